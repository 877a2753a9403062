//! The admin server against hostile clients: slow request heads are cut off after the header-read
//! timeout while /healthz keeps answering and memory stays bounded; oversized heads get 431; the
//! connection limit closes connections beyond it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;
use spotguard::admin::{self, Limits, Readiness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

struct AlwaysReady;

impl Readiness for AlwaysReady {
    fn ready(&self) -> Result<(), String> {
        Ok(())
    }
}

async fn server(limits: Limits) -> (SocketAddr, CancellationToken) {
    let mut registry = Registry::default();
    let _m = spotguard::metrics::Metrics::register(&mut registry);
    let cancel = CancellationToken::new();
    let (addr, fut) = admin::bind_with_limits(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(registry),
        Arc::new(AlwaysReady),
        limits,
        cancel.clone(),
    )
    .await
    .unwrap();
    tokio::spawn(fut);
    (addr, cancel)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn healthz(addr: SocketAddr) -> Result<u16, String> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

/// Trickle a request head one byte at a time until the server closes; returns when it did.
async fn slow_client(addr: SocketAddr, every: Duration) -> Instant {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    let mut buf = [0u8; 64];
    for b in head.iter().cycle() {
        if s.write_all(&[*b]).await.is_err() {
            return Instant::now();
        }
        match tokio::time::timeout(every, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Instant::now(),
            // Any answer (a 408, say) is followed by the close.
            Ok(Ok(_)) => {}
            Err(_) => {}
        }
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_header_clients_are_cut_off_and_healthz_keeps_answering() {
    let timeout = Duration::from_secs(2);
    let (addr, cancel) = server(Limits {
        header_read_timeout: timeout,
        ..Limits::default()
    })
    .await;
    assert_eq!(healthz(addr).await, Ok(200));
    let rss_before = rss_kib();

    const CLIENTS: usize = 300;
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| tokio::spawn(slow_client(addr, Duration::from_millis(250))))
        .collect();
    // While they trickle, the probe endpoint answers every time.
    let mut probes = 0;
    while started.elapsed() < timeout + Duration::from_millis(500) {
        assert_eq!(
            healthz(addr).await,
            Ok(200),
            "healthz failed under slow clients"
        );
        probes += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rss_during = rss_kib();
    let mut cut = Vec::new();
    for c in clients {
        let at = tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("a slow client was never cut off")
            .unwrap();
        cut.push(at.duration_since(started));
    }
    let (first, last) = (cut.iter().min().unwrap(), cut.iter().max().unwrap());
    assert!(
        *first >= timeout - Duration::from_millis(300),
        "cut after {first:?}, before the {timeout:?} timeout"
    );
    assert!(
        *last <= timeout + Duration::from_secs(3),
        "the last slow client lasted {last:?}"
    );
    assert!(probes >= 5);
    assert_eq!(healthz(addr).await, Ok(200));
    // 300 open connections, each with its buffers, must stay far below the 64 MiB limit.
    let growth = rss_during.saturating_sub(rss_before);
    assert!(
        growth < 24 * 1024,
        "RSS grew by {growth} KiB with {CLIENTS} slow clients"
    );
    cancel.cancel();
}

#[tokio::test]
async fn idle_connections_are_closed_after_the_timeout() {
    let (addr, cancel) = server(Limits {
        header_read_timeout: Duration::from_secs(1),
        ..Limits::default()
    })
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an idle connection stayed open")
        .unwrap_or(0);
    // Closed (possibly after a 408): the read returns the answer or EOF, then EOF.
    if n > 0 {
        let rest = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(rest, 0);
    }
    assert!(started.elapsed() >= Duration::from_millis(800));
    cancel.cancel();
}

#[tokio::test]
async fn oversized_request_heads_are_refused() {
    let (addr, cancel) = server(Limits::default()).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let big = "a".repeat(64 * 1024);
    let req = format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n");
    let _ = s.write_all(req.as_bytes()).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(
        text.starts_with("HTTP/1.1 431"),
        "answer to a 64 KiB header: {text:?}"
    );
    assert_eq!(healthz(addr).await, Ok(200));
    cancel.cancel();
}

#[tokio::test]
async fn connections_beyond_the_limit_are_closed_on_accept() {
    let (addr, cancel) = server(Limits {
        max_connections: 8,
        header_read_timeout: Duration::from_secs(30),
        ..Limits::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..8 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET").await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(2), extra.read(&mut buf))
        .await
        .expect("the connection over the limit was kept open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    // A slot frees when a held connection goes.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(healthz(addr).await, Ok(200));
    cancel.cancel();
}

/// One request on a kept-alive connection; `None` when the server closed it.
async fn keep_alive_request(s: &mut TcpStream) -> Option<()> {
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut buf = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .ok()?
        .ok()?;
    (n > 0 && buf.starts_with(b"HTTP/1.1 200")).then_some(())
}

/// Issue 24 item 7: one client holds every admin connection, keeping each alive with a tiny
/// request every 4 s. The kubelet's `/healthz` probe (a fresh connection each time) must still be
/// answered: it takes the place of the connection waiting longest between requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_holding_every_connection_does_not_keep_probes_out() {
    let limits = Limits::default();
    let (addr, cancel) = server(limits).await;
    let mut held = Vec::new();
    for _ in 0..limits.max_connections {
        let Ok(mut s) = TcpStream::connect(addr).await else {
            break;
        };
        if keep_alive_request(&mut s).await.is_some() {
            held.push(s);
        }
    }
    let holder = tokio::spawn(async move {
        // The tiny request every 4 s (within the 5 s keep-alive), on every connection still open.
        let mut open = held;
        loop {
            tokio::time::sleep(Duration::from_secs(4)).await;
            let mut still = Vec::with_capacity(open.len());
            for mut s in open {
                if keep_alive_request(&mut s).await.is_some() {
                    still.push(s);
                }
            }
            open = still;
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let mut answered = 0;
    while started.elapsed() < Duration::from_secs(9) {
        assert_eq!(
            healthz(addr).await,
            Ok(200),
            "a probe was kept out by a client holding every connection"
        );
        answered += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(answered >= 10);
    holder.abort();
    cancel.cancel();
}
