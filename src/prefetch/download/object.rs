//! One object, or one group of small objects, under its claim: claim it (or see it published
//! elsewhere), download it into its part file, verify and publish it; retry transient failures,
//! start over when it changed at the source, and checkpoint or discard the part file when it
//! stops early.

use crate::backoff::Backoff;
use std::fs;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use object_store::ObjectStoreExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::fetch::{acquire_request, fetch_missing, Fetched, OBJECT_ATTEMPTS};
use super::lease::{checkpoint_on_stop, release};
use super::options::Verify;
use super::part::{discard_part, missing_segments, open_part};
use super::publish::{publish, record_done, Verified};
use super::run::{blocking, Run, Stop};
use super::verification::verify_part;
use super::work::{group_claim_key, Active, Done, Group, Listed, Segment, Work};
use crate::prefetch::claim::{now_ms, Acquire, Claim, ClaimRecord};
use crate::prefetch::manifest::Entry;
use crate::prefetch::Error;
use crate::store::checksum::VerifiedBy;
use crate::sync::lock;

/// Pause after a retryable failure of attempt n: 200 ms, 400 ms (equal jitter, `crate::backoff`).
const RETRY_BACKOFF: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));

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
    let (r, entry) = (run.clone(), listed.entry.clone());
    let acquired = acquire_claim(run, &key, &claim, &record, move |claim, got| {
        // Published by someone else since our listing? (Checked under the claim, so a
        // finished owner's manifest update is visible: claims are released after it.)
        Ok(match got {
            Acquire::Acquired { previous } if r.done_elsewhere(&entry) => {
                if let Some(p) = previous {
                    let _ = fs::remove_file(r.paths.dir.join(&p.part));
                }
                claim.release(&r.owner)?;
                true
            }
            _ => false,
        })
    })
    .await;
    let previous = match acquired {
        None => return Done::Finished,
        Some((_, true)) => {
            run.count_by_other(&listed.entry);
            return Done::Finished;
        }
        Some((Acquire::Acquired { previous }, false)) => previous,
        Some((Acquire::Held(_), false)) => return Done::Deferred(Work::Object(listed)),
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
    let record = group_record(run, &group);
    let r = run.clone();
    let entries: Vec<Entry> = group.objects.iter().map(|l| l.entry.clone()).collect();
    let acquired = acquire_claim(run, &group.first, &claim, &record, move |_, got| {
        let mut elsewhere = Vec::new();
        if let Acquire::Acquired { previous } = got {
            if let Some(p) = previous {
                // A dead owner's partial small files: they start over.
                let tag = p.owner.tag();
                for k in &p.keys {
                    let _ = fs::remove_file(r.paths.dir.join(r.paths.part_rel(k, &tag)));
                }
            }
            elsewhere = entries.iter().map(|e| r.done_elsewhere(e)).collect();
        }
        Ok(elsewhere)
    })
    .await;
    let (previous, elsewhere) = match acquired {
        None => return Done::Finished,
        Some((Acquire::Acquired { previous }, elsewhere)) => (previous, elsewhere),
        Some((Acquire::Held(_), _)) => return Done::Deferred(Work::Group(group)),
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
        let active = Active::new(None, record.clone(), group_active.lost.clone());
        tasks.spawn(fetch_member(run.clone(), listed.clone(), active));
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

/// The claim record of a group: its first key, its objects' keys and total size.
fn group_record(run: &Run, group: &Group) -> ClaimRecord {
    ClaimRecord {
        owner: run.owner.clone(),
        lease_until_ms: run.lease_until(),
        key: group.first.clone(),
        size: group.objects.iter().map(|l| l.entry.size).sum(),
        etag: None,
        part: String::new(),
        done: Vec::new(),
        keys: group.objects.iter().map(|l| l.entry.key.clone()).collect(),
    }
}

/// Download, verify and publish one object of a group under the group's claim; the object back
/// when the claim was lost (another process takes it over).
async fn fetch_member(r: Arc<Run>, mut listed: Listed, active: Arc<Active>) -> Option<Listed> {
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
}

/// Acquire `claim` (of `key`) with `record` on the blocking pool, then run `then` under it (what
/// another process published meanwhile). A claim that cannot be written ends the run: `None`.
async fn acquire_claim<T: Send + 'static>(
    run: &Run,
    key: &str,
    claim: &Claim,
    record: &ClaimRecord,
    then: impl FnOnce(&Claim, &Acquire) -> io::Result<T> + Send + 'static,
) -> Option<(Acquire, T)> {
    let (c, record) = (claim.clone(), record.clone());
    let acquired = blocking(move || -> io::Result<(Acquire, T)> {
        let got = c.acquire(&record, now_ms())?;
        let seen = then(&c, &got)?;
        Ok((got, seen))
    })
    .await;
    match acquired {
        Ok(Ok(v)) => Some(v),
        Ok(Err(source)) => {
            run.set_fatal(Error::io_for(
                key,
                "create claim",
                claim.path.clone(),
                source,
            ));
            None
        }
        Err(e) => {
            run.set_fatal(e);
            None
        }
    }
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
                let pause = RETRY_BACKOFF.delay(attempt);
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

/// The run and the claim still stand and every byte of the object is accounted for.
fn all_bytes_fetched(run: &Run, active: &Active, key: &str, size: u64) -> Result<(), Stop> {
    if let Some(stop) = run.stopped() {
        return Err(stop);
    }
    if active.lost.is_cancelled() {
        return Err(Stop::Lost);
    }
    let done = active.done_ranges();
    if size > 0 && done != vec![[0, size]] {
        return Err(Stop::Err(Error::SizeMismatch {
            key: key.to_string(),
            expected: size,
            got: done.iter().map(|r| r[1] - r[0]).sum(),
        }));
    }
    Ok(())
}

/// Prepare the part file (resuming a previous owner's when it matches), fetch the missing
/// ranges and verify the result. Returns the part file, ready to publish, with the etag its
/// bytes belong to.
async fn download(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    previous: Option<ClaimRecord>,
    part_rel: &str,
) -> Result<Verified, Stop> {
    let key = listed.entry.key.clone();
    let size = listed.entry.size;
    let part_path = run.paths.dir.join(part_rel);
    let final_path = run.paths.file(&key);
    // An object fetched with one request holds its request slot from part-file creation to
    // publication: open part files (and preallocated space) stay bounded by the concurrency.
    let slot = if size <= run.opts.part_size {
        Some(acquire_request(run, active).await?)
    } else {
        None
    };

    let (file, mut expected_etag) =
        open_part(run, listed, active, previous, &part_path, &final_path).await?;
    if expected_etag.is_none() {
        expected_etag = lock(&active.record).etag.clone();
    }

    let done_before = lock(&active.base_done).clone();
    let missing = missing_segments(&done_before, size, run.opts.part_size);
    let segments: Vec<Arc<Segment>> = missing.iter().map(|&(a, b)| Segment::new(a, b)).collect();
    *lock(&active.segments) = segments.clone();

    let Fetched {
        inline,
        checksum,
        etag: etag_seen,
    } = fetch_missing(
        run,
        listed,
        active,
        &file,
        &segments,
        expected_etag,
        slot.is_some(),
    )
    .await?;
    all_bytes_fetched(run, active, &key, size)?;

    let verified_by = if run.opts.verify != Verify::Checksum || size == 0 {
        VerifiedBy::Size
    } else {
        verify_part(
            &key,
            size,
            &file,
            &part_path,
            checksum,
            inline,
            etag_seen.as_deref(),
        )
        .await?
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
