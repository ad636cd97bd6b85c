//! The few Docker Engine API calls the actuator needs, as plain HTTP/1.1 over the
//! engine's unix socket (hyper, already in the build through kube): inspect a
//! container, restart it, run a command in it and read its output.
//!
//! Paths carry no API version, so the engine answers at its own version; the fields
//! read here (`Id`, `State.Running`, `State.Status`, `State.StartedAt`, `ExitCode`)
//! have been stable since API 1.25.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context};
use hyper::body::Bytes;
use hyper::Method;
use serde::Deserialize;

use super::http::round_trip;

/// How long one call other than a restart may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long reaching the engine's socket may take for a restart. The request is
/// written at once after (a few bytes on a local socket) and the engine acts on it as
/// it reads it, so this bounds the restart's request for the Lease
/// (`restart::Request::timeout`); its answer comes after the stop and the start.
pub const RESTART_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Engine {
    socket: PathBuf,
}

/// What the actuator needs of `GET /containers/{name}/json`.
#[derive(Debug, Clone)]
pub struct Container {
    pub id: String,
    pub running: bool,
    /// `created`, `running`, `restarting`, `exited`, ...
    pub status: String,
    pub started_at: SystemTime,
}

#[derive(Debug)]
pub struct ExecOutput {
    pub exit_code: i64,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Engine {
    pub fn new(socket: &Path) -> Engine {
        Engine { socket: socket.to_path_buf() }
    }

    pub async fn inspect(&self, name: &str) -> anyhow::Result<Container> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Inspect {
            id: String,
            state: State,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct State {
            running: bool,
            status: String,
            started_at: String,
        }
        let body = self.call(Method::GET, &format!("/containers/{name}/json"), None, CALL_TIMEOUT).await?;
        let i: Inspect = self.json(&body, &format!("GET /containers/{name}/json"))?;
        let started_at = parse_time(&i.state.started_at)
            .with_context(|| format!("container {name}: State.StartedAt {:?}", i.state.started_at))?;
        Ok(Container { id: i.id, running: i.state.running, status: i.state.status, started_at })
    }

    /// `POST /containers/{id}/restart?t=...`: stops the container (SIGTERM, then SIGKILL
    /// after `stop_timeout`) and starts the same container again. `Err`: the request
    /// never reached the engine (its socket not reached within
    /// [`RESTART_CONNECT_TIMEOUT`]): nothing was restarted. `Ok(answer)`: it did;
    /// `answer` is the engine's, once the container is started again.
    pub async fn restart(&self, id: &str, stop_timeout: Duration) -> anyhow::Result<anyhow::Result<()>> {
        let t = stop_timeout.as_secs() + u64::from(stop_timeout.subsec_nanos() > 0);
        let path = format!("/containers/{id}/restart?t={t}");
        let stream = tokio::time::timeout(RESTART_CONNECT_TIMEOUT, tokio::net::UnixStream::connect(&self.socket))
            .await
            .map_err(|_| anyhow::anyhow!("not reached within {} s", RESTART_CONNECT_TIMEOUT.as_secs()))
            .and_then(|r| r.context("connecting"))
            .with_context(|| format!("{}: POST {path}", self.endpoint()))?;
        // The engine answers only after the stop and the start: allow for both.
        let limit = stop_timeout + Duration::from_secs(60);
        Ok(self.exchange(async { Ok(stream) }, Method::POST, &path, None, limit).await.map(|_| ()))
    }

    /// Runs `cmd` in the running container `id` and returns its exit code and output.
    pub async fn exec(&self, id: &str, cmd: &[&str]) -> anyhow::Result<ExecOutput> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Created {
            id: String,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Inspect {
            running: bool,
            exit_code: Option<i64>,
        }
        let create = serde_json::json!({ "AttachStdout": true, "AttachStderr": true, "Tty": false, "Cmd": cmd });
        let path = format!("/containers/{id}/exec");
        let body = self.call(Method::POST, &path, Some(create), CALL_TIMEOUT).await?;
        let exec: Created = self.json(&body, &format!("POST {path}"))?;
        // Without `Detach`, the engine streams the output on this connection and closes
        // it when the command has ended; without a TTY the stream is multiplexed.
        let start = format!("/exec/{}/start", exec.id);
        let stream = self
            .call(Method::POST, &start, Some(serde_json::json!({ "Detach": false, "Tty": false })), CALL_TIMEOUT)
            .await?;
        let (stdout, stderr) = demultiplex(&stream).with_context(|| format!("{}: POST {start}", self.endpoint()))?;
        // The exit code is set a moment after the stream ends.
        let inspect = format!("/exec/{}/json", exec.id);
        for _ in 0..50 {
            let body = self.call(Method::GET, &inspect, None, CALL_TIMEOUT).await?;
            let state: Inspect = self.json(&body, &format!("GET {inspect}"))?;
            if let (false, Some(exit_code)) = (state.running, state.exit_code) {
                return Ok(ExecOutput { exit_code, stdout, stderr });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!("{}: GET {inspect}: {cmd:?} in container {id} has not exited 5 s after its output ended", self.endpoint())
    }

    fn endpoint(&self) -> String {
        format!("Docker Engine API at unix://{}", self.socket.display())
    }

    fn json<T: for<'a> Deserialize<'a>>(&self, body: &[u8], what: &str) -> anyhow::Result<T> {
        serde_json::from_slice(body).with_context(|| format!("{}: {what}: unexpected answer", self.endpoint()))
    }

    /// One request on a fresh connection. A non-2xx answer is an error carrying the
    /// engine's message (`{"message": ...}`).
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        limit: Duration,
    ) -> anyhow::Result<Bytes> {
        let connect = async { tokio::net::UnixStream::connect(&self.socket).await.context("connecting") };
        self.exchange(connect, method, path, body, limit).await
    }

    /// One request on the connection `connect` makes, within `limit`.
    async fn exchange(
        &self,
        connect: impl std::future::Future<Output = anyhow::Result<tokio::net::UnixStream>>,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        limit: Duration,
    ) -> anyhow::Result<Bytes> {
        let what = format!("{}: {method} {path}", self.endpoint());
        let exchange = async { round_trip(connect.await?, method, "docker", path, body.as_ref()).await };
        let (status, bytes) = tokio::time::timeout(limit, exchange)
            .await
            .map_err(|_| anyhow::anyhow!("no answer within {} s", limit.as_secs()))
            .and_then(|r| r)
            .with_context(|| what.clone())?;
        if !status.is_success() {
            #[derive(Deserialize)]
            struct Message {
                message: String,
            }
            let msg = serde_json::from_slice::<Message>(&bytes)
                .map(|m| m.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).trim().to_string());
            bail!("{what}: {status}: {msg}");
        }
        Ok(bytes)
    }
}

/// Splits the engine's multiplexed stream: frames of an 8-byte header (stream 1 =
/// stdout, 2 = stderr; bytes 4..8 the big-endian length) and the payload.
fn demultiplex(mut stream: &[u8]) -> anyhow::Result<(Vec<u8>, Vec<u8>)> {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while !stream.is_empty() {
        if stream.len() < 8 {
            bail!("output stream ends inside a frame header");
        }
        let len = u32::from_be_bytes([stream[4], stream[5], stream[6], stream[7]]) as usize;
        let payload = stream.get(8..8 + len).context("output stream ends inside a frame")?;
        match stream[0] {
            2 => err.extend_from_slice(payload),
            _ => out.extend_from_slice(payload),
        }
        stream = &stream[8 + len..];
    }
    Ok((out, err))
}

/// The engine's RFC 3339 times (`2024-05-01T10:00:00.123456789Z`).
fn parse_time(s: &str) -> anyhow::Result<SystemTime> {
    let ts: k8s_openapi::jiff::Timestamp = s.parse()?;
    Ok(SystemTime::from(ts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_split_by_stream() {
        let mut s = vec![1, 0, 0, 0, 0, 0, 0, 3];
        s.extend_from_slice(b"etc");
        s.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 4]);
        s.extend_from_slice(b"oops");
        s.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 5]);
        s.extend_from_slice(b"d-onl");
        let (out, err) = demultiplex(&s).unwrap();
        assert_eq!(out, b"etcd-onl");
        assert_eq!(err, b"oops");
        assert!(demultiplex(&s[..s.len() - 1]).is_err());
        assert!(demultiplex(&s[..5]).is_err());
    }

    #[test]
    fn engine_times_parse() {
        let t = parse_time("2024-05-01T10:00:00.5Z").unwrap();
        let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs_f64();
        assert_eq!(secs, 1_714_557_600.5);
        assert!(parse_time("yesterday").is_err());
    }
}
