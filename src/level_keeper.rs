//! The edge around [`crate::level_record`]: keeps the record on disk while a step runs
//! (each phase written before its effect), and paces the reconciliation of the Node's
//! marks (level-triggered, with backoff).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use crate::actuator::Actuator;
use crate::cluster::Cluster;
use crate::config::Config;
use crate::decide::Step;
use crate::level::Level;
use crate::level_record::{converge, Decision, LevelRecord, Marks, Observed, Phase};

/// A record file held open, with what identifies its contents as they were seen: the
/// inode, the size and the change time (any write changes it).
struct Seen {
    _file: File,
    id: FileId,
}

#[derive(PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
}

impl FileId {
    fn of(m: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::MetadataExt;
        FileId { dev: m.dev(), ino: m.ino(), size: m.size(), ctime: (m.ctime(), m.ctime_nsec()) }
    }
}

impl Seen {
    fn hold(file: File) -> Option<Seen> {
        let id = FileId::of(&file.metadata().ok()?);
        Some(Seen { _file: file, id })
    }

    /// Whether `path` names this file, unchanged since it was seen.
    fn still(&self, path: &Path) -> bool {
        std::fs::metadata(path).is_ok_and(|m| FileId::of(&m) == self.id)
    }

    /// The record at `path` and, if no write came while it was read, the file held.
    fn read(path: &Path) -> anyhow::Result<Option<(LevelRecord, Option<Seen>)>> {
        let mut file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let before = FileId::of(&file.metadata()?);
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let record = LevelRecord::parse(&bytes, path)?;
        let seen = Seen::hold(file).filter(|s| s.id == before);
        Ok(Some((record, seen)))
    }
}

#[cfg(test)]
thread_local! {
    /// How often this thread's `moved_on_disk` read the record file.
    static READS: Cell<u32> = const { Cell::new(0) };
}

fn count_read() {
    #[cfg(test)]
    READS.with(|n| n.set(n.get() + 1));
}

/// The level record of this server as a step sees it. `None` path: a dry run, which
/// must not change the record a real `watch` keeps.
pub struct Keeper {
    path: Option<PathBuf>,
    keys: BTreeMap<String, String>,
    current: RefCell<LevelRecord>,
    /// The record file as this process last wrote it or read `current` from, held open.
    seen: RefCell<Option<Seen>>,
    /// Set when a step may have left the Node's marks other than its outcome says (a
    /// PATCH whose reply never came: its effect at the API is unknown). Whoever ran
    /// the step reconciles the marks and clears it.
    pub marks_unsure: Cell<bool>,
}

impl Keeper {
    pub fn new(path: Option<PathBuf>, record: LevelRecord, keys: BTreeMap<String, String>) -> Keeper {
        Keeper { path, keys, current: RefCell::new(record), seen: RefCell::new(None), marks_unsure: Cell::new(false) }
    }

    pub fn record(&self) -> LevelRecord {
        self.current.borrow().clone()
    }

    pub fn level(&self) -> Level {
        self.current.borrow().level
    }

    pub fn keys(&self) -> &BTreeMap<String, String> {
        &self.keys
    }

    /// Takes `record` as the current one (written by another process: a hand step).
    pub fn adopt(&self, record: LevelRecord) {
        *self.current.borrow_mut() = record;
    }

    /// The record on disk now, if it can be read (`None` in a dry run).
    pub fn on_disk(&self) -> Option<LevelRecord> {
        LevelRecord::read(self.path.as_ref()?).ok().flatten()
    }

    /// Whether the record on disk is no longer the one this process holds: another
    /// process (a hand step, finished or killed) wrote it. Every decision to act is
    /// then made again from the disk. Never in a dry run. No record on disk is not a
    /// move (a start without one writes none until the Node has been read, and every
    /// step writes one), nor is one that cannot be read (the start decided without it,
    /// and deciding again would not change that).
    ///
    /// Told first without reading the file: under memory pressure the thrash has evicted
    /// it, and reading it back waits 0.15-0.25 s for a busy disk just before a step. The
    /// file this process last wrote (or read `current` from) is held open, so its inode
    /// stays in memory and its number is not reused; the path still naming that inode,
    /// with the size and change time seen then, is that file unchanged. Every writer of
    /// the record replaces it by a rename (a new inode); an edit in place changes its
    /// change time. Anything else is judged by reading the file, as before.
    pub fn moved_on_disk(&self) -> bool {
        let Some(path) = &self.path else { return false };
        let unchanged = self.seen.borrow().as_ref().is_some_and(|s| s.still(path));
        if unchanged {
            return false;
        }
        count_read();
        match Seen::read(path) {
            Ok(Some((on_disk, seen))) => {
                let moved = on_disk != *self.current.borrow();
                *self.seen.borrow_mut() = if moved { None } else { seen };
                moved
            }
            Ok(None) | Err(_) => false,
        }
    }

    /// Takes the one lock of stepping this server (see [`StepLock`]). `Ok(None)` in a
    /// dry run, which changes nothing.
    pub fn lock_steps(&self) -> anyhow::Result<Result<Option<StepLock>, Busy>> {
        match &self.path {
            Some(p) => Ok(StepLock::try_take(p)?.map(Some)),
            None => Ok(Ok(None)),
        }
    }

    pub fn put(&self, r: LevelRecord) -> anyhow::Result<()> {
        if let Some(p) = &self.path {
            // Until the write is known good, the file is judged by reading it.
            *self.seen.borrow_mut() = None;
            let file = r.write_kept(p)?;
            *self.seen.borrow_mut() = Seen::hold(file);
        }
        *self.current.borrow_mut() = r;
        Ok(())
    }

    /// Records `step` as begun, at `first`: the phase of the step's first effect (see
    /// `step::first_phase`). An error here means nothing was changed: the step must not
    /// go on.
    pub fn begin(&self, step: &Step, first: Phase) -> anyhow::Result<()> {
        let r = self.current.borrow().begin(step.from, step.to).reach(first);
        self.put(r)
    }

    /// Records that the step is about to have `phase`'s effect. A failure to write is
    /// logged: the effect goes ahead (stopping half-way would be worse), and a crash
    /// before the next write is judged from the phase before.
    ///
    /// A phase the record on disk is at or past already is not written again: phases
    /// only move forward, and each durable write under pressure waits on a busy disk.
    pub fn reach(&self, phase: Phase) {
        let there = self.current.borrow().step.as_ref().is_some_and(|s| s.phase >= phase);
        if there && self.seen.borrow().is_some() {
            return;
        }
        let r = self.current.borrow().reach(phase);
        if let Err(e) = self.put(r.clone()) {
            tracing::error!(error = %format!("{e:#}"), phase = %phase, "could not record the step's progress");
            *self.current.borrow_mut() = r;
        }
    }

    /// A step left at `restoring` (its rollback could not be finished): the undoing,
    /// to be finished under the Lease as a step from `to` back to `from`, recorded as
    /// that reversed step at `restarting` — what a start decides from the same record.
    pub fn unfinished_undoing(&self) -> Option<Step> {
        let s = self.record().step.filter(|s| s.phase == Phase::Restoring)?;
        let r = self.record().begin(s.to, s.from).reach(Phase::Restarting);
        if let Err(e) = self.put(r.clone()) {
            tracing::error!(error = %format!("{e:#}"), "could not record the undoing of the step");
            *self.current.borrow_mut() = r;
        }
        Some(Step::between(s.to, s.from))
    }

    /// Records the server at `level`, no step under way. Writes nothing when the
    /// record on disk says that already (a calm start writes nothing).
    pub fn settle(&self, level: Level) {
        let same = {
            let c = self.current.borrow();
            c.level == level && c.step.is_none() && c.keys == self.keys
        };
        if same && self.path.as_ref().is_none_or(|p| p.exists()) {
            return;
        }
        let r = self.current.borrow().settle(level, self.keys.clone());
        if let Err(e) = self.put(r.clone()) {
            tracing::error!(error = %format!("{e:#}"), level = %level, "could not record the level");
            *self.current.borrow_mut() = r;
        }
    }
}

/// The one lock of stepping this server: only the process holding it steps, changes
/// the level record or puts the Node's marks right. An exclusive `flock` on a file
/// beside the level record, so the kernel lets go of it when its process dies however
/// it dies (SIGKILL, OOM): a step it left in the record is found by the next holder,
/// which finishes or rolls it back from the record on disk. `watch` holds it for one
/// step or one convergence at a time; `regrade step` for its whole run. The file holds
/// the holder's PID, for the message of whoever finds it busy.
#[derive(Debug)]
pub struct StepLock {
    _file: File,
}

/// The lock is held by another live process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Busy {
    pub path: PathBuf,
    pub pid: Option<u32>,
}

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "another regrade process (PID {pid}) is stepping this server"),
            None => write!(f, "another regrade process is stepping this server"),
        }?;
        write!(f, " (it holds {})", self.path.display())
    }
}

impl StepLock {
    /// The lock file for the level record at `record`.
    pub fn path_for(record: &Path) -> PathBuf {
        let mut p = record.as_os_str().to_owned();
        p.push(".lock");
        PathBuf::from(p)
    }

    /// Takes the lock if no other process holds it; never waits.
    pub fn try_take(record: &Path) -> anyhow::Result<Result<StepLock, Busy>> {
        let path = Self::path_for(record);
        let open = || OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path);
        let mut file = match open() {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)
                        .map_err(|e| anyhow::anyhow!("creating {} for the step lock: {e}", dir.display()))?;
                }
                open().map_err(|e| anyhow::anyhow!("opening the step lock {}: {e}", path.display()))?
            }
            Err(e) => anyhow::bail!("opening the step lock {}: {e}", path.display()),
        };
        // flock(2), not File::try_lock: that needs a newer Rust than the crate's MSRV.
        // SAFETY: a plain syscall on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                anyhow::bail!("locking the step lock {}: {e}", path.display());
            }
            let mut held = String::new();
            let _ = file.read_to_string(&mut held);
            return Ok(Err(Busy { path, pid: held.trim().parse().ok() }));
        }
        // Who holds it, for the message of whoever finds it busy; not needed to lock.
        let _ = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| writeln!(file, "{}", std::process::id()));
        Ok(Ok(StepLock { _file: file }))
    }
}

/// The configuration keys naming what regrade puts on the Node and on disk, with
/// their values now (see [`LevelRecord::keys`]).
pub fn keys(cfg: &Config) -> BTreeMap<String, String> {
    let c = &cfg.cluster;
    let mut k = BTreeMap::from([
        ("cluster.level_label".to_string(), c.level_label.clone()),
        ("cluster.taint_key".to_string(), c.taint_key.clone()),
        ("cluster.set_annotation".to_string(), c.set_annotation.clone()),
    ]);
    if !cfg!(feature = "docker") {
        k.insert("systemd.dropin".to_string(), cfg.systemd.dropin.display().to_string());
    }
    k
}

/// What the Node's marks say now; `Unknown` when it cannot be read.
pub async fn read_marks(cluster: &dyn Cluster) -> Marks {
    match cluster.node_level().await {
        Ok(l) => Marks::Level(l.unwrap_or(Level::Full)),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "could not read the Node's marks; reconciling them once it answers");
            Marks::Unknown
        }
    }
}

/// What is left to do after the start-up decision, level-triggered: retried (with
/// backoff) until done.
#[derive(Clone, Debug, PartialEq)]
pub enum Pending {
    Nothing,
    /// Put the Node's marks right for the level held.
    Marks,
    /// Read the Node, then decide again from the record on disk: no record yet and
    /// the Node unread, or the record was changed by another process (a hand step,
    /// finished or killed mid-step) or could not be looked at for one.
    Adopt,
    /// Finish an interrupted step (under the Lease).
    Resume(Step),
}

/// The start-up decision, carried out as far as it goes without the API.
pub struct Start {
    pub keeper: Keeper,
    pub decision: Decision,
    pub pending: Pending,
}

impl Start {
    /// The level the core starts from (a step to resume starts from its `from`).
    pub fn level(&self) -> Level {
        match &self.pending {
            Pending::Resume(s) => s.from,
            _ => self.keeper.level(),
        }
    }
}

/// Reads the record and the world, decides ([`converge`]) and carries out what needs
/// no API (the actuator's file, the record); leaves the rest [`Pending`]. `marks`:
/// the Node's marks as read (or `Unknown`). Refuses a changed key.
pub async fn start(cfg: &Config, actuator: &mut dyn Actuator, marks: Marks) -> anyhow::Result<Start> {
    let path = cfg.level_record.clone();
    let keys = keys(cfg);
    let (record, no_record) = match LevelRecord::read(&path) {
        Ok(r) => (r, "none".to_string()),
        Err(e) => {
            tracing::error!(error = %e, "going on as if there were no level record");
            (None, format!("unreadable ({e})"))
        }
    };
    let (file, started) = actuator.observe().await?;
    let levels = cfg.levels.clone();
    let same = move |a: Level, b: Level| !levels.needs_restart(a, b);
    let observed = Observed { record: record.as_ref(), file, started, marks, keys: &keys };
    let decision = converge(&observed, &same);
    let found = observed.describe(&no_record);
    let had_record = record.is_some();
    let base = record.clone().unwrap_or_else(|| LevelRecord::at(started.or(file).unwrap_or(Level::Full), keys.clone()));
    let keeper = Keeper::new(Some(path), base, keys);
    match &decision {
        Decision::AtLevel { .. } => {
            tracing::info!(found = %found, decision = %decision.describe(), "the level record and the world")
        }
        _ => tracing::warn!(found = %found, decision = %decision.describe(), "the level record and the world disagree"),
    }
    let pending = match &decision {
        Decision::RefuseKeyChanged { .. } => anyhow::bail!("{}", decision.describe()),
        Decision::AtLevel { level } => {
            keeper.settle(*level);
            Pending::Nothing
        }
        Decision::ReconcileMarks { level } if !had_record && marks == Marks::Unknown => {
            // Nothing to write yet: the Node may say a lower level to adopt.
            keeper.adopt(LevelRecord::at(*level, keeper.keys().clone()));
            Pending::Adopt
        }
        Decision::ReconcileMarks { level } => {
            keeper.settle(*level);
            Pending::Marks
        }
        Decision::RewriteFile { level, marks } => {
            actuator.rewrite(*level).await?;
            keeper.settle(*level);
            if *marks {
                Pending::Marks
            } else {
                Pending::Nothing
            }
        }
        Decision::RollBack { step } => {
            actuator.rewrite(step.from).await?;
            keeper.settle(step.from);
            // The step may have marked the Node for `to`.
            if marks == Marks::Level(step.from) {
                Pending::Nothing
            } else {
                Pending::Marks
            }
        }
        Decision::ResumeStep { step } => {
            // A reversed step (an undoing under way) is recorded as such.
            if record.as_ref().and_then(|r| r.step.as_ref()).is_some_and(|s| s.from != step.from) {
                keeper.put(keeper.record().begin(step.from, step.to).reach(Phase::Restarting))?;
            }
            Pending::Resume(Step::between(step.from, step.to))
        }
    };
    Ok(Start { keeper, decision, pending })
}

/// When to try the Node's marks again: 1 s after a failure, doubling to 60 s.
#[derive(Debug)]
pub struct Backoff {
    delay: Duration,
    next: Instant,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_secs(1);
    pub const MAX: Duration = Duration::from_secs(60);

    /// Due at once.
    pub fn now() -> Backoff {
        Backoff { delay: Self::FIRST, next: Instant::now() }
    }

    pub fn due(&self) -> bool {
        Instant::now() >= self.next
    }

    /// After a failed try: wait, and twice as long the next time.
    pub fn failed(&mut self) -> Duration {
        let d = self.delay;
        self.next = Instant::now() + d;
        self.delay = (d * 2).min(Self::MAX);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::Direction;
    use std::os::unix::fs::MetadataExt;

    /// `moved_on_disk` tells the record this process wrote or read, unchanged, without
    /// reading it, and sees every write by another: a new file by rename (as every
    /// regrade writes it) and an edit in place of the same size.
    #[test]
    fn an_unchanged_record_is_told_without_reading_it_and_any_write_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("level.json");
        let keys = BTreeMap::from([("cluster.level_label".to_string(), "l".to_string())]);
        let k = Keeper::new(Some(p.clone()), LevelRecord::at(Level::ControlPlane, keys.clone()), keys.clone());
        let reads = || READS.with(Cell::get);
        k.settle(Level::ControlPlane);
        let r0 = reads();
        assert!(!k.moved_on_disk());
        assert_eq!(reads(), r0, "the record this process wrote was read back");
        // Another process's step: a new file by rename.
        LevelRecord::at(Level::EtcdOnly, keys.clone()).write(&p).unwrap();
        assert!(k.moved_on_disk(), "a record replaced by another process");
        k.adopt(LevelRecord::read(&p).unwrap().unwrap());
        assert!(!k.moved_on_disk());
        let r1 = reads();
        assert!(!k.moved_on_disk());
        assert_eq!(reads(), r1, "the record read once, unchanged, was read again");
        // The same bytes by rename: read, not moved.
        std::fs::write(dir.path().join("same"), std::fs::read(&p).unwrap()).unwrap();
        std::fs::rename(dir.path().join("same"), &p).unwrap();
        assert!(!k.moved_on_disk());
        assert_eq!(reads(), r1 + 1);
        // An edit in place, same size (a digit of `updated`), once the kernel's coarse
        // clock has passed the file's change time (a file changed twice within one tick
        // of that clock keeps its change time on kernels without fine-grained ones).
        let changed = {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(&p).unwrap();
            std::time::UNIX_EPOCH + Duration::new(m.ctime() as u64, m.ctime_nsec() as u32)
        };
        while std::time::SystemTime::now() < changed + Duration::from_millis(20) {
            std::thread::yield_now();
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let at = text.find("\"updated\": ").unwrap() + "\"updated\": ".len();
        let digit = text.as_bytes()[at];
        let other = if digit == b'1' { b'2' } else { b'1' };
        let mut f = OpenOptions::new().write(true).open(&p).unwrap();
        f.seek(std::io::SeekFrom::Start(at as u64)).unwrap();
        f.write_all(&[other]).unwrap();
        drop(f);
        assert!(k.moved_on_disk(), "a record edited in place");
    }

    #[test]
    fn a_step_is_on_disk_before_each_effect_and_settles() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("level.json");
        let keys = BTreeMap::from([("cluster.level_label".to_string(), "l".to_string())]);
        let k = Keeper::new(Some(p.clone()), LevelRecord::at(Level::ControlPlane, keys.clone()), keys);
        let step = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
        k.begin(&step, Phase::Marking).unwrap();
        let on_disk = || LevelRecord::read(&p).unwrap().unwrap();
        assert_eq!(on_disk().step.unwrap().phase, Phase::Marking);
        // A phase already recorded is not written again; a later one is.
        let written = std::fs::metadata(&p).unwrap().ino();
        k.reach(Phase::Leased);
        k.reach(Phase::Marking);
        assert_eq!(std::fs::metadata(&p).unwrap().ino(), written, "a phase already on disk was written again");
        k.reach(Phase::Restarting);
        assert_eq!(on_disk().step.unwrap().phase, Phase::Restarting);
        k.settle(Level::EtcdOnly);
        let r = on_disk();
        assert_eq!((r.level, &r.step), (Level::EtcdOnly, &None));
        // A dry run keeps it in memory only.
        let k = Keeper::new(None, r.clone(), BTreeMap::new());
        k.begin(&step, Phase::Marking).unwrap();
        assert_eq!(on_disk(), r);
    }

    #[tokio::test]
    async fn backoff_doubles_to_a_minute() {
        let mut b = Backoff::now();
        assert!(b.due());
        let waits: Vec<u64> = (0..9).map(|_| b.failed().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert!(!b.due(), "not due until the wait is over");
    }
}
