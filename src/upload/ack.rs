//! The protocol side of staged checkpoints (docs/checkpoint-protocol.md, "Staged checkpoints").
//!
//! A trainer acks `done` with `"staged": "/local/ckpt/step-1200"` (and optionally
//! `"upload": "s3://bucket/run1"`), then waits for the agent's answer, `upload-<pid>.json` in
//! the same checkpoint dir: `taken` once every staged file is open in the agent (the trainer may
//! exit at once: the upload no longer needs its container, its mount namespace, or even the
//! files' names), or `refused` with the reason (the trainer still has time to save elsewhere).
//! [`take`] is that step: it runs on the ack watcher's thread while the process is alive.
//!
//! The checkpoint's destination is `<location>/<name>`: the location from the ack's `upload`,
//! else the pod's `spotguard.io/checkpoint-upload` annotation (host mode: `--checkpoint-upload`);
//! the name is the staged directory's base name. It must pass the operator's `--upload-allow`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::dest::{validate_checkpoint_name, Granted, Location, UploadPolicy};
use super::journal::RootRecord;
use super::manifest::Part;
use super::staged::{self, Limits, Root, StagedTree};
use super::Error;
use crate::checkpoint::ack::{AckFile, AckState, CheckpointDir};
use crate::checkpoint::procfs::ProcFs;

/// Pod annotation naming where the pod's staged checkpoints go (a location).
pub const UPLOAD_ANNOTATION: &str = crate::checkpoint::pods::UPLOAD;

/// The agent's answer to a staged ack of process `ns_pid` (pid as the process sees it).
pub fn answer_file_name(ns_pid: i32) -> String {
    format!("upload-{ns_pid}.json")
}

/// What a `done` ack with `staged` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedRequest {
    /// The staged directory, as the process sees it (absolute).
    pub staged: PathBuf,
    /// The location named in the ack, if any.
    pub upload: Option<String>,
    /// The ack's step, when it is a non-negative integer.
    pub step: Option<u64>,
    /// This node's share of a checkpoint several nodes save.
    pub part: Option<Part>,
}

impl StagedRequest {
    /// The request an ack carries: `Ok(None)` when it names no staged directory; an error when
    /// `staged` comes with another state than `done` or is not an absolute path.
    pub fn from_ack(ack: &AckFile) -> Result<Option<StagedRequest>, Error> {
        let Some(staged) = &ack.staged else {
            return Ok(None);
        };
        let bad = |reason: &str| Error::Staged {
            path: staged.clone(),
            problem: staged::Problem::Name,
            detail: reason.to_string(),
        };
        if ack.state != AckState::Done {
            return Err(bad("`staged` goes with state `done`"));
        }
        let path = Path::new(staged);
        if !path.is_absolute() {
            return Err(bad("the staged directory must be an absolute path"));
        }
        let part = match &ack.part {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let p: Part = serde_json::from_value(v.clone())
                    .map_err(|_| bad("`part` is {\"index\": i, \"count\": n}"))?;
                p.check().map_err(|e| bad(&e))?;
                Some(p)
            }
        };
        Ok(Some(StagedRequest {
            staged: path.to_path_buf(),
            upload: ack.upload.clone().filter(|u| !u.trim().is_empty()),
            step: ack.step.as_ref().and_then(|s| s.as_u64()),
            part,
        }))
    }

    /// The checkpoint's name: the staged directory's base name.
    pub fn name(&self) -> Result<String, Error> {
        let name = self
            .staged
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        validate_checkpoint_name(&name)?;
        Ok(name)
    }
}

/// Where a staged checkpoint goes, as allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// The checkpoint's directory: `<location>/<name>`.
    pub destination: Location,
    pub granted: Granted,
    pub name: String,
}

/// Resolve the destination of `req`: its own location, else `default` (the annotation or the
/// host flag), joined with the checkpoint's name, checked against `policy`.
pub fn resolve(
    req: &StagedRequest,
    default: Option<&str>,
    policy: &UploadPolicy,
) -> Result<Resolved, Error> {
    let text = req
        .upload
        .as_deref()
        .or(default)
        .ok_or_else(|| Error::InvalidDestination {
            dest: String::new(),
            reason: format!(
            "no destination: the ack names none (`upload`) and the pod has no {UPLOAD_ANNOTATION} \
             annotation (host mode: --checkpoint-upload)"
        ),
        })?;
    let name = req.name()?;
    let destination = Location::parse(text)?.join(&name);
    let granted = policy.check(&destination)?;
    Ok(Resolved {
        destination,
        granted,
        name,
    })
}

/// State of an [`Answer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AnswerState {
    /// Every staged file is open in the agent: the trainer may exit.
    Taken,
    /// Nothing will be uploaded; `error` says why.
    Refused,
}

/// `upload-<pid>.json`: the agent's answer to a staged ack.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub state: AnswerState,
    /// The checkpoint's destination.
    pub destination: Option<String>,
    pub files: Option<usize>,
    pub bytes: Option<u64>,
    pub error: Option<String>,
    /// Unix seconds.
    pub ts: f64,
}

impl Answer {
    fn now() -> f64 {
        jiff::Timestamp::now().as_millisecond() as f64 / 1000.0
    }

    pub fn taken(destination: &Location, tree: &StagedTree) -> Answer {
        Answer {
            state: AnswerState::Taken,
            destination: Some(destination.display()),
            files: Some(tree.files.len()),
            bytes: Some(tree.bytes),
            error: None,
            ts: Answer::now(),
        }
    }

    pub fn refused(error: &Error) -> Answer {
        Answer {
            state: AnswerState::Refused,
            destination: None,
            files: None,
            bytes: None,
            error: Some(error.to_string()),
            ts: Answer::now(),
        }
    }
}

/// Write `answer` for process `ns_pid` into its checkpoint dir (atomic).
pub fn write_answer(
    dir: &CheckpointDir,
    ns_pid: i32,
    answer: &Answer,
) -> Result<(), crate::checkpoint::Error> {
    let mut data = serde_json::to_vec(answer).unwrap_or_default();
    data.push(b'\n');
    dir.write_atomic(&answer_file_name(ns_pid), &data)
}

/// A staged checkpoint taken: the tree open, where it goes, how it was captured.
#[derive(Debug)]
pub struct Taken {
    pub tree: StagedTree,
    pub resolved: Resolved,
    pub root: RootRecord,
}

/// The process whose ack asked for an upload.
#[derive(Clone, Copy, Debug)]
pub struct Acker {
    /// Host pid.
    pub pid: i32,
    pub start_time: u64,
    /// Pid as the process sees it (names its ack and answer files).
    pub ns_pid: i32,
}

/// On a `done` ack with `staged`, while the process lives: resolve and check the destination,
/// capture the staged tree through the process's root, and answer (`taken` or `refused`) in
/// its checkpoint dir. Blocking and quick (directory reads and opens: milliseconds for
/// thousands of files); never on the signal path. A failed answer write is logged, not fatal:
/// the trainer's wait times out and it exits anyway.
pub fn take(
    proc: &ProcFs,
    acker: Acker,
    dir: &CheckpointDir,
    req: &StagedRequest,
    default: Option<&str>,
    policy: &UploadPolicy,
    limits: &Limits,
) -> Result<Taken, Error> {
    let result = (|| {
        let resolved = resolve(req, default, policy)?;
        let root = Root::of_process(proc, acker.pid, acker.start_time)?;
        let record = if root.is_host_root() {
            RootRecord::Host { owner: root.uid }
        } else {
            RootRecord::Process {
                pid: acker.pid,
                start_time: acker.start_time,
            }
        };
        let tree = staged::capture(&root, &req.staged, limits)?;
        Ok(Taken {
            tree,
            resolved,
            root: record,
        })
    })();
    let answer = match &result {
        Ok(t) => Answer::taken(&t.resolved.destination, &t.tree),
        Err(e) => Answer::refused(e),
    };
    if let Err(e) = write_answer(dir, acker.ns_pid, &answer) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot write the upload answer");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upload::dest::AllowUpload;

    fn ack(json: &str) -> AckFile {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn staged_acks_parse_and_resolve_under_the_allow_list() {
        assert_eq!(
            StagedRequest::from_ack(&ack(r#"{"state":"done","step":3}"#)).unwrap(),
            None
        );
        let req = StagedRequest::from_ack(&ack(
            r#"{"state":"done","step":1200,"staged":"/local/ckpt/step-1200","upload":"s3://ck/run1"}"#,
        ))
        .unwrap()
        .unwrap();
        assert_eq!(req.step, Some(1200));
        assert_eq!(req.part, None);
        let parted = StagedRequest::from_ack(&ack(
            r#"{"state":"done","staged":"/c/step-1","part":{"index":1,"count":4}}"#,
        ))
        .unwrap()
        .unwrap();
        assert_eq!(parted.part, Some(Part { index: 1, count: 4 }));
        for bad in [r#"{"index":4,"count":4}"#, r#""1/4""#, r#"{"index":1}"#] {
            let text = format!(r#"{{"state":"done","staged":"/c/step-1","part":{bad}}}"#);
            assert!(StagedRequest::from_ack(&ack(&text)).is_err(), "{bad}");
        }
        assert_eq!(req.name().unwrap(), "step-1200");
        let policy = UploadPolicy {
            allow: vec![AllowUpload::parse("s3://ck").unwrap()],
        };
        let r = resolve(&req, Some("s3://other/x"), &policy).unwrap();
        assert_eq!(r.destination.display(), "s3://ck/run1/step-1200");
        // The annotation when the ack names nothing; refused when not allowed.
        let mut bare = req.clone();
        bare.upload = None;
        assert_eq!(
            resolve(&bare, Some("s3://ck/run2"), &policy)
                .unwrap()
                .destination
                .display(),
            "s3://ck/run2/step-1200"
        );
        assert_eq!(
            resolve(&bare, Some("s3://other/x"), &policy)
                .unwrap_err()
                .metric_label(),
            "not_allowed"
        );
        assert!(resolve(&bare, None, &policy).is_err());
        assert!(StagedRequest::from_ack(&ack(r#"{"state":"failed","staged":"/x"}"#)).is_err());
        assert!(StagedRequest::from_ack(&ack(r#"{"state":"done","staged":"rel"}"#)).is_err());
        let hidden = StagedRequest::from_ack(&ack(r#"{"state":"done","staged":"/c/.x"}"#))
            .unwrap()
            .unwrap();
        assert!(hidden.name().is_err());
    }

    #[test]
    fn a_live_process_is_taken_and_answered() {
        let tmp = tempfile::tempdir().unwrap();
        let staged = tmp.path().join("step-7");
        std::fs::create_dir_all(&staged).unwrap();
        std::fs::write(staged.join("w.bin"), b"weights").unwrap();
        let cdir = tmp.path().join("sg");
        let dir = CheckpointDir::host(&cdir).unwrap();
        let proc = ProcFs::default();
        let me = std::process::id() as i32;
        let acker = Acker {
            pid: me,
            start_time: proc.start_time(me).unwrap(),
            ns_pid: 4242,
        };
        let req = StagedRequest {
            staged: staged.clone(),
            upload: Some(tmp.path().join("dest").display().to_string()),
            step: Some(7),
            part: None,
        };
        let policy = UploadPolicy {
            allow: vec![
                AllowUpload::parse(&tmp.path().join("dest").display().to_string()).unwrap(),
            ],
        };
        let taken = take(&proc, acker, &dir, &req, None, &policy, &Limits::default()).unwrap();
        assert_eq!(taken.tree.files.len(), 1);
        assert!(matches!(taken.root, RootRecord::Host { .. }));
        let answer: Answer =
            serde_json::from_slice(&std::fs::read(cdir.join("upload-4242.json")).unwrap()).unwrap();
        assert_eq!(answer.state, AnswerState::Taken);
        assert_eq!(answer.files, Some(1));

        // Refused: the answer says why.
        let off = UploadPolicy::default();
        assert!(take(&proc, acker, &dir, &req, None, &off, &Limits::default()).is_err());
        let answer: Answer =
            serde_json::from_slice(&std::fs::read(cdir.join("upload-4242.json")).unwrap()).unwrap();
        assert_eq!(answer.state, AnswerState::Refused);
        assert!(answer.error.unwrap().contains("off"));
    }
}
