//! server1's etcd member through an arm of the incident (both lanes): its `/health`
//! probed every 250 ms, and its own latencies from its metrics listener (WAL fsync and
//! backend commit p99, heartbeat send failures), accumulated across its restarts.
//! Included by each incident test with `#[path]`; the lane says how to GET a path of
//! server1's metrics listener (127.0.0.1:2381 in its network namespace or guest).

#![allow(dead_code)] // each test uses its own part

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The histograms' and counters' names, as etcd exports them.
const WAL_FSYNC: &str = "etcd_disk_wal_fsync_duration_seconds";
const BACKEND_COMMIT: &str = "etcd_disk_backend_commit_duration_seconds";
const HEARTBEAT_FAILURES: &str = "etcd_server_heartbeat_send_failures_total";
const SLOW_APPLIES: &str = "etcd_server_slow_apply_total";

/// A histogram's cumulative bucket counts by upper bound (`le`; +Inf as infinity).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Buckets(pub BTreeMap<u64, f64>);

/// Bounds are kept as f64 bits: every `le` etcd exports is a positive finite number
/// or +Inf, whose bits order as the numbers do.
fn key(le: f64) -> u64 {
    le.to_bits()
}

impl Buckets {
    /// What was added since `before`; a counter that went back means the process
    /// restarted, and everything it counts now is new.
    fn since(&self, before: &Buckets) -> Buckets {
        let restarted = self.0.iter().any(|(k, v)| before.0.get(k).is_some_and(|b| v < b));
        Buckets(
            self.0
                .iter()
                .map(|(k, v)| (*k, if restarted { *v } else { v - before.0.get(k).unwrap_or(&0.0) }))
                .collect(),
        )
    }

    fn add(&mut self, more: &Buckets) {
        for (k, v) in &more.0 {
            *self.0.entry(*k).or_default() += v;
        }
    }

    /// The upper bound of the bucket holding the 99th percentile; `None` with no
    /// observation.
    pub fn p99(&self) -> Option<f64> {
        let total = self.0.values().copied().fold(0.0, f64::max);
        if total <= 0.0 {
            return None;
        }
        self.0.iter().find(|(_, c)| **c >= 0.99 * total).map(|(k, _)| f64::from_bits(*k))
    }

    pub fn count(&self) -> f64 {
        self.0.values().copied().fold(0.0, f64::max)
    }
}

/// One scrape of the metrics listener: the two histograms and the two counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    pub wal_fsync: Buckets,
    pub backend_commit: Buckets,
    pub heartbeat_failures: f64,
    pub slow_applies: f64,
}

/// Parses Prometheus text: `<name>_bucket{...le="x"...} count` lines of the two
/// histograms and the two counters (summed over their labels).
pub fn parse(text: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        let name = series.split('{').next().unwrap_or(series);
        let le = || {
            let v = series.split("le=\"").nth(1)?.split('"').next()?;
            if v == "+Inf" {
                Some(f64::INFINITY)
            } else {
                v.parse::<f64>().ok()
            }
        };
        match name.strip_suffix("_bucket") {
            Some(WAL_FSYNC) => {
                le().map(|le| s.wal_fsync.0.insert(key(le), value));
            }
            Some(BACKEND_COMMIT) => {
                le().map(|le| s.backend_commit.0.insert(key(le), value));
            }
            _ if name == HEARTBEAT_FAILURES => s.heartbeat_failures += value,
            _ if name == SLOW_APPLIES => s.slow_applies += value,
            _ => {}
        }
    }
    s
}

/// What was observed over an arm.
#[derive(Clone, Debug, Default)]
pub struct MemberFigures {
    /// Seconds the member's /health did not answer "true" (each probe counts until the
    /// next), the longest such stretch, and the probes made.
    pub unhealthy_s: f64,
    pub longest_s: f64,
    pub probes: usize,
    /// Added up over scrapes, across restarts.
    pub wal_fsync: Buckets,
    pub backend_commit: Buckets,
    pub heartbeat_failures: f64,
    pub slow_applies: f64,
    /// Unhealthy stretches (start, seconds) of 2 s or more, for the timeline.
    pub stretches: Vec<(f64, f64)>,
    /// Every unhealthy stretch (start, end), for a window's figure.
    spans: Vec<(f64, f64)>,
    last_probe: Option<(f64, bool)>,
    since: Option<f64>,
    last_scrape: Option<Scrape>,
}

impl MemberFigures {
    /// A /health probe's answer at `t`: the time until the next probe counts as its.
    pub fn health(&mut self, t: f64, healthy: bool) {
        if let Some((pt, false)) = self.last_probe {
            self.unhealthy_s += t - pt;
        }
        match (healthy, self.since) {
            (false, None) => self.since = Some(t),
            (true, Some(start)) => {
                self.close(start, t);
                self.since = None;
            }
            _ => {}
        }
        self.last_probe = Some((t, healthy));
        self.probes += 1;
    }

    /// A scrape of the metrics listener (Prometheus text).
    pub fn scrape(&mut self, text: &str) {
        let now = parse(text);
        if let Some(before) = self.last_scrape.take() {
            self.wal_fsync.add(&now.wal_fsync.since(&before.wal_fsync));
            self.backend_commit.add(&now.backend_commit.since(&before.backend_commit));
            let counter = |b: f64, n: f64| if n < b { n } else { n - b };
            self.heartbeat_failures += counter(before.heartbeat_failures, now.heartbeat_failures);
            self.slow_applies += counter(before.slow_applies, now.slow_applies);
        }
        self.last_scrape = Some(now);
    }

    /// The arm's end at `t`: the last probe's answer counts until then.
    pub fn end(&mut self, t: f64) {
        if let Some((pt, false)) = self.last_probe.take() {
            self.unhealthy_s += t - pt;
        }
        if let Some(start) = self.since.take() {
            self.close(start, t);
        }
    }

    /// Seconds unhealthy within `from..to` (the held arm's 120 s after its restart),
    /// and the stretches of 2 s or more in it (start, seconds), cut to the window.
    pub fn within(&self, from: f64, to: f64) -> (f64, Vec<(f64, f64)>) {
        let cut: Vec<(f64, f64)> =
            self.spans.iter().map(|&(a, b)| (a.max(from), b.min(to))).filter(|(a, b)| b > a).collect();
        (
            cut.iter().map(|(a, b)| b - a).sum(),
            cut.iter().filter(|(a, b)| b - a >= 2.0).map(|&(a, b)| (a, b - a)).collect(),
        )
    }

    fn close(&mut self, start: f64, end: f64) {
        self.spans.push((start, end));
        self.longest_s = self.longest_s.max(end - start);
        if end - start >= 2.0 {
            self.stretches.push((start, end - start));
        }
    }

    /// One cell of the table: unhealthy seconds (longest), p99s, failures.
    pub fn cell(&self) -> String {
        let ms = |b: &Buckets| {
            b.p99().map_or("-".into(), |s| if s.is_finite() { format!("≤ {:.0} ms", s * 1e3) } else { "> 8 s".into() })
        };
        format!(
            "unhealthy {:.1} s (longest {:.1} s; {} probes); p99 WAL fsync {}, backend commit {}; \
             heartbeat send failures {}; slow applies {}",
            self.unhealthy_s,
            self.longest_s,
            self.probes,
            ms(&self.wal_fsync),
            ms(&self.backend_commit),
            self.heartbeat_failures,
            self.slow_applies
        )
    }
}

/// The figures from the VM guest's sampler lines (tests/vm/guest/sampler.py): `H t=…
/// ok=1|0` every 250 ms and `M <metric lines, tab-separated>` every 2 s, each with the
/// host's time of arrival; the arm ends at `end`.
pub fn from_sampler(lines: &[(f64, String)], end: f64) -> MemberFigures {
    let mut f = MemberFigures::default();
    for (t, line) in lines {
        if let Some(rest) = line.strip_prefix("H ") {
            f.health(*t, rest.split_whitespace().any(|kv| kv == "ok=1"));
        } else if let Some(rest) = line.strip_prefix("M ") {
            f.scrape(&rest.replace('\t', "\n"));
        }
    }
    f.end(end);
    f
}

/// Probes /health every 250 ms and scrapes /metrics every 2 s until finished. `get`
/// GETs a path of server1's metrics listener (e.g. "/health"), `None` when it did not
/// answer 200 within its own timeout.
pub struct MemberWatch {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<MemberFigures>>,
}

impl MemberWatch {
    /// `enter` runs first in the watch's own thread (to enter server1's network
    /// namespace, for one).
    pub fn start(
        now: fn() -> f64,
        enter: impl FnOnce() + Send + 'static,
        get: impl Fn(&str) -> Option<String> + Send + 'static,
    ) -> MemberWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            enter();
            let mut f = MemberFigures::default();
            let mut last_scrape: Option<Instant> = None;
            while !s.load(Ordering::SeqCst) {
                let t = now();
                f.health(t, get("/health").is_some_and(|b| b.contains("\"health\":\"true\"")));
                if last_scrape.is_none_or(|l| l.elapsed() >= Duration::from_secs(2)) {
                    if let Some(text) = get("/metrics") {
                        f.scrape(&text);
                    }
                    last_scrape = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_secs_f64((t + 0.25 - now()).max(0.0)));
            }
            if let Some(text) = get("/metrics") {
                f.scrape(&text);
            }
            f.end(now());
            f
        });
        MemberWatch { stop, thread: Some(thread) }
    }

    pub fn finish(mut self) -> MemberFigures {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP etcd_disk_wal_fsync_duration_seconds ...
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.001"} 10
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.002"} 90
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.512"} 99
etcd_disk_wal_fsync_duration_seconds_bucket{le="1.024"} 100
etcd_disk_wal_fsync_duration_seconds_bucket{le="+Inf"} 100
etcd_disk_wal_fsync_duration_seconds_sum 3.2
etcd_disk_backend_commit_duration_seconds_bucket{le="0.004"} 5
etcd_disk_backend_commit_duration_seconds_bucket{le="+Inf"} 5
etcd_server_heartbeat_send_failures_total{To="a"} 2
etcd_server_heartbeat_send_failures_total{To="b"} 3
etcd_server_slow_apply_total 1
"#;

    #[test]
    fn the_99th_percentile_is_the_bucket_that_holds_it() {
        let s = parse(TEXT);
        assert_eq!(s.wal_fsync.p99(), Some(0.512));
        assert_eq!(s.backend_commit.p99(), Some(0.004));
        assert_eq!((s.heartbeat_failures, s.slow_applies), (5.0, 1.0));
    }

    #[test]
    fn a_restart_counts_what_the_new_process_saw_not_a_negative() {
        let mut f = MemberFigures::default();
        f.scrape(TEXT);
        f.scrape("etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.001\"} 1\netcd_disk_wal_fsync_duration_seconds_bucket{le=\"+Inf\"} 4\netcd_server_heartbeat_send_failures_total 1\n");
        assert_eq!(f.wal_fsync.count(), 4.0);
        assert_eq!(f.heartbeat_failures, 1.0);
        // Then a plain increase adds the difference.
        f.scrape("etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.001\"} 1\netcd_disk_wal_fsync_duration_seconds_bucket{le=\"+Inf\"} 6\netcd_server_heartbeat_send_failures_total 3\n");
        assert_eq!(f.wal_fsync.count(), 6.0);
        assert_eq!(f.heartbeat_failures, 3.0);
        assert_eq!(f.wal_fsync.p99(), Some(f64::INFINITY));
    }

    #[test]
    fn each_probe_counts_until_the_next_and_stretches_are_kept() {
        let mut f = MemberFigures::default();
        for (t, ok) in [(0.0, true), (0.25, false), (0.5, false), (3.0, true), (3.25, false)] {
            f.health(t, ok);
        }
        f.end(4.0);
        assert!((f.unhealthy_s - 3.5).abs() < 1e-9, "{}", f.unhealthy_s);
        assert_eq!(f.stretches, vec![(0.25, 2.75)]);
        assert!((f.longest_s - 2.75).abs() < 1e-9);
        assert_eq!(f.probes, 5);
        // A window counts only its part of each stretch.
        let (s, stretches) = f.within(0.5, 3.5);
        assert!((s - 2.75).abs() < 1e-9, "{s}");
        assert_eq!(stretches, vec![(0.5, 2.5)]);
        assert_eq!(f.within(3.0, 3.2).0, 0.0);
    }
}
