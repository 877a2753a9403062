//! A real Kubernetes control plane for tests, and what a test needs around it.
//!
//! - [`assets`]: where kube-apiserver, kube-controller-manager, kube-scheduler and etcd come
//!   from (`KUBEBUILDER_ASSETS`, `../shared/k8s`, a download, or an error saying how).
//! - [`controlplane`]: one control plane per test binary ([`ControlPlane::shared`]), with the
//!   shipped RBAC applied and ServiceAccount tokens for the agent.
//! - [`kubelet`]: a kubelet stand-in per test node that runs pods as real processes (or
//!   simulates them), and [`Fleet`]: many such nodes served by one set of tasks.
//! - [`proxy`]: a fault proxy between the agent and the API server (latency, blackholes,
//!   error codes per request kind, a request log).
//! - [`fixtures`]: test pods, PDB helpers, Events read back.
//! - [`tools`]: kubectl and helm run as an operator would, from a home of their own.
//! - [`daemonset`]: the shipped DaemonSet's pod on a kubelet stand-in node, Ready with the
//!   privileges it ships, and a notice it handles for an opted-in trainer.
//! - [`agents`]: spotguard on a node as the DaemonSet runs it (agent + prefetcher processes,
//!   the node's own metadata emulator), for fleet tests; [`apimetrics`]: the API server's own
//!   request counts, watches and latency histogram.
//! - [`TestCluster`]: one test's view: its own namespaces and node names (suffixed with a
//!   per-test id), its own proxy, clients as admin or as the agent.

pub mod agents;
pub mod apimetrics;
pub mod apiserver;
pub mod assets;
pub mod child;
pub mod controllers;
pub mod controlplane;
pub mod daemonset;
pub mod etcd;
pub mod fixtures;
pub mod kubelet;
pub mod pki;
pub mod proxy;
pub mod tools;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{ReplicaSet, ReplicaSetSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, PodSpec, PodTemplateSpec, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use crate::wait::{until, until_described};

pub use controlplane::{ControlPlane, Identity};
pub use fixtures::{EventApi, FlatEvent, TestPod};
pub use kubelet::{Fleet, Image, Kubelet, NodeConfig};
pub use proxy::{Fault, FaultProxy, RecordedRequest, RequestKind};

/// The label every node of a [`TestCluster`] carries (value: the test's id).
pub const TEST_LABEL: &str = "testkit.spotguard.io/test";

/// How a PodDisruptionBudget limits disruptions.
#[derive(Clone, Debug)]
pub enum PdbLimit {
    MinAvailable(IntOrString),
    MaxUnavailable(IntOrString),
}

/// One test's slice of the shared control plane.
pub struct TestCluster {
    pub cp: &'static ControlPlane,
    id: String,
    admin: kube::Client,
    proxy: FaultProxy,
    namespaces: Mutex<Vec<String>>,
}

static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// How a pod looks, for a test's failure message: its phase, conditions and containers' states
/// (`absent` when there is none).
fn describe_pod(pod: Option<&Pod>) -> String {
    let Some(pod) = pod else {
        return "absent".to_string();
    };
    let Some(status) = pod.status.as_ref() else {
        return "no status yet".to_string();
    };
    let conditions: Vec<String> = status
        .conditions
        .iter()
        .flatten()
        .map(|c| format!("{}={}", c.type_, c.status))
        .collect();
    let containers: Vec<String> = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten())
        .map(|c| {
            let state = serde_json::to_string(&c.state).unwrap_or_default();
            format!("{} {state}", c.name)
        })
        .collect();
    format!(
        "phase {}, conditions [{}], containers [{}]{}",
        status.phase.as_deref().unwrap_or("-"),
        conditions.join(" "),
        containers.join("; "),
        if pod.metadata.deletion_timestamp.is_some() {
            ", being deleted"
        } else {
            ""
        }
    )
}

impl TestCluster {
    /// A fresh slice (starting the shared control plane on first use) with its own proxy.
    pub async fn new() -> TestCluster {
        let cp = ControlPlane::shared();
        let id = format!("t{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
        let proxy = match FaultProxy::start(cp).await {
            Ok(p) => p,
            Err(e) => panic!("fault proxy: {e}"),
        };
        TestCluster {
            cp,
            admin: cp.admin(),
            id,
            proxy,
            namespaces: Mutex::new(Vec::new()),
        }
    }

    /// [`TestCluster::new`] on a control plane whose API server keeps Events only `ttl`
    /// (`--event-ttl`). Every test of the binary must start this way (one control plane per
    /// binary): panics when the control plane already runs without that TTL.
    pub async fn with_event_ttl(ttl: std::time::Duration) -> TestCluster {
        controlplane::set_event_ttl(ttl);
        let k = TestCluster::new().await;
        assert_eq!(
            k.cp.event_ttl,
            Some(ttl),
            "the control plane of this test binary started without --event-ttl={ttl:?}: every test \
             of the binary must use TestCluster::with_event_ttl"
        );
        k
    }

    /// This test's id (`t7`), the suffix of its names.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `base` made unique to this test: `base-t7`.
    pub fn name(&self, base: &str) -> String {
        format!("{base}-{}", self.id)
    }

    /// An admin client straight to the API server.
    pub fn admin(&self) -> kube::Client {
        self.admin.clone()
    }

    pub fn proxy(&self) -> &FaultProxy {
        &self.proxy
    }

    /// What the agent uses: the shipped ServiceAccount's token, through the fault proxy.
    pub fn agent_client(&self) -> kube::Client {
        self.proxy.client(self.cp, Identity::Agent)
    }

    /// The agent as the DaemonSet runs it on `node`: a pod of the shipped ServiceAccount in the
    /// agent's namespace, bound to `node` (a kubelet stand-in serving `node` runs it as a
    /// sleeper), and a client through the proxy with a token bound to that pod, which carries the
    /// node's name: the shipped ValidatingAdmissionPolicy holds its writes to `node`. Returns
    /// the pod (`namespace`, `name`) and the client.
    pub async fn agent_on(&self, node: &str) -> ((String, String), kube::Client) {
        let name = self.name(&format!("spotguard-{node}"));
        let client = self
            .pod_bound_client(
                node,
                controlplane::AGENT_NAMESPACE,
                &name,
                controlplane::AGENT_SERVICE_ACCOUNT,
            )
            .await;
        ((controlplane::AGENT_NAMESPACE.to_string(), name), client)
    }

    /// A DaemonSet-like pod `namespace/name` of `service_account` bound to `node`, and a client
    /// through the proxy with a token bound to it (its user info names the node), as
    /// [`Self::agent_on`] makes for the shipped ServiceAccount.
    pub async fn pod_bound_client(
        &self,
        node: &str,
        namespace: &str,
        name: &str,
        service_account: &str,
    ) -> kube::Client {
        let mut pod = TestPod::new(namespace, name, node).daemonset().build();
        if let Some(spec) = pod.spec.as_mut() {
            spec.service_account_name = Some(service_account.into());
        }
        let pod = self.create_pod(&pod).await;
        let token = match controlplane::mint_pod_token(&self.admin(), &pod).await {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        };
        self.proxy.client_with_token(self.cp, &token)
    }

    /// A client through the proxy as `identity`.
    pub fn client_as(&self, identity: Identity) -> kube::Client {
        self.proxy.client(self.cp, identity)
    }

    /// A kubeconfig for an agent process: through the proxy, as the shipped ServiceAccount.
    pub fn agent_kubeconfig(&self) -> String {
        self.cp.kubeconfig(&self.proxy.url(), Identity::Agent)
    }

    /// Create namespace `base-<id>` (and its `default` ServiceAccount, which the ServiceAccount
    /// controller would add); its name.
    pub async fn namespace(&self, base: &str) -> String {
        let name = self.name(base);
        let nss: Api<Namespace> = Api::all(self.admin());
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        match nss.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("creating namespace {name}: {e}"),
        }
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin(), &name);
        let sa = ServiceAccount {
            metadata: ObjectMeta {
                name: Some("default".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        match sas.create(&PostParams::default(), &sa).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => panic!("creating {name}/default ServiceAccount: {e}"),
        }
        self.namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.clone());
        name
    }

    /// A node config named `base-<id>`, labelled as this test's ([`TestCluster::node_selector`]).
    pub fn node_config(&self, base: &str) -> NodeConfig {
        NodeConfig::new(&self.name(base)).label(TEST_LABEL, &self.id)
    }

    /// A nodeSelector for pods the scheduler places: this test's nodes only (tests share the
    /// control plane, and other tests' nodes are schedulable too).
    pub fn node_selector(&self) -> BTreeMap<String, String> {
        BTreeMap::from([(TEST_LABEL.to_string(), self.id.clone())])
    }

    /// Start a kubelet stand-in for `config`.
    pub async fn node(&self, config: NodeConfig) -> Kubelet {
        match Kubelet::start(self.cp, config).await {
            Ok(k) => k,
            Err(e) => panic!("{e}"),
        }
    }

    pub async fn create_pod(&self, pod: &Pod) -> Pod {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.admin(), &ns);
        match pods.create(&PostParams::default(), pod).await {
            Ok(p) => p,
            Err(e) => panic!(
                "creating pod {ns}/{}: {e}",
                pod.metadata.name.clone().unwrap_or_default()
            ),
        }
    }

    pub async fn pod(&self, namespace: &str, name: &str) -> Option<Pod> {
        let pods: Api<Pod> = Api::namespaced(self.admin(), namespace);
        match pods.get_opt(name).await {
            Ok(p) => p,
            Err(e) => panic!("getting pod {namespace}/{name}: {e}"),
        }
    }

    /// Wait up to `limit` until `pred` holds for pod `namespace/name` (`None`: absent); on
    /// timeout the panic says how the pod looked last (its phase, conditions and containers).
    pub async fn wait_pod(
        &self,
        namespace: &str,
        name: &str,
        what: &str,
        limit: Duration,
        pred: impl Fn(Option<&Pod>) -> bool,
    ) -> Option<Pod> {
        until_described(
            &format!("pod {namespace}/{name}: {what}"),
            limit,
            |last: &Option<Pod>| Some(describe_pod(last.as_ref())),
            || async {
                let p = self.pod(namespace, name).await;
                if pred(p.as_ref()) {
                    Ok(p)
                } else {
                    Err(p)
                }
            },
        )
        .await
    }

    /// Create `pods` and wait until the kubelet reports each Running and Ready (or, for a pod
    /// that runs to completion, its terminal phase; for a pod built with [`TestPod::phase`],
    /// that phase).
    pub async fn run_pods(&self, pods: &[Pod]) {
        for p in pods {
            self.create_pod(p).await;
        }
        for p in pods {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let name = p.metadata.name.clone().unwrap_or_default();
            let finishes =
                p.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) == Some("Never");
            let ends_in = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(fixtures::ENDS_IN_ANNOTATION))
                .cloned();
            let what = match &ends_in {
                Some(phase) => format!("in phase {phase}"),
                None => "running (or finished)".to_string(),
            };
            self.wait_pod(&ns, &name, &what, Duration::from_secs(60), |p| {
                let status = p.and_then(|p| p.status.as_ref());
                let phase = status.and_then(|s| s.phase.as_deref());
                if let Some(want) = &ends_in {
                    return phase == Some(want.as_str());
                }
                if finishes && matches!(phase, Some("Succeeded" | "Failed")) {
                    return true;
                }
                phase == Some("Running")
                    && status
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|cs| {
                            cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        })
            })
            .await;
        }
    }

    /// Start a [`Fleet`] of stand-in nodes for `configs`.
    pub async fn fleet(&self, configs: Vec<NodeConfig>) -> Fleet {
        match Fleet::start(self.cp, configs).await {
            Ok(f) => f,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`TestCluster::run_pods`] for many pods: created `concurrency` at a time, then one list
    /// per namespace every 250 ms (not a GET per pod) until each is Running and Ready.
    pub async fn run_many_pods(&self, pods: &[Pod], concurrency: usize) {
        use futures::StreamExt;
        futures::stream::iter(pods)
            .for_each_concurrent(concurrency.max(1), |p| async move {
                self.create_pod(p).await;
            })
            .await;
        let mut namespaces: Vec<&str> = pods
            .iter()
            .filter_map(|p| p.metadata.namespace.as_deref())
            .collect();
        namespaces.sort_unstable();
        namespaces.dedup();
        let wanted: std::collections::HashSet<(String, String)> = pods
            .iter()
            .map(|p| {
                (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.name.clone().unwrap_or_default(),
                )
            })
            .collect();
        until(
            &format!("{} pods running and ready", pods.len()),
            Duration::from_secs(120 + pods.len() as u64 / 10),
            || async {
                let ready = self
                    .pods_in(&namespaces)
                    .await
                    .into_iter()
                    .filter(|p| {
                        let key = (
                            p.metadata.namespace.clone().unwrap_or_default(),
                            p.metadata.name.clone().unwrap_or_default(),
                        );
                        let status = p.status.as_ref();
                        wanted.contains(&key)
                            && status.and_then(|s| s.phase.as_deref()) == Some("Running")
                            && status
                                .and_then(|s| s.conditions.as_ref())
                                .is_some_and(|cs| {
                                    cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                                })
                    })
                    .count();
                if ready < wanted.len() {
                    tokio::time::sleep(Duration::from_millis(225)).await;
                }
                (ready == wanted.len()).then_some(())
            },
        )
        .await
    }

    /// Pods (including terminating ones) of these namespaces, sorted by name.
    pub async fn pods_in(&self, namespaces: &[&str]) -> Vec<Pod> {
        let mut out = Vec::new();
        for ns in namespaces {
            let pods: Api<Pod> = Api::namespaced(self.admin(), ns);
            match pods.list(&ListParams::default()).await {
                Ok(l) => out.extend(l.items),
                Err(e) => panic!("listing pods in {ns}: {e}"),
            }
        }
        out.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        out
    }

    pub async fn node_object(&self, name: &str) -> Node {
        let nodes: Api<Node> = Api::all(self.admin());
        match nodes.get(name).await {
            Ok(n) => n,
            Err(e) => panic!("getting node {name}: {e}"),
        }
    }

    /// The node as JSON.
    pub async fn node_json(&self, name: &str) -> Value {
        serde_json::to_value(self.node_object(name).await).unwrap_or(Value::Null)
    }

    /// Write a node annotation as another controller or an operator would.
    pub async fn set_node_annotation(&self, node: &str, key: &str, value: &str) {
        let nodes: Api<Node> = Api::all(self.admin());
        let patch = json!({ "metadata": { "annotations": { key: value } } });
        if let Err(e) = nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            panic!("annotating node {node}: {e}");
        }
    }

    /// Merge-patch a node's spec as an operator would (e.g. `{"unschedulable": true}`).
    pub async fn patch_node_spec(&self, node: &str, spec: Value) {
        let nodes: Api<Node> = Api::all(self.admin());
        let patch = json!({ "spec": spec });
        if let Err(e) = nodes
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            panic!("patching node {node}: {e}");
        }
    }

    /// This test's Events (in its namespaces, or about objects named with its id), oldest
    /// first, except those Kubernetes' own components report (`RegisteredNode` from the node
    /// controller, `Scheduled` from the scheduler, …): what the software under test said.
    pub async fn events(&self) -> Vec<FlatEvent> {
        let api: Api<Event> = Api::all(self.admin());
        let list = match api.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => panic!("listing events: {e}"),
        };
        let mine = self
            .namespaces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let suffix = format!("-{}", self.id);
        let mut out: Vec<FlatEvent> = list
            .items
            .iter()
            .map(FlatEvent::from_event)
            .filter(|e| mine.contains(&e.namespace) || e.regarding_name.ends_with(&suffix))
            .filter(|e| !e.from_control_plane())
            .collect();
        // eventTime has microseconds; creationTimestamp only seconds.
        let key = |e: &FlatEvent| {
            e.raw["eventTime"]
                .as_str()
                .or(e.raw["metadata"]["creationTimestamp"].as_str())
                .and_then(|t| t.parse::<jiff::Timestamp>().ok())
        };
        out.sort_by(|a, b| key(a).cmp(&key(b)).then(a.name.cmp(&b.name)));
        out
    }

    /// A ReplicaSet of `replicas` pods labelled `labels`, whose pods run `template` (the
    /// replicaset controller runs: it creates what is missing and replaces what is evicted).
    /// Running pods with those labels and no owner ([`TestPod::orphan`]) are adopted: create
    /// them first to choose their names and nodes. For PDBs with `maxUnavailable` or
    /// percentages, which the disruption controller resolves through the pods' controller.
    pub async fn replica_set(
        &self,
        namespace: &str,
        name: &str,
        replicas: i32,
        labels: &[(&str, &str)],
        template: PodSpec,
    ) -> ReplicaSet {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let rs = ReplicaSet {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            spec: Some(ReplicaSetSpec {
                replicas: Some(replicas),
                selector: LabelSelector {
                    match_labels: Some(labels.clone()),
                    ..Default::default()
                },
                template: Some(PodTemplateSpec {
                    metadata: Some(ObjectMeta {
                        labels: Some(labels),
                        ..Default::default()
                    }),
                    spec: Some(template),
                }),
                ..Default::default()
            }),
            status: None,
        };
        let api: Api<ReplicaSet> = Api::namespaced(self.admin(), namespace);
        match api.create(&PostParams::default(), &rs).await {
            Ok(rs) => rs,
            Err(e) => panic!("creating ReplicaSet {namespace}/{name}: {e}"),
        }
    }

    /// A policy/v1 PodDisruptionBudget selecting pods by `matchLabels`; returns once the
    /// disruption controller has computed its status for `expected_pods` pods.
    pub async fn add_pdb(
        &self,
        namespace: &str,
        name: &str,
        selector: &[(&str, &str)],
        limit: PdbLimit,
        expected_pods: i32,
    ) -> PodDisruptionBudget {
        let labels: BTreeMap<String, String> = selector
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut spec = PodDisruptionBudgetSpec {
            selector: Some(LabelSelector {
                match_labels: Some(labels),
                ..Default::default()
            }),
            ..Default::default()
        };
        match limit {
            PdbLimit::MinAvailable(v) => spec.min_available = Some(v),
            PdbLimit::MaxUnavailable(v) => spec.max_unavailable = Some(v),
        }
        let pdb = PodDisruptionBudget {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                ..Default::default()
            },
            spec: Some(spec),
            status: None,
        };
        let api: Api<PodDisruptionBudget> = Api::namespaced(self.admin(), namespace);
        if let Err(e) = api.create(&PostParams::default(), &pdb).await {
            panic!("creating PDB {namespace}/{name}: {e}");
        }
        until(
            &format!("PDB {namespace}/{name} status for {expected_pods} pods (kube-controller-manager's disruption controller)"),
            Duration::from_secs(30),
            || async {
                let p = api.get(name).await.ok()?;
                let generation = p.metadata.generation?;
                let status = p.status.clone()?;
                (status.observed_generation == Some(generation)
                    && status.expected_pods == expected_pods)
                    .then_some(p)
            },
        )
        .await
    }
}

/// Taints as (key, value, effect), leaving out those Kubernetes' own node lifecycle controller
/// keeps in step with the node's state (`node.kubernetes.io/*`, e.g. `unschedulable` on a
/// cordoned node): what spotguard and operators put there.
pub fn non_system_taints(node: &Node) -> Vec<(String, Option<String>, String)> {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !t.key.starts_with("node.kubernetes.io/"))
        .map(|t| (t.key, t.value, t.effect))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_that_never_came_up_is_described() {
        assert_eq!(describe_pod(None), "absent");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": { "name": "p" },
            "status": {
                "phase": "Pending",
                "conditions": [{ "type": "PodScheduled", "status": "True" }],
                "containerStatuses": [{
                    "name": "main", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "state": { "waiting": { "reason": "ContainerCreating", "message": "configmap kube-root-ca.crt not found" } }
                }]
            }
        }))
        .unwrap();
        let text = describe_pod(Some(&pod));
        assert!(
            text.starts_with("phase Pending, conditions [PodScheduled=True]"),
            "{text}"
        );
        assert!(text.contains("main {\"waiting\":{\"message\":\"configmap kube-root-ca.crt not found\",\"reason\":\"ContainerCreating\"}}"), "{text}");
    }
}
