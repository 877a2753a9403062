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
use rustix::fs::{Mode, OFlags, ResolveFlags};

use super::dest::{Granted, Location};
use super::manifest::MANIFEST_MAX_BYTES;
use super::Error;
use crate::fsutil::{AtomicFile, Durability};
use crate::prefetch::source::{self, Scheme, StoreOptions};
use crate::prefetch::verify::{ChecksumSlot, StoreChecksum};

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
            (Location::Dir(path), Granted::Dir { base, below }) => {
                Ok(Target::Dir(DirTarget::open(base, below, path)?))
            }
            (Location::Dir(path), Granted::Store) => Err(Error::InvalidDestination {
                dest: path.display().to_string(),
                reason: "a directory needs a granted base".into(),
            }),
        }
    }
}

fn store_err(url: &source::SourceUrl) -> impl FnOnce(crate::prefetch::Error) -> Error + '_ {
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
    /// read back through [`crate::prefetch::verify::ChecksumConnector`]: a store built without
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

    /// Publish: `PUT` the manifest `file` (one object: atomic for readers).
    pub async fn write_manifest(&self, file: &str, data: Vec<u8>) -> Result<(), Error> {
        let key = self.key(file)?;
        self.store
            .put(&key, PutPayload::from(data))
            .await
            .map(|_| ())
            .map_err(Self::request_err("PUT", &key))
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

const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// Open (creating it `0755` if missing) the directory `name` in `parent`, never through a
/// symlink.
fn open_or_make(parent: &impl AsFd, name: &std::ffi::OsStr) -> rustix::io::Result<OwnedFd> {
    let open = || {
        rustix::fs::openat2(
            parent,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        )
    };
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

impl DirTarget {
    /// `base` (the allowed directory; created if missing, symlinks in it followed: the operator
    /// chose it), then `below` component by component beneath it (created if missing, never
    /// through a symlink). `path` is the full path, for messages.
    pub fn open(base: &Path, below: &Path, path: &Path) -> Result<DirTarget, Error> {
        let display = path.display().to_string();
        let io = |op: &'static str| Error::io(op, display.clone());
        std::fs::create_dir_all(base).map_err(io("mkdir"))?;
        let mut cur = rustix::fs::open(
            base,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io("open")(e.into()))?;
        let mut parent = None;
        for comp in below.components() {
            let std::path::Component::Normal(name) = comp else {
                return Err(Error::InvalidDestination {
                    dest: display,
                    reason: "not a plain relative path below the allowed directory".into(),
                });
            };
            let next = open_or_make(&cur, name).map_err(|e| {
                let symlink = rustix::fs::statat(&cur, name, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| {
                        rustix::fs::FileType::from_raw_mode(st.st_mode)
                            == rustix::fs::FileType::Symlink
                    });
                if symlink {
                    Error::InvalidDestination {
                        dest: display.clone(),
                        reason: format!("{} is a symlink (refused)", name.to_string_lossy()),
                    }
                } else {
                    io("open")(e.into())
                }
            })?;
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
        let mut subdirs = crate::prefetch::lock(&self.subdirs);
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
        let subdirs: Vec<(String, Arc<OwnedFd>)> = crate::prefetch::lock(&self.subdirs)
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
        let fd = match rustix::fs::openat2(
            &*self.dir,
            file,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
            BENEATH,
        ) {
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

    /// Publish: the manifest `file` written atomically and durably (file and directory synced).
    pub fn write_manifest(&self, file: &str, data: &[u8]) -> Result<(), Error> {
        crate::fsutil::write_atomic_at(
            self.dir.as_fd(),
            file,
            data,
            FILE_MODE,
            Durability::FileAndDir,
        )
        .map_err(Error::io("write", self.path_of(file)))
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

    /// The checkpoint directory, for tests and logs.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(&self.display)
    }
}
