//! The S3-compatible servers of the tests, on free loopback ports: s3s-fs (its objects plain files
//! under a temp dir) and moto's server; and a [`Throttle`]: a TCP proxy that forwards the client's bytes at a fixed
//! rate, a slow network in front of it (an upload that lasts seconds with a few MiB); and in
//! [`proxy`], an HTTP proxy in front of it that injects a test's faults.
//!
//! Needs `s3s-fs` and `moto_server` (`scripts/deps/prefetch.sh`).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::process::Kid;

pub mod proxy;

pub const ACCESS_KEY: &str = "spotguardtest";
pub const SECRET_KEY: &str = "spotguardtestsecret";
pub const REGION: &str = "us-east-1";
const DEPS: &str = "scripts/deps/prefetch.sh";

/// A running S3-compatible server on a free loopback port (s3s-fs or moto); killed on drop.
pub struct S3Server {
    _child: Kid,
    pub addr: SocketAddr,
    dir: Option<tempfile::TempDir>,
}

impl S3Server {
    /// s3s-fs over a fresh directory, with `buckets` created (s3s-fs maps a bucket to a
    /// directory). It keeps the checksums sent with an upload.
    pub fn s3s_fs(buckets: &[&str]) -> S3Server {
        let dir = tempfile::tempdir().unwrap();
        for b in buckets {
            std::fs::create_dir(dir.path().join(b)).unwrap();
        }
        let mut cmd = Command::new("s3s-fs");
        cmd.args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(dir.path())
            .env("RUST_LOG", "s3s_fs=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = Kid::try_spawn(cmd)
            .unwrap_or_else(|e| panic!("cannot run s3s-fs ({e}): install it with {DEPS}"));
        let out = child.take_stdout().unwrap();
        let addr = wait_for_address(out, "server is running at http://", "s3s-fs");
        S3Server {
            _child: child,
            addr,
            dir: Some(dir),
        }
    }

    /// moto's S3 server (honours `If-Match` on GET); buckets are made through the API.
    pub fn moto() -> S3Server {
        let mut cmd = Command::new("moto_server");
        cmd.args(["-H", "127.0.0.1", "-p", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = Kid::try_spawn(cmd)
            .unwrap_or_else(|e| panic!("cannot run moto_server ({e}): install it with {DEPS}"));
        let err = child.take_stderr().unwrap();
        let addr = wait_for_address(err, "Running on http://", "moto_server");
        S3Server {
            _child: child,
            addr,
            dir: None,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Where object `key` of `bucket` lies on disk (s3s-fs only).
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        let dir = self
            .dir
            .as_ref()
            .expect("objects on disk: an s3s-fs server");
        dir.path().join(bucket).join(key)
    }

    /// The environment a client needs (pass it to a child `Command`).
    pub fn client_env() -> [(&'static str, &'static str); 4] {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_REGION", REGION),
            ("AWS_EC2_METADATA_DISABLED", "true"),
        ]
    }
}

/// A store client in the code under test reads its credentials from the environment, which a
/// test never changes in its own process (other tests' threads read it): the test `name` runs
/// again, alone, as a child of this test binary with [`S3Server::client_env`] set. `true`: this
/// is the parent, and the child passed; `false`: this is the child, which runs the test.
pub async fn in_child(name: &str) -> bool {
    const CHILD: &str = "SPOTGUARD_S3_TEST_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let out = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .envs(S3Server::client_env())
        .env(CHILD, "1")
        .output()
        .await
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{name} failed in its child process:\n{text}"
    );
    assert!(
        text.contains("1 passed"),
        "{name} did not run in its child:\n{text}"
    );
    true
}

/// Create `bucket` through the S3 API (a `PUT /bucket` signed with the test credentials, as any
/// S3 request): moto starts with no bucket; s3s-fs takes one made this way too. Panics with the
/// server's answer when it refuses.
pub async fn create_bucket(endpoint: &str, bucket: &str) {
    use object_store::aws::{AwsAuthorizer, AwsCredential};
    let cred = AwsCredential {
        key_id: ACCESS_KEY.into(),
        secret_key: SECRET_KEY.into(),
        token: None,
    };
    let mut req = object_store::client::HttpRequest::new(Vec::<u8>::new().into());
    *req.method_mut() = http::Method::PUT;
    *req.uri_mut() = format!("{endpoint}/{bucket}").parse().unwrap();
    let host = req.uri().authority().unwrap().to_string();
    req.headers_mut()
        .insert(http::header::HOST, host.parse().unwrap());
    AwsAuthorizer::new(&cred, "s3", REGION).authorize(&mut req, None);
    let mut r = reqwest::Client::new().put(req.uri().to_string());
    for (k, v) in req.headers() {
        r = r.header(k, v);
    }
    let resp = r.send().await.unwrap();
    assert!(
        resp.status().is_success(),
        "create bucket {bucket}: {} {}",
        resp.status(),
        resp.text().await.unwrap_or_default()
    );
}

/// The address a server prints after `marker` on `reader`; the reader is drained to its end on
/// a thread of its own, so the server never blocks on a full pipe.
fn wait_for_address(
    reader: impl std::io::Read + Send + 'static,
    marker: &'static str,
    what: &str,
) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(reader).lines().map_while(Result::ok) {
            if sent {
                continue;
            }
            if let Some(rest) = line.split(marker).nth(1) {
                let addr: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
                    .collect();
                if let Ok(a) = addr.parse::<SocketAddr>() {
                    let _ = tx.send(a);
                    sent = true;
                }
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} did not report its address within 60 s"))
}

/// A TCP proxy on a free loopback port that forwards client → server bytes at `rate`
/// bytes per second (shared by all connections) and server → client unthrottled. Runs until
/// the test's runtime ends.
pub struct Throttle {
    pub addr: SocketAddr,
    /// Bytes forwarded client → server so far.
    pub forwarded: Arc<AtomicU64>,
}

impl Throttle {
    pub async fn start(upstream: SocketAddr, rate: u64) -> Throttle {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let forwarded = Arc::new(AtomicU64::new(0));
        let bucket = Arc::new(tokio::sync::Mutex::new(()));
        let count = forwarded.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (count, bucket) = (count.clone(), bucket.clone());
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = async move {
                        let mut buf = vec![0u8; 16 << 10];
                        loop {
                            let n = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            {
                                // One connection at a time takes its share of the rate.
                                let _turn = bucket.lock().await;
                                let pause = Duration::from_secs_f64(n as f64 / rate as f64);
                                tokio::time::sleep(pause).await;
                            }
                            if sw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                            count.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        let _ = sw.shutdown().await;
                    };
                    let down = async move {
                        let _ = tokio::io::copy(&mut sr, &mut cw).await;
                        let _ = cw.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        Throttle { addr, forwarded }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}
