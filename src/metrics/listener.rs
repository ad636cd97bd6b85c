//! The `/metrics` and `/healthz` listener on `[metrics] listen`: hyper's HTTP/1.1
//! server behind two caps (connections waiting for their request head, connections
//! being served), reading only the registry's atomics.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::{monotonic_ns, MaxSampleAge, Metrics};

/// Called before `/metrics` is rendered: `watch` looks at what it looks at only
/// under pressure, so a scrape asks for a look (bounded; see `watch::looks`).
pub type OnScrape = Arc<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync>;

/// Connections handed to hyper at once: each has sent a whole request head. At the
/// cap, a newly handed one closes the oldest one that is not being answered.
const MAX_CONNECTIONS: usize = 32;
/// Connections waiting for their whole request head, at once. They cost a socket and
/// a small task each, no HTTP state. At the cap a newcomer closes the oldest waiter:
/// a real client sends its request as soon as it has connected, so the oldest waiter
/// is one that sends nothing or a byte now and then. 32 + 256 sockets stay well
/// inside systemd's default of 1,024 open files.
const MAX_WAITING: usize = 256;
/// A request head must arrive whole within this, from the connection's start or the
/// previous answer: a client that sends nothing, or a byte now and then, is closed.
const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// A kept-alive connection is closed once this old (after the answer in flight).
const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// An answer older than this (its client does not read) no longer keeps its
/// connection from being closed for a new one; also the last answer's time at the age.
const ANSWER_GRACE: Duration = Duration::from_secs(5);
/// hyper's smallest read buffer: a request head longer than this is refused (431).
const MAX_HEAD: usize = 8192;

/// Binds `[metrics] listen`. Done before the loop starts, so a bad or busy address
/// stops `watch` at once, naming the key.
pub fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let std =
        std::net::TcpListener::bind(addr).with_context(|| format!("metrics.listen = \"{addr}\": cannot listen"))?;
    std.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(std).with_context(|| format!("metrics.listen = \"{addr}\""))
}

/// One open connection, as a cap sees it.
struct Slot {
    id: u64,
    /// The connection's socket, to see whether a request waits unread in it. Only
    /// peeked at, while the connection is open (slots go with their connection, on
    /// the one thread of `watch`'s runtime).
    fd: std::os::fd::RawFd,
    /// CLOCK_MONOTONIC ns since an answer is being made and handed to hyper; 0: none.
    answering_since: AtomicU64,
    /// Closes the connection at once (it is dropped), to make room for a new one.
    evict: tokio::sync::Notify,
}

/// The connections under one cap, oldest first.
struct Slots {
    cap: usize,
    open: std::sync::Mutex<std::collections::VecDeque<Arc<Slot>>>,
    next_id: AtomicU64,
}

impl Slots {
    fn new(cap: usize) -> Arc<Slots> {
        Arc::new(Slots { cap, open: Default::default(), next_id: AtomicU64::new(0) })
    }

    /// A slot for a new connection (socket `fd`). At the cap, `closed_for_it` picks the
    /// open one that is closed to make room (its index, oldest first); `None` from it
    /// closes the new one instead.
    fn admit(
        self: &Arc<Self>,
        fd: std::os::fd::RawFd,
        closed_for_it: impl Fn(&std::collections::VecDeque<Arc<Slot>>) -> Option<usize>,
    ) -> Option<(Arc<Slot>, Release)> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.len() >= self.cap {
            let closed = closed_for_it(&open)?;
            let old = open.remove(closed)?;
            old.evict.notify_one();
        }
        let slot = Arc::new(Slot {
            id: self.next_id.fetch_add(1, Relaxed),
            fd,
            answering_since: AtomicU64::new(0),
            evict: tokio::sync::Notify::new(),
        });
        open.push_back(slot.clone());
        Some((slot.clone(), Release(self.clone(), slot.id)))
    }

    fn release(&self, id: u64) {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).retain(|s| s.id != id);
    }
}

/// Among connections handed to hyper: the oldest not being answered and with no
/// request waiting unread in its socket (a kept-alive one between requests), else the
/// oldest not being answered; `None` when every one is being answered (then the new
/// one is closed, and a retry soon gets in: answers take microseconds).
fn idle_longest(open: &std::collections::VecDeque<Arc<Slot>>) -> Option<usize> {
    let now = monotonic_ns();
    let not_answered = |s: &Arc<Slot>| {
        let since = s.answering_since.load(Relaxed);
        since == 0 || now.saturating_sub(since) > ANSWER_GRACE.as_nanos() as u64
    };
    open.iter().position(|s| not_answered(s) && !unread(s.fd)).or_else(|| open.iter().position(not_answered))
}

/// Whether bytes wait unread in socket `fd` (a request not read yet), or its peer
/// has closed it: a look that takes nothing.
fn unread(fd: std::os::fd::RawFd) -> bool {
    let mut b = 0u8;
    // SAFETY: reads at most one byte into `b`; MSG_PEEK leaves it in the socket.
    let n = unsafe { libc::recv(fd, (&mut b as *mut u8).cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    n > 0
}

/// What a waiting connection has sent so far, seen without taking it from the socket.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    /// A whole request head (or [`MAX_HEAD`] bytes, which hyper refuses): hand it on.
    Whole,
    /// Closed or reset by the client.
    Gone,
}

/// Peeks at socket `fd`: `WouldBlock` while the head is not whole yet, so that
/// tokio waits for more bytes (it clears the socket's readiness on `WouldBlock`).
fn peek_head(fd: std::os::fd::RawFd) -> std::io::Result<Head> {
    let mut buf = [0u8; MAX_HEAD];
    // SAFETY: reads at most `buf.len()` bytes into `buf`; MSG_PEEK leaves them queued.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return if e.kind() == std::io::ErrorKind::WouldBlock { Err(e) } else { Ok(Head::Gone) };
    }
    let got = &buf[..n as usize];
    if got.is_empty() {
        Ok(Head::Gone)
    } else if got.len() == MAX_HEAD || got.windows(2).any(|w| w == b"\n\n") || got.windows(4).any(|w| w == b"\r\n\r\n")
    {
        Ok(Head::Whole)
    } else {
        Err(std::io::ErrorKind::WouldBlock.into())
    }
}

/// Waits until the socket holds a whole request head, or the client has gone.
///
/// A client that closes its side after part of a head leaves the socket readable for
/// good (tokio cannot clear a hang-up), so a partial head with the read side closed
/// is gone; a whole head sent before the close is still answered.
async fn whole_head(stream: &tokio::net::TcpStream) -> Head {
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    loop {
        let Ok(ready) = stream.ready(tokio::io::Interest::READABLE).await else { return Head::Gone };
        match stream.try_io(tokio::io::Interest::READABLE, || peek_head(fd)) {
            Ok(head) => return head,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && !ready.is_read_closed() => {}
            Err(_) => return Head::Gone,
        }
    }
}

/// Gives a connection's slot back however its task ends.
struct Release(Arc<Slots>, u64);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

/// Serves `/metrics` and `/healthz` until the future is dropped.
///
/// HTTP/1.1 with hyper's server (keep-alive, as Prometheus scrapes). A new connection
/// first waits, without HTTP state, until its whole request head has arrived (at most
/// [`MAX_WAITING`] wait; at the cap a newcomer closes the oldest waiter; each closed
/// at [`HEAD_DEADLINE`]): clients that send nothing, or a byte now and then, never
/// reach hyper. Only then is it handed to hyper (at most [`MAX_CONNECTIONS`]; at the
/// cap the oldest one not being answered is closed for it), which reads the head it
/// already has and answers at once. A kept-alive connection has [`HEAD_DEADLINE`] for
/// each next head and is closed at [`MAX_CONNECTION_AGE`]. The handlers only read
/// atomics: the watcher never waits for a client.
///
/// `/healthz` is 200 while a good sample is younger than `max_sample_age`.
pub async fn serve(listener: tokio::net::TcpListener, metrics: &'static Metrics, max_sample_age: MaxSampleAge) {
    serve_asking(listener, metrics, max_sample_age, None).await
}

/// [`serve`], calling `on_scrape` before each `/metrics` is rendered.
pub async fn serve_asking(
    listener: tokio::net::TcpListener,
    metrics: &'static Metrics,
    max_sample_age: MaxSampleAge,
    on_scrape: Option<OnScrape>,
) {
    let waiting = Slots::new(MAX_WAITING);
    let served = Slots::new(MAX_CONNECTIONS);
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!(error = %e, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
        let Some((slot, release)) = waiting.admit(fd, |_| Some(0)) else { continue };
        let served = served.clone();
        let on_scrape = on_scrape.clone();
        tokio::spawn(async move {
            let head = tokio::select! {
                head = whole_head(&stream) => head,
                _ = slot.evict.notified() => return,
                _ = tokio::time::sleep(HEAD_DEADLINE) => return,
            };
            drop(release);
            if head != Head::Whole {
                return;
            }
            let Some((slot, release)) = served.admit(fd, idle_longest) else {
                tracing::debug!("metrics listener: every connection is being answered; closing a new one");
                return;
            };
            // A task of its own: a waiter's task stays as small as waiting needs.
            tokio::spawn(async move {
                connection(stream, slot, metrics, max_sample_age, on_scrape).await;
                drop(release);
            });
        });
    }
}

async fn connection(
    stream: tokio::net::TcpStream,
    slot: Arc<Slot>,
    metrics: &'static Metrics,
    max_sample_age: MaxSampleAge,
    on_scrape: Option<OnScrape>,
) {
    let answering = slot.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
        answering.answering_since.store(monotonic_ns(), Relaxed);
        let (answering, on_scrape) = (answering.clone(), on_scrape.clone());
        async move {
            let scrape =
                matches!(*req.method(), hyper::Method::GET | hyper::Method::HEAD) && req.uri().path() == "/metrics";
            if let (true, Some(ask)) = (scrape, on_scrape) {
                ask().await;
            }
            Ok::<_, std::convert::Infallible>(respond(&req, metrics, max_sample_age, answering))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_DEADLINE)
        .max_buf_size(MAX_HEAD)
        .keep_alive(true)
        // A client may close its side once its request is sent (`curl` with a body
        // from stdin, `nc -N`): answer it rather than take that for gone.
        .half_close(true)
        // The header names as before (Content-Type, Content-Length), for human readers.
        .title_case_headers(true);
    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = slot.evict.notified() => return,
        _ = tokio::time::sleep(MAX_CONNECTION_AGE) => {}
    }
    // Old enough: the answer in flight, if any, and then closed.
    conn.as_mut().graceful_shutdown();
    tokio::select! {
        _ = conn => {}
        _ = slot.evict.notified() => {}
        _ = tokio::time::sleep(ANSWER_GRACE) => {}
    }
}

/// A whole answer in one frame. Dropped once hyper has taken it: the connection is
/// then no longer being answered.
struct Answer {
    data: Option<hyper::body::Bytes>,
    slot: Arc<Slot>,
}

impl hyper::body::Body for Answer {
    type Data = hyper::body::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::task::Poll::Ready(self.data.take().map(|d| Ok(hyper::body::Frame::data(d))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.slot.answering_since.store(0, Relaxed);
    }
}

/// The response to a request (HEAD gets the head only: hyper sends no body for it).
fn respond<B>(
    req: &hyper::Request<B>,
    metrics: &Metrics,
    max_sample_age: MaxSampleAge,
    slot: Arc<Slot>,
) -> hyper::Response<Answer> {
    use hyper::StatusCode;
    const PLAIN: &str = "text/plain; charset=utf-8";
    let (status, content_type, body): (StatusCode, &str, String) = match *req.method() {
        hyper::Method::GET | hyper::Method::HEAD => match req.uri().path() {
            "/metrics" => {
                let mut body = String::with_capacity(4096);
                metrics.render(&mut body);
                (StatusCode::OK, "text/plain; version=0.0.4; charset=utf-8", body)
            }
            "/healthz" => match metrics.unhealthy(max_sample_age) {
                None => (StatusCode::OK, PLAIN, "ok\n".into()),
                Some(why) => (StatusCode::SERVICE_UNAVAILABLE, PLAIN, format!("{why}\n")),
            },
            "/" => (StatusCode::OK, PLAIN, "regrade: see /metrics and /healthz\n".into()),
            _ => (StatusCode::NOT_FOUND, PLAIN, "not found: try /metrics or /healthz\n".into()),
        },
        _ => (StatusCode::METHOD_NOT_ALLOWED, PLAIN, "only GET and HEAD\n".into()),
    };
    let len = body.len();
    let mut r = hyper::Response::new(Answer { data: Some(body.into()), slot });
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(content_type));
    h.insert(hyper::header::CONTENT_LENGTH, hyper::header::HeaderValue::from(len));
    if status == StatusCode::METHOD_NOT_ALLOWED {
        h.insert(hyper::header::ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::Reading;
    use crate::level::Level;
    use crate::metrics::tests::{ages, sample};

    /// Metrics that live for the test, with one calm sample stored.
    fn calm_metrics() -> &'static Metrics {
        let m: &'static Metrics = Box::leak(Box::new(Metrics::new()));
        m.sampled(&sample(), Reading::Calm);
        m
    }

    /// `m` served on a free loopback port (from within a runtime); its address.
    fn listening(m: &'static Metrics) -> SocketAddr {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(listener, m, ages(Duration::from_secs(60))));
        addr
    }

    /// One HTTP/1.1 request over a real loopback socket; returns the raw response.
    async fn request(addr: SocketAddr, req: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(req.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    /// A scrape of `/metrics` asks (`watch` looks then, not on a timer) and is answered
    /// after what it asked for; `/healthz` asks nothing.
    #[test]
    fn a_scrape_asks_before_it_is_answered_and_healthz_does_not() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m = calm_metrics();
            let asked = Arc::new(AtomicU64::new(0));
            let counted = asked.clone();
            let on_scrape: OnScrape = Arc::new(move || {
                let counted = counted.clone();
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    counted.fetch_add(1, Relaxed);
                })
            });
            let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(serve_asking(listener, m, ages(Duration::from_secs(60)), Some(on_scrape)));
            let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let r = request(addr, &get("/healthz")).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            assert_eq!(asked.load(Relaxed), 0, "/healthz asks nothing");
            let r = request(addr, &get("/metrics")).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            assert_eq!(asked.load(Relaxed), 1, "answered after the ask was done");
        });
    }

    #[test]
    fn the_listener_serves_metrics_and_healthz_over_http() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m: &'static Metrics = Box::leak(Box::new(Metrics::new()));
            let addr = listening(m);
            let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");

            let r = request(addr, &get("/healthz")).await;
            assert!(r.starts_with("HTTP/1.1 503"), "{r}");
            assert!(r.ends_with("no good sample yet\n"), "{r}");

            m.set_level(Level::EtcdOnly);
            m.sampled(&sample(), Reading::Over);
            let r = request(addr, &get("/metrics")).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            assert!(r.contains("\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"), "{r}");
            let body = r.split_once("\r\n\r\n").unwrap().1;
            assert!(r.contains(&format!("\r\nContent-Length: {}\r\n", body.len())), "{r}");
            assert!(
                r.contains("\r\nregrade_level{level=\"etcd-only\"} 1\n")
                    || r.contains("\nregrade_level{level=\"etcd-only\"} 1\n"),
                "{r}"
            );

            let r = request(addr, &get("/healthz")).await;
            assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("ok\n"), "{r}");
            let r = request(addr, &get("/nope")).await;
            assert!(r.starts_with("HTTP/1.1 404"), "{r}");
            let r =
                request(addr, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .await;
            assert!(
                r.starts_with("HTTP/1.1 405") && r.to_ascii_lowercase().contains("\r\nallow: get, head\r\n"),
                "{r}"
            );
            let r = request(addr, "garbage\r\n\r\n").await;
            assert!(r.starts_with("HTTP/1.1 400"), "{r}");
            let r = request(addr, "GET /metrics HTTP/1.0\r\n\r\n").await;
            assert!(r.starts_with("HTTP/1.") && r.contains(" 200 OK\r\n"), "HTTP/1.0 client: {r}");
            let r = request(addr, "GET /healthz?x=1 HTTP/1.1\nConnection: close\n\n").await;
            assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("ok\n"), "query string, bare newlines: {r}");
            let r = request(addr, "HEAD /metrics HTTP/1.1\r\nConnection: close\r\n\r\n").await;
            assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("\r\n\r\n"), "HEAD has no body: {r}");
            // Exactly a full buffer and no end of head (all of it read: no reset).
            let prefix = "GET /metrics HTTP/1.1\r\nX: ";
            let long = format!("{prefix}{}", "a".repeat(MAX_HEAD - prefix.len()));
            let r = request(addr, &long).await;
            assert!(r.starts_with("HTTP/1.1 431"), "{r}");
            // Still serving after the bad request.
            let r = request(addr, &get("/metrics")).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        });
    }

    /// Many clients that open a connection and send nothing, and slow ones that send a
    /// byte of a request head every second, hold no slot `/healthz` needs: a new probe
    /// is answered within a second while they hold on, and the server closes them at
    /// its deadline for a request head.
    /// A flood of new connections (a thousand clients reconnecting) is accepted in a
    /// burst before any connection's task has run: a probe whose request is already
    /// sent must not be the "oldest not being answered" that a newcomer closes. Here 32
    /// silent clients, then the probe, then 48 more silent ones are all connected
    /// before the server accepts the first.
    #[test]
    fn a_sent_request_is_not_closed_for_a_burst_of_newcomers() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let m = calm_metrics();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let silent: Vec<_> = (0..MAX_CONNECTIONS).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        let mut probe = std::net::TcpStream::connect(addr).unwrap();
        probe.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let more: Vec<_> = (0..48).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        probe.set_nonblocking(true).unwrap();
        let r = rt.block_on(async {
            listener.set_nonblocking(true).unwrap();
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tokio::spawn(serve(listener, m, ages(Duration::from_secs(60))));
            let mut probe = tokio::net::TcpStream::from_std(probe).unwrap();
            let mut out = String::new();
            let read = tokio::time::timeout(Duration::from_secs(2), probe.read_to_string(&mut out)).await;
            (read.map(|r| r.map_err(|e| e.to_string())), out)
        });
        assert!(matches!(r.0, Ok(Ok(_))) && r.1.starts_with("HTTP/1.1 200"), "the probe was not answered: {r:?}");
        drop((silent, more));
    }

    /// A real client sends its request right after connecting, but on a loaded host
    /// "right after" can be milliseconds, in which a thousand reconnecting clients are
    /// accepted. Here a probe connects and stays silent while 100 newcomers (more than
    /// [`MAX_CONNECTIONS`]) connect and are accepted; then it sends, and is answered.
    /// Past [`MAX_WAITING`] silent newcomers, the oldest waiters are the ones closed.
    #[test]
    fn a_probe_slow_to_send_is_not_closed_for_newcomers_and_the_oldest_waiters_are() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m = calm_metrics();
            let addr = listening(m);
            let healthz = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            let mut probe = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut silent = Vec::new();
            for _ in 0..100 {
                silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            // Connections are accepted in order, each given its slot as it is: once a
            // later one is answered, all 100 were in before the probe sends.
            let r = request(addr, healthz).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            probe.write_all(healthz.as_bytes()).await.unwrap();
            let mut out = String::new();
            let read = tokio::time::timeout(Duration::from_secs(2), probe.read_to_string(&mut out)).await;
            assert!(
                matches!(read, Ok(Ok(_))) && out.starts_with("HTTP/1.1 200"),
                "the probe was closed for newcomers: {read:?} {out:?}"
            );

            // Past the waiting cap: the oldest silent ones are closed, long before the
            // deadline for a head.
            for _ in 0..MAX_WAITING {
                silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            let r = request(addr, healthz).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            let t0 = std::time::Instant::now();
            for (i, s) in silent.iter_mut().take(10).enumerate() {
                let mut b = [0u8; 16];
                let r = tokio::time::timeout(HEAD_DEADLINE / 2, s.read(&mut b)).await;
                assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "waiter {i} still open past the cap: {r:?}");
            }
            eprintln!("the oldest waiters were closed within {:?} of the cap", t0.elapsed());
        });
    }

    /// A client that sends part of a head and closes its side leaves its socket
    /// readable for good: the listener closes it at once and goes on serving (a wait
    /// that took the hang-up for "more bytes" would spin on the runtime's one thread,
    /// and nothing else would run). A whole head sent before the close is answered.
    #[test]
    fn a_client_that_closes_after_part_of_a_head_is_closed_and_serving_goes_on() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m = calm_metrics();
            // The listener on a thread of its own, as in watch: if it spun, this
            // test's timeouts still fire.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async {
                    tx.send(listening(m)).unwrap();
                    std::future::pending::<()>().await
                })
            });
            let addr = rx.recv().unwrap();
            let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
            half.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
            half.shutdown().await.unwrap();
            let mut b = [0u8; 16];
            let r = tokio::time::timeout(HEAD_DEADLINE / 2, half.read(&mut b)).await;
            assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "a half-closed partial head is still open: {r:?}");
            let healthz = "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
            let r = tokio::time::timeout(Duration::from_secs(2), request(addr, healthz)).await;
            assert!(matches!(&r, Ok(r) if r.starts_with("HTTP/1.1 200")), "serving stopped: {r:?}");

            let mut whole = tokio::net::TcpStream::connect(addr).await.unwrap();
            whole.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
            whole.shutdown().await.unwrap();
            let mut out = String::new();
            let r = tokio::time::timeout(Duration::from_secs(2), whole.read_to_string(&mut out)).await;
            assert!(matches!(r, Ok(Ok(_))) && out.starts_with("HTTP/1.1 200"), "{r:?} {out:?}");
        });
    }

    #[test]
    fn idle_and_slow_clients_do_not_stop_healthz() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const IDLE: usize = 64;
        const SLOW: usize = MAX_CONNECTIONS + 16;
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m = calm_metrics();
            let addr = listening(m);
            let opened = std::time::Instant::now();
            let mut idle = Vec::new();
            for _ in 0..IDLE {
                idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
            }
            // Slow clients: a byte of a request head a second, never the end of it.
            let (slow_closed_tx, mut slow_closed) = tokio::sync::mpsc::unbounded_channel();
            for _ in 0..SLOW {
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                let tx = slow_closed_tx.clone();
                tokio::spawn(async move {
                    let start = std::time::Instant::now();
                    for b in b"GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter().cycle()
                    {
                        if s.write_all(std::slice::from_ref(b)).await.is_err() {
                            break;
                        }
                        // The client's pace, not a wait for an event.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    let _ = tx.send(start.elapsed());
                });
            }
            drop(slow_closed_tx);
            // Probes while all of them hold on.
            let mut took = Vec::new();
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                let probe = async {
                    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
                    let mut out = String::new();
                    s.read_to_string(&mut out).await.unwrap();
                    out
                };
                let r = tokio::time::timeout(Duration::from_secs(1), probe).await.unwrap_or_else(|_| {
                    panic!("/healthz not answered within 1 s, {IDLE} idle and {SLOW} slow clients open")
                });
                assert!(r.starts_with("HTTP/1.1 200") && r.ends_with("ok\n"), "{r}");
                took.push(t0.elapsed());
            }
            eprintln!("/healthz with {IDLE} idle and {SLOW} slow clients: {took:?}");
            // The idle ones are closed by the server (EOF or a reset), at its deadline.
            for (i, mut s) in idle.into_iter().enumerate() {
                let mut b = [0u8; 64];
                let r = tokio::time::timeout(Duration::from_secs(15), s.read(&mut b)).await;
                assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "idle client {i} still open: {r:?}");
            }
            eprintln!("the idle clients were closed within {:?}", opened.elapsed());
            for _ in 0..SLOW {
                let held = tokio::time::timeout(Duration::from_secs(15), slow_closed.recv()).await.unwrap().unwrap();
                assert!(held < Duration::from_secs(12), "a slow client held on for {held:?}");
            }
        });
    }

    /// Keep-alive, as Prometheus scrapes, but bounded: a connection left idle after
    /// its answers is closed at the deadline for the next request head.
    #[test]
    fn a_kept_alive_connection_is_closed_when_left_idle() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let m = calm_metrics();
            let addr = listening(m);
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut got = Vec::new();
            for n in 1..=2 {
                s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
                while got.windows(3).filter(|w| *w == b"ok\n").count() < n {
                    let mut b = [0u8; 512];
                    let k = s.read(&mut b).await.unwrap();
                    assert!(k > 0, "closed after {n} requests: {}", String::from_utf8_lossy(&got));
                    got.extend_from_slice(&b[..k]);
                }
            }
            let idle = std::time::Instant::now();
            let mut b = [0u8; 64];
            let r = tokio::time::timeout(HEAD_DEADLINE + Duration::from_secs(3), s.read(&mut b)).await;
            assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "still open after {:?} idle: {r:?}", idle.elapsed());
            eprintln!("an idle kept-alive connection closed after {:?}", idle.elapsed());
        });
    }

    #[test]
    fn a_busy_address_names_the_key() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let e = format!("{:#}", bind(addr).unwrap_err());
        assert!(e.contains(&format!("metrics.listen = \"{addr}\": cannot listen")), "{e}");
    }
}
