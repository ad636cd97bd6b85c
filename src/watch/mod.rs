//! `watch`, the daemon: the loop at the edge that feeds samples to the core and runs
//! the steps it proposes. The per-sample work is [`ticker`]; where the core starts
//! from is [`start`]; a step is `step::run`; a step by hand is `hand`.
//!
//! The loop's clock is tokio's (`tokio::time::Instant`, `interval`), so a test with
//! paused time drives it (`watch_follows_a_hand_step_on_tokios_clock` below).

pub mod start;
pub mod ticker;

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::backend::{self, Backend};
use crate::cluster::StepEvent;
use crate::config::Config;
use crate::decide::Step;
use crate::level::Level;
use crate::metrics::{self, METRICS};
use crate::pressure::Sampler;
use crate::psi_trigger::{self, Cause, Pacer, Pacing, Wake};
use crate::runtime::{lock_memory, runtime};
use crate::step::{self, Outcome};
use start::{decide_start, NodeLabel, StartDecision};
pub use ticker::Ticker;

/// Whether `watch` acts, or only decides and logs (`--dry-run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The real actuator and cluster.
    Act,
    /// Touch neither k3s nor the cluster, and publish no state.
    DryRun,
}

pub fn run(cfg: &Config, mode: Mode) -> anyhow::Result<ExitCode> {
    // Open the files first: no PSI means stop at once (docs/behaviour.md, "Pressure").
    let sampler = Sampler::open(&cfg.pressure.source, &cfg.pressure.meminfo)?.needing(cfg.pressure.needs());
    lock_memory();
    runtime()?.block_on(async {
        if let Some(addr) = cfg.metrics.listen {
            // Bound before anything else, so a busy address stops watch at once.
            let listener = metrics::bind(addr)?;
            // Healthy while samples keep coming: three periods, and slack for a slow one.
            let max_age = cfg.pressure.sample_period.0 * 3 + Duration::from_secs(10);
            tokio::spawn(metrics::serve(listener, &METRICS, max_age));
            tracing::info!(listen = %addr, "serving Prometheus metrics on /metrics and health on /healthz");
        }
        let backend = match mode {
            Mode::DryRun => backend::dry_run(cfg).await,
            Mode::Act => backend::real(cfg).await?,
        };
        let mut watcher = Watcher::new(cfg, backend, sampler, mode).await?;
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        watcher
            .run_until(async {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            })
            .await?;
        Ok(ExitCode::SUCCESS)
    })
}

struct Watcher<'a> {
    cfg: &'a Config,
    backend: Backend,
    ticker: Ticker,
    origin: Instant,
    mode: Mode,
    /// The Node's marks may not match the level (a step failed, or marking did): they
    /// are put right on the following samples until that succeeds.
    marks_pending: bool,
    /// When the actuator's level was last read, and what it said. A hand step changes
    /// it behind the core. (The core's level can differ from it on purpose: after a
    /// reboot at `control-plane`, see [`start`].)
    level_checked: Instant,
    actuator_level: Level,
    /// Samples every `sample_period`, or sleeps on the PSI trigger when calm at the top.
    pacer: Pacer,
}

/// How often `watch` re-reads the level, to notice a hand step (`regrade step`).
const LEVEL_CHECK_EVERY: Duration = Duration::from_secs(60);

impl<'a> Watcher<'a> {
    async fn new(cfg: &'a Config, mut backend: Backend, sampler: Sampler, mode: Mode) -> anyhow::Result<Watcher<'a>> {
        if let Some(d) = backend.actuator.disagreement().await {
            tracing::warn!(disagreement = %d, "k3s's level and regrade's file disagree; converging");
        }
        backend.actuator.reconcile(backend.cluster.as_ref()).await.context("converging at start")?;
        let levels = backend.actuator.levels().to_vec();
        let actuator_level = backend.actuator.current_level().await.context("reading the current level")?;
        let (mut level, mut marks_pending) = (actuator_level, false);
        if mode == Mode::Act {
            let decision = start_level(&backend, &cfg.levels, actuator_level).await;
            (level, marks_pending) = (decision.level(actuator_level), decision.marks_pending());
            backend.cluster.disconnect();
        }
        let (trigger, described) =
            psi_trigger::arm_for_watch(&cfg.pressure.source, cfg.pressure.metric, cfg.pressure.threshold);
        let mut ticker = Ticker::new(cfg, sampler, levels, level, mode);
        let period = cfg.pressure.sample_period.0;
        let pacer = Pacer::new(period, psi_trigger::HOLD_AFTER_FIRE, trigger, ticker.notifier.watchdog_period())
            .context("setting up the PSI trigger's wait")?;
        tracing::info!(
            level = %level, dry_run = mode == Mode::DryRun, pacing = %pacer.mode(), trigger = %described,
            "regrade watch starting"
        );
        say_what_is_read(cfg, mode);
        ticker.set_pacing(pacer.mode(), Some(&described));
        Ok(Watcher {
            cfg,
            backend,
            ticker,
            origin: Instant::now(),
            mode,
            marks_pending,
            level_checked: Instant::now(),
            actuator_level,
            pacer,
        })
    }

    /// Samples every `pressure.sample_period` until `shutdown` completes (a signal).
    async fn run_until(&mut self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        tokio::pin!(shutdown);
        let mut ready = false;
        loop {
            let wake = tokio::select! {
                w = self.pacer.next() => w,
                _ = &mut shutdown => break,
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
            if self.mode == Mode::Act {
                if proposed.is_some() || self.level_checked.elapsed() >= LEVEL_CHECK_EVERY {
                    self.follow_hand_steps(t).await;
                }
                if self.marks_pending {
                    self.put_marks_right().await;
                }
            }
            // A hand step just noticed may have made the proposal stale.
            if let Some(step) = proposed.filter(|s| s.from == self.ticker.state.level) {
                self.step(t, &step).await;
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
        Ok(())
    }

    /// Runs the step the core proposed and feeds its outcome back.
    async fn step(&mut self, t: Duration, step: &Step) {
        // The step first, then the hold: the switch-time check writes its hold first,
        // then reads this, so one of the two always sees the other.
        self.ticker.set_stepping(Some(step.to));
        let outcome = match self.switch_hold() {
            Some(refusal) => Outcome::Refused(refusal),
            None => self.run_step(step).await,
        };
        self.ticker.set_stepping(None);
        self.marks_pending |= matches!(outcome, Outcome::Failed { .. });
        if let Some(level) = outcome.level_after(step) {
            self.actuator_level = level;
        }
        if let (true, Outcome::Refused(r)) = (self.ticker.settle(t, step, &outcome), &outcome) {
            self.backend.cluster.record(StepEvent::Refused(step, r)).await;
        }
        if !self.marks_pending {
            self.backend.cluster.disconnect();
        }
    }

    /// A hold left by the NixOS switch-time check (`crate::hold`): no step starts while
    /// it is active. A file that is not a hold is ignored, with a warning.
    fn switch_hold(&self) -> Option<crate::cluster::Refusal> {
        if self.mode != Mode::Act {
            return None;
        }
        let path = crate::hold::path_for(&self.cfg.state_file);
        match crate::hold::read(&path, std::time::SystemTime::now()) {
            crate::hold::Hold::Active { until, left } => Some(crate::cluster::Refusal {
                kind: crate::cluster::RefusalKind::SwitchHold,
                subject: path.display().to_string(),
                message: format!(
                    "a NixOS switch is turning regrade off: no step until Unix time {until} ({}s left, hold {})",
                    left.as_secs(),
                    path.display()
                ),
            }),
            crate::hold::Hold::Ignored(why) => {
                tracing::warn!(path = %path.display(), "ignoring the switch hold: {why}");
                None
            }
            crate::hold::Hold::None => None,
        }
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
        let Backend { actuator, cluster, etcd } = &mut self.backend;
        let fut = step::run(step, actuator.as_mut(), cluster.as_ref(), etcd.as_ref(), &self.cfg.levels);
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

/// Reads the Node's level label and decides where to start ([`start`]), saying so.
async fn start_level(backend: &Backend, levels: &crate::levels::LevelsConfig, actual: Level) -> StartDecision {
    let label = match backend.cluster.node_level().await {
        Ok(label) => NodeLabel::Read(label),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "could not read the Node's level at start; going on from the actuator's");
            NodeLabel::Unreadable
        }
    };
    let decision = decide_start(label, actual, levels);
    match decision {
        StartDecision::Actuator => {}
        StartDecision::AdoptLabel(labelled) => {
            tracing::info!(level = %labelled, k3s = %actual, "the Node is labelled with a level k3s runs as; carrying on from it")
        }
        StartDecision::CorrectNode { label } => {
            tracing::warn!(label = %label, level = %actual, "the Node's label does not match how k3s runs; correcting the Node")
        }
    }
    decision
}

/// Says at start, in words, what `watch` reads, from where, and how it decides.
fn say_what_is_read(cfg: &Config, mode: Mode) {
    let p = &cfg.pressure;
    let metric = p.metric.as_str();
    let (over, calm) = match p.mem_available_floor {
        Some(f) => (
            format!("{metric} >= {}% and MemAvailable below {} MiB", p.threshold, f.0 >> 20),
            format!("{metric} below {}% and MemAvailable at least {} MiB", cfg.calm_threshold(), f.0 >> 20),
        ),
        None => (format!("{metric} >= {}%", p.threshold), format!("{metric} below {}%", cfg.calm_threshold())),
    };
    tracing::info!(
        "reading memory pressure from {} and MemAvailable from {} every {}: over when {over}, calm when {calm}; \
         a step after {} of either, {} apart at least",
        p.source.display(),
        p.meminfo.display(),
        crate::units::format_duration(p.sample_period.0),
        crate::units::format_duration(p.sustain.0),
        crate::units::format_duration(p.cooldown.0),
    );
    if mode == Mode::DryRun {
        tracing::info!("dry run: steps are logged, and neither k3s nor the cluster is touched");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeActuator, FakeCluster};

    fn fixture(dir: &std::path::Path) -> (Config, Sampler) {
        let (psi, mem) = (dir.join("psi"), dir.join("meminfo"));
        std::fs::write(&psi, "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n").unwrap();
        std::fs::write(&mem, "MemAvailable: 1000000 kB\n").unwrap();
        let cfg = Config::parse(&format!(
            "state_file = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\n",
            dir.join("state.json")
        ))
        .unwrap();
        let sampler = Sampler::open(&psi, &mem).unwrap();
        (cfg, sampler)
    }

    /// An actuator whose level the test changes behind the watcher's back, and a Node
    /// labelled `control-plane`.
    fn backend(level: Level) -> (Backend, std::rc::Rc<std::cell::Cell<Level>>) {
        let actuator = FakeActuator::at(level);
        let shared = actuator.level.clone();
        let cluster = FakeCluster { node_level: Ok(Some(Level::ControlPlane)), ..Default::default() };
        (
            Backend {
                actuator: Box::new(actuator),
                cluster: Box::new(cluster),
                etcd: Box::new(crate::etcd::NoRestartGate),
            },
            shared,
        )
    }

    /// The NixOS switch-time check's hold: while it is active a proposed step is refused
    /// (kind `switch-hold`) before the actuator is touched; once it is gone the step runs.
    #[test]
    fn a_switch_hold_refuses_a_step_until_it_is_gone() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        let actuator = FakeActuator::at(Level::Full);
        let level = actuator.level.clone();
        let backend = Backend {
            actuator: Box::new(actuator),
            cluster: Box::new(FakeCluster::default()),
            etcd: Box::new(crate::etcd::NoRestartGate),
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let hold = dir.path().join("switch-hold");
        std::fs::write(&hold, format!("{}\n# held by the test\n", now + 300)).unwrap();
        let down = Step { direction: crate::decide::Direction::Down, from: Level::Full, to: Level::ControlPlane };
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            w.step(Duration::from_secs(60), &down).await;
            assert_eq!(level.get(), Level::Full, "a held step must not reach the actuator");
            let state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
            assert_eq!(state["refusal"]["kind"], "switch-hold", "{state}");
            assert!(state["refusal"]["message"].as_str().unwrap().contains("a NixOS switch is turning regrade off"));
            assert!(state.get("stepping").is_none(), "no step is under way once it was refused: {state}");
            std::fs::remove_file(&hold).unwrap();
            w.step(Duration::from_secs(120), &down).await;
            assert_eq!(level.get(), Level::ControlPlane, "without the hold the step runs");
        });
    }

    #[test]
    fn watch_follows_a_hand_step_but_keeps_a_level_adopted_from_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        let (backend, level) = backend(Level::Full);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.ticker.state.level, Level::ControlPlane, "adopted from the Node after a reboot");
            w.follow_hand_steps(Duration::from_secs(60)).await;
            assert_eq!(w.ticker.state.level, Level::ControlPlane, "the actuator did not change: nothing to follow");
            level.set(Level::EtcdOnly); // `regrade step down` by hand
            w.follow_hand_steps(Duration::from_secs(120)).await;
            assert_eq!(w.ticker.state.level, Level::EtcdOnly);
            assert_eq!(w.ticker.state.last_step, Some(Duration::from_secs(120)), "a hand step starts the cooldown");
        });
    }

    /// The loop runs on tokio's clock: with time paused, 75 s of sampling pass at once,
    /// and the hand step made at 30 s is followed at the first level check, 60 s in.
    #[test]
    fn watch_follows_a_hand_step_on_tokios_clock() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        let (backend, level) = backend(Level::ControlPlane);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            let started = Instant::now();
            w.run_until(async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                level.set(Level::EtcdOnly); // `regrade step down` by hand
                tokio::time::sleep(Duration::from_secs(45)).await;
            })
            .await
            .unwrap();
            assert_eq!(started.elapsed(), Duration::from_secs(75), "paused time advanced by the sleeps alone");
            assert_eq!(w.ticker.state.level, Level::EtcdOnly);
            // Samples every 5 s from 0; the first at or after 60 s since start checks.
            assert_eq!(w.ticker.state.last_step, Some(Duration::from_secs(60)));
        });
    }

    use crate::decide::Direction;

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
        let mut ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::Full, Mode::DryRun);
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
