//! Nothing of regrade's starts k3s (issue 59): the NixOS module's units, as the module
//! evaluates them (tests/nixos/eval-module.nix, with tests/nixos/minilib.nix), in the
//! test container's real systemd. With k3s stopped (an etcd snapshot restore needs it
//! stopped on every server): the credential unit started, its timer elapsing, its path
//! unit seeing `watch`'s note of a 401, `systemctl restart regrade.service` and a crash
//! of it (Restart=always) leave k3s stopped, with no job queued for it. Then the
//! suspicion settled: with the `Wants=k3s.service` the module had, the crash's automatic
//! restart starts k3s. Gated by REGRADE_TEST_SYSTEMD=1 (root; nix-instantiate).

use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::nspawn::{enabled, Container};
use serde_json::Value;

/// The module's units for an enabled server: `systemd.services`, the credential timer
/// and path unit.
fn module_units() -> Value {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("nix-instantiate")
        .args(["--eval", "--strict", "--json"])
        .arg(repo.join("tests/nixos/eval-module.nix"))
        .args(["--arg", "lib", &format!("import {}", repo.join("tests/nixos/minilib.nix").display())])
        .args(["--argstr", "tmp", &tmp.path().join("k3s").display().to_string()])
        .args(["--argstr", "example", "/nonexistent"])
        .args(["-A", "enabled"])
        .output()
        .expect("running nix-instantiate (apt-get install -y nix-bin)");
    assert!(out.status.success(), "nix-instantiate: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn list(v: &Value) -> String {
    v.as_array().map(|a| a.iter().map(|s| s.as_str().unwrap()).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

/// A service's dependencies exactly as the module gives them, and `service` as its
/// [Service] section.
fn service_unit(u: &Value, service: &str) -> String {
    format!(
        "[Unit]\nAfter={}\nWants={}\nBefore={}\nStartLimitIntervalSec=0\n\n[Service]\n{service}",
        list(&u["after"]),
        list(&u["wants"]),
        list(&u["before"])
    )
}

fn state(c: &Container, unit: &str, prop: &str) -> String {
    c.exec(&["systemctl", "show", "-P", prop, unit]).trim().to_string()
}

/// Waits until `unit` has run again (another invocation than `before`) and ended: with
/// k3s stopped it reaches no API server and fails, waiting to be tried again
/// (Restart=on-failure); then stops it, so the next start is the next one's doing.
fn wait_for_a_new_run(c: &Container, unit: &str, before: &str) {
    let t0 = Instant::now();
    loop {
        let id = state(c, unit, "InvocationID");
        let (active, sub) = (state(c, unit, "ActiveState"), state(c, unit, "SubState"));
        if !id.is_empty() && id != before && (active != "activating" || sub == "auto-restart") {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{unit} did not run again (InvocationID {id}, {active} {sub})");
        std::thread::sleep(Duration::from_millis(100));
    }
    c.exec(&["systemctl", "stop", unit]);
}

/// k3s is stopped, and no job would start it.
fn k3s_still_stopped(c: &Container, after: &str, starts: usize) {
    let jobs = c.exec(&["systemctl", "list-jobs", "--no-legend"]);
    let active = c.k3s_prop("ActiveState");
    println!("after {after}: k3s.service {active}; jobs: {:?}", jobs.trim());
    assert_eq!(active, "inactive", "after {after}, k3s.service is {active}");
    assert!(!jobs.contains("k3s.service"), "after {after}, a job for k3s.service: {jobs}");
    assert_eq!(c.k3s_starts(), starts, "after {after}, k3s.service started again");
}

/// Kills regrade.service's process as a crash would, and waits for Restart=always to
/// bring it back (its restart count reaching `n`).
fn crash_and_restart(c: &Container, n: u32) {
    // The main process only, as a crash: killing the whole cgroup failed once in CI
    // with EIO for "auxiliary processes" (there are none) and failed the test.
    c.exec(&["systemctl", "kill", "--kill-whom=main", "--signal=KILL", "regrade.service"]);
    let t0 = Instant::now();
    while state(c, "regrade.service", "NRestarts").parse::<u32>().unwrap_or(0) < n
        || state(c, "regrade.service", "ActiveState") != "active"
    {
        assert!(t0.elapsed() < Duration::from_secs(60), "regrade.service was not restarted");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn nothing_of_regrades_starts_a_stopped_k3s() {
    if !enabled("nothing_of_regrades_starts_a_stopped_k3s") {
        return;
    }
    let m = module_units();
    let units = &m["units"];
    let c = Container::up("regrade-cred-units");
    c.wait_healthy(Duration::from_secs(90));
    let root = Path::new(c.var("ROOT"));
    let system = root.join("etc/systemd/system");

    // The module's own command, with the container's regrade: it reads the module's
    // settings for the credential (a lifetime, its period) and, with k3s stopped,
    // reaches no API server.
    let exec = units["regrade-credentials"]["serviceConfig"]["ExecStart"].as_str().unwrap();
    let (_, args) = exec.split_once("/bin/regrade ").expect("the module runs regrade");
    let sc = &units["regrade-credentials"]["serviceConfig"];
    let credential = format!(
        "Type={}\nExecStart=/usr/local/bin/regrade {args}\nRestart={}\nRestartSec={}\nStateDirectory={}\n",
        sc["Type"].as_str().unwrap(),
        sc["Restart"].as_str().unwrap(),
        sc["RestartSec"].as_str().unwrap(),
        sc["StateDirectory"].as_str().unwrap()
    );
    std::fs::write(
        system.join("regrade-credentials.service"),
        service_unit(&units["regrade-credentials"], &credential),
    )
    .unwrap();
    // `watch` stands in as a process that stays up: what matters is the unit's
    // dependencies and its Restart=.
    let sc = &units["regrade"]["serviceConfig"];
    let watch = format!(
        "Type=simple\nExecStart=/bin/sleep infinity\nRestart={}\nRestartSec={}\n",
        sc["Restart"].as_str().unwrap(),
        sc["RestartSec"].as_str().unwrap()
    );
    std::fs::write(system.join("regrade.service"), service_unit(&units["regrade"], &watch)).unwrap();
    let timer = &m["credentialsTimer"]["timerConfig"];
    std::fs::write(
        system.join("regrade-credentials.timer"),
        format!(
            "[Timer]\nOnBootSec={}\nOnUnitActiveSec={}\n",
            timer["OnBootSec"].as_str().unwrap(),
            timer["OnUnitActiveSec"].as_str().unwrap()
        ),
    )
    .unwrap();
    // The test's own addition: the timer elapses a second after it is started.
    std::fs::create_dir_all(system.join("regrade-credentials.timer.d")).unwrap();
    std::fs::write(system.join("regrade-credentials.timer.d/soon.conf"), "[Timer]\nOnActiveSec=1s\nAccuracySec=1ms\n")
        .unwrap();
    let note = m["credentialsPath"]["pathConfig"]["PathChanged"].as_str().unwrap();
    std::fs::write(system.join("regrade-credentials.path"), format!("[Path]\nPathChanged={note}\n")).unwrap();
    let settings = &m["settings"];
    std::fs::create_dir_all(root.join("etc/regrade")).unwrap();
    std::fs::write(
        root.join("etc/regrade/regrade.toml"),
        format!(
            "[cluster]\nkubeconfig = {:?}\napi_servers = [\"https://127.0.0.1:9\"]\nrequest_timeout = \"2s\"\n\
             [credential]\nlifetime = {:?}\nrenew_period = {:?}\n",
            settings["cluster"]["kubeconfig"].as_str().unwrap(),
            settings["credential"]["lifetime"].as_str().unwrap(),
            settings["credential"]["renew_period"].as_str().unwrap(),
        ),
    )
    .unwrap();
    let admin = c.etc().join("k3s.yaml");
    if !admin.exists() {
        std::fs::write(
            &admin,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: k3s\n  cluster:\n    server: https://{}:16443\n    \
                 insecure-skip-tls-verify: true\ncontexts:\n- name: k3s\n  context:\n    cluster: k3s\n    user: admin\n\
                 current-context: k3s\nusers:\n- name: admin\n  user:\n    token: admin\n",
                c.var("ADDR")
            ),
        )
        .unwrap();
    }
    c.exec(&["systemctl", "daemon-reload"]);

    c.exec(&["systemctl", "stop", "k3s.service"]);
    let starts = c.k3s_starts();
    k3s_still_stopped(&c, "systemctl stop k3s", starts);

    // The credential unit, started as regrade.service's Wants= starts it.
    let before = state(&c, "regrade-credentials.service", "InvocationID");
    c.exec(&["systemctl", "start", "--no-block", "regrade-credentials.service"]);
    wait_for_a_new_run(&c, "regrade-credentials.service", &before);
    k3s_still_stopped(&c, "the credential unit", starts);
    let log = c.exec(&["journalctl", "-u", "regrade-credentials.service", "-o", "cat", "--no-pager"]);
    println!("--- regrade-credentials.service ---\n{log}");
    assert!(log.contains("regrade:") && log.contains("no Kubernetes API server answered"), "{log}");

    // Its timer elapsing.
    let before = state(&c, "regrade-credentials.service", "InvocationID");
    c.exec(&["systemctl", "start", "regrade-credentials.timer"]);
    wait_for_a_new_run(&c, "regrade-credentials.service", &before);
    k3s_still_stopped(&c, "the credential timer", starts);

    // Its path unit, seeing the note `watch` writes at a 401.
    c.exec(&["systemctl", "start", "regrade-credentials.path"]);
    let before = state(&c, "regrade-credentials.service", "InvocationID");
    c.exec(&["sh", "-c", &format!("mkdir -p $(dirname {note}) && echo '{{}}' > {note}")]);
    wait_for_a_new_run(&c, "regrade-credentials.service", &before);
    k3s_still_stopped(&c, "the path unit", starts);

    // regrade.service: started, restarted by hand, and crashed (Restart=always).
    c.exec(&["systemctl", "start", "regrade.service"]);
    c.exec(&["systemctl", "restart", "regrade.service"]);
    k3s_still_stopped(&c, "systemctl restart regrade.service", starts);
    crash_and_restart(&c, 1);
    k3s_still_stopped(&c, "regrade.service's automatic restart", starts);

    // The suspicion, settled: with the Wants= the module had, the same automatic
    // restart starts k3s.
    std::fs::create_dir_all(system.join("regrade.service.d")).unwrap();
    std::fs::write(system.join("regrade.service.d/old-wants.conf"), "[Unit]\nWants=k3s.service\n").unwrap();
    c.exec(&["systemctl", "daemon-reload"]);
    crash_and_restart(&c, 2);
    let started = c.k3s_starts_reaching(starts + 1);
    println!(
        "with Wants=k3s.service, regrade.service's automatic restart: k3s.service {} ({} starts, {starts} before)",
        c.k3s_prop("ActiveState"),
        started
    );
    assert_eq!(started, starts + 1, "Wants=k3s.service: the automatic restart did not start k3s");
}
