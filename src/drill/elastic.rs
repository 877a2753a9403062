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
use std::process::Stdio;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use super::elastic_report::{self as er, ElasticVerdict, NodeRun};
use super::records;
use super::wait;
use super::{
    drill_run_args, exit_info, DrillArgs, EXIT_ERROR, EXIT_FAIL, EXIT_PASS, SIGNAL, SIGNAL_NAME,
};
use crate::app;
use crate::checkpoint::procfs::ProcFs;
use crate::config::{self, Config};
use crate::emulator;
use crate::responder::PlanEvent;

/// How often the drill's helper reports progress (`SPOTGUARD_PROGRESS`, seconds).
const PROGRESS_S: &str = "0.5";

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
            Some(var) => drill_one_launcher(args, var, doomed, cancel.clone()).await,
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

/// One node: a copy of the command in its own process group.
struct Node {
    index: u32,
    dir: PathBuf,
    child: Child,
    pid: i32,
    run: NodeRun,
    /// Every process seen in the node's tree or process group (pid → start time): torchrun starts
    /// its workers in sessions of their own, and they outlive their agent as orphans, so neither
    /// the process group nor the tree at the time of the kill holds all of them.
    members: Members,
}

/// Processes that belonged to a node (pid → start time, so that a reused pid is never killed).
#[derive(Default)]
struct Members(std::collections::HashMap<i32, u64>);

impl Members {
    fn add(&mut self, proc: &ProcFs, pids: impl IntoIterator<Item = i32>) {
        for pid in pids {
            if let Ok(st) = proc.stat(pid) {
                self.0.entry(pid).or_insert(st.start_time);
            }
        }
    }

    /// The members still running (same pid, same start time).
    fn alive(&self, proc: &ProcFs) -> Vec<i32> {
        let mut out: Vec<i32> = self
            .0
            .iter()
            .filter(|(pid, start)| {
                proc.stat(**pid)
                    .is_ok_and(|st| st.start_time == **start && st.state != 'Z' && st.state != 'X')
            })
            .map(|(pid, _)| *pid)
            .collect();
        out.sort_unstable();
        out
    }

    /// Send `sig` to every member still running; returns how many.
    fn kill(&self, proc: &ProcFs, sig: libc::c_int) -> usize {
        let alive = self.alive(proc);
        for pid in &alive {
            // SAFETY: kill(2) of a process this drill's node started (pid and start time match).
            unsafe {
                libc::kill(*pid, sig);
            }
        }
        alive.len()
    }
}

impl Node {
    fn spawn(
        index: u32,
        program: &str,
        rest: &[String],
        dir: &Path,
        extra_env: &[(&str, &str)],
    ) -> Result<Node, String> {
        let mut cmd = Command::new(program);
        cmd.args(rest)
            .envs(extra_env.iter().copied())
            .env("SPOTGUARD_DIR", dir)
            .env("SPOTGUARD_PROGRESS", PROGRESS_S)
            .env("SPOTGUARD_DRILL_NODE", index.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("starting node {index} ({program}): {e}"))?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| format!("node {index} exited at once"))?;
        // Each line of the node's output, prefixed with its node, on our stderr (stdout is the
        // table, or the JSON).
        if let Some(out) = child.stdout.take() {
            tokio::spawn(prefix_lines(index, out));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(prefix_lines(index, err));
        }
        Ok(Node {
            index,
            dir: dir.to_path_buf(),
            child,
            pid,
            run: NodeRun::new(index, pid, dir.to_path_buf()),
            members: Members::default(),
        })
    }

    /// Record the node's exit if it has exited.
    fn poll_exit(&mut self) {
        if self.run.exit.is_some() {
            return;
        }
        if let Ok(Some(status)) = self.child.try_wait() {
            self.run.exit = Some(exit_info(status, false));
            self.run.exited_at = Some(Timestamp::now());
        }
    }

    /// Note the processes of the node's tree and process group (see `members`).
    fn track(&mut self, proc: &ProcFs) {
        self.members.add(proc, wait::tree(proc, self.pid));
        self.members.add(proc, group_members(proc, self.pid));
    }

    /// Record the node's exit, and its processes.
    fn poll(&mut self, proc: &ProcFs) {
        self.track(proc);
        self.poll_exit();
    }

    /// Kill the node's whole process tree with `sig`: every process it ever had that still runs
    /// (its workers in their own sessions, orphans included) and its process group; returns how
    /// many processes that was.
    fn kill_tree(&mut self, proc: &ProcFs, sig: libc::c_int) -> usize {
        self.track(proc);
        self.members.kill(proc, sig)
    }
}

async fn prefix_lines(index: u32, stream: impl tokio::io::AsyncRead + Unpin) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        eprintln!("  [node {index}] {line}");
    }
}

/// The live processes of process group `pgid`.
fn group_members(proc: &ProcFs, pgid: i32) -> Vec<i32> {
    let Ok(pids) = proc.pids() else {
        return Vec::new();
    };
    pids.into_iter()
        .filter(|&p| {
            // SAFETY: getpgid(2) only reads.
            let g = unsafe { libc::getpgid(p) };
            g == pgid && wait::alive(proc, p)
        })
        .collect()
}

async fn drill(
    args: &DrillArgs,
    doomed: u32,
    cancel: CancellationToken,
) -> Result<ElasticVerdict, String> {
    let work = tempfile::Builder::new()
        .prefix("spotguard-drill-")
        .tempdir()
        .map_err(|e| format!("creating a temp dir: {e}"))?;
    let base = match &args.notice_dir {
        Some(d) => std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?,
        None => work.path().join("notice"),
    };
    let state_dir = work.path().join("state");
    let pidfile = work.path().join("doomed.pid");
    let proc = ProcFs::new("/proc");
    let say = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let cloud = args.cloud;
    let kill_after = args
        .kill_after
        .unwrap_or_else(|| args.cloud.facts().interruption_notice);
    let shown = args.command.join(" ");
    say(format!(
        "spotguard drill --elastic: {} nodes of `{shown}`; {} interruption of node {doomed} {} after every node trains, its process tree killed {} after the notice",
        args.nodes,
        args.cloud.as_str(),
        crate::duration::display(args.after),
        crate::duration::display(kill_after),
    ));
    let emu = emulator::start(emulator::EmulatorConfig::new(cloud))
        .await
        .map_err(|e| format!("starting the metadata emulator: {e}"))?;
    let started_at = Timestamp::now();
    let started = Instant::now();

    // 1. The nodes: node 1 first (the rendezvous host), the others once it listens or trains.
    let (program, rest) = (&args.command[0], &args.command[1..]);
    let mut nodes: Vec<Node> = Vec::new();
    for index in 1..=args.nodes {
        let dir = base.join(format!("node-{index}"));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        records::clear(&dir);
        say(format!("  node {index}: SPOTGUARD_DIR={}", dir.display()));
        if index == 2 {
            let first = &mut nodes[0];
            loop {
                let tree = wait::tree(&proc, first.pid);
                if wait::listens(Path::new("/proc"), &tree)
                    || wait::find_handler(&proc, first.pid, SIGNAL).is_some()
                {
                    break;
                }
                first.poll(&proc);
                if let Some(e) = &first.run.exit {
                    return Err(format!(
                        "node 1 ended before the notice ({}, {:.1}s after start)",
                        super::report::exit_label(e),
                        started.elapsed().as_secs_f64()
                    ));
                }
                if started.elapsed() >= args.startup_timeout {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        nodes.push(Node::spawn(index, program, rest, &dir, &[])?);
    }

    // 2. Every node trains: a handler each, a resume record each, then --after without a new one.
    let mut all_handlers_at: Option<Instant> = None;
    loop {
        if cancel.is_cancelled() {
            stop_all(&mut nodes, &proc).await;
            return Err("interrupted".into());
        }
        nodes.iter_mut().for_each(|n| n.poll(&proc));
        if let Some(n) = nodes.iter().find(|n| n.run.exit.is_some()) {
            let what = n
                .run
                .exit
                .as_ref()
                .map(super::report::exit_label)
                .unwrap_or_default();
            let index = n.index;
            stop_all(&mut nodes, &proc).await;
            return Err(format!(
                "node {index} ended before the notice ({what}, {:.1}s after start)",
                started.elapsed().as_secs_f64()
            ));
        }
        for n in nodes.iter_mut() {
            if n.run.handler.is_none() {
                if let Some(h) = wait::find_handler(&proc, n.pid, SIGNAL) {
                    n.run.handler = Some((h, started.elapsed()));
                }
            }
        }
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
                break;
            }
        }
        if started.elapsed() >= args.startup_timeout {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let d = (doomed - 1) as usize;
    for n in &nodes {
        match &n.run.handler {
            Some((h, w)) => say(format!(
                "  node {}: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start",
                n.index,
                h.pid,
                h.command,
                w.as_secs_f64()
            )),
            None => say(format!(
                "  node {}: no process catches {SIGNAL_NAME} (waited {:.1}s)",
                n.index,
                started.elapsed().as_secs_f64()
            )),
        }
    }

    // 3. The real pipeline against the interrupted node only.
    std::fs::write(&pidfile, format!("{}\n", nodes[d].pid))
        .map_err(|e| format!("writing pidfile: {e}"))?;
    let dir = nodes[d].dir.clone();
    let mut v = {
        let mut poll = || nodes.iter_mut().for_each(|n| n.poll(&proc));
        notice_phase(
            args,
            emu,
            &dir,
            &state_dir,
            &[pidfile],
            (doomed, shown, started_at),
            &cancel,
            &mut poll,
        )
        .await?
    };
    let power_off = power_off_instant(&v, kill_after);

    // 4. Until the power-off, then --settle: watch the nodes.
    while Instant::now() < power_off && !cancel.is_cancelled() {
        nodes.iter_mut().for_each(|n| n.poll(&proc));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    nodes[d].poll(&proc);
    v.power_off_at = Some(Timestamp::now());
    nodes[d].run.killed_at_power_off = nodes[d].kill_tree(&proc, libc::SIGKILL);
    let settle_end = Instant::now() + args.settle;
    while Instant::now() < settle_end && !cancel.is_cancelled() {
        nodes.iter_mut().for_each(|n| n.poll(&proc));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // 5. Stop the others, read what the nodes wrote, judge.
    stop_all(&mut nodes, &proc).await;
    v.acks = records::read_acks(&nodes[d].dir);
    for n in nodes.iter_mut() {
        n.run.resumes = records::read_resumes(&n.dir);
    }
    v.nodes = nodes.into_iter().map(|n| n.run).collect();
    er::judge(&mut v, args.timeout, kill_after);
    if args.keep {
        say(format!("  drill dir (kept): {}", work.path().display()));
        let _ = work.keep();
    }
    Ok(v)
}

/// `--node-env VAR`: one launcher runs every node (horovodrun). A node is the set of the
/// command's processes that catch the signal with the same value of `VAR` in their environment;
/// the notice goes to the `doomed`-th of them in name order, and the power-off kills every
/// process of the command's tree whose environment has that value.
async fn drill_one_launcher(
    args: &DrillArgs,
    var: &str,
    doomed: u32,
    cancel: CancellationToken,
) -> Result<ElasticVerdict, String> {
    let work = tempfile::Builder::new()
        .prefix("spotguard-drill-")
        .tempdir()
        .map_err(|e| format!("creating a temp dir: {e}"))?;
    let dir = match &args.notice_dir {
        Some(d) => std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))?,
        None => work.path().join("notice"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    records::clear(&dir);
    let state_dir = work.path().join("state");
    let proc = ProcFs::new("/proc");
    let say = |line: String| {
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let kill_after = args
        .kill_after
        .unwrap_or_else(|| args.cloud.facts().interruption_notice);
    let shown = args.command.join(" ");
    say(format!(
        "spotguard drill --elastic: `{shown}` as {} nodes told apart by ${var}; {} interruption of the {}th node (in name order) {} after every node trains, its processes killed {} after the notice",
        args.nodes,
        args.cloud.as_str(),
        doomed,
        crate::duration::display(args.after),
        crate::duration::display(kill_after),
    ));
    say(format!("  SPOTGUARD_DIR={}", dir.display()));
    let cloud = args.cloud;
    let emu = emulator::start(emulator::EmulatorConfig::new(cloud))
        .await
        .map_err(|e| format!("starting the metadata emulator: {e}"))?;
    let started_at = Timestamp::now();
    let started = Instant::now();
    let (program, rest) = (&args.command[0], &args.command[1..]);
    let mut job = Node::spawn(1, program, rest, &dir, &[("SPOTGUARD_NODE_ENV", var)])?;

    // 1. Every node trains: its workers catch the signal and wrote resume records, then quiet.
    let mut first_seen: std::collections::BTreeMap<String, (wait::Handler, Duration)> =
        Default::default();
    loop {
        if cancel.is_cancelled() {
            stop_all(std::slice::from_mut(&mut job), &proc).await;
            return Err("interrupted".into());
        }
        job.poll(&proc);
        if let Some(e) = &job.run.exit {
            let what = super::report::exit_label(e);
            return Err(format!(
                "the command ended before the notice ({what}, {:.1}s after start)",
                started.elapsed().as_secs_f64()
            ));
        }
        for (name, pids) in node_workers(&proc, job.pid, var) {
            if let Some(&pid) = pids.first() {
                first_seen.entry(name).or_insert_with(|| {
                    let command = proc
                        .cmdline(pid)
                        .map(|a| wait::shorten(&a.join(" "), 80))
                        .unwrap_or_default();
                    (wait::Handler { pid, command }, started.elapsed())
                });
            }
        }
        let resumes = records::read_resumes(&dir);
        let trained = first_seen
            .keys()
            .filter(|n| {
                resumes
                    .iter()
                    .any(|r| r.node.as_deref() == Some(n.as_str()))
            })
            .count();
        let quiet = resumes.iter().map(|r| r.at).max().is_some_and(|t| {
            Timestamp::now().duration_since(t).as_secs_f64() >= args.after.as_secs_f64()
        });
        if trained >= args.nodes as usize && quiet {
            break;
        }
        if started.elapsed() >= args.startup_timeout {
            stop_all(std::slice::from_mut(&mut job), &proc).await;
            return Err(format!(
                "only {} of {} nodes trained within --startup-timeout {} (nodes seen: {:?}; each needs a process catching {SIGNAL_NAME} with ${var} set, and a resume record: spotguard.resumed())",
                trained,
                args.nodes,
                crate::duration::display(args.startup_timeout),
                first_seen.keys().collect::<Vec<_>>()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let names: Vec<String> = first_seen.keys().cloned().collect();
    let Some(doomed_name) = names.get(doomed as usize - 1).cloned() else {
        stop_all(std::slice::from_mut(&mut job), &proc).await;
        return Err(format!(
            "--interrupt-node {doomed}, but only {} nodes: {names:?}",
            names.len()
        ));
    };
    for (name, (h, w)) in &first_seen {
        say(format!(
            "  {var}={name}: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start",
            h.pid,
            h.command,
            w.as_secs_f64()
        ));
    }

    // 2. The notice, against the interrupted node's workers only (one pidfile each).
    let workers = node_workers(&proc, job.pid, var)
        .remove(&doomed_name)
        .unwrap_or_default();
    let mut pidfiles = Vec::new();
    for pid in &workers {
        let f = work.path().join(format!("doomed-{pid}.pid"));
        std::fs::write(&f, format!("{pid}\n")).map_err(|e| format!("writing pidfile: {e}"))?;
        pidfiles.push(f);
    }
    let mut gone_at: Option<Timestamp> = None;
    // The interrupted node's processes, as seen (they may be orphaned before the power-off).
    let mut doomed_members = Members::default();
    let watch = |job: &mut Node, gone_at: &mut Option<Timestamp>, members: &mut Members| {
        job.poll(&proc);
        let now = node_processes(&proc, job.pid, var, &doomed_name);
        members.add(&proc, now.iter().copied());
        if gone_at.is_none() && now.is_empty() && members.alive(&proc).is_empty() {
            *gone_at = Some(Timestamp::now());
        }
    };
    let mut v = {
        let mut poll = || watch(&mut job, &mut gone_at, &mut doomed_members);
        notice_phase(
            args,
            emu,
            &dir,
            &state_dir,
            &pidfiles,
            (doomed, shown, started_at),
            &cancel,
            &mut poll,
        )
        .await?
    };

    // 3. The power-off, then --settle.
    let power_off = power_off_instant(&v, kill_after);
    while Instant::now() < power_off && !cancel.is_cancelled() {
        watch(&mut job, &mut gone_at, &mut doomed_members);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    watch(&mut job, &mut gone_at, &mut doomed_members);
    v.power_off_at = Some(Timestamp::now());
    let killed = doomed_members.kill(&proc, libc::SIGKILL);
    let settle_end = Instant::now() + args.settle;
    while Instant::now() < settle_end && !cancel.is_cancelled() {
        job.poll(&proc);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let command_exit = job.run.exit.clone();
    stop_all(std::slice::from_mut(&mut job), &proc).await;

    // 4. One NodeRun per name.
    v.acks = records::read_acks(&dir)
        .into_iter()
        .filter(|a| {
            a.file
                .strip_prefix("ack-")
                .and_then(|r| r.strip_suffix(".json"))
                .and_then(|p| p.parse::<i32>().ok())
                .is_some_and(|p| workers.contains(&p))
        })
        .collect();
    let resumes = records::read_resumes(&dir);
    v.nodes = names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut n = NodeRun::new(i as u32 + 1, job.pid, dir.clone());
            n.label = format!("{var}={name}");
            n.handler = first_seen.get(name).cloned();
            n.resumes = resumes
                .iter()
                .filter(|r| r.node.as_deref() == Some(name.as_str()))
                .cloned()
                .collect();
            if *name == doomed_name {
                n.exited_at = gone_at;
                n.killed_at_power_off = killed;
            } else {
                n.exit = command_exit.clone();
                n.stopped_by_drill = command_exit.is_none();
            }
            n
        })
        .collect();
    er::judge(&mut v, args.timeout, kill_after);
    if args.keep {
        say(format!("  drill dir (kept): {}", work.path().display()));
        let _ = work.keep();
    }
    Ok(v)
}

/// The value of `var` in `pid`'s environment.
fn environ_value(pid: i32, var: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let key = format!("{var}=");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(key.as_bytes()))
        .map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The processes of `root`'s tree that catch the signal, by the value of `var` in their
/// environment.
fn node_workers(
    proc: &ProcFs,
    root: i32,
    var: &str,
) -> std::collections::BTreeMap<String, Vec<i32>> {
    let mut out: std::collections::BTreeMap<String, Vec<i32>> = Default::default();
    for pid in wait::tree(proc, root) {
        if !proc.status(pid).is_ok_and(|s| s.catches(SIGNAL)) {
            continue;
        }
        if let Some(name) = environ_value(pid, var) {
            out.entry(name).or_default().push(pid);
        }
    }
    out
}

/// Every live process of `root`'s tree whose environment has `var=name`.
fn node_processes(proc: &ProcFs, root: i32, var: &str, name: &str) -> Vec<i32> {
    wait::tree(proc, root)
        .into_iter()
        .filter(|&p| wait::alive(proc, p) && environ_value(p, var).as_deref() == Some(name))
        .collect()
}

/// When the power-off comes: `kill_after` after the notice was raised.
fn power_off_instant(v: &ElasticVerdict, kill_after: Duration) -> Instant {
    let since = Timestamp::now().duration_since(v.raised_at).unsigned_abs();
    Instant::now() + kill_after.saturating_sub(since)
}

/// Raise the notice against the processes of `pidfiles` (the interrupted node; its notice dir
/// `dir`) through the real pipeline and follow the plan to its checkpoint result, calling `poll`
/// every 100 ms meanwhile. Shuts the emulator down.
#[allow(clippy::too_many_arguments)]
async fn notice_phase(
    args: &DrillArgs,
    emu: emulator::EmulatorHandle,
    dir: &Path,
    state_dir: &Path,
    pidfiles: &[PathBuf],
    (doomed, shown, started_at): (u32, String, Timestamp),
    cancel: &CancellationToken,
    poll: &mut dyn FnMut(),
) -> Result<ElasticVerdict, String> {
    let run_args = drill_run_args(args, &emu.base_url(), dir, state_dir, pidfiles)?;
    let cfg = Config::resolve(run_args, &config::ProcessEnv).map_err(|e| e.to_string())?;
    let pipeline_cancel = cancel.child_token();
    let app = app::start(cfg, pipeline_cancel.clone())
        .await
        .map_err(|e| format!("starting the pipeline: {e}"))?;
    let mut events = app.events;
    let raised_at = emu
        .raise(emulator::EmulatedNotice::interruption())
        .map_err(|e| format!("raising the notice in the emulator: {e}"))?
        .visible_at;
    let mut v = ElasticVerdict::started(args.cloud, shown, doomed, started_at, raised_at);
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
    // The nodes are watched while the pipeline runs, too.
    let mut timed_out = false;
    {
        tokio::pin!(follow);
        let follow_deadline = tokio::time::sleep(limit);
        tokio::pin!(follow_deadline);
        loop {
            tokio::select! {
                _ = &mut follow => break,
                _ = &mut follow_deadline => {
                    timed_out = true;
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => poll(),
            }
        }
    }
    if timed_out {
        v.error = Some(format!(
            "the agent pipeline did not reach a checkpoint result within {}",
            crate::duration::display(limit)
        ));
    }
    pipeline_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;
    Ok(v)
}

/// Stop every node still running: SIGTERM to its whole process tree (see `Node::members`),
/// SIGKILL 5 s later. Exits seen here are the drill's doing (`stopped_by_drill`), not the node's.
async fn stop_all(nodes: &mut [Node], proc: &ProcFs) {
    for n in nodes.iter_mut() {
        n.poll(proc);
        if n.run.exit.is_none() {
            n.run.stopped_by_drill = true;
        }
        n.kill_tree(proc, libc::SIGTERM);
    }
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end && nodes.iter().any(|n| !n.members.alive(proc).is_empty()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for n in nodes.iter_mut() {
        n.kill_tree(proc, libc::SIGKILL);
        if n.run.exit.is_none() {
            if let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(5), n.child.wait()).await
            {
                n.run.exit = Some(exit_info(status, true));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_are_told_apart_by_an_environment_variable() {
        // Two "hosts" under one launcher (sh), like horovodrun's workers with HOROVOD_HOSTNAME.
        let worker =
            "import signal, time; signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(30)";
        let script = format!(
            "SG_TEST_HOST=a python3 -c '{worker}' & SG_TEST_HOST=b python3 -c '{worker}' & SG_TEST_HOST=b sleep 30 & wait"
        );
        let mut child = std::process::Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .unwrap();
        let root = child.id() as i32;
        let proc = ProcFs::new("/proc");
        let deadline = Instant::now() + Duration::from_secs(60);
        let found = loop {
            let found = node_workers(&proc, root, "SG_TEST_HOST");
            if found.values().map(Vec::len).sum::<usize>() == 2 {
                break found;
            }
            assert!(Instant::now() < deadline, "workers not found: {found:?}");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(found.keys().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(
            environ_value(found["a"][0], "SG_TEST_HOST").as_deref(),
            Some("a")
        );
        // The power-off takes every process of host b (the worker and the plain sleep), not a's.
        let b = node_processes(&proc, root, "SG_TEST_HOST", "b");
        assert_eq!(b.len(), 2, "{b:?}");
        assert!(!b.contains(&found["a"][0]));
        for pid in wait::tree(&proc, root).into_iter().filter(|p| *p != root) {
            // SAFETY: kill(2) of this test's own grandchildren.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
