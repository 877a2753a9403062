//! Whose a checkpoint location is. A location (`s3://bucket/run1`) belongs to one job: the
//! first upload to it writes the owner marker `<location>/.spotguard-location.json` naming its
//! [`Writer`] (created only if absent), every later upload checks it before sending anything,
//! and every manifest names its writer, so readers take only the owner's checkpoints. Two pods
//! of one job share the location (they are one writer); two jobs never do by accident (the
//! second one's uploads fail, named, and readers never mix their checkpoints).
//!
//! The step: a checkpoint's step is what its name proves ([`step_of_name`]: the last run of
//! digits, `step-1200` → 1200, at most [`MAX_STEP`]); an ack's `step` must agree with it, so a
//! stranger cannot make "latest" theirs with an absurd step.

use serde::{Deserialize, Serialize};

/// The owner marker's file name under a location (a checkpoint name never starts with `.`).
pub const MARKER_NAME: &str = ".spotguard-location.json";

/// The marker's `format`.
pub const MARKER_FORMAT: &str = "spotguard-location/1";

/// Markers larger than this are not read.
pub const MARKER_MAX_BYTES: u64 = 64 << 10;

/// The greatest step a checkpoint may carry (2^53 − 1: exact in every JSON reader).
pub const MAX_STEP: u64 = (1 << 53) - 1;

/// The job that writes a location's checkpoints, as text: `k8s:<namespace>/<Kind>/<name>` (the
/// pod's JobSet, else its controller, else the pod itself) or `host:uid:<uid>` (host mode: the
/// acking process's user).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Writer(pub String);

impl Writer {
    /// A Kubernetes job: `namespace`, its kind (`JobSet`, `Job`, `PyTorchJob`, `Pod`, …) and name.
    pub fn kube(namespace: &str, kind: &str, name: &str) -> Writer {
        Writer(format!("k8s:{namespace}/{kind}/{name}"))
    }

    /// A host-mode trainer running as `uid`.
    pub fn host(uid: u32) -> Writer {
        Writer(format!("host:uid:{uid}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `<location>/.spotguard-location.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub format: String,
    pub writer: Writer,
    /// RFC 3339, the first uploader's clock.
    pub created_at: String,
}

impl Marker {
    pub fn new(writer: Writer) -> Marker {
        Marker {
            format: MARKER_FORMAT.to_string(),
            writer,
            created_at: jiff::Timestamp::now().to_string(),
        }
    }

    /// Parse a marker read with a cap of [`MARKER_MAX_BYTES`]; `Err` says why it does not count.
    pub fn parse(data: &[u8]) -> Result<Marker, String> {
        if data.len() as u64 > MARKER_MAX_BYTES {
            return Err(format!("larger than {MARKER_MAX_BYTES} bytes"));
        }
        let m: Marker = serde_json::from_slice(data).map_err(|e| e.to_string())?;
        if m.format != MARKER_FORMAT {
            return Err(format!("format {:?}, expected {MARKER_FORMAT:?}", m.format));
        }
        if m.writer.0.is_empty() {
            return Err("no writer".into());
        }
        Ok(m)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec(self).unwrap_or_default();
        v.push(b'\n');
        v
    }
}

/// The step a checkpoint's name proves: its last run of ASCII digits (`step-1200` → 1200,
/// `epoch3-step0042` → 42). `Ok(None)`: the name has no digits; `Err`: the digits exceed
/// [`MAX_STEP`].
pub fn step_of_name(name: &str) -> Result<Option<u64>, String> {
    let bytes = name.as_bytes();
    let Some(end) = bytes.iter().rposition(u8::is_ascii_digit) else {
        return Ok(None);
    };
    let start = bytes[..end]
        .iter()
        .rposition(|b| !b.is_ascii_digit())
        .map_or(0, |i| i + 1);
    let digits = name[start..=end].trim_start_matches('0');
    if digits.is_empty() {
        return Ok(Some(0));
    }
    match digits.parse::<u64>() {
        Ok(n) if n <= MAX_STEP => Ok(Some(n)),
        _ => Err(format!(
            "step {digits} in the name {name:?} is larger than {MAX_STEP}"
        )),
    }
}

/// The step of checkpoint `name` given the step a writer claims: the name's step; a claim that
/// disagrees with it (or a claim on a name without digits) is refused.
pub fn checked_step(name: &str, claimed: Option<u64>) -> Result<Option<u64>, String> {
    let proved = step_of_name(name)?;
    match (proved, claimed) {
        (p, None) => Ok(p),
        (Some(p), Some(c)) if p == c => Ok(Some(p)),
        (Some(p), Some(c)) => Err(format!(
            "step {c} disagrees with the checkpoint's name {name:?} (step {p}): name checkpoints \
             after their step"
        )),
        (None, Some(c)) => Err(format!(
            "step {c} given but the checkpoint's name {name:?} carries no step: name checkpoints \
             after their step (e.g. step-{c})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_what_the_name_proves() {
        assert_eq!(step_of_name("step-1200"), Ok(Some(1200)));
        assert_eq!(step_of_name("epoch3-step0042"), Ok(Some(42)));
        assert_eq!(step_of_name("step-000"), Ok(Some(0)));
        assert_eq!(step_of_name("final"), Ok(None));
        assert!(step_of_name("step-18446744073709551615").is_err());
        assert!(step_of_name("step-9007199254740992").is_err());
        assert_eq!(step_of_name("step-9007199254740991"), Ok(Some(MAX_STEP)));
        assert_eq!(checked_step("step-200", Some(200)), Ok(Some(200)));
        assert_eq!(checked_step("step-200", None), Ok(Some(200)));
        assert!(checked_step("step-200", Some(u64::MAX)).is_err());
        assert!(checked_step("step-200", Some(201)).is_err());
        assert!(checked_step("final", Some(3)).is_err());
        assert_eq!(checked_step("final", None), Ok(None));
    }

    #[test]
    fn markers_round_trip_and_refuse_what_does_not_count() {
        let m = Marker::new(Writer::kube("ml", "Job", "train-a"));
        assert_eq!(Marker::parse(&m.to_bytes()).unwrap(), m);
        assert_eq!(m.writer.as_str(), "k8s:ml/Job/train-a");
        assert_eq!(Writer::host(1000).as_str(), "host:uid:1000");
        assert!(Marker::parse(br#"{"format":"x","writer":"a","created_at":""}"#).is_err());
        assert!(
            Marker::parse(br#"{"format":"spotguard-location/1","writer":"","created_at":""}"#)
                .is_err()
        );
        assert!(Marker::parse(&vec![b' '; (MARKER_MAX_BYTES + 1) as usize]).is_err());
    }
}
