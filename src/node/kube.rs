//! [`NodeOps`] through the Kubernetes API server, for this node only.
//!
//! - The plan state lives in the node annotation `spotguard.io/notice` (JSON [`PlanState`]).
//! - Taint + cordon is one read-modify-write carrying `metadata.resourceVersion`: a 409 re-reads
//!   and retries at once, 429 / 5xx / transport errors retry after a short jittered backoff, and
//!   only what was not already there is reported in [`Applied`] (an operator's cordon stays).
//! - Events are `events.k8s.io/v1` Events on the Node (namespace `default`) or on a Pod, reported
//!   by `spotguard.io/agent`; a repeat of the same event within a few minutes bumps its `series`.
//! - GPU health: conditions `GPUUnhealthy` / `GPUDegraded` through a strategic-merge patch of
//!   `nodes/status` (merge key `type`, so the kubelet's conditions are untouched) and the taint
//!   `spotguard.io/gpu-unhealthy:NoSchedule` while unhealthy.
//! - Dry-run: reads happen, every write is logged instead.
//!
//! Build the client with [`client_from_config`] (or set `default_retry = false`): kube's built-in
//! retry layer would swallow the 429s that tell the drain which PodDisruptionBudget blocks it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeCondition, ObjectReference, Taint};
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::{
    reason, Applied, AppliedMarks, ConditionState, DrainReport, DrainRequest, Error, EventType,
    GpuConditions, NodeOps, PlanState, Protection, APPLIED_ANNOTATION, GPU_UNHEALTHY_TAINT,
    INTERRUPTION_TAINT, NOTICE_ANNOTATION,
};
use crate::backoff::{jittered, Backoff};
use crate::checkpoint::PodRef;
use crate::metrics::Metrics;

/// `reportingController` of spotguard's Events.
pub const REPORTING_CONTROLLER: &str = "spotguard.io/agent";
/// Field manager named on every write.
pub const FIELD_MANAGER: &str = "spotguard";
/// Default node condition types (problem polarity: status True = problem present); the types
/// in use are configurable ([`KubeNodeOps::with_gpu_condition_types`]).
pub const CONDITION_GPU_UNHEALTHY: &str = crate::gpu::DEFAULT_UNHEALTHY_CONDITION;
pub const CONDITION_GPU_DEGRADED: &str = crate::gpu::DEFAULT_DEGRADED_CONDITION;

/// Attempts of one node read-modify-write (conflicts and transient errors together).
const NODE_WRITE_ATTEMPTS: u32 = 8;
/// Retries of API requests after 429 / 5xx / transport errors: 50 ms doubling to 1 s.
pub(crate) const API_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
/// Pause before re-reading the node after a 409 conflict: 10–20 ms, just enough to spread
/// writers that collided.
const CONFLICT_PAUSE: Duration = Duration::from_millis(20);
/// Bound on any single API request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Namespace of Events about the (cluster-scoped) Node, as the kubelet does.
const NODE_EVENT_NAMESPACE: &str = "default";
/// Identical events within this window are counted in one Event's `series`.
const EVENT_SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
const EVENT_CACHE_MAX: usize = 256;
/// events.k8s.io/v1 limits.
const EVENT_NOTE_MAX_BYTES: usize = 1024;
const EVENT_FIELD_MAX_BYTES: usize = 128;

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
    gpu_types: crate::gpu::ConditionTypes,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct EventKey {
    namespace: String,
    regarding: String,
    type_: &'static str,
    reason: String,
    note: String,
}

struct SeriesEntry {
    name: String,
    count: i32,
    last: Instant,
}

/// The change one node patch makes, as told by the planning closure.
struct Rmw<T> {
    /// The change of the patch that succeeded (`None`: nothing needed doing).
    applied: Option<T>,
    /// Changes of attempts whose outcome is unknown (5xx / transport error after sending).
    ambiguous: Vec<T>,
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
            gpu_types: crate::gpu::ConditionTypes::default(),
        }
    }

    /// Show the GPU verdict under these condition types (default `GPUUnhealthy` /
    /// `GPUDegraded`, no Ready-polarity condition).
    pub fn with_gpu_condition_types(mut self, types: crate::gpu::ConditionTypes) -> Self {
        self.gpu_types = types;
        self
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

    /// Emit an Event on a pod (checkpoint outcomes).
    async fn emit_pod_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let regarding = ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Pod".to_string()),
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: (!pod.uid.is_empty()).then(|| pod.uid.clone()),
            ..Default::default()
        };
        self.emit(&pod.namespace, regarding, kind, reason, message)
            .await
    }

    // === node reads and writes ===

    /// GET the node once (and remember its UID for Event references).
    async fn get_node_once(&self) -> Result<Node, ::kube::Error> {
        let node = with_timeout(self.nodes.get(&self.node_name)).await?;
        if let Some(uid) = &node.metadata.uid {
            if let Ok(mut g) = self.node_uid.lock() {
                *g = Some(uid.clone());
            }
        }
        Ok(node)
    }

    /// GET the node, retrying transient errors.
    async fn get_node(&self) -> Result<Node, Error> {
        let mut backoff = API_BACKOFF;
        loop {
            match self.get_node_once().await {
                Ok(node) => return Ok(node),
                Err(e)
                    if super::kube_retryable(&e)
                        && backoff.failures() + 1 < NODE_WRITE_ATTEMPTS =>
                {
                    tracing::debug!(node = %self.node_name, error = %e, "reading node failed, retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    return Err(Error::GetNode {
                        node: self.node_name.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// One resourceVersion-guarded read-modify-write of the node. `plan` returns the merge patch
    /// (without resourceVersion) and a description of the change, or `None` when the node is
    /// already as wanted.
    async fn modify_node<T, F>(&self, what: &'static str, mut plan: F) -> Result<Rmw<T>, Error>
    where
        F: FnMut(&Node) -> Option<(Value, T)>,
    {
        let mut ambiguous = Vec::new();
        let mut last_error: Option<::kube::Error> = None;
        for attempt in 0..NODE_WRITE_ATTEMPTS {
            if attempt > 0 {
                // A conflict re-reads at once (tiny jitter); anything else backs off.
                let conflict = matches!(&last_error, Some(::kube::Error::Api(s)) if s.code == 409);
                let pause = if conflict {
                    jittered(CONFLICT_PAUSE)
                } else {
                    API_BACKOFF.delay(attempt)
                };
                tokio::time::sleep(pause).await;
            }
            let node = match self.get_node_once().await {
                Ok(node) => node,
                Err(e) if super::kube_retryable(&e) => {
                    tracing::debug!(node = %self.node_name, what, attempt, error = %e, "reading node failed, retrying");
                    last_error = Some(e);
                    continue;
                }
                Err(source) => {
                    return Err(Error::GetNode {
                        node: self.node_name.clone(),
                        source,
                    })
                }
            };
            let Some((mut patch, change)) = plan(&node) else {
                return Ok(Rmw {
                    applied: None,
                    ambiguous,
                });
            };
            if self.dry_run {
                tracing::info!(node = %self.node_name, what, patch = %patch, "dry-run: would patch node");
                return Ok(Rmw {
                    applied: Some(change),
                    ambiguous,
                });
            }
            patch["metadata"]["resourceVersion"] = json!(node.metadata.resource_version);
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            let result = with_timeout(self.nodes.patch(
                &self.node_name,
                &params,
                &Patch::Merge(&patch),
            ))
            .await;
            match result {
                Ok(_) => {
                    return Ok(Rmw {
                        applied: Some(change),
                        ambiguous,
                    })
                }
                Err(::kube::Error::Api(s)) if s.code == 409 => {
                    tracing::debug!(node = %self.node_name, what, attempt, "node changed underneath, re-reading");
                    last_error = Some(::kube::Error::Api(s));
                }
                Err(e) if super::kube_retryable(&e) => {
                    tracing::debug!(node = %self.node_name, what, attempt, error = %e, "node patch failed, retrying");
                    // The write may have landed: remember what it would have changed.
                    ambiguous.push(change);
                    last_error = Some(e);
                }
                Err(source) => {
                    return Err(Error::PatchNode {
                        node: self.node_name.clone(),
                        what,
                        source,
                    })
                }
            }
        }
        match last_error {
            Some(::kube::Error::Api(s)) if s.code == 409 => Err(Error::Conflict {
                node: self.node_name.clone(),
                attempts: NODE_WRITE_ATTEMPTS,
            }),
            Some(source) => Err(Error::PatchNode {
                node: self.node_name.clone(),
                what,
                source,
            }),
            None => Err(Error::Conflict {
                node: self.node_name.clone(),
                attempts: NODE_WRITE_ATTEMPTS,
            }),
        }
    }

    /// A patch that needs no precondition (spotguard's own annotation or conditions), retried on
    /// transient errors.
    async fn patch_blind(
        &self,
        what: &'static str,
        status: bool,
        patch: Patch<Value>,
    ) -> Result<(), Error> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let mut backoff = API_BACKOFF;
        loop {
            let result = if status {
                with_timeout(self.nodes.patch_status(&self.node_name, &params, &patch)).await
            } else {
                with_timeout(self.nodes.patch(&self.node_name, &params, &patch)).await
            };
            match result {
                Ok(_) => return Ok(()),
                Err(e)
                    if super::kube_retryable(&e)
                        && backoff.failures() + 1 < NODE_WRITE_ATTEMPTS =>
                {
                    tracing::debug!(node = %self.node_name, what, error = %e, "node patch failed, retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    return Err(Error::PatchNode {
                        node: self.node_name.clone(),
                        what,
                        source,
                    })
                }
            }
        }
    }

    fn count(&self, action: &str, result: &Result<impl Sized, Error>) {
        if !self.dry_run {
            self.metrics.action(action, result.is_ok());
        }
        if let Err(e) = result {
            self.metrics.error("node", e.metric_label());
        }
    }

    /// Add (`present`) or remove a taint `key:effect` through an RV-guarded write.
    async fn set_taint(
        &self,
        key: &str,
        value: Option<&str>,
        effect: &str,
        present: bool,
    ) -> Result<bool, Error> {
        let what = if present { "taint" } else { "untaint" };
        let out = self
            .modify_node(what, |node| {
                let taints = node_taints(node);
                let has = taints.iter().any(|t| t.key == key && t.effect == effect);
                if has == present {
                    return None;
                }
                let new: Vec<Taint> = if present {
                    let mut t = taints.clone();
                    t.push(Taint {
                        key: key.to_string(),
                        value: value.map(str::to_string),
                        effect: effect.to_string(),
                        time_added: None,
                    });
                    t
                } else {
                    taints
                        .iter()
                        .filter(|t| !(t.key == key && t.effect == effect))
                        .cloned()
                        .collect()
                };
                Some((json!({ "spec": { "taints": taints_value(&new) } }), ()))
            })
            .await;
        self.count(what, &out);
        Ok(out?.applied.is_some())
    }

    // === events ===

    async fn node_reference(&self) -> ObjectReference {
        let cached = self.node_uid.lock().ok().and_then(|g| g.clone());
        let uid = match cached {
            Some(uid) => Some(uid),
            None => self.get_node().await.ok().and_then(|n| n.metadata.uid),
        };
        ObjectReference {
            api_version: Some("v1".to_string()),
            kind: Some("Node".to_string()),
            name: Some(self.node_name.clone()),
            uid,
            ..Default::default()
        }
    }

    async fn emit(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let type_ = match kind {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        };
        let note = truncate(message, EVENT_NOTE_MAX_BYTES);
        let target = format!(
            "{}/{}/{}",
            regarding.kind.as_deref().unwrap_or(""),
            regarding.namespace.as_deref().unwrap_or(""),
            regarding.name.as_deref().unwrap_or("")
        );
        if self.dry_run {
            tracing::info!(node = %self.node_name, target = %target, reason, event_type = type_, "dry-run: would emit event: {note}");
            return Ok(());
        }
        let key = EventKey {
            namespace: namespace.to_string(),
            regarding: target,
            type_,
            reason: reason.to_string(),
            note: note.to_string(),
        };
        let result = self
            .emit_inner(namespace, regarding, key, reason, note)
            .await;
        self.count("event", &result);
        result
    }

    async fn emit_inner(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        key: EventKey,
        reason: &str,
        note: &str,
    ) -> Result<(), Error> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let now = Timestamp::now();
        let repeat = self.series.lock().ok().and_then(|mut cache| {
            let entry = cache.get_mut(&key)?;
            if entry.last.elapsed() > EVENT_SERIES_WINDOW {
                return None;
            }
            entry.count += 1;
            entry.last = Instant::now();
            Some((entry.name.clone(), entry.count))
        });
        if let Some((name, count)) = repeat {
            let series = EventSeries {
                count,
                last_observed_time: MicroTime(now),
            };
            let patch = json!({ "series": series });
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..Default::default()
            };
            match with_timeout(api.patch(&name, &params, &Patch::Merge(&patch))).await {
                Ok(_) => return Ok(()),
                Err(e) => {
                    // Gone (TTL) or refused: start a new Event.
                    tracing::debug!(event = %name, error = %e, "updating event series failed, creating a new event");
                }
            }
        }
        let regarding_name = regarding.name.clone().unwrap_or_default();
        let name = format!(
            "{}.{:x}{:04x}",
            regarding_name,
            now.as_nanosecond(),
            fastrand::u16(..)
        );
        let instance = truncate(
            &format!("{REPORTING_CONTROLLER}-{}", self.node_name),
            EVENT_FIELD_MAX_BYTES,
        )
        .to_string();
        let event = Event {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            reporting_controller: Some(REPORTING_CONTROLLER.to_string()),
            reporting_instance: Some(instance),
            action: Some(action_for(reason).to_string()),
            reason: Some(truncate(reason, EVENT_FIELD_MAX_BYTES).to_string()),
            note: Some(note.to_string()),
            type_: Some(key.type_.to_string()),
            regarding: Some(regarding),
            ..Default::default()
        };
        let mut backoff = API_BACKOFF;
        loop {
            match with_timeout(api.create(&PostParams::default(), &event)).await {
                Ok(_) => break,
                Err(e) if super::kube_retryable(&e) && backoff.failures() < 2 => {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    return Err(Error::Event {
                        reason: reason.to_string(),
                        source,
                    })
                }
            }
        }
        if let Ok(mut cache) = self.series.lock() {
            if cache.len() >= EVENT_CACHE_MAX {
                cache.retain(|_, e| e.last.elapsed() <= EVENT_SERIES_WINDOW);
                if cache.len() >= EVENT_CACHE_MAX {
                    cache.clear();
                }
            }
            cache.insert(
                key,
                SeriesEntry {
                    name,
                    count: 1,
                    last: Instant::now(),
                },
            );
        }
        Ok(())
    }
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
        self.emit_pod_event(pod, kind, reason, message).await
    }

    async fn load_state(&self) -> Result<Option<PlanState>, Error> {
        let node = self.get_node().await?;
        let Some(raw) = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NOTICE_ANNOTATION))
        else {
            return Ok(None);
        };
        serde_json::from_str(raw)
            .map(Some)
            .map_err(|e| Error::StateCorrupt {
                location: format!("node/{} annotation {NOTICE_ANNOTATION}", self.node_name),
                reason: e.to_string(),
            })
    }

    async fn save_state(&self, state: &PlanState) -> Result<(), Error> {
        let json = serde_json::to_string(state).map_err(|e| Error::StateCorrupt {
            location: format!("node/{} annotation {NOTICE_ANNOTATION}", self.node_name),
            reason: e.to_string(),
        })?;
        if self.dry_run {
            tracing::info!(node = %self.node_name, notice_id = %state.id, phase = state.phase.as_str(), "dry-run: would persist plan state in the node annotation");
            return Ok(());
        }
        let patch = json!({ "metadata": { "annotations": { NOTICE_ANNOTATION: json } } });
        let result = self
            .patch_blind("annotate", false, Patch::Merge(patch))
            .await;
        self.count("annotate", &result);
        result
    }

    async fn clear_state(&self) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(node = %self.node_name, "dry-run: would remove the plan state annotation");
            return Ok(());
        }
        let patch = json!({ "metadata": { "annotations": { NOTICE_ANNOTATION: null } } });
        let result = self
            .patch_blind("annotate", false, Patch::Merge(patch))
            .await;
        self.count("annotate", &result);
        result
    }

    async fn protect(&self, protection: &Protection) -> Result<Applied, Error> {
        let effect = protection.effect.as_str();
        let value = protection.taint_value.as_str();
        let result = self
            .modify_node("protect", |node| {
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
            })
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
        let regarding = self.node_reference().await;
        self.emit(NODE_EVENT_NAMESPACE, regarding, kind, reason, message)
            .await
    }

    async fn drain(&self, request: &DrainRequest) -> Result<DrainReport, Error> {
        let own = self
            .own_pod
            .as_ref()
            .map(|(ns, name)| (ns.as_str(), name.as_str()));
        super::drain::drain_node(
            &self.client,
            &self.node_name,
            own,
            self.dry_run,
            &self.metrics,
            request,
        )
        .await
    }

    async fn gpu_conditions(&self) -> Result<GpuConditions, Error> {
        let node = self.get_node().await?;
        let get = |t: &str| {
            find_condition(&node, t)
                .map(condition_state)
                .unwrap_or_default()
        };
        Ok(GpuConditions {
            unhealthy: get(&self.gpu_types.unhealthy),
            degraded: get(&self.gpu_types.degraded),
        })
    }

    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error> {
        let node = self.get_node().await?;
        let now = Timestamp::now();
        let mut patches = Vec::new();
        let mut transitions: Vec<(EventType, &str, String)> = Vec::new();
        let mut recovered: Vec<&str> = Vec::new();
        // (type, wanted state, Ready polarity?, Events on change?)
        let mut wanted: Vec<(&str, &ConditionState, bool, bool)> = vec![
            (&self.gpu_types.unhealthy, &desired.unhealthy, false, true),
            (&self.gpu_types.degraded, &desired.degraded, false, true),
        ];
        if let Some(ready) = &self.gpu_types.ready {
            wanted.push((ready, &desired.unhealthy, true, false));
        }
        for (type_, want, ready_polarity, with_events) in wanted {
            let current = find_condition(&node, type_);
            let current_state = current.map(|c| {
                let mut state = condition_state(c);
                if ready_polarity {
                    state.active = c.status == "False";
                }
                state
            });
            let unchanged = match &current_state {
                Some(c) => c == want,
                // Never shown: nothing to say while healthy.
                None => !want.active,
            };
            if unchanged {
                continue;
            }
            let was_active = current_state.as_ref().is_some_and(|c| c.active);
            let transition_time = match current {
                Some(c) if was_active == want.active => {
                    c.last_transition_time.as_ref().map(|t| t.0).unwrap_or(now)
                }
                _ => now,
            };
            let status = if want.active != ready_polarity {
                "True"
            } else {
                "False"
            };
            patches.push(json!({
                "type": type_,
                "status": status,
                "reason": if want.reason.is_empty() { Value::Null } else { json!(want.reason) },
                "message": if want.message.is_empty() { Value::Null } else { json!(want.message) },
                "lastTransitionTime": transition_time.to_string(),
                "lastHeartbeatTime": now.to_string(),
            }));
            if !with_events {
                continue;
            }
            if want.active && !was_active {
                let r = if type_ == self.gpu_types.unhealthy {
                    reason::GPU_UNHEALTHY
                } else {
                    reason::GPU_DEGRADED
                };
                transitions.push((EventType::Warning, r, want.message.clone()));
            } else if !want.active && was_active {
                recovered.push(type_);
            }
        }
        if !recovered.is_empty() {
            transitions.push((
                EventType::Normal,
                reason::GPU_RECOVERED,
                format!("{} cleared", recovered.join(", ")),
            ));
        }
        if !patches.is_empty() {
            if self.dry_run {
                let conditions = Value::Array(patches.clone());
                tracing::info!(node = %self.node_name, conditions = %conditions, "dry-run: would patch node conditions");
            } else {
                let patch = json!({ "status": { "conditions": patches } });
                let result = self
                    .patch_blind("conditions", true, Patch::Strategic(patch))
                    .await;
                self.count("condition", &result);
                result?;
            }
        }
        let has_taint = node_taints(&node)
            .iter()
            .any(|t| t.key == GPU_UNHEALTHY_TAINT && t.effect == "NoSchedule");
        if desired.unhealthy.active != has_taint {
            self.set_taint(
                GPU_UNHEALTHY_TAINT,
                None,
                "NoSchedule",
                desired.unhealthy.active,
            )
            .await?;
        }
        for (kind, r, message) in transitions {
            if let Err(e) = self.event(kind, r, &message).await {
                tracing::warn!(node = %self.node_name, reason = r, error = %e, "could not emit GPU event");
            }
        }
        Ok(())
    }
}

// === helpers ===

/// Run one API call with [`REQUEST_TIMEOUT`]; a timeout becomes a (retryable) service error.
pub(crate) async fn with_timeout<T>(
    fut: impl std::future::Future<Output = Result<T, ::kube::Error>>,
) -> Result<T, ::kube::Error> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(::kube::Error::Service(
            format!("request timed out after {}s", REQUEST_TIMEOUT.as_secs()).into(),
        )),
    }
}

fn node_taints(node: &Node) -> Vec<Taint> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
}

/// The taints list for a merge patch (null removes the field when empty).
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

fn taints_value(taints: &[Taint]) -> Value {
    if taints.is_empty() {
        Value::Null
    } else {
        serde_json::to_value(taints).unwrap_or(Value::Null)
    }
}

fn find_condition<'a>(node: &'a Node, type_: &str) -> Option<&'a NodeCondition> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
}

fn condition_state(c: &NodeCondition) -> ConditionState {
    ConditionState {
        active: c.status == "True",
        reason: c.reason.clone().unwrap_or_default(),
        message: c.message.clone().unwrap_or_default(),
    }
}

/// events.k8s.io/v1 requires an `action`: what spotguard did or is doing.
fn action_for(r: &str) -> &'static str {
    match r {
        reason::SPOT_INTERRUPTION | reason::REBALANCE | reason::MAINTENANCE => "Protect",
        reason::CORDON_FAILED => "Cordon",
        reason::UNCORDONED | reason::NOTICE_CANCELLED | reason::PREVIOUS_LIFE => "Undo",
        reason::DRAIN_STARTED
        | reason::DRAIN_COMPLETE
        | reason::DRAIN_BLOCKED
        | reason::DRAIN_FAILED => "Drain",
        reason::CHECKPOINT_SIGNALLED
        | reason::CHECKPOINT_ACKED
        | reason::CHECKPOINT_TIMEOUT
        | reason::CHECKPOINT_FAILED
        | reason::CHECKPOINT_NO_HANDLER => "Checkpoint",
        reason::GPU_UNHEALTHY | reason::GPU_DEGRADED | reason::GPU_RECOVERED => "GPUHealthCheck",
        _ => "Notify",
    }
}

/// At most `max` bytes, cut on a character boundary.
fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("abcdef", 3), "abc");
        // 'é' is two bytes: cutting inside it backs off.
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(
            truncate(&"x".repeat(2000), EVENT_NOTE_MAX_BYTES).len(),
            1024
        );
    }

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let mut backoff = API_BACKOFF;
        for _ in 0..20 {
            let d = backoff.next_delay();
            assert!(d >= Duration::from_millis(25), "{d:?}");
            assert!(d <= Duration::from_millis(1500), "{d:?}");
        }
    }

    #[test]
    fn every_reason_has_an_action() {
        for r in [
            reason::SPOT_INTERRUPTION,
            reason::DRAIN_BLOCKED,
            reason::CHECKPOINT_ACKED,
            reason::GPU_RECOVERED,
            reason::UNCORDONED,
        ] {
            assert_ne!(action_for(r), "Notify", "{r}");
        }
        assert_eq!(action_for(reason::BAD_ANNOTATION), "Notify");
    }

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
