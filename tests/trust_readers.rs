//! The resume side against a hostile bucket or directory (issue 29, items 3 and 8):
//! `prefetch --latest-checkpoint` takes only the location owner's checkpoints, fetches only the
//! files a manifest lists, verifies each file's CRCs before it calls a checkpoint complete,
//! refuses manifests that name paths outside the checkpoint, reads every body with a cap, lists
//! the location once, and stops at `--timeout` and on SIGTERM in every phase.
//!
//! The reader runs as uid 1000 (a trainer), against s3s-fs (objects are plain files under its
//! directory, so a test writes the hostile bucket directly) behind the testkit's fault proxy.
//!
//! Needs `s3s-fs`: run `scripts/deps/prefetch.sh` once.

use std::os::unix::fs::{chown, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::request::Parts;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::Response;
use serde_json::Value;
use spotguard::upload::crc::Crcs;
use spotguard::upload::manifest::{
    hex32, hex64, Manifest, ManifestFile, Origin, Timings, VerifiedBy, FORMAT,
};
use spotguard::upload::owner::{Marker, Writer, MARKER_NAME};
use spotguard_testkit::s3::proxy::{Body, BoxError, Faults, Proxy};
use spotguard_testkit::s3::S3Server;

const BUCKET: &str = "ckpt";
const OWNER: &str = "k8s:ml/JobSet/train-a";
const TRAINER: u32 = 1000;
/// `prefetch`'s exit codes.
const EXIT_FAILED: i32 = 2;
const EXIT_CANCELLED: i32 = 3;

// ---------------------------------------------------------------------------------------------
// A location written directly: files, a manifest with their CRCs, the owner marker.

fn manifest(
    name: &str,
    step: Option<u64>,
    files: &[(&str, &[u8])],
    writer: Option<&str>,
) -> Manifest {
    let files: Vec<ManifestFile> = files
        .iter()
        .map(|(path, content)| {
            let c = Crcs::of(content);
            ManifestFile {
                path: path.to_string(),
                size: content.len() as u64,
                crc64nvme: hex64(c.crc64nvme),
                crc32c: hex32(c.crc32c),
                verified_by: VerifiedBy::Crc64Nvme,
            }
        })
        .collect();
    Manifest {
        format: FORMAT.into(),
        name: name.into(),
        step,
        part: None,
        file_count: files.len(),
        bytes: files.iter().map(|f| f.size).sum(),
        files,
        notice: None,
        origin: Origin::default(),
        timings: Timings {
            acked_at: None,
            started_at: "2026-01-01T00:00:00Z".into(),
            completed_at: "2026-01-01T00:00:01Z".into(),
            upload_seconds: 1.0,
            resumed: false,
        },
        spotguard_version: "0.1.0".into(),
        writer: writer.map(str::to_string),
    }
}

/// Checkpoint `name` under directory `location`: its files, then its manifest.
fn put(
    location: &Path,
    name: &str,
    step: Option<u64>,
    files: &[(&str, &[u8])],
    writer: Option<&str>,
) {
    let dir = location.join(name);
    for (path, content) in files {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }
    put_manifest(location, &manifest(name, step, files, writer));
}

fn put_manifest(location: &Path, m: &Manifest) {
    let dir = location.join(&m.name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("manifest.json"), m.to_bytes()).unwrap();
}

fn mark_owner(location: &Path, writer: &str) {
    std::fs::create_dir_all(location).unwrap();
    std::fs::write(
        location.join(MARKER_NAME),
        Marker::new(Writer(writer.into())).to_bytes(),
    )
    .unwrap();
}

fn shard(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// A directory the trainer (uid 1000) may write: DEST.
fn trainer_dir() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    chown(t.path(), Some(TRAINER), Some(TRAINER)).unwrap();
    t
}

/// A directory location the trainer may read.
fn readable_dir() -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    t
}

// ---------------------------------------------------------------------------------------------
// The reader: `spotguard prefetch --latest-checkpoint` as the trainer.

fn reader(args: &[&str], endpoint: Option<&str>) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.arg("prefetch")
        .arg("--latest-checkpoint")
        .args(args)
        .args(["--progress", "none"])
        .envs(S3Server::client_env())
        .env("SPOTGUARD_LOG_LEVEL", "spotguard=debug")
        .uid(TRAINER)
        .gid(TRAINER)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(e) = endpoint {
        c.args(["--endpoint", e]);
    }
    c
}

struct Ran {
    code: i32,
    json: Value,
    stderr: String,
}

fn ran(out: Output) -> Ran {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    Ran {
        code: out.status.code().unwrap_or(-1),
        json: stdout
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn run(mut cmd: Command) -> Ran {
    ran(tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap())
}

/// Every file under `dir` (relative, `/`-separated), `.spotguard/` (the prefetcher's own) left out.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap().map(Result::unwrap) {
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
            if rel == ".spotguard" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                walk(root, &p, out);
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    if dir.exists() {
        walk(dir, dir, &mut out);
    }
    out.sort();
    out
}

// ---------------------------------------------------------------------------------------------
// The fault proxy: counts LISTs and manifest GETs; can swap a manifest's body.

#[derive(Default)]
struct Counting {
    lists: AtomicU64,
    manifest_gets: AtomicU64,
    /// A GET of a key ending in this is answered with `swap_len` bytes instead.
    swap: std::sync::Mutex<Option<String>>,
    swap_len: AtomicU64,
    /// Bytes of the swapped body the client pulled.
    swapped_served: Arc<AtomicU64>,
    /// Answers to hold forever (headers sent, the body never comes): LISTs, or GETs of keys
    /// ending in this.
    hang_lists: std::sync::atomic::AtomicBool,
    hang_suffix: std::sync::Mutex<Option<String>>,
    /// Answers held so far.
    hung: AtomicU64,
}

impl Counting {
    fn hang(&self, resp: Response<Body>) -> Response<Body> {
        self.hung.fetch_add(1, Ordering::SeqCst);
        let (parts, _) = resp.into_parts();
        let never = futures::stream::pending::<Result<Frame<Bytes>, BoxError>>();
        Response::from_parts(parts, BodyExt::boxed(StreamBody::new(never)))
    }
}

impl Faults for Counting {
    fn response(self: &Arc<Self>, req: &Parts, resp: Response<Body>) -> Response<Body> {
        let query = req.uri.query().unwrap_or("");
        if req.method == http::Method::GET && query.contains("list-type") {
            self.lists.fetch_add(1, Ordering::SeqCst);
            if self.hang_lists.load(Ordering::SeqCst) {
                return self.hang(resp);
            }
        }
        let path = req.uri.path();
        let hang = self.hang_suffix.lock().unwrap().clone();
        if req.method == http::Method::GET && hang.is_some_and(|h| path.ends_with(&h)) {
            return self.hang(resp);
        }
        if req.method == http::Method::GET && path.ends_with("/manifest.json") {
            self.manifest_gets.fetch_add(1, Ordering::SeqCst);
            let swap = self.swap.lock().unwrap().clone();
            if swap.is_some_and(|s| path.ends_with(&s)) && resp.status().is_success() {
                let len = self.swap_len.load(Ordering::SeqCst);
                let (mut parts, _) = resp.into_parts();
                parts
                    .headers
                    .insert(http::header::CONTENT_LENGTH, len.into());
                parts.headers.remove(http::header::ETAG);
                let served = self.swapped_served.clone();
                const CHUNK: u64 = 1 << 20;
                let body = futures::stream::iter(0..len.div_ceil(CHUNK)).map(move |i| {
                    let n = CHUNK.min(len - i * CHUNK);
                    served.fetch_add(n, Ordering::SeqCst);
                    Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b' '; n as usize])))
                });
                return Response::from_parts(parts, BodyExt::boxed(StreamBody::new(body)));
            }
        }
        resp
    }
}

fn s3_location(server: &S3Server, prefix: &str) -> PathBuf {
    server.object_path(BUCKET, prefix)
}

// ---------------------------------------------------------------------------------------------
// Item 3: only the manifest's files, every file verified, clean paths.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_size_overwrite_of_a_shard_is_an_error_naming_it_and_nothing_is_reported() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    mark_owner(&loc, OWNER);
    let (a, b) = (shard(300_000, 1), shard(200_000, 2));
    put(
        &loc,
        "step-5",
        Some(5),
        &[("rank0/a.distcp", &a), ("b", &b)],
        Some(OWNER),
    );
    // The store's copy of b changes after the manifest was written: same size, other bytes.
    let mut evil = b.clone();
    evil[100_000] ^= 0xff;
    std::fs::write(loc.join("step-5/b"), &evil).unwrap();

    let dest = trainer_dir();
    let r = run(reader(
        &["s3://ckpt/run1", dest.path().to_str().unwrap()],
        Some(&server.endpoint()),
    ))
    .await;
    assert_eq!(r.code, EXIT_FAILED, "{}", r.stderr);
    assert!(
        r.stderr.contains("step-5/b") && r.stderr.contains("CRC"),
        "{}",
        r.stderr
    );
    assert_eq!(r.json, Value::Null, "a checkpoint was reported: {}", r.json);
    // The bad copy is gone and nothing says the dataset is complete.
    let got = dest.path().join("step-5");
    assert!(!got.join("b").exists());
    assert!(!got.join(".spotguard/complete").exists());
    assert!(!got.join("manifest.json").exists());

    // Put right, the same run fetches, verifies and reports it.
    std::fs::write(loc.join("step-5/b"), &b).unwrap();
    let r = run(reader(
        &["s3://ckpt/run1", dest.path().to_str().unwrap()],
        Some(&server.endpoint()),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], "step-5");
    assert_eq!(std::fs::read(got.join("b")).unwrap(), b);
    assert_eq!(std::fs::read(got.join("rank0/a.distcp")).unwrap(), a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_files_the_manifest_lists_are_fetched_and_odd_names_round_trip() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("w", shard(1000, 3)),
        ("a\\b", shard(10, 4)),
        ("%25", shard(11, 5)),
        ("q?x#y", shard(12, 6)),
        ("sub/manifest.json", shard(13, 7)),
    ];
    let refs: Vec<(&str, &[u8])> = files.iter().map(|(p, c)| (*p, c.as_slice())).collect();
    put(&loc, "step-7", Some(7), &refs, None);
    // Written into the checkpoint's directory by someone else: not the checkpoint's.
    std::fs::write(loc.join("step-7/evil.py"), b"import os; os.system('id')").unwrap();
    std::fs::create_dir_all(loc.join("step-7/extra")).unwrap();
    std::fs::write(loc.join("step-7/extra/x"), b"x").unwrap();

    let dest = trainer_dir();
    let r = run(reader(
        &["s3://ckpt/run1", dest.path().to_str().unwrap()],
        Some(&server.endpoint()),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], "step-7");
    let got = dest.path().join("step-7");
    let mut want: Vec<String> = files.iter().map(|(p, _)| p.to_string()).collect();
    want.push("manifest.json".into());
    want.sort();
    assert_eq!(tree(&got), want);
    for (p, content) in &files {
        assert_eq!(&std::fs::read(got.join(p)).unwrap(), content, "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_naming_paths_outside_its_checkpoint_is_not_a_checkpoint() {
    let loc = readable_dir();
    let good = shard(64, 9);
    put(loc.path(), "step-5", Some(5), &[("w", &good)], None);
    // Newer, but listing a host file (its real size and CRCs) or a path above the checkpoint.
    let host = std::fs::read("/etc/hostname").unwrap_or_default();
    put_manifest(
        loc.path(),
        &manifest("step-8", Some(8), &[("/etc/hostname", &host)], None),
    );
    std::fs::write(loc.path().join("x"), b"outside").unwrap();
    put_manifest(
        loc.path(),
        &manifest("step-9", Some(9), &[("../x", b"outside")], None),
    );

    let location = loc.path().to_str().unwrap();
    let r = run(reader(&[location], None)).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], "step-5", "{}", r.json);
    let dest = trainer_dir();
    let r = run(reader(&[location, dest.path().to_str().unwrap()], None)).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], "step-5", "{}", r.json);
    assert_eq!(tree(&dest.path().join("step-5")), ["manifest.json", "w"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_make_latest_theirs() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    mark_owner(&loc, OWNER);
    let mine = shard(100, 1);
    put(&loc, "step-200", Some(200), &[("w", &mine)], Some(OWNER));
    // Another job's, with a higher step; a step its name does not prove; an absurd step.
    put(
        &loc,
        "step-900",
        Some(900),
        &[("w", b"theirs")],
        Some("host:uid:1001"),
    );
    put(
        &loc,
        "step-201",
        Some(u64::MAX),
        &[("w", b"theirs")],
        Some(OWNER),
    );
    put(
        &loc,
        "step-18446744073709551615",
        None,
        &[("w", b"theirs")],
        Some(OWNER),
    );
    put(&loc, "step-300", None, &[("w", b"theirs")], None);

    let dest = trainer_dir();
    let r = run(reader(
        &["s3://ckpt/run1", dest.path().to_str().unwrap()],
        Some(&server.endpoint()),
    ))
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(
        (&r.json["name"], &r.json["step"]),
        (&"step-200".into(), &200.into()),
        "{}",
        r.json
    );
    assert_eq!(std::fs::read(dest.path().join("step-200/w")).unwrap(), mine);

    // A marker that cannot be read trusts nothing: an error, not another job's checkpoint.
    std::fs::write(loc.join(MARKER_NAME), vec![b' '; 1 << 20]).unwrap();
    let r = run(reader(&["s3://ckpt/run1"], Some(&server.endpoint()))).await;
    assert_eq!(r.code, EXIT_FAILED, "{}", r.stderr);
    assert!(r.stderr.contains(MARKER_NAME), "{}", r.stderr);
}

// ---------------------------------------------------------------------------------------------
// Item 8: bounded.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_body_swapped_after_the_listing_is_dropped_at_its_cap() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    put(&loc, "step-5", Some(5), &[("w", b"ok")], None);
    put(&loc, "step-9", Some(9), &[("w", b"ok")], None);
    let proxy = Proxy::start(&server, Counting::default()).await;
    const SWAPPED: u64 = 256 << 20;
    *proxy.state.swap.lock().unwrap() = Some("step-9/manifest.json".into());
    proxy.state.swap_len.store(SWAPPED, Ordering::SeqCst);

    let r = run(reader(&["s3://ckpt/run1"], Some(&proxy.endpoint()))).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], "step-5", "{}", r.json);
    // Dropped at the cap (16 MiB) or before; what the sockets buffered on the way is the rest.
    let served = proxy.state.swapped_served.load(Ordering::SeqCst);
    assert!(
        served < 48 << 20,
        "{} MiB of the swapped body were pulled",
        served >> 20
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_directories_are_listed_once_and_read_newest_first() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    const DIRS: u64 = 2500;
    for step in 1..=DIRS - 2 {
        put_manifest(
            &loc,
            &manifest(&format!("step-{step}"), Some(step), &[("w", b"x")], None),
        );
    }
    // The two newest were cut off by a deadline: files, no manifest.
    for step in DIRS - 1..=DIRS {
        std::fs::create_dir_all(loc.join(format!("step-{step}"))).unwrap();
        std::fs::write(loc.join(format!("step-{step}/w")), b"partial").unwrap();
    }
    let proxy = Proxy::start(&server, Counting::default()).await;
    let r = run(reader(&["s3://ckpt/run1"], Some(&proxy.endpoint()))).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json["name"], format!("step-{}", DIRS - 2), "{}", r.json);
    let (lists, gets) = (
        proxy.state.lists.load(Ordering::SeqCst),
        proxy.state.manifest_gets.load(Ordering::SeqCst),
    );
    // One paginated listing of the location (1000 per page), one listing of each of the two
    // directories without a manifest (for part manifests), three manifest GETs.
    assert!(lists <= DIRS.div_ceil(1000) + 2, "{lists} LISTs");
    assert_eq!(gets, 3, "{gets} manifest GETs");
}

/// A store that accepts connections and never answers; `accepted` gets each connection (held
/// open) as it comes.
fn silent_store() -> (String, std::sync::mpsc::Receiver<std::net::TcpStream>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for s in listener.incoming().map_while(Result::ok) {
            if tx.send(s).is_err() {
                return;
            }
        }
    });
    (endpoint, rx)
}

/// The exit code of `child` once it exits by itself within `limit` (killed and `None` if not).
fn exit_within(child: &mut std::process::Child, limit: Duration) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status.code().unwrap_or(-1));
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_never_answers_stops_at_the_timeout() {
    let (endpoint, accepted) = silent_store();
    let mut cmd = reader(&["s3://ckpt/run1", "--timeout", "1s"], Some(&endpoint));
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    // It did reach the store.
    let _held = accepted.recv_timeout(Duration::from_secs(60)).unwrap();
    // The limit only bounds a hang: the run stops itself at 1 s.
    let code = tokio::task::spawn_blocking(move || {
        let code = exit_within(&mut child, Duration::from_secs(20));
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        (code, err)
    })
    .await
    .unwrap();
    assert_eq!(code.0, Some(EXIT_CANCELLED), "{}", code.1);
    assert!(code.1.contains("--timeout"), "{}", code.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_store_never_answers_stops_at_once() {
    let (endpoint, accepted) = silent_store();
    let mut cmd = reader(&["s3://ckpt/run1"], Some(&endpoint));
    cmd.stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = cmd.spawn().unwrap();
    // A request of the finding phase is in flight: the signal arrives mid-phase.
    let _held = accepted.recv_timeout(Duration::from_secs(60)).unwrap();
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let code =
        tokio::task::spawn_blocking(move || exit_within(&mut child, Duration::from_secs(20)))
            .await
            .unwrap();
    assert_eq!(code, Some(EXIT_CANCELLED));
}

/// SIGTERM while a request of each phase hangs (the listing, a manifest read, the fetch of a
/// file): the run stops at once with exit 3 and reports nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_every_phase() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let loc = s3_location(&server, "run1");
    put(&loc, "step-5", Some(5), &[("w", &shard(1000, 1))], None);
    for phase in ["listing", "manifest", "fetch"] {
        let proxy = Proxy::start(&server, Counting::default()).await;
        match phase {
            "listing" => proxy.state.hang_lists.store(true, Ordering::SeqCst),
            "manifest" => *proxy.state.hang_suffix.lock().unwrap() = Some("/manifest.json".into()),
            _ => *proxy.state.hang_suffix.lock().unwrap() = Some("/step-5/w".into()),
        }
        let dest = trainer_dir();
        let mut cmd = reader(
            &["s3://ckpt/run1", dest.path().to_str().unwrap()],
            Some(&proxy.endpoint()),
        );
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        // Wait for the event: a request of this phase is being held.
        let seen = Instant::now();
        while proxy.state.hung.load(Ordering::SeqCst) == 0 {
            assert!(
                seen.elapsed() < Duration::from_secs(60),
                "{phase}: never reached"
            );
            assert!(child.try_wait().unwrap().is_none(), "{phase}: exited early");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let (code, out) = tokio::task::spawn_blocking(move || {
            let code = exit_within(&mut child, Duration::from_secs(20));
            let mut out = String::new();
            std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
            (code, out)
        })
        .await
        .unwrap();
        assert_eq!(code, Some(EXIT_CANCELLED), "{phase}");
        assert!(out.trim().is_empty(), "{phase}: reported {out}");
    }
}
