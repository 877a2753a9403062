//! The pod condition `DisruptionTarget` on the pods a notice's plan will take down: the
//! condition the kubelet's graceful node shutdown and the Eviction API set, which Job
//! `podFailurePolicy`, JobSet `failurePolicy` and Kueue read to tell "the machine was taken" from
//! "the job failed". Set right after the checkpoint signal, so that a trainer that acks and exits
//! before the drain evicts its pod (or one killed at power-off) already carries it when it fails.
//!
//! One strategic-merge patch of `pods/status` per pod (conditions merge by `type`: the kubelet's
//! own conditions stay), carrying the pod's uid (a replacement pod of the same name answers 409 and
//! is left alone). Which pods: those the drain would evict ([`crate::node::filter`]).

use futures::stream::{self, StreamExt};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use super::api::with_timeout;
use super::{KubeNodeOps, FIELD_MANAGER};
use crate::node::filter::{self, pod_key};
use crate::node::{Disruption, Error, DISRUPTION_TARGET};

/// Status patches in flight at once.
const CONCURRENCY: usize = 16;

/// Whether `pod` already shows `DisruptionTarget` True (set by an earlier run, the kubelet or an
/// eviction): nothing to write.
fn already_marked(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == DISRUPTION_TARGET && c.status == "True")
        })
}

impl KubeNodeOps {
    /// Set `DisruptionTarget` on every pod of this node the drain would evict. Returns the pods
    /// marked (`namespace/name`); a pod that could not be marked is logged and counted, never an
    /// error of the whole (only the list is).
    pub(super) async fn mark_disruption_target(
        &self,
        disruption: &Disruption,
    ) -> Result<Vec<String>, Error> {
        let all: Api<Pod> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node_name));
        let pods = match with_timeout(all.list(&params)).await {
            Ok(list) => list.items,
            Err(source) => {
                self.metrics.error("node", "list_pods");
                return Err(Error::ListPods {
                    node: self.node_name.clone(),
                    source,
                });
            }
        };
        let own = self
            .own_pod
            .as_ref()
            .map(|(ns, name)| (ns.as_str(), name.as_str()));
        let (taken, _) = filter::partition(pods, own);
        let taken: Vec<Pod> = taken.into_iter().filter(|p| !already_marked(p)).collect();
        if self.dry_run {
            for pod in &taken {
                tracing::info!(pod = %pod_key(pod), reason = disruption.reason, "dry-run: would set the DisruptionTarget condition");
            }
            return Ok(taken.iter().map(pod_key).collect());
        }
        let now = Timestamp::now().to_string();
        let marked: Vec<Option<String>> = stream::iter(taken)
            .map(|pod| {
                let now = now.clone();
                async move {
                    let key = pod_key(&pod);
                    let result = self.patch_condition(&pod, disruption, &now).await;
                    self.metrics.action("disruption_target", result.is_ok());
                    match result {
                        Ok(()) => Some(key),
                        Err(e) => {
                            self.metrics.error("node", e.metric_label());
                            tracing::warn!(pod = %key, error = %e, "setting the DisruptionTarget condition failed");
                            None
                        }
                    }
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let mut marked: Vec<String> = marked.into_iter().flatten().collect();
        marked.sort();
        Ok(marked)
    }

    /// The one status patch of one pod (no retries: the plan's budget bounds it, and the
    /// eviction sets the same condition on a pod still running at the drain).
    async fn patch_condition(
        &self,
        pod: &Pod,
        disruption: &Disruption,
        now: &str,
    ) -> Result<(), Error> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
        let patch = json!({
            "metadata": { "uid": pod.metadata.uid },
            "status": { "conditions": [{
                "type": DISRUPTION_TARGET,
                "status": "True",
                "reason": disruption.reason,
                "message": disruption.message,
                "lastTransitionTime": now,
            }] }
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        with_timeout(pods.patch_status(&name, &params, &Patch::Strategic(&patch)))
            .await
            .map(|_| ())
            .map_err(|source| Error::PatchPod {
                pod: format!("{ns}/{name}"),
                source,
            })
    }
}
