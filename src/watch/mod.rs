//! `watch`, the daemon: the loop at the edge that feeds samples to the core and runs
//! the steps it proposes. The per-sample work is [`ticker`]; where the core starts
//! from is the level record ([`crate::level_keeper::start`]); a step is `step::run`;
//! a step by hand is `hand`.
//!
//! The loop's clock is tokio's (`tokio::time::Instant`, `interval`), so a test with
//! paused time drives it (`watch_follows_a_hand_step_on_tokios_clock` below).

pub mod looks;
mod members;
pub mod ticker;
mod weighing;

use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::backend::{self, Backend};
use crate::cluster::StepEvent;
use crate::config::Config;
use crate::decide::{MemberSignals, Step};
use crate::level::Level;
use crate::level_keeper::{self, Backoff, Keeper, Pending};
use crate::level_record::LevelRecord;
use crate::metrics::{self, METRICS};
use crate::own_time::StepClock;
use crate::pressure::Sampler;
use crate::psi_trigger::{self, Cause, Pacer, Wake};
use crate::runtime::{runtime, shed_start_up_code};
use crate::sample::Pacing;
use crate::step::{self, Outcome};
use members::MemberLearning;
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
    let sampler = Sampler::for_config(&cfg.pressure)?;
    shed_start_up_code();
    runtime()?.block_on(async {
        let listener = match cfg.metrics.listen {
            // Bound before anything else, so a busy address stops watch at once.
            Some(addr) => Some((addr, metrics::bind(addr)?)),
            None => None,
        };
        // Its own task: a hung etcd stalls only its looks, never a sample.
        let looks = looks_for(cfg, mode)?;
        if let Some((addr, listener)) = listener {
            // Healthy while samples keep coming: three periods, and slack for a slow one.
            let polling = cfg.pressure.sample_period.0 * 3 + Duration::from_secs(10);
            let max_age = metrics::MaxSampleAge { polling, on_trigger: psi_trigger::SAFETY_TIMEOUT + polling };
            // A scrape asks for a look (calm, nothing else looks); a hung member is
            // waited for two requests' bounds at most.
            let on_scrape = looks.on_scrape(cfg.etcd.request_timeout.0 * 2 + Duration::from_secs(1));
            tokio::spawn(metrics::serve_asking(listener, &METRICS, max_age, Some(on_scrape)));
            tracing::info!(listen = %addr, "serving Prometheus metrics on /metrics and health on /healthz");
        }
        let backend = match mode {
            Mode::DryRun => backend::dry_run(cfg).await,
            Mode::Act => backend::real(cfg).await?,
        };
        let mut watcher = Watcher::new(cfg, backend, sampler, mode).await?;
        watcher.looks = Some(looks);
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        watcher
            .run_until(async {
                tokio::select! {
                    biased;
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            })
            .await?;
        Ok(ExitCode::SUCCESS)
    })
}

/// The looking task `watch` runs beside its samples (`looks`): the local etcd member,
/// if `etcd.metrics_url` is set, and the host's units, if `census.slice` is.
fn looks_for(cfg: &Config, mode: Mode) -> anyhow::Result<looks::Looks> {
    let state_file = (mode == Mode::Act).then(|| cfg.state_file.clone());
    let member = match cfg.etcd.metrics_url() {
        Some(url) => Some(crate::etcd::member::Looker::new(url?, cfg.etcd.request_timeout.0, state_file.clone())),
        None => None,
    };
    let units = cfg.census.slice().map(|s| crate::census::Reader::new(s.to_path_buf(), state_file));
    Ok(looks::Looks::spawn(cfg.etcd.metrics_interval.0, looks::Looking { member, units }))
}

/// The daemon loop over a given backend until `shutdown`, as `run` runs it: for the
/// deterministic simulator (tests/testsuite/simulator.rs), which gives each simulated server its
/// own files and a simulated cluster, etcd and k3s.
#[cfg(any(test, feature = "testing"))]
pub async fn run_with(
    cfg: &Config,
    backend: Backend,
    sampler: Sampler,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    Watcher::new(cfg, backend, sampler, Mode::Act).await?.run_until(shutdown).await
}

struct Watcher<'a> {
    cfg: &'a Config,
    backend: Backend,
    ticker: Ticker,
    origin: Instant,
    mode: Mode,
    /// The level record (docs/level-record.md): the level held, a step under way.
    keeper: Keeper,
    /// What the start-up decision, or a step, left to do: the Node's marks to put
    /// right, an interrupted step to finish. Retried with `backoff` until done; a
    /// calm, consistent server has nothing pending and makes no API request.
    pending: Pending,
    backoff: Backoff,
    /// When the level record was last re-read, to notice a hand step (`regrade step`
    /// writes it too).
    level_checked: Instant,
    /// Samples every `sample_period`, or sleeps on the PSI trigger when calm at the top.
    pacer: Pacer,
    /// The etcd members, learned while calm for the restarts that come under pressure.
    members: MemberLearning,
    /// The local member's signals now, for the step into `etcd-only`'s cost: its last
    /// look if fresh (`etcd::member::fresh_signals`).
    member_signals: Box<dyn Fn() -> MemberSignals>,
    /// Told after each sample whether `watch` is pressed: it looks at the etcd member
    /// only then (and when a scrape asks). `None`: nothing to look at (the simulator).
    looks: Option<looks::Looks>,
}

/// How long the watchdog is fed through one API call of convergence (or a refusal's
/// Event): tried at each endpoint with `cluster.request_timeout`, conflicts retried
/// for 30 s, it ends well within this; past it, it is stuck.
const API_CALL_BOUND: Duration = Duration::from_secs(180);

/// How often `watch` re-reads the level record, to notice a hand step.
const LEVEL_CHECK_EVERY: Duration = Duration::from_secs(60);

impl<'a> Watcher<'a> {
    async fn new(cfg: &'a Config, mut backend: Backend, sampler: Sampler, mode: Mode) -> anyhow::Result<Watcher<'a>> {
        let dry_run = mode == Mode::DryRun;
        let memory = sampler.memory_source();
        let levels = backend.actuator.levels().to_vec();
        let (keeper, pending) = if dry_run {
            let level = backend.actuator.current_level().await.context("reading the current level")?;
            (
                Keeper::new(None, LevelRecord::at(level, level_keeper::keys(cfg)), level_keeper::keys(cfg)),
                Pending::Nothing,
            )
        } else {
            match level_keeper::StepLock::try_take(&cfg.level_record)? {
                Ok(_lock) => {
                    // The one read of the Node a calm start makes; then no request while calm.
                    let marks = level_keeper::read_marks(backend.cluster.as_ref()).await;
                    let st = level_keeper::start(cfg, backend.actuator.as_mut(), marks)
                        .await
                        .context("converging at start")?;
                    backend.cluster.disconnect();
                    if let Pending::Resume(step) = &st.pending {
                        tracing::info!(from = %step.from, to = %step.to, "an interrupted step is to be finished first");
                    }
                    (st.keeper, st.pending)
                }
                Err(busy) => {
                    // A hand step is under way: its record is not ours to judge yet.
                    // Start from what it says, and decide once the lock is free.
                    tracing::info!("{busy}: deciding from the level record once it is done");
                    let keys = level_keeper::keys(cfg);
                    let record = match LevelRecord::read(&cfg.level_record) {
                        Ok(Some(r)) => r,
                        _ => LevelRecord::at(
                            backend.actuator.current_level().await.context("reading the current level")?,
                            keys.clone(),
                        ),
                    };
                    (Keeper::new(Some(cfg.level_record.clone()), record, keys), Pending::Adopt)
                }
            }
        };
        let level = match &pending {
            Pending::Resume(s) => s.from,
            _ => keeper.level(),
        };
        let (trigger, described) =
            psi_trigger::arm_for_watch(&cfg.pressure.source, cfg.pressure.metric, cfg.pressure.threshold);
        let mut ticker = Ticker::new(cfg, sampler, levels, level, mode);
        let period = cfg.pressure.sample_period.0;
        let armed = trigger.is_some();
        let mut pacer = Pacer::new(period, psi_trigger::HOLD_AFTER_FIRE, trigger, ticker.notifier.watchdog_period())
            .context("setting up the PSI trigger's wait")?;
        if armed {
            // A trigger that was armed once is armed again after it is lost (a
            // cgroup removed and made again).
            let (source, spec) = (
                cfg.pressure.source.clone(),
                psi_trigger::Spec::for_threshold(cfg.pressure.metric, cfg.pressure.threshold),
            );
            pacer = pacer.rearming(psi_trigger::REARM_EVERY, move || {
                psi_trigger::Trigger::arm(&source, spec).ok().map(psi_trigger::Trigger::into_fd)
            });
        }
        tracing::info!(
            level = %level, dry_run, pacing = %pacer.mode(), trigger = %described,
            "regrade watch starting"
        );
        say_what_is_read(cfg, mode, &memory);
        ticker.set_pacing(pacer.mode(), Some(&described));
        Ok(Watcher {
            cfg,
            backend,
            ticker,
            origin: Instant::now(),
            mode,
            keeper,
            pending,
            backoff: Backoff::now(),
            level_checked: Instant::now(),
            pacer,
            members: if dry_run { MemberLearning::never() } else { MemberLearning::at_once() },
            member_signals: {
                let max_age = cfg.etcd.member_look_max_age();
                Box::new(move || crate::etcd::member::fresh_signals(max_age))
            },
            looks: None,
        })
    }

    /// Samples every `pressure.sample_period` until `shutdown` completes (a signal).
    async fn run_until(&mut self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        tokio::pin!(shutdown);
        let mut ready = false;
        loop {
            // The etcd members are learned while calm: at the first calm sample, and a
            // minute after a failed look, also while asleep on the trigger (a k3s still
            // starting at boot must not leave them unknown for days of calm).
            let learn = self.ticker.calm() && self.pending == Pending::Nothing;
            let wake = tokio::select! {
                biased;
                w = self.pacer.next() => w,
                _ = &mut shutdown => break,
                _ = self.members.looks_due(), if learn => {
                    let look = self.members.try_now(self.backend.etcd.as_ref());
                    self.ticker.notifier.pinging(API_CALL_BOUND, look).await;
                    continue;
                }
            };
            match wake {
                Wake::Watchdog => {
                    // Asleep on the trigger under systemd: a ping and nothing else.
                    self.ticker.notifier.watchdog();
                    continue;
                }
                Wake::Sample(Cause::TriggerLost) => {
                    self.ticker
                        .set_pacing(Pacing::Polling, Some("none: the trigger was lost; arming it again every minute"));
                }
                Wake::Sample(Cause::Fired) => {
                    tracing::info!(pacing = %Pacing::Polling, "the PSI trigger fired; sampling every sample_period");
                    self.ticker.set_pacing(Pacing::Polling, None);
                }
                Wake::Sample(_) => {}
            }
            let t = self.origin.elapsed();
            let proposed = self.ticker.tick(t)?;
            // A step's clock starts at its decision: what comes before `step::run` (the
            // level record's check, the step lock) is the step's too.
            let clock = proposed.as_ref().map(|_| StepClock::start());
            if !ready && self.ticker.good_samples > 0 {
                // READY after the first good sample: the files are there and parse.
                self.ticker.notifier.ready();
                ready = true;
            }
            if self.mode == Mode::Act {
                if proposed.is_some() || self.level_checked.elapsed() >= LEVEL_CHECK_EVERY {
                    self.follow_hand_steps();
                }
                if self.pending != Pending::Nothing && self.backoff.due() {
                    self.converge(t).await;
                }
            }
            // A hand step just noticed may have made the proposal stale; an interrupted
            // step is finished before any other.
            let resuming = matches!(self.pending, Pending::Resume(_));
            let proposed = proposed.filter(|s| s.from == self.ticker.state.level && !resuming);
            if let (Some(step), Some(clock)) = (proposed, clock) {
                self.step(t, &step, &clock).await;
            }
            let calm = self.ticker.calm_at_top() && self.pending == Pending::Nothing;
            let pacing = self.pacer.after_sample(calm);
            if let Some(looks) = &self.looks {
                looks.set_pressed(!self.pacer.resting());
            }
            if let Some(pacing) = pacing {
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

    /// Runs the step the core proposed and feeds its outcome back. Only under the step
    /// lock, and only from the record this process holds: if another process wrote
    /// the record meanwhile, the proposal is stale and the loop decides again first.
    async fn step(&mut self, t: Duration, step: &Step, clock: &StepClock) {
        if let Some(whose) = crate::census::recent_summary(self.cfg.etcd.member_look_max_age()) {
            tracing::info!(from = %step.from, to = %step.to, "whose memory, as the step is decided: {whose}");
        }
        // The step first, then the hold: the switch-time check writes its hold first,
        // then reads this, so one of the two always sees the other.
        self.ticker.set_stepping(Some(step.to));
        let outcome = match self.etcd_only_held(step).or_else(|| self.switch_hold()) {
            Some(refusal) => Outcome::Refused(refusal),
            None => match self.keeper.lock_steps() {
                Ok(Ok(_lock)) if self.keeper.moved_on_disk() => {
                    self.ticker.set_stepping(None);
                    self.decide_again();
                    return;
                }
                Ok(Ok(_lock)) => self.run_step(step, false, clock).await,
                Ok(Err(busy)) => Outcome::Refused(busy_refusal(&busy)),
                Err(error) => Outcome::Failed { level: step.from, error: error.context("nothing was changed") },
            },
        };
        self.ticker.set_stepping(None);
        self.after_step(&outcome);
        if let (true, Outcome::Refused(r)) = (self.ticker.settle(t, step, &outcome), &outcome) {
            self.ticker
                .notifier
                .pinging(API_CALL_BOUND, self.backend.cluster.record(StepEvent::Refused(step, r)))
                .await;
        }
        if self.pending == Pending::Nothing {
            self.backend.cluster.disconnect();
        }
    }

    /// The record on disk is not the one this process holds (a hand step ended, or
    /// was killed mid-step): what is pending and the level are decided again from it,
    /// under the step lock, by the next convergence.
    fn decide_again(&mut self) {
        if self.pending != Pending::Adopt {
            tracing::info!(
                was = %self.keeper.level(),
                "the level record was changed by another process (a hand step?); deciding again from it"
            );
            // Already deciding again: the backoff of its failed tries stands.
            self.pending = Pending::Adopt;
            self.backoff = Backoff::now();
        }
    }

    /// After a step: marks whose outcome at the API is unknown, or that a failed step
    /// may have left wrong, are reconciled from the next sample on.
    fn after_step(&mut self, outcome: &Outcome) {
        if let Some(undoing) = self.keeper.unfinished_undoing() {
            // A rollback past the deadline could not restart k3s: finished under the
            // Lease, as after a crash.
            tracing::warn!(from = %undoing.from, to = %undoing.to, "the step's undoing is to be finished");
            self.pending = Pending::Resume(undoing);
            self.backoff = Backoff::now();
        } else if self.keeper.marks_unsure.replace(false) || matches!(outcome, Outcome::Failed { .. }) {
            self.pending = Pending::Marks;
            self.backoff = Backoff::now();
        }
    }

    /// The step into `etcd-only` weighed against its cost at its decision, with the
    /// local member's last look if it is fresh (three looks' worth).
    fn etcd_only_held(&self, step: &Step) -> Option<crate::cluster::Refusal> {
        self.ticker.etcd_only_held(step, &self.cfg.etcd.etcd_only_cost(), &(self.member_signals)())
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

    /// A hand step (`regrade step`) moves the level record behind the core, and one
    /// killed mid-step leaves its step in it: either way the record is decided again
    /// (a level reached by hand is adopted as a step that ran now; a step left
    /// half-done is finished or rolled back under the Lease).
    fn follow_hand_steps(&mut self) {
        self.level_checked = Instant::now();
        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
    }

    /// One try at what is pending; on failure the next try waits (backoff). The API
    /// calls ping the watchdog while they run (each tries every endpoint in turn).
    async fn converge(&mut self, t: Duration) {
        if self.pending == Pending::Nothing {
            return;
        }
        // One process acts on this server at a time, from the record on disk.
        let _lock = match self.keeper.lock_steps() {
            Ok(Ok(lock)) => lock,
            Ok(Err(busy)) => return self.retry_later(&anyhow::anyhow!("{busy}")),
            Err(e) => return self.retry_later(&e),
        };
        if self.keeper.moved_on_disk() {
            self.decide_again();
        }
        let notifier = &self.ticker.notifier;
        match self.pending.clone() {
            Pending::Nothing => {}
            Pending::Adopt => match notifier.pinging(API_CALL_BOUND, self.backend.cluster.node_level()).await {
                Ok(label) => {
                    // Decide again, now that the Node has been read.
                    let marks = crate::level_record::Marks::Level(label.unwrap_or(Level::Full));
                    let start = level_keeper::start(self.cfg, self.backend.actuator.as_mut(), marks);
                    match notifier.pinging(API_CALL_BOUND, start).await {
                        Ok(st) => {
                            if st.level() != self.ticker.state.level {
                                // Reached by another process (or said by the Node at a
                                // start without a record): a step that ran now, so the
                                // cooldown and fresh streaks apply from it.
                                tracing::info!(level = %st.level(), was = %self.ticker.state.level, "carrying on from the level the record and the Node say");
                                self.ticker.state.step_ran(t, st.level());
                                self.ticker.mark_dirty();
                            }
                            self.keeper = st.keeper;
                            self.pending = st.pending;
                            self.backoff = Backoff::now();
                        }
                        Err(e) => self.retry_later(&e),
                    }
                }
                Err(e) => self.retry_later(&e),
            },
            Pending::Marks => {
                let level = self.keeper.level();
                match notifier.pinging(API_CALL_BOUND, self.backend.cluster.mark_node(level, &self.cfg.levels)).await {
                    Ok(()) => {
                        tracing::info!(level = %level, "the Node's marks match the level");
                        self.pending = Pending::Nothing;
                        self.backoff = Backoff::now();
                        self.backend.cluster.disconnect();
                    }
                    Err(e) => self.retry_later(&e),
                }
            }
            Pending::Resume(step) => {
                tracing::info!(from = %step.from, to = %step.to, "finishing the interrupted step");
                let outcome = self.run_step(&step, true, &StepClock::start()).await;
                match &outcome {
                    Outcome::Refused(r) => {
                        let e = anyhow::anyhow!("the interrupted step {} -> {} was refused: {r}", step.from, step.to);
                        self.retry_later(&e);
                        return;
                    }
                    Outcome::Done | Outcome::Failed { .. } => {
                        self.pending = Pending::Nothing;
                        self.backoff = Backoff::now();
                    }
                }
                self.after_step(&outcome);
                self.ticker.settle(t, &step, &outcome);
            }
        }
    }

    fn retry_later(&mut self, e: &anyhow::Error) {
        let wait = self.backoff.failed();
        tracing::warn!(error = %format!("{e:#}"), pending = ?self.pending, retry_in = ?wait, "could not converge yet; retrying");
    }

    /// Runs a step, pinging the watchdog meanwhile: a restart can outlast WatchdogSec.
    async fn run_step(&mut self, step: &Step, resume: bool, clock: &StepClock) -> Outcome {
        let Backend { actuator, cluster, etcd } = &mut self.backend;
        let weighing = weighing::WeighingGate {
            gate: etcd.as_ref(),
            ticker: &self.ticker,
            pressure: &self.cfg.pressure,
            cost: self.cfg.etcd.etcd_only_cost(),
            member: &self.member_signals,
            health: self.cfg.etcd.metrics_url().and_then(Result::ok).map(|u| (u, self.cfg.etcd.request_timeout.0)),
        };
        let (a, c, e, l, k) = (actuator.as_mut(), cluster.as_ref(), &weighing, &self.cfg.levels, &self.keeper);
        let fut = async move {
            if resume {
                step::resume(step, a, c, e, l, k, clock).await
            } else {
                step::run(step, a, c, e, l, k, clock).await
            }
        };
        self.ticker.notifier.pinging(step::bound(&self.cfg.levels), fut).await
    }
}

/// The refusal a step meets while another process holds the step lock.
fn busy_refusal(busy: &level_keeper::Busy) -> crate::cluster::Refusal {
    crate::cluster::Refusal {
        kind: crate::cluster::RefusalKind::LeaseHeld,
        subject: busy.path.display().to_string(),
        message: format!("{busy}: no step until it is done"),
    }
}

/// Says at start, in words, what `watch` reads, from where, and how it decides.
fn say_what_is_read(cfg: &Config, mode: Mode, memory: &str) {
    let p = &cfg.pressure;
    let metric = p.metric.as_str();
    let (over, calm) = match p.mem_available_floor {
        Some(f) => (
            format!(
                "{metric} >= {}% and available memory below {} MiB{}",
                p.threshold,
                f.0 >> 20,
                if cfg.etcd.distress_overrides_floor && cfg.etcd.metrics_url().is_some() {
                    " (or the local etcd member in distress)"
                } else {
                    ""
                }
            ),
            format!("{metric} below {}% and available memory at least {} MiB", cfg.calm_threshold(), f.0 >> 20),
        ),
        None => (format!("{metric} >= {}%", p.threshold), format!("{metric} below {}%", cfg.calm_threshold())),
    };
    tracing::info!(
        "reading memory pressure from {} and available memory as {memory} every {}: over when {over}, \
         calm when {calm}; a step after {} of either, {} apart at least",
        p.source.display(),
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
    use crate::level_record::{Phase, StepInProgress};
    use crate::runtime::runtime;
    use crate::testing::{FakeActuator, FakeCluster};
    use std::rc::Rc;

    fn fixture(dir: &std::path::Path) -> (Config, Sampler) {
        let (psi, mem) = (dir.join("psi"), dir.join("meminfo"));
        std::fs::write(&psi, "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n").unwrap();
        std::fs::write(&mem, "MemAvailable: 1000000 kB\n").unwrap();
        let cfg = Config::parse(&format!(
            "state_file = {:?}\nlevel_record = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\n",
            dir.join("state.json"),
            dir.join("level.json"),
        ))
        .unwrap();
        (cfg, Sampler::open(&psi, &mem).unwrap())
    }

    fn record(cfg: &Config, level: Level, step: Option<(Level, Level, Phase)>) {
        let mut r = LevelRecord::at(level, level_keeper::keys(cfg));
        r.step = step.map(|(from, to, phase)| StepInProgress { from, to, phase, started: 0 });
        r.write(&cfg.level_record).unwrap();
    }

    fn on_disk(cfg: &Config) -> LevelRecord {
        LevelRecord::read(&cfg.level_record).unwrap().unwrap()
    }

    /// Was: the API unreachable at start, the core sat at the actuator's `full` and
    /// nothing read the label again (issue 10, scenario 2). Now the level record on
    /// disk says control-plane through the reboot, and the marks are reconciled once
    /// the API answers.
    #[test]
    fn after_a_reboot_at_control_plane_with_the_api_unreachable_the_level_holds_and_marks_follow() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::ControlPlane, None);
        // k3s started from an absent drop-in after the reboot: full's flags.
        let node = FakeCluster::labelled(Err("every endpoint timed out"));
        let label = node.label.clone();
        let (backend, _) = backend_with(Level::Full, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.ticker.state.level, Level::ControlPlane, "the record's level, not the actuator's full");
            assert_eq!(w.pending, Pending::Marks);
            w.converge(Duration::from_secs(5)).await;
            assert_eq!(w.pending, Pending::Marks, "still unreachable: retried later");
            assert!(!w.backoff.due(), "with backoff");
            // The API answers again, the Node was unlabelled meanwhile by someone.
            *label.borrow_mut() = Ok(None);
            w.converge(Duration::from_secs(10)).await;
            assert_eq!(*label.borrow(), Ok(Some(Level::ControlPlane)), "marked again");
            assert_eq!(w.pending, Pending::Nothing);
            assert_eq!(on_disk(&cfg).level, Level::ControlPlane);
        });
    }

    /// Was: killed during a step up etcd-only -> control-plane, the etcd-only label was
    /// "corrected" to full at restart — two levels, without the Lease (issue 10,
    /// scenario 5). Now the interrupted step is finished, one level, under the Lease.
    #[test]
    fn killed_during_a_step_up_the_step_is_finished_not_corrected_to_full() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::EtcdOnly, Some((Level::EtcdOnly, Level::ControlPlane, Phase::Restarting)));
        // k3s restarted from the removed drop-in: the hook recorded full.
        let log = crate::testing::Log::default();
        let node = FakeCluster { log: log.clone(), ..FakeCluster::labelled(Ok(Some(Level::EtcdOnly))) };
        let label = node.label.clone();
        let (backend, _) = backend_with(Level::Full, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.ticker.state.level, Level::EtcdOnly, "starts from the step's from, never full");
            let want = Step { direction: crate::decide::Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane };
            assert_eq!(w.pending, Pending::Resume(want));
            assert!(!log.take().iter().any(|c| c.starts_with("mark")), "nothing marked before the step is finished");
            w.converge(Duration::from_secs(5)).await;
            assert_eq!(w.ticker.state.level, Level::ControlPlane);
            let marks: Vec<String> = log.take().into_iter().filter(|c| c.starts_with("mark")).collect();
            assert_eq!(marks, ["mark control-plane"], "marked one level up, not full");
            assert_eq!(*label.borrow(), Ok(Some(Level::ControlPlane)));
            let r = on_disk(&cfg);
            assert_eq!((r.level, r.step), (Level::ControlPlane, None));
            assert_eq!(w.ticker.state.last_step, Some(Duration::from_secs(5)), "the finished step starts the cooldown");
        });
    }

    /// A step cut at its deadline whose rollback could not restart k3s (systemd did
    /// not answer): the undoing is pending, and the next convergence finishes it, one
    /// level back, under the Lease; the record ends settled at the step's `from`.
    #[test]
    fn a_rollback_left_unfinished_is_finished_by_convergence() {
        let dir = tempfile::tempdir().unwrap();
        let (mut cfg, sampler) = fixture(dir.path());
        cfg.levels.step_timeout = crate::units::HumanDuration(Duration::from_secs(60));
        record(&cfg, Level::ControlPlane, None);
        let log = crate::testing::Log::default();
        let actuator = FakeActuator {
            reports: &[Phase::Writing, Phase::Restarting],
            fail_roll_back: true,
            ..FakeActuator::at(Level::ControlPlane).logging_to(&log)
        };
        actuator.hangs.set(1);
        let level = actuator.level.clone();
        let node = FakeCluster { log: log.clone(), ..FakeCluster::labelled(Ok(Some(Level::ControlPlane))) };
        let backend = Backend {
            actuator: Box::new(actuator),
            cluster: Box::new(node),
            etcd: Box::new(crate::etcd::NoRestartGate),
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            let down =
                Step { direction: crate::decide::Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
            w.step(Duration::from_secs(60), &down, &StepClock::start()).await;
            let undo = Step { direction: crate::decide::Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane };
            assert_eq!(w.pending, Pending::Resume(undo));
            let s = on_disk(&cfg).step.expect("the undoing is recorded");
            assert_eq!((s.from, s.to, s.phase), (Level::EtcdOnly, Level::ControlPlane, Phase::Restarting));
            assert!(log.take().contains(&"roll back to control-plane: the bus did not answer".to_string()));
            w.converge(Duration::from_secs(200)).await;
            assert_eq!(w.pending, Pending::Nothing);
            assert_eq!(log.take()[..3], ["preflight", "acquire", "apply control-plane"], "under the Lease");
            assert_eq!(level.get(), Level::ControlPlane);
            let r = on_disk(&cfg);
            assert_eq!((r.level, r.step), (Level::ControlPlane, None));
        });
    }

    /// Was (issue 23, finding 3): an interrupted step left pending (its resume refused
    /// for a while) was re-run from memory after the operator had finished it by hand
    /// and gone back to full: control-plane -> etcd-only on a calm server at full. Now
    /// the record on disk is read again under the step lock, and decided from.
    #[test]
    fn a_pending_resume_is_dropped_when_the_record_moved_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::ControlPlane, Some((Level::ControlPlane, Level::EtcdOnly, Phase::Restarting)));
        let log = crate::testing::Log::default();
        let node = FakeCluster { log: log.clone(), ..FakeCluster::labelled(Ok(Some(Level::ControlPlane))) };
        let label = node.label.clone();
        let (backend, k3s) = backend_with(Level::EtcdOnly, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.pending, Pending::Resume(Step::between(Level::ControlPlane, Level::EtcdOnly)));
            // Meanwhile by hand: `regrade step` finished it, then `regrade step to full`.
            k3s.set(Level::Full);
            *label.borrow_mut() = Ok(None);
            record(&cfg, Level::Full, None);
            log.take();
            w.converge(Duration::from_secs(5)).await;
            w.converge(Duration::from_secs(6)).await;
            assert_eq!(k3s.get(), Level::Full, "no step was run from the stale memory: {:?}", log.take());
            assert_eq!((w.ticker.state.level, &w.pending), (Level::Full, &Pending::Nothing));
            assert_eq!(on_disk(&cfg), LevelRecord::at(Level::Full, level_keeper::keys(&cfg)));
        });
    }

    /// Was (issue 23, finding 6): marks pending after a reboot with the API down were
    /// put right from the level held in memory after a hand step to full had marked
    /// the Node: control-plane's marks again, and nothing pending to undo them. Now
    /// the moved record is decided again first.
    #[test]
    fn pending_marks_follow_the_record_on_disk_not_the_level_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::ControlPlane, None);
        let node = FakeCluster::labelled(Err("every endpoint timed out"));
        let label = node.label.clone();
        let (backend, _) = backend_with(Level::Full, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!((w.ticker.state.level, &w.pending), (Level::ControlPlane, &Pending::Marks));
            // The API is back; `regrade step to full` by hand marked the Node full.
            *label.borrow_mut() = Ok(None);
            record(&cfg, Level::Full, None);
            w.converge(Duration::from_secs(5)).await;
            w.converge(Duration::from_secs(6)).await;
            assert_eq!(*label.borrow(), Ok(None), "the Node keeps full's marks");
            assert_eq!((w.ticker.state.level, &w.pending), (Level::Full, &Pending::Nothing));
        });
    }

    /// Was (issue 23, finding 4): a hand step killed mid-step left its step in the
    /// record; the running watch ignored it and stepped from its stale level
    /// (control-plane -> full, "no restart", so no etcd gate) while k3s ran etcd-only.
    /// Now the proposal made from the stale level is dropped, and the killed step is
    /// finished under the Lease first.
    #[test]
    fn a_hand_step_killed_mid_step_is_finished_before_watch_steps_again() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::ControlPlane, None);
        let log = crate::testing::Log::default();
        let node = FakeCluster { log: log.clone(), ..FakeCluster::labelled(Ok(Some(Level::ControlPlane))) };
        let (backend, k3s) = backend_with(Level::ControlPlane, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            // `regrade step down`, SIGKILLed once k3s restarted etcd-only.
            k3s.set(Level::EtcdOnly);
            record(&cfg, Level::ControlPlane, Some((Level::ControlPlane, Level::EtcdOnly, Phase::Restarting)));
            w.step(Duration::from_secs(60), &Step::between(Level::ControlPlane, Level::Full), &StepClock::start())
                .await;
            assert_eq!(k3s.get(), Level::EtcdOnly, "no step from the stale level");
            assert_eq!(w.pending, Pending::Adopt);
            w.converge(Duration::from_secs(61)).await;
            assert_eq!(w.pending, Pending::Resume(Step::between(Level::ControlPlane, Level::EtcdOnly)));
            log.take();
            w.converge(Duration::from_secs(62)).await;
            assert_eq!(log.take()[..2], ["preflight", "acquire"], "finished under the Lease");
            assert_eq!((w.ticker.state.level, &w.pending), (Level::EtcdOnly, &Pending::Nothing));
            let r = on_disk(&cfg);
            assert_eq!((r.level, r.step), (Level::EtcdOnly, None));
        });
    }

    /// A start with no level record and the API down writes no record yet: that is not
    /// a record moved by another process. Was: taken for one, so every proposed step
    /// was dropped to decide again, with the backoff reset each sample (CI's
    /// step_faults bench: no step ever refused, a retry every sample).
    #[test]
    fn no_record_on_disk_is_not_a_record_moved_by_another_process() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        let node = FakeCluster::labelled(Err("every endpoint timed out"));
        let label = node.label.clone();
        let (backend, k3s) = backend_with(Level::Full, node);
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.pending, Pending::Adopt);
            assert!(!cfg.level_record.exists(), "no record written before the Node was read");
            w.converge(Duration::from_secs(5)).await;
            assert!(!w.backoff.due(), "a failed try waits: {:?}", w.backoff);
            w.follow_hand_steps();
            assert!(!w.backoff.due(), "and is not made due again by looking at the disk");
            *label.borrow_mut() = Ok(None); // the API answers again
            w.step(Duration::from_secs(60), &Step::between(Level::Full, Level::ControlPlane), &StepClock::start())
                .await;
            assert_eq!(k3s.get(), Level::ControlPlane, "the proposed step ran");
        });
    }

    /// One process steps a server at a time: while another holds the step lock (a hand
    /// step), watch's step is refused before anything is touched, and runs once free.
    #[test]
    fn watch_does_not_step_while_another_process_holds_the_step_lock() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::Full, None);
        let (backend, k3s) = backend_with(Level::Full, FakeCluster::labelled(Ok(None)));
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            let held = level_keeper::StepLock::try_take(&cfg.level_record).unwrap().unwrap();
            w.step(Duration::from_secs(60), &Step::between(Level::Full, Level::ControlPlane), &StepClock::start())
                .await;
            assert_eq!(k3s.get(), Level::Full, "refused while the lock is held");
            let state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
            assert_eq!(state["refusal"]["kind"], "lease-held", "{state}");
            let pid = format!("PID {}", std::process::id());
            assert!(state["refusal"]["message"].as_str().unwrap().contains(&pid), "{state}");
            drop(held);
            w.step(Duration::from_secs(120), &Step::between(Level::Full, Level::ControlPlane), &StepClock::start())
                .await;
            assert_eq!(k3s.get(), Level::ControlPlane, "stepped once the lock was free");
        });
    }

    /// An actuator whose level the test changes behind the watcher's back, and a Node
    /// labelled `control-plane`.
    fn backend(level: Level) -> (Backend, Rc<std::cell::Cell<Level>>) {
        backend_with(level, FakeCluster::labelled(Ok(Some(Level::ControlPlane))))
    }

    /// k3s at `level` (what it was started at; shared, so the test can change it) and
    /// `cluster`.
    fn backend_with(level: Level, cluster: FakeCluster) -> (Backend, Rc<std::cell::Cell<Level>>) {
        let actuator = FakeActuator::at(level);
        let shared = actuator.level.clone();
        let backend = Backend {
            actuator: Box::new(actuator),
            cluster: Box::new(cluster),
            etcd: Box::new(crate::etcd::NoRestartGate),
        };
        (backend, shared)
    }

    /// A server under pressure: PSI 90 %, 100 MiB available (the file returned, to
    /// change), a 512 MiB floor, one second's sustain; no etcd metrics listener.
    pub(super) fn pressed(dir: &std::path::Path) -> (Config, Sampler, std::path::PathBuf) {
        let (psi, mem) = (dir.join("psi"), dir.join("meminfo"));
        std::fs::write(&psi, "some avg10=90 avg60=90 avg300=90 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n")
            .unwrap();
        std::fs::write(&mem, "MemAvailable: 102400 kB\n").unwrap(); // 100 MiB
        let cfg = Config::parse(&format!(
            "state_file = {:?}\nlevel_record = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\n\
             mem_available_floor = \"512MiB\"\nsustain = \"1s\"\nsample_period = \"1s\"\n[etcd]\nmetrics_url = \"\"\n",
            dir.join("state.json"),
            dir.join("level.json"),
        ))
        .unwrap();
        let sampler = Sampler::open(&psi, &mem).unwrap();
        (cfg, sampler, mem)
    }

    /// The step into etcd-only weighs its cost: after a drain into control-plane that
    /// freed nothing, with the local member unhealthy, it is refused as `etcd-only-held`
    /// naming why; with the member well, or once the drain's effect shows (available
    /// memory up by more than `etcd.drain_freed_at_least`), it runs. The member's look
    /// is passed to the ticker here rather than published in `etcd::member::MEMBER`, a
    /// process-wide value other tests read.
    #[test]
    fn the_step_into_etcd_only_is_held_while_the_drain_freed_nothing_and_the_member_is_unhealthy() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler, mem) = pressed(dir.path());
        let (backend, level) = backend_with(Level::Full, FakeCluster::default());
        let into_etcd_only =
            Step { direction: crate::decide::Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
        let unhealthy = crate::decide::MemberSignals { healthy: Some(false), ..Default::default() };
        let well = crate::decide::MemberSignals { healthy: Some(true), ..Default::default() };
        let cost = cfg.etcd.etcd_only_cost();
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.ticker.tick(Duration::ZERO).unwrap(), None);
            let into_cp = w.ticker.tick(Duration::from_secs(1)).unwrap().expect("over for sustain: step down");
            w.step(Duration::from_secs(1), &into_cp, &StepClock::start()).await;
            let state = std::fs::read_to_string(dir.path().join("state.json")).unwrap();
            assert_eq!(level.get(), Level::ControlPlane, "{state}");
            // The drain freed nothing (still 100 MiB) and the member is unhealthy: held.
            w.ticker.tick(Duration::from_secs(2)).unwrap();
            let held = w.ticker.etcd_only_held(&into_etcd_only, &cost, &unhealthy).expect("held");
            assert_eq!((held.kind.as_str(), held.subject.as_str()), ("etcd-only-held", "member-in-distress"));
            assert!(held.message.contains("freed 0 MiB") && held.message.contains("not healthy"), "{}", held.message);
            // A well member: go on, whatever the floor.
            assert!(w.ticker.etcd_only_held(&into_etcd_only, &cost, &well).is_none());
            // The drain's effect shows (100 MiB more than at the decision): go on.
            std::fs::write(&mem, "MemAvailable: 204800 kB\n").unwrap();
            w.ticker.tick(Duration::from_secs(3)).unwrap();
            assert!(w.ticker.etcd_only_held(&into_etcd_only, &cost, &unhealthy).is_none());
            w.step(Duration::from_secs(3), &into_etcd_only, &StepClock::start()).await;
            assert_eq!(level.get(), Level::EtcdOnly, "the step goes on");
        });
    }

    /// The member falls into distress during the drain into etcd-only, decided while it
    /// was well: the cost, weighed again by `watch`'s gate after the drain with a fresh
    /// sample (the drain into control-plane freed nothing), holds the step there. k3s
    /// stays at control-plane, the marks go back; with memory freed by then it goes on.
    #[test]
    fn the_step_into_etcd_only_is_weighed_again_after_its_drain() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler, mem) = pressed(dir.path());
        let log = crate::testing::Log::default();
        let cluster = FakeCluster { drained: Some(Default::default()), ..FakeCluster::logging_to(&log) };
        let (backend, level) = backend_with(Level::Full, cluster);
        let into_etcd_only =
            Step { direction: crate::decide::Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!(w.ticker.tick(Duration::ZERO).unwrap(), None);
            let into_cp = w.ticker.tick(Duration::from_secs(1)).unwrap().expect("over for sustain: step down");
            w.step(Duration::from_secs(1), &into_cp, &StepClock::start()).await;
            assert_eq!(level.get(), Level::ControlPlane);
            log.take();
            // Well until the drain into etcd-only, unhealthy after it.
            let drained = log.clone();
            w.member_signals = Box::new(move || crate::decide::MemberSignals {
                healthy: Some(!drained.has("drain")),
                ..Default::default()
            });
            w.ticker.tick(Duration::from_secs(2)).unwrap();
            w.step(Duration::from_secs(2), &into_etcd_only, &StepClock::start()).await;
            assert_eq!(level.get(), Level::ControlPlane, "held after the drain: k3s not restarted");
            let calls = log.take();
            let at =
                |what: &str| calls.iter().position(|c| c == what).unwrap_or_else(|| panic!("no {what}: {calls:?}"));
            assert!(at("mark etcd-only") < at("drain") && at("drain") < at("mark control-plane"), "{calls:?}");
            let state = std::fs::read_to_string(dir.path().join("state.json")).unwrap();
            assert!(state.contains(step::HELD_AT_RESTART), "{state}");
            // The member unhealthy after the drain again, but memory freed since the
            // step into control-plane, shown only by the sample taken at the restart
            // (none between): the step goes on.
            std::fs::write(&mem, "MemAvailable: 204800 kB\n").unwrap();
            w.step(Duration::from_secs(40), &into_etcd_only, &StepClock::start()).await;
            assert_eq!(level.get(), Level::EtcdOnly, "the step goes on");
        });
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
            w.step(Duration::from_secs(60), &down, &StepClock::start()).await;
            assert_eq!(level.get(), Level::Full, "a held step must not reach the actuator");
            let state: serde_json::Value =
                serde_json::from_slice(&std::fs::read(dir.path().join("state.json")).unwrap()).unwrap();
            assert_eq!(state["refusal"]["kind"], "switch-hold", "{state}");
            assert!(state["refusal"]["message"].as_str().unwrap().contains("a NixOS switch is turning regrade off"));
            assert!(state.get("stepping").is_none(), "no step is under way once it was refused: {state}");
            std::fs::remove_file(&hold).unwrap();
            w.step(Duration::from_secs(120), &down, &StepClock::start()).await;
            assert_eq!(level.get(), Level::ControlPlane, "without the hold the step runs");
        });
    }

    #[test]
    fn watch_follows_a_hand_step_by_the_level_record() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        record(&cfg, Level::ControlPlane, None);
        let (backend, k3s) = backend_with(Level::Full, FakeCluster::labelled(Ok(Some(Level::ControlPlane))));
        runtime().unwrap().block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            assert_eq!((w.ticker.state.level, &w.pending), (Level::ControlPlane, &Pending::Nothing));
            w.follow_hand_steps();
            assert_eq!(w.pending, Pending::Nothing, "the record did not change: nothing to follow");
            // `regrade step down` by hand: k3s restarted etcd-only, the record says so.
            k3s.set(Level::EtcdOnly);
            record(&cfg, Level::EtcdOnly, None);
            w.follow_hand_steps();
            assert_eq!(w.pending, Pending::Adopt, "decided again from the disk");
            w.converge(Duration::from_secs(120)).await;
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
        record(&cfg, Level::ControlPlane, None);
        let (backend, k3s) = backend(Level::ControlPlane);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            let started = Instant::now();
            w.run_until(async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                k3s.set(Level::EtcdOnly); // `regrade step down` by hand
                record(&cfg, Level::EtcdOnly, None);
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

    /// The etcd members are learned while the reading is calm, at whatever level, and
    /// not while it is not: the restart into etcd-only comes under pressure, when the
    /// local member may not answer, and the gate then asks the members it learned.
    /// (A VM run's first step into etcd-only was refused as `etcd-unavailable` for
    /// minutes: no restart had ever looked at etcd, so no other member was known.)
    #[test]
    fn a_calm_watch_learns_the_etcd_members_and_a_pressed_one_waits() {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, sampler) = fixture(dir.path());
        let psi = dir.path().join("psi");
        std::fs::write(&psi, "some avg10=80 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n")
            .unwrap();
        let learner = super::members::tests::Learner { answers: vec![false].into(), ..Default::default() };
        let looks = learner.looks.clone();
        let (mut backend, _) = backend(Level::Full);
        backend.etcd = Box::new(learner);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let mut w = Watcher::new(&cfg, backend, sampler, Mode::Act).await.unwrap();
            w.run_until(tokio::time::sleep(Duration::from_secs(12))).await.unwrap();
            assert_eq!(looks.get(), 0, "not while the reading is not calm");
            std::fs::write(&psi, "some avg10=0 avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n")
                .unwrap();
            w.run_until(tokio::time::sleep(Duration::from_secs(12))).await.unwrap();
            assert_eq!(looks.get(), 1, "looked at the first calm sample (and failed)");
            w.run_until(tokio::time::sleep(Duration::from_secs(60))).await.unwrap();
            assert_eq!(looks.get(), 2, "looked again a minute later, and learned them");
            w.run_until(tokio::time::sleep(Duration::from_secs(300))).await.unwrap();
            assert_eq!(looks.get(), 2, "never again once known");
        });
    }

    /// A stand-in for the etcd member's metrics listener that counts the `/health`
    /// requests it is sent: one per look.
    async fn counting_member() -> (String, Rc<std::cell::Cell<usize>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/metrics", l.local_addr().unwrap());
        let looks = Rc::new(std::cell::Cell::new(0));
        let counted = looks.clone();
        tokio::task::spawn_local(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                let body = if buf[..n].starts_with(b"GET /health") {
                    counted.set(counted.get() + 1);
                    "{\"health\":\"true\"}"
                } else {
                    "etcd_server_has_leader 1\n"
                };
                let _ = s.write_all(format!("HTTP/1.1 200 OK\r\n\r\n{body}").as_bytes()).await;
            }
        });
        (url, looks)
    }

    /// Calm at `full`, `watch` looks at the etcd member at most once, at start, and
    /// never on a timer: not in an hour of calm (here without a trigger, so the loop samples
    /// every period all the while), only every `etcd.metrics_interval` while pressure
    /// is not calm, and once when a scrape asks. (Since issue 40 it looked every
    /// 10 s whatever the pressure: 360 looks in the hour.)
    #[test]
    fn a_calm_watch_never_looks_on_a_timer() {
        let dir = tempfile::tempdir().unwrap();
        let (psi, mem) = (dir.path().join("psi"), dir.path().join("meminfo"));
        let write_psi = |p: u32| {
            std::fs::write(
                &psi,
                format!("some avg10={p} avg60=0 avg300=0 total=0\nfull avg10=0 avg60=0 avg300=0 total=0\n"),
            )
            .unwrap()
        };
        write_psi(0);
        std::fs::write(&mem, "MemAvailable: 4000000 kB\n").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let (url, looked) = counting_member().await;
            let cfg = Config::parse(&format!(
                "state_file = {:?}\nlevel_record = {:?}\n[pressure]\nsource = {psi:?}\nmeminfo = {mem:?}\n\
                 [etcd]\nmetrics_url = {url:?}\nmetrics_interval = \"10s\"\n",
                dir.path().join("state.json"),
                dir.path().join("level.json"),
            ))
            .unwrap();
            let (backend, _) = backend_with(Level::Full, FakeCluster::labelled(Ok(None)));
            let mut w = Watcher::new(&cfg, backend, Sampler::open(&psi, &mem).unwrap(), Mode::Act).await.unwrap();
            assert_eq!(w.pending, Pending::Nothing);
            w.looks = Some(looks_for(&cfg, Mode::Act).unwrap());
            let hour = Duration::from_secs(3600);
            w.run_until(tokio::time::sleep(hour)).await.unwrap();
            assert!(w.pacer.resting(), "calm at the top");
            let at_start = looked.get();
            assert!(at_start <= 1, "{at_start} looks in an hour of calm: at most one, at start");
            // Pressure over the threshold (not over: memory is plentiful), for a minute:
            // a look at once and one every 10 s.
            write_psi(80);
            w.run_until(tokio::time::sleep(Duration::from_secs(60))).await.unwrap();
            let pressed = looked.get() - at_start;
            assert!((5..=7).contains(&pressed), "{pressed} looks in a minute of pressure");
            // Calm again: past the hold, looks stop.
            write_psi(0);
            w.run_until(tokio::time::sleep(Duration::from_secs(30))).await.unwrap();
            let stopped = looked.get();
            w.run_until(tokio::time::sleep(hour)).await.unwrap();
            assert_eq!(looked.get(), stopped, "no look in the second hour of calm");
            // A scrape asks: one look now; another right after is answered by it.
            let looks = w.looks.clone().unwrap();
            looks.ask(Duration::from_secs(10)).await;
            assert_eq!(looked.get(), stopped + 1, "a scrape's look");
            looks.ask(Duration::from_secs(10)).await;
            assert_eq!(looked.get(), stopped + 1, "the next scrape within the interval is answered by it");
        });
    }

    use crate::decide::Direction;

    /// One path of [`trigger_and_polling_make_the_same_decisions`]: the pacing of
    /// `Watcher::run` (wait, sample, run the proposed step, choose how to wait next)
    /// over fixture files that a timeline rewrites. `fire` is sent the moment pressure
    /// reaches `threshold`, as the kernel fires a PSI trigger.
    ///
    /// Tokio's clock is paused, so time moves only when both the loop and the timeline
    /// wait: the result is the same on an idle machine and a loaded one. (In real time,
    /// two cores busy with the rest of the suite delayed one path by several periods.)
    /// The trigger is still a real POLLPRI on a socket; the timeline waits until the
    /// kernel reports it before it lets time move on.
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
        let pending = rx.try_clone().unwrap();
        let sampler = Sampler::open(&psi, &mem).unwrap();
        let mut ticker = Ticker::new(&cfg, sampler, Level::ALL.to_vec(), Level::Full, Mode::DryRun);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let origin = tokio::time::Instant::now();
            // (when, pressure): calm at full, over (two steps down), calm (two steps up,
            // back at full), over again. Half a period off the polling samples, so no
            // sample and no change fall on the same instant.
            let timeline = async {
                for (at, p) in [(1050, 60.0), (2550, 0.0), (4550, 60.0)] {
                    tokio::time::sleep_until(origin + ms(at)).await;
                    write_psi(p);
                    if p >= 40.0 && trigger {
                        crate::psi_trigger::tests::fire(&tx);
                        crate::psi_trigger::tests::wait_urgent(&pending);
                    }
                }
            };
            let watch = async {
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
            };
            // Time moves on to this if the loop sleeps on the trigger with nothing left to
            // wake it: a path that missed a fire fails here instead of hanging.
            let watch = tokio::time::timeout(ms(6000), watch);
            tokio::join!(timeline, watch).1.expect("asleep on the trigger with pressure over")
        })
    }

    /// The same pressure, fed to `watch` asleep on a trigger and to `watch` polling:
    /// the same steps, in the same order, none later; the trigger path sleeps through
    /// the calm at `full`.
    #[test]
    fn trigger_and_polling_make_the_same_decisions() {
        let (polled, triggered) = (run_path(false), run_path(true));
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
            // Within a period of each other: the trigger path samples from the fire on.
            let gap = p.0.abs_diff(t.0);
            assert!(gap < Duration::from_millis(100), "polling at {:?}, trigger at {:?}", p.0, t.0);
        }
        // Polling samples about 55 times in 5.5 s; the trigger path sleeps through the
        // calm at full (0-1 s, and from about 4.1 s to 4.5 s) apart from the hold.
        assert!(polled.1 >= 45, "{} polling samples", polled.1);
        assert!(triggered.1 + 8 <= polled.1, "trigger path: {} samples, polling {}", triggered.1, polled.1);
    }
}
