//! Reboots (issue 10, scenarios 1 and 2): the nspawn container rebooted — systemd
//! powers it off, /run is gone, it boots again from the same disk — at control-plane
//! and at etcd-only, with every API endpoint down at boot (regrade's API goes through a
//! proxy that answers nothing) and back later. Then `regrade status`, `regrade step to
//! full` and `regrade watch` must each do the right thing: say the level the server
//! is held at, refuse rather than claim `full`, carry on from it; and once the API is
//! back, `step to full` takes the server back up and the Node's marks go.
//!
//! Gated by REGRADE_TEST_KUBE=1 and REGRADE_TEST_SYSTEMD=1 (root).
// The systemd actuator's: a `docker` build drives another actuator.
#![cfg(not(feature = "docker"))]

use crate::common;

use std::time::{Duration, Instant};

use common::level_rig::{stop, LevelRig};

#[test]
fn reboot_at_control_plane_and_at_etcd_only() {
    let Some(mut rig) = LevelRig::up("reboot_at_control_plane_and_at_etcd_only", "regrade-reboot") else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let proxy = rt.block_on(common::lost_reply::start(&rig.h.server, &rig.h.dir.join("pki")));
    let sa = rig.sa_kubeconfig();
    rig.write_config(&sa, Some(&proxy.url));
    let logs = rig.dir.path().to_path_buf();

    for level in ["control-plane", "etcd-only"] {
        let t0 = Instant::now();
        let phase = |what: &str| println!("[{level} {:>5.1}s] {what}", t0.elapsed().as_secs_f64());
        let (ok, out, err) = rig.run(&["step", "to", level]);
        assert!(ok, "step to {level}: {out}{err}");
        rig.wait(&format!("converged at {level}"), Duration::from_secs(60), || {
            (rig.converged().ok()? == level).then_some(())
        });
        phase("stepped there by hand; converged");

        proxy.knobs.set_down(true);
        rig.c.reboot();
        rig.c.wait_healthy(Duration::from_secs(90));
        let started = rig.c.record_text();
        let eo = level == "etcd-only";
        assert_eq!(started == "etcd-only", eo, "k3s started with the level's flags after the reboot: {started}");
        assert_eq!(started, level, "record-start recorded the level on record, not what the drop-in alone says");
        phase("container rebooted, /run emptied; every API endpoint down");

        // status: the level on record, the Node unknown, what regrade will do.
        let (ok, out, err) = rig.run(&["status", "--json"]);
        assert!(ok, "status: {err}");
        let st: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(st["level"], level, "{st}");
        let will = st["will_do"].as_str().unwrap_or_default().to_string();
        assert!(will.contains("marks"), "status says what regrade will do about the unread Node: {st}");
        phase(&format!("status: level {level}; will do: {will}"));

        // step to full: refused while nothing answers, never "at full".
        let (ok, out, err) = rig.run(&["step", "to", "full"]);
        assert!(!ok, "step to full with the API down succeeded: {out}{err}");
        assert!(!out.contains("at full"), "{out}");
        assert_eq!(rig.record().unwrap()["level"], level);
        phase(&format!("step to full with the API down: refused ({})", err.trim().lines().last().unwrap_or("")));

        // watch starts at the level on record, and holds it; when the API is back the
        // Node's marks are read (and agree), and nothing else changes.
        let log = logs.join(format!("watch-{level}.log"));
        let mut w = rig.watch(None, &log);
        // The event: watch's start line (it names the level it starts from).
        let started = || {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.lines().find(|l| l.contains("regrade watch starting")).map(str::to_string)
        };
        let line = rig.wait("watch's start line", Duration::from_secs(30), started);
        assert!(line.contains(&format!("level={level}")), "watch did not start at {level}: {line}");
        assert_eq!(rig.record().unwrap()["level"], level);
        proxy.knobs.set_down(false);
        let converged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rig.wait("converged with the API back", Duration::from_secs(60), || rig.converged().ok())
        }));
        stop(&mut w);
        let got = converged.unwrap_or_else(|p| {
            eprintln!("--- watch ---\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            std::panic::resume_unwind(p)
        });
        assert_eq!(got, level);
        phase("watch carried on from it with the API down, and held it once the API was back");

        let (ok, out, err) = rig.run(&["step", "to", "full"]);
        assert!(ok, "step to full with the API back: {out}{err}");
        rig.wait("converged at full", Duration::from_secs(60), || (rig.converged().ok()? == "full").then_some(()));
        phase("step to full with the API back: at full, the Node's marks gone");
    }
}
