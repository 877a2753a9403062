//! What a plan achieved, once it ends: follows the responder's [`PlanEvent`] stream and, on each
//! plan's `Done`, records checkpoint headroom in metrics, posts a Node Event and sends the outcome
//! webhook. It only listens: nothing here can delay the checkpoint signal or the drain.
//!
//! Per plan it keeps the notice, the signal time and checkpoint deadline (the budget), the
//! checkpoint results, the drain report and a drain failure. Budget = signal → checkpoint deadline;
//! duration = a group's signal → ack latency; headroom = budget − duration (0 for a group that never
//! acknowledged: timeout, no handler, error).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use jiff::Timestamp;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::checkpoint::run::GroupResult;
use crate::checkpoint::Outcome;
use crate::goodput::{self, record::Interruption};
use crate::metrics::{CategoryLabels, Metrics, OutcomeLabels};
use crate::node::{DrainReport, EventType, NodeOps};
use crate::notice::Notice;
use crate::responder::PlanEvent;
use crate::webhook::{NotifyFields, PlanOutcome, Webhook};

/// Node Event reasons of the outcome.
pub mod reason {
    /// Every checkpoint acknowledged and nothing left blocked.
    pub const HANDLED: &str = "InterruptionHandled";
    /// A checkpoint failed or timed out, pods stayed blocked, or the drain failed.
    pub const HANDLED_WITH_PROBLEMS: &str = "InterruptionHandledWithProblems";
    /// On each signalled pod: what the interruption cost it (docs/goodput.md).
    pub const BADPUT: &str = "InterruptionBadput";
    /// On the resumed pod: how long the job was away after an interruption (goodput; posted by
    /// [`crate::goodput::recovery`], which defines it).
    pub const RECOVERED: &str = crate::goodput::recovery::REASON;
}

/// Plans not finished within this long are forgotten (their `Done` was lost).
const FORGET_AFTER: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// Where outcomes go.
pub struct Sinks {
    pub metrics: Arc<Metrics>,
    /// Node Events (Kubernetes mode; host mode's NodeOps logs them).
    pub node: Option<Arc<dyn NodeOps>>,
    pub webhook: Option<Webhook>,
    /// Node name and instance for the webhook.
    pub node_name: String,
    pub instance: String,
    /// What spotguard does, for `{{action}}`.
    pub action: String,
    /// Host mode: `node_name` is a host, not a Kubernetes node.
    pub host: bool,
    /// The goodput log (`<state-dir>/goodput.jsonl`), appended as each plan ends; `None` in
    /// dry-run.
    pub goodput_log: Option<PathBuf>,
}

#[derive(Default)]
struct Tracked {
    notice: Option<Notice>,
    seen_at: Option<Timestamp>,
    signalled_at: Option<Timestamp>,
    checkpoint_deadline: Option<Timestamp>,
    results: Option<Vec<GroupResult>>,
    drain: Option<DrainReport>,
    drain_error: Option<String>,
    undone: bool,
    drained_at: Option<Timestamp>,
    /// Staged uploads: the trainer's pod (`namespace/name`, `None` on a host) and seconds.
    uploads: Vec<(Option<String>, f64)>,
}

/// Follow `events` until `cancel` or the channel closes.
pub async fn follow(
    mut events: broadcast::Receiver<PlanEvent>,
    sinks: Sinks,
    cancel: CancellationToken,
) {
    let mut plans: HashMap<String, Tracked> = HashMap::new();
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            e = events.recv() => e,
        };
        match event {
            Ok(e) => {
                if let Some((id, t, at)) = apply(&mut plans, e) {
                    finish(&sinks, &id, t, at).await;
                }
            }
            Err(broadcast::error::RecvError::Lagged(n)) => {
                sinks.metrics.error("outcome", "lagged");
                warn!(
                    missed = n,
                    "plan events missed: an outcome report may be incomplete"
                );
            }
            Err(broadcast::error::RecvError::Closed) => return,
        }
        let now = Timestamp::now();
        plans.retain(|_, t| {
            t.seen_at
                .is_none_or(|s| now.duration_since(s).unsigned_abs() < FORGET_AFTER)
        });
    }
}

/// Fold one event in; returns the finished plan on `Done`.
fn apply(
    plans: &mut HashMap<String, Tracked>,
    event: PlanEvent,
) -> Option<(String, Tracked, Timestamp)> {
    match event {
        PlanEvent::NoticeSeen { notice, at } => {
            let t = plans.entry(notice.id.clone()).or_default();
            t.seen_at = Some(at);
            t.notice = Some(notice);
        }
        PlanEvent::Protected { id, at } => {
            plans.entry(id).or_default().seen_at.get_or_insert(at);
        }
        PlanEvent::Signalled {
            id,
            at,
            checkpoint_deadline,
            ..
        } => {
            let t = plans.entry(id).or_default();
            t.seen_at.get_or_insert(at);
            t.signalled_at = Some(at);
            t.checkpoint_deadline = Some(checkpoint_deadline);
        }
        PlanEvent::Checkpointed { id, at, results } => {
            let t = plans.entry(id).or_default();
            t.seen_at.get_or_insert(at);
            t.results = Some(results);
        }
        PlanEvent::Drained { id, at, report } => {
            let t = plans.entry(id).or_default();
            t.seen_at.get_or_insert(at);
            t.drain = Some(report);
            t.drained_at = Some(at);
        }
        PlanEvent::DrainFailed { id, at, reason } => {
            let t = plans.entry(id).or_default();
            t.seen_at.get_or_insert(at);
            t.drain_error = Some(reason);
        }
        PlanEvent::Uploaded {
            id,
            at,
            pod,
            report,
        } => {
            let t = plans.entry(id).or_default();
            t.seen_at.get_or_insert(at);
            t.uploads.push((pod, report.seconds));
        }
        PlanEvent::Undone { id, .. } => {
            // After its `Done` a plan is gone: an undo then (a later cancellation) is no outcome.
            if let Some(t) = plans.get_mut(&id) {
                t.undone = true;
            }
        }
        PlanEvent::Done { id, at } => {
            let t = plans.remove(&id).unwrap_or_default();
            return Some((id, t, at));
        }
    }
    None
}

/// The training step in a checkpoint result's detail (`… step=1200 …`), the highest if several.
pub fn step_of(detail: &str) -> Option<u64> {
    detail
        .match_indices("step=")
        .filter_map(|(i, m)| {
            let rest = detail[i + m.len()..].trim_start_matches('"');
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .max()
}

/// Summarise a finished plan.
fn summarise(t: &Tracked, done_at: Timestamp) -> PlanOutcome {
    let budget = match (t.signalled_at, t.checkpoint_deadline) {
        (Some(s), Some(d)) => Some(d.duration_since(s).as_secs_f64().max(0.0)),
        _ => None,
    };
    let (checkpoint, step, slowest, checkpoint_ok) = match &t.results {
        None => ("not run".to_string(), None, None, true),
        Some(results) if results.is_empty() => ("no targets".to_string(), None, None, true),
        Some(results) => {
            let mut counts: Vec<(&str, usize)> = Vec::new();
            for r in results {
                let o = r.outcome.as_str();
                match counts.iter_mut().find(|(k, _)| *k == o) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((o, 1)),
                }
            }
            let text = counts
                .iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect::<Vec<_>>()
                .join(", ");
            let step = results
                .iter()
                .filter(|r| r.outcome == Outcome::Acked)
                .filter_map(|r| step_of(&r.detail))
                .max();
            let slowest = results
                .iter()
                .filter_map(|r| r.ack_latency)
                .max()
                .map(|d| d.as_secs_f64());
            let ok = results
                .iter()
                .all(|r| matches!(r.outcome, Outcome::Acked | Outcome::Exited));
            (text, step, slowest, ok)
        }
    };
    let (evicted, blocked_pods, blocking_pdbs) = match &t.drain {
        Some(d) => {
            let mut pdbs: Vec<String> = d.blocked.iter().flat_map(|b| b.pdbs.clone()).collect();
            pdbs.sort();
            pdbs.dedup();
            (
                d.evicted.len(),
                d.blocked.iter().map(|b| b.pod.clone()).collect(),
                pdbs,
            )
        }
        None => (0, Vec::new(), Vec::new()),
    };
    let outcome = if t.undone {
        "undone"
    } else if t.drain_error.is_some() {
        "drain_failed"
    } else {
        "completed"
    };
    let plan_seconds = t
        .seen_at
        .map(|s| done_at.duration_since(s).as_secs_f64().max(0.0))
        .unwrap_or(0.0);
    PlanOutcome {
        outcome: outcome.to_string(),
        ok: checkpoint_ok && blocked_pods.is_empty() && t.drain_error.is_none(),
        checkpoint,
        step,
        checkpoint_seconds: slowest,
        budget_seconds: budget,
        evicted,
        blocked_pods,
        blocking_pdbs,
        drain_error: t.drain_error.clone().unwrap_or_default(),
        plan_seconds,
        ..PlanOutcome::default()
    }
}

/// Record checkpoint headroom of one plan.
fn record(metrics: &Metrics, t: &Tracked, o: &PlanOutcome) {
    metrics
        .plans
        .get_or_create(&OutcomeLabels {
            outcome: o.outcome.clone(),
        })
        .inc();
    let (Some(results), Some(budget)) = (&t.results, o.budget_seconds) else {
        return;
    };
    for r in results {
        let headroom = match (r.outcome, r.ack_latency) {
            (Outcome::Exited, _) => continue,
            (_, Some(latency)) => (budget - latency.as_secs_f64()).max(0.0),
            (_, None) => 0.0,
        };
        metrics.checkpoint_headroom.observe(headroom);
    }
    metrics.last_budget.set(budget);
    if let Some(d) = o.checkpoint_seconds {
        metrics.last_duration.set(d);
    }
    if let Some(step) = o.step.and_then(|s| i64::try_from(s).ok()) {
        metrics.last_acked_step.set(step);
    }
}

/// The badput record of a finished plan (docs/goodput.md).
fn interruption(sinks: &Sinks, id: &str, t: &Tracked, done_at: Timestamp) -> Interruption {
    let targets = t
        .results
        .iter()
        .flatten()
        .map(|r| {
            let pod = r
                .pod
                .as_ref()
                .map(|p| format!("{}/{}", p.namespace, p.name));
            let upload = t
                .uploads
                .iter()
                .filter(|(p, _)| *p == pod)
                .map(|(_, s)| *s)
                .reduce(f64::max);
            let step = (r.outcome == Outcome::Acked)
                .then(|| step_of(&r.detail))
                .flatten();
            goodput::record::target(r, step, upload)
        })
        .collect();
    let notice = t.notice.as_ref();
    Interruption {
        notice_id: id.to_string(),
        node: sinks.node_name.clone(),
        kind: notice
            .map(|n| n.kind.label().to_string())
            .unwrap_or_default(),
        source: notice.map(|n| n.source.to_string()).unwrap_or_default(),
        published_at: notice.and_then(|n| n.published_at),
        seen_at: t.seen_at,
        signalled_at: t.signalled_at,
        deadline: notice.and_then(|n| n.deadline),
        drained_at: t.drained_at,
        done_at,
        targets,
    }
}

/// Badput metrics, the outcome's badput fields, the goodput log.
fn record_badput(sinks: &Sinks, i: &Interruption, o: &mut PlanOutcome) {
    for (category, seconds) in i.badput() {
        sinks
            .metrics
            .badput_seconds
            .get_or_create(&CategoryLabels {
                category: category.to_string(),
            })
            .inc_by(seconds);
    }
    sinks.metrics.steps_lost.inc_by(i.steps_lost());
    let [(_, save), (_, wasted)] = i.badput();
    if !i.targets.is_empty() {
        o.save_seconds = Some(save);
        o.wasted_seconds = Some(wasted);
        o.steps_lost = Some(i.steps_lost());
        o.badput = i
            .targets
            .iter()
            .map(|t| format!("{}: {}", t.target, t.summary()))
            .collect::<Vec<_>>()
            .join("; ");
    }
}

async fn finish(sinks: &Sinks, id: &str, t: Tracked, done_at: Timestamp) {
    let mut o = summarise(&t, done_at);
    record(&sinks.metrics, &t, &o);
    let badput = interruption(sinks, id, &t, done_at);
    record_badput(sinks, &badput, &mut o);
    if let Some(path) = sinks.goodput_log.clone() {
        let line = badput.clone();
        let written =
            tokio::task::spawn_blocking(move || goodput::report::append(&path, &line)).await;
        if let Ok(Err(e)) = written {
            sinks.metrics.error("outcome", "goodput_log");
            warn!(error = %e, "cannot append to the goodput log");
        }
    }
    let mut fields = match &t.notice {
        Some(n) => NotifyFields::from_notice(n, &sinks.node_name, &sinks.instance, &sinks.action),
        None => NotifyFields {
            node: sinks.node_name.clone(),
            instance: sinks.instance.clone(),
            notice_id: id.to_string(),
            action: sinks.action.clone(),
            ..NotifyFields::default()
        },
    };
    fields.outcome = Some(o.clone());
    fields.host = sinks.host;
    let summary = fields.summary(done_at);
    info!(
        notice_id = id,
        outcome = %o.outcome,
        ok = o.ok,
        checkpoint = %o.checkpoint,
        step = o.step,
        checkpoint_seconds = o.checkpoint_seconds,
        budget_seconds = o.budget_seconds,
        evicted = o.evicted as u64,
        blocked = o.blocked_pods.len() as u64,
        plan_seconds = o.plan_seconds,
        save_seconds = o.save_seconds,
        wasted_seconds = o.wasted_seconds,
        steps_lost = o.steps_lost,
        badput = %o.badput,
        "plan outcome"
    );
    if let Some(node) = &sinks.node {
        let (kind, reason) = if o.ok {
            (EventType::Normal, reason::HANDLED)
        } else {
            (EventType::Warning, reason::HANDLED_WITH_PROBLEMS)
        };
        if let Err(e) = node.event(kind, reason, &summary).await {
            sinks.metrics.error("outcome", e.metric_label());
            warn!(error = %e, "cannot post the outcome Event");
        }
    }
    if let Some(node) = &sinks.node {
        // One Event per pod (Kubernetes; a log line on a host): what the interruption cost it,
        // with its record (the interruption's timeline, that pod's target only) for
        // `spotguard goodput`.
        for (r, b) in t.results.iter().flatten().zip(&badput.targets) {
            let Some(pod) = &r.pod else { continue };
            let record = goodput::event::EventRecord::Badput(Interruption {
                targets: vec![b.clone()],
                ..badput.clone()
            });
            if let Err(e) = node
                .pod_record_event(
                    pod,
                    EventType::Normal,
                    reason::BADPUT,
                    &b.summary(),
                    &record,
                )
                .await
            {
                sinks.metrics.error("outcome", e.metric_label());
                warn!(error = %e, "cannot post the badput Event");
            }
        }
    }
    if let Some(hook) = &sinks.webhook {
        let _ = hook.notify(&fields);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_read_from_details() {
        assert_eq!(
            step_of("pid 7 done step=1200 checkpoint=s3://b/1200"),
            Some(1200)
        );
        assert_eq!(step_of("a step=3, b step=\"17\""), Some(17));
        assert_eq!(step_of("no step here"), None);
        assert_eq!(step_of("step=abc"), None);
    }

    #[test]
    fn a_clean_plan_is_ok_and_a_blocked_one_is_not() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let mut t = Tracked {
            seen_at: Some(t0),
            signalled_at: Some(t0),
            checkpoint_deadline: Some(t0 + std::time::Duration::from_secs(90)),
            results: Some(vec![GroupResult {
                group: "ns/p".into(),
                pod: None,
                outcome: Outcome::Acked,
                signalled: 1,
                signalled_at: Some(t0),
                ack_latency: Some(std::time::Duration::from_secs(30)),
                detail: "pid 1 done step=42".into(),
                exits: Vec::new(),
            }]),
            drain: Some(DrainReport {
                evicted: vec!["ns/a".into()],
                ..DrainReport::default()
            }),
            ..Tracked::default()
        };
        let o = summarise(&t, t0 + std::time::Duration::from_secs(50));
        assert!(o.ok);
        assert_eq!(o.outcome, "completed");
        assert_eq!(
            (o.step, o.checkpoint_seconds, o.budget_seconds),
            (Some(42), Some(30.0), Some(90.0))
        );
        assert_eq!(o.checkpoint, "1 acked");
        assert_eq!(o.plan_seconds, 50.0);
        t.drain = Some(DrainReport {
            blocked: vec![crate::node::BlockedPod {
                pod: "ns/b".into(),
                pdbs: vec!["web".into()],
                reason: "pdb".into(),
            }],
            ..DrainReport::default()
        });
        t.drain_error = Some("api down".into());
        let o = summarise(&t, t0);
        assert!(!o.ok);
        assert_eq!(o.outcome, "drain_failed");
        assert_eq!(o.blocking_pdbs, vec!["web".to_string()]);
    }
}
