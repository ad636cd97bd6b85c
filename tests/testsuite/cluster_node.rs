//! Node marking and the readiness wait against a real kube-apiserver (docs/behaviour.md,
//! "Levels" and "Coordination").
//! Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use regrade::actuator::NodeReadiness;
use regrade::cluster::Cluster;
use regrade::level::Level;
use regrade::levels::LevelsConfig;
use serde_json::{json, Value};

use common::{block_on, Kubelet};

/// The parts of a Node regrade must leave as they were.
fn operator_view(n: &Node) -> String {
    let v = serde_json::to_value(n).unwrap();
    serde_json::to_string(&json!([v["metadata"]["labels"], v["metadata"]["annotations"], v["spec"]["taints"]])).unwrap()
}

fn taints(n: &Node) -> Vec<(String, String)> {
    n.spec.as_ref().and_then(|s| s.taints.clone()).unwrap_or_default().into_iter().map(|t| (t.key, t.effect)).collect()
}

#[test]
fn a_step_down_and_up_leaves_the_operators_marks_byte_identical() {
    let Some(h) = common::start("a_step_down_and_up_leaves_the_operators_marks_byte_identical") else { return };
    block_on(async {
        let admin = h.admin().await;
        let nodes: Api<Node> = Api::all(admin.clone());
        for n in ["marks-1", "marks-2"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        // The operator's own: two taints, a label; marks-2 is cordoned by the operator.
        let operator = json!({
            "metadata": {"labels": {"team": "infra"}},
            "spec": {"taints": [
                {"key": "dedicated", "value": "db", "effect": "NoSchedule"},
                {"key": "example.com/maintenance", "effect": "NoExecute", "timeAdded": "2026-01-02T03:04:05Z"},
            ]},
        });
        for n in ["marks-1", "marks-2"] {
            nodes.patch(n, &PatchParams::default(), &Patch::Merge(&operator)).await.unwrap();
        }
        nodes
            .patch("marks-2", &PatchParams::default(), &Patch::Merge(json!({"spec": {"unschedulable": true}})))
            .await
            .unwrap();
        let levels = LevelsConfig::default();

        for (name, operator_cordon) in [("marks-1", false), ("marks-2", true)] {
            let before = nodes.get(name).await.unwrap();
            let c = common::kube_cluster(&h.config(&h.admin_kubeconfig, name, "marks")).unwrap();

            c.mark_node(Level::ControlPlane, &levels).await.unwrap();
            let cp = nodes.get(name).await.unwrap();
            let labels = cp.metadata.labels.clone().unwrap();
            assert_eq!(labels["regrade.dev/level"], "control-plane");
            let set = &cp.metadata.annotations.as_ref().unwrap()["regrade.dev/set"];
            assert_eq!(set, if operator_cordon { "taint" } else { "cordon,taint" });
            assert_eq!(cp.spec.as_ref().unwrap().unschedulable, Some(true));
            assert_eq!(
                taints(&cp),
                [
                    ("dedicated".into(), "NoSchedule".into()),
                    ("example.com/maintenance".into(), "NoExecute".into()),
                    ("regrade.dev/stepped-down".into(), "NoSchedule".into())
                ]
            );

            c.mark_node(Level::EtcdOnly, &levels).await.unwrap();
            let eo = nodes.get(name).await.unwrap();
            assert_eq!(eo.metadata.labels.as_ref().unwrap()["regrade.dev/level"], "etcd-only");
            assert_eq!(taints(&eo).len(), 3);
            c.mark_node(Level::ControlPlane, &levels).await.unwrap();
            c.mark_node(Level::Full, &levels).await.unwrap();

            let after = nodes.get(name).await.unwrap();
            assert_eq!(operator_view(&after), operator_view(&before), "{name}: the operator's marks changed");
            assert_eq!(after.spec.as_ref().unwrap().unschedulable.unwrap_or(false), operator_cordon, "{name}");
        }
    });
}

/// `spec.taints` has no merge key: a writer that patched the list without the
/// `resourceVersion` would wipe taints another writer added meanwhile. Here an
/// operator adds taints (get → edit → update) while regrade steps up and down.
#[test]
fn concurrent_taint_edits_are_never_lost() {
    let Some(h) = common::start("concurrent_taint_edits_are_never_lost") else { return };
    block_on(async {
        let admin = h.admin().await;
        let nodes: Api<Node> = Api::all(admin.clone());
        common::create_server_node(&admin, &Kubelet::ready("race-1")).await;
        let c = common::kube_cluster(&h.config(&h.admin_kubeconfig, "race-1", "race")).unwrap();
        let levels = LevelsConfig::default();
        const N: usize = 30;
        let operator = async {
            let mut conflicts = 0;
            for i in 0..N {
                loop {
                    let mut n = nodes.get("race-1").await.unwrap();
                    let spec = n.spec.get_or_insert_with(Default::default);
                    spec.taints.get_or_insert_with(Vec::new).push(
                        serde_json::from_value(json!({
                            "key": format!("op/{i}"), "effect": "NoSchedule"
                        }))
                        .unwrap(),
                    );
                    match nodes.replace("race-1", &PostParams::default(), &n).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 409 => conflicts += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            conflicts
        };
        let regrade = async {
            for i in 0..N {
                let level = if i % 2 == 0 { Level::ControlPlane } else { Level::Full };
                c.mark_node(level, &levels).await.unwrap();
            }
        };
        let (conflicts, ()) = tokio::join!(operator, regrade);
        let n = nodes.get("race-1").await.unwrap();
        let keys: Vec<String> = taints(&n).into_iter().map(|(k, _)| k).collect();
        for i in 0..N {
            assert!(keys.contains(&format!("op/{i}")), "the operator's taint op/{i} was lost: {keys:?}");
        }
        // The last step was to full (N even): regrade's own marks are gone.
        assert!(!keys.iter().any(|k| k == "regrade.dev/stepped-down"), "{keys:?}");
        let v: Value = serde_json::to_value(&n).unwrap();
        assert!(v["metadata"]["labels"].get("regrade.dev/level").is_none());
        println!("concurrent edits: {N} operator taints kept, {conflicts} operator-side 409s");
    });
}

#[test]
fn readiness_waits_for_a_heartbeat_newer_than_the_restart() {
    let Some(h) = common::start("readiness_waits_for_a_heartbeat_newer_than_the_restart") else { return };
    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready("ready-1")).await;
        let c = common::kube_cluster(&h.config(&h.admin_kubeconfig, "ready-1", "ready")).unwrap();
        // Heartbeats are whole seconds in the Ready condition: let the restart be later.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let restart = SystemTime::now();

        // The kubelet comes back 2 s after the restart and renews its node Lease.
        let kubelet = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            common::renew_node_lease(&admin, "ready-1").await;
        };
        let t0 = std::time::Instant::now();
        let (r, ()) = tokio::join!(c.wait_ready_since(restart, Duration::from_secs(20)), kubelet);
        r.unwrap();
        assert!(t0.elapsed() >= Duration::from_secs(2), "returned on a heartbeat from before the restart");

        // No renewal after this restart: a clean timeout naming the Node.
        let restart = SystemTime::now();
        let e = c.wait_ready_since(restart, Duration::from_secs(3)).await.unwrap_err();
        let e = format!("{e:#}");
        assert!(e.contains("ready-1") && e.contains("not Ready on a heartbeat newer than the restart"), "{e}");
        println!("timeout error: {e}");
    });
}

/// `watch` asks once at start which level the Node's label names: after a reboot at
/// `control-plane` only the Node remembers it.
#[test]
fn node_level_reads_the_level_label() {
    let Some(h) = common::start("node_level_reads_the_level_label") else { return };
    block_on(async {
        let admin = h.admin().await;
        let nodes: Api<Node> = Api::all(admin.clone());
        common::create_server_node(&admin, &Kubelet::ready("label-1")).await;
        let c = common::kube_cluster(&h.config(&h.admin_kubeconfig, "label-1", "label")).unwrap();
        let levels = LevelsConfig::default();
        assert_eq!(c.node_level().await.unwrap(), None, "no label: full");
        for level in [Level::ControlPlane, Level::EtcdOnly] {
            c.mark_node(level, &levels).await.unwrap();
            assert_eq!(c.node_level().await.unwrap(), Some(level));
        }
        c.mark_node(Level::Full, &levels).await.unwrap();
        assert_eq!(c.node_level().await.unwrap(), None);

        let bogus = json!({"metadata": {"labels": {"regrade.dev/level": "half-way"}}});
        nodes.patch("label-1", &PatchParams::default(), &Patch::Merge(&bogus)).await.unwrap();
        let e = format!("{:#}", c.node_level().await.unwrap_err());
        for part in ["label-1", "regrade.dev/level", "half-way"] {
            assert!(e.contains(part), "{part} not named in: {e}");
        }

        // A Node that does not exist is an error that names it, not "no label".
        let gone = common::kube_cluster(&h.config(&h.admin_kubeconfig, "no-such-node", "label")).unwrap();
        let e = format!("{:#}", gone.node_level().await.unwrap_err());
        assert!(e.contains("nodes/no-such-node") && e.contains("404"), "{e}");
    });
}
