//! Signal first: discover the targets, write the local record listing every process about to be
//! signalled (a file, no API call), signal them all at once on the checkpoint module's own
//! threads, with protect / the Event / the start hooks beside it and, once the signal is out,
//! `DisruptionTarget` on the pods a draining plan takes down; then the record (with what was
//! applied) goes to both copies. Hands the deliveries to the ack wait.

use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::{error, info};

use super::{protect_beside, Flow, Run, Step};
use crate::checkpoint::run::{self as ckpt, CheckpointRequest, Prior, Signalled};
use crate::checkpoint::TargetGroup;
use crate::metrics::SourceLabels;
use crate::node::{reason, EventType};
use crate::notice::NoticeKind;
use crate::responder::plan::{merge_applied, Plan, Signalled as Handed};
use crate::responder::record::Phase;
use crate::responder::record::RecordedTarget;
use crate::responder::PlanEvent;

/// The checkpoint signal to every target.
pub(super) struct Signal;

#[async_trait]
impl Step for Signal {
    fn name(&self) -> &'static str {
        "signal"
    }

    fn applies(&self, run: &Run) -> bool {
        run.policy.checkpoint && run.state.phase < Phase::Checkpointed
    }

    fn runs_when_cancelled(&self) -> bool {
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        run.plan.deadline()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let groups = discover(&run.plan).await;
        let (request, reserve) = request(run);
        if groups.is_empty() {
            info!("no checkpoint targets found");
        }
        let prior = prior(run);
        if let Some(at) = run.state.signalled_at {
            info!(signalled_at = %at, "signals were sent before a restart: the processes the record lists (or whose notice.json names the notice) are only waited for");
        }
        record_targets(run, &groups).await;
        // Protect, the Event and the start hooks run beside the signal.
        let plan = &run.plan;
        let side = tokio::spawn(protect_beside(
            plan.deps.clone(),
            plan.notice.clone(),
            plan.deadline(),
            run.policy,
            run.resumed.is_none(),
            plan.budget(),
        ));
        // On threads of the checkpoint module's own, never tokio's blocking pool; every group
        // and container under its own deadline.
        let deliveries =
            ckpt::deliver_with_async(groups.clone(), request.clone(), prior, &plan.deps.metrics)
                .await;
        // After the signal, beside the rest: DisruptionTarget on the pods the drain will take.
        let marking = run.policy.drain.then(|| {
            let disruption = super::disruption::disruption(&plan.notice, plan.deadline());
            tokio::spawn(super::disruption::mark(
                plan.deps.clone(),
                disruption,
                plan.budget(),
            ))
        });
        let sent: Vec<usize> = deliveries.iter().map(|d| d.sent()).collect();
        announce(&run.plan, run.resumed.is_some(), &groups, &sent, &request).await;
        // What protect applied joins the record (both copies) before the wait.
        let applied = side.await.unwrap_or_else(|e| {
            error!(error = %e, "protect task failed");
            None
        });
        merge_applied(&mut run.state.applied, applied);
        if let Some(marking) = marking {
            let _ = marking.await;
        }
        run.persist(Phase::Signalled).await;
        run.plan.event(PlanEvent::Protected {
            id: run.plan.notice.id.clone(),
            at: Timestamp::now(),
        });
        run.found.signalled = Some(Handed {
            deliveries,
            request,
            reserve,
        });
        Flow::Next
    }
}

/// The targets: checkpoint discovery, nothing when it fails (logged and counted).
async fn discover(plan: &Plan) -> Vec<TargetGroup> {
    let deps = &plan.deps;
    match deps.discovery.discover().await {
        Ok(g) => g,
        Err(e) => {
            error!(error = %e, "checkpoint target discovery failed");
            deps.metrics.error("checkpoint", e.metric_label());
            Vec::new()
        }
    }
}

/// The checkpoint request and the drain reserve its deadline keeps: the acks are waited for until
/// `min(now + checkpoint-timeout, deadline − drain-reserve)`.
fn request(run: &Run) -> (CheckpointRequest, Duration) {
    let plan = &run.plan;
    let cfg = &plan.cfg;
    let now = Timestamp::now();
    // A rebalance recommendation has no deadline (its plan's "deadline" is the expiry): the
    // early checkpoint gets the full --checkpoint-timeout, with nothing reserved for a drain.
    let (bound, reserve) = if plan.notice.kind == NoticeKind::Rebalance && !run.policy.drain {
        (
            crate::duration::add(now, cfg.checkpoint_timeout),
            Duration::ZERO,
        )
    } else {
        (plan.deadline(), cfg.reserve(plan.notice.source))
    };
    let checkpoint_deadline =
        crate::duration::checkpoint_deadline(bound, now, reserve, cfg.checkpoint_timeout);
    let request = CheckpointRequest {
        notice_id: plan.notice.id.clone(),
        source: plan.notice.source.as_str().to_string(),
        kind: plan.notice.kind.label().to_string(),
        deadline: Some(plan.deadline()),
        checkpoint_deadline,
        dry_run: cfg.dry_run,
    };
    (request, reserve)
}

/// What is known about earlier deliveries of this notice (docs/checkpoint-protocol.md, "One
/// signal per notice"): a resumed plan's record lists who was signalled; without a list (an
/// older record) or with an unreadable record nothing lists them and `notice.json` decides,
/// holding the targets whose `notice.json` cannot be read; a fresh plan with a readable record
/// asks `notice.json` only.
fn prior(run: &Run) -> Prior {
    let plan = &run.plan;
    let signalled = match (run.state.signalled_at, &run.resumed) {
        (Some(_), Some(t)) if !t.is_empty() => {
            Signalled::Listed(t.iter().map(|t| (t.pid, t.start)).collect())
        }
        (Some(_), _) => Signalled::Unlisted,
        (None, _) if plan.reoccurred => Signalled::Nobody,
        (None, _) if plan.deps.local.was_unreadable() => Signalled::Unlisted,
        (None, _) => Signalled::Unrecorded,
    };
    Prior {
        life: plan.deps.life.id(),
        node: plan.cfg.node_name.clone(),
        signalled_at: run.state.signalled_at,
        signalled,
    }
}

/// The local record first (a file, no API call), listing every process about to be signalled,
/// so that a restart never signals one twice, even when notice.json cannot be written.
async fn record_targets(run: &mut Run, groups: &[TargetGroup]) {
    let mut listed: Vec<RecordedTarget> = run.resumed.clone().unwrap_or_default();
    for g in groups {
        for c in &g.containers {
            for p in &c.processes {
                let t = RecordedTarget {
                    pid: p.pid,
                    start: p.start_time,
                };
                if !listed.contains(&t) {
                    listed.push(t);
                }
            }
        }
    }
    if run.state.signalled_at.is_none() {
        run.state.signalled_at = Some(Timestamp::now());
    }
    run.plan.stamp(&mut run.state, Phase::Signalled);
    if !run.plan.cfg.dry_run {
        run.plan
            .records
            .save_local_with_targets(&run.state, listed)
            .await;
    }
}

/// After the signal: the notice-to-signal latency, the log line, the `Signalled` plan event and
/// a `CheckpointSignalled` Event on each pod that was signalled.
async fn announce(
    plan: &Plan,
    resumed: bool,
    groups: &[TargetGroup],
    sent: &[usize],
    request: &CheckpointRequest,
) {
    let sent_at = Timestamp::now();
    let processes: usize = sent.iter().sum();
    if processes == 0 && resumed {
        return;
    }
    let latency = sent_at
        .duration_since(plan.notice.observed_at)
        .as_secs_f64();
    if processes > 0 && latency >= 0.0 && !resumed {
        let source = plan.notice.source.as_str().into();
        let histogram = plan
            .deps
            .metrics
            .notice_to_signal
            .get_or_create(&SourceLabels { source });
        histogram.observe(latency);
    }
    let checkpoint_deadline = request.checkpoint_deadline;
    info!(processes, checkpoint_deadline = %checkpoint_deadline, "checkpoint signals sent");
    plan.event(PlanEvent::Signalled {
        id: plan.notice.id.clone(),
        at: sent_at,
        processes,
        checkpoint_deadline,
    });
    let budget = plan.budget();
    let told = groups.iter().zip(sent).filter(|(_, sent)| **sent > 0);
    for (g, _) in told {
        let Some(pod) = &g.pod else { continue };
        let message = format!(
            "{} sent for {} notice {}; checkpoint by {}",
            g.signal, request.kind, request.notice_id, checkpoint_deadline
        );
        let event = plan.deps.node.pod_event(
            pod,
            EventType::Normal,
            reason::CHECKPOINT_SIGNALLED,
            &message,
        );
        let _ = tokio::time::timeout(budget, event).await;
    }
}
