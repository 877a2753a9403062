//! Verification before publishing: the store's full-object checksum (from a HEAD or the GET's
//! headers), the MD5 of a plain etag, or the size; hashes not computed while streaming are
//! computed by reading the part file back.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use super::run::{blocking, Stop};
use crate::prefetch::manifest::etag_md5;
use crate::prefetch::Error;
use crate::store::checksum::{self as verify, Finished, Hasher, StoreChecksum, VerifiedBy};

/// Verify the part file of an object of `size` (> 0) bytes before it is published. Content: the
/// store's checksum, else a plain-MD5 etag, else the size alone. A hash not computed inline
/// (resumed bytes, SHA-256 or MD5 over ranged parts) is computed by reading the part file back.
pub(super) async fn verify_part(
    key: &str,
    size: u64,
    file: &Arc<File>,
    part_path: &Path,
    checksum: Option<StoreChecksum>,
    inline: Option<Hasher>,
    etag: Option<&str>,
) -> Result<VerifiedBy, Stop> {
    let md5_expected = etag.and_then(etag_md5);
    let verified_by = if let Some(c) = checksum {
        let got = match inline.filter(|h| !matches!(h, Hasher::Md5(_))) {
            Some(h) => h.finish(),
            None => read_back(file, size, c.hasher(), key, part_path).await?,
        };
        if !c.matches(&got) {
            return Err(Stop::Err(Error::ChecksumMismatch {
                key: key.to_string(),
                algorithm: c.kind(),
                expected: c.hex(),
                got: finished_hex(&got),
            }));
        }
        c.kind()
    } else if let Some(expected) = md5_expected {
        let got = match inline.filter(|h| matches!(h, Hasher::Md5(_))) {
            Some(h) => h.finish(),
            None => read_back(file, size, Hasher::md5(), key, part_path).await?,
        };
        if got != Finished::Bytes(expected.to_vec()) {
            return Err(Stop::Err(Error::ChecksumMismatch {
                key: key.to_string(),
                algorithm: VerifiedBy::Md5,
                expected: verify::hex(&expected),
                got: finished_hex(&got),
            }));
        }
        VerifiedBy::Md5
    } else {
        VerifiedBy::Size
    };
    Ok(verified_by)
}

fn finished_hex(f: &Finished) -> String {
    match f {
        Finished::Crc(v) => format!("{v:x}"),
        Finished::Bytes(b) => verify::hex(b),
    }
}

async fn read_back(
    file: &Arc<File>,
    size: u64,
    hasher: Hasher,
    key: &str,
    part: &Path,
) -> Result<Finished, Stop> {
    let (f, k, p) = (file.clone(), key.to_string(), part.to_path_buf());
    Ok(blocking(move || hash_file(&f, size, hasher))
        .await?
        .map_err(|e| Error::io_for(&k, "read back part file", p, e))?)
}

/// `h` over the first `size` bytes of `f`.
fn hash_file(f: &File, size: u64, mut h: Hasher) -> io::Result<Finished> {
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let want = usize::try_from((size - at).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = f.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "part file shorter than the object",
            ));
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(h.finish())
}
