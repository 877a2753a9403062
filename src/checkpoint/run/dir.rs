//! The file side of a container's checkpoint dir: opened inside the container's root (or on the
//! host) on a thread of its own; `notice.json` read back (did this notice reach the container
//! before?), the ack files stamped before the signal, files other users planted at the targets'
//! ack names removed, `notice.json` written; and how an ack is judged fresh.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use super::delivery::NoticeStatus;
use super::threads::Counters;
use crate::checkpoint::ack::CheckpointDir;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::protocol::{ack_file_name, AckName, FileStamp, NoticeFile, PLAIN_ACK_FILE};
use crate::checkpoint::Error;

/// The checkpoint dir of a container as delivery left it.
#[derive(Debug)]
pub(super) enum DirSlot {
    /// Open, with the stamps taken before the signal (or the restart path's anchor).
    Ready(CheckpointDir, Box<Freshness>),
    /// Its file thread did not answer within [`NOTICE_BUDGET`](super::NOTICE_BUDGET); picked up
    /// by the watcher if it ever does.
    Late(mpsc::Receiver<FileJob>),
    None,
}

/// What `notice.json` said before delivery wrote anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Told {
    /// It names this notice (of this life): the container was told, and signalled, before.
    Named(FileStamp),
    /// Absent, or about another notice or another life.
    NotNamed,
    /// It could not be read (not a regular file, unreadable, the dir cannot be opened).
    Unknown(String),
}

/// What a container's file thread produced.
#[derive(Debug)]
pub(super) struct FileJob {
    pub(super) dir: Result<CheckpointDir, Error>,
    pub(super) fresh: Freshness,
    pub(super) told: Told,
    pub(super) status: NoticeStatus,
    /// Namespace PIDs told now, and told before (waited for without a signal); the targets in
    /// neither are held (nobody can tell whether they were signalled).
    pub(super) now: Vec<i32>,
    pub(super) before: Vec<i32>,
}

/// How an ack is judged "written after the signal" (see [`FileStamp`]).
#[derive(Clone, Debug, Default)]
pub(super) struct Freshness {
    /// Stamps of the ack files just before the signal (absent: did not exist).
    baseline: HashMap<String, FileStamp>,
    /// Processes signalled before (a restart): their acks count when they changed no earlier
    /// than `notice.json` of this notice (`anchor`), by the namespace PIDs their names carry.
    anchor: Option<FileStamp>,
    anchored: HashSet<i32>,
    /// The plain ack is judged by the anchor too (every target of the container was signalled
    /// before).
    plain_anchored: bool,
}

impl Freshness {
    pub(super) fn fresh(&self, name: &str, what: &AckName, stamp: &FileStamp) -> bool {
        let anchored = match what {
            AckName::Process(pid) => self.anchored.contains(pid),
            AckName::Plain => self.plain_anchored,
        };
        match (&self.anchor, anchored) {
            (Some(a), true) => stamp.ctime >= a.ctime,
            _ => self.baseline.get(name) != Some(stamp),
        }
    }
}

/// Which processes of the container the file thread is to tell now.
#[derive(Clone, Debug)]
pub(super) enum Tell {
    /// Decided before (the record lists who was signalled): tell these namespace PIDs (write
    /// `notice.json` only when there is one).
    Known { now: Vec<i32>, before: Vec<i32> },
    /// Decided by `notice.json`: every target is told now unless it names this notice (then
    /// they were told before); when it cannot be read, `if_unknown` says.
    ByNotice { targets: Vec<i32>, if_unknown: bool },
    /// The restart path of old: never tell anyone (every target was signalled before).
    NoneNow { targets: Vec<i32> },
}

/// The file side of one container, on a thread of its own: open the dir, read what
/// `notice.json` says, stamp the acks that already exist, remove what other users planted at
/// the targets' ack names, write `notice.json`.
pub(super) struct FileTask {
    pub(super) proc: ProcFs,
    pub(super) dir: PathBuf,
    pub(super) root: Option<i32>,
    /// `(pid, start time)` whose root may be used, in order.
    pub(super) tries: Vec<(i32, u64)>,
    /// The targets' uids, by namespace PID (an ack counts, and is left in place, only when one of
    /// its process's uids owns it).
    pub(super) owners: HashMap<i32, Vec<u32>>,
    pub(super) tell: Tell,
    pub(super) notice: NoticeFile,
    pub(super) dry_run: bool,
    pub(super) counters: Counters,
    /// Set by delivery when it stopped waiting for this thread and decided without it: nothing
    /// may be written any more (delivery may have held the targets).
    pub(super) abandoned: Arc<AtomicBool>,
    /// The dirs this delivery writes `notice.json` into.
    pub(super) claimed: Claimed,
}

/// The checkpoint dirs (by container root process, `None` on the host, and path) this delivery
/// writes `notice.json` into, shared by all its groups. Several groups may share one dir (host
/// mode: a `--checkpoint-pidfile` group each, one checkpoint dir): a group that reads a
/// `notice.json` naming this notice in a dir another group of the same delivery claimed reads
/// that group's write, not proof of an earlier signal. A group claims the dir before it writes.
#[derive(Clone, Debug, Default)]
pub(super) struct Claimed(Arc<Mutex<HashSet<DirKey>>>);

/// A checkpoint dir of a delivery: its container's root process (`None`: the host) and path.
type DirKey = (Option<i32>, PathBuf);

impl Claimed {
    fn claim(&self, root: Option<i32>, dir: &std::path::Path) {
        crate::sync::lock(&self.0).insert((root, dir.to_path_buf()));
    }

    fn has(&self, root: Option<i32>, dir: &std::path::Path) -> bool {
        crate::sync::lock(&self.0).contains(&(root, dir.to_path_buf()))
    }
}

/// Whether `found` names the notice `want` of this life: the same id (a `notice.json` that says
/// no life, written by an older agent, is judged by its id alone); or, for the kinds a life has
/// one of (an interruption, a rebalance recommendation), the same kind and life (a server may
/// serve the same notice under a new id on every poll).
pub(super) fn names(found: &NoticeFile, want: &NoticeFile) -> bool {
    if found.source != want.source {
        return false;
    }
    match (&found.life, &want.life) {
        (Some(f), Some(w)) if f != w => false,
        (Some(_), Some(_)) => {
            found.notice_id == want.notice_id
                || (found.kind == want.kind
                    && matches!(want.kind.as_str(), "interruption" | "rebalance"))
        }
        _ => found.notice_id == want.notice_id,
    }
}

pub(super) fn file_job(t: FileTask) -> FileJob {
    let d = match open_dir(&t.proc, &t.dir, t.root, &t.tries) {
        Ok(d) => d,
        Err(e) => {
            t.counters.error(e.metric_label());
            let why = e.to_string();
            return FileJob {
                dir: Err(e),
                fresh: Freshness::default(),
                told: Told::Unknown(why.clone()),
                status: NoticeStatus::Failed(why),
                now: Vec::new(),
                before: Vec::new(),
            };
        }
    };
    let told = read_told(&d, &t);
    let (now, before) = decide(&t.tell, &told);
    let fresh = freshness(&d, &told, &now, &before);
    let status = write_notice(&d, &t, &now, &before);
    FileJob {
        dir: Ok(d),
        fresh,
        told,
        status,
        now,
        before,
    }
}

/// What `notice.json` says of this notice. It matters unless everyone is told now (a first
/// delivery): then the read is skipped, it would only cost the signal time.
fn read_told(d: &CheckpointDir, t: &FileTask) -> Told {
    if matches!(&t.tell, Tell::Known { before, .. } if before.is_empty()) {
        return Told::NotNamed;
    }
    match d.read_notice_stamped() {
        // Written by another group of this delivery (checked after the read: a group claims
        // the dir before its write), not by an earlier one.
        Ok(Some(_)) if t.claimed.has(t.root, &t.dir) => Told::NotNamed,
        Ok(Some((n, stamp))) if names(&n, &t.notice) => Told::Named(stamp),
        Ok(_) => Told::NotNamed,
        Err(e) => Told::Unknown(e.to_string()),
    }
}

/// Who is told now and who was before (namespace PIDs), by what was decided before the dir was
/// read and what `notice.json` says.
fn decide(tell: &Tell, told: &Told) -> (Vec<i32>, Vec<i32>) {
    match tell {
        Tell::Known { now, before } => (now.clone(), before.clone()),
        Tell::ByNotice { targets, .. } if matches!(told, Told::Named(_)) => {
            (Vec::new(), targets.clone())
        }
        Tell::ByNotice {
            targets,
            if_unknown,
        } => match told {
            Told::Unknown(_) if !if_unknown => (Vec::new(), Vec::new()),
            _ => (targets.clone(), Vec::new()),
        },
        Tell::NoneNow { targets } => (Vec::new(), targets.clone()),
    }
}

/// The stamps an ack must differ from to count (taken now, before the signal), and the anchor
/// for those told before: `notice.json`'s stamp, when it names this notice.
fn freshness(d: &CheckpointDir, told: &Told, now: &[i32], before: &[i32]) -> Freshness {
    let mut names: Vec<String> = now
        .iter()
        .chain(before)
        .map(|p| ack_file_name(*p))
        .collect();
    names.push(PLAIN_ACK_FILE.to_string());
    let anchor = match told {
        Told::Named(stamp) => Some(*stamp),
        _ => None,
    };
    Freshness {
        baseline: d.stamps(&names),
        anchor,
        anchored: match anchor {
            Some(_) => before.iter().copied().collect(),
            None => Default::default(),
        },
        plain_anchored: anchor.is_some() && now.is_empty() && !before.is_empty(),
    }
}

/// Write `notice.json` when someone is told now (not in a dry run, not once delivery went on
/// without this thread), after removing what other users planted at the targets' ack names.
fn write_notice(d: &CheckpointDir, t: &FileTask, now: &[i32], before: &[i32]) -> NoticeStatus {
    if now.is_empty() {
        if before.is_empty() {
            NoticeStatus::NotNeeded
        } else {
            NoticeStatus::AlreadyWritten
        }
    } else if t.dry_run {
        NoticeStatus::DryRun
    } else if t.abandoned.load(Ordering::SeqCst) {
        NoticeStatus::Failed("checkpoint dir answered after delivery went on without it".into())
    } else {
        remove_planted(d, t, now);
        t.claimed.claim(t.root, &t.dir);
        match d.write_notice(&t.notice) {
            Ok(()) => NoticeStatus::Written,
            Err(e) => {
                t.counters.error(e.metric_label());
                NoticeStatus::Failed(e.to_string())
            }
        }
    }
}

/// Before the signal: files other users planted at the names the targets told now will write
/// (their `ack-<pid>.json`, the container's `ack`) are removed, so that they never stand in the
/// way of the real ack (and would not count anyway). Logged and counted.
fn remove_planted(d: &CheckpointDir, t: &FileTask, now: &[i32]) {
    let mut all: Vec<u32> = t.owners.values().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    let mut names: Vec<(String, Vec<u32>)> = now
        .iter()
        .map(|p| {
            (
                ack_file_name(*p),
                t.owners.get(p).cloned().unwrap_or_default(),
            )
        })
        .collect();
    names.push((PLAIN_ACK_FILE.to_string(), all));
    for f in d.remove_foreign(&names) {
        t.counters.error("foreign_ack");
        match &f.removed {
            Ok(()) => {
                tracing::warn!(dir = %d.display(), file = %f.name, owner = f.owner, "removed a file another user put at a target's ack name before the signal")
            }
            Err(e) => {
                tracing::warn!(dir = %d.display(), file = %f.name, owner = f.owner, error = %e, "a file another user put at a target's ack name cannot be removed; the target's own ack will use a fallback name")
            }
        }
    }
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

    fn stamp(ino: u64, ctime: i64) -> FileStamp {
        FileStamp {
            dev: 1,
            ino,
            uid: 1000,
            size: 10,
            ctime: (ctime, 0),
            mtime: (0, 0),
        }
    }

    #[test]
    fn freshness_compares_stamps_not_clocks() {
        let p1 = AckName::Process(1);
        let mut f = Freshness::default();
        // absent before the signal: any ack counts, whatever its times say
        assert!(f.fresh("ack-1.json", &p1, &stamp(5, 0)));
        f.baseline.insert("ack-1.json".into(), stamp(5, 100));
        assert!(!f.fresh("ack-1.json", &p1, &stamp(5, 100)));
        assert!(f.fresh("ack-1.json", &p1, &stamp(6, 100)));
        assert!(f.fresh("ack-1.json", &p1, &stamp(5, 101)));
        // restart path: no earlier than notice.json of this notice, same filesystem clock
        let anchor = Freshness {
            baseline: HashMap::new(),
            anchor: Some(stamp(9, 200)),
            anchored: [1].into_iter().collect(),
            plain_anchored: true,
        };
        assert!(!anchor.fresh("ack-1.json", &p1, &stamp(6, 199)));
        assert!(anchor.fresh("ack-1.json", &p1, &stamp(6, 200)));
        assert!(anchor.fresh("ack", &AckName::Plain, &stamp(7, 200)));
    }

    fn notice(id: &str, kind: &str, life: Option<&str>) -> NoticeFile {
        NoticeFile {
            notice_id: id.into(),
            source: "aws".into(),
            kind: kind.into(),
            deadline_unix: None,
            checkpoint_deadline_unix: 0,
            signal: "SIGUSR1".into(),
            life: life.map(str::to_string),
            node: None,
        }
    }

    #[test]
    fn a_notice_is_named_by_its_id_or_by_its_kind_in_the_same_life() {
        let want = notice("i-2", "interruption", Some("b1"));
        assert!(names(&notice("i-2", "interruption", Some("b1")), &want));
        // a re-stamped interruption of the same life is the same interruption
        assert!(names(&notice("i-1", "interruption", Some("b1")), &want));
        // another life (a resume from hibernation) is not
        assert!(!names(&notice("i-2", "interruption", Some("b1+1")), &want));
        // an older agent's notice.json says no life: its id alone
        assert!(names(&notice("i-2", "interruption", None), &want));
        assert!(!names(&notice("i-1", "interruption", None), &want));
        // maintenance events by id only
        let m = notice("ev-1", "maintenance", Some("b1"));
        assert!(names(&notice("ev-1", "maintenance", Some("b1")), &m));
        assert!(!names(&notice("ev-2", "maintenance", Some("b1")), &m));
        // without a life, ids only
        let bare = notice("i-2", "interruption", None);
        assert!(names(&notice("i-2", "interruption", None), &bare));
        assert!(!names(&notice("i-1", "interruption", None), &bare));
    }
}
