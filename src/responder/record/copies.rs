//! The plan record's two copies: the local file (always; written first, fsync'd) and the node's
//! copy (Kubernetes: the Node annotation `spotguard.io/notice`, within a budget; host mode has
//! none). Which copy is further along when both are read.

use std::sync::Arc;
use std::time::Duration;

use tracing::{error, warn};

use super::{PlanState, RecordedTarget, StateFile};
use crate::metrics::Metrics;
use crate::node::{Error as NodeError, NodeOps, NOTICE_ANNOTATION};

/// Bound on reading the node's copy at start-up (the local record answers without it).
pub(crate) const LOAD_BUDGET: Duration = Duration::from_secs(5);

/// The two copies of the plan record: the local file (always; written first, fsync'd) and the Node
/// annotation (Kubernetes mode; within a budget).
#[derive(Clone)]
pub(crate) struct Records {
    pub(crate) local: StateFile,
    pub(crate) node: Arc<dyn NodeOps>,
    pub(crate) metrics: Arc<Metrics>,
}

impl Records {
    pub(crate) fn new(deps: &super::super::Deps) -> Self {
        Records {
            local: deps.local.clone(),
            node: deps.node.clone(),
            metrics: deps.metrics.clone(),
        }
    }

    pub(crate) async fn save_local(&self, state: &PlanState) {
        if let Err(e) = self.local.save(state).await {
            error!(phase = state.phase.as_str(), error = %e, "persisting the local plan record failed");
            self.metrics.error("responder", e.metric_label());
        }
    }

    /// The local record with the processes about to be signalled (before the signal).
    pub(crate) async fn save_local_with_targets(
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
    pub(crate) async fn clear_plan(&self, id: &str, budget: Duration) {
        if let Err(e) = self.local.clear_plan(id).await {
            error!(error = %e, "clearing the plan from the local record failed");
            self.metrics.error("responder", e.metric_label());
        }
        {
            let remote = tokio::time::timeout(budget, self.load_remote()).await;
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

    pub(crate) async fn save_remote(&self, state: &PlanState, budget: Duration) {
        let save = async { self.node.save_state(&node_copy(state)?).await };
        match tokio::time::timeout(budget, save).await {
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

    pub(crate) async fn save(&self, state: &PlanState, budget: Duration) {
        self.save_local(state).await;
        self.save_remote(state, budget).await;
    }

    /// Everything the records say. The latest plan: of the local file and the Node annotation,
    /// the one further along (the same notice: the later phase; different notices: the newer
    /// record); an unreadable copy is logged and counted (and remembered by the local
    /// [`StateFile`]); an API outage leaves the local record. With it the processes the local
    /// record lists for it, and the other kinds' plans of the local record.
    pub(crate) async fn load_all(&self) -> Loaded {
        let local = match self.local.load_record().await {
            Ok(r) => r,
            Err(e) => {
                error!(error = %e, "local plan record unreadable: ignoring it; until a new record is written, a target whose notice.json cannot be read is not signalled (it may have been)");
                self.metrics.error("responder", e.metric_label());
                None
            }
        };
        let remote = {
            match tokio::time::timeout(LOAD_BUDGET, self.load_remote()).await {
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

    /// The node's copy, read back into a record.
    async fn load_remote(&self) -> Result<Option<PlanState>, NodeError> {
        match self.node.load_state().await? {
            Some(raw) => serde_json::from_str(&raw)
                .map(Some)
                .map_err(|e| corrupt(e.to_string())),
            None => Ok(None),
        }
    }
}

/// The node's copy of `state`: the record as compact JSON (the annotation's bytes).
fn node_copy(state: &PlanState) -> Result<String, NodeError> {
    serde_json::to_string(state).map_err(|e| corrupt(e.to_string()))
}

fn corrupt(reason: String) -> NodeError {
    NodeError::StateCorrupt {
        location: format!("the node's copy (annotation {NOTICE_ANNOTATION})"),
        reason,
    }
}

/// What [`Records::load_all`] found.
#[derive(Debug, Default)]
pub(crate) struct Loaded {
    pub(crate) latest: Option<PlanState>,
    pub(crate) targets: Vec<RecordedTarget>,
    pub(crate) earlier: Vec<PlanState>,
}

/// The record further along of two copies.
pub(crate) fn newest(local: Option<PlanState>, remote: Option<PlanState>) -> Option<PlanState> {
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
