//! `spotguard drill`: rehearse a preemption on this machine, no cloud needed.
//!
//! Runs the training command as a child (with `SPOTGUARD_DIR` set), starts the embedded metadata
//! emulator on loopback, raises an interruption after `--after`, and drives the real `run`
//! pipeline (host mode) against the child. Prints a verdict table; exit 0 on PASS.
//! With no command it runs the bundled example trainer (`spotguard example-trainer`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::Duration;

use clap::{Args, ValueEnum};
use jiff::Timestamp;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::app;
use crate::checkpoint::run::GroupResult;
use crate::checkpoint::Outcome;
use crate::config::{self, Config, ModeChoice};
use crate::emulator;
use crate::notice::store;
use crate::responder::PlanEvent;

/// Which cloud's interruption to rehearse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DrillCloud {
    /// EC2 spot instance-action: 2 minutes' notice.
    Aws,
    /// GCE preemption: 30 s from `preempted=TRUE` to power-off.
    Gce,
    /// Azure Scheduled Events Preempt: NotBefore 30 s ahead.
    Azure,
}

/// `spotguard drill` arguments.
#[derive(Debug, Clone, Args)]
pub struct DrillArgs {
    /// Cloud whose interruption is rehearsed (sets the notice's deadline and the budget).
    #[arg(long, value_enum, default_value = "aws")]
    pub cloud: DrillCloud,
    /// Raise the interruption this long after the command started.
    #[arg(long, default_value = "5s", value_parser = config::parse_duration)]
    pub after: Duration,
    /// Checkpoint directory given to the command as SPOTGUARD_DIR [default: a fresh temp dir].
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,
    /// Upper bound on waiting for the acknowledgement (--checkpoint-timeout of `run`).
    #[arg(long, default_value = "90s", value_parser = config::parse_positive_duration)]
    pub timeout: Duration,
    /// Log level of the agent pipeline while the drill runs (e.g. `info` to watch every step).
    #[arg(long, default_value = "error")]
    pub log_level: String,
    /// The training command and its arguments (after `--`). Default: the bundled example trainer.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// The bundled example trainer's arguments.
#[derive(Debug, Clone, Args)]
pub struct ExampleTrainerArgs {
    /// Time per simulated training step.
    #[arg(long, default_value = "100ms", value_parser = config::parse_duration)]
    pub step_time: Duration,
    /// Simulated time to write a checkpoint.
    #[arg(long, default_value = "300ms", value_parser = config::parse_duration)]
    pub save_time: Duration,
    /// Stop after this many steps (0 = run until signalled).
    #[arg(long, default_value_t = 0)]
    pub max_steps: u64,
}

/// Result of a drill.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub pass: bool,
    pub raised_at: Timestamp,
    pub seen_at: Option<Timestamp>,
    pub signalled_at: Option<Timestamp>,
    pub processes: usize,
    pub checkpoint_deadline: Option<Timestamp>,
    pub deadline: Option<Timestamp>,
    pub acked_at: Option<Timestamp>,
    pub results: Vec<GroupResult>,
    pub ack: Option<serde_json::Value>,
    pub child_exit: Option<i32>,
    pub reason: String,
}

/// Run the drill; returns the process exit code.
pub async fn run(args: DrillArgs, cancel: CancellationToken) -> i32 {
    crate::telemetry::init(config::LogFormat::Text, &args.log_level);
    match drill(&args, cancel).await {
        Ok(v) => {
            print_verdict(&args, &v);
            if v.pass {
                0
            } else {
                1
            }
        }
        Err(e) => {
            eprintln!("spotguard drill: {e}");
            2
        }
    }
}

async fn drill(args: &DrillArgs, cancel: CancellationToken) -> Result<Verdict, String> {
    let work = tempfile::Builder::new()
        .prefix("spotguard-drill-")
        .tempdir()
        .map_err(|e| format!("creating a temp dir: {e}"))?;
    let ckpt_dir = match &args.checkpoint_dir {
        Some(d) => std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?,
        None => work.path().join("checkpoint"),
    };
    std::fs::create_dir_all(&ckpt_dir)
        .map_err(|e| format!("creating {}: {e}", ckpt_dir.display()))?;
    let state_dir = work.path().join("state");
    let pidfile = work.path().join("trainer.pid");

    // 1. The emulator.
    let cloud = match args.cloud {
        DrillCloud::Aws => emulator::Cloud::Aws,
        DrillCloud::Gce => emulator::Cloud::Gce,
        DrillCloud::Azure => emulator::Cloud::Azure,
    };
    let emu = emulator::start(emulator::EmulatorConfig::new(cloud))
        .await
        .map_err(|e| format!("starting the metadata emulator: {e}"))?;

    // 2. The child.
    let (program, child_args): (PathBuf, Vec<String>) = if args.command.is_empty() {
        let me = std::env::current_exe().map_err(|e| format!("locating spotguard: {e}"))?;
        (me, vec!["example-trainer".into()])
    } else {
        (PathBuf::from(&args.command[0]), args.command[1..].to_vec())
    };
    let shown = if args.command.is_empty() {
        "spotguard example-trainer (bundled)".to_string()
    } else {
        args.command.join(" ")
    };
    println!(
        "spotguard drill: {} interruption in {} against `{shown}`",
        cloud_name(args.cloud),
        humantime::format_duration(args.after)
    );
    println!("  SPOTGUARD_DIR={}", ckpt_dir.display());
    let _ = std::io::stdout().flush();
    let mut child = Command::new(&program)
        .args(&child_args)
        .env("SPOTGUARD_DIR", &ckpt_dir)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", program.display()))?;
    let pid = child
        .id()
        .ok_or_else(|| "the command exited at once".to_string())?;
    std::fs::write(&pidfile, format!("{pid}\n")).map_err(|e| format!("writing pidfile: {e}"))?;

    // 3. The real pipeline, host mode, against the emulator.
    let run_args = drill_run_args(args, &emu.base_url(), &ckpt_dir, &state_dir, &pidfile)?;
    let cfg = Config::resolve(run_args, &config::ProcessEnv).map_err(|e| e.to_string())?;
    let pipeline_cancel = cancel.child_token();
    let app = app::start(cfg, pipeline_cancel.clone())
        .await
        .map_err(|e| format!("starting the pipeline: {e}"))?;
    let mut events = app.events;

    // 4. Raise the interruption after --after (unless the child dies first).
    tokio::select! {
        _ = tokio::time::sleep(args.after) => {}
        status = child.wait() => {
            pipeline_cancel.cancel();
            emu.shutdown().await;
            return Err(format!("the command exited before the interruption ({})", status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string())));
        }
        _ = cancel.cancelled() => return Err("interrupted".into()),
    }
    let raised_at = emu
        .raise(emulator::EmulatedNotice::interruption())
        .map_err(|e| format!("raising the notice in the emulator: {e}"))?
        .visible_at;
    let mut v = Verdict {
        pass: false,
        raised_at,
        seen_at: None,
        signalled_at: None,
        processes: 0,
        checkpoint_deadline: None,
        deadline: None,
        acked_at: None,
        results: Vec::new(),
        ack: None,
        child_exit: None,
        reason: String::new(),
    };

    // 5. Follow the plan until the checkpoint step is over.
    let limit = args.timeout + default_lead(args.cloud) + Duration::from_secs(30);
    let follow = async {
        loop {
            match events.recv().await {
                Ok(PlanEvent::NoticeSeen { notice, at }) => {
                    v.seen_at = Some(at);
                    v.deadline = notice.deadline;
                }
                Ok(PlanEvent::Signalled {
                    at,
                    processes,
                    checkpoint_deadline,
                    ..
                }) => {
                    v.signalled_at = Some(at);
                    v.processes = processes;
                    v.checkpoint_deadline = Some(checkpoint_deadline);
                }
                Ok(PlanEvent::Checkpointed { at, results, .. }) => {
                    v.acked_at = Some(at);
                    v.results = results;
                    break;
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => break,
            }
        }
    };
    if tokio::time::timeout(limit, follow).await.is_err() {
        v.reason = "the plan did not reach the checkpoint result in time".into();
    }

    // 6. Let the child finish (it should exit after its save), then stop it.
    let status = match tokio::time::timeout(Duration::from_secs(10), child.wait()).await {
        Ok(s) => s.ok(),
        Err(_) => {
            terminate(pid);
            tokio::time::timeout(Duration::from_secs(5), child.wait())
                .await
                .ok()
                .and_then(|s| s.ok())
        }
    };
    v.child_exit = status.and_then(|s| {
        use std::os::unix::process::ExitStatusExt;
        s.code().or_else(|| s.signal().map(|sig| 128 + sig))
    });
    v.ack = read_ack(&ckpt_dir);
    pipeline_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;

    let outcome = v.results.first().map(|r| r.outcome);
    v.pass = !v.results.is_empty()
        && v.results
            .iter()
            .all(|r| matches!(r.outcome, Outcome::Acked | Outcome::Exited));
    if v.reason.is_empty() {
        v.reason = match outcome {
            Some(Outcome::Acked) => "acknowledged `done` within the budget".into(),
            Some(Outcome::Exited) => "exited cleanly after its checkpoint".into(),
            Some(Outcome::NoHandler) => format!("no process of the command catches {} — install a handler (clients/python/spotguard.py: spotguard.install())", "SIGUSR1"),
            Some(Outcome::Timeout) => "no terminal ack before the checkpoint budget ran out — the save does not fit this cloud's window".into(),
            Some(Outcome::Skipped) => "the process acked `skipped`: it judged the save would not fit".into(),
            Some(Outcome::Failed) => "the process acked `failed` or exited without `done`".into(),
            Some(Outcome::Error) => "spotguard could not signal or read acks (see the logs)".into(),
            None => "no checkpoint target found (did the command start?)".into(),
        };
    }
    drop(work);
    Ok(v)
}

fn drill_run_args(
    args: &DrillArgs,
    endpoint: &str,
    ckpt_dir: &Path,
    state_dir: &Path,
    pidfile: &Path,
) -> Result<config::RunArgs, String> {
    let cloud = cloud_name(args.cloud);
    let timeout = humantime::format_duration(args.timeout).to_string();
    let argv: Vec<String> = vec![
        "spotguard".into(),
        "run".into(),
        "--mode=host".into(),
        format!("--cloud={cloud}"),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=1s".into(),
        format!("--checkpoint-timeout={timeout}"),
        format!("--checkpoint-dir={}", ckpt_dir.display()),
        format!("--state-dir={}", state_dir.display()),
        format!("--checkpoint-pidfile={}", pidfile.display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        format!("--log-level={}", args.log_level),
        "--shutdown-grace=5s".into(),
    ];
    match config::parse_cli(argv) {
        config::Parsed::Command(config::Command::Run(r)) => {
            let mut r = *r;
            r.mode = ModeChoice::Host;
            r.config = None;
            Ok(r)
        }
        config::Parsed::Exit { text, .. } => Err(text),
        config::Parsed::Command(_) => Err("internal: drill built a non-run command".into()),
    }
}

fn cloud_name(c: DrillCloud) -> &'static str {
    match c {
        DrillCloud::Aws => "aws",
        DrillCloud::Gce => "gce",
        DrillCloud::Azure => "azure",
    }
}

/// The notice lead each cloud gives (the emulator's deadline; GCE's client adds its own 30 s).
fn default_lead(c: DrillCloud) -> Duration {
    match c {
        DrillCloud::Aws => Duration::from_secs(120),
        DrillCloud::Gce => Duration::from_secs(30),
        DrillCloud::Azure => Duration::from_secs(30),
    }
}

fn terminate(pid: u32) {
    if let Ok(p) = i32::try_from(pid) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(p, libc::SIGTERM);
        }
    }
}

/// The newest ack file in the checkpoint dir, for the verdict table.
fn read_ack(dir: &Path) -> Option<serde_json::Value> {
    let mut best: Option<(std::time::SystemTime, serde_json::Value)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("ack-") && name.ends_with(".json")) {
            continue;
        }
        let mtime = entry.metadata().and_then(|m| m.modified()).ok()?;
        let Ok(bytes) = std::fs::read(entry.path()) else {
            continue;
        };
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
            continue;
        };
        if best.as_ref().is_none_or(|(t, _)| mtime > *t) {
            best = Some((mtime, v));
        }
    }
    best.map(|(_, v)| v)
}

fn secs_after(t: Option<Timestamp>, t0: Timestamp) -> String {
    match t {
        Some(t) => format!("+{:.3}s", t.duration_since(t0).as_secs_f64()),
        None => "—".into(),
    }
}

fn print_verdict(args: &DrillArgs, v: &Verdict) {
    let t0 = v.raised_at;
    let budget = match (v.checkpoint_deadline, v.signalled_at) {
        (Some(cd), Some(s)) => Some(store::until(cd, s)),
        _ => None,
    };
    let took = match (v.acked_at, v.signalled_at) {
        (Some(a), Some(s)) => Some(a.duration_since(s).as_secs_f64()),
        _ => None,
    };
    let mut out = String::new();
    out.push_str("\n  step                 time       detail\n");
    out.push_str(&format!(
        "  notice raised        {:<10} {} interruption, deadline {}\n",
        "+0.000s",
        cloud_name(args.cloud),
        v.deadline
            .map(|d| format!("+{:.0}s", d.duration_since(t0).as_secs_f64()))
            .unwrap_or_else(|| "now".into())
    ));
    out.push_str(&format!(
        "  notice seen          {:<10} by the agent polling the emulator\n",
        secs_after(v.seen_at, t0)
    ));
    out.push_str(&format!(
        "  signal sent          {:<10} SIGUSR1 to {} process(es)\n",
        secs_after(v.signalled_at, t0),
        v.processes
    ));
    let ack_detail = match &v.ack {
        Some(a) => format!(
            "state={} step={} checkpoint={}",
            a.get("state").and_then(|s| s.as_str()).unwrap_or("?"),
            a.get("step")
                .map(|s| s.to_string())
                .unwrap_or_else(|| "null".into()),
            a.get("checkpoint").and_then(|s| s.as_str()).unwrap_or("-"),
        ),
        None => "no ack file".into(),
    };
    out.push_str(&format!(
        "  ack / result         {:<10} {}\n",
        secs_after(v.acked_at, t0),
        ack_detail
    ));
    if let Some(b) = budget {
        out.push_str(&format!(
            "  budget               {:<10} min(--timeout {}, deadline − drain reserve)\n",
            format!("{:.1}s", b.as_secs_f64()),
            humantime::format_duration(args.timeout)
        ));
    }
    if let Some(t) = took {
        out.push_str(&format!(
            "  checkpoint took      {:<10} signal → result\n",
            format!("{t:.3}s")
        ));
    }
    for r in &v.results {
        out.push_str(&format!(
            "  outcome              {:<10} {} ({})\n",
            r.outcome.as_str(),
            r.group,
            r.detail
        ));
    }
    if let Some(code) = v.child_exit {
        out.push_str(&format!(
            "  command exit         {:<10} {}\n",
            code,
            if code == 143 || code == 0 {
                "clean (143 = retryable after a checkpoint)"
            } else {
                ""
            }
        ));
    }
    out.push_str(&format!(
        "\n  verdict: {} — {}\n",
        if v.pass { "PASS" } else { "FAIL" },
        v.reason
    ));
    println!("{out}");
}

// === the bundled example trainer ===

static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn install_handlers() -> std::io::Result<()> {
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    for sig in [libc::SIGUSR1, libc::SIGTERM] {
        // SAFETY: installing a handler that only stores to an atomic.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn write_ack(dir: &Path, state: &str, step: u64, checkpoint: Option<&Path>) -> std::io::Result<()> {
    let body = serde_json::json!({
        "state": state,
        "step": step,
        "checkpoint": checkpoint.map(|p| p.display().to_string()),
        "ts": Timestamp::now().as_millisecond() as f64 / 1000.0,
    });
    crate::fsutil::write_atomic(
        &dir.join(format!("ack-{}.json", std::process::id())),
        body.to_string().as_bytes(),
        0o644,
    )
}

/// The bundled trainer: simulated steps; on SIGUSR1/SIGTERM it finishes the step, saves a
/// checkpoint into `$SPOTGUARD_DIR`, acks `done` and exits 143. Resumes from the newest checkpoint.
pub fn example_trainer(args: ExampleTrainerArgs) -> i32 {
    let dir =
        PathBuf::from(std::env::var("SPOTGUARD_DIR").unwrap_or_else(|_| "/tmp/spotguard".into()));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|_| install_handlers()) {
        eprintln!("example-trainer: {e}");
        return 1;
    }
    let mut step = latest_checkpoint(&dir).unwrap_or(0);
    if step > 0 {
        println!("example-trainer: resumed from step {step}");
    } else {
        println!(
            "example-trainer: starting from scratch (pid {})",
            std::process::id()
        );
    }
    let _ = std::io::stdout().flush();
    loop {
        std::thread::sleep(args.step_time);
        step += 1;
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            let _ = write_ack(&dir, "received", step, None);
            println!("example-trainer: signal {sig} at step {step}: saving a checkpoint");
            std::thread::sleep(args.save_time);
            let path = dir.join(format!("checkpoint-{step:08}.json"));
            let payload = serde_json::json!({"step": step, "weights": "simulated"}).to_string();
            if let Err(e) = crate::fsutil::write_atomic(&path, payload.as_bytes(), 0o644) {
                eprintln!("example-trainer: saving {}: {e}", path.display());
                let _ = write_ack(&dir, "failed", step, None);
                return 1;
            }
            if let Err(e) = write_ack(&dir, "done", step, Some(&path)) {
                eprintln!("example-trainer: writing ack: {e}");
                return 1;
            }
            println!(
                "example-trainer: checkpoint {} saved; exiting 143",
                path.display()
            );
            let _ = std::io::stdout().flush();
            return 143;
        }
        if args.max_steps > 0 && step >= args.max_steps {
            return 0;
        }
    }
}

fn latest_checkpoint(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("checkpoint-")?
                .strip_suffix(".json")?
                .parse::<u64>()
                .ok()
        })
        .max()
}
