//! The title with its key, and the panels above the level: the metric against its
//! thresholds, the lanes (reading, streak, cooldown), MemAvailable against its floor.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::text::{bold, clock, font, mib, num, text_width};
use super::*;
use crate::decide::{Reading, StepUp};
use crate::units::format_duration;

impl Picture<'_> {
    pub(super) fn title(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
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

    pub(super) fn metric_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let top = self.metric.iter().map(|p| p.1).fold(s.threshold, f64::max);
        let ymax = (top * 1.12).clamp(5.0, 100.0);
        let mut chart = self.chart(area, 0f64..ymax, (8, 0), 0)?;
        mesh(&mut chart)
            .y_labels(6)
            .y_label_formatter(&|v| format!("{} %", num(*v)))
            .y_desc(format!("{} (PSI)", s.metric.as_str()))
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

    pub(super) fn lanes_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let mut chart = self.chart(area, 0f64..3.0, (4, 4), 0)?;
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

    pub(super) fn mem_panel(&self, area: &DrawingArea<SVGBackend, Shift>) -> Res {
        let s = self.settings;
        let floor = s.mem_available_floor.map(|b| b as f64 / MIB);
        let top = self.mem.iter().map(|p| p.1).fold(floor.unwrap_or(0.0), f64::max);
        let ymax = (top * 1.1).max(1.0);
        let mut chart = self.chart(area, 0f64..ymax, (6, 0), 0)?;
        mesh(&mut chart)
            .y_labels(4)
            .y_label_formatter(&|v| {
                if ymax >= 10240.0 {
                    format!("{:.0} GiB", v / 1024.0)
                } else {
                    format!("{v:.0} MiB")
                }
            })
            .y_desc("MemAvailable")
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
}
