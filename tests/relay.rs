//! The relay (docs/relay.md) between two agents' relay parts in this process, publishing to
//! s3s-fs: a relayed checkpoint is published once with the sender's manifest; a sender that dies
//! or goes silent mid-stream leaves nothing; a sender without the key, or one that pins another
//! fingerprint, gets nowhere; a receiver restarted while publishing publishes once from its
//! journal; hostile streams (a `..` name, more bytes than declared, a checksum that does not
//! match, a location outside the receiver's allow-list) are refused with nothing published; a
//! peer that dies mid-stream, or whose disk fills mid-file, publishes nothing and the next peer
//! publishes the checkpoint once; a peer with room for one checkpoint takes the first of two
//! doomed nodes and refuses the second, which goes on to its next peer; a sender's cap is its
//! address's; a sender with two copies streams to two peers at once, and one publishes.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt};
use prometheus_client::registry::Registry;
use spotguard::relay::metrics::RelayMetrics;
use spotguard::relay::receive::{self, Receiver, Settings};
use spotguard::relay::send::{self, Peer, Source};
use spotguard::relay::tls::{self, Identity};
use spotguard::relay::wire::{self, Checkpoint, FileCrcs, Reserve, State};
use spotguard::store::crc::Crcs;
use spotguard::store::manifest::{Manifest, NoticeInfo, Origin};
use spotguard::store::owner::Writer;
use spotguard::store::url::StoreOptions;
use spotguard::upload::dest::{AllowUpload, UploadPolicy};
use spotguard::upload::engine::{self, Job, Meta, Options};
use spotguard::upload::handoff::{self, Mode, Relay};
use spotguard::upload::journal::RootRecord;
use spotguard::upload::relayed::RelayPublisher;
use spotguard::upload::staged::{self, Limits, Root};
use spotguard::upload::target::Target;
use spotguard::upload::{Outcome, UploadMetrics};
use spotguard_testkit::s3::proxy::{paced, Body, Faults, Proxy};
use spotguard_testkit::s3::{create_bucket, in_child, S3Server};
use spotguard_testkit::tcp::Forward;
use spotguard_testkit::tmpfs::Tmpfs;
use spotguard_testkit::wait::{eventually, PACE};
use tokio_util::sync::CancellationToken;

const BUCKET: &str = "ckpt";
const KEY: &str = "node-key-0123456789abcdef";
const MIB: usize = 1 << 20;

/// One agent's receiving side: its staging dir, state dir, listener and receiver.
struct Node {
    receiver: Arc<Receiver>,
    addr: SocketAddr,
    fingerprint: [u8; 32],
    staging: PathBuf,
    state: PathBuf,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// The receiver's registry (`spotguard_relay_*`).
    registry: Arc<Registry>,
}

impl Node {
    fn peer(&self) -> Peer {
        Peer {
            addr: self.addr.to_string(),
            fingerprint: self.fingerprint,
        }
    }

    /// Nothing staged (neither files nor journals) and nothing reserved.
    fn is_empty(&self) -> bool {
        self.receiver.reserved() == 0
            && std::fs::read_dir(&self.staging)
                .map(|d| d.count() == 0)
                .unwrap_or(true)
    }

    /// Its `/metrics` text.
    fn metrics(&self) -> String {
        spotguard::metrics::encode(&self.registry)
    }

    /// The agent stops (its publications stop where they are, nothing is cleaned).
    async fn stop(self) -> (PathBuf, PathBuf) {
        self.cancel.cancel();
        let _ = self.task.await;
        (self.staging, self.state)
    }
}

async fn start(
    endpoint: &str,
    allow: &str,
    dirs: (PathBuf, PathBuf),
    per_sender: u64,
    idle: Duration,
) -> Node {
    let (staging, state) = dirs;
    let publisher = RelayPublisher {
        policy: UploadPolicy {
            allow: vec![AllowUpload::parse(allow).unwrap()],
            own_dirs: Vec::new(),
        },
        limits: Limits::default(),
        store: StoreOptions {
            endpoint: Some(endpoint.to_string()),
            ..StoreOptions::default()
        },
        concurrency: 4,
        part_size: spotguard::upload::engine::MIN_PART_SIZE,
        journal_dir: state.join("relay"),
        metrics: None,
    };
    let identity = Identity::load_or_create(&tls::dir(&state)).unwrap();
    let mut registry = Registry::default();
    let metrics = Arc::new(RelayMetrics::register(&mut registry));
    let receiver = Arc::new(
        Receiver::new(
            Settings {
                key: KEY.as_bytes().to_vec(),
                staging: staging.clone(),
                per_sender,
                idle,
                limits: Limits::default(),
                connections: receive::connection_limits(
                    receive::MAX_CONNECTIONS,
                    receive::MAX_CONNECTIONS_PER_SENDER,
                ),
                metrics,
            },
            Arc::new(publisher),
        )
        .unwrap(),
    );
    receiver.recover();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(receiver.clone().serve(
        listener,
        identity.server_config().unwrap(),
        cancel.clone(),
    ));
    Node {
        receiver,
        addr,
        fingerprint: identity.fingerprint,
        staging,
        state,
        cancel,
        task,
        registry: Arc::new(registry),
    }
}

fn dirs(tmp: &Path) -> (PathBuf, PathBuf) {
    (tmp.join("staging"), tmp.join("state"))
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..len).map(|_| rng.u8(..)).collect()
}

/// A staged tree on the sender's side, as the upload captures it.
fn stage(root: &Path, name: &str, files: &[(&str, Vec<u8>)]) -> PathBuf {
    let dir = root.join(name);
    for (p, d) in files {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, d).unwrap();
    }
    dir
}

/// What the sender sends for the staged `dir`: the reservation and its files.
fn outgoing(dir: &Path, location: &str) -> (Reserve, Vec<Source>) {
    let tree = staged::capture(&Root::host().unwrap(), dir, &Limits::default()).unwrap();
    let (files, sources) = handoff::files_of(&tree);
    let name = dir.file_name().unwrap().to_str().unwrap().to_string();
    let step = name.trim_start_matches("step-").parse().ok();
    let reserve = Reserve {
        version: wire::VERSION,
        sender: "doomed-node".into(),
        location: location.into(),
        namespace: None,
        checkpoint: Checkpoint {
            name,
            step,
            part: None,
            notice: Some(NoticeInfo {
                id: "notice-1".into(),
                source: "gce".into(),
                kind: "interruption".into(),
                deadline: None,
            }),
            origin: Origin {
                staged: dir.display().to_string(),
                node: Some("doomed-node".into()),
                pod: None,
            },
            acked_at: Some("2026-11-29T03:00:00Z".into()),
            writer: "host:uid:1000".into(),
        },
        files,
    };
    (reserve, sources)
}

fn store(endpoint: &str) -> Arc<dyn ObjectStore> {
    Arc::new(
        AmazonS3Builder::from_env()
            .with_endpoint(endpoint)
            .with_bucket_name(BUCKET)
            .with_client_options(ClientOptions::new().with_allow_http(true))
            .build()
            .unwrap(),
    )
}

async fn get(store: &dyn ObjectStore, key: &str) -> Option<Vec<u8>> {
    match store.get(&ObjectPath::from(key)).await {
        Ok(r) => Some(r.bytes().await.unwrap().to_vec()),
        Err(object_store::Error::NotFound { .. }) => None,
        Err(e) => panic!("GET {key}: {e}"),
    }
}

async fn keys(store: &dyn ObjectStore, prefix: &str) -> Vec<String> {
    use futures::TryStreamExt;
    let mut k: Vec<String> = store
        .list(Some(&ObjectPath::from(prefix)))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    k.sort();
    k
}

fn tree_files() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("__0_0.distcp", data(6 * MIB, 1)),
        ("sub/optim.bin", data(200_000, 2)),
        (".metadata", data(1000, 3)),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_checkpoint_is_published_once_with_the_senders_manifest() {
    if in_child("a_relayed_checkpoint_is_published_once_with_the_senders_manifest").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let tmp = tempfile::tempdir().unwrap();
    let peer = start(
        &server.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        1 << 40,
        Duration::from_secs(30),
    )
    .await;
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let (reserve, sources) = outgoing(&dir, "s3://ckpt/run1");

    let end = send::relay(
        &peer.peer(),
        KEY,
        reserve.clone(),
        sources.clone(),
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(end.state, State::Published, "{end:?}");
    let s3 = store(&server.endpoint());
    let m = Manifest::parse(
        &get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        "step-100",
        None,
    )
    .unwrap();
    // The sender's manifest: its origin, notice and writer, every file with its CRCs.
    assert_eq!(m.origin.node.as_deref(), Some("doomed-node"));
    assert_eq!(m.origin.staged, dir.display().to_string());
    assert_eq!(m.notice.as_ref().map(|n| n.id.as_str()), Some("notice-1"));
    assert_eq!(m.writer.as_deref(), Some("host:uid:1000"));
    assert_eq!(m.step, Some(100));
    assert_eq!(m.timings.acked_at.as_deref(), Some("2026-11-29T03:00:00Z"));
    for (p, d) in &files {
        let f = m.files.iter().find(|f| f.path == *p).unwrap();
        assert_eq!(FileCrcs::of(&Crcs::of(d)).crc64nvme, f.crc64nvme);
        assert_eq!(get(&*s3, &format!("run1/step-100/{p}")).await.unwrap(), *d);
    }
    eventually(
        "the peer's staging emptied",
        Duration::from_secs(10),
        || async { peer.is_empty() },
    )
    .await;
    // Relayed again (a second peer, the sender's own upload): never published twice.
    let again = send::relay(
        &peer.peer(),
        KEY,
        reserve,
        sources,
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(again.state, State::AlreadyPublished, "{again:?}");
    assert_eq!(
        get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        m.to_bytes(),
        "the first manifest was overwritten"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_without_the_key_or_pinning_another_fingerprint_gets_nowhere() {
    if in_child("a_sender_without_the_key_or_pinning_another_fingerprint_gets_nowhere").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let tmp = tempfile::tempdir().unwrap();
    let peer = start(
        &server.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        1 << 40,
        Duration::from_secs(30),
    )
    .await;
    let dir = stage(tmp.path(), "step-100", &tree_files());
    let (reserve, sources) = outgoing(&dir, "s3://ckpt/run1");
    for key in ["", "node-key-0123456789abcdeX"] {
        let e = send::relay(
            &peer.peer(),
            key,
            reserve.clone(),
            sources.clone(),
            None,
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(e, spotguard::relay::Error::Refused { status: 401, .. }),
            "{e}"
        );
    }
    // Counted where the receiver refuses: no byte was taken.
    let text = peer.metrics();
    for line in [
        "spotguard_relay_refusals_total{reason=\"auth\"} 2",
        "spotguard_relay_received_bytes_total 0",
    ] {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
    // A peer presenting another certificate than the one pinned: the sender refuses it.
    let mut wrong = peer.peer();
    wrong.fingerprint[0] ^= 1;
    let e = send::relay(
        &wrong,
        KEY,
        reserve,
        sources,
        None,
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("fingerprint"), "{e}");
    assert!(peer.is_empty());
    assert!(keys(&*store(&server.endpoint()), "run1").await.is_empty());
}

/// A sender of its own, to do what a real sender never does.
struct Raw {
    conn: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Raw {
    async fn connect(node: &Node) -> Raw {
        Raw::connect_to(node.addr, node.fingerprint).await
    }

    async fn connect_to(addr: SocketAddr, fingerprint: [u8; 32]) -> Raw {
        let config = tls::client_config(fingerprint).unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(tls::server_name(), tcp)
            .await
            .unwrap();
        let (conn, driver) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .unwrap();
        tokio::spawn(driver);
        Raw { conn }
    }

    async fn call(&mut self, method: Method, path: &str, body: Vec<u8>) -> (StatusCode, Vec<u8>) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {KEY}"))
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        self.conn.ready().await.unwrap();
        let resp = self.conn.send_request(req).await.unwrap();
        let status = resp.status();
        let data = resp
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec();
        (status, data)
    }

    async fn reserve(&mut self, r: &Reserve) -> Result<String, (StatusCode, String)> {
        let (s, d) = self
            .call(Method::POST, wire::RELAYS, serde_json::to_vec(r).unwrap())
            .await;
        if s == StatusCode::CREATED {
            Ok(serde_json::from_slice::<wire::Reserved>(&d).unwrap().id)
        } else {
            Err((s, String::from_utf8_lossy(&d).into_owned()))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_dying_or_going_silent_mid_stream_leaves_nothing_and_frees_its_space() {
    if in_child("a_sender_dying_or_going_silent_mid_stream_leaves_nothing_and_frees_its_space")
        .await
    {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let tmp = tempfile::tempdir().unwrap();
    let idle = Duration::from_millis(800);
    let peer = start(
        &server.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        1 << 40,
        idle,
    )
    .await;
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let (reserve, _) = outgoing(&dir, "s3://ckpt/run1");
    let big = reserve
        .files
        .iter()
        .position(|f| f.path == "__0_0.distcp")
        .unwrap();

    // Dies: half of a file on a connection that then closes.
    let mut raw = Raw::connect(&peer).await;
    let id = raw.reserve(&reserve).await.unwrap();
    assert_eq!(peer.receiver.reserved(), reserve.bytes());
    let tcp = tokio::net::TcpStream::connect(peer.addr).await.unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(tls::client_config(peer.fingerprint).unwrap())
        .connect(tls::server_name(), tcp)
        .await
        .unwrap();
    use tokio::io::AsyncWriteExt;
    let head = format!(
        "PUT {}/{id}/files/{big} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-length: {}\r\n\r\n",
        wire::RELAYS,
        6 * MIB
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(&files[0].1[..MIB]).await.unwrap();
    tls.flush().await.unwrap();
    eventually("the first MiB staged", Duration::from_secs(10), || async {
        walk_bytes(&peer.staging) > 0
    })
    .await;
    drop(tls);
    eventually(
        "the dead sender's relay given up",
        Duration::from_secs(10),
        || async { peer.is_empty() },
    )
    .await;
    assert_eq!(peer.receiver.status(&id).unwrap().state, State::Aborted);

    // Silent: reserved, then nothing (its VM gone without a word).
    let id = raw.reserve(&reserve).await.unwrap();
    assert!(!peer.is_empty());
    eventually(
        "the silent sender's relay given up",
        Duration::from_secs(10),
        || async { peer.is_empty() },
    )
    .await;
    assert_eq!(peer.receiver.status(&id).unwrap().state, State::Aborted);
    assert!(keys(&*store(&server.endpoint()), "run1").await.is_empty());
}

fn walk_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                walk_bytes(&e.path())
            } else if e.path().extension().is_some_and(|x| x == "json") {
                0
            } else {
                m.len()
            }
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_streams_are_refused_and_nothing_is_published() {
    if in_child("hostile_streams_are_refused_and_nothing_is_published").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let tmp = tempfile::tempdir().unwrap();
    let per_sender = 7 * MIB as u64;
    let peer = start(
        &server.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        per_sender,
        Duration::from_secs(30),
    )
    .await;
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let (reserve, _) = outgoing(&dir, "s3://ckpt/run1");
    let mut raw = Raw::connect(&peer).await;

    // Names and locations refused before a byte is accepted.
    for (path, status) in [
        ("../escape", StatusCode::UNPROCESSABLE_ENTITY),
        ("a/../../escape", StatusCode::UNPROCESSABLE_ENTITY),
        ("/etc/passwd", StatusCode::UNPROCESSABLE_ENTITY),
        ("manifest.json", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let mut r = reserve.clone();
        r.files[0].path = path.into();
        let (s, why) = raw.reserve(&r).await.unwrap_err();
        assert_eq!(s, status, "{path}: {why}");
    }
    let mut r = reserve.clone();
    r.location = "s3://other-bucket/run1".into();
    assert_eq!(raw.reserve(&r).await.unwrap_err().0, StatusCode::FORBIDDEN);
    let mut r = reserve.clone();
    r.checkpoint.writer = "k8s:ml/Job/x".into();
    assert_eq!(raw.reserve(&r).await.unwrap_err().0, StatusCode::FORBIDDEN);
    let mut r = reserve.clone();
    r.version = 2;
    assert_eq!(
        raw.reserve(&r).await.unwrap_err().0,
        StatusCode::BAD_REQUEST
    );
    // Over this sender's cap: two reservations of 6.2 MiB do not fit in 7 MiB.
    let id = raw.reserve(&reserve).await.unwrap();
    assert_eq!(
        raw.reserve(&reserve).await.unwrap_err().0,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    raw.call(
        Method::DELETE,
        &format!("{}/{id}", wire::RELAYS),
        Vec::new(),
    )
    .await;
    assert!(peer.is_empty());

    // More bytes than declared: refused, the relay given up.
    let small = reserve
        .files
        .iter()
        .position(|f| f.path == ".metadata")
        .unwrap();
    let id = raw.reserve(&reserve).await.unwrap();
    let (s, _) = raw
        .call(
            Method::PUT,
            &format!("{}/{id}/files/{small}", wire::RELAYS),
            vec![7u8; 1001],
        )
        .await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(peer.receiver.status(&id).unwrap().state, State::Aborted);
    assert!(peer.is_empty());

    // Every byte as declared, but a checksum that does not match: nothing published.
    let id = raw.reserve(&reserve).await.unwrap();
    let mut sums = Vec::new();
    for (i, f) in reserve.files.iter().enumerate() {
        let content = &files.iter().find(|(p, _)| *p == f.path).unwrap().1;
        let (s, d) = raw
            .call(
                Method::PUT,
                &format!("{}/{id}/files/{i}", wire::RELAYS),
                content.clone(),
            )
            .await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&d));
        sums.push(FileCrcs::of(&Crcs::of(content)));
    }
    sums[small].crc32c = "00000000".into();
    let commit = serde_json::to_vec(&wire::Commit { files: sums }).unwrap();
    let (s, _) = raw
        .call(
            Method::POST,
            &format!("{}/{id}/commit", wire::RELAYS),
            commit,
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(peer.receiver.status(&id).unwrap().state, State::Aborted);
    assert!(peer.is_empty());
    assert!(keys(&*store(&server.endpoint()), "run1").await.is_empty());
}

/// Holds every PUT body while set: the receiver's publication stays mid-upload.
#[derive(Default)]
struct Hold(AtomicBool);

impl Faults for Hold {
    fn request_body(self: &Arc<Self>, req: &http::request::Parts, body: Body) -> Body {
        if req.method == Method::PUT && self.0.load(Ordering::SeqCst) {
            return paced(body, 1);
        }
        body
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_restarted_while_publishing_publishes_once_from_its_journal() {
    if in_child("a_receiver_restarted_while_publishing_publishes_once_from_its_journal").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let proxy = Proxy::start(&server, Hold::default()).await;
    let tmp = tempfile::tempdir().unwrap();
    let peer = start(
        &proxy.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        1 << 40,
        Duration::from_secs(30),
    )
    .await;
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let (reserve, sources) = outgoing(&dir, "s3://ckpt/run1");

    proxy.state.0.store(true, Ordering::SeqCst);
    let sending = tokio::spawn({
        let (p, r, s) = (peer.peer(), reserve.clone(), sources.clone());
        async move { send::relay(&p, KEY, r, s, None, CancellationToken::new()).await }
    });
    let r2 = peer.receiver.clone();
    eventually(
        "the relay committed and publishing",
        Duration::from_secs(20),
        || {
            let r2 = r2.clone();
            async move {
                let state = std::fs::read_dir(tmp_staging(&r2)).ok();
                state.is_some() && r2.reserved() > 0 && journals_committed(&tmp_staging(&r2))
            }
        },
    )
    .await;
    // The agent stops mid-publication: the sender loses its peer; the files stay.
    let addr = peer.addr;
    let (staging, state) = peer.stop().await;
    sending.abort();
    assert!(journals_committed(&staging));
    proxy.state.0.store(false, Ordering::SeqCst);

    // The next run publishes it from its journal, once.
    let again = start(
        &proxy.endpoint(),
        "s3://ckpt",
        (staging, state),
        1 << 40,
        Duration::from_secs(30),
    )
    .await;
    let _ = addr;
    let s3 = store(&server.endpoint());
    eventually(
        "the restarted receiver published",
        Duration::from_secs(30),
        || async { get(&*s3, "run1/step-100/manifest.json").await.is_some() },
    )
    .await;
    let m = Manifest::parse(
        &get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        "step-100",
        None,
    )
    .unwrap();
    assert_eq!(m.origin.node.as_deref(), Some("doomed-node"));
    assert_eq!(m.files.len(), files.len());
    for (p, d) in &files {
        assert_eq!(get(&*s3, &format!("run1/step-100/{p}")).await.unwrap(), *d);
    }
    eventually(
        "the restarted receiver's staging emptied",
        Duration::from_secs(10),
        || async { again.is_empty() },
    )
    .await;
}

fn tmp_staging(r: &Receiver) -> PathBuf {
    r.staging_dir().to_path_buf()
}

/// A committed relay's journal is in `staging`.
fn journals_committed(staging: &Path) -> bool {
    std::fs::read_dir(staging)
        .map(|d| {
            d.flatten().any(|e| {
                e.path().extension().is_some_and(|x| x == "json")
                    && std::fs::read(e.path())
                        .ok()
                        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                        .is_some_and(|v| !v["committed"].is_null())
            })
        })
        .unwrap_or(false)
}

/// Slows every PUT body down to `rate` bytes a second: a store the doomed node cannot reach fast.
struct Slow(u64);

impl Faults for Slow {
    fn request_body(self: &Arc<Self>, req: &http::request::Parts, body: Body) -> Body {
        if req.method == Method::PUT {
            return paced(body, self.0);
        }
        body
    }
}

/// The doomed node's upload job for `dir` to `location`/<name>, through `endpoint`.
fn upload_job(dir: &Path, endpoint: &str, location: &str, deadline: tokio::time::Instant) -> Job {
    use spotguard::upload::dest::{Granted, Location};
    let (reserve, _) = outgoing(dir, location);
    let cp = reserve.checkpoint;
    let dest = Location::parse(location).unwrap().join(&cp.name);
    let target = Target::open(
        &dest,
        &Granted::Store,
        &StoreOptions {
            endpoint: Some(endpoint.to_string()),
            ..StoreOptions::default()
        },
    )
    .unwrap();
    Job {
        tree: staged::capture(&Root::host().unwrap(), dir, &Limits::default()).unwrap(),
        target,
        meta: Meta {
            name: cp.name,
            step: cp.step,
            part: None,
            notice: cp.notice,
            origin: cp.origin,
            acked_at: cp.acked_at.and_then(|t| t.parse().ok()),
            writer: Some(Writer(cp.writer)),
        },
        root: RootRecord::Host { owner: None },
        options: Options {
            deadline: Some(deadline),
            ..Options::default()
        },
        progress: Default::default(),
        metrics: None,
        cancel: CancellationToken::new(),
        relayed: Default::default(),
    }
}

/// The sender's race ([`handoff::race`]) as the upload service starts it for a staged ack.
/// The sender's counts go to `metrics`.
async fn race(
    job: Job,
    peer: &Node,
    mode: Mode,
    metrics: Arc<RelayMetrics>,
) -> spotguard::upload::Report {
    race_to(job, vec![peer.peer()], mode, metrics).await
}

/// [`race`] with the peers `peers`, tried in order.
async fn race_to(
    job: Job,
    peers: Vec<Peer>,
    mode: Mode,
    metrics: Arc<RelayMetrics>,
) -> spotguard::upload::Report {
    race_copies(job, peers, 1, mode, metrics).await
}

/// [`race_to`] with `copies` peers at once.
async fn race_copies(
    job: Job,
    peers: Vec<Peer>,
    copies: usize,
    mode: Mode,
    metrics: Arc<RelayMetrics>,
) -> spotguard::upload::Report {
    let (reserve, sources) = handoff::outgoing(&job, "s3://ckpt/run1", None, "doomed-node");
    let (progress, cancel, relayed, total, deadline) = (
        job.progress.clone(),
        job.cancel.clone(),
        job.relayed.clone(),
        job.tree.bytes,
        job.options.deadline,
    );
    let upload = tokio::spawn(engine::run(job));
    let relay = Relay {
        mode,
        peers: peers.into(),
        copies,
        key: KEY.into(),
        metrics,
    };
    handoff::race(
        upload, relay, reserve, sources, progress, total, deadline, cancel, relayed,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_cannot_finish_inside_the_notice_is_relayed_and_published_once() {
    if in_child("an_upload_that_cannot_finish_inside_the_notice_is_relayed_and_published_once")
        .await
    {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    // The doomed node reaches the store at 200 kB/s: 6.2 MB take half a minute, the notice
    // leaves it 20 s.
    let slow = Proxy::start(&server, Slow(200_000)).await;
    let tmp = tempfile::tempdir().unwrap();
    let peer = start(
        &server.endpoint(),
        "s3://ckpt",
        dirs(tmp.path()),
        1 << 40,
        Duration::from_secs(30),
    )
    .await;
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    // The sender's one registry: its upload's families and the relay's.
    let mut registry = Registry::default();
    let uploads = Arc::new(UploadMetrics::register(&mut registry));
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let bytes: usize = files.iter().map(|(_, d)| d.len()).sum();

    let mut job = upload_job(&dir, &slow.endpoint(), "s3://ckpt/run1", deadline);
    job.metrics = Some(uploads.clone());
    let report = race(job, &peer, Mode::Auto, relays.clone()).await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    assert_eq!(
        report.relayed_to.as_deref(),
        Some(peer.addr.to_string().as_str())
    );
    assert!(
        tokio::time::Instant::now() < deadline,
        "published only at the deadline"
    );
    let s3 = store(&server.endpoint());
    let m = Manifest::parse(
        &get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        "step-100",
        None,
    )
    .unwrap();
    assert_eq!(m.origin.node.as_deref(), Some("doomed-node"));
    assert_eq!(m.writer.as_deref(), Some("host:uid:1000"));
    for (p, d) in &files {
        assert_eq!(get(&*s3, &format!("run1/step-100/{p}")).await.unwrap(), *d);
    }
    // The metrics say what the report says: the relay published it, the upload stopped for it
    // (`relayed`, not `cancelled`); the peer received every byte and published once.
    let sender = spotguard::metrics::encode(&registry);
    for line in [
        "spotguard_relay_sent_total{outcome=\"published\"} 1",
        "spotguard_relay_sent_total{outcome=\"failed\"} 0",
        "spotguard_checkpoint_upload_total{outcome=\"relayed\"} 1",
        "spotguard_checkpoint_upload_total{outcome=\"cancelled\"} 0",
        "spotguard_checkpoint_upload_total{outcome=\"published\"} 0",
    ] {
        assert!(sender.contains(line), "missing {line} in\n{sender}");
    }
    assert!(
        !sender.contains("spotguard_checkpoint_upload_errors_total{error=\"cancelled\"}"),
        "{sender}"
    );
    let received = peer.metrics();
    for line in [
        "spotguard_relay_received_total{outcome=\"published\"} 1".to_string(),
        format!("spotguard_relay_received_bytes_total {bytes}"),
    ] {
        assert!(received.contains(&line), "missing {line} in\n{received}");
    }

    // An upload that finishes inside the notice (5 MB/s: a second and a half) is not relayed.
    let fits = Proxy::start(&server, Slow(5_000_000)).await;
    let dir = stage(tmp.path(), "step-200", &files);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let before = peer.receiver.known();
    let report = race(
        upload_job(&dir, &fits.endpoint(), "s3://ckpt/run1", deadline),
        &peer,
        Mode::Auto,
        relays.clone(),
    )
    .await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    assert_eq!(report.relayed_to, None);
    assert_eq!(
        peer.receiver.known(),
        before,
        "relayed though the upload fit"
    );
}

/// A publisher that never ends (a peer whose store hangs).
struct Stalled;

impl spotguard::relay::Publisher for Stalled {
    fn check(&self, _: &Reserve) -> Result<(), String> {
        Ok(())
    }

    fn publish(
        &self,
        _: spotguard::relay::PublishJob,
    ) -> futures::future::BoxFuture<'static, spotguard::relay::Published> {
        Box::pin(std::future::pending())
    }
}

/// A receiver whose publications never end, with the connection limits `connections`: its
/// receiver, address, fingerprint and stop.
async fn stalled(
    tmp: &Path,
    connections: spotguard::admin::Limits,
) -> (Arc<Receiver>, SocketAddr, [u8; 32], CancellationToken) {
    let (staging, state) = dirs(tmp);
    let identity = Identity::load_or_create(&tls::dir(&state)).unwrap();
    let receiver = Arc::new(
        Receiver::new(
            Settings {
                key: KEY.as_bytes().to_vec(),
                staging,
                per_sender: 1 << 40,
                idle: Duration::from_secs(30),
                limits: Limits::default(),
                connections,
                metrics: Arc::new(RelayMetrics::register(&mut Registry::default())),
            },
            Arc::new(Stalled),
        )
        .unwrap(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    tokio::spawn(receiver.clone().serve(
        listener,
        identity.server_config().unwrap(),
        cancel.clone(),
    ));
    (receiver, addr, identity.fingerprint, cancel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_waits_for_its_peer_only_until_the_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    let limits = receive::connection_limits(
        receive::MAX_CONNECTIONS,
        receive::MAX_CONNECTIONS_PER_SENDER,
    );
    let (receiver, addr, fingerprint, cancel) = stalled(tmp.path(), limits).await;
    let peer = Peer {
        addr: addr.to_string(),
        fingerprint,
    };
    let dir = stage(tmp.path(), "step-7", &[("a.bin", data(4096, 7))]);
    let (reserve, sources) = outgoing(&dir, "s3://ckpt/run1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    // The peer never publishes: the sender stops waiting at the deadline and says the relay is
    // not finished (the bound here only keeps a broken sender from hanging the test).
    let end = tokio::time::timeout(
        Duration::from_secs(120),
        send::relay(
            &peer,
            KEY,
            reserve,
            sources,
            Some(deadline),
            CancellationToken::new(),
        ),
    )
    .await
    .expect("the sender waited past the deadline");
    assert!(
        matches!(end, Err(spotguard::relay::Error::Deadline { .. })),
        "{end:?}"
    );
    // It had committed: the peer still holds it, publishing (never a part of it).
    assert_eq!(receiver.known(), 1);
    cancel.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_closes_connections_over_its_cap_when_every_one_is_busy() {
    let tmp = tempfile::tempdir().unwrap();
    let (_receiver, addr, fingerprint, cancel) =
        stalled(tmp.path(), receive::connection_limits(2, 2)).await;
    let staging = tmp.path().join("staging");
    let files = [("a.bin", data(2 * MIB, 1)), ("b.bin", data(2 * MIB, 2))];
    let dir = stage(tmp.path(), "step-9", &files);
    let (reserve, _) = outgoing(&dir, "s3://ckpt/run1");
    let id = Raw::connect_to(addr, fingerprint)
        .await
        .reserve(&reserve)
        .await
        .unwrap();
    // Two connections each busy with a file (half of it sent): the receiver's cap.
    use tokio::io::AsyncWriteExt;
    let mut busy = Vec::new();
    for (i, (_, d)) in files.iter().enumerate() {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(tls::client_config(fingerprint).unwrap())
            .connect(tls::server_name(), tcp)
            .await
            .unwrap();
        let head = format!(
            "PUT {}/{id}/files/{i} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-length: {}\r\n\r\n",
            wire::RELAYS,
            d.len()
        );
        tls.write_all(head.as_bytes()).await.unwrap();
        tls.write_all(&d[..MIB + 1]).await.unwrap();
        tls.flush().await.unwrap();
        busy.push(tls);
    }
    eventually(
        "both files being received",
        Duration::from_secs(30),
        || async { walk_bytes(&staging) >= 2 * MIB as u64 },
    )
    .await;
    // A third is closed on accept: no handshake, no answer.
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let third = tokio_rustls::TlsConnector::from(tls::client_config(fingerprint).unwrap())
        .connect(tls::server_name(), tcp)
        .await;
    assert!(third.is_err(), "a connection over the cap was served");
    // The busy ones are served still.
    for (tls, (_, d)) in busy.iter_mut().zip(&files) {
        tls.write_all(&d[MIB + 1..]).await.unwrap();
        tls.flush().await.unwrap();
    }
    use tokio::io::AsyncReadExt;
    for mut tls in busy {
        let mut head = [0u8; 12];
        tls.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 204", "{}", String::from_utf8_lossy(&head));
    }
    cancel.cancel();
}

#[test]
fn relay_fingerprint_prints_the_certificate_senders_pin() {
    let tmp = tempfile::tempdir().unwrap();
    let print = || {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
            .args(["relay", "fingerprint", "--state-dir"])
            .arg(tmp.path())
            .env_remove("SPOTGUARD_STATE_DIR")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap().trim().to_string()
    };
    let first = print();
    assert_eq!(first.len(), 64, "{first}");
    assert_eq!(print(), first, "the certificate is made once and kept");
    let id = Identity::load_or_create(&tls::dir(tmp.path())).unwrap();
    assert_eq!(tls::hex(&id.fingerprint), first);
}

/// Holds every PUT body until opened: the doomed node's own upload waits while its relay runs
/// (and ends `relayed` when the peer publishes first).
#[derive(Default)]
struct Shut(AtomicBool);

impl Shut {
    fn open(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Faults for Shut {
    fn request_body(self: &Arc<Self>, req: &http::request::Parts, body: Body) -> Body {
        use futures::StreamExt;
        if req.method != Method::PUT {
            return body;
        }
        let me = self.clone();
        let opened = async move {
            while !me.0.load(Ordering::SeqCst) {
                tokio::time::sleep(PACE).await;
            }
        };
        let stream = futures::stream::once(opened)
            .filter_map(|()| async {
                None::<Result<hyper::body::Frame<Bytes>, spotguard_testkit::s3::proxy::BoxError>>
            })
            .chain(http_body_util::BodyStream::new(body));
        BodyExt::boxed(http_body_util::StreamBody::new(stream))
    }
}

/// `node`, reached through the forwarder `via`.
fn through(via: &Forward, node: &Node) -> Peer {
    Peer {
        addr: via.addr().to_string(),
        fingerprint: node.fingerprint,
    }
}

/// The keys of checkpoint `name` under `run1`: exactly its files and its manifest, each file
/// whole.
async fn published_whole(s3: &dyn ObjectStore, name: &str, files: &[(&str, Vec<u8>)]) -> Manifest {
    let mut want: Vec<String> = files
        .iter()
        .map(|(p, _)| format!("run1/{name}/{p}"))
        .chain([format!("run1/{name}/manifest.json")])
        .collect();
    want.sort();
    assert_eq!(keys(s3, &format!("run1/{name}")).await, want);
    for (p, d) in files {
        assert_eq!(
            get(s3, &format!("run1/{name}/{p}")).await.unwrap(),
            *d,
            "{p}"
        );
    }
    let m = Manifest::parse(
        &get(s3, &format!("run1/{name}/manifest.json"))
            .await
            .unwrap(),
        name,
        None,
    )
    .unwrap();
    assert_eq!(m.origin.node.as_deref(), Some("doomed-node"));
    assert_eq!(m.files.len(), files.len());
    m
}

fn has(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(text.contains(line), "missing {line} in\n{text}");
    }
}

const LONG: Duration = Duration::from_secs(60);

/// The race's report. The bound only keeps a broken sender from hanging the test: an upload
/// held by its store must stop as soon as the peer published (and the upload's own end comes
/// when its store answers).
async fn ended(
    racing: tokio::task::JoinHandle<spotguard::upload::Report>,
) -> spotguard::upload::Report {
    tokio::time::timeout(Duration::from_secs(180), racing)
        .await
        .expect("the race did not end: an upload held by its store did not stop for the peer")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_dies_mid_stream_publishes_nothing_and_the_next_peer_publishes_once() {
    if in_child("a_peer_that_dies_mid_stream_publishes_nothing_and_the_next_peer_publishes_once")
        .await
    {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    // The doomed node's own upload waits: the relay decides.
    let shut = Proxy::start(&server, Shut::default()).await;
    let tmp = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(30);
    let endpoint = server.endpoint();
    let first = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("1")),
        1 << 40,
        idle,
    )
    .await;
    let second = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("2")),
        1 << 40,
        idle,
    )
    .await;
    // The first peer's stream stops after 2 MiB: mid-file.
    let to_first = Forward::start(first.addr, None).await;
    to_first.hold_at(2 * MIB as u64);
    let files = tree_files();
    let dir = stage(tmp.path(), "step-100", &files);
    let mut registry = Registry::default();
    let uploads = Arc::new(UploadMetrics::register(&mut registry));
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let mut job = upload_job(&dir, &shut.endpoint(), "s3://ckpt/run1", deadline);
    job.metrics = Some(uploads);
    let racing = tokio::spawn(race_to(
        job,
        vec![through(&to_first, &first), second.peer()],
        Mode::Always,
        relays.clone(),
    ));
    eventually("the first peer mid-file", LONG, || async {
        to_first.held() && walk_bytes(&first.staging) >= MIB as u64
    })
    .await;
    // The first peer's agent dies there (its files stay on its disk, as a killed agent's do).
    let (staging, state) = first.stop().await;
    assert!(walk_bytes(&staging) > 0);

    let report = ended(racing).await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    assert_eq!(
        report.relayed_to.as_deref(),
        Some(second.addr.to_string().as_str())
    );
    let s3 = store(&endpoint);
    let m = published_whole(&*s3, "step-100", &files).await;
    has(
        &spotguard::metrics::encode(&registry),
        &[
            "spotguard_relay_sent_total{outcome=\"failed\"} 1",
            "spotguard_relay_sent_total{outcome=\"published\"} 1",
            "spotguard_checkpoint_upload_total{outcome=\"relayed\"} 1",
        ],
    );
    has(
        &second.metrics(),
        &["spotguard_relay_received_total{outcome=\"published\"} 1"],
    );
    // The first peer comes back: its part is removed, never published.
    let back = start(&endpoint, "s3://ckpt", (staging, state), 1 << 40, idle).await;
    assert!(back.is_empty());
    has(
        &back.metrics(),
        &["spotguard_relay_received_total{outcome=\"published\"} 0"],
    );
    assert_eq!(
        get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        m.to_bytes()
    );

    // With no other peer: the relay is reported failed and the upload's own outcome stands.
    let only = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("3")),
        1 << 40,
        idle,
    )
    .await;
    let to_only = Forward::start(only.addr, None).await;
    to_only.hold_at(2 * MIB as u64);
    let dir = stage(tmp.path(), "step-200", &files);
    let mut registry = Registry::default();
    let uploads = Arc::new(UploadMetrics::register(&mut registry));
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let mut job = upload_job(&dir, &shut.endpoint(), "s3://ckpt/run1", deadline);
    job.metrics = Some(uploads);
    let racing = tokio::spawn(race_to(
        job,
        vec![through(&to_only, &only)],
        Mode::Always,
        relays.clone(),
    ));
    eventually("the only peer mid-file", LONG, || async {
        to_only.held() && walk_bytes(&only.staging) >= MIB as u64
    })
    .await;
    let (staging, state) = only.stop().await;
    eventually("the relay counted failed", LONG, || async {
        spotguard::metrics::encode(&registry)
            .contains("spotguard_relay_sent_total{outcome=\"failed\"} 1")
    })
    .await;
    assert!(keys(&*s3, "run1/step-200").await.is_empty());
    shut.state.open();
    let report = ended(racing).await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    assert_eq!(report.relayed_to, None, "{report:?}");
    published_whole(&*s3, "step-200", &files).await;
    has(
        &spotguard::metrics::encode(&registry),
        &[
            "spotguard_relay_sent_total{outcome=\"failed\"} 1",
            "spotguard_relay_sent_total{outcome=\"published\"} 0",
            "spotguard_checkpoint_upload_total{outcome=\"published\"} 1",
            "spotguard_checkpoint_upload_total{outcome=\"relayed\"} 0",
        ],
    );
    let back = start(&endpoint, "s3://ckpt", (staging, state), 1 << 40, idle).await;
    assert!(back.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_disk_fills_mid_file_gives_the_relay_up_and_the_next_peer_publishes() {
    if in_child("a_peer_whose_disk_fills_mid_file_gives_the_relay_up_and_the_next_peer_publishes")
        .await
    {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let shut = Proxy::start(&server, Shut::default()).await;
    let tmp = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(30);
    let endpoint = server.endpoint();
    // A staging volume of 16 MiB: the checkpoint's 6.2 MiB are reserved.
    let volume = Tmpfs::mount(&tmp.path().join("volume"), 16 * MIB as u64);
    let full = start(
        &endpoint,
        "s3://ckpt",
        (volume.path().join("staging"), tmp.path().join("state")),
        1 << 40,
        idle,
    )
    .await;
    let other = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("2")),
        1 << 40,
        idle,
    )
    .await;
    let to_full = Forward::start(full.addr, None).await;
    to_full.hold_at(2 * MIB as u64);
    let files = tree_files();
    let bytes: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    let dir = stage(tmp.path(), "step-100", &files);
    let mut registry = Registry::default();
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let racing = tokio::spawn(race_to(
        upload_job(&dir, &shut.endpoint(), "s3://ckpt/run1", deadline),
        vec![through(&to_full, &full), other.peer()],
        Mode::Always,
        relays.clone(),
    ));
    eventually("the peer mid-file", LONG, || async {
        to_full.held() && walk_bytes(&full.staging) >= MIB as u64
    })
    .await;
    assert_eq!(full.receiver.reserved(), bytes);
    // Something else on the volume takes every byte left; the rest of the file does not fit.
    assert!(volume.fill("filler") > 0);
    to_full.release();

    let report = ended(racing).await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    assert_eq!(
        report.relayed_to.as_deref(),
        Some(other.addr.to_string().as_str())
    );
    published_whole(&*store(&endpoint), "step-100", &files).await;
    // The full peer gave the relay up: its files gone, its bytes freed, counted as its space.
    eventually("the full peer's relay given up", LONG, || async {
        full.is_empty()
    })
    .await;
    has(
        &full.metrics(),
        &[
            "spotguard_relay_refusals_total{reason=\"space\"} 1",
            "spotguard_relay_received_total{outcome=\"aborted\"} 1",
            "spotguard_relay_received_total{outcome=\"published\"} 0",
        ],
    );
    let sent = spotguard::metrics::encode(&registry);
    has(
        &sent,
        &["spotguard_relay_sent_total{outcome=\"published\"} 1"],
    );
    // The refusal (507) reached the sender, or the connection it came on broke first.
    assert!(
        sent.contains("spotguard_relay_sent_total{outcome=\"refused\"} 1")
            || sent.contains("spotguard_relay_sent_total{outcome=\"failed\"} 1"),
        "{sent}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_doomed_nodes_on_one_peer_get_its_room_once_and_each_is_published_once() {
    if in_child("two_doomed_nodes_on_one_peer_get_its_room_once_and_each_is_published_once").await {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let shut = Proxy::start(&server, Shut::default()).await;
    let tmp = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(30);
    let endpoint = server.endpoint();
    let files = tree_files();
    let bytes: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    // Peer a's staging volume holds one checkpoint (6.2 MiB), not two; peer b takes one
    // checkpoint per sender (its cap).
    let volume = Tmpfs::mount(&tmp.path().join("volume"), 10 * MIB as u64);
    let a = start(
        &endpoint,
        "s3://ckpt",
        (volume.path().join("staging"), tmp.path().join("state")),
        1 << 40,
        idle,
    )
    .await;
    let per_sender = 7 * MIB as u64;
    let b = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("b")),
        per_sender,
        idle,
    )
    .await;
    // Two doomed nodes on one host: their connections leave from 127.0.0.2 and 127.0.0.3.
    let (x, y): (IpAddr, IpAddr) = ([127, 0, 0, 2].into(), [127, 0, 0, 3].into());
    let (x_a, x_b) = (
        Forward::start(a.addr, Some(x)).await,
        Forward::start(b.addr, Some(x)).await,
    );
    let (y_a, y_b) = (
        Forward::start(a.addr, Some(y)).await,
        Forward::start(b.addr, Some(y)).await,
    );
    let mut registry = Registry::default();
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);

    // x reserves a's room first, and holds it mid-file.
    x_a.hold_at(2 * MIB as u64);
    let x_dir = stage(&tmp.path().join("x"), "step-100", &files);
    let x_racing = tokio::spawn(race_to(
        upload_job(&x_dir, &shut.endpoint(), "s3://ckpt/run1", deadline),
        vec![through(&x_a, &a), through(&x_b, &b)],
        Mode::Always,
        relays.clone(),
    ));
    eventually("x mid-file on a", LONG, || async {
        x_a.held() && a.receiver.reserved() == bytes
    })
    .await;
    // y: a has no room left (507), so y goes on to b, where it too holds mid-file.
    y_b.hold_at(2 * MIB as u64);
    let y_dir = stage(&tmp.path().join("y"), "step-200", &files);
    let y_racing = tokio::spawn(race_to(
        upload_job(&y_dir, &shut.endpoint(), "s3://ckpt/run1", deadline),
        vec![through(&y_a, &a), through(&y_b, &b)],
        Mode::Always,
        relays.clone(),
    ));
    eventually("y mid-file on b", LONG, || async {
        y_b.held() && b.receiver.reserved() == bytes
    })
    .await;
    has(
        &a.metrics(),
        &["spotguard_relay_refusals_total{reason=\"space\"} 1"],
    );
    assert_eq!(a.receiver.reserved(), bytes);
    // b's cap is per sender address: y's address is at its cap, x's is not.
    let z_dir = stage(
        &tmp.path().join("z"),
        "step-300",
        &[("a.bin", data(MIB, 9))],
    );
    let (z, _) = outgoing(&z_dir, "s3://ckpt/run1");
    let y_b2 = Forward::start(b.addr, Some(y)).await;
    let refused = Raw::connect_to(y_b2.addr(), b.fingerprint)
        .await
        .reserve(&z)
        .await
        .unwrap_err();
    assert_eq!(refused.0, StatusCode::PAYLOAD_TOO_LARGE, "{}", refused.1);
    let x_b2 = Forward::start(b.addr, Some(x)).await;
    let mut raw = Raw::connect_to(x_b2.addr(), b.fingerprint).await;
    let id = raw.reserve(&z).await.unwrap();
    raw.call(
        Method::DELETE,
        &format!("{}/{id}", wire::RELAYS),
        Vec::new(),
    )
    .await;
    has(
        &b.metrics(),
        &["spotguard_relay_refusals_total{reason=\"cap\"} 1"],
    );

    // Both go on: each checkpoint published once, by the peer that took it.
    x_a.release();
    y_b.release();
    let (x_report, y_report) = (ended(x_racing).await, ended(y_racing).await);
    assert_eq!(x_report.outcome, Outcome::Published, "{x_report:?}");
    assert_eq!(x_report.relayed_to, Some(x_a.addr().to_string()));
    assert_eq!(y_report.outcome, Outcome::Published, "{y_report:?}");
    assert_eq!(y_report.relayed_to, Some(y_b.addr().to_string()));
    let s3 = store(&endpoint);
    published_whole(&*s3, "step-100", &files).await;
    published_whole(&*s3, "step-200", &files).await;
    has(
        &a.metrics(),
        &["spotguard_relay_received_total{outcome=\"published\"} 1"],
    );
    has(
        &b.metrics(),
        &["spotguard_relay_received_total{outcome=\"published\"} 1"],
    );
    has(
        &spotguard::metrics::encode(&registry),
        &[
            "spotguard_relay_sent_total{outcome=\"published\"} 2",
            "spotguard_relay_sent_total{outcome=\"refused\"} 1",
        ],
    );
    for (n, peer) in [("a", &a), ("b", &b)] {
        eventually(&format!("{n}'s staging emptied"), LONG, || async {
            peer.is_empty()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_stream_to_two_peers_at_once_and_the_checkpoint_is_published_once() {
    if in_child("two_copies_stream_to_two_peers_at_once_and_the_checkpoint_is_published_once").await
    {
        return;
    }
    let server = S3Server::s3s_fs(&[]);
    create_bucket(&server.endpoint(), BUCKET).await;
    let shut = Proxy::start(&server, Shut::default()).await;
    let tmp = tempfile::tempdir().unwrap();
    let idle = Duration::from_secs(30);
    let endpoint = server.endpoint();
    let a = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("a")),
        1 << 40,
        idle,
    )
    .await;
    let b = start(
        &endpoint,
        "s3://ckpt",
        dirs(&tmp.path().join("b")),
        1 << 40,
        idle,
    )
    .await;
    let (to_a, to_b) = (
        Forward::start(a.addr, None).await,
        Forward::start(b.addr, None).await,
    );
    to_a.hold_at(2 * MIB as u64);
    to_b.hold_at(2 * MIB as u64);
    let files = tree_files();
    let bytes: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    let dir = stage(tmp.path(), "step-100", &files);
    let mut registry = Registry::default();
    let relays = Arc::new(RelayMetrics::register(&mut registry));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    let racing = tokio::spawn(race_copies(
        upload_job(&dir, &shut.endpoint(), "s3://ckpt/run1", deadline),
        vec![through(&to_a, &a), through(&to_b, &b)],
        2,
        Mode::Always,
        relays.clone(),
    ));
    // Both peers take it at once (the first is still mid-file when the second has its part).
    eventually("both peers mid-file", LONG, || async {
        to_a.held()
            && to_b.held()
            && a.receiver.reserved() == bytes
            && b.receiver.reserved() == bytes
    })
    .await;
    // a publishes first; b goes on after that. (s3s-fs checks `If-None-Match` before it writes:
    // two manifests written at one instant may both be taken there, as S3 and GCS do not —
    // creating one manifest at most is the store's, tested in tests/upload.rs.)
    let s3 = store(&endpoint);
    to_a.release();
    eventually("a published", LONG, || async {
        get(&*s3, "run1/step-100/manifest.json").await.is_some()
    })
    .await;
    to_b.release();
    let report = ended(racing).await;
    assert_eq!(report.outcome, Outcome::Published, "{report:?}");
    let winner = report.relayed_to.clone().unwrap();
    assert!(
        [to_a.addr().to_string(), to_b.addr().to_string()].contains(&winner),
        "{winner}"
    );
    let m = published_whole(&*s3, "step-100", &files).await;
    // Each copy ended once: the winner published it or found it published (its peer may read
    // its own status after the other peer published), the other was stopped or found it
    // published. The peers' counts say which one wrote the manifest: exactly one.
    let sent = spotguard::metrics::encode(&registry);
    let count = |outcome: &str| {
        let line = format!("spotguard_relay_sent_total{{outcome=\"{outcome}\"}} ");
        sent.lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |n| n.parse::<u64>().unwrap())
    };
    assert!(
        count("published") + count("already_published") >= 1,
        "{sent}"
    );
    assert_eq!(
        count("published") + count("already_published") + count("cancelled"),
        2,
        "{sent}"
    );
    for (n, peer) in [("a", &a), ("b", &b)] {
        eventually(&format!("{n}'s staging emptied"), LONG, || async {
            peer.is_empty()
        })
        .await;
    }
    let published: u64 = [&a, &b]
        .iter()
        .map(|p| {
            p.metrics()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("spotguard_relay_received_total{outcome=\"published\"} ")
                })
                .map_or(0, |n| n.parse::<u64>().unwrap())
        })
        .sum();
    assert_eq!(published, 1, "both peers published");
    assert_eq!(
        get(&*s3, "run1/step-100/manifest.json").await.unwrap(),
        m.to_bytes()
    );
}
