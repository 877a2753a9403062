//! `spotguard prefetch` against real S3-compatible servers on loopback: s3s-fs for most tests,
//! moto where `If-Match` must be honoured, and a small fault-injecting proxy in front of them
//! (503 SlowDown, 403/404 for one key, bandwidth limits, request counting).
//!
//! Needs `s3s-fs` and `moto_server`: run `scripts/deps/prefetch.sh` once.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload};
use serde_json::Value;
use spotguard_testkit::s3::proxy::{paced, s3_error, Body, Faults, Proxy};
use spotguard_testkit::s3::{create_bucket, S3Server, ACCESS_KEY, REGION, SECRET_KEY};

// ---------------------------------------------------------------------------------------------
// Servers

fn store(endpoint: &str, bucket: &str) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region(REGION)
            .with_client_options(ClientOptions::new().with_allow_http(true))
            .build()
            .unwrap(),
    )
}

/// A bucket on an S3 server of its own, made in one line
/// (`let bucket = Bucket::s3s_fs("data").await;`), with the test's objects put through the S3 API.
struct Bucket {
    server: S3Server,
    store: Arc<dyn ObjectStore>,
}

impl Bucket {
    /// On s3s-fs (keeps the checksums sent with an upload).
    async fn s3s_fs(name: &str) -> Bucket {
        Bucket::on(S3Server::s3s_fs(&[]), name).await
    }

    /// On moto (honours `If-Match` on GET).
    async fn moto(name: &str) -> Bucket {
        Bucket::on(S3Server::moto(), name).await
    }

    async fn on(server: S3Server, name: &str) -> Bucket {
        create_bucket(&server.endpoint(), name).await;
        let store = store(&server.endpoint(), name);
        Bucket { server, store }
    }

    fn endpoint(&self) -> String {
        self.server.endpoint()
    }

    async fn put(&self, key: &str, data: &[u8]) {
        put(&self.store, key, data).await;
    }

    async fn put_all<K: AsRef<str>, V: AsRef<[u8]>>(&self, objects: &[(K, V)]) {
        for (key, data) in objects {
            self.put(key.as_ref(), data.as_ref()).await;
        }
    }
}

async fn put(store: &Arc<dyn ObjectStore>, key: &str, data: &[u8]) {
    store
        .put(&ObjectPath::from(key), PutPayload::from(data.to_vec()))
        .await
        .unwrap_or_else(|e| panic!("put {key}: {e}"));
}

/// Deterministic, incompressible-enough test data.
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

// ---------------------------------------------------------------------------------------------
// The faults of the proxy in front of the server (spotguard_testkit::s3::proxy): 503 SlowDown,
// 403/404 or corrupted bytes for one key, a response rate limit, counting object GETs

#[derive(Default)]
struct ProxyState {
    /// Answer this many requests with 503 SlowDown first.
    slowdowns: AtomicU32,
    slowdowns_sent: AtomicU32,
    /// Answer GETs of paths ending in this key with this status.
    deny: Mutex<Option<(String, u16)>>,
    /// Flip a bit in every body chunk of GETs of paths ending in this key.
    corrupt: Mutex<Option<String>>,
    /// Response body rate limit per request, bytes/s (0 = none).
    rate_bps: AtomicU64,
    gets: AtomicU64,
    get_bytes: AtomicU64,
    bytes_by_path: Mutex<HashMap<String, u64>>,
}

impl Faults for ProxyState {
    fn answer(&self, req: &Parts) -> Option<Response<Body>> {
        if self
            .slowdowns
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            self.slowdowns_sent.fetch_add(1, Ordering::SeqCst);
            return Some(s3_error(503, "SlowDown"));
        }
        if req.method == http::Method::GET {
            if let Some((key, status)) = self.deny.lock().unwrap().clone() {
                if req.uri.path().ends_with(&key) {
                    let code = if status == 403 {
                        "AccessDenied"
                    } else {
                        "NoSuchKey"
                    };
                    return Some(s3_error(status, code));
                }
            }
        }
        None
    }

    /// Counts the bytes of object GETs, corrupts the chosen object's and paces every answer.
    fn response(self: &Arc<Self>, req: &Parts, resp: Response<Body>) -> Response<Body> {
        let path = req.uri.path().to_string();
        let is_get = req.method == http::Method::GET;
        let counted = is_get
            && resp.status().is_success()
            && !path.ends_with('/')
            && path.matches('/').count() >= 2;
        if counted {
            self.gets.fetch_add(1, Ordering::SeqCst);
        }
        let rate = self.rate_bps.load(Ordering::SeqCst);
        let corrupt = is_get
            && self
                .corrupt
                .lock()
                .unwrap()
                .as_ref()
                .is_some_and(|k| path.ends_with(k.as_str()));
        let st = self.clone();
        resp.map(|body| {
            let seen = body.map_frame(move |f| {
                f.map_data(|d| {
                    if d.is_empty() {
                        return d;
                    }
                    if counted {
                        let len = d.len() as u64;
                        st.get_bytes.fetch_add(len, Ordering::SeqCst);
                        *st.bytes_by_path
                            .lock()
                            .unwrap()
                            .entry(path.clone())
                            .or_default() += len;
                    }
                    if !corrupt {
                        return d;
                    }
                    let mut v = d.to_vec();
                    v[0] ^= 0x01;
                    Bytes::from(v)
                })
            });
            paced(seen.boxed(), rate)
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Running spotguard

/// The binary under test, copied once at the start: the target directory may be shared with
/// other builds that overwrite `CARGO_BIN_EXE_spotguard` while the tests run.
fn binary() -> &'static Path {
    static BIN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_name()
                .to_string_lossy()
                .starts_with("prefetch-test-spotguard-")
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let copy = dir.join(format!("prefetch-test-spotguard-{}", std::process::id()));
        std::fs::copy(env!("CARGO_BIN_EXE_spotguard"), &copy).unwrap();
        let help = Command::new(&copy)
            .args(["prefetch", "--help"])
            .output()
            .unwrap();
        assert!(
            help.status.success(),
            "{} is not this tree's spotguard (another build overwrote it): run the tests again",
            env!("CARGO_BIN_EXE_spotguard")
        );
        copy
    })
}

fn spotguard(src: &str, dest: &Path, endpoint: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(binary());
    c.arg("prefetch")
        .arg(src)
        .arg(dest)
        .args(["--endpoint", endpoint, "--progress", "json"])
        .args(extra)
        .envs(S3Server::client_env())
        .env("RUST_LOG", "spotguard=info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

struct RunResult {
    code: i32,
    summary: Value,
    stderr: String,
    stdout: String,
}

fn finish(out: Output) -> RunResult {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let summary = stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "summary")
        .unwrap_or(Value::Null);
    RunResult {
        code: out.status.code().unwrap_or(-1),
        summary,
        stderr,
        stdout,
    }
}

async fn run(cmd: Command) -> RunResult {
    let mut cmd = cmd;
    tokio::task::spawn_blocking(move || finish(cmd.output().unwrap()))
        .await
        .unwrap()
}

fn n(v: &Value, field: &str) -> u64 {
    v[field]
        .as_u64()
        .unwrap_or_else(|| panic!("summary has no {field}: {v}"))
}

fn walk(dir: &Path) -> Vec<PathBuf> {
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

fn part_files(dir: &Path) -> Vec<PathBuf> {
    walk(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".spotguard-part-"))
        .collect()
}

fn manifest(dir: &Path) -> HashMap<String, Value> {
    let text = std::fs::read_to_string(dir.join(".spotguard/manifest.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["objects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["key"].as_str().unwrap().to_string(), e.clone()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_prefetch_is_byte_identical_and_idempotent() {
    let bucket = Bucket::s3s_fs("data").await;
    let mut expected: Vec<(String, Vec<u8>)> = Vec::new();
    for i in 0..40u64 {
        let len = 1 + (i as usize * 7919) % (300 << 10);
        expected.push((format!("train/shard-{i:03}.bin"), data(len, i)));
    }
    expected.push((
        "train/deep/er/large-a.bin".into(),
        data((5 << 20) + 123, 100),
    ));
    expected.push(("train/large-b.bin".into(), data(3 << 20, 101)));
    expected.push(("train/empty".into(), Vec::new()));
    bucket.put_all(&expected).await;
    bucket.put("other/not-in-dataset", b"x").await;

    let cache = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        "s3://data/train",
        cache.path(),
        &bucket.endpoint(),
        &[
            "--name",
            "train",
            "--part-size",
            "1MiB",
            "--concurrency",
            "8",
        ],
    ))
    .await;
    assert_eq!(r.code, 0, "stderr: {}\nstdout: {}", r.stderr, r.stdout);
    let total: u64 = expected.iter().map(|(_, v)| v.len() as u64).sum();
    assert_eq!(r.summary["outcome"], "complete");
    assert_eq!(n(&r.summary, "files_total"), expected.len() as u64);
    assert_eq!(n(&r.summary, "files_fetched"), expected.len() as u64);
    assert_eq!(n(&r.summary, "bytes_total"), total);
    assert_eq!(n(&r.summary, "bytes_fetched"), total);
    let dir = cache.path().join("train");
    for (k, v) in &expected {
        let rel = k.strip_prefix("train/").unwrap();
        let got = std::fs::read(dir.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert!(got == *v, "{rel} differs");
    }
    assert!(!dir.join("not-in-dataset").exists());
    assert!(part_files(&dir).is_empty());
    assert!(dir.join(".spotguard/complete").exists());
    assert!(
        dir.join(".spotguard/lease").exists(),
        "the CLI touches the lease when done"
    );
    let m = manifest(&dir);
    assert_eq!(m.len(), expected.len());
    assert!(m.values().all(|e| e["done"] == true));
    assert!(
        std::fs::read_dir(dir.join(".spotguard/claims"))
            .unwrap()
            .next()
            .is_none(),
        "claims are released"
    );

    // Run again: everything is present, nothing is fetched.
    let again = run(spotguard(
        "s3://data/train",
        cache.path(),
        &bucket.endpoint(),
        &["--name", "train"],
    ))
    .await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert_eq!(n(&again.summary, "files_present"), expected.len() as u64);
    assert_eq!(n(&again.summary, "requests"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_with_a_ranged_get_after_kill_9() {
    let bucket = Bucket::s3s_fs("big").await;
    let size = 16 << 20;
    let payload = data(size, 7);
    bucket.put("ds/model.bin", &payload).await;
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    // 1 MiB/s per request, 2 requests at a time: the 16 MiB object takes ~8 s.
    proxy.state.rate_bps.store(1 << 20, Ordering::SeqCst);

    let cache = tempfile::tempdir().unwrap();
    let args = [
        "--name",
        "m",
        "--part-size",
        "1MiB",
        "--concurrency",
        "2",
        "--claim-lease",
        "3s",
    ];
    let mut child = spotguard("s3://big/ds", cache.path(), &proxy.endpoint(), &args)
        .spawn()
        .unwrap();
    let dir = cache.path().join("m");
    let claims = dir.join(".spotguard/claims");
    // Wait until the claim records at least 3 MiB written and synced, then kill -9.
    let deadline = Instant::now() + Duration::from_secs(60);
    let recorded = loop {
        assert!(
            Instant::now() < deadline,
            "no progress recorded in the claim"
        );
        let done: u64 = walk(&claims)
            .iter()
            .filter_map(|p| std::fs::read(p).ok())
            .filter_map(|b| serde_json::from_slice::<Value>(&b).ok())
            .map(|v| {
                v["done"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|r| r[1].as_u64().unwrap() - r[0].as_u64().unwrap())
                            .sum::<u64>()
                    })
                    .unwrap_or(0)
            })
            .sum();
        if done >= 3 << 20 {
            break done;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    assert!(recorded < size as u64, "the kill must land mid-object");
    assert!(
        !dir.join("model.bin").exists(),
        "nothing partial under the final name"
    );
    assert_eq!(
        part_files(&dir).len(),
        1,
        "the part file stays for resuming"
    );

    // Resume at full speed: the dead owner's claim is taken over at once (same host, dead pid).
    proxy.state.rate_bps.store(0, Ordering::SeqCst);
    let before = proxy.state.get_bytes.load(Ordering::SeqCst);
    let r = run(spotguard(
        "s3://big/ds",
        cache.path(),
        &proxy.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let resumed = n(&r.summary, "bytes_resumed");
    assert!(
        resumed >= recorded,
        "resumed {resumed} < recorded {recorded}"
    );
    assert_eq!(n(&r.summary, "bytes_fetched") + resumed, size as u64);
    let fetched_now = proxy.state.get_bytes.load(Ordering::SeqCst) - before;
    assert_eq!(
        fetched_now,
        size as u64 - resumed,
        "only the missing ranges were fetched"
    );
    assert!(std::fs::read(dir.join("model.bin")).unwrap() == payload);
    assert!(part_files(&dir).is_empty());
    assert!(
        r.stderr.contains("resuming a partial download"),
        "{}",
        r.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_checkpoints_and_the_next_run_resumes() {
    let bucket = Bucket::s3s_fs("sigterm").await;
    let payload = data(6 << 20, 9);
    bucket.put("p/x.bin", &payload).await;
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    proxy.state.rate_bps.store(512 << 10, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let args = ["--name", "x", "--part-size", "1MiB", "--concurrency", "2"];
    let child = spotguard("s3://sigterm/p", cache.path(), &proxy.endpoint(), &args)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let r = tokio::task::spawn_blocking(move || finish(child.wait_with_output().unwrap()))
        .await
        .unwrap();
    assert_eq!(r.code, 3, "cancelled: {}", r.stderr);
    assert_eq!(r.summary["outcome"], "cancelled");
    assert!(r.stderr.contains("run again to resume"));
    let progress: Vec<Value> = r
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "progress")
        .collect();
    assert!(
        !progress.is_empty(),
        "JSON progress lines every second: {}",
        r.stdout
    );
    for field in [
        "bytes_done",
        "bytes_total",
        "files_done",
        "files_total",
        "rate_bps",
    ] {
        assert!(progress[0][field].is_u64(), "{field} in {}", progress[0]);
    }
    let dir = cache.path().join("x");
    assert!(!dir.join("x.bin").exists());
    let claim: Value = serde_json::from_slice(
        &std::fs::read(walk(&dir.join(".spotguard/claims"))[0].clone()).unwrap(),
    )
    .unwrap();
    assert_eq!(
        claim["lease_until_ms"], 0,
        "lease ended for immediate takeover: {claim}\n{}",
        r.stderr
    );

    proxy.state.rate_bps.store(0, Ordering::SeqCst);
    let again = run(spotguard(
        "s3://sigterm/p",
        cache.path(),
        &proxy.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(again.code, 0, "{}", again.stderr);
    assert!(n(&again.summary, "bytes_resumed") > 0);
    assert!(std::fs::read(dir.join("x.bin")).unwrap() == payload);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_cache_and_fetch_each_object_once() {
    let bucket = Bucket::s3s_fs("shared").await;
    let mut objects = Vec::new();
    for i in 0..150u64 {
        objects.push((format!("ds/f{i:03}"), data(32 << 10, i)));
    }
    objects.push(("ds/big1".into(), data(4 << 20, 1000)));
    objects.push(("ds/big2".into(), data(3 << 20, 1001)));
    bucket.put_all(&objects).await;
    let total: u64 = objects.iter().map(|(_, v)| v.len() as u64).sum();
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    // Slow enough that the two runs overlap.
    proxy.state.rate_bps.store(4 << 20, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let args = [
        "--name",
        "shared",
        "--part-size",
        "1MiB",
        "--concurrency",
        "4",
    ];
    let a = spotguard("s3://shared/ds", cache.path(), &proxy.endpoint(), &args)
        .spawn()
        .unwrap();
    let b = spotguard("s3://shared/ds", cache.path(), &proxy.endpoint(), &args)
        .spawn()
        .unwrap();
    let (ra, rb) = tokio::task::spawn_blocking(move || {
        (
            finish(a.wait_with_output().unwrap()),
            finish(b.wait_with_output().unwrap()),
        )
    })
    .await
    .unwrap();
    assert_eq!(ra.code, 0, "{}", ra.stderr);
    assert_eq!(rb.code, 0, "{}", rb.stderr);
    let count = objects.len() as u64;
    let (fa, fb) = (
        n(&ra.summary, "files_fetched"),
        n(&rb.summary, "files_fetched"),
    );
    assert_eq!(fa + fb, count, "each object fetched once: {fa} + {fb}");
    assert!(fa > 0 && fb > 0, "both processes did work: {fa} + {fb}");
    assert_eq!(fa + n(&ra.summary, "files_by_others"), count);
    assert_eq!(fb + n(&rb.summary, "files_by_others"), count);
    assert_eq!(
        proxy.state.get_bytes.load(Ordering::SeqCst),
        total,
        "no byte downloaded twice"
    );
    let dir = cache.path().join("shared");
    for (k, v) in &objects {
        let rel = k.strip_prefix("ds/").unwrap();
        assert!(std::fs::read(dir.join(rel)).unwrap() == *v, "{rel}");
    }
    let m = manifest(&dir);
    assert_eq!(m.len(), objects.len());
    assert!(m.values().all(|e| e["done"] == true));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_objects_are_refetched_even_mid_download() {
    let bucket = Bucket::moto("chg").await;
    bucket.put("d/a.bin", &data(100 << 10, 1)).await;
    bucket.put("d/b.bin", &data(100 << 10, 2)).await;
    let cache = tempfile::tempdir().unwrap();
    let args = [
        "--name",
        "chg",
        "--part-size",
        "256KiB",
        "--concurrency",
        "2",
    ];
    let r = run(spotguard(
        "s3://chg/d",
        cache.path(),
        &bucket.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let dir = cache.path().join("chg");

    // Same size, new content: the etag differs from the manifest, so it is fetched again.
    let v2 = data(100 << 10, 3);
    bucket.put("d/a.bin", &v2).await;
    let r = run(spotguard(
        "s3://chg/d",
        cache.path(),
        &bucket.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(n(&r.summary, "files_fetched"), 1);
    assert_eq!(n(&r.summary, "files_present"), 1);
    assert!(std::fs::read(dir.join("a.bin")).unwrap() == v2);

    // Changed while being downloaded in parts: If-Match makes the remaining parts fail with 412,
    // and the object is fetched again from its new version.
    let big1 = data(4 << 20, 10);
    bucket.put("d/big.bin", &big1).await;
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    proxy.state.rate_bps.store(1 << 20, Ordering::SeqCst);
    let child = spotguard("s3://chg/d", cache.path(), &proxy.endpoint(), &args)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while proxy.state.get_bytes.load(Ordering::SeqCst) < 300 << 10 {
        assert!(Instant::now() < deadline, "download did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let big2 = data(4 << 20, 11);
    bucket.put("d/big.bin", &big2).await;
    proxy.state.rate_bps.store(0, Ordering::SeqCst);
    let r = tokio::task::spawn_blocking(move || finish(child.wait_with_output().unwrap()))
        .await
        .unwrap();
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        std::fs::read(dir.join("big.bin")).unwrap() == big2,
        "the new version, whole"
    );
    assert!(r.stderr.contains("changed at the source"), "{}", r.stderr);
    assert!(part_files(&dir).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_is_retried_with_backoff() {
    let bucket = Bucket::s3s_fs("thr").await;
    for i in 0..6u64 {
        bucket.put(&format!("t/{i}"), &data(50 << 10, i)).await;
    }
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    proxy.state.slowdowns.store(6, Ordering::SeqCst);
    let cache = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        "s3://thr/t",
        cache.path(),
        &proxy.endpoint(),
        &["--name", "t", "--concurrency", "2"],
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(proxy.state.slowdowns_sent.load(Ordering::SeqCst), 6);
    assert_eq!(n(&r.summary, "files_fetched"), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_denied_and_missing_objects_are_named() {
    let bucket = Bucket::s3s_fs("err").await;
    for k in ["e/ok.bin", "e/secret.bin", "e/vanished.bin"] {
        bucket.put(k, &data(10 << 10, 5)).await;
    }
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    *proxy.state.deny.lock().unwrap() = Some(("e/secret.bin".into(), 403));
    let cache = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        "s3://err/e",
        cache.path(),
        &proxy.endpoint(),
        &["--name", "e"],
    ))
    .await;
    assert_eq!(r.code, 1, "some objects failed: {}", r.stderr);
    assert_eq!(r.summary["outcome"], "incomplete");
    assert!(
        r.stderr.contains("secret.bin") && r.stderr.contains("access denied (403"),
        "{}",
        r.stderr
    );
    assert_eq!(r.summary["errors"][0]["kind"], "permission_denied");
    let dir = cache.path().join("e");
    assert!(dir.join("ok.bin").exists() && dir.join("vanished.bin").exists());
    assert!(!dir.join("secret.bin").exists());
    assert!(!dir.join(".spotguard/complete").exists());
    assert_eq!(manifest(&dir)["secret.bin"]["done"], false);

    *proxy.state.deny.lock().unwrap() = Some(("e/vanished.bin".into(), 404));
    std::fs::remove_file(dir.join("vanished.bin")).unwrap();
    let r = run(spotguard(
        "s3://err/e",
        cache.path(),
        &proxy.endpoint(),
        &["--name", "e"],
    ))
    .await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr.contains("vanished.bin") && r.stderr.contains("not found (404)"),
        "{}",
        r.stderr
    );
    assert_eq!(
        n(&r.summary, "files_fetched"),
        1,
        "secret.bin is allowed now"
    );
}

/// A tmpfs mounted for the test and unmounted when dropped.
struct TmpfsMount {
    dir: tempfile::TempDir,
}

impl TmpfsMount {
    fn new(size: &str) -> TmpfsMount {
        let dir = tempfile::tempdir().unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("mount (the tests run as root)");
        assert!(
            st.success(),
            "mount -t tmpfs failed (root and CAP_SYS_ADMIN needed)"
        );
        TmpfsMount { dir }
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_is_a_clear_error_and_leaves_the_cache_consistent() {
    let bucket = Bucket::s3s_fs("full").await;
    let objs = [
        ("f/a.bin", data(3 << 20, 1)),
        ("f/b.bin", data(3 << 20, 2)),
        ("f/c.bin", data(3 << 20, 3)),
    ];
    bucket.put_all(&objs).await;
    let mnt = TmpfsMount::new("8m");
    let r = run(spotguard(
        "s3://full/f",
        mnt.dir.path(),
        &bucket.endpoint(),
        &["--name", "f", "--concurrency", "1"],
    ))
    .await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.summary["outcome"], "failed");
    assert!(r.stderr.contains("disk full writing"), "{}", r.stderr);
    // The error names the object and its part file: "... f/b.bin.spotguard-part-... (object b.bin)".
    let failed = r
        .stderr
        .split("(object ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("no object named: {}", r.stderr))
        .to_string();
    assert!(
        r.stderr.contains(&format!("{failed}.spotguard-part-")),
        "names the part file: {}",
        r.stderr
    );
    let dir = mnt.dir.path().join("f");
    assert!(
        part_files(&dir).is_empty(),
        "part files removed: {:?}",
        part_files(&dir)
    );
    assert!(!dir.join(&failed).exists());
    assert!(!dir.join(".spotguard/complete").exists());
    // Consistent: what the manifest calls done is whole; nothing else is under a final name.
    let m = manifest(&dir);
    assert_eq!(m[&failed]["done"], false);
    let done = m.values().filter(|e| e["done"] == true).count();
    assert!((1..=2).contains(&done), "the first objects fit: {m:?}");
    for (k, v) in &objs {
        let rel = k.strip_prefix("f/").unwrap();
        if m[rel]["done"] == true {
            assert!(std::fs::read(dir.join(rel)).unwrap() == *v, "{rel}");
        } else {
            assert!(!dir.join(rel).exists(), "{rel} is not done but visible");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_escaping_the_dataset_is_rejected_by_name() {
    let bucket = Bucket::moto("esc").await;
    // object_store refuses to write such a key; send the PUT raw (moto does not check auth).
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let req = Request::put(format!(
        "{}/esc/d/%2E%2E/%2E%2E/escape.txt",
        bucket.endpoint()
    ))
    .body(Full::new(Bytes::from_static(b"owned")))
    .unwrap();
    let resp = client.request(req).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    bucket.put("d/fine.txt", b"fine").await;
    let cache = tempfile::tempdir().unwrap();
    let inner = cache.path().join("root");
    let r = run(spotguard(
        "s3://esc/d",
        &inner,
        &bucket.endpoint(),
        &["--name", "d"],
    ))
    .await;
    assert_ne!(r.code, 0);
    assert!(
        r.stderr.contains("d/../../escape.txt"),
        "names the key: {}",
        r.stderr
    );
    assert!(r.stderr.contains("escapes the dataset"), "{}", r.stderr);
    assert!(!cache.path().join("escape.txt").exists());
    assert!(!inner.join("escape.txt").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_removes_the_least_recently_used_dataset_not_in_use() {
    let bucket = Bucket::s3s_fs("evict").await;
    for ds in ["a", "b", "c", "d"] {
        put(
            &bucket.store,
            &format!("{ds}/blob"),
            &data(1 << 20, ds.as_bytes()[0] as u64),
        )
        .await;
    }
    let cache = tempfile::tempdir().unwrap();
    let window = ["--in-use-window", "2s", "--cache-max-bytes", "3MiB"];
    for ds in ["a", "b", "c"] {
        let mut args = vec!["--name", ds];
        args.extend(window);
        let r = run(spotguard(
            &format!("s3://evict/{ds}"),
            cache.path(),
            &bucket.endpoint(),
            &args,
        ))
        .await;
        assert_eq!(r.code, 0, "{ds}: {}", r.stderr);
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    tokio::time::sleep(Duration::from_millis(2000)).await;
    // "a" is the least recently used, but a job is reading it (it touches the lease).
    std::fs::File::options()
        .write(true)
        .open(cache.path().join("a/.spotguard/lease"))
        .unwrap()
        .set_modified(std::time::SystemTime::now())
        .unwrap();
    let mut args = vec!["--name", "d"];
    args.extend(window);
    let r = run(spotguard(
        "s3://evict/d",
        cache.path(),
        &bucket.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        r.summary["evicted"],
        serde_json::json!(["b"]),
        "{}",
        r.summary
    );
    assert!(cache.path().join("a/blob").exists());
    assert!(!cache.path().join("b").exists());
    assert!(cache.path().join("c/blob").exists() && cache.path().join("d/blob").exists());

    // Nothing evictable is left (a in use, c and d too recent): a clear error.
    bucket.put("e/blob", &data(2 << 20, 9)).await;
    let mut args = vec!["--name", "e", "--cache-max-bytes", "3MiB"];
    args.extend(["--in-use-window", "1h"]);
    let r = run(spotguard(
        "s3://evict/e",
        cache.path(),
        &bucket.endpoint(),
        &args,
    ))
    .await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("cache full"), "{}", r.stderr);
}

// ---------------------------------------------------------------------------------------------
// Verification with the stores' checksums, publish order, pod requests, --wait.

/// Upload `data` with an additional checksum header (`x-amz-checksum-<alg>`), signed like any
/// default header; the server checks it and keeps it.
async fn put_with_checksum(endpoint: &str, bucket: &str, key: &str, data: &[u8], alg: &str) {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let value = match alg {
        "crc64nvme" => {
            b64(&crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, data).to_be_bytes())
        }
        "crc32c" => b64(
            &(crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32).to_be_bytes(),
        ),
        "crc32" => b64(
            &(crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32IsoHdlc, data) as u32).to_be_bytes(),
        ),
        "sha256" => {
            use sha2::Digest;
            b64(&sha2::Sha256::digest(data))
        }
        other => panic!("{other}"),
    };
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::HeaderName::from_bytes(format!("x-amz-checksum-{alg}").as_bytes()).unwrap(),
        value.parse().unwrap(),
    );
    let s: Arc<dyn ObjectStore> = Arc::new(
        AmazonS3Builder::new()
            .with_endpoint(endpoint)
            .with_bucket_name(bucket)
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region(REGION)
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(true)
                    .with_default_headers(headers),
            )
            .build()
            .unwrap(),
    );
    put(&s, key, data).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_checksums_verify_whole_and_ranged_objects_and_the_summary_says_how() {
    // s3s-fs keeps a checksum sent with the upload and returns it with
    // x-amz-checksum-mode: ENABLED, on GET and HEAD.
    let bucket = Bucket::s3s_fs("sums").await;
    let mut want = HashMap::new();
    for (i, alg) in ["crc64nvme", "crc32c", "crc32", "sha256"]
        .iter()
        .enumerate()
    {
        // One object fetched with one GET, one in ranged parts (--part-size 64KiB).
        let small = data(20_000 + i, 10 + i as u64);
        let big = data((300 << 10) + i, 20 + i as u64);
        put_with_checksum(
            &bucket.endpoint(),
            "sums",
            &format!("ds/{alg}-small"),
            &small,
            alg,
        )
        .await;
        put_with_checksum(
            &bucket.endpoint(),
            "sums",
            &format!("ds/{alg}-big"),
            &big,
            alg,
        )
        .await;
        want.insert(format!("{alg}-small"), small);
        want.insert(format!("{alg}-big"), big);
    }
    // Without a checksum: the plain-MD5 etag.
    let plain = data(5000, 99);
    bucket.put("ds/plain", &plain).await;
    want.insert("plain".to_string(), plain);

    let cache = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        "s3://sums/ds",
        cache.path(),
        &bucket.endpoint(),
        &["--name", "ds", "--part-size", "64KiB"],
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let s = &r.summary;
    assert_eq!(
        (
            n(s, "verified_crc64nvme"),
            n(s, "verified_crc32c"),
            n(s, "verified_crc32"),
            n(s, "verified_sha256"),
            n(s, "verified_md5"),
            n(s, "verified_size"),
        ),
        (2, 2, 2, 2, 1, 0),
        "{s}"
    );
    for (key, bytes) in &want {
        assert_eq!(
            &std::fs::read(cache.path().join("ds").join(key)).unwrap(),
            bytes,
            "{key}"
        );
    }

    // --verify size checks sizes only, and says so.
    let again = tempfile::tempdir().unwrap();
    let r = run(spotguard(
        "s3://sums/ds",
        again.path(),
        &bucket.endpoint(),
        &["--name", "ds", "--verify", "size"],
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(n(&r.summary, "verified_size"), 9, "{}", r.summary);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_right_after_a_rename_leaves_only_whole_synced_files_and_resumes() {
    let bucket = Bucket::s3s_fs("order").await;
    let mut want = HashMap::new();
    for i in 0..4u64 {
        let d = data(200_000 + i as usize, i);
        bucket.put(&format!("ds/f{i}"), &d).await;
        want.insert(format!("f{i}"), d);
    }
    let cache = tempfile::tempdir().unwrap();
    let mut cmd = spotguard(
        "s3://order/ds",
        cache.path(),
        &bucket.endpoint(),
        &["--name", "ds", "--part-size", "64KiB", "--concurrency", "2"],
    );
    // Debug builds: SIGKILL right after the first rename, before the directory sync and the
    // manifest update.
    cmd.env("SPOTGUARD_PREFETCH_FAILPOINT", "kill-after-rename");
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), Some(9), "{out:?}");
    let ds = cache.path().join("ds");
    // What is under a final name is whole (its data was synced before the rename).
    let published: Vec<String> = want
        .keys()
        .filter(|k| ds.join(k).exists())
        .cloned()
        .collect();
    assert!(!published.is_empty(), "the failpoint fires after a rename");
    for k in &published {
        assert_eq!(&std::fs::read(ds.join(k)).unwrap(), &want[k], "{k}");
    }
    // Not recorded as done, and the dataset is not complete.
    let recorded_done = std::fs::read_to_string(ds.join(".spotguard/manifest.json"))
        .map(|t| t.contains("\"done\":true"))
        .unwrap_or(false);
    assert!(!recorded_done);
    assert!(!ds.join(".spotguard/complete").exists());

    let r = run(spotguard(
        "s3://order/ds",
        cache.path(),
        &bucket.endpoint(),
        &["--name", "ds", "--part-size", "64KiB"],
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    for (k, d) in &want {
        assert_eq!(&std::fs::read(ds.join(k)).unwrap(), d, "{k}");
    }
    assert!(part_files(&ds).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urls_that_used_to_collide_get_their_own_directories_and_a_name_is_never_reused_for_another_source(
) {
    let server = S3Server::s3s_fs(&[]);
    // Both named "aaa-b-c" before.
    for b in ["aaa", "aaa-b"] {
        create_bucket(&server.endpoint(), b).await;
    }
    put(&store(&server.endpoint(), "aaa"), "b/c/x", &data(100, 1)).await;
    put(&store(&server.endpoint(), "aaa-b"), "c/x", &data(100, 2)).await;
    let cache = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    for url in ["s3://aaa/b/c", "s3://aaa-b/c"] {
        let r = run(spotguard(url, cache.path(), &server.endpoint(), &[])).await;
        assert_eq!(r.code, 0, "{}", r.stderr);
        dirs.push(r.summary["dir"].as_str().unwrap().to_string());
    }
    assert_ne!(dirs[0], dirs[1]);
    assert_eq!(
        std::fs::read(Path::new(&dirs[0]).join("x")).unwrap(),
        data(100, 1)
    );
    assert_eq!(
        std::fs::read(Path::new(&dirs[1]).join("x")).unwrap(),
        data(100, 2)
    );

    // The same name for another source: refused, the existing dataset untouched.
    let r = run(spotguard(
        "s3://aaa/b/c",
        cache.path(),
        &server.endpoint(),
        &["--name", "shared"],
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = run(spotguard(
        "s3://aaa-b/c",
        cache.path(),
        &server.endpoint(),
        &["--name", "shared"],
    ))
    .await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("already prefetched from s3://aaa/b/c"),
        "{}",
        r.stderr
    );
    assert_eq!(
        std::fs::read(cache.path().join("shared/x")).unwrap(),
        data(100, 1)
    );
    assert!(cache.path().join("shared/.spotguard/complete").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_returns_when_the_dataset_completes() {
    let bucket = Bucket::s3s_fs("waitb").await;
    put(
        &store(&bucket.endpoint(), "waitb"),
        "ds/x",
        &data(50_000, 3),
    )
    .await;
    let cache = tempfile::tempdir().unwrap();
    let mut waiter = Command::new(binary())
        .args([
            "prefetch",
            "--wait",
            "c4",
            "--source",
            "s3://waitb/ds/",
            "--timeout",
            "60s",
        ])
        .arg(cache.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        waiter.try_wait().unwrap().is_none(),
        "returned before the dataset exists"
    );
    // Fetched with the privileges the prefetch container ships with: root, no capabilities.
    let r = run(without_capabilities(spotguard(
        "s3://waitb/ds",
        cache.path(),
        &bucket.endpoint(),
        &["--name", "c4"],
    )))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let started = Instant::now();
    let status = loop {
        if let Some(s) = waiter.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "--wait did not return"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Some(0));
    // A timeout on a dataset that never comes: exit 3.
    let out = Command::new(binary())
        .args(["prefetch", "--wait", "never", "--timeout", "1s"])
        .arg(cache.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_bytes_fail_the_store_checksum_and_are_never_published() {
    let bucket = Bucket::s3s_fs("bad").await;
    let big = data(300 << 10, 5);
    let small = data(30_000, 6);
    put_with_checksum(&bucket.endpoint(), "bad", "ds/big", &big, "crc64nvme").await;
    put_with_checksum(&bucket.endpoint(), "bad", "ds/small", &small, "crc32c").await;
    let proxy = Proxy::start(&bucket.server, ProxyState::default()).await;
    let cache = tempfile::tempdir().unwrap();
    for key in ["ds/big", "ds/small"] {
        *proxy.state.corrupt.lock().unwrap() = Some(key.to_string());
        let r = run(spotguard(
            "s3://bad/ds",
            cache.path(),
            &proxy.endpoint(),
            &["--name", "ds", "--part-size", "64KiB"],
        ))
        .await;
        assert_eq!(r.code, 1, "{key}: {}", r.stderr);
        let failed = key.trim_start_matches("ds/");
        let errors = r.summary["errors"].as_array().unwrap();
        assert_eq!(errors.len(), 1, "{}", r.summary);
        assert_eq!(errors[0]["key"], failed);
        assert_eq!(errors[0]["kind"], "checksum_mismatch");
        assert!(!cache.path().join("ds").join(failed).exists());
        assert!(part_files(&cache.path().join("ds")).is_empty());
        *proxy.state.corrupt.lock().unwrap() = None;
        let r = run(spotguard(
            "s3://bad/ds",
            cache.path(),
            &proxy.endpoint(),
            &["--name", "ds", "--part-size", "64KiB"],
        ))
        .await;
        assert_eq!(r.code, 0, "{}", r.stderr);
        std::fs::remove_dir_all(cache.path().join("ds")).unwrap();
    }
}

/// `cmd` under `setpriv` with every capability dropped (bounding and inheritable sets) and no
/// new privileges: how the DaemonSet's prefetch container runs.
fn without_capabilities(cmd: Command) -> Command {
    let mut c = Command::new("setpriv");
    c.args([
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ])
    .arg(cmd.get_program())
    .args(cmd.get_args())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    c
}

/// An ext4 filesystem in a file, mounted on a loop device at `at`; unmounted when dropped.
struct Ext4Loop {
    at: PathBuf,
    _image: tempfile::TempDir,
}

impl Ext4Loop {
    fn new(at: &Path) -> Ext4Loop {
        let image = tempfile::tempdir().unwrap();
        let file = image.path().join("fs.img");
        std::fs::File::create(&file)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let ok = Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&file)
            .status()
            .expect("mkfs.ext4")
            .success();
        assert!(ok, "mkfs.ext4");
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&file)
            .arg(at)
            .status()
            .expect("mount -o loop (the tests run as root)")
            .success();
        assert!(ok, "mount -o loop");
        Ext4Loop {
            at: at.to_path_buf(),
            _image: image,
        }
    }

    /// Shut the filesystem down (`EXT4_IOC_SHUTDOWN`, no log flush): every later write and
    /// sync fails with EIO, as on a disk that went away.
    fn shut_down(at: &Path) {
        const EXT4_IOC_SHUTDOWN: libc::c_ulong = 0x8004_587D;
        const EXT4_GOING_FLAGS_NOLOGFLUSH: u32 = 2;
        let dir = std::fs::File::open(at).unwrap();
        let flags = EXT4_GOING_FLAGS_NOLOGFLUSH;
        // SAFETY: the ioctl reads one u32 from a pointer that lives across the call.
        let rc = unsafe {
            libc::ioctl(
                std::os::fd::AsRawFd::as_raw_fd(&dir),
                EXT4_IOC_SHUTDOWN as _,
                &flags,
            )
        };
        assert_eq!(rc, 0, "shutdown: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Ext4Loop {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// Issue 24 item 6: the directory sync after publishing a file fails (EIO: the dataset's disk
/// goes away right after the rename, the manifest's filesystem stays): the error surfaces, and
/// the manifest never names the file whose directory entry may be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_directory_sync_surfaces_and_the_manifest_does_not_name_the_file() {
    use spotguard::prefetch::cache::DatasetPaths;
    use spotguard::prefetch::download::{self, Failpoint, Job, PublishStep};
    use spotguard::prefetch::{FetchOptions, Outcome, Progress, SourceUrl};

    let root = tempfile::tempdir().unwrap();
    let ds = root.path().join("ds");
    let _disk = Ext4Loop::new(&ds);
    // The manifest, claims and lease live on a healthy filesystem.
    let meta = ds.join(".spotguard");
    std::fs::create_dir_all(&meta).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(&meta)
        .status()
        .unwrap()
        .success();
    assert!(ok, "mount tmpfs");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _meta = Unmount(meta.clone());

    let store = Arc::new(object_store::memory::InMemory::new());
    store
        .put(
            &ObjectPath::from("ds/d/file"),
            PutPayload::from(data(5000, 9)),
        )
        .await
        .unwrap();
    let disk = ds.clone();
    let failpoint = Failpoint(Arc::new(move |step, _path| {
        if step == PublishStep::Renamed {
            Ext4Loop::shut_down(&disk);
        }
    }));
    let job = Job {
        store,
        source: SourceUrl::parse("s3://bucket/ds").unwrap(),
        paths: DatasetPaths::new(root.path(), "ds"),
        cache_root: root.path().to_path_buf(),
        options: FetchOptions {
            failpoint: Some(failpoint),
            ..FetchOptions::default()
        },
        progress: Arc::new(Progress::default()),
        metrics: None,
        cancel: tokio_util::sync::CancellationToken::new(),
    };
    let report = download::fetch_dataset(job).await;
    assert_ne!(
        report.summary.outcome,
        Outcome::Complete,
        "{:?}",
        report.summary
    );
    let said = format!("{:?}", report.summary);
    assert!(said.contains("sync directory"), "{said}");
    let names_it = std::fs::read_to_string(meta.join("manifest.json"))
        .map(|t| t.contains("\"done\":true"))
        .unwrap_or(false);
    assert!(
        !names_it,
        "the manifest names a file whose directory sync failed"
    );
    assert!(!meta.join("complete").exists());
}
