//! One HTTP/1.1 request on a fresh connection (unix socket or TCP), with hyper: all
//! the Docker actuator needs to talk to the engine.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// Sends one request on `io` and reads the whole answer. `host` is the Host header.
pub async fn round_trip<IO>(
    io: IO,
    method: Method,
    host: &str,
    path: &str,
    json: Option<&serde_json::Value>,
) -> anyhow::Result<(StatusCode, Bytes)>
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let driver = tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path).header(hyper::header::HOST, host);
    let body = match json {
        Some(v) => {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
            Bytes::from(serde_json::to_vec(v)?)
        }
        None => Bytes::new(),
    };
    let resp = sender.send_request(req.body(Full::new(body))?).await?;
    let status = resp.status();
    // An answer without a length (the engine's exec stream) ends when the peer closes.
    let bytes = resp.into_body().collect().await?.to_bytes();
    drop(sender);
    driver.abort();
    Ok((status, bytes))
}
