//! Prometheus metrics: what `watch` knows, as text exposition on `[metrics] listen`.
//!
//! The values live in one static [`Metrics`] of atomics and fixed arrays, so the
//! per-sample path updates them with plain stores: no allocation, no lock, nothing a
//! thrashing host can make wait. Rendering (which allocates) happens only when a
//! scraper asks, on the listener's own connections ([`serve`]).
//!
//! Names follow Prometheus conventions: one `regrade_` prefix, base units (ratio,
//! bytes, seconds), `_total` for counters. Every labelled family has a fixed, small
//! set of label values (levels, PSI averages, readings, refusal kinds), all exported
//! from the start, so a series never appears out of nowhere.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::cluster::RefusalKind;
use crate::decide::{Direction, Reading};
use crate::level::Level;
use crate::sample::{Metric, Pacing, Sample};

mod listener;
mod units;
pub use listener::{bind, serve, serve_asking, OnScrape};
pub use units::UnitsLook;

/// `[metrics]`
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `"ADDR:PORT"` to serve `/metrics` and `/healthz` on (an IP address, not a host
    /// name: `"127.0.0.1:9559"`, `"[::1]:9559"`). Unset: no listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
}

/// Upper bounds of the step-duration buckets, in seconds. A step that restarts
/// nothing takes a second or two; a k3s restart, tens of seconds to minutes; the
/// health and readiness timeouts (5 m each by default) bound the rest.
pub const STEP_BUCKETS: [f64; 11] = [0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0];

const READINGS: [Reading; 3] = [Reading::Over, Reading::Calm, Reading::Neither];
const DIRECTIONS: [Direction; 2] = [Direction::Down, Direction::Up];

/// How a step that ran ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepResult {
    Done,
    Failed,
}

impl StepResult {
    const ALL: [StepResult; 2] = [StepResult::Done, StepResult::Failed];
    fn as_str(self) -> &'static str {
        match self {
            StepResult::Done => "done",
            StepResult::Failed => "failed",
        }
    }
}

/// An `f64` kept as its bits.
struct AtomicF64(AtomicU64);

impl AtomicF64 {
    const fn zero() -> Self {
        AtomicF64(AtomicU64::new(0)) // 0.0's bits are all zero
    }
    const fn nan() -> Self {
        AtomicF64(AtomicU64::new(0x7ff8_0000_0000_0000)) // f64::NAN's bits
    }
    fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed)
    }
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
    fn add(&self, v: f64) {
        // Only the watcher writes; the loop is for correctness, not contention.
        let _ = self.0.fetch_update(Relaxed, Relaxed, |b| Some((f64::from_bits(b) + v).to_bits()));
    }
}

/// Everything exported. One instance, [`METRICS`], is what `watch` updates and serves;
/// tests make their own.
pub struct Metrics {
    /// Index into `Level::ALL`, or `NONE` before `watch` knows it.
    level: AtomicU8,
    /// Index into `READINGS`, or `NONE` before the first good sample.
    reading: AtomicU8,
    /// The six PSI averages as ratios, in `Metric::ALL` order.
    pressure: [AtomicF64; 6],
    mem_available: AtomicU64,
    /// Whether the last sample read both files (PSI and MemAvailable).
    pressure_available: AtomicBool,
    /// CLOCK_MONOTONIC nanoseconds of the last good sample (0: none yet), for `/healthz`.
    last_good_sample_mono_ns: AtomicU64,
    /// `[direction][result]`
    steps: [[AtomicU64; 2]; 2],
    /// In `RefusalKind::ALL` order.
    refusals: [AtomicU64; RefusalKind::ALL.len()],
    /// Cumulative counts per bucket, then the sum and the count.
    step_buckets: [AtomicU64; STEP_BUCKETS.len()],
    step_seconds_sum: AtomicF64,
    step_count: AtomicU64,
    lease_held: AtomicBool,
    /// Unix seconds of the end of the last step that ran; 0.0: none yet (not exported).
    last_step: AtomicF64,
    /// Index into `PACINGS`, or `NONE` before `watch` has chosen.
    pacing: AtomicU8,
    /// The local etcd member as its metrics listener showed it (`etcd::member`).
    etcd_member: EtcdMemberMetrics,
    /// The host's units: the largest, the one growing (`census`).
    units: units::UnitsMetrics,
    /// The kubelet's `system-reserved` memory as k3s's configuration gives it, judged at
    /// `watch`'s start (k3s reads its files only when it starts): bytes in force (NaN:
    /// none, or not known), and its state, an index into `RESERVED_STATES`.
    k3s_reserved_memory: AtomicF64,
    k3s_reserved_state: AtomicU8,
}

/// The states of the kubelet's reserved memory, as `status` words them.
const RESERVED_STATES: [&str; 5] = ["in place", "lowered", "shadowed", "missing", "unknown"];

/// The last look at the local etcd member; NaN for what is not known.
struct EtcdMemberMetrics {
    /// 1 healthy, 0 not, NaN unknown.
    healthy: AtomicF64,
    wal_fsync_p99: AtomicF64,
    backend_commit_p99: AtomicF64,
    /// Sums of each look's interval, as regrade saw them.
    heartbeat_send_failures: AtomicU64,
    slow_applies: AtomicU64,
    leader_changes: AtomicU64,
    looks: AtomicU64,
}

/// One look at the local etcd member, in the metrics' terms (`etcd::member::MemberView`).
#[derive(Clone, Copy, Debug, Default)]
pub struct EtcdMemberLook {
    pub healthy: Option<bool>,
    pub wal_fsync_p99: Option<f64>,
    pub backend_commit_p99: Option<f64>,
    pub heartbeat_send_failures: u64,
    pub slow_applies: u64,
    pub leader_changes: u64,
}

const PACINGS: [Pacing; 2] = [Pacing::Trigger, Pacing::Polling];

/// How old the last good sample may be before `/healthz` fails: a sample period or so
/// while polling, and the trigger's safety timeout while asleep on it.
#[derive(Clone, Copy, Debug)]
pub struct MaxSampleAge {
    pub polling: Duration,
    pub on_trigger: Duration,
}

const NONE: u8 = u8::MAX;

/// The process's metrics.
pub static METRICS: Metrics = Metrics::new();

#[allow(clippy::declare_interior_mutable_const)] // array initialisers, each copied once
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZERO_F: AtomicF64 = AtomicF64::zero();
#[allow(clippy::declare_interior_mutable_const)]
const ZERO_ROW: [AtomicU64; 2] = [ZERO; 2];

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub const fn new() -> Metrics {
        Metrics {
            level: AtomicU8::new(NONE),
            reading: AtomicU8::new(NONE),
            pressure: [ZERO_F; 6],
            mem_available: AtomicU64::new(0),
            pressure_available: AtomicBool::new(false),
            last_good_sample_mono_ns: AtomicU64::new(0),
            steps: [ZERO_ROW; 2],
            refusals: [ZERO; RefusalKind::ALL.len()],
            step_buckets: [ZERO; STEP_BUCKETS.len()],
            step_seconds_sum: AtomicF64::zero(),
            step_count: AtomicU64::new(0),
            lease_held: AtomicBool::new(false),
            last_step: AtomicF64::zero(),
            pacing: AtomicU8::new(NONE),
            etcd_member: EtcdMemberMetrics {
                healthy: AtomicF64::nan(),
                wal_fsync_p99: AtomicF64::nan(),
                backend_commit_p99: AtomicF64::nan(),
                heartbeat_send_failures: AtomicU64::new(0),
                slow_applies: AtomicU64::new(0),
                leader_changes: AtomicU64::new(0),
                looks: AtomicU64::new(0),
            },
            units: units::UnitsMetrics::new(),
            k3s_reserved_memory: AtomicF64::nan(),
            k3s_reserved_state: AtomicU8::new(NONE),
        }
    }

    /// The kubelet's reserved memory as `status` judges it (`state`, one of
    /// `RESERVED_STATES`) and the bytes in force, at `watch`'s start.
    pub fn set_k3s_reserved_memory(&self, state: &str, bytes_in_force: Option<u64>) {
        let i = RESERVED_STATES.iter().position(|s| *s == state).map_or(NONE, |i| i as u8);
        self.k3s_reserved_state.store(i, Relaxed);
        self.k3s_reserved_memory.set(bytes_in_force.map_or(f64::NAN, |b| b as f64));
    }

    /// A census of the host's units (`census::Reader`, under pressure or when asked).
    pub fn units_read(&self, look: UnitsLook) {
        self.units.read(look);
    }

    /// A look at the local etcd member (its own task, every `etcd.metrics_interval`).
    pub fn etcd_member_looked(&self, l: EtcdMemberLook) {
        let m = &self.etcd_member;
        m.healthy.set(l.healthy.map_or(f64::NAN, |h| f64::from(u8::from(h))));
        m.wal_fsync_p99.set(l.wal_fsync_p99.unwrap_or(f64::NAN));
        m.backend_commit_p99.set(l.backend_commit_p99.unwrap_or(f64::NAN));
        m.heartbeat_send_failures.fetch_add(l.heartbeat_send_failures, Relaxed);
        m.slow_applies.fetch_add(l.slow_applies, Relaxed);
        m.leader_changes.fetch_add(l.leader_changes, Relaxed);
        m.looks.fetch_add(1, Relaxed);
    }

    /// The level `watch` is at (the core's).
    pub fn set_level(&self, level: Level) {
        let i = level.index_in(&Level::ALL).map_or(NONE, |i| i as u8);
        self.level.store(i, Relaxed);
    }

    /// A good sample and its reading. Stores only: this is the calm path.
    pub fn sampled(&self, sample: &Sample, reading: Reading) {
        for (slot, m) in self.pressure.iter().zip(Metric::ALL) {
            slot.set(sample.metric(m) / 100.0);
        }
        self.mem_available.store(sample.mem_available, Relaxed);
        let r = READINGS.iter().position(|x| *x == reading).map_or(NONE, |i| i as u8);
        self.reading.store(r, Relaxed);
        self.pressure_available.store(true, Relaxed);
        self.last_good_sample_mono_ns.store(monotonic_ns(), Relaxed);
    }

    /// A sample that could not be read or parsed. The last values stay (they are what
    /// was last known); `regrade_pressure_available` says they are stale.
    pub fn sample_failed(&self) {
        self.pressure_available.store(false, Relaxed);
    }

    /// A step that ran: counts it, its duration, and when it ended.
    pub fn step_ran(&self, direction: Direction, result: StepResult, took: Duration, ended: SystemTime) {
        let d = DIRECTIONS.iter().position(|x| *x == direction).unwrap_or(0);
        let r = StepResult::ALL.iter().position(|x| *x == result).unwrap_or(0);
        self.steps[d][r].fetch_add(1, Relaxed);
        let secs = took.as_secs_f64();
        for (bucket, le) in self.step_buckets.iter().zip(STEP_BUCKETS) {
            if secs <= le {
                bucket.fetch_add(1, Relaxed);
            }
        }
        self.step_seconds_sum.add(secs);
        self.step_count.fetch_add(1, Relaxed);
        self.last_step.set(ended.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64());
    }

    /// A step the cluster refused, by the refusal's kind. Counted at every attempt (a
    /// refused step is retried every sample), so a steady rate means "still refused".
    pub fn refused(&self, kind: RefusalKind) {
        let i = RefusalKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        self.refusals[i].fetch_add(1, Relaxed);
    }

    /// How `watch` waits for its next sample.
    pub fn set_pacing(&self, pacing: Pacing) {
        let i = PACINGS.iter().position(|p| *p == pacing).map_or(NONE, |i| i as u8);
        self.pacing.store(i, Relaxed);
    }

    /// Whether this server holds the step Lease (from taking it to giving it back).
    pub fn set_lease_held(&self, held: bool) {
        self.lease_held.store(held, Relaxed);
    }

    /// Why `/healthz` fails, or `None` when a good sample is younger than `max_age`
    /// allows for the pacing in force, or a step is running.
    pub fn unhealthy(&self, max_age: MaxSampleAge) -> Option<&'static str> {
        let at = self.last_good_sample_mono_ns.load(Relaxed);
        if at == 0 {
            return Some("no good sample yet");
        }
        if !self.pressure_available.load(Relaxed) {
            return Some("the last sample could not read memory pressure");
        }
        // A step (a k3s restart can take minutes) holds the loop, and the Lease.
        if self.lease_held.load(Relaxed) {
            return None;
        }
        // Asleep on the trigger, a calm server samples once per safety timeout.
        let asleep = self.pacing.load(Relaxed) == 0;
        let max_age = if asleep { max_age.on_trigger } else { max_age.polling };
        if monotonic_ns().saturating_sub(at) > max_age.as_nanos() as u64 {
            return Some("no sample for too long");
        }
        None
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric.
    pub fn render(&self, out: &mut String) {
        // fmt::Write into a String cannot fail.
        let _ = self.render_fmt(out);
    }

    fn render_fmt(&self, o: &mut String) -> std::fmt::Result {
        family(o, "regrade_build_info", "gauge", "regrade's version; always 1.")?;
        writeln!(o, "regrade_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"))?;

        family(o, "regrade_level", "gauge", "1 for the level this server runs at, 0 for the others.")?;
        let level = self.level.load(Relaxed);
        for (i, l) in Level::ALL.iter().enumerate() {
            writeln!(o, "regrade_level{{level=\"{l}\"}} {}", u8::from(level == i as u8))?;
        }

        family(
            o,
            "regrade_reading",
            "gauge",
            "1 for the last sample's reading (over, calm, neither), 0 for the others.",
        )?;
        let reading = self.reading.load(Relaxed);
        for (i, r) in READINGS.iter().enumerate() {
            writeln!(o, "regrade_reading{{reading=\"{}\"}} {}", r.as_str(), u8::from(reading == i as u8))?;
        }

        family(
            o,
            "regrade_pressure_ratio",
            "gauge",
            "Memory PSI averages (/proc/pressure/memory) as a ratio, 0 to 1.",
        )?;
        for (slot, m) in self.pressure.iter().zip(Metric::ALL) {
            writeln!(o, "regrade_pressure_ratio{{metric=\"{}\"}} {}", m.as_str(), slot.get())?;
        }

        family(o, "regrade_mem_available_bytes", "gauge", "MemAvailable (/proc/meminfo) at the last good sample.")?;
        writeln!(o, "regrade_mem_available_bytes {}", self.mem_available.load(Relaxed))?;

        family(
            o,
            "regrade_pressure_available",
            "gauge",
            "1 when the last sample read PSI and MemAvailable, 0 when it failed.",
        )?;
        writeln!(o, "regrade_pressure_available {}", u8::from(self.pressure_available.load(Relaxed)))?;

        family(o, "regrade_steps_total", "counter", "Steps that ran, by direction and result.")?;
        for (d, row) in DIRECTIONS.iter().zip(&self.steps) {
            for (r, n) in StepResult::ALL.iter().zip(row) {
                writeln!(
                    o,
                    "regrade_steps_total{{direction=\"{}\",result=\"{}\"}} {}",
                    direction_str(*d),
                    r.as_str(),
                    n.load(Relaxed)
                )?;
            }
        }

        family(
            o,
            "regrade_refusals_total",
            "counter",
            "Step attempts the cluster refused, by reason; a refused step is retried every sample.",
        )?;
        for (reason, n) in RefusalKind::ALL.iter().zip(&self.refusals) {
            writeln!(o, "regrade_refusals_total{{reason=\"{}\"}} {}", reason.as_str(), n.load(Relaxed))?;
        }

        family(
            o,
            "regrade_step_duration_seconds",
            "histogram",
            "How long steps that ran took, from their first check to the Lease given back.",
        )?;
        for (le, n) in STEP_BUCKETS.iter().zip(&self.step_buckets) {
            writeln!(o, "regrade_step_duration_seconds_bucket{{le=\"{le}\"}} {}", n.load(Relaxed))?;
        }
        let count = self.step_count.load(Relaxed);
        writeln!(o, "regrade_step_duration_seconds_bucket{{le=\"+Inf\"}} {count}")?;
        writeln!(o, "regrade_step_duration_seconds_sum {}", self.step_seconds_sum.get())?;
        writeln!(o, "regrade_step_duration_seconds_count {count}")?;

        family(
            o,
            "regrade_pacing",
            "gauge",
            "1 for how watch waits for its next sample (trigger: asleep on the PSI trigger; polling: every sample_period).",
        )?;
        let pacing = self.pacing.load(Relaxed);
        for (i, p) in PACINGS.iter().enumerate() {
            writeln!(o, "regrade_pacing{{mode=\"{}\"}} {}", p.as_str(), u8::from(pacing == i as u8))?;
        }

        family(o, "regrade_lease_held", "gauge", "1 while this server holds the cluster's step Lease.")?;
        writeln!(o, "regrade_lease_held {}", u8::from(self.lease_held.load(Relaxed)))?;

        family(
            o,
            "regrade_k3s_reserved_memory_bytes",
            "gauge",
            "The kubelet's system-reserved memory as k3s's configuration gives it, at watch's start; NaN: none.",
        )?;
        writeln!(o, "regrade_k3s_reserved_memory_bytes {}", self.k3s_reserved_memory.get())?;
        family(
            o,
            "regrade_k3s_reserved_memory_state",
            "gauge",
            "1 for the state of that reservation (in place, lowered, shadowed, missing, unknown), 0 for the others.",
        )?;
        let state = self.k3s_reserved_state.load(Relaxed);
        for (i, s) in RESERVED_STATES.iter().enumerate() {
            writeln!(o, "regrade_k3s_reserved_memory_state{{state=\"{s}\"}} {}", u8::from(state == i as u8))?;
        }

        self.render_etcd_member(o)?;
        self.units.render(o)?;

        // No step yet: no sample (a 1970 timestamp would read as "long ago").
        let last = self.last_step.get();
        if last > 0.0 {
            family(
                o,
                "regrade_last_step_timestamp_seconds",
                "gauge",
                "When the last step that ran ended, in Unix seconds.",
            )?;
            writeln!(o, "regrade_last_step_timestamp_seconds {last}")?;
        }
        Ok(())
    }
}

impl Metrics {
    fn render_etcd_member(&self, o: &mut String) -> std::fmt::Result {
        let m = &self.etcd_member;
        let gauges = [
            ("regrade_etcd_member_healthy", "1 when the local etcd member's /health said true at the last look, 0 when not or it did not answer in time; NaN: not known.", &m.healthy),
            ("regrade_etcd_member_wal_fsync_p99_seconds", "The local etcd member's WAL fsync p99 over the interval before the last look (its own histogram's bucket deltas); NaN: none in it.", &m.wal_fsync_p99),
            ("regrade_etcd_member_backend_commit_p99_seconds", "The local etcd member's backend commit p99 over the interval before the last look; NaN: none in it.", &m.backend_commit_p99),
        ];
        for (name, help, v) in gauges {
            family(o, name, "gauge", help)?;
            writeln!(o, "{name} {}", v.get())?;
        }
        let counters = [
            (
                "regrade_etcd_member_heartbeat_send_failures_total",
                "Heartbeat send failures of the local etcd member, summed over regrade's looks.",
                &m.heartbeat_send_failures,
            ),
            (
                "regrade_etcd_member_slow_applies_total",
                "Slow applies of the local etcd member, summed over regrade's looks.",
                &m.slow_applies,
            ),
            (
                "regrade_etcd_member_leader_changes_total",
                "Leader changes the local etcd member saw, summed over regrade's looks.",
                &m.leader_changes,
            ),
            (
                "regrade_etcd_member_looks_total",
                "Looks at the local etcd member's metrics listener (etcd.metrics_url).",
                &m.looks,
            ),
        ];
        for (name, help, v) in counters {
            family(o, name, "counter", help)?;
            writeln!(o, "{name} {}", v.load(Relaxed))?;
        }
        Ok(())
    }
}

fn family(o: &mut String, name: &str, kind: &str, help: &str) -> std::fmt::Result {
    writeln!(o, "# HELP {name} {help}")?;
    writeln!(o, "# TYPE {name} {kind}")
}

fn direction_str(d: Direction) -> &'static str {
    match d {
        Direction::Down => "down",
        Direction::Up => "up",
    }
}

pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    // Never 0 on a running system (0 means "none yet" above).
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64).max(1)
}
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sample::Psi;

    pub(crate) fn sample() -> Sample {
        Sample { psi: Psi { some: [12.5, 3.25, 0.75], full: [1.0, 0.5, 0.0] }, mem_available: 2048 * 1024 }
    }

    fn rendered(m: &Metrics) -> String {
        let mut s = String::new();
        m.render(&mut s);
        s
    }

    /// The value of the one line starting with `series ` (name and labels).
    fn value(text: &str, series: &str) -> String {
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(&format!("{series} "))).collect();
        assert_eq!(lines.len(), 1, "{series} in:\n{text}");
        lines[0][series.len() + 1..].to_string()
    }

    #[test]
    fn a_fresh_registry_exports_every_family_with_zeroes() {
        let t = rendered(&Metrics::new());
        for name in [
            "regrade_build_info",
            "regrade_level",
            "regrade_reading",
            "regrade_pressure_ratio",
            "regrade_mem_available_bytes",
            "regrade_pressure_available",
            "regrade_steps_total",
            "regrade_refusals_total",
            "regrade_step_duration_seconds",
            "regrade_lease_held",
            "regrade_etcd_member_healthy",
            "regrade_etcd_member_wal_fsync_p99_seconds",
            "regrade_etcd_member_backend_commit_p99_seconds",
            "regrade_etcd_member_heartbeat_send_failures_total",
            "regrade_k3s_reserved_memory_bytes",
            "regrade_k3s_reserved_memory_state",
        ] {
            assert!(t.contains(&format!("# TYPE {name} ")), "{name} missing:\n{t}");
        }
        assert_eq!(value(&t, "regrade_k3s_reserved_memory_bytes"), "NaN", "not judged yet");
        let m = Metrics::new();
        m.set_k3s_reserved_memory("shadowed", None);
        let t = rendered(&m);
        assert_eq!(value(&t, "regrade_k3s_reserved_memory_state{state=\"shadowed\"}"), "1");
        assert_eq!(value(&t, "regrade_k3s_reserved_memory_state{state=\"in place\"}"), "0");
        m.set_k3s_reserved_memory("in place", Some(768 << 20));
        assert_eq!(value(&rendered(&m), "regrade_k3s_reserved_memory_bytes"), "805306368");
        assert_eq!(value(&t, "regrade_etcd_member_healthy"), "NaN", "not looked at yet: not known");
        assert_eq!(value(&t, &format!("regrade_build_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"))), "1");
        for l in Level::ALL {
            assert_eq!(value(&t, &format!("regrade_level{{level=\"{l}\"}}")), "0", "no level known yet");
        }
        assert_eq!(value(&t, "regrade_step_duration_seconds_bucket{le=\"+Inf\"}"), "0");
        assert!(!t.contains("regrade_last_step_timestamp_seconds"), "no step yet, no timestamp:\n{t}");
    }

    #[test]
    fn a_sample_sets_pressure_as_ratios_and_the_reading() {
        let m = Metrics::new();
        m.set_level(Level::ControlPlane);
        m.sampled(&sample(), Reading::Calm);
        let t = rendered(&m);
        assert_eq!(value(&t, "regrade_level{level=\"control-plane\"}"), "1");
        assert_eq!(value(&t, "regrade_level{level=\"full\"}"), "0");
        assert_eq!(value(&t, "regrade_level{level=\"etcd-only\"}"), "0");
        assert_eq!(value(&t, "regrade_pressure_ratio{metric=\"some_avg10\"}"), "0.125");
        assert_eq!(value(&t, "regrade_pressure_ratio{metric=\"some_avg60\"}"), "0.0325");
        assert_eq!(value(&t, "regrade_pressure_ratio{metric=\"full_avg10\"}"), "0.01");
        assert_eq!(value(&t, "regrade_pressure_ratio{metric=\"full_avg300\"}"), "0");
        assert_eq!(value(&t, "regrade_mem_available_bytes"), (2048 * 1024).to_string());
        assert_eq!(value(&t, "regrade_reading{reading=\"calm\"}"), "1");
        assert_eq!(value(&t, "regrade_reading{reading=\"over\"}"), "0");
        assert_eq!(value(&t, "regrade_pressure_available"), "1");
        m.sample_failed();
        assert_eq!(value(&rendered(&m), "regrade_pressure_available"), "0");
    }

    #[test]
    fn steps_fill_the_counters_and_the_histogram() {
        let m = Metrics::new();
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        m.step_ran(Direction::Down, StepResult::Done, Duration::from_millis(800), at);
        m.step_ran(Direction::Down, StepResult::Done, Duration::from_secs(45), at);
        m.step_ran(Direction::Up, StepResult::Failed, Duration::from_secs(2000), at + Duration::from_secs(5));
        let t = rendered(&m);
        assert_eq!(value(&t, "regrade_steps_total{direction=\"down\",result=\"done\"}"), "2");
        assert_eq!(value(&t, "regrade_steps_total{direction=\"down\",result=\"failed\"}"), "0");
        assert_eq!(value(&t, "regrade_steps_total{direction=\"up\",result=\"failed\"}"), "1");
        assert_eq!(value(&t, "regrade_step_duration_seconds_bucket{le=\"0.5\"}"), "0");
        assert_eq!(value(&t, "regrade_step_duration_seconds_bucket{le=\"1\"}"), "1");
        assert_eq!(value(&t, "regrade_step_duration_seconds_bucket{le=\"60\"}"), "2");
        assert_eq!(
            value(&t, "regrade_step_duration_seconds_bucket{le=\"1200\"}"),
            "2",
            "2000 s is past the last bound"
        );
        assert_eq!(value(&t, "regrade_step_duration_seconds_bucket{le=\"+Inf\"}"), "3");
        assert_eq!(value(&t, "regrade_step_duration_seconds_count"), "3");
        assert_eq!(value(&t, "regrade_step_duration_seconds_sum"), "2045.8");
        assert_eq!(value(&t, "regrade_last_step_timestamp_seconds"), "1700000005");
    }

    #[test]
    fn refusals_count_by_reason() {
        let m = Metrics::new();
        m.refused(RefusalKind::PeerNotReady);
        m.refused(RefusalKind::PeerNotReady);
        m.refused(RefusalKind::LeaseHeld);
        m.set_lease_held(true);
        let t = rendered(&m);
        assert_eq!(value(&t, "regrade_refusals_total{reason=\"peer-not-ready\"}"), "2");
        assert_eq!(value(&t, "regrade_refusals_total{reason=\"lease-held\"}"), "1");
        assert_eq!(value(&t, "regrade_refusals_total{reason=\"api-error\"}"), "0");
        for k in RefusalKind::ALL {
            assert!(t.contains(&format!("regrade_refusals_total{{reason=\"{k}\"}} ")), "{k} exported from the start");
        }
        assert_eq!(value(&t, "regrade_lease_held"), "1");
    }

    #[test]
    fn every_line_is_a_comment_or_a_sample_of_a_declared_family() {
        let m = Metrics::new();
        m.sampled(&sample(), Reading::Over);
        m.step_ran(Direction::Down, StepResult::Done, Duration::from_secs(3), SystemTime::now());
        let t = rendered(&m);
        let mut declared = Vec::new();
        for line in t.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                declared.push(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| declared.iter().any(|d| d == f)))
                .unwrap_or(name);
            assert_eq!(declared.last().map(String::as_str), Some(family), "{line:?} outside its family");
            let v = line.rsplit(' ').next().unwrap();
            assert!(v.parse::<f64>().is_ok(), "{line:?}: value {v:?}");
        }
        assert!(t.ends_with('\n'));
    }

    /// Every family filled in, through Prometheus's own linter (`promtool check
    /// metrics`, Debian's prometheus package). Gated with the Prometheus tests.
    #[test]
    fn promtool_accepts_the_exposition() {
        if std::env::var_os("REGRADE_TEST_PROMETHEUS").is_none() {
            eprintln!("skipped: set REGRADE_TEST_PROMETHEUS=1 (needs promtool)");
            return;
        }
        let m = Metrics::new();
        m.set_level(Level::ControlPlane);
        m.sampled(&sample(), Reading::Neither);
        m.step_ran(Direction::Down, StepResult::Done, Duration::from_secs(3), SystemTime::now());
        m.step_ran(Direction::Up, StepResult::Failed, Duration::from_millis(1500), SystemTime::now());
        m.refused(RefusalKind::ApiUnreachable);
        m.set_lease_held(true);
        let text = rendered(&m);
        let mut child = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool (apt-get install prometheus)");
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), text.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // promtool exits 0 with lint warnings too (3 for problems, 1 for errors); any
        // word from it is a finding.
        assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics:\n{said}\n---\n{text}");
    }

    pub(crate) fn ages(polling: Duration) -> MaxSampleAge {
        MaxSampleAge { polling, on_trigger: Duration::from_secs(3600) }
    }

    #[test]
    fn healthz_wants_a_recent_good_sample() {
        let m = Metrics::new();
        assert_eq!(m.unhealthy(ages(Duration::from_secs(60))), Some("no good sample yet"));
        m.sampled(&sample(), Reading::Calm);
        assert_eq!(m.unhealthy(ages(Duration::from_secs(60))), None);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(m.unhealthy(ages(Duration::from_millis(10))), Some("no sample for too long"));
        m.set_pacing(Pacing::Polling);
        assert_eq!(m.unhealthy(ages(Duration::from_millis(10))), Some("no sample for too long"));
        m.set_pacing(Pacing::Trigger);
        assert_eq!(m.unhealthy(ages(Duration::from_millis(10))), None, "asleep on the trigger, samples are rare");
        let both_short = MaxSampleAge { polling: Duration::from_millis(10), on_trigger: Duration::from_millis(10) };
        assert_eq!(m.unhealthy(both_short), Some("no sample for too long"), "but not forever");
        m.set_pacing(Pacing::Polling);
        m.set_lease_held(true);
        assert_eq!(m.unhealthy(ages(Duration::from_millis(10))), None, "a long step is not a hang");
        m.set_lease_held(false);
        m.sample_failed();
        assert!(m.unhealthy(ages(Duration::from_secs(60))).is_some());
    }

    #[test]
    fn config_key_is_an_address_and_port() {
        #[derive(Deserialize)]
        struct W {
            metrics: MetricsConfig,
        }
        let w: W = toml::from_str("[metrics]\nlisten = \"127.0.0.1:9559\"\n").unwrap();
        assert_eq!(w.metrics.listen, Some("127.0.0.1:9559".parse().unwrap()));
        let w: W = toml::from_str("[metrics]\nlisten = \"[::1]:9559\"\n").unwrap();
        assert_eq!(w.metrics.listen.unwrap().port(), 9559);
        let w: W = toml::from_str("[metrics]\n").unwrap();
        assert_eq!(w.metrics.listen, None);
        for bad in ["listen = \"localhost:9559\"", "listen = \"127.0.0.1\"", "listen = 9559", "port = 1"] {
            let e =
                toml::from_str::<W>(&format!("[metrics]\n{bad}\n")).err().unwrap_or_else(|| panic!("accepted {bad}"));
            let msg = e.to_string();
            assert!(msg.contains("listen") || msg.contains("port"), "{bad}: {msg}");
        }
    }
}
