//! The responder: turns accepted notices into the plan of design §4 and carries it out.
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
//! furthest wins): past `signalled` it never signals again (a target group whose `notice.json`
//! lacks the notice id did not get the signal and gets it now), past `drained` it never drains
//! again. A record from another boot belongs to a previous life of the machine: what spotguard
//! applied is undone, the record cleared, the agent armed again. Rebalance (default
//! `checkpoint`): soft taint, early checkpoint, undone after `--rebalance-expiry` unless an
//! interruption follows; the same recommendation never acts twice. Cancelled maintenance: undo
//! exactly what spotguard did, never an operator's cordon.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::checkpoint::ack::CheckpointDir;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::run::{self as ckpt, CheckpointRequest, GroupResult};
use crate::checkpoint::{Outcome, TargetDiscovery, TargetGroup};
use crate::config::{MaintenanceAction, RebalanceAction};
use crate::metrics::{Metrics, NoticeLabels, OutcomeLabels, SourceLabels};
use crate::node::host::StateFile;
use crate::node::{
    reason, Applied, DrainReport, DrainRequest, EventType, NodeOps, Phase, PlanState, Protection,
    TaintEffect,
};
use crate::notice::store::{self, Decision, NoticeStore, Resume};
use crate::notice::{Notice, NoticeKind, NoticeSource, Source};

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
    /// Boot id of this machine, written into every persisted record: a record from another boot
    /// belongs to a previous life of the machine.
    pub boot_id: Option<String>,
}

impl ResponderConfig {
    fn reserve(&self, source: Source) -> Duration {
        crate::config::drain_reserve(self.drain_reserve, source)
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
    /// Plan complete.
    Done { id: String, at: Timestamp },
    /// A notice was cancelled or expired and spotguard's changes undone.
    Undone { id: String, at: Timestamp },
}

/// The steps a plan takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Steps {
    taint: Option<TaintEffect>,
    cordon: bool,
    checkpoint: bool,
    drain: bool,
}

fn steps_for(notice: &Notice, cfg: &ResponderConfig) -> Option<Steps> {
    let full = Steps {
        taint: Some(TaintEffect::NoSchedule),
        cordon: true,
        checkpoint: true,
        drain: true,
    };
    let maintenance = if crate::notice::azure::is_freeze(notice) {
        cfg.on_azure_freeze
    } else {
        cfg.on_maintenance
    };
    match &notice.kind {
        NoticeKind::Interruption => Some(full),
        NoticeKind::Maintenance => match maintenance {
            MaintenanceAction::Ignore => None,
            MaintenanceAction::Cordon => Some(Steps {
                checkpoint: false,
                drain: false,
                ..full
            }),
            MaintenanceAction::Drain => Some(full),
        },
        NoticeKind::Rebalance => match cfg.on_rebalance {
            RebalanceAction::Ignore => None,
            RebalanceAction::Cordon => Some(Steps {
                taint: Some(TaintEffect::PreferNoSchedule),
                cordon: true,
                checkpoint: false,
                drain: false,
            }),
            RebalanceAction::Checkpoint => Some(Steps {
                taint: Some(TaintEffect::PreferNoSchedule),
                cordon: false,
                checkpoint: true,
                drain: false,
            }),
            RebalanceAction::Drain => Some(full),
        },
        NoticeKind::Cancelled(_) => None,
    }
}

/// Nominal deadline for plans whose notice carries none (rebalance with `drain`): EC2's
/// two-minute interruption warning.
const NOMINAL_DEADLINE: Duration = Duration::from_secs(120);

fn event_reason(kind: &NoticeKind) -> &'static str {
    match kind {
        NoticeKind::Interruption => reason::SPOT_INTERRUPTION,
        NoticeKind::Rebalance => reason::REBALANCE,
        NoticeKind::Maintenance => reason::MAINTENANCE,
        NoticeKind::Cancelled(_) => reason::NOTICE_CANCELLED,
    }
}

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

#[derive(Clone, Copy)]
enum DecisionKind {
    Updated,
    Other,
}

/// A maintenance notice waiting for `not_before − lead`.
struct Scheduled {
    timer: JoinHandle<()>,
}

/// Upper bound of one step beside the signal (protect, Event, annotation): a quarter of the time
/// left, between 1 s and 10 s.
const SIDE_BUDGET_MAX: Duration = Duration::from_secs(10);
const SIDE_BUDGET_MIN: Duration = Duration::from_secs(1);
/// Bound on reading the Node annotation at start-up (the local record answers without it).
const LOAD_BUDGET: Duration = Duration::from_secs(5);

fn side_budget(deadline: Timestamp, now: Timestamp) -> Duration {
    (store::until(deadline, now) / 4).clamp(SIDE_BUDGET_MIN, SIDE_BUDGET_MAX)
}

/// The two copies of the plan record: the local file (always; written first, fsync'd) and the Node
/// annotation (Kubernetes mode; within a budget).
#[derive(Clone)]
struct Records {
    local: StateFile,
    node: Arc<dyn NodeOps>,
    metrics: Arc<Metrics>,
}

impl Records {
    fn new(deps: &Deps) -> Self {
        Records {
            local: deps.local.clone(),
            node: deps.node.clone(),
            metrics: deps.metrics.clone(),
        }
    }

    fn remote(&self) -> bool {
        !self.node.state_is_local()
    }

    async fn save_local(&self, state: &PlanState) {
        if let Err(e) = self.local.save(state).await {
            error!(phase = state.phase.as_str(), error = %e, "persisting the local plan record failed");
            self.metrics.error("responder", e.metric_label());
        }
    }

    async fn save_remote(&self, state: &PlanState, budget: Duration) {
        if !self.remote() {
            return;
        }
        match tokio::time::timeout(budget, self.node.save_state(state)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                error!(phase = state.phase.as_str(), error = %e, "persisting the plan state on the node failed");
                self.metrics.error("responder", e.metric_label());
            }
            Err(_) => {
                warn!(
                    phase = state.phase.as_str(),
                    budget_ms = budget.as_millis() as u64,
                    "persisting the plan state on the node ran out of its budget"
                );
                self.metrics.error("responder", "state_timeout");
            }
        }
    }

    async fn save(&self, state: &PlanState, budget: Duration) {
        self.save_local(state).await;
        self.save_remote(state, budget).await;
    }

    async fn clear(&self, budget: Duration) {
        if let Err(e) = self.local.clear().await {
            error!(error = %e, "clearing the local plan record failed");
            self.metrics.error("responder", e.metric_label());
        }
        if self.remote() {
            match tokio::time::timeout(budget, self.node.clear_state()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    error!(error = %e, "clearing the plan state on the node failed");
                    self.metrics.error("responder", e.metric_label());
                }
                Err(_) => self.metrics.error("responder", "state_timeout"),
            }
        }
    }

    /// The persisted record: the local file and the Node annotation, the one further along wins
    /// (the same notice: the later phase; different notices: the newer record). An unreadable
    /// copy is logged and counted; an API outage leaves the local record.
    async fn load(&self) -> Option<PlanState> {
        let local = match self.local.load().await {
            Ok(s) => s,
            Err(e) => {
                error!(error = %e, "local plan record unreadable: ignoring it");
                self.metrics.error("responder", e.metric_label());
                None
            }
        };
        let remote = if self.remote() {
            match tokio::time::timeout(LOAD_BUDGET, self.node.load_state()).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    error!(error = %e, "plan state on the node unreadable: using the local record");
                    self.metrics.error("responder", e.metric_label());
                    None
                }
                Err(_) => {
                    warn!(
                        budget_ms = LOAD_BUDGET.as_millis() as u64,
                        "API server did not answer: using the local record"
                    );
                    self.metrics.error("responder", "state_timeout");
                    None
                }
            }
        } else {
            None
        };
        newest(local, remote)
    }
}

/// The record further along of two copies.
fn newest(local: Option<PlanState>, remote: Option<PlanState>) -> Option<PlanState> {
    match (local, remote) {
        (Some(l), Some(r)) => {
            let remote_ahead = if l.id == r.id && l.kind == r.kind {
                r.phase > l.phase
            } else {
                r.updated_at > l.updated_at
            };
            Some(if remote_ahead { r } else { l })
        }
        (l, r) => l.or(r),
    }
}

/// The responder task.
pub struct Responder {
    cfg: ResponderConfig,
    deps: Arc<Deps>,
    events: broadcast::Sender<PlanEvent>,
    next_seq: std::sync::atomic::AtomicU64,
    /// Plans report here when they end, so that the responder is free at once.
    finished_tx: mpsc::UnboundedSender<u64>,
    finished_rx: Option<mpsc::UnboundedReceiver<u64>>,
}

impl Responder {
    pub fn new(cfg: ResponderConfig, deps: Deps) -> Self {
        let (events, _) = broadcast::channel(256);
        let (tx, rx) = mpsc::unbounded_channel();
        Responder {
            cfg,
            deps: Arc::new(deps),
            events,
            next_seq: std::sync::atomic::AtomicU64::new(0),
            finished_tx: tx,
            finished_rx: Some(rx),
        }
    }

    /// Subscribe to plan progress.
    pub fn subscribe(&self) -> broadcast::Receiver<PlanEvent> {
        self.events.subscribe()
    }

    /// Run until `cancel`; then give an in-flight plan up to the shutdown grace period.
    pub async fn run(mut self, mut rx: mpsc::Receiver<Notice>, cancel: CancellationToken) {
        let mut store = NoticeStore::new();
        let mut running: Option<Running> = None;
        let mut scheduled: HashMap<String, Scheduled> = HashMap::new();
        let mut rebalance_expiry: Option<(String, JoinHandle<()>)> = None;
        // Plans cancelled by shutdown stop at the grace period, not at once.
        let plan_cancel = CancellationToken::new();
        let (due_tx, mut due_rx) = mpsc::channel::<Notice>(16);
        let (expired_tx, mut expired_rx) = mpsc::channel::<String>(4);
        let (expiry_due_tx, mut expiry_due_rx) = mpsc::channel::<String>(4);
        // `run` consumes the responder: the receiver is always there.
        let mut finished_rx = self
            .finished_rx
            .take()
            .unwrap_or_else(|| mpsc::unbounded_channel().1);

        self.resume(
            &mut store,
            &mut running,
            &mut rebalance_expiry,
            &plan_cancel,
            &expired_tx,
            &expiry_due_tx,
        )
        .await;

        loop {
            // A finished plan frees the responder for the next notice.
            if running.as_ref().is_some_and(|r| !r.active()) {
                running = None;
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                Some(seq) = finished_rx.recv() => {
                    if running.as_ref().is_some_and(|r| r.seq == seq) {
                        running = None;
                    }
                }
                maybe = rx.recv() => {
                    let Some(notice) = maybe else { break };
                    let now = Timestamp::now();
                    let decision = store.accept(&notice, now);
                    self.count_notice(&notice, &decision, now);
                    let decision_kind = match &decision {
                        Decision::Updated(_) => DecisionKind::Updated,
                        _ => DecisionKind::Other,
                    };
                    match decision {
                        Decision::Duplicate => {}
                        Decision::StartInterruption(n) => {
                            for (_, s) in scheduled.drain() {
                                s.timer.abort();
                            }
                            if let Some((_, t)) = rebalance_expiry.take() {
                                t.abort();
                            }
                            if let Some(r) = running.take() {
                                info!(notice_id = %r.id, "interruption supersedes the plan in progress");
                                r.cancel.cancel();
                                let _ = r.task.await;
                            }
                            running = Some(self.start_plan(n, None, &plan_cancel, &expired_tx));
                        }
                        Decision::DeadlineMoved(d) => {
                            if let Some(r) = &running {
                                info!(notice_id = %r.id, deadline = %d, "interruption deadline moved earlier");
                                let _ = r.deadline_tx.send(d);
                            }
                            self.deps.metrics.deadline.set(d.as_second() as f64);
                        }
                        Decision::New(n) | Decision::Updated(n) => {
                            if store.interruption().is_some() {
                                info!(notice_id = %n.id, kind = n.kind.label(), "interruption in progress: notice noted, no separate plan");
                                continue;
                            }
                            match n.kind {
                                NoticeKind::Maintenance => {
                                    if let Some(r) = running.as_ref().filter(|r| r.id == n.id && r.active()) {
                                        // The window moved (or became known) while its plan runs.
                                        let d = store::effective_deadline(n.not_before.or(n.deadline), now);
                                        info!(notice_id = %n.id, deadline = %d, "maintenance window changed: plan deadline updated");
                                        let _ = r.deadline_tx.send(d);
                                        continue;
                                    }
                                    if matches!(decision_kind, DecisionKind::Updated) && self.plan_finished(&n.id).await {
                                        info!(notice_id = %n.id, "maintenance window changed after its plan completed: nothing to redo");
                                        continue;
                                    }
                                    let start = store::maintenance_start(
                                        n.not_before.or(n.deadline).unwrap_or(now),
                                        self.cfg.maintenance_lead,
                                        now,
                                    );
                                    if let Some(old) = scheduled.remove(&n.id) {
                                        old.timer.abort();
                                    }
                                    let _ = self.events.send(PlanEvent::NoticeSeen { notice: n.clone(), at: now });
                                    info!(notice_id = %n.id, start = %start, "maintenance scheduled");
                                    let tx = due_tx.clone();
                                    let wait = store::until(start, now);
                                    let due = n.clone();
                                    let timer = tokio::spawn(async move {
                                        tokio::time::sleep(wait).await;
                                        let _ = tx.send(due).await;
                                    });
                                    scheduled.insert(n.id.clone(), Scheduled { timer });
                                }
                                NoticeKind::Rebalance => {
                                    if running.as_ref().is_some_and(|r| r.active()) {
                                        info!(notice_id = %n.id, "a plan is in progress: rebalance recommendation noted");
                                        continue;
                                    }
                                    running = Some(self.start_plan(n, None, &plan_cancel, &expired_tx));
                                }
                                _ => {}
                            }
                        }
                        Decision::Cancel(id) => {
                            if let Some(s) = scheduled.remove(&id) {
                                s.timer.abort();
                                info!(notice_id = %id, "scheduled maintenance cancelled before it started");
                                let _ = self.events.send(PlanEvent::Undone { id: id.clone(), at: Timestamp::now() });
                            }
                            let cancels_plan = running.as_ref().is_some_and(|r| r.id == id && r.kind != NoticeKind::Interruption);
                            let last_plan = self.deps.local.load().await.ok().flatten().is_some_and(|s| s.id == id && s.phase != Phase::Undone);
                            if cancels_plan {
                                if let Some(r) = running.take() {
                                    r.cancel.cancel();
                                    let _ = r.task.await;
                                }
                                self.undo(&id, "cancelled by the cloud").await;
                            } else if rebalance_expiry.as_ref().is_some_and(|(rid, _)| *rid == id) {
                                if let Some((_, t)) = rebalance_expiry.take() { t.abort(); }
                                self.undo(&id, "cancelled by the cloud").await;
                            } else if last_plan {
                                // A finished maintenance plan (cordon-only, or drained) cancelled.
                                self.undo(&id, "cancelled by the cloud").await;
                            }
                        }
                    }
                }
                Some(n) = due_rx.recv() => {
                    scheduled.remove(&n.id);
                    if store.interruption().is_some() {
                        continue;
                    }
                    if let Some(r) = running.take() {
                        if r.kind == NoticeKind::Rebalance || !r.active() {
                            r.cancel.cancel();
                            let _ = r.task.await;
                        } else {
                            info!(notice_id = %n.id, "another plan in progress: maintenance handled after it");
                            running = Some(r);
                            continue;
                        }
                    }
                    running = Some(self.start_plan(n, None, &plan_cancel, &expired_tx));
                }
                Some(id) = expired_rx.recv() => {
                    // A rebalance plan finished its early checkpoint: undo after the expiry.
                    let tx = expiry_due_tx.clone();
                    let wait = self.cfg.rebalance_expiry;
                    let due = id.clone();
                    let t = tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        let _ = tx.send(due).await;
                    });
                    if let Some((_, old)) = rebalance_expiry.replace((id, t)) {
                        old.abort();
                    }
                }
                Some(id) = expiry_due_rx.recv() => {
                    rebalance_expiry = None;
                    if store.interruption().is_none() {
                        if let Some(r) = running.take_if(|r| r.id == id) {
                            r.cancel.cancel();
                            let _ = r.task.await;
                        }
                        // The store keeps the recommendation: the same `noticeTime`, served until
                        // the instance dies, never starts a second plan.
                        self.undo(&id, "rebalance recommendation expired without an interruption").await;
                    }
                }
            }
        }

        // Shutdown: monitors have stopped; an in-flight plan gets the grace period.
        for (_, s) in scheduled.drain() {
            s.timer.abort();
        }
        if let Some((_, t)) = rebalance_expiry.take() {
            t.abort();
        }
        if let Some(r) = running.take() {
            if r.active() {
                info!(notice_id = %r.id, grace_ms = self.cfg.shutdown_grace.as_millis() as u64, "waiting for the plan in progress before exiting");
                let mut task = r.task;
                match tokio::time::timeout(self.cfg.shutdown_grace, &mut task).await {
                    Ok(_) => info!(notice_id = %r.id, "plan finished; exiting"),
                    Err(_) => {
                        warn!(notice_id = %r.id, "shutdown grace period over: stopping the plan; a restarted agent resumes it from the persisted phase");
                        plan_cancel.cancel();
                        let _ = task.await;
                    }
                }
            }
        }
    }

    /// Whether the last plan persisted is `id`'s and it completed (this life of the machine).
    async fn plan_finished(&self, id: &str) -> bool {
        self.deps
            .local
            .load()
            .await
            .ok()
            .flatten()
            .is_some_and(|s| {
                s.id == id && s.phase == Phase::Done && s.same_life(self.cfg.boot_id.as_deref())
            })
    }

    fn undoer(&self) -> Undoer {
        Undoer {
            deps: self.deps.clone(),
            records: Records::new(&self.deps),
            events: self.events.clone(),
            boot_id: self.cfg.boot_id.clone(),
        }
    }

    async fn undo(&self, id: &str, why: &str) {
        self.undoer().undo(id, why).await
    }

    fn count_notice(&self, notice: &Notice, decision: &Decision, now: Timestamp) {
        let fresh = matches!(
            decision,
            Decision::StartInterruption(_)
                | Decision::New(_)
                | Decision::Updated(_)
                | Decision::Cancel(_)
        );
        if !fresh {
            return;
        }
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
                "notice accepted"
            ),
            None => info!(
                notice_id = %notice.id,
                source = notice.source.as_str(),
                kind = notice.kind.label(),
                detail = %notice.detail,
                seen_after_ms,
                "notice accepted"
            ),
        }
    }

    /// Resume a plan persisted by an earlier run of the agent.
    async fn resume(
        &self,
        store: &mut NoticeStore,
        running: &mut Option<Running>,
        rebalance_expiry: &mut Option<(String, JoinHandle<()>)>,
        plan_cancel: &CancellationToken,
        expired_tx: &mpsc::Sender<String>,
        expiry_due_tx: &mpsc::Sender<String>,
    ) {
        let Some(state) = Records::new(&self.deps).load().await else {
            return;
        };
        let now = Timestamp::now();
        let decision = store::resume(&state, self.cfg.boot_id.as_deref());
        info!(notice_id = %state.id, phase = state.phase.as_str(), kind = state.kind.label(), previous_life = decision == Resume::PreviousLife, "found persisted plan state");
        match decision {
            Resume::PreviousLife => self.undoer().previous_life(state).await,
            Resume::Remember => store.restore_state(&state, now),
            Resume::AwaitExpiry => {
                store.restore_state(&state, now);
                let left = state
                    .deadline
                    .map(|d| store::until(d, now))
                    .unwrap_or(Duration::ZERO);
                let tx = expiry_due_tx.clone();
                let id = state.id.clone();
                let t = tokio::spawn(async move {
                    tokio::time::sleep(left).await;
                    let _ = tx.send(id).await;
                });
                *rebalance_expiry = Some((state.id.clone(), t));
            }
            Resume::Continue => {
                store.restore_state(&state, now);
                let notice = notice_from_state(&state);
                *running = Some(self.start_plan(notice, Some(state), plan_cancel, expired_tx));
            }
        }
    }

    fn start_plan(
        &self,
        notice: Notice,
        resume: Option<PlanState>,
        plan_cancel: &CancellationToken,
        expired_tx: &mpsc::Sender<String>,
    ) -> Running {
        let now = Timestamp::now();
        let deadline = match notice.kind {
            NoticeKind::Rebalance => match (&resume, self.cfg.on_rebalance) {
                // A resumed rebalance keeps its expiry.
                (Some(s), _) if s.deadline.is_some() => store::effective_deadline(s.deadline, now),
                (_, RebalanceAction::Drain) => store::add(now, NOMINAL_DEADLINE),
                _ => store::add(now, self.cfg.rebalance_expiry),
            },
            _ => store::effective_deadline(notice.deadline, now),
        };
        let (deadline_tx, deadline_rx) = watch::channel(deadline);
        let cancel = plan_cancel.child_token();
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
            expired_tx: expired_tx.clone(),
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

fn notice_from_state(state: &PlanState) -> Notice {
    Notice {
        id: state.id.clone(),
        kind: state.kind.clone(),
        source: state.source,
        deadline: state.deadline,
        not_before: state.deadline,
        detail: if state.detail.is_empty() {
            "resumed from persisted state".into()
        } else {
            state.detail.clone()
        },
        restart: state.restart,
        published_at: None,
        observed_at: state.updated_at,
    }
}

/// Undoes what spotguard did for a notice (cancel, expiry, a previous life of the machine).
#[derive(Clone)]
struct Undoer {
    deps: Arc<Deps>,
    records: Records,
    events: broadcast::Sender<PlanEvent>,
    boot_id: Option<String>,
}

impl Undoer {
    /// Remove exactly what `state.applied` says spotguard did. `true` when nothing is left to undo.
    async fn unprotect(&self, state: &PlanState, why: &str, event_reason: &str) -> bool {
        let node = &self.deps.node;
        match node.unprotect(&state.applied).await {
            Ok(()) => {
                self.deps.metrics.action("unprotect", true);
                let msg = format!(
                    "{} {} {why}: removed what spotguard applied (cordon: {}, taint: {})",
                    state.kind.label(),
                    state.id,
                    state.applied.cordoned,
                    state
                        .applied
                        .taint_effect
                        .map(|e| e.as_str())
                        .unwrap_or("none"),
                );
                info!(notice_id = %state.id, "{msg}");
                let budget = SIDE_BUDGET_MAX;
                let _ =
                    tokio::time::timeout(budget, node.event(EventType::Normal, event_reason, &msg))
                        .await;
                true
            }
            Err(e) => {
                self.deps.metrics.action("unprotect", false);
                error!(notice_id = %state.id, error = %e, "undo failed");
                false
            }
        }
    }

    /// A cancelled or expired notice: undo, then clear the record, except for a rebalance
    /// recommendation: the metadata service keeps serving it until the instance dies, so an
    /// `undone` record keeps a restarted agent from acting on it again.
    async fn undo(&self, id: &str, why: &str) {
        let state = match self.records.load().await {
            Some(s) if s.id == id && s.phase != Phase::Undone => s,
            _ => {
                info!(notice_id = %id, "nothing persisted to undo");
                return;
            }
        };
        if !self.unprotect(&state, why, reason::NOTICE_CANCELLED).await {
            return;
        }
        if state.kind == NoticeKind::Rebalance {
            let mut s = state;
            s.phase = Phase::Undone;
            s.applied = Applied::default();
            s.boot_id.clone_from(&self.boot_id);
            s.updated_at = Timestamp::now();
            self.records.save(&s, SIDE_BUDGET_MAX).await;
        } else {
            self.records.clear(SIDE_BUDGET_MAX).await;
        }
        let _ = self.events.send(PlanEvent::Undone {
            id: id.to_string(),
            at: Timestamp::now(),
        });
    }

    /// A record from a previous life of the machine: undo what spotguard applied then (never an
    /// operator's cordon), clear the record, and arm again.
    async fn previous_life(&self, state: PlanState) {
        info!(notice_id = %state.id, phase = state.phase.as_str(), "the machine has rebooted since this plan: undoing what spotguard applied and arming again");
        // The record and the node's own marks together: a crash between a protect patch and
        // the record loses nothing.
        // Bounded: an API outage at start-up must not keep the agent from arming.
        let marks = match tokio::time::timeout(LOAD_BUDGET, self.deps.node.applied_marks()).await {
            Ok(Ok(m)) => m,
            _ => Default::default(),
        };
        let mut state = state;
        state.applied.cordoned |= marks.cordoned;
        let mut effects: Vec<TaintEffect> = state.applied.taint_effect.into_iter().collect();
        for e in marks.taints {
            if !effects.contains(&e) {
                effects.push(e);
            }
        }
        let why = "belongs to a previous life of the machine (it rebooted since)";
        let undo_all = async {
            let mut undone = true;
            let mut first = true;
            for effect in effects.iter().copied().map(Some).chain(
                // Nothing tainted: still undo a cordon.
                effects.is_empty().then_some(None),
            ) {
                let mut one = state.clone();
                one.applied = Applied {
                    cordoned: first && state.applied.cordoned,
                    taint_effect: effect,
                };
                first = false;
                undone &= self.unprotect(&one, why, reason::PREVIOUS_LIFE).await;
            }
            undone
        };
        let undone = tokio::time::timeout(SIDE_BUDGET_MAX, undo_all)
            .await
            .unwrap_or(false);
        if !undone {
            // Keep the record so that the next start tries again; the agent is armed anyway
            // (nothing of it is restored into the store).
            warn!(notice_id = %state.id, "could not undo the previous life's cordon/taint now; the next start tries again");
            self.deps.metrics.error("responder", "previous_life_undo");
            return;
        }
        self.records.clear(SIDE_BUDGET_MAX).await;
        self.deps.metrics.action("previous_life_cleared", true);
        let _ = self.events.send(PlanEvent::Undone {
            id: state.id,
            at: Timestamp::now(),
        });
    }
}

/// One plan in progress.
struct Plan {
    seq: u64,
    finished_tx: mpsc::UnboundedSender<u64>,
    cfg: ResponderConfig,
    deps: Arc<Deps>,
    records: Records,
    events: broadcast::Sender<PlanEvent>,
    notice: Notice,
    deadline: watch::Receiver<Timestamp>,
    cancel: CancellationToken,
    expired_tx: mpsc::Sender<String>,
}

/// What the steps beside the signal produced.
struct SideResult {
    applied: Option<Applied>,
}

impl Plan {
    async fn run(self, resume: Option<PlanState>) {
        let (seq, finished) = (self.seq, self.finished_tx.clone());
        self.run_steps(resume).await;
        let _ = finished.send(seq);
    }

    async fn run_steps(mut self, resume: Option<PlanState>) {
        let Some(steps) = steps_for(&self.notice, &self.cfg) else {
            info!("policy says ignore: logged only");
            return;
        };
        let active = OutcomeLabels {
            outcome: self.notice.kind.label().into(),
        };
        self.deps
            .metrics
            .notice_active
            .get_or_create(&active)
            .set(1);
        if self.notice.kind == NoticeKind::Interruption {
            self.deps
                .metrics
                .deadline
                .set(self.deadline().as_second() as f64);
        }
        let resumed = resume.is_some();
        let mut state = resume.unwrap_or_else(|| PlanState {
            id: self.notice.id.clone(),
            kind: self.notice.kind.clone(),
            source: self.notice.source,
            deadline: Some(*self.deadline.borrow()),
            phase: Phase::Detected,
            signalled_at: None,
            applied: Applied::default(),
            boot_id: self.cfg.boot_id.clone(),
            restart: self.notice.restart,
            detail: self.notice.detail.clone(),
            failure: None,
            updated_at: Timestamp::now(),
        });
        // No separate record of `detected`: the notice is still in the metadata service after a
        // crash, and every write before the signal costs time.
        let result = self.steps(steps, &mut state, resumed).await;
        self.deps
            .metrics
            .notice_active
            .get_or_create(&active)
            .set(0);
        match result {
            Ok(()) => {
                let _ = self.events.send(PlanEvent::Done {
                    id: self.notice.id.clone(),
                    at: Timestamp::now(),
                });
            }
            Err(why) => warn!("plan stopped: {why}"),
        }
    }

    fn deadline(&self) -> Timestamp {
        *self.deadline.borrow()
    }

    fn budget(&self) -> Duration {
        side_budget(self.deadline(), Timestamp::now())
    }

    fn stamp(&self, state: &mut PlanState, phase: Phase) {
        state.phase = phase;
        state.deadline = Some(self.deadline());
        state.boot_id.clone_from(&self.cfg.boot_id);
        state.updated_at = Timestamp::now();
    }

    /// Both copies: the local record, then the Node annotation within the budget.
    async fn persist(&self, state: &mut PlanState, phase: Phase) {
        self.stamp(state, phase);
        self.records.save(state, self.budget()).await;
    }

    /// Taint + cordon, the notice's Event, and (on a fresh plan) the start hooks, each bounded
    /// by the side budget. Never on the signal's path.
    async fn protect_side(
        deps: Arc<Deps>,
        notice: Notice,
        deadline: Timestamp,
        steps: Steps,
        hooks: bool,
        budget: Duration,
    ) -> SideResult {
        let node = deps.node.clone();
        let protect = async {
            let effect = steps.taint?;
            let protection = Protection {
                taint_value: notice.kind.label().to_string(),
                effect,
                cordon: steps.cordon,
            };
            // One call: node ops retry conflicts and 5xx themselves, boundedly.
            let failure = match tokio::time::timeout(budget, node.protect(&protection)).await {
                Ok(Ok(mut applied)) => {
                    deps.metrics.action("protect", true);
                    if !hooks {
                        // A resumed plan: an earlier run may have protected the node and died
                        // before recording it. The node's own marks say what spotguard did.
                        if let Ok(Ok(marks)) =
                            tokio::time::timeout(budget, node.applied_marks()).await
                        {
                            merge_applied(&mut applied, Some(marks.for_protection(&protection)));
                        }
                    }
                    return Some(applied);
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {} ms", budget.as_millis()),
            };
            deps.metrics.action("protect", false);
            error!(error = %failure, "taint/cordon failed");
            let _ = tokio::time::timeout(
                budget,
                node.event(
                    EventType::Warning,
                    reason::CORDON_FAILED,
                    &format!("taint/cordon failed: {failure}"),
                ),
            )
            .await;
            None
        };
        let event = async {
            let msg = format!(
                "{} notice {} from {}: deadline {}; {}",
                notice.kind.label(),
                notice.id,
                notice.source,
                deadline,
                notice.detail
            );
            match tokio::time::timeout(
                budget,
                node.event(EventType::Warning, event_reason(&notice.kind), &msg),
            )
            .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    deps.metrics.error("responder", e.metric_label());
                    warn!(error = %e, "emitting node event failed");
                }
                Err(_) => {
                    deps.metrics.error("responder", "event_timeout");
                    warn!(
                        budget_ms = budget.as_millis() as u64,
                        "emitting node event ran out of its budget"
                    );
                }
            }
        };
        if hooks {
            for hook in &deps.on_start {
                hook(&notice);
            }
        }
        let (applied, ()) = tokio::join!(protect, event);
        SideResult { applied }
    }

    async fn steps(
        &mut self,
        steps: Steps,
        state: &mut PlanState,
        resumed: bool,
    ) -> Result<(), String> {
        // 1–2. Signal first; protect, Event and hooks beside it.
        if steps.checkpoint && state.phase < Phase::Checkpointed {
            self.checkpoint(state, steps, resumed).await;
            self.persist(state, Phase::Checkpointed).await;
        } else if state.phase < Phase::Protected {
            let side = Self::protect_side(
                self.deps.clone(),
                self.notice.clone(),
                self.deadline(),
                steps,
                !resumed,
                self.budget(),
            )
            .await;
            merge_applied(&mut state.applied, side.applied);
            self.persist(state, Phase::Protected).await;
            let _ = self.events.send(PlanEvent::Protected {
                id: self.notice.id.clone(),
                at: Timestamp::now(),
            });
        }
        if self.cancel.is_cancelled() {
            return Err("cancelled".into());
        }

        if self.notice.kind == NoticeKind::Rebalance && !steps.drain {
            let _ = self.expired_tx.send(self.notice.id.clone()).await;
            return Ok(());
        }

        // 4. Drain.
        if steps.drain && state.phase < Phase::Drained && state.failure.is_none() {
            match self.drain().await? {
                Ok(report) => {
                    self.persist(state, Phase::Drained).await;
                    let _ = self.events.send(PlanEvent::Drained {
                        id: self.notice.id.clone(),
                        at: Timestamp::now(),
                        report,
                    });
                }
                Err(failure) => {
                    if let Some(report) = failure.report {
                        let _ = self.events.send(PlanEvent::Drained {
                            id: self.notice.id.clone(),
                            at: Timestamp::now(),
                            report,
                        });
                    }
                    let _ = self.events.send(PlanEvent::DrainFailed {
                        id: self.notice.id.clone(),
                        at: Timestamp::now(),
                        reason: failure.reason.clone(),
                    });
                    state.failure = Some(failure.reason);
                }
            }
        }

        // 5. Acknowledge (Azure) only after a complete drain, and finish.
        if state.phase < Phase::Done {
            if steps.drain && state.phase == Phase::Drained {
                self.acknowledge().await;
            } else if steps.drain {
                info!("drain did not complete: the cloud's event is not acknowledged");
            }
            self.persist(state, Phase::Done).await;
        }
        Ok(())
    }

    async fn checkpoint(&mut self, state: &mut PlanState, steps: Steps, resumed: bool) {
        let groups = match self.deps.discovery.discover().await {
            Ok(g) => g,
            Err(e) => {
                error!(error = %e, "checkpoint target discovery failed");
                self.deps.metrics.error("checkpoint", e.metric_label());
                Vec::new()
            }
        };
        let now = Timestamp::now();
        // A rebalance recommendation has no deadline (its plan's "deadline" is the expiry): the
        // early checkpoint gets the full --checkpoint-timeout, with nothing reserved for a drain.
        let (bound, reserve) = if self.notice.kind == NoticeKind::Rebalance && !steps.drain {
            (store::add(now, self.cfg.checkpoint_timeout), Duration::ZERO)
        } else {
            (self.deadline(), self.cfg.reserve(self.notice.source))
        };
        let ck_deadline =
            store::checkpoint_deadline(bound, now, reserve, self.cfg.checkpoint_timeout);
        let req = CheckpointRequest {
            notice_id: self.notice.id.clone(),
            source: self.notice.source.as_str().to_string(),
            kind: self.notice.kind.label().to_string(),
            deadline: Some(self.deadline()),
            checkpoint_deadline: ck_deadline,
            dry_run: self.cfg.dry_run,
        };
        if groups.is_empty() {
            info!("no checkpoint targets found");
        }
        let signalled_before = state.signalled_at;
        // Groups already signalled before a restart: those whose notice.json names this notice.
        let (before, to_signal): (Vec<TargetGroup>, Vec<TargetGroup>) = match state.signalled_at {
            Some(_) => {
                let id = self.notice.id.clone();
                let g = groups.clone();
                let budget = self.budget();
                let told = tokio::time::timeout(
                    budget,
                    tokio::task::spawn_blocking(move || {
                        g.iter().map(|g| notice_names(g, &id)).collect::<Vec<_>>()
                    }),
                )
                .await;
                match told {
                    Ok(Ok(flags)) => {
                        let mut before = Vec::new();
                        let mut rest = Vec::new();
                        for (g, told) in groups.iter().zip(flags) {
                            if told {
                                before.push(g.clone());
                            } else {
                                rest.push(g.clone());
                            }
                        }
                        (before, rest)
                    }
                    // Cannot tell: never signal twice.
                    _ => (groups.clone(), Vec::new()),
                }
            }
            None => (Vec::new(), groups.clone()),
        };
        let mut deliveries = Vec::new();
        if let Some(at) = state.signalled_at {
            if !before.is_empty() {
                info!(signalled_at = %at, groups = before.len(), "signals were sent before a restart: waiting for acks without signalling again");
                let r = req.clone();
                match tokio::task::spawn_blocking(move || {
                    ckpt::plan_without_signal(&before, &r, at)
                })
                .await
                {
                    Ok(d) => deliveries.extend(d),
                    Err(e) => error!(error = %e, "rebuilding the checkpoint wait failed"),
                }
            }
            if !to_signal.is_empty() {
                info!(
                    groups = to_signal.len(),
                    "the notice never reached these targets before the restart: signalling now"
                );
            }
        }
        // The local record first (a file, no API call), so that a restart never signals twice.
        if state.signalled_at.is_none() {
            state.signalled_at = Some(Timestamp::now());
            self.stamp(state, Phase::Signalled);
            self.records.save_local(state).await;
        }
        // Protect, the Event and the start hooks run beside the signal.
        let side = tokio::spawn(Self::protect_side(
            self.deps.clone(),
            self.notice.clone(),
            self.deadline(),
            steps,
            !resumed,
            self.budget(),
        ));
        if signalled_before.is_none() || !to_signal.is_empty() {
            let (g, r, m) = (to_signal.clone(), req.clone(), self.deps.metrics.clone());
            let sent = match tokio::task::spawn_blocking(move || ckpt::deliver(&g, &r, &m)).await {
                Ok(d) => d,
                Err(e) => {
                    error!(error = %e, "delivering checkpoint signals failed");
                    Vec::new()
                }
            };
            let sent_at = Timestamp::now();
            let processes: usize = sent.iter().map(|d| d.signalled()).sum();
            let latency = sent_at
                .duration_since(self.notice.observed_at)
                .as_secs_f64();
            if processes > 0 && latency >= 0.0 && !resumed {
                self.deps
                    .metrics
                    .notice_to_signal
                    .get_or_create(&SourceLabels {
                        source: self.notice.source.as_str().into(),
                    })
                    .observe(latency);
            }
            info!(processes, checkpoint_deadline = %ck_deadline, "checkpoint signals sent");
            let _ = self.events.send(PlanEvent::Signalled {
                id: self.notice.id.clone(),
                at: sent_at,
                processes,
                checkpoint_deadline: ck_deadline,
            });
            deliveries.extend(sent);
            let budget = self.budget();
            for g in &to_signal {
                if let Some(pod) = &g.pod {
                    let _ = tokio::time::timeout(
                        budget,
                        self.deps.node.pod_event(
                            pod,
                            EventType::Normal,
                            reason::CHECKPOINT_SIGNALLED,
                            &format!(
                                "{} sent for {} notice {}; checkpoint by {}",
                                g.signal, req.kind, req.notice_id, ck_deadline
                            ),
                        ),
                    )
                    .await;
                }
            }
        }
        // What protect applied joins the record (both copies) before the wait.
        let applied = match side.await {
            Ok(s) => s.applied,
            Err(e) => {
                error!(error = %e, "protect task failed");
                None
            }
        };
        merge_applied(&mut state.applied, applied);
        self.persist(state, Phase::Signalled).await;
        let _ = self.events.send(PlanEvent::Protected {
            id: self.notice.id.clone(),
            at: Timestamp::now(),
        });

        // Wait; a deadline moved earlier cuts the wait at the new checkpoint deadline.
        let wait_cancel = self.cancel.child_token();
        let results = {
            let wait = ckpt::wait(deliveries, &req, &self.deps.metrics, &wait_cancel);
            tokio::pin!(wait);
            let mut cut_at = req.checkpoint_deadline;
            let mut cutter: Option<JoinHandle<()>> = None;
            let results = loop {
                tokio::select! {
                    r = &mut wait => break r,
                    changed = self.deadline.changed() => {
                        if changed.is_err() { continue; }
                        let new_ck = store::checkpoint_deadline(self.deadline(), Timestamp::now(), reserve, self.cfg.checkpoint_timeout);
                        if new_ck < cut_at {
                            cut_at = new_ck;
                            info!(checkpoint_deadline = %new_ck, "deadline moved earlier: checkpoint wait cut short");
                            let cancel = wait_cancel.clone();
                            let wait_for = store::until(new_ck, Timestamp::now());
                            if let Some(old) = cutter.replace(tokio::spawn(async move {
                                tokio::time::sleep(wait_for).await;
                                cancel.cancel();
                            })) {
                                old.abort();
                            }
                        }
                    }
                }
            };
            if let Some(c) = cutter {
                c.abort();
            }
            results
        };
        let budget = self.budget();
        for r in &results {
            match r.ack_latency {
                Some(d) => {
                    info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, ack_ms = d.as_millis() as u64, detail = %r.detail, "checkpoint result")
                }
                None => {
                    info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, detail = %r.detail, "checkpoint result")
                }
            }
            if let Some(pod) = &r.pod {
                let (kind, reason) = match r.outcome {
                    Outcome::Acked | Outcome::Exited => {
                        (EventType::Normal, reason::CHECKPOINT_ACKED)
                    }
                    Outcome::Timeout => (EventType::Warning, reason::CHECKPOINT_TIMEOUT),
                    Outcome::NoHandler => (EventType::Warning, reason::CHECKPOINT_NO_HANDLER),
                    Outcome::Skipped | Outcome::Failed | Outcome::Error => {
                        (EventType::Warning, reason::CHECKPOINT_FAILED)
                    }
                };
                let _ = tokio::time::timeout(
                    budget,
                    self.deps.node.pod_event(
                        pod,
                        kind,
                        reason,
                        &format!("checkpoint {}: {}", r.outcome.as_str(), r.detail),
                    ),
                )
                .await;
            }
        }
        let _ = self.events.send(PlanEvent::Checkpointed {
            id: self.notice.id.clone(),
            at: Timestamp::now(),
            results,
        });
    }

    /// Drain until the deadline. `Ok(Ok(report))` only for a complete drain; a blocked or failed
    /// one is reported (Event, metric) and returned as a [`DrainFailure`]. `Err` = cancelled.
    async fn drain(&mut self) -> Result<Result<DrainReport, DrainFailure>, String> {
        let node = self.deps.node.clone();
        let _ = tokio::time::timeout(
            self.budget(),
            node.event(
                EventType::Normal,
                reason::DRAIN_STARTED,
                &format!("draining before {}", self.deadline()),
            ),
        )
        .await;
        let started = std::time::Instant::now();
        let outcome = loop {
            let req = DrainRequest {
                deadline: self.deadline(),
                force_delete_at_deadline: self.cfg.force_delete_at_deadline,
                concurrency: self.cfg.drain_concurrency,
            };
            let drain = node.drain(&req);
            tokio::pin!(drain);
            let outcome = tokio::select! {
                r = &mut drain => Some(r),
                // A deadline moved: restart the (idempotent) drain with it.
                Ok(()) = self.deadline.changed() => None,
                _ = self.cancel.cancelled() => return Err("cancelled during drain".into()),
            };
            match outcome {
                Some(Ok(report)) => break Ok(report),
                Some(Err(e)) => {
                    if e.is_retryable() && Timestamp::now() < self.deadline() {
                        self.deps.metrics.error("drain", e.metric_label());
                        warn!(error = %e, "drain failed; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    break Err(e);
                }
                None => continue,
            }
        };
        self.deps
            .metrics
            .drain_duration
            .observe(started.elapsed().as_secs_f64());
        let budget = self.budget().max(SIDE_BUDGET_MIN);
        let failure = match outcome {
            Ok(report) if report.complete() => {
                self.deps.metrics.action("drain", true);
                let _ = tokio::time::timeout(
                    budget,
                    node.event(
                        EventType::Normal,
                        reason::DRAIN_COMPLETE,
                        &format!("{} pods evicted", report.evicted.len()),
                    ),
                )
                .await;
                return Ok(Ok(report));
            }
            Ok(report) => {
                let blockers: Vec<String> = report
                    .blocked
                    .iter()
                    .map(|b| {
                        if b.pdbs.is_empty() {
                            format!("{} ({})", b.pod, b.reason)
                        } else {
                            format!("{} (PDB {})", b.pod, b.pdbs.join(","))
                        }
                    })
                    .collect();
                let reason = format!("still on the node at the deadline: {}", blockers.join("; "));
                error!(blocked = %blockers.join("; "), "drain did not complete before the deadline");
                self.deps.metrics.error("drain", "blocked");
                let _ = tokio::time::timeout(
                    budget,
                    node.event(EventType::Warning, reason::DRAIN_BLOCKED, &reason),
                )
                .await;
                DrainFailure {
                    reason,
                    report: Some(report),
                }
            }
            Err(e) => {
                let reason = format!("drain failed: {e}");
                error!(error = %e, "drain failed; the node is not reported drained");
                self.deps.metrics.error("drain", e.metric_label());
                let _ = tokio::time::timeout(
                    budget,
                    node.event(EventType::Warning, reason::DRAIN_FAILED, &reason),
                )
                .await;
                DrainFailure {
                    reason,
                    report: None,
                }
            }
        };
        self.deps.metrics.action("drain", false);
        Ok(Err(failure))
    }

    async fn acknowledge(&self) {
        let Some(source) = self
            .deps
            .sources
            .iter()
            .find(|s| s.name() == self.notice.source.as_str())
        else {
            return;
        };
        if self.cfg.dry_run {
            info!("dry-run: would acknowledge the event to {}", source.name());
            return;
        }
        match source.acknowledge(&self.notice).await {
            Ok(()) => self.deps.metrics.action("acknowledge", true),
            Err(e) => {
                self.deps.metrics.action("acknowledge", false);
                self.deps.metrics.error("notice", e.metric_label());
                warn!(error = %e, "acknowledging the event failed");
            }
        }
    }
}

/// Why a drain did not complete.
struct DrainFailure {
    reason: String,
    /// The report, when the drain ran to the deadline with pods still on the node.
    report: Option<DrainReport>,
}

/// Add what one protect call applied to what the plan applied so far.
fn merge_applied(into: &mut Applied, new: Option<Applied>) {
    if let Some(a) = new {
        into.cordoned |= a.cordoned;
        if into.taint_effect.is_none() {
            into.taint_effect = a.taint_effect;
        }
    }
}

/// Whether the group's `notice.json` names notice `id` (the signal went out before a restart).
/// Read inside the group's own filesystem root. Blocking.
fn notice_names(group: &TargetGroup, id: &str) -> bool {
    let proc = ProcFs::default();
    group.containers.iter().any(|c| {
        let dir = match c.root_pid {
            None => CheckpointDir::host(&group.dir),
            Some(pid) => {
                let start = c
                    .processes
                    .iter()
                    .find(|p| p.pid == pid)
                    .map(|p| p.start_time)
                    .or_else(|| proc.start_time(pid).ok());
                match start {
                    Some(start) => CheckpointDir::in_root_of(&proc, pid, start, &group.dir),
                    None => return false,
                }
            }
        };
        dir.ok()
            .and_then(|d| d.read_notice().ok().flatten())
            .is_some_and(|n| n.notice_id == id)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ResponderConfig {
        ResponderConfig {
            on_rebalance: RebalanceAction::Checkpoint,
            rebalance_expiry: Duration::from_secs(1800),
            on_maintenance: MaintenanceAction::Drain,
            on_azure_freeze: MaintenanceAction::Ignore,
            maintenance_lead: Duration::from_secs(600),
            checkpoint_timeout: Duration::from_secs(90),
            drain_reserve: None,
            force_delete_at_deadline: false,
            drain_concurrency: 8,
            dry_run: false,
            shutdown_grace: Duration::from_secs(5),
            boot_id: None,
        }
    }

    #[test]
    fn steps_follow_the_policies() {
        let c = cfg();
        let n = |kind: NoticeKind, detail: &str| Notice {
            id: "n".into(),
            kind,
            source: Source::Azure,
            deadline: None,
            not_before: None,
            detail: detail.into(),
            restart: false,
            published_at: None,
            observed_at: Timestamp::now(),
        };
        let s = steps_for(&n(NoticeKind::Interruption, ""), &c).unwrap();
        assert!(s.cordon && s.checkpoint && s.drain);
        assert_eq!(s.taint, Some(TaintEffect::NoSchedule));
        let r = steps_for(&n(NoticeKind::Rebalance, ""), &c).unwrap();
        assert_eq!(r.taint, Some(TaintEffect::PreferNoSchedule));
        assert!(r.checkpoint && !r.drain && !r.cordon);
        let mut c2 = c.clone();
        c2.on_rebalance = RebalanceAction::Ignore;
        assert!(steps_for(&n(NoticeKind::Rebalance, ""), &c2).is_none());
        c2.on_maintenance = MaintenanceAction::Cordon;
        let m = steps_for(
            &n(NoticeKind::Maintenance, "Reboot (Scheduled, Platform): x"),
            &c2,
        )
        .unwrap();
        assert!(m.cordon && !m.checkpoint && !m.drain);
        // Azure Freeze follows its own policy (default ignore), not --on-maintenance.
        let freeze = n(
            NoticeKind::Maintenance,
            "Freeze (Scheduled, Platform): pause",
        );
        assert!(steps_for(&freeze, &c).is_none());
        let mut c3 = c.clone();
        c3.on_azure_freeze = MaintenanceAction::Cordon;
        let f = steps_for(&freeze, &c3).unwrap();
        assert!(f.cordon && !f.checkpoint && !f.drain);
        assert_eq!(c.reserve(Source::Aws), Duration::from_secs(25));
        assert_eq!(c.reserve(Source::Gce), Duration::from_secs(8));
    }
}
