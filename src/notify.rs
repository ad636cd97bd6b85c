//! Talking to systemd (`Type=notify`): READY once the first sample is good, STATUS with
//! the level and the pressure, WATCHDOG pings. The per-sample messages go through a
//! socket opened once and a stack buffer, so a sample allocates nothing; the `sd-notify`
//! crate handles the once-only messages and reads the watchdog interval.

use std::io::Write;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

pub struct Notifier {
    socket: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
}

impl Notifier {
    pub fn from_env() -> Notifier {
        let socket = std::env::var_os("NOTIFY_SOCKET").and_then(|path| {
            let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
            let addr = match bytes.strip_prefix(b"@") {
                Some(name) => SocketAddr::from_abstract_name(name).ok()?,
                None => SocketAddr::from_pathname(&path).ok()?,
            };
            let sock = UnixDatagram::unbound().ok()?;
            // Never block the watcher on a busy service manager: a dropped STATUS or
            // ping is better than a watcher stuck in sendto.
            sock.set_nonblocking(true).ok()?;
            Some((sock, addr))
        });
        Notifier { socket, watchdog: sd_notify::watchdog_enabled() }
    }

    /// How often to ping: half the interval systemd asked for.
    pub fn watchdog_period(&self) -> Option<Duration> {
        self.watchdog.map(|d| d / 2)
    }

    pub fn ready(&self) {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    }

    pub fn stopping(&self) {
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
    }

    pub fn watchdog(&self) {
        self.send(format_args!("WATCHDOG=1"));
    }

    /// Drives `fut` to its end, pinging the watchdog every period meanwhile, for at
    /// most `within`: a step (a restart) or an API call tried at every endpoint can
    /// outlast WatchdogSec, but each is bounded, and one that runs past its bound
    /// has stopped making progress. Then the pings stop, so systemd ends a regrade
    /// stuck for good and the next start finishes from the level record.
    pub async fn pinging<F: std::future::Future>(&self, within: Duration, fut: F) -> F::Output {
        let Some(period) = self.watchdog_period() else { return fut.await };
        tokio::pin!(fut);
        let mut pings = tokio::time::interval(period);
        let until = tokio::time::Instant::now() + within;
        loop {
            tokio::select! {
                biased;
                out = &mut fut => return out,
                _ = pings.tick() => self.watchdog(),
                _ = tokio::time::sleep_until(until) => {}
            }
            if tokio::time::Instant::now() >= until {
                tracing::error!(within = ?within, "still not done past its bound: no more watchdog pings");
                return fut.await;
            }
        }
    }

    /// `STATUS=...`, formatted into a stack buffer (truncated past 256 bytes).
    pub fn status(&self, args: std::fmt::Arguments<'_>) {
        self.send(format_args!("STATUS={args}"));
    }

    fn send(&self, args: std::fmt::Arguments<'_>) {
        let Some((sock, addr)) = &self.socket else { return };
        let mut buf = [0u8; 256];
        let mut cur = std::io::Cursor::new(&mut buf[..]);
        let _ = cur.write_fmt(args);
        let n = cur.position() as usize;
        let _ = sock.send_to_addr(&buf[..n], addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_status_to_the_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        let n = Notifier {
            socket: Some((UnixDatagram::unbound().unwrap(), SocketAddr::from_pathname(&path).unwrap())),
            watchdog: Some(Duration::from_secs(30)),
        };
        n.status(format_args!("level full, pressure {:.2}%", 12.345));
        n.watchdog();
        let mut buf = [0u8; 300];
        let k = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..k], b"STATUS=level full, pressure 12.35%");
        let k = server.recv(&mut buf).unwrap();
        assert_eq!(&buf[..k], b"WATCHDOG=1");
        assert_eq!(n.watchdog_period(), Some(Duration::from_secs(15)));
    }

    #[test]
    fn a_long_call_is_pinged_through() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).unwrap();
        server.set_nonblocking(true).unwrap();
        let n = Notifier {
            socket: Some((UnixDatagram::unbound().unwrap(), SocketAddr::from_pathname(&path).unwrap())),
            watchdog: Some(Duration::from_secs(30)),
        };
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        let call = |secs| async move {
            tokio::time::sleep(Duration::from_secs(secs)).await;
            7
        };
        let pings = || {
            let mut buf = [0u8; 64];
            let mut pings = 0;
            while let Ok(k) = server.recv(&mut buf) {
                assert_eq!(&buf[..k], b"WATCHDOG=1");
                pings += 1;
            }
            pings
        };
        assert_eq!(rt.block_on(n.pinging(Duration::from_secs(600), call(40))), 7);
        assert_eq!(pings(), 3, "at 0, 15 and 30 s of a 40 s call");
        // Past its bound a call is stuck: no pings after 50 s of a 200 s call.
        assert_eq!(rt.block_on(n.pinging(Duration::from_secs(50), call(200))), 7);
        assert_eq!(pings(), 4, "at 0, 15, 30 and 45 s only");
    }
}
