//! Where calls go (docs/behaviour.md, "Coordination"), against a real kube-apiserver:
//! past a refused local port and a server answering 503 "apiserver disabled" (as k3s does at etcd-only) to the
//! real API server reached at an address its certificate does not name; discovery from
//! the `default/kubernetes` EndpointSlice and its cache. Gated by REGRADE_TEST_KUBE=1.

use crate::common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use regrade::cluster::Cluster;
use regrade::decide::{Direction, Step};
use regrade::level::Level;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::block_on;

const DOWN: Step = Step { direction: Direction::Down, from: Level::Full, to: Level::ControlPlane };

/// A TLS listener on `addr` with the API server's own certificate that answers every
/// request as k3s's port 6443 does with the API server disabled. Counts requests.
async fn apiserver_disabled(addr: &str, pki: &Path) -> (String, Arc<AtomicUsize>) {
    let certs = CertificateDer::pem_file_iter(pki.join("apiserver.crt")).unwrap().map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_file(pki.join("apiserver.key")).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let tls = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = TcpListener::bind(format!("{addr}:0")).await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let (acceptor, counted) = (acceptor.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else { return };
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                counted.fetch_add(1, Ordering::SeqCst);
                let body = "apiserver disabled\n";
                let resp = format!(
                    "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (url, count)
}

/// A plain TCP forwarder from `addr` to `to` (host:port): the real API server at an
/// address its serving certificate does not name.
async fn forwarder(addr: &str, to: String) -> String {
    let listener = TcpListener::bind(format!("{addr}:0")).await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut a, _) = listener.accept().await.unwrap();
            let to = to.clone();
            tokio::spawn(async move {
                if let Ok(mut b) = TcpStream::connect(to).await {
                    let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
                }
            });
        }
    });
    url
}

/// A loopback port nothing listens on.
async fn refused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port()
}

/// The admin kubeconfig with its server replaced by `server`.
fn kubeconfig_at(h: &common::Harness, server: &str, name: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(&h.admin_kubeconfig).unwrap().replace(&h.server, server);
    let out = h.dir.join(name);
    std::fs::write(&out, text).unwrap();
    out
}

#[test]
fn calls_fail_over_past_a_refused_port_and_a_disabled_apiserver() {
    let Some(h) = common::start("calls_fail_over_past_a_refused_port_and_a_disabled_apiserver") else { return };
    block_on(async {
        let pki = h.dir.join("pki");
        let (disabled, hits) = apiserver_disabled("127.0.0.2", &pki).await;
        let real = forwarder("127.0.0.3", h.server.trim_start_matches("https://").to_string()).await;
        let local = format!("https://127.0.0.1:{}", refused_port().await);
        let kc = kubeconfig_at(&h, &local, "refused.kubeconfig");

        let mut cfg = h.config(&kc, "failover-1", "failover");
        cfg.cluster.api_servers = vec![disabled.clone(), real.clone()];
        let c = common::kube_cluster(&cfg).unwrap();
        c.acquire(&DOWN).await.unwrap();
        assert!(hits.load(Ordering::SeqCst) >= 1, "the disabled API server was never asked");
        assert_eq!(c.endpoints.urls().await.unwrap(), [local.clone(), disabled.clone(), real.clone()]);
        // The endpoint that answered is asked first from then on.
        let before = hits.load(Ordering::SeqCst);
        c.release().await;
        c.preflight(&DOWN).await.unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), before, "went back to a server that had answered 503");

        // Control: without the TLS server name the real server's certificate does not
        // name 127.0.0.3, so nothing answers, and the refusal names every endpoint.
        cfg.cluster.tls_server_name = String::new();
        let c = common::kube_cluster(&cfg).unwrap();
        let r = c.acquire(&DOWN).await.unwrap_err();
        assert_eq!(r.kind, "api-unreachable", "{r}");
        for ep in [&local, &disabled, &real] {
            assert!(r.message.contains(ep.as_str()), "{ep} not named in: {r}");
        }
        assert!(r.message.contains("not valid for name \"127.0.0.3\""), "{r}");
        let mut eps = [local.clone(), disabled.clone(), real.clone()];
        eps.sort();
        assert_eq!(r.subject, eps.join(" "), "the endpoints identify the reason");
        assert!(c.preflight(&DOWN).await.unwrap_err().same_reason(&r));
        println!("all down: {r}");
    });
}

#[test]
fn api_servers_are_discovered_cached_and_used_when_the_local_one_is_down() {
    let Some(h) = common::start("api_servers_are_discovered_cached_and_used_when_the_local_one_is_down") else {
        return;
    };
    block_on(async {
        let admin = h.admin().await;
        let cfg = h.config(&h.admin_kubeconfig, "disc-1", "disc");
        let cache = cfg.cluster.endpoints_cache.clone();
        let c = common::kube_cluster(&cfg).unwrap();
        // No slice yet (as on a k3s whose API server has just started): nothing is
        // learnt, and discovery is tried again at the next call.
        c.preflight(&DOWN).await.unwrap();
        assert!(!cache.exists(), "cached endpoints without a slice");
        assert_eq!(c.endpoints.urls().await.unwrap(), std::slice::from_ref(&h.server));

        // The harness runs without an endpoint reconciler (loopback is no valid
        // endpoint address), so the test publishes the slice a 3-server k3s would
        // have. 10.255.255.1 is never connected to: the local API answers.
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "kubernetes", "labels": {"kubernetes.io/service-name": "kubernetes"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.255.255.1"], "conditions": {"ready": true}}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
        }))
        .unwrap();
        Api::<EndpointSlice>::namespaced(admin.clone(), "default").create(&Default::default(), &slice).await.unwrap();

        c.preflight(&DOWN).await.unwrap();
        assert_eq!(std::fs::read_to_string(&cache).unwrap(), "https://10.255.255.1:6443\n");
        assert_eq!(c.endpoints.urls().await.unwrap(), [h.server.clone(), "https://10.255.255.1:6443".to_string()]);

        // A later process whose local API is down (etcd-only) goes to the cached ones.
        let real = forwarder("127.0.0.3", h.server.trim_start_matches("https://").to_string()).await;
        std::fs::write(&cache, format!("{real}\n")).unwrap();
        let local = format!("https://127.0.0.1:{}", refused_port().await);
        let mut cfg = h.config(&kubeconfig_at(&h, &local, "down.kubeconfig"), "disc-1", "disc");
        cfg.cluster.endpoints_cache = cache;
        let c = common::kube_cluster(&cfg).unwrap();
        c.acquire(&DOWN).await.unwrap();
        c.release().await;
        assert_eq!(c.endpoints.urls().await.unwrap(), [local, real]);
    });
}
