//! Requests: ranged GETs of an object's segments within the run's request slots, each response
//! checked to be of the version being assembled (If-Match and etag), short bodies and transient
//! failures resumed from the byte reached.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use object_store::{GetOptions, GetRange, GetResultPayload, ObjectStore};
use tokio::sync::oneshot;

use super::lease::Active;
use super::object::OBJECT_ATTEMPTS;
use super::part::{copy_local, stream_to_file, Segment};
use super::plan::Listed;
use super::run::{Run, Stop};
use crate::prefetch::lock;
use crate::prefetch::manifest::{etag_md5, normalize_etag};
use crate::prefetch::progress::Progress;
use crate::prefetch::verify::{ChecksumSlot, Hasher, StoreChecksum};
use crate::prefetch::Error;

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
