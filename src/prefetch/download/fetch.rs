//! Requests: ranged GETs of an object's segments within the run's request slots, each response
//! checked to be of the version being assembled (If-Match and etag), short bodies and transient
//! failures resumed from the byte reached.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore};
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use super::options::Verify;
use super::part::{copy_local, stream_to_file};
use super::run::{Run, Stop};
use super::work::{Active, Listed, Segment};
use crate::prefetch::manifest::{etag_md5, normalize_etag};
use crate::prefetch::Error;
use crate::store::checksum::{ChecksumSlot, Hasher, StoreChecksum};
use crate::store::progress::Progress;
use crate::sync::lock;

/// Attempts per object for transient failures, on top of object_store's own retries.
pub(super) const OBJECT_ATTEMPTS: u32 = 3;

/// What [`fetch_missing`] learned: the hash of the bytes written (where it could be computed
/// while they streamed), the store's full-object checksum, and the etag the bytes belong to.
pub(super) struct Fetched {
    pub(super) inline: Option<Hasher>,
    pub(super) checksum: Option<StoreChecksum>,
    pub(super) etag: Option<String>,
}

/// Fetch the missing `segments` of `listed` into `file`: one request when a single segment is
/// missing (within the caller's request slot when it holds one), else parallel ranged GETs.
/// With `--verify checksum` the store's checksum is asked for and the bytes hashed as they
/// stream where that is possible.
pub(super) async fn fetch_missing(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    file: &Arc<File>,
    segments: &[Arc<Segment>],
    expected_etag: Option<String>,
    holding_slot: bool,
) -> Result<Fetched, Stop> {
    let size = listed.entry.size;
    let want = run.opts.verify == Verify::Checksum;
    let fresh = lock(&active.base_done).is_empty();
    let mut fetched = Fetched {
        inline: None,
        checksum: None,
        etag: expected_etag.clone(),
    };
    if size == 0 {
        // Nothing to fetch; the listing is the truth for an empty object.
    } else if segments.len() == 1 {
        // One request: the checksum comes with the response headers, the hash with the body.
        let seg = segments[0].clone();
        let single_stream = seg.start == 0 && seg.end == size;
        if want && !single_stream {
            // The rest of a resumed object: the checksum from a HEAD, the hash by reading back.
            fetched.checksum =
                head_checksum(run, listed, active, holding_slot, expected_etag.as_deref()).await?;
        }
        let fetch = fetch_segment(
            run,
            listed,
            active,
            &seg,
            file,
            expected_etag,
            SegmentHash::Choose(want && single_stream),
            None,
        );
        let out = if holding_slot {
            fetch.await?
        } else {
            with_request(run, active, fetch).await?
        };
        fetched.inline = out.hasher;
        fetched.checksum = out.checksum.or(fetched.checksum);
        fetched.etag = out.etag.or(fetched.etag);
    } else {
        // Ranged parts: ask for the checksum first (one HEAD), then hash each part and combine.
        if want {
            fetched.checksum =
                head_checksum(run, listed, active, false, expected_etag.as_deref()).await?;
        }
        let part_hasher = fetched.checksum.filter(|c| c.combinable() && fresh);
        let (inline, etag) = fetch_ranged(
            run,
            listed,
            active,
            file,
            segments,
            expected_etag,
            part_hasher,
        )
        .await?;
        fetched.inline = inline;
        fetched.etag = etag;
    }
    Ok(fetched)
}

/// Fetch `segments` as parallel ranged GETs, each within a request slot; the first failure
/// stops the others. Returns the combined hash of the parts (when `part_hasher` is given and
/// every part was hashed) and the etag the parts belong to (learned from the first response
/// when `expected_etag` is unknown).
async fn fetch_ranged(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    file: &Arc<File>,
    segments: &[Arc<Segment>],
    mut expected_etag: Option<String>,
    part_hasher: Option<StoreChecksum>,
) -> Result<(Option<Hasher>, Option<String>), Stop> {
    let object_stop = active.lost.child_token();
    let mut parts: JoinSet<Result<(u64, Option<Hasher>), Stop>> = JoinSet::new();
    let mut hashes: Vec<(u64, Option<Hasher>)> = Vec::new();
    let mut iter = segments.iter().cloned();
    // Without a known etag, the first response fixes it for the other parts (If-Match).
    if expected_etag.is_none() {
        if let Some(first) = iter.next() {
            let h = SegmentHash::Given(part_hasher.map(|c| c.hasher()));
            expected_etag = first_part(run, listed, active, file, first, h, &mut parts).await?;
        }
    }
    let mut first_err: Option<Stop> = None;
    let share = run.opts.parts_per_object.max(1);
    let mut iter = iter.peekable();
    while let Some(seg) = iter.peek().cloned() {
        // Reap finished parts so that a failure stops the rest early.
        while let Some(res) = parts.try_join_next() {
            settle(res, &mut hashes, &mut first_err, &object_stop);
        }
        if first_err.is_some() {
            break;
        }
        let permit = if parts.len() < share {
            match acquire_request(run, active).await {
                Ok(p) => p,
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        } else {
            // Beyond its share, an object takes only a slot nobody waits for (the semaphore
            // hands a released slot to a waiter first): a lone large object still uses every
            // free slot, one listed before many small ones leaves them theirs.
            match run.requests.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(tokio::sync::TryAcquireError::Closed) => {
                    first_err = Some(Stop::Aborted);
                    break;
                }
                Err(tokio::sync::TryAcquireError::NoPermits) => {
                    // Wait for one of its own parts to end, then ask again.
                    if let Some(res) = parts.join_next().await {
                        settle(res, &mut hashes, &mut first_err, &object_stop);
                    }
                    continue;
                }
            }
        };
        iter.next();
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
        settle(res, &mut hashes, &mut first_err, &object_stop);
    }
    if let Some(e) = first_err {
        // A part stopped because a sibling failed: report the sibling's cause.
        return Err(e);
    }
    let inline = if part_hasher.is_some() && hashes.len() == segments.len() {
        combine(hashes)
    } else {
        None
    };
    Ok((inline, expected_etag))
}

/// The hash of the whole object from its parts' (by start offset); none when a part has none.
fn combine(mut hashes: Vec<(u64, Option<Hasher>)>) -> Option<Hasher> {
    hashes.sort_by_key(|(start, _)| *start);
    hashes
        .into_iter()
        .map(|(_, h)| h)
        .try_fold(None::<Hasher>, |acc, h| match (acc, h) {
            (None, Some(h)) => Some(Some(h)),
            (Some(a), Some(h)) => a.combine(h).map(Some),
            (_, None) => None,
        })
        .flatten()
}

/// Start the first part of an object whose etag is unknown; the etag of its response (none when
/// it failed before its headers: its error is in `parts` then).
async fn first_part(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    file: &Arc<File>,
    first: Arc<Segment>,
    h: SegmentHash,
    parts: &mut JoinSet<Result<(u64, Option<Hasher>), Stop>>,
) -> Result<Option<String>, Stop> {
    let permit = acquire_request(run, active).await?;
    let (tx, rx) = oneshot::channel();
    let (r, l, a, f) = (run.clone(), listed.clone(), active.clone(), file.clone());
    parts.spawn(async move {
        let res = fetch_segment(&r, &l, &a, &first, &f, None, h, Some(tx)).await;
        drop(permit);
        res.map(|o| (first.start, o.hasher))
    });
    Ok(rx.await.unwrap_or(None))
}

/// HEAD with the checksum asked for: the object's full checksum (if the store keeps one). The
/// object must still be the version being assembled (`expected_etag`, when known).
async fn head_checksum(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    holding_slot: bool,
    expected_etag: Option<&str>,
) -> Result<Option<StoreChecksum>, Stop> {
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
            if let (Some(want), Some(got)) = (expected_etag, &r.meta.e_tag) {
                if normalize_etag(want) != normalize_etag(got) {
                    return Err(Stop::Err(Error::Changed { key: key.clone() }));
                }
            }
            Ok(slot.get())
        }
        Err(object_store::Error::NotFound { .. }) => {
            Err(Stop::Err(Error::Changed { key: key.clone() }))
        }
        Err(e) => Err(Stop::Err(Error::get(key, e))),
    }
}

/// How a segment is hashed: a given hasher (ranged parts), or chosen from the response (a
/// whole-object GET: the store's checksum if it sent one, else MD5 for a plain-MD5 etag).
pub(super) enum SegmentHash {
    Given(Option<Hasher>),
    Choose(bool),
}

/// What [`fetch_segment`] learned.
pub(super) struct SegmentOut {
    pub(super) hasher: Option<Hasher>,
    pub(super) etag: Option<String>,
    pub(super) checksum: Option<StoreChecksum>,
}

/// One ended part of [`fetch_ranged`]: its hash kept, or its failure the object's first (which
/// stops the other parts).
fn settle(
    res: Result<Result<(u64, Option<Hasher>), Stop>, tokio::task::JoinError>,
    hashes: &mut Vec<(u64, Option<Hasher>)>,
    first_err: &mut Option<Stop>,
    object_stop: &tokio_util::sync::CancellationToken,
) {
    match part_result(res) {
        Ok(Some(h)) => hashes.push(h),
        Ok(None) => {}
        Err(e) => {
            if first_err.is_none() {
                object_stop.cancel();
                *first_err = Some(e);
            }
        }
    }
}

pub(super) fn part_result(
    res: Result<Result<(u64, Option<Hasher>), Stop>, tokio::task::JoinError>,
) -> Result<Option<(u64, Option<Hasher>)>, Stop> {
    match res {
        Ok(Ok(h)) => Ok(Some(h)),
        Ok(Err(Stop::Aborted)) => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Stop::Err(Error::Internal("part task panicked"))),
    }
}

pub(super) async fn acquire_request(
    run: &Run,
    active: &Active,
) -> Result<tokio::sync::OwnedSemaphorePermit, Stop> {
    tokio::select! {
        _ = run.abort.cancelled() => Err(run.stopped().unwrap_or(Stop::Aborted)),
        _ = active.lost.cancelled() => Err(Stop::Lost),
        p = run.requests.clone().acquire_owned() => p.map_err(|_| Stop::Aborted),
    }
}

pub(super) async fn with_request<T>(
    run: &Run,
    active: &Active,
    fut: impl std::future::Future<Output = Result<T, Stop>>,
) -> Result<T, Stop> {
    let permit = acquire_request(run, active).await?;
    let out = fut.await;
    drop(permit);
    out
}

/// Every response must be of the version being assembled (servers that ignore If-Match
/// included) and of the listed size. The first etag seen becomes the expected one, recorded in
/// the claim so that a resumer can check it.
fn same_version(
    key: &str,
    size: u64,
    active: &Active,
    expected: &mut Option<String>,
    meta: &object_store::ObjectMeta,
) -> Result<(), Stop> {
    let changed = || {
        Stop::Err(Error::Changed {
            key: key.to_string(),
        })
    };
    let etag = meta.e_tag.clone();
    match (&*expected, &etag) {
        (Some(want), Some(got)) if normalize_etag(want) != normalize_etag(got) => {
            return Err(changed())
        }
        (None, Some(_)) => {
            *expected = etag.clone();
            if active.claim.is_some() {
                lock(&active.record)
                    .etag
                    .get_or_insert_with(|| etag.clone().unwrap_or_default());
            }
        }
        _ => {}
    }
    if meta.size != size {
        return Err(changed());
    }
    Ok(())
}

/// The hash of a whole-object GET: the store's checksum, else MD5 when the etag is a plain MD5.
fn pick_hash(checksum: Option<StoreChecksum>, etag: Option<&str>) -> Option<Hasher> {
    match checksum {
        Some(c) => Some(c.hasher()),
        None => etag.and_then(etag_md5).map(|_| Hasher::md5()),
    }
}

/// Fetch `seg` (from where it stands) into `file`. Retries transient failures from the byte
/// reached. Returns the hash state, the etag of the responses and the store's checksum (from a
/// whole-object response).
#[allow(clippy::too_many_arguments)]
pub(super) async fn fetch_segment(
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
        same_version(key, size, active, &mut expected, &res.meta)?;
        if let Some(tx) = headers_tx.take() {
            let _ = tx.send(expected.clone());
        }
        if choose && whole {
            // The first response of a whole-object GET picks the hash.
            checksum = slot.get();
            hasher = pick_hash(checksum, expected.as_deref());
        }
        // Resuming in the middle: no inline hash (the part file is read back).
        choose = false;
        let write = match res.payload {
            GetResultPayload::File(src, _) => {
                copy_local(run, active, seg, file, src, &listed.entry.key).await
            }
            GetResultPayload::Stream(stream) => {
                stream_to_file(run, active, seg, file, stream, &mut hasher, key).await
            }
        };
        after_write(write, seg, key, attempt)?;
    }
}

/// After one response's body: go on (from the byte reached, with attempts left: a short body or
/// a transient failure) or stop.
fn after_write(
    write: Result<(), Stop>,
    seg: &Segment,
    key: &str,
    attempt: u32,
) -> Result<(), Stop> {
    match write {
        Ok(()) => {
            let reached = seg.start + seg.written.load(Ordering::Acquire);
            if reached < seg.end && attempt >= OBJECT_ATTEMPTS {
                return Err(Stop::Err(Error::SizeMismatch {
                    key: key.to_string(),
                    expected: seg.end - seg.start,
                    got: reached - seg.start,
                }));
            }
            // Whole, or a short body: continue from where it stopped.
            Ok(())
        }
        Err(Stop::Err(e)) if e.is_retryable() && attempt < OBJECT_ATTEMPTS => {
            tracing::info!(key = %key, error = %e, "retrying from byte {}", seg.start + seg.written.load(Ordering::Acquire));
            Ok(())
        }
        Err(e) => Err(e),
    }
}
