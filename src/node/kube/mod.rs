//! [`NodeOps`] through the Kubernetes API server, for this node only.
//!
//! - The plan state lives in the node annotation `spotguard.io/notice` (JSON [`PlanState`]).
//! - Taint + cordon is one read-modify-write carrying `metadata.resourceVersion`: a 409 re-reads
//!   and retries almost at once, 429 / 5xx / transport errors retry after a short backoff, and
//!   only what was not already there is reported in [`Applied`] (an operator's cordon stays).
//! - Events are `events.k8s.io/v1` Events on the Node (namespace `default`) or on a Pod, reported
//!   by `spotguard.io/agent`; a repeat of the same event within a few minutes bumps its `series`.
//! - GPU health: conditions `GPUUnhealthy` / `GPUDegraded` through a strategic-merge patch of
//!   `nodes/status` (merge key `type`, so the kubelet's conditions are untouched) and the taint
//!   `spotguard.io/gpu-unhealthy:NoSchedule` while unhealthy.
//! - `DisruptionTarget` on the pods a plan takes down: a strategic-merge patch of `pods/status`
//!   per pod (`disruption`).
//! - Dry-run: reads happen, every write is logged instead.
//!
//! Build the client with [`client_from_config`] (or set `default_retry = false`): kube's built-in
//! retry layer would swallow the 429s that tell the drain which PodDisruptionBudget blocks it.
//!
//! Files: this one holds [`KubeNodeOps`] and the plan state, protection and drain parts of
//! [`NodeOps`]; `api` the bounded API call and the node's reads and resourceVersion-guarded writes
//! (retries through [`crate::backoff`]); `events` the Events and their series; `ledger` the goodput
//! records (`Interruption` objects) written beside the goodput Events, `owner` whom each belongs
//! to (the pod's controller, or its Job's JobSet); `conditions` the
//! GPU conditions and taint; `drain` the deadline-bounded drain through the Eviction API.

mod api;
mod conditions;
mod disruption;
mod drain;
mod events;
pub mod ledger;
pub mod owner;

pub use events::controller_reference;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use async_trait::async_trait;
use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, Patch};
use kube::Client;
use serde_json::{json, Value};

use super::drain::PodWatch;
use super::{
    Applied, AppliedMarks, Disruption, DrainReport, DrainRequest, Error, EventType,
    GpuConditionTypes, GpuConditions, NodeOps, Protection, APPLIED_ANNOTATION, INTERRUPTION_TAINT,
    NOTICE_ANNOTATION,
};
use crate::metrics::Metrics;
use crate::node::PodRef;
pub(crate) use api::{with_timeout, API_BACKOFF};
use events::{EventKey, SeriesEntry};

/// `reportingController` of spotguard's Events.
pub const REPORTING_CONTROLLER: &str = "spotguard.io/agent";
/// Field manager named on every write.
pub const FIELD_MANAGER: &str = "spotguard";
/// Default node condition types (problem polarity: status True = problem present); the types
/// in use are configurable ([`KubeNodeOps::with_gpu_condition_types`]).
pub const CONDITION_GPU_UNHEALTHY: &str = super::DEFAULT_GPU_UNHEALTHY_CONDITION;
pub const CONDITION_GPU_DEGRADED: &str = super::DEFAULT_GPU_DEGRADED_CONDITION;

/// A kube client for spotguard: kube's default retry layer off (spotguard classifies 429 / 5xx
/// itself, bounded by the notice deadline).
pub fn client_from_config(mut config: kube::Config) -> Result<Client, ::kube::Error> {
    config.default_retry = false;
    Client::try_from(config)
}

/// The Kubernetes implementation of [`NodeOps`].
pub struct KubeNodeOps {
    client: Client,
    nodes: Api<Node>,
    node_name: String,
    own_pod: Option<(String, String)>,
    dry_run: bool,
    metrics: Arc<Metrics>,
    node_uid: Mutex<Option<String>>,
    series: Mutex<HashMap<EventKey, SeriesEntry>>,
    gpu_types: GpuConditionTypes,
    /// Set once by the app after the pod cache that feeds it was built (the cache reports
    /// through these node operations, so it comes second).
    pod_watch: OnceLock<Arc<dyn PodWatch>>,
    /// How long a bare pod's goodput record is kept (`ledger`).
    record_ttl: std::time::Duration,
    /// When this agent last looked for its expired goodput records.
    last_sweep: Mutex<Option<tokio::time::Instant>>,
    /// The JobSets of the Jobs whose pods' goodput records were written (`owner`).
    job_owners: Arc<owner::JobOwners>,
}

#[derive(Clone, Copy, Debug, Default)]
struct ProtectChange {
    cordon: bool,
    taint: bool,
}

impl KubeNodeOps {
    pub fn new(
        client: Client,
        node_name: String,
        own_pod: Option<(String, String)>,
        dry_run: bool,
        metrics: Arc<Metrics>,
    ) -> KubeNodeOps {
        KubeNodeOps {
            nodes: Api::all(client.clone()),
            client,
            node_name,
            own_pod,
            dry_run,
            metrics,
            node_uid: Mutex::new(None),
            series: Mutex::new(HashMap::new()),
            gpu_types: GpuConditionTypes::default(),
            pod_watch: OnceLock::new(),
            record_ttl: ledger::DEFAULT_RECORD_TTL,
            last_sweep: Mutex::new(None),
            job_owners: Arc::default(),
        }
    }

    /// Keep a bare pod's goodput records this long (default [`ledger::DEFAULT_RECORD_TTL`]).
    pub fn with_record_ttl(mut self, ttl: std::time::Duration) -> Self {
        self.record_ttl = ttl;
        self
    }

    /// Let the drain learn from `watch` (the agent's watch of this node's pods) when an evicted
    /// pod is gone, instead of polling the API server for each pod. The first call wins.
    pub fn set_pod_watch(&self, watch: Arc<dyn PodWatch>) {
        let _ = self.pod_watch.set(watch);
    }

    /// Show the GPU verdict under these condition types (default `GPUUnhealthy` /
    /// `GPUDegraded`, no Ready-polarity condition).
    pub fn with_gpu_condition_types(mut self, types: GpuConditionTypes) -> Self {
        self.gpu_types = types;
        self
    }

    /// The JobSets of the Jobs read for goodput records (recovery validation asks them too).
    pub fn job_owners(&self) -> Arc<owner::JobOwners> {
        self.job_owners.clone()
    }

    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn dry_run(&self) -> bool {
        self.dry_run
    }

    /// Set the plan state annotation to `value` (`null` removes it), counted as `annotate`.
    async fn annotate_state(&self, value: Value) -> Result<(), Error> {
        let patch = json!({ "metadata": { "annotations": { NOTICE_ANNOTATION: value } } });
        let result = self
            .patch_blind("annotate", false, Patch::Merge(patch))
            .await;
        self.count("annotate", &result);
        result
    }

    fn count(&self, action: &str, result: &Result<impl Sized, Error>) {
        if !self.dry_run {
            self.metrics.action(action, result.is_ok());
        }
        if let Err(e) = result {
            self.metrics.error("node", e.metric_label());
        }
    }
}

/// The merge patch that puts `protection` on `node` (the taint, the cordon, and the
/// `spotguard.io/applied` marks when they change), with what it changes; `None` when the node
/// already shows it.
fn protect_patch(node: &Node, protection: &Protection) -> Option<(Value, ProtectChange)> {
    let effect = protection.effect.as_str();
    let value = protection.taint_value.as_str();
    let cordoned = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
    let mut taints = node_taints(node);
    let need_cordon = protection.cordon && !cordoned;
    let existing = taints
        .iter()
        .position(|t| t.key == INTERRUPTION_TAINT && t.effect == effect);
    let need_taint = match existing {
        Some(i) => taints[i].value.as_deref() != Some(value),
        None => true,
    };
    if !need_cordon && !need_taint {
        return None;
    }
    let mut marks = marks_of(node);
    let before = marks.clone();
    marks.cordoned |= need_cordon;
    if need_taint && !marks.taints.contains(&protection.effect) {
        marks.taints.push(protection.effect);
    }
    let mut spec = json!({});
    if need_cordon {
        spec["unschedulable"] = json!(true);
    }
    if need_taint {
        match existing {
            Some(i) => taints[i].value = Some(value.to_string()),
            None => taints.push(Taint {
                key: INTERRUPTION_TAINT.to_string(),
                value: Some(value.to_string()),
                effect: effect.to_string(),
                time_added: None,
            }),
        }
        spec["taints"] = taints_value(&taints);
    }
    let mut patch = json!({ "spec": spec });
    if marks != before {
        patch["metadata"]["annotations"][APPLIED_ANNOTATION] = marks_value(&marks);
    }
    Some((
        patch,
        ProtectChange {
            cordon: need_cordon,
            taint: need_taint,
        },
    ))
}

#[async_trait]
impl NodeOps for KubeNodeOps {
    async fn pod_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let regarding = events::pod_reference(pod);
        self.emit(&pod.namespace, regarding, kind, reason, message)
            .await
    }

    /// The pod Event with `record` in its annotation [`super::RECORD_ANNOTATION`] and the pod's
    /// controller as `related` (from the pod watch; one GET of the pod when the watch never saw
    /// it).
    async fn pod_record_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
        record: &str,
    ) -> Result<(), Error> {
        let annotations = Some(std::collections::BTreeMap::from([(
            super::RECORD_ANNOTATION.to_string(),
            record.to_string(),
        )]));
        let related = self.pod_controller(pod).await;
        let extra = events::Extra {
            annotations,
            related: related.clone(),
        };
        let regarding = events::pod_reference(pod);
        // The Event is the notification; the ledger's object is the record that lasts. One
        // failing does not keep the other from being written; the record's failure is the one
        // reported when both fail.
        let event = self
            .emit_with(&pod.namespace, regarding, extra, kind, reason, message)
            .await;
        let record = self.write_record(pod, record, related.as_ref()).await;
        record.and(event)
    }

    async fn load_state(&self) -> Result<Option<String>, Error> {
        let node = self.get_node().await?;
        let Some(raw) = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NOTICE_ANNOTATION))
        else {
            return Ok(None);
        };
        // The record is the responder's; an annotation that is not even JSON is reported here.
        serde_json::from_str::<serde::de::IgnoredAny>(raw)
            .map(|_| Some(raw.clone()))
            .map_err(|e| Error::StateCorrupt {
                location: format!("node/{} annotation {NOTICE_ANNOTATION}", self.node_name),
                reason: e.to_string(),
            })
    }

    async fn save_state(&self, record: &str) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(node = %self.node_name, record, "dry-run: would persist plan state in the node annotation");
            return Ok(());
        }
        self.annotate_state(json!(record)).await
    }

    async fn clear_state(&self) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(node = %self.node_name, "dry-run: would remove the plan state annotation");
            return Ok(());
        }
        self.annotate_state(Value::Null).await
    }

    async fn protect(&self, protection: &Protection) -> Result<Applied, Error> {
        let effect = protection.effect.as_str();
        let value = protection.taint_value.as_str();
        let result = self
            .modify_node("protect", |node| protect_patch(node, protection))
            .await;
        let rmw = match result {
            Ok(r) => r,
            Err(e) => {
                if !self.dry_run {
                    self.metrics.action("cordon", false);
                }
                self.metrics.error("node", e.metric_label());
                return Err(e);
            }
        };
        let change = rmw.ambiguous.iter().chain(rmw.applied.iter()).fold(
            ProtectChange::default(),
            |acc, c| ProtectChange {
                cordon: acc.cordon || c.cordon,
                taint: acc.taint || c.taint,
            },
        );
        let applied = Applied {
            cordoned: change.cordon,
            taint_effect: change.taint.then_some(protection.effect),
        };
        if !self.dry_run {
            if change.cordon {
                self.metrics.action("cordon", true);
            }
            if change.taint {
                self.metrics.action("taint", true);
            }
        }
        tracing::info!(
            node = %self.node_name,
            taint = %format!("{INTERRUPTION_TAINT}={value}:{effect}"),
            cordoned = applied.cordoned,
            tainted = applied.taint_effect.is_some(),
            dry_run = self.dry_run,
            "node protected (only changes spotguard made are recorded for undo)"
        );
        Ok(applied)
    }

    async fn unprotect(&self, applied: &Applied) -> Result<(), Error> {
        if !applied.cordoned && applied.taint_effect.is_none() {
            return Ok(());
        }
        let result = self
            .modify_node("unprotect", |node| {
                let cordoned = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
                let taints = node_taints(node);
                let uncordon = applied.cordoned && cordoned;
                let effect = applied.taint_effect.map(|e| e.as_str());
                let remaining: Vec<Taint> = taints
                    .iter()
                    .filter(|t| !(t.key == INTERRUPTION_TAINT && Some(t.effect.as_str()) == effect))
                    .cloned()
                    .collect();
                let untaint = remaining.len() != taints.len();
                let mut marks = marks_of(node);
                let before = marks.clone();
                if applied.cordoned {
                    marks.cordoned = false;
                }
                if let Some(e) = applied.taint_effect {
                    marks.taints.retain(|t| *t != e);
                }
                if !uncordon && !untaint && marks == before {
                    return None;
                }
                let mut spec = json!({});
                if uncordon {
                    spec["unschedulable"] = Value::Null;
                }
                if untaint {
                    spec["taints"] = taints_value(&remaining);
                }
                let mut patch = json!({});
                if uncordon || untaint {
                    patch["spec"] = spec;
                }
                if marks != before {
                    patch["metadata"]["annotations"][APPLIED_ANNOTATION] = marks_value(&marks);
                }
                Some((patch, (uncordon, untaint)))
            })
            .await;
        match &result {
            Ok(rmw) => {
                let (uncordon, untaint) = rmw
                    .ambiguous
                    .iter()
                    .chain(rmw.applied.iter())
                    .fold((false, false), |a, c| (a.0 || c.0, a.1 || c.1));
                if !self.dry_run {
                    if uncordon {
                        self.metrics.action("uncordon", true);
                    }
                    if untaint {
                        self.metrics.action("untaint", true);
                    }
                }
                tracing::info!(node = %self.node_name, uncordoned = uncordon, untainted = untaint, dry_run = self.dry_run, "undid spotguard's node changes");
            }
            Err(e) => {
                if !self.dry_run {
                    self.metrics.action("uncordon", false);
                }
                self.metrics.error("node", e.metric_label());
            }
        }
        result.map(|_| ())
    }

    async fn applied_marks(&self) -> Result<AppliedMarks, Error> {
        Ok(marks_of(&self.get_node().await?))
    }

    async fn event(&self, kind: EventType, reason: &str, message: &str) -> Result<(), Error> {
        self.emit_node_event(kind, reason, message).await
    }

    async fn drain(&self, request: &DrainRequest) -> Result<DrainReport, Error> {
        let own = self
            .own_pod
            .as_ref()
            .map(|(ns, name)| (ns.as_str(), name.as_str()));
        drain::drain_node(
            &self.client,
            &self.node_name,
            own,
            self.dry_run,
            &self.metrics,
            request,
            self.pod_watch.get().map(|w| &**w),
        )
        .await
    }

    async fn mark_disruption(&self, disruption: &Disruption) -> Result<Vec<String>, Error> {
        self.mark_disruption_target(disruption).await
    }

    async fn gpu_conditions(&self) -> Result<GpuConditions, Error> {
        self.read_gpu_conditions().await
    }

    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error> {
        self.write_gpu_conditions(desired).await
    }
}

fn node_taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// The node's `spotguard.io/applied` marks; absent or unreadable ones count as none.
fn marks_of(node: &Node) -> AppliedMarks {
    node.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(APPLIED_ANNOTATION))
        .and_then(|raw| serde_json::from_str(raw).ok())
        .unwrap_or_default()
}

/// The annotation value for `marks` (`null` removes it when nothing is left).
fn marks_value(marks: &AppliedMarks) -> Value {
    if marks.is_empty() {
        Value::Null
    } else {
        serde_json::to_string(marks).map_or(Value::Null, Value::String)
    }
}

/// The taints list for a merge patch (null removes the field when empty).
fn taints_value(taints: &[Taint]) -> Value {
    if taints.is_empty() {
        Value::Null
    } else {
        serde_json::to_value(taints).unwrap_or(Value::Null)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_taint_list_removes_the_field() {
        assert_eq!(taints_value(&[]), Value::Null);
        let t = Taint {
            key: "k".into(),
            value: None,
            effect: "NoSchedule".into(),
            time_added: None,
        };
        assert_eq!(
            taints_value(&[t]),
            json!([{ "key": "k", "effect": "NoSchedule" }])
        );
    }
}
