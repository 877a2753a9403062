//! The responder: turns accepted notices into the plan of design §4 and carries it out.
//!
//! Interruption (and maintenance with `--on-maintenance drain`), each step persisted first:
//!
//! 1. persist `detected`;
//! 2. taint + cordon, Event, cancel prefetches, webhook;
//! 3. checkpoint: signal every target at once, wait for acks until
//!    `min(now + checkpoint-timeout, deadline − drain-reserve)`;
//! 4. drain until the deadline;
//! 5. mark `drained`, Azure: acknowledge; `done`.
//!
//! A restarted agent resumes from the persisted phase: past `signalled` it never signals again,
//! past `drained` it never drains again. Rebalance (default `checkpoint`): soft taint, early
//! checkpoint, undone after `--rebalance-expiry` unless an interruption follows. Cancelled
//! maintenance: undo exactly what spotguard did, never an operator's cordon.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::{broadcast, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn, Instrument};

use crate::checkpoint::run::{self as ckpt, CheckpointRequest, GroupResult};
use crate::checkpoint::{Outcome, TargetDiscovery};
use crate::config::{MaintenanceAction, RebalanceAction};
use crate::metrics::{Metrics, NoticeLabels, OutcomeLabels, SourceLabels};
use crate::node::{
    reason, Applied, DrainReport, DrainRequest, EventType, NodeOps, Phase, PlanState, Protection,
    TaintEffect,
};
use crate::notice::store::{self, Decision, NoticeStore};
use crate::notice::{Notice, NoticeKind, NoticeSource, Source};

/// Settings of the responder (from `run` flags).
#[derive(Clone, Debug)]
pub struct ResponderConfig {
    pub on_rebalance: RebalanceAction,
    pub rebalance_expiry: Duration,
    pub on_maintenance: MaintenanceAction,
    pub maintenance_lead: Duration,
    pub checkpoint_timeout: Duration,
    /// `--drain-reserve`; `None` = per cloud (25 s aws, 8 s gce/azure).
    pub drain_reserve: Option<Duration>,
    pub force_delete_at_deadline: bool,
    pub drain_concurrency: usize,
    pub dry_run: bool,
    /// On shutdown, how long an in-flight plan may go on.
    pub shutdown_grace: Duration,
    /// Boot id of this machine (restart-type maintenance ⇒ uncordon after a reboot).
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
    /// Drain finished.
    Drained {
        id: String,
        at: Timestamp,
        report: DrainReport,
    },
    /// The drain failed (sent before the plan's `Done`).
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

fn steps_for(kind: &NoticeKind, cfg: &ResponderConfig) -> Option<Steps> {
    let full = Steps {
        taint: Some(TaintEffect::NoSchedule),
        cordon: true,
        checkpoint: true,
        drain: true,
    };
    match kind {
        NoticeKind::Interruption => Some(full),
        NoticeKind::Maintenance => match cfg.on_maintenance {
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
    id: String,
    kind: NoticeKind,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    deadline_tx: watch::Sender<Timestamp>,
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
}

impl Responder {
    pub fn new(cfg: ResponderConfig, deps: Deps) -> Self {
        let (events, _) = broadcast::channel(256);
        Responder {
            cfg,
            deps: Arc::new(deps),
            events,
        }
    }

    /// Subscribe to plan progress.
    pub fn subscribe(&self) -> broadcast::Receiver<PlanEvent> {
        self.events.subscribe()
    }

    /// Run until `cancel`; then give an in-flight plan up to the shutdown grace period.
    pub async fn run(self, mut rx: mpsc::Receiver<Notice>, cancel: CancellationToken) {
        let mut store = NoticeStore::new();
        let mut running: Option<Running> = None;
        let mut scheduled: HashMap<String, Scheduled> = HashMap::new();
        let mut rebalance_expiry: Option<(String, JoinHandle<()>)> = None;
        // Plans cancelled by shutdown stop at the grace period, not at once.
        let plan_cancel = CancellationToken::new();
        let (due_tx, mut due_rx) = mpsc::channel::<Notice>(16);
        let (expired_tx, mut expired_rx) = mpsc::channel::<String>(4);
        let (expiry_due_tx, mut expiry_due_rx) = mpsc::channel::<String>(4);

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
            tokio::select! {
                _ = cancel.cancelled() => break,
                maybe = rx.recv() => {
                    let Some(notice) = maybe else { break };
                    let now = Timestamp::now();
                    let decision = store.accept(&notice, now);
                    self.count_notice(&notice, &decision, now);
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
                                    let start = store::maintenance_start(
                                        n.not_before.or(n.deadline).unwrap_or(now),
                                        self.cfg.maintenance_lead,
                                        now,
                                    );
                                    if let Some(old) = scheduled.remove(&n.id) {
                                        old.timer.abort();
                                    }
                                    if running.as_ref().is_some_and(|r| r.id == n.id) {
                                        continue;
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
                                    if running.is_some() {
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
                            if running.as_ref().is_some_and(|r| r.id == id && r.kind != NoticeKind::Interruption) {
                                if let Some(r) = running.take() {
                                    r.cancel.cancel();
                                    let _ = r.task.await;
                                }
                                self.undo(&id, "cancelled by the cloud").await;
                            } else if rebalance_expiry.as_ref().is_some_and(|(rid, _)| *rid == id) {
                                if let Some((_, t)) = rebalance_expiry.take() { t.abort(); }
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
                        if r.kind == NoticeKind::Rebalance || r.task.is_finished() {
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
                        self.undo(&id, "rebalance recommendation expired without an interruption").await;
                        store.forget(&id);
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
            if !r.task.is_finished() {
                info!(notice_id = %r.id, grace = %humantime::format_duration(self.cfg.shutdown_grace), "waiting for the plan in progress before exiting");
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

    fn clone_for_undo(&self) -> Undoer {
        Undoer {
            deps: self.deps.clone(),
            events: self.events.clone(),
        }
    }

    async fn undo(&self, id: &str, why: &str) {
        self.clone_for_undo().undo(id, why).await
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
        info!(
            notice_id = %notice.id,
            source = notice.source.as_str(),
            kind = notice.kind.label(),
            deadline = ?notice.deadline.map(|d| d.to_string()),
            detail = %notice.detail,
            seen_after_ms = now.duration_since(notice.observed_at).as_millis() as i64,
            "notice accepted"
        );
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
        let state = match self.deps.node.load_state().await {
            Ok(Some(s)) => s,
            Ok(None) => return,
            Err(e) => {
                error!(error = %e, "persisted plan state unreadable: starting without it");
                self.deps.metrics.error("responder", e.metric_label());
                return;
            }
        };
        let now = Timestamp::now();
        let rebooted = match (&state.boot_id, &self.cfg.boot_id) {
            (Some(a), Some(b)) => a != b,
            _ => false,
        };
        info!(notice_id = %state.id, phase = state.phase.as_str(), kind = state.kind.label(), rebooted, "found persisted plan state");
        match (&state.kind, state.phase) {
            (_, Phase::Undone) => {
                let _ = self.deps.node.clear_state().await;
            }
            (NoticeKind::Maintenance, _) if rebooted && state.restart => {
                // The machine came back from a restart-type event: undo our cordon/taint.
                self.undo(&state.id, "the machine rebooted for maintenance")
                    .await;
            }
            (NoticeKind::Interruption, Phase::Done) => {
                store.restore_interruption(&state.id, state.deadline.unwrap_or(now));
            }
            (NoticeKind::Interruption, _) => {
                store.restore_interruption(&state.id, state.deadline.unwrap_or(now));
                let notice = notice_from_state(&state);
                *running = Some(self.start_plan(notice, Some(state), plan_cancel, expired_tx));
            }
            (NoticeKind::Rebalance, phase) if phase >= Phase::Checkpointed => {
                store.restore(&state.id, state.kind.clone(), None);
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
            (_, Phase::Done) => {
                store.restore(&state.id, state.kind.clone(), state.deadline);
            }
            (kind, _) => {
                store.restore(&state.id, kind.clone(), state.deadline);
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
            NoticeKind::Rebalance => match self.cfg.on_rebalance {
                RebalanceAction::Drain => store::add(now, NOMINAL_DEADLINE),
                _ => store::add(now, self.cfg.rebalance_expiry),
            },
            _ => store::effective_deadline(notice.deadline, now),
        };
        let (deadline_tx, deadline_rx) = watch::channel(deadline);
        let cancel = plan_cancel.child_token();
        let plan = Plan {
            cfg: self.cfg.clone(),
            deps: self.deps.clone(),
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
        detail: "resumed from persisted state".into(),
        restart: state.restart,
        published_at: None,
        observed_at: state.updated_at,
    }
}

/// Undoes what spotguard did for a notice (cancel, expiry, reboot).
#[derive(Clone)]
struct Undoer {
    deps: Arc<Deps>,
    events: broadcast::Sender<PlanEvent>,
}

impl Undoer {
    async fn undo(&self, id: &str, why: &str) {
        let node = &self.deps.node;
        let state = match node.load_state().await {
            Ok(Some(s)) if s.id == id => s,
            Ok(_) => {
                info!(notice_id = %id, "nothing persisted to undo");
                return;
            }
            Err(e) => {
                error!(notice_id = %id, error = %e, "cannot read plan state to undo");
                self.deps.metrics.error("responder", e.metric_label());
                return;
            }
        };
        match node.unprotect(&state.applied).await {
            Ok(()) => {
                self.deps.metrics.action("unprotect", true);
                let msg = format!(
                    "{} {} {why}: removed what spotguard applied (cordon: {}, taint: {})",
                    state.kind.label(),
                    id,
                    state.applied.cordoned,
                    state
                        .applied
                        .taint_effect
                        .map(|e| e.as_str())
                        .unwrap_or("none"),
                );
                info!(notice_id = %id, "{msg}");
                let _ = node
                    .event(EventType::Normal, reason::NOTICE_CANCELLED, &msg)
                    .await;
            }
            Err(e) => {
                self.deps.metrics.action("unprotect", false);
                error!(notice_id = %id, error = %e, "undo failed");
                return;
            }
        }
        let mut s = state;
        s.phase = Phase::Undone;
        s.applied = Applied::default();
        s.updated_at = Timestamp::now();
        if let Err(e) = node.save_state(&s).await {
            warn!(error = %e, "persisting undone state failed");
        }
        let _ = node.clear_state().await;
        let _ = self.events.send(PlanEvent::Undone {
            id: id.to_string(),
            at: Timestamp::now(),
        });
    }
}

/// One plan in progress.
struct Plan {
    cfg: ResponderConfig,
    deps: Arc<Deps>,
    events: broadcast::Sender<PlanEvent>,
    notice: Notice,
    deadline: watch::Receiver<Timestamp>,
    cancel: CancellationToken,
    expired_tx: mpsc::Sender<String>,
}

impl Plan {
    async fn run(mut self, resume: Option<PlanState>) {
        let Some(steps) = steps_for(&self.notice.kind, &self.cfg) else {
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
            updated_at: Timestamp::now(),
        });
        // No separate record of `detected`: the notice is still in the metadata service after a
        // crash, and every write before the signal costs time (an fsync, or an API round trip).
        let result = self.steps(steps, &mut state).await;
        self.deps
            .metrics
            .notice_active
            .get_or_create(&active)
            .set(0);
        if let Err(why) = result {
            warn!("plan stopped: {why}");
        }
    }

    fn deadline(&self) -> Timestamp {
        *self.deadline.borrow()
    }

    async fn persist(&self, state: &mut PlanState, phase: Phase) {
        state.phase = phase;
        state.deadline = Some(self.deadline());
        state.updated_at = Timestamp::now();
        if let Err(e) = self.deps.node.save_state(state).await {
            // Keep going: the plan matters more than its record. Count and log.
            error!(phase = phase.as_str(), error = %e, "persisting plan state failed");
            self.deps.metrics.error("responder", e.metric_label());
        }
    }

    async fn steps(&mut self, steps: Steps, state: &mut PlanState) -> Result<(), String> {
        let node = self.deps.node.clone();

        // 2. Protect: taint + cordon, Event, hooks (prefetch cancel, webhook).
        if state.phase < Phase::Protected {
            if let Some(effect) = steps.taint {
                let protection = Protection {
                    taint_value: self.notice.kind.label().to_string(),
                    effect,
                    cordon: steps.cordon,
                };
                // One call: node ops retry conflicts and 5xx themselves, boundedly. Retrying here
                // until the deadline would hold the checkpoint hostage to an API-server outage.
                match node.protect(&protection).await {
                    Ok(applied) => {
                        self.deps.metrics.action("protect", true);
                        state.applied = applied;
                    }
                    Err(e) => {
                        self.deps.metrics.action("protect", false);
                        error!(error = %e, "taint/cordon failed; continuing with the checkpoint");
                        let _ = node
                            .event(
                                EventType::Warning,
                                reason::CORDON_FAILED,
                                &format!("taint/cordon failed: {e}"),
                            )
                            .await;
                    }
                }
            }
            let msg = format!(
                "{} notice {} from {}: deadline {}; {}",
                self.notice.kind.label(),
                self.notice.id,
                self.notice.source,
                self.deadline(),
                self.notice.detail
            );
            if let Err(e) = node
                .event(EventType::Warning, event_reason(&self.notice.kind), &msg)
                .await
            {
                self.deps.metrics.error("responder", e.metric_label());
                warn!(error = %e, "emitting node event failed");
            }
            for hook in &self.deps.on_start {
                hook(&self.notice);
            }
            state.phase = Phase::Protected;
            // When a checkpoint follows, the `signalled` record (which carries what was applied)
            // is the one write before the signal; otherwise record `protected` now.
            if !steps.checkpoint {
                self.persist(state, Phase::Protected).await;
            }
            let _ = self.events.send(PlanEvent::Protected {
                id: self.notice.id.clone(),
                at: Timestamp::now(),
            });
        }
        if self.cancel.is_cancelled() {
            return Err("cancelled".into());
        }

        // 3. Checkpoint.
        if steps.checkpoint && state.phase < Phase::Checkpointed {
            self.checkpoint(state, steps.drain).await;
            self.persist(state, Phase::Checkpointed).await;
        }
        if self.cancel.is_cancelled() {
            return Err("cancelled".into());
        }

        if self.notice.kind == NoticeKind::Rebalance && !steps.drain {
            let _ = self.expired_tx.send(self.notice.id.clone()).await;
            let _ = self.events.send(PlanEvent::Done {
                id: self.notice.id.clone(),
                at: Timestamp::now(),
            });
            return Ok(());
        }

        // 4. Drain.
        if steps.drain && state.phase < Phase::Drained {
            let report = self.drain().await?;
            self.persist(state, Phase::Drained).await;
            let _ = self.events.send(PlanEvent::Drained {
                id: self.notice.id.clone(),
                at: Timestamp::now(),
                report,
            });
        }

        // 5. Acknowledge (Azure) and finish.
        if state.phase < Phase::Done {
            if steps.drain {
                self.acknowledge().await;
            }
            self.persist(state, Phase::Done).await;
        }
        let _ = self.events.send(PlanEvent::Done {
            id: self.notice.id.clone(),
            at: Timestamp::now(),
        });
        Ok(())
    }

    async fn checkpoint(&mut self, state: &mut PlanState, drain: bool) {
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
        let (bound, reserve) = if self.notice.kind == NoticeKind::Rebalance && !drain {
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
        let deliveries = if let Some(at) = state.signalled_at {
            info!(signalled_at = %at, "signals were sent before a restart: waiting for acks without signalling again");
            let (g, r) = (groups.clone(), req.clone());
            match tokio::task::spawn_blocking(move || ckpt::plan_without_signal(&g, &r, at)).await {
                Ok(d) => d,
                Err(e) => {
                    error!(error = %e, "rebuilding the checkpoint wait failed");
                    Vec::new()
                }
            }
        } else {
            // Persist before signalling: a crash after this point never signals twice.
            let at = Timestamp::now();
            state.signalled_at = Some(at);
            self.persist(state, Phase::Signalled).await;
            let (g, r, m) = (groups.clone(), req.clone(), self.deps.metrics.clone());
            let deliveries =
                match tokio::task::spawn_blocking(move || ckpt::deliver(&g, &r, &m)).await {
                    Ok(d) => d,
                    Err(e) => {
                        error!(error = %e, "delivering checkpoint signals failed");
                        Vec::new()
                    }
                };
            let sent_at = Timestamp::now();
            let processes: usize = deliveries.iter().map(|d| d.signalled()).sum();
            let latency = sent_at
                .duration_since(self.notice.observed_at)
                .as_secs_f64();
            if processes > 0 && latency >= 0.0 {
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
            for g in &groups {
                if let Some(pod) = &g.pod {
                    let _ = self
                        .deps
                        .node
                        .pod_event(
                            pod,
                            EventType::Normal,
                            reason::CHECKPOINT_SIGNALLED,
                            &format!(
                                "{} sent for {} notice {}; checkpoint by {}",
                                g.signal, req.kind, req.notice_id, ck_deadline
                            ),
                        )
                        .await;
                }
            }
            deliveries
        };
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
        for r in &results {
            info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, ack_ms = ?r.ack_latency.map(|d| d.as_millis()), detail = %r.detail, "checkpoint result");
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
                let _ = self
                    .deps
                    .node
                    .pod_event(
                        pod,
                        kind,
                        reason,
                        &format!("checkpoint {}: {}", r.outcome.as_str(), r.detail),
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

    async fn drain(&mut self) -> Result<DrainReport, String> {
        let node = self.deps.node.clone();
        let _ = node
            .event(
                EventType::Normal,
                reason::DRAIN_STARTED,
                &format!("draining before {}", self.deadline()),
            )
            .await;
        let started = std::time::Instant::now();
        let report = loop {
            let req = DrainRequest {
                deadline: self.deadline(),
                force_delete_at_deadline: self.cfg.force_delete_at_deadline,
                concurrency: self.cfg.drain_concurrency,
            };
            let drain = node.drain(&req);
            tokio::pin!(drain);
            let outcome = tokio::select! {
                r = &mut drain => Some(r),
                // A deadline moved earlier: restart the (idempotent) drain with it.
                Ok(()) = self.deadline.changed() => None,
                _ = self.cancel.cancelled() => return Err("cancelled during drain".into()),
            };
            match outcome {
                Some(Ok(report)) => break report,
                Some(Err(e)) => {
                    self.deps.metrics.error("drain", e.metric_label());
                    if e.is_retryable() && Timestamp::now() < self.deadline() {
                        warn!(error = %e, "drain failed; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    error!(error = %e, "drain failed");
                    break DrainReport::default();
                }
                None => continue,
            }
        };
        self.deps
            .metrics
            .drain_duration
            .observe(started.elapsed().as_secs_f64());
        if report.complete() {
            let _ = node
                .event(
                    EventType::Normal,
                    reason::DRAIN_COMPLETE,
                    &format!("{} pods evicted", report.evicted.len()),
                )
                .await;
        } else {
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
            error!(blocked = ?blockers, "drain did not complete before the deadline");
            let _ = node
                .event(
                    EventType::Warning,
                    reason::DRAIN_BLOCKED,
                    &format!("still on the node at the deadline: {}", blockers.join("; ")),
                )
                .await;
        }
        Ok(report)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ResponderConfig {
        ResponderConfig {
            on_rebalance: RebalanceAction::Checkpoint,
            rebalance_expiry: Duration::from_secs(1800),
            on_maintenance: MaintenanceAction::Drain,
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
        let s = steps_for(&NoticeKind::Interruption, &c).unwrap();
        assert!(s.cordon && s.checkpoint && s.drain);
        assert_eq!(s.taint, Some(TaintEffect::NoSchedule));
        let r = steps_for(&NoticeKind::Rebalance, &c).unwrap();
        assert_eq!(r.taint, Some(TaintEffect::PreferNoSchedule));
        assert!(r.checkpoint && !r.drain && !r.cordon);
        let mut c2 = c.clone();
        c2.on_rebalance = RebalanceAction::Ignore;
        assert!(steps_for(&NoticeKind::Rebalance, &c2).is_none());
        c2.on_maintenance = MaintenanceAction::Cordon;
        let m = steps_for(&NoticeKind::Maintenance, &c2).unwrap();
        assert!(m.cordon && !m.checkpoint && !m.drain);
        assert_eq!(c.reserve(Source::Aws), Duration::from_secs(25));
        assert_eq!(c.reserve(Source::Gce), Duration::from_secs(8));
    }
}
