//! Delivery, the signal path: per group, check and pin the targets and write `notice.json`
//! (phase 1, [`stage_group`]), then signal what was pinned (phase 2, [`signal_group`]); every
//! group on a thread of its own under [`DELIVER_BUDGET`]. The restart path
//! ([`plan_without_signal`]) runs the same phases without writing or signalling.

use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use jiff::Timestamp;

use super::dir::{file_job, DirSlot, FileJob, FileTask};
use super::threads::{count_stuck, spawn_thread, Counters};
use super::{group_span, CheckpointRequest, DELIVER_BUDGET, NOTICE_BUDGET};
use crate::checkpoint::ack::{ack_file_name, PLAIN_ACK_FILE};
use crate::checkpoint::procfs::{clock_ticks_per_second, ProcFs};
use crate::checkpoint::signal::{self, NotSignalled, Prepared};
use crate::checkpoint::{
    run_on_thread, PodRef, Signal, TargetContainer, TargetGroup, TargetMode, TargetProcess,
};
use crate::metrics::Metrics;

/// Restart path: a process that started this long after the signal was not signalled.
const START_SLACK: Duration = Duration::from_secs(2);

/// Name of the thread [`deliver_async`] and [`plan_without_signal_async`] run on.
const OFF_POOL_THREAD: &str = "sg-ckpt";

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
    pub(super) dir: DirSlot,
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
    pub(super) proc: ProcFs,
}

impl Delivery {
    /// A delivery to `g` in `state`, with no container delivered yet.
    fn of(g: &TargetGroup, state: DeliveryState, proc: ProcFs) -> Self {
        Delivery {
            group: g.name.clone(),
            pod: g.pod.clone(),
            dir: g.dir.clone(),
            signal: g.signal,
            timeout: g.timeout,
            state,
            signalled_at: None,
            containers: Vec::new(),
            proc,
        }
    }

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
    let g = groups.clone();
    run_on_thread(OFF_POOL_THREAD, move || {
        run_groups(&g, &req, counters, Mode::Deliver)
    })
    .await
    .unwrap_or_else(|_| failed_all(&groups, "no thread for checkpoint delivery"))
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
    let g = groups.clone();
    run_on_thread(OFF_POOL_THREAD, move || {
        plan_without_signal(&g, &req, signalled_at)
    })
    .await
    .unwrap_or_else(|_| failed_all(&groups, "no thread for checkpoint planning"))
}

fn failed_all(groups: &[TargetGroup], why: &str) -> Vec<Delivery> {
    tracing::error!(reason = why, "checkpoint delivery could not run");
    groups
        .iter()
        .map(|g| failed_delivery(g, why.to_string()))
        .collect()
}

fn failed_delivery(g: &TargetGroup, why: String) -> Delivery {
    Delivery::of(
        g,
        DeliveryState::Error(why),
        ProcFs::new(g.proc_root.clone()),
    )
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
pub(super) enum Mode {
    Deliver,
    Replan { signalled_at: Timestamp },
}

/// The processes of a container to consider, by target mode.
fn candidates(c: &TargetContainer, mode: TargetMode) -> Result<Vec<&TargetProcess>, String> {
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
        signalled_at: first_signal,
        containers,
        ..Delivery::of(group, state, proc)
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
