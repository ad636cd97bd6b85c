//! The incident under real memory pressure (issue 26; docs/incident.md): three servers
//! as in tests/testsuite/e2e_three_servers.rs (systemd-nspawn containers in network namespaces,
//! the k3s stand-in with real etcd members and real kube-apiservers), server1 booted
//! inside a cgroup v1 memory cgroup of its own (limit 1536 MiB), and a real workload
//! that makes the kernel reclaim, refault and OOM-kill inside that limit. Three arms
//! from the same start, one after another on one cluster: **nothing** (no regrade on
//! server1), **earlyoom** (Debian's /usr/bin/earlyoom with its defaults, placed in
//! server1's memory cgroup), **regrade** (regrade.service on server1 with the packaged
//! unit, tests/incident/regrade.toml: defaults but sustain 10s, cooldown 20s and the
//! drains' timeouts 30s). A fourth arm runs regrade again with the workload's pod held
//! on server1 by a PodDisruptionBudget, so that the drain frees nothing and regrade
//! goes on to etcd-only; 120 s after k3s was restarted into etcd-only (the thrash goes
//! on meanwhile, so the table shows how long server1's member stays away under it) the
//! test deletes the budget and the pod, as an operator would, and waits for regrade's steps back to
//! full (the step into etcd-only ends only once server1's etcd member is back, which
//! under the thrash is mostly after the pod went).
//! The arms run in the order regrade, held, earlyoom, nothing: the judged ones first, on
//! a cluster no unchecked thrash has touched. Before each arm the workload is killed
//! and scaled to 0, the cluster waited back (server1's member healthy with its ID, its
//! Node Ready and schedulable, a write through server2 answered; k3s on server1
//! restarted by the test, and said so, if that takes over 90 s) and the host's PSI
//! waited back under 5 %.
//!
//! The workload: a Deployment `hog` (one replica). The kubelet stand-in
//! (tests/rig/go/cmd/kubelet-standin, `--exec-node server1 --exec-cgroup DIR`) binds it
//! to the first fitting Node (server1), reports it Running and runs its command as a
//! real process on this host, first putting itself into server1's memory cgroup
//! (DIR = `<cgroup>/workload`): tests/incident/hog.py, which allocates anonymous memory
//! (touched; a start size from the cgroup's free room, then 8 MiB/s) and reads random
//! pages of a 600 MiB file on disk through mmap (eight readers). Evicting or deleting
//! the pod kills its process group; a process that ends by itself (the cgroup's OOM
//! killer) is reported as a container restart (lastState OOMKilled) and run again 5 s
//! later. On another Node the pod only becomes Running: no process.
//!
//! On this host (cgroup v1) the PSI regrade and this test read is **the host's**
//! /proc/pressure/memory: the run takes /tmp/regrade-rig.lock itself so nothing else
//! of the rigs shares it. Available memory is server1's cgroup's figure
//! (`pressure.memory_cgroup`). earlyoom reads the host's /proc/meminfo.
//!
//! Measured, from /proc, the cgroup's files, etcd's member list and metrics (server1's
//! member's /health every 250 ms and its own latencies: tests/testsuite/incident/member.rs), the API,
//! regrade's journal and the kernel log; printed as one table at the end. Bounded:
//! the nothing and earlyoom arms run 120 s from the workload's start; regrade's ends
//! once relieved (PSI under 40 % for 15 s after the onset), then waits at most 90 s
//! for regrade's steps back to full; the held arm runs at most 240 s (360 s if no step
//! into etcd-only was decided by then, and always until 120 s after its restart into
//! etcd-only) before it is resolved and then waits at most 120 s. The host's MemAvailable below 2 GiB at any
//! sample kills the workload and fails the run.
//!
//! It fails if, in regrade's arm, server1 did not step down and back to full or its
//! etcd member lost its ID or health, or if in the held arm server1 did not reach
//! etcd-only and come back to full with its member kept; everything else is reported.
//!
//! Gated by REGRADE_TEST_INCIDENT=1 (root). Run alone (not under flock: it takes the
//! rig lock itself):
//!   REGRADE_TEST_INCIDENT=1 cargo test --test testsuite incident_real_pressure:: -- --nocapture

use crate::common;
use crate::incident::member;
use crate::incident::shared;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::nspawn::Container;
use common::three_servers::{
    addr, api_servers_toml, api_url, container_env, enter_netns, field, in_netns, make_credentials, mint_credential,
    now, repo, run, seed_k3s, Credentials, Network,
};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Api;
use serde_json::{json, Value};

const GATE: &str = "REGRADE_TEST_INCIDENT";
const LIMIT_MIB: u64 = 1536;
const FILE_MIB: u64 = 600;
const GROW_MIB_PER_S: u64 = 16;
/// The workload starts with the cgroup's available memory less this ...
const START_ROOM_MIB: u64 = 640;
/// ... and grows until this much is left for page cache (its file's, and the code of
/// server1's etcd and API server), a sixth of its file: the kernel thrashes.
const CACHE_LEFT_MIB: u64 = 100;
/// regrade's defaults (tests/incident/regrade.toml leaves them): threshold and
/// calm_threshold 40 %, floor 512 MiB.
const THRESHOLD: f64 = 40.0;
const ARM_BOUND: Duration = Duration::from_secs(120);
/// The fourth arm: regrade again, the workload's pod held on server1 by a
/// PodDisruptionBudget (minAvailable 1 of 1 replica), so the drain frees nothing and
/// regrade goes on to etcd-only. Its bound allows two drain timeouts of 30 s.
const HELD: &str = "regrade, pod held by a PDB";
const HELD_BOUND: Duration = Duration::from_secs(240);
/// How long the held arm's thrash goes on after k3s's restart into etcd-only, before
/// the test resolves the incident: long enough to see how long server1's member stays
/// away under it (issue 40: at most 20 s is the aim).
const HELD_AFTER_RESTART: f64 = 120.0;
/// The held arm's bound when at [`HELD_BOUND`] regrade had not yet decided its step into
/// etcd-only (only a step in flight is cut short by the resolution).
const HELD_LATE_BOUND: Duration = Duration::from_secs(360);
/// The held arm's `pressure.threshold` (printed with its config): the arm is there for
/// the step into etcd-only under thrash, not for the default's tuning. A CI run with
/// the default 40 % sat at 33-40 % for 270 s at control-plane (the workload at its
/// cap, thrashing steadily) and never stepped further (docs/incident.md).
const HELD_THRESHOLD: f64 = 25.0;
/// The arms in the order they run: the two the test judges first, on a cluster no
/// unchecked thrash has touched; then the two whose harm is the finding (a run on a
/// clean machine ended the nothing arm with server1's API server not answering).
const ARMS: [&str; 4] = ["regrade", HELD, "earlyoom", "nothing"];
const HOST_FLOOR_KB: u64 = 2 << 20;

/// `[Service]` settings for server1's k3s.service, `;`-separated
/// (`REGRADE_INCIDENT_K3S_UNIT='IOSchedulingClass=realtime'`): a drop-in written before
/// the arms, taking effect at k3s's next start (the restart into etcd-only, for one) —
/// to measure what a setting moves.
const K3S_UNIT_ENV: &str = "REGRADE_INCIDENT_K3S_UNIT";

/// Writes [`K3S_UNIT_ENV`]'s settings as server1's k3s.service drop-in, and says so.
fn k3s_unit_settings(s1: &Server) {
    let Ok(settings) = std::env::var(K3S_UNIT_ENV) else { return };
    let lines: Vec<&str> = settings.split(';').map(str::trim).filter(|l| !l.is_empty()).collect();
    let body = format!("[Service]\n{}\n", lines.join("\n"));
    let root = PathBuf::from(s1.c.var("ROOT"));
    std::fs::write(root.join("etc/systemd/system/k3s.service.d/90-incident.conf"), body).unwrap();
    s1.exec(&["systemctl", "daemon-reload"]);
    println!("server1's k3s.service, from {K3S_UNIT_ENV} (at its next start): {}", lines.join(", "));
}

/// Runs only the arms it names, comma-separated (`regrade`, `held`, `earlyoom`,
/// `nothing`): to measure one arm without the whole run's time.
const ARMS_ENV: &str = "REGRADE_INCIDENT_ARMS";

/// The arms this run takes, in [`ARMS`]'s order; an unknown name fails at once.
fn arms_to_run() -> Vec<&'static str> {
    let Ok(asked) = std::env::var(ARMS_ENV) else { return ARMS.to_vec() };
    let asked: Vec<&str> = asked.split(',').map(str::trim).filter(|a| !a.is_empty()).collect();
    // Each arm's name is one word but the held arm's.
    let known: Vec<&str> = ARMS.iter().map(|a| if *a == HELD { "held" } else { a }).collect();
    for a in &asked {
        assert!(known.iter().any(|k| k == a), "{ARMS_ENV}: no arm {a:?} (arms: {})", known.join(", "));
    }
    ARMS.iter().zip(&known).filter(|(_, k)| asked.contains(k)).map(|(a, _)| *a).collect()
}

/// `REGRADE_INCIDENT_RESERVED=1`: the pods capped by the kubelet's system-reserved
/// memory packaging/ ships, as the kubelet enforces it (the pods' cgroup at the node's
/// memory less the reservation): server1's `workload` cgroup at [`LIMIT_MIB`] less
/// it (768 MiB since 2026-12-07; the earlier runs in docs/incident.md had 512), for
/// every arm of the run. The kubelet stand-in does not read k3s's config. With it, a
/// judged arm that decides no step passes: the thrash may stay in the pods' cap.
const RESERVED_ENV: &str = "REGRADE_INCIDENT_RESERVED";

/// server1's memory cgroup (v1), with the child `workload` the stand-in puts pods'
/// processes in. Dropped: every process in it killed, the directories removed.
struct MemCg(PathBuf);

impl MemCg {
    /// With the pods' cap (`workload`'s limit) when `pods_limit` is given.
    fn make(pods_limit: Option<u64>) -> MemCg {
        let dir = PathBuf::from(format!("/sys/fs/cgroup/memory/regrade-incident-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("memory.limit_in_bytes"), (LIMIT_MIB << 20).to_string()).unwrap();
        std::fs::create_dir(dir.join("workload")).unwrap();
        if let Some(limit) = pods_limit {
            std::fs::write(dir.join("workload/memory.limit_in_bytes"), limit.to_string()).unwrap();
        }
        MemCg(dir)
    }

    /// The pods' cap, if below server1's own limit.
    fn pods_limit(&self) -> Option<u64> {
        let limit: u64 = self.file("workload/memory.limit_in_bytes").trim().parse().ok()?;
        (limit < LIMIT_MIB << 20).then_some(limit)
    }

    fn file(&self, f: &str) -> String {
        std::fs::read_to_string(self.0.join(f)).unwrap_or_default()
    }

    fn stat(&self, key: &str) -> u64 {
        self.file("memory.stat")
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0)
    }

    /// regrade's figure: limit - (usage - inactive file pages), bytes.
    fn available(&self) -> u64 {
        let limit: u64 = self.file("memory.limit_in_bytes").trim().parse().unwrap_or(0);
        let usage: u64 = self.file("memory.usage_in_bytes").trim().parse().unwrap_or(0);
        limit.saturating_sub(usage.saturating_sub(self.stat("total_inactive_file")))
    }

    /// Every PID in the cgroup and its children.
    fn pids(&self) -> Vec<i32> {
        fn walk(d: &Path, out: &mut Vec<i32>) {
            if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
                out.extend(t.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
            }
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        walk(&e.path(), out);
                    }
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.0, &mut out);
        out
    }

    fn kill_workload(&self) {
        for p in std::fs::read_to_string(self.0.join("workload/cgroup.procs")).unwrap_or_default().lines() {
            if let Ok(pid) = p.trim().parse::<i32>() {
                // SAFETY: kills a process this test's workload started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}

impl Drop for MemCg {
    fn drop(&mut self) {
        for _ in 0..40 {
            let pids = self.pids();
            if pids.is_empty() {
                break;
            }
            for p in pids {
                // SAFETY: kills what is left in the cgroup this test made.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let _ = std::fs::remove_dir(self.0.join("workload"));
        let mut subdirs = Vec::new();
        fn dirs(d: &Path, out: &mut Vec<PathBuf>) {
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        dirs(&e.path(), out);
                        out.push(e.path());
                    }
                }
            }
        }
        dirs(&self.0, &mut subdirs);
        for d in subdirs {
            let _ = std::fs::remove_dir(d);
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// The kernel's delay accounting on (`kernel.task_delayacct`) while the test runs, so
/// that regrade's progress lines can say how long it waited for a CPU and for the disk
/// (its own share of a step); put back as it was when dropped.
struct DelayAccounting(String);

const DELAYACCT: &str = "/proc/sys/kernel/task_delayacct";

impl DelayAccounting {
    fn on() -> DelayAccounting {
        let was = std::fs::read_to_string(DELAYACCT).expect(DELAYACCT);
        std::fs::write(DELAYACCT, "1").expect(DELAYACCT);
        DelayAccounting(was)
    }
}

impl Drop for DelayAccounting {
    fn drop(&mut self) {
        let _ = std::fs::write(DELAYACCT, self.0.trim());
    }
}

/// Processes this test runs on the host (controllers, stand-in, earlyoom): killed when
/// dropped.
struct Procs(Vec<std::process::Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Children die with the test, even SIGKILLed (PR_SET_PDEATHSIG).
fn dies_with_us(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl only, between fork and exec.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        })
    }
}

/// What a run that was killed (SIGKILL, CI's timeout) left behind: its memory cgroups
/// and the processes in them, its containers, the network namespaces, its files.
fn sweep_leftovers() {
    for e in std::fs::read_dir("/sys/fs/cgroup/memory").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("regrade-incident-") {
            eprintln!("removing {} left by an earlier run", e.path().display());
            drop(MemCg(e.path()));
        }
    }
    for n in 1..=3 {
        let _ = Command::new(repo("tests/nspawn/container.sh")).args(["down", &format!("incident-server{n}")]).output();
    }
    let _ = Command::new(repo("tests/e2e/netns.sh")).arg("down").output();
    for e in std::fs::read_dir("/var/tmp").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with("regrade-incident.") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

fn spawn_logged(bin: &Path, args: &[&str], log: &Path) -> std::process::Child {
    let f = std::fs::File::create(log).unwrap();
    dies_with_us(&mut Command::new(bin))
        .args(args)
        .stdout(f.try_clone().unwrap())
        .stderr(f)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()))
}

/// Which server's etcd member leads (`etcd_server_is_leader`), or "?" when none says so.
fn leader(servers: &[Server]) -> String {
    servers
        .iter()
        .find(|s| s.etcd_metric("etcd_server_is_leader") == Some(1.0))
        .map_or("?".into(), |s| format!("server{}", s.n))
}

struct Server {
    n: usize,
    c: Container,
}

impl Server {
    fn exec(&self, args: &[&str]) -> String {
        self.c.exec(args)
    }

    fn healthy(&self) -> bool {
        in_netns(self.n, || common::nspawn::health_ok("http://127.0.0.1:2381/health"))
    }

    fn etcd_metric(&self, series: &str) -> Option<f64> {
        let text = in_netns(self.n, || common::nspawn::http_get("http://127.0.0.1:2381/metrics"))?;
        let line = text.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))?;
        line[series.len()..].trim().parse().ok()
    }

    fn member_ids(&self) -> Vec<(String, u64)> {
        let tls = PathBuf::from(self.c.var("ROOT")).join("var/lib/rancher/k3s/server/tls/etcd");
        let cfg = regrade::etcd::EtcdConfig {
            ca_file: tls.join("server-ca.crt"),
            cert_file: tls.join("client.crt"),
            key_file: tls.join("client.key"),
            ..Default::default()
        };
        let url = format!("https://{}:2379", addr(self.n));
        std::thread::spawn(move || {
            let client = regrade::etcd::client::EtcdClient::new(&cfg).unwrap();
            let ep = regrade::etcd::client::Endpoint::parse(&url).unwrap();
            common::block_on(client.member_list(&ep))
                .map(|l| l.members.into_iter().map(|m| (m.name, m.id)).collect())
                .unwrap_or_default()
        })
        .join()
        .unwrap()
    }

    /// The host PID of a unit's main process, if it runs.
    fn unit_host_pid(&self, unit: &str) -> Option<i32> {
        let inner = self.exec(&["systemctl", "show", "-P", "MainPID", unit]).trim().to_string();
        if inner == "0" || inner.is_empty() {
            return None;
        }
        let ours = std::fs::read_link(format!("/proc/{}/ns/pid", self.c.var("PID"))).ok()?;
        for e in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
            if std::fs::read_link(e.path().join("ns/pid")).ok().as_ref() != Some(&ours) {
                continue;
            }
            let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
            let ns_pid =
                status.lines().find_map(|l| l.strip_prefix("NSpid:")).and_then(|l| l.split_whitespace().last());
            if ns_pid == Some(inner.as_str()) {
                return Some(pid);
            }
        }
        None
    }

    /// When regrade's journal since `since` first says "step done" at `level`.
    fn step_done_at(&self, level: &str, since: f64) -> Option<f64> {
        self.first_line("step done", "LEVEL", level, since)
    }

    /// When regrade's journal since `since` says it asked systemd to restart k3s into
    /// `level` (the end of regrade's own share of the step).
    fn restarted_into(&self, level: &str, since: f64) -> Option<f64> {
        self.first_line("restart requested; waiting for a new process and etcd's health", "LEVEL", level, since)
    }

    /// Whether regrade's journal since `since` says it held the step into etcd-only by
    /// its cost (`etcd-only-held`).
    fn held_by_cost(&self, since: f64) -> bool {
        shared::held_by_cost(&self.journal("regrade.service", since))
    }

    /// Whether regrade's journal since `since` says it decided a step into `level`.
    fn stepping_to(&self, level: &str, since: f64) -> bool {
        self.first_line("stepping", "TO", level, since).is_some()
    }

    /// When regrade's journal since `since` first has `message` with `key` = `value`.
    fn first_line(&self, message: &str, key: &str, value: &str, since: f64) -> Option<f64> {
        shared::first_line(&self.journal("regrade.service", since), message, key, value)
    }

    fn journal(&self, unit: &str, since: f64) -> Vec<(f64, String, Value)> {
        self.exec(&["journalctl", "-u", unit, "-o", "json", "--no-pager"])
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| {
                let t = v["__REALTIME_TIMESTAMP"].as_str()?.parse::<f64>().ok()? / 1e6;
                Some((t, v["MESSAGE"].as_str()?.to_string(), v))
            })
            .filter(|(t, ..)| *t >= since)
            .collect()
    }
}

fn seed(tmp: &Path, certs: &Path, names: &[String], n: usize) -> (PathBuf, PathBuf) {
    let (etc, root) = seed_k3s(tmp, certs, names, n);
    // Only server1 runs regrade, and only in the regrade arm (started by the test).
    if n == 1 {
        let toml = std::fs::read_to_string(repo("tests/incident/regrade.toml")).unwrap();
        std::fs::create_dir_all(root.join("etc/regrade")).unwrap();
        std::fs::write(root.join("etc/regrade/regrade.toml"), toml.replace("@API_SERVERS@", &api_servers_toml(n)))
            .unwrap();
    }
    (etc, root)
}

async fn client(kubeconfig: &Path, n: usize) -> kube::Client {
    let kc = Kubeconfig::read_from(kubeconfig).unwrap();
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.unwrap();
    cfg.cluster_url = api_url(n).parse().unwrap();
    cfg.connect_timeout = Some(Duration::from_secs(3));
    cfg.read_timeout = Some(Duration::from_secs(5));
    kube::Client::try_from(cfg).unwrap()
}

/// The Node is Ready and, with `schedulable`, not cordoned.
async fn node_ready(c: &kube::Client, name: &str, schedulable: bool) -> bool {
    let Ok(n) = Api::<Node>::all(c.clone()).get(name).await else { return false };
    let cordoned = n.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
    let ready = n
        .status
        .and_then(|s| s.conditions)
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ready && !(schedulable && cordoned)
}

fn psi_some_avg10() -> f64 {
    let t = std::fs::read_to_string("/proc/pressure/memory").unwrap();
    let some = t.lines().find(|l| l.starts_with("some ")).unwrap();
    some.split_whitespace().find_map(|w| w.strip_prefix("avg10=")).unwrap().parse().unwrap()
}

fn host_mem_available_kb() -> u64 {
    let t = std::fs::read_to_string("/proc/meminfo").unwrap();
    t.lines().find_map(|l| l.strip_prefix("MemAvailable:")).unwrap().split_whitespace().next().unwrap().parse().unwrap()
}

/// Proportional set size: a page shared by n processes counts 1/n in each, so the
/// sum over server1's processes counts the readers' shared file pages once.
fn pss_kb(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A process's major faults and CPU time (user + system) so far, from `/proc/PID/stat`.
#[derive(Clone, Copy, Debug)]
struct Cost {
    majflt: u64,
    cpu_ticks: u64,
}

fn cost(pid: i32) -> Option<Cost> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = s[s.rfind(')')? + 2..].split_whitespace().collect();
    // After the name: state is field 0, majflt 9, utime 11, stime 12 (proc(5)).
    let num = |i: usize| rest.get(i)?.parse::<u64>().ok();
    Some(Cost { majflt: num(9)?, cpu_ticks: num(11)? + num(12)? })
}

/// Clock ticks per second, the unit of `/proc/PID/stat`'s times.
fn ticks_per_second() -> f64 {
    // SAFETY: sysconf reads a constant.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

#[derive(Clone, Debug)]
struct Sample {
    t: f64,
    psi: f64,
    cg_available: u64,
    pss_kb: u64,
    host_available_kb: u64,
    regrade_cost: Option<Cost>,
}

/// Samples every 250 ms until stopped; kills the workload if the host's MemAvailable
/// goes under 2 GiB.
struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    breached: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(cg: Arc<MemCg>, regrade_pid: Option<i32>) -> Sampler {
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let (stop, breached) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (s, v, b) = (stop.clone(), Arc::clone(&samples), breached.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let host_available_kb = host_mem_available_kb();
                if host_available_kb < HOST_FLOOR_KB {
                    b.store(true, Ordering::SeqCst);
                    cg.kill_workload();
                }
                let sample = Sample {
                    t: now(),
                    psi: psi_some_avg10(),
                    cg_available: cg.available(),
                    pss_kb: cg.pids().into_iter().map(pss_kb).sum(),
                    host_available_kb,
                    regrade_cost: regrade_pid.and_then(cost),
                };
                v.lock().unwrap().push(sample);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        Sampler { stop, samples, breached, thread: Some(thread) }
    }

    fn last(&self) -> Option<Sample> {
        self.samples.lock().unwrap().last().cloned()
    }

    fn finish(mut self) -> (Vec<Sample>, bool) {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        let v = self.samples.lock().unwrap().clone();
        (v, self.breached.load(Ordering::SeqCst))
    }
}

/// Writes a ConfigMap through server2's API every 500 ms: (start, seconds, ok).
struct Probe {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(f64, f64, bool)>>>,
}

impl Probe {
    fn start(kubeconfig: PathBuf) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            common::block_on(async move {
                let c = client(&kubeconfig, 2).await;
                let cms: Api<ConfigMap> = Api::namespaced(c, "default");
                let mut out = Vec::new();
                let mut i = 0u64;
                while !s.load(Ordering::SeqCst) {
                    let t0 = now();
                    let patch = json!({"data": {"i": i.to_string()}});
                    let (pp, merge) = (PatchParams::default(), Patch::Merge(&patch));
                    let w = cms.patch("probe", &pp, &merge);
                    let ok = matches!(tokio::time::timeout(Duration::from_secs(5), w).await, Ok(Ok(_)));
                    let took = now() - t0;
                    out.push((t0, took, ok));
                    i += 1;
                    tokio::time::sleep(Duration::from_secs_f64((0.5 - took).max(0.0))).await;
                }
                out
            })
        });
        Probe { stop, thread: Some(thread) }
    }

    fn finish(mut self) -> Vec<(f64, f64, bool)> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap()
    }
}

#[derive(Default)]
struct Row {
    arm: String,
    member: String,
    /// server1's member through the arm (tests/testsuite/incident/member.rs).
    member_distress: String,
    /// The same in the held arm's 120 s after its restart into etcd-only.
    member_after_restart: String,
    leader_changes: String,
    bad_write_seconds: String,
    workload: String,
    killed: String,
    onset_to_relief: String,
    peak_psi: String,
    psi_over: String,
    rss_freed: String,
    regrade_steps: String,
    notes: Vec<String>,
    /// regrade's journal during the arm, also printed with the arm: a failure repeats
    /// it, since CI may show only the end of the output.
    journal: Vec<String>,
    /// server1's member kept its ID and is healthy at the end.
    member_kept: bool,
    /// regrade took a step down and came back to full.
    regrade_round_trip: bool,
    /// regrade decided a step down in the arm.
    stepped: bool,
    /// regrade stepped into etcd-only.
    reached_etcd_only: bool,
    /// regrade held the step into etcd-only at control-plane by its cost (the member
    /// in distress after a drain that freed nothing: `decide::weigh_etcd_only`).
    held_at_control_plane: bool,
}

/// The hog pods not being deleted: (node, restarts, last termination reason).
async fn hog_pods(c: &kube::Client) -> Result<Vec<(String, i32, String)>, kube::Error> {
    let pods = Api::<Pod>::namespaced(c.clone(), "default").list(&ListParams::default().labels("app=hog")).await?.items;
    Ok(pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_else(|| "unbound".into());
            let cs = p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).and_then(|c| c.first().cloned());
            let restarts = cs.as_ref().map_or(0, |c| c.restart_count);
            let reason =
                cs.and_then(|c| c.last_state).and_then(|s| s.terminated).and_then(|t| t.reason).unwrap_or_default();
            (node, restarts, reason)
        })
        .collect())
}

/// The kernel's OOM kills since `since` (unix seconds): the killed processes' names.
fn oom_kills_since(since: f64) -> Vec<String> {
    let out = Command::new("dmesg").args(["--time-format", "iso"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let mut killed = Vec::new();
    for l in text.lines() {
        let Some((ts, msg)) = l.split_once(' ') else { continue };
        let Ok(t) = chrono_like_parse(ts) else { continue };
        if t < since {
            continue;
        }
        // "Memory cgroup out of memory: Killed process 1234 (python3) total-vm:..."
        if let Some(rest) = msg.split("Killed process ").nth(1) {
            if let (Some(a), Some(b)) = (rest.find('('), rest.find(')')) {
                killed.push(rest[a + 1..b].to_string());
            }
        }
    }
    killed
}

/// dmesg's ISO time (2026-12-02T05:40:01,123456+00:00) as unix seconds.
fn chrono_like_parse(ts: &str) -> Result<f64, ()> {
    let ts = ts.replace(',', ".");
    let t: k8s_openapi::jiff::Timestamp = ts.parse().map_err(|_| ())?;
    Ok(t.as_millisecond() as f64 / 1e3)
}

/// Waits for `f`, polling every 250 ms; `None` after `within`.
async fn wait_until<T>(within: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if t0.elapsed() >= within {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[test]
fn incident_three_arms() {
    if !common::gate_open(GATE, "incident_three_arms", "root; boots three systemd-nspawn containers, thrashes the host")
    {
        return;
    }
    // The rig lock: no other rig test shares the host's PSI meanwhile.
    let lock =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open("/tmp/regrade-rig.lock").unwrap();
    // SAFETY: flock on a file this test opened.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    assert!(Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists(), "needs the cgroup v1 memory controller");
    sweep_leftovers();
    let earlyoom = Path::new("/usr/bin/earlyoom");
    assert!(earlyoom.exists(), "needs Debian's earlyoom (apt-get install earlyoom)");

    let t_start = Instant::now();
    let bin = common::built("tests/rig/build.sh");
    let rootfs = Command::new(repo("tests/nspawn/rootfs.sh")).stderr(std::process::Stdio::inherit()).output().unwrap();
    assert!(rootfs.status.success(), "tests/nspawn/rootfs.sh failed");

    // The workload's file, on disk (tmpfs pages could not be evicted), out of the cache.
    let work = tempfile::Builder::new().prefix("regrade-incident.").tempdir_in("/var/tmp").unwrap();
    let data = work.path().join("data");
    run(
        Path::new("dd"),
        &["if=/dev/urandom", &format!("of={}", data.display()), "bs=1M", &format!("count={FILE_MIB}"), "status=none"],
    );

    let st = Command::new(repo("tests/e2e/netns.sh")).arg("up").status().unwrap();
    assert!(st.success(), "tests/e2e/netns.sh up");
    let network = Network;
    enter_netns("regrade-e2e-hub");
    let pods_capped = std::env::var(RESERVED_ENV).as_deref() == Ok("1");
    let pods_limit = pods_capped.then(|| (LIMIT_MIB << 20) - shared::system_reserved_bytes());
    let cg = Arc::new(MemCg::make(pods_limit));
    let delays = DelayAccounting::on();

    let tmp = tempfile::tempdir().unwrap();
    let Credentials { certs, names, .. } = make_credentials(tmp.path(), &bin.join("harness"));
    let specs: Vec<(String, Vec<(&str, String)>)> = (1..=3)
        .map(|n| {
            let (etc, root) = seed(tmp.path(), &certs, &names, n);
            let mut env = container_env(n, &etc, &root, &bin);
            if n == 1 {
                env.push(("REGRADE_NSPAWN_MEMORY_CGROUP", cg.0.display().to_string()));
                // The packaged unit keeps CAP_IPC_LOCK for regrade's mlock; nspawn's
                // default bounding set leaves it out, which a real host does not.
                env.push(("REGRADE_NSPAWN_CAPABILITY", "CAP_IPC_LOCK".into()));
            }
            (format!("incident-server{n}"), env)
        })
        .collect();
    let specs: Vec<(&str, Vec<(&str, String)>)> = specs.iter().map(|(n, e)| (n.as_str(), e.clone())).collect();
    let servers: Vec<Server> =
        Container::up_many(&specs).into_iter().enumerate().map(|(i, c)| Server { n: i + 1, c }).collect();
    println!("[{:>6.1}s] three containers up", t_start.elapsed().as_secs_f64());

    let rows = common::block_on(scenario(&servers, &bin, &certs, &cg, &data, work.path(), t_start));
    print_table(&rows);
    // What the run must show (the figures are printed above either way): in regrade's
    // arm, server1 stepped down and back to full and its etcd member kept its ID and
    // health. The other arms are reported, not judged: their harm is the finding.
    // With the pods capped by system-reserved their thrash may stay in the cap, and
    // no step at all is right too (the held arm's step into etcd-only included).
    let said = |r: &Row| {
        format!(
            "steps: {}; notes: {}; regrade's journal:\n{}",
            r.regrade_steps,
            r.notes.join("; "),
            r.journal.join("\n")
        )
    };
    if let Some(regrade) = rows.iter().find(|r| r.arm == "regrade") {
        assert!(
            regrade.regrade_round_trip || (pods_capped && !regrade.stepped),
            "regrade did not step server1 down and back to full; {}",
            said(regrade)
        );
        assert!(
            regrade.member_kept,
            "regrade's arm: server1's etcd member did not survive: {}; {}",
            regrade.member,
            said(regrade)
        );
    }
    if let Some(held) = rows.iter().find(|r| r.arm == HELD) {
        assert!(
            held.reached_etcd_only || held.held_at_control_plane || (pods_capped && !held.stepped),
            "the held arm: regrade neither stepped server1 into etcd-only nor held that step by its cost; {}",
            said(held)
        );
        assert!(
            held.regrade_round_trip || (pods_capped && !held.stepped),
            "the held arm: regrade did not step server1 back to full; {}",
            said(held)
        );
        assert!(
            held.member_kept,
            "the held arm: server1's etcd member did not survive: {}; {}",
            held.member,
            said(held)
        );
    }
    println!("[done] whole run in {:.1}s", t_start.elapsed().as_secs_f64());
    drop(servers);
    drop(cg);
    drop(delays);
    drop(network);
    drop(lock);
}

async fn scenario(
    servers: &[Server],
    bin: &Path,
    certs: &Path,
    cg: &Arc<MemCg>,
    data: &Path,
    work: &Path,
    t_start: Instant,
) -> Vec<Row> {
    let phase = |name: &str| println!("[{:>6.1}s] {name}", t_start.elapsed().as_secs_f64());
    let [s1, s2, s3] = [&servers[0], &servers[1], &servers[2]];
    let admin_kc = certs.join("admin.kubeconfig");
    let a2 = client(&admin_kc, 2).await;
    for n in ["server1", "server2", "server3"] {
        let ok = wait_until(Duration::from_secs(180), async || node_ready(&a2, n, false).await.then_some(())).await;
        assert!(ok.is_some(), "Node {n} not Ready within 180s");
    }
    // regrade.service is enabled by the packaging in every container: only server1's
    // runs, and only in the regrade arm.
    for s in servers {
        s.exec(&["systemctl", "stop", "regrade.service"]);
    }
    mint_credential(bin, certs, &s1.c);
    k3s_unit_settings(s1);
    Api::<ConfigMap>::namespaced(a2.clone(), "default")
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": "probe"}})).unwrap())
        .await
        .unwrap();

    // The controllers and the kubelet stand-in that runs server1's pods for real.
    let workload_cg = cg.0.join("workload");
    let kc = format!("--kubeconfig={}", admin_kc.display());
    let _controllers = Procs(vec![
        spawn_logged(
            &bin.join("kube-controller-manager"),
            &[
                &kc,
                "--leader-elect=false",
                "--controllers=deployment,replicaset,serviceaccount,disruption",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                "-v=1",
            ],
            &work.join("kube-controller-manager.log"),
        ),
        spawn_logged(
            &bin.join("kubelet-standin"),
            &[
                &kc,
                "--nodes=server1,server2,server3",
                "--schedule",
                "--exec-node=server1",
                &format!("--exec-cgroup={}", workload_cg.display()),
            ],
            &work.join("kubelet-standin.log"),
        ),
    ]);
    let hog = repo("tests/incident/hog.py");
    let member_id = |s: &Server| s.member_ids().into_iter().find(|(n, _)| n.starts_with("server1-")).map(|(_, id)| id);
    let id_before = member_id(s2).expect("server1's etcd member, seen through server2");
    let pods_cap = cg.pods_limit().map_or("none (no system-reserved)".to_string(), |l| {
        format!("{} MiB (system-reserved {} MiB, {RESERVED_ENV}=1)", l >> 20, shared::system_reserved_bytes() >> 20)
    });
    phase(&format!(
        "cluster up: 3 Nodes Ready, server1's etcd member {id_before:x}; limit {LIMIT_MIB} MiB; the pods' cap {pods_cap}"
    ));

    let mut rows: Vec<Row> = Vec::new();
    for arm in arms_to_run() {
        // What it took to get back to the start is the previous arm's doing.
        let recovery = same_start(&a2, s1, s2, cg, id_before, arm).await;
        if let Some(prev) = rows.last_mut() {
            prev.notes.extend(recovery);
        }

        let mut extra = Procs(Vec::new());
        let mut regrade_pid = None;
        match arm {
            "earlyoom" => {
                // In server1's memory cgroup, as if installed there; its defaults.
                let sh = format!("echo $$ > {}/cgroup.procs && exec {}", workload_cg.display(), earlyoom_path());
                let log = std::fs::File::create(work.join("earlyoom.log")).unwrap();
                extra.0.push(
                    dies_with_us(&mut Command::new("/bin/sh"))
                        .args(["-c", &sh])
                        .stdout(log.try_clone().unwrap())
                        .stderr(log)
                        .spawn()
                        .unwrap(),
                );
                let started = wait_until(Duration::from_secs(10), async || {
                    std::fs::read_to_string(work.join("earlyoom.log"))
                        .unwrap_or_default()
                        .contains("mem total")
                        .then_some(())
                })
                .await;
                assert!(
                    started.is_some(),
                    "earlyoom did not start: {}",
                    std::fs::read_to_string(work.join("earlyoom.log")).unwrap_or_default()
                );
            }
            "regrade" | HELD => {
                if arm == HELD {
                    shared::pdb(&a2, true).await;
                    let set = format!("s/^\\[pressure\\]$/[pressure]\\nthreshold = {HELD_THRESHOLD}/");
                    s1.exec(&["sed", "-i", &set, "/etc/regrade/regrade.toml"]);
                }
                s1.exec(&["systemctl", "start", "regrade.service"]);
                let since = now() - 5.0;
                let up = wait_until(Duration::from_secs(30), async || {
                    s1.journal("regrade.service", since)
                        .iter()
                        .any(|(_, m, _)| m == "regrade watch starting")
                        .then_some(())
                })
                .await;
                assert!(up.is_some(), "regrade.service did not start on server1");
                regrade_pid = s1.unit_host_pid("regrade.service");
                let locked = regrade_pid
                    .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
                    .and_then(|t| t.lines().find(|l| l.starts_with("VmLck:")).map(str::to_string))
                    .unwrap_or_default();
                // Its niceness: field 19 of /proc/PID/stat (the unit's Nice=).
                let nice = regrade_pid
                    .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
                    .and_then(|t| Some(t[t.rfind(')')? + 2..].split_whitespace().nth(19 - 3)?.to_string()))
                    .unwrap_or_default();
                // Its I/O class, per thread (the unit's IOSchedulingClass=; each thread
                // has its own, inherited from its creator).
                let io_classes: std::collections::BTreeSet<String> = regrade_pid
                    .and_then(|p| std::fs::read_dir(format!("/proc/{p}/task")).ok())
                    .into_iter()
                    .flatten()
                    .filter_map(|t| {
                        let out = Command::new("ionice").arg("-p").arg(t.ok()?.file_name()).output().ok()?;
                        Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
                    })
                    .collect();
                phase(&format!(
                    "regrade on server1: host PID {regrade_pid:?}, {locked}, nice {nice}, I/O {io_classes:?}"
                ));
                let cfg = s1.exec(&["cat", "/etc/regrade/regrade.toml"]);
                phase(&format!("regrade.service on server1 with {} (every other key default)", keys_set(&cfg)));
            }
            _ => {}
        }

        let leaders_before: Vec<Option<f64>> =
            [s2, s3].iter().map(|s| s.etcd_metric("etcd_server_leader_changes_seen_total")).collect();
        let leader_before = leader(servers);
        let start_room = cg.available() >> 20;
        let initial = start_room.saturating_sub(START_ROOM_MIB);
        let cap = start_room.saturating_sub(CACHE_LEFT_MIB);
        let sampler = Sampler::start(Arc::clone(cg), regrade_pid);
        let probe = Probe::start(admin_kc.clone());
        let watch = member::MemberWatch::start(
            now,
            || enter_netns(&common::three_servers::netns(1)),
            |path| common::nspawn::http_get(&format!("http://127.0.0.1:2381{path}")),
        );
        let t0 = now();
        phase(&format!("arm {arm}: workload on (start {initial} MiB of {start_room} MiB free in the cgroup, then {GROW_MIB_PER_S} MiB/s up to {cap} MiB)"));
        start_workload(&a2, &hog, data, initial, cap).await;

        // Until the bound, or 20 s after relief (PSI back under the threshold after onset).
        // Relief: PSI under the threshold (= regrade's default calm_threshold) after
        // the onset, and staying there 15 s.
        // The held arm instead runs until 120 s after its restart into etcd-only (or its
        // bound), and then the test resolves the incident as an operator would.
        let mut onset: Option<f64> = None;
        let mut below: Option<f64> = None;
        let mut relief: Option<f64> = None;
        let mut restarted_etcd_only: Option<f64> = None;
        let mut bound = if arm == HELD { HELD_BOUND } else { ARM_BOUND };
        let mut polls = 0u32;
        while now() - t0 < bound.as_secs_f64() {
            tokio::time::sleep(Duration::from_millis(250)).await;
            polls += 1;
            if arm == HELD && restarted_etcd_only.is_none() && polls % 8 == 0 {
                restarted_etcd_only = s1.restarted_into("etcd-only", t0);
                // The thrash runs its full time after the restart, whatever the bound.
                if let Some(t) = restarted_etcd_only {
                    bound = bound.max(Duration::from_secs_f64(t - t0 + HELD_AFTER_RESTART + 1.0));
                }
            }
            // The held arm's step into etcd-only not yet decided at its bound (the
            // pressure at control-plane not over for `sustain` after the cooldown, or
            // a step refused or failed before): it gets the late bound, and the note.
            let late = arm == HELD && bound == HELD_BOUND && now() - t0 >= HELD_BOUND.as_secs_f64() - 1.0;
            if late && !s1.stepping_to("etcd-only", t0) && !s1.held_by_cost(t0) {
                bound = HELD_LATE_BOUND;
                phase(&format!("arm {arm}: no step into etcd-only decided yet; waiting up to {} s", bound.as_secs()));
            }
            if restarted_etcd_only.is_some_and(|t| now() - t >= HELD_AFTER_RESTART) {
                break;
            }
            let Some(s) = sampler.last() else { continue };
            if onset.is_none() && s.psi >= THRESHOLD {
                onset = Some(s.t);
            }
            if onset.is_some() {
                below = if s.psi < THRESHOLD { below.or(Some(s.t)) } else { None };
            }
            if relief.is_none() && below.is_some_and(|b| s.t - b >= 15.0) {
                relief = below;
            }
            // Only regrade's arm ends at relief: without it, the bound shows whether
            // the thrash comes back.
            if relief.is_some() && arm == "regrade" {
                break;
            }
        }
        // The held arm, resolved: the budget and the pod deleted (through server2), the
        // Deployment's new pod goes to another Node, and the process on server1 dies.
        let mut resolved = None;
        if arm == HELD {
            shared::pdb(&a2, false).await;
            shared::delete_hog_pods(&a2).await;
            resolved = Some(now());
            phase(&format!(
                "arm {arm}: the budget and the pod deleted at +{:.1}s (server1 {})",
                now() - t0,
                if restarted_etcd_only.is_some() {
                    "restarted into etcd-only 120 s before"
                } else {
                    "never restarted into etcd-only"
                }
            ));
        }
        // The regrade arms: up to a further 90 s (held: 120 s, two cooldowns) for its
        // steps back to full (event: the journal's "step done" at level full).
        let mut back_full = None;
        if arm == "regrade" || arm == HELD {
            let within = Duration::from_secs(if arm == HELD { 120 } else { 90 });
            back_full = wait_until(within, async || s1.step_done_at("full", t0)).await;
            s1.exec(&["systemctl", "stop", "regrade.service"]);
            s1.exec(&["sed", "-i", "/^threshold = /d", "/etc/regrade/regrade.toml"]);
        }
        let probes = probe.finish();
        let etcd1 = watch.finish();
        let pods = hog_pods(&a2).await;
        let (samples, breached) = sampler.finish();
        let t_end = now();
        drop(extra);
        let leaders_after: Vec<Option<f64>> =
            [s2, s3].iter().map(|s| s.etcd_metric("etcd_server_leader_changes_seen_total")).collect();
        let leader_after = leader(servers);

        let mut row = Row { arm: arm.into(), member_distress: etcd1.cell(), ..Row::default() };
        if let Some(r) = restarted_etcd_only {
            let (s, stretches) = etcd1.within(r, r + HELD_AFTER_RESTART);
            let parts: Vec<String> = stretches.iter().map(|(t, d)| format!("+{:.1}s for {d:.1}s", t - r)).collect();
            row.member_after_restart = format!(
                "unhealthy {s:.1} s of {HELD_AFTER_RESTART:.0} s{}",
                if parts.is_empty() { String::new() } else { format!(": {}", parts.join(", ")) }
            );
        }
        if !etcd1.stretches.is_empty() {
            let s: Vec<String> = etcd1.stretches.iter().map(|(t, d)| format!("+{:.1}s for {d:.1}s", t - t0)).collect();
            row.notes.push(format!("server1's member unhealthy from {}", s.join(", ")));
        }
        let id_after = member_id(s2);
        // Kept: healthy again once the incident is over, not at one look as it ends.
        let healthy = shared::wait_until(shared::MEMBER_BACK, async || s1.healthy().then_some(())).await.is_some();
        row.member_kept = id_after == Some(id_before) && healthy;
        row.member = match id_after {
            Some(id) if id == id_before && healthy => format!("same ID {id:x}, healthy"),
            Some(id) if id == id_before => format!("same ID {id:x}, NOT healthy"),
            Some(id) => format!("NEW ID {id:x}"),
            None => "GONE from the member list".into(),
        };
        let changes: Vec<String> = leaders_before
            .iter()
            .zip(&leaders_after)
            .map(|(b, a)| match (b, a) {
                (Some(b), Some(a)) => format!("{}", a - b),
                _ => "?".into(),
            })
            .collect();
        // A leader restarted hands its leadership on (etcd's graceful stop), which
        // counts as a change: who led before and after says whether that was it.
        row.leader_changes = format!(
            "{} (seen by server2, server3); leader before {leader_before}, after {leader_after}",
            changes.join(", ")
        );
        let bad: BTreeSet<i64> =
            probes.iter().filter(|(_, took, ok)| !ok || *took > 1.0).map(|(t, ..)| *t as i64).collect();
        let failed = probes.iter().filter(|(_, _, ok)| !ok).count();
        row.bad_write_seconds = format!("{} s ({} of {} writes failed)", bad.len(), failed, probes.len());
        let kills = oom_kills_since(t0);
        let hog_kills = kills.iter().filter(|k| k.starts_with("python")).count();
        let others: Vec<&String> = kills.iter().filter(|k| !k.starts_with("python")).collect();
        row.workload = match pods.as_deref().map(<[_]>::first) {
            Err(e) => format!("unknown: the API through server2 did not list the pods ({e})"),
            Ok(None) => "no pod".into(),
            Ok(Some((node, restarts, reason))) if node == "server1" && *restarts > 0 => {
                format!("on server1, {restarts} restarts (last: {reason}), {hog_kills} OOM kills of its processes")
            }
            Ok(Some((node, ..))) if node == "server1" => "on server1, never killed: still running at the end".into(),
            Ok(Some((node, restarts, _))) => {
                let how = if resolved.is_some() { "deleted by the test" } else { "evicted" };
                format!("{how}, rescheduled on {node} ({restarts} restarts on server1 before; {hog_kills} OOM kills)")
            }
        };
        row.killed = if others.is_empty() { "nothing else".into() } else { format!("{others:?}") };
        let peak = samples.iter().map(|s| s.psi).fold(0.0, f64::max);
        row.peak_psi = format!("{peak:.1} % (host's)");
        let over = shared::seconds_where(&samples, |s| s.t, |s| s.psi >= THRESHOLD);
        row.psi_over = format!("{over:.1} s of {:.0} s", t_end - t0);
        row.onset_to_relief = match (onset, relief) {
            (None, _) => format!("never reached {THRESHOLD} %"),
            (Some(o), Some(r)) => format!("{:.1} s (onset {:.1} s after start)", r - o, o - t0),
            (Some(o), None) => format!("no relief within {} s of start (onset {:.1} s)", bound.as_secs(), o - t0),
        };
        if breached {
            row.notes.push("host MemAvailable fell under 2 GiB: workload killed by the test".into());
        }
        let min_host = samples.iter().map(|s| s.host_available_kb).min().unwrap_or(0);
        row.notes.push(format!("host MemAvailable min {} MiB", min_host >> 10));
        let min_cg = samples.iter().map(|s| s.cg_available).min().unwrap_or(0);
        row.notes.push(format!("cgroup available min {} MiB", min_cg >> 20));
        match arm {
            "earlyoom" => {
                let log = std::fs::read_to_string(work.join("earlyoom.log")).unwrap_or_default();
                let acted = log.lines().filter(|l| l.contains("sending SIG") && l.contains("to process")).count();
                row.notes.push(if acted == 0 {
                    "earlyoom never acted: it reads the host's /proc/meminfo, not the cgroup's".into()
                } else {
                    format!("earlyoom acted {acted} times")
                });
            }
            "regrade" | HELD => {
                // Where a k3s start under the thrash spends its time: the stand-in's own
                // lines (the temporary etcd's reconcile, the member's start and ready,
                // the local API server) and how many lines etcd logged meanwhile.
                if let Some(r) = restarted_etcd_only {
                    println!("-- server1's k3s from the restart into etcd-only (seconds after its request):");
                    let mut etcd_lines = 0;
                    for (t, m, _) in
                        s1.journal("k3s.service", r).into_iter().filter(|(t, ..)| *t <= r + HELD_AFTER_RESTART)
                    {
                        // etcd's own lines are JSON (zap); the stand-in's are not.
                        if !m.starts_with('{') {
                            println!("  {:>7.2}s {m}", t - r);
                        } else {
                            etcd_lines += 1;
                        }
                    }
                    println!("  ({etcd_lines} lines of etcd's own log meanwhile)");
                }
                println!("-- server1's regrade journal during the arm (seconds from the workload's start):");
                for (t, m, v) in s1.journal("regrade.service", t0) {
                    // The error, where a slow look at etcd spent its time, how long after
                    // the decision a part of a step ended and how much of that was
                    // regrade's own time.
                    let fields: Vec<String> =
                        ["ERROR", "AFTER_MS", "OWN_MS", "LIST_MS", "LIST_FROM", "STATUS_MS", "SLOWEST_MEMBER"]
                            .iter()
                            .map(|k| (k, field(&v, k)))
                            .filter(|(_, f)| *f != "?")
                            .map(|(k, f)| format!("{}: {f}", k.to_lowercase()))
                            .collect();
                    let fields = if fields.is_empty() { String::new() } else { format!(" ({})", fields.join(", ")) };
                    let line = format!("  {:>7.2}s {m}{fields}", t - t0);
                    println!("{line}");
                    row.journal.push(line);
                }
                let (freed, steps) = regrade_figures(s1, t0, &samples);
                row.rss_freed = freed;
                row.regrade_steps = steps;
                // A step counts once done: an attempt rolled back did not reach its level.
                let down = s1.step_done_at("control-plane", t0).is_some();
                row.regrade_round_trip = down && back_full.is_some();
                row.stepped = s1.stepping_to("control-plane", t0);
                row.reached_etcd_only = s1.step_done_at("etcd-only", t0).is_some();
                row.held_at_control_plane = s1.held_by_cost(t0);
                if row.held_at_control_plane {
                    row.notes.push("regrade held the step into etcd-only by its cost (etcd-only-held)".into());
                }
                if back_full.is_none() {
                    row.notes.push("regrade did not step back to full in time after the bound/relief".into());
                }
                if let Some(r) = resolved {
                    row.notes.push(format!(
                        "the pod was held by a PodDisruptionBudget until the test deleted both at +{:.1}s",
                        r - t0
                    ));
                }
            }
            _ => {}
        }
        row.notes.push(format!("arm took {:.0} s", t_end - t0));
        phase(&format!("arm {arm} done"));
        rows.push(row);
    }
    // The last arm may leave the cluster thrashing: the workload is killed here, and
    // what is left goes with the containers and the cgroup.
    cg.kill_workload();
    let _ = scale_to_zero(&a2).await;
    rows
}

/// Every arm's start: the workload gone (killed in server1's cgroup at once, since an
/// API server under thrash may not answer, and scaled to 0 so that the kubelet
/// stand-in does not run it again), server1's etcd member healthy with the ID it had
/// before the first arm, its Node Ready and schedulable, a write through server2's API
/// answered, dirty pages written back, the page cache dropped and the host's PSI under
/// 5 %. If the cluster is not back 90 s after the workload went, the test restarts k3s
/// on server1 as an operator would, and says so: the returned notes, which belong to
/// the arm before.
async fn same_start(a2: &kube::Client, s1: &Server, s2: &Server, cg: &MemCg, member: u64, arm: &str) -> Vec<String> {
    let workload_cg = cg.0.join("workload");
    let gone = wait_until(Duration::from_secs(120), async || {
        cg.kill_workload();
        let scaled = scale_to_zero(a2).await.is_ok();
        let no_pod = hog_pods(a2).await.is_ok_and(|p| p.is_empty());
        let no_process = std::fs::read_to_string(workload_cg.join("cgroup.procs")).unwrap().trim().is_empty();
        (scaled && no_pod && no_process).then_some(())
    })
    .await;
    assert!(gone.is_some(), "the workload did not go before arm {arm}");

    let mut notes = Vec::new();
    let t0 = Instant::now();
    let back = async || {
        let member_ok =
            s1.healthy() && s2.member_ids().iter().any(|(n, id)| n.starts_with("server1-") && *id == member);
        (member_ok && node_ready(a2, "server1", true).await && api_write(a2).await).then_some(())
    };
    if wait_until(Duration::from_secs(90), back).await.is_none() {
        s1.exec(&["systemctl", "restart", "k3s.service"]);
        let again = wait_until(Duration::from_secs(180), back).await;
        assert!(
            again.is_some(),
            "before arm {arm}: server1's etcd member (ID {member:x}), its Node or the API through server2 not back \
             within 90 s of the workload's end, nor 180 s after the test restarted k3s on server1"
        );
        notes.push(
            "after the arm the test restarted k3s on server1: its member, Node or the API was not back in 90 s".into(),
        );
    }
    notes.push(format!("cluster back {:.0} s after the workload went", t0.elapsed().as_secs_f64()));

    // Written back first: dirty pages (the file just written) are not dropped, and
    // pages cached outside server1's cgroup would not count against its limit.
    run(Path::new("sync"), &[]);
    std::fs::write("/proc/sys/vm/drop_caches", "1").unwrap();
    let calm = wait_until(Duration::from_secs(90), async || (psi_some_avg10() < 5.0).then_some(())).await;
    assert!(calm.is_some(), "the host's PSI did not fall under 5 % before arm {arm}");
    notes
}

/// A write through the API (the probe's ConfigMap) answered.
async fn api_write(c: &kube::Client) -> bool {
    let cms: Api<ConfigMap> = Api::namespaced(c.clone(), "default");
    let patch = json!({"data": {"start": now().to_string()}});
    cms.patch("probe", &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok()
}

/// Every key a TOML file sets, as `section.key = value`, on one line.
fn keys_set(toml: &str) -> String {
    let mut section = String::new();
    let mut keys = Vec::new();
    for l in toml.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if let Some(name) = l.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = format!("{name}.");
        } else {
            keys.push(format!("{section}{l}"));
        }
    }
    keys.join(", ")
}

fn earlyoom_path() -> &'static str {
    "/usr/bin/earlyoom"
}

/// The Deployment `hog` with one replica and the workload's sizes; created at the first
/// call.
async fn start_workload(c: &kube::Client, hog: &Path, data: &Path, initial: u64, cap: u64) {
    let d: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(c.clone(), "default");
    // The start size lives in the pod template: a new size is a new ReplicaSet.
    let dep = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "hog", "namespace": "default"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "hog"}},
                 "template": {"metadata": {"labels": {"app": "hog"}},
                              "spec": {"automountServiceAccountToken": false, "terminationGracePeriodSeconds": 1,
                                       "containers": [{"name": "hog", "image": "registry.invalid/hog:1",
                                                       "command": ["python3", hog.display().to_string(), data.display().to_string(),
                                                                   initial.to_string(), GROW_MIB_PER_S.to_string(), cap.to_string()]}]}}}
    });
    d.patch("hog", &PatchParams::apply("incident").force(), &Patch::Apply(&dep)).await.unwrap();
}

/// The Deployment `hog` scaled to 0, if there is one.
async fn scale_to_zero(c: &kube::Client) -> Result<(), kube::Error> {
    let d: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(c.clone(), "default");
    if d.get_opt("hog").await?.is_some() {
        d.patch("hog", &PatchParams::default(), &Patch::Merge(&json!({"spec": {"replicas": 0}}))).await?;
    }
    Ok(())
}

/// regrade's steps in its journal since `t0`: RSS of server1's processes at each
/// level (from the samples), and per step its major faults, CPU time and its share.
///
/// Its share is read from its own progress lines, on its own clock: `after_ms` is the
/// wall time since the decision, `own_ms` how much of it regrade ran, waited for a CPU
/// or waited for the disk (the rest it waited for the API, etcd, systemd or the
/// drain's pods). Up to asking systemd for the restart in a step that restarts k3s,
/// else up to the step's end. The journal's own times (when journald received a line)
/// give the wall times from the decision to "drop-in written" and "restart requested".
fn regrade_figures(s1: &Server, t0: f64, samples: &[Sample]) -> (String, String) {
    let journal = s1.journal("regrade.service", t0);
    let at = |t: f64| samples.iter().rev().find(|s| s.t <= t).or(samples.first());
    let ms = |v: &Value, k: &str| field(v, k).parse::<f64>().ok().map(|m| m / 1000.0);
    let mut freed = Vec::new();
    let mut steps = Vec::new();
    let mut start: Option<(f64, String, String)> = None;
    let (mut dropin, mut restart) = (None, None);
    let (mut marked, mut drained, mut own, mut over) = (None, None, None, None);
    for (t, msg, v) in &journal {
        match msg.as_str() {
            "stepping" => {
                start = Some((*t, field(v, "LEVEL").to_string(), field(v, "TO").to_string()));
                (dropin, restart, marked, drained, own, over) = (None, None, None, None, None, None);
            }
            m if m.starts_with("drop-in written") => dropin = Some(*t),
            m if m.starts_with("restart requested") => restart = Some(*t),
            "the Node is marked" => marked = ms(v, "AFTER_MS"),
            "the drain is over" => drained = ms(v, "AFTER_MS"),
            "asking systemd to restart k3s" => own = Some(v.clone()),
            "the step is over; releasing the Lease" => over = Some(v.clone()),
            // A failed step ends at watch's "step failed" (the actuator's "step failed;
            // restoring" comes before its rollback).
            m if m == "step done" || m == "step failed" => {
                let Some((ts, from, to)) = start.take() else { continue };
                let failed = if m == "step failed" { " FAILED and rolled back" } else { "" };
                // The step's end: the last sample of regrade's faults by then (the test
                // may stop regrade right after its last step).
                let end = samples.iter().rev().filter(|s| s.t <= *t + 0.3).find_map(|s| s.regrade_cost);
                let faults = match (at(ts).and_then(|s| s.regrade_cost), end) {
                    (Some(a), Some(b)) => format!(
                        "{} major faults, CPU {:.2} s",
                        b.majflt - a.majflt,
                        (b.cpu_ticks - a.cpu_ticks) as f64 / ticks_per_second()
                    ),
                    _ => "faults ?".into(),
                };
                let drain = match (marked, drained) {
                    (Some(m), Some(d)) => Some(d - m),
                    _ => None,
                };
                let share = match (&own, &over) {
                    (Some(v), _) => own_share(v, "to the restart request", drain),
                    (None, Some(v)) => own_share(v, "of the whole step", drain),
                    (None, None) => "own share ?".into(),
                };
                let wall = match (dropin, restart) {
                    (Some(d), Some(r)) => {
                        format!("decision→drop-in {:.3} s, →restart requested {:.3} s", d - ts, r - ts)
                    }
                    _ => format!("no restart; decision→done {:.3} s", t - ts),
                };
                steps.push(format!(
                    "{from}→{to}{failed} at +{:.1}s: {share}; {faults}, {wall}, step {:.1} s",
                    ts - t0,
                    t - ts
                ));
                if to != "full" {
                    let before = at(ts).map_or(0, |s| s.pss_kb);
                    // After: 5 s after the step's end, when evicted processes are gone.
                    let after = at(*t + 5.0).map_or(0, |s| s.pss_kb);
                    freed.push(format!(
                        "{to}{failed}: {} → {} MiB ({:+} MiB)",
                        before >> 10,
                        after >> 10,
                        (after as i64 - before as i64) >> 10
                    ));
                }
            }
            _ => {}
        }
    }
    if !freed.iter().any(|f| f.starts_with("etcd-only")) {
        freed.push("etcd-only: not reached".into());
    }
    (freed.join("; "), if steps.is_empty() { "no step".into() } else { steps.join(" | ") })
}

/// regrade's own share of a step from one of its progress lines: "own 0.42 s of 3.90 s
/// to the restart request (CPU 0.35, waiting for a CPU 0.04, for the disk 0.03; 0
/// major faults), 2.10 s of it waiting for the drain".
fn own_share(v: &Value, upto: &str, drain: Option<f64>) -> String {
    let ms = |k: &str| field(v, k).parse::<f64>().map_or("?".to_string(), |m| format!("{:.2}", m / 1000.0));
    let waits = match field(v, "OWN_CPU_WAIT_MS") {
        "?" => format!("waits {}", field(v, "OWN_WAITS")),
        _ => format!("waiting for a CPU {}, for the disk {}", ms("OWN_CPU_WAIT_MS"), ms("OWN_DISK_WAIT_MS")),
    };
    let drain = drain.map_or(String::new(), |d| format!(", {d:.2} s of it the drain"));
    format!(
        "own {} s of {} s {upto} (CPU {}, {waits}; {} major faults){drain}",
        ms("OWN_MS"),
        ms("AFTER_MS"),
        ms("OWN_CPU_MS"),
        field(v, "OWN_MAJOR_FAULTS")
    )
}

/// A table line: its name and how it is read from a row.
type Field = (&'static str, fn(&Row) -> String);

fn print_table(rows: &[Row]) {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n== the incident, four arms (server1 in a {LIMIT_MIB} MiB cgroup v1 memory cgroup; PSI is the host's) =="
    );
    let fields: [Field; 13] = [
        ("server1's etcd member", |r| r.member.clone()),
        ("server1's member through the arm", |r| r.member_distress.clone()),
        ("its member after the restart into etcd-only", |r| r.member_after_restart.clone()),
        ("etcd leader changes", |r| r.leader_changes.clone()),
        ("API write seconds failed or > 1 s", |r| r.bad_write_seconds.clone()),
        ("workload", |r| r.workload.clone()),
        ("else OOM-killed", |r| r.killed.clone()),
        ("onset → relief (PSI some avg10 ≥ 40 → < 40)", |r| r.onset_to_relief.clone()),
        ("peak PSI some avg10", |r| r.peak_psi.clone()),
        ("time with PSI some avg10 ≥ 40 %", |r| r.psi_over.clone()),
        ("PSS of server1's processes by level", |r| r.rss_freed.clone()),
        ("regrade's steps", |r| r.regrade_steps.clone()),
        ("notes", |r| r.notes.join("; ")),
    ];
    for r in rows {
        let _ = writeln!(out, "\n-- arm: {} --", r.arm);
        for (name, f) in &fields {
            let _ = writeln!(out, "  {name:<46} {}", shared::or_dash(f(r)));
        }
    }
    println!("{out}");
}
