//! `regrade entrypoint -- k3s server ARGS...`: the k3s container's entrypoint
//! (docs/behaviour.md, "Actuators"). In every build, since the container runs it whether or not this build
//! has the Docker actuator.
//!
//! At every start of the container it reads the level file (on the k3s data volume,
//! written by the Docker actuator), records the level it starts k3s at on the
//! container's tmpfs (where the actuator reads it back: k3s hides its arguments), and
//! `exec`s k3s with ARGS plus the level's flags (`[levels.<level>.k3s]` of regrade's
//! configuration, as `--flag` arguments). So a level survives `docker restart`, a
//! dockerd restart and a host reboot.
//!
//! The level recorded is the one k3s's flags say, read as k3s reads them inside the
//! container ([`crate::k3s_config`]: `K3S_CONFIG_FILE`, `--config`, the default config
//! file and its drop-ins, then ARGS, then the level's flags, which come last and so beat
//! every file and argument before them): a config file of the container's own that
//! runs another level's flags is said, and recorded as what k3s runs.
//!
//! k3s must always start: a missing, unreadable or corrupt level file, a broken
//! configuration or a record that cannot be written all start k3s at `full` (its
//! own arguments only), with a message on stderr (the container's log).
//!
//! Paths inside the k3s container, from its environment:
//! - `REGRADE_LEVEL_FILE` (default [`DEFAULT_LEVEL_FILE`]): the level file.
//! - `REGRADE_STARTED_LEVEL_FILE` (default [`DEFAULT_STARTED_LEVEL_FILE`]): the record;
//!   its directory should be a tmpfs (`--tmpfs /run`), so a record never outlives the
//!   container's run.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use crate::fsutil;
use crate::level::Level;
use crate::levels::{FlagValue, LevelsConfig};

pub const LEVEL_FILE_ENV: &str = "REGRADE_LEVEL_FILE";
pub const STARTED_LEVEL_FILE_ENV: &str = "REGRADE_STARTED_LEVEL_FILE";
/// On k3s's data volume (`/var/lib/rancher/k3s`), so it lives as long as the server.
pub const DEFAULT_LEVEL_FILE: &str = "/var/lib/rancher/k3s/regrade-level";
/// On the container's tmpfs.
pub const DEFAULT_STARTED_LEVEL_FILE: &str = "/run/regrade/started-level";

/// `levels`: the `[levels]` of regrade's configuration as `Config::load_levels` read
/// it; an error starts k3s at `full`.
pub fn run(levels: anyhow::Result<LevelsConfig>, command: &[OsString]) -> anyhow::Result<ExitCode> {
    let Some((program, args)) = command.split_first() else {
        anyhow::bail!("entrypoint: no k3s command given (usage: regrade entrypoint -- k3s server ARGS...)");
    };
    let level_file = env_path(LEVEL_FILE_ENV, DEFAULT_LEVEL_FILE);
    let record = env_path(STARTED_LEVEL_FILE_ENV, DEFAULT_STARTED_LEVEL_FILE);

    let (mut level, levels) = match levels {
        Ok(levels) => (level_to_start(&level_file), levels),
        Err(e) => {
            say(&format!("{e:#}; starting k3s at full"));
            (Level::Full, LevelsConfig::default())
        }
    };
    let mut flags = flag_args(&levels.k3s_flags(level));
    let started = started_at(&levels, level, command, &flags, std::env::vars().collect());
    if let Err(e) = fsutil::write_atomic(&record, format!("{started}\n").as_bytes(), 0o644, "start-record") {
        // No record must mean `full` (what the actuator reads), so start at `full`.
        say(&format!("recording the started level in {}: {e:#}; starting k3s at full", record.display()));
        let _ = std::fs::remove_file(&record);
        level = Level::Full;
        flags = flag_args(&levels.k3s_flags(level));
    }
    say(&format!("starting k3s at level {level}{}", describe(&flags)));
    let err = std::process::Command::new(program).args(args).args(&flags).exec();
    Err(err).with_context(|| format!("entrypoint: exec {}", program.to_string_lossy()))
}

/// The level whose flags k3s runs with when started as `command` with `level`'s
/// `flags` after it, its configuration read as k3s reads it in the container: `level`
/// unless the container's own config files run another level's flags (said on stderr,
/// with the file and key when no level's flags hold). An unreadable configuration is
/// said and `level` kept: k3s itself will say more.
fn started_at(
    levels: &LevelsConfig,
    level: Level,
    command: &[OsString],
    flags: &[String],
    env: Vec<(String, String)>,
) -> Level {
    let argv = command.iter().map(|a| a.to_string_lossy().into_owned()).chain(flags.iter().cloned()).collect();
    let inv = crate::k3s_config::Invocation { argv: Some(argv), env };
    let eff = match crate::k3s_config::read(&crate::k3s_config::Distribution::k3s(), &inv, None) {
        Ok(eff) => eff,
        Err(e) => {
            say(&format!("reading k3s's configuration: {e:#}; recording level {level}"));
            return level;
        }
    };
    let (started, overridden) = crate::k3s_config::levels::started_level(levels, &eff, None, Some(level));
    if !overridden.is_empty() {
        let why: Vec<String> = overridden.iter().map(|o| o.to_string()).collect();
        say(&format!("k3s runs the flags of no level: {}; recording the nearest, {started}", why.join("; ")));
    } else if started != level {
        say(&format!("k3s's own configuration runs the flags of level {started}, not {level}: recording {started}"));
    }
    started
}

fn env_path(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from).unwrap_or_else(|| default.into())
}

fn say(msg: &str) {
    eprintln!("regrade entrypoint: {msg}");
}

fn describe(flags: &[String]) -> String {
    if flags.is_empty() {
        String::new()
    } else {
        format!(", adding {}", flags.join(" "))
    }
}

/// The level the file asks for; `full` when it is absent, and `full` with a message
/// when it cannot be read or makes no sense.
fn level_to_start(path: &Path) -> Level {
    match read_level_file(path) {
        Ok(Some(level)) => level,
        Ok(None) => {
            say(&format!("no level file {}: full", path.display()));
            Level::Full
        }
        Err(e) => {
            say(&format!("{e:#}; starting k3s at full"));
            Level::Full
        }
    }
}

/// The level file: one line, a level's name. `None` when there is no file.
pub fn read_level_file(path: &Path) -> anyhow::Result<Option<Level>> {
    let bytes = fsutil::read_if_exists(path).with_context(|| format!("reading level file {}", path.display()))?;
    bytes.map(|b| parse_level(&b).with_context(|| format!("level file {}", path.display()))).transpose()
}

pub fn parse_level(bytes: &[u8]) -> anyhow::Result<Level> {
    let text = std::str::from_utf8(bytes).map_err(|_| anyhow::anyhow!("is not text"))?;
    text.trim().parse::<Level>().map_err(|e| anyhow::anyhow!("{e}"))
}

/// A level's flags as k3s command-line arguments: `--name` for `true`, `--name=value`
/// otherwise, a list as the flag repeated (k3s's list flags accumulate).
pub fn flag_args(flags: &BTreeMap<String, FlagValue>) -> Vec<String> {
    let mut out = Vec::new();
    for (name, value) in flags {
        match value {
            FlagValue::Bool(true) => out.push(format!("--{name}")),
            FlagValue::Bool(false) => out.push(format!("--{name}=false")),
            FlagValue::Int(n) => out.push(format!("--{name}={n}")),
            FlagValue::Str(s) => out.push(format!("--{name}={s}")),
            FlagValue::List(items) => out.extend(items.iter().map(|i| format!("--{name}={i}"))),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_become_arguments() {
        let levels = LevelsConfig::default();
        assert_eq!(
            flag_args(&levels.k3s_flags(Level::EtcdOnly)),
            ["--disable-apiserver", "--disable-controller-manager", "--disable-scheduler"]
        );
        assert!(flag_args(&levels.k3s_flags(Level::Full)).is_empty());
        let custom: BTreeMap<String, FlagValue> = [
            ("disable-agent".to_string(), FlagValue::Bool(false)),
            ("etcd-arg".to_string(), FlagValue::List(vec!["a=1".into(), "b=2".into()])),
            ("https-listen-port".to_string(), FlagValue::Int(7443)),
            ("node-name".to_string(), FlagValue::Str("s1".into())),
        ]
        .into();
        assert_eq!(
            flag_args(&custom),
            ["--disable-agent=false", "--etcd-arg=a=1", "--etcd-arg=b=2", "--https-listen-port=7443", "--node-name=s1"]
        );
    }

    /// The level recorded is the one k3s's flags say: the container's config file
    /// (K3S_CONFIG_FILE) can run etcd-only's flags at `full`; arguments before the
    /// level's flags cannot undo them.
    #[test]
    fn the_level_recorded_is_the_one_k3s_flags_say() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.yaml");
        let env = vec![("K3S_CONFIG_FILE".to_string(), config.display().to_string())];
        let levels = LevelsConfig::default();
        let k3s: Vec<OsString> = ["k3s", "server", "--disable-apiserver=false"].iter().map(OsString::from).collect();
        let etcd_only = flag_args(&levels.k3s_flags(Level::EtcdOnly));
        assert_eq!(started_at(&levels, Level::EtcdOnly, &k3s, &etcd_only, env.clone()), Level::EtcdOnly);
        assert_eq!(started_at(&levels, Level::Full, &k3s[..2], &[], env.clone()), Level::Full);
        std::fs::write(&config, "disable-apiserver: true\ndisable-controller-manager: true\ndisable-scheduler: true\n")
            .unwrap();
        assert_eq!(started_at(&levels, Level::Full, &k3s[..2], &[], env.clone()), Level::EtcdOnly);
        std::fs::write(&config, "kubelet-arg: [\n").unwrap();
        assert_eq!(started_at(&levels, Level::ControlPlane, &k3s[..2], &[], env), Level::ControlPlane, "unreadable");
    }

    #[test]
    fn the_level_file_is_one_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("level");
        assert_eq!(read_level_file(&p).unwrap(), None);
        fsutil::write_atomic(&p, b"etcd-only\n", 0o644, "test").unwrap();
        assert_eq!(read_level_file(&p).unwrap(), Some(Level::EtcdOnly));
        std::fs::write(&p, b"etcd-onl\xff").unwrap();
        let e = format!("{:#}", read_level_file(&p).unwrap_err());
        assert!(e.contains(&p.display().to_string()), "{e}");
        std::fs::write(&p, b"half").unwrap();
        let e = format!("{:#}", read_level_file(&p).unwrap_err());
        assert!(e.contains("half") && e.contains(&p.display().to_string()), "{e}");
        assert_eq!(level_to_start(&p), Level::Full);
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
