//! Staged checkpoint upload (docs/checkpoint-upload.md): a trainer saves its checkpoint to
//! local disk in seconds, acks `done` with the staged directory, and exits; spotguard ships the
//! directory to an object store or a shared filesystem with the rest of the notice's time, and
//! publishes it with a `manifest.json` written last.
//!
//! - [`staged`]: capturing the staged tree through the trainer's root (every file opened while
//!   the trainer lives; symlinks, special files, other mounts, foreign owners refused);
//! - [`dest`]: destinations and the operator's `--upload-allow` list;
//! - [`target`]: the object store (single `PUT`s and multipart uploads through object_store,
//!   the store's checksum compared after each file) and the filesystem (temp, fsync, rename);
//! - [`engine`]: one upload from start to publication — the location claimed, the deadline,
//!   progress, then the [`manifest`] written last; `resume`: its [`journal`] opened (resuming an
//!   earlier run after a restart) and kept or dropped when a run ends unpublished; `send`: the
//!   files sent, parallel parts from a bounded buffer [`pool`], CRCs while reading ([`crc`]);
//! - [`latest`]: the latest complete checkpoint under a location (resume side);
//! - [`ack`]: the protocol side (what a `done` ack asks for, the agent's answer);
//! - [`uploader`]: where uploads run (own runtime, own low-priority threads);
//! - [`service`]: the agent's side (`spotguard run`): settings, a staged ack taken and its
//!   upload submitted on the ack watcher's thread, restart recovery;
//! - [`handoff`]: the sender's side of the relay: when to relay, and the race with the upload;
//! - [`relayed`]: what a peer relayed to this agent, published (`crate::relay::Publisher`);
//! - [`cli`]: `spotguard upload STAGED DEST`; [`metrics`]: `spotguard_checkpoint_upload_*`.

pub mod ack;
pub mod budget;
pub mod cli;
pub mod dest;
pub mod engine;
mod error;
pub mod handoff;
pub mod journal;
pub mod latest;
pub mod metrics;
pub mod pool;
pub mod relayed;
mod resume;
mod send;
pub mod service;
pub mod staged;
pub mod target;
pub mod uploader;

// The checkpoint's shared formats live on the store floor (the relay uses them too).
pub use crate::store::{crc, manifest, owner};
pub use dest::{AllowUpload, Location, UploadPolicy};
pub use engine::{Job, Meta, Options, Report};
pub use error::Error;
pub use metrics::UploadMetrics;
pub use staged::{Limits, Root, StagedTree};
pub use uploader::Uploader;

/// How an upload ended (`spotguard_checkpoint_upload_total{outcome}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every file is at the destination and the manifest was written.
    Published,
    /// The destination already held this very checkpoint (same files and checksums).
    AlreadyPublished,
    /// The deadline arrived first: no manifest; the previous checkpoint stays the latest.
    Deadline,
    /// The uploader was stopped; a later run with the same journal resumes.
    Cancelled,
    /// An error (store, I/O, a file changed under the upload, checksum mismatch): no manifest.
    Failed,
    /// The destination or the staged tree was refused (allow-list, symlinks, special files,
    /// owner, limits): nothing was sent.
    Refused,
    /// An uploader restarted mid-upload and could not resume it (the trainer's files are no
    /// longer reachable, or an earlier boot): reported, nothing published.
    Interrupted,
    /// A relay's peer published the checkpoint first (`handoff`): this upload stopped; the
    /// report says `published` with `relayed_to`.
    Relayed,
}

impl Outcome {
    /// Every outcome, in the order the docs list them.
    pub const ALL: [Outcome; 8] = [
        Outcome::Published,
        Outcome::AlreadyPublished,
        Outcome::Deadline,
        Outcome::Cancelled,
        Outcome::Failed,
        Outcome::Refused,
        Outcome::Interrupted,
        Outcome::Relayed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::AlreadyPublished => "already_published",
            Outcome::Deadline => "deadline",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "failed",
            Outcome::Refused => "refused",
            Outcome::Interrupted => "interrupted",
            Outcome::Relayed => "relayed",
        }
    }

    /// The checkpoint is at the destination and complete.
    pub fn is_published(self) -> bool {
        matches!(self, Outcome::Published | Outcome::AlreadyPublished)
    }
}
