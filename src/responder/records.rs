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
    (store::until(deadline, now) / 4).clamp(SIDE_BUDGET_MIN, SIDE_BUDGET_MAX)
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

    pub(super) async fn clear(&self, budget: Duration) {
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
    pub(super) async fn load(&self) -> Option<PlanState> {
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
