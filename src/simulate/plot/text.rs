//! What the picture writes: times as a person reads them, the time axis's ticks, the
//! steps' labels, sizes and numbers, and the text styles.

use plotters::prelude::*;

use super::FONT;
use crate::simulate::StepLine;

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
pub(super) fn time_ticks(a: f64, z: f64) -> Vec<f64> {
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
pub(super) fn clock_unit(span: f64, end: f64) -> &'static str {
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

pub(super) fn mib(v: f64) -> String {
    if v >= 10240.0 {
        format!("{:.1} GiB", v / 1024.0)
    } else {
        format!("{v:.0} MiB")
    }
}

/// A number as short as it can be written: `40`, `12.5`.
pub(super) fn num(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

pub(super) fn font(size: u32, color: &RGBColor) -> TextStyle<'static> {
    (FONT, size).into_font().color(color)
}

/// About how wide `text` is in a sans-serif face at `size` (plotters' size).
pub(super) fn text_width(text: &str, size: u32) -> i32 {
    (text.chars().count() as f64 * size as f64 / 1.24 * 0.56) as i32
}

pub(super) fn bold(size: u32, color: &RGBColor) -> TextStyle<'static> {
    (FONT, size, FontStyle::Bold).into_font().color(color)
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
}
