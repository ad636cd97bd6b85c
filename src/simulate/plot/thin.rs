//! Thinning for drawing: a long trace drawn as the low and high of each slice of time,
//! runs of readings and streaks coarsened so that pressure is never hidden.

use super::{Span, Streak, BUCKETS};
use crate::decide::Reading;

pub(super) fn zip(t: &[f64], v: &[f64]) -> Vec<(f64, f64)> {
    t.iter().copied().zip(v.iter().copied()).collect()
}

/// Each bucket's lowest and highest value, in the order they came: a peak of one
/// sample survives the thinning.
pub(super) fn min_max(t: &[f64], v: &[f64], t0: f64, bucket: f64) -> Vec<(f64, f64)> {
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
pub(super) fn worst_per_bucket(runs: &[Span<Reading>], t0: f64, bucket: f64) -> Vec<Span<Reading>> {
    worst_per_bucket_by(runs, t0, bucket, |r| match r {
        Reading::Calm => 1,
        Reading::Neither => 2,
        Reading::Over => 3,
    })
}

/// Runs coarsened to buckets, each bucket taking the run of highest `rank` in it.
pub(super) fn worst_per_bucket_by<T: Copy + PartialEq>(
    runs: &[Span<T>],
    t0: f64,
    bucket: f64,
    rank: impl Fn(T) -> u8,
) -> Vec<Span<T>> {
    let mut worst: Vec<Option<T>> = vec![None; BUCKETS + 1];
    for r in runs {
        let a = (((r.start - t0) / bucket) as usize).min(BUCKETS);
        // A run ends where the next begins: the bucket of its end belongs to the next.
        let z = ((((r.end - t0) / bucket) as usize).max(a + 1) - 1).min(BUCKETS);
        for w in &mut worst[a..=z.max(a)] {
            if w.is_none_or(|w| rank(w) < rank(r.what)) {
                *w = Some(r.what);
            }
        }
    }
    let mut out: Vec<Span<T>> = vec![];
    for (i, w) in worst.iter().enumerate() {
        let Some(what) = *w else { continue };
        let (start, end) = (t0 + i as f64 * bucket, t0 + (i + 1) as f64 * bucket);
        match out.last_mut() {
            Some(s) if s.what == what && s.end >= start => s.end = end,
            _ => out.push(Span { start, end, what }),
        }
    }
    out
}

/// Each bucket's highest known value, at its time, or a gap (`None`) where the bucket
/// has none: a latency's peak survives the thinning, a stretch without answers too.
pub(super) fn peaks(points: &[(f64, Option<f64>)], t0: f64, bucket: f64) -> Vec<(f64, Option<f64>)> {
    let mut out: Vec<(f64, Option<f64>)> = Vec::with_capacity(BUCKETS + 2);
    let mut last_bucket = None;
    for &(t, v) in points {
        let b = ((t - t0) / bucket).floor();
        match out.last_mut() {
            Some(p) if last_bucket == Some(b) => {
                if v.is_some_and(|v| p.1.is_none_or(|pv| v > pv)) {
                    *p = (t, v);
                }
            }
            _ => out.push((t, v)),
        }
        last_bucket = Some(b);
    }
    out
}

/// Marks `(t, how many)` summed per bucket, at the first of each.
pub(super) fn sum_per_bucket(marks: &[(f64, u64)], t0: f64, bucket: f64) -> Vec<(f64, u64)> {
    let mut out: Vec<(f64, u64)> = vec![];
    for &(t, n) in marks {
        match out.last_mut() {
            Some(m) if ((m.0 - t0) / bucket).floor() == ((t - t0) / bucket).floor() => m.1 += n,
            _ => out.push((t, n)),
        }
    }
    out
}

/// Streaks of one kind less than `gap` apart drawn as one.
pub(super) fn merge_close(spans: &[Span<Streak>], gap: f64) -> Vec<Span<Streak>> {
    let mut out: Vec<Span<Streak>> = vec![];
    for s in spans {
        match out.last_mut() {
            Some(l) if l.what == s.what && s.start - l.end < gap => l.end = s.end,
            _ => out.push(*s),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn peaks_keep_each_slices_highest_and_the_gaps() {
        let mut points: Vec<(f64, Option<f64>)> = (0..100_000).map(|i| (f64::from(i), Some(1.0))).collect();
        points[54_321].1 = Some(900.0);
        for p in &mut points[70_000..80_000] {
            p.1 = None;
        }
        let got = peaks(&points, 0.0, 100_000.0 / BUCKETS as f64);
        assert!(got.len() <= BUCKETS + 1, "{}", got.len());
        assert!(got.contains(&(54_321.0, Some(900.0))));
        assert!(got.iter().filter(|p| p.1.is_none()).count() >= 100, "a stretch of no answers stays a gap");
        let marks: Vec<(f64, u64)> = (0..10_000).map(|i| (f64::from(i), 1)).collect();
        let summed = sum_per_bucket(&marks, 0.0, 10_000.0 / BUCKETS as f64);
        assert!(summed.len() <= BUCKETS + 1 && summed.iter().map(|m| m.1).sum::<u64>() == 10_000, "{summed:?}");
    }
}
