//! The sender: one staged tree to one peer (`--relay-peers ADDR#SHA256`) over TLS pinned to the
//! peer's fingerprint — the reservation, every file (read with `pread` from the descriptors the
//! upload took, checksummed while read), the commit with the checksums — then the peer's
//! status until it published, failed, or the sender stops it (`DELETE`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;

use super::tls;
use super::wire::{self, Commit, FileCrcs, Refusal, Reserve, Reserved, Status};
use super::Error;
use crate::store::crc::Crcs;

/// Bytes read from a file per request body frame.
const READ_CHUNK: usize = 1 << 20;
/// The connection and TLS handshake must be done within this.
const CONNECT: Duration = Duration::from_secs(10);
/// How often the peer's status is read after the commit.
const POLL: Duration = Duration::from_millis(200);
/// The best-effort `DELETE` that gives a stopped relay up is done within this.
const GIVE_UP: Duration = Duration::from_secs(5);

/// A peer: `ADDR#SHA256` (`10.0.0.7:7443#9f86d0…`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// `host:port`.
    pub addr: String,
    pub fingerprint: [u8; 32],
}

impl Peer {
    pub fn parse(text: &str) -> Result<Peer, String> {
        let (addr, fp) = text.trim().split_once('#').ok_or_else(|| {
            format!("relay peer {text:?}: expected HOST:PORT#SHA256 (the peer's `spotguard relay fingerprint`)")
        })?;
        if addr
            .rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(format!(
                "relay peer {text:?}: expected HOST:PORT before the #"
            ));
        }
        Ok(Peer {
            addr: addr.to_string(),
            fingerprint: tls::parse_fingerprint(fp)?,
        })
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.addr)
    }
}

/// One file to send: its open descriptor (read with `pread`, so it may be shared with the
/// upload reading it at the same time) and its size as captured.
#[derive(Clone, Debug)]
pub struct Source {
    pub file: Arc<File>,
    pub size: u64,
}

type Conn = hyper::client::conn::http1::SendRequest<
    http_body_util::combinators::BoxBody<Bytes, std::io::Error>,
>;

struct Session {
    peer: Peer,
    key: String,
    conn: Conn,
}

fn body(data: Vec<u8>) -> http_body_util::combinators::BoxBody<Bytes, std::io::Error> {
    Full::new(Bytes::from(data))
        .map_err(|never| match never {})
        .boxed()
}

impl Session {
    async fn connect(peer: &Peer, key: &str) -> Result<Session, Error> {
        let err = |reason: String| Error::Peer {
            peer: peer.addr.clone(),
            reason,
        };
        let config = tls::client_config(peer.fingerprint)?;
        let connector = tokio_rustls::TlsConnector::from(config);
        let stream = tokio::time::timeout(CONNECT, async {
            let tcp = tokio::net::TcpStream::connect(&peer.addr)
                .await
                .map_err(|e| err(e.to_string()))?;
            let _ = tcp.set_nodelay(true);
            connector
                .connect(tls::server_name(), tcp)
                .await
                .map_err(|e| err(format!("TLS: {e}")))
        })
        .await
        .map_err(|_| err(format!("no connection within {CONNECT:?}")))??;
        let (conn, driver) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| err(e.to_string()))?;
        tokio::spawn(driver);
        Ok(Session {
            peer: peer.clone(),
            key: key.to_string(),
            conn,
        })
    }

    async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: http_body_util::combinators::BoxBody<Bytes, std::io::Error>,
        len: Option<u64>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let err = |reason: String| Error::Peer {
            peer: self.peer.addr.clone(),
            reason,
        };
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, tls::SERVER_NAME)
            .header(http::header::AUTHORIZATION, format!("Bearer {}", self.key));
        if let Some(n) = len {
            req = req.header(http::header::CONTENT_LENGTH, n);
        }
        let req = req.body(body).map_err(|e| err(e.to_string()))?;
        self.conn.ready().await.map_err(|e| err(e.to_string()))?;
        let resp = self
            .conn
            .send_request(req)
            .await
            .map_err(|e| err(e.to_string()))?;
        let status = resp.status();
        let data = http_body_util::Limited::new(resp.into_body(), wire::MAX_JSON)
            .collect()
            .await
            .map_err(|e| err(e.to_string()))?
            .to_bytes();
        Ok((status, data))
    }

    fn refused(&self, status: StatusCode, data: &[u8]) -> Error {
        let reason = serde_json::from_slice::<Refusal>(data)
            .map(|r| r.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&data[..data.len().min(512)]).into_owned());
        Error::Refused {
            peer: self.peer.addr.clone(),
            status: status.as_u16(),
            reason,
        }
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &mut self,
        method: Method,
        path: &str,
        data: Vec<u8>,
        expect: StatusCode,
    ) -> Result<T, Error> {
        let len = data.len() as u64;
        let (status, data) = self.call(method, path, body(data), Some(len)).await?;
        if status != expect {
            return Err(self.refused(status, &data));
        }
        serde_json::from_slice(&data).map_err(|e| Error::Peer {
            peer: self.peer.addr.clone(),
            reason: format!("an answer that is not the wire format: {e}"),
        })
    }

    /// Send one file's bytes; its checksums as read.
    async fn file(&mut self, id: &str, index: usize, src: &Source) -> Result<Crcs, Error> {
        let crcs = Arc::new(Mutex::new(Crcs::empty()));
        let (file, size, sums) = (src.file.clone(), src.size, crcs.clone());
        let stream = futures::stream::unfold(0u64, move |off| {
            let (file, sums) = (file.clone(), sums.clone());
            async move {
                if off >= size {
                    return None;
                }
                let n = (size - off).min(READ_CHUNK as u64) as usize;
                let read = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; n];
                    file.read_exact_at(&mut buf, off).map(|()| buf)
                })
                .await
                .map_err(std::io::Error::other)
                .and_then(|r| r);
                match read {
                    Ok(buf) => {
                        let mut s = crate::sync::lock(&sums);
                        *s = s.then(Crcs::of(&buf));
                        Some((Ok(Frame::data(Bytes::from(buf))), off + n as u64))
                    }
                    Err(e) => Some((Err(e), size)),
                }
            }
        });
        let body = StreamBody::new(stream).boxed();
        let path = format!("{}/{id}/files/{index}", wire::RELAYS);
        let (status, data) = self.call(Method::PUT, &path, body, Some(size)).await?;
        if status != StatusCode::NO_CONTENT {
            return Err(self.refused(status, &data));
        }
        let c = *crate::sync::lock(&crcs);
        Ok(c)
    }
}

/// Relay `files` (in `reserve`'s order) to `peer` with the node `key`, and wait for the peer's
/// end: `Ok` with its final status (published or not), `Err` when the peer refused, broke or
/// could not be reached, or had not published by `deadline` ([`Error::Deadline`]: the relay
/// is not finished; the peer may still publish it whole, never a part). `cancel` stops it.
/// Stopped or failed, the peer is told, best effort (`DELETE`, within [`GIVE_UP`]).
pub async fn relay(
    peer: &Peer,
    key: &str,
    reserve: Reserve,
    files: Vec<Source>,
    deadline: Option<tokio::time::Instant>,
    cancel: CancellationToken,
) -> Result<Status, Error> {
    let by_deadline = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    let reserving = async {
        let mut session = Session::connect(peer, key).await?;
        let data = serde_json::to_vec(&reserve).unwrap_or_default();
        let reserved: Reserved = session
            .json(Method::POST, wire::RELAYS, data, StatusCode::CREATED)
            .await?;
        Ok::<_, Error>((session, reserved.id))
    };
    let mut by_deadline = std::pin::pin!(by_deadline);
    let (mut session, id) = tokio::select! {
        r = reserving => r?,
        _ = cancel.cancelled() => return Err(Error::Cancelled { peer: peer.addr.clone() }),
        () = &mut by_deadline => return Err(Error::Deadline { peer: peer.addr.clone() }),
    };
    let run = async {
        let mut sums = Vec::with_capacity(files.len());
        for (i, src) in files.iter().enumerate() {
            sums.push(FileCrcs::of(&session.file(&id, i, src).await?));
        }
        let commit = serde_json::to_vec(&Commit { files: sums }).unwrap_or_default();
        let path = format!("{}/{id}/commit", wire::RELAYS);
        let _: Status = session
            .json(Method::POST, &path, commit, StatusCode::ACCEPTED)
            .await?;
        let path = format!("{}/{id}", wire::RELAYS);
        loop {
            let s: Status = session
                .json(Method::GET, &path, Vec::new(), StatusCode::OK)
                .await?;
            if s.state.is_final() {
                return Ok(s);
            }
            tokio::time::sleep(POLL).await;
        }
    };
    let ended = tokio::select! {
        r = run => r,
        _ = cancel.cancelled() => Err(Error::Cancelled { peer: peer.addr.clone() }),
        () = &mut by_deadline => Err(Error::Deadline { peer: peer.addr.clone() }),
    };
    if ended.is_err() {
        // The peer gives the relay up (its files go, nothing is published; a committed one it
        // publishes whole regardless); told on a connection of its own, as the first may be
        // mid-body.
        let _ = tokio::time::timeout(GIVE_UP, async {
            if let Ok(mut s) = Session::connect(peer, key).await {
                let path = format!("{}/{id}", wire::RELAYS);
                let _ = s
                    .call(Method::DELETE, &path, body(Vec::new()), Some(0))
                    .await;
            }
        })
        .await;
    }
    ended
}
