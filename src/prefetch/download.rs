//! The download engine: the listing streams into a bounded pipeline; each object is claimed,
//! written with positioned I/O into a preallocated part file (large objects as parallel ranged
//! GETs), verified, renamed into place and recorded in the manifest.
//!
//! Memory is bounded by the number of requests in flight (`concurrency`) times the write batch
//! (at most two batches per request), whatever the dataset or object size: bodies are streamed,
//! never collected.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, GetRange, GetResultPayload, ObjectMeta, ObjectStore, ObjectStoreExt,
};
use serde::Serialize;
use tokio::sync::{oneshot, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::cache::{self, CompleteMarker, DatasetPaths};
use super::claim::{now_ms, Acquire, Claim, ClaimRecord, Owner};
use super::manifest::{etag_md5, normalize_etag, Entry, Manifest, Update};
use super::metrics::PrefetchMetrics;
use super::progress::{Progress, Snapshot};
use super::source::SourceUrl;
use super::verify::{ChecksumSlot, Finished, Hasher, StoreChecksum, VerifiedBy};
use super::Error;

/// Write batch: body chunks are gathered up to this many bytes and written with one `pwritev`.
const BATCH_BYTES: usize = 256 << 10;
/// At most this many chunks per `pwritev` (below `IOV_MAX`).
const BATCH_CHUNKS: usize = 512;
/// Attempts per object for transient failures, on top of object_store's own retries.
const OBJECT_ATTEMPTS: u32 = 3;
/// Published files being synced at once.
const SYNCS_IN_FLIGHT: usize = 16;

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

/// Tunables of a dataset run.
#[derive(Clone, Debug)]
pub struct FetchOptions {
    /// Requests in flight.
    pub concurrency: usize,
    /// Objects larger than this are fetched as parallel ranged GETs of this size.
    pub part_size: u64,
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
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            concurrency: 32,
            part_size: 8 << 20,
            verify: Verify::Checksum,
            lease: Duration::from_secs(30),
            renew_every: Duration::from_secs(5),
            flush_every: Duration::from_secs(1),
            max_bytes: None,
            in_use_window: Duration::from_secs(15 * 60),
            touch_lease_on_complete: false,
            failpoint: None,
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

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Every object is in the cache, whole and verified.
    Complete,
    /// Some objects failed (named in `errors`); the rest is in the cache.
    Incomplete,
    /// The run stopped on an error (listing, credentials, disk full, cache full).
    Failed,
    /// Cancelled (interruption notice, signal or deadline); safe to resume.
    Cancelled,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::Incomplete => "incomplete",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// One failed object in the summary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ObjectError {
    pub key: String,
    pub error: String,
    pub kind: &'static str,
}

/// The machine-readable end of a run (the CLI prints it as one JSON line).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub event: &'static str,
    pub dataset: String,
    pub dir: String,
    pub source: String,
    pub outcome: Outcome,
    #[serde(flatten)]
    pub counts: Snapshot,
    pub evicted: Vec<String>,
    pub duration_s: f64,
    pub rate_bps: u64,
    /// The error that stopped the run.
    pub error: Option<String>,
    /// Failed objects (at most 50 listed; `counts.files_failed` has the total).
    pub errors: Vec<ObjectError>,
}

/// The result of a run: the summary plus the typed errors.
#[derive(Debug)]
pub struct Report {
    pub summary: Summary,
    pub fatal: Option<Error>,
}

/// An object from the listing.
#[derive(Clone, Debug)]
struct Listed {
    location: ObjectPath,
    entry: Entry,
}

/// Consecutive small objects (at most [`GROUP_WINDOW`] listing positions) claimed together: one
/// claim file instead of one per object. `first` and `last` are the window's first and last
/// listed keys, so processes listing the same source form the same groups.
#[derive(Clone, Debug)]
struct Group {
    first: String,
    last: String,
    objects: Vec<Listed>,
}

/// Work that may have to wait for another process's claim.
enum Work {
    Object(Listed),
    Group(Group),
}

/// Objects of at most this many consecutive listing positions share a group claim.
const GROUP_WINDOW: u64 = 64;

/// The claim key of the group whose window starts at `first` and ends at `last`.
pub(crate) fn group_claim_key(first: &str, last: &str) -> String {
    format!("group\n{first}\n{last}")
}

/// A byte range of an object being fetched; `written` bytes from `start` are on disk.
#[derive(Debug)]
struct Segment {
    start: u64,
    end: u64,
    written: AtomicU64,
}

impl Segment {
    fn new(start: u64, end: u64) -> Arc<Segment> {
        Arc::new(Segment {
            start,
            end,
            written: AtomicU64::new(0),
        })
    }
    fn done(&self) -> [u64; 2] {
        [
            self.start,
            self.start + self.written.load(Ordering::Acquire),
        ]
    }
}

/// A download in progress, or a group's claim: what the renewer needs to checkpoint it.
struct Active {
    /// The claim this entry renews: an object's own (large objects) or a group's; `None` for an
    /// object covered by its group's claim.
    claim: Option<Claim>,
    record: Mutex<ClaimRecord>,
    file: Mutex<Option<Arc<File>>>,
    base_done: Mutex<Vec<[u64; 2]>>,
    segments: Mutex<Vec<Arc<Segment>>>,
    synced: Mutex<Vec<[u64; 2]>>,
    /// Cancelled when the claim was lost (someone else owns it now).
    lost: CancellationToken,
}

impl Active {
    fn new(claim: Option<Claim>, record: ClaimRecord, lost: CancellationToken) -> Arc<Active> {
        Arc::new(Active {
            claim,
            record: Mutex::new(record),
            file: Mutex::new(None),
            base_done: Mutex::new(Vec::new()),
            segments: Mutex::new(Vec::new()),
            synced: Mutex::new(Vec::new()),
            lost,
        })
    }

    fn done_ranges(&self) -> Vec<[u64; 2]> {
        let mut v = lock(&self.base_done).clone();
        v.extend(lock(&self.segments).iter().map(|s| s.done()));
        merge_ranges(v)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sort and merge `[start, end)` ranges, dropping empty ones.
pub(crate) fn merge_ranges(mut v: Vec<[u64; 2]>) -> Vec<[u64; 2]> {
    v.retain(|r| r[1] > r[0]);
    v.sort_unstable();
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r[0] <= last[1] => last[1] = last[1].max(r[1]),
            _ => out.push(r),
        }
    }
    out
}

/// The parts of `[0, size)` not in `done`, split into pieces of at most `part`.
pub(crate) fn missing_segments(done: &[[u64; 2]], size: u64, part: u64) -> Vec<(u64, u64)> {
    let part = part.max(1);
    let mut out = Vec::new();
    let mut push = |mut a: u64, b: u64| {
        while a < b {
            let e = (a + part).min(b);
            out.push((a, e));
            a = e;
        }
    };
    let mut at = 0;
    for r in merge_ranges(done.to_vec()) {
        let (s, e) = (r[0].min(size), r[1].min(size));
        if s > at {
            push(at, s);
        }
        at = at.max(e);
    }
    if at < size {
        push(at, size);
    }
    out
}

/// State shared by the tasks of one run.
struct Run {
    store: Arc<dyn ObjectStore>,
    source: SourceUrl,
    paths: DatasetPaths,
    opts: FetchOptions,
    owner: Owner,
    progress: Arc<Progress>,
    metrics: Option<Arc<PrefetchMetrics>>,
    /// External cancellation (interruption, signal, deadline): keep part files to resume.
    cancel: CancellationToken,
    /// Cancelled by a fatal error (child of `cancel`).
    abort: CancellationToken,
    requests: Arc<Semaphore>,
    active: Mutex<HashMap<String, Arc<Active>>>,
    /// Manifest updates not merged yet, and claims to release once they are.
    pending: Mutex<(Vec<Update>, Vec<Claim>)>,
    fatal: Mutex<Option<Error>>,
    failures: Mutex<Vec<(String, Error)>>,
    made_dirs: Mutex<HashSet<PathBuf>>,
    complete_removed: AtomicBool,
    /// The shared manifest as last read, keyed by (inode, mtime) of the file.
    shared: Mutex<Option<(ManifestStamp, Arc<Manifest>)>>,
    /// The cache is on tmpfs (no block reservation: see [`preallocate`]).
    on_tmpfs: AtomicBool,
    /// Bounds the files being synced at once (see [`publish`]).
    syncs: Semaphore,
}

type ManifestStamp = (u64, Option<std::time::SystemTime>);

/// Result of one object or group.
enum Done {
    /// Published, seen published by another process, failed, cancelled (all recorded).
    Finished,
    /// Someone else holds the claim: look again later.
    Deferred(Work),
}

/// Why an object's download stopped early.
enum Stop {
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
    fn metrics_error(&self, e: &Error) {
        if let Some(m) = &self.metrics {
            m.error(e.metric_label());
        }
    }

    fn set_fatal(&self, e: Error) {
        self.metrics_error(&e);
        let mut f = lock(&self.fatal);
        if f.is_none() {
            tracing::error!(dataset = %self.paths.name, error = %e, "prefetch failed");
            *f = Some(e);
        }
        drop(f);
        self.abort.cancel();
    }

    fn fail_object(&self, key: &str, e: Error) {
        tracing::warn!(dataset = %self.paths.name, key, error = %e, "object failed");
        self.metrics_error(&e);
        Progress::add(&self.progress.files_failed, 1);
        lock(&self.failures).push((key.to_string(), e));
    }

    fn stopped(&self) -> Option<Stop> {
        if self.cancel.is_cancelled() {
            Some(Stop::Cancelled)
        } else if self.abort.is_cancelled() {
            Some(Stop::Aborted)
        } else {
            None
        }
    }

    fn disk_full(&self) -> bool {
        matches!(*lock(&self.fatal), Some(Error::DiskFull { .. }))
    }

    fn push_update(&self, u: Update, release: Option<Claim>) {
        let mut p = lock(&self.pending);
        p.0.push(u);
        p.1.extend(release);
    }

    /// Release `claim` after the next manifest merge (which records its objects).
    fn push_update_release(&self, claim: Claim) {
        lock(&self.pending).1.push(claim);
    }

    fn lease_until(&self) -> i64 {
        now_ms() + i64::try_from(self.opts.lease.as_millis()).unwrap_or(i64::MAX)
    }

    fn make_parent(&self, file: &Path) -> io::Result<()> {
        let Some(dir) = file.parent() else {
            return Ok(());
        };
        if lock(&self.made_dirs).contains(dir) {
            return Ok(());
        }
        fs::create_dir_all(dir)?;
        lock(&self.made_dirs).insert(dir.to_path_buf());
        Ok(())
    }

    /// Whether another process sharing the cache has published this version of the object
    /// (the shared manifest is re-read only when it changed). Blocking.
    fn done_elsewhere(&self, entry: &Entry) -> bool {
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

    fn count_by_other(&self, entry: &Entry) {
        Progress::add(&self.progress.bytes_done, entry.size);
        Progress::add(&self.progress.files_done, 1);
        Progress::add(&self.progress.files_by_others, 1);
        if let Some(m) = &self.metrics {
            let labels = PrefetchMetrics::dataset(&self.paths.name);
            m.pending_bytes
                .get_or_create(&labels)
                .dec_by(i64::try_from(entry.size).unwrap_or(i64::MAX));
            m.pending_files.get_or_create(&labels).dec();
        }
    }

    /// Remove the `complete` marker once, when the run finds something to fetch.
    fn mark_incomplete(&self) -> io::Result<()> {
        if self.complete_removed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        match fs::remove_file(&self.paths.complete) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|_| Error::Internal("blocking task panicked"))
}

/// Run one dataset to completion, failure or cancellation.
pub async fn fetch_dataset(job: Job) -> Report {
    let started = Instant::now();
    let abort = job.cancel.child_token();
    let run = Arc::new(Run {
        requests: Arc::new(Semaphore::new(job.options.concurrency.max(1))),
        store: job.store,
        source: job.source,
        paths: job.paths,
        owner: Owner::current(),
        progress: job.progress,
        metrics: job.metrics,
        cancel: job.cancel,
        abort,
        opts: job.options,
        active: Mutex::new(HashMap::new()),
        pending: Mutex::new((Vec::new(), Vec::new())),
        fatal: Mutex::new(None),
        failures: Mutex::new(Vec::new()),
        made_dirs: Mutex::new(HashSet::new()),
        complete_removed: AtomicBool::new(false),
        shared: Mutex::new(None),
        on_tmpfs: AtomicBool::new(false),
        syncs: Semaphore::new(SYNCS_IN_FLIGHT),
    });
    if let Some(m) = &run.metrics {
        m.active.inc();
    }
    let evicted = drive(&run, &job.cache_root).await;
    if let Some(m) = &run.metrics {
        m.active.dec();
        m.duration.observe(started.elapsed().as_secs_f64());
        let labels = PrefetchMetrics::dataset(&run.paths.name);
        m.pending_bytes.get_or_create(&labels).set(0);
        m.pending_files.get_or_create(&labels).set(0);
    }
    summarize(&run, evicted, started)
}

fn summarize(run: &Run, evicted: Vec<String>, started: Instant) -> Report {
    let counts = run.progress.snapshot();
    let fatal = lock(&run.fatal).take();
    let failures = std::mem::take(&mut *lock(&run.failures));
    let outcome = if run.cancel.is_cancelled() {
        Outcome::Cancelled
    } else if fatal.is_some() {
        Outcome::Failed
    } else if !failures.is_empty() || counts.files_done < counts.files_total {
        Outcome::Incomplete
    } else {
        Outcome::Complete
    };
    let duration = started.elapsed().as_secs_f64();
    let summary = Summary {
        event: "summary",
        dataset: run.paths.name.clone(),
        dir: run.paths.dir.display().to_string(),
        source: run.source.url.clone(),
        outcome,
        counts,
        evicted,
        duration_s: (duration * 1000.0).round() / 1000.0,
        rate_bps: (counts.bytes_fetched as f64 / duration.max(1e-3)) as u64,
        error: fatal.as_ref().map(|e| e.to_string()),
        errors: failures
            .iter()
            .take(50)
            .map(|(key, e)| ObjectError {
                key: key.clone(),
                error: e.to_string(),
                kind: e.metric_label(),
            })
            .collect(),
    };
    Report { summary, fatal }
}

/// The body of a run; returns the datasets evicted to make room.
async fn drive(run: &Arc<Run>, cache_root: &Path) -> Vec<String> {
    let paths = run.paths.clone();
    let setup = {
        let paths = paths.clone();
        let source = run.source.url.clone();
        let root = cache_root.to_path_buf();
        let r = run.clone();
        blocking(move || -> Result<Manifest, Error> {
            cache::remove_eviction_leftovers(&root);
            paths.create().map_err(|source| Error::Io {
                op: "create dataset directory",
                path: paths.claims.clone(),
                source,
            })?;
            let tmpfs = rustix::fs::statfs(&paths.dir)
                .is_ok_and(|st| st.f_type == libc::TMPFS_MAGIC);
            r.on_tmpfs.store(tmpfs, Ordering::Relaxed);
            // A directory holding another source is never reused (its files would be
            // overwritten or deleted as "gone from the source").
            if let Some(existing) = cache::existing_source(&paths) {
                if !cache::same_source(&existing, &source) {
                    return Err(Error::NameInUse {
                        name: paths.name.clone(),
                        existing,
                        requested: source.clone(),
                    });
                }
            }
            match Manifest::load(&paths.manifest, &source) {
                Ok(m) => Ok(m),
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    tracing::warn!(error = %e, "ignoring an unreadable manifest: every file is re-verified against the source");
                    Ok(Manifest::new(&source))
                }
                Err(e) => Err(Error::Io {
                    op: "read manifest",
                    path: paths.manifest.clone(),
                    source: e,
                }),
            }
        })
        .await
        .and_then(|r| r)
    };
    let manifest = match setup {
        Ok(m) => m,
        Err(e) => {
            run.set_fatal(e);
            return Vec::new();
        }
    };

    let housekeeping_stop = CancellationToken::new();
    let housekeeper = tokio::spawn(housekeep(run.clone(), housekeeping_stop.clone()));

    let mut evicted = Vec::new();
    let listed_keys = produce(run, &manifest, cache_root, &mut evicted).await;

    housekeeping_stop.cancel();
    let _ = housekeeper.await;

    // Objects gone from the source: drop them (only after a full, successful listing).
    let mut removed = Vec::new();
    if let Some(keys) = &listed_keys {
        if run.stopped().is_none() {
            for key in manifest.objects.keys() {
                if !keys.contains(key) {
                    removed.push(key.clone());
                }
            }
        }
    }
    for key in &removed {
        run.push_update(Update::Remove(key.clone()), None);
    }
    let final_flush = flush(run).await;
    if let Err(e) = final_flush {
        run.set_fatal(e);
    }
    if !removed.is_empty() {
        let p = paths.clone();
        let removed_count = removed.len();
        let _ = blocking(move || {
            for key in removed {
                let f = p.file(&key);
                if let Err(e) = fs::remove_file(&f) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(path = %f.display(), error = %e, "could not remove a file deleted at the source");
                    }
                }
            }
        })
        .await;
        tracing::info!(dataset = %paths.name, files = removed_count, "removed files deleted at the source");
    }

    let s = run.progress.snapshot();
    let complete = listed_keys.is_some()
        && run.stopped().is_none()
        && lock(&run.failures).is_empty()
        && s.files_done == s.files_total;
    if complete {
        let marker = CompleteMarker {
            source: run.source.url.clone(),
            finished_at: jiff::Timestamp::now().to_string(),
            objects: s.files_total,
            bytes: s.bytes_total,
        };
        let touch = run.opts.touch_lease_on_complete;
        let p = paths.clone();
        let written = blocking(move || -> io::Result<()> {
            let json = serde_json::to_vec(&marker).map_err(io::Error::other)?;
            crate::fsutil::write_atomic(&p.complete, &json, 0o644)?;
            if touch {
                cache::touch_lease(&p)?;
            }
            Ok(())
        })
        .await;
        match written {
            Ok(Ok(())) => {}
            Ok(Err(source)) => run.set_fatal(Error::Io {
                op: "write complete marker",
                path: paths.complete.clone(),
                source,
            }),
            Err(e) => run.set_fatal(e),
        }
    }
    evicted
}

/// Spawn `work`, holding `n` object permits until it finishes.
async fn spawn_work(
    run: &Arc<Run>,
    tasks: &mut JoinSet<Done>,
    permits: &Arc<Semaphore>,
    work: Work,
) -> bool {
    let n = match &work {
        Work::Object(_) => 1,
        Work::Group(g) => u32::try_from(g.objects.len()).unwrap_or(u32::MAX).max(1),
    };
    let permit = tokio::select! {
        _ = run.abort.cancelled() => return false,
        p = permits.clone().acquire_many_owned(n) => match p {
            Ok(p) => p,
            Err(_) => return false,
        },
    };
    let r = run.clone();
    tasks.spawn(async move {
        let out = match work {
            Work::Object(listed) => fetch_object(&r, listed).await,
            Work::Group(group) => fetch_group(&r, group).await,
        };
        drop(permit);
        out
    });
    true
}

/// The small objects of the current listing window.
struct Window {
    index: u64,
    group: Group,
}

/// List the source and feed the pipeline. Returns every listed key when the listing finished.
async fn produce(
    run: &Arc<Run>,
    manifest: &Manifest,
    cache_root: &Path,
    evicted: &mut Vec<String>,
) -> Option<HashSet<String>> {
    // Objects (claimed, part file open) in flight; a group holds one permit per object.
    let capacity = (run.opts.concurrency.max(1) * 2).max(2 * GROUP_WINDOW as usize);
    let permits = Arc::new(Semaphore::new(capacity));
    let mut tasks: JoinSet<Done> = JoinSet::new();
    let mut deferred: Vec<Work> = Vec::new();
    let mut keys = HashSet::new();
    let mut room: u64 = 0;
    let labels = PrefetchMetrics::dataset(&run.paths.name);
    let mut position: u64 = 0;
    let mut window: Option<Window> = None;

    let mut listing = run.store.list(run.source.list_prefix());
    let mut listing_ok = true;
    loop {
        let item = tokio::select! {
            _ = run.abort.cancelled() => { listing_ok = false; break; }
            item = listing.next() => item,
        };
        let meta = match item {
            None => break,
            Some(Ok(meta)) => meta,
            Some(Err(e)) => {
                run.set_fatal(Error::from_list(&run.source.url, e));
                listing_ok = false;
                break;
            }
        };
        let Some(listed) = to_listed(run, meta) else {
            continue;
        };
        let key = listed.entry.key.clone();
        keys.insert(key.clone());

        // Group windows follow listing positions (present objects included), so that every
        // process listing the same source forms the same groups.
        let index = position / GROUP_WINDOW;
        position += 1;
        if window.as_ref().is_some_and(|w| w.index != index) {
            if let Some(w) = window.take() {
                if !w.group.objects.is_empty()
                    && !spawn_work(run, &mut tasks, &permits, Work::Group(w.group)).await
                {
                    listing_ok = false;
                    break;
                }
            }
        }
        let w = window.get_or_insert_with(|| Window {
            index,
            group: Group {
                first: key.clone(),
                last: key.clone(),
                objects: Vec::new(),
            },
        });
        w.group.last = key.clone();

        let size = listed.entry.size;
        Progress::add(&run.progress.bytes_total, size);
        Progress::add(&run.progress.files_total, 1);
        if let Some(cur) = manifest.objects.get(&key) {
            if cur.done
                && cur.same_version(&listed.entry)
                && file_has_size(&run.paths.file(&key), size)
            {
                Progress::add(&run.progress.bytes_done, size);
                Progress::add(&run.progress.files_done, 1);
                Progress::add(&run.progress.files_present, 1);
                continue;
            }
        }
        if let Some(m) = &run.metrics {
            m.pending_bytes
                .get_or_create(&labels)
                .inc_by(i64::try_from(size).unwrap_or(i64::MAX));
            m.pending_files.get_or_create(&labels).inc();
        }
        if let Err(source) = run.mark_incomplete() {
            run.set_fatal(Error::Io {
                op: "remove complete marker",
                path: run.paths.complete.clone(),
                source,
            });
            listing_ok = false;
            break;
        }
        if let Some(max) = run.opts.max_bytes {
            // A scan reads every dataset's manifest: rescan only when the room found by the
            // last one is used up.
            let need = run.progress.bytes_total.load(Ordering::Relaxed);
            if need > room {
                let root = cache_root.to_path_buf();
                let keep = run.paths.name.clone();
                let in_use = run.opts.in_use_window;
                match blocking(move || cache::make_room(&root, &keep, need, max, in_use))
                    .await
                    .and_then(|r| r)
                {
                    Ok(report) => {
                        if let Some(m) = &run.metrics {
                            m.evictions.inc_by(report.evicted.len() as u64);
                        }
                        evicted.extend(report.evicted);
                        // `used` counts the other datasets.
                        room = max.saturating_sub(report.used);
                    }
                    Err(e) => {
                        run.set_fatal(e);
                        listing_ok = false;
                        break;
                    }
                }
            }
        }
        run.push_update(Update::Pending(listed.entry.clone()), None);

        if size <= run.opts.part_size {
            w.group.objects.push(listed);
        } else if !spawn_work(run, &mut tasks, &permits, Work::Object(listed)).await {
            listing_ok = false;
            break;
        }
        while let Some(res) = tasks.try_join_next() {
            collect(res, &mut deferred);
        }
    }
    if listing_ok {
        if let Some(w) = window.take() {
            if !w.group.objects.is_empty()
                && !spawn_work(run, &mut tasks, &permits, Work::Group(w.group)).await
            {
                listing_ok = false;
            }
        }
    }
    run.progress.listed.store(listing_ok, Ordering::Relaxed);
    while let Some(res) = tasks.join_next().await {
        collect(res, &mut deferred);
    }

    // Work claimed by other processes: wait until it is published, or take it over when its
    // owner's lease runs out.
    let mut pause = Duration::from_millis(200);
    while !deferred.is_empty() && run.stopped().is_none() {
        tokio::select! {
            _ = run.abort.cancelled() => break,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(2));
        for work in std::mem::take(&mut deferred) {
            if !spawn_work(run, &mut tasks, &permits, work).await {
                break;
            }
        }
        while let Some(res) = tasks.join_next().await {
            collect(res, &mut deferred);
        }
    }
    listing_ok.then_some(keys)
}

fn collect(res: Result<Done, tokio::task::JoinError>, deferred: &mut Vec<Work>) {
    match res {
        Ok(Done::Deferred(w)) => deferred.push(w),
        Ok(Done::Finished) => {}
        Err(e) => tracing::error!(error = %e, "object task panicked"),
    }
}

fn file_has_size(path: &Path, size: u64) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == size)
}

fn to_listed(run: &Run, meta: ObjectMeta) -> Option<Listed> {
    let location = meta.location;
    let Some(key) = run.source.relative_key(location.as_ref()) else {
        tracing::debug!(location = %location, "listed object outside the prefix; skipped");
        return None;
    };
    let key = key.to_string();
    if let Err(e) = cache::validate_key(&key) {
        run.fail_object(&key, e);
        Progress::add(&run.progress.files_total, 1);
        return None;
    }
    Some(Listed {
        location,
        entry: Entry {
            key,
            size: meta.size,
            etag: meta.e_tag,
            modified_ms: Some(meta.last_modified.timestamp_millis()),
            done: false,
        },
    })
}

/// Claim, download, verify and publish one (large) object under its own claim, which records
/// its progress for resuming.
async fn fetch_object(run: &Arc<Run>, mut listed: Listed) -> Done {
    let key = listed.entry.key.clone();
    let claim = Claim::new(&run.paths.claims, &key);
    let part_rel = run.paths.part_rel(&key, &run.owner.tag());
    let record = ClaimRecord {
        owner: run.owner.clone(),
        lease_until_ms: run.lease_until(),
        key: key.clone(),
        size: listed.entry.size,
        etag: listed.entry.etag.clone(),
        part: part_rel.clone(),
        done: Vec::new(),
        keys: Vec::new(),
    };
    let acquired = {
        let claim = claim.clone();
        let record = record.clone();
        let r = run.clone();
        let entry = listed.entry.clone();
        blocking(move || -> io::Result<(Acquire, bool)> {
            let got = claim.acquire(&record, now_ms())?;
            // Published by someone else since our listing? (Checked under the claim, so a
            // finished owner's manifest update is visible: claims are released after it.)
            let elsewhere = match &got {
                Acquire::Acquired { previous } if r.done_elsewhere(&entry) => {
                    if let Some(p) = previous {
                        let _ = fs::remove_file(r.paths.dir.join(&p.part));
                    }
                    claim.release(&r.owner)?;
                    true
                }
                _ => false,
            };
            Ok((got, elsewhere))
        })
        .await
    };
    let previous = match acquired {
        Ok(Ok((_, true))) => {
            run.count_by_other(&listed.entry);
            return Done::Finished;
        }
        Ok(Ok((Acquire::Acquired { previous }, false))) => previous,
        Ok(Ok((Acquire::Held(_), false))) => return Done::Deferred(Work::Object(listed)),
        Ok(Err(source)) => {
            run.set_fatal(Error::io_for(
                &key,
                "create claim",
                claim.path.clone(),
                source,
            ));
            return Done::Finished;
        }
        Err(e) => {
            run.set_fatal(e);
            return Done::Finished;
        }
    };
    if previous.is_some() {
        tracing::info!(dataset = %run.paths.name, key, "took over a stale claim");
    }
    let active = Active::new(Some(claim.clone()), record, CancellationToken::new());
    lock(&run.active).insert(key.clone(), active.clone());
    let result = fetch_attempts(run, &mut listed, &active, &part_rel, previous).await;
    lock(&run.active).remove(&key);
    match result {
        Ok(published) => {
            match publish(run, &key, published).await {
                Ok(etag) => record_done(run, &listed, etag, Some(claim)),
                Err(e) => {
                    release(run, &claim).await;
                    fail_or_fatal(run, &key, e);
                }
            }
            Done::Finished
        }
        Err(Stop::Cancelled) | Err(Stop::Aborted) if !run.disk_full() => {
            checkpoint_on_stop(&active).await;
            Done::Finished
        }
        Err(Stop::Cancelled) | Err(Stop::Aborted) => {
            discard_part(run, &active, &part_rel).await;
            release(run, &claim).await;
            Done::Finished
        }
        Err(Stop::Lost) => {
            tracing::warn!(dataset = %run.paths.name, key, "claim taken over by another process; leaving the object to it");
            discard_part(run, &active, &part_rel).await;
            Done::Deferred(Work::Object(listed))
        }
        Err(Stop::Err(e)) => {
            discard_part(run, &active, &part_rel).await;
            release(run, &claim).await;
            fail_or_fatal(run, &key, e);
            Done::Finished
        }
    }
}

/// Claim a group of small objects with one claim file, then download, verify and publish each.
/// Small objects are not resumed: an interrupted one starts over.
async fn fetch_group(run: &Arc<Run>, group: Group) -> Done {
    let claim = Claim::new(
        &run.paths.claims,
        &group_claim_key(&group.first, &group.last),
    );
    let record = ClaimRecord {
        owner: run.owner.clone(),
        lease_until_ms: run.lease_until(),
        key: group.first.clone(),
        size: group.objects.iter().map(|l| l.entry.size).sum(),
        etag: None,
        part: String::new(),
        done: Vec::new(),
        keys: group.objects.iter().map(|l| l.entry.key.clone()).collect(),
    };
    let acquired = {
        let claim = claim.clone();
        let record = record.clone();
        let r = run.clone();
        let entries: Vec<Entry> = group.objects.iter().map(|l| l.entry.clone()).collect();
        blocking(move || -> io::Result<(Acquire, Vec<bool>)> {
            let got = claim.acquire(&record, now_ms())?;
            let mut elsewhere = Vec::new();
            if let Acquire::Acquired { previous } = &got {
                if let Some(p) = previous {
                    // A dead owner's partial small files: they start over.
                    let tag = p.owner.tag();
                    for k in &p.keys {
                        let _ = fs::remove_file(r.paths.dir.join(r.paths.part_rel(k, &tag)));
                    }
                }
                elsewhere = entries.iter().map(|e| r.done_elsewhere(e)).collect();
            }
            Ok((got, elsewhere))
        })
        .await
    };
    let (previous, elsewhere) = match acquired {
        Ok(Ok((Acquire::Acquired { previous }, elsewhere))) => (previous, elsewhere),
        Ok(Ok((Acquire::Held(_), _))) => return Done::Deferred(Work::Group(group)),
        Ok(Err(source)) => {
            run.set_fatal(Error::io_for(
                &group.first,
                "create claim",
                claim.path.clone(),
                source,
            ));
            return Done::Finished;
        }
        Err(e) => {
            run.set_fatal(e);
            return Done::Finished;
        }
    };
    if previous.is_some() {
        tracing::info!(dataset = %run.paths.name, first = %group.first, "took over a stale group claim");
    }
    let entry_key = format!("group\n{}", group.first);
    let group_active = Active::new(
        Some(claim.clone()),
        record.clone(),
        CancellationToken::new(),
    );
    lock(&run.active).insert(entry_key.clone(), group_active.clone());

    let mut tasks: JoinSet<Option<Listed>> = JoinSet::new();
    for (listed, done) in group.objects.iter().zip(elsewhere) {
        if done {
            run.count_by_other(&listed.entry);
            continue;
        }
        let (r, mut listed) = (run.clone(), listed.clone());
        let active = Active::new(None, record.clone(), group_active.lost.clone());
        tasks.spawn(async move {
            let key = listed.entry.key.clone();
            let part_rel = r.paths.part_rel(&key, &r.owner.tag());
            match fetch_attempts(&r, &mut listed, &active, &part_rel, None).await {
                Ok(published) => {
                    match publish(&r, &key, published).await {
                        Ok(etag) => record_done(&r, &listed, etag, None),
                        Err(e) => fail_or_fatal(&r, &key, e),
                    }
                    None
                }
                Err(Stop::Lost) => {
                    discard_part(&r, &active, &part_rel).await;
                    Some(listed)
                }
                Err(Stop::Cancelled) | Err(Stop::Aborted) => {
                    discard_part(&r, &active, &part_rel).await;
                    None
                }
                Err(Stop::Err(e)) => {
                    discard_part(&r, &active, &part_rel).await;
                    fail_or_fatal(&r, &key, e);
                    None
                }
            }
        });
    }
    let mut lost = Vec::new();
    while let Some(res) = tasks.join_next().await {
        match res {
            Ok(Some(listed)) => lost.push(listed),
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "object task panicked"),
        }
    }
    lock(&run.active).remove(&entry_key);
    if !lost.is_empty() {
        tracing::warn!(dataset = %run.paths.name, first = %group.first, "group claim taken over by another process; leaving its objects to it");
        return Done::Deferred(Work::Group(Group {
            objects: lost,
            ..group
        }));
    }
    if run.stopped().is_some() {
        // Nothing to resume in a group: let the next run (anywhere) take it at once.
        release(run, &claim).await;
    } else {
        // Released once the manifest records the objects.
        run.push_update_release(claim);
    }
    Done::Finished
}

/// Download and publish one object, retrying transient failures (resuming from the bytes
/// written) and starting over when it changed at the source.
async fn fetch_attempts(
    run: &Arc<Run>,
    listed: &mut Listed,
    active: &Arc<Active>,
    part_rel: &str,
    mut previous: Option<ClaimRecord>,
) -> Result<Verified, Stop> {
    let key = listed.entry.key.clone();
    let mut attempt = 0;
    loop {
        attempt += 1;
        match download(run, listed, active, previous.take(), part_rel).await {
            Ok(published) => return Ok(published),
            Err(Stop::Err(Error::Changed { .. })) if attempt < OBJECT_ATTEMPTS => {
                tracing::info!(dataset = %run.paths.name, key, "object changed at the source; fetching the new version");
                discard_part(run, active, part_rel).await;
                match run.store.head(&listed.location).await {
                    Ok(meta) => {
                        listed.entry.size = meta.size;
                        listed.entry.etag = meta.e_tag;
                        listed.entry.modified_ms = Some(meta.last_modified.timestamp_millis());
                        let mut rec = lock(&active.record);
                        rec.size = listed.entry.size;
                        rec.etag = listed.entry.etag.clone();
                    }
                    Err(e) => return Err(Stop::Err(Error::get(&key, e))),
                }
            }
            Err(Stop::Err(e)) if e.is_retryable() && attempt < OBJECT_ATTEMPTS => {
                tracing::info!(dataset = %run.paths.name, key, error = %e, attempt, "retrying object");
                // Keep what is on disk: the next attempt resumes from the written ranges.
                let done = active.done_ranges();
                *lock(&active.base_done) = done;
                lock(&active.segments).clear();
                let pause = Duration::from_millis(200 * u64::from(attempt));
                tokio::select! {
                    _ = run.abort.cancelled() => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            Err(stop) => return Err(stop),
        }
    }
}

/// A published object: count it and queue its manifest update (and the claim to release once
/// the manifest records it).
fn record_done(run: &Run, listed: &Listed, etag: Option<String>, release: Option<Claim>) {
    let mut entry = listed.entry.clone();
    if entry.etag.is_none() {
        entry.etag = etag;
    }
    entry.done = true;
    if let Some(m) = &run.metrics {
        let labels = PrefetchMetrics::dataset(&run.paths.name);
        m.files.get_or_create(&labels).inc();
        m.pending_bytes
            .get_or_create(&labels)
            .dec_by(i64::try_from(entry.size).unwrap_or(i64::MAX));
        m.pending_files.get_or_create(&labels).dec();
    }
    Progress::add(&run.progress.files_done, 1);
    Progress::add(&run.progress.files_fetched, 1);
    run.push_update(Update::Done(entry), release);
}

fn fail_or_fatal(run: &Run, key: &str, e: Error) {
    if e.is_fatal() {
        run.set_fatal(e);
    } else {
        run.fail_object(key, e);
    }
}

/// Remove our part file and forget its progress.
async fn discard_part(run: &Run, active: &Active, part_rel: &str) {
    let written: u64 = lock(&active.segments)
        .iter()
        .map(|s| s.written.load(Ordering::Acquire))
        .sum::<u64>()
        + lock(&active.base_done)
            .iter()
            .map(|r| r[1] - r[0])
            .sum::<u64>();
    Progress::sub(&run.progress.bytes_done, written);
    lock(&active.segments).clear();
    lock(&active.base_done).clear();
    lock(&active.synced).clear();
    *lock(&active.file) = None;
    let part = run.paths.dir.join(part_rel);
    let _ = blocking(move || match fs::remove_file(&part) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            tracing::warn!(path = %part.display(), error = %e, "could not remove part file")
        }
        _ => {}
    })
    .await;
}

async fn release(run: &Run, claim: &Claim) {
    let claim = claim.clone();
    let owner = run.owner.clone();
    if let Ok(Err(e)) = blocking(move || claim.release(&owner)).await {
        tracing::warn!(error = %e, "could not release claim");
    }
}

/// Interrupted: sync what is written, record it in the claim and end the lease at once, so the
/// next run (here or on another node) resumes from it without waiting.
async fn checkpoint_on_stop(active: &Arc<Active>) {
    let Some(claim) = active.claim.clone() else {
        return;
    };
    let done = active.done_ranges();
    let file = lock(&active.file).clone();
    let mut record = lock(&active.record).clone();
    record.done = done;
    record.lease_until_ms = 0;
    let path = claim.path.clone();
    let res = blocking(move || -> io::Result<bool> {
        if let Some(f) = file {
            f.sync_data()?;
        }
        claim.renew(&record)
    })
    .await;
    match res {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(claim = %path.display(), error = %e, "could not checkpoint an interrupted download")
        }
        Err(e) => tracing::warn!(error = %e, "checkpoint task failed"),
    }
}

/// Prepare the part file (resuming a previous owner's when it matches) and fetch the missing
/// ranges. Returns the etag the bytes belong to.
async fn download(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    previous: Option<ClaimRecord>,
    part_rel: &str,
) -> Result<Verified, Stop> {
    let key = listed.entry.key.clone();
    let size = listed.entry.size;
    let dir = run.paths.dir.clone();
    let part_path = dir.join(part_rel);
    let final_path = run.paths.file(&key);
    let listed_etag = listed.entry.etag.clone();
    // An object fetched with one request holds its request slot from part-file creation to
    // publication: open part files (and preallocated space) stay bounded by the concurrency.
    let slot = if size <= run.opts.part_size {
        Some(acquire_request(run, active).await?)
    } else {
        None
    };

    // Resume a previous owner's part file when it is for the same version of the object; a
    // part file that cannot be resumed is removed.
    let stale_part = previous.as_ref().map(|p| dir.join(&p.part));
    let resumable = previous.filter(|p| {
        p.size == size
            && !p.done.is_empty()
            && match (&p.etag, &listed_etag) {
                (Some(a), Some(b)) => normalize_etag(a) == normalize_etag(b),
                (Some(_), None) => true,
                (None, _) => false,
            }
    });
    let mut expected_etag = listed_etag.clone();
    let existing_file = lock(&active.file).clone();
    let file: Arc<File> = match existing_file {
        // A retry within this process: same part file, same progress.
        Some(f) => f,
        None => {
            let resume = resumable.clone();
            let part = part_path.clone();
            let fin = final_path.clone();
            let run2 = run.clone();
            let k = key.clone();
            let stale = stale_part.filter(|_| resume.is_none());
            let opened =
                blocking(move || -> Result<(File, Vec<[u64; 2]>), Error> {
                    if let Some(old) = stale.filter(|old| *old != part) {
                        let _ = fs::remove_file(old);
                    }
                    run2.make_parent(&fin)
                        .map_err(|e| Error::io_for(&k, "create directory", fin.clone(), e))?;
                    if let Some(prev) = &resume {
                        let old = dir.join(&prev.part);
                        let ok = fs::metadata(&old).is_ok_and(|m| m.len() == size);
                        if ok && (old == part || fs::rename(&old, &part).is_ok()) {
                            let f = File::options().write(true).read(true).open(&part).map_err(
                                |e| Error::io_for(&k, "open part file", part.clone(), e),
                            )?;
                            return Ok((f, prev.done.clone()));
                        }
                        let _ = fs::remove_file(&old);
                    }
                    let f = File::options()
                        .write(true)
                        .read(true)
                        .create(true)
                        .truncate(true)
                        .open(&part)
                        .map_err(|e| Error::io_for(&k, "create part file", part.clone(), e))?;
                    let ranged = size > run2.opts.part_size;
                    if ranged {
                        preallocate(&f, size, !run2.on_tmpfs.load(Ordering::Relaxed))
                            .map_err(|e| Error::io_for(&k, "preallocate", part.clone(), e))?;
                    }
                    Ok((f, Vec::new()))
                })
                .await
                .and_then(|r| r)?;
            let (f, done) = opened;
            if !done.is_empty() {
                let reused: u64 = merge_ranges(done.clone()).iter().map(|r| r[1] - r[0]).sum();
                tracing::info!(dataset = %run.paths.name, key, bytes = reused, "resuming a partial download");
                Progress::add(&run.progress.bytes_resumed, reused);
                Progress::add(&run.progress.bytes_done, reused);
                if expected_etag.is_none() {
                    expected_etag = resumable.as_ref().and_then(|p| p.etag.clone());
                }
                *lock(&active.base_done) = done;
            }
            let f = Arc::new(f);
            *lock(&active.file) = Some(f.clone());
            // Record the progress we start from (a takeover) or the etag we now expect. A
            // fresh claim already says all there is: no write.
            let rec = {
                let mut rec = lock(&active.record);
                let done = active.done_ranges();
                let changed = rec.done != done || rec.etag != expected_etag;
                rec.done = done;
                rec.etag = expected_etag.clone();
                rec.lease_until_ms = run.lease_until();
                changed.then(|| rec.clone())
            };
            // (Objects of a group have no claim of their own.)
            if let (Some(rec), Some(claim)) = (rec, active.claim.clone()) {
                let path = claim.path.clone();
                match blocking(move || claim.renew(&rec)).await {
                    Ok(Ok(true)) => {}
                    Ok(Ok(false)) => return Err(Stop::Lost),
                    Ok(Err(e)) => {
                        return Err(Stop::Err(Error::io_for(&key, "write claim", path, e)))
                    }
                    Err(e) => return Err(Stop::Err(e)),
                }
            }
            f
        }
    };
    if expected_etag.is_none() {
        expected_etag = lock(&active.record).etag.clone();
    }

    let done_before = lock(&active.base_done).clone();
    let missing = missing_segments(&done_before, size, run.opts.part_size);
    let segments: Vec<Arc<Segment>> = missing.iter().map(|&(a, b)| Segment::new(a, b)).collect();
    *lock(&active.segments) = segments.clone();

    let want = run.opts.verify == Verify::Checksum;
    let fresh = done_before.is_empty();
    let mut etag_seen: Option<String> = expected_etag.clone();
    // The store's full-object checksum, and the hash of what was written (inline).
    let mut checksum: Option<StoreChecksum> = None;
    let mut inline: Option<Hasher> = None;

    if size == 0 {
        // Nothing to fetch; the listing is the truth for an empty object.
    } else if segments.len() == 1 {
        // One request: the checksum comes with the response headers, the hash with the body.
        let seg = segments[0].clone();
        let single_stream = seg.start == 0 && seg.end == size;
        if want && !single_stream {
            // The rest of a resumed object: the checksum from a HEAD, the hash by reading back.
            let (c, head_etag) = head_checksum(run, listed, active, slot.is_some()).await?;
            if let (Some(want_tag), Some(got)) = (&expected_etag, &head_etag) {
                if normalize_etag(want_tag) != normalize_etag(got) {
                    return Err(Stop::Err(Error::Changed { key: key.clone() }));
                }
            }
            checksum = c;
        }
        let fetch = fetch_segment(
            run,
            listed,
            active,
            &seg,
            &file,
            expected_etag.clone(),
            SegmentHash::Choose(want && single_stream),
            None,
        );
        let out = if slot.is_some() {
            fetch.await?
        } else {
            with_request(run, active, fetch).await?
        };
        inline = out.hasher;
        checksum = out.checksum.or(checksum);
        etag_seen = out.etag.or(etag_seen);
    } else {
        // Ranged parts: ask for the checksum first (one HEAD), then hash each part and combine.
        if want {
            let (c, head_etag) = head_checksum(run, listed, active, false).await?;
            if let (Some(want_tag), Some(got)) = (&expected_etag, &head_etag) {
                if normalize_etag(want_tag) != normalize_etag(got) {
                    return Err(Stop::Err(Error::Changed { key: key.clone() }));
                }
            }
            checksum = c;
        }
        let part_hasher = checksum.filter(|c| c.combinable() && fresh);
        let object_stop = active.lost.child_token();
        let mut parts: JoinSet<Result<(u64, Option<Hasher>), Stop>> = JoinSet::new();
        let mut hashes: Vec<(u64, Option<Hasher>)> = Vec::new();
        let mut iter = segments.iter().cloned();
        // Without a known etag, the first response fixes it for the other parts (If-Match).
        if expected_etag.is_none() {
            if let Some(first) = iter.next() {
                let permit = acquire_request(run, active).await?;
                let (tx, rx) = oneshot::channel();
                let (r, l, a, f) = (run.clone(), listed.clone(), active.clone(), file.clone());
                let h = SegmentHash::Given(part_hasher.map(|c| c.hasher()));
                parts.spawn(async move {
                    let res = fetch_segment(&r, &l, &a, &first, &f, None, h, Some(tx)).await;
                    drop(permit);
                    res.map(|o| (first.start, o.hasher))
                });
                // If the first part fails before its headers, its error is in the join set.
                if let Ok(etag) = rx.await {
                    expected_etag = etag.clone();
                    etag_seen = etag;
                }
            }
        }
        let mut first_err: Option<Stop> = None;
        for seg in iter {
            // Reap finished parts so that a failure stops the rest early.
            while let Some(res) = parts.try_join_next() {
                match part_result(res) {
                    Ok(Some(h)) => hashes.push(h),
                    Ok(None) => {}
                    Err(e) => {
                        first_err.get_or_insert(e);
                        object_stop.cancel();
                    }
                }
            }
            if first_err.is_some() {
                break;
            }
            let permit = match acquire_request(run, active).await {
                Ok(p) => p,
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            };
            let (r, l, a, f) = (run.clone(), listed.clone(), active.clone(), file.clone());
            let (tag, stop) = (expected_etag.clone(), object_stop.clone());
            let h = SegmentHash::Given(part_hasher.map(|c| c.hasher()));
            parts.spawn(async move {
                let res = tokio::select! {
                    _ = stop.cancelled() => Err(Stop::Aborted),
                    res = fetch_segment(&r, &l, &a, &seg, &f, tag, h, None) => res.map(|o| (seg.start, o.hasher)),
                };
                drop(permit);
                res
            });
        }
        while let Some(res) = parts.join_next().await {
            match part_result(res) {
                Ok(Some(h)) => hashes.push(h),
                Ok(None) => {}
                Err(e) => {
                    if first_err.is_none() {
                        object_stop.cancel();
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            // A part stopped because a sibling failed: report the sibling's cause.
            return Err(e);
        }
        if part_hasher.is_some() && hashes.len() == segments.len() {
            hashes.sort_by_key(|(start, _)| *start);
            inline = hashes
                .into_iter()
                .map(|(_, h)| h)
                .try_fold(None::<Hasher>, |acc, h| match (acc, h) {
                    (None, Some(h)) => Some(Some(h)),
                    (Some(a), Some(h)) => a.combine(h).map(Some),
                    (_, None) => None,
                })
                .flatten();
        }
    }
    if let Some(stop) = run.stopped() {
        return Err(stop);
    }
    if active.lost.is_cancelled() {
        return Err(Stop::Lost);
    }

    // Every byte accounted for?
    let done = active.done_ranges();
    if size > 0 && done != vec![[0, size]] {
        return Err(Stop::Err(Error::SizeMismatch {
            key: key.clone(),
            expected: size,
            got: done.iter().map(|r| r[1] - r[0]).sum(),
        }));
    }

    // Content: the store's checksum, else a plain-MD5 etag, else the size alone. A hash not
    // computed inline (resumed bytes, SHA-256 or MD5 over ranged parts) is computed by reading
    // the part file back.
    let md5_expected = etag_seen.as_deref().and_then(etag_md5);
    let verified_by = if !want || size == 0 {
        VerifiedBy::Size
    } else if let Some(c) = checksum {
        let got = match inline.filter(|h| !matches!(h, Hasher::Md5(_))) {
            Some(h) => h.finish(),
            None => read_back(&file, size, c.hasher(), &key, &part_path).await?,
        };
        if !c.matches(&got) {
            return Err(Stop::Err(Error::ChecksumMismatch {
                key: key.clone(),
                algorithm: c.kind(),
                expected: c.hex(),
                got: finished_hex(&got),
            }));
        }
        c.kind()
    } else if let Some(expected) = md5_expected {
        let got = match inline.filter(|h| matches!(h, Hasher::Md5(_))) {
            Some(h) => h.finish(),
            None => read_back(&file, size, Hasher::md5(), &key, &part_path).await?,
        };
        if got != Finished::Bytes(expected.to_vec()) {
            return Err(Stop::Err(Error::ChecksumMismatch {
                key: key.clone(),
                algorithm: VerifiedBy::Md5,
                expected: super::verify::hex(&expected),
                got: finished_hex(&got),
            }));
        }
        VerifiedBy::Md5
    } else {
        VerifiedBy::Size
    };

    // Published by [`publish`]: synced, then renamed, off the request slot.
    *lock(&active.file) = None;
    drop(slot);
    Ok(Verified {
        etag: etag_seen,
        file,
        part: part_path,
        path: final_path,
        verified_by,
    })
}

fn finished_hex(f: &Finished) -> String {
    match f {
        Finished::Crc(v) => format!("{v:x}"),
        Finished::Bytes(b) => super::verify::hex(b),
    }
}

async fn read_back(
    file: &Arc<File>,
    size: u64,
    hasher: Hasher,
    key: &str,
    part: &Path,
) -> Result<Finished, Stop> {
    let (f, k, p) = (file.clone(), key.to_string(), part.to_path_buf());
    Ok(blocking(move || hash_file(&f, size, hasher))
        .await?
        .map_err(|e| Error::io_for(&k, "read back part file", p, e))?)
}

/// HEAD with the checksum asked for: the object's full checksum (if the store keeps one) and
/// its etag.
async fn head_checksum(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    holding_slot: bool,
) -> Result<(Option<StoreChecksum>, Option<String>), Stop> {
    let slot = ChecksumSlot::default();
    let opts = GetOptions {
        head: true,
        extensions: slot.extensions(),
        ..GetOptions::default()
    };
    let key = &listed.entry.key;
    Progress::add(&run.progress.requests, 1);
    let head = async {
        tokio::select! {
            _ = run.abort.cancelled() => Err(run.stopped().unwrap_or(Stop::Aborted)),
            _ = active.lost.cancelled() => Err(Stop::Lost),
            r = run.store.get_opts(&listed.location, opts) => Ok(r),
        }
    };
    // A caller holding its request slot already must not wait for a second one.
    let res = if holding_slot {
        head.await?
    } else {
        with_request(run, active, head).await?
    };
    match res {
        Ok(r) => {
            if r.meta.size != listed.entry.size {
                return Err(Stop::Err(Error::Changed { key: key.clone() }));
            }
            Ok((slot.get(), r.meta.e_tag))
        }
        Err(object_store::Error::NotFound { .. }) => {
            Err(Stop::Err(Error::Changed { key: key.clone() }))
        }
        Err(e) => Err(Stop::Err(Error::get(key, e))),
    }
}

/// A downloaded, verified part file, not yet under its final name.
struct Verified {
    /// The etag its bytes belong to.
    etag: Option<String>,
    file: Arc<File>,
    part: PathBuf,
    path: PathBuf,
    verified_by: VerifiedBy,
}

/// Publish a verified file: its data is synced first, then it is renamed into place (so a file
/// under its final name is never one whose data may still be missing after a crash: on a node
/// crash an unsynced rename could leave a full-size, hole-filled file there); the directory is
/// synced before the manifest records it ([`flush`]). Syncs run off the request slots, up to
/// [`SYNCS_IN_FLIGHT`] at once, so the device's flushes overlap the downloads (no-ops on
/// tmpfs). Returns the etag.
async fn publish(run: &Run, key: &str, v: Verified) -> Result<Option<String>, Error> {
    let _permit = run
        .syncs
        .acquire()
        .await
        .map_err(|_| Error::Internal("sync semaphore closed"))?;
    let k = key.to_string();
    let Verified {
        etag,
        file,
        part,
        path,
        verified_by,
    } = v;
    let failpoint = run.opts.failpoint.clone();
    blocking(move || -> Result<(), Error> {
        if let Err(e) = file.sync_data() {
            let _ = fs::remove_file(&part);
            return Err(Error::io_for(&k, "sync", part.clone(), e));
        }
        drop(file);
        if let Some(fp) = &failpoint {
            (fp.0)(PublishStep::PartSynced, &part);
        }
        fs::rename(&part, &path)
            .map_err(|e| Error::io_for(&k, "publish (rename)", path.clone(), e))?;
        if let Some(fp) = &failpoint {
            (fp.0)(PublishStep::Renamed, &path);
        }
        Ok(())
    })
    .await??;
    let counter = match verified_by {
        VerifiedBy::Crc64Nvme => &run.progress.verified_crc64nvme,
        VerifiedBy::Crc32c => &run.progress.verified_crc32c,
        VerifiedBy::Crc32 => &run.progress.verified_crc32,
        VerifiedBy::Sha256 => &run.progress.verified_sha256,
        VerifiedBy::Md5 => &run.progress.verified_md5,
        VerifiedBy::Size => &run.progress.verified_size,
    };
    Progress::add(counter, 1);
    Ok(etag)
}

/// How a segment is hashed: a given hasher (ranged parts), or chosen from the response (a
/// whole-object GET: the store's checksum if it sent one, else MD5 for a plain-MD5 etag).
enum SegmentHash {
    Given(Option<Hasher>),
    Choose(bool),
}

/// What [`fetch_segment`] learned.
struct SegmentOut {
    hasher: Option<Hasher>,
    etag: Option<String>,
    checksum: Option<StoreChecksum>,
}

fn part_result(
    res: Result<Result<(u64, Option<Hasher>), Stop>, tokio::task::JoinError>,
) -> Result<Option<(u64, Option<Hasher>)>, Stop> {
    match res {
        Ok(Ok(h)) => Ok(Some(h)),
        Ok(Err(Stop::Aborted)) => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Stop::Err(Error::Internal("part task panicked"))),
    }
}

async fn acquire_request(
    run: &Run,
    active: &Active,
) -> Result<tokio::sync::OwnedSemaphorePermit, Stop> {
    tokio::select! {
        _ = run.abort.cancelled() => Err(run.stopped().unwrap_or(Stop::Aborted)),
        _ = active.lost.cancelled() => Err(Stop::Lost),
        p = run.requests.clone().acquire_owned() => p.map_err(|_| Stop::Aborted),
    }
}

async fn with_request<T>(
    run: &Run,
    active: &Active,
    fut: impl std::future::Future<Output = Result<T, Stop>>,
) -> Result<T, Stop> {
    let permit = acquire_request(run, active).await?;
    let out = fut.await;
    drop(permit);
    out
}

/// Fetch `seg` (from where it stands) into `file`. Retries transient failures from the byte
/// reached. Returns the hash state, the etag of the responses and the store's checksum (from a
/// whole-object response).
#[allow(clippy::too_many_arguments)]
async fn fetch_segment(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    seg: &Arc<Segment>,
    file: &Arc<File>,
    expected_etag: Option<String>,
    hash: SegmentHash,
    mut headers_tx: Option<oneshot::Sender<Option<String>>>,
) -> Result<SegmentOut, Stop> {
    let (mut hasher, mut choose) = match hash {
        SegmentHash::Given(h) => (h, false),
        SegmentHash::Choose(c) => (None, c),
    };
    let mut checksum: Option<StoreChecksum> = None;
    let key = &listed.entry.key;
    let size = listed.entry.size;
    let mut expected = expected_etag;
    let mut attempt = 0;
    loop {
        let from = seg.start + seg.written.load(Ordering::Acquire);
        if from >= seg.end {
            return Ok(SegmentOut {
                hasher,
                etag: expected,
                checksum,
            });
        }
        attempt += 1;
        let whole = from == 0 && seg.end == size;
        let slot = ChecksumSlot::default();
        let opts = GetOptions {
            if_match: expected.clone(),
            range: (!whole).then_some(GetRange::Bounded(from..seg.end)),
            extensions: slot.extensions(),
            ..GetOptions::default()
        };
        Progress::add(&run.progress.requests, 1);
        let got = tokio::select! {
            _ = run.abort.cancelled() => return Err(run.stopped().unwrap_or(Stop::Aborted)),
            _ = active.lost.cancelled() => return Err(Stop::Lost),
            r = run.store.get_opts(&listed.location, opts) => r,
        };
        let res = match got {
            Ok(r) => r,
            Err(object_store::Error::Precondition { .. }) => {
                return Err(Stop::Err(Error::Changed { key: key.clone() }))
            }
            Err(e) => {
                let err = Error::get(key, e);
                if err.is_retryable() && attempt < OBJECT_ATTEMPTS {
                    tracing::info!(key = %key, error = %err, "retrying request");
                    continue;
                }
                return Err(Stop::Err(err));
            }
        };
        // Every response must be of the version we are assembling (servers that ignore
        // If-Match included).
        let etag = res.meta.e_tag.clone();
        match (&expected, &etag) {
            (Some(want), Some(got)) if normalize_etag(want) != normalize_etag(got) => {
                return Err(Stop::Err(Error::Changed { key: key.clone() }))
            }
            (None, Some(_)) => {
                // Learned from the first response: record it so a resumer can check it.
                expected = etag.clone();
                if active.claim.is_some() {
                    lock(&active.record)
                        .etag
                        .get_or_insert_with(|| etag.clone().unwrap_or_default());
                }
            }
            _ => {}
        }
        if res.meta.size != size {
            return Err(Stop::Err(Error::Changed { key: key.clone() }));
        }
        if let Some(tx) = headers_tx.take() {
            let _ = tx.send(expected.clone());
        }
        if choose && whole {
            // The first response of a whole-object GET picks the hash: the store's checksum,
            // else MD5 when the etag is a plain MD5.
            choose = false;
            checksum = slot.get();
            hasher = match checksum {
                Some(c) => Some(c.hasher()),
                None => expected
                    .as_deref()
                    .and_then(etag_md5)
                    .map(|_| Hasher::md5()),
            };
        } else if choose {
            // Resuming in the middle: no inline hash (the part file is read back).
            choose = false;
        }
        let write = match res.payload {
            GetResultPayload::File(src, _) => {
                copy_local(run, active, seg, file, src, &listed.entry.key).await
            }
            GetResultPayload::Stream(stream) => {
                stream_to_file(run, active, seg, file, stream, &mut hasher, key).await
            }
        };
        match write {
            Ok(()) => {
                let reached = seg.start + seg.written.load(Ordering::Acquire);
                if reached < seg.end {
                    // Short body: continue from where it stopped.
                    if attempt < OBJECT_ATTEMPTS {
                        continue;
                    }
                    return Err(Stop::Err(Error::SizeMismatch {
                        key: key.clone(),
                        expected: seg.end - seg.start,
                        got: reached - seg.start,
                    }));
                }
            }
            Err(Stop::Err(e)) if e.is_retryable() && attempt < OBJECT_ATTEMPTS => {
                tracing::info!(key = %key, error = %e, "retrying from byte {}", seg.start + seg.written.load(Ordering::Acquire));
            }
            Err(e) => return Err(e),
        }
    }
}

/// A batch write on the blocking pool: its result, the hash state after it, its length.
type WriteJob = tokio::task::JoinHandle<(io::Result<()>, Option<Hasher>, u64)>;

/// Stream a body into `file` at the segment's position, in batches written with `pwritev` on
/// the blocking pool, one batch in flight while the next is received.
async fn stream_to_file(
    run: &Arc<Run>,
    active: &Arc<Active>,
    seg: &Arc<Segment>,
    file: &Arc<File>,
    mut stream: futures::stream::BoxStream<'static, object_store::Result<Bytes>>,
    hasher: &mut Option<Hasher>,
    key: &str,
) -> Result<(), Stop> {
    let mut batch: Vec<Bytes> = Vec::new();
    let mut batch_len = 0usize;
    let mut inflight: Option<WriteJob> = None;
    let mut offset = seg.start + seg.written.load(Ordering::Acquire);
    let limit = seg.end;
    let mut stream_err: Option<Error> = None;
    loop {
        let next = tokio::select! {
            _ = run.abort.cancelled() => break,
            _ = active.lost.cancelled() => break,
            c = stream.next() => c,
        };
        let end = match next {
            Some(Ok(chunk)) => {
                // Never write past the segment (a server sending more than asked for).
                let room = usize::try_from(limit.saturating_sub(offset + batch_len as u64))
                    .unwrap_or(usize::MAX);
                let chunk = if chunk.len() > room {
                    chunk.slice(..room)
                } else {
                    chunk
                };
                batch_len += chunk.len();
                if !chunk.is_empty() {
                    batch.push(chunk);
                }
                false
            }
            Some(Err(e)) => {
                stream_err = Some(Error::get(key, e));
                true
            }
            None => true,
        };
        if batch_len >= BATCH_BYTES || batch.len() >= BATCH_CHUNKS || (end && batch_len > 0) {
            // Wait for the previous write, then hand this batch to the blocking pool.
            if let Some(h) = inflight.take() {
                finish_write(run, seg, h, hasher, key).await?;
            }
            let chunks = std::mem::take(&mut batch);
            let len = batch_len as u64;
            batch_len = 0;
            let f = file.clone();
            let mut h = hasher.take();
            let at = offset;
            offset += len;
            inflight = Some(tokio::task::spawn_blocking(move || {
                let r = write_chunks(&f, at, &chunks);
                if r.is_ok() {
                    if let Some(h) = h.as_mut() {
                        for c in &chunks {
                            h.update(c);
                        }
                    }
                }
                (r, h, len)
            }));
        }
        if end {
            break;
        }
    }
    if let Some(h) = inflight.take() {
        finish_write(run, seg, h, hasher, key).await?;
    }
    if let Some(stop) = run.stopped() {
        return Err(stop);
    }
    if active.lost.is_cancelled() {
        return Err(Stop::Lost);
    }
    match stream_err {
        Some(e) => Err(Stop::Err(e)),
        None => Ok(()),
    }
}

async fn finish_write(
    run: &Run,
    seg: &Segment,
    h: WriteJob,
    hasher: &mut Option<Hasher>,
    key: &str,
) -> Result<(), Stop> {
    let (res, md5, len) = h
        .await
        .map_err(|_| Stop::Err(Error::Internal("write task panicked")))?;
    *hasher = md5;
    match res {
        Ok(()) => {
            seg.written.fetch_add(len, Ordering::AcqRel);
            Progress::add(&run.progress.bytes_done, len);
            Progress::add(&run.progress.bytes_fetched, len);
            if let Some(m) = &run.metrics {
                m.bytes
                    .get_or_create(&PrefetchMetrics::dataset(&run.paths.name))
                    .inc_by(len);
            }
            Ok(())
        }
        Err(e) => {
            let part = run
                .paths
                .dir
                .join(run.paths.part_rel(key, &run.owner.tag()));
            Err(Stop::Err(Error::io_for(key, "write", part, e)))
        }
    }
}

/// `pwritev` all of `chunks` at `offset`.
fn write_chunks(file: &File, offset: u64, chunks: &[Bytes]) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = chunks.iter().map(|c| IoSlice::new(c)).collect();
    let mut bufs: &mut [IoSlice<'_>] = &mut slices;
    let mut at = offset;
    while !bufs.is_empty() {
        let n = rustix::io::pwritev(file, bufs, at)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        at += n as u64;
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// A `file://` source: copy in the kernel (`copy_file_range`), falling back to read/write.
async fn copy_local(
    run: &Arc<Run>,
    active: &Arc<Active>,
    seg: &Arc<Segment>,
    file: &Arc<File>,
    src: File,
    key: &str,
) -> Result<(), Stop> {
    const STEP: u64 = 8 << 20;
    loop {
        if let Some(stop) = run.stopped() {
            return Err(stop);
        }
        if active.lost.is_cancelled() {
            return Err(Stop::Lost);
        }
        let at = seg.start + seg.written.load(Ordering::Acquire);
        if at >= seg.end {
            return Ok(());
        }
        let len = (seg.end - at).min(STEP);
        let dst = file.clone();
        let src = src
            .try_clone()
            .map_err(|e| Stop::Err(Error::io_for(key, "read source", PathBuf::from(key), e)))?;
        let n = blocking(move || copy_range(&src, &dst, at, len)).await?;
        let n = match n {
            Ok(0) => {
                return Err(Stop::Err(Error::SizeMismatch {
                    key: key.to_string(),
                    expected: seg.end - seg.start,
                    got: at - seg.start,
                }))
            }
            Ok(n) => n,
            Err(e) => {
                let part = run
                    .paths
                    .dir
                    .join(run.paths.part_rel(key, &run.owner.tag()));
                return Err(Stop::Err(Error::io_for(key, "copy", part, e)));
            }
        };
        seg.written.fetch_add(n, Ordering::AcqRel);
        Progress::add(&run.progress.bytes_done, n);
        Progress::add(&run.progress.bytes_fetched, n);
        if let Some(m) = &run.metrics {
            m.bytes
                .get_or_create(&PrefetchMetrics::dataset(&run.paths.name))
                .inc_by(n);
        }
    }
}

fn copy_range(src: &File, dst: &File, at: u64, len: u64) -> io::Result<u64> {
    let mut off_in = at;
    let mut off_out = at;
    let len_usize = usize::try_from(len).unwrap_or(usize::MAX);
    match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), len_usize) {
        Ok(n) => Ok(n as u64),
        Err(e)
            if e == rustix::io::Errno::XDEV
                || e == rustix::io::Errno::NOSYS
                || e == rustix::io::Errno::INVAL =>
        {
            let mut buf = vec![0u8; len_usize.min(1 << 20)];
            let n = src.read_at(&mut buf, at)?;
            dst.write_all_at(&buf[..n], at)?;
            Ok(n as u64)
        }
        Err(e) => Err(e.into()),
    }
}

/// Size the part file of an object fetched in ranged parts. Where it pays (disk filesystems),
/// reserve the blocks too: a full disk fails here, before any byte is fetched, and parallel
/// ranges do not fragment the file. Not on tmpfs, where reserving means zeroing every page
/// that the download then overwrites. Objects fetched in one piece are written sequentially
/// and not sized ahead at all (a full disk then shows at the write, with the same error).
fn preallocate(f: &File, size: u64, reserve: bool) -> io::Result<()> {
    if size == 0 {
        return Ok(());
    }
    if !reserve {
        return f.set_len(size);
    }
    match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), 0, size) {
        Ok(()) => Ok(()),
        // Filesystems without fallocate (some NFS): a sparse file; a full disk shows at write.
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOSYS => {
            f.set_len(size)
        }
        Err(e) => Err(e.into()),
    }
}

/// `h` over the first `size` bytes of `f`.
fn hash_file(f: &File, size: u64, mut h: Hasher) -> io::Result<Finished> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let want = usize::try_from((size - at).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = f.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "part file shorter than the object",
            ));
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finish())
}

/// Merge pending manifest updates (after making the published files durable), then release the
/// claims of the objects they cover.
async fn flush(run: &Arc<Run>) -> Result<(), Error> {
    let (updates, claims) = {
        let mut p = lock(&run.pending);
        (std::mem::take(&mut p.0), std::mem::take(&mut p.1))
    };
    if updates.is_empty() && claims.is_empty() {
        return Ok(());
    }
    let paths = run.paths.clone();
    let source = run.source.url.clone();
    let owner = run.owner.clone();
    let updates2 = updates.clone();
    let failpoint = run.opts.failpoint.clone();
    let res = blocking(move || -> io::Result<()> {
        // The manifest only claims what is on stable storage: the files were synced after
        // their rename; sync the directories holding the renames (just those: never the whole
        // filesystem, which may hold a training job's checkpoints).
        let dirs: HashSet<PathBuf> = updates2
            .iter()
            .filter_map(|u| match u {
                Update::Done(e) => paths.file(&e.key).parent().map(Path::to_path_buf),
                _ => None,
            })
            .collect();
        for dir in dirs {
            // The renames themselves (directory entries); best effort on filesystems that
            // refuse to sync a directory.
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            if let Some(fp) = &failpoint {
                (fp.0)(PublishStep::DirSynced, &dir);
            }
        }
        Manifest::merge_into(&paths.manifest, &source, &updates2)?;
        for c in &claims {
            if let Err(e) = c.release(&owner) {
                tracing::warn!(claim = %c.path.display(), error = %e, "could not release claim");
            }
        }
        Ok(())
    })
    .await?;
    if let Err(source) = res {
        // Put the updates back for the next try; the claims stay held meanwhile.
        let mut p = lock(&run.pending);
        let mut back = updates;
        back.append(&mut p.0);
        p.0 = back;
        return Err(Error::Io {
            op: "update manifest",
            path: run.paths.manifest.clone(),
            source,
        });
    }
    Ok(())
}

/// Periodic work while a run is going: merge manifest updates, renew claims (syncing the part
/// files and recording their progress first).
async fn housekeep(run: Arc<Run>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_flush = Instant::now();
    let mut last_renew = Instant::now();
    let mut flush_failures = 0u32;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if last_flush.elapsed() >= run.opts.flush_every {
            last_flush = Instant::now();
            match flush(&run).await {
                Ok(()) => flush_failures = 0,
                Err(e) => {
                    flush_failures += 1;
                    tracing::warn!(error = %e, "manifest update failed; will retry");
                    if flush_failures >= 10 {
                        run.set_fatal(e);
                    }
                }
            }
        }
        if last_renew.elapsed() >= run.opts.renew_every {
            last_renew = Instant::now();
            renew_all(&run).await;
        }
    }
}

async fn renew_all(run: &Arc<Run>) {
    let actives: Vec<Arc<Active>> = lock(&run.active).values().cloned().collect();
    if actives.is_empty() {
        return;
    }
    let until = run.lease_until();
    let res = blocking(move || {
        for a in actives {
            let Some(claim) = &a.claim else {
                continue;
            };
            let done = a.done_ranges();
            let file = lock(&a.file).clone();
            let changed = *lock(&a.synced) != done;
            if changed {
                if let Some(f) = &file {
                    // Only bytes on stable storage are recorded as done (a node crash on a
                    // shared cache must not leave "done" holes).
                    if let Err(e) = f.sync_data() {
                        tracing::warn!(claim = %claim.path.display(), error = %e, "could not sync a part file");
                        continue;
                    }
                }
            }
            let rec = {
                let mut r = lock(&a.record);
                r.lease_until_ms = until;
                if file.is_some() {
                    r.done = done.clone();
                }
                r.clone()
            };
            match claim.renew(&rec) {
                Ok(true) => *lock(&a.synced) = done,
                Ok(false) => a.lost.cancel(),
                Err(e) => tracing::warn!(claim = %claim.path.display(), error = %e, "could not renew claim"),
            }
        }
    })
    .await;
    if let Err(e) = res {
        tracing::warn!(error = %e, "claim renewal task failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_merge_and_missing_parts_split() {
        assert_eq!(
            merge_ranges(vec![[5, 9], [0, 3], [3, 4], [8, 12], [7, 7]]),
            vec![[0, 4], [5, 12]]
        );
        assert_eq!(missing_segments(&[], 10, 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(missing_segments(&[[0, 10]], 10, 4), vec![]);
        assert_eq!(
            missing_segments(&[[2, 5], [7, 8]], 10, 100),
            vec![(0, 2), (5, 7), (8, 10)]
        );
        assert_eq!(missing_segments(&[[0, 3]], 0, 4), vec![]);
    }
}
