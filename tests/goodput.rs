//! Goodput measured by the agent (docs/goodput.md): a host-mode plan against a real Python
//! trainer that uses the checkout's helper, the badput record in the goodput log and the metrics,
//! and `spotguard goodput` over that log. The trainers write their own ground truth (the step
//! they stopped at, when they trained it, their last durable step and when), which the agent's
//! figures are checked against.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard::goodput::record::Interruption;
use spotguard::responder::PlanEvent;

fn helper_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python")
}

/// Train ~2 ms steps; save (durably) at step 50; at the notice write the ground truth, then
/// either ack `done` at the step reached and exit (`ACK=1`) or start a save that never ends (a
/// slow save: the test powers it off).
const TRAINER: &str = r#"
import json, os, sys, time
import spotguard
d = os.environ["SPOTGUARD_DIR"]
spotguard.install()
spotguard.resumed(0)
step, saved_ts = 0, None
def truth(**kw):
    with open(os.path.join(d, "truth.tmp"), "w") as f:
        json.dump(kw, f)
    os.rename(os.path.join(d, "truth.tmp"), os.path.join(d, "truth.json"))
while True:
    step += 1
    time.sleep(0.002)
    trained_at = time.time()
    if step == 50:
        spotguard.saved(50, "/ckpt/step-50")
        saved_ts = time.time()
    if step == 60:
        open(os.environ["READY"], "w").close()
    if spotguard.should_checkpoint(step=step):
        signalled = spotguard.received_at()
        truth(step=step, trained_at=trained_at, saved_step=50, saved_ts=saved_ts, received_at=signalled)
        if os.environ.get("ACK") == "1":
            spotguard.ack("done", step=step, checkpoint=f"/ckpt/step-{step}")
            sys.exit(0)
        time.sleep(3600)
"#;

struct Run {
    dir: tempfile::TempDir,
    trainer: tokio::process::Child,
}

async fn start_trainer(ack: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let trainer = tokio::process::Command::new("python3")
        .arg("-c")
        .arg(TRAINER)
        .env("PYTHONPATH", helper_dir())
        .env("SPOTGUARD_DIR", &ckpt)
        .env("READY", dir.path().join("ready"))
        .env("ACK", if ack { "1" } else { "0" })
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    std::fs::write(
        dir.path().join("trainer.pid"),
        trainer.id().unwrap().to_string(),
    )
    .unwrap();
    let ready = dir.path().join("ready");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the trainer never got ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Run { dir, trainer }
}

/// An in-process host-mode agent over `dir` (its checkpoint dir, state dir and trainer pidfile),
/// named `node` when given.
async fn agent(
    dir: &Path,
    emu: &emulator::EmulatorHandle,
    node: Option<&str>,
) -> (spotguard::app::App, tokio_util::sync::CancellationToken) {
    let pidfile = format!("--checkpoint-pidfile={}", dir.join("trainer.pid").display());
    agent_selecting(dir, emu, node, &pidfile).await
}

/// [`agent`] with the trainer selector `selector` (`--checkpoint-pidfile=…`,
/// `--checkpoint-cmdline=…`).
async fn agent_selecting(
    dir: &Path,
    emu: &emulator::EmulatorHandle,
    node: Option<&str>,
    selector: &str,
) -> (spotguard::app::App, tokio_util::sync::CancellationToken) {
    let mut argv: Vec<String> = vec![
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=60s".into(),
        format!("--checkpoint-dir={}", dir.join("ckpt").display()),
        format!("--state-dir={}", dir.join("state").display()),
        selector.into(),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-level=warn".into(),
        "--shutdown-grace=2s".into(),
    ];
    if let Some(node) = node {
        argv.push(format!("--node-name={node}"));
    }
    let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
    let cfg = spotguard::config::Config::resolve(args, &spotguard::config::ProcessEnv).unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let app = spotguard::app::start(cfg, cancel.clone()).await.unwrap();
    (app, cancel)
}

fn read_json(path: &Path) -> Option<serde_json::Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The goodput log's one line, once the outcome follower wrote it.
async fn logged(dir: &Path) -> Interruption {
    let path = dir.join("state").join(spotguard::goodput::report::LOG_FILE);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((all, 0)) = spotguard::goodput::report::load(&path) {
            if let [one] = all.as_slice() {
                return one.clone();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no goodput log line in {}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} not in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_that_acks_costs_its_save_and_throws_nothing_away() {
    let mut run = start_trainer(true).await;
    let dir = run.dir.path().to_path_buf();
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let (app, cancel) = agent(&dir, &emu, None).await;
    let mut events = app.events;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let signalled =
        spotguard_testkit::wait_for_event(&mut events, Duration::from_secs(30), |e| match e {
            PlanEvent::Signalled { at, .. } => Some(*at),
            _ => None,
        })
        .await;
    spotguard_testkit::wait_for_event(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    let i = logged(&dir).await;
    let truth = read_json(&dir.join("ckpt/truth.json")).expect("the trainer's ground truth");
    let [t] = i.targets.as_slice() else {
        panic!("one target expected: {i:?}")
    };
    assert_eq!(t.outcome, "acked");
    assert_eq!(t.step, truth["step"].as_u64(), "{t:?} vs {truth}");
    assert_eq!((t.wasted_steps, t.wasted_seconds), (Some(0), Some(0.0)));
    // The save: signal → the ack the agent saw, at least the trainer's own signal → ack.
    let save = t.save_seconds.expect("a save time");
    let own = truth["received_at"].as_f64().unwrap() - signalled.as_millisecond() as f64 / 1000.0;
    assert!(
        save >= own.max(0.0) - 0.01 && save < 30.0,
        "save {save}, trainer saw the signal after {own}"
    );
    assert_eq!(i.signalled_at, Some(signalled));

    let m = spotguard_testkit::metrics_text(app.admin_addr).await;
    let booked = metric(
        &m,
        "spotguard_badput_seconds_total{category=\"checkpoint_save\"}",
    );
    assert!((booked - save).abs() < 1e-6, "{booked} vs {save}");
    assert_eq!(metric(&m, "spotguard_badput_steps_lost_total"), 0.0);

    // `spotguard goodput` over the log.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["goodput", "--json", "--state-dir"])
        .arg(dir.join("state"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["totals"]["interruptions"], 1);
    assert_eq!(report["totals"]["badput_seconds"][0][0], "checkpoint_save");
    assert!((report["totals"]["badput_seconds"][0][1].as_f64().unwrap() - save).abs() < 1e-6);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;
    let _ = run.trainer.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_powered_off_before_acking_reports_what_it_threw_away() {
    let mut run = start_trainer(false).await;
    let dir = run.dir.path().to_path_buf();
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let (app, cancel) = agent(&dir, &emu, None).await;
    let mut events = app.events;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    // The trainer saw the signal and started its (endless) save: power it off.
    let truth_path = dir.join("ckpt/truth.json");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let truth = loop {
        if let Some(t) = read_json(&truth_path) {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the trainer never saw the signal"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    run.trainer.start_kill().unwrap();
    let _ = run.trainer.wait().await;
    spotguard_testkit::wait_for_event(&mut events, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    let i = logged(&dir).await;
    let [t] = i.targets.as_slice() else {
        panic!("one target expected: {i:?}")
    };
    assert_eq!(t.outcome, "exited");
    let stopped = truth["step"].as_u64().unwrap();
    assert_eq!(t.durable_step, Some(50));
    // Exact: after the signal the helper writes every new step.
    assert_eq!(t.wasted_steps, Some(stopped - 50), "{t:?} vs {truth}");
    // Seconds: the trainer's own clock, durable save → its last step (the helper's timestamps
    // are taken a few statements apart from the trainer's: 50 ms covers a loaded machine).
    let own = truth["trained_at"].as_f64().unwrap() - truth["saved_ts"].as_f64().unwrap();
    let wasted = t.wasted_seconds.unwrap();
    assert!(
        (wasted - own).abs() < 0.05,
        "wasted {wasted} s vs the trainer's {own} s"
    );
    assert_eq!(t.save_seconds, None);
    assert!(t.downtime_seconds.unwrap() > 0.0);

    let m = spotguard_testkit::metrics_text(app.admin_addr).await;
    assert_eq!(
        metric(&m, "spotguard_badput_steps_lost_total"),
        (stopped - 50) as f64
    );
    let booked = metric(
        &m,
        "spotguard_badput_seconds_total{category=\"wasted_progress\"}",
    );
    assert!((booked - wasted).abs() < 1e-6);
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;
}

#[test]
fn the_operators_guides_goodput_recording_rules_pass_promtool() {
    let guide = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operators-guide.md"),
    )
    .unwrap();
    let (_, section) = guide.split_once("### Goodput").expect("no Goodput section");
    let (_, block) = section.split_once("```yaml\n").expect("no rule file");
    let (rules, _) = block.split_once("```").unwrap();
    assert!(rules.contains("spotguard_badput_seconds_total"));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("goodput-rules.yaml");
    std::fs::write(&path, rules).unwrap();
    let out = spotguard_testkit::prometheus::promtool(&["check", "rules", path.to_str().unwrap()]);
    assert!(out.contains("SUCCESS: 3 rules found"), "{out}");
}

/// Machine A's trainer: trains until the notice, saves a directory checkpoint into the shared
/// checkpoint storage (`$STORE`), acks `done` with its path and exits, leaving its own ground
/// truth (the step, and the wall clock just before and just after its ack).
const INTERRUPTED: &str = r#"
import json, os, time
import spotguard
d, store = os.environ["SPOTGUARD_DIR"], os.environ["STORE"]
spotguard.install()
spotguard.resumed(0)
step = 0
while True:
    step += 1
    time.sleep(0.002)
    if step == 20:
        open(os.environ["READY"], "w").close()
    if spotguard.should_checkpoint(step=step):
        path = os.path.join(store, f"step-{step}")
        os.makedirs(path)
        with open(os.path.join(path, "model.pt"), "w") as f:
            f.write(json.dumps({"step": step}))
        before = time.time()
        spotguard.ack("done", step=step, checkpoint=path)
        after = time.time()
        with open(os.path.join(store, "truth-a.tmp"), "w") as f:
            json.dump({"step": step, "path": path, "ack_before": before, "ack_after": after}, f)
        os.rename(os.path.join(store, "truth-a.tmp"), os.path.join(store, "truth-a.json"))
        spotguard.exit_after_checkpoint()
"#;

/// Machine B's trainer: loads the checkpoint `$CKPT` (timing the load), resumes from it with
/// `resumed(step, checkpoint=…, restore_seconds=…)` and trains on; its ground truth is the wall
/// clock around its first step's `should_checkpoint()` and the restore time it measured.
const RESUMING: &str = r#"
import json, os, time
import spotguard
d, ckpt = os.environ["SPOTGUARD_DIR"], os.environ["CKPT"]
spotguard.install()
t0 = time.monotonic()
with open(os.path.join(ckpt, "model.pt")) as f:
    step = json.load(f)["step"]
time.sleep(0.3)  # a restore that takes a while
restore = time.monotonic() - t0
spotguard.resumed(step, checkpoint=ckpt, restore_seconds=restore)
first = True
while True:
    step += 1
    time.sleep(0.002)
    before = time.time()
    spotguard.should_checkpoint(step=step)
    if first:
        first = False
        after = time.time()
        with open(os.path.join(d, "truth-b.tmp"), "w") as f:
            json.dump({"step": step, "first_before": before, "first_after": after, "restore": restore}, f)
        os.rename(os.path.join(d, "truth-b.tmp"), os.path.join(d, "truth-b.json"))
"#;

/// The agents' log lines (JSON), for the one test that reads them: the in-process agent logs
/// through the global subscriber.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

impl Captured {
    fn install() -> Captured {
        let c = Captured::default();
        tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "warn,spotguard::goodput=info",
            ))
            .with_writer(c.clone())
            .try_init()
            .expect("the only global subscriber of this test binary");
        c
    }

    /// The log lines with message `message`.
    fn lines(&self, message: &str) -> Vec<serde_json::Value> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["message"] == message)
            .collect()
    }
}

/// The trainers run as this uid, as trainers do on a node.
const TRAINER_UID: u32 = 1000;
/// Another local user.
const OTHER_UID: u32 = 1001;
/// The last argument of every trainer's command line, which the agents select on.
const JOB_ARG: &str = "sgtrain-x";

/// Another local user's processes, matching the agent's `--checkpoint-cmdline` (in host mode any
/// user's are targets): four of them, each rewriting its resume record every 50 ms with a fresh
/// invented notice id, a save in 2001 and a restore of 9 999 999 s; the first uses the real
/// notice id `$REAL` (world-readable in `notice.json`) instead, with the same save from 2001.
const FORGER: &str = r#"
import json, os, time
d, real = os.environ["SPOTGUARD_DIR"], os.environ["REAL"]
first = True
for _ in range(3):
    if os.fork() == 0:
        first = False
        break
n = 0
while True:
    n += 1
    now = time.time()
    notice = real if first else f"forged-{os.getpid()}-{n}"
    rec = {"step": 120, "ts": now, "rank": 0, "world_size": 1, "last_step": 120, "last_ts": now,
           "interruption": {"notice_id": notice, "node": "machine-a", "kind": "interruption",
                            "source": "aws", "step": 120, "saved_ts": 1000000001.0},
           "restore_seconds": 9999999, "first_step_ts": now}
    tmp = os.path.join(d, f".resume-{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.rename(tmp, os.path.join(d, f"resume-{os.getpid()}.json"))
    time.sleep(0.05)
"#;

/// One machine: its checkpoint dir (`ckpt`), state dir, pidfile, and metadata emulator.
struct Machine {
    base: PathBuf,
    name: &'static str,
}

impl Machine {
    fn new(root: &Path, name: &'static str) -> Machine {
        let base = root.join(name);
        let ckpt = base.join("ckpt");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&ckpt, std::fs::Permissions::from_mode(0o1777)).unwrap();
        Machine { base, name }
    }

    /// A trainer running `script` as `uid`, its command line ending in [`JOB_ARG`] (what the
    /// agents select).
    fn trainer_as(
        &self,
        uid: u32,
        script: &str,
        env: &[(&str, &Path)],
    ) -> spotguard_testkit::process::Kid {
        let mut cmd = std::process::Command::new("python3");
        cmd.arg("-c")
            .arg(script)
            .arg(JOB_ARG)
            .env("PYTHONPATH", helper_dir())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("SPOTGUARD_DIR", self.base.join("ckpt"))
            .stdout(std::process::Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        spotguard_testkit::process::as_user(&mut cmd, uid);
        spotguard_testkit::process::Kid::spawn(cmd)
    }

    fn trainer(&self, script: &str, env: &[(&str, &Path)]) -> spotguard_testkit::process::Kid {
        self.trainer_as(TRAINER_UID, script, env)
    }

    /// This machine's agent, selecting every process whose command line has [`JOB_ARG`]: in
    /// host mode any local user's.
    async fn agent(
        &self,
        emu: &emulator::EmulatorHandle,
    ) -> (spotguard::app::App, tokio_util::sync::CancellationToken) {
        agent_selecting(
            &self.base,
            emu,
            Some(self.name),
            &format!("--checkpoint-cmdline={JOB_ARG}"),
        )
        .await
    }
}

fn recoveries(log: &Path) -> Vec<spotguard::goodput::event::Recovery> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            match serde_json::from_str::<spotguard::goodput::event::LogLine>(l).ok()? {
                spotguard::goodput::event::LogLine::Recovery { recovery } => Some(recovery),
                _ => None,
            }
        })
        .collect()
}

/// A metric's value, or `None` while the series is not there.
fn metric_opt(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The job is interrupted on a host, the host comes back (a spot VM stopped and restarted on its
/// own disk: a new agent over the same state dir), and the job resumes there. Meanwhile another
/// local user's processes, matching the agent's selector, write resume records naming invented
/// notices and the real one with a forged save: none of them is reported, none reaches the
/// goodput log, the report or the metrics; the real recovery is reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_resumed_on_its_host_reports_its_recovery_once_and_forged_ones_never() {
    let logs = Captured::install();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // The checkpoint storage (a shared filesystem).
    let store = tmp.path().join("storage");
    std::fs::create_dir(&store).unwrap();
    std::fs::set_permissions(&store, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let a = Machine::new(tmp.path(), "machine-a");

    // The trainer is interrupted, saves into the storage and acks `done`.
    let ready = store.join("ready-a");
    let _trainer_a = a.trainer(INTERRUPTED, &[("STORE", &store), ("READY", &ready)]);
    spotguard_testkit::wait::until("trainer A to train", Duration::from_secs(60), || {
        std::future::ready(ready.exists().then_some(()))
    })
    .await;
    let emu_a = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let (app_a, cancel_a) = a.agent(&emu_a).await;
    let mut events_a = app_a.events;
    emu_a.raise(EmulatedNotice::interruption()).unwrap();
    spotguard_testkit::wait_for_event(&mut events_a, Duration::from_secs(60), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;
    let truth_a =
        spotguard_testkit::wait::until("trainer A's ground truth", Duration::from_secs(30), || {
            std::future::ready(read_json(&store.join("truth-a.json")))
        })
        .await;
    let interrupted = logged(&a.base).await;
    assert_eq!(interrupted.targets[0].outcome, "acked");
    let ckpt = PathBuf::from(truth_a["path"].as_str().unwrap());
    cancel_a.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app_a.join).await;
    emu_a.shutdown().await;

    // The host is back: a new agent on the same state dir; no notice now.
    let emu_b = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let (app_b, cancel_b) = a.agent(&emu_b).await;
    let log = a
        .base
        .join("state")
        .join(spotguard::goodput::report::LOG_FILE);
    let log_before = std::fs::read(&log).unwrap();

    // The other user's processes, before the job resumes: refused (counted once per reason).
    let real = PathBuf::from(&interrupted.notice_id);
    let forger = a.trainer_as(OTHER_UID, FORGER, &[("REAL", &real)]);
    let refused =
        |reason: &str| format!("spotguard_errors_total{{module=\"goodput\",error=\"{reason}\"}}");
    spotguard_testkit::wait::until("both refusals counted", Duration::from_secs(60), || async {
        let m = spotguard_testkit::metrics_text(app_b.admin_addr).await;
        (metric_opt(&m, &refused("recovery_not_recorded")).is_some()
            && metric_opt(&m, &refused("recovery_inconsistent")).is_some())
        .then_some(())
    })
    .await;
    assert_eq!(std::fs::read(&log).unwrap(), log_before, "nothing written");

    // The job resumes on this host.
    let _trainer_b = a.trainer(RESUMING, &[("CKPT", &ckpt)]);
    let got = spotguard_testkit::wait::until("the recovery line", Duration::from_secs(60), || {
        std::future::ready(recoveries(&log).into_iter().next())
    })
    .await;
    let truth_b = read_json(&a.base.join("ckpt/truth-b.json")).expect("trainer B's ground truth");
    // Several more passes with the forgers still writing.
    let m = spotguard_testkit::metrics_text(app_b.admin_addr).await;
    let refusals = metric(&m, &refused("recovery_not_recorded"));
    drop(forger);

    assert_eq!(got.notice_id, interrupted.notice_id);
    assert_eq!(got.from_node.as_deref(), Some("machine-a"));
    assert_eq!(got.node, "machine-a");
    assert_eq!(got.target, format!("cmdline:{JOB_ARG}"));
    assert_eq!(Some(got.step), truth_a["step"].as_u64());
    // recovery_seconds = B's first step − A's save, each bracketed by the trainers' own clocks:
    // A's save lies between the wall clock just before and just after its ack, B's first step
    // between the wall clock just before and after its first should_checkpoint(). The tolerance
    // is those brackets (milliseconds), nothing more.
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap();
    let lo = f(&truth_b, "first_before") - f(&truth_a, "ack_after");
    let hi = f(&truth_b, "first_after") - f(&truth_a, "ack_before");
    assert!(
        lo - 1e-3 <= got.recovery_seconds && got.recovery_seconds <= hi + 1e-3,
        "recovery {} s outside the trainers' own [{lo}, {hi}]",
        got.recovery_seconds
    );
    let restore = f(&truth_b, "restore");
    eprintln!(
        "recovery {:.3} s (trainers' own bracket [{lo:.3}, {hi:.3}]), restore {restore:.3} s",
        got.recovery_seconds
    );
    assert_eq!(got.restore_seconds, Some(restore));
    assert!(restore >= 0.3);

    // The metrics: the real recovery once; the forged ones counted once per reason, not per
    // record or pass.
    let m = spotguard_testkit::metrics_text(app_b.admin_addr).await;
    assert_eq!(metric(&m, "spotguard_recoveries_total"), 1.0);
    let infra = metric(
        &m,
        "spotguard_badput_seconds_total{category=\"infrastructure_recovery\"}",
    );
    assert!(
        (infra - (got.recovery_seconds - restore)).abs() < 1e-6,
        "{infra}"
    );
    let booked = metric(
        &m,
        "spotguard_badput_seconds_total{category=\"checkpoint_restore\"}",
    );
    assert!((booked - restore).abs() < 1e-6, "{booked} vs {restore}");
    assert_eq!(refusals, 1.0);
    assert_eq!(metric(&m, &refused("recovery_not_recorded")), 1.0);
    assert_eq!(metric(&m, &refused("recovery_inconsistent")), 1.0);

    // The log: the interruption and the one recovery; the report over it shows only them.
    assert_eq!(recoveries(&log).len(), 1);
    let all = spotguard::goodput::report::load_all(&log).unwrap();
    assert_eq!((all.interruptions.len(), all.recoveries.len()), (1, 1));
    let report = spotguard::goodput::report::compute(all, None, None, jiff::Timestamp::now());
    assert_eq!(
        (report.totals.interruptions, report.totals.recoveries),
        (1, 1)
    );
    assert_eq!(report.interruptions[0].notice_id, interrupted.notice_id);
    // The default window starts at what the report shows: the interruption.
    assert_eq!(report.totals.since, report.interruptions[0].at);

    // The log lines: one recovery; the refusals once each, naming the target group.
    let line =
        spotguard_testkit::wait::until("the recovery's log line", Duration::from_secs(10), || {
            std::future::ready(logs.lines("interruption recovered").into_iter().next())
        })
        .await;
    assert_eq!(line["notice_id"], interrupted.notice_id.as_str());
    assert_eq!(line["from_node"], "machine-a");
    assert_eq!(line["target_group"], format!("cmdline:{JOB_ARG}"));
    assert_eq!(
        line["recovery_seconds"].as_f64(),
        Some(got.recovery_seconds)
    );
    assert_eq!(line["restore_seconds"].as_f64(), Some(restore));
    assert_eq!(logs.lines("interruption recovered").len(), 1);
    assert_eq!(
        logs.lines("ignoring a recovery that no recorded interruption backs")
            .len(),
        2
    );

    cancel_b.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app_b.join).await;
    emu_b.shutdown().await;
}
