//! Test objects: pods (a builder whose pods the kubelet stand-in can really run), PDBs,
//! ReplicaSets to own pods, and Events read back flattened.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, PodSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde_json::Value;

/// A long-running container process that ends on SIGTERM (exit 143).
pub const SLEEPER: [&str; 2] = ["sleep", "infinity"];

/// The terminal phase a pod built with [`TestPod::phase`] ends in, so that
/// [`super::TestCluster::run_pods`] waits for that phase (its container first runs, and a pod
/// meant to be `Failed` must not be taken as ready while it still runs).
pub const ENDS_IN_ANNOTATION: &str = "testkit.spotguard.io/ends-in";

/// Builder for test pods: one container `main` running [`SLEEPER`], bound to `node`, owned by
/// a ReplicaSet (that need not exist), default grace period, restart policy Always.
pub struct TestPod {
    pod: Pod,
}

impl TestPod {
    pub fn new(namespace: &str, name: &str, node: &str) -> TestPod {
        let pod = Pod {
            metadata: ObjectMeta {
                namespace: Some(namespace.to_string()),
                name: Some(name.to_string()),
                owner_references: Some(vec![OwnerReference {
                    api_version: "apps/v1".to_string(),
                    kind: "ReplicaSet".to_string(),
                    name: format!("{name}-rs"),
                    uid: format!("rs-{name}"),
                    controller: Some(true),
                    block_owner_deletion: Some(true),
                }]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.to_string()),
                containers: vec![Container {
                    name: "main".to_string(),
                    image: Some("registry.example/trainer:1".to_string()),
                    command: Some(SLEEPER.iter().map(|s| s.to_string()).collect()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: None,
        };
        TestPod { pod }
    }

    fn spec(&mut self) -> &mut PodSpec {
        self.pod.spec.get_or_insert_with(Default::default)
    }

    fn main(&mut self) -> &mut Container {
        &mut self.spec().containers[0]
    }

    pub fn label(mut self, key: &str, value: &str) -> TestPod {
        self.pod
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(key.to_string(), value.to_string());
        self
    }

    pub fn annotation(mut self, key: &str, value: &str) -> TestPod {
        self.pod
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(key.to_string(), value.to_string());
        self
    }

    pub fn grace_period(mut self, seconds: i64) -> TestPod {
        self.spec().termination_grace_period_seconds = Some(seconds);
        self
    }

    /// The container runs `argv` instead.
    pub fn command(mut self, argv: &[&str]) -> TestPod {
        self.main().command = Some(argv.iter().map(|s| s.to_string()).collect());
        self
    }

    /// `bash -c script`.
    pub fn script(self, script: &str) -> TestPod {
        self.command(&["bash", "-c", script])
    }

    pub fn env(mut self, key: &str, value: &str) -> TestPod {
        self.main().env.get_or_insert_with(Vec::new).push(EnvVar {
            name: key.to_string(),
            value: Some(value.to_string()),
            value_from: None,
        });
        self
    }

    /// On SIGTERM the container takes `delay` to finish (a real graceful shutdown), then exits 0.
    pub fn terminates_after(self, delay: Duration) -> TestPod {
        let script = format!(
            "trap 'sleep {:.3}; exit 0' TERM; while :; do sleep 0.05; done",
            delay.as_secs_f64()
        );
        self.script(&script)
    }

    /// A simulated pod: the kubelet stand-in runs no process for it (it reports it Running and
    /// Ready), and once deleted it stops after `stop` (`None`: at the end of its grace period,
    /// like a process that ignores SIGTERM). Cheap enough for thousands of pods in a bench.
    pub fn simulated(self, stop: Option<Duration>) -> TestPod {
        let value = match stop {
            Some(d) => format!("{:.3}", d.as_secs_f64()),
            None => "grace".to_string(),
        };
        self.annotation(super::kubelet::SIMULATED_ANNOTATION, &value)
    }

    /// A pod that ran to completion: `Succeeded` or `Failed` (restart policy Never; the
    /// container exits 0 or 1 at once; [`super::TestCluster::run_pods`] waits for that phase).
    pub fn phase(mut self, phase: &str) -> TestPod {
        let code = match phase {
            "Succeeded" => 0,
            "Failed" => 1,
            other => {
                panic!("TestPod::phase: only Succeeded / Failed can be made real, not {other}")
            }
        };
        self.spec().restart_policy = Some("Never".into());
        self.main().command = Some(vec!["sh".into(), "-c".into(), format!("exit {code}")]);
        self.annotation(ENDS_IN_ANNOTATION, phase)
    }

    /// A pod that runs until `file` exists on this machine, then completes (exit 0, phase
    /// `Succeeded`; restart policy Never).
    pub fn completes_when_exists(mut self, file: &std::path::Path) -> TestPod {
        self.spec().restart_policy = Some("Never".into());
        self.main().command = Some(vec![
            "sh".into(),
            "-c".into(),
            "while [ ! -e \"$1\" ]; do sleep 0.05; done".into(),
            "sh".into(),
            file.display().to_string(),
        ]);
        self
    }

    /// Controlled by a DaemonSet instead of a ReplicaSet.
    pub fn daemonset(mut self) -> TestPod {
        if let Some(owner) = self
            .pod
            .metadata
            .owner_references
            .as_mut()
            .and_then(|o| o.first_mut())
        {
            owner.kind = "DaemonSet".to_string();
        }
        self
    }

    /// Owned by `owner`.
    pub fn owned_by(mut self, owner: OwnerReference) -> TestPod {
        self.pod.metadata.owner_references = Some(vec![owner]);
        self
    }

    /// Owned by nothing (a controller whose selector matches may adopt it).
    pub fn orphan(mut self) -> TestPod {
        self.pod.metadata.owner_references = None;
        self
    }

    /// The API mirror of a static pod on `node` (uid `node_uid`).
    pub fn mirror(mut self, node: &str, node_uid: &str) -> TestPod {
        self.pod
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                spotguard::node::filter::MIRROR_ANNOTATION.to_string(),
                "hash".to_string(),
            );
        self.pod.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "v1".to_string(),
            kind: "Node".to_string(),
            name: node.to_string(),
            uid: node_uid.to_string(),
            controller: Some(true),
            block_owner_deletion: None,
        }]);
        self
    }

    /// A finalizer nobody removes: the pod's deletion never completes (a stuck pod).
    pub fn stuck(mut self) -> TestPod {
        self.pod
            .metadata
            .finalizers
            .get_or_insert_with(Vec::new)
            .push(STUCK_FINALIZER.to_string());
        self
    }

    pub fn build(self) -> Pod {
        self.pod
    }
}

/// The finalizer of [`TestPod::stuck`].
pub const STUCK_FINALIZER: &str = "testkit.spotguard.io/stuck";

/// Which Events API an event was written through (from its managed fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventApi {
    /// `events.k8s.io/v1`
    EventsV1,
    /// core `v1`
    Core,
}

/// One Event as stored, flattened across both APIs.
#[derive(Clone, Debug)]
pub struct FlatEvent {
    pub api: EventApi,
    pub namespace: String,
    pub name: String,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    /// `note` (events.k8s.io/v1; core `message`).
    pub message: String,
    pub regarding_kind: String,
    pub regarding_name: String,
    pub regarding_namespace: String,
    pub reporting_controller: String,
    /// `series.count` (or the core `count`), 1 for a single occurrence.
    pub count: i64,
    pub raw: Value,
}

/// Components of the control plane (and the kubelet) as they sign their Events.
const CONTROL_PLANE_REPORTERS: [&str; 12] = [
    "kubelet",
    "default-scheduler",
    "node-controller",
    "job-controller",
    "replicaset-controller",
    "daemonset-controller",
    "disruption-controller",
    "taint-eviction-controller",
    "taint-controller",
    "cloud-node-lifecycle-controller",
    "controllermanager",
    "kube-controller-manager",
];

impl FlatEvent {
    /// Reported by Kubernetes' own components (by `reportingController`, or the core
    /// `source.component` of older recorders).
    pub fn from_control_plane(&self) -> bool {
        let source = self.raw["deprecatedSource"]["component"]
            .as_str()
            .unwrap_or_default();
        [self.reporting_controller.as_str(), source]
            .iter()
            .any(|r| CONTROL_PLANE_REPORTERS.contains(r) || r.starts_with("kubernetes.io/"))
    }

    pub fn from_event(e: &Event) -> FlatEvent {
        let raw = serde_json::to_value(e).unwrap_or(Value::Null);
        let api = if e
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .any(|m| m.api_version.as_deref() == Some("events.k8s.io/v1"))
        {
            EventApi::EventsV1
        } else {
            EventApi::Core
        };
        let regarding = e.regarding.clone().unwrap_or_default();
        FlatEvent {
            api,
            namespace: e.metadata.namespace.clone().unwrap_or_default(),
            name: e.metadata.name.clone().unwrap_or_default(),
            type_: e.type_.clone().unwrap_or_default(),
            reason: e.reason.clone().unwrap_or_default(),
            message: e.note.clone().unwrap_or_default(),
            regarding_kind: regarding.kind.unwrap_or_default(),
            regarding_name: regarding.name.unwrap_or_default(),
            regarding_namespace: regarding.namespace.unwrap_or_default(),
            reporting_controller: e.reporting_controller.clone().unwrap_or_default(),
            count: e
                .series
                .as_ref()
                .map(|s| s.count as i64)
                .or(e.deprecated_count.map(|c| c as i64))
                .unwrap_or(1),
            raw,
        }
    }
}

/// The documents of a (multi-document) YAML text, as JSON values (nulls for empty documents).
pub fn yaml_documents(text: &str) -> Result<Vec<Value>, String> {
    serde_saphyr::from_multiple(text).map_err(|e| e.to_string())
}
