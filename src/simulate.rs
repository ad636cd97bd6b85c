//! `simulate` replays a trace through the decision core; `record` writes such a trace
//! from the live files (README, "Commands"; docs/behaviour.md, "Decision rules"). The
//! CSV columns and the JSON lines are a contract.

use std::io::{BufRead, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::config::Config;
use crate::decide::{Reading, State};
use crate::level::Level;
use crate::pressure::Sampler;
use crate::sample::{Metric, Psi, Sample};

pub mod member;
pub mod plot;

pub use member::{MemberCells, MEMBER_COLUMNS};

/// `t`, the six averages in [`Metric::ALL`]'s order, `mem_available_kb`.
pub const COLUMNS: [&str; 8] = {
    let mut c = [""; 8];
    c[0] = "t";
    let mut i = 0;
    while i < Metric::ALL.len() {
        c[i + 1] = Metric::ALL[i].as_str();
        i += 1;
    }
    c[7] = "mem_available_kb";
    c
};

/// The latest `t` a trace may have: about 31,700 years, far from where adding a
/// sustain or cooldown to it could overflow a `Duration`.
const MAX_T: f64 = 1e12;

/// One line of `simulate`'s output.
#[derive(Debug, PartialEq, serde::Serialize)]
pub struct StepLine {
    pub t: serde_json::Number,
    pub action: &'static str,
    pub from: Level,
    pub to: Level,
}

/// One sample as the core took it, for the plot: the streaks are the core's, after
/// this sample and before the step it may have proposed ran.
#[derive(Clone, Copy, Debug)]
pub struct Observed {
    pub lineno: usize,
    pub t: f64,
    pub sample: Sample,
    /// Whether the trace has a `mem_available_kb` column.
    pub has_mem_available: bool,
    pub reading: Reading,
    pub over_since: Option<Duration>,
    pub calm_since: Option<Duration>,
    /// The etcd member's cells, when the trace has member columns.
    pub member: Option<MemberCells>,
}

pub fn run(cfg: &Config, trace: &Path, level: Level, plot_to: Option<&Path>) -> anyhow::Result<ExitCode> {
    let file = std::fs::File::open(trace).with_context(|| format!("opening {}", trace.display()))?;
    let out = std::io::stdout();
    let mut out = out.lock();
    // Printing and drawing take the steps from this one call: the picture shows the
    // steps the JSON says.
    let mut steps = vec![];
    let mut drawing = plot_to.map(|_| {
        plot::Recorder::new(cfg.core_settings())
            .member_limits(cfg.etcd.wal_fsync_p99_limit.0, cfg.etcd.backend_commit_p99_limit.0)
    });
    let plotting = drawing.is_some();
    replay_observed(
        cfg,
        std::io::BufReader::new(file),
        level,
        |o| drawing.as_mut().map_or(Ok(()), |d| d.observe(o)),
        |line| {
            serde_json::to_writer(&mut out, &line)?;
            out.write_all(b"\n")?;
            if plotting {
                steps.push(line);
            }
            Ok(())
        },
    )
    .with_context(|| format!("in {}", trace.display()))?;
    out.flush()?;
    if let (Some(d), Some(svg)) = (drawing, plot_to) {
        let started = Instant::now();
        let name = trace.file_name().map_or_else(|| trace.display().to_string(), |n| n.to_string_lossy().into_owned());
        let picture = d.finish(&name, level, &steps).with_context(|| format!("plotting {}", trace.display()))?;
        std::fs::write(svg, picture).with_context(|| format!("writing {}", svg.display()))?;
        tracing::debug!(elapsed = ?started.elapsed(), "plotted");
    }
    Ok(ExitCode::SUCCESS)
}

/// Replays `trace` from `level`, calling `emit` for every step. Every step succeeds.
pub fn replay(
    cfg: &Config,
    trace: impl BufRead,
    level: Level,
    emit: impl FnMut(StepLine) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    replay_observed(cfg, trace, level, |_| Ok(()), emit)
}

/// [`replay`], calling `seen` for every sample before `emit` for the step it led to.
pub fn replay_observed(
    cfg: &Config,
    trace: impl BufRead,
    level: Level,
    mut seen: impl FnMut(&Observed) -> anyhow::Result<()>,
    mut emit: impl FnMut(StepLine) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let settings = cfg.core_settings();
    let levels = &Level::ALL[..];
    let mut state = State::new(level);
    let mut lines = trace.lines().enumerate();
    let header = loop {
        match lines.next() {
            Some((_, l)) => {
                let l = l?;
                if !l.trim().is_empty() {
                    break l;
                }
            }
            None => bail!("the trace is empty (expected a header row: {})", COLUMNS.join(",")),
        }
    };
    let names: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |name: &str| names.iter().position(|n| *n == name);
    for n in &names {
        if !COLUMNS.contains(n) && !MEMBER_COLUMNS.contains(n) {
            bail!(
                "line 1: unknown column {n:?} (columns: {}; and the etcd member's: {})",
                COLUMNS.join(","),
                MEMBER_COLUMNS.join(",")
            );
        }
    }
    let member_cols = member::MemberColumns::find(&names);
    let t_col = col("t").context("line 1: no \"t\" column")?;
    col(settings.metric.as_str())
        .with_context(|| format!("line 1: no {:?} column, which pressure.metric names", settings.metric.as_str()))?;
    let mem_col = col("mem_available_kb");
    if settings.mem_available_floor.is_some() && mem_col.is_none() {
        bail!("line 1: no \"mem_available_kb\" column, which pressure.mem_available_floor needs");
    }
    let mut last_t = None;
    // The member's last look that answered, and when: given to the core while it is
    // as fresh as `watch` would take it.
    let member_max_age = cfg.etcd.member_look_max_age().as_secs_f64();
    let mut last_look: Option<(f64, crate::decide::MemberSignals)> = None;
    for (i, line) in lines {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let lineno = i + 1;
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if cells.len() != names.len() {
            bail!("line {lineno}: {} cells, the header has {}", cells.len(), names.len());
        }
        let num = |c: usize| -> anyhow::Result<f64> {
            let v: f64 = cells[c]
                .parse()
                .map_err(|_| anyhow::anyhow!("line {lineno}: {}: {:?} is not a number", names[c], cells[c]))?;
            if !v.is_finite() || v < 0.0 {
                bail!("line {lineno}: {}: {:?} must be 0 or more", names[c], cells[c]);
            }
            Ok(v)
        };
        let t = num(t_col)?;
        if t > MAX_T {
            bail!("line {lineno}: t = {t} is past the end of any trace (at most {MAX_T} seconds)");
        }
        if last_t.is_some_and(|l| t < l) {
            bail!("line {lineno}: t = {t} goes back in time");
        }
        last_t = Some(t);
        let mut sample = Sample { psi: Psi::default(), mem_available: u64::MAX };
        for m in Metric::ALL {
            if let Some(c) = col(m.as_str()) {
                sample.psi.set(m, num(c)?);
            }
        }
        if let Some(c) = mem_col {
            sample.mem_available = (num(c)? as u64).saturating_mul(1024);
        }
        let member = member_cols.map(|m| m.read(&cells, lineno)).transpose()?;
        let now = Duration::from_secs_f64(t);
        if let Some(m) = member.filter(MemberCells::looked) {
            last_look = Some((t, m.signals()));
        }
        let look = last_look.filter(|(at, _)| t - at <= member_max_age).map(|(_, m)| m).unwrap_or_default();
        let reading = settings.classify(&sample, &look);
        let step = state.observe(&settings, levels, now, reading);
        seen(&Observed {
            lineno,
            t,
            sample,
            has_mem_available: mem_col.is_some(),
            reading,
            over_since: state.over_since,
            calm_since: state.calm_since,
            member,
        })?;
        if let Some(step) = step {
            state.step_ran(now, step.to);
            emit(StepLine {
                t: seconds(cells[t_col], t),
                action: step.direction.action(),
                from: step.from,
                to: step.to,
            })?;
        }
    }
    Ok(())
}

/// `t` as the trace wrote it: a whole number stays whole.
fn seconds(text: &str, v: f64) -> serde_json::Number {
    text.parse::<u64>()
        .map(serde_json::Number::from)
        .ok()
        .or_else(|| serde_json::Number::from_f64(v))
        .unwrap_or_else(|| serde_json::Number::from(0))
}

/// With `etcd_member`, each row also has the local member's columns ([`MEMBER_COLUMNS`]).
pub fn record(cfg: &Config, count: Option<u64>, interval: Option<&str>, etcd_member: bool) -> anyhow::Result<ExitCode> {
    let period = match interval {
        Some(s) => crate::units::parse_duration(s).map_err(|e| anyhow::anyhow!("--interval: {e}"))?,
        None => cfg.pressure.sample_period.0,
    };
    let mut sampler = Sampler::for_config(&cfg.pressure)?.needing(crate::pressure::Needs::ALL);
    let mut member = etcd_member.then(|| member::Looker::new(&cfg.etcd)).transpose()?;
    let out = std::io::stdout();
    let mut out = out.lock();
    write!(out, "{}", COLUMNS.join(","))?;
    if member.is_some() {
        write!(out, ",{}", MEMBER_COLUMNS.join(","))?;
    }
    writeln!(out)?;
    out.flush()?;
    // std's clock and a blocking sleep keep the schedule; the member's look (its own
    // small runtime) fits within the time left until the next row is due.
    let start = Instant::now();
    let due = |n: u64| start + period * u32::try_from(n).unwrap_or(u32::MAX);
    let mut n = 0u64;
    while count.is_none_or(|c| n < c) {
        if n > 0 {
            std::thread::sleep(due(n).saturating_duration_since(Instant::now()));
        }
        let s = sampler.sample()?;
        let t = start.elapsed().as_secs_f64();
        write!(out, "{t:.3}")?;
        for m in Metric::ALL {
            write!(out, ",{}", s.psi.get(m))?;
        }
        write!(out, ",{}", s.mem_available / 1024)?;
        if let Some(m) = member.as_mut() {
            m.look(due(n + 1).saturating_duration_since(Instant::now())).write(&mut out)?;
        }
        writeln!(out)?;
        out.flush()?;
        n += 1;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        Config::parse(&format!(
            "[pressure]\nthreshold = 40\ncalm_threshold = 10\nmem_available_floor = \"1MiB\"\n\
             sample_period = \"10s\"\nsustain = \"30s\"\ncooldown = \"60s\"\n{extra}"
        ))
        .unwrap()
    }

    fn steps(cfg: &Config, trace: &str, level: Level) -> anyhow::Result<Vec<StepLine>> {
        let mut v = vec![];
        replay(cfg, trace.as_bytes(), level, |l| {
            v.push(l);
            Ok(())
        })?;
        Ok(v)
    }

    #[test]
    fn replays_over_then_calm() {
        let mut trace = String::from("mem_available_kb,t,some_avg10\n");
        for t in (0..=200).step_by(10) {
            trace += &format!("100,{t},50\n");
        }
        for t in (210..=400).step_by(10) {
            trace += &format!("4096,{t},1.5\n");
        }
        let got = steps(&cfg(""), &trace, Level::Full).unwrap();
        let json: Vec<String> = got.iter().map(|l| serde_json::to_string(l).unwrap()).collect();
        assert_eq!(
            json,
            [
                r#"{"t":30,"action":"step-down","from":"full","to":"control-plane"}"#,
                r#"{"t":90,"action":"step-down","from":"control-plane","to":"etcd-only"}"#,
                r#"{"t":240,"action":"step-up","from":"etcd-only","to":"control-plane"}"#,
                r#"{"t":300,"action":"step-up","from":"control-plane","to":"full"}"#,
            ]
        );
    }

    #[test]
    fn start_level_and_manual_mode() {
        let trace = "t,some_avg10,mem_available_kb\n0,0,4096\n100,0,4096\n";
        let got = steps(&cfg(""), trace, Level::EtcdOnly).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].from, got[0].to), (Level::EtcdOnly, Level::ControlPlane));
        let manual = Config::parse("step_up = \"manual\"\n").unwrap();
        assert!(steps(&manual, trace, Level::EtcdOnly).unwrap().is_empty());
    }

    #[test]
    fn bad_traces_name_line_and_column() {
        let c = cfg("");
        let e = |t: &str| format!("{:#}", steps(&c, t, Level::Full).unwrap_err());
        assert!(e("").contains("empty"));
        assert!(e("t,some_avg10,bogus\n").contains("bogus"));
        assert!(e("t,mem_available_kb\n").contains("some_avg10"));
        assert!(e("t,some_avg10\n").contains("mem_available_kb"));
        let msg = e("t,some_avg10,mem_available_kb\n0,1,1\n5,x,1\n");
        assert!(msg.contains("line 3") && msg.contains("some_avg10"), "{msg}");
        assert!(e("t,some_avg10,mem_available_kb\n10,1,1\n5,1,1\n").contains("back in time"));
        assert!(e("t,some_avg10,mem_available_kb\n10,1\n").contains("line 2"));
        assert!(e("t,some_avg10,mem_available_kb\n10,-1,1\n").contains("0 or more"));
        // A time too large for a Duration is an error naming the line, not an abort.
        let msg = e("t,some_avg10,mem_available_kb\n1e30,1,1\n");
        assert!(msg.contains("line 2") && msg.contains("t = "), "{msg}");
    }

    #[test]
    fn a_member_in_distress_steps_over_the_floor_while_its_look_is_fresh() {
        // PSI over, memory well above the floor: neither, unless the member is in distress.
        let trace = |member: &dyn Fn(u64) -> &'static str| {
            let mut t = format!("t,some_avg10,mem_available_kb,{}\n", MEMBER_COLUMNS[..3].join(","));
            for s in (0..=200).step_by(10) {
                t += &format!("{s},50,10000000,{}\n", member(s));
            }
            t
        };
        let at = |steps: Vec<StepLine>| steps.iter().map(|l| l.t.to_string()).collect::<Vec<_>>();
        let unhealthy_from_50 = trace(&|s| if s >= 50 { "0,," } else { "1,," });
        assert_eq!(at(steps(&cfg(""), &unhealthy_from_50, Level::Full).unwrap()), ["80", "140"]);
        let off = cfg("[etcd]\ndistress_overrides_floor = false");
        assert!(steps(&off, &unhealthy_from_50, Level::Full).unwrap().is_empty());
        // A commit p99 at its limit (1 s) is distress too; under it is not.
        let slow = trace(&|_| "1,,1000");
        assert_eq!(at(steps(&cfg(""), &slow, Level::Full).unwrap()), ["30", "90"]);
        assert!(steps(&cfg(""), &trace(&|_| "1,,999"), Level::Full).unwrap().is_empty());
        // One look, then none: it counts while fresh (3 looks of 10 s and 2 timeouts of
        // 3 s: 36 s), not after. The streak from 0 lasts to 30 only.
        let one_look = trace(&|s| if s == 0 { "0,," } else { ",," });
        assert_eq!(at(steps(&cfg(""), &one_look, Level::Full).unwrap()), ["30"]);
    }

    #[test]
    fn member_columns_are_read_by_name_and_a_well_member_changes_no_step() {
        let mut plain = String::from("t,some_avg10,mem_available_kb\n");
        let mut with = format!("etcd_slow_applies,t,some_avg10,mem_available_kb,{}\n", &MEMBER_COLUMNS[..5].join(","));
        for t in (0..=200).step_by(10) {
            plain += &format!("{t},50,100\n");
            // Every kind of cell: empty ones, and values.
            let member = if t % 20 == 0 { "1,3.5,12.25,0,2" } else { ",,,," };
            with += &format!("{},{t},50,100,{member}\n", t / 10);
        }
        let c = cfg("");
        let json = |steps: Vec<StepLine>| steps.iter().map(|l| serde_json::to_string(l).unwrap()).collect::<Vec<_>>();
        let expected = json(steps(&c, &plain, Level::Full).unwrap());
        assert!(!expected.is_empty());
        assert_eq!(json(steps(&c, &with, Level::Full).unwrap()), expected);
        let mut seen = vec![];
        replay_observed(
            &c,
            with.as_bytes(),
            Level::Full,
            |o| {
                seen.push(o.member);
                Ok(())
            },
            |_| Ok(()),
        )
        .unwrap();
        assert_eq!(seen[0].unwrap().wal_fsync_p99_ms, Some(3.5));
        assert_eq!(seen[0].unwrap().slow_applies, Some(0));
        assert_eq!(seen[1].unwrap(), MemberCells { slow_applies: Some(1), ..Default::default() });
        // A trace without them has none; a bad cell names its line and column.
        replay_observed(
            &c,
            plain.as_bytes(),
            Level::Full,
            |o| {
                assert!(o.member.is_none());
                Ok(())
            },
            |_| Ok(()),
        )
        .unwrap();
        let bad = with.replacen(",,,,\n", ",abc,,,\n", 1);
        let msg = format!("{:#}", steps(&c, &bad, Level::Full).unwrap_err());
        assert!(msg.contains("line 3: etcd_wal_fsync_p99_ms: \"abc\""), "{msg}");
        let msg = format!("{:#}", steps(&c, "t,some_avg10,mem_available_kb,etcd_bogus\n", Level::Full).unwrap_err());
        assert!(msg.contains("unknown column \"etcd_bogus\"") && msg.contains("etcd_healthy"), "{msg}");
    }

    fn plot(cfg: &Config, trace: &str) -> anyhow::Result<String> {
        let mut rec = plot::Recorder::new(cfg.core_settings());
        let mut steps = vec![];
        replay_observed(
            cfg,
            trace.as_bytes(),
            Level::Full,
            |o| rec.observe(o),
            |l| {
                steps.push(l);
                Ok(())
            },
        )?;
        rec.finish("trace.csv", Level::Full, &steps)
    }

    #[test]
    fn traces_that_cannot_be_drawn_say_which_row_or_column() {
        let c = cfg("");
        let e = |t: &str| format!("{:#}", plot(&c, t).unwrap_err());
        assert!(e("t,some_avg10,mem_available_kb\n").contains("no rows"));
        let msg = e("t,some_avg10,mem_available_kb\n5,1,1\n");
        assert!(msg.contains("line 2") && msg.contains("only row"), "{msg}");
        let msg = e("t,some_avg10,mem_available_kb\n5,1,1\n\n5,2,1\n5,3,1\n");
        assert!(msg.contains("lines 2-5") && msg.contains("t = 5") && msg.contains("no time"), "{msg}");
        let no_floor = Config::parse("[pressure]\nmem_available_floor = \"none\"\n").unwrap();
        let msg = format!("{:#}", plot(&no_floor, "t,some_avg10\n0,1\n1,1\n").unwrap_err());
        assert!(msg.contains("mem_available_kb"), "{msg}");
        // Two rows a second apart are enough.
        assert!(plot(&c, "t,some_avg10,mem_available_kb\n0,1,1\n1,1,1\n").unwrap().starts_with("<svg"));
    }

    #[test]
    fn the_columns_are_the_contract() {
        assert_eq!(
            COLUMNS,
            [
                "t",
                "some_avg10",
                "some_avg60",
                "some_avg300",
                "full_avg10",
                "full_avg60",
                "full_avg300",
                "mem_available_kb"
            ]
        );
    }

    #[test]
    fn fractional_times_stay_fractional() {
        let mut trace = String::from("t,some_avg10,mem_available_kb\n");
        for i in 0..=40 {
            trace += &format!("{}.5,90,1\n", i);
        }
        let got = steps(&cfg(""), &trace, Level::Full).unwrap();
        assert_eq!(serde_json::to_string(&got[0].t).unwrap(), "30.5");
    }
}
