//! The kill-point matrix (issue 10): `regrade watch` SIGKILLed at each named point of a
//! step, in both directions (control-plane -> etcd-only and back, the steps that
//! restart k3s), against a real kube-apiserver with RBAC and a real systemd in nspawn
//! (tests/testsuite/common/level_rig.rs); then started again. Every cell must end converged —
//! the level record without a step under way, the Node's marks, the drop-in and k3s's
//! start record all at its level, the Lease free — at the step's `from` or its `to`,
//! never further (a poller watches the record and the Node's label all along).
//! Prints the matrix as a table.
//!
//! Built with the `docker` feature, the same matrix runs against the Docker actuator:
//! k3s is a container on the Docker rig's real dockerd (tests/testsuite/common/docker_k3s.rs),
//! regrade a `docker` build on the host. Each point is then met by two faults: the
//! SIGKILL alone, and the SIGKILL followed by a dockerd restart (which restarts the
//! k3s container through its restart policy, as it restarts a Compose project's
//! containers) before regrade starts again.
//!
//! Gated by REGRADE_TEST_KUBE=1 and REGRADE_TEST_SYSTEMD=1 (root); in a `docker`
//! build by REGRADE_TEST_KUBE=1 and REGRADE_TEST_DOCKER=1.

use crate::common;

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::level_rig::{stop, LevelRig, LABEL, NODE};
use regrade::kill_point::POINTS;

const CP: &str = "control-plane";
const EO: &str = "etcd-only";

/// What happens after regrade is killed at the point, before it starts again.
#[derive(Clone, Copy, PartialEq)]
enum Fault {
    Kill,
    /// A `docker` build: dockerd restarted too.
    #[cfg_attr(not(feature = "docker"), allow(dead_code))]
    KillAndDockerdRestart,
}

impl Fault {
    fn all() -> &'static [Fault] {
        if cfg!(feature = "docker") {
            &[Fault::Kill, Fault::KillAndDockerdRestart]
        } else {
            &[Fault::Kill]
        }
    }

    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "SIGKILL",
            Fault::KillAndDockerdRestart => "SIGKILL+dockerd",
        }
    }
}

struct Row {
    direction: String,
    fault: &'static str,
    point: &'static str,
    phase: String,
    decision: String,
    end: String,
    took: f64,
}

/// Watches the level record and the Node's label from another thread for the levels
/// they pass through.
struct Seen {
    stop: Arc<AtomicBool>,
    levels: Arc<Mutex<BTreeSet<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Seen {
    fn start(record: std::path::PathBuf, kubeconfig: std::path::PathBuf) -> Seen {
        let stop = Arc::new(AtomicBool::new(false));
        let levels = Arc::new(Mutex::new(BTreeSet::new()));
        let (s, l) = (stop.clone(), levels.clone());
        let thread = std::thread::spawn(move || {
            common::block_on(async move {
                let c = common::client_for(&kubeconfig).await;
                let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(c);
                while !s.load(Ordering::SeqCst) {
                    if let Ok(t) = std::fs::read_to_string(&record) {
                        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&t) {
                            if let Some(x) = v["level"].as_str() {
                                l.lock().unwrap().insert(format!("record {x}"));
                            }
                        }
                    }
                    if let Ok(n) = nodes.get(NODE).await {
                        let label = n.metadata.labels.and_then(|m| m.get(LABEL).cloned());
                        l.lock().unwrap().insert(format!("label {}", label.as_deref().unwrap_or("full")));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        });
        Seen { stop, levels, thread: Some(thread) }
    }

    fn finish(mut self) -> BTreeSet<String> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        let l = self.levels.lock().unwrap().clone();
        l
    }
}

/// The decision the restarted watch logged for the interrupted step.
fn decision(log: &str) -> String {
    for line in log.lines() {
        if let Some(i) = line.find("decision=") {
            let rest = &line[i + "decision=".len()..];
            let rest = rest.trim_start_matches('"');
            let end = rest.find(['"']).unwrap_or(rest.len());
            let d = &rest[..end];
            let word = d.split_whitespace().take(5).collect::<Vec<_>>().join(" ");
            return word;
        }
    }
    "?".into()
}

#[test]
fn kill_point_matrix() {
    let Some(rig) = LevelRig::up("kill_point_matrix", "regrade-killpoints") else { return };
    // Kept after the test (the temporary directory is not): each cell's two watches.
    let logs = std::env::temp_dir().join(if cfg!(feature = "docker") {
        "regrade-kill-points-docker"
    } else {
        "regrade-kill-points"
    });
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs).unwrap();

    // To control-plane by hand (no restart), the starting point of the first cell.
    let (ok, out, err) = rig.run(&["step", "to", CP]);
    assert!(ok, "step to control-plane: {out}{err}");
    rig.wait("converged at control-plane", Duration::from_secs(30), || (rig.converged().ok()? == CP).then_some(()));

    let mut rows = Vec::new();
    let t_all = Instant::now();
    for (from, to, psi) in [(CP, EO, 80.0), (EO, CP, 0.0)] {
        for (point, &fault) in POINTS.iter().flat_map(|p| Fault::all().iter().map(move |f| (*p, f))) {
            // Into position: the cell's `from`, converged.
            let here = rig.converged().unwrap_or_else(|e| panic!("before {from} -> {to} at {point}: {e}"));
            println!("[cell] {from} -> {to} at {point} ({}): starting from {here}", fault.name());
            if here != from {
                // The Lease may still name the killed watch: the hand step watches it
                // and takes it over once it has expired by its own clock.
                let (ok, out, err) = rig.run(&["step", "to", from]);
                assert!(ok, "step to {from}: {out}{err}");
                rig.wait(&format!("converged at {from}"), Duration::from_secs(60), || {
                    (rig.converged().ok()? == from).then_some(())
                });
            }
            let cell = format!("{from}->{to}@{point}{}", if fault == Fault::Kill { "" } else { "+dockerd" });
            let seen = Seen::start(rig.level_record(), rig.h.admin_kubeconfig.clone());
            let t0 = Instant::now();

            // 1. watch steps and is killed at the point.
            rig.pressure(psi);
            let log1 = logs.join(format!("{cell}.killed.log"));
            let mut w = rig.watch(Some(point), &log1);
            let status = rig.wait(&format!("{cell}: watch killed"), Duration::from_secs(90), || w.try_wait().unwrap());
            let log = std::fs::read_to_string(&log1).unwrap_or_default();
            assert_eq!(
                status.signal(),
                Some(libc::SIGKILL),
                "{cell}: watch was not killed at the point: {status}\n{log}"
            );
            rig.pressure(20.0); // neither over nor calm: no new step of its own
            let phase = rig
                .record()
                .map(|r| match r["step"]["phase"].as_str() {
                    Some(p) => p.to_string(),
                    None => format!("none ({})", r["level"].as_str().unwrap_or("?")),
                })
                .unwrap_or_else(|| "no record".into());
            #[cfg(feature = "docker")]
            if fault == Fault::KillAndDockerdRestart {
                rig.c.restart_dockerd();
            }

            // 2. started again: converges.
            let log2 = logs.join(format!("{cell}.restarted.log"));
            let mut w = rig.watch(None, &log2);
            let end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rig.wait(&format!("{cell}: converged after the restart"), Duration::from_secs(120), || {
                    rig.converged().ok()
                })
            }));
            stop(&mut w);
            let restarted = std::fs::read_to_string(&log2).unwrap_or_default();
            let end = end.unwrap_or_else(|p| {
                eprintln!("--- {cell}: killed watch ---\n{log}\n--- restarted watch ---\n{restarted}");
                eprintln!("state: {:?}, record {:?}", rig.converged(), rig.record());
                std::panic::resume_unwind(p)
            });
            let took = t0.elapsed().as_secs_f64();
            let levels = seen.finish();
            let allowed: BTreeSet<String> =
                [from, to].iter().flat_map(|l| [format!("record {l}"), format!("label {l}")]).collect();
            assert!(levels.is_subset(&allowed), "{cell}: passed through {levels:?}, beyond {from} and {to}");
            assert!(end == from || end == to, "{cell}: ended at {end}");
            println!(
                "[cell] {from} -> {to} killed at {point} ({}): record's phase {phase}, converged at {end} in {took:.1}s",
                fault.name()
            );
            rows.push(Row {
                direction: format!("{from} -> {to}"),
                fault: fault.name(),
                point,
                phase,
                decision: decision(&restarted),
                end,
                took,
            });
        }
    }

    let actuator = if cfg!(feature = "docker") { "docker" } else { "systemd" };
    println!(
        "\n== kill-point matrix ({actuator} actuator): regrade watch SIGKILLed at a point of a step, then started again =="
    );
    println!(
        "{:<28} {:<22} {:<16} {:<26} {:<34} {:<14} {:>6}",
        "step", "killed at", "fault", "record's phase then", "decision at restart", "converged at", "took"
    );
    for r in &rows {
        println!(
            "{:<28} {:<22} {:<16} {:<26} {:<34} {:<14} {:>5.1}s",
            r.direction, r.point, r.fault, r.phase, r.decision, r.end, r.took
        );
    }
    println!(
        "every cell: record without a step, Node marks = {} = start record = record's level, Lease free, \
         no level outside the step's two; {} cells in {:.0}s",
        if cfg!(feature = "docker") { "level file" } else { "drop-in" },
        rows.len(),
        t_all.elapsed().as_secs_f64()
    );
}
