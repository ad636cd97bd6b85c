//! Wiring: which actuator and which cluster a command runs with.

use crate::actuator::dry_run::DryRun;
use crate::actuator::Actuator;
use crate::cluster::{AlwaysFree, Cluster};
use crate::config::Config;
use crate::level::Level;

pub struct Backend {
    pub actuator: Box<dyn Actuator>,
    pub cluster: Box<dyn Cluster>,
}

/// The real actuator and cluster, as this build and the configuration choose.
pub async fn real(cfg: &Config) -> anyhow::Result<Backend> {
    let actuator = real_actuator(cfg)?;
    let cluster = crate::cluster::connect(cfg).await?;
    Ok(Backend { actuator, cluster })
}

/// A dry run starts where the real actuator says k3s is, and changes nothing.
pub async fn dry_run(cfg: &Config) -> Backend {
    let level = observed_level(cfg).await.unwrap_or(Level::Full);
    Backend { actuator: Box::new(DryRun::new(level)), cluster: Box::new(AlwaysFree) }
}

/// The level k3s runs at, read without changing anything.
pub async fn observed_level(cfg: &Config) -> anyhow::Result<Level> {
    real_actuator(cfg)?.current_level().await
}

/// Where k3s's start record and the actuator's file disagree, a sentence saying so.
pub async fn disagreement(cfg: &Config) -> Option<String> {
    real_actuator(cfg).ok()?.disagreement().await
}

#[cfg(not(feature = "docker"))]
fn real_actuator(cfg: &Config) -> anyhow::Result<Box<dyn Actuator>> {
    Ok(Box::new(crate::actuator::systemd::SystemdActuator::new(cfg)?))
}

#[cfg(feature = "docker")]
fn real_actuator(cfg: &Config) -> anyhow::Result<Box<dyn Actuator>> {
    Ok(Box::new(crate::actuator::docker::DockerActuator::new(cfg)?))
}
