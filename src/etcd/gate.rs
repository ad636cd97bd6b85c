//! One look at the cluster through [`AskEtcd`], and the two questions the step asks of
//! it: may this member restart now, and is it back after the restart.
//!
//! The gate judges the **other** voters, so it must be answerable while this server's
//! own member is down (k3s crash-looping at a new level, OOM-killed while starting):
//! when the local endpoints do not answer, the member list is asked of the other
//! members at the client URLs they had at the last look (`etcd.members_cache`). A
//! local member that refuses the connection everywhere it is known is *down*: it has
//! no vote left to lose, so a restart, which is the way back, is never refused then.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, Context};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::client::{refused, AskEtcd, Endpoint, EtcdClient, MemberList, Status};
use super::judge::{self, EtcdRefusal, View};
use super::EtcdConfig;
use crate::fsutil;

/// How often [`EtcdGate::wait_back`] looks again.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// A look at etcd slower than this is logged with where its time went.
const SLOW_LOOK: Duration = Duration::from_millis(300);

/// How long one look's two rounds took: the member list (and where from), then the
/// statuses asked at once (the slowest).
struct LookTimes {
    list: Duration,
    list_from: Endpoint,
    slowest_status: Slowest,
}

/// The slowest status of a round: its member ID and how long it took.
#[derive(Clone, Copy)]
struct Slowest(u64, Duration);

impl Slowest {
    fn slower(self, other: Slowest) -> Slowest {
        if self.1 >= other.1 {
            self
        } else {
            other
        }
    }
}

/// Which members a list has and which of them vote: what two lists must agree on.
fn membership(list: &MemberList) -> Vec<(u64, bool)> {
    let mut m: Vec<(u64, bool)> = list.members.iter().map(|m| (m.id, m.is_learner)).collect();
    m.sort();
    m
}

/// One look: what etcd said, and whether the local member is known down.
pub struct Look {
    pub view: View,
    /// Every local endpoint refused the connection, and this member's own client URLs
    /// did not answer either: nothing of it runs.
    pub this_down: bool,
}

/// Why the gate says no.
#[derive(Debug)]
pub enum GateError {
    /// Neither the local member nor any other known member answered: etcd cannot be asked.
    Unavailable(anyhow::Error),
    /// etcd answered, and the answer refuses the restart.
    Refused(EtcdRefusal),
}

impl std::fmt::Display for GateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GateError::Unavailable(e) => write!(f, "etcd cannot be asked: {e:#}"),
            GateError::Refused(r) => write!(f, "{r}"),
        }
    }
}

impl std::error::Error for GateError {}

/// A restart the gate lets through, and for which member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cleared {
    /// This server's member ID (what the wait after the restart waits for).
    pub me: u64,
    /// This member was down: the others were not judged, since a restart cannot cost a
    /// vote that is already gone.
    pub this_down: bool,
}

/// What the last look that reached the local member saw: which member is this
/// server's, and every member's client URLs. Kept in `etcd.members_cache`, so a
/// regrade started while its member is down can still ask the others.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnownMembers {
    pub me: u64,
    pub members: Vec<(u64, Vec<String>)>,
}

impl KnownMembers {
    fn of(list: &MemberList, me: u64) -> KnownMembers {
        let mut members: Vec<(u64, Vec<String>)> =
            list.members.iter().filter(|m| !m.client_urls.is_empty()).map(|m| (m.id, m.client_urls.clone())).collect();
        members.sort();
        KnownMembers { me, members }
    }

    fn read(path: &Path) -> anyhow::Result<Option<KnownMembers>> {
        let Some(bytes) = fsutil::read_if_exists(path).with_context(|| format!("reading {}", path.display()))? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).with_context(|| format!("{}: not a member cache", path.display()))
    }
}

pub struct EtcdGate<A: AskEtcd = EtcdClient> {
    ask: A,
    endpoints: Vec<Endpoint>,
    max_raft_lag: u64,
    catch_up_timeout: Duration,
    /// `etcd.members_cache` (empty: none), and what it holds, once read or written.
    cache: PathBuf,
    known: RefCell<Option<KnownMembers>>,
}

impl EtcdGate<EtcdClient> {
    /// Reads the certificates (an error names the missing or unreadable file).
    pub fn new(cfg: &EtcdConfig) -> anyhow::Result<EtcdGate> {
        EtcdGate::with(EtcdClient::new(cfg)?, cfg)
    }
}

impl<A: AskEtcd> EtcdGate<A> {
    /// A gate asking through `ask` (the simulator's model, in its tests).
    pub fn with(ask: A, cfg: &EtcdConfig) -> anyhow::Result<EtcdGate<A>> {
        let endpoints = cfg
            .endpoints
            .iter()
            .map(|e| Endpoint::parse(e).map_err(|err| anyhow!("etcd.endpoints: {err}")))
            .collect::<anyhow::Result<_>>()?;
        Ok(EtcdGate {
            ask,
            endpoints,
            max_raft_lag: cfg.max_raft_lag,
            catch_up_timeout: cfg.catch_up_timeout.0,
            cache: cfg.members_cache.clone(),
            known: RefCell::new(None),
        })
    }

    pub fn max_raft_lag(&self) -> u64 {
        self.max_raft_lag
    }

    pub fn catch_up_timeout(&self) -> Duration {
        self.catch_up_timeout
    }

    /// The member list and every member's status: [`Self::look_timed`].
    pub async fn look(&self) -> anyhow::Result<Look> {
        self.look_timed().await.map(|(look, _)| look)
    }

    fn known(&self) -> Option<KnownMembers> {
        if self.known.borrow().is_none() && !self.cache.as_os_str().is_empty() {
            match KnownMembers::read(&self.cache) {
                Ok(k) => *self.known.borrow_mut() = k,
                Err(e) => tracing::warn!(error = %format!("{e:#}"), "etcd.members_cache cannot be used"),
            }
        }
        self.known.borrow().clone()
    }

    /// Makes sure the members are known (`etcd.members_cache`): a look through the
    /// local member when none are known yet. Without them, a look while the local
    /// member does not answer (slow under the thrash, or down) cannot ask the others,
    /// and the restart into `etcd-only` is refused as `etcd-unavailable`.
    pub async fn learn_members(&self) -> anyhow::Result<()> {
        if self.known().is_some() {
            return Ok(());
        }
        self.look().await.map(|_| ())
    }

    /// Keeps what a look through the local member saw, when it changed (a membership
    /// change is rare: the file is written durably then, not every look).
    fn remember(&self, list: &MemberList, me: u64) {
        let now = KnownMembers::of(list, me);
        if self.known().as_ref() == Some(&now) {
            return;
        }
        if !self.cache.as_os_str().is_empty() {
            let bytes = serde_json::to_vec(&now).expect("a member cache serializes");
            if let Err(e) = fsutil::write_atomic(&self.cache, &bytes, 0o600, "etcd-members-cache") {
                tracing::warn!(error = %e, file = %self.cache.display(), "could not keep the etcd members for later");
            }
        }
        *self.known.borrow_mut() = Some(now);
    }

    /// The member list, from the first local endpoint that answers or else from another
    /// member at the client URLs it was known by; then every member's status asked at
    /// its own client URLs (this member's at the local endpoint that answered), all at
    /// once, each bounded by the request timeout.
    async fn look_timed(&self) -> anyhow::Result<(Look, LookTimes)> {
        let started = Instant::now();
        let mut errors = Vec::new();
        let mut local_refused = true;
        let mut found: Option<(Endpoint, MemberList, u64)> = None;
        for ep in &self.endpoints {
            match self.ask.member_list(ep).await {
                Ok(l) => {
                    let me = l.header.member_id;
                    found = Some((ep.clone(), l, me));
                    break;
                }
                Err(e) => {
                    local_refused &= refused(&e);
                    errors.push(format!("{e:#}"));
                }
            }
        }
        let local_answered = found.is_some();
        if !local_answered {
            let known = self.known().ok_or_else(|| {
                anyhow!(
                    "the local etcd member did not answer ({}), and no other member is known yet (etcd.members_cache)",
                    errors.join("; ")
                )
            })?;
            'others: for (_, urls) in known.members.iter().filter(|(id, _)| *id != known.me) {
                for u in urls {
                    let Ok(ep) = Endpoint::parse(u) else { continue };
                    match self.ask.member_list(&ep).await {
                        Ok(l) => {
                            found = Some((ep, l, known.me));
                            break 'others;
                        }
                        Err(e) => errors.push(format!("{e:#}")),
                    }
                }
            }
        }
        let (from, list, me) = found
            .ok_or_else(|| anyhow!("neither the local etcd member nor any other answered: {}", errors.join("; ")))?;
        let list_took = started.elapsed();
        if local_answered {
            self.remember(&list, me);
        }
        let local = local_answered.then_some(&from);
        let (statuses, mut slowest) = self.statuses(&list, me, local).await;
        let mut view = View { list, statuses, me };
        let this_down = !local_answered && local_refused && !matches!(view.status(me), Some(Ok(_)));
        // A member list may be one the cluster has moved past (a member added or
        // removed without it): the local member's when it is not healthy itself (it
        // sees no leader, or lags), and another member's, which may be a follower that
        // has not applied a member change yet. The leader's list is the one judged
        // then (not needed for a member down: its restart is let through unjudged).
        // The statuses are asked again after the leader's list, so that the answers
        // judged are the look's last part, not a round older than the act.
        let unsure = !local_answered || judge::is_back(&view, me, self.max_raft_lag).is_err();
        if let Some(leaders) = if unsure && !this_down { self.leaders_list(&view).await } else { None } {
            if membership(&leaders) != membership(&view.list) {
                tracing::info!(
                    list_from = %from,
                    "the member list came from a member that may be behind, and differs from the leader's: judging \
                     the leader's"
                );
            }
            let (statuses, again) = self.statuses(&leaders, me, local).await;
            view = View { list: leaders, statuses, me };
            slowest = slowest.slower(again);
        }
        let times = LookTimes { list: list_took, list_from: from, slowest_status: slowest };
        Ok((Look { view, this_down }, times))
    }

    /// Every member's status in `list`, asked at once at its client URLs (this
    /// member's at `local`, the endpoint that answered, if any), and the slowest ask.
    async fn statuses(
        &self,
        list: &MemberList,
        me: u64,
        local: Option<&Endpoint>,
    ) -> (Vec<(u64, Result<Status, String>)>, Slowest) {
        let asks = list.members.iter().map(|m| {
            let urls: anyhow::Result<Vec<Endpoint>> = match local {
                Some(ep) if m.id == me => Ok(vec![ep.clone()]),
                _ => m.client_urls.iter().map(|u| Endpoint::parse(u)).collect(),
            };
            let id = m.id;
            async move {
                let asked = Instant::now();
                let urls = match urls {
                    Ok(u) => u,
                    Err(e) => return (id, Err(format!("{e:#}")), Duration::ZERO),
                };
                let mut last = String::from("no client URL");
                for u in &urls {
                    match self.ask.status(u).await {
                        Ok(s) => return (id, Ok(s), asked.elapsed()),
                        Err(e) => last = format!("{e:#}"),
                    }
                }
                (id, Err(last), asked.elapsed())
            }
        });
        let mut slowest = Slowest(0, Duration::ZERO);
        let mut statuses = Vec::new();
        for (id, status, took) in futures_util::future::join_all(asks).await {
            if took >= slowest.1 {
                slowest = Slowest(id, took);
            }
            statuses.push((id, status));
        }
        (statuses, slowest)
    }

    /// The member list of the leader another member names, asked at its client URLs.
    async fn leaders_list(&self, view: &View) -> Option<MemberList> {
        let leader = view
            .statuses
            .iter()
            .filter(|(id, _)| *id != view.me)
            .find_map(|(_, s)| s.as_ref().ok().map(|s| s.leader).filter(|&l| l != 0 && l != view.me))?;
        let m = view.list.members.iter().find(|m| m.id == leader)?;
        for u in &m.client_urls {
            let Ok(ep) = Endpoint::parse(u) else { continue };
            if let Ok(l) = self.ask.member_list(&ep).await {
                return Some(l);
            }
        }
        None
    }

    /// Before a restart: whether this member may go down now. A member already down is
    /// let through (its restart is how it comes back); otherwise every other member is
    /// judged. A slow look says in the journal which part was slow (under memory
    /// pressure, the local member).
    pub async fn check(&self) -> Result<Cleared, GateError> {
        let (look, times) = self.look_timed().await.map_err(GateError::Unavailable)?;
        let view = &look.view;
        if times.list + times.slowest_status.1 >= SLOW_LOOK {
            let name = view.list.members.iter().find(|m| m.id == times.slowest_status.0).map(|m| m.name.as_str());
            tracing::info!(
                list_ms = times.list.as_millis() as u64,
                list_from = %times.list_from,
                status_ms = times.slowest_status.1.as_millis() as u64,
                slowest_member = name.unwrap_or(""),
                "etcd answered slowly: the member list, then every member's status at once"
            );
        }
        let me = view.self_id();
        if look.this_down {
            tracing::info!(
                list_from = %times.list_from,
                "this etcd member is down (nothing answers at its endpoints): a restart costs no vote"
            );
            return Ok(Cleared { me, this_down: true });
        }
        judge::may_restart(view, self.max_raft_lag).map_err(GateError::Refused)?;
        Ok(Cleared { me, this_down: false })
    }

    /// After a restart: waits until member `me` is back in the list, healthy and caught
    /// up, or `deadline` passes (the error gives the last reason).
    pub async fn wait_back(&self, me: u64, deadline: tokio::time::Instant, budget: &str) -> anyhow::Result<View> {
        loop {
            let last = match self.look().await {
                Ok(l) => match judge::is_back(&l.view, me, self.max_raft_lag) {
                    Ok(()) => return Ok(l.view),
                    Err(r) => r.to_string(),
                },
                Err(e) => format!("{e:#}"),
            };
            if tokio::time::Instant::now() + LOOK_EVERY >= deadline {
                anyhow::bail!("this etcd member was not back and caught up within {budget} (last: {last})");
            }
            tokio::time::sleep(LOOK_EVERY).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use async_trait::async_trait;

    use super::super::client::{Header, Member};
    use super::*;

    /// etcd as a table: what each endpoint answers; an endpoint not in it refuses.
    #[derive(Default)]
    struct Table {
        lists: HashMap<String, MemberList>,
        statuses: HashMap<String, Status>,
    }

    #[async_trait(?Send)]
    impl AskEtcd for Table {
        async fn member_list(&self, ep: &Endpoint) -> anyhow::Result<MemberList> {
            self.lists.get(&ep.to_string()).cloned().ok_or_else(|| refused_at(ep))
        }
        async fn status(&self, ep: &Endpoint) -> anyhow::Result<Status> {
            self.statuses.get(&ep.to_string()).cloned().ok_or_else(|| refused_at(ep))
        }
    }

    fn refused_at(ep: &Endpoint) -> anyhow::Error {
        anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)).context(format!("{ep}"))
    }

    fn url(id: u64) -> String {
        format!("https://10.0.0.{id}:2379")
    }

    fn member(id: u64) -> Member {
        Member {
            id,
            name: format!("server{id}-0000000{id}"),
            peer_urls: vec![format!("https://10.0.0.{id}:2380")],
            client_urls: vec![url(id)],
            is_learner: false,
        }
    }

    fn list(from: u64, members: Vec<Member>) -> MemberList {
        MemberList { header: Header { cluster_id: 7, member_id: from }, members }
    }

    fn status(id: u64, leader: u64) -> Status {
        Status {
            header: Header { cluster_id: 7, member_id: id },
            leader,
            raft_index: 100,
            raft_applied_index: 100,
            ..Status::default()
        }
    }

    fn gate(table: Table) -> EtcdGate<Table> {
        let cfg = EtcdConfig { members_cache: PathBuf::new(), ..EtcdConfig::default() };
        EtcdGate::with(table, &cfg).unwrap()
    }

    /// A gate that never looked knows no other member: with the local member not
    /// answering, it cannot be asked whether this member may restart. Once it learned
    /// the members while the local one answered, a gate started later (the same
    /// `etcd.members_cache`) asks the others, and clears the restart.
    #[tokio::test(flavor = "current_thread")]
    async fn members_learned_while_the_local_member_answers_are_asked_when_it_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EtcdConfig { members_cache: dir.path().join("members.json"), ..EtcdConfig::default() };
        let three: Vec<Member> = (1..=3).map(member).collect();
        let others = || {
            let mut t = Table::default();
            t.lists.insert(url(2), list(2, three.clone()));
            t.statuses.insert(url(2), status(2, 2));
            t.statuses.insert(url(3), status(3, 2));
            t
        };
        match EtcdGate::with(others(), &cfg).unwrap().check().await {
            Err(GateError::Unavailable(e)) => assert!(format!("{e:#}").contains("etcd.members_cache"), "{e:#}"),
            other => panic!("cleared with no member known: {other:?}"),
        }
        let mut answering = others();
        answering.lists.insert("https://127.0.0.1:2379".into(), list(1, three.clone()));
        answering.statuses.insert("https://127.0.0.1:2379".into(), status(1, 2));
        EtcdGate::with(answering, &cfg).unwrap().learn_members().await.unwrap();
        let later = EtcdGate::with(others(), &cfg).unwrap();
        assert_eq!(later.check().await.unwrap(), Cleared { me: 1, this_down: true });
        later.learn_members().await.expect("known from the cache: no look needed");
    }

    /// Was (issue 38): the member list came from the local member, which the gate never
    /// judges. Member 1 (this server's) sees no leader and still lists three members;
    /// the cluster added a fourth, not started yet. Judged by the local list the
    /// restart passed, and with this member down only 2 of 4 voters would be healthy.
    /// Now the leader's list is judged when the local member is not healthy itself.
    #[tokio::test(flavor = "current_thread")]
    async fn a_local_member_without_a_leader_is_not_trusted_for_the_member_list() {
        let three: Vec<Member> = (1..=3).map(member).collect();
        let mut four = three.clone();
        four.push(Member { id: 4, name: String::new(), client_urls: vec![], ..member(4) });
        let mut t = Table::default();
        t.lists.insert("https://127.0.0.1:2379".into(), list(1, three.clone()));
        t.lists.insert(url(2), list(2, four));
        t.statuses.insert("https://127.0.0.1:2379".into(), status(1, 0));
        t.statuses.insert(url(2), status(2, 2));
        t.statuses.insert(url(3), status(3, 2));
        match gate(t).check().await {
            Err(GateError::Refused(EtcdRefusal::Member { member, reason })) => {
                assert_eq!((member.id, reason.kind()), (4, "not-started"));
            }
            other => panic!("not refused for the fourth member: {other:?}"),
        }
        // A healthy local member's list is judged as it is (the leader is not asked).
        let mut t = Table::default();
        t.lists.insert("https://127.0.0.1:2379".into(), list(1, three));
        t.statuses.insert("https://127.0.0.1:2379".into(), status(1, 2));
        t.statuses.insert(url(2), status(2, 2));
        t.statuses.insert(url(3), status(3, 2));
        assert_eq!(gate(t).check().await.unwrap(), Cleared { me: 1, this_down: false });
    }

    /// Issue 55's suspicion: with the local member not answering, the member list was
    /// taken from the first other member that answered, which may be a follower that
    /// has not applied a member add yet. Member 2 (a follower) lists three; the leader
    /// (3) lists four, the fourth added and not started. Judged by 2's list the
    /// restart passed, and with this member down only 2 of 4 voters would be healthy.
    /// Now the leader's list is judged whenever the list came from another member.
    #[tokio::test(flavor = "current_thread")]
    async fn a_list_from_another_member_is_checked_against_the_leaders() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EtcdConfig { members_cache: dir.path().join("members.json"), ..EtcdConfig::default() };
        let three: Vec<Member> = (1..=3).map(member).collect();
        let mut learning = Table::default();
        learning.lists.insert("https://127.0.0.1:2379".into(), list(1, three.clone()));
        learning.statuses.insert("https://127.0.0.1:2379".into(), status(1, 3));
        EtcdGate::with(learning, &cfg).unwrap().learn_members().await.unwrap();
        let mut four = three.clone();
        four.push(Member { id: 4, name: String::new(), client_urls: vec![], ..member(4) });
        // The local endpoint does not answer; this member still answers its status at
        // its client URL (so it is not down, and is judged).
        let mut t = Table::default();
        t.lists.insert(url(2), list(2, three));
        t.lists.insert(url(3), list(3, four));
        t.statuses.insert(url(1), status(1, 3));
        t.statuses.insert(url(2), status(2, 3));
        t.statuses.insert(url(3), status(3, 3));
        match EtcdGate::with(t, &cfg).unwrap().check().await {
            Err(GateError::Refused(EtcdRefusal::Member { member, reason })) => {
                assert_eq!((member.id, reason.kind()), (4, "not-started"));
            }
            other => panic!("not refused for the fourth member: {other:?}"),
        }
    }
}
