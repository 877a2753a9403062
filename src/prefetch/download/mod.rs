//! The download engine: the listing streams into a bounded pipeline; each object is claimed,
//! written with positioned I/O into a preallocated part file (large objects as parallel ranged
//! GETs), verified, renamed into place and recorded in the manifest.
//!
//! Memory is bounded by the number of requests in flight (`concurrency`) times the write batch
//! (at most two batches per request), whatever the dataset or object size: bodies are streamed,
//! never collected.
//!
//! Here: the run's lifecycle (set up, list and fetch, drop what the source deleted, the
//! `complete` marker) and its summary. Its parts, each importing only those listed after it:
//! - `plan`: from the listing to work (present objects skipped, room made, small objects grouped);
//! - `object`: one object or group under its claim: download, retry, checkpoint or discard;
//! - `fetch`: requests (slots, ranged GETs of the version being assembled, the checksum HEAD);
//! - `publish`: sync, rename, directory sync, then the manifest and the claims' release;
//! - `lease`: the claims held (progress recorded, renewed, checkpointed, released);
//! - `part`: the part file (ranges, opening or resuming it, writing bodies at their offsets);
//! - `verification`: checksum, MD5 etag or size before publishing;
//! - `run`: the state the tasks of a run share (errors, cancellation, pending updates);
//! - `work`: what the tasks pass each other (listed objects, groups, a download in progress and
//!   its byte ranges); `options`: what the caller asks ([`Job`], [`FetchOptions`], [`Verify`]).

mod fetch;
mod lease;
mod object;
mod options;
mod part;
mod plan;
mod publish;
mod run;
mod verification;
mod work;

#[cfg(test)]
pub(crate) mod tests;

pub use options::{Failpoint, FailpointFn, FetchOptions, Job, PublishStep, Verify};

use std::fs;
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use self::lease::renew_all;
use self::plan::produce;
use self::publish::flush;
use self::run::{blocking, Run};
use crate::prefetch::cache::{self, CompleteMarker};
use crate::prefetch::manifest::{Manifest, Update};
use crate::prefetch::metrics::PrefetchMetrics;
use crate::prefetch::Error;
use crate::store::progress::Snapshot;
use crate::sync::lock;

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

/// Run one dataset to completion, failure or cancellation.
pub async fn fetch_dataset(job: Job) -> Report {
    let started = Instant::now();
    let cache_root = job.cache_root.clone();
    let run = Arc::new(Run::new(job));
    if let Some(m) = &run.metrics {
        m.active.inc();
    }
    let evicted = drive(&run, &cache_root).await;
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
    let manifest = match set_up(run, cache_root).await {
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
        remove_files(run, removed).await;
    }

    let s = run.progress.snapshot();
    let complete = listed_keys.is_some()
        && run.stopped().is_none()
        && lock(&run.failures).is_empty()
        && s.files_done == s.files_total;
    if complete {
        mark_complete(run, &s).await;
    }
    evicted
}

/// Create the dataset directory (after cleaning up interrupted evictions in the cache) and
/// read its manifest; a directory holding another source is refused.
async fn set_up(run: &Arc<Run>, cache_root: &Path) -> Result<Manifest, Error> {
    let paths = run.paths.clone();
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
        let tmpfs =
            rustix::fs::statfs(&paths.dir).is_ok_and(|st| st.f_type == libc::TMPFS_MAGIC);
        r.on_tmpfs.store(tmpfs, Ordering::Relaxed);
        cache::check_source(&paths, &source)?;
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
}

/// Remove the files of objects deleted at the source (their manifest entries are gone).
async fn remove_files(run: &Run, removed: Vec<String>) {
    let p = run.paths.clone();
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
    tracing::info!(dataset = %run.paths.name, files = removed_count, "removed files deleted at the source");
}

/// Write the `complete` marker (and touch the lease when asked to); a failure ends the run.
async fn mark_complete(run: &Run, s: &Snapshot) {
    let marker = CompleteMarker {
        source: run.source.url.clone(),
        finished_at: jiff::Timestamp::now().to_string(),
        objects: s.files_total,
        bytes: s.bytes_total,
    };
    let touch = run.opts.touch_lease_on_complete;
    let p = run.paths.clone();
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
            path: run.paths.complete.clone(),
            source,
        }),
        Err(e) => run.set_fatal(e),
    }
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
