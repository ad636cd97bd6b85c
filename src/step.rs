//! Running one step (docs/behaviour.md, "Decision rules" and "Coordination"): the edge
//! between the pure core and the world. Takes the Lease (with the peer check), marks
//! the Node and applies the level in the order that keeps the Node's marks true,
//! renews the Lease on its own timer from taking it to releasing it, stops the step
//! before the Lease could be taken over, releases it as soon as the step returns, and
//! records an Event.

use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use crate::actuator::{Actuator, NodeReadiness, UndoPending};
use crate::cluster::{Cluster, Refusal, RefusalKind, StepEvent};
use crate::decide::{Direction, Step};
use crate::etcd::RestartGate;
use crate::kill_point;
use crate::level::Level;
use crate::level_keeper::Keeper;
use crate::level_record::Phase;
use crate::levels::LevelsConfig;
use crate::metrics::{StepResult, METRICS};
use crate::own_time::StepClock;
use crate::units::format_duration;

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

/// Runs `step`, keeping the level record (`keeper`) a phase ahead of each effect, and
/// counts its outcome in [`METRICS`] (refusal kind, or result and duration; the Lease
/// held meanwhile).
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
    keeper: &Keeper,
    clock: &StepClock,
) -> Outcome {
    counted(step, go(step, actuator, Parts { cluster, etcd, levels, keeper, clock }, Mode::Fresh)).await
}

/// Finishes `step`, which a killed process began and got as far as restarting k3s
/// for (the level record says so): under the Lease, the peer gate and the etcd gate
/// like every step, [`Actuator::resume`] instead of a fresh apply.
pub async fn resume(
    step: &Step,
    actuator: &mut dyn Actuator,
    cluster: &dyn Cluster,
    etcd: &dyn RestartGate,
    levels: &LevelsConfig,
    keeper: &Keeper,
    clock: &StepClock,
) -> Outcome {
    counted(step, go(step, actuator, Parts { cluster, etcd, levels, keeper, clock }, Mode::Resume)).await
}

async fn counted(step: &Step, running: impl std::future::Future<Output = Outcome>) -> Outcome {
    let started = Instant::now();
    let outcome = running.await;
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

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Fresh,
    Resume,
}

/// What the actuator may ask of the outside while it applies a level: the cluster's
/// readiness wait, and the record of each phase before its effect.
struct Tracked<'a> {
    cluster: &'a dyn Cluster,
    keeper: &'a Keeper,
    clock: &'a StepClock,
    /// The etcd gate, asked right before any restart the actuator asks for: also one
    /// the plan did not expect (k3s running other flags than the record says).
    gate: &'a dyn RestartGate,
}

#[async_trait::async_trait(?Send)]
impl NodeReadiness for Tracked<'_> {
    async fn wait_ready_since(&self, since: SystemTime, timeout: Duration) -> anyhow::Result<()> {
        kill_point::reached("readiness-wait");
        self.cluster.wait_ready_since(since, timeout).await
    }
    /// Every restart the actuator asks for (forward, resumed, or the undoing of a
    /// failed one) is allowed here, at its moment: the answers under the Lease came
    /// before the marks, the drain or a failed restart's wait.
    async fn may_restart(&self) -> anyhow::Result<()> {
        restart_allowed(self.cluster, self.gate).await
    }
    /// The Lease's safe bound; not surely held, now (nothing may be sent).
    fn restart_bound(&self) -> Option<tokio::time::Instant> {
        Some(self.cluster.lease_safe_until().unwrap_or_else(tokio::time::Instant::now))
    }
    fn progress(&self, phase: Phase) {
        self.keeper.reach(phase);
        if phase == Phase::Restarting {
            // Up to here the step is regrade's; from the restart request on, k3s's.
            self.clock.progress("asking systemd to restart k3s");
        }
    }
}

/// The look every restart of k3s a step asks for takes at its moment — forward, back,
/// the undoing of a failed restart, a resumed step — through
/// [`crate::actuator::restart::send`], which also keeps the request inside the
/// Lease's safe bound: asked only while this server surely holds the Lease (before
/// [`Cluster::lease_safe_until`], which leaves a quarter of the lease duration before
/// another server could take it over; not held at all is not sure), and only with the
/// etcd gate's yes at that moment. The gate lets a member that is down already through
/// (its restart costs no vote; it is how it comes back) and judges the other voters
/// otherwise. The Lease is looked at again after the gate: under pressure its look
/// takes seconds. `Err`: nothing may be restarted now; it says why.
async fn restart_allowed(cluster: &dyn Cluster, etcd: &dyn RestartGate) -> anyhow::Result<()> {
    let lease_sure = || match cluster.lease_safe_until() {
        Some(until) if tokio::time::Instant::now() < until => Ok(()),
        _ => anyhow::bail!(
            "the Lease is no longer surely this server's (no renewal landed within cluster.lease_duration less a \
             quarter, or it was lost): no restart is asked for"
        ),
    };
    lease_sure()?;
    if let Err(refusal) = etcd.before_restart().await {
        METRICS.refused(refusal.kind);
        anyhow::bail!("the etcd gate refused the restart at the moment of it: {}", refusal.message);
    }
    lease_sure()
}

/// How long the rollback after a missed deadline may take: a file or two, one call
/// to restart k3s, the Node's marks (whose retries end within 30 s).
pub const ROLLBACK_BOUND: Duration = Duration::from_secs(60);

/// The longest a step may run: its deadline (`levels.step_timeout`), then its
/// rollback. `watch` feeds the watchdog no longer than this, so a step stuck past
/// every bound is ended by systemd and finished from the level record at the next
/// start.
pub fn bound(levels: &LevelsConfig) -> Duration {
    levels.step_timeout.0 + ROLLBACK_BOUND
}

/// What a step asks of the world besides the actuator.
#[derive(Clone, Copy)]
struct Parts<'a> {
    cluster: &'a dyn Cluster,
    etcd: &'a dyn RestartGate,
    levels: &'a LevelsConfig,
    keeper: &'a Keeper,
    /// When the step was decided: its progress lines say how long after, and how much
    /// of that was regrade's own time.
    clock: &'a StepClock,
}

async fn go(step: &Step, actuator: &mut dyn Actuator, p: Parts<'_>, mode: Mode) -> Outcome {
    let Parts { cluster, etcd, levels, clock, .. } = p;
    let restart = levels.needs_restart(step.from, step.to);
    // Read-only first: while a peer is down, a pressured server retries every sample,
    // and must not write the Lease (take and give back) each time. The peers and etcd
    // are asked at once (each answer is slow under pressure); the peers' refusal comes
    // first when both refuse.
    let peers = async {
        let r = cluster.preflight(step).await;
        if r.is_ok() {
            clock.progress("the peers allow the step");
        }
        r
    };
    let etcd_first = async {
        if !restart {
            return Ok(());
        }
        let r = etcd.before_restart().await.map(|_| ());
        if r.is_ok() {
            clock.progress("etcd allows the restart");
        }
        r
    };
    let (peers, etcd_first) = tokio::join!(peers, etcd_first);
    if let Err(refusal) = peers.and(etcd_first) {
        return Outcome::Refused(refusal);
    }
    if let Err(refusal) = cluster.acquire(step).await {
        return Outcome::Refused(refusal);
    }
    clock.progress("took the Lease");
    METRICS.set_lease_held(true);
    // From here to the release the Lease is renewed on its own timer, whatever the
    // step awaits (the etcd check, the marks, the actuator, a rollback).
    let outcome = {
        let renewing = cluster.hold();
        tokio::pin!(renewing);
        let held = held(step, &mut *actuator, p, mode, restart);
        tokio::pin!(held);
        tokio::select! {
            biased;
            outcome = &mut held => outcome,
            lost = &mut renewing => {
                // A restart cannot be taken back half-way: cancelling it would leave k3s
                // and the Node's marks at no level at all. Finish it, and say so loudly.
                tracing::error!(error = %format!("{lost:#}"), "lost the Lease while stepping; finishing the step");
                held.await
            }
        }
    };
    if !matches!(outcome, Outcome::Refused(_)) {
        clock.progress("the step is over; releasing the Lease");
        kill_point::reached("before-release");
    }
    cluster.release().await;
    match &outcome {
        Outcome::Done => cluster.record(StepEvent::Done(step)).await,
        Outcome::Failed { error, .. } => cluster.record(StepEvent::Failed(step, &format!("{error:#}"))).await,
        Outcome::Refused(_) => {}
    }
    outcome
}

/// The step while the Lease is held (and renewed beside it): the etcd check under the
/// Lease, then the marks and the level, cut short at the step's deadline or once the
/// Lease is no longer surely ours, and then rolled back.
async fn held(step: &Step, actuator: &mut dyn Actuator, p: Parts<'_>, mode: Mode, restart: bool) -> Outcome {
    let Parts { cluster, etcd, levels, keeper, .. } = p;
    let deadline = tokio::time::Instant::now() + levels.step_timeout.0;
    // Under the Lease, the answer that counts: another server's restart may have ended
    // (and its Lease been released) between the two looks only once its member was back.
    let me = if restart {
        tokio::select! {
            biased;
            answer = etcd.before_restart() => match answer {
                Ok(cleared) => {
                    p.clock.progress("etcd allows the restart, asked again under the Lease");
                    Some(cleared.me)
                }
                Err(refusal) => return Outcome::Refused(refusal),
            },
            why = cut(deadline, cluster, levels) => return Outcome::Refused(Refusal {
                kind: RefusalKind::ApiUnreachable,
                subject: "lease".into(),
                message: format!("{why}, while asking etcd under the Lease; nothing was changed"),
            }),
        }
    } else {
        None
    };
    if mode == Mode::Fresh {
        if let Err(error) = keeper.begin(step, first_phase(step)) {
            return Outcome::Failed { level: step.from, error: error.context("nothing was changed") };
        }
    }
    // The deadline, or a Lease no longer surely held, cuts the step short wherever it
    // is; the step is then rolled back.
    let why = tokio::select! {
        biased;
        r = under_lease(step, &mut *actuator, p, mode, me) => return match r {
            Err(refusal) => Outcome::Refused(refusal),
            Ok(Ok(())) => {
                keeper.settle(step.to);
                Outcome::Done
            }
            Ok(Err(error)) if error.downcast_ref::<UndoPending>().is_some() => {
                // The restart back was not allowed at its moment: the record keeps the
                // undoing (`restoring`), finished under the Lease once it is.
                Outcome::Failed { level: step.to, error }
            }
            Ok(Err(error)) => {
                // Where k3s is now. A level with `from`'s flags is `from` (after a reboot
                // the start record may say full where control-plane is held).
                let level = match actuator.current_level().await {
                    Ok(l) if !levels.needs_restart(l, step.from) => step.from,
                    Ok(l) => l,
                    Err(_) => step.from,
                };
                keeper.settle(level);
                Outcome::Failed { level, error }
            }
        },
        why = cut(deadline, cluster, levels) => why,
    };
    past_deadline(step, actuator, p, &why).await
}

/// The phase a step's level record begins at: a step down's first effect is the
/// Node's marks, and a start judges `leased` and `marking` alike (rolled back), so it
/// begins at `marking`. Under memory pressure each durable write waits on a disk the
/// thrash keeps busy; this is one fewer. (`writing` is not begun at: a step cut short
/// before its file is written undoes only the marks, and the record is what says so.)
fn first_phase(step: &Step) -> Phase {
    match step.direction {
        Direction::Down => Phase::Marking,
        Direction::Up => Phase::Leased,
    }
}

/// Ends at the step's `deadline` or at [`Cluster::lease_safe_until`], whichever comes
/// first (the latter moves on with every renewal that lands; a Lease no longer held
/// has none, and ends it now), saying which.
async fn cut(deadline: tokio::time::Instant, cluster: &dyn Cluster, levels: &LevelsConfig) -> String {
    loop {
        let safe = cluster.lease_safe_until().unwrap_or_else(tokio::time::Instant::now);
        tokio::time::sleep_until(safe.min(deadline)).await;
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return format!(
                "the step did not end within levels.step_timeout = {}",
                format_duration(levels.step_timeout.0)
            );
        }
        if cluster.lease_safe_until().is_none_or(|s| now >= s) {
            return "could not renew the Lease: no renewal landed within cluster.lease_duration less a quarter, \
                    so the step stopped before another server could take the Lease over"
                .to_string();
        }
    }
}

/// The step under the Lease: the marks (down), the level, and this etcd member's
/// return after a restart (`me`). `Err`: the marks could
/// not be set before anything changed, a refusal.
async fn under_lease(
    step: &Step,
    actuator: &mut dyn Actuator,
    p: Parts<'_>,
    mode: Mode,
    me: Option<u64>,
) -> Result<anyhow::Result<()>, Refusal> {
    let Parts { cluster, etcd, levels, keeper, .. } = p;
    // Down: the marks go first (cordon and taint free memory before any restart). If
    // they cannot be set, k3s has not changed: the step is undone and refused. The
    // PATCH may have reached the API server all the same (its reply lost), so the
    // marks are left to be reconciled on the level the record keeps.
    if step.direction == Direction::Down {
        kill_point::reached("before-marks");
        keeper.reach(Phase::Marking);
        if let Err(e) = cluster.mark_node(step.to, levels).await {
            keeper.marks_unsure.set(true);
            if mode == Mode::Fresh {
                keeper.settle(step.from);
            }
            return Err(Refusal {
                kind: RefusalKind::ApiError,
                subject: "node-marks".into(),
                message: format!("could not mark the Node: {e:#}"),
            });
        }
        kill_point::reached("after-marks");
        p.clock.progress("the Node is marked");
    }
    let applying = async {
        apply(step, &mut *actuator, Tracked { cluster, keeper, clock: p.clock, gate: etcd }, levels, mode).await?;
        match me {
            // The Lease is held until this member is back, healthy and caught up:
            // only then may another server restart its own.
            Some(me) => etcd.after_restart(me).await.map(|()| {
                tracing::info!(level = %step.to, "this etcd member is back and caught up after the restart");
            }),
            None => Ok(()),
        }
    };
    Ok(applying.await)
}

/// The step was cut short (`why`: its deadline passed, or the Lease is no longer
/// surely ours) and its work was dropped where it stood: undo what
/// its recorded phase says may have happened, within [`ROLLBACK_BOUND`]. The file of
/// `from` goes back and, if k3s may have restarted, a restart into `from` is asked for
/// (not waited on: other servers' etcd gates wait for this member); the marks go
/// back to `from`. A rollback that cannot restart k3s leaves the record at
/// `restoring`, so the undoing is finished under the Lease by `watch` (or the next
/// start), as after a crash.
async fn past_deadline(step: &Step, actuator: &mut dyn Actuator, p: Parts<'_>, why: &str) -> Outcome {
    let Parts { cluster, etcd, levels, keeper, clock } = p;
    let phase = keeper.record().step.map_or(Phase::Leased, |s| s.phase);
    let restarted = levels.needs_restart(step.from, step.to) && phase >= Phase::Restarting;
    let cut = format!("{why} (it was at phase {phase})");
    if phase == Phase::Applied {
        // k3s serves at `to` already (what was left: this member's catch-up, the marks
        // up): a restart back would be a second restart, ungated. Kept at `to`.
        tracing::error!(from = %step.from, to = %step.to, "{cut}; k3s serves at {} already: keeping it", step.to);
        let marked = tokio::time::timeout(ROLLBACK_BOUND, cluster.mark_node(step.to, levels)).await;
        if !matches!(marked, Ok(Ok(()))) {
            keeper.marks_unsure.set(true);
        }
        keeper.settle(step.to);
        return Outcome::Failed {
            level: step.to,
            error: anyhow::anyhow!(
                "{cut}; k3s serves at {} already, so it was kept there, not restarted back",
                step.to
            ),
        };
    }
    tracing::error!(from = %step.from, to = %step.to, "{cut}; rolling it back");
    let undo = async {
        let mut said = Vec::new();
        if phase >= Phase::Writing {
            if restarted {
                // Recorded before anything: whatever fails from here, the record keeps
                // the undoing for the resume path.
                keeper.reach(Phase::Restoring);
            }
            // A restart back is a restart: allowed at its moment and sent inside the
            // Lease's safe bound like any other (a step cut by the Lease stop is past
            // it already), by the one function that sends restarts.
            let tracked = Tracked { cluster, keeper, clock, gate: etcd };
            said.push(actuator.roll_back(step.from, restarted, &tracked).await.context("restarting back")?);
        }
        // The marks may say `to`: set on the way down first, on the way up last.
        if step.direction == Direction::Down || phase >= Phase::Applied {
            match cluster.mark_node(step.from, levels).await {
                Ok(()) => said.push(format!("put the Node's marks back to {}", step.from)),
                Err(e) => {
                    keeper.marks_unsure.set(true);
                    said.push(format!("could not put the Node's marks back yet ({e:#})"));
                }
            }
        }
        anyhow::Ok(said.join("; "))
    };
    let undone = match tokio::time::timeout(ROLLBACK_BOUND, undo).await {
        Ok(r) => r,
        Err(_) => Err(anyhow::anyhow!("the rollback did not end within {}", format_duration(ROLLBACK_BOUND))),
    };
    let from = step.from;
    match undone {
        Ok(said) => {
            keeper.settle(from);
            Outcome::Failed { level: from, error: anyhow::anyhow!("{cut}; rolled back to {from}: {said}") }
        }
        Err(e) if restarted => Outcome::Failed {
            level: step.to,
            error: anyhow::anyhow!(
                "{cut}; rolling back to {from} failed: {e:#}; the level record keeps the undoing (phase restoring), \
                 which is finished under the Lease"
            ),
        },
        Err(e) => {
            // Nothing was restarted: k3s runs with `from`'s flags.
            keeper.marks_unsure.set(true);
            keeper.settle(from);
            Outcome::Failed { level: from, error: anyhow::anyhow!("{cut}; rolling back to {from}: {e:#}") }
        }
    }
}

/// Down (marks already set by [`go`]): apply. Up: apply first, then mark, so the Node
/// never claims a level k3s is not at yet. If applying fails on the way down, the
/// marks go back to the level the actuator restored. A mark that fails once k3s is
/// at its level does not fail the step: the marks are left to be reconciled.
async fn apply(
    step: &Step,
    actuator: &mut dyn Actuator,
    tracked: Tracked<'_>,
    levels: &LevelsConfig,
    mode: Mode,
) -> anyhow::Result<()> {
    let (cluster, keeper) = (tracked.cluster, tracked.keeper);
    let mut drained = None;
    if mode == Mode::Fresh && step.direction == Direction::Down {
        // The drain: after the cordon and taint (no pod comes back), before any
        // restart (the local API still answers), while the Lease is held.
        let settings = levels.get(step.to).and_then(|l| l.drain_settings());
        drained = match settings {
            Some(s) => cluster.drain(step.to, s).await,
            None => None,
        };
        if drained.is_some() {
            tracked.clock.progress("the drain is over");
        }
        // Before the restart, the step may still end with k3s untouched at `from`:
        // stopped by a signal during the drain, or held by its cost, weighed once more
        // now (the drain can take minutes; the member's distress is what the restart
        // would meet). The marks go back to `from` and the step did not happen.
        let restart = levels.needs_restart(step.from, step.to);
        let stopped = drained
            .as_ref()
            .filter(|r| r.interrupted && restart)
            .map(|report| anyhow::anyhow!("stopped by a signal while draining, before restarting k3s; {report}"));
        let ended = match stopped {
            Some(stopped) => Some(stopped),
            None => held_at_restart(tracked.gate, step).await,
        };
        if let Some(error) = ended {
            if let Some(report) = &drained {
                cluster.record(StepEvent::Drained(report)).await;
            }
            if let Err(m) = cluster.mark_node(step.from, levels).await {
                keeper.marks_unsure.set(true);
                tracing::error!(error = %format!("{m:#}"), level = %step.from, "could not put the Node's marks back");
            }
            return Err(error);
        }
    }
    let applying = async {
        match mode {
            Mode::Fresh => actuator.apply_level(step.to, &tracked).await,
            Mode::Resume => actuator.resume(step.from, step.to, &tracked).await,
        }
    };
    // The drain's Event is posted while the level is applied, not before: under
    // pressure a call to the API takes a second the restart need not wait for.
    let recording = async {
        if let Some(report) = &drained {
            cluster.record(StepEvent::Drained(report)).await;
        }
    };
    let (applied, ()) = tokio::join!(applying, recording);
    if let Err(e) = applied {
        if step.direction == Direction::Down {
            let back = match actuator.current_level().await {
                Ok(l) if levels.needs_restart(l, step.from) => l,
                _ => step.from,
            };
            if let Err(m) = cluster.mark_node(back, levels).await {
                keeper.marks_unsure.set(true);
                tracing::error!(error = %format!("{m:#}"), level = %back, "could not put the Node's marks back");
            }
        }
        return Err(e);
    }
    keeper.reach(Phase::Applied);
    if step.direction == Direction::Up {
        kill_point::reached("before-marks");
        if let Err(m) = cluster.mark_node(step.to, levels).await {
            keeper.marks_unsure.set(true);
            tracing::error!(error = %format!("{m:#}"), level = %step.to, "could not mark the Node; reconciling it later");
        }
        kill_point::reached("after-marks");
    }
    Ok(())
}

/// What a step says when [`RestartGate::held_by_cost`] holds it after its drain (the
/// journal's message; the step's error begins with it).
pub const HELD_AT_RESTART: &str = "held at the moment of the restart by its cost";

/// [`RestartGate::held_by_cost`], counted and logged: the step's error if it is held.
async fn held_at_restart(gate: &dyn RestartGate, step: &Step) -> Option<anyhow::Error> {
    let refusal = gate.held_by_cost(step).await?;
    METRICS.refused(refusal.kind);
    tracing::warn!(kind = refusal.kind.as_str(), reason = %refusal.message, to = %step.to, "{HELD_AT_RESTART}");
    Some(anyhow::anyhow!("{HELD_AT_RESTART} ({}): {}", refusal.kind.as_str(), refusal.message))
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
        /// Refuse from this call on (1: the first), as a peer whose member dies.
        refuse_from: Option<usize>,
        calls: std::cell::Cell<usize>,
        not_back: bool,
        /// How long each look before a restart takes.
        takes: Duration,
        /// What [`RestartGate::held_by_cost`] answers, logged.
        held: Option<Refusal>,
    }

    impl Gate {
        fn logging_to(log: &Log) -> Gate {
            Gate {
                log: log.clone(),
                refuse: None,
                refuse_from: None,
                calls: Default::default(),
                not_back: false,
                takes: Duration::ZERO,
                held: None,
            }
        }
    }

    #[async_trait(?Send)]
    impl RestartGate for Gate {
        async fn before_restart(&self) -> Result<crate::etcd::restart::Cleared, Refusal> {
            self.log.push("etcd check");
            if !self.takes.is_zero() {
                tokio::time::sleep(self.takes).await;
            }
            self.calls.set(self.calls.get() + 1);
            if self.refuse_from.is_some_and(|n| self.calls.get() >= n) {
                return Err(etcd_refusal());
            }
            self.refuse.clone().map_or(Ok(crate::etcd::restart::Cleared { me: 7, this_down: false }), Err)
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
        async fn held_by_cost(&self, _step: &Step) -> Option<Refusal> {
            // Logged only when set: the other tests' logs have no weighing in them.
            let held = self.held.clone()?;
            self.log.push("held by its cost");
            Some(held)
        }
    }

    fn etcd_refusal() -> Refusal {
        Refusal {
            kind: RefusalKind::EtcdMemberUnhealthy,
            subject: "server3-1a2b3c4d:unreachable".into(),
            message: "etcd member server3-1a2b3c4d (Node server3): unreachable: connection refused".into(),
        }
    }

    /// A level record kept in memory only.
    fn keeper() -> Keeper {
        let k = std::collections::BTreeMap::new();
        Keeper::new(None, crate::level_record::LevelRecord::at(Level::ControlPlane, k.clone()), k)
    }

    /// `step::run` with a clock started now: the tests read no progress line's times.
    async fn run(
        step: &Step,
        actuator: &mut dyn Actuator,
        cluster: &dyn Cluster,
        etcd: &dyn RestartGate,
        levels: &LevelsConfig,
        keeper: &Keeper,
    ) -> Outcome {
        super::run(step, actuator, cluster, etcd, levels, keeper, &StepClock::start()).await
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
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
        assert!(matches!(out, Outcome::Done));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "etcd check",
                "apply etcd-only",
                "etcd back 7",
                "release",
                "event done"
            ]
        );
        assert_eq!(a.level(), Level::EtcdOnly);
    }

    /// Was (issue 23, finding 4): a step planned without a restart (control-plane ->
    /// full) from a level record that had fallen behind k3s (which ran etcd-only) asked
    /// no etcd gate, yet the actuator restarted k3s. Now every restart the actuator
    /// asks for is gated at its moment: refused here, k3s stays where it is.
    #[test]
    fn a_restart_the_plan_did_not_expect_is_gated_all_the_same() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::EtcdOnly).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let gate = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
        let up = Step { direction: Direction::Up, from: Level::ControlPlane, to: Level::Full };
        let out = block_on(run(&up, &mut a, &c, &gate, &LevelsConfig::default(), &keeper()));
        let Outcome::Failed { error, .. } = out else { panic!("{out:?}") };
        assert!(format!("{error:#}").contains("refused the restart at the moment of it"), "{error:#}");
        assert_eq!(a.level(), Level::EtcdOnly, "k3s was not restarted");
        assert_eq!(log.take()[..3], ["preflight", "acquire", "etcd check"], "no gate before: the plan had no restart");
    }

    /// Under pressure an API call takes seconds: the drain's Event is posted while the
    /// level is applied, and the step ends once both have.
    #[test]
    fn the_drains_event_does_not_hold_up_the_restart() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster {
            drained: Some(crate::cluster::drain::DrainReport::default()),
            events_take: Duration::from_secs(5),
            ..FakeCluster::logging_to(&log)
        };
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
        assert!(matches!(out, Outcome::Done), "{out:?}");
        let calls = log.take();
        let at = |what: &str| calls.iter().position(|c| c == what).unwrap_or_else(|| panic!("no {what}: {calls:?}"));
        assert!(at("drain") < at("apply etcd-only"), "{calls:?}");
        assert!(at("apply etcd-only") < at("event drained"), "the restart waited for the Event: {calls:?}");
        assert!(at("event drained") < at("release"), "{calls:?}");
    }

    #[test]
    fn up_applies_before_marking() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::EtcdOnly).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let out = block_on(run(&UP, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
        assert_eq!(out.level_after(&UP), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
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
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
        assert_eq!(out.level_after(&DOWN), Some(Level::ControlPlane));
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "etcd check",
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
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
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
        let out = block_on(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &keeper()));
        assert!(matches!(&out, Outcome::Refused(r) if r.kind == "api-error" && r.message.contains("503")), "{out:?}");
        assert_eq!(log.take(), ["preflight", "etcd check", "acquire", "etcd check", "mark etcd-only", "release"]);
        assert_eq!(a.level(), Level::ControlPlane, "k3s untouched");
        // The PATCH may have gone through: the marks are to be reconciled, and the
        // record holds the level the step started from.
        let k = keeper();
        block_on(run(&DOWN, &mut a, &c, &crate::etcd::NoRestartGate, &LevelsConfig::default(), &k));
        assert!(k.marks_unsure.get());
        assert_eq!((k.level(), k.record().step), (Level::ControlPlane, None));
    }

    #[test]
    fn a_refused_step_touches_nothing() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let refusal =
            Refusal { kind: RefusalKind::LeaseHeld, subject: "server-2".into(), message: "held by server-2".into() };
        let c = FakeCluster { refuse: Some(refusal.clone()), ..FakeCluster::logging_to(&log) };
        // etcd refuses too: the peers and etcd are asked at once, and the peers' refusal
        // is the one reported.
        let g = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
        let out = block_on(run(&DOWN, &mut a, &c, &g, &LevelsConfig::default(), &keeper()));
        assert!(matches!(out, Outcome::Refused(r) if r == refusal));
        assert_eq!(log.take(), ["preflight", "etcd check"], "refused read-only: the Lease was never written");
        assert_eq!(a.level(), Level::ControlPlane);
    }

    #[test]
    fn an_etcd_refusal_before_a_restart_touches_nothing_and_writes_no_lease() {
        for step in [DOWN, UP] {
            let log = Log::default();
            let mut a = FakeActuator::at(step.from).logging_to(&log);
            let c = FakeCluster::logging_to(&log);
            let g = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
            let out = block_on(run(&step, &mut a, &c, &g, &LevelsConfig::default(), &keeper()));
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
        let out = block_on(run(&DOWN, &mut a, &c, &g, &LevelsConfig::default(), &keeper()));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s is at the new level; only the catch-up failed");
        assert!(format!("{error:#}").contains("not back and caught up"), "{error:#}");
        let calls = log.take();
        let back = calls.iter().position(|c| c == "etcd back 7").unwrap();
        let release = calls.iter().position(|c| c == "release").unwrap();
        assert!(back < release, "{calls:?}");
    }

    /// Time stands still but for the timers: a deadline passes at once.
    fn block_on_paused<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(f)
    }

    fn one_minute_steps() -> LevelsConfig {
        LevelsConfig { step_timeout: crate::units::HumanDuration(Duration::from_secs(60)), ..Default::default() }
    }

    /// A restart that never ends (the bus stalled after the drop-in was written and
    /// RestartUnit sent) is cut at the deadline, not after the actuator's own bounds:
    /// rolled back (file and restart), marks back, Lease renewed only until then,
    /// released, reported.
    #[test]
    fn a_step_past_its_deadline_is_rolled_back_and_renews_no_more() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster { renew_every: Some(Duration::from_secs(7)), ..FakeCluster::logging_to(&log) };
        let k = keeper();
        let (out, took) = block_on_paused(async {
            let t0 = tokio::time::Instant::now();
            let out = run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &one_minute_steps(), &k).await;
            (out, t0.elapsed())
        });
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane);
        let e = format!("{error:#}");
        assert!(e.contains("levels.step_timeout = 1m") && e.contains("phase restarting"), "{e}");
        assert!(e.contains("rolled back to control-plane"), "{e}");
        assert_eq!(took, Duration::from_secs(60), "ends at the deadline");
        let mut calls = log.take();
        let renewals = calls.iter().filter(|c| *c == "renew").count();
        assert_eq!(renewals, 8, "every 7 s up to the deadline (56 s), then never: {calls:?}");
        calls.retain(|c| c != "renew");
        assert_eq!(
            calls,
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "etcd check",
                "etcd check",
                "roll back to control-plane, restarting",
                "mark control-plane",
                "release",
                "event failed"
            ],
            "the restart back is gated at its moment too"
        );
        assert_eq!(a.level(), Level::ControlPlane);
        assert_eq!((k.level(), k.record().step), (Level::ControlPlane, None), "settled at from");
        assert_eq!(*c.label.borrow(), Ok(Some(Level::ControlPlane)));
    }

    /// Cut short before the file was written: nothing of the actuator's to undo,
    /// only the marks. A step without a restart is never asked to restart back.
    #[test]
    fn a_step_cut_before_its_file_undoes_only_the_marks() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600));
        let c = FakeCluster::logging_to(&log);
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &one_minute_steps(), &keeper()));
        assert!(matches!(&out, Outcome::Failed { level: Level::ControlPlane, .. }), "{out:?}");
        let calls = log.take();
        assert!(!calls.iter().any(|c| c.starts_with("roll back")), "{calls:?}");
        assert!(calls.ends_with(&["mark control-plane".into(), "release".into(), "event failed".into()]), "{calls:?}");

        let step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        let mut a = FakeActuator { reports: &[Phase::Writing, Phase::Restarting], ..FakeActuator::at(Level::Full) }
            .logging_to(&log)
            .taking(Duration::from_secs(3600));
        let out = block_on_paused(run(&step, &mut a, &c, &Gate::logging_to(&log), &one_minute_steps(), &keeper()));
        assert!(matches!(&out, Outcome::Failed { level: Level::Full, .. }), "{out:?}");
        assert!(log.take().contains(&"roll back to full".to_string()));
    }

    /// The rollback cannot restart k3s (the bus still stalled): the record keeps the
    /// undoing, which `watch` then finishes as the reversed step under the Lease.
    #[test]
    fn a_rollback_that_cannot_restart_leaves_the_undoing_recorded() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            fail_roll_back: true,
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster::logging_to(&log);
        let k = keeper();
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &one_minute_steps(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s may be at etcd-only");
        assert!(format!("{error:#}").contains("the bus did not answer"), "{error:#}");
        assert_eq!(k.record().step.map(|s| s.phase), Some(Phase::Restoring));
        assert!(log.take().ends_with(&["release".into(), "event failed".into()]));
        let undo = k.unfinished_undoing().expect("an undoing to finish");
        assert_eq!(undo, Step { direction: Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane });
        let rec = k.record().step.unwrap();
        assert_eq!((rec.from, rec.to, rec.phase), (Level::EtcdOnly, Level::ControlPlane, Phase::Restarting));
        assert_eq!(k.unfinished_undoing(), None, "recorded once");
    }

    /// Past the deadline after k3s was asked to restart, with a peer's member dead
    /// meanwhile: the restart back is refused by the gate at its moment; nothing is
    /// restarted, and the record keeps the undoing for later, under the Lease.
    #[test]
    fn a_restart_back_past_the_deadline_is_gated_too() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster::logging_to(&log);
        // The checks before the step and at the restart pass; the one before the
        // restart back (the fourth) finds a member dead.
        let g = Gate { refuse_from: Some(4), ..Gate::logging_to(&log) };
        let k = keeper();
        let out = block_on_paused(run(&DOWN, &mut a, &c, &g, &one_minute_steps(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s may be at etcd-only");
        let e = format!("{error:#}");
        assert!(e.contains("restarting back") && e.contains("the etcd gate refused the restart at the moment"), "{e}");
        let restarts: Vec<Level> = a.restarts.borrow().iter().map(|r| r.0).collect();
        assert_eq!(restarts, [Level::EtcdOnly], "nothing restarted back");
        assert_eq!(k.record().step.map(|s| s.phase), Some(Phase::Restoring));
    }

    /// One rule for every restart (issue 55), forward: a request that could reach k3s
    /// only after the Lease's safe bound (renewals stopped at the start; the bus slow)
    /// is not sent; the step fails with k3s untouched at `from`.
    #[test]
    fn a_forward_restart_that_could_land_after_the_leases_bound_is_not_sent() {
        let log = Log::default();
        let mut a = FakeActuator { request_takes: Duration::from_secs(50), ..FakeActuator::at(Level::ControlPlane) }
            .logging_to(&log);
        let c = FakeCluster { renewals_fail_after: Some(Duration::from_secs(45)), ..FakeCluster::logging_to(&log) };
        let k = keeper();
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane, "{error:#}");
        assert!(format!("{error:#}").contains("was not asked for"), "{error:#}");
        assert!(a.restarts.borrow().is_empty(), "nothing restarted");
        assert_eq!((k.level(), k.record().step), (Level::ControlPlane, None), "settled at from");
    }

    /// One rule for every restart (issue 55), the undoing of a failed restart: the
    /// restart into etcd-only went out at once, k3s never became healthy in 20 s, and
    /// the restart back is sent while it fits before the Lease's safe bound (40 s
    /// after the start, no renewal landing); with 15-s requests it could land only at
    /// 50 s: not sent, the undoing left pending.
    #[test]
    fn an_undoing_that_could_land_after_the_leases_bound_is_not_sent() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            fail: true,
            undoes: true,
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(20))
        };
        let c = FakeCluster { renewals_fail_after: Some(Duration::from_secs(40)), ..FakeCluster::logging_to(&log) };
        let k = keeper();
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane, "restored: {error:#}");
        let restarts: Vec<Level> = a.restarts.borrow().iter().map(|r| r.0).collect();
        assert_eq!(restarts, [Level::EtcdOnly, Level::ControlPlane], "back within the bound: sent");
        // 15-s requests: forward out by 15 s, failed at 35 s, back could land at 50 s.
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            fail: true,
            undoes: true,
            request_takes: Duration::from_secs(15),
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(20))
        };
        let k = keeper();
        let out = block_on_paused(run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "{error:#}");
        assert!(format!("{error:#}").contains("was not asked for"), "{error:#}");
        let restarts: Vec<Level> = a.restarts.borrow().iter().map(|r| r.0).collect();
        assert_eq!(restarts, [Level::EtcdOnly], "nothing restarted back");
        assert_eq!(k.record().step.map(|s| s.phase), Some(Phase::Restoring), "left for the resume path");
    }

    /// One rule for every restart (issue 55), a resumed step: its restart goes
    /// through the same function and is not sent past the Lease's bound.
    #[test]
    fn a_resumed_steps_restart_that_could_land_after_the_leases_bound_is_not_sent() {
        let log = Log::default();
        let mut a = FakeActuator { request_takes: Duration::from_secs(50), ..FakeActuator::at(Level::ControlPlane) }
            .logging_to(&log);
        let c = FakeCluster { renewals_fail_after: Some(Duration::from_secs(45)), ..FakeCluster::logging_to(&log) };
        let k = keeper();
        let levels = LevelsConfig::default();
        let out = block_on_paused(super::resume(
            &DOWN,
            &mut a,
            &c,
            &Gate::logging_to(&log),
            &levels,
            &k,
            &StepClock::start(),
        ));
        let Outcome::Failed { error, .. } = &out else { panic!("{out:?}") };
        assert!(format!("{error:#}").contains("was not asked for"), "{error:#}");
        assert!(a.restarts.borrow().is_empty(), "nothing restarted");
    }

    /// The review's proof (issue 55): a step control-plane -> etcd-only is cut by its
    /// deadline (600 s) at phase `restarting` while renewals stopped landing (the
    /// Lease surely ours until 605 s; another server may take it from 625 s). Its
    /// restart back is allowed at 600 s, but its request (a bus connect and a
    /// RestartUnit of 10 s each, a durable write) may take 21 s: once, it was asked
    /// at 621 s, past the bound. Now it is not sent: nothing is restarted back, and
    /// the record keeps the undoing for the resume path under a fresh Lease.
    #[test]
    fn a_restart_back_that_could_land_after_the_leases_bound_is_not_sent() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            request_takes: Duration::from_secs(21),
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster { renewals_fail_after: Some(Duration::from_secs(605)), ..FakeCluster::logging_to(&log) };
        let levels =
            LevelsConfig { step_timeout: crate::units::HumanDuration(Duration::from_secs(600)), ..Default::default() };
        let k = keeper();
        let (out, t0) = block_on_paused(async {
            let t0 = tokio::time::Instant::now();
            (run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &levels, &k).await, t0)
        });
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s may be at etcd-only");
        let e = format!("{error:#}");
        assert!(e.contains("levels.step_timeout = 10m") && e.contains("was not asked for"), "{e}");
        let restarts: Vec<(Level, Duration)> = a.restarts.borrow().iter().map(|r| (r.0, r.1 - t0)).collect();
        assert_eq!(restarts, [(Level::EtcdOnly, Duration::from_secs(21))], "only the forward restart, at 21 s");
        assert_eq!(k.record().step.map(|s| s.phase), Some(Phase::Restoring), "the undoing is left for the resume path");
    }

    /// A peer's etcd member dies during the drain: the gate, asked again at the
    /// moment of the restart, stops it. k3s is not restarted, the marks go back, the
    /// record settles at `from`.
    #[test]
    fn the_etcd_gate_is_asked_again_at_the_moment_of_the_restart() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let g = Gate { refuse_from: Some(3), ..Gate::logging_to(&log) };
        let k = keeper();
        let out = block_on(run(&DOWN, &mut a, &c, &g, &LevelsConfig::default(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane);
        assert!(format!("{error:#}").contains("refused the restart at the moment of it"), "{error:#}");
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "etcd check",
                "mark control-plane",
                "release",
                "event failed"
            ],
            "no apply after the refusal"
        );
        assert_eq!(a.level(), Level::ControlPlane, "k3s not restarted");
        assert_eq!((k.level(), k.record().step), (Level::ControlPlane, None));
    }

    /// The member fell into distress during the drain into etcd-only (decided while
    /// it was well): the cost, weighed again after the drain, holds the step. Nothing
    /// is restarted, the marks go back to control-plane, the drain's Event is posted.
    #[test]
    fn the_cost_is_weighed_again_after_the_drain_and_holds_the_restart() {
        let log = Log::default();
        let mut a = FakeActuator::at(Level::ControlPlane).logging_to(&log);
        let c = FakeCluster { drained: Some(Default::default()), ..FakeCluster::logging_to(&log) };
        let held = Refusal {
            kind: RefusalKind::EtcdOnlyHeld,
            subject: "member-in-distress".into(),
            message: "the local etcd member is in distress (not healthy)".into(),
        };
        let g = Gate { held: Some(held), ..Gate::logging_to(&log) };
        let k = keeper();
        let out = block_on(run(&DOWN, &mut a, &c, &g, &LevelsConfig::default(), &k));
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane);
        let error = format!("{error:#}");
        assert!(error.starts_with(HELD_AT_RESTART) && error.contains("etcd-only-held"), "{error}");
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "drain",
                "held by its cost",
                "event drained",
                "mark control-plane",
                "release",
                "event failed"
            ],
            "weighed after the drain; no apply after the hold"
        );
        assert_eq!(a.level(), Level::ControlPlane, "k3s not restarted");
        assert_eq!((k.level(), k.record().step), (Level::ControlPlane, None));
    }

    /// Past the deadline while this member catches up after the restart (phase
    /// `applied`): k3s serves at `to`, so it is kept there; no second restart.
    #[test]
    fn a_deadline_after_k3s_serves_keeps_the_level_and_restarts_nothing() {
        struct SlowCatchUp(Log);
        #[async_trait(?Send)]
        impl RestartGate for SlowCatchUp {
            async fn before_restart(&self) -> Result<crate::etcd::restart::Cleared, Refusal> {
                Ok(crate::etcd::restart::Cleared { me: 7, this_down: false })
            }
            async fn after_restart(&self, _me: u64) -> anyhow::Result<()> {
                self.0.push("catching up");
                std::future::pending().await
            }
            async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
                Ok(vec![])
            }
        }
        for step in [DOWN, UP] {
            let log = Log::default();
            let mut a = FakeActuator::at(step.from).logging_to(&log);
            let c = FakeCluster::logging_to(&log);
            let k = keeper();
            let out = block_on_paused(run(&step, &mut a, &c, &SlowCatchUp(log.clone()), &one_minute_steps(), &k));
            let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
            assert_eq!(*level, step.to, "{error:#}");
            assert!(format!("{error:#}").contains("kept there, not restarted back"), "{error:#}");
            let calls = log.take();
            assert!(!calls.iter().any(|c| c.starts_with("roll back")), "{calls:?}");
            assert_eq!(calls.iter().filter(|c| c.starts_with("apply")).count(), 1, "{calls:?}");
            assert_eq!(calls.last().map(String::as_str), Some("event failed"), "{calls:?}");
            assert_eq!(a.level(), step.to);
            assert_eq!((k.level(), k.record().step), (step.to, None));
            assert_eq!(*c.label.borrow(), Ok(Some(step.to)), "the marks say {}", step.to);
        }
    }

    /// A step down's record begins at its marks (one durable write fewer); a step up's
    /// at the Lease, since it restarts or marks only later.
    #[test]
    fn a_step_down_is_recorded_from_its_marks() {
        assert_eq!(first_phase(&DOWN), Phase::Marking);
        assert_eq!(first_phase(&UP), Phase::Leased);
    }

    #[test]
    fn a_step_without_a_restart_does_not_ask_etcd() {
        let log = Log::default();
        let step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        let mut a = FakeActuator::at(Level::Full).logging_to(&log);
        let c = FakeCluster::logging_to(&log);
        let g = Gate { refuse: Some(etcd_refusal()), ..Gate::logging_to(&log) };
        let out = block_on(run(&step, &mut a, &c, &g, &LevelsConfig::default(), &keeper()));
        assert!(matches!(out, Outcome::Done), "{out:?}");
        assert!(!log.take().iter().any(|c| c.starts_with("etcd")));
    }

    /// The renewal runs on its own timer from taking the Lease to releasing it: also
    /// during the etcd check under the Lease, the down marks and the rollback, which
    /// are awaited outside the actuator's work (each takes 10-20 s here).
    #[test]
    fn the_lease_is_renewed_throughout_the_step() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster {
            renew_every: Some(Duration::from_secs(3)),
            marks_take: Duration::from_secs(20),
            ..FakeCluster::logging_to(&log)
        };
        let g = Gate { takes: Duration::from_secs(10), ..Gate::logging_to(&log) };
        let out = block_on_paused(run(&DOWN, &mut a, &c, &g, &one_minute_steps(), &keeper()));
        assert!(matches!(&out, Outcome::Failed { level: Level::ControlPlane, .. }), "{out:?}");
        let calls = log.take();
        let at = |what: &str, nth: usize| {
            calls.iter().enumerate().filter(|(_, c)| *c == what).nth(nth).map(|(i, _)| i).expect(what)
        };
        let renewed = |from: usize, to: usize| calls[from..to].iter().any(|c| c == "renew");
        let (under_lease, marks, rollback_marks) =
            (at("etcd check", 1), at("mark etcd-only", 0), at("mark control-plane", 0));
        let release = at("release", 0);
        assert!(!renewed(0, at("acquire", 0)), "renewed before the Lease was taken: {calls:?}");
        assert!(renewed(under_lease, marks), "no renewal during the etcd check under the Lease: {calls:?}");
        assert!(renewed(marks, at("etcd check", 2)), "no renewal during the down marks: {calls:?}");
        assert!(renewed(rollback_marks, release), "no renewal during the rollback: {calls:?}");
        assert!(!renewed(release, calls.len()), "renewed after the release: {calls:?}");
    }

    /// Renewals stop landing (the API server slow or away): the step stops once the
    /// Lease is no longer surely ours, well before its deadline and before another
    /// server could take the Lease over.
    ///
    /// Was (issue 38, finding 3): the rollback that followed asked for the restart
    /// back anyway, bounded only by the rollback's minute, so a slow bus could deliver
    /// it after another server took the Lease and restarted its own member. Now no
    /// restart is asked for past the Lease's safe bound: k3s is left where the cut
    /// found it, the record keeps the undoing (`restoring`), and a step under a new
    /// Lease finishes it.
    #[test]
    fn a_step_stops_before_its_lease_could_be_taken_over() {
        let log = Log::default();
        let mut a = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log).taking(Duration::from_secs(3600))
        };
        let c = FakeCluster { renewals_fail_after: Some(Duration::from_secs(45)), ..FakeCluster::logging_to(&log) };
        let k = keeper();
        let (out, took) = block_on_paused(async {
            let t0 = tokio::time::Instant::now();
            let out = run(&DOWN, &mut a, &c, &Gate::logging_to(&log), &LevelsConfig::default(), &k).await;
            (out, t0.elapsed())
        });
        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::EtcdOnly, "k3s may be at etcd-only");
        let e = format!("{error:#}");
        assert!(e.contains("could not renew the Lease") && e.contains("phase restarting"), "{e}");
        assert!(e.contains("the Lease is no longer surely this server's"), "{e}");
        assert_eq!(took, Duration::from_secs(45), "stops when the Lease is no longer surely held");
        assert_eq!(
            log.take(),
            [
                "preflight",
                "etcd check",
                "acquire",
                "etcd check",
                "mark etcd-only",
                "etcd check",
                "release",
                "event failed"
            ],
            "no restart back asked for"
        );
        let step = k.record().step.expect("the undoing is kept");
        assert_eq!((step.from, step.to, step.phase), (Level::ControlPlane, Level::EtcdOnly, Phase::Restoring));
    }
}
