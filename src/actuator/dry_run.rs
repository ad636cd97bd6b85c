//! The dry-run actuator: remembers a level in memory and touches nothing, for
//! `watch --dry-run` and `simulate`.

use async_trait::async_trait;

use super::{Actuator, NodeReadiness};
use crate::level::Level;

pub struct DryRun {
    level: Level,
}

impl DryRun {
    pub fn new(level: Level) -> DryRun {
        DryRun { level }
    }
}

#[async_trait(?Send)]
impl Actuator for DryRun {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }

    async fn current_level(&self) -> anyhow::Result<Level> {
        Ok(self.level)
    }

    async fn apply_level(&mut self, level: Level, _: &dyn NodeReadiness) -> anyhow::Result<()> {
        tracing::info!(from = %self.level, to = %level, "dry run: would apply level");
        self.level = level;
        Ok(())
    }
}
