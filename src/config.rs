//! The configuration file (SPEC §6): one TOML file, every key checked at start.
//!
//! Unknown keys and wrong types are rejected by serde (`deny_unknown_fields`), which
//! through `toml` names the key, the file's line and column. Impossible values (a
//! negative threshold, `sustain` shorter than `sample_period`) are rejected by
//! [`Config::validate`], which names the key as `section.key`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{de, Deserialize, Deserializer, Serialize};

use crate::level::Level;
use crate::units;

pub const DEFAULT_PATH: &str = "/etc/regrade/regrade.toml";

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
    pub const ALL: [Metric; 6] = [
        Metric::SomeAvg10,
        Metric::SomeAvg60,
        Metric::SomeAvg300,
        Metric::FullAvg10,
        Metric::FullAvg60,
        Metric::FullAvg300,
    ];
    pub fn as_str(self) -> &'static str {
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepUp {
    Automatic,
    Manual,
}

/// A duration written `"30s"`, `"5m"`, `"250ms"` (or a whole number of seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a duration such as \"30s\", \"5m\" or \"250ms\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<HumanDuration, E> {
                units::parse_duration(s).map(HumanDuration).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<HumanDuration, E> {
                u64::try_from(n)
                    .map(|s| HumanDuration(Duration::from_secs(s)))
                    .map_err(|_| E::custom(format!("{n} is negative; a duration must be 0 or more")))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&units::format_duration(self.0))
    }
}

/// A byte size written `"512MiB"`, `"2GiB"` (or a whole number of bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as \"512MiB\" or \"2GiB\", or a number of bytes")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<ByteSize, E> {
                units::parse_bytes(s).map(ByteSize).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("{n} is negative; a size must be 0 or more")))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

/// `mem_available_floor`: a size, or `"none"` to decide on PSI alone (TOML has no null).
fn floor_de<'de, D: Deserializer<'de>>(d: D) -> Result<Option<ByteSize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Floor {
        None(NoneWord),
        Size(ByteSize),
    }
    #[derive(Deserialize)]
    enum NoneWord {
        #[serde(rename = "none")]
        None,
    }
    // Untagged enums hide the inner error, so say what is accepted.
    match Floor::deserialize(d).map_err(|_| {
        de::Error::custom("expected a size such as \"512MiB\" or a number of bytes (0 or more), or \"none\"")
    })? {
        Floor::None(_) => Ok(None),
        Floor::Size(b) => Ok(Some(b)),
    }
}

fn floor_ser<S: serde::Serializer>(v: &Option<ByteSize>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(b) => s.serialize_u64(b.0),
        None => s.serialize_str("none"),
    }
}

/// `[pressure]`: the keys of SPEC §6 (a contract).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PressureConfig {
    pub metric: Metric,
    /// Percent (0–100) of the chosen PSI average at or above which a sample may be "over".
    pub threshold: f64,
    /// Percent below which a sample may be "calm"; defaults to `threshold`.
    pub calm_threshold: Option<f64>,
    /// "Over" also needs MemAvailable below this, "calm" at or above it. `"none"`:
    /// PSI alone decides.
    #[serde(deserialize_with = "floor_de", serialize_with = "floor_ser")]
    pub mem_available_floor: Option<ByteSize>,
    pub sample_period: HumanDuration,
    pub sustain: HumanDuration,
    pub cooldown: HumanDuration,
    /// The PSI file, `/proc/pressure/memory` format.
    pub source: PathBuf,
    /// The meminfo file, `/proc/meminfo` format.
    pub meminfo: PathBuf,
}

impl Default for PressureConfig {
    fn default() -> Self {
        PressureConfig {
            metric: Metric::SomeAvg10,
            threshold: 40.0,
            calm_threshold: None,
            mem_available_floor: Some(ByteSize(512 << 20)),
            sample_period: HumanDuration(Duration::from_secs(5)),
            sustain: HumanDuration(Duration::from_secs(60)),
            cooldown: HumanDuration(Duration::from_secs(300)),
            source: PathBuf::from("/proc/pressure/memory"),
            meminfo: PathBuf::from("/proc/meminfo"),
        }
    }
}

/// What the Node gets while a level is in force (SPEC §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// A k3s flag value as it goes into the k3s config drop-in.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum FlagValue {
    Bool(bool),
    Int(i64),
    Str(String),
    List(Vec<String>),
}

/// `[levels.<name>]` for a level below `full`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LevelConfig {
    /// The taint's effect while at this level (cordon and taint are set from the
    /// first level below `full` on).
    pub taint_effect: TaintEffect,
    /// k3s flags (config.yaml keys) in force at this level. A change of flags between
    /// two levels restarts k3s; equal flags (e.g. `full` and `control-plane`) do not.
    /// Unset: the level's built-in flags (none for `control-plane`; for `etcd-only`
    /// the three `disable-*` flags k3s documents for etcd-only servers).
    pub k3s: Option<BTreeMap<String, FlagValue>>,
    /// Evict the Node's pods on the step down into this level (`cluster::drain`).
    pub drain: bool,
    /// How long the drain may take before `on_drain_timeout` applies.
    pub drain_timeout: HumanDuration,
    pub on_drain_timeout: crate::cluster::drain::OnDrainTimeout,
}

impl Default for LevelConfig {
    fn default() -> Self {
        LevelConfig {
            taint_effect: TaintEffect::NoExecute,
            k3s: None,
            drain: true,
            drain_timeout: crate::cluster::drain::DEFAULT_DRAIN_TIMEOUT,
            on_drain_timeout: Default::default(),
        }
    }
}

impl LevelConfig {
    /// The drain on the step down into this level; `None` with `drain = false`.
    pub fn drain_settings(&self) -> Option<crate::cluster::drain::DrainSettings> {
        self.drain.then_some(crate::cluster::drain::DrainSettings {
            timeout: self.drain_timeout.0,
            on_timeout: self.on_drain_timeout,
        })
    }
}

/// The k3s flags k3s documents for an etcd-only server. The agent stays (SPEC §2:
/// `disable-agent` is unsupported with embedded etcd).
pub const ETCD_ONLY_FLAGS: [&str; 3] = ["disable-apiserver", "disable-controller-manager", "disable-scheduler"];

/// `[levels]`: per-level settings. `full` has none: it is k3s as configured.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LevelsConfig {
    #[serde(rename = "control-plane")]
    pub control_plane: LevelConfig,
    #[serde(rename = "etcd-only")]
    pub etcd_only: LevelConfig,
}

impl LevelsConfig {
    /// The settings of `level`; `None` for `full`.
    pub fn get(&self, level: Level) -> Option<&LevelConfig> {
        match level {
            Level::Full => None,
            Level::ControlPlane => Some(&self.control_plane),
            Level::EtcdOnly => Some(&self.etcd_only),
        }
    }

    fn get_mut(&mut self, level: Level) -> Option<&mut LevelConfig> {
        match level {
            Level::Full => None,
            Level::ControlPlane => Some(&mut self.control_plane),
            Level::EtcdOnly => Some(&mut self.etcd_only),
        }
    }

    /// The k3s flags in force at `level` (empty at `full`).
    pub fn k3s_flags(&self, level: Level) -> BTreeMap<String, FlagValue> {
        match (level, self.get(level).and_then(|l| l.k3s.as_ref())) {
            (_, Some(flags)) => flags.clone(),
            (Level::EtcdOnly, None) => ETCD_ONLY_FLAGS.iter().map(|f| (f.to_string(), FlagValue::Bool(true))).collect(),
            _ => BTreeMap::new(),
        }
    }

    /// Whether k3s runs its agent (kubelet) at `level`, so a restart into it waits for
    /// the Node to be Ready on a fresh heartbeat.
    pub fn runs_agent(&self, level: Level) -> bool {
        !matches!(self.k3s_flags(level).get("disable-agent"), Some(FlagValue::Bool(true)))
    }

    /// Whether moving between `a` and `b` restarts k3s: only when their flags differ.
    pub fn needs_restart(&self, a: Level, b: Level) -> bool {
        self.k3s_flags(a) != self.k3s_flags(b)
    }
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub step_up: StepUp,
    /// Where `watch` publishes its state (streaks, last step, last refusal) for `status`.
    pub state_file: PathBuf,
    pub pressure: PressureConfig,
    pub levels: LevelsConfig,
    pub cluster: crate::cluster::ClusterConfig,
    pub systemd: crate::actuator::systemd::SystemdConfig,
    #[cfg(feature = "docker")]
    pub docker: crate::actuator::docker::DockerConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            step_up: StepUp::Automatic,
            state_file: PathBuf::from("/run/regrade/state.json"),
            pressure: PressureConfig::default(),
            levels: LevelsConfig::default(),
            cluster: Default::default(),
            systemd: Default::default(),
            #[cfg(feature = "docker")]
            docker: Default::default(),
        }
    }
}

impl Config {
    /// Loads `path`, or the built-in defaults when `path` is the default path and absent.
    pub fn load(path: &Path, explicit: bool) -> anyhow::Result<Config> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => String::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        Self::parse(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Config> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_end()))?;
        cfg.validate()?;
        // Spell out each level's flags, so `check-config` shows what is in force.
        for level in [Level::ControlPlane, Level::EtcdOnly] {
            let flags = cfg.levels.k3s_flags(level);
            if let Some(lc) = cfg.levels.get_mut(level) {
                lc.k3s = Some(flags);
            }
        }
        Ok(cfg)
    }

    /// Rejects values no server could run with, naming the key.
    pub fn validate(&self) -> anyhow::Result<()> {
        let p = &self.pressure;
        check_percent("pressure.threshold", p.threshold)?;
        if let Some(c) = p.calm_threshold {
            check_percent("pressure.calm_threshold", c)?;
            if c > p.threshold {
                bail!(
                    "pressure.calm_threshold = {c} is above pressure.threshold = {}: a sample could be over and calm at once",
                    p.threshold
                );
            }
        }
        if p.sample_period.0.is_zero() {
            bail!("pressure.sample_period must be more than 0");
        }
        if p.sustain.0 < p.sample_period.0 {
            bail!(
                "pressure.sustain = {} is shorter than pressure.sample_period = {}: a streak could never be observed",
                units::format_duration(p.sustain.0),
                units::format_duration(p.sample_period.0)
            );
        }
        for (name, lc) in [("control-plane", &self.levels.control_plane), ("etcd-only", &self.levels.etcd_only)] {
            if lc.drain && lc.drain_timeout.0.is_zero() {
                bail!("levels.{name}.drain_timeout must be more than 0 (or set levels.{name}.drain = false)");
            }
            for key in lc.k3s.iter().flat_map(|m| m.keys()) {
                if key.is_empty() || key.starts_with('-') || key.contains(char::is_whitespace) {
                    bail!("levels.{name}.k3s: {key:?} is not a k3s flag name (write it without leading dashes)");
                }
            }
        }
        self.cluster.validate()?;
        self.systemd.validate()?;
        #[cfg(feature = "docker")]
        self.docker.validate()?;
        Ok(())
    }

    /// For the hooks that start k3s (`record-start`, `entrypoint`), which must never
    /// fail over regrade's own settings: every section that parses and validates is
    /// taken (`[systemd]`, `[levels]` are what they use), defaults for the rest, and
    /// each problem is handed to `warn`.
    pub fn load_for_hook(path: &Path, explicit: bool, mut warn: impl FnMut(String)) -> Config {
        let mut cfg = Config::default();
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return cfg,
            Err(e) => {
                warn(format!("reading {}: {e}; using the built-in settings", path.display()));
                return cfg;
            }
        };
        let table: toml::Table = match toml::from_str(&text) {
            Ok(t) => t,
            Err(e) => {
                warn(format!("in {}: {}; using the built-in settings", path.display(), e.to_string().trim_end()));
                return cfg;
            }
        };
        let section = |name: &str| table.get(name).cloned().map(|v| (name.to_string(), v));
        if let Some((name, v)) = section("systemd") {
            match v.try_into::<crate::actuator::systemd::SystemdConfig>() {
                Ok(s) if s.validate().is_ok() => cfg.systemd = s,
                Ok(s) => {
                    warn(format!("in {}: {:#}; using the built-in [{name}]", path.display(), s.validate().unwrap_err()))
                }
                Err(e) => warn(format!("in {}: [{name}]: {e}; using the built-in [{name}]", path.display())),
            }
        }
        if let Some((name, v)) = section("levels") {
            match v.try_into::<LevelsConfig>() {
                Ok(l) => cfg.levels = l,
                Err(e) => warn(format!("in {}: [{name}]: {e}; using the built-in [{name}]", path.display())),
            }
        }
        cfg
    }

    pub fn calm_threshold(&self) -> f64 {
        self.pressure.calm_threshold.unwrap_or(self.pressure.threshold)
    }
}

fn check_percent(key: &str, v: f64) -> anyhow::Result<()> {
    if !(0.0..=100.0).contains(&v) || v.is_nan() {
        bail!("{key} = {v} is out of range: PSI is a percentage from 0 to 100");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        format!("{:#}", Config::parse(text).unwrap_err())
    }

    #[test]
    fn empty_file_is_the_defaults() {
        let c = Config::parse("").unwrap();
        assert_eq!(c.pressure.metric, Metric::SomeAvg10);
        assert_eq!(c.step_up, StepUp::Automatic);
        assert_eq!(c.calm_threshold(), c.pressure.threshold);
        assert!(c.levels.runs_agent(Level::EtcdOnly));
        assert!(!c.levels.needs_restart(Level::Full, Level::ControlPlane));
        assert!(c.levels.needs_restart(Level::ControlPlane, Level::EtcdOnly));
        assert!(c.levels.needs_restart(Level::EtcdOnly, Level::Full));
    }

    #[test]
    fn the_contract_keys_parse() {
        let c = Config::parse(
            r#"
            step_up = "manual"
            [pressure]
            metric = "full_avg60"
            threshold = 30
            calm_threshold = 10.5
            mem_available_floor = "512MiB"
            sample_period = "2s"
            sustain = "30s"
            cooldown = "5m"
            source = "/tmp/psi"
            meminfo = "/tmp/meminfo"
            "#,
        )
        .unwrap();
        assert_eq!(c.step_up, StepUp::Manual);
        assert_eq!(c.pressure.metric, Metric::FullAvg60);
        assert_eq!(c.pressure.threshold, 30.0);
        assert_eq!(c.calm_threshold(), 10.5);
        assert_eq!(c.pressure.mem_available_floor, Some(ByteSize(512 << 20)));
        assert_eq!(c.pressure.sample_period.0, Duration::from_secs(2));
        assert_eq!(c.pressure.sustain.0, Duration::from_secs(30));
        assert_eq!(c.pressure.cooldown.0, Duration::from_secs(300));
        assert_eq!(c.pressure.source, PathBuf::from("/tmp/psi"));
    }

    #[test]
    fn a_misspelt_key_is_named_with_its_line() {
        let e = err("[pressure]\ntreshold = 20\n");
        assert!(e.contains("treshold"), "{e}");
        assert!(e.contains("line 2"), "{e}");
    }

    #[test]
    fn wrong_types_are_named() {
        let e = err("[pressure]\nthreshold = \"high\"\n");
        assert!(e.contains("threshold"), "{e}");
        let e = err("step_up = \"sometimes\"\n");
        assert!(e.contains("step_up") || e.contains("sometimes"), "{e}");
        let e = err("[pressure]\nsustain = \"5 parsecs\"\n");
        assert!(e.contains("sustain") && e.contains("parsecs"), "{e}");
    }

    #[test]
    fn impossible_values_are_named() {
        let e = err("[pressure]\nthreshold = -1\n");
        assert!(e.contains("pressure.threshold"), "{e}");
        let e = err("[pressure]\nthreshold = 101\n");
        assert!(e.contains("pressure.threshold"), "{e}");
        let e = err("[pressure]\nsample_period = \"10s\"\nsustain = \"5s\"\n");
        assert!(e.contains("pressure.sustain") && e.contains("sample_period"), "{e}");
        let e = err("[pressure]\nmem_available_floor = -5\n");
        assert!(e.contains("mem_available_floor") && e.contains("0 or more"), "{e}");
        let e = err("[pressure]\nmem_available_floor = \"lots\"\n");
        assert!(e.contains("mem_available_floor") && e.contains("none"), "{e}");
        let e = err("[pressure]\ncooldown = -5\n");
        assert!(e.contains("cooldown") && e.contains("negative"), "{e}");
        let e = err("[pressure]\nthreshold = 20\ncalm_threshold = 30\n");
        assert!(e.contains("pressure.calm_threshold"), "{e}");
        let e = err("[pressure]\nsample_period = \"0s\"\n");
        assert!(e.contains("pressure.sample_period"), "{e}");
        let e = err("[levels.etcd-only.k3s]\n\"--disable-apiserver\" = true\n");
        assert!(e.contains("levels.etcd-only.k3s"), "{e}");
    }

    #[test]
    fn missing_explicit_file_is_an_error_missing_default_is_defaults() {
        let p = Path::new("/nonexistent/regrade.toml");
        assert!(Config::load(p, false).is_ok());
        let e = format!("{:#}", Config::load(p, true).unwrap_err());
        assert!(e.contains("/nonexistent/regrade.toml"), "{e}");
    }

    #[test]
    fn etcd_only_keeps_its_flags_when_only_the_taint_is_set() {
        let c = Config::parse("[levels.etcd-only]\ntaint_effect = \"NoSchedule\"\n").unwrap();
        assert_eq!(c.levels.etcd_only.taint_effect, TaintEffect::NoSchedule);
        assert_eq!(c.levels.k3s_flags(Level::EtcdOnly).len(), 3);
        assert!(c.levels.needs_restart(Level::ControlPlane, Level::EtcdOnly));
    }

    #[test]
    fn the_floor_can_be_turned_off_and_round_trips() {
        let c = Config::parse("[pressure]\nmem_available_floor = \"none\"\n").unwrap();
        assert_eq!(c.pressure.mem_available_floor, None);
        let again = Config::parse(&toml::to_string(&c).unwrap()).unwrap();
        assert_eq!(again.pressure.mem_available_floor, None);
        let c = Config::parse("[pressure]\nmem_available_floor = 1024\n").unwrap();
        assert_eq!(c.pressure.mem_available_floor, Some(ByteSize(1024)));
        assert_eq!(Config::parse("").unwrap().pressure.mem_available_floor, Some(ByteSize(512 << 20)));
    }

    #[test]
    fn the_drain_keys_parse_on_both_levels() {
        use crate::cluster::drain::OnDrainTimeout;
        let c = Config::parse("").unwrap();
        for lc in [&c.levels.control_plane, &c.levels.etcd_only] {
            assert!(lc.drain);
            assert_eq!(lc.drain_timeout.0, Duration::from_secs(120));
            assert_eq!(lc.on_drain_timeout, OnDrainTimeout::Proceed);
        }
        let c = Config::parse(
            "[levels.control-plane]\ndrain_timeout = \"30s\"\non_drain_timeout = \"delete\"\n\
             [levels.etcd-only]\ndrain = false\n",
        )
        .unwrap();
        let s = c.levels.control_plane.drain_settings().unwrap();
        assert_eq!((s.timeout, s.on_timeout), (Duration::from_secs(30), OnDrainTimeout::Delete));
        assert_eq!(c.levels.etcd_only.drain_settings(), None);
        let e = err("[levels.control-plane]\non_drain_timeout = \"force\"\n");
        assert!(e.contains("on_drain_timeout") && e.contains("proceed"), "{e}");
        let e = err("[levels.etcd-only]\ndrain_timeout = \"0s\"\n");
        assert!(e.contains("levels.etcd-only.drain_timeout"), "{e}");
        assert!(Config::parse("[levels.etcd-only]\ndrain = false\ndrain_timeout = 0\n").is_ok());
    }

    #[test]
    fn disable_agent_is_an_opt_in() {
        let c = Config::parse("[levels.etcd-only.k3s]\ndisable-agent = true\ndisable-apiserver = true\n").unwrap();
        assert!(!c.levels.runs_agent(Level::EtcdOnly));
        assert!(c.levels.runs_agent(Level::ControlPlane));
    }
}
