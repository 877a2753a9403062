//! `spotguard drill --elastic --node-env VAR`: one launcher runs every node (horovodrun). A node
//! is the set of the command's processes that catch the signal with the same value of `VAR` in
//! their environment; the notice goes to the `doomed`-th of them in name order, and the power-off
//! kills every process of the command's tree whose environment has that value.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;

use super::job::{interrupt, keep_work, kill_after, Job, Target};
use super::node::{stop_all, Members, Node};
use super::report::{self as er, ElasticVerdict, NodeRun};
use crate::checkpoint::procfs::ProcFs;
use crate::drill::report::{AckRow, ExitInfo};
use crate::drill::workdir::{self, WorkDir};
use crate::drill::{pipeline, records, say, wait, DrillArgs, SIGNAL, SIGNAL_NAME};

/// Each node's first process seen catching the signal, and when (after the command started), by
/// the node's value of `VAR`.
type FirstSeen = BTreeMap<String, (wait::Handler, Duration)>;

/// Run the drill once against one launcher of every node, telling nodes apart by `var`.
pub async fn drill(
    args: &DrillArgs,
    var: &str,
    doomed: u32,
    cancel: CancellationToken,
) -> Result<ElasticVerdict, String> {
    let work = WorkDir::new(args.notice_dir.as_deref())?;
    let dir = work.notice.clone();
    workdir::create(&dir)?;
    records::clear(&dir);
    let proc = ProcFs::new("/proc");
    let kill_after = kill_after(args);
    let shown = args.command.join(" ");
    announce(args, &shown, var, doomed, kill_after, &dir);
    let emu = pipeline::start_emulator(args.cloud).await?;
    let started_at = Timestamp::now();
    let started = Instant::now();
    let (program, rest) = (&args.command[0], &args.command[1..]);
    let mut job = Node::spawn(1, program, rest, &dir, &[("SPOTGUARD_NODE_ENV", var)])?;

    // 1. Every node trains: its workers catch the signal and wrote resume records, then quiet.
    let first_seen =
        wait_until_every_node_trains(args, var, &mut job, &dir, &proc, started, &cancel).await?;
    let doomed_name = pick_doomed(&first_seen, doomed, &mut job, &proc).await?;
    say_handlers(args, var, &first_seen);

    // 2. The notice, against the interrupted node's workers only (one pidfile each); 3. the
    // power-off, then --settle.
    let workers = node_workers(&proc, job.pid, var)
        .remove(&doomed_name)
        .unwrap_or_default();
    let pidfiles = write_pidfiles(work.path(), &workers)?;
    let mut gone = Doomed::new(var, doomed_name);
    let target = Target {
        doomed,
        dir: dir.clone(),
        pidfiles,
        command: shown,
        started_at,
    };
    let mut launched = Launched {
        job: &mut job,
        gone: &mut gone,
    };
    let mut v = interrupt(args, emu, &work, target, &cancel, &proc, &mut launched).await?;
    let command_exit = job.run.exit.clone();
    stop_all(std::slice::from_mut(&mut job), &proc).await;

    // 4. One NodeRun per name.
    v.acks = workers_acks(&dir, &workers);
    v.nodes = node_runs(var, &first_seen, job.pid, &dir, &gone, command_exit);
    er::judge(&mut v, args.timeout, kill_after);
    keep_work(args, work);
    Ok(v)
}

/// Say what the run rehearses, and where the notice dir is.
fn announce(
    args: &DrillArgs,
    shown: &str,
    var: &str,
    doomed: u32,
    kill_after: Duration,
    dir: &Path,
) {
    say(
        args.json,
        format!(
            "spotguard drill --elastic: `{shown}` as {} nodes told apart by ${var}; {} interruption of the {}th node (in name order) {} after every node trains, its processes killed {} after the notice",
            args.nodes,
            args.cloud.as_str(),
            doomed,
            crate::duration::display(args.after),
            crate::duration::display(kill_after),
        ),
    );
    say(args.json, format!("  SPOTGUARD_DIR={}", dir.display()));
}

/// Wait until every node trains: `--nodes` values of `var` among the processes catching the
/// signal, each with a resume record, and no new record for `--after`. An error when the command
/// ends first, or when `--startup-timeout` passes (after stopping the command).
async fn wait_until_every_node_trains(
    args: &DrillArgs,
    var: &str,
    job: &mut Node,
    dir: &Path,
    proc: &ProcFs,
    started: Instant,
    cancel: &CancellationToken,
) -> Result<FirstSeen, String> {
    let mut first_seen = FirstSeen::new();
    loop {
        if cancel.is_cancelled() {
            stop_all(std::slice::from_mut(job), proc).await;
            return Err("interrupted".into());
        }
        job.poll(proc);
        if let Some(e) = &job.run.exit {
            let what = crate::drill::report::exit_label(e);
            return Err(format!(
                "the command ended before the notice ({what}, {:.1}s after start)",
                started.elapsed().as_secs_f64()
            ));
        }
        note_first_seen(&mut first_seen, proc, job.pid, var, started);
        let resumes = records::read_resumes(dir);
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
            return Ok(first_seen);
        }
        if started.elapsed() >= args.startup_timeout {
            stop_all(std::slice::from_mut(job), proc).await;
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
}

/// Note each node's first process seen catching the signal (`first_seen`), and when.
fn note_first_seen(
    first_seen: &mut FirstSeen,
    proc: &ProcFs,
    root: i32,
    var: &str,
    started: Instant,
) {
    for (name, pids) in node_workers(proc, root, var) {
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
}

/// The interrupted node's name: the `doomed`-th in name order; an error (after stopping the
/// command) when there are fewer nodes.
async fn pick_doomed(
    first_seen: &FirstSeen,
    doomed: u32,
    job: &mut Node,
    proc: &ProcFs,
) -> Result<String, String> {
    let names: Vec<String> = first_seen.keys().cloned().collect();
    let Some(doomed_name) = names.get(doomed as usize - 1).cloned() else {
        stop_all(std::slice::from_mut(job), proc).await;
        return Err(format!(
            "--interrupt-node {doomed}, but only {} nodes: {names:?}",
            names.len()
        ));
    };
    Ok(doomed_name)
}

/// Say which process of each node catches the signal.
fn say_handlers(args: &DrillArgs, var: &str, first_seen: &FirstSeen) {
    for (name, (h, w)) in first_seen {
        say(
            args.json,
            format!(
                "  {var}={name}: pid {} ({}) catches {SIGNAL_NAME}, {:.1}s after start",
                h.pid,
                h.command,
                w.as_secs_f64()
            ),
        );
    }
}

/// One pidfile per worker of the interrupted node, in `work`.
fn write_pidfiles(work: &Path, workers: &[i32]) -> Result<Vec<PathBuf>, String> {
    let mut pidfiles = Vec::new();
    for pid in workers {
        let f = work.join(format!("doomed-{pid}.pid"));
        std::fs::write(&f, format!("{pid}\n")).map_err(|e| format!("writing pidfile: {e}"))?;
        pidfiles.push(f);
    }
    Ok(pidfiles)
}

/// The interrupted node: its processes as seen (they may be orphaned before the power-off), when
/// none was left, and how many the power-off killed.
struct Doomed<'a> {
    var: &'a str,
    name: String,
    members: Members,
    gone_at: Option<Timestamp>,
    killed: usize,
}

impl<'a> Doomed<'a> {
    fn new(var: &'a str, name: String) -> Self {
        Doomed {
            var,
            name,
            members: Members::default(),
            gone_at: None,
            killed: 0,
        }
    }

    /// Record the command's exit, the node's processes, and when the last of them went.
    fn watch(&mut self, job: &mut Node, proc: &ProcFs) {
        job.poll(proc);
        let now = node_processes(proc, job.pid, self.var, &self.name);
        self.members.add(proc, now.iter().copied());
        if self.gone_at.is_none() && now.is_empty() && self.members.alive(proc).is_empty() {
            self.gone_at = Some(Timestamp::now());
        }
    }
}

/// The launcher's job, watched through the interrupted node's processes (`gone`).
struct Launched<'a, 'v> {
    job: &'a mut Node,
    gone: &'a mut Doomed<'v>,
}

impl Job for Launched<'_, '_> {
    fn watch(&mut self, proc: &ProcFs) {
        self.gone.watch(self.job, proc);
    }

    fn kill(&mut self, proc: &ProcFs) {
        self.gone.killed = self.gone.members.kill(proc, libc::SIGKILL);
    }

    fn settle(&mut self, proc: &ProcFs) {
        self.job.poll(proc);
    }
}

/// The acks of the interrupted node's workers (`ack-<pid>.json` of one of `workers`).
fn workers_acks(dir: &Path, workers: &[i32]) -> Vec<AckRow> {
    records::read_acks(dir)
        .into_iter()
        .filter(|a| {
            a.file
                .strip_prefix("ack-")
                .and_then(|r| r.strip_suffix(".json"))
                .and_then(|p| p.parse::<i32>().ok())
                .is_some_and(|p| workers.contains(&p))
        })
        .collect()
}

/// One `NodeRun` per node name: its handler and resume records; the interrupted one's end (when
/// its processes went, how many the power-off killed), the others' the command's exit (or that
/// the drill stopped it).
fn node_runs(
    var: &str,
    first_seen: &FirstSeen,
    pid: i32,
    dir: &Path,
    doomed: &Doomed,
    command_exit: Option<ExitInfo>,
) -> Vec<NodeRun> {
    let resumes = records::read_resumes(dir);
    first_seen
        .iter()
        .enumerate()
        .map(|(i, (name, handler))| {
            let mut n = NodeRun::new(i as u32 + 1, pid, dir.to_path_buf());
            n.label = format!("{var}={name}");
            n.handler = Some(handler.clone());
            n.resumes = resumes
                .iter()
                .filter(|r| r.node.as_deref() == Some(name.as_str()))
                .cloned()
                .collect();
            if *name == doomed.name {
                n.exited_at = doomed.gone_at;
                n.killed_at_power_off = doomed.killed;
            } else {
                n.exit = command_exit.clone();
                n.stopped_by_drill = command_exit.is_none();
            }
            n
        })
        .collect()
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
