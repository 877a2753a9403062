//! Pod-requested prefetch: the `spotguard.io/prefetch` annotations of the pods on this node.
//!
//! Every round (`interval`), list this node's pods (`spec.nodeName` field selector) and, for each
//! running or pending pod, check each entry of its annotation (`NAME=URL` or a URL) against the
//! operator's [`AnnotationPolicy`]; a refusal is a Warning Event on the pod (once per pod and
//! entry) and `spotguard_prefetch_refused_total{reason}`. Accepted datasets are `ensure`d (a
//! no-op when complete or running; fetched again after an eviction or a failure), and their
//! leases are touched here, by the prefetcher: a dataset referenced by a pod on the node is
//! never evicted, whether or not the pod can write to the cache (the example Job mounts it
//! read-only). The state kept between rounds is that of the pods listed last: it shrinks as pods
//! go.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::cache::{self, DatasetPaths};
use super::policy::{annotation_entries, AnnotationPolicy, Refusal};
use super::{Error, PrefetchMetrics, Prefetcher};
use crate::checkpoint::PodRef;
use crate::node::{EventType, NodeOps};

/// Annotation asking spotguard to warm datasets on the pod's node.
pub const PREFETCH_ANNOTATION: &str = "spotguard.io/prefetch";
/// Reason of the Warning Event on a pod whose request was refused.
pub const REFUSED_REASON: &str = "PrefetchRefused";

/// What a pod asked for, as last evaluated.
pub struct PodState {
    /// The annotation's value when evaluated.
    value: String,
    /// Accepted `(name, url)` pairs.
    accepted: Vec<(String, String)>,
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
    pub interval: Duration,
}

impl AnnotationWatcher {
    /// Run until `cancel`.
    pub async fn run(self, cancel: CancellationToken) {
        let mut state: HashMap<String, PodState> = HashMap::new();
        loop {
            self.round(&mut state).await;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    /// One round: list, evaluate new or changed annotations, re-ensure and lease what is
    /// referenced. Returns the referenced dataset names.
    pub async fn round(&self, state: &mut HashMap<String, PodState>) -> BTreeSet<String> {
        // This node's pods only, served from the API server's watch cache (resourceVersion=0):
        // cheap enough to repeat every round.
        let lp = ListParams::default()
            .fields(&format!("spec.nodeName={}", self.node_name))
            .match_any();
        let list = match self.pods.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                self.metrics.error("list_pods");
                warn!(error = %e, "listing pods for prefetch annotations failed");
                // Keep leasing what the last listing referenced.
                let names = referenced(state);
                self.touch_leases(&names).await;
                return names;
            }
        };
        let mut present: HashSet<String> = HashSet::new();
        for pod in &list.items {
            let Some(pod_ref) = pod_ref(pod) else {
                continue;
            };
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded") | Some("Failed")) {
                continue;
            }
            let Some(value) = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(PREFETCH_ANNOTATION))
            else {
                continue;
            };
            present.insert(pod_ref.uid.clone());
            if state.get(&pod_ref.uid).is_some_and(|s| &s.value == value) {
                continue;
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
        // Pods gone (or finished, or without the annotation now) are forgotten.
        state.retain(|uid, _| present.contains(uid));
        // Accepted datasets: started again if evicted or failed since.
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
            let checked = self.policy.check(spec).and_then(|(name, url)| {
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
