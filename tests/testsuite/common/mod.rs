//! Test helpers for the cluster tests: a real etcd + kube-apiserver per test from
//! `tests/rig/kube-harness.sh`, killed with its whole process group when the test ends
//! or panics; and the tests' kubelets: Nodes with k3s's role labels, Ready conditions
//! and node Leases the tests renew or let go stale.
#![allow(dead_code)] // each test module uses its own part of these helpers (some only in a `docker` build)

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Event, Node, NodeCondition, NodeStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Api;
use serde_json::json;

/// The systemd-nspawn rig (tests/nspawn) for the systemd actuator tests.
pub mod nspawn;

/// The level-record tests' rig: API server, nspawn container, `regrade` as a child.
pub mod level_rig;

/// A k3s container on the Docker rig, for the level-record tests of a `docker` build.
#[cfg(feature = "docker")]
pub mod docker_k3s;

/// A private D-Bus with a stalled "systemd" on it.
pub mod private_bus;

/// A real etcd cluster with TLS and client-certificate auth, as k3s runs it.
pub mod etcd_cluster;

/// A proxy in front of the API server that loses a Node PATCH's reply.
pub mod lost_reply;

/// The three-server rig of the e2e and the incident tests: addresses, namespaces, seeds.
pub mod three_servers;

/// The shared fakes (src/testing.rs): the readiness wait of the actuator tests.
#[allow(unused_imports)] // used by the actuator tests only
pub use regrade::testing::Readiness;

/// The edges built from their own sections of `cfg`, as `backend` builds them.
pub fn kube_cluster(cfg: &regrade::config::Config) -> anyhow::Result<regrade::cluster::KubeCluster> {
    regrade::cluster::KubeCluster::new(&cfg.cluster, &cfg.levels)
}

pub fn systemd_actuator(cfg: &regrade::config::Config) -> anyhow::Result<regrade::actuator::systemd::SystemdActuator> {
    regrade::actuator::systemd::SystemdActuator::new(&cfg.systemd, &cfg.levels)
}

#[cfg(feature = "docker")]
pub fn docker_actuator(cfg: &regrade::config::Config) -> anyhow::Result<regrade::actuator::docker::DockerActuator> {
    regrade::actuator::docker::DockerActuator::new(&cfg.docker, &cfg.levels)
}

pub const GATE: &str = "REGRADE_TEST_KUBE";

/// A memory PSI fixture: every `some` average at `psi` percent, `full` at 0.
pub fn psi_text(psi: f64) -> String {
    format!(
        "some avg10={psi:.2} avg60={psi:.2} avg300={psi:.2} total=0\n\
         full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    )
}

/// A running etcd + kube-apiserver. Dropping it stops them.
pub struct Harness {
    child: Child,
    pub admin_kubeconfig: PathBuf,
    pub server: String,
    pub bin_dir: PathBuf,
    pub dir: PathBuf,
}

fn rig(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rig").join(script)
}

/// Runs a rig's build script (`tests/rig/build.sh`, `tests/vm/image.sh`, …; each a
/// no-op when what it builds is cached) and returns the directory its last stdout line
/// names. Its progress goes to the test's stderr.
#[allow(dead_code)]
pub fn built(script: &str) -> PathBuf {
    let out = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {script}: {e}"));
    assert!(out.status.success(), "{script} failed");
    PathBuf::from(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .last()
            .unwrap_or_else(|| panic!("{script} printed nothing"))
            .trim(),
    )
}

/// Whether the env var `gate` is `1`; else says on stderr that `test` was skipped
/// and what setting `gate` would run it against (`needs`).
pub fn gate_open(gate: &str, test: &str, needs: &str) -> bool {
    if std::env::var(gate).as_deref() == Ok("1") {
        return true;
    }
    // Straight to stderr: libtest captures eprintln!, and a skip must be seen.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: set {gate}=1 ({needs})");
    false
}

/// Starts a harness, or prints a notice and returns `None` when the gate is unset.
pub fn start(test: &str) -> Option<Harness> {
    start_with(test, &[])
}

/// As [`start`], with extra `harness run` flags (`--controller-manager`, `--kubelet`).
pub fn start_with(test: &str, args: &[&str]) -> Option<Harness> {
    if !gate_open(GATE, test, "a real kube-apiserver from tests/rig") {
        return None;
    }
    let bin_dir = built("tests/rig/build.sh");
    let mut child = Command::new(rig("kube-harness.sh"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .process_group(0)
        .spawn()
        .expect("starting tests/rig/kube-harness.sh");
    // From here on, a panic kills the process group through Drop.
    let stdout = child.stdout.take().unwrap();
    let mut h =
        Harness { child, admin_kubeconfig: PathBuf::new(), server: String::new(), bin_dir, dir: PathBuf::new() };
    let mut lines = BufReader::new(stdout).lines();
    h.admin_kubeconfig = PathBuf::from(lines.next().expect("harness printed nothing").unwrap());
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(v) = line.strip_prefix("SERVER=") {
            h.server = v.to_string();
        } else if let Some(v) = line.strip_prefix("DIR=") {
            h.dir = PathBuf::from(v);
        } else if line.starts_with("LOG=") {
            break;
        }
    }
    // Keep draining stdout so the harness never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Some(h)
}

impl Drop for Harness {
    fn drop(&mut self) {
        let pgid = self.child.id() as i32;
        // SAFETY: signals our own child's process group.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    unsafe { libc::kill(-pgid, libc::SIGKILL) };
                    let _ = self.child.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Harness {
    pub async fn admin(&self) -> kube::Client {
        client_for(&self.admin_kubeconfig).await
    }

    /// `kubectl` from the rig, against this API server as admin.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let out = Command::new(self.bin_dir.join("kubectl"))
            .arg("--kubeconfig")
            .arg(&self.admin_kubeconfig)
            .args(args)
            .output()
            .expect("running kubectl");
        assert!(out.status.success(), "kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// Applies deploy/rbac.yaml and deploy/admission-policy.yaml, as the NixOS module has
    /// k3s apply them.
    pub fn apply_least_privilege(&self) {
        for f in ["deploy/rbac.yaml", "deploy/admission-policy.yaml"] {
            self.kubectl(&["apply", "-f", Path::new(env!("CARGO_MANIFEST_DIR")).join(f).to_str().unwrap()]);
        }
    }

    /// Server `node`'s own credential as `regrade credential` mints it (the Node must
    /// exist): deploy/rbac.yaml and the admission policy applied, a token of the
    /// ServiceAccount regrade/<node> bound to the Node, in force once this returns.
    pub async fn server_credential(&self, node: &str) -> PathBuf {
        self.apply_least_privilege();
        let s = self.mint_settings(node, Duration::from_secs(3600));
        regrade::cluster::credential::ensure(&s, Timestamp::now().as_second()).await.unwrap();
        wait_for_the_policy(&s.kubeconfig).await;
        s.kubeconfig
    }

    /// What `regrade credential` is given for `node` on this API server: the admin
    /// kubeconfig, and regrade's kubeconfig at `DIR/regrade-<node>.kubeconfig`.
    pub fn mint_settings(&self, node: &str, lifetime: Duration) -> regrade::cluster::credential::MintSettings {
        regrade::cluster::credential::MintSettings {
            admin_kubeconfig: self.admin_kubeconfig.clone(),
            api_servers: Vec::new(),
            tls_server_name: None,
            request_timeout: Duration::from_secs(10),
            endpoints_cache: None,
            node: node.to_string(),
            kubeconfig: self.dir.join(format!("regrade-{node}.kubeconfig")),
            lifetime,
            renew_period: lifetime / 4,
            force: false,
        }
    }

    /// Server `node`'s own credential as an API server older than 1.31 gives it: a token
    /// of the ServiceAccount regrade/<node> bound to no Node (which need not exist yet),
    /// with deploy/rbac.yaml and the admission policy applied and in force.
    pub fn unbound_server_credential(&self, node: &str) -> PathBuf {
        self.apply_least_privilege();
        let out = self.dir.join(format!("regrade-{node}.kubeconfig"));
        let st = Command::new(rig("mint-sa-kubeconfig.sh"))
            .args([self.admin_kubeconfig.to_str().unwrap(), "regrade", node, out.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(st.success(), "mint-sa-kubeconfig.sh failed");
        block_on(wait_for_the_policy(&out));
        out
    }

    /// A regrade configuration for Node `node` using `kubeconfig`, with its own Lease.
    pub fn config(&self, kubeconfig: &Path, node: &str, lease: &str) -> regrade::config::Config {
        let mut c = regrade::config::Config::default();
        c.cluster.kubeconfig = Some(kubeconfig.to_path_buf());
        c.cluster.node_name = Some(node.to_string());
        c.cluster.lease_name = lease.to_string();
        c.cluster.endpoints_cache = self.dir.join(format!("endpoints-{node}"));
        c.cluster.request_timeout = regrade::units::HumanDuration(Duration::from_secs(5));
        c
    }
}

/// Waits until the admission policy refuses `kubeconfig`'s credential an Event about
/// another Node (a dry run): a policy just applied is in force once the API server has
/// read it.
pub async fn wait_for_the_policy(kubeconfig: &Path) {
    let events: Api<Event> = Api::namespaced(client_for(kubeconfig).await, "default");
    let probe: Event = serde_json::from_value(json!({
        "metadata": {"name": "policy-probe"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": "policy-probe"},
    }))
    .unwrap();
    let dry = PostParams { dry_run: true, ..Default::default() };
    let t = Instant::now();
    loop {
        match events.create(&dry, &probe).await {
            Err(kube::Error::Api(s)) if s.message.contains("ValidatingAdmissionPolicy") => return,
            other => assert!(t.elapsed() < Duration::from_secs(30), "the admission policy is not in force: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub async fn client_for(kubeconfig: &Path) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    kube::Client::try_from(cfg).unwrap()
}

pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

pub fn now_seconds() -> Timestamp {
    Timestamp::from_second(Timestamp::now().as_second()).unwrap()
}

/// How a test kubelet presents its Node.
pub struct Kubelet<'a> {
    pub name: &'a str,
    pub ready: &'a str,
    pub etcd_voter: Option<&'a str>,
}

impl Kubelet<'_> {
    pub fn ready(name: &str) -> Kubelet<'_> {
        Kubelet { name, ready: "True", etcd_voter: Some("True") }
    }
}

/// Creates a k3s server's Node (role labels, etcd annotations), its status and a
/// freshly renewed node Lease.
pub async fn create_server_node(c: &kube::Client, k: &Kubelet<'_>) {
    let nodes: Api<Node> = Api::all(c.clone());
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": k.name,
            "labels": {
                "node-role.kubernetes.io/etcd": "true",
                "node-role.kubernetes.io/control-plane": "true",
                "node-role.kubernetes.io/master": "true",
                "kubernetes.io/hostname": k.name,
            },
            "annotations": {
                "etcd.k3s.cattle.io/node-name": format!("{}-0a1b2c3d", k.name),
                "etcd.k3s.cattle.io/node-address": "10.0.0.1",
            },
        },
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    set_conditions(c, k).await;
    renew_node_lease(c, k.name).await;
}

pub async fn set_conditions(c: &kube::Client, k: &Kubelet<'_>) {
    let nodes: Api<Node> = Api::all(c.clone());
    let now = Time(now_seconds());
    let mut conditions = vec![NodeCondition {
        type_: "Ready".into(),
        status: k.ready.into(),
        reason: Some(if k.ready == "True" { "KubeletReady" } else { "KubeletNotReady" }.into()),
        message: Some("test kubelet".into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
    }];
    if let Some(v) = k.etcd_voter {
        conditions.push(NodeCondition {
            type_: "EtcdIsVoter".into(),
            status: v.into(),
            reason: Some(if v == "True" { "MemberIsVoter" } else { "MemberIsLearner" }.into()),
            message: Some(if v == "True" { "Node is a voting member" } else { "Node is a learner" }.into()),
            last_heartbeat_time: Some(now.clone()),
            last_transition_time: Some(now),
        });
    }
    let status = NodeStatus { conditions: Some(conditions), ..Default::default() };
    nodes.patch_status(k.name, &PatchParams::default(), &Patch::Merge(json!({ "status": status }))).await.unwrap();
}

/// What the kubelet does every 10 s: renew its node Lease (creating it the first time).
pub async fn renew_node_lease(c: &kube::Client, name: &str) {
    set_node_lease(c, name, Timestamp::now()).await
}

pub async fn set_node_lease(c: &kube::Client, name: &str, renew: Timestamp) {
    let leases: Api<Lease> = Api::namespaced(c.clone(), "kube-node-lease");
    let spec = LeaseSpec {
        holder_identity: Some(name.into()),
        lease_duration_seconds: Some(40),
        renew_time: Some(MicroTime(renew)),
        ..Default::default()
    };
    match leases.get_opt(name).await.unwrap() {
        None => {
            let l = Lease {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some("kube-node-lease".into()),
                    ..Default::default()
                },
                spec: Some(spec),
            };
            leases.create(&PostParams::default(), &l).await.unwrap();
        }
        Some(_) => {
            leases.patch(name, &PatchParams::default(), &Patch::Merge(json!({ "spec": spec }))).await.unwrap();
        }
    }
}
