//! What a caller asks of a run ([`Job`], [`FetchOptions`], [`Verify`]) and the publish
//! failpoint tests hook in ([`Failpoint`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStore;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::prefetch::cache::DatasetPaths;
use crate::prefetch::metrics::PrefetchMetrics;
use crate::store::progress::Progress;
use crate::store::url::SourceUrl;

/// Default of [`FetchOptions::parts_per_object`].
pub const PARTS_PER_OBJECT: usize = 4;

/// What to verify before a file is published.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verify {
    /// Content: the store's full-object checksum (S3 CRC64NVME / CRC32C / CRC32 / SHA-256, GCS
    /// CRC32C), CRCs computed while streaming and combined across ranged parts; else the MD5 of
    /// a plain (single-part) etag; else the size. The summary counts which was used.
    #[value(alias = "md5")]
    Checksum,
    /// Size (and the etag of every response) only.
    Size,
}

/// Tunables of a dataset run.
#[derive(Clone, Debug)]
pub struct FetchOptions {
    /// Requests in flight.
    pub concurrency: usize,
    /// Objects larger than this are fetched as parallel ranged GETs of this size.
    pub part_size: u64,
    /// One object's share of the request slots for its ranged GETs (within `concurrency`):
    /// beyond it, the object takes only a slot no other object waits for, so large objects
    /// listed first leave the small ones theirs while a lone large object uses them all.
    pub parts_per_object: usize,
    pub verify: Verify,
    /// Claim lease; renewed every `renew_every` (progress is synced and recorded then).
    pub lease: Duration,
    pub renew_every: Duration,
    /// Manifest updates are merged at most this often.
    pub flush_every: Duration,
    /// Keep the cache under this many bytes (evicting other datasets).
    pub max_bytes: Option<u64>,
    /// A dataset whose lease was touched within this window is in use.
    pub in_use_window: Duration,
    /// Touch the dataset's lease when the run completes (the CLI: a job is about to use it).
    pub touch_lease_on_complete: bool,
    /// Test hook at each publish step.
    pub failpoint: Option<Failpoint>,
    /// Fetch only these keys (relative to the source prefix): every other listed object is
    /// ignored, neither fetched nor counted (`prefetch --latest-checkpoint` fetches the files its
    /// checkpoint's manifest lists, nothing else under the prefix). `None`: every object.
    pub only: Option<Arc<std::collections::HashSet<String>>>,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            concurrency: 32,
            part_size: 8 << 20,
            parts_per_object: PARTS_PER_OBJECT,
            verify: Verify::Checksum,
            lease: Duration::from_secs(30),
            renew_every: Duration::from_secs(5),
            flush_every: Duration::from_secs(1),
            max_bytes: None,
            in_use_window: Duration::from_secs(15 * 60),
            touch_lease_on_complete: false,
            failpoint: None,
            only: None,
        }
    }
}

/// One dataset run.
pub struct Job {
    pub store: Arc<dyn ObjectStore>,
    pub source: SourceUrl,
    pub paths: DatasetPaths,
    pub cache_root: PathBuf,
    pub options: FetchOptions,
    pub progress: Arc<Progress>,
    pub metrics: Option<Arc<PrefetchMetrics>>,
    pub cancel: CancellationToken,
}

/// Called at the steps of publishing a file (tests: the order of sync and rename, and a crash
/// between them).
#[derive(Clone)]
pub struct Failpoint(pub Arc<FailpointFn>);

/// The function behind a [`Failpoint`].
pub type FailpointFn = dyn Fn(PublishStep, &Path) + Send + Sync;

impl std::fmt::Debug for Failpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Failpoint")
    }
}

/// A step of publishing: the part file's data is on stable storage; it has its final name;
/// the directory holding the name is synced (the manifest may record it after this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishStep {
    PartSynced,
    Renamed,
    DirSynced,
}
