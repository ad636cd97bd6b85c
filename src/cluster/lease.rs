//! The Lease that serialises steps across servers (docs/behaviour.md, "Coordination"): `coordination.k8s.io/v1`,
//! default `kube-system/regrade`. Every write carries the `resourceVersion` just read,
//! so of two servers writing at once one gets 409 and loses.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::Api;
// tokio's clock, so paused-time tests can drive the renewals and the expiry by our
// own clock.
use tokio::time::Instant;

use super::endpoints::{CallError, Endpoints};
use super::{Refusal, RefusalKind};

/// Beyond `renewTime + leaseDurationSeconds`, how long a Lease is still taken as held:
/// room for the clocks of two servers to disagree.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// How soon a renewal that failed is tried again (or sooner, every third of a short
/// Lease): well within the lease duration, not a whole renewal period later.
pub const RENEW_RETRY: Duration = Duration::from_secs(2);

/// How long a step may go on after the last renewal that landed: the lease duration
/// less a quarter of it. Another server takes the Lease over no sooner than the lease
/// duration plus [`EXPIRY_MARGIN`] after it saw that write, so the step stops with a
/// quarter of the duration and the margin to spare.
pub fn safe_for(duration: Duration) -> Duration {
    duration - duration / 4
}

pub struct LeaseLock {
    pub namespace: String,
    pub name: String,
    /// Who we are in `holderIdentity`: the Node name and the process.
    pub identity: String,
    pub duration: Duration,
    /// The Lease as we last wrote it while holding it.
    held: RefCell<Option<Lease>>,
    /// When the last write of ours that landed was sent (taking or renewing the
    /// Lease): the Lease is ours for sure until [`safe_for`] after it.
    landed: Cell<Option<Instant>>,
    /// A Lease held by another: its `resourceVersion` and when we first saw it. If it
    /// has not changed for the lease duration plus the margin, it has expired by our
    /// own clock, whatever its `renewTime` says.
    observed: RefCell<Option<(String, Instant)>>,
}

/// What a look at the Lease found.
enum Seen {
    Absent,
    Free(Lease),
    Ours(Lease),
    Expired(Lease),
    Held { holder: String, lease: Lease },
}

impl LeaseLock {
    pub fn new(namespace: &str, name: &str, identity: String, duration: Duration) -> LeaseLock {
        LeaseLock {
            namespace: namespace.into(),
            name: name.into(),
            identity,
            duration,
            held: RefCell::new(None),
            landed: Cell::new(None),
            observed: RefCell::new(None),
        }
    }

    fn what(&self, verb: &str) -> String {
        format!("{verb} leases {}/{}", self.namespace, self.name)
    }

    fn api(&self, c: kube::Client) -> Api<Lease> {
        Api::namespaced(c, &self.namespace)
    }

    async fn get(&self, eps: &Endpoints) -> Result<Option<Lease>, CallError> {
        eps.call(self.what("get"), |c| async move { self.api(c).get_opt(&self.name).await }).await
    }

    fn classify(&self, lease: Option<Lease>) -> Seen {
        let Some(lease) = lease else { return Seen::Absent };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        if holder.is_empty() {
            return Seen::Free(lease);
        }
        if holder == self.identity {
            return Seen::Ours(lease);
        }
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        let now = Instant::now();
        let first_seen = {
            let mut obs = self.observed.borrow_mut();
            match &*obs {
                Some((seen_rv, at)) if *seen_rv == rv => *at,
                _ => {
                    *obs = Some((rv, now));
                    now
                }
            }
        };
        let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64);
        // Only our own observation counts: `renewTime` is the holder's wall clock,
        // and a reader whose clock runs ahead would see a live Lease as expired.
        if now.duration_since(first_seen) >= duration + EXPIRY_MARGIN {
            Seen::Expired(lease)
        } else {
            Seen::Held { holder, lease }
        }
    }

    fn held_refusal(&self, holder: &str, lease: &Lease) -> Refusal {
        let spec = lease.spec.as_ref();
        let renewed = spec.and_then(|s| s.renew_time.as_ref()).map_or("never".to_string(), |t| t.0.to_string());
        let secs = spec.and_then(|s| s.lease_duration_seconds).unwrap_or(0);
        Refusal {
            kind: RefusalKind::LeaseHeld,
            subject: holder.to_string(),
            message: format!(
                "Lease {}/{} is held by {holder} (renewed {renewed}, for {secs}s)",
                self.namespace, self.name
            ),
        }
    }

    /// Whether the Lease is free for us now, read only (for `status`).
    pub async fn check(&self, eps: &Endpoints) -> Result<(), Refusal> {
        match self.classify(self.get(eps).await.map_err(unreachable)?) {
            Seen::Held { holder, lease } => Err(self.held_refusal(&holder, &lease)),
            _ => Ok(()),
        }
    }

    /// Takes the Lease: creates it when absent, takes it when free, expired or already
    /// ours. A held Lease, or losing a race for it (409), refuses.
    pub async fn acquire(&self, eps: &Endpoints) -> Result<(), Refusal> {
        let seen = self.classify(self.get(eps).await.map_err(unreachable)?);
        let now = MicroTime(super::clock::wall_now());
        let sent = Instant::now();
        // Who won is not known here; the next look at the Lease names them.
        let lost = || Refusal {
            kind: RefusalKind::LeaseHeld,
            subject: format!("{}/{}", self.namespace, self.name),
            message: format!("another server took Lease {}/{} at the same moment", self.namespace, self.name),
        };
        let written = match seen {
            Seen::Held { holder, lease } => return Err(self.held_refusal(&holder, &lease)),
            Seen::Absent => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        namespace: Some(self.namespace.clone()),
                        ..Default::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(self.duration_secs()),
                        acquire_time: Some(now.clone()),
                        renew_time: Some(now),
                        lease_transitions: Some(0),
                        ..Default::default()
                    }),
                };
                let lease = &lease;
                let r =
                    eps.call(self.what("create"), |c| async move {
                        self.api(c).create(&PostParams::default(), lease).await
                    })
                    .await;
                match r {
                    Ok(l) => l,
                    Err(e) if e.code() == Some(409) => return Err(lost()),
                    Err(e) => return Err(unreachable(e)),
                }
            }
            Seen::Free(mut lease) | Seen::Expired(mut lease) | Seen::Ours(mut lease) => {
                let spec = lease.spec.get_or_insert_with(Default::default);
                if spec.holder_identity.as_deref() != Some(&self.identity) {
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                    spec.acquire_time = Some(now.clone());
                }
                spec.holder_identity = Some(self.identity.clone());
                spec.lease_duration_seconds = Some(self.duration_secs());
                spec.renew_time = Some(now);
                match self.replace(eps, &lease).await {
                    Ok(l) => l,
                    Err(e) if e.is_conflict() => return Err(lost()),
                    Err(e) => return Err(unreachable(e)),
                }
            }
        };
        *self.held.borrow_mut() = Some(written);
        self.landed.set(Some(sent));
        *self.observed.borrow_mut() = None;
        Ok(())
    }

    fn duration_secs(&self) -> i32 {
        self.duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }

    /// PUT with the object's `resourceVersion`: 409 if anyone wrote since.
    async fn replace(&self, eps: &Endpoints, lease: &Lease) -> Result<Lease, CallError> {
        eps.call(self.what("update"), |c| async move {
            self.api(c).replace(&self.name, &PostParams::default(), lease).await
        })
        .await
    }

    /// Until when the Lease is surely ours: [`safe_for`] its duration after the last
    /// write of ours that landed. `None`: not surely ours at all (never taken,
    /// released, or lost to another holder).
    pub fn safe_until(&self) -> Option<Instant> {
        self.landed.get().map(|t| t + safe_for(self.duration))
    }

    /// Renews the Lease every third of its duration for as long as it is held; a
    /// renewal that fails is tried again after [`RENEW_RETRY`]. Returns only when the
    /// Lease is lost (another holder, or released behind our back). A Lease that
    /// cannot be renewed is not given up here: [`safe_until`](Self::safe_until) stops
    /// advancing, and the step stops by it.
    pub async fn hold(&self, eps: &Endpoints) -> anyhow::Error {
        let period = self.duration / 3;
        let retry = RENEW_RETRY.min(period);
        let mut next = self.landed.get().unwrap_or_else(Instant::now) + period;
        loop {
            tokio::time::sleep_until(next).await;
            let Some(mut lease) = self.held.borrow().clone() else {
                return anyhow::anyhow!("Lease {}/{} is not held", self.namespace, self.name);
            };
            if let Some(spec) = lease.spec.as_mut() {
                spec.renew_time = Some(MicroTime(super::clock::wall_now()));
            }
            let sent = Instant::now();
            next = sent + retry;
            match self.replace(eps, &lease).await {
                Ok(l) => {
                    *self.held.borrow_mut() = Some(l);
                    self.landed.set(Some(sent));
                    next = sent + period;
                }
                Err(e) if e.is_conflict() => match self.get(eps).await {
                    // Our own earlier write that we did not hear back from: adopt it,
                    // and renew from it at once (when it was sent is not known).
                    Ok(Some(l)) if holder_of(&l) == self.identity => {
                        *self.held.borrow_mut() = Some(l);
                        next = Instant::now();
                    }
                    Ok(l) => {
                        *self.held.borrow_mut() = None;
                        // Surely ours no longer, from now: no restart is asked for after
                        // this. (It was `now - safe_for`, which within that long of the
                        // machine's boot is no instant at all, and was read as no bound.)
                        self.landed.set(None);
                        let who = l.as_ref().map(holder_of).unwrap_or_default();
                        return anyhow::anyhow!(
                            "lost Lease {}/{} to {}",
                            self.namespace,
                            self.name,
                            if who.is_empty() { "nobody (released)" } else { &who }
                        );
                    }
                    Err(e) => tracing::warn!(error = %e, "could not read the Lease after a conflict; retrying"),
                },
                Err(e) => tracing::warn!(
                    error = %e,
                    retry_in = ?retry,
                    since_renewed = ?self.landed.get().map(|t| t.elapsed()),
                    "could not renew the Lease; retrying"
                ),
            }
        }
    }

    /// Gives the Lease up if we still hold it; a no-op otherwise. Retries a 409 caused
    /// by our own renewal racing the release.
    pub async fn release(&self, eps: &Endpoints) {
        self.held.borrow_mut().take();
        self.landed.set(None);
        for _ in 0..3 {
            let mut lease = match self.get(eps).await {
                Ok(Some(l)) if holder_of(&l) == self.identity => l,
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "could not release the Lease; it expires by itself");
                    return;
                }
            };
            if let Some(spec) = lease.spec.as_mut() {
                spec.holder_identity = None;
            }
            match self.replace(eps, &lease).await {
                Ok(_) => {
                    tracing::info!(lease = %format!("{}/{}", self.namespace, self.name), "released the Lease");
                    return;
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "could not release the Lease; it expires by itself");
                    return;
                }
            }
        }
    }
}

pub fn holder_of(l: &Lease) -> String {
    l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default()
}

/// A call that failed before the Lease could be judged refuses the step.
pub fn unreachable(e: CallError) -> Refusal {
    Refusal {
        kind: if e.is_unreachable() { RefusalKind::ApiUnreachable } else { RefusalKind::ApiError },
        subject: e.subject(),
        message: e.to_string(),
    }
}
