//! `regrade status` and `regrade record-start` read k3s's configuration as k3s builds it
//! (issue 58), run as an operator and systemd run them, on fixture files: no cluster, no
//! root, no systemd (the bus address points nowhere, so the files alone are read).
//!
//! The review's proof: a site's `90-site.yaml` with a plain `kubelet-arg: [max-pods=50]`
//! replaces every earlier `kubelet-arg`, regrade's reservation in
//! `40-regrade-reserved.yaml` with it, so the kubelet reserves nothing; `status` said
//! "in place", naming regrade's file.

use std::path::Path;
use std::process::{Command, Output};

use crate::fixture;

fn status(dir: &Path, json: bool) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_regrade"));
    c.arg("--config").arg(dir.join("regrade.toml")).arg("status");
    if json {
        c.arg("--json");
    }
    c.env("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent/regrade-test-bus").env_remove("NOTIFY_SOCKET");
    c.output().unwrap()
}

/// The `reserved memory` finding of `status --json`.
fn reserved(dir: &Path) -> serde_json::Value {
    let out = status(dir, true);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let found = v["protections"].as_array().unwrap().iter().find(|p| p["protection"] == "reserved memory").cloned();
    found.unwrap_or_else(|| panic!("no reserved memory finding: {v}"))
}

#[test]
fn a_site_file_that_drops_regrades_reservation_is_named_as_shadowing_it() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    fixture::write_pressure(dir, fixture::CALM_PSI, 4_000_000);
    fixture::config(dir, "", "");
    let dropins = dir.join("config.yaml.d");
    std::fs::create_dir(&dropins).unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/k3s/40-regrade-reserved.yaml");
    std::fs::copy(shipped, dropins.join("40-regrade-reserved.yaml")).unwrap();

    let alone = reserved(dir);
    assert_eq!(alone["state"], "in place", "{alone}");
    assert_eq!(alone["value"], "768Mi", "{alone}");
    assert!(alone["source"].as_str().unwrap().ends_with("40-regrade-reserved.yaml"), "{alone}");

    std::fs::write(dropins.join("90-site.yaml"), "kubelet-arg: [max-pods=50]\n").unwrap();
    let shadowed = reserved(dir);
    assert_eq!(shadowed["state"], "shadowed", "{shadowed}");
    let site = dropins.join("90-site.yaml").display().to_string();
    assert_eq!(shadowed["shadowed_by"], site.as_str(), "{shadowed}");
    assert!(shadowed["words"].as_str().unwrap().contains(&site), "{shadowed}");
    let plain = String::from_utf8_lossy(&status(dir, false).stdout).into_owned();
    let line = plain.lines().find(|l| l.contains("reserved memory: ")).unwrap_or_default();
    assert!(line.contains("SHADOWED") && line.contains("90-site.yaml"), "{plain}");

    // The site file appends: regrade's reservation stands.
    std::fs::write(dropins.join("90-site.yaml"), "kubelet-arg+: [max-pods=50]\n").unwrap();
    assert_eq!(reserved(dir)["state"], "in place");
    // Renamed away, regrade's file is not read; a comment naming the flag sets nothing.
    std::fs::rename(dropins.join("40-regrade-reserved.yaml"), dropins.join("40-regrade-reserved.yaml.disabled"))
        .unwrap();
    std::fs::write(dir.join("config.yaml"), "# kubelet-arg: [system-reserved=memory=1Gi]\n").unwrap();
    assert_eq!(reserved(dir)["state"], "missing");
}

#[test]
fn regrades_smaller_reservation_after_an_operators_larger_one_is_said_to_lower_it() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    fixture::write_pressure(dir, fixture::CALM_PSI, 4_000_000);
    fixture::config(dir, "", "");
    let dropins = dir.join("config.yaml.d");
    std::fs::create_dir(&dropins).unwrap();
    std::fs::write(dir.join("config.yaml"), "kubelet-arg:\n  - system-reserved=memory=2Gi\n").unwrap();
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/k3s/40-regrade-reserved.yaml");
    std::fs::copy(shipped, dropins.join("40-regrade-reserved.yaml")).unwrap();
    let lowered = reserved(dir);
    assert_eq!(lowered["state"], "lowered", "{lowered}");
    assert_eq!(lowered["value"], "768Mi", "the kubelet keeps the last value: {lowered}");
    let words = lowered["words"].as_str().unwrap();
    assert!(words.contains("2Gi") && words.contains(&dir.join("config.yaml").display().to_string()), "{lowered}");
    // Without regrade's file the operator's 2Gi is in force.
    std::fs::remove_file(dropins.join("40-regrade-reserved.yaml")).unwrap();
    let own = reserved(dir);
    assert_eq!((own["state"].as_str(), own["value"].as_str()), (Some("in place"), Some("2Gi")), "{own}");
}

/// `record-start`: the level k3s starts at is the one its effective flags say, not the
/// one regrade's drop-in names. Was: the drop-in alone was read.
#[test]
fn record_start_records_the_level_k3s_flags_say() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    let dropins = dir.join("config.yaml.d");
    std::fs::create_dir(&dropins).unwrap();
    let record = dir.join("started-level");
    let conf = dir.join("regrade.toml");
    let level_record = dir.join("level.json");
    std::fs::write(
        &conf,
        format!(
            "level_record = {level_record:?}\n[systemd]\ndropin = {:?}\nrecord = {record:?}\n",
            dropins.join("50-regrade.yaml")
        ),
    )
    .unwrap();
    let record_start = || {
        let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
            .args(["--config", conf.to_str().unwrap(), "record-start"])
            .env("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent/regrade-test-bus")
            .env_remove("JOURNAL_STREAM")
            .env_remove("K3S_CONFIG_FILE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        (std::fs::read_to_string(&record).unwrap().trim().to_string(), stderr)
    };
    assert_eq!(record_start().0, "full");
    // No drop-in of regrade's, but the operator's config.yaml runs k3s without its API
    // server, controller-manager and scheduler: etcd-only's flags.
    std::fs::write(
        dir.join("config.yaml"),
        "disable-apiserver: true\ndisable-controller-manager: yes\ndisable-scheduler: true\n",
    )
    .unwrap();
    assert_eq!(record_start().0, "etcd-only");
    // The same file under another name k3s does not read: full.
    std::fs::rename(dir.join("config.yaml"), dir.join("config.yaml.bak")).unwrap();
    assert_eq!(record_start().0, "full");
    // With K3S_CONFIG_FILE in the unit's environment (the hook's own), that file is read.
    let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .args(["--config", conf.to_str().unwrap(), "record-start"])
        .env("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent/regrade-test-bus")
        .env("K3S_CONFIG_FILE", dir.join("config.yaml.bak"))
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(std::fs::read_to_string(&record).unwrap().trim(), "etcd-only");
    // regrade's etcd-only drop-in with a later file turning the API server back on: no
    // level's flags hold; the nearest is recorded and the override named.
    std::fs::remove_file(dir.join("config.yaml.bak")).unwrap();
    let etcd_only = "# regrade-level: etcd-only\ndisable-apiserver: true\ndisable-controller-manager: true\ndisable-scheduler: true\n";
    std::fs::write(dropins.join("50-regrade.yaml"), etcd_only).unwrap();
    std::fs::write(dropins.join("90-site.yaml"), "disable-apiserver: false\n").unwrap();
    let (level, stderr) = record_start();
    assert_eq!(level, "etcd-only");
    assert!(stderr.contains("90-site.yaml sets disable-apiserver") && stderr.contains("no regrade level"), "{stderr}");
}
