//! The levels a server can run at (docs/behaviour.md, "Levels"), ordered from most to
//! least function. A value module: no I/O, no other regrade module.

use std::fmt;
use std::str::FromStr;

/// A level of function. `Ord` follows the table in docs/behaviour.md ("Levels"): `Full`
/// is the highest (`Full > ControlPlane > EtcdOnly`), so "stepping down" moves towards
/// `EtcdOnly`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Level {
    Full,
    ControlPlane,
    EtcdOnly,
}

impl Level {
    /// Highest first.
    pub const ALL: [Level; 3] = [Level::Full, Level::ControlPlane, Level::EtcdOnly];

    pub fn as_str(self) -> &'static str {
        match self {
            Level::Full => "full",
            Level::ControlPlane => "control-plane",
            Level::EtcdOnly => "etcd-only",
        }
    }

    /// Position in `levels`, an actuator's ordered list (highest first).
    pub fn index_in(self, levels: &[Level]) -> Option<usize> {
        levels.iter().position(|l| *l == self)
    }

    /// The next lower level in `levels`, if any.
    pub fn below(self, levels: &[Level]) -> Option<Level> {
        self.index_in(levels).and_then(|i| levels.get(i + 1).copied())
    }

    /// The next higher level in `levels`, if any.
    pub fn above(self, levels: &[Level]) -> Option<Level> {
        match self.index_in(levels) {
            Some(i) if i > 0 => Some(levels[i - 1]),
            _ => None,
        }
    }
}

impl Level {
    /// How much of k3s runs: more is higher.
    fn function(self) -> u8 {
        match self {
            Level::Full => 2,
            Level::ControlPlane => 1,
            Level::EtcdOnly => 0,
        }
    }
}

impl Ord for Level {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.function().cmp(&other.function())
    }
}

impl PartialOrd for Level {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Level::ALL
            .into_iter()
            .find(|l| l.as_str() == s)
            .ok_or_else(|| format!("unknown level {s:?} (expected full, control-plane or etcd-only)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for l in Level::ALL {
            assert_eq!(l.as_str().parse::<Level>().unwrap(), l);
        }
        assert!("etcd".parse::<Level>().is_err());
    }

    #[test]
    fn ord_follows_the_table_full_highest() {
        assert!(Level::Full > Level::ControlPlane && Level::ControlPlane > Level::EtcdOnly);
        let mut sorted = Level::ALL;
        sorted.sort_by(|a, b| b.cmp(a));
        assert_eq!(sorted, Level::ALL, "ALL is highest first");
    }

    #[test]
    fn neighbours_follow_the_actuator_list() {
        let all = &Level::ALL[..];
        assert_eq!(Level::Full.below(all), Some(Level::ControlPlane));
        assert_eq!(Level::EtcdOnly.below(all), None);
        assert_eq!(Level::Full.above(all), None);
        assert_eq!(Level::EtcdOnly.above(all), Some(Level::ControlPlane));
        let two = &[Level::Full, Level::EtcdOnly][..];
        assert_eq!(Level::Full.below(two), Some(Level::EtcdOnly));
        assert_eq!(Level::ControlPlane.below(two), None);
    }
}
