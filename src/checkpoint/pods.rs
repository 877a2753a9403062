//! Pod opt-in annotations of checkpoint protocol v1 (docs/checkpoint-protocol.md), parsed from a k8s-openapi
//! [`Pod`]. Pure: listing the pods (field selector `spec.nodeName`) and mapping container ids to
//! host PIDs happen elsewhere.
//!
//! | annotation | default |
//! |---|---|
//! | `spotguard.io/checkpoint` | — (`"true"` opts in, `"false"` or absent: not opted in) |
//! | `spotguard.io/checkpoint-signal` | `--checkpoint-signal` (SIGUSR1) |
//! | `spotguard.io/checkpoint-target` | `handlers` |
//! | `spotguard.io/checkpoint-containers` | every container |
//! | `spotguard.io/checkpoint-dir` | `/tmp/spotguard` (inside the container) |
//! | `spotguard.io/checkpoint-timeout` | `--checkpoint-timeout` |
//!
//! Annotation values come from whoever can create pods: every value is checked, and a bad one is
//! an [`Error::Annotation`] naming it (the caller logs it, counts it and emits a `BadAnnotation`
//! Event on the pod) rather than a guess.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;

use super::{Error, PodRef, Signal, TargetMode};

pub const CHECKPOINT: &str = "spotguard.io/checkpoint";
pub const SIGNAL: &str = "spotguard.io/checkpoint-signal";
pub const TARGET: &str = "spotguard.io/checkpoint-target";
pub const CONTAINERS: &str = "spotguard.io/checkpoint-containers";
pub const DIR: &str = "spotguard.io/checkpoint-dir";
pub const TIMEOUT: &str = "spotguard.io/checkpoint-timeout";
/// Where the pod's staged checkpoints go (a location; checked by the upload side when a staged
/// ack needs it, never here: a bad value refuses that upload, not the pod's checkpoint).
pub const UPLOAD: &str = "spotguard.io/checkpoint-upload";
/// The label a JobSet puts on its pods: the JobSet's name.
pub const JOBSET_NAME_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
/// Longest `spotguard.io/checkpoint-upload` value kept.
const MAX_UPLOAD_LEN: usize = 2048;

/// Default checkpoint dir inside the container.
pub const DEFAULT_DIR: &str = "/tmp/spotguard";

/// Longest accepted `checkpoint-timeout`: the budget is also bounded by the notice deadline, so
/// this only rejects values that are certainly mistakes.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Longest accepted `checkpoint-dir` (Linux `PATH_MAX`).
const MAX_DIR_LEN: usize = 4096;

/// Agent-wide defaults for what a pod does not say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodDefaults {
    /// `--checkpoint-signal`.
    pub signal: Signal,
    /// `--checkpoint-timeout`.
    pub timeout: Duration,
    /// Checkpoint dir inside the container.
    pub dir: PathBuf,
    pub mode: TargetMode,
}

impl Default for PodDefaults {
    fn default() -> Self {
        PodDefaults {
            signal: Signal::USR1,
            timeout: Duration::from_secs(90),
            dir: PathBuf::from(DEFAULT_DIR),
            mode: TargetMode::Handlers,
        }
    }
}

/// What to checkpoint in one opted-in pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodCheckpointSpec {
    pub pod: PodRef,
    pub signal: Signal,
    pub mode: TargetMode,
    /// `(container name, container id without the runtime prefix)` of the selected containers
    /// that are running and have an id, in the order of the pod spec. May be empty (nothing
    /// running yet): the caller reports that pod as an error outcome.
    pub containers: Vec<(String, String)>,
    /// Checkpoint dir as the container sees it: absolute, normalised, no `.`/`..`.
    pub dir: PathBuf,
    pub timeout: Duration,
    /// `spotguard.io/checkpoint-upload` as written (at most 2 KiB), unchecked.
    pub upload: Option<String>,
    /// The job the pod belongs to: whose its checkpoint location is.
    pub owner: PodOwner,
}

/// The job a pod belongs to, as the upload side names a location's writer: the pod's JobSet
/// (label `jobset.sigs.k8s.io/jobset-name`), else its controller (the ownerReference with
/// `controller: true`: `Job/train-a`, `PyTorchJob/x`, …), else the pod itself. Every pod of one
/// job has the same owner, so they share its location; pods of two jobs never do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodOwner {
    pub namespace: String,
    pub kind: String,
    pub name: String,
}

impl PodOwner {
    /// The owner of `pod` (its namespace and name as given; the caller checked they exist).
    pub fn of(pod: &Pod) -> PodOwner {
        let meta = &pod.metadata;
        let namespace = meta.namespace.clone().unwrap_or_default();
        if let Some(js) = meta
            .labels
            .as_ref()
            .and_then(|l| l.get(JOBSET_NAME_LABEL))
            .filter(|v| !v.is_empty())
        {
            return PodOwner {
                namespace,
                kind: "JobSet".into(),
                name: js.clone(),
            };
        }
        if let Some(c) = meta.owner_references.as_ref().and_then(|refs| {
            refs.iter()
                .find(|r| r.controller == Some(true) && !r.kind.is_empty() && !r.name.is_empty())
        }) {
            return PodOwner {
                namespace,
                kind: c.kind.clone(),
                name: c.name.clone(),
            };
        }
        PodOwner {
            namespace,
            kind: "Pod".into(),
            name: meta.name.clone().unwrap_or_default(),
        }
    }
}

/// Where an opted-in pod's staged checkpoints go and whose they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadBinding {
    /// `spotguard.io/checkpoint-upload`, if set.
    pub location: Option<String>,
    pub owner: PodOwner,
}

impl PodCheckpointSpec {
    /// `namespace/name`, the target group name.
    pub fn name(&self) -> String {
        format!("{}/{}", self.pod.namespace, self.pod.name)
    }
}

/// Whether `pod` is one spotguard may checkpoint on `node`: bound to that node and `Running`.
/// A pod already terminating (deletion timestamp set) is still running its processes and stays a
/// candidate: a checkpoint request is still worth making.
pub fn is_candidate(pod: &Pod, node: &str) -> bool {
    let on_node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .is_some_and(|n| !node.is_empty() && n == node);
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Running");
    on_node && running
}

/// Split a `status.containerStatuses[].containerID` into runtime and id:
/// `containerd://<id>`, `cri-o://<id>`, `docker://<id>`. The id must be 1–128 lowercase hex
/// digits (runtimes use 64): it is matched against cgroup path components, so nothing else is
/// let through. `None` for anything else.
pub fn container_id(raw: &str) -> Option<(&str, &str)> {
    let (runtime, id) = raw.split_once("://")?;
    if !matches!(runtime, "containerd" | "cri-o" | "docker") {
        return None;
    }
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    if id.is_empty() || id.len() > 128 || !id.bytes().all(hex) {
        return None;
    }
    Some((runtime, id))
}

/// Parse the checkpoint annotations of `pod`. `Ok(None)`: not opted in. `Err`: opted in (or the
/// opt-in value itself is malformed) with a bad value, naming the annotation.
pub fn pod_checkpoint_spec(
    pod: &Pod,
    defaults: &PodDefaults,
) -> Result<Option<PodCheckpointSpec>, Error> {
    let meta = &pod.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    let name = meta.name.clone().unwrap_or_default();
    let shown = format!("{namespace}/{name}");
    let bad = |annotation: &'static str, reason: String| Error::Annotation {
        pod: shown.clone(),
        annotation,
        reason,
    };
    let annotation = |key: &str| meta.annotations.as_ref().and_then(|a| a.get(key));

    if !opted_in(annotation(CHECKPOINT)).map_err(|reason| bad(CHECKPOINT, reason))? {
        return Ok(None);
    }

    let uid = meta.uid.clone().unwrap_or_default();
    if name.is_empty() || uid.is_empty() {
        return Err(bad(CHECKPOINT, "pod has no name or uid".into()));
    }

    let signal = match annotation(SIGNAL) {
        None => defaults.signal,
        Some(v) => v
            .parse::<Signal>()
            .map_err(|e| bad(SIGNAL, shorten_reason(e)))?,
    };
    let mode = match annotation(TARGET) {
        None => defaults.mode,
        Some(v) => v
            .parse::<TargetMode>()
            .map_err(|e| bad(TARGET, shorten_reason(e)))?,
    };
    let dir = match annotation(DIR) {
        None => defaults.dir.clone(),
        Some(v) => parse_dir(v).map_err(|reason| bad(DIR, reason))?,
    };
    let timeout = match annotation(TIMEOUT) {
        None => defaults.timeout,
        Some(v) => parse_timeout(v).map_err(|reason| bad(TIMEOUT, reason))?,
    };

    let spec_names: Vec<&str> = pod
        .spec
        .as_ref()
        .map(|s| s.containers.iter().map(|c| c.name.as_str()).collect())
        .unwrap_or_default();
    let selected = selected_containers(annotation(CONTAINERS), &spec_names)
        .map_err(|reason| bad(CONTAINERS, reason))?;
    let containers = running_containers(pod, &spec_names, &selected);

    Ok(Some(PodCheckpointSpec {
        pod: PodRef {
            namespace,
            name,
            uid,
        },
        signal,
        mode,
        containers,
        dir,
        timeout,
        upload: annotation(UPLOAD)
            .map(|v| v.trim())
            .filter(|v| !v.is_empty() && v.len() <= MAX_UPLOAD_LEN)
            .map(str::to_string),
        owner: PodOwner::of(pod),
    }))
}

/// The opt-in annotation: `true` or `false` (any case); absent is `false`.
fn opted_in(value: Option<&String>) -> Result<bool, String> {
    match value.map(|v| v.trim()) {
        None => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
        Some(v) => Err(format!(
            "expected \"true\" or \"false\", got {}",
            shorten(v)
        )),
    }
}

/// The containers the `containers` annotation names (each once, in its order), every one a
/// container of the pod's spec; without it, all of them.
fn selected_containers<'a>(
    value: Option<&'a String>,
    spec_names: &[&'a str],
) -> Result<Vec<&'a str>, String> {
    let Some(v) = value else {
        return Ok(spec_names.to_vec());
    };
    let mut names: Vec<&str> = Vec::new();
    for n in v.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if !spec_names.contains(&n) {
            return Err(format!(
                "{} is not a container of the pod (containers: {})",
                shorten(n),
                spec_names.join(", ")
            ));
        }
        if !names.contains(&n) {
            names.push(n);
        }
    }
    if names.is_empty() {
        return Err("names no container".into());
    }
    Ok(names)
}

/// The selected containers that run, in the spec's order, with their container ids.
fn running_containers(pod: &Pod, spec_names: &[&str], selected: &[&str]) -> Vec<(String, String)> {
    let statuses = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_deref())
        .unwrap_or_default();
    spec_names
        .iter()
        .filter(|n| selected.contains(n))
        .filter_map(|n| {
            let status = statuses.iter().find(|s| s.name == *n)?;
            let running = status.state.as_ref().is_some_and(|s| s.running.is_some());
            let (_, id) = container_id(status.container_id.as_deref()?)?;
            running.then(|| (n.to_string(), id.to_string()))
        })
        .collect()
}

fn parse_dir(value: &str) -> Result<PathBuf, String> {
    let v = value.trim();
    if v.is_empty() {
        return Err("empty".into());
    }
    if v.len() > MAX_DIR_LEN {
        return Err(format!("longer than {MAX_DIR_LEN} bytes"));
    }
    if v.chars().any(char::is_control) {
        return Err(format!("contains control characters: {}", shorten(v)));
    }
    if !v.starts_with('/') {
        return Err(format!("must be an absolute path, got {}", shorten(v)));
    }
    // Split by hand: Path::components() would silently drop interior "." segments.
    let mut normal = PathBuf::from("/");
    for segment in v.split('/').filter(|s| !s.is_empty()) {
        if segment == "." || segment == ".." {
            return Err(format!(
                "must not contain '.' or '..' components, got {}",
                shorten(v)
            ));
        }
        normal.push(segment);
    }
    if normal == Path::new("/") {
        return Err("must name a directory below /".into());
    }
    Ok(normal)
}

fn parse_timeout(value: &str) -> Result<Duration, String> {
    let v = value.trim();
    let d = crate::duration::parse(v)
        .map_err(|_| format!("{} is not a duration like 90s or 2m", shorten(v)))?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    if d > MAX_TIMEOUT {
        return Err(format!(
            "{} is longer than {}",
            shorten(v),
            crate::duration::display(MAX_TIMEOUT)
        ));
    }
    Ok(d)
}

/// Quote a hostile value for an error message, bounded in length.
fn shorten(v: &str) -> String {
    const MAX: usize = 64;
    if v.chars().count() <= MAX {
        format!("{v:?}")
    } else {
        let head: String = v.chars().take(MAX).collect();
        format!("{head:?}…")
    }
}

/// Bound a parse error message that may embed the whole hostile value.
fn shorten_reason(reason: String) -> String {
    const MAX: usize = 200;
    if reason.chars().count() <= MAX {
        reason
    } else {
        let head: String = reason.chars().take(MAX).collect();
        format!("{head}…")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{
        Container, ContainerState, ContainerStateRunning, ContainerStateWaiting, ContainerStatus,
        PodSpec, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    const ID_A: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const ID_B: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

    enum State {
        Running,
        Waiting,
        NoId,
    }

    fn status(name: &str, raw_id: &str, state: State) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            container_id: match state {
                State::NoId => None,
                _ => Some(raw_id.into()),
            },
            state: Some(match state {
                State::Running | State::NoId => ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                },
                State::Waiting => ContainerState {
                    waiting: Some(ContainerStateWaiting::default()),
                    ..Default::default()
                },
            }),
            ..Default::default()
        }
    }

    /// A Running pod on node-a with containers trainer (running), sidecar (running) and
    /// logger (waiting), annotated with `annotations`.
    fn pod(annotations: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                namespace: Some("ml".into()),
                name: Some("train-0".into()),
                uid: Some("3f1c8e52-8a8e-4d3b-9c55-0c4f9b7f6a10".into()),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                containers: ["trainer", "sidecar", "logger"]
                    .into_iter()
                    .map(|n| Container {
                        name: n.into(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                container_statuses: Some(vec![
                    // Status order differs from spec order on purpose.
                    status("sidecar", &format!("cri-o://{ID_B}"), State::Running),
                    status("trainer", &format!("containerd://{ID_A}"), State::Running),
                    status("logger", &format!("containerd://{ID_B}"), State::Waiting),
                ]),
                ..Default::default()
            }),
        }
    }

    fn spec(annotations: &[(&str, &str)]) -> Result<Option<PodCheckpointSpec>, Error> {
        pod_checkpoint_spec(&pod(annotations), &PodDefaults::default())
    }

    #[test]
    fn a_pods_owner_is_its_jobset_else_its_controller_else_itself() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let owner_ref = |kind: &str, name: &str, controller: Option<bool>| OwnerReference {
            api_version: "batch/v1".into(),
            kind: kind.into(),
            name: name.into(),
            uid: "u".into(),
            controller,
            ..Default::default()
        };
        let mut p = pod(&[(CHECKPOINT, "true")]);
        let owner = |p: &Pod| {
            let o = pod_checkpoint_spec(p, &PodDefaults::default())
                .unwrap()
                .unwrap()
                .owner;
            format!("{}/{}/{}", o.namespace, o.kind, o.name)
        };
        assert_eq!(owner(&p), "ml/Pod/train-0");
        // An owner that is not the controller does not count.
        p.metadata.owner_references = Some(vec![
            owner_ref("ConfigMap", "cm", None),
            owner_ref("Job", "train-a", Some(true)),
        ]);
        assert_eq!(owner(&p), "ml/Job/train-a");
        p.metadata.owner_references = Some(vec![owner_ref("PyTorchJob", "x", Some(false))]);
        assert_eq!(owner(&p), "ml/Pod/train-0");
        p.metadata.owner_references = Some(vec![owner_ref("Job", "js-workers-0", Some(true))]);
        p.metadata.labels = Some(BTreeMap::from([(
            JOBSET_NAME_LABEL.to_string(),
            "js".to_string(),
        )]));
        assert_eq!(owner(&p), "ml/JobSet/js");
    }

    #[test]
    fn not_opted_in() {
        for annotations in [
            &[][..],
            &[(CHECKPOINT, "false")][..],
            &[(CHECKPOINT, " FALSE ")][..],
            // Other annotations without the opt-in are ignored, even bad ones.
            &[(SIGNAL, "SIGKILL"), (DIR, "relative")][..],
        ] {
            assert_eq!(spec(annotations).unwrap(), None, "{annotations:?}");
        }
        let mut p = pod(&[]);
        p.metadata.annotations = None;
        assert_eq!(
            pod_checkpoint_spec(&p, &PodDefaults::default()).unwrap(),
            None
        );
    }

    #[test]
    fn defaults_apply() {
        let s = spec(&[(CHECKPOINT, "true")]).unwrap().unwrap();
        assert_eq!(
            s.pod,
            PodRef {
                namespace: "ml".into(),
                name: "train-0".into(),
                uid: "3f1c8e52-8a8e-4d3b-9c55-0c4f9b7f6a10".into(),
            }
        );
        assert_eq!(s.name(), "ml/train-0");
        assert_eq!(s.signal, Signal::USR1);
        assert_eq!(s.mode, TargetMode::Handlers);
        assert_eq!(s.dir, PathBuf::from("/tmp/spotguard"));
        assert_eq!(s.timeout, Duration::from_secs(90));
        // Spec order; the waiting logger is left out.
        assert_eq!(
            s.containers,
            vec![
                ("trainer".to_string(), ID_A.to_string()),
                ("sidecar".to_string(), ID_B.to_string()),
            ]
        );

        let defaults = PodDefaults {
            signal: Signal::USR2,
            timeout: Duration::from_secs(30),
            dir: PathBuf::from("/ckpt"),
            mode: TargetMode::All,
        };
        let s = pod_checkpoint_spec(&pod(&[(CHECKPOINT, "True")]), &defaults)
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.signal, s.mode, s.dir, s.timeout),
            (
                Signal::USR2,
                TargetMode::All,
                PathBuf::from("/ckpt"),
                Duration::from_secs(30)
            )
        );
    }

    #[test]
    fn valid_values() {
        type Check = fn(&PodCheckpointSpec) -> bool;
        let cases: &[(&str, &str, Check)] = &[
            (SIGNAL, "SIGUSR2", |s| s.signal == Signal::USR2),
            (SIGNAL, "usr2", |s| s.signal == Signal::USR2),
            (SIGNAL, " SIGTERM ", |s| s.signal == Signal::TERM),
            (SIGNAL, "10", |s| s.signal == Signal(libc::SIGUSR1)),
            (SIGNAL, "SIGINT", |s| s.signal == Signal(libc::SIGINT)),
            (TARGET, "pid1", |s| s.mode == TargetMode::Pid1),
            (TARGET, "all", |s| s.mode == TargetMode::All),
            (TARGET, "caught", |s| s.mode == TargetMode::Caught),
            (TARGET, "handlers", |s| s.mode == TargetMode::Handlers),
            (DIR, "/var/run/spotguard", |s| {
                s.dir == Path::new("/var/run/spotguard")
            }),
            (DIR, "  //data//ckpt/  ", |s| {
                s.dir == Path::new("/data/ckpt")
            }),
            (DIR, "/ü/spötguard", |s| {
                s.dir == Path::new("/ü/spötguard")
            }),
            (TIMEOUT, "2m", |s| s.timeout == Duration::from_secs(120)),
            (TIMEOUT, "1m 30s", |s| s.timeout == Duration::from_secs(90)),
            (TIMEOUT, "500ms", |s| {
                s.timeout == Duration::from_millis(500)
            }),
            (TIMEOUT, "24h", |s| s.timeout == MAX_TIMEOUT),
            (CONTAINERS, "trainer", |s| {
                s.containers == vec![("trainer".to_string(), ID_A.to_string())]
            }),
            // Order follows the spec, duplicates and blanks are dropped.
            (CONTAINERS, " sidecar , trainer,,trainer ", |s| {
                s.containers
                    == vec![
                        ("trainer".to_string(), ID_A.to_string()),
                        ("sidecar".to_string(), ID_B.to_string()),
                    ]
            }),
            // A selected container that is not running is simply not a target (yet).
            (CONTAINERS, "logger", |s| s.containers.is_empty()),
        ];
        for (key, value, check) in cases {
            let s = spec(&[(CHECKPOINT, "true"), (key, value)])
                .unwrap_or_else(|e| panic!("{key}={value:?}: {e}"))
                .unwrap();
            assert!(check(&s), "{key}={value:?}: {s:?}");
        }
    }

    #[test]
    fn bad_values_name_the_annotation() {
        let long = "x".repeat(5000);
        let long_dir = format!("/{long}");
        let cases: &[(&str, &str, &str)] = &[
            (CHECKPOINT, "yes", "expected"),
            (CHECKPOINT, "1", "expected"),
            (CHECKPOINT, "", "expected"),
            (SIGNAL, "SIGKILL", "SIGKILL"),
            (SIGNAL, "SIGSTOP", "SIGSTOP"),
            (SIGNAL, "9", "cannot be caught"),
            (SIGNAL, "19", "cannot be caught"),
            (SIGNAL, "0", "is not a signal"),
            (SIGNAL, "65", "is not a signal"),
            (SIGNAL, "-10", "is not a signal"),
            (SIGNAL, "", "signal"),
            (SIGNAL, "SIGUSR1; rm -rf /", "signal"),
            (SIGNAL, &long, "…"),
            (TARGET, "everything", "unknown checkpoint target"),
            (TARGET, "", "unknown checkpoint target"),
            (TARGET, "PID1", "unknown checkpoint target"),
            (DIR, "", "empty"),
            (DIR, "   ", "empty"),
            (DIR, "tmp/spotguard", "absolute"),
            (DIR, "./spotguard", "absolute"),
            (DIR, "/", "below /"),
            (DIR, "///", "below /"),
            (DIR, "/tmp/../etc", "'..'"),
            (DIR, "/../../../../etc/shadow", "'..'"),
            (DIR, "/tmp/./x", "'.'"),
            (DIR, "/tmp/spot\0guard", "control"),
            (DIR, "/tmp/spot\nguard", "control"),
            (DIR, &long_dir, "longer than"),
            (TIMEOUT, "", "not a duration"),
            (TIMEOUT, "90", "not a duration"),
            (TIMEOUT, "-5s", "not a duration"),
            (TIMEOUT, "1e9s", "not a duration"),
            (TIMEOUT, "soon", "not a duration"),
            (TIMEOUT, "0s", "greater than zero"),
            (TIMEOUT, "25h", "longer than"),
            (TIMEOUT, "99999999999999999999s", "not a duration"),
            (CONTAINERS, "", "names no container"),
            (CONTAINERS, " , ,", "names no container"),
            (CONTAINERS, "trainer,ghost", "\"ghost\" is not a container"),
            (CONTAINERS, "Trainer", "is not a container"),
            (CONTAINERS, "../trainer", "is not a container"),
            (CONTAINERS, &long, "…"),
        ];
        for (key, value, needle) in cases {
            let err = spec(&[(CHECKPOINT, "true"), (key, value)])
                .map(|_| ())
                .expect_err(&format!("{key}={value:?} must be rejected"));
            match &err {
                Error::Annotation {
                    pod,
                    annotation,
                    reason,
                } => {
                    assert_eq!(pod, "ml/train-0");
                    assert_eq!(annotation, key, "{value:?}");
                    assert!(
                        reason.contains(needle),
                        "{key}={value:?}: {reason:?} lacks {needle:?}"
                    );
                    assert!(reason.len() < 600, "unbounded reason for {key}");
                }
                other => panic!("{key}={value:?}: wrong error {other:?}"),
            }
            assert_eq!(err.metric_label(), "annotation");
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn opted_in_pod_without_identity_is_an_error() {
        let mut p = pod(&[(CHECKPOINT, "true")]);
        p.metadata.uid = None;
        let err = pod_checkpoint_spec(&p, &PodDefaults::default()).unwrap_err();
        assert!(matches!(
            err,
            Error::Annotation {
                annotation: CHECKPOINT,
                ..
            }
        ));
    }

    #[test]
    fn containers_without_usable_ids_are_skipped() {
        let mut p = pod(&[(CHECKPOINT, "true")]);
        if let Some(st) = p.status.as_mut() {
            st.container_statuses = Some(vec![
                status("trainer", "", State::NoId),
                status("sidecar", "rkt://abc", State::Running),
                status(
                    "logger",
                    &format!("containerd://{ID_B}/../x"),
                    State::Running,
                ),
            ]);
        }
        let s = pod_checkpoint_spec(&p, &PodDefaults::default())
            .unwrap()
            .unwrap();
        assert!(s.containers.is_empty(), "{:?}", s.containers);

        // No status at all yet.
        let mut p = pod(&[(CHECKPOINT, "true")]);
        p.status = None;
        let s = pod_checkpoint_spec(&p, &PodDefaults::default())
            .unwrap()
            .unwrap();
        assert!(s.containers.is_empty());
    }

    #[test]
    fn container_id_table() {
        let a128 = "a".repeat(128);
        let cases: Vec<(String, Option<(&str, &str)>)> = vec![
            ("containerd://abc123".into(), Some(("containerd", "abc123"))),
            (format!("cri-o://{ID_A}"), Some(("cri-o", ID_A))),
            (format!("docker://{ID_B}"), Some(("docker", ID_B))),
            (format!("containerd://{a128}"), Some(("containerd", &a128))),
            (format!("containerd://{a128}a"), None),
            ("containerd://".into(), None),
            ("containerd:/abc".into(), None),
            ("abc123".into(), None),
            ("".into(), None),
            ("://abc".into(), None),
            ("rkt://abc".into(), None),
            ("CONTAINERD://abc".into(), None),
            ("containerd://ABC".into(), None),
            ("containerd://abc/def".into(), None),
            ("containerd://../../etc".into(), None),
            ("containerd://abc def".into(), None),
            ("containerd://abc\n".into(), None),
            ("containerd://abc://def".into(), None),
            ("containerd://ab\u{0}c".into(), None),
            ("containerd://\u{ff21}\u{ff22}".into(), None),
        ];
        for (raw, want) in &cases {
            assert_eq!(container_id(raw), *want, "{raw:?}");
        }
    }

    #[test]
    fn candidates() {
        let p = pod(&[]);
        assert!(is_candidate(&p, "node-a"));
        assert!(!is_candidate(&p, "node-b"));
        assert!(!is_candidate(&p, ""));

        for phase in [
            Some("Pending"),
            Some("Succeeded"),
            Some("Failed"),
            Some("Unknown"),
            Some("running"),
            None,
        ] {
            let mut p = pod(&[]);
            if let Some(st) = p.status.as_mut() {
                st.phase = phase.map(str::to_string);
            }
            assert!(!is_candidate(&p, "node-a"), "{phase:?}");
        }

        let mut p = pod(&[]);
        p.status = None;
        assert!(!is_candidate(&p, "node-a"));

        let mut p = pod(&[]);
        p.spec = None;
        assert!(!is_candidate(&p, "node-a"));

        let mut p = pod(&[]);
        if let Some(sp) = p.spec.as_mut() {
            sp.node_name = None;
        }
        assert!(!is_candidate(&p, "node-a"));
        assert!(!is_candidate(&p, ""));
    }
}
