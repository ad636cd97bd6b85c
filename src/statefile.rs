//! What `watch` publishes for `status`: its streaks, last step and last refusal, with
//! wall-clock times. Written atomically, and only when something in it changes, so a
//! calm sample writes nothing.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::decide::State;
use crate::level::Level;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Published {
    pub pid: u32,
    pub level: Option<Level>,
    /// Seconds since the Unix epoch.
    pub over_since: Option<f64>,
    pub calm_since: Option<f64>,
    pub last_step: Option<LastStep>,
    pub refusal: Option<PublishedRefusal>,
    /// The level a step is starting towards, published before the switch hold is read
    /// (`crate::hold`): the NixOS switch-time check reads it after writing its hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stepping: Option<Level>,
    pub dry_run: bool,
    /// How `watch` waits for its next sample: asleep on the PSI trigger, or polling.
    #[serde(default)]
    pub pacing: Option<crate::sample::Pacing>,
    /// The armed trigger, or why there is none.
    #[serde(default)]
    pub trigger: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastStep {
    pub at: f64,
    pub action: String,
    pub from: Level,
    pub to: Level,
    /// "done", or "failed: <why>".
    pub result: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PublishedRefusal {
    pub since: f64,
    pub kind: String,
    /// What the refusal is about (the peer, the Lease holder, the endpoints).
    #[serde(default)]
    pub subject: String,
    pub message: String,
}

pub fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64()
}

impl Published {
    /// Takes the core's state with times made absolute (`origin` is the wall-clock
    /// time of the core's time zero). Returns whether anything changed.
    pub fn set_state(&mut self, state: &State, origin: SystemTime) -> bool {
        let at = |d: Duration| unix(origin + d);
        let new = (Some(state.level), state.over_since.map(at), state.calm_since.map(at));
        let changed = (self.level, self.over_since, self.calm_since) != new;
        (self.level, self.over_since, self.calm_since) = new;
        changed
    }

    /// The core's state on a Unix-epoch time axis, for `status`'s arithmetic.
    pub fn state(&self) -> Option<State> {
        // The file is outside data: a time that is no Duration reads as zero.
        let d = |s: f64| Duration::try_from_secs_f64(s.max(0.0)).unwrap_or_default();
        Some(State {
            level: self.level?,
            over_since: self.over_since.map(d),
            calm_since: self.calm_since.map(d),
            last_step: self.last_step.as_ref().map(|l| d(l.at)),
        })
    }

    /// Readable by all (`status` needs no root), whatever the service's umask.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
        }
        crate::fsutil::publish_atomic(path, &serde_json::to_vec_pretty(self)?, 0o644)
    }

    /// The published state, if the `watch` that wrote it is still running.
    pub fn read_live(path: &Path) -> Option<Published> {
        let p: Published = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
        alive(p.pid).then_some(p)
    }
}

/// Whether the process `pid` (a file's writer) still runs.
pub fn alive(pid: u32) -> bool {
    // kill(pid, 0) tests that the process exists without signalling it; EPERM
    // means it exists but belongs to someone else (a root `watch`, a user `status`).
    pid != 0
        && (unsafe { libc::kill(pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nixos/pre-switch-check.sh matches `"stepping": "<level>"` in this file.
    #[test]
    fn a_step_under_way_is_published_as_the_switch_check_reads_it() {
        let p = Published { stepping: Some(Level::ControlPlane), ..Default::default() };
        let json = String::from_utf8(serde_json::to_vec_pretty(&p).unwrap()).unwrap();
        assert!(json.contains("\"stepping\": \"control-plane\""), "{json}");
        assert!(!serde_json::to_string(&Published::default()).unwrap().contains("stepping"));
    }

    #[test]
    fn round_trips_and_ignores_dead_writers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.json");
        let origin = UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut st = State::new(Level::ControlPlane);
        st.over_since = Some(Duration::from_secs(30));
        let mut p = Published { pid: std::process::id(), ..Default::default() };
        p.set_state(&st, origin);
        p.write(&path).unwrap();
        let back = Published::read_live(&path).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.state().unwrap().over_since, Some(Duration::from_secs(1_000_030)));
        // A pid that cannot exist: the file is stale.
        Published { pid: i32::MAX as u32, ..p }.write(&path).unwrap();
        assert!(Published::read_live(&path).is_none());
    }
}
