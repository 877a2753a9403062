//! The checkpoint step of the responder (design §4 step 3, §5): [`deliver`] writes `notice.json`
//! and signals the targets of all groups concurrently; [`wait`] watches acks and exits until each
//! group is finished or its budget ran out. After an agent restart, [`plan_without_signal`]
//! rebuilds what to wait for from fresh discovery without signalling anyone again.
//!
//! `deliver` and `plan_without_signal` block (procfs reads, fsync): call them from
//! `spawn_blocking`. `wait` is async and does its file reads on blocking threads.
//!
//! Per group, the budget is `min(signalled_at + group.timeout, req.checkpoint_deadline)`. A group
//! is finished when every signalled process has a terminal ack (`done`, `skipped`, `failed`)
//! written after the signal, or has exited (after `done`: success; without: `exited`), or the
//! plain `ack` file appeared in its container. "Written after the signal" is judged by the file's
//! modification time (same kernel clock as the agent), with [`ACK_CLOCK_SLACK`] for the coarse
//! filesystem clock. Group outcome: `failed` if any process failed, else `exited` if any exited
//! without `done`, else `skipped` if any skipped, else `acked`.
//!
//! Dry-run: the processes are checked as for real, nothing is written or signalled, and the result
//! says what would have happened (`no_handler` when nothing catches the signal, else `skipped`
//! with a detail starting `dry-run:`); dry-run outcomes are not counted in the metrics.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use tokio_util::sync::CancellationToken;

use super::ack::{AckState, CheckpointDir, NoticeFile};
use super::procfs::{clock_ticks_per_second, ProcFs};
use super::signal::{self, NotSignalled, Prepared};
use super::{Outcome, PodRef, Signal, TargetContainer, TargetGroup, TargetMode};
use crate::metrics::{Metrics, OutcomeLabels};

/// How much earlier than the signal an ack's mtime may be and still count (the filesystem
/// timestamps files with a clock that lags by up to one tick).
pub const ACK_CLOCK_SLACK: Duration = Duration::from_millis(50);
/// How often acks and exits are polled.
pub const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// Restart path: a process that started this long after the signal was not signalled.
const START_SLACK: Duration = Duration::from_secs(2);

const MODULE: &str = "checkpoint";

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
    dir: Option<CheckpointDir>,
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
/// run concurrently, one thread each: a group is signalled as soon as its own notices are written,
/// so a slow or hung checkpoint filesystem in one pod never delays another pod's signal. Blocking.
pub fn deliver(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    metrics: &Metrics,
) -> Vec<Delivery> {
    let proc = ProcFs::default();
    per_group(groups, |g| {
        let staged = stage_group(&proc, g, req, metrics, Mode::Deliver);
        signal_group(staged, req, metrics, Mode::Deliver)
    })
}

/// After an agent restart: rebuild the deliveries from fresh discovery as if the processes had been
/// signalled at `signalled_at` (same target filter; processes started after it are left out).
/// Never writes and never signals. Blocking.
pub fn plan_without_signal(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    signalled_at: Timestamp,
) -> Vec<Delivery> {
    let proc = ProcFs::default();
    let mode = Mode::Replan {
        signalled_at,
        boot: proc.boot_time().ok(),
    };
    groups
        .iter()
        .map(|g| {
            signal_group(
                stage_group(&proc, g, req, &NoMetrics, mode),
                req,
                &NoMetrics,
                mode,
            )
        })
        .collect()
}

/// Run `f` for each group, on a scoped thread per group when there are several.
fn per_group<F>(groups: &[TargetGroup], f: F) -> Vec<Delivery>
where
    F: Fn(&TargetGroup) -> Delivery + Sync,
{
    if groups.len() <= 1 {
        return groups.iter().map(&f).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = groups
            .iter()
            .map(|g| {
                let f = &f;
                let handle = std::thread::Builder::new()
                    .name("sg-deliver".into())
                    .spawn_scoped(s, move || f(g));
                (g, handle)
            })
            .collect();
        handles
            .into_iter()
            .map(|(g, h)| match h {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    tracing::error!(group = %g.name, "checkpoint delivery thread panicked");
                    Delivery {
                        group: g.name.clone(),
                        pod: g.pod.clone(),
                        dir: g.dir.clone(),
                        signal: g.signal,
                        timeout: g.timeout,
                        state: DeliveryState::Error("delivery thread panicked".into()),
                        signalled_at: None,
                        containers: Vec::new(),
                    }
                }),
                // No thread available: deliver on this one.
                Err(e) => {
                    tracing::debug!(error = %e, "no thread for delivery, delivering inline");
                    f(g)
                }
            })
            .collect()
    })
}

/// A group whose targets are checked and pinned and whose notices are written.
struct Staged<'g> {
    group: &'g TargetGroup,
    containers: Vec<(ContainerDelivery, Vec<Prepared>)>,
}

/// Metric sink: the restart path counts nothing (nothing is sent).
trait Counting: Sync {
    fn signal_sent(&self);
    fn error(&self, label: &str);
}

impl Counting for Metrics {
    fn signal_sent(&self) {
        self.signals_sent.inc();
    }
    fn error(&self, label: &str) {
        Metrics::error(self, MODULE, label);
    }
}

struct NoMetrics;

impl Counting for NoMetrics {
    fn signal_sent(&self) {}
    fn error(&self, _: &str) {}
}

#[derive(Clone, Copy)]
enum Mode {
    Deliver,
    Replan {
        signalled_at: Timestamp,
        boot: Option<i64>,
    },
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
    group: &TargetGroup,
    c: &TargetContainer,
    prepared: &[Prepared],
) -> Result<CheckpointDir, super::Error> {
    let Some(root_pid) = c.root_pid else {
        return CheckpointDir::host(&group.dir);
    };
    let mut tries: Vec<(i32, u64)> = c
        .processes
        .iter()
        .filter(|p| p.pid == root_pid)
        .map(|p| (p.pid, p.start_time))
        .collect();
    tries.extend(prepared.iter().map(|p| (p.pid, p.start_time)));
    let mut last = None;
    for (pid, start) in tries {
        match CheckpointDir::in_root_of(proc, pid, start, &group.dir) {
            Ok(d) => return Ok(d),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| super::Error::ReadAck {
        target: format!("{} in /proc/{root_pid}/root", group.dir.display()),
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

/// Phase 1 for one group: check and pin the targets, write the notices.
fn stage_group<'g>(
    proc: &ProcFs,
    group: &'g TargetGroup,
    req: &CheckpointRequest,
    metrics: &dyn Counting,
    mode: Mode,
) -> Staged<'g> {
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let notice = req.notice(group.signal);
    let require_handler = group.mode == TargetMode::Handlers;

    let mut staged: Vec<(ContainerDelivery, Vec<Prepared>)> = Vec::new();
    for c in &group.containers {
        let mut cd = ContainerDelivery {
            name: c.name.clone(),
            root_pid: c.root_pid,
            signalled: Vec::new(),
            would_signal: Vec::new(),
            skipped: Vec::new(),
            notice: NoticeStatus::NotNeeded,
            error: None,
            dir: None,
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
                                metrics.error("prepare");
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
        if let Mode::Replan { signalled_at, boot } = mode {
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
        if !prepared.is_empty() {
            match open_dir(proc, group, c, &prepared) {
                Ok(dir) => {
                    cd.notice = match mode {
                        Mode::Replan { .. } => NoticeStatus::AlreadyWritten,
                        Mode::Deliver if req.dry_run => {
                            tracing::info!(dir = %dir.display(), notice = ?notice, "dry-run: would write notice.json");
                            NoticeStatus::DryRun
                        }
                        Mode::Deliver => {
                            let owner = prepared.first().map(|p| (p.uid, p.gid));
                            match dir.write_notice(&notice, owner) {
                                Ok(()) => NoticeStatus::Written,
                                Err(e) => {
                                    tracing::warn!(error = %e, "cannot write notice.json; signalling anyway");
                                    metrics.error(e.metric_label());
                                    NoticeStatus::Failed(e.to_string())
                                }
                            }
                        }
                    };
                    cd.dir = Some(dir);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open the checkpoint dir; signalling anyway");
                    metrics.error(e.metric_label());
                    cd.notice = NoticeStatus::Failed(e.to_string());
                }
            }
        }
        staged.push((cd, prepared));
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
    metrics: &dyn Counting,
    mode: Mode,
) -> Delivery {
    let group = staged.group;
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let mut first_signal = None;
    let mut containers = Vec::with_capacity(staged.containers.len());
    for (mut cd, prepared) in staged.containers {
        for p in prepared {
            match mode {
                Mode::Replan { signalled_at, .. } => {
                    first_signal.get_or_insert(signalled_at);
                    cd.signalled.push(signalled(&p, signalled_at));
                }
                Mode::Deliver if req.dry_run => cd.would_signal.push(p.pid),
                Mode::Deliver => {
                    let at = Timestamp::now();
                    match signal::send(&p, group.signal) {
                        Ok(()) => {
                            metrics.signal_sent();
                            first_signal.get_or_insert(at);
                            cd.signalled.push(signalled(&p, at));
                        }
                        Err(e) => {
                            let reason = signal::send_failure(&e);
                            if matches!(reason, NotSignalled::Failed(_)) {
                                tracing::warn!(pid = p.pid, error = %e, "checkpoint signal failed");
                                metrics.error(e.metric_label());
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
    match &state {
        DeliveryState::Signalled if matches!(mode, Mode::Deliver) => tracing::info!(
            signal = %group.signal,
            pids = ?containers.iter().flat_map(|c| c.signalled.iter().map(|p| p.pid)).collect::<Vec<_>>(),
            "checkpoint signal sent"
        ),
        DeliveryState::Signalled => tracing::info!(
            pids = ?containers.iter().flat_map(|c| c.signalled.iter().map(|p| p.pid)).collect::<Vec<_>>(),
            "resuming the wait for acks of processes signalled before the restart"
        ),
        DeliveryState::DryRun => tracing::info!(
            signal = %group.signal,
            pids = ?containers.iter().flat_map(|c| c.would_signal.iter().copied()).collect::<Vec<_>>(),
            "dry-run: would send the checkpoint signal"
        ),
        other => tracing::info!(state = ?other, "no checkpoint signal sent"),
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
        received: Option<Timestamp>,
    },
    Acked {
        state: AckState,
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
    dir: Option<CheckpointDir>,
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
    /// The result has been counted and logged.
    recorded: bool,
}

/// Wait for every delivery to finish (acks, exits, plain ack) or run out of budget; one result per
/// delivery, in order. Counts `spotguard_checkpoint_total{outcome}` and the ack-latency histogram.
/// On `cancel` (agent shutting down) unfinished groups end with `error` ("cancelled"), uncounted.
pub async fn wait(
    deliveries: Vec<Delivery>,
    req: &CheckpointRequest,
    metrics: &Metrics,
    cancel: &CancellationToken,
) -> Vec<GroupResult> {
    let mut watches: Vec<GroupWatch> = deliveries.into_iter().map(|d| watch(d, req)).collect();
    let proc = ProcFs::default();
    let mut first = true;
    loop {
        for w in watches.iter_mut().filter(|w| !w.recorded) {
            if let Some(r) = &w.result {
                record(r, req, metrics);
                w.recorded = true;
            }
        }
        if watches.iter().all(|w| w.result.is_some()) {
            break;
        }
        let cancelled = if first {
            cancel.is_cancelled()
        } else {
            tokio::select! {
                _ = tokio::time::sleep(POLL_INTERVAL) => false,
                _ = cancel.cancelled() => true,
            }
        };
        first = false;
        if cancelled {
            for w in watches.iter_mut().filter(|w| w.result.is_none()) {
                let detail = format!(
                    "cancelled (agent shutting down) while waiting: {}",
                    pending_detail(w)
                );
                w.result = Some(GroupResult {
                    group: w.group.clone(),
                    pod: w.pod.clone(),
                    outcome: Outcome::Error,
                    signalled: w.containers.iter().map(|c| c.procs.len()).sum(),
                    signalled_at: Some(w.signalled_at),
                    ack_latency: None,
                    detail,
                });
                w.recorded = true;
            }
            break;
        }
        let p = proc.clone();
        let polled = tokio::task::spawn_blocking(move || {
            let now = Timestamp::now();
            for w in watches.iter_mut().filter(|w| w.result.is_none()) {
                poll_group(&p, w, now);
            }
            watches
        })
        .await;
        watches = match polled {
            Ok(w) => w,
            Err(e) => {
                // The poll closure does not panic; a failed join leaves nothing to report on.
                tracing::error!(error = %e, "checkpoint ack poll failed");
                metrics.error(MODULE, "poll");
                return Vec::new();
            }
        };
    }
    watches.into_iter().filter_map(|w| w.result).collect()
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
            tracing::info!(outcome = "acked", latency = ?r.ack_latency, detail = %r.detail, "checkpoint finished")
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
        recorded: false,
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

fn fresh(mtime: Timestamp, signalled_at: Timestamp) -> bool {
    mtime
        >= signalled_at
            .checked_sub(ACK_CLOCK_SLACK)
            .unwrap_or(signalled_at)
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
fn poll_group(proc: &ProcFs, w: &mut GroupWatch, now: Timestamp) {
    for c in &mut w.containers {
        if c.plain_ack.is_some() {
            continue;
        }
        let Some(dir) = &c.dir else {
            // No dir: only exits can finish these processes.
            for p in &mut c.procs {
                check_exit(proc, None, p, now);
            }
            continue;
        };
        let first_signal = c
            .procs
            .iter()
            .map(|p| p.process.signalled_at)
            .min()
            .unwrap_or(w.signalled_at);
        match dir.plain_ack() {
            Ok(Some(mtime)) if fresh(mtime, first_signal) => {
                c.plain_ack = Some(mtime);
                continue;
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "unreadable plain ack"),
        }
        for p in &mut c.procs {
            if matches!(p.state, ProcState::Pending { .. }) {
                read_ack(dir, p);
                check_exit(proc, Some(dir), p, now);
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

fn read_ack(dir: &CheckpointDir, p: &mut ProcWatch) {
    match dir.read_ack(p.process.ns_pid) {
        Ok(Some(ack)) if fresh(ack.mtime, p.process.signalled_at) => {
            p.problem = None;
            if ack.file.state.is_terminal() {
                p.state = ProcState::Acked {
                    state: ack.file.state,
                    at: ack.mtime,
                    note: ack_note(&ack.file),
                };
            } else if let ProcState::Pending { received } = &mut p.state {
                received.get_or_insert(ack.mtime);
            }
        }
        Ok(_) => {}
        Err(e) => p.problem = Some(e.to_string()),
    }
}

fn check_exit(proc: &ProcFs, dir: Option<&CheckpointDir>, p: &mut ProcWatch, now: Timestamp) {
    if !matches!(p.state, ProcState::Pending { .. }) {
        return;
    }
    match proc.alive(p.process.pid, p.process.start_time) {
        Ok(true) => {}
        Ok(false) => {
            // It may have written `done` between the read above and its exit.
            if let Some(dir) = dir {
                read_ack(dir, p);
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
            recorded: false,
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
                dir: None,
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
            dir: None,
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
            dir: None,
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
    fn acks_within_the_clock_slack_count() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        assert!(fresh(t0, t0));
        assert!(fresh(t0 - Duration::from_millis(20), t0));
        assert!(!fresh(t0 - Duration::from_millis(200), t0));
        assert!(fresh(Timestamp::MIN, Timestamp::MIN));
    }
}
