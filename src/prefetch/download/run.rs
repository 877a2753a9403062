//! The state shared by the tasks of one run: the fatal error and the failed objects, the
//! cancellation, the manifest updates not merged yet, and what other processes sharing the cache
//! have published.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use object_store::ObjectStore;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::options::{FetchOptions, Job};
use super::work::Active;
use crate::prefetch::cache::DatasetPaths;
use crate::prefetch::claim::{now_ms, Claim, Owner};
use crate::prefetch::manifest::{Entry, Manifest, Update};
use crate::prefetch::metrics::PrefetchMetrics;
use crate::prefetch::Error;
use crate::store::progress::Progress;
use crate::store::url::SourceUrl;
use crate::sync::lock;

/// Published files being synced at once.
pub(super) const SYNCS_IN_FLIGHT: usize = 16;

pub(super) fn file_has_size(path: &Path, size: u64) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == size)
}

/// State shared by the tasks of one run.
pub(super) struct Run {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) source: SourceUrl,
    pub(super) paths: DatasetPaths,
    pub(super) opts: FetchOptions,
    pub(super) owner: Owner,
    pub(super) progress: Arc<Progress>,
    pub(super) metrics: Option<Arc<PrefetchMetrics>>,
    /// External cancellation (interruption, signal, deadline): keep part files to resume.
    pub(super) cancel: CancellationToken,
    /// Cancelled by a fatal error (child of `cancel`).
    pub(super) abort: CancellationToken,
    pub(super) requests: Arc<Semaphore>,
    pub(super) active: Mutex<HashMap<String, Arc<Active>>>,
    /// Manifest updates not merged yet, and claims to release once they are.
    pub(super) pending: Mutex<(Vec<Update>, Vec<Claim>)>,
    pub(super) fatal: Mutex<Option<Error>>,
    pub(super) failures: Mutex<Vec<(String, Error)>>,
    made_dirs: Mutex<HashSet<PathBuf>>,
    /// Directories this run created whose entry in their parent is not synced yet: the parent
    /// is synced before the manifest names a file below them.
    pub(super) new_dirs: Mutex<HashSet<PathBuf>>,
    complete_removed: AtomicBool,
    /// The shared manifest as last read, keyed by (inode, mtime) of the file.
    shared: Mutex<Option<(ManifestStamp, Arc<Manifest>)>>,
    /// The cache is on tmpfs (no block reservation: see [`preallocate`]).
    pub(super) on_tmpfs: AtomicBool,
    /// Bounds the files being synced at once (see [`publish`]).
    pub(super) syncs: Semaphore,
}

type ManifestStamp = (u64, Option<std::time::SystemTime>);

/// Why an object's download stopped early.
pub(super) enum Stop {
    /// Cancelled from outside: checkpoint and keep the part file.
    Cancelled,
    /// Another task failed fatally: the run is ending.
    Aborted,
    /// Our claim was taken over: leave the object to its new owner.
    Lost,
    Err(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Err(e)
    }
}

impl Run {
    pub(super) fn new(job: Job) -> Run {
        Run {
            requests: Arc::new(Semaphore::new(job.options.concurrency.max(1))),
            store: job.store,
            source: job.source,
            paths: job.paths,
            owner: Owner::current(),
            progress: job.progress,
            metrics: job.metrics,
            abort: job.cancel.child_token(),
            cancel: job.cancel,
            opts: job.options,
            active: Mutex::new(HashMap::new()),
            pending: Mutex::new((Vec::new(), Vec::new())),
            fatal: Mutex::new(None),
            failures: Mutex::new(Vec::new()),
            made_dirs: Mutex::new(HashSet::new()),
            new_dirs: Mutex::new(HashSet::new()),
            complete_removed: AtomicBool::new(false),
            shared: Mutex::new(None),
            on_tmpfs: AtomicBool::new(false),
            syncs: Semaphore::new(SYNCS_IN_FLIGHT),
        }
    }

    pub(super) fn metrics_error(&self, e: &Error) {
        if let Some(m) = &self.metrics {
            m.error(e.metric_label());
        }
    }

    pub(super) fn set_fatal(&self, e: Error) {
        self.metrics_error(&e);
        let mut f = lock(&self.fatal);
        if f.is_none() {
            tracing::error!(dataset = %self.paths.name, error = %e, "prefetch failed");
            *f = Some(e);
        }
        drop(f);
        self.abort.cancel();
    }

    pub(super) fn fail_object(&self, key: &str, e: Error) {
        tracing::warn!(dataset = %self.paths.name, key, error = %e, "object failed");
        self.metrics_error(&e);
        Progress::add(&self.progress.files_failed, 1);
        lock(&self.failures).push((key.to_string(), e));
    }

    pub(super) fn stopped(&self) -> Option<Stop> {
        if self.cancel.is_cancelled() {
            Some(Stop::Cancelled)
        } else if self.abort.is_cancelled() {
            Some(Stop::Aborted)
        } else {
            None
        }
    }

    pub(super) fn disk_full(&self) -> bool {
        matches!(*lock(&self.fatal), Some(Error::DiskFull { .. }))
    }

    pub(super) fn push_update(&self, u: Update, release: Option<Claim>) {
        let mut p = lock(&self.pending);
        p.0.push(u);
        p.1.extend(release);
    }

    /// Release `claim` after the next manifest merge (which records its objects).
    pub(super) fn push_update_release(&self, claim: Claim) {
        lock(&self.pending).1.push(claim);
    }

    pub(super) fn lease_until(&self) -> i64 {
        now_ms() + i64::try_from(self.opts.lease.as_millis()).unwrap_or(i64::MAX)
    }

    pub(super) fn make_parent(&self, file: &Path) -> io::Result<()> {
        let Some(dir) = file.parent() else {
            return Ok(());
        };
        if lock(&self.made_dirs).contains(dir) {
            return Ok(());
        }
        // One component at a time, remembering the ones made here (see `new_dirs`).
        let mut missing = Vec::new();
        let mut at = dir;
        while !at.is_dir() {
            missing.push(at.to_path_buf());
            match at.parent() {
                Some(p) if !p.as_os_str().is_empty() => at = p,
                _ => break,
            }
        }
        for d in missing.into_iter().rev() {
            match fs::create_dir(&d) {
                Ok(()) => {
                    lock(&self.new_dirs).insert(d);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        lock(&self.made_dirs).insert(dir.to_path_buf());
        Ok(())
    }

    /// Whether another process sharing the cache has published this version of the object
    /// (the shared manifest is re-read only when it changed). Blocking.
    pub(super) fn done_elsewhere(&self, entry: &Entry) -> bool {
        use std::os::unix::fs::MetadataExt;
        let Ok(meta) = fs::metadata(&self.paths.manifest) else {
            return false;
        };
        let stamp = (meta.ino(), meta.modified().ok());
        let cached = match &*lock(&self.shared) {
            Some((s, m)) if *s == stamp => Some(m.clone()),
            _ => None,
        };
        let manifest = match cached {
            Some(m) => m,
            None => match Manifest::load(&self.paths.manifest, &self.source.url) {
                Ok(m) => {
                    let m = Arc::new(m);
                    *lock(&self.shared) = Some((stamp, m.clone()));
                    m
                }
                Err(_) => return false,
            },
        };
        manifest
            .objects
            .get(&entry.key)
            .is_some_and(|e| e.done && e.same_version(entry))
            && file_has_size(&self.paths.file(&entry.key), entry.size)
    }

    pub(super) fn count_by_other(&self, entry: &Entry) {
        Progress::add(&self.progress.bytes_done, entry.size);
        Progress::add(&self.progress.files_done, 1);
        Progress::add(&self.progress.files_by_others, 1);
        self.no_longer_pending(entry.size);
    }

    /// An object of `size` bytes is no longer pending: published, here or by another process.
    pub(super) fn no_longer_pending(&self, size: u64) {
        if let Some(m) = &self.metrics {
            let labels = PrefetchMetrics::dataset(&self.paths.name);
            m.pending_bytes
                .get_or_create(&labels)
                .dec_by(i64::try_from(size).unwrap_or(i64::MAX));
            m.pending_files.get_or_create(&labels).dec();
        }
    }

    /// Remove the `complete` marker once, when the run finds something to fetch.
    pub(super) fn mark_incomplete(&self) -> io::Result<()> {
        if self.complete_removed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        match fs::remove_file(&self.paths.complete) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| Error::Internal("blocking task panicked"))
}
