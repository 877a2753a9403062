//! `events.k8s.io/v1` Events on the Node (namespace `default`) or on a Pod, reported by
//! `spotguard.io/agent`; a repeat of the same event within a few minutes bumps its `series`.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::time::Instant;

use super::api::{with_timeout, API_BACKOFF};
use super::{KubeNodeOps, FIELD_MANAGER, REPORTING_CONTROLLER};
use crate::node::PodRef;
use crate::node::{reason, Error, EventType};

/// Namespace of Events about the (cluster-scoped) Node, as the kubelet does.
const NODE_EVENT_NAMESPACE: &str = "default";
/// Identical events within this window are counted in one Event's `series`.
const EVENT_SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
const EVENT_CACHE_MAX: usize = 256;
/// events.k8s.io/v1 limits.
const EVENT_NOTE_MAX_BYTES: usize = 1024;
const EVENT_FIELD_MAX_BYTES: usize = 128;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct EventKey {
    namespace: String,
    regarding: String,
    type_: &'static str,
    reason: String,
    note: String,
    /// The annotations of a record Event: two different records never share one Event.
    annotations: Option<BTreeMap<String, String>>,
}

/// What an Event carries beyond its text: the machine-readable record of a goodput Event
/// (annotations) and the object it is also about (`related`: the pod's controller).
#[derive(Clone, Debug, Default)]
pub(super) struct Extra {
    pub(super) annotations: Option<BTreeMap<String, String>>,
    pub(super) related: Option<ObjectReference>,
}

pub(super) struct SeriesEntry {
    name: String,
    count: i32,
    last: Instant,
}

/// What an Event on `pod` refers to (checkpoint outcomes).
pub(super) fn pod_reference(pod: &PodRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_string()),
        kind: Some("Pod".to_string()),
        name: Some(pod.name.clone()),
        namespace: Some(pod.namespace.clone()),
        uid: (!pod.uid.is_empty()).then(|| pod.uid.clone()),
        ..Default::default()
    }
}

/// What `pod`'s controller ownerReference names (a Job, a ReplicaSet, …), in `pod`'s namespace:
/// a goodput Event's `related`, so that a report can gather a job's Events after its pods are
/// gone.
pub fn controller_reference(pod: &Pod) -> Option<ObjectReference> {
    let owner = pod
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.controller == Some(true) && !r.kind.is_empty() && !r.name.is_empty())?;
    Some(ObjectReference {
        api_version: Some(owner.api_version.clone()),
        kind: Some(owner.kind.clone()),
        name: Some(owner.name.clone()),
        namespace: pod.metadata.namespace.clone(),
        uid: (!owner.uid.is_empty()).then(|| owner.uid.clone()),
        ..Default::default()
    })
}

impl KubeNodeOps {
    /// `pod`'s controller: what the pod watch saw, else (the watch never saw the pod) one
    /// bounded GET of the pod (none when the pod is gone, is another pod of the same name, or
    /// the read fails: the Event goes out without it).
    pub(super) async fn pod_controller(&self, pod: &PodRef) -> Option<ObjectReference> {
        if let Some(known) = self.pod_watch.get().and_then(|w| w.controller(&pod.uid)) {
            return known;
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        match with_timeout(api.get_opt(&pod.name)).await {
            Ok(Some(p)) if pod.uid.is_empty() || p.metadata.uid.as_deref() == Some(&pod.uid) => {
                controller_reference(&p)
            }
            Ok(_) => None,
            Err(e) => {
                tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "reading the pod's controller failed; the Event names none");
                None
            }
        }
    }

    /// Emit an Event on this node.
    pub(super) async fn emit_node_event(
        &self,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let regarding = self.node_reference().await;
        self.emit(NODE_EVENT_NAMESPACE, regarding, kind, reason, message)
            .await
    }

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

    /// Emit an Event in `namespace` about `regarding` (dry-run: logged), counted as `event`.
    pub(super) async fn emit(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        self.emit_with(
            namespace,
            regarding,
            Extra::default(),
            kind,
            reason,
            message,
        )
        .await
    }

    /// [`Self::emit`] with annotations and a `related` object (the goodput Events). A repeat
    /// bumps the series only when the annotations are the same too.
    pub(super) async fn emit_with(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        extra: Extra,
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
            let related = extra.related.as_ref().map(|r| {
                format!(
                    "{}/{}",
                    r.kind.as_deref().unwrap_or(""),
                    r.name.as_deref().unwrap_or("")
                )
            });
            tracing::info!(node = %self.node_name, involved = %target, reason, event_type = type_, related, annotations = ?extra.annotations, "dry-run: would emit event: {note}");
            return Ok(());
        }
        let key = EventKey {
            namespace: namespace.to_string(),
            regarding: target,
            type_,
            reason: reason.to_string(),
            note: note.to_string(),
            annotations: extra.annotations.clone(),
        };
        let result = self
            .emit_inner(namespace, regarding, extra.related, key, reason, note)
            .await;
        self.count("event", &result);
        result
    }

    async fn emit_inner(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        related: Option<ObjectReference>,
        key: EventKey,
        reason: &str,
        note: &str,
    ) -> Result<(), Error> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        let now = Timestamp::now();
        if self.bump_series(&api, &key, now).await {
            return Ok(());
        }
        let mut event = self.new_event(namespace, regarding, key.type_, reason, note, now);
        event.metadata.annotations = key.annotations.clone();
        event.related = related;
        let name = event.metadata.name.clone().unwrap_or_default();
        let mut backoff = API_BACKOFF;
        loop {
            match with_timeout(api.create(&PostParams::default(), &event)).await {
                Ok(_) => break,
                Err(e) if crate::node::kube_retryable(&e) && backoff.failures() < 2 => {
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
        self.remember_series(key, name);
        Ok(())
    }

    /// A repeat of the Event of `key` within [`EVENT_SERIES_WINDOW`]: bump its `series` (true
    /// when that worked; false when there is none to bump or it is gone or refused, so a new
    /// Event is made).
    async fn bump_series(&self, api: &Api<Event>, key: &EventKey, now: Timestamp) -> bool {
        let repeat = self.series.lock().ok().and_then(|mut cache| {
            let entry = cache.get_mut(key)?;
            if entry.last.elapsed() > EVENT_SERIES_WINDOW {
                return None;
            }
            entry.count += 1;
            entry.last = Instant::now();
            Some((entry.name.clone(), entry.count))
        });
        let Some((name, count)) = repeat else {
            return false;
        };
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
            Ok(_) => true,
            Err(e) => {
                // Gone (TTL) or refused: start a new Event.
                tracing::debug!(event = %name, error = %e, "updating event series failed, creating a new event");
                false
            }
        }
    }

    /// A new Event about `regarding`, with a fresh unique name.
    fn new_event(
        &self,
        namespace: &str,
        regarding: ObjectReference,
        type_: &str,
        reason: &str,
        note: &str,
        now: Timestamp,
    ) -> Event {
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
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.to_string()),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            reporting_controller: Some(REPORTING_CONTROLLER.to_string()),
            reporting_instance: Some(instance),
            action: Some(action_for(reason).to_string()),
            reason: Some(truncate(reason, EVENT_FIELD_MAX_BYTES).to_string()),
            note: Some(note.to_string()),
            type_: Some(type_.to_string()),
            regarding: Some(regarding),
            ..Default::default()
        }
    }

    /// Remember the Event `name` just made for `key`, so that a repeat bumps its series (the
    /// cache is bounded: expired entries go first, all of them if that is not enough).
    fn remember_series(&self, key: EventKey, name: String) {
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
    fn the_related_object_is_the_pods_controller() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owner = |kind: &str, name: &str, controller| OwnerReference {
            api_version: "batch/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            controller,
            ..Default::default()
        };
        let mut pod = Pod {
            metadata: ObjectMeta {
                name: Some("p".into()),
                namespace: Some("ml".into()),
                owner_references: Some(vec![
                    owner("Thing", "not-the-controller", None),
                    owner("Job", "train", Some(true)),
                ]),
                ..Default::default()
            },
            ..Default::default()
        };
        let r = controller_reference(&pod).unwrap();
        assert_eq!(
            (
                r.kind.as_deref(),
                r.name.as_deref(),
                r.namespace.as_deref(),
                r.uid.as_deref(),
                r.api_version.as_deref()
            ),
            (
                Some("Job"),
                Some("train"),
                Some("ml"),
                Some("uid-train"),
                Some("batch/v1")
            )
        );
        pod.metadata.owner_references = Some(vec![owner("Job", "x", Some(false))]);
        assert_eq!(controller_reference(&pod), None);
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
}
