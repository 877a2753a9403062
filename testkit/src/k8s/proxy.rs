//! A loopback fault proxy in front of the real API server: what the server does not do by
//! itself, on demand, per request kind.
//!
//! HTTPS on `127.0.0.1:0` towards the client (the API server's own serving certificate, so
//! clients trust it through the same test CA; client-go sends no bearer token over plain HTTP)
//! and towards the API server; the client's own `Authorization` goes through unchanged, so RBAC
//! applies to the identity the client holds. Bodies stream both ways (watches stay open through
//! it).
//!
//! Knobs: latency on every request ([`FaultProxy::set_latency`]); per [`RequestKind`] a delay,
//! a blackhole (accept, never answer) or an error status ([`FaultProxy::set_fault`]); the next
//! `n` requests of a kind answered with an error status without reaching the server
//! ([`FaultProxy::fail_next`]); every request to one method + path refused
//! ([`FaultProxy::refuse`]). Inspection: the request log ([`FaultProxy::requests`]), the number
//! of mutating requests and the latency added.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde_json::{json, Value};

use super::controlplane::{ControlPlane, Identity};

/// Which kind of request a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// `GET` of a pod collection (not a watch).
    PodList,
    /// `GET` of a pod collection with `watch=true`.
    PodWatch,
    /// `GET` of one pod.
    PodGet,
    /// `DELETE` of a pod.
    PodDelete,
    /// `POST …/pods/NAME/eviction`.
    Eviction,
    /// `GET` of a node.
    NodeGet,
    /// `PATCH` / `PUT` of a node or its status.
    NodeWrite,
    /// `POST` of an Event (either API).
    EventCreate,
    /// `PATCH` / `PUT` of an Event (either API).
    EventPatch,
    /// Anything else (discovery, PDBs, …).
    Other,
}

impl RequestKind {
    /// Classify a request by method, path and query.
    pub fn of(method: &str, path: &str, query: &str) -> RequestKind {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        let watch = query
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1");
        match (method, segs.as_slice()) {
            ("GET", ["api", "v1", "pods"]) | ("GET", ["api", "v1", "namespaces", _, "pods"]) => {
                if watch {
                    RequestKind::PodWatch
                } else {
                    RequestKind::PodList
                }
            }
            ("GET", ["api", "v1", "namespaces", _, "pods", _]) => RequestKind::PodGet,
            ("DELETE", ["api", "v1", "namespaces", _, "pods", _]) => RequestKind::PodDelete,
            ("POST", ["api", "v1", "namespaces", _, "pods", _, "eviction"]) => {
                RequestKind::Eviction
            }
            ("GET", ["api", "v1", "nodes", ..]) => RequestKind::NodeGet,
            ("PATCH" | "PUT", ["api", "v1", "nodes", ..]) => RequestKind::NodeWrite,
            ("POST", ["api", "v1", "namespaces", _, "events"])
            | ("POST", ["apis", "events.k8s.io", "v1", "namespaces", _, "events"]) => {
                RequestKind::EventCreate
            }
            ("PATCH" | "PUT", ["api", "v1", "namespaces", _, "events", _])
            | ("PATCH" | "PUT", ["apis", "events.k8s.io", "v1", "namespaces", _, "events", _]) => {
                RequestKind::EventPatch
            }
            _ => RequestKind::Other,
        }
    }

    /// Both Event kinds.
    pub fn is_event(self) -> bool {
        matches!(self, RequestKind::EventCreate | RequestKind::EventPatch)
    }
}

/// What to do to the requests of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward after this delay.
    Delay(Duration),
    /// Accept the request and never answer (a silently dropping server or network).
    Blackhole,
    /// Answer with this status (a `Status` body) without forwarding.
    Status(u16),
}

/// One request as received by the proxy.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// Raw query string (percent-encoded), empty when none.
    pub query: String,
    pub content_type: Option<String>,
    pub body: String,
    pub kind: RequestKind,
    /// The status answered (the API server's or an injected one); `None` while pending or
    /// for a blackholed request.
    pub status: Option<u16>,
    /// When the proxy received it.
    pub at: std::time::Instant,
}

impl RecordedRequest {
    /// The body parsed as JSON, if it is.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.body).ok()
    }

    /// A decoded query parameter.
    pub fn query_param(&self, key: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k) == key).then(|| percent_decode(v))
        })
    }

    pub fn is_write(&self) -> bool {
        !matches!(self.method.as_str(), "GET" | "HEAD")
    }
}

fn percent_decode(s: &str) -> String {
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Default)]
struct Knobs {
    latency: Duration,
    /// `None` key: every kind without its own.
    faults: HashMap<Option<RequestKind>, Fault>,
    fail_next: HashMap<RequestKind, VecDeque<u16>>,
    refusals: Vec<(String, String, u16)>,
}

#[derive(Default)]
struct Log {
    requests: Vec<RecordedRequest>,
    writes: u64,
    added: Duration,
}

struct Shared {
    upstream: String,
    http: reqwest::Client,
    knobs: Mutex<Knobs>,
    log: Mutex<Log>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running proxy; it stops when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// A proxy to the shared control plane's API server, on the current tokio runtime.
    pub async fn start(cp: &ControlPlane) -> std::io::Result<FaultProxy> {
        let ca = reqwest::Certificate::from_pem(cp.pki.ca_pem.as_bytes())
            .map_err(std::io::Error::other)?;
        let http = reqwest::Client::builder()
            .add_root_certificate(ca)
            .connect_timeout(Duration::from_secs(5))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(std::io::Error::other)?;
        let tls = tls_acceptor(cp)?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: cp.url(),
            http,
            knobs: Mutex::new(Knobs::default()),
            log: Mutex::new(Log::default()),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let tls = tls.clone();
                let app = app.clone();
                tokio::spawn(async move {
                    let Ok(stream) = tls.accept(tcp).await else {
                        return;
                    };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(FaultProxy { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }

    /// A client through this proxy as `identity`, as spotguard builds its own (kube's retry
    /// layer off).
    pub fn client(&self, cp: &ControlPlane, identity: Identity) -> kube::Client {
        match spotguard::node::kube::client_from_config(cp.config(&self.url(), identity)) {
            Ok(c) => c,
            Err(e) => panic!("kube client through the proxy: {e}"),
        }
    }

    /// A client through the proxy with `token` (a token minted in the test, e.g. pod-bound).
    pub fn client_with_token(&self, cp: &ControlPlane, token: &str) -> kube::Client {
        let mut config = cp.config(&self.url(), Identity::Agent);
        config.auth_info.token = Some(token.to_string().into());
        match spotguard::node::kube::client_from_config(config) {
            Ok(c) => c,
            Err(e) => panic!("kube client through the proxy: {e}"),
        }
    }

    /// Delay every new request by this much before forwarding it.
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.shared.knobs).latency = latency;
    }

    /// Apply `fault` to every new request of `kind` (`None`: of every kind without a fault of
    /// its own); `fault: None` removes it. Requests already in flight are not affected.
    pub fn set_fault(&self, kind: Option<RequestKind>, fault: Option<Fault>) {
        let mut k = lock(&self.shared.knobs);
        match fault {
            Some(f) => {
                k.faults.insert(kind, f);
            }
            None => {
                k.faults.remove(&kind);
            }
        }
    }

    /// Remove every fault (per-kind, global, queued and refusals); latency stays.
    pub fn clear_faults(&self) {
        let mut k = lock(&self.shared.knobs);
        k.faults.clear();
        k.fail_next.clear();
        k.refusals.clear();
    }

    /// Answer the next `n` requests of `kind` with `code` (e.g. 409, 500) without forwarding.
    pub fn fail_next(&self, kind: RequestKind, code: u16, n: usize) {
        lock(&self.shared.knobs)
            .fail_next
            .entry(kind)
            .or_default()
            .extend(std::iter::repeat_n(code, n));
    }

    /// Answer every `method` request to exactly `path` with `code` (e.g. 403).
    pub fn refuse(&self, method: &str, path: &str, code: u16) {
        lock(&self.shared.knobs)
            .refusals
            .push((method.to_string(), path.to_string(), code));
    }

    /// Every request received so far (including refused and blackholed ones).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.log).requests.clone()
    }

    pub fn clear_requests(&self) {
        let mut l = lock(&self.shared.log);
        l.requests.clear();
        l.writes = 0;
    }

    /// Mutating requests (anything but GET / HEAD) received, whatever their outcome.
    pub fn write_count(&self) -> u64 {
        lock(&self.shared.log).writes
    }

    /// Total delay the proxy added (latency and `Delay` faults), summed over requests.
    pub fn added_latency(&self) -> Duration {
        lock(&self.shared.log).added
    }
}

/// TLS with the API server's serving certificate (valid for 127.0.0.1, signed by the test CA).
fn tls_acceptor(cp: &ControlPlane) -> std::io::Result<tokio_rustls::TlsAcceptor> {
    crate::tls::acceptor(&cp.pki.serving_cert, &cp.pki.serving_key)
}

fn status_body(code: u16, message: &str) -> Response {
    let reason = match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        409 => "Conflict",
        410 => "Expired",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    };
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut resp = (status, body.to_string()).into_response();
    resp.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "host",
];

fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !HOP_BY_HOP.contains(&k.as_str()) && k.as_str() != "content-length" {
            to.append(k.clone(), v.clone());
        }
    }
}

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let method = parts.method.clone();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or("").to_string();
    let body = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return status_body(400, &format!("reading the request body: {e}")),
    };
    let kind = RequestKind::of(method.as_str(), &path, &query);
    let index = {
        let mut log = lock(&shared.log);
        if !matches!(method, Method::GET | Method::HEAD) {
            log.writes += 1;
        }
        log.requests.push(RecordedRequest {
            method: method.to_string(),
            path: path.clone(),
            query: query.clone(),
            content_type: parts
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            body: String::from_utf8_lossy(&body).into_owned(),
            kind,
            status: None,
            at: std::time::Instant::now(),
        });
        log.requests.len() - 1
    };
    let resp = answer(&shared, parts, kind, path, query, body).await;
    if let Some(r) = lock(&shared.log).requests.get_mut(index) {
        r.status = Some(resp.status().as_u16());
    }
    resp
}

async fn answer(
    shared: &Shared,
    parts: axum::http::request::Parts,
    kind: RequestKind,
    path: String,
    query: String,
    body: bytes::Bytes,
) -> Response {
    let method = parts.method.clone();
    let (latency, fault, fail) = {
        let mut k = lock(&shared.knobs);
        if let Some((_, _, code)) = k
            .refusals
            .iter()
            .find(|(m, p, _)| m == method.as_str() && *p == path)
        {
            return status_body(*code, "refused by the test's fault proxy");
        }
        let fail = k.fail_next.get_mut(&kind).and_then(VecDeque::pop_front);
        let fault = k
            .faults
            .get(&Some(kind))
            .or_else(|| k.faults.get(&None))
            .copied();
        (k.latency, fault, fail)
    };
    let mut wait = latency;
    match fault {
        Some(Fault::Blackhole) => std::future::pending::<()>().await,
        Some(Fault::Status(code)) => {
            return status_body(code, "injected by the test's fault proxy")
        }
        Some(Fault::Delay(d)) => wait += d,
        None => {}
    }
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
        lock(&shared.log).added += wait;
    }
    if let Some(code) = fail {
        return status_body(code, "injected by the test's fault proxy");
    }
    forward(shared, parts.method, &parts.headers, &path, &query, body).await
}

async fn forward(
    shared: &Shared,
    method: Method,
    headers: &HeaderMap,
    path: &str,
    query: &str,
    body: bytes::Bytes,
) -> Response {
    let url = if query.is_empty() {
        format!("{}{path}", shared.upstream)
    } else {
        format!("{}{path}?{query}", shared.upstream)
    };
    let method = match reqwest::Method::from_bytes(method.as_str().as_bytes()) {
        Ok(m) => m,
        Err(e) => return status_body(400, &e.to_string()),
    };
    let mut out = HeaderMap::new();
    copy_headers(headers, &mut out);
    let resp = match shared
        .http
        .request(method, url)
        .headers(out)
        .body(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return status_body(502, &format!("fault proxy: upstream: {e}")),
    };
    let status = resp.status().as_u16();
    let mut headers = HeaderMap::new();
    copy_headers(resp.headers(), &mut headers);
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_classified_by_method_path_and_watch() {
        use RequestKind::*;
        for (m, p, q, want) in [
            ("GET", "/api/v1/pods", "fieldSelector=x", PodList),
            (
                "GET",
                "/api/v1/pods",
                "watch=true&resourceVersion=1",
                PodWatch,
            ),
            ("GET", "/api/v1/namespaces/a/pods/b", "", PodGet),
            ("DELETE", "/api/v1/namespaces/a/pods/b", "", PodDelete),
            ("POST", "/api/v1/namespaces/a/pods/b/eviction", "", Eviction),
            ("GET", "/api/v1/nodes/n", "", NodeGet),
            ("PATCH", "/api/v1/nodes/n/status", "", NodeWrite),
            (
                "POST",
                "/apis/events.k8s.io/v1/namespaces/d/events",
                "",
                EventCreate,
            ),
            ("PATCH", "/api/v1/namespaces/d/events/e", "", EventPatch),
            ("GET", "/apis/policy/v1/poddisruptionbudgets", "", Other),
        ] {
            assert_eq!(RequestKind::of(m, p, q), want, "{m} {p}?{q}");
        }
    }

    #[test]
    fn query_parameters_decode() {
        let r = RecordedRequest {
            method: "GET".into(),
            path: "/api/v1/pods".into(),
            query: "fieldSelector=spec.nodeName%3Dn1&labelSelector=a+in+%28b%29&x".into(),
            content_type: None,
            body: String::new(),
            kind: RequestKind::PodList,
            status: None,
            at: std::time::Instant::now(),
        };
        assert_eq!(
            r.query_param("fieldSelector").as_deref(),
            Some("spec.nodeName=n1")
        );
        assert_eq!(r.query_param("labelSelector").as_deref(), Some("a in (b)"));
        assert_eq!(r.query_param("x").as_deref(), Some(""));
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
