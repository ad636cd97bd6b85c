//! k3s's effective configuration, built the way k3s builds it (k3s-io/k3s,
//! `pkg/configfilearg`), so that regrade judges what k3s runs, not what one file says:
//!
//! - the config file: `K3S_CONFIG_FILE` in k3s's environment, else `--config`/`-c` on
//!   its command line, else the default;
//! - then its drop-in directory `<config>.d`: only `*.yaml` and `*.yml` files (any
//!   case), in name order; the config file may be absent while drop-ins exist;
//! - a later file's plain `key:` replaces the value every earlier file gave `key`, a
//!   `key+:` appends to it (the value read so far made a list);
//! - the flags thus built go right after the `server` subcommand, before the unit's
//!   own command-line flags: a command-line flag beats every file (a scalar's last
//!   value wins; a list flag's command-line values come after the files').
//!
//! The kubelet's own merging of what k3s passes it (`kubelet-arg`) is in [`kubelet`].
//!
//! A distribution built on the same package (RKE2) is a [`Distribution`]: another
//! environment variable and default path, the same reading.

pub mod kubelet;
pub mod levels;
pub mod yaml;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use anyhow::Context;

/// Where a distribution that parses its configuration with k3s's `configfilearg`
/// keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    /// The program's name, for messages.
    pub name: &'static str,
    /// The environment variable that names the config file and beats `--config`.
    pub config_env: &'static str,
    /// The config file when neither names one.
    pub default_config: PathBuf,
}

impl Distribution {
    pub fn k3s() -> Distribution {
        Distribution {
            name: "k3s",
            config_env: "K3S_CONFIG_FILE",
            default_config: "/etc/rancher/k3s/config.yaml".into(),
        }
    }

    pub fn rke2() -> Distribution {
        Distribution {
            name: "rke2",
            config_env: "RKE2_CONFIG_FILE",
            default_config: "/etc/rancher/rke2/config.yaml".into(),
        }
    }

    /// The same with another default config file.
    pub fn with_default_config(self, path: impl Into<PathBuf>) -> Distribution {
        Distribution { default_config: path.into(), ..self }
    }
}

/// How the service starts k3s: its command line (`None`: not known, read as
/// `k3s server` with no flags) and its environment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Invocation {
    pub argv: Option<Vec<String>>,
    pub env: Vec<(String, String)>,
}

impl Invocation {
    fn env(&self, name: &str) -> Option<&str> {
        self.env.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
    }
}

/// Where a flag's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    CommandLine,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::File(p) => write!(f, "{}", p.display()),
            Source::CommandLine => f.write_str("k3s's command line"),
        }
    }
}

/// One flag k3s passes itself, as `--key=value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arg {
    pub key: String,
    pub value: String,
    pub from: Source,
}

/// A value a file gave, dropped by a later file's plain `key:`.
#[derive(Debug, Clone, PartialEq)]
pub struct Shadowed {
    pub key: String,
    pub value: String,
    pub was_in: PathBuf,
    pub by: PathBuf,
}

/// k3s's configuration as it will run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Effective {
    /// The config file k3s looks for (it may be absent).
    pub config_file: PathBuf,
    /// The files read, in k3s's order.
    pub files: Vec<PathBuf>,
    /// The server's flags in k3s's order: the files', then the command line's.
    pub args: Vec<Arg>,
    /// Values a later file replaced.
    pub shadowed: Vec<Shadowed>,
}

impl Effective {
    /// Every value of `key`, in order (a list flag gets them all).
    pub fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a Arg> + 'a {
        self.args.iter().filter(move |a| a.key == key)
    }

    /// The value a scalar flag ends with: the last one given.
    pub fn last(&self, key: &str) -> Option<&Arg> {
        self.args.iter().rev().find(|a| a.key == key)
    }

    /// Whether `path` is one of the files k3s reads.
    pub fn reads(&self, path: &Path) -> bool {
        self.files.iter().any(|f| f == path)
    }
}

/// A file read as if it held `content` (`None`: as if absent), to see what k3s would
/// run with once it is written.
#[derive(Debug, Clone, Copy)]
pub struct Overlay<'a> {
    pub path: &'a Path,
    pub content: Option<&'a str>,
}

/// k3s's boolean server flags: on the command line they take no separate value
/// (`--cluster-init server2` is a flag and an argument). Others given with a space take
/// the next argument as their value.
const BOOL_FLAGS: &[&str] = &[
    "cluster-init",
    "cluster-reset",
    "debug",
    "disable-agent",
    "disable-apiserver",
    "disable-cloud-controller",
    "disable-controller-manager",
    "disable-etcd",
    "disable-helm-controller",
    "disable-kube-proxy",
    "disable-network-policy",
    "disable-scheduler",
    "docker",
    "embedded-registry",
    "enable-pprof",
    "etcd-disable-snapshots",
    "etcd-expose-metrics",
    "etcd-s3",
    "etcd-s3-insecure",
    "etcd-s3-skip-ssl-verify",
    "flannel-ipv6-masq",
    "prefer-bundled-bin",
    "protect-kernel-defaults",
    "rootless",
    "secrets-encryption",
    "selinux",
    "supervisor-metrics",
];

/// k3s's effective configuration for `inv`, reading files now.
pub fn read(dist: &Distribution, inv: &Invocation, overlay: Option<Overlay<'_>>) -> anyhow::Result<Effective> {
    let default_argv = vec![dist.name.to_string(), "server".to_string()];
    let argv = inv.argv.as_ref().unwrap_or(&default_argv);
    let config_file = config_file(dist, inv, argv);
    let files = files_read(&config_file, overlay)?;
    let mut eff =
        Effective { config_file, files: files.iter().map(|(p, _)| p.clone()).collect(), ..Default::default() };
    // The files' values, merged per key in the order keys were first seen.
    let mut order: Vec<String> = Vec::new();
    let mut values: HashMap<String, Merged> = HashMap::new();
    for (path, text) in files {
        let entries = yaml::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        for (raw, value) in entries {
            let (key, append) = match raw.strip_suffix('+') {
                Some(k) => (k.to_string(), true),
                None => (raw, false),
            };
            if !values.contains_key(&key) {
                order.push(key.clone());
            }
            let from = || path.clone();
            match values.get_mut(&key) {
                Some(old) if append => {
                    let mut items = old.items();
                    items.extend(value.items().into_iter().map(|v| (v, from())));
                    *old = Merged::List(items);
                }
                old => {
                    if let Some(old) = &old {
                        for (value, was_in) in old.args() {
                            eff.shadowed.push(Shadowed { key: key.clone(), value, was_in, by: path.clone() });
                        }
                    }
                    let new = match value {
                        yaml::Value::List(items) => Merged::List(items.into_iter().map(|v| (v, from())).collect()),
                        scalar => Merged::Scalar(scalar, from()),
                    };
                    values.insert(key.clone(), new);
                }
            }
        }
    }
    for key in order {
        for (value, path) in values[&key].args() {
            eff.args.push(Arg { key: key.clone(), value, from: Source::File(path) });
        }
    }
    eff.args.extend(command_line(argv));
    Ok(eff)
}

/// A key's value while the files are merged, each item with its file.
enum Merged {
    Scalar(yaml::Value, PathBuf),
    List(Vec<(String, PathBuf)>),
}

impl Merged {
    /// What an append extends: k3s's `toSlice` of the value so far.
    fn items(&self) -> Vec<(String, PathBuf)> {
        match self {
            Merged::Scalar(v, p) => v.items().into_iter().map(|i| (i, p.clone())).collect(),
            Merged::List(items) => items.clone(),
        }
    }

    /// The `--key=value` arguments it becomes: one per item of a list.
    fn args(&self) -> Vec<(String, PathBuf)> {
        match self {
            Merged::Scalar(yaml::Value::Str(s) | yaml::Value::Other(s), p) => vec![(s.clone(), p.clone())],
            Merged::Scalar(yaml::Value::List(_), _) => unreachable!("a list is kept as Merged::List"),
            Merged::List(items) => items.clone(),
        }
    }
}

/// The config file k3s reads: its environment variable, then `--config`/`-c` anywhere
/// on the command line, then the default.
fn config_file(dist: &Distribution, inv: &Invocation, argv: &[String]) -> PathBuf {
    if let Some(v) = inv.env(dist.config_env) {
        return v.into();
    }
    for (i, arg) in argv.iter().enumerate() {
        for flag in ["--config", "-c"] {
            if arg == flag {
                return argv.get(i + 1).map_or_else(PathBuf::new, PathBuf::from);
            }
            if let Some(v) = arg.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                return v.into();
            }
        }
    }
    dist.default_config.clone()
}

/// The files k3s reads, with their text: the config file if it exists, then its
/// drop-ins. `overlay` stands in for one of them.
fn files_read(config: &Path, overlay: Option<Overlay<'_>>) -> anyhow::Result<Vec<(PathBuf, String)>> {
    if config.as_os_str().is_empty() {
        return Ok(Vec::new());
    }
    let mut paths = vec![config.to_path_buf()];
    let dir = PathBuf::from(format!("{}.d", config.display()));
    match std::fs::read_dir(&dir) {
        Ok(entries) => {
            let mut names = Vec::new();
            for e in entries {
                let e = e.with_context(|| format!("listing {}", dir.display()))?;
                let name = e.file_name().to_string_lossy().into_owned();
                if is_config_name(&name) && !e.file_type().is_ok_and(|t| t.is_dir()) {
                    names.push(name);
                }
            }
            names.sort();
            paths.extend(names.into_iter().map(|n| dir.join(n)));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    }
    if let Some(o) = overlay {
        if o.path.parent() == Some(&dir) && !paths.iter().any(|p| p == o.path) {
            paths.push(o.path.to_path_buf());
            paths[1..].sort();
        }
    }
    let mut out = Vec::new();
    for path in paths {
        let text = match overlay {
            Some(o) if o.path == path => o.content.map(str::to_string),
            _ => crate::fsutil::read_string_if_exists(&path).with_context(|| format!("reading {}", path.display()))?,
        };
        if let Some(text) = text {
            out.push((path, text));
        }
    }
    Ok(out)
}

/// Whether k3s reads a file of this name in `config.yaml.d`: `*.yaml` and `*.yml`, any case.
pub fn is_config_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.ends_with(".yaml") || lower.ends_with(".yml")
}

/// The server's flags on the command line, after the `server` (or `agent`)
/// subcommand: `--key=value`, `--key value`, or a boolean `--key`.
fn command_line(argv: &[String]) -> Vec<Arg> {
    let Some(start) = argv.iter().position(|a| a == "server" || a == "agent") else { return Vec::new() };
    let mut out = Vec::new();
    let mut rest = argv[start + 1..].iter().peekable();
    while let Some(arg) = rest.next() {
        if arg == "--" {
            break;
        }
        let Some(flag) = arg.strip_prefix("--").or_else(|| arg.strip_prefix('-')).filter(|f| !f.is_empty()) else {
            continue;
        };
        let (key, value) = match flag.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None if !BOOL_FLAGS.contains(&flag) && rest.peek().is_some_and(|n| !n.starts_with('-')) => {
                (flag.to_string(), rest.next().cloned().unwrap_or_default())
            }
            None => (flag.to_string(), "true".to_string()),
        };
        out.push(Arg { key, value, from: Source::CommandLine });
    }
    out
}

/// The variables of a systemd `EnvironmentFile=`: `KEY=VALUE` lines, `#` and `;`
/// comments, a value in matching quotes unquoted.
pub fn environment_file(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else { continue };
        let v = v.trim();
        let unquoted = ['"', '\''].iter().find_map(|&q| v.strip_prefix(q)?.strip_suffix(q)).unwrap_or(v);
        out.push((k.trim().to_string(), unquoted.to_string()));
    }
    out
}

/// Go's `strconv.ParseBool`, with a flag not given as `false`.
pub fn go_bool(arg: Option<&Arg>) -> Option<bool> {
    match arg.map(|a| a.value.as_str()) {
        None => Some(false),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Some(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Some(false),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests;
