//! TLS for test servers: the acceptor the fault proxy serves with, and [`TlsFront`], a
//! TLS-terminating TCP forwarder that puts HTTPS in front of a plain-HTTP server (an S3 server)
//! with a test CA's certificate, so a test can show a client trusts a server through a given CA bundle
//! and refuses one whose CA is not in it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::k8s::pki::Pki;

/// A rustls acceptor serving the PEM certificate chain and key in these files (HTTP/1.1).
pub fn acceptor(cert: &Path, key: &Path) -> std::io::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(std::io::Error::other)?
        .collect::<Result<_, _>>()
        .map_err(std::io::Error::other)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(std::io::Error::other)?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(std::io::Error::other)?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(std::io::Error::other)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// HTTPS on a free loopback port, forwarded as plain TCP to `upstream`, with the serving
/// certificate of a test PKI ([`crate::k8s::pki::generate`]: valid for `127.0.0.1`, signed by
/// that PKI's own CA). Stops when dropped.
pub struct TlsFront {
    pub addr: SocketAddr,
    handshakes: Arc<Mutex<Handshakes>>,
    task: tokio::task::JoinHandle<()>,
}

/// What the front's TLS handshakes came to.
#[derive(Clone, Debug, Default)]
pub struct Handshakes {
    pub completed: u64,
    /// The error of each failed handshake (a client that refused the certificate sends an
    /// alert: `received fatal alert: UnknownCA`).
    pub failed: Vec<String>,
}

impl TlsFront {
    pub async fn start(upstream: SocketAddr, pki: &Pki) -> Result<TlsFront, String> {
        let tls = acceptor(&pki.serving_cert, &pki.serving_key).map_err(|e| e.to_string())?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let handshakes = Arc::new(Mutex::new(Handshakes::default()));
        let record = Arc::clone(&handshakes);
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let tls = tls.clone();
                let record = Arc::clone(&record);
                tokio::spawn(async move {
                    // A client that refuses the certificate ends here: nothing to forward.
                    let mut client = match tls.accept(tcp).await {
                        Ok(c) => {
                            record.lock().unwrap().completed += 1;
                            c
                        }
                        Err(e) => {
                            record.lock().unwrap().failed.push(e.to_string());
                            return;
                        }
                    };
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Ok(TlsFront {
            addr,
            handshakes,
            task,
        })
    }

    /// The handshakes so far.
    pub fn handshakes(&self) -> Handshakes {
        self.handshakes.lock().unwrap().clone()
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
