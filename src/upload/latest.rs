//! The resume side: the complete checkpoints under a location, and the latest of them.
//!
//! A checkpoint is a directory right under the location (`<location>/<name>/`) holding a valid
//! `manifest.json` (right format, its own name, counts that add up); anything else — an upload
//! cut off by the deadline, a directory the trainer wrote itself — does not exist here. The
//! latest is the one with the greatest step, then the latest completion
//! ([`super::manifest::newer`]).
//!
//! `spotguard prefetch --latest-checkpoint LOCATION [DEST]` ([`run_cli`]) prints the latest
//! (no DEST) or fetches it into `DEST/<name>` with the prefetcher (parallel ranged GETs, the
//! store's checksums verified, nothing partial published), then checks every file of the
//! manifest is there with its size.

use std::io::Read;
use std::path::{Path, PathBuf};

use futures::stream::{self, StreamExt};
use object_store::path::Path as ObjectPath;
use object_store::ObjectStoreExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::dest::Location;
use super::manifest::{complete, manifest_name, newer, Manifest, MANIFEST_MAX_BYTES};
use super::Error;
use crate::prefetch::source::{self, StoreOptions};

/// A complete checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// Its directory.
    pub destination: Location,
    pub manifest: Manifest,
}

/// Manifests read at once from an object store.
const LIST_CONCURRENCY: usize = 16;

/// Every complete checkpoint under `location`, in no particular order.
pub async fn list_complete(location: &Location, opts: &StoreOptions) -> Result<Vec<Found>, Error> {
    match location {
        Location::Dir(dir) => {
            let dir = dir.clone();
            let loc = location.clone();
            tokio::task::spawn_blocking(move || list_dir(&dir, &loc))
                .await
                .map_err(|e| Error::io("list", location.display())(std::io::Error::other(e)))?
        }
        Location::Store(url) => {
            let store = source::build_store(url, opts).map_err(|e| Error::Store {
                url: url.url.clone(),
                reason: e.to_string(),
            })?;
            let prefix = url.list_prefix().cloned();
            let listing = store
                .list_with_delimiter(prefix.as_ref())
                .await
                .map_err(|source| Error::Request {
                    op: "LIST",
                    key: url.normalized(),
                    source,
                })?;
            let found = stream::iter(listing.common_prefixes)
                .map(|dir| {
                    let store = store.clone();
                    let loc = location.clone();
                    async move { read_store_manifest(&*store, &dir, &loc).await }
                })
                .buffer_unordered(LIST_CONCURRENCY)
                .collect::<Vec<_>>()
                .await;
            found.into_iter().filter_map(Result::transpose).collect()
        }
    }
}

/// The manifests at the top of checkpoint directory `dir` in a store, made into one.
async fn read_store_manifest(
    store: &dyn object_store::ObjectStore,
    dir: &ObjectPath,
    location: &Location,
) -> Result<Option<Found>, Error> {
    let Some(name) = dir.filename().map(str::to_string) else {
        return Ok(None);
    };
    let request = |op: &'static str, key: &ObjectPath| {
        let key = key.to_string();
        move |source| Error::Request { op, key, source }
    };
    let top = store
        .list_with_delimiter(Some(dir))
        .await
        .map_err(request("LIST", dir))?;
    let mut manifests = Vec::new();
    for object in top.objects {
        let Some(file) = object.location.filename() else {
            continue;
        };
        let Some(part) = manifest_name(file) else {
            continue;
        };
        if object.size > MANIFEST_MAX_BYTES {
            tracing::debug!(key = %object.location, "skipping an oversized manifest");
            continue;
        }
        let got = match store.get(&object.location).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(request("GET", &object.location)(e)),
        };
        let data = got
            .bytes()
            .await
            .map_err(request("GET", &object.location))?;
        match Manifest::parse(&data, &name, part) {
            Ok(m) => manifests.push(m),
            Err(reason) => {
                tracing::debug!(manifest = %object.location, reason = %reason, "not a valid manifest")
            }
        }
    }
    Ok(found(manifests, &name, location))
}

/// The checkpoint the valid manifests of directory `name` make, if they make a complete one.
fn found(manifests: Vec<Manifest>, name: &str, location: &Location) -> Option<Found> {
    if manifests.is_empty() {
        return None;
    }
    match complete(manifests) {
        Ok(manifest) => Some(Found {
            destination: location.join(name),
            manifest,
        }),
        Err(reason) => {
            tracing::debug!(checkpoint = %name, reason = %reason, "not a complete checkpoint");
            None
        }
    }
}

fn list_dir(dir: &Path, location: &Location) -> Result<Vec<Found>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", dir.display().to_string())(e)),
    };
    let mut out = Vec::new();
    for entry in entries.filter_map(Result::ok) {
        let Ok(ft) = entry.file_type() else { continue };
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if !ft.is_dir() {
            continue;
        }
        let Ok(inner) = std::fs::read_dir(entry.path()) else {
            continue;
        };
        let mut manifests = Vec::new();
        for f in inner.filter_map(Result::ok) {
            let Some(file) = f.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let Some(part) = manifest_name(&file) else {
                continue;
            };
            if let Some(m) =
                read_small(&f.path()).and_then(|d| Manifest::parse(&d, &name, part).ok())
            {
                manifests.push(m);
            }
        }
        out.extend(found(manifests, &name, location));
    }
    Ok(out)
}

/// A regular file of at most [`MANIFEST_MAX_BYTES`], never through a symlink.
fn read_small(path: &Path) -> Option<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut data = Vec::new();
    file.take(MANIFEST_MAX_BYTES + 1)
        .read_to_end(&mut data)
        .ok()?;
    (data.len() as u64 <= MANIFEST_MAX_BYTES).then_some(data)
}

/// The latest complete checkpoint under `location`, if any.
pub async fn latest(location: &Location, opts: &StoreOptions) -> Result<Option<Found>, Error> {
    let all = list_complete(location, opts).await?;
    Ok(all.into_iter().reduce(|best, f| {
        if newer(&f.manifest, &best.manifest) {
            f
        } else {
            best
        }
    }))
}

/// What `--latest-checkpoint` prints.
#[derive(Serialize)]
struct Printed<'a> {
    /// The checkpoint's directory (URL or path).
    checkpoint: String,
    name: &'a str,
    step: Option<u64>,
    files: usize,
    bytes: u64,
    completed_at: &'a str,
    /// Where it was fetched to (with DEST).
    local: Option<PathBuf>,
    manifest: &'a Manifest,
}

/// `spotguard prefetch --latest-checkpoint LOCATION [DEST]`: print the latest complete
/// checkpoint as one JSON line (`null` when there is none), and with DEST fetch it into
/// `DEST/<name>`. No checkpoint yet is not an error (exit 0: a first run has nothing to resume).
pub async fn run_cli(
    args: crate::prefetch::PrefetchArgs,
    location: String,
    cancel: CancellationToken,
) -> i32 {
    use crate::prefetch::cli::{EXIT_FAILED, EXIT_OK, EXIT_USAGE};
    let dest = match (&args.src, &args.dest) {
        (None, None) => None,
        (Some(one), None) => Some(PathBuf::from(one)),
        _ => {
            eprintln!("spotguard prefetch: --latest-checkpoint takes at most one directory: DEST");
            return EXIT_USAGE;
        }
    };
    let loc = match Location::parse(&location) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("spotguard prefetch: {e}");
            return EXIT_USAGE;
        }
    };
    let opts = StoreOptions {
        endpoint: args.endpoint.clone(),
        pool: args.concurrency,
        ..StoreOptions::default()
    };
    let found = match latest(&loc, &opts).await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("spotguard prefetch: {e}");
            return EXIT_FAILED;
        }
    };
    let Some(found) = found else {
        eprintln!("spotguard prefetch: no complete checkpoint under {loc}; nothing to fetch");
        println!("null");
        return EXIT_OK;
    };
    let m = &found.manifest;
    let mut local = None;
    if let Some(dest) = dest {
        let mut fetch = args.clone();
        fetch.latest_checkpoint = None;
        fetch.src = Some(match &found.destination {
            Location::Dir(p) => format!("file://{}", p.display()),
            Location::Store(u) => u.normalized(),
        });
        fetch.dest = Some(dest.clone());
        fetch.name = Some(m.name.clone());
        let code = Box::pin(crate::prefetch::run_cli(fetch, cancel)).await;
        if code != EXIT_OK {
            return code;
        }
        let dir = dest.join(&m.name);
        if let Some(problem) = check_local(&dir, m) {
            eprintln!(
                "spotguard prefetch: {} does not match its manifest: {problem}",
                dir.display()
            );
            return EXIT_FAILED;
        }
        local = Some(dir);
    }
    let printed = Printed {
        checkpoint: found.destination.display(),
        name: &m.name,
        step: m.step,
        files: m.file_count,
        bytes: m.bytes,
        completed_at: &m.timings.completed_at,
        local,
        manifest: m,
    };
    println!("{}", serde_json::to_string(&printed).unwrap_or_default());
    EXIT_OK
}

/// Every file of the manifest is in `dir` with its size (the prefetcher verified the content
/// against the store's checksums).
fn check_local(dir: &Path, m: &Manifest) -> Option<String> {
    for f in &m.files {
        match std::fs::symlink_metadata(dir.join(&f.path)) {
            Ok(md) if md.is_file() && md.len() == f.size => {}
            Ok(md) => {
                return Some(format!(
                    "{}: {} bytes, the manifest says {}",
                    f.path,
                    md.len(),
                    f.size
                ))
            }
            Err(e) => return Some(format!("{}: {e}", f.path)),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upload::manifest::{hex32, hex64, ManifestFile, Origin, Timings, VerifiedBy};

    fn write(dir: &Path, name: &str, step: Option<u64>, completed: &str) {
        let m = Manifest {
            format: crate::upload::manifest::FORMAT.into(),
            name: name.into(),
            step,
            part: None,
            files: vec![ManifestFile {
                path: "w".into(),
                size: 1,
                crc64nvme: hex64(0),
                crc32c: hex32(0),
                verified_by: VerifiedBy::Written,
            }],
            file_count: 1,
            bytes: 1,
            notice: None,
            origin: Origin::default(),
            timings: Timings {
                acked_at: None,
                started_at: completed.into(),
                completed_at: completed.into(),
                upload_seconds: 1.0,
                resumed: false,
            },
            spotguard_version: "0.1.0".into(),
            writer: None,
        };
        std::fs::create_dir_all(dir.join(name)).unwrap();
        std::fs::write(dir.join(name).join("manifest.json"), m.to_bytes()).unwrap();
    }

    #[tokio::test]
    async fn the_latest_complete_checkpoint_of_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let loc = Location::parse(&tmp.path().display().to_string()).unwrap();
        let opts = StoreOptions::default();
        assert_eq!(latest(&loc, &opts).await.unwrap(), None);
        write(tmp.path(), "step-100", Some(100), "2026-01-01T00:00:00Z");
        write(tmp.path(), "step-200", Some(200), "2026-01-01T00:01:00Z");
        // Not checkpoints: no manifest, a manifest of another name, a garbage manifest.
        std::fs::create_dir_all(tmp.path().join("step-300")).unwrap();
        std::fs::write(tmp.path().join("step-300/w"), b"x").unwrap();
        write(tmp.path(), "step-400", Some(400), "2026-01-01T00:02:00Z");
        std::fs::rename(tmp.path().join("step-400"), tmp.path().join("step-401")).unwrap();
        std::fs::create_dir_all(tmp.path().join("step-500")).unwrap();
        std::fs::write(tmp.path().join("step-500/manifest.json"), b"{").unwrap();
        let got = latest(&loc, &opts).await.unwrap().unwrap();
        assert_eq!(got.manifest.name, "step-200");
        assert_eq!(got.destination, loc.join("step-200"));
        assert_eq!(list_complete(&loc, &opts).await.unwrap().len(), 2);
        let missing = Location::parse(&tmp.path().join("nope").display().to_string()).unwrap();
        assert!(list_complete(&missing, &opts).await.unwrap().is_empty());
    }
}
