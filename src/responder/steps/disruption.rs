//! `DisruptionTarget` on the pods the plan will take down, started by the signal step once the
//! signal is delivered (never before it, never on its path), within the budget of an action
//! beside the signal.

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tracing::{info, warn};

use crate::node::{Disruption, DISRUPTION_REASON};
use crate::notice::Notice;
use crate::responder::Deps;

/// The condition for `notice`: its reason, and a message naming the cloud's notice.
pub(super) fn disruption(notice: &Notice, deadline: Timestamp) -> Disruption {
    Disruption {
        reason: DISRUPTION_REASON,
        message: format!(
            "{} {} notice {}: the node is taken down by {deadline}; spotguard asked for a checkpoint and drains the node",
            notice.source,
            notice.kind.label(),
            notice.id,
        ),
    }
}

/// Mark the pods, bounded by `budget`; logged and counted, never an error of the plan.
pub(super) async fn mark(deps: Arc<Deps>, disruption: Disruption, budget: Duration) {
    match tokio::time::timeout(budget, deps.node.mark_disruption(&disruption)).await {
        Ok(Ok(pods)) if pods.is_empty() => {}
        Ok(Ok(pods)) => info!(pods = ?pods, reason = disruption.reason, "DisruptionTarget set"),
        Ok(Err(e)) => {
            deps.metrics.error("responder", e.metric_label());
            warn!(error = %e, "setting DisruptionTarget on the node's pods failed");
        }
        Err(_) => {
            deps.metrics.error("responder", "disruption_timeout");
            warn!(
                budget_ms = budget.as_millis() as u64,
                "setting DisruptionTarget ran out of its budget"
            );
        }
    }
}
