//! The shipped example Job (`daemonset/examples/training-job.yaml`) end to end through the real
//! Job controller and scheduler: a real training process (`examples/train_loop.py` under the
//! Python helper's launcher) checkpoints on each spot interruption of the node under it, and a
//! fresh node with its own agent takes over, four times (more than the Job's `backoffLimit`).
//! The Job completes, every resume starts from exactly the step saved at the notice, no step is
//! lost, and no retry counts against `backoffLimit`. What each interruption cost, as the agents
//! report it (the `InterruptionBadput` / `InterruptionRecovered` Events' records), and the
//! Job's goodput (`spotguard goodput --job`) agree with the harness's ground truth: the
//! trainer's own timeline (`train_loop.py --timeline`), the times it raised each notice, and
//! the Job's start and completion.
//!
//! Only what the harness cannot run is replaced in the example: the trainer's image (and with
//! it the command), and the checkpoint PersistentVolumeClaim (a hostPath every node maps to the
//! same directory: the network storage). The init container runs as shipped (the `spotguard`
//! image) against each node's prefetch cache, seeded as the node's prefetcher would leave it.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{json, Value};
use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard::goodput::event::{EventRecord, Recovery, ANNOTATION};
use spotguard::goodput::record::category;
use spotguard::outcome;
use spotguard::responder::PlanEvent;
use spotguard_testkit::k8s::fixtures::yaml_documents;
use spotguard_testkit::k8s::{Image, Kubelet, TestCluster};
use spotguard_testkit::wait_for_event as wait_for;
use tokio::sync::broadcast::Receiver;
use tokio_util::sync::CancellationToken;

/// Enough that the last run, after four interruptions, trains for several of its agent's
/// recovery passes (it reports the recovery from a running trainer's resume record).
const STEPS: u64 = 600;
/// The tests of this file one at a time: their nodes map the same checkpoint path
/// ([`CHECKPOINT_HOST_PATH`]), each to its own storage, and each drives its Job through the
/// Job controller's backoff on 2 cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const INTERRUPTIONS: usize = 4;
/// Where the replaced PVC lives on every node (the "network storage").
const CHECKPOINT_HOST_PATH: &str = "/mnt/spotguard-test-checkpoints";
const TRAINER_IMAGE: &str = "registry.example/trainer-loop:test";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// The trainer "image": train_loop.py and the Python helper, readable by the Job's uid 1000.
fn trainer_image() -> (tempfile::TempDir, Image) {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o755);
    std::fs::copy(
        repo().join("examples/train_loop.py"),
        dir.path().join("train_loop.py"),
    )
    .unwrap();
    let pkg = dir.path().join("spotguard");
    std::fs::create_dir(&pkg).unwrap();
    for entry in std::fs::read_dir(repo().join("clients/python/spotguard")).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, pkg.join(p.file_name().unwrap())).unwrap();
        }
    }
    for p in [dir.path().join("train_loop.py"), pkg.clone()] {
        chmod(&p, if p.is_dir() { 0o755 } else { 0o644 });
    }
    for entry in std::fs::read_dir(&pkg).unwrap() {
        chmod(&entry.unwrap().path(), 0o644);
    }
    let mut image = Image::default().with_files(dir.path(), "/app");
    // As a trainer image's Dockerfile would set them: the helper importable, and output not
    // held in Python's block buffer (so the log shows progress as it happens).
    image.env = vec![
        ("PYTHONPATH".into(), "/app".into()),
        ("PYTHONUNBUFFERED".into(), "1".into()),
    ];
    (dir, image)
}

/// The example Job with the trainer's image and command, and the checkpoint volume, replaced;
/// its pods go only to this test's nodes (the tests of this file run side by side).
fn example_job(k: &TestCluster, namespace: &str) -> Job {
    let text =
        std::fs::read_to_string(repo().join("daemonset/examples/training-job.yaml")).unwrap();
    let mut job: Value = yaml_documents(&text)
        .unwrap()
        .into_iter()
        .find(|d| d["kind"] == "Job")
        .expect("the example's Job");
    job["metadata"]["namespace"] = json!(namespace);
    let spec = &mut job["spec"]["template"]["spec"];
    spec["nodeSelector"] = json!(k.node_selector());
    let trainer = spec["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "trainer")
        .expect("trainer container");
    trainer["image"] = json!(TRAINER_IMAGE);
    trainer["command"] = json!([
        "python3",
        "-m",
        "spotguard",
        "launch",
        "--",
        "python3",
        "/app/train_loop.py"
    ]);
    trainer["args"] = json!([
        "--ckpt-dir",
        "/checkpoints",
        "--steps",
        STEPS.to_string(),
        "--step-time",
        "0.05",
        "--save-time",
        "0.1",
        "--load-time",
        "0.1",
        "--log-every",
        "20",
        "--timeline"
    ]);
    let volumes = spec["volumes"].as_array_mut().unwrap();
    let pvc = volumes
        .iter_mut()
        .find(|v| v["persistentVolumeClaim"].is_object())
        .expect("the checkpoint PVC");
    let name = pvc["name"].clone();
    *pvc =
        json!({ "name": name, "hostPath": { "path": CHECKPOINT_HOST_PATH, "type": "Directory" } });
    serde_json::from_value(job).unwrap()
}

/// One machine: a node with its kubelet, its metadata emulator and its own agent.
struct Machine {
    kubelet: Kubelet,
    emu: emulator::EmulatorHandle,
    app: app::App,
    cancel: CancellationToken,
    _dirs: tempfile::TempDir,
}

impl Machine {
    async fn start(k: &TestCluster, i: usize, image: &Image, checkpoints: &Path) -> Machine {
        let dirs = tempfile::tempdir().unwrap();
        // The node's prefetch cache, with the example's dataset complete (what the node's
        // prefetcher leaves; the Job's init container waits for it).
        let cache = dirs.path().join("cache");
        let paths = spotguard::prefetch::cache::DatasetPaths::new(&cache, "c4-en");
        std::fs::create_dir_all(paths.complete.parent().unwrap()).unwrap();
        let marker = spotguard::prefetch::cache::CompleteMarker {
            source: "s3://example-datasets/tokenized/c4-en/".into(),
            finished_at: jiff::Timestamp::now().to_string(),
            objects: 1,
            bytes: 4,
        };
        std::fs::write(&paths.complete, serde_json::to_vec(&marker).unwrap()).unwrap();
        std::fs::write(paths.dir.join("shard-0"), b"data").unwrap();
        for p in [dirs.path().to_path_buf(), cache.clone(), paths.dir.clone()] {
            chmod(&p, 0o755);
        }
        let kubelet = k
            .node(
                k.node_config(&format!("spot-{i}"))
                    .capacity("nvidia.com/gpu", "8")
                    .host_path("/var/cache/spotguard", &cache)
                    .host_path(CHECKPOINT_HOST_PATH, checkpoints)
                    .image(
                        "spotguard:0.1.0",
                        Image::binary(env!("CARGO_BIN_EXE_spotguard")),
                    )
                    .image(TRAINER_IMAGE, image.clone()),
            )
            .await;
        let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
            .await
            .unwrap();
        std::fs::write(dirs.path().join("boot_id"), format!("boot-{i}\n")).unwrap();
        let argv: Vec<String> = vec![
            "--mode=kubernetes".into(),
            format!("--node-name={}", kubelet.name()),
            "--cloud=aws".into(),
            format!("--metadata-endpoint={}", emu.base_url()),
            "--poll-interval=200ms".into(),
            format!("--state-dir={}", dirs.path().join("state").display()),
            format!("--boot-id-file={}", dirs.path().join("boot_id").display()),
            "--metrics-addr=127.0.0.1:0".into(),
            "--gpu=off".into(),
            format!(
                "--log-level={}",
                std::env::var("SG_TEST_LOG").unwrap_or_else(|_| "warn".into())
            ),
            "--shutdown-grace=0s".into(),
        ];
        let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
        let cfg = Config::resolve(args, &config::ProcessEnv).unwrap();
        spotguard::telemetry::init(config::LogFormat::Text, &cfg.args.log_level);
        let cancel = CancellationToken::new();
        let app = app::start_with_client(cfg, cancel.clone(), Some(k.agent_client()))
            .await
            .unwrap();
        Machine {
            kubelet,
            emu,
            app,
            cancel,
            _dirs: dirs,
        }
    }

    /// A spot interruption notice on this instance's metadata service: when the harness raised
    /// it, and the agent's plan events from then on.
    fn raise_interruption(&mut self) -> (Timestamp, Receiver<PlanEvent>) {
        let events = std::mem::replace(&mut self.app.events, tokio::sync::broadcast::channel(1).1);
        let at = Timestamp::now();
        self.emu.raise(EmulatedNotice::interruption()).unwrap();
        (at, events)
    }

    /// The instance goes: its agent stops, its node is deleted.
    async fn stop(self) {
        self.cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.app.join).await;
        self.kubelet.delete_node();
    }
}

async fn job_pods(k: &TestCluster, ns: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(k.admin(), ns);
    let mut v = pods
        .list(&ListParams::default().labels("batch.kubernetes.io/job-name=llm-finetune"))
        .await
        .unwrap()
        .items;
    v.sort_by(|a, b| {
        a.metadata
            .creation_timestamp
            .cmp(&b.metadata.creation_timestamp)
    });
    v
}

fn phase(p: &Pod) -> &str {
    p.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// The first number after `prefix` in `log` (every occurrence).
fn numbers_after(log: &str, prefix: &str) -> Vec<u64> {
    log.match_indices(prefix)
        .filter_map(|(i, _)| {
            let rest = &log[i + prefix.len()..];
            let digits: String = rest
                .trim_start_matches(|c: char| !c.is_ascii_digit())
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .collect()
}

/// The checkpoint storage every node mounts, writable by the Job's uid (the PVC with its
/// fsGroup 1000).
fn checkpoint_storage() -> tempfile::TempDir {
    let checkpoints = tempfile::tempdir().unwrap();
    std::os::unix::fs::chown(checkpoints.path(), Some(1000), Some(1000)).unwrap();
    chmod(checkpoints.path(), 0o775);
    checkpoints
}

/// The Job's pod running on `machine`'s node whose trainer log satisfies `progressing`: its
/// name. Fails after `limit` (`what`: which interruption or attempt waits).
async fn trainer_on(
    k: &TestCluster,
    ns: &str,
    machine: &Machine,
    what: &str,
    limit: Duration,
    progressing: impl Fn(&str) -> bool,
) -> String {
    let start = Instant::now();
    loop {
        let on_node = job_pods(k, ns).await.into_iter().find(|p| {
            phase(p) == "Running"
                && p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                    == Some(machine.kubelet.name())
        });
        if let Some(p) = on_node {
            let name = p.metadata.name.clone().unwrap();
            if progressing(&machine.kubelet.logs(ns, &name, "trainer")) {
                return name;
            }
        }
        assert!(
            start.elapsed() < limit,
            "{what}: no trainer making progress on {}: {:?}",
            machine.kubelet.name(),
            job_pods(k, ns)
                .await
                .iter()
                .map(|p| (
                    p.metadata.name.clone(),
                    p.spec.as_ref().and_then(|s| s.node_name.clone()),
                    phase(p).to_string()
                ))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `pod` has finished (or is gone: a pod the drain evicted between its ack and its
/// exit is deleted); its last state.
async fn wait_finished(k: &TestCluster, ns: &str, pod: &str) -> Option<Pod> {
    k.wait_pod(ns, pod, "finished", Duration::from_secs(60), |p| {
        p.is_none_or(|p| matches!(phase(p), "Failed" | "Succeeded"))
    })
    .await
}

/// Waits for the plan's `Done` event.
async fn wait_done(events: &mut Receiver<PlanEvent>, limit: Duration) {
    wait_for(events, limit, |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Ground truth and what the agents reported.

/// The trainer's own timeline (`train_loop.py --timeline`: `timeline EVENT at=UNIX key=value`),
/// on its clock (the host's: every node of the harness is this machine).
#[derive(Debug, Default)]
struct TrainerTimeline {
    /// (checkpoint step, seconds its load took).
    restored: Option<(u64, f64)>,
    /// (step, when it finished): the first step trained in this run.
    first_step: Option<(u64, f64)>,
    /// (step, when the signal arrived): the last step trained.
    signal: Option<(u64, f64)>,
    /// (step, when the `done` ack was written).
    saved: Option<(u64, f64)>,
    /// Right before the process exited 143.
    exit: Option<f64>,
    /// (step, when): trained to the end.
    finished: Option<(u64, f64)>,
}

fn trainer_timeline(log: &str) -> TrainerTimeline {
    let mut t = TrainerTimeline::default();
    for line in log.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("timeline") {
            continue;
        }
        let Some(event) = words.next() else { continue };
        let fields: BTreeMap<&str, &str> = words.filter_map(|w| w.split_once('=')).collect();
        let num = |k: &str| -> f64 {
            fields
                .get(k)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("timeline line without {k}: {line:?}"))
        };
        let step = || num("step") as u64;
        match event {
            "restored" => t.restored = Some((step(), num("seconds"))),
            "first_step" => t.first_step = Some((step(), num("at"))),
            "signal" => t.signal = Some((step(), num("at"))),
            "saved" => t.saved = Some((step(), num("at"))),
            "exit" => t.exit = Some(num("at")),
            "finished" => t.finished = Some((step(), num("at"))),
            other => panic!("unknown timeline event {other:?} in {line:?}"),
        }
    }
    t
}

fn unix(t: Timestamp) -> f64 {
    t.as_nanosecond() as f64 / 1e9
}

/// One goodput Event: its reason, the pod it regards, its record.
#[derive(Debug)]
struct GoodputEvent {
    reason: String,
    pod: String,
    record: EventRecord,
}

/// The goodput Events of `ns` (`InterruptionBadput`, `InterruptionRecovered`) with their
/// `spotguard.io/goodput` records, read as an admin.
async fn goodput_events(k: &TestCluster, ns: &str) -> Vec<GoodputEvent> {
    let api: Api<Event> = Api::namespaced(k.admin(), ns);
    let list = api.list(&ListParams::default()).await.unwrap();
    list.items
        .into_iter()
        .filter(|e| {
            matches!(
                e.reason.as_deref(),
                Some(outcome::reason::BADPUT | outcome::reason::RECOVERED)
            )
        })
        .map(|e| {
            let text = e
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ANNOTATION))
                .unwrap_or_else(|| panic!("goodput Event without {ANNOTATION}: {e:?}"));
            GoodputEvent {
                reason: e.reason.clone().unwrap_or_default(),
                pod: e
                    .regarding
                    .as_ref()
                    .and_then(|r| r.name.clone())
                    .unwrap_or_default(),
                record: serde_json::from_str(text)
                    .unwrap_or_else(|err| panic!("{ANNOTATION} {text:?}: {err}")),
            }
        })
        .collect()
}

/// Waits until the agent of `pod`'s node reported its recovery (an `InterruptionRecovered`
/// Event on it): the trainer must still run then, since the agent reads its resume record.
async fn wait_recovered(k: &TestCluster, ns: &str, pod: &str, limit: Duration) -> Recovery {
    let start = Instant::now();
    loop {
        let found = goodput_events(k, ns)
            .await
            .into_iter()
            .find_map(|e| match e {
                GoodputEvent {
                    pod: p,
                    record: EventRecord::Recovery(r),
                    ..
                } if p == pod => Some(r),
                _ => None,
            });
        if let Some(r) = found {
            return r;
        }
        assert!(
            start.elapsed() < limit,
            "no {} Event on {pod} in {limit:?}: {:?}",
            outcome::reason::RECOVERED,
            goodput_events(k, ns).await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How far the agents' figures may be from the trainer's own clock, and why.
mod tolerance {
    /// Two clock reads of one process a few statements apart (the helper's timestamps vs the
    /// trainer's `timeline` lines around the same call), on 2 cores shared with the control
    /// plane, five kubelets and their agents: a Python process can be descheduled for tens of
    /// ms between two statements.
    pub const SAME_PROCESS: f64 = 0.1;
    /// The agent's view of a trainer's ack (or exit) lags it by at most one watcher poll
    /// (`checkpoint::run::POLL_INTERVAL`, 50 ms), and its signal reaches the trainer through
    /// the launcher's forwarding; both are threads or processes waiting for a CPU on the same
    /// loaded 2 cores.
    pub const AGENT_VIEW: f64 = 0.5;
    /// The agent sees a notice within one metadata poll (`--poll-interval=200ms`) of the
    /// harness raising it, plus the same scheduling slack.
    pub const DETECTION: f64 = 0.2 + AGENT_VIEW;
}

/// `agent` (what the agent reported) against `truth` (the trainer's own clock): at least
/// `truth - below`, at most `truth + above`. `what`'s first line names the figure; the rest
/// (the run's logs) follows the numbers in a failure.
fn close(what: &str, agent: Option<f64>, truth: f64, below: f64, above: f64) {
    let (name, context) = what.split_once('\n').unwrap_or((what, ""));
    let agent =
        agent.unwrap_or_else(|| panic!("{name}: not reported (truth {truth:.3}s)\n{context}"));
    assert!(
        agent >= truth - below && agent <= truth + above,
        "{name}: agent {agent:.3}s, trainer's own clock {truth:.3}s (allowed -{below}s/+{above}s)\n{context}"
    );
}

/// Interruption `i` as the harness saw it.
struct Raised {
    /// When the harness raised the notice (its clock).
    at: Timestamp,
    /// The step in the agent's `Checkpointed` result.
    acked_step: Option<u64>,
}

/// Raises a spot interruption on `machine` and follows its plan to the end: the trainer
/// `pod` acks (its step returned), the plan is done, the pod has finished.
async fn interrupt(k: &TestCluster, ns: &str, machine: &mut Machine, pod: &str) -> Raised {
    let (at, mut events) = machine.raise_interruption();
    let results = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(
        results[0].outcome.as_str(),
        "acked",
        "{results:?}\ntrainer log:\n{}",
        machine.kubelet.logs(ns, pod, "trainer")
    );
    // "… step=N …" in the group's detail.
    let acked_step = numbers_after(&results[0].detail, "step=").first().copied();
    wait_done(&mut events, Duration::from_secs(60)).await;
    // The trainer's pod has finished on the old node.
    wait_finished(k, ns, pod).await;
    Raised { at, acked_step }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_job_survives_more_interruptions_than_its_backoff_limit_losing_no_step() {
    let _one = ONE_AT_A_TIME.lock().await;
    let k = TestCluster::new().await;
    let ns = k.namespace("ml").await;
    let (_image_dir, image) = trainer_image();
    let checkpoints = checkpoint_storage();

    let job = example_job(&k, &ns);
    let backoff_limit = job.spec.as_ref().and_then(|s| s.backoff_limit).unwrap();
    assert!(
        (INTERRUPTIONS as i32) > backoff_limit,
        "more interruptions ({INTERRUPTIONS}) than backoffLimit ({backoff_limit})"
    );
    let mut machine = Machine::start(&k, 0, &image, checkpoints.path()).await;
    let jobs: Api<Job> = Api::namespaced(k.admin(), &ns);
    jobs.create(&PostParams::default(), &job)
        .await
        .expect("the example Job is accepted");

    // Trainer logs by pod name, kept when a node goes away.
    let mut logs: BTreeMap<String, String> = BTreeMap::new();
    // The trainers' pods in the order they trained.
    let mut order: Vec<String> = Vec::new();
    let mut raised: Vec<Raised> = Vec::new();
    for i in 1..=INTERRUPTIONS {
        // The trainer trains on this machine's node.
        let pod = trainer_on(
            &k,
            &ns,
            &machine,
            &format!("interruption {i}"),
            Duration::from_secs(90),
            |log| log.contains("step 20 ") || log.contains("  loss"),
        )
        .await;
        // A fresh machine joins; the spot interruption hits the current one.
        let next = Machine::start(&k, i, &image, checkpoints.path()).await;
        if i > 1 {
            // This node's agent has told the recovery from the last interruption (it reads the
            // resume record of a running trainer only).
            wait_recovered(&k, &ns, &pod, Duration::from_secs(60)).await;
        }
        raised.push(interrupt(&k, &ns, &mut machine, &pod).await);
        // Keep its log (by its name: a pod the drain evicted between its ack and its exit is
        // gone from the API, its log is still the kubelet's), then the instance goes.
        order.push(pod.clone());
        logs.insert(pod.clone(), machine.kubelet.logs(&ns, &pod, "trainer"));
        machine.stop().await;
        machine = next;
    }

    // The last machine trains to the end: the Job completes.
    let start = Instant::now();
    let (done, job_times) = loop {
        let j = jobs.get("llm-finetune").await.unwrap();
        let status = j.status.clone().unwrap_or_default();
        let cond = |t: &str| {
            status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == t && c.status == "True")
        };
        if cond("Complete") {
            let times = (
                status.start_time.clone().expect("startTime").0,
                status.completion_time.clone().expect("completionTime").0,
            );
            break (status, times);
        }
        assert!(!cond("Failed"), "the Job failed: {:?}", status.conditions);
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the Job did not complete: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for p in job_pods(&k, &ns).await {
        let name = p.metadata.name.clone().unwrap();
        let log = machine.kubelet.logs(&ns, &name, "trainer");
        if !log.is_empty() {
            logs.insert(name, log);
        }
    }
    assert_eq!(done.succeeded, Some(1), "{done:?}");
    assert_eq!(
        done.failed.unwrap_or(0),
        0,
        "no interruption counted as a failure: {done:?}"
    );

    // Every trainer, in order: where it resumed, where it saved.
    let pods = job_pods(&k, &ns).await;
    for p in &pods {
        let finished = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.name == "trainer"))
            .and_then(|c| c.state.as_ref()?.terminated.as_ref())
            .map(|t| (t.exit_code, t.finished_at.clone()));
        eprintln!(
            "{} created {:?} on {:?}: {} {:?}",
            p.metadata.name.as_deref().unwrap_or(""),
            p.metadata.creation_timestamp.as_ref().map(|t| t.0),
            p.spec.as_ref().and_then(|s| s.node_name.clone()),
            phase(p),
            finished
        );
    }
    for p in &pods {
        let name = p.metadata.name.clone().unwrap();
        if logs.contains_key(&name) && !order.contains(&name) {
            order.push(name);
        }
    }
    let mut chain: Vec<(String, u64, Option<u64>)> = Vec::new();
    for name in &order {
        let Some(log) = logs.get(name) else { continue };
        let resumed = numbers_after(log, "resumed from step")
            .first()
            .copied()
            .unwrap_or(0);
        let saved = numbers_after(log, "saved /checkpoints/step-")
            .last()
            .copied();
        chain.push((name.clone(), resumed, saved));
    }
    let acked_steps: Vec<Option<u64>> = raised.iter().map(|r| r.acked_step).collect();
    let summary = format!("{chain:?}\nacked steps {acked_steps:?}\nlogs: {logs:#?}");
    assert_eq!(chain.len(), INTERRUPTIONS + 1, "{summary}");
    assert_eq!(
        chain[0].1, 0,
        "the first run starts from scratch: {summary}"
    );
    for w in chain.windows(2) {
        let saved = w[0]
            .2
            .unwrap_or_else(|| panic!("{} saved nothing: {summary}", w[0].0));
        assert_eq!(
            w[1].1, saved,
            "{} resumed from {} but {} saved {saved} at the notice: {summary}",
            w[1].0, w[1].1, w[0].0
        );
    }
    // The steps saved at the notices are the ones the agent saw acknowledged.
    let saved: Vec<Option<u64>> = chain[..INTERRUPTIONS].iter().map(|c| c.2).collect();
    assert_eq!(saved, acked_steps, "{summary}");
    let last = &logs[&chain[INTERRUPTIONS].0];
    assert!(
        last.contains(&format!("training finished at step {STEPS}")),
        "{summary}"
    );

    // What each interruption cost, as the agents reported it, against the trainers' own clock.
    let timelines: Vec<TrainerTimeline> = chain
        .iter()
        .map(|(name, ..)| trainer_timeline(&logs[name]))
        .collect();
    let events = goodput_events(&k, &ns).await;
    // The trainers' sums over the Job (seconds): signal → ack, ack → the next first step
    // (restore included), the restores.
    #[derive(Default)]
    struct Sums {
        save: f64,
        recovery: f64,
        restore: f64,
    }
    let mut truth = Sums::default();
    for i in 0..INTERRUPTIONS {
        let (pod, next_pod) = (&chain[i].0, &chain[i + 1].0);
        let (t, next) = (&timelines[i], &timelines[i + 1]);
        let what = |m: &str| format!("interruption {}: {m}\n{summary}", i + 1);
        let (Some((stopped, signal_at)), Some((saved_step, saved_at)), Some(exit_at)) =
            (t.signal, t.saved, t.exit)
        else {
            panic!(
                "{}",
                what(&format!("{pod}'s timeline is incomplete: {t:?}"))
            );
        };
        let (Some((restored_step, restore)), Some((first, first_at))) =
            (next.restored, next.first_step)
        else {
            panic!(
                "{}",
                what(&format!("{next_pod}'s timeline is incomplete: {next:?}"))
            );
        };
        assert_eq!(first, restored_step + 1, "{}", what("first step"));
        // Ground truth: thrown away = trained on the old node, not resumed from.
        let truth_lost = stopped - restored_step;
        let badput = events
            .iter()
            .find_map(|e| match &e.record {
                EventRecord::Badput(b) if e.pod == *pod && e.reason == outcome::reason::BADPUT => {
                    Some(b)
                }
                _ => None,
            })
            .unwrap_or_else(|| {
                panic!("{}", what(&format!("no badput Event on {pod}: {events:?}")))
            });
        let recovery = events
            .iter()
            .find_map(|e| match &e.record {
                EventRecord::Recovery(r) if e.pod == *next_pod => Some(r),
                _ => None,
            })
            .unwrap_or_else(|| {
                panic!(
                    "{}",
                    what(&format!("no recovery Event on {next_pod}: {events:?}"))
                )
            });
        assert_eq!(badput.targets.len(), 1, "{}", what(&format!("{badput:?}")));
        let target = &badput.targets[0];
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        eprintln!(
            "interruption {} (trainer's clock / agent's): save {:.3}/{}s, down {:.3}/{}s, \
             recovery {:.3}/{:.3}s, restore {restore:.3}/{}s, steps lost {truth_lost}/{:?}",
            i + 1,
            saved_at - signal_at,
            opt(target.save_seconds),
            exit_at - signal_at,
            opt(target.downtime_seconds),
            first_at - saved_at,
            recovery.recovery_seconds,
            opt(recovery.restore_seconds),
            target.wasted_steps,
        );
        assert_eq!(target.target, format!("{ns}/{pod}"), "{}", what("target"));
        assert_eq!(target.outcome, "acked", "{}", what("outcome"));
        assert_eq!(target.step, Some(saved_step), "{}", what("acked step"));
        assert_eq!(
            recovery.notice_id,
            badput.notice_id,
            "{}",
            what("the recovery names its interruption")
        );
        assert_eq!(
            recovery.from_node.as_deref(),
            Some(badput.node.as_str()),
            "{}",
            what("from node")
        );
        assert_eq!(recovery.step, restored_step, "{}", what("resumed step"));
        // The harness's own clock: the notice raised → seen → signalled → the trainer's signal.
        let seen = badput
            .seen_at
            .unwrap_or_else(|| panic!("{}", what("no seen_at")));
        let signalled = badput
            .signalled_at
            .unwrap_or_else(|| panic!("{}", what("no signalled_at")));
        close(
            &what("detection (harness raised → agent saw)"),
            Some(unix(seen) - unix(raised[i].at)),
            0.0,
            0.0,
            tolerance::DETECTION,
        );
        assert!(signalled >= seen, "{}", what("signalled before seen"));
        close(
            &what("signal delivery (agent signalled → trainer caught)"),
            Some(signal_at - unix(signalled)),
            0.0,
            tolerance::SAME_PROCESS,
            tolerance::AGENT_VIEW,
        );
        // Save (signal → ack) and downtime (signal → exit): from the agent's signal to its
        // view of the ack, so never shorter than the trainer's own, by at most its view's lag.
        close(
            &what("save"),
            target.save_seconds,
            saved_at - signal_at,
            tolerance::SAME_PROCESS,
            tolerance::AGENT_VIEW,
        );
        close(
            &what("downtime"),
            target.downtime_seconds,
            exit_at - signal_at,
            tolerance::SAME_PROCESS,
            tolerance::AGENT_VIEW,
        );
        assert_eq!(
            truth_lost,
            0,
            "{}",
            what("every trainer acks the step it stopped at")
        );
        assert_eq!(
            target.wasted_steps,
            Some(truth_lost),
            "{}",
            what("steps thrown away")
        );
        assert_eq!(
            target.wasted_seconds,
            Some(0.0),
            "{}",
            what("seconds thrown away")
        );
        // Recovery (old trainer's ack → first step of the next) and restore: the helper's clock
        // reads, in the same processes as the trainer's lines around them.
        close(
            &what("recovery"),
            Some(recovery.recovery_seconds),
            first_at - saved_at,
            tolerance::SAME_PROCESS,
            tolerance::SAME_PROCESS,
        );
        close(
            &what("restore"),
            recovery.restore_seconds,
            restore,
            1e-3,
            1e-3,
        );
        truth.save += saved_at - signal_at;
        truth.recovery += first_at - saved_at;
        truth.restore += restore;
    }

    assert_eq!(
        timelines[INTERRUPTIONS].finished.map(|f| f.0),
        Some(STEPS),
        "the last trainer's timeline ends at the last step: {summary}"
    );

    // The whole Job: `spotguard goodput` (the built binary, an admin's kubeconfig) against the
    // harness's figure with the same definition (paid: the Job's startTime → completionTime;
    // badput: save + thrown away + recovery (restore included); start-up before the first step
    // and the time after the last one are not charged).
    let paid = unix(job_times.1) - unix(job_times.0);
    let truth_badput = truth.save + truth.recovery;
    let truth_goodput = 100.0 * (paid - truth_badput) / paid;
    let report = goodput_report(&k, &ns, true);
    let table = goodput_report(&k, &ns, false);
    eprintln!(
        "spotguard goodput --namespace {ns} --job llm-finetune\n{}",
        table.as_str().unwrap_or("")
    );
    let totals = &report["totals"];
    let number = |key: &str| {
        totals[key]
            .as_f64()
            .unwrap_or_else(|| panic!("no totals.{key} in {report:#}"))
    };
    // Paid time: the same two fields of the same Job, read by both.
    assert!(
        (number("paid_seconds") - paid).abs() < 1e-6,
        "paid: the harness {paid}s (the Job's startTime → completionTime): {report:#}"
    );
    assert_eq!(totals["steps_lost"], 0, "no step thrown away: {report:#}");
    assert_eq!(
        (&totals["interruptions"], &totals["recoveries"]),
        (&json!(INTERRUPTIONS), &json!(INTERRUPTIONS)),
        "{report:#}"
    );
    // Each category over the Job against the trainers' sums, with the per-interruption
    // tolerances added up.
    let category = |name: &str| {
        totals["badput_seconds"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c[0] == name)
            .and_then(|c| c[1].as_f64())
            .unwrap_or_else(|| panic!("no {name} in totals.badput_seconds: {report:#}"))
    };
    let n = INTERRUPTIONS as f64;
    close(
        "the Job's checkpoint_save",
        Some(category(category::CHECKPOINT_SAVE)),
        truth.save,
        n * tolerance::SAME_PROCESS,
        n * tolerance::AGENT_VIEW,
    );
    close(
        "the Job's wasted_progress",
        Some(category(category::WASTED_PROGRESS)),
        0.0,
        0.0,
        0.0,
    );
    close(
        "the Job's checkpoint_restore",
        Some(category(category::CHECKPOINT_RESTORE)),
        truth.restore,
        n * 1e-3,
        n * 1e-3,
    );
    close(
        "the Job's infrastructure_recovery + checkpoint_restore",
        Some(category(category::INFRASTRUCTURE_RECOVERY) + category(category::CHECKPOINT_RESTORE)),
        truth.recovery,
        n * tolerance::SAME_PROCESS,
        n * tolerance::SAME_PROCESS,
    );
    let reported = number("goodput_percent");
    // Each interruption's save may read up to AGENT_VIEW longer than the trainer's own; the
    // recoveries are the helper's clock reads (SAME_PROCESS each).
    let allowed =
        100.0 * (INTERRUPTIONS as f64 * (tolerance::AGENT_VIEW + tolerance::SAME_PROCESS)) / paid;
    eprintln!(
        "goodput: harness {truth_goodput:.2}% (paid {paid:.0}s, badput {truth_badput:.2}s), spotguard goodput {reported:.2}%"
    );
    assert!(
        (reported - truth_goodput).abs() <= allowed,
        "spotguard goodput says {reported:.2}%, the harness {truth_goodput:.2}% (allowed ±{allowed:.2}): {report:#}"
    );
}

/// `spotguard goodput --namespace NS --job llm-finetune` (`--json`: parsed; else the table as a
/// string), the built binary with an admin's kubeconfig.
fn goodput_report(k: &TestCluster, ns: &str, json: bool) -> Value {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["goodput", "--namespace", ns, "--job", "llm-finetune"])
        .args(json.then_some("--json"))
        .arg("--kubeconfig")
        .arg(&k.cp.admin_kubeconfig)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "spotguard goodput: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    if !json {
        return Value::String(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "spotguard goodput --json: {e}\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The trainer of [`the_example_jobs_rules_ignore_every_kind_of_preemption_and_fail_a_real_failure`]:
/// each attempt (counted in the shared checkpoint storage) is another kind of trainer.
const KINDS_TRAINER: &str = r#"
n=$(cat /checkpoints/attempts 2>/dev/null || echo 0); n=$((n+1)); echo $n > /checkpoints/attempts
echo "attempt $n"
case $n in
  # With the helper: saves, acks and exits 143.
  1) trap 'printf "{\"state\":\"done\",\"step\":$n,\"checkpoint\":\"c\",\"ts\":%s}" $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$$.json"; exit 143' USR1 ;;
  # Catches the signal but never gets to ack: killed at the power-off (137).
  2) trap 'echo saving' USR1 ;;
  # Never had the helper: the signal is not for it; the drain's SIGTERM ends it.
  3) ;;
  *) echo "training finished"; exit 0 ;;
esac
echo training
while :; do sleep 0.05; done
"#;

/// The example Job with the trainer replaced by `script` (its image's bash).
fn job_running(k: &TestCluster, ns: &str, name: &str, script: &str) -> Job {
    let mut job = serde_json::to_value(example_job(k, ns)).unwrap();
    job["metadata"]["name"] = json!(name);
    let trainer = job["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == "trainer")
        .unwrap();
    trainer["command"] = json!(["bash", "-c", script]);
    trainer["args"] = json!([]);
    serde_json::from_value(job).unwrap()
}

async fn job_condition(jobs: &Api<Job>, name: &str, limit: Duration) -> (String, Job) {
    let start = Instant::now();
    loop {
        let j = jobs.get(name).await.unwrap();
        let status = j.status.clone().unwrap_or_default();
        let done = status
            .conditions
            .iter()
            .flatten()
            .find(|c| matches!(c.type_.as_str(), "Complete" | "Failed") && c.status == "True");
        if let Some(c) = done {
            return (c.type_.clone(), j);
        }
        assert!(
            start.elapsed() < limit,
            "Job {name} did not finish: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Issue 36 item 2, through the real Job controller: the example Job's rules (DisruptionTarget
/// first, the exit code as the fallback) let no kind of preemption count against
/// `backoffLimit` — a trainer that acks and exits 143, one killed at the power-off without an
/// ack (137: only the DisruptionTarget the agent set right after the signal says it was a
/// preemption), one without the helper (ended by the drain) — and the Job completes; a plain
/// failure (exit 1, no notice) still fails the Job at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_jobs_rules_ignore_every_kind_of_preemption_and_fail_a_real_failure() {
    let _one = ONE_AT_A_TIME.lock().await;
    let k = TestCluster::new().await;
    let ns = k.namespace("ml").await;
    let (_image_dir, image) = trainer_image();
    let checkpoints = checkpoint_storage();
    let mut machine = Machine::start(&k, 0, &image, checkpoints.path()).await;
    let jobs: Api<Job> = Api::namespaced(k.admin(), &ns);
    jobs.create(
        &PostParams::default(),
        &job_running(&k, &ns, "llm-finetune", KINDS_TRAINER),
    )
    .await
    .expect("the Job is accepted");

    for attempt in 1..=3 {
        let pod = trainer_on(
            &k,
            &ns,
            &machine,
            &format!("attempt {attempt}"),
            Duration::from_secs(120),
            |log| log.contains("training"),
        )
        .await;
        let run = machine
            .kubelet
            .wait_run(&ns, &pod, "trainer", Duration::from_secs(10))
            .await;
        if attempt < 3 {
            assert!(spotguard_testkit::process::wait_catches_usr1(run.pid).await);
        }
        let next = Machine::start(&k, attempt, &image, checkpoints.path()).await;
        let (_, mut events) = machine.raise_interruption();
        if attempt == 2 {
            // The power-off, after the agent marked the pod: the trainer dies without an ack.
            k.wait_pod(
                &ns,
                &pod,
                "DisruptionTarget",
                Duration::from_secs(30),
                |p| {
                    p.and_then(|p| p.status.as_ref()?.conditions.as_ref())
                        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "DisruptionTarget"))
                },
            )
            .await;
            // SAFETY: kill(2) of the container's process, a child of the kubelet stand-in.
            unsafe {
                libc::kill(run.pid as i32, libc::SIGKILL);
            }
        }
        wait_done(&mut events, Duration::from_secs(120)).await;
        let finished = wait_finished(&k, &ns, &pod).await;
        let code = finished
            .as_ref()
            .and_then(|p| p.status.as_ref()?.container_statuses.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.name == "trainer"))
            .and_then(|c| c.state.as_ref()?.terminated.as_ref())
            .map(|t| t.exit_code);
        eprintln!("attempt {attempt}: {pod} ended with {code:?}");
        if attempt == 2 {
            assert_eq!(code, Some(137), "killed at the power-off");
        }
        machine.stop().await;
        machine = next;
    }
    let (outcome, job) = job_condition(&jobs, "llm-finetune", Duration::from_secs(180)).await;
    let status = job.status.unwrap_or_default();
    assert_eq!(outcome, "Complete", "{status:?}");
    assert_eq!(status.succeeded, Some(1), "{status:?}");
    assert_eq!(
        status.failed.unwrap_or(0),
        0,
        "no preemption counted against backoffLimit: {status:?}"
    );

    // Not a preemption: exit 1 with no notice fails the Job at once.
    jobs.create(
        &PostParams::default(),
        &job_running(&k, &ns, "broken", "echo 'a bug'; exit 1"),
    )
    .await
    .unwrap();
    let (outcome, job) = job_condition(&jobs, "broken", Duration::from_secs(60)).await;
    let status = job.status.unwrap_or_default();
    assert_eq!(outcome, "Failed", "{status:?}");
    let reason = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Failed")
        .and_then(|c| c.reason.clone());
    assert_eq!(reason.as_deref(), Some("PodFailurePolicy"), "{status:?}");
    machine.stop().await;
}
