//! The listener, the connections, the fault layer and the shared state behind them.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use jiff::Timestamp;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::fault::{Action, Fault, FaultKind, Faults, Origin};
use super::model::{EmulatedNotice, Model, NoticeKind, Status};
use super::wire::{self, Body};
use super::{aws, azure, control, gce, Cloud, EmulatorConfig, Error, Raised};

const MAX_COUNTED_PATHS: usize = 10_000;
const OTHER_PATHS: &str = "<other>";

/// A `down` requested over HTTP starts this long after its control request is answered.
pub(super) const HTTP_DOWN_DELAY: Duration = Duration::from_millis(100);

/// Error returned by the service to make hyper close the connection without an answer.
#[derive(Debug)]
struct DropConnection;

impl std::fmt::Display for DropConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by an injected fault")
    }
}

impl std::error::Error for DropConnection {}

/// State shared by the accept loop, every connection and the handle.
pub(super) struct Shared {
    pub cfg: EmulatorConfig,
    model: Mutex<Model>,
    pub gce: gce::Channels,
    faults: Mutex<Faults>,
    /// `true` while a `down` fault holds the listener closed.
    down: watch::Sender<bool>,
    /// Bumped by every `down`/`clear` so an older `down` timer never lifts a newer one.
    down_generation: Mutex<u64>,
    cancel: CancellationToken,
    tasks: TaskTracker,
}

pub(super) async fn start(cfg: EmulatorConfig) -> std::io::Result<(Arc<Shared>, SocketAddr)> {
    let listener = bind(cfg.listen).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("bind metadata emulator on {}: {e}", cfg.listen),
        )
    })?;
    let addr = listener.local_addr()?;
    let shared = Arc::new(Shared {
        gce: gce::Channels::new(&cfg),
        model: Mutex::new(Model {
            azure_incarnation: 1,
            ..Model::default()
        }),
        faults: Mutex::new(Faults::default()),
        down: watch::Sender::new(false),
        down_generation: Mutex::new(0),
        cancel: CancellationToken::new(),
        tasks: TaskTracker::new(),
        cfg,
    });
    shared.mutate(|_| ());
    shared
        .tasks
        .spawn(accept_loop(Arc::clone(&shared), listener, addr));
    if let Some(after) = shared.cfg.notice_after {
        let s = Arc::clone(&shared);
        shared.tasks.spawn(async move {
            tokio::select! {
                _ = s.cancel.cancelled() => {}
                _ = tokio::time::sleep(after) => match s.raise(EmulatedNotice::interruption()) {
                    Ok(r) => info!(cloud = %s.cfg.cloud, notice_id = %r.id, visible_at = %r.visible_at, "emulator: --notice-after raised an interruption"),
                    Err(e) => warn!(error = %e, "emulator: --notice-after could not raise an interruption"),
                },
            }
        });
    }
    debug!(cloud = %shared.cfg.cloud, %addr, "metadata emulator started");
    Ok((shared, addr))
}

/// Bind with `SO_REUSEADDR` so a `down` fault can close the port and bind it again at once.
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    bound(addr)?.listen(1024)
}

/// A socket bound to `addr` (`SO_REUSEADDR`), not listening. While a `down` fault lasts one
/// holds the port: connections to it are refused as without a socket, and no other process's
/// listener can take the port meanwhile (a test beside ours binding port 0 got it once, and the
/// two emulators answered each other's requests).
fn bound(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener, addr: SocketAddr) {
    let mut down = shared.down.subscribe();
    let mut listener = Some(listener);
    loop {
        let Some(current) = listener.take() else {
            // Down: the port refuses connections until the fault ends, held by a socket that
            // does not listen (bound at once, right after the listener closed).
            let held = bound(addr)
                .inspect_err(
                    |e| warn!(%addr, error = %e, "emulator: cannot hold the port while down"),
                )
                .ok();
            tokio::select! {
                _ = shared.cancel.cancelled() => return,
                _ = until(&mut down, false) => {}
            }
            drop(held);
            listener = rebind(&shared, addr).await;
            if listener.is_none() {
                return;
            }
            info!(%addr, "emulator: listener back up");
            continue;
        };
        tokio::select! {
            _ = shared.cancel.cancelled() => return,
            _ = until(&mut down, true) => {
                drop(current);
                info!(%addr, "emulator: listener closed by a down fault");
            }
            accepted = current.accept() => {
                match accepted {
                    Ok((stream, _)) => {
                        shared.tasks.spawn(serve_connection(Arc::clone(&shared), stream));
                    }
                    Err(e) => {
                        warn!(error = %e, "emulator: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                listener = Some(current);
            }
        }
    }
}

/// Wait until the `down` flag equals `want` (the guard `wait_for` returns is not `Send`).
async fn until(down: &mut watch::Receiver<bool>, want: bool) {
    // An error means the sender is gone, i.e. the emulator is being torn down.
    let _ = down.wait_for(|d| *d == want).await;
}

async fn rebind(shared: &Shared, addr: SocketAddr) -> Option<TcpListener> {
    loop {
        match bind(addr) {
            Ok(l) => return Some(l),
            Err(e) => warn!(%addr, error = %e, "emulator: rebinding after down failed; retrying"),
        }
        tokio::select! {
            _ = shared.cancel.cancelled() => return None,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}

async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        debug!(error = %e, "emulator: TCP_NODELAY not set");
    }
    let mut down = shared.down.subscribe();
    let cancel = shared.cancel.clone();
    let svc_shared = Arc::clone(&shared);
    let service = service_fn(move |req| dispatch(Arc::clone(&svc_shared), req));
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        res = conn => if let Err(e) = res {
            debug!(error = %e, "emulator: connection ended with an error");
        },
        _ = cancel.cancelled() => {}
        _ = until(&mut down, true) => {}
    }
}

async fn dispatch(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, DropConnection> {
    let path = req.uri().path().to_owned();
    shared.count(&path);
    if path.starts_with(control::PREFIX) {
        return Ok(control::handle(&shared, req).await);
    }
    let action = shared
        .lock_faults()
        .take(&path, tokio::time::Instant::now());
    let mut garbage = false;
    match action {
        Some(Action::Drop) => {
            debug!(%path, "emulator: dropping connection (fault)");
            return Err(DropConnection);
        }
        Some(Action::Error(code)) => {
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Ok(wire::text(status, format!("emulated fault: {status}\n")));
        }
        Some(Action::Stall(delay)) => tokio::time::sleep(delay).await,
        Some(Action::Garbage) => garbage = true,
        None => {}
    }
    let resp = match shared.cfg.cloud {
        Cloud::Aws => aws::handle(&shared, req).await,
        Cloud::Gce => gce::handle(&shared, req).await,
        Cloud::Azure => azure::handle(&shared, req).await,
    };
    if garbage {
        let (mut parts, _) = resp.into_parts();
        parts.status = StatusCode::OK;
        parts.headers.remove(http::header::CONTENT_LENGTH);
        return Ok(Response::from_parts(parts, Body::from(wire::GARBAGE)));
    }
    Ok(resp)
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Model> {
        crate::sync::lock(&self.model)
    }

    fn lock_faults(&self) -> MutexGuard<'_, Faults> {
        crate::sync::lock(&self.faults)
    }

    pub(super) fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Count a request; past [`MAX_COUNTED_PATHS`] distinct paths, new ones count as `<other>`
    /// (a scanner must not grow the map without bound).
    fn count(&self, path: &str) {
        let mut model = self.lock();
        let key = if model.requests.len() < MAX_COUNTED_PATHS || model.requests.contains_key(path) {
            path
        } else {
            OTHER_PATHS
        };
        *model.requests.entry(key.to_owned()).or_insert(0) += 1;
    }

    /// Apply a change to the model and publish it: GCE watch values and the Azure incarnation
    /// are recomputed under the same lock, so every client sees changes in order.
    pub(super) fn mutate<R>(&self, f: impl FnOnce(&mut Model) -> R) -> R {
        let mut model = self.lock();
        let out = f(&mut model);
        match self.cfg.cloud {
            Cloud::Gce => self.gce.publish(&self.cfg, &model),
            Cloud::Azure => azure::publish(&mut model),
            Cloud::Aws => {}
        }
        out
    }

    pub(super) fn raise(self: &Arc<Self>, notice: EmulatedNotice) -> Result<Raised, Error> {
        let now = Timestamp::now();
        if notice.not_before_raw.is_some()
            && (self.cfg.cloud, notice.kind) != (Cloud::Aws, NoticeKind::Maintenance)
        {
            // Only EC2 scheduled events carry a NotBefore string to corrupt; silently ignoring
            // it elsewhere would make a malformed-document test pass without a malformed document.
            return Err(Error::UnsupportedField {
                cloud: self.cfg.cloud,
                kind: notice.kind,
                field: "not_before_raw",
            });
        }
        let event = match self.cfg.cloud {
            Cloud::Aws => aws::build(&self.cfg, &notice, now)?,
            Cloud::Gce => gce::build(&self.cfg, &notice, now)?,
            Cloud::Azure => azure::build(&self.cfg, &notice, now)?,
        };
        let (id, kind, start) = (event.id.clone(), event.kind, event.start);
        self.mutate(|m| {
            // Raising an id that exists replaces it (a re-raise moves the deadline).
            m.events.retain(|e| e.id != id);
            m.events.push(event);
        });
        let visible_at = Timestamp::now();
        info!(cloud = %self.cfg.cloud, notice_id = %id, kind = %kind, deadline = %start, "emulator: notice raised");
        if self.cfg.cloud == Cloud::Azure {
            azure::schedule_auto_start(self, id.clone(), start);
        }
        if let (Cloud::Gce, Some(delay)) = (self.cfg.cloud, notice.window_after) {
            // Publish the window later, as GCE sometimes does.
            let weak = Arc::downgrade(self);
            let reveal = id.clone();
            self.spawn_timer(delay, move || {
                if let Some(shared) = weak.upgrade() {
                    shared.mutate(|m| {
                        if let Some(e) = m.find_mut(&reveal) {
                            e.window_hidden = false;
                        }
                    });
                }
            });
        }
        Ok(Raised { id, visible_at })
    }

    pub(super) fn end_events(&self, id: Option<&str>, how: Status) -> Result<Vec<String>, Error> {
        let cloud = self.cfg.cloud;
        let ended = self.mutate(|m| -> Result<Vec<String>, Error> {
            let cancellable = |kind: NoticeKind| match cloud {
                Cloud::Azure => kind != NoticeKind::Rebalance,
                Cloud::Aws | Cloud::Gce => kind == NoticeKind::Maintenance,
            };
            if let Some(id) = id {
                let event = m.find_mut(id).ok_or_else(|| Error::UnknownEvent {
                    cloud,
                    id: id.to_owned(),
                })?;
                if !cancellable(event.kind) {
                    return Err(Error::NotCancellable {
                        cloud,
                        id: id.to_owned(),
                        kind: event.kind,
                    });
                }
            }
            let mut ended = Vec::new();
            for event in m.events.iter_mut() {
                let selected = id.is_none_or(|id| event.id == id);
                if selected && cancellable(event.kind) && event.status.is_live() {
                    event.status = how;
                    if cloud == Cloud::Aws {
                        aws::mark_ended(event, how);
                    }
                    ended.push(event.id.clone());
                }
            }
            Ok(ended)
        })?;
        info!(cloud = %cloud, ended = %ended.join(","), state = %serde_json::to_value(how).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(), "emulator: events ended");
        Ok(ended)
    }

    pub(super) fn clear(&self) {
        self.mutate(|m| m.events.clear());
        info!(cloud = %self.cfg.cloud, "emulator: all notices cleared");
    }

    pub(super) fn apply_fault(self: &Arc<Self>, fault: Fault, origin: Origin) -> Result<(), Error> {
        fault.validate(origin)?;
        info!(cloud = %self.cfg.cloud, fault = %serde_json::to_string(&fault).unwrap_or_default(), "emulator: fault applied");
        match fault.kind {
            FaultKind::Clear => {
                self.lock_faults().clear();
                *self.down_generation() += 1;
                self.down.send_replace(false);
            }
            FaultKind::ExpireTokens => self.mutate(|m| m.tokens.clear()),
            FaultKind::Down => {
                let generation = {
                    let mut g = self.down_generation();
                    *g += 1;
                    *g
                };
                match origin {
                    Origin::Handle => self.set_down(generation, fault.duration),
                    // Let the control request's own answer go out first.
                    Origin::Http => {
                        let weak = Arc::downgrade(self);
                        self.spawn_timer(HTTP_DOWN_DELAY, move || {
                            if let Some(s) = weak.upgrade() {
                                s.set_down(generation, fault.duration);
                            }
                        });
                    }
                }
            }
            FaultKind::Error { .. }
            | FaultKind::Stall { .. }
            | FaultKind::Drop
            | FaultKind::Garbage => {
                self.lock_faults().add(&fault, tokio::time::Instant::now());
            }
        }
        Ok(())
    }

    /// Close the listener (unless a later `down`/`clear` superseded this one) and schedule its
    /// return after `duration`.
    fn set_down(self: &Arc<Self>, generation: u64, duration: Option<Duration>) {
        if *self.down_generation() != generation {
            return;
        }
        self.down.send_replace(true);
        if let Some(d) = duration {
            let weak = Arc::downgrade(self);
            self.spawn_timer(d, move || {
                if let Some(s) = weak.upgrade() {
                    if *s.down_generation() == generation {
                        s.down.send_replace(false);
                    }
                }
            });
        }
    }

    fn down_generation(&self) -> MutexGuard<'_, u64> {
        crate::sync::lock(&self.down_generation)
    }

    pub(super) fn azure_acks(&self) -> Vec<String> {
        self.lock().azure_acks.clone()
    }

    pub(super) fn requests(&self, path: &str) -> u64 {
        self.lock().requests.get(path).copied().unwrap_or(0)
    }

    /// Spawn a task that ends with the emulator.
    pub(super) fn spawn_timer(&self, delay: Duration, f: impl FnOnce() + Send + 'static) {
        let cancel = self.cancel.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = tokio::time::sleep(delay) => f(),
            }
        });
    }

    pub(super) fn state_json(&self) -> serde_json::Value {
        let faults = self.lock_faults().describe(tokio::time::Instant::now());
        let model = self.lock();
        serde_json::json!({
            "cloud": self.cfg.cloud,
            "vm_name": self.cfg.vm_name,
            "notices": model.events.iter().map(|e| serde_json::json!({
                "id": e.id,
                "kind": e.kind,
                "status": e.status,
                "code": e.code,
                "action": e.action,
                "target": e.target,
                "description": e.description,
                "raised_at": wire::rfc3339(e.raised_at),
                "deadline": wire::rfc3339(e.start),
                "not_before_raw": e.raw_not_before,
                "end": e.end.map(wire::rfc3339),
            })).collect::<Vec<_>>(),
            "azure": {
                "incarnation": model.azure_incarnation,
                "acks": model.azure_acks,
            },
            "requests": model.requests,
            "faults": faults,
            "down": *self.down.borrow(),
        })
    }

    pub(super) async fn shutdown(&self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

/// Read a request body up to `limit` bytes.
pub(super) async fn read_body(
    req: Request<Incoming>,
    limit: usize,
) -> Result<bytes::Bytes, String> {
    use http_body_util::BodyExt;
    http_body_util::Limited::new(req.into_body(), limit)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .map_err(|e| format!("could not read the request body: {e}"))
}

/// Parse the query string into key/value pairs (percent-decoded).
pub(super) fn query(req: &Request<Incoming>) -> Result<Vec<(String, String)>, String> {
    axum::extract::Query::<Vec<(String, String)>>::try_from_uri(req.uri())
        .map(|q| q.0)
        .map_err(|e| format!("malformed query string: {e}"))
}

/// First value of `key` in a parsed query.
pub(super) fn param<'q>(query: &'q [(String, String)], key: &str) -> Option<&'q str> {
    query
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}
