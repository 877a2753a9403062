//! Admin HTTP server: `/metrics` (OpenMetrics text), `/healthz` (process alive and serving) and
//! `/readyz` (at least one metadata poll succeeded recently).
//!
//! It listens on the node's network (hostNetwork), so every client is untrusted: request headers
//! must arrive within [`Limits::header_read_timeout`] and fit in [`Limits::max_header_bytes`], and
//! at most [`Limits::max_connections`] connections are open at once (further ones are closed on
//! accept). A connection lives at most [`Limits::max_connection_age`], then is closed gracefully
//! (Prometheus reconnects). So slow or idle clients cost bounded memory and never starve the
//! kubelet's probes for long.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Readiness as seen by the admin server.
pub trait Readiness: Send + Sync {
    /// `Ok(())` when ready, else the reason.
    fn ready(&self) -> Result<(), String>;
}

/// Bounds on what clients may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Whole request head (request line and headers) within this time, else the connection is
    /// closed. Also bounds an idle keep-alive connection's wait for its next request.
    pub header_read_timeout: Duration,
    /// Largest request head accepted (larger: 431). At least 8 KiB.
    pub max_header_bytes: usize,
    /// Connections open at once.
    pub max_connections: usize,
    /// Oldest a connection gets before it is closed after its current request.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(5),
            max_header_bytes: 16 * 1024,
            max_connections: 512,
            max_connection_age: Duration::from_secs(300),
        }
    }
}

struct AdminState {
    registry: Arc<Registry>,
    readiness: Arc<dyn Readiness>,
}

/// Bind the admin server with the default [`Limits`]; the returned future serves until `cancel`.
pub async fn bind(
    addr: SocketAddr,
    registry: Arc<Registry>,
    readiness: Arc<dyn Readiness>,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()>)> {
    bind_with_limits(addr, registry, readiness, Limits::default(), cancel).await
}

/// [`bind`] with explicit limits.
pub async fn bind_with_limits(
    addr: SocketAddr,
    registry: Arc<Registry>,
    readiness: Arc<dyn Readiness>,
    limits: Limits,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, impl std::future::Future<Output = ()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Arc::new(AdminState {
            registry,
            readiness,
        }));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let fut = async move {
        let mut conns = JoinSet::new();
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => break,
                a = listener.accept() => a,
                // Reap finished connections so the set stays small.
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            };
            let (stream, _peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: wait a little instead of spinning.
                    tracing::warn!(error = %e, "admin server: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                // Over the limit: close at once (dropping the stream).
                continue;
            };
            let service = hyper_util::service::TowerToHyperService::new(app.clone());
            let conn = http.serve_connection(TokioIo::new(stream), service);
            let age = limits.max_connection_age;
            conns.spawn(async move {
                let _permit = permit;
                let mut conn = std::pin::pin!(conn);
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = tokio::time::sleep(age) => {}
                }
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(Duration::from_secs(10), conn).await;
            });
        }
        // Shutdown: stop accepting; in-flight scrapes are dropped with the set.
        conns.shutdown().await;
    };
    Ok((local, fut))
}

async fn metrics(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    let body = crate::metrics::encode(&s.registry);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

async fn readyz(State(s): State<Arc<AdminState>>) -> impl IntoResponse {
    match s.readiness.ready() {
        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        ),
    }
}
