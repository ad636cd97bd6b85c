//! Actuators: what changes how k3s runs (docs/behaviour.md, "Actuators"). The core calls only [`Actuator`]'s
//! three methods; the Node's cordon, taint and label are the cluster's business.

use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::level::Level;

#[cfg(feature = "docker")]
pub mod docker;
pub mod dry_run;
pub mod entrypoint;
pub mod etcd_health;
pub mod systemd;

/// Waits for the local Node to be Ready on a heartbeat newer than a restart
/// (docs/behaviour.md, "Coordination").
/// The cluster implements it; an actuator calls it after restarting k3s into a level
/// that runs the agent.
#[async_trait(?Send)]
pub trait NodeReadiness {
    async fn wait_ready_since(&self, since: SystemTime, timeout: Duration) -> anyhow::Result<()>;
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
}
