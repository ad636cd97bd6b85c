//! A step whose flags k3s would not run with is refused before anything changes (issue
//! 58), against a real systemd and D-Bus: the systemd tests' container
//! (tests/nspawn/), its k3s.service running the k3s stand-in. An operator's file read
//! after regrade's drop-in, or the unit's own command line, that turns etcd-only's
//! `disable-apiserver` back off: the step into etcd-only names the file (or the command
//! line) and the key, writes no drop-in and restarts nothing. Was: the old check read
//! only top-level keys of the files after regrade's by a case-insensitive name order,
//! and `record-start` would then have recorded etcd-only for a k3s serving its API.
//! Gated by REGRADE_TEST_SYSTEMD=1 (root).

use crate::common;

use std::time::Duration;

use common::nspawn::{enabled, Container};
use common::Readiness;
use regrade::actuator::Actuator;
use regrade::level::Level;

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
}

#[test]
fn a_step_into_etcd_only_that_another_file_or_the_command_line_overrides_is_refused_before_any_change() {
    if !enabled("a_step_into_etcd_only_that_another_file_or_the_command_line_overrides_is_refused_before_any_change") {
        return;
    }
    let c = Container::up("regrade-overrides");
    c.wait_healthy(Duration::from_secs(90));
    let mut a = common::systemd_actuator(&c.config("25s", "")).unwrap();
    let (starts, invocation) = (c.k3s_starts(), c.k3s_prop("InvocationID"));

    // An operator's drop-in, read after regrade's 50-regrade.yaml.
    let site = c.etc().join("config.yaml.d/90-site.yaml");
    std::fs::write(&site, "disable-apiserver: false\n").unwrap();
    let e = format!("{:#}", block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap_err());
    assert!(e.contains("nothing was changed"), "{e}");
    assert!(e.contains(&site.display().to_string()) && e.contains("disable-apiserver"), "{e}");
    assert!(!c.dropin().exists(), "no drop-in written");
    assert_eq!((c.k3s_starts(), c.k3s_prop("InvocationID")), (starts, invocation.clone()), "k3s not restarted");
    assert_eq!(c.record_text(), "full");

    // The same from the unit's command line (systemd's ExecStart, after a daemon-reload).
    std::fs::remove_file(&site).unwrap();
    let exec = c.k3s_prop("ExecStart");
    let argv = exec.split("argv[]=").nth(1).and_then(|r| r.split(" ;").next()).unwrap().trim().to_string();
    c.exec(&[
        "sh",
        "-c",
        &format!(
            "mkdir -p /run/systemd/system/k3s.service.d && printf '[Service]\\nExecStart=\\nExecStart=%s --disable-apiserver=false\\n' '{argv}' \
             > /run/systemd/system/k3s.service.d/90-site.conf && systemctl daemon-reload"
        ),
    ]);
    let e = format!("{:#}", block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap_err());
    assert!(e.contains("k3s's command line sets disable-apiserver") && e.contains("nothing was changed"), "{e}");
    assert!(!c.dropin().exists(), "no drop-in written");
    assert_eq!((c.k3s_starts(), c.k3s_prop("InvocationID")), (starts, invocation.clone()), "k3s not restarted");

    // Without the override the same step goes through.
    c.exec(&["sh", "-c", "rm /run/systemd/system/k3s.service.d/90-site.conf && systemctl daemon-reload"]);
    block_on(a.apply_level(Level::EtcdOnly, &Readiness::default())).unwrap();
    assert_eq!(c.record_text(), "etcd-only");
}
