//! The one durable record of the level regrade holds this server at.
//!
//! Everything else that says a level is derived from it: the k3s drop-in (what k3s
//! will start with), the start record under `/run` (what k3s was started with, which
//! a reboot forgets) and the Node's marks (label, cordon, taint, annotation). It lives
//! on local disk that survives a reboot (`/var/lib/regrade/level.json` by default) and
//! is replaced atomically, so a crash leaves the old record or the new one, whole.
//!
//! A step writes its progress here before each effect it has on the world (see
//! [`Phase`]), so the next process to start — `watch`, `step` or `status` — knows
//! how far a killed step got, and [`converge`] decides the same way for all of them
//! what to do about it. docs/level-record.md says case by case what happens when the
//! record and the world disagree.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::level::Level;

/// Where the record lives unless configured otherwise.
pub const DEFAULT_PATH: &str = "/var/lib/regrade/level.json";

/// The format's version. A record of another version is refused by name, not guessed at.
pub const VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LevelRecord {
    pub version: u32,
    /// The level regrade holds the server at: where the last step finished (or was
    /// rolled back to). While `step` is set, the step has not finished.
    pub level: Level,
    /// A step under way. Cleared when it finished or was rolled back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<StepInProgress>,
    /// The configuration keys naming what regrade put on the Node and on disk, with
    /// their values when the record was written (`cluster.level_label` → the label
    /// name, `systemd.dropin` → the path). Below `full` these are what is to be
    /// undone; a change of one of them is caught at start (see [`converge`]).
    #[serde(default)]
    pub keys: BTreeMap<String, String>,
    /// When the record was written, in seconds since the Unix epoch.
    pub updated: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepInProgress {
    pub from: Level,
    pub to: Level,
    /// How far the step got: the last effect it began (written before the effect).
    pub phase: Phase,
    /// When the step began, in seconds since the Unix epoch.
    pub started: u64,
}

/// The effects of a step, in the order a step may have them (`Restoring` only after
/// a failed restart). Each is recorded
/// *before* the effect is attempted, so a record with phase P means "P may or may not
/// have happened, nothing after it has".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// The Lease is held; nothing else changed yet.
    Leased,
    /// Down: the Node's marks for `to` are being set.
    Marking,
    /// The actuator's file (drop-in) for `to` is being written; k3s not restarted.
    Writing,
    /// k3s is being restarted into `to`: once asked, systemd finishes the restart
    /// whether regrade lives or not.
    Restarting,
    /// k3s serves at `to` (healthy and, where the agent runs, Ready); what is left is
    /// the marks (up) and the release of the Lease.
    Applied,
    /// The restart into `to` failed: the file of `from` is being put back and k3s
    /// restarted into it (what a failed step does).
    Restoring,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Leased => "leased",
            Phase::Marking => "marking",
            Phase::Writing => "writing",
            Phase::Restarting => "restarting",
            Phase::Applied => "applied",
            Phase::Restoring => "restoring",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the record could not be read. Each names the file, so an operator knows which
/// one to look at (and may remove: with no record, regrade starts over from what k3s
/// runs and what the Node says).
#[derive(Debug)]
pub enum RecordError {
    Io { path: PathBuf, error: io::Error },
    Garbled { path: PathBuf, why: String },
    Version { path: PathBuf, version: u64 },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Io { path, error } => write!(f, "reading the level record {}: {error}", path.display()),
            RecordError::Garbled { path, why } => write!(
                f,
                "the level record {} is not a regrade level record ({why}); remove it to start over from what k3s \
                 runs and what the Node says",
                path.display()
            ),
            RecordError::Version { path, version } => write!(
                f,
                "the level record {} has version {version}, this regrade reads version {VERSION}: it was written by \
                 another regrade",
                path.display()
            ),
        }
    }
}

impl std::error::Error for RecordError {}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs()
}

impl LevelRecord {
    /// A record of a server held at `level`, no step under way.
    pub fn at(level: Level, keys: BTreeMap<String, String>) -> LevelRecord {
        LevelRecord { version: VERSION, level, step: None, keys, updated: unix_now() }
    }

    /// The record read from `path`; `None` when there is none (a first start).
    pub fn read(path: &Path) -> Result<Option<LevelRecord>, RecordError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(RecordError::Io { path: path.into(), error }),
        };
        Self::parse(&bytes, path).map(Some)
    }

    /// The record in `bytes`, read from `path` (named in the errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<LevelRecord, RecordError> {
        let garbled = |why: String| RecordError::Garbled { path: path.into(), why };
        // The version first, so a newer format is named as such, not as garbage.
        let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| garbled(e.to_string()))?;
        match value.get("version").and_then(serde_json::Value::as_u64) {
            Some(v) if v == u64::from(VERSION) => {}
            Some(version) => return Err(RecordError::Version { path: path.into(), version }),
            None => return Err(garbled("no \"version\"".into())),
        }
        let record: LevelRecord = serde_json::from_value(value).map_err(|e| garbled(e.to_string()))?;
        if let Some(s) = &record.step {
            if s.from == s.to {
                return Err(garbled(format!("a step from {} to itself", s.from)));
            }
        }
        Ok(record)
    }

    /// Replaces the record at `path` whole (see [`crate::fsutil`]), creating its
    /// directory. World-readable: `status` run by an operator reads it.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        self.write_kept(path).map(drop)
    }

    /// [`Self::write`], and the file written, still open.
    pub fn write_kept(&self, path: &Path) -> anyhow::Result<std::fs::File> {
        use anyhow::Context;
        let mut bytes = serde_json::to_vec_pretty(self)?;
        bytes.push(b'\n');
        // Named with its phase, so a test can cut the write of one phase
        // (`level-record@writing`: a phase ahead of the drop-in; see kill_point).
        let write = format!("level-record@{}", self.step.as_ref().map_or("settled", |s| s.phase.as_str()));
        crate::fsutil::write_atomic_kept(path, &bytes, 0o644, &write)
            .with_context(|| format!("writing the level record {}", path.display()))
    }

    /// The level the server is at for anyone asking now: the step's `from` while one
    /// is under way (it has not finished).
    pub fn level(&self) -> Level {
        self.level
    }

    /// This record with `step` begun (phase [`Phase::Leased`]).
    pub fn begin(&self, from: Level, to: Level) -> LevelRecord {
        let step = StepInProgress { from, to, phase: Phase::Leased, started: unix_now() };
        LevelRecord { step: Some(step), updated: unix_now(), ..self.clone() }
    }

    /// This record with its step moved on to `phase`. Phases only move forward: a
    /// step resumed from a later phase (`restarting`, say) that reports an earlier one
    /// on its way (`marking`) keeps the later one, which is what may have happened.
    pub fn reach(&self, phase: Phase) -> LevelRecord {
        let mut r = self.clone();
        if let Some(s) = &mut r.step {
            s.phase = s.phase.max(phase);
        }
        r.updated = unix_now();
        r
    }

    /// This record with no step under way, at `level`, with `keys` (the ones in force).
    pub fn settle(&self, level: Level, keys: BTreeMap<String, String>) -> LevelRecord {
        LevelRecord { version: VERSION, level, step: None, keys, updated: unix_now() }
    }
}

/// What the Node's marks say, as read now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Marks {
    /// The level the label names (`full`: no label).
    Level(Level),
    /// The Node could not be read (the API is unreachable): they may be anything.
    Unknown,
}

/// What is observed of the world, next to the record.
#[derive(Clone, Debug)]
pub struct Observed<'a> {
    /// The record; `None` when there is none (a first start, or a record that could
    /// not be read — see [`RecordError`]).
    pub record: Option<&'a LevelRecord>,
    /// The level whose k3s flags the actuator's file (drop-in) holds; `None` when the
    /// file holds something regrade did not write and names no level.
    pub file: Option<Level>,
    /// The level k3s was started at (the start record); `None` when k3s has not been
    /// started through the hook since boot.
    pub started: Option<Level>,
    pub marks: Marks,
    /// The keys configured now (the same names as [`LevelRecord::keys`]).
    pub keys: &'a BTreeMap<String, String>,
}

impl Observed<'_> {
    /// What was found, in words: what `watch` and `step` log at their start next to
    /// the decision (`record` says why there is none: absent or unreadable).
    pub fn describe(&self, no_record: &str) -> String {
        let record = match self.record {
            None => no_record.to_string(),
            Some(LevelRecord { level, step: None, .. }) => format!("{level}"),
            Some(LevelRecord { level, step: Some(s), .. }) => {
                format!("{level}, step {} -> {} at phase {}", s.from, s.to, s.phase)
            }
        };
        let or = |l: Option<Level>, none: &str| l.map_or(none.to_string(), |l| l.to_string());
        let marks = match self.marks {
            Marks::Level(l) => l.to_string(),
            Marks::Unknown => "not read".into(),
        };
        format!(
            "record: {record}; k3s's file: {}; k3s started at: {}; the Node's marks: {marks}",
            or(self.file, "not regrade's"),
            or(self.started, "not recorded since boot")
        )
    }
}

/// What to do about what was observed. Every command computes it the same way; the
/// ones that may change things (`watch`, `step`) do it, `status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// The record, k3s, its file and the Node agree: nothing to do.
    AtLevel { level: Level },
    /// The level is `level`; its marks differ from it, or could not be read: put them
    /// right (level-triggered, with backoff, until they match).
    ReconcileMarks { level: Level },
    /// The level is `level`; the actuator's file does not hold its flags (edited, or
    /// written by a step that was never finished and whose record was lost): rewrite
    /// it, without a restart (k3s runs at `level` already), then the marks.
    RewriteFile { level: Level, marks: bool },
    /// A step was under way and k3s was never restarted for it: undo what it did (the
    /// file, the marks) back to `step.from`. No restart, so no Lease needed.
    RollBack { step: StepInProgress },
    /// A step was under way and k3s was restarted (or asked to restart) into
    /// `step.to`: systemd finishes such a restart whatever regrade does, so the step is
    /// finished — under the Lease and peer gate, as every step — by waiting for k3s
    /// to serve at `to`; if it does not, it is undone as a failed step is.
    ResumeStep { step: StepInProgress },
    /// A key naming something regrade put on the Node or on disk changed while the
    /// server is below `full`: the old marks or file would be orphaned.
    RefuseKeyChanged { key: String, recorded: String, configured: String, level: Level, command: String },
}

impl Decision {
    /// The level the server is held at once this decision is carried out (for a
    /// resumed step, where it goes if it succeeds).
    pub fn level(&self) -> Level {
        match self {
            Decision::AtLevel { level }
            | Decision::ReconcileMarks { level }
            | Decision::RewriteFile { level, .. }
            | Decision::RefuseKeyChanged { level, .. } => *level,
            Decision::RollBack { step } => step.from,
            Decision::ResumeStep { step } => step.to,
        }
    }

    /// One sentence for `status` and the journal: what regrade will do.
    pub fn describe(&self) -> String {
        match self {
            Decision::AtLevel { level } => format!("nothing: the record, k3s and the Node agree on {level}"),
            Decision::ReconcileMarks { level } => {
                format!("put the Node's marks right for {level} (retried with backoff until they match)")
            }
            Decision::RewriteFile { level, marks } => format!(
                "rewrite regrade's k3s file for {level} without restarting k3s (it runs at {level}){}",
                if *marks { ", then put the Node's marks right" } else { "" }
            ),
            Decision::RollBack { step } => format!(
                "roll back the step {} -> {} interrupted at {} (k3s was not restarted for it): file and marks back \
                 to {}",
                step.from, step.to, step.phase, step.from
            ),
            Decision::ResumeStep { step } => format!(
                "finish the step {} -> {} interrupted at {} under the Lease (k3s was restarted into {}): wait for it \
                 to serve, then mark the Node; undo it if it does not serve",
                step.from, step.to, step.phase, step.to
            ),
            Decision::RefuseKeyChanged { key, recorded, configured, level, command } => format!(
                "refuse to run: {key} changed from {recorded:?} to {configured:?} while the server is at {level}; \
                 {command}"
            ),
        }
    }
}

/// Whether two levels run k3s with the same flags (no restart between them).
pub trait SameFlags {
    fn same_flags(&self, a: Level, b: Level) -> bool;
}

impl<F: Fn(Level, Level) -> bool> SameFlags for F {
    fn same_flags(&self, a: Level, b: Level) -> bool {
        self(a, b)
    }
}

fn lower(a: Level, b: Level) -> bool {
    a.index_in(&Level::ALL) > b.index_in(&Level::ALL)
}

/// Decides what to do about the record and the world. Pure: the same observation
/// gives the same decision whichever command meets it. Never moves the server two
/// levels: a resumed step goes to its `to`, a rollback to its `from`, and otherwise
/// the level is the record's (or, where k3s demonstrably runs other flags, the
/// level k3s runs at — a fact, not a step).
pub fn converge(o: &Observed<'_>, flags: &dyn SameFlags) -> Decision {
    let Some(record) = o.record else { return without_record(o, flags) };

    // A key changed while something of regrade's is out there under the old name.
    let below = record.level != Level::Full || record.step.is_some();
    if below {
        for (key, recorded) in &record.keys {
            if let Some(configured) = o.keys.get(key) {
                if configured != recorded {
                    let level = record.step.as_ref().map_or(record.level, |s| s.from);
                    return Decision::RefuseKeyChanged {
                        key: key.clone(),
                        recorded: recorded.clone(),
                        configured: configured.clone(),
                        level,
                        command: format!(
                            "set {key} = {recorded:?} again, run `regrade step to full`, then change it (regrade \
                             changes these names only at full)"
                        ),
                    };
                }
            }
        }
    }

    if let Some(step) = &record.step {
        return interrupted(step, o, flags);
    }

    // No step under way. k3s's flags: what it was started with, else what it will
    // start with. If they are not the record's level's, k3s was restarted with a file
    // someone else wrote: the running k3s wins (a restart now would go without the
    // Lease), and the record follows it.
    let mut level = record.level;
    let running = o.started.or(o.file);
    if let Some(r) = running {
        if !flags.same_flags(r, level) {
            level = r;
        }
    }
    settle(level, o, flags)
}

/// The level is `level`: is the file right, are the marks?
fn settle(level: Level, o: &Observed<'_>, flags: &dyn SameFlags) -> Decision {
    let marks_ok = o.marks == Marks::Level(level);
    let file_ok = o.file.is_some_and(|f| flags.same_flags(f, level));
    match (file_ok, marks_ok) {
        (true, true) => Decision::AtLevel { level },
        (true, false) => Decision::ReconcileMarks { level },
        (false, marks) => Decision::RewriteFile { level, marks: !marks },
    }
}

/// A step was under way when the process that ran it stopped.
fn interrupted(step: &StepInProgress, o: &Observed<'_>, flags: &dyn SameFlags) -> Decision {
    let restarts = !flags.same_flags(step.from, step.to);
    let k3s_at_to = o.started.is_some_and(|s| flags.same_flags(s, step.to));
    match step.phase {
        // k3s serves at `to`: only the marks and the Lease were left.
        Phase::Applied => settle(step.to, o, flags),
        // systemd finishes a restart once asked, so the step is finished too.
        Phase::Restarting if restarts => Decision::ResumeStep { step: step.clone() },
        // The file was written but no restart asked for. If k3s was restarted with it
        // anyway (k3s crashed and systemd restarted it), k3s is at `to`: finish.
        Phase::Writing if restarts && k3s_at_to => Decision::ResumeStep { step: step.clone() },
        // The step failed and its undoing was under way: finish the undoing, a
        // restart back into `from` (the step reversed), under the Lease.
        Phase::Restoring => Decision::ResumeStep {
            step: StepInProgress { from: step.to, to: step.from, phase: Phase::Restarting, started: step.started },
        },
        // Nothing restarted for this step: undo it. (A step without restart, full <->
        // control-plane, is undone up to `Applied`: its only effects are the marks.)
        _ => Decision::RollBack { step: step.clone() },
    }
}

/// No record: the first start of a regrade that keeps one (or a record that could
/// not be read). The level is what k3s runs; a label naming a lower level with the
/// same flags is believed (after a reboot at `control-plane` only the Node remembers
/// it). The marks must be known to decide that: with the API unreachable, the level
/// is k3s's for now and the marks are to be reconciled, and callers write no record
/// until the marks have been read (they decide again then).
fn without_record(o: &Observed<'_>, flags: &dyn SameFlags) -> Decision {
    let running = o.started.or(o.file).unwrap_or(Level::Full);
    let level = match o.marks {
        Marks::Level(l) if lower(l, running) && flags.same_flags(l, running) => l,
        _ => running,
    };
    settle(level, o, flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Level::{ControlPlane as CP, EtcdOnly as EO, Full};

    /// A step resumed at `restarting` passes `marking` again on its way: the record
    /// keeps `restarting` (k3s may have been restarted), so a kill then is judged from
    /// it, never rolled back as "not restarted".
    #[test]
    fn phases_only_move_forward() {
        let r = LevelRecord::at(CP, BTreeMap::new()).begin(CP, EO).reach(Phase::Restarting);
        assert_eq!(r.reach(Phase::Marking).step.unwrap().phase, Phase::Restarting);
        assert_eq!(r.reach(Phase::Applied).step.unwrap().phase, Phase::Applied);
        assert_eq!(r.reach(Phase::Restoring).step.unwrap().phase, Phase::Restoring);
        let resumed = r.reach(Phase::Marking);
        let o = Observed {
            record: Some(&resumed),
            file: Some(EO),
            started: Some(EO),
            marks: Marks::Level(EO),
            keys: &BTreeMap::new(),
        };
        assert!(matches!(converge(&o, &flags), Decision::ResumeStep { .. }), "{:?}", converge(&o, &flags));
        // A new step starts from the beginning.
        assert_eq!(r.begin(EO, CP).step.unwrap().phase, Phase::Leased);
    }

    /// The default levels: full and control-plane run k3s alike; etcd-only differs.
    fn flags(a: Level, b: Level) -> bool {
        (a == EO) == (b == EO)
    }

    fn keys() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("cluster.level_label".to_string(), "regrade.dev/level".to_string()),
            ("cluster.taint_key".to_string(), "regrade.dev/stepped-down".to_string()),
            ("cluster.set_annotation".to_string(), "regrade.dev/set".to_string()),
            ("systemd.dropin".to_string(), "/etc/rancher/k3s/config.yaml.d/50-regrade.yaml".to_string()),
        ])
    }

    fn record(level: Level, step: Option<(Level, Level, Phase)>) -> LevelRecord {
        let mut r = LevelRecord::at(level, keys());
        r.step = step.map(|(from, to, phase)| StepInProgress { from, to, phase, started: 1 });
        r
    }

    fn decide(r: Option<&LevelRecord>, file: Option<Level>, started: Option<Level>, marks: Marks) -> Decision {
        let k = keys();
        converge(&Observed { record: r, file, started, marks, keys: &k }, &flags)
    }

    fn step(from: Level, to: Level, phase: Phase) -> StepInProgress {
        StepInProgress { from, to, phase, started: 1 }
    }

    #[test]
    fn record_round_trips_and_garbage_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/level.json");
        assert!(LevelRecord::read(&p).unwrap().is_none());
        let r = record(CP, Some((CP, EO, Phase::Restarting)));
        r.write(&p).unwrap();
        assert_eq!(LevelRecord::read(&p).unwrap().unwrap(), r);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o644);

        for (text, want) in [
            ("half a rec", "is not a regrade level record"),
            ("{\"level\": \"full\"}", "no \"version\""),
            ("{\"version\": 1, \"level\": \"fast\", \"updated\": 0}", "unknown variant"),
            ("{\"version\": 7, \"level\": \"full\"}", "has version 7"),
            (
                "{\"version\": 1, \"level\": \"full\", \"updated\": 0, \"step\": {\"from\": \"full\", \"to\": \
                 \"full\", \"phase\": \"leased\", \"started\": 0}}",
                "to itself",
            ),
        ] {
            std::fs::write(&p, text).unwrap();
            let e = LevelRecord::read(&p).unwrap_err().to_string();
            assert!(e.contains(p.to_str().unwrap()) && e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_step_records_its_phases() {
        let r = record(CP, None).begin(CP, EO);
        assert_eq!(r.step.as_ref().unwrap().phase, Phase::Leased);
        let r = r.reach(Phase::Restarting);
        assert_eq!((r.level, r.step.as_ref().unwrap().phase), (CP, Phase::Restarting));
        let r = r.settle(EO, keys());
        assert_eq!((r.level, r.step), (EO, None));
    }

    // Scenario 1 of issue 10: a reboot at control-plane wipes /run; the record on disk
    // still says control-plane, and k3s (started from an absent drop-in) runs full's
    // flags, which are control-plane's: the level stays control-plane.
    #[test]
    fn s1_reboot_at_control_plane_keeps_the_level() {
        let r = record(CP, None);
        assert_eq!(decide(Some(&r), Some(Full), Some(Full), Marks::Level(CP)), Decision::AtLevel { level: CP });
        // ... before k3s started through the hook, too.
        assert_eq!(decide(Some(&r), Some(Full), None, Marks::Level(CP)), Decision::AtLevel { level: CP });
        // At etcd-only: the drop-in survived the reboot with the record.
        let r = record(EO, None);
        assert_eq!(decide(Some(&r), Some(EO), Some(EO), Marks::Level(EO)), Decision::AtLevel { level: EO });
    }

    // Scenario 2: the API is unreachable at start. The level comes from the record
    // (control-plane, not full), and the marks are to be reconciled once it answers.
    #[test]
    fn s2_api_unreachable_at_start_keeps_the_level_and_reconciles_later() {
        let r = record(CP, None);
        let d = decide(Some(&r), Some(Full), Some(Full), Marks::Unknown);
        assert_eq!(d, Decision::ReconcileMarks { level: CP });
        // No record at all (an upgrade from a regrade without one): the level is k3s's
        // for now, the marks are reconciled (and the label adopted) once read.
        assert_eq!(decide(None, Some(Full), Some(Full), Marks::Unknown), Decision::ReconcileMarks { level: Full });
        assert_eq!(decide(None, Some(Full), Some(Full), Marks::Level(CP)), Decision::AtLevel { level: CP });
        // A label that cannot be true (etcd-only's flags are not running) is not adopted.
        assert_eq!(decide(None, Some(Full), Some(Full), Marks::Level(EO)), Decision::ReconcileMarks { level: Full });
    }

    // Scenario 3: a Node PATCH whose reply was lost. The step recorded `marking`
    // before the PATCH; whatever the API did, the next decision puts the marks right.
    #[test]
    fn s3_a_lost_reply_to_the_marks_is_reconciled() {
        let r = record(Full, Some((Full, CP, Phase::Marking)));
        // The PATCH went through: the Node says control-plane; the step is rolled
        // back (nothing was restarted) and the marks go back to full.
        let d = decide(Some(&r), Some(Full), Some(Full), Marks::Level(CP));
        assert_eq!(d, Decision::RollBack { step: step(Full, CP, Phase::Marking) });
        // After the rollback (record full), marks still at control-plane: reconciled.
        let r = record(Full, None);
        assert_eq!(
            decide(Some(&r), Some(Full), Some(Full), Marks::Level(CP)),
            Decision::ReconcileMarks { level: Full }
        );
    }

    // Scenario 4: the level is control-plane on record while k3s's start record says
    // full (reboot). A failed step to etcd-only is undone to the step's `from`
    // (control-plane), and the decision after it keeps control-plane.
    #[test]
    fn s4_a_failed_step_after_a_reboot_keeps_control_plane() {
        // The failed step restored control-plane's (absent) drop-in and k3s's record
        // says full again: same flags.
        let r = record(CP, None);
        assert_eq!(decide(Some(&r), Some(Full), Some(Full), Marks::Level(CP)), Decision::AtLevel { level: CP });
        // Killed during the restore: the record still has the step, k3s runs full's
        // flags: rolled back to control-plane, never to full.
        let r = record(CP, Some((CP, EO, Phase::Writing)));
        let d = decide(Some(&r), Some(EO), Some(Full), Marks::Level(EO));
        assert_eq!(d, Decision::RollBack { step: step(CP, EO, Phase::Writing) });
        assert_eq!(d.level(), CP);
    }

    // Scenario 5: killed during a step up etcd-only -> control-plane, in the health or
    // readiness wait. The restart was asked for: the step is finished (to
    // control-plane), never "corrected" to full.
    #[test]
    fn s5_killed_during_a_step_up_finishes_it_one_level() {
        for started in [Some(EO), Some(CP), Some(Full), None] {
            let r = record(EO, Some((EO, CP, Phase::Restarting)));
            let d = decide(Some(&r), Some(Full), started, Marks::Level(EO));
            assert_eq!(d, Decision::ResumeStep { step: step(EO, CP, Phase::Restarting) }, "{started:?}");
            assert_eq!(d.level(), CP, "one level up, not two");
        }
        // Once k3s served at control-plane, only the marks were left.
        let r = record(EO, Some((EO, CP, Phase::Applied)));
        assert_eq!(decide(Some(&r), Some(Full), Some(CP), Marks::Level(EO)), Decision::ReconcileMarks { level: CP });
    }

    /// The start's log line names what was found: the record (or why there is none),
    /// the file, the start record and the marks (the power-cut test reads it).
    #[test]
    fn what_was_found_is_said_in_words() {
        let k = keys();
        let r = record(CP, Some((CP, EO, Phase::Writing)));
        let seen = Observed { record: Some(&r), file: Some(EO), started: None, marks: Marks::Level(EO), keys: &k };
        assert_eq!(
            seen.describe("none"),
            "record: control-plane, step control-plane -> etcd-only at phase writing; k3s's file: etcd-only; \
             k3s started at: not recorded since boot; the Node's marks: etcd-only"
        );
        let seen = Observed { record: None, file: None, started: Some(Full), marks: Marks::Unknown, keys: &k };
        assert_eq!(
            seen.describe("unreadable (garbled)"),
            "record: unreadable (garbled); k3s's file: not regrade's; k3s started at: full; the Node's marks: not read"
        );
    }

    // Scenario 6: a hand step interrupted (Ctrl-C is now finished by the step itself;
    // SIGKILL leaves the record): converges like watch.
    #[test]
    fn s6_an_interrupted_hand_step_converges_like_watch() {
        // Killed with the drop-in written, before the restart: rolled back.
        let r = record(CP, Some((CP, EO, Phase::Writing)));
        let d = decide(Some(&r), Some(EO), Some(CP), Marks::Level(EO));
        assert_eq!(d, Decision::RollBack { step: step(CP, EO, Phase::Writing) });
        // ... unless k3s restarted with that drop-in meanwhile: finished.
        let d = decide(Some(&r), Some(EO), Some(EO), Marks::Level(EO));
        assert_eq!(d, Decision::ResumeStep { step: step(CP, EO, Phase::Writing) });
    }

    // Scenario 7: a key changed while below full is refused, naming the key and the
    // command to run first; at full any key may change.
    #[test]
    fn s7_a_changed_key_below_full_is_refused() {
        let mut r = record(CP, None);
        r.keys.insert("cluster.level_label".into(), "example.com/level".into());
        let d = decide(Some(&r), Some(Full), Some(Full), Marks::Unknown);
        let Decision::RefuseKeyChanged { key, recorded, configured, level, command } = &d else { panic!("{d:?}") };
        assert_eq!((key.as_str(), recorded.as_str(), level), ("cluster.level_label", "example.com/level", &CP));
        assert_eq!(configured, "regrade.dev/level");
        assert!(command.contains("regrade step to full") && command.contains("example.com/level"), "{command}");
        assert!(d.describe().contains("cluster.level_label"), "{}", d.describe());
        // The drop-in path too, and during a step.
        let mut r = record(CP, Some((CP, EO, Phase::Restarting)));
        r.keys.insert("systemd.dropin".into(), "/etc/rancher/k3s/config.yaml.d/10-old.yaml".into());
        assert!(matches!(decide(Some(&r), Some(EO), Some(EO), Marks::Level(EO)),
            Decision::RefuseKeyChanged { ref key, .. } if key == "systemd.dropin"));
        // At full, nothing of regrade's is out there: the new names apply.
        let mut r = record(Full, None);
        r.keys.insert("cluster.level_label".into(), "example.com/level".into());
        assert_eq!(decide(Some(&r), Some(Full), Some(Full), Marks::Level(Full)), Decision::AtLevel { level: Full });
    }

    /// Every kill point of the matrix, both directions, decided from the phase the
    /// record holds there and what k3s runs: the outcome is the step's `from` or its
    /// `to`, never further.
    #[test]
    fn every_kill_point_ends_one_level_from_where_it_started_at_most() {
        // (direction, phase recorded, start record after the kill, expected level)
        let cases = [
            ((CP, EO), Phase::Leased, CP, CP),
            ((CP, EO), Phase::Marking, CP, CP),
            ((CP, EO), Phase::Writing, CP, CP),
            ((CP, EO), Phase::Restarting, CP, EO),
            ((CP, EO), Phase::Restarting, EO, EO),
            ((EO, CP), Phase::Leased, EO, EO),
            ((EO, CP), Phase::Writing, EO, EO),
            ((EO, CP), Phase::Restarting, EO, CP),
            ((EO, CP), Phase::Restarting, CP, CP),
            ((EO, CP), Phase::Applied, CP, CP),
            ((Full, CP), Phase::Marking, Full, Full),
            ((CP, Full), Phase::Leased, CP, CP),
            ((CP, Full), Phase::Applied, Full, Full),
            ((CP, EO), Phase::Restoring, EO, CP),
            ((CP, EO), Phase::Restoring, CP, CP),
            ((EO, CP), Phase::Restoring, CP, EO),
        ];
        for ((from, to), phase, started, want) in cases {
            let r = record(from, Some((from, to, phase)));
            let file = if phase >= Phase::Writing { to } else { from };
            for marks in [Marks::Level(from), Marks::Level(to), Marks::Unknown] {
                let d = decide(Some(&r), Some(file), Some(started), marks);
                assert_eq!(d.level(), want, "{from} -> {to} at {phase}, k3s started at {started}, {marks:?}: {d:?}");
            }
        }
    }

    #[test]
    fn outside_changes_converge_on_the_running_k3s() {
        let r = record(CP, None);
        // A drop-in for etcd-only written, k3s not restarted with it: rewritten.
        let d = decide(Some(&r), Some(EO), Some(CP), Marks::Level(CP));
        assert_eq!(d, Decision::RewriteFile { level: CP, marks: false });
        // A drop-in nobody can read a level from: rewritten, and the marks too.
        assert_eq!(decide(Some(&r), None, Some(CP), Marks::Unknown), Decision::RewriteFile { level: CP, marks: true });
        // k3s was restarted with etcd-only's flags by someone: the record follows k3s.
        assert_eq!(decide(Some(&r), Some(EO), Some(EO), Marks::Level(CP)), Decision::ReconcileMarks { level: EO });
        // A label removed by hand: put back.
        assert_eq!(decide(Some(&r), Some(Full), Some(CP), Marks::Level(Full)), Decision::ReconcileMarks { level: CP });
    }
}
