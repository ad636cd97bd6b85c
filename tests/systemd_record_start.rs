//! `regrade record-start`, the ExecStartPre hook of k3s.service, run as a process:
//! it records the level the drop-in names and never fails, whatever the drop-in.

use std::path::{Path, PathBuf};
use std::process::Command;

use regrade::actuator::systemd::dropin;
use regrade::config::Config;
use regrade::level::Level;
use regrade::level_record::LevelRecord;

struct Host {
    _dir: tempfile::TempDir,
    conf: PathBuf,
    dropin: PathBuf,
    record: PathBuf,
    level_record: PathBuf,
}

/// Every path the hook reads or writes is away from its default (which, on a test
/// machine, is absent or someone else's).
fn host() -> Host {
    let dir = tempfile::tempdir().unwrap();
    let dropin = dir.path().join("k3s/config.yaml.d/50-regrade.yaml");
    let record = dir.path().join("run/regrade/started-level");
    let level_record = dir.path().join("srv/regrade/level.json");
    let conf = dir.path().join("regrade.toml");
    std::fs::write(
        &conf,
        format!("level_record = {level_record:?}\n[systemd]\ndropin = {dropin:?}\nrecord = {record:?}\n"),
    )
    .unwrap();
    Host { _dir: dir, conf, dropin, record, level_record }
}

/// Runs the hook; its stderr. Asserts it succeeded.
fn record_start(h: &Host) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .args(["--config", h.conf.to_str().unwrap(), "record-start"])
        .env_remove("JOURNAL_STREAM")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "record-start failed: {stderr}");
    stderr
}

fn recorded(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap().trim().to_string()
}

fn write_level(h: &Host, level: Level) {
    let text = dropin::render(&Config::default().levels, level).unwrap();
    dropin::put(&h.dropin, Some(text.as_bytes())).unwrap();
}

#[test]
fn a_broken_regrade_config_still_records_with_the_sections_that_parse() {
    let h = host();
    write_level(&h, Level::EtcdOnly);
    let good = std::fs::read_to_string(&h.conf).unwrap();
    // A misspelt key elsewhere: `watch` would refuse this file, the hook must not.
    std::fs::write(&h.conf, format!("{good}[pressure]\ntreshold = 20\n")).unwrap();
    let err = record_start(&h);
    assert_eq!(recorded(&h.record), "etcd-only", "{err}");
}

#[test]
fn records_the_level_the_drop_in_names() {
    let h = host();
    record_start(&h);
    assert_eq!(recorded(&h.record), "full", "no drop-in: full");
    write_level(&h, Level::EtcdOnly);
    record_start(&h);
    assert_eq!(recorded(&h.record), "etcd-only");
}

#[test]
fn a_level_with_the_same_flags_survives_a_restart() {
    let h = host();
    std::fs::create_dir_all(h.record.parent().unwrap()).unwrap();
    std::fs::write(&h.record, "control-plane\n").unwrap();
    record_start(&h);
    assert_eq!(recorded(&h.record), "control-plane", "k3s runs the same at full and control-plane");
    write_level(&h, Level::EtcdOnly);
    record_start(&h);
    assert_eq!(recorded(&h.record), "etcd-only");
}

#[test]
fn an_unreadable_drop_in_is_recorded_as_full_with_the_reason() {
    let h = host();
    std::fs::create_dir_all(&h.dropin).unwrap(); // a directory where the file should be
    let stderr = record_start(&h);
    assert_eq!(recorded(&h.record), "full");
    assert!(stderr.contains("50-regrade.yaml") && stderr.contains("recording full"), "{stderr}");
}

#[test]
fn a_hand_edited_drop_in_records_the_level_it_names_or_full() {
    let h = host();
    write_level(&h, Level::EtcdOnly);
    let edited = std::fs::read_to_string(&h.dropin).unwrap() + "kubelet-arg: [\"max-pods=5\"]\n";
    std::fs::write(&h.dropin, edited).unwrap();
    let stderr = record_start(&h);
    assert_eq!(recorded(&h.record), "etcd-only");
    assert!(stderr.contains("edited"), "{stderr}");
    std::fs::write(&h.dropin, "disable-apiserver: true\n").unwrap();
    let stderr = record_start(&h);
    assert_eq!(recorded(&h.record), "full");
    assert!(stderr.contains("names no regrade level"), "{stderr}");
}

#[test]
fn a_record_that_cannot_be_written_does_not_fail_the_start() {
    let h = host();
    // The record's directory is a regular file: nothing can be created under it.
    std::fs::create_dir_all(h.record.parent().unwrap().parent().unwrap()).unwrap();
    std::fs::write(h.record.parent().unwrap(), "").unwrap();
    let stderr = record_start(&h);
    assert!(stderr.contains("could not record"), "{stderr}");
}

/// After a reboot at control-plane the drop-in is absent (control-plane runs full's
/// flags) and /run is empty: only the level record, here at a configured path, knows.
#[test]
fn a_reboot_at_control_plane_records_control_plane_from_a_level_record_elsewhere() {
    let h = host();
    LevelRecord::at(Level::ControlPlane, Default::default()).write(&h.level_record).unwrap();
    assert!(!h.dropin.exists() && !h.record.exists());
    let stderr = record_start(&h);
    assert_eq!(recorded(&h.record), "control-plane", "{stderr}");
}

/// The daemon that reads these files runs once the file is fixed; until then the hook
/// still reads and writes where it is told, key by key.
#[test]
fn each_path_is_honoured_whatever_else_is_wrong_in_its_section() {
    for broken in ["unitt = \"k3s.service\"", "health_timeout = \"0s\"", "unit = \"k3s\"", "call_timeout = 3.5"] {
        let h = host();
        let good = std::fs::read_to_string(&h.conf).unwrap();
        std::fs::write(&h.conf, format!("{good}{broken}\nstep_up = \"sometimes\"\n")).unwrap();
        LevelRecord::at(Level::ControlPlane, Default::default()).write(&h.level_record).unwrap();
        let stderr = record_start(&h);
        assert_eq!(recorded(&h.record), "control-plane", "{broken}: {stderr}");
        let key = broken.split(' ').next().unwrap();
        assert!(stderr.contains(&format!("systemd.{key}")), "{broken}: the key left out is named: {stderr}");
        write_level(&h, Level::EtcdOnly);
        LevelRecord::at(Level::EtcdOnly, Default::default()).write(&h.level_record).unwrap();
        record_start(&h);
        assert_eq!(recorded(&h.record), "etcd-only", "{broken}: the configured drop-in is read");
    }
}
