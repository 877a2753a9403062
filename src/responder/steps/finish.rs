//! The end of a plan: the cloud's event is acknowledged (Azure: approved, so that it starts
//! sooner) only after a complete drain, and the record reaches `done`.

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{info, warn};

use super::{Flow, Run, Step};
use crate::responder::plan::Plan;
use crate::responder::record::Phase;

/// Acknowledge after a complete drain, and finish.
pub(super) struct Finish;

#[async_trait]
impl Step for Finish {
    fn name(&self) -> &'static str {
        "finish"
    }

    fn applies(&self, run: &Run) -> bool {
        run.state.phase < Phase::Done
    }

    fn runs_when_cancelled(&self) -> bool {
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        run.plan.deadline()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        if run.policy.drain && run.state.phase == Phase::Drained {
            acknowledge(&run.plan).await;
        } else if run.policy.drain {
            info!("drain did not complete: the cloud's event is not acknowledged");
        }
        run.persist(Phase::Done).await;
        Flow::Next
    }
}

/// Tell the notice's source that spotguard is done with it.
async fn acknowledge(plan: &Plan) {
    let Some(source) = plan
        .deps
        .sources
        .iter()
        .find(|s| s.name() == plan.notice.source.as_str())
    else {
        return;
    };
    if !source.acknowledges(&plan.notice) {
        // Nothing to tell this cloud: nothing counted as done.
        return;
    }
    if plan.cfg.dry_run {
        info!("dry-run: would acknowledge the event to {}", source.name());
        return;
    }
    match source.acknowledge(&plan.notice).await {
        Ok(()) => plan.deps.metrics.action("acknowledge", true),
        Err(e) => {
            plan.deps.metrics.action("acknowledge", false);
            plan.deps.metrics.error("notice", e.metric_label());
            warn!(error = %e, "acknowledging the event failed");
        }
    }
}
