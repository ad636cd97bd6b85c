//! The levels' settings (`[levels]`): each level's k3s flags and taint effect, and
//! what follows from them (does a move between two levels restart k3s, does a level
//! run the agent). See docs/behaviour.md, "Levels".
//!
//! A value module: no I/O. The actuators and the cluster take a [`LevelsConfig`]
//! alongside their own section.

use std::collections::BTreeMap;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::level::Level;
use crate::units::HumanDuration;

/// The effect of regrade's taint while a level below `full` is in force
/// (docs/behaviour.md, "Levels").
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
    pub on_drain_timeout: OnDrainTimeout,
}

impl Default for LevelConfig {
    fn default() -> Self {
        LevelConfig {
            // Nothing new lands, nothing bypasses a PodDisruptionBudget: the drain
            // moves the pods. NoExecute would delete them all, DaemonSets' too.
            taint_effect: TaintEffect::NoSchedule,
            k3s: None,
            drain: true,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            on_drain_timeout: OnDrainTimeout::default(),
        }
    }
}

impl LevelConfig {
    /// The drain on the step down into this level; `None` with `drain = false`.
    pub fn drain_settings(&self) -> Option<DrainSettings> {
        self.drain.then_some(DrainSettings { timeout: self.drain_timeout.0, on_timeout: self.on_drain_timeout })
    }
}

/// What happens to pods still on the Node when `drain_timeout` has passed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnDrainTimeout {
    /// The step goes on; the pods stay, each named (with the budget holding it).
    #[default]
    Proceed,
    /// The pods are deleted, bypassing their PodDisruptionBudgets.
    Delete,
}

impl OnDrainTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnDrainTimeout::Proceed => "proceed",
            OnDrainTimeout::Delete => "delete",
        }
    }
}

/// A level's drain keys (`drain`, `drain_timeout`, `on_drain_timeout`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainSettings {
    pub timeout: Duration,
    pub on_timeout: OnDrainTimeout,
}

pub const DEFAULT_STEP_TIMEOUT: HumanDuration = HumanDuration(Duration::from_secs(25 * 60));

pub const DEFAULT_DRAIN_TIMEOUT: HumanDuration = HumanDuration(Duration::from_secs(120));

/// The k3s flags k3s documents for an etcd-only server. The agent stays: k3s does not
/// support `disable-agent` with embedded etcd (docs/behaviour.md, "Levels").
pub const ETCD_ONLY_FLAGS: [&str; 3] = ["disable-apiserver", "disable-controller-manager", "disable-scheduler"];

/// Why a k3s flag must never be part of a level, or `None` when it may: each of
/// these stops, wipes or replaces the very etcd vote regrade steps down to protect.
pub fn unsafe_level_flag(key: &str) -> Option<&'static str> {
    let key = key.strip_suffix('+').unwrap_or(key);
    Some(match key {
        "disable-etcd" => "it stops this server's etcd member, so the server loses its vote",
        "cluster-reset" | "cluster-reset-restore-path" => {
            "it resets etcd to a one-member cluster, throwing the other members out"
        }
        "cluster-init" => "it starts a new etcd cluster instead of rejoining this one",
        "server" | "token" | "token-file" | "agent-token" | "agent-token-file" => {
            "it changes which cluster this server joins"
        }
        "data-dir" => "k3s would start with another data directory, so another (empty) etcd member",
        "datastore-endpoint" | "datastore-cafile" | "datastore-certfile" | "datastore-keyfile" => {
            "it replaces embedded etcd with an external datastore"
        }
        "node-name" | "with-node-id" => "a new node name is a new etcd member, not this server's",
        "etcd-arg" => "it changes how etcd itself runs",
        _ => return None,
    })
}

/// `[levels]`: per-level settings. `full` has none: it is k3s as configured.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LevelsConfig {
    /// The deadline of one step, from taking the Lease to releasing it: past it the
    /// step is cut short and rolled back (`crate::step`). Longer than the drain and
    /// the restart's waits, so it catches only a step that stopped making progress.
    pub step_timeout: HumanDuration,
    #[serde(rename = "control-plane")]
    pub control_plane: LevelConfig,
    #[serde(rename = "etcd-only")]
    pub etcd_only: LevelConfig,
}

impl Default for LevelsConfig {
    fn default() -> Self {
        LevelsConfig {
            step_timeout: DEFAULT_STEP_TIMEOUT,
            control_plane: LevelConfig::default(),
            etcd_only: LevelConfig::default(),
        }
    }
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

    /// Writes each level's flags out in full (the built-in ones where unset), so
    /// `check-config` shows what is in force.
    pub fn spell_out(&mut self) {
        for level in [Level::ControlPlane, Level::EtcdOnly] {
            let flags = self.k3s_flags(level);
            if let Some(lc) = self.get_mut(level) {
                lc.k3s = Some(flags);
            }
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
