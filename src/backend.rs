//! Wiring: which actuator and which cluster a command runs with. With `config`, the
//! only place that sees every section: each edge is built from its own section and
//! the levels.

use crate::actuator::dry_run::DryRun;
use crate::actuator::Actuator;
use crate::cluster::{AlwaysFree, Cluster};
use crate::config::Config;
use crate::etcd::restart::LazyEtcdGate;
use crate::etcd::{NoRestartGate, RestartGate};
use crate::level::Level;

pub struct Backend {
    pub actuator: Box<dyn Actuator>,
    pub cluster: Box<dyn Cluster>,
    /// Asked before and after every restart of k3s (`[etcd]`).
    pub etcd: Box<dyn RestartGate>,
}

/// The real actuator and cluster, as this build and the configuration choose.
pub async fn real(cfg: &Config) -> anyhow::Result<Backend> {
    let actuator = actuator(cfg)?;
    let cluster = cluster(cfg).await?;
    Ok(Backend { actuator, cluster, etcd: etcd(cfg) })
}

/// A dry run starts where the real actuator says k3s is, and changes nothing.
pub async fn dry_run(cfg: &Config) -> Backend {
    let level = match actuator(cfg) {
        Ok(a) => a.current_level().await.unwrap_or(Level::Full),
        Err(_) => Level::Full,
    };
    Backend { actuator: Box::new(DryRun::new(level)), cluster: Box::new(AlwaysFree), etcd: Box::new(NoRestartGate) }
}

/// etcd as `[etcd]` configures it. Reads its certificates when first asked.
pub fn etcd(cfg: &Config) -> Box<dyn RestartGate> {
    Box::new(LazyEtcdGate::new(&cfg.etcd))
}

/// The Kubernetes API as `[cluster]` configures it. Connects nowhere until first used.
pub async fn cluster(cfg: &Config) -> anyhow::Result<Box<dyn Cluster>> {
    crate::cluster::connect(&cfg.cluster, &cfg.levels, crate::cluster::drain::progress_path(&cfg.state_file)).await
}

/// The real actuator this build has (systemd, or docker in a `docker` build). Building
/// it touches nothing; `status` reads the level and any disagreement through it.
#[cfg(not(feature = "docker"))]
pub fn actuator(cfg: &Config) -> anyhow::Result<Box<dyn Actuator>> {
    Ok(Box::new(crate::actuator::systemd::SystemdActuator::new(&cfg.systemd, &cfg.levels)?))
}

#[cfg(feature = "docker")]
pub fn actuator(cfg: &Config) -> anyhow::Result<Box<dyn Actuator>> {
    Ok(Box::new(crate::actuator::docker::DockerActuator::new(&cfg.docker, &cfg.levels)?))
}

/// Which static protections of k3s are in place (`regrade status`): k3s.service's
/// under systemd; none to judge for a k3s container.
#[cfg(not(feature = "docker"))]
pub async fn protections(cfg: &Config) -> Vec<crate::actuator::systemd::protections::Finding> {
    crate::actuator::systemd::protections::survey(&cfg.systemd, &cfg.pressure.source).await
}

#[cfg(feature = "docker")]
pub async fn protections(_cfg: &Config) -> Vec<crate::actuator::systemd::protections::Finding> {
    Vec::new()
}

/// Whether k3s would run at each level regrade steps to, with its configuration read as
/// k3s reads it (`check-config`, `watch`'s start): an error names each level another
/// file or k3s's command line overrides, with the file and the key.
#[cfg(not(feature = "docker"))]
pub async fn check_levels(cfg: &Config) -> anyhow::Result<()> {
    crate::actuator::systemd::k3s_flags::check_levels_of_unit(&cfg.systemd, &cfg.levels).await
}

/// The Docker actuator's entrypoint puts a level's flags last on k3s's command line,
/// where no config file and no earlier argument overrides them (the entrypoint says at
/// each start what k3s runs with).
#[cfg(feature = "docker")]
pub async fn check_levels(_cfg: &Config) -> anyhow::Result<()> {
    Ok(())
}

/// The kubelet's reserved memory as k3s's configuration gives it, into the metrics
/// (`watch`'s start: k3s reads its files only when it starts); not judged for a k3s
/// container.
pub async fn note_reserved_memory(cfg: &Config) {
    #[cfg(not(feature = "docker"))]
    {
        let (state, bytes) = crate::actuator::systemd::protections::reserved_memory_now(&cfg.systemd).await;
        crate::metrics::METRICS.set_k3s_reserved_memory(state, bytes);
    }
    #[cfg(feature = "docker")]
    let _ = cfg;
}
