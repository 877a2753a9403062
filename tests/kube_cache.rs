//! The watch-fed pod cache behind Kubernetes-mode discovery, against the in-process API server:
//! once synced, a notice's discovery makes no API request at all (the server may be blackholed);
//! the watch keeps it current (new, changed and deleted pods); a bad annotation is reported with
//! an Event when the pod is seen; a cache that never synced falls back to one bounded list.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::kube_discovery::{Defaults, KubeDiscovery, FALLBACK_LIST_TIMEOUT};
use spotguard::checkpoint::{Error, TargetDiscovery};
use spotguard::metrics::Metrics;
use spotguard::node::kube::KubeNodeOps;
use spotguard_testkit::apiserver::{test_node, FakeApiServer, Fault, RequestKind, TestPod};
use tokio_util::sync::CancellationToken;

const NODE: &str = "gpu-node-1";

fn pod(name: &str, node: &str, annotations: &[(&str, &str)]) -> Pod {
    let mut p = TestPod::new("ml", name, node).build();
    let ann: BTreeMap<String, String> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    p.metadata.annotations = Some(ann);
    p
}

const OPT_IN: (&str, &str) = ("spotguard.io/checkpoint", "true");

fn discovery(api: &FakeApiServer) -> Arc<KubeDiscovery> {
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    let node = Arc::new(KubeNodeOps::new(
        api.client(),
        NODE.to_string(),
        None,
        false,
        metrics.clone(),
    ));
    Arc::new(KubeDiscovery::new(
        api.client(),
        NODE.to_string(),
        node,
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

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_cache_needs_no_api_round_trip_and_follows_the_watch() {
    let api = FakeApiServer::start().await.unwrap();
    api.add_node(test_node(NODE));
    api.add_pod(pod("trainer-a", NODE, &[OPT_IN]));
    api.add_pod(pod("not-opted-in", NODE, &[]));
    api.add_pod(pod("elsewhere", "other-node", &[OPT_IN]));
    let d = discovery(&api);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(d.clone().keep_warm(cancel.clone()));
    eventually("cache synced", || async { d.synced() }).await;
    // The watch uses the field selector, from the list's resourceVersion.
    let watch = api
        .requests()
        .into_iter()
        .find(|r| r.query_param("watch").as_deref() == Some("true"))
        .expect("a watch request");
    assert_eq!(
        watch.query_param("fieldSelector").as_deref(),
        Some("spec.nodeName=gpu-node-1")
    );
    assert!(watch.query_param("resourceVersion").is_some());

    // Every new request now goes nowhere: discovery must not need one.
    api.clear_requests();
    api.set_fault(None, Some(Fault::Blackhole));
    let started = Instant::now();
    assert_eq!(names(&d).await, vec!["ml/trainer-a".to_string()]);
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "{:?}",
        started.elapsed()
    );
    assert!(api.requests().is_empty(), "{:?}", api.requests());
    api.clear_faults();

    // The established watch keeps the cache current.
    api.add_pod(pod("trainer-b", NODE, &[OPT_IN]));
    eventually("new pod seen", || async {
        names(&d).await == vec!["ml/trainer-a".to_string(), "ml/trainer-b".to_string()]
    })
    .await;
    api.set_pod_phase("ml", "trainer-a", "Succeeded");
    eventually("finished pod dropped", || async {
        names(&d).await == vec!["ml/trainer-b".to_string()]
    })
    .await;
    api.remove_pod("ml", "trainer-b");
    eventually("deleted pod dropped", || async {
        names(&d).await.is_empty()
    })
    .await;

    // A bad annotation is reported when the pod is seen, with an Event on the pod.
    api.add_pod(pod(
        "bad",
        NODE,
        &[OPT_IN, ("spotguard.io/checkpoint-signal", "SIGKILL")],
    ));
    eventually("Warning event for the bad pod", || async {
        api.events()
            .iter()
            .any(|e| e.regarding_name == "bad" && e.type_ == "Warning")
    })
    .await;
    assert!(names(&d).await.is_empty());
    cancel.cancel();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_synced_cache_falls_back_to_one_bounded_list() {
    let api = FakeApiServer::start().await.unwrap();
    api.add_node(test_node(NODE));
    api.add_pod(pod("trainer-a", NODE, &[OPT_IN]));
    api.set_fault(None, Some(Fault::Blackhole));
    let d = discovery(&api);
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
    api.clear_faults();
    api.set_fault(Some(RequestKind::PodWatch), Some(Fault::Blackhole));
    api.set_fault(
        Some(RequestKind::PodList),
        Some(Fault::Delay(Duration::from_millis(100))),
    );
    let d2 = discovery(&api);
    assert_eq!(names(&d2).await, vec!["ml/trainer-a".to_string()]);
    cancel.cancel();
    task.await.unwrap();
}
