//! `spotguard drill --elastic`: rehearse a preemption of one node of an elastic job.
//!
//! Runs the command `--nodes` times on this machine, each copy a node of one job (torchrun
//! `--nnodes MIN:MAX` through the launcher, Horovod elastic…) with its own notice dir
//! (`SPOTGUARD_DIR=<dir>/node-N`) and its own process group. Node 1 starts first and the others
//! once it hosts the rendezvous (holds a listening socket) or runs a worker, so that node 1 is
//! the rendezvous host, which the default `--interrupt-node` (the last) is not. When every node
//! trains (a handler and a resume record each, and no new resume record for `--after`), the
//! real pipeline (host mode) raises the notice against the interrupted node only; at its
//! deadline (`--kill-after`) the drill kills that node's whole process group (the power-off) and
//! watches the others `--settle` longer.
//!
//! The drill learns steps from the helper's files: the `done` acks carry the step saved, and
//! `spotguard.resumed(step)` writes `resume-<pid>.json` with the step a process resumed from and
//! when (`SPOTGUARD_PROGRESS`, set here, makes it also report the last step reached), which
//! tells the surviving nodes' resumed step, the steps lost and when they trained again
//! (`elastic_report`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;

use super::elastic_launcher;
use super::elastic_node::{stop_all, Node};
use super::elastic_report::{self as er, ElasticVerdict};
use super::follow;
use super::pipeline::{self, Pipeline};
use super::workdir::{self, WorkDir};
use super::{records, say, wait, DrillArgs, EXIT_ERROR, EXIT_FAIL, EXIT_PASS, SIGNAL, SIGNAL_NAME};
use crate::checkpoint::procfs::ProcFs;
use crate::emulator::EmulatorHandle;

/// Run the elastic drill (`--repeat` times); returns the process exit code.
pub async fn run(args: &DrillArgs, cancel: CancellationToken) -> i32 {
    if args.command.is_empty() {
        eprintln!(
            "spotguard drill: --elastic needs the job's command after `--`, e.g. \
             -- python3 -m spotguard launch -- torchrun --nnodes=1:2 --rdzv-backend=c10d \
             --rdzv-endpoint=localhost:29400 --nproc-per-node=2 train.py"
        );
        return EXIT_ERROR;
    }
    let doomed = args.interrupt_node.unwrap_or(args.nodes);
    if doomed > args.nodes {
        eprintln!(
            "spotguard drill: --interrupt-node {doomed} but only --nodes {}",
            args.nodes
        );
        return EXIT_ERROR;
    }
    let mut runs: Vec<(ElasticVerdict, String, Duration)> = Vec::new();
    let mut code = EXIT_PASS;
    for i in 0..args.repeat {
        if args.repeat > 1 && !args.json {
            println!("spotguard drill: run {} of {}", i + 1, args.repeat);
        }
        let began = Instant::now();
        let run = match &args.node_env {
            Some(var) => elastic_launcher::drill(args, var, doomed, cancel.clone()).await,
            None => drill(args, doomed, cancel.clone()).await,
        };
        let v = match run {
            Ok(v) => v,
            Err(e) => {
                eprintln!("spotguard drill: {e}");
                return EXIT_ERROR;
            }
        };
        let text = er::table(&v);
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
            "runs": runs.iter().map(|(v, _, _)| er::to_json(v)).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    }
    if let Some(path) = &args.junit {
        if let Err(e) = std::fs::write(path, er::junit(&runs)) {
            eprintln!("spotguard drill: writing {}: {e}", path.display());
            return EXIT_ERROR;
        }
    }
    code
}

/// Run the drill once with `--nodes` copies of the command, the `doomed`-th interrupted.
async fn drill(
    args: &DrillArgs,
    doomed: u32,
    cancel: CancellationToken,
) -> Result<ElasticVerdict, String> {
    let work = WorkDir::new(args.notice_dir.as_deref())?;
    let pidfile = work.path().join("doomed.pid");
    let proc = ProcFs::new("/proc");
    let kill_after = kill_after(args);
    let shown = args.command.join(" ");
    say(
        args.json,
        format!(
            "spotguard drill --elastic: {} nodes of `{shown}`; {} interruption of node {doomed} {} after every node trains, its process tree killed {} after the notice",
            args.nodes,
            args.cloud.as_str(),
            crate::duration::display(args.after),
            crate::duration::display(kill_after),
        ),
    );
    let emu = pipeline::start_emulator(args.cloud).await?;
    let started_at = Timestamp::now();
    let started = Instant::now();

    // 1. The nodes: node 1 first (the rendezvous host), the others once it listens or trains.
    let mut nodes = start_nodes(args, &work.notice, &proc, started).await?;

    // 2. Every node trains: a handler each, a resume record each, then --after without a new one.
    wait_until_every_node_trains(args, &mut nodes, &proc, started, &cancel).await?;
    say_handlers(args, &nodes, started);

    // 3. The real pipeline against the interrupted node only.
    let d = (doomed - 1) as usize;
    std::fs::write(&pidfile, format!("{}\n", nodes[d].pid))
        .map_err(|e| format!("writing pidfile: {e}"))?;
    let dir = nodes[d].dir.clone();
    let mut v = {
        let mut poll = || nodes.iter_mut().for_each(|n| n.poll(&proc));
        let what = (doomed, shown, started_at);
        let pidfiles = [pidfile];
        notice_phase(
            args,
            emu,
            &dir,
            &work.state(),
            &pidfiles,
            what,
            &cancel,
            &mut poll,
        )
        .await?
    };
    let power_off = power_off_instant(&v, kill_after);

    // 4. Until the power-off, then --settle: watch the nodes.
    watch_until(power_off, &cancel, || {
        nodes.iter_mut().for_each(|n| n.poll(&proc))
    })
    .await;
    nodes[d].poll(&proc);
    v.power_off_at = Some(Timestamp::now());
    nodes[d].run.killed_at_power_off = nodes[d].kill_tree(&proc, libc::SIGKILL);
    let settle_end = Instant::now() + args.settle;
    watch_until(settle_end, &cancel, || {
        nodes.iter_mut().for_each(|n| n.poll(&proc))
    })
    .await;

    // 5. Stop the others, read what the nodes wrote, judge.
    stop_all(&mut nodes, &proc).await;
    v.acks = records::read_acks(&nodes[d].dir);
    for n in nodes.iter_mut() {
        n.run.resumes = records::read_resumes(&n.dir);
    }
    v.nodes = nodes.into_iter().map(|n| n.run).collect();
    er::judge(&mut v, args.timeout, kill_after);
    keep_work(args, work);
    Ok(v)
}

/// `--kill-after`, else the cloud's notice lead.
pub(super) fn kill_after(args: &DrillArgs) -> Duration {
    args.kill_after
        .unwrap_or_else(|| args.cloud.facts().interruption_notice)
}

/// Keep the drill's temp dir and say where it is (`--keep`), or delete it.
pub(super) fn keep_work(args: &DrillArgs, work: WorkDir) {
    if args.keep {
        say(
            args.json,
            format!("  drill dir (kept): {}", work.path().display()),
        );
        work.keep(true);
    }
}

/// Start the nodes, each with its notice dir `base/node-N` (cleared): node 1 first, the others
/// once it hosts the rendezvous or trains.
async fn start_nodes(
    args: &DrillArgs,
    base: &Path,
    proc: &ProcFs,
    started: Instant,
) -> Result<Vec<Node>, String> {
    let (program, rest) = (&args.command[0], &args.command[1..]);
    let mut nodes: Vec<Node> = Vec::new();
    for index in 1..=args.nodes {
        let dir = base.join(format!("node-{index}"));
        workdir::create(&dir)?;
        records::clear(&dir);
        say(
            args.json,
            format!("  node {index}: SPOTGUARD_DIR={}", dir.display()),
        );
        if index == 2 {
            wait_for_rendezvous_host(args, &mut nodes[0], proc, started).await?;
        }
        nodes.push(Node::spawn(index, program, rest, &dir, &[])?);
    }
    Ok(nodes)
}

/// Wait (up to `--startup-timeout`) until node 1 holds a listening socket (hosts the rendezvous)
/// or catches the signal (trains); an error when it ends first.
async fn wait_for_rendezvous_host(
    args: &DrillArgs,
    first: &mut Node,
    proc: &ProcFs,
    started: Instant,
) -> Result<(), String> {
    loop {
        let tree = wait::tree(proc, first.pid);
        if wait::listens(Path::new("/proc"), &tree)
            || wait::find_handler(proc, first.pid, SIGNAL).is_some()
        {
            return Ok(());
        }
        first.poll(proc);
        if let Some(e) = &first.run.exit {
            return Err(format!(
                "node 1 ended before the notice ({}, {:.1}s after start)",
                super::report::exit_label(e),
                started.elapsed().as_secs_f64()
            ));
        }
        if started.elapsed() >= args.startup_timeout {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wait until every node trains (a handler each, a resume record each, then `--after` without a
/// new one; at most `--after` + 20 s once every node has a handler) or `--startup-timeout`
/// passes. An error (after stopping the nodes) when a node ends first.
async fn wait_until_every_node_trains(
    args: &DrillArgs,
    nodes: &mut [Node],
    proc: &ProcFs,
    started: Instant,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let mut all_handlers_at: Option<Instant> = None;
    loop {
        if cancel.is_cancelled() {
            stop_all(nodes, proc).await;
            return Err("interrupted".into());
        }
        nodes.iter_mut().for_each(|n| n.poll(proc));
        if let Some(n) = nodes.iter().find(|n| n.run.exit.is_some()) {
            let what = n
                .run
                .exit
                .as_ref()
                .map(super::report::exit_label)
                .unwrap_or_default();
            let index = n.index;
            stop_all(nodes, proc).await;
            return Err(format!(
                "node {index} ended before the notice ({what}, {:.1}s after start)",
                started.elapsed().as_secs_f64()
            ));
        }
        note_handlers(nodes, proc, started);
        if all_handlers_at.is_none() && nodes.iter().all(|n| n.run.handler.is_some()) {
            all_handlers_at = Some(Instant::now());
        }
        let resumes: Vec<_> = nodes
            .iter()
            .map(|n| records::read_resumes(&n.dir))
            .collect();
        let last = resumes.iter().flatten().map(|r| r.at).max();
        let quiet = last.is_some_and(|t| {
            Timestamp::now().duration_since(t).as_secs_f64() >= args.after.as_secs_f64()
        });
        if let Some(t) = all_handlers_at {
            if (resumes.iter().all(|r| !r.is_empty()) && quiet)
                || t.elapsed() >= args.after + Duration::from_secs(20)
            {
                return Ok(());
            }
        }
        if started.elapsed() >= args.startup_timeout {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Note each node's first process seen catching the signal, and when.
fn note_handlers(nodes: &mut [Node], proc: &ProcFs, started: Instant) {
    for n in nodes.iter_mut() {
        if n.run.handler.is_none() {
            if let Some(h) = wait::find_handler(proc, n.pid, SIGNAL) {
                n.run.handler = Some((h, started.elapsed()));
            }
        }
    }
}

/// Say which process of each node catches the signal (or that none does).
fn say_handlers(args: &DrillArgs, nodes: &[Node], started: Instant) {
    for n in nodes {
        match &n.run.handler {
            Some((h, w)) => say(
                args.json,
                format!(
                    "  node {}: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start",
                    n.index,
                    h.pid,
                    h.command,
                    w.as_secs_f64()
                ),
            ),
            None => say(
                args.json,
                format!(
                    "  node {}: no process catches {SIGNAL_NAME} (waited {:.1}s)",
                    n.index,
                    started.elapsed().as_secs_f64()
                ),
            ),
        }
    }
}

/// When the power-off comes: `kill_after` after the notice was raised.
pub(super) fn power_off_instant(v: &ElasticVerdict, kill_after: Duration) -> Instant {
    let since = Timestamp::now().duration_since(v.raised_at).unsigned_abs();
    Instant::now() + kill_after.saturating_sub(since)
}

/// Call `poll` every 100 ms until `end` (or until cancelled).
pub(super) async fn watch_until(end: Instant, cancel: &CancellationToken, mut poll: impl FnMut()) {
    while Instant::now() < end && !cancel.is_cancelled() {
        poll();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Raise the notice against the processes of `pidfiles` (the interrupted node; its notice dir
/// `dir`) through the real pipeline and follow the plan to its checkpoint result, calling `poll`
/// every 100 ms meanwhile. Shuts the emulator down.
#[allow(clippy::too_many_arguments)]
pub(super) async fn notice_phase(
    args: &DrillArgs,
    emu: EmulatorHandle,
    dir: &Path,
    state_dir: &Path,
    pidfiles: &[PathBuf],
    (doomed, shown, started_at): (u32, String, Timestamp),
    cancel: &CancellationToken,
    poll: &mut dyn FnMut(),
) -> Result<ElasticVerdict, String> {
    let mut pipeline = Pipeline::start(args, emu, dir, state_dir, pidfiles, cancel).await?;
    let raised_at = pipeline.raise()?;
    let mut v = ElasticVerdict::started(args.cloud, shown, doomed, started_at, raised_at);
    // The nodes are watched while the pipeline runs, too.
    let limit = follow::limit(args.timeout, args.cloud);
    v.record_plan(follow::to_result_polling(pipeline.events(), limit, poll).await);
    pipeline.stop().await;
    Ok(v)
}
