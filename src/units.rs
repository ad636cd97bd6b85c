//! Human-friendly durations (`"30s"`, `"5m"`) and byte sizes (`"512MiB"`) for the
//! configuration file. Plain integers are accepted too: seconds, and bytes.
//!
//! A value module: it reads nothing and imports nothing of regrade, so every section
//! of the configuration (each owned by the module it configures) can use it.

use std::fmt;
use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serialize};

/// Parses `"250ms"`, `"30s"`, `"5m"`, `"1h"`, or a combination like `"1m30s"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("empty duration".into());
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{s:?} is not a duration like \"30s\", \"5m\" or \"250ms\""));
        }
        let n: u128 = rest[..digits].parse().map_err(|_| format!("{s:?}: number too large"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let per: u128 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" | "min" => 60_000,
            "h" => 3_600_000,
            "" => return Err(format!("{s:?} needs a unit (ms, s, m or h)")),
            other => return Err(format!("{s:?}: unknown unit {other:?} (use ms, s, m or h)")),
        };
        total_ms = total_ms
            .checked_add(n.checked_mul(per).ok_or_else(|| format!("{s:?}: too large"))?)
            .ok_or_else(|| format!("{s:?}: too large"))?;
    }
    let ms = u64::try_from(total_ms).map_err(|_| format!("{s:?}: too large"))?;
    Ok(Duration::from_millis(ms))
}

/// Parses `"512MiB"`, `"1.5GiB"`, `"300M"`, `"1048576"` (bytes).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    if num.is_empty() {
        return Err(format!("{s:?} is not a size like \"512MiB\" or \"2GiB\""));
    }
    let n: f64 = num.parse().map_err(|_| format!("{s:?}: bad number"))?;
    let mult: f64 = match unit {
        "" | "B" => 1.0,
        "K" | "KB" | "k" | "kB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "GB" => 1e9,
        "Ki" | "KiB" => 1024.0,
        "Mi" | "MiB" => 1024.0 * 1024.0,
        "Gi" | "GiB" => 1024.0 * 1024.0 * 1024.0,
        "Ti" | "TiB" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, K, M or G)")),
    };
    let bytes = (n * mult).round();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{s:?}: too large"));
    }
    Ok(bytes as u64)
}

/// Formats a duration the way the configuration writes it (`"5m"`, `"90s"`, `"250ms"`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms % 3_600_000 == 0 && ms > 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms % 60_000 == 0 && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// A duration written `"30s"`, `"5m"`, `"250ms"` (or a whole number of seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Written {
            expecting: "a duration such as \"30s\", \"5m\" or \"250ms\"",
            what: "a duration",
            parse: |s| parse_duration(s).map(HumanDuration),
            whole: |n| HumanDuration(Duration::from_secs(n)),
        })
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(self.0))
    }
}

/// A byte size written `"512MiB"`, `"2GiB"` (or a whole number of bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Written {
            expecting: "a size such as \"512MiB\" or \"2GiB\", or a number of bytes",
            what: "a size",
            parse: |s| parse_bytes(s).map(ByteSize),
            whole: ByteSize,
        })
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// Reads a value the configuration writes as a string (`parse`) or a whole number
/// (`whole`: seconds, bytes), refusing a negative number.
struct Written<T> {
    expecting: &'static str,
    /// "a duration", "a size": for the error on a negative number.
    what: &'static str,
    parse: fn(&str) -> Result<T, String>,
    whole: fn(u64) -> T,
}

impl<T> de::Visitor<'_> for Written<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expecting)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
        (self.parse)(s).map_err(E::custom)
    }
    fn visit_i64<E: de::Error>(self, n: i64) -> Result<T, E> {
        u64::try_from(n)
            .map(self.whole)
            .map_err(|_| E::custom(format!("{n} is negative; {} must be 0 or more", self.what)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        for bad in ["", "30", "s", "-5s", "5 parsecs", "1.5s", "5d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("300M").unwrap(), 300_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "MiB", "-1MiB", "12 parsecs", "1e999GiB"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn duration_format_round_trips() {
        for s in ["5m", "90s", "250ms", "2h", "0s"] {
            assert_eq!(format_duration(parse_duration(s).unwrap()), s);
        }
    }
}
