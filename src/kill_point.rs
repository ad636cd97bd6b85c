//! Test-only kill points: `REGRADE_TEST_KILL_AT=<point>` makes the process stop itself
//! the first time it reaches the named point of a step, so the kill-point matrix test
//! (tests/testsuite/level_kill_points.rs) can stop regrade exactly there, the way a power cut or
//! the OOM killer would. Unset (always, outside tests) it costs one environment lookup
//! per step effect or durable write, never per sample.
//!
//! Two kinds of point:
//! - a moment of a step, one of [`POINTS`];
//! - a moment inside a durable write (`fsutil`'s replace: temporary file written,
//!   fsynced, renamed, its directory fsynced): `<write>:<moment>`, `<write>` one of
//!   [`WRITES`] and `<moment>` one of [`MOMENTS`]. A writer may tag its write
//!   (`level-record@writing`: the record of a step at phase `writing`); an untagged
//!   `<write>` names every write of it, a tagged one only that write.
//!
//! `REGRADE_TEST_KILL_HOW=stop` makes the process SIGSTOP itself there instead of
//! SIGKILL: its writes so far stay where the kernel has them (a guest's dirty page
//! cache), so a test that cuts a virtual machine's power after the log line cuts
//! exactly there (tests/testsuite/vm_power_cuts.rs).

use std::sync::atomic::{AtomicBool, Ordering};

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

/// regrade's durable writes a test can cut: its level record, the k3s drop-in, and
/// k3s's start record (written by `record-start` in k3s's start, or by `watch`).
pub const WRITES: [&str; 3] = ["level-record", "dropin", "start-record"];

/// Where in a durable write (see [`crate::fsutil`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// The temporary file written, not yet fsynced.
    BeforeFsync,
    /// The temporary file fsynced, not yet renamed over the target.
    BeforeRename,
    /// Renamed (or, for a removal, removed), the directory not yet fsynced.
    BeforeDirFsync,
}

pub const MOMENTS: [Moment; 3] = [Moment::BeforeFsync, Moment::BeforeRename, Moment::BeforeDirFsync];

impl Moment {
    pub fn as_str(self) -> &'static str {
        match self {
            Moment::BeforeFsync => "before-fsync",
            Moment::BeforeRename => "before-rename",
            Moment::BeforeDirFsync => "before-dir-fsync",
        }
    }
}

pub const ENV: &str = "REGRADE_TEST_KILL_AT";
pub const HOW_ENV: &str = "REGRADE_TEST_KILL_HOW";
/// The `fsync-faults` build's mutation: `<write>` skips that write's file fsync,
/// `<write>:dir` its directory's (see [`crate::fsutil`]).
pub const NO_FSYNC_ENV: &str = "REGRADE_TEST_NO_FSYNC";

/// The line logged at a point, before the process stops or dies: what a test waits for.
pub const LOGGED: &str = "stopping this process here";

static FIRED: AtomicBool = AtomicBool::new(false);

/// Stops this process if `REGRADE_TEST_KILL_AT` names the step's `point`.
pub fn reached(point: &str) {
    debug_assert!(POINTS.contains(&point), "unknown kill point {point}");
    if std::env::var_os(ENV).is_some_and(|v| v == point) {
        stop_here(point);
    }
}

/// Stops this process if `REGRADE_TEST_KILL_AT` names this moment of the durable write
/// `write` (`name` or `name@tag`).
pub fn in_write(write: &str, moment: Moment) {
    let Some(asked) = std::env::var_os(ENV) else { return };
    let asked = asked.to_string_lossy();
    if cut_matches(&asked, write, moment) {
        stop_here(&asked);
    }
}

/// Whether the asked point `<write>[@tag]:<moment>` is this moment of `write`.
fn cut_matches(asked: &str, write: &str, moment: Moment) -> bool {
    let Some((asked_write, asked_moment)) = asked.rsplit_once(':') else { return false };
    asked_moment == moment.as_str() && names_write(asked_write, write)
}

/// Whether `asked` (`name` or `name@tag`) names `write` (`name` or `name@tag`).
fn names_write(asked: &str, write: &str) -> bool {
    asked == write || (!asked.contains('@') && write.split('@').next() == Some(asked))
}

/// Whether the `fsync-faults` mutation takes this fsync out: `REGRADE_TEST_NO_FSYNC`
/// names `write` (its file's fsync) or `write:dir` (its directory's).
pub fn fsync_skipped(asked: Option<&str>, write: &str, dir: bool) -> bool {
    let Some(asked) = asked else { return false };
    asked.split(',').map(str::trim).any(|a| match a.strip_suffix(":dir") {
        Some(w) => dir && names_write(w, write),
        None => !dir && names_write(a, write),
    })
}

/// Logs `point` as asked (`{ENV}=<point>: {LOGGED}`, the line a test waits for) and
/// stops or kills this process.
fn stop_here(point: &str) {
    if FIRED.swap(true, Ordering::SeqCst) {
        // Continued after a stop (SIGCONT): the point was this process's once.
        return;
    }
    if std::env::var_os(HOW_ENV).is_some_and(|v| v == "stop") {
        tracing::warn!(point, "{ENV}={point}: {LOGGED} (SIGSTOP)");
        // SAFETY: raise(2) with a signal number; the process stops until SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
    } else {
        tracing::warn!(point, "{ENV}={point}: {LOGGED} (SIGKILL)");
        // SAFETY: raise(2) with a signal number; the process ends.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_names_a_write_untagged_or_one_tagged_write() {
        use Moment::*;
        assert!(cut_matches("dropin:before-rename", "dropin", BeforeRename));
        assert!(!cut_matches("dropin:before-rename", "dropin", BeforeFsync));
        assert!(!cut_matches("dropin:before-rename", "start-record", BeforeRename));
        assert!(cut_matches("level-record:before-fsync", "level-record@writing", BeforeFsync));
        assert!(cut_matches("level-record@writing:before-dir-fsync", "level-record@writing", BeforeDirFsync));
        assert!(!cut_matches("level-record@writing:before-dir-fsync", "level-record@marking", BeforeDirFsync));
        assert!(!cut_matches("level-record@writing:before-dir-fsync", "level-record", BeforeDirFsync));
        assert!(!cut_matches("after-dropin", "dropin", BeforeFsync), "a step's point is not a write's");
        assert!(!cut_matches("level:before-fsync", "level-record", BeforeFsync), "a name, not a prefix");
        for m in MOMENTS {
            for w in WRITES {
                assert!(cut_matches(&format!("{w}:{}", m.as_str()), w, m));
            }
        }
    }

    #[test]
    fn the_mutation_takes_out_the_file_or_the_directory_fsync_it_names() {
        assert!(!fsync_skipped(None, "dropin", false));
        assert!(fsync_skipped(Some("dropin"), "dropin", false));
        assert!(!fsync_skipped(Some("dropin"), "dropin", true));
        assert!(fsync_skipped(Some("dropin:dir"), "dropin", true));
        assert!(!fsync_skipped(Some("dropin:dir"), "dropin", false));
        assert!(fsync_skipped(Some("level-record"), "level-record@writing", false));
        assert!(fsync_skipped(Some("start-record, dropin:dir"), "dropin", true));
        assert!(!fsync_skipped(Some("start-record"), "level-record", false));
    }
}
