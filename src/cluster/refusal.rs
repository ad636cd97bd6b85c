//! Why a step may not run now, as a value. A refused step changes no state
//! (docs/behaviour.md, "Decision rules" and "Coordination").

use std::fmt;

/// The machine-readable cause of a refusal. [`RefusalKind::as_str`] is what goes into
/// the journal, the state file (`refusal.kind`), `status --json` and the Node's Event:
/// those strings are a contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalKind {
    /// Another server (or a hand step) holds the Lease, or took it at the same moment.
    LeaseHeld,
    /// A peer etcd voter is not Ready: no fresh node Lease, Ready not True, or
    /// `EtcdIsVoter` False.
    PeerNotReady,
    /// A peer carries the level label: it is stepped down itself (steps down only).
    PeerSteppedDown,
    /// No API endpoint answered.
    ApiUnreachable,
    /// An API call answered with an error (RBAC, a server error), or the Node's marks
    /// could not be set before anything had changed.
    ApiError,
    /// This server's clock is too far off the API server's to judge peers' heartbeats.
    ClockSkew,
    /// A NixOS switch that turns regrade off holds steps until regrade.service stops
    /// (the hold file, `crate::hold`).
    SwitchHold,
    /// Before a restart of k3s: an etcd member (named in the subject) is not healthy —
    /// unreachable, not started, a learner, another cluster, no leader, an alarm, or
    /// too far behind the leader.
    EtcdMemberUnhealthy,
    /// Before a restart of k3s: fewer than 3 etcd voters, so any restart loses quorum.
    EtcdTooFewVoters,
    /// Before a restart of k3s: without this member the healthy voters are no quorum.
    EtcdNoQuorum,
    /// Before a restart of k3s: the local etcd member could not be asked (down, or its
    /// client certificate unreadable).
    EtcdUnavailable,
    /// The step into `etcd-only` weighed its cost and is held at `control-plane`: the
    /// drain freed nothing and the local member is already in distress
    /// (`decide::weigh_etcd_only`; the subject is the cause).
    EtcdOnlyHeld,
}

impl RefusalKind {
    pub const ALL: [RefusalKind; 12] = [
        RefusalKind::LeaseHeld,
        RefusalKind::PeerNotReady,
        RefusalKind::PeerSteppedDown,
        RefusalKind::ApiUnreachable,
        RefusalKind::ApiError,
        RefusalKind::ClockSkew,
        RefusalKind::SwitchHold,
        RefusalKind::EtcdMemberUnhealthy,
        RefusalKind::EtcdTooFewVoters,
        RefusalKind::EtcdNoQuorum,
        RefusalKind::EtcdUnavailable,
        RefusalKind::EtcdOnlyHeld,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalKind::LeaseHeld => "lease-held",
            RefusalKind::PeerNotReady => "peer-not-ready",
            RefusalKind::PeerSteppedDown => "peer-stepped-down",
            RefusalKind::ApiUnreachable => "api-unreachable",
            RefusalKind::ApiError => "api-error",
            RefusalKind::ClockSkew => "clock-skew",
            RefusalKind::SwitchHold => "switch-hold",
            RefusalKind::EtcdMemberUnhealthy => "etcd-member-unhealthy",
            RefusalKind::EtcdTooFewVoters => "etcd-too-few-voters",
            RefusalKind::EtcdNoQuorum => "etcd-no-quorum",
            RefusalKind::EtcdUnavailable => "etcd-unavailable",
            RefusalKind::EtcdOnlyHeld => "etcd-only-held",
        }
    }
}

impl fmt::Display for RefusalKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A kind equals its wire string, so a test or a reader of the state file can compare
/// with what it reads (`r.kind == "lease-held"`).
impl PartialEq<&str> for RefusalKind {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

/// Why a step may not run now. A refused step changes no state.
///
/// `(kind, subject)` identifies the reason: it stays the same from sample to sample
/// while the reason does, so a change of it is what gets an Event. `message` is for
/// reading and may change every sample (it carries ages and renew times).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub kind: RefusalKind,
    /// What the refusal is about, without volatile numbers: the peer's Node name,
    /// the Lease holder's identity, the endpoints that did not answer, the request
    /// and status that failed.
    pub subject: String,
    /// What an operator reads: names the holder, the peer, the endpoint.
    pub message: String,
}

impl Refusal {
    /// Whether `other` is the same reason (see the type's documentation).
    pub fn same_reason(&self, other: &Refusal) -> bool {
        self.kind == other.kind && self.subject == other.subject
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.kind)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_strings_are_distinct_and_kebab_case() {
        let names: std::collections::BTreeSet<_> = RefusalKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), RefusalKind::ALL.len());
        assert!(names.iter().all(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '-')));
        assert_eq!(RefusalKind::LeaseHeld, "lease-held");
        let r = Refusal { kind: RefusalKind::ApiError, subject: "x".into(), message: "boom".into() };
        assert_eq!(r.to_string(), "boom (api-error)");
    }
}
