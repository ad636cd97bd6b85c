//! The edge around [`crate::level_record`]: keeps the record on disk while a step runs
//! (each phase written before its effect), and paces the reconciliation of the Node's
//! marks (level-triggered, with backoff).

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::decide::Step;
use crate::level::Level;
use crate::level_record::{LevelRecord, Phase};

/// The level record of this server as a step sees it. `None` path: a dry run, which
/// must not change the record a real `watch` keeps.
pub struct Keeper {
    path: Option<PathBuf>,
    keys: BTreeMap<String, String>,
    current: RefCell<LevelRecord>,
    /// Set when a step may have left the Node's marks other than its outcome says (a
    /// PATCH whose reply never came: its effect at the API is unknown). Whoever ran
    /// the step reconciles the marks and clears it.
    pub marks_unsure: Cell<bool>,
}

impl Keeper {
    pub fn new(path: Option<PathBuf>, record: LevelRecord, keys: BTreeMap<String, String>) -> Keeper {
        Keeper { path, keys, current: RefCell::new(record), marks_unsure: Cell::new(false) }
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

    fn put(&self, r: LevelRecord) -> anyhow::Result<()> {
        if let Some(p) = &self.path {
            r.write(p)?;
        }
        *self.current.borrow_mut() = r;
        Ok(())
    }

    /// Records `step` as begun (the Lease is held, nothing else changed). An error
    /// here means nothing was changed: the step must not go on.
    pub fn begin(&self, step: &Step) -> anyhow::Result<()> {
        let r = self.current.borrow().begin(step.from, step.to);
        self.put(r)
    }

    /// Records that the step is about to have `phase`'s effect. A failure to write is
    /// logged: the effect goes ahead (stopping half-way would be worse), and a crash
    /// before the next write is judged from the phase before.
    pub fn reach(&self, phase: Phase) {
        let r = self.current.borrow().reach(phase);
        if let Err(e) = self.put(r.clone()) {
            tracing::error!(error = %format!("{e:#}"), phase = %phase, "could not record the step's progress");
            *self.current.borrow_mut() = r;
        }
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

    #[test]
    fn a_step_is_on_disk_before_each_effect_and_settles() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("level.json");
        let keys = BTreeMap::from([("cluster.level_label".to_string(), "l".to_string())]);
        let k = Keeper::new(Some(p.clone()), LevelRecord::at(Level::ControlPlane, keys.clone()), keys);
        let step = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
        k.begin(&step).unwrap();
        let on_disk = || LevelRecord::read(&p).unwrap().unwrap();
        assert_eq!(on_disk().step.unwrap().phase, Phase::Leased);
        k.reach(Phase::Restarting);
        assert_eq!(on_disk().step.unwrap().phase, Phase::Restarting);
        k.settle(Level::EtcdOnly);
        let r = on_disk();
        assert_eq!((r.level, &r.step), (Level::EtcdOnly, &None));
        // A dry run keeps it in memory only.
        let k = Keeper::new(None, r.clone(), BTreeMap::new());
        k.begin(&step).unwrap();
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
