//! The goodput ledger's writer: each goodput record also goes to an `Interruption` object
//! (`spotguard.io/v1alpha1`, `daemonset/crds/`) in the pod's namespace, which outlives the
//! Events (`--event-ttl`) and which only the agents can write.
//!
//! * One object per record: `spec.type` `badput` (an interruption, one target) or `recovery`,
//!   its name a hash of the type, notice id, target and node, so a record written twice (a retry,
//!   a restarted agent) is one object (`AlreadyExists` is success).
//! * Retention follows the job: the object is owned (an ownerReference, not a controller one) by
//!   the pod's controller, as the pod watch knows it, or by the JobSet of a JobSet's Job (`owner`:
//!   a JobSet that restarts recreates its Jobs, and a Job's records would go with it), so the
//!   garbage collector deletes it with the job. A bare pod's record carries `spec.expiresAt` (now + the record TTL) and the label
//!   [`EXPIRES_LABEL`]; this agent deletes its own node's expired records every [`SWEEP_EVERY`]
//!   (its task, [`KubeNodeOps::expire_records`]) and when it writes one (at most once per
//!   [`SWEEP_EVERY`] in all).
//! * Off the signal path: written by the outcome follower and the recovery task after the Event,
//!   with the API backoff; a failure is logged and counted (`spotguard_node_actions_total{action="record"}`).

use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, ObjectMeta,
    PostParams,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::api::{with_timeout, API_BACKOFF};
pub use super::owner::RecordOwner;
use super::{owner, KubeNodeOps, FIELD_MANAGER};
use crate::node::{Error, PodRef};

/// The ledger's API group, version, kind and resource.
pub const GROUP: &str = "spotguard.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "Interruption";
pub const PLURAL: &str = "interruptions";
/// On a bare pod's record (no controller to follow): its agent deletes it after `spec.expiresAt`.
pub const EXPIRES_LABEL: &str = "spotguard.io/expires";
/// The uid of the record's owner (the pod's controller, or its Job's JobSet): the report selects
/// an owner's records by it.
pub const OWNER_UID_LABEL: &str = "spotguard.io/owner-uid";
/// On a record owned by a JobSet: the uid of the pod's Job (the report's `--job` and recovery
/// validation select a Job's records by it).
pub const JOB_UID_LABEL: &str = "spotguard.io/job-uid";
/// How long a bare pod's record is kept (`--goodput-record-ttl`).
pub const DEFAULT_RECORD_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
/// Expired records are looked for at most this often.
pub const SWEEP_EVERY: Duration = Duration::from_secs(3600);

/// The bounds of the CRD's schema (`daemonset/crds/interruptions.spotguard.io.yaml`).
pub mod bounds {
    pub const NODE: usize = 253;
    pub const TARGET: usize = 320;
    pub const POD: usize = 253;
    pub const NOTICE_ID: usize = 256;
    pub const OUTCOME: usize = 32;
    pub const RECORD: usize = 16384;
    /// Seconds: a year.
    pub const SECONDS: f64 = 31_536_000.0;
    pub const STEPS: u64 = 1_000_000_000_000;
}

/// Attempts of one record's create (transient errors).
const ATTEMPTS: u32 = 4;

/// The `spec` of an `Interruption` object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InterruptionSpec {
    /// `badput` or `recovery`.
    #[serde(rename = "type")]
    pub type_: String,
    /// The node whose agent wrote it.
    pub node: String,
    /// `namespace/pod`.
    pub target: String,
    pub pod: String,
    pub notice_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_lost: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<Timestamp>,
    /// The goodput record as compact JSON (the Event annotation's text).
    pub record: String,
}

/// The API resource of the ledger's kind.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

fn seconds(v: &serde_json::Value) -> Option<f64> {
    v.as_f64()
        .filter(|s| s.is_finite())
        .map(|s| s.clamp(0.0, bounds::SECONDS))
}

/// The spec for the goodput record `record` (the Event annotation's JSON) about `pod`, written by
/// `node`; `None` when it is not a goodput record or does not fit the schema's bounds. The
/// table's columns (outcome, save seconds, steps lost, recovery seconds) come from the record;
/// the report reads the record itself.
pub fn spec_for(record: &str, node: &str, pod: &PodRef) -> Option<InterruptionSpec> {
    if record.len() > bounds::RECORD || node.is_empty() || node.len() > bounds::NODE {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(record).ok()?;
    let notice_id = v["notice_id"].as_str()?;
    if notice_id.is_empty() || notice_id.len() > bounds::NOTICE_ID || pod.name.is_empty() {
        return None;
    }
    let mut spec = InterruptionSpec {
        node: node.to_string(),
        target: format!("{}/{}", pod.namespace, pod.name),
        pod: pod.name.clone(),
        notice_id: notice_id.to_string(),
        record: record.to_string(),
        ..InterruptionSpec::default()
    };
    match v["type"].as_str()? {
        "badput" => {
            let t = &v["targets"][0];
            spec.type_ = "badput".into();
            spec.outcome = t["outcome"]
                .as_str()
                .filter(|o| o.len() <= bounds::OUTCOME)
                .map(str::to_string);
            spec.save_seconds = seconds(&t["save_seconds"]);
            spec.steps_lost = t["wasted_steps"].as_u64().map(|s| s.min(bounds::STEPS));
        }
        "recovery" => {
            spec.type_ = "recovery".into();
            spec.outcome = Some("recovered".into());
            spec.recovery_seconds = seconds(&v["recovery_seconds"]);
        }
        _ => return None,
    }
    (spec.target.len() <= bounds::TARGET && spec.pod.len() <= bounds::POD).then_some(spec)
}

/// The object's name: one per type, notice, target and node (a record written again is the same
/// object).
pub fn object_name(spec: &InterruptionSpec) -> String {
    let mut h = Sha256::new();
    for part in [&spec.type_, &spec.notice_id, &spec.target, &spec.node] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    let digest = h.finalize();
    let hex: String = digest[..10].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{hex}", spec.type_)
}

/// The ownerReference naming `controller` (not as controller: the job's own controller stays the
/// only one); `None` without a uid.
pub fn owner_reference(controller: &ObjectReference) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: controller.api_version.clone().filter(|v| !v.is_empty())?,
        kind: controller.kind.clone().filter(|k| !k.is_empty())?,
        name: controller.name.clone().filter(|n| !n.is_empty())?,
        uid: controller.uid.clone().filter(|u| !u.is_empty())?,
        controller: None,
        block_owner_deletion: None,
    })
}

/// The object for `spec` in `namespace`: owned by `owner`, else expiring at `now + ttl`.
pub fn object(
    spec: InterruptionSpec,
    namespace: &str,
    owner: Option<&RecordOwner>,
    now: Timestamp,
    ttl: Duration,
) -> DynamicObject {
    let mut spec = spec;
    let job_uid = owner.and_then(|o| o.job_uid.clone());
    let owner = owner.and_then(|o| owner_reference(&o.owner));
    let mut labels = std::collections::BTreeMap::from([(
        "app.kubernetes.io/managed-by".to_string(),
        "spotguard".to_string(),
    )]);
    match &owner {
        Some(o) => {
            labels.insert(OWNER_UID_LABEL.to_string(), o.uid.clone());
            if let Some(job) = job_uid {
                labels.insert(JOB_UID_LABEL.to_string(), job);
            }
        }
        None => {
            spec.expires_at = Some(crate::duration::add(now, ttl));
            labels.insert(EXPIRES_LABEL.to_string(), "true".to_string());
        }
    }
    let mut obj = DynamicObject::new(&object_name(&spec), &api_resource()).within(namespace);
    obj.metadata = ObjectMeta {
        name: Some(object_name(&spec)),
        namespace: Some(namespace.to_string()),
        labels: Some(labels),
        owner_references: owner.map(|o| vec![o]),
        ..Default::default()
    };
    obj.data = serde_json::json!({ "spec": spec });
    obj
}

fn already_exists(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists")
}

impl KubeNodeOps {
    /// Write the goodput record `record` about `pod` (owned by `controller`) to the ledger;
    /// a record that is not a goodput record or that does not fit is refused (logged, counted).
    pub(super) async fn write_record(
        &self,
        pod: &PodRef,
        record: &str,
        controller: Option<&ObjectReference>,
    ) -> Result<(), Error> {
        let Some(spec) = spec_for(record, &self.node_name, pod) else {
            tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), "a goodput record that does not fit the ledger's schema was not written");
            if !self.dry_run {
                self.metrics.action("record", false);
            }
            return Ok(());
        };
        if self.dry_run {
            tracing::info!(node = %self.node_name, pod = %spec.target, notice_id = %spec.notice_id, record_type = %spec.type_, "dry-run: would write the goodput record");
            return Ok(());
        }
        let owner = match controller {
            Some(c) => Some(self.record_owner(&pod.namespace, c).await),
            None => None,
        };
        let now = Timestamp::now();
        let obj = object(spec, &pod.namespace, owner.as_ref(), now, self.record_ttl);
        let name = obj.metadata.name.clone().unwrap_or_default();
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &pod.namespace, &api_resource());
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let mut backoff = API_BACKOFF;
        let result = loop {
            match with_timeout(api.create(&params, &obj)).await {
                Ok(_) => break Ok(()),
                Err(e) if already_exists(&e) => break Ok(()),
                Err(e) if crate::node::kube_retryable(&e) && backoff.failures() + 1 < ATTEMPTS => {
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    break Err(Error::Record {
                        name: format!("{}/{name}", pod.namespace),
                        source,
                    })
                }
            }
        };
        self.count("record", &result);
        if result.is_ok() {
            self.sweep_expired_records(now).await;
        }
        result
    }

    /// The owner of a record about a pod of `namespace` controlled by `controller`: the JobSet of
    /// its Job (`owner`), else `controller` itself, also when the Job cannot be read (logged and
    /// counted; the record is still written).
    async fn record_owner(&self, namespace: &str, controller: &ObjectReference) -> RecordOwner {
        match self
            .job_owners
            .jobset(&self.client, namespace, controller)
            .await
        {
            Ok(jobset) => owner::record_owner(controller, jobset),
            Err(e) => {
                tracing::warn!(error = %e, "the goodput record is owned by the pod's Job: its JobSet, if any, is unknown");
                self.metrics.error("node", e.metric_label());
                RecordOwner::controller(controller)
            }
        }
    }

    /// Every [`SWEEP_EVERY`] from the start until `cancel`: [`Self::sweep_expired_records`] (the
    /// agent's task, so that expired records go even when the node writes no new one).
    pub async fn expire_records(self: std::sync::Arc<Self>, cancel: CancellationToken) {
        loop {
            self.sweep_expired_records(Timestamp::now()).await;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(SWEEP_EVERY) => {}
            }
        }
    }

    /// Delete this node's bare-pod records past their `expiresAt`, at most once per
    /// [`SWEEP_EVERY`] (the first call sweeps; in dry-run, never). Failures are logged; the next
    /// sweep retries.
    pub async fn sweep_expired_records(&self, now: Timestamp) {
        if self.dry_run {
            return;
        }
        {
            let Ok(mut last) = self.last_sweep.lock() else {
                return;
            };
            if last.is_some_and(|t: Instant| t.elapsed() < SWEEP_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &api_resource());
        let mut params = ListParams::default()
            .labels(&format!("{EXPIRES_LABEL}=true"))
            .limit(500);
        let mut deleted = 0usize;
        loop {
            let page = match with_timeout(api.list(&params)).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(node = %self.node_name, error = %e, "listing expired goodput records failed; the next sweep retries");
                    return;
                }
            };
            for o in &page.items {
                let spec = &o.data["spec"];
                let expired = spec["expiresAt"]
                    .as_str()
                    .and_then(|t| t.parse::<Timestamp>().ok())
                    .is_some_and(|t| t <= now);
                if !expired || spec["node"].as_str() != Some(self.node_name.as_str()) {
                    continue;
                }
                let (Some(ns), Some(name)) = (&o.metadata.namespace, &o.metadata.name) else {
                    continue;
                };
                let api: Api<DynamicObject> =
                    Api::namespaced_with(self.client.clone(), ns, &api_resource());
                match with_timeout(api.delete(name, &DeleteParams::default())).await {
                    Ok(_) => deleted += 1,
                    Err(e) => {
                        tracing::warn!(record = %format!("{ns}/{name}"), error = %e, "deleting an expired goodput record failed")
                    }
                }
            }
            match page.metadata.continue_ {
                Some(c) if !c.is_empty() => params = params.continue_token(&c),
                _ => break,
            }
        }
        if deleted > 0 {
            tracing::info!(node = %self.node_name, deleted, "expired goodput records of bare pods deleted");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: "train-0".into(),
            uid: "u".into(),
        }
    }

    #[test]
    fn a_badput_record_fills_the_tables_columns_and_a_recovery_its_own() {
        let b = r#"{"type":"badput","notice_id":"aws-1","node":"n","done_at":"2026-01-01T00:00:00Z","targets":[{"target":"ml/train-0","outcome":"acked","save_seconds":1e99,"wasted_steps":40}]}"#;
        let s = spec_for(b, "spot-a", &pod()).unwrap();
        assert_eq!(
            (
                s.type_.as_str(),
                s.outcome.as_deref(),
                s.save_seconds,
                s.steps_lost
            ),
            ("badput", Some("acked"), Some(bounds::SECONDS), Some(40))
        );
        assert_eq!(s.target, "ml/train-0");
        let r = r#"{"type":"recovery","notice_id":"aws-1","node":"m","target":"ml/train-1","step":1,"saved_at":"2026-01-01T00:00:00Z","first_step_at":"2026-01-01T00:01:00Z","recovery_seconds":-5}"#;
        let s2 = spec_for(r, "spot-b", &pod()).unwrap();
        assert_eq!(
            (s2.type_.as_str(), s2.recovery_seconds),
            ("recovery", Some(0.0))
        );
        assert_ne!(object_name(&s), object_name(&s2));
        assert!(object_name(&s).len() <= 63, "{}", object_name(&s));
        // Not a goodput record, or too big for the schema.
        assert!(spec_for("{}", "spot-a", &pod()).is_none());
        let long = format!(r#"{{"type":"badput","notice_id":"{}"}}"#, "x".repeat(300));
        assert!(spec_for(&long, "spot-a", &pod()).is_none());
    }

    #[test]
    fn a_record_is_owned_by_the_pods_controller_or_expires() {
        let s = spec_for(
            r#"{"type":"badput","notice_id":"n1","targets":[]}"#,
            "a",
            &pod(),
        )
        .unwrap();
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let job = ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some("train".into()),
            uid: Some("job-uid".into()),
            ..Default::default()
        };
        let o = object(
            s.clone(),
            "ml",
            Some(&RecordOwner::controller(&job)),
            now,
            DEFAULT_RECORD_TTL,
        );
        let owners = o.metadata.owner_references.clone().unwrap();
        assert_eq!(owners[0].uid, "job-uid");
        assert_eq!(owners[0].controller, None);
        assert!(o.data["spec"]["expiresAt"].is_null());
        assert_eq!(
            o.metadata.labels.as_ref().unwrap().get(OWNER_UID_LABEL),
            Some(&"job-uid".to_string())
        );
        assert!(!o
            .metadata
            .labels
            .as_ref()
            .unwrap()
            .contains_key(JOB_UID_LABEL));
        // A JobSet's Job: owned by the JobSet, the Job's uid in a label of its own.
        let jobset = ObjectReference {
            api_version: Some("jobset.x-k8s.io/v1alpha2".into()),
            kind: Some("JobSet".into()),
            name: Some("pretrain".into()),
            uid: Some("js-uid".into()),
            ..Default::default()
        };
        let via = RecordOwner {
            owner: jobset,
            job_uid: Some("job-uid".into()),
        };
        let o = object(s.clone(), "ml", Some(&via), now, DEFAULT_RECORD_TTL);
        let owners = o.metadata.owner_references.clone().unwrap();
        assert_eq!(
            (
                owners.len(),
                owners[0].kind.as_str(),
                owners[0].uid.as_str()
            ),
            (1, "JobSet", "js-uid")
        );
        assert_eq!(owners[0].controller, None);
        let labels = o.metadata.labels.clone().unwrap();
        assert_eq!(
            (
                labels.get(OWNER_UID_LABEL).map(String::as_str),
                labels.get(JOB_UID_LABEL).map(String::as_str)
            ),
            (Some("js-uid"), Some("job-uid"))
        );
        let bare = object(s, "ml", None, now, Duration::from_secs(60));
        assert!(bare.metadata.owner_references.is_none());
        assert_eq!(
            bare.data["spec"]["expiresAt"],
            serde_json::json!((now + Duration::from_secs(60)).to_string())
        );
        assert_eq!(
            bare.metadata
                .labels
                .unwrap()
                .get(EXPIRES_LABEL)
                .map(String::as_str),
            Some("true")
        );
    }
}
