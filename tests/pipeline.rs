//! End to end in host mode, over loopback HTTP: the embedded metadata emulator (real wire
//! protocols) → notice sources → store → responder → checkpoint signal to real child processes →
//! acks → persisted state. Faults: 5xx storms, stalls, resets, expired tokens, garbage, a metadata
//! server that is down at start.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig, Fault};
use spotguard::responder::PlanEvent;
use spotguard_testkit::metrics_text;
use spotguard_testkit::process::catches_usr1;
use spotguard_testkit::wait_for_event as wait_for;
use tokio_util::sync::CancellationToken;

/// A training-like process tree under one parent: the parent `bash` and a `sleep` do not catch
/// SIGUSR1; the trainer does, records each signal in `marks`, and writes a `done` ack.
struct Trainer {
    parent: tokio::process::Child,
    dir: PathBuf,
    pidfile: PathBuf,
}

const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; printf '"'"'{"state":"done","step":%d,"checkpoint":"ckpt-%d","ts":%s}'"'"' $n $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

impl Trainer {
    async fn start(dir: &Path) -> Trainer {
        std::fs::create_dir_all(dir.join("ckpt")).unwrap();
        let script = format!(
            "sleep 1000 & echo $! > '{d}/sleep.pid'; bash -c '{t}' & echo $! > '{d}/trainer.pid'; wait",
            d = dir.display(),
            t = TRAINER.replace('\'', r"'\''"),
        );
        let parent = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(script)
            .env("SPOTGUARD_DIR", dir.join("ckpt"))
            .env("MARKS", dir.join("marks"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pidfile = dir.join("parent.pid");
        std::fs::write(&pidfile, parent.id().unwrap().to_string()).unwrap();
        // Wait until the trainer has installed its trap.
        let t = Trainer {
            parent,
            dir: dir.to_path_buf(),
            pidfile,
        };
        for _ in 0..200 {
            if let Some(pid) = t.pid("trainer.pid") {
                if catches_usr1(pid) {
                    return t;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("trainer did not start");
    }

    fn pid(&self, file: &str) -> Option<i32> {
        std::fs::read_to_string(self.dir.join(file))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    fn signals_seen(&self) -> usize {
        std::fs::read_to_string(self.dir.join("marks"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn alive(&self, file: &str) -> bool {
        self.pid(file).is_some_and(alive)
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        for f in ["sleep.pid", "trainer.pid"] {
            if let Some(p) = self.pid(f) {
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        let _ = self.parent.start_kill();
    }
}

fn alive(pid: i32) -> bool {
    // A zombie still answers kill(0); check the state too.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    let exists = unsafe { libc::kill(pid, 0) } == 0;
    exists && state != Some("Z")
}

fn run_args(cloud: &str, endpoint: &str, t: &Trainer, extra: &[&str]) -> config::RunArgs {
    let mut argv: Vec<String> = vec![
        "--mode=host".into(),
        format!("--cloud={cloud}"),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=20s".into(),
        format!("--checkpoint-dir={}", t.dir.join("ckpt").display()),
        format!("--state-dir={}", t.dir.join("state").display()),
        format!("--checkpoint-pidfile={}", t.pidfile.display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        format!(
            "--log-level={}",
            std::env::var("SG_TEST_LOG").unwrap_or_else(|_| "warn".into())
        ),
        "--shutdown-grace=2s".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"))
}

async fn start_agent(args: config::RunArgs) -> (app::App, CancellationToken) {
    let cfg = Config::resolve(args, &config::ProcessEnv).unwrap();
    spotguard::telemetry::init(config::LogFormat::Text, &cfg.args.log_level);
    let cancel = CancellationToken::new();
    let app = app::start(cfg, cancel.clone()).await.unwrap();
    (app, cancel)
}

fn persisted_phase(t: &Trainer) -> Option<String> {
    let s = std::fs::read_to_string(t.dir.join("state/notice.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&s).ok()?;
    v.get("phase")?.as_str().map(str::to_string)
}

async fn interruption_round_trip(cloud: Cloud) {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
    let (app, cancel) = start_agent(run_args(cloud.as_str(), &emu.base_url(), &t, &[])).await;
    let mut events = app.events;
    // A first poll answered before the notice is raised.
    wait_metrics(app.admin_addr, |m| {
        read(
            m,
            &format!(
                "spotguard_metadata_polls_total{{source=\"{}\"}}",
                cloud.as_str()
            ),
        ) > 0.0
    })
    .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();

    let processes = wait_for(&mut events, Duration::from_secs(20), |e| match e {
        PlanEvent::Signalled { processes, .. } => Some(*processes),
        _ => None,
    })
    .await;
    assert_eq!(
        processes, 1,
        "only the process that catches SIGUSR1 is signalled"
    );
    let results = wait_for(&mut events, Duration::from_secs(20), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].outcome.as_str(), "acked", "{:?}", results[0]);
    wait_for(&mut events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;

    assert_eq!(t.signals_seen(), 1);
    assert!(
        t.alive("sleep.pid"),
        "a process that does not catch SIGUSR1 must live"
    );
    assert!(t.alive("trainer.pid"));
    assert_eq!(persisted_phase(&t).as_deref(), Some("done"));
    let notice: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(t.dir.join("ckpt/notice.json")).unwrap())
            .unwrap();
    assert_eq!(notice["source"], cloud.as_str());
    assert_eq!(notice["kind"], "interruption");
    assert_eq!(notice["signal"], "SIGUSR1");

    // Re-polls of the same notice never signal again: the store decided a later one is a
    // duplicate. (GCE's watch answers again only when its hanging GET times out, after 60 s:
    // no re-poll comes within the test.)
    if cloud != Cloud::Gce {
        next_duplicates(app.admin_addr, "interruption", 2).await;
        let later = pending(&mut events);
        assert!(
            !later
                .iter()
                .any(|e| matches!(e, PlanEvent::NoticeSeen { .. })),
            "a re-poll started a plan: {later:#?}"
        );
    }
    assert_eq!(t.signals_seen(), 1);
    let m = metrics_text(app.admin_addr).await;
    assert!(
        m.contains(&format!(
            "spotguard_notices_total{{source=\"{}\",kind=\"interruption\"}} 1",
            cloud.as_str()
        )),
        "{m}"
    );
    assert!(
        m.contains("spotguard_checkpoint_total{outcome=\"acked\"} 1"),
        "{m}"
    );
    if cloud == Cloud::Azure {
        // Approved only after checkpoint (and drain) completed.
        assert_eq!(emu.azure_acks().len(), 1);
    }
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_spot_interruption_signals_the_handler_only() {
    interruption_round_trip(Cloud::Aws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gce_preemption_signals_the_handler_only() {
    interruption_round_trip(Cloud::Gce).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_preempt_signals_then_acknowledges() {
    interruption_round_trip(Cloud::Azure).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_rebalance_is_an_early_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let (app, cancel) = start_agent(run_args("aws", &emu.base_url(), &t, &[])).await;
    let mut events = app.events;
    emu.raise(EmulatedNotice::rebalance()).unwrap();
    let results = wait_for(&mut events, Duration::from_secs(20), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results[0].outcome.as_str(), "acked");
    assert_eq!(t.signals_seen(), 1);
    // An interruption after a rebalance still checkpoints (a fresh save).
    emu.raise(EmulatedNotice::interruption()).unwrap();
    wait_for(&mut events, Duration::from_secs(20), |e| match e {
        PlanEvent::Checkpointed { .. } => Some(()),
        _ => None,
    })
    .await;
    assert_eq!(t.signals_seen(), 2);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_maintenance_is_undone() {
    for cloud in [Cloud::Aws, Cloud::Azure] {
        let tmp = tempfile::tempdir().unwrap();
        let t = Trainer::start(tmp.path()).await;
        let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
        // Lead longer than the notice: handling starts at once.
        let (app, cancel) = start_agent(run_args(
            cloud.as_str(),
            &emu.base_url(),
            &t,
            &["--maintenance-lead=1h", "--on-maintenance=cordon"],
        ))
        .await;
        let mut events = app.events;
        let raised = emu
            .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
            .unwrap();
        wait_for(&mut events, Duration::from_secs(20), |e| {
            matches!(e, PlanEvent::Done { .. }).then_some(())
        })
        .await;
        assert_eq!(persisted_phase(&t).as_deref(), Some("done"));
        emu.cancel(Some(&raised.id)).unwrap();
        let undone = wait_for(&mut events, Duration::from_secs(20), |e| match e {
            PlanEvent::Undone { id, .. } => Some(id.clone()),
            _ => None,
        })
        .await;
        assert_eq!(undone, raised.id, "{cloud}");
        assert_eq!(persisted_phase(&t), None, "state cleared after undo");
        assert_eq!(t.signals_seen(), 0, "cordon policy never signals");
        cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_are_counted_and_the_notice_is_still_seen() {
    for (cloud, faults) in [
        (
            Cloud::Aws,
            vec![
                Fault::error(500).times(6),
                Fault::expire_tokens(),
                Fault::garbage().times(5),
                Fault::drop_connections().times(5),
                Fault::stall(Duration::from_secs(3)).times(2),
            ],
        ),
        (
            Cloud::Gce,
            vec![
                Fault::error(503).times(10),
                Fault::drop_connections().times(4),
            ],
        ),
        (
            Cloud::Azure,
            vec![Fault::error(500).times(10), Fault::garbage().times(5)],
        ),
    ] {
        eprintln!("faults: {cloud}");
        let tmp = tempfile::tempdir().unwrap();
        let t = Trainer::start(tmp.path()).await;
        let emu = emulator::start(EmulatorConfig::new(cloud)).await.unwrap();
        for f in faults {
            emu.fault(f).unwrap();
        }
        let (app, cancel) = start_agent(run_args(cloud.as_str(), &emu.base_url(), &t, &[])).await;
        let mut events = app.events;
        // The faults answered first: some failed poll counted.
        let errors = format!(
            "spotguard_metadata_errors_total{{source=\"{}\"",
            cloud.as_str()
        );
        wait_metrics(app.admin_addr, |m| counted(m, &errors)).await;
        emu.raise(EmulatedNotice::interruption()).unwrap();
        let results = wait_for(&mut events, Duration::from_secs(60), |e| match e {
            PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
            _ => None,
        })
        .await;
        assert_eq!(results[0].outcome.as_str(), "acked", "{cloud}");
        let m = metrics_text(app.admin_addr).await;
        assert!(
            counted(
                &m,
                &format!(
                    "spotguard_metadata_errors_total{{source=\"{}\"",
                    cloud.as_str()
                )
            ),
            "{cloud}: errors counted\n{m}"
        );
        assert!(!app.join.is_finished(), "the agent keeps running");
        cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_down_at_start_then_up() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    // Reserve a port, release it: nothing listens there at start.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let (app, cancel) = start_agent(run_args("aws", &endpoint, &t, &[])).await;
    let mut events = app.events;
    // A poll failed (nothing listens).
    wait_metrics(app.admin_addr, |m| {
        counted(m, "spotguard_metadata_errors_total{source=\"aws\"")
    })
    .await;
    let ready = reqwest::get(format!("http://{}/readyz", app.admin_addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "not ready while no poll succeeded");
    let mut cfg = EmulatorConfig::new(Cloud::Aws);
    cfg.listen = format!("127.0.0.1:{port}").parse().unwrap();
    let emu = emulator::start(cfg).await.unwrap();
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let results = wait_for(&mut events, Duration::from_secs(60), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(results[0].outcome.as_str(), "acked");
    let ready = reqwest::get(format!("http://{}/readyz", app.admin_addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let m = metrics_text(app.admin_addr).await;
    assert!(
        counted(&m, "spotguard_metadata_errors_total{source=\"aws\""),
        "{m}"
    );
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

/// Kill -9 the agent (a real `spotguard run` process) right after it signalled, restart it: it
/// resumes from the persisted phase and never signals again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_mid_plan_never_signals_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let admin = spotguard_testkit::free_port();
    let args = |t: &Trainer, metrics_addr: String| -> Vec<String> {
        vec![
            "run".into(),
            "--mode=host".into(),
            "--cloud=aws".into(),
            format!("--metadata-endpoint={}", emu.base_url()),
            "--poll-interval=200ms".into(),
            "--checkpoint-timeout=20s".into(),
            format!("--checkpoint-dir={}", t.dir.join("ckpt").display()),
            format!("--state-dir={}", t.dir.join("state").display()),
            format!("--checkpoint-pidfile={}", t.pidfile.display()),
            format!("--metrics-addr={metrics_addr}"),
            "--gpu=off".into(),
            "--log-format=json".into(),
        ]
    };
    let bin = env!("CARGO_BIN_EXE_spotguard");
    let mut first = tokio::process::Command::new(bin)
        .args(args(&t, "127.0.0.1:0".into()))
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    emu.raise(EmulatedNotice::interruption()).unwrap();
    // Wait until the signal has been seen by the trainer, then kill -9 the agent.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while t.signals_seen() == 0 {
        assert!(std::time::Instant::now() < deadline, "no signal");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.start_kill().unwrap();
    let _ = first.wait().await;
    let phase = persisted_phase(&t).expect("phase persisted before the kill");
    assert!(
        ["signalled", "checkpointed", "drained", "done"].contains(&phase.as_str()),
        "{phase}"
    );

    let admin_addr: std::net::SocketAddr = ([127, 0, 0, 1], admin).into();
    let mut second = tokio::process::Command::new(bin)
        .args(args(&t, admin_addr.to_string()))
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while persisted_phase(&t).as_deref() != Some("done") {
        assert!(
            std::time::Instant::now() < deadline,
            "restarted agent did not converge"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The restarted agent decided a re-poll after its plan was done is a duplicate.
    next_duplicates(admin_addr, "interruption", 2).await;
    assert_eq!(t.signals_seen(), 1, "a restarted agent never signals twice");
    unsafe { libc::kill(second.id().unwrap() as i32, libc::SIGTERM) };
    let status = tokio::time::timeout(Duration::from_secs(10), second.wait())
        .await
        .expect("agent exits on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

/// Whether some series starting with `prefix` has a value above 0 (every known series exists at 0
/// from start-up, so its presence alone proves nothing).
fn counted(metrics: &str, prefix: &str) -> bool {
    metrics.lines().any(|l| {
        l.starts_with(prefix)
            && l.rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
    })
}

// === AWS's own ec2-metadata-mock beside the project's emulator (issue 20 item 5) ===

/// The value of `series` (its name and labels as exported) in the text of `/metrics`; 0 when
/// absent.
fn read(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// The agent's `/metrics` at `addr`, `None` while it does not answer.
async fn try_metrics(addr: std::net::SocketAddr) -> Option<String> {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()
}

/// Wait (up to 60 s, reading `/metrics` every 20 ms) until the agent's metrics satisfy `done`;
/// returns them.
async fn wait_metrics(addr: std::net::SocketAddr, done: impl Fn(&str) -> bool) -> String {
    let end = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(m) = try_metrics(addr).await.filter(|m| done(m)) {
            return m;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the agent's metrics at {addr} never got there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The store's `duplicate` decisions about notices of `kind`.
fn duplicates(kind: &str) -> String {
    format!("spotguard_notice_decisions_total{{kind=\"{kind}\",decision=\"duplicate\"}}")
}

/// Wait until the store has decided `n` more notices of `kind` to be duplicates than when
/// called: that many re-polls after this point were considered and started nothing.
async fn next_duplicates(addr: std::net::SocketAddr, kind: &str, n: u32) {
    let series = duplicates(kind);
    let now = read(&wait_metrics(addr, |_| true).await, &series);
    wait_metrics(addr, |m| read(m, &series) >= now + f64::from(n)).await;
}

/// Plan events until `last` picks one (included), for at most `limit`; panics on timeout.
async fn collect_until(
    events: &mut tokio::sync::broadcast::Receiver<PlanEvent>,
    limit: Duration,
    last: impl Fn(&PlanEvent) -> bool,
) -> Vec<PlanEvent> {
    let mut out = Vec::new();
    let found = tokio::time::timeout(limit, async {
        loop {
            match events.recv().await {
                Ok(e) => {
                    let end = last(&e);
                    out.push(e);
                    if end {
                        return true;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => return false,
            }
        }
    })
    .await;
    assert_eq!(
        found,
        Ok(true),
        "the awaited plan event never came: {out:#?}"
    );
    out
}

/// The plan events sent so far and not yet read, without waiting.
fn pending(events: &mut tokio::sync::broadcast::Receiver<PlanEvent>) -> Vec<PlanEvent> {
    let mut out = Vec::new();
    loop {
        match events.try_recv() {
            Ok(e) => out.push(e),
            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {}
            Err(_) => return out,
        }
    }
}

/// Plan events until the plan of a notice of `kind` is done, then until the store has decided
/// two more notices of `kind` to be duplicates (two polls after it: every answer of the poll
/// before them handled), and every event sent by then.
async fn until_done_and_repolled(
    admin: std::net::SocketAddr,
    events: &mut tokio::sync::broadcast::Receiver<PlanEvent>,
    kind: &str,
) -> Vec<PlanEvent> {
    let mut seen = collect_until(events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. })
    })
    .await;
    while !done_of(&seen, kind) {
        seen.extend(
            collect_until(events, Duration::from_secs(60), |e| {
                matches!(e, PlanEvent::Done { .. })
            })
            .await,
        );
    }
    next_duplicates(admin, kind, 2).await;
    seen.extend(pending(events));
    seen
}

/// Whether `events` hold the `Done` of a plan for a notice of `kind`.
fn done_of(events: &[PlanEvent], kind: &str) -> bool {
    events.iter().any(|e| match e {
        PlanEvent::Done { id, .. } => events.iter().any(|s| {
            matches!(s, PlanEvent::NoticeSeen { notice, .. } if notice.id == *id && notice.kind.label() == kind)
        }),
        _ => false,
    })
}

/// The kinds of the notices accepted (plans started or scheduled), once per notice id, in order.
fn plans_started(events: &[PlanEvent]) -> Vec<&'static str> {
    let mut ids = Vec::new();
    let mut kinds = Vec::new();
    for e in events {
        if let PlanEvent::NoticeSeen { notice, .. } = e {
            if !ids.contains(&notice.id) {
                ids.push(notice.id.clone());
                kinds.push(notice.kind.label());
            }
        }
    }
    kinds
}

fn checkpoints(events: &[PlanEvent]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, PlanEvent::Checkpointed { .. }))
        .count()
}

async fn mock(args: &[&str]) -> spotguard_testkit::ec2_mock::Ec2MetadataMock {
    let m = spotguard_testkit::ec2_mock::Ec2MetadataMock::start(args)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // IMDSv2 only: a request without a session token is refused.
    let v1 = reqwest::get(format!("{}/latest/meta-data/instance-id", m.base_url()))
        .await
        .unwrap()
        .status();
    assert_eq!(v1.as_u16(), 401, "-I: IMDSv2 only");
    m
}

/// One rebalance recommendation (served from start-up, its `noticeTime` re-stamped on every
/// poll) and then a spot interruption (its `time` re-stamped too): exactly two checkpoints, one
/// early for the rebalance and one for the interruption, and nothing new after the interruption.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_metadata_mock_one_rebalance_and_an_interruption_checkpoint_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let m = mock(&["spot", "-I", "-d", "4"]).await;
    eprintln!("AWS ec2-metadata-mock {}", m.version());
    let (app, cancel) = start_agent(run_args("aws", &m.base_url(), &t, &[])).await;
    let mut events = app.events;
    let seen = until_done_and_repolled(app.admin_addr, &mut events, "interruption").await;
    assert_eq!(
        plans_started(&seen),
        vec!["rebalance", "interruption"],
        "one plan per notice: {seen:#?}"
    );
    assert_eq!(checkpoints(&seen), 2, "{seen:#?}");
    assert_eq!(t.signals_seen(), 2, "one rebalance, one interruption");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

/// Spot interruption notices of every action, IMDSv2 only: each is one plan and one signal,
/// however often the mock re-stamps its `time`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_metadata_mock_spot_terminate_stop_hibernate_signal_once() {
    for action in ["terminate", "stop", "hibernate"] {
        let tmp = tempfile::tempdir().unwrap();
        let t = Trainer::start(tmp.path()).await;
        // No rebalance recommendation during the test.
        let m = mock(&[
            "spot",
            "-I",
            "-a",
            action,
            "--rebalance-delay-sec",
            "100000",
        ])
        .await;
        let (app, cancel) = start_agent(run_args("aws", &m.base_url(), &t, &[])).await;
        let mut events = app.events;
        let seen = until_done_and_repolled(app.admin_addr, &mut events, "interruption").await;
        assert_eq!(plans_started(&seen), vec!["interruption"], "{action}");
        assert!(
            seen.iter().any(|e| matches!(e, PlanEvent::Done { .. })),
            "{action}: the plan completes"
        );
        assert_eq!(t.signals_seen(), 1, "{action}: one signal");
        cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    }
}

/// A scheduled event (system-reboot, NotBefore at the mock's start) with the drain policy:
/// one maintenance plan, one signal, its id the mock's event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_metadata_mock_scheduled_event_is_one_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let m = mock(&["events", "-I", "-o", "system-reboot"]).await;
    let (app, cancel) = start_agent(run_args(
        "aws",
        &m.base_url(),
        &t,
        &["--on-maintenance=drain"],
    ))
    .await;
    let mut events = app.events;
    let seen = until_done_and_repolled(app.admin_addr, &mut events, "maintenance").await;
    assert_eq!(plans_started(&seen), vec!["maintenance"], "{seen:#?}");
    let id = seen
        .iter()
        .find_map(|e| match e {
            PlanEvent::NoticeSeen { notice, .. } => Some(notice.id.clone()),
            _ => None,
        })
        .unwrap();
    assert!(id.starts_with("instance-event-"), "{id}");
    assert_eq!(t.signals_seen(), 1);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}

/// The project's emulator re-stamping its answers as ec2-metadata-mock does: the same outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emulator_with_restamped_times_one_rebalance_and_an_interruption_checkpoint_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let t = Trainer::start(tmp.path()).await;
    let mut cfg = EmulatorConfig::new(Cloud::Aws);
    cfg.ec2_restamp_times = true;
    let emu = emulator::start(cfg).await.unwrap();
    let (app, cancel) = start_agent(run_args("aws", &emu.base_url(), &t, &[])).await;
    let mut events = app.events;
    emu.raise(EmulatedNotice::rebalance()).unwrap();
    // Until the rebalance's early checkpoint, and two re-stamped recommendations after it.
    let mut first = collect_until(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Checkpointed { .. })
    })
    .await;
    next_duplicates(app.admin_addr, "rebalance", 2).await;
    first.extend(pending(&mut events));
    assert_eq!(plans_started(&first), vec!["rebalance"], "{first:#?}");
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let then = until_done_and_repolled(app.admin_addr, &mut events, "interruption").await;
    assert_eq!(plans_started(&then), vec!["interruption"], "{then:#?}");
    assert_eq!(checkpoints(&first) + checkpoints(&then), 2);
    assert_eq!(t.signals_seen(), 2);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
}
