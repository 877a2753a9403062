//! Watching the signalled processes: each group on a watcher thread of its own polls the acks in
//! its checkpoint dirs and the processes' exits until the group is finished or its budget
//! (enforced by the caller, outside the blocking calls) ran out.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::watch as tokio_watch;
use tokio_util::sync::CancellationToken;

use super::delivery::{Delivery, DeliveryState, NoticeStatus, SignalledProcess};
use super::dir::{DirSlot, Freshness};
use super::outcome::{ack_note, finish, pending_detail, record, skipped_detail, GroupResult};
use super::threads::{count_stuck, Counters};
use super::{AckHook, AckSeen, CheckpointRequest, POLL_INTERVAL, WATCH_GRACE};
use crate::checkpoint::ack::CheckpointDir;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::protocol::{
    ack_file_name, AckName, AckState, FileStamp, NOTICE_FILE, PLAIN_ACK_FILE,
};
use crate::checkpoint::{Outcome, PodRef};
use crate::metrics::{Metrics, ModuleErrorLabels};

/// What is known about one signalled process.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum ProcState {
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
        /// Its `progress-<ns_pid>.json` (the helper's progress record, at most
        /// [`MAX_PROGRESS_BYTES`](super::outcome::MAX_PROGRESS_BYTES), owned by the process's
        /// user), read as it was seen gone; unparsed (`crate::goodput` reads it).
        progress: Option<Vec<u8>>,
    },
}

#[derive(Debug)]
pub(super) struct ProcWatch {
    pub(super) process: SignalledProcess,
    pub(super) state: ProcState,
    /// Last unreadable-ack problem, for the detail.
    pub(super) problem: Option<String>,
}

#[derive(Debug)]
pub(super) struct ContainerWatch {
    pub(super) name: String,
    pub(super) dir: DirSlot,
    /// When the plain `ack` was first seen (agent clock).
    pub(super) plain_ack: Option<Timestamp>,
    pub(super) procs: Vec<ProcWatch>,
    /// Files at ack names owned by another user, already logged and counted (name, inode).
    pub(super) foreign: HashSet<(String, u64)>,
}

impl ContainerWatch {
    pub(super) fn finished(&self) -> bool {
        self.plain_ack.is_some()
            || self
                .procs
                .iter()
                .all(|p| !matches!(p.state, ProcState::Pending { .. }))
    }
}

#[derive(Debug)]
pub(super) struct GroupWatch {
    pub(super) group: String,
    pub(super) pod: Option<PodRef>,
    pub(super) signalled_at: Timestamp,
    pub(super) deadline: Timestamp,
    pub(super) containers: Vec<ContainerWatch>,
    pub(super) notice_problems: Vec<String>,
    pub(super) result: Option<GroupResult>,
    pub(super) proc: ProcFs,
    /// The plan's checkpoint deadline moved earlier than this group's own budget end.
    pub(super) cut: bool,
    pub(super) counters: Counters,
    /// Told of each terminal ack while its process lives ([`wait_with`]).
    pub(super) hook: Hook,
}

/// The hook of a group's watch, if any.
#[derive(Clone, Default)]
pub(super) struct Hook(Option<AckHook>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Hook(set)"
        } else {
            "Hook(none)"
        })
    }
}

impl GroupWatch {
    /// This group's result with `outcome`.
    pub(super) fn group_result(
        &self,
        outcome: Outcome,
        ack_latency: Option<Duration>,
        detail: String,
    ) -> GroupResult {
        GroupResult {
            group: self.group.clone(),
            pod: self.pod.clone(),
            outcome,
            signalled: self.containers.iter().map(|c| c.procs.len()).sum(),
            signalled_at: Some(self.signalled_at),
            ack_latency,
            detail,
            exits: super::outcome::exits(self),
        }
    }
}

/// Wait for every delivery to finish (acks, exits, plain ack) or run out of budget; one result per
/// delivery, in order. Each group is watched by a thread of its own; its budget is enforced here,
/// so a watcher stuck in a hung filesystem ends its group with `timeout` (the thread is abandoned
/// and counted) while every other group goes on. Counts `spotguard_checkpoint_total{outcome}` and
/// the ack-latency histogram as each group finishes. On `cancel` (agent shutting down)
/// unfinished groups end with `error` ("cancelled"), uncounted.
pub async fn wait(
    deliveries: Vec<Delivery>,
    req: &CheckpointRequest,
    metrics: &Metrics,
    cancel: &CancellationToken,
) -> Vec<GroupResult> {
    let (_keep, deadline) = tokio_watch::channel(req.checkpoint_deadline);
    wait_until(deliveries, req, metrics, cancel, deadline).await
}

/// [`wait`] with a checkpoint deadline that may move earlier while it waits (the notice's
/// deadline moved): every group's budget ends no later than the deadline's latest value, and a
/// group still waiting then ends `timeout` (counted, with a detail saying the deadline moved),
/// exactly as if its budget had been that short from the start.
pub async fn wait_until(
    deliveries: Vec<Delivery>,
    req: &CheckpointRequest,
    metrics: &Metrics,
    cancel: &CancellationToken,
    deadline: tokio_watch::Receiver<Timestamp>,
) -> Vec<GroupResult> {
    wait_with(deliveries, req, metrics, cancel, deadline, None).await
}

/// [`wait_until`], telling `hook` of each terminal ack on the watcher's thread, while the
/// acking process still lives and before it counts as acked (a staged checkpoint is taken
/// there: `crate::upload::ack::take`).
pub async fn wait_with(
    deliveries: Vec<Delivery>,
    req: &CheckpointRequest,
    metrics: &Metrics,
    cancel: &CancellationToken,
    deadline: tokio_watch::Receiver<Timestamp>,
    hook: Option<AckHook>,
) -> Vec<GroupResult> {
    use futures::stream::{FuturesUnordered, StreamExt};
    let mut results: Vec<Option<GroupResult>> = Vec::with_capacity(deliveries.len());
    let mut running = FuturesUnordered::new();
    for (i, d) in deliveries.into_iter().enumerate() {
        let mut w = watch(d, req, Counters::of(metrics));
        w.hook = Hook(hook.clone());
        match w.result.take() {
            Some(r) => {
                record(&r, req, metrics);
                results.push(Some(r));
            }
            None => {
                results.push(None);
                running.push(watch_group(
                    i,
                    w,
                    cancel.clone(),
                    deadline.clone(),
                    metrics.errors.clone(),
                ));
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

fn millis(t: Timestamp) -> i64 {
    t.as_millisecond()
}

fn until(t: Timestamp) -> Duration {
    Duration::try_from(t.duration_since(Timestamp::now()).max(SignedDuration::ZERO))
        .unwrap_or_default()
}

/// What a group's watcher thread shares with the task that waits for it.
#[derive(Clone)]
struct Shared {
    /// What the group still waits for, as of the last poll (for a result without the thread).
    detail: Arc<Mutex<String>>,
    /// Set when the task stopped waiting: the thread ends after its current poll.
    stop: Arc<AtomicBool>,
    /// The budget's end (milliseconds): moved earlier by the task when the deadline moves.
    end: Arc<AtomicI64>,
}

impl Shared {
    fn last_detail(&self) -> String {
        self.detail.lock().map(|g| g.clone()).unwrap_or_default()
    }
}

/// Watch one group on its own thread; the budget (plus [`WATCH_GRACE`]), a deadline moved
/// earlier and `cancel` are enforced here. Returns the group's index, its result and whether to
/// count it.
async fn watch_group(
    i: usize,
    mut w: GroupWatch,
    cancel: CancellationToken,
    mut moved: tokio_watch::Receiver<Timestamp>,
    errors: Family<ModuleErrorLabels, Counter>,
) -> (usize, GroupResult, bool) {
    let own_end = w.deadline;
    let first = *moved.borrow_and_update();
    if first < w.deadline {
        w.deadline = first;
        w.cut = true;
    }
    let shared = Shared {
        detail: Arc::new(Mutex::new(pending_detail(&w))),
        stop: Arc::new(AtomicBool::new(false)),
        end: Arc::new(AtomicI64::new(millis(w.deadline))),
    };
    let mut give_up = tokio::time::Instant::now() + until(w.deadline) + WATCH_GRACE;
    let base = w.group_result(Outcome::Error, None, String::new());
    let signalled_at = w.signalled_at;
    let mut rx = match start_poller(w, shared.clone()) {
        Ok(rx) => rx,
        Err(e) => {
            tracing::error!(group = %base.group, error = %e, "cannot start a checkpoint watcher thread");
            let detail = format!("no thread to watch this group: {e}");
            return (i, GroupResult { detail, ..base }, true);
        }
    };
    loop {
        tokio::select! {
            r = &mut rx => return match r {
                Ok(r) => (i, r, true),
                Err(_) => {
                    tracing::error!(group = %base.group, "checkpoint watcher thread panicked");
                    (i, GroupResult { detail: "watcher thread panicked".into(), ..base }, true)
                }
            },
            changed = moved.changed() => {
                if changed.is_err() {
                    // The deadline can no longer move: wait on without it.
                    moved = tokio_watch::channel(own_end).1;
                    continue;
                }
                let end = (*moved.borrow_and_update()).min(own_end);
                if millis(end) < shared.end.load(Ordering::Relaxed) {
                    shared.end.store(millis(end), Ordering::Relaxed);
                    give_up = tokio::time::Instant::now() + until(end) + WATCH_GRACE;
                }
            }
            _ = tokio::time::sleep_until(give_up) => {
                shared.stop.store(true, Ordering::Relaxed);
                count_stuck(&errors);
                let end = Timestamp::from_millisecond(shared.end.load(Ordering::Relaxed)).unwrap_or(own_end);
                return (i, stuck(base, end.duration_since(signalled_at), &shared), true);
            }
            _ = cancel.cancelled() => {
                shared.stop.store(true, Ordering::Relaxed);
                let detail = format!(
                    "cancelled (agent shutting down) while waiting: {}",
                    shared.last_detail()
                );
                return (i, GroupResult { detail, ..base }, false);
            }
        }
    }
}

/// Start the thread that polls the group every [`POLL_INTERVAL`] until it has a result (sent on
/// the returned channel) or is told to stop.
fn start_poller(
    mut w: GroupWatch,
    shared: Shared,
) -> std::io::Result<tokio::sync::oneshot::Receiver<GroupResult>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sg-ckpt-watch".into())
        .spawn(move || loop {
            let end = Timestamp::from_millisecond(shared.end.load(Ordering::Relaxed))
                .unwrap_or(w.deadline);
            if end < w.deadline {
                w.deadline = end;
                w.cut = true;
            }
            poll_group(&mut w, Timestamp::now());
            if let Some(r) = w.result.take() {
                let _ = tx.send(r);
                return;
            }
            let text = pending_detail(&w);
            if let Ok(mut g) = shared.detail.lock() {
                *g = text;
            }
            if shared.stop.load(Ordering::Relaxed) {
                return;
            }
            std::thread::sleep(POLL_INTERVAL);
        })?;
    Ok(rx)
}

/// The result of a group whose watcher is stuck past the budget (`budget` after the signal).
fn stuck(base: GroupResult, budget: SignedDuration, shared: &Shared) -> GroupResult {
    let budget_s = budget.as_secs_f64();
    tracing::error!(group = %base.group, budget_s, "checkpoint watcher stuck past the budget (hung filesystem?); abandoned");
    let detail = format!(
        "no terminal ack within {budget_s:.1}s, and the watcher is stuck in a filesystem or /proc call (hung mount?): {}",
        shared.last_detail()
    );
    GroupResult {
        outcome: Outcome::Timeout,
        detail,
        ..base
    }
}

/// Turn a delivery into a watch; deliveries with nothing to wait for get their result at once.
fn watch(d: Delivery, req: &CheckpointRequest, counters: Counters) -> GroupWatch {
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
    let result = immediate_result(&d);
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
                foreign: HashSet::new(),
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
        cut: false,
        counters,
        hook: Hook::default(),
    }
}

/// The result of a delivery that leaves nothing to wait for (nobody signalled, a dry run);
/// `None` when processes were signalled.
fn immediate_result(d: &Delivery) -> Option<GroupResult> {
    let immediate = |outcome: Outcome, detail: String| GroupResult {
        group: d.group.clone(),
        pod: d.pod.clone(),
        outcome,
        signalled: d.signalled(),
        signalled_at: d.signalled_at,
        ack_latency: None,
        detail,
        exits: Vec::new(),
    };
    let skipped = || skipped_detail(&d.containers).map(|s| format!(": {s}"));
    match &d.state {
        DeliveryState::Signalled => None,
        DeliveryState::NoHandler => Some(immediate(
            Outcome::NoHandler,
            format!(
                "no process catches {}{}",
                d.signal,
                skipped().unwrap_or_else(|| ": no process matched".into())
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
            Some(if pids.is_empty() {
                immediate(
                    Outcome::NoHandler,
                    format!(
                        "dry-run: no process catches {}{}",
                        d.signal,
                        skipped().unwrap_or_default()
                    ),
                )
            } else {
                immediate(
                    Outcome::Skipped,
                    format!(
                        "dry-run: would write {} and send {} to pids {pids:?}",
                        d.dir.join(NOTICE_FILE).display(),
                        d.signal
                    ),
                )
            })
        }
    }
}

/// One poll of one group: read acks, check exits, decide.
fn poll_group(w: &mut GroupWatch, now: Timestamp) {
    let proc = w.proc.clone();
    let counters = w.counters.clone();
    let hook = w.hook.clone();
    let pod = w.pod.clone();
    let told = |seen: &AckSeen<'_>| {
        if let Some(h) = &hook.0 {
            h(seen)
        }
    };
    let told: Told<'_> = (&told, pod.as_ref(), &proc);
    for c in &mut w.containers {
        if c.plain_ack.is_some() {
            continue;
        }
        c.take_late_dir();
        let DirSlot::Ready(dir, fresh) = &c.dir else {
            // No dir (yet): only exits can finish these processes.
            for p in &mut c.procs {
                check_exit(&proc, None, p, now);
            }
            continue;
        };
        // Fallback names (`ack-<pid>.<suffix>.json`, `ack.<suffix>`): one listing per poll.
        let fallbacks = match dir.fallback_acks() {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(error = %e, "cannot list the checkpoint dir");
                Vec::new()
            }
        };
        let plain = (dir, &**fresh, &fallbacks[..], &counters);
        if read_plain_acks(plain, &c.procs, &mut c.foreign) {
            c.plain_ack = Some(now);
            continue;
        }
        for p in &mut c.procs {
            if matches!(p.state, ProcState::Pending { .. }) {
                read_acks(
                    (dir, fresh, &fallbacks, &mut c.foreign, &counters),
                    p,
                    now,
                    Some(told),
                );
                check_exit(
                    &proc,
                    Some((dir, fresh, &fallbacks, &mut c.foreign, &counters)),
                    p,
                    now,
                );
            }
        }
    }
    if w.containers.iter().all(ContainerWatch::finished) {
        w.result = Some(finish(w));
    } else if now >= w.deadline {
        w.result = Some(timed_out(w));
    }
}

impl ContainerWatch {
    /// The dir of a file thread that answered after delivery stopped waiting for it, once it has.
    fn take_late_dir(&mut self) {
        if let DirSlot::Late(rx) = &self.dir {
            self.dir = match rx.try_recv() {
                Ok(job) => match job.dir {
                    Ok(dir) => DirSlot::Ready(dir, Box::new(job.fresh)),
                    Err(_) => DirSlot::None,
                },
                Err(mpsc::TryRecvError::Disconnected) => DirSlot::None,
                Err(mpsc::TryRecvError::Empty) => std::mem::replace(&mut self.dir, DirSlot::None),
            };
        }
    }
}

/// Whether a fresh plain ack (`ack` or a fallback `ack.<suffix>`) of one of the container's
/// users is in the dir; one of another user is reported once ([`foreign`], [`refused`]).
fn read_plain_acks(
    (dir, fresh, fallbacks, counters): (
        &CheckpointDir,
        &Freshness,
        &[(String, AckName)],
        &Counters,
    ),
    procs: &[ProcWatch],
    seen: &mut HashSet<(String, u64)>,
) -> bool {
    let container_uids: Vec<u32> = procs
        .iter()
        .flat_map(|p| p.process.uids.iter().copied())
        .collect();
    let plain_names = std::iter::once(PLAIN_ACK_FILE.to_string()).chain(
        fallbacks
            .iter()
            .filter(|(_, what)| *what == AckName::Plain)
            .map(|(n, _)| n.clone()),
    );
    for name in plain_names {
        match dir.plain_ack_named(&name) {
            Ok(Some(stamp)) if fresh.fresh(&name, &AckName::Plain, &stamp) => {
                if container_uids.contains(&stamp.uid) {
                    return true;
                }
                foreign(seen, dir, &name, &stamp, &container_uids, counters);
            }
            Ok(_) => {}
            Err(e) => refused(seen, &name, &e, counters, "unreadable plain ack"),
        }
    }
    false
}

/// The result of a group whose budget ran out.
fn timed_out(w: &GroupWatch) -> GroupResult {
    let budget = w.deadline.duration_since(w.signalled_at);
    let moved = if w.cut {
        format!(
            " (the notice's deadline moved earlier: checkpoint deadline {})",
            w.deadline
        )
    } else {
        String::new()
    };
    let detail = format!(
        "no terminal ack within {:.1}s{moved}: {}",
        budget.as_secs_f64(),
        pending_detail(w)
    );
    w.group_result(Outcome::Timeout, None, detail)
}

/// A file at an ack name whose owner is not the acknowledging process's user: never counted;
/// logged and counted once per file.
fn foreign(
    seen: &mut HashSet<(String, u64)>,
    dir: &CheckpointDir,
    name: &str,
    stamp: &FileStamp,
    owners: &[u32],
    counters: &Counters,
) {
    if seen.insert((name.to_string(), stamp.ino)) {
        counters.error("foreign_ack");
        tracing::warn!(
            dir = %dir.display(),
            file = name,
            owner = stamp.uid,
            expected = ?owners,
            "ignoring an ack written by another user"
        );
    }
}

/// The hook of a poll, the group's pod and the proc mount.
type Told<'a> = (&'a dyn Fn(&AckSeen<'_>), Option<&'a PodRef>, &'a ProcFs);

/// Read the process's acks (its plain name and its fallback names): a fresh one its own user
/// wrote counts; a terminal state wins over `received`. `told`: the process is alive, the hook
/// hears of its terminal ack; `None`: the process has exited, read from the dir as first opened.
fn read_acks(
    (dir, fresh, fallbacks, seen, counters): DirContext<'_>,
    p: &mut ProcWatch,
    now: Timestamp,
    told: Option<Told<'_>>,
) {
    let after_exit = told.is_none();
    let me = AckName::Process(p.process.ns_pid);
    let names = std::iter::once(ack_file_name(p.process.ns_pid)).chain(
        fallbacks
            .iter()
            .filter(|(_, what)| *what == me)
            .map(|(n, _)| n.clone()),
    );
    for name in names {
        let read = if after_exit {
            dir.read_ack_after_exit(&name)
        } else {
            dir.read_ack_named(&name)
        };
        match read {
            Ok(Some(ack)) if fresh.fresh(&name, &me, &ack.stamp) => {
                if !p.process.uids.contains(&ack.stamp.uid) {
                    foreign(seen, dir, &name, &ack.stamp, &p.process.uids, counters);
                    p.problem = Some(format!(
                        "{name} is owned by uid {}, not by the process: ignored",
                        ack.stamp.uid
                    ));
                    continue;
                }
                p.problem = None;
                if ack.file.state.is_terminal() {
                    if let Some((hook, pod, proc)) = told {
                        hook(&AckSeen {
                            pod,
                            process: &p.process,
                            dir,
                            ack: &ack.file,
                            proc,
                        });
                    }
                    p.state = ProcState::Acked {
                        state: ack.file.state,
                        at: now,
                        note: ack_note(&ack.file),
                    };
                    return;
                } else if let ProcState::Pending { received } = &mut p.state {
                    received.get_or_insert(now);
                }
            }
            Ok(_) => {}
            Err(e) => {
                refused(seen, &name, &e, counters, "unreadable ack");
                p.problem = Some(e.to_string());
            }
        }
    }
}

/// A read error at an ack name: a refused file (hard-linked, world-writable) is logged as a
/// warning and counted once per file; anything else (a writer caught mid-write) is debug noise.
fn refused(
    seen: &mut HashSet<(String, u64)>,
    name: &str,
    e: &crate::checkpoint::Error,
    counters: &Counters,
    other: &str,
) {
    match e {
        crate::checkpoint::Error::RefusedAck { ino, .. } => {
            if seen.insert((name.to_string(), *ino)) {
                counters.error(e.metric_label());
                tracing::warn!(error = %e, "ignoring a file at an ack name");
            }
        }
        _ => tracing::debug!(error = %e, "{other}"),
    }
}

type DirContext<'a> = (
    &'a CheckpointDir,
    &'a Freshness,
    &'a [(String, AckName)],
    &'a mut HashSet<(String, u64)>,
    &'a Counters,
);

fn check_exit(proc: &ProcFs, dir: Option<DirContext<'_>>, p: &mut ProcWatch, now: Timestamp) {
    if !matches!(p.state, ProcState::Pending { .. }) {
        return;
    }
    match proc.alive(p.process.pid, p.process.start_time) {
        Ok(true) => {}
        Ok(false) => {
            // It may have written `done` between the read above and its exit (read from the
            // dir as opened before: its container's mounts may be gone with it).
            let mut files = None;
            if let Some(dir) = dir {
                files = Some(dir.0);
                read_acks(dir, p, now, None);
            }
            if matches!(p.state, ProcState::Pending { .. }) {
                let progress = files.and_then(|d| super::outcome::read_progress(d, &p.process));
                p.state = ProcState::Exited { at: now, progress };
            }
        }
        Err(e) => {
            tracing::debug!(pid = p.process.pid, error = %e, "cannot check whether a target exited")
        }
    }
}
