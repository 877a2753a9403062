//! The plan record's two copies (local file first, Node annotation within a budget) and the
//! budgets of the steps beside the signal.

use super::*;

/// Upper bound of one step beside the signal (protect, Event, annotation): a quarter of the time
/// left, between 1 s and 10 s.
pub(super) const SIDE_BUDGET_MAX: Duration = Duration::from_secs(10);
pub(super) const SIDE_BUDGET_MIN: Duration = Duration::from_secs(1);
/// Bound on reading the Node annotation at start-up (the local record answers without it).
pub(super) const LOAD_BUDGET: Duration = Duration::from_secs(5);

pub(super) fn side_budget(deadline: Timestamp, now: Timestamp) -> Duration {
    (duration::until(deadline, now) / 4).clamp(SIDE_BUDGET_MIN, SIDE_BUDGET_MAX)
}

/// The two copies of the plan record: the local file (always; written first, fsync'd) and the Node
/// annotation (Kubernetes mode; within a budget).
#[derive(Clone)]
pub(super) struct Records {
    pub(super) local: StateFile,
    pub(super) node: Arc<dyn NodeOps>,
    pub(super) metrics: Arc<Metrics>,
}

impl Records {
    pub(super) fn new(deps: &Deps) -> Self {
        Records {
            local: deps.local.clone(),
            node: deps.node.clone(),
            metrics: deps.metrics.clone(),
        }
    }

    pub(super) fn remote(&self) -> bool {
        !self.node.state_is_local()
    }

    pub(super) async fn save_local(&self, state: &PlanState) {
        if let Err(e) = self.local.save(state).await {
            error!(phase = state.phase.as_str(), error = %e, "persisting the local plan record failed");
            self.metrics.error("responder", e.metric_label());
        }
    }

    /// The local record with the processes about to be signalled (before the signal).
    pub(super) async fn save_local_with_targets(
        &self,
        state: &PlanState,
        targets: Vec<RecordedTarget>,
    ) {
        if let Err(e) = self.local.save_with_targets(state, targets).await {
            error!(phase = state.phase.as_str(), error = %e, "persisting the local plan record failed; a restarted agent tells who was signalled from notice.json");
            self.metrics.error("responder", e.metric_label());
        }
    }

    /// Remove one plan from the record (its notice was cancelled and undone); the other kinds'
    /// plans stay. The Node annotation holds one plan: it is cleared when it is this one.
    pub(super) async fn clear_plan(&self, id: &str, budget: Duration) {
        if let Err(e) = self.local.clear_plan(id).await {
            error!(error = %e, "clearing the plan from the local record failed");
            self.metrics.error("responder", e.metric_label());
        }
        if self.remote() {
            let remote = tokio::time::timeout(budget, self.node.load_state()).await;
            if let Ok(Ok(Some(s))) = remote {
                if s.id != id {
                    return;
                }
            }
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

    pub(super) async fn save_remote(&self, state: &PlanState, budget: Duration) {
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

    pub(super) async fn save(&self, state: &PlanState, budget: Duration) {
        self.save_local(state).await;
        self.save_remote(state, budget).await;
    }

    /// Everything the records say. The latest plan: of the local file and the Node annotation,
    /// the one further along (the same notice: the later phase; different notices: the newer
    /// record); an unreadable copy is logged and counted (and remembered by the local
    /// [`StateFile`]); an API outage leaves the local record. With it the processes the local
    /// record lists for it, and the other kinds' plans of the local record.
    pub(super) async fn load_all(&self) -> Loaded {
        let local = match self.local.load_record().await {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "local plan record unreadable: ignoring it; until a new record is written, a target whose notice.json cannot be read is not signalled (it may have been)");
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
        let (local_latest, targets, earlier) = match local {
            Some(r) => (Some(r.latest), r.targets, r.earlier),
            None => (None, Vec::new(), Vec::new()),
        };
        let latest = newest(local_latest.clone(), remote);
        // The target list belongs to the local copy's latest plan.
        let targets = match (&latest, &local_latest) {
            (Some(l), Some(ll)) if l.id == ll.id && l.kind == ll.kind => targets,
            _ => Vec::new(),
        };
        let mut earlier = earlier;
        if let (Some(l), Some(ll)) = (&latest, local_latest) {
            // The annotation was newer and of another kind: the local latest is still a plan of
            // this life worth remembering.
            if ll.kind != l.kind {
                earlier.retain(|p| p.kind != ll.kind);
                earlier.push(ll);
            }
        }
        earlier.retain(|p| latest.as_ref().is_none_or(|l| l.kind != p.kind));
        Loaded {
            latest,
            targets,
            earlier,
        }
    }
}

/// What [`Records::load_all`] found.
#[derive(Debug, Default)]
pub(super) struct Loaded {
    pub(super) latest: Option<PlanState>,
    pub(super) targets: Vec<RecordedTarget>,
    pub(super) earlier: Vec<PlanState>,
}

/// The record further along of two copies.
pub(super) fn newest(local: Option<PlanState>, remote: Option<PlanState>) -> Option<PlanState> {
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
