//! Kubernetes-mode checkpoint discovery: a cache of this node's pods (`spec.nodeName` field
//! selector) kept warm by a list + watch from start-up ([`KubeDiscovery::keep_warm`]), so that
//! [`TargetDiscovery::discover`] on a notice needs **no API round trip**: it reads the cache and
//! maps each opted-in container to host processes through the container's own cgroup (its
//! `cgroup.procs`, located in the background; each process confirmed by its `/proc/<pid>/cgroup`),
//! so the notice costs what the targets cost, not what the node runs — falling back to a scan of
//! every `/proc/*/cgroup` when the cgroups cannot be read here (on a thread of its own; see
//! [`crate::checkpoint::cgroup::find_containers`]). Only if the cache never synced (API server unreachable since start) does discovery fall
//! back to one list bounded by [`FALLBACK_LIST_TIMEOUT`].
//!
//! The cache keeps only what checkpointing needs (the parsed `spotguard.io/checkpoint*` settings
//! of opted-in running pods), not the pod objects. A bad annotation is reported when the pod is
//! seen (a Warning Event on it, once per pod and problem), never on the notice's path.
//! (Pods' `spotguard.io/prefetch` annotations are read by the prefetcher's own process:
//! `crate::prefetch::annotations`.)
//!
//! The same watch tells the drain when an evicted pod is gone ([`PodWatch`]): the cache
//! remembers the uids it saw deleted (or that a relist no longer had) for
//! [`GONE_MEMORY`], knows whether it is healthy (synced, and no list or watch failing since),
//! and marks a change after every update, so the drain waits on it without a request per pod.
//! It also keeps each opted-in pod's controller for as long ([`PodWatch::controller`]): a goodput
//! Event names it after the drain deleted the pod, without reading the pod.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::checkpoint::cgroup::{cgroup_mounts, find_containers, ContainerCgroups, FoundBy};
use crate::checkpoint::pods::{is_candidate, pod_checkpoint_spec, PodCheckpointSpec, PodDefaults};
use crate::checkpoint::{Error, Signal, TargetDiscovery, TargetGroup};
use crate::metrics::Metrics;
use crate::node::drain::{PodPresence, PodWatch};
use crate::node::kube::controller_reference;
use crate::node::{reason, EventType, NodeOps, PodRef};

/// Bound on the one list discovery makes when the cache never synced.
pub const FALLBACK_LIST_TIMEOUT: Duration = Duration::from_secs(1);
/// Bound on the cache's own (re)lists.
const LIST_TIMEOUT: Duration = Duration::from_secs(30);
/// Server-side watch timeout (the API server ends the watch after it; we re-watch).
const WATCH_TIMEOUT_SECS: u32 = 290;
/// A watch silent for this long is presumed dead (a dropped connection sends nothing).
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 30);
/// How long the uid of a pod seen deleted is remembered for [`PodWatch::presence`] (longer than
/// any drain).
pub const GONE_MEMORY: Duration = Duration::from_secs(15 * 60);

/// Node-wide defaults for pods that do not override them.
#[derive(Clone, Debug)]
pub struct Defaults {
    pub signal: Signal,
    pub timeout: Duration,
}

/// What the cache keeps per pod (by uid).
#[derive(Clone, Debug)]
enum Cached {
    /// Opted in, running on this node, annotations valid.
    Target(Box<PodCheckpointSpec>),
    /// Anything else (kept so a later update can replace it).
    Other,
}

#[derive(Default)]
struct CacheState {
    /// A list succeeded at least once.
    synced: bool,
    /// Synced, and no list or watch has failed since the last successful list.
    healthy: bool,
    /// When the latest successful list was requested.
    listed_at: Option<Instant>,
    pods: HashMap<String, Cached>,
    /// Uids seen deleted (or missing from a relist), and when: for the drain.
    gone: HashMap<String, Instant>,
    /// `(pod uid, problem)` already reported with an Event.
    reported: HashSet<(String, String)>,
    /// Each opted-in pod's controller as last seen (`None`: it has none), kept while the pod is
    /// cached or remembered gone: a goodput Event's `related` after the drain deleted the pod.
    controllers: HashMap<String, Option<ObjectReference>>,
}

impl CacheState {
    fn mark_gone(&mut self, uid: String, now: Instant) {
        let (pods, controllers) = (&self.pods, &mut self.controllers);
        self.gone.retain(|uid, at| {
            let keep = now.saturating_duration_since(*at) < GONE_MEMORY;
            if !keep && !pods.contains_key(uid) {
                controllers.remove(uid);
            }
            keep
        });
        self.gone.insert(uid, now);
    }

    /// Remember `pod`'s controller when it is a target.
    fn note_controller(&mut self, uid: &str, pod: &Pod, entry: &Cached) {
        if matches!(entry, Cached::Target(_)) {
            self.controllers
                .insert(uid.to_string(), controller_reference(pod));
        }
    }
}

/// Finds opted-in pods' processes on this node.
pub struct KubeDiscovery {
    pods: Api<Pod>,
    node_name: String,
    node: Arc<dyn NodeOps>,
    defaults: PodDefaults,
    proc_root: PathBuf,
    metrics: Arc<Metrics>,
    cache: Mutex<CacheState>,
    /// Marked after every update of the cache and change of its health.
    changes: watch::Sender<()>,
    /// The cgroup hierarchies mounted here, where the containers' own cgroups are read.
    cgroup_mounts: Vec<PathBuf>,
    /// Where the opted-in containers' cgroups are, located in the background
    /// ([`KubeDiscovery::keep_cgroups_located`]) or by the last discovery.
    located: Mutex<Arc<ContainerCgroups>>,
}

/// Least time between two background walks of the cgroup hierarchies.
const LOCATE_INTERVAL: Duration = Duration::from_secs(1);

impl KubeDiscovery {
    pub fn new(
        client: kube::Client,
        node_name: String,
        node: Arc<dyn NodeOps>,
        defaults: Defaults,
        proc_root: PathBuf,
        metrics: Arc<Metrics>,
    ) -> Self {
        KubeDiscovery {
            pods: Api::all(client),
            node_name,
            node,
            defaults: PodDefaults {
                signal: defaults.signal,
                timeout: defaults.timeout,
                ..PodDefaults::default()
            },
            proc_root,
            metrics,
            cache: Mutex::new(CacheState::default()),
            changes: watch::Sender::new(()),
            cgroup_mounts: cgroup_mounts(),
            located: Mutex::new(Arc::new(ContainerCgroups::default())),
        }
    }

    /// (pod uid, container id) of every opted-in container in the cache.
    fn wanted_containers(&self) -> Vec<(String, String)> {
        self.state()
            .pods
            .values()
            .filter_map(|c| match c {
                Cached::Target(s) => Some(s),
                Cached::Other => None,
            })
            .flat_map(|s| {
                s.containers
                    .iter()
                    .map(|(_, id)| (s.pod.uid.clone(), id.clone()))
            })
            .collect()
    }

    fn located(&self) -> Arc<ContainerCgroups> {
        crate::sync::lock(&self.located).clone()
    }

    fn set_located(&self, map: ContainerCgroups) {
        *crate::sync::lock(&self.located) = Arc::new(map);
    }

    /// Keep the opted-in containers' cgroup directories located until `cancel`, so that a notice
    /// reads their `cgroup.procs` without walking the hierarchies: after a change of the pod cache
    /// that leaves a container unlocated, walk them once on a thread of its own, at most once per
    /// [`LOCATE_INTERVAL`]. Never on the signal path.
    pub async fn keep_cgroups_located(self: Arc<Self>, cancel: CancellationToken) {
        if self.cgroup_mounts.is_empty() {
            return;
        }
        let mut changes = self.changes.subscribe();
        loop {
            let wanted = self.wanted_containers();
            if !wanted.is_empty() && !self.located().has_all(&wanted) {
                let mounts = self.cgroup_mounts.clone();
                if let Ok(map) = crate::checkpoint::run_on_thread("sg-cgroup-locate", move || {
                    ContainerCgroups::locate(&mounts)
                })
                .await
                {
                    self.set_located(map);
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(LOCATE_INTERVAL) => {}
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                r = changes.changed() => if r.is_err() { return },
            }
        }
    }

    /// Whether the watch is healthy: synced, and no list or watch failing since.
    pub fn healthy(&self) -> bool {
        self.state().healthy
    }

    fn set_healthy(&self, healthy: bool) {
        let changed = {
            let mut st = self.state();
            let was = st.healthy;
            st.healthy = healthy && st.synced;
            was != st.healthy
        };
        if changed {
            self.changes.send_replace(());
        }
    }

    /// Whether the pod cache has been filled by a list at least once.
    pub fn synced(&self) -> bool {
        self.state().synced
    }

    fn state(&self) -> std::sync::MutexGuard<'_, CacheState> {
        crate::sync::lock(&self.cache)
    }

    /// The pod's `spotguard.io/checkpoint-upload` annotation and its owner (whose the location
    /// is), from the cache (opted-in pods).
    pub fn upload_location(&self, pod: &PodRef) -> Option<super::pods::UploadBinding> {
        match self.state().pods.get(&pod.uid) {
            Some(Cached::Target(spec)) => Some(super::pods::UploadBinding {
                location: spec.upload.clone(),
                owner: spec.owner.clone(),
            }),
            _ => None,
        }
    }

    /// Classify a pod; report a bad annotation (once per pod and problem) in the background.
    fn classify(&self, pod: &Pod) -> Cached {
        if !is_candidate(pod, &self.node_name) {
            return Cached::Other;
        }
        match pod_checkpoint_spec(pod, &self.defaults) {
            Ok(Some(spec)) => Cached::Target(Box::new(spec)),
            Ok(None) => Cached::Other,
            Err(e) => {
                let key = (pod.metadata.uid.clone().unwrap_or_default(), e.to_string());
                if self.state().reported.insert(key) {
                    self.metrics.error("checkpoint", e.metric_label());
                    warn!(error = %e, "pod with a bad checkpoint annotation will not be checkpointed");
                    if let Some(pod_ref) = pod_ref(pod) {
                        let node = self.node.clone();
                        let message = e.to_string();
                        tokio::spawn(async move {
                            let _ = node
                                .pod_event(
                                    &pod_ref,
                                    EventType::Warning,
                                    reason::BAD_ANNOTATION,
                                    &message,
                                )
                                .await;
                        });
                    }
                }
                Cached::Other
            }
        }
    }

    fn upsert(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let entry = self.classify(pod);
        let mut st = self.state();
        st.note_controller(&uid, pod, &entry);
        st.pods.insert(uid, entry);
        drop(st);
        self.changes.send_replace(());
    }

    fn remove(&self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            let mut st = self.state();
            st.pods.remove(uid);
            st.reported.retain(|(u, _)| u != uid);
            st.mark_gone(uid.clone(), Instant::now());
            drop(st);
            self.changes.send_replace(());
        }
    }

    /// Keep the pod cache warm until `cancel`: list, then watch from the list's resourceVersion;
    /// re-watch when the server ends a watch, relist on `410 Gone` or errors (jittered backoff).
    /// Until the first list succeeds, discovery falls back to a bounded list.
    /// The containers' cgroups are kept located beside it ([`KubeDiscovery::keep_cgroups_located`]).
    pub async fn keep_warm(self: Arc<Self>, cancel: CancellationToken) {
        let locating = cancel.child_token();
        tokio::spawn(self.clone().keep_cgroups_located(locating.clone()));
        let _stop_locating = locating.drop_guard();
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        loop {
            let outcome = tokio::select! {
                _ = cancel.cancelled() => return,
                r = self.list_and_watch() => r,
            };
            let pause = match outcome {
                Ok(()) => {
                    backoff.reset();
                    Duration::ZERO
                }
                Err(e) => {
                    self.set_healthy(false);
                    self.metrics.error("checkpoint", "pod_watch");
                    warn!(error = %e, "pod cache: list/watch of this node's pods failed; retrying");
                    backoff.next_delay()
                }
            };
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// One list + watch cycle. `Ok` when the cycle should simply start over (relist).
    async fn list_and_watch(&self) -> Result<(), String> {
        let requested = Instant::now();
        let list = tokio::time::timeout(LIST_TIMEOUT, self.pods.list(&on_node(&self.node_name)))
            .await
            .map_err(|_| format!("list timed out after {}s", LIST_TIMEOUT.as_secs()))?
            .map_err(|e| e.to_string())?;
        let mut rv = list.metadata.resource_version.clone().unwrap_or_default();
        {
            let fresh: HashMap<String, Cached> = list
                .items
                .iter()
                .filter_map(|p| Some((p.metadata.uid.clone()?, self.classify(p))))
                .collect();
            let mut st = self.state();
            let was_synced = st.synced;
            // What the previous view had and this list does not is gone.
            let missing: Vec<String> = st
                .pods
                .keys()
                .filter(|uid| !fresh.contains_key(*uid))
                .cloned()
                .collect();
            let now = Instant::now();
            for uid in missing {
                st.mark_gone(uid, now);
            }
            for p in &list.items {
                if let Some((uid, entry)) = p
                    .metadata
                    .uid
                    .as_ref()
                    .and_then(|u| Some((u, fresh.get(u)?)))
                {
                    st.note_controller(uid, p, entry);
                }
            }
            st.pods = fresh;
            st.synced = true;
            st.healthy = true;
            st.listed_at = Some(requested);
            let targets = st
                .pods
                .values()
                .filter(|c| matches!(c, Cached::Target(_)))
                .count();
            drop(st);
            self.changes.send_replace(());
            if !was_synced {
                info!(pods = list.items.len(), targets, "pod cache synced");
            }
        }
        loop {
            let wp = WatchParams::default()
                .fields(&format!("spec.nodeName={}", self.node_name))
                .timeout(WATCH_TIMEOUT_SECS);
            let stream = tokio::time::timeout(LIST_TIMEOUT, self.pods.watch(&wp, &rv))
                .await
                .map_err(|_| "starting the watch timed out".to_string())?
                .map_err(|e| e.to_string())?;
            let mut stream = std::pin::pin!(stream);
            loop {
                let next = match tokio::time::timeout(WATCH_IDLE, stream.next()).await {
                    Ok(n) => n,
                    Err(_) => return Err("watch silent for too long".into()),
                };
                match next {
                    None => break, // the server ended the watch: re-watch from rv
                    Some(Err(e)) => return Err(e.to_string()),
                    Some(Ok(ev)) => match ev {
                        WatchEvent::Added(p) | WatchEvent::Modified(p) => {
                            rv = p.metadata.resource_version.clone().unwrap_or(rv);
                            self.upsert(&p);
                        }
                        WatchEvent::Deleted(p) => {
                            rv = p.metadata.resource_version.clone().unwrap_or(rv);
                            self.remove(&p);
                        }
                        WatchEvent::Bookmark(b) => rv = b.metadata.resource_version,
                        WatchEvent::Error(status) if status.code == 410 => {
                            debug!("pod watch: resourceVersion too old; relisting");
                            return Ok(());
                        }
                        WatchEvent::Error(status) => {
                            return Err(format!("watch error {}: {}", status.code, status.message))
                        }
                    },
                }
            }
        }
    }

    /// The opted-in pods: from the cache, or (never synced) one bounded list.
    async fn specs(&self) -> Result<Vec<PodCheckpointSpec>, Error> {
        {
            let st = self.state();
            if st.synced {
                return Ok(st
                    .pods
                    .values()
                    .filter_map(|c| match c {
                        Cached::Target(s) => Some((**s).clone()),
                        Cached::Other => None,
                    })
                    .collect());
            }
        }
        warn!(
            timeout_ms = FALLBACK_LIST_TIMEOUT.as_millis() as u64,
            "pod cache never synced; listing this node's pods"
        );
        let list = tokio::time::timeout(
            FALLBACK_LIST_TIMEOUT,
            self.pods.list(&on_node(&self.node_name)),
        )
        .await
        .map_err(|_| {
            Error::ListPods(format!(
                "no answer within {} ms and the pod cache never synced",
                FALLBACK_LIST_TIMEOUT.as_millis()
            ))
        })?
        .map_err(|e| Error::ListPods(e.to_string()))?;
        Ok(list
            .items
            .iter()
            .filter_map(|p| match self.classify(p) {
                Cached::Target(s) => Some(*s),
                Cached::Other => None,
            })
            .collect())
    }
}

impl PodWatch for KubeDiscovery {
    fn presence(&self, uid: &str, listed_at: Instant) -> PodPresence {
        let st = self.state();
        if st.gone.contains_key(uid) {
            return PodPresence::Gone;
        }
        if !st.healthy {
            return PodPresence::Unknown;
        }
        // A list requested after the drain's own list returned is authoritative for absence.
        let relisted = st.listed_at.is_some_and(|at| at > listed_at);
        if relisted && !st.pods.contains_key(uid) {
            return PodPresence::Gone;
        }
        PodPresence::Present
    }

    fn changes(&self) -> watch::Receiver<()> {
        self.changes.subscribe()
    }

    fn controller(&self, uid: &str) -> Option<Option<ObjectReference>> {
        self.state().controllers.get(uid).cloned()
    }
}

fn on_node(node: &str) -> ListParams {
    ListParams::default().fields(&format!("spec.nodeName={node}"))
}

#[async_trait]
impl TargetDiscovery for KubeDiscovery {
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error> {
        let mut specs = self.specs().await?;
        if specs.is_empty() {
            return Ok(Vec::new());
        }
        specs.sort_by_key(|s| s.name());
        let wanted: Vec<(String, String)> = specs
            .iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .map(|(_, id)| (s.pod.uid.clone(), id.clone()))
            })
            .collect();
        let root = self.proc_root.clone();
        let mounts = self.cgroup_mounts.clone();
        let located = self.located();
        let (index, found_by, relocated) =
            crate::checkpoint::run_on_thread("sg-ckpt-scan", move || {
                find_containers(&root, &mounts, &located, &wanted)
            })
            .await
            .map_err(|e| Error::Proc {
                path: self.proc_root.display().to_string(),
                source: e,
            })??;
        if let Some(map) = relocated {
            self.set_located(map);
        }
        if found_by == FoundBy::FullScan {
            debug!(
                "checkpoint discovery scanned every process (container cgroups not readable here)"
            );
        }
        let mut groups = Vec::new();
        for spec in specs {
            if spec.containers.is_empty() {
                debug!(pod = %spec.name(), "opted-in pod has no running container yet");
            }
            let mut containers = Vec::new();
            for (name, id) in &spec.containers {
                match index.container(&spec.pod.uid, id) {
                    Some(mut c) => {
                        c.name = name.clone();
                        containers.push(c);
                    }
                    None => {
                        debug!(pod = %spec.name(), container = %name, "no processes found for container")
                    }
                }
            }
            groups.push(TargetGroup {
                name: spec.name(),
                pod: Some(spec.pod),
                containers,
                mode: spec.mode,
                signal: spec.signal,
                dir: spec.dir,
                timeout: spec.timeout,
                proc_root: self.proc_root.clone(),
            });
        }
        Ok(groups)
    }
}

fn pod_ref(pod: &Pod) -> Option<PodRef> {
    Some(PodRef {
        namespace: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        uid: pod.metadata.uid.clone().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    use super::*;
    use crate::checkpoint::pods::PodOwner;

    fn target(uid: &str) -> (Pod, Cached) {
        let pod = Pod {
            metadata: ObjectMeta {
                namespace: Some("ml".into()),
                name: Some(format!("train-{uid}")),
                uid: Some(uid.into()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "batch/v1".into(),
                    kind: "Job".into(),
                    name: "train".into(),
                    uid: "job-uid".into(),
                    controller: Some(true),
                    ..Default::default()
                }]),
                ..Default::default()
            },
            ..Default::default()
        };
        let spec = PodCheckpointSpec {
            pod: PodRef {
                namespace: "ml".into(),
                name: format!("train-{uid}"),
                uid: uid.into(),
            },
            signal: Signal::USR1,
            mode: Default::default(),
            containers: vec![],
            dir: PathBuf::from("/ckpt"),
            timeout: Duration::from_secs(1),
            upload: None,
            owner: PodOwner::of(&pod),
        };
        (pod, Cached::Target(Box::new(spec)))
    }

    #[test]
    fn a_targets_controller_outlives_the_pod_for_as_long_as_it_is_remembered_gone() {
        let mut st = CacheState::default();
        let t0 = Instant::now();
        for uid in ["a", "b"] {
            let (pod, entry) = target(uid);
            st.note_controller(uid, &pod, &entry);
            st.pods.insert(uid.into(), entry);
        }
        // Another pod that is not a target is not remembered.
        let (other, _) = target("c");
        st.note_controller("c", &other, &Cached::Other);
        assert_eq!(st.controllers.get("c"), None);
        // Both deleted in one relist: both controllers are still known.
        st.pods.clear();
        st.mark_gone("a".into(), t0);
        st.mark_gone("b".into(), t0);
        for uid in ["a", "b"] {
            let known = st.controllers.get(uid).cloned().flatten().unwrap();
            assert_eq!(known.kind.as_deref(), Some("Job"));
            assert_eq!(known.name.as_deref(), Some("train"));
            assert_eq!(known.uid.as_deref(), Some("job-uid"));
        }
        // Once forgotten as gone, forgotten as a controller too.
        st.mark_gone("z".into(), t0 + GONE_MEMORY + Duration::from_secs(1));
        assert!(st.controllers.is_empty(), "{:?}", st.controllers);
    }
}
