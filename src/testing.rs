//! The one set of fakes for [`Actuator`], [`Cluster`] and [`NodeReadiness`], for the
//! unit tests (`cfg(test)`) and the integration tests under `tests/` (the `testing`
//! feature, which the crate's dev-dependency on itself turns on). Not in a release
//! build.
//!
//! Each fake records what it was asked in a shared [`Log`], so a test can check the
//! order of effects across the actuator and the cluster.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::actuator::restart::{self, Purpose};
use crate::actuator::{Actuator, NodeReadiness};
use crate::cluster::{Cluster, Refusal, StepEvent};
use crate::decide::Step;
use crate::level::Level;
use crate::level_record::Phase;
use crate::levels::LevelsConfig;

/// Every call, in order, shared by the fakes that log to it.
#[derive(Clone, Default)]
pub struct Log(Rc<RefCell<Vec<String>>>);

impl Log {
    pub fn push(&self, s: impl Into<String>) {
        self.0.borrow_mut().push(s.into());
    }

    pub fn take(&self) -> Vec<String> {
        self.0.take()
    }

    /// Whether `what` was logged (and not taken yet).
    pub fn has(&self, what: &str) -> bool {
        self.0.borrow().iter().any(|s| s == what)
    }
}

/// k3s as a level in memory. `level` is shared, so a test can change it behind the
/// back of whoever holds the actuator (a hand step, as `watch` sees it).
pub struct FakeActuator {
    pub level: Rc<Cell<Level>>,
    /// `apply_level` fails (after logging) and leaves the level as it was.
    pub fail: bool,
    /// How long `apply_level` takes (a restart); zero: it yields once, so a Lease
    /// renewal can run meanwhile.
    pub apply_takes: Duration,
    /// The phases `apply_level` reports before it takes `apply_takes`.
    pub reports: &'static [Phase],
    /// `roll_back` fails (a bus that does not answer).
    pub fail_roll_back: bool,
    /// How long each restart's request takes to reach the manager (its bound for the
    /// Lease, `restart::Request::timeout`): a slow bus.
    pub request_takes: Duration,
    /// A failed restart is undone as the real actuators undo it: its restart back
    /// through the one function that sends restarts (`restart::send`, back), and
    /// left pending when that cannot go now. Otherwise `fail` only says it restored.
    pub undoes: bool,
    /// Each restart that reached k3s: into which level, and when (tokio's clock).
    pub restarts: Rc<RefCell<Vec<(Level, tokio::time::Instant)>>>,
    /// This many `apply_level` calls from now never return (shared: the test counts
    /// them down from outside).
    pub hangs: Rc<Cell<u32>>,
    pub log: Log,
}

impl FakeActuator {
    pub fn at(level: Level) -> FakeActuator {
        FakeActuator {
            level: Rc::new(Cell::new(level)),
            fail: false,
            apply_takes: Duration::ZERO,
            reports: &[],
            fail_roll_back: false,
            request_takes: Duration::ZERO,
            undoes: false,
            restarts: Rc::default(),
            hangs: Rc::new(Cell::new(0)),
            log: Log::default(),
        }
    }

    pub fn logging_to(mut self, log: &Log) -> FakeActuator {
        self.log = log.clone();
        self
    }

    pub fn failing(mut self) -> FakeActuator {
        self.fail = true;
        self
    }

    pub fn taking(mut self, d: Duration) -> FakeActuator {
        self.apply_takes = d;
        self
    }

    pub fn level(&self) -> Level {
        self.level.get()
    }

    /// A restart's request through the one function that sends restarts, kept in
    /// `restarts` when it reaches k3s.
    async fn request(&self, readiness: &dyn NodeReadiness, purpose: Purpose, level: Level) -> anyhow::Result<()> {
        let request =
            restart::Request { purpose, what: format!("k3s into {level}"), timeout: self.request_takes, write: None };
        let asked = async {
            tokio::time::sleep(self.request_takes).await;
            self.restarts.borrow_mut().push((level, tokio::time::Instant::now()));
            anyhow::Ok(())
        };
        restart::send(readiness, request, asked).await
    }
}

#[async_trait(?Send)]
impl Actuator for FakeActuator {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }

    async fn current_level(&self) -> anyhow::Result<Level> {
        Ok(self.level.get())
    }

    async fn apply_level(&mut self, level: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        // The restart's request: at once where the test says the actuator reached
        // `restarting` (the time it takes is then the wait for k3s), else after it
        // (the time is then what comes before the file).
        let restart = LevelsConfig::default().needs_restart(self.level.get(), level);
        let sent_first = restart && self.reports.contains(&Phase::Restarting);
        if sent_first {
            self.request(readiness, Purpose::Forward, level).await?;
        }
        for &phase in self.reports {
            readiness.progress(phase);
        }
        if self.hangs.get() > 0 {
            self.hangs.set(self.hangs.get() - 1);
            return std::future::pending().await;
        }
        if self.apply_takes.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(self.apply_takes).await;
        }
        if restart && !sent_first {
            self.request(readiness, Purpose::Forward, level).await?;
        }
        self.log.push(format!("apply {level}"));
        if self.fail {
            let (from, failed) = (self.level.get(), format!("the restart into {level} never became healthy"));
            if self.undoes && restart {
                if let Err(e) = self.request(readiness, Purpose::Back, from).await {
                    return Err(crate::actuator::undo_pending(readiness, e, &failed, from));
                }
            }
            anyhow::bail!("{failed}; restored {from}");
        }
        self.level.set(level);
        Ok(())
    }

    async fn roll_back(
        &mut self,
        from: Level,
        restarted: bool,
        readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<String> {
        if self.fail_roll_back {
            self.log.push(format!("roll back to {from}: the bus did not answer"));
            anyhow::bail!("the bus did not answer");
        }
        if restarted {
            self.request(readiness, Purpose::Back, from).await?;
        }
        self.log.push(format!("roll back to {from}{}", if restarted { ", restarting" } else { "" }));
        self.level.set(from);
        Ok(format!("back at {from}"))
    }
}

/// The Node's level label as [`FakeCluster`] keeps it, shared so that a test can read
/// or change it behind the back of whoever holds the cluster; `Err`: the Node cannot
/// be read (nor marked), with that message.
pub type Label = Rc<RefCell<Result<Option<Level>, String>>>;

/// The cluster: refuses with `refuse` (if set) at preflight and acquire, loses the
/// Lease at once while a step runs (`lose_lease`), fails to mark the Node
/// (`fail_marks`, or while `label` is unreadable), and keeps the Node's label in
/// `label` (a mark sets it).
pub struct FakeCluster {
    pub refuse: Option<Refusal>,
    pub lose_lease: bool,
    /// While a step runs, the Lease is renewed this often (logged); `None`: silently.
    pub renew_every: Option<Duration>,
    /// No renewal lands after `acquire`: the Lease is surely ours only this long
    /// after it (`Cluster::lease_safe_until`); `None`: for as long as it is held (a
    /// day).
    pub renewals_fail_after: Option<Duration>,
    /// When the Lease was taken (tokio's clock); `None` once released.
    pub acquired: Cell<Option<tokio::time::Instant>>,
    /// How long marking the Node takes.
    pub marks_take: Duration,
    pub fail_marks: bool,
    pub label: Label,
    /// What a drain reports (`None`: nothing drained, as a dry run).
    pub drained: Option<crate::cluster::drain::DrainReport>,
    /// How long recording an Event takes (logged when it ends).
    pub events_take: Duration,
    pub log: Log,
}

impl Default for FakeCluster {
    fn default() -> FakeCluster {
        FakeCluster {
            refuse: None,
            lose_lease: false,
            renew_every: None,
            renewals_fail_after: None,
            acquired: Cell::new(None),
            marks_take: Duration::ZERO,
            fail_marks: false,
            label: Rc::new(RefCell::new(Ok(None))),
            drained: None,
            events_take: Duration::ZERO,
            log: Log::default(),
        }
    }
}

impl FakeCluster {
    pub fn logging_to(log: &Log) -> FakeCluster {
        FakeCluster { log: log.clone(), ..Default::default() }
    }

    /// A Node labelled `label` (`Err`: unreadable, with that message).
    pub fn labelled(label: Result<Option<Level>, &str>) -> FakeCluster {
        FakeCluster { label: Rc::new(RefCell::new(label.map_err(str::to_string))), ..Default::default() }
    }
}

#[async_trait(?Send)]
impl NodeReadiness for FakeCluster {
    async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
        Ok(())
    }
}

#[async_trait(?Send)]
impl Cluster for FakeCluster {
    async fn preflight(&self, _: &Step) -> Result<(), Refusal> {
        self.log.push("preflight");
        self.refuse.clone().map_or(Ok(()), Err)
    }

    async fn acquire(&self, _: &Step) -> Result<(), Refusal> {
        self.log.push("acquire");
        self.refuse.clone().map_or(Ok(()), Err)?;
        self.acquired.set(Some(tokio::time::Instant::now()));
        Ok(())
    }

    fn lease_safe_until(&self) -> Option<tokio::time::Instant> {
        Some(self.acquired.get()? + self.renewals_fail_after.unwrap_or(Duration::from_secs(86_400)))
    }

    async fn hold(&self) -> anyhow::Error {
        if self.lose_lease {
            self.log.push("lease lost");
            return anyhow::anyhow!("lease taken by server-2");
        }
        let Some(every) = self.renew_every else { return std::future::pending().await };
        loop {
            tokio::time::sleep(every).await;
            self.log.push("renew");
        }
    }

    async fn release(&self) {
        self.log.push("release");
        self.acquired.set(None);
    }

    async fn mark_node(&self, level: Level, _: &LevelsConfig) -> anyhow::Result<()> {
        self.log.push(format!("mark {level}"));
        if !self.marks_take.is_zero() {
            tokio::time::sleep(self.marks_take).await;
        }
        if self.fail_marks {
            anyhow::bail!("503 from every endpoint");
        }
        if let Err(e) = &*self.label.borrow() {
            anyhow::bail!("{e}");
        }
        *self.label.borrow_mut() = Ok((level != Level::Full).then_some(level));
        Ok(())
    }

    async fn node_level(&self) -> anyhow::Result<Option<Level>> {
        self.label.borrow().clone().map_err(|e| anyhow::anyhow!("{e}"))
    }

    async fn record(&self, e: StepEvent<'_>) {
        if !self.events_take.is_zero() {
            tokio::time::sleep(self.events_take).await;
        }
        self.log.push(match e {
            StepEvent::Done(_) => "event done",
            StepEvent::Failed(..) => "event failed",
            StepEvent::Refused(..) => "event refused",
            StepEvent::Drained(..) => "event drained",
        });
    }

    async fn drain(
        &self,
        _: Level,
        _: crate::cluster::drain::DrainSettings,
    ) -> Option<crate::cluster::drain::DrainReport> {
        // Logged only when set: the other tests' logs have no drain in them.
        let report = self.drained.clone()?;
        self.log.push("drain");
        Some(report)
    }
}

/// Stands in for the cluster's readiness wait in the actuator tests (the wait itself is
/// tested against a real API server in tests/testsuite/cluster_node.rs, and end to end): records
/// the restart time each wait was asked for, and each phase the actuator reported.
#[derive(Default)]
pub struct Readiness(pub RefCell<Vec<SystemTime>>, pub RefCell<Vec<Phase>>);

#[async_trait(?Send)]
impl NodeReadiness for Readiness {
    async fn wait_ready_since(&self, since: SystemTime, _timeout: Duration) -> anyhow::Result<()> {
        self.0.borrow_mut().push(since);
        Ok(())
    }
    fn progress(&self, phase: Phase) {
        self.1.borrow_mut().push(phase);
    }
}
