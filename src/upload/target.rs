//! The two kinds of destination a checkpoint is written to, behind one small API the engine
//! drives: an object store (S3 or GCS, through the prefetcher's store construction: the same
//! credentials, endpoint and retry settings) and a directory (a local or NFS/EFS mount).
//!
//! Object stores: files up to the part size are one `PUT`; larger ones are multipart uploads
//! driven part by part through [`MultipartStore`] (parts in parallel, resumable from a recorded
//! upload id). object_store 0.13 can attach only one additional checksum to a request,
//! `x-amz-checksum-sha256` (`AmazonS3Builder::with_checksum_algorithm`), which makes a multipart
//! object's checksum a COMPOSITE of part hashes; it has no way to add a CRC-64/NVME or CRC-32C
//! header (extensions reach the HTTP client after signing, and S3 refuses unsigned `x-amz-*`
//! headers). So no checksum header is sent: each part's body is protected in transit by SigV4's
//! signed payload hash (plain HTTP) or TLS, and after each file the store's own full-object
//! checksum (S3 computes a CRC-64/NVME for every new object, GCS a CRC-32C) is read back — from
//! the `PUT` response, or a `HEAD` after a multipart completion — and compared with ours.
//!
//! Directories: every file is written under a temporary name ([`crate::fsutil::AtomicFile`]),
//! synced and renamed; directories are synced before the manifest is written. The checkpoint
//! directory is opened beneath the allowed base with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt, PutOptions, PutPayload};
use rustix::fs::{Mode, OFlags};

use super::dest::{Granted, Location};
use super::manifest::MANIFEST_MAX_BYTES;
use super::owner::{Marker, Writer};
use super::Error;
use crate::checkpoint::root;
use crate::fsutil::AtomicFile;
use crate::store::checksum::{ChecksumSlot, StoreChecksum};
use crate::store::url::{self as source, Scheme, StoreOptions};

/// Mode of uploaded files and created directories on a filesystem destination.
const FILE_MODE: u32 = 0o644;
const DIR_MODE: u32 = 0o755;

/// Where one checkpoint is written.
pub enum Target {
    Store(StoreTarget),
    Dir(DirTarget),
}

impl Target {
    /// The checkpoint's directory as a URL or path.
    pub fn display(&self) -> &str {
        match self {
            Target::Store(s) => &s.url,
            Target::Dir(d) => &d.display,
        }
    }

    /// Connect to `dest` (a checkpoint's directory) as `granted` by the allow-list (the CLI,
    /// which needs none, passes [`Granted::Store`] for stores and the parent directory for
    /// directories).
    pub fn open(dest: &Location, granted: &Granted, opts: &StoreOptions) -> Result<Target, Error> {
        match (dest, granted) {
            (Location::Store(url), _) => {
                let (store, multipart): (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>) =
                    match url.scheme {
                        Scheme::S3 => {
                            let s = Arc::new(source::build_s3(url, opts).map_err(store_err(url))?);
                            (s.clone(), s)
                        }
                        Scheme::Gcs => {
                            let s = Arc::new(source::build_gcs(url, opts).map_err(store_err(url))?);
                            (s.clone(), s)
                        }
                        Scheme::File => {
                            return Err(Error::InvalidDestination {
                                dest: url.url.clone(),
                                reason: "not an object store".into(),
                            })
                        }
                    };
                Ok(Target::Store(StoreTarget::new(
                    store,
                    multipart,
                    &url.prefix,
                    url.normalized(),
                )))
            }
            (Location::Dir(path), Granted::Dir { base, below, own }) => {
                Ok(Target::Dir(DirTarget::open(base, below, path, own)?))
            }
            (Location::Dir(path), Granted::Store) => Err(Error::InvalidDestination {
                dest: path.display().to_string(),
                reason: "a directory needs a granted base".into(),
            }),
        }
    }
}

/// The longest object key S3 and GCS take (bytes of UTF-8).
pub const MAX_KEY_BYTES: usize = 1024;

impl Target {
    /// Whether the store will take every key this checkpoint needs: each staged file's, the
    /// manifest's (`manifest_file`) and the location's owner marker. Checked before the trainer
    /// is answered `taken`, while it still has time to save elsewhere. A directory takes every
    /// name the staged tree (a real directory) could hold.
    pub fn check_keys<'a>(
        &self,
        files: impl Iterator<Item = &'a str>,
        manifest_file: &'a str,
    ) -> Result<(), Error> {
        let Target::Store(s) = self else {
            return Ok(());
        };
        let marker = s.marker_key_text();
        for rel in files.chain(std::iter::once(manifest_file)) {
            let key = if s.prefix.is_empty() {
                rel.to_string()
            } else {
                format!("{}/{rel}", s.prefix)
            };
            s.check_key(&key)?;
        }
        s.check_key(&marker)
    }
}

impl Target {
    /// The location this checkpoint is listed under (its directory's parent), for messages.
    fn location_display(&self) -> String {
        let d = self.display();
        d.rsplit_once('/')
            .map_or(d, |(parent, _)| parent)
            .to_string()
    }

    async fn read_marker(&self) -> Result<Option<Vec<u8>>, Error> {
        match self {
            Target::Store(s) => s.read_marker().await,
            Target::Dir(d) => d.read_marker(),
        }
    }

    /// Before any file is sent: the location's owner marker names `writer`, created (only if
    /// absent) when there is none; a location another writer owns is
    /// [`Error::ForeignLocation`]. The marker is read back after it is created, so a store that
    /// ignored the create-only condition and let a concurrent writer's marker replace ours
    /// still leaves only one writer going on. Returns the writer the manifest names.
    ///
    /// `writer` `None` (an upload resumed after an agent restart, whose first run claimed the
    /// location before anything was journaled or sent): the marker's writer, if any.
    pub async fn claim(&self, writer: Option<&Writer>) -> Result<Option<Writer>, Error> {
        let location = self.location_display();
        let unreadable = |reason: String| Error::Manifest {
            key: format!("{location}/{}", super::owner::MARKER_NAME),
            reason: format!("the location's owner marker is unreadable: {reason}"),
        };
        let existing = self.read_marker().await?;
        let Some(writer) = writer else {
            return Ok(existing
                .and_then(|d| Marker::parse(&d).ok())
                .map(|m| m.writer));
        };
        let data = match existing {
            Some(d) => d,
            None => {
                let fresh = Marker::new(writer.clone()).to_bytes();
                match self {
                    Target::Store(s) => s.create_marker(fresh).await?,
                    Target::Dir(d) => d.create_marker(&fresh)?,
                };
                self.read_marker()
                    .await?
                    .ok_or_else(|| unreadable("gone right after it was created".into()))?
            }
        };
        let marker = Marker::parse(&data).map_err(unreadable)?;
        if &marker.writer != writer {
            return Err(Error::ForeignLocation {
                location,
                owner: marker.writer.to_string(),
                writer: writer.to_string(),
            });
        }
        Ok(Some(marker.writer))
    }
}

fn store_err(url: &source::SourceUrl) -> impl FnOnce(crate::store::Error) -> Error + '_ {
    move |e| Error::Store {
        url: url.url.clone(),
        reason: e.to_string(),
    }
}

/// An object store destination: the checkpoint's objects under `prefix`.
pub struct StoreTarget {
    store: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
    prefix: String,
    url: String,
}

impl StoreTarget {
    /// `store` and `multipart` are two views of one store; `prefix` is the checkpoint's key
    /// prefix (no leading or trailing `/`), `url` its display form. The store's checksums are
    /// read back through [`crate::store::checksum::ChecksumConnector`]: a store built without
    /// it ([`Target::open`] builds it with it) verifies sizes only.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        multipart: Arc<dyn MultipartStore>,
        prefix: &str,
        url: String,
    ) -> StoreTarget {
        StoreTarget {
            store,
            multipart,
            prefix: prefix.trim_matches('/').to_string(),
            url,
        }
    }

    /// The key of `rel` (a path checked by the capture: a valid key).
    pub fn key(&self, rel: &str) -> Result<ObjectPath, Error> {
        let full = if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        };
        ObjectPath::parse(&full).map_err(|e| Error::InvalidDestination {
            dest: full,
            reason: e.to_string(),
        })
    }

    fn request_err(
        op: &'static str,
        key: &ObjectPath,
    ) -> impl FnOnce(object_store::Error) -> Error {
        let key = key.to_string();
        move |source| Error::Request { op, key, source }
    }

    /// Whether the store takes `key`: at most [`MAX_KEY_BYTES`], segments that are neither empty
    /// nor `.`/`..`, no control characters (GCS refuses `\r` and `\n`), not under GCS's reserved
    /// `.well-known/acme-challenge/`.
    fn check_key(&self, key: &str) -> Result<(), Error> {
        let refuse = |reason: String| Error::InvalidDestination {
            dest: format!("{}/…", self.url),
            reason: format!(
                "the store would refuse the key {:?}: {reason}",
                shorten(key)
            ),
        };
        if key.len() > MAX_KEY_BYTES {
            return Err(refuse(format!(
                "{} bytes, more than the store's {MAX_KEY_BYTES}",
                key.len()
            )));
        }
        if key.chars().any(char::is_control) {
            return Err(refuse("control characters".into()));
        }
        if key
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return Err(refuse("an empty, `.` or `..` segment".into()));
        }
        if key.starts_with(".well-known/acme-challenge/") {
            return Err(refuse("a name GCS reserves".into()));
        }
        ObjectPath::parse(key)
            .map(|_| ())
            .map_err(|e| refuse(e.to_string()))
    }

    /// The location's owner marker key: `<location>/.spotguard-location.json`, the location
    /// being the checkpoint's parent.
    fn marker_key_text(&self) -> String {
        match self.prefix.rsplit_once('/') {
            Some((parent, _)) => format!("{parent}/{}", super::owner::MARKER_NAME),
            None => super::owner::MARKER_NAME.to_string(),
        }
    }

    /// The location's owner marker, if there is one (read with a cap of
    /// [`super::owner::MARKER_MAX_BYTES`]).
    pub async fn read_marker(&self) -> Result<Option<Vec<u8>>, Error> {
        let key = ObjectPath::from(self.marker_key_text());
        match self.store.get(&key).await {
            Ok(r) => {
                if r.meta.size > super::owner::MARKER_MAX_BYTES {
                    return Ok(Some(vec![
                        b' ';
                        super::owner::MARKER_MAX_BYTES as usize + 1
                    ]));
                }
                let bytes = r.bytes().await.map_err(Self::request_err("GET", &key))?;
                Ok(Some(bytes.to_vec()))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::request_err("GET", &key)(e)),
        }
    }

    /// Create the owner marker only if there is none (`PutMode::Create`: S3's `If-None-Match:
    /// *`, GCS's `ifGenerationMatch=0`). `Ok(false)`: one was already there.
    pub async fn create_marker(&self, data: Vec<u8>) -> Result<bool, Error> {
        let key = ObjectPath::from(self.marker_key_text());
        let opts = PutOptions {
            mode: object_store::PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .store
            .put_opts(&key, PutPayload::from(data), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) => Err(Self::request_err("PUT", &key)(e)),
        }
    }

    /// `PUT` a whole small file; the store's checksum from the response, if it sent one.
    pub async fn put(&self, rel: &str, data: Bytes) -> Result<Option<StoreChecksum>, Error> {
        let key = self.key(rel)?;
        let slot = ChecksumSlot::default();
        let opts = PutOptions {
            extensions: slot.extensions(),
            ..PutOptions::default()
        };
        self.store
            .put_opts(&key, PutPayload::from_bytes(data), opts)
            .await
            .map_err(Self::request_err("PUT", &key))?;
        Ok(slot.get())
    }

    /// `HEAD`: the object's size and full-object checksum, if the store keeps one.
    pub async fn head(&self, rel: &str) -> Result<(u64, Option<StoreChecksum>), Error> {
        let key = self.key(rel)?;
        let slot = ChecksumSlot::default();
        let opts = GetOptions {
            head: true,
            extensions: slot.extensions(),
            ..GetOptions::default()
        };
        let r = self
            .store
            .get_opts(&key, opts)
            .await
            .map_err(Self::request_err("HEAD", &key))?;
        Ok((r.meta.size, slot.get()))
    }

    pub async fn create(&self, rel: &str) -> Result<String, Error> {
        let key = self.key(rel)?;
        self.multipart
            .create_multipart(&key)
            .await
            .map_err(Self::request_err("CreateMultipartUpload", &key))
    }

    /// Upload part `idx` (0-based) of upload `id`; the part's etag.
    pub async fn put_part(
        &self,
        rel: &str,
        id: &str,
        idx: usize,
        data: Bytes,
    ) -> Result<String, Error> {
        let key = self.key(rel)?;
        let id = id.to_string();
        self.multipart
            .put_part(&key, &id, idx, PutPayload::from_bytes(data))
            .await
            .map(|p| p.content_id)
            .map_err(Self::request_err("UploadPart", &key))
    }

    pub async fn complete(&self, rel: &str, id: &str, etags: Vec<String>) -> Result<(), Error> {
        let key = self.key(rel)?;
        let parts = etags
            .into_iter()
            .map(|content_id| PartId { content_id })
            .collect();
        self.multipart
            .complete_multipart(&key, &id.to_string(), parts)
            .await
            .map(|_| ())
            .map_err(Self::request_err("CompleteMultipartUpload", &key))
    }

    /// Abort upload `id` (best effort: the store's lifecycle rule is the backstop).
    pub async fn abort(&self, rel: &str, id: &str) {
        if let Ok(key) = self.key(rel) {
            if let Err(e) = self.multipart.abort_multipart(&key, &id.to_string()).await {
                tracing::warn!(key = %key, error = %e, "aborting a multipart upload failed");
            }
        }
    }

    /// The checkpoint's manifest `file` (`manifest.json` or a part's), if there is one.
    pub async fn read_manifest(&self, file: &str) -> Result<Option<Vec<u8>>, Error> {
        let key = self.key(file)?;
        match self.store.get(&key).await {
            Ok(r) => {
                if r.meta.size > MANIFEST_MAX_BYTES {
                    return Err(Error::Manifest {
                        key: key.to_string(),
                        reason: format!("{} bytes, more than {MANIFEST_MAX_BYTES}", r.meta.size),
                    });
                }
                let bytes = r.bytes().await.map_err(Self::request_err("GET", &key))?;
                Ok(Some(bytes.to_vec()))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(Self::request_err("GET", &key)(e)),
        }
    }

    /// Publish: `PUT` the manifest `file` (one object: atomic for readers) only if there is
    /// none (`PutMode::Create`: S3's `If-None-Match: *`, GCS's `ifGenerationMatch=0`), so two
    /// writers of one checkpoint (the doomed node's upload and a peer's relay) never both
    /// publish. `Ok(false)`: another writer's manifest was there first.
    pub async fn write_manifest(&self, file: &str, data: Vec<u8>) -> Result<bool, Error> {
        let key = self.key(file)?;
        let opts = PutOptions {
            mode: object_store::PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .store
            .put_opts(&key, PutPayload::from(data.clone()), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. })
            | Err(object_store::Error::Precondition { .. }) => Ok(false),
            Err(e) if crate::store::is_conditional_write_unsupported(&e) => {
                self.write_manifest_unconditionally(&key, file, data, &e)
                    .await
            }
            Err(e) => Err(Self::request_err("PUT", &key)(e)),
        }
    }

    /// A store without conditional writes (an older S3-compatible server): the manifest is
    /// written as before them, unless one is there already (read first), with a plain `PUT`.
    /// Two writers racing between the read and the `PUT` both publish (the later manifest
    /// replaces the earlier): exactly once is not guaranteed on such a store.
    async fn write_manifest_unconditionally(
        &self,
        key: &ObjectPath,
        file: &str,
        data: Vec<u8>,
        why: &object_store::Error,
    ) -> Result<bool, Error> {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                dest = %self.url,
                error = %crate::store::store_words(why),
                "the store does not do conditional writes: manifests are written unconditionally (checked first), so two writers of one checkpoint may both publish it"
            );
        }
        if self.read_manifest(file).await?.is_some() {
            return Ok(false);
        }
        self.store
            .put(key, PutPayload::from(data))
            .await
            .map(|_| true)
            .map_err(Self::request_err("PUT", key))
    }
}

/// A directory destination, opened without following symlinks below the granted base.
pub struct DirTarget {
    /// The checkpoint's directory.
    dir: Arc<OwnedFd>,
    /// Its parent (synced once the directory's own entry must last).
    parent: OwnedFd,
    /// Subdirectories made or opened so far, by relative path.
    subdirs: Mutex<HashMap<String, Arc<OwnedFd>>>,
    display: String,
}

/// Open (creating it `0755` if missing) the directory `name` in `parent`, never through a
/// symlink.
fn open_or_make(parent: &impl AsFd, name: &std::ffi::OsStr) -> rustix::io::Result<OwnedFd> {
    let open = || root::open_beneath(parent, name, OFlags::RDONLY | OFlags::DIRECTORY);
    match open() {
        Err(rustix::io::Errno::NOENT) => {
            match rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(DIR_MODE)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => open(),
                Err(e) => Err(e),
            }
        }
        other => other,
    }
}

/// Identity of a directory: device and inode.
type DirId = (u64, u64);

fn dir_id(fd: &impl AsFd) -> rustix::io::Result<DirId> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev as u64, st.st_ino))
}

/// The agent's own directories (`--checkpoint-dir`, which is also where `notice.json` goes, and
/// `--state-dir`) by identity, and every directory above them, so that an allowed base can be
/// compared with them by what it is, not by how it is named.
struct OwnDirs {
    own: Vec<(DirId, PathBuf)>,
    above: Vec<(DirId, PathBuf)>,
}

impl OwnDirs {
    fn of(paths: &[PathBuf]) -> OwnDirs {
        let mut own = Vec::new();
        let mut above = Vec::new();
        for p in paths {
            let Ok(fd) = rustix::fs::open(
                p,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            ) else {
                continue;
            };
            let Ok(id) = dir_id(&fd) else { continue };
            own.push((id, p.clone()));
            for up in ancestors(fd) {
                above.push((up, p.clone()));
            }
        }
        OwnDirs { own, above }
    }

    fn own(&self, id: DirId) -> Option<&Path> {
        self.own
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, p)| p.as_path())
    }

    fn below(&self, id: DirId) -> Option<&Path> {
        self.above
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, p)| p.as_path())
    }
}

/// Every directory above `fd` (its parent first, `/` last), found through `..`.
fn ancestors(fd: OwnedFd) -> Vec<DirId> {
    let mut out = Vec::new();
    let Ok(mut id) = dir_id(&fd) else {
        return out;
    };
    let mut cur = fd;
    // Deeper than any real path can be.
    for _ in 0..4096 {
        let Ok(up) = rustix::fs::openat(
            &cur,
            "..",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) else {
            break;
        };
        let Ok(up_id) = dir_id(&up) else { break };
        if up_id == id {
            break;
        }
        out.push(up_id);
        id = up_id;
        cur = up;
    }
    out
}

/// Whether `name` in `dir` is a symlink (for a clear refusal).
fn is_symlink(dir: &impl AsFd, name: &std::ffi::OsStr) -> bool {
    rustix::fs::statat(dir, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW).is_ok_and(|st| {
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::Symlink
    })
}

/// Whether a directory owned by `uid` with `mode` is one only its owner (root, or the user
/// running the uploader) can change.
fn trusted(uid: u32, mode: u32) -> Result<(), String> {
    let me = rustix::process::geteuid().as_raw();
    if uid != 0 && uid != me {
        return Err(format!(
            "owned by uid {uid}, not by root{}",
            if me == 0 {
                String::new()
            } else {
                format!(" or uid {me}")
            }
        ));
    }
    if mode & 0o022 != 0 {
        return Err(format!(
            "writable by group or others (mode {:o})",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// Open the allowed base as the operator made it: from `/`, one component at a time, never
/// through a symlink; only its last component may be created (0755, and only in a parent that
/// root — or the user running the uploader — owns and nobody else can write). The base must be
/// owned by root (or that user) and not writable by group or others, and must neither be, nor
/// contain, nor lie inside one of `own` (the agent's own directories), compared by identity.
fn open_base(base: &Path, own: &[PathBuf], display: &str) -> Result<OwnedFd, Error> {
    let refuse = |reason: String| Error::NotAllowed {
        dest: display.to_string(),
        reason: format!("the allowed directory {}: {reason}", base.display()),
    };
    let io = |op: &'static str| Error::io(op, base.display().to_string());
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut cur = rustix::fs::open("/", flags, Mode::empty()).map_err(|e| io("open")(e.into()))?;
    let names: Vec<&std::ffi::OsStr> = base
        .components()
        .filter_map(|c| match c {
            std::path::Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect();
    for (i, name) in names.iter().enumerate() {
        let last = i + 1 == names.len();
        let open = |dir: &OwnedFd| rustix::fs::openat(dir, *name, flags, Mode::empty());
        let next =
            match open(&cur) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::NOENT) if last => {
                    let st = rustix::fs::fstat(&cur).map_err(|e| io("stat")(e.into()))?;
                    trusted(st.st_uid, st.st_mode).map_err(|why| {
                        refuse(format!(
                        "does not exist, and its parent is not one only root can change ({why}): \
                         create it yourself"
                    ))
                    })?;
                    match rustix::fs::mkdirat(&cur, *name, Mode::from_raw_mode(DIR_MODE)) {
                        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(io("mkdir")(e.into())),
                    }
                    open(&cur).map_err(|e| io("open")(e.into()))?
                }
                Err(e) => {
                    if is_symlink(&cur, name) {
                        return Err(refuse(format!(
                        "{} is a symlink (the allowed directory is opened without following any)",
                        Path::new("/").join(names[..=i].iter().collect::<PathBuf>()).display()
                    )));
                    }
                    return Err(io("open")(e.into()));
                }
            };
        cur = next;
    }
    let st = rustix::fs::fstat(&cur).map_err(|e| io("stat")(e.into()))?;
    trusted(st.st_uid, st.st_mode).map_err(refuse)?;
    let own = OwnDirs::of(own);
    let id = (st.st_dev as u64, st.st_ino);
    if let Some(p) = own.own(id) {
        return Err(refuse(format!(
            "is the agent's own directory {}",
            p.display()
        )));
    }
    if let Some(p) = own.below(id) {
        return Err(refuse(format!(
            "contains the agent's own directory {}",
            p.display()
        )));
    }
    let dup = rustix::io::fcntl_dupfd_cloexec(&cur, 0).map_err(|e| io("dup")(e.into()))?;
    for up in ancestors(dup) {
        if let Some(p) = own.own(up) {
            return Err(refuse(format!(
                "is inside the agent's own directory {}",
                p.display()
            )));
        }
    }
    Ok(cur)
}

impl DirTarget {
    /// `base` (the allowed directory, trusted only as the operator made it: [`open_base`]), then
    /// `below` component by component beneath it (created if missing, never through a symlink,
    /// never one of `own`, the agent's own directories). `path` is the full path, for messages.
    pub fn open(
        base: &Path,
        below: &Path,
        path: &Path,
        own: &[PathBuf],
    ) -> Result<DirTarget, Error> {
        let display = path.display().to_string();
        let io = |op: &'static str| Error::io(op, display.clone());
        let mut cur = open_base(base, own, &display)?;
        let own_ids = OwnDirs::of(own);
        let mut parent = None;
        for comp in below.components() {
            let std::path::Component::Normal(name) = comp else {
                return Err(Error::InvalidDestination {
                    dest: display,
                    reason: "not a plain relative path below the allowed directory".into(),
                });
            };
            let next = open_or_make(&cur, name).map_err(|e| {
                if is_symlink(&cur, name) {
                    Error::InvalidDestination {
                        dest: display.clone(),
                        reason: format!("{} is a symlink (refused)", name.to_string_lossy()),
                    }
                } else {
                    io("open")(e.into())
                }
            })?;
            if let Some(p) = dir_id(&next).ok().and_then(|id| own_ids.own(id)) {
                return Err(Error::NotAllowed {
                    dest: display,
                    reason: format!("reaches the agent's own directory {}", p.display()),
                });
            }
            parent = Some(std::mem::replace(&mut cur, next));
        }
        let Some(parent) = parent else {
            return Err(Error::InvalidDestination {
                dest: display,
                reason: "the checkpoint directory must be below the allowed directory".into(),
            });
        };
        Ok(DirTarget {
            dir: Arc::new(cur),
            parent,
            subdirs: Mutex::new(HashMap::new()),
            display,
        })
    }

    /// The directory that holds `rel`, and `rel`'s file name.
    fn dir_of(&self, rel: &str) -> Result<(Arc<OwnedFd>, String), Error> {
        let Some((parent, name)) = rel.rsplit_once('/') else {
            return Ok((self.dir.clone(), rel.to_string()));
        };
        let mut subdirs = crate::sync::lock(&self.subdirs);
        if let Some(fd) = subdirs.get(parent) {
            return Ok((fd.clone(), name.to_string()));
        }
        let mut cur = self.dir.clone();
        let mut prefix = String::new();
        for comp in parent.split('/') {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(comp);
            if let Some(fd) = subdirs.get(&prefix) {
                cur = fd.clone();
                continue;
            }
            let fd = open_or_make(&*cur, std::ffi::OsStr::new(comp))
                .map_err(|e| Error::io("mkdir", format!("{}/{prefix}", self.display))(e.into()))?;
            cur = Arc::new(fd);
            subdirs.insert(prefix.clone(), cur.clone());
        }
        Ok((cur, name.to_string()))
    }

    /// A temporary file that becomes `rel` on commit.
    pub fn create(&self, rel: &str) -> Result<AtomicFile<Arc<OwnedFd>>, Error> {
        let (dir, name) = self.dir_of(rel)?;
        AtomicFile::create(dir, &name, FILE_MODE)
            .map_err(Error::io("create", format!("{}/{rel}", self.display)))
    }

    pub fn path_of(&self, rel: &str) -> String {
        format!("{}/{rel}", self.display)
    }

    /// Sync every directory written to, deepest first, then the checkpoint directory and its
    /// parent: after this every file's name lasts.
    pub fn sync_dirs(&self) -> Result<(), Error> {
        let subdirs: Vec<(String, Arc<OwnedFd>)> = crate::sync::lock(&self.subdirs)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut subdirs = subdirs;
        subdirs.sort_by_key(|(k, _)| std::cmp::Reverse(k.matches('/').count()));
        for (k, fd) in subdirs {
            rustix::fs::fsync(&*fd).map_err(|e| Error::io("fsync", self.path_of(&k))(e.into()))?;
        }
        rustix::fs::fsync(&*self.dir)
            .map_err(|e| Error::io("fsync", self.display.clone())(e.into()))?;
        rustix::fs::fsync(&self.parent)
            .map_err(|e| Error::io("fsync", self.display.clone())(e.into()))?;
        Ok(())
    }

    /// The checkpoint's manifest `file`, if there is one.
    pub fn read_manifest(&self, file: &str) -> Result<Option<Vec<u8>>, Error> {
        let path = self.path_of(file);
        let fd = match root::open_beneath(&*self.dir, file, OFlags::RDONLY | OFlags::NONBLOCK) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(Error::io("open", path)(e.into())),
        };
        let mut data = Vec::new();
        std::fs::File::from(fd)
            .take(MANIFEST_MAX_BYTES + 1)
            .read_to_end(&mut data)
            .map_err(Error::io("read", path.clone()))?;
        if data.len() as u64 > MANIFEST_MAX_BYTES {
            return Err(Error::Manifest {
                key: path,
                reason: format!("more than {MANIFEST_MAX_BYTES} bytes"),
            });
        }
        Ok(Some(data))
    }

    /// Publish: the manifest `file` written durably and atomically, only if there is none
    /// ([`create_once`]: a hard link never replaces), so two writers of one checkpoint never
    /// both publish. `Ok(false)`: another writer's manifest was there first.
    pub fn write_manifest(&self, file: &str, data: &[u8]) -> Result<bool, Error> {
        create_once(&self.dir, file, data).map_err(Error::io("create", self.path_of(file)))
    }

    /// Remove temporary files an interrupted earlier run left in the checkpoint directory (the
    /// atomic writes' `.<name>.tmp-<pid>-<hex>`) unless they are staged names.
    pub fn remove_stale_temps(&self, staged: &std::collections::HashSet<&str>) {
        let Ok(mut dir) = rustix::fs::Dir::read_from(&*self.dir) else {
            return;
        };
        let mut stale = Vec::new();
        while let Some(Ok(e)) = dir.next() {
            let Ok(name) = e.file_name().to_str() else {
                continue;
            };
            if name.starts_with('.') && name.contains(".tmp-") && !staged.contains(name) {
                stale.push(name.to_string());
            }
        }
        for name in stale {
            let _ = rustix::fs::unlinkat(&*self.dir, name.as_str(), rustix::fs::AtFlags::empty());
        }
    }

    /// The location's owner marker (in the checkpoint directory's parent, the location), if
    /// there is one; read without following a symlink, with a cap.
    pub fn read_marker(&self) -> Result<Option<Vec<u8>>, Error> {
        let name = super::owner::MARKER_NAME;
        let path = format!("{}/../{name}", self.display);
        let fd = match root::open_beneath(&self.parent, name, OFlags::RDONLY | OFlags::NONBLOCK) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(e) => return Err(Error::io("open", path)(e.into())),
        };
        let mut data = Vec::new();
        std::fs::File::from(fd)
            .take(super::owner::MARKER_MAX_BYTES + 1)
            .read_to_end(&mut data)
            .map_err(Error::io("read", path))?;
        Ok(Some(data))
    }

    /// Create the owner marker only if there is none ([`create_once`] in the location's
    /// directory). `Ok(false)`: one was already there.
    pub fn create_marker(&self, data: &[u8]) -> Result<bool, Error> {
        let name = super::owner::MARKER_NAME;
        let path = format!("{}/../{name}", self.display);
        create_once(&self.parent, name, data).map_err(Error::io("create", path))
    }

    /// The checkpoint directory, for tests and logs.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(&self.display)
    }
}

/// Create `name` in `dir` with `data` only if there is none: written and synced under a
/// temporary name, then hard-linked to its name (`linkat` never replaces) and the directory
/// synced, so a reader sees it whole or not at all. `Ok(false)`: one was already there.
fn create_once(dir: &OwnedFd, name: &str, data: &[u8]) -> std::io::Result<bool> {
    use std::io::Write;
    let tmp = format!(
        ".{name}.new-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    );
    let fd = rustix::fs::openat(
        dir,
        tmp.as_str(),
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(FILE_MODE),
    )?;
    let mut file = std::fs::File::from(fd);
    let linked = (|| -> std::io::Result<bool> {
        rustix::fs::fchmod(&file, Mode::from_raw_mode(FILE_MODE))?;
        file.write_all(data)?;
        file.sync_all()?;
        match rustix::fs::linkat(dir, tmp.as_str(), dir, name, rustix::fs::AtFlags::empty()) {
            Ok(()) => {}
            Err(rustix::io::Errno::EXIST) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        match rustix::fs::fsync(dir) {
            Err(e) if e != rustix::io::Errno::INVAL => return Err(e.into()),
            _ => {}
        }
        Ok(true)
    })();
    let _ = rustix::fs::unlinkat(dir, tmp.as_str(), rustix::fs::AtFlags::empty());
    linked
}

/// A hostile key, bounded for a message.
fn shorten(key: &str) -> String {
    const MAX: usize = 96;
    if key.len() <= MAX {
        return key.to_string();
    }
    let mut end = MAX;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &key[..end], key.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// An older S3-compatible server: no conditional writes.
    #[derive(Debug)]
    struct NoConditional(object_store::memory::InMemory);

    impl std::fmt::Display for NoConditional {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("NoConditional")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for NoConditional {
        async fn put_opts(
            &self,
            location: &ObjectPath,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<object_store::PutResult> {
            if matches!(opts.mode, object_store::PutMode::Create) {
                return Err(object_store::Error::NotImplemented {
                    operation: "put_opts with PutMode::Create".into(),
                    implementer: self.to_string(),
                });
            }
            self.0.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &ObjectPath,
            opts: object_store::PutMultipartOptions,
        ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
            self.0.put_multipart_opts(location, opts).await
        }

        async fn get_opts(
            &self,
            location: &ObjectPath,
            options: object_store::GetOptions,
        ) -> object_store::Result<object_store::GetResult> {
            self.0.get_opts(location, options).await
        }

        fn delete_stream(
            &self,
            locations: futures::stream::BoxStream<'static, object_store::Result<ObjectPath>>,
        ) -> futures::stream::BoxStream<'static, object_store::Result<ObjectPath>> {
            self.0.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&ObjectPath>,
        ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>>
        {
            self.0.list(prefix)
        }

        async fn list_with_delimiter(
            &self,
            prefix: Option<&ObjectPath>,
        ) -> object_store::Result<object_store::ListResult> {
            self.0.list_with_delimiter(prefix).await
        }

        async fn copy_opts(
            &self,
            from: &ObjectPath,
            to: &ObjectPath,
            options: object_store::CopyOptions,
        ) -> object_store::Result<()> {
            self.0.copy_opts(from, to, options).await
        }
    }

    #[tokio::test]
    async fn a_store_without_conditional_writes_still_publishes_its_manifest_once_checked() {
        let store = Arc::new(NoConditional(object_store::memory::InMemory::new()));
        let multipart = Arc::new(object_store::memory::InMemory::new());
        let t = StoreTarget::new(
            store.clone(),
            multipart,
            "run1/step-1",
            "s3://b/run1/step-1".into(),
        );
        assert!(t
            .write_manifest("manifest.json", b"first".to_vec())
            .await
            .unwrap());
        // A second writer finds it there (checked first) and writes nothing.
        assert!(!t
            .write_manifest("manifest.json", b"second".to_vec())
            .await
            .unwrap());
        assert_eq!(
            t.read_manifest("manifest.json").await.unwrap().as_deref(),
            Some(&b"first"[..])
        );
    }

    fn chmod(p: &Path, mode: u32) {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn open(base: &Path, own: &[PathBuf]) -> Result<DirTarget, Error> {
        let path = base.join("run1/step-1");
        DirTarget::open(base, Path::new("run1/step-1"), &path, own)
    }

    fn refusal(r: Result<DirTarget, Error>) -> String {
        match r {
            Ok(_) => panic!("opened"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn the_allowed_base_is_opened_only_as_the_operator_made_it() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        chmod(t, 0o755);
        // A root-owned 0755 base: opened, the path below made.
        let base = t.join("efs");
        std::fs::create_dir(&base).unwrap();
        let d = open(&base, &[]).unwrap();
        assert!(base.join("run1/step-1").is_dir());
        drop(d);
        // Missing: created (0755) in a parent only root can change.
        let fresh = t.join("fresh");
        open(&fresh, &[]).unwrap();
        assert_eq!(
            std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o7777,
            0o755
        );
        // A symlink anywhere on the way, the base itself or a component above it.
        std::os::unix::fs::symlink(&base, t.join("link")).unwrap();
        assert!(refusal(open(&t.join("link"), &[])).contains("symlink"));
        assert!(refusal(open(&t.join("link/inner"), &[])).contains("symlink"));
        // Writable by others, or owned by another user.
        let open_to_all = t.join("shared");
        std::fs::create_dir(&open_to_all).unwrap();
        chmod(&open_to_all, 0o777);
        assert!(refusal(open(&open_to_all, &[])).contains("writable by group or others"));
        chmod(&open_to_all, 0o1777);
        assert!(refusal(open(&open_to_all, &[])).contains("writable by group or others"));
        // A missing base is not created in a directory others can write.
        assert!(refusal(open(&open_to_all.join("new"), &[])).contains("does not exist"));
        assert!(!open_to_all.join("new").exists());
        let users = t.join("users");
        std::fs::create_dir(&users).unwrap();
        std::os::unix::fs::chown(&users, Some(1000), Some(1000)).unwrap();
        if rustix::process::geteuid().is_root() {
            assert!(refusal(open(&users, &[])).contains("owned by uid 1000"));
        }
    }

    #[test]
    fn the_allowed_base_never_is_contains_or_lies_in_the_agents_own_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let agent = t.join("agent");
        let ckpt = agent.join("run");
        std::fs::create_dir_all(&ckpt).unwrap();
        let state = t.join("state");
        std::fs::create_dir_all(state.join("inner")).unwrap();
        let own = vec![ckpt.clone(), state.clone()];
        assert!(refusal(open(&ckpt, &own)).contains("is the agent's own directory"));
        assert!(refusal(open(&agent, &own)).contains("contains the agent's own directory"));
        assert!(refusal(open(&state.join("inner"), &own))
            .contains("is inside the agent's own directory"));
        // By identity, not by name: the agent's dir named through a symlink.
        std::os::unix::fs::symlink(&agent, t.join("agent-link")).unwrap();
        let named_otherwise = vec![t.join("agent-link/run")];
        assert!(refusal(open(&ckpt, &named_otherwise)).contains("is the agent's own directory"));
        assert!(refusal(open(&agent, &named_otherwise)).contains("contains the agent's own"));
        let other = t.join("other");
        std::fs::create_dir(&other).unwrap();
        open(&other, &own).unwrap();
    }

    #[tokio::test]
    async fn a_directory_location_has_one_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("efs");
        std::fs::create_dir(&base).unwrap();
        let a = Writer::host(1000);
        let b = Writer::host(1001);
        let t = Target::Dir(open(&base, &[]).unwrap());
        assert_eq!(t.claim(Some(&a)).await.unwrap(), Some(a.clone()));
        let marker = base.join("run1").join(super::super::owner::MARKER_NAME);
        let m = Marker::parse(&std::fs::read(&marker).unwrap()).unwrap();
        assert_eq!(m.writer, a);
        // No temporary file left beside it.
        let names: Vec<_> = std::fs::read_dir(base.join("run1"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        // The same writer goes on; another is refused; a resumed upload adopts the marker's.
        assert_eq!(t.claim(Some(&a)).await.unwrap(), Some(a.clone()));
        let e = t.claim(Some(&b)).await.unwrap_err();
        assert_eq!(e.metric_label(), "foreign_location");
        assert!(e.to_string().contains("host:uid:1000"), "{e}");
        assert_eq!(t.claim(None).await.unwrap(), Some(a.clone()));
        // A marker planted as a symlink is not followed.
        std::fs::remove_file(&marker).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &marker).unwrap();
        assert!(t.claim(Some(&a)).await.is_err());
    }

    #[test]
    fn keys_the_store_would_refuse_are_refused_before_anything_is_sent() {
        let store: Arc<object_store::memory::InMemory> = Arc::new(Default::default());
        let long = "p".repeat(1100);
        let t = Target::Store(StoreTarget::new(
            store.clone(),
            store.clone(),
            &format!("{long}/step-1"),
            format!("s3://b/{long}/step-1"),
        ));
        let e = t
            .check_keys(["a.bin"].into_iter(), "manifest.json")
            .unwrap_err();
        assert!(e.to_string().contains("more than the store's 1024"), "{e}");
        let ok = Target::Store(StoreTarget::new(
            store.clone(),
            store.clone(),
            "run1/step-1",
            "s3://b/run1/step-1".into(),
        ));
        ok.check_keys(["a.bin", "sub/b.bin"].into_iter(), "manifest.json")
            .unwrap();
        let deep = "d/".repeat(600) + "x";
        assert!(ok
            .check_keys([deep.as_str()].into_iter(), "manifest.json")
            .is_err());
        assert!(ok
            .check_keys(["a\rb"].into_iter(), "manifest.json")
            .is_err());
        let acme = Target::Store(StoreTarget::new(
            store.clone(),
            store,
            ".well-known/acme-challenge/step-1",
            "gs://b/.well-known/acme-challenge/step-1".into(),
        ));
        assert!(acme.check_keys(["a"].into_iter(), "manifest.json").is_err());
    }
}
