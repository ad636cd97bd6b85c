//! server1 as a qemu guest (tests/testsuite/vm_incident.rs): Debian 12's kernel under emulation
//! (TCG: KVM here hangs guests), unified cgroup v2, systemd as PID 1, its own disk.
//!
//! - Disks: a qcow2 overlay on the cached image (tests/vm/image.sh), so the image stays
//!   as built; and this run's seed (binaries, configuration, address) as an ext4 image.
//!   Both opened `cache=none`: the guest's writes bypass the host's page cache, and what
//!   the guest has not flushed can be lost when qemu is SIGKILLed — a power cut
//!   ([`Guest::power_cut`]; [`Guest::boot_again`] boots the same disks, as
//!   tests/testsuite/vm_power_cuts.rs does). Not `directsync`: that makes every write durable
//!   as it completes, a disk without a volatile cache, which hides the reordering a
//!   real disk's cache allows before a flush.
//! - Network: `-nodefaults` (no user-mode NIC) and one virtio NIC on the tap `tap-vm1`,
//!   which tests/vm/net.sh put on the bridge inside the rig's own namespace; qemu is
//!   started from a thread inside that namespace.
//! - Channels, each an event the test waits for, never a sleep: the serial console
//!   (boot lines, `regrade-vm: …` lines, the kernel's OOM kills at loglevel 4) read
//!   from qemu's stdout; the sampler's lines (tests/vm/guest/sampler.py) on the
//!   virtio-serial port `regrade.samples`; commands through the qemu guest agent
//!   (`guest-exec`) on the port `org.qemu.guest_agent.0`.
//! - Bounds: 2 GiB of guest RAM, qemu in a cgroup v1 memory cgroup of its own limited
//!   to [`HOST_LIMIT_MIB`], SIGKILLed when the test dies (PR_SET_PDEATHSIG, even on
//!   SIGKILL of the test), at [`Guest::boot`]'s time bound, and on drop (a panic too);
//!   `sweep` removes what a killed run left.

#![allow(dead_code)] // tests/testsuite/vm_incident.rs and tests/testsuite/vm_power_cuts.rs each use their part

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// The guest's RAM.
pub const GUEST_MIB: u64 = 2048;
/// The guest's virtual CPUs: `REGRADE_VM_SMP` if set, else the test's `default`.
/// Each is a host thread emulating one (TCG), many times slower than a real core: with
/// one, the incident lane's etcd answered /health late on a calm guest (CPU PSI some
/// 70-84 % at each arm's start; docs/incident-vm.md), so that lane gives the guest both
/// of a 2-core machine's cores; the power cuts keep one.
pub fn cpus(default: u32) -> u32 {
    std::env::var("REGRADE_VM_SMP").ok().and_then(|n| n.parse().ok()).unwrap_or(default)
}
/// qemu's own memory cgroup on the host: the guest's RAM plus emulation's overhead
/// (translation cache 256 MiB, device state); measured peak in the log.
const HOST_LIMIT_MIB: u64 = 3072;
const CGROUP_PREFIX: &str = "/sys/fs/cgroup/memory/regrade-vm-";

/// What the guest's sampler said once (tests/vm/guest/sampler.py), with the host's
/// time of arrival.
#[derive(Clone, Debug, Default)]
pub struct GuestSample {
    /// Host time the line arrived.
    pub host_t: f64,
    /// Guest time it was taken.
    pub guest_t: f64,
    /// The guest's /proc/pressure/memory some and full avg10.
    pub psi: f64,
    pub psi_full: f64,
    pub avail_kb: u64,
    /// k3s.service's and kubepods.slice's memory.pressure some/full avg10 and
    /// memory.current (kB); `None` where the cgroup was not there.
    pub k3s: Option<(f64, f64, u64)>,
    pub pods: Option<(f64, f64, u64)>,
    /// k3s.service's io.pressure and cpu.pressure some/full avg10.
    pub k3s_io: Option<(f64, f64)>,
    pub k3s_cpu: Option<(f64, f64)>,
    /// The share of all the guest's CPUs (%) used since the line before by k3s.service,
    /// by kubepods.slice, and by everything (kernel threads and interrupts included);
    /// `None` on the first line, or where a cgroup was not there.
    pub cpu_used: Option<(f64, f64, f64)>,
    /// k3s.service's share split between the k3s process (etcd embedded) and its
    /// kube-apiserver, and the kernel's kswapd threads' share, in the same unit.
    pub procs: Option<(f64, f64, f64)>,
    pub etcd_healthy: bool,
}

impl GuestSample {
    fn parse(host_t: f64, line: &str) -> Option<GuestSample> {
        let rest = line.trim().strip_prefix("S ")?;
        let mut s = GuestSample { host_t, ..Default::default() };
        for kv in rest.split_whitespace() {
            let (k, v) = kv.split_once('=')?;

            match k {
                "t" => s.guest_t = v.parse().ok()?,
                "psi" => s.psi = v.parse().ok()?,
                "full" => s.psi_full = v.parse().ok()?,
                "avail" => s.avail_kb = v.parse().ok()?,
                "k3s" => s.k3s = three(v),
                "pods" => s.pods = three(v),
                "cpu" => s.cpu_used = three(v),
                "procs" => s.procs = three(v),
                "k3sio" | "k3scpu" => {
                    let pair = v.split_once('/').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
                    if k == "k3sio" {
                        s.k3s_io = pair;
                    } else {
                        s.k3s_cpu = pair;
                    }
                }
                "etcd" => s.etcd_healthy = v == "1",
                _ => {}
            }
        }
        Some(s)
    }
}

/// `a/b/c`, each parsed; `None` if any is not (a cgroup not there reads `-`).
fn three<A: std::str::FromStr, B: std::str::FromStr, C: std::str::FromStr>(v: &str) -> Option<(A, B, C)> {
    let mut it = v.split('/');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// Lines that arrived on a channel, and a condition variable for waiters.
#[derive(Default)]
struct Feed<T> {
    items: Mutex<Vec<T>>,
    more: Condvar,
}

impl<T: Clone> Feed<T> {
    fn push(&self, item: T) {
        self.items.lock().unwrap().push(item);
        self.more.notify_all();
    }

    /// Waits until `f` finds something in the items from index `from` on.
    fn wait_for<R>(&self, from: usize, within: Duration, mut f: impl FnMut(&T) -> Option<R>) -> Option<R> {
        let deadline = Instant::now() + within;
        let mut items = self.items.lock().unwrap();
        let mut seen = from;
        loop {
            for it in &items[seen.min(items.len())..] {
                if let Some(r) = f(it) {
                    return Some(r);
                }
            }
            seen = items.len();
            let left = deadline.checked_duration_since(Instant::now())?;
            items = self.more.wait_timeout(items, left).unwrap().0;
        }
    }
}

pub struct Guest {
    /// Host time qemu was last started.
    pub started: f64,
    /// qemu; `None` between a power cut and the next boot.
    child: Option<Child>,
    /// qemu's command line, the same at every boot.
    args: Vec<String>,
    dir: PathBuf,
    cgroup: PathBuf,
    console: Arc<Feed<(f64, String)>>,
    /// console.log, every boot's lines.
    log: std::fs::File,
    samples: Arc<Feed<GuestSample>>,
    /// The sampler's lines about server1's etcd member (`H …`, `M …`), with the host's
    /// time of arrival (tests/testsuite/incident/member.rs reads them).
    member_lines: Arc<Feed<(f64, String)>>,
    qga: Mutex<Option<Qga>>,
    /// The running qemu's PID (0: none), for the time bound's thread.
    pid: Arc<AtomicI32>,
    bound_hit: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
}

/// What a finished guest-exec said.
pub struct Exec {
    pub code: i64,
    pub out: String,
    pub err: String,
}

impl Guest {
    /// Boots the guest from `image` (tests/vm/image.sh's directory) with the seed tree
    /// `seed` (made into a disk here), under `dir`, killed after `bound` (from this
    /// first boot, across [`Guest::boot_again`]). `cmdline` is added to the kernel's
    /// command line. Returns once qemu runs; [`Guest::wait_console`] waits for the
    /// boot's lines. `cpus`: its virtual CPUs ([`cpus`]).
    ///
    /// Call from a thread inside the rig's hub namespace that lives as long as the
    /// guest: the tap is there, and PR_SET_PDEATHSIG fires when the thread that
    /// spawned qemu ends.
    pub fn boot(image: &Path, seed: &Path, dir: &Path, bound: Duration, cmdline: &str, cpus: u32) -> Guest {
        std::fs::create_dir_all(dir).unwrap();
        let overlay = dir.join("server1.qcow2");
        let base = image.join("disk.img");
        run_ok(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", "-b", base.to_str().unwrap(), "-F", "raw", overlay.to_str().unwrap()],
        );
        let seed_img = dir.join("seed.img");
        let du = run_ok("du", &["-sm", seed.to_str().unwrap()]);
        let mib: u64 = du.split_whitespace().next().unwrap().parse::<u64>().unwrap() + 64;
        run_ok("truncate", &["-s", &format!("{mib}M"), seed_img.to_str().unwrap()]);
        run_ok("mkfs.ext4", &["-q", "-d", seed.to_str().unwrap(), seed_img.to_str().unwrap()]);

        let cgroup = PathBuf::from(format!("{CGROUP_PREFIX}{}", std::process::id()));
        std::fs::create_dir_all(&cgroup).unwrap();
        std::fs::write(cgroup.join("memory.limit_in_bytes"), (HOST_LIMIT_MIB << 20).to_string()).unwrap();
        let (qga, samples_sock) = (dir.join("qga.sock"), dir.join("samples.sock"));
        let drive = |f: &Path, fmt: &str| format!("file={},if=virtio,cache=none,format={fmt}", f.display());
        let chardev = |id: &str, p: &Path| format!("socket,id={id},path={},server=on,wait=off", p.display());
        let append = format!(
            "console=ttyS0 root=/dev/vda rw net.ifnames=0 loglevel=4 systemd.show_status=error panic=-1 {cmdline}"
        );
        let args: Vec<String> = [
            "-name",
            "regrade-vm-server1",
            "-machine",
            "q35",
            "-accel",
            "tcg,thread=multi,tb-size=256",
            "-cpu",
            "max",
            "-smp",
            &cpus.to_string(),
            "-m",
            &GUEST_MIB.to_string(),
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
            "-serial",
            "stdio",
            "-kernel",
            image.join("vmlinuz").to_str().unwrap(),
            "-initrd",
            image.join("initrd.img").to_str().unwrap(),
            "-append",
            append.trim_end(),
            "-drive",
            &drive(&overlay, "qcow2"),
            "-drive",
            &drive(&seed_img, "raw"),
            "-netdev",
            "tap,id=n0,ifname=tap-vm1,script=no,downscript=no",
            "-device",
            "virtio-net-pci,netdev=n0,mac=52:54:00:0d:07:0b",
            "-device",
            "virtio-serial-pci",
            "-chardev",
            &chardev("qga", &qga),
            "-device",
            "virtserialport,chardev=qga,name=org.qemu.guest_agent.0",
            "-chardev",
            &chardev("smp", &samples_sock),
            "-device",
            "virtserialport,chardev=smp,name=regrade.samples",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let console: Arc<Feed<(f64, String)>> = Arc::default();
        let log = std::fs::File::create(dir.join("console.log")).unwrap();
        let mut g = Guest {
            started: 0.0,
            child: None,
            args,
            dir: dir.to_path_buf(),
            cgroup,
            console,
            log,
            samples: Arc::default(),
            member_lines: Arc::default(),
            qga: Mutex::new(None),
            pid: Arc::new(AtomicI32::new(0)),
            bound_hit: Arc::new(AtomicBool::new(false)),
            done: Arc::new(AtomicBool::new(false)),
        };
        g.start_qemu();
        // The time bound: qemu SIGKILLed, and the test fails at its next wait.
        let (hit, stop, pid) = (Arc::clone(&g.bound_hit), Arc::clone(&g.done), Arc::clone(&g.pid));
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while t0.elapsed() < bound {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
            hit.store(true, Ordering::SeqCst);
            eprintln!("vm: the guest ran past its bound of {} s: killing qemu", bound.as_secs());
            let p = pid.load(Ordering::SeqCst);
            if p > 0 {
                // SAFETY: kills the qemu this guest started last (its PID is still ours:
                // it is reaped only by a power cut, which sets 0 first, or on drop).
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        });
        g
    }

    /// Starts qemu on the guest's disks, as they are: its console and sampler lines go
    /// on into the same feeds (a mark taken before a power cut still counts on).
    fn start_qemu(&mut self) {
        // The shell puts itself into qemu's memory cgroup, then becomes qemu.
        let sh = format!("echo $$ > {}/cgroup.procs && exec qemu-system-x86_64 \"$@\"", self.cgroup.display());
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(sh).arg("qemu").args(&self.args);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        crate::incident::shared::dies_with_us(&mut cmd);
        self.started = crate::common::three_servers::now();
        let mut child = cmd.spawn().expect("starting qemu-system-x86_64");
        std::fs::write(self.dir.join("qemu.pid"), child.id().to_string()).unwrap();
        self.pid.store(child.id() as i32, Ordering::SeqCst);
        for stream in
            [Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>, Box::new(child.stderr.take().unwrap())]
        {
            let (console, mut log) = (Arc::clone(&self.console), self.log.try_clone().unwrap());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
                    let line = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
                    let _ = writeln!(log, "{:.3} {line}", crate::common::three_servers::now());
                    console.push((crate::common::three_servers::now(), line));
                }
            });
        }
        let samples_sock = self.dir.join("samples.sock");
        let (feed, member_feed) = (Arc::clone(&self.samples), Arc::clone(&self.member_lines));
        std::thread::spawn(move || {
            // qemu makes the socket at its start; the guest writes once its sampler runs.
            let t0 = Instant::now();
            let stream = loop {
                match UnixStream::connect(&samples_sock) {
                    Ok(s) => break s,
                    Err(_) if t0.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(100)),
                    Err(e) => panic!("{}: {e}", samples_sock.display()),
                }
            };
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if let Some(s) = GuestSample::parse(crate::common::three_servers::now(), &line) {
                    feed.push(s);
                } else if line.starts_with("H ") || line.starts_with("M ") {
                    member_feed.push((crate::common::three_servers::now(), line));
                }
            }
        });
        self.child = Some(child);
    }

    /// Cuts the guest's power: qemu SIGKILLed at once. Its disks stay as they are:
    /// what the guest flushed (cache=none: see the module documentation), and nothing
    /// of its page cache. [`Guest::boot_again`] boots the same disks.
    pub fn power_cut(&mut self) {
        self.pid.store(0, Ordering::SeqCst);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        *self.qga.lock().unwrap() = None;
        let _ = writeln!(self.log, "{:.3} ---- power cut ----", crate::common::three_servers::now());
    }

    /// Boots the guest again from the same disks (after [`Guest::power_cut`]), from the
    /// same thread as [`Guest::boot`]; returns once qemu runs. Console marks taken
    /// before still count: wait for `regrade-vm: booted` from a mark taken before this.
    pub fn boot_again(&mut self) {
        assert!(self.child.is_none(), "boot_again: the guest still runs (power_cut first)");
        assert!(!self.bound_hit.load(Ordering::SeqCst), "boot_again: the guest ran past its bound");
        self.start_qemu();
    }

    /// Waits for a console line containing `needle`, from line `from` on; its host time
    /// and the line. Panics, with the console's tail, if qemu ended or `within` passed.
    pub fn wait_console(&self, from: usize, needle: &str, within: Duration) -> (f64, String) {
        let found = self.console.wait_for(from, within, |(t, l)| l.contains(needle).then(|| (*t, l.clone())));
        found.unwrap_or_else(|| panic!("no console line {needle:?} within {within:?}{}", self.why()))
    }

    /// How many console lines have arrived (a mark for [`Guest::console_since`]).
    pub fn console_mark(&self) -> usize {
        self.console.items.lock().unwrap().len()
    }

    pub fn console_since(&self, mark: usize) -> Vec<(f64, String)> {
        let items = self.console.items.lock().unwrap();
        items[mark.min(items.len())..].to_vec()
    }

    pub fn member_lines_mark(&self) -> usize {
        self.member_lines.items.lock().unwrap().len()
    }

    /// The sampler's `H`/`M` lines from `mark` on: (host time of arrival, line).
    pub fn member_lines_since(&self, mark: usize) -> Vec<(f64, String)> {
        let items = self.member_lines.items.lock().unwrap();
        items[mark.min(items.len())..].to_vec()
    }

    pub fn samples_mark(&self) -> usize {
        self.samples.items.lock().unwrap().len()
    }

    pub fn samples_since(&self, mark: usize) -> Vec<GuestSample> {
        let items = self.samples.items.lock().unwrap();
        items[mark.min(items.len())..].to_vec()
    }

    pub fn last_sample(&self) -> Option<GuestSample> {
        self.samples.items.lock().unwrap().last().cloned()
    }

    /// Waits for a sample for which `f` holds, from sample `from` on.
    pub fn wait_sample(&self, from: usize, within: Duration, f: impl Fn(&GuestSample) -> bool) -> Option<GuestSample> {
        self.samples.wait_for(from, within, |s| f(s).then(|| s.clone()))
    }

    /// Guest time minus host time, from the samples' arrival (the smallest difference
    /// seen: a line's transit only adds).
    pub fn clock_offset(&self) -> f64 {
        let items = self.samples.items.lock().unwrap();
        items.iter().map(|s| s.guest_t - s.host_t).fold(f64::NEG_INFINITY, f64::max)
    }

    /// Runs `sh -c script` in the guest through its agent, with `input` on stdin;
    /// waits up to `within` for it to end.
    pub fn exec_input(&self, script: &str, input: Option<&[u8]>, within: Duration) -> Result<Exec, String> {
        let mut guard = self.qga.lock().unwrap();
        if guard.is_none() {
            *guard = Some(Qga::connect(&self.dir.join("qga.sock"), within)?);
        }
        let qga = guard.as_mut().unwrap();
        let mut args = json!({"path": "/bin/sh", "arg": ["-c", script], "capture-output": true});
        if let Some(i) = input {
            args["input-data"] = json!(base64_encode(i));
        }
        let res = qga.call("guest-exec", args, within).inspect_err(|_| *guard = None);
        let pid = res?["pid"].as_i64().ok_or("guest-exec: no pid")?;
        let t0 = Instant::now();
        let qga = guard.as_mut().unwrap();
        loop {
            let st = qga.call("guest-exec-status", json!({"pid": pid}), within)?;
            if st["exited"].as_bool() == Some(true) {
                let text = |k: &str| String::from_utf8_lossy(&base64_decode(st[k].as_str().unwrap_or(""))).into_owned();
                return Ok(Exec {
                    code: st["exitcode"].as_i64().unwrap_or(-1),
                    out: text("out-data"),
                    err: text("err-data"),
                });
            }
            if t0.elapsed() > within {
                return Err(format!("{script:?} did not end within {within:?}"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `script` in the guest; its stdout. Panics if it fails or takes over `within`.
    pub fn sh(&self, script: &str, within: Duration) -> String {
        match self.exec_input(script, None, within) {
            Ok(e) if e.code == 0 => e.out,
            Ok(e) => panic!("{script:?} in the guest: exit {}: {}{}", e.code, e.err, self.why()),
            Err(e) => panic!("{script:?} in the guest: {e}{}", self.why()),
        }
    }

    /// qemu's peak memory on the host (its cgroup's max usage), MiB.
    pub fn host_peak_mib(&self) -> u64 {
        std::fs::read_to_string(self.cgroup.join("memory.max_usage_in_bytes"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map_or(0, |b| b >> 20)
    }

    /// Why a wait failed: qemu's state and the console's last lines.
    fn why(&self) -> String {
        let bound = if self.bound_hit.load(Ordering::SeqCst) { " (qemu killed at its time bound)" } else { "" };
        let items = self.console.items.lock().unwrap();
        let tail: Vec<&str> = items.iter().rev().take(25).rev().map(|(_, l)| l.as_str()).collect();
        format!("{bound}; console's last lines:\n{}", tail.join("\n"))
    }

    /// Kills qemu at once (a power cut) and removes its cgroup and files.
    fn kill(&mut self) {
        self.done.store(true, Ordering::SeqCst);
        self.pid.store(0, Ordering::SeqCst);
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        remove_cgroup(&self.cgroup);
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("vm: {}", self.why());
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn remove_cgroup(cg: &Path) {
    for _ in 0..40 {
        let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
        if procs.trim().is_empty() {
            break;
        }
        for p in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: kills what is left in the cgroup this test made for qemu.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let _ = std::fs::remove_dir(cg);
}

/// What a killed run left: qemu's memory cgroups (and the qemu in them).
pub fn sweep() {
    for e in std::fs::read_dir("/sys/fs/cgroup/memory").unwrap().flatten() {
        let p = e.path();
        if p.to_string_lossy().starts_with(CGROUP_PREFIX) {
            eprintln!("vm: removing {} left by an earlier run", p.display());
            remove_cgroup(&p);
        }
    }
}

fn run_ok(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// The qemu guest agent's protocol: one JSON command, one JSON answer a line, on the
/// chardev's socket; `guest-sync-delimited` first, whose answer follows a 0xFF byte,
/// so a reconnect skips whatever an earlier client left half-read.
struct Qga {
    r: BufReader<UnixStream>,
    w: UnixStream,
    id: u64,
}

impl Qga {
    fn connect(sock: &Path, within: Duration) -> Result<Qga, String> {
        let s = UnixStream::connect(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut q = Qga { r: BufReader::new(s.try_clone().unwrap()), w: s, id: std::process::id() as u64 * 1000 };
        // The agent starts late in the boot: ask again until it answers.
        let t0 = Instant::now();
        loop {
            q.id += 1;
            let cmd = json!({"execute": "guest-sync-delimited", "arguments": {"id": q.id}});
            q.w.write_all(format!("\u{ff}{cmd}\n").as_bytes()).map_err(|e| e.to_string())?;
            let mut skipped = Vec::new();
            if q.r.read_until(0xff, &mut skipped).is_ok_and(|n| n > 0 && skipped.ends_with(&[0xff])) {
                if let Ok(v) = q.read_json(Duration::from_secs(5)) {
                    if v["return"].as_u64() == Some(q.id) {
                        return Ok(q);
                    }
                }
            }
            if t0.elapsed() > within {
                return Err(format!("the guest agent did not answer within {within:?}"));
            }
        }
    }

    fn read_json(&mut self, within: Duration) -> Result<Value, String> {
        let t0 = Instant::now();
        let mut line = Vec::new();
        loop {
            match self.r.read_until(b'\n', &mut line) {
                Ok(0) => return Err("the guest agent's socket closed".into()),
                Ok(_) if line.ends_with(b"\n") => {
                    let text: Vec<u8> = line.iter().copied().filter(|b| *b != 0xff).collect();
                    if let Ok(v) = serde_json::from_slice::<Value>(&text) {
                        return Ok(v);
                    }
                    line.clear();
                }
                Ok(_) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
                Err(e) => return Err(e.to_string()),
            }
            if t0.elapsed() > within {
                return Err(format!("no answer from the guest agent within {within:?}"));
            }
        }
    }

    fn call(&mut self, cmd: &str, args: Value, within: Duration) -> Result<Value, String> {
        let msg = json!({"execute": cmd, "arguments": args});
        self.w.write_all(format!("{msg}\n").as_bytes()).map_err(|e| e.to_string())?;
        let v = self.read_json(within)?;
        if let Some(e) = v.get("error") {
            return Err(format!("{cmd}: {e}"));
        }
        Ok(v["return"].clone())
    }
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n =
            (u32::from(c[0]) << 16) | (u32::from(*c.get(1).unwrap_or(&0)) << 8) | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            out.push(if i <= c.len() { B64[(n >> (18 - 6 * i)) as usize & 63] as char } else { '=' });
        }
    }
    out
}

fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for b in text.bytes() {
        let Some(v) = B64.iter().position(|&c| c == b) else { continue };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[test]
fn base64_round_trips() {
    for s in ["", "a", "ab", "abc", "abcd", "hello, guest\n"] {
        assert_eq!(base64_decode(&base64_encode(s.as_bytes())), s.as_bytes(), "{s:?}");
    }
    assert_eq!(base64_encode(b"hello"), "aGVsbG8=");
}

/// The sampler's line (tests/vm/guest/sampler.py), a cgroup not there reading "-".
#[test]
fn a_sample_line_reads_k3s_memory_io_and_cpu_pressure_and_cpu_use() {
    let line =
        "S t=2.5 psi=40.00 full=10.00 avail=1000 k3s=1.50/0.50/2048 pods=-/-/- k3sio=3.00/1.00 k3scpu=-/- cpu=45.0/30.5/99.0 procs=40.0/5.0/12.5 etcd=1";
    let s = GuestSample::parse(1.0, line).unwrap();
    assert_eq!(
        (s.psi, s.k3s, s.pods, s.k3s_io, s.k3s_cpu, s.cpu_used, s.procs, s.etcd_healthy),
        (
            40.0,
            Some((1.5, 0.5, 2048)),
            None,
            Some((3.0, 1.0)),
            None,
            Some((45.0, 30.5, 99.0)),
            Some((40.0, 5.0, 12.5)),
            true
        )
    );
    let first = GuestSample::parse(1.0, "S t=1 cpu=-/-/- procs=-/-/- etcd=0").unwrap();
    assert_eq!((first.cpu_used, first.procs), (None, None));
}
