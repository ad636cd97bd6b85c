//! regrade's levels against k3s's effective configuration: which level's flags k3s
//! runs with, and which of a level's flags it would not. `ours` is the file regrade
//! writes a level's flags to (the systemd actuator's drop-in), where a list flag
//! dropped by a later file's plain key is looked for; `None` where the flags go on the
//! command line (the Docker entrypoint).

use std::fmt;
use std::path::Path;

use super::{go_bool, Effective, Source};
use crate::level::Level;
use crate::levels::{FlagValue, LevelsConfig};

/// One of a level's flags that k3s would not run with.
#[derive(Debug, Clone, PartialEq)]
pub struct Overridden {
    pub key: String,
    /// The level's value, as text.
    pub want: String,
    /// What k3s ends with, and where that comes from; `None`: k3s does not read
    /// regrade's drop-in at all.
    pub got: Option<(String, Source)>,
}

impl fmt::Display for Overridden {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.got {
            Some((value, from)) => {
                let (key, want) = (&self.key, &self.want);
                write!(
                    f,
                    "{from} sets {key} = {value:?} after regrade's flags, so k3s would run with it rather than \
                     regrade's {key} = {want}: "
                )?;
                // A list (regrade's value written as one) is dropped by a plain key, kept by `key+:`.
                if want.starts_with('[') {
                    write!(f, "write it as `{key}+:` there")
                } else {
                    write!(f, "remove {key} there")
                }
            }
            None => write!(f, "{} = {} is not passed to k3s", self.key, self.want),
        }
    }
}

/// Every flag name regrade's levels set, each with whether it is a boolean.
fn our_keys(levels: &LevelsConfig) -> Vec<(String, bool)> {
    let mut keys: Vec<(String, bool)> = Level::ALL
        .iter()
        .flat_map(|&l| levels.k3s_flags(l).into_iter().map(|(k, v)| (k, matches!(v, FlagValue::Bool(_)))))
        .collect();
    keys.sort();
    keys.dedup_by(|a, b| a.0 == b.0);
    keys
}

/// The flags of `level` that `eff` does not run with. A boolean flag the level leaves
/// out must be off (regrade never writes `false`); another flag it leaves out is the
/// operator's.
pub fn overridden(levels: &LevelsConfig, level: Level, eff: &Effective, ours: Option<&Path>) -> Vec<Overridden> {
    let flags = levels.k3s_flags(level);
    let mut out = Vec::new();
    for (key, is_bool) in our_keys(levels) {
        let want = flags.get(&key);
        let last = eff.last(&key);
        let got = || last.map(|a| (a.value.clone(), a.from.clone()));
        let holds = match want {
            None if is_bool => go_bool(last) == Some(false),
            None => true,
            Some(FlagValue::Bool(b)) => go_bool(last) == Some(*b),
            Some(FlagValue::Int(i)) => last.is_some_and(|a| a.value == i.to_string()),
            Some(FlagValue::Str(s)) => last.is_some_and(|a| &a.value == s),
            Some(FlagValue::List(items)) => {
                let have: Vec<&str> = eff.all(&key).map(|a| a.value.as_str()).collect();
                if !items.iter().all(|i| have.contains(&i.as_str())) {
                    // Dropped by a later file's plain key, or never read.
                    let by = eff.shadowed.iter().find(|s| s.key == key && Some(s.was_in.as_path()) == ours);
                    out.push(Overridden {
                        key: key.clone(),
                        want: format!("{items:?}"),
                        got: by.map(|s| (format!("{:?}", have), Source::File(s.by.clone()))),
                    });
                }
                continue;
            }
        };
        if !holds {
            let want = match want {
                None => "false (unset)".to_string(),
                Some(FlagValue::Bool(b)) => b.to_string(),
                Some(FlagValue::Int(i)) => i.to_string(),
                Some(FlagValue::Str(s)) => format!("{s:?}"),
                Some(FlagValue::List(_)) => unreachable!("handled above"),
            };
            out.push(Overridden { key, want, got: got() });
        }
    }
    out
}

/// The level k3s runs at, from its flags: `claimed` (the level regrade's file names) when its flags hold, else the first level from `full` down whose flags hold.
/// When none does (another file or the command line overrides some), the level with the
/// fewest flags overridden, `claimed` first among equals, with those flags: a level
/// record can name no other state, and the override is an error to show.
pub fn started_level(
    levels: &LevelsConfig,
    eff: &Effective,
    ours: Option<&Path>,
    claimed: Option<Level>,
) -> (Level, Vec<Overridden>) {
    let candidates = claimed.into_iter().chain(Level::ALL);
    let judged = candidates.map(|l| (l, overridden(levels, l, eff, ours)));
    judged.min_by_key(|(_, wrong)| wrong.len()).expect("Level::ALL is not empty")
}
