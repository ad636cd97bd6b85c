//! Power cuts (issue 41): server1 in the VM lane's qemu guest (tests/testsuite/vm/guest.rs; its
//! disks opened `cache=none`, so what the guest has not flushed is lost with qemu)
//! has its power cut in the middle of a step, is booted again from the same disks, and
//! must converge with nothing half-done.
//!
//! The rig is the VM lane's (tests/testsuite/vm_incident.rs): server1 the guest, server2 and
//! server3 systemd-nspawn containers, one etcd of three and the API through server2.
//! regrade.service runs in the guest, enabled at boot, with tests/vm/power-cuts.toml:
//! its PSI source is a file the test writes in the guest (`some` at 80 % steps down,
//! 0 % up, 20 % neither), on tmpfs so that a cut forgets it and every boot starts at
//! neither. A fake pressure, not a thrash: the cells are about where the step is cut.
//!
//! Before the cells, k3s's configuration as regrade reads it (tests/testsuite/vm/k3s_config.rs,
//! issue 58): `regrade status` with a site drop-in that shadows the shipped reservation,
//! with an operator's 2 GiB the shipped file lowers, and with it after that file, each
//! checked against the k3s stand-in's report of the kubelet's flags after a restart;
//! the operator's 2 GiB stays through the cells and is read back after them.
//!
//! Each cell, from the step's `from` level, converged (moved there by `regrade step`
//! in the guest, then `sync`: what came before is on disk, as on a host that ran a
//! while):
//! 1. arms the cut: `systemctl set-environment REGRADE_TEST_KILL_AT=<point>
//!    REGRADE_TEST_KILL_HOW=stop` (the manager's environment: regrade.service and k3s's
//!    start hook, `regrade record-start`, both get it; a cut forgets it) and restarts
//!    regrade.service;
//! 2. writes the pressure that makes the step, and waits for the point's log line in
//!    the guest's journal and the process stopped there (SIGSTOP: its writes stay in
//!    the guest's page cache, dirty or not, as the kernel has them);
//! 3. cuts the power (SIGKILL of qemu), boots the same disks again, and waits for the
//!    boot's console line;
//! 4. waits for convergence (polling the guest, the API and etcd; no sleep stands for
//!    an event): the level record without a step, the Node's marks, the drop-in and
//!    the start record at one level, the Lease free, server1's etcd member healthy
//!    with the ID it had;
//! 5. checks: no level outside the step's two (the Node's label all along, the record
//!    at each look); no file of regrade's or the k3s stand-in's empty, unreadable or
//!    not what its writer writes (the record parses, the drop-in is regrade's text for
//!    its level, the start record a level, the caches and the credential whole, the
//!    stand-in's config as seeded); and regrade's first start line of the new boot
//!    names what it found, a record of this step's levels, and decides what the cut
//!    leaves (`expected_decision`).
//!
//! Cells: each kill point of a step in the step into control-plane (the three it
//! reaches: it restarts nothing), the step into etcd-only and the step out of it; and
//! the nine cuts inside regrade's durable writes in the step into etcd-only
//! (`<write>:<moment>`; the level record's write at phase `writing`, a phase ahead of
//! the drop-in). `REGRADE_VM_CUTS=ci` (the default) runs the three riskiest, `all`
//! every cell, or a comma-separated list of cell names. Prints the matrix.
//!
//! The mutation (docs/power-cuts.md): `REGRADE_VM_BIN` a build with `--features
//! fsync-faults`, `REGRADE_VM_NO_FSYNC=<write>[:dir]` passed to regrade as
//! `REGRADE_TEST_NO_FSYNC`, `REGRADE_VM_ROOTFLAGS=noauto_da_alloc` mounts the guest's
//! root (regrade's and k3s's files) with that option.
//!
//! Gated by REGRADE_TEST_VM=1 (root; one qemu guest, about a core). Run alone:
//!   REGRADE_TEST_VM=1 cargo test --test testsuite vm_power_cuts:: -- --nocapture
//!   REGRADE_TEST_VM=1 REGRADE_VM_CUTS=all cargo test --test testsuite vm_power_cuts:: -- --nocapture

use crate::common;
use crate::incident::shared;
use crate::vm::guest;
use crate::vm::k3s_config;
use crate::vm::lane;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::Api;
use regrade::kill_point::{MOMENTS, POINTS, WRITES};
use regrade::level::Level;
use regrade::level_record::LevelRecord;
use serde_json::Value;

use common::three_servers::{apply_access, enter_netns, field, make_credentials, repo, Credentials};
use guest::Guest;
use lane::{Network, Peer, HUB};
use shared::{client, wait_until};

const GATE: &str = "REGRADE_TEST_VM";
const CUTS_ENV: &str = "REGRADE_VM_CUTS";
const GUEST_BOUND: Duration = Duration::from_secs(120 * 60);
const LONG: Duration = Duration::from_secs(120);
const CONVERGE: Duration = Duration::from_secs(420);
const FULL: &str = "full";
const CP: &str = "control-plane";
const EO: &str = "etcd-only";
const LABEL: &str = "regrade.dev/level";
const TAINT: &str = "regrade.dev/stepped-down";
const RECORD: &str = "/var/lib/regrade/level.json";
const DROPIN: &str = "/etc/rancher/k3s/config.yaml.d/50-regrade.yaml";
const STARTED: &str = "/run/regrade/started-level";
const PSI: &str = "/run/regrade-vm/psi";
/// The file fsynced to commit the guest's journal before a cut (on the root filesystem,
/// outside the directories checked).
const COMMIT_MARK: &str = "/var/lib/.regrade-test-commit";
/// The cells CI runs: the level record written a phase ahead of the drop-in (renamed,
/// its directory not yet fsynced), the drop-in itself (the same moment), and the
/// restart request.
const CI: [&str; 3] =
    ["cp-eo/level-record@writing:before-dir-fsync", "cp-eo/dropin:before-dir-fsync", "cp-eo/after-restart-request"];

/// What regrade must decide at its start after a cut at `point` of the step `up` or
/// down (the first words of its decision). With the guest's journal committed before
/// each cut, every rename so far is on disk and every fsynced file whole, so this is
/// fixed: a cut that loses a write regrade synced (a missing fsync) shows as another
/// decision, even where the recovery then converges all the same.
fn expected_decision(up: bool, point: &str) -> &'static str {
    const ROLL_BACK: &str = "roll back the step";
    const FINISH: &str = "finish the step";
    const NOTHING: &str = "nothing";
    match point {
        "before-release" => NOTHING,
        // Up: k3s restarts first, then the marks.
        "before-marks" if up => "put the Node's marks right",
        "after-marks" if up => NOTHING,
        // Down: the marks, the record a phase ahead, the drop-in; k3s not restarted.
        "before-marks" | "after-marks" => ROLL_BACK,
        p if p.starts_with("level-record") => ROLL_BACK,
        "dropin:before-fsync" | "dropin:before-rename" => ROLL_BACK,
        // The new drop-in on disk, or a restart asked for: finished.
        _ => FINISH,
    }
}

/// One cell: the step (`from` -> `to`, made by `psi`) cut at `point`.
#[derive(Clone)]
struct Cell {
    name: String,
    from: &'static str,
    to: &'static str,
    psi: f64,
    point: String,
    /// This cell's mutation: `REGRADE_TEST_NO_FSYNC` for it alone.
    no_fsync: Option<String>,
}

/// Every cell, in an order that moves between levels little: a step into etcd-only
/// often ends there, where the next step out of it starts.
fn all_cells() -> Vec<Cell> {
    let cell = |step: &str, from, to, psi, point: &str| Cell {
        name: format!("{step}/{point}"),
        from,
        to,
        psi,
        point: point.into(),
        no_fsync: None,
    };
    let mut cells: Vec<Cell> =
        ["before-marks", "after-marks", "before-release"].iter().map(|p| cell("full-cp", FULL, CP, 80.0, p)).collect();
    let mut down: Vec<Cell> = POINTS.iter().map(|p| cell("cp-eo", CP, EO, 80.0, p)).collect();
    for w in WRITES {
        for m in MOMENTS {
            let w = if w == "level-record" { "level-record@writing" } else { w };
            down.push(cell("cp-eo", CP, EO, 80.0, &format!("{w}:{}", m.as_str())));
        }
    }
    let mut up = POINTS.iter().map(|p| cell("eo-cp", EO, CP, 0.0, p));
    for d in down {
        cells.push(d);
        cells.extend(up.next());
    }
    cells.extend(up);
    cells
}

/// The cells `REGRADE_VM_CUTS` asks for, in its order. A named cell may carry the
/// mutation for itself alone: `<cell>+no-fsync=<write>[:dir][+<write>[:dir]...]`
/// (a build with `fsync-faults`; see the module documentation).
fn cells_to_run() -> Vec<Cell> {
    let all = all_cells();
    let asked = std::env::var(CUTS_ENV).unwrap_or_else(|_| "ci".into());
    let names: Vec<String> = match asked.as_str() {
        "all" => return all,
        "ci" => CI.iter().map(|s| s.to_string()).collect(),
        list => list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
    };
    names
        .iter()
        .map(|n| {
            let (name, no_fsync) = match n.split_once("+no-fsync=") {
                Some((name, spec)) => (name, Some(spec.replace('+', ","))),
                None => (n.as_str(), None),
            };
            let mut cell = all.iter().find(|c| c.name == name).cloned().unwrap_or_else(|| {
                panic!(
                    "{CUTS_ENV}: no cell {name:?}; cells: {}",
                    all.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
                )
            });
            if let Some(spec) = no_fsync {
                cell.name = format!("{name} NO_FSYNC={spec}");
                cell.no_fsync = Some(spec);
            }
            cell
        })
        .collect()
}

/// The PSI file's one line: the `some` averages at `psi` % (the default metric,
/// `some_avg10`, needs no `full` line).
fn psi_line(psi: f64) -> String {
    format!("some avg10={psi:.2} avg60={psi:.2} avg300={psi:.2} total=0")
}

/// What a cell saw, for the table.
#[derive(Default)]
struct Row {
    cell: String,
    /// The level record as the stopped process left it in the guest's page cache.
    before_cut: String,
    /// regrade's first start line in the new boot: what it found, what it decided.
    found: String,
    decision: String,
    end: String,
    files: String,
    secs: f64,
    failed: Option<String>,
}

#[test]
fn vm_power_cuts() {
    if !common::gate_open(GATE, "vm_power_cuts", "root; boots a qemu guest (server1) and two systemd-nspawn containers")
    {
        return;
    }
    let cells = cells_to_run();
    let t_start = Instant::now();
    let phase = |name: &str| println!("[{:>6.1}s] {name}", t_start.elapsed().as_secs_f64());
    let lock = lane::take_lock();
    let bin = common::built("tests/rig/build.sh");
    let image = common::built("tests/vm/image.sh");
    let regrade_bin =
        std::env::var("REGRADE_VM_BIN").map_or(std::path::PathBuf::from(env!("CARGO_BIN_EXE_regrade")), Into::into);
    let rootflags = std::env::var("REGRADE_VM_ROOTFLAGS").ok().filter(|f| !f.is_empty());
    let no_fsync = std::env::var("REGRADE_VM_NO_FSYNC").ok().filter(|f| !f.is_empty());
    phase(&format!(
        "rigs and image ready; regrade in the guest: {}; cells: {}",
        regrade_bin.display(),
        cells.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
    ));

    let network = Network::up();
    // This thread stays in the hub: qemu's tap is there, and qemu dies with this thread.
    enter_netns(HUB);
    let tmp = tempfile::Builder::new().prefix("regrade-vm.").tempdir_in("/var/tmp").unwrap();
    let Credentials { certs, names, .. } = make_credentials(tmp.path(), &bin.join("harness"));
    let toml = std::fs::read_to_string(repo("tests/vm/power-cuts.toml")).unwrap();
    // Every boot starts at "neither" (the first boot's is made by the test: the seed
    // is copied over / after systemd-tmpfiles ran).
    let tmpfiles = format!("f {PSI} 0644 root root - {}\n", psi_line(20.0));
    let seed = lane::server1_seed(
        tmp.path(),
        &certs,
        &names,
        &bin,
        &regrade_bin,
        &toml,
        &[("/etc/tmpfiles.d/regrade-vm.conf".into(), tmpfiles)],
    );
    let cmdline = rootflags.as_ref().map_or(String::new(), |f| format!("rootflags={f}"));
    let mut g = Guest::boot(&image, &seed, &tmp.path().join("guest"), GUEST_BOUND, &cmdline, guest::cpus(1));
    let peers = lane::peers_up(tmp.path(), &certs, &names, &bin);
    phase("server2 and server3 up");
    let (t_booted, line) = g.wait_console(0, "regrade-vm: booted", Duration::from_secs(300));
    phase(&format!("server1's guest: {line:?}, {:.1} s after qemu started", t_booted - g.started));
    let mount = g.sh("grep ' / ' /proc/mounts", LONG);
    phase(&format!("server1's root: {}", mount.trim()));

    let admin_kc = certs.join("admin.kubeconfig");
    let rows = common::block_on(async {
        let a2 = client(&admin_kc, 2).await;
        lane::nodes_ready(&a2).await;
        for p in &peers {
            p.c.exec(&["systemctl", "stop", "regrade.service"]);
        }
        let member = wait_until(LONG, async || peers[0].server1_member()).await.expect("server1's etcd member");
        apply_access(&bin, &certs);
        g.sh("/usr/local/bin/regrade credential --admin-kubeconfig /etc/rancher/k3s/kubelet.kubeconfig", LONG);
        g.sh(
            &format!("systemd-tmpfiles --create /etc/tmpfiles.d/regrade-vm.conf && cat {PSI} && systemctl enable regrade.service && systemctl start regrade.service && sync"),
            LONG,
        );
        let k3s_config = g.sh("cat /etc/rancher/k3s/config.yaml", LONG);
        phase(&format!(
            "cluster up: 3 Nodes Ready, server1's etcd member {member:x}; regrade.service enabled and started"
        ));
        let lane = Lane {
            a2,
            admin_kc: admin_kc.clone(),
            peers: &peers,
            member,
            k3s_config,
            no_fsync: no_fsync.clone(),
            t_start,
        };
        // k3s's configuration as regrade reads it (issue 58), before the cells: the
        // operator's 2 GiB it leaves in config.yaml.d stays through them.
        for line in k3s_config::before_steps(&g).unwrap_or_else(|e| panic!("k3s's configuration: {e}")) {
            phase(&line);
        }
        lane.converge_at(&g, &[FULL]).await.unwrap_or_else(|e| panic!("after k3s's restarts: {e}"));
        let mut rows = Vec::new();
        for cell in &cells {
            let t0 = Instant::now();
            let mut row = Row { cell: cell.name.clone(), ..Row::default() };
            let r = lane.cell(&mut g, cell, &mut row).await;
            row.secs = t0.elapsed().as_secs_f64();
            let failed = r.is_err();
            if let Err(e) = r {
                row.failed = Some(e);
            }
            phase(&format!("cell {} {} in {:.0} s", cell.name, if failed { "FAILED" } else { "converged" }, row.secs));
            rows.push(row);
            if failed {
                // The next cell could not start from a known state.
                break;
            }
        }
        let config_after = k3s_config::after_steps(&g);
        if let Ok(line) = &config_after {
            phase(line);
        }
        (rows, config_after)
    });
    let (rows, config_after) = rows;
    print_table(&rows, &cmdline, no_fsync.as_deref(), t_start.elapsed().as_secs_f64());
    let failed: Vec<String> =
        rows.iter().filter_map(|r| r.failed.as_ref().map(|e| format!("{}: {e}", r.cell))).collect();
    drop(g);
    drop(peers);
    drop(network);
    drop(lock);
    assert!(failed.is_empty(), "cells failed:\n{}", failed.join("\n"));
    if let Err(e) = config_after {
        panic!("k3s's configuration after the cells: {e}");
    }
    assert_eq!(rows.len(), cells.len(), "every cell ran");
}

struct Lane<'a> {
    a2: kube::Client,
    admin_kc: std::path::PathBuf,
    peers: &'a [Peer],
    member: u64,
    k3s_config: String,
    no_fsync: Option<String>,
    t_start: Instant,
}

/// What regrade's files in the guest say.
struct Files {
    record: Result<Option<LevelRecord>, String>,
    dropin: Option<String>,
    started: Option<String>,
}

impl Lane<'_> {
    fn phase(&self, what: &str) {
        println!("[{:>6.1}s]   {what}", self.t_start.elapsed().as_secs_f64());
    }

    async fn cell(&self, g: &mut Guest, cell: &Cell, row: &mut Row) -> Result<(), String> {
        // Into position: converged at `from`.
        let here = self.converged(g).await;
        if here.as_deref() != Ok(cell.from) {
            self.phase(&format!("at {here:?}: `regrade step to {}` in the guest", cell.from));
            let e = g.exec_input(&format!("regrade step to {} 2>&1", cell.from), None, Duration::from_secs(600))?;
            if e.code != 0 {
                return Err(format!("regrade step to {}: exit {}: {}", cell.from, e.code, e.out));
            }
            self.converge_at(g, &[cell.from]).await?;
        }
        g.sh("sync", LONG);
        // The cut armed, regrade started again with it.
        let mut env = format!("REGRADE_TEST_KILL_AT={} REGRADE_TEST_KILL_HOW=stop", cell.point);
        if let Some(n) = cell.no_fsync.as_ref().or(self.no_fsync.as_ref()) {
            env += &format!(" REGRADE_TEST_NO_FSYNC={n}");
        }
        let since = g.sh("date +%s", LONG).trim().to_string();
        g.sh(&format!("systemctl set-environment {env} && systemctl restart regrade.service"), LONG);
        let seen = Seen::start(self.admin_kc.clone());
        g.sh(&format!("echo '{}' > {PSI}", psi_line(cell.psi)), LONG);
        self.phase(&format!("{}: armed ({env}), pressure {} %", cell.name, cell.psi));
        let stopped = format!("REGRADE_TEST_KILL_AT={}: {}", cell.point, regrade::kill_point::LOGGED);
        let probe = format!(
            "journalctl -b -q -o cat --since=@{since} | grep -qF '{stopped}' && \
             for p in $(pidof regrade); do grep -q '^State:.*T (stopped)' /proc/$p/status && echo $p; done"
        );
        let pid = wait_until(Duration::from_secs(300), async || {
            let out = g.exec_input(&probe, None, LONG).ok()?.out;
            out.lines().next().map(str::to_string)
        })
        .await
        .ok_or_else(|| format!("regrade never stopped at {}", cell.point))?;
        // What the stopped process left, as the guest's page cache has it.
        let before = self.files(g);
        row.before_cut = describe(&before.record);
        self.phase(&format!(
            "{}: regrade (PID {pid}) stopped there; record {}; cutting the power",
            cell.name, row.before_cut
        ));
        // Commit ext4's journal first (an fsync of a file of the test's own commits the
        // one running transaction): every rename and creation so far is on disk, data
        // not yet written back is not. The worst moment for a missing fsync, and the
        // same end state each run rather than a race with the 5 s journal commit.
        g.sh(&format!(": > {COMMIT_MARK} && sync {COMMIT_MARK}"), LONG);
        g.power_cut();
        let mark = g.console_mark();
        g.boot_again();
        let (t, _) = g.wait_console(mark, "regrade-vm: booted", Duration::from_secs(300));
        self.phase(&format!("{}: booted again in {:.1} s", cell.name, t - g.started));
        let end = self.converge_at(g, &[cell.from, cell.to]).await;
        let levels = seen.finish();
        let end = end?;
        row.end = end.clone();
        let allowed: BTreeSet<String> = [cell.from, cell.to].iter().map(|l| l.to_string()).collect();
        if !levels.is_subset(&allowed) {
            return Err(format!("the Node's label passed through {levels:?}, beyond {} and {}", cell.from, cell.to));
        }
        let (found, decision) = self.start_line(g)?;
        row.found = found.clone();
        row.decision = decision.clone();
        let expected = expected_decision((cell.from, cell.to) == (EO, CP), &cell.point);
        if !decision.starts_with(expected) {
            return Err(format!(
                "regrade's start decided {decision:?} where a cut at {} leaves what needs {expected:?} (found: {found})",
                cell.point
            ));
        }
        // What it found is a record of this step's levels (or its undoing), whole.
        let named_levels: BTreeSet<String> = [FULL, CP, EO]
            .iter()
            .filter(|l| found.split("; ").next().unwrap_or("").contains(*l))
            .map(|l| l.to_string())
            .collect();
        if !found.starts_with("record: ")
            || found.starts_with("record: unreadable")
            || found.starts_with("record: none")
        {
            return Err(format!("regrade's start found no whole record: {found}"));
        }
        if !named_levels.is_subset(&allowed) {
            return Err(format!("regrade's start found a record outside {} and {}: {found}", cell.from, cell.to));
        }
        row.files = self.check_files(g, &end)?;
        Ok(())
    }

    /// regrade's files in the guest, read through the guest agent.
    fn files(&self, g: &Guest) -> Files {
        let read = |p: &str| {
            let e = g.exec_input(&format!("cat {p}"), None, LONG).ok()?;
            (e.code == 0).then_some(e.out)
        };
        let record = match g.exec_input(&format!("cat {RECORD}"), None, LONG) {
            Err(e) => Err(e),
            Ok(e) if e.code != 0 => Ok(None),
            Ok(e) => LevelRecord::parse(e.out.as_bytes(), Path::new(RECORD)).map(Some).map_err(|e| e.to_string()),
        };
        Files { record, dropin: read(DROPIN), started: read(STARTED) }
    }

    /// Converged: the record without a step, at the level the Node's marks, the
    /// drop-in and the start record say (full and control-plane share k3s's flags),
    /// the Lease free, server1's etcd member healthy with its ID. That level.
    async fn converged(&self, g: &Guest) -> Result<String, String> {
        let f = self.files(g);
        let r = f.record?.ok_or("no level record")?;
        if let Some(s) = &r.step {
            return Err(format!("a step is under way: {} -> {} at {}", s.from, s.to, s.phase));
        }
        let level = r.level().to_string();
        let marks = self.marks().await?;
        if marks != level {
            return Err(format!("the record says {level}, the Node {marks}"));
        }
        let eo = |l: &str| l == EO;
        let dropin = dropin_level(f.dropin.as_deref());
        if eo(&dropin) != eo(&level) {
            return Err(format!("the record says {level}, the drop-in {dropin}"));
        }
        let started = f.started.as_deref().map(str::trim).ok_or("no start record")?.to_string();
        if eo(&started) != eo(&level) {
            return Err(format!("the record says {level}, k3s was started at {started}"));
        }
        if !g.last_sample().is_some_and(|s| s.etcd_healthy && s.host_t > g.started) {
            return Err("server1's etcd member does not answer /health".into());
        }
        match self.peers[0].server1_member() {
            Some(id) if id == self.member => {}
            other => return Err(format!("server1's etcd member is {other:x?}, not {:x}", self.member)),
        }
        if let Some(h) = self.lease_holder().await? {
            return Err(format!("the Lease is held by {h}"));
        }
        let active = g.exec_input("systemctl is-active regrade.service", None, LONG).map(|e| e.out).unwrap_or_default();
        if active.trim() != "active" {
            return Err(format!("regrade.service is {}", active.trim()));
        }
        Ok(level)
    }

    /// Waits until converged at one of `levels`; the level, or the last reason not.
    async fn converge_at(&self, g: &Guest, levels: &[&str]) -> Result<String, String> {
        let t0 = Instant::now();
        let mut last = String::new();
        while t0.elapsed() < CONVERGE {
            match self.converged(g).await {
                Ok(l) if levels.contains(&l.as_str()) => {
                    self.phase(&format!("converged at {l} in {:.0} s", t0.elapsed().as_secs_f64()));
                    return Ok(l);
                }
                Ok(l) => return Err(format!("converged at {l}, outside {levels:?}")),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let journal = g
            .exec_input("journalctl -b -u regrade.service -o cat --no-pager | tail -n 30", None, LONG)
            .map(|e| e.out)
            .unwrap_or_default();
        Err(format!("not converged at {levels:?} within {CONVERGE:?}: {last}\nregrade's journal:\n{journal}"))
    }

    async fn marks(&self) -> Result<String, String> {
        let n = Api::<Node>::all(self.a2.clone()).get("server1").await.map_err(|e| format!("the Node: {e}"))?;
        let label = n.metadata.labels.as_ref().and_then(|l| l.get(LABEL).cloned());
        let spec = n.spec.unwrap_or_default();
        let cordoned = spec.unschedulable == Some(true);
        let taint = spec.taints.unwrap_or_default().into_iter().find(|t| t.key == TAINT).and_then(|t| t.value);
        match (&label, cordoned, &taint) {
            (None, false, None) => Ok(FULL.into()),
            (Some(l), true, Some(t)) if l == t => Ok(l.clone()),
            _ => Err(format!("the Node's marks disagree: label {label:?}, cordoned {cordoned}, taint {taint:?}")),
        }
    }

    /// Who holds regrade's Lease now (`None`: free or expired).
    async fn lease_holder(&self) -> Result<Option<String>, String> {
        let l = Api::<Lease>::namespaced(self.a2.clone(), "kube-system")
            .get_opt("regrade")
            .await
            .map_err(|e| format!("the Lease: {e}"))?;
        let Some(spec) = l.and_then(|l| l.spec) else { return Ok(None) };
        let Some(holder) = spec.holder_identity.filter(|h| !h.is_empty()) else { return Ok(None) };
        let renewed = spec.renew_time.map_or(0, |t| t.0.as_millisecond());
        let secs = i64::from(spec.lease_duration_seconds.unwrap_or(0));
        let now = k8s_openapi::jiff::Timestamp::now().as_millisecond();
        Ok((renewed + secs * 1000 > now).then_some(holder))
    }

    /// regrade.service's first "the level record and the world" line of this boot:
    /// (what it found, what it decided).
    fn start_line(&self, g: &Guest) -> Result<(String, String), String> {
        let out = g.sh("journalctl -b -u regrade.service -o json --no-pager", LONG);
        out.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["MESSAGE"].as_str().is_some_and(|m| m.starts_with("the level record and the world")))
            .map(|v| (field(&v, "FOUND").to_string(), field(&v, "DECISION").to_string()))
            .ok_or_else(|| "regrade logged no start line in the new boot".to_string())
    }

    /// No file of regrade's or the k3s stand-in's empty, unreadable, or other than its
    /// writer writes it, at the level converged at. Says what was looked at.
    fn check_files(&self, g: &Guest, level: &str) -> Result<String, String> {
        let f = self.files(g);
        let record = f.record.map_err(|e| format!("the level record: {e}"))?.ok_or("no level record")?;
        if record.level().to_string() != level {
            return Err(format!("the record says {}", record.level()));
        }
        let want = regrade::actuator::systemd::dropin::render(
            &regrade::config::Config::default().levels,
            level.parse::<Level>().unwrap(),
        );
        if f.dropin != want {
            return Err(format!("the drop-in is {:?}, regrade writes {want:?} for {level}", f.dropin));
        }
        let started = f.started.unwrap_or_default();
        started.trim().parse::<Level>().map_err(|e| format!("the start record {started:?}: {e}"))?;
        let k3s_config = g.sh("cat /etc/rancher/k3s/config.yaml", LONG);
        if k3s_config != self.k3s_config {
            return Err(format!("k3s's config.yaml changed: {k3s_config:?}"));
        }
        // Every file of regrade's and of the stand-in's: not empty, readable. A durable
        // write's temporary cut before its fsync may be left empty: nothing reads it.
        let dirs = "/var/lib/regrade /run/regrade /etc/regrade /etc/rancher /var/lib/rancher";
        let bad = g.sh(
            &format!("find {dirs} -xdev -type f ! -name '.*.tmp' \\( -empty -o ! -readable \\) -print 2>&1 || true"),
            LONG,
        );
        if !bad.trim().is_empty() {
            return Err(format!("empty or unreadable files: {}", bad.split_whitespace().collect::<Vec<_>>().join(" ")));
        }
        let counted = g.sh(&format!("find {dirs} -xdev -type f | wc -l"), LONG);
        // The caches regrade keeps: whole lines, whole JSON.
        let caches = g.sh("for f in /var/lib/regrade/*; do echo \"== $f\"; cat \"$f\"; done", LONG);
        for part in caches.split("== ").filter(|p| !p.is_empty()) {
            let (name, text) = part.split_once('\n').unwrap_or((part, ""));
            if name.ends_with(".json") && serde_json::from_str::<Value>(text).is_err() {
                return Err(format!("{name} is not whole JSON: {text:?}"));
            }
            if !name.ends_with(".json") && !text.ends_with('\n') {
                return Err(format!("{name} does not end with a whole line: {text:?}"));
            }
        }
        let leftovers = g
            .sh("find /var/lib/regrade /run/regrade /etc/rancher/k3s/config.yaml.d -xdev -name '.*.tmp' | wc -l", LONG);
        Ok(format!("{} files whole; {} temporaries left", counted.trim(), leftovers.trim()))
    }
}

fn dropin_level(text: Option<&str>) -> String {
    match text {
        None => FULL.into(),
        Some(t) => t.lines().find_map(|l| l.strip_prefix("# regrade-level: ")).unwrap_or("edited").trim().to_string(),
    }
}

fn describe(r: &Result<Option<LevelRecord>, String>) -> String {
    match r {
        Err(e) => format!("unreadable ({e})"),
        Ok(None) => "none".into(),
        Ok(Some(r)) => match &r.step {
            None => r.level().to_string(),
            Some(s) => format!("{} -> {} at {}", s.from, s.to, s.phase),
        },
    }
}

/// The levels the Node's label passes through, watched from another thread.
struct Seen {
    stop: Arc<AtomicBool>,
    levels: Arc<Mutex<BTreeSet<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Seen {
    /// Watches through server2's API with `kubeconfig`'s credentials, on a client of
    /// its own (a client serves requests on the runtime that made it).
    fn start(kubeconfig: std::path::PathBuf) -> Seen {
        let stop = Arc::new(AtomicBool::new(false));
        let levels = Arc::new(Mutex::new(BTreeSet::new()));
        let (s, l) = (stop.clone(), levels.clone());
        let thread = std::thread::spawn(move || {
            common::block_on(async move {
                let nodes: Api<Node> = Api::all(client(&kubeconfig, 2).await);
                while !s.load(Ordering::SeqCst) {
                    if let Ok(n) = nodes.get("server1").await {
                        let label = n.metadata.labels.and_then(|m| m.get(LABEL).cloned());
                        l.lock().unwrap().insert(label.unwrap_or_else(|| FULL.into()));
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            })
        });
        Seen { stop, levels, thread: Some(thread) }
    }

    fn finish(mut self) -> BTreeSet<String> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        let l = self.levels.lock().unwrap().clone();
        l
    }
}

fn print_table(rows: &[Row], cmdline: &str, no_fsync: Option<&str>, total: f64) {
    println!(
        "\n== power cuts: server1 (qemu, disks cache=none) cut at a point of a step, booted again{}{} ==",
        if cmdline.is_empty() { String::new() } else { format!(", kernel {cmdline}") },
        no_fsync.map_or(String::new(), |n| format!(", REGRADE_TEST_NO_FSYNC={n}"))
    );
    println!(
        "{:<46} {:<36} {:<64} {:<14} {:>6}  files / failure",
        "cell (step/point)",
        "record in the page cache at the cut",
        "regrade found at its start",
        "converged at",
        "secs"
    );
    for r in rows {
        let found = r.found.strip_prefix("record: ").unwrap_or(&r.found);
        let found = found.split("; ").next().unwrap_or("");
        let decision: String = r.decision.split(':').next().unwrap_or("").chars().take(24).collect();
        let tail =
            r.failed.as_deref().map_or(r.files.clone(), |e| format!("FAILED: {}", e.lines().next().unwrap_or("")));
        println!(
            "{:<46} {:<36} {:<64} {:<14} {:>6.0}  {}",
            r.cell,
            r.before_cut,
            format!("{found} ({decision})"),
            if r.end.is_empty() { "-" } else { &r.end },
            r.secs,
            tail
        );
    }
    let failed = rows.iter().filter(|r| r.failed.is_some()).count();
    println!(
        "{}: converged with the record, the Node's marks, the drop-in and the start record at one level, \
         the Lease free, server1's etcd member back with its ID; no level outside the step's two; no file empty, \
         unreadable or not its writer's; regrade's decision the one the cut leaves; {} cells in {total:.0} s",
        if failed == 0 { "every cell".to_string() } else { format!("{failed} cell(s) FAILED; each other cell") },
        rows.len()
    );
}
