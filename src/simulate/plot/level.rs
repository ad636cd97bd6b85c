//! The level panel: the level as a step line, each step named above it, and the time
//! axis shared by every panel.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::text::{bold, burst_label, clock, clock_unit, font, step_label, text_width, time_ticks};
use super::*;

/// A label's row, the steps it names, and whether it is anchored by its right end.
type Placed<'a> = (usize, Vec<(f64, &'a StepLine)>, bool);

impl Picture<'_> {
    pub(super) fn level_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        // full at 2, etcd-only at 0; above them the rows of step labels.
        let y = |l: Level| 2.0 - l.index_in(&Level::ALL).unwrap_or(0) as f64;
        const ROWS: usize = 3;
        const ROW: f64 = 0.62;
        let ymax = 2.45 + ROWS as f64 * ROW;
        let span = self.duration();
        let mut chart = self.chart(area, -0.35f64..ymax, (2, 6), 46)?;
        mesh(&mut chart).x_labels(0).y_labels(0).draw()?;
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
