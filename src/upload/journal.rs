//! The upload journal: an upload's progress persisted in the state directory
//! (`<state-dir>/uploads/<hash of the destination>.json`), so that an uploader restarted in the
//! middle of an upload resumes it — files already whole at the destination are not sent again,
//! a multipart upload continues from its recorded parts — or reports it, and never publishes a
//! partial checkpoint: the manifest is only ever written by a run that has every file.
//!
//! Like every persisted record of spotguard the journal says which life of the machine it
//! belongs to (the boot id): after a reboot the staged files on local disk are gone or stale,
//! so a journal of an earlier boot is abandoned (its multipart uploads aborted) and reported.
//! A recorded file is reused only while the staged file's identity (device, inode, size,
//! mtime, ctime) is unchanged and the part size is the same.
//!
//! Writes are atomic and durable ([`crate::fsutil::write_atomic`]) and batched: the engine
//! flushes at most every half second, and at once after recording a new multipart upload id (so
//! that no upload the store holds is unknown to the journal for long).
//!
//! Each multipart upload id is also appended, before any of its parts is sent, to a side file
//! next to the journal (`<hash>.uploads`: one JSON record per line, synced): a journal that
//! cannot be read (corrupt, truncated, of another version) still leaves every upload it held
//! open findable, so that it is aborted rather than left to cost storage in the bucket. A line
//! that does not parse is skipped; the others still count.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::crc::Crcs;
use super::manifest::VerifiedBy;
use super::staged::FileId;
use super::Error;

/// Version of the journal's format.
pub const VERSION: u32 = 1;

/// Directory of journals under the state directory.
pub const DIR: &str = "uploads";

/// Whose root the staged tree was captured in: what a restarted uploader needs to capture it
/// again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum RootRecord {
    /// This machine's `/` (the CLI, or a host-mode trainer sharing the host's filesystem).
    Host {
        /// The owner every entry had to have, if one was required.
        owner: Option<u32>,
    },
    /// A process's root (a container): capturable again only while that process lives.
    Process { pid: i32, start_time: u64 },
}

/// A part of a multipart upload already at the store.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartRecord {
    pub etag: String,
    pub crcs: Crcs,
}

/// A file whole at the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneRecord {
    pub crcs: Crcs,
    pub verified_by: VerifiedBy,
}

/// One file's progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    pub id: FileId,
    pub part_size: u64,
    /// The multipart upload in progress, if any.
    #[serde(default)]
    pub upload_id: Option<String>,
    #[serde(default)]
    pub parts: BTreeMap<usize, PartRecord>,
    #[serde(default)]
    pub done: Option<DoneRecord>,
}

/// The journal's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub version: u32,
    pub boot_id: String,
    /// The checkpoint's directory (URL or path).
    pub destination: String,
    /// The staged directory as the trainer named it.
    pub staged: String,
    pub root: RootRecord,
    pub started_at: String,
    pub files: BTreeMap<String, FileRecord>,
    /// What the manifest will say (a restarted uploader rebuilds its job from these).
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub step: Option<u64>,
    #[serde(default)]
    pub part: Option<super::manifest::Part>,
    /// When the upload must stop, publishing nothing (the plan's `deadline − drain reserve`, as
    /// wall-clock time, RFC 3339): a resumed upload keeps it.
    #[serde(default)]
    pub deadline: Option<String>,
    /// The namespace of the pod the checkpoint is for (Kubernetes; host mode: none): a resumed
    /// upload is allowed for it again, `{namespace}` in the allow-list standing for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl Record {
    /// Multipart uploads the record holds open: `(path, upload id)`.
    pub fn open_uploads(&self) -> Vec<(String, String)> {
        self.files
            .iter()
            .filter(|(_, f)| f.done.is_none())
            .filter_map(|(p, f)| f.upload_id.clone().map(|id| (p.clone(), id)))
            .collect()
    }
}

/// The journal file of `destination` under `state_dir`.
pub fn path_for(state_dir: &Path, destination: &str) -> PathBuf {
    let mut h = crate::store::short_hash(destination);
    h.truncate(16);
    state_dir.join(DIR).join(format!("{h}.json"))
}

/// The side file of the journal at `journal`: the multipart upload ids it created.
pub fn uploads_path(journal: &Path) -> PathBuf {
    journal.with_extension(UPLOADS_EXT)
}

/// Extension of the side files.
const UPLOADS_EXT: &str = "uploads";

/// The most of a side file that is read (an id is ~100 bytes; 10 000 files fit many times).
const UPLOADS_MAX_BYTES: u64 = 16 << 20;

/// A multipart upload created for a journaled upload: a line of the journal's side file.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpenUpload {
    /// The checkpoint's directory (URL), as in [`Record::destination`].
    pub destination: String,
    /// The file's path below it.
    pub path: String,
    pub upload_id: String,
    /// The namespace of the pod it is for (Kubernetes): what the allow-list's `{namespace}`
    /// stood for when it was allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// Append `upload` to the side file of the journal at `journal`, synced (the directory too
/// when the file is new). Blocking.
pub fn append_upload(journal: &Path, upload: &OpenUpload) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = uploads_path(journal);
    let err = |e: std::io::Error| Error::Journal {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(err)?;
    let existed = path.exists();
    let mut line = serde_json::to_vec(upload).unwrap_or_default();
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(err)?;
    f.write_all(&line).map_err(err)?;
    f.sync_data().map_err(err)?;
    if !existed {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

/// The uploads recorded in the side file of the journal at `journal` (none when there is no
/// side file); lines that do not parse are skipped and logged.
pub fn read_uploads(journal: &Path) -> Vec<OpenUpload> {
    use std::io::Read;
    let path = uploads_path(journal);
    let mut data = Vec::new();
    match std::fs::File::open(&path) {
        Ok(f) => {
            if let Err(e) = f.take(UPLOADS_MAX_BYTES).read_to_end(&mut data) {
                tracing::warn!(path = %path.display(), error = %e, "reading the journal's upload ids failed");
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "reading the journal's upload ids failed");
            return Vec::new();
        }
    }
    let mut out = Vec::new();
    let mut skipped = 0usize;
    for line in data.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        match serde_json::from_slice::<OpenUpload>(line) {
            Ok(u) => out.push(u),
            Err(_) => skipped += 1,
        }
    }
    if skipped > 0 {
        tracing::warn!(path = %path.display(), skipped, "skipped unreadable lines of the journal's upload ids");
    }
    out.sort();
    out.dedup();
    out
}

/// Keep only `uploads` in the side file of the journal at `journal` (removed when empty).
/// Blocking.
pub fn rewrite_uploads(journal: &Path, uploads: &[OpenUpload]) -> Result<(), Error> {
    let path = uploads_path(journal);
    if uploads.is_empty() {
        remove_quietly(&path);
        return Ok(());
    }
    let mut data = Vec::new();
    for u in uploads {
        data.extend(serde_json::to_vec(u).unwrap_or_default());
        data.push(b'\n');
    }
    crate::fsutil::write_atomic(&path, &data, 0o600).map_err(|e| Error::Journal {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Remove a journal and its side file (best effort, logged).
pub fn remove_all(journal: &Path) {
    remove_quietly(journal);
    remove_quietly(&uploads_path(journal));
}

fn remove_quietly(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "removing an upload journal file failed")
        }
    }
}

/// Side files under `state_dir` whose journal is gone (a run killed between the two writes):
/// the journal path each belongs to.
pub fn orphaned_uploads(state_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(state_dir.join(DIR)) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == UPLOADS_EXT))
        .map(|p| p.with_extension("json"))
        .filter(|j| !j.exists())
        .collect();
    out.sort();
    out
}

/// Every journal under `state_dir` (unreadable ones are reported as errors, not skipped).
pub fn list(state_dir: &Path) -> Vec<(PathBuf, Result<Record, Error>)> {
    let dir = state_dir.join(DIR);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Result<Record, Error>)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let r = load(&p).and_then(|r| {
                r.ok_or_else(|| Error::Journal {
                    path: p.display().to_string(),
                    reason: "vanished".into(),
                })
            });
            (p, r)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Read a journal: `None` when there is none.
pub fn load(path: &Path) -> Result<Option<Record>, Error> {
    let err = |reason: String| Error::Journal {
        path: path.display().to_string(),
        reason,
    };
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(err(e.to_string())),
    };
    let record: Record = serde_json::from_slice(&data).map_err(|e| err(e.to_string()))?;
    if record.version != VERSION {
        return Err(err(format!(
            "version {}, expected {VERSION}",
            record.version
        )));
    }
    Ok(Some(record))
}

/// A journal being kept: the record in memory, written back by [`Journal::flush`].
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    record: Mutex<Record>,
    dirty: AtomicBool,
}

impl Journal {
    /// Keep `record` at `path` (written at the first flush).
    pub fn new(path: PathBuf, record: Record) -> Journal {
        Journal {
            path,
            record: Mutex::new(record),
            dirty: AtomicBool::new(true),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Change the record (written back at the next flush).
    pub fn update(&self, f: impl FnOnce(&mut Record)) {
        f(&mut crate::sync::lock(&self.record));
        self.dirty.store(true, Ordering::Release);
    }

    /// The namespace the upload is for ([`Record::namespace`]).
    pub fn namespace(&self) -> Option<String> {
        crate::sync::lock(&self.record).namespace.clone()
    }

    /// A copy of the record.
    pub fn snapshot(&self) -> Record {
        crate::sync::lock(&self.record).clone()
    }

    /// Write the record if it changed. Blocking (fsync).
    pub fn flush(&self) -> Result<(), Error> {
        if !self.dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let data = {
            let r = crate::sync::lock(&self.record);
            serde_json::to_vec(&*r).unwrap_or_default()
        };
        crate::fsutil::write_atomic(&self.path, &data, 0o600).map_err(|e| {
            self.dirty.store(true, Ordering::Release);
            Error::Journal {
                path: self.path.display().to_string(),
                reason: e.to_string(),
            }
        })
    }

    /// Remove the journal and its side file (the upload ended for good: published, or given
    /// up, its multipart uploads completed or aborted).
    pub fn remove(&self) {
        self.dirty.store(false, Ordering::Release);
        remove_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let id = FileId {
            dev: 1,
            ino: 2,
            size: 3,
            mtime_ns: 4,
            ctime_ns: 5,
            nlink: 1,
        };
        let mut files = BTreeMap::new();
        files.insert(
            "big".to_string(),
            FileRecord {
                id,
                part_size: 8 << 20,
                upload_id: Some("u-1".into()),
                parts: BTreeMap::from([(
                    0,
                    PartRecord {
                        etag: "e0".into(),
                        crcs: Crcs::of(b"abc"),
                    },
                )]),
                done: None,
            },
        );
        files.insert(
            "small".to_string(),
            FileRecord {
                id,
                part_size: 8 << 20,
                upload_id: None,
                parts: BTreeMap::new(),
                done: Some(DoneRecord {
                    crcs: Crcs::of(b"abc"),
                    verified_by: VerifiedBy::Size,
                }),
            },
        );
        Record {
            version: VERSION,
            boot_id: "boot".into(),
            destination: "s3://b/run/step-1".into(),
            staged: "/ckpt/step-1".into(),
            root: RootRecord::Process {
                pid: 7,
                start_time: 99,
            },
            started_at: "2026-01-01T00:00:00Z".into(),
            files,
            name: "step-1".into(),
            step: Some(1),
            part: None,
            deadline: Some("2026-01-01T00:01:00Z".into()),
            namespace: None,
        }
    }

    #[test]
    fn journals_round_trip_and_list_their_open_uploads() {
        let tmp = tempfile::tempdir().unwrap();
        let path = path_for(tmp.path(), "s3://b/run/step-1");
        assert_ne!(path, path_for(tmp.path(), "s3://b/run/step-2"));
        assert_eq!(load(&path).unwrap(), None);
        let j = Journal::new(path.clone(), record());
        j.flush().unwrap();
        assert_eq!(load(&path).unwrap().unwrap(), record());
        assert_eq!(
            record().open_uploads(),
            vec![("big".to_string(), "u-1".to_string())]
        );
        j.update(|r| r.files.clear());
        j.flush().unwrap();
        assert!(load(&path).unwrap().unwrap().files.is_empty());
        let listed = list(tmp.path());
        assert_eq!(listed.len(), 1);
        assert!(listed[0].1.is_ok());
        j.remove();
        assert_eq!(load(&path).unwrap(), None);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, b"{").unwrap();
        assert!(load(&path).is_err());
    }
}

#[cfg(test)]
mod side_file_tests {
    use super::*;

    #[test]
    fn upload_ids_survive_a_corrupt_journal_and_a_bad_line_is_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let journal = path_for(tmp.path(), "s3://b/run/step-1");
        let up = |p: &str, id: &str| OpenUpload {
            namespace: None,
            destination: "s3://b/run/step-1".into(),
            path: p.into(),
            upload_id: id.into(),
        };
        assert!(read_uploads(&journal).is_empty());
        append_upload(&journal, &up("a", "u-1")).unwrap();
        // A torn write in the middle, then more.
        let side = uploads_path(&journal);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&side)
            .unwrap();
        std::io::Write::write_all(&mut f, b"{\"destination\":\"s3://b/ru\n").unwrap();
        append_upload(&journal, &up("b", "u-2")).unwrap();
        std::fs::write(&journal, b"{ not json").unwrap();
        assert!(load(&journal).is_err());
        assert_eq!(read_uploads(&journal), vec![up("a", "u-1"), up("b", "u-2")]);
        assert!(orphaned_uploads(tmp.path()).is_empty());
        rewrite_uploads(&journal, &[up("b", "u-2")]).unwrap();
        assert_eq!(read_uploads(&journal), vec![up("b", "u-2")]);
        std::fs::remove_file(&journal).unwrap();
        assert_eq!(orphaned_uploads(tmp.path()), vec![journal.clone()]);
        remove_all(&journal);
        assert!(!side.exists());
        assert!(orphaned_uploads(tmp.path()).is_empty());
    }
}
