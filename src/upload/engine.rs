//! The upload of one captured checkpoint, from start to publication: the location claimed, an
//! existing manifest compared, the journal opened (resuming an earlier run: [`super::resume`]),
//! the files sent ([`super::send`]), then `manifest.json` written last.
//!
//! The run stops at the deadline (the caller passes `deadline − drain reserve`), on the first
//! error, or when cancelled. Only a run that has every file writes the manifest. A run stopped by
//! the deadline or an error aborts its multipart uploads and forgets its journal (the staged copy
//! will not outlive the notice); a cancelled one (the uploader itself is stopping) keeps both, so
//! that the next run resumes.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::crc::Crcs;
use super::journal::{Record, RootRecord};
use super::manifest::{self, Manifest, ManifestFile, NoticeInfo, Origin, Timings};
use super::metrics::UploadMetrics;
use super::resume::{self, give_up};
use super::send::{flush_journal, send_files, Shared};
use super::staged::{StagedFile, StagedTree};
use super::target::Target;
use super::{Error, Outcome};
use crate::store::progress::Progress;

pub use super::send::MIN_PART_SIZE;

/// Tunables of an upload.
#[derive(Clone, Debug)]
pub struct Options {
    /// Requests in flight (a small file's in a buffer of its own size, a part's in a
    /// part-sized one).
    pub concurrency: usize,
    /// Bytes of part-sized buffers: the parts in flight are `memory / part size`, at least 2.
    pub memory: u64,
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
            memory: 8 * (8 << 20),
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
    /// Set (by `super::handoff::race`) before `cancel` when a relay's peer published the
    /// checkpoint: the upload then ends [`Outcome::Relayed`], not `cancelled`.
    pub relayed: Arc<std::sync::atomic::AtomicBool>,
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
    /// The relay's peer that published this checkpoint instead of this upload
    /// (`upload::handoff`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relayed_to: Option<String>,
}
impl Report {
    /// A report of an upload that could not run.
    pub fn failed(destination: &str, error: String) -> Report {
        Report {
            outcome: Outcome::Failed,
            destination: destination.to_string(),
            files: 0,
            bytes: 0,
            bytes_sent: 0,
            bytes_resumed: 0,
            seconds: 0.0,
            rate_bps: 0,
            manifest: None,
            error: Some(error),
            error_label: Some("task"),
            relayed_to: None,
        }
    }

    /// This report, for a checkpoint a relay's `peer` published (`super::handoff`).
    pub fn relayed(self, peer: String) -> Report {
        Report {
            outcome: Outcome::Published,
            error: None,
            error_label: None,
            relayed_to: Some(peer),
            ..self
        }
    }
}

/// Run one upload to its end.
pub async fn run(job: Job) -> Report {
    let started = Instant::now();
    let started_at = Timestamp::now();
    let destination = job.target.display().to_string();
    let (files, bytes) = (job.tree.files.len(), job.tree.bytes);
    let metrics = job.metrics.clone();
    let relayed = job.relayed.clone();
    announce(&job, &destination);
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
        // Stopped because a relay's peer published it: not an error of this upload.
        Err((Error::Cancelled { .. }, sent, resumed))
            if relayed.load(std::sync::atomic::Ordering::SeqCst) =>
        {
            (Outcome::Relayed, None, None, sent, resumed)
        }
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
    let report = Report {
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
        error: None,
        relayed_to: None,
    };
    log_end(&report, error.as_ref());
    Report {
        error: error.map(|e| e.to_string()),
        ..report
    }
}

/// The upload begins: metrics and progress know its size, the log its deadline.
fn announce(job: &Job, destination: &str) {
    let (files, bytes) = (job.tree.files.len(), job.tree.bytes);
    if let Some(m) = &job.metrics {
        m.active.inc();
        m.pending_bytes.inc_by(bytes as i64);
    }
    let progress = &job.progress;
    Progress::add(&progress.files_total, files as u64);
    Progress::add(&progress.bytes_total, bytes);
    progress.listed.store(true, Ordering::Relaxed);
    info!(
        destination = %destination,
        staged = %job.tree.display,
        files,
        bytes,
        deadline_in_s = job.options.deadline.map(|d| d.saturating_duration_since(tokio::time::Instant::now()).as_secs_f64()),
        "uploading staged checkpoint"
    );
}

/// The upload's end in the log.
fn log_end(r: &Report, error: Option<&Error>) {
    match error {
        None => info!(
            destination = %r.destination,
            outcome = r.outcome.as_str(),
            files = r.files,
            bytes = r.bytes,
            bytes_sent = r.bytes_sent,
            bytes_resumed = r.bytes_resumed,
            seconds = r.seconds,
            rate_bps = r.rate_bps,
            "checkpoint upload finished"
        ),
        Some(e) => warn!(
            destination = %r.destination,
            outcome = r.outcome.as_str(),
            error = %e,
            bytes_sent = r.bytes_sent,
            seconds = r.seconds,
            "checkpoint upload did not publish"
        ),
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
        relayed: _,
    } = job;
    let started = Instant::now();
    let total = tree.bytes;
    let fail0 = |e: Error| (e, 0, 0);

    // The steps before the files are sent talk to the store too: each ends at the deadline or
    // the cancel (a peer's relay that published first) like the sending, a hung store or not.
    let stop = (&options, &cancel, total);

    // The location is this writer's (its owner marker), or nothing is sent.
    let writer = unless_stopped(target.claim(meta.writer.as_ref()), stop)
        .await
        .map_err(fail0)?;

    // A checkpoint is never overwritten: an existing manifest must describe this very content.
    let manifest_file = manifest::manifest_file(meta.part);
    if let Some(existing) = unless_stopped(existing_manifest(&target, &meta, &manifest_file), stop)
        .await
        .map_err(fail0)?
    {
        return already_published(&tree, existing, &target)
            .await
            .map_err(fail0);
    }

    // The journal: resume what an earlier run of this upload left, or start one.
    let (journal, resumed_from) = unless_stopped(
        resume::journal_for(
            &target,
            &manifest_file,
            &tree,
            &root,
            &meta,
            &options,
            started_at,
        ),
        stop,
    )
    .await
    .map_err(fail0)?;
    let resumed = resumed_from.is_some();
    remove_stale_temps(&target, &tree);

    let shared = Arc::new(Shared::new(
        target,
        journal,
        progress.clone(),
        metrics,
        cancel.child_token(),
    ));
    // The journal is on disk before anything is sent.
    flush_journal(&shared).await.map_err(fail0)?;

    let stopped = send_until_stopped(&shared, tree, &options, resumed_from, &cancel).await;
    let sent = shared.sent.load(Ordering::Relaxed);
    let resumed_bytes = progress.bytes_resumed.load(Ordering::Relaxed);
    let tree = match stopped {
        Ok(tree) => tree,
        Err(e) => {
            let e = with_progress(e, sent + resumed_bytes, total);
            give_up(&shared, &e).await;
            return Err((e, sent, resumed_bytes));
        }
    };

    // Every file is whole: sync (directories), then publish the manifest.
    let stamp = (writer, started_at, started, resumed);
    let manifest = manifest_of(&tree, &meta, &shared, stamp);
    let published = match publish(&shared, &tree, &manifest, &manifest_file).await {
        Ok(true) => Ok((Outcome::Published, manifest)),
        // Another writer's manifest came first (a peer's relay of this very checkpoint): the
        // same content is "already published"; anything else stays theirs.
        Ok(false) => match existing_manifest(&shared.target, &meta, &manifest_file).await {
            Ok(Some(existing)) if existing.same_content(&manifest) => {
                Ok((Outcome::AlreadyPublished, existing))
            }
            Ok(_) => Err(Error::Exists {
                dest: shared.target.display().to_string(),
            }),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    let (outcome, manifest) = match published {
        Ok(p) => p,
        Err(e) => {
            give_up(&shared, &e).await;
            return Err((e, sent, resumed_bytes));
        }
    };
    if let Some(j) = &shared.journal {
        j.remove();
    }
    Ok(Done {
        outcome,
        manifest,
        sent,
        resumed: resumed_bytes,
    })
}

/// A directory destination: the temp files an earlier run left of this tree's files go.
fn remove_stale_temps(target: &Target, tree: &StagedTree) {
    if let Target::Dir(d) = target {
        let names: HashSet<&str> = tree.files.iter().map(|f| f.path.as_str()).collect();
        d.remove_stale_temps(&names);
    }
}

/// The manifest already at the destination, parsed; `None` when there is none.
async fn existing_manifest(
    target: &Target,
    meta: &Meta,
    manifest_file: &str,
) -> Result<Option<Manifest>, Error> {
    let Some(existing) = read_manifest(target, manifest_file).await? else {
        return Ok(None);
    };
    Manifest::parse(&existing, &meta.name, meta.part)
        .map(Some)
        .map_err(|reason| Error::Manifest {
            key: format!("{}/{manifest_file}", target.display()),
            reason: format!("an unreadable manifest is already there: {reason}"),
        })
}

/// `step` (of a run of `total` bytes) unless the run's deadline or its cancel comes first: the
/// steps before the files are sent, and the sending itself ([`send_until_stopped`]).
async fn unless_stopped<T>(
    step: impl std::future::Future<Output = Result<T, Error>>,
    (options, cancel, total): (&Options, &CancellationToken, u64),
) -> Result<T, Error> {
    tokio::select! {
        r = step => r,
        _ = async {
            match options.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        } => Err(Error::Deadline { done: 0, total }),
        _ = cancel.cancelled() => Err(Error::Cancelled { done: 0, total }),
    }
}

/// Send the files until all are whole, the deadline, an error or the cancel; the progress
/// logger and the journal's writer (every half second) run meanwhile and are stopped after.
async fn send_until_stopped(
    shared: &Arc<Shared>,
    tree: StagedTree,
    options: &Options,
    resumed_from: Option<Record>,
    cancel: &CancellationToken,
) -> Result<Arc<StagedTree>, Error> {
    let total = tree.bytes;
    let reporter = tokio::spawn(log_progress(
        shared.progress.clone(),
        shared.target.display().to_string(),
        options.log_every,
        shared.stop.clone(),
    ));
    let flusher = shared
        .journal
        .as_ref()
        .map(|_| tokio::spawn(flush_every_half_second(shared.clone())));

    let work = send_files(
        shared.clone(),
        Arc::new(tree),
        options.clone(),
        resumed_from,
    );
    let stopped = unless_stopped(work, (options, cancel, total)).await;
    shared.stop.cancel();
    reporter.abort();
    if let Some(f) = flusher {
        let _ = f.await;
    }
    stopped
}

/// Write the journal back every half second until the run stops.
async fn flush_every_half_second(s: Arc<Shared>) {
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
}

/// A stop from outside with the bytes done by then.
fn with_progress(e: Error, done: u64, total: u64) -> Error {
    match e {
        Error::Deadline { .. } => Error::Deadline { done, total },
        Error::Cancelled { .. } => Error::Cancelled { done, total },
        other => other,
    }
}

/// What the manifest says of the run besides the files: the writer, when it started (wall
/// clock and monotonic), whether it resumed an earlier run.
type Stamp = (Option<super::owner::Writer>, Timestamp, Instant, bool);

/// The manifest of a finished run: every file whole at the destination, in the tree's order.
fn manifest_of(tree: &StagedTree, meta: &Meta, shared: &Shared, stamp: Stamp) -> Manifest {
    let (writer, started_at, started, resumed) = stamp;
    let done = crate::sync::lock(&shared.done).clone();
    Manifest {
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
    }
}

/// Write the manifest last (directories synced first), only if there is none: the checkpoint
/// is published. `Ok(false)`: another writer (a peer's relay of this very checkpoint, say)
/// published first; nothing was overwritten.
async fn publish(
    shared: &Arc<Shared>,
    tree: &StagedTree,
    manifest: &Manifest,
    manifest_file: &str,
) -> Result<bool, Error> {
    if manifest.files.len() != tree.files.len() {
        return Err(Error::Manifest {
            key: shared.target.display().to_string(),
            reason: "internal: a file is missing from the finished upload".into(),
        });
    }
    let data = manifest.to_bytes();
    match &shared.target {
        Target::Store(s) => s.write_manifest(manifest_file, data).await,
        Target::Dir(_) => {
            let s2 = shared.clone();
            let manifest_file = manifest_file.to_string();
            tokio::task::spawn_blocking(move || match &s2.target {
                Target::Dir(d) => d
                    .sync_dirs()
                    .and_then(|()| d.write_manifest(&manifest_file, &data)),
                Target::Store(_) => Ok(false),
            })
            .await
            .unwrap_or_else(|e| Err(Error::io("publish", "manifest")(std::io::Error::other(e))))
        }
    }
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
