//! The pure judgement: what etcd said (the member list, each member's own status) → may this member go down for a restart, and is it back?
//!
//! Before a restart every member must be healthy — started, a voter, reachable at its
//! client URL, in the same cluster, seeing a leader, no alarm, its applied raft index
//! within `max_raft_lag` of the leader's — there must be at least 3 voters, and the
//! voters other than this member must be a quorum on their own. Why every member and
//! not just a quorum: a member that is down, partitioned or still a learner is already
//! a lost vote; restarting this one on top of it is how quorum is lost (k3s#2316).

use std::fmt;

use super::client::{Member, MemberList, Status};

/// What one look at the cluster gave.
#[derive(Clone, Debug)]
pub struct View {
    /// The member list: from the local member, or from another member when the local
    /// one does not answer.
    pub list: MemberList,
    /// Each member's status (by member ID), or why it could not be had.
    pub statuses: Vec<(u64, Result<Status, String>)>,
    /// This server's member: the one the local endpoint answers as (its header), or,
    /// when it does not answer, the one it answered as last time.
    pub me: u64,
}

/// A member as a refusal names it: its etcd name and the Node k3s runs it for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberRef {
    pub id: u64,
    /// etcd's member name, `<node>-<8 hex>` under k3s; empty for a member never started.
    pub name: String,
    pub node: String,
}

impl fmt::Display for MemberRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.name.is_empty() {
            write!(f, "etcd member {:x} (not started, no name yet)", self.id)
        } else {
            write!(f, "etcd member {} (Node {})", self.name, self.node)
        }
    }
}

/// Why one member is not healthy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Added to the cluster but never started (no name, no client URL).
    NotStarted,
    /// A learner: it has no vote yet.
    Learner,
    /// Its status could not be had at its client URL.
    Unreachable(String),
    /// It answers for another cluster.
    ClusterMismatch { ours: u64, theirs: u64 },
    /// It sees no leader.
    NoLeader,
    /// It reports alarms or errors (e.g. `NOSPACE`).
    Alarm(Vec<String>),
    /// Its applied raft index is too far behind the leader's.
    Behind { applied: u64, leader: u64, max_lag: u64 },
    /// Not in the member list at all (only for this member, after a restart).
    NotAMember,
}

impl Reason {
    /// A short stable name, for a refusal's kind and for `status`.
    pub fn kind(&self) -> &'static str {
        match self {
            Reason::NotStarted => "not-started",
            Reason::Learner => "learner",
            Reason::Unreachable(_) => "unreachable",
            Reason::ClusterMismatch { .. } => "cluster-id-mismatch",
            Reason::NoLeader => "no-leader",
            Reason::Alarm(_) => "alarm",
            Reason::Behind { .. } => "behind",
            Reason::NotAMember => "not-a-member",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::NotStarted => write!(f, "added but not started"),
            Reason::Learner => write!(f, "a learner, without a vote"),
            Reason::Unreachable(e) => write!(f, "unreachable: {e}"),
            Reason::ClusterMismatch { ours, theirs } => {
                write!(f, "answers for cluster {theirs:x}, not {ours:x}")
            }
            Reason::NoLeader => write!(f, "sees no leader"),
            Reason::Alarm(e) => write!(f, "reports {}", e.join(", ")),
            Reason::Behind { applied, leader, max_lag } => write!(
                f,
                "raft index {applied} is {} behind the leader's {leader} (at most {max_lag})",
                leader.saturating_sub(*applied)
            ),
            Reason::NotAMember => write!(f, "not in the member list"),
        }
    }
}

/// Why this member may not go down now (or is not back yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EtcdRefusal {
    Member {
        member: MemberRef,
        reason: Reason,
    },
    /// Fewer than 3 voters: any restart loses quorum while it runs (2 voters) or is
    /// the whole cluster (1).
    TooFewVoters {
        voters: Vec<String>,
    },
    /// The voters other than this member would not be a quorum of all voters.
    NoQuorumWithout {
        healthy: usize,
        voters: usize,
    },
}

impl EtcdRefusal {
    /// A stable `(kind, subject)`: the same while the reason stays the same.
    pub fn kind(&self) -> String {
        match self {
            EtcdRefusal::Member { reason, .. } => format!("etcd-member-{}", reason.kind()),
            EtcdRefusal::TooFewVoters { .. } => "etcd-too-few-voters".into(),
            EtcdRefusal::NoQuorumWithout { .. } => "etcd-no-quorum-without-this-member".into(),
        }
    }

    pub fn subject(&self) -> String {
        match self {
            EtcdRefusal::Member { member, .. } if member.name.is_empty() => format!("{:x}", member.id),
            EtcdRefusal::Member { member, .. } => member.name.clone(),
            EtcdRefusal::TooFewVoters { voters } => voters.join(","),
            EtcdRefusal::NoQuorumWithout { healthy, voters } => format!("{healthy}/{voters}"),
        }
    }

    /// The member a refusal names, if it names one.
    pub fn member(&self) -> Option<&MemberRef> {
        match self {
            EtcdRefusal::Member { member, .. } => Some(member),
            _ => None,
        }
    }
}

impl fmt::Display for EtcdRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EtcdRefusal::Member { member, reason } => write!(f, "{member}: {reason}"),
            EtcdRefusal::TooFewVoters { voters } => write!(
                f,
                "only {} etcd voter{} ({}): restarting any of them loses quorum while it runs; at least 3 are needed",
                voters.len(),
                if voters.len() == 1 { "" } else { "s" },
                voters.join(", ")
            ),
            EtcdRefusal::NoQuorumWithout { healthy, voters } => write!(
                f,
                "with this member down, {healthy} of {voters} etcd voters would be healthy; a quorum is {}",
                voters / 2 + 1
            ),
        }
    }
}

/// The Node k3s runs a member for: its name without the `-<8 hex>` k3s appends (a name
/// without that suffix is taken whole).
pub fn node_of(member_name: &str) -> &str {
    match member_name.rsplit_once('-') {
        Some((node, suffix))
            if !node.is_empty() && suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            node
        }
        _ => member_name,
    }
}

fn member_ref(m: &Member) -> MemberRef {
    MemberRef { id: m.id, name: m.name.clone(), node: node_of(&m.name).to_string() }
}

impl View {
    /// This server's member.
    pub fn self_id(&self) -> u64 {
        self.me
    }

    pub fn status(&self, id: u64) -> Option<&Result<Status, String>> {
        self.statuses.iter().find(|(i, _)| *i == id).map(|(_, s)| s)
    }

    /// The leader's raft index: from the leader's own status, as this member (or, failing
    /// that, any member) names the leader; else the highest index any member reports.
    fn leader_index(&self) -> Option<u64> {
        let ok = || self.statuses.iter().filter_map(|(_, s)| s.as_ref().ok());
        let leader = match self.status(self.self_id()) {
            Some(Ok(s)) if s.leader != 0 => s.leader,
            _ => ok().map(|s| s.leader).find(|&l| l != 0)?,
        };
        match self.status(leader) {
            Some(Ok(s)) => Some(s.raft_index),
            _ => ok().map(|s| s.raft_index).max(),
        }
    }

    /// Whether member `m` is healthy, and if not, why.
    pub fn health(&self, m: &Member, max_raft_lag: u64) -> Result<(), Reason> {
        if m.name.is_empty() || m.client_urls.is_empty() {
            return Err(Reason::NotStarted);
        }
        if m.is_learner {
            return Err(Reason::Learner);
        }
        let s = match self.status(m.id) {
            None => return Err(Reason::Unreachable("not asked".into())),
            Some(Err(e)) => return Err(Reason::Unreachable(e.clone())),
            Some(Ok(s)) => s,
        };
        if s.header.cluster_id != self.list.header.cluster_id {
            return Err(Reason::ClusterMismatch { ours: self.list.header.cluster_id, theirs: s.header.cluster_id });
        }
        if s.is_learner {
            return Err(Reason::Learner);
        }
        if s.leader == 0 {
            return Err(Reason::NoLeader);
        }
        if !s.errors.is_empty() {
            return Err(Reason::Alarm(s.errors.clone()));
        }
        let leader = self.leader_index().unwrap_or(s.raft_index);
        if s.raft_applied_index.saturating_add(max_raft_lag) < leader {
            return Err(Reason::Behind { applied: s.raft_applied_index, leader, max_lag: max_raft_lag });
        }
        Ok(())
    }

    /// Every member with its health, for `status`.
    pub fn members(&self, max_raft_lag: u64) -> Vec<(MemberRef, Result<(), Reason>)> {
        self.list.members.iter().map(|m| (member_ref(m), self.health(m, max_raft_lag))).collect()
    }
}

/// May this member (the view's self) go down for a restart now?
///
/// Every *other* member must be healthy (a refusal names the first that is not). This
/// member's own health is not asked: its going down is what is being judged, and a
/// struggling local etcd is a reason to shed load, not to keep it.
pub fn may_restart(view: &View, max_raft_lag: u64) -> Result<(), EtcdRefusal> {
    let me = view.self_id();
    for m in view.list.members.iter().filter(|m| m.id != me) {
        view.health(m, max_raft_lag).map_err(|reason| EtcdRefusal::Member { member: member_ref(m), reason })?;
    }
    let voters: Vec<&Member> = view.list.members.iter().filter(|m| !m.is_learner).collect();
    if voters.len() < 3 {
        return Err(EtcdRefusal::TooFewVoters {
            voters: voters
                .iter()
                .map(|m| if m.name.is_empty() { format!("{:x}", m.id) } else { m.name.clone() })
                .collect(),
        });
    }
    // Implied by the two rules above today; kept so that relaxing the first (say, to
    // tolerate one dead peer of five) can never let a restart lose quorum.
    let (healthy, voters) = healthy_voters_without(view, me, max_raft_lag);
    if healthy < voters / 2 + 1 {
        return Err(EtcdRefusal::NoQuorumWithout { healthy, voters });
    }
    Ok(())
}

/// (healthy voters other than `me`, all voters).
pub fn healthy_voters_without(view: &View, me: u64, max_raft_lag: u64) -> (usize, usize) {
    let voters: Vec<&Member> = view.list.members.iter().filter(|m| !m.is_learner).collect();
    let healthy = voters.iter().filter(|m| m.id != me && view.health(m, max_raft_lag).is_ok()).count();
    (healthy, voters.len())
}

/// After a restart: is member `me` back in the list, healthy and caught up?
pub fn is_back(view: &View, me: u64, max_raft_lag: u64) -> Result<(), EtcdRefusal> {
    let Some(m) = view.list.members.iter().find(|m| m.id == me) else {
        let member = MemberRef { id: me, name: String::new(), node: String::new() };
        return Err(EtcdRefusal::Member { member, reason: Reason::NotAMember });
    };
    view.health(m, max_raft_lag).map_err(|reason| EtcdRefusal::Member { member: member_ref(m), reason })
}

#[cfg(test)]
mod tests {
    use super::super::client::Header;
    use super::*;

    const CLUSTER: u64 = 0xc1;

    fn member(id: u64, name: &str) -> Member {
        Member {
            id,
            name: name.into(),
            peer_urls: vec![format!("https://10.0.0.{id}:2380")],
            client_urls: vec![format!("https://10.0.0.{id}:2379")],
            is_learner: false,
        }
    }

    fn status(id: u64, leader: u64, index: u64) -> Status {
        Status {
            header: Header { cluster_id: CLUSTER, member_id: id },
            version: "3.6.0".into(),
            leader,
            raft_index: index,
            raft_applied_index: index,
            raft_term: 2,
            is_learner: false,
            errors: vec![],
        }
    }

    /// Three healthy voters, server1 (id 1) asking, server2 (id 2) the leader.
    fn healthy() -> View {
        View {
            list: MemberList {
                header: Header { cluster_id: CLUSTER, member_id: 1 },
                members: vec![
                    member(1, "server1-0a1b2c3d"),
                    member(2, "server2-1a2b3c4d"),
                    member(3, "server3-deadbeef"),
                ],
            },
            statuses: vec![(1, Ok(status(1, 2, 500))), (2, Ok(status(2, 2, 502))), (3, Ok(status(3, 2, 501)))],
            me: 1,
        }
    }

    fn set(v: &mut View, id: u64, s: Result<Status, String>) {
        v.statuses.iter_mut().find(|(i, _)| *i == id).unwrap().1 = s;
    }

    fn st(v: &mut View, id: u64) -> &mut Status {
        v.statuses.iter_mut().find(|(i, _)| *i == id).unwrap().1.as_mut().unwrap()
    }

    fn refused_member(v: &View) -> (String, String, &'static str) {
        match may_restart(v, 100).unwrap_err() {
            EtcdRefusal::Member { member, reason } => (member.name, member.node, reason.kind()),
            other => panic!("refused, but not naming a member: {other}"),
        }
    }

    #[test]
    fn node_names_drop_k3s_suffix() {
        assert_eq!(node_of("server3-1a2b3c4d"), "server3");
        assert_eq!(node_of("k3s-node-1-DEADBEEF"), "k3s-node-1");
        assert_eq!(node_of("server3"), "server3");
        assert_eq!(node_of("server3-1a2b3c4"), "server3-1a2b3c4");
        assert_eq!(node_of("node-abcdefgh"), "node-abcdefgh");
        assert_eq!(node_of("-1a2b3c4d"), "-1a2b3c4d");
    }

    #[test]
    fn three_healthy_voters_may_restart() {
        may_restart(&healthy(), 100).unwrap();
        is_back(&healthy(), 1, 100).unwrap();
    }

    /// Each fault, the member it must name and the reason.
    #[test]
    fn each_unhealthy_peer_is_named_with_its_reason() {
        type Fault = fn(&mut View);
        let table: &[(&str, Fault, &str, &str, &str)] = &[
            (
                "unreachable",
                |v| set(v, 3, Err("connecting: connection refused".into())),
                "server3-deadbeef",
                "server3",
                "unreachable",
            ),
            (
                "not started",
                |v| v.list.members[2] = Member { name: String::new(), client_urls: vec![], ..member(3, "") },
                "",
                "",
                "not-started",
            ),
            ("learner (list)", |v| v.list.members[1].is_learner = true, "server2-1a2b3c4d", "server2", "learner"),
            ("learner (status)", |v| st(v, 3).is_learner = true, "server3-deadbeef", "server3", "learner"),
            (
                "other cluster",
                |v| st(v, 2).header.cluster_id = 0xbad,
                "server2-1a2b3c4d",
                "server2",
                "cluster-id-mismatch",
            ),
            ("no leader", |v| st(v, 3).leader = 0, "server3-deadbeef", "server3", "no-leader"),
            ("alarm", |v| st(v, 2).errors = vec!["NOSPACE".into()], "server2-1a2b3c4d", "server2", "alarm"),
            ("behind", |v| st(v, 3).raft_applied_index = 300, "server3-deadbeef", "server3", "behind"),
        ];
        for (what, fault, name, node, kind) in table {
            let mut v = healthy();
            fault(&mut v);
            assert_eq!(refused_member(&v), (name.to_string(), node.to_string(), *kind), "{what}");
        }
    }

    #[test]
    fn behind_is_measured_against_the_leaders_index() {
        let mut v = healthy();
        // 100 behind the leader (502) is allowed, 101 is not.
        st(&mut v, 3).raft_applied_index = 402;
        may_restart(&v, 100).unwrap();
        st(&mut v, 3).raft_applied_index = 401;
        let e = may_restart(&v, 100).unwrap_err();
        assert_eq!(
            e.to_string(),
            "etcd member server3-deadbeef (Node server3): raft index 401 is 101 behind the leader's 502 (at most 100)"
        );
        // The leader's index counts even when a non-leader reports more (say, a stale view).
        let mut v = healthy();
        st(&mut v, 1).raft_index = 5000;
        st(&mut v, 1).raft_applied_index = 5000;
        may_restart(&v, 100).unwrap();
    }

    #[test]
    fn this_members_own_health_is_not_asked_before_a_restart() {
        let mut v = healthy();
        st(&mut v, 1).leader = 0;
        st(&mut v, 1).raft_applied_index = 1;
        may_restart(&v, 100).unwrap();
        set(&mut v, 1, Err("slow".into()));
        may_restart(&v, 100).unwrap();
    }

    #[test]
    fn quorum_counts_healthy_voters_other_than_this_one() {
        let mut v = healthy();
        assert_eq!(healthy_voters_without(&v, 1, 100), (2, 3));
        set(&mut v, 3, Err("down".into()));
        assert_eq!(healthy_voters_without(&v, 1, 100), (1, 3));
        v.list.members[1].is_learner = true;
        assert_eq!(healthy_voters_without(&v, 1, 100), (0, 2));
    }

    #[test]
    fn fewer_than_three_voters_are_refused() {
        let mut v = healthy();
        v.list.members.pop();
        v.statuses.pop();
        let e = may_restart(&v, 100).unwrap_err();
        assert_eq!(e, EtcdRefusal::TooFewVoters { voters: vec!["server1-0a1b2c3d".into(), "server2-1a2b3c4d".into()] });
        assert!(e.to_string().starts_with("only 2 etcd voters (server1-0a1b2c3d, server2-1a2b3c4d)"), "{e}");
        assert_eq!(
            (e.kind().as_str(), e.subject().as_str()),
            ("etcd-too-few-voters", "server1-0a1b2c3d,server2-1a2b3c4d")
        );
        v.list.members.pop();
        assert!(matches!(may_restart(&v, 100), Err(EtcdRefusal::TooFewVoters { voters }) if voters.len() == 1));
    }

    #[test]
    fn five_voters_with_one_down_still_refuse_naming_it() {
        let mut v = healthy();
        for id in [4, 5] {
            v.list.members.push(member(id, &format!("server{id}-0000000{id}")));
            v.statuses.push((id, Ok(status(id, 2, 500))));
        }
        may_restart(&v, 100).unwrap();
        set(&mut v, 5, Err("timeout".into()));
        assert_eq!(refused_member(&v).1, "server5");
    }

    #[test]
    fn after_a_restart_this_member_must_be_listed_healthy_and_caught_up() {
        let mut v = healthy();
        st(&mut v, 1).raft_applied_index = 10;
        let e = is_back(&v, 1, 100).unwrap_err();
        assert!(
            matches!(&e, EtcdRefusal::Member { reason: Reason::Behind { .. }, member } if member.node == "server1"),
            "{e}"
        );
        st(&mut v, 1).raft_applied_index = 499;
        is_back(&v, 1, 100).unwrap();
        // A peer's trouble is not this member's: is_back judges only this member.
        set(&mut v, 3, Err("down".into()));
        is_back(&v, 1, 100).unwrap();
        set(&mut v, 1, Err("connection refused".into()));
        assert!(matches!(is_back(&v, 1, 100), Err(EtcdRefusal::Member { reason: Reason::Unreachable(_), .. })));
        let e = is_back(&healthy(), 9, 100).unwrap_err();
        assert!(matches!(e, EtcdRefusal::Member { reason: Reason::NotAMember, .. }), "{e}");
    }

    #[test]
    fn refusals_read_well_and_have_stable_kinds() {
        let mut v = healthy();
        set(&mut v, 3, Err("https://10.0.0.3:2379: connecting: connection refused".into()));
        let e = may_restart(&v, 100).unwrap_err();
        assert_eq!(
            e.to_string(),
            "etcd member server3-deadbeef (Node server3): unreachable: https://10.0.0.3:2379: connecting: connection refused"
        );
        assert_eq!((e.kind().as_str(), e.subject().as_str()), ("etcd-member-unreachable", "server3-deadbeef"));
        assert_eq!(e.member().unwrap().node, "server3");
        let q = EtcdRefusal::NoQuorumWithout { healthy: 2, voters: 5 };
        assert_eq!(q.to_string(), "with this member down, 2 of 5 etcd voters would be healthy; a quorum is 3");
    }
}
