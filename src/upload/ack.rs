//! The protocol side of staged checkpoints (docs/checkpoint-protocol.md, "Staged checkpoints").
//!
//! A trainer acks `done` with `"staged": "/local/ckpt/step-1200"` (and optionally
//! `"upload": "s3://bucket/run1"`), then waits for the agent's answer, `upload-<pid>.json` in
//! the same checkpoint dir: `taken` once every staged file is open in the agent (the trainer may
//! exit at once: the upload no longer needs its container, its mount namespace, or even the
//! files' names), or `refused` with the reason (the trainer still has time to save elsewhere).
//! [`take`] is that step: it runs on the ack watcher's thread while the process is alive.
//!
//! The checkpoint's destination is `<location>/<name>`: the location is the job's, the pod's
//! `spotguard.io/checkpoint-upload` annotation (host mode: `--checkpoint-upload`), or a place
//! below it the ack's `upload` names; the name is the staged directory's base name, and the
//! ack's `step` must agree with the step the name carries. It must pass the operator's
//! `--upload-allow`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::dest::{validate_checkpoint_name, Granted, Location, UploadPolicy};
use super::journal::RootRecord;
use super::manifest::Part;
use super::owner::Writer;
use super::staged::{self, Limits, Root, StagedTree};
use super::target::Target;
use super::Error;
use crate::checkpoint::ack::{AckFile, AckState, CheckpointDir};
use crate::checkpoint::procfs::ProcFs;
use crate::store::url::StoreOptions;

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
    /// The ack's step (one that is not a non-negative integer reads as `u64::MAX`: it agrees
    /// with no checkpoint name).
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
            step: match &ack.step {
                None | Some(serde_json::Value::Null) => None,
                // A step that is no u64 (negative, fractional, a string) can agree with no name.
                Some(v) => Some(v.as_u64().unwrap_or(u64::MAX)),
            },
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
    /// The location it is listed under (the job's bound location, or the one below it the ack
    /// named): where the owner marker is.
    pub location: Location,
    pub granted: Granted,
    pub name: String,
    /// The step the name proves (the ack's `step` must agree: [`super::owner::checked_step`]).
    pub step: Option<u64>,
}

/// Resolve the destination of `req`: the job's `bound` location (the pod's annotation or the
/// host flag), or the location the ack's `upload` names at or below it, joined with the
/// checkpoint's name, checked against `policy` for the pod's `namespace`; the ack's step checked
/// against the name.
/// Without a bound location nothing is uploaded: a trainer never chooses where its checkpoint
/// goes, only where below its job's location.
pub fn resolve(
    req: &StagedRequest,
    bound: Option<&str>,
    policy: &UploadPolicy,
    namespace: Option<&str>,
) -> Result<Resolved, Error> {
    let bound_text = bound.ok_or_else(|| Error::InvalidDestination {
        dest: req.upload.clone().unwrap_or_default(),
        reason: format!(
            "no location is bound to this job: the pod has no {UPLOAD_ANNOTATION} annotation \
             (host mode: --checkpoint-upload); an ack's `upload` may only name a place at or \
             below it"
        ),
    })?;
    let bound = Location::parse(bound_text)?;
    let location = match req.upload.as_deref() {
        None => bound.clone(),
        Some(text) => {
            let named = Location::parse(text)?;
            if !named.is_within(&bound) {
                return Err(Error::NotAllowed {
                    dest: named.display(),
                    reason: format!(
                        "the ack's `upload` must be the job's location {} or below it",
                        bound.display()
                    ),
                });
            }
            named
        }
    };
    let name = req.name()?;
    let step = super::owner::checked_step(&name, req.step).map_err(|reason| Error::Step {
        name: name.clone(),
        reason,
    })?;
    let destination = location.join(&name);
    let granted = policy.check(&destination, namespace)?;
    Ok(Resolved {
        destination,
        location,
        granted,
        name,
        step,
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

/// A staged checkpoint taken: the tree open, where it goes (opened), how it was captured.
pub struct Taken {
    pub tree: StagedTree,
    pub resolved: Resolved,
    pub root: RootRecord,
    pub target: Target,
    /// Whose checkpoint it is (the location's owner marker must name it).
    pub writer: Writer,
}

/// What the job binds a staged checkpoint to: its location (the pod's annotation, host mode's
/// `--checkpoint-upload`) and, in Kubernetes, its writer (the pod's owner; host mode: `None`,
/// the acking process's uid is the writer).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Binding {
    pub location: Option<String>,
    pub writer: Option<Writer>,
    /// The pod's namespace (Kubernetes; host mode: `None`): what `{namespace}` in the
    /// allow-list stands for.
    pub namespace: Option<String>,
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken")
            .field("resolved", &self.resolved)
            .field("target", &self.target.display())
            .field("writer", &self.writer)
            .finish()
    }
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

/// On a `done` ack with `staged`, while the process lives: resolve and check the destination
/// (bound to the job, allowed, the step its name proves), capture the staged tree through the
/// process's root, open the destination (a directory: its allowed base as the operator made it)
/// and check that the store will take every key, then answer (`taken` or `refused`) in its
/// checkpoint dir: `taken` means nothing the agent can know of stands in the way of publishing.
/// Blocking and quick (directory reads and opens: milliseconds for thousands of files; no
/// network); never on the signal path. A failed answer write is logged, not fatal: the
/// trainer's wait times out and it exits anyway.
#[allow(clippy::too_many_arguments)]
pub fn take(
    proc: &ProcFs,
    acker: Acker,
    dir: &CheckpointDir,
    req: &StagedRequest,
    binding: &Binding,
    policy: &UploadPolicy,
    limits: &Limits,
    store: &StoreOptions,
) -> Result<Taken, Error> {
    let result = (|| {
        let resolved = resolve(
            req,
            binding.location.as_deref(),
            policy,
            binding.namespace.as_deref(),
        )?;
        let root = Root::of_process(proc, acker.pid, acker.start_time)?;
        let writer = match (&binding.writer, root.uid) {
            (Some(w), _) => w.clone(),
            (None, Some(uid)) => Writer::host(uid),
            (None, None) => {
                return Err(Error::InvalidDestination {
                    dest: resolved.destination.display(),
                    reason: "no writer identity for this trainer".into(),
                })
            }
        };
        let record = if root.is_host_root() {
            RootRecord::Host { owner: root.uid }
        } else {
            RootRecord::Process {
                pid: acker.pid,
                start_time: acker.start_time,
            }
        };
        let tree = staged::capture(&root, &req.staged, limits)?;
        let target = Target::open(&resolved.destination, &resolved.granted, store)?;
        target.check_keys(
            tree.files.iter().map(|f| f.path.as_str()),
            &super::manifest::manifest_file(req.part),
        )?;
        Ok(Taken {
            tree,
            resolved,
            root: record,
            target,
            writer,
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
            own_dirs: Vec::new(),
        };
        // The ack's `upload` at or below the job's location.
        let r = resolve(&req, Some("s3://ck/run1"), &policy, None).unwrap();
        assert_eq!(r.destination.display(), "s3://ck/run1/step-1200");
        assert_eq!(r.location.display(), "s3://ck/run1");
        assert_eq!(r.step, Some(1200));
        assert_eq!(
            resolve(&req, Some("s3://ck"), &policy, None)
                .unwrap()
                .destination
                .display(),
            "s3://ck/run1/step-1200"
        );
        // Anywhere else, or with no location bound to the job: refused.
        for bound in [
            "s3://other/x",
            "s3://ck/run1/sub",
            "s3://ck/run",
            "gs://ck/run1",
        ] {
            assert_eq!(
                resolve(&req, Some(bound), &policy, None)
                    .unwrap_err()
                    .metric_label(),
                "not_allowed",
                "{bound}"
            );
        }
        assert_eq!(
            resolve(&req, None, &policy, None)
                .unwrap_err()
                .metric_label(),
            "invalid_destination"
        );
        // The bound location when the ack names nothing; refused when not allowed.
        let mut bare = req.clone();
        bare.upload = None;
        assert_eq!(
            resolve(&bare, Some("s3://ck/run2"), &policy, None)
                .unwrap()
                .destination
                .display(),
            "s3://ck/run2/step-1200"
        );
        assert_eq!(
            resolve(&bare, Some("s3://other/x"), &policy, None)
                .unwrap_err()
                .metric_label(),
            "not_allowed"
        );
        assert!(resolve(&bare, None, &policy, None).is_err());
        // The step is the name's: an absurd or disagreeing one is refused.
        for step in [u64::MAX, 1201, 0] {
            let mut forged = bare.clone();
            forged.step = Some(step);
            assert_eq!(
                resolve(&forged, Some("s3://ck/run2"), &policy, None)
                    .unwrap_err()
                    .metric_label(),
                "step",
                "{step}"
            );
        }
        let negative = StagedRequest::from_ack(&ack(
            r#"{"state":"done","step":-5,"staged":"/local/ckpt/step-5"}"#,
        ))
        .unwrap()
        .unwrap();
        assert!(resolve(&negative, Some("s3://ck/run2"), &policy, None).is_err());
        let mut unnumbered = bare.clone();
        unnumbered.staged = PathBuf::from("/local/ckpt/final");
        unnumbered.step = None;
        assert_eq!(
            resolve(&unnumbered, Some("s3://ck/run2"), &policy, None)
                .unwrap()
                .step,
            None
        );
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
            own_dirs: vec![cdir.clone()],
        };
        let binding = Binding {
            location: req.upload.clone(),
            writer: None,
            namespace: None,
        };
        let store = StoreOptions::default();
        let taken = take(
            &proc,
            acker,
            &dir,
            &req,
            &binding,
            &policy,
            &Limits::default(),
            &store,
        )
        .unwrap();
        assert_eq!(taken.tree.files.len(), 1);
        assert!(matches!(taken.root, RootRecord::Host { .. }));
        // Host mode: the acking process's uid is the writer.
        assert_eq!(
            taken.writer,
            Writer::host(rustix::process::getuid().as_raw())
        );
        let answer: Answer =
            serde_json::from_slice(&std::fs::read(cdir.join("upload-4242.json")).unwrap()).unwrap();
        assert_eq!(answer.state, AnswerState::Taken);
        assert_eq!(answer.files, Some(1));

        // Refused: the answer says why.
        let off = UploadPolicy::default();
        assert!(take(
            &proc,
            acker,
            &dir,
            &req,
            &binding,
            &off,
            &Limits::default(),
            &store
        )
        .is_err());
        let answer: Answer =
            serde_json::from_slice(&std::fs::read(cdir.join("upload-4242.json")).unwrap()).unwrap();
        assert_eq!(answer.state, AnswerState::Refused);
        assert!(answer.error.unwrap().contains("off"));
    }
}
