//! The etcd member's panel, drawn when the trace has its columns (`record
//! --etcd-member`): when the member was unhealthy or did not answer, as bands; its p99
//! WAL fsync and backend commit against their limits (`etcd.wal_fsync_p99_limit`,
//! `etcd.backend_commit_p99_limit`) on a log scale; and each increment of its
//! heartbeat send failures, slow applies and leader changes, as marks in lanes.

use std::time::Duration;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::text::{font, num, text_width};
use super::thin::{peaks, sum_per_bucket, worst_per_bucket_by};
use super::*;
use crate::simulate::MemberCells;
use crate::units::format_duration;

/// The panel's height, added to the picture's.
pub const MEMBER_HEIGHT: u32 = 240;

const WAL: RGBColor = RGBColor(0, 128, 128);
const COMMIT: RGBColor = RGBColor(190, 120, 0);
const NO_ANSWER: RGBColor = RGBColor(150, 150, 150);
const MARKS: [RGBColor; 3] = [RGBColor(214, 39, 40), RGBColor(140, 86, 75), RGBColor(100, 60, 160)];
/// The counters' lanes, in [`MemberCells`]' order.
const COUNTERS: [&str; 3] = ["heartbeat send failures", "slow applies", "leader changes"];
/// The lowest latency drawn (a log scale has no 0).
const LEAST_MS: f64 = 0.1;

/// What `/health` said at a row, until the next.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Health {
    Healthy,
    Unhealthy,
    NoAnswer,
}

/// The member's columns as the replay saw them, row by row.
#[derive(Default)]
pub(super) struct MemberTrack {
    health: Vec<Span<Health>>,
    wal: Vec<(f64, Option<f64>)>,
    commit: Vec<(f64, Option<f64>)>,
    /// Each counter's last value read, and its increments `(t, by)`.
    last: [Option<u64>; 3],
    marks: [Vec<(f64, u64)>; 3],
}

impl MemberTrack {
    pub(super) fn observe(&mut self, t: f64, c: &MemberCells) {
        let health = match c.healthy {
            Some(true) => Health::Healthy,
            Some(false) => Health::Unhealthy,
            None => Health::NoAnswer,
        };
        match self.health.last_mut() {
            Some(h) if h.what == health => h.end = t,
            last => {
                // As a reading: it holds until the next row.
                if let Some(h) = last {
                    h.end = t;
                }
                self.health.push(Span { start: t, end: t, what: health });
            }
        }
        self.wal.push((t, c.wal_fsync_p99_ms));
        self.commit.push((t, c.backend_commit_p99_ms));
        let now = [c.heartbeat_send_failures, c.slow_applies, c.leader_changes];
        for ((v, last), marks) in now.into_iter().zip(&mut self.last).zip(&mut self.marks) {
            let Some(v) = v else { continue };
            if let Some(before) = *last {
                // A count that went down: the member restarted and counts from zero.
                let by = if v >= before { v - before } else { v };
                if by > 0 {
                    marks.push((t, by));
                }
            }
            *last = Some(v);
        }
    }

    /// What the panel draws; thinned as the rest of the picture when `thinned`.
    pub(super) fn finish(self, t0: f64, bucket: f64, thinned: bool, limits: (Duration, Duration)) -> MemberPicture {
        let thin = |p: Vec<(f64, Option<f64>)>| if thinned { peaks(&p, t0, bucket) } else { p };
        let health = if self.health.len() > MAX_SPANS {
            worst_per_bucket_by(&self.health, t0, bucket, |h| match h {
                Health::Healthy => 1,
                Health::NoAnswer => 2,
                Health::Unhealthy => 3,
            })
        } else {
            self.health
        };
        let totals = self.marks.each_ref().map(|m| m.iter().map(|m| m.1).sum());
        let marks = self.marks.map(|m| if m.len() > MAX_SPANS { sum_per_bucket(&m, t0, bucket) } else { m });
        MemberPicture { health, wal: thin(self.wal), commit: thin(self.commit), marks, totals, limits }
    }
}

pub(super) struct MemberPicture {
    health: Vec<Span<Health>>,
    wal: Vec<(f64, Option<f64>)>,
    commit: Vec<(f64, Option<f64>)>,
    marks: [Vec<(f64, u64)>; 3],
    totals: [u64; 3],
    /// `etcd.wal_fsync_p99_limit`, `etcd.backend_commit_p99_limit`.
    limits: (Duration, Duration),
}

/// A latency on the panel's log scale.
fn log_ms(ms: f64) -> f64 {
    ms.max(LEAST_MS).log10()
}

/// `10^v` ms as a person reads it, on whole decades only.
fn decade(v: f64) -> String {
    if (v - v.round()).abs() > 1e-6 {
        return String::new();
    }
    let ms = 10f64.powi(v.round() as i32);
    if ms >= 1000.0 {
        format!("{} s", num(ms / 1000.0))
    } else {
        format!("{} ms", num(ms))
    }
}

/// Runs of known values: a row without one breaks the line.
fn segments(points: &[(f64, Option<f64>)]) -> Vec<Vec<(f64, f64)>> {
    let mut out: Vec<Vec<(f64, f64)>> = vec![];
    let mut open = false;
    for &(t, v) in points {
        match v {
            Some(v) if open => out.last_mut().into_iter().for_each(|s| s.push((t, log_ms(v)))),
            Some(v) => out.push(vec![(t, log_ms(v))]),
            None => {}
        }
        open = v.is_some();
    }
    out
}

impl Picture<'_> {
    pub(super) fn member_panel(&self, area: &DrawingArea<SVGBackend, Shift>, m: &MemberPicture) -> Res {
        let (key, rest) = area.split_vertically(48);
        let (latency, lanes) = rest.split_vertically(MEMBER_HEIGHT - 48 - 78);
        self.member_key(&key, m)?;
        self.latency_chart(&latency, m)?;
        self.marks_lanes(&lanes, m)
    }

    fn member_key(&self, area: &DrawingArea<SVGBackend, Shift>, m: &MemberPicture) -> Res {
        let (wal, commit) = m.limits;
        let items: [(String, RGBColor, u8); 6] = [
            ("etcd member unhealthy".into(), OVER, 0),
            ("no answer".into(), NO_ANSWER, 0),
            ("WAL fsync p99".into(), WAL, 1),
            ("backend commit p99".into(), COMMIT, 1),
            (format!("wal_fsync_p99_limit {}", format_duration(wal)), WAL, 2),
            (format!("backend_commit_p99_limit {}", format_duration(commit)), COMMIT, 2),
        ];
        let mut x = 14;
        for (label, color, kind) in items {
            match kind {
                0 => area.draw(&Rectangle::new([(x, 12), (x + 24, 26)], band(color).filled()))?,
                1 => area.draw(&PathElement::new([(x, 19), (x + 24, 19)], color.stroke_width(3)))?,
                _ => {
                    area.draw(&PathElement::new([(x, 19), (x + 9, 19)], color.stroke_width(3)))?;
                    area.draw(&PathElement::new([(x + 15, 19), (x + 24, 19)], color.stroke_width(3)))?;
                }
            }
            area.draw(&Text::new(label.clone(), (x + 30, 11), font(15, &INK)))?;
            x += 30 + text_width(&label, 15) + 18;
        }
        let counted: Vec<String> = COUNTERS.iter().zip(m.totals).map(|(name, n)| format!("{name} {n}")).collect();
        let marks = format!("marks: each increment of the member's counters ({} in this trace)", counted.join(", "));
        area.draw(&Text::new(marks, (14, 30), font(14, &FAINT)))?;
        Ok(())
    }

    fn latency_chart(&self, area: &DrawingArea<SVGBackend, Shift>, m: &MemberPicture) -> Res {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let highest =
            m.wal.iter().chain(&m.commit).filter_map(|p| p.1).fold(ms(m.limits.0).max(ms(m.limits.1)), f64::max);
        let (lo, hi) = (log_ms(LEAST_MS), log_ms(highest * 2.0));
        let mut chart = self.chart(area, lo..hi, (4, 0), 0)?;
        mesh(&mut chart).y_labels(8).y_label_formatter(&|v| decade(*v)).y_desc("etcd member p99").draw()?;
        // At least two pixels wide, and solid along the top edge: a short stretch in a
        // long trace stays visible under the lines.
        let least = self.duration() / 550.0;
        let edge = hi - (hi - lo) * 0.06;
        for what in [Health::NoAnswer, Health::Unhealthy] {
            let c = if what == Health::Unhealthy { OVER } else { NO_ANSWER };
            for h in m.health.iter().filter(|h| h.what == what) {
                let end = h.end.max(h.start + least);
                chart.draw_series([
                    Rectangle::new([(h.start, lo), (end, hi)], band(c).filled()),
                    Rectangle::new([(h.start, edge), (end, hi)], c.filled()),
                ])?;
            }
        }
        self.time_grid(&mut chart, (lo, hi))?;
        self.step_lines(&mut chart, (lo, hi))?;
        let (a, z) = self.span;
        for (limit, c) in [(m.limits.0, WAL), (m.limits.1, COMMIT)] {
            let y = log_ms(ms(limit));
            chart.draw_series(DashedLineSeries::new([(a, y), (z, y)], 10, 5, c.stroke_width(2)))?;
        }
        for (points, c) in [(&m.wal, WAL), (&m.commit, COMMIT)] {
            for s in segments(points) {
                if let [one] = s[..] {
                    chart.draw_series([Circle::new(one, 2, c.filled())])?;
                } else {
                    chart.draw_series(LineSeries::new(s, c.stroke_width(2)))?;
                }
            }
        }
        Ok(())
    }

    fn marks_lanes(&self, area: &DrawingArea<SVGBackend, Shift>, m: &MemberPicture) -> Res {
        let mut chart = self.chart(area, 0f64..3.0, (4, 4), 0)?;
        self.time_grid(&mut chart, (0.0, 3.0))?;
        self.step_lines(&mut chart, (0.0, 3.0))?;
        for (i, marks) in m.marks.iter().enumerate() {
            let mid = 3.0 - i as f64 - 0.5;
            chart.draw_series(LineSeries::new([(self.span.0, mid), (self.span.1, mid)], GRID.stroke_width(1)))?;
            chart.draw_series(marks.iter().map(|(t, _)| TriangleMarker::new((*t, mid), 6, MARKS[i].filled())))?;
        }
        // The lanes' names, in the value axis's place.
        let (xs, ys) = chart.plotting_area().get_pixel_range();
        let h = (ys.end - ys.start) as f64 / 3.0;
        let base = area.get_base_pixel();
        for (i, name) in COUNTERS.iter().enumerate() {
            let y = ys.start + (h * (i as f64 + 0.5)) as i32 - base.1;
            let style = font(12, &INK).pos(Pos::new(HPos::Right, VPos::Center));
            area.draw(&Text::new(*name, (xs.start - base.0 - 6, y), style))?;
        }
        Ok(())
    }
}

/// A band's fill: light enough for the lines over it.
fn band(c: RGBColor) -> RGBAColor {
    c.mix(0.22)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(healthy: Option<bool>, wal: Option<f64>, hb: Option<u64>) -> MemberCells {
        MemberCells { healthy, wal_fsync_p99_ms: wal, heartbeat_send_failures: hb, ..Default::default() }
    }

    #[test]
    fn health_runs_and_counter_increments() {
        let mut m = MemberTrack::default();
        m.observe(0.0, &cells(Some(true), None, Some(5)));
        m.observe(1.0, &cells(Some(true), Some(2.0), Some(5)));
        m.observe(2.0, &cells(Some(false), Some(900.0), Some(8)));
        m.observe(3.0, &cells(None, None, None));
        // Restarted: counts from zero.
        m.observe(4.0, &cells(Some(true), Some(1.0), Some(2)));
        let spans: Vec<(f64, f64, Health)> = m.health.iter().map(|s| (s.start, s.end, s.what)).collect();
        assert_eq!(
            spans,
            [
                (0.0, 2.0, Health::Healthy),
                (2.0, 3.0, Health::Unhealthy),
                (3.0, 4.0, Health::NoAnswer),
                (4.0, 4.0, Health::Healthy)
            ]
        );
        assert_eq!(m.marks[0], [(2.0, 3), (4.0, 2)]);
        let p = m.finish(0.0, 1.0, false, (Duration::from_secs(1), Duration::from_secs(1)));
        assert_eq!(p.totals, [5, 0, 0]);
        assert_eq!(segments(&p.wal).len(), 2, "the row without an answer breaks the line");
    }

    #[test]
    fn the_scale_names_whole_decades() {
        assert_eq!(
            (decade(0.0), decade(3.0), decade(-1.0), decade(0.5)),
            ("1 ms".into(), "1 s".into(), "0.1 ms".into(), String::new())
        );
        assert_eq!(log_ms(0.0), log_ms(LEAST_MS));
    }
}
