//! `simulate --plot`: one SVG of a replayed trace — the metric against `threshold` and
//! `calm_threshold`, MemAvailable against its floor, each sample's reading, the
//! streaks with their `sustain`, the cooldowns, and the level with every step.
//!
//! Only the `simulate` command draws; nothing of this runs in `watch`. The steps drawn
//! are the list `simulate` printed, taken as they were emitted.

use std::time::Duration;

use anyhow::bail;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{Observed, StepLine};
use crate::decide::{Reading, Settings, StepUp};
use crate::level::Level;
use crate::units::format_duration;

pub const WIDTH: u32 = 1200;
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
        }
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
        };
        let mut svg = String::new();
        picture.draw(&mut svg).map_err(|e| anyhow::anyhow!("drawing the SVG: {e}"))?;
        Ok(svg)
    }
}

const MIB: f64 = 1024.0 * 1024.0;

fn zip(t: &[f64], v: &[f64]) -> Vec<(f64, f64)> {
    t.iter().copied().zip(v.iter().copied()).collect()
}

/// Each bucket's lowest and highest value, in the order they came: a peak of one
/// sample survives the thinning.
fn min_max(t: &[f64], v: &[f64], t0: f64, bucket: f64) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(BUCKETS * 2 + 2);
    let mut i = 0;
    while i < t.len() {
        let b = ((t[i] - t0) / bucket).floor();
        let (mut lo, mut hi) = (i, i);
        let mut j = i + 1;
        while j < t.len() && ((t[j] - t0) / bucket).floor() == b {
            if v[j] < v[lo] {
                lo = j;
            }
            if v[j] > v[hi] {
                hi = j;
            }
            j += 1;
        }
        let (a, z) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push((t[a], v[a]));
        if z != a {
            out.push((t[z], v[z]));
        }
        i = j;
    }
    out
}

/// Runs of readings coarsened to buckets: a bucket with any over is over, else one
/// with any neither is neither, else calm (a stretch of pressure is never hidden).
fn worst_per_bucket(runs: &[Span<Reading>], t0: f64, bucket: f64) -> Vec<Span<Reading>> {
    let rank = |r: Reading| match r {
        Reading::Calm => 1u8,
        Reading::Neither => 2,
        Reading::Over => 3,
    };
    let mut worst = vec![0u8; BUCKETS + 1];
    for r in runs {
        let a = (((r.start - t0) / bucket) as usize).min(BUCKETS);
        // A run ends where the next begins: the bucket of its end belongs to the next.
        let z = ((((r.end - t0) / bucket) as usize).max(a + 1) - 1).min(BUCKETS);
        for w in &mut worst[a..=z.max(a)] {
            *w = (*w).max(rank(r.what));
        }
    }
    let mut out: Vec<Span<Reading>> = vec![];
    for (i, w) in worst.iter().enumerate() {
        let what = match w {
            3 => Reading::Over,
            2 => Reading::Neither,
            1 => Reading::Calm,
            _ => continue,
        };
        let (start, end) = (t0 + i as f64 * bucket, t0 + (i + 1) as f64 * bucket);
        match out.last_mut() {
            Some(s) if s.what == what && s.end >= start => s.end = end,
            _ => out.push(Span { start, end, what }),
        }
    }
    out
}

/// Streaks of one kind less than `gap` apart drawn as one.
fn merge_close(spans: &[Span<Streak>], gap: f64) -> Vec<Span<Streak>> {
    let mut out: Vec<Span<Streak>> = vec![];
    for s in spans {
        match out.last_mut() {
            Some(l) if l.what == s.what && s.start - l.end < gap => l.end = s.end,
            _ => out.push(*s),
        }
    }
    out
}

/// `t` as a person reads it: `mm:ss`, `h:mm:ss` past an hour, `Nd hh:mm` past two days.
pub fn clock(t: f64, span: f64) -> String {
    let s = t.max(0.0).round() as u64;
    if span < 3600.0 && s < 6000 {
        format!("{:02}:{:02}", s / 60, s % 60)
    } else if span < 2.0 * 86400.0 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}d {:02}:{:02}", s / 86400, s / 3600 % 24, s / 60 % 60)
    }
}

/// About ten ticks at a step a person counts in: 10 s, 1 min, 5 min, 1 h, 1 d ...
fn time_ticks(a: f64, z: f64) -> Vec<f64> {
    const STEPS: [f64; 21] = [
        1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 900.0, 1800.0, 3600.0, 7200.0, 10800.0, 21600.0,
        43200.0, 86400.0, 172800.0, 604800.0, 2592000.0,
    ];
    let want = (z - a) / 10.0;
    let step = STEPS.iter().copied().find(|s| *s >= want).unwrap_or(want.max(1.0));
    let mut out = vec![];
    let mut k = (a / step).ceil();
    while k * step <= z + 1e-9 {
        out.push(k * step);
        k += 1.0;
    }
    out
}

/// What the time axis says its labels are.
fn clock_unit(span: f64, end: f64) -> &'static str {
    if span < 3600.0 && end < 6000.0 {
        "mm:ss"
    } else if span < 2.0 * 86400.0 {
        "h:mm:ss"
    } else {
        "days hh:mm"
    }
}

/// The label of one step, two lines: `from → to`, then when.
pub fn step_label(step: &StepLine, span: f64) -> [String; 2] {
    let t = step.t.as_f64().unwrap_or(0.0);
    [format!("{} → {}", step.from.as_str(), step.to.as_str()), format!("{} (t={})", clock(t, span), step.t)]
}

/// The label of `n` steps drawn as one: `n steps: from → … → to`, then from when to when.
pub fn burst_label(first: &StepLine, last: &StepLine, n: usize, span: f64) -> [String; 2] {
    let (a, z) = (first.t.as_f64().unwrap_or(0.0), last.t.as_f64().unwrap_or(0.0));
    [
        format!("{n} steps: {} → … → {}", first.from.as_str(), last.to.as_str()),
        format!("{}–{} (t={}–{})", clock(a, span), clock(z, span), first.t, last.t),
    ]
}

fn mib(v: f64) -> String {
    if v >= 10240.0 {
        format!("{:.1} GiB", v / 1024.0)
    } else {
        format!("{v:.0} MiB")
    }
}

/// A number as short as it can be written: `40`, `12.5`.
fn num(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

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
}

type Res = Result<(), Box<dyn std::error::Error>>;

/// A label's row, the steps it names, and whether it is anchored by its right end.
type Placed<'a> = (usize, Vec<(f64, &'a StepLine)>, bool);

/// Left of every panel: the value axis and the lanes' names; the same for all, so
/// their time axes line up.
const LEFT: u32 = 118;
const MARGIN_RIGHT: u32 = 28;

fn font(size: u32, color: &RGBColor) -> TextStyle<'static> {
    (FONT, size).into_font().color(color)
}

/// About how wide `text` is in a sans-serif face at `size` (plotters' size).
fn text_width(text: &str, size: u32) -> i32 {
    (text.chars().count() as f64 * size as f64 / 1.24 * 0.56) as i32
}

fn bold(size: u32, color: &RGBColor) -> TextStyle<'static> {
    (FONT, size, FontStyle::Bold).into_font().color(color)
}

impl Picture<'_> {
    fn draw(&self, out: &mut String) -> Res {
        let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
        // An opaque page of its own: the same on a dark or a light page.
        root.fill(&BG)?;
        root.draw(&Rectangle::new([(0, 0), (WIDTH as i32 - 1, HEIGHT as i32 - 1)], FAINT.stroke_width(1)))?;
        let (title, rest) = root.split_vertically(128);
        let panels = rest.split_by_breakpoints([] as [u32; 0], [222, 306, 432]);
        self.title(&title)?;
        self.metric_panel(&panels[0])?;
        self.lanes_panel(&panels[1])?;
        self.mem_panel(&panels[2])?;
        self.level_panel(&panels[3])?;
        root.present()?;
        Ok(())
    }

    fn duration(&self) -> f64 {
        self.span.1 - self.span.0
    }

    fn title(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let downs = self.steps.iter().filter(|(_, l)| l.action == "step-down").count();
        let ups = self.steps.len() - downs;
        let head = format!(
            "{}: {} step{} down, {} up (starting at {})",
            self.name,
            downs,
            if downs == 1 { "" } else { "s" },
            ups,
            self.start.as_str()
        );
        area.draw(&Text::new(head, (14, 10), bold(24, &INK)))?;
        let floor = s.mem_available_floor.map_or("none".to_string(), |b| mib(b as f64 / MIB));
        let step_up = match s.step_up {
            StepUp::Automatic => "automatic",
            StepUp::Manual => "manual",
        };
        let settings = format!(
            "metric {} · threshold {} % · calm_threshold {} % · mem_available_floor {} · sustain {} · cooldown {} · step_up {}",
            s.metric.as_str(),
            num(s.threshold),
            num(s.calm_threshold),
            floor,
            format_duration(s.sustain),
            format_duration(s.cooldown),
            step_up,
        );
        area.draw(&Text::new(settings, (14, 42), font(17, &INK)))?;
        let span = self.duration();
        let samples = if self.thinned {
            format!(
                "{} samples over {}; drawn as the low and high of each of {BUCKETS} slices of time \
                 (downsampled for drawing only: the steps are decided on every sample)",
                self.samples,
                clock(span, span)
            )
        } else {
            format!("{} samples over {}", self.samples, clock(span, span))
        };
        area.draw(&Text::new(samples, (14, 64), font(15, &FAINT)))?;
        // The key: the lines, then the lanes.
        let floor_key = s.mem_available_floor.map(|b| format!("mem_available_floor {}", mib(b as f64 / MIB)));
        let mut lines: Vec<(String, RGBColor, bool)> = vec![
            (s.metric.as_str().to_string(), METRIC, false),
            (format!("threshold {} %", num(s.threshold)), OVER, true),
            (format!("calm_threshold {} %", num(s.calm_threshold)), CALM, true),
            ("MemAvailable".to_string(), MEM, false),
        ];
        lines.extend(floor_key.map(|k| (k, FLOOR, true)));
        let mut x = 14;
        for (label, color, dashed) in lines {
            let style = color.stroke_width(3);
            if dashed {
                area.draw(&PathElement::new([(x, 93), (x + 9, 93)], style))?;
                area.draw(&PathElement::new([(x + 15, 93), (x + 24, 93)], style))?;
            } else {
                area.draw(&PathElement::new([(x, 93), (x + 24, 93)], style))?;
            }
            area.draw(&Text::new(label.clone(), (x + 30, 85), font(16, &INK)))?;
            x += 30 + text_width(&label, 16) + 22;
        }
        let mut x = 14;
        let key: [(&str, RGBColor, f64); 7] = [
            ("reading over", OVER, 1.0),
            ("calm", CALM, 1.0),
            ("neither", NEITHER, 1.0),
            ("streak within sustain", OVER, 0.3),
            ("streak sustained", OVER, 1.0),
            ("cooldown", COOLDOWN, 0.55),
            ("step down / up", INK, 0.0),
        ];
        for (label, color, alpha) in key {
            if alpha > 0.0 {
                area.draw(&Rectangle::new([(x, 107), (x + 16, 123)], color.mix(alpha).filled()))?;
            } else {
                area.draw(&Circle::new((x + 5, 115), 6, OVER.filled()))?;
                area.draw(&Circle::new((x + 17, 115), 6, CALM.filled()))?;
                x += 8;
            }
            area.draw(&Text::new(label, (x + 22, 108), font(16, &INK)))?;
            x += 22 + text_width(label, 16) + 22;
        }
        Ok(())
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

    fn metric_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let top = self.metric.iter().map(|p| p.1).fold(s.threshold, f64::max);
        let ymax = (top * 1.12).clamp(5.0, 100.0);
        let mut chart = ChartBuilder::on(area)
            .margin_left(6)
            .margin_right(MARGIN_RIGHT)
            .margin_top(8)
            .x_label_area_size(0)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(self.span.0..self.span.1, 0f64..ymax)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_labels(6)
            .y_label_formatter(&|v| format!("{} %", num(*v)))
            .y_desc(format!("{} (PSI)", s.metric.as_str()))
            .label_style(font(15, &INK))
            .axis_desc_style(font(15, &INK))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(FAINT)
            .draw()?;
        self.time_grid(&mut chart, (0.0, ymax))?;
        self.step_lines(&mut chart, (0.0, ymax))?;
        let (a, z) = self.span;
        chart.draw_series(DashedLineSeries::new([(a, s.threshold), (z, s.threshold)], 10, 5, OVER.stroke_width(2)))?;
        chart.draw_series(DashedLineSeries::new(
            [(a, s.calm_threshold), (z, s.calm_threshold)],
            10,
            5,
            CALM.stroke_width(2),
        ))?;
        chart.draw_series(LineSeries::new(self.metric.iter().copied(), METRIC.stroke_width(2)))?;
        Ok(())
    }

    fn lanes_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let mut chart = ChartBuilder::on(area)
            .margin_left(6)
            .margin_right(MARGIN_RIGHT)
            .margin_top(4)
            .margin_bottom(4)
            .x_label_area_size(0)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(self.span.0..self.span.1, 0f64..3.0)?;
        self.time_grid(&mut chart, (0.0, 3.0))?;
        // Each lane is one unit high, with a gap between lanes.
        let lane = |i: f64| (3.0 - i - 0.12, 3.0 - i - 0.88);
        let (r0, r1) = lane(0.0);
        // At least two pixels wide, and over drawn last: a short burst in a long trace
        // stays visible.
        let least = self.duration() / 550.0;
        let wide = |a: f64, z: f64| (a, z.max(a + least));
        for what in [Reading::Calm, Reading::Neither, Reading::Over] {
            let c = match what {
                Reading::Over => OVER,
                Reading::Calm => CALM,
                Reading::Neither => NEITHER,
            };
            chart.draw_series(self.readings.iter().filter(|r| r.what == what).map(|r| {
                let (a, z) = wide(r.start, r.end);
                Rectangle::new([(a, r0), (z, r1)], c.filled())
            }))?;
        }
        let (k0, k1) = lane(1.0);
        let sustain = s.sustain.as_secs_f64();
        for st in &self.streaks {
            let c = match st.what {
                Streak::Over => OVER,
                Streak::Calm => CALM,
            };
            let (start, end) = wide(st.start, st.end);
            let held = (start + sustain).min(end);
            chart.draw_series([
                Rectangle::new([(start, k0), (held, k1)], c.mix(0.3).filled()),
                Rectangle::new([(start, k0), (held, k1)], c.mix(0.8).stroke_width(1)),
            ])?;
            if end > held {
                chart.draw_series([Rectangle::new([(held, k0), (end, k1)], c.filled())])?;
            }
        }
        let (c0, c1) = lane(2.0);
        let cooldown = s.cooldown.as_secs_f64();
        chart.draw_series(self.steps.iter().map(|(t, _)| {
            Rectangle::new([(*t, c0), (wide(*t, t + cooldown).1.min(self.span.1), c1)], COOLDOWN.mix(0.55).filled())
        }))?;
        // Overlapping cooldowns stay apart by their edges.
        chart.draw_series(self.steps.iter().map(|(t, _)| {
            Rectangle::new([(*t, c0), (wide(*t, t + cooldown).1.min(self.span.1), c1)], COOLDOWN.stroke_width(1))
        }))?;
        self.step_lines(&mut chart, (0.0, 3.0))?;
        // The lanes' names, in the value axis's place.
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        let h = (ys.end - ys.start) as f64 / 3.0;
        let base = area.get_base_pixel();
        let names = ["reading".to_string(), format!("streak ({})", format_duration(s.sustain)), "cooldown".to_string()];
        for (i, name) in names.iter().enumerate() {
            let y = ys.start + (h * (i as f64 + 0.5)) as i32 - base.1;
            let style = font(15, &INK).pos(Pos::new(HPos::Right, VPos::Center));
            area.draw(&Text::new(name.as_str(), (xs.start - base.0 - 8, y), style))?;
        }
        Ok(())
    }

    fn mem_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let floor = s.mem_available_floor.map(|b| b as f64 / MIB);
        let top = self.mem.iter().map(|p| p.1).fold(floor.unwrap_or(0.0), f64::max);
        let ymax = (top * 1.1).max(1.0);
        let mut chart = ChartBuilder::on(area)
            .margin_left(6)
            .margin_right(MARGIN_RIGHT)
            .margin_top(6)
            .x_label_area_size(0)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(self.span.0..self.span.1, 0f64..ymax)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_labels(4)
            .y_label_formatter(&|v| {
                if ymax >= 10240.0 {
                    format!("{:.0} GiB", v / 1024.0)
                } else {
                    format!("{v:.0} MiB")
                }
            })
            .y_desc("MemAvailable")
            .label_style(font(15, &INK))
            .axis_desc_style(font(15, &INK))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(FAINT)
            .draw()?;
        self.time_grid(&mut chart, (0.0, ymax))?;
        self.step_lines(&mut chart, (0.0, ymax))?;
        if let Some(f) = floor {
            let (a, z) = self.span;
            chart.draw_series(DashedLineSeries::new([(a, f), (z, f)], 10, 5, FLOOR.stroke_width(2)))?;
        }
        chart.draw_series(LineSeries::new(self.mem.iter().copied(), MEM.stroke_width(2)))?;
        Ok(())
    }

    fn level_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        // full at 2, etcd-only at 0; above them the rows of step labels.
        let y = |l: Level| 2.0 - l.index_in(&Level::ALL).unwrap_or(0) as f64;
        const ROWS: usize = 3;
        const ROW: f64 = 0.62;
        let ymax = 2.45 + ROWS as f64 * ROW;
        let span = self.duration();
        let mut chart = ChartBuilder::on(area)
            .margin_left(6)
            .margin_right(MARGIN_RIGHT)
            .margin_top(2)
            .margin_bottom(6)
            .x_label_area_size(46)
            .y_label_area_size(LEFT)
            .build_cartesian_2d(self.span.0..self.span.1, -0.35f64..ymax)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_labels(0)
            .label_style(font(15, &INK))
            .axis_desc_style(font(15, &INK))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(FAINT)
            .draw()?;
        self.time_grid(&mut chart, (-0.35, ymax))?;
        for l in Level::ALL {
            let v = y(l);
            chart.draw_series(LineSeries::new([(self.span.0, v), (self.span.1, v)], GRID.stroke_width(1)))?;
        }
        // The level as a step line.
        let mut level = self.start;
        let mut pts = vec![(self.span.0, y(level))];
        for (t, l) in &self.steps {
            pts.push((*t, y(l.from)));
            pts.push((*t, y(l.to)));
            level = l.to;
        }
        pts.push((self.span.1, y(level)));
        chart.draw_series(LineSeries::new(pts, INK.stroke_width(3)))?;
        // Each step: a dot where it lands, its label in the first row where it does
        // not run into the label before it.
        let (xs, _) = chart.plotting_area().get_pixel_range();
        let to_px = |t: f64| xs.start as f64 + (t - self.span.0) / span * (xs.end - xs.start) as f64;
        let label_of = |b: &[(f64, &StepLine)]| match b {
            [(_, one)] => step_label(one, span),
            _ => burst_label(b[0].1, b[b.len() - 1].1, b.len(), span),
        };
        let mut row_end = [f64::NEG_INFINITY; ROWS];
        // Steps within a few pixels of each other cannot be named apart at this scale:
        // they share one label, a burst.
        let mut bursts: Vec<Vec<(f64, &StepLine)>> = vec![];
        for (t, l) in &self.steps {
            match bursts.last_mut() {
                Some(b) if to_px(*t) - to_px(b[0].0) < 14.0 => b.push((*t, *l)),
                _ => bursts.push(vec![(*t, *l)]),
            }
        }
        let mut placed: Vec<Placed> = vec![];
        for (i, burst) in bursts.into_iter().enumerate() {
            let x = to_px(burst[0].0);
            let [what, when] = label_of(&burst);
            let width = text_width(&what, 15).max(text_width(&when, 14)) as f64 + 8.0;
            // Labels near the right edge are anchored by their right end.
            let (from, to) = if x + width > xs.end as f64 { (x - width, x) } else { (x, x + width) };
            let row = (0..ROWS).find(|&r| row_end[r] + 6.0 <= from).unwrap_or(i % ROWS);
            row_end[row] = to;
            placed.push((row, burst, x + width > xs.end as f64));
        }
        for (t, l) in &self.steps {
            let c = if l.action == "step-down" { OVER } else { CALM };
            chart.draw_series([Circle::new((*t, y(l.to)), 6, c.filled())])?;
        }
        for (row, group, right) in placed {
            let (t, first) = group[0];
            let c = match group.len() {
                1 if first.action == "step-down" => OVER,
                1 => CALM,
                _ => INK,
            };
            let label_y = 2.45 + (ROWS - 1 - row) as f64 * ROW + ROW * 0.92;
            chart.draw_series(DashedLineSeries::new(
                [(t, y(first.to).max(y(first.from))), (t, label_y)],
                3,
                3,
                c.mix(0.8).stroke_width(1),
            ))?;
            let (h, dx) = if right { (HPos::Right, -4) } else { (HPos::Left, 4) };
            let [what, when] = label_of(&group);
            let pos = Pos::new(h, VPos::Top);
            chart.draw_series([
                EmptyElement::at((t, label_y)) + Text::new(what, (dx, 0), bold(15, &c).pos(pos)),
                EmptyElement::at((t, label_y)) + Text::new(when, (dx, 17), font(14, &INK).pos(pos)),
            ])?;
        }
        // The levels' names, in the value axis's place.
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        let base = area.get_base_pixel();
        let range = ymax + 0.35;
        for l in Level::ALL {
            let py = ys.start + ((ymax - y(l)) / range * (ys.end - ys.start) as f64) as i32 - base.1;
            let style = font(15, &INK).pos(Pos::new(HPos::Right, VPos::Center));
            area.draw(&Text::new(l.as_str(), (xs.start - base.0 - 8, py), style))?;
        }
        // The time axis's labels, on the same ticks as every panel's grid.
        for t in time_ticks(self.span.0, self.span.1) {
            let px = to_px(t) as i32 - base.0;
            let style = font(15, &INK).pos(Pos::new(HPos::Center, VPos::Top));
            area.draw(&Text::new(clock(t, span), (px, ys.end - base.1 + 8), style))?;
        }
        let desc = format!("time ({} from the trace's t = 0)", clock_unit(span, self.span.1));
        let mid = (xs.start + xs.end) / 2 - base.0;
        area.draw(&Text::new(
            desc,
            (mid, ys.end - base.1 + 28),
            font(15, &INK).pos(Pos::new(HPos::Center, VPos::Top)),
        ))?;
        let py = ys.start - base.1 + 4;
        area.draw(&Text::new(
            "steps",
            (xs.start - base.0 - 8, py),
            font(15, &FAINT).pos(Pos::new(HPos::Right, VPos::Top)),
        ))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_read_as_people_read_them() {
        assert_eq!(clock(83.4, 300.0), "01:23");
        assert_eq!(clock(3723.0, 7200.0), "1:02:03");
        assert_eq!(clock(2.0 * 86400.0 + 3660.0, 7.0 * 86400.0), "2d 01:01");
    }

    #[test]
    fn thinning_keeps_each_slices_peak() {
        let t: Vec<f64> = (0..100_000).map(f64::from).collect();
        let mut v = vec![1.0; t.len()];
        v[54_321] = 99.0;
        let got = min_max(&t, &v, 0.0, 100_000.0 / BUCKETS as f64);
        assert!(got.len() <= 2 * (BUCKETS + 1), "{}", got.len());
        assert!(got.contains(&(54_321.0, 99.0)));
        assert!(got.windows(2).all(|w| w[0].0 <= w[1].0), "in time order");
    }

    #[test]
    fn coarse_readings_never_hide_an_over() {
        let runs: Vec<Span<Reading>> = (0..10_000)
            .map(|i| {
                let what = if i == 5000 { Reading::Over } else { Reading::Calm };
                Span { start: i as f64, end: (i + 1) as f64, what }
            })
            .collect();
        let got = worst_per_bucket(&runs, 0.0, 10_000.0 / BUCKETS as f64);
        let over: Vec<_> = got.iter().filter(|s| s.what == Reading::Over).collect();
        assert_eq!(over.len(), 1, "{got:?}");
        assert!(over[0].start <= 5000.0 && over[0].end >= 5001.0, "{over:?}");
    }
}
