//! Drain the node until the deadline (a pod whose staged checkpoint is uploading is held until
//! its upload ends: the upload step's holds), re-running the (idempotent) drain when the deadline moves
//! and retrying a retryable failure. Only a complete drain is recorded `drained`; a blocked or
//! failed one is reported (a `DrainBlocked` / `DrainFailed` Event, the error metric, the
//! `DrainFailed` plan event) and kept in the record's `failure`.

use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{error, warn};

use super::{Flow, Run, Step};
use crate::node::{reason, DrainReport, DrainRequest, EventType, Hold};
use crate::responder::plan::{Plan, SIDE_BUDGET_MIN};
use crate::responder::record::Phase;
use crate::responder::PlanEvent;

/// A retryable drain failure (API server unreachable, 5xx) is retried after this step, jittered
/// by `crate::backoff`, while the deadline allows.
const DRAIN_RETRY_PAUSE: Duration = Duration::from_secs(1);

/// The drain.
pub(super) struct Drain;

#[async_trait]
impl Step for Drain {
    fn name(&self) -> &'static str {
        "drain"
    }

    fn applies(&self, run: &Run) -> bool {
        run.policy.drain && run.state.phase < Phase::Drained && run.state.failure.is_none()
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        run.plan.deadline()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let outcome = match drain(&mut run.plan, &run.found.holds).await {
            Ok(outcome) => outcome,
            Err(cancelled) => return Flow::Stop(cancelled),
        };
        let id = run.plan.notice.id.clone();
        match outcome {
            Ok(report) => {
                run.persist(Phase::Drained).await;
                let at = Timestamp::now();
                run.plan.event(PlanEvent::Drained { id, at, report });
            }
            Err(failure) => {
                if let Some(report) = failure.report {
                    let at = Timestamp::now();
                    let id = id.clone();
                    run.plan.event(PlanEvent::Drained { id, at, report });
                }
                let reason = failure.reason.clone();
                let at = Timestamp::now();
                run.plan.event(PlanEvent::DrainFailed { id, at, reason });
                run.state.failure = Some(failure.reason);
            }
        }
        Flow::Next
    }
}

/// Why a drain did not complete.
struct DrainFailure {
    reason: String,
    /// The report, when the drain ran to the deadline with pods still on the node.
    report: Option<DrainReport>,
}

/// Drain until the deadline. `Ok(Ok(report))` only for a complete drain; a blocked or failed
/// one is reported (Event, metric) and returned as a [`DrainFailure`]. `Err` = cancelled.
async fn drain(
    plan: &mut Plan,
    holds: &[Hold],
) -> Result<Result<DrainReport, DrainFailure>, String> {
    let node = plan.deps.node.clone();
    let started_event = format!("draining before {}", plan.deadline());
    let started_event = node.event(EventType::Normal, reason::DRAIN_STARTED, &started_event);
    let _ = tokio::time::timeout(plan.budget(), started_event).await;
    let started = std::time::Instant::now();
    let outcome = until_deadline(plan, holds).await?;
    plan.deps
        .metrics
        .drain_duration
        .observe(started.elapsed().as_secs_f64());
    Ok(report(plan, outcome).await)
}

/// The drain, re-run when the deadline moves, a retryable failure retried while the deadline
/// allows. `Err` = cancelled.
async fn until_deadline(
    plan: &mut Plan,
    holds: &[Hold],
) -> Result<Result<DrainReport, crate::node::Error>, String> {
    let node = plan.deps.node.clone();
    loop {
        let req = DrainRequest {
            deadline: plan.deadline(),
            force_delete_at_deadline: plan.cfg.force_delete_at_deadline,
            concurrency: plan.cfg.drain_concurrency,
            holds: holds.to_vec(),
        };
        let drain = node.drain(&req);
        tokio::pin!(drain);
        let outcome = tokio::select! {
            r = &mut drain => Some(r),
            // A deadline moved: restart the (idempotent) drain with it.
            Ok(()) = plan.deadline.changed() => None,
            _ = plan.cancel.cancelled() => return Err("cancelled during drain".into()),
        };
        match outcome {
            Some(Ok(report)) => return Ok(Ok(report)),
            Some(Err(e)) => {
                if e.is_retryable() && Timestamp::now() < plan.deadline() {
                    plan.deps.metrics.error("drain", e.metric_label());
                    warn!(error = %e, "drain failed; retrying");
                    tokio::time::sleep(crate::backoff::jittered(DRAIN_RETRY_PAUSE)).await;
                    continue;
                }
                return Ok(Err(e));
            }
            None => continue,
        }
    }
}

/// A complete drain's `DrainComplete` Event; a blocked or failed one's Event, metrics and the
/// failure the plan records.
async fn report(
    plan: &Plan,
    outcome: Result<DrainReport, crate::node::Error>,
) -> Result<DrainReport, DrainFailure> {
    let node = &plan.deps.node;
    let metrics = &plan.deps.metrics;
    let budget = plan.budget().max(SIDE_BUDGET_MIN);
    // A failure: what it was, its error label, its Event reason, the report if any.
    let (reason, label, event_reason, report) = match outcome {
        Ok(report) if report.complete() => {
            metrics.action("drain", true);
            let message = format!("{} pods evicted", report.evicted.len());
            let complete = node.event(EventType::Normal, reason::DRAIN_COMPLETE, &message);
            let _ = tokio::time::timeout(budget, complete).await;
            return Ok(report);
        }
        Ok(report) => {
            let reason = crate::node::drain::blocked_summary(&report);
            error!(blocked = %reason, "drain did not complete before the deadline");
            (reason, "blocked", reason::DRAIN_BLOCKED, Some(report))
        }
        Err(e) => {
            error!(error = %e, "drain failed; the node is not reported drained");
            let reason = format!("drain failed: {e}");
            (reason, e.metric_label(), reason::DRAIN_FAILED, None)
        }
    };
    metrics.error("drain", label);
    let failed = node.event(EventType::Warning, event_reason, &reason);
    let _ = tokio::time::timeout(budget, failed).await;
    metrics.action("drain", false);
    Err(DrainFailure { reason, report })
}
