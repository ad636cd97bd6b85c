//! Where API calls go (docs/behaviour.md, "Coordination"). A server at `etcd-only` has no API server of its own:
//! its port 6443 answers 503 "apiserver disabled". So every call is tried against a
//! list of endpoints in turn — the kubeconfig's own server first, then the configured
//! `cluster.api_servers`, or, when none are configured, the API servers discovered
//! from the `default/kubernetes` EndpointSlice while the local one worked (cached in a
//! file, so a process started at `etcd-only` still knows them).
//!
//! Lazy by design: nothing is read or connected until the first call, so an idle
//! `watch` makes no API request at all.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::Status;

/// A failed call: what was asked, where, and why.
#[derive(Debug)]
pub enum CallError {
    /// No endpoint answered: each one tried and why it was passed over.
    Unreachable { what: String, tried: Vec<(String, String)> },
    /// An endpoint answered with an error status (403, 404, 409, ...).
    Status { what: String, endpoint: String, status: Box<Status> },
    /// The credentials could not be loaded, or an answer could not be read.
    Other { what: String, error: String },
}

impl CallError {
    pub fn code(&self) -> Option<u16> {
        match self {
            CallError::Status { status, .. } => Some(status.code),
            _ => None,
        }
    }
    pub fn is_conflict(&self) -> bool {
        self.code() == Some(409)
    }
    pub fn is_unreachable(&self) -> bool {
        matches!(self, CallError::Unreachable { .. })
    }

    /// What failed, without what changes from one attempt to the next (the order the
    /// endpoints were tried in, how long one took): the endpoints that did not
    /// answer, in name order; the request, endpoint and status code; the request.
    pub fn subject(&self) -> String {
        match self {
            CallError::Unreachable { tried, .. } => {
                let mut eps: Vec<&str> = tried.iter().map(|(ep, _)| ep.as_str()).collect();
                eps.sort_unstable();
                eps.dedup();
                eps.join(" ")
            }
            CallError::Status { what, endpoint, status } => format!("{what} at {endpoint}: {}", status.code),
            CallError::Other { what, .. } => what.clone(),
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Unreachable { what, tried } => {
                write!(f, "{what}: no Kubernetes API server answered (")?;
                for (i, (ep, why)) in tried.iter().enumerate() {
                    write!(f, "{}{ep}: {why}", if i > 0 { "; " } else { "" })?;
                }
                write!(f, ")")
            }
            CallError::Status { what, endpoint, status } => {
                write!(f, "{what} at {endpoint}: {} {} ({})", status.code, status.reason, status.message)
            }
            CallError::Other { what, error } => write!(f, "{what}: {error}"),
        }
    }
}

impl std::error::Error for CallError {}

/// The settings of [`Endpoints`], from `[cluster]`.
#[derive(Clone, Debug)]
pub struct EndpointSettings {
    pub kubeconfig: PathBuf,
    pub api_servers: Vec<String>,
    /// The name a swapped-in endpoint's serving certificate is checked against.
    pub tls_server_name: Option<String>,
    pub request_timeout: Duration,
    pub cache: Option<PathBuf>,
    /// Say the first 401 of a run of them, and write it down ([`super::rejected`]).
    pub report_rejected: bool,
}

struct Endpoint {
    url: String,
    /// Built on first use.
    client: Option<kube::Client>,
}

struct Loaded {
    base: kube::Config,
    /// The kubeconfig's own server's URL, as written there.
    local: String,
    endpoints: Vec<Endpoint>,
    /// The kubeconfig's `tokenFile`, and the file the clients were built with.
    token_file: Option<(PathBuf, Option<FileStamp>)>,
}

/// Which file a path names, and which version of it: a token replaced by a rename (or
/// rewritten) has another one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileStamp {
    fn of(path: &std::path::Path) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).ok()?;
        let mtime_ns = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
        Some(FileStamp { dev: m.dev(), ino: m.ino(), len: m.len(), mtime_ns })
    }
}

/// The API endpoints, tried in turn, starting from the last one that answered.
pub struct Endpoints {
    settings: EndpointSettings,
    loaded: RefCell<Option<Loaded>>,
    preferred: Cell<usize>,
    discovered: Cell<bool>,
    /// The last answer was a 401: the credential is rejected.
    rejected: Cell<bool>,
}

impl Endpoints {
    pub fn new(settings: EndpointSettings) -> Endpoints {
        Endpoints {
            settings,
            loaded: RefCell::new(None),
            preferred: Cell::new(0),
            discovered: Cell::new(false),
            rejected: Cell::new(false),
        }
    }

    /// The endpoints in the order they are tried from now (for logs and tests).
    pub async fn urls(&self) -> Result<Vec<String>, CallError> {
        self.load("reading the kubeconfig").await?;
        let loaded = self.loaded.borrow();
        Ok(loaded.as_ref().map(|l| l.endpoints.iter().map(|e| e.url.clone()).collect()).unwrap_or_default())
    }

    /// Runs `f` against each endpoint in turn until one answers. A 503 (k3s's
    /// "apiserver disabled"), a refused connection, a TLS failure or a timeout moves
    /// on to the next; any other answer, success or error, is the answer.
    pub async fn call<T, F, Fut>(&self, what: impl Into<String>, f: F) -> Result<T, CallError>
    where
        F: Fn(kube::Client) -> Fut,
        Fut: Future<Output = Result<T, kube::Error>>,
    {
        let what = what.into();
        self.load(&what).await?;
        self.follow_the_token_file();
        let n = self.loaded.borrow().as_ref().map_or(0, |l| l.endpoints.len());
        let mut tried = Vec::new();
        for k in 0..n {
            let i = (self.preferred.get() + k) % n;
            let (url, client) = match self.client(i) {
                Ok(c) => c,
                Err(why) => {
                    tried.push((self.url(i), why));
                    continue;
                }
            };
            let outcome = tokio::time::timeout(self.settings.request_timeout, f(client.clone())).await;
            let why = match outcome {
                Ok(Ok(v)) => {
                    self.preferred.set(i);
                    self.credential_answered(None);
                    self.maybe_discover(i, &client).await;
                    return Ok(v);
                }
                Ok(Err(kube::Error::Api(s))) if s.code == 503 => format!("503 {}", s.message),
                Ok(Err(kube::Error::Api(status))) => {
                    let e = CallError::Status { what, endpoint: url, status };
                    self.credential_answered(Some(&e));
                    return Err(e);
                }
                Ok(Err(e @ (kube::Error::HyperError(_) | kube::Error::Service(_)))) => error_chain(&e),
                Ok(Err(e)) => {
                    return Err(CallError::Other { what: format!("{what} at {url}"), error: error_chain(&e) })
                }
                Err(_) => format!("no answer within {:?}", self.settings.request_timeout),
            };
            let why = super::static_dns::explain_lookup_failure(&url, why, super::static_dns::STATIC_BUILD);
            tracing::debug!(endpoint = %url, why = %why, request = %what, "API endpoint passed over");
            tried.push((url, why));
        }
        Err(CallError::Unreachable { what, tried })
    }

    /// From now on, every call is tried first at another server's API server: the
    /// first endpoint that is neither the kubeconfig's own server nor at an address of
    /// this host. For a step down: this server is under memory pressure, and its own
    /// API server is the slowest to answer (under a thrash it can hang each call for
    /// the whole `request_timeout`). Nothing changes while the calls already go
    /// elsewhere, or when no other endpoint is known. A failure moves on in turn as
    /// ever, to this server's own API server too.
    pub async fn ask_others_first(&self) {
        if self.load("choosing an API server").await.is_err() {
            return; // the call itself will say why
        }
        let guard = self.loaded.borrow();
        let Some(l) = guard.as_ref() else { return };
        if !on_this_host(&l.endpoints[self.preferred.get()].url, &l.local) {
            return;
        }
        if let Some(i) = l.endpoints.iter().position(|e| !on_this_host(&e.url, &l.local)) {
            tracing::debug!(endpoint = %l.endpoints[i].url, "stepping down: asking another server's API server first");
            self.preferred.set(i);
        }
    }

    /// An API server answered (`Some`: with an error status). The first 401 after an
    /// accepted call is reported, and the first accepted call after a 401: for a
    /// kubeconfig naming a token file, which `regrade credential` renews (an admin
    /// kubeconfig's 401 is no note's to write beside k3s's file).
    fn credential_answered(&self, error: Option<&CallError>) {
        let renewed = self.loaded.borrow().as_ref().is_some_and(|l| l.token_file.is_some());
        if !self.settings.report_rejected || !renewed {
            return;
        }
        let rejected = error.is_some_and(|e| e.code() == Some(401));
        if rejected == self.rejected.replace(rejected) {
            return;
        }
        match error {
            Some(e) if rejected => super::rejected::report(&self.settings.kubeconfig, e),
            _ => super::rejected::accepted_again(&self.settings.kubeconfig),
        }
    }

    fn url(&self, i: usize) -> String {
        self.loaded.borrow().as_ref().map(|l| l.endpoints[i].url.clone()).unwrap_or_default()
    }

    /// Drops every client and so its pooled connections: a calm `watch` holds no
    /// connection to any API server between steps.
    pub fn disconnect(&self) {
        if let Some(loaded) = self.loaded.borrow_mut().as_mut() {
            for ep in &mut loaded.endpoints {
                ep.client = None;
            }
        }
    }

    /// A token file renewed since the clients were built (`regrade credential`) is used
    /// from this call on: the clients, which each read it once when built (and kube's own
    /// once a minute after), are built again. One `stat` per call.
    fn follow_the_token_file(&self) {
        let mut guard = self.loaded.borrow_mut();
        let Some(loaded) = guard.as_mut() else { return };
        let Some((path, seen)) = loaded.token_file.as_mut() else { return };
        let now = FileStamp::of(path);
        if now == *seen {
            return;
        }
        tracing::debug!(token_file = %path.display(), "the token file changed; new clients read it");
        *seen = now;
        for ep in &mut loaded.endpoints {
            ep.client = None;
        }
    }

    /// The client for endpoint `i`, built on first use.
    fn client(&self, i: usize) -> Result<(String, kube::Client), String> {
        let mut guard = self.loaded.borrow_mut();
        let loaded = guard.as_mut().expect("loaded before use");
        let ep = &loaded.endpoints[i];
        if let Some(c) = &ep.client {
            return Ok((ep.url.clone(), c.clone()));
        }
        let mut config = loaded.base.clone();
        config.cluster_url = ep.url.parse().map_err(|e| format!("not a URL: {e}"))?;
        if ep.url != loaded.local && config.tls_server_name.is_none() {
            // The kubeconfig's CA signs every server's certificate, but a swapped-in
            // address need not be among its names; k3s puts `kubernetes` on all of them.
            config.tls_server_name = self.settings.tls_server_name.clone();
        }
        // kube retries 429, 503 and 504 itself by default (up to 15 times). Here a 503
        // is k3s's "apiserver disabled", which must move on to the next endpoint at
        // once, and a 429 on an eviction is a PodDisruptionBudget's answer, which the
        // drain must see (it retries with its own backoff and names the budget).
        config.default_retry = false;
        config.connect_timeout = Some(self.settings.request_timeout);
        config.read_timeout = Some(self.settings.request_timeout);
        let client = kube::Client::try_from(config).map_err(|e| error_chain(&e))?;
        let url = ep.url.clone();
        loaded.endpoints[i].client = Some(client.clone());
        Ok((url, client))
    }

    /// Reads the kubeconfig and builds the endpoint list, once.
    async fn load(&self, what: &str) -> Result<(), CallError> {
        if self.loaded.borrow().is_some() {
            return Ok(());
        }
        let path = &self.settings.kubeconfig;
        let other = |e: String| CallError::Other { what: what.to_string(), error: e };
        let kc = Kubeconfig::read_from(path).map_err(|e| other(format!("kubeconfig {}: {}", path.display(), e)))?;
        let base = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| other(format!("kubeconfig {}: {}", path.display(), error_chain(&e))))?;
        let local = base.cluster_url.to_string().trim_end_matches('/').to_string();
        let token_file = base.auth_info.token_file.as_ref().map(|f| {
            let f = PathBuf::from(f);
            let stamp = FileStamp::of(&f);
            (f, stamp)
        });
        let mut urls = vec![local.clone()];
        let extra =
            if self.settings.api_servers.is_empty() { self.read_cache() } else { self.settings.api_servers.clone() };
        for u in extra {
            let u = u.trim_end_matches('/').to_string();
            if !urls.contains(&u) {
                urls.push(u);
            }
        }
        let endpoints = urls.into_iter().map(|url| Endpoint { url, client: None }).collect();
        *self.loaded.borrow_mut() = Some(Loaded { base, local, endpoints, token_file });
        Ok(())
    }

    fn read_cache(&self) -> Vec<String> {
        let Some(path) = &self.settings.cache else { return Vec::new() };
        match crate::fsutil::read_string_if_exists(path) {
            Ok(Some(s)) => s.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect(),
            Ok(None) => Vec::new(),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "could not read the cached API endpoints");
                Vec::new()
            }
        }
    }

    /// While the kubeconfig's own server answers and no endpoints are configured:
    /// learn the API servers from the `default/kubernetes` EndpointSlice, add them to
    /// the list and cache them. Done once per process, but only once it found some:
    /// a failed read, or a slice not (yet) there or empty (the API server just
    /// started), is tried again after the next call the local server answers.
    async fn maybe_discover(&self, answered: usize, client: &kube::Client) {
        let is_local = self.loaded.borrow().as_ref().is_some_and(|l| l.endpoints[answered].url == l.local);
        if !is_local || !self.settings.api_servers.is_empty() || self.discovered.get() {
            return;
        }
        let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
        let slice = match tokio::time::timeout(self.settings.request_timeout, api.get_opt("kubernetes")).await {
            Ok(Ok(Some(s))) => s,
            Ok(Ok(None)) => return,
            Ok(Err(e)) => {
                tracing::warn!(error = %error_chain(&e), "could not read the default/kubernetes EndpointSlice to learn the other API servers; will try again");
                return;
            }
            Err(_) => return,
        };
        let found = urls_of(&slice);
        if found.is_empty() {
            return;
        }
        self.discovered.set(true);
        if let Some(l) = self.loaded.borrow_mut().as_mut() {
            for url in &found {
                if !l.endpoints.iter().any(|e| &e.url == url) {
                    l.endpoints.push(Endpoint { url: url.clone(), client: None });
                }
            }
        }
        if let Some(path) = &self.settings.cache {
            if let Err(e) =
                crate::fsutil::write_atomic(path, (found.join("\n") + "\n").as_bytes(), 0o644, "endpoints-cache")
            {
                tracing::warn!(path = %path.display(), error = %e, "could not cache the API endpoints");
            }
        }
    }
}

/// Whether `url` reaches this host's own API server: the kubeconfig's server
/// (`local`), or an IP address of this host (a loopback address, or one a socket can be
/// bound to here: a discovered endpoint is this server's too). A name is taken for
/// another host.
fn on_this_host(url: &str, local: &str) -> bool {
    if url == local {
        return true;
    }
    let Ok(uri) = url.parse::<http::Uri>() else { return false };
    let Some(host) = uri.host() else { return false };
    let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() else {
        return false;
    };
    ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

/// `https://addr:port` for each ready address in an EndpointSlice. Only IP addresses
/// of the slice's own family are taken: the slice is data from the cluster, and a
/// string that is no address must not turn into some other URL.
pub fn urls_of(slice: &EndpointSlice) -> Vec<String> {
    let port = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref().is_none_or(|n| n == "https"))
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p != 0)
        .unwrap_or(6443);
    let v6 = slice.address_type == "IPv6";
    slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .flat_map(|e| e.addresses.iter())
        .filter_map(|a| match a.parse::<std::net::IpAddr>() {
            Ok(std::net::IpAddr::V6(ip)) if v6 => Some(format!("https://[{ip}]:{port}")),
            Ok(std::net::IpAddr::V4(ip)) if !v6 => Some(format!("https://{ip}:{port}")),
            _ => None,
        })
        .collect()
}

/// An error and its causes on one line ("connection refused" sits deep in the chain).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s += ": ";
            s += &t;
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint as SliceEndpoint, EndpointConditions, EndpointPort};

    #[test]
    fn slice_addresses_become_urls() {
        let slice = EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: vec![
                SliceEndpoint { addresses: vec!["10.0.0.1".into()], ..Default::default() },
                SliceEndpoint {
                    addresses: vec!["10.0.0.2".into()],
                    conditions: Some(EndpointConditions { ready: Some(false), ..Default::default() }),
                    ..Default::default()
                },
            ],
            ports: Some(vec![EndpointPort { name: Some("https".into()), port: Some(6443), ..Default::default() }]),
            ..Default::default()
        };
        assert_eq!(urls_of(&slice), ["https://10.0.0.1:6443"]);
        let v6 = EndpointSlice {
            address_type: "IPv6".into(),
            endpoints: vec![SliceEndpoint { addresses: vec!["fd00::1".into()], ..Default::default() }],
            ..Default::default()
        };
        assert_eq!(urls_of(&v6), ["https://[fd00::1]:6443"]);
        // Anything that is not an address of the slice's family is dropped.
        let odd = EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: vec![SliceEndpoint {
                addresses: vec!["evil.example/x".into(), "fd00::2".into(), "10.0.0.3".into()],
                ..Default::default()
            }],
            ..Default::default()
        };
        assert_eq!(urls_of(&odd), ["https://10.0.0.3:6443"]);
    }

    #[test]
    fn this_hosts_own_api_server_is_told_from_the_others() {
        let local = "https://kubernetes.local:6443";
        assert!(on_this_host(local, local), "the kubeconfig's own server");
        assert!(on_this_host("https://127.0.0.1:6443", local));
        assert!(on_this_host("https://127.0.0.9:6443", local), "all of 127/8 is this host");
        assert!(on_this_host("https://[::1]:6443", local));
        assert!(!on_this_host("https://server2.example:6443", local), "a name is another host");
        // An address assigned here is this host's (a build machine here had 192.0.2.2
        // on eth0); one that is not, is another's.
        let [a, b] = elsewhere();
        assert!(!on_this_host(&a, local) && !on_this_host(&b, local), "{a} {b}");
        let here = std::net::UdpSocket::bind("0.0.0.0:0")
            .and_then(|s| s.connect(("192.0.2.77", 9)).and(s.local_addr()))
            .map(|a| a.ip())
            .ok()
            .filter(|ip| !ip.is_unspecified() && !ip.is_loopback());
        if let Some(ip) = here {
            assert!(on_this_host(&format!("https://{ip}:6443"), local), "{ip}, this host's own route source");
        }
    }

    /// A kubeconfig at `dir/kubeconfig` for the API server at `server` (a token, no
    /// certificate checked).
    pub(crate) fn kubeconfig_at(dir: &std::path::Path, server: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: {server}\n    \
             insecure-skip-tls-verify: true\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\n\
             current-context: c\nusers:\n- name: u\n  user:\n    token: t\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Two documentation addresses (TEST-NET-1..3) not assigned to this host.
    pub(crate) fn elsewhere() -> [String; 2] {
        let free: Vec<String> = ["192.0.2", "198.51.100", "203.0.113"]
            .iter()
            .flat_map(|net| (1..=9).map(move |h| format!("{net}.{h}")))
            .filter(|ip| std::net::UdpSocket::bind((ip.parse::<std::net::IpAddr>().unwrap(), 0)).is_err())
            .map(|ip| format!("https://{ip}:6443"))
            .take(2)
            .collect();
        [free[0].clone(), free[1].clone()]
    }

    /// A kubeconfig at this host and two other servers: after `ask_others_first`
    /// the first try goes to the first other one, and stays there.
    #[test]
    fn a_step_down_asks_another_server_first() {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = kubeconfig_at(dir.path(), "https://127.0.0.1:6443");
        let settings = |api_servers: Vec<String>| EndpointSettings {
            kubeconfig: kubeconfig.clone(),
            api_servers,
            tls_server_name: None,
            request_timeout: Duration::from_secs(1),
            cache: None,
            report_rejected: false,
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let [a, b] = elsewhere();
            let eps = Endpoints::new(settings(vec!["https://127.0.0.2:6443".to_string(), a.clone(), b]));
            assert_eq!(eps.preferred.get(), 0, "the kubeconfig's own server first");
            eps.ask_others_first().await;
            assert_eq!(eps.urls().await.unwrap()[eps.preferred.get()], a, "past 127.0.0.2, this host's");
            // Once elsewhere (here: the second other server answered), it stays there.
            eps.preferred.set(3);
            eps.ask_others_first().await;
            assert_eq!(eps.preferred.get(), 3);

            // Only this host's own servers known: nothing to move to.
            let alone = Endpoints::new(settings(vec!["https://127.0.0.2:6443".into()]));
            alone.ask_others_first().await;
            assert_eq!(alone.preferred.get(), 0);
        });
    }

    #[test]
    fn unreachable_names_every_endpoint() {
        let e = CallError::Unreachable {
            what: "get leases kube-system/regrade".into(),
            tried: vec![
                ("https://a:6443".into(), "503 apiserver disabled".into()),
                ("https://b:6443".into(), "refused".into()),
            ],
        };
        let s = e.to_string();
        assert!(s.contains("https://a:6443: 503 apiserver disabled") && s.contains("https://b:6443: refused"), "{s}");
    }

    #[test]
    fn the_subject_of_unreachable_ignores_order_and_timings() {
        let e = |tried: &[(&str, &str)]| CallError::Unreachable {
            what: "list nodes".into(),
            tried: tried.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
        };
        let one = e(&[("https://b:6443", "refused"), ("https://a:6443", "no answer within 10s")]);
        let two = e(&[("https://a:6443", "503 apiserver disabled"), ("https://b:6443", "refused")]);
        assert_ne!(one.to_string(), two.to_string());
        assert_eq!(one.subject(), "https://a:6443 https://b:6443");
        assert_eq!(one.subject(), two.subject());
    }
}
