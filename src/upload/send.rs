//! The multipart send code of one upload: the files turned into units of work, sent in
//! parallel under a bounded [`Pool`] of buffers, and each file completed and verified.
//!
//! One producer ([`send_files`]) walks the files in order and turns each into work — a small file
//! is one unit (read, `PUT`); a large one a multipart upload (created, recorded, then one unit per
//! part) — leasing a buffer from the [`Pool`] before each unit, which bounds both memory and the
//! requests in flight. Units run as tasks: the read (positioned, from the captured descriptor,
//! with both CRCs computed over the buffer and the page cache dropped behind it) on a blocking
//! thread, the request on the runtime. The unit that finishes a file's last part completes the
//! file: its CRCs combined in order, its identity checked again (changed under the upload ⇒ the
//! upload fails), the multipart upload completed or the temp file renamed, the store's checksum
//! compared, the journal told. The first error stops every unit ([`Shared::fail`]).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::crc::Crcs;
use super::engine::Options;
use super::journal::{self, DoneRecord, FileRecord, Journal, PartRecord, Record};
use super::manifest::{self, VerifiedBy};
use super::metrics::UploadMetrics;
use super::pool::{Lease, Pool};
use super::staged::{StagedFile, StagedTree};
use super::target::{StoreTarget, Target};
use super::Error;
use crate::fsutil::{AtomicFile, Durability};
use crate::store::checksum::StoreChecksum;
use crate::store::progress::Progress;

/// The most parts a multipart upload may have (S3 and GCS).
const MAX_PARTS: u64 = 10_000;
/// The smallest part S3 and GCS accept (all but the last).
pub const MIN_PART_SIZE: u64 = 5 << 20;

/// What the tasks of a run share.
pub(super) struct Shared {
    pub(super) target: Target,
    pub(super) journal: Option<Journal>,
    pub(super) progress: Arc<Progress>,
    pub(super) metrics: Option<Arc<UploadMetrics>>,
    pub(super) stop: CancellationToken,
    pub(super) error: Mutex<Option<Error>>,
    /// Per file (index into the tree): done record once whole at the destination.
    pub(super) done: Mutex<BTreeMap<usize, DoneRecord>>,
    /// Multipart uploads open: path → id (aborted when the run gives up).
    pub(super) open: Mutex<BTreeMap<String, String>>,
    pub(super) sent: std::sync::atomic::AtomicU64,
}

impl Shared {
    /// A run's shared state, nothing sent yet; `stop` ends every unit.
    pub(super) fn new(
        target: Target,
        journal: Option<Journal>,
        progress: Arc<Progress>,
        metrics: Option<Arc<UploadMetrics>>,
        stop: CancellationToken,
    ) -> Shared {
        Shared {
            target,
            journal,
            progress,
            metrics,
            stop,
            error: Mutex::new(None),
            done: Mutex::new(BTreeMap::new()),
            open: Mutex::new(BTreeMap::new()),
            sent: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The first error: kept, and every unit stopped.
    pub(super) fn fail(&self, e: Error) {
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

    /// `n` bytes are on their way to the store until the guard drops (answered or failed).
    fn in_flight(&self, n: u64) -> InFlight<'_> {
        Progress::add(&self.progress.bytes_in_flight, n);
        InFlight {
            progress: &self.progress,
            n,
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
pub(super) fn part_size_for(size: u64, configured: u64) -> u64 {
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

/// Write the journal back now (blocking thread).
pub(super) async fn flush_journal(shared: &Arc<Shared>) -> Result<(), Error> {
    if shared.journal.is_none() {
        return Ok(());
    }
    let s = shared.clone();
    tokio::task::spawn_blocking(move || s.journal.as_ref().map(|j| j.flush()).unwrap_or(Ok(())))
        .await
        .map_err(|e| Error::io("journal", "flush")(std::io::Error::other(e)))?
}

/// The units of a run, as tasks.
type Tasks = JoinSet<()>;

/// Send every file; the tree back when all are whole at the destination.
pub(super) async fn send_files(
    shared: Arc<Shared>,
    tree: Arc<StagedTree>,
    options: Options,
    resumed_from: Option<Record>,
) -> Result<Arc<StagedTree>, Error> {
    let pool = pool_for(&tree, &options);
    let mut tasks = JoinSet::new();
    let records = resumed_from.map(|r| r.files).unwrap_or_default();

    for (idx, file) in tree.files.iter().enumerate() {
        if shared.stop.is_cancelled() {
            break;
        }
        let record = records.get(&file.path);
        if let Some(done) = record.and_then(|r| r.done) {
            count_resumed_file(&shared, idx, file, done);
            continue;
        }
        if file.id.size <= options.part_size {
            queue_small(&shared, &pool, &mut tasks, idx, file).await;
        } else {
            queue_large(&shared, &pool, &mut tasks, idx, file, &options, record).await;
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

/// The run's buffers: `memory` of part-sized buffers for `concurrency` requests in flight.
fn pool_for(tree: &StagedTree, options: &Options) -> Arc<Pool> {
    let largest = tree.files.iter().map(|f| f.id.size).max().unwrap_or(0);
    let (count, size) = buffers_for(largest, options);
    Pool::with_requests(count, size, options.concurrency, super::budget::memory())
}

/// How many part-sized buffers, of what size, for a tree whose largest file is `largest`
/// bytes: as many as fit in `memory` (at least 2), bigger and fewer when a huge file needs
/// bigger parts.
fn buffers_for(largest: u64, options: &Options) -> (usize, usize) {
    let size = part_size_for(largest, options.part_size).max(options.part_size);
    ((options.memory / size).max(2) as usize, size as usize)
}

/// A file an earlier run finished: counted as done, not sent again.
fn count_resumed_file(shared: &Shared, idx: usize, file: &StagedFile, done: DoneRecord) {
    Progress::add(&shared.progress.bytes_resumed, file.id.size);
    Progress::add(&shared.progress.bytes_done, file.id.size);
    if let Some(m) = &shared.metrics {
        m.pending_bytes.dec_by(file.id.size as i64);
    }
    crate::sync::lock(&shared.done).insert(idx, done);
    Progress::add(&shared.progress.files_done, 1);
}

/// A small file as one unit, once a buffer is free (nothing when the run stops first).
async fn queue_small(
    shared: &Arc<Shared>,
    pool: &Arc<Pool>,
    tasks: &mut Tasks,
    idx: usize,
    file: &StagedFile,
) {
    let lease = tokio::select! {
        l = pool.lease_exact(file.id.size as usize) => l,
        _ = shared.stop.cancelled() => return,
    };
    let (s, f) = (shared.clone(), file.clone());
    tasks.spawn(async move {
        if let Err(e) = send_small(&s, idx, f, lease).await {
            s.fail(e);
        }
    });
}

/// A large file: its multipart upload set up, then one unit per part still to send, each once
/// a buffer is free; a file whose parts an earlier run sent is completed at once.
async fn queue_large(
    shared: &Arc<Shared>,
    pool: &Arc<Pool>,
    tasks: &mut Tasks,
    idx: usize,
    file: &StagedFile,
    options: &Options,
    record: Option<&FileRecord>,
) {
    let large = match start_large(shared, idx, file, options, record).await {
        Ok(l) => Arc::new(l),
        Err(e) => return shared.fail(e),
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
            _ = shared.stop.cancelled() => return,
        };
        let (s, l) = (shared.clone(), large.clone());
        tasks.spawn(async move {
            if let Err(e) = send_part(&s, &l, part, lease).await {
                s.fail(e);
            }
        });
    }
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
            let from_put = {
                let _flight = shared.in_flight(file.id.size);
                s.put(&file.path, lease.freeze()).await?
            };
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
                    take_resumed_parts(shared, &mut parts, done);
                    id
                }
                None => create_recorded(shared, s, file).await?,
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

/// The parts an earlier run sent of a multipart upload it left open: taken as sent (and
/// counted as resumed), those beyond the file's part count ignored.
fn take_resumed_parts(
    shared: &Shared,
    parts: &mut [Option<PartRecord>],
    done: BTreeMap<usize, PartRecord>,
) {
    for (i, p) in done {
        if i < parts.len() {
            let len = p.crcs.len;
            parts[i] = Some(p);
            Progress::add(&shared.progress.bytes_resumed, len);
            Progress::add(&shared.progress.bytes_done, len);
            if let Some(m) = &shared.metrics {
                m.pending_bytes.dec_by(len as i64);
            }
        }
    }
}

/// A new multipart upload, findable before any part is sent: appended to the journal's side
/// file and recorded in the journal, flushed (aborted if the side file cannot be written).
async fn create_recorded(
    shared: &Arc<Shared>,
    s: &StoreTarget,
    file: &StagedFile,
) -> Result<String, Error> {
    let id = s.create(&file.path).await?;
    let Some(j) = &shared.journal else {
        return Ok(id);
    };
    // Findable even if the journal itself is lost, before any part is sent.
    let open = journal::OpenUpload {
        destination: shared.target.display().to_string(),
        path: file.path.clone(),
        upload_id: id.clone(),
        namespace: j.namespace(),
    };
    let jp = j.path().to_path_buf();
    let appended = tokio::task::spawn_blocking(move || journal::append_upload(&jp, &open))
        .await
        .map_err(|e| Error::io("journal", "append")(std::io::Error::other(e)))
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
    Ok(id)
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
            let etag = {
                let _flight = shared.in_flight(len as u64);
                s.put_part(&large.file.path, upload_id, part, lease.freeze())
                    .await?
            };
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

/// Bytes counted in [`Progress::bytes_in_flight`] while a request is under way.
struct InFlight<'a> {
    progress: &'a Progress,
    n: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        Progress::sub(&self.progress.bytes_in_flight, self.n);
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

    /// Issue 35: the part buffers are a byte budget, not one per request: as many as fit in
    /// `memory` whatever the concurrency (two at least, so that reading overlaps sending), and
    /// fewer, bigger ones for a file that needs bigger parts.
    #[test]
    fn part_buffers_fit_the_memory_budget_whatever_the_concurrency() {
        let opts = |concurrency, memory| Options {
            concurrency,
            memory,
            part_size: 8 << 20,
            ..Options::default()
        };
        for concurrency in [1, 8, 64] {
            let (count, size) = buffers_for(1 << 30, &opts(concurrency, 32 << 20));
            assert_eq!((count, size), (4, 8 << 20), "concurrency {concurrency}");
        }
        let (count, size) = buffers_for(100_000 << 20, &opts(8, 64 << 20));
        assert_eq!((count, size), (6, 10 << 20));
        assert!(count * size <= 64 << 20);
        assert_eq!(buffers_for(1 << 30, &opts(8, 1 << 20)), (2, 8 << 20));
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
