//! Admin HTTP server: `/metrics` (OpenMetrics text), `/healthz` (process alive and serving) and
//! `/readyz` (at least one metadata poll succeeded recently).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

/// Readiness as seen by the admin server.
pub trait Readiness: Send + Sync {
    /// `Ok(())` when ready, else the reason.
    fn ready(&self) -> Result<(), String>;
}

struct AdminState {
    registry: Arc<Registry>,
    readiness: Arc<dyn Readiness>,
}

/// Bind the admin server; the returned future serves until `cancel`.
pub async fn bind(
    addr: SocketAddr,
    registry: Arc<Registry>,
    readiness: Arc<dyn Readiness>,
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
    let fut = async move {
        let r = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = r {
            tracing::error!(error = %e, "admin server failed");
        }
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
