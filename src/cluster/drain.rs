//! The drain on a step down: the Node's pods leave through the Eviction API, so a
//! PodDisruptionBudget can hold one back, the way `kubectl drain --ignore-daemonsets
//! --delete-emptydir-data --force` chooses and evicts them (kured drains the same way).
//!
//! - Chosen: every pod bound to the Node (`spec.nodeName`) except pods a DaemonSet
//!   controls (its controller would put them straight back, and they are the log
//!   shippers, node exporters, CNI and storage agents an operator needs most now) and
//!   mirror pods (the API's copy of a static pod: only the kubelet can remove those).
//!   Pods with `emptyDir` volumes are evicted (their data goes; their memory is what we
//!   want back); so are pods no controller owns (they do not come back; the report
//!   says which they were) and finished pods.
//! - Each chosen pod is evicted (`policy/v1` Eviction, with the pod's UID as a
//!   precondition, so a pod re-created under the same name is not touched). A 429 is a
//!   PodDisruptionBudget saying no: it is retried with backoff and the budget's name,
//!   taken from the answer, is kept for the report. A 409 is retried the same way:
//!   the API server answers it for a UID that no longer matches and also when its
//!   own retries of a conflicting write run out, so only the next list of the Node's
//!   pods says the pod is gone (its UID no longer listed).
//! - Evicted pods are waited for until they are gone (their own grace periods), the
//!   whole drain bounded by `drain_timeout`. At the deadline, `on_drain_timeout =
//!   "proceed"` leaves the rest where they are and names each (with the budget that
//!   holds it); `"delete"` deletes them, as `kubectl drain --disable-eviction` would,
//!   without waiting for them to stop.
//! - A call the API refuses for good (403: a missing RBAC right) ends the drain with
//!   that error, which names the verb and resource.
//!
//! The drain only asks the API server for things; it can be cancelled between any two
//! requests (SIGTERM), and what it already evicted stays evicted.
//!
//! [`choose`] and [`DrainState`] are pure, so selection and the report are tested
//! without an API server; [`drain`] is the loop that talks to it.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::core::Status;
use kube::Api;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::time::Instant;

use super::endpoints::{CallError, Endpoints};

pub use crate::levels::{DrainSettings, OnDrainTimeout, DEFAULT_DRAIN_TIMEOUT};

/// How often the Node's pods are listed while the drain waits.
pub const POLL: Duration = Duration::from_millis(500);
/// The first retry of an eviction a budget refused; doubled each time up to [`BACKOFF_MAX`].
const BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// `kubectl drain` retries a refused eviction every 5 s.
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The annotation the kubelet puts on a static pod's API copy.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A pod, by namespace and name (and UID, which tells a re-created pod apart).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    #[serde(skip)]
    pub uid: String,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl PodRef {
    fn of(pod: &Pod) -> PodRef {
        PodRef {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        }
    }
}

/// Why a pod is left on the Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Skip {
    DaemonSet,
    Mirror,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::DaemonSet => "DaemonSet",
            Skip::Mirror => "mirror pod",
        }
    }
}

/// What the drain does with one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Evict,
    /// Already being deleted (by someone else, or an earlier drain): only wait for it.
    Wait,
    Skip(Skip),
}

/// The choice `kubectl drain --ignore-daemonsets --delete-emptydir-data --force`
/// makes for `pod`.
pub fn choose(pod: &Pod) -> Choice {
    let annotations = pod.metadata.annotations.as_ref();
    if annotations.is_some_and(|a| a.contains_key(MIRROR_ANNOTATION)) {
        return Choice::Skip(Skip::Mirror);
    }
    let controller = pod.metadata.owner_references.iter().flatten().find(|o| o.controller == Some(true));
    if controller.is_some_and(|o| o.kind == "DaemonSet") {
        return Choice::Skip(Skip::DaemonSet);
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Choice::Wait;
    }
    Choice::Evict
}

/// Whether no controller owns `pod` (an evicted one is gone for good).
fn is_bare(pod: &Pod) -> bool {
    !pod.metadata.owner_references.iter().flatten().any(|o| o.controller == Some(true))
}

/// Why an eviction did not happen (yet).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Block {
    /// The PodDisruptionBudget that refused, when the API server named it.
    pub pdb: Option<String>,
    /// The API server's words (e.g. "The disruption budget web needs 2 healthy pods
    /// and has 2 currently").
    pub message: String,
}

/// What an eviction request came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Evicted {
    /// Accepted: the pod is being deleted with its own grace period.
    Yes,
    /// The pod (with this UID) no longer exists.
    Gone,
    /// Refused for now (a budget); try again later.
    Blocked(Block),
    /// Not answered (no API server reachable, a timeout); try again later.
    Retry(String),
    /// Refused for good (a missing right, a bad request): the drain ends.
    Fatal(String),
}

/// Classifies the error of an eviction or delete call.
pub fn classify(e: &CallError) -> Evicted {
    let CallError::Status { status, .. } = e else {
        return if e.is_unreachable() { Evicted::Retry(e.to_string()) } else { Evicted::Fatal(e.to_string()) };
    };
    match status.code {
        404 => Evicted::Gone,
        // A failed UID precondition (a new pod by that name), or the API server's own
        // conflict retries ran out for this very pod: only the next list can tell, and
        // it does (a UID no longer listed is gone), so retry as for a budget.
        409 => Evicted::Blocked(Block { pdb: None, message: status.message.clone() }),
        429 => Evicted::Blocked(block_of(status)),
        // "This pod has more than one PodDisruptionBudget, which the eviction
        // subresource does not support": wait as for a refusal.
        500 if status.message.contains("PodDisruptionBudget") => {
            Evicted::Blocked(Block { pdb: None, message: status.message.clone() })
        }
        500..=599 => Evicted::Retry(e.to_string()),
        _ => Evicted::Fatal(e.to_string()),
    }
}

/// The budget's name from a 429: its `DisruptionBudget` cause reads "The disruption
/// budget NAME needs ..." or "The disruption budget NAME is still being processed ...".
fn block_of(status: &Status) -> Block {
    let cause = status
        .details
        .as_ref()
        .and_then(|d| d.causes.iter().find(|c| c.reason == "DisruptionBudget"))
        .map(|c| c.message.clone());
    let pdb = cause
        .as_deref()
        .and_then(|m| m.strip_prefix("The disruption budget "))
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string);
    Block { pdb, message: cause.unwrap_or_else(|| status.message.clone()) }
}

#[derive(Clone, Debug)]
enum State {
    /// To be evicted when `next_try` comes; `blocked` is the last refusal.
    ToEvict {
        next_try: Instant,
        attempts: u32,
        blocked: Option<Block>,
    },
    /// Evicted (or found terminating): waiting for it to be gone.
    Terminating {
        evicted_by_us: bool,
    },
    /// Deleted after the deadline (`on_drain_timeout = "delete"`).
    Deleted,
    Gone {
        evicted_by_us: bool,
    },
    Skipped(Skip),
}

#[derive(Clone, Debug)]
struct Tracked {
    pod: PodRef,
    bare: bool,
    state: State,
}

/// The drain's bookkeeping: every pod seen on the Node, by UID, and what became of it.
/// Pure: the caller lists the pods, makes the requests and says what they answered.
#[derive(Clone, Debug, Default)]
pub struct DrainState {
    pods: BTreeMap<String, Tracked>,
    error: Option<String>,
    /// Ended by a signal before it was done.
    pub interrupted: bool,
}

impl DrainState {
    /// Takes in the Node's pods as listed now: new ones are chosen for, tracked ones
    /// no longer listed are gone.
    pub fn observe(&mut self, pods: &[Pod], now: Instant) {
        let listed: std::collections::BTreeSet<&str> = pods.iter().filter_map(|p| p.metadata.uid.as_deref()).collect();
        for t in self.pods.values_mut() {
            if listed.contains(t.pod.uid.as_str()) {
                continue;
            }
            t.state = match t.state {
                State::ToEvict { .. } => State::Gone { evicted_by_us: false },
                State::Terminating { evicted_by_us } => State::Gone { evicted_by_us },
                ref s => s.clone(),
            }
        }
        for p in pods {
            let r = PodRef::of(p);
            if r.uid.is_empty() || self.pods.contains_key(&r.uid) {
                continue;
            }
            let state = match choose(p) {
                Choice::Evict => State::ToEvict { next_try: now, attempts: 0, blocked: None },
                Choice::Wait => State::Terminating { evicted_by_us: false },
                Choice::Skip(s) => State::Skipped(s),
            };
            self.pods.insert(r.uid.clone(), Tracked { bare: is_bare(p), pod: r, state });
        }
    }

    /// The pods whose eviction is due at `now`.
    pub fn due(&self, now: Instant) -> Vec<PodRef> {
        self.pods
            .values()
            .filter(|t| matches!(t.state, State::ToEvict { next_try, .. } if next_try <= now))
            .map(|t| t.pod.clone())
            .collect()
    }

    /// Records what the eviction of `pod` came to.
    pub fn evicted(&mut self, pod: &PodRef, result: Evicted, now: Instant) {
        let Some(t) = self.pods.get_mut(&pod.uid) else { return };
        let attempts = match &t.state {
            State::ToEvict { attempts, .. } => *attempts,
            _ => 0,
        };
        let retry = |blocked| State::ToEvict { next_try: now + backoff(attempts), attempts: attempts + 1, blocked };
        t.state = match result {
            Evicted::Yes => State::Terminating { evicted_by_us: true },
            Evicted::Gone => State::Gone { evicted_by_us: false },
            Evicted::Blocked(b) => retry(Some(b)),
            Evicted::Retry(why) => {
                let blocked = match &t.state {
                    State::ToEvict { blocked, .. } => blocked.clone(),
                    _ => None,
                };
                tracing::debug!(pod = %pod, why = %why, "eviction not answered; retrying");
                retry(blocked)
            }
            Evicted::Fatal(why) => {
                self.error.get_or_insert(why);
                return;
            }
        };
    }

    /// Records that `pod` was deleted after the deadline.
    pub fn deleted(&mut self, pod: &PodRef) {
        if let Some(t) = self.pods.get_mut(&pod.uid) {
            t.state = State::Deleted;
        }
    }

    /// Ends the drain with `error` (the first one is kept).
    pub fn fail(&mut self, error: String) {
        self.error.get_or_insert(error);
    }

    pub fn failed(&self) -> bool {
        self.error.is_some()
    }

    /// Whether nothing is left to evict or wait for.
    pub fn done(&self) -> bool {
        self.pods.values().all(|t| matches!(t.state, State::Gone { .. } | State::Skipped(_) | State::Deleted))
    }

    /// The pods not evicted yet (for `"delete"`; evicted ones are already being
    /// deleted, with their own grace periods, and a delete would not hurry them).
    pub fn remaining(&self) -> Vec<PodRef> {
        self.pods.values().filter(|t| matches!(t.state, State::ToEvict { .. })).map(|t| t.pod.clone()).collect()
    }

    /// The earliest moment something is due, for the wait between rounds.
    pub fn next_due(&self) -> Option<Instant> {
        self.pods
            .values()
            .filter_map(|t| match t.state {
                State::ToEvict { next_try, .. } => Some(next_try),
                _ => None,
            })
            .min()
    }

    /// Where the drain stands (for progress) or ended (with `timed_out`).
    pub fn report(&self, elapsed: Duration, timed_out: bool) -> DrainReport {
        let mut r = DrainReport { elapsed_ms: elapsed.as_millis() as u64, timed_out, ..Default::default() };
        for t in self.pods.values() {
            let name = t.pod.to_string();
            match &t.state {
                State::Gone { evicted_by_us: true } => r.evicted.push(name),
                State::Gone { evicted_by_us: false } => r.gone.push(name),
                State::Terminating { .. } => r.waiting.push(name),
                State::Deleted => r.deleted.push(name),
                State::Skipped(s) => r.skipped.push(SkippedPod { pod: name, why: *s }),
                State::ToEvict { blocked, .. } => r.blocked.push(BlockedPod {
                    pod: name,
                    pdb: blocked.as_ref().and_then(|b| b.pdb.clone()),
                    message: blocked.as_ref().map(|b| b.message.clone()),
                }),
            }
            if t.bare && !matches!(t.state, State::Skipped(_)) {
                r.bare.push(t.pod.to_string());
            }
        }
        r.error = self.error.clone();
        r.interrupted = self.interrupted;
        // By name, for the reader (the state is kept by UID).
        for v in [&mut r.evicted, &mut r.gone, &mut r.waiting, &mut r.deleted, &mut r.bare] {
            v.sort();
        }
        r.blocked.sort_by(|a, b| a.pod.cmp(&b.pod));
        r.skipped.sort_by(|a, b| a.pod.cmp(&b.pod));
        r
    }
}

/// 1, 2, 4, 5, 5 … s.
fn backoff(attempts: u32) -> Duration {
    (BACKOFF_FIRST * 2u32.saturating_pow(attempts.min(8))).min(BACKOFF_MAX)
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockedPod {
    pub pod: String,
    /// The PodDisruptionBudget that refused its eviction.
    pub pdb: Option<String>,
    /// The last refusal's words; `None` if it was never tried (the drain ended first).
    pub message: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedPod {
    pub pod: String,
    pub why: Skip,
}

/// What a drain did, for the log, the Event and `status`. Pods are `namespace/name`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DrainReport {
    /// Evicted and gone.
    pub evicted: Vec<String>,
    /// Gone without our eviction (deleted by someone else meanwhile).
    pub gone: Vec<String>,
    /// Evicted (or terminating) and not gone yet.
    pub waiting: Vec<String>,
    /// Not evicted: a budget refused (named when the API server named it).
    pub blocked: Vec<BlockedPod>,
    /// Deleted after the deadline (`on_drain_timeout = "delete"`).
    pub deleted: Vec<String>,
    /// Left alone: DaemonSet and mirror pods.
    pub skipped: Vec<SkippedPod>,
    /// Of the moved pods, those no controller re-creates.
    pub bare: Vec<String>,
    pub timed_out: bool,
    /// Ended by SIGTERM or SIGINT before it was done.
    pub interrupted: bool,
    /// The call that failed for good (it names the verb and resource).
    pub error: Option<String>,
    pub elapsed_ms: u64,
}

impl DrainReport {
    /// Whether pods the drain meant to move are still on the Node.
    pub fn incomplete(&self) -> bool {
        !self.waiting.is_empty() || !self.blocked.is_empty() || self.error.is_some() || self.interrupted
    }
}

impl fmt::Display for DrainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.elapsed_ms as f64 / 1000.0;
        write!(f, "drain: {} evicted", self.evicted.len())?;
        if !self.gone.is_empty() {
            write!(f, ", {} gone meanwhile", self.gone.len())?;
        }
        write!(f, ", {} left alone (DaemonSet or mirror)", self.skipped.len())?;
        if !self.deleted.is_empty() {
            write!(f, ", {} deleted after the deadline ({})", self.deleted.len(), self.deleted.join(", "))?;
        }
        if !self.waiting.is_empty() {
            write!(f, ", {} still terminating ({})", self.waiting.len(), self.waiting.join(", "))?;
        }
        if !self.blocked.is_empty() {
            write!(f, ", {} blocked (", self.blocked.len())?;
            for (i, b) in self.blocked.iter().enumerate() {
                let by = match (&b.pdb, &b.message) {
                    (Some(pdb), _) => format!("by PodDisruptionBudget {pdb}"),
                    (None, Some(m)) => m.clone(),
                    (None, None) => "not tried".into(),
                };
                write!(f, "{}{} {by}", if i > 0 { "; " } else { "" }, b.pod)?;
            }
            write!(f, ")")?;
        }
        if !self.bare.is_empty() {
            write!(f, "; not re-created by any controller: {}", self.bare.join(", "))?;
        }
        write!(f, "; {secs:.1}s")?;
        if self.timed_out {
            write!(f, " (drain_timeout reached)")?;
        }
        if self.interrupted {
            write!(f, " (stopped by a signal)")?;
        }
        if let Some(e) = &self.error {
            write!(f, "; failed: {e}")?;
        }
        Ok(())
    }
}

/// The drain as `regrade status` shows it: written by the process that runs the step
/// (`watch` or a step by hand) whenever the drain moves, and kept after it ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PublishedDrain {
    pub pid: u32,
    pub node: String,
    /// The level stepped down into.
    pub level: String,
    /// Seconds since the Unix epoch.
    pub started: f64,
    pub running: bool,
    pub report: DrainReport,
}

/// Publishes a drain while it runs, at `path` (none: not published). Dropped before
/// [`finish`](Self::finish) — the step cut short around the drain, at its deadline or
/// its Lease — it publishes the drain as not running, with why in the report's
/// `error`, so `drain.json` never says `running` under a live PID that is no longer
/// draining.
pub struct DrainPublisher {
    path: Option<std::path::PathBuf>,
    last: PublishedDrain,
    finished: bool,
}

/// What a drain dropped mid-way says in its report's `error`.
pub const DROPPED: &str =
    "cut short while draining: the step ended (levels.step_timeout, or its Lease no longer surely held) \
     before the drain did";

impl DrainPublisher {
    /// Publishes the drain as started (`running`, nothing done yet).
    pub fn start(path: Option<std::path::PathBuf>, node: &str, level: &str, started: f64) -> DrainPublisher {
        let last = PublishedDrain {
            pid: std::process::id(),
            node: node.to_string(),
            level: level.to_string(),
            started,
            running: true,
            report: DrainReport::default(),
        };
        let p = DrainPublisher { path, last, finished: false };
        p.write();
        p
    }

    fn write(&self) {
        if let Some(path) = &self.path {
            self.last.write(path);
        }
    }

    /// The drain moved: publishes `report`, still running.
    pub fn progress(&mut self, report: &DrainReport) {
        self.last.report = report.clone();
        self.write();
    }

    /// The drain ended with `report`: publishes it, not running.
    pub fn finish(mut self, report: &DrainReport) {
        self.last.report = report.clone();
        self.last.running = false;
        self.finished = true;
        self.write();
    }
}

impl Drop for DrainPublisher {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        self.last.running = false;
        let why = match self.last.report.error.take() {
            Some(e) => format!("{DROPPED}; {e}"),
            None => DROPPED.to_string(),
        };
        self.last.report.error = Some(why);
        tracing::warn!(node = %self.last.node, "the drain was dropped, {DROPPED}");
        self.write();
    }
}

/// Where the drain's progress is published: beside `watch`'s state file.
pub fn progress_path(state_file: &std::path::Path) -> std::path::PathBuf {
    state_file.with_file_name("drain.json")
}

impl PublishedDrain {
    /// Readable by all, as the state file is. Failing to write is logged, not fatal.
    pub fn write(&self, path: &std::path::Path) {
        let r = (|| -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            crate::fsutil::publish_atomic(path, &serde_json::to_vec_pretty(self)?, 0o644)
        })();
        if let Err(e) = r {
            tracing::warn!(error = %e, path = %path.display(), "could not publish the drain's progress");
        }
    }

    pub fn read(path: &std::path::Path) -> Option<PublishedDrain> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }

    /// Whether it says running and its writer is still alive.
    pub fn is_live(&self) -> bool {
        // kill(pid, 0) tests that the process exists; EPERM: it exists, not ours.
        self.running
            && self.pid != 0
            && (unsafe { libc::kill(self.pid as libc::pid_t, 0) } == 0
                || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
    }
}

/// Drains Node `node`: evicts its pods (see the module documentation), waits for them
/// within `settings.timeout`, then proceeds or deletes. Ends early, at the next
/// request boundary, when `stop` completes (SIGTERM). `progress` is handed the report
/// whenever it changes. Never fails: what went wrong is in the report.
pub async fn drain(
    eps: &Endpoints,
    node: &str,
    settings: DrainSettings,
    stop: impl std::future::Future<Output = ()>,
    progress: &mut dyn FnMut(&DrainReport),
) -> DrainReport {
    let started = Instant::now();
    let mut st = DrainState::default();
    let mut last: Option<DrainReport> = None;
    let mut tell = |st: &DrainState, timed_out: bool| {
        let r = st.report(started.elapsed(), timed_out);
        // Progress is what moved, not the clock.
        let moved = |a: &DrainReport| DrainReport { elapsed_ms: 0, ..a.clone() };
        if last.as_ref().is_none_or(|l| moved(l) != moved(&r)) {
            progress(&r);
            last = Some(r.clone());
        }
        r
    };
    let ended = {
        let running = run(eps, node, settings, started, &mut st, &mut tell);
        tokio::pin!(running);
        tokio::pin!(stop);
        tokio::select! {
            r = &mut running => Some(r),
            _ = &mut stop => None,
        }
    };
    match ended {
        Some(r) => r,
        None => {
            st.interrupted = true;
            tell(&st, false)
        }
    }
}

async fn run(
    eps: &Endpoints,
    node: &str,
    settings: DrainSettings,
    started: Instant,
    st: &mut DrainState,
    tell: &mut dyn FnMut(&DrainState, bool) -> DrainReport,
) -> DrainReport {
    let deadline = started + settings.timeout;
    // Until a list answers, nothing is known, so nothing is done either; if none
    // ever does, the drain failed (with the last reason).
    let mut unlisted: Option<String> = Some("the Node's pods were never listed".into());
    loop {
        let listed = match list(eps, node).await {
            Ok(pods) => {
                st.observe(&pods, Instant::now());
                unlisted = None;
                true
            }
            Err(e) => match classify(&e) {
                Evicted::Retry(why) => {
                    tracing::debug!(why = %why, "listing the Node's pods failed; retrying");
                    if unlisted.is_some() {
                        unlisted = Some(e.to_string());
                    }
                    false
                }
                _ => {
                    st.fail(e.to_string());
                    return tell(st, false);
                }
            },
        };
        for pod in st.due(Instant::now()) {
            // Many pods and a slow API must not carry the drain past its deadline.
            if Instant::now() >= deadline {
                break;
            }
            let r = evict(eps, &pod).await;
            st.evicted(&pod, r, Instant::now());
            if st.failed() {
                return tell(st, false);
            }
        }
        tell(st, false);
        if listed && st.done() {
            return tell(st, false);
        }
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        let wake = st.next_due().map_or(now + POLL, |t| t.min(now + POLL)).max(now + Duration::from_millis(50));
        tokio::time::sleep_until(wake.min(deadline)).await;
    }
    if let Some(why) = unlisted {
        st.fail(why);
        return tell(st, true);
    }
    if settings.on_timeout == OnDrainTimeout::Delete {
        for pod in st.remaining() {
            match delete(eps, &pod).await {
                Ok(()) => st.deleted(&pod),
                Err(e) => match classify(&e) {
                    Evicted::Gone => st.evicted(&pod, Evicted::Gone, Instant::now()),
                    // Not known to be gone: left, and reported, as not evicted.
                    Evicted::Blocked(_) => {}
                    _ => {
                        st.fail(e.to_string());
                        break;
                    }
                },
            }
        }
    }
    tell(st, true)
}

async fn list(eps: &Endpoints, node: &str) -> Result<Vec<Pod>, CallError> {
    let lp = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let lp = &lp;
    eps.call(format!("list pods --all-namespaces --field-selector spec.nodeName={node}"), |c| async move {
        Api::<Pod>::all(c).list(lp).await.map(|l| l.items)
    })
    .await
}

async fn evict(eps: &Endpoints, pod: &PodRef) -> Evicted {
    let body = json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": { "name": pod.name, "namespace": pod.namespace },
        "deleteOptions": { "preconditions": { "uid": pod.uid } },
    });
    let body = &body;
    let r = eps
        .call(format!("create pods/eviction {pod}"), |c| async move {
            Api::<Pod>::namespaced(c, &pod.namespace)
                .create_subresource::<_, serde_json::Value>("eviction", &pod.name, &PostParams::default(), body)
                .await
        })
        .await;
    match r {
        Ok(_) => Evicted::Yes,
        Err(e) => classify(&e),
    }
}

async fn delete(eps: &Endpoints, pod: &PodRef) -> Result<(), CallError> {
    let dp = DeleteParams {
        preconditions: Some(Preconditions { uid: Some(pod.uid.clone()), resource_version: None }),
        ..Default::default()
    };
    let dp = &dp;
    eps.call(format!("delete pods {pod}"), |c| async move {
        Api::<Pod>::namespaced(c, &pod.namespace).delete(&pod.name, dp).await.map(drop)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::response::{StatusCause, StatusDetails};

    fn pod(name: &str, owner: Option<&str>) -> Pod {
        let mut v = json!({
            "metadata": {"namespace": "apps", "name": name, "uid": format!("uid-{name}")},
            "spec": {"nodeName": "server-1", "containers": [{"name": "c", "image": "i"}]},
        });
        if let Some(kind) = owner {
            v["metadata"]["ownerReferences"] =
                json!([{"apiVersion": "apps/v1", "kind": kind, "name": "owner", "uid": "u", "controller": true}]);
        }
        serde_json::from_value(v).unwrap()
    }

    fn with_emptydir(mut p: Pod) -> Pod {
        p.spec.as_mut().unwrap().volumes =
            Some(vec![serde_json::from_value(json!({"name": "scratch", "emptyDir": {}})).unwrap()]);
        p
    }

    fn mirror(name: &str) -> Pod {
        let mut p = pod(name, None);
        p.metadata.annotations = Some([(MIRROR_ANNOTATION.to_string(), "abc".to_string())].into());
        p.metadata.owner_references = Some(vec![serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Node", "name": "server-1", "uid": "n", "controller": true}),
        )
        .unwrap()]);
        p
    }

    fn status(code: u16, message: &str, cause: Option<&str>) -> CallError {
        let mut s = Status::failure(message, "TooManyRequests").with_code(code);
        if let Some(c) = cause {
            s.details = Some(StatusDetails {
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                causes: vec![StatusCause {
                    reason: "DisruptionBudget".into(),
                    message: c.into(),
                    field: String::new(),
                }],
                retry_after_seconds: 0,
            });
        }
        CallError::Status {
            what: "create pods/eviction apps/web-1".into(),
            endpoint: "https://127.0.0.1:6443".into(),
            status: Box::new(s),
        }
    }

    #[test]
    fn selection_is_kubectl_drains() {
        assert_eq!(choose(&pod("web-1", Some("ReplicaSet"))), Choice::Evict);
        assert_eq!(choose(&pod("db-0", Some("StatefulSet"))), Choice::Evict);
        assert_eq!(choose(&with_emptydir(pod("cache", Some("ReplicaSet")))), Choice::Evict, "emptyDir data goes");
        assert_eq!(choose(&pod("bare", None)), Choice::Evict, "as with --force");
        assert_eq!(choose(&pod("fluent-bit-x", Some("DaemonSet"))), Choice::Skip(Skip::DaemonSet));
        assert_eq!(choose(&mirror("kube-vip-server-1")), Choice::Skip(Skip::Mirror));
        let mut going = pod("web-2", Some("ReplicaSet"));
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
        assert_eq!(choose(&going), Choice::Wait);
        // A DaemonSet that only owns (not controls) a pod does not keep it.
        let mut p = pod("adopted", Some("DaemonSet"));
        p.metadata.owner_references.as_mut().unwrap()[0].controller = None;
        assert_eq!(choose(&p), Choice::Evict);
    }

    #[test]
    fn a_budgets_refusal_is_named_and_retried() {
        let e = status(
            429,
            "Cannot evict pod as it would violate the pod's disruption budget.",
            Some("The disruption budget web-pdb needs 2 healthy pods and has 2 currently"),
        );
        assert_eq!(
            classify(&e),
            Evicted::Blocked(Block {
                pdb: Some("web-pdb".into()),
                message: "The disruption budget web-pdb needs 2 healthy pods and has 2 currently".into()
            })
        );
        let e = status(
            429,
            "Cannot evict pod",
            Some("The disruption budget web-pdb is still being processed by the server."),
        );
        assert!(matches!(classify(&e), Evicted::Blocked(Block { pdb: Some(p), .. }) if p == "web-pdb"));
        let e = status(
            500,
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            None,
        );
        assert!(matches!(classify(&e), Evicted::Blocked(Block { pdb: None, .. })));
        assert_eq!(classify(&status(404, "not found", None)), Evicted::Gone);
        assert!(matches!(classify(&status(503, "unavailable", None)), Evicted::Retry(_)));
        let Evicted::Fatal(why) =
            classify(&status(403, "pods \"web-1\" is forbidden: cannot create resource \"pods/eviction\"", None))
        else {
            panic!()
        };
        assert!(why.contains("create pods/eviction apps/web-1") && why.contains("403"), "{why}");
        let unreachable = CallError::Unreachable { what: "x".into(), tried: vec![] };
        assert!(matches!(classify(&unreachable), Evicted::Retry(_)));
    }

    #[test]
    fn backoff_doubles_to_kubectls_five_seconds() {
        let b: Vec<u64> = (0..5).map(|a| backoff(a).as_secs()).collect();
        assert_eq!(b, [1, 2, 4, 5, 5]);
        assert_eq!(backoff(u32::MAX), BACKOFF_MAX);
    }

    #[test]
    fn the_report_follows_each_pod() {
        let t0 = Instant::now();
        let web = pod("web-1", Some("ReplicaSet"));
        let db = pod("db-0", Some("StatefulSet"));
        let ds = pod("node-exporter-x", Some("DaemonSet"));
        let bare = with_emptydir(pod("scratch", None));
        let all = vec![web.clone(), db.clone(), ds.clone(), bare.clone(), mirror("static-1")];
        let mut st = DrainState::default();
        st.observe(&all, t0);
        let due = st.due(t0);
        assert_eq!(due.iter().map(|p| p.to_string()).collect::<Vec<_>>(), ["apps/db-0", "apps/scratch", "apps/web-1"]);
        let r = |p: &Pod| PodRef::of(p);
        let blocked = Block {
            pdb: Some("db-pdb".into()),
            message: "The disruption budget db-pdb needs 1 healthy pods and has 1 currently".into(),
        };
        st.evicted(&r(&web), Evicted::Yes, t0);
        st.evicted(&r(&bare), Evicted::Yes, t0);
        st.evicted(&r(&db), Evicted::Blocked(blocked.clone()), t0);
        assert!(st.due(t0).is_empty(), "a refused eviction waits for its backoff");
        assert_eq!(st.due(t0 + Duration::from_secs(1)), [r(&db)]);
        assert_eq!(st.next_due(), Some(t0 + Duration::from_secs(1)));
        assert!(!st.done());

        // web-1 is gone; scratch still terminating; db-0 refused again.
        st.observe(&[db.clone(), ds.clone(), bare.clone(), mirror("static-1")], t0 + Duration::from_secs(1));
        st.evicted(&r(&db), Evicted::Blocked(blocked.clone()), t0 + Duration::from_secs(1));
        assert_eq!(st.next_due(), Some(t0 + Duration::from_secs(3)), "backoff doubled");
        let rep = st.report(Duration::from_secs(2), false);
        assert_eq!(rep.evicted, ["apps/web-1"]);
        assert_eq!(rep.waiting, ["apps/scratch"]);
        assert_eq!(
            rep.blocked,
            [BlockedPod {
                pod: "apps/db-0".into(),
                pdb: Some("db-pdb".into()),
                message: Some(blocked.message.clone())
            }]
        );
        assert_eq!(
            rep.skipped.iter().map(|s| (s.pod.as_str(), s.why)).collect::<Vec<_>>(),
            [("apps/node-exporter-x", Skip::DaemonSet), ("apps/static-1", Skip::Mirror)]
        );
        assert_eq!(rep.bare, ["apps/scratch"]);
        assert!(rep.incomplete());
        assert_eq!(st.remaining(), [r(&db)], "evicted pods are not deleted again");

        // The deadline: "delete" takes the rest.
        st.deleted(&r(&db));
        assert!(!st.done(), "scratch is still terminating");
        st.observe(&[ds.clone(), mirror("static-1")], t0 + Duration::from_secs(5));
        assert!(st.done());
        let rep = st.report(Duration::from_secs(5), true);
        assert_eq!(rep.deleted, ["apps/db-0"]);
        assert_eq!(rep.evicted, ["apps/scratch", "apps/web-1"]);
        assert!(rep.blocked.is_empty() && rep.waiting.is_empty() && !rep.incomplete());
        let text = rep.to_string();
        assert!(
            text.contains("1 deleted after the deadline (apps/db-0)") && text.contains("drain_timeout reached"),
            "{text}"
        );
    }

    #[test]
    fn the_report_names_the_budget_and_the_failure() {
        let t0 = Instant::now();
        let db = pod("db-0", Some("StatefulSet"));
        let mut st = DrainState::default();
        st.observe(std::slice::from_ref(&db), t0);
        st.evicted(&PodRef::of(&db), Evicted::Blocked(Block { pdb: Some("db-pdb".into()), message: "m".into() }), t0);
        let text = st.report(Duration::from_millis(120_000), true).to_string();
        assert!(text.contains("1 blocked (apps/db-0 by PodDisruptionBudget db-pdb)"), "{text}");
        assert!(text.contains("120.0s (drain_timeout reached)"), "{text}");

        st.evicted(&PodRef::of(&db), Evicted::Fatal("create pods/eviction apps/db-0: 403 Forbidden".into()), t0);
        assert!(st.failed());
        let rep = st.report(Duration::ZERO, false);
        assert!(rep.incomplete());
        assert!(rep.to_string().contains("failed: create pods/eviction apps/db-0: 403"), "{rep}");
    }

    #[test]
    fn a_pod_recreated_under_its_name_is_a_new_pod() {
        let t0 = Instant::now();
        let old = pod("db-0", Some("StatefulSet"));
        let mut st = DrainState::default();
        st.observe(std::slice::from_ref(&old), t0);
        st.evicted(&PodRef::of(&old), Evicted::Yes, t0);
        let mut new = old.clone();
        new.metadata.uid = Some("uid-db-0-again".into());
        st.observe(std::slice::from_ref(&new), t0);
        let rep = st.report(Duration::ZERO, false);
        assert_eq!(rep.evicted, ["apps/db-0"]);
        assert_eq!(st.due(t0).iter().map(|p| p.uid.as_str()).collect::<Vec<_>>(), ["uid-db-0-again"]);
    }

    /// A 409 is not "gone": the API server also answers it for the same pod when its
    /// own conflict retries run out. The eviction is retried with backoff; only a
    /// list without the pod's UID (deleted, or re-created as a new pod) makes it gone.
    #[test]
    fn a_conflict_is_retried_until_a_list_says_the_pod_is_gone() {
        let t0 = Instant::now();
        let web = pod("web-1", Some("ReplicaSet"));
        let r = PodRef::of(&web);
        let mut st = DrainState::default();
        st.observe(std::slice::from_ref(&web), t0);
        let conflict =
            status(409, "Operation cannot be fulfilled on pods \"web-1\": the object has been modified", None);
        st.evicted(&r, classify(&conflict), t0);
        assert!(!st.done(), "the same pod is still there");
        assert!(st.due(t0).is_empty(), "retried after a backoff");
        st.observe(std::slice::from_ref(&web), t0 + Duration::from_secs(1));
        assert_eq!(st.due(t0 + Duration::from_secs(1)), std::slice::from_ref(&r), "same UID listed: evicted again");
        let rep = st.report(Duration::from_secs(1), false);
        assert!(rep.gone.is_empty() && rep.blocked.len() == 1, "{rep:?}");
        assert!(rep.blocked[0].message.as_deref().is_some_and(|m| m.contains("has been modified")), "{rep:?}");
        st.evicted(&r, Evicted::Yes, t0 + Duration::from_secs(1));
        st.observe(&[], t0 + Duration::from_secs(2));
        assert!(st.done());
        assert_eq!(st.report(Duration::from_secs(2), false).evicted, ["apps/web-1"]);

        // A 409 for a pod re-created under its name: the list shows the new UID only.
        let mut st = DrainState::default();
        st.observe(std::slice::from_ref(&web), t0);
        st.evicted(&r, classify(&status(409, "Precondition failed: UID in precondition", None)), t0);
        let mut again = web.clone();
        again.metadata.uid = Some("uid-web-1-again".into());
        st.observe(std::slice::from_ref(&again), t0 + Duration::from_secs(1));
        let rep = st.report(Duration::from_secs(1), false);
        assert_eq!(rep.gone, ["apps/web-1"], "{rep:?}");
        assert_eq!(
            st.due(t0 + Duration::from_secs(1)).iter().map(|p| p.uid.as_str()).collect::<Vec<_>>(),
            ["uid-web-1-again"]
        );
    }
}
