//! The engine end to end over an in-memory store: fetch, publish, record, resume, wait for
//! another owner, cancel.

use std::path::PathBuf;
use std::sync::Mutex;

use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::*;
use crate::prefetch::{cache, claim, download, manifest};
use crate::store::{Progress, SourceUrl};
use crate::sync::lock;

async fn store_with(objects: &[(&str, Vec<u8>)]) -> Arc<dyn ObjectStore> {
    let store = InMemory::new();
    for (k, v) in objects {
        store
            .put(&ObjectPath::from(*k), v.clone().into())
            .await
            .unwrap();
    }
    Arc::new(store)
}

fn job(
    store: Arc<dyn ObjectStore>,
    root: &std::path::Path,
    cancel: CancellationToken,
) -> download::Job {
    let source = SourceUrl::parse("s3://bucket/ds").unwrap();
    download::Job {
        store,
        paths: cache::DatasetPaths::new(root, "ds"),
        cache_root: root.to_path_buf(),
        source,
        options: FetchOptions {
            part_size: 64 << 10,
            concurrency: 4,
            ..FetchOptions::default()
        },
        progress: Arc::new(Progress::default()),
        metrics: None,
        cancel,
    }
}

pub(crate) fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn fetches_publishes_and_records_then_skips_and_refetches_changes() {
    let root = tempfile::tempdir().unwrap();
    let big = pattern(300 << 10, 1);
    let store = store_with(&[
        ("ds/a.bin", pattern(1000, 2)),
        ("ds/dir/big.bin", big.clone()),
        ("ds/empty", Vec::new()),
        ("other/x", pattern(10, 3)),
    ])
    .await;
    let report =
        download::fetch_dataset(job(store.clone(), root.path(), CancellationToken::new())).await;
    let s = &report.summary;
    assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
    assert_eq!((s.counts.files_total, s.counts.files_fetched), (3, 3));
    let ds = root.path().join("ds");
    assert_eq!(std::fs::read(ds.join("dir/big.bin")).unwrap(), big);
    assert_eq!(std::fs::read(ds.join("a.bin")).unwrap(), pattern(1000, 2));
    assert_eq!(std::fs::read(ds.join("empty")).unwrap().len(), 0);
    assert!(ds.join(".spotguard/complete").exists());
    let m = manifest::Manifest::load(&ds.join(".spotguard/manifest.json"), "").unwrap();
    assert!(m.objects.values().all(|e| e.done), "{m:?}");
    assert_eq!(m.objects.len(), 3);
    // No part files or claims are left behind.
    let leftovers: Vec<_> = walk(&ds)
        .into_iter()
        .filter(|p| {
            p.to_string_lossy().contains("spotguard-part")
                || p.to_string_lossy().contains("/claims/")
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Second run: nothing to fetch.
    let again =
        download::fetch_dataset(job(store.clone(), root.path(), CancellationToken::new())).await;
    assert_eq!(again.summary.outcome, Outcome::Complete);
    assert_eq!(again.summary.counts.files_fetched, 0);
    assert_eq!(again.summary.counts.files_present, 3);
    assert_eq!(again.summary.counts.requests, 0);

    // A changed object is fetched again; a deleted one is removed.
    store
        .put(&ObjectPath::from("ds/a.bin"), pattern(1000, 9).into())
        .await
        .unwrap();
    store.delete(&ObjectPath::from("ds/empty")).await.unwrap();
    let third = download::fetch_dataset(job(store, root.path(), CancellationToken::new())).await;
    assert_eq!(third.summary.outcome, Outcome::Complete);
    assert_eq!(third.summary.counts.files_fetched, 1);
    assert_eq!(std::fs::read(ds.join("a.bin")).unwrap(), pattern(1000, 9));
    assert!(!ds.join("empty").exists());
    let m = manifest::Manifest::load(&ds.join(".spotguard/manifest.json"), "").unwrap();
    assert_eq!(m.objects.len(), 2);
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test]
async fn publishing_syncs_then_renames_then_syncs_the_directory_before_recording() {
    let root = tempfile::tempdir().unwrap();
    let store = store_with(&[
        ("ds/a/big", pattern(300 << 10, 1)),
        ("ds/a/small", pattern(1000, 2)),
        ("ds/top", pattern(5000, 3)),
    ])
    .await;
    type Journal = Vec<(download::PublishStep, PathBuf, bool, bool)>;
    let journal: Arc<Mutex<Journal>> = Arc::default();
    let (j, manifest_path) = (
        journal.clone(),
        root.path().join("ds/.spotguard/manifest.json"),
    );
    let mut job = job(store, root.path(), CancellationToken::new());
    job.options.failpoint = Some(download::Failpoint(Arc::new(move |step, path| {
        // At each step: does the final name exist yet, and does the manifest record it?
        let recorded = std::fs::read_to_string(&manifest_path)
            .map(|t| t.contains("\"done\":true"))
            .unwrap_or(false);
        let text = path.to_string_lossy();
        let final_name = text
            .split(crate::store::PART_INFIX)
            .next()
            .unwrap_or_default();
        let final_exists = std::path::Path::new(final_name).exists();
        lock(&j).push((step, path.to_path_buf(), final_exists, recorded));
    })));
    let report = download::fetch_dataset(job).await;
    assert_eq!(
        report.summary.outcome,
        Outcome::Complete,
        "{:?}",
        report.summary
    );
    let journal = lock(&journal).clone();
    let ds = root.path().join("ds");
    for key in ["a/big", "a/small", "top"] {
        let fin = ds.join(key);
        let synced = journal
            .iter()
            .position(|(s, p, _, _)| {
                *s == download::PublishStep::PartSynced
                    && p.to_string_lossy()
                        .starts_with(&format!("{}.spotguard-part-", fin.display()))
            })
            .unwrap_or_else(|| panic!("{key}: no sync in {journal:?}"));
        let renamed = journal
            .iter()
            .position(|(s, p, _, _)| *s == download::PublishStep::Renamed && *p == fin)
            .unwrap_or_else(|| panic!("{key}: no rename in {journal:?}"));
        let dir_synced = journal
            .iter()
            .position(|(s, p, _, _)| {
                *s == download::PublishStep::DirSynced && Some(p.as_path()) == fin.parent()
            })
            .unwrap_or_else(|| panic!("{key}: no directory sync in {journal:?}"));
        assert!(
            synced < renamed && renamed < dir_synced,
            "{key}: {journal:?}"
        );
        // When the part was synced, the final name did not exist yet; after the rename it
        // did.
        assert!(
            !journal[synced].2 && journal[renamed].2,
            "{key}: {journal:?}"
        );
    }
    // The manifest recorded nothing before the first directory sync.
    let first_dir_sync = journal
        .iter()
        .position(|(s, _, _, _)| *s == download::PublishStep::DirSynced)
        .unwrap();
    assert!(journal[..=first_dir_sync]
        .iter()
        .all(|(_, _, _, recorded)| !recorded));
    // The in-memory store keeps no checksums and its etags are not MD5s: sizes only.
    assert_eq!(
        report.summary.counts.verified_size, 3,
        "{:?}",
        report.summary
    );
}

#[tokio::test]
async fn resumes_from_a_dead_owners_claim() {
    let root = tempfile::tempdir().unwrap();
    let data = pattern(200 << 10, 5);
    let store = store_with(&[("ds/big", data.clone())]).await;
    let meta = store.head(&ObjectPath::from("ds/big")).await.unwrap();
    // A previous owner (a dead process on this host) wrote the first 128 KiB.
    let paths = cache::DatasetPaths::new(root.path(), "ds");
    paths.create().unwrap();
    let mut dead = claim::Owner::current();
    dead.pid = 999_999_999;
    dead.nonce = 1;
    let part = paths.part_rel("big", &dead.tag());
    let mut partial = vec![0u8; data.len()];
    partial[..128 << 10].copy_from_slice(&data[..128 << 10]);
    std::fs::write(paths.dir.join(&part), &partial).unwrap();
    claim::Claim::new(&paths.claims, "big")
        .write(&claim::ClaimRecord {
            owner: dead,
            lease_until_ms: claim::now_ms() + 600_000,
            key: "big".into(),
            size: data.len() as u64,
            etag: meta.e_tag.clone(),
            part: part.clone(),
            done: vec![[0, 128 << 10]],
            keys: vec![],
        })
        .unwrap();
    let report = download::fetch_dataset(job(store, root.path(), CancellationToken::new())).await;
    let s = &report.summary;
    assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
    assert_eq!(s.counts.bytes_resumed, 128 << 10);
    assert_eq!(s.counts.bytes_fetched, (200 - 128) << 10);
    assert_eq!(std::fs::read(paths.dir.join("big")).unwrap(), data);
    assert!(!paths.dir.join(&part).exists());
}

#[tokio::test]
async fn live_foreign_claim_is_waited_for_then_seen_complete() {
    let root = tempfile::tempdir().unwrap();
    let data = pattern(1000, 7);
    let store = store_with(&[("ds/f", data.clone())]).await;
    let paths = cache::DatasetPaths::new(root.path(), "ds");
    paths.create().unwrap();
    let other = claim::Owner {
        host: "other-node".into(),
        pid: 1,
        boot_id: String::new(),
        pid_ns: String::new(),
        start_ticks: 0,
        nonce: 3,
    };
    // Small objects are claimed in groups (here a group of one).
    let c = claim::Claim::new(&paths.claims, &download::work::group_claim_key("f", "f"));
    c.write(&claim::ClaimRecord {
        owner: other.clone(),
        lease_until_ms: claim::now_ms() + 600_000,
        key: "f".into(),
        size: 1000,
        etag: None,
        part: "f.spotguard-part-other-node-1".into(),
        done: vec![],
        keys: vec![],
    })
    .unwrap();
    let run = tokio::spawn(download::fetch_dataset(job(
        store.clone(),
        root.path(),
        CancellationToken::new(),
    )));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!run.is_finished());
    // The other node publishes the file, records it and releases its claim.
    let meta = store.head(&ObjectPath::from("ds/f")).await.unwrap();
    std::fs::write(paths.dir.join("f"), &data).unwrap();
    manifest::Manifest::merge_into(
        &paths.manifest,
        "s3://bucket/ds",
        &[manifest::Update::Done(manifest::Entry {
            key: "f".into(),
            size: 1000,
            etag: meta.e_tag,
            modified_ms: Some(meta.last_modified.timestamp_millis()),
            done: true,
        })],
    )
    .unwrap();
    c.release(&other).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .unwrap()
        .unwrap();
    let s = &report.summary;
    assert_eq!(s.outcome, Outcome::Complete, "{s:?}");
    assert_eq!(
        (
            s.counts.files_by_others,
            s.counts.files_fetched,
            s.counts.requests
        ),
        (1, 0, 0)
    );
}

#[tokio::test]
async fn cancellation_keeps_a_resumable_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let store = store_with(&[("ds/f", pattern(1000, 1))]).await;
    let cancel = CancellationToken::new();
    cancel.cancel();
    let report = download::fetch_dataset(job(store, root.path(), cancel)).await;
    assert_eq!(report.summary.outcome, Outcome::Cancelled);
    assert!(!root.path().join("ds/f").exists());
    assert!(!root.path().join("ds/.spotguard/complete").exists());
}

/// Issue 24 item 6: a nested key whose directories this run creates: before the manifest names
/// the file, the directory holding it and every directory holding a directory made for it are
/// synced (a crash must never leave a manifest naming a file whose directory entry is lost).
#[tokio::test]
async fn new_parent_directories_are_synced_before_the_manifest_names_their_files() {
    let root = tempfile::tempdir().unwrap();
    let store = store_with(&[("ds/x/y/z/file", pattern(4000, 7))]).await;
    let journal: Arc<Mutex<Vec<(PathBuf, bool)>>> = Arc::default();
    let (j, manifest_path) = (
        journal.clone(),
        root.path().join("ds/.spotguard/manifest.json"),
    );
    let mut job = job(store, root.path(), CancellationToken::new());
    job.options.failpoint = Some(download::Failpoint(Arc::new(move |step, path| {
        if step == download::PublishStep::DirSynced {
            let recorded = std::fs::read_to_string(&manifest_path)
                .map(|t| t.contains("\"done\":true"))
                .unwrap_or(false);
            lock(&j).push((path.to_path_buf(), recorded));
        }
    })));
    let report = download::fetch_dataset(job).await;
    assert_eq!(
        report.summary.outcome,
        Outcome::Complete,
        "{:?}",
        report.summary
    );
    let journal = lock(&journal).clone();
    let ds = root.path().join("ds");
    for dir in ["x/y/z", "x/y", "x", ""] {
        let want = if dir.is_empty() {
            ds.clone()
        } else {
            ds.join(dir)
        };
        let (_, recorded) = journal
            .iter()
            .find(|(p, _)| *p == want)
            .unwrap_or_else(|| panic!("{} not synced: {journal:?}", want.display()));
        assert!(
            !recorded,
            "the manifest named the file before {} was synced",
            want.display()
        );
    }
}

/// A store counting the ranged GETs in flight (from the request until its body is dropped);
/// each body yields to the scheduler before its bytes, so that the parts started together
/// overlap.
#[derive(Debug)]
struct RangesInFlight {
    inner: InMemory,
    now: Arc<std::sync::atomic::AtomicUsize>,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Display for RangesInFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RangesInFlight")
    }
}

/// Decrements the count when the body it travels with is dropped.
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl ObjectStore for RangesInFlight {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        use futures::StreamExt;
        if options.range.is_none() || options.head {
            return self.inner.get_opts(location, options).await;
        }
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        let guard = InFlight(self.now.clone());
        let mut res = self.inner.get_opts(location, options).await?;
        if let object_store::GetResultPayload::Stream(body) = res.payload {
            let delayed = futures::stream::once(async move {
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
            })
            .flat_map(move |()| {
                let _ = &guard;
                futures::stream::empty()
            })
            .chain(body);
            res.payload = object_store::GetResultPayload::Stream(delayed.boxed());
        }
        Ok(res)
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[tokio::test]
async fn a_lone_object_takes_the_free_slots_beyond_its_share() {
    let root = tempfile::tempdir().unwrap();
    let big = pattern(16 * (64 << 10), 4);
    let inner = InMemory::new();
    inner
        .put(&ObjectPath::from("ds/big.bin"), big.clone().into())
        .await
        .unwrap();
    let store = Arc::new(RangesInFlight {
        inner,
        now: Arc::default(),
        most: Arc::default(),
    });
    let mut job = job(store.clone(), root.path(), CancellationToken::new());
    job.options.concurrency = 8;
    job.options.parts_per_object = 2;
    let report = download::fetch_dataset(job).await;
    assert_eq!(
        report.summary.outcome,
        Outcome::Complete,
        "{:?}",
        report.summary
    );
    assert_eq!(std::fs::read(root.path().join("ds/big.bin")).unwrap(), big);
    // 16 parts of 64 KiB, 8 request slots, a share of 2: with no other object waiting for a
    // slot the lone object takes the free ones too (a cap would hold it to 2 at once), never
    // more than the slots.
    let most = store.most.load(Ordering::SeqCst);
    assert!(
        (3..=8).contains(&most),
        "{most} ranged GETs in flight at most"
    );
}
