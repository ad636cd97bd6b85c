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

/// The files in the start record's directory: (name, contents).
fn dir_files(h: &Host) -> Vec<(String, String)> {
    let mut v: Vec<_> = std::fs::read_dir(h.record.parent().unwrap())
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().into_string().unwrap(), std::fs::read_to_string(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// The cut points inside a durable write (`REGRADE_TEST_KILL_AT=start-record:<moment>`,
/// tests/testsuite/vm_power_cuts.rs cuts a guest's power at them): the hook dies exactly there,
/// with the file system as each moment must leave it — before the fsync and before the
/// rename, the old record whole beside the new temporary file; before the directory's
/// fsync, the new record in place and no temporary file.
#[test]
fn a_cut_inside_the_start_record_write_stops_the_hook_at_that_moment() {
    use std::os::unix::process::ExitStatusExt;
    for moment in regrade::kill_point::MOMENTS {
        let h = host();
        regrade::actuator::systemd::record::write(&h.record, Level::Full).unwrap();
        write_level(&h, Level::EtcdOnly);
        let point = format!("start-record:{}", moment.as_str());
        let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
            .args(["--config", h.conf.to_str().unwrap(), "record-start"])
            .env_remove("JOURNAL_STREAM")
            .env(regrade::kill_point::ENV, &point)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.signal(), Some(libc::SIGKILL), "{point}: {}\n{stderr}", out.status);
        assert!(stderr.contains(&point) && stderr.contains(regrade::kill_point::LOGGED), "{point}: {stderr}");
        let files = dir_files(&h);
        let temp = |(name, text): &(String, String)| name.starts_with(".started-level.") && text == "etcd-only\n";
        match moment {
            regrade::kill_point::Moment::BeforeFsync | regrade::kill_point::Moment::BeforeRename => {
                assert_eq!(files.len(), 2, "{point}: {files:?}");
                assert!(files.iter().any(temp), "{point}: the new record in its temporary file: {files:?}");
                assert_eq!(recorded(&h.record), "full", "{point}: the old record untouched");
            }
            regrade::kill_point::Moment::BeforeDirFsync => {
                assert_eq!(files, [("started-level".to_string(), "etcd-only\n".to_string())], "{point}");
            }
        }
    }
}

/// `REGRADE_TEST_KILL_HOW=stop`: the process logs the point and stops itself there
/// (SIGSTOP), so a test can cut a machine's power with its writes where the kernel has
/// them; continued, it goes on and finishes the write.
#[test]
fn a_cut_with_kill_how_stop_stops_the_process_and_logs_the_point_first() {
    use std::io::BufRead;
    let h = host();
    write_level(&h, Level::EtcdOnly);
    let mut child = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .args(["--config", h.conf.to_str().unwrap(), "record-start"])
        .env_remove("JOURNAL_STREAM")
        .env(regrade::kill_point::ENV, "start-record:before-rename")
        .env(regrade::kill_point::HOW_ENV, "stop")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Killed if an assertion fails: a stopped child would hold the test's output open.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let stderr = child.stderr.take().unwrap();
    let mut child = Reaped(child);
    let mut lines = std::io::BufReader::new(stderr).lines();
    let line = lines.by_ref().map_while(Result::ok).find(|l| l.contains(regrade::kill_point::LOGGED)).unwrap();
    assert!(line.contains("start-record:before-rename") && line.contains("SIGSTOP"), "{line}");
    let pid = child.0.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: waits for our own child, reporting a stop.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) }, pid);
    assert!(libc::WIFSTOPPED(status) && libc::WSTOPSIG(status) == libc::SIGSTOP, "status {status:#x}");
    assert!(!h.record.exists(), "stopped before the rename");
    // SAFETY: continues our own stopped child.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(child.0.wait().unwrap().success());
    assert_eq!(recorded(&h.record), "etcd-only", "continued, the write finished");
}
