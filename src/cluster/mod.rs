//! Coordination across servers (SPEC §4): the Lease that serialises steps, the peer
//! gate, and the Node marking. The step runner calls only [`Cluster`].

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::actuator::NodeReadiness;
use crate::config::{HumanDuration, LevelsConfig};
use crate::decide::Step;
use crate::level::Level;

/// `[cluster]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Credentials for the API. Unset: `/etc/rancher/k3s/k3s.yaml`.
    pub kubeconfig: Option<PathBuf>,
    /// This server's Node name. Unset: the host name.
    pub node_name: Option<String>,
    /// The other servers' API endpoints (`https://host:6443`), tried in turn when the
    /// local API server is disabled or unreachable.
    pub api_servers: Vec<String>,
    pub lease_namespace: String,
    pub lease_name: String,
    pub lease_duration: HumanDuration,
    /// The label naming the level, on the Node from the first step down until `full`.
    pub level_label: String,
    /// The taint key regrade sets below `full`.
    pub taint_key: String,
    /// A peer whose node Lease is older than this is not Ready.
    pub peer_heartbeat_timeout: HumanDuration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            kubeconfig: None,
            node_name: None,
            api_servers: Vec::new(),
            lease_namespace: "kube-system".into(),
            lease_name: "regrade".into(),
            lease_duration: HumanDuration(Duration::from_secs(60)),
            level_label: "regrade.dev/level".into(),
            taint_key: "regrade.dev/stepped-down".into(),
            peer_heartbeat_timeout: HumanDuration(Duration::from_secs(40)),
        }
    }
}

impl ClusterConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.lease_duration.0 < Duration::from_secs(1) {
            anyhow::bail!("cluster.lease_duration must be at least 1s");
        }
        Ok(())
    }
}

/// Why a step may not run now. A refused step changes no state (SPEC §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// A short machine-readable cause: `lease-held`, `peer-not-ready`,
    /// `peer-stepped-down`, `api-unreachable`, ...
    pub kind: &'static str,
    /// What an operator reads: names the holder, the peer, the endpoint.
    pub message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.kind)
    }
}

/// What happened to a step, for the Event on the Node.
#[derive(Clone, Debug)]
pub enum StepEvent<'a> {
    Done(&'a Step),
    Failed(&'a Step, &'a str),
    Refused(&'a Step, &'a Refusal),
}

#[async_trait(?Send)]
pub trait Cluster: NodeReadiness {
    /// What would refuse `step` now (a held Lease, a peer), read without taking or
    /// changing anything: for `status`.
    async fn preflight(&self, step: &Step) -> Result<(), Refusal>;

    /// Takes the Lease and checks the peers, for `step`. On refusal nothing is held.
    async fn acquire(&self, step: &Step) -> Result<(), Refusal>;

    /// Renews the Lease while a step runs. Returns only when the Lease is lost.
    async fn hold(&self) -> anyhow::Error;

    /// Releases the Lease if still the holder.
    async fn release(&self);

    /// Puts the Node's marks for `level` in place: the level label and, below `full`,
    /// the cordon and taint (recording which of them regrade set); at `full`, removes
    /// exactly what regrade set.
    async fn mark_node(&self, level: Level, levels: &LevelsConfig) -> anyhow::Result<()>;

    /// Records a Kubernetes Event on the Node. Failing to record is logged, not fatal.
    async fn record(&self, event: StepEvent<'_>);
}

/// A gate that never refuses and marks nothing: for `--dry-run` and `simulate`.
pub struct AlwaysFree;

#[async_trait(?Send)]
impl NodeReadiness for AlwaysFree {
    async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
        Ok(())
    }
}

#[async_trait(?Send)]
impl Cluster for AlwaysFree {
    async fn preflight(&self, _: &Step) -> Result<(), Refusal> {
        Ok(())
    }
    async fn acquire(&self, _: &Step) -> Result<(), Refusal> {
        Ok(())
    }
    async fn hold(&self) -> anyhow::Error {
        std::future::pending().await
    }
    async fn release(&self) {}
    async fn mark_node(&self, level: Level, _: &LevelsConfig) -> anyhow::Result<()> {
        tracing::info!(level = %level, "dry run: would mark the Node");
        Ok(())
    }
    async fn record(&self, _: StepEvent<'_>) {}
}

/// The cluster client for `cfg`: the Kubernetes API through the configured endpoints.
pub async fn connect(_cfg: &crate::config::Config) -> anyhow::Result<Box<dyn Cluster>> {
    anyhow::bail!("no cluster client is configured in this build yet (issue 3)")
}
