//! Property tests of the decision core (docs/behaviour.md, "Decision rules") over
//! random traces and settings: the invariants that must hold whatever the pressure does.

use std::time::Duration;

use proptest::prelude::*;
use regrade::decide::StepUp;
use regrade::decide::{Direction, DistressLimits, MemberSignals, Reading, Settings, State};
use regrade::level::Level;
use regrade::sample::{Metric, Sample};

fn settings() -> impl Strategy<Value = Settings> {
    (0.0f64..100.0, 0.0f64..1.0, proptest::option::of(0u64..4096), 1u64..120, 0u64..300, any::<bool>(), any::<bool>())
        .prop_map(|(threshold, calm_frac, floor, sustain, cooldown, manual, distress)| Settings {
            metric: Metric::SomeAvg10,
            threshold,
            calm_threshold: threshold * calm_frac,
            mem_available_floor: floor,
            distress_overrides_floor: distress.then_some(LIMITS),
            sustain: Duration::from_secs(sustain),
            cooldown: Duration::from_secs(cooldown),
            step_up: if manual { StepUp::Manual } else { StepUp::Automatic },
        })
}

const LIMITS: DistressLimits =
    DistressLimits { wal_fsync_p99: Duration::from_secs(1), backend_commit_p99: Duration::from_secs(1) };

/// The local etcd member's look: healthy, not healthy, or none.
fn member(healthy: Option<bool>) -> MemberSignals {
    MemberSignals { healthy, ..Default::default() }
}

/// A trace: (seconds since the previous sample, pressure, MemAvailable, refused?, the
/// member's health).
type Trace = Vec<(u64, f64, u64, bool, Option<bool>)>;

fn trace() -> impl Strategy<Value = Trace> {
    prop::collection::vec(
        (1u64..30, 0.0f64..100.0, 0u64..8192, prop::bool::weighted(0.2), proptest::option::of(any::<bool>())),
        1..400,
    )
}

fn levels() -> impl Strategy<Value = Vec<Level>> {
    prop_oneof![
        Just(Level::ALL.to_vec()),
        Just(vec![Level::Full, Level::EtcdOnly]),
        Just(vec![Level::Full, Level::ControlPlane]),
    ]
}

#[derive(Debug)]
struct Ran {
    t: Duration,
    direction: Direction,
    from: Level,
    to: Level,
}

/// Runs the trace through the core; steps are refused where the trace says so.
fn run(s: &Settings, levels: &[Level], start: Level, trace: &[(u64, f64, u64, bool, Option<bool>)]) -> Vec<Ran> {
    let mut state = State::new(start);
    let mut t = Duration::ZERO;
    let mut ran = vec![];
    for &(dt, p, avail, refused, healthy) in trace {
        t += Duration::from_secs(dt);
        let mut sample = Sample::default();
        sample.psi.some[0] = p;
        sample.mem_available = avail;
        let before = state;
        if let Some(step) = state.observe(s, levels, t, s.classify(&sample, &member(healthy))) {
            assert_eq!(step.from, before.level, "a step starts at the current level");
            if refused {
                continue;
            }
            state.step_ran(t, step.to);
            ran.push(Ran { t, direction: step.direction, from: step.from, to: step.to });
        }
    }
    ran
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn steps_respect_cooldown_sustain_and_bounds(
        s in settings(), levels in levels(), start_idx in 0usize..3, trace in trace()
    ) {
        let start = levels[start_idx % levels.len()];
        let ran = run(&s, &levels, start, &trace);
        let mut level = start;
        for (i, r) in ran.iter().enumerate() {
            // One level per step, from the level it was at, within the actuator's levels.
            prop_assert_eq!(r.from, level);
            let (fi, ti) = (r.from.index_in(&levels).unwrap(), r.to.index_in(&levels).unwrap());
            match r.direction {
                Direction::Down => prop_assert_eq!(ti, fi + 1),
                Direction::Up => prop_assert_eq!(ti + 1, fi),
            }
            // Never two steps closer than cooldown, in either direction.
            if i > 0 {
                prop_assert!(r.t - ran[i - 1].t >= s.cooldown, "steps at {:?} and {:?}", ran[i - 1].t, r.t);
                // Every further step needs a fresh streak observed after the last step,
                // so it comes at least sustain (and one sample) after it.
                prop_assert!(r.t - ran[i - 1].t >= s.sustain);
            }
            // No automatic step up in manual mode.
            if s.step_up == StepUp::Manual {
                prop_assert_eq!(r.direction, Direction::Down);
            }
            level = r.to;
        }
    }

    #[test]
    fn a_neither_sample_always_ends_both_streaks(s in settings(), trace in trace()) {
        let mut state = State::new(Level::ControlPlane);
        let mut t = Duration::ZERO;
        for (dt, p, avail, _, healthy) in trace {
            t += Duration::from_secs(dt);
            let mut sample = Sample::default();
            sample.psi.some[0] = p;
            sample.mem_available = avail;
            let reading = s.classify(&sample, &member(healthy));
            state.observe(&s, &Level::ALL, t, reading);
            match reading {
                Reading::Neither => prop_assert_eq!((state.over_since, state.calm_since), (None, None)),
                Reading::Over => prop_assert!(state.over_since.is_some() && state.calm_since.is_none()),
                Reading::Calm => prop_assert!(state.calm_since.is_some() && state.over_since.is_none()),
            }
        }
    }

    #[test]
    fn a_sample_is_never_over_and_calm_rules_are_exclusive(
        s in settings(), p in 0.0f64..100.0, avail in 0u64..8192, healthy in proptest::option::of(any::<bool>())
    ) {
        let mut sample = Sample::default();
        sample.psi.some[0] = p;
        sample.mem_available = avail;
        // Over: PSI at the threshold and under the floor, or (when on) the member not healthy.
        let distress = s.distress_overrides_floor.is_some() && healthy == Some(false);
        let over = p >= s.threshold && (s.mem_available_floor.is_none_or(|f| avail < f) || distress);
        let calm = p < s.calm_threshold && s.mem_available_floor.is_none_or(|f| avail >= f);
        prop_assert!(!(over && calm));
        let expected = if over { Reading::Over } else if calm { Reading::Calm } else { Reading::Neither };
        prop_assert_eq!(s.classify(&sample, &member(healthy)), expected);
    }
}
