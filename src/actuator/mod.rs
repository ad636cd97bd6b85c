//! Actuators: what changes how k3s runs (docs/behaviour.md, "Actuators"). The core calls only [`Actuator`]'s
//! three methods; the Node's cordon, taint and label are the cluster's business.

use std::time::{Duration, SystemTime};

use anyhow::anyhow;
use async_trait::async_trait;
use tokio::time::Instant;

use crate::level::Level;
use crate::level_record::Phase;

#[cfg(feature = "docker")]
pub mod docker;
pub mod dry_run;
pub mod entrypoint;
pub mod etcd_health;
pub mod restart;
pub mod systemd;

/// Waits for the local Node to be Ready on a heartbeat newer than a restart
/// (docs/behaviour.md, "Coordination").
/// The cluster implements it; an actuator calls it after restarting k3s into a level
/// that runs the agent.
#[async_trait(?Send)]
pub trait NodeReadiness {
    async fn wait_ready_since(&self, since: SystemTime, timeout: Duration) -> anyhow::Result<()>;

    /// Asked by the actuator immediately before every restart of k3s it asks for
    /// (before it writes the file the restart reads), the undoing of a failed restart
    /// included: whether the restart may go ahead now. The answers a step got before —
    /// under the Lease, then a drain or a failed restart's wait of minutes — may be
    /// stale by then: a peer's etcd member that died meanwhile must stop the restart,
    /// unless this member is down already. `Err`: do not restart; change nothing.
    async fn may_restart(&self) -> anyhow::Result<()> {
        Ok(())
    }

    /// Until when a restart request must have reached the manager: the Lease's safe
    /// bound, read now (a renewal that lands moves it on). `None`: no bound (an
    /// actuator driven outside a step, in its own tests). Read by [`restart::send`].
    fn restart_bound(&self) -> Option<Instant> {
        None
    }

    /// The actuator is about to have `phase`'s effect (write its file, restart k3s,
    /// restore after a failure): the step runner records it in the level record
    /// first, so a crash right after is judged by it (docs/level-record.md).
    fn progress(&self, _phase: Phase) {}
}

/// The error of a step whose undoing could not restart k3s back ([`restart::send`]:
/// not allowed at that moment, or it could not have reached the manager before the
/// Lease's safe bound): k3s is left as the failure left it, and the level record keeps
/// the undoing (`restoring`) for a step under the Lease to finish once a restart is
/// allowed.
#[derive(Debug)]
pub struct UndoPending(pub String);

impl std::fmt::Display for UndoPending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UndoPending {}

/// The undoing of a failed restart did not restart k3s back (`e` says why): left
/// pending as an [`UndoPending`] for the resume path under a fresh Lease, the level
/// record at `restoring` (what the resume path finishes).
pub fn undo_pending(readiness: &dyn NodeReadiness, e: anyhow::Error, failed: &str, from: Level) -> anyhow::Error {
    readiness.progress(Phase::Restoring);
    let e = format!("{failed}; k3s was not restarted back into {from}: {e:#}");
    tracing::error!(error = %e, "the undoing is left for the resume path");
    anyhow!(UndoPending(e))
}

#[async_trait(?Send)]
pub trait Actuator {
    /// The levels this actuator supports, highest (`full`) first.
    fn levels(&self) -> &[Level];

    /// The level k3s is running at now.
    async fn current_level(&self) -> anyhow::Result<Level>;

    /// Makes k3s run at `level`. Returns once k3s serves at that level (etcd healthy
    /// and, where the agent runs, the Node Ready on a fresh heartbeat through
    /// `readiness`). On failure it has put the previous level back as far as it could,
    /// and the error says what failed and what was restored.
    async fn apply_level(&mut self, level: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()>;

    /// Where what k3s was started with and what the actuator last wrote disagree (the
    /// daemon died between writing and restarting, or someone edited the file), a
    /// sentence saying so, for `status` and the journal. `None` when they agree.
    async fn disagreement(&self) -> Option<String> {
        None
    }

    /// Called once when `watch` starts: converges a disagreement as the actuator
    /// documents. Does nothing when there is none.
    async fn reconcile(&mut self, _readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        Ok(())
    }

    /// What the actuator's own files say, for the level record's convergence: the
    /// level whose k3s flags its file holds (`None`: something regrade did not write),
    /// and the level k3s was started at (`None`: not since boot).
    async fn observe(&self) -> anyhow::Result<(Option<Level>, Option<Level>)> {
        let l = self.current_level().await?;
        Ok((Some(l), Some(l)))
    }

    /// Makes the actuator's file hold `level`'s flags without restarting k3s, which
    /// runs with them already (a rolled-back step, an edited file).
    async fn rewrite(&mut self, _level: Level) -> anyhow::Result<()> {
        Ok(())
    }

    /// The step's deadline passed while it applied a level, and its work was cut
    /// short part-way: puts `from`'s flags back in the actuator's file and, where k3s
    /// may have been restarted with the new ones (`restarted`), asks for a restart into
    /// `from` through [`restart::send`] (as every restart: allowed by `readiness` at
    /// its moment, inside the Lease's safe bound) without waiting for it to serve (the
    /// step has waited as long as it may). Each call is bounded by its own timeout.
    /// Says what it did.
    async fn roll_back(
        &mut self,
        from: Level,
        restarted: bool,
        _readiness: &dyn NodeReadiness,
    ) -> anyhow::Result<String> {
        self.rewrite(from).await?;
        Ok(match restarted {
            false => format!("put the flags of {from} back"),
            true => format!("put the flags of {from} back (this actuator restarts nothing)"),
        })
    }

    /// Finishes a step from `from` to `to` that a process killed meanwhile began and
    /// got as far as restarting k3s for: k3s may run at `to` already, or be
    /// restarting into it. Returns once k3s serves at `to`; on failure, as
    /// [`Actuator::apply_level`], `from` is put back.
    async fn resume(&mut self, _from: Level, to: Level, readiness: &dyn NodeReadiness) -> anyhow::Result<()> {
        self.apply_level(to, readiness).await
    }
}
