//! One look at the cluster through [`EtcdClient`], and the two questions the step
//! asks of it: may this member restart now, and is it back after the restart.

use std::time::Duration;

use anyhow::{anyhow, Context};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::client::{Endpoint, EtcdClient, MemberList};
use super::judge::{self, EtcdRefusal, View};
use super::EtcdConfig;

/// How often [`EtcdGate::wait_back`] looks again.
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// A look at etcd slower than this is logged with where its time went.
const SLOW_LOOK: Duration = Duration::from_millis(300);

/// How long one look's two rounds took: the member list (and where from), then the
/// statuses asked at once (the slowest: its member ID and time).
struct LookTimes {
    list: Duration,
    list_from: Endpoint,
    slowest_status: (u64, Duration),
}

/// Why the gate says no.
#[derive(Debug)]
pub enum GateError {
    /// The local member did not answer at any endpoint: etcd cannot be asked.
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

pub struct EtcdGate {
    client: EtcdClient,
    endpoints: Vec<Endpoint>,
    max_raft_lag: u64,
}

impl EtcdGate {
    /// Reads the certificates (an error names the missing or unreadable file).
    pub fn new(cfg: &EtcdConfig) -> anyhow::Result<EtcdGate> {
        let endpoints = cfg
            .endpoints
            .iter()
            .map(|e| Endpoint::parse(e).map_err(|err| anyhow!("etcd.endpoints: {err}")))
            .collect::<anyhow::Result<_>>()?;
        Ok(EtcdGate { client: EtcdClient::new(cfg)?, endpoints, max_raft_lag: cfg.max_raft_lag })
    }

    pub fn max_raft_lag(&self) -> u64 {
        self.max_raft_lag
    }

    /// The member list from the first endpoint that answers, and every member's status
    /// asked at its own client URL (this member's at the endpoint that answered), all
    /// at once, each bounded by the request timeout.
    pub async fn look(&self) -> anyhow::Result<View> {
        self.look_timed().await.map(|(view, _)| view)
    }

    /// [`Self::look`], and how long its two rounds took.
    async fn look_timed(&self) -> anyhow::Result<(View, LookTimes)> {
        let started = Instant::now();
        let mut errors = Vec::new();
        let mut found: Option<(Endpoint, MemberList)> = None;
        for ep in &self.endpoints {
            match self.client.member_list(ep).await {
                Ok(l) => {
                    found = Some((ep.clone(), l));
                    break;
                }
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
        let (local, list) =
            found.ok_or_else(|| anyhow!("the local etcd member did not answer: {}", errors.join("; ")))?;
        let list_took = started.elapsed();
        let me = list.header.member_id;
        let mut asks = JoinSet::new();
        let mut statuses = Vec::new();
        for m in &list.members {
            let urls: Vec<Endpoint> = if m.id == me {
                vec![local.clone()]
            } else {
                match m.client_urls.iter().map(|u| Endpoint::parse(u)).collect::<anyhow::Result<Vec<_>>>() {
                    Ok(u) => u,
                    Err(e) => {
                        statuses.push((m.id, Err(format!("{e:#}"))));
                        continue;
                    }
                }
            };
            let (client, id) = (self.client.clone(), m.id);
            asks.spawn(async move {
                let asked = Instant::now();
                let mut last = String::from("no client URL");
                for u in &urls {
                    match client.status(u).await {
                        Ok(s) => return (id, Ok(s), asked.elapsed()),
                        Err(e) => last = format!("{e:#}"),
                    }
                }
                (id, Err(last), asked.elapsed())
            });
        }
        let mut slowest = (0, Duration::ZERO);
        while let Some(r) = asks.join_next().await {
            let (id, status, took) = r.context("a status request panicked")?;
            if took >= slowest.1 {
                slowest = (id, took);
            }
            statuses.push((id, status));
        }
        let times = LookTimes { list: list_took, list_from: local, slowest_status: slowest };
        Ok((View { list, statuses }, times))
    }

    /// Before a restart: Ok(view) when this member may go down now. A slow look says
    /// in the journal which part was slow (under memory pressure, the local member).
    pub async fn check(&self) -> Result<View, GateError> {
        let (view, times) = self.look_timed().await.map_err(GateError::Unavailable)?;
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
        judge::may_restart(&view, self.max_raft_lag).map_err(GateError::Refused)?;
        Ok(view)
    }

    /// After a restart: waits until member `me` is back in the list, healthy and caught
    /// up, or `deadline` passes (the error gives the last reason).
    pub async fn wait_back(&self, me: u64, deadline: tokio::time::Instant, budget: &str) -> anyhow::Result<View> {
        loop {
            let last = match self.look().await {
                Ok(v) => match judge::is_back(&v, me, self.max_raft_lag) {
                    Ok(()) => return Ok(v),
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
