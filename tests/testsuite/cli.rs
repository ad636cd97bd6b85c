//! The `regrade` binary as an operator runs it, on fixture files: no cluster, no root.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::fixture;

use fixture::{CALM_PSI, OVER_PSI};

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    /// Fixture pressure files and a config pointing at them, plus `extra` TOML.
    fn new(psi: &str, mem_kb: u64, extra: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let f = Fixture { dir };
        f.write_pressure(psi, mem_kb);
        fixture::config(f.dir.path(), extra, "sample_period = \"100ms\"\nsustain = \"300ms\"\ncooldown = \"300ms\"");
        f
    }

    fn write_pressure(&self, psi: &str, mem_kb: u64) {
        fixture::write_pressure(self.dir.path(), psi, mem_kb);
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("regrade.toml")
    }

    /// `regrade` with `args`, running, its stderr piped.
    fn spawn(&self, args: &[&str]) -> std::process::Child {
        Command::new(env!("CARGO_BIN_EXE_regrade"))
            .arg("--config")
            .arg(self.config())
            .args(args)
            .env_remove("NOTIFY_SOCKET")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    fn regrade(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_regrade"))
            .arg("--config")
            .arg(self.config())
            .args(args)
            .env_remove("NOTIFY_SOCKET")
            .output()
            .unwrap()
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn status_json_works_with_no_config_file_at_all() {
    // The default config path is absent on a fresh machine: built-in defaults apply.
    if !Path::new("/proc/pressure/memory").exists() || Path::new(regrade::config::DEFAULT_PATH).exists() {
        eprintln!("SKIPPED: needs /proc/pressure/memory and no {}", regrade::config::DEFAULT_PATH);
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_regrade")).args(["status", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["metric"], "some_avg10");
    assert!(v["mem_available"].as_u64().unwrap() > 0);
    assert!(v["level"].is_string());
}

#[test]
fn status_reports_the_fixture_values() {
    let f = Fixture::new(OVER_PSI, 1000, "");
    let out = f.regrade(&["status", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["pressure"], 80.0);
    assert_eq!(v["psi"]["full_avg60"], 10.0);
    assert_eq!(v["mem_available"], 1000 * 1024);
    assert_eq!(v["reading"], "over");
    assert_eq!(v["level"], "full");
    assert_eq!(v["watch_running"], false);
    let plain = text(&f.regrade(&["status"]).stdout);
    assert!(plain.contains("some_avg10 80.00%") && plain.contains("not running"), "{plain}");
}

#[test]
fn a_misspelt_key_is_refused_naming_key_file_and_line() {
    let f = Fixture::new(CALM_PSI, 4_000_000, "");
    std::fs::write(f.config(), "[pressure]\nthreshold = 20\ntreshold = 30\n").unwrap();
    for cmd in [&["check-config"][..], &["status"], &["watch", "--dry-run"]] {
        let out = f.regrade(cmd);
        assert!(!out.status.success(), "{cmd:?} accepted a bad config");
        let e = text(&out.stderr);
        assert!(e.contains("treshold") && e.contains("line 3") && e.contains("regrade.toml"), "{cmd:?}: {e}");
    }
}

#[test]
fn no_psi_stops_watch_and_status_naming_the_file() {
    let f = Fixture::new(CALM_PSI, 4_000_000, "");
    std::fs::remove_file(f.dir.path().join("psi")).unwrap();
    for cmd in [&["watch", "--dry-run"][..], &["status"]] {
        let start = Instant::now();
        let out = f.regrade(cmd);
        assert!(!out.status.success());
        assert!(start.elapsed() < Duration::from_secs(10), "{cmd:?} did not stop at once");
        let e = text(&out.stderr);
        assert!(e.contains("psi") && e.contains("CONFIG_PSI") && e.contains("psi=0"), "{cmd:?}: {e}");
    }
}

#[test]
fn simulate_prints_one_json_line_per_step() {
    let f = Fixture::new(CALM_PSI, 4_000_000, "");
    std::fs::write(
        f.config(),
        "[pressure]\nthreshold = 40\nmem_available_floor = \"1GiB\"\nsample_period = \"10s\"\nsustain = \"30s\"\ncooldown = \"60s\"\n",
    )
    .unwrap();
    let trace = f.dir.path().join("trace.csv");
    let mut t = std::fs::File::create(&trace).unwrap();
    writeln!(t, "t,some_avg10,some_avg60,some_avg300,full_avg10,full_avg60,full_avg300,mem_available_kb").unwrap();
    for s in (0..=100).step_by(10) {
        writeln!(t, "{s},90,50,10,20,5,1,100000").unwrap();
    }
    drop(t);
    let out = f.regrade(&["simulate", trace.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "{\"t\":30,\"action\":\"step-down\",\"from\":\"full\",\"to\":\"control-plane\"}\n\
         {\"t\":90,\"action\":\"step-down\",\"from\":\"control-plane\",\"to\":\"etcd-only\"}\n"
    );
    let out = f.regrade(&["simulate", "--level", "etcd-only", trace.to_str().unwrap()]);
    assert_eq!(text(&out.stdout), "", "no level below etcd-only");
}

#[test]
fn record_prints_the_csv_simulate_reads() {
    let f = Fixture::new(OVER_PSI, 2048, "");
    let out = f.regrade(&["record", "--count", "2", "--interval", "50ms"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    let lines: Vec<&str> = o.lines().collect();
    assert_eq!(lines[0], "t,some_avg10,some_avg60,some_avg300,full_avg10,full_avg60,full_avg300,mem_available_kb");
    assert_eq!(lines.len(), 3);
    assert!(lines[1].ends_with(",80,60,20,30,10,1,2048"), "{}", lines[1]);
    // And simulate takes it back.
    let trace = f.dir.path().join("rec.csv");
    std::fs::write(&trace, &o).unwrap();
    assert!(f.regrade(&["simulate", trace.to_str().unwrap()]).status.success());
}

/// A stand-in for etcd's metrics listener on loopback: `/health` says true, and its
/// `n`-th `/metrics` answer has, after 1000 fast WAL fsyncs (under 1 ms), `10 n` more
/// in (4 ms, 8 ms], and `n` heartbeat send failures. Over the interval between two
/// answers the p99 is then 7.96 ms (10 fsyncs, all slow); from zero it would be lower.
fn etcd_metrics_listener() -> String {
    etcd_metrics_listener_saying("true")
}

/// [`etcd_metrics_listener`] whose `/health` says `health` (`"false"`: not healthy).
fn etcd_metrics_listener_saying(health: &'static str) -> String {
    use std::io::Read;
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut n = 0u64;
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let mut buf = [0u8; 1024];
            let got = s.read(&mut buf).unwrap_or(0);
            let body = if buf[..got].starts_with(b"GET /health") {
                format!("{{\"health\":\"{health}\",\"reason\":\"\"}}")
            } else {
                n += 1;
                let slow = 1000 + 10 * n;
                format!(
                    "etcd_disk_wal_fsync_duration_seconds_bucket{{le=\"0.001\"}} 1000\n\
                     etcd_disk_wal_fsync_duration_seconds_bucket{{le=\"0.004\"}} 1000\n\
                     etcd_disk_wal_fsync_duration_seconds_bucket{{le=\"0.008\"}} {slow}\n\
                     etcd_disk_wal_fsync_duration_seconds_bucket{{le=\"+Inf\"}} {slow}\n\
                     etcd_disk_backend_commit_duration_seconds_bucket{{le=\"0.001\"}} 5\n\
                     etcd_disk_backend_commit_duration_seconds_bucket{{le=\"+Inf\"}} 5\n\
                     etcd_server_heartbeat_send_failures_total {n}\n\
                     etcd_server_slow_apply_total 7\n\
                     etcd_server_leader_changes_seen_total 2\n"
                )
            };
            let _ = s.write_all(format!("HTTP/1.1 200 OK\r\n\r\n{body}").as_bytes());
        }
    });
    format!("http://{addr}/metrics")
}

/// `record --etcd-member` with `etcd.metrics_url` at `url`: the header's extra columns
/// and each row's member cells, and stderr.
fn record_member(url: &str, interval: &str) -> (Vec<String>, Vec<f64>, String) {
    let f = Fixture::new(OVER_PSI, 2048, &format!("[etcd]\nmetrics_url = {url:?}\nrequest_timeout = \"5s\""));
    let out = f.regrade(&["record", "--etcd-member", "--count", "3", "--interval", interval]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    let mut lines = o.lines();
    let header = lines.next().unwrap();
    let (pressure, member) = header.split_at(header.find(",etcd_").expect(header));
    assert_eq!(pressure, "t,some_avg10,some_avg60,some_avg300,full_avg10,full_avg60,full_avg300,mem_available_kb");
    assert_eq!(
        member,
        ",etcd_healthy,etcd_wal_fsync_p99_ms,etcd_backend_commit_p99_ms,etcd_heartbeat_send_failures,etcd_slow_applies,etcd_leader_changes"
    );
    let mut rows = vec![];
    let mut t = vec![];
    for l in lines {
        let cells: Vec<&str> = l.split(',').collect();
        assert_eq!(cells.len(), 14, "{l}");
        assert_eq!(cells[1..8].join(","), "80,60,20,30,10,1,2048", "the pressure columns stay as they were");
        rows.push(cells[8..].join(","));
        t.push(cells[0].parse().unwrap());
    }
    // And simulate takes it back, member columns and all.
    let trace = f.dir.path().join("rec.csv");
    std::fs::write(&trace, &o).unwrap();
    let replay = f.regrade(&["simulate", trace.to_str().unwrap()]);
    assert!(replay.status.success(), "{}", text(&replay.stderr));
    (rows, t, text(&out.stderr))
}

#[test]
fn record_etcd_member_adds_the_members_columns_with_the_p99_of_each_interval() {
    let (rows, _, _) = record_member(&etcd_metrics_listener(), "300ms");
    // The first row has no interval before it; then 10 fsyncs in (4, 8] ms each time.
    assert_eq!(rows, ["1,,,1,7,2", "1,7.960,,2,7,2", "1,7.960,,3,7,2"]);
}

#[test]
fn record_etcd_member_goes_on_when_the_member_does_not_answer() {
    // Nothing listens: empty cells, said once.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let (rows, _, err) = record_member(&format!("http://{free}/metrics"), "100ms");
    assert_eq!(rows, [",,,,,"; 3]);
    assert_eq!(err.matches("does not answer").count(), 1, "{err}");
    // Hung (connects, never answers) with etcd.request_timeout = 5s: not healthy, and
    // every row on time (45 % of a 600 ms interval per request at most).
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (rows, t, err) = record_member(&format!("http://{}/metrics", hung.local_addr().unwrap()), "600ms");
    assert_eq!(rows, ["0,,,,,"; 3]);
    for (i, t) in t.iter().enumerate() {
        assert!(*t < i as f64 * 0.6 + 0.25, "row {i} at t = {t}: late behind a hung member");
    }
    assert_eq!(err.matches("does not answer").count(), 1, "{err}");
    drop(hung);
}

#[test]
fn record_etcd_member_needs_a_metrics_url() {
    let f = Fixture::new(OVER_PSI, 2048, "[etcd]\nmetrics_url = \"\"");
    let out = f.regrade(&["record", "--etcd-member", "--count", "1"]);
    assert!(!out.status.success() && text(&out.stderr).contains("etcd.metrics_url"), "{}", text(&out.stderr));
}

#[test]
fn watch_dry_run_steps_down_then_up_and_stops_on_sigterm() {
    // The step into etcd-only is not weighed here (nothing is drained in a dry run, so
    // it would be held at control-plane: watch::tests has that).
    let f = Fixture::new(OVER_PSI, 1000, "[etcd]\nhold_at_control_plane = false");
    let child = f.spawn(&["watch", "--dry-run"]);
    // Over for 300 ms sustained, cooldown 300 ms: two steps down within ~2 s.
    std::thread::sleep(Duration::from_millis(2000));
    f.write_pressure(CALM_PSI, 4_000_000);
    std::thread::sleep(Duration::from_millis(2500));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "watch did not stop cleanly on SIGTERM");
    let log = text(&out.stderr);
    let order: Vec<&str> = log.lines().filter(|l| l.contains("dry run: would apply level")).collect();
    assert_eq!(order.len(), 4, "{log}");
    for (line, (from, to)) in order.iter().zip([
        ("full", "control-plane"),
        ("control-plane", "etcd-only"),
        ("etcd-only", "control-plane"),
        ("control-plane", "full"),
    ]) {
        assert!(line.contains(&format!("from={from}")) && line.contains(&format!("to={to}")), "{line}");
    }
    // A dry run leaves the real watch's state file alone.
    assert!(!f.dir.path().join("state.json").exists());
}

/// PSI over the threshold with available memory above the floor (1 GiB here) is over
/// while the local etcd member is in distress, neither while it is well or with
/// `etcd.distress_overrides_floor = false`: as `status` reads it (a look of its own).
#[test]
fn status_reads_over_the_floor_when_the_member_is_in_distress() {
    let reading = |health: &'static str, extra: &str| {
        let url = etcd_metrics_listener_saying(health);
        let f = Fixture::new(OVER_PSI, 4_000_000, &format!("[etcd]\nmetrics_url = {url:?}\n{extra}"));
        let out = f.regrade(&["status", "--json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["reading"].as_str().unwrap().to_string()
    };
    assert_eq!(reading("false", ""), "over");
    assert_eq!(reading("true", ""), "neither");
    assert_eq!(reading("false", "distress_overrides_floor = false"), "neither");
}

/// `watch` steps on it, and says why: the member's look, not the floor.
#[test]
fn watch_dry_run_steps_over_the_floor_when_the_member_is_not_healthy() {
    let url = etcd_metrics_listener_saying("false");
    let f = Fixture::new(OVER_PSI, 4_000_000, &format!("[etcd]\nmetrics_url = {url:?}\nmetrics_interval = \"1s\""));
    let mut child = f.spawn(&["watch", "--dry-run"]);
    let (err, status) = logs_until_then_sigterm(&mut child, "dry run: would apply level");
    assert!(status.success(), "{err}");
    assert!(
        err.contains("reading now over") && err.contains("the local etcd member is in distress: not healthy"),
        "{err}"
    );
    let step = err.lines().find(|l| l.contains("dry run: would apply level")).unwrap();
    assert!(step.contains("from=full") && step.contains("to=control-plane"), "{step}");
}

/// Reads `child`'s stderr until it holds `needle`, sends SIGTERM and reads the rest:
/// the whole log and how the child ended. Panics, with the log, if it ends first or
/// `needle` does not come within a minute (the child is killed then).
fn logs_until_then_sigterm(child: &mut std::process::Child, needle: &str) -> (String, std::process::ExitStatus) {
    use std::sync::mpsc::RecvTimeoutError;
    let mut logs = std::io::BufReader::new(child.stderr.take().unwrap());
    let (lines, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || loop {
        let mut line = String::new();
        match std::io::BufRead::read_line(&mut logs, &mut line) {
            Ok(n) if n > 0 && lines.send(line).is_ok() => {}
            _ => break,
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut err = String::new();
    while !err.contains(needle) {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => err.push_str(&line),
            Err(RecvTimeoutError::Disconnected) => panic!("ended before {needle:?}: {err}"),
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("no {needle:?} within 60 s: {err}");
            }
        }
    }
    signal(child, libc::SIGTERM);
    err.extend(rx.iter());
    reader.join().unwrap();
    (err, child.wait().unwrap())
}

/// A hand step, with the step lock held by another process (here the test, as `watch`
/// in a step would): `regrade step`, started with `extra` stdout, waits for the lock;
/// returns the child and the lock (dropping it frees the lock).
fn hand_step_behind_a_held_lock(f: &Fixture, stdout: Stdio) -> (std::process::Child, regrade::level_keeper::StepLock) {
    let lock = regrade::level_keeper::StepLock::try_take(&f.dir.path().join("level.json")).unwrap().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_regrade"))
        .arg("--config")
        .arg(f.config())
        .args(["step", "down"])
        .env_remove("NOTIFY_SOCKET")
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, lock)
}

fn signal(child: &std::process::Child, sig: i32) {
    unsafe { libc::kill(child.id() as i32, sig) };
}

/// One process steps a server at a time: `regrade step` waits while another holds the
/// step lock, says so, and a SIGHUP (the SSH session dropped) stops the wait with
/// nothing changed. Was: no lock, so a hand step and `watch` could step one server at
/// once; and SIGHUP was not handled, so it killed a hand step wherever it was.
#[test]
fn a_hand_step_waits_for_the_step_lock_and_a_sighup_stops_the_wait_with_nothing_changed() {
    let f = Fixture::new(CALM_PSI, 4_000_000, &format!("level_record = {:?}", "LEVEL"));
    let cfg = std::fs::read_to_string(f.config()).unwrap();
    let record = f.dir.path().join("level.json");
    std::fs::write(f.config(), cfg.replace("\"LEVEL\"", &format!("{record:?}"))).unwrap();
    let (mut child, _lock) = hand_step_behind_a_held_lock(&f, Stdio::piped());
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let holder = format!("another regrade process (PID {}) is stepping this server", std::process::id());
    assert!(line.contains(&holder) && line.contains("waiting for it to finish"), "{line}");
    signal(&child, libc::SIGHUP);
    let done = child.wait_with_output().unwrap();
    let err = text(&done.stderr);
    assert_eq!(done.status.code(), Some(1), "{err}");
    assert!(err.contains("SIGHUP") && err.contains("nothing was changed"), "{err}");
    assert!(!record.exists(), "no level record was written");
}

/// A terminal that fails every write (its stdout /dev/full here; a dropped SSH session
/// alike) does not make a hand step panic: it goes on, and stops on SIGTERM as asked.
/// Was: `println!` panicked at the first line.
#[test]
fn a_hand_step_whose_stdout_fails_does_not_panic() {
    let f = Fixture::new(CALM_PSI, 4_000_000, &format!("level_record = {:?}", "LEVEL"));
    let cfg = std::fs::read_to_string(f.config()).unwrap();
    std::fs::write(f.config(), cfg.replace("\"LEVEL\"", &format!("{:?}", f.dir.path().join("level.json")))).unwrap();
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let (mut child, _lock) = hand_step_behind_a_held_lock(&f, Stdio::from(full));
    // Its log says it waits; the line on stdout before it has failed by then.
    let (err, status) = logs_until_then_sigterm(&mut child, "waiting for the step lock");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("SIGTERM: stopped while waiting for the step lock"), "{err}");
}
