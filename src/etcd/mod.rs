//! The etcd gate: before k3s is restarted (into or out of `etcd-only`), ask etcd itself
//! whether the cluster can lose this member for a while, and after the restart whether
//! this member is back and caught up.
//!
//! The node-Lease peer gate (`cluster::peers`) is a proxy: a peer whose kubelet is fine
//! but whose etcd member is dead, partitioned on its peer port or still a learner passes
//! it, and restarting this member then loses quorum. So the member list is read from the
//! local member (from another member when the local one is down), and every member's
//! own status from its client URL.
//!
//! - [`EtcdConfig`]: `[etcd]`, k3s's client certificates by default.
//! - [`client`]: etcd's JSON gateway over HTTPS with the client certificate.
//! - [`judge`]: the pure judgement (member list + statuses → go or a refusal naming
//!   the member), table-tested.
//! - [`gate`]: one look at the cluster through the client, and the after-restart wait.
//! - [`member`]: the local member's own distress, from its metrics listener.

pub mod client;
pub mod gate;
pub mod judge;
pub mod member;
pub mod restart;

pub use restart::{NoRestartGate, RestartGate};

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::{ByteSize, HumanDuration};

/// `[etcd]`
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EtcdConfig {
    /// The local member's client URLs, tried in order for the member list. k3s serves
    /// `https://127.0.0.1:2379` on every server.
    pub endpoints: Vec<String>,
    /// The CA that signed the members' serving certificates (k3s: `server-ca.crt`).
    pub ca_file: PathBuf,
    /// The client certificate and key etcd asks for (k3s: `client.crt`, `client.key`).
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// One request (connect, TLS, answer) may take this long; a member that does not
    /// answer within it is unreachable.
    pub request_timeout: HumanDuration,
    /// A member whose applied raft index is more than this many entries behind the
    /// leader's is not caught up.
    pub max_raft_lag: u64,
    /// After a restart, this member must be back in the list, healthy and caught up
    /// within this, or the step fails (the Lease is held until then).
    pub catch_up_timeout: HumanDuration,
    /// Where the gate keeps which member is this server's and every member's client
    /// URLs, as last seen through the local member: while the local member is down,
    /// the others are asked there. Empty: not kept (a regrade started while its
    /// member is down cannot then ask etcd at all).
    pub members_cache: PathBuf,
    /// The local member's metrics listener (`/metrics`; `/health` at the same host and
    /// port), which k3s's embedded etcd serves without TLS. Empty: not looked at.
    pub metrics_url: String,
    /// How often `watch` looks at it (each request bounded by `request_timeout`).
    pub metrics_interval: HumanDuration,
    /// The step into `etcd-only` may be held at `control-plane` by its cost
    /// (docs/behaviour.md, "Decision rules"). `false`: never held.
    pub hold_at_control_plane: bool,
    /// The drain into `control-plane` "freed nothing" when available memory rose by
    /// less than this since that step was decided.
    pub drain_freed_at_least: ByteSize,
    /// The member is in distress at a WAL fsync p99 at or over this ...
    pub wal_fsync_p99_limit: HumanDuration,
    /// ... or at a backend commit p99 at or over this.
    pub backend_commit_p99_limit: HumanDuration,
    /// PSI at or over `pressure.threshold` while the member is in distress is over
    /// even with available memory above `pressure.mem_available_floor`
    /// (docs/behaviour.md, "Decision rules"). `false`: the floor alone.
    pub distress_overrides_floor: bool,
}

/// Where k3s keeps etcd's certificates.
const K3S_ETCD_TLS: &str = "/var/lib/rancher/k3s/server/tls/etcd";

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["https://127.0.0.1:2379".into()],
            ca_file: PathBuf::from(K3S_ETCD_TLS).join("server-ca.crt"),
            cert_file: PathBuf::from(K3S_ETCD_TLS).join("client.crt"),
            key_file: PathBuf::from(K3S_ETCD_TLS).join("client.key"),
            request_timeout: HumanDuration(Duration::from_secs(3)),
            max_raft_lag: 1000,
            catch_up_timeout: HumanDuration(Duration::from_secs(300)),
            members_cache: PathBuf::from("/var/lib/regrade/etcd-members.json"),
            metrics_url: "http://127.0.0.1:2381/metrics".into(),
            metrics_interval: HumanDuration(Duration::from_secs(10)),
            hold_at_control_plane: true,
            drain_freed_at_least: ByteSize(64 << 20),
            // 1 s: etcd's own "slow fdatasync" warning and its default election timeout;
            // past it, raft cannot keep up. Not lower: a busy shared disk or an SD card
            // gives 0.1–0.3 s p99 with a member that serves (regrade's own fsyncs waited
            // 0.1–0.3 s under the incident's thrash, docs/incident.md, and a healthy
            // rig member here 0.24 s under other tests' load), where the restart finishes.
            wal_fsync_p99_limit: HumanDuration(Duration::from_secs(1)),
            backend_commit_p99_limit: HumanDuration(Duration::from_secs(1)),
            // On: on a loaded 2 GiB host the member stopped answering tens of seconds
            // before the floor was crossed (docs/incident-vm.md).
            distress_overrides_floor: true,
        }
    }
}

impl EtcdConfig {
    /// Rejects values no cluster could be checked with, naming the key. The files are
    /// read when the gate is first used (see [`client::EtcdClient::new`]), so a config
    /// can be checked on a machine without them.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.endpoints.is_empty() {
            anyhow::bail!("etcd.endpoints must name at least the local member, e.g. [\"https://127.0.0.1:2379\"]");
        }
        for e in &self.endpoints {
            client::Endpoint::parse(e).map_err(|err| anyhow::anyhow!("etcd.endpoints: {err}"))?;
        }
        if self.request_timeout.0.is_zero() {
            anyhow::bail!("etcd.request_timeout must be more than 0");
        }
        if self.catch_up_timeout.0.is_zero() {
            anyhow::bail!("etcd.catch_up_timeout must be more than 0");
        }
        if let Some(url) = self.metrics_url() {
            url?;
            if self.metrics_interval.0 < Duration::from_secs(1) {
                anyhow::bail!("etcd.metrics_interval must be at least 1s (each look reads etcd's whole /metrics)");
            }
        }
        if self.wal_fsync_p99_limit.0.is_zero() || self.backend_commit_p99_limit.0.is_zero() {
            anyhow::bail!("etcd.wal_fsync_p99_limit and etcd.backend_commit_p99_limit must be more than 0");
        }
        if self.max_raft_lag == 0 {
            anyhow::bail!("etcd.max_raft_lag must be at least 1 (a follower is always a few entries behind)");
        }
        Ok(())
    }
}

impl EtcdConfig {
    /// `metrics_url` parsed; `None` when empty (not looked at).
    pub fn metrics_url(&self) -> Option<anyhow::Result<crate::actuator::etcd_health::HealthUrl>> {
        (!self.metrics_url.is_empty())
            .then(|| crate::actuator::etcd_health::HealthUrl::parse("etcd.metrics_url", &self.metrics_url))
    }

    /// The core's weighing of the step into `etcd-only` (`decide::weigh_etcd_only`).
    pub fn etcd_only_cost(&self) -> crate::decide::EtcdOnlyCost {
        crate::decide::EtcdOnlyCost {
            hold: self.hold_at_control_plane,
            drain_freed_at_least: self.drain_freed_at_least.0,
            limits: self.distress_limits(),
        }
    }

    /// When the member is in distress (`etcd.wal_fsync_p99_limit`,
    /// `etcd.backend_commit_p99_limit`).
    pub fn distress_limits(&self) -> crate::decide::DistressLimits {
        crate::decide::DistressLimits {
            wal_fsync_p99: self.wal_fsync_p99_limit.0,
            backend_commit_p99: self.backend_commit_p99_limit.0,
        }
    }

    /// How old a look at the member may be and still count: three looks' worth.
    pub fn member_look_max_age(&self) -> Duration {
        self.metrics_interval.0 * 3 + self.request_timeout.0 * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_k3s_paths_and_keys_are_checked() {
        let d = EtcdConfig::default();
        assert_eq!(d.endpoints, ["https://127.0.0.1:2379"]);
        assert_eq!(d.ca_file, PathBuf::from("/var/lib/rancher/k3s/server/tls/etcd/server-ca.crt"));
        assert_eq!(d.cert_file, PathBuf::from("/var/lib/rancher/k3s/server/tls/etcd/client.crt"));
        assert_eq!(d.key_file, PathBuf::from("/var/lib/rancher/k3s/server/tls/etcd/client.key"));
        d.validate().unwrap();
        let c: EtcdConfig = toml::from_str("endpoints = [\"https://10.0.0.1:2379\"]\nmax_raft_lag = 50").unwrap();
        assert_eq!(c.max_raft_lag, 50);
        c.validate().unwrap();
        let bad = |t: &str| format!("{:#}", toml::from_str::<EtcdConfig>(t).unwrap().validate().unwrap_err());
        assert!(bad("endpoints = []").contains("etcd.endpoints"));
        assert!(bad("endpoints = [\"http://127.0.0.1:2379\"]").contains("etcd.endpoints"));
        assert!(bad("max_raft_lag = 0").contains("etcd.max_raft_lag"));
        assert!(bad("request_timeout = \"0s\"").contains("etcd.request_timeout"));
        assert!(bad("metrics_url = \"https://127.0.0.1:2381/metrics\"").contains("etcd.metrics_url"));
        assert!(bad("metrics_url = \"http://127.0.0.1/metrics\"").contains("etcd.metrics_url"));
        assert!(bad("metrics_interval = \"500ms\"").contains("etcd.metrics_interval"));
        assert!(bad("wal_fsync_p99_limit = \"0s\"").contains("etcd.wal_fsync_p99_limit"));
        toml::from_str::<EtcdConfig>("metrics_url = \"\"").unwrap().validate().unwrap();
        assert_eq!(d.metrics_url, "http://127.0.0.1:2381/metrics");
        assert_eq!(d.drain_freed_at_least.0, 64 << 20);
        assert!(toml::from_str::<EtcdConfig>("endpoint = []").unwrap_err().to_string().contains("endpoint"));
    }
}
