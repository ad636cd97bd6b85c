//! The etcd members learned while calm: the restart into `etcd-only` comes under the
//! thrash, when the local member may not answer within `etcd.request_timeout`; the
//! gate then asks the other members at the URLs it remembered (`etcd.members_cache`).
//! A regrade that never restarted k3s had remembered none: a VM run's first step into
//! `etcd-only` was refused as `etcd-unavailable` for minutes (docs/incident-vm.md).

use std::time::Duration;

use tokio::time::Instant;

use crate::etcd::RestartGate;

/// How often a calm `watch` tries again while the members are not known.
const AGAIN_EVERY: Duration = Duration::from_secs(60);

/// Whether the members are known, and when to try again if not.
pub struct MemberLearning {
    /// `None`: known (or nothing to learn: a dry run).
    again_at: Option<Instant>,
    /// A failure was logged: the later ones, a minute apart, are not (after a success
    /// nothing is tried again).
    said_failure: bool,
}

impl MemberLearning {
    /// Nothing to learn: a dry run asks no etcd.
    pub fn never() -> MemberLearning {
        MemberLearning { again_at: None, said_failure: false }
    }

    /// To be learned at the first calm moment (the start is one).
    pub fn at_once() -> MemberLearning {
        MemberLearning { again_at: Some(Instant::now()), said_failure: false }
    }

    /// Completes when a look is due; never once the members are known.
    pub async fn looks_due(&self) {
        match self.again_at {
            Some(at) => tokio::time::sleep_until(at).await,
            None => std::future::pending().await,
        }
    }

    /// Learns the members if due (only call it while calm: it asks etcd).
    pub async fn try_now(&mut self, gate: &dyn RestartGate) {
        if self.again_at.is_none_or(|at| Instant::now() < at) {
            return;
        }
        match gate.learn_members().await {
            Ok(()) => {
                self.again_at = None;
                tracing::info!(
                    "the etcd members are known: a look while the local member does not answer asks the others"
                );
            }
            Err(e) => {
                self.again_at = Some(Instant::now() + AGAIN_EVERY);
                if !std::mem::replace(&mut self.said_failure, true) {
                    tracing::warn!(
                        error = %format!("{e:#}"),
                        "the etcd members are not known yet: trying again while calm; until then a restart into etcd-only needs the local member to answer"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::cell::{Cell, RefCell};
    use std::rc::Rc;

    use async_trait::async_trait;

    use super::*;
    use crate::cluster::Refusal;
    use crate::etcd::restart::{Cleared, MemberState};

    /// Counts the looks; answers with the next of `answers` (then Ok).
    #[derive(Default)]
    pub(crate) struct Learner {
        pub looks: Rc<Cell<usize>>,
        pub answers: RefCell<Vec<bool>>,
    }

    #[async_trait(?Send)]
    impl RestartGate for Learner {
        async fn before_restart(&self) -> Result<Cleared, Refusal> {
            unreachable!("no restart here")
        }
        async fn after_restart(&self, _me: u64) -> anyhow::Result<()> {
            unreachable!("no restart here")
        }
        async fn members(&self) -> anyhow::Result<Vec<MemberState>> {
            Ok(Vec::new())
        }
        async fn learn_members(&self) -> anyhow::Result<()> {
            self.looks.set(self.looks.get() + 1);
            let mut answers = self.answers.borrow_mut();
            match answers.is_empty() || answers.remove(0) {
                true => Ok(()),
                false => Err(anyhow::anyhow!("no answer within 3s")),
            }
        }
    }

    /// Due at once; a failure is tried again a minute later, not at every sample; once
    /// known, never again. A dry run never asks.
    #[test]
    fn members_are_learned_once_and_a_failure_is_tried_again_a_minute_later() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
        rt.block_on(async {
            let gate = Learner { answers: RefCell::new(vec![false]), ..Learner::default() };
            let mut m = MemberLearning::at_once();
            m.try_now(&gate).await;
            assert_eq!(gate.looks.get(), 1);
            tokio::time::sleep(Duration::from_secs(59)).await;
            m.try_now(&gate).await;
            assert_eq!(gate.looks.get(), 1, "not again within the minute");
            tokio::time::sleep(Duration::from_secs(1)).await;
            m.try_now(&gate).await;
            assert_eq!(gate.looks.get(), 2, "again after it");
            tokio::time::sleep(Duration::from_secs(600)).await;
            m.try_now(&gate).await;
            assert_eq!(gate.looks.get(), 2, "known: never asked again");
            let mut never = MemberLearning::never();
            never.try_now(&gate).await;
            assert_eq!(gate.looks.get(), 2);
        });
    }
}
