//! One plan in progress: the notice, what the policy asks, the plan's record, and the steps it
//! runs in order ([`super::steps`]). The plan owns what every step shares: the deadline (moved
//! earlier by later notices), the budget of the actions beside the signal, persisting the record
//! at each phase, and what earlier steps hand to later ones ([`Found`]).

use super::steps;
use super::*;
use crate::checkpoint::run::{CheckpointRequest, Delivery};

/// Upper bound of one action beside the signal (protect, Event, annotation): a quarter of the
/// time left, between 1 s and 10 s.
pub(super) const SIDE_BUDGET_MAX: Duration = Duration::from_secs(10);
pub(super) const SIDE_BUDGET_MIN: Duration = Duration::from_secs(1);

pub(super) fn side_budget(deadline: Timestamp, now: Timestamp) -> Duration {
    (duration::until(deadline, now) / 4).clamp(SIDE_BUDGET_MIN, SIDE_BUDGET_MAX)
}

/// One plan in progress.
pub(super) struct Plan {
    pub(super) seq: u64,
    pub(super) finished_tx: mpsc::UnboundedSender<u64>,
    pub(super) cfg: ResponderConfig,
    pub(super) deps: Arc<Deps>,
    pub(super) records: Records,
    pub(super) events: broadcast::Sender<PlanEvent>,
    pub(super) notice: Notice,
    pub(super) deadline: watch::Receiver<Timestamp>,
    pub(super) cancel: CancellationToken,
    pub(super) expired_tx: mpsc::Sender<String>,
    /// The notice is a fixed id seen again after its cancel: nobody was signalled for this
    /// occurrence yet, whatever `notice.json` says (it names the earlier one).
    pub(super) reoccurred: bool,
}

/// A plan while its steps run: the plan, what the policy asks, its record, and what the steps
/// found so far.
pub(super) struct Run {
    pub(super) plan: Plan,
    pub(super) policy: Policy,
    /// The plan's record, persisted at each phase.
    pub(super) state: PlanState,
    /// A resumed plan: the processes its record lists as signalled (`None`: a fresh plan).
    pub(super) resumed: Option<Vec<RecordedTarget>>,
    pub(super) found: Found,
}

/// What earlier steps hand to later ones.
#[derive(Default)]
pub(super) struct Found {
    /// The signal step's deliveries, for the ack wait.
    pub(super) signalled: Option<Signalled>,
    /// The staged checkpoints the ack wait took (their uploads already running), for the
    /// upload step, with the drain reserve their uploads keep.
    pub(super) staged: Option<(
        tokio::sync::mpsc::UnboundedReceiver<crate::upload::service::Staged>,
        Duration,
    )>,
    /// Pods the drain evicts only after their upload (the upload step's holds).
    pub(super) holds: Vec<crate::node::Hold>,
    /// The upload step's followers (each reports one upload and ends its hold).
    pub(super) uploads: Vec<tokio::task::JoinHandle<()>>,
}

/// What the signal step delivered: the ack wait waits on it.
pub(super) struct Signalled {
    pub(super) deliveries: Vec<Delivery>,
    pub(super) request: CheckpointRequest,
    /// The drain reserve the checkpoint deadline kept: a deadline moved earlier moves the
    /// checkpoint deadline by the same rule.
    pub(super) reserve: Duration,
}

impl Plan {
    pub(super) async fn run(self, resume: Option<(PlanState, Vec<RecordedTarget>)>) {
        let (seq, finished) = (self.seq, self.finished_tx.clone());
        self.run_steps(resume).await;
        let _ = finished.send(seq);
    }

    async fn run_steps(self, resume: Option<(PlanState, Vec<RecordedTarget>)>) {
        let Some(policy) = policy_for(&self.notice, &self.cfg) else {
            info!("policy says ignore: logged only");
            return;
        };
        let active = OutcomeLabels {
            outcome: self.notice.kind.label().into(),
        };
        let metrics = self.deps.metrics.clone();
        metrics.notice_active.get_or_create(&active).set(1);
        if self.notice.kind == NoticeKind::Interruption {
            metrics.deadline.set(self.deadline().as_second() as f64);
        }
        let (state, resumed) = match resume {
            Some((state, targets)) => (state, Some(targets)),
            // No separate record of `detected`: the notice is still in the metadata service
            // after a crash, and every write before the signal costs time.
            None => (self.fresh_state(), None),
        };
        let mut run = Run {
            plan: self,
            policy,
            state,
            resumed,
            found: Found::default(),
        };
        let result = steps::run(&mut run).await;
        metrics.notice_active.get_or_create(&active).set(0);
        match result {
            Ok(()) => {
                let _ = run.plan.events.send(PlanEvent::Done {
                    id: run.plan.notice.id.clone(),
                    at: Timestamp::now(),
                });
            }
            Err(why) => warn!("plan stopped: {why}"),
        }
    }

    /// The record of a plan that starts now.
    fn fresh_state(&self) -> PlanState {
        PlanState {
            id: self.notice.id.clone(),
            kind: self.notice.kind.clone(),
            source: self.notice.source,
            deadline: Some(*self.deadline.borrow()),
            phase: Phase::Detected,
            signalled_at: None,
            applied: Applied::default(),
            boot_id: self.deps.life.id(),
            restart: self.notice.restart,
            detail: self.notice.detail.clone(),
            failure: None,
            updated_at: Timestamp::now(),
        }
    }

    pub(super) fn deadline(&self) -> Timestamp {
        *self.deadline.borrow()
    }

    /// The budget of one action beside the signal, from the time left now.
    pub(super) fn budget(&self) -> Duration {
        side_budget(self.deadline(), Timestamp::now())
    }

    pub(super) fn stamp(&self, state: &mut PlanState, phase: Phase) {
        state.phase = phase;
        state.deadline = Some(self.deadline());
        state.boot_id = self.deps.life.id();
        state.updated_at = Timestamp::now();
    }

    /// Both copies: the local record, then the Node annotation within the budget.
    pub(super) async fn persist(&self, state: &mut PlanState, phase: Phase) {
        self.stamp(state, phase);
        self.records.save(state, self.budget()).await;
    }

    /// Send a plan event (drill, tests, the outcome follower).
    pub(super) fn event(&self, event: PlanEvent) {
        let _ = self.events.send(event);
    }
}

impl Run {
    /// [`Plan::persist`] of this run's record.
    pub(super) async fn persist(&mut self, phase: Phase) {
        self.plan.persist(&mut self.state, phase).await;
    }
}

/// Add what one protect call applied to what the plan applied so far.
pub(super) fn merge_applied(into: &mut Applied, new: Option<Applied>) {
    if let Some(a) = new {
        into.cordoned |= a.cordoned;
        if into.taint_effect.is_none() {
            into.taint_effect = a.taint_effect;
        }
    }
}
