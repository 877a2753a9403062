//! The admin server against hostile clients: slow request heads are cut off after the header-read
//! timeout while /healthz keeps answering and memory stays bounded; oversized heads get 431; a
//! connection beyond a limit takes the place of the one waiting longest for its head, so slow
//! heads from the probes' own address, or over the global limit, never keep probes out.

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

/// A connection over the limit takes the place of the one that has been waiting for its request
/// head longest (issue 34 item 3): the oldest held half-head is closed, the new one is served.
#[tokio::test]
async fn a_connection_beyond_the_limit_takes_the_place_of_the_longest_waiting() {
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
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), held[0].read(&mut buf))
        .await
        .expect("the longest-waiting connection was kept open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(keep_alive_request(&mut extra).await, Some(()));
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

/// `path` from `from` on a fresh connection (as the kubelet probes): the status, or the error.
async fn probe(addr: SocketAddr, from: std::net::IpAddr, path: &str) -> Result<u16, String> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .local_address(from)
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    client
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .map_err(|e| spotguard::words::chain(&e))
}

/// `n` connections from `from`, each sending half a request head and reopened as soon as the
/// server closes it (the header timeout, or another connection taking its place); `open` counts
/// those holding a connection.
fn slow_heads(
    addr: SocketAddr,
    from: std::net::IpAddr,
    n: usize,
    open: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
) -> tokio::task::JoinSet<()> {
    use std::sync::atomic::Ordering;
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (open, stop) = (open.clone(), stop.clone());
        set.spawn(async move {
            while !stop.is_cancelled() {
                let sock = tokio::net::TcpSocket::new_v4().unwrap();
                sock.bind(SocketAddr::new(from, 0)).unwrap();
                let Ok(mut s) = sock.connect(addr).await else {
                    tokio::task::yield_now().await;
                    continue;
                };
                if s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Sl")
                    .await
                    .is_err()
                {
                    continue;
                }
                open.fetch_add(1, Ordering::SeqCst);
                let mut buf = [0u8; 256];
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        r = s.read(&mut buf) => match r {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        },
                    }
                }
                open.fetch_sub(1, Ordering::SeqCst);
            }
        });
    }
    set
}

/// Wait until `open` holds at least `n` connections.
async fn wait_open(open: &std::sync::atomic::AtomicUsize, n: usize) {
    let started = Instant::now();
    while open.load(std::sync::atomic::Ordering::SeqCst) < n {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "only {} of {n} slow connections open",
            open.load(std::sync::atomic::Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Probe `/healthz`, `/readyz` and `/metrics` from `from`, `rounds` times each, one after
/// another; the failures.
async fn probe_rounds(addr: SocketAddr, from: std::net::IpAddr, rounds: usize) -> Vec<String> {
    let mut failed = Vec::new();
    for _ in 0..rounds {
        for path in ["/healthz", "/readyz", "/metrics"] {
            match probe(addr, from, path).await {
                Ok(200) => {}
                other => failed.push(format!("{path}: {other:?}")),
            }
        }
    }
    failed
}

/// Issue 34 item 3: 384 connections from the probe's own address (127.0.0.1, the node's address
/// that hostNetwork pods share), each stuck sending half a request head and reopened when it is
/// closed: every `/healthz`, `/readyz` and `/metrics` probe from that address is answered (a new
/// connection takes the place of the one waiting longest for its head).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_from_the_probes_own_address_never_keep_probes_out() {
    let limits = Limits::default();
    let (addr, cancel) = server(limits).await;
    let local: std::net::IpAddr = "127.0.0.1".parse().unwrap();
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let attack = slow_heads(addr, local, 384, open.clone(), stop.clone());
    wait_open(&open, 384).await;
    let failed = probe_rounds(addr, local, 20).await;
    stop.cancel();
    attack.join_all().await;
    assert!(
        failed.is_empty(),
        "{} of 60 probes failed: {failed:?}",
        failed.len()
    );
    cancel.cancel();
}

/// Issue 34 item 3: 260 slow-head connections from each of two addresses (520, more than the
/// global limit of 512), reopened as they close: probes from a third address and from one of the
/// two are all answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_heads_from_two_addresses_over_the_global_limit_never_keep_probes_out() {
    let limits = Limits::default();
    let (addr, cancel) = server(limits).await;
    let ip = |s: &str| -> std::net::IpAddr { s.parse().unwrap() };
    let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let a = slow_heads(addr, ip("127.0.0.1"), 260, open.clone(), stop.clone());
    let b = slow_heads(addr, ip("127.0.0.2"), 260, open.clone(), stop.clone());
    wait_open(&open, limits.max_connections).await;
    let mut failed = probe_rounds(addr, ip("127.0.0.3"), 10).await;
    failed.extend(probe_rounds(addr, ip("127.0.0.1"), 10).await);
    stop.cancel();
    a.join_all().await;
    b.join_all().await;
    assert!(
        failed.is_empty(),
        "{} of 60 probes failed: {failed:?}",
        failed.len()
    );
    cancel.cancel();
}
