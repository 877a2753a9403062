//! Admin HTTP server: `/metrics` (OpenMetrics text), `/healthz` (process alive and serving) and
//! `/readyz` (at least one metadata poll succeeded recently).
//!
//! It listens on the node's network (hostNetwork), so every client is untrusted: request headers
//! must arrive within [`Limits::header_read_timeout`] and fit in [`Limits::max_header_bytes`], at
//! most [`Limits::max_connections`] connections are open at once and at most
//! [`Limits::max_connections_per_peer`] from one address. A connection is *waiting for a head*
//! from its accept until its request head is complete, and again from each response until the
//! next head (keep-alive); only while a request is being served is it busy. A connection over a
//! limit takes the place of the connection (of that peer, for the per-peer limit) that has been
//! waiting for a head longest: a slow-header client, a half-sent head or an idle keep-alive
//! connection, never a request being answered. Only when every connection is busy is the new one
//! closed on accept. A connection lives at most [`Limits::max_connection_age`], then is closed
//! gracefully (Prometheus reconnects). So slow or idle clients cost bounded memory, and a client
//! that holds every connection (slow heads reopened as they close, or a tiny keep-alive request
//! now and then) never keeps the kubelet's probes or a scrape out, from another address or from
//! its own: a probe's head arrives at once, so it is served before the connections opened after
//! it have taken the place of every older one.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
    /// Connections open at once from one IP address: one client (a pod) can never take every
    /// connection, the rest stays for the others (the kubelet's probes come from the node).
    pub max_connections_per_peer: usize,
    /// Oldest a connection gets before it is closed after its current request.
    pub max_connection_age: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_read_timeout: Duration::from_secs(5),
            max_header_bytes: 16 * 1024,
            max_connections: 512,
            max_connections_per_peer: 384,
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
    let app = router(registry, readiness);
    let http = http_builder(&limits);
    let gate = Gate::new(limits);
    let fut = async move {
        let mut conns = JoinSet::new();
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => break,
                a = listener.accept() => a,
                // Reap finished connections so the set stays small.
                Some(_) = conns.join_next(), if !conns.is_empty() => continue,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: wait a little instead of spinning.
                    tracing::warn!(error = %e, "admin server: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            // Refused: closed at once (dropping the stream).
            let Some(admitted) = gate.admit(peer.ip()) else {
                continue;
            };
            let service = Tracked {
                inner: hyper_util::service::TowerToHyperService::new(app.clone()),
                tracker: admitted.tracker(),
            };
            let conn = http.serve_connection(TokioIo::new(stream), service);
            conns.spawn(admitted.serve(conn, |c| c.graceful_shutdown()));
        }
        // Shutdown: stop accepting; in-flight scrapes are dropped with the set.
        conns.shutdown().await;
    };
    Ok((local, fut))
}

/// The admin server's routes.
fn router(registry: Arc<Registry>, readiness: Arc<dyn Readiness>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(Arc::new(AdminState {
            registry,
            readiness,
        }))
}

/// HTTP/1 with the request-head time and size limits.
fn http_builder(limits: &Limits) -> http1::Builder {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    http
}

/// The connection limits of a server every client of which is untrusted (the admin server's,
/// the relay receiver's): at most [`Limits::max_connections`] at once and
/// [`Limits::max_connections_per_peer`] from one address; over a limit, a new connection takes
/// the place of the one waiting longest for a request head (of that peer for the per-peer
/// limit), else it is refused; a connection lives at most [`Limits::max_connection_age`].
pub struct Gate {
    limits: Limits,
    slots: Arc<Semaphore>,
    table: Arc<Mutex<Table>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// A connection the [`Gate`] let in: serve it with [`Admitted::serve`], marking each request
/// served with its [`Tracker`].
pub struct Admitted {
    kill: CancellationToken,
    /// `None`: it took another's place and waits for that one's slot.
    permit: Option<OwnedSemaphorePermit>,
    slots: Arc<Semaphore>,
    entry: Entry,
    age: Duration,
}

/// Marks its connection busy (not evictable) while a request is served.
#[derive(Clone)]
pub struct Tracker {
    id: u64,
    table: Arc<Mutex<Table>>,
}

/// A request being served; its connection waits for a head again when this is dropped.
pub struct Serving(Tracker);

impl Tracker {
    pub fn serving(&self) -> Serving {
        crate::sync::lock(&self.table).busy(self.id, true);
        Serving(self.clone())
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        crate::sync::lock(&self.0.table).busy(self.0.id, false);
    }
}

impl Gate {
    pub fn new(limits: Limits) -> Gate {
        Gate {
            slots: Arc::new(Semaphore::new(limits.max_connections.max(1))),
            limits,
            table: Arc::new(Mutex::new(Table::default())),
            next_id: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Take a place for a connection from `peer`. Over a limit, it takes the place of the
    /// connection waiting longest for a request head (of this peer for the per-peer limit),
    /// else it is refused (`None`: close it).
    pub fn admit(&self, peer: IpAddr) -> Option<Admitted> {
        let id = 1 + self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut t = crate::sync::lock(&self.table);
        let mut evicted = false;
        if t.from(peer) >= self.limits.max_connections_per_peer.max(1) {
            if !t.evict_longest_waiting(Some(peer)) {
                return None;
            }
            evicted = true;
        }
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) if evicted || t.evict_longest_waiting(None) => None,
            Err(_) => return None,
        };
        t.insert(id, peer);
        let kill = t.kill_token(id);
        Some(Admitted {
            kill,
            permit,
            slots: self.slots.clone(),
            entry: Entry {
                id,
                table: self.table.clone(),
            },
            age: self.limits.max_connection_age,
        })
    }
}

impl Admitted {
    pub fn tracker(&self) -> Tracker {
        Tracker {
            id: self.entry.id,
            table: self.entry.table.clone(),
        }
    }

    /// Serve the connection `conn` until it ends, is killed (another took its place) or
    /// reaches its age (then `graceful` is called on it, and it has 10 s more at most).
    /// Without a slot it first waits up to [`EVICT_WAIT`] for the slot of the connection whose
    /// place it took.
    pub async fn serve<F: std::future::Future>(self, conn: F, graceful: impl FnOnce(Pin<&mut F>)) {
        let _entry = self.entry;
        // The slot of an evicted connection frees as soon as its task ends.
        let _permit = match self.permit {
            Some(p) => p,
            None => match tokio::time::timeout(EVICT_WAIT, self.slots.acquire_owned()).await {
                Ok(Ok(p)) => p,
                _ => return,
            },
        };
        let mut conn = std::pin::pin!(conn);
        tokio::select! {
            _ = conn.as_mut() => return,
            _ = self.kill.cancelled() => return,
            _ = tokio::time::sleep(self.age) => {}
        }
        graceful(conn.as_mut());
        let _ = tokio::time::timeout(Duration::from_secs(10), conn).await;
    }
}

/// How long a connection that took another's place waits for that one's slot.
const EVICT_WAIT: Duration = Duration::from_millis(500);

/// The open connections: their peer, whether they wait for a request head (and since when), and
/// how to close them.
#[derive(Default)]
struct Table {
    conns: HashMap<u64, Conn>,
}

struct Conn {
    peer: IpAddr,
    /// Waiting for a request head since then: since the accept, or since its last response
    /// (keep-alive). `None` while a request is being served.
    waiting_since: Option<std::time::Instant>,
    kill: CancellationToken,
}

impl Table {
    fn from(&self, peer: IpAddr) -> usize {
        self.conns.values().filter(|c| c.peer == peer).count()
    }

    fn insert(&mut self, id: u64, peer: IpAddr) {
        self.conns.insert(
            id,
            Conn {
                peer,
                waiting_since: Some(std::time::Instant::now()),
                kill: CancellationToken::new(),
            },
        );
    }

    fn kill_token(&self, id: u64) -> CancellationToken {
        self.conns
            .get(&id)
            .map(|c| c.kill.clone())
            .unwrap_or_default()
    }

    /// Close the connection (of `peer`, if given) that has waited longest for a request head
    /// (sending one slowly, or idle between requests); `false` when every one is busy.
    fn evict_longest_waiting(&mut self, peer: Option<IpAddr>) -> bool {
        let longest = self
            .conns
            .iter()
            .filter(|(_, c)| peer.is_none_or(|p| c.peer == p))
            .filter_map(|(id, c)| c.waiting_since.map(|at| (at, *id)))
            .min();
        let Some((_, id)) = longest else {
            return false;
        };
        if let Some(c) = self.conns.remove(&id) {
            c.kill.cancel();
        }
        true
    }

    fn busy(&mut self, id: u64, busy: bool) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.waiting_since = (!busy).then(std::time::Instant::now);
        }
    }
}

/// Removes a connection from the table when its task ends.
struct Entry {
    id: u64,
    table: Arc<Mutex<Table>>,
}

impl Drop for Entry {
    fn drop(&mut self) {
        crate::sync::lock(&self.table).conns.remove(&self.id);
    }
}

/// The router, marking its connection busy while a request is served.
struct Tracked {
    inner: hyper_util::service::TowerToHyperService<Router>,
    tracker: Tracker,
}

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Tracked {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, req: http::Request<hyper::body::Incoming>) -> Self::Future {
        let serving = self.tracker.serving();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await;
            drop(serving);
            resp
        })
    }
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
