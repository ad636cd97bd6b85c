//! What the two incident tests share (tests/testsuite/incident_real_pressure.rs, the cgroup v1
//! lane; tests/testsuite/vm_incident.rs, server1 in a VM): the processes they run on the host,
//! the API client and the write probe through server2, the workload's Deployment, and
//! waits. Included by each with `#[path]`.

#![allow(dead_code)] // each test uses its own part

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Api;
use serde_json::{json, Value};

use crate::common;

/// Seconds of the samples (at times `t`) for which `holds`: each sample stands for the
/// time until the next one. Folded from 0.0: an empty f64 sum is -0.0, printed "-0".
pub fn seconds_where<S>(samples: &[S], t: impl Fn(&S) -> f64, holds: impl Fn(&S) -> bool) -> f64 {
    samples.windows(2).filter(|w| holds(&w[0])).map(|w| t(&w[1]) - t(&w[0])).fold(0.0, |a, b| a + b)
}
use crate::common::three_servers::{addr, api_url, field, now};

/// Processes a test runs on the host (controllers, stand-ins, earlyoom): killed when
/// dropped.
pub struct Procs(pub Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The kubelet's system-reserved memory packaging/ ships, in bytes
/// (packaging/k3s/40-regrade-reserved.yaml: `system-reserved=memory=768Mi`). The kubelet
/// caps the pods' cgroup at the node's memory less it (node allocatable enforced on the
/// pods, its default; the hard eviction threshold is not taken off the cgroup).
pub fn system_reserved_bytes() -> u64 {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/k3s/40-regrade-reserved.yaml");
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let value = text.split("system-reserved=memory=").nth(1).and_then(|v| v.split('"').next());
    let mib = value.and_then(|v| v.strip_suffix("Mi")).and_then(|v| v.parse::<u64>().ok());
    mib.unwrap_or_else(|| panic!("{path}: no system-reserved=memory=<N>Mi")) << 20
}

/// A table cell: `-` for one with nothing to say.
pub fn or_dash(cell: String) -> String {
    if cell.is_empty() {
        "-".into()
    } else {
        cell
    }
}

/// Children die with the test, even SIGKILLed (PR_SET_PDEATHSIG: when the thread that
/// spawned them ends).
pub fn dies_with_us(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl only, between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        })
    }
}

pub fn spawn_logged(bin: &Path, args: &[&str], log: &Path) -> Child {
    let f = std::fs::File::create(log).unwrap();
    dies_with_us(&mut Command::new(bin))
        .args(args)
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()))
}

/// kube-controller-manager against the admin kubeconfig's API server, with the
/// controllers the workload needs (its Deployment, ReplicaSet, ServiceAccount, and
/// the disruption controller for budgets); its log in `work`.
pub fn controller_manager(bin: &Path, admin_kc: &Path, work: &Path) -> Child {
    let kc = format!("--kubeconfig={}", admin_kc.display());
    spawn_logged(
        &bin.join("kube-controller-manager"),
        &[
            &kc,
            "--leader-elect=false",
            "--controllers=deployment,replicaset,serviceaccount,disruption",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "-v=1",
        ],
        &work.join("kube-controller-manager.log"),
    )
}

/// The ConfigMap `probe` the write probe patches.
pub async fn create_probe(c: &kube::Client) {
    Api::<ConfigMap>::namespaced(c.clone(), "default")
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "probe"}})).unwrap())
        .await
        .unwrap();
}

/// A client of server `n`'s API server with the kubeconfig's credentials.
pub async fn client(kubeconfig: &Path, n: usize) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    cfg.cluster_url = api_url(n).parse().unwrap();
    cfg.connect_timeout = Some(Duration::from_secs(3));
    cfg.read_timeout = Some(Duration::from_secs(5));
    kube::Client::try_from(cfg).unwrap()
}

/// The Node's Ready condition and whether it is cordoned; `None` if it cannot be read.
pub async fn node_state(c: &kube::Client, name: &str) -> Option<(bool, bool)> {
    let n = Api::<Node>::all(c.clone()).get(name).await.ok()?;
    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    let ready = n
        .status
        .and_then(|s| s.conditions)
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    Some((ready, cordoned))
}

/// How long after an arm's end server1's member may take to answer healthy again and
/// still count as kept.
pub const MEMBER_BACK: Duration = Duration::from_secs(60);

/// Waits for `f`, polling every 250 ms; `None` after `within`.
pub async fn wait_until<T>(within: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if t0.elapsed() >= within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Writes the ConfigMap `probe` through server2's API every 500 ms: (start, seconds, ok).
pub struct Probe {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(f64, f64, bool)>>>,
}

impl Probe {
    pub fn start(kubeconfig: PathBuf) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            common::block_on(async move {
                let cms: Api<ConfigMap> = Api::namespaced(client(&kubeconfig, 2).await, "default");
                let mut out = Vec::new();
                let mut i = 0u64;
                while !s.load(Ordering::SeqCst) {
                    let t0 = now();
                    let patch = json!({"data": {"i": i.to_string()}});
                    let (pp, merge) = (PatchParams::default(), Patch::Merge(&patch));
                    let w = cms.patch("probe", &pp, &merge);
                    let ok = matches!(tokio::time::timeout(Duration::from_secs(5), w).await, Ok(Ok(_)));
                    let took = now() - t0;
                    out.push((t0, took, ok));
                    i += 1;
                    tokio::time::sleep(Duration::from_secs_f64((0.5 - took).max(0.0))).await;
                }
                out
            })
        });
        Probe { stop, thread: Some(thread) }
    }

    pub fn finish(mut self) -> Vec<(f64, f64, bool)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// A write through the API (the probe's ConfigMap) answered.
pub async fn api_write(c: &kube::Client) -> bool {
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let patch = json!({"data": {"start": now().to_string()}});
    cms.patch("probe", &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok()
}

/// The Deployment `hog` with one replica (no requests: BestEffort) running `command`;
/// created at the first call. The command (with the sizes) lives in the pod template:
/// a new one is a new ReplicaSet.
pub async fn start_workload(c: &kube::Client, command: &[String]) {
    let d: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(c.clone(), "default");
    let dep = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "hog", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "hog"}},
                 "template": {"metadata": {"labels": {"app": "hog"}},
                              "spec": {"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "hog", "image": "registry.invalid/hog:1",
                                                       "command": command}]}}}
    });
    d.patch("hog", &PatchParams::apply("incident").force(), &Patch::Apply(&dep)).await.unwrap();
}

/// The PodDisruptionBudget `hog` (minAvailable 1): made, or deleted.
pub async fn pdb(c: &kube::Client, make: bool) {
    let api: Api<k8s_openapi::api::policy::v1::PodDisruptionBudget> = Api::namespaced(c.clone(), "default");
    if make {
        let b = json!({"metadata": {"name": "hog"}, "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "hog"}}}});
        api.create(&PostParams::default(), &serde_json::from_value(b).unwrap()).await.unwrap();
    } else {
        api.delete("hog", &Default::default()).await.unwrap();
    }
}

/// The hog pods deleted at once (grace 1 s), as an operator resolving the incident would.
pub async fn delete_hog_pods(c: &kube::Client) {
    let pods: Api<Pod> = Api::namespaced(c.clone(), "default");
    let dp = kube::api::DeleteParams { grace_period_seconds: Some(1), ..Default::default() };
    pods.delete_collection(&dp, &ListParams::default().labels("app=hog")).await.unwrap();
}

/// When `journal` (a unit's entries: time, message, the entry) first has `message`
/// with `key` = `value`.
pub fn first_line(journal: &[(f64, String, Value)], message: &str, key: &str, value: &str) -> Option<f64> {
    journal.iter().find(|(_, m, v)| m == message && field(v, key) == value).map(|(t, ..)| *t)
}

/// Whether regrade's `journal` says it held the step into etcd-only by its cost
/// (`etcd-only-held`): refused at its decision, or held at the moment of its restart,
/// after its drain.
pub fn held_by_cost(journal: &[(f64, String, Value)]) -> bool {
    ["step refused", regrade::step::HELD_AT_RESTART]
        .iter()
        .any(|m| first_line(journal, m, "KIND", "etcd-only-held").is_some())
}

/// The Deployment `hog` scaled to 0, if there is one.
pub async fn scale_to_zero(c: &kube::Client) -> Result<(), kube::Error> {
    let d: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(c.clone(), "default");
    if d.get_opt("hog").await?.is_some() {
        d.patch("hog", &PatchParams::default(), &Patch::Merge(&json!({"spec": {"replicas": 0}}))).await?;
    }
    Ok(())
}

/// The hog pods not being deleted: (node, restarts, last termination reason).
pub async fn hog_pods(c: &kube::Client) -> Result<Vec<(String, i32, String)>, kube::Error> {
    let pods = Api::<Pod>::namespaced(c.clone(), "default").list(&ListParams::default().labels("app=hog")).await?.items;
    Ok(pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_else(|| "unbound".into());
            let cs = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first().cloned());
            let restarts = cs.as_ref().map_or(0, |c| c.restart_count);
            let reason =
                cs.and_then(|c| c.last_state).and_then(|s| s.terminated).and_then(|t| t.reason).unwrap_or_default();
            (node, restarts, reason)
        })
        .collect())
}

/// The etcd member list as server `n`'s member sees it, (name, ID), through its client
/// port with the client certificate under its root `root`.
pub fn member_ids(root: &Path, n: usize) -> Vec<(String, u64)> {
    let tls = root.join("var/lib/rancher/k3s/server/tls/etcd");
    let cfg = regrade::etcd::EtcdConfig {
        ca_file: tls.join("server-ca.crt"),
        cert_file: tls.join("client.crt"),
        key_file: tls.join("client.key"),
        ..Default::default()
    };
    let url = format!("https://{}:2379", addr(n));
    std::thread::spawn(move || {
        let client = regrade::etcd::client::EtcdClient::new(&cfg).unwrap();
        let ep = regrade::etcd::client::Endpoint::parse(&url).unwrap();
        common::block_on(client.member_list(&ep))
            .map(|l| l.members.into_iter().map(|m| (m.name, m.id)).collect())
            .unwrap_or_default()
    })
    .join()
    .unwrap()
}

/// Onset and relief of a thrash, sample by sample: the onset is the first sample at or
/// over `threshold`; relief, the start of the first 15 s under it after the onset.
#[derive(Default)]
pub struct Relief {
    pub onset: Option<f64>,
    below: Option<f64>,
    pub relief: Option<f64>,
}

impl Relief {
    pub fn observe(&mut self, t: f64, psi: f64, threshold: f64) {
        if self.onset.is_none() && psi >= threshold {
            self.onset = Some(t);
        }
        if self.onset.is_some() {
            self.below = if psi < threshold { self.below.or(Some(t)) } else { None };
        }
        if self.relief.is_none() && self.below.is_some_and(|b| t - b >= 15.0) {
            self.relief = self.below;
        }
    }
}

/// The probe's writes: the seconds in which a write failed or took over 1 s.
pub fn bad_write_seconds(probes: &[(f64, f64, bool)]) -> String {
    let bad: std::collections::BTreeSet<i64> =
        probes.iter().filter(|(_, took, ok)| !ok || *took > 1.0).map(|(t, ..)| *t as i64).collect();
    let failed = probes.iter().filter(|(_, _, ok)| !ok).count();
    format!("{} s ({} of {} writes failed)", bad.len(), failed, probes.len())
}

/// Leader changes each of server2 and server3 saw (`etcd_server_leader_changes_seen_total`
/// after less before), comma-separated; "?" where a figure was missing.
pub fn leader_changes(before: &[Option<f64>], after: &[Option<f64>]) -> String {
    let changes: Vec<String> = before
        .iter()
        .zip(after)
        .map(|(b, a)| match (b, a) {
            (Some(b), Some(a)) => format!("{}", a - b),
            _ => "?".into(),
        })
        .collect();
    format!("{} (seen by server2, server3)", changes.join(", "))
}

/// Every key a TOML file sets, as `section.key = value`, on one line.
pub fn keys_set(toml: &str) -> String {
    let mut section = String::new();
    let mut keys = Vec::new();
    for l in toml.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if let Some(name) = l.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = format!("{name}.");
        } else {
            keys.push(format!("{section}{l}"));
        }
    }
    keys.join(", ")
}
