//! Staged checkpoint uploads (src/upload) against real S3-compatible servers on loopback
//! (s3s-fs, moto) and a local filesystem destination: the happy path with the manifest written
//! last, the deadline arriving mid-upload, a restart mid-upload (SIGKILL of `spotguard upload`),
//! hostile staged trees (a symlink to a host file, a FIFO, a file growing during the upload, a
//! file of another uid behind a trainer's root), the store's checksum compared after each file,
//! and the resume side (`prefetch --latest-checkpoint`).
//!
//! Needs `s3s-fs` and `moto_server`: run `scripts/deps/prefetch.sh` once.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::StreamExt;
use http::request::Parts;
use hyper::Response;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjectPath;
use object_store::{
    ClientOptions, CopyOptions, GetOptions, GetResult, ListResult, MultipartId, MultipartUpload,
    ObjectMeta, ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload,
    PutResult,
};
use serde_json::Value;
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::upload::dest::Location;
use spotguard::upload::engine::{self, Job, Meta, Options};
use spotguard::upload::journal::RootRecord;
use spotguard::upload::latest;
use spotguard::upload::manifest::{Manifest, Origin};
use spotguard::upload::staged::{self, Limits, Problem, Root};
use spotguard::upload::target::{StoreTarget, Target};
use spotguard::upload::{Error, Outcome};
use spotguard_testkit::process::with_shipped_capabilities;
use spotguard_testkit::s3::proxy::{paced, Body, Faults, Proxy};
use spotguard_testkit::s3::{create_bucket, S3Server, ACCESS_KEY, REGION, SECRET_KEY};
use tokio_util::sync::CancellationToken;

const BUCKET: &str = "ckpt";
const MIB: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Servers

fn s3(endpoint: &str) -> Arc<AmazonS3> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(BUCKET)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region(REGION)
            .with_http_connector(spotguard::store::checksum::ChecksumConnector)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(true)
                    .with_default_headers(http::HeaderMap::from_iter([(
                        http::HeaderName::from_static(spotguard::store::checksum::CHECKSUM_MODE),
                        http::HeaderValue::from_static("ENABLED"),
                    )])),
            )
            .build()
            .unwrap(),
    )
}

async fn get(store: &AmazonS3, key: &str) -> Option<Vec<u8>> {
    match store.get(&ObjectPath::from(key)).await {
        Ok(r) => Some(r.bytes().await.unwrap().to_vec()),
        Err(object_store::Error::NotFound { .. }) => None,
        Err(e) => panic!("GET {key}: {e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// A store that records what it completed, can hold parts back and counts aborts

#[derive(Debug)]
struct Recording {
    inner: Arc<AmazonS3>,
    /// Keys whose write completed (PUT or CompleteMultipartUpload), in order.
    writes: Mutex<Vec<String>>,
    aborts: Mutex<Vec<String>>,
    parts: AtomicUsize,
    /// Parts started; every part from number `hold_after` on (counting all of them) waits
    /// while it is below `hold_after`.
    started: AtomicUsize,
    hold_after: AtomicUsize,
}

impl Recording {
    fn new(inner: Arc<AmazonS3>) -> Arc<Recording> {
        Arc::new(Recording {
            inner,
            writes: Mutex::new(Vec::new()),
            aborts: Mutex::new(Vec::new()),
            parts: AtomicUsize::new(0),
            started: AtomicUsize::new(0),
            hold_after: AtomicUsize::new(usize::MAX),
        })
    }

    fn target(self: &Arc<Self>, prefix: &str) -> Target {
        Target::Store(StoreTarget::new(
            self.clone(),
            self.clone(),
            prefix,
            format!("s3://{BUCKET}/{prefix}"),
        ))
    }
}

impl fmt::Display for Recording {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Recording({})", self.inner)
    }
}

#[async_trait]
impl ObjectStore for Recording {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        let r = self.inner.put_opts(location, payload, opts).await?;
        self.writes.lock().unwrap().push(location.to_string());
        Ok(r)
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[async_trait]
impl MultipartStore for Recording {
    async fn create_multipart(&self, path: &ObjectPath) -> object_store::Result<MultipartId> {
        self.inner.create_multipart(path).await
    }

    async fn put_part(
        &self,
        path: &ObjectPath,
        id: &MultipartId,
        part_idx: usize,
        data: PutPayload,
    ) -> object_store::Result<PartId> {
        let n = self.started.fetch_add(1, Ordering::SeqCst);
        while n >= self.hold_after.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let r = self.inner.put_part(path, id, part_idx, data).await?;
        self.parts.fetch_add(1, Ordering::SeqCst);
        Ok(r)
    }

    async fn complete_multipart(
        &self,
        path: &ObjectPath,
        id: &MultipartId,
        parts: Vec<PartId>,
    ) -> object_store::Result<PutResult> {
        let r = self.inner.complete_multipart(path, id, parts).await?;
        self.writes.lock().unwrap().push(path.to_string());
        Ok(r)
    }

    async fn abort_multipart(
        &self,
        path: &ObjectPath,
        id: &MultipartId,
    ) -> object_store::Result<()> {
        self.aborts.lock().unwrap().push(path.to_string());
        self.inner.abort_multipart(path, id).await
    }
}

// ---------------------------------------------------------------------------------------------
// Staged trees and jobs

fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// A staged checkpoint `name` under a fresh directory: `(relative path, content)` pairs.
fn stage(name: &str, files: &[(&str, Vec<u8>)]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    for (p, content) in files {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    (tmp, dir)
}

/// A checkpoint like torch DCP writes one: a few large shards, `.metadata`, small files in a
/// subdirectory, an empty file.
fn dcp_like(big: usize, big_len: usize, small: usize) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for i in 0..big {
        files.push((
            format!("__{i}_0.distcp"),
            data(big_len + i * 4099, i as u64),
        ));
    }
    files.push((".metadata".to_string(), data(4321, 99)));
    for i in 0..small {
        files.push((
            format!("extra/state-{i:03}.pt"),
            data(1 + i * 37, 1000 + i as u64),
        ));
    }
    files.push(("extra/empty".to_string(), Vec::new()));
    files
}

fn as_refs(files: &[(String, Vec<u8>)]) -> Vec<(&str, Vec<u8>)> {
    files.iter().map(|(p, d)| (p.as_str(), d.clone())).collect()
}

fn capture(dir: &Path) -> spotguard::upload::StagedTree {
    staged::capture(&Root::host().unwrap(), dir, &Limits::default()).unwrap()
}

fn job(dir: &Path, target: Target, step: u64, options: Options) -> Job {
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    Job {
        tree: capture(dir),
        target,
        meta: Meta {
            name,
            step: Some(step),
            origin: Origin {
                staged: dir.display().to_string(),
                ..Origin::default()
            },
            ..Meta::default()
        },
        root: RootRecord::Host { owner: None },
        options,
        progress: Default::default(),
        metrics: None,
        cancel: CancellationToken::new(),
        relayed: Default::default(),
    }
}

fn small_parts() -> Options {
    Options {
        concurrency: 4,
        part_size: engine::MIN_PART_SIZE,
        ..Options::default()
    }
}

fn hex64(d: &[u8]) -> String {
    format!(
        "{:016x}",
        crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, d)
    )
}

fn hex32(d: &[u8]) -> String {
    format!(
        "{:08x}",
        crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, d) as u32
    )
}

/// The manifest lists exactly `files`, with their sizes and both CRCs of their content.
fn assert_manifest_lists(m: &Manifest, files: &[(String, Vec<u8>)]) {
    let mut want: Vec<&(String, Vec<u8>)> = files.iter().collect();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(m.files.len(), want.len());
    assert_eq!(m.file_count, want.len());
    for (f, (path, content)) in m.files.iter().zip(want) {
        assert_eq!(&f.path, path);
        assert_eq!(f.size, content.len() as u64, "{path}");
        assert_eq!(f.crc64nvme, hex64(content), "{path}");
        assert_eq!(f.crc32c, hex32(content), "{path}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tests: object stores

async fn happy_path_on(server: &S3Server) {
    create_bucket(&server.endpoint(), BUCKET).await;
    let store = s3(&server.endpoint());
    let rec = Recording::new(store.clone());
    let files = dcp_like(3, 12 * MIB, 40);
    let (_tmp, dir) = stage("step-1200", &as_refs(&files));
    let report = engine::run(job(&dir, rec.target("run1/step-1200"), 1200, small_parts())).await;
    assert_eq!(report.outcome, Outcome::Published, "{:?}", report.error);
    let total: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(
        (report.files, report.bytes, report.bytes_sent),
        (files.len(), total, total)
    );

    // Every file is there, byte for byte; the manifest is the last write and lists them all.
    for (path, content) in &files {
        let got = get(&store, &format!("run1/step-1200/{path}")).await;
        assert_eq!(got.as_deref(), Some(content.as_slice()), "{path}");
    }
    let writes = rec.writes.lock().unwrap().clone();
    assert_eq!(writes.len(), files.len() + 1, "{writes:?}");
    assert_eq!(writes.last().unwrap(), "run1/step-1200/manifest.json");
    let m = Manifest::parse(
        &get(&store, "run1/step-1200/manifest.json").await.unwrap(),
        "step-1200",
        None,
    )
    .unwrap();
    assert_manifest_lists(&m, &files);
    assert_eq!(m.step, Some(1200));
    assert_eq!(Some(&m), report.manifest.as_ref());
    // Three multipart uploads of 3 parts each (12 MiB in 5 MiB parts).
    assert_eq!(rec.parts.load(Ordering::SeqCst), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3s_fs_publishes_every_file_then_the_manifest() {
    happy_path_on(&S3Server::s3s_fs(&[])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_publishes_every_file_then_the_manifest() {
    happy_path_on(&S3Server::moto()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_mid_upload_publishes_nothing_and_the_previous_checkpoint_stays_latest() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let store = s3(&server.endpoint());
    let rec = Recording::new(store.clone());
    let state = tempfile::tempdir().unwrap();

    let first = dcp_like(1, 6 * MIB, 3);
    let (_t1, d1) = stage("step-100", &as_refs(&first));
    let r1 = engine::run(job(&d1, rec.target("run1/step-100"), 100, small_parts())).await;
    assert_eq!(r1.outcome, Outcome::Published, "{:?}", r1.error);

    // The next one is big; the store takes two of its parts and holds the others, so the
    // deadline arrives in the middle. Should a busy machine not get a part through before the
    // deadline, the same upload runs again with twice the time: the condition is reached, not
    // hoped for.
    let second = dcp_like(2, 16 * MIB, 3);
    let (_t2, d2) = stage("step-200", &as_refs(&second));
    let mut allowed = Duration::from_millis(1200);
    let r2 = loop {
        let parts_before = rec.parts.load(Ordering::SeqCst);
        rec.hold_after
            .store(rec.started.load(Ordering::SeqCst) + 2, Ordering::SeqCst);
        rec.aborts.lock().unwrap().clear();
        let started = Instant::now();
        let mut opts = small_parts();
        opts.deadline = Some(tokio::time::Instant::now() + allowed);
        opts.state_dir = Some(state.path().to_path_buf());
        let r2 = engine::run(job(&d2, rec.target("run1/step-200"), 200, opts)).await;
        assert_eq!(r2.outcome, Outcome::Deadline, "{r2:?}");
        let late = started.elapsed().saturating_sub(allowed);
        assert!(
            late < Duration::from_secs(3),
            "stopped {late:?} after its deadline"
        );
        assert_eq!(r2.error_label, Some("deadline"));
        assert!(
            r2.error.as_deref().unwrap().contains("no manifest"),
            "{r2:?}"
        );
        if rec.parts.load(Ordering::SeqCst) - parts_before == 2 {
            break r2;
        }
        assert!(
            allowed < Duration::from_secs(40),
            "two parts never went through before the deadline"
        );
        allowed *= 2;
        eprintln!("the deadline came before two parts: again with {allowed:?}");
    };
    rec.hold_after.store(usize::MAX, Ordering::SeqCst);
    assert!(r2.bytes_sent > 0 && r2.bytes_sent < r2.bytes, "{r2:?}");
    assert_eq!(get(&store, "run1/step-200/manifest.json").await, None);
    // Its multipart uploads were aborted and its journal forgotten.
    let aborts = rec.aborts.lock().unwrap().clone();
    assert!(
        !aborts.is_empty() && aborts.iter().all(|k| k.starts_with("run1/step-200/")),
        "{aborts:?}"
    );
    assert_eq!(
        std::fs::read_dir(state.path().join("uploads"))
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );

    // For readers, step-100 is still the latest.
    let found = latest_via_cli(&server, &format!("s3://{BUCKET}/run1")).await;
    assert_eq!(found["name"], "step-100", "{found}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_growing_during_the_upload_fails_it_and_nothing_is_published() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let store = s3(&server.endpoint());
    let rec = Recording::new(store.clone());
    let files = dcp_like(1, 16 * MIB, 2);
    let (_t, dir) = stage("step-7", &as_refs(&files));
    // The store holds the parts until the file has grown: read, then changed, then checked.
    rec.hold_after.store(0, Ordering::SeqCst);
    let j = job(&dir, rec.target("run1/step-7"), 7, small_parts());
    let upload = tokio::spawn(engine::run(j));
    let t = Instant::now();
    while rec.started.load(Ordering::SeqCst) == 0 {
        assert!(t.elapsed() < Duration::from_secs(60), "no part was sent");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("__0_0.distcp"))
        .unwrap();
    f.write_all(&[7u8; 4096]).unwrap();
    rec.hold_after.store(usize::MAX, Ordering::SeqCst);
    let r = upload.await.unwrap();
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    assert_eq!(r.error_label, Some("changed"), "{r:?}");
    assert!(r.error.unwrap().contains("__0_0.distcp"));
    assert_eq!(get(&store, "run1/step-7/manifest.json").await, None);
    assert_eq!(get(&store, "run1/step-7/__0_0.distcp").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_checkpoint_is_never_overwritten() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let store = s3(&server.endpoint());
    let rec = Recording::new(store.clone());
    let files = dcp_like(1, 6 * MIB, 2);
    let (_t, dir) = stage("step-9", &as_refs(&files));
    let r = engine::run(job(&dir, rec.target("run1/step-9"), 9, small_parts())).await;
    assert_eq!(r.outcome, Outcome::Published);
    // The same content again: nothing sent.
    let again = engine::run(job(&dir, rec.target("run1/step-9"), 9, small_parts())).await;
    assert_eq!(again.outcome, Outcome::AlreadyPublished, "{again:?}");
    assert_eq!(again.bytes_sent, 0);
    // Other content under the same name: refused, the published files untouched.
    std::fs::write(dir.join(".metadata"), b"different").unwrap();
    let other = engine::run(job(&dir, rec.target("run1/step-9"), 9, small_parts())).await;
    assert_eq!(other.outcome, Outcome::Failed);
    assert_eq!(other.error_label, Some("exists"));
    let meta = &files.iter().find(|(p, _)| p == ".metadata").unwrap().1;
    assert_eq!(
        get(&store, "run1/step-9/.metadata").await.as_deref(),
        Some(meta.as_slice())
    );
}

/// Two writers of one checkpoint (the doomed node's upload and a peer's relay of it) race: the
/// one held mid-upload finds the other's manifest at its own publication and never overwrites
/// it (the manifest is created only if absent: `If-None-Match: *`).
async fn racing_writers_publish_once_on(server: &S3Server) {
    create_bucket(&server.endpoint(), BUCKET).await;
    let store = s3(&server.endpoint());
    let files = dcp_like(1, 6 * MIB, 2);
    let (_t, dir) = stage("step-9", &as_refs(&files));
    for (round, other_content) in [(0, false), (1, true)] {
        let prefix = format!("run{round}/step-9");
        let held = Recording::new(store.clone());
        held.hold_after.store(1, Ordering::SeqCst);
        let slow = tokio::spawn(engine::run(job(
            &dir,
            held.target(&prefix),
            9,
            small_parts(),
        )));
        // The held upload is past its start (its second part is waiting)...
        let h = held.clone();
        spotguard_testkit::wait::eventually(
            "the held upload's second part",
            Duration::from_secs(20),
            || {
                let h = h.clone();
                async move { h.started.load(Ordering::SeqCst) >= 2 }
            },
        )
        .await;
        // ...when the other writer publishes the same checkpoint, or other content under its name.
        let (_t2, dir2) = stage("step-9", &as_refs(&files));
        if other_content {
            std::fs::write(dir2.join(".metadata"), b"different").unwrap();
        }
        let fast = Recording::new(store.clone());
        let first = engine::run(job(&dir2, fast.target(&prefix), 9, small_parts())).await;
        assert_eq!(first.outcome, Outcome::Published, "{first:?}");
        let published = get(&store, &format!("{prefix}/manifest.json"))
            .await
            .unwrap();
        held.hold_after.store(usize::MAX, Ordering::SeqCst);
        let second = slow.await.unwrap();
        if other_content {
            assert_eq!(second.outcome, Outcome::Failed, "{second:?}");
            assert_eq!(second.error_label, Some("exists"));
        } else {
            assert_eq!(second.outcome, Outcome::AlreadyPublished, "{second:?}");
        }
        assert_eq!(
            get(&store, &format!("{prefix}/manifest.json"))
                .await
                .unwrap(),
            published,
            "the first writer's manifest was overwritten"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3s_fs_racing_writers_of_one_checkpoint_publish_it_once() {
    racing_writers_publish_once_on(&S3Server::s3s_fs(&[])).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moto_racing_writers_of_one_checkpoint_publish_it_once() {
    racing_writers_publish_once_on(&S3Server::moto()).await;
}

// ---------------------------------------------------------------------------------------------
// A proxy in front of the server (spotguard_testkit::s3::proxy): slows request bodies down (to
// kill an upload mid-way) and adds the full-object checksum real S3 returns for every new object
// to PUT and HEAD answers

#[derive(Default)]
struct ProxyState {
    /// Request body bytes per second (0 = no limit).
    rate_bps: AtomicU64,
    /// key suffix → x-amz-checksum-crc64nvme value (base64) added to PUT and HEAD answers.
    checksums: Mutex<HashMap<String, String>>,
    /// While set, every part after the first `hold_after` is held (its body never arrives):
    /// the upload stays exactly where the test wants it, however busy the machine is.
    hold: std::sync::atomic::AtomicBool,
    hold_after: AtomicUsize,
    /// Part uploads (`UploadPart`) seen.
    parts: AtomicUsize,
}

impl ProxyState {
    /// PUT and HEAD answers for keys ending in `key` carry the CRC64/NVME of `content`.
    fn checksum(&self, key: &str, content: &[u8]) {
        use base64::Engine;
        let v = crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, content).to_be_bytes();
        self.checksums.lock().unwrap().insert(
            key.to_string(),
            base64::engine::general_purpose::STANDARD.encode(v),
        );
    }
}

impl Faults for ProxyState {
    fn request_body(self: &Arc<Self>, req: &Parts, body: Body) -> Body {
        let is_part =
            req.method == http::Method::PUT && req.uri.query().unwrap_or("").contains("partNumber");
        if is_part {
            let n = self.parts.fetch_add(1, Ordering::SeqCst);
            if self.hold.load(Ordering::SeqCst) && n >= self.hold_after.load(Ordering::SeqCst) {
                // One byte a second: a 5 MiB part is held for good.
                return paced(body, 1);
            }
        }
        paced(body, self.rate_bps.load(Ordering::SeqCst))
    }

    fn response(self: &Arc<Self>, req: &Parts, resp: Response<Body>) -> Response<Body> {
        let add_checksum = matches!(req.method, http::Method::HEAD | http::Method::PUT)
            && !req.uri.query().unwrap_or("").contains("partNumber");
        let (mut rparts, rbody) = resp.into_parts();
        if add_checksum && rparts.status.is_success() {
            let sums = self.checksums.lock().unwrap();
            let path = req.uri.path();
            if let Some((_, v)) = sums.iter().find(|(k, _)| path.ends_with(k.as_str())) {
                rparts
                    .headers
                    .insert("x-amz-checksum-crc64nvme", v.parse().unwrap());
                rparts
                    .headers
                    .insert("x-amz-checksum-type", "FULL_OBJECT".parse().unwrap());
            }
        }
        Response::from_parts(rparts, rbody)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stores_checksum_is_compared_after_each_file() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let proxy = Proxy::start(&server, ProxyState::default()).await;
    let files = dcp_like(1, 11 * MIB, 2);
    for (p, content) in &files {
        proxy.state.checksum(&format!("run1/step-3/{p}"), content);
    }
    let (_t, dir) = stage("step-3", &as_refs(&files));
    let rec = Recording::new(s3(&proxy.endpoint()));
    let r = engine::run(job(&dir, rec.target("run1/step-3"), 3, small_parts())).await;
    assert_eq!(r.outcome, Outcome::Published, "{r:?}");
    let m = r.manifest.unwrap();
    assert!(
        m.files
            .iter()
            .all(|f| f.verified_by.as_str() == "crc64nvme"),
        "{:?}",
        m.files
    );

    // The store holds other bytes than were read (it says so with its checksum): no manifest.
    let (_t2, dir2) = stage("step-4", &as_refs(&files));
    for (p, _) in &files {
        proxy
            .state
            .checksum(&format!("run1/step-4/{p}"), b"not these bytes");
    }
    let r = engine::run(job(&dir2, rec.target("run1/step-4"), 4, small_parts())).await;
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    assert_eq!(r.error_label, Some("checksum_mismatch"));
    assert_eq!(
        get(&s3(&server.endpoint()), "run1/step-4/manifest.json").await,
        None
    );
}

// ---------------------------------------------------------------------------------------------
// The CLI: restart mid-upload, refusals, the resume side

fn spotguard(args: &[&str], endpoint: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args)
        .args(["--endpoint", endpoint])
        .envs(S3Server::client_env())
        .env("SPOTGUARD_LOG_LEVEL", "spotguard=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

struct Ran {
    code: i32,
    last_json: Value,
    stderr: String,
}

async fn run(cmd: Command) -> Ran {
    let mut cmd = cmd;
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Ran {
        code: out.status.code().unwrap_or(-1),
        last_json: stdout
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn latest_via_cli(server: &S3Server, location: &str) -> Value {
    let r = run(spotguard(
        &["prefetch", "--latest-checkpoint", location],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.last_json
}

/// The journals under `dir` (`*.json`; not the temp file of a write in progress, which a
/// SIGKILL may leave unrenamed), parsed.
fn journals(dir: &Path) -> Vec<Value> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p.file_name().unwrap().to_string_lossy().starts_with('.')
        })
        .filter_map(|p| std::fs::read(p).ok())
        .filter_map(|d| serde_json::from_slice::<Value>(&d).ok())
        .collect()
}

/// Parts the journals under `dir` record, and the bytes a resume may reuse (those parts and
/// the files recorded whole).
fn journaled(dir: &Path) -> (usize, u64) {
    let mut parts = 0;
    let mut bytes = 0;
    for j in journals(dir) {
        for f in j["files"].as_object().into_iter().flat_map(|f| f.values()) {
            if let Some(done) = f["done"].as_object() {
                bytes += done["crcs"]["len"].as_u64().unwrap();
                continue;
            }
            for p in f["parts"].as_object().into_iter().flat_map(|p| p.values()) {
                parts += 1;
                bytes += p["crcs"]["len"].as_u64().unwrap();
            }
        }
    }
    (parts, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_upload_never_publishes_a_partial_and_the_next_run_resumes() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let proxy = Proxy::start(&server, ProxyState::default()).await;
    // The store takes two parts, then holds every other: the journal ends up naming exactly
    // what the store has, and the kill finds the upload there, however slow the machine.
    proxy.state.hold_after.store(2, Ordering::SeqCst);
    proxy.state.hold.store(true, Ordering::SeqCst);
    let files = dcp_like(2, 24 * MIB, 20);
    let (_t, dir) = stage("step-50", &as_refs(&files));
    let state = tempfile::tempdir().unwrap();
    let staged = dir.display().to_string();
    let state_dir = state.path().display().to_string();
    let args = [
        "upload",
        &staged,
        "s3://ckpt/run1",
        "--step",
        "50",
        "--state-dir",
        &state_dir,
        "--part-size",
        "5MiB",
        "--concurrency",
        "2",
        "--progress",
        "json",
    ];
    let mut child = spotguard(&args, &proxy.endpoint()).spawn().unwrap();
    // Wait until the journal records the two parts the store took, then kill -9 mid-upload.
    let journal_dir = state.path().join("uploads");
    let deadline = Instant::now() + Duration::from_secs(120);
    while journaled(&journal_dir).0 < 2 {
        assert!(Instant::now() < deadline, "no parts recorded within 120 s");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the upload ended before it was killed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let (parts, reusable) = journaled(&journal_dir);
    assert_eq!(parts, 2, "the store took two parts");
    let store = s3(&server.endpoint());
    assert_eq!(get(&store, "run1/step-50/manifest.json").await, None);
    let none = latest_via_cli(&server, "s3://ckpt/run1").await;
    assert_eq!(none, Value::Null);

    // Run it again (nothing held): it resumes from the journal — every byte it names is
    // reused, not sent again — and publishes.
    proxy.state.hold.store(false, Ordering::SeqCst);
    let parts_before = proxy.state.parts.load(Ordering::SeqCst);
    let r = run(spotguard(&args, &proxy.endpoint())).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.last_json["outcome"], "published", "{}", r.last_json);
    let resumed = r.last_json["bytes_resumed"].as_u64().unwrap();
    assert!(reusable >= 2 * 5 * MIB as u64);
    assert_eq!(resumed, reusable, "{}", r.last_json);
    let total: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    assert_eq!(
        r.last_json["bytes_sent"].as_u64().unwrap(),
        total - reusable,
        "{}",
        r.last_json
    );
    // Two files of five parts each, two of them already at the store.
    assert_eq!(proxy.state.parts.load(Ordering::SeqCst) - parts_before, 8);
    for (path, content) in &files {
        let got = get(&store, &format!("run1/step-50/{path}")).await;
        assert_eq!(got.as_deref(), Some(content.as_slice()), "{path}");
    }
    let m = Manifest::parse(
        &get(&store, "run1/step-50/manifest.json").await.unwrap(),
        "step-50",
        None,
    )
    .unwrap();
    assert_manifest_lists(&m, &files);
    assert!(m.timings.resumed);
    assert!(
        std::fs::read_dir(&journal_dir).unwrap().next().is_none(),
        "journal left behind"
    );
    let found = latest_via_cli(&server, "s3://ckpt/run1").await;
    assert_eq!(found["name"], "step-50");
    assert_eq!(found["step"], 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_latest_checkpoint_is_fetched_for_a_resume() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let mut staged = Vec::new();
    for step in [100u64, 300, 200] {
        let files = dcp_like(1, 6 * MIB + step as usize, 3);
        let (t, dir) = stage(&format!("step-{step}"), &as_refs(&files));
        let r = run(spotguard(
            &[
                "upload",
                &dir.display().to_string(),
                "s3://ckpt/run1",
                "--step",
                &step.to_string(),
                "--progress",
                "json",
            ],
            &server.endpoint(),
        ))
        .await;
        assert_eq!(r.code, 0, "{}", r.stderr);
        staged.push((step, files, t));
    }
    let local = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        &[
            "prefetch",
            "--latest-checkpoint",
            "s3://ckpt/run1/",
            &local.path().display().to_string(),
            "--progress",
            "none",
        ],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.last_json["name"], "step-300", "{}", r.last_json);
    let (_, files, _) = staged.iter().find(|(s, _, _)| *s == 300).unwrap();
    for (path, content) in files {
        assert_eq!(
            std::fs::read(local.path().join("step-300").join(path)).unwrap(),
            *content,
            "{path}"
        );
    }
    assert!(local.path().join("step-300/manifest.json").exists());
    // No checkpoint yet (a job's first start): exit 0, null, nothing fetched.
    let empty = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        &[
            "prefetch",
            "--latest-checkpoint",
            "s3://ckpt/run2",
            &empty.path().display().to_string(),
        ],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.last_json, Value::Null);
    assert!(std::fs::read_dir(empty.path()).unwrap().next().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_outside_the_allow_list_and_hostile_trees_are_refused_before_anything_is_sent()
{
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let files = dcp_like(0, 0, 3);
    let (_t, dir) = stage("step-1", &as_refs(&files));
    let staged = dir.display().to_string();
    let r = run(spotguard(
        &[
            "upload",
            &staged,
            "s3://ckpt/run1",
            "--allow",
            "s3://ckpt/other",
        ],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("not under any allowed location"),
        "{}",
        r.stderr
    );

    // A symlink to a host file, then a FIFO: refused by name, nothing at the destination.
    std::os::unix::fs::symlink("/etc/shadow", dir.join("extra/shadow")).unwrap();
    let r = run(spotguard(
        &["upload", &staged, "s3://ckpt/run1"],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("extra/shadow") && r.stderr.contains("symlink"),
        "{}",
        r.stderr
    );
    std::fs::remove_file(dir.join("extra/shadow")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        dir.join("extra/pipe"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    let r = tokio::time::timeout(
        Duration::from_secs(30),
        run(spotguard(
            &["upload", &staged, "s3://ckpt/run1"],
            &server.endpoint(),
        )),
    )
    .await
    .expect("a FIFO must not block the upload");
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("extra/pipe") && r.stderr.contains("special file"),
        "{}",
        r.stderr
    );
    let store = s3(&server.endpoint());
    assert!(
        store.list(None).next().await.is_none(),
        "something was uploaded"
    );
}

// ---------------------------------------------------------------------------------------------
// Trainers behind their own root and uid

/// A trainer stand-in running as uid 1000 (killed on drop).
struct Trainer(Child);

impl Drop for Trainer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn trainer_as_1000() -> Trainer {
    Trainer(
        Command::new("setpriv")
            .args([
                "--reuid",
                "1000",
                "--regid",
                "1000",
                "--clear-groups",
                "sleep",
                "60",
            ])
            .spawn()
            .unwrap(),
    )
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).unwrap();
}

fn wait_for_uid(proc: &ProcFs, pid: i32, uid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while proc.status(pid).map(|s| s.uid).ok() != Some(uid) {
        assert!(
            Instant::now() < deadline,
            "the trainer never ran as uid {uid}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_trainer_of_another_uid_cannot_stage_what_it_does_not_own() {
    let proc = ProcFs::default();
    let trainer = trainer_as_1000();
    let pid = trainer.0.id() as i32;
    wait_for_uid(&proc, pid, 1000);
    let start = proc.start_time(pid).unwrap();
    let root = Root::of_process(&proc, pid, start).unwrap();
    assert_eq!(root.uid, Some(1000));

    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("step-1");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("w.bin"), b"weights").unwrap();
    chown(&dir, 1000);
    chown(&dir.join("w.bin"), 1000);
    // A root-only file planted in the tree (a copy or hard link of a secret): the trainer could
    // not read it, so the agent must not ship it.
    let secret = dir.join("secret");
    std::fs::write(&secret, b"root only").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let refused = staged::capture(&root, &dir, &Limits::default()).unwrap_err();
    match &refused {
        Error::Staged {
            path,
            problem,
            detail,
        } => {
            assert_eq!(*problem, Problem::Owner);
            assert!(path.ends_with("step-1/secret"), "{path}");
            assert!(
                detail.contains("uid 0") && detail.contains("uid 1000"),
                "{detail}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(refused.metric_label(), "staged_owner");
    std::fs::remove_file(&secret).unwrap();
    // A root-owned directory inside the tree is refused the same way.
    std::fs::create_dir(dir.join("sub")).unwrap();
    assert!(matches!(
        staged::capture(&root, &dir, &Limits::default()),
        Err(Error::Staged {
            problem: Problem::Owner,
            ..
        })
    ));
    chown(&dir.join("sub"), 1000);
    let tree = staged::capture(&root, &dir, &Limits::default()).unwrap();
    assert_eq!(tree.files.len(), 1);
    assert_eq!(tree.owner, Some(1000));

    // Once the trainer is gone its root is out of reach: a clear error, not another process's.
    drop(trainer);
    let gone = Root::of_process(&proc, pid, start).unwrap_err();
    assert_eq!(gone.metric_label(), "staged_process_gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_checkpoint_uploads_after_the_trainer_and_its_files_are_gone() {
    use spotguard::checkpoint::ack::{AckFile, CheckpointDir};
    use spotguard::upload::ack::{self, Acker, Answer, AnswerState, StagedRequest};
    use spotguard::upload::dest::{AllowUpload, UploadPolicy};

    let proc = ProcFs::default();
    let trainer = trainer_as_1000();
    let pid = trainer.0.id() as i32;
    wait_for_uid(&proc, pid, 1000);
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let files = dcp_like(1, 7 * MIB, 5);
    let dir = tmp.path().join("step-42");
    for (p, content) in &files {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, content).unwrap();
    }
    for e in [dir.clone(), dir.join("extra")] {
        chown(&e, 1000);
    }
    for (p, _) in &files {
        chown(&dir.join(p), 1000);
    }
    let ckdir = tmp.path().join("sg");
    let cdir = CheckpointDir::host(&ckdir).unwrap();
    let ack: AckFile = serde_json::from_value(serde_json::json!({
        "state": "done", "step": 42, "staged": dir.display().to_string(),
    }))
    .unwrap();
    let req = StagedRequest::from_ack(&ack).unwrap().unwrap();
    let dest_base = tempfile::tempdir().unwrap();
    let policy = UploadPolicy {
        allow: vec![AllowUpload::parse(&dest_base.path().display().to_string()).unwrap()],
        own_dirs: vec![ckdir.clone()],
    };
    let default = dest_base.path().join("run1").display().to_string();
    let acker = Acker {
        pid,
        start_time: proc.start_time(pid).unwrap(),
        ns_pid: pid,
    };
    let taken = ack::take(
        &proc,
        acker,
        &cdir,
        &req,
        &ack::Binding {
            location: Some(default.clone()),
            writer: None,
            namespace: None,
        },
        &policy,
        &Limits::default(),
        &Default::default(),
    )
    .unwrap();
    let answer: Answer =
        serde_json::from_slice(&std::fs::read(ckdir.join(ack::answer_file_name(pid))).unwrap())
            .unwrap();
    assert_eq!(answer.state, AnswerState::Taken);
    assert_eq!(answer.files, Some(files.len()));

    // The trainer exits and its staged directory disappears (a pod's emptyDir torn down).
    drop(trainer);
    std::fs::remove_dir_all(&dir).unwrap();

    let target = Target::open(
        &taken.resolved.destination,
        &taken.resolved.granted,
        &Default::default(),
    )
    .unwrap();
    let report = engine::run(Job {
        tree: taken.tree,
        target,
        meta: Meta {
            name: taken.resolved.name.clone(),
            step: req.step,
            ..Meta::default()
        },
        root: taken.root,
        options: small_parts(),
        progress: Default::default(),
        metrics: None,
        cancel: CancellationToken::new(),
        relayed: Default::default(),
    })
    .await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    let out = dest_base.path().join("run1/step-42");
    for (p, content) in &files {
        assert_eq!(std::fs::read(out.join(p)).unwrap(), *content, "{p}");
    }
    let m = Manifest::parse(
        &std::fs::read(out.join("manifest.json")).unwrap(),
        "step-42",
        None,
    )
    .unwrap();
    assert_manifest_lists(&m, &files);
    let loc = Location::parse(&dest_base.path().join("run1").display().to_string()).unwrap();
    let found = latest::latest(&loc, &Default::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.manifest.step, Some(42));
}

// ---------------------------------------------------------------------------------------------
// Filesystem destinations

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_destination_gets_synced_files_then_the_manifest_and_no_symlink_is_followed() {
    let files = dcp_like(2, 9 * MIB, 10);
    let (_t, dir) = stage("step-5", &as_refs(&files));
    let base = tempfile::tempdir().unwrap();
    let dest = Location::parse(&base.path().join("run1/step-5").display().to_string()).unwrap();
    let granted = spotguard::upload::dest::Granted::Dir {
        base: base.path().to_path_buf(),
        below: PathBuf::from("run1/step-5"),
        own: Vec::new(),
    };
    let target = Target::open(&dest, &granted, &Default::default()).unwrap();
    let r = engine::run(job(&dir, target, 5, small_parts())).await;
    assert_eq!(r.outcome, Outcome::Published, "{r:?}");
    let out = base.path().join("run1/step-5");
    for (p, content) in &files {
        assert_eq!(std::fs::read(out.join(p)).unwrap(), *content, "{p}");
    }
    let m = Manifest::parse(
        &std::fs::read(out.join("manifest.json")).unwrap(),
        "step-5",
        None,
    )
    .unwrap();
    assert_manifest_lists(&m, &files);
    assert!(m.files.iter().all(|f| f.verified_by.as_str() == "written"));
    // No temp file left anywhere.
    let leftovers: Vec<_> = walk(&out)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Someone with write access to the shared filesystem plants a symlink below the allowed
    // directory: the agent refuses to write through it.
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), base.path().join("run2")).unwrap();
    let dest = Location::parse(&base.path().join("run2/step-5").display().to_string()).unwrap();
    let granted = spotguard::upload::dest::Granted::Dir {
        base: base.path().to_path_buf(),
        below: PathBuf::from("run2/step-5"),
        own: Vec::new(),
    };
    match Target::open(&dest, &granted, &Default::default()) {
        Err(e) => assert!(e.to_string().contains("symlink"), "{e}"),
        Ok(_) => panic!("opened a destination through a symlink"),
    }
    assert!(std::fs::read_dir(elsewhere.path())
        .unwrap()
        .next()
        .is_none());
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The protocol end to end: the Python helper as a non-root trainer, the agent's take

/// The helper package, copied where another uid can read it.
fn helper_for_others() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let pkg = dir.path().join("spotguard");
    std::fs::create_dir(&pkg).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/spotguard");
    for e in std::fs::read_dir(src).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "py") {
            std::fs::copy(e.path(), pkg.join(e.file_name())).unwrap();
        }
    }
    std::fs::set_permissions(&pkg, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_helper_and_the_agent_agree_and_the_trainer_exits_once_taken() {
    use spotguard::checkpoint::ack::CheckpointDir;
    use spotguard::upload::ack::{self, Acker, StagedRequest};
    use spotguard::upload::dest::{AllowUpload, UploadPolicy};

    let helper = helper_for_others();
    let home = tempfile::tempdir().unwrap();
    std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let local = home.path().join("local");
    let ckdir = home.path().join("sg");
    for d in [&local, &ckdir] {
        std::fs::create_dir(d).unwrap();
        chown(d, 1000);
    }
    let dest = tempfile::tempdir().unwrap();
    // A trainer as uid 1000 (umask 077: its files are its own) saves, acks staged, and exits as
    // soon as the answer says taken.
    let script = format!(
        r#"
import json, os, sys, time
sys.path.insert(0, {helper:?})
import spotguard
os.umask(0o077)
d = os.path.join({local:?}, "step-8")
os.makedirs(os.path.join(d, "extra"))
with open(os.path.join(d, "__0_0.distcp"), "wb") as f:
    f.write(bytes(range(256)) * 40000)
with open(os.path.join(d, "extra", "rng.pt"), "wb") as f:
    f.write(b"rng")
a = spotguard.ack_staged(d, step=8, upload={upload:?}, wait=60)
print(json.dumps({{"state": a.state, "files": a.files, "error": a.error, "at": time.time()}}), flush=True)
"#,
        helper = helper.path().display().to_string(),
        local = local.display().to_string(),
        upload = dest.path().join("run1").display().to_string(),
    );
    let trainer = Command::new("setpriv")
        .args([
            "--reuid",
            "1000",
            "--regid",
            "1000",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
        ])
        .arg(&script)
        .env("SPOTGUARD_DIR", &ckdir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = trainer.id() as i32;
    let proc = ProcFs::default();
    wait_for_uid(&proc, pid, 1000);
    let start_time = proc.start_time(pid).unwrap();

    // The agent's side: read the ack as the responder does, take the checkpoint.
    let cdir = CheckpointDir::host(&ckdir).unwrap();
    let policy = UploadPolicy {
        allow: vec![AllowUpload::parse(&dest.path().display().to_string()).unwrap()],
        own_dirs: vec![ckdir.clone()],
    };
    // The job's location: the ack's `upload` (run1) is below it.
    let binding = ack::Binding {
        location: Some(dest.path().display().to_string()),
        writer: None,
        namespace: None,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let req = loop {
        if let Ok(Some(a)) = cdir.read_ack(pid) {
            if let Some(req) = StagedRequest::from_ack(&a.file).unwrap() {
                break req;
            }
        }
        assert!(Instant::now() < deadline, "no staged ack within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let acker = Acker {
        pid,
        start_time,
        ns_pid: pid,
    };
    let taken = ack::take(
        &proc,
        acker,
        &cdir,
        &req,
        &binding,
        &policy,
        &Limits::default(),
        &Default::default(),
    )
    .unwrap();
    let taken_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let out = tokio::task::spawn_blocking(move || trainer.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(said["state"], "taken", "{said}");
    assert_eq!(said["files"], 2);
    assert!(
        said["at"].as_f64().unwrap() - taken_at < 5.0,
        "the trainer kept waiting after the answer: {said}"
    );
    assert_eq!(taken.tree.owner, Some(1000));

    // The trainer is gone (and so would be its container); the files are still readable.
    std::fs::remove_dir_all(local.join("step-8")).unwrap();
    let target = Target::open(
        &taken.resolved.destination,
        &taken.resolved.granted,
        &Default::default(),
    )
    .unwrap();
    let report = engine::run(Job {
        tree: taken.tree,
        target,
        meta: Meta {
            name: taken.resolved.name.clone(),
            step: req.step,
            ..Meta::default()
        },
        root: taken.root,
        options: small_parts(),
        progress: Default::default(),
        metrics: None,
        cancel: CancellationToken::new(),
        relayed: Default::default(),
    })
    .await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    let out = dest.path().join("run1/step-8");
    assert_eq!(std::fs::read(out.join("extra/rng.pt")).unwrap(), b"rng");
    assert_eq!(
        std::fs::metadata(out.join("__0_0.distcp")).unwrap().len(),
        256 * 40000
    );
    assert!(out.join("manifest.json").exists());
}

#[test]
fn with_the_shipped_capabilities_the_agent_reads_what_others_may_read_and_nothing_else() {
    let proc = ProcFs::default();
    let trainer = trainer_as_1000();
    let pid = trainer.0.id() as i32;
    wait_for_uid(&proc, pid, 1000);
    let start = proc.start_time(pid).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("step-3");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("a.bin"), b"a").unwrap();
    std::fs::write(dir.join("b.bin"), b"b").unwrap();
    for p in [dir.clone(), dir.join("a.bin"), dir.join("b.bin")] {
        chown(&p, 1000);
    }
    // The trainer's umask 077 left one file private: the agent without DAC_OVERRIDE cannot read
    // it (and says which), as any other user could not.
    std::fs::set_permissions(dir.join("a.bin"), std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::set_permissions(dir.join("b.bin"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let d = dir.clone();
    let refused = with_shipped_capabilities(move || {
        let root = Root::of_process(&ProcFs::default(), pid, start)?;
        staged::capture(&root, &d, &Limits::default()).map(|t| t.files.len())
    });
    match refused {
        Err(Error::Staged { problem, path, .. }) => {
            assert_eq!(problem, Problem::Unreadable);
            assert!(path.ends_with("a.bin"), "{path}");
        }
        other => panic!("{other:?}"),
    }
    // What spotguard.ack_staged(make_readable=True) does: o+r. Now it is taken.
    std::fs::set_permissions(dir.join("a.bin"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let d = dir.clone();
    let taken = with_shipped_capabilities(move || {
        let root = Root::of_process(&ProcFs::default(), pid, start)?;
        staged::capture(&root, &d, &Limits::default()).map(|t| t.files.len())
    });
    assert_eq!(taken.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_saved_by_several_nodes_is_complete_only_with_every_part() {
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let upload = |dir: &Path, step: &str, part: Option<&str>| {
        let mut args = vec![
            "upload".to_string(),
            dir.display().to_string(),
            "s3://ckpt/run1".into(),
            "--step".into(),
            step.into(),
            "--progress".into(),
            "json".into(),
        ];
        if let Some(p) = part {
            args.extend(["--part".to_string(), p.to_string()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        spotguard(&args, &server.endpoint())
    };
    let (_t0, single) = stage("step-100", &[("w", data(1000, 1))]);
    assert_eq!(run(upload(&single, "100", None)).await.code, 0);
    // Two nodes each stage their own ranks' shards of step 200 (rank 0 also writes .metadata).
    let node0 = vec![
        ("__0_0.distcp", data(6 * MIB, 2)),
        (".metadata", data(300, 3)),
    ];
    let node1 = vec![("__1_0.distcp", data(6 * MIB, 4))];
    let (_t1, d0) = stage("step-200", &node0);
    let (_t2, d1) = stage("step-200", &node1);
    let r = run(upload(&d0, "200", Some("0/2"))).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        latest_via_cli(&server, "s3://ckpt/run1").await["name"],
        "step-100"
    );
    let r = run(upload(&d1, "200", Some("1/2"))).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let found = latest_via_cli(&server, "s3://ckpt/run1").await;
    assert_eq!(
        (found["name"].clone(), found["files"].clone()),
        ("step-200".into(), 3.into())
    );
    let store = s3(&server.endpoint());
    for key in ["manifest.part-0-of-2.json", "manifest.part-1-of-2.json"] {
        assert!(
            get(&store, &format!("run1/step-200/{key}")).await.is_some(),
            "{key}"
        );
    }
    assert_eq!(get(&store, "run1/step-200/manifest.json").await, None);

    let local = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        &[
            "prefetch",
            "--latest-checkpoint",
            "s3://ckpt/run1",
            &local.path().display().to_string(),
            "--progress",
            "none",
        ],
        &server.endpoint(),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    for (p, content) in node0.iter().chain(&node1) {
        assert_eq!(
            std::fs::read(local.path().join("step-200").join(p)).unwrap(),
            *content,
            "{p}"
        );
    }
}
