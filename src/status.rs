//! `status [--json]`: the level, the pressure now, what `watch` has seen (streaks, last
//! step, last refusal), when the next step could happen, and what would refuse it.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::backend;
use crate::cluster::drain::{self, PublishedDrain};
use crate::config::Config;
use crate::decide::{Reading, Step, StepUp};
use crate::level::Level;
use crate::level_record::{converge, LevelRecord, Marks, Observed};
use crate::pressure::Sampler;
use crate::runtime::runtime;
use crate::sample::Psi;
use crate::statefile::{self, LastStep, Published, PublishedRefusal};

#[derive(Debug, Serialize)]
pub struct Status {
    pub level: Level,
    pub metric: &'static str,
    pub pressure: f64,
    pub threshold: f64,
    pub calm_threshold: f64,
    pub mem_available: u64,
    pub mem_available_floor: Option<u64>,
    /// The PSI file read (`pressure.source`, or a cgroup v2's `memory.pressure`).
    pub psi_source: String,
    /// Where `mem_available` comes from: MemAvailable, or `pressure.memory_cgroup`.
    pub memory_source: String,
    /// `pressure.memory_cgroup` is set: `mem_available` is that cgroup's.
    pub memory_cgroup: bool,
    pub reading: Reading,
    /// The six averages by name (`some_avg10` ... `full_avg300`).
    pub psi: Psi,
    pub step_up: StepUp,
    /// Whether a `watch` is running and has published its state.
    pub watch_running: bool,
    /// How that `watch` waits: `trigger` (asleep on the PSI trigger) or `polling`.
    pub pacing: Option<crate::sample::Pacing>,
    /// The armed trigger, or why there is none.
    pub trigger: Option<String>,
    pub over_since: Option<f64>,
    pub calm_since: Option<f64>,
    pub last_step: Option<LastStep>,
    pub next_step: Option<NextStep>,
    /// The refusal `watch` last met, if its step is still refused.
    pub refusal: Option<PublishedRefusal>,
    /// What the cluster would refuse the next step for, asked now (read only).
    pub would_refuse: Option<String>,
    /// k3s's start record and the actuator's file disagree (`watch` converges at start).
    pub disagreement: Option<String>,
    /// The API server rejected regrade's token (401), since when and how
    /// (`<kubeconfig>.rejected`, until `regrade credential` mints a new one).
    pub credential_rejected: Option<crate::cluster::rejected::RejectedNote>,
    /// The level record (docs/level-record.md), or why it could not be read.
    pub record: Option<crate::level_record::LevelRecord>,
    pub record_error: Option<String>,
    /// What the Node's marks say, read now; `None`: the Node could not be read.
    pub node_marks: Option<Level>,
    /// What regrade will do about the record and the world (the decision `watch`
    /// and `step` take when they meet it).
    pub will_do: String,
    /// The etcd members as regrade sees them (the etcd gate's view, asked now).
    pub etcd: EtcdStatus,
    /// The last drain on this server, as its process published it.
    pub drain: Option<DrainStatus>,
    /// The local etcd member's own view (`etcd.metrics_url`): `watch`'s last look if it
    /// is recent (`watch` looks only while pressed), else one look now (health only: a
    /// p99 needs two looks).
    pub etcd_member: Option<crate::etcd::member::MemberView>,
    /// Which static protections of k3s are in place on this host.
    pub protections: Vec<crate::actuator::systemd::protections::Finding>,
    /// Whose memory it is: `census.slice`'s children now, largest first, growth judged
    /// against `watch`'s last census or, with none, a reading a second before.
    pub units: Option<crate::census::Census>,
    /// Why they could not be read (cgroup v1, no such slice).
    pub units_error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct DrainStatus {
    #[serde(flatten)]
    pub published: PublishedDrain,
    /// Says running, but the process that ran it is gone (killed mid-drain).
    pub writer_gone: bool,
}

#[derive(Debug, Default, Serialize)]
pub struct EtcdStatus {
    pub members: Vec<MemberStatus>,
    /// Why etcd could not be asked.
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct MemberStatus {
    /// etcd's member name (`<node>-<8 hex>`); empty for a member not started yet.
    pub name: String,
    pub node: String,
    /// The member ID, hex, as `etcdctl member list` writes it.
    pub id: String,
    pub voter: bool,
    /// This server's own member.
    pub this: bool,
    /// `ok`, or why the gate would not count it healthy.
    pub health: String,
}

#[derive(Debug, Serialize)]
pub struct NextStep {
    pub action: &'static str,
    pub to: Level,
    /// Seconds since the Unix epoch.
    pub at: f64,
    pub in_seconds: f64,
}

pub fn run(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let mut sampler = Sampler::for_config(&cfg.pressure)?;
    let sample = sampler.sample()?;
    let (psi_source, memory_source) = (sampler.psi_path().display().to_string(), sampler.memory_source());
    let memory_cgroup = sampler.cgroup().is_some();
    let settings = cfg.core_settings();
    let published = Published::read_live(&cfg.state_file);
    let status = runtime()?.block_on(async {
        let (level, disagreement, observed) = match backend::actuator(cfg) {
            Ok(a) => (a.current_level().await, a.disagreement().await, a.observe().await.ok()),
            Err(e) => (Err(e), None, None),
        };
        let level = level.unwrap_or_else(|e| {
            tracing::warn!(error = %format!("{e:#}"), "could not read the level; assuming full");
            Level::Full
        });
        let (file, started) = observed.unwrap_or((None, None));
        let (record, record_error) = match LevelRecord::read(&cfg.level_record) {
            Ok(r) => (r, None),
            Err(e) => (None, Some(e.to_string())),
        };
        let node_marks = match backend::cluster(cfg).await {
            Ok(c) => c.node_level().await.ok().map(|l| l.unwrap_or(Level::Full)),
            Err(_) => None,
        };
        let keys = crate::level_keeper::keys(cfg);
        let same = |a: Level, b: Level| !cfg.levels.needs_restart(a, b);
        let marks = node_marks.map_or(Marks::Unknown, Marks::Level);
        let decision = converge(&Observed { record: record.as_ref(), file, started, marks, keys: &keys }, &same);
        // The level regrade holds the server at: the record's (a step under way has not
        // finished), else what k3s runs.
        let level = record.as_ref().map_or(level, |r| r.level);
        let now = statefile::unix(SystemTime::now());
        let state = published.as_ref().and_then(Published::state);
        let next_step = state.and_then(|s| {
            let (step, at) = s.next_step_at(&settings, &Level::ALL)?;
            let at = at.as_secs_f64();
            Some((step, NextStep { action: step.direction.action(), to: step.to, at, in_seconds: (at - now).max(0.0) }))
        });
        let gate = backend::etcd(cfg);
        let would_refuse = match &next_step {
            Some((step, _)) => match preflight(cfg, step).await {
                None if cfg.levels.needs_restart(step.from, step.to) => {
                    gate.before_restart().await.err().map(|r| r.to_string())
                }
                other => other,
            },
            None => None,
        };
        let etcd = match gate.members().await {
            Ok(ms) => EtcdStatus {
                members: ms
                    .into_iter()
                    .map(|m| MemberStatus {
                        name: m.member.name,
                        node: m.member.node,
                        id: format!("{:x}", m.member.id),
                        voter: m.voter,
                        this: m.this,
                        health: m.health.map_or_else(|r| r.to_string(), |()| "ok".into()),
                    })
                    .collect(),
                error: None,
            },
            Err(e) => EtcdStatus { members: Vec::new(), error: Some(format!("{e:#}")) },
        };
        // watch looks only while pressed: calm, its last look may be hours old.
        let max_age = cfg.etcd.member_look_max_age().as_secs_f64();
        let watchs = crate::etcd::member::read_live(&cfg.state_file).filter(|v| now - v.at <= max_age);
        let etcd_member = match (watchs, cfg.etcd.metrics_url()) {
            (Some(v), _) => Some(v),
            (None, Some(Ok(url))) => Some(crate::etcd::member::look(&url, cfg.etcd.request_timeout.0, None).await.0),
            (None, _) => None,
        };
        let protections = backend::protections(cfg).await;
        let (units, units_error) = match cfg.census.slice() {
            Some(slice) => match census_now(slice, &cfg.state_file).await {
                Ok(c) => (Some(c), None),
                Err(e) => (None, Some(format!("{e:#}"))),
            },
            None => (None, None),
        };
        Status {
            level,
            metric: settings.metric.as_str(),
            pressure: sample.metric(settings.metric),
            threshold: settings.threshold,
            calm_threshold: settings.calm_threshold,
            mem_available: sample.mem_available,
            mem_available_floor: settings.mem_available_floor,
            psi_source,
            memory_source,
            memory_cgroup,
            reading: settings.classify(&sample, &etcd_member.as_ref().map(|m| m.signals()).unwrap_or_default()),
            psi: sample.psi,
            step_up: settings.step_up,
            watch_running: published.is_some(),
            pacing: published.as_ref().and_then(|p| p.pacing),
            trigger: published.as_ref().and_then(|p| p.trigger.clone()),
            over_since: published.as_ref().and_then(|p| p.over_since),
            calm_since: published.as_ref().and_then(|p| p.calm_since),
            last_step: published.as_ref().and_then(|p| p.last_step.clone()),
            next_step: next_step.map(|(_, n)| n),
            refusal: published.as_ref().and_then(|p| p.refusal.clone()),
            would_refuse,
            disagreement,
            credential_rejected: crate::cluster::rejected::RejectedNote::read(
                cfg.cluster.kubeconfig.as_deref().unwrap_or(crate::cluster::DEFAULT_KUBECONFIG.as_ref()),
            ),
            record,
            record_error,
            node_marks,
            will_do: decision.describe(),
            etcd,
            drain: PublishedDrain::read(&drain::progress_path(&cfg.state_file))
                .map(|p| DrainStatus { writer_gone: p.running && !p.is_live(), published: p }),
            etcd_member,
            protections,
            units,
            units_error,
        }
    });
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{}", render(&status, statefile::unix(SystemTime::now())));
    }
    Ok(ExitCode::SUCCESS)
}

/// The host's units now, growth judged against `watch`'s last census (it reads them
/// only under pressure) or, with none, against a reading one second before.
async fn census_now(slice: &std::path::Path, state_file: &std::path::Path) -> anyhow::Result<crate::census::Census> {
    use crate::census::{self, Census};
    let earlier = match census::read_live(state_file) {
        Some(c) => c,
        None => {
            let c = Census::read(slice, SystemTime::now(), None)?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            c
        }
    };
    Census::read(slice, SystemTime::now(), Some(&earlier))
}

/// Asks the cluster, read only, what would refuse `step`. Unreachable: says so.
async fn preflight(cfg: &Config, step: &Step) -> Option<String> {
    match backend::cluster(cfg).await {
        Ok(c) => c.preflight(step).await.err().map(|r| r.to_string()),
        Err(e) => Some(format!("cluster not reachable: {e:#}")),
    }
}

/// The README's word (as in `--json`), never Rust's Debug name.
fn step_up_word(s: StepUp) -> &'static str {
    match s {
        StepUp::Automatic => "automatic",
        StepUp::Manual => "manual",
    }
}

fn ago(now: f64, t: f64) -> String {
    crate::units::format_duration(Duration::from_secs((now - t).max(0.0) as u64))
}

pub fn render(s: &Status, now: f64) -> String {
    let mut o = String::new();
    let floor = s.mem_available_floor.map_or("none".to_string(), |f| format!("{} MiB", f >> 20));
    o += &format!("level:          {}\n", s.level);
    o += &format!(
        "pressure:       {} {:.2}% (over at >= {}, calm below {})\n",
        s.metric, s.pressure, s.threshold, s.calm_threshold
    );
    let available = match s.mem_available {
        crate::pressure::MEM_AVAILABLE_UNKNOWN => "unknown (not in the file; no floor needs it)".to_string(),
        m => format!("{} MiB", m >> 20),
    };
    if s.memory_cgroup {
        o += &format!("available:      {available} (floor {floor}), of the memory cgroup\n");
    } else {
        o += &format!("MemAvailable:   {available} (floor {floor})\n");
    }
    o += &format!("read from:      PSI {}; {}\n", s.psi_source, s.memory_source);
    o += &format!("this sample:    {}\n", s.reading.as_str());
    o += &format!("step up:        {}\n", step_up_word(s.step_up));
    if !s.watch_running {
        o += "watch:          not running (no streaks to show)\n";
    } else {
        match (s.over_since, s.calm_since) {
            (Some(t), _) => o += &format!("streak:         over for {}\n", ago(now, t)),
            (_, Some(t)) => o += &format!("streak:         calm for {}\n", ago(now, t)),
            _ => o += "streak:         none\n",
        }
        match s.pacing {
            Some(crate::sample::Pacing::Trigger) => o += "watch waits:    asleep on the PSI trigger\n",
            Some(crate::sample::Pacing::Polling) => o += "watch waits:    sampling every sample_period\n",
            None => {}
        }
        if let Some(t) = &s.trigger {
            o += &format!("PSI trigger:    {t}\n");
        }
    }
    match &s.last_step {
        Some(l) => {
            o += &format!("last step:      {} {} -> {}, {} ago: {}\n", l.action, l.from, l.to, ago(now, l.at), l.result)
        }
        None => o += "last step:      none\n",
    }
    match &s.next_step {
        Some(n) if n.in_seconds > 0.0 => {
            o += &format!("next step:      {} to {} in {}s if the streak holds\n", n.action, n.to, n.in_seconds.ceil())
        }
        Some(n) => o += &format!("next step:      {} to {} due now\n", n.action, n.to),
        None => o += "next step:      none due\n",
    }
    if let Some(r) = &s.refusal {
        o += &format!("refused:        {} (since {} ago)\n", r.message, ago(now, r.since));
    }
    if let Some(w) = &s.would_refuse {
        o += &format!("would refuse:   {w}\n");
    }
    if let Some(d) = &s.disagreement {
        o += &format!("disagreement:   {d}\n");
    }
    if let Some(r) = &s.credential_rejected {
        o += &format!(
            "credential:     REJECTED by the API server (401) since {} ago, until `regrade credential` mints a new \
             token: {}\n",
            ago(now, r.since),
            r.error
        );
    }
    match (&s.record, &s.record_error) {
        (_, Some(e)) => o += &format!("level record:   {e}\n"),
        (Some(r), _) => {
            if let Some(st) = &r.step {
                o += &format!("step under way: {} -> {}, at {} (interrupted?)\n", st.from, st.to, st.phase);
            }
        }
        (None, None) => o += "level record:   none yet\n",
    }
    match s.node_marks {
        Some(m) if m != s.level => o += &format!("the Node says:  {m} (the record says {})\n", s.level),
        Some(_) => {}
        None => o += "the Node says:  (not readable now)\n",
    }
    o += &format!("will do:        {}\n", s.will_do);
    if let Some(d) = &s.drain {
        o += &drain_line(d, now);
    }
    if let Some(e) = &s.etcd.error {
        o += &format!("etcd:           not asked: {e}\n");
    }
    for (i, m) in s.etcd.members.iter().enumerate() {
        let head = if i == 0 { "etcd members:" } else { "" };
        let name =
            if m.name.is_empty() { format!("{} (not started)", m.id) } else { format!("{} (Node {})", m.name, m.node) };
        let role = match (m.voter, m.this) {
            (true, true) => "voter, this server",
            (true, false) => "voter",
            (false, true) => "learner, this server",
            (false, false) => "learner",
        };
        o += &format!("{head:<16}{name}, {role}: {}\n", m.health);
    }
    if let Some(m) = &s.etcd_member {
        o += &format!("this member:    {}\n", m.summary());
    }
    match (&s.units, &s.units_error) {
        (Some(c), _) => o += &format!("host memory:    {}\n", c.summary()),
        (None, Some(e)) => o += &format!("host memory:    not read: {e}\n"),
        (None, None) => {}
    }
    for (i, p) in s.protections.iter().enumerate() {
        let head = if i == 0 { "protections:" } else { "" };
        let state =
            if matches!(p.state, "missing" | "shadowed" | "lowered") { p.state.to_uppercase() } else { p.state.into() };
        o += &format!("{head:<16}{}: {state}: {}\n", p.protection, p.words);
    }
    o
}

/// The last drain: into which level, when, and what it did (blocked pods by budget).
fn drain_line(d: &DrainStatus, now: f64) -> String {
    let p = &d.published;
    let when = match (p.running, d.writer_gone) {
        (true, false) => format!("running for {}", ago(now, p.started)),
        (true, true) => format!("cut short {} ago (its process {} is gone)", ago(now, p.started), p.pid),
        (false, _) => format!("{} ago", ago(now, p.started)),
    };
    let report = p.report.to_string();
    let report = report.strip_prefix("drain: ").unwrap_or(&report);
    format!("drain:          into {}, {when}: {report}\n", p.level)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::drain::{BlockedPod, DrainReport};

    #[test]
    fn the_drain_line_names_what_is_blocked_and_whether_it_runs() {
        let report = DrainReport {
            evicted: vec!["apps/web-1".into()],
            waiting: vec!["apps/web-2".into()],
            blocked: vec![BlockedPod { pod: "apps/db-0".into(), pdb: Some("db-pdb".into()), message: None }],
            elapsed_ms: 4000,
            ..Default::default()
        };
        let published = PublishedDrain {
            pid: 0,
            node: "server1".into(),
            level: "control-plane".into(),
            started: 1000.0,
            running: true,
            report,
        };
        let d = DrainStatus { published: published.clone(), writer_gone: false };
        assert_eq!(
            drain_line(&d, 1012.0),
            "drain:          into control-plane, running for 12s: 1 evicted, 0 left alone (DaemonSet or mirror), \
             1 still terminating (apps/web-2), 1 blocked (apps/db-0 by PodDisruptionBudget db-pdb); 4.0s\n"
        );
        let gone = DrainStatus { published: published.clone(), writer_gone: true };
        assert!(drain_line(&gone, 1012.0).contains("cut short 12s ago (its process 0 is gone)"));
        let ended = DrainStatus { published: PublishedDrain { running: false, ..published }, writer_gone: false };
        assert!(drain_line(&ended, 1060.0).starts_with("drain:          into control-plane, 1m ago: 1 evicted"));
    }
}
