//! The file formats of checkpoint protocol v1 (docs/checkpoint-protocol.md): the names in the
//! checkpoint dir (`notice.json`, `ack-<pid>.json`, `ack` and their fallback names), what
//! `notice.json` and an ack hold, and the stamp that tells an ack written after the signal from
//! one written before. Reading and writing them inside a pod's root is [`super::ack`]'s.
//!
//! Whether an ack is newer than the signal is decided without comparing the file's mtime with the
//! agent's clock (a network filesystem stamps files with its server's clock): see [`FileStamp`].

use serde::{Deserialize, Serialize};

/// Name of the notice file inside the checkpoint dir.
pub const NOTICE_FILE: &str = "notice.json";
/// Name of the plain ack file (acks the whole container).
pub const PLAIN_ACK_FILE: &str = "ack";
/// Acks and notices larger than this are refused.
pub(crate) const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Name of the per-process ack file for a PID as the process sees it.
pub fn ack_file_name(ns_pid: i32) -> String {
    format!("ack-{ns_pid}.json")
}

/// Longest suffix of a fallback ack name (`ack-<pid>.<suffix>.json`, `ack.<suffix>`).
const MAX_SUFFIX: usize = 64;

/// What an ack file's name says it acknowledges.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AckName {
    /// `ack-<pid>.json` or a fallback `ack-<pid>.<suffix>.json`: the process `<pid>` (as it sees
    /// its PID).
    Process(i32),
    /// `ack` or a fallback `ack.<suffix>`: the whole container.
    Plain,
}

fn valid_suffix(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_SUFFIX
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// Parse an ack file name: the plain names and the fallback names a writer uses when another
/// user's file holds its plain name (a file planted in a sticky directory cannot be replaced by
/// anyone but its owner; the fallback name is the writer's own choice, so nobody can take it
/// first). `None` for every other name.
pub fn parse_ack_name(name: &str) -> Option<AckName> {
    if name == PLAIN_ACK_FILE {
        return Some(AckName::Plain);
    }
    if let Some(suffix) = name.strip_prefix("ack.") {
        return valid_suffix(suffix).then_some(AckName::Plain);
    }
    let rest = name.strip_prefix("ack-")?.strip_suffix(".json")?;
    let (pid, suffix) = match rest.split_once('.') {
        Some((pid, suffix)) => (pid, Some(suffix)),
        None => (rest, None),
    };
    if pid.is_empty() || pid.len() > 10 || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if suffix.is_some_and(|s| !valid_suffix(s)) {
        return None;
    }
    pid.parse().ok().map(AckName::Process)
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
    /// The machine's life the notice belongs to (the boot id, `+<n>` after the n-th resume from
    /// hibernation): a `notice.json` of another life is a leftover.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub life: Option<String>,
    /// The node (host) whose agent wrote it: the helper copies it into the interruption sidecar
    /// of a checkpoint saved after the notice, so that the node the job resumes on can name the
    /// node it came from (docs/goodput.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
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
    /// With `done`: the checkpoint was saved to this local directory (as the process sees it)
    /// for the agent to upload (docs/checkpoint-protocol.md, "Staged checkpoints").
    #[serde(default)]
    pub staged: Option<String>,
    /// With `staged`: where the job's checkpoints go (overrides the pod's
    /// `spotguard.io/checkpoint-upload` / the host's `--checkpoint-upload`).
    #[serde(default)]
    pub upload: Option<String>,
    /// With `staged`: this node's share of a checkpoint several nodes save,
    /// `{"index": i, "count": n}`.
    #[serde(default)]
    pub part: Option<serde_json::Value>,
}

/// Identity and change stamp of a file in the checkpoint dir, as the filesystem reports it. An
/// ack counts as written after the signal when its stamp differs from the one taken just before
/// the signal (a new file, a rename over the old one, or a rewrite all change it; nothing is
/// compared with the agent's clock), or — on the restart path, where no earlier stamp exists —
/// when it changed no earlier than `notice.json` of the same notice (both stamped by the same
/// filesystem clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    pub dev: u64,
    pub ino: u64,
    /// The file's owner: an ack counts only when it is the acknowledging process's user.
    pub uid: u32,
    pub size: u64,
    /// Last status change (seconds, nanoseconds): writers cannot set it.
    pub ctime: (i64, i64),
    pub mtime: (i64, i64),
}

impl FileStamp {
    pub(crate) fn of(st: &rustix::fs::Stat) -> FileStamp {
        FileStamp {
            dev: st.st_dev,
            ino: st.st_ino,
            uid: st.st_uid,
            size: u64::try_from(st.st_size).unwrap_or(0),
            ctime: (st.st_ctime, i64::try_from(st.st_ctime_nsec).unwrap_or(0)),
            mtime: (st.st_mtime, i64::try_from(st.st_mtime_nsec).unwrap_or(0)),
        }
    }
}

/// A file another user planted at an ack name, found before the signal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignAck {
    pub name: String,
    pub owner: u32,
    /// `Err` with the reason when it could not be removed.
    pub removed: Result<(), String>,
}

/// An ack file read back, with its stamp.
#[derive(Clone, Debug, PartialEq)]
pub struct Ack {
    pub file: AckFile,
    pub stamp: FileStamp,
}
