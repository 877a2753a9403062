//! What a message says: the values of a start or outcome message ([`NotifyFields`],
//! [`PlanOutcome`]), the one-line summary, and the value of each placeholder.

use std::fmt::Write as _;
use std::time::Duration;

use jiff::Timestamp;

use crate::duration::time_until;
use crate::notice::Notice;

/// Placeholders a template may use. Outcome placeholders render empty in start messages.
pub const PLACEHOLDERS: &[&str] = &[
    "node",
    "instance",
    "kind",
    "source",
    "deadline",
    "deadline_unix",
    "time_left",
    "notice_id",
    "detail",
    "action",
    "message",
    "summary",
    "severity",
    "event_action",
    "dry_run",
    "dry_run_tag",
    "routing_key",
    "outcome",
    "ok",
    "checkpoint",
    "step",
    "checkpoint_seconds",
    "budget_seconds",
    "headroom_seconds",
    "evicted",
    "blocked",
    "blocked_pods",
    "blocking_pdbs",
    "drain_error",
    "plan_seconds",
    "save_seconds",
    "wasted_seconds",
    "steps_lost",
    "badput",
];

/// How a plan ended, for the outcome message.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanOutcome {
    /// `completed`, `drain_failed` or `undone`.
    pub outcome: String,
    /// Every group acked (or exited), the drain (if any) left nothing blocked and did not fail.
    pub ok: bool,
    /// Checkpoint outcomes, e.g. `2 acked, 1 timeout`; `not run` when the plan had no checkpoint.
    pub checkpoint: String,
    /// Highest training step the acks reported.
    pub step: Option<u64>,
    /// Slowest acknowledgement (signal → ack).
    pub checkpoint_seconds: Option<f64>,
    /// The checkpoint budget: signal → checkpoint deadline.
    pub budget_seconds: Option<f64>,
    pub evicted: usize,
    /// `namespace/name` of pods still on the node at the deadline.
    pub blocked_pods: Vec<String>,
    /// PodDisruptionBudgets that refused evictions.
    pub blocking_pdbs: Vec<String>,
    /// Why the drain failed, empty when it did not.
    pub drain_error: String,
    /// Notice seen → plan done.
    pub plan_seconds: f64,
    /// Badput (docs/goodput.md), summed over the targets: signal → ack of the groups that acked.
    pub save_seconds: Option<f64>,
    /// Training thrown away (after the last durable checkpoint), seconds and steps.
    pub wasted_seconds: Option<f64>,
    pub steps_lost: Option<u64>,
    /// Per target: `group: badput: checkpoint save 12.3s, nothing thrown away, …`; empty when
    /// nothing was signalled.
    pub badput: String,
}

/// Values substituted into the template. Build one with [`NotifyFields::from_notice`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NotifyFields {
    /// Kubernetes node name, or the host name in host mode.
    pub node: String,
    /// Cloud instance id / VM name where known (empty otherwise).
    pub instance: String,
    /// Notice kind label: `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `None` means "now": the notice gives no time, so it is treated as due at once.
    pub deadline: Option<Timestamp>,
    pub notice_id: String,
    /// The cloud's own words (action, event type, description).
    pub detail: String,
    /// What spotguard is doing about it, e.g. `checkpoint and drain`.
    pub action: String,
    /// Set for the message sent when the plan ends.
    pub outcome: Option<PlanOutcome>,
    /// Host mode: `node` is a host, not a Kubernetes node (the summary says "on host X").
    pub host: bool,
}

impl NotifyFields {
    pub fn from_notice(notice: &Notice, node: &str, instance: &str, action: &str) -> Self {
        NotifyFields {
            node: node.to_string(),
            instance: instance.to_string(),
            kind: notice.kind.label().to_string(),
            source: notice.source.as_str().to_string(),
            deadline: notice.deadline,
            notice_id: notice.id.clone(),
            detail: notice.detail.clone(),
            action: action.to_string(),
            outcome: None,
            host: false,
        }
    }

    /// What `node` names: a Kubernetes node, or a host.
    fn place(&self) -> &'static str {
        if self.host {
            "host"
        } else {
            "node"
        }
    }

    /// One line for humans: what happened and what spotguard did (or is doing).
    pub fn summary(&self, now: Timestamp) -> String {
        match &self.outcome {
            None => format!(
                "{} notice on {} {} ({}), deadline {} ({} left): {}",
                self.kind,
                self.place(),
                self.node,
                self.source,
                self.value(Field::Deadline, now, Ctx::default()),
                self.value(Field::TimeLeft, now, Ctx::default()),
                self.action
            ),
            Some(o) => {
                let mut s = format!(
                    "{} on {} {} {} after {}: checkpoint {}",
                    self.kind,
                    self.place(),
                    self.node,
                    if o.ok {
                        "handled"
                    } else {
                        "handled with problems"
                    },
                    secs(o.plan_seconds),
                    o.checkpoint
                );
                let mut inner = Vec::new();
                if let Some(step) = o.step {
                    inner.push(format!("step {step}"));
                }
                match (o.checkpoint_seconds, o.budget_seconds) {
                    (Some(d), Some(b)) => inner.push(format!("{} of {} budget", secs(d), secs(b))),
                    (Some(d), None) => inner.push(secs(d)),
                    _ => {}
                }
                if !inner.is_empty() {
                    let _ = write!(s, " ({})", inner.join(", "));
                }
                if o.outcome == "undone" {
                    s.push_str("; notice cancelled, changes undone");
                } else {
                    let _ = write!(
                        s,
                        "; drain: {} evicted, {} blocked",
                        o.evicted,
                        o.blocked_pods.len()
                    );
                    if !o.blocking_pdbs.is_empty() {
                        let _ = write!(s, " (PDB {})", o.blocking_pdbs.join(", "));
                    }
                    if !o.drain_error.is_empty() {
                        let _ = write!(s, "; drain failed: {}", o.drain_error);
                    }
                }
                if let (Some(save), Some(steps)) = (o.save_seconds, o.steps_lost) {
                    let _ = write!(s, "; badput: checkpoint save {}", secs(save));
                    match o.wasted_seconds {
                        Some(w) if steps > 0 => {
                            let _ = write!(s, ", {steps} steps ({}) thrown away", secs(w));
                        }
                        _ => {}
                    }
                }
                s
            }
        }
    }

    pub(super) fn value(&self, field: Field, now: Timestamp, ctx: Ctx<'_>) -> String {
        let o = self.outcome.as_ref();
        let num = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_default();
        match field {
            Field::Node => self.node.clone(),
            Field::Instance => self.instance.clone(),
            Field::Kind => self.kind.clone(),
            Field::Source => self.source.clone(),
            Field::Deadline => match self.deadline {
                Some(d) => d.to_string(),
                None => "now".to_string(),
            },
            Field::DeadlineUnix => self
                .deadline
                .map(|d| d.as_second().to_string())
                .unwrap_or_default(),
            Field::TimeLeft => {
                let left = time_until(self.deadline, now);
                crate::duration::display(Duration::from_secs(left.as_secs())).to_string()
            }
            Field::NoticeId => self.notice_id.clone(),
            Field::Detail => self.detail.clone(),
            Field::Action => self.action.clone(),
            Field::Message => if o.is_some() { "outcome" } else { "start" }.to_string(),
            Field::Summary => self.summary(now),
            Field::Severity => match o {
                None => "warning",
                Some(o) if o.ok => "info",
                Some(_) => "error",
            }
            .to_string(),
            Field::EventAction => match o {
                Some(o) if o.ok => "resolve",
                _ => "trigger",
            }
            .to_string(),
            Field::DryRun => ctx.dry_run.to_string(),
            Field::DryRunTag => if ctx.dry_run { "[DRY RUN] " } else { "" }.to_string(),
            Field::RoutingKey => ctx.routing_key.to_string(),
            Field::Outcome => o.map(|o| o.outcome.clone()).unwrap_or_default(),
            Field::Ok => o.map(|o| o.ok.to_string()).unwrap_or_default(),
            Field::Checkpoint => o.map(|o| o.checkpoint.clone()).unwrap_or_default(),
            Field::Step => o
                .and_then(|o| o.step)
                .map(|s| s.to_string())
                .unwrap_or_default(),
            Field::CheckpointSeconds => num(o.and_then(|o| o.checkpoint_seconds)),
            Field::BudgetSeconds => num(o.and_then(|o| o.budget_seconds)),
            Field::HeadroomSeconds => {
                num(o.and_then(|o| Some((o.budget_seconds? - o.checkpoint_seconds?).max(0.0))))
            }
            Field::Evicted => o.map(|o| o.evicted.to_string()).unwrap_or_default(),
            Field::Blocked => o
                .map(|o| o.blocked_pods.len().to_string())
                .unwrap_or_default(),
            Field::BlockedPods => o.map(|o| o.blocked_pods.join(", ")).unwrap_or_default(),
            Field::BlockingPdbs => o.map(|o| o.blocking_pdbs.join(", ")).unwrap_or_default(),
            Field::DrainError => o.map(|o| o.drain_error.clone()).unwrap_or_default(),
            Field::PlanSeconds => num(o.map(|o| o.plan_seconds)),
            Field::SaveSeconds => num(o.and_then(|o| o.save_seconds)),
            Field::WastedSeconds => num(o.and_then(|o| o.wasted_seconds)),
            Field::StepsLost => o
                .and_then(|o| o.steps_lost)
                .map(|s| s.to_string())
                .unwrap_or_default(),
            Field::Badput => o.map(|o| o.badput.clone()).unwrap_or_default(),
        }
    }
}

fn secs(s: f64) -> String {
    format!("{s:.1}s")
}

/// Per-webhook values (not per message).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ctx<'a> {
    pub(super) dry_run: bool,
    pub(super) routing_key: &'a str,
}

macro_rules! fields {
    ($($name:literal => $variant:ident),* $(,)?) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(super) enum Field { $($variant),* }
        impl Field {
            pub(super) fn parse(name: &str) -> Option<Field> {
                Some(match name { $($name => Field::$variant,)* _ => return None })
            }
        }
    };
}

fields! {
    "node" => Node,
    "instance" => Instance,
    "kind" => Kind,
    "source" => Source,
    "deadline" => Deadline,
    "deadline_unix" => DeadlineUnix,
    "time_left" => TimeLeft,
    "notice_id" => NoticeId,
    "detail" => Detail,
    "action" => Action,
    "message" => Message,
    "summary" => Summary,
    "severity" => Severity,
    "event_action" => EventAction,
    "dry_run" => DryRun,
    "dry_run_tag" => DryRunTag,
    "routing_key" => RoutingKey,
    "outcome" => Outcome,
    "ok" => Ok,
    "checkpoint" => Checkpoint,
    "step" => Step,
    "checkpoint_seconds" => CheckpointSeconds,
    "budget_seconds" => BudgetSeconds,
    "headroom_seconds" => HeadroomSeconds,
    "evicted" => Evicted,
    "blocked" => Blocked,
    "blocked_pods" => BlockedPods,
    "blocking_pdbs" => BlockingPdbs,
    "drain_error" => DrainError,
    "plan_seconds" => PlanSeconds,
    "save_seconds" => SaveSeconds,
    "wasted_seconds" => WastedSeconds,
    "steps_lost" => StepsLost,
    "badput" => Badput,
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::webhook) fn fields() -> NotifyFields {
        NotifyFields {
            node: "gpu-node-1".into(),
            instance: "i-0abc".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            deadline: Some(Timestamp::from_second(1_700_000_120).unwrap()),
            notice_id: "9f8e7d6c".into(),
            detail: "terminate".into(),
            action: "checkpoint and drain".into(),
            outcome: None,
            host: false,
        }
    }

    pub(in crate::webhook) fn now() -> Timestamp {
        Timestamp::from_second(1_700_000_000).unwrap()
    }

    #[test]
    fn fields_from_a_notice() {
        let notice = Notice {
            id: "abc".into(),
            kind: crate::notice::NoticeKind::Maintenance,
            source: crate::notice::Cloud::Azure,
            deadline: None,
            not_before: None,
            detail: "Reboot".into(),
            restart: true,
            published_at: None,
            maintenance: crate::notice::MaintenanceKind::Other,
            observed_at: now(),
            cloud_event_id: None,
        };
        let f = NotifyFields::from_notice(&notice, "node-9", "vm-9", "drain");
        assert_eq!(
            f,
            NotifyFields {
                node: "node-9".into(),
                instance: "vm-9".into(),
                kind: "maintenance".into(),
                source: "azure".into(),
                deadline: None,
                notice_id: "abc".into(),
                detail: "Reboot".into(),
                action: "drain".into(),
                outcome: None,
                host: false,
            }
        );
    }
}
