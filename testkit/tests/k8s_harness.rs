//! The real control plane harness itself: the kubelet stand-in runs pods as real processes and
//! reports what they do; deletion follows the kubelet's SIGTERM → grace → SIGKILL; the agent's
//! identity has exactly the shipped permissions; the fault proxy does what it is told.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams};
use spotguard_testkit::k8s::{Fault, RequestKind, TestCluster, TestPod};

fn exit_code(p: &Pod, container: &str) -> Option<i32> {
    p.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name == container)?
        .state
        .as_ref()?
        .terminated
        .as_ref()
        .map(|t| t.exit_code)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_run_as_processes_and_report_their_exit_codes() {
    let k = TestCluster::new().await;
    let ns = k.namespace("harness").await;
    let node = k.node(k.node_config("node")).await;
    k.run_pods(&[
        TestPod::new(&ns, "sleeper", node.name()).build(),
        TestPod::new(&ns, "done", node.name())
            .phase("Succeeded")
            .build(),
        TestPod::new(&ns, "broken", node.name())
            .phase("Failed")
            .build(),
    ])
    .await;
    let sleeper = k.pod(&ns, "sleeper").await.unwrap();
    let status = sleeper.status.unwrap();
    let cs = &status.container_statuses.unwrap()[0];
    let run = node.run_of(&ns, "sleeper", "main").expect("started");
    assert_eq!(
        cs.container_id.as_deref(),
        Some(&*format!("containerd://{}", run.container_id))
    );
    let cgroup = std::fs::read_to_string(format!("/proc/{}/cgroup", run.pid)).unwrap();
    let uid = sleeper.metadata.uid.unwrap().replace('-', "_");
    assert!(
        cgroup.contains(&format!(
            "pod{uid}.slice/cri-containerd-{}.scope",
            run.container_id
        )),
        "{cgroup}"
    );
    let done = k.pod(&ns, "done").await.unwrap();
    assert_eq!(
        done.status.as_ref().unwrap().phase.as_deref(),
        Some("Succeeded")
    );
    assert_eq!(exit_code(&done, "main"), Some(0));
    let broken = k.pod(&ns, "broken").await.unwrap();
    assert_eq!(
        broken.status.as_ref().unwrap().phase.as_deref(),
        Some("Failed")
    );
    assert_eq!(exit_code(&broken, "main"), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_is_sigterm_then_the_grace_period_then_sigkill_then_grace_zero() {
    let k = TestCluster::new().await;
    let ns = k.namespace("harness").await;
    let node = k.node(k.node_config("node")).await;
    k.run_pods(&[
        TestPod::new(&ns, "polite", node.name())
            .terminates_after(Duration::from_millis(1500))
            .build(),
        TestPod::new(&ns, "stubborn", node.name())
            .grace_period(2)
            .script("trap '' TERM; while :; do sleep 0.05; done")
            .build(),
    ])
    .await;
    let pods: Api<Pod> = Api::namespaced(k.admin(), &ns);
    let started = Instant::now();
    pods.delete("polite", &DeleteParams::default())
        .await
        .unwrap();
    pods.delete("stubborn", &DeleteParams::default())
        .await
        .unwrap();
    // Terminating (deletionTimestamp) while the process shuts down.
    let p = k
        .pod(&ns, "polite")
        .await
        .expect("still there while terminating");
    assert!(p.metadata.deletion_timestamp.is_some());
    k.wait_pod(&ns, "polite", "gone", Duration::from_secs(20), |p| {
        p.is_none()
    })
    .await;
    let polite = started.elapsed();
    assert!(polite >= Duration::from_millis(1400), "{polite:?}");
    k.wait_pod(&ns, "stubborn", "gone", Duration::from_secs(20), |p| {
        p.is_none()
    })
    .await;
    let stubborn = started.elapsed();
    assert!(
        stubborn >= Duration::from_secs(2) && stubborn < Duration::from_secs(8),
        "{stubborn:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_identity_has_the_shipped_permissions_only() {
    let k = TestCluster::new().await;
    let ns = k.namespace("harness").await;
    let node = k.node(k.node_config("node")).await;
    k.run_pods(&[TestPod::new(&ns, "victim", node.name()).build()])
        .await;
    let agent: Api<Pod> = Api::namespaced(k.agent_client(), &ns);
    match agent.delete("victim", &DeleteParams::default()).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("the base role may not delete pods: {other:?}"),
    }
    agent
        .evict("victim", &EvictParams::default())
        .await
        .expect("evictions are allowed");
    k.wait_pod(&ns, "victim", "evicted", Duration::from_secs(30), |p| {
        p.is_none()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_delays_blackholes_and_fails_per_request_kind() {
    let k = TestCluster::new().await;
    let ns = k.namespace("harness").await;
    let pods: Api<Pod> = Api::namespaced(k.agent_client(), &ns);
    k.proxy().set_fault(
        Some(RequestKind::PodList),
        Some(Fault::Delay(Duration::from_millis(300))),
    );
    let t = Instant::now();
    pods.list(&Default::default()).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    k.proxy()
        .set_fault(Some(RequestKind::PodList), Some(Fault::Blackhole));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), pods.list(&Default::default()))
            .await
            .is_err()
    );
    k.proxy().clear_faults();
    k.proxy().fail_next(RequestKind::PodGet, 500, 1);
    match pods.get("nothing").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 500),
        other => panic!("{other:?}"),
    }
    match pods.get("nothing").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 404, "the real server answers again"),
        other => panic!("{other:?}"),
    }
    let kinds: Vec<RequestKind> = k.proxy().requests().iter().map(|r| r.kind).collect();
    assert_eq!(
        kinds,
        vec![
            RequestKind::PodList,
            RequestKind::PodList,
            RequestKind::PodGet,
            RequestKind::PodGet
        ]
    );
}

/// A pod wait that times out says what it waited for and how the pod looked last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_wait_that_times_out_says_how_the_pod_looked() {
    let k = std::sync::Arc::new(TestCluster::new().await);
    let ns = k.namespace("harness").await;
    let waited = {
        let (k, ns) = (k.clone(), ns.clone());
        tokio::spawn(async move {
            k.wait_pod(&ns, "never", "running", Duration::from_millis(200), |p| {
                p.is_some()
            })
            .await
        })
    };
    let panic = waited.await.expect_err("the wait times out").into_panic();
    let text = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        text.contains(&format!("pod {ns}/never: running; last seen: absent")),
        "{text}"
    );
}
