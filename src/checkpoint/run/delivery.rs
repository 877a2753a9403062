//! Delivery, the signal path: per group, check and pin the targets, tell which were signalled
//! for this notice before (the record's list, or `notice.json` naming the notice), and write
//! `notice.json` (phase 1, [`stage_group`]); then signal what is to be signalled now (phase 2,
//! [`signal_group`]); every group on a thread of its own under [`DELIVER_BUDGET`]. What is known
//! before delivery comes in a [`Prior`]; the restart path of old ([`plan_without_signal`]) is the
//! prior "everyone was signalled".

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;

use super::dir::{file_job, Claimed, DirSlot, FileJob, FileTask, Tell, Told};
use super::threads::{count_stuck, spawn_thread, Counters};
use super::{group_span, CheckpointRequest, Prior, Signalled, DELIVER_BUDGET, NOTICE_BUDGET};
use crate::checkpoint::handler::Check;
use crate::checkpoint::procfs::{clock_ticks_per_second, ProcFs};
use crate::checkpoint::protocol::NoticeFile;
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
    /// Every uid of the process: only a file one of them owns is its ack.
    pub uids: Vec<u32>,
    /// Signalled for this notice before this delivery (by an earlier run of the agent): only
    /// waited for.
    pub before: bool,
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

    /// Number of processes signalled (by this delivery or, for this notice, before it).
    pub fn signalled(&self) -> usize {
        self.containers.iter().map(|c| c.signalled.len()).sum()
    }

    /// Number of processes this delivery sent the signal to.
    pub fn sent(&self) -> usize {
        self.containers
            .iter()
            .flat_map(|c| c.signalled.iter())
            .filter(|p| !p.before)
            .count()
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
/// its thread abandoned. Every target is signalled: the caller knows of no earlier delivery of
/// this notice (see [`deliver_with`] for one that may have happened).
pub fn deliver(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    metrics: &Metrics,
) -> Vec<Delivery> {
    deliver_with(groups, req, &Prior::default(), metrics)
}

/// [`deliver`] knowing what `prior` says about earlier deliveries of this notice: a target the
/// record lists, or (without a list) whose `notice.json` names this notice of this life, is
/// waited for without a second signal; a target nobody can tell about is signalled or held as
/// `prior` says.
pub fn deliver_with(
    groups: &[TargetGroup],
    req: &CheckpointRequest,
    prior: &Prior,
    metrics: &Metrics,
) -> Vec<Delivery> {
    run_groups(groups, req, prior, Counters::of(metrics), false)
}

/// [`deliver`] on a thread of its own: for async callers (the responder), which must not queue
/// the signal behind tokio's blocking pool.
pub async fn deliver_async(
    groups: Vec<TargetGroup>,
    req: CheckpointRequest,
    metrics: &Metrics,
) -> Vec<Delivery> {
    deliver_with_async(groups, req, Prior::default(), metrics).await
}

/// [`deliver_with`] on a thread of its own.
pub async fn deliver_with_async(
    groups: Vec<TargetGroup>,
    req: CheckpointRequest,
    prior: Prior,
    metrics: &Metrics,
) -> Vec<Delivery> {
    let counters = Counters::of(metrics);
    let g = groups.clone();
    run_on_thread(OFF_POOL_THREAD, move || {
        run_groups(&g, &req, &prior, counters, false)
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
    let prior = Prior {
        signalled_at: Some(signalled_at),
        signalled: Signalled::Everyone,
        ..Prior::default()
    };
    run_groups(groups, req, &prior, Counters::none(), true)
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
    prior: &Prior,
    counters: Counters,
    replan: bool,
) -> Vec<Delivery> {
    let deadline = Instant::now() + DELIVER_BUDGET;
    let claimed = Claimed::default();
    let pending: Vec<Option<mpsc::Receiver<Delivery>>> = groups
        .iter()
        .map(|g| {
            let (tx, rx) = mpsc::channel();
            let (g2, req2, c2, p2) = (g.clone(), req.clone(), counters.clone(), prior.clone());
            let claimed = claimed.clone();
            let started = spawn_thread("sg-ckpt-deliver", &counters, move || {
                let proc = ProcFs::new(g2.proc_root.clone());
                let staged = stage_group(&proc, &g2, &req2, &p2, &c2, &claimed);
                let _ = tx.send(signal_group(staged, &req2, &c2, replan, proc));
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

/// A group whose targets are checked and pinned, sorted into "signal now" and "signalled before"
/// (with when), and whose notices are written.
struct Staged<'g> {
    group: &'g TargetGroup,
    containers: Vec<StagedContainer>,
}

/// One container after phase 1: who to signal now, who was signalled before (and when).
struct StagedContainer {
    delivery: ContainerDelivery,
    now: Vec<Prepared>,
    before: Vec<(Prepared, Timestamp)>,
}

/// A container's file thread being waited for.
struct PendingFile {
    rx: mpsc::Receiver<FileJob>,
    abandoned: Arc<AtomicBool>,
    tell: Tell,
}

/// The processes of a container to consider, by target mode.
fn candidates(c: &TargetContainer, mode: TargetMode) -> Result<Vec<&TargetProcess>, String> {
    match mode {
        TargetMode::Handlers | TargetMode::Caught | TargetMode::All => {
            Ok(c.processes.iter().collect())
        }
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

/// Phase 1 for one group: check and pin the targets, find out which were signalled for this
/// notice before, write the notices (each container's on its own file thread, waited for at most
/// [`NOTICE_BUDGET`] in all).
fn stage_group<'g>(
    proc: &ProcFs,
    group: &'g TargetGroup,
    req: &CheckpointRequest,
    prior: &Prior,
    counters: &Counters,
    claimed: &Claimed,
) -> Staged<'g> {
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let notice = req.notice(group.signal, prior);
    let boot = prior.signalled_at.and_then(|_| proc.boot_time().ok());
    let mut staged: Vec<(ContainerDelivery, Vec<Prepared>)> = Vec::new();
    let mut jobs: Vec<Option<PendingFile>> = Vec::new();
    for c in &group.containers {
        let (mut cd, prepared) = prepare_container(proc, group, c, prior, boot, counters);
        let job = (!prepared.is_empty()).then(|| {
            let who: Vec<Who> = prepared.iter().map(Who::of).collect();
            let file = FileStart {
                proc,
                group,
                req,
                notice: &notice,
                counters,
                claimed,
            };
            file.start(c, &prepared, tell(&prior.signalled, &who), &mut cd)
        });
        jobs.push(job);
        staged.push((cd, prepared));
    }
    // Collect the file threads against one deadline; a dir that does not answer in time is left
    // to the watcher, and its targets are decided without it.
    let deadline = Instant::now() + NOTICE_BUDGET;
    let containers = staged
        .into_iter()
        .zip(jobs)
        .map(|((mut cd, prepared), job)| {
            let Some(job) = job else {
                return StagedContainer {
                    delivery: cd,
                    now: Vec::new(),
                    before: Vec::new(),
                };
            };
            let (answer, tell) = job.wait(deadline, group, &mut cd, counters);
            let (now, before, told_at) = settle(answer, &tell, group, &notice, &mut cd);
            let before_at = prior
                .signalled_at
                .or(told_at)
                .unwrap_or_else(Timestamp::now);
            let sorted = sort(prepared, |p| p.ns_pid, &now, &before);
            held(&sorted.unknown, group, counters, &mut cd);
            StagedContainer {
                delivery: cd,
                now: sorted.signal,
                before: sorted.waited.into_iter().map(|p| (p, before_at)).collect(),
            }
        })
        .collect();
    Staged { group, containers }
}

/// Step 1 of a container: its candidate processes by target mode, checked and pinned; those
/// that started after the notice's earlier signal are left out (never signalled for it, and not
/// now either). The skipped and why are in the returned [`ContainerDelivery`].
fn prepare_container(
    proc: &ProcFs,
    group: &TargetGroup,
    c: &TargetContainer,
    prior: &Prior,
    boot: Option<i64>,
    counters: &Counters,
) -> (ContainerDelivery, Vec<Prepared>) {
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
    let check = Check::of(group.mode);
    let mut prepared = Vec::new();
    match candidates(c, group.mode) {
        Ok(targets) => {
            for t in targets {
                match signal::prepare(proc, t, group.signal, check) {
                    Ok(p) => prepared.push(p),
                    Err(reason) => {
                        if let NotSignalled::Failed(e) = &reason {
                            tracing::warn!(pid = t.pid, error = %e, "cannot check checkpoint target");
                            counters.error("prepare");
                        }
                        if let NotSignalled::NotAHandler(why) = &reason {
                            tracing::info!(pid = t.pid, group = %group.name, "not signalled: {why} (target mode `caught` signals it)");
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
    if let Some(signalled_at) = prior.signalled_at {
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
    (cd, prepared)
}

/// A target as the "one signal per notice" decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Who {
    /// Its PID as it sees it (the names of its acks, `notice.json`'s readers).
    ns_pid: i32,
    /// Host PID and start time: what the plan record lists.
    id: (i32, u64),
}

impl Who {
    fn of(p: &Prepared) -> Who {
        Who {
            ns_pid: p.ns_pid,
            id: (p.pid, p.start_time),
        }
    }
}

/// Step 2, the decision table of "one signal per notice": what the plan record knows of the
/// notice's earlier signal ([`Signalled`]) says which targets the file thread tells now, which
/// it tells were told before, and when `notice.json` decides.
fn tell(signalled: &Signalled, targets: &[Who]) -> Tell {
    let ns = || targets.iter().map(|w| w.ns_pid).collect::<Vec<_>>();
    match signalled {
        // The caller knows nobody was: every target now, `notice.json` not consulted.
        Signalled::Nobody => Tell::Known {
            now: ns(),
            before: Vec::new(),
        },
        // The restart path of old: every target was signalled before.
        Signalled::Everyone => Tell::NoneNow { targets: ns() },
        // The record lists who was: those were told before, the others now.
        Signalled::Listed(listed) => {
            let (before, now): (Vec<&Who>, Vec<&Who>) =
                targets.iter().partition(|w| listed.contains(&w.id));
            Tell::Known {
                now: now.iter().map(|w| w.ns_pid).collect(),
                before: before.iter().map(|w| w.ns_pid).collect(),
            }
        }
        // No record of this notice: `notice.json` decides; unreadable, a first notice must
        // reach the trainers.
        Signalled::Unrecorded => Tell::ByNotice {
            targets: ns(),
            if_unknown: true,
        },
        // Signalled, nobody listed: `notice.json` decides; unreadable, the targets are held
        // (never a second signal).
        Signalled::Unlisted => Tell::ByNotice {
            targets: ns(),
            if_unknown: false,
        },
    }
}

/// What starting a container's file thread needs of its group's delivery.
struct FileStart<'a> {
    proc: &'a ProcFs,
    group: &'a TargetGroup,
    req: &'a CheckpointRequest,
    notice: &'a NoticeFile,
    counters: &'a Counters,
    claimed: &'a Claimed,
}

impl FileStart<'_> {
    /// Step 3: start the container's file thread (open the dir, read `notice.json`, stamp the
    /// acks, write the notice). Without a thread the sender is gone: the receiver reports it
    /// disconnected.
    fn start(
        &self,
        c: &TargetContainer,
        prepared: &[Prepared],
        tell: Tell,
        cd: &mut ContainerDelivery,
    ) -> PendingFile {
        // Roots to resolve the dir in, in order: the container's root process, then the targets.
        let tries: Vec<(i32, u64)> = c
            .processes
            .iter()
            .filter(|p| Some(p.pid) == c.root_pid)
            .map(|p| (p.pid, p.start_time))
            .chain(prepared.iter().map(|p| (p.pid, p.start_time)))
            .collect();
        let owners: HashMap<i32, Vec<u32>> = prepared
            .iter()
            .map(|p| (p.ns_pid, p.uids.clone()))
            .collect();
        let (tx, rx) = mpsc::channel();
        let abandoned = Arc::new(AtomicBool::new(false));
        let task = FileTask {
            proc: self.proc.clone(),
            dir: self.group.dir.clone(),
            root: c.root_pid,
            tries,
            owners,
            tell: tell.clone(),
            notice: self.notice.clone(),
            dry_run: self.req.dry_run,
            counters: self.counters.clone(),
            abandoned: abandoned.clone(),
            claimed: self.claimed.clone(),
        };
        let started = spawn_thread("sg-ckpt-file", self.counters, move || {
            let _ = tx.send(file_job(task));
        });
        if !started {
            cd.notice = NoticeStatus::Failed("no thread for the checkpoint dir".into());
        }
        PendingFile {
            rx,
            abandoned,
            tell,
        }
    }
}

impl PendingFile {
    /// Step 4: the file thread's answer by `deadline`; `None` when it did not answer (a hung
    /// dir: left to the watcher) or died, said in `cd.notice`. With what it was to tell.
    fn wait(
        self,
        deadline: Instant,
        group: &TargetGroup,
        cd: &mut ContainerDelivery,
        counters: &Counters,
    ) -> (Option<FileJob>, Tell) {
        let PendingFile {
            rx,
            abandoned,
            tell,
        } = self;
        let answer = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(job) => Some(job),
            Err(RecvTimeoutError::Timeout) => {
                abandoned.store(true, Ordering::SeqCst);
                let budget_ms = NOTICE_BUDGET.as_millis() as u64;
                tracing::warn!(container = %cd.name, dir = %group.dir.display(), budget_ms, "checkpoint dir does not answer (hung filesystem?); going on without notice.json");
                counters.error("dir_timeout");
                count_stuck(&counters.errors);
                cd.notice = NoticeStatus::Failed(format!(
                    "checkpoint dir did not answer within {budget_ms} ms (hung filesystem?)"
                ));
                cd.dir = DirSlot::Late(rx);
                None
            }
            Err(RecvTimeoutError::Disconnected) => {
                abandoned.store(true, Ordering::SeqCst);
                if !matches!(cd.notice, NoticeStatus::Failed(_)) {
                    counters.error("panic");
                    cd.notice = NoticeStatus::Failed("checkpoint dir thread panicked".into());
                }
                None
            }
        };
        (answer, tell)
    }
}

/// Step 5: who is told now and who was before, by the file thread's answer (or, without one,
/// by the record alone: [`undecided`]), and when `notice.json` says the earlier signal was.
/// The answer's dir, notice status and warnings go into `cd`.
fn settle(
    answer: Option<FileJob>,
    tell: &Tell,
    group: &TargetGroup,
    notice: &NoticeFile,
    cd: &mut ContainerDelivery,
) -> (Vec<i32>, Vec<i32>, Option<Timestamp>) {
    let Some(job) = answer else {
        let (now, before) = undecided(tell);
        return (now, before, None);
    };
    let told_at = match &job.told {
        Told::Named(stamp) => Some(stamp_time(stamp.mtime)),
        _ => None,
    };
    let decided = match &job.dir {
        Ok(_) => Some((job.now.clone(), job.before.clone())),
        Err(_) => None,
    };
    match &job.status {
        NoticeStatus::DryRun => {
            tracing::info!(dir = %group.dir.display(), notice_id = %notice.notice_id, "dry-run: would write notice.json")
        }
        NoticeStatus::Failed(e) if job.dir.is_ok() => {
            tracing::warn!(container = %cd.name, error = %e, "cannot write notice.json; signalling anyway")
        }
        _ => {}
    }
    match job.dir {
        Ok(dir) => cd.dir = DirSlot::Ready(dir, Box::new(job.fresh)),
        Err(e) => {
            tracing::warn!(container = %cd.name, error = %e, "cannot open the checkpoint dir; deciding without notice.json")
        }
    }
    cd.notice = job.status;
    let (now, before) = decided.unwrap_or_else(|| undecided(tell));
    (now, before, told_at)
}

/// Targets sorted by the decision: signal now, only wait for (signalled before), or neither
/// (nothing tells whether they were: held).
#[derive(Debug, PartialEq)]
struct Sorted<T> {
    signal: Vec<T>,
    waited: Vec<T>,
    unknown: Vec<T>,
}

/// Step 6: sort `targets` (namespace PID by `ns`) into [`Sorted`].
fn sort<T>(targets: Vec<T>, ns: impl Fn(&T) -> i32, now: &[i32], before: &[i32]) -> Sorted<T> {
    let now: HashSet<i32> = now.iter().copied().collect();
    let before: HashSet<i32> = before.iter().copied().collect();
    let mut sorted = Sorted {
        signal: Vec::new(),
        waited: Vec::new(),
        unknown: Vec::new(),
    };
    for t in targets {
        if now.contains(&ns(&t)) {
            sorted.signal.push(t);
        } else if before.contains(&ns(&t)) {
            sorted.waited.push(t);
        } else {
            sorted.unknown.push(t);
        }
    }
    sorted
}

/// The held targets: logged, counted, skipped as "maybe signalled" (a second signal is worse
/// than none).
fn held(
    unknown: &[Prepared],
    group: &TargetGroup,
    counters: &Counters,
    cd: &mut ContainerDelivery,
) {
    for p in unknown {
        tracing::warn!(pid = p.pid, dir = %group.dir.display(), "cannot tell whether this process was signalled for this notice before (no record lists it, notice.json cannot be read): not signalling it again");
        counters.error("signalled_unknown");
        cd.skipped.push(SkippedProcess {
            pid: p.pid,
            reason: NotSignalled::MaybeSignalled,
        });
    }
}

/// Who is told now and who was before when the container's file thread gave no answer.
fn undecided(tell: &Tell) -> (Vec<i32>, Vec<i32>) {
    match tell {
        Tell::Known { now, before } => (now.clone(), before.clone()),
        Tell::ByNotice {
            targets,
            if_unknown: true,
        } => (targets.clone(), Vec::new()),
        Tell::ByNotice { .. } => (Vec::new(), Vec::new()),
        Tell::NoneNow { targets } => (Vec::new(), targets.clone()),
    }
}

/// A file time (filesystem clock) as a timestamp; now when it is not plausible.
fn stamp_time((secs, nanos): (i64, i64)) -> Timestamp {
    let now = Timestamp::now();
    match Timestamp::new(secs, i32::try_from(nanos).unwrap_or(0)) {
        Ok(t) if t <= now && now.duration_since(t).as_secs() < 86_400 => t,
        _ => now,
    }
}

/// Phase 2 for one group: signal everything that is to be signalled now.
fn signal_group(
    staged: Staged<'_>,
    req: &CheckpointRequest,
    counters: &Counters,
    replan: bool,
    proc: ProcFs,
) -> Delivery {
    let group = staged.group;
    let span = group_span(req, &group.name);
    let _enter = span.enter();
    let mut first_signal: Option<Timestamp> = None;
    let containers: Vec<ContainerDelivery> = staged
        .containers
        .into_iter()
        .map(|c| signal_container(c, group, req, counters, &mut first_signal))
        .collect();
    let state = delivery_state(req.dry_run && !replan, &containers);
    log_delivery(&state, group, &containers);
    Delivery {
        signalled_at: first_signal,
        containers,
        ..Delivery::of(group, state, proc)
    }
}

/// One container of phase 2: the processes signalled before are recorded with their time, the
/// others signalled now (or, in a dry run, listed). `first_signal` is the earliest signal seen.
fn signal_container(
    staged: StagedContainer,
    group: &TargetGroup,
    req: &CheckpointRequest,
    counters: &Counters,
    first_signal: &mut Option<Timestamp>,
) -> ContainerDelivery {
    let StagedContainer {
        delivery: mut cd,
        now: to_signal,
        before: waited,
    } = staged;
    let mut seen = |at: Timestamp| *first_signal = Some(first_signal.map_or(at, |f| f.min(at)));
    for (p, at) in waited {
        seen(at);
        cd.signalled.push(signalled(&p, at, true));
    }
    for p in to_signal {
        if req.dry_run {
            cd.would_signal.push(p.pid);
            continue;
        }
        let at = Timestamp::now();
        match signal::send(&p, group.signal) {
            Ok(()) => {
                counters.signal_sent();
                seen(at);
                cd.signalled.push(signalled(&p, at, false));
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
    cd
}

/// The group's delivery in the log: who was signalled now, who before, or why nobody.
fn log_delivery(state: &DeliveryState, group: &TargetGroup, containers: &[ContainerDelivery]) {
    let pids = |before: bool| {
        containers
            .iter()
            .flat_map(|c| c.signalled.iter().filter(|p| p.before == before))
            .map(|p| p.pid.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    match state {
        DeliveryState::Signalled => {
            let sent = pids(false);
            let before = pids(true);
            if !sent.is_empty() {
                tracing::info!(signal = %group.signal, pids = %sent, "checkpoint signal sent");
            }
            if !before.is_empty() {
                tracing::info!(
                    pids = %before,
                    "signalled for this notice before: waiting for their acks without a second signal"
                );
            }
        }
        DeliveryState::DryRun => tracing::info!(
            signal = %group.signal,
            pids = %containers.iter().flat_map(|c| c.would_signal.iter().map(|p| p.to_string())).collect::<Vec<_>>().join(","),
            "dry-run: would send the checkpoint signal"
        ),
        other => tracing::info!(state = other.label(), "no checkpoint signal sent"),
    }
}

fn signalled(p: &Prepared, at: Timestamp, before: bool) -> SignalledProcess {
    SignalledProcess {
        pid: p.pid,
        ns_pid: p.ns_pid,
        start_time: p.start_time,
        signalled_at: at,
        uids: p.uids.clone(),
        before,
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
    let held: Vec<String> = skipped()
        .filter(|s| s.reason == NotSignalled::MaybeSignalled)
        .map(|s| s.pid.to_string())
        .collect();
    if !held.is_empty() {
        return DeliveryState::Error(format!(
            "not signalled: nothing tells whether pids {} were signalled for this notice before (no record lists them, notice.json cannot be read), and a second signal is worse than none",
            held.join(",")
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

    const A: Who = Who {
        ns_pid: 1,
        id: (101, 5),
    };
    const B: Who = Who {
        ns_pid: 2,
        id: (102, 6),
    };

    /// The decision before the dir answers, and without its answer: (now, before).
    fn decide(signalled: Signalled) -> (Tell, (Vec<i32>, Vec<i32>)) {
        let told = tell(&signalled, &[A, B]);
        let without_dir = undecided(&told);
        (told, without_dir)
    }

    fn sorted(now: &[i32], before: &[i32]) -> Sorted<i32> {
        sort(vec![1, 2], |n| *n, now, before)
    }

    #[test]
    fn nobody_signalled_before_signals_everyone_without_reading_notice_json() {
        let (told, (now, before)) = decide(Signalled::Nobody);
        assert!(
            matches!(&told, Tell::Known { now, before } if now == &[1, 2] && before.is_empty()),
            "{told:?}"
        );
        assert_eq!(sorted(&now, &before).signal, vec![1, 2]);
    }

    #[test]
    fn everyone_signalled_before_is_only_waited_for() {
        let (told, (now, before)) = decide(Signalled::Everyone);
        assert!(
            matches!(&told, Tell::NoneNow { targets } if targets == &[1, 2]),
            "{told:?}"
        );
        let s = sorted(&now, &before);
        assert!(s.signal.is_empty());
        assert_eq!(s.waited, vec![1, 2]);
    }

    #[test]
    fn listed_processes_are_waited_for_and_the_others_signalled() {
        // B's PID was recycled: same host PID, another start time, so it is not the listed one.
        let listed = HashSet::from([A.id, (B.id.0, B.id.1 + 1)]);
        let (told, (now, before)) = decide(Signalled::Listed(listed));
        assert!(
            matches!(&told, Tell::Known { now, before } if now == &[2] && before == &[1]),
            "{told:?}"
        );
        let s = sorted(&now, &before);
        assert_eq!((s.signal, s.waited), (vec![2], vec![1]));
        assert!(s.unknown.is_empty());
    }

    #[test]
    fn unrecorded_notice_signals_when_notice_json_cannot_be_read() {
        let (told, (now, before)) = decide(Signalled::Unrecorded);
        assert!(
            matches!(&told, Tell::ByNotice { targets, if_unknown: true } if targets == &[1, 2]),
            "{told:?}"
        );
        assert_eq!(sorted(&now, &before).signal, vec![1, 2]);
    }

    #[test]
    fn unlisted_record_holds_every_target_when_notice_json_cannot_be_read() {
        let (told, (now, before)) = decide(Signalled::Unlisted);
        assert!(
            matches!(&told, Tell::ByNotice { targets, if_unknown: false } if targets == &[1, 2]),
            "{told:?}"
        );
        let s = sorted(&now, &before);
        assert!(s.signal.is_empty() && s.waited.is_empty());
        assert_eq!(s.unknown, vec![1, 2]);
    }

    #[test]
    fn an_answer_sorts_each_target_into_exactly_one_list() {
        let s = sort(vec![1, 2, 3], |n| *n, &[1], &[2]);
        assert_eq!(
            s,
            Sorted {
                signal: vec![1],
                waited: vec![2],
                unknown: vec![3],
            }
        );
    }
}
