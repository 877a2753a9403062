//! Capturing a staged checkpoint: the directory a trainer wrote to local disk and acked, walked
//! and opened while the trainer is still alive, so that the upload never depends on its mount
//! namespace, its container or even the files' names surviving (an open descriptor keeps an
//! inode readable after the container's emptyDir bind mount is gone, and after the kubelet has
//! deleted the volume).
//!
//! Everything in the tree is hostile input. The staged path is resolved inside the trainer's
//! root (`/proc/<pid>/root`, or `/` for the CLI) with `openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`; every entry below it with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV` and `O_NOFOLLOW`. Only regular
//! files and directories are accepted: a symlink, FIFO, socket or device anywhere in the tree,
//! another mount inside it, a name that is not a safe object key, more files, bytes or depth than
//! the [`Limits`], or (when an owner is required) an entry owned by another uid refuses the
//! whole tree with an [`Error::Staged`] naming the entry. Entries are `lstat`ed before they are
//! opened (so a FIFO or device is never opened) and `fstat`ed after (same inode, still a regular
//! file), and opened with `O_NONBLOCK | O_NOCTTY`. Each file's identity (device, inode, size,
//! mtime, ctime) is kept; the upload compares it again after reading ([`FileId::check`]), so a
//! file that grows, shrinks or is rewritten during the upload fails it.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::{AtFlags, FileType, OFlags};
use serde::{Deserialize, Serialize};

use super::Error;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::root::{self, ProcessRoot, Symlinks};

pub use crate::store::manifest::MANIFEST_NAME;

/// Why a staged tree was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Problem {
    /// The staged path does not exist (in the trainer's root).
    Missing,
    /// The staged path is not a directory.
    NotADirectory,
    /// A symlink in the path or in the tree.
    Symlink,
    /// A FIFO, socket or device node in the tree.
    Special,
    /// Another filesystem mounted inside the tree.
    Mount,
    /// An entry owned by another uid than the acking process's.
    Owner,
    /// A name that is not UTF-8, holds control characters or is reserved.
    Name,
    /// More files than allowed.
    TooMany,
    /// More bytes than allowed.
    TooLarge,
    /// Nested deeper than allowed.
    TooDeep,
    /// More files than the owner's share of the agent's descriptor budget.
    Budget,
    /// The agent cannot open or read an entry (permissions, I/O).
    Unreadable,
    /// The acking process is gone (its root cannot be opened any more).
    Gone,
}

impl Problem {
    /// Label for `spotguard_checkpoint_upload_errors_total{error}`.
    pub fn metric_label(self) -> &'static str {
        match self {
            Problem::Missing => "staged_missing",
            Problem::NotADirectory => "staged_not_a_directory",
            Problem::Symlink => "staged_symlink",
            Problem::Special => "staged_special_file",
            Problem::Mount => "staged_mount",
            Problem::Owner => "staged_owner",
            Problem::Name => "staged_name",
            Problem::TooMany => "staged_too_many_files",
            Problem::TooLarge => "staged_too_large",
            Problem::TooDeep => "staged_too_deep",
            Problem::Budget => "staged_budget",
            Problem::Unreadable => "staged_unreadable",
            Problem::Gone => "staged_process_gone",
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Problem::Missing => "does not exist",
            Problem::NotADirectory => "not a directory",
            Problem::Symlink => "symlink (refused)",
            Problem::Special => "special file (refused)",
            Problem::Mount => "another mount inside the tree (refused)",
            Problem::Owner => "owned by another user (refused)",
            Problem::Name => "unusable name",
            Problem::TooMany => "too many files",
            Problem::TooLarge => "too large",
            Problem::TooDeep => "nested too deep",
            Problem::Unreadable => "cannot be read",
            Problem::Gone => "the acking process is gone",
            Problem::Budget => "over the node's upload budget (refused)",
        })
    }
}

pub use crate::store::tree::Limits;

/// What identifies a file's content as captured: if any of it differs after the upload read the
/// file, the file changed under the upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
    pub size: u64,
    /// Last modification, nanoseconds since the epoch.
    pub mtime_ns: i128,
    /// Last status change (writers cannot set it), nanoseconds since the epoch.
    pub ctime_ns: i128,
    /// Hard links: an unlink (the kubelet removing a pod's emptyDir) changes the ctime too.
    #[serde(default)]
    pub nlink: u64,
}

impl FileId {
    pub(crate) fn of(st: &rustix::fs::Stat) -> FileId {
        let ns = |s: i64, n: i64| i128::from(s) * 1_000_000_000 + i128::from(n);
        FileId {
            dev: st.st_dev,
            ino: st.st_ino,
            size: u64::try_from(st.st_size).unwrap_or(0),
            #[allow(clippy::unnecessary_cast)]
            mtime_ns: ns(st.st_mtime as i64, st.st_mtime_nsec as i64),
            #[allow(clippy::unnecessary_cast)]
            ctime_ns: ns(st.st_ctime as i64, st.st_ctime_nsec as i64),
            #[allow(clippy::useless_conversion)]
            nlink: u64::from(st.st_nlink),
        }
    }

    /// `Ok` when `file` is still what was captured (same size and mtime; same ctime unless its
    /// link count changed: its name may be gone, its content is not); else [`Error::Changed`].
    pub fn check(&self, file: &File, path: &str) -> Result<(), Error> {
        let now = rustix::fs::fstat(file).map_err(|e| Error::io("fstat", path)(e.into()))?;
        let now = FileId::of(&now);
        let what = if now.size != self.size {
            format!("size {} → {} bytes", self.size, now.size)
        } else if now.mtime_ns != self.mtime_ns
            || (now.nlink == self.nlink && now.ctime_ns != self.ctime_ns)
        {
            "rewritten".to_string()
        } else {
            return Ok(());
        };
        Err(Error::Changed {
            path: path.to_string(),
            what,
        })
    }
}

/// One captured file: its path relative to the staged directory (`/`-separated, a valid object
/// key), the open file and its identity.
#[derive(Clone, Debug)]
pub struct StagedFile {
    pub path: String,
    pub file: Arc<File>,
    pub id: FileId,
    /// Its descriptor in the agent's budget ([`super::budget`]): back when the last clone of
    /// the file is dropped. `None` outside the agent (the CLI).
    _held: Option<Arc<super::budget::Held>>,
}

/// A captured staged checkpoint: every regular file of the tree, open.
#[derive(Debug)]
pub struct StagedTree {
    /// The staged directory as the trainer named it (logs, the manifest).
    pub dir: PathBuf,
    /// Where it was found, for errors: `/ckpt/step-100 in /proc/1234/root`.
    pub display: String,
    /// Sorted by path.
    pub files: Vec<StagedFile>,
    pub bytes: u64,
    /// The uid every entry had to belong to, when one was required.
    pub owner: Option<u32>,
}

/// The filesystem root a staged path is resolved in.
#[derive(Debug)]
pub struct Root {
    root: ProcessRoot,
    /// The uid every entry must belong to: the acking process's (0 for a root trainer); `None`
    /// only for the CLI's own `/`, where the invoking user's permissions apply.
    pub uid: Option<u32>,
}

impl Root {
    /// `/`, as this process sees it; no owner is required (the CLI: the invoking user's own
    /// permissions apply).
    pub fn host() -> Result<Root, Error> {
        let root = ProcessRoot::host().map_err(Error::io("open", "/"))?;
        Ok(Root { root, uid: None })
    }

    /// The root of process `pid` (`<proc>/<pid>/root`), whose entries must all belong to the
    /// process's real uid, root's (uid 0) like anyone's. The start time is checked after the root and the uid
    /// were read, so both belong to that very process and not to a successor with a recycled PID.
    pub fn of_process(proc: &ProcFs, pid: i32, start_time: u64) -> Result<Root, Error> {
        let status = || proc.status(pid).map_err(|e| e.to_string());
        let (root, status) =
            ProcessRoot::of_process(proc, pid, start_time, status).map_err(|e| Error::Staged {
                path: proc.path(pid, "root").display().to_string(),
                problem: Problem::Gone,
                detail: e.to_string(),
            })?;
        Ok(Root {
            root,
            uid: Some(status.uid),
        })
    }

    /// Whether this root is the same directory as this process's `/` (host-mode trainers that
    /// share the host's filesystem: their staged tree outlives them).
    pub fn is_host_root(&self) -> bool {
        self.root.is_host_root()
    }
}

/// A name usable as an object key segment and as a file name on the way back.
fn valid_name(name: &str) -> Result<(), &'static str> {
    if name.chars().any(|c| c.is_control()) {
        return Err("control characters");
    }
    if name.contains(crate::store::PART_INFIX) {
        return Err("spotguard's part-file infix");
    }
    Ok(())
}

struct Walk<'a> {
    tree: StagedTree,
    limits: &'a Limits,
    /// The agent's descriptor budget and who this tree's files are charged to.
    budget: Option<(Arc<super::budget::Budget>, super::budget::Owner)>,
}

impl Walk<'_> {
    fn refuse(&self, rel: &str, problem: Problem, detail: impl Into<String>) -> Error {
        let path = if rel.is_empty() {
            self.tree.display.clone()
        } else {
            format!("{}/{rel}", self.tree.dir.display())
        };
        Error::Staged {
            path,
            problem,
            detail: detail.into(),
        }
    }

    fn check_owner(&self, rel: &str, st: &rustix::fs::Stat) -> Result<(), Error> {
        match self.tree.owner {
            Some(uid) if st.st_uid != uid => Err(self.refuse(
                rel,
                Problem::Owner,
                format!(
                    "owned by uid {}, the acking process runs as uid {uid}",
                    st.st_uid
                ),
            )),
            _ => Ok(()),
        }
    }

    fn open_entry(&self, dir: &OwnedFd, name: &str, flags: OFlags) -> rustix::io::Result<OwnedFd> {
        root::open_entry(dir, name, flags | OFlags::RDONLY | OFlags::NOCTTY)
    }

    fn open_error(&self, rel: &str, e: rustix::io::Errno) -> Error {
        match e {
            rustix::io::Errno::LOOP => self.refuse(rel, Problem::Symlink, "replaced by a symlink"),
            rustix::io::Errno::XDEV => self.refuse(rel, Problem::Mount, "a mount point"),
            rustix::io::Errno::MFILE | rustix::io::Errno::NFILE => self.refuse(
                rel,
                Problem::TooMany,
                "out of file descriptors (raise the agent's RLIMIT_NOFILE or lower --upload-max-files)",
            ),
            e => self.refuse(rel, Problem::Unreadable, e.to_string()),
        }
    }

    /// Visit the directory `dir` (at `prefix`, `depth` levels down).
    fn dir(&mut self, dir: OwnedFd, prefix: &str, depth: usize) -> Result<(), Error> {
        let mut names = Vec::new();
        let mut reader = rustix::fs::Dir::read_from(&dir)
            .map_err(|e| self.refuse(prefix, Problem::Unreadable, e.to_string()))?;
        for entry in reader.by_ref() {
            let entry =
                entry.map_err(|e| self.refuse(prefix, Problem::Unreadable, e.to_string()))?;
            let bytes = entry.file_name().to_bytes();
            if bytes == b"." || bytes == b".." {
                continue;
            }
            let shown = String::from_utf8_lossy(bytes).into_owned();
            let Ok(name) = std::str::from_utf8(bytes) else {
                return Err(self.refuse(&join(prefix, &shown), Problem::Name, "not UTF-8"));
            };
            names.push(name.to_string());
        }
        drop(reader);
        names.sort();
        for name in names {
            let rel = join(prefix, &name);
            if let Err(why) = valid_name(&name) {
                return Err(self.refuse(&rel, Problem::Name, why));
            }
            if depth == 0 && super::manifest::is_reserved(&name) {
                return Err(self.refuse(
                    &rel,
                    Problem::Name,
                    "manifest.json and manifest.part-* at the top are the upload's commit markers",
                ));
            }
            let st = rustix::fs::statat(&dir, name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| self.refuse(&rel, Problem::Unreadable, e.to_string()))?;
            match FileType::from_raw_mode(st.st_mode) {
                FileType::Directory => {
                    self.check_owner(&rel, &st)?;
                    if depth + 1 > self.limits.max_depth {
                        return Err(self.refuse(
                            &rel,
                            Problem::TooDeep,
                            format!("more than {} levels", self.limits.max_depth),
                        ));
                    }
                    let fd = self
                        .open_entry(&dir, &name, OFlags::DIRECTORY)
                        .map_err(|e| self.open_error(&rel, e))?;
                    let again = rustix::fs::fstat(&fd)
                        .map_err(|e| self.refuse(&rel, Problem::Unreadable, e.to_string()))?;
                    if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
                        return Err(self.refuse(&rel, Problem::Unreadable, "replaced while read"));
                    }
                    self.dir(fd, &rel, depth + 1)?;
                }
                FileType::RegularFile => self.file(&dir, &name, &rel, &st)?,
                FileType::Symlink => {
                    return Err(self.refuse(&rel, Problem::Symlink, "symlinks are never followed"))
                }
                other => {
                    return Err(self.refuse(
                        &rel,
                        Problem::Special,
                        format!("{other:?}; only regular files and directories are uploaded"),
                    ))
                }
            }
        }
        Ok(())
    }

    fn file(
        &mut self,
        dir: &OwnedFd,
        name: &str,
        rel: &str,
        st: &rustix::fs::Stat,
    ) -> Result<(), Error> {
        self.check_owner(rel, st)?;
        if self.tree.files.len() >= self.limits.max_files {
            return Err(self.refuse(
                rel,
                Problem::TooMany,
                format!("more than {} files", self.limits.max_files),
            ));
        }
        // The descriptor is charged before it is opened: a tree over its owner's share is
        // refused here, before the trainer is answered, and never takes what others need.
        let held = match &self.budget {
            Some((budget, owner)) => {
                Some(Arc::new(budget.take(owner).map_err(|r| {
                    self.refuse(rel, Problem::Budget, r.to_string())
                })?))
            }
            None => None,
        };
        let fd = self
            .open_entry(dir, name, OFlags::NONBLOCK)
            .map_err(|e| self.open_error(rel, e))?;
        let now = rustix::fs::fstat(&fd)
            .map_err(|e| self.refuse(rel, Problem::Unreadable, e.to_string()))?;
        if FileType::from_raw_mode(now.st_mode) != FileType::RegularFile
            || (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)
        {
            return Err(self.refuse(rel, Problem::Special, "replaced while read"));
        }
        self.check_owner(rel, &now)?;
        let id = FileId::of(&now);
        self.tree.bytes = self.tree.bytes.saturating_add(id.size);
        if self.tree.bytes > self.limits.max_bytes {
            return Err(self.refuse(
                rel,
                Problem::TooLarge,
                format!("the tree holds more than {} bytes", self.limits.max_bytes),
            ));
        }
        crate::store::validate_key(rel)
            .map_err(|e| self.refuse(rel, Problem::Name, e.to_string()))?;
        self.tree.files.push(StagedFile {
            path: rel.to_string(),
            file: Arc::new(File::from(fd)),
            id,
            _held: held,
        });
        Ok(())
    }
}

fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}/{name}")
    }
}

/// Capture the staged directory `staged` (absolute, as the trainer sees it) inside `root`.
/// Blocking (directory reads, opens): run it off the async runtime. Nothing is read yet: the
/// returned tree holds every file open.
pub fn capture(root: &Root, staged: &Path, limits: &Limits) -> Result<StagedTree, Error> {
    let budget = super::budget::node().map(|b| (b, budget_owner(root)));
    capture_in(root, staged, limits, budget)
}

/// [`capture`], charging each file to `budget` (the budget and the owner).
fn capture_in(
    root: &Root,
    staged: &Path,
    limits: &Limits,
    budget: Option<(Arc<super::budget::Budget>, super::budget::Owner)>,
) -> Result<StagedTree, Error> {
    let display = root.root.show(staged);
    let refuse = |problem, detail: String| Error::Staged {
        path: display.clone(),
        problem,
        detail,
    };
    let rel = root::relative(staged).map_err(|_| {
        refuse(
            Problem::Name,
            "must be an absolute path without `..`".to_string(),
        )
    })?;
    let top = root
        .root
        .open(
            &rel,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
            Symlinks::Refuse,
        )
        .map_err(|e| match e {
            rustix::io::Errno::NOENT => refuse(Problem::Missing, e.to_string()),
            rustix::io::Errno::NOTDIR if is_symlink_in_root(root, &rel) => refuse(
                Problem::Symlink,
                "the path is a symlink; name the real path (os.path.realpath)".to_string(),
            ),
            rustix::io::Errno::NOTDIR => refuse(Problem::NotADirectory, e.to_string()),
            rustix::io::Errno::LOOP => refuse(
                Problem::Symlink,
                "the path goes through a symlink; name the real path (os.path.realpath)"
                    .to_string(),
            ),
            e => refuse(Problem::Unreadable, e.to_string()),
        })?;
    let st = rustix::fs::fstat(&top).map_err(|e| refuse(Problem::Unreadable, e.to_string()))?;
    let mut walk = Walk {
        tree: StagedTree {
            dir: staged.to_path_buf(),
            display: display.clone(),
            files: Vec::new(),
            bytes: 0,
            owner: root.uid,
        },
        limits,
        budget,
    };
    walk.check_owner("", &st)?;
    walk.dir(top, "", 0)?;
    Ok(walk.tree)
}

/// Who a tree taken in `root` is charged to: the trainer's uid on the host's own filesystem,
/// else its container's filesystem root.
fn budget_owner(root: &Root) -> super::budget::Owner {
    if root.is_host_root() {
        return super::budget::Owner::Uid(root.uid.unwrap_or(0));
    }
    match rustix::fs::fstat(&root.root) {
        Ok(st) => super::budget::Owner::Root {
            dev: st.st_dev,
            ino: st.st_ino,
        },
        Err(_) => super::budget::Owner::Uid(root.uid.unwrap_or(0)),
    }
}

/// Whether `rel` names a symlink itself (`O_DIRECTORY | O_NOFOLLOW` on one fails `ENOTDIR`).
fn is_symlink_in_root(root: &Root, rel: &Path) -> bool {
    root.root
        .open(rel, OFlags::PATH | OFlags::NOFOLLOW, Symlinks::Refuse)
        .and_then(|fd| rustix::fs::fstat(&fd))
        .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink)
}

/// Raise this process's soft limit on open files to its hard limit (a captured tree holds one
/// descriptor per file). Best effort.
pub fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        lim.current = lim.maximum;
        let _ = setrlimit(Resource::Nofile, lim);
    }
}

/// A borrowed view for callers that only need the descriptor (tests).
impl AsFd for Root {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::Mode;
    use std::os::unix::fs::symlink;

    fn tree(files: &[(&str, &[u8])]) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        for (p, data) in files {
            let path = tmp.path().join(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, data).unwrap();
        }
        tmp
    }

    fn problem(r: Result<StagedTree, Error>) -> Problem {
        match r {
            Err(Error::Staged { problem, .. }) => problem,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn captures_regular_files_sorted_with_their_identity() {
        let t = tree(&[("b/x.bin", b"xx"), ("a.bin", b"a"), (".metadata", b"meta")]);
        let got = capture(&Root::host().unwrap(), t.path(), &Limits::default()).unwrap();
        let paths: Vec<&str> = got.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(paths, [".metadata", "a.bin", "b/x.bin"]);
        assert_eq!(got.bytes, 7);
        assert_eq!(got.files[2].id.size, 2);
        // The descriptors stay usable after the names are gone.
        std::fs::remove_dir_all(t.path()).unwrap();
        let mut s = String::new();
        use std::io::Read;
        (&*got.files[0].file).read_to_string(&mut s).unwrap();
        assert_eq!(s, "meta");
    }

    #[test]
    fn symlinks_fifos_mounts_and_reserved_names_are_refused() {
        let t = tree(&[("ok.bin", b"1")]);
        symlink("/etc/passwd", t.path().join("passwd")).unwrap();
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                t.path(),
                &Limits::default()
            )),
            Problem::Symlink
        );

        let t = tree(&[("ok.bin", b"1")]);
        rustix::fs::mknodat(
            rustix::fs::CWD,
            t.path().join("pipe"),
            FileType::Fifo,
            Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                t.path(),
                &Limits::default()
            )),
            Problem::Special
        );

        let t = tree(&[("manifest.json", b"{}")]);
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                t.path(),
                &Limits::default()
            )),
            Problem::Name
        );
        // Below the top it is an ordinary name.
        let t = tree(&[("sub/manifest.json", b"{}")]);
        assert!(capture(&Root::host().unwrap(), t.path(), &Limits::default()).is_ok());

        // The staged path itself through a symlink.
        let t = tree(&[("real/a", b"1")]);
        symlink(t.path().join("real"), t.path().join("link")).unwrap();
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                &t.path().join("link"),
                &Limits::default()
            )),
            Problem::Symlink
        );
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                &t.path().join("nope"),
                &Limits::default()
            )),
            Problem::Missing
        );
        assert_eq!(
            problem(capture(
                &Root::host().unwrap(),
                &t.path().join("real/a"),
                &Limits::default()
            )),
            Problem::NotADirectory
        );
    }

    /// Issue 29 item 6: a tree over its owner's share of the descriptor budget is refused while
    /// it is captured, naming the budget; its descriptors return when the tree is dropped.
    #[test]
    fn a_tree_over_the_owners_share_of_the_budget_is_refused() {
        use super::super::budget::{Budget, Owner};
        let t = tree(&[("a", b"1"), ("b", b"2"), ("c", b"3")]);
        let budget = Budget::new(8, 264);
        let (one, two) = (Owner::Uid(1000), Owner::Uid(1001));
        let take = |owner: &Owner| {
            capture_in(
                &Root::host().unwrap(),
                t.path(),
                &Limits::default(),
                Some((budget.clone(), owner.clone())),
            )
        };
        // Alone, uid 1000 may hold 8 / 2 = 4: one tree of 3 fits, a second does not.
        let first = take(&one).unwrap();
        assert_eq!(budget.held_by(&one), 3);
        let err = take(&one).unwrap_err();
        assert!(
            err.to_string().contains("upload descriptor budget"),
            "{err}"
        );
        assert_eq!(problem(Err(err)), Problem::Budget);
        assert_eq!(
            budget.held_by(&one),
            3,
            "the refused tree's descriptors came back"
        );
        // uid 1001 gets a share of its own (8 / 3 = 2): its tree of 3 is refused too, but not
        // because uid 1000 took everything.
        let err = take(&two).unwrap_err().to_string();
        assert!(err.contains("holds 2 of its share of 2"), "{err}");
        drop(first);
        assert_eq!(budget.held_by(&one), 0);
        assert!(take(&two).is_ok());
    }

    #[test]
    fn limits_bound_files_bytes_and_depth() {
        let t = tree(&[("a", b"12345"), ("b", b"12345"), ("c/d/e", b"1")]);
        let small = |f: fn(&mut Limits)| {
            let mut l = Limits::default();
            f(&mut l);
            problem(capture(&Root::host().unwrap(), t.path(), &l))
        };
        assert_eq!(small(|l| l.max_files = 2), Problem::TooMany);
        assert_eq!(small(|l| l.max_bytes = 9), Problem::TooLarge);
        assert_eq!(small(|l| l.max_depth = 1), Problem::TooDeep);
        let l = Limits {
            max_depth: 2,
            ..Limits::default()
        };
        assert!(capture(&Root::host().unwrap(), t.path(), &l).is_ok());
    }

    #[test]
    fn a_changed_file_is_detected() {
        let t = tree(&[("a", b"12345")]);
        let got = capture(&Root::host().unwrap(), t.path(), &Limits::default()).unwrap();
        let f = &got.files[0];
        f.id.check(&f.file, "a").unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(t.path().join("a"))
            .unwrap();
        f.id.check(&f.file, "a").unwrap();
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(t.path().join("a"))
            .unwrap()
            .write_all(b"more")
            .unwrap();
        assert!(matches!(
            f.id.check(&f.file, "a"),
            Err(Error::Changed { .. })
        ));
    }
}
