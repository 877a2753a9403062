//! The file side of checkpoint protocol v1 (design §5): `notice.json` in, `ack-<pid>.json` and
//! `ack` out, inside the checkpoint dir.
//!
//! A [`CheckpointDir`] holds a directory file descriptor for the filesystem root the processes see:
//! `/proc/<pid>/root` for a container (the pid's start time is re-checked after opening, so a
//! recycled PID cannot hand us another root), `/` for a host group. Every path below that root is
//! resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: absolute symlinks and `..`
//! planted in the container stay inside the container, and `/proc/self/root`-style magic links are
//! refused, so the agent can never be pointed at a host file. The directory is created if missing
//! (owned by the target process's user so that it can write its acks), files are written as temp +
//! fsync + rename, and reads refuse anything but a small regular file
//! (a FIFO or device planted as an ack cannot block or flood the agent).

use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use jiff::Timestamp;
use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};

use super::procfs::ProcFs;
use super::Error;

/// Name of the notice file inside the checkpoint dir.
pub const NOTICE_FILE: &str = "notice.json";
/// Name of the plain ack file (acks the whole container).
pub const PLAIN_ACK_FILE: &str = "ack";
/// Acks and notices larger than this are refused.
const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Name of the per-process ack file for a PID as the process sees it.
pub fn ack_file_name(ns_pid: i32) -> String {
    format!("ack-{ns_pid}.json")
}

/// `notice.json`: what the training code reads after the signal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticeFile {
    pub notice_id: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// When the machine goes away (Unix seconds); `null` when the cloud gave none ("now").
    pub deadline_unix: Option<i64>,
    /// When spotguard stops waiting for acks (Unix seconds).
    pub checkpoint_deadline_unix: i64,
    /// The signal that was sent, e.g. `SIGUSR1`.
    pub signal: String,
}

/// `state` of an `ack-<pid>.json`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AckState {
    Received,
    Done,
    Skipped,
    Failed,
}

impl AckState {
    /// `done`, `skipped` and `failed` end the wait for a process; `received` does not.
    pub fn is_terminal(self) -> bool {
        !matches!(self, AckState::Received)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            AckState::Received => "received",
            AckState::Done => "done",
            AckState::Skipped => "skipped",
            AckState::Failed => "failed",
        }
    }
}

/// `ack-<pid>.json` as written by the training code. Only `state` is required; the rest is
/// reported as given.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AckFile {
    pub state: AckState,
    #[serde(default)]
    pub step: Option<serde_json::Value>,
    #[serde(default)]
    pub checkpoint: Option<serde_json::Value>,
    #[serde(default)]
    pub ts: Option<serde_json::Value>,
}

/// An ack file read back, with its modification time (what "written after the signal" is judged
/// by: the agent and the writer share the kernel's clock, whatever `ts` says).
#[derive(Clone, Debug, PartialEq)]
pub struct Ack {
    pub file: AckFile,
    pub mtime: Timestamp,
}

/// The checkpoint dir of one target, resolved inside its filesystem root.
#[derive(Debug)]
pub struct CheckpointDir {
    root: OwnedFd,
    /// `dir` relative to the root (`.` for the root itself).
    rel: PathBuf,
    /// For errors and logs: `/tmp/spotguard in /proc/1234/root`.
    display: String,
}

const RESOLVE: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);

fn relative(dir: &Path) -> io::Result<PathBuf> {
    if !dir.is_absolute() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("checkpoint dir {} is not absolute", dir.display()),
        ));
    }
    let mut rel = PathBuf::new();
    for c in dir.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => rel.push(n),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("checkpoint dir {} contains `..`", dir.display()),
                ))
            }
        }
    }
    if rel.as_os_str().is_empty() {
        rel.push(".");
    }
    Ok(rel)
}

impl CheckpointDir {
    /// A host path (host groups, `root_pid: None`).
    pub fn host(dir: &Path) -> Result<Self, Error> {
        let target = dir.display().to_string();
        let open = || -> io::Result<(OwnedFd, PathBuf)> {
            let rel = relative(dir)?;
            let root = rustix::fs::open(
                "/",
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            Ok((root, rel))
        };
        let (root, rel) = open().map_err(|source| Error::ReadAck {
            target: target.clone(),
            source,
        })?;
        Ok(CheckpointDir {
            root,
            rel,
            display: target,
        })
    }

    /// `dir` inside the filesystem root of process `pid` (`<proc>/<pid>/root`). The process's
    /// start time is checked after the root is opened: if the PID now belongs to another process
    /// the open fails with `ESRCH`. The descriptor stays valid after the process exits.
    pub fn in_root_of(proc: &ProcFs, pid: i32, start_time: u64, dir: &Path) -> Result<Self, Error> {
        let root_path = proc.path(pid, "root");
        let display = format!("{} in {}", dir.display(), root_path.display());
        let open = || -> io::Result<(OwnedFd, PathBuf)> {
            let rel = relative(dir)?;
            let root = rustix::fs::open(
                &root_path,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let alive = proc
                .alive(pid, start_time)
                .map_err(|e| io::Error::other(e.to_string()))?;
            if !alive {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok((root, rel))
        };
        let (root, rel) = open().map_err(|source| Error::ReadAck {
            target: display.clone(),
            source,
        })?;
        Ok(CheckpointDir { root, rel, display })
    }

    /// Where this dir is, for logs.
    pub fn display(&self) -> &str {
        &self.display
    }

    fn open_in_root(&self, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
        Ok(rustix::fs::openat2(
            &self.root,
            rel,
            flags | OFlags::CLOEXEC,
            Mode::empty(),
            RESOLVE,
        )?)
    }

    /// Open the dir, creating missing components. A newly created final directory is given to
    /// `owner` (uid, gid) so that the process can write its acks.
    fn ensure_dir(&self, owner: Option<(u32, u32)>) -> io::Result<OwnedFd> {
        let mut prefix = PathBuf::new();
        let mut created_last = false;
        let count = self.rel.components().count();
        for (i, comp) in self.rel.components().enumerate() {
            prefix.push(comp);
            match self.open_in_root(&prefix, OFlags::PATH | OFlags::DIRECTORY) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let parent = prefix
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."));
                    let parent_fd = self.open_in_root(parent, OFlags::PATH | OFlags::DIRECTORY)?;
                    match rustix::fs::mkdirat(
                        &parent_fd,
                        comp.as_os_str(),
                        Mode::from_raw_mode(0o755),
                    ) {
                        Ok(()) => created_last = i + 1 == count,
                        Err(rustix::io::Errno::EXIST) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let dir = self.open_in_root(&self.rel, OFlags::RDONLY | OFlags::DIRECTORY)?;
        if created_last {
            rustix::fs::fchmod(&dir, Mode::from_raw_mode(0o755))?;
            if let Some((uid, gid)) = owner {
                rustix::fs::fchown(
                    &dir,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )?;
            }
        }
        Ok(dir)
    }

    /// Write `name` atomically inside the dir (temp + fsync + rename), creating the dir if
    /// needed.
    pub fn write_atomic(
        &self,
        name: &str,
        data: &[u8],
        owner: Option<(u32, u32)>,
    ) -> Result<(), Error> {
        let err = |source| Error::WriteNotice {
            target: self.display.clone(),
            file: name.to_string(),
            source,
        };
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bad file name",
            )));
        }
        let dir = self.ensure_dir(owner).map_err(err)?;
        let tmp = format!(
            ".{name}.tmp-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let result = (|| -> io::Result<()> {
            let fd = rustix::fs::openat(
                &dir,
                tmp.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )?;
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(0o644))?;
            let mut file = std::fs::File::from(fd);
            file.write_all(data)?;
            file.sync_all()?;
            rustix::fs::renameat(&dir, tmp.as_str(), &dir, name)?;
            // The rename is atomic for readers. The directory itself is not fsynced: a notice is
            // meaningless after a crash, and every fsync is milliseconds before the signal.
            Ok(())
        })();
        if result.is_err() {
            let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), rustix::fs::AtFlags::empty());
        }
        result.map_err(err)
    }

    /// Write `notice.json`.
    pub fn write_notice(
        &self,
        notice: &NoticeFile,
        owner: Option<(u32, u32)>,
    ) -> Result<(), Error> {
        let mut data = serde_json::to_vec_pretty(notice).map_err(|e| Error::WriteNotice {
            target: self.display.clone(),
            file: NOTICE_FILE.to_string(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        data.push(b'\n');
        self.write_atomic(NOTICE_FILE, &data, owner)
    }

    /// Read a small regular file in the dir: `None` when it does not exist.
    fn read_file(&self, name: &str) -> Result<Option<(Vec<u8>, Timestamp)>, Error> {
        let err = |source| Error::ReadAck {
            target: format!("{} ({name})", self.display),
            source,
        };
        let fd = match self.open_in_root(
            &self.rel.join(name),
            OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
        ) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(e)),
        };
        let mut file = std::fs::File::from(fd);
        let meta = file.metadata().map_err(err)?;
        if !meta.is_file() {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not a regular file",
            )));
        }
        if meta.len() > MAX_FILE_BYTES {
            return Err(err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} bytes, more than {MAX_FILE_BYTES}", meta.len()),
            )));
        }
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| Timestamp::try_from(t).ok())
            .unwrap_or(Timestamp::UNIX_EPOCH);
        let mut data = Vec::new();
        (&mut file)
            .take(MAX_FILE_BYTES)
            .read_to_end(&mut data)
            .map_err(err)?;
        Ok(Some((data, mtime)))
    }

    /// Read `ack-<ns_pid>.json`. `Ok(None)` when absent; malformed JSON (perhaps a writer that is
    /// not atomic, caught mid-write) is an `InvalidData` error.
    pub fn read_ack(&self, ns_pid: i32) -> Result<Option<Ack>, Error> {
        let name = ack_file_name(ns_pid);
        let Some((data, mtime)) = self.read_file(&name)? else {
            return Ok(None);
        };
        let file: AckFile = serde_json::from_slice(&data).map_err(|e| Error::ReadAck {
            target: format!("{} ({name})", self.display),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        Ok(Some(Ack { file, mtime }))
    }

    /// Modification time of the plain `ack` file, if present (any content).
    pub fn plain_ack(&self) -> Result<Option<Timestamp>, Error> {
        Ok(self.read_file(PLAIN_ACK_FILE)?.map(|(_, mtime)| mtime))
    }

    /// Read `notice.json` back (restart path, tests).
    pub fn read_notice(&self) -> Result<Option<NoticeFile>, Error> {
        let Some((data, _)) = self.read_file(NOTICE_FILE)? else {
            return Ok(None);
        };
        serde_json::from_slice(&data)
            .map(Some)
            .map_err(|e| Error::ReadAck {
                target: format!("{} ({NOTICE_FILE})", self.display),
                source: io::Error::new(io::ErrorKind::InvalidData, e),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice() -> NoticeFile {
        NoticeFile {
            notice_id: "n-1".into(),
            source: "aws".into(),
            kind: "interruption".into(),
            deadline_unix: Some(1_700_000_120),
            checkpoint_deadline_unix: 1_700_000_095,
            signal: "SIGUSR1".into(),
        }
    }

    #[test]
    fn notice_round_trip_and_atomic_replace() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/ckpt");
        let cd = CheckpointDir::host(&dir).unwrap();
        assert_eq!(cd.read_notice().unwrap(), None);
        cd.write_notice(&notice(), None).unwrap();
        assert_eq!(cd.read_notice().unwrap(), Some(notice()));
        let mut second = notice();
        second.deadline_unix = None;
        cd.write_notice(&second, None).unwrap();
        let text = std::fs::read_to_string(dir.join(NOTICE_FILE)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["deadline_unix"], serde_json::Value::Null);
        assert_eq!(v["checkpoint_deadline_unix"], 1_700_000_095);
        assert_eq!(v["signal"], "SIGUSR1");
        // no temp files left behind
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![NOTICE_FILE.to_string()]);
    }

    #[test]
    fn acks_parse_and_refuse_odd_files() {
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        assert_eq!(cd.read_ack(7).unwrap(), None);
        assert_eq!(cd.plain_ack().unwrap(), None);
        std::fs::write(
            tmp.path().join("ack-7.json"),
            r#"{"state":"done","step":1200,"checkpoint":"s3://b/ck/1200","ts":1700000000.5,"extra":1}"#,
        )
        .unwrap();
        let ack = cd.read_ack(7).unwrap().unwrap();
        assert_eq!(ack.file.state, AckState::Done);
        assert_eq!(ack.file.step, Some(serde_json::json!(1200)));
        assert!(ack.mtime > Timestamp::now() - jiff::SignedDuration::from_secs(60));
        std::fs::write(tmp.path().join("ack-8.json"), r#"{"state":"recei"#).unwrap();
        let err = cd.read_ack(8).unwrap_err();
        assert!(err.to_string().contains("ack-8.json"), "{err}");
        std::fs::write(tmp.path().join("ack-9.json"), r#"{"state":"weird"}"#).unwrap();
        assert!(cd.read_ack(9).is_err());
        // a FIFO must not block the reader
        let fifo = tmp.path().join("ack-10.json");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert!(cd.read_ack(10).unwrap_err().to_string().contains("regular"));
        std::fs::write(tmp.path().join("ack-11.json"), vec![b' '; 100_000]).unwrap();
        assert!(cd.read_ack(11).is_err());
        std::fs::write(tmp.path().join(PLAIN_ACK_FILE), b"").unwrap();
        assert!(cd.plain_ack().unwrap().is_some());
    }

    #[test]
    fn rejects_relative_and_parent_dirs() {
        assert!(CheckpointDir::host(Path::new("rel/dir")).is_err());
        assert!(CheckpointDir::host(Path::new("/tmp/../etc")).is_err());
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        for bad in ["", "a/b", "..", "."] {
            assert!(cd.write_atomic(bad, b"x", None).is_err());
        }
    }

    #[test]
    fn created_dir_is_given_to_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("owned");
        let cd = CheckpointDir::host(&dir).unwrap();
        cd.write_notice(&notice(), Some((4321, 4322))).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o7777),
            (4321, 4322, 0o755)
        );
        let file = std::fs::metadata(dir.join(NOTICE_FILE)).unwrap();
        assert_eq!(file.mode() & 0o777, 0o644);
        // an existing dir keeps its owner
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        cd.write_notice(&notice(), Some((4321, 4322))).unwrap();
        assert_eq!(std::fs::metadata(tmp.path()).unwrap().uid(), 0);
    }

    #[test]
    fn symlinks_resolve_inside_the_root() {
        // A fake "container root" that is just a directory: opened as the root, an absolute
        // symlink inside must resolve under it, never on the host.
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        let host_target = tmp.path().join("host-target");
        std::fs::create_dir_all(root.join("tmp")).unwrap();
        std::fs::create_dir_all(&host_target).unwrap();
        std::os::unix::fs::symlink(&host_target, root.join("tmp/sg")).unwrap();
        let cd = CheckpointDir {
            root: rustix::fs::open(&root, OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap(),
            rel: PathBuf::from("tmp/sg"),
            display: "test".into(),
        };
        assert!(cd.write_notice(&notice(), None).is_err());
        assert_eq!(std::fs::read_dir(&host_target).unwrap().count(), 0);
        // the symlink target created inside the root: now the write lands there
        let inside = root.join(host_target.strip_prefix("/").unwrap());
        std::fs::create_dir_all(&inside).unwrap();
        cd.write_notice(&notice(), None).unwrap();
        assert!(inside.join(NOTICE_FILE).exists());
        assert_eq!(std::fs::read_dir(&host_target).unwrap().count(), 0);
    }

    #[test]
    fn magic_links_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/proc/self/cwd", tmp.path().join("magic")).unwrap();
        let cd = CheckpointDir::host(&tmp.path().join("magic")).unwrap();
        let err = cd.write_notice(&notice(), None).unwrap_err();
        assert!(
            matches!(&err, Error::WriteNotice { source, .. } if source.raw_os_error() == Some(libc::ELOOP)),
            "{err}"
        );
    }
}
