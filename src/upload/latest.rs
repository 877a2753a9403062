//! The resume side: the complete checkpoints under a location, and the latest of them.
//!
//! A checkpoint is a directory right under the location (`<location>/<name>/`) holding a valid
//! `manifest.json` (right format, its own name, counts that add up, clean relative file paths)
//! or every part's manifest of a multi-node one; anything else — an upload cut off by the
//! deadline, a directory the trainer wrote itself — does not exist here. Of those, only the
//! owner's count: when the location has an owner marker (`<location>/.spotguard-location.json`,
//! [`super::owner::Marker`]) only manifests naming its writer; a location without one (written
//! by an earlier release) counts every manifest. A manifest whose step disagrees with its
//! directory's name ([`super::owner::checked_step`]) never counts. The latest is the one with the
//! greatest step, then the latest completion ([`super::manifest::newer`]).
//!
//! Bounded: the location is listed once (one delimiter listing, paginated by the store), the
//! candidates are ordered by the step their names prove and their manifests read newest first
//! ([`READ_CONCURRENCY`] at a time) until a step holds a complete checkpoint; only a directory
//! without a readable `manifest.json` is listed (for part manifests). Every body is read as a
//! stream and dropped at its cap ([`MANIFEST_MAX_BYTES`], [`MARKER_MAX_BYTES`]), whatever the
//! listing said its size was.
//!
//! `spotguard prefetch --latest-checkpoint LOCATION [DEST]` (`crate::cli::latest_checkpoint`,
//! where the CLI joins this side to the prefetcher) prints the latest (no DEST) or fetches it into `DEST/<name>` with the prefetcher (parallel ranged GETs, the
//! store's checksums verified, nothing partial published) — only the files its manifest lists —
//! then reads every fetched file once more and compares its CRC-64/NVME and CRC-32C with the
//! manifest's before it reports the checkpoint. `--timeout` and SIGTERM stop every phase.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::stream::{self, StreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio_util::sync::CancellationToken;

use super::crc::Crcs;
use super::dest::{validate_checkpoint_name, Location};
use super::manifest::{
    complete, hex32, hex64, manifest_file, manifest_name, newer, Manifest, MANIFEST_MAX_BYTES,
};
use super::owner::{self, Marker, MARKER_MAX_BYTES, MARKER_NAME};
use crate::store::url::{self as source, StoreOptions};

/// Why the resume side could not answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Upload(#[from] super::Error),

    /// The owner marker is there but cannot be trusted: no checkpoint of the location counts.
    #[error(
        "the location's owner marker {key} cannot be read: {reason}; no checkpoint under it is \
         taken"
    )]
    Marker { key: String, reason: String },

    /// A fetched file is not what the manifest lists.
    #[error("{path}: {reason}; the checkpoint is not complete")]
    Content { path: String, reason: String },

    #[error("stopped")]
    Stopped,
}

/// A complete checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Found {
    /// Its directory.
    pub destination: Location,
    pub manifest: Manifest,
}

/// Manifests read at once (each body held at most [`MANIFEST_MAX_BYTES`]: 64 MiB at worst).
pub const READ_CONCURRENCY: usize = 4;

/// A directory right under the location that may be a checkpoint.
#[derive(Clone, Debug)]
struct Candidate {
    name: String,
    /// What its name proves.
    step: Option<u64>,
}

/// Checkpoint directory names (valid checkpoint names whose step, if any, is at most
/// [`owner::MAX_STEP`]), ordered newest first by the step their names prove, names without a
/// step last.
fn candidates(names: impl IntoIterator<Item = String>) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = names
        .into_iter()
        .filter(|n| validate_checkpoint_name(n).is_ok())
        .filter_map(|name| match owner::step_of_name(&name) {
            Ok(step) => Some(Candidate { name, step }),
            Err(reason) => {
                tracing::debug!(checkpoint = %name, %reason, "not a checkpoint");
                None
            }
        })
        .collect();
    out.sort_by(|a, b| b.step.cmp(&a.step).then_with(|| a.name.cmp(&b.name)));
    out
}

/// Whether `m`, read from directory `name`, counts: its writer is the location's owner (when
/// the location has one) and its step agrees with the name (the step is then the checked one).
fn owned(mut m: Manifest, name: &str, owner: Option<&Marker>) -> Option<Manifest> {
    if let Some(marker) = owner {
        if m.writer.as_deref() != Some(marker.writer.as_str()) {
            tracing::debug!(checkpoint = %name, writer = ?m.writer, owner = %marker.writer,
                "a manifest of another writer than the location's owner; ignored");
            return None;
        }
    }
    match owner::checked_step(name, m.step) {
        Ok(step) => {
            m.step = step;
            Some(m)
        }
        Err(reason) => {
            tracing::debug!(checkpoint = %name, %reason, "a manifest whose step disagrees with its name; ignored");
            None
        }
    }
}

/// Where the manifests are read from.
enum Source {
    Dir(PathBuf),
    Store {
        store: Arc<dyn ObjectStore>,
        prefix: Option<ObjectPath>,
        url: String,
    },
}

impl Source {
    fn new(location: &Location, opts: &StoreOptions) -> Result<Source, Error> {
        Ok(match location {
            Location::Dir(dir) => Source::Dir(dir.clone()),
            Location::Store(url) => Source::Store {
                store: source::build_store(url, opts).map_err(|e| super::Error::Store {
                    url: url.url.clone(),
                    reason: e.to_string(),
                })?,
                prefix: url.list_prefix().cloned(),
                url: url.normalized(),
            },
        })
    }

    fn key(prefix: &Option<ObjectPath>, parts: &[&str]) -> ObjectPath {
        let mut key = prefix.clone().unwrap_or_default();
        for p in parts {
            key = key.clone().join(*p);
        }
        key
    }

    /// The owner marker, if the location has one.
    async fn marker(&self) -> Result<Option<Marker>, Error> {
        let (data, key) = match self {
            Source::Dir(dir) => {
                let path = dir.join(MARKER_NAME);
                let p = path.clone();
                let data = blocking(move || read_capped_file(&p, MARKER_MAX_BYTES)).await?;
                (data, path.display().to_string())
            }
            Source::Store { store, prefix, .. } => {
                let key = Self::key(prefix, &[MARKER_NAME]);
                (
                    read_capped(&**store, &key, MARKER_MAX_BYTES).await?,
                    key.to_string(),
                )
            }
        };
        match data {
            Capped::Absent => Ok(None),
            Capped::TooLarge => Err(Error::Marker {
                key,
                reason: format!("larger than {MARKER_MAX_BYTES} bytes"),
            }),
            Capped::Read(d) => Marker::parse(&d)
                .map(Some)
                .map_err(|reason| Error::Marker { key, reason }),
        }
    }

    /// The names right under the location (one listing).
    async fn names(&self) -> Result<Vec<String>, Error> {
        match self {
            Source::Dir(dir) => {
                let dir = dir.clone();
                blocking(move || list_dirs(&dir)).await?
            }
            Source::Store {
                store, prefix, url, ..
            } => {
                let listing =
                    store
                        .list_with_delimiter(prefix.as_ref())
                        .await
                        .map_err(|source| super::Error::Request {
                            op: "LIST",
                            key: url.clone(),
                            source,
                        })?;
                Ok(listing
                    .common_prefixes
                    .iter()
                    .filter_map(|p| p.filename().map(str::to_string))
                    .collect())
            }
        }
    }

    /// The complete checkpoint of directory `name`, if its manifests make one that counts.
    async fn checkpoint(
        &self,
        name: &str,
        owner: Option<&Marker>,
    ) -> Result<Option<Manifest>, Error> {
        let mut manifests = Vec::new();
        match self {
            Source::Dir(dir) => {
                let (dir, n) = (dir.join(name), name.to_string());
                for (part, data) in blocking(move || read_dir_manifests(&dir, &n)).await? {
                    manifests.extend(parse(&data, name, part, owner));
                }
            }
            Source::Store { store, prefix, .. } => {
                let dir = Self::key(prefix, &[name]);
                let whole = dir.clone().join(manifest_file(None));
                if let Capped::Read(d) = read_capped(&**store, &whole, MANIFEST_MAX_BYTES).await? {
                    manifests.extend(parse(&d, name, None, owner));
                }
                if manifests.is_empty() {
                    // No (valid) manifest.json: the parts of a multi-node checkpoint, if any.
                    let top = store
                        .list_with_delimiter(Some(&dir))
                        .await
                        .map_err(|source| super::Error::Request {
                            op: "LIST",
                            key: dir.to_string(),
                            source,
                        })?;
                    for object in top.objects {
                        let Some(Some(part)) = object.location.filename().and_then(manifest_name)
                        else {
                            continue;
                        };
                        if let Capped::Read(d) =
                            read_capped(&**store, &object.location, MANIFEST_MAX_BYTES).await?
                        {
                            manifests.extend(parse(&d, name, Some(part), owner));
                        }
                    }
                }
            }
        }
        if manifests.is_empty() {
            return Ok(None);
        }
        match complete(manifests) {
            Ok(m) => Ok(Some(m)),
            Err(reason) => {
                tracing::debug!(checkpoint = %name, %reason, "not a complete checkpoint");
                Ok(None)
            }
        }
    }
}

/// A manifest read from directory `name` under the file name of `part`, if valid and owned.
fn parse(
    data: &[u8],
    name: &str,
    part: Option<super::manifest::Part>,
    owner: Option<&Marker>,
) -> Option<Manifest> {
    match Manifest::parse(data, name, part) {
        Ok(m) => owned(m, name, owner),
        Err(reason) => {
            tracing::debug!(checkpoint = %name, %reason, "not a valid manifest");
            None
        }
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Error> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        Error::Upload(super::Error::io("read", "location")(std::io::Error::other(
            e,
        )))
    })
}

/// A body read with a cap.
enum Capped {
    Absent,
    TooLarge,
    Read(Vec<u8>),
}

/// Object `key`, read as a stream and dropped as soon as it passes `cap` bytes (the size a
/// listing gave is not trusted: the object may be replaced between the listing and the GET).
async fn read_capped(store: &dyn ObjectStore, key: &ObjectPath, cap: u64) -> Result<Capped, Error> {
    let request = |source| {
        Error::Upload(super::Error::Request {
            op: "GET",
            key: key.to_string(),
            source,
        })
    };
    let got = match store.get(key).await {
        Ok(g) => g,
        Err(object_store::Error::NotFound { .. }) => return Ok(Capped::Absent),
        Err(e) => return Err(request(e)),
    };
    if got.meta.size > cap {
        tracing::debug!(key = %key, size = got.meta.size, cap, "larger than its cap; not read");
        return Ok(Capped::TooLarge);
    }
    let mut body = got.into_stream();
    let mut data = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(request)?;
        if (data.len() + chunk.len()) as u64 > cap {
            tracing::debug!(key = %key, cap, "a body larger than its cap; dropped");
            return Ok(Capped::TooLarge);
        }
        data.extend_from_slice(&chunk);
    }
    Ok(Capped::Read(data))
}

/// A regular file of at most `cap` bytes, never through a symlink, never blocking on a FIFO.
fn read_capped_file(path: &Path, cap: u64) -> Capped {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    else {
        return Capped::Absent;
    };
    if !file.metadata().is_ok_and(|m| m.is_file()) {
        return Capped::Absent;
    }
    let mut data = Vec::new();
    if file.take(cap + 1).read_to_end(&mut data).is_err() {
        return Capped::Absent;
    }
    if data.len() as u64 > cap {
        return Capped::TooLarge;
    }
    Capped::Read(data)
}

/// The directories right under `dir` (not through symlinks).
fn list_dirs(dir: &Path) -> Result<Vec<String>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(super::Error::io("list", dir.display().to_string())(e).into()),
    };
    Ok(entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .collect())
}

/// The manifest files at the top of checkpoint directory `dir`, each read with its cap.
fn read_dir_manifests(dir: &Path, name: &str) -> Vec<(Option<super::manifest::Part>, Vec<u8>)> {
    let Ok(inner) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for f in inner.filter_map(Result::ok) {
        let Some(part) = f.file_name().to_str().and_then(manifest_name) else {
            continue;
        };
        match read_capped_file(&f.path(), MANIFEST_MAX_BYTES) {
            Capped::Read(d) => out.push((part, d)),
            Capped::TooLarge => {
                tracing::debug!(checkpoint = %name, "a manifest larger than its cap; not read")
            }
            Capped::Absent => {}
        }
    }
    out
}

/// Every complete checkpoint under `location` that counts, in no particular order. Reads every
/// manifest: for [`latest`], which stops early, and tests.
pub async fn list_complete(location: &Location, opts: &StoreOptions) -> Result<Vec<Found>, Error> {
    let src = Source::new(location, opts)?;
    let owner = src.marker().await?;
    let names = src.names().await?;
    let mut out = Vec::new();
    for c in candidates(names) {
        if let Some(manifest) = src.checkpoint(&c.name, owner.as_ref()).await? {
            out.push(Found {
                destination: location.join(&c.name),
                manifest,
            });
        }
    }
    Ok(out)
}

/// The latest complete checkpoint under `location` that counts, if any: one listing, then the
/// candidates' manifests newest first, step by step, until a step has a complete checkpoint.
pub async fn latest(location: &Location, opts: &StoreOptions) -> Result<Option<Found>, Error> {
    let src = Source::new(location, opts)?;
    let owner = src.marker().await?;
    let all = candidates(src.names().await?);
    let mut rest = all.as_slice();
    while let Some(first) = rest.first() {
        let same = rest.iter().take_while(|c| c.step == first.step).count();
        let (group, tail) = rest.split_at(same);
        rest = tail;
        let (src, owner) = (&src, owner.as_ref());
        let mut reads = stream::iter(group)
            .map(|c| async move { (c, src.checkpoint(&c.name, owner).await) })
            .buffer_unordered(READ_CONCURRENCY);
        let mut best: Option<Found> = None;
        while let Some((c, read)) = reads.next().await {
            let Some(manifest) = read? else { continue };
            if best.as_ref().is_none_or(|b| newer(&manifest, &b.manifest)) {
                best = Some(Found {
                    destination: location.join(&c.name),
                    manifest,
                });
            }
        }
        if best.is_some() {
            return Ok(best);
        }
    }
    Ok(None)
}

/// `fut`, unless `stop` comes first.
pub async fn until<T>(
    stop: &CancellationToken,
    fut: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::select! {
        biased;
        _ = stop.cancelled() => Err(Error::Stopped),
        r = fut => r,
    }
}

/// Files checked at once.
const VERIFY_CONCURRENCY: usize = 4;

/// Every file of the manifest is in `dir`, a regular file (not through a symlink) with the
/// manifest's size, CRC-64/NVME and CRC-32C: one more read of each, [`VERIFY_CONCURRENCY`] at a
/// time. The first that is not names itself in the error.
pub async fn verify_local(dir: &Path, m: &Manifest, stop: &CancellationToken) -> Result<(), Error> {
    let stopped = Arc::new(AtomicBool::new(false));
    let flag = stopped.clone();
    let watch = stop.clone();
    let watcher = tokio::spawn(async move {
        watch.cancelled().await;
        flag.store(true, Ordering::Relaxed);
    });
    let checks = stream::iter(m.files.clone())
        .map(|f| {
            let (path, stopped) = (dir.join(&f.path), stopped.clone());
            async move {
                blocking(move || verify_file(&path, &f, &stopped))
                    .await
                    .and_then(|r| r)
            }
        })
        .buffer_unordered(VERIFY_CONCURRENCY);
    let result = until(stop, async {
        let mut checks = std::pin::pin!(checks);
        while let Some(r) = checks.next().await {
            r?;
        }
        Ok(())
    })
    .await;
    watcher.abort();
    result
}

fn verify_file(
    path: &Path,
    f: &super::manifest::ManifestFile,
    stopped: &AtomicBool,
) -> Result<(), Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let content = |reason: String| Error::Content {
        path: path.display().to_string(),
        reason,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| content(format!("not fetched ({e})")))?;
    let md = file.metadata().map_err(|e| content(e.to_string()))?;
    if !md.is_file() || md.len() != f.size {
        return Err(content(format!(
            "{} bytes, the manifest lists {}",
            md.len(),
            f.size
        )));
    }
    let mut crcs = Crcs::empty();
    let mut buf = vec![0u8; 4 << 20];
    loop {
        if stopped.load(Ordering::Relaxed) {
            return Err(Error::Stopped);
        }
        let n = file.read(&mut buf).map_err(|e| content(e.to_string()))?;
        if n == 0 {
            break;
        }
        crcs = crcs.then(Crcs::of(&buf[..n]));
    }
    if crcs.len != f.size {
        return Err(content(format!(
            "{} bytes read, the manifest lists {}",
            crcs.len, f.size
        )));
    }
    let (got64, got32) = (hex64(crcs.crc64nvme), hex32(crcs.crc32c));
    if !got64.eq_ignore_ascii_case(&f.crc64nvme) {
        return Err(content(format!(
            "CRC-64/NVME {got64}, the manifest lists {}",
            f.crc64nvme
        )));
    }
    if !got32.eq_ignore_ascii_case(&f.crc32c) {
        return Err(content(format!(
            "CRC-32C {got32}, the manifest lists {}",
            f.crc32c
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upload::manifest::{hex32, hex64, ManifestFile, Origin, Timings, VerifiedBy};

    fn write(dir: &Path, name: &str, step: Option<u64>, completed: &str) {
        write_by(dir, name, step, completed, None)
    }

    fn write_by(dir: &Path, name: &str, step: Option<u64>, completed: &str, writer: Option<&str>) {
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
            writer: writer.map(str::to_string),
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

    #[tokio::test]
    async fn only_the_owners_checkpoints_whose_steps_agree_with_their_names_count() {
        let tmp = tempfile::tempdir().unwrap();
        let loc = Location::parse(&tmp.path().display().to_string()).unwrap();
        let opts = StoreOptions::default();
        let a = "k8s:ml/Job/train-a";
        write_by(
            tmp.path(),
            "step-100",
            Some(100),
            "2026-01-01T00:00:00Z",
            Some(a),
        );
        // Another job's, and a step its name does not prove: never the latest.
        write_by(
            tmp.path(),
            "step-200",
            Some(200),
            "2026-01-01T00:01:00Z",
            Some("host:uid:1001"),
        );
        write_by(
            tmp.path(),
            "step-150",
            Some(9_000),
            "2026-01-01T00:01:00Z",
            Some(a),
        );
        write_by(
            tmp.path(),
            "final",
            Some(1),
            "2026-01-01T00:01:00Z",
            Some(a),
        );
        write_by(
            tmp.path(),
            "step-18446744073709551615",
            None,
            "2026-01-01T00:01:00Z",
            Some(a),
        );
        // Without a marker (a location of an earlier release) every manifest counts.
        let got = latest(&loc, &opts).await.unwrap().unwrap();
        assert_eq!(got.manifest.name, "step-200");
        std::fs::write(
            tmp.path().join(owner::MARKER_NAME),
            Marker::new(owner::Writer(a.into())).to_bytes(),
        )
        .unwrap();
        let got = latest(&loc, &opts).await.unwrap().unwrap();
        assert_eq!(
            (got.manifest.name.as_str(), got.manifest.step),
            ("step-100", Some(100))
        );
        assert_eq!(list_complete(&loc, &opts).await.unwrap().len(), 1);
        // A marker that cannot be read trusts nothing.
        std::fs::write(tmp.path().join(owner::MARKER_NAME), vec![b' '; 70 << 10]).unwrap();
        let e = latest(&loc, &opts).await.unwrap_err();
        assert!(matches!(e, Error::Marker { .. }), "{e}");
    }

    #[tokio::test]
    async fn a_manifest_of_a_name_without_a_step_is_read_after_every_stepped_one() {
        let tmp = tempfile::tempdir().unwrap();
        let loc = Location::parse(&tmp.path().display().to_string()).unwrap();
        let opts = StoreOptions::default();
        write(tmp.path(), "final", None, "2026-01-03T00:00:00Z");
        write(tmp.path(), "best", None, "2026-01-04T00:00:00Z");
        assert_eq!(
            latest(&loc, &opts).await.unwrap().unwrap().manifest.name,
            "best"
        );
        write(tmp.path(), "step-3", None, "2026-01-01T00:00:00Z");
        let got = latest(&loc, &opts).await.unwrap().unwrap();
        // Its step is the one its name proves.
        assert_eq!(
            (got.manifest.name.as_str(), got.manifest.step),
            ("step-3", Some(3))
        );
    }
}
