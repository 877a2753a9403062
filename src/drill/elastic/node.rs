//! One node of the elastic drill: a copy of the command in its own process group, every process
//! it ever had (torchrun's workers run in sessions of their own), and stopping them all
//! (SIGTERM, SIGKILL [`STOP_GRACE`] later).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::report::NodeRun;
use crate::checkpoint::procfs::ProcFs;
use crate::drill::child::{exit_info, STOP_GRACE};
use crate::drill::wait;

/// How often the drill's helper reports progress (`SPOTGUARD_PROGRESS`, seconds).
const PROGRESS_S: &str = "0.5";

/// One node: a copy of the command in its own process group.
pub struct Node {
    pub index: u32,
    pub dir: PathBuf,
    child: Child,
    pub pid: i32,
    pub run: NodeRun,
    /// Every process seen in the node's tree or process group (pid → start time): torchrun starts
    /// its workers in sessions of their own, and they outlive their agent as orphans, so neither
    /// the process group nor the tree at the time of the kill holds all of them.
    members: Members,
}

/// Processes that belonged to a node (pid → start time, so that a reused pid is never killed).
#[derive(Default)]
pub struct Members(std::collections::HashMap<i32, u64>);

impl Members {
    pub fn add(&mut self, proc: &ProcFs, pids: impl IntoIterator<Item = i32>) {
        for pid in pids {
            if let Ok(st) = proc.stat(pid) {
                self.0.entry(pid).or_insert(st.start_time);
            }
        }
    }

    /// The members still running (same pid, same start time).
    pub fn alive(&self, proc: &ProcFs) -> Vec<i32> {
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
    pub fn kill(&self, proc: &ProcFs, sig: libc::c_int) -> usize {
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
    pub fn spawn(
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
    pub fn poll(&mut self, proc: &ProcFs) {
        self.track(proc);
        self.poll_exit();
    }

    /// Kill the node's whole process tree with `sig`: every process it ever had that still runs
    /// (its workers in their own sessions, orphans included) and its process group; returns how
    /// many processes that was.
    pub fn kill_tree(&mut self, proc: &ProcFs, sig: libc::c_int) -> usize {
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

/// Stop every node still running: SIGTERM to its whole process tree (see `Node::members`),
/// SIGKILL [`STOP_GRACE`] later. Exits seen here are the drill's doing (`stopped_by_drill`), not the node's.
pub async fn stop_all(nodes: &mut [Node], proc: &ProcFs) {
    for n in nodes.iter_mut() {
        n.poll(proc);
        if n.run.exit.is_none() {
            n.run.stopped_by_drill = true;
        }
        n.kill_tree(proc, libc::SIGTERM);
    }
    let end = Instant::now() + STOP_GRACE;
    while Instant::now() < end && nodes.iter().any(|n| !n.members.alive(proc).is_empty()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for n in nodes.iter_mut() {
        n.kill_tree(proc, libc::SIGKILL);
        if n.run.exit.is_none() {
            if let Ok(Ok(status)) = tokio::time::timeout(STOP_GRACE, n.child.wait()).await {
                n.run.exit = Some(exit_info(status, true));
            }
        }
    }
}
