//! An in-process fake Kubernetes API server (axum on `127.0.0.1:0`) implementing the small subset
//! spotguard's node operations use, faithfully: what it accepts, a real API server accepts.
//!
//! - Every object carries a `metadata.resourceVersion`, bumped on every write (one counter, like
//!   etcd's revision). A write carrying a stale resourceVersion gets `409 Conflict` with a
//!   `Status` body; a write that changes nothing is not persisted and keeps its resourceVersion.
//! - Nodes: GET, PUT and PATCH (`application/merge-patch+json`,
//!   `application/strategic-merge-patch+json` — `status.conditions` merged by `type`,
//!   `spec.taints` atomic as in the real schema — and `application/json-patch+json`), on the
//!   object (status changes ignored) and on the `status` subresource (spec changes ignored).
//! - Pods: list with `fieldSelector` (`spec.nodeName`, `metadata.name`, …) and `labelSelector`,
//!   GET, graceful DELETE (`gracePeriodSeconds`, preconditions), and the `eviction` subresource
//!   (policy/v1) with PodDisruptionBudget checks computed from the matching pods, answering 429
//!   with the real `Status` shape (message and `DisruptionBudget` cause naming the PDB).
//! - A simulated kubelet: a pod deleted with grace `g` disappears `min(g, deletion delay)` later,
//!   unless it was marked stuck.
//! - Events: create / patch in `events.k8s.io/v1` and core `v1`, validated like the real server.
//! - Discovery documents (`/api`, `/apis`, `/api/v1`, …) so that kubectl can talk to it.
//!
//! - Pod watches (`watch=true` on the pod collections): `resourceVersion` (empty or `0`: the
//!   current pods as ADDED first; otherwise every change after it, `410 Gone` as an ERROR event
//!   when it is older than the kept history), `fieldSelector` / `labelSelector` applied to each
//!   event's object, `timeoutSeconds` (the server ends the watch). No bookmarks.
//!
//! Knobs for tests and benches: per-request latency, faults per request kind ([`Fault::Delay`]:
//! answer after a delay; [`Fault::Blackhole`]: accept the request and never answer), injected
//! 500 / 409 on the next node writes, the kubelet deletion delay, stuck pods. Inspection: objects,
//! events, the request log and the number of mutating requests.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, NodeStatus, Pod, PodCondition, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::{json, Map, Value};
use tokio::time::Instant;

const MAX_BODY: usize = 4 << 20;

/// How a PodDisruptionBudget limits disruptions.
#[derive(Clone, Debug)]
pub enum PdbLimit {
    MinAvailable(IntOrString),
    MaxUnavailable(IntOrString),
}

/// Which Events API an event was created through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventApi {
    /// `events.k8s.io/v1`
    EventsV1,
    /// core `v1`
    Core,
}

/// One event as stored, flattened across both APIs.
#[derive(Clone, Debug)]
pub struct FakeEvent {
    pub api: EventApi,
    pub namespace: String,
    pub name: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    /// `note` (events.k8s.io/v1) or `message` (core).
    pub message: String,
    pub regarding_kind: String,
    pub regarding_name: String,
    pub regarding_namespace: String,
    pub reporting_controller: String,
    /// `series.count` / `count`, 1 for a single occurrence.
    pub count: i64,
    pub raw: Value,
}

/// One request as received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// Raw query string (percent-encoded), empty when none.
    pub query: String,
    pub content_type: Option<String>,
    pub body: String,
}

impl RecordedRequest {
    /// The body parsed as JSON, if it is.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.body).ok()
    }

    /// A decoded query parameter.
    pub fn query_param(&self, key: &str) -> Option<String> {
        parse_query(&self.query)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    pub fn is_write(&self) -> bool {
        !matches!(self.method.as_str(), "GET" | "HEAD")
    }
}

/// Handle to a running fake API server; the server stops when the handle is dropped.
pub struct FakeApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Shared {
    store: Mutex<Store>,
    /// Woken on every pod change (watches).
    pods_changed: tokio::sync::Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct StoredPod {
    obj: Value,
    /// When the simulated kubelet finishes the deletion (`None`: not deleting, or stuck).
    gone_at: Option<Instant>,
}

struct StoredEvent {
    api: EventApi,
    namespace: String,
    name: String,
    obj: Value,
}

/// Which kind of request a [`Fault`] applies to.
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
    /// `POST …/eviction`.
    Eviction,
    /// `GET` of nodes.
    NodeGet,
    /// `PATCH` / `PUT` of a node or its status.
    NodeWrite,
    /// Events (either API).
    Event,
    /// Anything else (discovery, PDBs, …).
    Other,
}

/// What to do to the requests of one [`RequestKind`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer after this delay.
    Delay(Duration),
    /// Accept the request and never answer (a silently dropping API server or proxy).
    Blackhole,
}

fn request_kind(method: &Method, segs: &[&str], q: &Query) -> RequestKind {
    let watch = matches!(qget(q, "watch"), Some("true" | "1"));
    match (method.as_str(), segs) {
        ("GET", ["api", "v1", "pods"]) | ("GET", ["api", "v1", "namespaces", _, "pods"]) => {
            if watch {
                RequestKind::PodWatch
            } else {
                RequestKind::PodList
            }
        }
        ("GET", ["api", "v1", "namespaces", _, "pods", _]) => RequestKind::PodGet,
        ("DELETE", ["api", "v1", "namespaces", _, "pods", _]) => RequestKind::PodDelete,
        ("POST", ["api", "v1", "namespaces", _, "pods", _, "eviction"]) => RequestKind::Eviction,
        ("GET", ["api", "v1", "nodes", ..]) => RequestKind::NodeGet,
        ("PATCH" | "PUT", ["api", "v1", "nodes", ..]) => RequestKind::NodeWrite,
        (_, ["api", "v1", "namespaces", _, "events", ..])
        | (_, ["apis", "events.k8s.io", "v1", "namespaces", _, "events", ..]) => RequestKind::Event,
        _ => RequestKind::Other,
    }
}

/// How many pod changes the watch history keeps (older resourceVersions get `410 Gone`).
const POD_HISTORY: usize = 4096;

/// One pod change, for watches.
struct PodChange {
    rv: u64,
    kind: &'static str,
    obj: Value,
}

#[derive(Default)]
struct Knobs {
    latency: Duration,
    /// Per-kind faults; `None` key: every kind without its own.
    faults: std::collections::HashMap<Option<RequestKind>, Fault>,
    node_write_faults: VecDeque<u16>,
    deletion_delay: Duration,
    stuck: HashSet<(String, String)>,
    /// (method, path, code): requests refused outright.
    refusals: Vec<(String, String, u16)>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    seq: u64,
    nodes: BTreeMap<String, Value>,
    pods: BTreeMap<(String, String), StoredPod>,
    pdbs: BTreeMap<(String, String), Value>,
    events: Vec<StoredEvent>,
    requests: Vec<RecordedRequest>,
    writes: u64,
    served: Duration,
    knobs: Knobs,
    port: u16,
    pod_history: VecDeque<PodChange>,
}

impl FakeApiServer {
    /// Bind `127.0.0.1:0` and serve until the handle is dropped.
    pub async fn start() -> std::io::Result<FakeApiServer> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                port: addr.port(),
                ..Store::default()
            }),
            pods_changed: tokio::sync::Notify::new(),
        });
        let app = axum::Router::new()
            .fallback(handle)
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "fake API server stopped");
            }
        });
        Ok(FakeApiServer { addr, shared, task })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A kube client for this server: plain HTTP, no auth, and without kube's built-in retry
    /// layer (spotguard classifies 429s and 5xx itself).
    pub fn client(&self) -> kube::Client {
        let uri: http::Uri = match self.url().parse() {
            Ok(u) => u,
            Err(e) => panic!("loopback URL {} does not parse: {e}", self.url()),
        };
        let mut config = kube::Config::new(uri);
        config.default_retry = false;
        match kube::Client::try_from(config) {
            Ok(c) => c,
            Err(e) => panic!("building a kube client for the fake API server: {e}"),
        }
    }

    /// A kubeconfig (YAML) pointing at this server, for kubectl.
    pub fn kubeconfig(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        )
    }

    // === seed ===

    pub fn add_node(&self, node: Node) {
        let mut s = self.shared.lock();
        let mut obj = to_value(&node);
        set_kind(&mut obj, "v1", "Node");
        let name = str_at(&obj, "/metadata/name").to_string();
        s.stamp_new(&mut obj);
        s.nodes.insert(name, obj);
    }

    pub fn add_pod(&self, pod: Pod) {
        let mut s = self.shared.lock();
        let mut obj = to_value(&pod);
        set_kind(&mut obj, "v1", "Pod");
        let ns = str_at(&obj, "/metadata/namespace").to_string();
        let ns = if ns.is_empty() {
            "default".to_string()
        } else {
            ns
        };
        obj["metadata"]["namespace"] = json!(ns);
        let name = str_at(&obj, "/metadata/name").to_string();
        s.stamp_new(&mut obj);
        let kind = if s.pods.contains_key(&(ns.clone(), name.clone())) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        s.pod_changed(kind, &obj);
        s.pods.insert((ns, name), StoredPod { obj, gone_at: None });
        drop(s);
        self.shared.pods_changed.notify_waiters();
    }

    /// Remove a pod at once (the kubelet and the registry are done with it).
    pub fn remove_pod(&self, namespace: &str, name: &str) {
        let mut s = self.shared.lock();
        if let Some(p) = s.pods.remove(&(namespace.to_string(), name.to_string())) {
            let mut obj = p.obj;
            obj["metadata"]["resourceVersion"] = json!(s.bump());
            s.pod_changed("DELETED", &obj);
        }
        drop(s);
        self.shared.pods_changed.notify_waiters();
    }

    /// A policy/v1 PodDisruptionBudget selecting pods by `matchLabels`.
    pub fn add_pdb(&self, namespace: &str, name: &str, selector: &[(&str, &str)], limit: PdbLimit) {
        let mut s = self.shared.lock();
        let labels: Map<String, Value> = selector
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let mut spec = json!({ "selector": { "matchLabels": labels } });
        match limit {
            PdbLimit::MinAvailable(v) => spec["minAvailable"] = to_value(&v),
            PdbLimit::MaxUnavailable(v) => spec["maxUnavailable"] = to_value(&v),
        }
        let mut obj = json!({
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": { "name": name, "namespace": namespace },
            "spec": spec,
        });
        s.stamp_new(&mut obj);
        s.pdbs
            .insert((namespace.to_string(), name.to_string()), obj);
    }

    /// Replace a pod's phase (e.g. a pod that finished).
    pub fn set_pod_phase(&self, namespace: &str, name: &str, phase: &str) {
        let mut s = self.shared.lock();
        let rv = s.bump();
        let mut changed = None;
        if let Some(p) = s.pods.get_mut(&(namespace.to_string(), name.to_string())) {
            p.obj["status"]["phase"] = json!(phase);
            p.obj["metadata"]["resourceVersion"] = json!(rv);
            changed = Some(p.obj.clone());
        }
        if let Some(obj) = changed {
            s.pod_changed("MODIFIED", &obj);
        }
        drop(s);
        self.shared.pods_changed.notify_waiters();
    }

    // === knobs ===

    /// Delay every request by this much before it is handled.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.lock().knobs.latency = latency;
    }

    /// Apply `fault` to every new request of `kind` (`None`: of every kind that has no fault of
    /// its own); `fault: None` removes it. Requests already being answered are not affected.
    pub fn set_fault(&self, kind: Option<RequestKind>, fault: Option<Fault>) {
        let mut s = self.shared.lock();
        match fault {
            Some(f) => {
                s.knobs.faults.insert(kind, f);
            }
            None => {
                s.knobs.faults.remove(&kind);
            }
        }
    }

    /// Remove every fault.
    pub fn clear_faults(&self) {
        self.shared.lock().knobs.faults.clear();
    }

    /// Answer the next `n` node writes (PATCH / PUT, object or status) with `code` (500 or 409),
    /// without applying them.
    pub fn fail_node_writes(&self, code: u16, n: usize) {
        let mut s = self.shared.lock();
        s.knobs
            .node_write_faults
            .extend(std::iter::repeat_n(code, n));
    }

    /// Answer every `method` request to exactly `path` with `code` (e.g. 403: RBAC missing).
    pub fn refuse(&self, method: &str, path: &str, code: u16) {
        let mut s = self.shared.lock();
        s.knobs
            .refusals
            .push((method.to_string(), path.to_string(), code));
    }

    /// The simulated kubelet removes a pod `min(grace, delay)` after its graceful deletion.
    pub fn set_deletion_delay(&self, delay: Duration) {
        self.shared.lock().knobs.deletion_delay = delay;
    }

    /// The deletion of this pod never completes (kubelet gone, finalizer, …).
    pub fn stick_pod(&self, namespace: &str, name: &str) {
        let mut s = self.shared.lock();
        let key = (namespace.to_string(), name.to_string());
        if let Some(p) = s.pods.get_mut(&key) {
            p.gone_at = None;
        }
        s.knobs.stuck.insert(key);
    }

    // === inspection ===

    pub fn node(&self, name: &str) -> Option<Node> {
        let mut s = self.shared.lock();
        s.purge();
        s.nodes
            .get(name)
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }

    /// The node as stored (JSON).
    pub fn node_json(&self, name: &str) -> Option<Value> {
        self.shared.lock().nodes.get(name).cloned()
    }

    /// Replace a node's annotation directly (as an operator or another controller would).
    pub fn set_node_annotation(&self, node: &str, key: &str, value: &str) {
        let mut s = self.shared.lock();
        let rv = s.bump();
        if let Some(n) = s.nodes.get_mut(node) {
            if !n["metadata"]["annotations"].is_object() {
                n["metadata"]["annotations"] = json!({});
            }
            n["metadata"]["annotations"][key] = json!(value);
            n["metadata"]["resourceVersion"] = json!(rv);
        }
    }

    /// Pods still present (including terminating ones).
    pub fn pods(&self) -> Vec<Pod> {
        let mut s = self.shared.lock();
        s.purge();
        s.pods
            .values()
            .filter_map(|p| serde_json::from_value(p.obj.clone()).ok())
            .collect()
    }

    pub fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let mut s = self.shared.lock();
        s.purge();
        s.pods
            .get(&(namespace.to_string(), name.to_string()))
            .and_then(|p| serde_json::from_value(p.obj.clone()).ok())
    }

    pub fn events(&self) -> Vec<FakeEvent> {
        let s = self.shared.lock();
        s.events.iter().map(flatten_event).collect()
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.lock().requests.clone()
    }

    pub fn clear_requests(&self) {
        let mut s = self.shared.lock();
        s.requests.clear();
        s.writes = 0;
    }

    /// Number of mutating requests (anything but GET/HEAD) received, whatever their outcome.
    pub fn write_count(&self) -> u64 {
        self.shared.lock().writes
    }

    /// Total latency the server added (sum over requests).
    pub fn served_latency(&self) -> Duration {
        self.shared.lock().served
    }
}

// === request handling ===

struct Reply {
    code: StatusCode,
    body: Value,
    warnings: Vec<String>,
}

impl Reply {
    fn ok(body: Value) -> Reply {
        Reply {
            code: StatusCode::OK,
            body,
            warnings: Vec::new(),
        }
    }
    fn created(body: Value) -> Reply {
        Reply {
            code: StatusCode::CREATED,
            body,
            warnings: Vec::new(),
        }
    }
}

/// A failure answered with a `Status` object.
#[derive(Debug)]
struct ApiErr {
    code: u16,
    reason: &'static str,
    message: String,
    details: Option<Value>,
}

impl ApiErr {
    fn new(code: u16, reason: &'static str, message: impl Into<String>) -> ApiErr {
        ApiErr {
            code,
            reason,
            message: message.into(),
            details: None,
        }
    }
    fn details(mut self, d: Value) -> ApiErr {
        self.details = Some(d);
        self
    }
    fn bad_request(message: impl Into<String>) -> ApiErr {
        ApiErr::new(400, "BadRequest", message)
    }
    fn not_found(resource: &str, name: &str) -> ApiErr {
        ApiErr::new(404, "NotFound", format!("{resource} \"{name}\" not found"))
            .details(json!({ "name": name, "kind": resource }))
    }
    fn conflict(resource: &str, name: &str) -> ApiErr {
        ApiErr::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {resource} \"{name}\": the object has been \
                 modified; please apply your changes to the latest version and try again"
            ),
        )
        .details(json!({ "name": name, "kind": resource }))
    }
    fn invalid(kind: &str, name: &str, causes: Vec<(String, String)>) -> ApiErr {
        let msgs: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let causes: Vec<Value> = causes
            .into_iter()
            .map(|(f, m)| json!({ "reason": "FieldValueInvalid", "message": m, "field": f }))
            .collect();
        ApiErr::new(
            422,
            "Invalid",
            format!("{kind} \"{name}\" is invalid: [{}]", msgs.join(", ")),
        )
        .details(json!({ "name": name, "kind": kind, "causes": causes }))
    }

    fn status(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            v["details"] = d.clone();
        }
        v
    }
}

type ApiResult = Result<Reply, ApiErr>;

async fn handle(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(e) => return respond(Err(ApiErr::bad_request(format!("reading body: {e}")))),
    };
    let method = parts.method.clone();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or("").to_string();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or("").trim().to_string());
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let q = parse_query(&query);
    let kind = request_kind(&method, &segs, &q);
    let (latency, fault) = {
        let mut s = shared.lock();
        let rec = RecordedRequest {
            method: method.to_string(),
            path: path.clone(),
            query: query.clone(),
            content_type: content_type.clone(),
            body: String::from_utf8_lossy(&bytes).into_owned(),
        };
        if rec.is_write() {
            s.writes += 1;
        }
        s.requests.push(rec);
        let latency = s.knobs.latency;
        s.served += latency;
        let fault = s
            .knobs
            .faults
            .get(&Some(kind))
            .or_else(|| s.knobs.faults.get(&None))
            .copied();
        (latency, fault)
    };
    if !latency.is_zero() {
        tokio::time::sleep(latency).await;
    }
    match fault {
        Some(Fault::Delay(d)) => tokio::time::sleep(d).await,
        Some(Fault::Blackhole) => std::future::pending::<()>().await,
        None => {}
    }
    if kind == RequestKind::PodWatch {
        let ns = match segs.as_slice() {
            ["api", "v1", "namespaces", ns, "pods"] => Some(ns.to_string()),
            _ => None,
        };
        return watch_pods(shared, ns, &q);
    }
    let (result, changed) = {
        let mut s = shared.lock();
        let before = s.rv;
        s.purge();
        let refused = s
            .knobs
            .refusals
            .iter()
            .find(|(m, p, _)| *m == method.as_str() && *p == path)
            .map(|(_, _, code)| *code);
        let r = match refused {
            Some(code) => Err(ApiErr::new(
                code,
                if code == 403 {
                    "Forbidden"
                } else {
                    "InternalError"
                },
                format!("{method} {path} refused by the test"),
            )),
            None => s.route(&method, &path, &q, content_type.as_deref(), &bytes),
        };
        (r, before != s.rv)
    };
    if changed {
        shared.pods_changed.notify_waiters();
    }
    respond(result)
}

/// A pod watch: stream `{"type", "object"}` lines, one per change after the requested
/// resourceVersion, filtered by the selectors, until `timeoutSeconds`.
fn watch_pods(shared: Arc<Shared>, ns: Option<String>, q: &Query) -> Response {
    let pod_fields = [
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ];
    let fs = match parse_field_selector(qget(q, "fieldSelector").unwrap_or(""), &pod_fields) {
        Ok(f) => f,
        Err(e) => return respond(Err(e)),
    };
    let ls = match parse_label_selector(qget(q, "labelSelector").unwrap_or("")) {
        Ok(l) => l,
        Err(e) => return respond(Err(e)),
    };
    let timeout = qget(q, "timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(Duration::from_secs(1800));
    let matches = Arc::new(move |obj: &Value| {
        ns.as_deref()
            .is_none_or(|n| str_at(obj, "/metadata/namespace") == n)
            && fields_match(obj, &fs)
            && labels_match(obj, &ls)
    });
    let line = |kind: &str, obj: &Value| {
        let mut l = json!({ "type": kind, "object": obj }).to_string();
        l.push('\n');
        bytes::Bytes::from(l)
    };
    // The starting point and the initial lines.
    let mut first: Vec<bytes::Bytes> = Vec::new();
    let start_rv = {
        let mut s = shared.lock();
        s.purge();
        match qget(q, "resourceVersion").unwrap_or("") {
            "" | "0" => {
                for p in s.pods.values().filter(|p| matches(&p.obj)) {
                    first.push(line("ADDED", &p.obj));
                }
                s.rv
            }
            v => match v.parse::<u64>() {
                Ok(rv) if s.pod_history.front().is_some_and(|c| c.rv > rv + 1) => {
                    let status = ApiErr::new(
                        410,
                        "Expired",
                        format!("too old resource version: {rv} ({})", s.rv),
                    )
                    .status();
                    first.push(line("ERROR", &status));
                    u64::MAX
                }
                Ok(rv) => rv,
                Err(_) => {
                    return respond(Err(ApiErr::bad_request(format!(
                        "invalid resourceVersion {v:?}"
                    ))))
                }
            },
        }
    };
    let end = Instant::now() + timeout;
    let initial = futures::stream::iter(first.into_iter().map(Ok::<_, std::io::Error>));
    let follow = futures::stream::unfold((shared, start_rv, end), move |(shared, mut rv, end)| {
        let matches = matches.clone();
        async move {
            if rv == u64::MAX {
                return None;
            }
            loop {
                let batch: Vec<bytes::Bytes> = {
                    let mut s = shared.lock();
                    s.purge();
                    let from = rv;
                    let mut out = Vec::new();
                    for c in s.pod_history.iter().filter(|c| c.rv > from) {
                        rv = c.rv;
                        if matches(&c.obj) {
                            out.push(line(c.kind, &c.obj));
                        }
                    }
                    out
                };
                if !batch.is_empty() {
                    return Some((Ok(bytes::Bytes::from(batch.concat())), (shared, rv, end)));
                }
                if Instant::now() >= end {
                    return None;
                }
                // The simulated kubelet changes pods on its own schedule: look again soon.
                let notified = shared.pods_changed.notified();
                let _ = tokio::time::timeout(Duration::from_millis(50), notified).await;
            }
        }
    });
    let body = axum::body::Body::from_stream(futures::StreamExt::chain(initial, follow));
    let mut resp = (StatusCode::OK, body).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn respond(result: ApiResult) -> Response {
    let (code, body, warnings) = match result {
        Ok(r) => (r.code, r.body, r.warnings),
        Err(e) => (
            StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            e.status(),
            Vec::new(),
        ),
    };
    let mut resp = (code, body.to_string()).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for w in warnings {
        if let Ok(v) = HeaderValue::from_str(&format!("299 - \"{}\"", w.replace('"', "\\\""))) {
            resp.headers_mut().append(header::WARNING, v);
        }
    }
    resp
}

type Query = Vec<(String, String)>;

fn qget<'a>(q: &'a Query, key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn is_dry_run(q: &Query) -> bool {
    q.iter().any(|(k, v)| k == "dryRun" && v == "All")
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum NodePart {
    Object,
    Status,
}

impl Store {
    /// Record a pod change for watches (`obj` carries its new resourceVersion).
    fn pod_changed(&mut self, kind: &'static str, obj: &Value) {
        let rv = str_at(obj, "/metadata/resourceVersion")
            .parse()
            .unwrap_or(self.rv);
        self.pod_history.push_back(PodChange {
            rv,
            kind,
            obj: obj.clone(),
        });
        while self.pod_history.len() > POD_HISTORY {
            self.pod_history.pop_front();
        }
    }

    fn bump(&mut self) -> String {
        self.rv += 1;
        self.rv.to_string()
    }

    fn next_uid(&mut self) -> String {
        self.seq += 1;
        format!("00000000-0000-4000-8000-{:012x}", self.seq)
    }

    /// Identity for a newly stored object: uid, creationTimestamp, resourceVersion.
    fn stamp_new(&mut self, obj: &mut Value) {
        if !obj["metadata"].is_object() {
            obj["metadata"] = json!({});
        }
        if str_at(obj, "/metadata/uid").is_empty() {
            obj["metadata"]["uid"] = json!(self.next_uid());
        }
        if str_at(obj, "/metadata/creationTimestamp").is_empty() {
            obj["metadata"]["creationTimestamp"] = json!(now_seconds().to_string());
        }
        obj["metadata"]["resourceVersion"] = json!(self.bump());
    }

    /// The simulated kubelet: remove pods whose graceful deletion has run its course.
    fn purge(&mut self) {
        let now = Instant::now();
        let done: Vec<(String, String)> = self
            .pods
            .iter()
            .filter(|(_, p)| p.gone_at.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in done {
            if let Some(p) = self.pods.remove(&k) {
                let mut obj = p.obj;
                obj["metadata"]["resourceVersion"] = json!(self.bump());
                self.pod_changed("DELETED", &obj);
            }
        }
    }

    fn route(
        &mut self,
        method: &Method,
        path: &str,
        q: &Query,
        ct: Option<&str>,
        body: &[u8],
    ) -> ApiResult {
        let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        match (method.as_str(), segs.as_slice()) {
            ("GET", ["version"]) => Ok(Reply::ok(json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-spotguard-fake",
                "platform": "linux/amd64",
            }))),
            ("GET", ["api"]) => Ok(Reply::ok(json!({
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    { "clientCIDR": "0.0.0.0/0", "serverAddress": format!("127.0.0.1:{}", self.port) }
                ],
            }))),
            ("GET", ["apis"]) => Ok(Reply::ok(discovery_groups())),
            ("GET", ["api", "v1"]) => Ok(Reply::ok(discovery_core())),
            ("GET", ["apis", "policy", "v1"]) => Ok(Reply::ok(discovery_policy())),
            ("GET", ["apis", "events.k8s.io", "v1"]) => Ok(Reply::ok(discovery_events())),

            ("GET", ["api", "v1", "nodes"]) => self.list_nodes(q),
            ("GET", ["api", "v1", "nodes", name]) | ("GET", ["api", "v1", "nodes", name, "status"]) => self
                .nodes
                .get(*name)
                .map(|n| Reply::ok(n.clone()))
                .ok_or_else(|| ApiErr::not_found("nodes", name)),
            ("PATCH", ["api", "v1", "nodes", name]) => self.patch_node(name, NodePart::Object, q, ct, body),
            ("PATCH", ["api", "v1", "nodes", name, "status"]) => {
                self.patch_node(name, NodePart::Status, q, ct, body)
            }
            ("PUT", ["api", "v1", "nodes", name]) => self.put_node(name, NodePart::Object, q, body),
            ("PUT", ["api", "v1", "nodes", name, "status"]) => self.put_node(name, NodePart::Status, q, body),

            ("GET", ["api", "v1", "pods"]) => self.list_pods(None, q),
            ("GET", ["api", "v1", "namespaces", ns, "pods"]) => self.list_pods(Some(ns), q),
            ("GET", ["api", "v1", "namespaces", ns, "pods", name]) => self
                .pods
                .get(&(ns.to_string(), name.to_string()))
                .map(|p| Reply::ok(p.obj.clone()))
                .ok_or_else(|| ApiErr::not_found("pods", name)),
            ("DELETE", ["api", "v1", "namespaces", ns, "pods", name]) => self.delete_pod(ns, name, q, body),
            ("POST", ["api", "v1", "namespaces", ns, "pods", name, "eviction"]) => self.evict(ns, name, q, body),

            ("GET", ["apis", "policy", "v1", "poddisruptionbudgets"]) => Ok(self.list_pdbs(None)),
            ("GET", ["apis", "policy", "v1", "namespaces", ns, "poddisruptionbudgets"]) => {
                Ok(self.list_pdbs(Some(ns)))
            }

            ("POST", ["api", "v1", "namespaces", ns, "events"]) => self.create_event(EventApi::Core, ns, q, body),
            ("POST", ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"]) => {
                self.create_event(EventApi::EventsV1, ns, q, body)
            }
            ("PATCH", ["api", "v1", "namespaces", ns, "events", name]) => {
                self.patch_event(EventApi::Core, ns, name, q, ct, body)
            }
            ("PATCH", ["apis", "events.k8s.io", "v1", "namespaces", ns, "events", name]) => {
                self.patch_event(EventApi::EventsV1, ns, name, q, ct, body)
            }
            ("GET", ["api", "v1", "namespaces", ns, "events"]) => Ok(self.list_events(EventApi::Core, ns)),
            ("GET", ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"]) => {
                Ok(self.list_events(EventApi::EventsV1, ns))
            }

            (_, ["api", "v1", ..]) | (_, ["apis", ..]) if known_resource_path(&segs) => Err(ApiErr::new(
                405,
                "MethodNotAllowed",
                format!("the server does not allow this method on the requested resource: {method} {path}"),
            )),
            _ => Err(ApiErr::new(404, "NotFound", "the server could not find the requested resource")
                .details(json!({}))),
        }
    }

    // --- nodes ---

    fn list_nodes(&self, q: &Query) -> ApiResult {
        let fs = parse_field_selector(
            qget(q, "fieldSelector").unwrap_or(""),
            &["metadata.name", "spec.unschedulable"],
        )?;
        let ls = parse_label_selector(qget(q, "labelSelector").unwrap_or(""))?;
        let items: Vec<Value> = self
            .nodes
            .values()
            .filter(|n| fields_match(n, &fs) && labels_match(n, &ls))
            .cloned()
            .collect();
        Ok(Reply::ok(json!({
            "kind": "NodeList", "apiVersion": "v1",
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": items,
        })))
    }

    fn take_node_fault(&mut self, name: &str) -> Result<(), ApiErr> {
        match self.knobs.node_write_faults.pop_front() {
            None => Ok(()),
            Some(409) => Err(ApiErr::conflict("nodes", name)),
            Some(code) => Err(ApiErr::new(
                code,
                if code == 429 {
                    "TooManyRequests"
                } else {
                    "InternalError"
                },
                "Internal error occurred: injected fault",
            )
            .details(json!({ "causes": [{ "message": "injected fault" }] }))),
        }
    }

    fn patch_node(
        &mut self,
        name: &str,
        part: NodePart,
        q: &Query,
        ct: Option<&str>,
        body: &[u8],
    ) -> ApiResult {
        self.take_node_fault(name)?;
        let current = self
            .nodes
            .get(name)
            .cloned()
            .ok_or_else(|| ApiErr::not_found("nodes", name))?;
        let patch = parse_json(body)?;
        let patched = apply_patch(&current, &patch, ct)?;
        self.commit_node(name, &current, patched, part, is_dry_run(q))
    }

    fn put_node(&mut self, name: &str, part: NodePart, q: &Query, body: &[u8]) -> ApiResult {
        self.take_node_fault(name)?;
        let current = self
            .nodes
            .get(name)
            .cloned()
            .ok_or_else(|| ApiErr::not_found("nodes", name))?;
        let new = parse_json(body)?;
        if !new.is_object() {
            return Err(ApiErr::bad_request(
                "the body of the request is not a Node object",
            ));
        }
        self.commit_node(name, &current, new, part, is_dry_run(q))
    }

    fn commit_node(
        &mut self,
        name: &str,
        current: &Value,
        mut new: Value,
        part: NodePart,
        dry: bool,
    ) -> ApiResult {
        match new.pointer("/metadata/resourceVersion") {
            None | Some(Value::Null) => {}
            Some(Value::String(rv)) if rv.is_empty() => {}
            Some(Value::String(rv)) => {
                if rv != str_at(current, "/metadata/resourceVersion") {
                    return Err(ApiErr::conflict("nodes", name));
                }
            }
            Some(other) => {
                return Err(ApiErr::bad_request(format!(
                    "metadata.resourceVersion must be a string, got {other}"
                )))
            }
        }
        if let Some(n) = new.pointer("/metadata/name").and_then(Value::as_str) {
            if n != name {
                return Err(ApiErr::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
        }
        // Status and spec are owned by different endpoints (nodeStrategy / nodeStatusStrategy).
        let mut new = match part {
            NodePart::Object => {
                restore(&mut new, current, "status");
                new
            }
            NodePart::Status => {
                let mut merged = current.clone();
                restore(&mut merged, &new, "status");
                merged
            }
        };
        for key in ["name", "uid", "creationTimestamp"] {
            new["metadata"][key] = current["metadata"][key].clone();
        }
        set_kind(&mut new, "v1", "Node");
        validate_node(name, &new)?;
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        if new == *current {
            // Nothing changed: not persisted, resourceVersion unchanged.
            return Ok(Reply::ok(new));
        }
        if dry {
            return Ok(Reply::ok(new));
        }
        new["metadata"]["resourceVersion"] = json!(self.bump());
        self.nodes.insert(name.to_string(), new.clone());
        Ok(Reply::ok(new))
    }

    // --- pods ---

    fn list_pods(&self, ns: Option<&str>, q: &Query) -> ApiResult {
        let fs = parse_field_selector(
            qget(q, "fieldSelector").unwrap_or(""),
            &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
        )?;
        let ls = parse_label_selector(qget(q, "labelSelector").unwrap_or(""))?;
        let items: Vec<Value> = self
            .pods
            .iter()
            .filter(|((pns, _), _)| ns.is_none_or(|n| n == pns))
            .filter(|(_, p)| fields_match(&p.obj, &fs) && labels_match(&p.obj, &ls))
            .map(|(_, p)| p.obj.clone())
            .collect();
        Ok(Reply::ok(json!({
            "kind": "PodList", "apiVersion": "v1",
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": items,
        })))
    }

    fn delete_pod(&mut self, ns: &str, name: &str, q: &Query, body: &[u8]) -> ApiResult {
        let key = (ns.to_string(), name.to_string());
        if !self.pods.contains_key(&key) {
            return Err(ApiErr::not_found("pods", name));
        }
        let mut opts = if body.iter().all(u8::is_ascii_whitespace) {
            json!({})
        } else {
            parse_json(body)?
        };
        if let Some(g) = qget(q, "gracePeriodSeconds") {
            let g: i64 = g
                .parse()
                .map_err(|_| ApiErr::bad_request(format!("invalid gracePeriodSeconds {g:?}")))?;
            opts["gracePeriodSeconds"] = json!(g);
        }
        let dry = is_dry_run(q)
            || opts["dryRun"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v == "All"));
        self.check_preconditions(&key, &opts)?;
        let obj = self.graceful_delete(&key, opts["gracePeriodSeconds"].as_i64(), dry)?;
        Ok(Reply::ok(obj))
    }

    fn check_preconditions(&self, key: &(String, String), opts: &Value) -> Result<(), ApiErr> {
        let Some(pod) = self.pods.get(key) else {
            return Err(ApiErr::not_found("pods", &key.1));
        };
        let uid = str_at(&pod.obj, "/metadata/uid");
        if let Some(want) = opts.pointer("/preconditions/uid").and_then(Value::as_str) {
            if want != uid {
                return Err(ApiErr::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on Pod \"{}\": Precondition failed: UID in \
                         precondition: {want}, UID in object meta: {uid}",
                        key.1
                    ),
                )
                .details(json!({ "name": key.1, "kind": "Pod" })));
            }
        }
        if let Some(want) = opts
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
        {
            let rv = str_at(&pod.obj, "/metadata/resourceVersion");
            if want != rv {
                return Err(ApiErr::new(
                    409,
                    "Conflict",
                    format!(
                        "Operation cannot be fulfilled on Pod \"{}\": Precondition failed: \
                         ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rv}",
                        key.1
                    ),
                )
                .details(json!({ "name": key.1, "kind": "Pod" })));
            }
        }
        Ok(())
    }

    /// Pod graceful deletion as the registry does it; returns the pod as it now stands.
    fn graceful_delete(
        &mut self,
        key: &(String, String),
        grace: Option<i64>,
        dry: bool,
    ) -> Result<Value, ApiErr> {
        let delay = self.knobs.deletion_delay;
        let stuck = self.knobs.stuck.contains(key);
        let Some(pod) = self.pods.get(key) else {
            return Err(ApiErr::not_found("pods", &key.1));
        };
        let own_grace = pod.obj["spec"]["terminationGracePeriodSeconds"]
            .as_i64()
            .unwrap_or(30);
        let mut grace = grace.unwrap_or(own_grace);
        if grace < 0 {
            grace = 1;
        }
        let phase = str_at(&pod.obj, "/status/phase");
        if str_at(&pod.obj, "/spec/nodeName").is_empty()
            || phase == "Succeeded"
            || phase == "Failed"
        {
            grace = 0;
        }
        if dry {
            return Ok(pod.obj.clone());
        }
        if grace == 0 && !stuck {
            let mut obj = pod.obj.clone();
            self.pods.remove(key);
            obj["metadata"]["resourceVersion"] = json!(self.bump());
            self.pod_changed("DELETED", &obj);
            return Ok(obj);
        }
        let existing = pod.obj["metadata"]["deletionGracePeriodSeconds"].as_i64();
        if existing.is_some_and(|g| g <= grace) {
            return Ok(pod.obj.clone());
        }
        let rv = self.bump();
        let Some(pod) = self.pods.get_mut(key) else {
            return Err(ApiErr::not_found("pods", &key.1));
        };
        let deletion = Timestamp::from_second(now_seconds().as_second() + grace)
            .unwrap_or_else(|_| now_seconds());
        pod.obj["metadata"]["deletionTimestamp"] = json!(deletion.to_string());
        pod.obj["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
        pod.obj["metadata"]["resourceVersion"] = json!(rv);
        if !stuck {
            let after = delay.min(Duration::from_secs(grace.unsigned_abs()));
            let at = Instant::now() + after;
            pod.gone_at = Some(pod.gone_at.map_or(at, |t| t.min(at)));
        }
        let obj = pod.obj.clone();
        self.pod_changed("MODIFIED", &obj);
        Ok(obj)
    }

    fn evict(&mut self, ns: &str, name: &str, q: &Query, body: &[u8]) -> ApiResult {
        let eviction = parse_json(body)?;
        let Value::Object(fields) = &eviction else {
            return Err(ApiErr::bad_request(
                "the body of the request is not an Eviction object",
            ));
        };
        if let Some(kind) = fields.get("kind").and_then(Value::as_str) {
            if kind != "Eviction" {
                return Err(ApiErr::bad_request(format!(
                    "expected kind Eviction, got {kind}"
                )));
            }
        }
        if let Some(av) = fields.get("apiVersion").and_then(Value::as_str) {
            if av != "policy/v1" && av != "policy/v1beta1" {
                return Err(ApiErr::bad_request(format!(
                    "the API version in the data ({av}) does not match the expected API version (policy/v1)"
                )));
            }
        }
        if str_at(&eviction, "/metadata/name") != name {
            return Err(ApiErr::bad_request(
                "name in URL does not match name in Eviction object",
            ));
        }
        let body_ns = str_at(&eviction, "/metadata/namespace");
        if !body_ns.is_empty() && body_ns != ns {
            return Err(ApiErr::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        // The real server drops unknown fields with a warning (fieldValidation=Warn by default).
        let warnings: Vec<String> = fields
            .keys()
            .filter(|k| {
                !matches!(
                    k.as_str(),
                    "apiVersion" | "kind" | "metadata" | "deleteOptions"
                )
            })
            .map(|k| format!("unknown field \"{k}\""))
            .collect();
        let opts = fields
            .get("deleteOptions")
            .cloned()
            .unwrap_or_else(|| json!({}));
        let key = (ns.to_string(), name.to_string());
        let Some(pod) = self.pods.get(&key) else {
            return Err(ApiErr::not_found("pods", name));
        };
        let pod = pod.obj.clone();
        self.check_preconditions(&key, &opts)?;
        let dry = is_dry_run(q)
            || opts["dryRun"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v == "All"));
        let phase = str_at(&pod, "/status/phase");
        let terminating = !str_at(&pod, "/metadata/deletionTimestamp").is_empty();
        let ignore_pdb = matches!(phase, "Succeeded" | "Failed" | "Pending") || terminating;
        if !ignore_pdb {
            let pdbs = self.pdbs_for(ns, &pod);
            if pdbs.len() > 1 {
                return Err(ApiErr::new(
                    500,
                    "InternalError",
                    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
                ));
            }
            if let Some(pdb) = pdbs.first() {
                let st = self.pdb_status(pdb);
                let pdb_name = str_at(pdb, "/metadata/name").to_string();
                let healthy_pod = pod_is_healthy(&pod);
                // Unhealthy pods may go while the budget is met (IfHealthyBudget, the default).
                let allowed = if healthy_pod {
                    st.allowed > 0
                } else {
                    st.healthy >= st.desired
                };
                if !allowed {
                    return Err(ApiErr::new(
                        429,
                        "TooManyRequests",
                        "Cannot evict pod as it would violate the pod's disruption budget.",
                    )
                    .details(json!({
                        "causes": [{
                            "reason": "DisruptionBudget",
                            "message": format!(
                                "The disruption budget {pdb_name} needs {} healthy pods and has {} currently",
                                st.desired, st.healthy
                            ),
                        }]
                    })));
                }
            }
        }
        self.graceful_delete(&key, opts["gracePeriodSeconds"].as_i64(), dry)?;
        Ok(Reply {
            code: StatusCode::CREATED,
            body: json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success" }),
            warnings,
        })
    }

    // --- PodDisruptionBudgets (the disruption controller's arithmetic, computed on demand) ---

    fn pdbs_for(&self, ns: &str, pod: &Value) -> Vec<Value> {
        let no_labels = pod["metadata"]["labels"]
            .as_object()
            .is_none_or(Map::is_empty);
        if no_labels {
            return Vec::new();
        }
        self.pdbs
            .iter()
            .filter(|((pns, _), pdb)| pns == ns && selector_matches(&pdb["spec"]["selector"], pod))
            .map(|(_, pdb)| pdb.clone())
            .collect()
    }

    fn pdb_status(&self, pdb: &Value) -> PdbStatus {
        let ns = str_at(pdb, "/metadata/namespace");
        let selector = &pdb["spec"]["selector"];
        let matching: Vec<&Value> = self
            .pods
            .iter()
            .filter(|((pns, _), p)| pns == ns && selector_matches(selector, &p.obj))
            .map(|(_, p)| &p.obj)
            .filter(|p| !matches!(str_at(p, "/status/phase"), "Succeeded" | "Failed"))
            .collect();
        let expected = matching.len() as i64;
        let healthy = matching.iter().filter(|p| pod_is_healthy(p)).count() as i64;
        let desired = if let Some(v) = pdb["spec"].get("minAvailable") {
            scaled(v, expected)
        } else if let Some(v) = pdb["spec"].get("maxUnavailable") {
            (expected - scaled(v, expected)).max(0)
        } else {
            1
        };
        PdbStatus {
            healthy,
            desired,
            allowed: (healthy - desired).max(0),
        }
    }

    fn list_pdbs(&self, ns: Option<&str>) -> Reply {
        let items: Vec<Value> = self
            .pdbs
            .iter()
            .filter(|((pns, _), _)| ns.is_none_or(|n| n == pns))
            .map(|(_, pdb)| {
                let st = self.pdb_status(pdb);
                let mut v = pdb.clone();
                v["status"] = json!({
                    "currentHealthy": st.healthy,
                    "desiredHealthy": st.desired,
                    "disruptionsAllowed": st.allowed,
                    "expectedPods": st.healthy.max(st.desired),
                });
                v
            })
            .collect();
        Reply::ok(json!({
            "kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1",
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": items,
        }))
    }

    // --- events ---

    fn create_event(&mut self, api: EventApi, ns: &str, q: &Query, body: &[u8]) -> ApiResult {
        let mut ev = parse_json(body)?;
        if !ev.is_object() {
            return Err(ApiErr::bad_request(
                "the body of the request is not an Event object",
            ));
        }
        let (kind_str, api_version) = match api {
            EventApi::EventsV1 => ("Event.events.k8s.io", "events.k8s.io/v1"),
            EventApi::Core => ("Event", "v1"),
        };
        let body_ns = str_at(&ev, "/metadata/namespace");
        if !body_ns.is_empty() && body_ns != ns {
            return Err(ApiErr::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        if !ev["metadata"].is_object() {
            ev["metadata"] = json!({});
        }
        ev["metadata"]["namespace"] = json!(ns);
        let mut name = str_at(&ev, "/metadata/name").to_string();
        if name.is_empty() {
            let prefix = str_at(&ev, "/metadata/generateName").to_string();
            if prefix.is_empty() {
                return Err(ApiErr::invalid(
                    kind_str,
                    "",
                    vec![(
                        "metadata.name".into(),
                        "Required value: name or generateName is required".into(),
                    )],
                ));
            }
            self.seq += 1;
            name = format!("{prefix}{:05x}", self.seq);
            ev["metadata"]["name"] = json!(name);
        }
        let causes = validate_event(api, ns, &ev);
        if !causes.is_empty() {
            return Err(ApiErr::invalid(kind_str, &name, causes));
        }
        if self
            .events
            .iter()
            .any(|e| e.api == api && e.namespace == ns && e.name == name)
        {
            return Err(ApiErr::new(
                409,
                "AlreadyExists",
                format!(
                    "{} \"{name}\" already exists",
                    if api == EventApi::Core {
                        "events"
                    } else {
                        "events.events.k8s.io"
                    }
                ),
            )
            .details(json!({ "name": name, "kind": "events" })));
        }
        set_kind(&mut ev, api_version, "Event");
        if is_dry_run(q) {
            return Ok(Reply::created(ev));
        }
        self.stamp_new(&mut ev);
        self.events.push(StoredEvent {
            api,
            namespace: ns.to_string(),
            name,
            obj: ev.clone(),
        });
        Ok(Reply::created(ev))
    }

    fn patch_event(
        &mut self,
        api: EventApi,
        ns: &str,
        name: &str,
        q: &Query,
        ct: Option<&str>,
        body: &[u8],
    ) -> ApiResult {
        let patch = parse_json(body)?;
        let Some(idx) = self
            .events
            .iter()
            .position(|e| e.api == api && e.namespace == ns && e.name == name)
        else {
            return Err(ApiErr::not_found("events", name));
        };
        let current = self.events[idx].obj.clone();
        let mut new = apply_patch(&current, &patch, ct)?;
        if let Some(rv) = new
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
        {
            if !rv.is_empty() && rv != str_at(&current, "/metadata/resourceVersion") {
                return Err(ApiErr::conflict("events", name));
            }
        }
        for key in ["name", "namespace", "uid", "creationTimestamp"] {
            new["metadata"][key] = current["metadata"][key].clone();
        }
        let causes = validate_event(api, ns, &new);
        if !causes.is_empty() {
            return Err(ApiErr::invalid("Event", name, causes));
        }
        if new == current || is_dry_run(q) {
            return Ok(Reply::ok(new));
        }
        new["metadata"]["resourceVersion"] = json!(self.bump());
        self.events[idx].obj = new.clone();
        Ok(Reply::ok(new))
    }

    fn list_events(&self, api: EventApi, ns: &str) -> Reply {
        let items: Vec<Value> = self
            .events
            .iter()
            .filter(|e| e.api == api && e.namespace == ns)
            .map(|e| e.obj.clone())
            .collect();
        Reply::ok(json!({
            "kind": "EventList",
            "apiVersion": if api == EventApi::Core { "v1" } else { "events.k8s.io/v1" },
            "metadata": { "resourceVersion": self.rv.to_string() },
            "items": items,
        }))
    }
}

struct PdbStatus {
    healthy: i64,
    desired: i64,
    allowed: i64,
}

/// An int-or-percent scaled against `total`, rounding up (as the disruption controller does).
fn scaled(v: &Value, total: i64) -> i64 {
    match v {
        Value::Number(n) => n.as_i64().unwrap_or(0),
        Value::String(s) => {
            let pct: i64 = s.trim_end_matches('%').parse().unwrap_or(0);
            (pct * total + 99) / 100
        }
        _ => 0,
    }
}

fn pod_is_healthy(pod: &Value) -> bool {
    if str_at(pod, "/status/phase") != "Running"
        || !str_at(pod, "/metadata/deletionTimestamp").is_empty()
    {
        return false;
    }
    let ready = pod["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .map(|c| c["status"] == "True");
    ready.unwrap_or(true)
}

/// `metav1.LabelSelector` semantics: null selects nothing, `{}` selects everything.
fn selector_matches(selector: &Value, obj: &Value) -> bool {
    let Value::Object(sel) = selector else {
        return false;
    };
    let labels = obj["metadata"]["labels"].as_object();
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    if let Some(Value::Object(ml)) = sel.get("matchLabels") {
        for (k, v) in ml {
            if get(k) != v.as_str() {
                return false;
            }
        }
    }
    if let Some(Value::Array(exprs)) = sel.get("matchExpressions") {
        for e in exprs {
            let key = e["key"].as_str().unwrap_or("");
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let ok = match e["operator"].as_str().unwrap_or("") {
                "In" => get(key).is_some_and(|v| values.contains(&v)),
                "NotIn" => get(key).is_none_or(|v| !values.contains(&v)),
                "Exists" => get(key).is_some(),
                "DoesNotExist" => get(key).is_none(),
                _ => false,
            };
            if !ok {
                return false;
            }
        }
    }
    true
}

fn validate_node(name: &str, node: &Value) -> Result<(), ApiErr> {
    if let Err(e) = serde_json::from_value::<Node>(node.clone()) {
        return Err(ApiErr::invalid(
            "Node",
            name,
            vec![("body".into(), e.to_string())],
        ));
    }
    let mut causes = Vec::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    if let Some(taints) = node["spec"]["taints"].as_array() {
        for (i, t) in taints.iter().enumerate() {
            let key = t["key"].as_str().unwrap_or("");
            let effect = t["effect"].as_str().unwrap_or("");
            if key.is_empty() {
                causes.push((
                    format!("spec.taints[{i}].key"),
                    "Required value".to_string(),
                ));
            }
            if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
                causes.push((
                    format!("spec.taints[{i}].effect"),
                    format!("Unsupported value: \"{effect}\": supported values: \"NoSchedule\", \"PreferNoSchedule\", \"NoExecute\""),
                ));
            }
            if !seen.insert((key.to_string(), effect.to_string())) {
                causes.push((
                    format!("spec.taints[{i}]"),
                    "Duplicate value: taints must be unique by key and effect pair".to_string(),
                ));
            }
        }
    }
    if let Some(conds) = node["status"]["conditions"].as_array() {
        for (i, c) in conds.iter().enumerate() {
            if c["type"].as_str().unwrap_or("").is_empty() {
                causes.push((
                    format!("status.conditions[{i}].type"),
                    "Required value".to_string(),
                ));
            }
        }
    }
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiErr::invalid("Node", name, causes))
    }
}

fn validate_event(api: EventApi, ns: &str, ev: &Value) -> Vec<(String, String)> {
    let mut causes = Vec::new();
    let (obj_field, regarding) = match api {
        EventApi::EventsV1 => ("regarding", &ev["regarding"]),
        EventApi::Core => ("involvedObject", &ev["involvedObject"]),
    };
    let reg_ns = regarding["namespace"].as_str().unwrap_or("");
    if reg_ns.is_empty() {
        if !ns.is_empty() && ns != "default" {
            causes.push((
                format!("{obj_field}.namespace"),
                "Invalid value: does not match event.namespace".into(),
            ));
        }
    } else if reg_ns != ns {
        causes.push((
            format!("{obj_field}.namespace"),
            "Invalid value: does not match event.namespace".into(),
        ));
    }
    let ty = ev["type"].as_str().unwrap_or("");
    let v1 = api == EventApi::EventsV1 || !ev["eventTime"].is_null();
    if !matches!(ty, "Normal" | "Warning") && (v1 || !ty.is_empty()) {
        causes.push((
            "type".into(),
            format!("Unsupported value: \"{ty}\": supported values: \"Normal\", \"Warning\""),
        ));
    }
    if v1 {
        if ev["eventTime"].is_null() {
            causes.push(("eventTime".into(), "Required value".into()));
        }
        for (field, limit) in [
            ("reportingController", 253),
            ("reportingInstance", 128),
            ("action", 128),
            ("reason", 128),
        ] {
            let v = ev[field].as_str().unwrap_or("");
            if v.is_empty() {
                causes.push((field.into(), "Required value".into()));
            } else if v.len() > limit {
                causes.push((
                    field.into(),
                    format!("Too long: may not be more than {limit} bytes"),
                ));
            }
        }
    }
    let note_field = if api == EventApi::EventsV1 {
        "note"
    } else {
        "message"
    };
    if api == EventApi::EventsV1 && ev[note_field].as_str().is_some_and(|n| n.len() > 1024) {
        causes.push((
            note_field.into(),
            "Too long: may not be more than 1024 bytes".into(),
        ));
    }
    causes
}

fn flatten_event(e: &StoredEvent) -> FakeEvent {
    let o = &e.obj;
    let (reg, msg, count) = match e.api {
        EventApi::EventsV1 => (
            &o["regarding"],
            str_at(o, "/note"),
            o["series"]["count"].as_i64().unwrap_or(1),
        ),
        EventApi::Core => (
            &o["involvedObject"],
            str_at(o, "/message"),
            o["count"].as_i64().unwrap_or(1),
        ),
    };
    FakeEvent {
        api: e.api,
        namespace: e.namespace.clone(),
        name: e.name.clone(),
        type_: str_at(o, "/type").to_string(),
        reason: str_at(o, "/reason").to_string(),
        message: msg.to_string(),
        regarding_kind: reg["kind"].as_str().unwrap_or("").to_string(),
        regarding_name: reg["name"].as_str().unwrap_or("").to_string(),
        regarding_namespace: reg["namespace"].as_str().unwrap_or("").to_string(),
        reporting_controller: str_at(o, "/reportingController").to_string(),
        count,
        raw: o.clone(),
    }
}

// === patches ===

fn apply_patch(current: &Value, patch: &Value, ct: Option<&str>) -> Result<Value, ApiErr> {
    match ct {
        Some("application/merge-patch+json") => Ok(merge_patch(current.clone(), patch)),
        Some("application/strategic-merge-patch+json") => strategic_merge(current.clone(), patch, ""),
        Some("application/json-patch+json") => json_patch(current.clone(), patch),
        other => Err(ApiErr::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format ({}) - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, \
                 application/strategic-merge-patch+json",
                other.unwrap_or("none")
            ),
        )),
    }
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: Value, patch: &Value) -> Value {
    match patch {
        Value::Object(p) => {
            let mut t = match target {
                Value::Object(m) => m,
                _ => Map::new(),
            };
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    let cur = t.remove(k).unwrap_or(Value::Null);
                    t.insert(k.clone(), merge_patch(cur, v));
                }
            }
            Value::Object(t)
        }
        other => other.clone(),
    }
}

enum ListStrategy {
    MergeKey(&'static str),
    Primitive,
}

/// patchStrategy/patchMergeKey of the list fields this server stores (Node, Event). Every other
/// list (notably `spec.taints`) is atomic: a strategic patch replaces it whole.
fn list_strategy(path: &str) -> Option<ListStrategy> {
    match path {
        "status.conditions" | "status.addresses" => Some(ListStrategy::MergeKey("type")),
        "status.volumesAttached" => Some(ListStrategy::MergeKey("name")),
        "metadata.ownerReferences" => Some(ListStrategy::MergeKey("uid")),
        "metadata.finalizers" | "spec.podCIDRs" => Some(ListStrategy::Primitive),
        _ => None,
    }
}

fn strategic_merge(target: Value, patch: &Value, path: &str) -> Result<Value, ApiErr> {
    let Value::Object(p) = patch else {
        return Ok(patch.clone());
    };
    match p.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut m = p.clone();
            m.remove("$patch");
            return Ok(Value::Object(m));
        }
        Some("delete") => return Ok(Value::Null),
        Some(other) => return Err(ApiErr::bad_request(format!("unknown patch type: {other}"))),
        None => {}
    }
    let mut t = match target {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    if let Some(keys) = p.get("$retainKeys") {
        let keys: Vec<&str> = keys
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        t.retain(|k, _| keys.contains(&k.as_str()));
    }
    for (k, v) in p {
        if k == "$retainKeys" || k.starts_with("$setElementOrder/") {
            // Ordering directives: the order of merged lists is not significant here.
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(cur)), Value::Array(del)) = (t.get_mut(field), v) {
                cur.retain(|x| !del.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            return Err(ApiErr::bad_request(format!("unknown patch directive {k}")));
        }
        let child = if path.is_empty() {
            k.clone()
        } else {
            format!("{path}.{k}")
        };
        if v.is_null() {
            t.remove(k);
            continue;
        }
        let cur = t.remove(k).unwrap_or(Value::Null);
        let merged = match (v, list_strategy(&child)) {
            (Value::Array(items), Some(ListStrategy::MergeKey(key))) => {
                merge_keyed_list(cur, items, key, &child)?
            }
            (Value::Array(items), Some(ListStrategy::Primitive)) => {
                let mut out = match cur {
                    Value::Array(a) => a,
                    _ => Vec::new(),
                };
                for i in items {
                    if !out.contains(i) {
                        out.push(i.clone());
                    }
                }
                Value::Array(out)
            }
            (Value::Object(_), _) => strategic_merge(cur, v, &child)?,
            _ => v.clone(),
        };
        if !merged.is_null() {
            t.insert(k.clone(), merged);
        }
    }
    Ok(Value::Object(t))
}

fn merge_keyed_list(cur: Value, items: &[Value], key: &str, path: &str) -> Result<Value, ApiErr> {
    if items
        .iter()
        .any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace"))
    {
        let kept: Vec<Value> = items
            .iter()
            .filter(|i| i.get("$patch").is_none())
            .cloned()
            .collect();
        return Ok(Value::Array(kept));
    }
    let mut out = match cur {
        Value::Array(a) => a,
        _ => Vec::new(),
    };
    for item in items {
        let Some(k) = item.get(key).filter(|k| !k.is_null()) else {
            return Err(ApiErr::bad_request(format!(
                "map in {path} does not contain declared merge key: {key}"
            )));
        };
        let pos = out.iter().position(|e| e.get(key) == Some(k));
        if item.get("$patch").and_then(Value::as_str) == Some("delete") {
            if let Some(i) = pos {
                out.remove(i);
            }
            continue;
        }
        match pos {
            Some(i) => {
                let existing = std::mem::take(&mut out[i]);
                out[i] = strategic_merge(existing, item, path)?;
            }
            None => out.push(strategic_merge(Value::Null, item, path)?),
        }
    }
    Ok(Value::Array(out))
}

/// RFC 6902 JSON patch.
fn json_patch(mut doc: Value, ops: &Value) -> Result<Value, ApiErr> {
    let Value::Array(ops) = ops else {
        return Err(ApiErr::bad_request(
            "a JSON patch must be an array of operations",
        ));
    };
    for op in ops {
        let kind = op["op"].as_str().unwrap_or("");
        let path = op["path"].as_str().unwrap_or("");
        match kind {
            "add" => pointer_add(&mut doc, path, op["value"].clone())?,
            "remove" => {
                pointer_remove(&mut doc, path)?;
            }
            "replace" => {
                pointer_remove(&mut doc, path)?;
                pointer_add(&mut doc, path, op["value"].clone())?;
            }
            "test" => {
                if doc.pointer(path) != Some(&op["value"]) {
                    return Err(ApiErr::new(
                        422,
                        "Invalid",
                        format!("the server rejected our request due to an error in our request: testing value {path} failed"),
                    ));
                }
            }
            "move" | "copy" => {
                let from = op["from"].as_str().unwrap_or("");
                let v = if kind == "move" {
                    pointer_remove(&mut doc, from)?
                } else {
                    doc.pointer(from)
                        .cloned()
                        .ok_or_else(|| json_patch_err(format!("missing value at {from}")))?
                };
                pointer_add(&mut doc, path, v)?;
            }
            other => return Err(json_patch_err(format!("unknown operation {other:?}"))),
        }
    }
    Ok(doc)
}

fn json_patch_err(msg: String) -> ApiErr {
    ApiErr::new(
        422,
        "Invalid",
        format!("the server rejected our request due to an error in our request: {msg}"),
    )
}

fn split_pointer(path: &str) -> Result<(&str, String), ApiErr> {
    let idx = path
        .rfind('/')
        .ok_or_else(|| json_patch_err(format!("invalid path {path:?}")))?;
    let last = path[idx + 1..].replace("~1", "/").replace("~0", "~");
    Ok((&path[..idx], last))
}

fn pointer_add(doc: &mut Value, path: &str, value: Value) -> Result<(), ApiErr> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    let target = doc
        .pointer_mut(parent)
        .ok_or_else(|| json_patch_err(format!("missing parent of {path}")))?;
    match target {
        Value::Object(m) => {
            m.insert(last, value);
            Ok(())
        }
        Value::Array(a) => {
            if last == "-" {
                a.push(value);
                return Ok(());
            }
            let i: usize = last
                .parse()
                .map_err(|_| json_patch_err(format!("invalid index in {path}")))?;
            if i > a.len() {
                return Err(json_patch_err(format!("index out of range in {path}")));
            }
            a.insert(i, value);
            Ok(())
        }
        _ => Err(json_patch_err(format!(
            "parent of {path} is not a container"
        ))),
    }
}

fn pointer_remove(doc: &mut Value, path: &str) -> Result<Value, ApiErr> {
    let (parent, last) = split_pointer(path)?;
    let target = doc
        .pointer_mut(parent)
        .ok_or_else(|| json_patch_err(format!("missing parent of {path}")))?;
    match target {
        Value::Object(m) => m
            .remove(&last)
            .ok_or_else(|| json_patch_err(format!("missing value at {path}"))),
        Value::Array(a) => {
            let i: usize = last
                .parse()
                .map_err(|_| json_patch_err(format!("invalid index in {path}")))?;
            if i >= a.len() {
                return Err(json_patch_err(format!("index out of range in {path}")));
            }
            Ok(a.remove(i))
        }
        _ => Err(json_patch_err(format!(
            "parent of {path} is not a container"
        ))),
    }
}

// === selectors ===

enum FieldReq {
    Eq(String, String),
    Ne(String, String),
}

fn parse_field_selector(s: &str, supported: &[&str]) -> Result<Vec<FieldReq>, ApiErr> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (field, value, neg) = if let Some((f, v)) = part.split_once("!=") {
            (f, v, true)
        } else if let Some((f, v)) = part.split_once("==") {
            (f, v, false)
        } else if let Some((f, v)) = part.split_once('=') {
            (f, v, false)
        } else {
            return Err(ApiErr::bad_request(format!(
                "invalid selector: '{s}'; can't understand '{part}'"
            )));
        };
        let field = field.trim();
        if !supported.contains(&field) {
            return Err(ApiErr::bad_request(format!(
                "field label not supported: {field}"
            )));
        }
        out.push(if neg {
            FieldReq::Ne(field.to_string(), value.trim().to_string())
        } else {
            FieldReq::Eq(field.to_string(), value.trim().to_string())
        });
    }
    Ok(out)
}

fn field_value(obj: &Value, field: &str) -> String {
    let ptr = format!("/{}", field.replace('.', "/"));
    match obj.pointer(&ptr) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => match field {
            "spec.unschedulable" | "spec.hostNetwork" => "false".to_string(),
            _ => String::new(),
        },
    }
}

fn fields_match(obj: &Value, reqs: &[FieldReq]) -> bool {
    reqs.iter().all(|r| match r {
        FieldReq::Eq(f, v) => field_value(obj, f) == *v,
        FieldReq::Ne(f, v) => field_value(obj, f) != *v,
    })
}

enum LabelReq {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn parse_set(rest: &str, whole: &str) -> Result<Vec<String>, ApiErr> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| ApiErr::bad_request(format!("unable to parse requirement: {whole}")))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
}

fn parse_label_selector(s: &str) -> Result<Vec<LabelReq>, ApiErr> {
    let mut out = Vec::new();
    for part in split_top_level(s)
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        if let Some(k) = part.strip_prefix('!') {
            out.push(LabelReq::NotExists(k.trim().to_string()));
        } else if let Some((k, v)) = part.split_once("!=") {
            out.push(LabelReq::Ne(k.trim().to_string(), v.trim().to_string()));
        } else if let Some((k, v)) = part.split_once("==") {
            out.push(LabelReq::Eq(k.trim().to_string(), v.trim().to_string()));
        } else if let Some((k, v)) = part.split_once('=') {
            out.push(LabelReq::Eq(k.trim().to_string(), v.trim().to_string()));
        } else if let Some((k, rest)) = part.split_once(" notin ") {
            out.push(LabelReq::NotIn(
                k.trim().to_string(),
                parse_set(rest, part)?,
            ));
        } else if let Some((k, rest)) = part.split_once(" in ") {
            out.push(LabelReq::In(k.trim().to_string(), parse_set(rest, part)?));
        } else if part.contains(char::is_whitespace) || part.contains('(') {
            return Err(ApiErr::bad_request(format!(
                "unable to parse requirement: {part}"
            )));
        } else {
            out.push(LabelReq::Exists(part.to_string()));
        }
    }
    Ok(out)
}

fn labels_match(obj: &Value, reqs: &[LabelReq]) -> bool {
    let labels = obj["metadata"]["labels"].as_object();
    let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
    reqs.iter().all(|r| match r {
        LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
        LabelReq::Ne(k, v) => get(k) != Some(v.as_str()),
        LabelReq::In(k, vs) => get(k).is_some_and(|v| vs.iter().any(|x| x == v)),
        LabelReq::NotIn(k, vs) => get(k).is_none_or(|v| !vs.iter().any(|x| x == v)),
        LabelReq::Exists(k) => get(k).is_some(),
        LabelReq::NotExists(k) => get(k).is_none(),
    })
}

// === discovery ===

fn known_resource_path(segs: &[&str]) -> bool {
    matches!(
        segs,
        ["api", "v1", "nodes", ..]
            | ["api", "v1", "pods"]
            | ["api", "v1", "namespaces", _, "pods", ..]
            | ["api", "v1", "namespaces", _, "events", ..]
            | ["apis", "events.k8s.io", "v1", "namespaces", _, "events", ..]
            | ["apis", "policy", "v1", ..]
    )
}

fn resource(name: &str, namespaced: bool, kind: &str, verbs: &[&str]) -> Value {
    json!({ "name": name, "singularName": "", "namespaced": namespaced, "kind": kind, "verbs": verbs })
}

fn discovery_core() -> Value {
    let mut eviction = resource("pods/eviction", true, "Eviction", &["create"]);
    eviction["group"] = json!("policy");
    eviction["version"] = json!("v1");
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            resource("nodes", false, "Node", &["get", "list", "patch", "update"]),
            resource("nodes/status", false, "Node", &["get", "patch", "update"]),
            resource("pods", true, "Pod", &["delete", "get", "list"]),
            eviction,
            resource("events", true, "Event", &["create", "get", "list", "patch"]),
        ],
    })
}

fn discovery_policy() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "policy/v1",
        "resources": [resource("poddisruptionbudgets", true, "PodDisruptionBudget", &["get", "list"])],
    })
}

fn discovery_events() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "events.k8s.io/v1",
        "resources": [resource("events", true, "Event", &["create", "get", "list", "patch"])],
    })
}

fn discovery_groups() -> Value {
    let group = |name: &str| {
        json!({
            "name": name,
            "versions": [{ "groupVersion": format!("{name}/v1"), "version": "v1" }],
            "preferredVersion": { "groupVersion": format!("{name}/v1"), "version": "v1" },
        })
    };
    json!({
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [group("policy"), group("events.k8s.io")],
    })
}

// === small helpers ===

fn to_value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

fn set_kind(obj: &mut Value, api_version: &str, kind: &str) {
    obj["apiVersion"] = json!(api_version);
    obj["kind"] = json!(kind);
}

fn str_at<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

/// Copy `key` from `src` into `dst` (removing it from `dst` when `src` has none).
fn restore(dst: &mut Value, src: &Value, key: &str) {
    if let Value::Object(d) = dst {
        match src.get(key) {
            Some(v) => {
                d.insert(key.to_string(), v.clone());
            }
            None => {
                d.remove(key);
            }
        }
    }
}

fn parse_json(body: &[u8]) -> Result<Value, ApiErr> {
    serde_json::from_slice(body)
        .map_err(|e| ApiErr::bad_request(format!("error decoding the request body: {e}")))
}

fn now_seconds() -> Timestamp {
    Timestamp::from_second(Timestamp::now().as_second()).unwrap_or(Timestamp::UNIX_EPOCH)
}

fn parse_query(q: &str) -> Query {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// === fixtures ===

/// A Ready node as the kubelet reports it (conditions Ready / MemoryPressure), schedulable.
pub fn test_node(name: &str) -> Node {
    let t = Time(now_seconds());
    let cond = |type_: &str, status: &str, reason: &str| NodeCondition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason: Some(reason.to_string()),
        message: Some(format!("kubelet: {reason}")),
        last_heartbeat_time: Some(t.clone()),
        last_transition_time: Some(t.clone()),
    };
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            labels: Some(BTreeMap::from([(
                "kubernetes.io/hostname".to_string(),
                name.to_string(),
            )])),
            ..Default::default()
        },
        spec: None,
        status: Some(NodeStatus {
            conditions: Some(vec![
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                cond("Ready", "True", "KubeletReady"),
            ]),
            ..Default::default()
        }),
    }
}

/// Builder for test pods: by default Running and Ready on the given node, controlled by a
/// ReplicaSet, default grace period.
pub struct TestPod {
    pod: Pod,
}

impl TestPod {
    pub fn new(namespace: &str, name: &str, node: &str) -> TestPod {
        let pod = Pod {
            metadata: ObjectMeta {
                namespace: Some(namespace.to_string()),
                name: Some(name.to_string()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "apps/v1".to_string(),
                    kind: "ReplicaSet".to_string(),
                    name: format!("{name}-rs"),
                    uid: format!("rs-{name}"),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.to_string()),
                containers: vec![Container {
                    name: "main".to_string(),
                    image: Some("registry.example/trainer:1".to_string()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".to_string()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".to_string(),
                    status: "True".to_string(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        };
        TestPod { pod }
    }

    pub fn label(mut self, key: &str, value: &str) -> TestPod {
        self.pod
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(key.to_string(), value.to_string());
        self
    }

    pub fn grace_period(mut self, seconds: i64) -> TestPod {
        if let Some(spec) = self.pod.spec.as_mut() {
            spec.termination_grace_period_seconds = Some(seconds);
        }
        self
    }

    pub fn phase(mut self, phase: &str) -> TestPod {
        if let Some(status) = self.pod.status.as_mut() {
            status.phase = Some(phase.to_string());
        }
        self
    }

    /// Controlled by a DaemonSet instead of a ReplicaSet.
    pub fn daemonset(mut self) -> TestPod {
        if let Some(owner) = self
            .pod
            .metadata
            .owner_references
            .as_mut()
            .and_then(|o| o.first_mut())
        {
            owner.kind = "DaemonSet".to_string();
        }
        self
    }

    /// The API mirror of a static pod.
    pub fn mirror(mut self) -> TestPod {
        self.pod
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                spotguard::node::filter::MIRROR_ANNOTATION.to_string(),
                "hash".to_string(),
            );
        self.pod.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".to_string(),
            kind: "Node".to_string(),
            name: "node".to_string(),
            uid: "node-uid".to_string(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        self
    }

    pub fn build(self) -> Pod {
        self.pod
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategic_merge_merges_conditions_by_type_and_replaces_taints() {
        let node = json!({
            "spec": { "taints": [{ "key": "a", "effect": "NoSchedule" }] },
            "status": { "conditions": [
                { "type": "Ready", "status": "True" },
                { "type": "GPUUnhealthy", "status": "False" }
            ]}
        });
        let patch = json!({
            "spec": { "taints": [{ "key": "b", "effect": "NoSchedule" }] },
            "status": { "conditions": [{ "type": "GPUUnhealthy", "status": "True", "reason": "Xid79" }],
                        "$setElementOrder/conditions": [{ "type": "Ready" }, { "type": "GPUUnhealthy" }] }
        });
        let out = strategic_merge(node, &patch, "").unwrap();
        assert_eq!(
            out["spec"]["taints"],
            json!([{ "key": "b", "effect": "NoSchedule" }])
        );
        assert_eq!(
            out["status"]["conditions"],
            json!([
                { "type": "Ready", "status": "True" },
                { "type": "GPUUnhealthy", "status": "True", "reason": "Xid79" }
            ])
        );
        let del = json!({ "status": { "conditions": [{ "type": "Ready", "$patch": "delete" }] } });
        let out = strategic_merge(out, &del, "").unwrap();
        assert_eq!(
            out["status"]["conditions"].as_array().map(Vec::len),
            Some(1)
        );
        let bad = json!({ "status": { "conditions": [{ "status": "True" }] } });
        assert_eq!(strategic_merge(out, &bad, "").unwrap_err().code, 400);
    }

    #[test]
    fn merge_patch_follows_rfc7386() {
        let doc = json!({ "a": 1, "b": { "c": 2, "d": 3 }, "l": [1, 2] });
        let out = merge_patch(
            doc,
            &json!({ "b": { "c": null, "e": 4 }, "l": [3], "a": null }),
        );
        assert_eq!(out, json!({ "b": { "d": 3, "e": 4 }, "l": [3] }));
    }

    #[test]
    fn json_patch_ops_and_test_failure() {
        let doc = json!({ "metadata": { "resourceVersion": "5" }, "spec": { "taints": [] } });
        let ops = json!([
            { "op": "test", "path": "/metadata/resourceVersion", "value": "5" },
            { "op": "add", "path": "/spec/taints/-", "value": { "key": "k", "effect": "NoSchedule" } },
            { "op": "add", "path": "/spec/unschedulable", "value": true },
            { "op": "replace", "path": "/spec/unschedulable", "value": false },
        ]);
        let out = json_patch(doc.clone(), &ops).unwrap();
        assert_eq!(out["spec"]["taints"][0]["key"], "k");
        assert_eq!(out["spec"]["unschedulable"], false);
        let stale = json!([{ "op": "test", "path": "/metadata/resourceVersion", "value": "4" }]);
        assert_eq!(json_patch(doc.clone(), &stale).unwrap_err().code, 422);
        let missing = json!([{ "op": "remove", "path": "/spec/nothing" }]);
        assert_eq!(json_patch(doc, &missing).unwrap_err().code, 422);
    }

    #[test]
    fn selectors_parse_and_match() {
        let pod = json!({ "metadata": { "name": "p", "labels": { "app": "x", "tier": "gpu" } },
                          "spec": { "nodeName": "n1" } });
        let fs = parse_field_selector(
            "spec.nodeName=n1,metadata.name!=q",
            &["spec.nodeName", "metadata.name"],
        )
        .unwrap();
        assert!(fields_match(&pod, &fs));
        let fs = parse_field_selector("spec.nodeName==n2", &["spec.nodeName"]).unwrap();
        assert!(!fields_match(&pod, &fs));
        assert_eq!(
            parse_field_selector("spec.bogus=1", &["spec.nodeName"])
                .err()
                .map(|e| e.code),
            Some(400)
        );
        for (sel, want) in [
            ("app=x", true),
            ("app==x,tier", true),
            ("app!=x", false),
            ("!missing", true),
            ("tier in (gpu, cpu)", true),
            ("tier notin (gpu)", false),
            ("app=x,tier in (cpu)", false),
        ] {
            let ls = parse_label_selector(sel).unwrap();
            assert_eq!(labels_match(&pod, &ls), want, "{sel}");
        }
        assert!(parse_label_selector("tier in gpu").is_err());
    }

    #[test]
    fn query_strings_decode() {
        let q = parse_query("fieldSelector=spec.nodeName%3Dn1&labelSelector=a+in+%28b%29&x");
        assert_eq!(qget(&q, "fieldSelector"), Some("spec.nodeName=n1"));
        assert_eq!(qget(&q, "labelSelector"), Some("a in (b)"));
        assert_eq!(qget(&q, "x"), Some(""));
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn pdb_arithmetic_matches_the_disruption_controller() {
        assert_eq!(scaled(&json!(2), 10), 2);
        assert_eq!(scaled(&json!("50%"), 3), 2);
        assert_eq!(scaled(&json!("100%"), 4), 4);
        let sel = json!({ "matchLabels": { "app": "x" } });
        let pod = json!({ "metadata": { "labels": { "app": "x" } } });
        assert!(selector_matches(&sel, &pod));
        assert!(selector_matches(&json!({}), &pod));
        assert!(!selector_matches(&Value::Null, &pod));
        let expr =
            json!({ "matchExpressions": [{ "key": "app", "operator": "NotIn", "values": ["x"] }] });
        assert!(!selector_matches(&expr, &pod));
    }
}
