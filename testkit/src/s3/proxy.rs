//! An HTTP proxy on a free loopback port in front of an [`S3Server`], which injects the faults a
//! test asks for through its [`Faults`] hook.
//!
//! The proxy owns the listener, the accept loop, the client to the server and the forwarding of
//! every request and answer (bodies streamed both ways); the hook sees each request and may answer
//! it instead ([`Faults::answer`]), change the body sent on ([`Faults::request_body`]) or change
//! the server's answer ([`Faults::response`]). [`paced`] limits a body's rate and [`s3_error`]
//! builds an S3 error answer, for hooks to use.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::request::Parts;
use http_body_util::{combinators::BoxBody, BodyExt, BodyStream, Full, StreamBody};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};

use super::S3Server;

/// The error of a body that passes through the proxy.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request or answer body as the proxy and its hook handle it.
pub type Body = BoxBody<Bytes, BoxError>;

/// What a test does to the traffic through its [`Proxy`]; each method sees the client's request
/// (method, URI, headers) as it came. The defaults forward everything unchanged.
pub trait Faults: Send + Sync + 'static {
    /// An answer to send instead of forwarding the request (an injected error); `None` forwards it.
    fn answer(&self, _req: &Parts) -> Option<Response<Body>> {
        None
    }

    /// The request body as sent to the server (slowed down, say); the body may keep the state
    /// (`self`) to update it as bytes pass.
    fn request_body(self: &Arc<Self>, _req: &Parts, body: Body) -> Body {
        body
    }

    /// The server's answer as returned to the client (headers rewritten, body slowed down,
    /// counted or corrupted); the body may keep the state (`self`) to update it as bytes pass.
    fn response(self: &Arc<Self>, _req: &Parts, resp: Response<Body>) -> Response<Body> {
        resp
    }
}

/// A running proxy in front of one server; its accept loop stops on drop.
pub struct Proxy<F> {
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    /// The test's fault state, shared with the hook: set faults and read counters through it.
    pub state: Arc<F>,
    task: tokio::task::JoinHandle<()>,
}

impl<F: Faults> Proxy<F> {
    /// Listen on a free loopback port and forward to `upstream`, with `state` as the hook.
    pub async fn start(upstream: &S3Server, state: F) -> Proxy<F> {
        let state = Arc::new(state);
        let upstream = upstream.addr;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client: Client<HttpConnector, Body> =
            Client::builder(TokioExecutor::new()).build_http();
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let (st, client) = (st.clone(), client.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        forward(upstream, st.clone(), client.clone(), req)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        Proxy { addr, state, task }
    }

    /// The URL clients use (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl<F> Drop for Proxy<F> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One request: answered by the hook, or sent to `upstream` and its answer passed back.
async fn forward<F: Faults>(
    upstream: SocketAddr,
    faults: Arc<F>,
    client: Client<HttpConnector, Body>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    if let Some(answer) = faults.answer(&parts) {
        return Ok(answer);
    }
    let body = faults.request_body(&parts, boxed(body));
    let mut sent = parts.clone();
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    sent.uri = format!("http://{upstream}{pq}").parse().unwrap();
    let resp = match client.request(Request::from_parts(sent, body)).await {
        Ok(r) => r.map(boxed),
        Err(e) => return Ok(s3_error(502, &format!("ProxyError {e}"))),
    };
    Ok(faults.response(&parts, resp))
}

fn boxed(body: Incoming) -> Body {
    body.map_err(|e| Box::new(e) as BoxError).boxed()
}

/// An S3 error answer (`<Error><Code>code</Code>…`) with `status`, as the proxy injects it.
pub fn s3_error(status: u16, code: &str) -> Response<Body> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
    );
    Response::builder()
        .status(status)
        .header("content-type", "application/xml")
        .body(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed())
        .unwrap()
}

/// `body` passed on at no more than `bytes_per_s` bytes per second from now (0: as it comes);
/// each frame waits until the bytes up to its end are due.
pub fn paced(body: Body, bytes_per_s: u64) -> Body {
    let started = Instant::now();
    let mut seen = 0u64;
    let stream = BodyStream::new(body).then(move |frame| {
        let len = frame
            .as_ref()
            .ok()
            .and_then(|f| f.data_ref())
            .map_or(0, |d| d.len() as u64);
        seen += len;
        let due = (bytes_per_s > 0)
            .then(|| started + Duration::from_secs_f64(seen as f64 / bytes_per_s as f64));
        async move {
            if let Some(due) = due {
                tokio::time::sleep_until(due.into()).await;
            }
            frame
        }
    });
    BodyExt::boxed(StreamBody::new(stream))
}
