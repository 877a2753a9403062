//! The checkpoint step of the responder (docs/architecture.md, docs/checkpoint-protocol.md): [`deliver`] writes `notice.json`
//! and signals the targets of all groups concurrently; [`wait`] watches acks and exits until each
//! group is finished or its budget ran out. After an agent restart, [`plan_without_signal`]
//! rebuilds what to wait for from fresh discovery without signalling anyone again.
//!
//! **Hang isolation.** All checkpoint work runs on threads of its own (never tokio's blocking pool,
//! which prefetch I/O fills): one delivery thread per group, one file thread per container for the
//! checkpoint dir (`notice.json`), and one watcher thread per group while waiting. Every wait on
//! such a thread has a wall-clock deadline enforced by the caller, outside the blocking call: a
//! checkpoint dir on a hung mount (NFS server gone, FUSE daemon stuck: the thread sits in D state)
//! costs its own container at most [`NOTICE_BUDGET`] before the signal goes out without
//! `notice.json`, and its own group a `timeout` outcome; the stuck thread is abandoned (counted in
//! `spotguard_errors_total{module="checkpoint",error="stuck_thread"}`), never joined, so no other
//! group, the drain or the Azure approval waits for it. [`deliver`] blocks for at most
//! [`DELIVER_BUDGET`]; [`deliver_async`] and [`plan_without_signal_async`] run it on a thread of
//! their own.
//!
//! Per group, the budget is `min(signalled_at + group.timeout, req.checkpoint_deadline)`. A group
//! is finished when every signalled process has a terminal ack (`done`, `skipped`, `failed`)
//! written after the signal, or has exited (after `done`: success; without: `exited`), or the
//! plain `ack` file appeared in its container. "Written after the signal" never compares a file's
//! mtime with the agent's clock: the ack files' stamps are taken just before the signal and an ack
//! counts once its stamp changed; on the restart path an ack counts when it changed no earlier
//! than `notice.json` carrying this notice's id (see [`super::ack::FileStamp`]). Ack latency is
//! measured on the agent's clock, from the signal to when the ack was seen. Group outcome:
//! `failed` if any process failed, else `exited` if any exited without `done`, else `skipped` if
//! any skipped, else `acked`.
//!
//! Dry-run: the processes are checked as for real, nothing is written or signalled, and the result
//! says what would have happened (`no_handler` when nothing catches the signal, else `skipped`
//! with a detail starting `dry-run:`); dry-run outcomes are not counted in the metrics.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio_util::sync::CancellationToken;

use super::ack::{ack_file_name, AckState, CheckpointDir, FileStamp, NoticeFile, PLAIN_ACK_FILE};
use super::procfs::{clock_ticks_per_second, ProcFs};
use super::signal::{self, NotSignalled, Prepared};
use super::{Outcome, PodRef, Signal, TargetContainer, TargetGroup, TargetMode};
use crate::metrics::{Metrics, ModuleErrorLabels, OutcomeLabels};

/// How often acks and exits are polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long a container's checkpoint dir may take to open and take `notice.json` before its
/// processes are signalled without it.
pub const NOTICE_BUDGET: Duration = Duration::from_secs(1);
/// How long [`deliver`] waits for a group's delivery thread (procfs checks, pidfds, signals)
/// before reporting the group as `error` and abandoning the thread.
pub const DELIVER_BUDGET: Duration = Duration::from_secs(3);
/// How long past its budget a group's watcher may take to report before it is abandoned.
pub const WATCH_GRACE: Duration = Duration::from_millis(500);
/// Restart path: a process that started this long after the signal was not signalled.
const START_SLACK: Duration = Duration::from_secs(2);

const MODULE: &str = "checkpoint";

/// Spawn a named checkpoint thread; `None` (logged, counted) when the system has no thread left.
fn spawn_thread<F>(name: &str, counters: &Counters, f: F) -> bool
where
    F: FnOnce() + Send + 'static,
{
    match std::thread::Builder::new().name(name.into()).spawn(f) {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(thread = name, error = %e, "cannot start a checkpoint thread");
            counters.error("thread_spawn");
            false
        }
    }
}

/// Metric handles a detached thread can own (the registry's counters are shared handles).
#[derive(Clone)]
struct Counters {
    signals_sent: Counter,
    errors: Family<ModuleErrorLabels, Counter>,
    enabled: bool,
}

impl Counters {
    fn of(m: &Metrics) -> Self {
        Counters {
            signals_sent: m.signals_sent.clone(),
            errors: m.errors.clone(),
            enabled: true,
        }
    }

    /// The restart path counts nothing (nothing is sent).
    fn none() -> Self {
        Counters {
            signals_sent: Counter::default(),
            errors: Family::default(),
            enabled: false,
        }
    }

    fn signal_sent(&self) {
        if self.enabled {
            self.signals_sent.inc();
        }
    }

    fn error(&self, label: &str) {
        if self.enabled {
            self.errors
                .get_or_create(&ModuleErrorLabels {
                    module: MODULE.to_string(),
                    error: label.to_string(),
                })
                .inc();
        }
    }
}

/// Count a thread left behind in a blocking call.
fn count_stuck(errors: &Family<ModuleErrorLabels, Counter>) {
    errors
        .get_or_create(&ModuleErrorLabels {
            module: MODULE.to_string(),
            error: "stuck_thread".to_string(),
        })
        .inc();
}

/// What to checkpoint for (one notice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRequest {
    pub notice_id: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// The notice's deadline (`None`: the cloud gave none).
    pub deadline: Option<Timestamp>,
    /// `deadline − drain-reserve`, capped by `now + --checkpoint-timeout`: no group waits longer.
    pub checkpoint_deadline: Timestamp,
    pub dry_run: bool,
}

impl CheckpointRequest {
    fn notice(&self, signal: Signal) -> NoticeFile {
        NoticeFile {
            notice_id: self.notice_id.clone(),
            source: self.source.clone(),
            kind: self.kind.clone(),
            deadline_unix: self.deadline.map(|d| d.as_second()),
            checkpoint_deadline_unix: self.checkpoint_deadline.as_second(),
            signal: signal.name(),
        }
    }
}

/// A process that was signalled (or, on the restart path, is assumed to have been).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignalledProcess {
    /// Host PID.
    pub pid: i32,
    /// PID as the process sees it (names its `ack-<ns_pid>.json`).
    pub ns_pid: i32,
    pub start_time: u64,
    pub signalled_at: Timestamp,
}

/// A discovered process that was not signalled, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedProcess {
    pub pid: i32,
    pub reason: NotSignalled,
}

/// What happened to `notice.json` in one container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoticeStatus {
    Written,
    /// Nothing to signal in this container, so nothing written.
    NotNeeded,
    /// Restart path: the notice was written before the restart.
    AlreadyWritten,
    DryRun,
    Failed(String),
}

/// Delivery to one container (or host selector).
#[derive(Debug)]
pub struct ContainerDelivery {
    pub name: String,
    pub root_pid: Option<i32>,
    pub signalled: Vec<SignalledProcess>,
    /// Dry-run: the host PIDs that would have been signalled.
    pub would_signal: Vec<i32>,
    pub skipped: Vec<SkippedProcess>,
    pub notice: NoticeStatus,
    /// A container-level problem (no init process for `pid1`, root not openable).
    pub error: Option<String>,
    dir: DirSlot,
}

/// The checkpoint dir of a container as delivery left it.
#[derive(Debug)]
enum DirSlot {
    /// Open, with the stamps taken before the signal (or the restart path's anchor).
    Ready(CheckpointDir, Freshness),
    /// Its file thread did not answer within [`NOTICE_BUDGET`]; picked up by the watcher if it
    /// ever does.
    Late(mpsc::Receiver<FileJob>),
    None,
}

/// What a container's file thread produced.
type FileJob = (Result<CheckpointDir, super::Error>, Freshness, NoticeStatus);

/// How an ack is judged "written after the signal" (see [`super::ack::FileStamp`]).
#[derive(Clone, Debug, Default)]
struct Freshness {
    /// Stamps of the ack files just before the signal (absent: did not exist).
    baseline: HashMap<String, FileStamp>,
    /// Restart path: `notice.json` of this notice; acks count when they changed no earlier.
    anchor: Option<FileStamp>,
}

impl Freshness {
    fn fresh(&self, name: &str, stamp: &FileStamp) -> bool {
        match &self.anchor {
            Some(a) => stamp.ctime >= a.ctime,
            None => self.baseline.get(name) != Some(stamp),
        }
    }
}

/// Where a group stands after [`deliver`] / [`plan_without_signal`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeliveryState {
    /// At least one process was signalled: wait for it.
    Signalled,
    /// No process catches the signal (or the selector matched none): nothing sent.
    NoHandler,
    /// Every target exited before it could be signalled.
    Gone,
    /// Signalling failed for every target.
    Error(String),
    DryRun,
}

impl DeliveryState {
    /// For logs.
    pub fn label(&self) -> &'static str {
        match self {
            DeliveryState::Signalled => "signalled",
            DeliveryState::NoHandler => "no_handler",
            DeliveryState::Gone => "gone",
            DeliveryState::Error(_) => "error",
            DeliveryState::DryRun => "dry_run",
        }
    }
}

/// Delivery to one group.
#[derive(Debug)]
pub struct Delivery {
    pub group: String,
    pub pod: Option<PodRef>,
    /// Checkpoint dir as the processes see it.
    pub dir: PathBuf,
    pub signal: Signal,
    pub timeout: Duration,
    pub state: DeliveryState,
    /// When the first process of the group was signalled.
    pub signalled_at: Option<Timestamp>,
    pub containers: Vec<ContainerDelivery>,
    proc: ProcFs,
}

impl Delivery {
    /// Number of processes signalled.
    pub fn signalled(&self) -> usize {
        self.containers.iter().map(|c| c.signalled.len()).sum()
    }

    /// Host PIDs signalled.
    pub fn signalled_pids(&self) -> Vec<i32> {
        self.containers
            .iter()
            .flat_map(|c| c.signalled.iter().map(|p| p.pid))
            .collect()
    }
}

/// The outcome of one group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupResult {
    pub group: String,
    pub pod: Option<PodRef>,
    pub outcome: Outcome,
    pub signalled: usize,
    pub signalled_at: Option<Timestamp>,
    /// Signal → last terminal ack, for `acked`, `skipped` and `failed`.
    pub ack_latency: Option<Duration>,
    /// One line for logs and Events: per process state, step and checkpoint, or why not.
    pub detail: String,
}

/// Write `notice.json` into every target container and signal every target of every group. Groups
/// run concurrently, one thread each: a group is signalled as soon as its own notices are written
/// (or [`NOTICE_BUDGET`] ran out on a dir that does not answer), so a slow or hung checkpoint
/// filesystem in one pod never delays another pod's signal. Blocks for at most
/// [`DELIVER_BUDGET`]; a group whose thread has not finished by then is reported as an error and
/// its thread abandoned.
pub fn deliver(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    metrics: &Metrics,
) -> Vec<Delivery> {
    run_groups(groups, req, Counters::of(metrics), Mode::Deliver)
}

/// [`deliver`] on a thread of its own: for async callers (the responder), which must not queue
/// the signal behind tokio's blocking pool.
pub async fn deliver_async(
    groups: Vec<TargetGroup>,
    req: CheckpointRequest,
    metrics: &Metrics,
) -> Vec<Delivery> {
    let counters = Counters::of(metrics);
    off_pool(groups.clone(), move |g| {
        run_groups(&g, &req, counters, Mode::Deliver)
    })
    .await
    .unwrap_or_else(|| failed_all(&groups, "no thread for checkpoint delivery"))
}

/// After an agent restart: rebuild the deliveries from fresh discovery as if the processes had been
/// signalled at `signalled_at` (same target filter; processes started after it are left out).
/// Never writes and never signals. Blocks for at most [`DELIVER_BUDGET`].
pub fn plan_without_signal(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    signalled_at: Timestamp,
) -> Vec<Delivery> {
    run_groups(groups, req, Counters::none(), Mode::Replan { signalled_at })
}

/// [`plan_without_signal`] on a thread of its own.
pub async fn plan_without_signal_async(
    groups: Vec<TargetGroup>,
    req: CheckpointRequest,
    signalled_at: Timestamp,
) -> Vec<Delivery> {
    off_pool(groups.clone(), move |g| {
        plan_without_signal(&g, &req, signalled_at)
    })
    .await
    .unwrap_or_else(|| failed_all(&groups, "no thread for checkpoint planning"))
}

/// Run `f(groups)` on a dedicated thread and await it (`None`: no thread could be started).
async fn off_pool<F>(groups: Vec<TargetGroup>, f: F) -> Option<Vec<Delivery>>
where
    F: FnOnce(Vec<TargetGroup>) -> Vec<Delivery> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sg-ckpt".into())
        .spawn(move || {
            let _ = tx.send(f(groups));
        })
        .ok()?;
    rx.await.ok()
}

fn failed_all(groups: &[TargetGroup], why: &str) -> Vec<Delivery> {
    tracing::error!(reason = why, "checkpoint delivery could not run");
    groups
        .iter()
        .map(|g| failed_delivery(g, why.to_string()))
        .collect()
}

fn failed_delivery(g: &TargetGroup, why: String) -> Delivery {
    Delivery {
        group: g.name.clone(),
        pod: g.pod.clone(),
        dir: g.dir.clone(),
        signal: g.signal,
        timeout: g.timeout,
        state: DeliveryState::Error(why),
        signalled_at: None,
        containers: Vec::new(),
        proc: ProcFs::new(g.proc_root.clone()),
    }
}

/// One thread per group; wait for each until a shared wall-clock deadline, abandoning the late.
fn run_groups(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    counters: Counters,
    mode: Mode,
) -> Vec<Delivery> {
    let deadline = Instant::now() + DELIVER_BUDGET;
    let pending: Vec<Option<mpsc::Receiver<Delivery>>> = groups
        .iter()
        .map(|g| {
            let (tx, rx) = mpsc::channel();
            let (g2, req2, c2) = (g.clone(), req.clone(), counters.clone());
            let started = spawn_thread("sg-ckpt-deliver", &counters, move || {
                let proc = ProcFs::new(g2.proc_root.clone());
                let staged = stage_group(&proc, &g2, &req2, &c2, mode);
                let _ = tx.send(signal_group(staged, &req2, &c2, mode, proc));
            });
            started.then_some(rx)
        })
        .collect();
    groups
        .iter()
        .zip(pending)
        .map(|(g, rx)| {
            let Some(rx) = rx else {
                return failed_delivery(g, "no thread for this group's delivery".into());
            };
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(d) => d,
                Err(RecvTimeoutError::Timeout) => {
                    let budget_ms = DELIVER_BUDGET.as_millis() as u64;
                    tracing::error!(group = %g.name, budget_ms, "checkpoint delivery thread stuck; abandoned");
                    count_stuck(&counters.errors);
                    failed_delivery(
                        g,
                        format!("delivery did not finish within {budget_ms} ms (stuck in /proc or a filesystem); abandoned"),
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    tracing::error!(group = %g.name, "checkpoint delivery thread panicked");
                    counters.error("panic");
                    failed_delivery(g, "delivery thread panicked".into())
                }
            }
        })
        .collect()
}

/// A group whose targets are checked and pinned and whose notices are written.
struct Staged<'g> {
    group: &'g TargetGroup,
    containers: Vec<(ContainerDelivery, Vec<Prepared>)>,
}

#[derive(Clone, Copy)]
enum Mode {
    Deliver,
    Replan { signalled_at: Timestamp },
}

/// The processes of a container to consider, by target mode.
fn candidates(c: &TargetContainer, mode: TargetMode) -> Result<Vec<&super::TargetProcess>, String> {
    match mode {
        TargetMode::Handlers | TargetMode::All => Ok(c.processes.iter().collect()),
        TargetMode::Pid1 => {
            let init = c.init_pid.ok_or_else(|| {
                "target pid1: the container's init process is unknown".to_string()
            })?;
            c.processes
                .iter()
                .find(|p| p.pid == init)
                .map(|p| vec![p])
                .ok_or_else(|| {
                    format!(
                        "target pid1: init process {init} is not among the container's processes"
                    )
                })
        }
    }
}

/// Open the container's checkpoint dir: inside `/proc/<pid>/root` of the root process (or, if it
/// is gone, of another verified process of the container), or on the host.
fn open_dir(
    proc: &ProcFs,
    dir: &std::path::Path,
    c_root: Option<i32>,
    tries: &[(i32, u64)],
) -> Result<CheckpointDir, super::Error> {
    let Some(root_pid) = c_root else {
        return CheckpointDir::host(dir);
    };
    let mut last = None;
    for (pid, start) in tries {
        match CheckpointDir::in_root_of(proc, *pid, *start, dir) {
            Ok(d) => return Ok(d),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| super::Error::ReadAck {
        target: format!("{} in /proc/{root_pid}/root", dir.display()),
        source: std::io::Error::other("root process is not among the container's processes"),
    }))
}

fn group_span(req: &CheckpointRequest, group: &str) -> tracing::Span {
    tracing::info_span!(
        "checkpoint",
        notice_id = %req.notice_id,
        source = %req.source,
        pod = %group
    )
}

/// The file side of one container, on a thread of its own: open the dir, stamp the acks that
/// already exist, write `notice.json` (deliver) or find the anchor (restart path).
struct FileTask {
    proc: ProcFs,
    dir: PathBuf,
    root: Option<i32>,
    /// `(pid, start time)` whose root may be used, in order.
    tries: Vec<(i32, u64)>,
    /// Ack file names to stamp.
    names: Vec<String>,
    notice: NoticeFile,
    mode: Mode,
    dry_run: bool,
    counters: Counters,
}

fn file_job(t: FileTask) -> FileJob {
    let FileTask {
        proc,
        dir,
        root,
        tries,
        names,
        notice,
        mode,
        dry_run,
        counters,
    } = t;
    let opened = open_dir(&proc, &dir, root, &tries);
    let mut fresh = Freshness::default();
    let status = match &opened {
        Err(e) => {
            counters.error(e.metric_label());
            NoticeStatus::Failed(e.to_string())
        }
        Ok(d) => match mode {
            Mode::Replan { .. } => {
                match d.read_notice_stamped() {
                    Ok(Some((n, stamp))) if n.notice_id == notice.notice_id => {
                        fresh.anchor = Some(stamp)
                    }
                    _ => fresh.baseline = d.stamps(&names),
                }
                NoticeStatus::AlreadyWritten
            }
            Mode::Deliver if dry_run => NoticeStatus::DryRun,
            Mode::Deliver => {
                fresh.baseline = d.stamps(&names);
                match d.write_notice(&notice) {
                    Ok(()) => NoticeStatus::Written,
                    Err(e) => {
                        counters.error(e.metric_label());
                        NoticeStatus::Failed(e.to_string())
                    }
                }
            }
        },
    };
    (opened, fresh, status)
}

/// Phase 1 for one group: check and pin the targets, write the notices (each container's on its
/// own file thread, waited for at most [`NOTICE_BUDGET`] in all).
fn stage_group<'g>(
    proc: &ProcFs,
    group: &'g TargetGroup,
    req: &CheckpointRequest,
    counters: &Counters,
    mode: Mode,
) -> Staged<'g> {
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let notice = req.notice(group.signal);
    let require_handler = group.mode == TargetMode::Handlers;
    let boot = match mode {
        Mode::Replan { .. } => proc.boot_time().ok(),
        Mode::Deliver => None,
    };

    let mut staged: Vec<(ContainerDelivery, Vec<Prepared>)> = Vec::new();
    let mut jobs: Vec<Option<mpsc::Receiver<FileJob>>> = Vec::new();
    for c in &group.containers {
        let mut cd = ContainerDelivery {
            name: c.name.clone(),
            root_pid: c.root_pid,
            signalled: Vec::new(),
            would_signal: Vec::new(),
            skipped: Vec::new(),
            notice: NoticeStatus::NotNeeded,
            error: None,
            dir: DirSlot::None,
        };
        let mut prepared = Vec::new();
        match candidates(c, group.mode) {
            Ok(targets) => {
                for t in targets {
                    match signal::prepare(proc, t, group.signal, require_handler) {
                        Ok(p) => prepared.push(p),
                        Err(reason) => {
                            if let NotSignalled::Failed(e) = &reason {
                                tracing::warn!(pid = t.pid, error = %e, "cannot check checkpoint target");
                                counters.error("prepare");
                            }
                            cd.skipped.push(SkippedProcess { pid: t.pid, reason });
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(container = %c.name, error = %e, "no checkpoint target");
                cd.error = Some(e);
            }
        }
        if let Mode::Replan { signalled_at } = mode {
            prepared.retain(|p| {
                let late = started_after(p, signalled_at, boot);
                if late {
                    cd.skipped.push(SkippedProcess {
                        pid: p.pid,
                        reason: NotSignalled::StartedAfterSignal,
                    });
                }
                !late
            });
        }
        let job = if prepared.is_empty() {
            None
        } else {
            let mut tries: Vec<(i32, u64)> = c
                .processes
                .iter()
                .filter(|p| Some(p.pid) == c.root_pid)
                .map(|p| (p.pid, p.start_time))
                .collect();
            tries.extend(prepared.iter().map(|p| (p.pid, p.start_time)));
            let mut names: Vec<String> = prepared.iter().map(|p| ack_file_name(p.ns_pid)).collect();
            names.push(PLAIN_ACK_FILE.to_string());
            let (tx, rx) = mpsc::channel();
            let task = FileTask {
                proc: proc.clone(),
                dir: group.dir.clone(),
                root: c.root_pid,
                tries,
                names,
                notice: notice.clone(),
                mode,
                dry_run: req.dry_run,
                counters: counters.clone(),
            };
            let started = spawn_thread("sg-ckpt-file", counters, move || {
                let _ = tx.send(file_job(task));
            });
            if started {
                Some(rx)
            } else {
                cd.notice = NoticeStatus::Failed("no thread for the checkpoint dir".into());
                None
            }
        };
        jobs.push(job);
        staged.push((cd, prepared));
    }

    // Collect the file threads against one deadline; a dir that does not answer in time is left
    // to the watcher, and its processes are signalled without notice.json.
    let deadline = Instant::now() + NOTICE_BUDGET;
    for ((cd, _), job) in staged.iter_mut().zip(jobs) {
        let Some(rx) = job else { continue };
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((Ok(dir), fresh, status)) => {
                match &status {
                    NoticeStatus::DryRun => {
                        tracing::info!(dir = %dir.display(), notice_id = %notice.notice_id, "dry-run: would write notice.json")
                    }
                    NoticeStatus::Failed(e) => {
                        tracing::warn!(container = %cd.name, error = %e, "cannot write notice.json; signalling anyway")
                    }
                    _ => {}
                }
                cd.notice = status;
                cd.dir = DirSlot::Ready(dir, fresh);
            }
            Ok((Err(e), _, status)) => {
                tracing::warn!(container = %cd.name, error = %e, "cannot open the checkpoint dir; signalling anyway");
                cd.notice = status;
            }
            Err(RecvTimeoutError::Timeout) => {
                let budget_ms = NOTICE_BUDGET.as_millis() as u64;
                tracing::warn!(container = %cd.name, dir = %group.dir.display(), budget_ms, "checkpoint dir does not answer (hung filesystem?); signalling without notice.json");
                counters.error("dir_timeout");
                count_stuck(&counters.errors);
                cd.notice = NoticeStatus::Failed(format!(
                    "checkpoint dir did not answer within {budget_ms} ms (hung filesystem?)"
                ));
                cd.dir = DirSlot::Late(rx);
            }
            Err(RecvTimeoutError::Disconnected) => {
                counters.error("panic");
                cd.notice = NoticeStatus::Failed("checkpoint dir thread panicked".into());
            }
        }
    }
    Staged {
        group,
        containers: staged,
    }
}

/// Phase 2 for one group: signal everything that was pinned.
fn signal_group(
    staged: Staged<'_>,
    req: &CheckpointRequest,
    counters: &Counters,
    mode: Mode,
    proc: ProcFs,
) -> Delivery {
    let group = staged.group;
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let mut first_signal = None;
    let mut containers = Vec::with_capacity(staged.containers.len());
    for (mut cd, prepared) in staged.containers {
        for p in prepared {
            match mode {
                Mode::Replan { signalled_at } => {
                    first_signal.get_or_insert(signalled_at);
                    cd.signalled.push(signalled(&p, signalled_at));
                }
                Mode::Deliver if req.dry_run => cd.would_signal.push(p.pid),
                Mode::Deliver => {
                    let at = Timestamp::now();
                    match signal::send(&p, group.signal) {
                        Ok(()) => {
                            counters.signal_sent();
                            first_signal.get_or_insert(at);
                            cd.signalled.push(signalled(&p, at));
                        }
                        Err(e) => {
                            let reason = signal::send_failure(&e);
                            if matches!(reason, NotSignalled::Failed(_)) {
                                tracing::warn!(pid = p.pid, error = %e, "checkpoint signal failed");
                                counters.error(e.metric_label());
                            }
                            cd.skipped.push(SkippedProcess { pid: p.pid, reason });
                        }
                    }
                }
            }
        }
        containers.push(cd);
    }

    let state = delivery_state(req.dry_run && matches!(mode, Mode::Deliver), &containers);
    let pids = |c: &[ContainerDelivery]| {
        c.iter()
            .flat_map(|c| c.signalled.iter().map(|p| p.pid.to_string()))
            .collect::<Vec<_>>()
            .join(",")
    };
    match &state {
        DeliveryState::Signalled if matches!(mode, Mode::Deliver) => tracing::info!(
            signal = %group.signal,
            pids = %pids(&containers),
            "checkpoint signal sent"
        ),
        DeliveryState::Signalled => tracing::info!(
            pids = %pids(&containers),
            "resuming the wait for acks of processes signalled before the restart"
        ),
        DeliveryState::DryRun => tracing::info!(
            signal = %group.signal,
            pids = %containers.iter().flat_map(|c| c.would_signal.iter().map(|p| p.to_string())).collect::<Vec<_>>().join(","),
            "dry-run: would send the checkpoint signal"
        ),
        other => tracing::info!(state = other.label(), "no checkpoint signal sent"),
    }
    Delivery {
        group: group.name.clone(),
        pod: group.pod.clone(),
        dir: group.dir.clone(),
        signal: group.signal,
        timeout: group.timeout,
        state,
        signalled_at: first_signal,
        containers,
        proc,
    }
}

fn signalled(p: &Prepared, at: Timestamp) -> SignalledProcess {
    SignalledProcess {
        pid: p.pid,
        ns_pid: p.ns_pid,
        start_time: p.start_time,
        signalled_at: at,
    }
}

/// Whether a process started after `signalled_at` (+ slack), from its start ticks and boot time.
fn started_after(p: &Prepared, signalled_at: Timestamp, boot: Option<i64>) -> bool {
    let Some(boot) = boot else {
        return false;
    };
    let ticks = clock_ticks_per_second();
    let started_ms = boot.saturating_mul(1000).saturating_add(
        i64::try_from(p.start_time.saturating_mul(1000) / ticks).unwrap_or(i64::MAX),
    );
    let limit =
        signalled_at.as_millisecond() + i64::try_from(START_SLACK.as_millis()).unwrap_or(i64::MAX);
    started_ms > limit
}

fn delivery_state(dry_run: bool, containers: &[ContainerDelivery]) -> DeliveryState {
    if dry_run {
        return DeliveryState::DryRun;
    }
    if containers.iter().any(|c| !c.signalled.is_empty()) {
        return DeliveryState::Signalled;
    }
    let skipped = || containers.iter().flat_map(|c| c.skipped.iter());
    let errors: Vec<String> = containers
        .iter()
        .filter_map(|c| c.error.clone())
        .chain(skipped().filter_map(|s| match &s.reason {
            NotSignalled::Failed(e) => Some(format!("pid {}: {e}", s.pid)),
            _ => None,
        }))
        .collect();
    if !errors.is_empty() {
        return DeliveryState::Error(errors.join("; "));
    }
    let all_gone = skipped().next().is_some()
        && skipped().all(|s| {
            matches!(
                s.reason,
                NotSignalled::Gone
                    | NotSignalled::Recycled { .. }
                    | NotSignalled::StartedAfterSignal
            )
        });
    if all_gone {
        DeliveryState::Gone
    } else {
        DeliveryState::NoHandler
    }
}

// === wait ===

/// What is known about one signalled process.
#[derive(Clone, Debug, PartialEq)]
enum ProcState {
    Pending {
        /// When a `received` ack was first seen (agent clock).
        received: Option<Timestamp>,
    },
    Acked {
        state: AckState,
        /// When the terminal ack was first seen (agent clock).
        at: Timestamp,
        note: String,
    },
    Exited {
        at: Timestamp,
    },
}

#[derive(Debug)]
struct ProcWatch {
    process: SignalledProcess,
    state: ProcState,
    /// Last unreadable-ack problem, for the detail.
    problem: Option<String>,
}

#[derive(Debug)]
struct ContainerWatch {
    name: String,
    dir: DirSlot,
    /// When the plain `ack` was first seen (agent clock).
    plain_ack: Option<Timestamp>,
    procs: Vec<ProcWatch>,
}

impl ContainerWatch {
    fn finished(&self) -> bool {
        self.plain_ack.is_some()
            || self
                .procs
                .iter()
                .all(|p| !matches!(p.state, ProcState::Pending { .. }))
    }
}

#[derive(Debug)]
struct GroupWatch {
    group: String,
    pod: Option<PodRef>,
    signalled_at: Timestamp,
    deadline: Timestamp,
    containers: Vec<ContainerWatch>,
    notice_problems: Vec<String>,
    result: Option<GroupResult>,
    proc: ProcFs,
}

/// Wait for every delivery to finish (acks, exits, plain ack) or run out of budget; one result per
/// delivery, in order. Each group is watched by a thread of its own; its budget is enforced here,
/// so a watcher stuck in a hung filesystem ends its group with `timeout` (the thread is abandoned
/// and counted) while every other group goes on. Counts `spotguard_checkpoint_total{outcome}` and
/// the ack-latency histogram as each group finishes. On `cancel` (agent shutting down, or the
/// deadline moved earlier) unfinished groups end with `error` ("cancelled"), uncounted.
pub async fn wait(
    deliveries: Vec<Delivery>,
    req: &CheckpointRequest,
    metrics: &Metrics,
    cancel: &CancellationToken,
) -> Vec<GroupResult> {
    use futures::stream::{FuturesUnordered, StreamExt};
    let mut results: Vec<Option<GroupResult>> = Vec::with_capacity(deliveries.len());
    let mut running = FuturesUnordered::new();
    for (i, d) in deliveries.into_iter().enumerate() {
        let mut w = watch(d, req);
        match w.result.take() {
            Some(r) => {
                record(&r, req, metrics);
                results.push(Some(r));
            }
            None => {
                results.push(None);
                running.push(watch_group(i, w, cancel.clone(), metrics.errors.clone()));
            }
        }
    }
    while let Some((i, r, count)) = running.next().await {
        if count {
            record(&r, req, metrics);
        }
        if let Some(slot) = results.get_mut(i) {
            *slot = Some(r);
        }
    }
    results.into_iter().flatten().collect()
}

/// Watch one group on its own thread; the budget (plus [`WATCH_GRACE`]) and `cancel` are enforced
/// here. Returns the group's index, its result and whether to count it.
async fn watch_group(
    i: usize,
    mut w: GroupWatch,
    cancel: CancellationToken,
    errors: Family<ModuleErrorLabels, Counter>,
) -> (usize, GroupResult, bool) {
    let until_deadline = Duration::try_from(
        w.deadline
            .duration_since(Timestamp::now())
            .max(SignedDuration::ZERO),
    )
    .unwrap_or_default();
    let give_up = tokio::time::Instant::now() + until_deadline + WATCH_GRACE;
    let budget_s = w.deadline.duration_since(w.signalled_at).as_secs_f64();
    let detail = Arc::new(Mutex::new(pending_detail(&w)));
    let stop = Arc::new(AtomicBool::new(false));
    let base = GroupResult {
        group: w.group.clone(),
        pod: w.pod.clone(),
        outcome: Outcome::Error,
        signalled: w.containers.iter().map(|c| c.procs.len()).sum(),
        signalled_at: Some(w.signalled_at),
        ack_latency: None,
        detail: String::new(),
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (d2, s2) = (detail.clone(), stop.clone());
    let spawned = std::thread::Builder::new()
        .name("sg-ckpt-watch".into())
        .spawn(move || loop {
            poll_group(&mut w, Timestamp::now());
            if let Some(r) = w.result.take() {
                let _ = tx.send(r);
                return;
            }
            let text = pending_detail(&w);
            if let Ok(mut g) = d2.lock() {
                *g = text;
            }
            if s2.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(POLL_INTERVAL);
        });
    if let Err(e) = spawned {
        tracing::error!(group = %base.group, error = %e, "cannot start a checkpoint watcher thread");
        return (
            i,
            GroupResult {
                detail: format!("no thread to watch this group: {e}"),
                ..base
            },
            true,
        );
    }
    let last = |detail: &Arc<Mutex<String>>| detail.lock().map(|g| g.clone()).unwrap_or_default();
    tokio::select! {
        r = rx => match r {
            Ok(r) => (i, r, true),
            Err(_) => {
                tracing::error!(group = %base.group, "checkpoint watcher thread panicked");
                (i, GroupResult { detail: "watcher thread panicked".into(), ..base }, true)
            }
        },
        _ = tokio::time::sleep_until(give_up) => {
            stop.store(true, Ordering::Relaxed);
            count_stuck(&errors);
            tracing::error!(group = %base.group, budget_s, "checkpoint watcher stuck past the budget (hung filesystem?); abandoned");
            let detail = format!(
                "no terminal ack within {budget_s:.1}s, and the watcher is stuck in a filesystem or /proc call (hung mount?): {}",
                last(&detail)
            );
            (i, GroupResult { outcome: Outcome::Timeout, detail, ..base }, true)
        }
        _ = cancel.cancelled() => {
            stop.store(true, Ordering::Relaxed);
            let detail = format!(
                "cancelled (agent shutting down) while waiting: {}",
                last(&detail)
            );
            (i, GroupResult { detail, ..base }, false)
        }
    }
}

fn record(r: &GroupResult, req: &CheckpointRequest, metrics: &Metrics) {
    let span = tracing::info_span!(
        "checkpoint",
        notice_id = %req.notice_id,
        source = %req.source,
        pod = %r.group
    );
    let _enter = span.enter();
    if req.dry_run {
        tracing::info!(outcome = r.outcome.as_str(), detail = %r.detail, "checkpoint (dry-run)");
        return;
    }
    metrics
        .checkpoint
        .get_or_create(&OutcomeLabels {
            outcome: r.outcome.as_str().to_string(),
        })
        .inc();
    if let Some(l) = r.ack_latency {
        metrics.ack_latency.observe(l.as_secs_f64());
    }
    match r.outcome {
        Outcome::Acked => {
            tracing::info!(outcome = "acked", ack_ms = r.ack_latency.map(|d| d.as_millis() as u64).unwrap_or(0), detail = %r.detail, "checkpoint finished")
        }
        o => tracing::warn!(outcome = o.as_str(), detail = %r.detail, "checkpoint finished"),
    }
}

/// Turn a delivery into a watch; deliveries with nothing to wait for get their result at once.
fn watch(d: Delivery, req: &CheckpointRequest) -> GroupWatch {
    let signalled = d.signalled();
    let signalled_at = d.signalled_at.unwrap_or_else(Timestamp::now);
    let budget_end = signalled_at
        .checked_add(d.timeout)
        .unwrap_or(Timestamp::MAX)
        .min(req.checkpoint_deadline);
    let notice_problems: Vec<String> = d
        .containers
        .iter()
        .filter_map(|c| match &c.notice {
            NoticeStatus::Failed(e) => Some(format!("{}: notice.json not written: {e}", c.name)),
            _ => None,
        })
        .collect();
    let immediate = |outcome: Outcome, detail: String| GroupResult {
        group: d.group.clone(),
        pod: d.pod.clone(),
        outcome,
        signalled,
        signalled_at: d.signalled_at,
        ack_latency: None,
        detail,
    };
    let result = match &d.state {
        DeliveryState::Signalled => None,
        DeliveryState::NoHandler => Some(immediate(
            Outcome::NoHandler,
            format!(
                "no process catches {}{}",
                d.signal,
                skipped_detail(&d.containers)
                    .map(|s| format!(": {s}"))
                    .unwrap_or_else(|| ": no process matched".into())
            ),
        )),
        DeliveryState::Gone => Some(immediate(
            Outcome::Exited,
            format!(
                "every target exited before the signal: {}",
                skipped_detail(&d.containers).unwrap_or_default()
            ),
        )),
        DeliveryState::Error(e) => Some(immediate(Outcome::Error, e.clone())),
        DeliveryState::DryRun => {
            let pids: Vec<i32> = d
                .containers
                .iter()
                .flat_map(|c| c.would_signal.iter().copied())
                .collect();
            if pids.is_empty() {
                Some(immediate(
                    Outcome::NoHandler,
                    format!(
                        "dry-run: no process catches {}{}",
                        d.signal,
                        skipped_detail(&d.containers)
                            .map(|s| format!(": {s}"))
                            .unwrap_or_default()
                    ),
                ))
            } else {
                Some(immediate(
                    Outcome::Skipped,
                    format!(
                        "dry-run: would write {} and send {} to pids {pids:?}",
                        d.dir.join(super::ack::NOTICE_FILE).display(),
                        d.signal
                    ),
                ))
            }
        }
    };
    GroupWatch {
        group: d.group,
        pod: d.pod,
        signalled_at,
        deadline: budget_end,
        containers: d
            .containers
            .into_iter()
            .filter(|c| !c.signalled.is_empty())
            .map(|c| ContainerWatch {
                name: c.name,
                dir: c.dir,
                plain_ack: None,
                procs: c
                    .signalled
                    .into_iter()
                    .map(|process| ProcWatch {
                        process,
                        state: ProcState::Pending { received: None },
                        problem: None,
                    })
                    .collect(),
            })
            .collect(),
        notice_problems,
        result,
        proc: d.proc,
    }
}

fn skipped_detail(containers: &[ContainerDelivery]) -> Option<String> {
    let parts: Vec<String> = containers
        .iter()
        .flat_map(|c| {
            c.skipped
                .iter()
                .map(|s| format!("pid {} {}", s.pid, s.reason))
        })
        .chain(containers.iter().filter_map(|c| c.error.clone()))
        .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

fn ack_note(ack: &super::ack::AckFile) -> String {
    let mut note = String::new();
    if let Some(step) = &ack.step {
        let _ = write!(note, " step={step}");
    }
    if let Some(ck) = &ack.checkpoint {
        let _ = write!(note, " checkpoint={ck}");
    }
    note
}

/// One poll of one group: read acks, check exits, decide.
fn poll_group(w: &mut GroupWatch, now: Timestamp) {
    let proc = w.proc.clone();
    for c in &mut w.containers {
        if c.plain_ack.is_some() {
            continue;
        }
        if let DirSlot::Late(rx) = &c.dir {
            c.dir = match rx.try_recv() {
                Ok((Ok(dir), fresh, _)) => DirSlot::Ready(dir, fresh),
                Ok((Err(_), _, _)) | Err(mpsc::TryRecvError::Disconnected) => DirSlot::None,
                Err(mpsc::TryRecvError::Empty) => std::mem::replace(&mut c.dir, DirSlot::None),
            };
        }
        let DirSlot::Ready(dir, fresh) = &c.dir else {
            // No dir (yet): only exits can finish these processes.
            for p in &mut c.procs {
                check_exit(&proc, None, p, now);
            }
            continue;
        };
        match dir.plain_ack() {
            Ok(Some(stamp)) if fresh.fresh(PLAIN_ACK_FILE, &stamp) => {
                c.plain_ack = Some(now);
                continue;
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "unreadable plain ack"),
        }
        for p in &mut c.procs {
            if matches!(p.state, ProcState::Pending { .. }) {
                read_ack(dir, fresh, p, now);
                check_exit(&proc, Some((dir, fresh)), p, now);
            }
        }
    }
    if w.containers.iter().all(ContainerWatch::finished) {
        w.result = Some(finish(w));
    } else if now >= w.deadline {
        let budget = w.deadline.duration_since(w.signalled_at);
        w.result = Some(GroupResult {
            group: w.group.clone(),
            pod: w.pod.clone(),
            outcome: Outcome::Timeout,
            signalled: w.containers.iter().map(|c| c.procs.len()).sum(),
            signalled_at: Some(w.signalled_at),
            ack_latency: None,
            detail: format!(
                "no terminal ack within {:.1}s: {}",
                budget.as_secs_f64(),
                pending_detail(w)
            ),
        });
    }
}

fn read_ack(dir: &CheckpointDir, fresh: &Freshness, p: &mut ProcWatch, now: Timestamp) {
    match dir.read_ack(p.process.ns_pid) {
        Ok(Some(ack)) if fresh.fresh(&ack_file_name(p.process.ns_pid), &ack.stamp) => {
            p.problem = None;
            if ack.file.state.is_terminal() {
                p.state = ProcState::Acked {
                    state: ack.file.state,
                    at: now,
                    note: ack_note(&ack.file),
                };
            } else if let ProcState::Pending { received } = &mut p.state {
                received.get_or_insert(now);
            }
        }
        Ok(_) => {}
        Err(e) => p.problem = Some(e.to_string()),
    }
}

fn check_exit(
    proc: &ProcFs,
    dir: Option<(&CheckpointDir, &Freshness)>,
    p: &mut ProcWatch,
    now: Timestamp,
) {
    if !matches!(p.state, ProcState::Pending { .. }) {
        return;
    }
    match proc.alive(p.process.pid, p.process.start_time) {
        Ok(true) => {}
        Ok(false) => {
            // It may have written `done` between the read above and its exit.
            if let Some((dir, fresh)) = dir {
                read_ack(dir, fresh, p, now);
            }
            if matches!(p.state, ProcState::Pending { .. }) {
                p.state = ProcState::Exited { at: now };
            }
        }
        Err(e) => {
            tracing::debug!(pid = p.process.pid, error = %e, "cannot check whether a target exited")
        }
    }
}

fn finish(w: &GroupWatch) -> GroupResult {
    let mut worst = Outcome::Acked;
    let rank = |o: Outcome| match o {
        Outcome::Failed => 3,
        Outcome::Exited => 2,
        Outcome::Skipped => 1,
        _ => 0,
    };
    let mut last_ack: Option<Timestamp> = None;
    let mut parts = Vec::new();
    for c in &w.containers {
        if let Some(at) = c.plain_ack {
            last_ack = last_ack.max(Some(at));
            parts.push(format!("{}: plain ack", c.name));
            continue;
        }
        for p in &c.procs {
            let (o, text) = match &p.state {
                ProcState::Acked { state, at, note } => {
                    last_ack = last_ack.max(Some(*at));
                    let o = match state {
                        AckState::Done | AckState::Received => Outcome::Acked,
                        AckState::Skipped => Outcome::Skipped,
                        AckState::Failed => Outcome::Failed,
                    };
                    (o, format!("{}{note}", state.as_str()))
                }
                ProcState::Exited { .. } => (Outcome::Exited, "exited without done".to_string()),
                ProcState::Pending { .. } => (Outcome::Timeout, "pending".to_string()),
            };
            if rank(o) > rank(worst) {
                worst = o;
            }
            parts.push(format!(
                "pid {}{}: {text}",
                p.process.pid,
                ns_suffix(&p.process)
            ));
        }
    }
    parts.extend(w.notice_problems.iter().cloned());
    let ack_latency = match worst {
        Outcome::Acked | Outcome::Skipped | Outcome::Failed => last_ack.map(|at| {
            Duration::try_from(at.duration_since(w.signalled_at).max(SignedDuration::ZERO))
                .unwrap_or_default()
        }),
        _ => None,
    };
    GroupResult {
        group: w.group.clone(),
        pod: w.pod.clone(),
        outcome: worst,
        signalled: w.containers.iter().map(|c| c.procs.len()).sum(),
        signalled_at: Some(w.signalled_at),
        ack_latency,
        detail: parts.join("; "),
    }
}

fn ns_suffix(p: &SignalledProcess) -> String {
    if p.ns_pid != p.pid {
        format!(" (pid {} in its namespace)", p.ns_pid)
    } else {
        String::new()
    }
}

fn pending_detail(w: &GroupWatch) -> String {
    let mut parts = Vec::new();
    for c in &w.containers {
        if c.plain_ack.is_some() {
            parts.push(format!("{}: plain ack", c.name));
            continue;
        }
        for p in &c.procs {
            let s = match &p.state {
                ProcState::Pending { received: Some(_) } => "received, no terminal ack".to_string(),
                ProcState::Pending { received: None } => "no ack".to_string(),
                ProcState::Acked { state, note, .. } => format!("{}{note}", state.as_str()),
                ProcState::Exited { .. } => "exited without done".to_string(),
            };
            let problem = p
                .problem
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            parts.push(format!(
                "pid {}{}: {s}{problem}",
                p.process.pid,
                ns_suffix(&p.process)
            ));
        }
    }
    parts.extend(w.notice_problems.iter().cloned());
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_in(state: ProcState, pid: i32, at: Timestamp) -> ProcWatch {
        ProcWatch {
            process: SignalledProcess {
                pid,
                ns_pid: pid,
                start_time: 1,
                signalled_at: at,
            },
            state,
            problem: None,
        }
    }

    fn group(containers: Vec<ContainerWatch>, at: Timestamp) -> GroupWatch {
        GroupWatch {
            group: "g".into(),
            pod: None,
            signalled_at: at,
            deadline: at + Duration::from_secs(10),
            containers,
            notice_problems: Vec::new(),
            result: None,
            proc: ProcFs::default(),
        }
    }

    fn acked(state: AckState, at: Timestamp) -> ProcState {
        ProcState::Acked {
            state,
            at,
            note: String::new(),
        }
    }

    #[test]
    fn outcome_precedence_and_latency() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let t1 = t0 + Duration::from_millis(1500);
        let t2 = t0 + Duration::from_secs(3);
        let exited = ProcState::Exited { at: t1 };
        let cases = [
            (
                vec![acked(AckState::Done, t1), acked(AckState::Done, t2)],
                Outcome::Acked,
            ),
            (
                vec![acked(AckState::Done, t1), acked(AckState::Skipped, t2)],
                Outcome::Skipped,
            ),
            (
                vec![acked(AckState::Skipped, t1), exited.clone()],
                Outcome::Exited,
            ),
            (vec![exited, acked(AckState::Failed, t1)], Outcome::Failed),
        ];
        for (states, want) in cases {
            let procs = states
                .into_iter()
                .enumerate()
                .map(|(i, s)| proc_in(s, i as i32 + 10, t0))
                .collect();
            let c = ContainerWatch {
                name: "c".into(),
                dir: DirSlot::None,
                plain_ack: None,
                procs,
            };
            let r = finish(&group(vec![c], t0));
            assert_eq!(r.outcome, want, "{}", r.detail);
            assert_eq!(r.signalled, 2);
            match want {
                Outcome::Exited => assert_eq!(r.ack_latency, None),
                _ => assert!(r.ack_latency.is_some()),
            }
        }
        // latency is to the last terminal ack
        let c = ContainerWatch {
            name: "c".into(),
            dir: DirSlot::None,
            plain_ack: None,
            procs: vec![
                proc_in(acked(AckState::Done, t1), 1, t0),
                proc_in(acked(AckState::Done, t2), 2, t0),
            ],
        };
        assert_eq!(
            finish(&group(vec![c], t0)).ack_latency,
            Some(Duration::from_secs(3))
        );
    }

    #[test]
    fn plain_ack_finishes_a_container_with_pending_processes() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let c = ContainerWatch {
            name: "trainer".into(),
            dir: DirSlot::None,
            plain_ack: Some(t0 + Duration::from_secs(2)),
            procs: vec![proc_in(ProcState::Pending { received: None }, 1, t0)],
        };
        assert!(c.finished());
        let r = finish(&group(vec![c], t0));
        assert_eq!(r.outcome, Outcome::Acked);
        assert_eq!(r.ack_latency, Some(Duration::from_secs(2)));
        assert!(r.detail.contains("trainer: plain ack"));
    }

    #[test]
    fn freshness_compares_stamps_not_clocks() {
        let stamp = |ino: u64, ctime: i64| FileStamp {
            dev: 1,
            ino,
            size: 10,
            ctime: (ctime, 0),
            mtime: (0, 0),
        };
        let mut f = Freshness::default();
        // absent before the signal: any ack counts, whatever its times say
        assert!(f.fresh("ack-1.json", &stamp(5, 0)));
        f.baseline.insert("ack-1.json".into(), stamp(5, 100));
        assert!(!f.fresh("ack-1.json", &stamp(5, 100)));
        assert!(f.fresh("ack-1.json", &stamp(6, 100)));
        assert!(f.fresh("ack-1.json", &stamp(5, 101)));
        // restart path: no earlier than notice.json of this notice, same filesystem clock
        let anchor = Freshness {
            baseline: HashMap::new(),
            anchor: Some(stamp(9, 200)),
        };
        assert!(!anchor.fresh("ack-1.json", &stamp(6, 199)));
        assert!(anchor.fresh("ack-1.json", &stamp(6, 200)));
    }
}
