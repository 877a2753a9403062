//! Content verification with the checksums the stores keep.
//!
//! S3 returns an object's additional checksum (`x-amz-checksum-crc64nvme`, `-crc32c`, `-crc32`,
//! `-sha256`, with `x-amz-checksum-type: FULL_OBJECT` or `COMPOSITE`) on GET and HEAD when asked
//! with `x-amz-checksum-mode: ENABLED`; GCS returns `x-goog-hash: crc32c=…[,md5=…]` on every GET.
//! object_store does not surface those headers, so [`ChecksumConnector`] wraps its HTTP client
//! and copies them into a [`ChecksumSlot`] that the request carries in its extensions.
//!
//! CRCs are computed while the body streams, per ranged part, and combined
//! (`crc(A‖B)` from `crc(A)`, `crc(B)`, `len(B)`): a multipart download is verified without
//! reading the file back. Order of preference: CRC64NVME, CRC32C, CRC32, SHA-256, then the MD5 of
//! a plain (single-part) etag, then the size alone.

use std::sync::{Arc, Mutex};

use base64::Engine;
use crc_fast::CrcAlgorithm;
use md5::{Digest as _, Md5};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::ClientOptions;
use serde::Serialize;
use sha2::Sha256;

/// Header asking S3 for the object's additional checksum.
pub const CHECKSUM_MODE: &str = "x-amz-checksum-mode";

/// A full-object checksum the store reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreChecksum {
    Crc64Nvme(u64),
    Crc32c(u32),
    Crc32(u32),
    Sha256([u8; 32]),
}

/// What a published object was verified with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifiedBy {
    Crc64Nvme,
    Crc32c,
    Crc32,
    Sha256,
    Md5,
    Size,
}

impl StoreChecksum {
    pub fn kind(&self) -> VerifiedBy {
        match self {
            StoreChecksum::Crc64Nvme(_) => VerifiedBy::Crc64Nvme,
            StoreChecksum::Crc32c(_) => VerifiedBy::Crc32c,
            StoreChecksum::Crc32(_) => VerifiedBy::Crc32,
            StoreChecksum::Sha256(_) => VerifiedBy::Sha256,
        }
    }

    fn crc_algorithm(&self) -> Option<CrcAlgorithm> {
        match self {
            StoreChecksum::Crc64Nvme(_) => Some(CrcAlgorithm::Crc64Nvme),
            StoreChecksum::Crc32c(_) => Some(CrcAlgorithm::Crc32Iscsi),
            StoreChecksum::Crc32(_) => Some(CrcAlgorithm::Crc32IsoHdlc),
            StoreChecksum::Sha256(_) => None,
        }
    }

    /// Whether parts hashed separately can be combined (CRCs can, SHA-256 cannot).
    pub fn combinable(&self) -> bool {
        self.crc_algorithm().is_some()
    }

    /// A fresh hasher for this checksum.
    pub fn hasher(&self) -> Hasher {
        match self.crc_algorithm() {
            Some(a) => Hasher::Crc(a, Box::new(crc_fast::Digest::new(a)), 0),
            None => Hasher::Sha256(Box::default()),
        }
    }

    /// Whether `got` (a finished [`Hasher`]) matches.
    pub fn matches(&self, got: &Finished) -> bool {
        match (self, got) {
            (StoreChecksum::Crc64Nvme(a), Finished::Crc(b)) => *a == *b,
            (StoreChecksum::Crc32c(a), Finished::Crc(b))
            | (StoreChecksum::Crc32(a), Finished::Crc(b)) => u64::from(*a) == *b,
            (StoreChecksum::Sha256(a), Finished::Bytes(b)) => a.as_slice() == b.as_slice(),
            _ => false,
        }
    }

    /// Hex of the expected value (error messages).
    pub fn hex(&self) -> String {
        match self {
            StoreChecksum::Crc64Nvme(v) => format!("{v:016x}"),
            StoreChecksum::Crc32c(v) | StoreChecksum::Crc32(v) => format!("{v:08x}"),
            StoreChecksum::Sha256(b) => hex(b),
        }
    }

    /// The full-object checksum in response headers: S3's `x-amz-checksum-*` (not composite
    /// ones, which cover part checksums rather than the object) or GCS's `x-goog-hash` crc32c.
    pub fn from_headers(h: &http::HeaderMap) -> Option<StoreChecksum> {
        let get = |name: &str| h.get(name).and_then(|v| v.to_str().ok());
        let composite =
            get("x-amz-checksum-type").is_some_and(|t| t.eq_ignore_ascii_case("COMPOSITE"));
        if !composite {
            // A composite value also ends in "-<parts>", which fails to decode below anyway.
            if let Some(v) = get("x-amz-checksum-crc64nvme").and_then(b64::<8>) {
                return Some(StoreChecksum::Crc64Nvme(u64::from_be_bytes(v)));
            }
            if let Some(v) = get("x-amz-checksum-crc32c").and_then(b64::<4>) {
                return Some(StoreChecksum::Crc32c(u32::from_be_bytes(v)));
            }
            if let Some(v) = get("x-amz-checksum-crc32").and_then(b64::<4>) {
                return Some(StoreChecksum::Crc32(u32::from_be_bytes(v)));
            }
            if let Some(v) = get("x-amz-checksum-sha256").and_then(b64::<32>) {
                return Some(StoreChecksum::Sha256(v));
            }
        }
        for value in h.get_all("x-goog-hash") {
            let Ok(value) = value.to_str() else { continue };
            for item in value.split(',') {
                if let Some(v) = item.trim().strip_prefix("crc32c=").and_then(b64::<4>) {
                    return Some(StoreChecksum::Crc32c(u32::from_be_bytes(v)));
                }
            }
        }
        None
    }
}

fn b64<const N: usize>(s: &str) -> Option<[u8; N]> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .ok()?;
    bytes.try_into().ok()
}

/// Hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A running hash of (part of) an object.
#[derive(Clone)]
pub enum Hasher {
    /// A CRC, with the number of bytes it covers.
    Crc(CrcAlgorithm, Box<crc_fast::Digest>, u64),
    Sha256(Box<Sha256>),
    Md5(Box<Md5>),
}

/// A finished hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finished {
    Crc(u64),
    Bytes(Vec<u8>),
}

impl Hasher {
    pub fn md5() -> Hasher {
        Hasher::Md5(Box::default())
    }

    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Crc(_, d, n) => {
                d.update(data);
                *n += data.len() as u64;
            }
            Hasher::Sha256(h) => h.update(data),
            Hasher::Md5(h) => h.update(data),
        }
    }

    pub fn finish(self) -> Finished {
        match self {
            Hasher::Crc(_, d, _) => Finished::Crc(d.finalize()),
            Hasher::Sha256(h) => Finished::Bytes(h.finalize().to_vec()),
            Hasher::Md5(h) => Finished::Bytes(h.finalize().to_vec()),
        }
    }

    /// `crc(self ‖ next)`: CRCs of consecutive parts combined. `None` for other hashes.
    pub fn combine(self, next: Hasher) -> Option<Hasher> {
        match (self, next) {
            (Hasher::Crc(a, mut d1, n1), Hasher::Crc(b, d2, n2)) if a == b => {
                d1.combine(&d2);
                Some(Hasher::Crc(a, d1, n1 + n2))
            }
            _ => None,
        }
    }
}

/// Where [`ChecksumConnector`] puts the checksum of a response. Carried in the request's
/// extensions (`GetOptions::extensions`).
#[derive(Clone, Debug, Default)]
pub struct ChecksumSlot(Arc<Mutex<Option<StoreChecksum>>>);

impl ChecksumSlot {
    pub fn get(&self) -> Option<StoreChecksum> {
        *crate::sync::lock(&self.0)
    }

    fn set(&self, v: Option<StoreChecksum>) {
        *crate::sync::lock(&self.0) = v;
    }

    /// `GetOptions::extensions` carrying this slot.
    pub fn extensions(&self) -> http::Extensions {
        let mut e = http::Extensions::new();
        e.insert(self.clone());
        e
    }
}

/// object_store's reqwest connector, with response checksums copied into the request's
/// [`ChecksumSlot`]. Default headers of the options (`x-amz-checksum-mode`) are left to
/// object_store, which adds and signs them on GET and HEAD only: the reqwest client itself is
/// built without them, so that they never go out unsigned on other requests.
#[derive(Debug, Default)]
pub struct ChecksumConnector;

impl HttpConnector for ChecksumConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let plain = options.clone().with_default_headers(http::HeaderMap::new());
        let inner = ReqwestConnector::default().connect(&plain)?;
        Ok(HttpClient::new(ChecksumService { inner }))
    }
}

#[derive(Debug)]
struct ChecksumService {
    inner: HttpClient,
}

#[async_trait::async_trait]
impl HttpService for ChecksumService {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let slot = req.extensions().get::<ChecksumSlot>().cloned();
        let resp = self.inner.execute(req).await?;
        if let Some(slot) = slot {
            if resp.status().is_success() {
                slot.set(StoreChecksum::from_headers(resp.headers()));
            }
        }
        Ok(resp)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    fn b64e(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    #[test]
    fn headers_give_full_object_checksums_by_preference() {
        let data = b"123456789";
        let crc64 = crc_fast::checksum(CrcAlgorithm::Crc64Nvme, data);
        let crc32c = crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32;
        // CRC-32C check value of "123456789".
        assert_eq!(crc32c, 0xe306_9283);
        let h = headers(&[
            ("x-amz-checksum-crc32c", &b64e(&crc32c.to_be_bytes())),
            ("x-amz-checksum-crc64nvme", &b64e(&crc64.to_be_bytes())),
            ("x-amz-checksum-type", "FULL_OBJECT"),
        ]);
        let c = StoreChecksum::from_headers(&h).unwrap();
        assert_eq!(c, StoreChecksum::Crc64Nvme(crc64));
        let mut hasher = c.hasher();
        hasher.update(data);
        assert!(c.matches(&hasher.finish()));

        // Composite checksums (multipart uploads) do not cover the object.
        let composite = headers(&[
            ("x-amz-checksum-crc32c", "4waSgw==-3"),
            ("x-amz-checksum-type", "COMPOSITE"),
        ]);
        assert_eq!(StoreChecksum::from_headers(&composite), None);

        let gcs = headers(&[(
            "x-goog-hash",
            &format!("crc32c={},md5=xxxx", b64e(&crc32c.to_be_bytes())),
        )]);
        assert_eq!(
            StoreChecksum::from_headers(&gcs),
            Some(StoreChecksum::Crc32c(crc32c))
        );
        assert_eq!(StoreChecksum::from_headers(&headers(&[])), None);
    }

    #[test]
    fn crcs_of_parts_combine_into_the_whole() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for c in [
            StoreChecksum::Crc64Nvme(crc_fast::checksum(CrcAlgorithm::Crc64Nvme, &data)),
            StoreChecksum::Crc32c(crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, &data) as u32),
            StoreChecksum::Crc32(crc_fast::checksum(CrcAlgorithm::Crc32IsoHdlc, &data) as u32),
        ] {
            let mut parts = Vec::new();
            for chunk in data.chunks(30_001) {
                let mut h = c.hasher();
                h.update(chunk);
                parts.push(h);
            }
            let whole = parts
                .into_iter()
                .reduce(|a, b| a.combine(b).unwrap())
                .unwrap();
            assert!(c.matches(&whole.finish()), "{c:?}");
        }
        let mut wrong = StoreChecksum::Crc32c(1).hasher();
        wrong.update(&data);
        assert!(!StoreChecksum::Crc32c(1).matches(&wrong.finish()));
    }
}
