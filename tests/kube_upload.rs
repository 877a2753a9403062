//! Staged checkpoint uploads in Kubernetes mode, against a real control plane: the agent (the
//! real binary, as the shipped ServiceAccount through the fault proxy) takes a pod's staged
//! checkpoint, uploads it over a slow link to s3s-fs, and the drain evicts every other pod on
//! the node at once but the uploading pod only after its upload ended.
//!
//! Needs root, a cgroup hierarchy the kubelet stand-in can write, python3 and `s3s-fs`.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::k8s::{RecordedRequest, RequestKind, TestCluster, TestPod};
use spotguard_testkit::process::{self, Kid};
use spotguard_testkit::s3::{S3Server, Throttle};
use spotguard_testkit::wait::{eventually, until_described};

const BUCKET: &str = "ckpt";
const OWN_POD: &str = "spotguard-abcde";

/// The pod's trainer: on the signal, saves `$STAGED_MIB` MiB to `$STAGED`, acks staged (the
/// pod's annotation names the location), and exits once answered.
const TRAINER: &str = r#"
import os, time
import spotguard
spotguard.install()
while not spotguard.should_checkpoint():
    time.sleep(0.005)
path = os.environ["STAGED"]
os.makedirs(path)
with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
    f.write(os.urandom(int(os.environ["STAGED_MIB"]) << 20))
answer = spotguard.ack_staged(path, step=int(os.environ.get("STEP", "3")))
# Written aside, then renamed: the test reads the file while it waits.
with open(os.environ["RESULT"] + ".t", "w") as f:
    f.write(answer.state)
os.rename(os.environ["RESULT"] + ".t", os.environ["RESULT"])
spotguard.exit_after_checkpoint()
"#;

fn position(reqs: &[RecordedRequest], what: &str, f: impl Fn(&RecordedRequest) -> bool) -> usize {
    reqs.iter()
        .position(f)
        .unwrap_or_else(|| panic!("no {what} among the API requests"))
}

/// The agent (the real binary, as the shipped ServiceAccount through the fault proxy) on `node`,
/// uploading under `allow` to `endpoint`, once it serves /metrics and watches the node's pods
/// (the pods' annotations are read from that cache).
async fn start_agent(
    k: &TestCluster,
    node: &str,
    own: &str,
    work: &std::path::Path,
    metadata: &str,
    allow: &str,
    endpoint: &str,
) -> Kid {
    let kubeconfig = work.join("kubeconfig");
    std::fs::write(&kubeconfig, k.agent_kubeconfig()).unwrap();
    let port = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    cmd.args([
        "run".to_string(),
        "--mode=kubernetes".into(),
        format!("--node-name={node}"),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={metadata}"),
        "--poll-interval=200ms".into(),
        format!("--state-dir={}", work.join("state").display()),
        format!("--metrics-addr=127.0.0.1:{port}"),
        "--gpu=off".into(),
        "--log-level=warn".into(),
        "--shutdown-grace=0s".into(),
        format!("--upload-allow={allow}"),
        format!("--upload-endpoint={endpoint}"),
    ])
    .env("KUBECONFIG", &kubeconfig)
    .env("POD_NAME", OWN_POD)
    .env("POD_NAMESPACE", own)
    .envs(S3Server::client_env())
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let agent = Kid::spawn(cmd);
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    eventually(
        "the agent serving /metrics",
        Duration::from_secs(30),
        || async {
            reqwest::get(&metrics)
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await;
    let selector = format!("spec.nodeName={node}");
    eventually("the agent's pod watch", Duration::from_secs(30), || async {
        k.proxy().requests().iter().any(|r| {
            r.kind == RequestKind::PodWatch
                && r.query_param("fieldSelector").as_deref() == Some(selector.as_str())
        })
    })
    .await;
    agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploading_pod_is_evicted_after_its_upload_and_the_others_at_once() {
    // The same moment on both clocks: the manifest's mtime against the proxy's Instants.
    let clock = (std::time::SystemTime::now(), Instant::now());
    let server = S3Server::s3s_fs(&[BUCKET]);
    // 2 MiB/s: the 8 MiB checkpoint takes about 4 s.
    let slow = Throttle::start(server.addr, 2 << 20).await;
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    let web = k.namespace("web").await;
    let own = k.namespace("spotguard").await;
    let work = tempfile::tempdir().unwrap();
    let ckpt = work.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let staged: PathBuf = work.path().join("local/step-3");
    std::fs::create_dir_all(staged.parent().unwrap()).unwrap();
    let result = work.path().join("result");
    let trainer = TestPod::new(&ml, "trainer-0", node.name())
        .annotation("spotguard.io/checkpoint", "true")
        .annotation("spotguard.io/checkpoint-dir", &ckpt.display().to_string())
        .annotation("spotguard.io/checkpoint-timeout", "20s")
        .annotation(
            "spotguard.io/checkpoint-upload",
            &format!("s3://{BUCKET}/run1"),
        )
        .command(&["python3", "-c", TRAINER])
        .env(
            "PYTHONPATH",
            &repo_root().join("clients/python").display().to_string(),
        )
        .env("SPOTGUARD_DIR", &ckpt.display().to_string())
        .env("STAGED", &staged.display().to_string())
        .env("STAGED_MIB", "8")
        .env("RESULT", &result.display().to_string())
        .build();
    k.run_pods(&[
        trainer,
        TestPod::new(&web, "web-0", node.name()).build(),
        TestPod::new(&own, OWN_POD, node.name()).build(),
    ])
    .await;
    let run = node
        .wait_run(&ml, "trainer-0", "main", Duration::from_secs(30))
        .await;
    assert!(
        process::wait_catches_usr1(run.pid).await,
        "trainer did not install its handler"
    );

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let _agent = start_agent(
        &k,
        node.name(),
        &own,
        work.path(),
        &emu.base_url(),
        &format!("s3://{BUCKET}"),
        &slow.endpoint(),
    )
    .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();

    // Both pods leave the node; the trainer's only after its upload.
    until_described(
        "the trainer and web-0 off the node",
        Duration::from_secs(60),
        |left: &Vec<String>| Some(format!("still on the node: {left:?}")),
        || async {
            let left: Vec<String> = k
                .pods_in(&[&ml, &web])
                .await
                .iter()
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(left)
            }
        },
    )
    .await;
    assert_eq!(std::fs::read_to_string(&result).unwrap(), "taken");
    assert!(server
        .object_path(BUCKET, "run1/step-3/manifest.json")
        .exists());
    let reqs = k.proxy().requests();
    let evicts = |pod: &str| {
        let path = format!("/{pod}/eviction");
        move |r: &RecordedRequest| r.kind == RequestKind::Eviction && r.path.ends_with(&path)
    };
    let web_evicted = position(&reqs, "eviction of web-0", evicts("web-0"));
    let trainer_evicted = position(&reqs, "eviction of trainer-0", evicts("trainer-0"));
    let uploaded = position(&reqs, "CheckpointUploaded Event", |r| {
        r.method == "POST" && r.path.contains("events") && r.body.contains("CheckpointUploaded")
    });
    assert!(
        web_evicted < uploaded,
        "the other pod is evicted at once, not after the upload"
    );
    // The hold ends when the upload reports, and the Event is told beside the eviction (the
    // drain does not wait on it): the upload's end is its manifest, written last.
    let manifest_written = server
        .object_path(BUCKET, "run1/step-3/manifest.json")
        .metadata()
        .unwrap()
        .modified()
        .unwrap();
    let manifest_at = clock.1
        + manifest_written
            .duration_since(clock.0)
            .expect("written after the test started");
    assert!(
        reqs[trainer_evicted].at >= manifest_at,
        "the uploading pod is evicted only after its upload ended (its manifest written {:?} after the eviction)",
        manifest_at - reqs[trainer_evicted].at
    );
    let event = reqs[uploaded].body.clone();
    assert!(event.contains(&ml), "on the trainer's pod: {event}");
    assert!(event.contains("s3://ckpt/run1/step-3"), "{event}");
    // The location is the pod's job's — the test pod's controller, a ReplicaSet — named by its
    // owner marker and by the manifest.
    let writer = format!("k8s:{ml}/ReplicaSet/trainer-0-rs");
    let marker: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.object_path(BUCKET, "run1/.spotguard-location.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(marker["writer"], writer.as_str(), "{marker}");
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.object_path(BUCKET, "run1/step-3/manifest.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["writer"], writer.as_str(), "{manifest}");
}

/// Issue 42 item 1: with `--upload-allow=s3://ckpt/{namespace}` a pod of namespace B that claims
/// namespace A's JobSet and names A's location is refused (answered `refused`, nothing written
/// under A's prefix), while A's own trainer uploads. A second user of namespace A who labels a
/// pod with the victim's JobSet name writes as the victim's writer: the writer identity guards
/// against two jobs configured alike, not against the namespace's own users (the namespace is
/// the boundary; docs/checkpoint-upload.md, "Whose a location is").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_never_reaches_another_namespaces_location() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let victim_ns = k.namespace("team-a").await;
    let other_ns = k.namespace("team-b").await;
    let own = k.namespace("spotguard").await;
    let work = tempfile::tempdir().unwrap();
    let location = format!("s3://{BUCKET}/{victim_ns}/run1");
    // (pod namespace, pod name, step): the victim, a user of its namespace, another namespace.
    let pods = [
        (victim_ns.as_str(), "victim-0", 3),
        (victim_ns.as_str(), "squatter-0", 900),
        (other_ns.as_str(), "intruder-0", 901),
    ];
    let mut specs = Vec::new();
    for (ns, name, step) in pods {
        let dir = work.path().join(name);
        let ckpt = dir.join("ckpt");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::create_dir_all(dir.join("local")).unwrap();
        specs.push(
            TestPod::new(ns, name, node.name())
                .label("jobset.sigs.k8s.io/jobset-name", "victim-js")
                .annotation("spotguard.io/checkpoint", "true")
                .annotation("spotguard.io/checkpoint-dir", &ckpt.display().to_string())
                .annotation("spotguard.io/checkpoint-timeout", "20s")
                .annotation("spotguard.io/checkpoint-upload", &location)
                .command(&["python3", "-c", TRAINER])
                .env(
                    "PYTHONPATH",
                    &repo_root().join("clients/python").display().to_string(),
                )
                .env("SPOTGUARD_DIR", &ckpt.display().to_string())
                .env(
                    "STAGED",
                    &dir.join(format!("local/step-{step}")).display().to_string(),
                )
                .env("STAGED_MIB", "1")
                .env("STEP", &step.to_string())
                .env("RESULT", &dir.join("result").display().to_string())
                .build(),
        );
    }
    specs.push(TestPod::new(&own, OWN_POD, node.name()).build());
    k.run_pods(&specs).await;
    for (ns, name, _) in pods {
        let run = node
            .wait_run(ns, name, "main", Duration::from_secs(30))
            .await;
        assert!(
            process::wait_catches_usr1(run.pid).await,
            "{ns}/{name} did not install its handler"
        );
    }
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let _agent = start_agent(
        &k,
        node.name(),
        &own,
        work.path(),
        &emu.base_url(),
        &format!("s3://{BUCKET}/{{namespace}}"),
        &server.endpoint(),
    )
    .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();

    let answer = |name: &str| std::fs::read_to_string(work.path().join(name).join("result")).ok();
    let answers = until_described(
        "every trainer answered",
        Duration::from_secs(60),
        |seen: &Vec<Option<String>>| Some(format!("{seen:?}")),
        || async {
            let seen: Vec<Option<String>> = pods.iter().map(|(_, n, _)| answer(n)).collect();
            if seen.iter().all(Option::is_some) {
                Ok(seen)
            } else {
                Err(seen)
            }
        },
    )
    .await;
    let manifest = |step: u32| {
        server.object_path(
            BUCKET,
            &format!("{victim_ns}/run1/step-{step}/manifest.json"),
        )
    };
    // Another namespace: refused before anything is taken, nothing under A's prefix.
    assert_eq!(answers[2].as_deref(), Some("refused"), "{answers:?}");
    // The victim's own upload, and the squatter's under the victim's writer (the namespace's
    // own users are not kept apart).
    assert_eq!(answers[0].as_deref(), Some("taken"), "{answers:?}");
    assert_eq!(answers[1].as_deref(), Some("taken"), "{answers:?}");
    let writer = format!("k8s:{victim_ns}/JobSet/victim-js");
    for step in [3, 900] {
        eventually(
            &format!("step-{step} published"),
            Duration::from_secs(60),
            || async { manifest(step).exists() },
        )
        .await;
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(manifest(step)).unwrap()).unwrap();
        assert_eq!(m["writer"], writer.as_str(), "{m}");
    }
    let written: Vec<String> = walk(&server.object_path(BUCKET, &victim_ns))
        .into_iter()
        .filter(|p| p.contains("step-901"))
        .collect();
    assert!(written.is_empty(), "{written:?}");
    assert!(!server.object_path(BUCKET, &other_ns).exists());
}

/// Every file below `dir`.
fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}
