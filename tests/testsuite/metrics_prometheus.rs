//! The metrics against a real Prometheus (Debian's package): a `regrade watch
//! --dry-run` on fixture pressure files serves `[metrics] listen` on loopback, a
//! Prometheus started here scrapes it, and its query API must return the level and
//! the pressure series, then follow a change of pressure and the step it causes.
//! `promtool check metrics` must accept the exposition, and `promtool check rules` and
//! `test rules` must pass on deploy/prometheus.
//!
//! Gated: `REGRADE_TEST_PROMETHEUS=1` (tests/run sets it and installs `prometheus`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::fixture;

use fixture::{write_pressure, OVER_PSI};

/// Calm, with averages that are not 0, so that each pressure series shows its own.
const CALM_PSI: &str =
    "some avg10=12.50 avg60=3.25 avg300=0.75 total=10\nfull avg10=1.00 avg60=0.50 avg300=0.00 total=0\n";

fn gated() -> bool {
    if std::env::var_os("REGRADE_TEST_PROMETHEUS").is_none() {
        eprintln!("skipped: set REGRADE_TEST_PROMETHEUS=1 (needs Debian's prometheus package)");
        return false;
    }
    true
}

/// A loopback port nothing listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A plain HTTP/1.0 GET (no chunked encoding to undo); returns the status and the body.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Kills the child when the test ends, pass or fail.
struct Reaped(Child);
impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Watch {
    dir: tempfile::TempDir,
    addr: SocketAddr,
    _child: Reaped,
}

impl Watch {
    fn start() -> Watch {
        let dir = tempfile::tempdir().unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let d = dir.path();
        write_pressure(d, CALM_PSI, 4_000_000);
        let config = fixture::config(
            d,
            &format!("[metrics]\nlisten = \"{addr}\""),
            "sample_period = \"200ms\"\nsustain = \"1s\"\ncooldown = \"1s\"",
        );
        let child = Command::new(env!("CARGO_BIN_EXE_regrade"))
            .arg("--config")
            .arg(&config)
            .args(["watch", "--dry-run"])
            .env_remove("NOTIFY_SOCKET")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("watch.log")).unwrap())
            .spawn()
            .unwrap();
        let w = Watch { dir, addr, _child: Reaped(child) };
        wait_for("regrade's /healthz", Duration::from_secs(20), || {
            matches!(get(addr, "/healthz"), Ok((200, _))).then_some(())
        });
        w
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("watch.log")).unwrap_or_default()
    }
}

struct Prometheus {
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    _child: Reaped,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {:?}\n\
                 scrape_configs:\n  - job_name: regrade\n    static_configs:\n      - targets: [\"{target}\"]\n",
                repo().join("deploy/prometheus/regrade-rules.yaml"),
            ),
        )
        .unwrap();
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("prometheus (apt-get install prometheus)");
        let p = Prometheus { addr, _dir: dir, _child: Reaped(child) };
        wait_for("Prometheus ready", Duration::from_secs(60), || {
            matches!(get(addr, "/-/ready"), Ok((200, _))).then_some(())
        });
        p
    }

    /// The instant vector for `query`, as (labels, value) pairs.
    fn query(&self, query: &str) -> Vec<(serde_json::Value, f64)> {
        let path = format!("/api/v1/query?query={}", encode(query));
        let (status, body) = get(self.addr, &path).unwrap();
        assert_eq!(status, 200, "{query}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["status"], "success", "{body}");
        v["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r["metric"].clone(), r["value"][1].as_str().unwrap().parse().unwrap()))
            .collect()
    }

    /// The one value of `query` once Prometheus has a sample for it that `ok` accepts.
    fn wait_value(&self, query: &str, ok: impl Fn(f64) -> bool) -> f64 {
        wait_for(query, Duration::from_secs(30), || match self.query(query).as_slice() {
            [(_, v)] if ok(*v) => Some(*v),
            _ => None,
        })
    }
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn prometheus_scrapes_a_dry_run_watch_and_follows_a_step() {
    if !gated() {
        return;
    }
    let watch = Watch::start();

    // The exposition as served, through promtool's linter.
    let (status, text) = get(watch.addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    lint.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = lint.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics refused the exposition:\n{}{}\n---\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let prom = Prometheus::start(watch.addr);
    assert_eq!(prom.wait_value("up{job=\"regrade\"}", |v| v == 1.0), 1.0);

    // Calm, at full.
    let levels = wait_for("regrade_level", Duration::from_secs(30), || {
        let r = prom.query("regrade_level");
        (r.len() == 3).then_some(r)
    });
    for (labels, v) in &levels {
        let want = if labels["level"] == "full" { 1.0 } else { 0.0 };
        assert_eq!(*v, want, "{labels}");
        assert_eq!(labels["job"], "regrade");
    }
    assert_eq!(prom.query("regrade_pressure_ratio").len(), 6, "all six PSI averages");
    assert_eq!(prom.wait_value("regrade_pressure_ratio{metric=\"some_avg10\"}", |_| true), 0.125);
    assert_eq!(prom.wait_value("regrade_pressure_ratio{metric=\"full_avg60\"}", |_| true), 0.005);
    assert_eq!(prom.wait_value("regrade_mem_available_bytes", |_| true), 4_000_000.0 * 1024.0);
    assert_eq!(prom.wait_value("regrade_reading{reading=\"calm\"}", |_| true), 1.0);

    // Pressure: over for sustain (1 s), so the dry run steps down to control-plane.
    write_pressure(watch.dir.path(), OVER_PSI, 100_000);
    assert_eq!(prom.wait_value("regrade_pressure_ratio{metric=\"some_avg10\"}", |v| v == 0.8), 0.8);
    prom.wait_value("regrade_steps_total{direction=\"down\",result=\"done\"}", |v| v >= 1.0);
    prom.wait_value("regrade_level{level=\"full\"}", |v| v == 0.0);
    let below = prom.wait_value("sum(regrade_level{level!=\"full\"})", |v| v == 1.0);
    assert_eq!(below, 1.0, "exactly one level below full is current\n{}", watch.log());
    assert!(prom.wait_value("regrade_step_duration_seconds_count", |v| v >= 1.0) >= 1.0);
    assert!(prom.wait_value("regrade_last_step_timestamp_seconds", |v| v > 1.0e9) > 1.0e9);
    assert_eq!(prom.query("regrade_steps_total{direction=\"up\"} > 0").len(), 0, "no step up under pressure");
    // The rules load and evaluate against the real series: the Ready rules see no
    // kube-state-metrics here, and RegradeStuckBelowFull needs an hour.
    let (_, rules) = get(prom.addr, "/api/v1/rules").unwrap();
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let groups = rules["data"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{rules}");
    for g in groups {
        for r in g["rules"].as_array().unwrap() {
            assert_eq!(r["health"], "ok", "{r}");
        }
    }
}

/// A listener that cannot bind stops `watch` at once, naming the key.
#[test]
fn a_busy_listen_address_stops_watch_naming_the_key() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_pressure(d, CALM_PSI, 4_000_000);
    std::fs::write(
        d.join("regrade.toml"),
        format!(
            "state_file = {:?}\n[metrics]\nlisten = \"{addr}\"\n[pressure]\nsource = {:?}\nmeminfo = {:?}\n\
             [systemd]\nrecord = {:?}\ndropin = {:?}\n",
            d.join("state.json"),
            d.join("psi"),
            d.join("meminfo"),
            d.join("started-level"),
            d.join("dropin.yaml"),
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(d.join("regrade.toml"))
        .args(["watch", "--dry-run"])
        .env_remove("NOTIFY_SOCKET")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains(&format!("metrics.listen = \"{addr}\"")), "{err}");
}

#[test]
fn the_alert_rules_pass_promtool() {
    if !gated() {
        return;
    }
    let dir = repo().join("deploy/prometheus");
    for args in [["check", "rules", "regrade-rules.yaml"], ["test", "rules", "regrade-rules.test.yaml"]] {
        let out = Command::new("promtool").args(args).current_dir(&dir).output().expect("promtool");
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
