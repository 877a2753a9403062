//! The file side of checkpoint protocol v1 (docs/checkpoint-protocol.md): `notice.json` in, `ack-<pid>.json` and
//! `ack` out, inside the checkpoint dir.
//!
//! A [`CheckpointDir`] holds a directory file descriptor for the filesystem root the processes see:
//! `/proc/<pid>/root` for a container (the pid's start time is re-checked after opening, so a
//! recycled PID cannot hand us another root), `/` for a host group. Every path below that root is
//! resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: absolute symlinks and `..`
//! planted in the container stay inside the container, and `/proc/self/root`-style magic links are
//! refused, so the agent can never be pointed at a host file. Inside the checkpoint dir, names are
//! resolved with `RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_SYMLINKS` and `O_NOFOLLOW`: an ack
//! or notice is a plain entry of the dir itself, never a symlink and never on another mount. (The
//! path *to* the dir may cross mounts: an emptyDir volume is a mount of its own.)
//!
//! A missing dir is created by the agent owned by root with mode `1777` (sticky, world-writable:
//! `fchmod` by the owner needs no capability), so a trainer of any uid can write its acks; the
//! agent never chowns (it ships without CAP_CHOWN). Files are written as temp + fsync + rename, and
//! reads open with `O_NOFOLLOW | O_NONBLOCK`, then `fstat` and refuse anything but a small regular
//! file (a FIFO or device planted as an ack cannot block or flood the agent).
//!
//! The formats themselves (names, `notice.json`, acks, [`FileStamp`]) are [`super::protocol`]'s.

use std::io::{self, Read};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::podfs::{self, Helper};
use super::procfs::ProcFs;
use super::protocol::{parse_ack_name, MAX_FILE_BYTES};
use super::root::{self, ProcessRoot, RootError, Symlinks};
use super::Error;
use crate::fsutil::Durability;

// The types of this module's API, where its callers have always found them.
pub use super::protocol::{
    ack_file_name, Ack, AckFile, AckName, AckState, FileStamp, ForeignAck, NoticeFile, NOTICE_FILE,
    PLAIN_ACK_FILE,
};

/// Directory entries looked at per listing: a directory stuffed with names costs bounded work.
const MAX_ENTRIES: usize = 65_536;

/// The checkpoint dir of one target, resolved inside its filesystem root.
///
/// Every read resolves the path again from the root (a dir replaced or remounted meanwhile is
/// followed). The first dir opened is also kept open, for one read after the target exited
/// ([`CheckpointDir::read_ack_after_exit`]): a container's dir is usually a mount of the
/// container's own mount namespace (an emptyDir), which goes away with the container's last
/// process, so a trainer that writes `done` and exits at once would leave its ack unreadable —
/// resolving the path from the root then finds the empty mountpoint under it.
///
/// The file operations run in a helper process of their own when the daemon set one up
/// ([`super::podfs`]): a dir that hangs (a FUSE daemon that never answers) holds the helper in
/// the kernel, never the agent.
#[derive(Debug)]
pub struct CheckpointDir {
    /// For errors and logs: `/tmp/spotguard in /proc/1234/root`.
    display: String,
    at: At,
}

/// Where a [`CheckpointDir`]'s file operations run.
#[derive(Debug)]
enum At {
    Here(LocalDir),
    Helper(Helper),
}

/// A [`CheckpointDir`]'s file side in the process that does the I/O (the helper, or the agent
/// without one).
#[derive(Debug)]
pub(crate) struct LocalDir {
    root: ProcessRoot,
    /// `dir` relative to the root (`.` for the root itself).
    rel: PathBuf,
    /// For errors and logs: `/tmp/spotguard in /proc/1234/root`.
    display: String,
    /// The dir itself, as first opened (kept: see above).
    kept: std::sync::OnceLock<OwnedFd>,
}

/// Mode of a checkpoint dir the agent creates: any uid may write its acks, nobody may remove
/// another's files.
pub const CREATED_DIR_MODE: u32 = 0o1777;

/// `dir` relative to the root, or why it has none.
fn relative(dir: &Path) -> io::Result<PathBuf> {
    root::relative(dir).map_err(|why| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("checkpoint dir {} {why}", dir.display()),
        )
    })
}

impl LocalDir {
    /// A host path (host groups, `root_pid: None`).
    pub(super) fn host(dir: &Path) -> Result<Self, Error> {
        let display = dir.display().to_string();
        let open = || -> io::Result<(ProcessRoot, PathBuf)> {
            let rel = relative(dir)?;
            Ok((ProcessRoot::host()?, rel))
        };
        let (root, rel) = open().map_err(|source| Error::ReadAck {
            target: display.clone(),
            source,
        })?;
        Ok(Self::new(root, rel, display))
    }

    /// `dir` inside the filesystem root of process `pid` (`<proc>/<pid>/root`). The process's
    /// start time is checked after the root is opened: if the PID now belongs to another process
    /// the open fails with `ESRCH`. The descriptor stays valid after the process exits.
    pub(super) fn in_root_of(
        proc: &ProcFs,
        pid: i32,
        start_time: u64,
        dir: &Path,
    ) -> Result<Self, Error> {
        let display = ProcessRoot::show_in(proc, pid, dir);
        let open = || -> io::Result<(ProcessRoot, PathBuf)> {
            let rel = relative(dir)?;
            let (root, ()) =
                ProcessRoot::of_process(proc, pid, start_time, || Ok(())).map_err(|e| match e {
                    RootError::Open(errno) => errno.into(),
                    RootError::Exited(_) => io::Error::from_raw_os_error(libc::ESRCH),
                    e => io::Error::other(e.to_string()),
                })?;
            Ok((root, rel))
        };
        let (root, rel) = open().map_err(|source| Error::ReadAck {
            target: display.clone(),
            source,
        })?;
        Ok(Self::new(root, rel, display))
    }

    fn new(root: ProcessRoot, rel: PathBuf, display: String) -> Self {
        LocalDir {
            root,
            rel,
            display,
            kept: std::sync::OnceLock::new(),
        }
    }

    fn open_in_root(&self, rel: &Path, flags: OFlags) -> io::Result<OwnedFd> {
        Ok(self.root.open(rel, flags, Symlinks::InRoot)?)
    }

    /// Open the dir (a directory fd), creating missing components: intermediate ones `0755`, the
    /// dir itself [`CREATED_DIR_MODE`], all owned by the agent (root). Nothing is chowned.
    fn ensure_dir(&self) -> io::Result<OwnedFd> {
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
        let dir = self.open_dir()?;
        if created_last {
            // The agent owns what it just made: fchmod needs no capability (umask left it 0755).
            rustix::fs::fchmod(&dir, Mode::from_raw_mode(CREATED_DIR_MODE))?;
        }
        Ok(dir)
    }

    /// Open the existing dir (no creation), resolved from the root; the first one opened is
    /// kept for [`CheckpointDir::read_ack_after_exit`].
    fn open_dir(&self) -> io::Result<OwnedFd> {
        let fd = self.open_in_root(&self.rel, OFlags::RDONLY | OFlags::DIRECTORY)?;
        if self.kept.get().is_none() {
            let _ = self.kept.set(fd.try_clone()?);
        }
        Ok(fd)
    }

    /// Open an entry of the dir: never through a symlink, never on another mount.
    fn open_entry(dir: &OwnedFd, name: &str, flags: OFlags) -> io::Result<OwnedFd> {
        Ok(root::open_entry(dir, name, flags)?)
    }

    /// Stamps of `names` and of every fallback ack name in the dir as they are now (absent names
    /// are left out; a missing dir gives none). Taken just before the signal; see [`FileStamp`].
    pub(super) fn stamps(&self, names: &[String]) -> std::collections::HashMap<String, FileStamp> {
        let mut out = std::collections::HashMap::new();
        let Ok(dir) = self.open_dir() else {
            return out;
        };
        let listed = Self::list_fallbacks(&dir).unwrap_or_default();
        for name in names.iter().chain(listed.iter().map(|(n, _)| n)) {
            if let Ok(st) =
                rustix::fs::statat(&dir, name.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            {
                out.insert(name.clone(), FileStamp::of(&st));
            }
        }
        out
    }

    /// The fallback ack names (`ack-<pid>.<suffix>.json`, `ack.<suffix>`) in the dir, with what
    /// they acknowledge. At most [`MAX_ENTRIES`] entries are looked at.
    pub(super) fn fallback_acks(&self) -> Result<Vec<(String, AckName)>, Error> {
        let dir = match self.open_dir() {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(Error::ReadAck {
                    target: self.display.clone(),
                    source,
                })
            }
        };
        Self::list_fallbacks(&dir).map_err(|source| Error::ReadAck {
            target: self.display.clone(),
            source,
        })
    }

    fn list_fallbacks(dir: &OwnedFd) -> io::Result<Vec<(String, AckName)>> {
        let mut listing = rustix::fs::Dir::read_from(dir)?;
        let mut out = Vec::new();
        for entry in listing.by_ref().take(MAX_ENTRIES) {
            let entry = entry?;
            let Ok(name) = entry.file_name().to_str() else {
                continue;
            };
            if name == PLAIN_ACK_FILE
                || (name.starts_with("ack-") && name.matches('.').count() == 1)
            {
                continue;
            }
            if let Some(what) = parse_ack_name(name) {
                out.push((name.to_string(), what));
            }
        }
        Ok(out)
    }

    /// Before the signal: remove the files at `names` that belong to none of `owners` (planted by
    /// another user at a name the targets will write), so that they never stand in the targets'
    /// way. Returns what was found and whether it could be removed (in a sticky directory only its
    /// owner, the file's owner or CAP_FOWNER may; the agent has no CAP_FOWNER).
    pub(super) fn remove_foreign(&self, names: &[(String, Vec<u32>)]) -> Vec<ForeignAck> {
        let Ok(dir) = self.open_dir() else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for (name, owners) in names {
            let Ok(st) =
                rustix::fs::statat(&dir, name.as_str(), rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
            else {
                continue;
            };
            if owners.contains(&st.st_uid) {
                continue;
            }
            let removed = rustix::fs::unlinkat(&dir, name.as_str(), rustix::fs::AtFlags::empty())
                .map_err(|e| io::Error::from(e).to_string());
            found.push(ForeignAck {
                name: name.clone(),
                owner: st.st_uid,
                removed,
            });
        }
        found
    }

    /// Write `name` atomically inside the dir (temp + rename), creating the dir if needed.
    pub(super) fn write_atomic(&self, name: &str, data: &[u8]) -> Result<(), Error> {
        let err = |source| Error::WriteNotice {
            target: self.display.clone(),
            file: name.to_string(),
            source,
        };
        let dir = self.ensure_dir().map_err(err)?;
        // Not fsynced: a notice is meaningless after a crash of the machine (a new life), and
        // an fsync before the signal takes milliseconds, hundreds of them when other writers
        // have dirty data (a journal commit waits for them).
        crate::fsutil::write_atomic_at(dir.as_fd(), name, data, 0o644, Durability::None)
            .map_err(err)
    }

    /// [`Self::read_file`], from the dir as first opened when `kept` (and it was opened).
    pub(super) fn read_file_in(
        &self,
        name: &str,
        kept: bool,
    ) -> Result<Option<(Vec<u8>, FileStamp)>, Error> {
        let err = |source| Error::ReadAck {
            target: format!("{} ({name})", self.display),
            source,
        };
        let dir = match (kept, self.kept.get()) {
            (true, Some(fd)) => fd.try_clone(),
            _ => self.open_dir(),
        };
        let dir = match dir {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(e)),
        };
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY;
        let fd = match Self::open_entry(&dir, name, flags) {
            Ok(fd) => fd,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(err(refused_entry(e))),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| err(e.into()))?;
        let stamp = self.readable(name, &st)?;
        let mut file = std::fs::File::from(fd);
        let mut data = Vec::new();
        (&mut file)
            .take(MAX_FILE_BYTES)
            .read_to_end(&mut data)
            .map_err(err)?;
        Ok(Some((data, stamp)))
    }

    /// The stamp of an entry opened for reading, after `fstat` said it is a small regular file
    /// with one link that not every user may write; else why not.
    fn readable(&self, name: &str, st: &rustix::fs::Stat) -> Result<FileStamp, Error> {
        let target = || format!("{} ({name})", self.display);
        let invalid = |why: String| Error::ReadAck {
            target: target(),
            source: io::Error::new(io::ErrorKind::InvalidData, why),
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(invalid("not a regular file".into()));
        }
        // A hard link keeps its owner: a file another user's process linked in from anywhere on
        // the filesystem (a victim's world-writable log) would pass the owner check. And a file
        // every user may write is nobody's word in particular.
        let refused = if st.st_nlink != 1 {
            Some(format!("has {} hard links", st.st_nlink))
        } else if st.st_mode & 0o002 != 0 {
            Some(format!(
                "is writable by every user (mode {:o})",
                st.st_mode & 0o7777
            ))
        } else {
            None
        };
        if let Some(reason) = refused {
            return Err(Error::RefusedAck {
                target: target(),
                reason,
                ino: st.st_ino,
            });
        }
        let stamp = FileStamp::of(st);
        if stamp.size > MAX_FILE_BYTES {
            return Err(invalid(format!(
                "{} bytes, more than {MAX_FILE_BYTES}",
                stamp.size
            )));
        }
        Ok(stamp)
    }
}

/// An entry that could not be opened, in words: a symlink or another mount is refused.
fn refused_entry(e: io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(libc::ELOOP) => io::Error::new(io::ErrorKind::InvalidData, "is a symlink (refused)"),
        Some(libc::EXDEV) => {
            io::Error::new(io::ErrorKind::InvalidData, "is on another mount (refused)")
        }
        _ => e,
    }
}

impl CheckpointDir {
    /// A host path (host groups, `root_pid: None`).
    pub fn host(dir: &Path) -> Result<Self, Error> {
        let display = dir.display().to_string();
        let at = match podfs::helper() {
            Some(exe) => At::Helper(Helper::open_host(exe, dir, &display)?),
            None => At::Here(LocalDir::host(dir)?),
        };
        Ok(CheckpointDir { display, at })
    }

    /// `dir` inside the filesystem root of process `pid` (`<proc>/<pid>/root`). The process's
    /// start time is checked after the root is opened: if the PID now belongs to another process
    /// the open fails with `ESRCH`. The descriptor stays valid after the process exits.
    pub fn in_root_of(proc: &ProcFs, pid: i32, start_time: u64, dir: &Path) -> Result<Self, Error> {
        let display = ProcessRoot::show_in(proc, pid, dir);
        let at = match podfs::helper() {
            Some(exe) => At::Helper(Helper::open_in_root(
                exe, proc, pid, start_time, dir, &display,
            )?),
            None => At::Here(LocalDir::in_root_of(proc, pid, start_time, dir)?),
        };
        Ok(CheckpointDir { display, at })
    }

    /// Where this dir is, for logs.
    pub fn display(&self) -> &str {
        &self.display
    }

    /// Stamps of `names` and of every fallback ack name in the dir as they are now (absent names
    /// are left out; a missing dir gives none). Taken just before the signal; see [`FileStamp`].
    pub fn stamps(&self, names: &[String]) -> std::collections::HashMap<String, FileStamp> {
        match &self.at {
            At::Here(d) => d.stamps(names),
            At::Helper(h) => h.stamps(names),
        }
    }

    /// The fallback ack names (`ack-<pid>.<suffix>.json`, `ack.<suffix>`) in the dir, with what
    /// they acknowledge. At most [`MAX_ENTRIES`] entries are looked at.
    pub fn fallback_acks(&self) -> Result<Vec<(String, AckName)>, Error> {
        match &self.at {
            At::Here(d) => d.fallback_acks(),
            At::Helper(h) => h.fallback_acks(),
        }
    }

    /// Before the signal: remove the files at `names` that belong to none of `owners` (planted by
    /// another user at a name the targets will write), so that they never stand in the targets'
    /// way. Returns what was found and whether it could be removed (in a sticky directory only its
    /// owner, the file's owner or CAP_FOWNER may; the agent has no CAP_FOWNER).
    pub fn remove_foreign(&self, names: &[(String, Vec<u32>)]) -> Vec<ForeignAck> {
        match &self.at {
            At::Here(d) => d.remove_foreign(names),
            At::Helper(h) => h.remove_foreign(names),
        }
    }

    /// Write `name` atomically inside the dir (temp + fsync + rename), creating the dir if
    /// needed.
    pub fn write_atomic(&self, name: &str, data: &[u8]) -> Result<(), Error> {
        match &self.at {
            At::Here(d) => d.write_atomic(name, data),
            At::Helper(h) => h.write_atomic(name, data),
        }
    }

    /// Write `notice.json`.
    pub fn write_notice(&self, notice: &NoticeFile) -> Result<(), Error> {
        let mut data = serde_json::to_vec_pretty(notice).map_err(|e| Error::WriteNotice {
            target: self.display.clone(),
            file: NOTICE_FILE.to_string(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        data.push(b'\n');
        self.write_atomic(NOTICE_FILE, &data)
    }

    /// Read a small regular file in the dir: `None` when it (or the dir) does not exist. Opened
    /// with `O_NOFOLLOW | O_NONBLOCK` (a symlink is refused, a FIFO does not block), then checked
    /// with `fstat` before anything is read.
    pub fn read_file(&self, name: &str) -> Result<Option<(Vec<u8>, FileStamp)>, Error> {
        self.read_file_in(name, false)
    }

    /// [`Self::read_file`], from the dir as first opened when `kept` (and it was opened).
    fn read_file_in(&self, name: &str, kept: bool) -> Result<Option<(Vec<u8>, FileStamp)>, Error> {
        match &self.at {
            At::Here(d) => d.read_file_in(name, kept),
            At::Helper(h) => h.read_file_in(name, kept),
        }
    }

    /// A JSON file of this dir with its stamp. `Ok(None)` when absent; malformed JSON is an
    /// `InvalidData` error.
    fn read_json<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<(T, FileStamp)>, Error> {
        self.read_json_in(name, false)
    }

    fn read_json_in<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        kept: bool,
    ) -> Result<Option<(T, FileStamp)>, Error> {
        let Some((data, stamp)) = self.read_file_in(name, kept)? else {
            return Ok(None);
        };
        serde_json::from_slice(&data)
            .map(|value| Some((value, stamp)))
            .map_err(|e| Error::ReadAck {
                target: format!("{} ({name})", self.display),
                source: io::Error::new(io::ErrorKind::InvalidData, e),
            })
    }

    /// Read `ack-<ns_pid>.json`. `Ok(None)` when absent; malformed JSON (perhaps a writer that is
    /// not atomic, caught mid-write) is an `InvalidData` error.
    pub fn read_ack(&self, ns_pid: i32) -> Result<Option<Ack>, Error> {
        self.read_ack_named(&ack_file_name(ns_pid))
    }

    /// Read a per-process ack by its file name (plain or fallback).
    pub fn read_ack_named(&self, name: &str) -> Result<Option<Ack>, Error> {
        let read = self.read_json::<AckFile>(name)?;
        Ok(read.map(|(file, stamp)| Ack { file, stamp }))
    }

    /// [`Self::read_ack_named`] for a target that has exited: from the dir as first opened, which
    /// outlives the target's mount namespace (see [`CheckpointDir`]).
    pub fn read_ack_after_exit(&self, name: &str) -> Result<Option<Ack>, Error> {
        let read = self.read_json_in::<AckFile>(name, true)?;
        Ok(read.map(|(file, stamp)| Ack { file, stamp }))
    }

    /// A small regular file of an exited target (the helper's progress record), read like an
    /// ack from the dir as first opened (see [`Self::read_ack_after_exit`]); the caller parses it.
    pub fn read_file_after_exit(&self, name: &str) -> Result<Option<(Vec<u8>, FileStamp)>, Error> {
        self.read_file_in(name, true)
    }

    /// Stamp of the plain `ack` file, if present (any content).
    pub fn plain_ack(&self) -> Result<Option<FileStamp>, Error> {
        self.plain_ack_named(PLAIN_ACK_FILE)
    }

    /// Stamp of a plain ack by its file name (`ack` or a fallback `ack.<suffix>`).
    pub fn plain_ack_named(&self, name: &str) -> Result<Option<FileStamp>, Error> {
        Ok(self.read_file(name)?.map(|(_, stamp)| stamp))
    }

    /// `notice.json` read back with its stamp (restart path: the anchor acks are compared with).
    /// Only the agent's own file counts (owned by its user, one link): a `notice.json` a trainer
    /// wrote before the agent did would otherwise say "already delivered" and stop the signal;
    /// another user's is treated as absent (the notice is delivered, and written over it).
    pub fn read_notice_stamped(&self) -> Result<Option<(NoticeFile, FileStamp)>, Error> {
        let read = match self.read_json::<NoticeFile>(NOTICE_FILE) {
            Err(Error::RefusedAck { target, reason, .. }) => {
                tracing::warn!(file = %target, %reason, "ignoring a notice.json the agent did not write");
                return Ok(None);
            }
            r => r?,
        };
        match read {
            Some((_, stamp)) if stamp.uid != rustix::process::geteuid().as_raw() => {
                tracing::warn!(dir = %self.display, owner = stamp.uid, "ignoring a notice.json the agent did not write");
                Ok(None)
            }
            r => Ok(r),
        }
    }

    /// Read `notice.json` back (the responder's restart path: was this notice delivered here?).
    pub fn read_notice(&self) -> Result<Option<NoticeFile>, Error> {
        Ok(self.read_notice_stamped()?.map(|(notice, _)| notice))
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
            life: None,
            node: None,
        }
    }

    /// A container's checkpoint dir is a mount in the container's own mount namespace (an
    /// emptyDir). When the trainer writes `done` and exits at once — the helper's
    /// `exit_after_checkpoint` — the namespace goes with the last process and its mounts are
    /// detached: resolving the dir again from the container's root then finds the empty
    /// mountpoint underneath. The dir opened for the notice must still read the ack.
    #[test]
    fn the_ack_is_read_after_the_containers_mount_namespace_is_gone() {
        use std::io::{BufRead, Write};
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("spotguard");
        std::fs::create_dir(&dir).unwrap();
        // A process in a mount namespace of its own with a tmpfs at `dir` (the emptyDir).
        let script = r#"mount -t tmpfs tmpfs "$1" && echo mounted && read go && printf '{"state":"done","step":7}' > "$1/ack-$$.json" && exit 0"#;
        let mut child = std::process::Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
            ])
            .arg(&dir)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("unshare (util-linux; needs root)");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "mounted", "the tmpfs mount needs root");
        let pid = child.id() as i32;
        let proc = ProcFs::default();
        let start = proc.start_time(pid).unwrap();
        let ckpt = CheckpointDir::in_root_of(&proc, pid, start, &dir).unwrap();
        ckpt.write_notice(&notice()).unwrap();
        // The trainer acks and exits: its namespace (and the tmpfs in it) is gone.
        writeln!(child.stdin.take().unwrap()).unwrap();
        assert!(child.wait().unwrap().success());
        assert!(
            std::fs::read_dir(&dir).unwrap().next().is_none(),
            "the host sees the empty mountpoint"
        );
        // Resolved from the root, the path now leads to that empty mountpoint; the dir as
        // opened for the notice still holds the ack.
        assert!(ckpt.read_ack(pid).unwrap().is_none());
        let ack = ckpt
            .read_ack_after_exit(&ack_file_name(pid))
            .unwrap()
            .expect("the ack written before the exit");
        assert_eq!(ack.file.state, AckState::Done);
        assert_eq!(ack.file.step, Some(serde_json::json!(7)));
    }

    #[test]
    fn ack_names_plain_and_fallback() {
        assert_eq!(parse_ack_name("ack"), Some(AckName::Plain));
        assert_eq!(parse_ack_name("ack.x7-Q_1"), Some(AckName::Plain));
        assert_eq!(parse_ack_name("ack-42.json"), Some(AckName::Process(42)));
        assert_eq!(
            parse_ack_name("ack-42.k3v.json"),
            Some(AckName::Process(42))
        );
        for bad in [
            "ack.",
            "ack-.json",
            "ack-4x.json",
            "ack-42..json",
            "ack-42.a.b.json",
            "ack-42.json.tmp",
            ".ack-42.json",
            "ack.a/b",
            "ack-99999999999.json",
            "notice.json",
        ] {
            assert_eq!(parse_ack_name(bad), None, "{bad}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        for n in [
            "ack-7.json",
            "ack-7.r4nd.json",
            "ack",
            "ack.x1",
            "other",
            ".ack-7.json.tmp-1",
        ] {
            std::fs::write(tmp.path().join(n), b"{}").unwrap();
        }
        let mut listed = cd.fallback_acks().unwrap();
        listed.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            listed,
            vec![
                ("ack-7.r4nd.json".to_string(), AckName::Process(7)),
                ("ack.x1".to_string(), AckName::Plain)
            ]
        );
        // stamps cover the named files and every fallback name
        let stamps = cd.stamps(&["ack-7.json".to_string()]);
        assert_eq!(stamps.len(), 3);
    }

    #[test]
    fn foreign_files_at_ack_names_are_removed_before_the_signal() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        std::fs::write(tmp.path().join("ack-7.json"), b"{}").unwrap();
        std::fs::write(tmp.path().join("ack"), b"").unwrap();
        let me = std::fs::metadata(tmp.path().join("ack")).unwrap().uid();
        // Owned by an allowed uid: kept. Owned by someone else: removed.
        let found = cd.remove_foreign(&[
            ("ack-7.json".to_string(), vec![me + 1]),
            ("ack".to_string(), vec![me]),
            ("ack-8.json".to_string(), vec![me + 1]),
        ]);
        assert_eq!(
            found,
            vec![ForeignAck {
                name: "ack-7.json".into(),
                owner: me,
                removed: Ok(())
            }]
        );
        assert!(!tmp.path().join("ack-7.json").exists());
        assert!(tmp.path().join("ack").exists());
    }

    #[test]
    fn notice_round_trip_and_atomic_replace() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/ckpt");
        let cd = CheckpointDir::host(&dir).unwrap();
        assert_eq!(cd.read_notice().unwrap(), None);
        cd.write_notice(&notice()).unwrap();
        assert_eq!(cd.read_notice().unwrap(), Some(notice()));
        let mut second = notice();
        second.deadline_unix = None;
        cd.write_notice(&second).unwrap();
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
        assert_eq!(
            ack.stamp.size,
            std::fs::metadata(tmp.path().join("ack-7.json"))
                .unwrap()
                .len()
        );
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

    /// Issue 29 item 5: a hard link keeps its owner, so a file linked in from elsewhere never
    /// counts as an ack (nor as the plain ack, nor as `notice.json`); neither does a file every
    /// user may write.
    #[test]
    fn hard_linked_and_world_writable_files_are_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        let elsewhere = tmp.path().join("shared.log");
        std::fs::write(&elsewhere, r#"{"state":"done"}"#).unwrap();
        for name in ["ack-7.json", PLAIN_ACK_FILE, "ack.x", NOTICE_FILE] {
            std::fs::hard_link(&elsewhere, tmp.path().join(name)).unwrap();
        }
        let refused = |e: Error| match e {
            Error::RefusedAck { reason, .. } => reason,
            other => panic!("not refused: {other}"),
        };
        assert_eq!(refused(cd.read_ack(7).unwrap_err()), "has 5 hard links");
        assert!(refused(cd.plain_ack().unwrap_err()).contains("hard links"));
        assert!(refused(cd.plain_ack_named("ack.x").unwrap_err()).contains("hard links"));
        assert_eq!(cd.read_notice_stamped().unwrap(), None);
        std::fs::write(tmp.path().join("ack-8.json"), r#"{"state":"done"}"#).unwrap();
        std::fs::set_permissions(
            tmp.path().join("ack-8.json"),
            PermissionsExt::from_mode(0o666),
        )
        .unwrap();
        assert!(refused(cd.read_ack(8).unwrap_err()).contains("writable by every user"));
        // group-writable is the owner's choice (a shared group, fsGroup): it counts
        std::fs::set_permissions(
            tmp.path().join("ack-8.json"),
            PermissionsExt::from_mode(0o664),
        )
        .unwrap();
        assert!(cd.read_ack(8).unwrap().is_some());
    }

    #[test]
    fn a_notice_json_another_user_wrote_is_not_the_agents() {
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        cd.write_notice(&notice()).unwrap();
        assert_eq!(cd.read_notice().unwrap(), Some(notice()));
        std::os::unix::fs::chown(tmp.path().join(NOTICE_FILE), Some(1001), None).unwrap();
        assert_eq!(cd.read_notice().unwrap(), None);
    }

    #[test]
    fn rejects_relative_and_parent_dirs() {
        assert!(CheckpointDir::host(Path::new("rel/dir")).is_err());
        assert!(CheckpointDir::host(Path::new("/tmp/../etc")).is_err());
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        for bad in ["", "a/b", "..", "."] {
            assert!(cd.write_atomic(bad, b"x").is_err());
        }
    }

    #[test]
    fn created_dir_is_sticky_and_world_writable_and_never_chowned() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("made/here");
        let cd = CheckpointDir::host(&dir).unwrap();
        cd.write_notice(&notice()).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o1777));
        // intermediate components are not world-writable
        let parent = std::fs::metadata(tmp.path().join("made")).unwrap();
        assert_eq!(parent.mode() & 0o7777, 0o755);
        let file = std::fs::metadata(dir.join(NOTICE_FILE)).unwrap();
        assert_eq!(file.mode() & 0o777, 0o644);
        // an existing dir keeps its mode
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        cd.write_notice(&notice()).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o700);
    }

    #[test]
    fn acks_through_symlinks_are_refused_and_stamps_change_on_rewrite() {
        let tmp = tempfile::tempdir().unwrap();
        let cd = CheckpointDir::host(tmp.path()).unwrap();
        let elsewhere = tmp.path().join("elsewhere.json");
        std::fs::write(&elsewhere, r#"{"state":"done"}"#).unwrap();
        std::os::unix::fs::symlink(&elsewhere, tmp.path().join("ack-5.json")).unwrap();
        let err = cd.read_ack(5).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
        std::os::unix::fs::symlink(&elsewhere, tmp.path().join(PLAIN_ACK_FILE)).unwrap();
        assert!(cd.plain_ack().is_err());

        let names = vec![ack_file_name(6)];
        assert!(cd.stamps(&names).is_empty());
        std::fs::write(tmp.path().join("ack-6.json"), r#"{"state":"received"}"#).unwrap();
        let before = cd.stamps(&names)[&names[0]];
        assert_eq!(cd.read_ack(6).unwrap().unwrap().stamp, before);
        // an atomic replace (new inode) changes the stamp even within one clock tick
        let tmpfile = tmp.path().join(".ack-6.tmp");
        std::fs::write(&tmpfile, r#"{"state":"done"}"#).unwrap();
        std::fs::rename(&tmpfile, tmp.path().join("ack-6.json")).unwrap();
        assert_ne!(cd.read_ack(6).unwrap().unwrap().stamp, before);
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
            display: "test".into(),
            at: At::Here(LocalDir {
                root: ProcessRoot::of_dir(&root).unwrap(),
                rel: PathBuf::from("tmp/sg"),
                display: "test".into(),
                kept: std::sync::OnceLock::new(),
            }),
        };
        assert!(cd.write_notice(&notice()).is_err());
        assert_eq!(std::fs::read_dir(&host_target).unwrap().count(), 0);
        // the symlink target created inside the root: now the write lands there
        let inside = root.join(host_target.strip_prefix("/").unwrap());
        std::fs::create_dir_all(&inside).unwrap();
        cd.write_notice(&notice()).unwrap();
        assert!(inside.join(NOTICE_FILE).exists());
        assert_eq!(std::fs::read_dir(&host_target).unwrap().count(), 0);
    }

    #[test]
    fn magic_links_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/proc/self/cwd", tmp.path().join("magic")).unwrap();
        let cd = CheckpointDir::host(&tmp.path().join("magic")).unwrap();
        let err = cd.write_notice(&notice()).unwrap_err();
        assert!(
            matches!(&err, Error::WriteNotice { source, .. } if source.raw_os_error() == Some(libc::ELOOP)),
            "{err}"
        );
    }
}
