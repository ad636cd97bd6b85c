//! The step into `etcd-only` weighed against its cost once more at the moment of its
//! restart, after its drain: `watch`'s etcd gate, wrapped. The decision weighed it
//! with the sample that proposed it; the drain that follows can take minutes
//! (`levels.etcd-only.drain_timeout`), and what counts is the member the restart would
//! meet.

use async_trait::async_trait;

use super::ticker::{held_refusal, Ticker};
use crate::cluster::Refusal;
use crate::decide::{EtcdOnlyCost, MemberSignals, Step};
use crate::etcd::restart::{Cleared, MemberState};
use crate::etcd::RestartGate;
use crate::pressure::{PressureConfig, Sampler};

/// `gate`, and [`RestartGate::held_by_cost`] answered from a fresh sample of what
/// `[pressure]` names (the loop does not sample while a step runs) and the member's
/// signals now (`member`: its last fresh look).
pub(super) struct WeighingGate<'a> {
    pub gate: &'a dyn RestartGate,
    pub ticker: &'a Ticker,
    pub pressure: &'a PressureConfig,
    pub cost: EtcdOnlyCost,
    pub member: &'a dyn Fn() -> MemberSignals,
}

impl WeighingGate<'_> {
    /// Available memory now, by a sampler of its own; `None` (with a warning) when it
    /// cannot be read: then what the drain freed is not known, taken as nothing.
    fn available_now(&self) -> Option<u64> {
        match Sampler::for_config(self.pressure).and_then(|mut s| s.sample()) {
            Ok(sample) => Some(sample.mem_available),
            Err(e) => {
                tracing::warn!(error = %e, "could not sample before the restart into etcd-only");
                None
            }
        }
    }
}

#[async_trait(?Send)]
impl RestartGate for WeighingGate<'_> {
    async fn before_restart(&self) -> Result<Cleared, Refusal> {
        self.gate.before_restart().await
    }
    async fn after_restart(&self, me: u64) -> anyhow::Result<()> {
        self.gate.after_restart(me).await
    }
    async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
        self.gate.members().await
    }
    async fn learn_members(&self) -> anyhow::Result<()> {
        self.gate.learn_members().await
    }
    fn held_by_cost(&self, step: &Step) -> Option<Refusal> {
        if !self.cost.applies_to(step) {
            return None;
        }
        let freed = self.available_now().and_then(|a| self.ticker.freed_since(a));
        held_refusal(&self.cost, step, freed, &(self.member)())
    }
}
