//! The host's units in the metrics (`census`): which one is the largest and which
//! grows fastest, named in a `unit` label. Written by `watch`'s looking task only
//! while it is pressed or a scrape asks; one lock, never taken on the sample path.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use super::family;

/// One census, in the metrics' terms: `(unit, bytes)` of the largest, and
/// `(unit, bytes, bytes a second)` of the one growing fastest, if any grows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnitsLook {
    pub largest: Option<(String, u64)>,
    pub growing: Option<(String, u64, f64)>,
}

pub(super) struct UnitsMetrics {
    last: Mutex<Option<UnitsLook>>,
    reads: AtomicU64,
}

impl UnitsMetrics {
    pub(super) const fn new() -> UnitsMetrics {
        UnitsMetrics { last: Mutex::new(None), reads: AtomicU64::new(0) }
    }

    pub(super) fn read(&self, look: UnitsLook) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(look);
        self.reads.fetch_add(1, Relaxed);
    }

    /// The families are always declared; a sample only for what is known (no unit
    /// growing: no `..._growing_...` sample).
    pub(super) fn render(&self, o: &mut String) -> std::fmt::Result {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
        let name = "regrade_unit_largest_memory_bytes";
        family(
            o,
            name,
            "gauge",
            "memory.current of the largest child of census.slice at the last census, named by unit.",
        )?;
        if let Some((unit, bytes)) = &last.largest {
            writeln!(o, "{name}{{unit=\"{}\"}} {bytes}", escape(unit))?;
        }
        let (name, rate) = ("regrade_unit_growing_memory_bytes", "regrade_unit_growing_bytes_per_second");
        family(
            o,
            name,
            "gauge",
            "memory.current of the child of census.slice growing fastest at the last census (none growing: no sample).",
        )?;
        if let Some((unit, bytes, _)) = &last.growing {
            writeln!(o, "{name}{{unit=\"{}\"}} {bytes}", escape(unit))?;
        }
        family(o, rate, "gauge", "How fast that unit's memory.current grew over the census's window.")?;
        if let Some((unit, _, per_second)) = &last.growing {
            writeln!(o, "{rate}{{unit=\"{}\"}} {per_second}", escape(unit))?;
        }
        let name = "regrade_unit_censuses_total";
        family(o, name, "counter", "Readings of census.slice's children (under pressure, or when a scrape asked).")?;
        writeln!(o, "{name} {}", self.reads.load(Relaxed))
    }
}

/// A label value in the text format: systemd escapes unit names with `\x2d` and the
/// like, so backslashes are common.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_and_the_growing_unit_are_named_and_escaped() {
        let m = UnitsMetrics::new();
        let mut t = String::new();
        m.render(&mut t).unwrap();
        assert!(t.contains("# TYPE regrade_unit_growing_memory_bytes gauge") && !t.contains("{unit="), "{t}");
        m.read(UnitsLook {
            largest: Some(("k3s.service".into(), 851_443_712)),
            growing: Some(("backup@dev-disk-by\\x2duuid.service".into(), 1_449_551_462, 16_777_216.0)),
        });
        let mut t = String::new();
        m.render(&mut t).unwrap();
        assert!(t.contains("regrade_unit_largest_memory_bytes{unit=\"k3s.service\"} 851443712\n"), "{t}");
        assert!(
            t.contains(
                "regrade_unit_growing_memory_bytes{unit=\"backup@dev-disk-by\\\\x2duuid.service\"} 1449551462\n"
            ),
            "{t}"
        );
        assert!(
            t.contains(
                "regrade_unit_growing_bytes_per_second{unit=\"backup@dev-disk-by\\\\x2duuid.service\"} 16777216\n"
            ),
            "{t}"
        );
        assert!(t.contains("regrade_unit_censuses_total 1\n"), "{t}");
    }
}
