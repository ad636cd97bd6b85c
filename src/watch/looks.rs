//! What `watch` looks at beside its samples: the local etcd member
//! (`etcd::member::Looker`) and the host's units (`census::Reader`). Not on a timer while calm: a look every
//! `etcd.metrics_interval` only while `watch` is pressed — not resting on the PSI
//! trigger (`Pacer::resting`: pressure, a fire within the hold, a level below the
//! top, something pending) — and one when a scrape asks, unless the last is younger
//! than that interval. Calm at the top, the task waits on a channel and a `Notify`,
//! with no timer in tokio's wheel: it costs no wake-up
//! (`watch::tests::a_calm_watch_never_looks_on_a_timer`, tests/bench/watch_footprint.sh).
//!
//! Why sleeping through calm loses nothing: the member's distress counts only with
//! PSI over the threshold (`Settings::over_by_distress`), and the trigger fires on the
//! first 2-second window stalled that much, before any average can be over
//! (`psi_trigger`); looks start at that fire. Without a trigger they start at the
//! first sample that is not calm, which comes before an over one unless pressure
//! jumps from under `calm_threshold` to over `threshold` between two samples; then the
//! member's signals count from the next look, a sample or so later.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::etcd::member;

/// One round of looking.
pub struct Looking {
    pub member: Option<member::Looker>,
    /// The host's units (`census.slice`'s children): whose memory grows.
    pub units: Option<crate::census::Reader>,
}

impl Looking {
    async fn round(&mut self) {
        // The units first: local files, read in a few hundred µs.
        if let Some(u) = &mut self.units {
            u.read_and_publish();
        }
        if let Some(m) = &mut self.member {
            m.look_and_publish().await;
        }
    }
}

/// The handle `watch` (and the metrics listener) tell the looking task through.
#[derive(Clone)]
pub struct Looks(Arc<Demand>);

struct Demand {
    /// Looks every `every` while true.
    pressed: watch::Sender<bool>,
    /// A scrape asks for a look now.
    asked: Notify,
    /// Rounds done, and asks answered: an asker waits for it to move.
    answered: watch::Sender<u64>,
    /// When the last round started.
    last: Mutex<Option<Instant>>,
    every: Duration,
}

impl Demand {
    fn fresh(&self) -> bool {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t.elapsed() < self.every)
    }
}

impl Looks {
    /// Spawns the looking task (on the current runtime). Pressed at first: nothing
    /// says calm before the first sample, so `watch` looks once at start.
    pub fn spawn(every: Duration, looking: Looking) -> Looks {
        let demand = Arc::new(Demand {
            pressed: watch::Sender::new(true),
            asked: Notify::new(),
            answered: watch::Sender::new(0),
            last: Mutex::new(None),
            every,
        });
        tokio::spawn(run(demand.clone(), looking));
        Looks(demand)
    }

    /// After each sample: `pressed` is `!Pacer::resting()`.
    pub fn set_pressed(&self, pressed: bool) {
        self.0.pressed.send_if_modified(|p| std::mem::replace(p, pressed) != pressed);
    }

    /// Rounds done and asks answered so far.
    pub fn answered(&self) -> u64 {
        *self.0.answered.borrow()
    }

    /// A look now, unless the last is younger than `every`; waits for it at most
    /// `bound` (a hung member is bounded by `etcd.request_timeout` per request).
    pub async fn ask(&self, bound: Duration) {
        if self.0.fresh() {
            return;
        }
        let mut answered = self.0.answered.subscribe();
        let seen = *answered.borrow_and_update();
        self.0.asked.notify_one();
        let _ = tokio::time::timeout(bound, answered.wait_for(|n| *n > seen)).await;
    }

    /// [`Looks::ask`] as the metrics listener calls it before it renders `/metrics`.
    pub fn on_scrape(&self, bound: Duration) -> crate::metrics::OnScrape {
        let looks = self.clone();
        Arc::new(move || {
            let looks = looks.clone();
            Box::pin(async move { looks.ask(bound).await }) as Pin<Box<dyn Future<Output = ()> + Send>>
        })
    }
}

async fn run(demand: Arc<Demand>, mut looking: Looking) {
    let mut pressed = demand.pressed.subscribe();
    loop {
        let due = *pressed.borrow_and_update() && !demand.fresh();
        if !due {
            // Pressed with a fresh look: until the next is due. At rest: no timer at all.
            let next = demand.last.lock().unwrap_or_else(|p| p.into_inner()).map(|t| t + demand.every);
            let next = next.filter(|_| *pressed.borrow());
            let wait_out = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = pressed.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
                _ = demand.asked.notified() => {
                    if demand.fresh() {
                        demand.answered.send_modify(|n| *n += 1);
                        continue;
                    }
                }
                _ = wait_out => {}
            }
        }
        *demand.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        looking.round().await;
        demand.answered.send_modify(|n| *n += 1);
    }
}
