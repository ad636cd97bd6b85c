//! The decision core (docs/behaviour.md, "Decision rules"). Pure: time is an input,
//! nothing here does I/O, and it imports only value modules (`level`, `sample`): the
//! import graph test (tests/testsuite/import_graph.rs) fails otherwise.
//!
//! Each sample is classified as over, calm or neither; streaks start and end with it;
//! a step is proposed when a streak has lasted `sustain` and `cooldown` has passed
//! since the last step that ran, in either direction. The caller runs the step and
//! reports back with [`State::step_ran`] — or, when the step was refused, does
//! nothing, so the step is proposed again on the next sample.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::level::Level;
use crate::sample::{Metric, Sample};

/// `step_up`: whether the core steps up by itself once memory has been calm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StepUp {
    Automatic,
    Manual,
}

/// The settings the core decides by, taken from `[pressure]` and `step_up`
/// (`Config::core_settings`).
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub metric: Metric,
    pub threshold: f64,
    pub calm_threshold: f64,
    /// `None`: PSI alone decides.
    pub mem_available_floor: Option<u64>,
    /// `Some`: PSI at or over `threshold` while the local etcd member is in distress
    /// (by these limits) is over whatever the floor says; `None`: the floor alone.
    pub distress_overrides_floor: Option<DistressLimits>,
    pub sustain: Duration,
    pub cooldown: Duration,
    pub step_up: StepUp,
}

impl Settings {
    /// Over, calm or neither (docs/behaviour.md, "Decision rules"), with the local
    /// etcd member's last fresh look (`MemberSignals::default()` when there is none).
    pub fn classify(&self, s: &Sample, member: &MemberSignals) -> Reading {
        let p = s.metric(self.metric);
        let (low, high) = match self.mem_available_floor {
            Some(floor) => (s.mem_available < floor, s.mem_available >= floor),
            None => (true, true),
        };
        if p >= self.threshold && (low || self.over_by_distress(s, member).is_some()) {
            Reading::Over
        } else if p < self.calm_threshold && high {
            Reading::Calm
        } else {
            Reading::Neither
        }
    }

    /// The member's distress, when it alone makes this sample over: PSI at or over
    /// `threshold`, available memory at or above the floor. Measured on a loaded 2 GiB
    /// host (docs/incident-vm.md): PSI passed 40 % and the member stopped answering
    /// its health checks tens of seconds before available memory fell under the
    /// 512 MiB floor (on an idle one the floor came first, and this never acted).
    pub fn over_by_distress(&self, s: &Sample, member: &MemberSignals) -> Option<Distress> {
        let limits = self.distress_overrides_floor?;
        let floor_holds = self.mem_available_floor.is_some_and(|floor| s.mem_available >= floor);
        if !floor_holds || s.metric(self.metric) < self.threshold {
            return None;
        }
        member.distress(&limits)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reading {
    Over,
    Calm,
    Neither,
}

impl Reading {
    /// The README's word for it (as serialised), for logs and `status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reading::Over => "over",
            Reading::Calm => "calm",
            Reading::Neither => "neither",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Down,
    Up,
}

impl Direction {
    pub fn action(self) -> &'static str {
        match self {
            Direction::Down => "step-down",
            Direction::Up => "step-up",
        }
    }
}

/// A step of one level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub direction: Direction,
    pub from: Level,
    pub to: Level,
}

impl Step {
    /// The one-level step from `from` in `direction`, if `levels` has a level there.
    pub fn from_level(from: Level, direction: Direction, levels: &[Level]) -> Option<Step> {
        let to = match direction {
            Direction::Down => from.below(levels),
            Direction::Up => from.above(levels),
        }?;
        Some(Step { direction, from, to })
    }

    /// The step from `from` to `to`: down when `to` is the lower level.
    pub fn between(from: Level, to: Level) -> Step {
        let direction =
            if to.index_in(&Level::ALL) > from.index_in(&Level::ALL) { Direction::Down } else { Direction::Up };
        Step { direction, from, to }
    }
}

/// What the core remembers between samples. Times are offsets from any fixed origin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct State {
    pub level: Level,
    pub over_since: Option<Duration>,
    pub calm_since: Option<Duration>,
    pub last_step: Option<Duration>,
}

impl State {
    pub fn new(level: Level) -> State {
        State { level, over_since: None, calm_since: None, last_step: None }
    }

    /// Takes one sample's reading at time `t`: updates the streaks and proposes the
    /// step to attempt now, if any (docs/behaviour.md, "Decision rules").
    pub fn observe(&mut self, settings: &Settings, levels: &[Level], t: Duration, reading: Reading) -> Option<Step> {
        match reading {
            Reading::Over => {
                self.calm_since = None;
                self.over_since.get_or_insert(t);
            }
            Reading::Calm => {
                self.over_since = None;
                self.calm_since.get_or_insert(t);
            }
            Reading::Neither => {
                self.over_since = None;
                self.calm_since = None;
            }
        }
        let cooled = self.last_step.is_none_or(|last| t.saturating_sub(last) >= settings.cooldown);
        if !cooled {
            return None;
        }
        let sustained = |since: Option<Duration>| since.is_some_and(|s| t.saturating_sub(s) >= settings.sustain);
        if sustained(self.over_since) {
            if let Some(step) = Step::from_level(self.level, Direction::Down, levels) {
                return Some(step);
            }
        }
        if settings.step_up == StepUp::Automatic && sustained(self.calm_since) {
            return Step::from_level(self.level, Direction::Up, levels);
        }
        None
    }

    /// A step ran at `t` (succeeded or failed) and left k3s at `level`: the cooldown
    /// starts and every further step needs a fresh streak (docs/behaviour.md,
    /// "Decision rules").
    pub fn step_ran(&mut self, t: Duration, level: Level) {
        self.level = level;
        self.last_step = Some(t);
        self.over_since = None;
        self.calm_since = None;
    }

    /// When the next automatic step could happen if the current streak goes on, and
    /// which way; `None` when no streak is under way or none could lead to a step.
    pub fn next_step_at(&self, settings: &Settings, levels: &[Level]) -> Option<(Step, Duration)> {
        let after_cooldown = self.last_step.map_or(Duration::ZERO, |l| l + settings.cooldown);
        if let Some(since) = self.over_since {
            let step = Step::from_level(self.level, Direction::Down, levels)?;
            return Some((step, (since + settings.sustain).max(after_cooldown)));
        }
        if let (Some(since), StepUp::Automatic) = (self.calm_since, settings.step_up) {
            let step = Step::from_level(self.level, Direction::Up, levels)?;
            return Some((step, (since + settings.sustain).max(after_cooldown)));
        }
        None
    }
}

/// The step into `etcd-only` weighs its cost (docs/behaviour.md, "Decision rules"):
/// it restarts k3s, and the restarted etcd member reads its data back under the
/// thrash that made the step. In the measured incident (docs/incident.md, the held
/// arm: a PodDisruptionBudget kept the workload, so the drain into `control-plane`
/// freed nothing) the step freed about 217 MiB and ended the thrash; the member was
/// away about 20 s, longer when it was already struggling before the restart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EtcdOnlyCost {
    /// `false`: the step into `etcd-only` is never held (as before this rule).
    pub hold: bool,
    /// The drain into `control-plane` "freed nothing" when available memory rose by
    /// less than this since that step was decided.
    pub drain_freed_at_least: u64,
    pub limits: DistressLimits,
}

impl EtcdOnlyCost {
    /// Whether `step` is weighed at all: the step down into `etcd-only`, with `hold` on.
    pub fn applies_to(&self, step: &Step) -> bool {
        self.hold && step.direction == Direction::Down && step.to == Level::EtcdOnly
    }
}

/// When the local member is in distress: not healthy, or a p99 (over the last look's
/// interval) at or over its limit (`etcd.wal_fsync_p99_limit`,
/// `etcd.backend_commit_p99_limit`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DistressLimits {
    pub wal_fsync_p99: Duration,
    pub backend_commit_p99: Duration,
}

/// What the member's distress is (its `Display` names the limit crossed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Distress {
    NotHealthy,
    WalFsync { p99: Duration, limit: Duration },
    BackendCommit { p99: Duration, limit: Duration },
}

impl std::fmt::Display for Distress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Distress::NotHealthy => write!(f, "not healthy"),
            Distress::WalFsync { p99, limit } => write!(
                f,
                "WAL fsync p99 {} ms, limit etcd.wal_fsync_p99_limit = {} ms",
                p99.as_millis(),
                limit.as_millis()
            ),
            Distress::BackendCommit { p99, limit } => write!(
                f,
                "backend commit p99 {} ms, limit etcd.backend_commit_p99_limit = {} ms",
                p99.as_millis(),
                limit.as_millis()
            ),
        }
    }
}

/// The local etcd member as its own metrics listener last showed it, as the core
/// weighs it. `None` fields are unknown (no look yet, no fsync in the interval).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemberSignals {
    /// `Some(false)`: `/health` said false, or did not answer in time.
    pub healthy: Option<bool>,
    pub wal_fsync_p99: Option<Duration>,
    pub backend_commit_p99: Option<Duration>,
}

impl MemberSignals {
    /// The member's distress by `limits`, if any; unknown signals are no distress.
    pub fn distress(&self, limits: &DistressLimits) -> Option<Distress> {
        if self.healthy == Some(false) {
            return Some(Distress::NotHealthy);
        }
        if let Some(p99) = self.wal_fsync_p99.filter(|p| *p >= limits.wal_fsync_p99) {
            return Some(Distress::WalFsync { p99, limit: limits.wal_fsync_p99 });
        }
        let p99 = self.backend_commit_p99.filter(|p| *p >= limits.backend_commit_p99)?;
        Some(Distress::BackendCommit { p99, limit: limits.backend_commit_p99 })
    }
}

/// Why the step into `etcd-only` is held at `control-plane`.
#[derive(Clone, Debug, PartialEq)]
pub struct EtcdOnlyHeld {
    /// What the drain into `control-plane` freed (available memory since that step was
    /// decided); `None`: not known (regrade started at `control-plane`), taken as nothing.
    pub freed_by_drain: Option<i64>,
    pub why: HeldBecause,
}

///
/// Not a reason: that the restart would not free enough to reach the floor. Measured
/// (docs/incident.md, the held arm, 2026-12-04): with 5–28 MiB available in a 1.5 GiB
/// cgroup the restart freed 217 MiB and the thrash ended about 36 s later, available
/// still under the 512 MiB floor. The floor starts steps; it is not what relief needs.
#[derive(Clone, Debug, PartialEq)]
pub enum HeldBecause {
    /// The member is unhealthy, or its WAL fsync or backend commit p99 is at or over
    /// its limit: a restart now would not finish under the thrash.
    MemberInDistress(Distress),
}

impl std::fmt::Display for EtcdOnlyHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: i64| b / (1 << 20);
        match self.freed_by_drain {
            Some(freed) => write!(f, "the drain into control-plane freed {} MiB", mib(freed))?,
            None => write!(f, "what the drain into control-plane freed is not known")?,
        }
        match &self.why {
            HeldBecause::MemberInDistress(why) => write!(
                f,
                " and the local etcd member is in distress ({why}): a restart now would keep it away under the \
                 thrash; holding at control-plane"
            ),
        }
    }
}

/// Whether the step `step` is held at `control-plane` by its cost: only the step from
/// `control-plane` into `etcd-only`, only when the drain freed less than
/// `drain_freed_at_least`, and then when the member is already in distress. `None`: go
/// on.
pub fn weigh_etcd_only(
    cost: &EtcdOnlyCost,
    step: &Step,
    freed_by_drain: Option<i64>,
    member: &MemberSignals,
) -> Option<EtcdOnlyHeld> {
    if !cost.applies_to(step) {
        return None;
    }
    if freed_by_drain.is_some_and(|f| f >= cost.drain_freed_at_least as i64) {
        return None;
    }
    let why = HeldBecause::MemberInDistress(member.distress(&cost.limits)?);
    Some(EtcdOnlyHeld { freed_by_drain, why })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEVELS: &[Level] = &Level::ALL;

    fn settings() -> Settings {
        Settings {
            metric: Metric::SomeAvg10,
            threshold: 40.0,
            calm_threshold: 10.0,
            mem_available_floor: Some(1000),
            distress_overrides_floor: None,
            sustain: Duration::from_secs(30),
            cooldown: Duration::from_secs(60),
            step_up: StepUp::Automatic,
        }
    }

    fn sample(p: f64, avail: u64) -> Sample {
        let mut s = Sample::default();
        s.psi.some[0] = p;
        s.mem_available = avail;
        s
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// Feeds `reading` every 10 s from `from` to `to` inclusive; runs every proposed step
    /// successfully; returns the steps with their times.
    fn feed(state: &mut State, s: &Settings, reading: Reading, from: u64, to: u64) -> Vec<(u64, Step)> {
        let mut out = vec![];
        for t in (from..=to).step_by(10) {
            if let Some(step) = state.observe(s, LEVELS, secs(t), reading) {
                state.step_ran(secs(t), step.to);
                out.push((t, step));
            }
        }
        out
    }

    #[test]
    fn classification_follows_the_spec() {
        let s = settings();
        assert_eq!(s.classify(&sample(40.0, 999), &NO_LOOK), Reading::Over);
        assert_eq!(s.classify(&sample(40.0, 1000), &NO_LOOK), Reading::Neither, "high PSI, memory free");
        assert_eq!(s.classify(&sample(39.9, 999), &NO_LOOK), Reading::Neither);
        assert_eq!(s.classify(&sample(9.9, 1000), &NO_LOOK), Reading::Calm);
        assert_eq!(s.classify(&sample(10.0, 1000), &NO_LOOK), Reading::Neither, "calm needs P < calm_threshold");
        assert_eq!(s.classify(&sample(0.0, 999), &NO_LOOK), Reading::Neither, "calm needs A >= floor");
        let no_floor = Settings { mem_available_floor: None, ..s };
        assert_eq!(no_floor.classify(&sample(40.0, u64::MAX), &NO_LOOK), Reading::Over);
        assert_eq!(no_floor.classify(&sample(0.0, 0), &NO_LOOK), Reading::Calm);
    }

    /// No fresh look at the member.
    const NO_LOOK: MemberSignals = MemberSignals { healthy: None, wal_fsync_p99: None, backend_commit_p99: None };

    #[test]
    fn the_members_distress_stands_in_for_the_floor_only_under_pressure() {
        let s = Settings { distress_overrides_floor: Some(LIMITS), ..settings() };
        let unhealthy = MemberSignals { healthy: Some(false), ..NO_LOOK };
        let slow =
            MemberSignals { healthy: Some(true), backend_commit_p99: Some(Duration::from_millis(100)), ..NO_LOOK };
        let well = MemberSignals {
            healthy: Some(true),
            wal_fsync_p99: Some(Duration::from_millis(99)),
            backend_commit_p99: Some(Duration::from_millis(99)),
        };
        // PSI over, memory above the floor: over only with the member in distress.
        assert_eq!(s.classify(&sample(40.0, 5000), &unhealthy), Reading::Over);
        assert_eq!(s.over_by_distress(&sample(40.0, 5000), &unhealthy), Some(Distress::NotHealthy));
        assert_eq!(s.classify(&sample(40.0, 5000), &slow), Reading::Over);
        assert_eq!(s.classify(&sample(40.0, 5000), &well), Reading::Neither);
        assert_eq!(s.classify(&sample(40.0, 5000), &NO_LOOK), Reading::Neither, "no look is no distress");
        // PSI under the threshold: a member in distress steps nothing.
        assert_eq!(s.classify(&sample(39.9, 5000), &unhealthy), Reading::Neither);
        assert_eq!(s.classify(&sample(0.0, 5000), &unhealthy), Reading::Calm, "calm is PSI's and the floor's");
        // Under the floor it is over anyway, and not by distress.
        assert_eq!(s.over_by_distress(&sample(40.0, 999), &unhealthy), None);
        // Turned off: the floor alone.
        let off = Settings { distress_overrides_floor: None, ..s };
        assert_eq!(off.classify(&sample(40.0, 5000), &unhealthy), Reading::Neither);
    }

    #[test]
    fn sustain_completes_on_the_exact_sample() {
        let s = settings();
        let mut st = State::new(Level::Full);
        assert_eq!(st.observe(&s, LEVELS, secs(100), Reading::Over), None);
        assert_eq!(st.observe(&s, LEVELS, secs(129), Reading::Over), None, "one second short");
        let step = st.observe(&s, LEVELS, secs(130), Reading::Over).unwrap();
        assert_eq!(step, Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane });
    }

    #[test]
    fn a_neither_sample_ends_both_streaks() {
        let s = settings();
        let mut st = State::new(Level::Full);
        st.observe(&s, LEVELS, secs(0), Reading::Over);
        st.observe(&s, LEVELS, secs(20), Reading::Neither);
        assert_eq!((st.over_since, st.calm_since), (None, None));
        assert_eq!(st.observe(&s, LEVELS, secs(30), Reading::Over), None, "streak restarted at 30");
        assert_eq!(st.observe(&s, LEVELS, secs(59), Reading::Over), None);
        assert!(st.observe(&s, LEVELS, secs(60), Reading::Over).is_some());

        let mut st = State::new(Level::ControlPlane);
        st.observe(&s, LEVELS, secs(0), Reading::Calm);
        st.observe(&s, LEVELS, secs(20), Reading::Neither);
        assert_eq!(st.observe(&s, LEVELS, secs(30), Reading::Calm), None);
        assert_eq!(st.calm_since, Some(secs(30)));
    }

    #[test]
    fn over_ends_calm_and_calm_ends_over() {
        let s = settings();
        let mut st = State::new(Level::ControlPlane);
        st.observe(&s, LEVELS, secs(0), Reading::Calm);
        st.observe(&s, LEVELS, secs(10), Reading::Over);
        assert_eq!((st.over_since, st.calm_since), (Some(secs(10)), None));
        st.observe(&s, LEVELS, secs(20), Reading::Calm);
        assert_eq!((st.over_since, st.calm_since), (None, Some(secs(20))));
    }

    #[test]
    fn cooldown_blocks_a_step_down() {
        let s = settings();
        let mut st = State::new(Level::Full);
        let steps = feed(&mut st, &s, Reading::Over, 0, 200);
        // Down at 30 (sustain). The fresh streak starts at 40, sustained at 70, but the
        // cooldown from 30 runs to 90.
        assert_eq!(steps.iter().map(|(t, _)| *t).collect::<Vec<_>>(), vec![30, 90]);
        assert_eq!(st.level, Level::EtcdOnly);
    }

    #[test]
    fn cooldown_blocks_a_step_up_after_a_step_down() {
        let s = settings();
        let mut st = State::new(Level::Full);
        st.observe(&s, LEVELS, secs(0), Reading::Over);
        let step = st.observe(&s, LEVELS, secs(30), Reading::Over).unwrap();
        st.step_ran(secs(30), step.to);
        // Calm from 40: sustained at 70, cooled only at 90.
        assert_eq!(st.observe(&s, LEVELS, secs(40), Reading::Calm), None);
        assert_eq!(st.observe(&s, LEVELS, secs(70), Reading::Calm), None, "sustained but not cooled");
        assert_eq!(st.observe(&s, LEVELS, secs(89), Reading::Calm), None);
        let up = st.observe(&s, LEVELS, secs(90), Reading::Calm).unwrap();
        assert_eq!(up.direction, Direction::Up);
        assert_eq!((up.from, up.to), (Level::ControlPlane, Level::Full));
    }

    #[test]
    fn a_second_step_needs_a_fresh_streak() {
        let s = Settings { cooldown: Duration::ZERO, ..settings() };
        let mut st = State::new(Level::Full);
        st.observe(&s, LEVELS, secs(0), Reading::Over);
        let step = st.observe(&s, LEVELS, secs(30), Reading::Over).unwrap();
        st.step_ran(secs(30), step.to);
        // With no cooldown, the old streak (from 0) must not carry over.
        assert_eq!(st.observe(&s, LEVELS, secs(40), Reading::Over), None);
        assert_eq!(st.observe(&s, LEVELS, secs(69), Reading::Over), None);
        assert_eq!(st.observe(&s, LEVELS, secs(70), Reading::Over).unwrap().to, Level::EtcdOnly);
    }

    #[test]
    fn manual_never_steps_up_by_itself() {
        let s = Settings { step_up: StepUp::Manual, ..settings() };
        let mut st = State::new(Level::EtcdOnly);
        assert!(feed(&mut st, &s, Reading::Calm, 0, 100_000).is_empty());
        assert_eq!(st.level, Level::EtcdOnly);
        assert_eq!(st.next_step_at(&s, LEVELS), None);
    }

    #[test]
    fn never_below_the_lowest_or_above_full() {
        let s = settings();
        let mut st = State::new(Level::EtcdOnly);
        assert!(feed(&mut st, &s, Reading::Over, 0, 10_000).is_empty());
        let mut st = State::new(Level::Full);
        assert!(feed(&mut st, &s, Reading::Calm, 0, 10_000).is_empty());
        // An actuator with fewer levels bounds the steps the same way.
        let two = [Level::Full, Level::ControlPlane];
        let mut st = State::new(Level::ControlPlane);
        st.observe(&s, &two, secs(0), Reading::Over);
        assert_eq!(st.observe(&s, &two, secs(1000), Reading::Over), None);
    }

    #[test]
    fn a_refused_step_changes_nothing_and_is_proposed_again() {
        let s = settings();
        let mut st = State::new(Level::Full);
        st.observe(&s, LEVELS, secs(0), Reading::Over);
        let first = st.observe(&s, LEVELS, secs(30), Reading::Over).unwrap();
        let before = st;
        // Refused: the caller does not call step_ran.
        let again = st.observe(&s, LEVELS, secs(40), Reading::Over).unwrap();
        assert_eq!(first, again);
        assert_eq!(st, before, "the refusal left the state as the sample made it");
        assert_eq!(st.last_step, None);
    }

    #[test]
    fn a_failed_step_starts_the_cooldown_at_the_old_level() {
        let s = settings();
        let mut st = State::new(Level::ControlPlane);
        st.observe(&s, LEVELS, secs(0), Reading::Over);
        let step = st.observe(&s, LEVELS, secs(30), Reading::Over).unwrap();
        st.step_ran(secs(30), step.from); // failed: k3s restored at the previous level
        assert_eq!(st.level, Level::ControlPlane);
        assert_eq!(st.observe(&s, LEVELS, secs(40), Reading::Over), None);
        assert_eq!(st.observe(&s, LEVELS, secs(80), Reading::Over), None, "cooling down");
        assert!(st.observe(&s, LEVELS, secs(90), Reading::Over).is_some());
    }

    #[test]
    fn next_step_at_is_the_later_of_sustain_and_cooldown() {
        let s = settings();
        let mut st = State::new(Level::Full);
        st.observe(&s, LEVELS, secs(5), Reading::Over);
        assert_eq!(st.next_step_at(&s, LEVELS).unwrap().1, secs(35));
        st.step_ran(secs(35), Level::ControlPlane);
        st.observe(&s, LEVELS, secs(40), Reading::Over);
        assert_eq!(st.next_step_at(&s, LEVELS).unwrap().1, secs(95));
        st.observe(&s, LEVELS, secs(50), Reading::Neither);
        assert_eq!(st.next_step_at(&s, LEVELS), None);
    }

    const MIB: u64 = 1 << 20;

    const LIMITS: DistressLimits =
        DistressLimits { wal_fsync_p99: Duration::from_millis(100), backend_commit_p99: Duration::from_millis(100) };

    fn cost() -> EtcdOnlyCost {
        EtcdOnlyCost { hold: true, drain_freed_at_least: 64 * MIB, limits: LIMITS }
    }

    const INTO_ETCD_ONLY: Step = Step { direction: Direction::Down, from: Level::ControlPlane, to: Level::EtcdOnly };

    #[test]
    fn the_step_into_etcd_only_goes_on_when_the_drain_freed_something_or_the_member_is_well() {
        let c = cost();
        let well = MemberSignals { healthy: Some(true), ..Default::default() };
        let unwell = MemberSignals { healthy: Some(false), ..Default::default() };
        // The held arm's case, measured: nothing freed, 20 MiB available, a calm
        // member: go on (the restart ended the thrash under the floor).
        assert_eq!(weigh_etcd_only(&c, &INTO_ETCD_ONLY, Some(0), &well), None);
        // The drain freed something: the next step is the one that helps, go on.
        assert_eq!(weigh_etcd_only(&c, &INTO_ETCD_ONLY, Some(64 * MIB as i64), &unwell), None);
        // Not known what the drain freed: taken as nothing.
        let h = weigh_etcd_only(&c, &INTO_ETCD_ONLY, None, &unwell).unwrap();
        assert!(h.to_string().contains("not known"), "{h}");
        // Turned off, or another step: never held.
        assert_eq!(weigh_etcd_only(&EtcdOnlyCost { hold: false, ..c }, &INTO_ETCD_ONLY, Some(0), &unwell), None);
        let into_cp = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };
        assert_eq!(weigh_etcd_only(&c, &into_cp, Some(0), &unwell), None);
        let up = Step { direction: Direction::Up, from: Level::EtcdOnly, to: Level::ControlPlane };
        assert_eq!(weigh_etcd_only(&c, &up, Some(0), &unwell), None);
    }

    #[test]
    fn the_step_into_etcd_only_is_held_while_the_member_is_in_distress() {
        let c = cost();
        let held = |m: MemberSignals| weigh_etcd_only(&c, &INTO_ETCD_ONLY, Some(0), &m);
        let unhealthy = held(MemberSignals { healthy: Some(false), ..Default::default() }).unwrap();
        assert_eq!(unhealthy.why, HeldBecause::MemberInDistress(Distress::NotHealthy));
        let slow_fsync = held(MemberSignals { wal_fsync_p99: Some(Duration::from_millis(100)), ..Default::default() });
        assert!(slow_fsync.unwrap().to_string().contains("etcd.wal_fsync_p99_limit"));
        let slow_commit =
            held(MemberSignals { backend_commit_p99: Some(Duration::from_millis(250)), ..Default::default() });
        assert!(slow_commit.unwrap().to_string().contains("etcd.backend_commit_p99_limit"));
        // Under the limits, or unknown: go on.
        let fine = MemberSignals {
            healthy: Some(true),
            wal_fsync_p99: Some(Duration::from_millis(99)),
            backend_commit_p99: Some(Duration::from_millis(99)),
        };
        assert_eq!(held(fine), None);
        assert_eq!(held(MemberSignals::default()), None);
    }
}
