//! The plan record: what one plan has done, persisted before each step so that a restarted agent
//! resumes and never repeats a step that already happened (above all: never signals twice).
//!
//! - `local`: `<state-dir>/notice.json` ([`StateFile`], [`LocalRecord`]): every mode, written
//!   first and fsync'd, with the processes a plan is about to signal ([`RecordedTarget`]) and the
//!   last plan of each other notice kind in this life;
//! - `copies`: the local file and the node's copy (the Node annotation `spotguard.io/notice` in
//!   Kubernetes mode, which the node ops store as given), and which is further along;
//! - here: what a record found at start-up means ([`resume`]), what it restores into the notice
//!   store ([`remember`]) and the notice a resumed plan carries on ([`notice_of`]).
//!
//! Every record says which life of the machine it belongs to (`crate::life`): one of a previous
//! life is undone and cleared, never resumed.

mod copies;
mod local;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

pub(crate) use copies::{Records, LOAD_BUDGET};
pub use local::{LocalRecord, RecordedTarget, StateFile, STATE_FILE};

use super::store::NoticeStore;
use crate::node::Applied;
use crate::notice::{Cloud, Notice, NoticeKind};

/// Where the handling of one notice stands. Persisted before each step so that a restarted agent
/// resumes and never repeats a step that already happened (above all: never signals twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Seen; nothing done yet.
    Detected,
    /// Tainted and cordoned (interruption, maintenance) or soft-tainted (rebalance).
    Protected,
    /// Checkpoint signals sent (`signalled_at` set): never signal again for this notice.
    Signalled,
    /// Checkpoint wait finished (acks, exits or budget).
    Checkpointed,
    /// Drain finished (or gave up at the deadline; the report says which).
    Drained,
    /// Cloud acknowledged (Azure) / plan complete.
    Done,
    /// The notice was cancelled or expired and what spotguard did was undone.
    Undone,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Detected => "detected",
            Phase::Protected => "protected",
            Phase::Signalled => "signalled",
            Phase::Checkpointed => "checkpointed",
            Phase::Drained => "drained",
            Phase::Done => "done",
            Phase::Undone => "undone",
        }
    }
}

/// The persisted record of the plan for one notice: the latest plan of `<state-dir>/notice.json`
/// (every mode), and the node's copy in Kubernetes mode (the Node annotation
/// `spotguard.io/notice`, compact JSON, which the node ops store as given).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanState {
    pub id: String,
    pub kind: NoticeKind,
    pub source: Cloud,
    pub deadline: Option<Timestamp>,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signalled_at: Option<Timestamp>,
    /// What spotguard itself changed, so that undo never touches an operator's cordon or taint.
    #[serde(default)]
    pub applied: Applied,
    /// Boot id of the machine when the record was written. A different one at start-up means the
    /// record belongs to a previous life of the machine (stop/start, hibernation, reboot): what
    /// spotguard applied is undone, the record cleared, and the agent armed again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    #[serde(default)]
    pub restart: bool,
    /// The cloud's description of the notice (kept so that a resumed plan follows the same policy,
    /// e.g. an Azure `Freeze`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// Why the plan did not complete (a failed or blocked drain), when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    pub updated_at: Timestamp,
}

impl PlanState {
    /// Whether this record was written during the machine's current life. A record or an agent
    /// without a boot id cannot tell and counts as the same life.
    pub fn same_life(&self, boot_id: Option<&str>) -> bool {
        match (self.boot_id.as_deref(), boot_id) {
            (Some(recorded), Some(now)) => recorded == now,
            _ => true,
        }
    }
}

/// What a persisted record means at start-up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resume {
    /// Written in a previous life of the machine: undo what spotguard applied, clear it, arm again.
    PreviousLife,
    /// Nothing left to do; remember the notice so that re-polls of it dedupe.
    Remember,
    /// A rebalance whose early checkpoint is done: remember it and undo at its expiry.
    AwaitExpiry,
    /// A plan of this life that had not finished: carry on from its phase.
    Continue,
}

/// Decide what the persisted `state` means for an agent starting in the life `life`.
pub fn resume(state: &PlanState, life: Option<&str>) -> Resume {
    if !state.same_life(life) {
        return Resume::PreviousLife;
    }
    match (&state.kind, state.phase) {
        (_, Phase::Done | Phase::Undone) => Resume::Remember,
        (NoticeKind::Rebalance, phase) if phase >= Phase::Checkpointed => Resume::AwaitExpiry,
        _ => Resume::Continue,
    }
}

/// Restore into `store` what a persisted record of this life says: the interruption (never
/// started again), or a rebalance/maintenance notice (so that re-polls of it dedupe, also after
/// its plan was undone at expiry).
pub fn remember(store: &mut NoticeStore, state: &PlanState, now: Timestamp) {
    match &state.kind {
        NoticeKind::Interruption => {
            store.restore_interruption(&state.id, state.deadline.unwrap_or(now))
        }
        NoticeKind::Cancelled(_) => {}
        kind => store.restore(&state.id, kind.clone(), state.deadline),
    }
}

/// The notice a resumed plan carries on: what the record kept of it.
pub fn notice_of(state: &PlanState) -> Notice {
    Notice {
        id: state.id.clone(),
        kind: state.kind.clone(),
        source: state.source,
        deadline: state.deadline,
        not_before: state.deadline,
        detail: if state.detail.is_empty() {
            "resumed from persisted state".into()
        } else {
            state.detail.clone()
        },
        restart: state.restart,
        published_at: None,
        maintenance: state.source.maintenance_of_detail(&state.detail),
        observed_at: state.updated_at,
        cloud_event_id: None,
    }
}

/// Errors of the plan record's local file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading state file {path}: {source}")]
    StateRead {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("writing state file {path}: {source}")]
    StateWrite {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("persisted state {location} is not valid: {reason}")]
    StateCorrupt { location: String, reason: String },
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        false
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::StateRead { .. } => "state_read",
            Error::StateWrite { .. } => "state_write",
            Error::StateCorrupt { .. } => "state_corrupt",
        }
    }
}
