//! regrade's k3s config drop-in: rendering a level's flags as YAML, reading back
//! which level a file on disk stands for, and replacing or removing it atomically.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;

use crate::fsutil;
use crate::level::Level;
use crate::levels::{FlagValue, LevelsConfig};

/// The comment line that names the level a drop-in was written for. k3s ignores
/// comments; `record-start` and the start-up check read it back.
const LEVEL_MARK: &str = "# regrade-level: ";

/// k3s's flags are no secret; an operator reads the file to see what regrade did.
const DROPIN_MODE: u32 = 0o644;

/// What regrade's drop-in path holds.
#[derive(Debug, Clone, PartialEq)]
pub enum Dropin {
    /// No file: k3s runs with its own configuration only (`full`'s flags).
    Absent,
    /// Exactly what regrade writes for this level.
    Level(Level),
    /// Something regrade did not write as it is: edited by hand, or not regrade's.
    /// `claimed` is the level its mark names, if it has one.
    Edited { claimed: Option<Level> },
}

impl Dropin {
    /// The level whose flags k3s will start with, as far as the file says.
    pub fn level(&self) -> Option<Level> {
        match self {
            Dropin::Absent => Some(Level::Full),
            Dropin::Level(l) => Some(*l),
            Dropin::Edited { claimed } => *claimed,
        }
    }
}

/// The file regrade keeps at `level`; `None` when the level has no flags of its own
/// (the file is then absent: regrade never writes `false` to undo a flag).
pub fn render(levels: &LevelsConfig, level: Level) -> Option<String> {
    let flags = levels.k3s_flags(level);
    if flags.is_empty() {
        return None;
    }
    Some(render_flags(level, &flags))
}

fn render_flags(level: Level, flags: &BTreeMap<String, FlagValue>) -> String {
    let mut o = String::new();
    o += "# Written by regrade: the k3s flags of the level this server runs at.\n";
    o += "# regrade replaces or removes this file when it steps; do not edit it by hand.\n";
    o += &format!("{LEVEL_MARK}{level}\n");
    for (name, value) in flags {
        let key = yaml_key(name);
        // A list adds to what k3s read before this file (`name+`): a plain key would
        // replace every earlier value, the operator's and the shipped system-reserved
        // memory in kubelet-arg among them.
        let list_key = || yaml_key(&format!("{}+", name.trim_end_matches('+')));
        match value {
            FlagValue::Bool(b) => o += &format!("{key}: {b}\n"),
            FlagValue::Int(i) => o += &format!("{key}: {i}\n"),
            FlagValue::Str(s) => o += &format!("{key}: {}\n", yaml_str(s)),
            FlagValue::List(items) if items.is_empty() => o += &format!("{}: []\n", list_key()),
            FlagValue::List(items) => {
                o += &format!("{}:\n", list_key());
                for item in items {
                    o += &format!("  - {}\n", yaml_str(item));
                }
            }
        }
    }
    o
}

/// A flag name as a YAML key: bare when it is a plain k3s flag name, quoted otherwise.
fn yaml_key(name: &str) -> String {
    let plain = name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+'))
        && name.starts_with(|c: char| c.is_ascii_alphabetic());
    if plain {
        name.to_string()
    } else {
        yaml_str(name)
    }
}

/// A double-quoted YAML scalar. JSON's string escapes are a subset of YAML's.
fn yaml_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

/// Reads the drop-in at `path` and says which level it stands for.
pub fn read(path: &Path, levels: &LevelsConfig) -> anyhow::Result<Dropin> {
    let Some(text) =
        fsutil::read_string_if_exists(path).with_context(|| format!("reading the k3s drop-in {}", path.display()))?
    else {
        return Ok(Dropin::Absent);
    };
    Ok(classify(&text, levels))
}

/// Which level a drop-in's text stands for: exactly what regrade writes for a level,
/// or edited (naming the level its mark claims, if any).
pub fn classify(text: &str, levels: &LevelsConfig) -> Dropin {
    let claimed = text.lines().find_map(|l| l.strip_prefix(LEVEL_MARK)).and_then(|l| l.trim().parse::<Level>().ok());
    match claimed {
        Some(level) if render(levels, level).as_deref() == Some(text) => Dropin::Level(level),
        _ => Dropin::Edited { claimed },
    }
}

/// The raw bytes at `path` (to put back after a failed step), `None` when absent.
pub fn snapshot(path: &Path) -> anyhow::Result<Option<Vec<u8>>> {
    fsutil::read_if_exists(path).with_context(|| format!("reading the k3s drop-in {}", path.display()))
}

/// Makes `path` hold `content` (or not exist, for `None`), so that k3s sees either
/// the old file or the new one whole, even across a crash (see [`crate::fsutil`]).
pub fn put(path: &Path, content: Option<&[u8]>) -> anyhow::Result<()> {
    match content {
        Some(bytes) => fsutil::write_atomic(path, bytes, DROPIN_MODE, "dropin")
            .with_context(|| format!("writing the k3s drop-in {}", path.display())),
        None => fsutil::remove_durable(path, "dropin")
            .with_context(|| format!("removing the k3s drop-in {}", path.display())),
    }
}

/// Whether k3s reads `name` in `config.yaml.d`: `*.yaml` and `*.yml`, any case.
pub use crate::k3s_config::is_config_name as is_k3s_config_name;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::fs;

    #[test]
    fn k3s_reads_yaml_and_yml_in_any_case() {
        for yes in ["a.yaml", "b.yml", "C.YAML", "d.Yml"] {
            assert!(is_k3s_config_name(yes), "{yes}");
        }
        for no in ["a.yaml~", "b.json", "yaml", "c.yaml.bak"] {
            assert!(!is_k3s_config_name(no), "{no}");
        }
    }

    fn levels(toml: &str) -> LevelsConfig {
        Config::parse(toml).unwrap().levels
    }

    #[test]
    fn etcd_only_renders_its_three_flags_and_full_nothing() {
        let l = levels("");
        let text = render(&l, Level::EtcdOnly).unwrap();
        assert!(text.contains("# regrade-level: etcd-only\n"), "{text}");
        let body: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(body, ["disable-apiserver: true", "disable-controller-manager: true", "disable-scheduler: true"]);
        assert_eq!(render(&l, Level::Full), None);
        assert_eq!(render(&l, Level::ControlPlane), None);
    }

    #[test]
    fn every_value_kind_renders_as_yaml() {
        let l = levels(
            "[levels.etcd-only.k3s]\ndisable-apiserver = true\nkubelet-arg = [\"max-pods=10\", \"a\\\"b\"]\n\
             node-external-ip = \"x: y\"\nhttps-listen-port = 7443\ndisable = []\n",
        );
        let text = render(&l, Level::EtcdOnly).unwrap();
        assert!(text.contains("kubelet-arg+:\n  - \"max-pods=10\"\n  - \"a\\\"b\"\n"), "{text}");
        assert!(text.contains("node-external-ip: \"x: y\"\n"), "{text}");
        assert!(text.contains("https-listen-port: 7443\n"), "{text}");
        assert!(text.contains("disable+: []\n"), "{text}");
    }

    #[test]
    fn reading_back_tells_written_edited_and_absent_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml.d/50-regrade.yaml");
        let l = levels("");
        assert_eq!(read(&path, &l).unwrap(), Dropin::Absent);
        put(&path, render(&l, Level::EtcdOnly).as_deref().map(str::as_bytes)).unwrap();
        assert_eq!(read(&path, &l).unwrap(), Dropin::Level(Level::EtcdOnly));
        let edited = fs::read_to_string(&path).unwrap().replace("disable-scheduler: true\n", "");
        fs::write(&path, edited).unwrap();
        assert_eq!(read(&path, &l).unwrap(), Dropin::Edited { claimed: Some(Level::EtcdOnly) });
        fs::write(&path, "disable-apiserver: true\n").unwrap();
        assert_eq!(read(&path, &l).unwrap(), Dropin::Edited { claimed: None });
        put(&path, None).unwrap();
        assert_eq!(read(&path, &l).unwrap(), Dropin::Absent);
        put(&path, None).unwrap();
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert!(names.is_empty(), "no temporary file is left behind: {names:?}");
    }
}
