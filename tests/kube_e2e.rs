//! Kubernetes mode end to end: the metadata emulator (real wire protocol) → the agent in
//! Kubernetes mode (`app::start_with_client`) → an in-process API server (resource versions,
//! 409s, PDB 429s, grace periods, field selectors, Events) → a real training process placed in a
//! real cgroup with a kubelet-shaped path, found from its fake pod's UID and container ID.
//!
//! Needs root and the cgroup v1 `name=systemd` hierarchy at /sys/fs/cgroup/systemd.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerState, ContainerStateRunning, ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard::responder::PlanEvent;
use spotguard_testkit::apiserver::{test_node, FakeApiServer, PdbLimit, TestPod};
use spotguard_testkit::wait_for_event as wait_for;
use spotguard_testkit::{kubelet, metrics_text, process};
use tokio_util::sync::CancellationToken;

const NODE: &str = "gpu-node-1";
const CGROUP_ROOT: &str = "/sys/fs/cgroup/systemd";

/// A training process in a kubelet-shaped cgroup (systemd driver, Burstable QoS, containerd),
/// and the fake pod that describes it.
struct PodProcess {
    child: tokio::process::Child,
    cgroup: PathBuf,
    dir: tempfile::TempDir,
    uid: String,
    container_id: String,
}

const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; printf '"'"'{"state":"done","step":%d,"checkpoint":"ckpt","ts":%s}'"'"' $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

impl PodProcess {
    async fn start() -> PodProcess {
        assert!(
            Path::new(CGROUP_ROOT).join("cgroup.procs").exists(),
            "these tests need root and the cgroup v1 name=systemd hierarchy at {CGROUP_ROOT}"
        );
        let uid = kubelet::pod_uid();
        let container_id = kubelet::container_id();
        let cgroup = kubelet::burstable_cgroup(Path::new(CGROUP_ROOT), &uid, &container_id);
        std::fs::create_dir_all(&cgroup).expect("create cgroup");
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpt")).unwrap();
        let child = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(TRAINER)
            .env("SPOTGUARD_DIR", dir.path().join("ckpt"))
            .env("MARKS", dir.path().join("marks"))
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap();
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string()).expect("join cgroup");
        let p = PodProcess {
            child,
            cgroup,
            dir,
            uid,
            container_id,
        };
        assert!(
            process::wait_catches_usr1(pid).await,
            "trainer did not install its handler"
        );
        p
    }

    fn signals(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("marks"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    /// The fake pod describing this process: opted in, checkpoint dir = our temp dir (the
    /// process's root is the host root, so container paths are host paths here).
    fn pod(&self, name: &str) -> Pod {
        let mut pod = TestPod::new("ml", name, NODE).build();
        pod.metadata.uid = Some(self.uid.clone());
        let ann: BTreeMap<String, String> = [
            ("spotguard.io/checkpoint", "true".to_string()),
            (
                "spotguard.io/checkpoint-dir",
                self.dir.path().join("ckpt").display().to_string(),
            ),
            ("spotguard.io/checkpoint-timeout", "20s".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        pod.metadata.annotations = Some(ann);
        if let Some(status) = pod.status.as_mut() {
            status.container_statuses = Some(vec![ContainerStatus {
                name: "main".into(),
                container_id: Some(format!("containerd://{}", self.container_id)),
                ready: true,
                started: Some(true),
                image: "registry.example/trainer:1".into(),
                image_id: String::new(),
                restart_count: 0,
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }),
                ..Default::default()
            }]);
        }
        pod
    }
}

impl Drop for PodProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        if let Some(pid) = self.child.id() {
            let _ = std::fs::write(Path::new(CGROUP_ROOT).join("cgroup.procs"), pid.to_string());
        }
        // Wait for the process to leave, then remove the cgroup and its now-empty parents.
        for _ in 0..100 {
            if std::fs::remove_dir(&self.cgroup).is_ok() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(pod_slice) = self.cgroup.parent() {
            let _ = std::fs::remove_dir(pod_slice);
        }
    }
}

struct Cluster {
    api: FakeApiServer,
    emu: emulator::EmulatorHandle,
    trainer: PodProcess,
    state: tempfile::TempDir,
    /// `--boot-id-file`: the test "reboots" the machine by changing it.
    boot: tempfile::TempDir,
}

impl Cluster {
    async fn new(cloud: Cloud) -> Cluster {
        let api = FakeApiServer::start().await.unwrap();
        api.add_node(test_node(NODE));
        let trainer = PodProcess::start().await;
        api.add_pod(trainer.pod("trainer-0"));
        for i in 0..3 {
            api.add_pod(
                TestPod::new("web", &format!("web-{i}"), NODE)
                    .label("app", "web")
                    .build(),
            );
        }
        api.add_pod(
            TestPod::new("kube-system", "nvidia-device-plugin", NODE)
                .daemonset()
                .build(),
        );
        api.add_pod(TestPod::new("spotguard", "spotguard-abcde", NODE).build());
        api.add_pod(TestPod::new("web", "elsewhere", "other-node").build());
        let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
        let boot = tempfile::tempdir().unwrap();
        std::fs::write(boot.path().join("boot_id"), "boot-1\n").unwrap();
        Cluster {
            api,
            emu,
            trainer,
            state: tempfile::tempdir().unwrap(),
            boot,
        }
    }

    /// The machine comes back in a new life (stop/start, hibernation, reboot).
    fn reboot(&self, boot_id: &str) {
        std::fs::write(self.boot.path().join("boot_id"), boot_id).unwrap();
    }

    async fn agent(&self, extra: &[&str]) -> (app::App, CancellationToken) {
        let mut argv: Vec<String> = vec![
            "--mode=kubernetes".into(),
            format!("--node-name={NODE}"),
            format!("--cloud={}", self.emu.cloud().as_str()),
            format!("--metadata-endpoint={}", self.emu.base_url()),
            "--poll-interval=200ms".into(),
            format!("--state-dir={}", self.state.path().display()),
            format!(
                "--boot-id-file={}",
                self.boot.path().join("boot_id").display()
            ),
            "--metrics-addr=127.0.0.1:0".into(),
            "--gpu=off".into(),
            format!(
                "--log-level={}",
                std::env::var("SG_TEST_LOG").unwrap_or_else(|_| "warn".into())
            ),
            "--shutdown-grace=0s".into(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
        let mut cfg = Config::resolve(args, &config::ProcessEnv).unwrap();
        cfg.pod_namespace = Some("spotguard".into());
        cfg.pod_name = Some("spotguard-abcde".into());
        spotguard::telemetry::init(config::LogFormat::Text, &cfg.args.log_level);
        let cancel = CancellationToken::new();
        let app = app::start_with_client(cfg, cancel.clone(), Some(self.api.client()))
            .await
            .unwrap();
        (app, cancel)
    }

    fn node_json(&self) -> serde_json::Value {
        self.api.node_json(NODE).unwrap()
    }

    fn taints(&self) -> Vec<(String, String)> {
        self.node_json()["spec"]["taints"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|t| {
                        (
                            t["key"].as_str().unwrap_or_default().to_string(),
                            t["effect"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn cordoned(&self) -> bool {
        self.node_json()["spec"]["unschedulable"].as_bool() == Some(true)
    }

    fn phase(&self) -> Option<String> {
        let raw = self.node_json()["metadata"]["annotations"]["spotguard.io/notice"]
            .as_str()?
            .to_string();
        let v: serde_json::Value = serde_json::from_str(&raw).ok()?;
        v["phase"].as_str().map(str::to_string)
    }

    fn pod_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .api
            .pods()
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        v.sort();
        v
    }

    fn evictions(&self) -> Vec<String> {
        self.api
            .requests()
            .iter()
            .filter(|r| r.method == "POST" && r.path.ends_with("/eviction"))
            .map(|r| r.path.clone())
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spot_notice_checkpoints_before_the_first_eviction_then_drains_once() {
    let c = Cluster::new(Cloud::Aws).await;
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    let results = wait_for(&mut events, Duration::from_secs(30), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].group, "ml/trainer-0");
    assert_eq!(results[0].outcome.as_str(), "acked", "{results:?}");
    let report = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Drained { report, .. } => Some(report.clone()),
        _ => None,
    })
    .await;
    assert!(report.complete(), "{report:?}");
    wait_for(&mut events, Duration::from_secs(10), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;

    // Signal before the first eviction: the pod's CheckpointSignalled Event precedes it.
    let reqs = c.api.requests();
    let first_eviction = reqs
        .iter()
        .position(|r| r.method == "POST" && r.path.ends_with("/eviction"))
        .expect("evictions");
    let signalled_event = reqs
        .iter()
        .position(|r| {
            r.method == "POST"
                && r.path.contains("events")
                && r.body.contains("CheckpointSignalled")
        })
        .expect("CheckpointSignalled event");
    assert!(signalled_event < first_eviction);

    assert!(c.cordoned());
    assert!(c
        .taints()
        .contains(&("spotguard.io/interruption".into(), "NoSchedule".into())));
    assert_eq!(
        c.pod_names(),
        vec!["elsewhere", "nvidia-device-plugin", "spotguard-abcde"],
        "DaemonSet, own and other nodes' pods stay"
    );
    assert_eq!(c.phase().as_deref(), Some("done"));
    let reasons: Vec<String> = c.api.events().iter().map(|e| e.reason.clone()).collect();
    for r in [
        "SpotInterruption",
        "CheckpointSignalled",
        "CheckpointAcked",
        "DrainComplete",
    ] {
        assert!(
            reasons.iter().any(|x| x == r),
            "{r} missing from {reasons:?}"
        );
    }

    // The same notice, polled again and again: one signal, one drain.
    let evictions = c.evictions().len();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.trainer.signals(), 1);
    assert_eq!(c.evictions().len(), evictions);
    assert_eq!(evictions, 4, "trainer + 3 web pods");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pdb_blocked_pod_is_named_at_the_deadline() {
    let c = Cluster::new(Cloud::Aws).await;
    c.api.add_pdb(
        "web",
        "web-pdb",
        &[("app", "web")],
        PdbLimit::MinAvailable(IntOrString::Int(3)),
    );
    let (app, cancel) = c
        .agent(&["--drain-reserve=5s", "--checkpoint-timeout=3s"])
        .await;
    let mut events = app.events;
    let raised = c
        .emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(12)))
        .unwrap();
    let report = wait_for(&mut events, Duration::from_secs(40), |e| match e {
        PlanEvent::Drained { report, .. } => Some(report.clone()),
        _ => None,
    })
    .await;
    let now = jiff::Timestamp::now();
    let deadline = raised
        .visible_at
        .checked_add(jiff::SignedDuration::from_secs(12))
        .unwrap();
    assert!(
        now >= deadline
            .checked_sub(jiff::SignedDuration::from_secs(2))
            .unwrap(),
        "gave up early"
    );
    assert!(
        now <= deadline
            .checked_add(jiff::SignedDuration::from_secs(3))
            .unwrap(),
        "overran the deadline"
    );
    assert_eq!(report.blocked.len(), 3, "{report:?}");
    assert!(
        report
            .blocked
            .iter()
            .all(|b| b.pdbs == vec!["web-pdb".to_string()]),
        "{report:?}"
    );
    let blocked = c
        .api
        .events()
        .into_iter()
        .find(|e| e.reason == "DrainBlocked")
        .expect("DrainBlocked event");
    assert!(
        blocked.message.contains("web/web-0") && blocked.message.contains("web-pdb"),
        "{}",
        blocked.message
    );
    let m = metrics_text(app.admin_addr).await;
    assert!(m.contains("spotguard_drain_blocked_pods 3"), "{m}");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_stopped_mid_drain_resumes_without_a_second_signal() {
    let c = Cluster::new(Cloud::Aws).await;
    c.api.set_deletion_delay(Duration::from_secs(3));
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    // Let the evictions start, then stop the agent while pods are still terminating.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!c.evictions().is_empty(), "drain started");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    assert_eq!(
        c.phase().as_deref(),
        Some("checkpointed"),
        "stopped mid-drain"
    );
    assert_eq!(c.trainer.signals(), 1);

    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    let report = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Drained { report, .. } => Some(report.clone()),
        _ => None,
    })
    .await;
    assert!(report.complete(), "{report:?}");
    wait_for(&mut events, Duration::from_secs(10), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert_eq!(c.phase().as_deref(), Some("done"));
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
    assert_eq!(
        c.pod_names(),
        vec!["elsewhere", "nvidia-device-plugin", "spotguard-abcde"]
    );
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_writes_nothing_and_signals_nothing() {
    let c = Cluster::new(Cloud::Gce).await;
    let (app, cancel) = c.agent(&["--dry-run"]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(40), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert_eq!(
        c.api.write_count(),
        0,
        "{:?}",
        c.api
            .requests()
            .iter()
            .filter(|r| r.is_write())
            .collect::<Vec<_>>()
    );
    assert_eq!(c.trainer.signals(), 0);
    assert!(!c.cordoned());
    assert!(!c.trainer.dir.path().join("ckpt/notice.json").exists());
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_soft_taint_early_checkpoint_then_expiry_undoes() {
    let c = Cluster::new(Cloud::Aws).await;
    let (app, cancel) = c.agent(&["--rebalance-expiry=3s"]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::rebalance()).unwrap();
    let results = wait_for(&mut events, Duration::from_secs(30), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results[0].outcome.as_str(), "acked");
    assert_eq!(c.trainer.signals(), 1, "early checkpoint");
    assert!(c.taints().contains(&(
        "spotguard.io/interruption".into(),
        "PreferNoSchedule".into()
    )));
    assert!(!c.cordoned(), "rebalance does not cordon");
    assert!(c.evictions().is_empty(), "rebalance does not drain");
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(c.taints().is_empty(), "{:?}", c.taints());
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_maintenance_keeps_the_operators_cordon() {
    let c = Cluster::new(Cloud::Azure).await;
    let mut node = test_node(NODE);
    node.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
    c.api.add_node(node);
    let (app, cancel) = c
        .agent(&["--maintenance-lead=1h", "--on-maintenance=cordon"])
        .await;
    let mut events = app.events;
    let raised = c
        .emu
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(900)))
        .unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert!(c
        .taints()
        .contains(&("spotguard.io/interruption".into(), "NoSchedule".into())));
    c.emu.cancel(Some(&raised.id)).unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        c.taints().is_empty(),
        "spotguard's taint removed: {:?}",
        c.taints()
    );
    assert!(c.cordoned(), "the operator's cordon stays");
    assert_eq!(c.trainer.signals(), 0);
    assert!(c.api.events().iter().any(|e| e.reason == "NoticeCancelled"));
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

async fn stop(join: tokio::task::JoinHandle<Result<(), app::Error>>, cancel: CancellationToken) {
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), join).await;
}

/// Issue 9 item 1: a handled interruption, then the machine is stopped and started (a new boot):
/// the agent undoes its own cordon and taint from the previous life and acts on the next
/// interruption again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_boot_undoes_the_previous_life_and_the_next_interruption_is_signalled() {
    let c = Cluster::new(Cloud::Aws).await;
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert!(c.cordoned());
    assert_eq!(c.trainer.signals(), 1);
    assert_eq!(c.phase().as_deref(), Some("done"));
    stop(app.join, cancel).await;

    // Same boot, agent restarted: the handled interruption stays handled (no second signal).
    let (app, cancel) = c.agent(&[]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.trainer.signals(), 1, "same life: never a second signal");
    assert!(c.cordoned(), "same life: the plan's cordon stays");
    stop(app.join, cancel).await;

    // Stop/start: a new boot id. The trainer's pod is scheduled here again.
    c.emu.clear();
    c.reboot("boot-2");
    c.api.add_pod(c.trainer.pod("trainer-0"));
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        !c.cordoned(),
        "spotguard's cordon from the previous life is gone"
    );
    assert!(c.taints().is_empty(), "{:?}", c.taints());
    assert_eq!(c.phase(), None, "record of the previous life cleared");
    assert!(c
        .api
        .events()
        .iter()
        .any(|e| e.reason == "PreviousLifeUndone"));
    assert!(!c.state.path().join("notice.json").exists());

    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    let processes = wait_for(&mut events, Duration::from_secs(30), |e| match e {
        PlanEvent::Signalled { processes, .. } => Some(*processes),
        _ => None,
    })
    .await;
    assert_eq!(processes, 1);
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert_eq!(c.trainer.signals(), 2, "armed again in the new life");
    assert!(c.cordoned());
    let raw = c.node_json()["metadata"]["annotations"]["spotguard.io/notice"]
        .as_str()
        .unwrap()
        .to_string();
    let rec: serde_json::Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(rec["boot_id"], "boot-2");
    stop(app.join, cancel).await;
}

/// Issue 9 item 1: the operator's cordon from before the previous life is never undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_boot_keeps_the_operators_cordon() {
    let c = Cluster::new(Cloud::Aws).await;
    let mut node = test_node(NODE);
    node.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
    c.api.add_node(node);
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    stop(app.join, cancel).await;
    c.emu.clear();
    c.reboot("boot-2");
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(c.taints().is_empty(), "spotguard's taint removed");
    assert!(c.cordoned(), "the operator's cordon stays");
    stop(app.join, cancel).await;
}

/// Issue 9 item 4: a drain that fails (pods cannot be listed: RBAC) is never reported complete:
/// no DrainComplete, no `drained` phase, no Azure approval; a DrainFailed Event and the error
/// metric name why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_drain_is_not_complete_and_the_azure_event_is_not_approved() {
    let c = Cluster::new(Cloud::Azure).await;
    let (app, cancel) = c.agent(&["--checkpoint-timeout=3s"]).await;
    let mut events = app.events;
    c.emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(60)))
        .unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    // From now on the agent may not list pods.
    c.api.refuse("GET", "/api/v1/pods", 403);
    let mut drained = false;
    let reason = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Drained { .. } => {
            drained = true;
            None
        }
        PlanEvent::DrainFailed { reason, .. } => Some(reason.clone()),
        _ => None,
    })
    .await;
    assert!(!drained, "a failed drain sends no Drained");
    assert!(reason.contains("listing pods"), "{reason}");
    wait_for(&mut events, Duration::from_secs(10), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    let reasons: Vec<String> = c.api.events().iter().map(|e| e.reason.clone()).collect();
    assert!(!reasons.iter().any(|r| r == "DrainComplete"), "{reasons:?}");
    let failed = c
        .api
        .events()
        .into_iter()
        .find(|e| e.reason == "DrainFailed")
        .expect("DrainFailed event");
    assert!(
        failed.message.contains("listing pods"),
        "{}",
        failed.message
    );
    assert!(c.emu.azure_acks().is_empty(), "{:?}", c.emu.azure_acks());
    let raw = c.node_json()["metadata"]["annotations"]["spotguard.io/notice"]
        .as_str()
        .unwrap()
        .to_string();
    let rec: serde_json::Value = serde_json::from_str(&raw).unwrap();
    assert_eq!(rec["phase"], "done", "never `drained`");
    assert!(rec["failure"].as_str().unwrap().contains("listing pods"));
    let m = metrics_text(app.admin_addr).await;
    assert!(
        m.contains(r#"spotguard_errors_total{module="drain",error="list_pods"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"spotguard_node_actions_total{action="drain",outcome="error"} 1"#),
        "{m}"
    );
    stop(app.join, cancel).await;
}

/// Issue 9 item 4 (control): the same plan with a drain that completes approves the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_drain_approves_the_azure_event() {
    let c = Cluster::new(Cloud::Azure).await;
    let (app, cancel) = c.agent(&["--checkpoint-timeout=3s"]).await;
    let mut events = app.events;
    let raised = c
        .emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(60)))
        .unwrap();
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert_eq!(c.emu.azure_acks(), vec![raised.id]);
    assert_eq!(c.phase().as_deref(), Some("done"));
    stop(app.join, cancel).await;
}

/// Issue 9 item 6: the agent restarts mid-plan while the API server does not answer: the local
/// record says the signal went out, so it never goes out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_at_restart_never_signals_again() {
    let c = Cluster::new(Cloud::Aws).await;
    c.api.set_deletion_delay(Duration::from_secs(3));
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    stop(app.join, cancel).await;
    assert_eq!(c.trainer.signals(), 1);
    let local = std::fs::read_to_string(c.state.path().join("notice.json")).unwrap();
    assert!(local.contains("\"signalled_at\""), "{local}");

    // Every API request now takes 30 s: the annotation cannot be read at restart.
    c.api.set_latency(Duration::from_secs(30));
    let (app, cancel) = c.agent(&[]).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
    c.api.set_latency(Duration::ZERO);
    stop(app.join, cancel).await;
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
}

/// Issue 9 item 6: the agent cordoned and tainted the node, then died before its record said so
/// (the record, written before the signal, has nothing applied). The machine comes back in a new
/// boot: the node's own marks tell what spotguard did, and it is undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protect_that_was_never_recorded_is_still_undone_in_the_next_life() {
    let c = Cluster::new(Cloud::Aws).await;
    let mut node = test_node(NODE);
    node.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
    node.spec.get_or_insert_with(Default::default).taints =
        Some(vec![k8s_openapi::api::core::v1::Taint {
            key: "spotguard.io/interruption".into(),
            value: Some("interruption".into()),
            effect: "NoSchedule".into(),
            time_added: None,
        }]);
    c.api.add_node(node);
    c.api.set_node_annotation(
        NODE,
        "spotguard.io/applied",
        r#"{"cordoned":true,"taints":["NoSchedule"]}"#,
    );
    let now = jiff::Timestamp::now();
    let record = serde_json::json!({
        "id": "i-died", "kind": {"type": "interruption"}, "source": "aws",
        "deadline": now.to_string(), "phase": "signalled", "signalled_at": now.to_string(),
        "boot_id": "boot-1", "updated_at": now.to_string(),
    });
    c.api
        .set_node_annotation(NODE, "spotguard.io/notice", &record.to_string());
    c.reboot("boot-2");
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        !c.cordoned(),
        "spotguard's cordon undone from the node's marks"
    );
    assert!(c.taints().is_empty(), "{:?}", c.taints());
    assert!(c.node_json()["metadata"]["annotations"]["spotguard.io/applied"].is_null());
    assert_eq!(c.phase(), None);
    assert_eq!(c.trainer.signals(), 0);
    stop(app.join, cancel).await;
}

/// Issue 10 item 1 (responder side): the checkpoint signal goes first. With the API server
/// refusing the first node writes (protect retries them), the trainer is signalled while the
/// node is still uncordoned; the cordon lands after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_signal_does_not_wait_for_the_cordon() {
    let c = Cluster::new(Cloud::Aws).await;
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.api.fail_node_writes(500, 5);
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    let limit = std::time::Instant::now() + Duration::from_secs(20);
    while c.trainer.signals() == 0 {
        assert!(std::time::Instant::now() < limit, "no signal");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !c.cordoned(),
        "signalled before the cordon (protect is still retrying)"
    );
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert!(c.cordoned(), "the cordon landed after the signal");
    assert_eq!(c.trainer.signals(), 1);
    stop(app.join, cancel).await;
}
