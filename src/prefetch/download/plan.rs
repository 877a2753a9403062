//! From the listing to work: objects already present are skipped, room is made in the cache,
//! small objects are grouped under one claim and large ones go alone, within a bounded number
//! of objects in flight; work another process holds is looked at again until it is published
//! or its claim expires.

use crate::backoff::Backoff;
use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use object_store::{ObjectMeta, ObjectStore};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::object::{fetch_group, fetch_object};
use super::run::{blocking, file_has_size, Run};
use super::work::{Done, Group, Listed, Work};
use crate::prefetch::cache;
use crate::prefetch::manifest::{Entry, Manifest, Update};
use crate::prefetch::metrics::{DatasetLabels, PrefetchMetrics};
use crate::prefetch::Error;
use crate::store::progress::Progress;

/// Objects of at most this many consecutive listing positions share a group claim.
const GROUP_WINDOW: u64 = 64;

/// Spawn `work`, holding `n` object permits until it finishes.
async fn spawn_work(
    run: &Arc<Run>,
    tasks: &mut JoinSet<Done>,
    permits: &Arc<Semaphore>,
    work: Work,
) -> bool {
    let n = match &work {
        Work::Object(_) => 1,
        Work::Group(g) => u32::try_from(g.objects.len()).unwrap_or(u32::MAX).max(1),
    };
    let permit = tokio::select! {
        _ = run.abort.cancelled() => return false,
        p = permits.clone().acquire_many_owned(n) => match p {
            Ok(p) => p,
            Err(_) => return false,
        },
    };
    let r = run.clone();
    tasks.spawn(async move {
        let out = match work {
            Work::Object(listed) => fetch_object(&r, listed).await,
            Work::Group(group) => fetch_group(&r, group).await,
        };
        drop(permit);
        out
    });
    true
}

/// The small objects of the current listing window.
struct Window {
    index: u64,
    group: Group,
}

/// List the source and feed the pipeline. Returns every listed key when the listing finished.
pub(super) async fn produce(
    run: &Arc<Run>,
    manifest: &Manifest,
    cache_root: &Path,
    evicted: &mut Vec<String>,
) -> Option<HashSet<String>> {
    // Objects (claimed, part file open) in flight; a group holds one permit per object.
    let capacity = (run.opts.concurrency.max(1) * 2).max(2 * GROUP_WINDOW as usize);
    let permits = Arc::new(Semaphore::new(capacity));
    let mut tasks: JoinSet<Done> = JoinSet::new();
    let mut deferred: Vec<Work> = Vec::new();
    let mut keys = HashSet::new();
    let mut room: u64 = 0;
    let labels = PrefetchMetrics::dataset(&run.paths.name);
    let mut position: u64 = 0;
    let mut window: Option<Window> = None;

    let mut listing = run.store.list(run.source.list_prefix());
    let mut listing_ok = true;
    loop {
        let item = tokio::select! {
            _ = run.abort.cancelled() => { listing_ok = false; break; }
            item = listing.next() => item,
        };
        let meta = match item {
            None => break,
            Some(Ok(meta)) => meta,
            Some(Err(e)) => {
                run.set_fatal(Error::from_list(&run.source.url, e));
                listing_ok = false;
                break;
            }
        };
        let Some(listed) = to_listed(run, meta) else {
            continue;
        };
        let key = listed.entry.key.clone();
        keys.insert(key.clone());

        // Group windows follow listing positions (present objects included), so that every
        // process listing the same source forms the same groups.
        let index = position / GROUP_WINDOW;
        position += 1;
        if window.as_ref().is_some_and(|w| w.index != index)
            && !flush_window(run, &mut tasks, &permits, window.take()).await
        {
            listing_ok = false;
            break;
        }
        let w = window.get_or_insert_with(|| Window::new(index, &key));
        w.group.last = key.clone();

        let size = listed.entry.size;
        if present(run, manifest, &listed) {
            continue;
        }
        if let Err(e) = admit(run, &labels, &listed, cache_root, &mut room, evicted).await {
            run.set_fatal(e);
            listing_ok = false;
            break;
        }

        if size <= run.opts.part_size {
            w.group.objects.push(listed);
        } else if !spawn_work(run, &mut tasks, &permits, Work::Object(listed)).await {
            listing_ok = false;
            break;
        }
        while let Some(res) = tasks.try_join_next() {
            collect(res, &mut deferred);
        }
    }
    if listing_ok && !flush_window(run, &mut tasks, &permits, window.take()).await {
        listing_ok = false;
    }
    run.progress.listed.store(listing_ok, Ordering::Relaxed);
    while let Some(res) = tasks.join_next().await {
        collect(res, &mut deferred);
    }

    wait_for_deferred(run, &mut tasks, &permits, deferred).await;
    listing_ok.then_some(keys)
}

impl Window {
    fn new(index: u64, first: &str) -> Window {
        Window {
            index,
            group: Group {
                first: first.to_string(),
                last: first.to_string(),
                objects: Vec::new(),
            },
        }
    }
}

/// Hand a closed group window's objects to the pipeline (an empty one is nothing); `false` when
/// the run stopped.
async fn flush_window(
    run: &Arc<Run>,
    tasks: &mut JoinSet<Done>,
    permits: &Arc<Semaphore>,
    window: Option<Window>,
) -> bool {
    match window {
        Some(w) if !w.group.objects.is_empty() => {
            spawn_work(run, tasks, permits, Work::Group(w.group)).await
        }
        _ => true,
    }
}

/// Count a listed object; `true` when it is already whole in the cache (same version, same
/// size on disk): nothing to fetch.
fn present(run: &Run, manifest: &Manifest, listed: &Listed) -> bool {
    let (key, size) = (&listed.entry.key, listed.entry.size);
    Progress::add(&run.progress.bytes_total, size);
    Progress::add(&run.progress.files_total, 1);
    let whole = manifest.objects.get(key).is_some_and(|cur| {
        cur.done && cur.same_version(&listed.entry) && file_has_size(&run.paths.file(key), size)
    });
    if whole {
        Progress::add(&run.progress.bytes_done, size);
        Progress::add(&run.progress.files_done, 1);
        Progress::add(&run.progress.files_present, 1);
    }
    whole
}

/// Take a listed object that must be fetched: count it pending, mark the dataset incomplete,
/// make room for it under `--cache-max-bytes`, record it pending. `Err`: the run's fatal error.
async fn admit(
    run: &Run,
    labels: &DatasetLabels,
    listed: &Listed,
    cache_root: &Path,
    room: &mut u64,
    evicted: &mut Vec<String>,
) -> Result<(), Error> {
    let size = listed.entry.size;
    if let Some(m) = &run.metrics {
        m.pending_bytes
            .get_or_create(labels)
            .inc_by(i64::try_from(size).unwrap_or(i64::MAX));
        m.pending_files.get_or_create(labels).inc();
    }
    run.mark_incomplete().map_err(|source| Error::Io {
        op: "remove complete marker",
        path: run.paths.complete.clone(),
        source,
    })?;
    if let Some(max) = run.opts.max_bytes {
        make_room(run, cache_root, max, room, evicted).await?;
    }
    run.push_update(Update::Pending(listed.entry.clone()), None);
    Ok(())
}

/// Evict other datasets until the listed total fits under `max`. A scan reads every dataset's
/// manifest: rescan only when the room found by the last one (`room`) is used up.
async fn make_room(
    run: &Run,
    cache_root: &Path,
    max: u64,
    room: &mut u64,
    evicted: &mut Vec<String>,
) -> Result<(), Error> {
    let need = run.progress.bytes_total.load(Ordering::Relaxed);
    if need <= *room {
        return Ok(());
    }
    let root = cache_root.to_path_buf();
    let keep = run.paths.name.clone();
    let in_use = run.opts.in_use_window;
    let report = blocking(move || cache::make_room(&root, &keep, need, max, in_use))
        .await
        .and_then(|r| r)?;
    if let Some(m) = &run.metrics {
        m.evictions.inc_by(report.evicted.len() as u64);
    }
    evicted.extend(report.evicted);
    // `used` counts the other datasets.
    *room = max.saturating_sub(report.used);
    Ok(())
}

/// Work claimed by other processes: wait until it is published, or take it over when its
/// owner's lease runs out.
async fn wait_for_deferred(
    run: &Arc<Run>,
    tasks: &mut JoinSet<Done>,
    permits: &Arc<Semaphore>,
    mut deferred: Vec<Work>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
    while !deferred.is_empty() && run.stopped().is_none() {
        tokio::select! {
            _ = run.abort.cancelled() => break,
            _ = tokio::time::sleep(backoff.next_delay()) => {}
        }
        for work in std::mem::take(&mut deferred) {
            if !spawn_work(run, tasks, permits, work).await {
                break;
            }
        }
        while let Some(res) = tasks.join_next().await {
            collect(res, &mut deferred);
        }
    }
}

fn collect(res: Result<Done, tokio::task::JoinError>, deferred: &mut Vec<Work>) {
    match res {
        Ok(Done::Deferred(w)) => deferred.push(w),
        Ok(Done::Finished) => {}
        Err(e) => tracing::error!(error = %e, "object task panicked"),
    }
}

fn to_listed(run: &Run, meta: ObjectMeta) -> Option<Listed> {
    let location = meta.location;
    let Some(key) = run.source.relative_key(location.as_ref()) else {
        tracing::debug!(location = %location, "listed object outside the prefix; skipped");
        return None;
    };
    let key = key.to_string();
    if run
        .opts
        .only
        .as_ref()
        .is_some_and(|only| !only.contains(&key))
    {
        tracing::debug!(key = %key, "not among the keys to fetch; skipped");
        return None;
    }
    if let Err(e) = crate::store::validate_key(&key) {
        run.fail_object(&key, e.into());
        Progress::add(&run.progress.files_total, 1);
        return None;
    }
    Some(Listed {
        location,
        entry: Entry {
            key,
            size: meta.size,
            etag: meta.e_tag,
            modified_ms: Some(meta.last_modified.timestamp_millis()),
            done: false,
        },
    })
}
