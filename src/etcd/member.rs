//! The local etcd member's own view of its distress, from its metrics listener (k3s's
//! embedded etcd serves it without TLS on `http://127.0.0.1:2381`; `--etcd-expose-metrics`
//! adds the node's address): `/health`, and from `/metrics` its WAL fsync and backend
//! commit durations (p99 over the last interval, from the histograms' bucket deltas),
//! heartbeat send failures, slow applies and leader changes.
//!
//! A [`Looker`] looks, each request bounded by `etcd.request_timeout`, and publishes
//! the result to [`MEMBER`] (for the step into `etcd-only`, the metrics) and to
//! `etcd-member.json` beside the state file (for `status`). In `watch` it runs in a
//! task of its own (`watch::looks`), every `etcd.metrics_interval` only while `watch`
//! is pressed, and when a scrape asks: nothing on the per-sample path waits for etcd,
//! and calm costs nothing. The parser keeps only the
//! handful of series it needs, in fixed arrays.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::actuator::etcd_health::HealthUrl;
use crate::decide::MemberSignals;

/// Histogram buckets kept per family; etcd's disk histograms have 14 and `+Inf`.
const MAX_BUCKETS: usize = 24;
/// etcd's `/metrics` is a few hundred KiB; more than this is not etcd's.
const MAX_BODY: u64 = 8 << 20;

const WAL_FSYNC: &str = "etcd_disk_wal_fsync_duration_seconds_bucket";
const BACKEND_COMMIT: &str = "etcd_disk_backend_commit_duration_seconds_bucket";
const HEARTBEAT_FAILURES: &str = "etcd_server_heartbeat_send_failures_total";
const SLOW_APPLIES: &str = "etcd_server_slow_apply_total";
const LEADER_CHANGES: &str = "etcd_server_leader_changes_seen_total";
const HAS_LEADER: &str = "etcd_server_has_leader";
/// Every series read, for a test against a real etcd that each is still there.
pub const SERIES: [&str; 6] = [WAL_FSYNC, BACKEND_COMMIT, HEARTBEAT_FAILURES, SLOW_APPLIES, LEADER_CHANGES, HAS_LEADER];

/// A cumulative histogram: `(le, count)` ascending, the last `+Inf`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Histogram {
    buckets: [(f64, u64); MAX_BUCKETS],
    len: usize,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: [(0.0, 0); MAX_BUCKETS], len: 0 }
    }
}

impl Histogram {
    fn push(&mut self, le: f64, count: u64) {
        if self.len < MAX_BUCKETS {
            self.buckets[self.len] = (le, count);
            self.len += 1;
        }
    }

    fn buckets(&self) -> &[(f64, u64)] {
        &self.buckets[..self.len]
    }

    /// The 99th percentile of what was observed between `earlier` and `self`, in
    /// seconds, interpolated within its bucket as Prometheus's `histogram_quantile`
    /// does; `None` when nothing was observed. A count that went down (etcd restarted)
    /// counts from zero.
    pub fn p99_since(&self, earlier: Option<&Histogram>) -> Option<f64> {
        let now = self.buckets();
        let reset = earlier.is_none_or(|e| e.len != self.len || e.buckets().iter().zip(now).any(|(e, n)| n.1 < e.1));
        let delta = |i: usize| now[i].1 - if reset { 0 } else { earlier.map_or(0, |e| e.buckets[i].1) };
        let total = delta(now.len().checked_sub(1)?);
        if total == 0 {
            return None;
        }
        let rank = 0.99 * total as f64;
        let i = (0..now.len()).find(|&i| delta(i) as f64 >= rank)?;
        if now[i].0.is_infinite() {
            // Past the highest finite bound: that bound is all that is known.
            return Some(if i == 0 { 0.0 } else { now[i - 1].0 });
        }
        let (lower, below) = if i == 0 { (0.0, 0) } else { (now[i - 1].0, delta(i - 1)) };
        let in_bucket = (delta(i) - below) as f64;
        Some(lower + (now[i].0 - lower) * (rank - below as f64) / in_bucket)
    }
}

/// The series of one `/metrics` answer that regrade reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Scrape {
    pub wal_fsync: Histogram,
    pub backend_commit: Histogram,
    pub heartbeat_failures: u64,
    pub slow_applies: u64,
    pub leader_changes: u64,
    pub has_leader: Option<bool>,
}

/// Parses Prometheus text (format 0.0.4) for the series in [`Scrape`], ignoring every
/// other line. A counter with label sets is summed over them.
pub fn parse(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines() {
        if line.starts_with('#') || !line.starts_with("etcd_") {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let (name, rest) = line.split_at(name_end);
        let Some(value) = rest.rsplit(' ').find(|v| !v.is_empty()).and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        let count = if value.is_finite() && value > 0.0 { value as u64 } else { 0 };
        match name {
            WAL_FSYNC | BACKEND_COMMIT => {
                let Some(le) = label(rest, "le").and_then(|l| l.parse::<f64>().ok()) else { continue };
                let h = if name == WAL_FSYNC { &mut s.wal_fsync } else { &mut s.backend_commit };
                h.push(le, count);
            }
            HEARTBEAT_FAILURES => s.heartbeat_failures += count,
            SLOW_APPLIES => s.slow_applies += count,
            LEADER_CHANGES => s.leader_changes += count,
            HAS_LEADER => s.has_leader = Some(value >= 1.0),
            _ => {}
        }
    }
    s
}

/// The value of label `key` in a series' `{...}` (no escapes: etcd's `le` values have none).
fn label<'a>(series: &'a str, key: &str) -> Option<&'a str> {
    let inner = series.strip_prefix('{')?.split('}').next()?;
    inner.split(',').find_map(|kv| kv.trim().strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
}

/// What the last look showed, as `status` and the metrics show it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MemberView {
    /// The `watch` that looked (the file is void once it is gone).
    pub pid: u32,
    /// Unix seconds of the look.
    pub at: f64,
    /// The URL looked at.
    pub url: String,
    /// `Some(true)`: `/health` said true; `Some(false)`: it said false or did not answer
    /// within `etcd.request_timeout`; `None`: not known (nothing listens there).
    pub healthy: Option<bool>,
    /// `ok`, or what `/health` answered, or why it could not be asked.
    pub health: String,
    /// Seconds, over the interval since the look before; `None`: no fsync (commit) in
    /// it, or no look before.
    pub wal_fsync_p99: Option<f64>,
    pub backend_commit_p99: Option<f64>,
    /// In that interval.
    pub heartbeat_send_failures: u64,
    pub slow_applies: u64,
    pub leader_changes: u64,
    pub has_leader: Option<bool>,
    /// Why `/metrics` could not be read, if it could not.
    pub metrics_error: Option<String>,
}

impl MemberView {
    /// The core's view of it (`decide::weigh_etcd_only`).
    pub fn signals(&self) -> MemberSignals {
        let secs = |s: Option<f64>| s.map(Duration::from_secs_f64);
        MemberSignals {
            healthy: self.healthy,
            wal_fsync_p99: secs(self.wal_fsync_p99),
            backend_commit_p99: secs(self.backend_commit_p99),
        }
    }

    /// What the metrics take of it.
    pub fn metrics_look(&self) -> crate::metrics::EtcdMemberLook {
        crate::metrics::EtcdMemberLook {
            healthy: self.healthy,
            wal_fsync_p99: self.wal_fsync_p99,
            backend_commit_p99: self.backend_commit_p99,
            heartbeat_send_failures: self.heartbeat_send_failures,
            slow_applies: self.slow_applies,
            leader_changes: self.leader_changes,
        }
    }

    /// One line for `status`.
    pub fn summary(&self) -> String {
        if let (None, Some(e)) = (self.healthy, &self.metrics_error) {
            return format!("not reachable at {}: {e}", self.url);
        }
        let ms = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{:.0} ms", s * 1000.0));
        let health = match self.healthy {
            Some(true) => "healthy".to_string(),
            Some(false) => format!("NOT healthy ({})", self.health),
            None => format!("health unknown ({})", self.health),
        };
        let mut line = format!(
            "{health}; p99 WAL fsync {}, backend commit {}; {} heartbeat send failures, {} slow applies, {} leader changes in the last interval",
            ms(self.wal_fsync_p99),
            ms(self.backend_commit_p99),
            self.heartbeat_send_failures,
            self.slow_applies,
            self.leader_changes
        );
        if self.has_leader == Some(false) {
            line.push_str("; NO LEADER");
        }
        if let Some(e) = &self.metrics_error {
            line.push_str(&format!("; metrics unreadable: {e}"));
        }
        line
    }
}

/// The last look, for the step into `etcd-only` (with when it was taken, on tokio's
/// clock) and for the metrics. Written by [`Looker`] only.
pub static MEMBER: Mutex<Option<(tokio::time::Instant, MemberView)>> = Mutex::new(None);

/// The member's signals if the last look is younger than `max_age`; an older one is
/// not evidence of anything now.
pub fn fresh_signals(max_age: Duration) -> MemberSignals {
    let guard = MEMBER.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_ref() {
        Some((at, view)) if at.elapsed() <= max_age => view.signals(),
        _ => MemberSignals::default(),
    }
}

/// Where the last look is published for `status`: beside the state file.
pub fn path_for(state_file: &Path) -> PathBuf {
    state_file.with_file_name("etcd-member.json")
}

/// The published look, if the `watch` that wrote it still runs.
pub fn read_live(state_file: &Path) -> Option<MemberView> {
    let v: MemberView = serde_json::from_slice(&std::fs::read(path_for(state_file)).ok()?).ok()?;
    crate::statefile::alive(v.pid).then_some(v)
}

/// One look: `/health` and `/metrics` at `url`'s host and port, each within `timeout`.
/// `earlier` is the scrape of the look before (for the interval's deltas).
pub async fn look(url: &HealthUrl, timeout: Duration, earlier: Option<&Scrape>) -> (MemberView, Option<Scrape>) {
    let mut view = MemberView { pid: std::process::id(), url: url.to_string(), ..Default::default() };
    (view.healthy, view.health) = health(url, timeout).await;
    let scrape = match tokio::time::timeout(timeout, url.fetch(url.path(), MAX_BODY)).await {
        Err(_) => Err("no answer within etcd.request_timeout".to_string()),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Ok(Ok((status, _))) if status.split_whitespace().nth(1) != Some("200") => Err(format!("answered {status:?}")),
        Ok(Ok((_, body))) => Ok(parse(&String::from_utf8_lossy(&body))),
    };
    let scrape = match scrape {
        Ok(s) => s,
        Err(e) => {
            view.metrics_error = Some(e);
            return (view, None);
        }
    };
    let delta = |now: u64, then: Option<u64>| then.map_or(0, |t| now.saturating_sub(t));
    view.wal_fsync_p99 = earlier.and_then(|e| scrape.wal_fsync.p99_since(Some(&e.wal_fsync)));
    view.backend_commit_p99 = earlier.and_then(|e| scrape.backend_commit.p99_since(Some(&e.backend_commit)));
    view.heartbeat_send_failures = delta(scrape.heartbeat_failures, earlier.map(|e| e.heartbeat_failures));
    view.slow_applies = delta(scrape.slow_applies, earlier.map(|e| e.slow_applies));
    view.leader_changes = delta(scrape.leader_changes, earlier.map(|e| e.leader_changes));
    view.has_leader = scrape.has_leader;
    (view, Some(scrape))
}

/// The member's `/health` at `url`'s host and port within `timeout`: `Some(false)` when
/// it does not answer in time or answers not healthy, `None` when nothing is there to
/// ask (not reachable), and what it said.
pub async fn health(url: &HealthUrl, timeout: Duration) -> (Option<bool>, String) {
    match tokio::time::timeout(timeout, url.fetch("/health", 64 * 1024)).await {
        Err(_) => {
            (Some(false), format!("no answer within etcd.request_timeout = {}", crate::units::format_duration(timeout)))
        }
        Ok(Err(e)) => (None, format!("{e:#}")),
        Ok(Ok((status, body))) => {
            let body = String::from_utf8_lossy(&body);
            let ok = status.split_whitespace().nth(1) == Some("200")
                && body.replace(' ', "").contains("\"health\":\"true\"");
            (Some(ok), if ok { "ok".into() } else { format!("{status}: {}", body.trim()) })
        }
    }
}

/// Looks at the member and publishes each look to [`MEMBER`], the metrics and
/// (unless `state_file` is `None`, a dry run) the file `status` reads, at every look
/// (its `at` tells `status` whether it is fresh). `watch` asks it for a look only while it
/// is pressed, or when a scrape asks (`watch::looks`): calm, it is not woken.
pub struct Looker {
    url: HealthUrl,
    timeout: Duration,
    state_file: Option<PathBuf>,
    /// The scrape of the look before, for the interval's deltas.
    earlier: Option<Scrape>,
    published: Option<MemberView>,
}

impl Looker {
    pub fn new(url: HealthUrl, timeout: Duration, state_file: Option<PathBuf>) -> Looker {
        Looker { url, timeout, state_file, earlier: None, published: None }
    }

    /// One look, published.
    pub async fn look_and_publish(&mut self) {
        let (mut view, scrape) = look(&self.url, self.timeout, self.earlier.as_ref()).await;
        if scrape.is_some() {
            self.earlier = scrape;
        }
        crate::metrics::METRICS.etcd_member_looked(view.metrics_look());
        let changed = self.published.as_ref().is_none_or(|p| MemberView { at: p.at, ..view.clone() } != *p);
        view.at = crate::statefile::unix(SystemTime::now());
        if let Some(state_file) = &self.state_file {
            let path = path_for(state_file);
            let written = serde_json::to_vec_pretty(&view)
                .map_err(std::io::Error::other)
                .and_then(|j| crate::fsutil::publish_atomic(&path, &j, 0o644));
            if let Err(e) = written {
                tracing::warn!(error = %e, path = %path.display(), "could not publish the etcd member's look");
            }
        }
        if changed {
            let was = self.published.as_ref().and_then(|p| p.healthy);
            if was != view.healthy && self.published.is_some() {
                tracing::info!(url = %self.url, "the local etcd member: {}", view.summary());
            }
            self.published = Some(view.clone());
        }
        *MEMBER.lock().unwrap_or_else(|p| p.into_inner()) = Some((tokio::time::Instant::now(), view));
    }
}

/// Looks every `interval` for as long as it runs (a [`Looker`] on a timer: for tests
/// and tools; `watch` looks on demand).
pub async fn run(url: HealthUrl, interval: Duration, timeout: Duration, state_file: Option<PathBuf>) {
    let mut looker = Looker::new(url, timeout, state_file);
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        looker.look_and_publish().await;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Lines as etcd 3.5/3.6 writes them, with others around them.
    const TEXT: &str = "# HELP etcd_disk_wal_fsync_duration_seconds The latency distributions of fsync called by WAL.
# TYPE etcd_disk_wal_fsync_duration_seconds histogram
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.001\"} 10
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.002\"} 50
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.004\"} 90
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.008\"} 100
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"+Inf\"} 100
etcd_disk_wal_fsync_duration_seconds_sum 0.2
etcd_disk_wal_fsync_duration_seconds_count 100
etcd_disk_backend_commit_duration_seconds_bucket{le=\"0.001\"} 0
etcd_disk_backend_commit_duration_seconds_bucket{le=\"0.512\"} 4
etcd_disk_backend_commit_duration_seconds_bucket{le=\"+Inf\"} 5
etcd_server_heartbeat_send_failures_total 3
etcd_server_slow_apply_total 7
etcd_server_leader_changes_seen_total 2
etcd_server_has_leader 1
etcd_server_has_leader_x 0
go_goroutines 120
";

    #[test]
    fn the_series_regrade_reads_are_parsed_and_the_rest_ignored() {
        let s = parse(TEXT);
        assert_eq!(s.wal_fsync.buckets().len(), 5);
        assert_eq!(s.wal_fsync.buckets()[4], (f64::INFINITY, 100));
        assert_eq!(s.backend_commit.buckets(), &[(0.001, 0), (0.512, 4), (f64::INFINITY, 5)]);
        assert_eq!((s.heartbeat_failures, s.slow_applies, s.leader_changes, s.has_leader), (3, 7, 2, Some(true)));
        assert_eq!(parse("garbage\netcd_server_has_leader\n{}\n"), Scrape::default());
    }

    #[test]
    fn p99_is_interpolated_from_the_bucket_deltas() {
        let first = parse(TEXT);
        // All of it, from zero: rank 99 of 100 lies in (0.004, 0.008], 9 of 10 in.
        let p = first.wal_fsync.p99_since(None).unwrap();
        assert!((p - 0.0076).abs() < 1e-9, "{p}");
        // Nothing new since: unknown, not zero.
        assert_eq!(first.wal_fsync.p99_since(Some(&first.wal_fsync)), None);
        // 100 more fsyncs, all slow (over 8 ms): only the interval counts, not the
        // fast history, and past the highest finite bound that bound is the answer.
        let later = parse(&TEXT.replace("_bucket{le=\"+Inf\"} 100", "_bucket{le=\"+Inf\"} 200"));
        assert_eq!(later.wal_fsync.p99_since(Some(&first.wal_fsync)), Some(0.008));
        // A count that went down (etcd restarted) counts from zero.
        assert!((first.wal_fsync.p99_since(Some(&later.wal_fsync)).unwrap() - 0.0076).abs() < 1e-9);
        // The commit histogram: rank 4.95 of 5 is past 0.512.
        assert_eq!(first.backend_commit.p99_since(None), Some(0.512));
    }

    #[test]
    fn a_view_becomes_the_cores_signals_and_one_status_line() {
        let v = MemberView {
            healthy: Some(false),
            health: "no answer".into(),
            wal_fsync_p99: Some(0.25),
            ..Default::default()
        };
        let s = v.signals();
        assert_eq!(
            (s.healthy, s.wal_fsync_p99, s.backend_commit_p99),
            (Some(false), Some(Duration::from_millis(250)), None)
        );
        let line = v.summary();
        assert!(
            line.contains("NOT healthy (no answer)")
                && line.contains("p99 WAL fsync 250 ms")
                && line.contains("backend commit -"),
            "{line}"
        );
    }

    /// A stand-in listener answering `/health` and `/metrics` as etcd does, whose
    /// answers the test changes between looks.
    pub(crate) async fn listener(health: &'static str, metrics: std::sync::Arc<Mutex<String>>) -> HealthUrl {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                let body = if buf[..n].starts_with(b"GET /health") {
                    health.to_string()
                } else {
                    metrics.lock().unwrap().clone()
                };
                let _ = s.write_all(format!("HTTP/1.1 200 OK\r\n\r\n{body}").as_bytes()).await;
            }
        });
        HealthUrl::parse("etcd.metrics_url", &format!("http://{addr}/metrics")).unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_look_reads_health_and_the_intervals_deltas() {
        let metrics = std::sync::Arc::new(Mutex::new(TEXT.to_string()));
        let url = listener("{\"health\":\"true\",\"reason\":\"\"}", metrics.clone()).await;
        let t = Duration::from_secs(2);
        let (v, first) = look(&url, t, None).await;
        assert_eq!((v.healthy, v.health.as_str(), v.wal_fsync_p99), (Some(true), "ok", None), "{v:?}");
        *metrics.lock().unwrap() = TEXT
            .replace("_bucket{le=\"+Inf\"} 100", "_bucket{le=\"+Inf\"} 200")
            .replace("failures_total 3", "failures_total 5");
        let (v, _) = look(&url, t, first.as_ref()).await;
        assert_eq!((v.wal_fsync_p99, v.heartbeat_send_failures, v.slow_applies), (Some(0.008), 2, 0), "{v:?}");
        // Nothing listening: health unknown, and the metrics say why.
        let gone = HealthUrl::parse("etcd.metrics_url", "http://127.0.0.1:1/metrics").unwrap();
        let (v, s) = look(&gone, t, None).await;
        assert!(v.healthy.is_none() && s.is_none() && v.metrics_error.is_some(), "{v:?}");
    }

    /// Every look is published with its time, also one that says what the one before
    /// said: `status` trusts `watch`'s look only while it is fresh, and looks itself
    /// otherwise.
    #[tokio::test(flavor = "current_thread")]
    async fn every_look_is_published_with_its_time() {
        let dir = tempfile::tempdir().unwrap();
        let state_file = dir.path().join("state.json");
        let url = listener("{\"health\":\"true\"}", std::sync::Arc::new(Mutex::new(TEXT.to_string()))).await;
        let mut looker = Looker::new(url, Duration::from_secs(2), Some(state_file.clone()));
        looker.look_and_publish().await;
        let first = read_live(&state_file).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        looker.look_and_publish().await;
        let second = read_live(&state_file).unwrap();
        assert_eq!(second.healthy, Some(true));
        assert!(second.at > first.at, "{} then {}", first.at, second.at);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_member_that_does_not_answer_is_not_healthy_within_the_timeout() {
        // Accepts and never answers: a hung etcd.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = HealthUrl::parse("etcd.metrics_url", &format!("http://{}/metrics", l.local_addr().unwrap())).unwrap();
        let started = tokio::time::Instant::now();
        let (v, _) = look(&url, Duration::from_millis(200), None).await;
        assert!(started.elapsed() < Duration::from_secs(2), "bounded by the timeout");
        assert_eq!(v.healthy, Some(false), "{v:?}");
        assert!(v.health.contains("etcd.request_timeout"), "{v:?}");
        drop(l);
    }
}
