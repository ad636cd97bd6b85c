//! The systemd actuator (docs/behaviour.md, "Actuators"), the default: a level's k3s flags live in one k3s
//! config drop-in; a change of flags restarts `k3s.service` over systemd's D-Bus API;
//! an `ExecStartPre` hook (`regrade record-start`) records the level k3s started at.
//!
//! Start-up reconciliation (`watch`): when the drop-in and the record disagree — the
//! daemon died between writing the drop-in and restarting k3s, or someone changed the
//! file — the running k3s wins. regrade rewrites (or removes) the drop-in to match the
//! level on record, without restarting k3s: the record is what k3s runs with now, what
//! the Node's marks were set for, and a restart at start-up would run without the
//! Lease and peer check every step takes. If pressure persists, the next step is taken
//! normally. Without a record (k3s not started through the hook since boot) nothing is
//! converged: k3s will start with the drop-in and record it.

mod dbus;
pub mod dropin;
pub mod k3s_flags;
pub mod protections;
pub mod record;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{anyhow, bail, Context};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::etcd_health::HealthUrl;
use super::restart::{self, Purpose};
use super::{Actuator, NodeReadiness};
use crate::kill_point;
use crate::level::Level;
use crate::level_record::LevelRecord;
use crate::levels::LevelsConfig;
use crate::units::{format_duration, HumanDuration};

pub use dropin::Dropin;

/// How often a restart's progress (unit state, etcd health) is looked at.
const POLL: Duration = Duration::from_millis(250);

/// `[systemd]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SystemdConfig {
    /// The k3s unit restarted when a level changes k3s's flags.
    pub unit: String,
    /// The k3s config drop-in regrade owns. k3s reads `config.yaml.d/*.yaml` after
    /// `config.yaml`; the file is removed at `full`.
    pub dropin: PathBuf,
    /// Where `regrade record-start` records the level k3s was started at (tmpfs).
    pub record: PathBuf,
    /// etcd's health endpoint, which k3s serves without TLS.
    pub etcd_health_url: String,
    /// How long a restart may take until etcd is healthy before it is undone.
    pub health_timeout: HumanDuration,
    /// How long, after etcd is healthy, the Node may take to be Ready on a heartbeat
    /// newer than the restart (levels that run the agent) before the restart is undone.
    pub ready_timeout: HumanDuration,
    /// The bound on connecting to the system bus and on each D-Bus call to systemd.
    pub call_timeout: HumanDuration,
}

impl Default for SystemdConfig {
    fn default() -> Self {
        SystemdConfig {
            unit: "k3s.service".into(),
            dropin: PathBuf::from("/etc/rancher/k3s/config.yaml.d/50-regrade.yaml"),
            record: PathBuf::from("/run/regrade/started-level"),
            etcd_health_url: "http://127.0.0.1:2381/health".into(),
            health_timeout: HumanDuration(Duration::from_secs(300)),
            ready_timeout: HumanDuration(Duration::from_secs(300)),
            call_timeout: HumanDuration(Duration::from_secs(10)),
        }
    }
}

impl SystemdConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.unit.ends_with(".service") {
            bail!("systemd.unit = {:?} must name a .service unit", self.unit);
        }
        if !self.dropin.file_name().is_some_and(|n| dropin::is_k3s_config_name(&n.to_string_lossy())) {
            bail!(
                "systemd.dropin = {:?} must end in .yaml or .yml (k3s reads only config.yaml.d/*.yaml and *.yml)",
                self.dropin
            );
        }
        if self.health_timeout.0.is_zero() {
            bail!("systemd.health_timeout must be more than 0");
        }
        if self.ready_timeout.0.is_zero() {
            bail!("systemd.ready_timeout must be more than 0");
        }
        if self.call_timeout.0.is_zero() {
            bail!("systemd.call_timeout must be more than 0");
        }
        HealthUrl::parse("systemd.etcd_health_url", &self.etcd_health_url)?;
        Ok(())
    }
}

pub struct SystemdActuator {
    cfg: SystemdConfig,
    levels: LevelsConfig,
    health: HealthUrl,
}

impl SystemdActuator {
    pub fn new(cfg: &SystemdConfig, levels: &LevelsConfig) -> anyhow::Result<SystemdActuator> {
        Ok(SystemdActuator {
            cfg: cfg.clone(),
            levels: levels.clone(),
            health: HealthUrl::parse("systemd.etcd_health_url", &cfg.etcd_health_url)?,
        })
    }

    /// What the drop-in path holds, read now.
    pub fn dropin(&self) -> anyhow::Result<Dropin> {
        dropin::read(&self.cfg.dropin, &self.levels)
    }

    fn dropin_for(&self, level: Level) -> Option<String> {
        dropin::render(&self.levels, level)
    }

    /// Reaches systemd and reads the unit's state, before anything is changed: a bus
    /// that does not answer refuses the step with the drop-in untouched.
    async fn connect(&self) -> anyhow::Result<(dbus::Systemd, dbus::UnitState)> {
        let systemd = dbus::Systemd::connect(&self.cfg.unit, self.cfg.call_timeout.0).await?;
        let before = systemd.state().await?;
        Ok((systemd, before))
    }

    /// Refuses a restart whose flags k3s would not run with: k3s's configuration, read
    /// as k3s reads it with regrade's drop-in at each level, overrides a level's flags
    /// (a file read after regrade's, the unit's command line), or does not read
    /// regrade's drop-in at all. Every level, not only the step's: `check-config` and
    /// `watch`'s start ask the same.
    async fn check_overrides(&self, systemd: &dbus::Systemd) -> anyhow::Result<()> {
        let inv = systemd.invocation().await.unwrap_or_else(|e| {
            // Not every unit is a plain service with a readable ExecStart: the files
            // are still checked.
            tracing::debug!(error = %format!("{e:#}"), "could not read how systemd starts k3s");
            Default::default()
        });
        k3s_flags::check_levels(&self.cfg.dropin, &self.levels, &inv)
    }

    /// The restart request as [`restart::send`] sends it: RestartUnit on a bus
    /// reached already, its reply waited for within `dbus::restart_timeout`.
    fn request<'a>(&self, purpose: Purpose, level: Level, write: restart::Write<'a>) -> restart::Request<'a> {
        restart::Request {
            purpose,
            what: format!("{} into level {level}", self.cfg.unit),
            timeout: dbus::restart_timeout(self.cfg.call_timeout.0),
            write: Some(write),
        }
    }

    /// After RestartUnit was asked for: waits until a new process runs, etcd is
    /// healthy and, where `level` runs the agent, the Node is Ready on a heartbeat
    /// newer than the restart. Never waits on the restart job itself.
    async fn follow(
        &self,
        systemd: &dbus::Systemd,
        before: dbus::UnitState,
        level: Level,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let unit = &self.cfg.unit;
        let timeout = self.cfg.health_timeout.0;
        let deadline = Instant::now() + timeout;
        kill_point::reached("after-restart-request");
        // The step's own share ends here: from the decision ("stepping") through "drop-in
        // written" to this line, regrade works; after it, k3s and etcd do.
        tracing::info!(
            unit = %unit,
            level = %level,
            "restart requested; waiting for a new process and etcd's health"
        );
        // The new run's InvocationID and when it was first seen. The readiness wait
        // counts from then, not from RestartUnit: the old kubelet renews its node Lease
        // while k3s stops (and Ready stays True for ~40 s), so a heartbeat newer than
        // RestartUnit can be the old process's. The new InvocationID appears only once
        // the old process is gone.
        let mut started: Option<(Vec<u8>, SystemTime)> = None;
        let mut last_answer = String::from("none yet");
        let since = loop {
            let state = systemd.state().await?;
            if started.is_none() && !state.invocation.is_empty() && state.invocation != before.invocation {
                started = Some((state.invocation.clone(), SystemTime::now()));
                kill_point::reached("health-wait");
            }
            if let Some((invocation, since)) = &started {
                if state.start_failed() || state.invocation != *invocation {
                    bail!("{unit} failed to start at level {level} ({state}, Result={})", systemd.result().await);
                }
                match self.health.check().await {
                    Ok(()) => break *since,
                    Err(e) => last_answer = format!("{e:#}"),
                }
            }
            if Instant::now() >= deadline {
                match started {
                    None => bail!(
                        "{unit} did not start a new process within systemd.health_timeout = {} of RestartUnit ({state})",
                        format_duration(timeout)
                    ),
                    Some(_) => bail!(
                        "etcd at {} was not healthy within systemd.health_timeout = {} of restarting {unit} at level \
                         {level} (last answer: {last_answer})",
                        self.health,
                        format_duration(timeout)
                    ),
                }
            }
            tokio::time::sleep(POLL).await;
        };
        tracing::info!(unit = %unit, level = %level, url = %self.health, "etcd is healthy after the restart");
        self.serving(level, since, readiness).await
    }

    /// After etcd is healthy at `level`: the start record settled, and, where the
    /// agent runs, the Node Ready on a heartbeat newer than `since`.
    async fn serving(&self, level: Level, since: SystemTime, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        let unit = &self.cfg.unit;
        self.settle_record(level)?;
        if self.levels.runs_agent(level) {
            let ready = self.cfg.ready_timeout.0;
            readiness.wait_ready_since(since, ready).await.with_context(|| {
                format!(
                    "the Node was not Ready on a heartbeat newer than the restart of {unit} within \
                     systemd.ready_timeout = {}",
                    format_duration(ready)
                )
            })?;
            tracing::info!(unit = %unit, level = %level, "the Node is Ready on a heartbeat newer than the restart");
        }
        Ok(())
    }

    /// After k3s started at `level`: the hook recorded the level its drop-in names,
    /// which for levels with equal flags (`full`, `control-plane`) may be the other
    /// one. k3s runs with `level`'s flags either way; the record says `level`, so
    /// `current_level()` returns where the step went.
    ///
    /// k3s serves already, so a record that cannot be read or written is logged, not
    /// a failure: undoing a restart that went well would cost a second etcd restart,
    /// and the level record holds the level. Only a k3s started with another level's
    /// flags fails the step.
    fn settle_record(&self, level: Level) -> anyhow::Result<()> {
        let recorded = record::read(&self.cfg.record).unwrap_or_else(|e| {
            tracing::error!(error = %format!("{e:#}"), "could not read the start record after a healthy restart");
            Some(level)
        });
        match recorded {
            Some(r) if r == level => return Ok(()),
            Some(r) if self.levels.needs_restart(r, level) => bail!(
                "{} started at level {r} according to {} where {level} was expected: its drop-in {} was changed \
                 meanwhile",
                self.cfg.unit,
                self.cfg.record.display(),
                self.cfg.dropin.display()
            ),
            Some(_) => {}
            None => tracing::warn!(
                record = %self.cfg.record.display(),
                "k3s started without recording its level: is the ExecStartPre hook (regrade record-start) installed?"
            ),
        }
        if let Err(e) = record::write(&self.cfg.record, level) {
            tracing::error!(error = %format!("{e:#}"), level = %level, "could not write the start record; k3s serves");
        }
        Ok(())
    }

    /// Writes `level`'s drop-in and restarts k3s into it ([`restart::send`]); on
    /// failure puts `previous` back and restarts into `from`. The bus is reached and
    /// the unit's state read before the restart is allowed: what takes long comes
    /// before the look.
    async fn write_and_restart(
        &self,
        from: Level,
        level: Level,
        previous: Option<Vec<u8>>,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        let unchanged = || format!("stepping k3s from {from} to {level}: nothing was changed");
        let (systemd, before) = self.connect().await.with_context(unchanged)?;
        self.check_overrides(&systemd).await.with_context(unchanged)?;
        let (path, content) = (&self.cfg.dropin, self.dropin_for(level));
        let written = std::cell::Cell::new(false);
        let write = restart::write(|| {
            // A failed write leaves the old file whole (see dropin::put): nothing to undo.
            dropin::put(path, content.as_deref().map(str::as_bytes))?;
            written.set(true);
            tracing::info!(dropin = %path.display(), from = %from, to = %level, "drop-in written; requesting the restart of k3s");
            Ok(())
        });
        let sent = restart::send(readiness, self.request(Purpose::Forward, level, write), systemd.restart()).await;
        if let Err(e) = sent {
            // Not restarted (not allowed, not sent before the Lease's bound, or refused
            // by systemd): the file goes back, k3s runs `from` as before.
            if !written.get() {
                return Err(e.context(unchanged()));
            }
            let back = dropin::put(path, previous.as_deref()).map_or_else(
                |p| format!("putting the previous drop-in back failed too ({p:#}): k3s will start with the new one"),
                |()| "the previous drop-in was put back".to_string(),
            );
            return Err(e.context(format!("stepping k3s from {from} to {level}: k3s was not restarted; {back}")));
        }
        match self.follow(&systemd, before, level, readiness).await {
            Ok(()) => Ok(()),
            Err(failure) => self.undo(from, level, previous.as_deref(), failure, readiness).await,
        }
    }

    /// The restart into `to` failed: puts `from`'s drop-in (`previous`) back and
    /// restarts into it, if a restart is allowed now; the error says what was done.
    async fn undo(
        &self,
        from: Level,
        to: Level,
        previous: Option<&[u8]>,
        failure: anyhow::Error,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<()> {
        tracing::error!(error = %format!("{failure:#}"), from = %from, to = %to, "step failed; restoring");
        let failed = format!("stepping k3s from {from} to {to} failed: {failure:#}");
        let restored = self
            .restore(previous, from, readiness)
            .await
            .map_err(|e| super::undo_pending(readiness, e, &failed, from))?;
        Err(anyhow!("{failed}; {restored}"))
    }

    /// Puts the drop-in back as it was and restarts into `level` ([`restart::send`],
    /// [`Purpose::Back`]); says what it did. `Err`: nothing was restarted (systemd not
    /// reached, the restart not allowed or not sent, the file not written).
    async fn restore(
        &self,
        previous: Option<&[u8]>,
        level: Level,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<String> {
        let path = &self.cfg.dropin;
        let what = match previous {
            Some(_) => format!("put the previous drop-in {} back", path.display()),
            None => format!("removed the drop-in {} again", path.display()),
        };
        let (systemd, before) = self.connect().await.context("reaching systemd to restart k3s back")?;
        let write = restart::write(|| dropin::put(path, previous));
        restart::send(readiness, self.request(Purpose::Back, level, write), systemd.restart()).await?;
        Ok(match self.follow(&systemd, before, level, readiness).await {
            Ok(()) => format!("{what} and restarted {} at level {level}, which serves again", self.cfg.unit),
            Err(e) => format!("{what} and restarted {} at level {level}, but that failed too: {e:#}", self.cfg.unit),
        })
    }
}

#[async_trait(?Send)]
impl Actuator for SystemdActuator {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }

    /// The level on record (written by `regrade record-start` when k3s started, or by
    /// a step that needed no restart); no record = `full`.
    async fn current_level(&self) -> anyhow::Result<Level> {
        Ok(record::read(&self.cfg.record)?.unwrap_or(Level::Full))
    }

    async fn apply_level(&mut self, level: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        let from = self.current_level().await?;
        if from == level {
            return Ok(());
        }
        if !self.levels.needs_restart(from, level) {
            // Same flags: the running k3s is already at `level`; only the record moves.
            // The drop-in stays as it is (its flags are the same).
            return record::write(&self.cfg.record, level);
        }
        let previous = dropin::snapshot(&self.cfg.dropin)?;
        self.write_and_restart(from, level, previous, readiness).await
    }

    async fn observe(&self) -> anyhow::Result<(Option<Level>, Option<Level>)> {
        let file = match self.dropin()? {
            Dropin::Absent => Some(Level::Full),
            Dropin::Level(l) => Some(l),
            Dropin::Edited { .. } => None,
        };
        Ok((file, record::read(&self.cfg.record)?))
    }

    /// The drop-in for `level`, and the start record too where k3s runs `level`'s
    /// flags already (so `current_level()` says `level`, e.g. control-plane rather
    /// than full after a reboot).
    async fn rewrite(&mut self, level: Level) -> anyhow::Result<()> {
        dropin::put(&self.cfg.dropin, self.dropin_for(level).as_deref().map(str::as_bytes))?;
        match record::read(&self.cfg.record)? {
            Some(r) if r != level && !self.levels.needs_restart(r, level) => record::write(&self.cfg.record, level),
            _ => Ok(()),
        }
    }

    async fn roll_back(
        &mut self,
        from: Level,
        restarted: bool,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<String> {
        let (path, unit) = (self.cfg.dropin.display().to_string(), self.cfg.unit.clone());
        if !restarted {
            self.rewrite(from).await.with_context(|| format!("putting the drop-in {path} of level {from} back"))?;
            return Ok(format!("put the drop-in {path} of level {from} back; {unit} was not restarted"));
        }
        // The bus reached before the restart is allowed (the unit's state is not read:
        // a wedged systemd would not answer); the drop-in written inside the request's
        // bound; the restart not waited on, only seen begun (below).
        let systemd = dbus::Systemd::connect(&unit, self.cfg.call_timeout.0)
            .await
            .with_context(|| format!("reaching systemd to restart {unit} back into level {from}"))?;
        let (dropin, content) = (&self.cfg.dropin, self.dropin_for(from));
        let write = restart::write(|| dropin::put(dropin, content.as_deref().map(str::as_bytes)));
        restart::send(readiness, self.request(Purpose::Back, from, write), systemd.restart())
            .await
            .with_context(|| format!("putting the drop-in {path} of level {from} back and restarting {unit}"))?;
        // systemd runs the job it queued when it gets to it, which under pressure may
        // be seconds later: until then this member is up, and another server's gate
        // would let its own restart through once the Lease is released. The Lease is
        // held (the step's) until the unit is seen leaving `active` (stopping or
        // starting), within a call's bound; a restart quicker than the polls, or a
        // wedged systemd, ends the wait at that bound.
        let begun = async {
            loop {
                match systemd.state().await {
                    Ok(s) if s.active != "active" => return,
                    _ => tokio::time::sleep(POLL).await,
                }
            }
        };
        if tokio::time::timeout(self.cfg.call_timeout.0, begun).await.is_err() {
            tracing::warn!(unit = %unit, "the restart back was asked for but not seen begun within systemd.call_timeout");
        }
        Ok(format!("put the drop-in {path} of level {from} back and asked systemd to restart {unit} into it"))
    }

    /// k3s already started with `to`'s flags (the restart was asked for before the
    /// kill): wait for it to serve, with a heartbeat newer than now. Otherwise the
    /// drop-in for `to` is written and k3s restarted, as a step does. Either way a
    /// failure puts `from`'s drop-in back and restarts into it.
    async fn resume(&mut self, from: Level, to: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        if !self.levels.needs_restart(from, to) {
            return record::write(&self.cfg.record, to);
        }
        let previous = self.dropin_for(from).map(String::into_bytes);
        let started = record::read(&self.cfg.record)?;
        if started.is_none_or(|s| self.levels.needs_restart(s, to)) {
            tracing::info!(from = %from, to = %to, "k3s was not restarted with the level's flags yet: restarting it");
            return self.write_and_restart(from, to, previous, readiness).await;
        }
        // k3s runs `to`: the drop-in says so too (a reversed resume may find the new
        // level's drop-in still there).
        if !matches!(self.dropin(), Ok(d) if d.level().is_some_and(|l| !self.levels.needs_restart(l, to))) {
            dropin::put(&self.cfg.dropin, self.dropin_for(to).as_deref().map(str::as_bytes))?;
        }
        let deadline = Instant::now() + self.cfg.health_timeout.0;
        let waited = async {
            let since = SystemTime::now();
            while let Err(e) = self.health.check().await {
                if Instant::now() >= deadline {
                    bail!(
                        "etcd at {} was not healthy within systemd.health_timeout = {} of resuming the step to {to}                          (last answer: {e:#})",
                        self.health,
                        format_duration(self.cfg.health_timeout.0)
                    );
                }
                tokio::time::sleep(POLL).await;
            }
            tracing::info!(level = %to, url = %self.health, "etcd is healthy at the level of the interrupted step");
            self.serving(to, since, readiness).await
        };
        match waited.await {
            Ok(()) => Ok(()),
            Err(failure) => self.undo(from, to, previous.as_deref(), failure, readiness).await,
        }
    }

    async fn disagreement(&self) -> Option<String> {
        let (path, rec) = (self.cfg.dropin.display(), self.cfg.record.display());
        let recorded = match record::read(&self.cfg.record) {
            Ok(Some(l)) => l,
            Ok(None) => return None,
            Err(e) => return Some(format!("{e:#}")),
        };
        match self.dropin() {
            Err(e) => Some(format!("{e:#}")),
            Ok(Dropin::Edited { claimed }) => Some(format!(
                "{path} was changed outside regrade (it is not what regrade writes for {}); k3s was started at level \
                 {recorded} ({rec})",
                claimed.map_or("any level".to_string(), |l| format!("level {l}"))
            )),
            Ok(d) => {
                let file_level = d.level().unwrap_or(Level::Full);
                self.levels.needs_restart(file_level, recorded).then(|| {
                    format!(
                        "{path} holds the flags of level {file_level} but k3s ({}) runs at level {recorded} ({rec}): \
                         regrade stopped between writing the drop-in and restarting k3s, or the file was changed",
                        self.cfg.unit
                    )
                })
            }
        }
    }

    /// Converges on the running k3s: rewrites the drop-in for the recorded level (see
    /// the module's documentation for why), without a restart.
    async fn reconcile(&mut self, _readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        let Some(d) = self.disagreement().await else { return Ok(()) };
        let recorded = self.current_level().await?;
        dropin::put(&self.cfg.dropin, self.dropin_for(recorded).as_deref().map(str::as_bytes))?;
        tracing::warn!(
            disagreement = %d,
            level = %recorded,
            dropin = %self.cfg.dropin.display(),
            "converged on the level k3s runs at: rewrote the drop-in for it; k3s was not restarted"
        );
        Ok(())
    }
}

/// `regrade record-start`, the `ExecStartPre` hook of k3s.service: records the level
/// k3s is being started at, read from the flags k3s will run with (its configuration
/// as k3s builds it: the config file, its drop-ins, the unit's command line). It never
/// fails the start: an unreadable configuration is recorded as the level the drop-in
/// names (`full` without one), and a record it cannot write is logged.
pub fn record_start(
    sd: &SystemdConfig,
    levels: &LevelsConfig,
    level_record: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let path = sd.dropin.display();
    let claimed = match dropin::read(&sd.dropin, levels) {
        Ok(Dropin::Edited { claimed: Some(l) }) => {
            tracing::warn!(dropin = %path, level = %l, "the drop-in was edited by hand; it names level {l}");
            Some(l)
        }
        Ok(Dropin::Edited { claimed: None }) => {
            tracing::warn!(dropin = %path, "the drop-in names no regrade level");
            None
        }
        Ok(d) => d.level(),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "could not read the drop-in; recording full");
            None
        }
    };
    let started = match k3s_flags::effective(&sd.dropin, levels, &hook_invocation(sd), None) {
        Ok(eff) => {
            let (level, overridden) = crate::k3s_config::levels::started_level(levels, &eff, Some(&sd.dropin), claimed);
            if !overridden.is_empty() {
                let why: Vec<String> = overridden.iter().map(|o| o.to_string()).collect();
                tracing::error!(
                    level = %level,
                    "k3s starts with the flags of no regrade level: {}; recording the nearest",
                    why.join("; ")
                );
            } else if claimed.is_some_and(|c| levels.needs_restart(c, level)) {
                tracing::warn!(dropin = %path, level = %level, "k3s starts at another level than the drop-in names");
            }
            level
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "could not read k3s's configuration; recording the drop-in's level");
            claimed.unwrap_or(Level::Full)
        }
    };
    // The level regrade holds the server at, if k3s starts with its flags: after a
    // reboot at control-plane the drop-in is absent (full's flags) and /run is empty,
    // but the level record on disk says control-plane. During a step, its `to` or
    // `from`, whichever k3s starts with.
    let held = match LevelRecord::read(level_record) {
        Ok(Some(r)) => {
            let candidates = [Some(r.level), r.step.as_ref().map(|s| s.to), r.step.as_ref().map(|s| s.from)];
            candidates.into_iter().flatten().find(|l| !levels.needs_restart(*l, started))
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the level record; recording the drop-in's level");
            None
        }
    };
    // Else a level with the same flags as the one on record (e.g. control-plane,
    // reached without a restart) survives a restart of k3s: k3s runs the same either way.
    let level = match (held, record::read(&sd.record)) {
        (Some(l), _) => l,
        (None, Ok(Some(prev))) if !levels.needs_restart(prev, started) => prev,
        _ => started,
    };
    match record::write(&sd.record, level) {
        Ok(()) => tracing::info!(level = %level, record = %sd.record.display(), "recorded the level k3s starts at"),
        Err(e) => tracing::error!(error = %format!("{e:#}"), "could not record the level k3s starts at"),
    }
    Ok(ExitCode::SUCCESS)
}

/// How k3s is being started, seen from its `ExecStartPre` hook: the environment is the
/// unit's own (systemd gives the hook the same), the command line systemd's word,
/// asked briefly (a bus that does not answer delays k3s's start by at most 2 s in all;
/// without it the files alone are read).
fn hook_invocation(sd: &SystemdConfig) -> crate::k3s_config::Invocation {
    let bound = sd.call_timeout.0.min(Duration::from_secs(2));
    let ask = async {
        let systemd = dbus::Systemd::connect(&sd.unit, bound).await.ok()?;
        systemd.exec_start().await.ok()?.into_iter().next()
    };
    let bounded = async { tokio::time::timeout(bound, ask).await.ok().flatten() };
    let argv = crate::runtime::runtime().ok().and_then(|rt| rt.block_on(bounded));
    crate::k3s_config::Invocation { argv, env: std::env::vars().collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::level_record::Phase;

    fn actuator(record: &std::path::Path) -> SystemdActuator {
        let cfg = SystemdConfig { record: record.to_path_buf(), ..SystemdConfig::default() };
        SystemdActuator::new(&cfg, &LevelsConfig::default()).unwrap()
    }

    /// Was: a start record that could not be written after k3s came up healthy failed
    /// the step, which then restored (a needless second etcd restart).
    #[test]
    fn a_start_record_that_cannot_be_kept_does_not_fail_a_healthy_restart() {
        let dir = tempfile::tempdir().unwrap();
        // A directory where the record should be: it can be neither read nor written.
        let record = dir.path().join("started-level");
        std::fs::create_dir(&record).unwrap();
        assert!(actuator(&record).settle_record(Level::ControlPlane).is_ok());
    }

    /// Was (issue 38, finding 2): the undoing of a failed restart put the old drop-in
    /// back and restarted k3s without asking anything, though etcd may have come back
    /// healthy (only the Node was not Ready) while a peer's member died: a second
    /// voter down. Now it goes through `restart::send` like every restart (whose own
    /// tests show the refusal): here, whether the bus is not there (this machine) or
    /// the gate refuses (a machine with a system bus), nothing is touched and the
    /// error is the undoing left pending, recorded at `restoring`.
    #[test]
    fn the_undoing_of_a_failed_restart_is_asked_for_like_any_restart() {
        struct Refusing(std::cell::Cell<Vec<Phase>>);
        #[async_trait(?Send)]
        impl NodeReadiness for Refusing {
            async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
                Ok(())
            }
            async fn may_restart(&self) -> anyhow::Result<()> {
                anyhow::bail!("etcd member server3-1a2b3c4d (Node server3): unreachable")
            }
            fn progress(&self, phase: Phase) {
                let mut seen = self.0.take();
                seen.push(phase);
                self.0.set(seen);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let cfg = SystemdConfig {
            record: dir.path().join("started-level"),
            dropin: dir.path().join("50-regrade.yaml"),
            // Nothing listens: a restart asked for would fail loudly, not hang.
            call_timeout: HumanDuration(Duration::from_millis(100)),
            ..SystemdConfig::default()
        };
        let a = SystemdActuator::new(&cfg, &LevelsConfig::default()).unwrap();
        let to = a.dropin_for(Level::EtcdOnly).unwrap();
        std::fs::write(&cfg.dropin, &to).unwrap();
        let readiness = Refusing(Default::default());
        let failure = anyhow!("the Node was not Ready on a heartbeat newer than the restart");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let e = rt.block_on(a.undo(Level::ControlPlane, Level::EtcdOnly, None, failure, &readiness)).unwrap_err();
        let pending = e.downcast_ref::<super::super::UndoPending>().expect("the undoing is left pending");
        assert!(pending.0.contains("not restarted back into control-plane"), "{pending}");
        assert_eq!(std::fs::read_to_string(&cfg.dropin).unwrap(), to, "the drop-in of etcd-only is left as it is");
        assert_eq!(readiness.0.take()[0], Phase::Restoring, "recorded before it was asked");
    }

    #[test]
    fn a_k3s_started_with_other_flags_fails_the_step() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("started-level");
        std::fs::write(&record, "etcd-only\n").unwrap();
        let e = actuator(&record).settle_record(Level::ControlPlane).unwrap_err();
        assert!(format!("{e:#}").contains("started at level etcd-only"), "{e:#}");
        std::fs::write(&record, "full\n").unwrap();
        actuator(&record).settle_record(Level::ControlPlane).unwrap();
        assert_eq!(std::fs::read_to_string(&record).unwrap(), "control-plane\n", "same flags: the record says where");
    }
}
