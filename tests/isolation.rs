//! Hang isolation: a checkpoint dir on a mount that never answers must not delay another group's
//! signal or the end of the wait. The stand-in for a stopped NFS server / stuck FUSE daemon is a
//! real FUSE mount whose `/dev/fuse` descriptor nobody serves: the kernel never gets an answer to
//! FUSE_INIT, so every lookup below the mount blocks in the kernel (exactly what a D-state open on
//! a dead network filesystem does to the agent's thread). Closing the descriptor aborts the
//! connection, which releases the stuck threads; the mount is then detached.
//!
//! Needs root and /dev/fuse.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::checkpoint::run::{
    deliver, wait, CheckpointRequest, DeliveryState, NoticeStatus, NOTICE_BUDGET,
};
use spotguard::checkpoint::{
    Outcome, Signal, TargetContainer, TargetGroup, TargetMode, TargetProcess,
};
use spotguard::metrics::{encode, Metrics};
use spotguard_testkit::fuse::HungMount;
use spotguard_testkit::process::Kid;
use tokio_util::sync::CancellationToken;

/// A shell that handles SIGUSR1: writes `marker-$$` into `$MARKS` and `done` into `$DIR`.
const HANDLER: &str = r#"
trap 'echo got > "$MARKS/marker-$$"
  printf "{\"state\":\"done\"}" > "$DIR/.t$$" && mv "$DIR/.t$$" "$DIR/ack-$$.json"' USR1
sleep 1000 & S=$!
while :; do wait $S; done
"#;

fn handler(dir: &Path, marks: &Path) -> Kid {
    sh(HANDLER, dir, marks)
}

/// `script` under `sh -c` in a process group of its own, once its SIGUSR1 trap is installed.
fn sh(script: &str, dir: &Path, marks: &Path) -> Kid {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(script)
        .env("DIR", dir)
        .env("MARKS", marks)
        .stderr(Stdio::null());
    let kid = Kid::spawn(cmd);
    kid.wait_for_trap();
    kid
}

fn target(kid: &Kid) -> TargetProcess {
    TargetProcess {
        pid: kid.pid(),
        start_time: ProcFs::default().start_time(kid.pid()).unwrap(),
    }
}

fn group(name: &str, dir: &Path, kid: &Kid, timeout: Duration) -> TargetGroup {
    TargetGroup {
        name: name.to_string(),
        pod: None,
        containers: vec![TargetContainer {
            name: name.to_string(),
            root_pid: None,
            init_pid: Some(kid.pid()),
            processes: vec![target(kid)],
        }],
        mode: TargetMode::Handlers,
        signal: Signal::USR1,
        dir: dir.to_path_buf(),
        timeout,
        proc_root: "/proc".into(),
    }
}

fn request() -> CheckpointRequest {
    let now = Timestamp::now();
    CheckpointRequest {
        notice_id: "notice-hang".into(),
        source: "gce".into(),
        kind: "interruption".into(),
        deadline: Some(now + Duration::from_secs(30)),
        checkpoint_deadline: now + Duration::from_secs(20),
        dry_run: false,
    }
}

fn stuck_threads(r: &Registry) -> u64 {
    encode(r)
        .lines()
        .find(|l| l.contains("errors_total") && l.contains("stuck_thread"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_checkpoint_dir_delays_neither_another_groups_signal_nor_the_wait() {
    let tmp = tempfile::tempdir().unwrap();
    let marks = tmp.path().join("marks");
    let good_dir = tmp.path().join("good");
    std::fs::create_dir_all(&marks).unwrap();
    std::fs::create_dir_all(&good_dir).unwrap();
    let mount = HungMount::new(&tmp.path().join("nfs"));
    let hung_dir = mount.path().join("ckpt");

    let hung = handler(&hung_dir, &marks);
    let good = handler(&good_dir, &marks);
    let budget = Duration::from_secs(3);
    // The hung group first: a sequential implementation would block on it before the good one.
    let groups = vec![
        group("hung", &hung_dir, &hung, budget),
        group("good", &good_dir, &good, Duration::from_secs(20)),
    ];
    let req = request();
    let mut registry = Registry::default();
    let m = Metrics::register(&mut registry);

    let started = Instant::now();
    let watcher = {
        let mark = marks.join(format!("marker-{}", good.pid()));
        std::thread::spawn(move || {
            while !mark.exists() {
                std::thread::sleep(Duration::from_millis(2));
            }
            Instant::now()
        })
    };
    let deliveries = deliver(&groups, &req, &m);
    let delivered_in = started.elapsed();
    let good_signalled = watcher.join().unwrap().duration_since(started);
    assert!(
        good_signalled < Duration::from_millis(500),
        "the good group's signal waited {good_signalled:?} for the hung dir"
    );
    // delivery returns after at most the notice budget (the hung dir's container), not never
    assert!(
        delivered_in < NOTICE_BUDGET + Duration::from_secs(1),
        "{delivered_in:?}"
    );
    assert_eq!(deliveries[0].state, DeliveryState::Signalled);
    assert!(
        matches!(&deliveries[0].containers[0].notice, NoticeStatus::Failed(e) if e.contains("did not answer")),
        "{:?}",
        deliveries[0].containers[0].notice
    );
    assert_eq!(deliveries[1].containers[0].notice, NoticeStatus::Written);
    // the hung group's process was signalled too, without notice.json
    let mark = marks.join(format!("marker-{}", hung.pid()));
    let t = Instant::now();
    while !mark.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "hung group never signalled"
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    let waited = Instant::now();
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    let waited = waited.elapsed();
    assert_eq!(results[1].outcome, Outcome::Acked, "{}", results[1].detail);
    assert_eq!(
        results[0].outcome,
        Outcome::Timeout,
        "{}",
        results[0].detail
    );
    assert!(
        waited < budget + Duration::from_secs(2),
        "the wait outlived the hung group's budget: {waited:?}"
    );
    drop(mount);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watcher_stuck_in_a_mount_that_hangs_later_is_abandoned_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let marks = tmp.path().join("marks");
    let later = tmp.path().join("later");
    let good_dir = tmp.path().join("good");
    for d in [&marks, &later, &good_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    // The hung group's handler acks into a dir of its own, so only the watcher reads `later`.
    let hung = handler(&tmp.path().join("nowhere"), &marks);
    let good = slow_handler(&good_dir, &marks);
    let budget = Duration::from_secs(2);
    let groups = vec![
        group("hangs-later", &later, &hung, budget),
        group("good", &good_dir, &good, Duration::from_secs(20)),
    ];
    let req = request();
    let mut registry = Registry::default();
    let m = Metrics::register(&mut registry);
    let deliveries = deliver(&groups, &req, &m);
    assert!(deliveries
        .iter()
        .all(|d| d.state == DeliveryState::Signalled));
    // Now the dir's filesystem stops answering: the watcher's next read blocks in the kernel.
    let mount = HungMount::new(&later);
    let started = Instant::now();
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    let waited = started.elapsed();
    assert_eq!(results[1].outcome, Outcome::Acked, "{}", results[1].detail);
    assert_eq!(
        results[0].outcome,
        Outcome::Timeout,
        "{}",
        results[0].detail
    );
    assert!(results[0].detail.contains("stuck"), "{}", results[0].detail);
    assert!(waited < budget + Duration::from_secs(2), "{waited:?}");
    assert_eq!(stuck_threads(&registry), 1);
    drop(mount);
}

/// Acks `done` 300 ms after the signal (so the wait is still running when the other group
/// hangs).
fn slow_handler(dir: &Path, marks: &Path) -> Kid {
    let script = HANDLER.replace("trap 'echo got", "trap 'sleep 0.3; echo got");
    sh(&script, dir, marks)
}

// === Kubernetes mode, whole agent ===

mod kube {
    use std::path::Path;
    use std::time::{Duration, Instant};

    use spotguard::app;
    use spotguard::config::{self, Config};
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use spotguard::responder::PlanEvent;
    use spotguard_testkit::k8s::{TestCluster, TestPod};
    use spotguard_testkit::wait_for_event as wait_for;
    use tokio_util::sync::CancellationToken;

    use super::{HungMount, HANDLER};

    /// The opted-in pod whose container runs the SIGUSR1 handler, checkpoint dir `dir`.
    fn handler_pod(ns: &str, name: &str, node: &str, dir: &Path, marks: &Path) -> TestPod {
        TestPod::new(ns, name, node)
            .annotation("spotguard.io/checkpoint", "true")
            .annotation("spotguard.io/checkpoint-dir", &dir.display().to_string())
            .annotation("spotguard.io/checkpoint-timeout", "3s")
            // Kubernetes expands `$$` in a container's command to `$`: escape the shell's `$$`.
            .command(&["sh", "-c", &HANDLER.replace("$$", "$$$$")])
            .env("DIR", &dir.display().to_string())
            .env("MARKS", &marks.display().to_string())
    }

    fn marked_at(marks: &Path, pid: u32) -> Option<std::time::SystemTime> {
        std::fs::metadata(marks.join(format!("marker-{pid}")))
            .and_then(|m| m.modified())
            .ok()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pod_on_a_hung_mount_delays_neither_another_pods_signal_nor_the_drain() {
        let tmp = tempfile::tempdir().unwrap();
        let marks = tmp.path().join("marks");
        let good_dir = tmp.path().join("good");
        std::fs::create_dir_all(&marks).unwrap();
        std::fs::create_dir_all(&good_dir).unwrap();
        let k = TestCluster::new().await;
        let node = k.node(k.node_config("gpu-node-1")).await;
        let ml = k.namespace("ml").await;
        let web = k.namespace("web").await;
        let mount = HungMount::new(&tmp.path().join("nfs"));
        let hung_dir = mount.path().join("ckpt");
        // Named so the hung pod sorts first.
        k.run_pods(&[
            handler_pod(&ml, "a-hung", node.name(), &hung_dir, &marks).build(),
            handler_pod(&ml, "b-good", node.name(), &good_dir, &marks).build(),
            TestPod::new(&web, "web-0", node.name()).build(),
        ])
        .await;
        let mut pids = Vec::new();
        for name in ["a-hung", "b-good"] {
            let run = node
                .wait_run(&ml, name, "main", Duration::from_secs(10))
                .await;
            assert!(
                spotguard_testkit::process::wait_catches_usr1(run.pid).await,
                "{name}: no trap"
            );
            pids.push(run.pid);
        }
        let (hung_pid, good_pid) = (pids[0], pids[1]);
        let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
            .await
            .unwrap();
        // A 15 s notice keeps the test short (GCE's is 30 s; the budget is the pod's 3 s either way).
        let argv: Vec<String> = vec![
            "--mode=kubernetes".into(),
            format!("--node-name={}", node.name()),
            "--cloud=gce".into(),
            "--gce-preemption-notice=15s".into(),
            format!("--metadata-endpoint={}", emu.base_url()),
            format!("--state-dir={}", tmp.path().join("state").display()),
            "--metrics-addr=127.0.0.1:0".into(),
            "--gpu=off".into(),
            "--log-level=warn".into(),
            "--shutdown-grace=0s".into(),
        ];
        let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
        let cfg = Config::resolve(args, &config::ProcessEnv).unwrap();
        let cancel = CancellationToken::new();
        let app = app::start_with_client(cfg, cancel.clone(), Some(k.agent_client()))
            .await
            .unwrap();
        let mut events = app.events;
        tokio::time::sleep(Duration::from_millis(800)).await;
        let raised = Instant::now();
        emu.raise(EmulatedNotice::interruption()).unwrap();

        // The hung pod's own process is stuck in the kernel on its dead checkpoint dir (its ack
        // write, like a trainer saving to a dead NFS server): no signal ends it and the kubelet
        // cannot finish its deletion. The drain reports it at the deadline; it does not wait for
        // the hung filesystem before evicting the others.
        let report = wait_for(&mut events, Duration::from_secs(30), |e| match e {
            PlanEvent::Drained { report, .. } => Some(report.clone()),
            _ => None,
        })
        .await;
        // The hung pod's budget (3 s from its signal, which waited ≤ 1 s for its dir) bounds the
        // checkpoint step; then the drain runs. Nothing waits for the hung filesystem itself.
        let evicted_by = k
            .proxy()
            .requests()
            .iter()
            .filter(|r| r.kind == spotguard_testkit::k8s::RequestKind::Eviction)
            .count();
        assert_eq!(evicted_by, 3, "every pod asked to leave");
        let good_at = marked_at(&marks, good_pid).expect("good pod signalled");
        let hung_at = marked_at(&marks, hung_pid).expect("hung pod signalled too");
        assert!(
            good_at + Duration::from_millis(500) < hung_at,
            "the good pod's signal waited for the hung pod's dir: good {good_at:?}, hung {hung_at:?}"
        );
        let mut evicted = report.evicted.clone();
        evicted.sort();
        assert_eq!(
            evicted,
            vec![format!("{ml}/b-good"), format!("{web}/web-0")],
            "{report:?}"
        );
        assert_eq!(report.blocked.len(), 1, "{report:?}");
        assert_eq!(report.blocked[0].pod, format!("{ml}/a-hung"));
        assert!(
            report.blocked[0].reason.contains("terminating"),
            "{report:?}"
        );
        // Both others were gone well before the deadline.
        assert!(
            raised.elapsed() < Duration::from_secs(20),
            "drain reported {:?} after the notice",
            raised.elapsed()
        );
        assert!(k.pod(&web, "web-0").await.is_none(), "web-0 evicted");
        cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
        // Release the hung mount before the node's processes are killed.
        drop(mount);
        drop(node);
    }
}
