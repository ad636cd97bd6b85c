//! The peer gate against a real kube-apiserver (docs/behaviour.md, "Coordination").
//! The test plays the kubelets of three k3s servers. Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Patch, PatchParams};
use kube::Api;
use regrade::cluster::lease::holder_of;
use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use serde_json::json;

use common::{block_on, Kubelet};

const DOWN: Step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
const UP_NO_RESTART: Step = Step { direction: Direction::Up, from: Level::ControlPlane, to: Level::Full };
const UP_RESTART: Step = Step { direction: Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane };

#[test]
fn the_peer_gate_refuses_unfit_peers_and_allows_fresh_ones() {
    let Some(h) = common::start("the_peer_gate_refuses_unfit_peers_and_allows_fresh_ones") else { return };
    block_on(async {
        let admin = h.admin().await;
        for n in ["peers-1", "peers-2", "peers-3"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        // A Node that is not an etcd voter by role is no peer, however stale.
        let agent: Node = serde_json::from_value(json!({"metadata": {"name": "agent-1"}})).unwrap();
        Api::<Node>::all(admin.clone()).create(&Default::default(), &agent).await.unwrap();

        let c = common::kube_cluster(&h.config(&h.admin_kubeconfig, "peers-1", "peers")).unwrap();
        let nodes: Api<Node> = Api::all(admin.clone());
        let lease_holder = || async {
            holder_of(&Api::<Lease>::namespaced(h.admin().await, "kube-system").get("peers").await.unwrap())
        };

        // All fresh: allowed.
        c.acquire(&DOWN).await.unwrap();
        c.release().await;

        // A stale node Lease refuses, naming the peer; the Lease is not kept.
        common::set_node_lease(&admin, "peers-2", Timestamp::now() - SignedDuration::from_secs(60)).await;
        let r = c.acquire(&DOWN).await.unwrap_err();
        assert_eq!(r.kind, "peer-not-ready", "{r}");
        assert!(r.message.contains("peers-2") && r.message.contains("node Lease"), "{r}");
        assert_eq!(r.subject, "peers-2", "the peer identifies the reason");
        assert_eq!(lease_holder().await, "", "a refused step must not keep the Lease");
        assert!(c.preflight(&DOWN).await.unwrap_err().same_reason(&r), "status sees the same refusal");
        // Older still: another age in the message, the same reason.
        common::set_node_lease(&admin, "peers-2", Timestamp::now() - SignedDuration::from_secs(90)).await;
        let older = c.acquire(&DOWN).await.unwrap_err();
        assert_ne!(older.message, r.message);
        assert!(older.same_reason(&r), "{older:?} vs {r:?}");
        // A step up that restarts k3s needs every voter Ready too; one that does not, not.
        assert_eq!(c.acquire(&UP_RESTART).await.unwrap_err().kind, "peer-not-ready");
        c.acquire(&UP_NO_RESTART).await.unwrap();
        c.release().await;
        common::renew_node_lease(&admin, "peers-2").await;
        c.acquire(&DOWN).await.unwrap();
        c.release().await;

        // A peer carrying the level label (stepped down) refuses a step down, not up.
        let label = |v: serde_json::Value| json!({"metadata": {"labels": {"regrade.dev/level": v}}});
        nodes.patch("peers-3", &PatchParams::default(), &Patch::Merge(label(json!("control-plane")))).await.unwrap();
        let r = c.acquire(&DOWN).await.unwrap_err();
        assert_eq!(r.kind, "peer-stepped-down", "{r}");
        assert!(r.message.contains("peers-3") && r.message.contains("regrade.dev/level=control-plane"), "{r}");
        assert_eq!(r.subject, "peers-3");
        c.acquire(&UP_RESTART).await.unwrap();
        c.release().await;
        nodes.patch("peers-3", &PatchParams::default(), &Patch::Merge(label(json!(null)))).await.unwrap();

        // A peer that is an etcd learner, not a voter, refuses.
        common::set_conditions(&admin, &Kubelet { name: "peers-2", ready: "True", etcd_voter: Some("False") }).await;
        let r = c.acquire(&DOWN).await.unwrap_err();
        assert_eq!(r.kind, "peer-not-ready", "{r}");
        assert!(r.message.contains("peers-2") && r.message.contains("EtcdIsVoter=False"), "{r}");

        // A peer whose kubelet reports NotReady refuses.
        common::set_conditions(&admin, &Kubelet { name: "peers-2", ready: "False", etcd_voter: Some("True") }).await;
        let r = c.acquire(&DOWN).await.unwrap_err();
        assert!(r.message.contains("peers-2") && r.message.contains("Ready=False"), "{r}");

        // Where k3s reports no EtcdIsVoter (a merge patch replaces the whole list),
        // Ready and a fresh Lease suffice.
        common::set_conditions(&admin, &Kubelet { name: "peers-2", ready: "True", etcd_voter: None }).await;
        common::renew_node_lease(&admin, "peers-2").await;
        c.acquire(&DOWN).await.unwrap();
        c.release().await;
    });
}
