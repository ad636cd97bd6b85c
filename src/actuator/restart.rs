//! The one place a restart of k3s is sent (ARCHITECTURE.md, "Every restart is sent in
//! one place"): forward, the undoing of a failed restart, the rollback after a cut, a
//! resumed step; by the systemd and the Docker actuator, and by the simulator's k3s.
//!
//! The rule, kept here and nowhere else:
//! 1. what takes long comes first: connecting to the bus and reading the unit's or
//!    the container's state (by the actuator, before it calls [`send`]), then the
//!    durable write of the file the restart reads and the phase in the level record;
//! 2. then the look, with nothing left to wait on after it: the restart allowed at its
//!    moment ([`NodeReadiness::may_restart`]: the Lease surely held, the etcd gate's
//!    yes, the Lease looked at again);
//! 3. and the request leaves only if it reaches the manager within its own timeout
//!    before the Lease's safe bound ([`NodeReadiness::restart_bound`], read fresh: a
//!    renewal that lands moves it on). What could not is not started: [`NotSent`],
//!    and the step is left for the resume path under a fresh Lease. (Looked at before
//!    the write too, so a request that cannot fit writes nothing.)
//!
//! Checked once, then I/O of unbounded length before the act, was the fault found
//! three times on three paths (the gate not asked at the restart, the rollback after a
//! Lease stop, the rollback after a deadline): here the look and the bound travel with
//! the request.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::time::Instant;

use super::{NodeReadiness, UndoPending};
use crate::kill_point;
use crate::level_record::Phase;
use crate::units::format_duration;

/// Why a restart is sent: the phases recorded before it differ, and so does what
/// "not allowed now" means for the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Into the step's level (also a resumed step): `writing` before the file,
    /// `restarting` before the request. Not allowed or not sent: the step fails with
    /// k3s as it was (the file put back by the actuator).
    Forward,
    /// Back into the step's `from` (the undoing of a failed restart, the rollback
    /// after a cut): `restoring` before anything. Not allowed or not sent: an
    /// [`UndoPending`], so the level record keeps the undoing for the resume path.
    Back,
}

/// A restart request as an actuator sends it.
pub struct Request<'a> {
    pub purpose: Purpose,
    /// What is restarted into what, for the messages ("k3s.service into etcd-only").
    pub what: String,
    /// The longest the request takes from its start until it has reached the manager
    /// (systemd's RestartUnit answered or given up; the Engine's restart request
    /// written): it is started only this long before the Lease's safe bound. The ask
    /// keeps to it itself (a Docker restart's answer comes after the stop and the
    /// start, and must not be cut: the Engine could take the cut for a cancel).
    pub timeout: Duration,
    /// The durable write of the file the restart reads (`None`: nothing to write).
    pub write: Option<Write<'a>>,
}

/// The durable write a restart reads, run by [`send`] inside the request's bound.
pub type Write<'a> = Pin<Box<dyn Future<Output = anyhow::Result<()>> + 'a>>;

/// `write` as a [`Write`]: the actuators' writes are plain calls (a file and its
/// directory fsynced).
pub fn write<'a>(write: impl FnOnce() -> anyhow::Result<()> + 'a) -> Write<'a> {
    Box::pin(async move { write() })
}

/// The restart was not asked for: it could not have been answered before the Lease's
/// safe bound. `wrote`: the file the restart reads was written already.
#[derive(Debug)]
pub struct NotSent {
    pub what: String,
    pub wrote: bool,
    pub why: String,
}

impl std::fmt::Display for NotSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the restart of {} was not asked for: {}", self.what, self.why)
    }
}

impl std::error::Error for NotSent {}

/// Sends one restart under the rule above: `ask` is the request itself, started at
/// most once, only if it reaches the manager before the Lease's safe bound. `Err`: the
/// restart was refused or not sent (nothing asked; [`NotSent`] for the bound; for
/// [`Purpose::Back`] either is an [`UndoPending`]), the write failed (nothing asked),
/// or the request failed (what the ask says).
pub async fn send<T, F>(readiness: &dyn NodeReadiness, mut request: Request<'_>, ask: F) -> anyhow::Result<T>
where
    F: Future<Output = anyhow::Result<T>>,
{
    let purpose = request.purpose;
    if purpose == Purpose::Back {
        readiness.progress(Phase::Restoring);
    }
    let pending = |e: anyhow::Error| match purpose {
        Purpose::Forward => e,
        Purpose::Back => {
            let e = format!("{e:#}");
            tracing::error!(error = %e, "the undoing waits for a restart to be allowed and sent under the Lease");
            anyhow::Error::new(UndoPending(e))
        }
    };
    // Not even the request fits before the bound: nothing is written.
    within_bound(readiness, &request, false).map_err(|e| pending(e.into()))?;
    let wrote = request.write.is_some();
    if let Some(write) = request.write.take() {
        if purpose == Purpose::Forward {
            readiness.progress(Phase::Writing);
        }
        write.await?;
        kill_point::reached("after-dropin");
    }
    if purpose == Purpose::Forward {
        readiness.progress(Phase::Restarting);
    }
    // The look, after the slow parts (the durable writes of the file and of the level
    // record, seconds on a disk the thrash keeps busy): between its answer and the
    // request there is nothing left to wait on.
    if let Err(no) = readiness.may_restart().await {
        return Err(pending(no.context(format!("restarting {}: not allowed now", request.what))));
    }
    within_bound(readiness, &request, wrote).map_err(|e| pending(e.into()))?;
    ask.await
}

/// The request may start now: its timeout ends before the Lease's safe bound.
fn within_bound(readiness: &dyn NodeReadiness, request: &Request<'_>, wrote: bool) -> Result<(), NotSent> {
    let Some(bound) = readiness.restart_bound() else { return Ok(()) };
    let now = Instant::now();
    if now + request.timeout <= bound {
        return Ok(());
    }
    let why = match bound.saturating_duration_since(now) {
        left if left.is_zero() => "the Lease is no longer surely this server's (no renewal landed within \
                                   cluster.lease_duration less a quarter, or it was lost)"
            .to_string(),
        left => format!(
            "the Lease is surely this server's for {} more, and the request may take up to {}: it could land after \
             another server took the Lease over",
            format_duration(left),
            format_duration(request.timeout)
        ),
    };
    let e = NotSent { what: request.what.clone(), wrote, why };
    tracing::error!(error = %e, "restart not sent");
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};
    use std::time::SystemTime;

    /// A step's view of the Lease: allowed, and surely held until `bound`.
    struct Lease {
        bound: Cell<Option<Instant>>,
        refuse: bool,
        phases: RefCell<Vec<Phase>>,
    }

    #[async_trait::async_trait(?Send)]
    impl NodeReadiness for Lease {
        async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
            Ok(())
        }
        async fn may_restart(&self) -> anyhow::Result<()> {
            if self.refuse {
                anyhow::bail!("etcd member server3: unreachable");
            }
            Ok(())
        }
        fn restart_bound(&self) -> Option<Instant> {
            self.bound.get()
        }
        fn progress(&self, phase: Phase) {
            self.phases.borrow_mut().push(phase);
        }
    }

    fn lease(for_: Duration) -> Lease {
        Lease { bound: Cell::new(Some(Instant::now() + for_)), refuse: false, phases: RefCell::default() }
    }

    fn request<'a>(purpose: Purpose, write: impl FnOnce() -> anyhow::Result<()> + 'a) -> Request<'a> {
        Request {
            purpose,
            what: "k3s.service into etcd-only".into(),
            timeout: Duration::from_secs(20),
            write: Some(super::write(write)),
        }
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap().block_on(f)
    }

    #[test]
    fn a_request_that_fits_before_the_bound_is_sent_after_its_write_and_phases() {
        block_on(async {
            let l = lease(Duration::from_secs(30));
            let wrote = Cell::new(false);
            let write = || {
                wrote.set(true);
                Ok(())
            };
            let asked = send(&l, request(Purpose::Forward, write), async { anyhow::Ok("asked") }).await;
            assert_eq!(asked.unwrap(), "asked");
            assert!(wrote.get());
            assert_eq!(*l.phases.borrow(), [Phase::Writing, Phase::Restarting]);
        });
    }

    /// The rule's heart: with 15 s of the Lease left, a request that may take 20 s is
    /// not started — neither its write nor its ask.
    #[test]
    fn a_request_that_could_land_after_the_bound_is_not_started() {
        block_on(async {
            let l = lease(Duration::from_secs(15));
            let write = || panic!("written although the request could not be sent");
            let e = send::<(), _>(&l, request(Purpose::Forward, write), async { panic!("asked past the bound") })
                .await
                .unwrap_err();
            let not_sent = e.downcast_ref::<NotSent>().expect("not sent");
            assert!(!not_sent.wrote && not_sent.why.contains("15s more"), "{not_sent}");
            assert!(l.phases.borrow().is_empty(), "nothing recorded");
        });
    }

    /// A slow write (its fsync under the thrash) eats the room: looked at again after
    /// it, the request is not sent, and says the file was written.
    #[test]
    fn the_bound_is_looked_at_again_after_the_write() {
        block_on(async {
            let l = lease(Duration::from_secs(25));
            let write = || {
                // The write "took" 10 s: the bound comes 10 s closer.
                let b = l.bound.get().unwrap();
                l.bound.set(Some(b - Duration::from_secs(10)));
                Ok(())
            };
            let e = send::<(), _>(&l, request(Purpose::Forward, write), async { panic!("asked past the bound") })
                .await
                .unwrap_err();
            assert!(e.downcast_ref::<NotSent>().expect("not sent").wrote);
        });
    }

    /// Back: refused or not sent, the undoing is left pending for the resume path.
    #[test]
    fn a_restart_back_that_cannot_go_now_leaves_the_undoing_pending() {
        block_on(async {
            let mut l = lease(Duration::from_secs(5));
            let write = || Ok(());
            let e = send(&l, request(Purpose::Back, write), async { anyhow::Ok(()) }).await.unwrap_err();
            assert!(e.downcast_ref::<UndoPending>().is_some(), "{e:#}");
            assert_eq!(*l.phases.borrow(), [Phase::Restoring], "recorded before anything");
            l.refuse = true;
            l.bound.set(Some(Instant::now() + Duration::from_secs(60)));
            let e = send(&l, request(Purpose::Back, write), async { anyhow::Ok(()) }).await.unwrap_err();
            let pending = e.downcast_ref::<UndoPending>().expect("pending");
            assert!(pending.0.contains("server3"), "{pending}");
        });
    }
}
