//! Coordination across servers (docs/behaviour.md, "Coordination"): the Lease that
//! serialises steps, the peer gate, and the Node marking. The step runner calls only
//! [`Cluster`]. Only this module talks to the Kubernetes API.
//!
//! [`KubeCluster`] is the real one. It is lazy: it reads the kubeconfig and talks to
//! the API only when a step runs or `status` asks, so a calm `watch` makes no request.

pub mod boundary;
pub mod clock;
pub mod credential;
pub mod drain;
pub mod endpoints;
pub mod events;
pub mod lease;
pub mod node;
pub mod peers;
pub mod refusal;
pub mod rejected;
pub mod static_dns;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::actuator::NodeReadiness;
use crate::decide::{Direction, Step};
use crate::level::Level;
use crate::levels::LevelsConfig;
use crate::units::HumanDuration;
use endpoints::{EndpointSettings, Endpoints};
use lease::LeaseLock;
use node::NodeMarks;
use peers::PeerGate;
pub use refusal::{Refusal, RefusalKind};

/// `[cluster]`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Credentials for the API. Unset: `/etc/rancher/k3s/k3s.yaml`.
    pub kubeconfig: Option<PathBuf>,
    /// This server's Node name. Unset: the host name.
    pub node_name: Option<String>,
    /// The other servers' API endpoints (`https://host:6443`), tried in turn when the
    /// local API server is disabled or unreachable.
    pub api_servers: Vec<String>,
    pub lease_namespace: String,
    pub lease_name: String,
    pub lease_duration: HumanDuration,
    /// The label naming the level, on the Node from the first step down until `full`.
    pub level_label: String,
    /// The taint key regrade sets below `full`.
    pub taint_key: String,
    /// A peer whose node Lease is older than this is not Ready.
    pub peer_heartbeat_timeout: HumanDuration,
    /// The annotation recording which of cordon and taint regrade set.
    pub set_annotation: String,
    /// The name an API server's certificate is checked against when the call goes to
    /// an endpoint other than the kubeconfig's own (k3s puts `kubernetes` on every
    /// server's certificate). Empty: check against the endpoint's host.
    pub tls_server_name: String,
    /// How long one API request may take before the next endpoint is tried.
    pub request_timeout: HumanDuration,
    /// How far this server's clock may be off the API server's before steps are
    /// refused (`clock-skew`).
    pub max_clock_skew: HumanDuration,
    /// Where the API servers discovered from `default/kubernetes` are cached, for when
    /// the local one is disabled (`etcd-only`). Used only without `api_servers`.
    pub endpoints_cache: PathBuf,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            kubeconfig: None,
            node_name: None,
            api_servers: Vec::new(),
            lease_namespace: "kube-system".into(),
            lease_name: "regrade".into(),
            lease_duration: HumanDuration(Duration::from_secs(60)),
            level_label: "regrade.dev/level".into(),
            taint_key: "regrade.dev/stepped-down".into(),
            peer_heartbeat_timeout: HumanDuration(Duration::from_secs(40)),
            max_clock_skew: HumanDuration(Duration::from_secs(30)),
            set_annotation: "regrade.dev/set".into(),
            tls_server_name: "kubernetes".into(),
            request_timeout: HumanDuration(Duration::from_secs(10)),
            endpoints_cache: PathBuf::from("/var/lib/regrade/api-endpoints"),
        }
    }
}

impl ClusterConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.lease_duration.0 < Duration::from_secs(3) {
            anyhow::bail!("cluster.lease_duration must be at least 3s (it is renewed every third of it)");
        }
        for (key, d) in
            [("request_timeout", self.request_timeout), ("peer_heartbeat_timeout", self.peer_heartbeat_timeout)]
        {
            if d.0.is_zero() {
                anyhow::bail!("cluster.{key} must be more than 0");
            }
        }
        for (key, v) in [
            ("lease_namespace", &self.lease_namespace),
            ("lease_name", &self.lease_name),
            ("level_label", &self.level_label),
            ("taint_key", &self.taint_key),
            ("set_annotation", &self.set_annotation),
        ] {
            if v.is_empty() || v.contains(char::is_whitespace) {
                anyhow::bail!("cluster.{key} = {v:?} must be a non-empty name without spaces");
            }
        }
        for url in &self.api_servers {
            if !url.starts_with("https://") {
                anyhow::bail!("cluster.api_servers: {url:?} must be an https:// URL (e.g. https://10.0.0.2:6443)");
            }
        }
        Ok(())
    }
}

/// What happened to a step, for the Event on the Node.
#[derive(Clone, Debug)]
pub enum StepEvent<'a> {
    Done(&'a Step),
    Failed(&'a Step, &'a str),
    Refused(&'a Step, &'a Refusal),
    /// A drain's end: what it evicted, and what it left.
    Drained(&'a drain::DrainReport),
}

#[async_trait(?Send)]
pub trait Cluster: NodeReadiness {
    /// What would refuse `step` now (a held Lease, a peer), read without taking or
    /// changing anything: for `status`.
    async fn preflight(&self, step: &Step) -> Result<(), Refusal>;

    /// Takes the Lease and checks the peers, for `step`. On refusal nothing is held.
    async fn acquire(&self, step: &Step) -> Result<(), Refusal>;

    /// Renews the Lease on its own timer for as long as it is held (from `acquire` to
    /// `release`: the step polls it throughout), trying a failed renewal again
    /// within seconds. Returns only when the Lease is lost to another holder.
    async fn hold(&self) -> anyhow::Error;

    /// Until when the Lease is surely still ours, by this process's clock: the lease
    /// duration less a margin after the last renewal that landed. The step stops
    /// (rolled back) there, before another server could take the Lease over, and no
    /// restart is sent that could reach k3s after it. `None`: not surely ours at all
    /// (never taken, released, or lost): no restart.
    fn lease_safe_until(&self) -> Option<tokio::time::Instant> {
        None
    }

    /// Releases the Lease if still the holder.
    async fn release(&self);

    /// Puts the Node's marks for `level` in place: the level label and, below `full`,
    /// the cordon and taint (recording which of them regrade set); at `full`, removes
    /// exactly what regrade set.
    async fn mark_node(&self, level: Level, levels: &LevelsConfig) -> anyhow::Result<()>;

    /// The level this server's Node is labelled with (`None`: no label, i.e. `full`).
    /// `watch` compares it with the actuator's level once at start: after a reboot at
    /// `control-plane` (same flags as `full`, nothing on disk says so) only the Node
    /// remembers.
    async fn node_level(&self) -> anyhow::Result<Option<Level>> {
        Ok(None)
    }

    /// Closes any connection kept open for later calls (none are needed while calm).
    fn disconnect(&self) {}

    /// Records a Kubernetes Event on the Node. Failing to record is logged, not fatal.
    async fn record(&self, event: StepEvent<'_>);

    /// Drains the Node (`drain`): evicts its pods, bounded by `settings.timeout`,
    /// ended early by SIGTERM or SIGINT. Logs and publishes its progress; the step
    /// records its end as an Event ([`StepEvent::Drained`]) while it goes on. `None`:
    /// nothing to drain here (a dry run, a fake).
    async fn drain(&self, _level: Level, _settings: drain::DrainSettings) -> Option<drain::DrainReport> {
        None
    }
}

/// A gate that never refuses and marks nothing: for `--dry-run` and `simulate`.
pub struct AlwaysFree;

#[async_trait(?Send)]
impl NodeReadiness for AlwaysFree {
    async fn wait_ready_since(&self, _: SystemTime, _: Duration) -> anyhow::Result<()> {
        Ok(())
    }
}

#[async_trait(?Send)]
impl Cluster for AlwaysFree {
    async fn preflight(&self, _: &Step) -> Result<(), Refusal> {
        Ok(())
    }
    async fn acquire(&self, _: &Step) -> Result<(), Refusal> {
        Ok(())
    }
    async fn hold(&self) -> anyhow::Error {
        std::future::pending().await
    }
    /// A make-believe Lease, held for good: a dry run restarts nothing.
    fn lease_safe_until(&self) -> Option<tokio::time::Instant> {
        Some(tokio::time::Instant::now() + Duration::from_secs(86_400))
    }
    async fn release(&self) {}
    async fn mark_node(&self, level: Level, _: &LevelsConfig) -> anyhow::Result<()> {
        tracing::info!(level = %level, "dry run: would mark the Node");
        Ok(())
    }
    async fn record(&self, _: StepEvent<'_>) {}
}

/// The cluster client for `[cluster]`: the Kubernetes API through the configured
/// endpoints. Reads nothing and connects nowhere until first used. A drain's progress
/// is published at `drain_progress`, for `status`.
pub async fn connect(
    cfg: &ClusterConfig,
    levels: &LevelsConfig,
    drain_progress: PathBuf,
) -> anyhow::Result<Box<dyn Cluster>> {
    let mut c = KubeCluster::new(cfg, levels)?;
    c.drain_progress = Some(drain_progress);
    Ok(Box::new(c))
}

/// The Kubernetes API as [`Cluster`].
pub struct KubeCluster {
    pub endpoints: Endpoints,
    pub lease: LeaseLock,
    node_name: String,
    cfg: ClusterConfig,
    levels: LevelsConfig,
    /// Where the drain's progress is written for `status` (none: not published).
    pub drain_progress: Option<PathBuf>,
}

impl KubeCluster {
    pub fn new(c: &ClusterConfig, levels: &LevelsConfig) -> anyhow::Result<KubeCluster> {
        let node_name = match &c.node_name {
            Some(n) => n.clone(),
            None => hostname()?,
        };
        let endpoints = Endpoints::new(EndpointSettings {
            kubeconfig: c.kubeconfig.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_KUBECONFIG)),
            api_servers: c.api_servers.clone(),
            tls_server_name: (!c.tls_server_name.is_empty()).then(|| c.tls_server_name.clone()),
            request_timeout: c.request_timeout.0,
            cache: c.cache(),
            report_rejected: true,
        });
        // The process as well as the Node: a hand step and `watch` on one server are
        // two holders, and must not mistake each other's Lease for their own.
        let identity = format!("{node_name}/{}", std::process::id());
        let lease = LeaseLock::new(&c.lease_namespace, &c.lease_name, identity, c.lease_duration.0);
        Ok(KubeCluster { endpoints, lease, node_name, cfg: c.clone(), levels: levels.clone(), drain_progress: None })
    }

    fn marks(&self) -> NodeMarks<'_> {
        NodeMarks {
            node_name: &self.node_name,
            level_label: &self.cfg.level_label,
            taint_key: &self.cfg.taint_key,
            set_annotation: &self.cfg.set_annotation,
        }
    }

    /// The peer gate for `step`. Down: every other voter Ready and none stepped down.
    /// Up: restores function, so a stepped-down peer does not stop it; but a step that
    /// restarts k3s (and its etcd member) still needs every other voter Ready, or the
    /// restart could cost quorum.
    async fn check_peers(&self, step: &Step) -> Result<(), Refusal> {
        let skew = self.check_clock().await?;
        let gate = PeerGate {
            node_name: &self.node_name,
            level_label: &self.cfg.level_label,
            heartbeat_timeout: self.cfg.peer_heartbeat_timeout.0,
            server_now: skew.server_now(),
        };
        match step.direction {
            Direction::Down => gate.check_for_step_down(&self.endpoints).await,
            Direction::Up if self.levels.needs_restart(step.from, step.to) => {
                gate.check_voters_ready(&self.endpoints).await
            }
            Direction::Up => Ok(()),
        }
    }
}

impl KubeCluster {
    /// What this credential may and may not do as regrade of this Node (`check-access`).
    pub async fn boundary(&self) -> Result<boundary::Boundary, endpoints::CallError> {
        let needs = boundary::needs(
            &self.node_name,
            &self.cfg.lease_namespace,
            &self.cfg.lease_name,
            self.cfg.api_servers.is_empty(),
        );
        let deletes = [Level::ControlPlane, Level::EtcdOnly].into_iter().any(|l| {
            self.levels
                .get(l)
                .and_then(|c| c.drain_settings())
                .is_some_and(|d| d.on_timeout == drain::OnDrainTimeout::Delete)
        });
        // regrade's marks below full, from the Node as it is (none if it cannot be read,
        // or already carries them).
        let own_marks = match self.marks().get(&self.endpoints).await {
            Ok(node) => self.marks().patch_for(&node, Level::ControlPlane, &self.levels),
            Err(_) => None,
        };
        boundary::ask(&self.endpoints, &self.node_name, needs, deletes, own_marks).await
    }

    /// This server's clock against the API server's (its `Date` header on `/version`,
    /// which every authenticated client may read). Refuses when it is off by more
    /// than `cluster.max_clock_skew`.
    pub async fn check_clock(&self) -> Result<clock::Skew, Refusal> {
        let (date, ours) = self
            .endpoints
            .call("get /version", |c| async move {
                let request = http::Request::get("/version").body(Vec::new()).expect("a static request");
                let response = c.send(request.map(kube::client::Body::from)).await?;
                let date = response.headers().get(http::header::DATE).and_then(|d| d.to_str().ok()).map(String::from);
                Ok((date, clock::wall_now()))
            })
            .await
            .map_err(lease::unreachable)?;
        let subject = "clock".to_string();
        let Some(skew) = date.as_deref().and_then(|d| clock::Skew::from_date_header(d, ours)) else {
            return Err(Refusal {
                kind: RefusalKind::ClockSkew,
                subject,
                message: format!("the API server's answer had no readable Date header ({date:?}) to check this server's clock against"),
            });
        };
        let bound = self.cfg.max_clock_skew.0;
        if skew.magnitude() > bound {
            return Err(Refusal {
                kind: RefusalKind::ClockSkew,
                subject,
                message: format!(
                    "{skew} (more than cluster.max_clock_skew = {}s): fix the clock (NTP) first",
                    bound.as_secs()
                ),
            });
        }
        Ok(skew)
    }
}

pub const DEFAULT_KUBECONFIG: &str = "/etc/rancher/k3s/k3s.yaml";

impl ClusterConfig {
    /// `endpoints_cache`, unless turned off (empty).
    fn cache(&self) -> Option<PathBuf> {
        (!self.endpoints_cache.as_os_str().is_empty()).then(|| self.endpoints_cache.clone())
    }

    /// What `regrade credential` mints for this server: its Node's token, beside the
    /// configured `kubeconfig` (which must be set, and not the admin kubeconfig), through
    /// the endpoints `watch` uses. `lifetime`: `--lifetime`, else `credential.lifetime`.
    pub fn mint_settings(
        &self,
        credential: &credential::CredentialConfig,
        admin_kubeconfig: PathBuf,
        lifetime: Option<Duration>,
        force: bool,
    ) -> anyhow::Result<credential::MintSettings> {
        let kubeconfig = self.kubeconfig.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "cluster.kubeconfig is not set, so regrade would use the admin kubeconfig {DEFAULT_KUBECONFIG}: \
                 set it to where regrade credential may write regrade's own (e.g. /var/lib/regrade/kubeconfig)"
            )
        })?;
        if let Some(lifetime) = lifetime {
            credential::check_lifetime(lifetime, credential.renew_period.0, "--lifetime")?;
        }
        Ok(credential::MintSettings {
            admin_kubeconfig,
            api_servers: self.api_servers.clone(),
            tls_server_name: (!self.tls_server_name.is_empty()).then(|| self.tls_server_name.clone()),
            request_timeout: self.request_timeout.0,
            endpoints_cache: self.cache(),
            node: match &self.node_name {
                Some(n) => n.clone(),
                None => hostname()?,
            },
            kubeconfig,
            lifetime: lifetime.unwrap_or(credential.lifetime.0),
            renew_period: credential.renew_period.0,
            force,
        })
    }

    /// What `check-config` warns of: with no `api_servers` and no other server in the
    /// endpoints cache, this server knows only its own API server, which it disables at
    /// `etcd-only`: there neither `watch` nor `regrade credential` reach the cluster.
    pub fn warnings(&self) -> Vec<String> {
        if !self.api_servers.is_empty() {
            return Vec::new();
        }
        let cached = self.cache().map(|p| {
            let known = crate::fsutil::read_string_if_exists(&p).ok().flatten().is_some_and(|t| !t.trim().is_empty());
            (p, known)
        });
        let why = match cached {
            Some((_, true)) => return Vec::new(),
            Some((p, false)) => format!("the endpoints cache {} holds none yet", p.display()),
            None => "cluster.endpoints_cache is off".to_string(),
        };
        vec![format!(
            "cluster.api_servers is empty and {why}: this server knows only its own API server, which it disables at \
             etcd-only; there watch cannot step back up and regrade credential cannot renew the token until one is \
             known (list the other servers in cluster.api_servers, or let watch learn them while its own answers)"
        )]
    }
}

/// k3s names the Node after the host name, in lower case.
fn hostname() -> anyhow::Result<String> {
    let path = "/proc/sys/kernel/hostname";
    let h = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {path} for the Node name: {e}"))?;
    Ok(h.trim().to_lowercase())
}

#[async_trait(?Send)]
impl NodeReadiness for KubeCluster {
    async fn wait_ready_since(&self, since: SystemTime, timeout: Duration) -> anyhow::Result<()> {
        self.marks().wait_ready_since(&self.endpoints, since, timeout).await
    }
}

#[async_trait(?Send)]
impl Cluster for KubeCluster {
    fn disconnect(&self) {
        self.endpoints.disconnect();
    }

    async fn preflight(&self, step: &Step) -> Result<(), Refusal> {
        if step.direction == Direction::Down {
            self.endpoints.ask_others_first().await;
        }
        // Both read only: asked at once, since under pressure each answer is slow. The
        // Lease's refusal comes first when both refuse.
        let (lease, peers) = tokio::join!(self.lease.check(&self.endpoints), self.check_peers(step));
        lease?;
        peers
    }

    async fn acquire(&self, step: &Step) -> Result<(), Refusal> {
        self.lease.acquire(&self.endpoints).await?;
        // Peers are checked while holding the Lease: a peer that stepped down just
        // before has its label on by the time it released the Lease.
        if let Err(r) = self.check_peers(step).await {
            self.lease.release(&self.endpoints).await;
            return Err(r);
        }
        Ok(())
    }

    async fn hold(&self) -> anyhow::Error {
        self.lease.hold(&self.endpoints).await
    }

    fn lease_safe_until(&self) -> Option<tokio::time::Instant> {
        self.lease.safe_until()
    }

    async fn release(&self) {
        self.lease.release(&self.endpoints).await
    }

    async fn mark_node(&self, level: Level, levels: &LevelsConfig) -> anyhow::Result<()> {
        self.marks().apply(&self.endpoints, level, levels).await
    }

    async fn node_level(&self) -> anyhow::Result<Option<Level>> {
        let node = self.marks().get(&self.endpoints).await?;
        let label = &self.cfg.level_label;
        let Some(value) = node.metadata.labels.as_ref().and_then(|l| l.get(label)) else { return Ok(None) };
        value.parse::<Level>().map(Some).map_err(|_| {
            anyhow::anyhow!(
                "Node {}'s label {label}={value:?} names no level (expected control-plane or etcd-only; \
                 cluster.level_label)",
                self.node_name
            )
        })
    }

    async fn record(&self, event: StepEvent<'_>) {
        if let Err(e) = events::record(&self.endpoints, &self.node_name, &event).await {
            tracing::warn!(error = %format!("{e:#}"), node = %self.node_name, "could not record the Event on the Node");
        }
    }

    async fn drain(&self, level: Level, settings: drain::DrainSettings) -> Option<drain::DrainReport> {
        use tokio::signal::unix::{signal, SignalKind};
        // A signal ends the drain at the next request; the step then ends at the level
        // its marks already say (see step.rs). The handlers stay registered afterwards
        // (tokio cannot unregister them): `watch` has its own anyway.
        let stop = async {
            match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
                (Ok(mut t), Ok(mut i)) => {
                    tokio::select! {
                        _ = t.recv() => {}
                        _ = i.recv() => {}
                    }
                }
                _ => std::future::pending().await,
            }
        };
        let node = self.node_name.as_str();
        tracing::info!(node, level = %level, timeout = ?settings.timeout, "draining the Node");
        let started = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        // Dropped with the step (its deadline, its Lease), it publishes the drain as ended.
        let mut published =
            drain::DrainPublisher::start(self.drain_progress.clone(), node, &level.to_string(), started);
        let report = drain::drain(&self.endpoints, node, settings, stop, &mut |r| {
            tracing::info!(node, progress = %r, "drain");
            published.progress(r);
        })
        .await;
        published.finish(&report);
        if report.incomplete() {
            tracing::warn!(node, report = %report, "the drain left pods on the Node");
        }
        Some(report)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::endpoints::tests::{elsewhere, kubeconfig_at};
    use super::{drain, Cluster, KubeCluster};
    use crate::config::Config;
    use crate::level::Level;

    /// The step's deadline (or its Lease) drops the drain where it stands: here in its
    /// first request, to an API server that accepts the connection and never answers.
    /// `drain.json` must not go on saying `running` with this (live) process's PID,
    /// or `status` shows a drain under way for ever; it says it ended, and why.
    #[test]
    fn a_dropped_drain_is_published_as_not_running() {
        let dir = tempfile::tempdir().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let kubeconfig = kubeconfig_at(dir.path(), &format!("https://{}", listener.local_addr().unwrap()));
        let mut cfg = Config::default();
        cfg.cluster.kubeconfig = Some(kubeconfig);
        cfg.cluster.node_name = Some("server-1".into());
        cfg.cluster.endpoints_cache = Default::default();
        cfg.cluster.request_timeout = crate::units::HumanDuration(Duration::from_secs(600));
        let mut c = KubeCluster::new(&cfg.cluster, &cfg.levels).unwrap();
        let path = dir.path().join("drain.json");
        c.drain_progress = Some(path.clone());
        let settings = drain::DrainSettings { timeout: Duration::from_secs(600), on_timeout: Default::default() };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let cut = rt.block_on(async {
            let drain = c.drain(Level::ControlPlane, settings);
            tokio::time::timeout(Duration::from_millis(500), drain).await
        });
        assert!(cut.is_err(), "the drain ended by itself: {cut:?}");
        let published = drain::PublishedDrain::read(&path).expect("drain.json written");
        assert!(!published.running && !published.is_live(), "{published:?}");
        let why = published.report.error.clone().unwrap_or_default();
        assert!(why.contains("cut short"), "{published:?}");
        drop(listener);
    }

    /// A step down asks another server's API server before this host's own; a step up
    /// asks this host's first. Seen in the order a refusal names the endpoints it
    /// tried: here the kubeconfig's server accepts and never answers, and the other is
    /// a documentation address nothing answers at.
    #[test]
    fn a_step_down_tries_another_servers_api_server_first() {
        use crate::decide::{Direction, Step};
        let dir = tempfile::tempdir().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = format!("https://{}", listener.local_addr().unwrap());
        let kubeconfig = kubeconfig_at(dir.path(), &local);
        let [other, _] = elsewhere();
        let mut cfg = Config::default();
        cfg.cluster.kubeconfig = Some(kubeconfig);
        cfg.cluster.node_name = Some("server-1".into());
        cfg.cluster.endpoints_cache = Default::default();
        cfg.cluster.api_servers = vec![other.clone()];
        cfg.cluster.request_timeout = crate::units::HumanDuration(Duration::from_millis(300));
        let tried_first = |direction, from, to| {
            let c = KubeCluster::new(&cfg.cluster, &cfg.levels).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let refusal = rt.block_on(c.preflight(&Step { direction, from, to })).unwrap_err();
            let (at_local, at_other) = (refusal.message.find(&local), refusal.message.find(&other));
            assert!(at_local.is_some() && at_other.is_some(), "both tried: {refusal}");
            if at_other < at_local {
                other.clone()
            } else {
                local.clone()
            }
        };
        assert_eq!(tried_first(Direction::Down, Level::Full, Level::ControlPlane), other);
        assert_eq!(tried_first(Direction::Up, Level::ControlPlane, Level::Full), local);
        drop(listener);
    }

    /// check-config warns where this server knows no API server but its own: no
    /// cluster.api_servers, and no other in the endpoints cache (or no cache).
    #[test]
    fn check_config_warns_where_only_its_own_api_server_is_known() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Config::default().cluster;
        c.endpoints_cache = dir.path().join("api-endpoints");
        let w = c.warnings();
        assert!(w.len() == 1 && w[0].contains("holds none yet") && w[0].contains("cluster.api_servers"), "{w:?}");
        std::fs::write(&c.endpoints_cache, "https://10.0.0.2:6443\n").unwrap();
        assert!(c.warnings().is_empty());
        c.endpoints_cache = Default::default();
        assert!(c.warnings()[0].contains("cluster.endpoints_cache is off"));
        c.api_servers = vec!["https://10.0.0.2:6443".into()];
        assert!(c.warnings().is_empty());
    }

    fn err(text: &str) -> String {
        format!("{:#}", Config::parse(text).unwrap_err())
    }

    #[test]
    fn bad_cluster_settings_name_the_key() {
        assert!(err("[cluster]\nlease_duration = \"2s\"\n").contains("cluster.lease_duration"));
        assert!(err("[cluster]\nrequest_timeout = \"0s\"\n").contains("cluster.request_timeout"));
        assert!(err("[cluster]\nlevel_label = \"\"\n").contains("cluster.level_label"));
        assert!(err("[cluster]\napi_servers = [\"10.0.0.2:6443\"]\n").contains("cluster.api_servers"));
        let c =
            Config::parse("[cluster]\napi_servers = [\"https://10.0.0.2:6443\"]\ntls_server_name = \"\"\n").unwrap();
        assert_eq!(c.cluster.api_servers, ["https://10.0.0.2:6443"]);
    }
}
