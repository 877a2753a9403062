//! KubeNodeOps against a real API server (behaviour: testkit's control plane, kubelet stand-in
//! and fault proxy; spotguard acts as the shipped ServiceAccount) and against tower-test
//! scripted exchanges (exact request shapes).

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use spotguard::metrics::{encode, Metrics};
use spotguard::node::kube::KubeNodeOps;
use spotguard::node::{
    reason, Applied, AppliedMarks, ConditionState, DrainRequest, Error, EventType, GpuConditions,
    NodeOps, Protection, TaintEffect, GPU_UNHEALTHY_TAINT, INTERRUPTION_TAINT, NOTICE_ANNOTATION,
};
use spotguard::notice::{Cloud, NoticeKind};
use spotguard::responder::record::{Phase, PlanState};
use spotguard_testkit::k8s::fixtures::STUCK_FINALIZER;
use spotguard_testkit::k8s::{
    non_system_taints, EventApi, Identity, Kubelet, NodeConfig, PdbLimit, RecordedRequest,
    RequestKind, TestCluster, TestPod,
};

/// Only used by the tower-test exchanges below (the real-server tests name their node per test).
const NODE: &str = "gpu-node-1";
const OWN_POD: &str = "spotguard-agent-x7k2p";

struct Env {
    k: TestCluster,
    node: Kubelet,
    ops: KubeNodeOps,
    registry: Registry,
    /// The agent's own namespace (its pod is never evicted).
    own_ns: String,
}

impl Env {
    fn name(&self) -> &str {
        self.node.name()
    }
}

/// How a test's [`Env`] is made: `Env::start().await` for the usual node (schedulable, the
/// agent's identity, not dry-run), or e.g.
/// `Env::builder().node(NodeConfig::unschedulable).dry_run().start().await`.
struct EnvBuilder {
    node: fn(NodeConfig) -> NodeConfig,
    dry_run: bool,
    identity: Identity,
}

impl Env {
    async fn start() -> Env {
        Env::builder().start().await
    }

    fn builder() -> EnvBuilder {
        EnvBuilder {
            node: |c| c,
            dry_run: false,
            identity: Identity::Agent,
        }
    }
}

impl EnvBuilder {
    /// Shape the node before it registers.
    fn node(self, node: fn(NodeConfig) -> NodeConfig) -> EnvBuilder {
        EnvBuilder { node, ..self }
    }

    fn dry_run(self) -> EnvBuilder {
        EnvBuilder {
            dry_run: true,
            ..self
        }
    }

    /// The ServiceAccount KubeNodeOps acts as.
    fn identity(self, identity: Identity) -> EnvBuilder {
        EnvBuilder { identity, ..self }
    }

    /// A node with its kubelet, and KubeNodeOps acting as the identity through the fault proxy.
    async fn start(self) -> Env {
        let k = TestCluster::new().await;
        let node = k.node((self.node)(k.node_config("gpu-node-1"))).await;
        let own_ns = k.namespace("spotguard").await;
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let ops = KubeNodeOps::new(
            k.client_as(self.identity),
            node.name().to_string(),
            Some((own_ns.clone(), OWN_POD.to_string())),
            self.dry_run,
            metrics,
        );
        Env {
            k,
            node,
            ops,
            registry,
            own_ns,
        }
    }
}

/// `n` plain pods `worker-0` … on `node`, shaped by `shape`.
fn workers(
    ns: &str,
    node: &str,
    n: usize,
    shape: impl Fn(TestPod) -> TestPod,
) -> Vec<k8s_openapi::api::core::v1::Pod> {
    (0..n)
        .map(|i| shape(TestPod::new(ns, &format!("worker-{i}"), node)).build())
        .collect()
}

fn interruption() -> Protection {
    Protection {
        taint_value: "interruption".to_string(),
        effect: TaintEffect::NoSchedule,
        cordon: true,
    }
}

/// spotguard's and operators' taints (the node lifecycle controller's own `node.kubernetes.io/*`
/// taints, e.g. `unschedulable` on a cordoned node, are Kubernetes', not theirs).
async fn taints(e: &Env) -> Vec<(String, Option<String>, String)> {
    non_system_taints(&e.k.node_object(e.name()).await)
}

async fn cordoned(e: &Env) -> bool {
    e.k.node_object(e.name())
        .await
        .spec
        .and_then(|s| s.unschedulable)
        == Some(true)
}

fn in_secs(secs: u64) -> Timestamp {
    Timestamp::now() + Duration::from_secs(secs)
}

fn drain_request(deadline: Timestamp) -> DrainRequest {
    DrainRequest {
        deadline,
        force_delete_at_deadline: false,
        concurrency: 8,
        holds: Vec::new(),
    }
}

fn evictions(e: &Env) -> Vec<RecordedRequest> {
    e.k.proxy()
        .requests()
        .into_iter()
        .filter(|r| r.kind == RequestKind::Eviction)
        .collect()
}

async fn pod_names(e: &Env, namespaces: &[&str]) -> Vec<String> {
    e.k.pods_in(namespaces)
        .await
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

/// [`sample_state`] as the node stores it: the responder's compact JSON.
fn sample_record() -> String {
    serde_json::to_string(&sample_state()).expect("a record serializes")
}

fn sample_state() -> PlanState {
    PlanState {
        id: "i-0abc-interruption".to_string(),
        kind: NoticeKind::Interruption,
        source: Cloud::Aws,
        deadline: Some("2030-01-02T03:04:05Z".parse().expect("timestamp")),
        phase: Phase::Signalled,
        signalled_at: Some("2030-01-02T03:02:10Z".parse().expect("timestamp")),
        applied: Applied {
            cordoned: true,
            taint_effect: Some(TaintEffect::NoSchedule),
        },
        boot_id: Some("3f0c2e8a".to_string()),
        restart: false,
        detail: "instance-action terminate".to_string(),
        failure: None,
        updated_at: "2030-01-02T03:02:11Z".parse().expect("timestamp"),
    }
}

// === protect / unprotect ===

/// Issue 9 item 6: what spotguard applied is recorded on the Node in the same patch, so an agent
/// that died between the patch and its plan record still knows (and undo still spares an
/// operator's changes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_records_what_spotguard_applied_in_the_same_patch() {
    let e = Env::start().await;
    assert!(e.ops.applied_marks().await.expect("marks").is_empty());
    e.ops.protect(&interruption()).await.expect("protect");
    let marks = e.ops.applied_marks().await.expect("marks");
    assert_eq!(
        marks,
        AppliedMarks {
            cordoned: true,
            taints: vec![TaintEffect::NoSchedule]
        }
    );
    // A second protect (the resumed plan) changes nothing and reports nothing new, but the marks
    // still tell what spotguard did.
    let again = e.ops.protect(&interruption()).await.expect("protect");
    assert_eq!(again, Applied::default());
    assert_eq!(
        e.ops
            .applied_marks()
            .await
            .expect("marks")
            .for_protection(&interruption()),
        Applied {
            cordoned: true,
            taint_effect: Some(TaintEffect::NoSchedule)
        }
    );
    e.ops
        .unprotect(&marks.for_protection(&interruption()))
        .await
        .expect("unprotect");
    assert!(!cordoned(&e).await);
    assert!(e.ops.applied_marks().await.expect("marks").is_empty());
    let node = e.k.node_json(e.name()).await;
    assert!(
        node["metadata"]["annotations"]["spotguard.io/applied"].is_null(),
        "{node}"
    );
}

/// An operator's cordon is never in spotguard's marks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_never_claim_an_operators_cordon() {
    let e = Env::builder().node(NodeConfig::unschedulable).start().await;
    e.ops.protect(&interruption()).await.expect("protect");
    let marks = e.ops.applied_marks().await.expect("marks");
    assert!(!marks.cordoned);
    assert_eq!(marks.taints, vec![TaintEffect::NoSchedule]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_and_unprotect_a_schedulable_node() {
    let e = Env::start().await;
    let applied = e.ops.protect(&interruption()).await.expect("protect");
    assert_eq!(
        applied,
        Applied {
            cordoned: true,
            taint_effect: Some(TaintEffect::NoSchedule)
        }
    );
    assert!(cordoned(&e).await);
    assert_eq!(
        taints(&e).await,
        vec![(
            INTERRUPTION_TAINT.to_string(),
            Some("interruption".to_string()),
            "NoSchedule".to_string()
        )]
    );
    // One PATCH did both, carrying the resourceVersion it read.
    let patches: Vec<_> =
        e.k.proxy()
            .requests()
            .into_iter()
            .filter(|r| r.method == "PATCH")
            .collect();
    assert_eq!(patches.len(), 1);
    assert_eq!(
        patches[0].content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    let body = patches[0].json().expect("json body");
    assert!(body["metadata"]["resourceVersion"].is_string(), "{body}");

    e.ops.unprotect(&applied).await.expect("unprotect");
    assert!(!cordoned(&e).await);
    assert!(taints(&e).await.is_empty());
    let text = encode(&e.registry);
    assert!(
        text.contains("spotguard_node_actions_total{action=\"cordon\",outcome=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("spotguard_node_actions_total{action=\"uncordon\",outcome=\"ok\"} 1"),
        "{text}"
    );
}

/// The real control plane answers a cordon with its own `node.kubernetes.io/unschedulable`
/// taint (node lifecycle controller). spotguard's undo keeps every taint that is not its own:
/// what the controller put there is left for the controller to take away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undo_leaves_the_control_planes_own_taints_to_it() {
    let e = Env::start().await;
    let applied = e.ops.protect(&interruption()).await.expect("protect");
    let start = std::time::Instant::now();
    loop {
        let node = e.k.node_object(e.name()).await;
        let all = node.spec.and_then(|s| s.taints).unwrap_or_default();
        if all
            .iter()
            .any(|t| t.key == "node.kubernetes.io/unschedulable")
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the node lifecycle controller never tainted the cordoned node: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    e.ops.unprotect(&applied).await.expect("unprotect");
    let patch =
        e.k.proxy()
            .requests()
            .into_iter()
            .rfind(|r| r.method == "PATCH")
            .expect("undo patch");
    let body = patch.json().expect("json");
    let sent: Vec<&str> = body["spec"]["taints"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t["key"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(sent, vec!["node.kubernetes.io/unschedulable"], "{body}");
    assert!(!cordoned(&e).await);
    assert!(taints(&e).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_cordon_and_taints_survive_undo() {
    let e = Env::builder()
        .node(|c| {
            c.unschedulable()
                .taint("dedicated", Some("training"), "NoSchedule")
        })
        .start()
        .await;
    let applied = e.ops.protect(&interruption()).await.expect("protect");
    assert_eq!(
        applied,
        Applied {
            cordoned: false,
            taint_effect: Some(TaintEffect::NoSchedule)
        }
    );
    assert_eq!(taints(&e).await.len(), 2);
    e.ops.unprotect(&applied).await.expect("unprotect");
    assert!(cordoned(&e).await, "the operator's cordon stays");
    assert_eq!(
        taints(&e).await,
        vec![(
            "dedicated".to_string(),
            Some("training".to_string()),
            "NoSchedule".to_string()
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protecting_twice_writes_once_and_reports_nothing_new() {
    let e = Env::start().await;
    e.ops.protect(&interruption()).await.expect("protect");
    let writes = e.k.proxy().write_count();
    let again = e.ops.protect(&interruption()).await.expect("protect again");
    assert_eq!(again, Applied::default());
    assert_eq!(
        e.k.proxy().write_count(),
        writes,
        "nothing to change: no write"
    );
    assert_eq!(taints(&e).await.len(), 1, "taint added once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_then_interruption_keeps_both_taints_and_undoes_one() {
    let e = Env::start().await;
    let soft = Protection {
        taint_value: "rebalance".into(),
        effect: TaintEffect::PreferNoSchedule,
        cordon: false,
    };
    let a1 = e.ops.protect(&soft).await.expect("soft taint");
    assert_eq!(a1.taint_effect, Some(TaintEffect::PreferNoSchedule));
    assert!(!a1.cordoned && !cordoned(&e).await);
    let a2 = e.ops.protect(&interruption()).await.expect("hard taint");
    assert_eq!(a2.taint_effect, Some(TaintEffect::NoSchedule));
    assert_eq!(taints(&e).await.len(), 2);
    e.ops
        .unprotect(&a1)
        .await
        .expect("undo the rebalance taint");
    assert_eq!(
        taints(&e).await,
        vec![(
            INTERRUPTION_TAINT.to_string(),
            Some("interruption".to_string()),
            "NoSchedule".to_string()
        )]
    );
    assert!(cordoned(&e).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicts_and_server_errors_during_cordon_are_retried() {
    let e = Env::start().await;
    e.k.proxy().fail_next(RequestKind::NodeWrite, 409, 2);
    e.k.proxy().fail_next(RequestKind::NodeWrite, 500, 2);
    let applied = e
        .ops
        .protect(&interruption())
        .await
        .expect("protect despite faults");
    assert!(applied.cordoned);
    assert_eq!(applied.taint_effect, Some(TaintEffect::NoSchedule));
    assert!(cordoned(&e).await);
    assert_eq!(taints(&e).await.len(), 1, "taint added once");
    let reqs = e.k.proxy().requests();
    let patches = reqs.iter().filter(|r| r.method == "PATCH").count();
    let gets = reqs.iter().filter(|r| r.method == "GET").count();
    assert_eq!(patches, 5, "4 refused + 1 accepted");
    assert!(gets >= 5, "every attempt re-reads the node ({gets} GETs)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflict_that_never_settles_is_reported() {
    let e = Env::start().await;
    e.k.proxy().fail_next(RequestKind::NodeWrite, 409, 100);
    match e.ops.protect(&interruption()).await {
        Err(err @ Error::Conflict { .. }) => assert!(err.is_retryable()),
        other => panic!("expected a conflict error, got {other:?}"),
    }
    assert!(!cordoned(&e).await);
}

/// What spotguard's optimistic concurrency relies on: the API server refuses a merge patch that
/// carries a resourceVersion someone else has moved on from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_refuses_a_write_with_a_stale_resource_version() {
    use kube::api::{Api, Patch, PatchParams};
    let e = Env::start().await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(e.k.agent_client());
    let node = nodes.get(e.name()).await.expect("get");
    let rv = node
        .metadata
        .resource_version
        .clone()
        .expect("resourceVersion");
    e.k.set_node_annotation(e.name(), "other/controller", "was-here")
        .await;
    let patch = json!({ "metadata": { "resourceVersion": rv }, "spec": { "unschedulable": true } });
    match nodes
        .patch(e.name(), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 409);
            assert_eq!(s.reason, "Conflict");
        }
        other => panic!("expected 409, got {other:?}"),
    }
    assert!(!cordoned(&e).await);
}

// === plan state annotation ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_state_round_trips_through_the_node_annotation() {
    let e = Env::start().await;
    assert_eq!(e.ops.load_state().await.expect("load"), None);
    let state = sample_state();
    e.ops.save_state(&sample_record()).await.expect("save");
    let stored = e.ops.load_state().await.expect("load");
    // Stored as given, and still the same record.
    assert_eq!(stored.as_deref(), Some(sample_record().as_str()));
    let read: PlanState = serde_json::from_str(&stored.expect("a copy")).expect("a record");
    assert_eq!(read, state);
    let raw =
        e.k.node_object(e.name())
            .await
            .metadata
            .annotations
            .expect("annotations");
    let stored: Value = serde_json::from_str(&raw[NOTICE_ANNOTATION]).expect("annotation is JSON");
    assert_eq!(stored["phase"], "signalled");
    e.ops.clear_state().await.expect("clear");
    assert_eq!(e.ops.load_state().await.expect("load"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_annotation_is_a_typed_error() {
    let e = Env::start().await;
    e.k.set_node_annotation(e.name(), NOTICE_ANNOTATION, "{\"id\": \"x\", \"phase\": ")
        .await;
    match e.ops.load_state().await {
        Err(err @ Error::StateCorrupt { .. }) => {
            assert_eq!(err.metric_label(), "state_corrupt");
            assert!(err.to_string().contains(NOTICE_ANNOTATION), "{err}");
        }
        other => panic!("expected StateCorrupt, got {other:?}"),
    }
    // Saving over it repairs it.
    e.ops.save_state(&sample_record()).await.expect("save");
    assert!(e.ops.load_state().await.expect("load").is_some());
}

// === events ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_events_use_events_v1_and_repeat_as_a_series() {
    let e = Env::start().await;
    let team = e.k.namespace("team-a").await;
    let msg = "EC2 spot interruption: terminate at 2030-01-02T03:04:05Z";
    e.ops
        .event(EventType::Warning, reason::SPOT_INTERRUPTION, msg)
        .await
        .expect("event");
    e.ops
        .event(EventType::Warning, reason::SPOT_INTERRUPTION, msg)
        .await
        .expect("event again");
    let events = e.k.events().await;
    assert_eq!(events.len(), 1, "{events:?}");
    let ev = &events[0];
    assert_eq!(ev.api, EventApi::EventsV1);
    assert_eq!(ev.namespace, "default");
    assert_eq!(
        (ev.regarding_kind.as_str(), ev.regarding_name.as_str()),
        ("Node", e.name())
    );
    assert!(
        !ev.raw["regarding"]["uid"].as_str().unwrap_or("").is_empty(),
        "node uid set"
    );
    assert_eq!(ev.reason, "SpotInterruption");
    assert_eq!(ev.type_, "Warning");
    assert_eq!(ev.message, msg);
    assert_eq!(ev.reporting_controller, "spotguard.io/agent");
    assert_eq!(ev.count, 2);

    let long = "x".repeat(5000);
    e.ops
        .event(EventType::Normal, reason::DRAIN_COMPLETE, &long)
        .await
        .expect("long note is cut to the limit");
    let pod = spotguard::checkpoint::PodRef {
        namespace: team.clone(),
        name: "trainer-0".into(),
        uid: "uid-1".into(),
    };
    e.ops
        .pod_event(
            &pod,
            EventType::Normal,
            reason::CHECKPOINT_ACKED,
            "checkpoint step 1200 saved",
        )
        .await
        .expect("pod event");
    let events = e.k.events().await;
    assert_eq!(events.len(), 3);
    let pev = events
        .iter()
        .find(|ev| ev.reason == "CheckpointAcked")
        .expect("pod event stored");
    assert_eq!(pev.namespace, team);
    assert_eq!(
        (
            pev.regarding_kind.as_str(),
            pev.regarding_namespace.as_str()
        ),
        ("Pod", team.as_str())
    );
}

// === drain ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_evicts_twenty_pods() {
    let e = Env::start().await;
    let other = e.k.node(e.k.node_config("gpu-node-2")).await;
    let team = e.k.namespace("team-a").await;
    let mut pods = workers(&team, e.name(), 20, |p| p);
    pods.push(TestPod::new(&team, "elsewhere", other.name()).build());
    e.k.run_pods(&pods).await;
    let report = e
        .ops
        .drain(&drain_request(in_secs(60)))
        .await
        .expect("drain");
    assert!(report.complete(), "{report:?}");
    assert_eq!(report.evicted.len(), 20);
    assert!(report.evicted.contains(&format!("{team}/worker-7")));
    assert_eq!(pod_names(&e, &[&team]).await, vec!["elsewhere".to_string()]);
    // Listed once, for this node only.
    let lists: Vec<_> =
        e.k.proxy()
            .requests()
            .into_iter()
            .filter(|r| r.method == "GET" && r.path == "/api/v1/pods")
            .collect();
    assert_eq!(lists.len(), 1);
    assert_eq!(
        lists[0].query_param("fieldSelector").as_deref(),
        Some(&*format!("spec.nodeName={}", e.name()))
    );
    assert_eq!(evictions(&e).len(), 20);
    let text = encode(&e.registry);
    assert!(
        text.contains("spotguard_drain_pods_total{outcome=\"evicted\"} 20"),
        "{text}"
    );
    assert!(text.contains("spotguard_drain_blocked_pods 0"), "{text}");
    assert!(
        text.contains("spotguard_drain_duration_seconds_count 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemonset_mirror_finished_and_own_pods_are_never_evicted() {
    let e = Env::start().await;
    let system = e.k.namespace("kube-system").await;
    let team = e.k.namespace("team-a").await;
    let node_uid =
        e.k.node_object(e.name())
            .await
            .metadata
            .uid
            .expect("node uid");
    let proxy_pod = format!("kube-proxy-{}", e.name());
    e.k.run_pods(&[
        TestPod::new(&system, "nvidia-device-plugin-abc", e.name())
            .daemonset()
            .build(),
        TestPod::new(&system, &proxy_pod, e.name())
            .mirror(e.name(), &node_uid)
            .build(),
        TestPod::new(&team, "preprocess-done", e.name())
            .phase("Succeeded")
            .build(),
        TestPod::new(&team, "preprocess-crashed", e.name())
            .phase("Failed")
            .build(),
        TestPod::new(&e.own_ns, OWN_POD, e.name()).build(),
        TestPod::new(&team, "trainer-0", e.name()).build(),
    ])
    .await;
    let report = e
        .ops
        .drain(&drain_request(in_secs(60)))
        .await
        .expect("drain");
    assert_eq!(report.evicted, vec![format!("{team}/trainer-0")]);
    let mut skipped = report.skipped.clone();
    skipped.sort();
    let mut want = vec![
        format!("{system}/{proxy_pod}"),
        format!("{system}/nvidia-device-plugin-abc"),
        format!("{}/{OWN_POD}", e.own_ns),
        format!("{team}/preprocess-crashed"),
        format!("{team}/preprocess-done"),
    ];
    want.sort();
    assert_eq!(skipped, want);
    let evicted: Vec<String> = evictions(&e).iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        evicted,
        vec![format!("/api/v1/namespaces/{team}/pods/trainer-0/eviction")]
    );
    assert_eq!(e.k.pods_in(&[&system, &team, &e.own_ns]).await.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdb_blocks_one_pod_until_the_deadline_and_is_named() {
    let e = Env::start().await;
    let db = e.k.namespace("db").await;
    let team = e.k.namespace("team-a").await;
    let mut pods = vec![TestPod::new(&db, "postgres-0", e.name())
        .label("app", "postgres")
        .build()];
    pods.extend(workers(&team, e.name(), 3, |p| p));
    e.k.run_pods(&pods).await;
    e.k.add_pdb(
        &db,
        "postgres-pdb",
        &[("app", "postgres")],
        PdbLimit::MinAvailable(IntOrString::Int(1)),
        1,
    )
    .await;
    let deadline = in_secs(4);
    let started = std::time::Instant::now();
    let report = e.ops.drain(&drain_request(deadline)).await.expect("drain");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(3000),
        "returned before the deadline: {took:?}"
    );
    assert!(
        took < Duration::from_secs(8),
        "overran the deadline: {took:?}"
    );
    assert_eq!(report.evicted.len(), 3);
    assert_eq!(report.blocked.len(), 1, "{report:?}");
    let b = &report.blocked[0];
    assert_eq!(b.pod, format!("{db}/postgres-0"));
    assert_eq!(b.pdbs, vec!["postgres-pdb".to_string()]);
    assert!(b.reason.contains("429"), "{}", b.reason);
    assert!(b.reason.contains("disruption budget"), "{}", b.reason);
    assert!(e.k.pod(&db, "postgres-0").await.is_some());
    // Retried every 1–2 s, not hammered.
    let tries = evictions(&e)
        .iter()
        .filter(|r| r.path.contains("postgres-0"))
        .count();
    assert!(
        (2..=5).contains(&tries),
        "{tries} eviction attempts in ~4 s"
    );
    let text = encode(&e.registry);
    assert!(text.contains("spotguard_drain_blocked_pods 1"), "{text}");
    assert!(
        text.contains("spotguard_drain_pods_total{outcome=\"blocked\"} 1"),
        "{text}"
    );
}

/// Three replicas of a ReplicaSet behind `maxUnavailable: 1`: the budget lets one go; its
/// replacement cannot be scheduled yet (no other node), so the next eviction is refused (429)
/// and the drain waits for the budget; once the test adds a node the replacement is Ready there
/// and the disruption controller lets the next one go. (Issue 34 item 4: with the spare node
/// there from the start a fast machine had each replacement Ready before the next eviction, and
/// no eviction waited.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdb_with_room_lets_pods_go_one_at_a_time() {
    let e = Env::start().await;
    let web = e.k.namespace("web").await;
    let template = TestPod::new(&web, "template", "")
        .terminates_after(Duration::from_millis(300))
        .build()
        .spec
        .expect("spec");
    let mut template = template;
    template.node_name = None;
    template.node_selector = Some(e.k.node_selector());
    let pods: Vec<_> = (0..3)
        .map(|i| {
            TestPod::new(&web, &format!("web-{i}"), e.name())
                .label("app", "web")
                .orphan()
                .terminates_after(Duration::from_millis(300))
                .build()
        })
        .collect();
    e.k.run_pods(&pods).await;
    // The ReplicaSet adopts the three.
    e.k.replica_set(&web, "web", 3, &[("app", "web")], template)
        .await;
    e.k.add_pdb(
        &web,
        "web-pdb",
        &[("app", "web")],
        PdbLimit::MaxUnavailable(IntOrString::Int(1)),
        3,
    )
    .await;
    // Cordoned first, as the agent's plan does: replacements go to the spare node.
    e.k.patch_node_spec(e.name(), json!({ "unschedulable": true }))
        .await;
    let request = drain_request(in_secs(60));
    let drain = e.ops.drain(&request);
    tokio::pin!(drain);
    // The first eviction leaves a replacement with nowhere to go: the budget refuses the next.
    let refused = async {
        while !evictions(&e).iter().any(|r| r.status == Some(429)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        r = &mut drain => panic!("the drain ended before the budget refused an eviction: {r:?}"),
        r = tokio::time::timeout(Duration::from_secs(30), refused) => {
            r.expect("no eviction was refused by the budget within 30 s");
        }
    }
    let spare = e.k.node(e.k.node_config("gpu-node-2")).await;
    let report = drain.await.expect("drain");
    assert!(report.complete(), "{report:?}");
    assert_eq!(report.evicted.len(), 3, "{report:?}");
    let tries = evictions(&e).len();
    assert!(
        tries > 3,
        "some evictions waited for the budget ({tries} attempts)"
    );
    let replacements =
        e.k.pods_in(&[&web])
            .await
            .into_iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(spare.name()))
            .count();
    assert!(
        replacements >= 2,
        "replaced on the spare node: {replacements}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grace_period_longer_than_the_time_left_is_capped() {
    let e = Env::start().await;
    let team = e.k.namespace("team-a").await;
    e.k.run_pods(&[
        TestPod::new(&team, "slow-shutdown", e.name())
            .grace_period(600)
            .build(),
        TestPod::new(&team, "quick", e.name())
            .grace_period(5)
            .build(),
        TestPod::new(&team, "default-grace", e.name()).build(),
    ])
    .await;
    let report = e
        .ops
        .drain(&drain_request(in_secs(20)))
        .await
        .expect("drain");
    assert!(report.complete(), "{report:?}");
    let grace = |pod: &str| -> i64 {
        let r = evictions(&e)
            .into_iter()
            .find(|r| r.path.contains(pod))
            .expect("eviction sent");
        let body = r.json().expect("json");
        assert_eq!(body["apiVersion"], "policy/v1");
        assert_eq!(body["kind"], "Eviction");
        assert_eq!(body["metadata"]["name"], pod);
        assert!(body["deleteOptions"]["preconditions"]["uid"].is_string());
        body["deleteOptions"]["gracePeriodSeconds"]
            .as_i64()
            .expect("grace set")
    };
    let capped = grace("slow-shutdown");
    assert!(
        (14..=18).contains(&capped),
        "capped to time left − 2 s: {capped}"
    );
    assert_eq!(grace("quick"), 5);
    let dflt = grace("default-grace");
    assert!((14..=18).contains(&dflt), "default 30 s capped too: {dflt}");
}

/// Run as the ServiceAccount with the force-delete component's role as well (the base role may
/// not delete pods).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_pods_are_force_deleted_before_the_deadline_when_enabled() {
    let e = Env::builder()
        .identity(Identity::AgentForceDelete)
        .start()
        .await;
    let db = e.k.namespace("db").await;
    let template = {
        let mut s = TestPod::new(&db, "t", "").build().spec.expect("spec");
        s.node_name = None;
        s.node_selector = Some(e.k.node_selector());
        s
    };
    e.k.run_pods(&[TestPod::new(&db, "etcd-0", e.name())
        .label("app", "etcd")
        .orphan()
        .grace_period(120)
        .build()])
        .await;
    e.k.replica_set(&db, "etcd", 1, &[("app", "etcd")], template)
        .await;
    e.k.add_pdb(
        &db,
        "etcd-quorum",
        &[("app", "etcd")],
        PdbLimit::MaxUnavailable(IntOrString::Int(0)),
        1,
    )
    .await;
    let request = DrainRequest {
        deadline: in_secs(8),
        force_delete_at_deadline: true,
        concurrency: 4,
        holds: Vec::new(),
    };
    let started = std::time::Instant::now();
    let report = e.ops.drain(&request).await.expect("drain");
    assert_eq!(
        report.force_deleted,
        vec![format!("{db}/etcd-0")],
        "{report:?}"
    );
    assert!(report.blocked.is_empty());
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "finished before the deadline"
    );
    assert!(e.k.pod(&db, "etcd-0").await.is_none());
    let delete =
        e.k.proxy()
            .requests()
            .into_iter()
            .find(|r| r.method == "DELETE")
            .expect("a DELETE was sent");
    let grace = delete.json().expect("delete options")["gracePeriodSeconds"]
        .as_i64()
        .expect("grace");
    assert!(
        (1..=4).contains(&grace),
        "grace capped to the time left: {grace}"
    );
    let text = encode(&e.registry);
    assert!(
        text.contains("spotguard_drain_pods_total{outcome=\"force_deleted\"} 1"),
        "{text}"
    );
}

/// A pod held by a finalizer: its deletion never completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_never_finishes_terminating_is_reported() {
    let e = Env::start().await;
    let team = e.k.namespace("team-a").await;
    e.k.run_pods(&[
        TestPod::new(&team, "stuck", e.name()).stuck().build(),
        TestPod::new(&team, "fine", e.name()).build(),
    ])
    .await;
    let report = e
        .ops
        .drain(&drain_request(in_secs(3)))
        .await
        .expect("drain");
    assert_eq!(report.evicted, vec![format!("{team}/fine")]);
    assert_eq!(report.blocked.len(), 1);
    assert_eq!(report.blocked[0].pod, format!("{team}/stuck"));
    assert!(report.blocked[0].pdbs.is_empty());
    assert!(
        report.blocked[0].reason.contains("terminating"),
        "{}",
        report.blocked[0].reason
    );
    let stuck = e.k.pod(&team, "stuck").await.expect("still there");
    assert!(stuck.metadata.deletion_timestamp.is_some());
    assert_eq!(
        stuck.metadata.finalizers.as_deref(),
        Some(&[STUCK_FINALIZER.to_string()][..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pdbs_on_one_pod_are_a_server_error_reported_at_the_deadline() {
    let e = Env::start().await;
    let ml = e.k.namespace("ml").await;
    e.k.run_pods(&[TestPod::new(&ml, "ps-0", e.name())
        .label("app", "ps")
        .label("tier", "train")
        .build()])
        .await;
    e.k.add_pdb(
        &ml,
        "ps-a",
        &[("app", "ps")],
        PdbLimit::MinAvailable(IntOrString::Int(0)),
        1,
    )
    .await;
    e.k.add_pdb(
        &ml,
        "ps-b",
        &[("tier", "train")],
        PdbLimit::MinAvailable(IntOrString::Int(0)),
        1,
    )
    .await;
    let report = e
        .ops
        .drain(&drain_request(in_secs(3)))
        .await
        .expect("drain");
    assert_eq!(report.blocked.len(), 1);
    assert!(
        report.blocked[0]
            .reason
            .contains("more than one PodDisruptionBudget"),
        "{}",
        report.blocked[0].reason
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_drain_converges_when_run_again() {
    let e = Env::start().await;
    let team = e.k.namespace("team-a").await;
    let pods = workers(&team, e.name(), 10, |p| {
        p.terminates_after(Duration::from_millis(1500))
    });
    e.k.run_pods(&pods).await;
    let request = drain_request(in_secs(60));
    // The agent dies mid-drain: the future is dropped after the evictions went out.
    let first = tokio::time::timeout(Duration::from_millis(600), e.ops.drain(&request)).await;
    assert!(first.is_err(), "the first drain was cut off");
    let left = e.k.pods_in(&[&team]).await;
    let terminating = left
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some())
        .count();
    assert!(terminating > 0, "evictions went out before the cut");
    let present = left.len();
    let report = e.ops.drain(&request).await.expect("second drain");
    assert!(report.complete(), "{report:?}");
    assert!(e.k.pods_in(&[&team]).await.is_empty());
    assert_eq!(
        report.evicted.len(),
        present,
        "every pod still there is evicted (or found gone)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_writes_nothing() {
    let e = Env::builder().dry_run().start().await;
    let team = e.k.namespace("team-a").await;
    let system = e.k.namespace("kube-system").await;
    e.k.run_pods(&[
        TestPod::new(&team, "trainer-0", e.name()).build(),
        TestPod::new(&system, "ds-pod", e.name())
            .daemonset()
            .build(),
    ])
    .await;
    let applied = e.ops.protect(&interruption()).await.expect("protect");
    assert!(applied.cordoned, "reports what it would do");
    e.ops.unprotect(&applied).await.expect("unprotect");
    e.ops.save_state(&sample_record()).await.expect("save");
    e.ops.clear_state().await.expect("clear");
    e.ops
        .event(EventType::Warning, reason::SPOT_INTERRUPTION, "would say")
        .await
        .expect("event");
    let report = e
        .ops
        .drain(&drain_request(in_secs(30)))
        .await
        .expect("drain");
    assert_eq!(report.skipped, vec![format!("{system}/ds-pod")]);
    let gpu = GpuConditions {
        unhealthy: ConditionState {
            active: true,
            reason: "XID79".into(),
            message: "GPU-1 fell off the bus".into(),
        },
        degraded: ConditionState::default(),
    };
    e.ops.set_gpu_conditions(&gpu).await.expect("conditions");
    assert_eq!(e.k.proxy().write_count(), 0, "{:?}", e.k.proxy().requests());
    assert!(!cordoned(&e).await);
    assert_eq!(e.k.pods_in(&[&team, &system]).await.len(), 2);
    assert!(e.k.events().await.is_empty());
}

// === GPU conditions ===

async fn condition(e: &Env, type_: &str) -> Option<k8s_openapi::api::core::v1::NodeCondition> {
    e.k.node_object(e.name())
        .await
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == type_)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_conditions_set_merge_and_clear() {
    let e = Env::start().await;
    let ready_before = condition(&e, "Ready").await.expect("kubelet condition");

    // Healthy and never shown: nothing to write.
    e.ops
        .set_gpu_conditions(&GpuConditions::default())
        .await
        .expect("healthy");
    assert_eq!(e.k.proxy().write_count(), 0);

    let unhealthy = GpuConditions {
        unhealthy: ConditionState {
            active: true,
            reason: "XidCritical".into(),
            message: "GPU-5f1e2a: XID 79 (GPU has fallen off the bus); boot 3f0c2e8a".into(),
        },
        degraded: ConditionState::default(),
    };
    e.ops
        .set_gpu_conditions(&unhealthy)
        .await
        .expect("unhealthy");
    let c = condition(&e, "GPUUnhealthy").await.expect("condition set");
    assert_eq!(c.status, "True");
    assert_eq!(c.reason.as_deref(), Some("XidCritical"));
    assert_eq!(
        c.message.as_deref(),
        Some(unhealthy.unhealthy.message.as_str())
    );
    assert!(condition(&e, "GPUDegraded").await.is_none());
    assert_eq!(
        condition(&e, "Ready").await,
        Some(ready_before.clone()),
        "kubelet's condition untouched"
    );
    let status_patch =
        e.k.proxy()
            .requests()
            .into_iter()
            .find(|r| r.path.ends_with("/status"))
            .expect("status patch");
    assert_eq!(
        status_patch.content_type.as_deref(),
        Some("application/strategic-merge-patch+json")
    );
    assert_eq!(
        taints(&e).await,
        vec![(
            GPU_UNHEALTHY_TAINT.to_string(),
            None,
            "NoSchedule".to_string()
        )]
    );
    assert_eq!(e.ops.gpu_conditions().await.expect("read back"), unhealthy);

    // Same again: no write at all.
    let writes = e.k.proxy().write_count();
    e.ops
        .set_gpu_conditions(&unhealthy)
        .await
        .expect("unchanged");
    assert_eq!(e.k.proxy().write_count(), writes);

    // Degraded as well; unhealthy unchanged keeps its transition time.
    let both = GpuConditions {
        degraded: ConditionState {
            active: true,
            reason: "ThermalThrottle".into(),
            message: "GPU-77aa: HW thermal slowdown".into(),
        },
        ..unhealthy.clone()
    };
    let ltt = c.last_transition_time.clone();
    e.ops.set_gpu_conditions(&both).await.expect("degraded");
    assert_eq!(
        condition(&e, "GPUDegraded").await.map(|c| c.status),
        Some("True".into())
    );
    assert_eq!(
        condition(&e, "GPUUnhealthy")
            .await
            .and_then(|c| c.last_transition_time),
        ltt
    );
    assert_eq!(taints(&e).await.len(), 1, "taint added once");

    // Recovered: conditions go False with a new transition time, the taint goes.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    e.ops
        .set_gpu_conditions(&GpuConditions::default())
        .await
        .expect("recovered");
    let c = condition(&e, "GPUUnhealthy").await.expect("still shown");
    assert_eq!(c.status, "False");
    assert!(c.reason.is_none() && c.message.is_none(), "{c:?}");
    assert_ne!(c.last_transition_time, ltt);
    assert_eq!(
        condition(&e, "GPUDegraded").await.map(|c| c.status),
        Some("False".into())
    );
    assert!(taints(&e).await.is_empty());
    assert_eq!(condition(&e, "Ready").await, Some(ready_before));

    let reasons: Vec<String> = e.k.events().await.into_iter().map(|ev| ev.reason).collect();
    assert_eq!(reasons, vec!["GPUUnhealthy", "GPUDegraded", "GPURecovered"]);
}

// === exact request shapes (tower-test) ===

mod verifier {
    use super::*;
    use http::{Request, Response};
    use http_body_util::BodyExt;
    use kube::client::Body;

    pub type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

    pub fn client() -> (kube::Client, Handle) {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        (kube::Client::new(service, "default"), handle)
    }

    pub struct Exchange {
        pub method: String,
        pub uri: String,
        pub content_type: Option<String>,
        pub body: Value,
        send: tower_test::mock::SendResponse<Response<Body>>,
    }

    impl Exchange {
        pub fn reply(self, code: u16, body: Value) {
            let resp = Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string().into_bytes()));
            match resp {
                Ok(r) => self.send.send_response(r),
                Err(e) => panic!("building a response: {e}"),
            }
        }
    }

    /// The next request, within a generous timeout (a missing call fails the test).
    pub async fn next(handle: &mut Handle) -> Exchange {
        let (req, send) = tokio::time::timeout(Duration::from_secs(10), handle.next_request())
            .await
            .expect("the client made the expected request in time")
            .expect("the client is still alive");
        let (parts, body) = req.into_parts();
        let bytes = body.collect().await.expect("request body").to_bytes();
        Exchange {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            content_type: parts
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            body: if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("JSON body")
            },
            send,
        }
    }

    pub fn node_json(rv: &str, spec: Value) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": NODE, "uid": "node-uid-1", "resourceVersion": rv },
            "spec": spec,
            "status": { "conditions": [{ "type": "Ready", "status": "True" }] }
        })
    }
}

fn verifier_ops(client: kube::Client) -> KubeNodeOps {
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    KubeNodeOps::new(client, NODE.to_string(), None, false, metrics)
}

#[tokio::test]
async fn cordon_and_taint_is_one_merge_patch_with_the_resource_version() {
    let (client, mut handle) = verifier::client();
    let ops = verifier_ops(client);
    let task = tokio::spawn(async move { ops.protect(&interruption()).await });

    let get = verifier::next(&mut handle).await;
    assert_eq!(
        (get.method.as_str(), get.uri.as_str()),
        ("GET", "/api/v1/nodes/gpu-node-1")
    );
    get.reply(200, verifier::node_json("4711", json!({})));

    let patch = verifier::next(&mut handle).await;
    assert_eq!(patch.method, "PATCH");
    assert_eq!(
        patch.uri,
        "/api/v1/nodes/gpu-node-1?&fieldManager=spotguard"
    );
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    assert_eq!(
        patch.body,
        json!({
            "metadata": {
                "resourceVersion": "4711",
                "annotations": {
                    "spotguard.io/applied": r#"{"cordoned":true,"taints":["NoSchedule"]}"#
                }
            },
            "spec": {
                "unschedulable": true,
                "taints": [{ "key": "spotguard.io/interruption", "value": "interruption", "effect": "NoSchedule" }]
            }
        })
    );
    patch.reply(
        200,
        verifier::node_json("4712", json!({ "unschedulable": true })),
    );
    let applied = task.await.expect("task").expect("protect");
    assert!(applied.cordoned);
}

#[tokio::test]
async fn drain_lists_by_field_selector_evicts_with_a_policy_v1_body_and_retries_429() {
    let (client, mut handle) = verifier::client();
    let ops = verifier_ops(client);
    let task = tokio::spawn(async move { ops.drain(&drain_request(in_secs(60))).await });

    let list = verifier::next(&mut handle).await;
    assert_eq!(list.method, "GET");
    assert_eq!(
        list.uri,
        "/api/v1/pods?&fieldSelector=spec.nodeName%3Dgpu-node-1"
    );
    let pod = TestPod::new("team-a", "trainer-0", NODE)
        .grace_period(600)
        .build();
    let mut pod_json = serde_json::to_value(&pod).expect("pod json");
    pod_json["metadata"]["uid"] = json!("pod-uid-1");
    list.reply(
        200,
        json!({ "apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [pod_json] }),
    );

    let evict = verifier::next(&mut handle).await;
    assert_eq!(evict.method, "POST");
    assert_eq!(
        evict.uri,
        "/api/v1/namespaces/team-a/pods/trainer-0/eviction?"
    );
    assert_eq!(evict.content_type.as_deref(), Some("application/json"));
    let grace = evict.body["deleteOptions"]["gracePeriodSeconds"]
        .as_i64()
        .expect("grace");
    assert!((55..=58).contains(&grace), "600 s capped to ~58: {grace}");
    assert_eq!(
        evict.body,
        json!({
            "apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": { "name": "trainer-0", "namespace": "team-a" },
            "deleteOptions": { "gracePeriodSeconds": grace, "preconditions": { "uid": "pod-uid-1" } }
        })
    );
    // What the API server answers when a PDB refuses.
    evict.reply(
        429,
        json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "Cannot evict pod as it would violate the pod's disruption budget.",
            "reason": "TooManyRequests",
            "details": { "causes": [{ "reason": "DisruptionBudget",
                "message": "The disruption budget trainer-pdb needs 1 healthy pods and has 1 currently" }] },
            "code": 429
        }),
    );
    let retry = verifier::next(&mut handle).await;
    assert_eq!(
        retry.uri,
        "/api/v1/namespaces/team-a/pods/trainer-0/eviction?"
    );
    retry.reply(
        201,
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success" }),
    );

    let poll = verifier::next(&mut handle).await;
    assert_eq!(
        (poll.method.as_str(), poll.uri.as_str()),
        ("GET", "/api/v1/namespaces/team-a/pods/trainer-0")
    );
    poll.reply(
        404,
        json!({ "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "pods \"trainer-0\" not found", "reason": "NotFound", "code": 404 }),
    );
    let report = task.await.expect("task").expect("drain");
    assert_eq!(report.evicted, vec!["team-a/trainer-0".to_string()]);
    assert!(report.complete());
}

#[tokio::test]
async fn gpu_condition_is_a_strategic_status_patch_with_only_spotguards_types() {
    let (client, mut handle) = verifier::client();
    let ops = verifier_ops(client);
    let desired = GpuConditions {
        unhealthy: ConditionState::default(),
        degraded: ConditionState {
            active: true,
            reason: "NvlinkErrors".into(),
            message: "GPU-1: NVLink CRC errors rising".into(),
        },
    };
    let task = tokio::spawn(async move { ops.set_gpu_conditions(&desired).await });
    let get = verifier::next(&mut handle).await;
    assert_eq!(get.uri, "/api/v1/nodes/gpu-node-1");
    get.reply(200, verifier::node_json("10", json!({})));

    let patch = verifier::next(&mut handle).await;
    assert_eq!(patch.method, "PATCH");
    assert_eq!(
        patch.uri,
        "/api/v1/nodes/gpu-node-1/status?&fieldManager=spotguard"
    );
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/strategic-merge-patch+json")
    );
    let conds = patch.body["status"]["conditions"]
        .as_array()
        .expect("conditions list")
        .clone();
    assert_eq!(
        conds.len(),
        1,
        "only the changed condition, never the kubelet's: {conds:?}"
    );
    assert_eq!(conds[0]["type"], "GPUDegraded");
    assert_eq!(conds[0]["status"], "True");
    assert_eq!(conds[0]["reason"], "NvlinkErrors");
    assert!(conds[0]["lastTransitionTime"].is_string());
    patch.reply(200, verifier::node_json("11", json!({})));

    // Degraded alone is no reason to taint; the transition is announced.
    let event = verifier::next(&mut handle).await;
    assert_eq!(event.method, "POST");
    assert_eq!(
        event.uri,
        "/apis/events.k8s.io/v1/namespaces/default/events?"
    );
    assert_eq!(event.body["reason"], "GPUDegraded");
    assert_eq!(event.body["type"], "Warning");
    assert_eq!(
        event.body["regarding"],
        json!({ "apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1" })
    );
    assert_eq!(event.body["reportingController"], "spotguard.io/agent");
    let echo = event.body.clone();
    event.reply(201, echo);
    task.await.expect("task").expect("conditions");
}

// === the own-node policy: Events ===

/// An Event body of either API group, as the attacker writes it (raw JSON: every field its own).
fn forged_event(api: &str, name: &str, node: &str, instance: &str) -> Value {
    let now = Timestamp::now().to_string();
    if api == "core" {
        json!({
            "apiVersion": "v1", "kind": "Event",
            "metadata": { "name": name, "namespace": "default" },
            "involvedObject": { "apiVersion": "v1", "kind": "Node", "name": node },
            "reason": "SpotInterruption", "type": "Warning", "message": "forged",
            "source": { "component": "spotguard.io/agent", "host": node },
            "reportingComponent": "spotguard.io/agent", "reportingInstance": instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        })
    } else {
        json!({
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            "metadata": { "name": name, "namespace": "default" },
            "regarding": { "apiVersion": "v1", "kind": "Node", "name": node },
            "reason": "SpotInterruption", "type": "Warning", "note": "forged", "action": "Protect",
            "reportingController": "spotguard.io/agent", "reportingInstance": instance,
            "eventTime": Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
        })
    }
}

/// Create `body` as `client` (core/v1 or events.k8s.io/v1 by its apiVersion).
async fn create_event(client: &kube::Client, body: &Value) -> Result<(), String> {
    let core = body["apiVersion"] == "v1";
    let (group, version, resource) = if core {
        ("", "v1", "events")
    } else {
        ("events.k8s.io", "v1", "events")
    };
    let gvk = kube::api::GroupVersionKind::gvk(group, version, "Event");
    let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, resource);
    let api: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(client.clone(), "default", &ar);
    let obj: kube::api::DynamicObject = serde_json::from_value(body.clone()).unwrap();
    api.create(&kube::api::PostParams::default(), &obj)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Issue 42 item 2: a token bound to the agent's pod on node A writes the Events the agent
/// itself writes (about its node, about a pod, a repeat folded into its series), and is refused
/// — by the shipped policy — an Event about node B (either API group, B's `source.host`, B's
/// agent's reporting instance or its own) and a patch of B's agent's Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_bound_token_writes_events_only_about_its_own_node() {
    let k = TestCluster::new().await;
    let node_a = k.node(k.node_config("events-a")).await;
    let node_b = k.node(k.node_config("events-b")).await;
    let (a, b) = (node_a.name().to_string(), node_b.name().to_string());
    let team = k.namespace("team-a").await;
    let (_, client_a) = k.agent_on(&a).await;
    let (_, client_b) = k.agent_on(&b).await;
    let ops = |client: &kube::Client, node: &str| {
        let metrics = Arc::new(Metrics::register(&mut Registry::default()));
        KubeNodeOps::new(client.clone(), node.to_string(), None, false, metrics)
    };
    let (ops_a, ops_b) = (ops(&client_a, &a), ops(&client_b, &b));

    // What the agent writes, allowed: its node's Event twice (the second patches its series),
    // and an Event on a pod.
    let msg = "EC2 spot interruption: terminate at 2030-01-02T03:04:05Z";
    for _ in 0..2 {
        ops_a
            .event(EventType::Warning, reason::SPOT_INTERRUPTION, msg)
            .await
            .expect("its own node's Event");
    }
    let pod = spotguard::checkpoint::PodRef {
        namespace: team.clone(),
        name: "trainer-0".into(),
        uid: String::new(),
    };
    ops_a
        .pod_event(&pod, EventType::Normal, reason::CHECKPOINT_ACKED, "saved")
        .await
        .expect("an Event on a pod");
    ops_b
        .event(EventType::Warning, reason::SPOT_INTERRUPTION, msg)
        .await
        .expect("node B's agent's own Event");
    let events = k.events().await;
    let own = events
        .iter()
        .find(|e| e.regarding_name == a && e.reason == "SpotInterruption")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(own.count, 2, "the repeat patched its series: {own:?}");
    let theirs = events
        .iter()
        .find(|e| e.regarding_name == b)
        .unwrap_or_else(|| panic!("{events:?}"))
        .clone();

    // Forgeries, refused by the policy (not by RBAC: the ClusterRole grants events create and
    // patch in both groups, cluster-wide).
    let refused = |what: &str, r: Result<(), String>| {
        let e = r.expect_err(what);
        assert!(
            e.contains("spotguard-own-node") && e.contains(&a),
            "{what}: {e}"
        );
    };
    let instance = |node: &str| format!("spotguard.io/agent-{node}");
    for api in ["core", "events"] {
        for (n, inst) in [(0, instance(&b)), (1, instance(&a))] {
            let body = forged_event(api, &format!("{b}.forged-{api}-{n}"), &b, &inst);
            refused(
                &format!("{api} Event about node B as {inst}"),
                create_event(&client_a, &body).await,
            );
        }
    }
    // Its own node, but another node's reporting instance (core: the source host).
    refused(
        "an Event about its node as node B's agent",
        create_event(
            &client_a,
            &forged_event("events", &format!("{a}.forged-as-b"), &a, &instance(&b)),
        )
        .await,
    );
    let mut core = forged_event("core", &format!("{a}.forged-host"), &a, &instance(&a));
    core["source"]["host"] = json!(b);
    refused(
        "a core Event with node B's source.host",
        create_event(&client_a, &core).await,
    );

    // Node B's agent's Event: its series patched by node A's token.
    let ev: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(client_a.clone(), "default");
    let patched = ev
        .patch(
            &theirs.name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&json!({
                "metadata": { "annotations": { "spotguard.io/save-seconds": "50000" } }
            })),
        )
        .await
        .map(drop)
        .map_err(|e| e.to_string());
    refused("a patch of node B's agent's Event", patched);
    let events = k.events().await;
    assert!(
        events
            .iter()
            .all(|e| !e.raw.to_string().contains("forged") && !e.message.contains("50000")),
        "{events:?}"
    );
}
