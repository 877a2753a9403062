//! Protect the node: taint (and cordon) it, emit the notice's Event, run the start hooks. Beside
//! the signal when the plan checkpoints ([`beside`], started by the signal step); on its own, as
//! the [`Protect`] step, when it does not (a maintenance or rebalance that only cordons).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{error, warn};

use super::{Flow, Run, Step};
use crate::node::{reason, Applied, EventType, NodeOps, Protection};
use crate::notice::Notice;
use crate::responder::plan::merge_applied;
use crate::responder::policy::{event_reason, Policy};
use crate::responder::record::Phase;
use crate::responder::{Deps, PlanEvent};

/// Taint + cordon, the notice's Event and (on a fresh plan) the start hooks, for a plan that
/// does not checkpoint.
pub(super) struct Protect;

#[async_trait]
impl Step for Protect {
    fn name(&self) -> &'static str {
        "protect"
    }

    fn applies(&self, run: &Run) -> bool {
        !run.policy.checkpoint && run.state.phase < Phase::Protected
    }

    fn runs_when_cancelled(&self) -> bool {
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        crate::duration::add(Timestamp::now(), run.plan.budget())
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let plan = &run.plan;
        let applied = beside(
            plan.deps.clone(),
            plan.notice.clone(),
            plan.deadline(),
            run.policy,
            run.resumed.is_none(),
            plan.budget(),
        )
        .await;
        merge_applied(&mut run.state.applied, applied);
        run.persist(Phase::Protected).await;
        run.plan.event(PlanEvent::Protected {
            id: run.plan.notice.id.clone(),
            at: Timestamp::now(),
        });
        Flow::Next
    }
}

/// Taint + cordon, the notice's Event, and (with `hooks`: a fresh plan) the start hooks, each
/// bounded by `budget`. Never on the signal's path. Returns what the protect applied.
pub(in crate::responder) async fn beside(
    deps: Arc<Deps>,
    notice: Notice,
    deadline: Timestamp,
    policy: Policy,
    hooks: bool,
    budget: Duration,
) -> Option<Applied> {
    let protect = protect(&deps, &notice, policy, !hooks, budget);
    let event = notice_event(&deps, &notice, deadline, budget);
    if hooks {
        for hook in &deps.on_start {
            hook(&notice);
        }
    }
    let (applied, ()) = tokio::join!(protect, event);
    applied
}

/// Taint (and cordon) as `policy` says; `None` when the policy taints nothing or it failed (a
/// `CordonFailed` Event says why). A resumed plan also counts what the node's own marks say
/// spotguard applied: an earlier run may have protected the node and died before recording it.
async fn protect(
    deps: &Deps,
    notice: &Notice,
    policy: Policy,
    resumed: bool,
    budget: Duration,
) -> Option<Applied> {
    let node = &deps.node;
    let effect = policy.taint?;
    let protection = Protection {
        taint_value: notice.kind.label().to_string(),
        effect,
        cordon: policy.cordon,
    };
    // One call: node ops retry conflicts and 5xx themselves, boundedly.
    let failure = match tokio::time::timeout(budget, node.protect(&protection)).await {
        Ok(Ok(mut applied)) => {
            if node.has_node() {
                deps.metrics.action("protect", true);
            }
            if resumed {
                if let Ok(Ok(marks)) = tokio::time::timeout(budget, node.applied_marks()).await {
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
    let message = format!("taint/cordon failed: {failure}");
    let cordon_failed = node.event(EventType::Warning, reason::CORDON_FAILED, &message);
    let _ = tokio::time::timeout(budget, cordon_failed).await;
    None
}

/// The notice's Event on the node.
async fn notice_event(deps: &Deps, notice: &Notice, deadline: Timestamp, budget: Duration) {
    let msg = format!(
        "{} notice {} from {}: deadline {}; {}",
        notice.kind.label(),
        notice.id,
        notice.source,
        deadline,
        notice.detail
    );
    let emit = deps
        .node
        .event(EventType::Warning, event_reason(&notice.kind), &msg);
    match tokio::time::timeout(budget, emit).await {
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
}
