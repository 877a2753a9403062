//! A kubelet stand-in: one per test node.
//!
//! It registers the Node (labels, taints, capacity, Ready conditions), renews its Lease every
//! 10 s and reports node status every 5 minutes as the kubelet does, and runs every pod bound to
//! its node as real processes ([`pod`]): each container in a kubelet-shaped cgroup, with its
//! volumes bind-mounted in a private mount namespace, the user and capabilities of its
//! `securityContext` ([`sandbox`]), its environment (Downward API, ConfigMap / Secret keys, the
//! in-cluster API server address) and, for a projected ServiceAccount volume, a token minted
//! with the TokenRequest API. Pod status (Running, Ready from readiness probes, terminated with
//! the real exit code, the terminal phase) goes through the status subresource; a deleted pod
//! gets SIGTERM, its grace period, then SIGKILL, and is then removed with grace 0.
//!
//! What a container runs: its `command` + `args` on this machine's filesystem, or the
//! entrypoint of its image when the test registered one ([`Image`]); an unknown image without a
//! command stays `Waiting` (`ErrImagePull`). `hostPath` volumes map into a per-node directory
//! (every stand-in node has its own "disk") unless the test maps a path elsewhere
//! ([`NodeConfig::host_path`]). Not modelled: liveness / startup probes, PID and network
//! namespaces (everything is `hostPID` / `hostNetwork`), seccomp, resource limits.

mod fleet;
mod pod;
pub mod sandbox;

pub use fleet::Fleet;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, NodeSpec, Pod, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference};
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::controlplane::{on_own_thread, ControlPlane};

/// Pod annotation: run no process for this pod, only report it ([`crate::k8s::TestPod::simulated`]);
/// the value is how many seconds it takes to stop once deleted, or `grace`.
pub const SIMULATED_ANNOTATION: &str = "testkit.spotguard.io/simulated";

/// How long between two Lease renewals (the kubelet's default).
const LEASE_RENEW: Duration = Duration::from_secs(10);
const LEASE_DURATION_SECONDS: i32 = 40;
/// How often node status is reported when nothing changed (the kubelet's
/// `nodeStatusReportFrequency`).
const STATUS_REPORT: Duration = Duration::from_secs(300);

/// What an image runs when a container does not say.
#[derive(Clone, Debug, Default)]
pub struct Image {
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<(String, String)>,
    pub workdir: Option<PathBuf>,
    /// Directories of the image's filesystem: (host dir, path in the container), bind-mounted.
    pub files: Vec<(PathBuf, PathBuf)>,
}

impl Image {
    /// An image whose entrypoint is `program`.
    pub fn binary(program: impl Into<PathBuf>) -> Image {
        Image {
            entrypoint: vec![program.into().display().to_string()],
            ..Default::default()
        }
    }

    /// Add the host directory `host` at `path` in the container.
    pub fn with_files(mut self, host: impl Into<PathBuf>, path: impl Into<PathBuf>) -> Image {
        self.files.push((host.into(), path.into()));
        self
    }
}

/// A node to register.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub unschedulable: bool,
    /// Capacity (= allocatable) beyond the defaults (cpu 8, memory 32Gi, pods 110).
    pub capacity: BTreeMap<String, String>,
    /// hostPath prefixes mapped to a host directory of the test's choice (longest prefix wins);
    /// other hostPaths live under the node's own directory.
    pub host_paths: Vec<(PathBuf, PathBuf)>,
    pub images: HashMap<String, Image>,
}

impl NodeConfig {
    pub fn new(name: &str) -> NodeConfig {
        NodeConfig {
            name: name.to_string(),
            labels: BTreeMap::from([
                ("kubernetes.io/hostname".to_string(), name.to_string()),
                ("kubernetes.io/os".to_string(), "linux".to_string()),
                ("kubernetes.io/arch".to_string(), "amd64".to_string()),
            ]),
            annotations: BTreeMap::new(),
            taints: Vec::new(),
            unschedulable: false,
            capacity: BTreeMap::new(),
            host_paths: vec![(
                PathBuf::from("/sys/fs/cgroup"),
                PathBuf::from("/sys/fs/cgroup"),
            )],
            images: HashMap::new(),
        }
    }

    pub fn label(mut self, key: &str, value: &str) -> NodeConfig {
        self.labels.insert(key.into(), value.into());
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> NodeConfig {
        self.annotations.insert(key.into(), value.into());
        self
    }

    pub fn taint(mut self, key: &str, value: Option<&str>, effect: &str) -> NodeConfig {
        self.taints.push(Taint {
            key: key.into(),
            value: value.map(str::to_string),
            effect: effect.into(),
            time_added: None,
        });
        self
    }

    /// Cordoned by an operator before anything else runs.
    pub fn unschedulable(mut self) -> NodeConfig {
        self.unschedulable = true;
        self
    }

    pub fn capacity(mut self, resource: &str, quantity: &str) -> NodeConfig {
        self.capacity.insert(resource.into(), quantity.into());
        self
    }

    /// A GPU node: `nvidia.com/gpu.present=true` and `nvidia.com/gpu` capacity.
    pub fn gpus(self, n: u32) -> NodeConfig {
        self.label("nvidia.com/gpu.present", "true")
            .capacity("nvidia.com/gpu", &n.to_string())
    }

    pub fn host_path(mut self, host: impl Into<PathBuf>, local: impl Into<PathBuf>) -> NodeConfig {
        self.host_paths.push((host.into(), local.into()));
        self
    }

    pub fn image(mut self, name: &str, image: Image) -> NodeConfig {
        self.images.insert(name.into(), image);
        self
    }
}

/// One container process the stand-in started.
#[derive(Clone, Debug)]
pub struct ContainerRun {
    pub namespace: String,
    pub pod: String,
    pub uid: String,
    pub container: String,
    pub container_id: String,
    pub pid: u32,
    pub cgroup: PathBuf,
    pub log: PathBuf,
}

pub(crate) struct Inner {
    node: String,
    client: kube::Client,
    cp: &'static ControlPlane,
    config: NodeConfig,
    root: PathBuf,
    cgroup_root: PathBuf,
    runs: Mutex<Vec<ContainerRun>>,
    pods: Mutex<HashMap<String, PodEntry>>,
    /// Mountpoints created on the host for volumes (removed again when empty).
    mountpoints: Mutex<Vec<PathBuf>>,
    stop: CancellationToken,
}

struct PodEntry {
    updates: watch::Sender<Pod>,
    gone: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running kubelet stand-in. Dropping it stops the node: its processes are killed, their
/// cgroups removed, and the Node object deleted (as a cloud's node controller does when the
/// instance is gone), so that nothing is scheduled to a node that no longer runs anything.
pub struct Kubelet {
    inner: Arc<Inner>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Kubelet {
    /// Register `config` as a Node (replacing one of that name) and start serving it.
    pub async fn start(cp: &'static ControlPlane, config: NodeConfig) -> Result<Kubelet, String> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("kubelet-{}-", config.name))
            .tempdir()
            .map_err(|e| e.to_string())?;
        let client = cp.admin();
        let inner = Arc::new(Inner {
            node: config.name.clone(),
            client,
            cp,
            root: dir.path().to_path_buf(),
            cgroup_root: crate::kubelet::cgroup_root(),
            config,
            runs: Mutex::new(Vec::new()),
            pods: Mutex::new(HashMap::new()),
            mountpoints: Mutex::new(Vec::new()),
            stop: CancellationToken::new(),
        });
        let node = register(&inner).await?;
        let uid = node.metadata.uid.clone().unwrap_or_default();
        let tasks = vec![
            tokio::spawn(heartbeat(inner.clone(), uid)),
            tokio::spawn(watch_pods(inner.clone())),
        ];
        Ok(Kubelet {
            inner,
            tasks,
            _dir: dir,
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.node
    }

    /// The node's own directory (its "disk": hostPaths, pod volumes, logs).
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where `host_path` of this node is on this machine.
    pub fn host_path(&self, host_path: &Path) -> PathBuf {
        self.inner.map_host_path(host_path)
    }

    /// Every container process started so far (restarts included), oldest first.
    pub fn runs(&self) -> Vec<ContainerRun> {
        lock(&self.inner.runs).clone()
    }

    /// The latest run of `container` of pod `namespace/pod`.
    pub fn run_of(&self, namespace: &str, pod: &str, container: &str) -> Option<ContainerRun> {
        lock(&self.inner.runs)
            .iter()
            .rev()
            .find(|r| r.namespace == namespace && r.pod == pod && r.container == container)
            .cloned()
    }

    /// Wait up to `limit` for `container` of `namespace/pod` to be started; its run.
    pub async fn wait_run(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
        limit: Duration,
    ) -> ContainerRun {
        let start = tokio::time::Instant::now();
        loop {
            if let Some(r) = self.run_of(namespace, pod, container) {
                return r;
            }
            if start.elapsed() > limit {
                panic!(
                    "{}: container {container} of {namespace}/{pod} not started within {limit:?}",
                    self.inner.node
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything every run of `container` of `namespace/pod` wrote to stdout / stderr.
    pub fn logs(&self, namespace: &str, pod: &str, container: &str) -> String {
        lock(&self.inner.runs)
            .iter()
            .filter(|r| r.namespace == namespace && r.pod == pod && r.container == container)
            .map(|r| std::fs::read_to_string(&r.log).unwrap_or_default())
            .collect()
    }

    /// Stop the node and delete its Node object and Lease (the instance is gone). Dropping the
    /// handle does the same.
    pub fn delete_node(self) {
        drop(self);
    }
}

/// Delete Node `name` and its Lease, from a thread of its own (Drop may run while the test's
/// runtime is shutting down).
fn delete_node_object(cp: &'static ControlPlane, name: String) {
    delete_node_objects(cp, vec![name]);
}

/// [`delete_node_object`] for many nodes at once.
fn delete_node_objects(cp: &'static ControlPlane, names: Vec<String>) {
    let config = cp.config(&cp.url(), super::controlplane::Identity::Admin);
    let done = on_own_thread("k8s-node-cleanup", config, move |client| async move {
        let nodes: Api<Node> = Api::all(client.clone());
        let leases: Api<Lease> = Api::namespaced(client, "kube-node-lease");
        futures::stream::iter(names)
            .for_each_concurrent(16, |name| {
                let (nodes, leases) = (nodes.clone(), leases.clone());
                async move {
                    let _ = nodes.delete(&name, &DeleteParams::default()).await;
                    let _ = leases.delete(&name, &DeleteParams::default()).await;
                }
            })
            .await;
    });
    if let Ok(done) = done {
        let _ = done.join();
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        self.inner.stop_node();
        delete_node_object(self.inner.cp, self.inner.node.clone());
    }
}

impl Inner {
    /// Stop serving the node: its pod workers end, and what they ran is killed and removed,
    /// synchronously (the runtime may be going away with the test).
    fn stop_node(&self) {
        self.stop.cancel();
        for (_, entry) in lock(&self.pods).drain() {
            entry.gone.cancel();
        }
        let runs = lock(&self.runs).clone();
        for r in &runs {
            pod::kill_cgroup(&r.cgroup);
        }
        for r in &runs {
            pod::remove_cgroup(&r.cgroup);
        }
        let mut mps = lock(&self.mountpoints);
        for p in mps.drain(..).rev() {
            let _ = std::fs::remove_dir(&p);
        }
    }

    fn map_host_path(&self, host_path: &Path) -> PathBuf {
        let best = self
            .config
            .host_paths
            .iter()
            .filter(|(prefix, _)| host_path.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.components().count());
        match best {
            Some((prefix, local)) => match host_path.strip_prefix(prefix) {
                Ok(rest) if rest.as_os_str().is_empty() => local.clone(),
                Ok(rest) => local.join(rest),
                Err(_) => local.clone(),
            },
            None => self
                .root
                .join("host")
                .join(host_path.strip_prefix("/").unwrap_or(host_path)),
        }
    }
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

/// The Ready node status the kubelet reports.
fn node_status(inner: &Inner) -> serde_json::Value {
    let now = now_rfc3339();
    let cond = |t: &str, s: &str, reason: &str, msg: &str| {
        json!({ "type": t, "status": s, "reason": reason, "message": msg,
                "lastHeartbeatTime": now, "lastTransitionTime": now })
    };
    let mut capacity: BTreeMap<String, String> = BTreeMap::from([
        ("cpu".into(), "8".into()),
        ("memory".into(), "32Gi".into()),
        ("pods".into(), "110".into()),
        ("ephemeral-storage".into(), "100Gi".into()),
    ]);
    capacity.extend(inner.config.capacity.clone());
    let version = inner
        .cp
        .assets
        .version
        .split_whitespace()
        .last()
        .unwrap_or("v0.0.0")
        .to_string();
    json!({
        "capacity": capacity,
        "allocatable": capacity,
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        ],
        "addresses": [
            { "type": "InternalIP", "address": "127.0.0.1" },
            { "type": "Hostname", "address": inner.node },
        ],
        "daemonEndpoints": { "kubeletEndpoint": { "Port": 10250 } },
        "nodeInfo": {
            "machineID": crate::kubelet::hex(32),
            "systemUUID": crate::kubelet::pod_uid(),
            "bootID": crate::kubelet::pod_uid(),
            "kernelVersion": "testkit",
            "osImage": "spotguard testkit kubelet stand-in",
            "containerRuntimeVersion": "containerd://testkit",
            "kubeletVersion": version,
            "kubeProxyVersion": version,
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    })
}

/// Create (or replace) the Node, report its status, and wait until the control plane treats it
/// as Ready (the node lifecycle controller removes the not-ready taint that admission adds).
async fn register(inner: &Inner) -> Result<Node, String> {
    create_node(inner).await?;
    let nodes: Api<Node> = Api::all(inner.client.clone());
    let start = tokio::time::Instant::now();
    loop {
        let n = nodes
            .get(&inner.node)
            .await
            .map_err(|e| format!("node {}: {e}", inner.node))?;
        if !not_ready(&n) {
            return Ok(n);
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!(
                "node {} kept the not-ready taint for 30 s (is kube-controller-manager running? logs in {})",
                inner.node,
                inner.cp.logs_dir().display()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the node still has the not-ready taint admission puts on a new node.
fn not_ready(n: &Node) -> bool {
    n.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == "node.kubernetes.io/not-ready"))
}

/// Create (or replace) the Node, report its Ready status and take its Lease.
async fn create_node(inner: &Inner) -> Result<(), String> {
    let nodes: Api<Node> = Api::all(inner.client.clone());
    let _ = nodes.delete(&inner.node, &DeleteParams::default()).await;
    let node = Node {
        metadata: ObjectMeta {
            name: Some(inner.node.clone()),
            labels: Some(inner.config.labels.clone()),
            annotations: (!inner.config.annotations.is_empty())
                .then(|| inner.config.annotations.clone()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            unschedulable: inner.config.unschedulable.then_some(true),
            taints: (!inner.config.taints.is_empty()).then(|| inner.config.taints.clone()),
            ..Default::default()
        }),
        status: None,
    };
    let mut last = String::new();
    for _ in 0..100 {
        match nodes.create(&PostParams::default(), &node).await {
            Ok(_) => {
                last.clear();
                break;
            }
            // The old object is still being deleted.
            Err(kube::Error::Api(s)) if s.code == 409 => last = s.message,
            Err(e) => return Err(format!("registering node {}: {e}", inner.node)),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !last.is_empty() {
        return Err(format!("registering node {}: {last}", inner.node));
    }
    let patch = json!({ "status": node_status(inner) });
    nodes
        .patch_status(
            &inner.node,
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
        .map_err(|e| format!("node {} status: {e}", inner.node))?;
    renew_lease(inner, None).await
}

async fn renew_lease(inner: &Inner, node_uid: Option<&str>) -> Result<(), String> {
    let leases: Api<Lease> = Api::namespaced(inner.client.clone(), "kube-node-lease");
    let now = MicroTime(jiff::Timestamp::now());
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(inner.node.clone()),
            namespace: Some("kube-node-lease".into()),
            owner_references: node_uid.map(|uid| {
                vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: inner.node.clone(),
                    uid: uid.to_string(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(inner.node.clone()),
            lease_duration_seconds: Some(LEASE_DURATION_SECONDS),
            renew_time: Some(now),
            ..Default::default()
        }),
    };
    super::controlplane::apply(&leases, &inner.node, &lease)
        .await
        .map(drop)
}

async fn heartbeat(inner: Arc<Inner>, node_uid: String) {
    let mut last_status = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = inner.stop.cancelled() => return,
            _ = tokio::time::sleep(LEASE_RENEW) => {}
        }
        beat(&inner, &node_uid, &mut last_status).await;
    }
}

/// One heartbeat: renew the Lease; every [`STATUS_REPORT`], the node's status too.
async fn beat(inner: &Inner, node_uid: &str, last_status: &mut tokio::time::Instant) {
    let nodes: Api<Node> = Api::all(inner.client.clone());
    {
        if let Err(e) = renew_lease(inner, Some(node_uid)).await {
            tracing::debug!(node = %inner.node, error = %e, "lease renewal failed");
        }
        if last_status.elapsed() >= STATUS_REPORT {
            // Only the heartbeat times: conditions keep their transition times.
            if let Ok(n) = nodes.get(&inner.node).await {
                let now = now_rfc3339();
                let conds: Vec<serde_json::Value> = n
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|c| {
                        matches!(
                            c.type_.as_str(),
                            "Ready" | "MemoryPressure" | "DiskPressure" | "PIDPressure"
                        )
                    })
                    .map(|c| json!({ "type": c.type_, "lastHeartbeatTime": now }))
                    .collect();
                let patch = json!({ "status": { "conditions": conds } });
                let _ = nodes
                    .patch_status(
                        &inner.node,
                        &PatchParams::default(),
                        &Patch::Strategic(&patch),
                    )
                    .await;
            }
            *last_status = tokio::time::Instant::now();
        }
    }
}

/// List + watch the pods bound to this node and hand each to its pod worker.
async fn watch_pods(inner: Arc<Inner>) {
    let pods: Api<Pod> = Api::all(inner.client.clone());
    let selector = format!("spec.nodeName={}", inner.node);
    loop {
        let list = match pods.list(&ListParams::default().fields(&selector)).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(node = %inner.node, error = %e, "kubelet stand-in: listing pods");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut rv = list.metadata.resource_version.clone().unwrap_or_default();
        for p in list.items {
            sync_pod(&inner, p);
        }
        'watch: loop {
            let wp = WatchParams::default().fields(&selector).timeout(290);
            let stream = match pods.watch(&wp, &rv).await {
                Ok(s) => s,
                Err(_) => break 'watch,
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(WatchEvent::Added(p)) | Ok(WatchEvent::Modified(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                        sync_pod(&inner, p);
                    }
                    Ok(WatchEvent::Deleted(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                        if let Some(uid) = p.metadata.uid.as_deref() {
                            if let Some(entry) = lock(&inner.pods).remove(uid) {
                                entry.gone.cancel();
                            }
                        }
                    }
                    Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                    Ok(WatchEvent::Error(_)) | Err(_) => break 'watch,
                }
            }
        }
    }
}

fn sync_pod(inner: &Arc<Inner>, pod: Pod) {
    let Some(uid) = pod.metadata.uid.clone() else {
        return;
    };
    let mut pods = lock(&inner.pods);
    if let Some(entry) = pods.get(&uid) {
        let _ = entry.updates.send(pod);
        return;
    }
    let (tx, rx) = watch::channel(pod.clone());
    let gone = CancellationToken::new();
    pods.insert(
        uid,
        PodEntry {
            updates: tx,
            gone: gone.clone(),
        },
    );
    drop(pods);
    tokio::spawn(pod::run(inner.clone(), pod, rx, gone));
}
