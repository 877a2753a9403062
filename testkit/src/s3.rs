//! An S3-compatible server for tests (s3s-fs on a free loopback port, its objects plain files
//! under a temp dir) and a [`Throttle`]: a TCP proxy that forwards the client's bytes at a fixed
//! rate, a slow network in front of it (an upload that lasts seconds with a few MiB).
//!
//! Needs `s3s-fs` (`scripts/deps/prefetch.sh`).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const ACCESS_KEY: &str = "spotguardtest";
pub const SECRET_KEY: &str = "spotguardtestsecret";
pub const REGION: &str = "us-east-1";

/// A running s3s-fs; killed on drop.
pub struct S3sFs {
    child: Child,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl S3sFs {
    /// Start s3s-fs with `buckets` created.
    pub fn start(buckets: &[&str]) -> S3sFs {
        let dir = tempfile::tempdir().unwrap();
        for b in buckets {
            std::fs::create_dir(dir.path().join(b)).unwrap();
        }
        let mut child = Command::new("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(dir.path())
            .env("RUST_LOG", "s3s_fs=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run s3s-fs ({e}): scripts/deps/prefetch.sh"));
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if sent {
                    continue;
                }
                if let Some(rest) = line.split("server is running at http://").nth(1) {
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
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("s3s-fs did not report its address");
        S3sFs { child, addr, dir }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Where object `key` of `bucket` lies on disk.
    pub fn object_path(&self, bucket: &str, key: &str) -> PathBuf {
        self.dir.path().join(bucket).join(key)
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
