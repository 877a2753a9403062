//! Goodput, measured: what each interruption cost a training job, from the agent's own timeline
//! rather than parsed from logs after the fact.
//!
//! * [`progress`]: the helper's progress record (`progress-<pid>.json`), read for a process that
//!   exited without acking, to count the work it threw away.
//! * [`record`]: the per-target badput record of one plan ([`record::Interruption`]), its
//!   metrics, its Event text and its line in the goodput log.
//! * [`event`]: the records beyond this agent: the goodput Events' annotation and the log's
//!   lines, recoveries included.
//! * [`recovery`]: the node a job resumed on reports how long it was away after an
//!   interruption (the helper's resume record names the interruption; no central store).
//! * [`report`]: `spotguard goodput`, the table (or JSON) a person reads: per interruption and in
//!   total, from a host's goodput log(s) or ([`kube_report`]) a Kubernetes owner's records.
//! * [`ledger`]: those records, the `Interruption` objects (`spotguard.io/v1alpha1`) the agents
//!   write beside their goodput Events: read page by page, checked, joined in linear time.
//!
//! Categories and Google's ml-goodput-measurement names where they mean the same:
//! `checkpoint_save` = `UNPRODUCTIVE_CHECKPOINT_SAVE_TIME` (signal → ack: the trainer saves
//! instead of training), `wasted_progress` = `WASTED_PROGRESS_FROM_DISRUPTION` (training after the
//! last durable checkpoint, redone by the next run), `detection` (cloud publication → the agent
//! saw it; no Google counterpart: the library cannot see the notice). See docs/goodput.md.

pub mod event;
pub mod kube_report;
pub mod ledger;
pub mod progress;
pub mod record;
pub mod recovery;
pub mod report;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A progress record that is not the helper's format.
    #[error("progress record: {0}")]
    Progress(String),
    /// A resume record that is not the helper's format.
    #[error("resume record: {0}")]
    Resume(String),
    /// The goodput log cannot be read or written.
    #[error("goodput log {path}: {source}")]
    Log {
        path: String,
        #[source]
        source: std::io::Error,
    },
}
