//! Small filesystem helpers shared by every module that publishes files: the project's one
//! atomic write (temp file in the same directory → write → sync → rename), and the one test of
//! a full volume.

use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;

use rustix::fs::{AtFlags, Mode, OFlags};

/// What an atomic write makes durable before it returns. Readers always see the old content or
/// the new, never a partial file; this only says what survives a crash of the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Nothing: for records rewritten often whose loss is harmless (a prefetch claim's renewal),
    /// and for what the signal path writes before the signal (`notice.json` in the checkpoint
    /// dir, the local record's list of targets): meaningless after a crash of the machine, and
    /// an fsync there would make the signal wait on other writers' dirty data.
    None,
    /// The file's content (fsync before the rename); the rename itself may be lost. For files
    /// whose loss in a crash is harmless but whose content must never be half there.
    File,
    /// The content and the rename (fsync of the file, then of the directory).
    FileAndDir,
}

/// The write failed because its volume is full: `ENOSPC`, or a quota (`EDQUOT`).
pub fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || matches!(
            e.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
        )
}

/// Write `data` to `path` atomically and durably ([`Durability::FileAndDir`]), creating the
/// parent directory if needed.
pub fn write_atomic(path: &Path, data: &[u8], mode: u32) -> io::Result<()> {
    write_atomic_with(path, data, mode, Durability::FileAndDir)
}

/// [`write_atomic`] with the durability chosen by the caller.
pub fn write_atomic_with(
    path: &Path,
    data: &[u8],
    mode: u32,
    durability: Durability,
) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "path has no UTF-8 file name")
    })?;
    let dir = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    write_atomic_at(dir.as_fd(), name, data, mode, durability)
}

/// Write `name` inside the open directory `dir` atomically: a temp file created exclusively
/// (`O_EXCL | O_NOFOLLOW`, so neither a planted file nor a symlink is written through), given
/// exactly `mode` (no umask), synced as `durability` says, then renamed over `name`. The temp
/// name starts with a dot; a failed write removes it. `name` must be one path component.
pub fn write_atomic_at(
    dir: BorrowedFd<'_>,
    name: &str,
    data: &[u8],
    mode: u32,
    durability: Durability,
) -> io::Result<()> {
    let file = AtomicFile::create(dir, name, mode)?;
    (&*file).write_all(data)?;
    file.commit(durability)
}

/// A file written under a temporary name in an open directory and renamed over its final name
/// by [`AtomicFile::commit`]: the one atomic write, for content that is streamed (positioned
/// writes of a large file) rather than held in one buffer ([`write_atomic_at`] is this with a
/// single write). Dropped without a commit, the temporary file is removed.
#[derive(Debug)]
pub struct AtomicFile<D: AsFd> {
    dir: D,
    tmp: String,
    name: String,
    file: std::fs::File,
}

impl<D: AsFd> AtomicFile<D> {
    /// Create the temp file for `name` in `dir` (see [`write_atomic_at`] for how).
    pub fn create(dir: D, name: &str, mode: u32) -> io::Result<Self> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad file name"));
        }
        let tmp = format!(
            ".{name}.tmp-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let fd = rustix::fs::openat(
            dir.as_fd(),
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        let this = AtomicFile {
            dir,
            tmp,
            name: name.to_string(),
            file: std::fs::File::from(fd),
        };
        // On error `this` is dropped and the temp file removed.
        rustix::fs::fchmod(&this.file, Mode::from_raw_mode(mode))?;
        Ok(this)
    }

    /// Sync as `durability` says, then rename over the final name.
    pub fn commit(mut self, durability: Durability) -> io::Result<()> {
        let result = (|| -> io::Result<()> {
            if durability != Durability::None {
                self.file.sync_all()?;
            }
            rustix::fs::renameat(
                self.dir.as_fd(),
                self.tmp.as_str(),
                self.dir.as_fd(),
                self.name.as_str(),
            )?;
            if durability == Durability::FileAndDir {
                // The rename is durable only once the directory is: its error (EIO) is the
                // write's. A filesystem that cannot sync a directory at all (EINVAL) has nothing
                // to make durable this way.
                match rustix::fs::fsync(self.dir.as_fd()) {
                    Err(e) if e != rustix::io::Errno::INVAL => return Err(e.into()),
                    _ => {}
                }
            }
            Ok(())
        })();
        if result.is_err() {
            let _ = rustix::fs::unlinkat(self.dir.as_fd(), self.tmp.as_str(), AtFlags::empty());
        }
        // Renamed or removed: nothing left for Drop.
        self.tmp.clear();
        result
    }
}

impl<D: AsFd> std::ops::Deref for AtomicFile<D> {
    type Target = std::fs::File;

    /// The temp file, for writes (`write_all_at`, `set_len`, …).
    fn deref(&self) -> &std::fs::File {
        &self.file
    }
}

impl<D: AsFd> Drop for AtomicFile<D> {
    fn drop(&mut self) {
        if !self.tmp.is_empty() {
            let _ = rustix::fs::unlinkat(self.dir.as_fd(), self.tmp.as_str(), AtFlags::empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};

    use super::*;

    #[test]
    fn writes_replace_atomically_with_the_exact_mode_and_leave_no_temp() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("sub/state.json");
        write_atomic(&path, b"one", 0o600).unwrap();
        write_atomic_with(&path, b"two", 0o640, Durability::None).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("state.json")]);
    }

    #[test]
    fn a_symlink_at_the_name_is_replaced_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"keep").unwrap();
        let path = tmp.path().join("notice.json");
        symlink(&outside, &path).unwrap();
        write_atomic_with(&path, b"new", 0o644, Durability::File).unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"keep");
        assert!(!std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_symlink());
    }

    #[test]
    fn names_with_a_slash_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = std::fs::File::open(tmp.path()).unwrap();
        for name in ["", ".", "..", "a/b"] {
            let e = write_atomic_at(dir.as_fd(), name, b"x", 0o644, Durability::None).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{name:?}");
        }
    }
}
