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

pub mod client;
pub mod gate;
pub mod judge;
pub mod restart;

pub use restart::{NoRestartGate, RestartGate};

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::HumanDuration;

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
        if self.max_raft_lag == 0 {
            anyhow::bail!("etcd.max_raft_lag must be at least 1 (a follower is always a few entries behind)");
        }
        Ok(())
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
        assert!(toml::from_str::<EtcdConfig>("endpoint = []").unwrap_err().to_string().contains("endpoint"));
    }
}
