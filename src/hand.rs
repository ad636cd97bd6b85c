//! `regrade step up|down|to LEVEL`: a step by hand. It takes the same Lease and peer
//! check as an automatic step and never reads pressure. The planner
//! ([`next_hand_step`]) is pure; `watch` notices a hand step by the actuator's level.

use std::process::ExitCode;

use clap::Subcommand;

use crate::backend::{self, Backend};
use crate::cluster::StepEvent;
use crate::config::Config;
use crate::decide::{Direction, Step};
use crate::level::Level;
use crate::runtime::runtime;
use crate::step::{self, Outcome};

/// Where a hand step goes. The command line (`cli`) uses it as its subcommand.
#[derive(Subcommand, Debug, Clone, Copy)]
pub enum StepTarget {
    /// One level down.
    Down,
    /// One level up.
    Up,
    /// To LEVEL, one level at a time.
    To { level: Level },
}

/// `regrade step up|down|to LEVEL`: the same Lease and peer check, never reads PSI.
pub fn step_by_hand(cfg: &Config, target: StepTarget) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let Backend { mut actuator, cluster, etcd } = backend::real(cfg).await?;
        let levels = actuator.levels().to_vec();
        loop {
            let current = actuator.current_level().await?;
            let step = match next_hand_step(current, target, &levels)? {
                Some(step) => step,
                None => {
                    println!("at {current}");
                    return Ok(ExitCode::SUCCESS);
                }
            };
            println!("{} {} -> {} ...", step.direction.action(), step.from, step.to);
            match step::run(&step, actuator.as_mut(), cluster.as_ref(), etcd.as_ref(), &cfg.levels).await {
                Outcome::Done => println!("now at {}", step.to),
                Outcome::Refused(r) => {
                    cluster.record(StepEvent::Refused(&step, &r)).await;
                    anyhow::bail!("refused: {r}");
                }
                Outcome::Failed { level, error } => {
                    anyhow::bail!("{} failed, k3s is at {level}: {error:#}", step.direction.action())
                }
            }
            if !matches!(target, StepTarget::To { .. }) {
                return Ok(ExitCode::SUCCESS);
            }
        }
    })
}

/// The next one-level step towards `target` from `current`; `None` when there.
pub fn next_hand_step(current: Level, target: StepTarget, levels: &[Level]) -> anyhow::Result<Option<Step>> {
    let direction = match target {
        StepTarget::Down => Direction::Down,
        StepTarget::Up => Direction::Up,
        StepTarget::To { level } => {
            let (Some(c), Some(l)) = (current.index_in(levels), level.index_in(levels)) else {
                anyhow::bail!("this actuator does not support level {level}");
            };
            match l.cmp(&c) {
                std::cmp::Ordering::Equal => return Ok(None),
                std::cmp::Ordering::Greater => Direction::Down,
                std::cmp::Ordering::Less => Direction::Up,
            }
        }
    };
    match Step::from_level(current, direction, levels) {
        Some(s) => Ok(Some(s)),
        None if matches!(target, StepTarget::To { .. }) => Ok(None),
        None => anyhow::bail!(
            "already at {current}: there is no level {}",
            if direction == Direction::Down { "below" } else { "above" }
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: &[Level] = &Level::ALL;

    #[test]
    fn hand_steps_go_one_level_at_a_time() {
        let s = next_hand_step(Level::Full, StepTarget::To { level: Level::EtcdOnly }, L).unwrap().unwrap();
        assert_eq!((s.from, s.to), (Level::Full, Level::ControlPlane));
        let s = next_hand_step(Level::EtcdOnly, StepTarget::To { level: Level::Full }, L).unwrap().unwrap();
        assert_eq!((s.direction, s.to), (Direction::Up, Level::ControlPlane));
        assert!(next_hand_step(Level::Full, StepTarget::To { level: Level::Full }, L).unwrap().is_none());
        assert!(next_hand_step(Level::Full, StepTarget::Up, L).is_err());
        assert!(next_hand_step(Level::EtcdOnly, StepTarget::Down, L).is_err());
        assert_eq!(next_hand_step(Level::ControlPlane, StepTarget::Up, L).unwrap().unwrap().to, Level::Full);
    }
}
