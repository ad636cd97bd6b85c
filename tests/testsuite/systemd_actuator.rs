//! The systemd actuator against a real systemd and D-Bus: a Debian booted in
//! systemd-nspawn whose k3s.service runs the k3s stand-in (tests/nspawn/). The
//! actuator runs here on the host and reaches the container's system bus through
//! DBUS_SYSTEM_BUS_ADDRESS; the drop-in directory and /run/regrade are shared.
//! Gated by REGRADE_TEST_SYSTEMD=1 (root). Run with --test-threads=1 or not: the
//! containers take turns.

use crate::common;

use std::time::{Duration, Instant, SystemTime};

use common::nspawn::{enabled, Container};
use common::Readiness;
use regrade::actuator::systemd::{dropin, SystemdActuator};
use regrade::actuator::Actuator;
use regrade::level::Level;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

/// What the actuator logs, for the lines the incident scenario times steps by.
#[derive(Clone, Default)]
struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn flag(c: &Container, name: &str) -> serde_json::Value {
    c.standin_flags()["flags"][name].clone()
}

/// When k3s.service last entered `inactive`: in a restart, when the old process had
/// stopped. Read over D-Bus, which gives it in microseconds since the epoch.
fn inactive_entered(c: &Container) -> SystemTime {
    // The test's own DBUS_SYSTEM_BUS_ADDRESS (a host path to the container's bus) means
    // nothing inside the container.
    let out = c.exec(&[
        "env",
        "-u",
        "DBUS_SYSTEM_BUS_ADDRESS",
        "busctl",
        "--system",
        "get-property",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1/unit/k3s_2eservice",
        "org.freedesktop.systemd1.Unit",
        "InactiveEnterTimestamp",
    ]);
    let us: u64 = out.trim().strip_prefix("t ").and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{out:?}"));
    SystemTime::UNIX_EPOCH + Duration::from_micros(us)
}

/// Boots a container and brings its k3s to control-plane (no restart on the way).
fn at_control_plane(name: &str, health_timeout: &str, extra: &str) -> (Container, SystemdActuator) {
    let c = Container::up(name);
    c.wait_healthy(Duration::from_secs(90));
    assert_eq!(c.record_text(), "full", "the hook recorded full at boot (no drop-in)");
    let mut a = common::systemd_actuator(&c.config(health_timeout, extra)).unwrap();
    block_on(a.apply_level(Level::ControlPlane, &Readiness::default())).unwrap();
    (c, a)
}

#[test]
fn steps_restart_k3s_only_between_etcd_only_and_the_rest() {
    if !enabled("steps_restart_k3s_only_between_etcd_only_and_the_rest") {
        return;
    }
    let c = Container::up("regrade-steps");
    c.wait_healthy(Duration::from_secs(90));
    let mut a = common::systemd_actuator(&c.config("25s", "")).unwrap();
    let ready = Readiness::default();
    assert_eq!(block_on(a.current_level()).unwrap(), Level::Full);

    // full -> control-plane: the drop-in untouched, k3s not restarted.
    let inv = c.k3s_prop("InvocationID");
    let starts = c.k3s_starts();
    block_on(a.apply_level(Level::ControlPlane, &ready)).unwrap();
    assert!(!c.dropin().exists());
    assert_eq!(c.k3s_prop("InvocationID"), inv, "k3s was not restarted");
    assert_eq!(c.k3s_starts(), starts);
    assert_eq!(c.record_text(), "control-plane");
    assert_eq!(block_on(a.current_level()).unwrap(), Level::ControlPlane);
    assert!(ready.0.borrow().is_empty());

    // control-plane -> etcd-only: exactly the level's flags, one restart, returns
    // only once etcd is healthy (the stand-in's /health answers 503 for 3 s).
    let (t0, wall0) = (Instant::now(), SystemTime::now());
    let log = Log::default();
    let took = {
        let w = log.clone();
        let sub = tracing_subscriber::fmt().with_writer(move || w.clone()).with_ansi(false).finish();
        let _g = tracing::subscriber::set_default(sub);
        block_on(a.apply_level(Level::EtcdOnly, &ready)).unwrap();
        t0.elapsed()
    };
    // The step's own share is measured from these two lines' times (docs/incident.md):
    // the drop-in written, then the restart requested, in that order.
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let at = |m: &str| text.find(m).unwrap_or_else(|| panic!("no {m:?} line in the step's log:\n{text}"));
    assert!(at("drop-in written") < at("restart requested"), "{text}");
    assert!(c.healthy(), "etcd is healthy when apply_level returns");
    assert!(took >= Duration::from_millis(2500), "returned after {took:?}, before the 3 s health delay");
    let text = std::fs::read_to_string(c.dropin()).unwrap();
    let body: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(body, ["disable-apiserver: true", "disable-controller-manager: true", "disable-scheduler: true"]);
    let inv2 = c.k3s_prop("InvocationID");
    assert_ne!(inv2, inv, "k3s was restarted");
    assert_eq!(c.k3s_starts_reaching(starts + 1), starts + 1, "exactly one restart");
    assert_eq!(c.record_text(), "etcd-only");
    assert_eq!(flag(&c, "disable-apiserver"), serde_json::json!(true), "k3s runs with the drop-in's flags");
    assert_eq!(ready.0.borrow().len(), 1, "the agent runs at etcd-only: readiness was waited for");
    assert!(ready.0.borrow()[0] >= wall0, "readiness counts from the restart");
    // ... and from after the old k3s stopped: its kubelet heartbeats until then.
    let stopped = inactive_entered(&c);
    assert!(
        ready.0.borrow()[0] >= stopped,
        "readiness counts from {:?}, before the old k3s stopped at {stopped:?}",
        ready.0.borrow()[0]
    );

    // Back up: etcd-only -> control-plane restarts once and removes the drop-in ...
    block_on(a.apply_level(Level::ControlPlane, &ready)).unwrap();
    assert!(c.healthy());
    assert!(!c.dropin().exists(), "the drop-in is gone");
    assert_ne!(c.k3s_prop("InvocationID"), inv2);
    assert_eq!(c.k3s_starts_reaching(starts + 2), starts + 2);
    assert_eq!(c.record_text(), "control-plane");
    assert_eq!(flag(&c, "disable-apiserver"), serde_json::json!(false));
    assert_eq!(ready.0.borrow().len(), 2);
    // ... and control-plane -> full does not restart.
    let inv3 = c.k3s_prop("InvocationID");
    block_on(a.apply_level(Level::Full, &ready)).unwrap();
    assert_eq!(c.k3s_prop("InvocationID"), inv3);
    assert_eq!(c.record_text(), "full");
    assert_eq!(block_on(a.current_level()).unwrap(), Level::Full);

    // An operator's restart of k3s at control-plane keeps the level on record: k3s
    // runs the same at full and control-plane.
    block_on(a.apply_level(Level::ControlPlane, &ready)).unwrap();
    let starts = c.k3s_starts();
    c.exec(&["systemctl", "restart", "--no-block", "k3s.service"]);
    // The event: systemd's line of the new start (not the old process still healthy).
    let t0 = std::time::Instant::now();
    while c.k3s_starts() == starts {
        assert!(t0.elapsed() < Duration::from_secs(60), "k3s.service did not start again");
        std::thread::sleep(Duration::from_millis(200));
    }
    c.wait_healthy(Duration::from_secs(60));
    assert_eq!(c.record_text(), "control-plane");
}

#[test]
fn health_that_never_comes_puts_the_previous_level_back() {
    if !enabled("health_that_never_comes_puts_the_previous_level_back") {
        return;
    }
    // etcd-only's flags point the stand-in's never-healthy knob at a file that exists:
    // it stays unhealthy at etcd-only only.
    let extra = "[levels.etcd-only.k3s]\ndisable-apiserver = true\ndisable-controller-manager = true\n\
                 disable-scheduler = true\nnever-healthy-file = \"/etc/rancher/k3s/never-healthy-at-etcd-only\"\n";
    // Long enough for the restoring restart to be healthy on a loaded 2-core machine (the
    // stand-in starts as k3s does; the Docker twin of this test missed 6 s in a CI run).
    let (c, mut a) = at_control_plane("regrade-unhealthy", "20s", extra);
    std::fs::write(c.etc().join("never-healthy-at-etcd-only"), "").unwrap();
    let starts = c.k3s_starts();
    let t0 = Instant::now();
    let e = format!("{:#}", block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap_err());
    eprintln!("error: {e}");
    assert!(t0.elapsed() >= Duration::from_secs(20), "gave up only after systemd.health_timeout");
    assert!(e.contains("was not healthy within systemd.health_timeout = 20s"), "{e}");
    assert!(e.contains("removed the drop-in") && e.contains("at level control-plane, which serves again"), "{e}");
    assert!(!c.dropin().exists(), "the previous (absent) drop-in is back");
    assert_eq!(c.k3s_starts_reaching(starts + 2), starts + 2, "restarted into etcd-only, then back");
    assert!(c.healthy());
    assert_eq!(c.record_text(), "control-plane");
    assert_eq!(block_on(a.current_level()).unwrap(), Level::ControlPlane);
    assert_eq!(flag(&c, "disable-apiserver"), serde_json::json!(false));
}

#[test]
fn a_unit_that_fails_to_start_puts_the_previous_level_back() {
    if !enabled("a_unit_that_fails_to_start_puts_the_previous_level_back") {
        return;
    }
    let (c, mut a) = at_control_plane("regrade-failstart", "25s", "");
    let knob = c.etc().join("standin-fail-next-start");

    // Down into etcd-only, the new start fails: back to control-plane (no drop-in).
    std::fs::write(&knob, "").unwrap();
    let starts = c.k3s_starts();
    let e = format!("{:#}", block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap_err());
    eprintln!("error: {e}");
    assert!(e.contains("k3s.service failed to start at level etcd-only"), "{e}");
    assert!(e.contains("at level control-plane, which serves again"), "{e}");
    assert!(!knob.exists(), "the stand-in consumed its knob");
    assert!(!c.dropin().exists());
    assert!(c.k3s_starts_reaching(starts + 2) >= starts + 2);
    assert!(c.healthy());
    assert_eq!(c.record_text(), "control-plane");

    // Up out of etcd-only, the new start fails: the etcd-only drop-in is put back as it was.
    block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap();
    let before = std::fs::read(c.dropin()).unwrap();
    std::fs::write(&knob, "").unwrap();
    let e = format!("{:#}", block_on(a.apply_level(Level::ControlPlane, &Readiness::default())).unwrap_err());
    eprintln!("error: {e}");
    assert!(e.contains("failed to start at level control-plane"), "{e}");
    assert!(e.contains("put the previous drop-in") && e.contains("at level etcd-only, which serves again"), "{e}");
    assert_eq!(std::fs::read(c.dropin()).unwrap(), before);
    assert!(c.healthy());
    assert_eq!(c.record_text(), "etcd-only");
    assert_eq!(flag(&c, "disable-apiserver"), serde_json::json!(true));
}

#[test]
fn a_drop_in_written_but_never_restarted_is_found_and_converged_on_the_running_k3s() {
    if !enabled("a_drop_in_written_but_never_restarted_is_found_and_converged_on_the_running_k3s") {
        return;
    }
    let (c, mut a) = at_control_plane("regrade-disagree", "25s", "");
    let cfg = c.config("25s", "");
    assert_eq!(block_on(a.disagreement()), None);

    // The daemon wrote etcd-only's drop-in and was killed before it restarted k3s.
    let text = dropin::render(&cfg.levels, Level::EtcdOnly).unwrap();
    dropin::put(&c.dropin(), Some(text.as_bytes())).unwrap();
    let inv = c.k3s_prop("InvocationID");
    let d = block_on(a.disagreement()).expect("a disagreement");
    assert!(d.contains("level etcd-only") && d.contains("runs at level control-plane"), "{d}");

    // `status` shows it.
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("regrade.toml");
    std::fs::write(&conf, c.config_text("25s", "")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_regrade"))
        .args(["--config", conf.to_str().unwrap(), "status", "--json"])
        .output()
        .unwrap();
    let status: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json: {e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(status["disagreement"].as_str().unwrap_or("").contains("etcd-only"), "{status}");
    assert_eq!(status["level"], "control-plane");

    // `status` says which static protections are in place, read over the real
    // systemd's D-Bus: none at first (OOMScoreAdjust=0, no system-reserved), then the
    // shipped files installed as the README says, after a daemon-reload and no restart.
    let finding = |status: &serde_json::Value, what: &str| {
        let all = status["protections"].as_array().unwrap_or_else(|| panic!("no protections: {status}")).clone();
        all.into_iter().find(|f| f["protection"] == what).unwrap_or_else(|| panic!("no {what} in {status}"))
    };
    let status_now = || -> serde_json::Value {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_regrade"))
            .args(["--config", conf.to_str().unwrap(), "status", "--json"])
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let oom = finding(&status, "OOM score");
    assert_eq!(oom["state"], "missing", "{oom}");
    assert!(oom["words"].as_str().unwrap().contains("OOMScoreAdjust=0"), "{oom}");
    assert_eq!(finding(&status, "reserved memory")["state"], "missing");
    let shipped = |p: &str| std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(p)).unwrap();
    let unit_dropin = shipped("packaging/systemd/k3s.service.d/40-regrade-protect.conf");
    c.exec(&[
        "sh",
        "-c",
        &format!(
            "mkdir -p /etc/systemd/system/k3s.service.d && cat > /etc/systemd/system/k3s.service.d/40-regrade-protect.conf <<'EOF'\n{unit_dropin}EOF\nsystemctl daemon-reload"
        ),
    ]);
    let reserved = c.dropin().with_file_name("40-regrade-reserved.yaml");
    std::fs::write(&reserved, shipped("packaging/k3s/40-regrade-reserved.yaml")).unwrap();
    assert_eq!(c.k3s_prop("MemoryLow"), (512u64 << 20).to_string(), "systemd took the shipped MemoryLow=");
    let status = status_now();
    let oom = finding(&status, "OOM score");
    assert_eq!(oom["state"], "in place", "{oom}");
    assert!(oom["words"].as_str().unwrap().contains("OOMScoreAdjust=-999"), "{oom}");
    assert_eq!(finding(&status, "reserved memory")["state"], "in place");
    // This host's memory controller is cgroup v1: said so, not "missing".
    if !std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").is_ok_and(|c| c.contains("memory")) {
        assert_eq!(finding(&status, "memory protection")["state"], "not on this host");
    }
    assert_eq!(c.k3s_prop("InvocationID"), inv, "installing the protections did not restart k3s");
    std::fs::remove_file(&reserved).unwrap();

    // watch's start-up call converges on the running k3s: the drop-in goes, no restart.
    block_on(a.reconcile(&Readiness::default())).unwrap();
    assert!(!c.dropin().exists());
    assert_eq!(c.k3s_prop("InvocationID"), inv, "k3s was not restarted");
    assert_eq!(block_on(a.disagreement()), None);
    assert_eq!(block_on(a.current_level()).unwrap(), Level::ControlPlane);

    // A hand-edited drop-in is a disagreement too, and converges the same way.
    std::fs::write(c.dropin(), "disable-apiserver: true\n").unwrap();
    let d = block_on(a.disagreement()).expect("a disagreement");
    assert!(d.contains("changed outside regrade"), "{d}");
    block_on(a.reconcile(&Readiness::default())).unwrap();
    assert!(!c.dropin().exists());
    assert_eq!(c.k3s_prop("InvocationID"), inv);
}
