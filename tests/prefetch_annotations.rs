//! Pod-requested prefetch (`spotguard.io/prefetch`) against the real API server (pods run by the
//! kubelet stand-in, read as the shipped ServiceAccount) and a real
//! S3-compatible server (s3s-fs, from `scripts/deps/prefetch.sh`): the operator's opt-in and
//! allow-list, refusals as Events and metrics, and agent-side leases that keep a dataset a pod
//! references from being evicted; the pods come from a watch, and no API request is made per
//! round. The prefetcher's store reads the AWS_* environment: the test
//! runs its scenario in a child of this binary started with that environment (setting it in a
//! running test would race every other thread reading the environment).

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload};
use prometheus_client::registry::Registry;
use spotguard::metrics::Metrics;
use spotguard::node::kube::KubeNodeOps;
use spotguard::prefetch::annotations::{
    AnnotationWatcher, Requests, PREFETCH_ANNOTATION, REFUSED_REASON,
};
use spotguard::prefetch::cache;
use spotguard::prefetch::policy::{AllowPattern, AnnotationPolicy};
use spotguard::prefetch::{
    DatasetState, PrefetchDefaults, PrefetchMetrics, Prefetcher, StoreOptions,
};
use spotguard_testkit::k8s::{RequestKind, TestCluster, TestPod};
use spotguard_testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};
use spotguard_testkit::wait::eventually;
use tokio_util::sync::CancellationToken;

fn store(endpoint: &str, bucket: &str) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region("us-east-1")
            .with_client_options(ClientOptions::new().with_allow_http(true))
            .build()
            .unwrap(),
    )
}

fn pod(ns: &str, name: &str, node: &str, annotation: &str) -> TestPod {
    TestPod::new(ns, name, node).annotation(PREFETCH_ANNOTATION, annotation)
}

/// Set in the child that runs a scenario with its environment.
const CHILD: &str = "SPOTGUARD_TEST_SCENARIO_CHILD";

/// Run test `name` of this binary in a child process with `env` (the scenario runs there, under
/// its own runtime), and require that it passed.
fn in_child_with_env(name: &str, env: &[(&str, &str)], scenario: impl std::future::Future) {
    if std::env::var_os(CHILD).is_some() {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(scenario);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let status = Command::new(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .envs(env.iter().copied())
        .env(CHILD, "1")
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the scenario {name} failed in its child: {status}"
    );
}

#[test]
fn pod_requests_are_opt_in_allow_listed_evented_and_keep_their_dataset_leased() {
    in_child_with_env(
        "pod_requests_are_opt_in_allow_listed_evented_and_keep_their_dataset_leased",
        &S3Server::client_env(),
        opt_in_allow_listed_evented_and_leased(),
    );
}

async fn opt_in_allow_listed_evented_and_leased() {
    let s3 = S3Server::s3s_fs(&["datasets", "private"]);
    let endpoint = s3.endpoint();
    let ds = store(&endpoint, "datasets");
    ds.put(
        &ObjectPath::from("tokenized/c4/shard-0"),
        PutPayload::from(vec![7u8; 100_000]),
    )
    .await
    .unwrap();

    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    let done = tempfile::tempdir().unwrap();
    k.run_pods(&[
        pod(&ml, "train", node.name(), "c4=s3://datasets/tokenized/c4/")
            .completes_when_exists(&done.path().join("train"))
            .build(),
        pod(
            &ml,
            "thief",
            node.name(),
            "tok=file:///var/run/secrets/kubernetes.io/serviceaccount",
        )
        .build(),
        pod(&ml, "other", node.name(), "s3://private/weights").build(),
    ])
    .await;

    let cache_dir = tempfile::tempdir().unwrap();
    let mut registry = Registry::default();
    let metrics = Arc::new(PrefetchMetrics::register(&mut registry));
    let prefetcher = Prefetcher::new(
        cache_dir.path().to_path_buf(),
        None,
        PrefetchDefaults {
            store: StoreOptions {
                endpoint: Some(endpoint.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
        metrics.clone(),
        CancellationToken::new(),
    );
    let events = Arc::new(KubeNodeOps::new(
        k.agent_client(),
        node.name().to_string(),
        None,
        false,
        Arc::new(Metrics::register(&mut Registry::default())),
    ));
    let watcher = |enabled: bool| AnnotationWatcher {
        pods: kube::Api::all(k.agent_client()),
        node_name: node.name().to_string(),
        prefetcher: prefetcher.clone(),
        policy: AnnotationPolicy {
            enabled,
            allow: vec![AllowPattern::parse("s3://datasets/tokenized").unwrap()],
        },
        events: events.clone(),
        metrics: metrics.clone(),
        interval: Duration::from_millis(200),
    };
    // Run a watcher until the returned token is cancelled; what it knows.
    let start = |w: AnnotationWatcher| {
        let requests = Arc::new(Requests::default());
        let cancel = CancellationToken::new();
        tokio::spawn(w.run(requests.clone(), cancel.clone()));
        (requests, cancel)
    };
    let refusals = |pod: &'static str| {
        let k = &k;
        async move {
            k.events()
                .await
                .into_iter()
                .filter(|e| e.reason == REFUSED_REASON && e.regarding_name == pod)
                .map(|e| e.message)
                .collect::<Vec<String>>()
        }
    };

    // Off (the default): every request is refused, with an Event on the pod.
    let (off, stop_off) = start(watcher(false));
    eventually("the first list", Duration::from_secs(30), || async {
        off.synced()
    })
    .await;
    assert!(off.referenced().is_empty());
    for p in ["train", "thief", "other"] {
        let msgs = refusals(p).await;
        assert_eq!(msgs.len(), 1, "{p}: {msgs:?}");
        assert!(msgs[0].contains("off on this node"), "{msgs:?}");
    }
    assert!(!cache_dir.path().join("c4").exists());
    stop_off.cancel();

    // On, with an allow-list: file:// and buckets outside the list refused, once per pod.
    let (on, _stop_on) = start(watcher(true));
    eventually("two rounds", Duration::from_secs(30), || async {
        on.synced() && on.rounds() >= 2
    })
    .await;
    assert_eq!(on.referenced().into_iter().collect::<Vec<_>>(), vec!["c4"]);
    let thief = refusals("thief").await;
    assert_eq!(thief.len(), 2, "{thief:?}");
    assert!(thief[1].contains("only s3:// and gs://"), "{thief:?}");
    let other = refusals("other").await;
    assert_eq!(other.len(), 2, "{other:?}");
    assert!(
        other[1].contains("not under any allowed prefix"),
        "{other:?}"
    );
    assert!(
        refusals("train").await.len() == 1,
        "the accepted request got no new refusal"
    );
    let text = spotguard::metrics::encode(&registry);
    for line in [
        "spotguard_prefetch_refused_total{reason=\"disabled\"} 3",
        "spotguard_prefetch_refused_total{reason=\"scheme\"} 1",
        "spotguard_prefetch_refused_total{reason=\"not_allowed\"} 1",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    // Nothing of the node leaked into the cache.
    assert!(!cache_dir.path().join("tok").exists());
    // Rounds ask the API server nothing: the pods come from the watch.
    let lists = |k: &TestCluster| {
        k.proxy()
            .requests()
            .iter()
            .filter(|r| matches!(r.kind, RequestKind::PodList | RequestKind::PodGet))
            .count()
    };
    let (before, rounds) = (lists(&k), on.rounds());
    eventually("five more rounds", Duration::from_secs(30), || async {
        on.rounds() >= rounds + 5
    })
    .await;
    assert_eq!(lists(&k), before, "a round listed or read pods");

    let st = tokio::time::timeout(Duration::from_secs(30), prefetcher.wait("c4"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st.state, DatasetState::Complete, "{st:?}");
    assert_eq!(
        std::fs::read(cache_dir.path().join("c4/shard-0")).unwrap(),
        vec![7u8; 100_000]
    );

    // A dataset in use by a pod on the node is not evicted: the prefetcher touches its lease
    // (the pod mounts the cache read-only and cannot).
    let window = Duration::from_secs(60);
    let lease = cache_dir.path().join("c4/.spotguard/lease");
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&lease)
        .or_else(|_| std::fs::File::create(&lease))
        .unwrap()
        .set_modified(old)
        .unwrap();
    let complete = cache_dir.path().join("c4/.spotguard/complete");
    std::fs::File::options()
        .write(true)
        .open(&complete)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let rounds = on.rounds();
    eventually("a lease round", Duration::from_secs(30), || async {
        on.rounds() >= rounds + 2
    })
    .await;
    let err = cache::make_room(cache_dir.path(), "new", 1 << 20, 1 << 20, window).unwrap_err();
    assert!(err.to_string().contains("cache full"), "{err}");
    assert!(cache_dir.path().join("c4/shard-0").exists());

    // The pod finishes: its request is forgotten, the lease ages, the dataset may go.
    std::fs::write(done.path().join("train"), b"").unwrap();
    k.wait_pod(&ml, "train", "Succeeded", Duration::from_secs(30), |p| {
        p.and_then(|p| p.status.as_ref()?.phase.as_deref()) == Some("Succeeded")
    })
    .await;
    eventually(
        "the finished pod forgotten",
        Duration::from_secs(30),
        || async { on.referenced().is_empty() },
    )
    .await;
    assert_eq!(on.pods(), 2, "finished pods leave the state");
    let rounds = on.rounds();
    eventually("a lease round", Duration::from_secs(30), || async {
        on.rounds() >= rounds + 2
    })
    .await;
    std::fs::File::options()
        .write(true)
        .open(&lease)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let report = cache::make_room(cache_dir.path(), "new", 1 << 20, 1 << 20, window).unwrap();
    assert_eq!(report.evicted, vec!["c4"]);
}

/// Issue 42 item 1: with `--allow=s3://private/{namespace}` a pod fetches only under its own
/// namespace's prefix, into a name of its namespace's own (`<namespace>--NAME`): a pod of
/// another namespace naming the first's prefix is refused, nothing is fetched for it, and its
/// request for the same NAME under its own prefix is a copy of its own, never the first's.
#[test]
fn a_pod_never_gets_another_namespaces_dataset() {
    in_child_with_env(
        "a_pod_never_gets_another_namespaces_dataset",
        &S3Server::client_env(),
        namespaces_own_datasets(),
    );
}

async fn namespaces_own_datasets() {
    let s3 = S3Server::s3s_fs(&["private"]);
    let endpoint = s3.endpoint();
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let a = k.namespace("team-a").await;
    let b = k.namespace("team-b").await;
    let private = store(&endpoint, "private");
    for (ns, byte) in [(&a, 1u8), (&b, 2u8)] {
        private
            .put(
                &ObjectPath::from(format!("{ns}/weights/shard-0")),
                PutPayload::from(vec![byte; 10_000]),
            )
            .await
            .unwrap();
    }
    k.run_pods(&[
        pod(
            &a,
            "owner",
            node.name(),
            &format!("w=s3://private/{a}/weights/"),
        )
        .build(),
        pod(
            &b,
            "intruder",
            node.name(),
            &format!("w=s3://private/{a}/weights/"),
        )
        .build(),
        pod(
            &b,
            "neighbour",
            node.name(),
            &format!("w=s3://private/{b}/weights/"),
        )
        .build(),
        pod(
            &b,
            "squatter",
            node.name(),
            &format!("{a}--w=s3://private/{b}/weights/"),
        )
        .build(),
    ])
    .await;
    let cache_dir = tempfile::tempdir().unwrap();
    let mut registry = Registry::default();
    let metrics = Arc::new(PrefetchMetrics::register(&mut registry));
    let prefetcher = Prefetcher::new(
        cache_dir.path().to_path_buf(),
        None,
        PrefetchDefaults {
            store: StoreOptions {
                endpoint: Some(endpoint.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
        metrics.clone(),
        CancellationToken::new(),
    );
    let watcher = AnnotationWatcher {
        pods: kube::Api::all(k.agent_client()),
        node_name: node.name().to_string(),
        prefetcher: prefetcher.clone(),
        policy: AnnotationPolicy {
            enabled: true,
            allow: vec![AllowPattern::parse("s3://private/{namespace}").unwrap()],
        },
        events: Arc::new(KubeNodeOps::new(
            k.agent_client(),
            node.name().to_string(),
            None,
            false,
            Arc::new(Metrics::register(&mut Registry::default())),
        )),
        metrics: metrics.clone(),
        interval: Duration::from_millis(200),
    };
    let requests = Arc::new(Requests::default());
    let cancel = CancellationToken::new();
    tokio::spawn(watcher.run(requests.clone(), cancel.clone()));
    eventually("two rounds", Duration::from_secs(30), || async {
        requests.synced() && requests.rounds() >= 2
    })
    .await;
    let (own_a, own_b) = (format!("{a}--w"), format!("{b}--w"));
    let mut referenced: Vec<String> = requests.referenced().into_iter().collect();
    referenced.sort();
    let mut want = vec![own_a.clone(), own_b.clone()];
    want.sort();
    assert_eq!(referenced, want);
    for (name, byte) in [(&own_a, 1u8), (&own_b, 2u8)] {
        let st = tokio::time::timeout(Duration::from_secs(30), prefetcher.wait(name))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(st.state, DatasetState::Complete, "{st:?}");
        assert_eq!(
            std::fs::read(cache_dir.path().join(name).join("shard-0")).unwrap(),
            vec![byte; 10_000],
            "{name}"
        );
    }
    assert!(!cache_dir.path().join("w").exists());
    let refusals = |pod: &'static str| {
        let k = &k;
        async move {
            k.events()
                .await
                .into_iter()
                .filter(|e| e.reason == REFUSED_REASON && e.regarding_name == pod)
                .map(|e| e.message)
                .collect::<Vec<String>>()
        }
    };
    let intruder = refusals("intruder").await;
    assert!(
        intruder.len() == 1 && intruder[0].contains(&format!("for namespace {b}")),
        "{intruder:?}"
    );
    let squatter = refusals("squatter").await;
    assert!(
        squatter.len() == 1 && squatter[0].contains("may not hold \"--\""),
        "{squatter:?}"
    );
    assert!(refusals("owner").await.is_empty() && refusals("neighbour").await.is_empty());
    cancel.cancel();
}
