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
//! than `notice.json` carrying this notice's id (see [`super::protocol::FileStamp`]). Ack latency is
//! measured on the agent's clock, from the signal to when the ack was seen. Group outcome:
//! `failed` if any process failed, else `exited` if any exited without `done`, else `skipped` if
//! any skipped, else `acked`.
//!
//! Dry-run: the processes are checked as for real, nothing is written or signalled, and the result
//! says what would have happened (`no_handler` when nothing catches the signal, else `skipped`
//! with a detail starting `dry-run:`); dry-run outcomes are not counted in the metrics.
//!
//! The parts: `delivery.rs` (the signal path: targets checked and pinned, notices written, signals
//! sent), `dir.rs` (the file side of a container's checkpoint dir and ack freshness), `watch.rs`
//! (waiting for acks and exits), `outcome.rs` (a group's result, detail and metrics),
//! `threads.rs` (the named threads and their accounting).

mod delivery;
mod dir;
mod outcome;
mod threads;
mod watch;

use std::collections::HashSet;
use std::time::Duration;

use jiff::Timestamp;

use super::ack::CheckpointDir;
use super::procfs::ProcFs;
use super::protocol::{AckFile, NoticeFile};
use super::Signal;
use crate::node::PodRef;

pub use delivery::{
    deliver, deliver_async, deliver_with, deliver_with_async, plan_without_signal,
    plan_without_signal_async, ContainerDelivery, Delivery, DeliveryState, NoticeStatus,
    SignalledProcess, SkippedProcess,
};
pub use outcome::{ExitSeen, GroupResult, MAX_PROGRESS_BYTES};
pub use watch::{wait, wait_until, wait_with};

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
    fn notice(&self, signal: Signal, prior: &Prior) -> NoticeFile {
        NoticeFile {
            notice_id: self.notice_id.clone(),
            source: self.source.clone(),
            kind: self.kind.clone(),
            deadline_unix: self.deadline.map(|d| d.as_second()),
            checkpoint_deadline_unix: self.checkpoint_deadline.as_second(),
            signal: signal.name(),
            life: prior.life.clone(),
            node: prior.node.clone(),
        }
    }
}

/// A terminal ack seen while its process lives ([`wait_with`]).
pub struct AckSeen<'a> {
    /// The group's pod (Kubernetes).
    pub pod: Option<&'a PodRef>,
    pub process: &'a SignalledProcess,
    /// The process's checkpoint dir (opened inside its container).
    pub dir: &'a CheckpointDir,
    pub ack: &'a AckFile,
    pub proc: &'a ProcFs,
}

/// Told of terminal acks on the watcher threads: it must be quick (no network), and it runs
/// before the process counts as acked, while the process lives.
pub type AckHook = std::sync::Arc<dyn Fn(&AckSeen<'_>) + Send + Sync>;

/// What is known before delivery about earlier deliveries of the same notice: "was this target
/// signalled for this notice?" is answered from evidence that survives a lost record and an
/// unwritable checkpoint dir (docs/checkpoint-protocol.md, "One signal per notice").
#[derive(Clone, Debug, Default)]
pub struct Prior {
    /// The machine's life (`crate::life`), written into `notice.json`: a `notice.json` of another
    /// life never counts as this notice.
    pub life: Option<String>,
    /// This agent's node (host) name, written into `notice.json` (`node`).
    pub node: Option<String>,
    /// When the record says the notice was signalled: a process that started later was never
    /// signalled for it and is left out.
    pub signalled_at: Option<Timestamp>,
    pub signalled: Signalled,
}

/// Who was signalled for this notice before, as far as the plan record knows.
#[derive(Clone, Debug, Default)]
pub enum Signalled {
    /// Nobody was (the caller knows): every target is signalled, `notice.json` is not consulted.
    #[default]
    Nobody,
    /// No record of this notice: a target whose `notice.json` names it was signalled before and
    /// is only waited for; every other target is signalled, also when its `notice.json` cannot be
    /// read (a first notice must reach trainers whose dir is unwritable or hung).
    Unrecorded,
    /// The record lists the processes (host PID, start time) signalled, written before the
    /// signal: those are only waited for, the others are signalled.
    Listed(HashSet<(i32, u64)>),
    /// The record says the notice was signalled but lists nobody (a record of an older agent, or
    /// one that could not be read): a target whose `notice.json` names the notice is waited for,
    /// one whose `notice.json` says otherwise is signalled, and one whose `notice.json` cannot be
    /// read is held (logged, counted): never a second signal.
    Unlisted,
    /// Every target was signalled before (the restart path of [`plan_without_signal`]).
    Everyone,
}

fn group_span(req: &CheckpointRequest, group: &str) -> tracing::Span {
    tracing::info_span!(
        "checkpoint",
        notice_id = %req.notice_id,
        source = %req.source,
        // A pod's namespace/name, or a host target (unit:NAME, pidfile:PATH, cmdline:REGEX).
        target_group = %group
    )
}
