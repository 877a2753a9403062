//! The relay's channel: TLS with a self-signed certificate each node makes once and keeps in
//! its state dir, and clients that accept exactly the certificate whose SHA-256 fingerprint they
//! were given (`--relay-peers ADDR#SHA256`): no CA to run, no names to check.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest, Sha256};

use super::Error;

/// The name every relay certificate carries (never checked: the fingerprint is the identity).
pub const SERVER_NAME: &str = "spotguard-relay";

/// The certificate's and key's file names under `<state-dir>/relay/`.
const CERT_FILE: &str = "cert.der";
const KEY_FILE: &str = "key.der";

/// This node's relay certificate and key.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    key: PrivatePkcs8KeyDer<'static>,
    /// SHA-256 of the certificate (DER).
    pub fingerprint: [u8; 32],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &hex(&self.fingerprint))
            .finish_non_exhaustive()
    }
}

/// Where the identity lives: `<state-dir>/relay/`.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("relay")
}

/// SHA-256 of `der`.
pub fn fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fingerprint given as 64 hex digits (`:` between bytes allowed, as `openssl` prints them).
pub fn parse_fingerprint(text: &str) -> Result<[u8; 32], String> {
    let digits: String = text.chars().filter(|c| *c != ':').collect();
    if digits.len() != 64 || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "fingerprint {text:?}: expected the certificate's SHA-256 as 64 hex digits"
        ));
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

impl Identity {
    /// The identity kept under `dir`, made (ECDSA P-256, self-signed) and kept there if there is
    /// none. Blocking.
    pub fn load_or_create(dir: &Path) -> Result<Identity, Error> {
        let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        match (std::fs::read(&cert_path), std::fs::read(&key_path)) {
            (Ok(cert), Ok(key)) => return Ok(Identity::from_der(cert, key)),
            (Err(e), _) | (_, Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::Io {
                    what: format!("read the relay certificate in {}", dir.display()),
                    source: e,
                })
            }
            _ => {}
        }
        let made =
            rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()]).map_err(|e| {
                Error::Tls {
                    reason: format!("making the relay certificate: {e}"),
                }
            })?;
        let cert = made.cert.der().to_vec();
        let key = made.signing_key.serialize_der();
        std::fs::create_dir_all(dir).map_err(|e| Error::Io {
            what: format!("create {}", dir.display()),
            source: e,
        })?;
        // The key first: a certificate is never kept without its key.
        for (path, data, mode) in [(&key_path, &key, 0o600), (&cert_path, &cert, 0o644)] {
            crate::fsutil::write_atomic(path, data, mode).map_err(|e| Error::Io {
                what: format!("write {}", path.display()),
                source: e,
            })?;
        }
        Ok(Identity::from_der(cert, key))
    }

    fn from_der(cert: Vec<u8>, key: Vec<u8>) -> Identity {
        Identity {
            fingerprint: fingerprint(&cert),
            cert: CertificateDer::from(cert),
            key: PrivatePkcs8KeyDer::from(key),
        }
    }

    /// The receiver's TLS configuration.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, Error> {
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(tls_err)?
            .with_no_client_auth()
            .with_single_cert(
                vec![self.cert.clone()],
                PrivateKeyDer::Pkcs8(self.key.clone_key()),
            )
            .map_err(tls_err)?;
        Ok(Arc::new(config))
    }
}

fn tls_err(e: rustls::Error) -> Error {
    Error::Tls {
        reason: e.to_string(),
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A sender's TLS configuration for a peer whose certificate has `fingerprint`.
pub fn client_config(fingerprint: [u8; 32]) -> Result<Arc<rustls::ClientConfig>, Error> {
    let provider = provider();
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Pinned {
            fingerprint,
            provider,
        }))
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// The server name a sender presents (any: the fingerprint is what is checked).
pub fn server_name() -> ServerName<'static> {
    ServerName::try_from(SERVER_NAME).expect("a valid DNS name")
}

/// Accepts the one certificate whose SHA-256 is `fingerprint`; the handshake's signatures are
/// still verified with its key, so only the holder of that certificate's key gets through.
#[derive(Debug)]
struct Pinned {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let seen = fingerprint(end_entity);
        if seen == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(format!(
                "the peer's certificate has fingerprint {}, not the configured {}",
                hex(&seen),
                hex(&self.fingerprint)
            )))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_made_once_and_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(tmp.path()).unwrap();
        let b = Identity::load_or_create(tmp.path()).unwrap();
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.fingerprint, fingerprint(&a.cert));
        let key = std::fs::metadata(tmp.path().join(KEY_FILE)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(key.permissions().mode() & 0o777, 0o600);
        a.server_config().unwrap();
    }

    #[test]
    fn fingerprints_parse_as_hex_with_or_without_colons() {
        let f = [0xabu8; 32];
        assert_eq!(parse_fingerprint(&hex(&f)).unwrap(), f);
        let colons: Vec<String> = f.iter().map(|b| format!("{b:02X}")).collect();
        assert_eq!(parse_fingerprint(&colons.join(":")).unwrap(), f);
        assert!(parse_fingerprint("abc").is_err());
        assert!(parse_fingerprint(&"zz".repeat(32)).is_err());
    }
}
