//! The systemd tests' container (tests/nspawn/container.sh): a booted Debian with a
//! real systemd and D-Bus, the k3s stand-in as k3s.service, the drop-in directory and
//! /run/regrade shared with the host. Gated by REGRADE_TEST_SYSTEMD=1 (needs root).

#![allow(dead_code)] // each test module uses part of it

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The containers share one loopback address, and each sets the process's
/// DBUS_SYSTEM_BUS_ADDRESS: one at a time (see also [`system_bus`]).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Held by a test that points this process's DBUS_SYSTEM_BUS_ADDRESS somewhere of its
/// own (a private bus) while it uses it: the tests share one process (tests/testsuite),
/// and a container on the default address sets the same variable.
pub fn system_bus() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn enabled(test: &str) -> bool {
    super::gate_open("REGRADE_TEST_SYSTEMD", test, "root; boots a container with systemd-nspawn")
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nspawn/container.sh")
}

pub struct Container {
    pub name: String,
    vars: HashMap<String, String>,
    /// Held by containers on the default address (see [`Container::up`]).
    _lock: Option<MutexGuard<'static, ()>>,
}

impl Container {
    /// A container on the rig's default loopback address; its system bus becomes this
    /// process's DBUS_SYSTEM_BUS_ADDRESS.
    pub fn up(name: &str) -> Container {
        Self::up_with(name, &[])
    }

    /// As [`Container::up`], with container.sh's settings in `env` (e.g.
    /// REGRADE_NSPAWN_SEED_ETC): the script's, not the whole process's environment.
    pub fn up_with(name: &str, env: &[(&str, &Path)]) -> Container {
        let lock = system_bus();
        let c = Self::boot(name, env, lock);
        std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", c.var("BUS"));
        c
    }

    /// Boots several containers at once, each with container.sh's settings in its `env`
    /// (REGRADE_NSPAWN_ADDR, a different one each, seeds, ...): a
    /// three-member etcd reaches quorum, and so readiness, only once all three run.
    /// If any fails, all are stopped and removed before the panic.
    pub fn up_many(specs: &[(&str, Vec<(&str, String)>)]) -> Vec<Container> {
        let children: Vec<_> = specs
            .iter()
            .map(|(name, env)| {
                Command::new(script())
                    .args(["up", name])
                    .env("REGRADE_BIN", env!("CARGO_BIN_EXE_regrade"))
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("running tests/nspawn/container.sh")
            })
            .collect();
        let outs: Vec<_> = children.into_iter().map(|c| c.wait_with_output().expect("container.sh up")).collect();
        let mut failed = String::new();
        let mut up = Vec::new();
        for ((name, _), out) in specs.iter().zip(outs) {
            if out.status.success() {
                up.push(Self::from_output(name, &out.stdout, None));
            } else {
                failed += &format!("container.sh up {name} failed:\n{}\n", String::from_utf8_lossy(&out.stderr));
                let _ = Command::new(script()).args(["down", name]).status();
            }
        }
        if !failed.is_empty() {
            drop(up);
            panic!("{failed}");
        }
        up
    }

    fn boot(name: &str, env: &[(&str, &Path)], lock: MutexGuard<'static, ()>) -> Container {
        let out = Command::new(script())
            .args(["up", name])
            .env("REGRADE_BIN", env!("CARGO_BIN_EXE_regrade"))
            .envs(env.iter().copied())
            .output()
            .expect("running tests/nspawn/container.sh");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            let _ = Command::new(script()).args(["down", name]).status();
            panic!("container.sh up {name} failed:\n{stderr}");
        }
        Self::from_output(name, &out.stdout, Some(lock))
    }

    /// The container described by container.sh up's KEY=VALUE lines.
    fn from_output(name: &str, stdout: &[u8], lock: Option<MutexGuard<'static, ()>>) -> Container {
        let vars = String::from_utf8_lossy(stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Container { name: name.to_string(), vars, _lock: lock }
    }

    pub fn var(&self, k: &str) -> &str {
        self.vars.get(k).unwrap_or_else(|| panic!("container.sh printed no {k}"))
    }

    pub fn etc(&self) -> PathBuf {
        PathBuf::from(self.var("ETC"))
    }

    pub fn dropin(&self) -> PathBuf {
        self.etc().join("config.yaml.d/50-regrade.yaml")
    }

    pub fn record(&self) -> PathBuf {
        PathBuf::from(self.var("RUN")).join("started-level")
    }

    pub fn record_text(&self) -> String {
        std::fs::read_to_string(self.record()).unwrap_or_default().trim().to_string()
    }

    /// The regrade configuration of a host-side actuator driving this container.
    pub fn config(&self, health_timeout: &str, extra: &str) -> regrade::config::Config {
        regrade::config::Config::parse(&self.config_text(health_timeout, extra)).unwrap()
    }

    pub fn config_text(&self, health_timeout: &str, extra: &str) -> String {
        format!(
            "[systemd]\ndropin = {:?}\nrecord = {:?}\netcd_health_url = {:?}\nhealth_timeout = {health_timeout:?}\n\
             ready_timeout = \"5s\"\n{extra}",
            self.dropin(),
            self.record(),
            self.var("HEALTH_URL")
        )
    }

    /// Runs a command inside the container; its stdout.
    pub fn exec(&self, args: &[&str]) -> String {
        let out =
            Command::new("nsenter").args(["-t", self.var("PID"), "-a"]).args(args).output().expect("running nsenter");
        assert!(out.status.success(), "{args:?} in the container: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn k3s_prop(&self, prop: &str) -> String {
        self.exec(&["systemctl", "show", "-P", prop, "k3s.service"]).trim().to_string()
    }

    /// How many times k3s.service has started so far as the journal shows.
    pub fn k3s_starts(&self) -> usize {
        // systemd's own "Starting k3s.service" line, one per start. Not the record-start
        // hook's line: journald files a line by its sender's cgroup, read when it handles
        // the line, and a hook that has already exited by then is filed under no unit,
        // so `-u k3s.service` misses it (a CI run on a loaded machine saw no line for a
        // restart within 20 s). PID 1's lines always name their unit.
        self.exec(&["journalctl", "--sync"]);
        self.exec(&["journalctl", "-u", "k3s.service", "-o", "cat", "--no-pager"])
            .lines()
            .filter(|l| l.starts_with("Starting k3s.service"))
            .count()
    }

    /// How many times k3s.service has started, once the journal shows at least `n`
    /// starts or 20 s have passed: journald stores a line some time after the start,
    /// later still on a busy host.
    pub fn k3s_starts_reaching(&self, n: usize) -> usize {
        let t0 = Instant::now();
        loop {
            let starts = self.k3s_starts();
            if starts >= n || t0.elapsed() > Duration::from_secs(20) {
                return starts;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The stand-in's report of the flags it runs with.
    pub fn standin_flags(&self) -> serde_json::Value {
        // /run is the container's own tmpfs: reach it through its PID 1.
        let p = PathBuf::from(format!("/proc/{}/root/run/k3s-standin/flags.json", self.var("PID")));
        let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        serde_json::from_str(&text).unwrap()
    }

    pub fn healthy(&self) -> bool {
        health_ok(self.var("HEALTH_URL"))
    }

    pub fn wait_healthy(&self, within: Duration) {
        let t0 = Instant::now();
        while !self.healthy() {
            assert!(t0.elapsed() < within, "etcd at {} not healthy within {within:?}", self.var("HEALTH_URL"));
            std::thread::sleep(Duration::from_millis(200));
        }
        // The hook has run by now (it runs before the stand-in starts).
        while self.record_text().is_empty() {
            assert!(t0.elapsed() < within, "no record at {}", self.record().display());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Ok(out) = Command::new("nsenter")
                .args([
                    "-t",
                    self.var("PID"),
                    "-a",
                    "journalctl",
                    "-u",
                    "k3s.service",
                    "-u",
                    "regrade.service",
                    "--no-pager",
                    "-n",
                    "80",
                ])
                .output()
            {
                eprintln!(
                    "--- {}: k3s.service and regrade.service journal ---\n{}",
                    self.name,
                    String::from_utf8_lossy(&out.stdout)
                );
            }
        }
        let _ = Command::new(script()).args(["down", &self.name]).status();
    }
}

/// A blocking GET of etcd's health URL (`http://host:port/path`).
pub fn health_ok(url: &str) -> bool {
    http_get(url).is_some_and(|body| body.contains("\"health\":\"true\""))
}

/// The body of a 200 answer to a plain HTTP/1.0 GET of `url`; `None` otherwise.
pub fn http_get(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://").unwrap();
    let (auth, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = TcpStream::connect(auth).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {auth}\r\n\r\n").as_bytes()).ok()?;
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let (head, body) = text.split_once("\r\n\r\n")?;
    (head.split_whitespace().nth(1) == Some("200")).then(|| body.to_string())
}

impl Container {
    /// Reboots the container (tests/nspawn/container.sh reboot): systemd powers it off,
    /// its root and /etc/rancher/k3s stay, /run/regrade is emptied as a tmpfs would
    /// be, and it boots again. Its PID 1 and bus change.
    pub fn reboot(&mut self) {
        let out = Command::new(script())
            .args(["reboot", &self.name])
            .env("REGRADE_BIN", env!("CARGO_BIN_EXE_regrade"))
            .output()
            .expect("running tests/nspawn/container.sh reboot");
        assert!(
            out.status.success(),
            "container.sh reboot {} failed:\n{}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        let again = Self::from_output(&self.name, &out.stdout, None);
        self.vars = again.vars.clone();
        std::mem::forget(again); // its Drop would stop the container
        if self._lock.is_some() {
            std::env::set_var("DBUS_SYSTEM_BUS_ADDRESS", self.var("BUS"));
        }
    }
}
