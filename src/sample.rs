//! One reading of memory pressure as a plain value: the six PSI averages and
//! MemAvailable, and which average the core decides on ([`Metric`]).
//!
//! A value module: the sampler that fills it from `/proc` is `pressure`; the core
//! (`decide`), `simulate` and `status` use it without touching a file. Also how
//! `watch` paces its samples ([`Pacing`]), as `status` and the metrics name it.

use serde::{Deserialize, Serialize};

/// Which PSI average the core decides on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    SomeAvg10,
    SomeAvg60,
    SomeAvg300,
    FullAvg10,
    FullAvg60,
    FullAvg300,
}

impl Metric {
    /// The six averages in the one order regrade writes them everywhere (the CSV
    /// columns, the JSON fields): `some` then `full`, each avg10, avg60, avg300. The
    /// declaration order above is the same, so `m as usize` is the index in `ALL`.
    pub const ALL: [Metric; 6] = [
        Metric::SomeAvg10,
        Metric::SomeAvg60,
        Metric::SomeAvg300,
        Metric::FullAvg10,
        Metric::FullAvg60,
        Metric::FullAvg300,
    ];
    pub const fn as_str(self) -> &'static str {
        match self {
            Metric::SomeAvg10 => "some_avg10",
            Metric::SomeAvg60 => "some_avg60",
            Metric::SomeAvg300 => "some_avg300",
            Metric::FullAvg10 => "full_avg10",
            Metric::FullAvg60 => "full_avg60",
            Metric::FullAvg300 => "full_avg300",
        }
    }
}

/// The six PSI averages, in percent.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Psi {
    /// avg10, avg60, avg300 of the `some` line.
    pub some: [f64; 3],
    /// avg10, avg60, avg300 of the `full` line.
    pub full: [f64; 3],
}

impl Psi {
    pub fn get(&self, m: Metric) -> f64 {
        let i = m as usize;
        if i < 3 {
            self.some[i]
        } else {
            self.full[i - 3]
        }
    }

    pub fn set(&mut self, m: Metric, v: f64) {
        let i = m as usize;
        if i < 3 {
            self.some[i] = v
        } else {
            self.full[i - 3] = v
        }
    }
}

/// Serialised as an object with the six averages by name, in [`Metric::ALL`]'s order
/// (`status --json`'s `psi`).
impl Serialize for Psi {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(Metric::ALL.len()))?;
        for m in Metric::ALL {
            map.serialize_entry(m.as_str(), &self.get(m))?;
        }
        map.end()
    }
}

/// One reading of both files.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    pub psi: Psi,
    /// MemAvailable, in bytes.
    pub mem_available: u64,
}

impl Sample {
    pub fn metric(&self, m: Metric) -> f64 {
        self.psi.get(m)
    }
}

/// How `watch` waits between samples, as `status` and the journal name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pacing {
    /// Asleep on the trigger: calm at the top level, no streak that could step.
    Trigger,
    /// Sampling every `sample_period`.
    Polling,
}

impl Pacing {
    pub fn as_str(self) -> &'static str {
        match self {
            Pacing::Trigger => "trigger",
            Pacing::Polling => "polling",
        }
    }
}

impl std::fmt::Display for Pacing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_in_declaration_order_some_then_full() {
        for (i, m) in Metric::ALL.into_iter().enumerate() {
            assert_eq!(m as usize, i);
        }
        let mut p = Psi::default();
        for (i, m) in Metric::ALL.into_iter().enumerate() {
            p.set(m, i as f64);
        }
        assert_eq!((p.some, p.full), ([0.0, 1.0, 2.0], [3.0, 4.0, 5.0]));
        assert_eq!(
            serde_json::to_string(&p).unwrap(),
            r#"{"some_avg10":0.0,"some_avg60":1.0,"some_avg300":2.0,"full_avg10":3.0,"full_avg60":4.0,"full_avg300":5.0}"#
        );
    }
}
