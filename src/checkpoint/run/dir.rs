//! The file side of a container's checkpoint dir: opened inside the container's root (or on the
//! host) on a thread of its own, the ack files stamped before the signal, `notice.json` written
//! (or, on the restart path, found as the anchor); and how an ack is judged fresh.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc;

use super::delivery::{Mode, NoticeStatus};
use super::threads::Counters;
use crate::checkpoint::ack::{CheckpointDir, FileStamp, NoticeFile};
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::Error;

/// The checkpoint dir of a container as delivery left it.
#[derive(Debug)]
pub(super) enum DirSlot {
    /// Open, with the stamps taken before the signal (or the restart path's anchor).
    Ready(CheckpointDir, Freshness),
    /// Its file thread did not answer within [`NOTICE_BUDGET`]; picked up by the watcher if it
    /// ever does.
    Late(mpsc::Receiver<FileJob>),
    None,
}

/// What a container's file thread produced.
pub(super) type FileJob = (Result<CheckpointDir, Error>, Freshness, NoticeStatus);

/// How an ack is judged "written after the signal" (see [`FileStamp`]).
#[derive(Clone, Debug, Default)]
pub(super) struct Freshness {
    /// Stamps of the ack files just before the signal (absent: did not exist).
    baseline: HashMap<String, FileStamp>,
    /// Restart path: `notice.json` of this notice; acks count when they changed no earlier.
    anchor: Option<FileStamp>,
}

impl Freshness {
    pub(super) fn fresh(&self, name: &str, stamp: &FileStamp) -> bool {
        match &self.anchor {
            Some(a) => stamp.ctime >= a.ctime,
            None => self.baseline.get(name) != Some(stamp),
        }
    }
}

/// The file side of one container, on a thread of its own: open the dir, stamp the acks that
/// already exist, write `notice.json` (deliver) or find the anchor (restart path).
pub(super) struct FileTask {
    pub(super) proc: ProcFs,
    pub(super) dir: PathBuf,
    pub(super) root: Option<i32>,
    /// `(pid, start time)` whose root may be used, in order.
    pub(super) tries: Vec<(i32, u64)>,
    /// Ack file names to stamp.
    pub(super) names: Vec<String>,
    pub(super) notice: NoticeFile,
    pub(super) mode: Mode,
    pub(super) dry_run: bool,
    pub(super) counters: Counters,
}

pub(super) fn file_job(t: FileTask) -> FileJob {
    let FileTask {
        proc,
        dir,
        root,
        tries,
        names,
        notice,
        mode,
        dry_run,
        counters,
    } = t;
    let opened = open_dir(&proc, &dir, root, &tries);
    let mut fresh = Freshness::default();
    let status = match &opened {
        Err(e) => {
            counters.error(e.metric_label());
            NoticeStatus::Failed(e.to_string())
        }
        Ok(d) => match mode {
            Mode::Replan { .. } => {
                match d.read_notice_stamped() {
                    Ok(Some((n, stamp))) if n.notice_id == notice.notice_id => {
                        fresh.anchor = Some(stamp)
                    }
                    _ => fresh.baseline = d.stamps(&names),
                }
                NoticeStatus::AlreadyWritten
            }
            Mode::Deliver if dry_run => NoticeStatus::DryRun,
            Mode::Deliver => {
                fresh.baseline = d.stamps(&names);
                match d.write_notice(&notice) {
                    Ok(()) => NoticeStatus::Written,
                    Err(e) => {
                        counters.error(e.metric_label());
                        NoticeStatus::Failed(e.to_string())
                    }
                }
            }
        },
    };
    (opened, fresh, status)
}

/// Open the container's checkpoint dir: inside `/proc/<pid>/root` of the root process (or, if it
/// is gone, of another verified process of the container), or on the host.
fn open_dir(
    proc: &ProcFs,
    dir: &std::path::Path,
    c_root: Option<i32>,
    tries: &[(i32, u64)],
) -> Result<CheckpointDir, Error> {
    let Some(root_pid) = c_root else {
        return CheckpointDir::host(dir);
    };
    let mut last = None;
    for (pid, start) in tries {
        match CheckpointDir::in_root_of(proc, *pid, *start, dir) {
            Ok(d) => return Ok(d),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::ReadAck {
        target: format!("{} in /proc/{root_pid}/root", dir.display()),
        source: std::io::Error::other("root process is not among the container's processes"),
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn freshness_compares_stamps_not_clocks() {
        let stamp = |ino: u64, ctime: i64| FileStamp {
            dev: 1,
            ino,
            size: 10,
            ctime: (ctime, 0),
            mtime: (0, 0),
        };
        let mut f = Freshness::default();
        // absent before the signal: any ack counts, whatever its times say
        assert!(f.fresh("ack-1.json", &stamp(5, 0)));
        f.baseline.insert("ack-1.json".into(), stamp(5, 100));
        assert!(!f.fresh("ack-1.json", &stamp(5, 100)));
        assert!(f.fresh("ack-1.json", &stamp(6, 100)));
        assert!(f.fresh("ack-1.json", &stamp(5, 101)));
        // restart path: no earlier than notice.json of this notice, same filesystem clock
        let anchor = Freshness {
            baseline: HashMap::new(),
            anchor: Some(stamp(9, 200)),
        };
        assert!(!anchor.fresh("ack-1.json", &stamp(6, 199)));
        assert!(anchor.fresh("ack-1.json", &stamp(6, 200)));
    }
}
