//! Goodput in Kubernetes (docs/goodput.md): the agent's goodput Events and ledger records against
//! the real control plane, through the shipped ServiceAccount (`KubeNodeOps::pod_record_event`:
//! the Event with the record in its annotation and the pod's Job in `related`, and the
//! `Interruption` object owned by that Job), and `spotguard goodput --namespace NS --job` /
//! `--jobset` / `--pod` (the built binary, with the admin's kubeconfig) over those records. The
//! API server keeps Events only [`EVENT_TTL`]: the report must not need them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, OwnerReference};
use kube::api::{Api, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use prometheus_client::registry::Registry;
use serde_json::{json, Value};
use spotguard::goodput::event::{EventRecord, Recovery, ANNOTATION};
use spotguard::goodput::kube_report::{JOBSET_NAME_LABEL, REASONS};
use spotguard::goodput::record::{Interruption, TargetBadput};
use spotguard::metrics::Metrics;
use spotguard::node::kube::ledger::{api_resource, RecordOwner, JOB_UID_LABEL, OWNER_UID_LABEL};
use spotguard::node::kube::owner::JobOwners;
use spotguard::node::kube::KubeNodeOps;
use spotguard::node::{EventType, NodeOps, PodRef};
use spotguard_testkit::k8s::{assets, fixtures, TestCluster, TestPod};
use spotguard_testkit::wait::until;

const WAIT: Duration = Duration::from_secs(60);
/// `--event-ttl` of this binary's API server: the goodput Events expire while a test runs.
const EVENT_TTL: Duration = Duration::from_secs(15);

/// This test's slice of the binary's control plane (whose API server drops Events after
/// [`EVENT_TTL`]).
async fn cluster() -> TestCluster {
    TestCluster::with_event_ttl(EVENT_TTL).await
}

fn at(s: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + s).unwrap()
}

/// The agent's node operations as the shipped ServiceAccount (through the proxy).
fn agent_ops(k: &TestCluster) -> KubeNodeOps {
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    KubeNodeOps::new(k.agent_client(), k.name("gp-node"), None, false, metrics)
}

/// A Job run by the real Job controller whose one pod is never scheduled (no node matches), and
/// that pod, once the controller made it and started the Job.
async fn job_with_pod(k: &TestCluster, ns: &str, name: &str) -> (Job, Pod) {
    let jobs: Api<Job> = Api::namespaced(k.admin(), ns);
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"testkit.spotguard.io/no-such-node": "x"},
                "containers": [{"name": "main", "image": "registry.example/trainer:1"}]
            }}
        }
    }))
    .unwrap();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(k.admin(), ns);
    let selector = format!("batch.kubernetes.io/job-name={name}");
    until(
        &format!("Job {name} started, with its pod"),
        WAIT,
        || async {
            let job = jobs.get(name).await.ok()?;
            job.status.as_ref()?.start_time.as_ref()?;
            let pod = pods
                .list(&ListParams::default().labels(&selector))
                .await
                .ok()?
                .items
                .into_iter()
                .next()?;
            Some((job, pod))
        },
    )
    .await
}

fn pod_ref(pod: &Pod) -> PodRef {
    PodRef {
        namespace: pod.metadata.namespace.clone().unwrap(),
        name: pod.metadata.name.clone().unwrap(),
        uid: pod.metadata.uid.clone().unwrap(),
    }
}

/// `namespace/pod`: the target the agent names a pod's group by.
fn target_of(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap(),
        pod.metadata.name.as_deref().unwrap()
    )
}

fn badput(notice: &str, node: &str, target: &str, save: f64, wasted: (u64, f64)) -> EventRecord {
    EventRecord::Badput(Interruption {
        notice_id: notice.into(),
        node: node.into(),
        kind: "spot-interruption".into(),
        source: "aws".into(),
        seen_at: Some(at(0)),
        done_at: at(60),
        targets: vec![TargetBadput {
            target: target.into(),
            outcome: "acked".into(),
            step: Some(100),
            save_seconds: Some(save),
            downtime_seconds: Some(save + 1.0),
            wasted_steps: Some(wasted.0),
            wasted_seconds: Some(wasted.1),
            ..TargetBadput::default()
        }],
        ..Interruption::default()
    })
}

fn recovery(
    notice: &str,
    from: &str,
    node: &str,
    target: &str,
    gap: f64,
    restore: f64,
) -> EventRecord {
    EventRecord::Recovery(Recovery {
        notice_id: notice.into(),
        from_node: Some(from.into()),
        node: node.into(),
        target: target.into(),
        step: 100,
        saved_at: at(60),
        first_step_at: at(60) + Duration::from_secs_f64(gap),
        recovery_seconds: gap,
        restore_seconds: Some(restore),
    })
}

async fn post(ops: &KubeNodeOps, pod: &Pod, reason: &str, record: &EventRecord) {
    ops.pod_record_event(
        &pod_ref(pod),
        EventType::Normal,
        reason,
        "goodput",
        &record.to_annotation(),
    )
    .await
    .unwrap_or_else(|e| panic!("posting {reason}: {e}"));
}

/// The goodput Events of `ns` as stored.
async fn goodput_events(k: &TestCluster, ns: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(k.admin(), ns);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref().is_some_and(|r| REASONS.contains(&r)))
        .collect()
}

/// The ledger's records in `ns` as stored.
async fn ledger(k: &TestCluster, ns: &str) -> Vec<DynamicObject> {
    let api: Api<DynamicObject> = Api::namespaced_with(k.admin(), ns, &api_resource());
    api.list(&ListParams::default()).await.unwrap().items
}

/// An Event about `pod` related to `job`, posted as admin with `annotation` (or none): what an
/// older agent, or anything else able to write Events, might leave.
async fn foreign_event(k: &TestCluster, pod: &Pod, job: &Job, annotation: Option<&str>) {
    let ns = pod.metadata.namespace.clone().unwrap();
    let api: Api<Event> = Api::namespaced(k.admin(), &ns);
    let e = Event {
        metadata: ObjectMeta {
            generate_name: Some("foreign-".into()),
            annotations: annotation.map(|a| BTreeMap::from([(ANNOTATION.into(), a.into())])),
            ..Default::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        reporting_controller: Some("example.com/other".into()),
        reporting_instance: Some("x".into()),
        action: Some("Notify".into()),
        reason: Some(REASONS[0].into()),
        note: Some("no record".into()),
        type_: Some("Normal".into()),
        regarding: Some(ObjectReference {
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            namespace: Some(ns.clone()),
            ..Default::default()
        }),
        related: Some(ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: job.metadata.name.clone(),
            namespace: Some(ns),
            uid: job.metadata.uid.clone(),
            ..Default::default()
        }),
        ..Default::default()
    };
    api.create(&PostParams::default(), &e).await.unwrap();
}

/// `spotguard goodput ARGS --json --kubeconfig <admin>`: the report.
fn goodput(k: &TestCluster, args: &[&str]) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .arg("goodput")
        .args(args)
        .arg("--json")
        .arg("--kubeconfig")
        .arg(&k.cp.admin_kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "spotguard goodput {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn ts(v: &Value) -> Timestamp {
    v.as_str().unwrap().parse().unwrap()
}

#[test]
fn the_reasons_read_are_the_ones_the_agent_writes() {
    assert_eq!(
        REASONS,
        [
            spotguard::outcome::reason::BADPUT,
            spotguard::outcome::reason::RECOVERED
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_goodput_event_carries_its_record_and_names_the_pods_job() {
    let k = cluster().await;
    let ns = k.namespace("gp-event").await;
    let (job, pod) = job_with_pod(&k, &ns, "train").await;
    let ops = agent_ops(&k);
    let record = badput("aws-1", ops.node_name(), &target_of(&pod), 12.5, (0, 0.0));
    post(&ops, &pod, REASONS[0], &record).await;
    let events = goodput_events(&k, &ns).await;
    let [e] = events.as_slice() else {
        panic!("one goodput Event expected: {events:#?}")
    };
    let text = e
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
        .unwrap_or_else(|| panic!("no {ANNOTATION} annotation: {e:#?}"));
    assert_eq!(serde_json::from_str::<EventRecord>(text).unwrap(), record);
    let related = e.related.as_ref().expect("no related object");
    assert_eq!(
        (
            related.kind.as_deref(),
            related.name.as_deref(),
            related.uid.as_ref(),
            related.api_version.as_deref()
        ),
        (
            Some("Job"),
            Some("train"),
            job.metadata.uid.as_ref(),
            Some("batch/v1")
        )
    );
    let regarding = e.regarding.as_ref().unwrap();
    assert_eq!(regarding.name, pod.metadata.name);
    // A different record with the same text is an Event of its own, not a repeat.
    let other = badput("aws-2", ops.node_name(), &target_of(&pod), 12.5, (0, 0.0));
    post(&ops, &pod, REASONS[0], &other).await;
    assert_eq!(goodput_events(&k, &ns).await.len(), 2);
    // Each record is also an object of the ledger, owned (not controlled) by the pod's Job.
    let records = ledger(&k, &ns).await;
    assert_eq!(records.len(), 2, "{records:#?}");
    for r in &records {
        let owner = &r.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), Some(&owner.uid), owner.controller),
            ("Job", job.metadata.uid.as_ref(), None)
        );
        assert_eq!(r.data["spec"]["node"], ops.node_name());
        assert!(r.data["spec"]["expiresAt"].is_null());
    }
    // Written again (a retry, a restarted agent): still one object per record.
    post(&ops, &pod, REASONS[0], &other).await;
    assert_eq!(ledger(&k, &ns).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spotguard_goodput_reports_a_jobs_interruptions_recoveries_and_paid_time() {
    let k = cluster().await;
    let ns = k.namespace("gp-job").await;
    let (job, pod) = job_with_pod(&k, &ns, "llm").await;
    let (_, other_pod) = job_with_pod(&k, &ns, "other").await;
    let ops = agent_ops(&k);
    let node = ops.node_name().to_string();
    let t1 = target_of(&pod);
    let t2 = t1.clone();
    // Interruption 1 (acked, recovered: 20 s of which 4 s restore), interruption 2 (a trainer
    // that threw 30 steps / 15 s away; no recovery yet).
    post(
        &ops,
        &pod,
        REASONS[0],
        &badput("n1", &node, &t1, 10.0, (0, 0.0)),
    )
    .await;
    post(
        &ops,
        &pod,
        REASONS[1],
        &recovery("n1", "spot-a", &node, &t2, 20.0, 4.0),
    )
    .await;
    post(
        &ops,
        &pod,
        REASONS[0],
        &badput("n2", &node, &t2, 6.0, (30, 15.0)),
    )
    .await;
    // Another Job's interruption in the same namespace.
    post(
        &ops,
        &other_pod,
        REASONS[0],
        &badput("n3", &node, &target_of(&other_pod), 100.0, (500, 300.0)),
    )
    .await;
    // Goodput Events anyone who can write Events might leave: no record, a broken one, a
    // forged one. The report reads the ledger, not Events: none of them counts.
    foreign_event(&k, &pod, &job, None).await;
    foreign_event(&k, &pod, &job, Some("{\"type\":\"badput\",")).await;
    let forged = badput("x1", &node, &t1, 1_000_000.0, (0, 0.0)).to_annotation();
    foreign_event(&k, &pod, &job, Some(&forged)).await;

    let before = Timestamp::now();
    let r = goodput(&k, &["--namespace", &ns, "--job", "llm"]);
    let after = Timestamp::now();
    assert_eq!(r["owner"]["kind"], "Job", "{r:#}");
    assert_eq!(r["owner"]["name"], "llm");
    assert_eq!(r["owner"]["running"], true);
    assert_eq!(r["skipped"], 0, "{r:#}");
    let rows = r["interruptions"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{r:#}");
    let row = |id: &str| rows.iter().find(|x| x["notice_id"] == id).unwrap();
    let n1 = row("n1");
    assert_eq!(n1["node"], node);
    assert_eq!(n1["targets"], json!([t1]));
    assert_eq!(n1["outcome"], "acked");
    assert_eq!(f(&n1["save_seconds"]), 10.0);
    assert_eq!(f(&n1["downtime_seconds"]), 11.0);
    assert_eq!(f(&n1["wasted_seconds"]), 0.0);
    assert_eq!(n1["steps_lost"], 0);
    assert_eq!(f(&n1["recovery_seconds"]), 16.0);
    assert_eq!(f(&n1["restore_seconds"]), 4.0);
    assert_eq!(n1["recovered_on"], json!([node]));
    let n2 = row("n2");
    assert_eq!(
        (
            f(&n2["save_seconds"]),
            f(&n2["wasted_seconds"]),
            &n2["steps_lost"]
        ),
        (6.0, 15.0, &json!(30))
    );
    assert!(n2["recovery_seconds"].is_null(), "{n2}");

    // Paid time: the Job's startTime → now (it runs).
    let t = &r["totals"];
    let start = job.status.as_ref().unwrap().start_time.as_ref().unwrap().0;
    assert_eq!(ts(&t["since"]), start);
    let until = ts(&t["until"]);
    assert!(
        before <= until && until <= after,
        "{until} not in {before}..{after}"
    );
    let paid = f(&t["paid_seconds"]);
    assert!((paid - until.duration_since(start).as_secs_f64()).abs() < 1e-6);
    let cats: Vec<(String, f64)> = serde_json::from_value(t["badput_seconds"].clone()).unwrap();
    assert_eq!(
        cats,
        vec![
            ("checkpoint_save".to_string(), 16.0),
            ("wasted_progress".to_string(), 15.0),
            ("infrastructure_recovery".to_string(), 16.0),
            ("checkpoint_restore".to_string(), 4.0)
        ]
    );
    let productive = f(&t["productive_seconds"]);
    assert!((productive - (paid - 51.0).max(0.0)).abs() < 1e-6);
    assert!((f(&t["goodput_percent"]) - 100.0 * productive / paid).abs() < 1e-9);
    assert_eq!(
        (&t["steps_lost"], &t["interruptions"], &t["recoveries"]),
        (&json!(30), &json!(2), &json!(1))
    );

    // The same through `--owner KIND/NAME` (the kind found through the Events' apiVersion) and
    // through the pod the Events are about.
    let pod_name = pod.metadata.name.clone().unwrap();
    for args in [["--owner", "Job/llm"], ["--pod", pod_name.as_str()]] {
        let r = goodput(&k, &["--namespace", &ns, args[0], args[1]]);
        assert_eq!(
            r["interruptions"].as_array().unwrap().len(),
            2,
            "{args:?}: {r:#}"
        );
        assert_eq!(r["skipped"], 0, "{args:?}");
        assert_eq!(
            r["totals"]["badput_seconds"], t["badput_seconds"],
            "{args:?}"
        );
    }

    // The other Job sees only its own.
    let r = goodput(&k, &["--namespace", &ns, "--job", "other"]);
    assert_eq!(r["interruptions"].as_array().unwrap().len(), 1);
    assert_eq!(r["totals"]["badput_seconds"][0][1], 100.0);
    assert_eq!(r["skipped"], 0);
}

/// The JobSet CRD of `../shared/k8s/crds`, installed (idempotent) and Established.
async fn install_jobset_crd(k: &TestCluster) {
    let path = assets::shared_dir()
        .join("crds")
        .join("jobset.x-k8s.io_jobsets.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs = fixtures::yaml_documents(&text).unwrap();
    let crd: CustomResourceDefinition = serde_json::from_value(docs[0].clone()).unwrap();
    let api: Api<CustomResourceDefinition> = Api::all(k.admin());
    let name = crd.metadata.name.clone().unwrap();
    api.patch(
        &name,
        &PatchParams::apply("spotguard-goodput-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .unwrap();
    until("the JobSet CRD Established", WAIT, || async {
        let crd = api.get(&name).await.ok()?;
        crd.status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True")
            .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spotguard_goodput_reports_a_jobset_through_its_jobs() {
    let k = cluster().await;
    install_jobset_crd(&k).await;
    let ns = k.namespace("gp-jobset").await;
    // A JobSet (no JobSet controller runs: the test makes its Jobs), its two Jobs and a Job of
    // another JobSet, each with a pod of its own.
    let jobsets = kube::Api::<kube::api::DynamicObject>::namespaced_with(
        k.admin(),
        &ns,
        &kube::api::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet"),
            "jobsets",
        ),
    );
    let js: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "pretrain", "namespace": ns},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": {"spec": {
            "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "main", "image": "registry.example/trainer:1"}]}}}}}]}
    }))
    .unwrap();
    let js = jobsets.create(&PostParams::default(), &js).await.unwrap();
    let jobs: Api<Job> = Api::namespaced(k.admin(), &ns);
    let ops = agent_ops(&k);
    let mut pods = Vec::new();
    for (job_name, jobset) in [
        ("pretrain-workers-0", "pretrain"),
        ("pretrain-workers-1", "pretrain"),
        ("eval-workers-0", "eval"),
    ] {
        let job: Job = serde_json::from_value(json!({
            "metadata": {"name": job_name, "labels": {JOBSET_NAME_LABEL: jobset}},
            "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "main", "image": "registry.example/trainer:1"}]}}}
        }))
        .unwrap();
        let job = jobs.create(&PostParams::default(), &job).await.unwrap();
        let owner = OwnerReference {
            api_version: "batch/v1".into(),
            kind: "Job".into(),
            name: job_name.into(),
            uid: job.metadata.uid.clone().unwrap(),
            controller: Some(true),
            block_owner_deletion: None,
        };
        let pod = TestPod::new(&ns, &format!("{job_name}-p"), &k.name("nowhere"))
            .owned_by(owner)
            .build();
        pods.push(k.create_pod(&pod).await);
    }
    let node = ops.node_name().to_string();
    let w: Vec<String> = pods.iter().map(target_of).collect();
    post(
        &ops,
        &pods[0],
        REASONS[0],
        &badput("n1", &node, &w[0], 3.0, (0, 0.0)),
    )
    .await;
    post(
        &ops,
        &pods[1],
        REASONS[0],
        &badput("n1", &node, &w[1], 5.0, (0, 0.0)),
    )
    .await;
    post(
        &ops,
        &pods[1],
        REASONS[1],
        &recovery("n1", "spot-a", &node, &w[1], 8.0, 2.0),
    )
    .await;
    post(
        &ops,
        &pods[2],
        REASONS[0],
        &badput("n9", &node, &w[2], 50.0, (0, 0.0)),
    )
    .await;

    let r = goodput(&k, &["--namespace", &ns, "--jobset", "pretrain"]);
    assert_eq!(r["owner"]["kind"], "JobSet", "{r:#}");
    let rows = r["interruptions"].as_array().unwrap();
    let [row] = rows.as_slice() else {
        panic!("one interruption expected: {r:#}")
    };
    assert_eq!(row["notice_id"], "n1");
    assert_eq!(row["targets"], json!([w[0], w[1]]));
    assert_eq!(f(&row["save_seconds"]), 8.0);
    assert_eq!(f(&row["recovery_seconds"]), 6.0);
    let t = &r["totals"];
    // Paid time: the JobSet's creation → now (it has no terminal condition).
    let created = js.metadata.creation_timestamp.clone().unwrap().0;
    assert_eq!(ts(&t["since"]), created);
    assert_eq!(r["owner"]["running"], true);
    let lost: f64 = t["badput_seconds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| f(&c[1]))
        .sum();
    assert_eq!(lost, 16.0);
    assert_eq!(t["targets"], 2);
}

/// The JobSet API of `../shared/k8s/crds`.
fn jobset_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet"),
        "jobsets",
    )
}

/// A suspended Job of `jobset` as the JobSet controller makes it (controlled by the JobSet,
/// labelled with its name), created once the earlier Job of that name, if any, is gone.
async fn jobset_job(k: &TestCluster, ns: &str, name: &str, jobset: &DynamicObject) -> Job {
    let jobs: Api<Job> = Api::namespaced(k.admin(), ns);
    let js_name = jobset.metadata.name.clone().unwrap();
    let job: Job = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {JOBSET_NAME_LABEL: js_name},
            "ownerReferences": [{
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "name": js_name,
                "uid": jobset.metadata.uid.clone().unwrap(),
                "controller": true,
            }]
        },
        "spec": {"suspend": true, "template": {"spec": {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": "registry.example/trainer:1"}]}}}
    }))
    .unwrap();
    jobs.create(&PostParams::default(), &job).await.unwrap()
}

/// A pod of `node` whose controller reference names Job `job` with `uid`.
async fn pod_of_job(k: &TestCluster, ns: &str, pod: &str, node: &str, job: &str, uid: &str) -> Pod {
    let owner = OwnerReference {
        api_version: "batch/v1".into(),
        kind: "Job".into(),
        name: job.into(),
        uid: uid.into(),
        controller: Some(true),
        block_owner_deletion: None,
    };
    k.create_pod(&TestPod::new(ns, pod, node).owned_by(owner).build())
        .await
}

/// The ledger's record of notice `notice` in `ns`.
async fn record_of(k: &TestCluster, ns: &str, notice: &str) -> DynamicObject {
    let records = ledger(k, ns).await;
    records
        .iter()
        .find(|r| r.data["spec"]["noticeId"] == notice)
        .unwrap_or_else(|| panic!("no record of {notice}: {records:#?}"))
        .clone()
}

/// (kind, name, uid) of each of a record's owners, and its owner-uid and job-uid labels.
type Owned = (
    Vec<(String, String, String)>,
    Option<String>,
    Option<String>,
);

fn owners_and_labels(r: &DynamicObject) -> Owned {
    let owners = r
        .metadata
        .owner_references
        .iter()
        .flatten()
        .map(|o| (o.kind.clone(), o.name.clone(), o.uid.clone()))
        .collect();
    let label = |key: &str| r.metadata.labels.as_ref()?.get(key).cloned();
    (owners, label(OWNER_UID_LABEL), label(JOB_UID_LABEL))
}

/// Issue 45, retention follows the job: a JobSet's records are owned by the JobSet (the agent
/// reads the pod's Job and finds the JobSet controlling it), so a JobSet restart, which deletes
/// its Jobs and creates them again under the same names, leaves them: every owner a record names
/// is still there after it. A pod naming its Job with another uid gets what it named, not the
/// JobSet. (The testkit runs no garbage collector, so the test checks what the collector goes
/// by: that each record's owners exist, with the uids it names.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobsets_records_are_the_jobsets_and_outlive_its_restart() {
    let k = cluster().await;
    install_jobset_crd(&k).await;
    let ns = k.namespace("gp-jsown").await;
    let jobsets: Api<DynamicObject> = Api::namespaced_with(k.admin(), &ns, &jobset_resource());
    let js: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "pretrain", "namespace": ns},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
            "template": {"spec": {"restartPolicy": "Never",
                "containers": [{"name": "main", "image": "registry.example/trainer:1"}]}}}}}]}
    }))
    .unwrap();
    let js = jobsets.create(&PostParams::default(), &js).await.unwrap();
    let js_uid = js.metadata.uid.clone().unwrap();
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let ops = KubeNodeOps::new(k.agent_client(), k.name("gp-node"), None, false, metrics);
    let node = ops.node_name().to_string();
    let job_name = "pretrain-workers-0";
    let job = jobset_job(&k, &ns, job_name, &js).await;
    let job_uid = job.metadata.uid.clone().unwrap();
    let pod = pod_of_job(&k, &ns, "w0-a", &node, job_name, &job_uid).await;
    let w0 = target_of(&pod);
    post(
        &ops,
        &pod,
        REASONS[0],
        &badput("n1", &node, &w0, 4.0, (10, 5.0)),
    )
    .await;
    let jobset_owned = (
        vec![("JobSet".to_string(), "pretrain".to_string(), js_uid.clone())],
        Some(js_uid.clone()),
        Some(job_uid.clone()),
    );
    assert_eq!(
        owners_and_labels(&record_of(&k, &ns, "n1").await),
        jobset_owned
    );
    // The Event still names the pod's own controller, the Job.
    let events = goodput_events(&k, &ns).await;
    let related = events[0].related.as_ref().unwrap();
    assert_eq!(
        (related.kind.as_deref(), related.uid.as_deref()),
        (Some("Job"), Some(job_uid.as_str()))
    );
    // The Job's report has it too (the record names the Job's uid).
    let r = goodput(&k, &["--namespace", &ns, "--job", job_name]);
    assert_eq!(r["totals"]["interruptions"], 1, "{r:#}");
    // And so does recovery validation, asked (as the agent) for the pod's controller's uid.
    let found =
        spotguard::goodput::ledger::recorded_interruption(&k.agent_client(), &ns, &job_uid, "n1")
            .await
            .unwrap();
    assert_eq!(found.map(|i| i.notice_id).as_deref(), Some("n1"));

    // The JobSet restarts: its Job is deleted and made again under the same name.
    let jobs: Api<Job> = Api::namespaced(k.admin(), &ns);
    jobs.delete(job_name, &kube::api::DeleteParams::background())
        .await
        .unwrap();
    until("the JobSet's first Job gone", WAIT, || async {
        jobs.get_opt(job_name).await.ok()?.is_none().then_some(())
    })
    .await;
    let again = jobset_job(&k, &ns, job_name, &js).await;
    let again_uid = again.metadata.uid.clone().unwrap();
    assert_ne!(again_uid, job_uid);
    // Recovery validation for a pod of the new Job: the interruption hit the earlier Job, and is
    // found through the JobSet both belong to.
    let again_ref = ObjectReference {
        api_version: Some("batch/v1".into()),
        kind: Some("Job".into()),
        name: Some(job_name.into()),
        uid: Some(again_uid.clone()),
        ..Default::default()
    };
    let found = spotguard::goodput::ledger::recorded_for(
        &k.agent_client(),
        &JobOwners::default(),
        &ns,
        &again_ref,
        "n1",
    )
    .await
    .unwrap();
    assert_eq!(found.map(|i| i.notice_id).as_deref(), Some("n1"));
    let resumed = pod_of_job(&k, &ns, "w0-b", &node, job_name, &again_uid).await;
    post(
        &ops,
        &resumed,
        REASONS[1],
        &recovery("n1", "spot-a", &node, &target_of(&resumed), 12.0, 3.0),
    )
    .await;
    // Every owner each record names exists, with that uid: nothing for the collector to take.
    for r in ledger(&k, &ns).await {
        for o in r.metadata.owner_references.iter().flatten() {
            assert_eq!(
                (o.kind.as_str(), o.uid.as_str()),
                ("JobSet", js_uid.as_str()),
                "{r:#?}"
            );
        }
    }
    assert_eq!(
        jobsets.get("pretrain").await.unwrap().metadata.uid,
        js.metadata.uid
    );
    assert_eq!(
        owners_and_labels(&record_of(&k, &ns, "n1").await),
        jobset_owned
    );

    // The JobSet's report: the interruption before the restart, its recovery after it, once each.
    let r = goodput(&k, &["--namespace", &ns, "--jobset", "pretrain"]);
    let rows = r["interruptions"].as_array().unwrap();
    let [row] = rows.as_slice() else {
        panic!("one interruption expected: {r:#}")
    };
    assert_eq!(row["notice_id"], "n1");
    assert_eq!(f(&row["save_seconds"]), 4.0);
    assert_eq!(row["steps_lost"], 10);
    assert_eq!(f(&row["recovery_seconds"]), 9.0);
    assert_eq!(
        (&r["totals"]["interruptions"], &r["totals"]["recoveries"]),
        (&json!(1), &json!(1)),
        "{r:#}"
    );
    assert_eq!(r["skipped"], 0);

    // A pod naming the Job by name with another uid: the record is owned by what it named, as
    // for any controller, not by the JobSet the Job of that name belongs to.
    let forged_uid = "0c0ffee0-0000-4000-8000-000000000000";
    let liar = pod_of_job(&k, &ns, "liar", &node, job_name, forged_uid).await;
    post(
        &ops,
        &liar,
        REASONS[0],
        &badput("n2", &node, &target_of(&liar), 100.0, (0, 0.0)),
    )
    .await;
    assert_eq!(
        owners_and_labels(&record_of(&k, &ns, "n2").await),
        (
            vec![(
                "Job".to_string(),
                job_name.to_string(),
                forged_uid.to_string()
            )],
            Some(forged_uid.to_string()),
            None
        )
    );
    let text = spotguard::metrics::encode(&registry);
    assert!(
        text.contains("spotguard_errors_total{module=\"node\",error=\"job_gone\"} 1"),
        "{text}"
    );
    // The Job of that name now (another uid) does not count it; its report has the recovery its
    // JobSet owns, which names it.
    let r = goodput(&k, &["--namespace", &ns, "--job", job_name]);
    assert_eq!(
        (&r["totals"]["interruptions"], &r["totals"]["recoveries"]),
        (&json!(0), &json!(1)),
        "{r:#}"
    );
}

/// Issue 45: a Job interrupted three times over a simulated day. The goodput Events expire
/// (this binary's API server keeps Events [`EVENT_TTL`]); the report, from the ledger, still has
/// every interruption and recovery, and so does `--pod` once the pod is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_interruptions_outlive_their_events_and_its_gone_pod_still_reports() {
    let k = cluster().await;
    let ns = k.namespace("gp-ttl").await;
    let (_, pod) = job_with_pod(&k, &ns, "day").await;
    let ops = agent_ops(&k);
    let node = ops.node_name().to_string();
    let target = target_of(&pod);
    for (n, hour) in [(1, 2), (2, 10), (3, 20)] {
        let notice = format!("aws-{n}");
        let EventRecord::Badput(mut i) = badput(&notice, &node, &target, n as f64, (n, 0.5)) else {
            unreachable!()
        };
        i.seen_at = Some(at(hour * 3600));
        i.done_at = at(hour * 3600 + 60);
        post(&ops, &pod, REASONS[0], &EventRecord::Badput(i)).await;
        let EventRecord::Recovery(mut r) = recovery(&notice, "spot-a", &node, &target, 30.0, 3.0)
        else {
            unreachable!()
        };
        r.saved_at = at(hour * 3600 + 60);
        r.first_step_at = at(hour * 3600 + 90);
        post(&ops, &pod, REASONS[1], &EventRecord::Recovery(r)).await;
    }
    assert_eq!(goodput_events(&k, &ns).await.len(), 6);
    until(
        "the goodput Events expired (--event-ttl)",
        EVENT_TTL * 8,
        || async { goodput_events(&k, &ns).await.is_empty().then_some(()) },
    )
    .await;

    let check = |r: &Value, what: &str| {
        let rows = r["interruptions"].as_array().unwrap();
        let ids: Vec<&str> = rows
            .iter()
            .map(|x| x["notice_id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["aws-1", "aws-2", "aws-3"], "{what}: {r:#}");
        for (n, row) in rows.iter().enumerate() {
            assert_eq!(f(&row["save_seconds"]), (n + 1) as f64, "{what}");
            assert_eq!(row["steps_lost"], json!(n + 1), "{what}");
            assert_eq!(f(&row["recovery_seconds"]), 27.0, "{what}");
            assert_eq!(f(&row["restore_seconds"]), 3.0, "{what}");
        }
        let t = &r["totals"];
        assert_eq!(
            (&t["interruptions"], &t["recoveries"], &t["steps_lost"]),
            (&json!(3), &json!(3), &json!(6)),
            "{what}"
        );
        assert_eq!(r["skipped"], 0, "{what}");
    };
    check(&goodput(&k, &["--namespace", &ns, "--job", "day"]), "--job");

    // What `kubectl get interruptions` shows (the CRD's printer columns): one row per record.
    let kubectl = spotguard_testkit::k8s::tools::find_on_path("kubectl")
        .expect("kubectl (scripts/deps/kubectl.sh)");
    let home = tempfile::tempdir().unwrap();
    std::fs::copy(&k.cp.admin_kubeconfig, home.path().join("config")).unwrap();
    let ran = spotguard_testkit::k8s::tools::run_tool(
        &kubectl,
        &["get", "interruptions", "-n", &ns],
        None,
        home.path(),
        WAIT,
    )
    .await;
    assert!(ran.ok, "kubectl get interruptions: {}", ran.stderr);
    eprintln!("{}", ran.stdout);
    let mut lines = ran.stdout.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME",
            "TYPE",
            "NODE",
            "TARGET",
            "OUTCOME",
            "SAVE_S",
            "STEPS_LOST",
            "RECOVERY_S",
            "AGE"
        ]
    );
    assert_eq!(lines.count(), 6, "{}", ran.stdout);

    // The pod is gone (evicted, deleted): its records still report, over their own span.
    let pod_name = pod.metadata.name.clone().unwrap();
    let pods: Api<Pod> = Api::namespaced(k.admin(), &ns);
    pods.delete(
        &pod_name,
        &kube::api::DeleteParams::default().grace_period(0),
    )
    .await
    .unwrap();
    until("the pod gone", WAIT, || async {
        pods.get_opt(&pod_name).await.ok()?.is_none().then_some(())
    })
    .await;
    let r = goodput(&k, &["--namespace", &ns, "--pod", &pod_name]);
    check(&r, "--pod of a gone pod");
    assert_eq!(ts(&r["totals"]["since"]), at(2 * 3600));
    assert_eq!(ts(&r["totals"]["until"]), at(20 * 3600 + 90));
}

/// A namespace user with `create` on Events only (a right many controllers' ServiceAccounts
/// hold): a Role of its own in the job's namespace, a token of its ServiceAccount.
async fn events_only_user(k: &TestCluster, ns: &str) -> kube::Client {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let sa: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "mallory"}})).unwrap();
    Api::<ServiceAccount>::namespaced(k.admin(), ns)
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "events-writer"},
        "rules": [{"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]}]
    }))
    .unwrap();
    Api::<Role>::namespaced(k.admin(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "events-writer"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "events-writer"},
        "subjects": [{"kind": "ServiceAccount", "name": "mallory", "namespace": ns}]
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(k.admin(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let token = spotguard_testkit::k8s::controlplane::mint_token(&k.admin(), ns, "mallory")
        .await
        .unwrap();
    k.proxy().client_with_token(k.cp, &token)
}

/// Issue 45 as it was run: with only `create` on events.k8s.io Events, Events naming the victim
/// Job without a uid, one of 1 000 000 s of wasted progress and one of negative seconds and
/// 2^64−400 steps, change nothing in the victim's report; the same user cannot write the
/// ledger; a record that reached the ledger with such figures (an admin's) is skipped, counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_events_and_writers_without_rights_change_nothing() {
    let k = cluster().await;
    let ns = k.namespace("gp-forge").await;
    let (_, pod) = job_with_pod(&k, &ns, "victim").await;
    let ops = agent_ops(&k);
    let node = ops.node_name().to_string();
    let target = target_of(&pod);
    post(
        &ops,
        &pod,
        REASONS[0],
        &badput("real", &node, &target, 10.0, (400, 20.0)),
    )
    .await;
    let before = goodput(&k, &["--namespace", &ns, "--job", "victim"]);

    let mallory = events_only_user(&k, &ns).await;
    let events: Api<Event> = Api::namespaced(mallory.clone(), &ns);
    let forged = |annotation: String| Event {
        metadata: ObjectMeta {
            generate_name: Some("forged-".into()),
            annotations: Some(BTreeMap::from([(ANNOTATION.into(), annotation)])),
            ..Default::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        reporting_controller: Some("spotguard.io/agent".into()),
        reporting_instance: Some("spotguard.io/agent-x".into()),
        action: Some("Notify".into()),
        reason: Some(REASONS[0].into()),
        note: Some("badput".into()),
        type_: Some("Normal".into()),
        regarding: Some(ObjectReference {
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            namespace: Some(ns.clone()),
            ..Default::default()
        }),
        // The victim by name, no uid.
        related: Some(ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some("victim".into()),
            namespace: Some(ns.clone()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let huge = badput("forged-1", &node, &target, 0.0, (0, 1_000_000.0)).to_annotation();
    let wrap = badput("forged-2", &node, &target, 0.0, (u64::MAX - 399, 0.0))
        .to_annotation()
        .replace("\"wasted_seconds\":0.0", "\"wasted_seconds\":-20.0");
    for a in [huge.clone(), wrap.clone()] {
        events
            .create(&PostParams::default(), &forged(a))
            .await
            .unwrap_or_else(|e| panic!("the events-only user may create Events: {e}"));
    }
    // The same user cannot write the ledger.
    let spec = |record: &str| {
        spotguard::node::kube::ledger::spec_for(
            record,
            &node,
            &spotguard::node::PodRef {
                namespace: ns.clone(),
                name: pod.metadata.name.clone().unwrap(),
                uid: String::new(),
            },
        )
        .unwrap()
    };
    let obj = spotguard::node::kube::ledger::object(
        spec(&huge),
        &ns,
        None,
        Timestamp::now(),
        Duration::from_secs(60),
    );
    let records: Api<DynamicObject> = Api::namespaced_with(mallory, &ns, &api_resource());
    match records.create(&PostParams::default(), &obj).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("the events-only user wrote the ledger: {other:?}"),
    }
    let after = goodput(&k, &["--namespace", &ns, "--job", "victim"]);
    assert_eq!(after["interruptions"], before["interruptions"]);
    assert_eq!(
        after["totals"]["badput_seconds"],
        before["totals"]["badput_seconds"]
    );
    assert_eq!(after["totals"]["steps_lost"], json!(400));
    assert_eq!(after["skipped"], 0);

    // Figures out of bounds that reached the ledger anyway (written as the admin, owned by the
    // victim): skipped and counted, never summed.
    let admin_records: Api<DynamicObject> = Api::namespaced_with(k.admin(), &ns, &api_resource());
    let victim: Job = Api::namespaced(k.admin(), &ns).get("victim").await.unwrap();
    let owner = ObjectReference {
        api_version: Some("batch/v1".into()),
        kind: Some("Job".into()),
        name: Some("victim".into()),
        uid: victim.metadata.uid.clone(),
        ..Default::default()
    };
    let mut s = spec(&wrap);
    s.steps_lost = None;
    let obj = spotguard::node::kube::ledger::object(
        s,
        &ns,
        Some(&RecordOwner::controller(&owner)),
        Timestamp::now(),
        Duration::ZERO,
    );
    admin_records
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
    let r = goodput(&k, &["--namespace", &ns, "--job", "victim"]);
    assert_eq!(r["interruptions"], before["interruptions"]);
    assert_eq!(r["totals"]["steps_lost"], json!(400));
    assert_eq!(r["skipped"], 1, "{r:#}");
}

/// The own-node policy: an agent whose token is bound to its pod on node A writes records of
/// node A, and is refused a record of node B (an agent on B, or anyone holding A's token).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_writes_only_its_own_nodes_records() {
    let k = cluster().await;
    let node_a = k.node(k.node_config("gp-a")).await;
    let ns = k.namespace("gp-own").await;
    let (_, pod) = job_with_pod(&k, &ns, "train").await;
    let (_, client) = k.agent_on(node_a.name()).await;
    let metrics = || Arc::new(Metrics::register(&mut Registry::default()));
    let own = KubeNodeOps::new(
        client.clone(),
        node_a.name().to_string(),
        None,
        false,
        metrics(),
    );
    let record = badput("n1", node_a.name(), &target_of(&pod), 1.0, (0, 0.0));
    post(&own, &pod, REASONS[0], &record).await;
    assert_eq!(ledger(&k, &ns).await.len(), 1);

    let node_b = k.name("gp-b");
    let other = KubeNodeOps::new(client, node_b.clone(), None, false, metrics());
    let forged = badput("n2", &node_b, &target_of(&pod), 1.0, (0, 0.0));
    let e = other
        .pod_record_event(
            &pod_ref(&pod),
            EventType::Normal,
            REASONS[0],
            "goodput",
            &forged.to_annotation(),
        )
        .await
        .expect_err("a record of another node was written");
    let text = spotguard::words::chain(&e);
    assert!(
        text.contains("spotguard-own-node") && text.contains("its own node"),
        "{text}"
    );
    assert_eq!(ledger(&k, &ns).await.len(), 1);
}

/// A bare pod's records expire: they carry `spec.expiresAt` (the agent's record TTL) and no
/// owner, and the agent of their node deletes them once expired (when it writes a record), never
/// another node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bare_pods_records_expire_and_their_agent_deletes_them() {
    let k = cluster().await;
    let ns = k.namespace("gp-bare").await;
    let pod = k
        .create_pod(
            &TestPod::new(&ns, "bare", &k.name("nowhere"))
                .orphan()
                .build(),
        )
        .await;
    let metrics = || Arc::new(Metrics::register(&mut Registry::default()));
    let node = k.name("gp-node");
    // Written with a millisecond to live: expired by the next write (which comes after the
    // API server answered this one).
    let short = KubeNodeOps::new(k.agent_client(), node.clone(), None, false, metrics())
        .with_record_ttl(Duration::from_millis(1));
    let target = target_of(&pod);
    post(
        &short,
        &pod,
        REASONS[0],
        &badput("old", &node, &target, 1.0, (0, 0.0)),
    )
    .await;
    let records = ledger(&k, &ns).await;
    let [old] = records.as_slice() else {
        panic!("one record expected: {records:#?}")
    };
    assert!(old.metadata.owner_references.is_none());
    assert!(!old.data["spec"]["expiresAt"].is_null(), "{old:#?}");
    // Another node's expired record, which this agent must leave.
    let other_node = k.name("gp-other");
    let spec = spotguard::node::kube::ledger::spec_for(
        &badput("theirs", &other_node, &target, 1.0, (0, 0.0)).to_annotation(),
        &other_node,
        &pod_ref(&pod),
    )
    .unwrap();
    let theirs =
        spotguard::node::kube::ledger::object(spec, &ns, None, Timestamp::now(), Duration::ZERO);
    Api::<DynamicObject>::namespaced_with(k.admin(), &ns, &api_resource())
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();
    // The agent (restarted: its first write looks for expired records) writes a new one.
    let agent = agent_ops(&k);
    post(
        &agent,
        &pod,
        REASONS[0],
        &badput("new", &node, &target, 1.0, (0, 0.0)),
    )
    .await;
    let mut left: Vec<String> = ledger(&k, &ns)
        .await
        .iter()
        .map(|o| o.data["spec"]["noticeId"].as_str().unwrap().to_string())
        .collect();
    left.sort();
    assert_eq!(left, ["new", "theirs"]);
}
