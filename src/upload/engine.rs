//! The upload of one captured checkpoint: files first, in parallel, then `manifest.json`.
//!
//! One producer walks the files in order and turns each into work — a small file is one unit
//! (read, `PUT`); a large one a multipart upload (created, recorded, then one unit per part) —
//! leasing a buffer from the [`Pool`] before each unit, which bounds both memory and the requests
//! in flight. Units run as tasks: the read (positioned, from the captured descriptor, with both
//! CRCs computed over the buffer and the page cache dropped behind it) on a blocking thread, the
//! request on the runtime. The unit that finishes a file's last part completes the file: its
//! CRCs combined in order, its identity checked again (changed under the upload ⇒ the upload
//! fails), the multipart upload completed or the temp file renamed, the store's checksum
//! compared, the journal told.
//!
//! The run stops at the deadline (the caller passes `deadline − drain reserve`), on the first
//! error, or when cancelled. Only a run that has every file writes the manifest. A run stopped by
//! the deadline or an error aborts its multipart uploads and forgets its journal (the staged copy
//! will not outlive the notice); a cancelled one (the uploader itself is stopping) keeps both, so
//! that the next run resumes.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::crc::Crcs;
use super::journal::{self, DoneRecord, FileRecord, Journal, PartRecord, Record, RootRecord};
use super::manifest::{self, Manifest, ManifestFile, NoticeInfo, Origin, Timings, VerifiedBy};
use super::metrics::UploadMetrics;
use super::pool::{Lease, Pool};
use super::staged::{StagedFile, StagedTree};
use super::target::Target;
use super::{Error, Outcome};
use crate::fsutil::{AtomicFile, Durability};
use crate::store::checksum::StoreChecksum;
use crate::store::progress::Progress;

/// The most parts a multipart upload may have (S3 and GCS).
const MAX_PARTS: u64 = 10_000;
/// The smallest part S3 and GCS accept (all but the last).
pub const MIN_PART_SIZE: u64 = 5 << 20;

/// Tunables of an upload.
#[derive(Clone, Debug)]
pub struct Options {
    /// Requests (and part-sized buffers) in flight.
    pub concurrency: usize,
    /// Files up to this size are one `PUT`; larger ones are sent in parts of this size (raised
    /// for files that would need more than 10 000 parts, with fewer buffers to keep the memory).
    pub part_size: u64,
    /// When the upload stops, publishing nothing (`deadline − drain reserve`).
    pub deadline: Option<tokio::time::Instant>,
    /// Where the journal lives (resume after a restart); none: no resume.
    pub state_dir: Option<std::path::PathBuf>,
    /// How often progress is logged.
    pub log_every: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            concurrency: 8,
            part_size: 8 << 20,
            deadline: None,
            state_dir: None,
            log_every: Duration::from_secs(5),
        }
    }
}

/// What the manifest says besides the files.
#[derive(Clone, Debug, Default)]
pub struct Meta {
    /// The checkpoint's name (its directory under the location).
    pub name: String,
    pub step: Option<u64>,
    /// This node's share of a checkpoint several nodes save (its manifest is then
    /// `manifest.part-<i>-of-<n>.json`).
    pub part: Option<manifest::Part>,
    pub notice: Option<NoticeInfo>,
    pub origin: Origin,
    /// When the trainer's ack was seen.
    pub acked_at: Option<Timestamp>,
    /// Whose checkpoint this is: the location's owner marker must name it (created if there is
    /// none) before anything is sent. `None`: an upload resumed after a restart (its first run
    /// claimed the location): the marker's writer.
    pub writer: Option<super::owner::Writer>,
}

/// One upload.
pub struct Job {
    pub tree: StagedTree,
    pub target: Target,
    pub meta: Meta,
    /// How the tree was captured (recorded in the journal for a restarted uploader).
    pub root: RootRecord,
    pub options: Options,
    pub progress: Arc<Progress>,
    pub metrics: Option<Arc<UploadMetrics>>,
    pub cancel: CancellationToken,
}

/// How an upload ended.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Report {
    pub outcome: Outcome,
    /// The checkpoint's directory.
    pub destination: String,
    pub files: usize,
    pub bytes: u64,
    /// Bytes sent by this run.
    pub bytes_sent: u64,
    /// Bytes an earlier run had sent (resumed).
    pub bytes_resumed: u64,
    pub seconds: f64,
    /// Bytes per second of this run.
    pub rate_bps: u64,
    /// The published manifest.
    #[serde(skip)]
    pub manifest: Option<Manifest>,
    pub error: Option<String>,
    /// The error's metric label.
    pub error_label: Option<&'static str>,
}

/// What the tasks of a run share.
struct Shared {
    target: Target,
    journal: Option<Journal>,
    progress: Arc<Progress>,
    metrics: Option<Arc<UploadMetrics>>,
    stop: CancellationToken,
    error: Mutex<Option<Error>>,
    /// Per file (index into the tree): done record once whole at the destination.
    done: Mutex<BTreeMap<usize, DoneRecord>>,
    /// Multipart uploads open: path → id (aborted when the run gives up).
    open: Mutex<BTreeMap<String, String>>,
    sent: std::sync::atomic::AtomicU64,
}

impl Shared {
    fn fail(&self, e: Error) {
        let mut slot = crate::sync::lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stop.cancel();
    }

    fn sent(&self, n: u64) {
        self.sent.fetch_add(n, Ordering::Relaxed);
        Progress::add(&self.progress.bytes_done, n);
        if let Some(m) = &self.metrics {
            m.bytes.inc_by(n);
            m.pending_bytes.dec_by(n as i64);
        }
    }

    fn file_done(&self, idx: usize, path: &str, done: DoneRecord) {
        crate::sync::lock(&self.done).insert(idx, done);
        crate::sync::lock(&self.open).remove(path);
        Progress::add(&self.progress.files_done, 1);
        let counter = match done.verified_by {
            VerifiedBy::Crc64Nvme => &self.progress.verified_crc64nvme,
            VerifiedBy::Crc32c => &self.progress.verified_crc32c,
            VerifiedBy::Size | VerifiedBy::Written => &self.progress.verified_size,
        };
        Progress::add(counter, 1);
        if let Some(m) = &self.metrics {
            m.files.inc();
        }
        if let Some(j) = &self.journal {
            j.update(|r| {
                if let Some(f) = r.files.get_mut(path) {
                    f.done = Some(done);
                    f.parts.clear();
                    f.upload_id = None;
                }
            });
        }
    }
}

/// The part size for a file of `size` bytes: the configured one, or larger when the file would
/// need more than 10 000 parts (rounded up to MiB).
fn part_size_for(size: u64, configured: u64) -> u64 {
    let needed = size.div_ceil(MAX_PARTS).div_ceil(1 << 20) << 20;
    configured.max(needed)
}

/// Compare what the store reports with what was read.
fn verify(
    key: &str,
    ours: Crcs,
    store: Option<StoreChecksum>,
    size: Option<u64>,
) -> Result<VerifiedBy, Error> {
    match store {
        Some(StoreChecksum::Crc64Nvme(v)) if v == ours.crc64nvme => Ok(VerifiedBy::Crc64Nvme),
        Some(StoreChecksum::Crc64Nvme(v)) => Err(Error::ChecksumMismatch {
            key: key.to_string(),
            algorithm: "CRC-64/NVME",
            expected: manifest::hex64(v),
            got: manifest::hex64(ours.crc64nvme),
        }),
        Some(StoreChecksum::Crc32c(v)) if v == ours.crc32c => Ok(VerifiedBy::Crc32c),
        Some(StoreChecksum::Crc32c(v)) => Err(Error::ChecksumMismatch {
            key: key.to_string(),
            algorithm: "CRC-32C",
            expected: manifest::hex32(v),
            got: manifest::hex32(ours.crc32c),
        }),
        // CRC32 / SHA-256 would come from another uploader's headers: not ours to compare.
        _ => match size {
            Some(s) if s == ours.len => Ok(VerifiedBy::Size),
            Some(s) => Err(Error::SizeMismatch {
                key: key.to_string(),
                expected: ours.len,
                got: s,
            }),
            None => Ok(VerifiedBy::Size),
        },
    }
}

/// Read `len` bytes at `offset` into the lease, with their CRCs; the page cache behind the read
/// is dropped (the agent's cgroup is not charged with the checkpoint).
fn read_part(file: &StagedFile, lease: &mut Lease, offset: u64, len: usize) -> Result<Crcs, Error> {
    let buf = lease.fill(len);
    file.file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Changed {
                path: file.path.clone(),
                what: "shorter than when it was staged".into(),
            }
        } else {
            Error::io("read", file.path.clone())(e)
        }
    })?;
    let crcs = Crcs::of(buf);
    if let Some(n) = std::num::NonZeroU64::new(len as u64) {
        let _ = rustix::fs::fadvise(&*file.file, offset, Some(n), rustix::fs::Advice::DontNeed);
    }
    Ok(crcs)
}

/// A large file in flight.
struct Large {
    idx: usize,
    file: StagedFile,
    part_size: u64,
    count: usize,
    parts: Mutex<Vec<Option<PartRecord>>>,
    remaining: AtomicUsize,
    sink: LargeSink,
}

enum LargeSink {
    Store {
        upload_id: String,
    },
    Dir {
        tmp: Mutex<Option<Arc<AtomicFile<Arc<OwnedFd>>>>>,
    },
}

impl Large {
    fn range(&self, part: usize) -> (u64, usize) {
        let offset = part as u64 * self.part_size;
        let len = self.part_size.min(self.file.id.size - offset);
        (offset, len as usize)
    }
}

/// Run one upload to its end.
pub async fn run(job: Job) -> Report {
    let started = Instant::now();
    let started_at = Timestamp::now();
    let destination = job.target.display().to_string();
    let files = job.tree.files.len();
    let bytes = job.tree.bytes;
    if let Some(m) = &job.metrics {
        m.active.inc();
        m.pending_bytes.inc_by(bytes as i64);
    }
    let metrics = job.metrics.clone();
    let progress = job.progress.clone();
    Progress::add(&progress.files_total, files as u64);
    Progress::add(&progress.bytes_total, bytes);
    progress
        .listed
        .store(true, std::sync::atomic::Ordering::Relaxed);
    info!(
        destination = %destination,
        staged = %job.tree.display,
        files,
        bytes,
        deadline_in_s = job.options.deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64()),
        "uploading staged checkpoint"
    );
    let result = upload(job, started_at).await;
    let seconds = started.elapsed().as_secs_f64();
    let (outcome, manifest, error, sent, resumed) = match result {
        Ok(done) => (
            done.outcome,
            Some(done.manifest),
            None,
            done.sent,
            done.resumed,
        ),
        Err((e, sent, resumed)) => (e.outcome(), None, Some(e), sent, resumed),
    };
    if let Some(m) = &metrics {
        m.active.dec();
        m.pending_bytes
            .dec_by(bytes.saturating_sub(sent + resumed) as i64);
        m.ended(outcome.as_str(), seconds);
        if let Some(e) = &error {
            m.error(e.metric_label());
        }
    }
    let rate_bps = if seconds > 0.0 {
        (sent as f64 / seconds) as u64
    } else {
        0
    };
    match &error {
        None => info!(
            destination = %destination,
            outcome = outcome.as_str(),
            files,
            bytes,
            bytes_sent = sent,
            bytes_resumed = resumed,
            seconds,
            rate_bps,
            "checkpoint upload finished"
        ),
        Some(e) => warn!(
            destination = %destination,
            outcome = outcome.as_str(),
            error = %e,
            bytes_sent = sent,
            seconds,
            "checkpoint upload did not publish"
        ),
    }
    Report {
        outcome,
        destination,
        files,
        bytes,
        bytes_sent: sent,
        bytes_resumed: resumed,
        seconds,
        rate_bps,
        manifest,
        error_label: error.as_ref().map(|e| e.metric_label()),
        error: error.map(|e| e.to_string()),
    }
}

struct Done {
    outcome: Outcome,
    manifest: Manifest,
    sent: u64,
    resumed: u64,
}

type Failed = (Error, u64, u64);

async fn upload(job: Job, started_at: Timestamp) -> Result<Done, Failed> {
    let Job {
        tree,
        target,
        meta,
        root,
        options,
        progress,
        metrics,
        cancel,
    } = job;
    let started = Instant::now();
    let total = tree.bytes;
    let fail0 = |e: Error| (e, 0, 0);

    // The location is this writer's (its owner marker), or nothing is sent.
    let writer = target.claim(meta.writer.as_ref()).await.map_err(fail0)?;

    // A checkpoint is never overwritten: an existing manifest must describe this very content.
    let manifest_file = manifest::manifest_file(meta.part);
    if let Some(existing) = read_manifest(&target, &manifest_file)
        .await
        .map_err(fail0)?
    {
        let existing = Manifest::parse(&existing, &meta.name, meta.part).map_err(|reason| {
            fail0(Error::Manifest {
                key: format!("{}/{manifest_file}", target.display()),
                reason: format!("an unreadable manifest is already there: {reason}"),
            })
        })?;
        return already_published(&tree, existing, &target)
            .await
            .map_err(fail0);
    }

    // The journal: resume what an earlier run of this upload left, or start one.
    let (journal, resumed_from) = match &options.state_dir {
        None => (None, None),
        Some(dir) => {
            let key = format!("{}#{manifest_file}", target.display());
            let (j, prev) = open_journal(dir, &key, &tree, &target, &root, &options, started_at)
                .await
                .map_err(fail0)?;
            j.update(|r| {
                r.name = meta.name.clone();
                r.step = meta.step;
                r.part = meta.part;
            });
            (Some(j), prev)
        }
    };
    let resumed = resumed_from.is_some();
    if let Target::Dir(d) = &target {
        let names: HashSet<&str> = tree.files.iter().map(|f| f.path.as_str()).collect();
        d.remove_stale_temps(&names);
    }

    let shared = Arc::new(Shared {
        target,
        journal,
        progress: progress.clone(),
        metrics,
        stop: cancel.child_token(),
        error: Mutex::new(None),
        done: Mutex::new(BTreeMap::new()),
        open: Mutex::new(BTreeMap::new()),
        sent: std::sync::atomic::AtomicU64::new(0),
    });
    // The journal is on disk before anything is sent.
    flush_journal(&shared).await.map_err(fail0)?;

    // Progress in the log while it runs; the journal written back every half second.
    let reporter = tokio::spawn(log_progress(
        progress.clone(),
        shared.target.display().to_string(),
        options.log_every,
        shared.stop.clone(),
    ));
    let flusher = shared.journal.as_ref().map(|_| {
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = s.stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                let s2 = s.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    if let Some(j) = &s2.journal {
                        if let Err(e) = j.flush() {
                            warn!(error = %e, "writing the upload journal failed");
                        }
                    }
                })
                .await;
            }
        })
    });

    let work = send_files(
        shared.clone(),
        Arc::new(tree),
        options.clone(),
        resumed_from,
    );
    let stopped: Result<Arc<StagedTree>, Error> = tokio::select! {
        r = work => r,
        _ = async {
            match options.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        } => Err(Error::Deadline { done: 0, total }),
        _ = cancel.cancelled() => Err(Error::Cancelled { done: 0, total }),
    };
    shared.stop.cancel();
    reporter.abort();
    if let Some(f) = flusher {
        let _ = f.await;
    }
    let sent = shared.sent.load(Ordering::Relaxed);
    let resumed_bytes = progress
        .bytes_resumed
        .load(std::sync::atomic::Ordering::Relaxed);
    let done_bytes = sent + resumed_bytes;

    let tree = match stopped {
        Ok(tree) => tree,
        Err(e) => {
            let e = match e {
                Error::Deadline { .. } => Error::Deadline {
                    done: done_bytes,
                    total,
                },
                Error::Cancelled { .. } => Error::Cancelled {
                    done: done_bytes,
                    total,
                },
                other => other,
            };
            give_up(&shared, &e).await;
            return Err((e, sent, resumed_bytes));
        }
    };

    // Every file is whole: sync (directories), then publish the manifest.
    let done = crate::sync::lock(&shared.done).clone();
    let manifest = Manifest {
        format: manifest::FORMAT.to_string(),
        name: meta.name.clone(),
        step: meta.step,
        part: meta.part,
        files: tree
            .files
            .iter()
            .enumerate()
            .filter_map(|(i, f)| {
                done.get(&i).map(|d| ManifestFile {
                    path: f.path.clone(),
                    size: f.id.size,
                    crc64nvme: manifest::hex64(d.crcs.crc64nvme),
                    crc32c: manifest::hex32(d.crcs.crc32c),
                    verified_by: d.verified_by,
                })
            })
            .collect(),
        file_count: tree.files.len(),
        bytes: tree.bytes,
        notice: meta.notice.clone(),
        origin: meta.origin.clone(),
        timings: Timings {
            acked_at: meta.acked_at.map(|t| t.to_string()),
            started_at: started_at.to_string(),
            completed_at: Timestamp::now().to_string(),
            upload_seconds: started.elapsed().as_secs_f64(),
            resumed,
        },
        spotguard_version: env!("CARGO_PKG_VERSION").to_string(),
        writer: writer.map(|w| w.to_string()),
    };
    if manifest.files.len() != tree.files.len() {
        let e = Error::Manifest {
            key: shared.target.display().to_string(),
            reason: "internal: a file is missing from the finished upload".into(),
        };
        give_up(&shared, &e).await;
        return Err((e, sent, resumed_bytes));
    }
    let data = manifest.to_bytes();
    let published = match &shared.target {
        Target::Store(s) => s.write_manifest(&manifest_file, data).await,
        Target::Dir(_) => {
            let s2 = shared.clone();
            tokio::task::spawn_blocking(move || match &s2.target {
                Target::Dir(d) => d
                    .sync_dirs()
                    .and_then(|()| d.write_manifest(&manifest_file, &data)),
                Target::Store(_) => Ok(()),
            })
            .await
            .unwrap_or_else(|e| Err(Error::io("publish", "manifest")(std::io::Error::other(e))))
        }
    };
    if let Err(e) = published {
        give_up(&shared, &e).await;
        return Err((e, sent, resumed_bytes));
    }
    if let Some(j) = &shared.journal {
        j.remove();
    }
    Ok(Done {
        outcome: Outcome::Published,
        manifest,
        sent,
        resumed: resumed_bytes,
    })
}

/// Write the journal back now (blocking thread).
async fn flush_journal(shared: &Arc<Shared>) -> Result<(), Error> {
    if shared.journal.is_none() {
        return Ok(());
    }
    let s = shared.clone();
    tokio::task::spawn_blocking(move || s.journal.as_ref().map(|j| j.flush()).unwrap_or(Ok(())))
        .await
        .map_err(|e| Error::io("journal", "flush")(std::io::Error::other(e)))?
}

async fn read_manifest(target: &Target, file: &str) -> Result<Option<Vec<u8>>, Error> {
    match target {
        Target::Store(s) => s.read_manifest(file).await,
        Target::Dir(d) => d.read_manifest(file),
    }
}

/// The destination already holds a manifest: the same content (same files, sizes and CRCs,
/// which are computed by reading the staged files) is "already published"; anything else is
/// [`Error::Exists`].
async fn already_published(
    tree: &StagedTree,
    existing: Manifest,
    target: &Target,
) -> Result<Done, Error> {
    let exists = || Error::Exists {
        dest: target.display().to_string(),
    };
    let same_shape = existing.files.len() == tree.files.len()
        && existing
            .files
            .iter()
            .zip(&tree.files)
            .all(|(m, f)| m.path == f.path && m.size == f.id.size);
    if !same_shape {
        return Err(exists());
    }
    let files: Vec<StagedFile> = tree.files.clone();
    let crcs = tokio::task::spawn_blocking(move || -> Result<Vec<Crcs>, Error> {
        let mut buf = vec![0u8; 1 << 20];
        files
            .iter()
            .map(|f| {
                let mut c = Crcs::empty();
                let mut off = 0;
                while off < f.id.size {
                    let n = (f.id.size - off).min(buf.len() as u64) as usize;
                    f.file
                        .read_exact_at(&mut buf[..n], off)
                        .map_err(Error::io("read", f.path.clone()))?;
                    c = c.then(Crcs::of(&buf[..n]));
                    off += n as u64;
                }
                f.id.check(&f.file, &f.path)?;
                Ok(c)
            })
            .collect()
    })
    .await
    .map_err(|e| Error::io("read", "staged files")(std::io::Error::other(e)))??;
    let same = existing.files.iter().zip(&crcs).all(|(m, c)| {
        m.crc64nvme == manifest::hex64(c.crc64nvme) && m.crc32c == manifest::hex32(c.crc32c)
    });
    if !same {
        return Err(exists());
    }
    Ok(Done {
        outcome: Outcome::AlreadyPublished,
        manifest: existing,
        sent: 0,
        resumed: 0,
    })
}

/// Load the journal of this destination and decide what of it can be reused; returns the
/// journal to keep and the earlier record when resuming. A journal of an earlier boot, another
/// staged directory or another root is abandoned; a file whose identity or part size changed
/// starts over. Every multipart upload the earlier journal or its side file names that the new
/// record does not reuse is aborted, an unreadable journal's included.
async fn open_journal(
    state_dir: &std::path::Path,
    key: &str,
    tree: &StagedTree,
    target: &Target,
    root: &RootRecord,
    options: &Options,
    started_at: Timestamp,
) -> Result<(Journal, Option<Record>), Error> {
    let path = journal::path_for(state_dir, key);
    let boot_id = crate::life::read_boot_id().unwrap_or_default();
    let destination = target.display().to_string();
    let p2 = path.clone();
    let (loaded, side) =
        tokio::task::spawn_blocking(move || (journal::load(&p2), journal::read_uploads(&p2)))
            .await
            .map_err(|e| Error::io("journal", "load")(std::io::Error::other(e)))?;
    let previous = match loaded {
        Ok(p) => p,
        Err(e) => {
            warn!(error = %e, uploads = side.len(), "an unreadable upload journal: starting over and aborting the uploads its side file names");
            None
        }
    };
    // Every upload an earlier run may have left open here (not those it completed).
    let completed = |path: &str| {
        previous
            .as_ref()
            .and_then(|p| p.files.get(path))
            .is_some_and(|f| f.done.is_some())
    };
    let mut known: Vec<(String, String)> = side
        .into_iter()
        .filter(|u| u.destination == destination && !completed(&u.path))
        .map(|u| (u.path, u.upload_id))
        .collect();
    if let Some(p) = &previous {
        known.extend(p.open_uploads());
    }
    let staged = tree.dir.display().to_string();
    let previous = match previous {
        Some(p)
            if p.boot_id == boot_id
                && p.destination == destination
                && p.staged == staged
                && &p.root == root =>
        {
            Some(p)
        }
        Some(p) => {
            info!(
                destination = %destination,
                previous_boot = %p.boot_id,
                "abandoning the journal of an earlier upload (another boot, staged directory or root)"
            );
            None
        }
        None => None,
    };
    let mut files = BTreeMap::new();
    for f in &tree.files {
        let part_size = part_size_for(f.id.size, options.part_size);
        let reuse = previous
            .as_ref()
            .and_then(|p| p.files.get(&f.path))
            .filter(|r| r.id == f.id && r.part_size == part_size);
        if reuse.is_none()
            && previous
                .as_ref()
                .is_some_and(|p| p.files.contains_key(&f.path))
        {
            info!(destination = %destination, file = %f.path, "the file changed since the interrupted run: it is sent again");
        }
        let record = match reuse {
            Some(r) => r.clone(),
            None => FileRecord {
                id: f.id,
                part_size,
                upload_id: None,
                parts: BTreeMap::new(),
                done: None,
            },
        };
        files.insert(f.path.clone(), record);
    }
    let keep: Vec<journal::OpenUpload> = files
        .iter()
        .filter(|(_, r)| r.done.is_none())
        .filter_map(|(p, r)| {
            r.upload_id.clone().map(|id| journal::OpenUpload {
                destination: destination.clone(),
                path: p.clone(),
                upload_id: id,
            })
        })
        .collect();
    known.sort();
    known.dedup();
    known.retain(|(p, id)| !keep.iter().any(|k| &k.path == p && &k.upload_id == id));
    abort_uploads(target, &known).await;
    let p2 = path.clone();
    let keep2 = keep.clone();
    tokio::task::spawn_blocking(move || journal::rewrite_uploads(&p2, &keep2))
        .await
        .map_err(|e| Error::io("journal", "rewrite")(std::io::Error::other(e)))??;
    let record = Record {
        version: journal::VERSION,
        boot_id,
        destination,
        staged,
        root: root.clone(),
        started_at: started_at.to_string(),
        files,
        name: String::new(),
        step: None,
        part: None,
        deadline: options.deadline.and_then(wall_clock),
    };
    let resumed_from = previous.map(|_| record.clone());
    Ok((Journal::new(path, record), resumed_from))
}

/// `deadline` as wall-clock time (RFC 3339), for the journal.
fn wall_clock(deadline: tokio::time::Instant) -> Option<String> {
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    Timestamp::now()
        .checked_add(left)
        .ok()
        .map(|t| t.to_string())
}

async fn abort_uploads(target: &Target, uploads: &[(String, String)]) {
    if let Target::Store(s) = target {
        for (path, id) in uploads {
            s.abort(path, id).await;
        }
    }
}

/// The run is over without a manifest. Deadline and errors: abort the multipart uploads and
/// forget the journal (nothing will resume them). Cancelled: keep both for the next run.
async fn give_up(shared: &Arc<Shared>, e: &Error) {
    if matches!(e, Error::Cancelled { .. }) {
        if let Some(j) = &shared.journal {
            if let Err(e) = flush_journal(shared).await {
                warn!(error = %e, "writing the upload journal failed");
            }
            info!(journal = %j.path().display(), "upload interrupted; the next run resumes it");
        }
        return;
    }
    let mut open: Vec<(String, String)> = crate::sync::lock(&shared.open)
        .iter()
        .map(|(p, id)| (p.clone(), id.clone()))
        .collect();
    if let Some(j) = &shared.journal {
        // Also those created but not yet in `open` (the run stopped right after the create).
        let (snapshot, jp) = (j.snapshot(), j.path().to_path_buf());
        let side = tokio::task::spawn_blocking(move || journal::read_uploads(&jp))
            .await
            .unwrap_or_default();
        let destination = shared.target.display().to_string();
        for u in side {
            let done = snapshot
                .files
                .get(&u.path)
                .is_some_and(|f| f.done.is_some());
            let pair = (u.path, u.upload_id);
            if u.destination == destination && !done && !open.contains(&pair) {
                open.push(pair);
            }
        }
    }
    abort_uploads(&shared.target, &open).await;
    if let Some(j) = &shared.journal {
        j.remove();
    }
}

/// Send every file; the tree back when all are whole at the destination.
async fn send_files(
    shared: Arc<Shared>,
    tree: Arc<StagedTree>,
    options: Options,
    resumed_from: Option<Record>,
) -> Result<Arc<StagedTree>, Error> {
    let largest = tree.files.iter().map(|f| f.id.size).max().unwrap_or(0);
    let buf_size = part_size_for(largest, options.part_size).max(options.part_size);
    // Bigger buffers for huge files: fewer of them, the same memory.
    let budget = options.concurrency as u64 * options.part_size;
    let count = (budget / buf_size).max(2) as usize;
    let pool = Pool::new(count, buf_size as usize);
    let mut tasks = JoinSet::new();
    let records = resumed_from.map(|r| r.files).unwrap_or_default();

    for (idx, file) in tree.files.iter().enumerate() {
        if shared.stop.is_cancelled() {
            break;
        }
        let record = records.get(&file.path);
        if let Some(done) = record.and_then(|r| r.done) {
            Progress::add(&shared.progress.bytes_resumed, file.id.size);
            Progress::add(&shared.progress.bytes_done, file.id.size);
            if let Some(m) = &shared.metrics {
                m.pending_bytes.dec_by(file.id.size as i64);
            }
            // Already whole at the destination: counted as done, not sent again.
            crate::sync::lock(&shared.done).insert(idx, done);
            Progress::add(&shared.progress.files_done, 1);
            continue;
        }
        if file.id.size <= options.part_size {
            let lease = tokio::select! {
                l = pool.lease() => l,
                _ = shared.stop.cancelled() => break,
            };
            let (s, f) = (shared.clone(), file.clone());
            tasks.spawn(async move {
                if let Err(e) = send_small(&s, idx, f, lease).await {
                    s.fail(e);
                }
            });
        } else {
            let large = match start_large(&shared, idx, file, &options, record).await {
                Ok(l) => Arc::new(l),
                Err(e) => {
                    shared.fail(e);
                    break;
                }
            };
            let todo: Vec<usize> = {
                let parts = crate::sync::lock(&large.parts);
                (0..large.count).filter(|i| parts[*i].is_none()).collect()
            };
            if todo.is_empty() {
                // Every part was sent by an earlier run: complete now.
                let (s, l) = (shared.clone(), large.clone());
                tasks.spawn(async move {
                    if let Err(e) = finish_large(&s, &l).await {
                        s.fail(e);
                    }
                });
            }
            for part in todo {
                let lease = tokio::select! {
                    l = pool.lease() => l,
                    _ = shared.stop.cancelled() => break,
                };
                let (s, l) = (shared.clone(), large.clone());
                tasks.spawn(async move {
                    if let Err(e) = send_part(&s, &l, part, lease).await {
                        s.fail(e);
                    }
                });
            }
        }
        // Reap finished tasks as we go (their errors are in `shared`).
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    if let Some(e) = crate::sync::lock(&shared.error).take() {
        return Err(e);
    }
    if shared.stop.is_cancelled() {
        // Stopped from outside (deadline or cancel): the caller's select reports which.
        std::future::pending::<()>().await;
    }
    Ok(tree)
}

/// A small file: read whole, check, one `PUT` (or one atomic write), verify.
async fn send_small(
    shared: &Arc<Shared>,
    idx: usize,
    file: StagedFile,
    mut lease: Lease,
) -> Result<(), Error> {
    let len = file.id.size as usize;
    let f2 = file.clone();
    let (lease, crcs) = tokio::task::spawn_blocking(move || {
        let crcs = read_part(&f2, &mut lease, 0, len)?;
        f2.id.check(&f2.file, &f2.path)?;
        Ok::<_, Error>((lease, crcs))
    })
    .await
    .map_err(|e| Error::io("read", file.path.clone())(std::io::Error::other(e)))??;
    let verified_by = match &shared.target {
        Target::Store(s) => {
            let key = s.key(&file.path)?.to_string();
            let from_put = s.put(&file.path, lease.freeze()).await?;
            match from_put {
                Some(sum) => verify(&key, crcs, Some(sum), None)?,
                None => {
                    let (size, sum) = s.head(&file.path).await?;
                    verify(&key, crcs, sum, Some(size))?
                }
            }
        }
        Target::Dir(_) => {
            let s2 = shared.clone();
            let path = file.path.clone();
            tokio::task::spawn_blocking(move || {
                let Target::Dir(d) = &s2.target else {
                    return Ok(());
                };
                let tmp = d.create(&path)?;
                tmp.write_all_at(lease.filled(), 0)
                    .map_err(Error::io("write", d.path_of(&path)))?;
                tmp.commit(Durability::File)
                    .map_err(Error::io("commit", d.path_of(&path)))
            })
            .await
            .map_err(|e| Error::io("write", file.path.clone())(std::io::Error::other(e)))??;
            VerifiedBy::Written
        }
    };
    shared.sent(file.id.size);
    shared.file_done(idx, &file.path, DoneRecord { crcs, verified_by });
    Ok(())
}

/// Set up a large file: the multipart upload (recorded, and the journal flushed, before any
/// part is sent) or the temp file; parts an earlier run sent are taken from its record.
async fn start_large(
    shared: &Arc<Shared>,
    idx: usize,
    file: &StagedFile,
    options: &Options,
    record: Option<&FileRecord>,
) -> Result<Large, Error> {
    let part_size = part_size_for(file.id.size, options.part_size);
    let count = file.id.size.div_ceil(part_size) as usize;
    let mut parts: Vec<Option<PartRecord>> = vec![None; count];
    let sink = match &shared.target {
        Target::Store(s) => {
            let reuse = record.and_then(|r| r.upload_id.clone().map(|id| (id, r.parts.clone())));
            let upload_id = match reuse {
                Some((id, done)) => {
                    for (i, p) in done {
                        if i < count {
                            let len = p.crcs.len;
                            parts[i] = Some(p);
                            Progress::add(&shared.progress.bytes_resumed, len);
                            Progress::add(&shared.progress.bytes_done, len);
                            if let Some(m) = &shared.metrics {
                                m.pending_bytes.dec_by(len as i64);
                            }
                        }
                    }
                    id
                }
                None => {
                    let id = s.create(&file.path).await?;
                    if let Some(j) = &shared.journal {
                        // Findable even if the journal itself is lost, before any part is sent.
                        let open = journal::OpenUpload {
                            destination: shared.target.display().to_string(),
                            path: file.path.clone(),
                            upload_id: id.clone(),
                        };
                        let jp = j.path().to_path_buf();
                        let appended =
                            tokio::task::spawn_blocking(move || journal::append_upload(&jp, &open))
                                .await
                                .map_err(|e| {
                                    Error::io("journal", "append")(std::io::Error::other(e))
                                })
                                .and_then(|r| r);
                        if let Err(e) = appended {
                            s.abort(&file.path, &id).await;
                            return Err(e);
                        }
                        j.update(|r| {
                            if let Some(f) = r.files.get_mut(&file.path) {
                                f.upload_id = Some(id.clone());
                                f.parts.clear();
                            }
                        });
                        flush_journal(shared).await?;
                    }
                    id
                }
            };
            crate::sync::lock(&shared.open).insert(file.path.clone(), upload_id.clone());
            LargeSink::Store { upload_id }
        }
        Target::Dir(d) => {
            let tmp = d.create(&file.path)?;
            tmp.set_len(file.id.size)
                .map_err(Error::io("allocate", d.path_of(&file.path)))?;
            LargeSink::Dir {
                tmp: Mutex::new(Some(Arc::new(tmp))),
            }
        }
    };
    let remaining = parts.iter().filter(|p| p.is_none()).count();
    Ok(Large {
        idx,
        file: file.clone(),
        part_size,
        count,
        parts: Mutex::new(parts),
        remaining: AtomicUsize::new(remaining),
        sink,
    })
}

/// One part: read, send (or write), record; the last part completes the file.
async fn send_part(
    shared: &Arc<Shared>,
    large: &Arc<Large>,
    part: usize,
    mut lease: Lease,
) -> Result<(), Error> {
    let (offset, len) = large.range(part);
    let record = match &large.sink {
        LargeSink::Store { upload_id } => {
            let f = large.file.clone();
            let (lease, crcs) = tokio::task::spawn_blocking(move || {
                let crcs = read_part(&f, &mut lease, offset, len)?;
                Ok::<_, Error>((lease, crcs))
            })
            .await
            .map_err(|e| Error::io("read", large.file.path.clone())(std::io::Error::other(e)))??;
            let Target::Store(s) = &shared.target else {
                return Ok(());
            };
            let etag = s
                .put_part(&large.file.path, upload_id, part, lease.freeze())
                .await?;
            PartRecord { etag, crcs }
        }
        LargeSink::Dir { tmp } => {
            let Some(tmp) = crate::sync::lock(tmp).clone() else {
                return Ok(());
            };
            let f = large.file.clone();
            let crcs = tokio::task::spawn_blocking(move || {
                let crcs = read_part(&f, &mut lease, offset, len)?;
                (**tmp)
                    .write_all_at(lease.filled(), offset)
                    .map_err(Error::io("write", f.path.clone()))?;
                Ok::<_, Error>(crcs)
            })
            .await
            .map_err(|e| Error::io("write", large.file.path.clone())(std::io::Error::other(e)))??;
            PartRecord {
                etag: String::new(),
                crcs,
            }
        }
    };
    shared.sent(len as u64);
    if let (Some(j), LargeSink::Store { .. }) = (&shared.journal, &large.sink) {
        let rec = record.clone();
        j.update(|r| {
            if let Some(f) = r.files.get_mut(&large.file.path) {
                f.parts.insert(part, rec);
            }
        });
    }
    crate::sync::lock(&large.parts)[part] = Some(record);
    if large.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
        finish_large(shared, large).await?;
    }
    Ok(())
}

/// Every part is in: combine the CRCs, check the file did not change, complete, verify.
async fn finish_large(shared: &Arc<Shared>, large: &Arc<Large>) -> Result<(), Error> {
    let parts: Vec<PartRecord> = crate::sync::lock(&large.parts)
        .iter()
        .map(|p| {
            p.clone().unwrap_or(PartRecord {
                etag: String::new(),
                crcs: Crcs::empty(),
            })
        })
        .collect();
    let crcs = parts.iter().fold(Crcs::empty(), |acc, p| acc.then(p.crcs));
    if crcs.len != large.file.id.size {
        return Err(Error::Changed {
            path: large.file.path.clone(),
            what: "parts do not add up to its size".into(),
        });
    }
    large.file.id.check(&large.file.file, &large.file.path)?;
    let verified_by = match (&large.sink, &shared.target) {
        (LargeSink::Store { upload_id }, Target::Store(s)) => {
            let key = s.key(&large.file.path)?.to_string();
            s.complete(
                &large.file.path,
                upload_id,
                parts.into_iter().map(|p| p.etag).collect(),
            )
            .await?;
            let (size, sum) = s.head(&large.file.path).await?;
            verify(&key, crcs, sum, Some(size))?
        }
        (LargeSink::Dir { tmp }, Target::Dir(d)) => {
            let tmp = crate::sync::lock(tmp).take();
            let path = d.path_of(&large.file.path);
            let tmp = tmp.and_then(Arc::into_inner).ok_or_else(|| {
                Error::io("commit", path.clone())(std::io::Error::other(
                    "internal: the file is still being written",
                ))
            })?;
            tokio::task::spawn_blocking(move || {
                tmp.commit(Durability::File)
                    .map_err(Error::io("commit", path))
            })
            .await
            .map_err(|e| {
                Error::io("commit", large.file.path.clone())(std::io::Error::other(e))
            })??;
            VerifiedBy::Written
        }
        _ => VerifiedBy::Written,
    };
    shared.file_done(
        large.idx,
        &large.file.path,
        DoneRecord { crcs, verified_by },
    );
    Ok(())
}

/// Log progress every `every` until `stop`.
async fn log_progress(
    progress: Arc<Progress>,
    destination: String,
    every: Duration,
    stop: CancellationToken,
) {
    let start = Instant::now();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let s = progress.snapshot();
        let secs = start.elapsed().as_secs_f64().max(0.001);
        info!(
            destination = %destination,
            bytes_done = s.bytes_done,
            bytes_total = s.bytes_total,
            files_done = s.files_done,
            files_total = s.files_total,
            rate_bps = ((s.bytes_done - s.bytes_resumed.min(s.bytes_done)) as f64 / secs) as u64,
            "checkpoint upload progress"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_sizes_grow_only_for_files_beyond_ten_thousand_parts() {
        assert_eq!(part_size_for(1 << 30, 8 << 20), 8 << 20);
        assert_eq!(part_size_for(80_000 << 20, 8 << 20), 8 << 20);
        assert_eq!(part_size_for(100_000 << 20, 8 << 20), 10 << 20);
    }

    #[test]
    fn verification_prefers_the_stores_checksum_then_the_size() {
        let c = Crcs::of(b"hello");
        assert_eq!(
            verify("k", c, Some(StoreChecksum::Crc64Nvme(c.crc64nvme)), None).unwrap(),
            VerifiedBy::Crc64Nvme
        );
        assert_eq!(
            verify("k", c, Some(StoreChecksum::Crc32c(c.crc32c)), Some(5)).unwrap(),
            VerifiedBy::Crc32c
        );
        assert!(matches!(
            verify("k", c, Some(StoreChecksum::Crc64Nvme(1)), None),
            Err(Error::ChecksumMismatch { .. })
        ));
        assert_eq!(verify("k", c, None, Some(5)).unwrap(), VerifiedBy::Size);
        assert!(matches!(
            verify("k", c, None, Some(4)),
            Err(Error::SizeMismatch { .. })
        ));
        assert_eq!(
            verify("k", c, Some(StoreChecksum::Sha256([0; 32])), Some(5)).unwrap(),
            VerifiedBy::Size
        );
    }
}
