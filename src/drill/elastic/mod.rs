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
//! (`report`).

use std::path::Path;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;

mod job;
mod launcher;
mod node;
mod report;

use self::job::{interrupt, keep_work, kill_after, Job, Target};
use self::node::{stop_all, Node};
use self::report::{self as er, ElasticVerdict};
use super::pipeline;
use super::workdir::{self, WorkDir};
use super::{records, repeat, say, wait, DrillArgs, EXIT_ERROR, SIGNAL, SIGNAL_NAME};
use crate::checkpoint::procfs::ProcFs;

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
    repeat::run(args, &cancel, || once(args, doomed, cancel.clone())).await
}

/// Run the drill once: through the one launcher of every node (`--node-env`), else with
/// `--nodes` copies of the command.
async fn once(
    args: &DrillArgs,
    doomed: u32,
    cancel: CancellationToken,
) -> Result<ElasticVerdict, String> {
    match &args.node_env {
        Some(var) => launcher::drill(args, var, doomed, cancel).await,
        None => drill(args, doomed, cancel).await,
    }
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

    // 3. The real pipeline against the interrupted node only; 4. until the power-off, then
    // --settle: watch the nodes.
    let d = (doomed - 1) as usize;
    std::fs::write(&pidfile, format!("{}\n", nodes[d].pid))
        .map_err(|e| format!("writing pidfile: {e}"))?;
    let target = Target {
        doomed,
        dir: nodes[d].dir.clone(),
        pidfiles: vec![pidfile],
        command: shown,
        started_at,
    };
    let mut job = Nodes {
        nodes: &mut nodes,
        d,
    };
    let mut v = interrupt(args, emu, &work, target, &cancel, &proc, &mut job).await?;

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

/// The `--nodes` commands, the `d`-th (0-based) interrupted.
struct Nodes<'a> {
    nodes: &'a mut [Node],
    d: usize,
}

impl Job for Nodes<'_> {
    fn watch(&mut self, proc: &ProcFs) {
        self.nodes.iter_mut().for_each(|n| n.poll(proc));
    }

    fn last_look(&mut self, proc: &ProcFs) {
        self.nodes[self.d].poll(proc);
    }

    fn kill(&mut self, proc: &ProcFs) {
        let n = &mut self.nodes[self.d];
        n.run.killed_at_power_off = n.kill_tree(proc, libc::SIGKILL);
    }
}
