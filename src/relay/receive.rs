//! The receiver: a TLS listener (`--relay-listen`) serving the wire format ([`super::wire`]).
//!
//! Every request carries the node key or, in Kubernetes, an agent's relay token
//! (`Authorization: Bearer`), checked first ([`super::auth`]); a
//! reservation is checked before a byte is accepted: its version, the tree's paths, counts and
//! bytes (the staged-tree rules, `store::tree`), the location against this agent's own
//! allow-list and writer rules ([`Publisher::check`]), the sender's cap (bytes reserved by one
//! address at once) and the staging volume's free space less every other reservation. Each file
//! is written as it arrives, never past its declared size, with a deadline on every read; a
//! file that breaks any rule, a checksum that does not match, a sender silent for
//! `idle` or a `DELETE` ends the relay: its files are removed and its bytes freed, nothing is
//! published. A committed relay is published through the [`Publisher`] and, if the agent
//! restarts meanwhile, published again from its journal ([`Receiver::recover`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming as Body;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::stage::{self, Incoming, Journal, Staging};
use super::wire::{self, Commit, FileCrcs, Refusal, Reserve, Reserved, State, Status};
use super::{PublishJob, Published, Publisher};
use crate::admin;
use crate::fsutil::is_disk_full;
use crate::store::crc::Crcs;
use crate::store::tree::{self, Limits};

/// Bytes written to disk at a time.
const WRITE_CHUNK: usize = 1 << 20;
/// A TLS handshake and a request's head must arrive within this.
const HANDSHAKE: Duration = Duration::from_secs(10);
/// Finished relays whose status is kept for senders to read.
const KEEP_FINISHED: usize = 1024;

/// Connections open at once ([`Settings::connections`], the agent's): a sender holds one per
/// relay, and one more while it gives a relay up.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections open at once from one address: one sender never takes them all.
pub const MAX_CONNECTIONS_PER_SENDER: usize = 64;

/// The receiver's connection limits (the admin server's mechanism, [`admin::Gate`]): at most
/// `max` connections and `per_sender` from one address; over a limit a new connection takes
/// the place of the one waiting longest for a request head (a TLS handshake or a head sent
/// slowly, a connection idle between requests), and is closed at once when every one is
/// serving a request. A connection is never closed for its age (a file may take long).
pub fn connection_limits(max: usize, per_sender: usize) -> admin::Limits {
    admin::Limits {
        header_read_timeout: HANDSHAKE,
        max_connections: max,
        max_connections_per_peer: per_sender,
        max_connection_age: Duration::from_secs(24 * 3600),
        ..admin::Limits::default()
    }
}

/// The receiver's settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The node key senders must present (`--relay-key-file`).
    pub key: Vec<u8>,
    /// Where relayed files are staged.
    pub staging: std::path::PathBuf,
    /// Bytes one sender (address) may have reserved at once (`--relay-max-bytes-per-sender`).
    pub per_sender: u64,
    /// A receiving relay with no bytes for this long is given up (`--relay-idle-timeout`).
    pub idle: Duration,
    /// Files, bytes and depth of one relayed tree (the upload's `--upload-max-*`).
    pub limits: Limits,
    /// Connections open at once ([`connection_limits`]; the agent's: [`MAX_CONNECTIONS`],
    /// [`MAX_CONNECTIONS_PER_SENDER`]).
    pub connections: admin::Limits,
    /// `spotguard_relay_*` (received, bytes, refusals).
    pub metrics: Arc<super::metrics::RelayMetrics>,
}

/// The receiver.
pub struct Receiver {
    settings: Settings,
    staging: Staging,
    publisher: Arc<dyn Publisher>,
    /// Who may send ([`super::auth`]): the node key, or in Kubernetes a reviewed token.
    auth: super::auth::Auth,
    inner: Mutex<Inner>,
    /// Cancelled when the agent stops: publications stop where they are, and their files and
    /// journals stay for the next run ([`Receiver::recover`]).
    shutdown: CancellationToken,
}

#[derive(Default)]
struct Inner {
    relays: HashMap<String, Arc<Relay>>,
    /// Bytes reserved, by sender address and in all.
    by_sender: HashMap<IpAddr, u64>,
    reserved: u64,
    /// Finished relays, oldest first (their status stays readable for a while).
    finished: std::collections::VecDeque<String>,
}

struct Relay {
    id: String,
    sender: IpAddr,
    reserve: Reserve,
    bytes: u64,
    st: Mutex<RelayState>,
    cancel: CancellationToken,
}

struct RelayState {
    state: State,
    detail: Option<String>,
    /// Each file's checksums once it arrived whole.
    received: Vec<Option<Crcs>>,
    /// Files being received now.
    busy: usize,
    last: Instant,
    /// Its bytes are back in the pool.
    released: bool,
}

type Answer = Response<Full<Bytes>>;

fn answer(status: StatusCode, body: Vec<u8>) -> Answer {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn refuse(status: StatusCode, why: impl Into<String>) -> Answer {
    let body = serde_json::to_vec(&Refusal { error: why.into() }).unwrap_or_default();
    answer(status, body)
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Answer {
    answer(status, serde_json::to_vec(v).unwrap_or_default())
}

impl Receiver {
    pub fn new(
        settings: Settings,
        publisher: Arc<dyn Publisher>,
    ) -> Result<Receiver, super::Error> {
        let staging = Staging::open(&settings.staging)?;
        Ok(Receiver {
            auth: super::auth::Auth::key(&settings.key),
            settings,
            staging,
            publisher,
            inner: Mutex::new(Inner::default()),
            shutdown: CancellationToken::new(),
        })
    }

    /// Kubernetes: senders present an agent's relay token, checked by `reviewer`, instead of
    /// the node key.
    pub fn with_tokens(mut self, reviewer: super::auth::Reviewer) -> Receiver {
        self.auth = super::auth::Auth::Tokens(Box::new(reviewer));
        self
    }

    /// The relays an earlier run of the agent left: committed ones are published again from
    /// their staged files (the publication resumes or finds its own manifest); the others
    /// (their senders' streams are gone) are removed and their space freed.
    pub fn recover(self: &Arc<Self>) {
        let (journals, leftovers) = self.staging.scan();
        for name in leftovers {
            warn!(entry = %name, "removing an unfinished relay left by an earlier run");
            self.staging.remove_entry(&name);
        }
        for j in journals {
            let crcs = j.committed.as_ref().and_then(|c| {
                c.iter()
                    .map(|f| parse_crcs(f, 0))
                    .collect::<Option<Vec<Crcs>>>()
            });
            match crcs {
                Some(crcs) if crcs.len() == j.reserve.files.len() => {
                    let crcs: Vec<Crcs> = crcs
                        .into_iter()
                        .zip(&j.reserve.files)
                        .map(|(c, f)| Crcs { len: f.size, ..c })
                        .collect();
                    info!(relay = %j.id, location = %j.reserve.location, checkpoint = %j.reserve.checkpoint.name, "publishing a relay committed before an agent restart");
                    let relay = self.insert(j.id.clone(), j.sender, j.reserve, State::Publishing);
                    self.start_publish(relay, crcs);
                }
                _ => {
                    warn!(relay = %j.id, sender = %j.sender, "a relay was still receiving when the agent stopped: its files are removed, nothing is published");
                    self.staging.remove(&j.id);
                }
            }
        }
    }

    /// Serve on `listener` until `cancel`, with this node's TLS `config`; relays silent for
    /// `idle` are given up meanwhile.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        config: Arc<rustls::ServerConfig>,
        cancel: CancellationToken,
    ) {
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let reaper = tokio::spawn(self.clone().reap(cancel.clone()));
        let gate = admin::Gate::new(self.settings.connections);
        loop {
            let (tcp, addr) = tokio::select! {
                _ = cancel.cancelled() => break,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(e) => {
                        warn!(error = %e, "relay listener: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Some(admitted) = gate.admit(addr.ip()) else {
                warn!(peer = %addr, "relay connection refused: every connection is serving a request");
                continue;
            };
            let me = self.clone();
            let acceptor = acceptor.clone();
            let cancel = cancel.clone();
            tokio::spawn(async move {
                let tracker = admitted.tracker();
                let serving = async move {
                    let tls = match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                        Ok(Ok(t)) => t,
                        Ok(Err(e)) => {
                            warn!(peer = %addr, error = %e, "relay: TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    };
                    let service = hyper::service::service_fn(move |req| {
                        let me = me.clone();
                        let serving = tracker.serving();
                        async move {
                            let answer = me.handle(req, addr).await;
                            drop(serving);
                            Ok::<_, std::convert::Infallible>(answer)
                        }
                    });
                    let conn = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HANDSHAKE)
                        .serve_connection(TokioIo::new(tls), service);
                    tokio::select! {
                        _ = conn => {}
                        _ = cancel.cancelled() => {}
                    }
                };
                admitted.serve(serving, |_| {}).await;
            });
        }
        reaper.abort();
        self.stop();
    }

    /// The agent stops: every relay stops where it is; nothing is removed (a committed relay is
    /// published by the next run, a receiving one removed by it).
    pub fn stop(&self) {
        self.shutdown.cancel();
    }

    /// Give up receiving relays whose sender has been silent for `idle`.
    async fn reap(self: Arc<Self>, cancel: CancellationToken) {
        let every = (self.settings.idle / 4).max(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let relays: Vec<Arc<Relay>> = crate::sync::lock(&self.inner)
                .relays
                .values()
                .cloned()
                .collect();
            for r in relays {
                let silent = {
                    let st = crate::sync::lock(&r.st);
                    st.state == State::Receiving
                        && st.busy == 0
                        && st.last.elapsed() >= self.settings.idle
                };
                if silent {
                    self.abort(
                        &r,
                        "the sender went silent (no bytes within the idle timeout)",
                    );
                }
            }
        }
    }

    /// The status of relay `id`, if known.
    pub fn status(&self, id: &str) -> Option<Status> {
        let r = crate::sync::lock(&self.inner).relays.get(id).cloned()?;
        let st = crate::sync::lock(&r.st);
        Some(Status {
            state: st.state,
            detail: st.detail.clone(),
        })
    }

    /// The staging directory.
    pub fn staging_dir(&self) -> &std::path::Path {
        &self.staging.root
    }

    /// Relays reserved since the start (those still kept, finished ones included).
    pub fn known(&self) -> usize {
        crate::sync::lock(&self.inner).relays.len()
    }

    /// Bytes reserved now (all senders).
    pub fn reserved(&self) -> u64 {
        crate::sync::lock(&self.inner).reserved
    }

    /// What a new reservation may still take: the staging volume's free space less what is
    /// reserved (0 when the volume cannot be read).
    pub fn unreserved(&self) -> u64 {
        self.staging
            .free_bytes()
            .unwrap_or(0)
            .saturating_sub(self.reserved())
    }

    async fn handle(self: Arc<Self>, req: Request<Body>, from: SocketAddr) -> Answer {
        let node = match self.auth.check(req.headers()).await {
            Ok(node) => node,
            Err(denied) => {
                warn!(peer = %from, reason = %denied, "relay request from no agent refused");
                self.settings.metrics.refused("auth");
                return refuse(denied.status(), denied.to_string());
            }
        };
        let path = req.uri().path().to_string();
        let rest = path.strip_prefix(wire::RELAYS);
        let segments: Vec<&str> = match rest {
            Some("") => Vec::new(),
            Some(r) if r.starts_with('/') => r[1..].split('/').collect(),
            _ => return refuse(StatusCode::NOT_FOUND, "no such resource"),
        };
        match (req.method().clone(), segments.as_slice()) {
            (Method::POST, []) => self.reserve(req, from.ip(), node.as_deref()).await,
            (Method::PUT, [id, "files", index]) => {
                let (id, index) = (id.to_string(), index.to_string());
                self.receive_file(req, &id, &index).await
            }
            (Method::POST, [id, "commit"]) => {
                let id = id.to_string();
                self.commit(req, &id).await
            }
            (Method::GET, [id]) => match self.status(id) {
                Some(s) => json(StatusCode::OK, &s),
                None => refuse(StatusCode::NOT_FOUND, "no such relay"),
            },
            (Method::DELETE, [id]) => {
                if let Some(r) = self.relay(id) {
                    self.abort(&r, "the sender aborted it");
                }
                answer(StatusCode::NO_CONTENT, Vec::new())
            }
            _ => refuse(StatusCode::NOT_FOUND, "no such resource"),
        }
    }

    fn relay(&self, id: &str) -> Option<Arc<Relay>> {
        crate::sync::lock(&self.inner).relays.get(id).cloned()
    }

    /// `node`: the node the sender's token is bound to (Kubernetes), which must be the node the
    /// reservation names as its sender and as the checkpoint's origin.
    async fn reserve(
        self: &Arc<Self>,
        req: Request<Body>,
        sender: IpAddr,
        node: Option<&str>,
    ) -> Answer {
        let reserve: Reserve = match read_json(req).await {
            Ok(r) => r,
            Err(a) => {
                self.settings.metrics.refused("bad_request");
                return a;
            }
        };
        if reserve.version != wire::VERSION {
            self.settings.metrics.refused("bad_request");
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "wire format version {}, this agent speaks {}",
                    reserve.version,
                    wire::VERSION
                ),
            );
        }
        if let Some(node) = node {
            let origin = reserve.checkpoint.origin.node.as_deref();
            if reserve.sender != node || origin != Some(node) {
                let why = format!(
                    "the sender's token is bound to node {node:?}; the reservation names {:?} as its sender and {origin:?} as the checkpoint's origin",
                    reserve.sender
                );
                warn!(sender = %sender, location = %reserve.location, error = %why, "relay refused: an agent relays only its own node's checkpoints");
                self.settings.metrics.refused("auth");
                return refuse(StatusCode::FORBIDDEN, why);
            }
        }
        if let Err(why) = self.check_tree(&reserve) {
            warn!(sender = %sender, location = %reserve.location, error = %why, "relay refused: its tree breaks the staged-tree rules");
            self.settings.metrics.refused("tree");
            return refuse(StatusCode::UNPROCESSABLE_ENTITY, why);
        }
        if let Err(why) = self.publisher.check(&reserve) {
            warn!(sender = %sender, location = %reserve.location, error = %why, "relay refused: this agent does not publish there");
            self.settings.metrics.refused("location");
            return refuse(StatusCode::FORBIDDEN, why);
        }
        let bytes = reserve.bytes();
        let free = match self.staging.free_bytes() {
            Ok(f) => f,
            Err(e) => return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        };
        let id = stage::new_id();
        {
            let mut inner = crate::sync::lock(&self.inner);
            let mine = inner.by_sender.get(&sender).copied().unwrap_or(0);
            if mine.saturating_add(bytes) > self.settings.per_sender {
                self.settings.metrics.refused("cap");
                return refuse(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "{bytes} bytes would take this sender's reservations past {} bytes",
                        self.settings.per_sender
                    ),
                );
            }
            if inner.reserved.saturating_add(bytes) > free {
                self.settings.metrics.refused("space");
                return refuse(
                    StatusCode::INSUFFICIENT_STORAGE,
                    format!(
                        "{bytes} bytes do not fit: {free} bytes free on the staging volume, {} reserved",
                        inner.reserved
                    ),
                );
            }
            *inner.by_sender.entry(sender).or_default() += bytes;
            inner.reserved += bytes;
        }
        let journal = Journal {
            version: stage::JOURNAL_VERSION,
            id: id.clone(),
            sender,
            reserve: reserve.clone(),
            committed: None,
        };
        let staging = self.staging.clone();
        let made = tokio::task::spawn_blocking(move || staging.create(&journal)).await;
        let relay = self.insert(id.clone(), sender, reserve, State::Receiving);
        if let Err(e) = made
            .map_err(|e| super::Error::Io {
                what: "staging".into(),
                source: std::io::Error::other(e),
            })
            .and_then(|r| r)
        {
            self.abort(&relay, &e.to_string());
            if matches!(&e, super::Error::Io { source, .. } if is_disk_full(source)) {
                self.settings.metrics.refused("space");
                return refuse(StatusCode::INSUFFICIENT_STORAGE, e.to_string());
            }
            return refuse(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
        }
        info!(relay = %id, sender = %sender, location = %relay.reserve.location, checkpoint = %relay.reserve.checkpoint.name, files = relay.reserve.files.len(), bytes, "relay reserved");
        json(StatusCode::CREATED, &Reserved { id })
    }

    /// A relay's bytes are already counted; record it.
    fn insert(&self, id: String, sender: IpAddr, reserve: Reserve, state: State) -> Arc<Relay> {
        let bytes = reserve.bytes();
        let relay = Arc::new(Relay {
            id: id.clone(),
            sender,
            bytes,
            st: Mutex::new(RelayState {
                state,
                detail: None,
                received: vec![None; reserve.files.len()],
                busy: 0,
                last: Instant::now(),
                released: false,
            }),
            reserve,
            cancel: self.shutdown.child_token(),
        });
        let mut inner = crate::sync::lock(&self.inner);
        if state != State::Receiving {
            // Recovered: its bytes were not counted yet.
            *inner.by_sender.entry(sender).or_default() += bytes;
            inner.reserved += bytes;
        }
        inner.relays.insert(id, relay.clone());
        relay
    }

    /// The staged-tree rules, applied to what the sender declares.
    fn check_tree(&self, r: &Reserve) -> Result<(), String> {
        let limits = &self.settings.limits;
        if r.files.len() > limits.max_files {
            return Err(format!("more than {} files", limits.max_files));
        }
        let total = r
            .files
            .iter()
            .try_fold(0u64, |s, f| s.checked_add(f.size))
            .ok_or("the sizes overflow")?;
        if total > limits.max_bytes {
            return Err(format!("more than {} bytes", limits.max_bytes));
        }
        let mut seen = std::collections::HashSet::new();
        for f in &r.files {
            tree::check_file(&f.path, limits).map_err(|why| format!("file {:?}: {why}", f.path))?;
            if !seen.insert(f.path.as_str()) {
                return Err(format!("file {:?} listed twice", f.path));
            }
        }
        // A file and a directory of the same name cannot both exist.
        for f in &r.files {
            let mut prefix = f.path.as_str();
            while let Some((parent, _)) = prefix.rsplit_once('/') {
                if seen.contains(parent) {
                    return Err(format!("{parent:?} is both a file and a directory"));
                }
                prefix = parent;
            }
        }
        Ok(())
    }

    async fn receive_file(self: &Arc<Self>, req: Request<Body>, id: &str, index: &str) -> Answer {
        let Some(relay) = self.relay(id) else {
            return refuse(StatusCode::NOT_FOUND, "no such relay");
        };
        let Some(entry) = index
            .parse::<usize>()
            .ok()
            .and_then(|i| relay.reserve.files.get(i).map(|e| (i, e.clone())))
        else {
            return refuse(StatusCode::NOT_FOUND, "no such file in this relay");
        };
        let (i, entry) = entry;
        {
            let mut st = crate::sync::lock(&relay.st);
            if st.state != State::Receiving {
                return refuse(StatusCode::CONFLICT, format!("the relay is {:?}", st.state));
            }
            if st.received[i].is_some() {
                return refuse(StatusCode::CONFLICT, "this file was already received");
            }
            st.busy += 1;
            st.last = Instant::now();
        }
        // Counted out however the request ends (a connection that closes drops this future).
        let busy = Busy(&relay);
        let result = self
            .write_body(&relay, req.into_body(), &entry.path, entry.size)
            .await;
        drop(busy);
        match result {
            Ok(crcs) => {
                crate::sync::lock(&relay.st).received[i] = Some(crcs);
                answer(StatusCode::NO_CONTENT, Vec::new())
            }
            Err((status, why)) => {
                // Aborted because this agent is stopping: unavailable, as a peer that died would
                // be, not a refusal of the relay.
                let (status, why) = if self.shutdown.is_cancelled() {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the receiving agent is stopping".to_string(),
                    )
                } else {
                    (status, why)
                };
                let why = format!("file {:?}: {why}", entry.path);
                if status == StatusCode::INSUFFICIENT_STORAGE {
                    warn!(relay = %relay.id, sender = %relay.sender, error = %why, "relay refused: the staging volume is full");
                    self.settings.metrics.refused("space");
                }
                self.abort(&relay, &why);
                refuse(status, why)
            }
        }
    }

    /// Stream a request body into the file; every read within `idle`.
    async fn write_body(
        &self,
        relay: &Arc<Relay>,
        mut body: Body,
        rel: &str,
        size: u64,
    ) -> Result<Crcs, (StatusCode, String)> {
        let dir = self.staging.dir(&relay.id);
        let rel2 = rel.to_string();
        let io_err = |e: String| (StatusCode::INTERNAL_SERVER_ERROR, e);
        let mut file = tokio::task::spawn_blocking(move || Incoming::create(&dir, &rel2, size))
            .await
            .map_err(|e| io_err(e.to_string()))?
            .map_err(|e| io_refusal(&e))?;
        let mut buf: Vec<u8> = Vec::with_capacity(WRITE_CHUNK);
        let refused = |r: stage::Refused| match r {
            stage::Refused::Io(e) => io_refusal(&e),
            r => (StatusCode::BAD_REQUEST, r.to_string()),
        };
        loop {
            let frame = tokio::select! {
                _ = relay.cancel.cancelled() => return Err((StatusCode::CONFLICT, "the relay was aborted".into())),
                f = tokio::time::timeout(self.settings.idle, body.frame()) => f,
            };
            let frame = match frame {
                Err(_) => {
                    return Err((
                        StatusCode::REQUEST_TIMEOUT,
                        "no bytes within the idle timeout".into(),
                    ))
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => return Err((StatusCode::BAD_REQUEST, e.to_string())),
                Ok(Some(Ok(f))) => f,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            crate::sync::lock(&relay.st).last = Instant::now();
            self.settings
                .metrics
                .received_bytes
                .inc_by(data.len() as u64);
            if (buf.len() + data.len()) as u64 + file_len(&file) > size {
                return Err((
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("more bytes than the declared {size}"),
                ));
            }
            buf.extend_from_slice(&data);
            if buf.len() >= WRITE_CHUNK {
                let chunk = std::mem::take(&mut buf);
                file = tokio::task::spawn_blocking(move || file.write(&chunk).map(|()| file))
                    .await
                    .map_err(|e| io_err(e.to_string()))?
                    .map_err(refused)?;
            }
        }
        tokio::task::spawn_blocking(move || {
            file.write(&buf)?;
            file.finish()
        })
        .await
        .map_err(|e| io_err(e.to_string()))?
        .map_err(refused)
    }

    async fn commit(self: &Arc<Self>, req: Request<Body>, id: &str) -> Answer {
        let Some(relay) = self.relay(id) else {
            return refuse(StatusCode::NOT_FOUND, "no such relay");
        };
        let commit: Commit = match read_json(req).await {
            Ok(c) => c,
            Err(a) => {
                self.settings.metrics.refused("bad_request");
                return a;
            }
        };
        let crcs = {
            let mut st = crate::sync::lock(&relay.st);
            if st.state != State::Receiving {
                return refuse(StatusCode::CONFLICT, format!("the relay is {:?}", st.state));
            }
            if st.busy > 0 || st.received.iter().any(Option::is_none) {
                return refuse(StatusCode::CONFLICT, "not every file has arrived");
            }
            st.last = Instant::now();
            st.received.iter().flatten().copied().collect::<Vec<Crcs>>()
        };
        if commit.files.len() != crcs.len() {
            self.abort(&relay, "the commit lists another number of files");
            return refuse(
                StatusCode::BAD_REQUEST,
                "the commit lists another number of files",
            );
        }
        if let Some((f, _)) = relay
            .reserve
            .files
            .iter()
            .zip(commit.files.iter().zip(&crcs))
            .find(|(_, (sent, got))| !sent.matches(got))
        {
            let why = format!(
                "file {:?}: the bytes received do not match the sender's checksums",
                f.path
            );
            warn!(relay = %relay.id, sender = %relay.sender, error = %why, "relay refused: nothing is published");
            self.settings.metrics.refused("crc");
            self.abort(&relay, &why);
            return refuse(StatusCode::UNPROCESSABLE_ENTITY, why);
        }
        let journal = Journal {
            version: stage::JOURNAL_VERSION,
            id: relay.id.clone(),
            sender: relay.sender,
            reserve: relay.reserve.clone(),
            committed: Some(commit.files),
        };
        let staging = self.staging.clone();
        let written = tokio::task::spawn_blocking(move || staging.write_journal(&journal))
            .await
            .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
            .and_then(|r| {
                r.map_err(|e| match &e {
                    super::Error::Io { source, .. } if is_disk_full(source) => {
                        (StatusCode::INSUFFICIENT_STORAGE, e.to_string())
                    }
                    e => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
                })
            });
        if let Err((status, e)) = written {
            if status == StatusCode::INSUFFICIENT_STORAGE {
                warn!(relay = %relay.id, sender = %relay.sender, error = %e, "relay refused: the staging volume is full");
                self.settings.metrics.refused("space");
            }
            self.abort(&relay, &e);
            return refuse(status, e);
        }
        crate::sync::lock(&relay.st).state = State::Publishing;
        info!(relay = %relay.id, location = %relay.reserve.location, checkpoint = %relay.reserve.checkpoint.name, "relay verified; publishing");
        self.start_publish(relay, crcs);
        json(
            StatusCode::ACCEPTED,
            &Status {
                state: State::Publishing,
                detail: None,
            },
        )
    }

    fn start_publish(self: &Arc<Self>, relay: Arc<Relay>, crcs: Vec<Crcs>) {
        let me = self.clone();
        let job = PublishJob {
            dir: self.staging.dir(&relay.id),
            reserve: relay.reserve.clone(),
            crcs,
            cancel: relay.cancel.clone(),
        };
        let publishing = self.publisher.publish(job);
        tokio::spawn(async move {
            let end = publishing.await;
            if me.shutdown.is_cancelled() {
                return;
            }
            let (state, detail) = match end {
                Published::Published => (State::Published, None),
                Published::AlreadyPublished => (State::AlreadyPublished, None),
                Published::Failed(why) => (State::Failed, Some(why)),
            };
            match &detail {
                None => {
                    info!(relay = %relay.id, location = %relay.reserve.location, checkpoint = %relay.reserve.checkpoint.name, outcome = ?state, "relay published")
                }
                Some(e) => {
                    warn!(relay = %relay.id, location = %relay.reserve.location, error = %e, "relay did not publish")
                }
            }
            me.finish(&relay, state, detail);
        });
    }

    /// Give up a relay that has not published: its files go, its bytes are freed.
    fn abort(&self, relay: &Arc<Relay>, why: &str) {
        if self.shutdown.is_cancelled() {
            return;
        }
        {
            let st = crate::sync::lock(&relay.st);
            if st.state.is_final() {
                return;
            }
            if st.state == State::Publishing {
                // A committed relay is published regardless: its manifest is created only if
                // absent, and a publication stopped half-way would leave its multipart uploads
                // and journal behind. Only the agent's stop interrupts it (resumed next run).
                return;
            }
        }
        relay.cancel.cancel();
        warn!(relay = %relay.id, sender = %relay.sender, reason = %why, "relay given up: its files are removed, nothing is published");
        self.finish(relay, State::Aborted, Some(why.to_string()));
    }

    /// A relay's end: its files and journal removed, its bytes back.
    fn finish(&self, relay: &Arc<Relay>, state: State, detail: Option<String>) {
        {
            let mut st = crate::sync::lock(&relay.st);
            if st.released {
                return;
            }
            st.released = true;
            st.state = state;
            st.detail = detail;
        }
        self.settings.metrics.received(match state {
            State::Published => "published",
            State::AlreadyPublished => "already_published",
            State::Failed => "failed",
            State::Aborted | State::Receiving | State::Publishing => "aborted",
        });
        self.staging.remove(&relay.id);
        let mut inner = crate::sync::lock(&self.inner);
        if let Some(b) = inner.by_sender.get_mut(&relay.sender) {
            *b = b.saturating_sub(relay.bytes);
            if *b == 0 {
                inner.by_sender.remove(&relay.sender);
            }
        }
        inner.reserved = inner.reserved.saturating_sub(relay.bytes);
        inner.finished.push_back(relay.id.clone());
        while inner.finished.len() > KEEP_FINISHED {
            if let Some(old) = inner.finished.pop_front() {
                inner.relays.remove(&old);
            }
        }
    }
}

/// A file being received, counted in its relay's `busy` until dropped (the silent-sender reaper
/// leaves a relay alone while a request of it is reading, which has a deadline of its own).
struct Busy<'a>(&'a Relay);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        let mut st = crate::sync::lock(&self.0.st);
        st.busy = st.busy.saturating_sub(1);
        st.last = Instant::now();
    }
}

/// The answer to an I/O error while a file is staged: `507` when the volume is full, else `500`.
fn io_refusal(e: &std::io::Error) -> (StatusCode, String) {
    if is_disk_full(e) {
        (
            StatusCode::INSUFFICIENT_STORAGE,
            format!("the staging volume is full: {e}"),
        )
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }
}

fn file_len(f: &Incoming) -> u64 {
    f.len()
}

/// A JSON body of at most [`wire::MAX_JSON`] bytes.
async fn read_json<T: serde::de::DeserializeOwned>(req: Request<Body>) -> Result<T, Answer> {
    let limited = http_body_util::Limited::new(req.into_body(), wire::MAX_JSON);
    let data = limited.collect().await.map_err(|e| {
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the body could not be read within {} bytes: {e}",
                wire::MAX_JSON
            ),
        )
    })?;
    serde_json::from_slice(&data.to_bytes())
        .map_err(|e| refuse(StatusCode::BAD_REQUEST, format!("not a valid request: {e}")))
}

/// The checksums of a commit entry (`None`: not hex of the right length).
fn parse_crcs(f: &FileCrcs, len: u64) -> Option<Crcs> {
    if f.crc64nvme.len() != 16 || f.crc32c.len() != 8 {
        return None;
    }
    Some(Crcs {
        crc64nvme: u64::from_str_radix(&f.crc64nvme, 16).ok()?,
        crc32c: u32::from_str_radix(&f.crc32c, 16).ok()?,
        len,
    })
}
