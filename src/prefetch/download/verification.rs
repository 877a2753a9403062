//! Verification before publishing: the store's full-object checksum (from a HEAD or the GET's
//! headers), the MD5 of a plain etag, or the size; hashes not computed while streaming are
//! computed by reading the part file back.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use object_store::{GetOptions, ObjectStore};

use super::fetch::with_request;
use super::lease::Active;
use super::plan::Listed;
use super::run::{blocking, Run, Stop};
use crate::prefetch::progress::Progress;
use crate::prefetch::verify;
use crate::prefetch::verify::{ChecksumSlot, Finished, Hasher, StoreChecksum};
use crate::prefetch::Error;

pub(super) fn finished_hex(f: &Finished) -> String {
    match f {
        Finished::Crc(v) => format!("{v:x}"),
        Finished::Bytes(b) => verify::hex(b),
    }
}

pub(super) async fn read_back(
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

/// HEAD with the checksum asked for: the object's full checksum (if the store keeps one) and
/// its etag.
pub(super) async fn head_checksum(
    run: &Arc<Run>,
    listed: &Listed,
    active: &Arc<Active>,
    holding_slot: bool,
) -> Result<(Option<StoreChecksum>, Option<String>), Stop> {
    let slot = ChecksumSlot::default();
    let opts = GetOptions {
        head: true,
        extensions: slot.extensions(),
        ..GetOptions::default()
    };
    let key = &listed.entry.key;
    Progress::add(&run.progress.requests, 1);
    let head = async {
        tokio::select! {
            _ = run.abort.cancelled() => Err(run.stopped().unwrap_or(Stop::Aborted)),
            _ = active.lost.cancelled() => Err(Stop::Lost),
            r = run.store.get_opts(&listed.location, opts) => Ok(r),
        }
    };
    // A caller holding its request slot already must not wait for a second one.
    let res = if holding_slot {
        head.await?
    } else {
        with_request(run, active, head).await?
    };
    match res {
        Ok(r) => {
            if r.meta.size != listed.entry.size {
                return Err(Stop::Err(Error::Changed { key: key.clone() }));
            }
            Ok((slot.get(), r.meta.e_tag))
        }
        Err(object_store::Error::NotFound { .. }) => {
            Err(Stop::Err(Error::Changed { key: key.clone() }))
        }
        Err(e) => Err(Stop::Err(Error::get(key, e))),
    }
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
