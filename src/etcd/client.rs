//! etcd's JSON gateway (`POST /v3/cluster/member/list`, `POST /v3/maintenance/status`,
//! each with a `{}` body) over HTTPS with the client certificate.
//!
//! Why the gateway and not gRPC: two small JSON calls are all the gate needs, and hyper,
//! rustls and tokio-rustls are already in the build through kube's client, so this adds
//! no dependency a gRPC stack (tonic, prost, generated code) would. One request per
//! fresh connection: the gate asks a handful of times per step, never per sample.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use async_trait::async_trait;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Deserializer};
use tokio_rustls::rustls;
use tokio_rustls::TlsConnector;

use super::EtcdConfig;

/// An answer larger than this is not etcd's (a member list of a few members is ~1 KiB).
const MAX_ANSWER: usize = 1 << 20;

/// An `https://host:port` client URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    host: String,
    port: u16,
}

impl Endpoint {
    pub fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let Some(rest) = url.strip_prefix("https://") else {
            bail!("{url:?} must be an https:// URL (k3s's etcd takes only TLS clients), e.g. https://127.0.0.1:2379");
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !p.contains(']') => {
                (h, p.parse::<u16>().map_err(|_| anyhow!("{url:?}: {p:?} is not a port"))?)
            }
            _ => bail!("{url:?} must name a host and a port, e.g. https://127.0.0.1:2379"),
        };
        if host.contains('/') {
            bail!("{url:?} must be just https://host:port (no path)");
        }
        let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
        Ok(Endpoint { host, port })
    }

    fn server_name(&self) -> anyhow::Result<ServerName<'static>> {
        ServerName::try_from(self.host.clone()).map_err(|e| anyhow!("{self}: {e}"))
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host.contains(':') {
            write!(f, "https://[{}]:{}", self.host, self.port)
        } else {
            write!(f, "https://{}:{}", self.host, self.port)
        }
    }
}

/// The header of every answer: which cluster and which member answered.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Header {
    #[serde(alias = "clusterId", deserialize_with = "u64_any")]
    pub cluster_id: u64,
    #[serde(alias = "memberId", deserialize_with = "u64_any")]
    pub member_id: u64,
}

/// One member as the member list gives it. A member added but never started has no
/// name and no client URLs yet.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Member {
    #[serde(rename = "ID", alias = "id", deserialize_with = "u64_any")]
    pub id: u64,
    pub name: String,
    #[serde(rename = "peerURLs", alias = "peer_urls")]
    pub peer_urls: Vec<String>,
    #[serde(rename = "clientURLs", alias = "client_urls")]
    pub client_urls: Vec<String>,
    #[serde(rename = "isLearner", alias = "is_learner")]
    pub is_learner: bool,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct MemberList {
    pub header: Header,
    pub members: Vec<Member>,
}

/// A member's own status (`etcdctl endpoint status`).
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct Status {
    pub header: Header,
    pub version: String,
    /// The leader's member ID as this member sees it; 0: no leader.
    #[serde(deserialize_with = "u64_any")]
    pub leader: u64,
    #[serde(rename = "raftIndex", alias = "raft_index", deserialize_with = "u64_any")]
    pub raft_index: u64,
    #[serde(rename = "raftAppliedIndex", alias = "raft_applied_index", deserialize_with = "u64_any")]
    pub raft_applied_index: u64,
    #[serde(rename = "raftTerm", alias = "raft_term", deserialize_with = "u64_any")]
    pub raft_term: u64,
    #[serde(rename = "isLearner", alias = "is_learner")]
    pub is_learner: bool,
    /// Alarms and other errors the member reports (e.g. `NOSPACE`).
    pub errors: Vec<String>,
}

/// etcd's gateway writes 64-bit numbers as JSON strings; accept numbers too.
fn u64_any<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        S(String),
        N(u64),
    }
    match N::deserialize(d)? {
        N::N(n) => Ok(n),
        N::S(s) => s.parse().map_err(serde::de::Error::custom),
    }
}

/// An HTTPS client holding the CA and the client certificate. Cheap to clone.
#[derive(Clone)]
pub struct EtcdClient {
    tls: TlsConnector,
    timeout: Duration,
}

/// Reads a PEM file named by the config key `key`; the error names the key and the file.
fn read_pem(key: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("etcd.{key} = {}: cannot read the file", path.display()))?;
    Ok(bytes)
}

fn certs(key: &str, path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(key, path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("etcd.{key} = {}: not a PEM certificate: {e}", path.display()))?;
    if certs.is_empty() {
        bail!("etcd.{key} = {}: no PEM certificate in the file", path.display());
    }
    Ok(certs)
}

/// The two questions the gate asks a member: its member list and its own status. The
/// real [`EtcdClient`] asks over HTTPS; the simulator answers from its model.
#[async_trait(?Send)]
pub trait AskEtcd {
    async fn member_list(&self, ep: &Endpoint) -> anyhow::Result<MemberList>;
    async fn status(&self, ep: &Endpoint) -> anyhow::Result<Status>;
}

/// Whether `e` says nothing listens at the endpoint (the connection was refused): the
/// member is not running there, which a timeout does not say.
pub fn refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

#[async_trait(?Send)]
impl AskEtcd for EtcdClient {
    async fn member_list(&self, ep: &Endpoint) -> anyhow::Result<MemberList> {
        EtcdClient::member_list(self, ep).await
    }
    async fn status(&self, ep: &Endpoint) -> anyhow::Result<Status> {
        EtcdClient::status(self, ep).await
    }
}

impl EtcdClient {
    /// Reads the CA, the client certificate and its key named by `cfg`; a missing or
    /// unreadable file is an error naming its key and path.
    pub fn new(cfg: &EtcdConfig) -> anyhow::Result<EtcdClient> {
        let mut roots = rustls::RootCertStore::empty();
        for c in certs("ca_file", &cfg.ca_file)? {
            roots.add(c).map_err(|e| anyhow!("etcd.ca_file = {}: {e}", cfg.ca_file.display()))?;
        }
        let chain = certs("cert_file", &cfg.cert_file)?;
        let key_pem = read_pem("key_file", &cfg.key_file)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| anyhow!("etcd.key_file = {}: not a PEM private key: {e}", cfg.key_file.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS setup")?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .with_context(|| {
                format!(
                    "etcd.cert_file = {} and etcd.key_file = {} do not make a client certificate",
                    cfg.cert_file.display(),
                    cfg.key_file.display()
                )
            })?;
        // etcd's client port also speaks gRPC (h2); the gateway is plain HTTP/1.1.
        tls.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(EtcdClient { tls: TlsConnector::from(Arc::new(tls)), timeout: cfg.request_timeout.0 })
    }

    pub async fn member_list(&self, ep: &Endpoint) -> anyhow::Result<MemberList> {
        let body = self.post(ep, "/v3/cluster/member/list").await?;
        serde_json::from_slice(&body).with_context(|| format!("{ep}: a member list that does not parse"))
    }

    pub async fn status(&self, ep: &Endpoint) -> anyhow::Result<Status> {
        let body = self.post(ep, "/v3/maintenance/status").await?;
        serde_json::from_slice(&body).with_context(|| format!("{ep}: a status that does not parse"))
    }

    async fn post(&self, ep: &Endpoint, path: &str) -> anyhow::Result<Vec<u8>> {
        self.call(ep, path, "{}").await
    }

    /// One `POST path` with a JSON `body`, bounded by the request timeout as a whole.
    /// (The gate only reads; tests also add and remove members with it.)
    pub async fn call(&self, ep: &Endpoint, path: &str, body: &str) -> anyhow::Result<Vec<u8>> {
        match tokio::time::timeout(self.timeout, self.post_unbounded(ep, path, body.as_bytes().to_vec())).await {
            Ok(r) => r.with_context(|| format!("{ep}{path}")),
            Err(_) => bail!("{ep}{path}: no answer within {:?}", self.timeout),
        }
    }

    async fn post_unbounded(&self, ep: &Endpoint, path: &str, body: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        let tcp = tokio::net::TcpStream::connect((ep.host.as_str(), ep.port)).await.context("connecting")?;
        let tls = self.tls.connect(ep.server_name()?, tcp).await.context("TLS handshake")?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        let driver = tokio::spawn(conn);
        let req = Request::builder()
            .method(Method::POST)
            .uri(path)
            .header(hyper::header::HOST, format!("{}:{}", ep.host, ep.port))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(hyper::body::Bytes::from(body)))?;
        let result = async {
            let resp = sender.send_request(req).await.context("sending the request")?;
            let status = resp.status();
            let body = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(|e| anyhow!("reading the answer: {e}"))?
                .to_bytes();
            if status != StatusCode::OK {
                bail!("answered {status}: {}", String::from_utf8_lossy(&body).trim());
            }
            Ok(body.to_vec())
        }
        .await;
        driver.abort();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_https_host_port() {
        let e = Endpoint::parse("https://127.0.0.1:2379").unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 2379));
        assert_eq!(e.to_string(), "https://127.0.0.1:2379");
        assert_eq!(Endpoint::parse("https://[::1]:2379/").unwrap().to_string(), "https://[::1]:2379");
        assert_eq!(Endpoint::parse("https://etcd.local:2379").unwrap().host, "etcd.local");
        for bad in ["http://127.0.0.1:2379", "https://127.0.0.1", "https://:2379", "https://h:x", "https://h:1/p"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn gateway_json_with_string_numbers_and_omitted_defaults() {
        // What etcd's gateway answers: 64-bit numbers as strings, zero values omitted.
        let l: MemberList = serde_json::from_str(
            r#"{"header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437","raft_term":"2"},
                "members":[{"ID":"10276657743932975437","name":"server1-1a2b3c4d","peerURLs":["https://10.0.0.1:2380"],
                            "clientURLs":["https://10.0.0.1:2379"]},
                           {"ID":"42","peerURLs":["https://10.0.0.4:2380"],"isLearner":true}]}"#,
        )
        .unwrap();
        assert_eq!(l.header.cluster_id, 14841639068965178418);
        assert_eq!(l.members[0].name, "server1-1a2b3c4d");
        assert!(!l.members[0].is_learner && l.members[1].is_learner && l.members[1].name.is_empty());
        let s: Status = serde_json::from_str(
            r#"{"header":{"cluster_id":"7","member_id":"42"},"version":"3.6.0","leader":"9","raftIndex":"120",
                "raftTerm":"3","raftAppliedIndex":"118","errors":["NOSPACE"]}"#,
        )
        .unwrap();
        assert_eq!((s.leader, s.raft_index, s.raft_applied_index, s.is_learner), (9, 120, 118, false));
        assert_eq!(s.errors, ["NOSPACE"]);
    }

    #[test]
    fn a_missing_certificate_names_the_key_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = EtcdConfig {
            ca_file: dir.path().join("server-ca.crt"),
            cert_file: dir.path().join("client.crt"),
            key_file: dir.path().join("client.key"),
            ..EtcdConfig::default()
        };
        let e = format!("{:#}", EtcdClient::new(&cfg).err().unwrap());
        assert!(e.contains("etcd.ca_file") && e.contains("server-ca.crt"), "{e}");
        std::fs::write(&cfg.ca_file, "not pem").unwrap();
        let e = format!("{:#}", EtcdClient::new(&cfg).err().unwrap());
        assert!(e.contains("etcd.ca_file") && e.contains("no PEM certificate"), "{e}");
        cfg.ca_file = "/nonexistent/ca.crt".into();
        let e = format!("{:#}", EtcdClient::new(&cfg).err().unwrap());
        assert!(e.contains("/nonexistent/ca.crt"), "{e}");
    }
}
