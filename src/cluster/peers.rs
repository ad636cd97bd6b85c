//! The peer gate (docs/behaviour.md, "Coordination"): a server steps only while every other etcd voter is
//! Ready — judged by a fresh node Lease in `kube-node-lease`, a Ready condition that
//! is True and, where k3s reports it, `EtcdIsVoter` not False — and, for a step down,
//! while no other server carries the level label (is stepped down itself).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use kube::Api;

use super::endpoints::Endpoints;
use super::lease::unreachable;
use super::{Refusal, RefusalKind};

pub const ETCD_ROLE_LABEL: &str = "node-role.kubernetes.io/etcd";
pub const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

pub struct PeerGate<'a> {
    pub node_name: &'a str,
    pub level_label: &'a str,
    pub heartbeat_timeout: Duration,
    /// The API server's time now: node Lease ages are judged on its clock, not on
    /// this server's (see `clock`).
    pub server_now: Timestamp,
}

/// Whether a peer that carries the level label (is stepped down) refuses the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SteppedDownPeers {
    Refuse,
    Allow,
}

impl PeerGate<'_> {
    /// For a step down: every other voter Ready, and none stepped down.
    pub async fn check_for_step_down(&self, eps: &Endpoints) -> Result<(), Refusal> {
        self.check(eps, SteppedDownPeers::Refuse).await
    }

    /// For a step up that restarts k3s: every other voter Ready (a stepped-down peer
    /// does not stop a step that restores function).
    pub async fn check_voters_ready(&self, eps: &Endpoints) -> Result<(), Refusal> {
        self.check(eps, SteppedDownPeers::Allow).await
    }

    /// Refuses, naming the first peer in name order that is not fit, and why.
    async fn check(&self, eps: &Endpoints, stepped_down: SteppedDownPeers) -> Result<(), Refusal> {
        let selector = format!("{ETCD_ROLE_LABEL}=true");
        let nodes = eps
            .call(format!("list nodes -l {selector}"), |c| {
                let lp = ListParams::default().labels(&selector);
                async move { Api::<Node>::all(c).list(&lp).await }
            })
            .await
            .map_err(unreachable)?;
        let leases = eps
            .call(format!("list leases -n {NODE_LEASE_NAMESPACE}"), |c| async move {
                Api::<Lease>::namespaced(c, NODE_LEASE_NAMESPACE).list(&ListParams::default()).await
            })
            .await
            .map_err(unreachable)?;
        let renewed: BTreeMap<String, Option<Timestamp>> = leases
            .items
            .into_iter()
            .map(|l| {
                let t = l.spec.and_then(|s| s.renew_time).map(|t| t.0);
                (l.metadata.name.unwrap_or_default(), t)
            })
            .collect();
        let mut peers: Vec<Node> =
            nodes.items.into_iter().filter(|n| n.metadata.name.as_deref() != Some(self.node_name)).collect();
        peers.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let now = self.server_now;
        for peer in &peers {
            if let Some(why) = self.unfit(peer, &renewed, now, stepped_down) {
                return Err(why);
            }
        }
        Ok(())
    }

    fn unfit(
        &self,
        peer: &Node,
        renewed: &BTreeMap<String, Option<Timestamp>>,
        now: Timestamp,
        stepped_down: SteppedDownPeers,
    ) -> Option<Refusal> {
        let name = peer.metadata.name.as_deref().unwrap_or_default();
        if stepped_down == SteppedDownPeers::Refuse {
            if let Some(level) = peer.metadata.labels.as_ref().and_then(|l| l.get(self.level_label)) {
                return Some(Refusal {
                    kind: RefusalKind::PeerSteppedDown,
                    subject: name.to_string(),
                    message: format!("peer {name} is stepped down ({}={level})", self.level_label),
                });
            }
        }
        let not_ready = |why: String| {
            Some(Refusal {
                kind: RefusalKind::PeerNotReady,
                subject: name.to_string(),
                message: format!("peer {name} {why}"),
            })
        };
        let conditions = peer.status.as_ref().and_then(|s| s.conditions.as_ref());
        let condition = |t: &str| conditions.and_then(|cs| cs.iter().find(|c| c.type_ == t));
        if let Some(c) = condition("EtcdIsVoter") {
            if c.status == "False" {
                return not_ready(format!(
                    "is not an etcd voter (EtcdIsVoter=False: {})",
                    c.message.as_deref().or(c.reason.as_deref()).unwrap_or("no reason given")
                ));
            }
        }
        match condition("Ready") {
            Some(c) if c.status == "True" => {}
            Some(c) => {
                return not_ready(format!(
                    "is not Ready (Ready={}: {})",
                    c.status,
                    c.reason.as_deref().unwrap_or("no reason given")
                ))
            }
            None => return not_ready("has no Ready condition".into()),
        }
        match renewed.get(name) {
            None => not_ready(format!("has no node Lease in {NODE_LEASE_NAMESPACE}")),
            Some(None) => not_ready(format!("has never renewed its node Lease in {NODE_LEASE_NAMESPACE}")),
            Some(Some(t)) => {
                // A renewal in the future (that kubelet's clock ahead) counts by its
                // distance too: taken as age 0 it would read fresh for as long as the
                // clock is ahead, even after the peer died.
                let off = now.duration_since(*t);
                let age = Duration::try_from(off.abs()).unwrap_or(Duration::MAX);
                let when = if off.is_negative() { "in the future, by its clock" } else { "ago" };
                (age > self.heartbeat_timeout).then(|| Refusal {
                    kind: RefusalKind::PeerNotReady,
                    subject: name.to_string(),
                    message: format!(
                        "peer {name}'s node Lease was last renewed {}s {when} (stale after {}s)",
                        age.as_secs(),
                        self.heartbeat_timeout.as_secs()
                    ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A node Lease renewed in the future (that kubelet's clock ahead) is judged by
    /// how far ahead it is: within the heartbeat timeout it is fresh, past it stale.
    #[test]
    fn a_renewal_in_the_future_is_not_fresh_for_ever() {
        let now: Timestamp = "2026-12-01T08:00:00Z".parse().unwrap();
        let gate = PeerGate {
            node_name: "server-1",
            level_label: "regrade.dev/level",
            heartbeat_timeout: Duration::from_secs(40),
            server_now: now,
        };
        let peer: Node = serde_json::from_value(json!({
            "metadata": {"name": "server-2"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap();
        let unfit = |secs: i64| {
            let t = now.checked_add(k8s_openapi::jiff::SignedDuration::from_secs(secs)).unwrap();
            let renewed = BTreeMap::from([("server-2".to_string(), Some(t))]);
            gate.unfit(&peer, &renewed, now, SteppedDownPeers::Refuse).map(|r| r.message)
        };
        assert_eq!(unfit(-10), None, "renewed 10 s ago");
        assert_eq!(unfit(10), None, "10 s ahead: within the timeout");
        let why = unfit(-100).expect("100 s ago is stale");
        assert!(why.contains("100s ago"), "{why}");
        let why = unfit(3600).expect("an hour in the future is not fresh");
        assert!(why.contains("3600s in the future"), "{why}");
    }
}
