//! A rebalance recommendation that is not drained ends its plan after the early checkpoint (or
//! the soft taint): the responder undoes it at `--rebalance-expiry` unless an interruption
//! follows.

use async_trait::async_trait;
use jiff::Timestamp;

use super::{Flow, Run, Step};
use crate::notice::NoticeKind;

/// Hand a rebalance plan to its expiry.
pub(super) struct RebalanceExpiry;

#[async_trait]
impl Step for RebalanceExpiry {
    fn name(&self) -> &'static str {
        "rebalance expiry"
    }

    fn applies(&self, run: &Run) -> bool {
        run.plan.notice.kind == NoticeKind::Rebalance && !run.policy.drain
    }

    fn deadline(&self, _run: &Run) -> Timestamp {
        Timestamp::now()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let _ = run.plan.expired_tx.send(run.plan.notice.id.clone()).await;
        Flow::End
    }
}
