//! A proxy in front of the rig's kube-apiserver that can lose replies (and make the
//! Lease's writes slow, or answer pod evictions with 409 itself): it terminates
//! TLS with the API server's own serving certificate (so regrade's checks of the CA
//! and the name pass unchanged), forwards every request over a fresh TLS connection to
//! the real API server, and sends the answers back — except, when armed, the answer
//! to a Node PATCH: the PATCH reaches the API server and takes effect, its reply is
//! dropped, and the connection stays silent until the client gives up. Meanwhile (the
//! "black hole") every new request is swallowed the same way, as when every endpoint
//! times out. Requests carry their own credentials (a ServiceAccount token), which
//! pass through untouched; the proxy itself presents no client certificate.

use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;

#[derive(Default)]
pub struct Knobs {
    /// Node PATCHes still to lose.
    lose_patches: AtomicUsize,
    /// How long every request is swallowed after a lost PATCH.
    black_hole_for: Mutex<Duration>,
    black_hole_until: Mutex<Option<Instant>>,
    /// PATCHes to nodes forwarded (lost or not), and how many replies were lost.
    pub node_patches: AtomicUsize,
    pub lost: AtomicUsize,
    /// Requests swallowed by the black hole.
    pub swallowed: AtomicUsize,
    /// Every request swallowed until set false again: the API "down".
    down: AtomicBool,
    /// How long each write to a Lease (PUT or PATCH under coordination.k8s.io) is
    /// held before it goes on to the API server; zero: not held.
    lease_write_delay: Mutex<Duration>,
    /// Lease writes held so far.
    pub delayed_lease_writes: AtomicUsize,
    /// Pod evictions (POST .../pods/NAME/eviction) still to answer with 409 here,
    /// as the API server does when its own conflict retries run out; the pod stays.
    conflict_evictions: AtomicUsize,
    /// Eviction POSTs seen, and how many of them this proxy answered with 409.
    pub evictions: AtomicUsize,
    pub conflicted: AtomicUsize,
}

impl Knobs {
    /// Loses the reply to the next Node PATCH, then swallows every request for `then`.
    pub fn lose_next_node_patch(&self, then: Duration) {
        *self.black_hole_for.lock().unwrap() = then;
        self.lose_patches.store(1, Ordering::SeqCst);
    }

    /// Swallows every request (connections are accepted, nothing is answered) until
    /// called with `false`: every endpoint times out.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Holds every later write to a Lease `delay` before forwarding it (a slow API
    /// server, or a slow network to it): the client's request times out first, and
    /// the write still lands afterwards.
    pub fn delay_lease_writes(&self, delay: Duration) {
        *self.lease_write_delay.lock().unwrap() = delay;
    }

    /// Answers the next `n` pod evictions with 409 Conflict itself (they never reach
    /// the API server), then passes them through.
    pub fn conflict_next_evictions(&self, n: usize) {
        self.conflict_evictions.store(n, Ordering::SeqCst);
    }

    fn in_black_hole(&self) -> bool {
        self.down.load(Ordering::SeqCst) || self.black_hole_until.lock().unwrap().is_some_and(|t| Instant::now() < t)
    }

    /// Whether the black hole is over (or never began).
    pub fn back(&self) -> bool {
        !self.in_black_hole()
    }
}

pub struct LostReply {
    pub url: String,
    pub knobs: Arc<Knobs>,
}

/// Starts the proxy on 127.0.0.1 (a free port) in front of `upstream`
/// (`https://127.0.0.1:PORT`), with the harness's `pki` directory. Runs on the
/// caller's tokio runtime (a multi-threaded one: it must serve while the test blocks).
pub async fn start(upstream: &str, pki: &Path) -> LostReply {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<_> = CertificateDer::pem_file_iter(pki.join("apiserver.crt")).unwrap().map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_file(pki.join("apiserver.key")).unwrap();
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(pki.join("ca.crt")).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let hostport = upstream.strip_prefix("https://").unwrap().to_string();
    let ip: IpAddr = hostport.rsplit_once(':').unwrap().0.parse().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let knobs = Arc::new(Knobs::default());
    let k = knobs.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            let (acceptor, connector, hostport, k) = (acceptor.clone(), connector.clone(), hostport.clone(), k.clone());
            tokio::spawn(async move {
                let Ok(down) = acceptor.accept(tcp).await else { return };
                let Ok(up_tcp) = TcpStream::connect(&hostport).await else { return };
                let Ok(up) = connector.connect(ServerName::IpAddress(ip.into()), up_tcp).await else { return };
                serve(down, up, k).await;
            });
        }
    });
    LostReply { url, knobs }
}

/// Pipes one client connection to the API server and back, watching the requests.
async fn serve<D, U>(down: D, up: U, k: Arc<Knobs>)
where
    D: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut dr, dw) = tokio::io::split(down);
    let (mut ur, mut uw) = tokio::io::split(up);
    // Shared: the answers from upstream, and the proxy's own 409s.
    let dw = Arc::new(tokio::sync::Mutex::new(dw));
    let answers = dw.clone();
    // Set once this connection's replies are lost: nothing more goes back on it.
    let silent = Arc::new(AtomicBool::new(false));
    let s = silent.clone();
    let back = tokio::spawn(async move {
        let mut buf = vec![0u8; 16 << 10];
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if s.load(Ordering::SeqCst) {
                continue; // lost on the way back
            }
            if dw.lock().await.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    });
    let mut buf = vec![0u8; 16 << 10];
    // The tail of the previous chunk, so a request line split across reads is seen.
    let mut tail: Vec<u8> = Vec::new();
    // Whether this connection's requests still go up (a lost PATCH's body does;
    // a swallowed request does not).
    let mut forward = true;
    loop {
        let n = match dr.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut seen = std::mem::take(&mut tail);
        seen.extend_from_slice(&buf[..n]);
        if !silent.load(Ordering::SeqCst) {
            if k.in_black_hole() {
                // Every endpoint times out: swallow the request, answer nothing.
                k.swallowed.fetch_add(1, Ordering::SeqCst);
                silent.store(true, Ordering::SeqCst);
                forward = false;
            } else if seen.windows(20).any(|w| w == b"PATCH /api/v1/nodes/") {
                k.node_patches.fetch_add(1, Ordering::SeqCst);
                let lose =
                    k.lose_patches.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
                if lose {
                    // Silence first, then forward: the reply must never get back.
                    silent.store(true, Ordering::SeqCst);
                    k.lost.fetch_add(1, Ordering::SeqCst);
                    let hole = *k.black_hole_for.lock().unwrap();
                    *k.black_hole_until.lock().unwrap() = Some(Instant::now() + hole);
                }
            }
        }
        if forward && buf[..n].starts_with(b"POST /api/v1/namespaces/") && {
            let line_end = buf[..n].iter().position(|&b| b == b'\r').unwrap_or(n);
            // The path ends in /eviction (kube adds an empty query: "/eviction?").
            buf[..line_end].windows(10).any(|w| w == b"/eviction " || w == b"/eviction?")
        } {
            k.evictions.fetch_add(1, Ordering::SeqCst);
            let conflict =
                k.conflict_evictions.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
            if conflict {
                let Some(()) = read_whole_request(&mut dr, buf[..n].to_vec()).await else { break };
                k.conflicted.fetch_add(1, Ordering::SeqCst);
                let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Operation cannot be fulfilled on poddisruptionbudgets.policy \"web\": the object has been modified; please apply your changes to the latest version and try again","reason":"Conflict","details":{"name":"web","group":"policy","kind":"poddisruptionbudgets"},"code":409}"#;
                let head = format!(
                    "HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let mut w = answers.lock().await;
                if w.write_all(head.as_bytes()).await.is_err() || w.write_all(body).await.is_err() {
                    break;
                }
                tail.clear();
                continue;
            }
        }
        // Only a request line that ends in this chunk (not one seen in the tail).
        let old = seen.len() - n;
        let lease_write = [&b"PUT /apis/coordination.k8s.io/"[..], b"PATCH /apis/coordination.k8s.io/"]
            .iter()
            .any(|verb| seen.windows(verb.len()).enumerate().any(|(i, w)| w == *verb && i + verb.len() > old));
        let delay = *k.lease_write_delay.lock().unwrap();
        if forward && lease_write && !delay.is_zero() {
            k.delayed_lease_writes.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(delay).await;
        }
        if forward && uw.write_all(&buf[..n]).await.is_err() {
            break;
        }
        let keep = seen.len().saturating_sub(32);
        tail = seen.split_off(keep);
    }
    back.abort();
}

/// Reads the rest of the request that begins with `got` (its head, then a body of
/// its Content-Length), so that it can be answered here instead of upstream.
async fn read_whole_request<R: tokio::io::AsyncRead + Unpin>(r: &mut R, mut got: Vec<u8>) -> Option<()> {
    let mut buf = vec![0u8; 16 << 10];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = r.read(&mut buf).await.ok().filter(|&n| n > 0)?;
        got.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
    let length: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    while got.len() < head_end + length {
        let n = r.read(&mut buf).await.ok().filter(|&n| n > 0)?;
        got.extend_from_slice(&buf[..n]);
    }
    Some(())
}
