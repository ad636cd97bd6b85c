//! The per-sample work of `watch`: sample, classify, update the core, tell systemd,
//! publish the state when it changed; and feeding a step's outcome back. A calm sample
//! allocates nothing and makes no API request (tests/alloc_per_sample.rs,
//! tests/testsuite/bench_idle_api.rs).

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::Mode;
use crate::config::Config;
use crate::decide::{
    weigh_etcd_only, Direction, EtcdOnlyCost, HeldBecause, MemberSignals, Reading, Settings, State, Step,
};
use crate::level::Level;
use crate::metrics::METRICS;
use crate::notify::Notifier;
use crate::pressure::{SampleError, Sampler};
use crate::psi_trigger;
use crate::sample::Pacing;
use crate::statefile::{self, LastStep, Published, PublishedRefusal};
use crate::step::Outcome;

/// The per-sample work: sample, classify, update the core, tell systemd, publish the
/// state when it changed. Allocates nothing on a sample that proposes no step.
pub struct Ticker {
    sampler: Sampler,
    settings: Settings,
    levels: Vec<Level>,
    pub state: State,
    pub(super) notifier: Notifier,
    published: Published,
    /// `None` in a dry run: it must not overwrite the state a real `watch` publishes.
    state_file: Option<PathBuf>,
    /// Samples that parsed; READY waits for the first.
    pub good_samples: u64,
    /// Set when a step ran or was refused, so the next publish writes the file.
    dirty: bool,
    /// The last sample's reading, to log each change of it; the pacer sleeps only
    /// after a calm one.
    last_reading: Option<Reading>,
    wall_origin: SystemTime,
    /// Available memory at the last good sample, and at the sample that proposed the
    /// step under way.
    last_available: Option<u64>,
    available_at_decision: Option<u64>,
    /// Available memory when the step into `control-plane` that holds now was decided:
    /// what its drain freed is measured from it (`decide::weigh_etcd_only`).
    drain_baseline: Option<u64>,
    /// How old a look at the local etcd member may be and still count.
    member_max_age: Duration,
}

impl Ticker {
    pub fn new(cfg: &Config, sampler: Sampler, levels: Vec<Level>, level: Level, mode: Mode) -> Ticker {
        let dry_run = mode == Mode::DryRun;
        Ticker {
            sampler,
            settings: cfg.core_settings(),
            levels,
            state: State::new(level),
            notifier: Notifier::from_env(),
            published: Published { pid: std::process::id(), dry_run, ..Default::default() },
            state_file: (!dry_run).then(|| cfg.state_file.clone()),
            good_samples: 0,
            dirty: true,
            last_reading: None,
            wall_origin: SystemTime::now(),
            last_available: None,
            available_at_decision: None,
            drain_baseline: None,
            member_max_age: cfg.etcd.member_look_max_age(),
        }
    }

    /// Whether `watch` may sleep on the PSI trigger (see [`psi_trigger::calm_at_top`]).
    pub fn calm_at_top(&self) -> bool {
        psi_trigger::calm_at_top(&self.state, self.last_reading, &self.settings, &self.levels)
    }

    /// The last sample read calm, at whatever level.
    pub fn calm(&self) -> bool {
        self.last_reading == Some(Reading::Calm)
    }

    /// Publishes how `watch` waits (written at once: it changes rarely).
    pub(super) fn set_pacing(&mut self, pacing: Pacing, trigger: Option<&str>) {
        self.published.pacing = Some(pacing);
        METRICS.set_pacing(pacing);
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
            Err(e) if e.is_fatal() => {
                METRICS.sample_failed();
                return Err(e);
            }
            Err(e) => {
                METRICS.sample_failed();
                tracing::warn!(error = %e, "sample failed; trying again next period");
                return Ok(None);
            }
        };
        self.good_samples += 1;
        self.last_available = Some(sample.mem_available);
        // The member's last look (a lock and a copy; no request on this path).
        let member = crate::etcd::member::fresh_signals(self.member_max_age);
        let reading = self.settings.classify(&sample, &member);
        let pressure = sample.metric(self.settings.metric);
        let proposed = self.state.observe(&self.settings, &self.levels, t, reading);
        METRICS.sampled(&sample, reading);
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
        tracing::debug!(level = %self.state.level, pressure, available = sample.mem_available, decision = reading.as_str(), "sample");
        if self.last_reading != Some(reading) {
            // Each change of reading, not each sample: what a newcomer trying
            // `watch --dry-run` needs to see it work, and what the journal needs to
            // explain a step. Allocates (the log line), but only on a change.
            let was = self.last_reading.map_or("none", Reading::as_str);
            self.last_reading = Some(reading);
            let distress = match self.settings.over_by_distress(&sample, &member) {
                Some(d) if reading == Reading::Over => {
                    format!(" (over the floor, but the local etcd member is in distress: {d})")
                }
                _ => String::new(),
            };
            tracing::info!(
                level = %self.state.level, pressure, available = sample.mem_available, decision = reading.as_str(),
                "reading now {} (was {was}): {} {pressure:.2}%, MemAvailable {} MiB{distress}",
                reading.as_str(), self.settings.metric.as_str(), sample.mem_available >> 20
            );
        }
        if let Some(step) = &proposed {
            self.available_at_decision = Some(sample.mem_available);
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
    pub(super) fn settle(&mut self, t: Duration, step: &Step, outcome: &Outcome) -> bool {
        let now = statefile::unix(SystemTime::now());
        let level = match outcome {
            Outcome::Refused(r) => {
                // Logged and recorded as an Event only when the reason changes.
                // By (kind, subject): the message carries ages that change every sample.
                let changed =
                    self.published.refusal.as_ref().is_none_or(|p| p.kind != r.kind.as_str() || p.subject != r.subject);
                if !changed {
                    return false;
                }
                tracing::warn!(kind = r.kind.as_str(), reason = %r.message, decision = step.direction.action(), "step refused");
                self.published.refusal = Some(PublishedRefusal {
                    since: now,
                    kind: r.kind.as_str().to_string(),
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
        self.drain_baseline = match (level, outcome) {
            (Level::ControlPlane, Outcome::Done) if step.direction == Direction::Down => self.available_at_decision,
            (Level::ControlPlane, _) => self.drain_baseline,
            _ => None,
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

    /// Whether the step into `etcd-only` is held at `control-plane` by its cost, at its
    /// decision ([`held_refusal`]): the step is proposed again next sample and weighed
    /// again then.
    pub(super) fn etcd_only_held(
        &self,
        step: &Step,
        cost: &EtcdOnlyCost,
        member: &MemberSignals,
    ) -> Option<crate::cluster::Refusal> {
        // No sample yet: nothing to weigh (watch proposes steps only from a sample).
        held_refusal(cost, step, self.freed_since(self.last_available?), member)
    }

    /// Available memory freed since the step into `control-plane` that holds now was
    /// decided, at `available`; `None`: not known.
    pub(super) fn freed_since(&self, available: u64) -> Option<i64> {
        self.drain_baseline.map(|b| available as i64 - b as i64)
    }

    /// Publishes the step about to start (or, `None`, that none is), at once.
    pub(super) fn set_stepping(&mut self, to: Option<Level>) {
        self.published.stepping = to;
        self.mark_dirty();
    }

    /// Makes the next publish write the state file.
    pub(super) fn mark_dirty(&mut self) {
        self.dirty = true;
        self.publish();
    }

    /// Writes the state file when it changed (never on an unchanged calm sample).
    fn publish(&mut self) {
        METRICS.set_level(self.state.level);
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

/// The step into `etcd-only` weighed against its cost (`decide::weigh_etcd_only`), as
/// a refusal naming why; `None`: go on.
pub fn held_refusal(
    cost: &EtcdOnlyCost,
    step: &Step,
    freed: Option<i64>,
    member: &MemberSignals,
) -> Option<crate::cluster::Refusal> {
    let held = weigh_etcd_only(cost, step, freed, member)?;
    let subject = match held.why {
        HeldBecause::MemberInDistress(_) => "member-in-distress",
    };
    Some(crate::cluster::Refusal {
        kind: crate::cluster::RefusalKind::EtcdOnlyHeld,
        subject: subject.to_string(),
        message: held.to_string(),
    })
}
