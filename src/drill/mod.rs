//! `spotguard drill`: rehearse a preemption on this machine, no cloud needed.
//!
//! Runs the training command as a child (with `SPOTGUARD_DIR` set), starts the embedded metadata
//! emulator on loopback, waits until some process of the command's tree catches the checkpoint
//! signal (`wait`), raises an interruption `--after` that, and drives the real `run` pipeline
//! (host mode) against the child. Prints a verdict table (`report`); exit 0 on PASS. With no
//! command it runs the bundled example trainer (`trainer`).

mod elastic;
mod elastic_report;
mod records;
mod report;
mod trainer;
pub mod wait;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use jiff::Timestamp;
use tokio::process::Command;
use tokio_util::sync::CancellationToken;

use crate::app;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::{Outcome, Signal};
use crate::config::{self, Config, ModeChoice};
use crate::emulator;
use crate::notice::Cloud;
use crate::responder::PlanEvent;

pub use report::{AckRow, ExitInfo, Verdict};
pub use trainer::example_trainer;
use wait::HandlerWait;

/// Exit code of a drill whose every run passed.
pub const EXIT_PASS: i32 = 0;
/// Exit code when a run failed (the verdict says why).
pub const EXIT_FAIL: i32 = 1;
/// Exit code when the drill itself could not run (bad arguments, emulator, command not found).
pub const EXIT_ERROR: i32 = 2;

/// `--cloud`: which cloud's interruption to rehearse, each described by its source
/// ([`crate::notice::CloudFacts::drill_notice`]).
fn cloud_parser() -> impl clap::builder::TypedValueParser<Value = Cloud> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(
        Cloud::ALL.map(|c| PossibleValue::new(c.as_str()).help(c.facts().drill_notice)),
    )
    .try_map(|name| Cloud::from_str(&name, false))
}

/// `spotguard drill` arguments.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
By default the notice is raised --after (3s) once some process of the command's tree catches \
SIGUSR1 (a handler, e.g. spotguard.install()), waiting at most --startup-timeout for one; \
--after-start times it from the command's start instead.

Exit codes:
  0  PASS (every --repeat run): acked `done` within the budget and exited 143 (or another 128-255 code)
  1  FAIL: no handler, no or late ack, `skipped`/`failed`, exit 0 or 1-127 after the checkpoint,
     or still running after its result (killed by the drill)
  2  the drill could not run (command not found, exited before the notice, emulator error)")]
pub struct DrillArgs {
    /// Cloud whose interruption is rehearsed (sets the notice's deadline and the budget).
    #[arg(long, value_parser = cloud_parser(), default_value = "aws")]
    pub cloud: Cloud,
    /// Raise the interruption this long after the first process of the command catches the signal
    /// (with --after-start: after the command started).
    #[arg(long, default_value = "3s", value_parser = config::parse_duration)]
    pub after: Duration,
    /// Time --after from the command's start instead of waiting for a handler.
    #[arg(long)]
    pub after_start: bool,
    /// Upper bound on waiting for some process of the command to catch the signal; when none
    /// does, the notice is raised anyway and the verdict says no handler was installed.
    #[arg(long, default_value = "120s", value_parser = config::parse_positive_duration)]
    pub startup_timeout: Duration,
    /// The notice/ack directory given to the command as SPOTGUARD_DIR: where the agent writes
    /// notice.json and reads acks (not where checkpoints go) [default: a fresh temp dir per run].
    /// With --elastic, node N uses DIR/node-N. `--checkpoint-dir` is the old name.
    #[arg(long, value_name = "DIR", alias = "checkpoint-dir")]
    pub notice_dir: Option<PathBuf>,
    /// Upper bound on waiting for the acknowledgement (--checkpoint-timeout of `run`).
    #[arg(long, default_value = "90s", value_parser = config::parse_positive_duration)]
    pub timeout: Duration,
    /// Upper bound on waiting for the command to exit after its checkpoint result; then the drill
    /// stops it (SIGTERM, SIGKILL 5s later) and the verdict says so.
    #[arg(long, default_value = "30s", value_parser = config::parse_positive_duration)]
    pub exit_timeout: Duration,
    /// Run the drill N times in a row (each with a fresh temp dir unless --notice-dir is given).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Print the verdict as JSON on stdout (the command's own stdout goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also write a JUnit XML report (one test case per run) to FILE.
    #[arg(long, value_name = "FILE")]
    pub junit: Option<PathBuf>,
    /// Keep the drill's temp dir (checkpoint dir, agent state) and print where it is.
    #[arg(long)]
    pub keep: bool,
    /// Log level of the agent pipeline while the drill runs (e.g. `info` to watch every step).
    #[arg(long, default_value = "error")]
    pub log_level: String,
    /// Elastic training: run the command as --nodes local nodes of one elastic job (torchrun
    /// --nnodes MIN:MAX, Horovod elastic), raise the notice on one (--interrupt-node), kill that
    /// node's whole process tree at its deadline (--kill-after), and check that the other nodes
    /// resumed from the saved step, losing none, before that deadline.
    #[arg(long)]
    pub elastic: bool,
    /// With --elastic: how many nodes to run (node 1 is started first and hosts the rendezvous).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(2..=16))]
    pub nodes: u32,
    /// With --elastic: the node that gets the notice [default: the last one].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=16))]
    pub interrupt_node: Option<u32>,
    /// With --elastic: kill the interrupted node's process tree this long after the notice (the
    /// power-off) [default: the cloud's notice lead: aws 120s, gce 30s, azure 30s].
    #[arg(long, value_parser = config::parse_positive_duration)]
    pub kill_after: Option<Duration>,
    /// With --elastic: the command is ONE launcher for every node (horovodrun): a node is the
    /// set of its processes that catch the signal with the same value of VAR in their
    /// environment (e.g. HOROVOD_HOSTNAME); --interrupt-node counts them in name order.
    #[arg(long, value_name = "VAR")]
    pub node_env: Option<String>,
    /// With --elastic: keep watching the other nodes this long after the kill (a restart caused
    /// by the power-off loses steps).
    #[arg(long, default_value = "5s", value_parser = config::parse_duration)]
    pub settle: Duration,
    /// Rehearse a staged checkpoint: the agent uploads what the trainer acks `staged` into DIR
    /// (a local directory standing in for the job's s3://, gs:// or EFS location) and the drill
    /// reports the trainer's downtime (signal → exit) and the upload's time, bytes and verdict.
    /// The bundled trainer then saves --staged-size to a local staged directory
    /// ($SPOTGUARD_DRILL_STAGED); a command of yours acks with `spotguard.ack_staged(path)`.
    #[arg(long, value_name = "DIR")]
    pub upload_to: Option<PathBuf>,
    /// With --upload-to: how much the bundled trainer saves.
    #[arg(long, default_value = "64MiB", value_parser = config::parse_bytes)]
    pub staged_size: u64,
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

/// The signal the drill's agent sends (the `run` default).
const SIGNAL: Signal = Signal::USR1;
const SIGNAL_NAME: &str = "SIGUSR1";

/// Run the drill (`--repeat` times); returns the process exit code.
pub async fn run(args: DrillArgs, cancel: CancellationToken) -> i32 {
    crate::telemetry::init(config::LogFormat::Text, &args.log_level);
    if args.elastic {
        return elastic::run(&args, cancel).await;
    }
    let mut runs: Vec<(Verdict, String, Duration)> = Vec::new();
    let mut code = EXIT_PASS;
    for i in 0..args.repeat {
        if args.repeat > 1 && !args.json {
            println!("spotguard drill: run {} of {}", i + 1, args.repeat);
        }
        let began = Instant::now();
        let v = match drill(&args, cancel.clone()).await {
            Ok(v) => v,
            Err(e) => {
                eprintln!("spotguard drill: {e}");
                return EXIT_ERROR;
            }
        };
        let text = report::table(&v, args.timeout, SIGNAL_NAME);
        if !args.json {
            println!("{text}");
        }
        if !v.pass {
            code = EXIT_FAIL;
        }
        runs.push((v, text, began.elapsed()));
        if cancel.is_cancelled() {
            break;
        }
    }
    if args.repeat > 1 && !args.json {
        let passed = runs.iter().filter(|(v, _, _)| v.pass).count();
        println!("spotguard drill: {passed} of {} runs passed", runs.len());
    }
    if args.json {
        let doc = serde_json::json!({
            "pass": code == EXIT_PASS,
            "runs": runs.iter().map(|(v, _, _)| report::to_json(v, args.timeout, SIGNAL_NAME)).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    }
    if let Some(path) = &args.junit {
        if let Err(e) = std::fs::write(path, report::junit(&runs)) {
            eprintln!("spotguard drill: writing {}: {e}", path.display());
            return EXIT_ERROR;
        }
    }
    code
}

/// Where the command's stdout goes: ours, or stderr under `--json` (stdout is the JSON).
fn child_stdout(json: bool) -> Result<std::process::Stdio, String> {
    if !json {
        return Ok(std::process::Stdio::inherit());
    }
    use std::os::fd::AsFd;
    let fd = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("duplicating stderr: {e}"))?;
    Ok(std::process::Stdio::from(fd))
}

fn exit_info(status: std::process::ExitStatus, killed_by_drill: bool) -> ExitInfo {
    use std::os::unix::process::ExitStatusExt;
    let signal = status.signal();
    ExitInfo {
        code: status.code().unwrap_or_else(|| 128 + signal.unwrap_or(0)),
        signal,
        killed_by_drill,
    }
}

async fn drill(args: &DrillArgs, cancel: CancellationToken) -> Result<Verdict, String> {
    let work = tempfile::Builder::new()
        .prefix("spotguard-drill-")
        .tempdir()
        .map_err(|e| format!("creating a temp dir: {e}"))?;
    let ckpt_dir = match &args.notice_dir {
        Some(d) => std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?,
        None => work.path().join("notice"),
    };
    std::fs::create_dir_all(&ckpt_dir)
        .map_err(|e| format!("creating {}: {e}", ckpt_dir.display()))?;
    let state_dir = work.path().join("state");
    let pidfile = work.path().join("trainer.pid");
    let upload_to = match &args.upload_to {
        Some(d) => {
            let d = std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?;
            std::fs::create_dir_all(&d).map_err(|e| format!("creating {}: {e}", d.display()))?;
            Some(d)
        }
        None => None,
    };
    let staged_dir = work.path().join("staged");

    // 1. The emulator.
    let cloud = args.cloud;
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
    let when = if args.after_start {
        format!("{} after start", crate::duration::display(args.after))
    } else {
        format!(
            "{} after a process catches {SIGNAL_NAME} (waiting up to {})",
            crate::duration::display(args.after),
            crate::duration::display(args.startup_timeout)
        )
    };
    let say = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
            let _ = std::io::stdout().flush();
        }
    };
    say(format!(
        "spotguard drill: {} interruption {when}, against `{shown}`",
        args.cloud.as_str()
    ));
    say(format!("  SPOTGUARD_DIR={}", ckpt_dir.display()));
    if args.keep {
        say(format!("  drill dir (kept): {}", work.path().display()));
    }
    let started_at = Timestamp::now();
    let started = Instant::now();
    let mut child = Command::new(&program);
    if upload_to.is_some() {
        std::fs::create_dir_all(&staged_dir)
            .map_err(|e| format!("creating {}: {e}", staged_dir.display()))?;
        child
            .env(trainer::STAGED_ENV, &staged_dir)
            .env(trainer::STAGED_SIZE_ENV, args.staged_size.to_string());
        say(format!(
            "  staged checkpoints: uploaded by the agent into {}",
            upload_to.as_deref().unwrap_or(&staged_dir).display()
        ));
    }
    let mut child = child
        .args(&child_args)
        .env("SPOTGUARD_DIR", &ckpt_dir)
        .stdout(child_stdout(args.json)?)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", program.display()))?;
    let pid = child
        .id()
        .ok_or_else(|| "the command exited at once".to_string())?;
    std::fs::write(&pidfile, format!("{pid}\n")).map_err(|e| format!("writing pidfile: {e}"))?;

    // 3. The real pipeline, host mode, against the emulator.
    let run_args = drill_run_args(
        args,
        &emu.base_url(),
        &ckpt_dir,
        &state_dir,
        std::slice::from_ref(&pidfile),
    )?;
    let cfg = Config::resolve(run_args, &config::ProcessEnv).map_err(|e| e.to_string())?;
    let pipeline_cancel = cancel.child_token();
    let app = app::start(cfg, pipeline_cancel.clone())
        .await
        .map_err(|e| format!("starting the pipeline: {e}"))?;
    let mut events = app.events;

    // 4. Wait for a handler (bounded), then --after, unless the child dies first.
    let proc = ProcFs::new("/proc");
    let root = i32::try_from(pid).map_err(|_| format!("pid {pid} out of range"))?;
    let wait_phase = async {
        let handler = if args.after_start {
            HandlerWait::NotWaited
        } else {
            loop {
                if let Some(h) = wait::find_handler(&proc, root, SIGNAL) {
                    break HandlerWait::Found {
                        handler: h,
                        waited: started.elapsed(),
                    };
                }
                if started.elapsed() >= args.startup_timeout {
                    break HandlerWait::NotFound {
                        waited: started.elapsed(),
                    };
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        if let HandlerWait::Found { handler, waited } = &handler {
            say(format!(
                "  handler: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start; notice in {}",
                handler.pid,
                handler.command,
                waited.as_secs_f64(),
                crate::duration::display(args.after)
            ));
        }
        tokio::time::sleep(args.after).await;
        handler
    };
    let handler = tokio::select! {
        h = wait_phase => h,
        status = child.wait() => {
            pipeline_cancel.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
            emu.shutdown().await;
            let what = match status {
                Ok(s) => {
                    let e = exit_info(s, false);
                    match e.signal {
                        Some(_) => report::exit_label(&e),
                        None => format!("exit {}", e.code),
                    }
                }
                Err(e) => e.to_string(),
            };
            keep(work, args.keep);
            return Err(format!(
                "the command ended before the notice ({what}, {:.1}s after start): nothing was left to interrupt. Give it more steps, or a shorter --after",
                started.elapsed().as_secs_f64()
            ));
        }
        _ = cancel.cancelled() => return Err("interrupted".into()),
    };
    let raised_at = emu
        .raise(emulator::EmulatedNotice::interruption())
        .map_err(|e| format!("raising the notice in the emulator: {e}"))?
        .visible_at;
    let handler_gone = match &handler {
        HandlerWait::Found { handler, .. } => !wait::alive(&proc, handler.pid),
        _ => false,
    };
    let mut v = Verdict {
        raised_at: Some(raised_at),
        handler_gone,
        ..Verdict::started(args.cloud, shown, ckpt_dir.clone(), handler, started_at)
    };

    // 5. Follow the plan until the checkpoint step is over.
    let limit = args.timeout + args.cloud.facts().interruption_notice + Duration::from_secs(30);
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
                    v.result_at = Some(at);
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
        v.error = Some(format!(
            "the agent pipeline did not reach a checkpoint result within {}",
            crate::duration::display(limit)
        ));
    }

    // 6. Let the child exit on its own (it should, after its save); else stop it, and say so.
    // After a failed step (no handler, timeout, no result) there is nothing to wait for.
    let succeeded = v.error.is_none()
        && !v.results.is_empty()
        && v.results
            .iter()
            .all(|r| matches!(r.outcome, Outcome::Acked | Outcome::Exited));
    let still_saving = v.results.iter().any(|r| r.outcome == Outcome::Timeout);
    let exit_wait = if succeeded || still_saving {
        // A timed-out save may still finish: its ack then shows how late it was.
        args.exit_timeout
    } else {
        Duration::from_millis(500)
    };
    v.exit = match tokio::time::timeout(exit_wait, child.wait()).await {
        Ok(s) => {
            v.exited_at = Some(Timestamp::now());
            s.ok().map(|s| exit_info(s, false))
        }
        Err(_) => {
            v.drill_terminated_at = Some(Timestamp::now());
            terminate(pid, libc::SIGTERM);
            let status = match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                Ok(s) => s.ok(),
                Err(_) => {
                    terminate(pid, libc::SIGKILL);
                    tokio::time::timeout(Duration::from_secs(5), child.wait())
                        .await
                        .ok()
                        .and_then(|s| s.ok())
                }
            };
            status.map(|s| exit_info(s, true))
        }
    };
    v.acks = records::read_acks(&ckpt_dir);
    if upload_to.is_some() {
        v.upload = Some(upload_report(&mut events, &v, limit).await);
    }
    pipeline_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;

    report::judge(&mut v, SIGNAL_NAME, args.timeout);
    keep(work, args.keep);
    Ok(v)
}

/// The staged checkpoint's upload: its report once the plan says it ended (bounded by `limit`),
/// or why there is none.
async fn upload_report(
    events: &mut tokio::sync::broadcast::Receiver<PlanEvent>,
    v: &Verdict,
    limit: Duration,
) -> report::UploadRow {
    let staged = v.acks.iter().any(|a| a.staged.is_some());
    if !staged {
        return report::UploadRow::None(
            "no ack named a staged directory: nothing to upload (ack with spotguard.ack_staged(path))"
                .into(),
        );
    }
    let wait = async {
        loop {
            match events.recv().await {
                Ok(PlanEvent::Uploaded { report, .. }) => return Some(report),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => return None,
            }
        }
    };
    match tokio::time::timeout(limit, wait).await {
        Ok(Some(r)) => report::UploadRow::Ended(r),
        Ok(None) => report::UploadRow::None("the agent stopped before the upload ended".into()),
        Err(_) => report::UploadRow::None(format!(
            "no upload report within {}",
            crate::duration::display(limit)
        )),
    }
}

/// Drop (delete) the drill's temp dir, or keep it (`--keep`).
fn keep(work: tempfile::TempDir, keep: bool) {
    if keep {
        let _ = work.keep();
    }
}

fn drill_run_args(
    args: &DrillArgs,
    endpoint: &str,
    ckpt_dir: &Path,
    state_dir: &Path,
    pidfiles: &[PathBuf],
) -> Result<config::RunArgs, String> {
    let cloud = args.cloud.as_str();
    let timeout = crate::duration::display(args.timeout).to_string();
    let mut flags: Vec<String> = vec![
        "--mode=host".into(),
        format!("--cloud={cloud}"),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=1s".into(),
        format!("--checkpoint-timeout={timeout}"),
        format!("--checkpoint-dir={}", ckpt_dir.display()),
        format!("--state-dir={}", state_dir.display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        format!("--log-level={}", args.log_level),
        "--shutdown-grace=5s".into(),
    ];
    flags.extend(
        pidfiles
            .iter()
            .map(|p| format!("--checkpoint-pidfile={}", p.display())),
    );
    if let Some(dir) = &args.upload_to {
        flags.push(format!("--upload-allow={}", dir.display()));
        flags.push(format!("--checkpoint-upload={}", dir.display()));
    }
    let mut r = config::parse_run_args(flags)?;
    r.mode = ModeChoice::Host;
    r.config = None;
    Ok(r)
}

fn terminate(pid: u32, sig: libc::c_int) {
    if let Ok(p) = i32::try_from(pid) {
        // SAFETY: kill(2) on our own child's pid (not yet reaped: the pid is still ours).
        unsafe {
            libc::kill(p, sig);
        }
    }
}
