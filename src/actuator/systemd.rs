//! The systemd actuator (SPEC §5): a k3s config drop-in and a restart of
//! `k3s.service` over D-Bus. (Being implemented: issue 4.)

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::HumanDuration;

/// `[systemd]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SystemdConfig {
    /// The k3s unit restarted when a level changes k3s's flags.
    pub unit: String,
    /// The k3s config drop-in regrade owns. k3s reads `config.yaml.d/*.yaml` after
    /// `config.yaml`; the file is removed at `full`.
    pub dropin: PathBuf,
    /// Where `regrade record-start` records the level k3s was started at (tmpfs).
    pub record: PathBuf,
    /// etcd's health endpoint, which k3s serves without TLS.
    pub etcd_health_url: String,
    /// How long a restart may take to become healthy (and Ready) before it is undone.
    pub health_timeout: HumanDuration,
}

impl Default for SystemdConfig {
    fn default() -> Self {
        SystemdConfig {
            unit: "k3s.service".into(),
            dropin: PathBuf::from("/etc/rancher/k3s/config.yaml.d/50-regrade.yaml"),
            record: PathBuf::from("/run/regrade/started-level"),
            etcd_health_url: "http://127.0.0.1:2381/health".into(),
            health_timeout: HumanDuration(Duration::from_secs(300)),
        }
    }
}

impl SystemdConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if !self.unit.ends_with(".service") {
            anyhow::bail!("systemd.unit = {:?} must name a .service unit", self.unit);
        }
        if self.dropin.extension().is_none_or(|e| e != "yaml") {
            anyhow::bail!("systemd.dropin = {:?} must end in .yaml (k3s reads only config.yaml.d/*.yaml)", self.dropin);
        }
        if self.health_timeout.0.is_zero() {
            anyhow::bail!("systemd.health_timeout must be more than 0");
        }
        Ok(())
    }
}

use async_trait::async_trait;

use super::{Actuator, NodeReadiness};
use crate::config::Config;
use crate::level::Level;

pub struct SystemdActuator {
    record: PathBuf,
}

impl SystemdActuator {
    pub fn new(cfg: &Config) -> anyhow::Result<SystemdActuator> {
        Ok(SystemdActuator { record: cfg.systemd.record.clone() })
    }
}

#[async_trait(?Send)]
impl Actuator for SystemdActuator {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }

    /// The level `regrade record-start` recorded when k3s last started; none = `full`.
    async fn current_level(&self) -> anyhow::Result<Level> {
        match std::fs::read_to_string(&self.record) {
            Ok(s) => s.trim().parse().map_err(|e| anyhow::anyhow!("{}: {e}", self.record.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Level::Full),
            Err(e) => Err(anyhow::anyhow!("reading {}: {e}", self.record.display())),
        }
    }

    async fn apply_level(&mut self, _level: Level, _: &dyn NodeReadiness) -> anyhow::Result<()> {
        anyhow::bail!("no actuator is configured in this build yet: the systemd actuator is not implemented (issue 4)")
    }
}

/// `regrade record-start`, the ExecStartPre hook of k3s.service.
pub fn record_start(_cfg: &Config) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("record-start is not implemented yet (issue 4)")
}
