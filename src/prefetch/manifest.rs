//! The dataset manifest, `<dataset>/.spotguard/manifest.json`: every object of the source with its
//! size, etag and whether the local file is whole and verified (`done`).
//!
//! Several processes may update one manifest (a shared cache): each merges its changes into the
//! file under `.spotguard/manifest.lock` (read, merge, write to a temp file, rename), so nobody's
//! updates are lost and readers always see a whole file.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::claim::LockFile;
use crate::fsutil::write_atomic;

/// Manifest format version.
pub const VERSION: u32 = 1;

/// One object of the dataset.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Key relative to the dataset prefix (and the file's path under the dataset directory).
    pub key: String,
    pub size: u64,
    /// The store's etag (quotes included, as the store sends it); `None` if it gave none.
    pub etag: Option<String>,
    /// Last-modified time at the source (Unix ms), the change detector when the listing has no
    /// etag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modified_ms: Option<i64>,
    /// The file at `key` is whole and verified for this size and etag.
    pub done: bool,
}

impl Entry {
    /// Whether this entry describes the same version of the object as `other` (a listing).
    pub fn same_version(&self, other: &Entry) -> bool {
        if self.size != other.size {
            return false;
        }
        match (&self.etag, &other.etag) {
            (Some(a), Some(b)) => normalize_etag(a) == normalize_etag(b),
            // A listing without etags (some S3-compatible servers): size and mtime.
            _ => self.modified_ms.is_some() && self.modified_ms == other.modified_ms,
        }
    }
}

/// An etag without its quotes and weak prefix.
pub fn normalize_etag(etag: &str) -> &str {
    etag.trim_start_matches("W/").trim_matches('"')
}

/// The MD5 an etag stands for, when it is a plain MD5 (a single-part S3 upload, a
/// non-composite GCS object): 32 hex digits. Multipart etags (`<hex>-<parts>`) and other
/// stores' etags give `None`.
pub fn etag_md5(etag: &str) -> Option<[u8; 16]> {
    let hex = normalize_etag(etag);
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// The manifest file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    /// Source URL of the dataset.
    pub source: String,
    /// Entries by key.
    #[serde(with = "entries_as_list")]
    pub objects: BTreeMap<String, Entry>,
}

mod entries_as_list {
    use super::Entry;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use std::collections::BTreeMap;

    pub fn serialize<S: Serializer>(
        map: &BTreeMap<String, Entry>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let list: Vec<&Entry> = map.values().collect();
        list.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Entry>, D::Error> {
        let list = Vec::<Entry>::deserialize(d)?;
        Ok(list.into_iter().map(|e| (e.key.clone(), e)).collect())
    }
}

/// A change to merge into the manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Update {
    /// An object seen in the listing that still needs fetching. Does not undo `done` for the
    /// same version (another process may have finished it meanwhile).
    Pending(Entry),
    /// The file is published and verified.
    Done(Entry),
    /// The object is gone from the source.
    Remove(String),
}

impl Manifest {
    pub fn new(source: &str) -> Manifest {
        Manifest {
            version: VERSION,
            source: source.to_string(),
            objects: BTreeMap::new(),
        }
    }

    /// Read a manifest; a missing file is an empty manifest. Blocking.
    pub fn load(path: &Path, source: &str) -> io::Result<Manifest> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice::<Manifest>(&bytes).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} is not a valid manifest: {e}", path.display()),
                )
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Manifest::new(source)),
            Err(e) => Err(e),
        }
    }

    /// Apply updates in order.
    pub fn apply(&mut self, updates: &[Update]) {
        for u in updates {
            match u {
                Update::Pending(e) => {
                    let keep_done = self
                        .objects
                        .get(&e.key)
                        .is_some_and(|cur| cur.done && cur.same_version(e));
                    if !keep_done {
                        let mut e = e.clone();
                        e.done = false;
                        self.objects.insert(e.key.clone(), e);
                    }
                }
                Update::Done(e) => {
                    let mut e = e.clone();
                    e.done = true;
                    self.objects.insert(e.key.clone(), e);
                }
                Update::Remove(key) => {
                    self.objects.remove(key);
                }
            }
        }
    }

    /// Bytes of the objects marked done.
    pub fn done_bytes(&self) -> u64 {
        self.objects
            .values()
            .filter(|e| e.done)
            .map(|e| e.size)
            .sum()
    }

    /// Merge `updates` into the manifest at `path` under its lock and return the merged result.
    /// A manifest that cannot be parsed is replaced (its objects are re-verified against the
    /// source by the next run). Blocking.
    pub fn merge_into(path: &Path, source: &str, updates: &[Update]) -> io::Result<Manifest> {
        let lock_path = path.with_extension("lock");
        let _lock =
            LockFile::acquire(&lock_path, Duration::from_secs(30), Duration::from_secs(60))?;
        let mut manifest = match Manifest::load(path, source) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                tracing::warn!(error = %e, "replacing an unreadable manifest");
                Manifest::new(source)
            }
            Err(e) => return Err(e),
        };
        manifest.source = source.to_string();
        manifest.version = VERSION;
        manifest.apply(updates);
        let json = serde_json::to_vec(&manifest).map_err(io::Error::other)?;
        write_atomic(path, &json, 0o644)?;
        Ok(manifest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, size: u64, etag: &str) -> Entry {
        Entry {
            key: key.into(),
            size,
            etag: Some(etag.into()),
            modified_ms: None,
            done: false,
        }
    }

    #[test]
    fn md5_etags_only() {
        assert_eq!(
            etag_md5("\"d41d8cd98f00b204e9800998ecf8427e\"").map(|d| d[0]),
            Some(0xd4)
        );
        assert_eq!(etag_md5("\"d41d8cd98f00b204e9800998ecf8427e-3\""), None);
        assert_eq!(etag_md5("1a2b-3c-4d"), None);
        assert_eq!(etag_md5("zz1d8cd98f00b204e9800998ecf8427e"), None);
    }

    #[test]
    fn versions_compare_by_etag_or_mtime() {
        let a = entry("k", 3, "\"abc\"");
        assert!(a.same_version(&entry("k", 3, "abc")));
        assert!(!a.same_version(&entry("k", 3, "\"abd\"")));
        assert!(!a.same_version(&entry("k", 4, "\"abc\"")));
        let mut m1 = a.clone();
        m1.etag = None;
        m1.modified_ms = Some(5);
        let mut m2 = m1.clone();
        assert!(m1.same_version(&m2));
        m2.modified_ms = Some(6);
        assert!(!m1.same_version(&m2));
        m2.modified_ms = None;
        m1.modified_ms = None;
        assert!(!m1.same_version(&m2), "nothing to compare means changed");
    }

    #[test]
    fn pending_does_not_undo_done_of_the_same_version() {
        let mut m = Manifest::new("s3://b/p");
        m.apply(&[Update::Done(entry("k", 3, "\"e1\""))]);
        m.apply(&[Update::Pending(entry("k", 3, "\"e1\""))]);
        assert!(m.objects["k"].done);
        m.apply(&[Update::Pending(entry("k", 3, "\"e2\""))]);
        assert!(!m.objects["k"].done, "a new version is not done");
        m.apply(&[
            Update::Done(entry("k", 3, "\"e2\"")),
            Update::Remove("x".into()),
        ]);
        assert!(m.objects["k"].done);
        m.apply(&[Update::Remove("k".into())]);
        assert!(m.objects.is_empty());
    }

    #[test]
    fn merge_keeps_both_writers_updates_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest.json");
        Manifest::merge_into(&path, "s3://b/p", &[Update::Done(entry("a", 1, "\"x\""))]).unwrap();
        let merged = Manifest::merge_into(
            &path,
            "s3://b/p",
            &[Update::Pending(entry("b", 2, "\"y\""))],
        )
        .unwrap();
        assert_eq!(merged.objects.len(), 2);
        let loaded = Manifest::load(&path, "s3://b/p").unwrap();
        assert_eq!(loaded, merged);
        assert_eq!(loaded.done_bytes(), 1);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains(
                "\"objects\":[{\"key\":\"a\",\"size\":1,\"etag\":\"\\\"x\\\"\",\"done\":true}"
            ),
            "{text}"
        );
        assert!(!dir.path().join("manifest.lock").exists());
    }

    #[test]
    fn unreadable_manifest_is_replaced_on_merge() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("manifest.json");
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(
            Manifest::load(&path, "s").unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let m = Manifest::merge_into(&path, "s", &[Update::Done(entry("a", 1, "e"))]).unwrap();
        assert_eq!(m.objects.len(), 1);
    }
}
