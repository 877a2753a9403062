//! The upload's journal across runs: opened for a run (resuming what an earlier run of the same
//! upload left, abandoning what cannot be trusted), and at a run's end without a manifest either
//! kept for the next run (cancelled) or dropped with its multipart uploads aborted.
//!
//! A journal of an earlier boot, another staged directory or another root is abandoned; a file
//! whose identity or part size changed starts over. Every multipart upload the earlier journal
//! or its side file names that the new record does not reuse is aborted, an unreadable
//! journal's included.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use jiff::Timestamp;
use tracing::{info, warn};

use super::engine::{Meta, Options};
use super::journal::{self, FileRecord, Journal, OpenUpload, Record, RootRecord};
use super::send::{flush_journal, part_size_for, Shared};
use super::staged::StagedTree;
use super::target::Target;
use super::Error;

/// The run's journal when it keeps one (`state_dir`), with the earlier record it resumes.
pub(super) async fn journal_for(
    target: &Target,
    manifest_file: &str,
    tree: &StagedTree,
    root: &RootRecord,
    meta: &Meta,
    options: &Options,
    started_at: Timestamp,
) -> Result<(Option<Journal>, Option<Record>), Error> {
    let Some(dir) = &options.state_dir else {
        return Ok((None, None));
    };
    let key = format!("{}#{manifest_file}", target.display());
    let (j, prev) = open_journal(dir, &key, tree, target, root, options, started_at).await?;
    // The pod's namespace; a resumed upload (no pod) keeps the one its first run recorded.
    let namespace = meta
        .origin
        .pod
        .as_deref()
        .and_then(|p| p.split_once('/'))
        .map(|(ns, _)| ns.to_string())
        .or_else(|| prev.as_ref().and_then(|p| p.namespace.clone()));
    j.update(|r| {
        r.name = meta.name.clone();
        r.step = meta.step;
        r.part = meta.part;
        r.namespace = namespace;
    });
    Ok((Some(j), prev))
}

/// Load the journal of this destination and decide what of it can be reused; returns the
/// journal to keep and the earlier record when resuming.
async fn open_journal(
    state_dir: &Path,
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
    let staged = tree.dir.display().to_string();
    let (loaded, side) = load(&path).await?;
    let mut known = left_open(loaded.as_ref(), side, &destination);
    let previous = loaded.filter(|p| {
        let same = p.boot_id == boot_id
            && p.destination == destination
            && p.staged == staged
            && &p.root == root;
        if !same {
            info!(
                destination = %destination,
                previous_boot = %p.boot_id,
                "abandoning the journal of an earlier upload (another boot, staged directory or root)"
            );
        }
        same
    });
    let files = file_records(tree, previous.as_ref(), options, &destination);
    let namespace = previous.as_ref().and_then(|p| p.namespace.clone());
    let keep = still_open(&files, &destination, namespace.as_deref());
    known.sort();
    known.dedup();
    known.retain(|(p, id)| !keep.iter().any(|k| &k.path == p && &k.upload_id == id));
    abort_uploads(target, &known).await;
    let p2 = path.clone();
    tokio::task::spawn_blocking(move || journal::rewrite_uploads(&p2, &keep))
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
        namespace,
    };
    let resumed_from = previous.map(|_| record.clone());
    Ok((Journal::new(path, record), resumed_from))
}

/// The journal at `path` (none, or unreadable: none, and said so) and its side file's uploads.
async fn load(path: &Path) -> Result<(Option<Record>, Vec<OpenUpload>), Error> {
    let p2 = path.to_path_buf();
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
    Ok((previous, side))
}

/// Every upload an earlier run may have left open at `destination` (not those it completed):
/// its side file's and its journal's.
fn left_open(
    previous: Option<&Record>,
    side: Vec<OpenUpload>,
    destination: &str,
) -> Vec<(String, String)> {
    let completed = |path: &str| {
        previous
            .and_then(|p| p.files.get(path))
            .is_some_and(|f| f.done.is_some())
    };
    let mut known: Vec<(String, String)> = side
        .into_iter()
        .filter(|u| u.destination == destination && !completed(&u.path))
        .map(|u| (u.path, u.upload_id))
        .collect();
    if let Some(p) = previous {
        known.extend(p.open_uploads());
    }
    known
}

/// The new run's record of each file: the earlier run's where the file and its part size are
/// the same, a fresh one otherwise.
fn file_records(
    tree: &StagedTree,
    previous: Option<&Record>,
    options: &Options,
    destination: &str,
) -> BTreeMap<String, FileRecord> {
    let mut files = BTreeMap::new();
    for f in &tree.files {
        let part_size = part_size_for(f.id.size, options.part_size);
        let earlier = previous.and_then(|p| p.files.get(&f.path));
        let reuse = earlier.filter(|r| r.id == f.id && r.part_size == part_size);
        if reuse.is_none() && earlier.is_some() {
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
    files
}

/// The multipart uploads the new record reuses (open, of files not done).
fn still_open(
    files: &BTreeMap<String, FileRecord>,
    destination: &str,
    namespace: Option<&str>,
) -> Vec<OpenUpload> {
    files
        .iter()
        .filter(|(_, r)| r.done.is_none())
        .filter_map(|(p, r)| {
            r.upload_id.clone().map(|id| OpenUpload {
                namespace: namespace.map(str::to_string),
                destination: destination.to_string(),
                path: p.clone(),
                upload_id: id,
            })
        })
        .collect()
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
pub(super) async fn give_up(shared: &Arc<Shared>, e: &Error) {
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
