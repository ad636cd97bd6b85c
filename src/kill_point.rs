//! Test-only kill points: `REGRADE_TEST_KILL_AT=<point>` makes the process SIGKILL
//! itself the first time it reaches the named point of a step, so the kill-point
//! matrix test (tests/level_kill_points.rs) can stop regrade exactly there, the way
//! a power cut or the OOM killer would. Unset (always, outside tests) it costs one
//! environment lookup per step effect, never per sample.

/// The points, in the order a step down reaches them (a step up applies first and
/// marks after: after-dropin, after-restart-request, health-wait, readiness-wait,
/// before-marks, after-marks, before-release).
pub const POINTS: [&str; 7] = [
    "before-marks",
    "after-marks",
    "after-dropin",
    "after-restart-request",
    "health-wait",
    "readiness-wait",
    "before-release",
];

pub const ENV: &str = "REGRADE_TEST_KILL_AT";

/// Kills this process with SIGKILL if `REGRADE_TEST_KILL_AT` names `point`.
pub fn reached(point: &str) {
    debug_assert!(POINTS.contains(&point), "unknown kill point {point}");
    if std::env::var_os(ENV).is_some_and(|v| v == point) {
        tracing::warn!(point, "{ENV}: killing this process here (SIGKILL)");
        // SAFETY: raise(2) with a signal number; the process ends.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
