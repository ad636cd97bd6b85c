//! Whose memory it is, from the binary: `status` (text and --json) names the unit of a
//! fake cgroup v2 `system.slice` that grows and the largest beside it, and `watch`
//! under pressure says in its log which unit grows. No rig: fixture files only.

use crate::fixture;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MIB: u64 = 1 << 20;

/// `units` as (name, memory.current) under `d/system.slice`, as cgroupfs lays them out.
fn slice(d: &Path, units: &[(&str, u64)]) -> PathBuf {
    let slice = d.join("system.slice");
    for (name, current) in units {
        let u = slice.join(name);
        std::fs::create_dir_all(&u).unwrap();
        std::fs::write(u.join("memory.current"), format!("{current}\n")).unwrap();
        std::fs::write(
            u.join("memory.pressure"),
            "some avg10=12.00 avg60=0 avg300=0 total=1\nfull avg10=3.00 avg60=0 avg300=0 total=1\n",
        )
        .unwrap();
        std::fs::write(u.join("memory.events"), "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n").unwrap();
    }
    slice
}

fn setup(psi: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    fixture::write_pressure(dir.path(), psi, 4_000_000);
    let s = slice(
        dir.path(),
        &[("k3s.service", 1536 * MIB), ("leaky-backup.service", 1382 * MIB), ("regrade.service", 9 * MIB)],
    );
    let top = format!("[census]\nslice = {s:?}\n[etcd]\nmetrics_url = \"\"\n");
    let config = fixture::config(dir.path(), &top, "sample_period = \"100ms\"");
    (dir, config)
}

fn status(config: &Path, json: bool) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_regrade"));
    c.arg("--config").arg(config).arg("status").env_remove("NOTIFY_SOCKET");
    if json {
        c.arg("--json");
    }
    let out = c.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// With `watch`'s census published 10 s ago (this process stands in for that watch),
/// the backup grew 160 MiB since: named growing at 16 MiB/s, k3s as the largest only.
#[test]
fn status_names_the_unit_growing_and_the_largest() {
    let (dir, config) = setup(fixture::CALM_PSI);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    let earlier = serde_json::json!({
        "slice": dir.path().join("system.slice"), "at": now - 10.0, "window": null, "pid": std::process::id(),
        "units": [
            {"unit": "k3s.service", "current": 1536 * MIB, "growth": null, "grew": null, "some_avg10": 0.0, "full_avg10": 0.0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0},
            {"unit": "leaky-backup.service", "current": 1222 * MIB, "growth": null, "grew": null, "some_avg10": 0.0, "full_avg10": 0.0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0},
        ],
    });
    std::fs::write(dir.path().join("units.json"), earlier.to_string()).unwrap();
    let text = status(&config, false);
    let line = text.lines().find(|l| l.starts_with("host memory:")).unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.starts_with("host memory:    leaky-backup.service: 1.35 GiB, growing 1")
            && line.contains(" MiB/s")
            && line.ends_with("; largest k3s.service: 1.50 GiB"),
        "{line}"
    );
    let v: serde_json::Value = serde_json::from_str(&status(&config, true)).unwrap();
    let units = v["units"]["units"].as_array().unwrap();
    assert_eq!(units[0]["unit"], "k3s.service", "largest first");
    assert_eq!(units[1]["unit"], "leaky-backup.service");
    let rate = units[1]["growth"].as_f64().unwrap() / MIB as f64;
    // 160 MiB over the 10 s since, and however long status took to start.
    assert!((10.0..17.0).contains(&rate), "{rate} MiB/s");
    assert_eq!(units[1]["some_avg10"], 12.0);
    assert!(units[0]["growth"].as_f64().unwrap().abs() < 1.0, "k3s did not grow");
}

/// Nothing published (no `watch`): `status` reads twice, a second apart; nothing
/// grows, so nothing is named growing, and k3s only as the largest.
#[test]
fn status_without_watch_names_only_the_largest_when_nothing_grows() {
    let (_dir, config) = setup(fixture::CALM_PSI);
    let text = status(&config, false);
    let line = text.lines().find(|l| l.starts_with("host memory:")).unwrap_or_else(|| panic!("{text}"));
    assert_eq!(line, "host memory:    none in system.slice growing over 1 s; largest k3s.service: 1.50 GiB");
}

/// `watch --dry-run` under pressure reads the units every `etcd.metrics_interval`
/// and says in its log which one grows, once.
#[test]
fn watch_under_pressure_logs_the_unit_that_grows() {
    let (dir, config) = setup(fixture::OVER_PSI);
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("metrics_url = \"\"\n", "metrics_url = \"\"\nmetrics_interval = \"1s\"\n");
    std::fs::write(&config, text).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(&config)
        .args(["watch", "--dry-run"])
        .env_remove("NOTIFY_SOCKET")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // k3s larger than the backup can grow to within the test's bound, so the line
    // names it as the largest beside the one growing, whenever watch's round comes.
    std::fs::write(dir.path().join("system.slice/k3s.service/memory.current"), format!("{}\n", 8192 * MIB)).unwrap();
    // The backup grows 8 MiB every 100 ms until the log names it.
    let leaky = dir.path().join("system.slice/leaky-backup.service/memory.current");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let grower = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut current = 1382 * MIB;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                current += 8 * MIB;
                std::fs::write(&leaky, format!("{current}\n")).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut log = String::new();
    let found = loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                log += &line;
                log.push('\n');
                if line.contains("whose memory grows") {
                    break line;
                }
            }
            Err(_) => panic!("no line naming the unit growing within 30 s:\n{log}"),
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    grower.join().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        found.contains("leaky-backup.service: 1.")
            && found.contains("growing")
            && found.contains("largest k3s.service: 8.00 GiB"),
        "{found}"
    );
    assert!(!found.contains("k3s.service: 8.00 GiB, growing"), "{found}");
}
