//! Running one step (docs/behaviour.md, "Decision rules" and "Coordination"): the edge
//! between the pure core and the world. Takes the Lease (with the peer check), marks the Node and applies the level
//! in the order that keeps the Node's marks true, renews the Lease while the actuator
//! works, releases it as soon as the step returns, and records an Event.

use crate::actuator::Actuator;
use crate::cluster::{Cluster, Refusal, RefusalKind, StepEvent};
use crate::decide::{Direction, Step};
use crate::etcd::RestartGate;
use crate::level::Level;
use crate::levels::LevelsConfig;
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
///
/// A step that restarts k3s (into or out of `etcd-only`) also asks etcd itself, through
/// `etcd`, before anything changes — once read-only, once more under the Lease — and
/// after the restart holds the Lease until this member is back and caught up. A step
/// without a restart (`control-plane` <-> `full`) is not the etcd gate's business.
pub async fn run(
    step: &Step,
    actuator: &mut dyn Actuator,
    cluster: &dyn Cluster,
    etcd: &dyn RestartGate,
    levels: &LevelsConfig,
) -> Outcome {
    let started = Instant::now();
    let outcome = run_uncounted(step, actuator, cluster, etcd, levels).await;
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
    etcd: &dyn RestartGate,
    levels: &LevelsConfig,
) -> Outcome {
    let restart = levels.needs_restart(step.from, step.to);
    // Read-only first: while a peer is down, a pressured server retries every sample,
    // and must not write the Lease (take and give back) each time.
    if let Err(refusal) = cluster.preflight(step).await {
        return Outcome::Refused(refusal);
    }
    if restart {
        if let Err(refusal) = etcd.before_restart().await {
            return Outcome::Refused(refusal);
        }
    }
    if let Err(refusal) = cluster.acquire(step).await {
        return Outcome::Refused(refusal);
    }
    METRICS.set_lease_held(true);
    // Under the Lease, the answer that counts: another server's restart may have ended
    // (and its Lease been released) between the two looks only once its member was back.
    let me = if restart {
        match etcd.before_restart().await {
            Ok(me) => Some(me),
            Err(refusal) => {
                cluster.release().await;
                return Outcome::Refused(refusal);
            }
        }
    } else {
        None
    };
    // Down: the marks go first (cordon and taint free memory before any restart). If
    // they cannot be set, nothing has changed yet: that is a refusal, not a failed step.
    if step.direction == Direction::Down {
        if let Err(e) = cluster.mark_node(step.to, levels).await {
            cluster.release().await;
            return Outcome::Refused(Refusal {
                kind: RefusalKind::ApiError,
                subject: "node-marks".into(),
                message: format!("could not mark the Node: {e:#}"),
            });
        }
    }
    let result = {
        let applying = async {
            apply(step, &mut *actuator, cluster, levels).await?;
            match me {
                // The Lease is held until this member is back, healthy and caught up:
                // only then may another server restart its own.
                Some(me) => etcd.after_restart(me).await.map(|()| {
                    tracing::info!(level = %step.to, "this etcd member is back and caught up after the restart");
                }),
                None => Ok(()),
            }
        };
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
    use crate::etcd::restart::MemberState;
    use crate::testing::{FakeActuator, FakeCluster, Log};
    use async_trait::async_trait;

    /// The etcd gate as the step sees it: logs its calls, refuses or fails when told.
    struct Gate {
        log: Log,
        refuse: Option<Refusal>,
        not_back: bool,
    }

    impl Gate {
        fn logging_to(log: &Log) -> Gate {
            Gate { log: log.clone(), refuse: None, not_back: false }
        }
    }

    #[async_trait(?Send)]
    impl RestartGate for Gate {
        async fn before_restart(&self) -> Result<u64, Refusal> {
            self.log.push("etcd check");
            self.refuse.clone().map_or(Ok(7), Err)
        }
        async fn after_restart(&self, me: u64) -> anyhow::Result<()> {
            self.log.push(format!("etcd back {me}"));
            if self.not_back {
                anyhow::bail!("this etcd member was not back and caught up within etcd.catch_up_timeout = 1s");
            }
            Ok(())
        }
        async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
            Ok(vec![])
        }
    }

    fn etcd_refusal() -> Refusal {
        Refusal {
            kind: RefusalKind::EtcdMemberUnhealthy,
            subject: "server3-1a2b3c4d:unreachable".into(),
            message: "etcd member server3-1a2b3c4d (Node server3): unreachable: connection refused".into(),
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
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Done));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "apply etcd-only",
                "etcd back 7",
                "release",
                "event done"
            ]
        );
        assert_eq!(a.level(), Level::EtcdOnly);
    }

    #[test]
    fn up_applies_before_marking() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::EtcdOnly).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let out = block_on(run(&UP, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert_eq!(out.level_after(&UP), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "apply control-plane",
                "mark control-plane",
                "etcd back 7",
                "release",
                "event done"
            ]
        );
    }

    #[test]
    fn a_failed_down_step_puts_the_marks_back() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log).failing();
        let c = FakeCluster::logging_to(&log);
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert_eq!(out.level_after(&DOWN), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
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
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster { lose_lease: true, ..FakeCluster::logging_to(&log) };
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Done), "{out:?}");
        assert_eq!(a.level(), Level::EtcdOnly);
        let calls = log.take();
        assert!(calls.contains(&"lease lost".to_string()), "{calls:?}");
        assert!(calls.contains(&"apply etcd-only".to_string()), "{calls:?}");
    }

    #[test]
    fn a_mark_failure_before_anything_changed_is_a_refusal() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster { fail_marks: true, ..FakeCluster::logging_to(&log) };
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert!(matches!(&out, Outcome::Refused(r) if r.kind == "api-error" && r.message.contains("503")), "{out:?}");
        assert_eq!(log.take(), ["preflight", "etcd check", "acquire", "etcd check", "mark etcd-only", "release"]);
        assert_eq!(a.level(), Level::ControlPlane, "k3s untouched");
    }

    #[test]
    fn a_refused_step_touches_nothing() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let refusal =
            Refusal { kind: RefusalKind::LeaseHeld, subject: "server-2".into(), message: "held by server-2".into() };
        let c = FakeCluster { refuse: Some(refusal.clone()), ..FakeCluster::logging_to(&log) };
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Refused(r) if r == refusal));
        assert_eq!(log.take(), ["preflight"], "refused read-only: the Lease was never written");
        assert_eq!(a.level(), Level::ControlPlane);
    }

    #[test]
    fn an_etcd_refusal_before_a_restart_touches_nothing_and_writes_no_lease() {
        for step in [DOWN, UP] {
            let log = Log::default();
            let mut a = FakeActuator::at(step.from).logging_to(&log);
            let c = FakeCluster::logging_to(&log);
            let g = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
            let out = block_on(run(&step, &mut a, &c, &g, &LevelsConfig::default()));
            assert!(matches!(&out, Outcome::Refused(r) if *r == etcd_refusal()), "{out:?}");
            assert_eq!(log.take(), ["preflight", "etcd check"], "read-only: no Lease, no marks, no apply");
            assert_eq!(a.level(), step.from);
        }
    }

    #[test]
    fn the_lease_is_released_only_after_this_member_is_back() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let g = Gate { not_back: true, ..Gate::logging_to(&log) };
        let out = block_on(run(&DOWN, &mut a, &c, &g, &LevelsConfig::default()));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s is at the new level; only the catch-up failed");
        assert!(format!("{error:#}").contains("not back and caught up"), "{error:#}");
        let calls = log.take();
        let back = calls.iter().position(|c| c == "etcd back 7").unwrap();
        let release = calls.iter().position(|c| c == "release").unwrap();
        assert!(back < release, "{calls:?}");
    }

    #[test]
    fn a_step_without_a_restart_does_not_ask_etcd() {
        let log = Log::default();
        let step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        let mut a = FakeActuator::at(Level::Full).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let g = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
        let out = block_on(run(&step, &mut a, &c, &g, &LevelsConfig::default()));
        assert!(matches!(out, Outcome::Done), "{out:?}");
        assert!(!log.take().iter().any(|c| c.starts_with("etcd")));
    }
}
