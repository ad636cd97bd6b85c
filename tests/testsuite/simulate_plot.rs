//! `regrade simulate --plot`: the picture names exactly the steps the JSON lines say, a
//! week-long trace is drawn downsampled with the same steps, and a real headless
//! Chromium renders the SVG.
//!
//! The Chromium test is gated: `REGRADE_TEST_CHROMIUM=1` (tests/run sets it and
//! installs Debian's `chromium`). The others need nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Instant;

struct Dir {
    dir: tempfile::TempDir,
}

const CONFIG: &str = "[pressure]\nthreshold = 40\ncalm_threshold = 10\nmem_available_floor = \"512MiB\"\n\
                      sample_period = \"1s\"\nsustain = \"30s\"\ncooldown = \"60s\"\n";

impl Dir {
    fn new() -> Dir {
        let d = Dir { dir: tempfile::tempdir().unwrap() };
        std::fs::write(d.path("regrade.toml"), CONFIG).unwrap();
        d
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn simulate(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_regrade"))
            .arg("--config")
            .arg(self.path("regrade.toml"))
            .arg("simulate")
            .args(args)
            .output()
            .unwrap()
    }
}

/// Pressure in two bursts with calm around them: several steps each way, fractional
/// times, and 3000 rows (drawn in full).
fn incident() -> String {
    let mut s =
        String::from("t,some_avg10,some_avg60,some_avg300,full_avg10,full_avg60,full_avg300,mem_available_kb\n");
    for i in 0..3000u32 {
        let t = f64::from(i) * 0.5 + 0.25;
        let burst = (100.0..400.0).contains(&t) || (900.0..1100.0).contains(&t);
        let (p, mem) = if burst { (50.0 + (t / 9.0).sin() * 8.0, 200 * 1024) } else { (2.0, 3000 * 1024) };
        s += &format!("{t},{p:.2},{:.2},{:.2},{:.2},0,0,{mem}\n", p / 2.0, p / 4.0, p / 3.0);
    }
    s
}

#[derive(Debug, PartialEq)]
struct Step {
    t: String,
    from: String,
    to: String,
}

fn json_steps(stdout: &[u8]) -> Vec<Step> {
    String::from_utf8_lossy(stdout)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            Step {
                t: v["t"].to_string(),
                from: v["from"].as_str().unwrap().into(),
                to: v["to"].as_str().unwrap().into(),
            }
        })
        .collect()
}

/// The text of every `<text>` element, in document order.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .map(|s| {
            let body = &s[s.find('>').unwrap() + 1..s.find("</text>").unwrap()];
            body.trim().replace("&gt;", ">").replace("&lt;", "<").replace("&amp;", "&")
        })
        .collect()
}

/// The steps the picture labels: a `from → to` text followed by `mm:ss (t=T)`.
fn drawn_steps(svg: &str) -> Vec<Step> {
    let texts = texts(svg);
    let mut out = vec![];
    for w in texts.windows(2) {
        let (Some((from, to)), Some(t)) = (w[0].split_once(" → "), w[1].split_once("(t=")) else { continue };
        out.push(Step { t: t.1.trim_end_matches(')').into(), from: from.into(), to: to.into() });
    }
    out
}

fn plot(d: &Dir, trace: &str) -> (Vec<Step>, String, Output) {
    let csv = d.path("incident.csv");
    std::fs::write(&csv, trace).unwrap();
    let svg = d.path("incident.svg");
    let out = d.simulate(&["--plot", svg.to_str().unwrap(), csv.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    (json_steps(&out.stdout), std::fs::read_to_string(svg).unwrap(), out)
}

#[test]
fn the_picture_names_exactly_the_steps_printed() {
    let d = Dir::new();
    let (printed, svg, with_plot) = plot(&d, &incident());
    assert!(printed.len() >= 6, "the trace should step both ways twice: {printed:?}");
    assert!(printed.iter().any(|s| s.t.contains('.')), "a fractional time is among them: {printed:?}");
    assert_eq!(drawn_steps(&svg), printed);
    // --plot changes nothing of what is printed.
    let without = d.simulate(&[d.path("incident.csv").to_str().unwrap()]);
    assert_eq!(String::from_utf8_lossy(&without.stdout), String::from_utf8_lossy(&with_plot.stdout));
    // The title counts them and names the settings that decided.
    let all = texts(&svg).join("\n");
    let downs = printed.iter().filter(|s| s.from == "full" || s.to == "etcd-only").count();
    assert!(all.contains(&format!("incident.csv: {downs} steps down, {} up", printed.len() - downs)), "{all}");
    for s in ["some_avg10", "threshold 40 %", "calm_threshold 10 %", "mem_available_floor 512 MiB", "sustain 30s"] {
        assert!(all.contains(s), "{s:?} not in the title: {all}");
    }
    assert!(all.contains("cooldown 1m") && all.contains("step_up automatic"), "{all}");
    assert!(!all.contains("downsampled"), "3000 rows are drawn in full");
    // Self-contained: no script, no link out, no font file.
    for bad in ["<script", "href", "@font-face", "url("] {
        assert!(!svg.contains(bad), "the SVG has {bad:?}");
    }
}

/// [`incident`] with the etcd member's columns as `record --etcd-member` writes them:
/// unhealthy for t in [150, 200), no answer in [250, 270) (restarted: its counters from
/// zero after), p99s high in the first burst, 3 heartbeat send failures, 2 slow
/// applies, 1 leader change.
fn incident_with_member() -> String {
    let mut out = String::new();
    for (i, line) in incident().lines().enumerate() {
        if i == 0 {
            out += &format!(
                "{line},etcd_healthy,etcd_wal_fsync_p99_ms,etcd_backend_commit_p99_ms,\
                 etcd_heartbeat_send_failures,etcd_slow_applies,etcd_leader_changes\n"
            );
            continue;
        }
        let t: f64 = line.split(',').next().unwrap().parse().unwrap();
        let healthy = if (150.0..200.0).contains(&t) { "0" } else { "1" };
        let (wal, commit) = if (100.0..400.0).contains(&t) { ("640.5", "1200") } else { ("2.1", "") };
        let before_restart = t < 250.0;
        let hb = if before_restart { 10 + u32::from(t >= 120.0) + u32::from(t >= 180.0) } else { 1 };
        let slow = if before_restart { 4 + u32::from(t >= 160.0) } else { u32::from(t >= 300.0) };
        let leader = if before_restart { 3 } else { 3 + u32::from(t >= 270.0) };
        out += &if (250.0..270.0).contains(&t) {
            format!("{line},,,,,,\n")
        } else {
            format!("{line},{healthy},{wal},{commit},{hb},{slow},{leader}\n")
        };
    }
    out
}

/// The picture's height in pixels.
fn height(svg: &str) -> &str {
    svg.split("height=\"").nth(1).unwrap().split('"').next().unwrap()
}

#[test]
fn a_trace_with_the_members_columns_draws_the_member() {
    let d = Dir::new();
    std::fs::write(d.path("regrade.toml"), format!("{CONFIG}[etcd]\nwal_fsync_p99_limit = \"250ms\"\n")).unwrap();
    let (printed, svg, with_member) = plot(&d, &incident_with_member());
    // The member changes no step, and the steps are still named as printed.
    let (plain, plain_svg, without) = plot(&d, &incident());
    assert_eq!(
        (&printed, String::from_utf8_lossy(&with_member.stdout)),
        (&plain, String::from_utf8_lossy(&without.stdout))
    );
    assert_eq!(drawn_steps(&svg), printed);
    let all = texts(&svg).join("\n");
    for s in [
        "etcd member p99",
        "etcd member unhealthy",
        "no answer",
        "WAL fsync p99",
        "backend commit p99",
        "wal_fsync_p99_limit 250ms",
        "backend_commit_p99_limit 1s",
        "heartbeat send failures 3, slow applies 2, leader changes 1",
    ] {
        assert!(all.contains(s), "{s:?} not in the picture: {all}");
    }
    // The lanes of marks, and a mark (a triangle) for each increment: 2 heartbeat
    // send failures before the restart and 1 after it, 1 + 1 slow applies, 1 leader change.
    for lane in ["heartbeat send failures", "slow applies", "leader changes"] {
        assert!(texts(&svg).iter().any(|t| t == lane), "no lane {lane:?}: {all}");
    }
    assert_eq!(svg.matches("<polygon").count(), 6, "one mark per increment");
    // The log scale names its decades, up to the commit's 1.2 s.
    for s in ["1 ms", "100 ms", "1 s"] {
        assert!(texts(&svg).iter().any(|t| t == s), "no {s:?} on the scale: {all}");
    }
    assert_eq!((height(&svg), height(&plain_svg)), ("1040", "800"));
    // Without the columns, none of it.
    let plain_all = texts(&plain_svg).join("\n");
    assert!(!plain_all.contains("etcd member") && !plain_svg.contains("<polygon"), "{plain_all}");
}

#[test]
fn a_floor_of_none_draws_no_floor_line() {
    let d = Dir::new();
    std::fs::write(d.path("regrade.toml"), CONFIG.replace("\"512MiB\"", "\"none\"")).unwrap();
    let (_, svg, _) = plot(&d, &incident());
    let all = texts(&svg).join("\n");
    assert!(all.contains("mem_available_floor none") && !all.contains("mem_available_floor 512"), "{all}");
}

#[test]
fn unplottable_traces_fail_naming_the_row_or_column() {
    let d = Dir::new();
    let csv = d.path("bad.csv");
    let svg = d.path("bad.svg");
    for (trace, want) in [
        ("t,some_avg10,mem_available_kb\n7,1,1\n", "line 2: the trace's only row"),
        ("t,some_avg10,mem_available_kb\n7,1,1\n7,2,1\n", "lines 2-3: every row has t = 7"),
        ("t,some_avg10,mem_available_kb\n", "no rows"),
    ] {
        std::fs::write(&csv, trace).unwrap();
        let out = d.simulate(&["--plot", svg.to_str().unwrap(), csv.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{trace:?}: {err}");
        assert!(!svg.exists());
    }
    std::fs::write(d.path("regrade.toml"), CONFIG.replace("\"512MiB\"", "\"none\"")).unwrap();
    std::fs::write(&csv, "t,some_avg10\n0,1\n1,1\n").unwrap();
    let out = d.simulate(&["--plot", svg.to_str().unwrap(), csv.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("\"mem_available_kb\" column"), "{err}");
}

#[test]
fn a_week_at_one_second_is_downsampled_for_drawing_only() {
    let d = Dir::new();
    let mut trace = String::with_capacity(30 << 20);
    trace += "t,some_avg10,mem_available_kb\n";
    // Calm, with one short burst a day: each burst steps down once and back up.
    for t in 0..604_800u32 {
        let burst = t % 86_400 >= 40_000 && t % 86_400 < 40_100;
        let (p, mem) = if burst { (70, 100_000) } else { (1, 4_000_000) };
        trace += &format!("{t},{p},{mem}\n");
    }
    let start = Instant::now();
    let (printed, svg, _) = plot(&d, &trace);
    let elapsed = start.elapsed();
    eprintln!("a week at 1 s (604,800 rows): simulate --plot took {elapsed:.2?}, SVG {} bytes", svg.len());
    assert_eq!(printed.len(), 28, "two steps down and two up each day: {printed:?}");
    // Each day's four steps are minutes apart, a pixel at this scale: one label each
    // day names how many, the first and the last.
    let texts = texts(&svg);
    let mut named = 0;
    let mut i = 0;
    for w in texts.windows(2) {
        let Some((n, _)) = w[0].split_once(" steps: ") else { continue };
        let n: usize = n.parse().unwrap();
        let (a, z) = w[1].split_once("(t=").unwrap().1.trim_end_matches(')').split_once('–').unwrap();
        assert_eq!((a, z), (printed[i].t.as_str(), printed[i + n - 1].t.as_str()), "{w:?}");
        assert!(w[0].starts_with(&format!("{n} steps: {} → … → {}", printed[i].from, printed[i + n - 1].to)));
        named += n;
        i += n;
    }
    assert_eq!(named, printed.len(), "{texts:?}");
    let all = texts.join("\n");
    assert!(all.contains("604800 samples") && all.contains("downsampled"), "{all}");
    assert!(svg.len() < 2_000_000, "the SVG of a week is {} bytes", svg.len());
}

#[test]
fn chromium_renders_the_svg() {
    if std::env::var_os("REGRADE_TEST_CHROMIUM").is_none() {
        eprintln!("skipped: set REGRADE_TEST_CHROMIUM=1 (needs Debian's chromium package)");
        return;
    }
    let d = Dir::new();
    let (printed, svg, _) = plot(&d, &incident());
    assert_eq!(drawn_steps(&svg), printed);
    let png = d.path("out.png");
    let out = chromium(&d.path("incident.svg"), &format!("--screenshot={}", png.display()), d.dir.path());
    assert!(out.status.success(), "chromium failed: {}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1200, "width");
    assert_eq!(u32::from_be_bytes(bytes[20..24].try_into().unwrap()), 800, "height");
    // A blank page compresses to a few kilobytes; the drawing does not.
    assert!(bytes.len() > 30_000, "the screenshot is {} bytes: nothing drawn?", bytes.len());
    eprintln!("chromium's screenshot: {} bytes", bytes.len());
    // The document Chromium built: an SVG with every label, and no parser error (an
    // SVG it cannot read renders as an error page, with no exit status to say so).
    let dom = dom_of(&d.path("incident.svg"), d.dir.path());
    assert!(dom.contains("<svg") && !dom.contains("parsererror"), "{dom:.2000}");
    for s in &printed {
        assert!(dom.contains(&format!("{} → {}", s.from, s.to)) && dom.contains(&format!("(t={})", s.t)), "{s:?}");
    }
    // And the check sees an error page: a half-written SVG.
    let broken = d.path("broken.svg");
    std::fs::write(&broken, &svg[..svg.len() / 2]).unwrap();
    assert!(dom_of(&broken, d.dir.path()).contains("parsererror"));
}

fn dom_of(svg: &Path, home: &Path) -> String {
    let out = chromium(svg, "--dump-dom", home);
    assert!(out.status.success(), "chromium --dump-dom failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Headless Chromium on `svg` with `what` (`--screenshot=…` or `--dump-dom`); root
/// needs `--no-sandbox`.
fn chromium(svg: &Path, what: &str, home: &Path) -> Output {
    Command::new("chromium")
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,800"])
        .arg(format!("--user-data-dir={}", home.join("chromium").display()))
        .arg(what)
        .arg(format!("file://{}", svg.display()))
        .env("HOME", home)
        .output()
        .expect("running chromium (Debian's chromium package)")
}
