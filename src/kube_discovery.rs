//! Kubernetes-mode checkpoint discovery: list the pods on this node (`spec.nodeName` field
//! selector), parse their `spotguard.io/checkpoint*` annotations, and map each opted-in
//! container to host processes through `/proc/*/cgroup`. A bad annotation skips that pod with a
//! Warning Event on it; the rest proceed. Also watches `spotguard.io/prefetch` annotations.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::checkpoint::cgroup::ProcIndex;
use crate::checkpoint::pods::{is_candidate, pod_checkpoint_spec, PodDefaults};
use crate::checkpoint::{Error, PodRef, Signal, TargetDiscovery, TargetGroup};
use crate::metrics::Metrics;
use crate::node::{reason, EventType, NodeOps};
use crate::prefetch::Prefetcher;

/// Annotation asking spotguard to warm a dataset on the pod's node.
pub const PREFETCH_ANNOTATION: &str = "spotguard.io/prefetch";

/// Node-wide defaults for pods that do not override them.
#[derive(Clone, Debug)]
pub struct Defaults {
    pub signal: Signal,
    pub timeout: Duration,
}

/// Finds opted-in pods' processes on this node.
pub struct KubeDiscovery {
    pods: Api<Pod>,
    node_name: String,
    node: Arc<dyn NodeOps>,
    defaults: Defaults,
    proc_root: PathBuf,
    metrics: Arc<Metrics>,
}

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
            defaults,
            proc_root,
            metrics,
        }
    }
}

fn on_node(node: &str) -> ListParams {
    ListParams::default().fields(&format!("spec.nodeName={node}"))
}

#[async_trait]
impl TargetDiscovery for KubeDiscovery {
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error> {
        let list = self
            .pods
            .list(&on_node(&self.node_name))
            .await
            .map_err(|e| Error::ListPods(e.to_string()))?;
        let defaults = PodDefaults {
            signal: self.defaults.signal,
            timeout: self.defaults.timeout,
            ..PodDefaults::default()
        };
        let mut specs = Vec::new();
        for pod in &list.items {
            if !is_candidate(pod, &self.node_name) {
                continue;
            }
            match pod_checkpoint_spec(pod, &defaults) {
                Ok(Some(spec)) => specs.push(spec),
                Ok(None) => {}
                Err(e) => {
                    self.metrics.error("checkpoint", e.metric_label());
                    warn!(error = %e, "skipping pod with a bad checkpoint annotation");
                    if let Some(pod_ref) = pod_ref(pod) {
                        let _ = self
                            .node
                            .pod_event(
                                &pod_ref,
                                EventType::Warning,
                                reason::BAD_ANNOTATION,
                                &e.to_string(),
                            )
                            .await;
                    }
                }
            }
        }
        if specs.is_empty() {
            return Ok(Vec::new());
        }
        let root = self.proc_root.clone();
        let index = tokio::task::spawn_blocking(move || ProcIndex::scan(&root))
            .await
            .map_err(|e| Error::Proc {
                path: self.proc_root.display().to_string(),
                source: std::io::Error::other(e),
            })??;
        let mut groups = Vec::new();
        for spec in specs {
            if spec.containers.is_empty() {
                info!(pod = %spec.name(), "opted-in pod has no running container yet");
            }
            let mut containers = Vec::new();
            for (name, id) in &spec.containers {
                match index.container(&spec.pod.uid, id) {
                    Some(mut c) => {
                        c.name = name.clone();
                        containers.push(c);
                    }
                    None => {
                        debug!(pod = %format!("{}/{}", spec.pod.namespace, spec.pod.name), container = %name, "no processes found for container")
                    }
                }
            }
            groups.push(TargetGroup {
                name: format!("{}/{}", spec.pod.namespace, spec.pod.name),
                pod: Some(spec.pod),
                containers,
                mode: spec.mode,
                signal: spec.signal,
                dir: spec.dir,
                timeout: spec.timeout,
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

/// Every 30 s, list this node's pods and `ensure()` the datasets their `spotguard.io/prefetch`
/// annotations name. Errors are logged and counted; the loop goes on.
pub async fn watch_prefetch_annotations(
    client: kube::Client,
    node_name: String,
    prefetcher: Arc<Prefetcher>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let pods: Api<Pod> = Api::all(client);
    let mut seen: HashSet<String> = HashSet::new();
    loop {
        match pods.list(&on_node(&node_name)).await {
            Ok(list) => {
                for pod in &list.items {
                    let Some(url) = pod
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(PREFETCH_ANNOTATION))
                    else {
                        continue;
                    };
                    for u in url.split(',').map(str::trim).filter(|u| !u.is_empty()) {
                        if !seen.insert(u.to_string()) {
                            continue;
                        }
                        match prefetcher.ensure_url(u) {
                            Ok((name, how)) => {
                                info!(dataset = %name, url = %u, how = crate::app::ensure_label(&how), "prefetch requested by pod annotation");
                            }
                            Err(e) => {
                                metrics.error("prefetch", e.metric_label());
                                warn!(url = %u, error = %e, "cannot prefetch the dataset a spotguard.io/prefetch annotation names");
                                // Not marked seen: a transient error is retried on the next round.
                                seen.remove(u);
                            }
                        }
                    }
                }
            }
            Err(e) => {
                metrics.error("prefetch", "list_pods");
                warn!(error = %e, "listing pods for prefetch annotations failed");
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(30)) => {}
        }
    }
}
