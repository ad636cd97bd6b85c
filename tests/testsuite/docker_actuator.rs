//! The Docker actuator against a real Docker engine (docs/behaviour.md, "Actuators"; issue 6).
//!
//! Gated by `REGRADE_TEST_DOCKER=1` (needs root). The first test runs
//! `tests/docker/rig.sh up` (installs docker.io, starts the rig's own dockerd, builds
//! the static regrade and deploy/docker/k3s.Dockerfile on an imported base holding the
//! k3s stand-in as /bin/k3s: no C library); each container gets regrade's entrypoint
//! as deploy/docker/compose.yaml gives it. `tests/docker/run.sh` also stops that
//! dockerd afterwards.
//!
//! Each test runs one k3s container with `--network host` on a loopback address of its
//! own (the stand-in's etcd, /health and API port bind there), a host directory as
//! the k3s data volume (where the level file lives), one as /etc/rancher/k3s (the
//! stand-in's knob files) and one for the stand-in's report of the flags it was
//! started with. The tests run one at a time: one of them restarts dockerd.
#![cfg(feature = "docker")]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crate::common;

use common::Readiness;
use regrade::actuator::docker::DockerActuator;
use regrade::actuator::Actuator;
use regrade::config::Config;
use regrade::level::Level;
use regrade::level_record::Phase;

const DOCKER: &str = "/usr/bin/docker";

struct Rig {
    socket: PathBuf,
    image: String,
}

/// The rig, started once per test process; `None` (with a notice) when not enabled.
fn rig() -> Option<&'static Rig> {
    if std::env::var("REGRADE_TEST_DOCKER").as_deref() != Ok("1") {
        eprintln!(
            "skipped: set REGRADE_TEST_DOCKER=1 (as root) to run the Docker actuator tests against a real dockerd"
        );
        return None;
    }
    static RIG: OnceLock<Rig> = OnceLock::new();
    Some(RIG.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/docker/rig.sh");
        let out = Command::new("bash").arg(&script).arg("up").output().unwrap();
        assert!(out.status.success(), "{} up failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let get = |k: &str| {
            text.lines().find_map(|l| l.strip_prefix(&format!("{k}="))).unwrap_or_else(|| panic!("no {k}= in {text}"))
        };
        Rig { socket: get("socket").into(), image: get("image").to_string() }
    }))
}

/// Runs a test's body, one test at a time: a test restarts dockerd, and all share 2
/// cores. A current-thread runtime, as regrade's own.
fn serially(test: impl std::future::Future<Output = ()>) {
    static LOCK: Mutex<()> = Mutex::new(());
    let _serial = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(test)
}

fn docker(rig: &Rig, args: &[&str]) -> String {
    let out =
        Command::new(DOCKER).arg("-H").arg(format!("unix://{}", rig.socket.display())).args(args).output().unwrap();
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A k3s (stand-in) server container and its host directories.
struct K3s {
    rig: &'static Rig,
    name: String,
    ip: String,
    dir: tempfile::TempDir,
    args: Vec<String>,
}

impl K3s {
    /// `ip` is a loopback address of the test's own; `level_file` is written first.
    fn start(rig: &'static Rig, name: &str, ip: &str, level_file: Option<&[u8]>) -> K3s {
        K3s::start_with(rig, name, ip, level_file, true)
    }

    /// `through_regrade`: false runs k3s as the entrypoint itself, as before regrade
    /// was set up.
    fn start_with(rig: &'static Rig, name: &str, ip: &str, level_file: Option<&[u8]>, through_regrade: bool) -> K3s {
        let dir = tempfile::tempdir().unwrap();
        for d in ["data", "conf", "report"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let name = format!("regrade-test-{name}");
        let _ =
            Command::new(DOCKER).args(["-H", &format!("unix://{}", rig.socket.display()), "rm", "-f", &name]).output();
        let k3s = K3s {
            rig,
            name,
            ip: ip.to_string(),
            args: vec![
                "k3s".into(),
                "server".into(),
                format!("--node-ip={ip}"),
                format!("--etcd-health-addr={ip}:2381"),
                // Every port on the test's own address (k3s also listens on
                // 127.0.0.1:2379 and starts its temporary etcd there): the host's
                // network is shared, with a container another run may have left too.
                format!("--etcd-client-url=https://{ip}:2379"),
                format!("--temp-etcd-addr={ip}"),
                "--report-file=/report/flags.json".into(),
                "--health-delay=1s".into(),
            ],
            dir,
        };
        if let Some(content) = level_file {
            std::fs::write(k3s.level_file(), content).unwrap();
        }
        let mounts = [("data", "/var/lib/rancher/k3s"), ("conf", "/etc/rancher/k3s"), ("report", "/report")]
            .map(|(d, at)| format!("{}:{at}", k3s.dir.path().join(d).display()));
        let mut run = vec!["run", "-d", "--name", &k3s.name, "--network", "host", "--tmpfs", "/run"];
        run.extend(["--restart", "unless-stopped"]);
        for m in &mounts {
            run.extend(["-v", m]);
        }
        // The image is rancher/k3s's shape (entrypoint /bin/k3s) plus /bin/regrade;
        // regrade becomes the entrypoint the way deploy/docker/compose.yaml makes it.
        if through_regrade {
            run.extend(["--entrypoint", "/bin/regrade"]);
        }
        run.push(&rig.image);
        if through_regrade {
            run.extend(["entrypoint", "--"]);
        }
        run.extend(k3s.args.iter().skip(usize::from(!through_regrade)).map(String::as_str));
        docker(rig, &run);
        k3s.wait_healthy(Duration::from_secs(60));
        k3s
    }

    fn level_file(&self) -> PathBuf {
        self.dir.path().join("data/regrade-level")
    }

    fn knob(&self, name: &str) -> PathBuf {
        self.dir.path().join("conf").join(name)
    }

    fn config(&self, health_timeout: &str) -> Config {
        Config::parse(&format!(
            "[docker]\nsocket = {:?}\ncontainer = {:?}\nlevel_file = {:?}\nstop_timeout = \"5s\"\n\
             etcd_health_url = \"http://{}:2381/health\"\nhealth_timeout = {health_timeout:?}\n",
            self.rig.socket,
            self.name,
            self.level_file(),
            self.ip,
        ))
        .unwrap()
    }

    fn actuator(&self) -> DockerActuator {
        common::docker_actuator(&self.config("30s")).unwrap()
    }

    fn inspect(&self, format: &str) -> String {
        docker(self.rig, &["inspect", "-f", format, &self.name])
    }

    fn started_at(&self) -> String {
        self.inspect("{{.State.StartedAt}}")
    }

    /// Restarts of this container the engine reported since `since` (see [`now`]).
    fn restarts_since(&self, since: &str) -> usize {
        let until = format!("{}", SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() + 1);
        let filter = format!("container={}", self.name);
        let events = docker(
            self.rig,
            &["events", "--since", since, "--until", &until, "--filter", &filter, "--filter", "event=restart"],
        );
        events.lines().count()
    }

    fn report_file(&self) -> PathBuf {
        self.dir.path().join("report/flags.json")
    }

    /// The stand-in's report of what it was started with.
    fn report(&self) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(self.report_file()).unwrap()).unwrap()
    }

    /// Waits until a k3s started after the report was removed has reported a start with no
    /// added arguments: an actuator that gave up waiting for its health returns as soon as
    /// the container started again, before its k3s may have written the report (seen in CI).
    fn wait_started_without_added_args(&self) {
        let t0 = Instant::now();
        while !(self.report_file().exists() && self.added_args().is_empty()) {
            let last = std::fs::read_to_string(self.report_file()).unwrap_or_default();
            assert!(t0.elapsed() < Duration::from_secs(30), "no start without added arguments in 30s; report: {last}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The arguments k3s got beyond the container's own command line.
    fn added_args(&self) -> Vec<String> {
        let report = self.report();
        let argv: Vec<String> = serde_json::from_value(report["argv"].clone()).unwrap();
        // argv[0] is the stand-in itself; the container's command follows "k3s".
        assert_eq!(argv[1..self.args.len()], self.args[1..], "k3s lost its own arguments: {argv:?}");
        argv[self.args.len()..].to_vec()
    }

    fn flag(&self, name: &str) -> bool {
        self.report()["flags"][name].as_bool().unwrap()
    }

    fn healthy(&self) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect((self.ip.as_str(), 2381)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let _ = s.write_all(b"GET /health HTTP/1.0\r\n\r\n");
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.starts_with("HTTP/1.0 200") && answer.contains(r#""health":"true""#)
    }

    fn wait_healthy(&self, timeout: Duration) {
        let t0 = Instant::now();
        while !self.healthy() {
            if t0.elapsed() >= timeout {
                // What the container said, so a failure here can be read from CI's log.
                let logs = Command::new(DOCKER)
                    .args(["-H", &format!("unix://{}", self.rig.socket.display()), "logs", "--tail", "40", &self.name])
                    .output()
                    .map(|o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
                    .unwrap_or_default();
                let state = self.inspect("{{.State.Status}} restarts={{.RestartCount}} exit={{.State.ExitCode}}");
                panic!(
                    "{} not healthy on {}:2381 within {timeout:?} ({state}); its last lines:\n{logs}",
                    self.name, self.ip
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for K3s {
    fn drop(&mut self) {
        let _ = Command::new(DOCKER)
            .args(["-H", &format!("unix://{}", self.rig.socket.display()), "rm", "-f", &self.name])
            .output();
    }
}

/// The time now, as `docker events --since` takes it.
fn now() -> String {
    let d = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap();
    format!("{}.{:09}", d.as_secs(), d.subsec_nanos())
}

fn rfc3339(s: &str) -> SystemTime {
    SystemTime::from(s.parse::<k8s_openapi::jiff::Timestamp>().unwrap())
}

const ETCD_ONLY: [&str; 3] = ["--disable-apiserver", "--disable-controller-manager", "--disable-scheduler"];

#[test]
fn steps_down_restarting_only_for_etcd_only_and_back_up() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "steps", "127.0.61.1", None);
        let mut act = k3s.actuator();
        let ready = Readiness::default();
        let id = k3s.inspect("{{.Id}}");
        // No level file: the entrypoint started k3s at full.
        assert_eq!(act.current_level().await.unwrap(), Level::Full);
        assert!(k3s.added_args().is_empty());

        // full -> control-plane: same flags, no restart.
        let (t0, since) = (k3s.started_at(), now());
        act.apply_level(Level::ControlPlane, &ready).await.unwrap();
        assert_eq!(k3s.started_at(), t0, "full -> control-plane restarted the container");
        assert_eq!(k3s.restarts_since(&since), 0);
        assert_eq!(std::fs::read_to_string(k3s.level_file()).unwrap(), "control-plane\n");
        assert_eq!(act.current_level().await.unwrap(), Level::ControlPlane);
        assert!(ready.0.borrow().is_empty());
        assert!(ready.1.borrow().is_empty(), "no restart, no phases: {:?}", ready.1.borrow());

        // control-plane -> etcd-only: one restart, exactly the level's flags.
        let (t1, since) = (k3s.started_at(), now());
        act.apply_level(Level::EtcdOnly, &ready).await.unwrap();
        let t2 = k3s.started_at();
        assert_ne!(t2, t1, "control-plane -> etcd-only did not restart the container");
        assert_eq!(k3s.restarts_since(&since), 1);
        assert_eq!(k3s.inspect("{{.Id}}"), id, "the container was recreated, not restarted");
        assert_eq!(k3s.added_args(), ETCD_ONLY);
        assert!(k3s.flag("disable-apiserver") && k3s.flag("disable-scheduler") && !k3s.flag("disable-agent"));
        assert_eq!(act.current_level().await.unwrap(), Level::EtcdOnly);
        assert!(k3s.healthy());
        // etcd-only keeps the agent: the Node's readiness was awaited since the new start.
        assert_eq!(*ready.0.borrow(), [rfc3339(&t2)]);
        assert_eq!(act.disagreement().await, None);
        // Each phase recorded before its effect, as the level record keeps them.
        assert_eq!(ready.1.take(), [Phase::Writing, Phase::Restarting]);
        assert_eq!(act.observe().await.unwrap(), (Some(Level::EtcdOnly), Some(Level::EtcdOnly)));

        // Resuming that step (a regrade killed after asking for the restart): k3s runs
        // etcd-only's flags already, so it is waited for, not restarted again.
        let since = now();
        act.resume(Level::ControlPlane, Level::EtcdOnly, &ready).await.unwrap();
        assert_eq!(k3s.restarts_since(&since), 0, "the resumed step restarted the container again");
        assert_eq!(ready.0.borrow().last(), Some(&rfc3339(&t2)), "Ready awaited since the container's start");
        assert!(ready.1.borrow().is_empty());

        // Back to full: one restart, the flags gone.
        let since = now();
        act.apply_level(Level::ControlPlane, &ready).await.unwrap();
        let t3 = k3s.started_at();
        assert_eq!(k3s.restarts_since(&since), 1);
        assert!(k3s.added_args().is_empty());
        assert_eq!(act.current_level().await.unwrap(), Level::ControlPlane);
        act.apply_level(Level::Full, &ready).await.unwrap();
        assert_eq!(k3s.started_at(), t3, "control-plane -> full restarted the container");
        assert_eq!(act.current_level().await.unwrap(), Level::Full);
        assert!(k3s.added_args().is_empty());
        assert_eq!(std::fs::read_to_string(k3s.level_file()).unwrap(), "full\n");
        assert_eq!(k3s.inspect("{{.Id}}"), id);
    });
}

#[test]
fn etcd_only_to_full_restarts_once() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "up", "127.0.61.2", Some(b"etcd-only\n"));
        let mut act = k3s.actuator();
        assert_eq!(k3s.added_args(), ETCD_ONLY);
        assert_eq!(act.current_level().await.unwrap(), Level::EtcdOnly);
        let since = now();
        act.apply_level(Level::Full, &Readiness::default()).await.unwrap();
        assert_eq!(k3s.restarts_since(&since), 1);
        assert!(k3s.added_args().is_empty());
        assert!(!k3s.flag("disable-apiserver"));
        assert_eq!(act.current_level().await.unwrap(), Level::Full);
    });
}

#[test]
fn the_level_survives_a_restart_by_someone_else_and_a_dockerd_restart() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "survives", "127.0.61.3", None);
        let mut act = k3s.actuator();
        act.apply_level(Level::ControlPlane, &Readiness::default()).await.unwrap();
        act.apply_level(Level::EtcdOnly, &Readiness::default()).await.unwrap();

        let t0 = k3s.started_at();
        docker(rig, &["restart", "-t", "5", &k3s.name]);
        assert_ne!(k3s.started_at(), t0);
        k3s.wait_healthy(Duration::from_secs(60));
        assert_eq!(k3s.added_args(), ETCD_ONLY);
        assert_eq!(act.current_level().await.unwrap(), Level::EtcdOnly);

        let t1 = k3s.started_at();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/docker/rig.sh");
        let out = Command::new("bash").arg(&script).arg("restart-dockerd").output().unwrap();
        assert!(out.status.success(), "restart-dockerd: {}", String::from_utf8_lossy(&out.stderr));
        // The restart policy brings the container back through its entrypoint.
        let t = Instant::now();
        while k3s.inspect("{{.State.Running}}") != "true" || k3s.started_at() == t1 {
            assert!(t.elapsed() < Duration::from_secs(60), "container did not come back after the dockerd restart");
            std::thread::sleep(Duration::from_millis(200));
        }
        k3s.wait_healthy(Duration::from_secs(60));
        assert_eq!(k3s.added_args(), ETCD_ONLY);
        assert_eq!(act.current_level().await.unwrap(), Level::EtcdOnly);
    });
}

#[test]
fn health_that_never_comes_puts_the_previous_level_back() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "never", "127.0.61.4", None);
        // Long enough for the restoring restart to be healthy on a loaded 2-core machine:
        // the stand-in starts as k3s does (a temporary etcd, then the member with k3s's
        // 500 ms heartbeat), and a CI run saw it miss 6 s.
        let mut act = common::docker_actuator(&k3s.config("20s")).unwrap();
        act.apply_level(Level::ControlPlane, &Readiness::default()).await.unwrap();
        let t0 = k3s.started_at();
        std::fs::write(k3s.knob("standin-never-healthy"), "").unwrap();

        // Health comes back once the container was restarted a second time (the restore).
        let (socket, name, knob) = (rig.socket.clone(), k3s.name.clone(), k3s.knob("standin-never-healthy"));
        let watcher = std::thread::spawn(move || {
            let t = Instant::now();
            let mut seen = vec![t0];
            while seen.len() < 3 && t.elapsed() < Duration::from_secs(120) {
                let out = Command::new(DOCKER)
                    .args([
                        "-H",
                        &format!("unix://{}", socket.display()),
                        "inspect",
                        "-f",
                        "{{.State.StartedAt}}",
                        &name,
                    ])
                    .output()
                    .unwrap();
                let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
                if out.status.success() && seen.last() != Some(&s) {
                    seen.push(s);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            std::fs::remove_file(knob).unwrap();
            seen.len() - 1
        });

        let ready = Readiness::default();
        let err = format!("{:#}", act.apply_level(Level::EtcdOnly, &ready).await.unwrap_err());
        assert_eq!(watcher.join().unwrap(), 2, "expected the failed restart and the restoring one");
        assert!(
            err.contains("into level etcd-only failed")
                && err.contains("was not healthy within docker.health_timeout = 20s"),
            "{err}"
        );
        assert!(err.contains("restored the previous level control-plane"), "{err}");
        assert!(err.contains(&k3s.level_file().display().to_string()) && err.contains(&k3s.name), "{err}");
        assert!(err.contains("serves at control-plane again"), "{err}");
        assert_eq!(std::fs::read_to_string(k3s.level_file()).unwrap(), "control-plane\n");
        assert!(k3s.added_args().is_empty());
        assert_eq!(act.current_level().await.unwrap(), Level::ControlPlane);
        // The failed etcd-only start never got as far as waiting for the Node; the restored
        // control-plane did.
        assert_eq!(ready.0.borrow().len(), 1);
        assert_eq!(*ready.1.borrow(), [Phase::Writing, Phase::Restarting, Phase::Restoring]);
    });
}

#[test]
fn health_that_never_comes_back_either_is_reported() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "never2", "127.0.61.5", None);
        let mut act = common::docker_actuator(&k3s.config("3s")).unwrap();
        std::fs::write(k3s.knob("standin-never-healthy"), "").unwrap();
        std::fs::remove_file(k3s.report_file()).unwrap();
        let err = format!("{:#}", act.apply_level(Level::EtcdOnly, &Readiness::default()).await.unwrap_err());
        assert!(err.contains("restored the previous level full") && err.contains("but that failed too"), "{err}");
        // There was no level file before: there is none after.
        assert!(!k3s.level_file().exists());
        k3s.wait_started_without_added_args();
    });
}

#[test]
fn a_corrupt_level_file_starts_k3s_at_full_and_says_so() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "corrupt", "127.0.61.6", Some(b"etcd-\xffonly"));
        assert!(k3s.added_args().is_empty());
        let logs = {
            let out = Command::new(DOCKER)
                .args(["-H", &format!("unix://{}", rig.socket.display()), "logs", &k3s.name])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stderr).to_string()
        };
        let file = "/var/lib/rancher/k3s/regrade-level";
        assert!(logs.contains(&format!("regrade entrypoint: level file {file}")), "{logs}");
        assert!(logs.contains("starting k3s at full"), "{logs}");
        let mut act = k3s.actuator();
        assert_eq!(act.current_level().await.unwrap(), Level::Full);
        // The actuator replaces the bad file when it next applies a level.
        act.apply_level(Level::ControlPlane, &Readiness::default()).await.unwrap();
        assert_eq!(std::fs::read_to_string(k3s.level_file()).unwrap(), "control-plane\n");
    });
}

#[test]
fn a_container_that_is_not_running_is_named() {
    let Some(rig) = rig() else { return };
    serially(async {
        let k3s = K3s::start(rig, "stopped", "127.0.61.7", None);
        docker(rig, &["stop", "-t", "5", &k3s.name]);
        let err = format!("{:#}", k3s.actuator().current_level().await.unwrap_err());
        assert!(err.contains(&k3s.name) && err.contains("exited, not running"), "{err}");
        let missing =
            Config::parse(&format!("[docker]\nsocket = {:?}\ncontainer = \"no-such-k3s\"\n", rig.socket)).unwrap();
        let err = format!("{:#}", common::docker_actuator(&missing).unwrap().current_level().await.unwrap_err());
        assert!(err.contains("no-such-k3s") && err.contains(&rig.socket.display().to_string()), "{err}");
    });
}

#[test]
fn a_running_container_without_a_record_is_at_full() {
    let Some(rig) = rig() else { return };
    serially(async {
        // k3s started without regrade's entrypoint: nothing recorded a level.
        let k3s = K3s::start_with(rig, "norecord", "127.0.61.8", None, false);
        let mut act = k3s.actuator();
        assert_eq!(act.current_level().await.unwrap(), Level::Full);
        let t0 = k3s.started_at();
        act.apply_level(Level::ControlPlane, &Readiness::default()).await.unwrap();
        assert_eq!(k3s.started_at(), t0);
        assert_eq!(act.current_level().await.unwrap(), Level::ControlPlane);
        // A restart cannot bring this container to etcd-only: said, and undone.
        let err = format!("{:#}", act.apply_level(Level::EtcdOnly, &Readiness::default()).await.unwrap_err());
        assert!(
            err.contains("started k3s with the flags of full, not those of etcd-only") && err.contains("entrypoint"),
            "{err}"
        );
        assert!(err.contains("restored the previous level control-plane"), "{err}");
        assert_eq!(std::fs::read_to_string(k3s.level_file()).unwrap(), "control-plane\n");
        assert!(k3s.added_args().is_empty());
    });
}
