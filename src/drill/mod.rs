//! `spotguard drill`: rehearse a preemption on this machine, no cloud needed.
//!
//! Runs the training command as a child (with `SPOTGUARD_DIR` set), starts the embedded metadata
//! emulator on loopback, waits until some process of the command's tree catches the checkpoint
//! signal (`wait`), raises an interruption `--after` that, and drives the real `run` pipeline
//! (host mode) against the child. Prints a verdict table (`report`); exit 0 on PASS. With no
//! command it runs the bundled example trainer (`trainer`).

mod child;
mod elastic;
mod follow;
mod pipeline;
mod records;
mod repeat;
mod report;
mod trainer;
pub mod wait;
mod workdir;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use jiff::Timestamp;
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::{Outcome, Signal};
use crate::config;
use crate::notice::Cloud;
use crate::responder::PlanEvent;

use pipeline::Pipeline;
pub use report::{AckRow, ExitInfo, Verdict};
pub use trainer::example_trainer;
use wait::HandlerWait;
use workdir::WorkDir;

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
    if let Err(e) = check_args(&args) {
        eprintln!("spotguard: {e}");
        return config::EXIT_USAGE;
    }
    crate::telemetry::init(config::LogFormat::Text, &args.log_level);
    if args.elastic {
        return elastic::run(&args, cancel).await;
    }
    repeat::run(&args, &cancel, || drill(&args, cancel.clone())).await
}

/// What can be judged before the drill runs: the log filter, and the report file `--junit` will
/// write at the end (a typo there would otherwise cost the whole run).
fn check_args(args: &DrillArgs) -> Result<(), String> {
    config::check::log_filter(&args.log_level).map_err(|e| format!("--log-level: {e}"))?;
    if let Some(path) = &args.junit {
        config::check::output_file(path).map_err(|e| format!("--junit: {e}"))?;
    }
    Ok(())
}

/// Print a progress line: on stdout, or on stderr under `--json` (stdout is the JSON).
fn say(json: bool, line: String) {
    if json {
        eprintln!("{line}");
    } else {
        println!("{line}");
        let _ = std::io::stdout().flush();
    }
}

/// One run's directories and files.
struct RunDirs {
    work: WorkDir,
    /// The pidfile naming the command to the pipeline.
    pidfile: PathBuf,
    /// `--upload-to`, made absolute and created.
    upload_to: Option<PathBuf>,
    /// Where the bundled trainer stages its checkpoint (`--upload-to`).
    staged: PathBuf,
}

/// The run's temp dir, its notice dir (created) and `--upload-to` (created).
fn prepare_dirs(args: &DrillArgs) -> Result<RunDirs, String> {
    let work = WorkDir::new(args.notice_dir.as_deref())?;
    workdir::create(&work.notice)?;
    let pidfile = work.path().join("trainer.pid");
    let upload_to = match &args.upload_to {
        Some(d) => {
            let d = workdir::absolute(d)?;
            workdir::create(&d)?;
            Some(d)
        }
        None => None,
    };
    let staged = work.path().join("staged");
    Ok(RunDirs {
        work,
        pidfile,
        upload_to,
        staged,
    })
}

async fn drill(args: &DrillArgs, cancel: CancellationToken) -> Result<Verdict, String> {
    let dirs = prepare_dirs(args)?;

    // 1. The emulator.
    let emu = pipeline::start_emulator(args.cloud).await?;

    // 2. The child.
    let (program, child_args) = program(args)?;
    let shown = shown(args);
    announce(args, &dirs, &shown);
    let started_at = Timestamp::now();
    let started = Instant::now();
    let (mut child, pid) = start_child(args, &dirs, &program, &child_args)?;

    // 3. The real pipeline, host mode, against the emulator.
    let notice_dir = dirs.work.notice.clone();
    let pidfiles = std::slice::from_ref(&dirs.pidfile);
    let mut pipeline = Pipeline::start(
        args,
        emu,
        &notice_dir,
        &dirs.work.state(),
        pidfiles,
        &cancel,
    )
    .await?;

    // 4. Wait for a handler (bounded), then --after, unless the child dies first.
    let proc = ProcFs::new("/proc");
    let root = i32::try_from(pid).map_err(|_| format!("pid {pid} out of range"))?;
    let handler = tokio::select! {
        h = wait_for_handler(args, &proc, root, started) => h,
        status = child.wait() => {
            pipeline.stop().await;
            let why = ended_before_the_notice(args, status, started);
            dirs.work.keep(args.keep);
            return Err(why);
        }
        _ = cancel.cancelled() => return Err("interrupted".into()),
    };
    let raised_at = pipeline.raise()?;
    let handler_gone = match &handler {
        HandlerWait::Found { handler, .. } => !wait::alive(&proc, handler.pid),
        _ => false,
    };
    let mut v = Verdict {
        raised_at: Some(raised_at),
        handler_gone,
        ..Verdict::started(args.cloud, shown, notice_dir.clone(), handler, started_at)
    };

    // 5. Follow the plan until the checkpoint step is over.
    let limit = follow::limit(args.timeout, args.cloud);
    v.plan = follow::to_result(pipeline.events(), limit).await;

    // 6. Let the child exit on its own (it should, after its save); else stop it, and say so.
    let_child_exit(args, &mut v, &mut child, pid).await;
    v.acks = records::read_acks(&notice_dir);
    if dirs.upload_to.is_some() {
        v.upload = Some(upload_report(pipeline.events(), &v, limit).await);
    }
    pipeline.stop().await;

    report::judge(&mut v, SIGNAL_NAME, args.timeout);
    dirs.work.keep(args.keep);
    Ok(v)
}

/// The command as the verdict shows it.
fn shown(args: &DrillArgs) -> String {
    if args.command.is_empty() {
        "spotguard example-trainer (bundled)".to_string()
    } else {
        args.command.join(" ")
    }
}

/// Why the run stops when the command exited (`status`) before the notice: a crash, or an end.
fn ended_before_the_notice(
    args: &DrillArgs,
    status: std::io::Result<std::process::ExitStatus>,
    started: Instant,
) -> String {
    let crashed = matches!(&status, Ok(s) if !s.success());
    let what = child::early_exit(status);
    let after = started.elapsed().as_secs_f64();
    let where_ = if args.json {
        "on stderr, above"
    } else {
        "above"
    };
    if crashed {
        format!(
            "the command crashed before the notice ({what}, {after:.1}s after start): its own output is {where_} (a missing module, a bad argument?). Run it alone until it trains, then drill it again"
        )
    } else {
        format!(
            "the command ended before the notice ({what}, {after:.1}s after start): nothing was left to interrupt. Give it more steps, or a shorter --after"
        )
    }
}

/// The program to run and its arguments: the command, else the bundled example trainer.
fn program(args: &DrillArgs) -> Result<(PathBuf, Vec<String>), String> {
    if args.command.is_empty() {
        let me = std::env::current_exe().map_err(|e| format!("locating spotguard: {e}"))?;
        Ok((me, vec!["example-trainer".into()]))
    } else {
        Ok((PathBuf::from(&args.command[0]), args.command[1..].to_vec()))
    }
}

/// Say what the run rehearses, against what, and where its dirs are.
fn announce(args: &DrillArgs, dirs: &RunDirs, shown: &str) {
    let when = if args.after_start {
        format!("{} after start", crate::duration::display(args.after))
    } else {
        format!(
            "{} after a process catches {SIGNAL_NAME} (waiting up to {})",
            crate::duration::display(args.after),
            crate::duration::display(args.startup_timeout)
        )
    };
    say(
        args.json,
        format!(
            "spotguard drill: {} interruption {when}, against `{shown}`",
            args.cloud.as_str()
        ),
    );
    say(
        args.json,
        format!("  SPOTGUARD_DIR={}", dirs.work.notice.display()),
    );
    if args.keep {
        say(
            args.json,
            format!("  drill dir (kept): {}", dirs.work.path().display()),
        );
    }
}

/// Start the command (with `SPOTGUARD_DIR`, and the staged dir under `--upload-to`) and write
/// its pidfile; returns it and its pid.
fn start_child(
    args: &DrillArgs,
    dirs: &RunDirs,
    program: &Path,
    child_args: &[String],
) -> Result<(Child, u32), String> {
    let mut child = Command::new(program);
    if let Some(upload_to) = &dirs.upload_to {
        workdir::create(&dirs.staged)?;
        child
            .env(trainer::STAGED_ENV, &dirs.staged)
            .env(trainer::STAGED_SIZE_ENV, args.staged_size.to_string());
        say(
            args.json,
            format!(
                "  staged checkpoints: uploaded by the agent into {}",
                upload_to.display()
            ),
        );
    }
    let child = child
        .args(child_args)
        .env("SPOTGUARD_DIR", &dirs.work.notice)
        .stdout(child::stdout(args.json)?)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", program.display()))?;
    let pid = child
        .id()
        .ok_or_else(|| "the command exited at once".to_string())?;
    std::fs::write(&dirs.pidfile, format!("{pid}\n"))
        .map_err(|e| format!("writing pidfile: {e}"))?;
    Ok((child, pid))
}

/// Wait up to --startup-timeout for some process of `root`'s tree to catch the signal (not with
/// --after-start), say which, then wait --after.
async fn wait_for_handler(
    args: &DrillArgs,
    proc: &ProcFs,
    root: i32,
    started: Instant,
) -> HandlerWait {
    let handler = if args.after_start {
        HandlerWait::NotWaited
    } else {
        loop {
            if let Some(h) = wait::find_handler(proc, root, SIGNAL) {
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
        say(
            args.json,
            format!(
                "  handler: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start; notice in {}",
                handler.pid,
                handler.command,
                waited.as_secs_f64(),
                crate::duration::display(args.after)
            ),
        );
    }
    tokio::time::sleep(args.after).await;
    handler
}

/// Let the child exit on its own within --exit-timeout after a checkpoint that succeeded (or a
/// save that may still finish: its ack then shows how late it was), else within 500 ms (after a
/// failed step — no handler, timeout, no result — there is nothing to wait for); then stop it.
async fn let_child_exit(args: &DrillArgs, v: &mut Verdict, child: &mut Child, pid: u32) {
    let succeeded = v.plan.error.is_none()
        && !v.plan.results.is_empty()
        && v.plan
            .results
            .iter()
            .all(|r| matches!(r.outcome, Outcome::Acked | Outcome::Exited));
    let still_saving = v.plan.results.iter().any(|r| r.outcome == Outcome::Timeout);
    let exit_wait = if succeeded || still_saving {
        args.exit_timeout
    } else {
        Duration::from_millis(500)
    };
    let ended = child::let_exit(child, pid, exit_wait).await;
    v.exit = ended.exit;
    v.exited_at = ended.exited_at;
    v.drill_terminated_at = ended.terminated_at;
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
    match tokio::time::timeout(limit, follow::upload(events)).await {
        Ok(Some(r)) => report::UploadRow::Ended(r),
        Ok(None) => report::UploadRow::None("the agent stopped before the upload ended".into()),
        Err(_) => report::UploadRow::None(format!(
            "no upload report within {}",
            crate::duration::display(limit)
        )),
    }
}
