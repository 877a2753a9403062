//! The watch-fed pod cache behind Kubernetes-mode discovery, against the real API server
//! (through the fault proxy, as the shipped ServiceAccount): once synced, a notice's discovery
//! makes no API request at all (the server may be blackholed); the watch keeps it current (new,
//! finished and deleted pods); a bad annotation is reported with an Event when the pod is seen;
//! a cache that never synced falls back to one bounded list. The drain waits on the same watch
//! for evicted pods to go, without a request per pod while the watch is healthy, and asks the
//! API server while it is not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use prometheus_client::registry::Registry;
use spotguard::checkpoint::kube_discovery::{Defaults, KubeDiscovery, FALLBACK_LIST_TIMEOUT};
use spotguard::checkpoint::{Error, TargetDiscovery};
use spotguard::metrics::Metrics;
use spotguard::node::kube::KubeNodeOps;
use spotguard::node::{DrainRequest, NodeOps, DEFAULT_DRAIN_CONCURRENCY};
use spotguard_testkit::k8s::{Fault, FaultProxy, Identity, RequestKind, TestCluster, TestPod};
use spotguard_testkit::wait::eventually;
use tokio_util::sync::CancellationToken;

fn pod(ns: &str, name: &str, node: &str, annotations: &[(&str, &str)]) -> TestPod {
    annotations
        .iter()
        .fold(TestPod::new(ns, name, node), |p, (k, v)| p.annotation(k, v))
}

const OPT_IN: (&str, &str) = ("spotguard.io/checkpoint", "true");

fn discovery(k: &TestCluster, node: &str) -> Arc<KubeDiscovery> {
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    let ops = Arc::new(KubeNodeOps::new(
        k.agent_client(),
        node.to_string(),
        None,
        false,
        metrics.clone(),
    ));
    Arc::new(KubeDiscovery::new(
        k.agent_client(),
        node.to_string(),
        ops,
        Defaults {
            signal: spotguard::checkpoint::Signal::USR1,
            timeout: Duration::from_secs(30),
        },
        "/proc".into(),
        metrics,
    ))
}

async fn names(d: &KubeDiscovery) -> Vec<String> {
    let mut n: Vec<String> = d
        .discover()
        .await
        .unwrap()
        .into_iter()
        .map(|g| g.name)
        .collect();
    n.sort();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_cache_needs_no_api_round_trip_and_follows_the_watch() {
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let other = k.node(k.node_config("other-node")).await;
    let ml = k.namespace("ml").await;
    let done = tempfile::tempdir().unwrap();
    k.run_pods(&[
        pod(&ml, "trainer-a", node.name(), &[OPT_IN])
            .completes_when_exists(&done.path().join("trainer-a"))
            .build(),
        pod(&ml, "not-opted-in", node.name(), &[]).build(),
        pod(&ml, "elsewhere", other.name(), &[OPT_IN]).build(),
    ])
    .await;
    let d = discovery(&k, node.name());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(d.clone().keep_warm(cancel.clone()));
    eventually("cache synced", Duration::from_secs(10), || async {
        d.synced()
    })
    .await;
    // The watch uses the field selector, from the list's resourceVersion.
    let watch = k
        .proxy()
        .requests()
        .into_iter()
        .find(|r| r.query_param("watch").as_deref() == Some("true"))
        .expect("a watch request");
    assert_eq!(
        watch.query_param("fieldSelector"),
        Some(format!("spec.nodeName={}", node.name()))
    );
    assert!(watch.query_param("resourceVersion").is_some());

    // Every new request now goes nowhere: discovery must not need one.
    k.proxy().clear_requests();
    k.proxy().set_fault(None, Some(Fault::Blackhole));
    let started = Instant::now();
    assert_eq!(names(&d).await, vec![format!("{ml}/trainer-a")]);
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    assert!(
        k.proxy().requests().is_empty(),
        "{:?}",
        k.proxy().requests()
    );
    k.proxy().clear_faults();

    // The established watch keeps the cache current.
    k.run_pods(&[pod(&ml, "trainer-b", node.name(), &[OPT_IN]).build()])
        .await;
    eventually("new pod seen", Duration::from_secs(10), || async {
        names(&d).await == vec![format!("{ml}/trainer-a"), format!("{ml}/trainer-b")]
    })
    .await;
    // trainer-a's process completes: the kubelet reports Succeeded.
    std::fs::write(done.path().join("trainer-a"), b"").unwrap();
    eventually("finished pod dropped", Duration::from_secs(10), || async {
        names(&d).await == vec![format!("{ml}/trainer-b")]
    })
    .await;
    let pods: Api<Pod> = Api::namespaced(k.admin(), &ml);
    pods.delete("trainer-b", &DeleteParams::default())
        .await
        .unwrap();
    eventually("deleted pod dropped", Duration::from_secs(10), || async {
        names(&d).await.is_empty()
    })
    .await;

    // A bad annotation is reported when the pod is seen, with an Event on the pod.
    k.run_pods(&[pod(
        &ml,
        "bad",
        node.name(),
        &[OPT_IN, ("spotguard.io/checkpoint-signal", "SIGKILL")],
    )
    .build()])
        .await;
    eventually(
        "Warning event for the bad pod",
        Duration::from_secs(10),
        || async {
            k.events()
                .await
                .iter()
                .any(|e| e.regarding_name == "bad" && e.type_ == "Warning")
        },
    )
    .await;
    assert!(names(&d).await.is_empty());
    cancel.cancel();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_synced_cache_falls_back_to_one_bounded_list() {
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    k.run_pods(&[pod(&ml, "trainer-a", node.name(), &[OPT_IN]).build()])
        .await;
    k.proxy().set_fault(None, Some(Fault::Blackhole));
    let d = discovery(&k, node.name());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(d.clone().keep_warm(cancel.clone()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!d.synced());
    let started = Instant::now();
    let err = d.discover().await.unwrap_err();
    let took = started.elapsed();
    assert!(matches!(err, Error::ListPods(_)), "{err}");
    assert!(err.to_string().contains("never synced"), "{err}");
    assert!(
        took >= FALLBACK_LIST_TIMEOUT && took < FALLBACK_LIST_TIMEOUT + Duration::from_millis(500),
        "{took:?}"
    );
    // A slow (not silent) API server still answers the fallback list in time.
    k.proxy().clear_faults();
    k.proxy()
        .set_fault(Some(RequestKind::PodWatch), Some(Fault::Blackhole));
    k.proxy().set_fault(
        Some(RequestKind::PodList),
        Some(Fault::Delay(Duration::from_millis(100))),
    );
    let d2 = discovery(&k, node.name());
    assert_eq!(names(&d2).await, vec![format!("{ml}/trainer-a")]);
    cancel.cancel();
    task.await.unwrap();
}

// === the drain waits on the same watch ===

/// Node operations whose drain learns from `d` when an evicted pod is gone.
fn drain_ops(k: &TestCluster, node: &str, d: &Arc<KubeDiscovery>) -> KubeNodeOps {
    let ops = KubeNodeOps::new(
        k.agent_client(),
        node.to_string(),
        None,
        false,
        Arc::new(Metrics::register(&mut Registry::default())),
    );
    ops.set_pod_watch(d.clone());
    ops
}

fn drain_request(secs: u64) -> DrainRequest {
    DrainRequest {
        deadline: jiff::Timestamp::now() + Duration::from_secs(secs),
        force_delete_at_deadline: false,
        concurrency: DEFAULT_DRAIN_CONCURRENCY,
        holds: Vec::new(),
    }
}

fn pod_gets(k: &TestCluster) -> usize {
    k.proxy()
        .requests()
        .iter()
        .filter(|r| r.kind == RequestKind::PodGet)
        .count()
}

/// Pods that take a second to stop on SIGTERM.
async fn slow_pods(k: &TestCluster, ns: &str, node: &str, prefix: &str, n: usize) {
    let pods: Vec<Pod> = (0..n)
        .map(|i| {
            TestPod::new(ns, &format!("{prefix}-{i}"), node)
                .terminates_after(Duration::from_secs(1))
                .grace_period(10)
                .build()
        })
        .collect();
    k.run_pods(&pods).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_learns_from_the_watch_when_evicted_pods_are_gone() {
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    slow_pods(&k, &ml, node.name(), "worker", 4).await;
    let d = discovery(&k, node.name());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(d.clone().keep_warm(cancel.clone()));
    eventually("cache synced", Duration::from_secs(10), || async {
        d.healthy()
    })
    .await;
    let ops = drain_ops(&k, node.name(), &d);
    k.proxy().clear_requests();
    let started = Instant::now();
    let report = ops.drain(&drain_request(60)).await.expect("drain");
    let took = started.elapsed();
    assert!(report.complete(), "{report:?}");
    assert_eq!(report.evicted.len(), 4, "{report:?}");
    assert!(k.pods_in(&[&ml]).await.is_empty());
    // No request per pod while it terminates: the watch said when each was gone.
    assert_eq!(pod_gets(&k), 0, "{:#?}", k.proxy().requests());
    // …as soon as it was (the pods stop in about a second; an overdue check would come after
    // the 10 s grace period).
    assert!(took < Duration::from_secs(8), "{took:?}");
    cancel.cancel();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_watch_is_down_the_drain_asks_the_api_server() {
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    slow_pods(&k, &ml, node.name(), "first", 2).await;
    // The cache talks through a proxy of its own that refuses every pod list and watch.
    let cache_proxy = FaultProxy::start(k.cp).await.unwrap();
    cache_proxy.set_fault(Some(RequestKind::PodList), Some(Fault::Status(503)));
    cache_proxy.set_fault(Some(RequestKind::PodWatch), Some(Fault::Status(503)));
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    let cache_client = cache_proxy.client(k.cp, Identity::Agent);
    let d = Arc::new(KubeDiscovery::new(
        cache_client.clone(),
        node.name().to_string(),
        Arc::new(KubeNodeOps::new(
            cache_client,
            node.name().to_string(),
            None,
            false,
            metrics.clone(),
        )),
        Defaults {
            signal: spotguard::checkpoint::Signal::USR1,
            timeout: Duration::from_secs(30),
        },
        "/proc".into(),
        metrics,
    ));
    let cancel = CancellationToken::new();
    let task = tokio::spawn(d.clone().keep_warm(cancel.clone()));
    let ops = drain_ops(&k, node.name(), &d);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!d.healthy());
    k.proxy().clear_requests();
    let report = ops.drain(&drain_request(60)).await.expect("drain");
    assert!(report.complete(), "{report:?}");
    assert_eq!(report.evicted.len(), 2, "{report:?}");
    assert!(pod_gets(&k) >= 2, "{:#?}", k.proxy().requests());

    // The watch comes back: the next drain needs no GET again.
    cache_proxy.clear_faults();
    eventually("cache healthy", Duration::from_secs(10), || async {
        d.healthy()
    })
    .await;
    slow_pods(&k, &ml, node.name(), "second", 2).await;
    k.proxy().clear_requests();
    let report = ops.drain(&drain_request(60)).await.expect("drain");
    assert!(report.complete(), "{report:?}");
    assert_eq!(report.evicted.len(), 2, "{report:?}");
    assert_eq!(pod_gets(&k), 0, "{:#?}", k.proxy().requests());
    cancel.cancel();
    task.await.unwrap();
}
