//! The cache on disk: layout, key safety, the `complete` marker, the users' lease, and eviction.
//!
//! ```text
//! <root>/<name>/                      one dataset; files at their relative keys
//! <root>/<name>/<key>.spotguard-part-<host>-<pid>   a download in progress (never the final name)
//! <root>/<name>/.spotguard/manifest.json            key, size, etag, done
//! <root>/<name>/.spotguard/complete                 every object done (JSON summary)
//! <root>/<name>/.spotguard/lease                    touched by users while they read the data
//! <root>/<name>/.spotguard/claims/<hash>.json       who is downloading which object
//! ```
//!
//! Eviction (`--cache-max-bytes`): least-recently-used datasets go first, complete ones before
//! abandoned partial ones; a dataset is never evicted while in use (its `lease` was touched within
//! the in-use window) or being written (a live claim, or a partial dataset whose manifest changed
//! within the window).

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::claim::{now_ms, ClaimRecord};
use super::manifest::Manifest;
use super::Error;
use crate::store::key::{short_hash, META_DIR, NAME_MAX, PART_INFIX};

/// Prefix of datasets being deleted (renamed away first so they vanish at once).
const EVICTING_PREFIX: &str = ".spotguard-evicting-";

/// Paths of one dataset.
#[derive(Clone, Debug)]
pub struct DatasetPaths {
    pub name: String,
    pub dir: PathBuf,
    pub meta: PathBuf,
    pub manifest: PathBuf,
    pub complete: PathBuf,
    pub lease: PathBuf,
    pub claims: PathBuf,
}

impl DatasetPaths {
    pub fn new(root: &Path, name: &str) -> DatasetPaths {
        let dir = root.join(name);
        let meta = dir.join(META_DIR);
        DatasetPaths {
            name: name.to_string(),
            manifest: meta.join("manifest.json"),
            complete: meta.join("complete"),
            lease: meta.join("lease"),
            claims: meta.join("claims"),
            meta,
            dir,
        }
    }

    /// The final path of a (validated) key.
    pub fn file(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    /// The part file of `key` for the owner tagged `tag`, relative to the dataset directory:
    /// `<key>.spotguard-part-<tag>` (or `<dir>/<hash>.spotguard-part-<tag>` when that name would
    /// be too long).
    pub fn part_rel(&self, key: &str, tag: &str) -> String {
        let (parent, base) = match key.rsplit_once('/') {
            Some((p, b)) => (Some(p), b),
            None => (None, key),
        };
        let base = if base.len() + PART_INFIX.len() + tag.len() > NAME_MAX {
            short_hash(key)
        } else {
            base.to_string()
        };
        match parent {
            Some(p) => format!("{p}/{base}{PART_INFIX}{tag}"),
            None => format!("{base}{PART_INFIX}{tag}"),
        }
    }

    /// Create the dataset's metadata directories.
    pub fn create(&self) -> io::Result<()> {
        fs::create_dir_all(&self.claims)
    }
}

/// The `complete` marker's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompleteMarker {
    pub source: String,
    pub finished_at: String,
    pub objects: u64,
    pub bytes: u64,
}

impl CompleteMarker {
    pub fn read(path: &Path) -> Option<CompleteMarker> {
        fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
    }
}

/// The source a dataset directory holds, from its `complete` marker or its manifest.
pub fn existing_source(paths: &DatasetPaths) -> Option<String> {
    if let Some(m) = CompleteMarker::read(&paths.complete) {
        return Some(m.source);
    }
    let bytes = fs::read(&paths.manifest).ok()?;
    let m: Manifest = serde_json::from_slice(&bytes).ok()?;
    (!m.source.is_empty()).then_some(m.source)
}

/// A dataset directory holding another source than `url` is never reused (its files would be
/// overwritten, or deleted as "gone from the source"): [`Error::NameInUse`].
pub fn check_source(paths: &DatasetPaths, url: &str) -> Result<(), Error> {
    match existing_source(paths) {
        Some(existing) if !same_source(&existing, url) => Err(Error::NameInUse {
            name: paths.name.clone(),
            existing,
            requested: url.to_string(),
        }),
        _ => Ok(()),
    }
}

/// Whether two source URLs name the same scheme, bucket and prefix (a trailing `/` aside).
pub fn same_source(a: &str, b: &str) -> bool {
    use crate::store::SourceUrl;
    match (SourceUrl::parse(a), SourceUrl::parse(b)) {
        (Ok(x), Ok(y)) => x.normalized() == y.normalized(),
        _ => a == b,
    }
}

/// Touch `lease`: what users of a dataset do (at start and at least every half in-use window
/// while reading) so that it is not evicted under them. `touch <dir>/.spotguard/lease` works too.
pub fn touch_lease(paths: &DatasetPaths) -> io::Result<()> {
    fs::create_dir_all(&paths.meta)?;
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&paths.lease)?;
    f.set_modified(SystemTime::now())
}

/// What the evictor knows of one dataset.
#[derive(Clone, Debug)]
pub struct DatasetUsage {
    pub name: String,
    pub dir: PathBuf,
    /// Bytes of whole files (from the `complete` marker or the manifest).
    pub bytes: u64,
    pub complete: bool,
    /// Latest of: lease touched, completed, manifest written.
    pub last_used: SystemTime,
    /// The lease was touched within the in-use window.
    pub in_use: bool,
    /// A live claim exists, or the dataset is partial and its manifest changed within the window.
    pub writing: bool,
}

fn mtime(path: &Path) -> Option<SystemTime> {
    fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn has_live_claims(claims: &Path) -> bool {
    let Ok(rd) = fs::read_dir(claims) else {
        return false;
    };
    let now = now_ms();
    rd.flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if !name.ends_with(".json") || name.starts_with('.') {
            return false;
        }
        match fs::read(e.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<ClaimRecord>(&b).ok())
        {
            Some(rec) => !rec.is_stale(now),
            // Being written right now.
            None => true,
        }
    })
}

/// Look at every dataset under `root`. Blocking.
pub fn scan(
    root: &Path,
    in_use_window: Duration,
    now: SystemTime,
) -> io::Result<Vec<DatasetUsage>> {
    let rd = match fs::read_dir(root) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let recent = |t: Option<SystemTime>| {
        t.is_some_and(|t| {
            now.duration_since(t)
                .map(|d| d < in_use_window)
                .unwrap_or(true)
        })
    };
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        let paths = DatasetPaths::new(root, &name);
        if !paths.meta.is_dir() {
            // Not ours: never touched.
            continue;
        }
        let marker = CompleteMarker::read(&paths.complete);
        let manifest_mtime = mtime(&paths.manifest);
        let bytes = match &marker {
            Some(m) => m.bytes,
            None => Manifest::load(&paths.manifest, "")
                .map(|m| m.done_bytes())
                .unwrap_or(0),
        };
        let lease = mtime(&paths.lease);
        let complete_at = mtime(&paths.complete);
        let last_used = [lease, complete_at, manifest_mtime]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let complete = marker.is_some();
        out.push(DatasetUsage {
            writing: has_live_claims(&paths.claims) || (!complete && recent(manifest_mtime)),
            in_use: recent(lease),
            name,
            dir: paths.dir,
            bytes,
            complete,
            last_used,
        });
    }
    Ok(out)
}

/// Datasets that may be evicted, in eviction order: complete ones least recently used first,
/// then abandoned partial ones; never `keep`, one in use, or one being written.
pub fn eviction_order<'a>(datasets: &'a [DatasetUsage], keep: &str) -> Vec<&'a DatasetUsage> {
    let mut v: Vec<&DatasetUsage> = datasets
        .iter()
        .filter(|d| d.name != keep && !d.in_use && !d.writing)
        .collect();
    v.sort_by_key(|d| (!d.complete, d.last_used));
    v
}

/// Delete a dataset: rename it away (it vanishes at once), then remove it. Blocking.
pub fn evict(root: &Path, name: &str) -> io::Result<()> {
    let from = root.join(name);
    let to = root.join(format!(
        "{EVICTING_PREFIX}{name}-{}-{}",
        std::process::id(),
        fastrand::u32(..)
    ));
    fs::rename(&from, &to)?;
    fs::remove_dir_all(&to)
}

/// Remove leftovers of evictions interrupted by a crash. Blocking.
pub fn remove_eviction_leftovers(root: &Path) {
    let Ok(rd) = fs::read_dir(root) else {
        return;
    };
    for e in rd.flatten() {
        if e.file_name().to_string_lossy().starts_with(EVICTING_PREFIX) {
            if let Err(err) = fs::remove_dir_all(e.path()) {
                tracing::warn!(path = %e.path().display(), error = %err, "could not remove an interrupted eviction");
            }
        }
    }
}

/// What [`make_room`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictReport {
    pub evicted: Vec<String>,
    pub freed: u64,
    /// Bytes of whole files in the cache after eviction.
    pub used: u64,
}

/// Evict until the dataset `keep`, at `need` bytes, fits under `max` with the other datasets.
/// `used` in the report counts the other datasets only. Blocking.
pub fn make_room(
    root: &Path,
    keep: &str,
    need: u64,
    max: u64,
    in_use_window: Duration,
) -> Result<EvictReport, Error> {
    let io_err = |source: io::Error| Error::Io {
        op: "scan cache",
        path: root.to_path_buf(),
        source,
    };
    let datasets = scan(root, in_use_window, SystemTime::now()).map_err(io_err)?;
    let mut used: u64 = datasets
        .iter()
        .filter(|d| d.name != keep)
        .map(|d| d.bytes)
        .sum();
    let mut report = EvictReport::default();
    if used.saturating_add(need) <= max {
        report.used = used;
        return Ok(report);
    }
    for d in eviction_order(&datasets, keep) {
        // Re-check right before deleting: a user may have started meanwhile.
        let fresh = scan_one(root, &d.name, in_use_window);
        if fresh.is_none_or(|f| f.in_use || f.writing) {
            continue;
        }
        match evict(root, &d.name) {
            Ok(()) => {
                tracing::info!(dataset = %d.name, bytes = d.bytes, "evicted dataset from the cache");
                used = used.saturating_sub(d.bytes);
                report.freed += d.bytes;
                report.evicted.push(d.name.clone());
            }
            Err(e) => {
                tracing::warn!(dataset = %d.name, error = %e, "could not evict dataset");
            }
        }
        if used.saturating_add(need) <= max {
            report.used = used;
            return Ok(report);
        }
    }
    Err(Error::CacheFull {
        need,
        max,
        used,
        evicted: report.evicted.len(),
    })
}

fn scan_one(root: &Path, name: &str, window: Duration) -> Option<DatasetUsage> {
    scan(root, window, SystemTime::now())
        .ok()?
        .into_iter()
        .find(|d| d.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefetch::claim::{Claim, Owner};
    use crate::prefetch::manifest::{Entry, Update};

    fn make_dataset(root: &Path, name: &str, bytes: u64, complete: bool, age: Duration) {
        let p = DatasetPaths::new(root, name);
        p.create().unwrap();
        Manifest::merge_into(
            &p.manifest,
            "s3://b/p",
            &[Update::Done(Entry {
                key: "f".into(),
                size: bytes,
                etag: None,
                modified_ms: None,
                done: true,
            })],
        )
        .unwrap();
        let when = SystemTime::now() - age;
        let set = |path: &Path| {
            File::options()
                .write(true)
                .open(path)
                .unwrap()
                .set_modified(when)
                .unwrap()
        };
        set(&p.manifest);
        if complete {
            let m = CompleteMarker {
                source: "s3://b/p".into(),
                finished_at: "x".into(),
                objects: 1,
                bytes,
            };
            fs::write(&p.complete, serde_json::to_vec(&m).unwrap()).unwrap();
            set(&p.complete);
        }
    }

    #[test]
    fn part_names_stay_next_to_the_file_and_short() {
        let p = DatasetPaths::new(Path::new("/c"), "d");
        assert_eq!(p.part_rel("a/b.bin", "h-1"), "a/b.bin.spotguard-part-h-1");
        assert_eq!(p.part_rel("top", "h-1"), "top.spotguard-part-h-1");
        let long = format!("dir/{}", "x".repeat(250));
        let rel = p.part_rel(&long, "h-1");
        assert!(rel.starts_with("dir/") && rel.len() < 60, "{rel}");
    }

    #[test]
    fn lru_complete_first_never_in_use_or_written() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let hour = Duration::from_secs(3600);
        make_dataset(r, "old", 100, true, 5 * hour);
        make_dataset(r, "newer", 100, true, 2 * hour);
        make_dataset(r, "partial-idle", 50, false, 10 * hour);
        make_dataset(r, "partial-active", 50, false, Duration::ZERO);
        make_dataset(r, "used", 100, true, 9 * hour);
        touch_lease(&DatasetPaths::new(r, "used")).unwrap();
        make_dataset(r, "claimed", 100, true, 8 * hour);
        let claims = DatasetPaths::new(r, "claimed").claims;
        Claim::new(&claims, "f")
            .write(&ClaimRecord {
                owner: Owner {
                    host: "other-node".into(),
                    pid: 1,
                    boot_id: String::new(),
                    pid_ns: String::new(),
                    start_ticks: 0,
                    nonce: 0,
                },
                lease_until_ms: now_ms() + 60_000,
                key: "f".into(),
                size: 1,
                etag: None,
                part: "f.spotguard-part-x".into(),
                done: vec![],
                keys: vec![],
            })
            .unwrap();
        fs::create_dir(r.join("not-a-dataset")).unwrap();

        let all = scan(r, Duration::from_secs(900), SystemTime::now()).unwrap();
        assert_eq!(all.len(), 6);
        let order: Vec<&str> = eviction_order(&all, "newer")
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(order, vec!["old", "partial-idle"]);

        // "newer" grows to 220 bytes under a 500 limit with 400 used by the others: evicting
        // "old" (100) is not enough, so "partial-idle" (50) goes too.
        let report = make_room(r, "newer", 220, 500, Duration::from_secs(900)).unwrap();
        assert_eq!(report.evicted, vec!["old", "partial-idle"]);
        assert_eq!(report.freed, 150);
        assert_eq!(report.used, 250);
        assert!(!r.join("old").exists());
        assert!(r.join("used").exists() && r.join("claimed").exists());
        assert!(r.join("not-a-dataset").exists());

        // Nothing more can go: a clear error.
        match make_room(r, "newer", 1000, 500, Duration::from_secs(900)) {
            Err(Error::CacheFull {
                need, max, used, ..
            }) => {
                assert_eq!((need, max, used), (1000, 500, 250))
            }
            other => panic!("{other:?}"),
        }
        // Fits already: nothing evicted.
        let ok = make_room(r, "newer", 10, 10_000, Duration::from_secs(900)).unwrap();
        assert!(ok.evicted.is_empty());
    }

    #[test]
    fn interrupted_evictions_are_cleaned_up() {
        let root = tempfile::tempdir().unwrap();
        let left = root.path().join(".spotguard-evicting-x-1-2");
        fs::create_dir_all(left.join("sub")).unwrap();
        remove_eviction_leftovers(root.path());
        assert!(!left.exists());
    }
}
