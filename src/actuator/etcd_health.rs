//! etcd's health endpoint, which k3s serves without TLS (`http://127.0.0.1:2381/health`):
//! one plain HTTP/1.0 GET over a TCP stream, so no HTTP client crate is needed. Both
//! actuators wait on it after restarting k3s.

use std::time::Duration;

use anyhow::{bail, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One attempt may take this long before it counts as unhealthy.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// An `http://host:port/path` URL, the only form etcd's health endpoint takes here.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthUrl {
    authority: String,
    path: String,
}

impl HealthUrl {
    /// Parses `url`, the value of the config key `key` (named in errors).
    pub fn parse(key: &str, url: &str) -> anyhow::Result<HealthUrl> {
        let Some(rest) = url.strip_prefix("http://") else {
            bail!("{key} = {url:?} must start with http:// (k3s serves etcd's health without TLS)");
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let has_port = authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok());
        if authority.is_empty() || !has_port {
            bail!("{key} = {url:?} must name a host and a port, e.g. http://127.0.0.1:2381/health");
        }
        Ok(HealthUrl { authority: authority.to_string(), path: path.to_string() })
    }

    /// Ok when etcd answers 200 with `"health":"true"`; otherwise what it said.
    pub async fn check(&self) -> anyhow::Result<()> {
        tokio::time::timeout(ATTEMPT_TIMEOUT, self.get())
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {ATTEMPT_TIMEOUT:?}"))?
    }

    async fn get(&self) -> anyhow::Result<()> {
        let (status, body) = self.fetch(&self.path, 64 * 1024).await?;
        let body = String::from_utf8_lossy(&body);
        let healthy = body.replace(' ', "").contains("\"health\":\"true\"");
        if status.split_whitespace().nth(1) == Some("200") && healthy {
            Ok(())
        } else {
            bail!("answered {:?}: {}", status, body.trim())
        }
    }

    /// One GET of `path` on this URL's host and port, unbounded in time (the caller
    /// bounds it): the status line and at most `limit` bytes of the body. Also how
    /// `etcd::member` reads the same listener's `/metrics`.
    pub async fn fetch(&self, path: &str, limit: u64) -> anyhow::Result<(String, Vec<u8>)> {
        let mut s = TcpStream::connect(&self.authority).await.context("connecting")?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.authority);
        s.write_all(req.as_bytes()).await.context("sending the request")?;
        let mut buf = Vec::new();
        s.take(limit).read_to_end(&mut buf).await.context("reading the answer")?;
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            bail!("answered no complete HTTP head");
        };
        let status = String::from_utf8_lossy(&buf[..end]).lines().next().unwrap_or("").to_string();
        buf.drain(..end + 4);
        Ok((status, buf))
    }

    /// The same host and port with another path (etcd serves `/health` and
    /// `/metrics` on its metrics listener).
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// How often [`HealthUrl::wait`] asks.
const PROBE_EVERY: Duration = Duration::from_millis(500);

impl HealthUrl {
    /// Asks until etcd is healthy or `deadline` passes; the error names `budget` (the
    /// setting that gave the deadline, e.g. `docker.health_timeout = 5m`) and gives the
    /// last answer.
    pub async fn wait(&self, deadline: tokio::time::Instant, budget: &str) -> anyhow::Result<()> {
        loop {
            let last = match self.check().await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if tokio::time::Instant::now() + PROBE_EVERY >= deadline {
                bail!("etcd at {self} was not healthy within {budget} (last answer: {last:#})");
            }
            tokio::time::sleep(PROBE_EVERY).await;
        }
    }
}

impl std::fmt::Display for HealthUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}{}", self.authority, self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[test]
    fn urls_need_http_a_host_and_a_port() {
        let k = "systemd.etcd_health_url";
        let u = HealthUrl::parse(k, "http://127.0.0.1:2381/health").unwrap();
        assert_eq!(u.to_string(), "http://127.0.0.1:2381/health");
        assert!(format!("{:#}", HealthUrl::parse(k, "https://127.0.0.1:2381/health").unwrap_err()).contains(k));
        assert!(HealthUrl::parse(k, "http://127.0.0.1/health").is_err());
        assert!(HealthUrl::parse(k, "127.0.0.1:2381").is_err());
    }

    async fn serve_once(answer: &'static str) -> HealthUrl {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            s.write_all(answer.as_bytes()).await.unwrap();
        });
        HealthUrl::parse("test", &format!("http://{addr}/health")).unwrap()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn healthy_only_on_200_with_health_true() {
        let ok = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{\"health\":\"true\",\"reason\":\"\"}";
        serve_once(ok).await.check().await.unwrap();
        let bad = "HTTP/1.1 503 Service Unavailable\r\n\r\n{\"health\":\"false\",\"reason\":\"delay\"}";
        let e = format!("{:#}", serve_once(bad).await.check().await.unwrap_err());
        assert!(e.contains("503") && e.contains("delay"), "{e}");
        let lying = "HTTP/1.1 200 OK\r\n\r\n{\"health\":\"false\"}";
        assert!(serve_once(lying).await.check().await.is_err());
        let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
        let e = format!("{:#}", serve_once(bad).await.wait(deadline, "x.health_timeout = 1s").await.unwrap_err());
        assert!(e.contains("not healthy within x.health_timeout = 1s") && e.contains("503"), "{e}");
    }
}
