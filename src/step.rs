//! Running one step (SPEC §3 step 5, §4): the edge between the pure core and the
//! world. Takes the Lease (with the peer check), marks the Node and applies the level
//! in the order that keeps the Node's marks true, renews the Lease while the actuator
//! works, releases it as soon as the step returns, and records an Event.

use crate::actuator::Actuator;
use crate::cluster::{Cluster, Refusal, StepEvent};
use crate::config::LevelsConfig;
use crate::decide::{Direction, Step};
use crate::level::Level;
use crate::metrics::{StepResult, METRICS};
use std::time::{Instant, SystemTime};

#[derive(Debug)]
pub enum Outcome {
    /// The step ran and k3s is at `step.to`.
    Done,
    /// The step ran and failed; k3s is at `level` (normally `step.from`, restored).
    Failed { level: Level, error: anyhow::Error },
    /// The step did not run; nothing changed.
    Refused(Refusal),
}

impl Outcome {
    /// The level k3s is at after a step that ran; `None` when it was refused.
    pub fn level_after(&self, step: &Step) -> Option<Level> {
        match self {
            Outcome::Done => Some(step.to),
            Outcome::Failed { level, .. } => Some(*level),
            Outcome::Refused(_) => None,
        }
    }
}

/// Runs `step` and counts its outcome in [`METRICS`] (refusal kind, or result and
/// duration; the Lease held meanwhile).
pub async fn run(step: &Step, actuator: &mut dyn Actuator, cluster: &dyn Cluster, levels: &LevelsConfig) -> Outcome {
    let started = Instant::now();
    let outcome = run_uncounted(step, actuator, cluster, levels).await;
    METRICS.set_lease_held(false);
    let result = match &outcome {
        Outcome::Refused(r) => {
            METRICS.refused(r.kind);
            return outcome;
        }
        Outcome::Done => StepResult::Done,
        Outcome::Failed { .. } => StepResult::Failed,
    };
    METRICS.step_ran(step.direction, result, started.elapsed(), SystemTime::now());
    outcome
}

async fn run_uncounted(
    step: &Step,
    actuator: &mut dyn Actuator,
    cluster: &dyn Cluster,
    levels: &LevelsConfig,
) -> Outcome {
    // Read-only first: while a peer is down, a pressured server retries every sample,
    // and must not write the Lease (take and give back) each time.
    if let Err(refusal) = cluster.preflight(step).await {
        return Outcome::Refused(refusal);
    }
    if let Err(refusal) = cluster.acquire(step).await {
        return Outcome::Refused(refusal);
    }
    METRICS.set_lease_held(true);
    // Down: the marks go first (cordon and taint free memory before any restart). If
    // they cannot be set, nothing has changed yet: that is a refusal, not a failed step.
    if step.direction == Direction::Down {
        if let Err(e) = cluster.mark_node(step.to, levels).await {
            cluster.release().await;
            return Outcome::Refused(Refusal {
                kind: "api-error",
                subject: "node-marks".into(),
                message: format!("could not mark the Node: {e:#}"),
            });
        }
    }
    let result = {
        let applying = apply(step, &mut *actuator, cluster, levels);
        tokio::pin!(applying);
        tokio::select! {
            r = &mut applying => r,
            lost = cluster.hold() => {
                // A restart cannot be taken back half-way: cancelling it would leave k3s
                // and the Node's marks at no level at all. Finish it, and say so loudly.
                tracing::error!(error = %format!("{lost:#}"), "lost the Lease while stepping; finishing the step");
                applying.await
            }
        }
    };
    cluster.release().await;
    match result {
        Ok(()) => {
            cluster.record(StepEvent::Done(step)).await;
            Outcome::Done
        }
        Err(error) => {
            let level = actuator.current_level().await.unwrap_or(step.from);
            let text = format!("{error:#}");
            cluster.record(StepEvent::Failed(step, &text)).await;
            Outcome::Failed { level, error }
        }
    }
}

/// Down (marks already set by [`run`]): apply. Up: apply first, then mark, so the Node
/// never claims a level k3s is not at yet. If applying fails on the way down, the
/// marks go back to the level the actuator restored.
async fn apply(
    step: &Step,
    actuator: &mut dyn Actuator,
    cluster: &dyn Cluster,
    levels: &LevelsConfig,
) -> anyhow::Result<()> {
    match step.direction {
        Direction::Down => {
            if let Err(e) = actuator.apply_level(step.to, cluster).await {
                let back = actuator.current_level().await.unwrap_or(step.from);
                if let Err(m) = cluster.mark_node(back, levels).await {
                    tracing::error!(error = %format!("{m:#}"), level = %back, "could not put the Node's marks back");
                }
                return Err(e);
            }
            Ok(())
        }
        Direction::Up => {
            actuator.apply_level(step.to, cluster).await?;
            cluster.mark_node(step.to, levels).await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actuator::NodeReadiness;
    use async_trait::async_trait;
    use std::cell::RefCell;
    use std::time::{Duration, SystemTime};

    /// Records every call in order, so tests can check the order of effects.
    #[derive(Default)]
    struct Log(RefCell<Vec<String>>);
    impl Log {
        fn push(&self, s: impl Into<String>) {
            self.0.borrow_mut().push(s.into());
        }
        fn take(&self) -> Vec<String> {
            self.0.take()
        }
    }

    struct FakeActuator<'a> {
        level: Level,
        fail: bool,
        log: &'a Log,
    }

    #[async_trait(?Send)]
    impl Actuator for FakeActuator<'_> {
        fn levels(&self) -> &[Level] {
            &Level::ALL
        }
        async fn current_level(&self) -> anyhow::Result<Level> {
            Ok(self.level)
        }
        async fn apply_level(&mut self, level: Level, _: &dyn NodeReadiness) -> anyhow::Result<()> {
            // Like a real restart, give the Lease renewal a chance to run meanwhile.
            tokio::task::yield_now().await;
            self.log.push(format!("apply {level}"));
            if self.fail {
                anyhow::bail!("restart never became healthy; restored {}", self.level);
            }
            self.level = level;
            Ok(())
        }
    }

    struct FakeCluster<'a> {
        refuse: Option<Refusal>,
        log: &'a Log,
        lose_lease: bool,
        fail_marks: bool,
    }

    #[async_trait(?Send)]
    impl NodeReadiness for FakeCluster<'_> {
        async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
            Ok(())
        }
    }

    #[async_trait(?Send)]
    impl Cluster for FakeCluster<'_> {
        async fn preflight(&self, _: &Step) -> Result<(), Refusal> {
            self.log.push("preflight");
            self.refuse.clone().map_or(Ok(()), Err)
        }
        async fn acquire(&self, _: &Step) -> Result<(), Refusal> {
            self.log.push("acquire");
            self.refuse.clone().map_or(Ok(()), Err)
        }
        async fn hold(&self) -> anyhow::Error {
            if self.lose_lease {
                self.log.push("lease lost");
                return anyhow::anyhow!("lease taken by server-2");
            }
            std::future::pending().await
        }
        async fn release(&self) {
            self.log.push("release");
        }
        async fn mark_node(&self, level: Level, _: &LevelsConfig) -> anyhow::Result<()> {
            self.log.push(format!("mark {level}"));
            if self.fail_marks {
                anyhow::bail!("503 from every endpoint");
            }
            Ok(())
        }
        async fn record(&self, e: StepEvent<'_>) {
            self.log.push(match e {
                StepEvent::Done(_) => "event done",
                StepEvent::Failed(..) => "event failed",
                StepEvent::Refused(..) => "event refused",
            });
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
    }

    const DOWN: Step = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
    const UP: Step = Step { direction: Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane };

    #[test]
    fn down_marks_before_applying_and_releases_after() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::ControlPlane, fail: false, log: &log };
        let c = FakeCluster { refuse: None, log: &log, lose_lease: false, fail_marks: false };
        let out = block_on(run(&DOWN, &mut a, &c, &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Done));
        assert_eq!(log.take(), ["preflight", "acquire", "mark etcd-only", "apply etcd-only", "release", "event done"]);
        assert_eq!(a.level, Level::EtcdOnly);
    }

    #[test]
    fn up_applies_before_marking() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::EtcdOnly, fail: false, log: &log };
        let c = FakeCluster { refuse: None, log: &log, lose_lease: false, fail_marks: false };
        let out = block_on(run(&UP, &mut a, &c, &LevelsConfig::default()));
        assert_eq!(out.level_after(&UP), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            ["preflight", "acquire", "apply control-plane", "mark control-plane", "release", "event done"]
        );
    }

    #[test]
    fn a_failed_down_step_puts_the_marks_back() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::ControlPlane, fail: true, log: &log };
        let c = FakeCluster { refuse: None, log: &log, lose_lease: false, fail_marks: false };
        let out = block_on(run(&DOWN, &mut a, &c, &LevelsConfig::default()));
        assert_eq!(out.level_after(&DOWN), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "acquire",
                "mark etcd-only",
                "apply etcd-only",
                "mark control-plane",
                "release",
                "event failed"
            ]
        );
    }

    /// The fake actuator's apply yields once, so a Lease loss is seen mid-apply.
    #[test]
    fn losing_the_lease_mid_step_finishes_the_step() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::ControlPlane, fail: false, log: &log };
        let c = FakeCluster { refuse: None, log: &log, lose_lease: true, fail_marks: false };
        let out = block_on(run(&DOWN, &mut a, &c, &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Done), "{out:?}");
        assert_eq!(a.level, Level::EtcdOnly);
        let calls = log.take();
        assert!(calls.contains(&"lease lost".to_string()), "{calls:?}");
        assert!(calls.contains(&"apply etcd-only".to_string()), "{calls:?}");
    }

    #[test]
    fn a_mark_failure_before_anything_changed_is_a_refusal() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::ControlPlane, fail: false, log: &log };
        let c = FakeCluster { refuse: None, log: &log, lose_lease: false, fail_marks: true };
        let out = block_on(run(&DOWN, &mut a, &c, &LevelsConfig::default()));
        assert!(matches!(&out, Outcome::Refused(r) if r.kind == "api-error" && r.message.contains("503")), "{out:?}");
        assert_eq!(log.take(), ["preflight", "acquire", "mark etcd-only", "release"]);
        assert_eq!(a.level, Level::ControlPlane, "k3s untouched");
    }

    #[test]
    fn a_refused_step_touches_nothing() {
        let log = Log::default();
        let mut a = FakeActuator { level: Level::ControlPlane, fail: false, log: &log };
        let refusal = Refusal { kind: "lease-held", subject: "server-2".into(), message: "held by server-2".into() };
        let c = FakeCluster { refuse: Some(refusal.clone()), log: &log, lose_lease: false, fail_marks: false };
        let out = block_on(run(&DOWN, &mut a, &c, &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Refused(r) if r == refusal));
        assert_eq!(log.take(), ["preflight"], "refused read-only: the Lease was never written");
        assert_eq!(a.level, Level::ControlPlane);
    }
}
