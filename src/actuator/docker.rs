//! The Docker actuator (SPEC §5, docker; cargo feature `docker`). (Being implemented:
//! issue 6.)

use serde::{Deserialize, Serialize};

use crate::config::Config;

/// `[docker]`
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DockerConfig {
    /// The k3s server container.
    pub container: String,
}

impl DockerConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        Ok(())
    }
}

pub struct DockerActuator;

impl DockerActuator {
    pub fn new(_cfg: &Config) -> anyhow::Result<crate::actuator::systemd::SystemdActuator> {
        anyhow::bail!("the Docker actuator is not implemented yet (issue 6)")
    }
}
