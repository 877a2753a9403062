//! Lives of the machine. Everything spotguard persists says which life it belongs to, because a
//! notice handled in one life must never be handled again in it, and a new life must be armed
//! again.
//!
//! A **new life** starts with
//! - a new boot (a reboot, an EC2 or GCE stop/start, an Azure deallocation): the kernel's boot id
//!   (`/proc/sys/kernel/random/boot_id`) changes;
//! - a resume from hibernation or suspend within one boot (an EC2 spot `hibernate`): the boot id
//!   does not change (same kernel, memory restored), so it is told apart by
//!   - a jump of `CLOCK_BOOTTIME − CLOCK_MONOTONIC` (the time the machine spent suspended; the
//!     monotonic clock stops during a suspend, the boot-time clock does not), checked at start-up
//!     and every few seconds, or
//!   - the responder seeing the interruption it handled disappear from the metadata service after
//!     the interruption's action time and stay away for the resume hold (the machine went
//!     through the action and came back; one missing answer is no proof, see
//!     `responder::resume_hold`), or
//!   - the responder being served another interruption (other content) after the handled one's
//!     action time, also after a restart that restored the handled one's record
//!     (`responder::store`).
//!
//! The life's identity is the boot id in the first life of a boot and `<boot id>+<n>` after the
//! n-th resume; it is what plan records and `notice.json` carry (field `boot_id` / `life`). The
//! resume count and the suspend offset it was seen at are kept in `<state-dir>/life.json` (the
//! count cannot be read off the machine again), so a restarted agent stays in the life it was in.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where the kernel publishes the id of the current boot (changes on every boot).
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The current boot id ([`BOOT_ID_PATH`]).
pub fn read_boot_id() -> Result<String, Error> {
    read_boot_id_from(Path::new(BOOT_ID_PATH))
}

/// The boot id from `path` (trimmed; an empty file is an error).
pub fn read_boot_id_from(path: &Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::ReadBootId {
        path: path.display().to_string(),
        source,
    })?;
    let id = text.trim();
    if id.is_empty() {
        return Err(Error::ReadBootId {
            path: path.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "empty boot id"),
        });
    }
    Ok(id.to_string())
}

/// Errors reading which life this is.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading boot id from {path}: {source}")]
    ReadBootId {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        false
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::ReadBootId { .. } => "read_boot_id",
        }
    }
}

/// File name of the life mark inside `--state-dir`.
pub const LIFE_FILE: &str = "life.json";

/// A jump of the suspended time larger than this is a resume (hibernation, suspend). Between
/// suspends the difference of the two clocks is constant; reading them costs microseconds.
pub const SUSPEND_JUMP: Duration = Duration::from_secs(2);

/// How often a running agent looks for a suspend jump.
pub const SUSPEND_CHECK_EVERY: Duration = Duration::from_secs(2);

/// What `life.json` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Mark {
    boot_id: Option<String>,
    /// Resumes seen in this boot (0: the boot's first life).
    resumes: u32,
    /// `CLOCK_BOOTTIME − CLOCK_MONOTONIC` in milliseconds when the mark was last confirmed.
    suspended_ms: u64,
}

/// The machine's current life, shared by the responder and its plans.
#[derive(Debug)]
pub struct Lives {
    path: PathBuf,
    dry_run: bool,
    mark: Mutex<Mark>,
    clock: fn() -> Option<u64>,
}

/// Time the machine has spent suspended since boot (`CLOCK_BOOTTIME − CLOCK_MONOTONIC`), in ms.
pub fn suspended_ms() -> Option<u64> {
    fn now_ms(clock: libc::clockid_t) -> Option<u64> {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we own.
        if unsafe { libc::clock_gettime(clock, &mut t) } != 0 {
            return None;
        }
        u64::try_from(t.tv_sec)
            .ok()?
            .checked_mul(1000)?
            .checked_add(u64::try_from(t.tv_nsec).ok()? / 1_000_000)
    }
    // Monotonic read on both sides of the boot-time read: the later one bounds the gap.
    let m1 = now_ms(libc::CLOCK_MONOTONIC)?;
    let b = now_ms(libc::CLOCK_BOOTTIME)?;
    let m2 = now_ms(libc::CLOCK_MONOTONIC)?;
    Some(b.saturating_sub(m2.max(m1)))
}

impl Lives {
    /// The current life: the mark in `state_dir` when it is of this boot, else a first life. A
    /// suspend since the mark was confirmed starts a new life at once. Blocking (a small local
    /// file); never fails: an unreadable or unwritable mark is logged and the life kept in memory.
    pub fn open(state_dir: &Path, boot_id: Option<String>, dry_run: bool) -> Lives {
        Self::open_with_clock(state_dir, boot_id, dry_run, suspended_ms)
    }

    fn open_with_clock(
        state_dir: &Path,
        boot_id: Option<String>,
        dry_run: bool,
        clock: fn() -> Option<u64>,
    ) -> Lives {
        let path = state_dir.join(LIFE_FILE);
        let now = clock().unwrap_or(0);
        let stored = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Mark>(&bytes) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "life mark unreadable: starting from this boot's first life");
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "life mark unreadable: starting from this boot's first life");
                None
            }
        };
        let (mark, changed) = match stored {
            Some(m) if m.boot_id == boot_id => {
                if now.saturating_sub(m.suspended_ms) > SUSPEND_JUMP.as_millis() as u64 {
                    tracing::info!(
                        suspended_s = (now - m.suspended_ms) / 1000,
                        "the machine was suspended (hibernation) since the agent last ran: a new life"
                    );
                    (
                        Mark {
                            resumes: m.resumes + 1,
                            suspended_ms: now,
                            ..m
                        },
                        true,
                    )
                } else {
                    (m, false)
                }
            }
            _ => (
                Mark {
                    boot_id,
                    resumes: 0,
                    suspended_ms: now,
                },
                true,
            ),
        };
        let lives = Lives {
            path,
            dry_run,
            mark: Mutex::new(mark),
            clock,
        };
        if changed {
            lives.persist();
        }
        lives
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Mark> {
        crate::sync::lock(&self.mark)
    }

    /// The current life's identity: the boot id in a boot's first life, `<boot id>+<n>` after
    /// its n-th resume; `None` without a boot id in the first life (nothing can be told apart).
    pub fn id(&self) -> Option<String> {
        life_id(&self.lock())
    }

    /// The boot id.
    pub fn boot_id(&self) -> Option<String> {
        self.lock().boot_id.clone()
    }

    /// Whether a record stamped with `recorded` (a life id as [`Lives::id`] gives) belongs to
    /// the current life. A record without a stamp, or an agent without a boot id, cannot tell:
    /// the same life.
    pub fn is_current(&self, recorded: Option<&str>) -> bool {
        match (recorded, self.id()) {
            (Some(r), Some(now)) => r == now,
            _ => true,
        }
    }

    /// A suspend jump since the last check: `Some(seconds suspended)` and a new life begun.
    pub fn check_suspend(&self) -> Option<u64> {
        let now = (self.clock)()?;
        let jumped = {
            let mut m = self.lock();
            let gap = now.saturating_sub(m.suspended_ms);
            if gap <= SUSPEND_JUMP.as_millis() as u64 {
                return None;
            }
            m.resumes += 1;
            m.suspended_ms = now;
            gap / 1000
        };
        self.persist();
        Some(jumped)
    }

    /// Begin a new life now (a resume seen another way: the handled interruption disappeared
    /// after its action time). Returns the new life's id.
    pub fn begin_new_life(&self) -> Option<String> {
        let now = (self.clock)();
        {
            let mut m = self.lock();
            m.resumes += 1;
            if let Some(now) = now {
                m.suspended_ms = now;
            }
        }
        self.persist();
        self.id()
    }

    fn persist(&self) {
        if self.dry_run {
            return;
        }
        let mark = self.lock().clone();
        let result = serde_json::to_vec(&mark)
            .map_err(std::io::Error::other)
            .and_then(|json| crate::fsutil::write_atomic(&self.path, &json, 0o644));
        if let Err(e) = result {
            tracing::error!(path = %self.path.display(), error = %e, "persisting the life mark failed: a restarted agent may not know about the resume");
        }
    }
}

fn life_id(m: &Mark) -> Option<String> {
    match (&m.boot_id, m.resumes) {
        (boot, 0) => boot.clone(),
        (Some(boot), n) => Some(format!("{boot}+{n}")),
        (None, n) => Some(format!("unknown-boot+{n}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_id_is_read_and_trimmed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("boot_id");
        std::fs::write(&path, "0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11\n").expect("write");
        assert_eq!(
            read_boot_id_from(&path).expect("boot id"),
            "0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11"
        );
        std::fs::write(&path, "  \n").expect("write");
        let err = read_boot_id_from(&path).expect_err("empty");
        assert_eq!(err.metric_label(), "read_boot_id");
        let missing = read_boot_id_from(&dir.path().join("absent")).expect_err("missing");
        assert!(missing.to_string().contains("absent"), "{missing}");
    }

    #[test]
    fn this_machine_has_a_boot_id() {
        let id = read_boot_id().expect("/proc/sys/kernel/random/boot_id");
        assert_eq!(id.len(), 36, "{id}");
    }

    use std::sync::atomic::{AtomicU64, Ordering};

    static CLOCK: AtomicU64 = AtomicU64::new(0);
    fn fake() -> Option<u64> {
        Some(CLOCK.load(Ordering::SeqCst))
    }

    #[test]
    fn the_suspended_clock_is_readable_and_small_without_a_suspend() {
        let a = suspended_ms().expect("clocks");
        let b = suspended_ms().expect("clocks");
        assert!(b.abs_diff(a) <= 1, "{a} vs {b}: constant between suspends");
    }

    #[test]
    fn boots_and_resumes_make_lives() {
        let tmp = tempfile::tempdir().unwrap();
        CLOCK.store(5_000, Ordering::SeqCst);
        let boot = || Some("b1".to_string());
        let l = Lives::open_with_clock(tmp.path(), boot(), false, fake);
        assert_eq!(l.id().as_deref(), Some("b1"));
        assert!(l.is_current(Some("b1")) && !l.is_current(Some("b0")));
        assert!(
            l.is_current(None),
            "an unstamped record cannot be told apart"
        );
        // Clock noise is no resume; a suspend of a minute is.
        CLOCK.store(5_900, Ordering::SeqCst);
        assert_eq!(l.check_suspend(), None);
        CLOCK.store(65_000, Ordering::SeqCst);
        assert_eq!(l.check_suspend(), Some(60));
        assert_eq!(l.id().as_deref(), Some("b1+1"));
        assert!(!l.is_current(Some("b1")));
        // A restarted agent stays in that life...
        let again = Lives::open_with_clock(tmp.path(), boot(), false, fake);
        assert_eq!(again.id().as_deref(), Some("b1+1"));
        // ...and sees a suspend that happened while it was not running.
        CLOCK.store(300_000, Ordering::SeqCst);
        let after = Lives::open_with_clock(tmp.path(), boot(), false, fake);
        assert_eq!(after.id().as_deref(), Some("b1+2"));
        assert_eq!(after.begin_new_life().as_deref(), Some("b1+3"));
        // A new boot is a first life again.
        let rebooted = Lives::open_with_clock(tmp.path(), Some("b2".into()), false, fake);
        assert_eq!(rebooted.id().as_deref(), Some("b2"));
    }
}
