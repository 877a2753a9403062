//! One object, or one group of small objects, under its claim: claim it (or see it published
//! elsewhere), download it into its part file, verify and publish it; retry transient failures,
//! start over when it changed at the source, and checkpoint or discard the part file when it
//! stops early.

use std::fs::{self, File};
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStoreExt;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::fetch::{acquire_request, fetch_segment, part_result, with_request, SegmentHash};
use super::lease::{checkpoint_on_stop, release, Active};
use super::part::{discard_part, merge_ranges, missing_segments, preallocate, Segment};
use super::plan::{group_claim_key, Done, Group, Listed, Work};
use super::publish::{publish, record_done, Verified};
use super::run::{blocking, Run, Stop};
use super::verification::{finished_hex, head_checksum, read_back};
use super::Verify;
use crate::prefetch::claim::{now_ms, Acquire, Claim, ClaimRecord};
use crate::prefetch::manifest::{etag_md5, normalize_etag, Entry};
use crate::prefetch::progress::Progress;
use crate::prefetch::verify::{Finished, Hasher, StoreChecksum, VerifiedBy};
use crate::prefetch::Error;
use crate::prefetch::{lock, verify};

/// Attempts per object for transient failures, on top of object_store's own retries.
pub(super) const OBJECT_ATTEMPTS: u32 = 3;

/// Claim, download, verify and publish one (large) object under its own claim, which records
/// its progress for resuming.
pub(super) async fn fetch_object(run: &Arc<Run>, mut listed: Listed) -> Done {
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
pub(super) async fn fetch_group(run: &Arc<Run>, group: Group) -> Done {
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

fn fail_or_fatal(run: &Run, key: &str, e: Error) {
    if e.is_fatal() {
        run.set_fatal(e);
    } else {
        run.fail_object(key, e);
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
                expected: verify::hex(&expected),
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
