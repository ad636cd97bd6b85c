//! Waiting for etcd's health endpoint (k3s serves `http://127.0.0.1:2381/health`
//! without TLS) after a restart.

use std::time::Duration;

use anyhow::{bail, Context};
use hyper::{Method, Uri};
use tokio::time::Instant;

use super::http::round_trip;

/// How long one probe may take, and the pause between probes.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const PROBE_EVERY: Duration = Duration::from_millis(500);

/// An `http://host:port/path` URL, checked when the configuration is loaded.
#[derive(Clone, Debug)]
pub struct HealthUrl {
    text: String,
    authority: String,
    path: String,
}

impl HealthUrl {
    pub fn parse(text: &str) -> anyhow::Result<HealthUrl> {
        let uri: Uri = text.parse().context("not a URL")?;
        if uri.scheme_str() != Some("http") {
            bail!("must be an http:// URL (k3s serves etcd's health without TLS)");
        }
        let authority = uri.authority().context("names no host")?;
        if authority.port_u16().is_none() {
            bail!("names no port (k3s serves it on 2381)");
        }
        let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        Ok(HealthUrl { text: text.to_string(), authority: authority.to_string(), path })
    }
}

impl std::fmt::Display for HealthUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// One probe: healthy is HTTP 200 with `{"health":"true"}`.
async fn probe(url: &HealthUrl) -> anyhow::Result<()> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(&url.authority).await?;
        round_trip(stream, Method::GET, &url.authority, &url.path, None).await
    };
    let (status, body) = tokio::time::timeout(PROBE_TIMEOUT, exchange).await.context("no answer within 2 s")??;
    let healthy = status.is_success()
        && serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v.get("health").cloned())
            == Some(serde_json::Value::from("true"));
    if !healthy {
        bail!("{status}: {}", String::from_utf8_lossy(&body).trim());
    }
    Ok(())
}

/// Probes `url` until it is healthy or `deadline` passes.
pub async fn wait_healthy(url: &HealthUrl, deadline: Instant, timeout: Duration) -> anyhow::Result<()> {
    loop {
        let last = match probe(url).await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if Instant::now() + PROBE_EVERY >= deadline {
            bail!("etcd at {url} was not healthy within {} s (last answer: {last:#})", timeout.as_secs());
        }
        tokio::time::sleep(PROBE_EVERY).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        let u = HealthUrl::parse("http://127.0.0.1:2381/health").unwrap();
        assert_eq!((u.authority.as_str(), u.path.as_str()), ("127.0.0.1:2381", "/health"));
        assert!(HealthUrl::parse("https://127.0.0.1:2381/health").is_err());
        assert!(HealthUrl::parse("http://127.0.0.1/health").is_err());
        assert!(HealthUrl::parse("127.0.0.1:2381").is_err());
    }
}
