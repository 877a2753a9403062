//! The part file: byte ranges (what is written, what is missing), writing response bodies at
//! their offsets (batched `pwritev`, `copy_file_range` for `file://` sources), preallocation,
//! and removal.

use std::fs::{self, File};
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;

use super::run::{blocking, Run, Stop};
use super::work::{merge_ranges, Active, Listed, Segment};
use crate::prefetch::claim::ClaimRecord;
use crate::prefetch::manifest::normalize_etag;
use crate::prefetch::metrics::PrefetchMetrics;
use crate::prefetch::Error;
use crate::store::checksum::Hasher;
use crate::store::progress::Progress;
use crate::sync::lock;

/// Write batch: body chunks are gathered up to this many bytes and written with one `pwritev`.
const BATCH_BYTES: usize = 256 << 10;
/// At most this many chunks per `pwritev` (below `IOV_MAX`).
const BATCH_CHUNKS: usize = 512;

/// The parts of `[0, size)` not in `done`, split into pieces of at most `part`.
pub(super) fn missing_segments(done: &[[u64; 2]], size: u64, part: u64) -> Vec<(u64, u64)> {
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

/// The part file to write `listed` into, with the etag its bytes must belong to: this
/// process's own from an earlier attempt; a previous owner's when it holds the same version of
/// the object (its written ranges count as done, and the claim records them); else a new one,
/// preallocated when the object is fetched in ranged parts. A part file that cannot be resumed
/// is removed.
pub(super) async fn open_part(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    previous: Option<ClaimRecord>,
    part_path: &Path,
    final_path: &Path,
) -> Result<(Arc<File>, Option<String>), Stop> {
    let key = listed.entry.key.clone();
    let size = listed.entry.size;
    let listed_etag = listed.entry.etag.clone();
    let stale_part = previous.as_ref().map(|p| run.paths.dir.join(&p.part));
    let resumable = resumable(previous, size, &listed_etag);
    let mut expected_etag = listed_etag.clone();
    let existing_file = lock(&active.file).clone();
    // A retry within this process: same part file, same progress.
    if let Some(f) = existing_file {
        return Ok((f, expected_etag));
    }
    let resume = resumable.clone();
    let part = part_path.to_path_buf();
    let fin = final_path.to_path_buf();
    let run2 = run.clone();
    let k = key.clone();
    let stale = stale_part.filter(|_| resume.is_none());
    let (f, done) = blocking(move || {
        if let Some(old) = stale.filter(|old| *old != part) {
            let _ = fs::remove_file(old);
        }
        open_part_file(&run2, &k, size, &part, &fin, resume.as_ref())
    })
    .await
    .and_then(|r| r)?;
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
    record_start(run, active, &key, &expected_etag).await?;
    Ok((f, expected_etag))
}

/// A previous owner's claim whose part file holds bytes of the listed version of the object.
fn resumable(
    previous: Option<ClaimRecord>,
    size: u64,
    listed_etag: &Option<String>,
) -> Option<ClaimRecord> {
    previous.filter(|p| {
        p.size == size
            && !p.done.is_empty()
            && match (&p.etag, listed_etag) {
                (Some(a), Some(b)) => normalize_etag(a) == normalize_etag(b),
                (Some(_), None) => true,
                (None, _) => false,
            }
    })
}

/// Open the part file at `part`: `resume`'s (renamed to `part`) with the ranges it holds when it
/// is still there at full size, else a new one (preallocated when the object is fetched in
/// ranged parts). A part file that cannot be resumed is removed.
fn open_part_file(
    run: &Run,
    key: &str,
    size: u64,
    part: &Path,
    fin: &Path,
    resume: Option<&ClaimRecord>,
) -> Result<(File, Vec<[u64; 2]>), Error> {
    run.make_parent(fin)
        .map_err(|e| Error::io_for(key, "create directory", fin.to_path_buf(), e))?;
    if let Some(prev) = resume {
        let old = run.paths.dir.join(&prev.part);
        let ok = fs::metadata(&old).is_ok_and(|m| m.len() == size);
        if ok && (old == part || fs::rename(&old, part).is_ok()) {
            let f = File::options()
                .write(true)
                .read(true)
                .open(part)
                .map_err(|e| Error::io_for(key, "open part file", part.to_path_buf(), e))?;
            return Ok((f, prev.done.clone()));
        }
        let _ = fs::remove_file(&old);
    }
    let f = File::options()
        .write(true)
        .read(true)
        .create(true)
        .truncate(true)
        .open(part)
        .map_err(|e| Error::io_for(key, "create part file", part.to_path_buf(), e))?;
    if size > run.opts.part_size {
        preallocate(&f, size, !run.on_tmpfs.load(Ordering::Relaxed))
            .map_err(|e| Error::io_for(key, "preallocate", part.to_path_buf(), e))?;
    }
    Ok((f, Vec::new()))
}

/// Record the progress we start from (a takeover) or the etag we now expect in the claim. A
/// fresh claim already says all there is: no write. (Objects of a group have no claim of their
/// own.)
async fn record_start(
    run: &Run,
    active: &Active,
    key: &str,
    expected_etag: &Option<String>,
) -> Result<(), Stop> {
    let rec = {
        let mut rec = lock(&active.record);
        let done = active.done_ranges();
        let changed = rec.done != done || rec.etag != *expected_etag;
        rec.done = done;
        rec.etag = expected_etag.clone();
        rec.lease_until_ms = run.lease_until();
        changed.then(|| rec.clone())
    };
    let (Some(rec), Some(claim)) = (rec, active.claim.clone()) else {
        return Ok(());
    };
    let path = claim.path.clone();
    match blocking(move || claim.renew(&rec)).await {
        Ok(Ok(true)) => Ok(()),
        Ok(Ok(false)) => Err(Stop::Lost),
        Ok(Err(e)) => Err(Stop::Err(Error::io_for(key, "write claim", path, e))),
        Err(e) => Err(Stop::Err(e)),
    }
}

/// Remove our part file and forget its progress.
pub(super) async fn discard_part(run: &Run, active: &Active, part_rel: &str) {
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

/// A batch write on the blocking pool: its result, the hash state after it, its length.
type WriteJob = tokio::task::JoinHandle<(io::Result<()>, Option<Hasher>, u64)>;

/// Stream a body into `file` at the segment's position, in batches written with `pwritev` on
/// the blocking pool, one batch in flight while the next is received.
pub(super) async fn stream_to_file(
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
            inflight = Some(start_write(file.clone(), offset, chunks, hasher.take()));
            offset += len;
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

/// Write `chunks` at `at` on the blocking pool, hashing them once written.
fn start_write(f: Arc<File>, at: u64, chunks: Vec<Bytes>, mut h: Option<Hasher>) -> WriteJob {
    tokio::task::spawn_blocking(move || {
        let len = chunks.iter().map(|c| c.len() as u64).sum();
        let r = write_chunks(&f, at, &chunks);
        if r.is_ok() {
            if let Some(h) = h.as_mut() {
                for c in &chunks {
                    h.update(c);
                }
            }
        }
        (r, h, len)
    })
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
            count_written(run, seg, len);
            Ok(())
        }
        Err(e) => Err(part_error(run, key, "write", e)),
    }
}

/// `n` more bytes of `seg` are in the part file.
fn count_written(run: &Run, seg: &Segment, n: u64) {
    seg.written.fetch_add(n, Ordering::AcqRel);
    Progress::add(&run.progress.bytes_done, n);
    Progress::add(&run.progress.bytes_fetched, n);
    if let Some(m) = &run.metrics {
        m.bytes
            .get_or_create(&PrefetchMetrics::dataset(&run.paths.name))
            .inc_by(n);
    }
}

/// `op` failed on this process's part file of `key`.
fn part_error(run: &Run, key: &str, op: &'static str, e: io::Error) -> Stop {
    let part = run
        .paths
        .dir
        .join(run.paths.part_rel(key, &run.owner.tag()));
    Stop::Err(Error::io_for(key, op, part, e))
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
pub(super) async fn copy_local(
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
            Err(e) => return Err(part_error(run, key, "copy", e)),
        };
        count_written(run, seg, n);
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
pub(super) fn preallocate(f: &File, size: u64, reserve: bool) -> io::Result<()> {
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
