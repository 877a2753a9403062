//! Checkpoint hand-shake against real processes: real signals through pidfds, real ack files,
//! real exits. Every test uses its own temp dir and its own children (tests run in parallel).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::ack::{CheckpointDir, NoticeFile};
use spotguard::checkpoint::discover::{HostDiscovery, HostTargets};
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::checkpoint::run::{
    deliver, deliver_with, plan_without_signal, wait, CheckpointRequest, DeliveryState,
    NoticeStatus, Prior, Signalled,
};
use spotguard::checkpoint::signal::NotSignalled;
use spotguard::checkpoint::{
    Outcome, Signal, TargetContainer, TargetDiscovery, TargetGroup, TargetMode, TargetProcess,
};
use spotguard::metrics::{encode, Metrics};
use spotguard_testkit::process::{as_user, Kid};
use spotguard_testkit::wait::eventually_blocking;
use tokio_util::sync::CancellationToken;

/// A shell that handles SIGUSR1: writes `marker-$$`, then depending on the environment an ack
/// with `$STATE`, the plain ack (`$PLAIN`), and exits with `$EXIT`. Waits in `wait` (no busy loop).
const HANDLER: &str = r#"
trap 'echo got > "$DIR/marker-$$"
  if [ -n "$RECEIVED" ]; then printf "{\"state\":\"received\"}" > "$DIR/.t$$" && mv "$DIR/.t$$" "$DIR/ack-$$.json"; fi
  if [ -n "$STATE" ]; then printf "{\"state\":\"%s\",\"step\":42,\"checkpoint\":\"/ck/42\",\"ts\":1}" "$STATE" > "$DIR/.t$$" && mv "$DIR/.t$$" "$DIR/ack-$$.json"; fi
  if [ -n "$PLAIN" ]; then : > "$DIR/ack"; fi
  if [ -n "$EXIT" ]; then kill $S; exit "$EXIT"; fi' USR1
sleep 1000 & S=$!
while :; do wait $S; done
"#;

/// A shell running [`HANDLER`] with `$DIR` and `env`, once its trap is installed.
fn handler(dir: &Path, env: &[(&str, &str)]) -> Kid {
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(HANDLER).env("DIR", dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let kid = Kid::spawn(cmd);
    wait_for_handler(kid.pid());
    kid
}

/// `sleep 1000` (catches nothing), once it runs `sleep`.
fn sleeper() -> Kid {
    let mut cmd = Command::new("sleep");
    cmd.arg("1000");
    let kid = Kid::spawn(cmd);
    wait_for_exec(kid.pid(), "sleep");
    kid
}

fn target(pid: i32) -> TargetProcess {
    TargetProcess {
        pid,
        start_time: ProcFs::default().start_time(pid).expect("start time"),
    }
}

fn wait_for_handler(pid: i32) {
    eventually_blocking("the SIGUSR1 trap", Duration::from_secs(10), || {
        ProcFs::default()
            .status(pid)
            .is_ok_and(|s| s.catches(Signal::USR1))
    });
}

fn wait_for_exec(pid: i32, name: &str) {
    eventually_blocking("exec", Duration::from_secs(10), || {
        ProcFs::default().status(pid).is_ok_and(|s| s.name == name)
    });
}

fn host_group(
    name: &str,
    dir: &Path,
    processes: Vec<TargetProcess>,
    timeout: Duration,
) -> TargetGroup {
    TargetGroup {
        name: name.to_string(),
        pod: None,
        containers: vec![TargetContainer {
            name: name.to_string(),
            root_pid: None,
            init_pid: processes.first().map(|p| p.pid),
            processes,
        }],
        mode: TargetMode::Handlers,
        signal: Signal::USR1,
        dir: dir.to_path_buf(),
        timeout,
        proc_root: "/proc".into(),
    }
}

fn request(dry_run: bool) -> CheckpointRequest {
    let now = Timestamp::now();
    CheckpointRequest {
        notice_id: "notice-1".into(),
        source: "aws".into(),
        kind: "interruption".into(),
        deadline: Some(now + Duration::from_secs(120)),
        checkpoint_deadline: now + Duration::from_secs(60),
        dry_run,
    }
}

fn metrics() -> (Registry, Metrics) {
    let mut r = Registry::default();
    let m = Metrics::register(&mut r);
    (r, m)
}

fn marker(dir: &Path, pid: i32) -> PathBuf {
    dir.join(format!("marker-{pid}"))
}

const LONG: Duration = Duration::from_secs(20);

#[tokio::test]
async fn handler_acks_done_and_non_handler_is_never_hit() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    let mut handler = handler(&dir, &[("STATE", "done")]);
    let mut sleeper = sleeper();
    let group = host_group(
        "train",
        &dir,
        vec![target(handler.pid()), target(sleeper.pid())],
        LONG,
    );
    let req = request(false);
    let (registry, m) = metrics();

    let deliveries = deliver(std::slice::from_ref(&group), &req, &m);
    assert_eq!(deliveries.len(), 1);
    let d = &deliveries[0];
    assert_eq!(d.state, DeliveryState::Signalled);
    assert_eq!(d.signalled_pids(), vec![handler.pid()]);
    assert_eq!(d.containers[0].notice, NoticeStatus::Written);
    assert!(d.containers[0]
        .skipped
        .iter()
        .any(|s| s.pid == sleeper.pid() && s.reason == NotSignalled::NoHandler));
    assert_eq!(d.containers[0].signalled[0].ns_pid, handler.pid());

    let notice: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("notice.json")).unwrap()).unwrap();
    assert_eq!(notice["notice_id"], "notice-1");
    assert_eq!(notice["source"], "aws");
    assert_eq!(notice["kind"], "interruption");
    assert_eq!(notice["signal"], "SIGUSR1");
    assert_eq!(notice["deadline_unix"], req.deadline.unwrap().as_second());
    assert_eq!(
        notice["checkpoint_deadline_unix"],
        req.checkpoint_deadline.as_second()
    );

    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results.len(), 1);
    let r = &results[0];
    assert_eq!(r.outcome, Outcome::Acked, "{}", r.detail);
    assert_eq!(r.signalled, 1);
    assert!(r.ack_latency.is_some());
    assert!(r.detail.contains("done step=42"), "{}", r.detail);
    assert!(marker(&dir, handler.pid()).exists());
    assert!(handler.running());
    assert!(
        sleeper.running(),
        "the process without a handler must never be signalled"
    );

    let text = encode(&registry);
    assert!(
        text.contains("spotguard_checkpoint_total{outcome=\"acked\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("spotguard_checkpoint_signals_total 1"),
        "{text}"
    );
    assert!(
        text.contains("spotguard_checkpoint_ack_latency_seconds_count 1"),
        "{text}"
    );
}

#[tokio::test]
async fn skipped_failed_and_plain_ack_groups_in_one_delivery() {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = ["a", "b", "c"].iter().map(|n| tmp.path().join(n)).collect();
    for d in &dirs {
        std::fs::create_dir(d).unwrap();
    }
    let skipper = handler(&dirs[0], &[("STATE", "skipped")]);
    let failer = handler(&dirs[1], &[("STATE", "failed")]);
    let plain = handler(&dirs[2], &[("PLAIN", "1")]);
    let groups = vec![
        host_group("skip", &dirs[0], vec![target(skipper.pid())], LONG),
        host_group("fail", &dirs[1], vec![target(failer.pid())], LONG),
        host_group("plain", &dirs[2], vec![target(plain.pid())], LONG),
    ];
    let req = request(false);
    let (registry, m) = metrics();
    let deliveries = deliver(&groups, &req, &m);
    assert!(deliveries
        .iter()
        .all(|d| d.state == DeliveryState::Signalled));
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    let outcomes: Vec<_> = results
        .iter()
        .map(|r| (r.group.as_str(), r.outcome))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            ("skip", Outcome::Skipped),
            ("fail", Outcome::Failed),
            ("plain", Outcome::Acked)
        ],
        "{results:#?}"
    );
    assert!(results[2].detail.contains("plain ack"));
    let text = encode(&registry);
    for o in ["skipped", "failed", "acked"] {
        assert!(
            text.contains(&format!("spotguard_checkpoint_total{{outcome=\"{o}\"}} 1")),
            "{text}"
        );
    }
    assert!(
        text.contains("spotguard_checkpoint_signals_total 3"),
        "{text}"
    );
}

#[tokio::test]
async fn exit_after_done_is_success_and_exit_without_done_is_exited() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    // exit 143 after the save, as the training helper recommends
    let mut clean = handler(&a, &[("STATE", "done"), ("EXIT", "143")]);
    let mut quitter = handler(&b, &[("EXIT", "0")]);
    let groups = vec![
        host_group("clean", &a, vec![target(clean.pid())], LONG),
        host_group("quit", &b, vec![target(quitter.pid())], LONG),
    ];
    let req = request(false);
    let (_r, m) = metrics();
    let results = wait(
        deliver(&groups, &req, &m),
        &req,
        &m,
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert_eq!(results[1].outcome, Outcome::Exited, "{}", results[1].detail);
    assert!(results[1].detail.contains("exited without done"));
    // Its ack may be read before the shell's `exit 143` that follows it.
    let exit = clean.wait_timeout(Duration::from_secs(5));
    assert_eq!(exit.and_then(|s| s.code()), Some(143), "exits after done");
    assert!(!quitter.running());
}

#[tokio::test]
async fn received_without_terminal_ack_times_out_and_stale_acks_do_not_count() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    let slow = handler(&a, &[("RECEIVED", "1")]);
    let silent = handler(&b, &[]);
    // an ack and a plain ack from an earlier notice
    for path in [b.join(format!("ack-{}.json", silent.pid())), b.join("ack")] {
        std::fs::write(&path, r#"{"state":"done"}"#).unwrap();
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        f.set_modified(std::time::SystemTime::now() - Duration::from_secs(600))
            .unwrap();
    }
    let timeout = Duration::from_millis(1500);
    let groups = vec![
        host_group("slow", &a, vec![target(slow.pid())], timeout),
        host_group("silent", &b, vec![target(silent.pid())], timeout),
    ];
    let req = request(false);
    let (registry, m) = metrics();
    let started = Instant::now();
    let results = wait(
        deliver(&groups, &req, &m),
        &req,
        &m,
        &CancellationToken::new(),
    )
    .await;
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert!(started.elapsed() < Duration::from_secs(15));
    for r in &results {
        assert_eq!(r.outcome, Outcome::Timeout, "{r:?}");
        assert_eq!(r.ack_latency, None);
    }
    assert!(
        results[0].detail.contains("received, no terminal ack"),
        "{}",
        results[0].detail
    );
    assert!(
        results[1].detail.contains("no ack"),
        "{}",
        results[1].detail
    );
    assert!(marker(&b, silent.pid()).exists());
    assert!(encode(&registry).contains("spotguard_checkpoint_total{outcome=\"timeout\"} 2"));
}

#[tokio::test]
async fn budget_is_capped_by_the_checkpoint_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let silent = handler(tmp.path(), &[]);
    let group = host_group(
        "g",
        tmp.path(),
        vec![target(silent.pid())],
        Duration::from_secs(600),
    );
    let mut req = request(false);
    req.checkpoint_deadline = Timestamp::now() + Duration::from_secs(1);
    let (_r, m) = metrics();
    let started = Instant::now();
    let results = wait(
        deliver(&[group], &req, &m),
        &req,
        &m,
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(results[0].outcome, Outcome::Timeout);
    assert!(started.elapsed() < Duration::from_secs(15));
}

#[tokio::test]
async fn no_handler_sends_nothing_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut a = sleeper();
    let mut b = sleeper();
    let group = host_group(
        "g",
        tmp.path(),
        vec![target(a.pid()), target(b.pid())],
        LONG,
    );
    let req = request(false);
    let (registry, m) = metrics();
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].state, DeliveryState::NoHandler);
    assert_eq!(deliveries[0].signalled(), 0);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::NoHandler);
    assert!(
        results[0].detail.contains("no_handler"),
        "{}",
        results[0].detail
    );
    assert!(!tmp.path().join("notice.json").exists());
    std::thread::sleep(Duration::from_millis(200));
    assert!(a.running() && b.running());
    let text = encode(&registry);
    assert!(
        text.contains("spotguard_checkpoint_total{outcome=\"no_handler\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("spotguard_checkpoint_signals_total 0"),
        "{text}"
    );
}

#[tokio::test]
async fn recycled_pid_is_never_signalled() {
    let tmp = tempfile::tempdir().unwrap();
    let mut kid = handler(tmp.path(), &[("STATE", "done")]);
    let mut t = target(kid.pid());
    t.start_time += 1; // what discovery saw was another process with this PID
    let group = host_group("g", tmp.path(), vec![t], LONG);
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].state, DeliveryState::Gone);
    assert!(matches!(
        deliveries[0].containers[0].skipped[0].reason,
        NotSignalled::Recycled { .. }
    ));
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Exited);
    assert!(
        results[0].detail.contains("recycled"),
        "{}",
        results[0].detail
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(!marker(tmp.path(), kid.pid()).exists());
    assert!(kid.running());
}

#[tokio::test]
async fn dry_run_writes_and_signals_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[("STATE", "done")]);
    let group = host_group("g", tmp.path(), vec![target(kid.pid())], LONG);
    let req = request(true);
    let (registry, m) = metrics();
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].state, DeliveryState::DryRun);
    assert_eq!(deliveries[0].containers[0].would_signal, vec![kid.pid()]);
    assert_eq!(deliveries[0].containers[0].notice, NoticeStatus::DryRun);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert!(
        results[0].detail.starts_with("dry-run:"),
        "{}",
        results[0].detail
    );
    assert!(results[0].detail.contains(&kid.pid().to_string()));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!marker(tmp.path(), kid.pid()).exists());
    assert!(!tmp.path().join("notice.json").exists());
    let text = encode(&registry);
    // Nothing counted: every outcome series is still at its start-up 0.
    assert!(!counted_checkpoints(&text), "{text}");
    assert!(
        text.contains("spotguard_checkpoint_signals_total 0"),
        "{text}"
    );
}

#[tokio::test]
async fn pid1_and_all_target_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    std::fs::create_dir(&a).unwrap();
    std::fs::create_dir(&b).unwrap();
    // pid1: only the init process (the first), even though the second also handles it
    let init = handler(&a, &[("STATE", "done")]);
    let other = handler(&a, &[("STATE", "done")]);
    let mut pid1 = host_group(
        "pid1",
        &a,
        vec![target(init.pid()), target(other.pid())],
        LONG,
    );
    pid1.mode = TargetMode::Pid1;
    // all: the sleeper is hit too, and SIGUSR1's default action kills it
    let handler = handler(&b, &[("STATE", "done")]);
    let mut victim = sleeper();
    let mut all = host_group(
        "all",
        &b,
        vec![target(handler.pid()), target(victim.pid())],
        LONG,
    );
    all.mode = TargetMode::All;
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&[pid1, all], &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![init.pid()]);
    assert_eq!(
        deliveries[1].signalled_pids(),
        vec![handler.pid(), victim.pid()]
    );
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(!marker(&a, other.pid()).exists());
    assert_eq!(results[1].outcome, Outcome::Exited, "{}", results[1].detail);
    use std::os::unix::process::ExitStatusExt;
    let status = victim.wait();
    assert_eq!(status.signal(), Some(libc::SIGUSR1));
}

#[tokio::test]
async fn pid1_without_known_init_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[]);
    let mut g = host_group("g", tmp.path(), vec![target(kid.pid())], LONG);
    g.mode = TargetMode::Pid1;
    g.containers[0].init_pid = None;
    let req = request(false);
    let (_r, m) = metrics();
    let results = wait(deliver(&[g], &req, &m), &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Error);
    assert!(
        results[0].detail.contains("init process is unknown"),
        "{}",
        results[0].detail
    );
}

#[tokio::test]
async fn restart_path_never_signals_but_sees_acks() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[("STATE", "done")]);
    let group = host_group("g", tmp.path(), vec![target(kid.pid())], LONG);
    let req = request(false);
    let (registry, m) = metrics();

    // The signal went out a minute ago, before this process started: nothing to wait for.
    let long_ago = Timestamp::now() - Duration::from_secs(60);
    let plan = plan_without_signal(std::slice::from_ref(&group), &req, long_ago);
    assert_eq!(plan[0].state, DeliveryState::Gone);
    assert_eq!(
        plan[0].containers[0].skipped[0].reason,
        NotSignalled::StartedAfterSignal
    );

    let signalled_at = Timestamp::now();
    let plan = plan_without_signal(std::slice::from_ref(&group), &req, signalled_at);
    assert_eq!(plan[0].state, DeliveryState::Signalled);
    assert_eq!(plan[0].signalled_at, Some(signalled_at));
    assert_eq!(plan[0].containers[0].notice, NoticeStatus::AlreadyWritten);
    assert!(!tmp.path().join("notice.json").exists());
    // The process acks (as it would have after the original signal).
    std::thread::sleep(Duration::from_millis(100));
    std::fs::write(
        tmp.path().join(format!("ack-{}.json", kid.pid())),
        r#"{"state":"done","step":7}"#,
    )
    .unwrap();
    let results = wait(plan, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !marker(tmp.path(), kid.pid()).exists(),
        "the restart path must not signal"
    );
    assert!(encode(&registry).contains("spotguard_checkpoint_signals_total 0"));
}

/// Host mode: several `--checkpoint-pidfile` groups share one checkpoint dir. Without a record
/// of the notice (`Signalled::Unrecorded`) each group reads `notice.json` to tell whether its
/// trainer was signalled before; the `notice.json` another group of the same delivery has just
/// written is not that proof. Every group's trainer is signalled, delivery after delivery.
#[test]
fn groups_sharing_a_dir_never_take_each_others_notice_for_an_earlier_signal() {
    let tmp = tempfile::tempdir().unwrap();
    let kids: Vec<Kid> = (0..6).map(|_| handler(tmp.path(), &[])).collect();
    let groups: Vec<TargetGroup> = kids
        .iter()
        .enumerate()
        .map(|(i, k)| host_group(&format!("g{i}"), tmp.path(), vec![target(k.pid())], LONG))
        .collect();
    let (_registry, m) = metrics();
    for round in 0..50 {
        // An interruption of a life of its own each round: a new notice.
        let prior = Prior {
            life: Some(format!("boot-{round}")),
            node: None,
            signalled_at: None,
            signalled: Signalled::Unrecorded,
        };
        let req = request(false);
        let deliveries = deliver_with(&groups, &req, &prior, &m);
        let unsignalled: Vec<&str> = deliveries
            .iter()
            .filter(|d| d.sent() != 1)
            .map(|d| d.group.as_str())
            .collect();
        assert!(
            unsignalled.is_empty(),
            "round {round}: groups {unsignalled:?} left unsignalled: {deliveries:#?}"
        );
    }
}

#[tokio::test]
async fn cancel_ends_the_wait() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[]);
    let group = host_group("g", tmp.path(), vec![target(kid.pid())], LONG);
    let req = request(false);
    let (registry, m) = metrics();
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.cancel();
    });
    let started = Instant::now();
    let results = wait(deliver(&[group], &req, &m), &req, &m, &cancel).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(results[0].outcome, Outcome::Error);
    assert!(results[0].detail.starts_with("cancelled"));
    assert!(!counted_checkpoints(&encode(&registry)));
}

/// Whether any `spotguard_checkpoint_total{outcome}` series is above 0 (they exist at 0 from
/// start-up).
fn counted_checkpoints(text: &str) -> bool {
    text.lines()
        .any(|l| l.starts_with("spotguard_checkpoint_total{") && !l.ends_with(" 0"))
}

#[tokio::test]
async fn pid_namespace_acks_use_the_namespaced_pid() {
    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", "sh", "-c", HANDLER])
        .env("DIR", tmp.path())
        .env("STATE", "done");
    let outer = Kid::spawn(cmd);
    // the shell is pid 1 of the new namespace, a child of unshare
    let proc = ProcFs::default();
    let mut inner = None;
    eventually_blocking("the namespaced shell", Duration::from_secs(10), || {
        inner = proc.pids().unwrap().into_iter().find(|p| {
            proc.status(*p).is_ok_and(|s| {
                s.ppid == outer.pid() && s.ns_pid() == Some(1) && s.catches(Signal::USR1)
            })
        });
        inner.is_some()
    });
    let inner = inner.unwrap();
    let mut group = host_group("ns", tmp.path(), vec![target(inner)], LONG);
    group.containers[0].root_pid = Some(inner);
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(deliveries[0].containers[0].signalled[0].ns_pid, 1);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(
        results[0].detail.contains("pid 1 in its namespace"),
        "{}",
        results[0].detail
    );
    assert!(tmp.path().join("ack-1.json").exists());
    assert!(tmp.path().join("notice.json").exists());
}

// === host selectors ===

fn targets(dir: &Path) -> HostTargets {
    HostTargets {
        units: Vec::new(),
        pidfiles: Vec::new(),
        cmdlines: Vec::new(),
        cmdline_uids: Vec::new(),
        dir: dir.to_path_buf(),
        signal: Signal::USR1,
        timeout: LONG,
    }
}

fn pids_of(g: &TargetGroup) -> Vec<i32> {
    let mut p: Vec<i32> = g
        .containers
        .iter()
        .flat_map(|c| c.processes.iter().map(|p| p.pid))
        .collect();
    p.sort_unstable();
    p
}

#[tokio::test]
async fn pidfile_selects_the_launcher_and_its_descendants() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    // launcher: a shell without a handler that starts a worker shell with one, and a sleeper
    let launcher_script = format!(
        "DIR={dir} STATE=done sh -c '{h}' & sleep 1000 & echo $$ > {pf}; wait",
        dir = dir.display(),
        h = HANDLER.replace('\'', "'\\''"),
        pf = tmp.path().join("train.pid").display()
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(&launcher_script);
    let launcher = Kid::spawn(cmd);
    let proc = ProcFs::default();
    let mut worker = None;
    eventually_blocking("the worker", Duration::from_secs(10), || {
        worker = proc.pids().unwrap().into_iter().find(|p| {
            proc.status(*p)
                .is_ok_and(|s| s.ppid == launcher.pid() && s.catches(Signal::USR1))
        });
        worker.is_some() && tmp.path().join("train.pid").exists()
    });
    let worker = worker.unwrap();
    let mut t = targets(&dir);
    t.pidfiles = vec![tmp.path().join("train.pid"), tmp.path().join("missing.pid")];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert_eq!(groups.len(), 2);
    let g = &groups[0];
    assert_eq!(
        g.name,
        format!("pidfile:{}", tmp.path().join("train.pid").display())
    );
    let pids = pids_of(g);
    assert!(
        pids.contains(&launcher.pid()) && pids.contains(&worker),
        "{pids:?}"
    );
    assert!(
        pids.len() >= 4,
        "launcher, worker, worker's sleep, sleeper: {pids:?}"
    );
    assert_eq!(g.containers[0].init_pid, Some(launcher.pid()));
    assert_eq!(g.containers[0].root_pid, None);
    assert_eq!(g.mode, TargetMode::Handlers);
    assert!(pids_of(&groups[1]).is_empty());

    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&groups, &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![worker]);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert_eq!(results[1].outcome, Outcome::NoHandler);
    assert!(
        dir.join("notice.json").exists(),
        "the checkpoint dir is created"
    );
    let notice: NoticeFile = CheckpointDir::host(&dir)
        .unwrap()
        .read_notice()
        .unwrap()
        .unwrap();
    assert_eq!(notice.notice_id, "notice-1");
}

#[tokio::test]
async fn stale_pidfile_selects_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[]);
    let pf = tmp.path().join("old.pid");
    std::fs::write(&pf, kid.pid().to_string()).unwrap();
    let f = std::fs::File::options().write(true).open(&pf).unwrap();
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    let mut t = targets(tmp.path());
    t.pidfiles = vec![pf];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert!(pids_of(&groups[0]).is_empty());
}

#[tokio::test]
async fn cmdline_selects_matching_processes_but_never_spotguard() {
    let tmp = tempfile::tempdir().unwrap();
    let token = format!("sg-train-{}", fastrand::u64(..));
    let mut cmd = Command::new("sh");
    // `$0` carries the token into the cmdline
    cmd.args(["-c", HANDLER, &token])
        .env("DIR", tmp.path())
        .env("STATE", "done");
    let kid = Kid::spawn(cmd);
    wait_for_handler(kid.pid());
    let mut t = targets(tmp.path());
    t.cmdlines = vec![
        regex::Regex::new(&format!("(?s)^sh -c .* {token}$")).unwrap(),
        // matches this test binary's own cmdline: never selected
        regex::Regex::new("checkpoint").unwrap(),
    ];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert_eq!(pids_of(&groups[0]), vec![kid.pid()]);
    assert!(!pids_of(&groups[1]).contains(&(std::process::id() as i32)));
    let req = request(false);
    let (_r, m) = metrics();
    let results = wait(
        deliver(&groups[..1], &req, &m),
        &req,
        &m,
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
}

/// In host mode any local user can start a process whose command line matches: with
/// `--checkpoint-cmdline-uid` only the named user's matching process is selected and signalled,
/// another uid's, matching the same pattern and catching the signal too, never.
#[tokio::test]
async fn cmdline_with_a_uid_selects_only_that_users_processes() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let token = format!("sg-uid-{}", fastrand::u64(..));
    let as_uid = |uid: u32| {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", HANDLER, &token]).env("DIR", tmp.path());
        spotguard_testkit::process::as_user(&mut cmd, uid);
        let kid = Kid::spawn(cmd);
        wait_for_handler(kid.pid());
        kid
    };
    let trainer = as_uid(1000);
    let squatter = as_uid(1001);
    let mut t = targets(tmp.path());
    t.cmdlines = vec![regex::Regex::new(&token).unwrap()];
    let mut both = vec![trainer.pid(), squatter.pid()];
    both.sort_unstable();
    let groups = HostDiscovery::new(t.clone()).discover().await.unwrap();
    assert_eq!(pids_of(&groups[0]), both, "the pattern alone matches both");
    t.cmdline_uids = vec![1000];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert_eq!(pids_of(&groups[0]), vec![trainer.pid()]);
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&groups, &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![trainer.pid()]);
    let marker = |pid: i32| tmp.path().join(format!("marker-{pid}"));
    eventually_blocking("the trainer's marker", Duration::from_secs(10), || {
        marker(trainer.pid()).exists()
    });
    assert!(
        !marker(squatter.pid()).exists(),
        "another uid's process was signalled"
    );
    let done = CancellationToken::new();
    done.cancel();
    wait(deliveries, &req, &m, &done).await;
}

/// A cgroup directory created for a test, removed on drop (after its processes are gone).
struct Cgroup(PathBuf);

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.0).is_ok() || !self.0.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[tokio::test]
async fn unit_selects_the_units_cgroup() {
    let tmp = tempfile::tempdir().unwrap();
    let n = fastrand::u64(..);
    let slice = Cgroup(PathBuf::from(format!(
        "/sys/fs/cgroup/systemd/sg-test-{n}.slice"
    )));
    let unit = Cgroup(slice.0.join(format!("sg-train-{n}.service")));
    std::fs::create_dir_all(&unit.0).unwrap();
    let kid = handler(tmp.path(), &[("STATE", "done")]);
    let outside = handler(tmp.path(), &[]);
    std::fs::write(unit.0.join("cgroup.procs"), kid.pid().to_string()).unwrap();
    let mut t = targets(tmp.path());
    t.units = vec![format!("sg-train-{n}"), format!("sg-absent-{n}.service")];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert_eq!(groups[0].name, format!("unit:sg-train-{n}.service"));
    assert_eq!(pids_of(&groups[0]), vec![kid.pid()]);
    assert_eq!(groups[0].containers[0].init_pid, Some(kid.pid()));
    assert!(pids_of(&groups[1]).is_empty());
    let req = request(false);
    let (_r, m) = metrics();
    let results = wait(
        deliver(&groups, &req, &m),
        &req,
        &m,
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert_eq!(results[1].outcome, Outcome::NoHandler);
    assert!(!marker(tmp.path(), outside.pid()).exists());
    drop(kid);
    drop(unit);
    drop(slice);
}

// === pidfile rules ===

#[tokio::test]
async fn pidfile_rules_each_refuse_with_a_clear_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let kid = handler(tmp.path(), &[]);
    let d = HostDiscovery::new(targets(tmp.path()));
    let refuse = |name: &str, want: &str| {
        let path = tmp.path().join(name);
        let started = Instant::now();
        let err = d.check_pidfile(&path).unwrap_err().to_string();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{name}: refusing took {:?}",
            started.elapsed()
        );
        assert!(err.contains(want), "{name}: {err}");
        assert!(err.contains(&path.display().to_string()), "{err}");
    };

    let good = tmp.path().join("good.pid");
    std::fs::write(&good, format!("{}\n", kid.pid())).unwrap();
    assert_eq!(d.check_pidfile(&good).unwrap(), kid.pid());

    // never followed: a symlink to the good pidfile, and to /dev/zero (never read)
    std::os::unix::fs::symlink(&good, tmp.path().join("link.pid")).unwrap();
    refuse("link.pid", "symlink");
    std::os::unix::fs::symlink("/dev/zero", tmp.path().join("zero.pid")).unwrap();
    refuse("zero.pid", "symlink");
    // a FIFO nobody writes: refused at once, not waited on
    rustix::fs::mknodat(
        rustix::fs::CWD,
        tmp.path().join("fifo.pid"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    refuse("fifo.pid", "FIFO, not a regular file");
    std::fs::create_dir(tmp.path().join("dir.pid")).unwrap();
    refuse("dir.pid", "directory, not a regular file");
    // size cap
    std::fs::write(tmp.path().join("huge.pid"), vec![b'7'; 4096]).unwrap();
    refuse("huge.pid", "4096 bytes is not a pid");
    // never PID 1
    std::fs::write(tmp.path().join("init.pid"), "1\n").unwrap();
    refuse("init.pid", "pid 1");
    // owner must be root or the process's user: uid 1000 cannot name a root process
    let other = tmp.path().join("other.pid");
    std::fs::write(&other, kid.pid().to_string()).unwrap();
    std::os::unix::fs::chown(&other, Some(1000), Some(1000)).unwrap();
    refuse("other.pid", "owned by uid 1000 but process");

    // ... but may name its own process
    let mut cmd = Command::new("sleep");
    cmd.arg("1000").uid(1000).gid(1000);
    let user_kid = Kid::spawn(cmd);
    wait_for_exec(user_kid.pid(), "sleep");
    let own = tmp.path().join("own.pid");
    std::fs::write(&own, user_kid.pid().to_string()).unwrap();
    std::os::unix::fs::chown(&own, Some(1000), Some(1000)).unwrap();
    assert_eq!(d.check_pidfile(&own).unwrap(), user_kid.pid());
}

#[tokio::test]
async fn pidfile_descendants_are_only_those_of_the_same_user() {
    let tmp = tempfile::tempdir().unwrap();
    let pf = tmp.path().join("launch.pid");
    let script = format!(
        "setpriv --reuid=1000 --regid=1000 --clear-groups sleep 1000 & sleep 1000 & echo $$ > {}; wait",
        pf.display()
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(&script);
    let launcher = Kid::spawn(cmd);
    let proc = ProcFs::default();
    let kids = || -> Vec<(i32, u32)> {
        proc.pids()
            .unwrap()
            .into_iter()
            .filter_map(|p| {
                let s = proc.status(p).ok()?;
                (s.ppid == launcher.pid() && s.name == "sleep").then_some((p, s.uid))
            })
            .collect()
    };
    eventually_blocking("both sleepers", Duration::from_secs(10), || {
        kids().len() == 2 && pf.exists()
    });
    let kids = kids();
    let mut t = targets(tmp.path());
    t.pidfiles = vec![pf];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    let pids = pids_of(&groups[0]);
    for (pid, uid) in kids {
        assert_eq!(
            pids.contains(&pid),
            uid == 0,
            "pid {pid} uid {uid}: {pids:?}"
        );
    }
    assert!(pids.contains(&launcher.pid()));
}

// === what counts as a handler (issue 42 item 5) ===

/// A trainer's user (`setpriv`/`as_user`), so the processes are not root's.
const TRAINER_UID: u32 = 1000;

/// A work dir the trainer's user owns, with `scratch/part-0` in it (what a launcher's EXIT trap
/// deletes) and `ckpt/`.
fn trainer_workdir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let work = tmp.path().join("work");
    std::fs::create_dir_all(work.join("scratch")).unwrap();
    std::fs::create_dir_all(work.join("ckpt")).unwrap();
    std::fs::write(work.join("scratch/part-0"), b"saved").unwrap();
    for p in [&work, &work.join("scratch"), &work.join("ckpt")] {
        std::os::unix::fs::chown(p, Some(TRAINER_UID), Some(TRAINER_UID)).unwrap();
    }
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    (tmp, work)
}

/// The child of `parent` that runs `sh` and catches SIGUSR1 (the trainer), once there is one
/// (not bash's fork before its exec, which still has bash's handlers).
fn trainer_of(parent: i32) -> i32 {
    let proc = ProcFs::default();
    let mut found = None;
    eventually_blocking("the trainer", Duration::from_secs(10), || {
        found = proc.pids().unwrap().into_iter().find(|p| {
            proc.status(*p)
                .is_ok_and(|s| s.ppid == parent && s.name == "sh" && s.catches(Signal::USR1))
        });
        found.is_some()
    });
    found.unwrap()
}

/// bash with an `EXIT` trap catches SIGUSR1 (it catches every terminating signal to run the trap)
/// and dies of it: a launcher `trap 'rm -rf $SCRATCH' EXIT; <trainer>` selected with a pidfile is
/// not signalled; its trainer is, and acks; the scratch dir survives.
#[tokio::test]
async fn a_launcher_with_an_exit_trap_is_not_signalled_its_trainer_is() {
    let (_tmp, work) = trainer_workdir();
    let dir = work.join("ckpt");
    let pf = work.join("train.pid");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(r#"trap 'rm -rf "$SCRATCH"' EXIT; echo $$ > "$PF"; sh -c "$HANDLER"; true"#)
        .env("SCRATCH", work.join("scratch"))
        .env("PF", &pf)
        .env("HANDLER", HANDLER)
        .env("DIR", &dir)
        .env("STATE", "done")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    as_user(&mut cmd, TRAINER_UID);
    let mut launcher = Kid::spawn(cmd);
    let trainer = trainer_of(launcher.pid());
    eventually_blocking("the pidfile", Duration::from_secs(10), || pf.exists());
    let proc = ProcFs::default();
    assert!(
        proc.status(launcher.pid()).unwrap().catches(Signal::USR1),
        "bash with an EXIT trap shows SIGUSR1 in SigCgt"
    );
    let mut t = targets(&dir);
    t.pidfiles = vec![pf];
    let groups = HostDiscovery::new(t).discover().await.unwrap();
    assert!(pids_of(&groups[0]).contains(&launcher.pid()));
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&groups, &req, &m);
    assert_eq!(
        deliveries[0].signalled_pids(),
        vec![trainer],
        "{:?}",
        deliveries[0].containers[0].skipped
    );
    assert!(
        deliveries[0].containers[0].skipped.iter().any(|s| {
            s.pid == launcher.pid() && matches!(s.reason, NotSignalled::NotAHandler(_))
        }),
        "{:?}",
        deliveries[0].containers[0].skipped
    );
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(launcher.running(), "the launcher lives on");
    assert!(
        work.join("scratch/part-0").exists(),
        "the launcher's EXIT trap never ran"
    );
}

/// A container whose entrypoint is a bash script with an `EXIT` trap: bash is PID 1 of its own PID
/// namespace (as uid 1000), and a notice for the container signals its trainer, never PID 1 (whose
/// death would take the whole namespace down).
#[tokio::test]
async fn a_bash_pid1_with_an_exit_trap_survives_the_notice() {
    let (_tmp, work) = trainer_workdir();
    let dir = work.join("ckpt");
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--kill-child",
        "setpriv",
        "--reuid=1000",
        "--regid=1000",
        "--clear-groups",
        "bash",
        "-c",
        r#"trap 'rm -rf "$SCRATCH"' EXIT; sh -c "$HANDLER"; true"#,
    ])
    .env("SCRATCH", work.join("scratch"))
    .env("HANDLER", HANDLER)
    .env("DIR", &dir)
    .env("STATE", "done")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let outer = Kid::spawn(cmd);
    let proc = ProcFs::default();
    let mut init = None;
    eventually_blocking("the namespace's bash", Duration::from_secs(10), || {
        init = proc.pids().unwrap().into_iter().find(|p| {
            proc.status(*p).is_ok_and(|s| {
                s.ppid == outer.pid() && s.ns_pid() == Some(1) && s.catches(Signal::USR1)
            })
        });
        init.is_some()
    });
    let init = init.unwrap();
    let init_start = target(init).start_time;
    let trainer = trainer_of(init);
    let mut group = host_group("ns", &dir, vec![target(init), target(trainer)], LONG);
    group.containers[0].root_pid = Some(init);
    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&[group], &req, &m);
    assert_eq!(
        deliveries[0].signalled_pids(),
        vec![trainer],
        "{:?}",
        deliveries[0].containers[0].skipped
    );
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(proc.alive(init, init_start).unwrap(), "PID 1 lives");
    assert!(work.join("scratch/part-0").exists());
}

/// A bash script that traps SIGUSR1 itself *and* has an `EXIT` trap cannot be told from a
/// launcher by its masks: `handlers` leaves it alone (`no_handler`), and the operator's explicit
/// `caught` signals it; it handles the signal and lives on.
#[tokio::test]
async fn the_caught_mode_signals_a_shell_that_handlers_leaves_alone() {
    let (_tmp, work) = trainer_workdir();
    let dir = work.join("ckpt");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!(r#"trap 'rm -rf "$SCRATCH"' EXIT{HANDLER}"#))
        .env("SCRATCH", work.join("scratch"))
        .env("DIR", &dir)
        .env("STATE", "done")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    as_user(&mut cmd, TRAINER_UID);
    let mut script = Kid::spawn(cmd);
    wait_for_handler(script.pid());
    let req = request(false);
    let (_r, m) = metrics();
    let group = host_group("script", &dir, vec![target(script.pid())], LONG);
    let deliveries = deliver(std::slice::from_ref(&group), &req, &m);
    assert_eq!(deliveries[0].state, DeliveryState::NoHandler);
    let mut caught = group.clone();
    caught.mode = TargetMode::Caught;
    let deliveries = deliver(&[caught], &req, &m);
    assert_eq!(deliveries[0].signalled_pids(), vec![script.pid()]);
    let results = wait(deliveries, &req, &m, &CancellationToken::new()).await;
    assert_eq!(results[0].outcome, Outcome::Acked, "{}", results[0].detail);
    assert!(script.running());
    assert!(work.join("scratch/part-0").exists());
}

// === host mode: warm candidates ===

/// A shell running [`HANDLER`] whose cmdline carries `token` (as `$0`); with `removable`, SIGUSR2
/// removes its SIGUSR1 handler.
fn tagged_handler(dir: &Path, token: &str, removable: bool) -> Kid {
    let script = if removable {
        format!("trap 'trap - USR1' USR2\n{HANDLER}")
    } else {
        HANDLER.to_string()
    };
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg(script).arg(token).env("DIR", dir);
    let kid = Kid::spawn(cmd);
    wait_for_handler(kid.pid());
    wait_for_handler_sleep(kid.pid());
    kid
}

/// Until [`HANDLER`]'s `sleep` child in `pid` has exec'd: before, it is a fork of the handler
/// whose command line matches the handler's selectors too.
fn wait_for_handler_sleep(pid: i32) {
    eventually_blocking("the handler's sleep", Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse().ok())
            .any(|c| ProcFs::default().status(c).is_ok_and(|s| s.name == "sleep"))
    });
}

/// A `sleep` that gets PID `pid` (the kernel's next PID set through `ns_last_pid`; other
/// processes on the machine may take it first, so it is tried again).
fn sleeper_with_pid(pid: i32) -> Kid {
    // a PID stays taken while it names a process group with members (zombies included)
    let in_group = || {
        ProcFs::default().pids().unwrap().into_iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|t| {
                t.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(2).map(str::to_string))
                    == Some(pid.to_string())
            })
        })
    };
    eventually_blocking(
        "the old process group gone",
        Duration::from_secs(10),
        || !in_group(),
    );
    for _ in 0..500 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
            .expect("write ns_last_pid (needs root)");
        let mut cmd = Command::new("sleep");
        cmd.arg("1000");
        let kid = Kid::spawn(cmd);
        if kid.pid() == pid {
            wait_for_exec(pid, "sleep");
            return kid;
        }
    }
    panic!("pid {pid} was never given to a new process");
}

fn processes_of(groups: &[TargetGroup]) -> Vec<(String, Vec<TargetProcess>)> {
    groups
        .iter()
        .map(|g| {
            let mut p: Vec<TargetProcess> = g
                .containers
                .iter()
                .flat_map(|c| c.processes.clone())
                .collect();
            p.sort_by_key(|p| p.pid);
            (g.name.clone(), p)
        })
        .collect()
}

/// After a background refresh: a candidate exits and its PID goes to a process that does not
/// match, another removes its handler, a new matching process starts. The notice's re-read of
/// the warm candidates gives exactly what a full scan gives, and only the processes that catch the
/// signal now are signalled.
#[tokio::test]
async fn warm_candidates_give_what_the_full_scan_gives() {
    use spotguard::checkpoint::discover::{HostFoundBy, WARM_INTERVAL};
    let tmp = tempfile::tempdir().unwrap();
    let token = format!("sg-warm-{}", fastrand::u64(..));
    let exits = tagged_handler(tmp.path(), &token, false);
    let mut drops = tagged_handler(tmp.path(), &token, true);
    let stays = tagged_handler(tmp.path(), &token, false);
    let mut t = targets(tmp.path());
    t.cmdlines = vec![regex::Regex::new(&token).unwrap()];
    let d = HostDiscovery::new(t);
    d.refresh_warm(WARM_INTERVAL).unwrap();
    let (warm_groups, how) = d.discover_with().unwrap();
    assert_eq!(how, HostFoundBy::Warm);
    assert_eq!(pids_of(&warm_groups[0]), {
        let mut v = vec![exits.pid(), drops.pid(), stays.pid()];
        v.sort_unstable();
        v
    });

    // the candidate exits; its PID is reused by a process that does not match (the kernel's
    // PID counter set back for it, then forward again where it was, as after a natural wrap the
    // counter runs on from the reused PID)
    let reused = exits.pid();
    drop(exits);
    let counter = ProcFs::default().last_pid().unwrap();
    let impostor = sleeper_with_pid(reused);
    std::fs::write("/proc/sys/kernel/ns_last_pid", counter.to_string()).unwrap();
    // a candidate removes its handler
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(drops.pid()).unwrap(),
        rustix::process::Signal::USR2,
    )
    .unwrap();
    let proc = ProcFs::default();
    eventually_blocking("the handler removed", Duration::from_secs(10), || {
        proc.status(drops.pid())
            .is_ok_and(|s| !s.catches(Signal::USR1))
    });
    // a new matching process after the refresh
    let newcomer = tagged_handler(tmp.path(), &token, false);

    let (groups, how) = d.discover_with().unwrap();
    assert_eq!(how, HostFoundBy::Warm, "the warm set is still trusted");
    let full = d.discover_full().unwrap();
    assert_eq!(processes_of(&groups), processes_of(&full));
    let pids = pids_of(&groups[0]);
    assert!(!pids.contains(&impostor.pid()), "{pids:?}");
    assert!(pids.contains(&newcomer.pid()) && pids.contains(&drops.pid()));

    let req = request(false);
    let (_r, m) = metrics();
    let deliveries = deliver(&groups, &req, &m);
    let mut want = vec![stays.pid(), newcomer.pid()];
    want.sort_unstable();
    let mut got = deliveries[0].signalled_pids();
    got.sort_unstable();
    assert_eq!(got, want);
    assert!(
        drops.running(),
        "never signalled: the default action would kill it"
    );
    let done = CancellationToken::new();
    done.cancel();
    wait(deliveries, &req, &m, &done).await;
}

/// Processes created after a full refresh are folded into the warm set by the background's
/// catch-up: the notice then re-reads its targets (and the few processes that may still exec),
/// not every process created since the refresh, and finds what a full scan finds.
#[tokio::test]
async fn after_the_catch_up_the_notice_reads_none_of_the_processes_created_since_the_refresh() {
    use spotguard::checkpoint::discover::{HostFoundBy, WARM_INTERVAL};
    use spotguard_testkit::process::sleepers;
    let tmp = tempfile::tempdir().unwrap();
    let token = format!("sg-catchup-{}", fastrand::u64(..));
    let mut t = targets(tmp.path());
    t.cmdlines = vec![regex::Regex::new(&token).unwrap()];
    let d = HostDiscovery::new(t);
    d.refresh_warm(WARM_INTERVAL).unwrap();
    // after the refresh: 200 other processes and a matching one
    let others = sleepers(200, &tmp.path().join("sleepers"));
    let newcomer = tagged_handler(tmp.path(), &token, false);
    let others_read = |d: &HostDiscovery| {
        let read = d.notice_reads().expect("the warm set is trusted");
        others.pids().iter().filter(|p| read.contains(p)).count()
    };
    assert_eq!(
        others_read(&d),
        200,
        "not caught up yet: read at the notice"
    );
    // forks that never exec are settled from SETTLE_AGE on; the catch-up folds them in then
    eventually_blocking(
        "the other processes folded into the warm set",
        Duration::from_secs(10),
        || {
            d.catch_up().unwrap();
            others_read(&d) == 0
        },
    );
    let (groups, how) = d.discover_with().unwrap();
    assert_eq!(how, HostFoundBy::Warm);
    assert_eq!(pids_of(&groups[0]), vec![newcomer.pid()]);
    assert_eq!(
        processes_of(&groups),
        processes_of(&d.discover_full().unwrap())
    );
}

/// A warm set older than three refresh periods is not trusted: the notice reads every process.
#[tokio::test]
async fn stale_warm_candidates_fall_back_to_the_full_scan() {
    use spotguard::checkpoint::discover::HostFoundBy;
    let tmp = tempfile::tempdir().unwrap();
    let token = format!("sg-stale-{}", fastrand::u64(..));
    let kid = tagged_handler(tmp.path(), &token, false);
    let mut t = targets(tmp.path());
    t.cmdlines = vec![regex::Regex::new(&token).unwrap()];
    let d = HostDiscovery::new(t);
    assert_eq!(
        d.discover_with().unwrap().1,
        HostFoundBy::FullScan,
        "none yet"
    );
    // no pause before the next refresh: trusted for three times what the refresh took
    d.refresh_warm(Duration::ZERO).unwrap();
    let mut last = None;
    eventually_blocking(
        "the warm set no longer trusted",
        Duration::from_secs(10),
        || {
            let (groups, how) = d.discover_with().unwrap();
            let stale = how == HostFoundBy::FullScan;
            last = Some(groups);
            stale
        },
    );
    assert_eq!(pids_of(&last.unwrap()[0]), vec![kid.pid()]);
}

/// A launcher started just before the refresh (a shell: recent and unsettled) that, after the
/// refresh, execs into a matching command line is found by the notice's warm re-read, as a full
/// scan finds it. (The recent processes that have become their program are not re-read: the
/// `signal_path` bench's "started 2 s before" rows.)
#[tokio::test]
async fn a_recent_launcher_that_execs_into_a_match_after_the_refresh_is_found_warm() {
    use spotguard::checkpoint::discover::{HostFoundBy, WARM_INTERVAL};
    let tmp = tempfile::tempdir().unwrap();
    let token = format!("sg-exec-{}", fastrand::u64(..));
    let go = tmp.path().join("go");
    assert!(Command::new("mkfifo").arg(&go).status().unwrap().success());
    // its own command line does not name the token; the program it execs into does
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("read _ < \"$GO\"; exec sh -c \"$HANDLER\" \"$TOKEN\"")
        .env("GO", &go)
        .env("HANDLER", HANDLER)
        .env("TOKEN", &token)
        .env("DIR", tmp.path());
    let launcher = Kid::spawn(cmd);
    let mut t = targets(tmp.path());
    t.cmdlines = vec![regex::Regex::new(&token).unwrap()];
    let d = HostDiscovery::new(t);
    d.refresh_warm(WARM_INTERVAL).unwrap();
    let (before, _) = d.discover_with().unwrap();
    assert!(pids_of(&before[0]).is_empty(), "not a match yet");
    std::fs::write(&go, "go\n").unwrap();
    wait_for_handler(launcher.pid());
    wait_for_handler_sleep(launcher.pid());
    let (groups, how) = d.discover_with().unwrap();
    assert_eq!(how, HostFoundBy::Warm, "the warm set is still trusted");
    assert_eq!(pids_of(&groups[0]), vec![launcher.pid()]);
    assert_eq!(
        processes_of(&groups),
        processes_of(&d.discover_full().unwrap())
    );
}
