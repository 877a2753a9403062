//! The upload module's errors: what failed, on which file, key, destination or journal, and how
//! a failure is classified (which metric label, whether a later run may resume).

use std::io;

use super::staged::Problem;

/// Errors of the checkpoint upload. Each names the file, key, destination or path and the cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid destination {dest:?}: {reason}")]
    InvalidDestination { dest: String, reason: String },

    #[error("destination {dest} refused: {reason}")]
    NotAllowed { dest: String, reason: String },

    #[error("staged checkpoint {path}: {problem}: {detail}")]
    Staged {
        path: String,
        problem: Problem,
        detail: String,
    },

    #[error("{path}: changed during the upload ({what}); nothing was published")]
    Changed { path: String, what: String },

    #[error("cannot set up the object store for {url}: {reason}")]
    Store { url: String, reason: String },

    #[error("{op} {key} failed: {}", crate::store::store_words(.source))]
    Request {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },

    #[error("{key}: the store's {algorithm} checksum is {expected}, the data's is {got}")]
    ChecksumMismatch {
        key: String,
        algorithm: &'static str,
        expected: String,
        got: String,
    },

    #[error("{key}: the store holds {got} bytes, {expected} were sent")]
    SizeMismatch {
        key: String,
        expected: u64,
        got: u64,
    },

    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },

    #[error(
        "the deadline arrived with {done} of {total} bytes uploaded; no manifest was written \
         (the previous complete checkpoint stays the latest)"
    )]
    Deadline { done: u64, total: u64 },

    #[error("cancelled with {done} of {total} bytes uploaded; no manifest was written")]
    Cancelled { done: u64, total: u64 },

    #[error(
        "{dest} already holds a different complete checkpoint (its manifest.json lists other \
         files); a checkpoint is never overwritten: stage it under a new name"
    )]
    Exists { dest: String },

    #[error("upload journal {path}: {reason}")]
    Journal { path: String, reason: String },

    #[error("cannot resume the interrupted upload to {dest}: {reason}; nothing was published")]
    Resume { dest: String, reason: String },

    #[error("manifest {key}: {reason}")]
    Manifest { key: String, reason: String },

    #[error(
        "{location} belongs to {owner} (its owner marker), not to {writer}: nothing was sent; \
         each job needs a location of its own"
    )]
    ForeignLocation {
        location: String,
        owner: String,
        writer: String,
    },

    #[error("checkpoint {name}: {reason}")]
    Step { name: String, reason: String },
}

impl Error {
    /// Label for `spotguard_checkpoint_upload_errors_total{error}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidDestination { .. } => "invalid_destination",
            Error::NotAllowed { .. } => "not_allowed",
            Error::Staged { problem, .. } => problem.metric_label(),
            Error::Changed { .. } => "changed",
            Error::Store { .. } => "store",
            Error::Request { source, .. } => request_label(source),
            Error::ChecksumMismatch { .. } => "checksum_mismatch",
            Error::SizeMismatch { .. } => "size_mismatch",
            Error::Io { source, .. } if crate::fsutil::is_disk_full(source) => "disk_full",
            Error::Io { .. } => "io",
            Error::Deadline { .. } => "deadline",
            Error::Cancelled { .. } => "cancelled",
            Error::Exists { .. } => "exists",
            Error::Journal { .. } => "journal",
            Error::Resume { .. } => "resume",
            Error::Manifest { .. } => "manifest",
            Error::ForeignLocation { .. } => "foreign_location",
            Error::Step { .. } => "step",
        }
    }

    /// The outcome an upload that failed with this error reports
    /// (`spotguard_checkpoint_upload_total{outcome}`).
    pub fn outcome(&self) -> super::Outcome {
        match self {
            Error::Deadline { .. } => super::Outcome::Deadline,
            Error::Cancelled { .. } => super::Outcome::Cancelled,
            Error::NotAllowed { .. }
            | Error::InvalidDestination { .. }
            | Error::Staged { .. }
            | Error::Step { .. } => super::Outcome::Refused,
            _ => super::Outcome::Failed,
        }
    }

    pub(crate) fn io(op: &'static str, path: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}

fn request_label(e: &object_store::Error) -> &'static str {
    match e {
        object_store::Error::NotFound { .. } => "not_found",
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => "denied",
        _ => "request",
    }
}
