//! Wait for the acks (and exits) of the processes the signal step signalled, until the checkpoint
//! deadline: `min(now + checkpoint-timeout, deadline − drain-reserve)`, moved earlier with the
//! plan's deadline. Each result is logged and told on its pod; the record reaches `checkpointed`.
//! A staged `done` ack is taken and its upload started while the wait goes on (the upload
//! step's hook, on the watcher's thread).

use async_trait::async_trait;
use jiff::Timestamp;
use tokio::sync::watch;
use tracing::info;

use super::{Flow, Run, Step};
use crate::checkpoint::run::{self as ckpt, GroupResult};
use crate::checkpoint::Outcome;
use crate::node::{reason, EventType};
use crate::responder::plan::{Plan, Signalled};
use crate::responder::record::Phase;
use crate::responder::PlanEvent;

/// The wait for the checkpoint acks.
pub(super) struct AckWait;

#[async_trait]
impl Step for AckWait {
    fn name(&self) -> &'static str {
        "ack wait"
    }

    fn applies(&self, run: &Run) -> bool {
        run.policy.checkpoint && run.state.phase < Phase::Checkpointed
    }

    fn runs_when_cancelled(&self) -> bool {
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        match &run.found.signalled {
            Some(s) => s.request.checkpoint_deadline,
            None => run.plan.deadline(),
        }
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let results = match run.found.signalled.take() {
            Some(signalled) => wait(run, signalled).await,
            None => Vec::new(),
        };
        tell(&run.plan, &results).await;
        run.plan.event(PlanEvent::Checkpointed {
            id: run.plan.notice.id.clone(),
            at: Timestamp::now(),
            results,
        });
        run.persist(Phase::Checkpointed).await;
        Flow::Next
    }
}

/// Wait; a deadline moved earlier moves the checkpoint deadline with it: the groups still
/// waiting then end `timeout`, as if their budget had been that short.
async fn wait(run: &mut Run, signalled: Signalled) -> Vec<GroupResult> {
    let plan = &mut run.plan;
    let Signalled {
        deliveries,
        request,
        reserve,
    } = signalled;
    let (ck_tx, ck_rx) = watch::channel(request.checkpoint_deadline);
    let metrics = plan.deps.metrics.clone();
    let hook = super::upload::arm(plan, reserve, &mut run.found);
    let wait = ckpt::wait_with(deliveries, &request, &metrics, &plan.cancel, ck_rx, hook);
    tokio::pin!(wait);
    loop {
        tokio::select! {
            r = &mut wait => break r,
            changed = plan.deadline.changed() => {
                if changed.is_err() { continue; }
                let new_ck = crate::duration::checkpoint_deadline(
                    *plan.deadline.borrow(),
                    Timestamp::now(),
                    reserve,
                    plan.cfg.checkpoint_timeout,
                );
                if new_ck < *ck_tx.borrow() {
                    info!(checkpoint_deadline = %new_ck, "deadline moved earlier: checkpoint wait cut short");
                    let _ = ck_tx.send(new_ck);
                }
            }
        }
    }
}

/// Each group's result in the log, and on its pod as an Event.
async fn tell(plan: &Plan, results: &[GroupResult]) {
    let budget = plan.budget();
    for r in results {
        match r.ack_latency {
            Some(d) => {
                info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, ack_ms = d.as_millis() as u64, detail = %r.detail, "checkpoint result")
            }
            None => {
                info!(target_group = %r.group, outcome = r.outcome.as_str(), signalled = r.signalled, detail = %r.detail, "checkpoint result")
            }
        }
        let Some(pod) = &r.pod else { continue };
        let (kind, reason) = match r.outcome {
            Outcome::Acked | Outcome::Exited => (EventType::Normal, reason::CHECKPOINT_ACKED),
            Outcome::Timeout => (EventType::Warning, reason::CHECKPOINT_TIMEOUT),
            Outcome::NoHandler => (EventType::Warning, reason::CHECKPOINT_NO_HANDLER),
            Outcome::Skipped | Outcome::Failed | Outcome::Error => {
                (EventType::Warning, reason::CHECKPOINT_FAILED)
            }
        };
        let message = format!("checkpoint {}: {}", r.outcome.as_str(), r.detail);
        let event = plan.deps.node.pod_event(pod, kind, reason, &message);
        let _ = tokio::time::timeout(budget, event).await;
    }
}
