//! Kubernetes mode end to end: the metadata emulator (real wire protocol) → the agent in
//! Kubernetes mode (`app::start_with_client`, as the shipped ServiceAccount, through the fault
//! proxy) → a real API server (resource versions, 409s, PDB 429s from the disruption
//! controller's status, grace periods, field selectors, Events) → a real training process that
//! the kubelet stand-in runs as the pod's container, in a kubelet-shaped cgroup, found from the
//! pod's UID and container ID.
//!
//! Needs root and a cgroup hierarchy the kubelet stand-in can write (v1 `name=systemd` or v2).

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard::node::kube::KubeNodeOps;
use spotguard::node::{
    ConditionState, Disruption, GpuConditions, NodeOps, Protection, TaintEffect,
};
use spotguard::responder::PlanEvent;
use spotguard_testkit::k8s::{
    non_system_taints, FlatEvent, Kubelet, NodeConfig, PdbLimit, RequestKind, TestCluster, TestPod,
};
use spotguard_testkit::wait::{eventually, until};
use spotguard_testkit::wait_for_event as wait_for;
use spotguard_testkit::{metrics_text, process};
use tokio_util::sync::CancellationToken;

const OWN_POD: &str = "spotguard-abcde";

/// The training process the pod runs: on SIGUSR1 it counts the signal in `$MARKS` and acks.
const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; printf '"'"'{"state":"done","step":%d,"checkpoint":"ckpt","ts":%s}'"'"' $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

/// The trainer's files on this machine: its checkpoint dir (the pod's annotation names it; the
/// container's root is the host's) and the signal marks.
struct Trainer {
    dir: tempfile::TempDir,
    /// On SIGTERM the container takes this long to exit (a real graceful shutdown).
    term_delay: Option<Duration>,
}

impl Trainer {
    fn new(term_delay: Option<Duration>) -> Trainer {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpt")).unwrap();
        Trainer { dir, term_delay }
    }

    fn ckpt(&self) -> PathBuf {
        self.dir.path().join("ckpt")
    }

    fn signals(&self) -> usize {
        std::fs::read_to_string(self.dir.path().join("marks"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    /// The opted-in pod that runs it on `node`.
    fn pod(&self, ns: &str, name: &str, node: &str) -> Pod {
        let script = match self.term_delay {
            Some(d) => format!(
                "trap 'sleep {:.3}; exit 0' TERM\n{TRAINER}",
                d.as_secs_f64()
            ),
            None => TRAINER.to_string(),
        };
        TestPod::new(ns, name, node)
            .annotation("spotguard.io/checkpoint", "true")
            .annotation(
                "spotguard.io/checkpoint-dir",
                &self.ckpt().display().to_string(),
            )
            .annotation("spotguard.io/checkpoint-timeout", "20s")
            .script(&script)
            .env("SPOTGUARD_DIR", &self.ckpt().display().to_string())
            .env(
                "MARKS",
                &self.dir.path().join("marks").display().to_string(),
            )
            .build()
    }
}

struct Cluster {
    k: TestCluster,
    node: Kubelet,
    _other: Kubelet,
    ml: String,
    web: String,
    system: String,
    own: String,
    emu: emulator::EmulatorHandle,
    trainer: Trainer,
    state: tempfile::TempDir,
    /// `--boot-id-file`: the test "reboots" the machine by changing it.
    boot: tempfile::TempDir,
}

impl Cluster {
    async fn new(cloud: Cloud) -> Cluster {
        Cluster::with(cloud, |n| n, None).await
    }

    /// `node` shapes the node before anything runs; `term_delay`: every pod takes that long to
    /// exit on SIGTERM.
    async fn with(
        cloud: Cloud,
        node: impl FnOnce(NodeConfig) -> NodeConfig,
        term_delay: Option<Duration>,
    ) -> Cluster {
        let k = TestCluster::new().await;
        let n = k.node(node(k.node_config("gpu-node-1"))).await;
        let other = k.node(k.node_config("other-node")).await;
        let ml = k.namespace("ml").await;
        let web = k.namespace("web").await;
        let system = k.namespace("kube-system").await;
        let own = k.namespace("spotguard").await;
        let trainer = Trainer::new(term_delay);
        let slow = |p: TestPod| match term_delay {
            Some(d) => p.terminates_after(d),
            None => p,
        };
        let mut pods = vec![trainer.pod(&ml, "trainer-0", n.name())];
        for i in 0..3 {
            pods.push(
                slow(TestPod::new(&web, &format!("web-{i}"), n.name()).label("app", "web")).build(),
            );
        }
        pods.push(
            TestPod::new(&system, "nvidia-device-plugin", n.name())
                .daemonset()
                .build(),
        );
        pods.push(TestPod::new(&own, OWN_POD, n.name()).build());
        pods.push(TestPod::new(&web, "elsewhere", other.name()).build());
        k.run_pods(&pods).await;
        let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
        let boot = tempfile::tempdir().unwrap();
        std::fs::write(boot.path().join("boot_id"), "boot-1\n").unwrap();
        let c = Cluster {
            k,
            node: n,
            _other: other,
            ml,
            web,
            system,
            own,
            emu,
            trainer,
            state: tempfile::tempdir().unwrap(),
            boot,
        };
        c.trainer_ready().await;
        c
    }

    /// Wait until the trainer's current process catches SIGUSR1.
    async fn trainer_ready(&self) {
        let run = self
            .node
            .wait_run(&self.ml, "trainer-0", "main", Duration::from_secs(30))
            .await;
        assert!(
            process::wait_catches_usr1(run.pid).await,
            "trainer did not install its handler"
        );
    }

    /// The machine comes back in a new life (stop/start, hibernation, reboot).
    fn reboot(&self, boot_id: &str) {
        std::fs::write(self.boot.path().join("boot_id"), boot_id).unwrap();
    }

    fn name(&self) -> &str {
        self.node.name()
    }

    async fn agent(&self, extra: &[&str]) -> (app::App, CancellationToken) {
        let own = (self.own.clone(), OWN_POD.to_string());
        self.agent_as(extra, self.k.agent_client(), own).await
    }

    /// The agent with `client`, in the pod `own` (namespace, name).
    async fn agent_as(
        &self,
        extra: &[&str],
        client: kube::Client,
        own: (String, String),
    ) -> (app::App, CancellationToken) {
        let mut argv: Vec<String> = vec![
            "--mode=kubernetes".into(),
            format!("--node-name={}", self.name()),
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
        cfg.pod_namespace = Some(own.0);
        cfg.pod_name = Some(own.1);
        spotguard::telemetry::init(config::LogFormat::Text, &cfg.args.log_level);
        let cancel = CancellationToken::new();
        let app = app::start_with_client(cfg, cancel.clone(), Some(client))
            .await
            .unwrap();
        (app, cancel)
    }

    async fn node_json(&self) -> serde_json::Value {
        self.k.node_json(self.name()).await
    }

    /// spotguard's and operators' taints (key, effect).
    async fn taints(&self) -> Vec<(String, String)> {
        non_system_taints(&self.k.node_object(self.name()).await)
            .into_iter()
            .map(|(k, _, e)| (k, e))
            .collect()
    }

    async fn cordoned(&self) -> bool {
        self.node_json().await["spec"]["unschedulable"].as_bool() == Some(true)
    }

    async fn phase(&self) -> Option<String> {
        let raw = self.node_json().await["metadata"]["annotations"]["spotguard.io/notice"]
            .as_str()?
            .to_string();
        let v: serde_json::Value = serde_json::from_str(&raw).ok()?;
        v["phase"].as_str().map(str::to_string)
    }

    async fn pod_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .k
            .pods_in(&[&self.ml, &self.web, &self.system, &self.own])
            .await
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        v.sort();
        v
    }

    fn evictions(&self) -> Vec<String> {
        self.k
            .proxy()
            .requests()
            .iter()
            .filter(|r| r.kind == RequestKind::Eviction)
            .map(|r| r.path.clone())
            .collect()
    }

    async fn events(&self) -> Vec<FlatEvent> {
        self.k.events().await
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
    assert_eq!(results[0].group, format!("{}/trainer-0", c.ml));
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
    let reqs = c.k.proxy().requests();
    let first_eviction = reqs
        .iter()
        .position(|r| r.kind == RequestKind::Eviction)
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

    assert!(c.cordoned().await);
    assert!(c
        .taints()
        .await
        .contains(&("spotguard.io/interruption".into(), "NoSchedule".into())));
    assert_eq!(
        c.pod_names().await,
        vec!["elsewhere", "nvidia-device-plugin", "spotguard-abcde"],
        "DaemonSet, own and other nodes' pods stay"
    );
    assert_eq!(c.phase().await.as_deref(), Some("done"));
    let reasons: Vec<String> = c.events().await.iter().map(|e| e.reason.clone()).collect();
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
    c.k.add_pdb(
        &c.web,
        "web-pdb",
        &[("app", "web")],
        PdbLimit::MinAvailable(IntOrString::Int(3)),
        3,
    )
    .await;
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
        .events()
        .await
        .into_iter()
        .find(|e| e.reason == "DrainBlocked")
        .expect("DrainBlocked event");
    assert!(
        blocked.message.contains(&format!("{}/web-0", c.web))
            && blocked.message.contains("web-pdb"),
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
    let c = Cluster::with(Cloud::Aws, |n| n, Some(Duration::from_secs(3))).await;
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    // Once the evictions start, stop the agent while pods are still terminating.
    eventually(
        "the drain's first eviction",
        Duration::from_secs(30),
        || async { !c.evictions().is_empty() },
    )
    .await;
    assert!(!c.evictions().is_empty(), "drain started");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    assert_eq!(
        c.phase().await.as_deref(),
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
    assert_eq!(c.phase().await.as_deref(), Some("done"));
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
    assert_eq!(
        c.pod_names().await,
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
        c.k.proxy().write_count(),
        0,
        "{:?}",
        c.k.proxy()
            .requests()
            .iter()
            .filter(|r| r.is_write())
            .collect::<Vec<_>>()
    );
    assert_eq!(c.trainer.signals(), 0);
    assert!(!c.cordoned().await);
    assert!(!c.trainer.ckpt().join("notice.json").exists());
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
    assert!(c.taints().await.contains(&(
        "spotguard.io/interruption".into(),
        "PreferNoSchedule".into()
    )));
    assert!(!c.cordoned().await, "rebalance does not cordon");
    assert!(c.evictions().is_empty(), "rebalance does not drain");
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(c.taints().await.is_empty(), "{:?}", c.taints().await);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_maintenance_keeps_the_operators_cordon() {
    let c = Cluster::with(Cloud::Azure, NodeConfig::unschedulable, None).await;
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
        .await
        .contains(&("spotguard.io/interruption".into(), "NoSchedule".into())));
    c.emu.cancel(Some(&raised.id)).unwrap();
    wait_for(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        c.taints().await.is_empty(),
        "spotguard's taint removed: {:?}",
        c.taints().await
    );
    assert!(c.cordoned().await, "the operator's cordon stays");
    assert_eq!(c.trainer.signals(), 0);
    assert!(c
        .events()
        .await
        .iter()
        .any(|e| e.reason == "NoticeCancelled"));
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
    assert!(c.cordoned().await);
    assert_eq!(c.trainer.signals(), 1);
    assert_eq!(c.phase().await.as_deref(), Some("done"));
    stop(app.join, cancel).await;

    // Same boot, agent restarted: the handled interruption stays handled (no second signal).
    let (app, cancel) = c.agent(&[]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(c.trainer.signals(), 1, "same life: never a second signal");
    assert!(c.cordoned().await, "same life: the plan's cordon stays");
    stop(app.join, cancel).await;

    // Stop/start: a new boot id. The trainer's pod is scheduled here again.
    c.emu.clear();
    c.reboot("boot-2");
    c.k.run_pods(&[c.trainer.pod(&c.ml, "trainer-0", c.name())])
        .await;
    c.trainer_ready().await;
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        !c.cordoned().await,
        "spotguard's cordon from the previous life is gone"
    );
    assert!(c.taints().await.is_empty(), "{:?}", c.taints().await);
    assert_eq!(c.phase().await, None, "record of the previous life cleared");
    assert!(c
        .events()
        .await
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
    assert!(c.cordoned().await);
    let raw = c.node_json().await["metadata"]["annotations"]["spotguard.io/notice"]
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
    let c = Cluster::with(Cloud::Aws, NodeConfig::unschedulable, None).await;
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
    assert!(c.taints().await.is_empty(), "spotguard's taint removed");
    assert!(c.cordoned().await, "the operator's cordon stays");
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
    c.k.proxy().refuse("GET", "/api/v1/pods", 403);
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
    let reasons: Vec<String> = c.events().await.iter().map(|e| e.reason.clone()).collect();
    assert!(!reasons.iter().any(|r| r == "DrainComplete"), "{reasons:?}");
    let failed = c
        .events()
        .await
        .into_iter()
        .find(|e| e.reason == "DrainFailed")
        .expect("DrainFailed event");
    assert!(
        failed.message.contains("listing pods"),
        "{}",
        failed.message
    );
    assert!(c.emu.azure_acks().is_empty(), "{:?}", c.emu.azure_acks());
    let raw = c.node_json().await["metadata"]["annotations"]["spotguard.io/notice"]
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
    assert_eq!(c.phase().await.as_deref(), Some("done"));
    stop(app.join, cancel).await;
}

/// Issue 9 item 6: the agent restarts mid-plan while the API server does not answer: the local
/// record says the signal went out, so it never goes out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_outage_at_restart_never_signals_again() {
    let c = Cluster::with(Cloud::Aws, |n| n, Some(Duration::from_secs(3))).await;
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
    c.k.proxy().set_latency(Duration::from_secs(30));
    let (app, cancel) = c.agent(&[]).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
    c.k.proxy().set_latency(Duration::ZERO);
    stop(app.join, cancel).await;
    assert_eq!(c.trainer.signals(), 1, "never signalled twice");
}

/// Issue 9 item 6: the agent cordoned and tainted the node, then died before its record said so
/// (the record, written before the signal, has nothing applied). The machine comes back in a new
/// boot: the node's own marks tell what spotguard did, and it is undone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protect_that_was_never_recorded_is_still_undone_in_the_next_life() {
    let c = Cluster::with(
        Cloud::Aws,
        |n| {
            n.unschedulable().taint(
                "spotguard.io/interruption",
                Some("interruption"),
                "NoSchedule",
            )
        },
        None,
    )
    .await;
    c.k.set_node_annotation(
        c.name(),
        "spotguard.io/applied",
        r#"{"cordoned":true,"taints":["NoSchedule"]}"#,
    )
    .await;
    let now = jiff::Timestamp::now();
    let record = serde_json::json!({
        "id": "i-died", "kind": {"type": "interruption"}, "source": "aws",
        "deadline": now.to_string(), "phase": "signalled", "signalled_at": now.to_string(),
        "boot_id": "boot-1", "updated_at": now.to_string(),
    });
    c.k.set_node_annotation(c.name(), "spotguard.io/notice", &record.to_string())
        .await;
    c.reboot("boot-2");
    let (app, cancel) = c.agent(&[]).await;
    let mut events = app.events;
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    assert!(
        !c.cordoned().await,
        "spotguard's cordon undone from the node's marks"
    );
    assert!(c.taints().await.is_empty(), "{:?}", c.taints().await);
    assert!(c.node_json().await["metadata"]["annotations"]["spotguard.io/applied"].is_null());
    assert_eq!(c.phase().await, None);
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
    c.k.proxy().fail_next(RequestKind::NodeWrite, 500, 5);
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    eventually("the trainer's signal", Duration::from_secs(20), || async {
        c.trainer.signals() > 0
    })
    .await;
    assert!(
        !c.cordoned().await,
        "signalled before the cordon (protect is still retrying)"
    );
    wait_for(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    assert!(c.cordoned().await, "the cordon landed after the signal");
    assert_eq!(c.trainer.signals(), 1);
    stop(app.join, cancel).await;
}

/// The pod's `DisruptionTarget` condition as (status, reason, message), if any.
async fn disruption_target(
    k: &TestCluster,
    ns: &str,
    name: &str,
) -> Option<(String, String, String)> {
    let pod = k.pod(ns, name).await?;
    let c = pod
        .status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == "DisruptionTarget")?;
    Some((
        c.status,
        c.reason.unwrap_or_default(),
        c.message.unwrap_or_default(),
    ))
}

/// Issue 36 item 1: right after the signal the agent sets `DisruptionTarget` (True,
/// `TerminationByCloudNotice`, a message naming the notice) on every pod the drain will take:
/// a trainer that acks and exits 143 before the drain reaches it keeps the condition through the
/// kubelet's later status report of its exit (Failed, Ready False: the kubelet stand-in's
/// strategic merge keeps conditions it does not own, as the kubelet does), and pods the drain cannot evict
/// yet (a PodDisruptionBudget refuses: the Eviction API sets nothing) carry it too. The DaemonSet's
/// pod, the agent's own pod and another node's pod get nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pods_the_plan_takes_down_get_disruption_target_right_after_the_signal() {
    let c = Cluster::new(Cloud::Aws).await;
    c.k.add_pdb(
        &c.web,
        "web-pdb",
        &[("app", "web")],
        PdbLimit::MinAvailable(IntOrString::Int(3)),
        3,
    )
    .await;
    // A trainer that saves, acks and exits 143 on the signal, as the helper's trainers do.
    let quitter = tempfile::tempdir().unwrap();
    let dir = quitter.path().join("ckpt").display().to_string();
    std::fs::create_dir(quitter.path().join("ckpt")).unwrap();
    // It exits once the test saw its condition set, so that the kubelet's report of the exit
    // comes after the condition and must keep it.
    let release = quitter.path().join("release");
    let mut pod = TestPod::new(&c.ml, "quitter", c.name())
        .label("app", "quitter")
        .annotation("spotguard.io/checkpoint", "true")
        .annotation("spotguard.io/checkpoint-dir", &dir)
        .script(
            r#"trap 'printf '"'"'{"state":"done","step":7,"checkpoint":"c","ts":%s}'"'"' $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"; while [ ! -e "$RELEASE" ]; do sleep 0.05; done; exit 143' USR1
while :; do sleep 0.05; done
"#,
        )
        .env("SPOTGUARD_DIR", &dir)
        .env("RELEASE", &release.display().to_string())
        .build();
    pod.spec.as_mut().unwrap().restart_policy = Some("Never".into());
    c.k.run_pods(&[pod]).await;
    let run = c
        .node
        .wait_run(&c.ml, "quitter", "main", Duration::from_secs(30))
        .await;
    assert!(process::wait_catches_usr1(run.pid).await);
    // Nor is it evicted while it runs (the eviction would set the condition itself).
    c.k.add_pdb(
        &c.ml,
        "quitter-pdb",
        &[("app", "quitter")],
        PdbLimit::MinAvailable(IntOrString::Int(1)),
        1,
    )
    .await;

    let (app, cancel) = c
        .agent(&["--drain-reserve=5s", "--checkpoint-timeout=3s"])
        .await;
    let mut events = app.events;
    c.emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(60)))
        .unwrap();
    let results = wait_for(&mut events, Duration::from_secs(30), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert!(
        results.len() == 2 && results.iter().all(|r| r.outcome.as_str() == "acked"),
        "{results:?}"
    );
    let marked = |p: Option<&Pod>| {
        p.and_then(|p| p.status.as_ref()?.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "DisruptionTarget"))
    };
    c.k.wait_pod(
        &c.ml,
        "quitter",
        "DisruptionTarget",
        Duration::from_secs(10),
        marked,
    )
    .await;
    std::fs::write(&release, b"").unwrap();
    // The quitter's pod turns Failed (exit 143), reported by the kubelet after the condition was
    // set: that report keeps it. (The drain may evict the pod first, which deletes it: then its
    // condition was seen above, and there is no Failed report to check.)
    let failed = until(
        "the quitter Failed or gone",
        Duration::from_secs(30),
        || async {
            match c.k.pod(&c.ml, "quitter").await {
                None => Some(None),
                Some(p) if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed") => {
                    Some(Some(p))
                }
                Some(_) => None,
            }
        },
    )
    .await;
    if let Some(p) = failed {
        let conditions = p.status.and_then(|s| s.conditions).unwrap_or_default();
        let ready = conditions
            .iter()
            .find(|c| c.type_ == "Ready")
            .map(|c| c.status.clone());
        assert_eq!(
            ready.as_deref(),
            Some("False"),
            "the kubelet reported the exit"
        );
        let kept = conditions
            .iter()
            .find(|c| c.type_ == "DisruptionTarget")
            .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()));
        assert_eq!(
            kept,
            Some(("True".to_string(), "TerminationByCloudNotice".to_string())),
            "the quitter's Failed status keeps DisruptionTarget"
        );
    }
    for (ns, name) in [(&c.web, "web-0"), (&c.web, "web-1"), (&c.web, "web-2")] {
        let (status, reason, message) = disruption_target(&c.k, ns, name)
            .await
            .unwrap_or_else(|| panic!("{ns}/{name} has no DisruptionTarget"));
        assert_eq!(status, "True", "{ns}/{name}");
        assert_eq!(reason, "TerminationByCloudNotice", "{ns}/{name}");
        assert!(
            message.starts_with("aws interruption notice "),
            "{ns}/{name}: {message}"
        );
    }
    for (ns, name) in [
        (&c.system, "nvidia-device-plugin"),
        (&c.own, OWN_POD),
        (&c.web, "elsewhere"),
    ] {
        assert_eq!(disruption_target(&c.k, ns, name).await, None, "{ns}/{name}");
    }
    let m = metrics_text(app.admin_addr).await;
    // trainer-0, the quitter and the three web pods.
    assert!(
        m.contains(r#"spotguard_node_actions_total{action="disruption_target",outcome="ok"} 5"#),
        "{m}"
    );
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

/// Issue 36 item 8: the agent as the DaemonSet runs it (a token bound to its pod on the node,
/// which names the node) handles a spot notice end to end with the shipped
/// ValidatingAdmissionPolicy in place; the same token is refused on another node (taint and
/// cordon, GPU conditions, the `DisruptionTarget` of that node's pods), and still allowed to
/// evict that node's pods: an Eviction names no node, so the policy cannot hold it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_pod_bound_token_writes_only_to_its_own_node() {
    let c = Cluster::new(Cloud::Aws).await;
    let (own, client) = c.k.agent_on(c.name()).await;
    let (app, cancel) = c.agent_as(&[], client.clone(), own).await;
    let mut events = app.events;
    c.emu.raise(EmulatedNotice::interruption()).unwrap();
    let results = wait_for(&mut events, Duration::from_secs(30), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0].outcome.as_str(), "acked", "{results:?}");
    let report = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Drained { report, .. } => Some(report.clone()),
        _ => None,
    })
    .await;
    assert!(report.complete(), "{report:?}");
    // The fixture's stand-in for the agent's pod is now just another pod.
    assert_eq!(
        report.evicted.len(),
        5,
        "trainer + 3 web pods + {OWN_POD}: {report:?}"
    );
    assert!(c.cordoned().await);
    let m = metrics_text(app.admin_addr).await;
    assert!(
        m.contains(r#"spotguard_node_actions_total{action="disruption_target",outcome="ok"} 5"#),
        "{m}"
    );
    // Every Event of the plan (the node's, the pods') passed the policy's Event rules.
    assert!(
        !m.contains(r#"spotguard_node_actions_total{action="event",outcome="ok"} 0"#)
            && m.contains(r#"spotguard_node_actions_total{action="event",outcome="error"} 0"#),
        "{m}"
    );
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;

    // The same token on the other node.
    let other = c._other.name().to_string();
    let metrics = std::sync::Arc::new(spotguard::metrics::Metrics::register(
        &mut prometheus_client::registry::Registry::default(),
    ));
    let ops = KubeNodeOps::new(client.clone(), other.clone(), None, false, metrics);
    let protect = ops
        .protect(&Protection {
            taint_value: "interruption".into(),
            effect: TaintEffect::NoSchedule,
            cordon: true,
        })
        .await;
    let refused = |what: &str, e: String| {
        assert!(
            e.contains("spotguard-own-node") && e.contains("may change only"),
            "{what}: {e}"
        )
    };
    refused("protect", protect.unwrap_err().to_string());
    let conditions = GpuConditions {
        unhealthy: ConditionState {
            active: true,
            reason: "XidError".into(),
            message: "test".into(),
        },
        ..Default::default()
    };
    refused(
        "GPU conditions",
        ops.set_gpu_conditions(&conditions)
            .await
            .unwrap_err()
            .to_string(),
    );
    let marked = ops
        .mark_disruption(&Disruption {
            reason: "TerminationByCloudNotice",
            message: "test".into(),
        })
        .await
        .unwrap();
    assert!(marked.is_empty(), "{marked:?}");
    assert_eq!(disruption_target(&c.k, &c.web, "elsewhere").await, None);
    let pods: kube::Api<Pod> = kube::Api::namespaced(client.clone(), &c.web);
    let patch = serde_json::json!({ "status": { "conditions": [
        { "type": "DisruptionTarget", "status": "True", "reason": "TerminationByCloudNotice" }
    ] } });
    let status = pods
        .patch_status(
            "elsewhere",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&patch),
        )
        .await;
    refused("pod status", status.unwrap_err().to_string());
    let node = c.k.node_json(&other).await;
    assert_ne!(
        node["spec"]["unschedulable"].as_bool(),
        Some(true),
        "{node}"
    );
    // An Eviction names no node: the policy cannot hold it (docs/deploy-kubernetes.md).
    pods.evict("elsewhere", &kube::api::EvictParams::default())
        .await
        .expect("the eviction is not held to the agent's node");
}
