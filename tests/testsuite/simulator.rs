//! The deterministic simulator (issues 23 and 38): several servers, each running
//! regrade's real `watch` loop (`watch::run_with`: the ticker, the core, the level
//! record, the step lock, `step::run` and `step::resume`) and its real etcd gate
//! (`EtcdGate` over a modelled etcd) over a simulated world, with faults at random
//! moments, and the promise checked after every event.
//!
//! One seed is one run: single-threaded, on tokio's paused clock (timers jump; nothing
//! waits in real time), every random choice of the world from the seed. Every
//! `tokio::select!` on regrade's path is `biased` (polled in order), so no choice is
//! left to tokio's own RNG and a seed replays exactly. What is simulated:
//! - the cluster: one Lease (taken over once unrenewed for its duration), each Node's
//!   level label, peer readiness (a server whose k3s restarts or crash-loops is
//!   NotReady, and a Node may stay NotReady while its etcd serves: readiness is not
//!   health), the API going down;
//! - etcd: one member per server, asked by the real gate at its client URL (this
//!   server's at 127.0.0.1): a member down (its k3s restarting or crash-looping, or the
//!   member killed) refuses the connection, one that lags is behind the leader, and a
//!   leader exists while a quorum is up;
//! - k3s: its flags (the start record), the actuator's file (the drop-in), restarts that
//!   take 2–30 s, 30–55 s one in five, or a hang of 10 min; a kubelet that reports
//!   Ready 20–55 s after k3s is back, one restart in four; in one seed of four one server's k3s refuses the
//!   flags of etcd-only (a custom flag this k3s does not know) and crash-loops with
//!   them for good;
//! - memory: each server's own fixture PSI file, rewritten at random moments; in half
//!   the seeds server0 reads its memory from a cgroup v2 tree (`pressure.memory_cgroup`
//!   on `system.slice/k3s.service`, the slice limited to 512 MiB, the service not);
//! - the processes: `watch` SIGKILLed at a random moment (its future dropped where it
//!   stands: files written so far stay, the step lock goes with it) and started again;
//!   `regrade step down|up|to full` by hand (`hand::step_by_hand_with`), some SIGKILLed
//!   mid-step; a reboot (k3s restarts from the drop-in, not asked by regrade);
//! - slow calls, drawn beyond the Lease's margin (issue 55): a mark now and then takes
//!   5–40 s; an etcd look 50 ms, or 0.5–3 s one time in eight; each call on the bus may
//!   hang to its timeout (`CALL_TIMEOUT`), so reaching it and reading the unit before
//!   a restart may take 15 s; the drop-in's durable write takes 1–12 s one time in ten
//!   (a disk the thrash keeps busy); RestartUnit may hang to its timeout and systemd
//!   then executes the job late, as the call ends; the API may stop landing Lease
//!   renewals for 5–40 s while answering reads (a step that waits sees its Lease's
//!   safe bound come); lost replies (one Lease write or mark in 20 lands but answers
//!   an error); the step stops a quarter of the lease duration before its Lease could
//!   be taken over (`lease_safe_until`). Every restart goes through
//!   `actuator::restart::send`, as the real actuators' do.
//!
//! - the step's deadline: one seed in three, 2m30s, shorter than the step's waits at
//!   their bounds (which check-config refuses on a server), so that the deadline's
//!   rollback is put under the faults at every phase.
//!
//! Not simulated (yet): drains and PDBs, clock offsets, a renewal that lands late, a
//! member that hangs (its connection taken, no answer).
//!
//! Checked after every event: **quorum** (no restart requested by regrade while another
//! member is down that was down already when this server's gate last asked it, or not
//! asked within the look's window; a member already down restarting back costs no
//! vote), **Lease** (no restart requested by regrade unless it holds the Lease and no
//! other server could have taken it over), **one step** (no two servers' members down
//! for regrade at once, and no step of more than one level), **forward only** (within a
//! step the recorded phase never moves back), **reading** (at each change of memory,
//! regrade's own sampler and core read it as the world has it: over or calm), and once
//! the faults stop and memory is calm: **one truth and liveness** (within 15 min every
//! server is at `full`: record, drop-in, k3s's flags and Node label agree).
//!
//! `REGRADE_SIM_SEEDS=N` runs seeds 0..N (default 300); `REGRADE_SIM_SEED=S` runs one and
//! prints its trace. A failing seed prints its trace and the command that replays it.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use regrade::actuator::restart::{self, Purpose};
use regrade::actuator::{Actuator, NodeReadiness};
use regrade::backend::Backend;
use regrade::cluster::{Cluster, Refusal, RefusalKind, StepEvent};
use regrade::config::Config;
use regrade::decide::Reading;
use regrade::decide::{Direction, Step};
use regrade::etcd::client::{AskEtcd, Endpoint, Header, Member, MemberList, Status};
use regrade::etcd::gate::EtcdGate;
use regrade::hand::StepTarget;
use regrade::level::Level;
use regrade::level_record::{LevelRecord, Phase};
use regrade::levels::LevelsConfig;
use regrade::pressure::Sampler;
use tokio::time::Instant;

/// xorshift64*: small, and the same sequence everywhere.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn secs(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_secs(lo + self.below(hi - lo + 1))
    }
}

const LEASE_FOR: Duration = Duration::from_secs(15);

/// The bound of one call on the simulated system bus (`systemd.call_timeout`): the
/// restart's request reaches k3s within it. Less than the Lease's margin (a quarter of
/// its duration, 3.75 s), as the defaults' 10 s are within theirs.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// The longest from the gate's answer about a member to the restart request: the rest
/// of the look (a slow status, 3 s) and the bus call (3 s).
const LOOK_WINDOW: Duration = Duration::from_secs(6);

struct World {
    start: Instant,
    rng: Rng,
    lease: Option<usize>,
    renewed: Instant,
    label: Vec<Option<Level>>,
    /// k3s's flags in effect (its start record).
    running: Vec<Level>,
    /// Until when k3s restarts (member down, Node NotReady).
    restarting_until: Vec<Option<Instant>>,
    /// Whether the restart under way was asked for by regrade.
    by_regrade: Vec<bool>,
    dead: Vec<bool>,
    /// A member that is up but does not catch up (raft lag): the wait after its
    /// restart lasts until it does, or the step's deadline.
    lagging: Vec<bool>,
    /// The level whose flags this server's k3s refuses (a custom flag this k3s does
    /// not know): started with them it crash-loops, its member down, for good.
    refuses: Vec<Option<Level>>,
    /// When each member last went down (killed, or its k3s restarted), or came back
    /// after it was killed.
    went_down: Vec<Instant>,
    /// `asked[i][j]`: when server i's etcd gate last had member j's answer (its
    /// status, or its refused connection).
    asked: Vec<Vec<Instant>>,
    /// The Node stays NotReady although etcd serves (a kubelet that does not come
    /// back): readiness is not health.
    not_ready: Vec<bool>,
    /// When each Node reports Ready again after its k3s's last restart: a kubelet
    /// slow to report after a restart under pressure.
    ready_at: Vec<Instant>,
    dropin: Vec<Level>,
    api_down: bool,
    /// Until when the API answers reads but no Lease renewal lands (writes time out):
    /// the slow API of a step that waits.
    renewals_stall_until: Instant,
    levels: LevelsConfig,
    /// Each server's level record, and the last phase seen of its step under way.
    records: Vec<PathBuf>,
    seen: Vec<Option<(Level, Level, u64, Phase)>>,
    trace: Vec<String>,
    violations: Vec<String>,
}

type Shared = Rc<RefCell<World>>;

impl World {
    fn at(&self) -> String {
        format!("{:>7.1}s", self.start.elapsed().as_secs_f64())
    }
    fn say(&mut self, what: String) {
        let line = format!("{} {what}", self.at());
        self.trace.push(line);
    }
    fn restarting(&self, i: usize) -> bool {
        self.restarting_until[i].is_some_and(|u| Instant::now() < u)
    }
    /// k3s crash-loops: it runs with flags it refuses.
    fn crash_looping(&self, i: usize) -> bool {
        self.refuses[i] == Some(self.running[i])
    }
    fn up(&self, i: usize) -> bool {
        !self.restarting(i) && !self.dead[i] && !self.crash_looping(i)
    }
    /// Since when member `i` is up (if it is): its last change, or the end of its
    /// k3s's last restart.
    fn up_since(&self, i: usize) -> Instant {
        let restarted = self.restarting_until[i].filter(|&u| u <= Instant::now());
        restarted.map_or(self.went_down[i], |u| u.max(self.went_down[i]))
    }
    /// The Node is Ready: k3s serves and its kubelet reports.
    fn ready(&self, i: usize) -> bool {
        !self.restarting(i) && !self.crash_looping(i) && !self.not_ready[i] && Instant::now() >= self.ready_at[i]
    }
    /// How long a call on the system bus (or a slow etcd look) takes: mostly 50 ms,
    /// now and then seconds under the thrash. At most 3 s: the Lease's margin (a
    /// quarter of its duration, 3.75 s here) is what a call asked for at its last
    /// safe moment has to land in, as systemd.call_timeout is within it at the defaults.
    fn slow_call(&mut self) -> Duration {
        if self.rng.below(8) == 0 {
            Duration::from_millis(500 + self.rng.below(2500))
        } else {
            Duration::from_millis(50)
        }
    }
    /// A call on the bus that may hang to its timeout: mostly 50 ms, now and then
    /// seconds, one time in twelve the whole of [`CALL_TIMEOUT`].
    fn bus_call(&mut self) -> Duration {
        match self.rng.below(12) {
            0 => CALL_TIMEOUT,
            _ => self.slow_call().min(CALL_TIMEOUT),
        }
    }
    /// Reaching the bus and reading the unit's state before a restart: three calls,
    /// each of which may hang to its timeout (tried again: up to three times).
    fn bus_connect(&mut self) -> Duration {
        (0..3).map(|_| self.bus_call()).sum::<Duration>()
            + if self.rng.below(12) == 0 { 2 * CALL_TIMEOUT } else { Duration::ZERO }
    }
    /// A durable write (the drop-in, beside the level record's) under the thrash: at
    /// once mostly, one time in ten seconds on a disk the thrash keeps busy.
    fn durable_write(&mut self) -> Duration {
        if self.rng.below(10) == 0 {
            self.rng.secs(1, 12)
        } else {
            Duration::ZERO
        }
    }
    fn violate(&mut self, what: String) {
        let line = format!("{} VIOLATION {what}", self.at());
        self.trace.push(line.clone());
        self.violations.push(line);
    }
    /// Forward only: looked at before each effect (every call into the simulated
    /// world), which is when a step's record has just been written.
    fn look_at_record(&mut self, i: usize) {
        let now = LevelRecord::read(&self.records[i])
            .ok()
            .flatten()
            .and_then(|r| r.step)
            .map(|st| (st.from, st.to, st.started, st.phase));
        if let (Some(a), Some(b)) = (self.seen[i], now) {
            if (a.0, a.1, a.2) == (b.0, b.1, b.2) && b.3 < a.3 {
                self.violate(format!("forward only: server{i}'s step went from {} back to {}", a.3, b.3));
            }
        }
        self.seen[i] = now;
    }

    fn lease_free_for(&self, me: usize) -> bool {
        match self.lease {
            None => true,
            Some(h) if h == me => true,
            Some(_) => self.renewed.elapsed() > LEASE_FOR,
        }
    }
}

/// Waits, a second at a time, until `done` holds of the world; `what` within
/// `timeout` otherwise (the Node's readiness wait and k3s's health wait).
async fn wait_until(w: &Shared, done: impl Fn(&World) -> bool, timeout: Duration, what: &str) -> anyhow::Result<()> {
    let until = Instant::now() + timeout;
    while !done(&w.borrow()) {
        anyhow::ensure!(Instant::now() < until, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(())
}

struct SimCluster {
    me: usize,
    w: Shared,
}

fn refusal(kind: RefusalKind, subject: String, message: String) -> Refusal {
    Refusal { kind, subject, message }
}

impl SimCluster {
    fn check(&self, step: &Step) -> Result<(), Refusal> {
        self.w.borrow_mut().look_at_record(self.me);
        let w = self.w.borrow();
        if w.api_down {
            return Err(refusal(RefusalKind::ApiUnreachable, "api".into(), "the API is down".into()));
        }
        if !w.lease_free_for(self.me) {
            return Err(refusal(RefusalKind::LeaseHeld, "lease".into(), format!("held by {:?}", w.lease)));
        }
        for j in (0..w.label.len()).filter(|&j| j != self.me) {
            if !w.ready(j) {
                return Err(refusal(RefusalKind::PeerNotReady, format!("server{j}"), "NotReady".into()));
            }
            if step.direction == Direction::Down && w.label[j].is_some() {
                return Err(refusal(RefusalKind::PeerSteppedDown, format!("server{j}"), "stepped down".into()));
            }
        }
        Ok(())
    }
}

#[async_trait(?Send)]
impl NodeReadiness for SimCluster {
    async fn wait_ready_since(&self, _: SystemTime, timeout: Duration) -> anyhow::Result<()> {
        let me = self.me;
        wait_until(&self.w, |w| w.ready(me), timeout, "not Ready").await
    }
}

#[async_trait(?Send)]
impl Cluster for SimCluster {
    async fn preflight(&self, step: &Step) -> Result<(), Refusal> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.check(step)
    }
    async fn acquire(&self, step: &Step) -> Result<(), Refusal> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.check(step)?;
        let mut w = self.w.borrow_mut();
        if w.lease != Some(self.me) {
            w.say(format!("server{} takes the Lease ({} -> {})", self.me, step.from, step.to));
        }
        w.lease = Some(self.me);
        w.renewed = Instant::now();
        if w.rng.below(20) == 0 {
            // A lost reply: the Lease was written, the answer never came.
            w.say(format!("server{}'s Lease write landed, its reply lost", self.me));
            return Err(refusal(RefusalKind::ApiUnreachable, "lease".into(), "the reply was lost".into()));
        }
        Ok(())
    }
    fn lease_safe_until(&self) -> Option<Instant> {
        let w = self.w.borrow();
        (w.lease == Some(self.me)).then(|| w.renewed + LEASE_FOR * 3 / 4)
    }
    async fn hold(&self) -> anyhow::Error {
        loop {
            tokio::time::sleep(LEASE_FOR / 3).await;
            let mut w = self.w.borrow_mut();
            if w.lease != Some(self.me) {
                return anyhow::anyhow!("the Lease was taken over");
            }
            if !w.api_down && Instant::now() >= w.renewals_stall_until {
                w.renewed = Instant::now();
            }
        }
    }
    async fn release(&self) {
        let mut w = self.w.borrow_mut();
        w.look_at_record(self.me);
        if w.lease == Some(self.me) && !w.api_down {
            w.lease = None;
        }
    }
    async fn mark_node(&self, level: Level, _: &LevelsConfig) -> anyhow::Result<()> {
        // A slow call now and then: the window between the gate under the Lease and
        // the restart, in which a peer's member may die.
        let took = {
            let mut w = self.w.borrow_mut();
            if w.rng.below(10) == 0 {
                w.rng.secs(5, 40)
            } else {
                Duration::from_millis(50)
            }
        };
        tokio::time::sleep(took).await;
        let mut w = self.w.borrow_mut();
        w.look_at_record(self.me);
        anyhow::ensure!(!w.api_down, "the API is down");
        w.label[self.me] = (level != Level::Full).then_some(level);
        // A lost reply: the marks changed, the answer never came.
        anyhow::ensure!(w.rng.below(20) != 0, "the reply was lost");
        Ok(())
    }
    async fn node_level(&self) -> anyhow::Result<Option<Level>> {
        let w = self.w.borrow();
        anyhow::ensure!(!w.api_down, "the API is down");
        Ok(w.label[self.me])
    }
    async fn record(&self, e: StepEvent<'_>) {
        let what = match e {
            StepEvent::Done(s) => format!("server{} step done {} -> {}", self.me, s.from, s.to),
            StepEvent::Failed(s, why) => format!("server{} step failed {} -> {}: {why}", self.me, s.from, s.to),
            StepEvent::Refused(s, r) => {
                format!("server{} step refused {} -> {}: {}", self.me, s.from, s.to, r.kind.as_str())
            }
            StepEvent::Drained(report) => format!("server{} drained: {report}", self.me),
        };
        self.w.borrow_mut().say(what);
    }
}

/// etcd as the real gate ([`EtcdGate`]) sees it: each server's member answers its
/// member list and its status at `https://10.0.0.<i+1>:2379` (and this server's at
/// `https://127.0.0.1:2379`), refuses the connection while it is down (k3s
/// restarting or crash-looping, or the member killed), and sees a leader while a
/// quorum is up. A look takes 50 ms, now and then seconds.
struct SimEtcd {
    me: usize,
    w: Shared,
}

impl SimEtcd {
    /// The member an endpoint reaches, if it is up; else the refused connection.
    async fn reach(&self, ep: &Endpoint) -> anyhow::Result<usize> {
        let took = self.w.borrow_mut().slow_call();
        tokio::time::sleep(took).await;
        let mut w = self.w.borrow_mut();
        w.look_at_record(self.me);
        let url = ep.to_string();
        let host = url.trim_start_matches("https://").split(':').next().unwrap_or("");
        let j = match host {
            "127.0.0.1" => self.me,
            h => h.rsplit('.').next().and_then(|n| n.parse::<usize>().ok()).map_or(usize::MAX, |n| n - 1),
        };
        if j < w.dead.len() {
            w.asked[self.me][j] = Instant::now();
        }
        if j >= w.dead.len() || !w.up(j) {
            let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
            return Err(anyhow::Error::new(refused).context(format!("{ep}: connecting")));
        }
        Ok(j)
    }
}

fn member_id(i: usize) -> u64 {
    i as u64 + 1
}

#[async_trait(?Send)]
impl AskEtcd for SimEtcd {
    async fn member_list(&self, ep: &Endpoint) -> anyhow::Result<MemberList> {
        let j = self.reach(ep).await?;
        let n = self.w.borrow().dead.len();
        let members = (0..n)
            .map(|i| Member {
                id: member_id(i),
                name: format!("server{i}-0000000{i}"),
                peer_urls: vec![format!("https://10.0.0.{}:2380", i + 1)],
                client_urls: vec![format!("https://10.0.0.{}:2379", i + 1)],
                is_learner: false,
            })
            .collect();
        Ok(MemberList { header: Header { cluster_id: 7, member_id: member_id(j) }, members })
    }
    async fn status(&self, ep: &Endpoint) -> anyhow::Result<Status> {
        let j = self.reach(ep).await?;
        let w = self.w.borrow();
        let up: Vec<usize> = (0..w.dead.len()).filter(|&i| w.up(i)).collect();
        let leader = if up.len() * 2 > w.dead.len() { member_id(up[0]) } else { 0 };
        Ok(Status {
            header: Header { cluster_id: 7, member_id: member_id(j) },
            version: "3.6.0".into(),
            leader,
            raft_index: 5000,
            raft_applied_index: if w.lagging[j] { 10 } else { 5000 },
            raft_term: 2,
            is_learner: false,
            errors: vec![],
        })
    }
}

struct SimK3s {
    me: usize,
    w: Shared,
}

impl SimK3s {
    /// A restart of k3s asked for by regrade: the moment the promise is about.
    fn restart(&self, to: Level) {
        let mut w = self.w.borrow_mut();
        w.look_at_record(self.me);
        // A member already down (its k3s failed to come up) has no vote to lose: the
        // restart that puts its previous flags back is no new risk. One the gate saw
        // down that came back after the look, in its window, is the same race as a
        // peer that died in it (below): what every check before an act leaves.
        let asked_me = w.asked[self.me][self.me];
        let back_after_look = w.up_since(self.me) > asked_me && asked_me.elapsed() <= LOOK_WINDOW;
        let costs_a_vote = w.up(self.me) && !back_after_look;
        for j in (0..w.dead.len()).filter(|&j| j != self.me && costs_a_vote) {
            // Down when this server's gate last asked it, or down and not asked since
            // the last look's window (the rest of the look and the bus call, at most
            // 6 s): what the gate is for. A member that died in that window after
            // the look is what every check before an act leaves.
            let asked = w.asked[self.me][j];
            if !w.up(j) && (w.went_down[j] <= asked || asked.elapsed() > LOOK_WINDOW) {
                let why =
                    if w.restarting(j) && w.by_regrade[j] { "restarting for regrade too (one step)" } else { "down" };
                w.violate(format!("quorum: server{} asked k3s to restart while server{j}'s member is {why}", self.me));
            }
        }
        // Only under the Lease, and before another server could have taken it over.
        if w.lease != Some(self.me) || w.renewed.elapsed() > LEASE_FOR {
            let (holder, ago) = (w.lease, w.renewed.elapsed());
            w.violate(format!(
                "Lease: server{} asked k3s to restart while the Lease was {holder:?}'s, renewed {ago:?} ago (lasts \
                 {LEASE_FOR:?})",
                self.me
            ));
        }
        // Mostly 2–30 s; one in five slow, 30–55 s (under the health wait's minute);
        // one in twenty hangs. The Node reports Ready when k3s is back, or, one time
        // in four, 20–55 s later (the kubelet slow): with a member that lags, the
        // step's waits then reach its deadline (a cut at `applied`, say).
        let took = match w.rng.below(20) {
            0 => Duration::from_secs(600),
            1..=4 => w.rng.secs(30, 55),
            _ => w.rng.secs(2, 30),
        };
        let kubelet = if w.rng.below(4) == 0 { w.rng.secs(20, 55) } else { Duration::ZERO };
        w.ready_at[self.me] = Instant::now() + took + kubelet;
        let refused = if w.refuses[self.me] == Some(to) { ": it refuses these flags, and crash-loops" } else { "" };
        w.say(format!("server{} k3s restarts into {to} (takes {took:?}){refused}", self.me));
        w.running[self.me] = to;
        w.restarting_until[self.me] = Some(Instant::now() + took);
        w.went_down[self.me] = Instant::now();
        w.by_regrade[self.me] = true;
    }
    /// A restart of k3s as the systemd actuator sends it: the bus reached and the
    /// unit read first (slow, before the look), then through the one function that
    /// sends restarts ([`restart::send`]): the look at its moment, the drop-in's
    /// durable write (slow now and then), and RestartUnit (up to its timeout; systemd
    /// executes the job when the call ends, so one that is late is the call's hang).
    async fn send_restart(&self, r: &dyn NodeReadiness, purpose: Purpose, to: Level) -> anyhow::Result<()> {
        let connect = self.w.borrow_mut().bus_connect();
        tokio::time::sleep(connect).await;
        let me = self.me;
        let write = Box::pin(async move {
            let took = self.w.borrow_mut().durable_write();
            tokio::time::sleep(took).await;
            self.w.borrow_mut().look_at_record(me);
            self.w.borrow_mut().dropin[me] = to;
            anyhow::Ok(())
        });
        let what = format!("server{me}'s k3s into {to}");
        let request = restart::Request { purpose, what, timeout: CALL_TIMEOUT, write: Some(write) };
        let ask = async {
            let took = self.w.borrow_mut().bus_call();
            tokio::time::sleep(took).await;
            self.restart(to);
            anyhow::Ok(())
        };
        restart::send(r, request, ask).await
    }
    /// As the systemd actuator after a restart: etcd healthy, then (where the agent
    /// runs) the Node Ready on a fresh heartbeat; else the undoing, allowed at its
    /// moment and sent by the same rule as every restart ([`restart::send`]).
    async fn serve_or_undo(&self, from: Level, to: Level, r: &dyn NodeReadiness) -> anyhow::Result<()> {
        let me = self.me;
        let mut served = wait_until(
            &self.w,
            |w| !w.restarting(me) && !w.crash_looping(me),
            Duration::from_secs(60),
            "k3s not healthy",
        )
        .await;
        if served.is_ok() && self.w.borrow().levels.runs_agent(to) {
            served = r.wait_ready_since(SystemTime::now(), Duration::from_secs(60)).await;
        }
        let Err(e) = served else { return Ok(()) };
        let failed = format!("server{me} {from} -> {to}: {e:#}");
        if let Err(no) = self.send_restart(r, Purpose::Back, from).await {
            return Err(regrade::actuator::undo_pending(r, no, &failed, from));
        }
        Err(e.context(format!("restored {from}'s file and restarted into it")))
    }
}

#[async_trait(?Send)]
impl Actuator for SimK3s {
    fn levels(&self) -> &[Level] {
        &Level::ALL
    }
    async fn current_level(&self) -> anyhow::Result<Level> {
        Ok(self.w.borrow().running[self.me])
    }
    async fn apply_level(&mut self, to: Level, r: &dyn NodeReadiness) -> anyhow::Result<()> {
        {
            // One level per step: from the level this server's file is at.
            let mut w = self.w.borrow_mut();
            let at = w.dropin[self.me];
            if at.index_in(&Level::ALL).unwrap().abs_diff(to.index_in(&Level::ALL).unwrap()) > 1 {
                w.violate(format!("one step: server{} asked to go from {at} to {to}, two levels", self.me));
            }
        }
        let (running, before) = (self.w.borrow().running[self.me], self.w.borrow().dropin[self.me]);
        if !self.w.borrow().levels.needs_restart(running, to) {
            r.progress(Phase::Writing);
            self.w.borrow_mut().look_at_record(self.me);
            self.w.borrow_mut().dropin[self.me] = to;
            return Ok(());
        }
        if let Err(e) = self.send_restart(r, Purpose::Forward, to).await {
            // Not restarted: the file goes back, as the actuators put it back.
            self.w.borrow_mut().dropin[self.me] = before;
            return Err(e);
        }
        self.serve_or_undo(before, to, r).await
    }
    async fn observe(&self) -> anyhow::Result<(Option<Level>, Option<Level>)> {
        let w = self.w.borrow();
        Ok((Some(w.dropin[self.me]), (!w.restarting(self.me)).then_some(w.running[self.me])))
    }
    async fn rewrite(&mut self, level: Level) -> anyhow::Result<()> {
        self.w.borrow_mut().dropin[self.me] = level;
        Ok(())
    }
    async fn roll_back(&mut self, from: Level, restarted: bool, r: &dyn NodeReadiness) -> anyhow::Result<String> {
        self.w.borrow_mut().look_at_record(self.me);
        if restarted {
            self.send_restart(r, Purpose::Back, from).await?;
        } else {
            self.w.borrow_mut().dropin[self.me] = from;
        }
        Ok(format!("back at {from}"))
    }
    async fn resume(&mut self, from: Level, to: Level, r: &dyn NodeReadiness) -> anyhow::Result<()> {
        if self.w.borrow().running[self.me] == to {
            self.w.borrow_mut().dropin[self.me] = to;
            return self.serve_or_undo(from, to, r).await;
        }
        self.apply_level(to, r).await
    }
}

const CALM: &str = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
const OVER: &str =
    "some avg10=80.00 avg60=50.00 avg300=20.00 total=9\nfull avg10=40.00 avg60=20.00 avg300=9.00 total=9\n";

struct Server {
    dir: PathBuf,
    cfg: Rc<Config>,
    /// Reads its memory from a cgroup v2 tree (`pressure.memory_cgroup`):
    /// `system.slice` limited to 512 MiB, `k3s.service` in it unlimited.
    cgroup: bool,
    /// Its memory is over.
    over: bool,
    task: Option<tokio::task::JoinHandle<()>>,
    /// A `regrade step` under way on this server.
    hand: Option<tokio::task::JoinHandle<()>>,
}

fn backend(i: usize, w: &Shared, cfg: &Config) -> Backend {
    let etcd = EtcdGate::with(SimEtcd { me: i, w: w.clone() }, &cfg.etcd).unwrap();
    Backend {
        actuator: Box::new(SimK3s { me: i, w: w.clone() }),
        cluster: Box::new(SimCluster { me: i, w: w.clone() }),
        etcd: Box::new(etcd),
    }
}

impl Server {
    fn new(root: &Path, i: usize, cgroup: bool, short_deadline: bool) -> Server {
        let dir = root.join(format!("server{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("psi"), CALM).unwrap();
        std::fs::write(dir.join("meminfo"), "MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n").unwrap();
        // The cgroup server: its PSI is k3s.service's memory.pressure (the default
        // source resolves to it), its floor 256 MiB of the slice's 512.
        let pressure = if cgroup {
            let k3s = dir.join("cgroup/system.slice/k3s.service");
            std::fs::create_dir_all(&k3s).unwrap();
            std::fs::write(k3s.parent().unwrap().join("memory.max"), format!("{}\n", 512 << 20)).unwrap();
            std::fs::write(k3s.join("memory.max"), "max\n").unwrap();
            for d in [k3s.parent().unwrap(), &k3s] {
                std::fs::write(d.join("memory.stat"), "anon 0\nfile 0\ninactive_file 0\nactive_file 0\n").unwrap();
            }
            format!("memory_cgroup = {k3s:?}\nmem_available_floor = \"256MiB\"\n")
        } else {
            format!("source = {:?}\nmem_available_floor = \"none\"\n", dir.join("psi"))
        };
        let mut srv = Server { dir: dir.clone(), cfg: Rc::default(), cgroup, over: false, task: None, hand: None };
        srv.set_memory(false);
        // `hold_at_control_plane = false`: the hold only ever removes a restart (the
        // cgroup server, 12 MiB over a 256 MiB floor, would never reach etcd-only), and
        // this model is here to put every restart under faults. The hold itself:
        // decide's and watch's tests.
        let cfg = Config::parse(&format!(
            "state_file = {:?}\nlevel_record = {:?}\n[pressure]\n{pressure}meminfo = {:?}\n\
             sample_period = \"10s\"\nsustain = \"30s\"\ncooldown = \"60s\"\n\
             [levels]\nstep_timeout = \"4m10s\"\n[levels.control-plane]\ndrain = false\n[levels.etcd-only]\ndrain = false\n\
             [systemd]\nhealth_timeout = \"1m\"\nready_timeout = \"1m\"\n[etcd]\ncatch_up_timeout = \"2m\"\n\
             members_cache = {:?}\nhold_at_control_plane = false\n",
            dir.join("state.json"),
            dir.join("level.json"),
            dir.join("meminfo"),
            dir.join("etcd-members.json"),
        ))
        .unwrap();
        let mut cfg = cfg;
        if short_deadline {
            // Shorter than the step's waits at their bounds, which check-config refuses
            // on a server: here so that the deadline's rollback (at every phase,
            // `applied` among them) is put under the faults, whatever brings a
            // deadline on a real server.
            cfg.levels.step_timeout = regrade::units::HumanDuration(Duration::from_secs(150));
        }
        srv.cfg = Rc::new(cfg);
        srv
    }

    /// Memory over or calm: the PSI file, and for the cgroup server the slice's usage
    /// near its limit (500 of 512 MiB, 12 MiB available) or not (100 MiB).
    fn set_memory(&mut self, over: bool) {
        let psi = if over { OVER } else { CALM };
        if self.cgroup {
            let k3s = self.dir.join("cgroup/system.slice/k3s.service");
            let used = format!("{}\n", if over { 500u64 << 20 } else { 100 << 20 });
            std::fs::write(k3s.join("memory.pressure"), psi).unwrap();
            std::fs::write(k3s.join("memory.current"), &used).unwrap();
            std::fs::write(k3s.parent().unwrap().join("memory.current"), &used).unwrap();
        } else {
            std::fs::write(self.dir.join("psi"), psi).unwrap();
        }
        self.over = over;
    }

    /// **Reading**: what regrade's own sampler (`Sampler::for_config`, as `watch` opens
    /// it) and the core make of this server's memory is what the world says: over
    /// while it is over, calm while calm. For the cgroup server the slice's limit is
    /// the one that binds.
    fn check_reading(&self, i: usize, w: &Shared) {
        let mut sampler = Sampler::for_config(&self.cfg.pressure).unwrap();
        // No look at the member: the world's pressure alone (a member in distress only
        // ever adds an over reading where PSI is over already).
        let no_look = regrade::decide::MemberSignals::default();
        let reading = self.cfg.core_settings().classify(&sampler.sample().unwrap(), &no_look);
        let want = if self.over { Reading::Over } else { Reading::Calm };
        if reading != want {
            let what = if self.cgroup { " (a cgroup whose slice's limit binds)" } else { "" };
            w.borrow_mut().violate(format!(
                "reading: server{i}'s memory is {}{what}, but regrade reads {}",
                want.as_str(),
                reading.as_str()
            ));
        }
    }

    /// `regrade step` as an operator runs it; its end goes into the trace.
    fn hand_step(&mut self, i: usize, w: &Shared, target: StepTarget) {
        let (backend, cfg, w) = (backend(i, w, &self.cfg), self.cfg.clone(), w.clone());
        self.hand = Some(tokio::task::spawn_local(async move {
            let end = match regrade::hand::step_by_hand_with(&cfg, backend, target).await {
                Ok(_) => "ended".to_string(),
                Err(e) => format!("failed: {e:#}"),
            };
            w.borrow_mut().say(format!("server{i} hand step {target:?} {end}"));
        }));
    }

    fn hand_running(&self) -> bool {
        self.hand.as_ref().is_some_and(|h| !h.is_finished())
    }

    fn kill_hand(&mut self) {
        if let Some(t) = self.hand.take() {
            t.abort();
        }
    }

    fn start(&mut self, i: usize, w: &Shared) {
        let backend = backend(i, w, &self.cfg);
        let cfg = self.cfg.clone();
        let w = w.clone();
        self.task = Some(tokio::task::spawn_local(async move {
            let sampler = Sampler::for_config(&cfg.pressure).unwrap();
            if let Err(e) = regrade::watch::run_with(&cfg, backend, sampler, std::future::pending()).await {
                w.borrow_mut().say(format!("server{i} watch stopped: {e:#}"));
            }
        }));
    }

    fn kill(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }

    fn record(&self) -> Option<LevelRecord> {
        LevelRecord::read(&self.dir.join("level.json")).ok().flatten()
    }
}

/// One seed: `servers` servers, 20 min of faults, then calm until all are back at full.
async fn run_seed(seed: u64, servers: usize, root: &Path) -> Outcome {
    let w: Shared = Rc::new(RefCell::new(World {
        start: Instant::now(),
        rng: Rng::new(seed),
        lease: None,
        renewed: Instant::now(),
        label: vec![None; servers],
        running: vec![Level::Full; servers],
        restarting_until: vec![None; servers],
        by_regrade: vec![false; servers],
        dead: vec![false; servers],
        lagging: vec![false; servers],
        refuses: vec![None; servers],
        went_down: vec![Instant::now(); servers],
        asked: vec![vec![Instant::now(); servers]; servers],
        not_ready: vec![false; servers],
        ready_at: vec![Instant::now(); servers],
        dropin: vec![Level::Full; servers],
        api_down: false,
        renewals_stall_until: Instant::now(),
        levels: LevelsConfig::default(),
        records: (0..servers).map(|i| root.join(format!("server{i}/level.json"))).collect(),
        seen: vec![None; servers],
        trace: vec![],
        violations: vec![],
    }));
    {
        // One seed in four: one server's k3s refuses the flags of etcd-only (a custom
        // flag this k3s does not know), so every restart into it crash-loops.
        let mut wb = w.borrow_mut();
        if wb.rng.below(4) == 0 {
            let i = wb.rng.below(servers as u64) as usize;
            wb.refuses[i] = Some(Level::EtcdOnly);
            wb.say(format!("server{i}'s k3s refuses the flags of etcd-only"));
        }
    }
    // Every other seed, server0 reads its memory from a cgroup whose parent's limit binds.
    let cgroup = seed % 4 < 2;
    // One seed in three, steps whose deadline (2m30s) comes before their waits'
    // bounds: the deadline path exercised.
    let short_deadline = seed % 3 == 0;
    let mut s: Vec<Server> = (0..servers).map(|i| Server::new(root, i, cgroup && i == 0, short_deadline)).collect();
    for (i, srv) in s.iter_mut().enumerate() {
        srv.start(i, &w);
    }
    let faults_until = Duration::from_secs(480);
    let mut boots: Vec<Option<Instant>> = vec![None; servers];
    while w.borrow().start.elapsed() < faults_until {
        let gap = w.borrow_mut().rng.secs(2, 30);
        let until = Instant::now() + gap;
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_secs(2)).await;
            for i in 0..servers {
                if boots[i].is_some_and(|b| Instant::now() >= b) {
                    boots[i] = None;
                    w.borrow_mut().say(format!("server{i} booted: watch starts"));
                    s[i].start(i, &w);
                }
            }
        }
        let (kind, mut i) = {
            let mut wb = w.borrow_mut();
            (wb.rng.below(100), wb.rng.below(servers as u64) as usize)
        };
        if (80..=89).contains(&kind) {
            // An operator steps by hand where a server looks stuck (a step under way in
            // its record, which watch has not finished yet) one time in two.
            let stuck = (0..servers).find(|&j| s[j].record().is_some_and(|r| r.step.is_some()));
            if let Some(j) = stuck.filter(|_| w.borrow_mut().rng.below(2) == 0) {
                i = j;
            }
        }
        let mut wb = w.borrow_mut();
        match kind {
            0..=34 => {
                let over = wb.rng.below(2) == 0;
                wb.say(format!("server{i} memory {}", if over { "over" } else { "calm" }));
                s[i].set_memory(over);
                drop(wb);
                s[i].check_reading(i, &w);
                continue;
            }
            35..=49 if boots[i].is_none() => {
                let back = wb.rng.secs(0, 20);
                wb.say(format!("server{i} watch SIGKILLed, back in {back:?}"));
                s[i].kill();
                boots[i] = Some(Instant::now() + back);
            }
            50..=59 => {
                let dead = !wb.dead[i];
                wb.say(format!("server{i} etcd member {}", if dead { "dies" } else { "is back" }));
                wb.dead[i] = dead;
                wb.went_down[i] = Instant::now();
            }
            60..=64 => {
                let lag = !wb.lagging[i];
                wb.say(format!("server{i} etcd member {}", if lag { "lags" } else { "caught up" }));
                wb.lagging[i] = lag;
            }
            95..=99 => {
                let not_ready = !wb.not_ready[i];
                wb.say(format!("server{i} Node {}", if not_ready { "stays NotReady" } else { "Ready again" }));
                wb.not_ready[i] = not_ready;
            }
            65..=69 => {
                wb.api_down = !wb.api_down;
                let now = if wb.api_down { "down" } else { "up" };
                wb.say(format!("the API is {now}"));
            }
            70..=74 => {
                let stall = wb.rng.secs(5, 40);
                wb.say(format!("the API is slow: no Lease renewal lands for {stall:?}"));
                wb.renewals_stall_until = Instant::now() + stall;
            }
            80..=89 if boots[i].is_none() && !s[i].hand_running() => {
                let target = match wb.rng.below(4) {
                    0 => StepTarget::Down,
                    1 => StepTarget::Up,
                    _ => StepTarget::To { level: Level::Full },
                };
                wb.say(format!("server{i} regrade step {target:?} by hand"));
                drop(wb);
                s[i].hand_step(i, &w, target);
                continue;
            }
            90..=94 if s[i].hand_running() => {
                wb.say(format!("server{i} hand step SIGKILLed"));
                s[i].kill_hand();
            }
            75..=79 if boots[i].is_none() => {
                let took = wb.rng.secs(10, 40);
                wb.say(format!("server{i} reboots ({took:?}): k3s starts from its drop-in"));
                s[i].kill();
                s[i].kill_hand();
                let dropin = wb.dropin[i];
                wb.running[i] = dropin;
                wb.restarting_until[i] = Some(Instant::now() + took);
                wb.went_down[i] = Instant::now();
                wb.by_regrade[i] = false;
                boots[i] = Some(Instant::now() + took);
            }
            _ => {}
        }
    }
    // The faults stop: everything up, memory calm everywhere.
    {
        let mut wb = w.borrow_mut();
        wb.say("faults stop; memory calm everywhere".into());
        wb.api_down = false;
        wb.dead.iter_mut().for_each(|d| *d = false);
        wb.lagging.iter_mut().for_each(|d| *d = false);
        wb.not_ready.iter_mut().for_each(|d| *d = false);
    }
    for (i, srv) in s.iter_mut().enumerate() {
        srv.set_memory(false);
        if boots[i].take().is_some() {
            srv.start(i, &w);
        }
    }
    let settled = Instant::now() + Duration::from_secs(900);
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let all_full = {
            let wb = w.borrow();
            (0..servers).all(|i| {
                let r = s[i].record();
                r.is_some_and(|r| r.level == Level::Full && r.step.is_none())
                    && wb.dropin[i] == Level::Full
                    && !wb.levels.needs_restart(wb.running[i], Level::Full)
                    && !wb.restarting(i)
                    && wb.label[i].is_none()
            })
        };
        if all_full {
            break;
        }
        if Instant::now() >= settled {
            let mut wb = w.borrow_mut();
            for i in 0..servers {
                let r = s[i].record().map(|r| (r.level, r.step.map(|s| (s.from, s.to, s.phase))));
                let state = format!(
                    "server{i}: record {r:?}, drop-in {}, k3s {}, label {:?}",
                    wb.dropin[i], wb.running[i], wb.label[i]
                );
                wb.say(state);
            }
            wb.violate("liveness: 15 min after the faults stopped, not every server is back at full".into());
            break;
        }
    }
    for srv in &mut s {
        srv.kill();
        srv.kill_hand();
    }
    let mut wb = w.borrow_mut();
    Outcome { trace: std::mem::take(&mut wb.trace), violations: std::mem::take(&mut wb.violations) }
}

struct Outcome {
    trace: Vec<String>,
    violations: Vec<String>,
}

fn one(seed: u64, servers: usize) -> Outcome {
    let root = tempfile::Builder::new().prefix("regrade-sim").tempdir_in(shm()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
    let local = tokio::task::LocalSet::new();
    let w = local.block_on(&rt, run_seed(seed, servers, root.path()));
    drop(local);
    w
}

/// tmpfs where there is one: the level record is fsynced at every phase.
fn shm() -> PathBuf {
    let p = Path::new("/dev/shm");
    if p.is_dir() {
        p.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// What one thread found over its share of the seeds: its first failure, and counts.
#[derive(Default)]
struct Tally {
    failed: Option<(u64, usize, Outcome)>,
    events: usize,
    steps: usize,
}

fn servers_for(seed: u64) -> usize {
    // Odd seeds: 5 servers; even: 3.
    if seed % 2 == 1 {
        5
    } else {
        3
    }
}

#[test]
fn the_promise_holds_on_every_seed() {
    let single = std::env::var("REGRADE_SIM_SEED").ok().map(|s| s.parse::<u64>().unwrap());
    let n: u64 = std::env::var("REGRADE_SIM_SEEDS").ok().map_or(300, |s| s.parse().unwrap());
    let started = std::time::Instant::now();
    if let Some(seed) = single {
        let w = one(seed, servers_for(seed));
        w.trace.iter().for_each(|l| println!("{l}"));
        assert!(w.violations.is_empty(), "seed {seed}: {}", w.violations.join("\n"));
        return;
    }
    // Seeds are independent: one thread per core, each with its own runtime.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let tallies: Vec<Tally> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                scope.spawn(move || {
                    let mut tally = Tally::default();
                    for seed in (t..n).step_by(threads as usize) {
                        let w = one(seed, servers_for(seed));
                        tally.events += w.trace.len();
                        tally.steps += w.trace.iter().filter(|l| l.contains("step done")).count();
                        if !w.violations.is_empty() {
                            tally.failed = Some((seed, servers_for(seed), w));
                            break;
                        }
                    }
                    tally
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (events, steps) = tallies.iter().fold((0, 0), |(e, s), t| (e + t.events, s + t.steps));
    eprintln!(
        "simulator: {n} seeds on {threads} threads, {events} events, {steps} steps done, in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    if let Some((seed, servers, w)) = tallies.into_iter().filter_map(|t| t.failed).min_by_key(|f| f.0) {
        let tail = w.trace.len().saturating_sub(120);
        w.trace[tail..].iter().for_each(|l| eprintln!("{l}"));
        panic!(
            "seed {seed} ({servers} servers): {}\nreplay: REGRADE_SIM_SEED={seed} cargo test --test testsuite simulator:: -- --nocapture",
            w.violations.join("\n")
        );
    }
}
