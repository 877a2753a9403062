//! Every node-level action spotguard takes goes through the [`NodeOps`] seam: the node's copy of
//! the plan record, taint + cordon, Events, drain, GPU conditions. `HostNodeOps` (bare VM /
//! systemd) keeps no copy and logs the rest; the Kubernetes implementation performs them through
//! the API server. Dry-run is decided inside each implementation.

use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use serde::{Deserialize, Serialize};

pub mod drain;
pub mod filter;
pub mod host;
pub mod kube;

/// Annotation on the Node holding its copy of the plan record (JSON, as the responder wrote it).
pub const NOTICE_ANNOTATION: &str = "spotguard.io/notice";
/// Annotation on the Node recording what spotguard itself applied ([`AppliedMarks`]), written in
/// the same patch as the cordon / taint it describes.
pub const APPLIED_ANNOTATION: &str = "spotguard.io/applied";
/// Taint key applied on interruption / maintenance / rebalance (value = notice kind).
pub const INTERRUPTION_TAINT: &str = "spotguard.io/interruption";
/// Taint key applied while a GPU is unhealthy.
pub const GPU_UNHEALTHY_TAINT: &str = "spotguard.io/gpu-unhealthy";

/// Taint effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::PreferNoSchedule => "PreferNoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// What to put on the node for a notice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Protection {
    /// Taint `spotguard.io/interruption=<value>:<effect>`.
    pub taint_value: String,
    pub effect: TaintEffect,
    /// Also mark the node unschedulable.
    pub cordon: bool,
}

/// What spotguard changed on the node (recorded so that undo is exact).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// spotguard set `spec.unschedulable` (it was schedulable before).
    #[serde(default)]
    pub cordoned: bool,
    /// spotguard added its taint with this effect (absent before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub taint_effect: Option<TaintEffect>,
}

/// What spotguard has applied on the node, kept on the Node itself (annotation
/// `spotguard.io/applied`) and changed in the same patch as the cordon / taint: a crash between
/// that patch and the plan record loses nothing, and undo still touches only spotguard's changes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedMarks {
    #[serde(default)]
    pub cordoned: bool,
    /// Effects of the `spotguard.io/interruption` taints spotguard added.
    #[serde(default)]
    pub taints: Vec<TaintEffect>,
}

impl AppliedMarks {
    pub fn is_empty(&self) -> bool {
        !self.cordoned && self.taints.is_empty()
    }

    /// What these marks say spotguard applied for `protection`.
    pub fn for_protection(&self, protection: &Protection) -> Applied {
        Applied {
            cordoned: protection.cordon && self.cordoned,
            taint_effect: self
                .taints
                .contains(&protection.effect)
                .then_some(protection.effect),
        }
    }
}

/// Event severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    Normal,
    Warning,
}

/// Constant Kubernetes Event reasons.
pub mod reason {
    pub const SPOT_INTERRUPTION: &str = "SpotInterruption";
    pub const REBALANCE: &str = "RebalanceRecommendation";
    pub const MAINTENANCE: &str = "Maintenance";
    pub const NOTICE_CANCELLED: &str = "NoticeCancelled";
    pub const CORDON_FAILED: &str = "CordonFailed";
    pub const DRAIN_STARTED: &str = "DrainStarted";
    pub const DRAIN_COMPLETE: &str = "DrainComplete";
    pub const DRAIN_BLOCKED: &str = "DrainBlocked";
    pub const DRAIN_FAILED: &str = "DrainFailed";
    pub const PREVIOUS_LIFE: &str = "PreviousLifeUndone";
    pub const CHECKPOINT_SIGNALLED: &str = "CheckpointSignalled";
    pub const CHECKPOINT_ACKED: &str = "CheckpointAcked";
    pub const CHECKPOINT_TIMEOUT: &str = "CheckpointTimeout";
    pub const CHECKPOINT_FAILED: &str = "CheckpointFailed";
    pub const CHECKPOINT_NO_HANDLER: &str = "CheckpointNoHandler";
    pub const BAD_ANNOTATION: &str = "BadAnnotation";
    pub const UNCORDONED: &str = "Uncordoned";
    pub const GPU_UNHEALTHY: &str = "GPUUnhealthy";
    pub const GPU_DEGRADED: &str = "GPUDegraded";
    pub const GPU_RECOVERED: &str = "GPURecovered";
    pub const CHECKPOINT_UPLOADED: &str = "CheckpointUploaded";
    pub const CHECKPOINT_UPLOAD_FAILED: &str = "CheckpointUploadFailed";
    pub const CHECKPOINT_UPLOAD_REFUSED: &str = "CheckpointUploadRefused";
}

/// The pod condition type the kubelet's graceful node shutdown, the Eviction API and the taint
/// manager set on a pod about to be taken down; Job `podFailurePolicy`, JobSet `failurePolicy`
/// and Kueue read it.
pub const DISRUPTION_TARGET: &str = "DisruptionTarget";
/// spotguard's reason on `DisruptionTarget`, after Kubernetes' own (`TerminationByKubelet`,
/// `EvictionByEvictionAPI`, `DeletionByTaintManager`, `PreemptionByScheduler`): the pod is
/// terminated because of the cloud's notice. A pod still running at the drain gets the Eviction
/// API's `EvictionByEvictionAPI` in its place (same condition, still True).
pub const DISRUPTION_REASON: &str = "TerminationByCloudNotice";

/// The `DisruptionTarget` condition spotguard sets on the pods a plan will take down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Disruption {
    /// [`DISRUPTION_REASON`].
    pub reason: &'static str,
    /// Names the cloud's notice (kind, id, cloud, deadline).
    pub message: String,
}

/// Parameters of one drain.
#[derive(Clone, Debug)]
pub struct DrainRequest {
    /// Hard deadline: stop and report at this time.
    pub deadline: Timestamp,
    /// Delete pods still blocked by a PDB 5 s before the deadline (`--force-delete-at-deadline`).
    pub force_delete_at_deadline: bool,
    /// Maximum evictions in flight.
    pub concurrency: usize,
    /// Pods evicted only after their hold ends (every other pod is evicted at once).
    pub holds: Vec<Hold>,
}

/// A pod the drain evicts only once `released` turns true or `until` passes: the agent is
/// uploading the checkpoint its trainer staged on the node.
#[derive(Clone, Debug)]
pub struct Hold {
    /// `namespace/name`.
    pub pod: String,
    pub until: Timestamp,
    pub released: tokio::sync::watch::Receiver<bool>,
}

impl Hold {
    /// Wait until the hold ends (released, `until`, or its sender gone).
    pub async fn wait(mut self) {
        let left = crate::duration::until(self.until, Timestamp::now());
        let released = self.released.wait_for(|r| *r);
        let _ = tokio::time::timeout(left, released).await;
    }
}

/// Outcome of a drain.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// `namespace/name` of pods evicted and confirmed gone.
    pub evicted: Vec<String>,
    /// Pods still present at the deadline, with what blocked them (PDB names when known).
    pub blocked: Vec<BlockedPod>,
    /// Pods force-deleted at the deadline.
    pub force_deleted: Vec<String>,
    /// Pods that were skipped (DaemonSet, mirror, finished, spotguard itself), `namespace/name`.
    pub skipped: Vec<String>,
}

impl DrainReport {
    pub fn complete(&self) -> bool {
        self.blocked.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockedPod {
    pub pod: String,
    /// PodDisruptionBudgets that refused the eviction (names), empty when unknown.
    pub pdbs: Vec<String>,
    pub reason: String,
}

/// The GPU health as spotguard wants it shown on the node: conditions `GPUUnhealthy` and
/// `GPUDegraded` (problem polarity: status True = problem present) and, while unhealthy, the taint
/// `spotguard.io/gpu-unhealthy:NoSchedule`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuConditions {
    pub unhealthy: ConditionState,
    pub degraded: ConditionState,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConditionState {
    /// Condition status True (problem present).
    pub active: bool,
    pub reason: String,
    pub message: String,
}

/// The Node condition types the GPU verdict is shown under, as the GPU settings chose them
/// (`crate::gpu` validates them): `unhealthy` and `degraded` have problem polarity (status True =
/// problem present), the optional `ready` Ready polarity (status False while unhealthy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConditionTypes {
    pub unhealthy: String,
    pub degraded: String,
    pub ready: Option<String>,
}

/// Default `GPUUnhealthy` condition type.
pub const DEFAULT_GPU_UNHEALTHY_CONDITION: &str = "GPUUnhealthy";
/// Default `GPUDegraded` condition type.
pub const DEFAULT_GPU_DEGRADED_CONDITION: &str = "GPUDegraded";

impl Default for GpuConditionTypes {
    fn default() -> Self {
        GpuConditionTypes {
            unhealthy: DEFAULT_GPU_UNHEALTHY_CONDITION.into(),
            degraded: DEFAULT_GPU_DEGRADED_CONDITION.into(),
            ready: None,
        }
    }
}

/// The annotation holding a pod Event's machine-readable record
/// ([`NodeOps::pod_record_event`]): the goodput Events' (`crate::goodput::event`).
pub const RECORD_ANNOTATION: &str = "spotguard.io/goodput";

/// The Kubernetes pod a target group belongs to (for Events and logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// The node seam. Every mutation of the node (or its host-mode equivalent) goes through here.
#[async_trait]
pub trait NodeOps: Send + Sync {
    /// The node's copy of the plan record (Kubernetes: the Node annotation `spotguard.io/notice`),
    /// if any: the JSON document the responder saved, as stored (the record is the responder's;
    /// the node only checks that it is JSON). Default: the node keeps no copy (host mode: the
    /// responder's local record under `--state-dir` is the only one).
    async fn load_state(&self) -> Result<Option<String>, Error> {
        Ok(None)
    }
    /// Replace the node's copy of the plan record with `record` (JSON), stored as given
    /// (default: no copy kept).
    async fn save_state(&self, _record: &str) -> Result<(), Error> {
        Ok(())
    }
    /// Remove the node's copy of the plan record (default: no copy kept).
    async fn clear_state(&self) -> Result<(), Error> {
        Ok(())
    }
    /// Taint (and cordon) the node. Returns what was actually changed; something already present
    /// (an operator's cordon) is reported as not applied so that undo leaves it.
    async fn protect(&self, protection: &Protection) -> Result<Applied, Error>;
    /// Whether there is a node to act on (false in host mode: taints, cordons and drains are
    /// only logged, and not counted as done in `spotguard_node_actions_total`).
    fn has_node(&self) -> bool {
        true
    }
    /// Undo exactly what `applied` says spotguard did.
    async fn unprotect(&self, applied: &Applied) -> Result<(), Error>;
    /// What the node itself records that spotguard applied (Kubernetes: the annotation
    /// `spotguard.io/applied`; host mode: nothing).
    async fn applied_marks(&self) -> Result<AppliedMarks, Error> {
        Ok(AppliedMarks::default())
    }
    /// Emit an Event on the node (host mode: a log line).
    async fn event(&self, kind: EventType, reason: &str, message: &str) -> Result<(), Error>;
    /// Emit an Event on a pod (checkpoint signalled / acked / timeout / no handler / bad annotation).
    async fn pod_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error>;
    /// An Event on a pod carrying a machine-readable record: the goodput Events, whose
    /// annotation [`RECORD_ANNOTATION`] holds `record` (compact JSON, the caller's) and whose
    /// `related` names the pod's controller (a Job, …), so that `spotguard goodput` can gather a
    /// job's Events after its pods are gone. Default: a plain [`Self::pod_event`].
    async fn pod_record_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
        record: &str,
    ) -> Result<(), Error> {
        let _ = record;
        self.pod_event(pod, kind, reason, message).await
    }
    /// Evict every evictable pod before the deadline (host mode: nothing to drain).
    async fn drain(&self, request: &DrainRequest) -> Result<DrainReport, Error>;
    /// Set the pod condition `DisruptionTarget` on every pod the drain would evict; returns the
    /// pods marked, `namespace/name` (default: no pods, as in host mode).
    async fn mark_disruption(&self, _disruption: &Disruption) -> Result<Vec<String>, Error> {
        Ok(Vec::new())
    }
    /// The GPU conditions currently on the node (to resume sticky findings after a restart).
    async fn gpu_conditions(&self) -> Result<GpuConditions, Error>;
    /// Make the node show `desired` (no write when nothing changed).
    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error>;
}

#[async_trait]
impl<T: NodeOps + ?Sized> NodeOps for std::sync::Arc<T> {
    fn has_node(&self) -> bool {
        (**self).has_node()
    }
    async fn load_state(&self) -> Result<Option<String>, Error> {
        (**self).load_state().await
    }
    async fn save_state(&self, record: &str) -> Result<(), Error> {
        (**self).save_state(record).await
    }
    async fn clear_state(&self) -> Result<(), Error> {
        (**self).clear_state().await
    }
    async fn protect(&self, protection: &Protection) -> Result<Applied, Error> {
        (**self).protect(protection).await
    }
    async fn unprotect(&self, applied: &Applied) -> Result<(), Error> {
        (**self).unprotect(applied).await
    }
    async fn applied_marks(&self) -> Result<AppliedMarks, Error> {
        (**self).applied_marks().await
    }
    async fn event(&self, kind: EventType, reason: &str, message: &str) -> Result<(), Error> {
        (**self).event(kind, reason, message).await
    }
    async fn pod_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        (**self).pod_event(pod, kind, reason, message).await
    }
    async fn pod_record_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
        record: &str,
    ) -> Result<(), Error> {
        (**self)
            .pod_record_event(pod, kind, reason, message, record)
            .await
    }
    async fn drain(&self, request: &DrainRequest) -> Result<DrainReport, Error> {
        (**self).drain(request).await
    }
    async fn mark_disruption(&self, disruption: &Disruption) -> Result<Vec<String>, Error> {
        (**self).mark_disruption(disruption).await
    }
    async fn gpu_conditions(&self) -> Result<GpuConditions, Error> {
        (**self).gpu_conditions().await
    }
    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error> {
        (**self).set_gpu_conditions(desired).await
    }
}

/// Errors from node operations.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("persisted state {location} is not valid: {reason}")]
    StateCorrupt { location: String, reason: String },
    #[error("getting node {node}: {source}")]
    GetNode {
        node: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("patching node {node} ({what}): {source}")]
    PatchNode {
        node: String,
        what: &'static str,
        #[source]
        source: ::kube::Error,
    },
    #[error("listing pods on node {node}: {source}")]
    ListPods {
        node: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("evicting pod {pod}: {source}")]
    Evict {
        pod: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("setting a condition on pod {pod}: {source}")]
    PatchPod {
        pod: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("deleting pod {pod}: {source}")]
    DeletePod {
        pod: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("creating event {reason}: {source}")]
    Event {
        reason: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("writing goodput record {name}: {source}")]
    Record {
        name: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("reading Job {job} (a goodput record's owner): {source}")]
    GetJob {
        job: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("Job {job} is gone, or is not the Job its pod names")]
    JobGone { job: String },
    #[error("conflicting updates to node {node} did not settle after {attempts} attempts")]
    Conflict { node: String, attempts: u32 },
    #[error("deadline passed while {0}")]
    Deadline(&'static str),
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::StateCorrupt { .. } => false,
            Error::GetNode { source, .. }
            | Error::PatchNode { source, .. }
            | Error::ListPods { source, .. }
            | Error::Evict { source, .. }
            | Error::PatchPod { source, .. }
            | Error::DeletePod { source, .. }
            | Error::Event { source, .. }
            | Error::Record { source, .. }
            | Error::GetJob { source, .. } => kube_retryable(source),
            Error::JobGone { .. } => false,
            Error::Conflict { .. } => true,
            Error::Deadline(_) => false,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::StateCorrupt { .. } => "state_corrupt",
            Error::GetNode { .. } => "get_node",
            Error::PatchNode { .. } => "patch_node",
            Error::ListPods { .. } => "list_pods",
            Error::Evict { .. } => "evict",
            Error::PatchPod { .. } => "patch_pod",
            Error::DeletePod { .. } => "delete_pod",
            Error::Event { .. } => "event",
            Error::Record { .. } => "record",
            Error::GetJob { .. } => "get_job",
            Error::JobGone { .. } => "job_gone",
            Error::Conflict { .. } => "conflict",
            Error::Deadline(_) => "deadline",
        }
    }
}

/// Whether a kube error is worth retrying: transport errors, 409 conflicts, 429 and 5xx.
pub fn kube_retryable(e: &::kube::Error) -> bool {
    match e {
        ::kube::Error::Api(status) => {
            let code = status.code;
            code == 409 || code == 429 || code >= 500
        }
        ::kube::Error::HyperError(_) | ::kube::Error::Service(_) => true,
        _ => false,
    }
}

/// Default bound on evictions in flight.
pub const DEFAULT_DRAIN_CONCURRENCY: usize = 32;
/// Pods still blocked this long before the deadline are force-deleted when enabled.
pub const FORCE_DELETE_LEAD: Duration = Duration::from_secs(5);
