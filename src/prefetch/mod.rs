//! Dataset prefetch (docs/prefetch.md): copy an object-store prefix into a local (or shared NFS/EFS)
//! cache, fast, resumable, and never publishing a partial file.
//!
//! - [`cli`]: `spotguard prefetch SRC DEST` ([`PrefetchArgs`], [`run_cli`]).
//! - [`Prefetcher`]: the daemon side (`--prefetch NAME=URL`, config list, pod annotations).
//! - [`download`]: the engine; [`claim`]: per-object claims shared between processes and nodes;
//!   [`manifest`]: the per-dataset manifest; [`cache`]: layout, leases and eviction.
//!
//! The user guide is `docs/prefetch.md`.

pub mod annotations;
pub mod cache;
pub mod claim;
pub mod cli;
pub mod download;
pub mod manifest;
pub mod metrics;
pub mod policy;
pub mod progress;
pub mod serve;
pub mod source;
pub mod verify;

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use cli::{run_cli, PrefetchArgs};
pub use download::{FetchOptions, Outcome, Summary, Verify};
pub use metrics::PrefetchMetrics;
pub use progress::{Progress, Snapshot};
pub use source::{SourceUrl, StoreOptions};

/// Errors of the prefetch module. Each names the object (or URL, or path) and the cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid source URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    #[error("invalid dataset name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },

    #[error("cannot set up the object store for {url}: {source}")]
    BuildStore {
        url: String,
        #[source]
        source: object_store::Error,
    },

    #[error("listing {url} failed ({}): {source}", list_cause(.source))]
    List {
        url: String,
        #[source]
        source: object_store::Error,
    },

    #[error("object key {key:?} rejected: {reason}")]
    UnsafeKey { key: String, reason: String },

    #[error("GET {key} failed: {cause}: {source}")]
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
        algorithm: verify::VerifiedBy,
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

/// Why a GET failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetCause {
    /// 404.
    NotFound,
    /// 403: the credentials lack `s3:GetObject` / `storage.objects.get`.
    PermissionDenied,
    /// 401 or a credential provider failure.
    Unauthenticated,
    /// 503 SlowDown / 429, still failing after the retries with backoff.
    Throttled,
    /// Connection, timeout or another server error, after retries.
    Request,
}

impl std::fmt::Display for GetCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GetCause::NotFound => "not found (404)",
            GetCause::PermissionDenied => {
                "access denied (403: check the credentials and the bucket policy)"
            }
            GetCause::Unauthenticated => "not authenticated (401: check the credentials)",
            GetCause::Throttled => "throttled (503 SlowDown; retried with backoff)",
            GetCause::Request => "request failed",
        })
    }
}

fn list_cause(e: &object_store::Error) -> GetCause {
    GetCause::of(e)
}

impl GetCause {
    fn of(e: &object_store::Error) -> GetCause {
        match e {
            object_store::Error::NotFound { .. } => GetCause::NotFound,
            object_store::Error::PermissionDenied { .. } => GetCause::PermissionDenied,
            object_store::Error::Unauthenticated { .. } => GetCause::Unauthenticated,
            other => {
                // object_store keeps the HTTP status inside its (private) retry error; its text
                // reads "... status code: 503 Service Unavailable ..." and carries S3's code.
                let text = error_chain(other);
                if text.contains("SlowDown")
                    || text.contains(" 503")
                    || text.contains(" 429")
                    || text.contains("TooManyRequests")
                {
                    GetCause::Throttled
                } else if text.contains("InvalidAccessKeyId")
                    || text.contains("SignatureDoesNotMatch")
                    || text.contains("ExpiredToken")
                {
                    GetCause::Unauthenticated
                } else if text.contains(" 403") || text.contains("AccessDenied") {
                    GetCause::PermissionDenied
                } else {
                    GetCause::Request
                }
            }
        }
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
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
            } => Error::UnsafeKey {
                key: path,
                reason: "'.' or '..' segment escapes the dataset".to_string(),
            },
            object_store::Error::InvalidPath {
                source: object_store::path::Error::EmptySegment { path },
            } => Error::UnsafeKey {
                key: path,
                reason: "empty path segment".to_string(),
            },
            source => Error::List {
                url: url.to_string(),
                source,
            },
        }
    }

    /// An I/O failure on `path` while handling `key`; ENOSPC and EDQUOT become [`Error::DiskFull`].
    pub fn io_for(key: &str, op: &'static str, path: PathBuf, source: io::Error) -> Error {
        if matches!(
            source.raw_os_error(),
            Some(libc::ENOSPC) | Some(libc::EDQUOT)
        ) || source.kind() == io::ErrorKind::StorageFull
        {
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
            Error::InvalidUrl { .. }
            | Error::InvalidName { .. }
            | Error::BuildStore { .. }
            | Error::UnsafeKey { .. }
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
            | Error::BuildStore { .. }
            | Error::InvalidUrl { .. }
            | Error::InvalidName { .. }
            | Error::NameInUse { .. }
            | Error::Cancelled
            | Error::Internal(_) => true,
            Error::Io { source, .. } => matches!(
                source.kind(),
                io::ErrorKind::ReadOnlyFilesystem | io::ErrorKind::PermissionDenied
            ),
            Error::Get { .. }
            | Error::UnsafeKey { .. }
            | Error::Changed { .. }
            | Error::SizeMismatch { .. }
            | Error::ChecksumMismatch { .. } => false,
        }
    }

    /// Label for `spotguard_prefetch_errors_total{error}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidUrl { .. } => "invalid_url",
            Error::InvalidName { .. } | Error::NameInUse { .. } => "invalid_name",
            Error::BuildStore { .. } => "store_config",
            Error::List { .. } => "list",
            Error::UnsafeKey { .. } => "unsafe_key",
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

/// Parse a dataset spec as given to `--prefetch`: `NAME=URL`, or a bare URL (the name is then
/// derived from it). Both parts are validated. Returns `(name, url)`.
pub fn parse_spec(spec: &str) -> Result<(String, String), Error> {
    let spec = spec.trim();
    let (name, url) = match spec.split_once('=') {
        // `=` inside a URL (after "://") is not a separator.
        Some((name, url)) if !name.contains("://") => (name.trim().to_string(), url.trim()),
        _ => (String::new(), spec),
    };
    let src = SourceUrl::parse(url)?;
    let name = if name.is_empty() {
        src.default_name()
    } else {
        name
    };
    source::validate_name(&name)?;
    Ok((name, url.to_string()))
}

/// Defaults the daemon applies to every dataset it prefetches.
#[derive(Clone, Debug, Default)]
pub struct PrefetchDefaults {
    pub fetch: FetchOptions,
    pub store: StoreOptions,
}

/// What [`Prefetcher::ensure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensure {
    /// A run was started.
    Started,
    /// A run for this dataset is going on already.
    InProgress,
    /// The dataset is complete in the cache.
    AlreadyComplete,
}

impl Ensure {
    pub fn as_str(self) -> &'static str {
        match self {
            Ensure::Started => "started",
            Ensure::InProgress => "in_progress",
            Ensure::AlreadyComplete => "complete",
        }
    }
}

/// State of a dataset known to the [`Prefetcher`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetState {
    Running,
    Complete,
    Incomplete,
    Failed,
    Cancelled,
}

/// One dataset in [`Prefetcher::status`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct DatasetStatus {
    pub name: String,
    pub url: String,
    pub state: DatasetState,
    pub progress: Snapshot,
    pub started_at: Option<jiff::Timestamp>,
    pub finished_at: Option<jiff::Timestamp>,
    /// The error that stopped the last run, or the first failed object.
    pub error: Option<String>,
}

struct Tracked {
    url: String,
    state: DatasetState,
    progress: Arc<Progress>,
    started_at: Option<jiff::Timestamp>,
    finished_at: Option<jiff::Timestamp>,
    error: Option<String>,
}

struct Inner {
    cache_root: PathBuf,
    max_bytes: Option<u64>,
    defaults: PrefetchDefaults,
    metrics: Arc<PrefetchMetrics>,
    cancel: CancellationToken,
    datasets: Mutex<BTreeMap<String, Tracked>>,
    changed: Notify,
}

/// The daemon's prefetcher: warms datasets into `<cache_root>/<name>` in the background.
/// Cloning shares it.
#[derive(Clone)]
pub struct Prefetcher {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How often the daemon logs the progress of a running dataset.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Prefetcher {
    /// `cancel` ends every run (shutdown); [`Prefetcher::cancel_all`] does the same on an
    /// interruption notice.
    pub fn new(
        cache_root: PathBuf,
        max_bytes: Option<u64>,
        defaults: PrefetchDefaults,
        metrics: Arc<PrefetchMetrics>,
        cancel: CancellationToken,
    ) -> Prefetcher {
        Prefetcher {
            inner: Arc::new(Inner {
                cache_root,
                max_bytes,
                defaults,
                metrics,
                cancel,
                datasets: Mutex::new(BTreeMap::new()),
                changed: Notify::new(),
            }),
        }
    }

    /// Make sure dataset `name` from `url` is (being) prefetched. Idempotent: a dataset that is
    /// complete (in this process or on disk) or running is not restarted; a failed, incomplete
    /// or cancelled one is started again. Must be called within a tokio runtime.
    pub fn ensure(&self, name: &str, url: &str) -> Result<Ensure, Error> {
        source::validate_name(name)?;
        let src = SourceUrl::parse(url)?;
        if self.inner.cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        let paths = cache::DatasetPaths::new(&self.inner.cache_root, name);
        let mut datasets = lock(&self.inner.datasets);
        if let Some(t) = datasets.get(name) {
            if !cache::same_source(&t.url, url) {
                return Err(Error::NameInUse {
                    name: name.to_string(),
                    existing: t.url.clone(),
                    requested: url.to_string(),
                });
            }
            match t.state {
                DatasetState::Running => return Ok(Ensure::InProgress),
                // Still on disk? (It may have been evicted since: then fetch it again.)
                DatasetState::Complete if paths.complete.exists() => {
                    return Ok(Ensure::AlreadyComplete)
                }
                DatasetState::Complete
                | DatasetState::Incomplete
                | DatasetState::Failed
                | DatasetState::Cancelled => {}
            }
        }
        // A directory holding another source is never overwritten.
        if let Some(existing) = cache::existing_source(&paths) {
            if !cache::same_source(&existing, url) {
                return Err(Error::NameInUse {
                    name: name.to_string(),
                    existing,
                    requested: url.to_string(),
                });
            }
        }
        if let Some(marker) = cache::CompleteMarker::read(&paths.complete) {
            if cache::same_source(&marker.source, url) {
                let progress = Arc::new(Progress::default());
                Progress::add(&progress.files_total, marker.objects);
                Progress::add(&progress.files_done, marker.objects);
                Progress::add(&progress.files_present, marker.objects);
                Progress::add(&progress.bytes_total, marker.bytes);
                Progress::add(&progress.bytes_done, marker.bytes);
                progress
                    .listed
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                datasets.insert(
                    name.to_string(),
                    Tracked {
                        url: url.to_string(),
                        state: DatasetState::Complete,
                        progress,
                        started_at: None,
                        finished_at: None,
                        error: None,
                    },
                );
                return Ok(Ensure::AlreadyComplete);
            }
        }
        let store = source::build_store(&src, &self.inner.defaults.store)?;
        let progress = Arc::new(Progress::default());
        datasets.insert(
            name.to_string(),
            Tracked {
                url: url.to_string(),
                state: DatasetState::Running,
                progress: progress.clone(),
                started_at: Some(jiff::Timestamp::now()),
                finished_at: None,
                error: None,
            },
        );
        drop(datasets);

        let mut options = self.inner.defaults.fetch.clone();
        options.max_bytes = self.inner.max_bytes;
        let job = download::Job {
            store,
            source: src,
            paths,
            cache_root: self.inner.cache_root.clone(),
            options,
            progress: progress.clone(),
            metrics: Some(self.inner.metrics.clone()),
            cancel: self.inner.cancel.child_token(),
        };
        let inner = self.inner.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            tracing::info!(dataset = %name, url = %job.source.url, "prefetch started");
            let stop_log = CancellationToken::new();
            let logger = tokio::spawn(log_progress(
                progress.clone(),
                name.clone(),
                stop_log.clone(),
            ));
            let report = download::fetch_dataset(job).await;
            stop_log.cancel();
            let _ = logger.await;
            let s = &report.summary;
            let state = match s.outcome {
                Outcome::Complete => DatasetState::Complete,
                Outcome::Incomplete => DatasetState::Incomplete,
                Outcome::Failed => DatasetState::Failed,
                Outcome::Cancelled => DatasetState::Cancelled,
            };
            let error = s
                .error
                .clone()
                .or_else(|| s.errors.first().map(|e| e.error.clone()));
            tracing::info!(
                dataset = %name,
                outcome = s.outcome.as_str(),
                files_done = s.counts.files_done,
                files_total = s.counts.files_total,
                bytes_fetched = s.counts.bytes_fetched,
                duration_s = s.duration_s,
                error = error.as_deref().unwrap_or(""),
                "prefetch finished"
            );
            if let Some(t) = lock(&inner.datasets).get_mut(&name) {
                t.state = state;
                t.finished_at = Some(jiff::Timestamp::now());
                t.error = error;
            }
            inner.changed.notify_waiters();
        });
        Ok(Ensure::Started)
    }

    /// [`Prefetcher::ensure`] under the name derived from the URL ([`SourceUrl::default_name`]).
    /// Returns the name.
    pub fn ensure_url(&self, url: &str) -> Result<(String, Ensure), Error> {
        let name = SourceUrl::parse(url)?.default_name();
        let outcome = self.ensure(&name, url)?;
        Ok((name, outcome))
    }

    /// Cancel every run (an interruption notice: the node is going away). Part files and claims
    /// are checkpointed so another node, or this one after a restart, resumes them. Later
    /// [`Prefetcher::ensure`] calls return [`Error::Cancelled`].
    pub fn cancel_all(&self) {
        tracing::info!("cancelling all prefetches");
        self.inner.cancel.cancel();
    }

    /// The cache root.
    pub fn cache_root(&self) -> &std::path::Path {
        &self.inner.cache_root
    }

    /// Every dataset this prefetcher knows, by name.
    pub fn status(&self) -> Vec<DatasetStatus> {
        lock(&self.inner.datasets)
            .iter()
            .map(|(name, t)| DatasetStatus {
                name: name.clone(),
                url: t.url.clone(),
                state: t.state,
                progress: t.progress.snapshot(),
                started_at: t.started_at,
                finished_at: t.finished_at,
                error: t.error.clone(),
            })
            .collect()
    }

    /// Wait until dataset `name` is not running any more; `None` if it is unknown.
    pub async fn wait(&self, name: &str) -> Option<DatasetStatus> {
        loop {
            let notified = self.inner.changed.notified();
            let current = self.status().into_iter().find(|s| s.name == name)?;
            if current.state != DatasetState::Running {
                return Some(current);
            }
            notified.await;
        }
    }
}

async fn log_progress(progress: Arc<Progress>, name: String, stop: CancellationToken) {
    let mut tick = tokio::time::interval(LOG_EVERY);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let s = progress.snapshot();
        tracing::info!(
            dataset = %name,
            bytes_done = s.bytes_done,
            bytes_total = s.bytes_total,
            files_done = s.files_done,
            files_total = s.files_total,
            listed = s.listed,
            "prefetch progress"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::path::Path as ObjectPath;
    use object_store::{ObjectStore, ObjectStoreExt};

    #[test]
    fn specs_parse_with_or_without_a_name() {
        assert_eq!(
            parse_spec("imagenet=s3://bkt/imagenet/train").unwrap(),
            (
                "imagenet".to_string(),
                "s3://bkt/imagenet/train".to_string()
            )
        );
        let (name, url) = parse_spec("gs://b/p").unwrap();
        assert_eq!(url, "gs://b/p");
        assert!(
            name.starts_with("gs-b-p-") && name.len() == "gs-b-p-".len() + 8,
            "{name}"
        );
        assert!(matches!(
            parse_spec("../x=s3://b/p"),
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(
            parse_spec("x=http://b/p"),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(parse_spec("x="), Err(Error::InvalidUrl { .. })));
    }

    #[test]
    fn list_errors_name_the_escaping_key() {
        let bad = ObjectPath::parse("data/../../etc/passwd").unwrap_err();
        let e = Error::from_list(
            "s3://b/data",
            object_store::Error::InvalidPath { source: bad },
        );
        match &e {
            Error::UnsafeKey { key, .. } => assert_eq!(key, "data/../../etc/passwd"),
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

    async fn store_with(objects: &[(&str, Vec<u8>)]) -> Arc<dyn ObjectStore> {
        let store = InMemory::new();
        for (k, v) in objects {
            store
                .put(&ObjectPath::from(*k), v.clone().into())
                .await
                .unwrap();
        }
        Arc::new(store)
    }

    fn job(
        store: Arc<dyn ObjectStore>,
        root: &std::path::Path,
        cancel: CancellationToken,
    ) -> download::Job {
        let source = SourceUrl::parse("s3://bucket/ds").unwrap();
        download::Job {
            store,
            paths: cache::DatasetPaths::new(root, "ds"),
            cache_root: root.to_path_buf(),
            source,
            options: FetchOptions {
                part_size: 64 << 10,
                concurrency: 4,
                ..FetchOptions::default()
            },
            progress: Arc::new(Progress::default()),
            metrics: None,
            cancel,
        }
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[tokio::test]
    async fn fetches_publishes_and_records_then_skips_and_refetches_changes() {
        let root = tempfile::tempdir().unwrap();
        let big = pattern(300 << 10, 1);
        let store = store_with(&[
            ("ds/a.bin", pattern(1000, 2)),
            ("ds/dir/big.bin", big.clone()),
            ("ds/empty", Vec::new()),
            ("other/x", pattern(10, 3)),
        ])
        .await;
        let report =
            download::fetch_dataset(job(store.clone(), root.path(), CancellationToken::new()))
                .await;
        let s = &report.summary;
        assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
        assert_eq!((s.counts.files_total, s.counts.files_fetched), (3, 3));
        let ds = root.path().join("ds");
        assert_eq!(std::fs::read(ds.join("dir/big.bin")).unwrap(), big);
        assert_eq!(std::fs::read(ds.join("a.bin")).unwrap(), pattern(1000, 2));
        assert_eq!(std::fs::read(ds.join("empty")).unwrap().len(), 0);
        assert!(ds.join(".spotguard/complete").exists());
        let m = manifest::Manifest::load(&ds.join(".spotguard/manifest.json"), "").unwrap();
        assert!(m.objects.values().all(|e| e.done), "{m:?}");
        assert_eq!(m.objects.len(), 3);
        // No part files or claims are left behind.
        let leftovers: Vec<_> = walk(&ds)
            .into_iter()
            .filter(|p| {
                p.to_string_lossy().contains("spotguard-part")
                    || p.to_string_lossy().contains("/claims/")
            })
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");

        // Second run: nothing to fetch.
        let again =
            download::fetch_dataset(job(store.clone(), root.path(), CancellationToken::new()))
                .await;
        assert_eq!(again.summary.outcome, Outcome::Complete);
        assert_eq!(again.summary.counts.files_fetched, 0);
        assert_eq!(again.summary.counts.files_present, 3);
        assert_eq!(again.summary.counts.requests, 0);

        // A changed object is fetched again; a deleted one is removed.
        store
            .put(&ObjectPath::from("ds/a.bin"), pattern(1000, 9).into())
            .await
            .unwrap();
        store.delete(&ObjectPath::from("ds/empty")).await.unwrap();
        let third =
            download::fetch_dataset(job(store, root.path(), CancellationToken::new())).await;
        assert_eq!(third.summary.outcome, Outcome::Complete);
        assert_eq!(third.summary.counts.files_fetched, 1);
        assert_eq!(std::fs::read(ds.join("a.bin")).unwrap(), pattern(1000, 9));
        assert!(!ds.join("empty").exists());
        let m = manifest::Manifest::load(&ds.join(".spotguard/manifest.json"), "").unwrap();
        assert_eq!(m.objects.len(), 2);
    }

    fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let p = e.path();
                if p.is_dir() {
                    out.extend(walk(&p));
                } else {
                    out.push(p);
                }
            }
        }
        out
    }

    #[tokio::test]
    async fn publishing_syncs_then_renames_then_syncs_the_directory_before_recording() {
        let root = tempfile::tempdir().unwrap();
        let store = store_with(&[
            ("ds/a/big", pattern(300 << 10, 1)),
            ("ds/a/small", pattern(1000, 2)),
            ("ds/top", pattern(5000, 3)),
        ])
        .await;
        type Journal = Vec<(download::PublishStep, PathBuf, bool, bool)>;
        let journal: Arc<Mutex<Journal>> = Arc::default();
        let (j, manifest_path) = (
            journal.clone(),
            root.path().join("ds/.spotguard/manifest.json"),
        );
        let mut job = job(store, root.path(), CancellationToken::new());
        job.options.failpoint = Some(download::Failpoint(Arc::new(move |step, path| {
            // At each step: does the final name exist yet, and does the manifest record it?
            let recorded = std::fs::read_to_string(&manifest_path)
                .map(|t| t.contains("\"done\":true"))
                .unwrap_or(false);
            let text = path.to_string_lossy();
            let final_name = text.split(cache::PART_INFIX).next().unwrap_or_default();
            let final_exists = std::path::Path::new(final_name).exists();
            lock(&j).push((step, path.to_path_buf(), final_exists, recorded));
        })));
        let report = download::fetch_dataset(job).await;
        assert_eq!(
            report.summary.outcome,
            Outcome::Complete,
            "{:?}",
            report.summary
        );
        let journal = lock(&journal).clone();
        let ds = root.path().join("ds");
        for key in ["a/big", "a/small", "top"] {
            let fin = ds.join(key);
            let synced = journal
                .iter()
                .position(|(s, p, _, _)| {
                    *s == download::PublishStep::PartSynced
                        && p.to_string_lossy()
                            .starts_with(&format!("{}.spotguard-part-", fin.display()))
                })
                .unwrap_or_else(|| panic!("{key}: no sync in {journal:?}"));
            let renamed = journal
                .iter()
                .position(|(s, p, _, _)| *s == download::PublishStep::Renamed && *p == fin)
                .unwrap_or_else(|| panic!("{key}: no rename in {journal:?}"));
            let dir_synced = journal
                .iter()
                .position(|(s, p, _, _)| {
                    *s == download::PublishStep::DirSynced && Some(p.as_path()) == fin.parent()
                })
                .unwrap_or_else(|| panic!("{key}: no directory sync in {journal:?}"));
            assert!(
                synced < renamed && renamed < dir_synced,
                "{key}: {journal:?}"
            );
            // When the part was synced, the final name did not exist yet; after the rename it
            // did.
            assert!(
                !journal[synced].2 && journal[renamed].2,
                "{key}: {journal:?}"
            );
        }
        // The manifest recorded nothing before the first directory sync.
        let first_dir_sync = journal
            .iter()
            .position(|(s, _, _, _)| *s == download::PublishStep::DirSynced)
            .unwrap();
        assert!(journal[..=first_dir_sync]
            .iter()
            .all(|(_, _, _, recorded)| !recorded));
        // The in-memory store keeps no checksums and its etags are not MD5s: sizes only.
        assert_eq!(
            report.summary.counts.verified_size, 3,
            "{:?}",
            report.summary
        );
    }

    #[tokio::test]
    async fn a_dataset_directory_holding_another_source_is_never_overwritten() {
        let root = tempfile::tempdir().unwrap();
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::write(a.path().join("x"), b"from a").unwrap();
        std::fs::write(b.path().join("y"), b"from b").unwrap();
        let p = Prefetcher::new(
            root.path().to_path_buf(),
            None,
            PrefetchDefaults::default(),
            Arc::new(PrefetchMetrics::register(
                &mut prometheus_client::registry::Registry::default(),
            )),
            CancellationToken::new(),
        );
        let url_a = format!("file://{}", a.path().display());
        let url_b = format!("file://{}", b.path().display());
        p.ensure("ds", &url_a).unwrap();
        assert_eq!(p.wait("ds").await.unwrap().state, DatasetState::Complete);
        // Same name, other source: refused, in this process and in a fresh one (from disk).
        assert!(matches!(
            p.ensure("ds", &url_b),
            Err(Error::NameInUse { .. })
        ));
        let fresh = Prefetcher::new(
            root.path().to_path_buf(),
            None,
            PrefetchDefaults::default(),
            Arc::new(PrefetchMetrics::register(
                &mut prometheus_client::registry::Registry::default(),
            )),
            CancellationToken::new(),
        );
        match fresh.ensure("ds", &url_b) {
            Err(Error::NameInUse { existing, .. }) => assert_eq!(existing, url_a),
            other => panic!("{other:?}"),
        }
        // A trailing slash is the same source.
        assert_eq!(
            fresh.ensure("ds", &format!("{url_a}/")).unwrap(),
            Ensure::AlreadyComplete
        );
        assert_eq!(std::fs::read(root.path().join("ds/x")).unwrap(), b"from a");
        assert!(!root.path().join("ds/y").exists());
    }

    #[tokio::test]
    async fn resumes_from_a_dead_owners_claim() {
        let root = tempfile::tempdir().unwrap();
        let data = pattern(200 << 10, 5);
        let store = store_with(&[("ds/big", data.clone())]).await;
        let meta = store.head(&ObjectPath::from("ds/big")).await.unwrap();
        // A previous owner (a dead process on this host) wrote the first 128 KiB.
        let paths = cache::DatasetPaths::new(root.path(), "ds");
        paths.create().unwrap();
        let mut dead = claim::Owner::current();
        dead.pid = 999_999_999;
        dead.nonce = 1;
        let part = paths.part_rel("big", &dead.tag());
        let mut partial = vec![0u8; data.len()];
        partial[..128 << 10].copy_from_slice(&data[..128 << 10]);
        std::fs::write(paths.dir.join(&part), &partial).unwrap();
        claim::Claim::new(&paths.claims, "big")
            .write(&claim::ClaimRecord {
                owner: dead,
                lease_until_ms: claim::now_ms() + 600_000,
                key: "big".into(),
                size: data.len() as u64,
                etag: meta.e_tag.clone(),
                part: part.clone(),
                done: vec![[0, 128 << 10]],
                keys: vec![],
            })
            .unwrap();
        let report =
            download::fetch_dataset(job(store, root.path(), CancellationToken::new())).await;
        let s = &report.summary;
        assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
        assert_eq!(s.counts.bytes_resumed, 128 << 10);
        assert_eq!(s.counts.bytes_fetched, (200 - 128) << 10);
        assert_eq!(std::fs::read(paths.dir.join("big")).unwrap(), data);
        assert!(!paths.dir.join(&part).exists());
    }

    #[tokio::test]
    async fn live_foreign_claim_is_waited_for_then_seen_complete() {
        let root = tempfile::tempdir().unwrap();
        let data = pattern(1000, 7);
        let store = store_with(&[("ds/f", data.clone())]).await;
        let paths = cache::DatasetPaths::new(root.path(), "ds");
        paths.create().unwrap();
        let other = claim::Owner {
            host: "other-node".into(),
            pid: 1,
            boot_id: String::new(),
            pid_ns: String::new(),
            start_ticks: 0,
            nonce: 3,
        };
        // Small objects are claimed in groups (here a group of one).
        let c = claim::Claim::new(&paths.claims, &download::group_claim_key("f", "f"));
        c.write(&claim::ClaimRecord {
            owner: other.clone(),
            lease_until_ms: claim::now_ms() + 600_000,
            key: "f".into(),
            size: 1000,
            etag: None,
            part: "f.spotguard-part-other-node-1".into(),
            done: vec![],
            keys: vec![],
        })
        .unwrap();
        let run = tokio::spawn(download::fetch_dataset(job(
            store.clone(),
            root.path(),
            CancellationToken::new(),
        )));
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(!run.is_finished());
        // The other node publishes the file, records it and releases its claim.
        let meta = store.head(&ObjectPath::from("ds/f")).await.unwrap();
        std::fs::write(paths.dir.join("f"), &data).unwrap();
        manifest::Manifest::merge_into(
            &paths.manifest,
            "s3://bucket/ds",
            &[manifest::Update::Done(manifest::Entry {
                key: "f".into(),
                size: 1000,
                etag: meta.e_tag,
                modified_ms: Some(meta.last_modified.timestamp_millis()),
                done: true,
            })],
        )
        .unwrap();
        c.release(&other).unwrap();
        let report = tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .unwrap()
            .unwrap();
        let s = &report.summary;
        assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
        assert_eq!(
            (
                s.counts.files_by_others,
                s.counts.files_fetched,
                s.counts.requests
            ),
            (1, 0, 0)
        );
    }

    #[tokio::test]
    async fn cancellation_keeps_a_resumable_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let store = store_with(&[("ds/f", pattern(1000, 1))]).await;
        let cancel = CancellationToken::new();
        cancel.cancel();
        let report = download::fetch_dataset(job(store, root.path(), cancel)).await;
        assert_eq!(report.summary.outcome, Outcome::Cancelled);
        assert!(!root.path().join("ds/f").exists());
        assert!(!root.path().join("ds/.spotguard/complete").exists());
    }

    #[tokio::test]
    async fn prefetcher_ensure_is_idempotent_and_reports_status() {
        let root = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("sub")).unwrap();
        std::fs::write(src.path().join("sub/x"), pattern(5000, 4)).unwrap();
        std::fs::write(src.path().join("y"), pattern(10, 4)).unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(PrefetchMetrics::register(&mut registry));
        let p = Prefetcher::new(
            root.path().to_path_buf(),
            None,
            PrefetchDefaults::default(),
            metrics,
            CancellationToken::new(),
        );
        let url = format!("file://{}", src.path().display());
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::Started);
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::InProgress);
        assert!(matches!(
            p.ensure("local", "s3://b/other"),
            Err(Error::NameInUse { .. })
        ));
        assert!(matches!(
            p.ensure("../x", &url),
            Err(Error::InvalidName { .. })
        ));
        let st = p.wait("local").await.unwrap();
        assert_eq!(st.state, DatasetState::Complete, "{st:?}");
        assert_eq!(st.progress.files_done, 2);
        assert_eq!(
            std::fs::read(root.path().join("local/sub/x")).unwrap(),
            pattern(5000, 4)
        );
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::AlreadyComplete);
        let (derived, _) = p.ensure_url(&url).unwrap();
        assert_eq!(
            p.wait(&derived).await.unwrap().state,
            DatasetState::Complete
        );
        let text = crate::metrics::encode(&registry);
        assert!(
            text.contains("spotguard_prefetch_files_total{dataset=\"local\"} 2"),
            "{text}"
        );

        // A fresh prefetcher finds the complete marker on disk.
        let p2 = Prefetcher::new(
            root.path().to_path_buf(),
            None,
            PrefetchDefaults::default(),
            Arc::new(PrefetchMetrics::register(
                &mut prometheus_client::registry::Registry::default(),
            )),
            CancellationToken::new(),
        );
        assert_eq!(p2.ensure("local", &url).unwrap(), Ensure::AlreadyComplete);
        p2.cancel_all();
        assert!(matches!(p2.ensure("other", &url), Err(Error::Cancelled)));
        assert_eq!(p2.status().len(), 1);
    }
}
