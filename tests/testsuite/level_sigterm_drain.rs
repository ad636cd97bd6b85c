//! SIGTERM while a step's drain waits for a pod to go (issues 10 and 13): the
//! step control-plane -> etcd-only drains before it restarts k3s, so a signal during
//! the drain must end the step at once with k3s not restarted and the Node's marks
//! back at control-plane — in `regrade watch` and in a step by hand alike. Against a
//! real kube-apiserver with RBAC and a real systemd in nspawn (tests/testsuite/common/level_rig.rs).
//!
//! The pod that does not go: a Pod bound to the rig's Node. The eviction is accepted,
//! but no kubelet runs on that Node to finish the graceful deletion, so the pod stays
//! terminating and the drain waits for it (up to `drain_timeout`, 2 min), as it waits
//! for a slow pod's grace period on a real server.
//!
//! Gated by REGRADE_TEST_KUBE=1 and REGRADE_TEST_SYSTEMD=1 (root).
// The systemd actuator's: a `docker` build drives another actuator.
#![cfg(not(feature = "docker"))]

use crate::common;

use std::time::{Duration, Instant};

use common::level_rig::{stop, LevelRig};

const CP: &str = "control-plane";

/// Waits until the drain into etcd-only, run by `pid` (logging to `log`), is waiting
/// for the pod to go.
fn drain_blocked(rig: &LevelRig, pid: u32, log: &std::path::Path) {
    let t0 = Instant::now();
    loop {
        let d = rig.drain();
        if let Some(d) = &d {
            let waiting = d["report"]["waiting"].as_array().is_some_and(|w| !w.is_empty());
            if d["running"] == true && d["level"] == "etcd-only" && d["pid"] == pid && waiting {
                return;
            }
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            panic!("no drain into etcd-only waiting for the pod within 60 s; drain.json: {d:?}\n{text}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn sigterm_during_the_drain_ends_the_step_before_the_restart() {
    let Some(rig) = LevelRig::up("sigterm_during_the_drain_ends_the_step_before_the_restart", "regrade-sigterm") else {
        return;
    };
    let (ok, out, err) = rig.run(&["step", "to", CP]);
    assert!(ok, "step to control-plane: {out}{err}");
    rig.wait("converged at control-plane", Duration::from_secs(30), || (rig.converged().ok()? == CP).then_some(()));

    // The pod: bound to the Node, run by no kubelet.
    let _ = std::process::Command::new(rig.h.bin_dir.join("kubectl"))
        .arg("--kubeconfig")
        .arg(&rig.h.admin_kubeconfig)
        .args(["create", "serviceaccount", "default", "-n", "default"])
        .output();
    let objects = rig.dir.path().join("held.json");
    std::fs::write(
        &objects,
        serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "held", "namespace": "default", "labels": {"app": "held"}},
             "spec": {"nodeName": common::level_rig::NODE, "automountServiceAccountToken": false,
                      "containers": [{"name": "main", "image": "example.invalid/held:1"}]}},
        ]})
        .to_string(),
    )
    .unwrap();
    rig.h.kubectl(&["apply", "-f", objects.to_str().unwrap()]);
    let starts = rig.c.k3s_starts();

    // 1. watch: pressure steps it towards etcd-only; SIGTERM while the drain waits.
    rig.pressure(80.0);
    let log = rig.dir.path().join("watch.log");
    let mut w = rig.watch(None, &log);
    drain_blocked(&rig, w.id(), &log);
    rig.pressure(20.0);
    let t0 = Instant::now();
    stop(&mut w);
    let took = t0.elapsed();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(took < Duration::from_secs(10), "watch took {took:?} to stop:\n{text}");
    assert!(text.contains("stopped by a signal while draining"), "{text}");
    let end = rig.wait("converged after the SIGTERM", Duration::from_secs(30), || rig.converged().ok());
    assert_eq!(end, CP, "the step did not happen");
    assert_eq!(rig.c.k3s_starts(), starts, "k3s was not restarted");
    let d = rig.drain().unwrap();
    assert!(d["running"] == false && d["report"]["interrupted"] == true, "{d}");
    println!("watch: SIGTERM during the drain: stopped in {took:?}, converged at {end}, k3s not restarted");

    // 2. By hand: the same, through `regrade step to etcd-only`.
    let log = rig.dir.path().join("hand.log");
    let mut hand = rig.spawn(&["step", "to", "etcd-only"], &log);
    drain_blocked(&rig, hand.id(), &log);
    let t0 = Instant::now();
    stop(&mut hand);
    let took = t0.elapsed();
    let status = hand.wait().unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "the interrupted hand step exited 0:\n{text}");
    assert!(took < Duration::from_secs(10), "the hand step took {took:?} to stop:\n{text}");
    assert!(text.contains("stopped by a signal while draining"), "{text}");
    let end = rig.wait("converged after the SIGTERM", Duration::from_secs(30), || rig.converged().ok());
    assert_eq!(end, CP);
    assert_eq!(rig.c.k3s_starts(), starts, "k3s was not restarted");
    println!("step by hand: SIGTERM during the drain: stopped in {took:?}, exit {status}, converged at {end}");
}
