//! The prefetch module's errors: what failed, on which object, URL or path, and how a failure
//! is classified (retry the object, end the run, which metric label).

use std::io;
use std::path::PathBuf;

use crate::store::{self, checksum, GetCause};

/// Errors of the prefetch module. Each names the object (or URL, or path) and the cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A URL, name or key the store floor refused, or a client it could not build.
    #[error(transparent)]
    Store(#[from] store::Error),

    #[error("listing {url} failed: {}", store::store_words(.source))]
    List {
        url: String,
        #[source]
        source: object_store::Error,
    },

    #[error("GET {key} failed: {}", store::store_words(.source))]
    Get {
        key: String,
        cause: GetCause,
        #[source]
        source: object_store::Error,
    },

    #[error("{key}: the object changed at the source during the download")]
    Changed { key: String },

    #[error("{key}: size mismatch: expected {expected} bytes, received {got}")]
    SizeMismatch {
        key: String,
        expected: u64,
        got: u64,
    },

    #[error(
        "{key}: {algorithm:?} checksum mismatch: the store's is {expected}, the data's is {got}"
    )]
    ChecksumMismatch {
        key: String,
        algorithm: checksum::VerifiedBy,
        expected: String,
        got: String,
    },

    #[error("disk full writing {} (object {key}); the part file was removed", path.display())]
    DiskFull { key: String, path: PathBuf },

    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "cache full: a dataset of {need} bytes does not fit under --cache-max-bytes {max} next to \
         {used} bytes of other datasets (evicted {evicted}; the rest are in use or being written)"
    )]
    CacheFull {
        need: u64,
        max: u64,
        used: u64,
        evicted: usize,
    },

    #[error("dataset {name:?} is already prefetched from {existing}, not {requested}")]
    NameInUse {
        name: String,
        existing: String,
        requested: String,
    },

    #[error("prefetching is cancelled (interruption notice or shutdown)")]
    Cancelled,

    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl Error {
    /// A GET failure of `key`, classified.
    pub fn get(key: &str, source: object_store::Error) -> Error {
        Error::Get {
            key: key.to_string(),
            cause: GetCause::of(&source),
            source,
        }
    }

    /// A listing failure; a key that cannot be a path (`..`, empty segments) is named.
    pub fn from_list(url: &str, source: object_store::Error) -> Error {
        match source {
            object_store::Error::InvalidPath {
                source: object_store::path::Error::BadSegment { path, .. },
            } => Error::Store(store::Error::UnsafeKey {
                key: path,
                reason: "'.' or '..' segment escapes the dataset".to_string(),
            }),
            object_store::Error::InvalidPath {
                source: object_store::path::Error::EmptySegment { path },
            } => Error::Store(store::Error::UnsafeKey {
                key: path,
                reason: "empty path segment".to_string(),
            }),
            source => Error::List {
                url: url.to_string(),
                source,
            },
        }
    }

    /// An I/O failure on `path` while handling `key`; ENOSPC and EDQUOT become [`Error::DiskFull`].
    pub fn io_for(key: &str, op: &'static str, path: PathBuf, source: io::Error) -> Error {
        if crate::fsutil::is_disk_full(&source) {
            return Error::DiskFull {
                key: key.to_string(),
                path,
            };
        }
        Error::Io { op, path, source }
    }

    /// Worth another attempt (object_store already retried 5xx and connection errors).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Get { cause, .. } => matches!(cause, GetCause::Throttled | GetCause::Request),
            Error::Changed { .. } | Error::SizeMismatch { .. } | Error::ChecksumMismatch { .. } => {
                true
            }
            Error::List { source, .. } => matches!(
                GetCause::of(source),
                GetCause::Throttled | GetCause::Request
            ),
            Error::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::Interrupted | io::ErrorKind::TimedOut
            ),
            Error::Store(_)
            | Error::DiskFull { .. }
            | Error::CacheFull { .. }
            | Error::NameInUse { .. }
            | Error::Cancelled
            | Error::Internal(_) => false,
        }
    }

    /// Ends the whole run (rather than failing one object).
    pub fn is_fatal(&self) -> bool {
        match self {
            Error::DiskFull { .. }
            | Error::CacheFull { .. }
            | Error::List { .. }
            | Error::NameInUse { .. }
            | Error::Cancelled
            | Error::Internal(_) => true,
            Error::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::ReadOnlyFilesystem | io::ErrorKind::PermissionDenied
            ),
            // A key that cannot be a path fails its object; the rest of the store floor's
            // refusals (URL, name, client) end the run.
            Error::Store(e) => !matches!(e, store::Error::UnsafeKey { .. }),
            Error::Get { .. }
            | Error::Changed { .. }
            | Error::SizeMismatch { .. }
            | Error::ChecksumMismatch { .. } => false,
        }
    }

    /// Label for `spotguard_prefetch_errors_total{error}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Store(e) => e.metric_label(),
            Error::NameInUse { .. } => "invalid_name",
            Error::List { .. } => "list",
            Error::Get { cause, .. } => match cause {
                GetCause::NotFound => "not_found",
                GetCause::PermissionDenied => "permission_denied",
                GetCause::Unauthenticated => "unauthenticated",
                GetCause::Throttled => "throttled",
                GetCause::Request => "request",
            },
            Error::Changed { .. } => "changed",
            Error::SizeMismatch { .. } => "size_mismatch",
            Error::ChecksumMismatch { .. } => "checksum_mismatch",
            Error::DiskFull { .. } => "disk_full",
            Error::Io { .. } => "io",
            Error::CacheFull { .. } => "cache_full",
            Error::Cancelled => "cancelled",
            Error::Internal(_) => "internal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::path::Path as ObjectPath;

    #[test]
    fn list_errors_name_the_escaping_key() {
        let bad = ObjectPath::parse("data/../../etc/passwd").unwrap_err();
        let e = Error::from_list(
            "s3://b/data",
            object_store::Error::InvalidPath { source: bad },
        );
        match &e {
            Error::Store(store::Error::UnsafeKey { key, .. }) => {
                assert_eq!(key, "data/../../etc/passwd")
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("data/../../etc/passwd"));
        assert_eq!(e.metric_label(), "unsafe_key");
    }

    #[test]
    fn classification_of_store_errors() {
        let nf = object_store::Error::NotFound {
            path: "k".into(),
            source: "gone".into(),
        };
        let e = Error::get("k", nf);
        assert_eq!(e.metric_label(), "not_found");
        assert!(!e.is_retryable() && !e.is_fatal());
        assert!(
            e.to_string().contains("GET k failed: not found (404)"),
            "{e}"
        );

        let slow = object_store::Error::Generic {
            store: "S3",
            source: "Server returned non-2xx status code: 503 Service Unavailable: <Code>SlowDown</Code>".into(),
        };
        let e = Error::get("k", slow);
        assert_eq!(e.metric_label(), "throttled");
        assert!(e.is_retryable());

        let denied = object_store::Error::PermissionDenied {
            path: "k".into(),
            source: "403".into(),
        };
        let e = Error::get("k", denied);
        assert_eq!(e.metric_label(), "permission_denied");
        assert!(e.to_string().contains("check the credentials"));

        let full = Error::io_for(
            "a/b",
            "write",
            PathBuf::from("/c/d/a/b.spotguard-part-h-1"),
            io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert!(matches!(full, Error::DiskFull { .. }));
        assert!(full.is_fatal());
        assert!(
            full.to_string().contains("a/b.spotguard-part-h-1"),
            "{full}"
        );
    }
}
