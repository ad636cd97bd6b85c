//! The credential's lifecycle on a real kube-apiserver (issue 59): a token the API
//! server no longer accepts (its Node deleted and registered again) is noted at the
//! first 401 and replaced by the next `regrade credential`, and the next step succeeds
//! with no restart; a server whose own API server is gone (etcd-only), knowing the
//! others only from the endpoints cache, renews through another one. Gated by
//! REGRADE_TEST_KUBE=1.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use kube::api::DeleteParams;
use kube::Api;
use regrade::cluster::credential::{self, MintSettings, Minted};
use regrade::cluster::rejected::RejectedNote;
use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use regrade::levels::LevelsConfig;

use common::{block_on, Kubelet};

/// A step up that restarts nothing: the Lease and the marks, as `watch` takes it.
const UP: Step = Step { direction: Direction::Up, from: Level::ControlPlane, to: Level::Full };

async fn step_up(c: &regrade::cluster::KubeCluster) -> anyhow::Result<()> {
    c.acquire(&UP).await.map_err(|r| anyhow::anyhow!("{r}"))?;
    let marked = c.mark_node(Level::Full, &LevelsConfig::default()).await;
    c.release().await;
    marked
}

fn now() -> i64 {
    Timestamp::now().as_second()
}

/// The admin kubeconfig with its server replaced by `server`.
fn admin_at(h: &common::Harness, server: &str) -> PathBuf {
    let text = std::fs::read_to_string(&h.admin_kubeconfig).unwrap().replace(&h.server, server);
    let out = h.dir.join("admin-down.kubeconfig");
    std::fs::write(&out, text).unwrap();
    out
}

fn uid(n: &Node) -> String {
    n.metadata.uid.clone().unwrap_or_default()
}

#[test]
fn a_node_registered_again_revokes_the_token_and_the_next_renewal_mints_a_fresh_one() {
    let test = "a_node_registered_again_revokes_the_token_and_the_next_renewal_mints_a_fresh_one";
    let Some(h) = common::start(test) else { return };
    block_on(async {
        let admin = h.admin().await;
        let nodes = Api::<Node>::all(admin.clone());
        common::create_server_node(&admin, &Kubelet::ready("server1")).await;
        let kubeconfig = h.server_credential("server1").await;
        let s = h.mint_settings("server1", Duration::from_secs(3600));
        let c = common::kube_cluster(&h.config(&kubeconfig, "server1", "regrade")).unwrap();
        c.mark_node(Level::ControlPlane, &LevelsConfig::default()).await.unwrap();
        let first =
            credential::TokenClaims::parse(&std::fs::read_to_string(credential::token_path(&kubeconfig)).unwrap())
                .unwrap();

        // The Node deleted and registered again under its name: a new uid, and the
        // token bound to the old one is rejected (once the API server has seen the change).
        let old = uid(&nodes.get("server1").await.unwrap());
        nodes.delete("server1", &DeleteParams::default()).await.unwrap();
        common::create_server_node(&admin, &Kubelet::ready("server1")).await;
        let new = uid(&nodes.get("server1").await.unwrap());
        assert_ne!(old, new);
        let t0 = Instant::now();
        let rejected = loop {
            match step_up(&c).await {
                Err(e) if format!("{e:#}").contains("401") => break format!("{e:#}"),
                other => assert!(t0.elapsed() < Duration::from_secs(30), "still accepted: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        println!("after the Node was registered again: {rejected}");
        // The first 401 is noted beside the kubeconfig (for `status`, and the path unit).
        let note = RejectedNote::read(&kubeconfig).expect("the 401 noted");
        assert!(note.error.contains("401"), "{note:?}");

        // The token is not past its renewal point; the next renewal asks the API server
        // all the same, and mints a fresh one.
        let why = match credential::ensure(&s, now()).await.unwrap() {
            Minted::Renewed { why, claims, .. } => {
                assert_ne!(claims.id, first.id);
                why
            }
            other => panic!("the rejected token was kept: {other:?}"),
        };
        println!("regrade credential: renewed because {why}");
        assert!(why.contains("rejects it") && why.contains("401"), "{why}");
        assert_eq!(RejectedNote::read(&kubeconfig), None, "the note outlived the renewal");

        // The same client (a running watch, no restart): the next step succeeds.
        step_up(&c).await.unwrap();
        // And a token the API server accepts is kept.
        assert!(matches!(credential::ensure(&s, now()).await.unwrap(), Minted::Kept { unasked: None, .. }));
    });
}

#[test]
fn at_etcd_only_with_only_the_cache_the_token_is_renewed_through_another_server() {
    let test = "at_etcd_only_with_only_the_cache_the_token_is_renewed_through_another_server";
    let Some(h) = common::start(test) else { return };
    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready("server1")).await;
        h.apply_least_privilege();
        // This server's own API server is gone (etcd-only: k3s disabled it; a refused
        // port, which regrade passes over as it does a 503); no cluster.api_servers;
        // the endpoints cache `watch` filled while its own answered names the other.
        let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let local = format!("https://{gone}");
        let cache = h.dir.join("endpoints-server1");
        std::fs::write(&cache, format!("{}\n", h.server)).unwrap();
        let s = MintSettings {
            admin_kubeconfig: admin_at(&h, &local),
            endpoints_cache: Some(cache.clone()),
            tls_server_name: Some("kubernetes".into()),
            request_timeout: Duration::from_secs(3),
            ..h.mint_settings("server1", Duration::from_secs(3600))
        };
        // Knowing only its own, it reaches none: what check-config warns of.
        let alone = MintSettings { endpoints_cache: None, ..s.clone() };
        let e = credential::ensure(&alone, now()).await.unwrap_err().to_string();
        println!("with no other server known: {e}");
        assert!(e.contains("no Kubernetes API server answered"), "{e}");
        let mut cfg = h.config(&s.kubeconfig, "server1", "regrade");
        cfg.cluster.endpoints_cache = PathBuf::new();
        assert!(cfg.cluster.warnings().iter().any(|w| w.contains("knows only its own API server")));

        match credential::ensure(&s, now()).await.unwrap() {
            Minted::Renewed { claims, .. } => assert_eq!(claims.node.as_deref(), Some("server1")),
            other => panic!("{other:?}"),
        }
        // `watch` with the new token goes the same way: its own first, then the cache.
        cfg.cluster.endpoints_cache = cache;
        assert!(cfg.cluster.warnings().is_empty(), "{:?}", cfg.cluster.warnings());
        let c = common::kube_cluster(&cfg).unwrap();
        c.mark_node(Level::ControlPlane, &LevelsConfig::default()).await.unwrap();
        assert_eq!(c.endpoints.urls().await.unwrap(), [local, h.server.clone()]);
        // And the next run keeps it, having asked the other server whether it accepts it.
        assert!(matches!(credential::ensure(&s, now()).await.unwrap(), Minted::Kept { unasked: None, .. }));
    });
}

/// `--admin-kubeconfig` with exactly the rights the docs ask of it (read Nodes, make
/// ServiceAccounts and their tokens in the namespace regrade): the admission-policy
/// check, advice only, is refused (403), and the token is written all the same.
#[test]
fn with_only_the_documented_rights_the_token_is_written_and_the_policy_check_is_advice() {
    let test = "with_only_the_documented_rights_the_token_is_written_and_the_policy_check_is_advice";
    let Some(h) = common::start(test) else { return };
    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready("server1")).await;
        h.apply_least_privilege();
        let minter = h.dir.join("minter.kubeconfig");
        let st = std::process::Command::new(h.bin_dir.join("harness"))
            .args(["mint-sa", h.admin_kubeconfig.to_str().unwrap(), "kube-system", "regrade-minter"])
            .arg(&minter)
            .status()
            .unwrap();
        assert!(st.success(), "harness mint-sa failed");
        let rights = r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: regrade-minter}
rules:
- {apiGroups: [""], resources: [nodes], verbs: [get]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: regrade-minter}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: regrade-minter}
subjects: [{kind: ServiceAccount, name: regrade-minter, namespace: kube-system}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: regrade-minter, namespace: regrade}
rules:
- {apiGroups: [""], resources: [serviceaccounts], verbs: [get, create]}
- {apiGroups: [""], resources: [serviceaccounts/token], verbs: [create]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: regrade-minter, namespace: regrade}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: regrade-minter}
subjects: [{kind: ServiceAccount, name: regrade-minter, namespace: kube-system}]
"#;
        let file = h.dir.join("minter-rbac.yaml");
        std::fs::write(&file, rights).unwrap();
        h.kubectl(&["apply", "-f", file.to_str().unwrap()]);
        let s = MintSettings { admin_kubeconfig: minter, ..h.mint_settings("server1", Duration::from_secs(3600)) };
        let (claims, policy) = match credential::ensure(&s, now()).await.unwrap() {
            Minted::Renewed { claims, policy, .. } => (claims, policy),
            other => panic!("{other:?}"),
        };
        let advice = policy.refusal().unwrap_or_default();
        println!("regrade credential: {advice}");
        assert!(advice.contains("403") && advice.contains("written all the same"), "{advice}");
        let written = std::fs::read_to_string(credential::token_path(&s.kubeconfig)).unwrap();
        assert_eq!(credential::TokenClaims::parse(&written).unwrap(), claims);
        // The token works.
        common::wait_for_the_policy(&s.kubeconfig).await;
        let c = common::kube_cluster(&h.config(&s.kubeconfig, "server1", "regrade")).unwrap();
        c.mark_node(Level::ControlPlane, &LevelsConfig::default()).await.unwrap();
    });
}
