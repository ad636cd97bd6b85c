//! The gate as the step runner sees it: asked before every restart of k3s (into or
//! out of `etcd-only`), and after it, while the Lease is still held.

use std::cell::OnceCell;

use async_trait::async_trait;

use super::client::AskEtcd;
pub use super::gate::Cleared;
use super::gate::{EtcdGate, GateError};
use super::judge::{EtcdRefusal, MemberRef, Reason};
use super::EtcdConfig;
use crate::cluster::{Refusal, RefusalKind};

/// One member as `status` shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberState {
    pub member: MemberRef,
    pub voter: bool,
    /// `this` member: the one the local endpoint answered as.
    pub this: bool,
    pub health: Result<(), Reason>,
}

#[async_trait(?Send)]
pub trait RestartGate {
    /// Before k3s is restarted: this member's ID (and whether it is down already), or
    /// why it may not go down now.
    async fn before_restart(&self) -> Result<Cleared, Refusal>;
    /// After the restart: Ok once member `me` is back in the list, healthy and caught
    /// up, or an error when it is not within the gate's timeout.
    async fn after_restart(&self, me: u64) -> anyhow::Result<()>;
    /// The members as etcd shows them now (for `status`).
    async fn members(&self) -> anyhow::Result<Vec<MemberState>>;
    /// Remembers the members while the local one answers, so that a look while it
    /// does not can ask the others ([`EtcdGate::learn_members`]). Default: nothing
    /// to remember.
    async fn learn_members(&self) -> anyhow::Result<()> {
        Ok(())
    }
    /// The step into `etcd-only` weighed against its cost once more, right before its
    /// restart (after its drain, which can take minutes): `Some` holds it at
    /// `control-plane`. Default: not weighed (a hand step is the operator's call);
    /// `watch` weighs (`crate::watch`'s `WeighingGate`).
    async fn held_by_cost(&self, _step: &crate::decide::Step) -> Option<Refusal> {
        None
    }
}

/// Lets every restart through: dry runs, and tests of other parts.
pub struct NoRestartGate;

#[async_trait(?Send)]
impl RestartGate for NoRestartGate {
    async fn before_restart(&self) -> Result<Cleared, Refusal> {
        Ok(Cleared { me: 0, this_down: false })
    }
    async fn after_restart(&self, _me: u64) -> anyhow::Result<()> {
        Ok(())
    }
    async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
        Ok(Vec::new())
    }
}

/// The real gate, built at its first use (a restart, or `watch` learning the members
/// while calm): a missing certificate refuses the restart (naming the file) and is
/// logged while learning, instead of failing the start.
pub struct LazyEtcdGate {
    cfg: EtcdConfig,
    gate: OnceCell<Result<EtcdGate, String>>,
}

impl LazyEtcdGate {
    pub fn new(cfg: &EtcdConfig) -> LazyEtcdGate {
        LazyEtcdGate { cfg: cfg.clone(), gate: OnceCell::new() }
    }

    fn gate(&self) -> Result<&EtcdGate, String> {
        // A failure is kept too: the files are not read again every sample. (A fixed
        // certificate is seen at the next start of regrade.)
        self.gate.get_or_init(|| EtcdGate::new(&self.cfg).map_err(|e| format!("{e:#}"))).as_ref().map_err(|e| e.clone())
    }
}

/// The refusal a step gets for what the gate said.
pub fn refusal(e: &GateError) -> Refusal {
    match e {
        GateError::Unavailable(err) => Refusal {
            kind: RefusalKind::EtcdUnavailable,
            subject: "etcd".into(),
            message: format!("etcd cannot be asked whether this member may restart: {err:#}"),
        },
        GateError::Refused(r) => {
            let kind = match r {
                EtcdRefusal::Member { .. } => RefusalKind::EtcdMemberUnhealthy,
                EtcdRefusal::TooFewVoters { .. } => RefusalKind::EtcdTooFewVoters,
                EtcdRefusal::NoQuorumWithout { .. } => RefusalKind::EtcdNoQuorum,
            };
            // The reason's own kind goes into the subject too, so a member going from
            // unreachable to behind is a new reason (and a new Event).
            let subject = match r {
                EtcdRefusal::Member { reason, .. } => format!("{}:{}", r.subject(), reason.kind()),
                _ => r.subject(),
            };
            Refusal { kind, subject, message: r.to_string() }
        }
    }
}

#[async_trait(?Send)]
impl<A: AskEtcd> RestartGate for EtcdGate<A> {
    async fn before_restart(&self) -> Result<Cleared, Refusal> {
        self.check().await.map_err(|e| refusal(&e))
    }

    async fn after_restart(&self, me: u64) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + self.catch_up_timeout();
        let budget = format!("etcd.catch_up_timeout = {}", crate::units::format_duration(self.catch_up_timeout()));
        self.wait_back(me, deadline, &budget).await.map(|_| ())
    }

    async fn learn_members(&self) -> anyhow::Result<()> {
        EtcdGate::learn_members(self).await
    }

    async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
        let view = self.look().await?.view;
        let me = view.self_id();
        Ok(view
            .list
            .members
            .iter()
            .map(|m| MemberState {
                member: MemberRef { id: m.id, name: m.name.clone(), node: super::judge::node_of(&m.name).to_string() },
                voter: !m.is_learner,
                this: m.id == me,
                health: view.health(m, self.max_raft_lag()),
            })
            .collect())
    }
}

#[async_trait(?Send)]
impl RestartGate for LazyEtcdGate {
    async fn before_restart(&self) -> Result<Cleared, Refusal> {
        let gate = self.gate().map_err(|e| refusal(&GateError::Unavailable(anyhow::anyhow!(e))))?;
        gate.before_restart().await
    }

    async fn after_restart(&self, me: u64) -> anyhow::Result<()> {
        self.gate().map_err(|e| anyhow::anyhow!(e))?.after_restart(me).await
    }

    async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
        self.gate().map_err(|e| anyhow::anyhow!(e))?.members().await
    }

    async fn learn_members(&self) -> anyhow::Result<()> {
        self.gate().map_err(|e| anyhow::anyhow!(e))?.learn_members().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_carry_the_member_in_subject_and_message() {
        let member = MemberRef { id: 3, name: "server3-1a2b3c4d".into(), node: "server3".into() };
        let r = refusal(&GateError::Refused(EtcdRefusal::Member { member, reason: Reason::Learner }));
        assert_eq!(r.kind, RefusalKind::EtcdMemberUnhealthy);
        assert_eq!(r.subject, "server3-1a2b3c4d:learner");
        assert_eq!(r.message, "etcd member server3-1a2b3c4d (Node server3): a learner, without a vote");
        let r = refusal(&GateError::Refused(EtcdRefusal::TooFewVoters { voters: vec!["a-00000000".into()] }));
        assert_eq!((r.kind, r.subject.as_str()), (RefusalKind::EtcdTooFewVoters, "a-00000000"));
        let r = refusal(&GateError::Unavailable(anyhow::anyhow!("connection refused")));
        assert_eq!(r.kind, RefusalKind::EtcdUnavailable);
        assert!(r.message.contains("connection refused"), "{}", r.message);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_missing_certificate_refuses_the_restart_naming_the_file() {
        let cfg = EtcdConfig { ca_file: "/nonexistent/etcd/server-ca.crt".into(), ..EtcdConfig::default() };
        let g = LazyEtcdGate::new(&cfg);
        let r = g.before_restart().await.unwrap_err();
        assert_eq!(r.kind, RefusalKind::EtcdUnavailable);
        assert!(r.message.contains("etcd.ca_file = /nonexistent/etcd/server-ca.crt"), "{}", r.message);
        assert!(g.after_restart(1).await.is_err());
    }
}
