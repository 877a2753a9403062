//! The machine-readable goodput records that travel beyond this agent: the annotation on the
//! `InterruptionBadput` / `InterruptionRecovered` pod Events (read back by `spotguard goodput`
//! for a Job, JobSet or pod owner), and the lines of `<state-dir>/goodput.jsonl` on a host.
//!
//! * [`EventRecord::Badput`]: what one interruption cost one pod, written by the agent of the
//!   node the interruption hit ([`super::record::Interruption`] with that pod's target only).
//! * [`EventRecord::Recovery`]: the same job training again, written by the agent of the node it
//!   resumed on, linked to the interruption by its notice id and node (the helper's checkpoint
//!   sidecar or the staged manifest carries them across; no central store).

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::record::Interruption;

/// The annotation on a goodput Event holding its [`EventRecord`] as compact JSON.
pub const ANNOTATION: &str = crate::node::RECORD_ANNOTATION;

impl EventRecord {
    /// The annotation's text: compact JSON.
    pub fn to_annotation(&self) -> String {
        // A record of strings, numbers and timestamps always serialises.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// The record on a goodput Event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum EventRecord {
    /// One interruption, one target (`targets` holds exactly the Event's pod).
    Badput(Interruption),
    /// A resume after an interruption.
    Recovery(Recovery),
}

/// A trainer resumed from the checkpoint saved at an interruption: how long the job was away.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Recovery {
    /// The interruption this resume recovers from (its `notice_id`, as in its badput record).
    pub notice_id: String,
    /// The node (host) that interruption hit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_node: Option<String>,
    /// This node (host).
    pub node: String,
    /// The resumed group: `namespace/pod` in Kubernetes, the selector's name on a host.
    pub target: String,
    /// The step training resumed from.
    pub step: u64,
    /// When the interrupted trainer made that checkpoint durable (its `done` ack, or the staged
    /// upload's completion): its last act before it exited.
    pub saved_at: Timestamp,
    /// The first training step on this node after the resume.
    pub first_step_at: Timestamp,
    /// `saved_at` → `first_step_at`: the whole gap, restore included (Google's
    /// `INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION` plus `UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME`).
    pub recovery_seconds: f64,
    /// Loading the checkpoint, as the trainer timed it (`UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_seconds: Option<f64>,
}

impl Recovery {
    /// The recovery gap without the restore (`infrastructure_recovery`), never negative.
    pub fn infrastructure_seconds(&self) -> f64 {
        (self.recovery_seconds - self.restore_seconds.unwrap_or(0.0)).max(0.0)
    }
}

/// One line of `<state-dir>/goodput.jsonl`: an interruption (the format since the log began) or
/// `{"recovery": {…}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LogLine {
    Recovery { recovery: Recovery },
    Interruption(Interruption),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_log_lines_read_back_as_written() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let r = Recovery {
            notice_id: "aws-1".into(),
            from_node: Some("spot-0".into()),
            node: "spot-1".into(),
            target: "ml/job-abc".into(),
            step: 120,
            saved_at: t0,
            first_step_at: t0 + std::time::Duration::from_secs(9),
            recovery_seconds: 9.0,
            restore_seconds: Some(2.5),
        };
        assert_eq!(r.infrastructure_seconds(), 6.5);
        for rec in [
            EventRecord::Recovery(r.clone()),
            EventRecord::Badput(Interruption {
                notice_id: "aws-1".into(),
                done_at: t0,
                ..Interruption::default()
            }),
        ] {
            let text = serde_json::to_string(&rec).unwrap();
            assert_eq!(serde_json::from_str::<EventRecord>(&text).unwrap(), rec);
        }
        let line = LogLine::Recovery { recovery: r };
        let text = serde_json::to_string(&line).unwrap();
        assert!(text.starts_with("{\"recovery\":"), "{text}");
        assert_eq!(serde_json::from_str::<LogLine>(&text).unwrap(), line);
        let old = r#"{"notice_id":"aws-2","node":"h","done_at":"2023-11-14T22:13:20Z"}"#;
        assert!(matches!(
            serde_json::from_str::<LogLine>(old).unwrap(),
            LogLine::Interruption(i) if i.notice_id == "aws-2"
        ));
    }
}
