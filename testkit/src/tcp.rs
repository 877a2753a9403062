//! A TCP forwarder between a client and a server, for faults on a stream the test does not
//! speak (TLS included): its connections to the server leave from a loopback address of the
//! test's choice (`127.0.0.2`: a second node on one host), it counts the bytes it passes to the
//! server, and it can hold them at a mark — the client's stream stops there, mid-request, until
//! the test releases it. A test waits for [`Forward::held`] (an event), not for a time.
//! When either side closes, the forwarder closes the other.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;

/// A forwarder on a free loopback port (dropped: it stops accepting; open connections go on).
pub struct Forward {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    upstream: SocketAddr,
    bind: Option<IpAddr>,
    /// Bytes passed to the server, all connections together.
    forwarded: AtomicU64,
    /// Bytes to the server stop at this many (`u64::MAX`: never).
    hold: watch::Sender<u64>,
}

impl Forward {
    /// Forward to `upstream`, connecting from `bind` (any port) when given.
    pub async fn start(upstream: SocketAddr, bind: Option<IpAddr>) -> Forward {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream,
            bind,
            forwarded: AtomicU64::new(0),
            hold: watch::channel(u64::MAX).0,
        });
        let task = tokio::spawn({
            let shared = shared.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(shared.clone().serve(client));
                }
            }
        });
        Forward { addr, shared, task }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Bytes passed to the server so far.
    pub fn forwarded(&self) -> u64 {
        self.shared.forwarded.load(Ordering::SeqCst)
    }

    /// Pass at most `bytes` in all to the server (counted from the start), then hold.
    pub fn hold_at(&self, bytes: u64) {
        self.shared.hold.send_replace(bytes);
    }

    /// The stream to the server has reached its mark and waits.
    pub fn held(&self) -> bool {
        self.forwarded() >= *self.shared.hold.borrow()
    }

    /// Pass everything again.
    pub fn release(&self) {
        self.shared.hold.send_replace(u64::MAX);
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    async fn connect(&self) -> std::io::Result<TcpStream> {
        let socket = match self.upstream {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        if let Some(ip) = self.bind {
            socket.bind(SocketAddr::new(ip, 0))?;
        }
        socket.connect(self.upstream).await
    }

    async fn serve(self: Arc<Self>, client: TcpStream) {
        let Ok(server) = self.connect().await else {
            return;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (mut client_rx, mut client_tx) = client.into_split();
        let (mut server_rx, mut server_tx) = server.into_split();
        let up = async {
            let mut hold = self.hold.subscribe();
            let mut buf = vec![0u8; 64 << 10];
            loop {
                let allowed = loop {
                    let mark = *hold.borrow_and_update();
                    let done = self.forwarded.load(Ordering::SeqCst);
                    if done < mark {
                        break mark - done;
                    }
                    if hold.changed().await.is_err() {
                        return;
                    }
                };
                let want = buf
                    .len()
                    .min(usize::try_from(allowed).unwrap_or(usize::MAX));
                let n = match client_rx.read(&mut buf[..want]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
                self.forwarded.fetch_add(n as u64, Ordering::SeqCst);
            }
        };
        let down = tokio::io::copy(&mut server_rx, &mut client_tx);
        // Either side closed: both close (the sockets drop here).
        tokio::select! {
            () = up => {}
            _ = down => {}
        }
    }
}
