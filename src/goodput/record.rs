//! The badput record of one interruption: per target (pod or host group), from the agent's own
//! timeline, what the interruption cost in the units platform teams report.
//!
//! * `save_seconds` (`checkpoint_save`, Google's `UNPRODUCTIVE_CHECKPOINT_SAVE_TIME`): signal →
//!   the group's last terminal ack, for a group that acked; the trainer saves instead of training.
//! * `wasted_steps` / `wasted_seconds` (`wasted_progress`, `WASTED_PROGRESS_FROM_DISRUPTION`):
//!   training after the last durable checkpoint that the next run will not resume from. 0 for a
//!   group whose every process acked `done`; for a process that exited without acking, from its
//!   progress record (steps and seconds since its last durable step, the most of its
//!   processes: ranks of one job train the same steps); unknown (`None`) without one.
//! * `downtime_seconds`: signal → the last process seen gone, where the watcher saw it; signal →
//!   ack otherwise (the helper exits right after its ack).
//! * `upload_seconds`: the staged checkpoint's upload, after the trainer exited (off its clock:
//!   reported, not badput).
//! * Per interruption: `detection_seconds` (cloud publication → seen, where the notice carries a
//!   publication time; training goes on meanwhile, so it is reported, not badput) and
//!   `drain_margin_seconds` (drain end → deadline; negative when the drain ended after it).

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::progress;
use crate::checkpoint::run::GroupResult;
use crate::checkpoint::Outcome;

/// Badput categories: the `category` label of `spotguard_badput_seconds_total`.
pub mod category {
    /// Google's `UNPRODUCTIVE_CHECKPOINT_SAVE_TIME`.
    pub const CHECKPOINT_SAVE: &str = "checkpoint_save";
    /// Google's `WASTED_PROGRESS_FROM_DISRUPTION`.
    pub const WASTED_PROGRESS: &str = "wasted_progress";
    /// Google's `INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION`: the interrupted trainer's last act →
    /// the first step on the new node, less the restore.
    pub const INFRASTRUCTURE_RECOVERY: &str = "infrastructure_recovery";
    /// Google's `UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME`: loading the checkpoint on the new node.
    pub const CHECKPOINT_RESTORE: &str = "checkpoint_restore";
}

/// The most steps one interruption may throw away for one target: more is not a training run's
/// count (a record past it is refused, never summed).
pub const MAX_STEPS: u64 = 1 << 40;
/// The longest duration a record may hold (seconds, ~115 days): more is not a measured time.
pub const MAX_SECONDS: f64 = 1.0e7;

/// Whether `s` is a duration a record may hold: finite, 0 to [`MAX_SECONDS`].
pub fn sane_seconds(s: f64) -> bool {
    s.is_finite() && (0.0..=MAX_SECONDS).contains(&s)
}

/// What one interruption cost one target.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TargetBadput {
    /// The group: `namespace/pod` in Kubernetes, the selector's name on a host.
    pub target: String,
    /// The checkpoint outcome (`acked`, `exited`, `timeout`, …).
    pub outcome: String,
    /// The step the group acked (the highest of its acks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wasted_steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wasted_seconds: Option<f64>,
    /// The last durable step of a process that exited without acking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable_step: Option<u64>,
}

/// One interruption: its timeline and what it cost each target. One line of the goodput log.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Interruption {
    pub notice_id: String,
    /// The node (Kubernetes) or host.
    pub node: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signalled_at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_at: Option<Timestamp>,
    pub done_at: Timestamp,
    #[serde(default)]
    pub targets: Vec<TargetBadput>,
}

/// The agent's timeline of one plan, as the outcome follower collected it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timeline {
    pub published_at: Option<Timestamp>,
    pub seen_at: Option<Timestamp>,
    pub signalled_at: Option<Timestamp>,
    pub deadline: Option<Timestamp>,
    pub drained_at: Option<Timestamp>,
}

fn seconds(from: Timestamp, to: Timestamp) -> f64 {
    to.duration_since(from).as_secs_f64()
}

/// The badput of one group's checkpoint result. `upload_seconds`: its staged upload, if any.
pub fn target(r: &GroupResult, step: Option<u64>, upload_seconds: Option<f64>) -> TargetBadput {
    let save = match r.outcome {
        Outcome::Acked => r.ack_latency.map(|d| d.as_secs_f64()),
        _ => None,
    };
    let last_exit = r.exits.iter().map(|e| e.at).max();
    let downtime = match (r.signalled_at, last_exit) {
        (Some(s), Some(x)) => Some(seconds(s, x).max(0.0)),
        _ => r.ack_latency.map(|d| d.as_secs_f64()),
    };
    let mut t = TargetBadput {
        target: r.group.clone(),
        outcome: r.outcome.as_str().to_string(),
        step,
        save_seconds: save,
        downtime_seconds: downtime,
        upload_seconds,
        ..TargetBadput::default()
    };
    if r.outcome == Outcome::Acked && r.exits.is_empty() {
        // Every process acked `done` at the step it stopped: nothing to redo.
        t.wasted_steps = Some(0);
        t.wasted_seconds = Some(0.0);
        return t;
    }
    // The processes that left without a terminal ack: what their progress records say.
    let lost: Vec<(u64, f64, Option<u64>)> = r
        .exits
        .iter()
        .filter_map(|e| {
            let p = match progress::parse(e.progress.as_deref()?) {
                Ok(p) => p,
                Err(err) => {
                    tracing::debug!(target_group = %r.group, pid = e.ns_pid, error = %err, "progress record refused");
                    return None;
                }
            };
            let (steps, secs) = p.thrown_away()?;
            if steps > MAX_STEPS || !sane_seconds(secs) {
                tracing::debug!(target_group = %r.group, pid = e.ns_pid, "progress record refused: figures out of bounds");
                return None;
            }
            Some((steps, secs, p.durable_step))
        })
        .collect();
    if !lost.is_empty() {
        t.wasted_steps = lost.iter().map(|l| l.0).max();
        t.wasted_seconds = lost.iter().map(|l| l.1).reduce(f64::max);
        t.durable_step = lost.iter().filter_map(|l| l.2).min();
    }
    t
}

impl Interruption {
    /// Cloud publication → seen, where the cloud gave a publication time.
    pub fn detection_seconds(&self) -> Option<f64> {
        Some(seconds(self.published_at?, self.seen_at?).max(0.0))
    }

    /// Drain end → deadline (negative: the drain ended after the deadline).
    pub fn drain_margin_seconds(&self) -> Option<f64> {
        Some(seconds(self.drained_at?, self.deadline?))
    }

    /// Seconds of each badput category over every target: (category, seconds).
    pub fn badput(&self) -> [(&'static str, f64); 2] {
        let sum = |f: fn(&TargetBadput) -> Option<f64>| self.targets.iter().filter_map(f).sum();
        [
            (category::CHECKPOINT_SAVE, sum(|t| t.save_seconds)),
            (category::WASTED_PROGRESS, sum(|t| t.wasted_seconds)),
        ]
    }

    /// Steps thrown away over every target (saturating: never wraps).
    pub fn steps_lost(&self) -> u64 {
        self.targets
            .iter()
            .filter_map(|t| t.wasted_steps)
            .fold(0, u64::saturating_add)
    }

    /// Why this record cannot be summed (a figure out of bounds: negative, not finite, past
    /// [`MAX_SECONDS`] or [`MAX_STEPS`]), if so. A record read from an Event or a log line is
    /// anyone's text until checked.
    pub fn insane(&self) -> Option<&'static str> {
        self.targets.iter().find_map(TargetBadput::insane)
    }
}

impl TargetBadput {
    /// [`Interruption::insane`] for one target.
    pub fn insane(&self) -> Option<&'static str> {
        let seconds = [
            self.save_seconds,
            self.downtime_seconds,
            self.upload_seconds,
            self.wasted_seconds,
        ];
        if seconds.iter().flatten().any(|s| !sane_seconds(*s)) {
            return Some("a duration that is negative, not finite or too long");
        }
        if self.wasted_steps.is_some_and(|n| n > MAX_STEPS) {
            return Some("more steps thrown away than a run trains");
        }
        None
    }
}

fn secs(s: f64) -> String {
    format!("{s:.1}s")
}

impl TargetBadput {
    /// One line for the pod Event and the plan's log: `badput: checkpoint save 12.3s, thrown away
    /// 40 steps (31.2s) since step 100, down 13.0s, upload 4.1s`.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if let Some(s) = self.save_seconds {
            parts.push(format!("checkpoint save {}", secs(s)));
        }
        match (self.wasted_steps, self.wasted_seconds) {
            (Some(0), _) => parts.push("nothing thrown away".to_string()),
            (Some(n), Some(s)) => {
                let since = self
                    .durable_step
                    .map(|k| format!(" since the checkpoint at step {k}"))
                    .unwrap_or_default();
                parts.push(format!("thrown away {n} steps ({}){since}", secs(s)));
            }
            _ => parts.push("thrown away: unknown (no progress record)".to_string()),
        }
        if let Some(d) = self.downtime_seconds {
            parts.push(format!("down {}", secs(d)));
        }
        if let Some(u) = self.upload_seconds {
            parts.push(format!("upload {}", secs(u)));
        }
        format!("badput: {}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::run::ExitSeen;
    use std::time::Duration;

    fn result(outcome: Outcome, latency: Option<u64>, exits: Vec<ExitSeen>) -> GroupResult {
        GroupResult {
            group: "ml/t".into(),
            pod: None,
            outcome,
            signalled: 1,
            signalled_at: Some(Timestamp::from_second(1_700_000_000).unwrap()),
            ack_latency: latency.map(Duration::from_secs),
            detail: String::new(),
            exits,
        }
    }

    #[test]
    fn an_acked_target_threw_nothing_away_and_its_save_is_badput() {
        let t = target(
            &result(Outcome::Acked, Some(12), vec![]),
            Some(40),
            Some(3.0),
        );
        assert_eq!(
            (
                t.save_seconds,
                t.wasted_steps,
                t.wasted_seconds,
                t.downtime_seconds
            ),
            (Some(12.0), Some(0), Some(0.0), Some(12.0))
        );
        assert!(
            t.summary().contains("nothing thrown away"),
            "{}",
            t.summary()
        );
    }

    #[test]
    fn a_target_gone_without_acking_reports_its_progress_since_the_last_durable_step() {
        let at = Timestamp::from_second(1_700_000_030).unwrap();
        let progress =
            br#"{"v":1,"step":130,"ts":1700000001.0,"durable_step":100,"durable_ts":1699999971.0}"#;
        let exits = vec![
            ExitSeen {
                ns_pid: 7,
                at,
                progress: Some(progress.to_vec()),
            },
            ExitSeen {
                ns_pid: 8,
                at,
                progress: Some(b"garbage".to_vec()),
            },
        ];
        let t = target(&result(Outcome::Exited, None, exits), None, None);
        assert_eq!(
            (t.wasted_steps, t.wasted_seconds, t.durable_step),
            (Some(30), Some(30.0), Some(100))
        );
        assert_eq!((t.save_seconds, t.downtime_seconds), (None, Some(30.0)));
        assert!(t
            .summary()
            .contains("thrown away 30 steps (30.0s) since the checkpoint at step 100"));
        let none = target(&result(Outcome::Timeout, None, vec![]), None, None);
        assert_eq!(none.wasted_steps, None);
        assert!(none.summary().contains("unknown"));
    }

    #[test]
    fn the_categories_are_the_metrics_zeroed_at_start_up() {
        assert_eq!(
            crate::metrics::known::BADPUT_CATEGORIES,
            [
                category::CHECKPOINT_SAVE,
                category::WASTED_PROGRESS,
                category::INFRASTRUCTURE_RECOVERY,
                category::CHECKPOINT_RESTORE
            ]
        );
    }

    #[test]
    fn the_interruption_sums_its_targets_and_times_its_detection_and_drain() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let i = Interruption {
            published_at: Some(t0),
            seen_at: Some(t0 + Duration::from_millis(1500)),
            deadline: Some(t0 + Duration::from_secs(120)),
            drained_at: Some(t0 + Duration::from_secs(100)),
            done_at: t0 + Duration::from_secs(101),
            targets: vec![
                TargetBadput {
                    save_seconds: Some(10.0),
                    wasted_steps: Some(0),
                    wasted_seconds: Some(0.0),
                    ..Default::default()
                },
                TargetBadput {
                    wasted_steps: Some(7),
                    wasted_seconds: Some(3.5),
                    ..Default::default()
                },
            ],
            ..Interruption::default()
        };
        assert_eq!(i.detection_seconds(), Some(1.5));
        assert_eq!(i.drain_margin_seconds(), Some(20.0));
        assert_eq!(
            i.badput(),
            [
                (category::CHECKPOINT_SAVE, 10.0),
                (category::WASTED_PROGRESS, 3.5)
            ]
        );
        assert_eq!(i.steps_lost(), 7);
        let line = serde_json::to_string(&i).unwrap();
        assert_eq!(serde_json::from_str::<Interruption>(&line).unwrap(), i);
    }

    #[test]
    fn a_progress_record_past_the_bounds_throws_nothing_away() {
        // A trainer's progress record claiming 2^64-400 steps since its durable one, or a
        // durable time far in its past: refused, never summed.
        let at = Timestamp::from_second(1_700_000_030).unwrap();
        for progress in [
            format!(
                r#"{{"v":1,"step":{},"ts":1700000001.0,"durable_step":0,"durable_ts":1699999971.0}}"#,
                u64::MAX - 400
            ),
            r#"{"v":1,"step":130,"ts":1700000001.0,"durable_step":100,"durable_ts":1000000001.0}"#
                .to_string(),
        ] {
            let exits = vec![ExitSeen {
                ns_pid: 7,
                at,
                progress: Some(progress.clone().into_bytes()),
            }];
            let t = target(&result(Outcome::Exited, None, exits), None, None);
            assert_eq!(
                (t.wasted_steps, t.wasted_seconds),
                (None, None),
                "{progress}"
            );
            assert_eq!(t.insane(), None);
        }
        let forged = TargetBadput {
            wasted_steps: Some(u64::MAX - 399),
            wasted_seconds: Some(-20.0),
            ..TargetBadput::default()
        };
        assert!(forged.insane().is_some());
    }
}
