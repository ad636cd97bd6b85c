//! `pressure.memory_cgroup` against a real cgroup v1 memory controller: a cgroup with a
//! limit, a process in it that allocates, and `regrade record` and `regrade status`
//! reading the cgroup's available memory fall by what it allocated, while the host's
//! MemAvailable is not what they show.
//!
//! Gated by REGRADE_TEST_CGROUP=1 (root, and the v1 memory controller mounted at
//! /sys/fs/cgroup/memory). The cgroup is `regrade-test-<pid>` under it; it and the
//! process are removed when the test ends, passed or failed.
//!
//!   REGRADE_TEST_CGROUP=1 cargo test --test testsuite pressure_cgroup:: -- --nocapture

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

const V1_ROOT: &str = "/sys/fs/cgroup/memory";
const MIB: u64 = 1 << 20;
const LIMIT: u64 = 256 * MIB;
const HOG: u64 = 160;

/// The process that allocates: this test binary again, running `hog` below. Each
/// line on its stdin is a number of MiB to allocate and touch; it answers
/// `allocated N MiB` when they are resident, and ends when its stdin closes.
#[test]
fn hog() {
    if std::env::var("REGRADE_TEST_HOG").as_deref() != Ok("1") {
        return;
    }
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let stdout = std::io::stdout();
    for line in std::io::stdin().lock().lines() {
        let mib: usize = line.unwrap().trim().parse().unwrap();
        kept.push(vec![1u8; mib << 20]);
        writeln!(stdout.lock(), "allocated {mib} MiB").unwrap();
        stdout.lock().flush().unwrap();
    }
    std::hint::black_box(&kept);
}

/// Removes the cgroup and ends the hog, however the test ends.
struct Cleanup {
    cgroup: PathBuf,
    hog: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut h) = self.hog.take() {
            let _ = h.kill();
            let _ = h.wait();
        }
        // The hog was reaped: no task is left, so the cgroup can go.
        if let Err(e) = std::fs::remove_dir(&self.cgroup) {
            eprintln!("could not remove {}: {e}", self.cgroup.display());
        }
    }
}

/// A run killed before its `Cleanup` ran (a SIGKILLed `cargo test`) leaves its cgroup,
/// empty once its hog is gone: removed here when the run that made it is gone.
fn remove_stale_cgroups() {
    for e in std::fs::read_dir(V1_ROOT).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("regrade-test-") else { continue };
        if !Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

fn record(config: &Path) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(config)
        .args(["record", "--count", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let row = text.lines().nth(1).unwrap();
    row.rsplit(',').next().unwrap().parse::<u64>().unwrap() * 1024
}

fn read_number(p: &Path) -> u64 {
    std::fs::read_to_string(p).unwrap().trim().parse().unwrap()
}

#[test]
fn a_cgroup_v1_processs_allocation_is_seen_as_less_available_memory() {
    if std::env::var("REGRADE_TEST_CGROUP").as_deref() != Ok("1") {
        eprintln!("skipped: set REGRADE_TEST_CGROUP=1 (root, cgroup v1 memory controller)");
        return;
    }
    assert!(
        Path::new(V1_ROOT).join("memory.limit_in_bytes").exists(),
        "REGRADE_TEST_CGROUP=1 but no cgroup v1 memory controller at {V1_ROOT}"
    );
    remove_stale_cgroups();
    let cgroup = Path::new(V1_ROOT).join(format!("regrade-test-{}", std::process::id()));
    std::fs::create_dir(&cgroup).unwrap();
    let mut cleanup = Cleanup { cgroup: cgroup.clone(), hog: None };
    std::fs::write(cgroup.join("memory.limit_in_bytes"), LIMIT.to_string()).unwrap();

    let hog = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "pressure_cgroup::hog", "--nocapture", "--test-threads=1"])
        .env("REGRADE_TEST_HOG", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::fs::write(cgroup.join("cgroup.procs"), hog.id().to_string()).unwrap();
    let hog = cleanup.hog.insert(hog);
    let mut to_hog: ChildStdin = hog.stdin.take().unwrap();
    let mut from_hog = BufReader::new(hog.stdout.take().unwrap());

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("regrade.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = {:?}\nlevel_record = {:?}\n[pressure]\nmemory_cgroup = {cgroup:?}\n\
             [systemd]\nrecord = {:?}\ndropin = {:?}\n",
            dir.path().join("state.json"),
            dir.path().join("level.json"),
            dir.path().join("started-level"),
            dir.path().join("config.yaml.d/50-regrade.yaml"),
        ),
    )
    .unwrap();

    let before = record(&config);
    // The hog's memory before it moved stays charged where it was (v1 moves no
    // charges by default): the cgroup is nearly empty.
    let usage = read_number(&cgroup.join("memory.usage_in_bytes"));
    println!("before: available {} MiB (limit {} MiB, usage {} MiB)", before / MIB, LIMIT / MIB, usage / MIB);
    assert!(before > LIMIT - 32 * MIB && before <= LIMIT, "available {before} with a {LIMIT} limit");

    writeln!(to_hog, "{HOG}").unwrap();
    // The harness writes its own words around the answer ("test hog ... ").
    let mut line = String::new();
    while !line.contains("allocated ") {
        line.clear();
        assert!(from_hog.read_line(&mut line).unwrap() > 0, "the hog ended before it allocated");
    }
    assert!(line.contains(&format!("allocated {HOG} MiB")), "the hog said {line:?}");

    let after = record(&config);
    let usage = read_number(&cgroup.join("memory.usage_in_bytes"));
    let host =
        regrade::pressure::parse_mem_available(std::fs::read_to_string("/proc/meminfo").unwrap().as_bytes()).unwrap();
    println!(
        "after {HOG} MiB: available {} MiB (usage {} MiB); the host's MemAvailable {} MiB",
        after / MIB,
        usage / MIB,
        host / MIB
    );
    assert!(
        after + (HOG - 16) * MIB <= before,
        "available fell by {} MiB only, after {HOG} MiB were allocated in the cgroup",
        (before.saturating_sub(after)) / MIB
    );
    assert!(after < host, "the figure is the cgroup's, not the host's");

    let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(&config)
        .arg("status")
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    println!("{status}");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        status.contains(&format!("memory cgroup v1 {}", cgroup.display())) && status.contains("of the memory cgroup"),
        "status does not say it reads the cgroup:\n{status}"
    );
}
