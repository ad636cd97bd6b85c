//! The step into `etcd-only` weighed against its cost once more at the moment of its
//! restart, after its drain: `watch`'s etcd gate, wrapped. The decision weighed it
//! with the sample that proposed it; the drain that follows can take minutes
//! (`levels.etcd-only.drain_timeout`), and what counts is the member the restart would
//! meet.

use std::time::Duration;

use async_trait::async_trait;

use super::ticker::{held_refusal, Ticker};
use crate::actuator::etcd_health::HealthUrl;
use crate::cluster::Refusal;
use crate::decide::{EtcdOnlyCost, MemberSignals, Step};
use crate::etcd::restart::{Cleared, MemberState};
use crate::etcd::RestartGate;
use crate::pressure::{PressureConfig, Sampler};

/// `gate`, and [`RestartGate::held_by_cost`] answered from a fresh sample of what
/// `[pressure]` names (the loop does not sample while a step runs) and the member's
/// signals: its last fresh look (`member`), its health asked again now (`health`,
/// `etcd.metrics_url`'s `/health` within `etcd.request_timeout`; the last look may be
/// an `etcd.metrics_interval` old).
pub(super) struct WeighingGate<'a> {
    pub gate: &'a dyn RestartGate,
    pub ticker: &'a Ticker,
    pub pressure: &'a PressureConfig,
    pub cost: EtcdOnlyCost,
    pub member: &'a dyn Fn() -> MemberSignals,
    pub health: Option<(HealthUrl, Duration)>,
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
    async fn held_by_cost(&self, step: &Step) -> Option<Refusal> {
        if !self.cost.applies_to(step) {
            return None;
        }
        let freed = self.available_now().and_then(|a| self.ticker.freed_since(a));
        let mut member = (self.member)();
        if let Some((url, timeout)) = &self.health {
            let (healthy, said) = crate::etcd::member::health(url, *timeout).await;
            tracing::debug!(healthy = ?healthy, "the local etcd member's /health before the restart: {said}");
            member.healthy = healthy;
        }
        held_refusal(&self.cost, step, freed, &member)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::Direction;
    use crate::level::Level;

    /// The member's last look says healthy; its `/health` asked at the restart says
    /// not: held (the drain freed nothing, not known here). Answering healthy: go on.
    #[tokio::test(flavor = "current_thread")]
    async fn the_members_health_is_asked_again_at_the_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler, _) = super::super::tests::pressed(dir.path());
        let ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::ControlPlane, super::super::Mode::DryRun);
        let into_etcd_only = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
        let looked_well = || MemberSignals { healthy: Some(true), ..Default::default() };
        let metrics = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let gate = async |health: &'static str| {
            let url = crate::etcd::member::tests::listener(health, metrics.clone()).await;
            WeighingGate {
                gate: &crate::etcd::NoRestartGate,
                ticker: &ticker,
                pressure: &cfg.pressure,
                cost: cfg.etcd.etcd_only_cost(),
                member: &looked_well,
                health: Some((url, Duration::from_secs(2))),
            }
            .held_by_cost(&into_etcd_only)
            .await
        };
        let held = gate("{\"health\":\"false\",\"reason\":\"RAFT NO LEADER\"}").await.expect("held");
        assert!(held.message.contains("not healthy"), "{}", held.message);
        assert!(gate("{\"health\":\"true\",\"reason\":\"\"}").await.is_none(), "healthy now: go on");
    }
}
