//! The receiver's staging volume: each relay in a directory of its own, `<staging>/<id>/`, its
//! files written there as they arrive, and its journal beside it, `<staging>/<id>.json`
//! (written atomically: what was reserved, and once committed the sender's checksums), so an
//! agent that restarts finds what it was publishing.
//!
//! Every path comes off the wire: it has passed `store::tree::check_file` (no `..`, no empty or
//! absolute path, no control characters) before it gets here, and it is still created one
//! component at a time from the relay's own directory with `O_NOFOLLOW` / `O_EXCL`, directories
//! `0700`, files `0600`, so nothing a sender names can reach outside it or through a link.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};
use serde::{Deserialize, Serialize};

use super::wire::{FileCrcs, Reserve};
use crate::store::crc::Crcs;

/// The journal's version.
pub const JOURNAL_VERSION: u32 = 1;

/// What a relay's journal says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Journal {
    pub version: u32,
    pub id: String,
    /// The sender's address (its reservation counts against its cap).
    pub sender: std::net::IpAddr,
    pub reserve: Reserve,
    /// The sender's checksums, once every file arrived and matched them: the relay is
    /// committed and is published (again, after a restart) from the staged files.
    #[serde(default)]
    pub committed: Option<Vec<FileCrcs>>,
}

/// The staging directory.
#[derive(Clone, Debug)]
pub struct Staging {
    pub root: PathBuf,
}

fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> super::Error {
    let what = format!("{what} {}", path.display());
    move |source| super::Error::Io { what, source }
}

impl Staging {
    /// The staging directory, made `0700` if missing.
    pub fn open(root: &Path) -> Result<Staging, super::Error> {
        std::fs::create_dir_all(root).map_err(io("create", root))?;
        Ok(Staging {
            root: root.to_path_buf(),
        })
    }

    /// A relay's directory.
    pub fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn journal_path(&self, id: &str) -> PathBuf {
        self.root.join(format!("{id}.json"))
    }

    /// Make a new relay's directory and write its journal.
    pub fn create(&self, journal: &Journal) -> Result<(), super::Error> {
        let dir = self.dir(&journal.id);
        rustix::fs::mkdir(&dir, Mode::from_raw_mode(0o700))
            .map_err(|e| io("create", &dir)(e.into()))?;
        self.write_journal(journal)
    }

    /// Write a relay's journal (atomically, synced).
    pub fn write_journal(&self, journal: &Journal) -> Result<(), super::Error> {
        let path = self.journal_path(&journal.id);
        let data = serde_json::to_vec(journal).unwrap_or_default();
        crate::fsutil::write_atomic(&path, &data, 0o600).map_err(io("write", &path))
    }

    /// Remove a relay's files and journal (the journal last). Best effort.
    pub fn remove(&self, id: &str) {
        let _ = std::fs::remove_dir_all(self.dir(id));
        let _ = std::fs::remove_file(self.journal_path(id));
    }

    /// The journals found (a restart), and the names of entries that are neither a journal nor
    /// a journal's directory (an interrupted reservation's leftovers: removed by the caller).
    pub fn scan(&self) -> (Vec<Journal>, Vec<String>) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return (Vec::new(), Vec::new());
        };
        let mut journals = Vec::new();
        let mut names = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".json") {
                let parsed = std::fs::read(e.path())
                    .ok()
                    .and_then(|d| serde_json::from_slice::<Journal>(&d).ok())
                    .filter(|j| j.version == JOURNAL_VERSION && j.id == id && valid_id(id));
                match parsed {
                    Some(j) => journals.push(j),
                    None => names.push(name),
                }
            } else {
                names.push(name);
            }
        }
        let kept: std::collections::HashSet<&str> =
            journals.iter().map(|j| j.id.as_str()).collect();
        names.retain(|n| !kept.contains(n.as_str()));
        (journals, names)
    }

    /// Remove the entry `name` of the staging directory (file or tree). Best effort.
    pub fn remove_entry(&self, name: &str) {
        let p = self.root.join(name);
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }

    /// Bytes free for unprivileged writers on the staging volume.
    pub fn free_bytes(&self) -> Result<u64, super::Error> {
        let st =
            rustix::fs::statvfs(&self.root).map_err(|e| io("statvfs", &self.root)(e.into()))?;
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }
}

/// A relay id: 32 lower-case hex digits (what [`new_id`] makes; a journal's name is checked
/// against it before its directory is used).
pub fn valid_id(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A new random relay id.
pub fn new_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

/// One file being received: created under the relay's directory, its bytes counted against the
/// declared size and checksummed as they are written.
pub struct Incoming {
    file: File,
    declared: u64,
    crcs: Crcs,
}

/// Why a received file was refused.
#[derive(Debug)]
pub enum Refused {
    /// More bytes than declared.
    TooLarge {
        declared: u64,
    },
    /// Fewer bytes than declared.
    TooShort {
        declared: u64,
        got: u64,
    },
    Io(std::io::Error),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::TooLarge { declared } => write!(f, "more bytes than the declared {declared}"),
            Refused::TooShort { declared, got } => {
                write!(f, "{got} bytes, fewer than the declared {declared}")
            }
            Refused::Io(e) => write!(f, "{e}"),
        }
    }
}

impl Incoming {
    /// Create `rel` (already checked by `store::tree::check_file`) under `dir`, a new file; its
    /// parent directories made as needed. Blocking.
    pub fn create(dir: &Path, rel: &str, declared: u64) -> std::io::Result<Incoming> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let mut at: OwnedFd = rustix::fs::open(dir, flags, Mode::empty())?;
        let mut segments: Vec<&str> = rel.split('/').collect();
        let name = segments.pop().unwrap_or_default();
        for seg in segments {
            match rustix::fs::mkdirat(&at, seg, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(e) => return Err(e.into()),
            }
            at = rustix::fs::openat(&at, seg, flags, Mode::empty())?;
        }
        let fd = rustix::fs::openat(
            &at,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(Incoming {
            file: File::from(fd),
            declared,
            crcs: Crcs::empty(),
        })
    }

    /// Bytes written so far.
    pub fn len(&self) -> u64 {
        self.crcs.len
    }

    /// Nothing written yet.
    pub fn is_empty(&self) -> bool {
        self.crcs.len == 0
    }

    /// Append `data`; refused past the declared size. Blocking.
    pub fn write(&mut self, data: &[u8]) -> Result<(), Refused> {
        if self.crcs.len.saturating_add(data.len() as u64) > self.declared {
            return Err(Refused::TooLarge {
                declared: self.declared,
            });
        }
        self.file.write_all(data).map_err(Refused::Io)?;
        self.crcs = self.crcs.then(Crcs::of(data));
        Ok(())
    }

    /// The whole file arrived: exactly the declared size, synced. Its checksums. Blocking.
    pub fn finish(self) -> Result<Crcs, Refused> {
        if self.crcs.len != self.declared {
            return Err(Refused::TooShort {
                declared: self.declared,
                got: self.crcs.len,
            });
        }
        self.file.sync_all().map_err(Refused::Io)?;
        Ok(self.crcs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_created_beneath_its_relay_and_held_to_its_size() {
        let tmp = tempfile::tempdir().unwrap();
        let mut f = Incoming::create(tmp.path(), "a/b/c.bin", 5).unwrap();
        f.write(b"abc").unwrap();
        f.write(b"de").unwrap();
        assert!(matches!(f.write(b"f"), Err(Refused::TooLarge { .. })));
        assert_eq!(f.finish().unwrap(), Crcs::of(b"abcde"));
        assert_eq!(
            std::fs::read(tmp.path().join("a/b/c.bin")).unwrap(),
            b"abcde"
        );
        // Short, and a name that exists: refused.
        let g = Incoming::create(tmp.path(), "x", 3).unwrap();
        assert!(matches!(g.finish(), Err(Refused::TooShort { got: 0, .. })));
        assert!(Incoming::create(tmp.path(), "x", 3).is_err());
        // A symlink planted where a directory goes is never followed.
        let out = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(out.path(), tmp.path().join("link")).unwrap();
        assert!(Incoming::create(tmp.path(), "link/evil", 1).is_err());
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 0);
    }

    #[test]
    fn ids_are_32_hex_digits() {
        let id = new_id();
        assert!(valid_id(&id), "{id}");
        assert!(!valid_id("../../etc"));
        assert!(!valid_id(&"A".repeat(32)));
    }
}
