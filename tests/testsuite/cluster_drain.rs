//! The drain against a real kube-apiserver, a real kube-controller-manager (its
//! disruption controller computes PodDisruptionBudget status, its ReplicaSet
//! controller re-creates evicted pods) and kubelet-standin (pods run and finish their
//! graceful deletions; unscheduled pods are bound to a fitting Node), all from
//! tests/rig. Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, ReplicaSet};
use k8s_openapi::api::core::v1::{Node, Pod, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::Api;
use regrade::cluster::drain::{self, DrainReport, DrainSettings, OnDrainTimeout, PublishedDrain, Skip};
use regrade::cluster::{Cluster, KubeCluster};
use regrade::level::Level;
use serde_json::json;

use common::{block_on, Harness, Kubelet};

const NS: &str = "apps";
const RIG: &[&str] = &["--controller-manager", "--kubelet"];

fn say(line: String) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Polls `f` every 100 ms until it is `Some`, for at most `limit`.
async fn until<T, F: std::future::Future<Output = Option<T>>>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> F,
) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The namespace with its `default` ServiceAccount (no controller makes it here, and
/// pods are refused without it).
async fn namespace(c: &kube::Client) {
    let ns: k8s_openapi::api::core::v1::Namespace = serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap();
    Api::all(c.clone()).create(&PostParams::default(), &ns).await.unwrap();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "default"}})).unwrap();
    Api::<ServiceAccount>::namespaced(c.clone(), NS).create(&PostParams::default(), &sa).await.unwrap();
}

/// A ReplicaSet of `replicas` pods that the stand-in scheduler places on the first
/// fitting Node by name.
async fn replicaset(c: &kube::Client, name: &str, replicas: i32, grace: i64) {
    replicaset_on(c, name, replicas, grace, json!({})).await
}

/// As `replicaset`, with the pods' nodeSelector.
async fn replicaset_on(c: &kube::Client, name: &str, replicas: i32, grace: i64, selector: serde_json::Value) {
    let rs: ReplicaSet = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": grace,
                    "nodeSelector": selector,
                    "containers": [{"name": "main", "image": "example.invalid/app:1"}],
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            },
        },
    }))
    .unwrap();
    Api::<ReplicaSet>::namespaced(c.clone(), NS).create(&PostParams::default(), &rs).await.unwrap();
}

async fn pods_of(c: &kube::Client, app: &str) -> Vec<Pod> {
    let lp = ListParams::default().labels(&format!("app={app}"));
    Api::<Pod>::namespaced(c.clone(), NS).list(&lp).await.unwrap().items
}

fn node_of(p: &Pod) -> &str {
    p.spec.as_ref().and_then(|s| s.node_name.as_deref()).unwrap_or("")
}

fn running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none() && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Waits until `app` has `n` pods Running on `node` and no others.
async fn settled(c: &kube::Client, app: &str, n: usize, node: &str) -> Vec<Pod> {
    until(&format!("{n} pods of {app} Running on {node}"), Duration::from_secs(60), || async {
        let pods = pods_of(c, app).await;
        (pods.len() == n && pods.iter().all(|p| running(p) && node_of(p) == node)).then_some(pods)
    })
    .await
}

/// A pod a DaemonSet controls (no DaemonSet controller runs here: the pod is made as
/// it would make it), and a mirror pod, both on `node`.
async fn daemonset_and_mirror_pods(c: &kube::Client, node: &str) -> (Pod, Pod) {
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "node-agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "node-agent"}},
            "template": {"metadata": {"labels": {"app": "node-agent"}},
                         "spec": {"containers": [{"name": "a", "image": "example.invalid/agent:1"}]}},
        },
    }))
    .unwrap();
    let ds = Api::<DaemonSet>::namespaced(c.clone(), NS).create(&PostParams::default(), &ds).await.unwrap();
    let pods = Api::<Pod>::namespaced(c.clone(), NS);
    let agent: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("node-agent-{node}"), "labels": {"app": "node-agent"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "node-agent",
                                          "uid": ds.metadata.uid, "controller": true, "blockOwnerDeletion": true}]},
        "spec": {"nodeName": node, "containers": [{"name": "a", "image": "example.invalid/agent:1"}],
                 "tolerations": [{"operator": "Exists"}]},
    }))
    .unwrap();
    let node_uid = Api::<Node>::all(c.clone()).get(node).await.unwrap().metadata.uid;
    let mirror: Pod = serde_json::from_value(json!({
        "metadata": {"name": format!("kube-vip-{node}"), "labels": {"app": "static"},
                     "annotations": {drain::MIRROR_ANNOTATION: "0123456789abcdef",
                                     "kubernetes.io/config.source": "file"},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid,
                                          "controller": true}]},
        "spec": {"nodeName": node, "containers": [{"name": "vip", "image": "example.invalid/vip:1"}]},
    }))
    .unwrap();
    let agent = pods.create(&PostParams::default(), &agent).await.unwrap();
    let mirror = pods.create(&PostParams::default(), &mirror).await.unwrap();
    (agent, mirror)
}

/// A budget of `maxUnavailable: 0` over `app`, waited for until the disruption
/// controller has observed it (before that, every eviction it covers is refused anyway,
/// and the test would prove nothing about the budget itself).
async fn budget(c: &kube::Client, app: &str) {
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": format!("{app}-pdb")},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": app}}},
    }))
    .unwrap();
    let api = Api::<PodDisruptionBudget>::namespaced(c.clone(), NS);
    api.create(&PostParams::default(), &pdb).await.unwrap();
    until("the disruption controller to observe the budget", Duration::from_secs(30), || async {
        let p = api.get(&format!("{app}-pdb")).await.unwrap();
        let s = p.status?;
        (s.observed_generation == p.metadata.generation && s.current_healthy == 1 && s.disruptions_allowed == 0)
            .then_some(())
    })
    .await;
}

async fn cordon(c: &kube::Client, node: &str) {
    let p = Patch::Merge(json!({"spec": {"unschedulable": true}}));
    Api::<Node>::all(c.clone()).patch(node, &PatchParams::default(), &p).await.unwrap();
}

fn cluster(h: &Harness, kubeconfig: &std::path::Path, node: &str) -> KubeCluster {
    let cfg = h.config(kubeconfig, node, "regrade");
    KubeCluster::new(&cfg.cluster, &cfg.levels).unwrap()
}

async fn run_drain(c: &KubeCluster, node: &str, timeout: Duration, on_timeout: OnDrainTimeout) -> DrainReport {
    let mut steps: Vec<DrainReport> = Vec::new();
    let settings = DrainSettings { timeout, on_timeout };
    let r = drain::drain(&c.endpoints, node, settings, std::future::pending(), &mut |r| steps.push(r.clone())).await;
    say(format!("{node}: {r}"));
    let moved = |r: &DrainReport| DrainReport { elapsed_ms: 0, ..r.clone() };
    assert_eq!(steps.last().map(moved), Some(moved(&r)), "progress ends with the report");
    r
}

fn names(pods: &[Pod]) -> Vec<String> {
    let mut v: Vec<String> = pods.iter().map(|p| format!("{NS}/{}", p.metadata.name.as_deref().unwrap())).collect();
    v.sort();
    v
}

#[test]
fn replicaset_pods_move_daemonset_and_mirror_pods_stay_a_budget_holds_until_delete() {
    let test = "replicaset_pods_move_daemonset_and_mirror_pods_stay_a_budget_holds_until_delete";
    let Some(h) = common::start_with(test, RIG) else { return };
    block_on(async {
        let admin = h.admin().await;
        for n in ["drain-1", "drain-2"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        namespace(&admin).await;
        // drain-2 cordoned while the pods are placed: all of them land on drain-1.
        cordon(&admin, "drain-2").await;
        replicaset(&admin, "web", 3, 1).await;
        replicaset(&admin, "db", 1, 1).await;
        let web = settled(&admin, "web", 3, "drain-1").await;
        let db = settled(&admin, "db", 1, "drain-1").await;
        let (agent, mirror) = daemonset_and_mirror_pods(&admin, "drain-1").await;
        budget(&admin, "db").await;
        let p = Patch::Merge(json!({"spec": {"unschedulable": false}}));
        Api::<Node>::all(admin.clone()).patch("drain-2", &PatchParams::default(), &p).await.unwrap();
        cordon(&admin, "drain-1").await;

        // proceed: the budget holds db back for the whole drain_timeout.
        let c = cluster(&h, &h.admin_kubeconfig, "drain-1");
        let timeout = Duration::from_secs(6);
        let t0 = Instant::now();
        let r = run_drain(&c, "drain-1", timeout, OnDrainTimeout::Proceed).await;
        let took = t0.elapsed();
        assert!(took >= timeout && took < timeout + Duration::from_secs(3), "ended {took:?} after the start");
        assert!(r.timed_out && r.error.is_none(), "{r:?}");
        assert_eq!(r.evicted, names(&web), "{r:?}");
        assert_eq!(r.blocked.len(), 1, "{r:?}");
        assert_eq!(r.blocked[0].pod, names(&db)[0]);
        assert_eq!(r.blocked[0].pdb.as_deref(), Some("db-pdb"));
        assert!(r.blocked[0].message.as_deref().unwrap().contains("needs 1 healthy pods"), "{r:?}");
        let skipped: Vec<_> = r.skipped.iter().map(|s| (s.pod.as_str(), s.why)).collect();
        assert_eq!(skipped, [("apps/kube-vip-drain-1", Skip::Mirror), ("apps/node-agent-drain-1", Skip::DaemonSet)]);
        assert!(r.waiting.is_empty() && r.deleted.is_empty() && r.bare.is_empty(), "{r:?}");
        assert!(r.to_string().contains("apps/db-"), "{r}");

        // The workload moved: the ReplicaSet's new pods run on drain-2.
        settled(&admin, "web", 3, "drain-2").await;
        // db and the left-alone pods are where they were, untouched.
        let pods = Api::<Pod>::namespaced(admin.clone(), NS);
        for p in [&db[0], &agent, &mirror] {
            let now = pods.get(p.metadata.name.as_deref().unwrap()).await.unwrap();
            assert_eq!(now.metadata.uid, p.metadata.uid);
            assert!(now.metadata.deletion_timestamp.is_none(), "{:?} is being deleted", now.metadata.name);
            assert_eq!(node_of(&now), "drain-1");
        }

        // A stop (what SIGTERM does) ends a drain at once, saying what was left.
        let t0 = Instant::now();
        let settings = DrainSettings { timeout: Duration::from_secs(60), on_timeout: OnDrainTimeout::Delete };
        let stop = tokio::time::sleep(Duration::from_millis(1500));
        let r = drain::drain(&c.endpoints, "drain-1", settings, stop, &mut |_| {}).await;
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        assert!(r.interrupted && !r.timed_out && r.deleted.is_empty(), "{r:?}");
        assert_eq!(r.blocked.iter().map(|b| b.pod.clone()).collect::<Vec<_>>(), names(&db));
        assert!(r.to_string().contains("stopped by a signal"), "{r}");

        // delete: at the deadline db is deleted past its budget, and moves too.
        let r = run_drain(&c, "drain-1", Duration::from_secs(2), OnDrainTimeout::Delete).await;
        assert!(r.timed_out && r.error.is_none(), "{r:?}");
        assert_eq!(r.deleted, names(&db), "{r:?}");
        assert!(r.blocked.is_empty() && r.evicted.is_empty(), "{r:?}");
        until("db's pod to be gone from drain-1", Duration::from_secs(10), || async {
            pods.get_opt(db[0].metadata.name.as_deref().unwrap()).await.unwrap().is_none().then_some(())
        })
        .await;
        settled(&admin, "db", 1, "drain-2").await;
        for p in [&agent, &mirror] {
            assert!(pods.get(p.metadata.name.as_deref().unwrap()).await.unwrap().metadata.deletion_timestamp.is_none());
        }
        // Nothing left to move: a third drain, through the cluster edge as a step runs
        // it, ends at once and leaves what it did where `status` reads it.
        let mut c = c;
        let progress = h.dir.join("drain.json");
        c.drain_progress = Some(progress.clone());
        let t0 = Instant::now();
        let settings = DrainSettings { timeout: Duration::from_secs(30), on_timeout: OnDrainTimeout::Proceed };
        let r = Cluster::drain(&c, Level::ControlPlane, settings).await.expect("a report");
        assert!(!r.timed_out && !r.incomplete() && r.skipped.len() == 2, "{r:?}");
        assert!(t0.elapsed() < Duration::from_secs(2));
        let p = PublishedDrain::read(&progress).expect("the drain's progress published");
        assert!(!p.running && p.report == r && p.level == "control-plane" && p.node == "drain-1", "{p:?}");
    });
}

#[test]
fn the_shipped_rbac_drains_and_a_missing_right_is_named() {
    let Some(h) = common::start_with("the_shipped_rbac_drains_and_a_missing_right_is_named", RIG) else { return };
    let sa = h.unbound_server_credential("rbac-1");
    block_on(async {
        let admin = h.admin().await;
        for n in ["rbac-1", "rbac-2"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        namespace(&admin).await;
        cordon(&admin, "rbac-2").await;
        replicaset(&admin, "web", 2, 1).await;
        replicaset(&admin, "db", 1, 1).await;
        settled(&admin, "web", 2, "rbac-1").await;
        let db = settled(&admin, "db", 1, "rbac-1").await;
        budget(&admin, "db").await;
        cordon(&admin, "rbac-1").await;
        let p = Patch::Merge(json!({"spec": {"unschedulable": false}}));
        Api::<Node>::all(admin.clone()).patch("rbac-2", &PatchParams::default(), &p).await.unwrap();

        // With the shipped rights: list, evict, and (for "delete") delete.
        let c = cluster(&h, &sa, "rbac-1");
        let r = run_drain(&c, "rbac-1", Duration::from_secs(3), OnDrainTimeout::Proceed).await;
        assert!(r.error.is_none() && r.evicted.len() == 2 && r.blocked.len() == 1, "{r:?}");

        // Without the delete pair, "delete" names what it lacks.
        h.kubectl(&["delete", "clusterrolebinding", "regrade-drain-delete"]);
        let r = run_drain(&c, "rbac-1", Duration::from_secs(2), OnDrainTimeout::Delete).await;
        let e = r.error.clone().unwrap_or_default();
        assert!(e.contains(&format!("delete pods {}", names(&db)[0])) && e.contains("403"), "{r:?}");
        assert!(e.contains("cannot delete resource \"pods\""), "{e}");
        assert!(r.incomplete() && r.deleted.is_empty());

        // Without pods/eviction, the drain stops at the first eviction and names it.
        // Pinned to rbac-1 and made only once rbac-1 takes pods: the stand-in places a
        // pod by its (possibly lagging) view of the Nodes.
        Api::<Node>::all(admin.clone())
            .patch("rbac-1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"unschedulable": false}})))
            .await
            .unwrap();
        replicaset_on(&admin, "late", 1, 1, json!({"kubernetes.io/hostname": "rbac-1"})).await;
        settled(&admin, "late", 1, "rbac-1").await;
        cordon(&admin, "rbac-1").await;
        let role = h.kubectl(&["get", "clusterrole", "regrade", "-o", "json"]);
        let mut role: serde_json::Value = serde_json::from_str(&role).unwrap();
        role["metadata"].as_object_mut().unwrap().remove("resourceVersion");
        role["rules"].as_array_mut().unwrap().retain(|r| !r["resources"].to_string().contains("pods/eviction"));
        let file = h.dir.join("role-without-eviction.json");
        std::fs::write(&file, role.to_string()).unwrap();
        h.kubectl(&["replace", "-f", file.to_str().unwrap()]);
        let t0 = Instant::now();
        let r = run_drain(&c, "rbac-1", Duration::from_secs(30), OnDrainTimeout::Proceed).await;
        let e = r.error.clone().unwrap_or_default();
        assert!(e.contains("create pods/eviction") && e.contains("403"), "{r:?}");
        assert!(e.contains("cannot create resource \"pods/eviction\""), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "a missing right ends the drain at once");
        say(format!("without permission: {e}"));

        // Without list, nothing is tried.
        role["rules"].as_array_mut().unwrap().retain(|r| r["resources"] != json!(["pods"]));
        std::fs::write(&file, role.to_string()).unwrap();
        h.kubectl(&["replace", "-f", file.to_str().unwrap()]);
        let r = run_drain(&c, "rbac-1", Duration::from_secs(30), OnDrainTimeout::Proceed).await;
        let e = r.error.clone().unwrap_or_default();
        assert!(e.contains("list pods") && e.contains("cannot list resource \"pods\""), "{r:?}");
    });
}

/// How long a drain of N pods takes (each with a 1 s grace period, which the stand-in
/// kubelet always waits out in full), beside the deadline.
#[test]
fn drain_time_of_10_and_50_pods() {
    let Some(h) = common::start_with("drain_time_of_10_and_50_pods", RIG) else { return };
    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready("bench-1")).await;
        namespace(&admin).await;
        let c = cluster(&h, &h.admin_kubeconfig, "bench-1");
        let deadline = Duration::from_secs(120);
        for n in [10, 50] {
            let app = format!("bench-{n}");
            Api::<Node>::all(admin.clone())
                .patch("bench-1", &PatchParams::default(), &Patch::Merge(json!({"spec": {"unschedulable": false}})))
                .await
                .unwrap();
            replicaset(&admin, &app, n, 1).await;
            settled(&admin, &app, n as usize, "bench-1").await;
            cordon(&admin, "bench-1").await;
            let r = run_drain(&c, "bench-1", deadline, OnDrainTimeout::Proceed).await;
            assert_eq!(r.evicted.len(), n as usize, "{r:?}");
            assert!(!r.timed_out && !r.incomplete(), "{r:?}");
            say(format!(
                "DRAIN-TIME n={n} took={:.2}s deadline={}s (grace period 1s per pod)",
                r.elapsed_ms as f64 / 1000.0,
                deadline.as_secs()
            ));
            // The ReplicaSet's new pods find no schedulable Node: none back on bench-1.
            let back = pods_of(&admin, &app).await.into_iter().filter(|p| node_of(p) == "bench-1").count();
            assert_eq!(back, 0);
            // Out of the way of the next round: no pending pods to come back.
            let scale = Patch::Merge(json!({"spec": {"replicas": 0}}));
            Api::<ReplicaSet>::namespaced(admin.clone(), NS)
                .patch(&app, &PatchParams::default(), &scale)
                .await
                .unwrap();
            until(&format!("{app} scaled to 0"), Duration::from_secs(30), || async {
                pods_of(&admin, &app).await.is_empty().then_some(())
            })
            .await;
        }
    });
}

/// A 409 for the same pod (the API server's own conflict retries ran out; the pod is
/// still there with its UID) is retried, not taken as "gone meanwhile": a proxy in
/// front of the API server answers the pod's first two evictions with 409 itself,
/// then lets them through. The pod is evicted in the end, and its ReplicaSet's new
/// pod runs on the other Node.
#[test]
fn an_eviction_answered_409_for_the_same_pod_is_retried_until_it_is_evicted() {
    let test = "an_eviction_answered_409_for_the_same_pod_is_retried_until_it_is_evicted";
    let Some(h) = common::start_with(test, RIG) else { return };
    // The proxy passes a token through, not a client certificate: the ServiceAccount.
    let sa = h.unbound_server_credential("conflict-1");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let proxy = rt.block_on(common::lost_reply::start(&h.server, &h.dir.join("pki")));
    let via = h.dir.join("conflicting.kubeconfig");
    std::fs::write(&via, std::fs::read_to_string(&sa).unwrap().replace(&h.server, &proxy.url)).unwrap();
    rt.block_on(async {
        let admin = h.admin().await;
        for n in ["conflict-1", "conflict-2"] {
            common::create_server_node(&admin, &Kubelet::ready(n)).await;
        }
        namespace(&admin).await;
        cordon(&admin, "conflict-2").await;
        replicaset(&admin, "web", 1, 1).await;
        let web = settled(&admin, "web", 1, "conflict-1").await;
        let p = Patch::Merge(json!({"spec": {"unschedulable": false}}));
        Api::<Node>::all(admin.clone()).patch("conflict-2", &PatchParams::default(), &p).await.unwrap();
        cordon(&admin, "conflict-1").await;

        proxy.knobs.conflict_next_evictions(2);
        let c = cluster(&h, &via, "conflict-1");
        let r = run_drain(&c, "conflict-1", Duration::from_secs(60), OnDrainTimeout::Proceed).await;
        let (seen, conflicted) = (
            proxy.knobs.evictions.load(std::sync::atomic::Ordering::SeqCst),
            proxy.knobs.conflicted.load(std::sync::atomic::Ordering::SeqCst),
        );
        assert_eq!(conflicted, 2, "{r:?}");
        assert!(seen >= 3, "the eviction was not tried again after the 409s: {seen} seen, {r:?}");
        assert_eq!(r.evicted, names(&web), "{r:?}");
        assert!(r.gone.is_empty(), "a 409 for the same pod read as gone: {r:?}");
        assert!(!r.incomplete() && !r.timed_out, "{r:?}");
        let pods = Api::<Pod>::namespaced(admin.clone(), NS);
        let name = web[0].metadata.name.clone().unwrap();
        until("the evicted pod to be gone", Duration::from_secs(30), || async {
            pods.get_opt(&name).await.unwrap().is_none().then_some(())
        })
        .await;
        settled(&admin, "web", 1, "conflict-2").await;
        say(format!("409 twice then through: {seen} evictions sent, {conflicted} answered 409 by the proxy; {r}"));
    });
}
