//! Pod-requested prefetch: the `spotguard.io/prefetch` annotations of the pods on this node.
//!
//! A watch of this node's pods (kube's `watcher`, `spec.nodeName` field selector, relists from
//! the API server's watch cache, retried through [`crate::backoff`]) keeps what each running or
//! pending pod asked for. A pod is evaluated when it appears or its annotation changes: each
//! entry (`NAME=URL` or a URL) is checked against the operator's [`AnnotationPolicy`]; a refusal
//! is a Warning Event on the pod (once per pod and annotation value) and
//! `spotguard_prefetch_refused_total{reason}`. Accepted datasets are `ensure`d at once. Every
//! `interval`, with no API request, the accepted datasets are `ensure`d again (a no-op when
//! complete or running; fetched again after an eviction or a failure) and their leases are
//! touched here, by the prefetcher: a dataset referenced by a pod on the node is never evicted,
//! whether or not the pod can write to the cache (the example Job mounts it read-only). A pod
//! that finishes, loses its annotation or goes is forgotten; a relist forgets the pods it no
//! longer has.
//!
//! Idle, this costs the API server one open watch (re-opened every few minutes) instead of a
//! list every round.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::cache::{self, DatasetPaths};
use super::policy::{annotation_entries, AnnotationPolicy, Refusal};
use super::{Error, PrefetchMetrics, Prefetcher};
use crate::backoff::Backoff;
use crate::checkpoint::PodRef;
use crate::node::{EventType, NodeOps};

/// Annotation asking spotguard to warm datasets on the pod's node.
pub const PREFETCH_ANNOTATION: &str = "spotguard.io/prefetch";
/// Reason of the Warning Event on a pod whose request was refused.
pub const REFUSED_REASON: &str = "PrefetchRefused";
/// Retries of the pod watch: 500 ms doubling up to 30 s.
const WATCH_BACKOFF: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));

/// What a pod asked for, as last evaluated.
struct PodState {
    /// The annotation's value when evaluated.
    value: String,
    /// Accepted `(name, url)` pairs.
    accepted: Vec<(String, String)>,
}

/// What the watcher knows, for whoever looks (the prefetcher's tests, its logs).
#[derive(Debug, Default)]
pub struct Requests {
    inner: Mutex<Snapshot>,
}

#[derive(Clone, Debug, Default)]
struct Snapshot {
    synced: bool,
    pods: usize,
    referenced: BTreeSet<String>,
    rounds: u64,
}

impl Requests {
    fn lock(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        crate::sync::lock(&self.inner)
    }

    /// Whether a list of the node's pods has been seen.
    pub fn synced(&self) -> bool {
        self.lock().synced
    }

    /// How many pods with a prefetch annotation are remembered (running or pending ones).
    pub fn pods(&self) -> usize {
        self.lock().pods
    }

    /// The datasets pods on the node asked for and were allowed.
    pub fn referenced(&self) -> BTreeSet<String> {
        self.lock().referenced.clone()
    }

    /// Lease rounds done so far.
    pub fn rounds(&self) -> u64 {
        self.lock().rounds
    }
}

/// The annotation watcher.
pub struct AnnotationWatcher {
    pub pods: Api<Pod>,
    pub node_name: String,
    pub prefetcher: Prefetcher,
    pub policy: AnnotationPolicy,
    /// Where refusal Events go.
    pub events: Arc<dyn NodeOps>,
    pub metrics: Arc<PrefetchMetrics>,
    /// How often accepted datasets are ensured again and their leases touched.
    pub interval: Duration,
}

impl AnnotationWatcher {
    /// Run until `cancel`, keeping `requests` up to date.
    pub async fn run(self, requests: Arc<Requests>, cancel: CancellationToken) {
        let config = watcher::Config::default()
            .fields(&format!("spec.nodeName={}", self.node_name))
            .any_semantic();
        let mut events = std::pin::pin!(watcher(self.pods.clone(), config));
        let mut state: HashMap<String, PodState> = HashMap::new();
        // Pods of a (re)list in progress: replace the state when it is complete.
        let mut listing: Option<Vec<Pod>> = None;
        let mut backoff = WATCH_BACKOFF;
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first round is the one after the first list.
        tick.reset();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {
                    let names = self.maintain(&state).await;
                    let mut snap = requests.lock();
                    snap.referenced = names;
                    snap.rounds += 1;
                }
                event = events.next() => {
                    let Some(event) = event else { return };
                    match event {
                        Ok(event) => {
                            backoff.reset();
                            match event {
                                watcher::Event::Init => listing = Some(Vec::new()),
                                watcher::Event::InitApply(pod) => {
                                    listing.get_or_insert_with(Vec::new).push(pod)
                                }
                                watcher::Event::InitDone => {
                                    let pods = listing.take().unwrap_or_default();
                                    self.relisted(&mut state, pods).await;
                                    let names = self.maintain(&state).await;
                                    let mut snap = requests.lock();
                                    snap.synced = true;
                                    snap.rounds += 1;
                                    drop(snap);
                                    debug!(datasets = names.len(), "prefetch requests in step with the node's pods");
                                }
                                watcher::Event::Apply(pod) => self.observe(&mut state, &pod).await,
                                watcher::Event::Delete(pod) => {
                                    if let Some(uid) = &pod.metadata.uid {
                                        state.remove(uid);
                                    }
                                }
                            }
                            let mut snap = requests.lock();
                            snap.pods = state.len();
                            snap.referenced = referenced(&state);
                        }
                        Err(e) => {
                            self.metrics.error("pod_watch");
                            let pause = backoff.next_delay();
                            warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "watching pods for prefetch annotations failed");
                            tokio::select! {
                                _ = cancel.cancelled() => return,
                                _ = tokio::time::sleep(pause) => {}
                            }
                        }
                    }
                }
            }
        }
    }

    /// A complete (re)list: evaluate what is new or changed, forget what is not listed.
    async fn relisted(&self, state: &mut HashMap<String, PodState>, pods: Vec<Pod>) {
        let mut listed: HashSet<String> = HashSet::new();
        for pod in &pods {
            if let Some(uid) = &pod.metadata.uid {
                listed.insert(uid.clone());
            }
            self.observe(state, pod).await;
        }
        state.retain(|uid, _| listed.contains(uid));
        debug!(
            pods = pods.len(),
            requests = state.len(),
            "pods listed for prefetch annotations"
        );
    }

    /// A pod as the watch shows it now: evaluate a new or changed annotation; forget a pod
    /// that finished or no longer asks.
    async fn observe(&self, state: &mut HashMap<String, PodState>, pod: &Pod) {
        let Some(pod_ref) = pod_ref(pod) else {
            return;
        };
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let value = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(PREFETCH_ANNOTATION));
        let value = match value {
            Some(v) if !matches!(phase, Some("Succeeded") | Some("Failed")) => v,
            _ => {
                state.remove(&pod_ref.uid);
                return;
            }
        };
        if state.get(&pod_ref.uid).is_some_and(|s| &s.value == value) {
            return;
        }
        let accepted = self.evaluate(&pod_ref, value).await;
        state.insert(
            pod_ref.uid.clone(),
            PodState {
                value: value.clone(),
                accepted,
            },
        );
    }

    /// One round, without the API server: accepted datasets started again if evicted or
    /// failed since, and their leases touched. Returns the referenced dataset names.
    async fn maintain(&self, state: &HashMap<String, PodState>) -> BTreeSet<String> {
        for s in state.values() {
            for (name, url) in &s.accepted {
                if let Err(e) = self.prefetcher.ensure(name, url) {
                    self.metrics.error(e.metric_label());
                    warn!(dataset = %name, url = %url, error = %e, "cannot prefetch a dataset a pod asked for");
                }
            }
        }
        let names = referenced(state);
        self.touch_leases(&names).await;
        names
    }

    /// Check each entry of a pod's annotation; refusals become Events. Returns what was accepted.
    async fn evaluate(&self, pod: &PodRef, value: &str) -> Vec<(String, String)> {
        let mut accepted = Vec::new();
        for spec in annotation_entries(value) {
            let checked = self.policy.check(spec, &pod.namespace).and_then(|(name, url)| {
                match self.prefetcher.ensure(&name, &url) {
                    Ok(how) => {
                        info!(pod = %format!("{}/{}", pod.namespace, pod.name), dataset = %name, url = %url, how = how.as_str(), "prefetch requested by pod annotation");
                        Ok((name, url))
                    }
                    // Not the pod's fault, and retried next round: no refusal.
                    Err(Error::Cancelled) => Ok((name, url)),
                    Err(e) => Err(Refusal::Prefetch(e.to_string())),
                }
            });
            match checked {
                Ok(pair) => accepted.push(pair),
                Err(refusal) => self.refuse(pod, &refusal).await,
            }
        }
        accepted
    }

    async fn refuse(&self, pod: &PodRef, refusal: &Refusal) {
        self.metrics.refused(refusal.metric_label());
        warn!(pod = %format!("{}/{}", pod.namespace, pod.name), reason = refusal.metric_label(), error = %refusal, "prefetch request refused");
        let message = format!("{PREFETCH_ANNOTATION} refused: {refusal}");
        if let Err(e) = self
            .events
            .pod_event(pod, EventType::Warning, REFUSED_REASON, &message)
            .await
        {
            warn!(error = %e, "could not record the refusal Event");
        }
    }

    async fn touch_leases(&self, names: &BTreeSet<String>) {
        if names.is_empty() {
            return;
        }
        let root = self.prefetcher.cache_root().to_path_buf();
        let names = names.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for name in names {
                let paths = DatasetPaths::new(&root, &name);
                // Only datasets that exist (touching creates the metadata directory).
                if paths.meta.is_dir() {
                    if let Err(e) = cache::touch_lease(&paths) {
                        warn!(dataset = %name, error = %e, "could not touch a dataset's lease");
                    }
                }
            }
        })
        .await;
    }
}

fn referenced(state: &HashMap<String, PodState>) -> BTreeSet<String> {
    state
        .values()
        .flat_map(|s| s.accepted.iter().map(|(n, _)| n.clone()))
        .collect()
}

fn pod_ref(pod: &Pod) -> Option<PodRef> {
    Some(PodRef {
        namespace: pod.metadata.namespace.clone()?,
        name: pod.metadata.name.clone()?,
        uid: pod.metadata.uid.clone().unwrap_or_default(),
    })
}
