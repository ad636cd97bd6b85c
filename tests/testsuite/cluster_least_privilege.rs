//! Each server's regrade may mark only its own Node, and only with regrade's marks
//! (docs/behaviour.md, "Least privilege"), against a real kube-apiserver: server1's own
//! credential (a token of regrade/server1 bound to Node server1, as `regrade credential`
//! mints it) under deploy/rbac.yaml and deploy/admission-policy.yaml; a token past its
//! renewal point replaced and used by the next call; and a cluster without
//! ValidatingAdmissionPolicy, where the policy is refused and the RBAC alone works.
//! Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::TokenRequest;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, ServiceAccount};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::Api;
use regrade::cluster::boundary;
use regrade::cluster::credential::{self, MintSettings, Minted, PolicyState};
use regrade::cluster::{Cluster, KubeCluster};
use regrade::level::Level;
use regrade::levels::LevelsConfig;
use serde_json::json;

use common::{block_on, Harness, Kubelet};

const POLICY_REFUSED: &str =
    "ValidatingAdmissionPolicy 'regrade-own-node' with binding 'regrade-own-node' denied request";

/// Server1 and server2, server1 with an operator's label and taint.
async fn two_servers(admin: &kube::Client) {
    for n in ["server1", "server2"] {
        common::create_server_node(admin, &Kubelet::ready(n)).await;
    }
    let ops = json!({
        "metadata": {"labels": {"ops.example/team": "db"}},
        "spec": {"taints": [{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]},
    });
    Api::<Node>::all(admin.clone()).patch("server1", &PatchParams::default(), &Patch::Merge(ops)).await.unwrap();
}

fn cluster(h: &Harness, kubeconfig: &Path, node: &str) -> KubeCluster {
    common::kube_cluster(&h.config(kubeconfig, node, "regrade")).unwrap()
}

/// The message of a refused request; panics if it was not refused.
fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, kube::Error>) -> String {
    match r {
        Err(kube::Error::Api(s)) => {
            println!("refused: {what}: {} {}", s.code, s.message);
            assert_eq!(s.code, 403, "{what}: {s:?}");
            s.message
        }
        Ok(_) => panic!("{what}: not refused, done"),
        Err(e) => panic!("{what}: not refused by the API server: {e}"),
    }
}

fn node_of(n: &Node) -> (Option<String>, Vec<String>, bool, Option<String>) {
    let labels = n.metadata.labels.clone().unwrap_or_default();
    let spec = n.spec.clone().unwrap_or_default();
    let taints = spec.taints.unwrap_or_default().into_iter().map(|t| t.key).collect();
    let cordoned = spec.unschedulable.unwrap_or(false);
    (labels.get("ops.example/team").cloned(), taints, cordoned, labels.get("regrade.dev/level").cloned())
}

#[test]
fn server1s_credential_changes_only_server1_and_only_regrades_marks() {
    let Some(h) = common::start("server1s_credential_changes_only_server1_and_only_regrades_marks") else { return };
    block_on(async {
        let admin = h.admin().await;
        two_servers(&admin).await;
        let kubeconfig = h.server_credential("server1").await;
        let nodes = Api::<Node>::all(admin.clone());

        // What regrade does is allowed: its marks on its own Node, on and off again;
        // the operator's label and taint are left as they were.
        let c = cluster(&h, &kubeconfig, "server1");
        let levels = LevelsConfig::default();
        c.mark_node(Level::ControlPlane, &levels).await.unwrap();
        let marked = node_of(&nodes.get("server1").await.unwrap());
        assert_eq!(
            marked,
            (
                Some("db".into()),
                vec!["dedicated".into(), "regrade.dev/stepped-down".into()],
                true,
                Some("control-plane".into())
            )
        );
        c.mark_node(Level::Full, &levels).await.unwrap();
        assert_eq!(
            node_of(&nodes.get("server1").await.unwrap()),
            (Some("db".into()), vec!["dedicated".into()], false, None)
        );

        // Everything else RBAC would let the credential do, the policy refuses.
        let s1 = common::client_for(&kubeconfig).await;
        let as_s1 = Api::<Node>::all(s1.clone());
        let pp = PatchParams::default();
        let cordon = Patch::Merge(json!({"spec": {"unschedulable": true}}));
        let m = refused("cordon server2", as_s1.patch("server2", &pp, &cordon).await);
        assert!(
            m.contains(POLICY_REFUSED) && m.contains("may change only Node server1, not update Node server2"),
            "{m}"
        );

        let mut taints = nodes.get("server1").await.unwrap().spec.unwrap().taints.unwrap();
        taints.push(serde_json::from_value(json!({"key": "example.com/other", "effect": "NoSchedule"})).unwrap());
        let add_taint = Patch::Merge(json!({"spec": {"taints": taints}}));
        let m = refused("add the taint example.com/other to server1", as_s1.patch("server1", &pp, &add_taint).await);
        assert!(
            m.contains(POLICY_REFUSED) && m.contains("not add, change or remove the taint example.com/other"),
            "{m}"
        );

        let unlabel = Patch::Merge(json!({"metadata": {"labels": {"ops.example/team": null}}}));
        let m = refused("remove the label ops.example/team from server1", as_s1.patch("server1", &pp, &unlabel).await);
        assert!(
            m.contains(POLICY_REFUSED) && m.contains("only its own label regrade.dev/level, not ops.example/team"),
            "{m}"
        );

        // RBAC cannot limit a create by name; the policy does.
        let other: Lease = serde_json::from_value(json!({
            "metadata": {"name": "kube-scheduler"},
            "spec": {"holderIdentity": "server1", "leaseDurationSeconds": 60},
        }))
        .unwrap();
        let leases = Api::<Lease>::namespaced(s1.clone(), "kube-system");
        let m =
            refused("take the Lease kube-system/kube-scheduler", leases.create(&PostParams::default(), &other).await);
        assert!(
            m.contains(POLICY_REFUSED)
                && m.contains("only the Lease kube-system/regrade, not kube-system/kube-scheduler"),
            "{m}"
        );

        let event: Event = serde_json::from_value(json!({
            "metadata": {"name": "server2.forged"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": "server2"},
            "reason": "RegradeStepDown", "message": "forged", "type": "Normal",
        }))
        .unwrap();
        let events = Api::<Event>::namespaced(s1.clone(), "default");
        let m = refused("an Event about server2", events.create(&PostParams::default(), &event).await);
        assert!(
            m.contains(POLICY_REFUSED) && m.contains("Events only about Node server1, not about Node server2"),
            "{m}"
        );

        // A token of server1's ServiceAccount bound to server2's Node changes nothing.
        let server2 = nodes.get("server2").await.unwrap();
        let request: TokenRequest = serde_json::from_value(json!({"spec": {
            "boundObjectRef": {"apiVersion": "v1", "kind": "Node", "name": "server2", "uid": server2.metadata.uid},
        }}))
        .unwrap();
        let accounts = Api::<ServiceAccount>::namespaced(admin.clone(), credential::NAMESPACE);
        let crossed = accounts.create_token_request("server1", &PostParams::default(), &request).await.unwrap();
        let crossed_file = h.dir.join("crossed.token");
        std::fs::write(&crossed_file, crossed.status.unwrap().token).unwrap();
        let mut kc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&kubeconfig).unwrap()).unwrap();
        kc["users"][0]["user"]["tokenFile"] = json!(crossed_file);
        let crossed_kubeconfig = h.dir.join("crossed.kubeconfig");
        std::fs::write(&crossed_kubeconfig, kc.to_string()).unwrap();
        let as_crossed = Api::<Node>::all(common::client_for(&crossed_kubeconfig).await);
        let m =
            refused("cordon server1 with a token bound to server2", as_crossed.patch("server1", &pp, &cordon).await);
        assert!(m.contains(POLICY_REFUSED) && m.contains("is bound to Node server2, not to Node server1"), "{m}");

        // Nothing of it happened.
        assert!(!node_of(&nodes.get("server2").await.unwrap()).2);
        assert_eq!(
            node_of(&nodes.get("server1").await.unwrap()),
            (Some("db".into()), vec!["dedicated".into()], false, None)
        );

        // `regrade check-access`: this credential is least privilege; the admin's is not.
        let b = c.boundary().await.unwrap();
        println!("--- check-access, server1's credential ---\n{b}");
        assert!(b.is_least_privilege(), "{b}");
        assert_eq!(b.bound_node(), Some("server1"));
        assert_eq!(b.own_marks.as_ref().map(|p| &p.outcome), Some(&boundary::Outcome::Allowed), "{b}");
        // A taint key the policy does not name would be refused at the first step:
        // check-access says so before it comes to that.
        let mut renamed = h.config(&kubeconfig, "server1", "regrade");
        renamed.cluster.taint_key = "example.com/stepped-down".into();
        let b = common::kube_cluster(&renamed).unwrap().boundary().await.unwrap();
        println!("--- check-access, cluster.taint_key = \"example.com/stepped-down\" ---\n{b}");
        assert!(!b.is_least_privilege() && b.own_marks_refused().is_some_and(|m| m.contains(POLICY_REFUSED)), "{b}");
        let b = cluster(&h, &h.admin_kubeconfig, "server1").boundary().await.unwrap();
        println!("--- check-access, the admin kubeconfig ---\n{b}");
        assert!(
            !b.is_least_privilege()
                && b.to_string().contains("OVER-PRIVILEGED")
                && b.to_string().contains("admin credential"),
            "{b}"
        );
    });
}

/// `regrade credential` keeps a token until less than half of its lifetime is left; a
/// token past that point is replaced, and the same client's next call uses the new one
/// (the API server names the token it was given: its credential ID, the token's `jti`).
#[test]
fn a_token_past_its_renewal_point_is_replaced_and_the_next_call_uses_it() {
    let Some(h) = common::start("a_token_past_its_renewal_point_is_replaced_and_the_next_call_uses_it") else { return };
    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready("server1")).await;
        h.apply_least_privilege();
        let now = || Timestamp::now().as_second();
        let ten_minutes = h.mint_settings("server1", Duration::from_secs(600));
        let first = match credential::ensure(&ten_minutes, now()).await.unwrap() {
            Minted::Renewed { claims, policy, .. } => {
                assert_eq!(policy, PolicyState::InForce);
                claims
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(first.node.as_deref(), Some("server1"));
        let c = cluster(&h, &ten_minutes.kubeconfig, "server1");
        let credential_id = |u: k8s_openapi::api::authentication::v1::UserInfo| {
            u.extra.unwrap_or_default().get("authentication.kubernetes.io/credential-id").cloned().unwrap_or_default()
        };
        let used = credential_id(boundary::who_am_i(&c.endpoints).await.unwrap());
        assert_eq!(used, [format!("JTI={}", first.id.clone().unwrap())]);

        // Ten minutes left of a ten-minute lifetime: kept.
        match credential::ensure(&ten_minutes, now()).await.unwrap() {
            Minted::Kept { claims, renew_at, .. } => {
                assert_eq!(claims, first);
                println!("kept: renewed from {renew_at}, expires {}", claims.expires_at);
            }
            other => panic!("{other:?}"),
        }
        // With a day's lifetime the same token is past its renewal point (less than 12 h
        // left): replaced.
        let a_day = MintSettings { lifetime: Duration::from_secs(86400), ..ten_minutes.clone() };
        let second = match credential::ensure(&a_day, now()).await.unwrap() {
            Minted::Renewed { claims, why, .. } => {
                println!("renewed: {why}");
                assert!(why.contains("less than half of the 86400s lifetime"), "{why}");
                claims
            }
            other => panic!("{other:?}"),
        };
        assert_ne!(second.id, first.id);
        assert!(second.expires_at - now() > 86000, "{second:?}");
        // The same KubeCluster (a running watch), no restart: its next call uses it.
        let used = credential_id(boundary::who_am_i(&c.endpoints).await.unwrap());
        println!("the next call used {used:?} (first token JTI={:?}, new one JTI={:?})", first.id, second.id);
        assert_eq!(used, [format!("JTI={}", second.id.unwrap())]);
    });
}

/// A cluster older than 1.30 has no ValidatingAdmissionPolicy: here a 1.37 API server
/// that serves none (the two resources turned off) and runs no such admission plugin.
/// Installing the policy is refused, `regrade credential` says what that leaves, and a
/// step's marks work with the RBAC alone.
#[test]
fn without_validating_admission_policy_the_policy_is_refused_and_the_rbac_alone_works() {
    let test = "without_validating_admission_policy_the_policy_is_refused_and_the_rbac_alone_works";
    let off = [
        "--apiserver-arg=--runtime-config=admissionregistration.k8s.io/v1/validatingadmissionpolicies=false,\
         admissionregistration.k8s.io/v1/validatingadmissionpolicybindings=false",
        "--apiserver-arg=--disable-admission-plugins=ValidatingAdmissionPolicy",
    ];
    let Some(h) = common::start_with(test, &off) else { return };
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/admission-policy.yaml");
    h.kubectl(&["apply", "-f", Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/rbac.yaml").to_str().unwrap()]);
    let out = std::process::Command::new(h.bin_dir.join("kubectl"))
        .arg("--kubeconfig")
        .arg(&h.admin_kubeconfig)
        .args(["apply", "-f", policy.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    println!("kubectl apply -f deploy/admission-policy.yaml: {err}");
    assert!(!out.status.success() && err.contains("no matches for kind \"ValidatingAdmissionPolicy\""), "{err}");
    block_on(async {
        let admin = h.admin().await;
        two_servers(&admin).await;
        let s = h.mint_settings("server1", Duration::from_secs(3600));
        let refusal = match credential::ensure(&s, Timestamp::now().as_second()).await.unwrap() {
            Minted::Renewed { policy, claims, .. } => {
                assert_eq!(policy, PolicyState::NotServed);
                assert_eq!(claims.node.as_deref(), Some("server1"));
                policy.refusal().unwrap()
            }
            other => panic!("{other:?}"),
        };
        println!("regrade credential: {refusal}");
        assert!(refusal.contains("serves no ValidatingAdmissionPolicy") && refusal.contains("1.30"), "{refusal}");

        // The RBAC alone: a step's marks go on and off.
        let c = cluster(&h, &s.kubeconfig, "server1");
        let nodes = Api::<Node>::all(admin.clone());
        c.mark_node(Level::ControlPlane, &LevelsConfig::default()).await.unwrap();
        assert_eq!(node_of(&nodes.get("server1").await.unwrap()).3.as_deref(), Some("control-plane"));
        c.mark_node(Level::Full, &LevelsConfig::default()).await.unwrap();
        assert_eq!(
            node_of(&nodes.get("server1").await.unwrap()),
            (Some("db".into()), vec!["dedicated".into()], false, None)
        );

        // And nothing bounds it beyond that: check-access says so.
        let b = c.boundary().await.unwrap();
        println!("--- check-access without the policy ---\n{b}");
        assert!(!b.is_least_privilege() && b.to_string().contains("NOT BOUNDED BY THE POLICY"), "{b}");
        assert!(b.missing().is_empty() && b.excess().is_empty(), "{b}");
    });
}
