//! The rig of the level-record tests (kill points, reboot): a real kube-apiserver with
//! RBAC on the host (tests/rig), a Debian booted in systemd-nspawn whose k3s.service
//! runs the k3s stand-in with its agent registered against that API server (so the
//! Node, its Ready condition and its node Lease are real API objects), and `regrade`
//! run on the host as a child process — with a ServiceAccount token bound by
//! deploy/rbac.yaml, the container's system bus, its drop-in and start record, and
//! its level record at the container's own /var/lib/regrade/level.json (which
//! `record-start` in the container reads too).
//!
//! The etcd gate asks a three-member etcd on the host (127.0.0.41–43,
//! tests/testsuite/common/etcd_cluster.rs), not the container's own one-member etcd: a gate
//! that judged the member k3s restarts would rightly refuse every restart of a lone
//! voter. So these tests cover the level record through restarts the gate allows; the
//! gate's judgement of the restarted member itself is in etcd_gate and the e2e test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use serde_json::Value;

use super::etcd_cluster::{self, EtcdCluster};
use super::Harness;

/// Where k3s runs: a Debian booted in systemd-nspawn (the systemd actuator), or, in a
/// `docker` build, a container on the Docker rig's dockerd (the Docker actuator).
#[cfg(not(feature = "docker"))]
pub type K3s = super::nspawn::Container;
#[cfg(feature = "docker")]
pub type K3s = super::docker_k3s::DockerK3s;

/// The k3s stand-in's loopback address in a `docker` build (host networking), and
/// the gate's three-member etcd (127.0.0.41–43, or 71–73 in a `docker` build: the
/// two rigs run at once in tests/run).
#[cfg(feature = "docker")]
const DOCKER_K3S_IP: &str = "127.0.0.74";
const ETCD_PREFIX: &str = if cfg!(feature = "docker") { "127.0.0.7" } else { "127.0.0.4" };

pub const NODE: &str = "regrade-test";
pub const LABEL: &str = "regrade.dev/level";
pub const TAINT: &str = "regrade.dev/stepped-down";
pub const LEASE: &str = "regrade"; // the one name deploy/rbac.yaml allows

pub struct LevelRig {
    pub h: Harness,
    pub c: K3s,
    pub dir: tempfile::TempDir,
    pub conf: PathBuf,
    pub admin: kube::Client,
    pub etcd: EtcdCluster,
    rt: tokio::runtime::Runtime,
}

/// The stand-in's seed for the container's /etc/rancher/k3s: its agent talks to the
/// host's API server as admin; the local API server is off at every level (regrade
/// talks to the host's, and a second kube-apiserver would only cost the rig memory).
fn seed_etc(h: &Harness, dir: &Path) -> PathBuf {
    let etc = dir.join("seed-etc");
    std::fs::create_dir_all(etc.join("tls")).unwrap();
    for f in ["ca.crt", "admin.crt", "admin.key"] {
        std::fs::copy(h.dir.join("pki").join(f), etc.join("tls").join(f)).unwrap();
    }
    std::fs::write(
        etc.join("harness.kubeconfig"),
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: h\n  cluster:\n    server: {}\n    \
             certificate-authority: /etc/rancher/k3s/tls/ca.crt\nusers:\n- name: admin\n  user:\n    \
             client-certificate: /etc/rancher/k3s/tls/admin.crt\n    client-key: /etc/rancher/k3s/tls/admin.key\n\
             contexts:\n- name: admin\n  context: {{cluster: h, user: admin}}\ncurrent-context: admin\n",
            h.server
        ),
    )
    .unwrap();
    std::fs::write(
        etc.join("config.yaml"),
        // The harness serves the API: the stand-in runs none at any level, by its own
        // knob, not by `disable-apiserver`, which is regrade's level key (set here it
        // would override the levels, and watch refuses to start on that).
        "kubeconfig: /etc/rancher/k3s/harness.kubeconfig\nstandin-no-apiserver: true\nnode-lease-interval: 2s\n\
         node-status-interval: 2s\n",
    )
    .unwrap();
    etc
}

impl LevelRig {
    /// Starts the API server and boots the container; `None` when a gate is unset.
    pub fn up(test: &str, container: &str) -> Option<LevelRig> {
        #[cfg(not(feature = "docker"))]
        if !super::nspawn::enabled(test) {
            return None;
        }
        #[cfg(feature = "docker")]
        if !super::gate_open("REGRADE_TEST_DOCKER", test, "root; a real dockerd") {
            return None;
        }
        let h = super::start(test)?;
        let dir = tempfile::tempdir().unwrap();
        let sa = h.unbound_server_credential(NODE);
        let etc = seed_etc(&h, dir.path());
        #[cfg(not(feature = "docker"))]
        let c = K3s::up_with(container, &[("REGRADE_NSPAWN_SEED_ETC", etc.as_path())]);
        #[cfg(feature = "docker")]
        let c = K3s::up(container, NODE, DOCKER_K3S_IP, &etc, dir.path());
        c.wait_healthy(Duration::from_secs(90));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let admin = rt.block_on(h.admin());
        let etcd_dir = dir.path().join("etcd");
        std::fs::create_dir_all(&etcd_dir).unwrap();
        let mut etcd = EtcdCluster::new(&h.bin_dir, &etcd_dir, ETCD_PREFIX, 3);
        etcd.start_new(3);
        let gate = regrade::etcd::gate::EtcdGate::new(&etcd.config(1, "client")).unwrap();
        rt.block_on(etcd_cluster::settled(&gate, 3, Duration::from_secs(30)));
        let conf = dir.path().join("regrade.toml");
        let rig = LevelRig { h, c, dir, conf, admin, etcd, rt };
        rig.write_config(&sa, None);
        rig.pressure(20.0);
        rig.wait("the stand-in's Node Ready", Duration::from_secs(90), || rig.node().is_some().then_some(()));
        Some(rig)
    }

    /// (Re)writes regrade's configuration; `server` replaces the kubeconfig's API URL.
    pub fn write_config(&self, sa: &Path, server: Option<&str>) {
        let kubeconfig = match server {
            None => sa.to_path_buf(),
            Some(url) => {
                let text = std::fs::read_to_string(sa).unwrap().replace(&self.h.server, url);
                let p = self.dir.path().join("regrade-proxied.kubeconfig");
                std::fs::write(&p, text).unwrap();
                p
            }
        };
        let d = self.dir.path();
        let top = format!(
            "state_file = {:?}\nlevel_record = {:?}\nstep_up = \"automatic\"\n",
            d.join("state.json"),
            self.level_record()
        );
        let rest = format!(
            "[pressure]\nthreshold = 40\ncalm_threshold = 10\nmem_available_floor = \"none\"\n\
             sample_period = \"200ms\"\nsustain = \"600ms\"\ncooldown = \"1s\"\nsource = {:?}\nmeminfo = {:?}\n\
             [cluster]\nkubeconfig = {kubeconfig:?}\nnode_name = {NODE:?}\nlease_name = {LEASE:?}\n\
             lease_duration = \"6s\"\nrequest_timeout = \"3s\"\nendpoints_cache = {:?}\n",
            d.join("psi"),
            d.join("meminfo"),
            d.join("endpoints"),
        ) + &self.etcd.config_toml(1);
        std::fs::write(&self.conf, top + &self.c.config_text("30s", &rest)).unwrap();
    }

    pub fn sa_kubeconfig(&self) -> PathBuf {
        self.h.dir.join(format!("regrade-{NODE}.kubeconfig"))
    }

    /// The level record: where the nspawn container sees it at
    /// /var/lib/regrade/level.json (its `record-start` hook reads it); beside the
    /// Docker rig's container otherwise.
    pub fn level_record(&self) -> PathBuf {
        #[cfg(not(feature = "docker"))]
        return PathBuf::from(self.c.var("ROOT")).join("var/lib/regrade/level.json");
        #[cfg(feature = "docker")]
        return self.c.level_record();
    }

    pub fn record(&self) -> Option<Value> {
        let text = std::fs::read_to_string(self.level_record()).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// The pressure the fixture files show (MemAvailable plenty: PSI alone decides).
    pub fn pressure(&self, psi: f64) {
        let d = self.dir.path();
        std::fs::write(d.join("psi"), super::psi_text(psi)).unwrap();
        std::fs::write(d.join("meminfo"), "MemTotal: 4000000 kB\nMemAvailable: 2000000 kB\n").unwrap();
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_regrade"));
        c.arg("--config").arg(&self.conf).args(args);
        #[cfg(not(feature = "docker"))]
        c.env("DBUS_SYSTEM_BUS_ADDRESS", self.c.var("BUS"));
        c.env_remove(regrade::kill_point::ENV);
        c
    }

    /// `regrade ARGS` to the end: (success, stdout, stderr).
    pub fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = self.command(args).output().unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
    }

    /// `regrade watch` in the background, its log in `log`, killed at `kill_at` if set.
    pub fn watch(&self, kill_at: Option<&str>, log: &Path) -> Child {
        let kill = kill_at.map(|p| (regrade::kill_point::ENV, p));
        self.watch_with(kill.as_slice(), log)
    }

    /// `regrade watch` as [`LevelRig::watch`], with `env` set for it alone.
    pub fn watch_with(&self, env: &[(&str, &str)], log: &Path) -> Child {
        let mut c = self.command(&["watch"]);
        c.envs(env.iter().copied());
        c.env("RUST_LOG", "info").stdout(Stdio::null()).stderr(std::fs::File::create(log).unwrap());
        c.spawn().unwrap()
    }

    /// `regrade ARGS` in the background, stdout and stderr both in `log`.
    pub fn spawn(&self, args: &[&str], log: &Path) -> Child {
        let out = std::fs::File::create(log).unwrap();
        let mut c = self.command(args);
        c.env("RUST_LOG", "info").stdout(out.try_clone().unwrap()).stderr(out);
        c.spawn().unwrap()
    }

    /// The drain's progress as `regrade status` reads it (beside the state file).
    pub fn drain(&self) -> Option<Value> {
        let text = std::fs::read_to_string(self.dir.path().join("drain.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub fn node(&self) -> Option<Node> {
        self.rt.block_on(Api::<Node>::all(self.admin.clone()).get_opt(NODE)).unwrap()
    }

    /// The level the Node's marks say, if they are consistent (label, cordon, taint
    /// all of one level); `Err` describes inconsistent marks.
    pub fn marks(&self) -> Result<String, String> {
        let n = self.node().ok_or("no Node")?;
        let label = n.metadata.labels.as_ref().and_then(|l| l.get(LABEL).cloned());
        let spec = n.spec.unwrap_or_default();
        let cordoned = spec.unschedulable == Some(true);
        let taint = spec.taints.unwrap_or_default().into_iter().find(|t| t.key == TAINT).and_then(|t| t.value);
        match (&label, cordoned, &taint) {
            (None, false, None) => Ok("full".into()),
            (Some(l), true, Some(t)) if l == t => Ok(l.clone()),
            _ => Err(format!("label {label:?}, cordoned {cordoned}, taint {taint:?}")),
        }
    }

    /// Who holds regrade's Lease now (`None`: free or expired).
    pub fn lease_holder(&self) -> Option<String> {
        let l =
            self.rt.block_on(Api::<Lease>::namespaced(self.admin.clone(), "kube-system").get_opt(LEASE)).unwrap()?;
        let spec = l.spec?;
        let holder = spec.holder_identity.filter(|h| !h.is_empty())?;
        let renewed = spec.renew_time.map(|t| t.0.as_millisecond())?;
        let secs = i64::from(spec.lease_duration_seconds.unwrap_or(0));
        let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
        (renewed + secs * 1000 > now).then_some(holder)
    }

    /// The level the drop-in (the level file, in a `docker` build) stands for
    /// (absent: full's flags).
    pub fn dropin_level(&self) -> String {
        #[cfg(feature = "docker")]
        return self.c.file_level();
        #[cfg(not(feature = "docker"))]
        match std::fs::read_to_string(self.c.dropin()) {
            Err(_) => "full".into(),
            Ok(t) => t.lines().find_map(|l| l.strip_prefix("# regrade-level: ")).unwrap_or("edited").trim().to_string(),
        }
    }

    /// Converged: the level record has no step under way, and the Node's marks, the
    /// drop-in and the start record all say its level (full and control-plane share
    /// flags), the Lease is free. Returns that level.
    pub fn converged(&self) -> Result<String, String> {
        let r = self.record().ok_or("no level record")?;
        if !r["step"].is_null() {
            return Err(format!("a step is under way: {}", r["step"]));
        }
        let level = r["level"].as_str().ok_or("no level")?.to_string();
        let marks = self.marks()?;
        if marks != level {
            return Err(format!("the record says {level}, the Node {marks}"));
        }
        let eo = |l: &str| l == "etcd-only";
        let dropin = self.dropin_level();
        if eo(&dropin) != eo(&level) {
            return Err(format!("the record says {level}, the drop-in {dropin}"));
        }
        let started = self.c.record_text();
        if eo(&started) != eo(&level) {
            return Err(format!("the record says {level}, k3s was started at {started}"));
        }
        if !self.c.healthy() {
            return Err("etcd is not healthy".into());
        }
        if let Some(h) = self.lease_holder() {
            return Err(format!("the Lease is held by {h}"));
        }
        Ok(level)
    }

    pub fn wait<T>(&self, what: &str, within: Duration, f: impl FnMut() -> Option<T>) -> T {
        self.wait_saying(within, f, || format!("timed out after {within:?} waiting for {what}"))
    }

    /// As [`Rig::wait`], the panic saying `why()` (e.g. with the log of the process
    /// waited on), asked only then.
    pub fn wait_saying<T>(&self, within: Duration, mut f: impl FnMut() -> Option<T>, why: impl Fn() -> String) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(t0.elapsed() < within, "{}", why());
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// Stops a `watch` child: SIGTERM (it finishes a step under way), then waits.
pub fn stop(child: &mut Child) {
    // SAFETY: signals our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
