//! `regrade step up|down|to LEVEL`: a step by hand. It takes the same Lease and peer
//! check as an automatic step and never reads pressure. The planner
//! ([`next_hand_step`]) is pure; `watch` notices a hand step by the actuator's level.

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;

use crate::backend::{self, Backend};
use crate::cluster::lease::EXPIRY_MARGIN;
use crate::cluster::{RefusalKind, StepEvent};
use crate::config::Config;
use crate::decide::{Direction, Step};
use crate::level::Level;
use crate::level_keeper::{self, Pending};
use crate::own_time::StepClock;
use crate::runtime::runtime;
use crate::step::{self, Outcome};
use tokio::signal::unix::{signal, SignalKind};

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
/// It meets the level record first as `watch` does (an interrupted step is finished
/// first, a changed key refused), and handles SIGINT/SIGTERM as `watch` does: the
/// step under way is finished (or fails and is undone), then it stops.
pub fn step_by_hand(cfg: &Config, target: StepTarget) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let mut signals = Signals::new()?;
        let out = Out { quiet: false };
        // Held to the end: while it runs, `watch` on this server neither steps nor
        // judges the record; killed, the kernel lets go and `watch` finishes the step.
        let _lock = wait_for_the_step_lock(cfg, &mut signals, out).await?;
        let backend = backend::real(cfg).await?;
        hand_steps(cfg, backend, target, &mut signals, out).await
    })
}

/// `step_by_hand` over a given backend, printing nothing: for the deterministic
/// simulator (tests/testsuite/simulator.rs).
#[cfg(any(test, feature = "testing"))]
pub async fn step_by_hand_with(cfg: &Config, backend: Backend, target: StepTarget) -> anyhow::Result<ExitCode> {
    let mut signals = Signals::new()?;
    let out = Out { quiet: true };
    let _lock = wait_for_the_step_lock(cfg, &mut signals, out).await?;
    hand_steps(cfg, backend, target, &mut signals, out).await
}

/// What a hand step does once it holds the step lock.
async fn hand_steps(
    cfg: &Config,
    backend: Backend,
    target: StepTarget,
    signals: &mut Signals,
    out: Out,
) -> anyhow::Result<ExitCode> {
    {
        let Backend { mut actuator, cluster, etcd } = backend;
        let levels = actuator.levels().to_vec();
        let marks = level_keeper::read_marks(cluster.as_ref()).await;
        let st = level_keeper::start(cfg, actuator.as_mut(), marks).await?;
        let keeper = st.keeper;
        let mut interrupted = false;
        match st.pending {
            Pending::Nothing | Pending::Adopt => {}
            Pending::Marks => {
                if let Err(e) = cluster.mark_node(keeper.level(), &cfg.levels).await {
                    tracing::warn!(error = %format!("{e:#}"), "could not put the Node's marks right");
                }
            }
            Pending::Resume(step) => {
                out.say(format_args!("finishing the interrupted step {} -> {} ...", step.from, step.to));
                let clock = StepClock::start();
                let fut = step::resume(
                    &step,
                    actuator.as_mut(),
                    cluster.as_ref(),
                    etcd.as_ref(),
                    &cfg.levels,
                    &keeper,
                    &clock,
                );
                match finish_despite_signals(fut, signals, &mut interrupted).await {
                    Outcome::Done => out.say(format_args!("now at {}", step.to)),
                    Outcome::Refused(r) => {
                        anyhow::bail!(
                            "an interrupted step {} -> {} is to be finished first: refused: {r}",
                            step.from,
                            step.to
                        )
                    }
                    Outcome::Failed { level, error } => {
                        anyhow::bail!("finishing the interrupted step failed, k3s is at {level}: {error:#}")
                    }
                }
            }
        }
        // A Lease held by another is watched for up to a lease duration (and the
        // margin): a holder that died stops renewing it, and only this process's own
        // observation of an unchanged Lease lets it take over (never the holder's
        // renewTime, on another clock). A live holder keeps renewing: refused then.
        let patience = cfg.cluster.lease_duration.0 + EXPIRY_MARGIN + Duration::from_secs(2);
        let mut lease_wait: Option<tokio::time::Instant> = None;
        loop {
            let current = keeper.level();
            let step = match next_hand_step(current, target, &levels)? {
                Some(step) => step,
                None => {
                    out.say(format_args!("at {current}"));
                    return Ok(ExitCode::SUCCESS);
                }
            };
            if interrupted {
                anyhow::bail!("interrupted: stopped at {current}, before the step to {}", step.to);
            }
            if lease_wait.is_none() {
                out.say(format_args!("{} {} -> {} ...", step.direction.action(), step.from, step.to));
            }
            let clock = StepClock::start();
            let fut =
                step::run(&step, actuator.as_mut(), cluster.as_ref(), etcd.as_ref(), &cfg.levels, &keeper, &clock);
            let outcome = finish_despite_signals(fut, signals, &mut interrupted).await;
            if keeper.marks_unsure.replace(false) {
                if let Err(e) = cluster.mark_node(keeper.level(), &cfg.levels).await {
                    tracing::warn!(error = %format!("{e:#}"), "could not put the Node's marks right; `regrade watch` will");
                }
            }
            match outcome {
                Outcome::Done => out.say(format_args!("now at {}", step.to)),
                Outcome::Refused(r)
                    if r.kind == RefusalKind::LeaseHeld
                        && !interrupted
                        && lease_wait.is_none_or(|until| tokio::time::Instant::now() < until) =>
                {
                    if lease_wait.is_none() {
                        out.say(format_args!(
                            "{r}; watching it for up to {} (a holder that stopped renewing it is taken over)",
                            crate::units::format_duration(patience)
                        ));
                        lease_wait = Some(tokio::time::Instant::now() + patience);
                    }
                    tokio::select! {
                        biased;
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = signals.next() => interrupted = true,
                    }
                    continue;
                }
                Outcome::Refused(r) => {
                    cluster.record(StepEvent::Refused(&step, &r)).await;
                    anyhow::bail!("refused: {r}");
                }
                Outcome::Failed { level, error } => {
                    anyhow::bail!("{} failed, k3s is at {level}: {error:#}", step.direction.action())
                }
            }
            lease_wait = None;
            if !matches!(target, StepTarget::To { .. }) {
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

/// The signals a hand step outlives: SIGTERM and SIGINT, and SIGHUP (the SSH session
/// it ran in dropped). Each is noted, not obeyed, while a step is under way.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// The next signal, by name.
    async fn next(&mut self) -> &'static str {
        tokio::select! {
            biased;
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "interrupted",
            _ = self.hup.recv() => "SIGHUP (the terminal went away)",
        }
    }
}

/// Where a hand step says what it does: stdout, or nowhere (the simulator).
#[derive(Clone, Copy)]
struct Out {
    quiet: bool,
}

impl Out {
    /// Says `msg` on stdout. A terminal that went away (SIGHUP, a dropped SSH session)
    /// must not end the step half-way, as `println!` would by panicking.
    fn say(self, msg: std::fmt::Arguments<'_>) {
        use std::io::Write;
        if !self.quiet {
            let _ = writeln!(std::io::stdout(), "{msg}");
        }
    }
}

/// Waits until no other regrade process steps this server (`watch` in a step, or
/// another hand step), saying so once; a signal meanwhile stops the wait.
async fn wait_for_the_step_lock(
    cfg: &Config,
    signals: &mut Signals,
    out: Out,
) -> anyhow::Result<level_keeper::StepLock> {
    let mut said = false;
    loop {
        match level_keeper::StepLock::try_take(&cfg.level_record)? {
            Ok(lock) => return Ok(lock),
            Err(busy) if !said => {
                out.say(format_args!("{busy}; waiting for it to finish"));
                tracing::info!(lock = %busy.path.display(), pid = ?busy.pid, "waiting for the step lock");
                said = true;
            }
            Err(_) => {}
        }
        tokio::select! {
            biased;
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            why = signals.next() => anyhow::bail!("{why}: stopped while waiting for the step lock; nothing was changed"),
        }
    }
}

/// Drives a step to its end; a signal meanwhile is noted, not obeyed, so k3s is never
/// left between levels.
async fn finish_despite_signals(
    fut: impl std::future::Future<Output = Outcome>,
    signals: &mut Signals,
    interrupted: &mut bool,
) -> Outcome {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            biased;
            out = &mut fut => return out,
            why = signals.next() => {
                *interrupted = true;
                let _ = std::io::Write::write_fmt(
                    &mut std::io::stderr(),
                    format_args!("regrade: {why}: finishing the step under way, then stopping\n"),
                );
            }
        }
    }
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
