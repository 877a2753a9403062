//! A small fleet against the real API server, the CI-sized guard of what the fleet bench
//! (`benches/fleet.rs`, `bench/fleet.sh`) measures at N ≥ 100: 4 nodes served by one kubelet
//! stand-in (`Fleet`), each with spotguard as the DaemonSet runs it (`spotguard run` and
//! `spotguard prefetch-serve` as their own processes with the shipped capabilities, as the
//! shipped ServiceAccount through fault proxies that log every request, and the node's own EC2
//! metadata emulator).
//!
//! - Idle, the fleet stays within the API budget: at most 0.1 requests/s per node beyond its
//!   watches, with the prefetcher's round every second, so a list (or anything else) per round
//!   shows at once.
//! - A spot interruption's drain asks nothing per pod while the agent's pod watch is healthy:
//!   no pod GET between the notice and the node drained, nor for the badput Event after it.
//!
//! `SPOTGUARD_FLEET_BIN` runs another build of `spotguard` (to compare builds).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodSecurityContext};
use spotguard::emulator::EmulatedNotice;
use spotguard_testkit::k8s::agents::{AgentSpec, NodeAgent};
use spotguard_testkit::k8s::{
    FaultProxy, Fleet, Identity, RecordedRequest, RequestKind, TestCluster, TestPod,
};
use spotguard_testkit::wait::eventually;

const NODES: usize = 4;
/// The idle window the budget is checked over.
const IDLE: Duration = Duration::from_secs(6);
/// Requests per second per node beyond its watches (issue 20's target).
const BUDGET: f64 = 0.1;

fn bin() -> PathBuf {
    std::env::var_os("SPOTGUARD_FLEET_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_spotguard")))
}

/// Requests of `kinds` for this node's pods (field selector `spec.nodeName`).
fn pod_requests_of(requests: &[RecordedRequest], node: &str, kinds: &[RequestKind]) -> usize {
    let selector = format!("spec.nodeName={node}");
    requests
        .iter()
        .filter(|r| kinds.contains(&r.kind))
        .filter(|r| r.query_param("fieldSelector").as_deref() == Some(selector.as_str()))
        .count()
}

fn not_watches(requests: &[RecordedRequest]) -> Vec<String> {
    requests
        .iter()
        .filter(|r| r.query_param("watch").as_deref() != Some("true"))
        .map(|r| format!("{} {}?{}", r.method, r.path, r.query))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_fleet_stays_in_its_api_budget_and_drains_without_polling() {
    let k = TestCluster::new().await;
    let prefetch_proxy = FaultProxy::start(k.cp).await.expect("proxy");
    let fleet: Fleet = k
        .fleet(
            (0..NODES)
                .map(|i| k.node_config(&format!("fleet-{i}")))
                .collect(),
        )
        .await;
    let nodes: Vec<String> = fleet.names().to_vec();
    let ml = k.namespace("ml").await;

    // Node 0 runs a real trainer (uid 1000, catches SIGUSR1 and exits) and three pods that
    // take 2 s to stop; the others, two simulated pods each.
    let ckpt = tempfile::tempdir().unwrap();
    let mut trainer = TestPod::new(&ml, "trainer-0", &nodes[0])
        .annotation("spotguard.io/checkpoint", "true")
        .annotation(
            "spotguard.io/checkpoint-dir",
            &ckpt.path().display().to_string(),
        )
        .script("trap 'exit 0' USR1; while :; do sleep 0.1; done")
        .build();
    if let Some(spec) = trainer.spec.as_mut() {
        spec.restart_policy = Some("Never".into());
        spec.security_context = Some(PodSecurityContext {
            run_as_user: Some(1000),
            run_as_group: Some(1000),
            ..Default::default()
        });
    }
    let mut pods: Vec<Pod> = vec![trainer];
    for (i, node) in nodes.iter().enumerate() {
        let n = if i == 0 { 3 } else { 2 };
        for j in 0..n {
            pods.push(
                TestPod::new(&ml, &format!("w-{i}-{j}"), node)
                    .simulated(Some(Duration::from_secs(2)))
                    .grace_period(30)
                    .build(),
            );
        }
    }
    k.run_many_pods(&pods, 8).await;

    let dir = tempfile::tempdir().unwrap();
    let agent_kc = dir.path().join("agent.kubeconfig");
    std::fs::write(&agent_kc, k.agent_kubeconfig()).unwrap();
    let prefetch_kc = dir.path().join("prefetch.kubeconfig");
    std::fs::write(
        &prefetch_kc,
        k.cp.kubeconfig(&prefetch_proxy.url(), Identity::Agent),
    )
    .unwrap();
    let mut agents = Vec::new();
    for node in &nodes {
        let mut spec = AgentSpec::new(bin(), node, &agent_kc);
        spec.prefetch_kubeconfig = Some(prefetch_kc.clone());
        // A round every second: a request per round would stand out.
        spec.annotation_interval = Duration::from_secs(1);
        agents.push(NodeAgent::start(&spec).await.expect("agent"));
    }
    // Settled: each agent's pod cache watches this node's pods, and each prefetcher has read
    // them.
    eventually(
        "every agent's pod watch open",
        Duration::from_secs(30),
        || async {
            let a = k.proxy().requests();
            let p = prefetch_proxy.requests();
            let any = [RequestKind::PodList, RequestKind::PodWatch];
            nodes.iter().all(|n| {
                pod_requests_of(&a, n, &[RequestKind::PodWatch]) >= 1
                    && pod_requests_of(&p, n, &any) >= 1
            })
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Idle.
    k.proxy().clear_requests();
    prefetch_proxy.clear_requests();
    let started = Instant::now();
    tokio::time::sleep(IDLE).await;
    let secs = started.elapsed().as_secs_f64();
    let mut idle = not_watches(&k.proxy().requests());
    idle.extend(not_watches(&prefetch_proxy.requests()));
    let per_node = idle.len() as f64 / NODES as f64 / secs;
    assert!(
        per_node <= BUDGET,
        "{per_node:.3} requests/s per node beyond watches over {secs:.1} s (budget {BUDGET}): {idle:#?}"
    );
    for a in &mut agents {
        assert!(a.running(), "{} stopped: {}", a.node, a.log());
    }

    // A spot interruption on node 0: the drain learns from the watch when each pod is gone.
    k.proxy().clear_requests();
    agents[0]
        .emulator
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(120)))
        .expect("raise");
    let noticed = Instant::now();
    eventually("node 0 drained", Duration::from_secs(40), || async {
        k.pods_in(&[&ml])
            .await
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&nodes[0]))
            .all(|p| {
                matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                ) && p.metadata.deletion_timestamp.is_none()
            })
    })
    .await;
    let drained_in = noticed.elapsed();
    // The agent records the drain on the node.
    eventually("plan recorded drained", Duration::from_secs(20), || async {
        let node = k.node_json(&nodes[0]).await;
        let state = node["metadata"]["annotations"]["spotguard.io/notice"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        state.contains("\"phase\":\"drained\"") || state.contains("\"phase\":\"done\"")
    })
    .await;
    // And posts the trainer's badput Event, naming its controller from the watch, not from a
    // GET of a pod the drain just deleted.
    eventually(
        "the trainer's badput Event",
        Duration::from_secs(20),
        || async {
            k.events().await.iter().any(|e| {
                e.reason == spotguard::outcome::reason::BADPUT && e.regarding_name == "trainer-0"
            })
        },
    )
    .await;
    let requests = k.proxy().requests();
    let evictions = requests
        .iter()
        .filter(|r| r.kind == RequestKind::Eviction)
        .count();
    let gets: Vec<String> = requests
        .iter()
        .filter(|r| r.kind == RequestKind::PodGet)
        .map(|r| r.path.clone())
        .collect();
    assert_eq!(evictions, 3, "{:#?}", not_watches(&requests));
    assert!(
        gets.is_empty(),
        "the drain polled pods while its watch was healthy (drained in {drained_in:?}): {gets:#?}"
    );
    assert!(
        std::fs::read_dir(ckpt.path())
            .unwrap()
            .flatten()
            .any(|e| e.file_name() == "notice.json"),
        "the trainer got no notice.json"
    );
    for a in &mut agents {
        assert!(a.running(), "{} stopped: {}", a.node, a.log());
    }
    drop(agents);
    drop(fleet);
}
