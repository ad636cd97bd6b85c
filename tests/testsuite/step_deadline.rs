//! A whole step against a systemd that wedges mid-restart: the step runner with the
//! real Lease, Node and Events of a kube-apiserver (RBAC of deploy/rbac.yaml), and the
//! systemd actuator on a private bus whose "systemd" answers until it is asked to
//! restart k3s and then never again (tests/testsuite/common/private_bus.rs). Every call is
//! bounded, but a step made of bounded calls can still take minutes; the step's
//! deadline (`levels.step_timeout`) cuts it short and rolls it back: the drop-in
//! restored, a restart back asked for, the marks back, the level record settled, the
//! Lease released, an Event.
//! Gated by REGRADE_TEST_KUBE=1 and REGRADE_TEST_SYSTEMD=1.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node};
use kube::api::ListParams;
use kube::Api;
use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use regrade::level_keeper::Keeper;
use regrade::level_record::LevelRecord;
use regrade::step::{self, Outcome};
use regrade::units::HumanDuration;

use common::private_bus::{private_bus, stalling_systemd};
use common::{block_on, Kubelet};

const NODE: &str = "deadline-1";

#[test]
fn a_step_wedged_mid_restart_ends_at_its_deadline_rolled_back() {
    if std::env::var("REGRADE_TEST_SYSTEMD").as_deref() != Ok("1") {
        eprintln!("skipped: set REGRADE_TEST_SYSTEMD=1 (and REGRADE_TEST_KUBE=1)");
        return;
    }
    let Some(h) = common::start("a_step_wedged_mid_restart_ends_at_its_deadline_rolled_back") else { return };
    let sa = h.unbound_server_credential(NODE);
    let dir = tempfile::tempdir().unwrap();
    let (_bus, address) = private_bus(dir.path());
    let restarts = stalling_systemd(&address);
    // The process's system bus is this test's while it runs (tests share the process).
    let _bus = common::nspawn::system_bus();
    std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", &address);

    let mut cfg = h.config(&sa, NODE, "regrade");
    cfg.levels.step_timeout = HumanDuration(Duration::from_secs(4));
    cfg.levels.control_plane.drain = false;
    cfg.levels.etcd_only.drain = false;
    cfg.systemd.dropin = dir.path().join("config.yaml.d/50-regrade.yaml");
    cfg.systemd.record = dir.path().join("started-level");
    cfg.systemd.etcd_health_url = "http://127.0.0.1:9/health".into();
    cfg.systemd.call_timeout = HumanDuration(Duration::from_secs(10));
    // The deadline must exceed the step's own waits at their bounds (check-config's
    // rule: a failed restart and its undoing, 3 s here); the wedge is in the D-Bus
    // calls, which call_timeout bounds, not these.
    cfg.systemd.health_timeout = HumanDuration(Duration::from_secs(1));
    cfg.systemd.ready_timeout = HumanDuration(Duration::from_millis(500));
    cfg.etcd.catch_up_timeout = HumanDuration(Duration::from_secs(1));
    cfg.validate().unwrap();
    std::fs::create_dir_all(cfg.systemd.dropin.parent().unwrap()).unwrap();
    std::fs::write(&cfg.systemd.record, "control-plane\n").unwrap();
    let record_path = dir.path().join("level.json");
    let keeper = Keeper::new(
        Some(record_path.clone()),
        LevelRecord::at(Level::ControlPlane, Default::default()),
        Default::default(),
    );
    let down = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };

    block_on(async {
        let admin = h.admin().await;
        common::create_server_node(&admin, &Kubelet::ready(NODE)).await;
        let c = common::kube_cluster(&cfg).unwrap();
        c.mark_node(Level::ControlPlane, &cfg.levels).await.unwrap();
        let mut k3s = common::systemd_actuator(&cfg).unwrap();

        let t0 = Instant::now();
        let out = step::run(
            &down,
            &mut k3s,
            &c,
            &regrade::etcd::NoRestartGate,
            &cfg.levels,
            &keeper,
            &regrade::own_time::StepClock::start(),
        )
        .await;
        let took = t0.elapsed();
        println!("the step ended after {took:.1?}: {out:?}");

        let Outcome::Failed { level, error } = &out else { panic!("{out:?}") };
        assert_eq!(*level, Level::ControlPlane);
        let e = format!("{error:#}");
        assert!(e.contains("levels.step_timeout = 4s") && e.contains("phase restarting"), "{e}");
        assert!(e.contains("rolled back to control-plane"), "{e}");
        // The step's RestartUnit, then the rollback's: both went to the wedged systemd.
        assert_eq!(restarts.load(Ordering::SeqCst), 2);
        // The deadline (4 s), then the rollback: its RestartUnit unanswered for one
        // call_timeout (10 s), and the wait to see the restart begun, which a wedged
        // systemd ends at one call_timeout too (issue 55). Without the deadline the
        // actuator's own bounds run on: that RestartUnit, three tries of each read,
        // the restore — over a minute.
        assert!(took < Duration::from_secs(30), "took {took:?}");

        // The end state: drop-in of control-plane (none), record settled, marks of
        // control-plane, Lease free, an Event saying why.
        assert!(!cfg.systemd.dropin.exists(), "the etcd-only drop-in was taken back");
        let rec = LevelRecord::read(&record_path).unwrap().unwrap();
        assert_eq!((rec.level, rec.step), (Level::ControlPlane, None));
        let node = Api::<Node>::all(admin.clone()).get(NODE).await.unwrap();
        let label = node.metadata.labels.unwrap_or_default().get("regrade.dev/level").cloned();
        assert_eq!(label.as_deref(), Some("control-plane"));
        let lease = Api::<Lease>::namespaced(admin.clone(), "kube-system").get("regrade").await.unwrap();
        let holder = lease.spec.and_then(|s| s.holder_identity).unwrap_or_default();
        assert_eq!(holder, "", "the Lease was released");
        let lp = ListParams::default().fields(&format!("involvedObject.name={NODE}"));
        let evs = Api::<Event>::namespaced(admin.clone(), "default").list(&lp).await.unwrap().items;
        let failed: Vec<_> = evs
            .iter()
            .filter(|e| e.reason.as_deref() == Some("RegradeStepFailed"))
            .map(|e| e.message.clone().unwrap_or_default())
            .collect();
        assert_eq!(failed.len(), 1, "{evs:?}");
        assert!(failed[0].contains("levels.step_timeout"), "{}", failed[0]);
        println!("event: {}", failed[0]);
    });
}
