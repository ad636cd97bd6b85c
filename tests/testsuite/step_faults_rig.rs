//! The step path runs from locked memory (issue 26), against the real thing: a
//! `regrade watch` on the host steps the nspawn container's k3s (real systemd over
//! D-Bus, the k3s stand-in restarted for etcd-only, a real API server, the etcd gate
//! against a real three-member etcd: tests/testsuite/common/level_rig.rs) down to etcd-only and
//! back up to full, one step at a time, and before each step the page cache is
//! dropped (`echo 3 > /proc/sys/vm/drop_caches`), so every page of a file that the step
//! touches and that is not locked is a major fault. Printed per step: regrade's major
//! faults (field 12 of /proc/PID/stat), with its binary locked only on fault as before
//! (`REGRADE_TEST_TEXT_ON_FAULT=1`) and locked whole (now); and, at start, `Locked:`
//! and `Rss:` of the binary's r-xp mapping and VmRSS. Fails if a step, binary locked
//! whole, takes more than 10 major faults.
//!
//! The binary is the test profile's (unoptimised, with debug info: a far larger text
//! than the release build's); tests/bench/step_faults.sh has the release figures.
//!
//! Gated by REGRADE_TEST_KUBE=1 and REGRADE_TEST_SYSTEMD=1 (root).
//!
//!   REGRADE_TEST_KUBE=1 REGRADE_TEST_SYSTEMD=1 cargo test --test testsuite step_faults_rig:: -- --nocapture
#![cfg(not(feature = "docker"))]

use crate::common;

use std::path::Path;
use std::time::Duration;

use common::level_rig::{stop, LevelRig};

fn majflt(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // After "pid (comm) ": field 3 is the first; majflt is field 12.
    let rest = &stat[stat.rfind(") ").unwrap() + 2..];
    rest.split_whitespace().nth(9).unwrap().parse().unwrap()
}

fn status_kb(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// (Locked, Rss) of the binary's r-xp mapping, kB.
fn text_kb(pid: u32, exe: &Path) -> (u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let (mut inside, mut got) = (false, (0, 0));
    for line in smaps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.first().is_some_and(|r| r.contains('-') && !r.ends_with(':')) && f.len() >= 5 {
            inside = f[1] == "r-xp" && f.get(5).is_some_and(|p| Path::new(p) == exe);
            continue;
        }
        match (inside, f.first()) {
            (true, Some(&"Rss:")) => got.1 = f[1].parse().unwrap(),
            (true, Some(&"Locked:")) => got.0 = f[1].parse().unwrap(),
            _ => {}
        }
    }
    got
}

fn count(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().lines().filter(|l| l.contains(what)).count()
}

fn drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
}

#[test]
fn each_step_takes_at_most_10_major_faults_with_the_binary_locked() {
    let test = "each_step_takes_at_most_10_major_faults_with_the_binary_locked";
    let Some(rig) = LevelRig::up(test, "regrade-faults") else { return };
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_regrade")).unwrap();
    let steps = [
        (90.0, "full -> control-plane"),
        (90.0, "control-plane -> etcd-only"),
        (0.0, "etcd-only -> control-plane"),
        (0.0, "control-plane -> full"),
    ];
    let mut rows = Vec::new();
    for (label, on_fault) in [("binary locked on fault (before)", "1"), ("binary locked whole (now)", "0")] {
        rig.pressure(20.0); // neither: no step
        let log = rig.dir.path().join(format!("watch-{on_fault}.log"));
        let mut w = rig.watch_with(&[("REGRADE_TEST_TEXT_ON_FAULT", on_fault)], &log);
        let pid = w.id();
        rig.wait_saying(
            Duration::from_secs(60),
            || (count(&log, "regrade watch starting") > 0 && rig.record().is_some()).then_some(()),
            || {
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                format!("watch's first samples not within 60 s; its log:\n{said}")
            },
        );
        let (locked, rss) = text_kb(pid, &exe);
        let vmrss = status_kb(pid, "VmRSS:");
        let mut faults = Vec::new();
        for (i, (psi, what)) in steps.iter().enumerate() {
            drop_caches();
            let before = majflt(pid);
            rig.pressure(*psi);
            rig.wait(&format!("step {what}"), Duration::from_secs(180), || {
                (count(&log, "step done") > i).then_some(())
            });
            faults.push(majflt(pid) - before);
            rig.pressure(20.0);
        }
        let line = format!(
            "{label:<34} Locked {locked:>7} kB of Rss {rss:>7} kB, VmRSS {vmrss:>7} kB; majflt per step {faults:?}"
        );
        println!("{line}");
        rows.push((on_fault, faults));
        stop(&mut w);
        assert_eq!(rig.dropin_level(), "full", "the server is back at full");
    }
    println!("steps: {:?}", steps.iter().map(|s| s.1).collect::<Vec<_>>());
    let (_, locked) = rows.iter().find(|r| r.0 == "0").unwrap();
    assert!(
        locked.iter().all(|&f| f <= 10),
        "a step took more than 10 major faults with the binary locked: {locked:?}"
    );
}
