//! `simulate --plot`: one SVG of a replayed trace — the metric against `threshold` and
//! `calm_threshold`, MemAvailable against its floor, each sample's reading, the
//! streaks with their `sustain`, the cooldowns, and the level with every step; and,
//! when the trace has the etcd member's columns, a panel of the member.
//!
//! Here: what is collected and the layout. The title and the panels above the level
//! are in `panels`, the level and the time axis in `level`, the member's panel in
//! `member`, thinning a long trace in `thin`, labels and text styles in `text`.
//!
//! Only the `simulate` command draws; nothing of this runs in `watch`. The steps drawn
//! are the list `simulate` printed, taken as they were emitted.

use std::ops::Range;
use std::time::Duration;

use anyhow::bail;
use plotters::chart::MeshStyle;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::{Observed, StepLine};
use crate::decide::{Reading, Settings};
use crate::level::Level;

mod level;
mod member;
mod panels;
mod text;
mod thin;

use text::time_ticks;
pub use text::{burst_label, clock, step_label};
use thin::{merge_close, min_max, worst_per_bucket, zip};

pub const WIDTH: u32 = 1200;
/// Without the etcd member's panel; with it, [`member::MEMBER_HEIGHT`] more.
pub const HEIGHT: u32 = 800;

/// More samples than this are drawn as the minimum and maximum of each of
/// [`BUCKETS`] equal slices of time: a week at 1 s stays a file a browser opens.
pub const MAX_POINTS: usize = 4000;
const BUCKETS: usize = 1200;
/// More runs of one reading (or streaks) than this are merged per bucket.
const MAX_SPANS: usize = 3000;

const FONT: &str = "sans-serif";
const BG: RGBColor = RGBColor(255, 255, 255);
const INK: RGBColor = RGBColor(33, 33, 33);
const FAINT: RGBColor = RGBColor(110, 110, 110);
const GRID: RGBColor = RGBColor(225, 225, 225);
const METRIC: RGBColor = RGBColor(31, 119, 180);
const OVER: RGBColor = RGBColor(214, 39, 40);
const CALM: RGBColor = RGBColor(44, 150, 44);
const NEITHER: RGBColor = RGBColor(190, 190, 190);
const MEM: RGBColor = RGBColor(128, 80, 180);
const FLOOR: RGBColor = RGBColor(220, 100, 0);
const COOLDOWN: RGBColor = RGBColor(60, 110, 170);

/// A stretch of time with one value: `start` to `end` in trace seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Span<T> {
    start: f64,
    end: f64,
    what: T,
}

/// Which way a streak goes: over (towards a step down) or calm (towards a step up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Streak {
    Over,
    Calm,
}

/// Collects what the replay saw, sample by sample, and draws it once it is done.
pub struct Recorder {
    settings: Settings,
    t: Vec<f64>,
    metric: Vec<f64>,
    mem_mib: Vec<f64>,
    first_line: usize,
    last_line: usize,
    readings: Vec<Span<Reading>>,
    streaks: Vec<Span<Streak>>,
    /// The streak under way: its kind, the core's start of it, and it still held at.
    open: Option<(Streak, Duration, f64)>,
    /// The etcd member's columns, when the trace has them.
    member: Option<member::MemberTrack>,
    /// `etcd.wal_fsync_p99_limit`, `etcd.backend_commit_p99_limit`, drawn in its panel.
    member_limits: (Duration, Duration),
}

impl Recorder {
    pub fn new(settings: Settings) -> Recorder {
        Recorder {
            settings,
            t: vec![],
            metric: vec![],
            mem_mib: vec![],
            first_line: 0,
            last_line: 0,
            readings: vec![],
            streaks: vec![],
            open: None,
            member: None,
            member_limits: {
                let d = crate::etcd::EtcdConfig::default();
                (d.wal_fsync_p99_limit.0, d.backend_commit_p99_limit.0)
            },
        }
    }

    /// The etcd member's limits its panel draws (`etcd.wal_fsync_p99_limit`,
    /// `etcd.backend_commit_p99_limit`).
    pub fn member_limits(mut self, wal_fsync_p99: Duration, backend_commit_p99: Duration) -> Recorder {
        self.member_limits = (wal_fsync_p99, backend_commit_p99);
        self
    }

    pub fn observe(&mut self, o: &Observed) -> anyhow::Result<()> {
        if self.t.is_empty() {
            if !o.has_mem_available {
                bail!("line 1: no \"mem_available_kb\" column, which the plot's MemAvailable axis needs");
            }
            self.first_line = o.lineno;
        }
        self.last_line = o.lineno;
        self.t.push(o.t);
        self.metric.push(o.sample.metric(self.settings.metric));
        self.mem_mib.push(o.sample.mem_available as f64 / MIB);
        if let Some(cells) = &o.member {
            self.member.get_or_insert_with(Default::default).observe(o.t, cells);
        }
        match self.readings.last_mut() {
            Some(r) if r.what == o.reading => r.end = o.t,
            last => {
                // A reading holds until the next sample.
                if let Some(r) = last {
                    r.end = o.t;
                }
                self.readings.push(Span { start: o.t, end: o.t, what: o.reading });
            }
        }
        let now = match (o.over_since, o.calm_since) {
            (Some(s), _) => Some((Streak::Over, s)),
            (None, Some(s)) => Some((Streak::Calm, s)),
            (None, None) => None,
        };
        match (&mut self.open, now) {
            (Some((kind, since, held)), Some((k, s))) if *kind == k && *since == s => *held = o.t,
            (open, now) => {
                if let Some((kind, since, held)) = open.take() {
                    self.streaks.push(Span { start: since.as_secs_f64(), end: held, what: kind });
                }
                *open = now.map(|(k, s)| (k, s, o.t));
            }
        }
        Ok(())
    }

    /// The SVG of everything observed, with `steps` (the lines `simulate` printed).
    pub fn finish(mut self, name: &str, start: Level, steps: &[StepLine]) -> anyhow::Result<String> {
        let n = self.t.len();
        match n {
            0 => bail!("the trace has a header and no rows: nothing to plot"),
            1 => bail!("line {}: the trace's only row; a plot needs two rows or more", self.first_line),
            _ => {}
        }
        let (t0, t1) = (self.t[0], self.t[n - 1]);
        if t1 <= t0 {
            bail!(
                "lines {}-{}: every row has t = {t0}, so the trace spans no time (t is in seconds)",
                self.first_line,
                self.last_line
            );
        }
        if let Some((kind, since, held)) = self.open.take() {
            self.streaks.push(Span { start: since.as_secs_f64(), end: held, what: kind });
        }
        let steps: Vec<(f64, &StepLine)> = steps.iter().map(|s| (s.t.as_f64().unwrap_or(0.0), s)).collect();
        let bucket = (t1 - t0) / BUCKETS as f64;
        let thinned = n > MAX_POINTS;
        let (metric, mem) = if thinned {
            (min_max(&self.t, &self.metric, t0, bucket), min_max(&self.t, &self.mem_mib, t0, bucket))
        } else {
            (zip(&self.t, &self.metric), zip(&self.t, &self.mem_mib))
        };
        let readings =
            if self.readings.len() > MAX_SPANS { worst_per_bucket(&self.readings, t0, bucket) } else { self.readings };
        let streaks = if self.streaks.len() > MAX_SPANS { merge_close(&self.streaks, bucket) } else { self.streaks };
        let member = self.member.map(|m| m.finish(t0, bucket, thinned, self.member_limits));
        let picture = Picture {
            name,
            start,
            settings: &self.settings,
            span: (t0, t1),
            samples: n,
            thinned,
            metric,
            mem,
            readings,
            streaks,
            steps,
            member,
        };
        let mut svg = String::new();
        picture.draw(&mut svg).map_err(|e| anyhow::anyhow!("drawing the SVG: {e}"))?;
        Ok(svg)
    }
}

const MIB: f64 = 1024.0 * 1024.0;

struct Picture<'a> {
    name: &'a str,
    start: Level,
    settings: &'a Settings,
    span: (f64, f64),
    samples: usize,
    thinned: bool,
    metric: Vec<(f64, f64)>,
    mem: Vec<(f64, f64)>,
    readings: Vec<Span<Reading>>,
    streaks: Vec<Span<Streak>>,
    steps: Vec<(f64, &'a StepLine)>,
    member: Option<member::MemberPicture>,
}

type Res = Result<(), Box<dyn std::error::Error>>;

/// Every panel's chart: trace seconds across, the panel's values up.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A panel's value axis and its lines, in the picture's style; the time grid is drawn
/// apart ([`Picture::time_grid`]), on the same ticks in every panel.
fn mesh<'a, 'b, 'c>(chart: &'c mut Chart<'a, 'b>) -> MeshStyle<'a, 'c, RangedCoordf64, RangedCoordf64, SVGBackend<'b>> {
    let mut m = chart.configure_mesh();
    m.disable_x_mesh()
        .label_style(text::font(15, &INK))
        .axis_desc_style(text::font(15, &INK))
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .axis_style(FAINT);
    m
}

/// Left of every panel: the value axis and the lanes' names; the same for all, so
/// their time axes line up.
const LEFT: u32 = 118;
const MARGIN_RIGHT: u32 = 28;

impl Picture<'_> {
    fn draw(&self, out: &mut String) -> Res {
        let height = HEIGHT + self.member.as_ref().map_or(0, |_| member::MEMBER_HEIGHT);
        let root = SVGBackend::with_string(out, (WIDTH, height)).into_drawing_area();
        // An opaque page of its own: the same on a dark or a light page.
        root.fill(&BG)?;
        root.draw(&Rectangle::new([(0, 0), (WIDTH as i32 - 1, height as i32 - 1)], FAINT.stroke_width(1)))?;
        let (title, rest) = root.split_vertically(128);
        // The member's panel, if any, goes above the level's, which carries the time axis.
        let mut breaks = vec![222, 306, 432];
        if self.member.is_some() {
            breaks.push(432 + member::MEMBER_HEIGHT);
        }
        let panels = rest.split_by_breakpoints([] as [u32; 0], breaks);
        self.title(&title)?;
        self.metric_panel(&panels[0])?;
        self.lanes_panel(&panels[1])?;
        self.mem_panel(&panels[2])?;
        if let Some(m) = &self.member {
            self.member_panel(&panels[3], m)?;
        }
        self.level_panel(&panels[panels.len() - 1])?;
        root.present()?;
        Ok(())
    }

    fn duration(&self) -> f64 {
        self.span.1 - self.span.0
    }

    /// A panel's chart: time across, `y` up, with the value axis as wide in every panel
    /// so that their time axes line up; `margins` above and below, and the height
    /// `time_labels` of the time axis's labels (the level panel's only).
    fn chart<'a, 'b>(
        &self,
        area: &'a DrawingArea<SVGBackend<'b>, Shift>,
        y: Range<f64>,
        margins: (u32, u32),
        time_labels: u32,
    ) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
        Ok(ChartBuilder::on(area)
            .margin_left(6)
            .margin_right(MARGIN_RIGHT)
            .margin_top(margins.0)
            .margin_bottom(margins.1)
            .x_label_area_size(time_labels)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(self.span.0..self.span.1, y)?)
    }

    /// The time grid's lines through a panel.
    fn time_grid<DB: DrawingBackend>(
        &self,
        chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
        y: (f64, f64),
    ) -> Res
    where
        DB::ErrorType: 'static,
    {
        for t in time_ticks(self.span.0, self.span.1) {
            chart.draw_series(LineSeries::new([(t, y.0), (t, y.1)], GRID.stroke_width(1)))?;
        }
        Ok(())
    }

    /// The vertical line of each step through a panel, red down and green up.
    fn step_lines<DB: DrawingBackend>(
        &self,
        chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
        y: (f64, f64),
    ) -> Res
    where
        DB::ErrorType: 'static,
    {
        for (t, l) in &self.steps {
            let c = if l.action == "step-down" { OVER } else { CALM };
            chart.draw_series(DashedLineSeries::new([(*t, y.0), (*t, y.1)], 4, 4, c.mix(0.7).stroke_width(1)))?;
        }
        Ok(())
    }
}
