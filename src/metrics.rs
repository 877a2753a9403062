//! One Prometheus registry for the whole agent. Core families live here; modules with many series
//! of their own (gpu, prefetch) define a struct with `register(&mut Registry)`, registered next to
//! [`Metrics::register`] by the process that runs them (the agent's `app`, the prefetcher's own
//! process). Labels are low-cardinality only: no pod names, no notice ids.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SourceLabels {
    pub source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub source: String,
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NoticeLabels {
    pub source: String,
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub kind: String,
    pub decision: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CategoryLabels {
    pub category: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModuleErrorLabels {
    pub module: String,
    pub error: String,
}

/// Latency buckets from 1 ms to ~2 min.
fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
        20.0, 30.0, 60.0, 90.0, 120.0,
    ]
    .into_iter()
}

fn histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// Headroom buckets (budget − duration of a checkpoint), 0 s to 5 min.
fn headroom_buckets() -> impl Iterator<Item = f64> {
    [
        0.0, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    ]
    .into_iter()
}

/// Label values known in advance: every combination is exported at 0 from start-up, so that the
/// first event on a fresh node is an increase from 0 (a series born at 1 has `increase()` = 0 and
/// an alert on it never fires). docs/metrics.md lists the same values; tests/docs.rs checks both.
pub mod known {
    /// `source` of the notice and metadata families.
    pub const SOURCES: &[&str] = &["aws", "gce", "azure"];
    /// `error` of `spotguard_metadata_errors_total`.
    pub const METADATA_ERRORS: &[&str] = &[
        "request",
        "timeout",
        "status",
        "token",
        "parse",
        "acknowledge",
        "too_large",
    ];
    /// `kind` of `spotguard_notices_total`.
    pub const NOTICE_KINDS: &[&str] = &["interruption", "rebalance", "maintenance", "cancelled"];
    /// `decision` of `spotguard_notice_decisions_total`: what the notice store decided a notice
    /// means (`crate::responder::Decision::label`).
    pub const NOTICE_DECISIONS: &[&str] = &[
        "start_interruption",
        "deadline_moved",
        "new_interruption",
        "new",
        "updated",
        "cancel",
        "gone_after_action",
        "duplicate",
    ];
    /// `kind` of `spotguard_notice_active` (a cancellation has no plan of its own).
    pub const ACTIVE_KINDS: &[&str] = &["interruption", "rebalance", "maintenance"];
    /// `outcome` of `spotguard_checkpoint_total`.
    pub const CHECKPOINT_OUTCOMES: &[&str] = &[
        "acked",
        "skipped",
        "failed",
        "exited",
        "timeout",
        "no_handler",
        "error",
    ];
    /// `action` of `spotguard_node_actions_total`.
    pub const NODE_ACTIONS: &[&str] = &[
        "protect",
        "unprotect",
        "taint",
        "untaint",
        "cordon",
        "uncordon",
        "annotate",
        "condition",
        "disruption_target",
        "event",
        "record",
        "acknowledge",
        "drain",
    ];
    /// `outcome` of `spotguard_node_actions_total`.
    pub const ACTION_OUTCOMES: &[&str] = &["ok", "error"];
    /// `outcome` of `spotguard_drain_pods_total`.
    pub const DRAIN_OUTCOMES: &[&str] = &["evicted", "blocked", "force_deleted", "skipped", "gone"];
    /// `outcome` of `spotguard_webhook_total`.
    pub const WEBHOOK_OUTCOMES: &[&str] = &["sent", "failed", "retry", "suppressed"];
    /// `outcome` of `spotguard_plans_total`.
    pub const PLAN_OUTCOMES: &[&str] = &["completed", "drain_failed", "undone"];
    /// `category` of `spotguard_badput_seconds_total` (`crate::goodput::record::category`).
    pub const BADPUT_CATEGORIES: &[&str] = &[
        "checkpoint_save",
        "wasted_progress",
        "infrastructure_recovery",
        "checkpoint_restore",
    ];
    /// `module` of `spotguard_errors_total` (its `error` label is the module's error class; the
    /// zero series carries `error="none"`).
    pub const ERROR_MODULES: &[&str] = &[
        "checkpoint",
        "detect",
        "drain",
        "goodput",
        "gpu",
        "node",
        "notice",
        "outcome",
        "prefetch",
        "responder",
        "webhook",
    ];
}

/// Core metric families.
pub struct Metrics {
    /// `spotguard_metadata_errors_total{source,error}`: failed polls of the metadata service.
    pub metadata_errors: Family<ErrorLabels, Counter>,
    /// `spotguard_metadata_polls_total{source}`: successful polls.
    pub metadata_polls: Family<SourceLabels, Counter>,
    /// `spotguard_notices_total{source,kind}`: new notices accepted by the store (after dedupe).
    pub notices: Family<NoticeLabels, Counter>,
    /// `spotguard_notice_decisions_total{kind,decision}`: every notice a source delivered, by
    /// what the store decided it means (a `duplicate` is a re-poll of a notice already handled).
    pub notice_decisions: Family<DecisionLabels, Counter>,
    /// `spotguard_notice_detection_seconds{source}`: cloud publication → agent saw it, where the
    /// cloud gives a publication time.
    pub detection_latency: Family<SourceLabels, Histogram, fn() -> Histogram>,
    /// `spotguard_notice_to_signal_seconds{source}`: agent saw the notice → checkpoint signal sent.
    pub notice_to_signal: Family<SourceLabels, Histogram, fn() -> Histogram>,
    /// `spotguard_checkpoint_total{outcome}`: per target group (pod / host selector).
    pub checkpoint: Family<OutcomeLabels, Counter>,
    /// `spotguard_checkpoint_ack_latency_seconds`: signal → terminal ack.
    pub ack_latency: Histogram,
    /// `spotguard_checkpoint_signals_total`: processes signalled.
    pub signals_sent: Counter,
    /// `spotguard_node_actions_total{action,outcome}`: taint, cordon, uncordon, event, annotate…
    pub node_actions: Family<ActionLabels, Counter>,
    /// `spotguard_drain_duration_seconds`.
    pub drain_duration: Histogram,
    /// `spotguard_drain_pods_total{outcome}`: evicted, blocked, force_deleted, skipped, gone.
    pub drain_pods: Family<OutcomeLabels, Counter>,
    /// `spotguard_drain_blocked_pods`: pods still blocked at the end of the last drain.
    pub drain_blocked: Gauge,
    /// `spotguard_errors_total{module,error}`: every error the agent logged and carried on from.
    pub errors: Family<ModuleErrorLabels, Counter>,
    /// `spotguard_notice_active{kind}`: 1 while a plan for this kind is in progress.
    pub notice_active: NoticeActive,
    /// `spotguard_notice_deadline_timestamp_seconds`: deadline of the active interruption (0 = none).
    pub deadline: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// `spotguard_webhook_total{outcome}`.
    pub webhook: Family<OutcomeLabels, Counter>,
    /// `spotguard_checkpoint_headroom_seconds`: the plan's checkpoint budget (signal → checkpoint
    /// deadline) minus how long the group took to acknowledge; 0 for a group that never acked.
    pub checkpoint_headroom: Histogram,
    /// `spotguard_checkpoint_last_acked_step`: training step of the last acknowledged checkpoint
    /// (the highest `step` of the plan's acks; unchanged when an ack gives none).
    pub last_acked_step: Gauge,
    /// `spotguard_checkpoint_last_duration_seconds` / `..._budget_seconds`: the last plan's
    /// slowest acknowledgement and its budget.
    pub last_duration: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub last_budget: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// `spotguard_plans_total{outcome}`: plans ended (`completed`, `drain_failed`, `undone`).
    pub plans: Family<OutcomeLabels, Counter>,
    /// `spotguard_badput_seconds_total{category}`: target-seconds each interruption cost, by
    /// badput category (`checkpoint_save`, `wasted_progress`; docs/goodput.md).
    pub badput_seconds: Family<CategoryLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    /// `spotguard_badput_steps_lost_total`: training steps thrown away (trained after the last
    /// durable checkpoint by a target that exited without acking).
    pub steps_lost: Counter,
    /// `spotguard_recoveries_total`: interruptions recovered from on this node (a resumed
    /// trainer's first step after loading the checkpoint saved at an interruption; once per
    /// target and notice).
    pub recoveries: Counter,
}

/// `spotguard_notice_active{kind}`. The responder names the kind in an [`OutcomeLabels`]; it is
/// exported as `kind`.
#[derive(Clone, Debug, Default)]
pub struct NoticeActive(Family<KindLabels, Gauge>);

impl NoticeActive {
    /// The gauge of the notice kind in `labels.outcome`.
    pub fn get_or_create(
        &self,
        labels: &OutcomeLabels,
    ) -> impl std::ops::Deref<Target = Gauge> + '_ {
        self.0.get_or_create(&KindLabels {
            kind: labels.outcome.clone(),
        })
    }

    /// Set the gauge of `kind` to 1 (`active`) or 0.
    pub fn set(&self, kind: &str, active: bool) {
        self.0
            .get_or_create(&KindLabels {
                kind: kind.to_string(),
            })
            .set(i64::from(active));
    }
}

impl Metrics {
    /// Create the core families and register them (prefix `spotguard_`).
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            metadata_errors: Family::default(),
            metadata_polls: Family::default(),
            notices: Family::default(),
            notice_decisions: Family::default(),
            detection_latency: Family::new_with_constructor(histogram),
            notice_to_signal: Family::new_with_constructor(histogram),
            checkpoint: Family::default(),
            ack_latency: histogram(),
            signals_sent: Counter::default(),
            node_actions: Family::default(),
            drain_duration: histogram(),
            drain_pods: Family::default(),
            drain_blocked: Gauge::default(),
            errors: Family::default(),
            notice_active: NoticeActive::default(),
            deadline: Gauge::default(),
            webhook: Family::default(),
            checkpoint_headroom: Histogram::new(headroom_buckets()),
            last_acked_step: Gauge::default(),
            last_duration: Gauge::default(),
            last_budget: Gauge::default(),
            plans: Family::default(),
            badput_seconds: Family::default(),
            steps_lost: Counter::default(),
            recoveries: Counter::default(),
        };
        let r = registry;
        r.register(
            "spotguard_metadata_errors",
            "Failed polls of the instance metadata service",
            m.metadata_errors.clone(),
        );
        r.register(
            "spotguard_metadata_polls",
            "Successful polls of the instance metadata service",
            m.metadata_polls.clone(),
        );
        r.register(
            "spotguard_notices",
            "Notices accepted (after dedupe)",
            m.notices.clone(),
        );
        r.register(
            "spotguard_notice_decisions",
            "Notices delivered by the sources, by what the notice store decided they mean",
            m.notice_decisions.clone(),
        );
        r.register(
            "spotguard_notice_detection_seconds",
            "Cloud publication of a notice to the agent seeing it, where the cloud gives a publication time",
            m.detection_latency.clone(),
        );
        r.register(
            "spotguard_notice_to_signal_seconds",
            "Agent seeing an interruption notice to the checkpoint signal being delivered",
            m.notice_to_signal.clone(),
        );
        r.register(
            "spotguard_checkpoint",
            "Checkpoint outcomes per target (pod or host selector)",
            m.checkpoint.clone(),
        );
        r.register(
            "spotguard_checkpoint_ack_latency_seconds",
            "Checkpoint signal to terminal acknowledgement",
            m.ack_latency.clone(),
        );
        r.register(
            "spotguard_checkpoint_signals",
            "Processes sent a checkpoint signal",
            m.signals_sent.clone(),
        );
        r.register(
            "spotguard_node_actions",
            "Node actions (taint, cordon, uncordon, annotate, event) by outcome",
            m.node_actions.clone(),
        );
        r.register(
            "spotguard_drain_duration_seconds",
            "Duration of node drains",
            m.drain_duration.clone(),
        );
        r.register(
            "spotguard_drain_pods",
            "Pods handled by drains, by outcome",
            m.drain_pods.clone(),
        );
        r.register(
            "spotguard_drain_blocked_pods",
            "Pods still blocked (PDB or not yet gone) at the end of the last drain",
            m.drain_blocked.clone(),
        );
        r.register(
            "spotguard_errors",
            "Errors logged and recovered from, by module",
            m.errors.clone(),
        );
        r.register(
            "spotguard_notice_active",
            "1 while a plan for a notice of this kind is in progress",
            m.notice_active.0.clone(),
        );
        r.register(
            "spotguard_notice_deadline_timestamp_seconds",
            "Deadline of the active interruption as a Unix time (0 when none)",
            m.deadline.clone(),
        );
        r.register(
            "spotguard_webhook",
            "Webhook notifications by outcome",
            m.webhook.clone(),
        );
        r.register(
            "spotguard_checkpoint_headroom_seconds",
            "Checkpoint budget minus the time a target group took to acknowledge (0 when it never did)",
            m.checkpoint_headroom.clone(),
        );
        r.register(
            "spotguard_badput_seconds",
            "Target-seconds interruptions cost, by badput category",
            m.badput_seconds.clone(),
        );
        r.register(
            "spotguard_badput_steps_lost",
            "Training steps thrown away: trained after the last durable checkpoint by a target that exited without acking",
            m.steps_lost.clone(),
        );
        r.register(
            "spotguard_recoveries",
            "Interruptions recovered from on this node: a resumed trainer's first step after loading the checkpoint saved at an interruption",
            m.recoveries.clone(),
        );
        r.register(
            "spotguard_checkpoint_last_acked_step",
            "Training step of the last acknowledged checkpoint",
            m.last_acked_step.clone(),
        );
        r.register(
            "spotguard_checkpoint_last_duration_seconds",
            "Slowest acknowledgement of the last plan's checkpoint",
            m.last_duration.clone(),
        );
        r.register(
            "spotguard_checkpoint_last_budget_seconds",
            "Checkpoint budget (signal to checkpoint deadline) of the last plan",
            m.last_budget.clone(),
        );
        r.register(
            "spotguard_plans",
            "Plans ended, by outcome",
            m.plans.clone(),
        );
        r.register(
            "spotguard_build",
            "Build information",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("commit", env!("SPOTGUARD_GIT_COMMIT").to_string()),
            ]),
        );
        m.zero_known_series();
        m
    }

    /// Create every series whose label values are known in advance, at 0.
    fn zero_known_series(&self) {
        use known::*;
        let s = |v: &str| v.to_string();
        for source in SOURCES {
            let _ = self
                .metadata_polls
                .get_or_create(&SourceLabels { source: s(source) });
            let _ = self
                .detection_latency
                .get_or_create(&SourceLabels { source: s(source) });
            let _ = self
                .notice_to_signal
                .get_or_create(&SourceLabels { source: s(source) });
            for error in METADATA_ERRORS {
                let _ = self.metadata_errors.get_or_create(&ErrorLabels {
                    source: s(source),
                    error: s(error),
                });
            }
            for kind in NOTICE_KINDS {
                let _ = self.notices.get_or_create(&NoticeLabels {
                    source: s(source),
                    kind: s(kind),
                });
            }
        }
        for kind in NOTICE_KINDS {
            for decision in NOTICE_DECISIONS {
                let _ = self.notice_decisions.get_or_create(&DecisionLabels {
                    kind: s(kind),
                    decision: s(decision),
                });
            }
        }
        for kind in ACTIVE_KINDS {
            self.notice_active.set(kind, false);
        }
        for outcome in CHECKPOINT_OUTCOMES {
            let _ = self.checkpoint.get_or_create(&OutcomeLabels {
                outcome: s(outcome),
            });
        }
        for action in NODE_ACTIONS {
            for outcome in ACTION_OUTCOMES {
                let _ = self.node_actions.get_or_create(&ActionLabels {
                    action: s(action),
                    outcome: s(outcome),
                });
            }
        }
        for outcome in DRAIN_OUTCOMES {
            let _ = self.drain_pods.get_or_create(&OutcomeLabels {
                outcome: s(outcome),
            });
        }
        for outcome in WEBHOOK_OUTCOMES {
            let _ = self.webhook.get_or_create(&OutcomeLabels {
                outcome: s(outcome),
            });
        }
        for outcome in PLAN_OUTCOMES {
            let _ = self.plans.get_or_create(&OutcomeLabels {
                outcome: s(outcome),
            });
        }
        for category in BADPUT_CATEGORIES {
            let _ = self.badput_seconds.get_or_create(&CategoryLabels {
                category: s(category),
            });
        }
        for module in ERROR_MODULES {
            let _ = self.errors.get_or_create(&ModuleErrorLabels {
                module: s(module),
                error: s("none"),
            });
        }
    }

    /// Count an error that was logged and recovered from.
    pub fn error(&self, module: &str, label: &str) {
        self.errors
            .get_or_create(&ModuleErrorLabels {
                module: module.to_string(),
                error: label.to_string(),
            })
            .inc();
    }

    /// Count a node action.
    pub fn action(&self, action: &str, ok: bool) {
        self.node_actions
            .get_or_create(&ActionLabels {
                action: action.to_string(),
                outcome: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }
}

/// Encode a registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_families_encode_with_prefix() {
        let mut r = Registry::default();
        let m = Metrics::register(&mut r);
        m.notices
            .get_or_create(&NoticeLabels {
                source: "aws".into(),
                kind: "interruption".into(),
            })
            .inc();
        m.error("notice", "parse");
        let text = encode(&r);
        assert!(text.contains("spotguard_notices_total{source=\"aws\",kind=\"interruption\"} 1"));
        assert!(text.contains("spotguard_errors_total{module=\"notice\",error=\"parse\"} 1"));
        assert!(text.contains("# EOF"));
    }
}
