//! The responder: turns accepted notices into the plan described in docs/architecture.md and carries it out.
//!
//! Interruption (and maintenance with `--on-maintenance drain`):
//!
//! 1. signal first: the local record (`<state-dir>/notice.json`, fsync'd, no API call) and the
//!    checkpoint signal to every known target;
//! 2. beside it / after it, each within a small budget tied to the deadline: taint + cordon, the
//!    Event, prefetch cancel and webhook, the Node annotation;
//! 3. wait for acks until `min(now + checkpoint-timeout, deadline − drain-reserve)`;
//! 4. drain until the deadline;
//! 5. only a complete drain is `drained` (Azure: acknowledged); a failed or blocked one is reported
//!    (`DrainFailed` Event, `spotguard_errors_total{module="drain"}`, [`PlanEvent::DrainFailed`]);
//!    every plan that runs ends with one [`PlanEvent::Done`].
//!
//! A restarted agent resumes from the persisted phase (local record and Node annotation, the
//! furthest wins): past `signalled` it never signals a process again that the record lists (the
//! record names every process about to be signalled, written before the signal), nor one whose
//! `notice.json` names the notice; past `drained` it never drains again. A record from another
//! life of the machine (another boot, or before a resume from hibernation: `crate::life`) belongs
//! to a previous life: what spotguard applied is undone, the record cleared, the agent armed
//! again; a resume seen while running (the handled interruption gone after its action time, or a
//! suspend jump of the clocks) does the same at once. Rebalance (default `checkpoint`): soft
//! taint, early checkpoint, undone after `--rebalance-expiry` unless an interruption follows; one
//! recommendation per life, however its `noticeTime` moves. Cancelled maintenance: undo exactly
//! what spotguard did, never an operator's cordon. The local record keeps one plan per notice
//! kind, so a later plan of one kind never erases what another kind did in this life.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::checkpoint::run::GroupResult;
use crate::checkpoint::TargetDiscovery;
use crate::config::{MaintenanceAction, RebalanceAction};
use crate::duration;
use crate::life::Lives;
use crate::metrics::{DecisionLabels, Metrics, NoticeLabels, OutcomeLabels, SourceLabels};
use crate::node::{reason, Applied, DrainReport, EventType, NodeOps, TaintEffect};
use crate::notice::{Cloud, Notice, NoticeKind, NoticeSource};
use record::Phase;
use record::PlanState;

mod plan;
mod policy;
pub mod record;
mod steps;
mod store;
mod undo;

use plan::*;
use policy::{policy_for, Policy};
use record::{RecordedTarget, Records, Resume, StateFile, LOAD_BUDGET};
pub use store::resume_hold;
pub use store::Decision;
use store::NoticeStore;
use undo::*;

/// Settings of the responder (from `run` flags).
#[derive(Clone, Debug)]
pub struct ResponderConfig {
    pub on_rebalance: RebalanceAction,
    pub rebalance_expiry: Duration,
    pub on_maintenance: MaintenanceAction,
    /// Azure `Freeze` (a pause of seconds): `ignore` by default.
    pub on_azure_freeze: MaintenanceAction,
    pub maintenance_lead: Duration,
    pub checkpoint_timeout: Duration,
    /// `--drain-reserve`; `None` = per cloud (25 s aws, 8 s gce/azure).
    pub drain_reserve: Option<Duration>,
    pub force_delete_at_deadline: bool,
    pub drain_concurrency: usize,
    pub dry_run: bool,
    /// On shutdown, how long an in-flight plan may go on.
    pub shutdown_grace: Duration,
    /// How long the handled interruption must stay away after its action time to count as a
    /// resume from hibernation ([`resume_hold`] of the poll interval).
    pub resume_hold: Duration,
    /// This node's (host's) name, written into `notice.json` (`node`) for the helper's
    /// interruption sidecar.
    pub node_name: Option<String>,
}

impl ResponderConfig {
    fn reserve(&self, source: Cloud) -> Duration {
        source.drain_reserve(self.drain_reserve)
    }
}

/// Something to call when handling of a notice starts (cancel prefetches, send the webhook).
pub type StartHook = Box<dyn Fn(&Notice) + Send + Sync>;

/// What the responder needs.
pub struct Deps {
    pub node: Arc<dyn NodeOps>,
    /// The local record (`<state-dir>/notice.json`), kept in every mode.
    pub local: StateFile,
    pub discovery: Arc<dyn TargetDiscovery>,
    pub sources: Vec<Arc<dyn NoticeSource>>,
    pub metrics: Arc<Metrics>,
    pub on_start: Vec<StartHook>,
    /// The machine's current life, written into every persisted record and `notice.json`: a
    /// record of another life belongs to a previous life of the machine.
    pub life: Arc<Lives>,
    /// Staged checkpoint uploads (`--upload-allow`); `None`: staged acks count as plain `done`
    /// and get no answer.
    pub upload: Option<Arc<crate::upload::service::Service>>,
}

/// Progress of a plan, broadcast for `spotguard drill` and tests.
#[derive(Clone, Debug)]
pub enum PlanEvent {
    /// A notice was accepted and a plan (or schedule) created.
    NoticeSeen { notice: Notice, at: Timestamp },
    /// Tainted / cordoned.
    Protected { id: String, at: Timestamp },
    /// Checkpoint signals delivered to `processes` processes.
    Signalled {
        id: String,
        at: Timestamp,
        processes: usize,
        checkpoint_deadline: Timestamp,
    },
    /// Checkpoint wait finished.
    Checkpointed {
        id: String,
        at: Timestamp,
        results: Vec<GroupResult>,
    },
    /// Drain finished (complete, or stopped at the deadline: the report says which).
    Drained {
        id: String,
        at: Timestamp,
        report: DrainReport,
    },
    /// The drain failed or did not complete: the node is not reported drained, Azure's event is
    /// not approved. Sent before the plan's `Done`.
    DrainFailed {
        id: String,
        at: Timestamp,
        reason: String,
    },
    /// A staged checkpoint's upload ended (or was refused: `report.outcome` is `refused`).
    Uploaded {
        id: String,
        at: Timestamp,
        /// `namespace/name` of the trainer's pod (Kubernetes).
        pod: Option<String>,
        report: Box<crate::upload::Report>,
    },
    /// Plan complete.
    Done { id: String, at: Timestamp },
    /// A notice was cancelled or expired and spotguard's changes undone.
    Undone { id: String, at: Timestamp },
}

/// What the notice store decided about one notice a source delivered, published for tests (the
/// seam in `testkit`) and counted in `spotguard_notice_decisions_total` once the responder has
/// handled it (a plan it starts has sent its [`PlanEvent::NoticeSeen`]): every notice, a
/// [`Decision::Duplicate`] (a re-poll, never a second plan) included, so that a test waits for
/// the decision instead of for a silence.
#[derive(Clone, Debug)]
pub struct Decided {
    /// The notice as the source delivered it.
    pub notice: Notice,
    pub decision: Decision,
    /// When the store decided.
    pub at: Timestamp,
}

/// Nominal deadline for plans whose notice carries none (rebalance with `drain`): EC2's
/// two-minute interruption warning.
const NOMINAL_DEADLINE: Duration = Duration::from_secs(120);

/// A running plan.
struct Running {
    /// Which plan this is (plans of the same notice id can follow each other).
    seq: u64,
    id: String,
    kind: NoticeKind,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    deadline_tx: watch::Sender<Timestamp>,
}

impl Running {
    fn active(&self) -> bool {
        !self.task.is_finished()
    }
}

/// What the responder's loop holds between inputs.
struct Loop {
    store: NoticeStore,
    running: Option<Running>,
    /// Maintenance notices waiting for `not_before − lead`, by notice id.
    scheduled: HashMap<String, Scheduled>,
    /// A rebalance recommendation checkpointed for, waiting for its expiry.
    rebalance_expiry: Option<(String, JoinHandle<()>)>,
    /// Plans cancelled by shutdown stop at the grace period, not at once.
    plan_cancel: CancellationToken,
    due_tx: mpsc::Sender<Notice>,
    expired_tx: mpsc::Sender<String>,
    expiry_due_tx: mpsc::Sender<String>,
}

/// Send `value` on `tx` after `wait` (a timer the loop can abort).
fn send_after<T: Send + 'static>(tx: mpsc::Sender<T>, wait: Duration, value: T) -> JoinHandle<()> {
    tokio::spawn(async move {
        tokio::time::sleep(wait).await;
        let _ = tx.send(value).await;
    })
}

/// A maintenance notice waiting for `not_before − lead`.
struct Scheduled {
    timer: JoinHandle<()>,
}

/// The responder task.
pub struct Responder {
    cfg: ResponderConfig,
    deps: Arc<Deps>,
    events: broadcast::Sender<PlanEvent>,
    /// Every store decision ([`Responder::decisions`]).
    decisions: broadcast::Sender<Decided>,
    next_seq: std::sync::atomic::AtomicU64,
    /// Plans report here when they end, so that the responder is free at once.
    finished_tx: mpsc::UnboundedSender<u64>,
    finished_rx: Option<mpsc::UnboundedReceiver<u64>>,
}

impl Responder {
    pub fn new(cfg: ResponderConfig, deps: Deps) -> Self {
        let (events, _) = broadcast::channel(256);
        let (decisions, _) = broadcast::channel(256);
        let (tx, rx) = mpsc::unbounded_channel();
        Responder {
            cfg,
            deps: Arc::new(deps),
            events,
            decisions,
            next_seq: std::sync::atomic::AtomicU64::new(0),
            finished_tx: tx,
            finished_rx: Some(rx),
        }
    }

    /// Subscribe to plan progress.
    pub fn subscribe(&self) -> broadcast::Receiver<PlanEvent> {
        self.events.subscribe()
    }

    /// Subscribe to the store's decisions, one per notice delivered (nothing waits on a
    /// subscriber: one that lags loses the oldest).
    pub fn decisions(&self) -> broadcast::Receiver<Decided> {
        self.decisions.subscribe()
    }

    /// Run until `cancel`; then give an in-flight plan up to the shutdown grace period.
    ///
    /// One loop, one handler per input: a notice from a monitor (dispatched per store
    /// decision), a plan that ended, a maintenance window that came due, a rebalance plan that
    /// checkpointed, a rebalance recommendation that expired.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Notice>, cancel: CancellationToken) {
        // `run` consumes the responder: the receiver is always there.
        let mut finished_rx = self
            .finished_rx
            .take()
            .unwrap_or_else(|| mpsc::unbounded_channel().1);
        let (due_tx, mut due_rx) = mpsc::channel::<Notice>(16);
        let (expired_tx, mut expired_rx) = mpsc::channel::<String>(4);
        let (expiry_due_tx, mut expiry_due_rx) = mpsc::channel::<String>(4);
        let mut st = Loop {
            store: NoticeStore::new(),
            running: None,
            scheduled: HashMap::new(),
            rebalance_expiry: None,
            plan_cancel: CancellationToken::new(),
            due_tx,
            expired_tx,
            expiry_due_tx,
        };

        self.resume(&mut st).await;
        let mut suspend_check = tokio::time::interval(crate::life::SUSPEND_CHECK_EVERY);
        suspend_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

        loop {
            // A finished plan frees the responder for the next notice.
            if st.running.as_ref().is_some_and(|r| !r.active()) {
                st.running = None;
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                Some(seq) = finished_rx.recv() => {
                    if st.running.as_ref().is_some_and(|r| r.seq == seq) {
                        st.running = None;
                    }
                }
                maybe = rx.recv() => {
                    let Some(notice) = maybe else { break };
                    self.on_notice(&mut st, notice).await;
                }
                Some(n) = due_rx.recv() => self.on_maintenance_due(&mut st, n).await,
                Some(id) = expired_rx.recv() => self.on_rebalance_checkpointed(&mut st, id),
                Some(id) = expiry_due_rx.recv() => self.on_rebalance_expired(&mut st, id).await,
                _ = suspend_check.tick() => {
                    if let Some(secs) = self.deps.life.check_suspend() {
                        let why = format!("the machine was suspended for about {secs} s (a resume from hibernation)");
                        self.on_resumed(&mut st, &why, false).await;
                    } else if let Some(id) = st.store.resume_due(Timestamp::now(), self.cfg.resume_hold) {
                        let why = format!(
                            "the interruption it handled ({id}) left the metadata service after its action time and stayed away for {} s: the machine went through it (hibernation) and resumed",
                            self.cfg.resume_hold.as_secs()
                        );
                        self.on_resumed(&mut st, &why, true).await;
                    }
                }
            }
        }
        self.shut_down(st).await;
    }

    /// A notice from a monitor: the store decides what it is, one handler per decision.
    async fn on_notice(&self, st: &mut Loop, notice: Notice) {
        let now = Timestamp::now();
        let decision = st.store.accept(&notice, now);
        self.count_notice(&notice, &decision, now);
        // Published once handled: whoever sees a decision sees what it started.
        let decided = decision.clone();
        match decision {
            Decision::Duplicate => {}
            Decision::GoneAfterAction(id) => info!(
                notice_id = %id,
                hold_ms = self.cfg.resume_hold.as_millis() as u64,
                "the interruption it handled is no longer served after its action time: a resume from hibernation if it stays away for the hold"
            ),
            Decision::StartInterruption(n) => self.on_interruption(st, n).await,
            Decision::NewInterruption(n) => self.on_new_interruption(st, n, now).await,
            Decision::DeadlineMoved(d) => self.on_deadline_moved(st, d),
            Decision::New(n) => self.on_new_notice(st, n, false, now).await,
            Decision::Updated(n) => self.on_new_notice(st, n, true, now).await,
            Decision::Cancel(id) => self.on_cancel(st, id).await,
        }
        self.publish_decision(notice, decided, now);
    }

    /// An interruption supersedes everything: scheduled maintenance, a rebalance's expiry, the
    /// plan in progress.
    async fn on_interruption(&self, st: &mut Loop, n: Notice) {
        for (_, s) in st.scheduled.drain() {
            s.timer.abort();
        }
        if let Some((_, t)) = st.rebalance_expiry.take() {
            t.abort();
        }
        if let Some(r) = st.running.take() {
            info!(notice_id = %r.id, "interruption supersedes the plan in progress");
            r.cancel.cancel();
            let _ = r.task.await;
        }
        st.running = Some(self.start_plan(n, None, st));
    }

    fn on_deadline_moved(&self, st: &mut Loop, d: Timestamp) {
        if let Some(r) = &st.running {
            info!(notice_id = %r.id, deadline = %d, "interruption deadline moved earlier");
            let _ = r.deadline_tx.send(d);
        }
        self.deps.metrics.deadline.set(d.as_second() as f64);
    }

    /// A new (or changed) maintenance or rebalance notice (the store decides none while an
    /// interruption is in progress).
    async fn on_new_notice(&self, st: &mut Loop, n: Notice, updated: bool, now: Timestamp) {
        match n.kind {
            NoticeKind::Maintenance => self.on_maintenance(st, n, updated, now).await,
            NoticeKind::Rebalance => {
                if st.running.as_ref().is_some_and(|r| r.active()) {
                    info!(notice_id = %n.id, "a plan is in progress: rebalance recommendation noted");
                    return;
                }
                st.running = Some(self.start_plan(n, None, st));
            }
            _ => {}
        }
    }

    /// Scheduled maintenance: act `maintenance_lead` before its window; a window that moves
    /// while its plan runs moves the plan's deadline.
    async fn on_maintenance(&self, st: &mut Loop, n: Notice, updated: bool, now: Timestamp) {
        if let Some(r) = st.running.as_ref().filter(|r| r.id == n.id && r.active()) {
            // The window moved (or became known) while its plan runs.
            let d = duration::effective_deadline(n.not_before.or(n.deadline), now);
            info!(notice_id = %n.id, deadline = %d, "maintenance window changed: plan deadline updated");
            let _ = r.deadline_tx.send(d);
            return;
        }
        if updated && self.plan_finished(&n.id).await {
            info!(notice_id = %n.id, "maintenance window changed after its plan completed: nothing to redo");
            return;
        }
        let start = duration::maintenance_start(
            n.not_before.or(n.deadline).unwrap_or(now),
            self.cfg.maintenance_lead,
            now,
        );
        if let Some(old) = st.scheduled.remove(&n.id) {
            old.timer.abort();
        }
        let _ = self.events.send(PlanEvent::NoticeSeen {
            notice: n.clone(),
            at: now,
        });
        info!(notice_id = %n.id, start = %start, "maintenance scheduled");
        let id = n.id.clone();
        let timer = send_after(st.due_tx.clone(), duration::until(start, now), n);
        st.scheduled.insert(id, Scheduled { timer });
    }

    /// The cloud withdrew a notice: stop what it started and undo what was applied for it.
    async fn on_cancel(&self, st: &mut Loop, id: String) {
        if let Some(s) = st.scheduled.remove(&id) {
            s.timer.abort();
            info!(notice_id = %id, "scheduled maintenance cancelled before it started");
            let _ = self.events.send(PlanEvent::Undone {
                id: id.clone(),
                at: Timestamp::now(),
            });
        }
        let cancels_plan = st
            .running
            .as_ref()
            .is_some_and(|r| r.id == id && r.kind != NoticeKind::Interruption);
        let last_plan = self
            .deps
            .local
            .load_record()
            .await
            .ok()
            .flatten()
            .is_some_and(|r| r.plans().any(|s| s.id == id && s.phase != Phase::Undone));
        if cancels_plan {
            if let Some(r) = st.running.take() {
                r.cancel.cancel();
                let _ = r.task.await;
            }
            self.undo(&id, "cancelled by the cloud").await;
        } else if st
            .rebalance_expiry
            .as_ref()
            .is_some_and(|(rid, _)| *rid == id)
        {
            if let Some((_, t)) = st.rebalance_expiry.take() {
                t.abort();
            }
            self.undo(&id, "cancelled by the cloud").await;
        } else if last_plan {
            // A finished maintenance plan (cordon-only, or drained) cancelled.
            self.undo(&id, "cancelled by the cloud").await;
        }
    }

    /// A scheduled maintenance window came due: start its plan unless another plan must finish
    /// first (a rebalance plan gives way).
    async fn on_maintenance_due(&self, st: &mut Loop, n: Notice) {
        st.scheduled.remove(&n.id);
        if st.store.interruption().is_some() {
            return;
        }
        if let Some(r) = st.running.take() {
            if r.kind == NoticeKind::Rebalance || !r.active() {
                r.cancel.cancel();
                let _ = r.task.await;
            } else {
                info!(notice_id = %n.id, "another plan in progress: maintenance handled after it");
                st.running = Some(r);
                return;
            }
        }
        st.running = Some(self.start_plan(n, None, st));
    }

    /// A rebalance plan finished its early checkpoint: undo after the expiry.
    fn on_rebalance_checkpointed(&self, st: &mut Loop, id: String) {
        let t = send_after(
            st.expiry_due_tx.clone(),
            self.cfg.rebalance_expiry,
            id.clone(),
        );
        if let Some((_, old)) = st.rebalance_expiry.replace((id, t)) {
            old.abort();
        }
    }

    /// A rebalance recommendation expired without an interruption: undo what it applied.
    async fn on_rebalance_expired(&self, st: &mut Loop, id: String) {
        st.rebalance_expiry = None;
        if st.store.interruption().is_some() {
            return;
        }
        if let Some(r) = st.running.take_if(|r| r.id == id) {
            r.cancel.cancel();
            let _ = r.task.await;
        }
        // The store keeps the recommendation: the same `noticeTime`, served until the instance
        // dies, never starts a second plan.
        self.undo(
            &id,
            "rebalance recommendation expired without an interruption",
        )
        .await;
    }

    /// A new life of the machine began while the agent ran (a resume from hibernation): what the
    /// previous life's plans applied is undone, their records cleared, and the agent is armed
    /// again for every kind of notice.
    async fn on_resumed(&self, st: &mut Loop, why: &str, begin_life: bool) {
        let life = if begin_life {
            self.deps.life.begin_new_life()
        } else {
            self.deps.life.id()
        };
        warn!(
            life = life.as_deref().unwrap_or("unknown"),
            "{why}: a new life of the machine; arming again"
        );
        for (_, s) in st.scheduled.drain() {
            s.timer.abort();
        }
        if let Some((_, t)) = st.rebalance_expiry.take() {
            t.abort();
        }
        if let Some(r) = st.running.take() {
            r.cancel.cancel();
            let _ = r.task.await;
        }
        st.store = NoticeStore::new();
        let loaded = Records::new(&self.deps).load_all().await;
        for state in loaded.latest.into_iter().chain(loaded.earlier) {
            self.undoer().previous_life(state).await;
        }
    }

    /// Another interruption after the handled one's action time: the machine went through that
    /// one, so this is a new life (whatever hold was running or record was restored), and the new
    /// notice is its first interruption, started at once.
    async fn on_new_interruption(&self, st: &mut Loop, n: Notice, now: Timestamp) {
        let why = format!(
            "another interruption ({}) is served after the action time of the one it handled",
            n.id
        );
        self.on_resumed(st, &why, true).await;
        match st.store.accept(&n, now) {
            Decision::StartInterruption(n) => self.on_interruption(st, n).await,
            other => {
                warn!(notice_id = %n.id, decision = other.label(), "a new life's store did not start its first interruption")
            }
        }
    }

    /// Shutdown: monitors have stopped; an in-flight plan gets the grace period.
    async fn shut_down(&self, mut st: Loop) {
        for (_, s) in st.scheduled.drain() {
            s.timer.abort();
        }
        if let Some((_, t)) = st.rebalance_expiry.take() {
            t.abort();
        }
        let Some(r) = st.running.take().filter(|r| r.active()) else {
            return;
        };
        info!(notice_id = %r.id, grace_ms = self.cfg.shutdown_grace.as_millis() as u64, "waiting for the plan in progress before exiting");
        let mut task = r.task;
        match tokio::time::timeout(self.cfg.shutdown_grace, &mut task).await {
            Ok(_) => info!(notice_id = %r.id, "plan finished; exiting"),
            Err(_) => {
                warn!(notice_id = %r.id, "shutdown grace period over: stopping the plan; a restarted agent resumes it from the persisted phase");
                st.plan_cancel.cancel();
                let _ = task.await;
            }
        }
    }

    /// Whether the plan of `id` persisted in the record completed (this life of the machine).
    async fn plan_finished(&self, id: &str) -> bool {
        self.deps
            .local
            .load_record()
            .await
            .ok()
            .flatten()
            .is_some_and(|r| {
                r.plans().any(|s| {
                    s.id == id
                        && s.phase == Phase::Done
                        && self.deps.life.is_current(s.boot_id.as_deref())
                })
            })
    }

    fn undoer(&self) -> Undoer {
        Undoer {
            deps: self.deps.clone(),
            records: Records::new(&self.deps),
            events: self.events.clone(),
        }
    }

    async fn undo(&self, id: &str, why: &str) {
        self.undoer().undo(id, why).await
    }

    /// Count the store's decision about `notice` and publish it to [`Responder::decisions`].
    fn publish_decision(&self, notice: Notice, decision: Decision, now: Timestamp) {
        self.deps
            .metrics
            .notice_decisions
            .get_or_create(&DecisionLabels {
                kind: notice.kind.label().into(),
                decision: decision.label().into(),
            })
            .inc();
        let _ = self.decisions.send(Decided {
            notice,
            decision,
            at: now,
        });
    }

    /// Count and log an accepted notice: as the plan uses it (an interruption's deadline
    /// clamped into EC2's two minutes after first sight, or "now" when past).
    fn count_notice(&self, notice: &Notice, decision: &Decision, now: Timestamp) {
        let notice = match decision {
            Decision::StartInterruption(n)
            | Decision::NewInterruption(n)
            | Decision::New(n)
            | Decision::Updated(n) => n,
            Decision::Cancel(_) | Decision::GoneAfterAction(_) => notice,
            Decision::DeadlineMoved(_) | Decision::Duplicate => return,
        };
        let m = &self.deps.metrics;
        m.notices
            .get_or_create(&NoticeLabels {
                source: notice.source.as_str().into(),
                kind: notice.kind.label().into(),
            })
            .inc();
        if let Some(p) = notice.published_at {
            let secs = notice.observed_at.duration_since(p).as_secs_f64();
            if secs >= 0.0 {
                m.detection_latency
                    .get_or_create(&SourceLabels {
                        source: notice.source.as_str().into(),
                    })
                    .observe(secs);
            }
        }
        let seen_after_ms = now.duration_since(notice.observed_at).as_millis() as i64;
        match notice.deadline {
            Some(deadline) => info!(
                notice_id = %notice.id,
                source = notice.source.as_str(),
                kind = notice.kind.label(),
                deadline = %deadline,
                detail = %notice.detail,
                seen_after_ms,
                cloud_event_id = notice.cloud_event_id.as_deref(),
                "notice accepted"
            ),
            None => info!(
                notice_id = %notice.id,
                source = notice.source.as_str(),
                kind = notice.kind.label(),
                detail = %notice.detail,
                seen_after_ms,
                cloud_event_id = notice.cloud_event_id.as_deref(),
                "notice accepted"
            ),
        }
    }

    /// Resume a plan persisted by an earlier run of the agent; remember the other kinds' plans of
    /// this life; undo those of a previous life.
    async fn resume(&self, st: &mut Loop) {
        let loaded = Records::new(&self.deps).load_all().await;
        let now = Timestamp::now();
        for state in loaded.earlier {
            let decision = record::resume(&state, self.deps.life.id().as_deref());
            info!(notice_id = %state.id, phase = state.phase.as_str(), kind = state.kind.label(), previous_life = decision == Resume::PreviousLife, "found an earlier plan of another kind");
            match decision {
                Resume::PreviousLife => self.undoer().previous_life(state).await,
                _ => record::remember(&mut st.store, &state, now),
            }
        }
        let Some(state) = loaded.latest else {
            return;
        };
        let decision = record::resume(&state, self.deps.life.id().as_deref());
        info!(notice_id = %state.id, phase = state.phase.as_str(), kind = state.kind.label(), previous_life = decision == Resume::PreviousLife, "found persisted plan state");
        match decision {
            Resume::PreviousLife => self.undoer().previous_life(state).await,
            Resume::Remember => record::remember(&mut st.store, &state, now),
            Resume::AwaitExpiry => {
                record::remember(&mut st.store, &state, now);
                let left = state
                    .deadline
                    .map(|d| duration::until(d, now))
                    .unwrap_or(Duration::ZERO);
                let t = send_after(st.expiry_due_tx.clone(), left, state.id.clone());
                st.rebalance_expiry = Some((state.id.clone(), t));
            }
            Resume::Continue => {
                record::remember(&mut st.store, &state, now);
                let notice = record::notice_of(&state);
                st.running = Some(self.start_plan(notice, Some((state, loaded.targets)), st));
            }
        }
    }

    fn start_plan(
        &self,
        notice: Notice,
        resume: Option<(PlanState, Vec<RecordedTarget>)>,
        st: &Loop,
    ) -> Running {
        let now = Timestamp::now();
        let deadline = match notice.kind {
            NoticeKind::Rebalance => {
                match (&resume.as_ref().map(|r| &r.0), self.cfg.on_rebalance) {
                    // A resumed rebalance keeps its expiry.
                    (Some(s), _) if s.deadline.is_some() => {
                        duration::effective_deadline(s.deadline, now)
                    }
                    (_, RebalanceAction::Drain) => duration::add(now, NOMINAL_DEADLINE),
                    _ => duration::add(now, self.cfg.rebalance_expiry),
                }
            }
            _ => duration::effective_deadline(notice.deadline, now),
        };
        let (deadline_tx, deadline_rx) = watch::channel(deadline);
        let cancel = st.plan_cancel.child_token();
        let seq = self
            .next_seq
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let plan = Plan {
            seq,
            finished_tx: self.finished_tx.clone(),
            cfg: self.cfg.clone(),
            deps: self.deps.clone(),
            records: Records::new(&self.deps),
            events: self.events.clone(),
            notice: notice.clone(),
            deadline: deadline_rx,
            cancel: cancel.clone(),
            expired_tx: st.expired_tx.clone(),
            reoccurred: st.store.reoccurred(&notice.id),
        };
        if resume.is_none() {
            let _ = self.events.send(PlanEvent::NoticeSeen {
                notice: notice.clone(),
                at: now,
            });
        }
        let span = tracing::info_span!("plan", notice_id = %notice.id, source = notice.source.as_str(), kind = notice.kind.label());
        let task = tokio::spawn(plan.run(resume).instrument(span));
        Running {
            seq,
            id: notice.id,
            kind: notice.kind,
            cancel,
            task,
            deadline_tx,
        }
    }
}
