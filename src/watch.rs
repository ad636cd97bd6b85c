//! `watch`, the daemon, and `step`, by hand: the loop at the edge that feeds samples
//! to the core and runs the steps it proposes.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};

use crate::backend::{self, Backend};
use crate::cli::StepTarget;
use crate::cluster::StepEvent;
use crate::config::{Config, LevelsConfig};
use crate::decide::{Direction, Reading, Settings, State, Step};
use crate::level::Level;
use crate::notify::Notifier;
use crate::pressure::{SampleError, Sampler};
use crate::psi_trigger::{self, Cause, Pacer, Pacing, Wake};
use crate::statefile::{self, LastStep, Published, PublishedRefusal};
use crate::step::{self, Outcome};

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    // One thread is plenty: one sample at a time, one step at a time.
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// Locks the daemon's memory so a thrashing host cannot page it out. `MCL_ONFAULT`
/// locks pages as they are touched, so code never run (most of the binary) costs nothing.
fn lock_memory() {
    let flags = libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT;
    // SAFETY: mlockall takes flags only and changes no Rust-visible state.
    if unsafe { libc::mlockall(flags) } != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(error = %e, "could not lock memory (mlockall); going on unlocked (needs CAP_IPC_LOCK)");
    }
}

pub fn run(cfg: &Config, dry_run: bool) -> anyhow::Result<ExitCode> {
    // Open the files first: no PSI means stop at once (SPEC §3).
    let sampler = Sampler::open(&cfg.pressure.source, &cfg.pressure.meminfo)?;
    lock_memory();
    runtime()?.block_on(async {
        let backend = if dry_run { backend::dry_run(cfg).await } else { backend::real(cfg).await? };
        Watcher::new(cfg, backend, sampler, dry_run).await?.run().await
    })
}

/// The per-sample work: sample, classify, update the core, tell systemd, publish the
/// state when it changed. Allocates nothing on a sample that proposes no step.
pub struct Ticker {
    sampler: Sampler,
    settings: Settings,
    levels: Vec<Level>,
    pub state: State,
    notifier: Notifier,
    published: Published,
    /// `None` in a dry run: it must not overwrite the state a real `watch` publishes.
    state_file: Option<PathBuf>,
    /// Samples that parsed; READY waits for the first.
    pub good_samples: u64,
    /// Set when a step ran or was refused, so the next publish writes the file.
    dirty: bool,
    wall_origin: SystemTime,
    /// The last good sample's reading: the pacer sleeps only after a calm one.
    pub last_reading: Option<Reading>,
}

impl Ticker {
    pub fn new(cfg: &Config, sampler: Sampler, levels: Vec<Level>, level: Level, dry_run: bool) -> Ticker {
        Ticker {
            sampler,
            settings: Settings::from_config(cfg),
            levels,
            state: State::new(level),
            notifier: Notifier::from_env(),
            published: Published { pid: std::process::id(), dry_run, ..Default::default() },
            state_file: (!dry_run).then(|| cfg.state_file.clone()),
            good_samples: 0,
            dirty: true,
            wall_origin: SystemTime::now(),
            last_reading: None,
        }
    }

    /// Whether `watch` may sleep on the PSI trigger (see [`psi_trigger::calm_at_top`]).
    pub fn calm_at_top(&self) -> bool {
        psi_trigger::calm_at_top(&self.state, self.last_reading, &self.settings, &self.levels)
    }

    /// Publishes how `watch` waits (written at once: it changes rarely).
    fn set_pacing(&mut self, pacing: Pacing, trigger: Option<&str>) {
        self.published.pacing = Some(pacing);
        if let Some(t) = trigger {
            self.published.trigger = Some(t.to_string());
        }
        self.mark_dirty();
    }

    /// One sample at `t` (time since the watcher started). Returns the step the core
    /// proposes; a fatal error (no PSI) ends `watch`.
    pub fn tick(&mut self, t: Duration) -> Result<Option<Step>, SampleError> {
        let sample = match self.sampler.sample() {
            Ok(s) => s,
            Err(e) if e.is_fatal() => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "sample failed; trying again next period");
                return Ok(None);
            }
        };
        self.good_samples += 1;
        let reading = self.settings.classify(&sample);
        self.last_reading = Some(reading);
        let pressure = sample.metric(self.settings.metric);
        let proposed = self.state.observe(&self.settings, &self.levels, t, reading);
        if proposed.is_none() && self.published.refusal.is_some() {
            // Nothing is being refused any more (the streak ended or the step ran).
            self.published.refusal = None;
            self.dirty = true;
        }
        self.notifier.status(format_args!(
            "level {}, {} {:.2}%, MemAvailable {} MiB",
            self.state.level,
            self.settings.metric.as_str(),
            pressure,
            sample.mem_available >> 20
        ));
        self.notifier.watchdog();
        tracing::debug!(level = %self.state.level, pressure, available = sample.mem_available, decision = ?reading, "sample");
        if let Some(step) = &proposed {
            tracing::info!(
                level = %step.from, to = %step.to, pressure, available = sample.mem_available,
                decision = step.direction.action(), "stepping"
            );
        }
        self.publish();
        Ok(proposed)
    }

    /// Feeds a step's outcome back to the core and the published state. Returns true
    /// for a refusal whose reason is new, which is worth an Event.
    fn settle(&mut self, t: Duration, step: &Step, outcome: &Outcome) -> bool {
        let now = statefile::unix(SystemTime::now());
        let level = match outcome {
            Outcome::Refused(r) => {
                // Logged and recorded as an Event only when the reason changes.
                // By (kind, subject): the message carries ages that change every sample.
                let changed =
                    self.published.refusal.as_ref().is_none_or(|p| p.kind != r.kind || p.subject != r.subject);
                if !changed {
                    return false;
                }
                tracing::warn!(kind = r.kind, reason = %r.message, decision = step.direction.action(), "step refused");
                self.published.refusal = Some(PublishedRefusal {
                    since: now,
                    kind: r.kind.to_string(),
                    subject: r.subject.clone(),
                    message: r.message.clone(),
                });
                self.dirty = true;
                self.publish();
                return true;
            }
            Outcome::Done => {
                tracing::info!(level = %step.to, decision = step.direction.action(), "step done");
                step.to
            }
            Outcome::Failed { level, error } => {
                tracing::error!(level = %level, error = %format!("{error:#}"), decision = step.direction.action(), "step failed");
                *level
            }
        };
        self.state.step_ran(t, level);
        self.published.refusal = None;
        self.published.last_step = Some(LastStep {
            at: statefile::unix(self.wall_origin + t),
            action: step.direction.action().to_string(),
            from: step.from,
            to: step.to,
            result: match outcome {
                Outcome::Failed { error, .. } => format!("failed: {error:#}"),
                _ => "done".to_string(),
            },
        });
        self.dirty = true;
        self.publish();
        false
    }

    /// Makes the next publish write the state file.
    fn mark_dirty(&mut self) {
        self.dirty = true;
        self.publish();
    }

    /// Writes the state file when it changed (never on an unchanged calm sample).
    fn publish(&mut self) {
        let changed = self.published.set_state(&self.state, self.wall_origin);
        if changed || self.dirty {
            self.dirty = false;
            let Some(path) = &self.state_file else { return };
            if let Err(e) = self.published.write(path) {
                tracing::warn!(error = %e, path = %path.display(), "could not write the state file");
            }
        }
    }
}

struct Watcher<'a> {
    cfg: &'a Config,
    backend: Backend,
    ticker: Ticker,
    origin: Instant,
    dry_run: bool,
    /// The Node's marks may not match the level (a step failed, or marking did): they
    /// are put right on the following samples until that succeeds.
    marks_pending: bool,
    /// When the actuator's level was last read, and what it said. A hand step changes
    /// it behind the core. (The core's level can differ from it on purpose: after a
    /// reboot at `control-plane`, see [`start_level`].)
    level_checked: Instant,
    actuator_level: Level,
    /// Samples every `sample_period`, or sleeps on the PSI trigger when calm at the top.
    pacer: Pacer,
}

/// How often `watch` re-reads the level, to notice a hand step (`regrade step`).
const LEVEL_CHECK_EVERY: Duration = Duration::from_secs(60);

impl<'a> Watcher<'a> {
    async fn new(
        cfg: &'a Config,
        mut backend: Backend,
        sampler: Sampler,
        dry_run: bool,
    ) -> anyhow::Result<Watcher<'a>> {
        if let Some(d) = backend.actuator.disagreement().await {
            tracing::warn!(disagreement = %d, "k3s's level and regrade's file disagree; converging");
        }
        backend.actuator.reconcile(backend.cluster.as_ref()).await.context("converging at start")?;
        let levels = backend.actuator.levels().to_vec();
        let actuator_level = backend.actuator.current_level().await.context("reading the current level")?;
        let (mut level, mut marks_pending) = (actuator_level, false);
        if !dry_run {
            (level, marks_pending) = start_level(&backend, &cfg.levels, actuator_level).await;
            backend.cluster.disconnect();
        }
        let (trigger, described) =
            psi_trigger::arm_for_watch(&cfg.pressure.source, cfg.pressure.metric, cfg.pressure.threshold);
        let mut ticker = Ticker::new(cfg, sampler, levels, level, dry_run);
        let period = cfg.pressure.sample_period.0;
        let pacer = Pacer::new(period, psi_trigger::HOLD_AFTER_FIRE, trigger, ticker.notifier.watchdog_period())
            .context("setting up the PSI trigger's wait")?;
        tracing::info!(level = %level, dry_run, pacing = %pacer.mode(), trigger = %described, "regrade watch starting");
        ticker.set_pacing(pacer.mode(), Some(&described));
        Ok(Watcher {
            cfg,
            backend,
            ticker,
            origin: Instant::now(),
            dry_run,
            marks_pending,
            level_checked: Instant::now(),
            actuator_level,
            pacer,
        })
    }

    async fn run(mut self) -> anyhow::Result<ExitCode> {
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut ready = false;
        loop {
            let wake = tokio::select! {
                w = self.pacer.next() => w,
                _ = term.recv() => break,
                _ = int.recv() => break,
            };
            match wake {
                Wake::Watchdog => {
                    // Asleep on the trigger under systemd: a ping and nothing else.
                    self.ticker.notifier.watchdog();
                    continue;
                }
                Wake::Sample(Cause::Fired) => {
                    tracing::info!(pacing = %Pacing::Polling, "the PSI trigger fired; sampling every sample_period");
                    self.ticker.set_pacing(Pacing::Polling, None);
                }
                Wake::Sample(_) => {}
            }
            let t = self.origin.elapsed();
            let proposed = self.ticker.tick(t)?;
            if !ready && self.ticker.good_samples > 0 {
                // READY after the first good sample: the files are there and parse.
                self.ticker.notifier.ready();
                ready = true;
            }
            if !self.dry_run {
                if proposed.is_some() || self.level_checked.elapsed() >= LEVEL_CHECK_EVERY {
                    self.follow_hand_steps(t).await;
                }
                if self.marks_pending {
                    self.put_marks_right().await;
                }
            }
            // A hand step just noticed may have made the proposal stale.
            let proposed = proposed.filter(|s| s.from == self.ticker.state.level);
            if let Some(step) = proposed {
                let outcome = self.run_step(&step).await;
                self.marks_pending |= matches!(outcome, Outcome::Failed { .. });
                if let Some(level) = outcome.level_after(&step) {
                    self.actuator_level = level;
                }
                if let (true, Outcome::Refused(r)) = (self.ticker.settle(t, &step, &outcome), &outcome) {
                    self.backend.cluster.record(StepEvent::Refused(&step, r)).await;
                }
                if !self.marks_pending {
                    self.backend.cluster.disconnect();
                }
            }
            let calm = self.ticker.calm_at_top() && !self.marks_pending;
            if let Some(pacing) = self.pacer.after_sample(calm) {
                match pacing {
                    Pacing::Trigger => {
                        tracing::info!(pacing = %pacing, "calm at the top level: asleep on the PSI trigger")
                    }
                    Pacing::Polling => tracing::info!(pacing = %pacing, "sampling every sample_period"),
                }
                self.ticker.set_pacing(pacing, None);
            }
        }
        self.ticker.notifier.stopping();
        tracing::info!("regrade watch stopping");
        Ok(ExitCode::SUCCESS)
    }

    /// A hand step (`regrade step`) changes the actuator's level behind the core:
    /// adopt it as a step that ran now, so cooldown and fresh streaks apply from it.
    async fn follow_hand_steps(&mut self, t: Duration) {
        self.level_checked = Instant::now();
        match self.backend.actuator.current_level().await {
            Ok(level) if level != self.actuator_level => {
                self.actuator_level = level;
                tracing::info!(level = %level, was = %self.ticker.state.level, "the level changed outside watch (a hand step?); following it");
                self.ticker.state.step_ran(t, level);
                self.ticker.mark_dirty();
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %format!("{e:#}"), "could not read the current level"),
        }
    }

    /// Retries the Node's marks for the level k3s is at, after a step left them wrong.
    async fn put_marks_right(&mut self) {
        let level = self.ticker.state.level;
        match self.backend.cluster.mark_node(level, &self.cfg.levels).await {
            Ok(()) => {
                tracing::info!(level = %level, "the Node's marks match the level again");
                self.marks_pending = false;
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), level = %level, "could not put the Node's marks right; retrying next sample")
            }
        }
    }

    /// Runs a step, pinging the watchdog meanwhile: a restart can outlast WatchdogSec.
    async fn run_step(&mut self, step: &Step) -> Outcome {
        let Backend { actuator, cluster } = &mut self.backend;
        let fut = step::run(step, actuator.as_mut(), cluster.as_ref(), &self.cfg.levels);
        tokio::pin!(fut);
        let notifier = &self.ticker.notifier;
        let mut wd = tokio::time::interval(notifier.watchdog_period().unwrap_or(Duration::from_secs(3600)));
        loop {
            tokio::select! {
                out = &mut fut => return out,
                _ = wd.tick() => notifier.watchdog(),
            }
        }
    }
}

/// The level `watch` starts from, and whether the Node's marks need putting right.
/// After a reboot at `control-plane`, nothing on disk says so (the level has the
/// flags of `full` and the start record lives in /run): only the Node's label does.
/// A label naming a lower level with the same k3s flags is adopted; any other
/// mismatch is corrected to the actuator's level, which is what k3s runs.
async fn start_level(backend: &Backend, levels: &LevelsConfig, actual: Level) -> (Level, bool) {
    match backend.cluster.node_level().await {
        Ok(label) => {
            let labelled = label.unwrap_or(Level::Full);
            let below = |a: Level, b: Level| a.index_in(&Level::ALL) > b.index_in(&Level::ALL);
            if labelled == actual {
                (actual, false)
            } else if below(labelled, actual) && !levels.needs_restart(labelled, actual) {
                tracing::info!(level = %labelled, k3s = %actual, "the Node is labelled with a level k3s runs as; carrying on from it");
                (labelled, false)
            } else {
                tracing::warn!(label = %labelled, level = %actual, "the Node's label does not match how k3s runs; correcting the Node");
                (actual, true)
            }
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "could not read the Node's level at start; going on from the actuator's");
            (actual, false)
        }
    }
}

/// `regrade step up|down|to LEVEL`: the same Lease and peer check, never reads PSI.
pub fn step_by_hand(cfg: &Config, target: StepTarget) -> anyhow::Result<ExitCode> {
    runtime()?.block_on(async {
        let Backend { mut actuator, cluster } = backend::real(cfg).await?;
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
            match step::run(&step, actuator.as_mut(), cluster.as_ref(), &cfg.levels).await {
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
fn next_hand_step(current: Level, target: StepTarget, levels: &[Level]) -> anyhow::Result<Option<Step>> {
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
    use crate::actuator::dry_run::DryRun;
    use crate::actuator::NodeReadiness;
    use crate::cluster::{Cluster, Refusal};
    use async_trait::async_trait;

    /// A cluster whose Node carries `label`; nothing else is called at start.
    struct Labelled(anyhow::Result<Option<Level>>);

    #[async_trait(?Send)]
    impl NodeReadiness for Labelled {
        async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
            unreachable!()
        }
    }

    #[async_trait(?Send)]
    impl Cluster for Labelled {
        async fn preflight(&self, _: &Step) -> Result<(), Refusal> {
            unreachable!()
        }
        async fn acquire(&self, _: &Step) -> Result<(), Refusal> {
            unreachable!()
        }
        async fn hold(&self) -> anyhow::Error {
            unreachable!()
        }
        async fn release(&self) {}
        async fn mark_node(&self, _: Level, _: &LevelsConfig) -> anyhow::Result<()> {
            unreachable!()
        }
        async fn node_level(&self) -> anyhow::Result<Option<Level>> {
            match &self.0 {
                Ok(l) => Ok(*l),
                Err(e) => Err(anyhow::anyhow!("{e}")),
            }
        }
        async fn record(&self, _: StepEvent<'_>) {}
    }

    fn start(label: anyhow::Result<Option<Level>>, actual: Level) -> (Level, bool) {
        let backend = Backend { actuator: Box::new(DryRun::new(actual)), cluster: Box::new(Labelled(label)) };
        runtime().unwrap().block_on(start_level(&backend, &LevelsConfig::default(), actual))
    }

    #[test]
    fn after_a_reboot_at_control_plane_the_nodes_label_is_adopted() {
        // The record says full (a reboot forgot it), the Node says control-plane.
        assert_eq!(start(Ok(Some(Level::ControlPlane)), Level::Full), (Level::ControlPlane, false));
        // Agreement, or an unreachable API: the actuator's level, nothing to correct.
        assert_eq!(start(Ok(None), Level::Full), (Level::Full, false));
        assert_eq!(start(Ok(Some(Level::EtcdOnly)), Level::EtcdOnly), (Level::EtcdOnly, false));
        assert_eq!(start(Err(anyhow::anyhow!("503")), Level::Full), (Level::Full, false));
    }

    /// An actuator whose level the test changes behind the watcher's back.
    struct Shared(std::rc::Rc<std::cell::Cell<Level>>);

    #[async_trait(?Send)]
    impl crate::actuator::Actuator for Shared {
        fn levels(&self) -> &[Level] {
            &Level::ALL
        }
        async fn current_level(&self) -> anyhow::Result<Level> {
            Ok(self.0.get())
        }
        async fn apply_level(&mut self, _: Level, _: &dyn NodeReadiness) -> anyhow::Result<()> {
            unreachable!()
        }
    }

    #[test]
    fn watch_follows_a_hand_step_but_keeps_a_level_adopted_from_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let (psi, mem) = (dir.path().join("psi"), dir.path().join("meminfo"));
        std::fs::write(&psi, "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n").unwrap();
        std::fs::write(&mem, "MemAvailable: 1000000 kB\n").unwrap();
        let cfg = Config::parse(&format!(
            "state_file = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\n",
            dir.path().join("state.json")
        ))
        .unwrap();
        let level = std::rc::Rc::new(std::cell::Cell::new(Level::Full));
        let backend = Backend {
            actuator: Box::new(Shared(level.clone())),
            cluster: Box::new(Labelled(Ok(Some(Level::ControlPlane)))),
        };
        let sampler = Sampler::open(&psi, &mem).unwrap();
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, false).await.unwrap();
            assert_eq!(w.ticker.state.level, Level::ControlPlane, "adopted from the Node after a reboot");
            w.follow_hand_steps(Duration::from_secs(60)).await;
            assert_eq!(w.ticker.state.level, Level::ControlPlane, "the actuator did not change: nothing to follow");
            level.set(Level::EtcdOnly); // `regrade step down` by hand
            w.follow_hand_steps(Duration::from_secs(120)).await;
            assert_eq!(w.ticker.state.level, Level::EtcdOnly);
            assert_eq!(w.ticker.state.last_step, Some(Duration::from_secs(120)), "a hand step starts the cooldown");
        });
    }

    #[test]
    fn a_label_that_cannot_be_true_is_corrected() {
        // etcd-only needs other flags than k3s runs with at full: the label is stale.
        assert_eq!(start(Ok(Some(Level::EtcdOnly)), Level::Full), (Level::Full, true));
        // k3s runs at control-plane (on record) but the label was removed by hand.
        assert_eq!(start(Ok(None), Level::ControlPlane), (Level::ControlPlane, true));
        assert_eq!(start(Ok(Some(Level::ControlPlane)), Level::EtcdOnly), (Level::EtcdOnly, true));
    }

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

    /// One path of [`trigger_and_polling_make_the_same_decisions`]: the pacing of
    /// `Watcher::run` (wait, sample, run the proposed step, choose how to wait next)
    /// over fixture files that `timeline` rewrites in real time. `fire` is sent the
    /// moment pressure reaches `threshold`, as the kernel fires a PSI trigger.
    fn run_path(trigger: bool) -> (Vec<(Duration, Direction, Level, Level)>, usize) {
        let dir = tempfile::tempdir().unwrap();
        let (psi, mem) = (dir.path().join("psi"), dir.path().join("meminfo"));
        let write_psi = |p: f64| {
            std::fs::write(
                &psi,
                format!("some avg10={p:.2} avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n"),
            )
            .unwrap()
        };
        write_psi(0.0);
        std::fs::write(&mem, "MemAvailable: 1000000 kB\n").unwrap();
        let cfg = Config::parse(&format!(
            "state_file = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\nmem_available_floor = \"none\"\n\
             sample_period = \"100ms\"\nsustain = \"400ms\"\ncooldown = \"800ms\"\n",
            dir.path().join("state.json")
        ))
        .unwrap();
        let ms = Duration::from_millis;
        let (rx, tx) = crate::psi_trigger::tests::urgent();
        let sampler = Sampler::open(&psi, &mem).unwrap();
        let mut ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::Full, true);
        let origin = std::time::Instant::now();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // (when, pressure): calm at full, over (two steps down), calm (two steps
                // up, back at full), over again.
                for (at, p) in [(1000, 60.0), (2500, 0.0), (4500, 60.0)] {
                    std::thread::sleep(ms(at).saturating_sub(origin.elapsed()));
                    write_psi(p);
                    if p >= 40.0 && trigger {
                        crate::psi_trigger::tests::fire(&tx);
                    }
                }
            });
            runtime().unwrap().block_on(async {
                let mut pacer =
                    Pacer::with_safety(ms(100), ms(300), Duration::from_secs(60), trigger.then_some(rx), None).unwrap();
                let (mut steps, mut samples) = (vec![], 0);
                while origin.elapsed() < ms(5500) {
                    if pacer.next().await == Wake::Watchdog {
                        continue;
                    }
                    let t = origin.elapsed();
                    samples += 1;
                    if let Some(step) = ticker.tick(t).unwrap() {
                        ticker.state.step_ran(t, step.to); // a dry run's step: done
                        steps.push((t, step.direction, step.from, step.to));
                    }
                    pacer.after_sample(ticker.calm_at_top());
                }
                (steps, samples)
            })
        })
    }

    /// The same pressure, fed to `watch` asleep on a trigger and to `watch` polling:
    /// the same steps, in the same order, none later; the trigger path sleeps through
    /// the calm at `full`.
    #[test]
    fn trigger_and_polling_make_the_same_decisions() {
        let (polled, triggered) = std::thread::scope(|s| {
            let p = s.spawn(|| run_path(false));
            let t = s.spawn(|| run_path(true));
            (p.join().unwrap(), t.join().unwrap())
        });
        let kinds = |v: &[(Duration, Direction, Level, Level)]| v.iter().map(|s| (s.1, s.2, s.3)).collect::<Vec<_>>();
        use Level::*;
        let expected = [
            (Direction::Down, Full, ControlPlane),
            (Direction::Down, ControlPlane, EtcdOnly),
            (Direction::Up, EtcdOnly, ControlPlane),
            (Direction::Up, ControlPlane, Full),
            (Direction::Down, Full, ControlPlane),
        ];
        assert_eq!(kinds(&polled.0), expected, "polling: {:?}", polled.0);
        assert_eq!(kinds(&triggered.0), expected, "trigger: {:?}", triggered.0);
        for (p, t) in polled.0.iter().zip(&triggered.0) {
            // Within a period (100 ms) and some scheduling noise of each other.
            let gap = p.0.abs_diff(t.0);
            assert!(gap < Duration::from_millis(250), "polling at {:?}, trigger at {:?}", p.0, t.0);
        }
        // Polling samples about 55 times in 5.5 s; the trigger path sleeps through the
        // calm at full (0-1 s, and from about 4.1 s to 4.5 s) apart from the hold.
        assert!(polled.1 >= 45, "{} polling samples", polled.1);
        assert!(triggered.1 + 8 <= polled.1, "trigger path: {} samples, polling {}", triggered.1, polled.1);
    }
}
