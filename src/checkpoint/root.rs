//! A process's filesystem root, and every path the agent opens below it or below a directory it
//! holds, resolved with `openat2`: the one implementation the checkpoint dir ([`super::ack`]),
//! staged checkpoint trees (`upload::staged`) and directory targets (`upload::target`) share.
//!
//! A pod controls everything under its root: a path there is resolved with `RESOLVE_IN_ROOT`
//! (absolute symlinks and `..` stay inside the pod's root, never reach the host's) and
//! `RESOLVE_NO_MAGICLINKS` (`/proc/self/root`-style links are refused); [`Symlinks::Refuse`] adds
//! `RESOLVE_NO_SYMLINKS` where no symlink is accepted at all. An entry of a directory already
//! open is resolved with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` and
//! `O_NOFOLLOW`, plus `RESOLVE_NO_XDEV` for [`open_entry`] (a plain entry of the dir itself, never
//! on another mount). Every descriptor is opened `O_CLOEXEC`.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};

use super::procfs::ProcFs;

/// A path below a root: inside it, magic links refused; symlinks per [`Symlinks`].
const IN_ROOT: ResolveFlags = ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS);
/// An entry below a directory held open: never through a symlink, never a magic link.
const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);
/// An entry of a directory held open, on the directory's own mount.
const ENTRY: ResolveFlags = BENEATH.union(ResolveFlags::NO_XDEV);

/// Whether a path resolved in a root may go through symlinks (resolved inside that root).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Symlinks {
    /// Followed, inside the root: a checkpoint dir a pod reaches through a link of its own.
    InRoot,
    /// Refused (`ELOOP`): a staged tree is named by its real path.
    Refuse,
}

/// Why an absolute path has no form relative to a root.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotRelative {
    #[error("is not absolute")]
    NotAbsolute,
    #[error("contains `..`")]
    Parent,
}

/// `path` (absolute) relative to a root: `.` for the root itself; `..` is refused.
pub fn relative(path: &Path) -> Result<PathBuf, NotRelative> {
    if !path.is_absolute() {
        return Err(NotRelative::NotAbsolute);
    }
    let mut rel = PathBuf::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => rel.push(n),
            Component::ParentDir | Component::Prefix(_) => return Err(NotRelative::Parent),
        }
    }
    if rel.as_os_str().is_empty() {
        rel.push(".");
    }
    Ok(rel)
}

/// Why the root of a process could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum RootError {
    /// `<proc>/<pid>/root` could not be opened.
    #[error("{0}")]
    Open(#[source] rustix::io::Errno),
    /// What the caller read of the process besides its root failed.
    #[error("{0}")]
    Read(String),
    /// The PID now names another process, or none.
    #[error("pid {0} exited")]
    Exited(i32),
    /// Whether the process is still the one meant could not be read.
    #[error("{0}")]
    Alive(String),
}

/// The filesystem root a process sees, held open (`O_PATH`): the descriptor stays valid after
/// the process exits.
#[derive(Debug)]
pub struct ProcessRoot {
    fd: OwnedFd,
    /// `<proc>/<pid>/root`; `None` for this process's own `/`.
    path: Option<PathBuf>,
}

impl ProcessRoot {
    fn open_dir(path: &Path) -> rustix::io::Result<OwnedFd> {
        rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
    }

    /// `/`, as this process sees it (host groups, the CLI).
    pub fn host() -> io::Result<ProcessRoot> {
        Ok(ProcessRoot {
            fd: Self::open_dir(Path::new("/"))?,
            path: None,
        })
    }

    /// A directory taken as a root, as a process chrooted there sees it.
    #[cfg(test)]
    pub(crate) fn of_dir(dir: &Path) -> io::Result<ProcessRoot> {
        Ok(ProcessRoot {
            fd: Self::open_dir(dir)?,
            path: Some(dir.to_path_buf()),
        })
    }

    /// The root of process `pid` (`<proc>/<pid>/root`), with what `also` reads of the process
    /// (its uid, say). The start time is checked after both, so the root and what was read
    /// belong to that very process and not to a successor with a recycled PID.
    pub fn of_process<T>(
        proc: &ProcFs,
        pid: i32,
        start_time: u64,
        also: impl FnOnce() -> Result<T, String>,
    ) -> Result<(ProcessRoot, T), RootError> {
        let path = proc.path(pid, "root");
        let fd = Self::open_dir(&path).map_err(RootError::Open)?;
        let read = also().map_err(RootError::Read)?;
        match proc.alive(pid, start_time) {
            Ok(true) => Ok((
                ProcessRoot {
                    fd,
                    path: Some(path),
                },
                read,
            )),
            Ok(false) => Err(RootError::Exited(pid)),
            Err(e) => Err(RootError::Alive(e.to_string())),
        }
    }

    /// How `path` below the root of `pid` is named in errors and logs:
    /// `/tmp/spotguard in /proc/1234/root`.
    pub fn show_in(proc: &ProcFs, pid: i32, path: &Path) -> String {
        format!("{} in {}", path.display(), proc.path(pid, "root").display())
    }

    /// How `path` below this root is named in errors and logs (a host path as it is).
    pub fn show(&self, path: &Path) -> String {
        match &self.path {
            Some(root) => format!("{} in {}", path.display(), root.display()),
            None => path.display().to_string(),
        }
    }

    /// Open `rel` (see [`relative`]) below the root, resolved inside it.
    pub fn open(
        &self,
        rel: &Path,
        flags: OFlags,
        symlinks: Symlinks,
    ) -> rustix::io::Result<OwnedFd> {
        let resolve = match symlinks {
            Symlinks::InRoot => IN_ROOT,
            Symlinks::Refuse => IN_ROOT.union(ResolveFlags::NO_SYMLINKS),
        };
        rustix::fs::openat2(
            &self.fd,
            rel,
            flags | OFlags::CLOEXEC,
            Mode::empty(),
            resolve,
        )
    }

    /// Whether this root is the same directory as this process's `/` (host-mode trainers that
    /// share the host's filesystem).
    pub fn is_host_root(&self) -> bool {
        let ours = rustix::fs::stat("/");
        let theirs = rustix::fs::fstat(&self.fd);
        matches!((ours, theirs), (Ok(a), Ok(b)) if a.st_dev == b.st_dev && a.st_ino == b.st_ino)
    }
}

impl AsFd for ProcessRoot {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Open `name`, an entry of the directory `dir` itself: never through a symlink (`ELOOP`),
/// never on another mount (`EXDEV`).
pub fn open_entry(dir: &impl AsFd, name: &str, flags: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        dir,
        name,
        flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ENTRY,
    )
}

/// Open `name` below the directory `dir`, never through a symlink; mounts may be crossed.
pub fn open_beneath<P: rustix::path::Arg>(
    dir: &impl AsFd,
    name: P,
    flags: OFlags,
) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat2(
        dir,
        name,
        flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        BENEATH,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_refuse_parents_and_relative_input() {
        assert_eq!(relative(Path::new("/")).unwrap(), Path::new("."));
        assert_eq!(relative(Path::new("/a/./b")).unwrap(), Path::new("a/b"));
        assert_eq!(relative(Path::new("a/b")), Err(NotRelative::NotAbsolute));
        assert_eq!(relative(Path::new("/a/../b")), Err(NotRelative::Parent));
    }
}
