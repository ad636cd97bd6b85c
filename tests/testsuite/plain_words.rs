//! What a newcomer sees: `status` in the README's lowercase words (never Rust's Debug
//! names), and `watch --dry-run` saying at start what it reads from where, then
//! logging each change of reading — not every sample — at the default level.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::fixture;

use fixture::{write_pressure, CALM_PSI, OVER_PSI as HIGH_PSI};

/// A config on fixture files; `step_up` and a long `sustain` so nothing steps.
fn config(d: &Path, step_up: &str) -> std::path::PathBuf {
    fixture::config(d, &format!("step_up = \"{step_up}\""), "sample_period = \"100ms\"\nsustain = \"1h\"")
}

fn regrade(cfg: &Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_regrade")).arg("--config").arg(cfg).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The value after `key:` in `status`'s text.
fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
        .trim()
}

#[test]
fn status_speaks_the_readme_words() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (psi, mem_kb, step_up, reading) in [
        (CALM_PSI, 4_000_000, "automatic", "calm"),
        (HIGH_PSI, 100_000, "manual", "over"),
        (HIGH_PSI, 4_000_000, "automatic", "neither"),
    ] {
        write_pressure(d, psi, mem_kb);
        let t = regrade(&config(d, step_up), &["status"]);
        assert_eq!(field(&t, "this sample"), reading, "{t}");
        assert_eq!(field(&t, "step up"), step_up, "{t}");
        assert_eq!(field(&t, "level"), "full", "{t}");
        for debug in ["Calm", "Over", "Neither", "Automatic", "Manual", "ControlPlane", "EtcdOnly", "Some(", "None"] {
            assert!(!t.contains(debug), "Debug name {debug:?} in:\n{t}");
        }
    }
}

#[test]
fn watch_dry_run_says_what_it_reads_and_logs_each_change_of_reading() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_pressure(d, CALM_PSI, 4_000_000);
    let cfg = config(d, "automatic");
    let child = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(&cfg)
        .args(["watch", "--dry-run"])
        .env_remove("NOTIFY_SOCKET")
        .env_remove("REGRADE_LOG") // the default level
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // ~10 samples each: calm, over, neither (high PSI, memory free), calm again.
    std::thread::sleep(Duration::from_millis(1000));
    write_pressure(d, HIGH_PSI, 100_000);
    std::thread::sleep(Duration::from_millis(1000));
    write_pressure(d, HIGH_PSI, 4_000_000);
    std::thread::sleep(Duration::from_millis(1000));
    write_pressure(d, CALM_PSI, 4_000_000);
    std::thread::sleep(Duration::from_millis(1000));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let log = String::from_utf8(out.stderr).unwrap();

    let start = log.lines().find(|l| l.contains("reading memory pressure from")).unwrap_or_else(|| panic!("{log}"));
    for what in [
        format!("from {}", d.join("psi").display()),
        format!("available memory as MemAvailable of {}", d.join("meminfo").display()),
        "every 100ms".to_string(),
        "over when some_avg10 >= 40% and available memory below 1024 MiB".to_string(),
    ] {
        assert!(start.contains(&what), "start line lacks {what:?}: {start}");
    }
    assert!(log.contains("dry run: steps are logged, and neither k3s nor the cluster is touched"), "{log}");

    let changes: Vec<&str> = log.lines().filter(|l| l.contains("reading now ")).collect();
    let words: Vec<(&str, &str)> = changes
        .iter()
        .map(|l| {
            let rest = l.split("reading now ").nth(1).unwrap();
            let now = rest.split(' ').next().unwrap();
            let was = rest.split("(was ").nth(1).unwrap().split(')').next().unwrap();
            (now, was)
        })
        .collect();
    assert_eq!(
        words,
        [("calm", "none"), ("over", "calm"), ("neither", "over"), ("calm", "neither")],
        "one line per change, about 40 samples:\n{log}"
    );
    assert!(changes.iter().all(|l| l.contains(" INFO ")), "{log}");
    assert!(changes[1].contains("some_avg10 80.00%, MemAvailable 97 MiB"), "{}", changes[1]);
}
