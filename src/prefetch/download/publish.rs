//! Publishing: the part file's data is synced, then renamed into place; the directories are
//! synced before the manifest records the files, and their claims are released after it
//! (failpoints at each step for the tests).

use std::collections::HashSet;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::options::PublishStep;
use super::run::{blocking, Run};
use super::work::Listed;
use crate::prefetch::claim::Claim;
use crate::prefetch::manifest::{Manifest, Update};
use crate::prefetch::metrics::PrefetchMetrics;
use crate::prefetch::Error;
use crate::store::checksum::VerifiedBy;
use crate::store::progress::Progress;
use crate::sync::lock;

/// A downloaded, verified part file, not yet under its final name.
pub(super) struct Verified {
    /// The etag its bytes belong to.
    pub(super) etag: Option<String>,
    pub(super) file: Arc<File>,
    pub(super) part: PathBuf,
    pub(super) path: PathBuf,
    pub(super) verified_by: VerifiedBy,
}

/// Publish a verified file: its data is synced first, then it is renamed into place (so a file
/// under its final name is never one whose data may still be missing after a crash: on a node
/// crash an unsynced rename could leave a full-size, hole-filled file there); the directory is
/// synced before the manifest records it ([`flush`]). Syncs run off the request slots, up to
/// [`SYNCS_IN_FLIGHT`](super::run::SYNCS_IN_FLIGHT) at once, so the device's flushes overlap the downloads (no-ops on
/// tmpfs). Returns the etag.
pub(super) async fn publish(run: &Run, key: &str, v: Verified) -> Result<Option<String>, Error> {
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

/// A published object: count it and queue its manifest update (and the claim to release once
/// the manifest records it).
pub(super) fn record_done(
    run: &Run,
    listed: &Listed,
    etag: Option<String>,
    release: Option<Claim>,
) {
    let mut entry = listed.entry.clone();
    if entry.etag.is_none() {
        entry.etag = etag;
    }
    entry.done = true;
    if let Some(m) = &run.metrics {
        m.files
            .get_or_create(&PrefetchMetrics::dataset(&run.paths.name))
            .inc();
    }
    run.no_longer_pending(entry.size);
    Progress::add(&run.progress.files_done, 1);
    Progress::add(&run.progress.files_fetched, 1);
    run.push_update(Update::Done(entry), release);
}

/// Merge pending manifest updates (after making the published files durable), then release the
/// claims of the objects they cover.
pub(super) async fn flush(run: &Arc<Run>) -> Result<(), Error> {
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
    // The directories holding the renames, and the parents of directories this run created
    // above them (their entries are new too).
    let (dirs, created) = {
        let new_dirs = lock(&run.new_dirs);
        let mut dirs: HashSet<PathBuf> = HashSet::new();
        let mut created: HashSet<PathBuf> = HashSet::new();
        for u in &updates2 {
            let Update::Done(e) = u else { continue };
            let file = paths.file(&e.key);
            let Some(leaf) = file.parent() else { continue };
            dirs.insert(leaf.to_path_buf());
            for dir in leaf.ancestors() {
                if !new_dirs.contains(dir) {
                    continue;
                }
                created.insert(dir.to_path_buf());
                if let Some(parent) = dir.parent() {
                    dirs.insert(parent.to_path_buf());
                }
            }
        }
        (dirs, created)
    };
    let res = blocking(move || -> Result<(), (&'static str, PathBuf, io::Error)> {
        // The manifest only claims what is on stable storage: the files were synced before
        // their rename; sync the directories holding the renames and the new directories'
        // entries, deepest first (just those: never the whole filesystem, which may hold a
        // training job's checkpoints). A sync that fails (EIO) fails the flush: the manifest
        // does not name files whose directory entries may be lost.
        let mut dirs: Vec<PathBuf> = dirs.into_iter().collect();
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for dir in dirs {
            sync_dir(&dir).map_err(|e| ("sync directory", dir.clone(), e))?;
            if let Some(fp) = &failpoint {
                (fp.0)(PublishStep::DirSynced, &dir);
            }
        }
        Manifest::merge_into(&paths.manifest, &source, &updates2)
            .map_err(|e| ("update manifest", paths.manifest.clone(), e))?;
        for c in &claims {
            if let Err(e) = c.release(&owner) {
                tracing::warn!(claim = %c.path.display(), error = %e, "could not release claim");
            }
        }
        Ok(())
    })
    .await?;
    if res.is_ok() {
        let mut new_dirs = lock(&run.new_dirs);
        for d in &created {
            new_dirs.remove(d);
        }
    }
    if let Err((op, path, source)) = res {
        // Put the updates back for the next try; the claims stay held meanwhile.
        let mut p = lock(&run.pending);
        let mut back = updates;
        back.append(&mut p.0);
        p.0 = back;
        return Err(Error::Io { op, path, source });
    }
    Ok(())
}

/// fsync a directory. A filesystem that cannot sync directories at all (EINVAL) has nothing to
/// make durable this way; every other error (EIO above all) is returned.
fn sync_dir(dir: &Path) -> io::Result<()> {
    let d = File::open(dir)?;
    match d.sync_all() {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        other => other,
    }
}
