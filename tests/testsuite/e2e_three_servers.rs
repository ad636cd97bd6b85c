//! Three k3s servers end to end on this machine (issue 7): the twin of the NixOS VM
//! test nixos/tests/three-servers.nix. Each server is a Debian booted in systemd-nspawn
//! (real systemd and D-Bus; tests/nspawn/container.sh) in a network namespace of its
//! own (tests/e2e/netns.sh: 10.213.7.11–13, joined by a bridge in a hub namespace this
//! test runs in), running the k3s stand-in as k3s.service (one member of a real
//! three-member etcd with TLS and client-cert auth as k3s runs it, a real
//! kube-apiserver, the agent's Node and node Lease) and the
//! real regrade.service from packaging/systemd/, configured by tests/e2e/regrade.toml.
//! Pressure comes from fixture files this test writes into each container; it observes
//! through the API, the containers' files, `regrade status --json` run inside, and
//! etcd's own member list.
//!
//! Gated by REGRADE_TEST_E2E=1 (root). Run alone: see tests/e2e/README.md.

use crate::common;

use std::fmt::Write as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use common::nspawn::Container;
use common::three_servers::{
    addr, api_servers_toml, api_url, container_env, enter_netns, field, in_netns, make_credentials, mint_credential,
    now, repo, run, seed_k3s, Credentials, Network,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod, Secret};
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Api;
use serde_json::{json, Value};

const GATE: &str = "REGRADE_TEST_E2E";
const LABEL: &str = "regrade.dev/level";
const TAINT: &str = "regrade.dev/stepped-down";
const FIXTURES: &str = "var/lib/regrade-fixture";

fn netns_sh(args: &[&str]) {
    let st = Command::new(repo("tests/e2e/netns.sh")).args(args).status().unwrap();
    assert!(st.success(), "tests/e2e/netns.sh {args:?}");
}

/// A workload on the cluster: the real kube-controller-manager (deployment,
/// replicaset and serviceaccount controllers) and the kubelet stand-in with
/// `--schedule` (tests/rig/go/cmd/kubelet-standin: pods "run" on the Node they are
/// bound to, graceful deletions finish, an unbound pod goes to the first fitting
/// Node by name), both run by this test in the hub namespace with the admin
/// kubeconfig. The k3s stand-in runs no pods; these do what k3s's controllers and
/// kubelets would for a Deployment. Dropping it stops both.
struct Workload(Vec<std::process::Child>);

impl Workload {
    fn start(bin: &Path, admin_kc: &Path, log_dir: &Path) -> Workload {
        let kc = format!("--kubeconfig={}", admin_kc.display());
        let spawn = |name: &str, args: &[&str]| {
            let log = std::fs::File::create(log_dir.join(format!("{name}.log"))).unwrap();
            Command::new(bin.join(name))
                .arg(&kc)
                .args(args)
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {name}: {e}"))
        };
        Workload(vec![
            spawn(
                "kube-controller-manager",
                &[
                    "--leader-elect=false",
                    "--controllers=deployment,replicaset,serviceaccount",
                    "--bind-address=127.0.0.1",
                    "--secure-port=0",
                    "-v=1",
                ],
            ),
            spawn("kubelet-standin", &["--nodes=server1,server2,server3", "--schedule"]),
        ])
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The Nodes the `app=workload` pods are bound to, of those Running and not being
/// deleted.
async fn workload_nodes(c: &kube::Client) -> Vec<String> {
    let pods = Api::<Pod>::namespaced(c.clone(), "default")
        .list(&ListParams::default().labels("app=workload"))
        .await
        .map(|l| l.items)
        .unwrap_or_default();
    let mut nodes: Vec<String> = pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| p.spec.and_then(|s| s.node_name))
        .collect();
    nodes.sort();
    nodes
}

/// Polls `f` until it returns `Some`, or panics naming `what` after `within`.
fn wait_for<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < within, "timed out after {within:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// One server: its container, its number, its fixture files.
struct Server {
    n: usize,
    name: String,
    c: Container,
}

impl Server {
    fn fixture(&self, f: &str) -> PathBuf {
        PathBuf::from(self.c.var("ROOT")).join(FIXTURES).join(f)
    }

    /// Writes both fixture files in place (same inode): regrade keeps them open.
    fn pressure(&self, psi: f64, available_kb: u64) {
        std::fs::write(self.fixture("pressure"), common::psi_text(psi)).unwrap();
        std::fs::write(self.fixture("meminfo"), format!("MemTotal: 1572864 kB\nMemAvailable: {available_kb} kB\n"))
            .unwrap();
    }

    fn over(&self) {
        self.pressure(80.0, 100 * 1024)
    }

    fn calm(&self) {
        self.pressure(0.0, 1024 * 1024)
    }

    /// Neither over nor calm: the watcher takes no step of its own.
    fn neither(&self) {
        self.pressure(20.0, 1024 * 1024)
    }

    fn status(&self) -> Value {
        serde_json::from_str(&self.c.exec(&["regrade", "status", "--json"])).unwrap()
    }

    fn level(&self) -> String {
        self.status()["level"].as_str().unwrap().to_string()
    }

    /// Waits until k3s runs at `level` and the step there has returned: the hook records
    /// the level as k3s starts, before the step's health and readiness waits are over.
    fn wait_level(&self, level: &str, within: Duration) {
        wait_for(&format!("{} at level {level}, its step done (regrade status)", self.name), within, || {
            let st = self.status();
            let last = &st["last_step"];
            (st["level"] == level && (last.is_null() || (last["to"] == level && last["result"] == "done")))
                .then_some(())
        })
    }

    /// Runs `args` inside; (success, stdout + stderr), without asserting.
    fn try_exec(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("nsenter").args(["-t", self.c.var("PID"), "-a"]).args(args).output().unwrap();
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    }

    fn systemctl(&self, args: &[&str]) -> String {
        let mut a = vec!["systemctl"];
        a.extend_from_slice(args);
        self.c.exec(&a)
    }

    /// A unit's main process, as a PID in the container.
    fn main_pid(&self, unit: &str) -> String {
        let pid = self.systemctl(&["show", "-P", "MainPID", unit]).trim().to_string();
        assert!(pid != "0" && !pid.is_empty(), "{unit} in {} has no main process", self.name);
        pid
    }

    /// Host PIDs of this container's processes (in its PID namespace) named `comm`, or
    /// whose PID inside the container is `inner`. Minimal Debian has no kill or pgrep,
    /// so signals are sent from the host.
    fn host_pids(&self, comm: Option<&str>, inner: Option<&str>) -> Vec<i32> {
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
        let ours = ns(self.c.var("PID"));
        assert!(ours.is_some(), "{}'s PID 1 is gone", self.name);
        let mut pids = Vec::new();
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            if ns(&pid.to_string()) != ours {
                continue;
            }
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            let ns_pid =
                status.lines().find_map(|l| l.strip_prefix("NSpid:")).and_then(|l| l.split_whitespace().last());
            let name = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if comm.is_some_and(|c| name.trim() == c) || (inner.is_some() && ns_pid == inner) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Sends `sig` to the process that is `inner` inside the container.
    fn signal(&self, sig: i32, inner: &str) {
        let pids = self.host_pids(None, Some(inner));
        assert_eq!(pids.len(), 1, "process {inner} in {}: host PIDs {pids:?}", self.name);
        // SAFETY: signals one process of the container this test booted.
        assert_eq!(unsafe { libc::kill(pids[0], sig) }, 0, "kill {sig} {}", pids[0]);
    }

    /// The value of one sample of regrade's metrics (`[metrics] listen` in
    /// tests/e2e/regrade.toml), e.g. `regrade_level{level="full"}`.
    fn metric(&self, series: &str) -> f64 {
        let text = in_netns(self.n, || common::nspawn::http_get("http://127.0.0.1:9559/metrics"))
            .unwrap_or_else(|| panic!("{}: no metrics at 127.0.0.1:9559", self.name));
        let line = text.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '));
        let line = line.unwrap_or_else(|| panic!("{}: no {series} in\n{text}", self.name));
        line[series.len()..].trim().parse().unwrap()
    }

    /// etcd's /health, where k3s serves it: 127.0.0.1:2381 in the server's namespace.
    fn healthy(&self) -> bool {
        in_netns(self.n, || common::nspawn::health_ok("http://127.0.0.1:2381/health"))
    }

    fn standin_pid(&self) -> i64 {
        self.c.standin_flags()["pid"].as_i64().unwrap()
    }

    /// etcd's member list, through this server's etcd client URL (the JSON gateway over
    /// TLS with k3s's client certificate, as regrade reads it).
    fn etcd_members(&self) -> Vec<regrade::etcd::client::Member> {
        let tls = PathBuf::from(self.c.var("ROOT")).join("var/lib/rancher/k3s/server/tls/etcd");
        let cfg = regrade::etcd::EtcdConfig {
            ca_file: tls.join("server-ca.crt"),
            cert_file: tls.join("client.crt"),
            key_file: tls.join("client.key"),
            ..Default::default()
        };
        let url = format!("https://{}:2379", addr(self.n));
        // Its own thread and runtime: called from inside the scenario's runtime.
        std::thread::spawn(move || {
            let client = regrade::etcd::client::EtcdClient::new(&cfg).unwrap();
            let ep = regrade::etcd::client::Endpoint::parse(&url).unwrap();
            common::block_on(client.member_list(&ep)).unwrap_or_else(|e| panic!("etcd at {url}: {e:#}")).members
        })
        .join()
        .unwrap()
    }

    fn member_id(&self, of: &str) -> u64 {
        let members = self.etcd_members();
        let ids: Vec<_> =
            members.iter().filter(|m| regrade::etcd::judge::node_of(&m.name) == of).map(|m| m.id).collect();
        assert_eq!(ids.len(), 1, "etcd members of {of} seen through {}: {members:?}", self.name);
        ids[0]
    }

    /// regrade's journal as (unix seconds, message, fields).
    fn regrade_journal(&self) -> Vec<(f64, String, Value)> {
        self.c
            .exec(&["journalctl", "-u", "regrade.service", "-o", "json", "--no-pager"])
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| {
                let t = v["__REALTIME_TIMESTAMP"].as_str()?.parse::<f64>().ok()? / 1e6;
                Some((t, v["MESSAGE"].as_str()?.to_string(), v))
            })
            .collect()
    }
}

/// A journal entry's field, as tracing-journald names it (upper case, prefixed).
/// The milestones of every step that ran on `s` (from regrade's journal), with the
/// time each phase took. Refused steps (retried every sample) are left out.
fn timeline(s: &Server, origin: f64) -> String {
    const MILESTONES: [(&str, &str); 9] = [
        ("step failed; restoring", "k3s failed; restoring"),
        ("drop-in written", "drop-in written"),
        ("restart requested", "restart requested"),
        ("etcd is healthy after the restart", "etcd healthy"),
        ("the Node is Ready on a heartbeat newer", "Node Ready"),
        ("this etcd member is back and caught up", "etcd member caught up"),
        ("released the Lease", "Lease released"),
        ("step done", "step done"),
        ("step failed", "STEP FAILED"),
    ];
    let mut out = String::new();
    // The step under way: its start and the lines so far.
    let mut step: Option<(f64, f64, &str, String)> = None;
    for (t, msg, v) in s.regrade_journal() {
        if msg == "stepping" {
            let head =
                format!("  {:>8.2}s {}  step {} -> {}\n", t - origin, s.name, field(&v, "LEVEL"), field(&v, "TO"));
            step = Some((t, t, "step started", head));
        } else if msg == "step refused" {
            step = None;
        } else if msg == "regrade watch starting" || msg.starts_with("converged on the level k3s runs at") {
            if let Some((.., lines)) = step.take() {
                out += &lines;
                out += "             (regrade died during this step)\n";
            }
            let what = if msg == "regrade watch starting" { "regrade watch (re)started" } else { "converged on k3s" };
            let _ = writeln!(out, "  {:>8.2}s {}  {what} at level {}", t - origin, s.name, field(&v, "LEVEL"));
        } else if let Some((_, what)) = MILESTONES.iter().find(|(m, _)| msg.starts_with(m)) {
            match step.as_mut() {
                Some((t0, prev, prev_what, lines)) => {
                    let _ = writeln!(
                        lines,
                        "  {:>8.2}s {}    {what:<24} +{:>6.2}s after {prev_what}",
                        t - origin,
                        s.name,
                        t - *prev
                    );
                    (*prev, *prev_what) = (t, what);
                    if msg.starts_with("step done") || msg.starts_with("step failed") {
                        let _ = writeln!(lines, "  {:>9} {}    total {:.2}s", "", s.name, t - *t0);
                        out += lines;
                        step = None;
                    }
                }
                None => {
                    let _ = writeln!(out, "  {:>8.2}s {}  {what}", t - origin, s.name);
                }
            }
        }
    }
    out
}

/// Kubernetes clients on the host, as admin, one per server's API.
struct Api3 {
    kubeconfig: PathBuf,
}

impl Api3 {
    async fn client(&self, n: usize) -> kube::Client {
        let kc = Kubeconfig::read_from(&self.kubeconfig).unwrap();
        let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
        cfg.cluster_url = api_url(n).parse().unwrap();
        cfg.connect_timeout = Some(Duration::from_secs(5));
        cfg.read_timeout = Some(Duration::from_secs(15));
        kube::Client::try_from(cfg).unwrap()
    }
}

async fn node(c: &kube::Client, name: &str) -> Node {
    Api::<Node>::all(c.clone()).get(name).await.unwrap()
}

fn label(n: &Node) -> Option<String> {
    n.metadata.labels.as_ref().and_then(|l| l.get(LABEL).cloned())
}

fn cordoned(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

fn tainted(n: &Node) -> bool {
    n.spec.as_ref().and_then(|s| s.taints.as_ref()).is_some_and(|t| t.iter().any(|t| t.key == TAINT))
}

/// The Nodes carrying the level label (i.e. below `full`).
async fn below_full(c: &kube::Client) -> Vec<String> {
    let nodes = Api::<Node>::all(c.clone()).list(&ListParams::default()).await.unwrap();
    nodes.items.iter().filter(|n| label(n).is_some()).map(|n| n.metadata.name.clone().unwrap()).collect()
}

/// Ready on a node Lease renewed within 40 s (the peer gate's rule).
async fn node_ready(c: &kube::Client, name: &str) -> bool {
    let Ok(n) = Api::<Node>::all(c.clone()).get(name).await else { return false };
    let ready = n
        .status
        .and_then(|s| s.conditions)
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    let Ok(l) = Api::<Lease>::namespaced(c.clone(), "kube-node-lease").get(name).await else { return false };
    let renewed = l.spec.and_then(|s| s.renew_time).map(|t| t.0.as_second() as f64).unwrap_or(0.0);
    ready && now() - renewed < 40.0
}

/// Who holds regrade's Lease now: `None` when absent, released or expired.
async fn lease_holder(c: &kube::Client) -> Option<String> {
    let l = Api::<Lease>::namespaced(c.clone(), "kube-system").get_opt("regrade").await.unwrap()?;
    let spec = l.spec?;
    let holder = spec.holder_identity.filter(|h| !h.is_empty())?;
    let renewed = spec.renew_time.map(|t| t.0.as_millisecond() as f64 / 1e3).unwrap_or(0.0);
    let duration = spec.lease_duration_seconds.unwrap_or(0) as f64;
    (renewed + duration > now()).then_some(holder)
}

async fn events(c: &kube::Client, node: &str, reason: &str) -> Vec<String> {
    let evs = Api::<Event>::namespaced(c.clone(), "default").list(&ListParams::default()).await.unwrap();
    evs.items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(node) && e.reason.as_deref() == Some(reason))
        .map(|e| e.message.unwrap_or_default())
        .collect()
}

/// Watches, from another thread and through `via`'s API, that no Node but `stepping`
/// is below full; counts its looks so the test knows it looked.
struct Poller {
    stop: Arc<AtomicBool>,
    looks: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Poller {
    fn start(api: &Api3, via: usize, stepping: &'static str) -> Poller {
        let (stop, looks, seen) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)), Arc::default());
        let kubeconfig = api.kubeconfig.clone();
        let (s, l, v): (Arc<AtomicBool>, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) =
            (stop.clone(), looks.clone(), Arc::clone(&seen));
        let thread = std::thread::spawn(move || {
            common::block_on(async move {
                let c = Api3 { kubeconfig }.client(via).await;
                while !s.load(Ordering::SeqCst) {
                    if let Ok(nodes) = Api::<Node>::all(c.clone()).list(&ListParams::default()).await {
                        for n in nodes.items.iter().filter(|n| label(n).is_some()) {
                            let name = n.metadata.name.clone().unwrap();
                            if name != stepping {
                                v.lock().unwrap().push(format!("{name} at {:?}", label(n)));
                            }
                        }
                        l.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        });
        Poller { stop, looks, seen, thread: Some(thread) }
    }

    /// Stops; panics if another server was seen below full or too few looks were had.
    fn finish(mut self, min_looks: usize) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        let seen = self.seen.lock().unwrap();
        assert!(seen.is_empty(), "another server was below full meanwhile: {seen:?}");
        let looks = self.looks.load(Ordering::SeqCst);
        assert!(looks >= min_looks, "the poller looked only {looks} times");
    }
}

/// The seeds of server `n`: its k3s config and certificates (ETC), its regrade.toml,
/// calm fixture files and regrade.service enabled (root).
fn seed(tmp: &Path, certs: &Path, names: &[String], n: usize) -> (PathBuf, PathBuf) {
    let (etc, root) = seed_k3s(tmp, certs, names, n);
    let toml = std::fs::read_to_string(repo("tests/e2e/regrade.toml")).unwrap();
    std::fs::create_dir_all(root.join("etc/regrade")).unwrap();
    std::fs::write(
        root.join("etc/regrade/regrade.toml"),
        toml.replace("@N@", &n.to_string()).replace("@API_SERVERS@", &api_servers_toml(n)),
    )
    .unwrap();
    let fixtures = root.join(FIXTURES);
    std::fs::create_dir_all(&fixtures).unwrap();
    std::fs::write(
        fixtures.join("pressure"),
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    )
    .unwrap();
    std::fs::write(fixtures.join("meminfo"), "MemTotal: 1572864 kB\nMemAvailable: 1048576 kB\n").unwrap();
    let wants = root.join("etc/systemd/system/multi-user.target.wants");
    std::fs::create_dir_all(&wants).unwrap();
    std::os::unix::fs::symlink("../regrade.service", wants.join("regrade.service")).unwrap();
    (etc, root)
}

/// Waits until every server is at `full` (status and Node label) and regrade's Lease is
/// free: what every fault must end in.
async fn settled(api: &kube::Client, servers: &[Server], within: Duration, after: &str) {
    let t0 = Instant::now();
    loop {
        let levels: Vec<String> = servers.iter().map(Server::level).collect();
        let below = below_full(api).await;
        let holder = lease_holder(api).await;
        if levels.iter().all(|l| l == "full") && below.is_empty() && holder.is_none() {
            println!("[{after}] settled after {:.1}s: every server at full, no Lease held", t0.elapsed().as_secs_f64());
            return;
        }
        assert!(
            t0.elapsed() < within,
            "{after}: not settled within {within:?}: levels {levels:?}, labelled {below:?}, Lease held by {holder:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[test]
fn three_servers_end_to_end() {
    if !common::gate_open(GATE, "three_servers_end_to_end", "root; boots three systemd-nspawn containers") {
        return;
    }
    let t_start = Instant::now();
    let bin = common::built("tests/rig/build.sh");

    // The rootfs too is made (or found) before the test leaves the host's network.
    let rootfs = Command::new(repo("tests/nspawn/rootfs.sh")).stderr(std::process::Stdio::inherit()).output().unwrap();
    assert!(rootfs.status.success(), "tests/nspawn/rootfs.sh failed");
    netns_sh(&["up"]);
    let network = Network;
    enter_netns("regrade-e2e-hub");

    let tmp = tempfile::tempdir().unwrap();
    let Credentials { etcd_ca, certs, names } = make_credentials(tmp.path(), &bin.join("harness"));
    let specs: Vec<(String, Vec<(&str, String)>)> = (1..=3)
        .map(|n| {
            let (etc, root) = seed(tmp.path(), &certs, &names, n);
            (format!("e2e-server{n}"), container_env(n, &etc, &root, &bin))
        })
        .collect();
    let specs: Vec<(&str, Vec<(&str, String)>)> = specs.iter().map(|(n, e)| (n.as_str(), e.clone())).collect();
    let servers: Vec<Server> = Container::up_many(&specs)
        .into_iter()
        .enumerate()
        .map(|(i, c)| Server { n: i + 1, name: format!("server{}", i + 1), c })
        .collect();
    let origin = now();
    println!("[boot] three containers up after {:.1}s", t_start.elapsed().as_secs_f64());

    let api3 = Api3 { kubeconfig: certs.join("admin.kubeconfig") };
    common::block_on(scenario(&api3, &servers, &bin, &certs));
    // server2's steps were by hand (`regrade step`), outside the daemon's journal.
    println!("\n== server1's steps (seconds since the containers were up; from regrade.service's journal) ==");
    println!("{}", timeline(&servers[0], origin));

    common::block_on(etcd_gate(&api3, &servers, &bin, &etcd_ca, &names));
    println!("[done] whole scenario in {:.1}s", t_start.elapsed().as_secs_f64());
    drop(servers);
    drop(network);
}

async fn scenario(api3: &Api3, servers: &[Server], bin: &Path, certs: &Path) {
    let [s1, s2, s3] = [&servers[0], &servers[1], &servers[2]];
    let t0 = Instant::now();
    let phase = |name: &str| println!("[{:>6.1}s] {name}", t0.elapsed().as_secs_f64());
    let (a1, a2, a3) = (api3.client(1).await, api3.client(2).await, api3.client(3).await);

    // The cluster: three Nodes Ready, three etcd members, regrade at full everywhere.
    for s in servers {
        let name = s.name.clone();
        let t = Instant::now();
        while !node_ready(&a2, &name).await {
            assert!(t.elapsed() < Duration::from_secs(180), "Node {name} not Ready within 180s");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let members = s1.etcd_members();
    assert_eq!(members.len(), 3, "etcd members: {members:?}");
    for s in servers {
        assert_eq!(s.systemctl(&["is-active", "regrade.service"]).trim(), "active");
        assert_eq!(s.level(), "full");
    }
    // Each regrade runs with its server's own credential (a token of regrade/server<n>
    // bound to its Node, as the NixOS module mints it), not as admin, and the admission
    // policy bounds it: check-access exits 0 only for least privilege (waited for: the
    // policy is in force once the API servers have read it).
    let admin_kc = certs.join("admin.kubeconfig");
    for s in servers {
        let minted = mint_credential(bin, certs, &s.c);
        println!("[{}] {}", s.name, minted.trim());
        let kubeconfig = std::fs::read_to_string(s.c.etc().join("regrade.kubeconfig")).unwrap();
        assert!(kubeconfig.contains("tokenFile") && !kubeconfig.contains("client-key"), "{kubeconfig}");
        assert!(minted.contains(&format!("bound to Node {}", s.name)), "{minted}");
    }
    let check =
        wait_for("server1's credential least privilege (regrade check-access)", Duration::from_secs(60), || {
            let out = Command::new("nsenter")
                .args(["-t", s1.c.var("PID"), "-a", "regrade", "check-access"])
                .output()
                .unwrap();
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        });
    println!("{}", check.trim_end());
    phase("cluster up: 3 Nodes Ready, 3 etcd members, regrade.service active and at full on each, each with its own credential");

    // A workload Deployment, its two pods on server1 (the first Node by name).
    let workload = Workload::start(bin, &admin_kc, certs);
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "workload", "namespace": "default"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "workload"}},
                 "template": {"metadata": {"labels": {"app": "workload"}},
                              "spec": {"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "w", "image": "registry.invalid/workload:1"}]}}}
    });
    let manifest = certs.join("workload.json");
    std::fs::write(&manifest, deployment.to_string()).unwrap();
    run(&bin.join("kubectl"), &["--kubeconfig", admin_kc.to_str().unwrap(), "apply", "-f", manifest.to_str().unwrap()]);
    let t = Instant::now();
    while workload_nodes(&a2).await != ["server1", "server1"] {
        assert!(t.elapsed() < Duration::from_secs(120), "the workload is not running on server1");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    phase("0. a workload Deployment runs its two pods on server1");

    // 1. A Lease held by a made-up holder refuses a step; released, the step proceeds.
    let leases: Api<Lease> = Api::namespaced(a2.clone(), "kube-system");
    let stamp = k8s_openapi::jiff::Timestamp::now();
    let lease: Lease = serde_json::from_value(json!({
        "metadata": {"name": "regrade", "namespace": "kube-system"},
        "spec": {"holderIdentity": "made-up-holder", "leaseDurationSeconds": 3600,
                 "acquireTime": stamp.to_string(), "renewTime": stamp.to_string()}
    }))
    .unwrap();
    leases.create(&PostParams::default(), &lease).await.unwrap();
    s1.over();
    wait_for("server1's step refused for the held Lease", Duration::from_secs(60), || {
        (s1.status()["refusal"]["kind"] == "lease-held").then_some(())
    });
    assert_eq!(s1.level(), "full");
    assert_eq!(label(&node(&a2, "server1").await), None);
    let id_before = s2.member_id("server1");
    let secret_before =
        Api::<Secret>::namespaced(a2.clone(), "kube-system").get("server1.node-password.k3s").await.unwrap();
    // From here on, no server but server1 may be below full (step 2).
    let poller = Poller::start(api3, 3, "server1");
    leases.delete("regrade", &Default::default()).await.unwrap();
    phase("1. a made-up holder's Lease refused the step (status: lease-held); Lease deleted");

    // 2. Pressure steps server1 to control-plane, then etcd-only.
    s1.wait_level("control-plane", Duration::from_secs(60));
    let n1 = node(&a2, "server1").await;
    assert!(matches!(label(&n1).as_deref(), Some("control-plane" | "etcd-only")), "{:?}", label(&n1));
    assert!(cordoned(&n1) && tainted(&n1), "server1 at control-plane is cordoned and tainted");
    phase("2a. server1 at control-plane: labelled, cordoned, tainted");
    // The drain evicted the workload; its ReplicaSet made new pods, bound elsewhere.
    let t = Instant::now();
    loop {
        let nodes = workload_nodes(&a2).await;
        if nodes.len() == 2 && !nodes.iter().any(|n| n == "server1") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "the workload did not move off server1: {nodes:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained = events(&a2, "server1", "RegradeDrained").await;
    assert!(drained.iter().any(|m| m.contains("2 evicted")), "{drained:?}");
    drop(workload);
    phase(&format!("2b'. the drain moved the workload off server1: {:?}; {drained:?}", workload_nodes(&a2).await));
    s1.wait_level("etcd-only", Duration::from_secs(120));
    assert!(s1.c.dropin().exists(), "the drop-in {} is there at etcd-only", s1.c.dropin().display());
    assert_eq!(s1.c.standin_flags()["flags"]["disable-apiserver"], json!(true));
    assert!(s1.healthy(), "server1's etcd serves at etcd-only");
    let t = Instant::now();
    while label(&node(&a2, "server1").await).as_deref() != Some("etcd-only") {
        assert!(t.elapsed() < Duration::from_secs(30), "server1's label is not etcd-only");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(below_full(&a2).await, ["server1"]);
    for s in [s2, s3] {
        assert_eq!(s.level(), "full", "{}", s.name);
    }
    poller.finish(20);
    assert_eq!(s1.metric(r#"regrade_level{level="etcd-only"}"#), 1.0);
    assert_eq!(s1.metric(r#"regrade_level{level="full"}"#), 0.0);
    let downs = s1.metric(r#"regrade_steps_total{direction="down",result="done"}"#);
    assert!(downs >= 2.0, "two steps down done, the metrics say {downs}");
    assert!(s1.metric(r#"regrade_refusals_total{reason="lease-held"}"#) >= 1.0, "step 1's refusal is counted");
    assert_eq!(s2.metric(r#"regrade_steps_total{direction="down",result="done"}"#), 0.0);
    phase(&format!(
        "2b. server1 at etcd-only; no other server below full meanwhile (polled every 300ms); its metrics: \
         regrade_level etcd-only, {downs} steps down done, the lease-held refusal counted"
    ));

    // 3. server1 keeps its etcd member ID, its Node with the label, its node-password Secret.
    assert_eq!(s2.member_id("server1"), id_before);
    assert_eq!(s1.member_id("server1"), id_before);
    assert_eq!(label(&node(&a3, "server1").await).as_deref(), Some("etcd-only"));
    let secret_after =
        Api::<Secret>::namespaced(a2.clone(), "kube-system").get("server1.node-password.k3s").await.unwrap();
    assert_eq!(secret_after.metadata.uid, secret_before.metadata.uid);
    assert_eq!(secret_after.data, secret_before.data);
    phase("3. server1 kept its etcd member ID, its Node (labelled etcd-only), its node-password Secret");

    // 4. With server1 at etcd-only and server3's k3s stopped, writes through server2's API
    //    still succeed (server1's vote counts).
    s3.systemctl(&["stop", "k3s.service"]);
    let cms: Api<ConfigMap> = Api::namespaced(a2.clone(), "default");
    let cm = |name: &str| -> ConfigMap {
        serde_json::from_value(json!({"metadata": {"name": name}, "data": {"at": "etcd-only"}})).unwrap()
    };
    let t = Instant::now();
    loop {
        match cms.create(&PostParams::default(), &cm("quorum-check")).await {
            Ok(_) => break,
            Err(e) => assert!(t.elapsed() < Duration::from_secs(60), "write through server2 with server3 down: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    cms.get("quorum-check").await.unwrap();
    phase("4a. server3's k3s stopped: a write through server2's API succeeded (server1's etcd vote counts)");

    // 5. Pressure on server2 meanwhile is refused (server1 is below full, server3 down):
    //    visible in `regrade status` and as an Event on server2's Node.
    s2.over();
    let refusal = wait_for("server2's step refused", Duration::from_secs(60), || {
        let st = s2.status();
        (!st["refusal"].is_null()).then(|| st["refusal"].clone())
    });
    assert_eq!(s2.level(), "full");
    assert_eq!(label(&node(&a2, "server2").await), None);
    let t = Instant::now();
    while events(&a2, "server2", "RegradeRefused").await.is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30), "no RegradeRefused Event on server2");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    s2.calm();
    phase(&format!(
        "5. pressure on server2 refused ({}: {}), with an Event RegradeRefused on its Node",
        refusal["kind"], refusal["message"]
    ));

    //    ... and with server1's etcd stopped as well, writes fail: the check can fail.
    s1.systemctl(&["stop", "k3s.service"]);
    let failed =
        tokio::time::timeout(Duration::from_secs(20), cms.create(&PostParams::default(), &cm("no-quorum"))).await;
    assert!(!matches!(failed, Ok(Ok(_))), "a write with one etcd member of three succeeded");
    for s in [s1, s3] {
        s.systemctl(&["start", "--no-block", "k3s.service"]);
    }
    for s in servers {
        let name = s.name.clone();
        let t = Instant::now();
        while !(s.healthy() && node_ready(&a2, &name).await) {
            assert!(t.elapsed() < Duration::from_secs(120), "{name} not back (etcd healthy, Node Ready) within 120s");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert_eq!(s1.level(), "etcd-only", "server1 restarted at etcd-only (its record)");
    phase("4b. server1's etcd also stopped: the write failed; server1 and server3 started again");

    // 6. Calm values step server1 back to full by itself.
    s1.calm();
    s1.wait_level("full", Duration::from_secs(180));
    assert_eq!(s1.status()["last_step"]["from"], "control-plane");
    assert!(!s1.c.dropin().exists(), "the drop-in is gone at full");
    let t = Instant::now();
    while label(&node(&a2, "server1").await).is_some() {
        assert!(t.elapsed() < Duration::from_secs(30), "server1 still labelled at full");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let n1 = node(&a2, "server1").await;
    assert!(!cordoned(&n1) && !tainted(&n1), "cordon and taint gone: {:?}", n1.spec);
    assert_eq!(s1.c.standin_flags()["flags"]["disable-apiserver"], json!(false));
    assert_eq!(s2.member_id("server1"), id_before);
    assert!(events(&a2, "server1", "RegradeStepUp").await.len() >= 2);
    assert_eq!(s1.metric(r#"regrade_level{level="full"}"#), 1.0);
    assert!(s1.metric(r#"regrade_steps_total{direction="up",result="done"}"#) >= 1.0);
    phase("6. calm values stepped server1 back to full: label, cordon, taint and drop-in gone, same member ID");

    // 7. regrade step down / step up by hand on server2.
    let t = Instant::now();
    while !node_ready(&a2, "server1").await {
        assert!(t.elapsed() < Duration::from_secs(60), "server1 not Ready");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    s2.neither();
    s2.c.exec(&["regrade", "step", "down"]);
    assert_eq!(s2.level(), "control-plane");
    assert_eq!(label(&node(&a1, "server2").await).as_deref(), Some("control-plane"));
    s2.c.exec(&["regrade", "step", "up"]);
    assert_eq!(s2.level(), "full");
    assert_eq!(label(&node(&a1, "server2").await), None);
    s2.calm();
    settled(&a2, servers, Duration::from_secs(60), "7").await;
    phase("7. regrade step down / step up by hand on server2");

    // 8a. The system bus frozen as the step to etcd-only starts (the broker stalled, as
    //     under memory pressure), then regrade SIGKILLed: the step reaches systemd
    //     before it writes the drop-in, so nothing was written while systemd could not
    //     be reached; systemd restarts regrade, which converges on full.
    s1.over();
    s1.wait_level("control-plane", Duration::from_secs(60));
    let dbus = s1.main_pid("dbus.service");
    let regrade = s1.main_pid("regrade.service");
    let frozen_at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64();
    s1.signal(libc::SIGSTOP, &dbus);
    // The event: the step to etcd-only reached systemd and gave up there (its D-Bus
    // calls are bounded by systemd.call_timeout) with nothing changed.
    let failed = wait_for("server1's step to etcd-only to fail at the frozen bus", Duration::from_secs(120), || {
        s1.regrade_journal().into_iter().find_map(|(t, msg, v)| {
            let error = field(&v, "ERROR");
            (t >= frozen_at && msg == "step failed" && error.contains("nothing was changed")).then(|| error.to_string())
        })
    });
    println!("8a. the step met the frozen bus: {failed}");
    let wrote = s1.c.dropin().exists();
    s1.signal(libc::SIGKILL, &regrade);
    s1.signal(libc::SIGCONT, &dbus);
    assert!(!wrote, "the etcd-only drop-in was written while systemd could not be reached");
    s1.calm();
    assert_eq!(s1.c.record_text(), "control-plane", "k3s was not restarted");
    settled(&a2, servers, Duration::from_secs(180), "8a").await;
    assert!(!s1.c.dropin().exists());
    let restarted = s1.main_pid("regrade.service");
    assert_ne!(restarted, regrade, "systemd restarted regrade.service");
    phase("8a. system bus frozen at the step to etcd-only, then SIGKILL: no drop-in written; regrade restarted, back at full; Lease free");

    // 8b. regrade SIGKILLed during the readiness wait after the restart.
    s1.over();
    s1.wait_level("control-plane", Duration::from_secs(60));
    let before = s1.standin_pid();
    let regrade = s1.main_pid("regrade.service");
    wait_for("server1's k3s restarted into etcd-only", Duration::from_secs(60), || {
        (s1.standin_pid() != before).then_some(())
    });
    // etcd answers 503 for the stand-in's health-delay after a start: regrade is waiting.
    assert!(!s1.healthy(), "killed too late: etcd already healthy");
    s1.signal(libc::SIGKILL, &regrade);
    s1.calm();
    settled(&a2, servers, Duration::from_secs(240), "8b").await;
    phase("8b. SIGKILL during the readiness wait: regrade restarted at etcd-only and stepped back to full; Lease free");

    // 8c. server2's API server unreachable (stopped, so connections hang) during
    //     server1's steps down and back up: server1's calls fail over to server3.
    let apiserver = s2.host_pids(Some("kube-apiserver"), None);
    assert_eq!(apiserver.len(), 1, "server2's kube-apiserver: {apiserver:?}");
    // SAFETY: signals the kube-apiserver of a container this test booted.
    let stop = |sig| assert_eq!(unsafe { libc::kill(apiserver[0], sig) }, 0);
    stop(libc::SIGSTOP);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s1.over();
        s1.wait_level("etcd-only", Duration::from_secs(180));
        s1.calm();
        s1.wait_level("full", Duration::from_secs(240));
    }));
    stop(libc::SIGCONT);
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    settled(&a3, servers, Duration::from_secs(120), "8c").await;
    phase(
        "8c. server2's API server stopped during server1's steps down to etcd-only and up: both went through server3",
    );

    // 8d. server1's stand-in told to fail its next start: the step to etcd-only fails,
    //     regrade puts the drop-in back and restarts k3s at control-plane.
    let knob = s1.c.etc().join("standin-fail-next-start");
    std::fs::write(&knob, "").unwrap();
    s1.over();
    let last = wait_for("server1's failed step to etcd-only", Duration::from_secs(120), || {
        let st = s1.status();
        st["last_step"]["result"].as_str().is_some_and(|r| r.starts_with("failed")).then(|| st["last_step"].clone())
    });
    s1.calm();
    assert!(!knob.exists(), "the stand-in consumed its knob");
    assert_eq!(last["to"], "etcd-only");
    assert!(!events(&a2, "server1", "RegradeStepFailed").await.is_empty());
    settled(&a2, servers, Duration::from_secs(180), "8d").await;
    assert!(!s1.c.dropin().exists());
    phase(&format!("8d. failed start of k3s: step failed ({}), restored, back to full", last["result"]));
}

/// A hand step on `s` that the etcd gate must refuse, naming `member` (its etcd name
/// prefix, e.g. `server3-`) and `reason`: nothing may change (level, drop-in, record),
/// and the refusal is an Event on the Node naming the member.
async fn refused_by_etcd(api: &kube::Client, s: &Server, dir: &str, member: &str, reason: &str) -> String {
    let (level, dropin, record) = (s.level(), s.c.dropin().exists(), s.c.record_text());
    let (ok, out) = s.try_exec(&["regrade", "step", dir]);
    assert!(!ok, "regrade step {dir} on {} was not refused: {out}", s.name);
    assert!(out.contains(member) && out.contains(reason), "refusal names {member} and {reason:?}: {out}");
    assert_eq!((s.level(), s.c.dropin().exists(), s.c.record_text()), (level, dropin, record), "nothing changed");
    let t = Instant::now();
    while !events(api, &s.name, "RegradeRefused").await.iter().any(|m| m.contains(member)) {
        assert!(t.elapsed() < Duration::from_secs(30), "no RegradeRefused Event on {} naming {member}", s.name);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    out.lines().find(|l| l.contains(member)).unwrap_or(&out).trim().to_string()
}

/// What today's (node Lease) peer gate sees of `peer`: Ready on a fresh node Lease,
/// `EtcdIsVoter` not False, no level label. True means that gate lets the step through.
async fn old_gate_passes(api: &kube::Client, peer: &str) -> bool {
    let n = node(api, peer).await;
    let voter_false = n
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "EtcdIsVoter" && c.status == "False"));
    node_ready(api, peer).await && !voter_false && label(&n).is_none()
}

/// Waits until `name`'s Node is Ready on a fresh node Lease (a restarted stand-in
/// reports Ready=False first, as a restarted kubelet does).
async fn wait_node_ready(api: &kube::Client, name: &str, within: Duration) {
    let t = Instant::now();
    while !node_ready(api, name).await {
        assert!(t.elapsed() < within, "Node {name} not Ready within {within:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the etcd gate on `s` would let a restart through again: every member
/// healthy (after a fault is healed), seen through `regrade status`.
fn wait_gate_clear(s: &Server, within: Duration) {
    wait_for(&format!("{}'s etcd gate clear (regrade status)", s.name), within, || {
        let st = s.status();
        st["etcd"]["members"]
            .as_array()
            .is_some_and(|ms| !ms.is_empty() && ms.iter().all(|m| m["health"] == "ok"))
            .then_some(())
    });
}

/// 9. The etcd gate (issue 11): faults the node-Lease peer gate cannot see. Each is
///    shown to pass that gate (the peer's Node Ready on a fresh Lease) and to be refused
///    by the etcd gate, naming the member, with nothing changed.
async fn etcd_gate(api3: &Api3, servers: &[Server], bin: &Path, etcd_ca: &Path, names: &[String]) {
    let [s1, s3] = [&servers[0], &servers[2]];
    let t0 = Instant::now();
    let phase = |name: &str| println!("[{:>6.1}s] {name}", t0.elapsed().as_secs_f64());
    let (a1, a2) = (api3.client(1).await, api3.client(2).await);
    // Hand steps only: no pressure either way, so the watchers stay put.
    for s in servers {
        s.neither();
    }
    s1.c.exec(&["regrade", "step", "down"]);
    assert_eq!(s1.level(), "control-plane");
    wait_gate_clear(s1, Duration::from_secs(60));
    phase("9. server1 at control-plane by hand (no restart: the etcd gate is not asked)");

    // 9a. server3's etcd member dies; its agent keeps the Node Ready, the Lease fresh.
    let knob = s3.c.etc().join("standin-kill-etcd");
    std::fs::write(&knob, "").unwrap();
    wait_for("server3's etcd member down", Duration::from_secs(30), || {
        TcpStream::connect_timeout(&format!("{}:2379", addr(3)).parse().unwrap(), Duration::from_secs(1))
            .is_err()
            .then_some(())
    });
    // A node Lease renewal since the member died: the gate sees a fresh heartbeat.
    let died = now();
    let leases = Api::<Lease>::namespaced(a2.clone(), "kube-node-lease");
    let t0 = Instant::now();
    loop {
        let l = leases.get("server3").await.unwrap();
        let renewed = l.spec.and_then(|s| s.renew_time).map_or(0.0, |t| t.0.as_millisecond() as f64 / 1e3);
        if renewed > died {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "server3's node Lease not renewed since its etcd died");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(old_gate_passes(&a2, "server3").await, "server3 passes the node-Lease gate with its etcd dead");
    let why = refused_by_etcd(&a2, s1, "down", &names[2], "unreachable").await;
    phase(&format!("9a. server3's etcd killed, its Node Ready on a fresh Lease: step into etcd-only refused: {why}"));

    // ... and out of etcd-only: heal, step down, kill again, step up refused.
    std::fs::remove_file(&knob).unwrap();
    s3.systemctl(&["restart", "k3s.service"]);
    wait_gate_clear(s1, Duration::from_secs(120));
    wait_node_ready(&a2, "server3", Duration::from_secs(60)).await;
    s1.c.exec(&["regrade", "step", "down"]);
    assert_eq!(s1.level(), "etcd-only");
    std::fs::write(&knob, "").unwrap();
    wait_for("server3's etcd member down", Duration::from_secs(30), || {
        TcpStream::connect_timeout(&format!("{}:2379", addr(3)).parse().unwrap(), Duration::from_secs(1))
            .is_err()
            .then_some(())
    });
    assert!(old_gate_passes(&a2, "server3").await);
    let why = refused_by_etcd(&a2, s1, "up", &names[2], "unreachable").await;
    std::fs::remove_file(&knob).unwrap();
    s3.systemctl(&["restart", "k3s.service"]);
    wait_gate_clear(s1, Duration::from_secs(120));
    wait_node_ready(&a2, "server3", Duration::from_secs(60)).await;
    s1.c.exec(&["regrade", "step", "up"]);
    assert_eq!(s1.level(), "control-plane");
    phase(&format!("9a. ... and out of etcd-only: refused ({why}); healed, stepped up to control-plane"));

    // 9b. server3 partitioned on its peer port (TCP 2380 dropped in its namespace): its
    //     client port and its agent still work.
    netns_sh(&["partition", "3"]);
    let t = Instant::now();
    let why = loop {
        let (ok, out) = s1.try_exec(&["regrade", "status", "--json"]);
        let st: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        let bad = st["etcd"]["members"].as_array().and_then(|ms| {
            ms.iter().find(|m| m["name"].as_str().is_some_and(|n| n == names[2]) && m["health"] != "ok").cloned()
        });
        if let (true, Some(bad)) = (ok, bad) {
            break bad;
        }
        assert!(
            t.elapsed() < Duration::from_secs(90),
            "server3's partition never showed in server1's etcd view: {out}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(old_gate_passes(&a2, "server3").await, "server3 passes the node-Lease gate while partitioned");
    let refusal = refused_by_etcd(&a2, s1, "down", &names[2], "").await;
    netns_sh(&["heal", "3"]);
    wait_gate_clear(s1, Duration::from_secs(120));
    phase(&format!("9b. server3 partitioned on its peer port ({}): refused: {refusal}", why["health"]));

    // 9c. A learner (a fourth etcd, in the hub namespace, added as k3s adds a joining
    //     server): first added but not started, then started. No Node at all: the
    //     node-Lease gate cannot see it.
    let learner = tmp_learner_certs(etcd_ca);
    let admin = etcd_admin(s1);
    let ep1 = regrade::etcd::client::Endpoint::parse(&format!("https://{}:2379", addr(1))).unwrap();
    let peer4 = "https://10.213.7.1:2380";
    let added =
        etcd_call(&admin, &ep1, "/v3/cluster/member/add", &format!(r#"{{"peerURLs":["{peer4}"],"isLearner":true}}"#));
    let id4 = added["member"]["ID"].as_str().unwrap().to_string();
    let why = refused_by_etcd(&a2, s1, "down", "not started", "not started").await;
    phase(&format!("9c. a learner added, not started: refused: {why}"));
    let initial: Vec<String> = (1..=3).map(|m| format!("{}=https://{}:2380", names[m - 1], addr(m))).collect();
    let mut etcd4 = LearnerEtcd::start(bin, &learner, &format!("{},learner4-0a0b0c0d={peer4}", initial.join(",")));
    let t = Instant::now();
    let why = loop {
        let (ok, out) = s1.try_exec(&["regrade", "step", "down"]);
        assert!(!ok, "a step with a learner present was not refused: {out}");
        if out.contains("learner4-0a0b0c0d") {
            break out.lines().find(|l| l.contains("learner4")).unwrap().trim().to_string();
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the learner never showed as started: {out}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert!(why.contains("learner"), "{why}");
    assert_eq!(s1.level(), "control-plane");
    assert!(!s1.c.dropin().exists());
    etcd_call(&admin, &ep1, "/v3/cluster/member/remove", &format!(r#"{{"ID":"{id4}"}}"#));
    etcd4.stop();
    wait_gate_clear(s1, Duration::from_secs(60));
    phase(&format!("9c. ... the learner started: refused: {why}; removed"));

    // 9d. Two voters only: server3's member removed (and its server stopped, its Node
    //     deleted: a two-server cluster, which the node-Lease gate lets through).
    let id3 = s1.member_id("server3").to_string();
    s3.systemctl(&["stop", "k3s.service"]);
    etcd_call(&admin, &ep1, "/v3/cluster/member/remove", &format!(r#"{{"ID":"{id3}"}}"#));
    Api::<Node>::all(a2.clone()).delete("server3", &Default::default()).await.unwrap();
    assert!(old_gate_passes(&a1, "server2").await);
    let why = refused_by_etcd(&a2, s1, "down", "only 2 etcd voters", "at least 3").await;
    phase(&format!("9d. two voters left: refused: {why}"));
    s1.c.exec(&["regrade", "step", "up"]);
    assert_eq!(s1.level(), "full");
    phase("9. server1 back at full (no restart: no etcd gate)");
}

/// A client with server1's etcd client certificate (the test's admin).
fn etcd_admin(s: &Server) -> regrade::etcd::client::EtcdClient {
    let tls = PathBuf::from(s.c.var("ROOT")).join("var/lib/rancher/k3s/server/tls/etcd");
    regrade::etcd::client::EtcdClient::new(&regrade::etcd::EtcdConfig {
        ca_file: tls.join("server-ca.crt"),
        cert_file: tls.join("client.crt"),
        key_file: tls.join("client.key"),
        ..Default::default()
    })
    .unwrap()
}

/// A membership change through etcd's gateway, retried while etcd calls the cluster
/// unhealthy (it takes changes only once every member has been up a few seconds).
fn etcd_call(
    c: &regrade::etcd::client::EtcdClient,
    ep: &regrade::etcd::client::Endpoint,
    path: &str,
    body: &str,
) -> Value {
    let (c, ep, path, body) = (c.clone(), ep.clone(), path.to_string(), body.to_string());
    std::thread::spawn(move || {
        common::block_on(async {
            let t0 = Instant::now();
            loop {
                match c.call(&ep, &path, &body).await {
                    Ok(b) => return serde_json::from_slice(&b).unwrap(),
                    Err(e) => assert!(t0.elapsed() < Duration::from_secs(60), "{path} {body}: {e:#}"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    })
    .join()
    .unwrap()
}

/// Serving/peer certificates for the learner at 10.213.7.1, from the seeded CAs.
fn tmp_learner_certs(etcd_ca: &Path) -> PathBuf {
    let d = etcd_ca.join("learner");
    std::fs::create_dir_all(&d).unwrap();
    for (ca, name) in [("server-ca", "server"), ("peer-ca", "peer")] {
        let ext = d.join(format!("{name}.ext"));
        std::fs::write(&ext, "subjectAltName=IP:10.213.7.1,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
            .unwrap();
        let (key, csr, crt) =
            (d.join(format!("{name}.key")), d.join(format!("{name}.csr")), d.join(format!("{name}.crt")));
        run(
            Path::new("openssl"),
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                key.to_str().unwrap(),
                "-out",
                csr.to_str().unwrap(),
                "-subj",
                "/CN=learner4",
            ],
        );
        run(
            Path::new("openssl"),
            &[
                "x509",
                "-req",
                "-in",
                csr.to_str().unwrap(),
                "-CA",
                etcd_ca.join(format!("{ca}.crt")).to_str().unwrap(),
                "-CAkey",
                etcd_ca.join(format!("{ca}.key")).to_str().unwrap(),
                "-CAcreateserial",
                "-out",
                crt.to_str().unwrap(),
                "-days",
                "2",
                "-extfile",
                ext.to_str().unwrap(),
            ],
        );
    }
    d
}

/// The learner: the rig's plain etcd, in the hub namespace (this test's own).
struct LearnerEtcd(Option<std::process::Child>);

impl LearnerEtcd {
    fn start(bin: &Path, certs: &Path, initial: &str) -> LearnerEtcd {
        let ca = certs.parent().unwrap();
        let f = |n: &str| certs.join(n).display().to_string();
        let child = Command::new(bin.join("etcd"))
            .args(["--name", "learner4-0a0b0c0d", "--data-dir", &f("data")])
            .args([
                "--listen-client-urls",
                "https://10.213.7.1:2379",
                "--advertise-client-urls",
                "https://10.213.7.1:2379",
            ])
            .args([
                "--listen-peer-urls",
                "https://10.213.7.1:2380",
                "--initial-advertise-peer-urls",
                "https://10.213.7.1:2380",
            ])
            .args([
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "existing",
                "--initial-cluster-token",
                "k3s-standin",
            ])
            .args(["--client-cert-auth", "--trusted-ca-file", &ca.join("server-ca.crt").display().to_string()])
            .args(["--cert-file", &f("server.crt"), "--key-file", &f("server.key")])
            .args(["--peer-client-cert-auth", "--peer-trusted-ca-file", &ca.join("peer-ca.crt").display().to_string()])
            .args(["--peer-cert-file", &f("peer.crt"), "--peer-key-file", &f("peer.key"), "--log-level", "error"])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(certs.join("etcd.log")).unwrap())
            .spawn()
            .unwrap();
        LearnerEtcd(Some(child))
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for LearnerEtcd {
    fn drop(&mut self) {
        self.stop()
    }
}
