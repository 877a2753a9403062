//! `manifest.json`: the commit marker of an uploaded checkpoint, written after every file is
//! whole at the destination. It lists the files with their sizes and checksums (CRC-64/NVME and
//! CRC-32C of the bytes read from the staged files, computed while reading) and says how each
//! was verified against the store, then the step, the notice, where it came from and timings.
//! A checkpoint directory without a valid manifest does not exist for readers
//! (`upload::latest`).

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// Name of the commit marker at the top of an uploaded checkpoint; a staged file may not take it.
pub const MANIFEST_NAME: &str = "manifest.json";

/// The `format` every manifest carries; readers skip manifests of other formats.
pub const FORMAT: &str = "spotguard-checkpoint/1";

/// Manifests larger than this are not read (10 000 files take about 2 MB).
pub const MANIFEST_MAX_BYTES: u64 = 16 << 20;

/// How a file's content at the destination was checked after the upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifiedBy {
    /// The store's full-object CRC-64/NVME (S3 computes one for every new object) equals ours.
    Crc64Nvme,
    /// The store's CRC-32C (GCS keeps one for every object) equals ours.
    Crc32c,
    /// The store keeps no full-object checksum: its size equals ours (the bytes were protected
    /// in transit by the signed payload's SHA-256 over HTTP, by TLS over HTTPS).
    Size,
    /// A filesystem destination: written, synced and renamed by the agent itself.
    Written,
}

impl VerifiedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            VerifiedBy::Crc64Nvme => "crc64nvme",
            VerifiedBy::Crc32c => "crc32c",
            VerifiedBy::Size => "size",
            VerifiedBy::Written => "written",
        }
    }
}

/// One node's share of a checkpoint saved by several nodes (each node's agent uploads its own
/// shards into the same directory and writes its own manifest, `manifest.part-<i>-of-<n>.json`;
/// the checkpoint is complete when all `n` are there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Part {
    pub index: u32,
    pub count: u32,
}

impl Part {
    /// `I/N` (the CLI's `--part`).
    pub fn parse(text: &str) -> Result<Part, String> {
        let (i, n) = text
            .split_once('/')
            .ok_or_else(|| format!("part {text:?}: expected INDEX/COUNT, e.g. 0/4"))?;
        let part = Part {
            index: i
                .trim()
                .parse()
                .map_err(|_| format!("part {text:?}: bad index"))?,
            count: n
                .trim()
                .parse()
                .map_err(|_| format!("part {text:?}: bad count"))?,
        };
        part.check()?;
        Ok(part)
    }

    /// The index is below the count, the count between 1 and 10 000.
    pub fn check(self) -> Result<(), String> {
        if self.count == 0 || self.count > 10_000 || self.index >= self.count {
            return Err(format!(
                "part {}/{}: the index must be below the count (at most 10000)",
                self.index, self.count
            ));
        }
        Ok(())
    }
}

/// The commit marker's name: `manifest.json`, or `manifest.part-<i>-of-<n>.json` for one part.
pub fn manifest_file(part: Option<Part>) -> String {
    match part {
        None => MANIFEST_NAME.to_string(),
        Some(p) => format!("manifest.part-{}-of-{}.json", p.index, p.count),
    }
}

/// What a file name at the top of a checkpoint is: `Some(None)` for `manifest.json`,
/// `Some(Some(part))` for a part's manifest, `None` for anything else.
pub fn manifest_name(name: &str) -> Option<Option<Part>> {
    if name == MANIFEST_NAME {
        return Some(None);
    }
    let rest = name.strip_prefix("manifest.part-")?.strip_suffix(".json")?;
    let (i, n) = rest.split_once("-of-")?;
    let part = Part {
        index: i.parse().ok()?,
        count: n.parse().ok()?,
    };
    part.check().ok()?;
    (manifest_file(Some(part)) == name).then_some(Some(part))
}

/// Top-level names a staged tree may not use: the commit markers.
pub fn is_reserved(name: &str) -> bool {
    name == MANIFEST_NAME || name.starts_with("manifest.part-")
}

/// One file of the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Relative to the checkpoint's directory, `/`-separated.
    pub path: String,
    pub size: u64,
    /// CRC-64/NVME of the content, 16 hex digits.
    pub crc64nvme: String,
    /// CRC-32C of the content, 8 hex digits.
    pub crc32c: String,
    pub verified_by: VerifiedBy,
}

/// The notice the checkpoint was saved for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NoticeInfo {
    pub id: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// When the machine goes away (RFC 3339), if the cloud said.
    pub deadline: Option<String>,
}

/// Where the checkpoint came from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The staged directory as the trainer named it.
    pub staged: String,
    pub node: Option<String>,
    /// `namespace/name` in Kubernetes.
    pub pod: Option<String>,
}

/// When things happened (RFC 3339, the uploading machine's clock).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// When the trainer's `done` ack was seen, if the upload followed an ack.
    pub acked_at: Option<String>,
    pub started_at: String,
    pub completed_at: String,
    /// Wall time of the upload (across resumed runs: of the last one).
    pub upload_seconds: f64,
    /// The upload continued one that an earlier run of the uploader left unfinished.
    pub resumed: bool,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The checkpoint's directory name under its location.
    pub name: String,
    /// The training step the trainer acked, if it gave one.
    pub step: Option<u64>,
    /// This node's share, when several nodes save one checkpoint (absent: the whole of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub part: Option<Part>,
    pub files: Vec<ManifestFile>,
    pub file_count: usize,
    pub bytes: u64,
    pub notice: Option<NoticeInfo>,
    pub origin: Origin,
    pub timings: Timings,
    /// The spotguard release that wrote it.
    pub spotguard_version: String,
    /// Who published it: the job the location belongs to ([`super::owner::Writer`]'s text,
    /// `k8s:<namespace>/<Kind>/<name>` or `host:uid:<uid>`). Absent in manifests of earlier
    /// versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
}

impl Manifest {
    /// Parse and check a manifest read from checkpoint directory `name` under the file name of
    /// `part`: the right format, the same name and part, counts that add up. `Err` says why it
    /// does not count.
    pub fn parse(data: &[u8], name: &str, part: Option<Part>) -> Result<Manifest, String> {
        let m: Manifest = serde_json::from_slice(data).map_err(|e| e.to_string())?;
        if m.part != part {
            return Err(format!("part {:?} in a file named for {part:?}", m.part));
        }
        if m.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", m.format));
        }
        if m.name != name {
            return Err(format!(
                "names checkpoint {:?}, found in directory {name:?}",
                m.name
            ));
        }
        let bytes = m
            .files
            .iter()
            .try_fold(0u64, |sum, f| sum.checked_add(f.size));
        if m.file_count != m.files.len() || bytes != Some(m.bytes) {
            return Err("file count or byte total does not match the file list".to_string());
        }
        let mut seen = std::collections::HashSet::with_capacity(m.files.len());
        for f in &m.files {
            check_path(&f.path).map_err(|why| format!("file path {:?}: {why}", f.path))?;
            if !seen.insert(f.path.as_str()) {
                return Err(format!("file path {:?} listed twice", f.path));
            }
        }
        Ok(m)
    }

    /// The manifest as written: pretty JSON with a final newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).unwrap_or_default();
        v.push(b'\n');
        v
    }

    /// Whether `other` describes the same content (same files, sizes and checksums).
    pub fn same_content(&self, other: &Manifest) -> bool {
        self.files.len() == other.files.len()
            && self.files.iter().zip(&other.files).all(|(a, b)| {
                a.path == b.path
                    && a.size == b.size
                    && a.crc64nvme == b.crc64nvme
                    && a.crc32c == b.crc32c
            })
    }

    /// When it was completed, for ordering (`None` when unparsable).
    pub fn completed_at(&self) -> Option<Timestamp> {
        self.timings.completed_at.parse().ok()
    }
}

/// A file path a manifest may list: a clean relative key under the checkpoint's directory, as
/// the upload side produces them from a staged tree — `/`-separated non-empty segments, none
/// `.` or `..`, no NUL or control characters (the staged side refuses those names), not
/// spotguard's part-file infix, segments of at most 255 bytes, and not a commit marker at the
/// top. Everything else a file name may hold stays (`a\b`, `%25`, `?`, `#`, NFC and NFD forms):
/// those round-trip byte for byte.
pub fn check_path(path: &str) -> Result<(), &'static str> {
    if path.is_empty() {
        return Err("empty");
    }
    if path.starts_with('/') {
        return Err("absolute");
    }
    if path.chars().any(char::is_control) {
        return Err("NUL or control characters");
    }
    if path.contains(super::PART_INFIX) {
        return Err("spotguard's part-file infix");
    }
    for (i, seg) in path.split('/').enumerate() {
        match seg {
            "" => return Err("an empty segment"),
            "." | ".." => return Err("a '.' or '..' segment"),
            s if s.len() > 255 => return Err("a segment longer than 255 bytes"),
            s if i == 0 && is_reserved(s) => return Err("a manifest's name at the top"),
            _ => {}
        }
    }
    Ok(())
}

/// The checkpoint the manifests of one directory make up: the single manifest, or every part of
/// a multi-part one (same name, step and count; all indices present; a path in two parts only
/// with the same content), merged into one with `part: None` and the files of all parts. `Err`
/// says why it is not complete.
pub fn complete(mut manifests: Vec<Manifest>) -> Result<Manifest, String> {
    if let Some(i) = manifests.iter().position(|m| m.part.is_none()) {
        return Ok(manifests.swap_remove(i));
    }
    manifests.sort_by_key(|m| m.part.map(|p| p.index));
    let Some(first) = manifests.first().cloned() else {
        return Err("no manifest".into());
    };
    let count = first.part.map_or(1, |p| p.count);
    let have: Vec<u32> = manifests
        .iter()
        .filter_map(|m| m.part.map(|p| p.index))
        .collect();
    if have.len() != count as usize || have.iter().enumerate().any(|(i, x)| *x != i as u32) {
        return Err(format!("{} of {count} parts", have.len()));
    }
    let mut merged = first.clone();
    merged.part = None;
    let mut files: std::collections::BTreeMap<String, ManifestFile> = Default::default();
    for m in &manifests {
        if m.name != first.name || m.step != first.step || m.part.map(|p| p.count) != Some(count) {
            return Err("parts disagree on the name, step or count".into());
        }
        for f in &m.files {
            match files.get(&f.path) {
                Some(g) if g != f => return Err(format!("{} differs between parts", f.path)),
                _ => {
                    files.insert(f.path.clone(), f.clone());
                }
            }
        }
        if m.completed_at() > merged.completed_at() {
            merged.timings.completed_at = m.timings.completed_at.clone();
        }
        merged.timings.upload_seconds = merged.timings.upload_seconds.max(m.timings.upload_seconds);
        merged.timings.resumed |= m.timings.resumed;
    }
    merged.files = files.into_values().collect();
    merged.file_count = merged.files.len();
    merged.bytes = merged.files.iter().map(|f| f.size).sum();
    Ok(merged)
}

/// Order of "latest": the greatest step wins (a checkpoint without a step sorts before every
/// one with a step); equal steps are ordered by completion time, then by name.
pub fn newer(a: &Manifest, b: &Manifest) -> bool {
    let key = |m: &Manifest| (m.step.is_some(), m.step, m.completed_at(), m.name.clone());
    key(a) > key(b)
}

/// Hex of a CRC-64.
pub fn hex64(v: u64) -> String {
    format!("{v:016x}")
}

/// Hex of a CRC-32.
pub fn hex32(v: u32) -> String {
    format!("{v:08x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn manifest(name: &str, step: Option<u64>, completed: &str) -> Manifest {
        Manifest {
            format: FORMAT.to_string(),
            name: name.to_string(),
            step,
            part: None,
            files: vec![ManifestFile {
                path: "a".into(),
                size: 3,
                crc64nvme: hex64(1),
                crc32c: hex32(2),
                verified_by: VerifiedBy::Size,
            }],
            file_count: 1,
            bytes: 3,
            notice: None,
            origin: Origin::default(),
            timings: Timings {
                acked_at: None,
                started_at: completed.to_string(),
                completed_at: completed.to_string(),
                upload_seconds: 0.5,
                resumed: false,
            },
            spotguard_version: "0.1.0".into(),
            writer: None,
        }
    }

    #[test]
    fn manifests_round_trip_and_refuse_inconsistent_ones() {
        let m = manifest("step-1", Some(1), "2026-01-01T00:00:00Z");
        let bytes = m.to_bytes();
        assert_eq!(Manifest::parse(&bytes, "step-1", None).unwrap(), m);
        assert!(Manifest::parse(&bytes, "step-2", None).is_err());
        let part = Some(Part { index: 0, count: 2 });
        assert!(Manifest::parse(&bytes, "step-1", part).is_err());
        let mut wrong = m.clone();
        wrong.bytes = 4;
        assert!(Manifest::parse(&wrong.to_bytes(), "step-1", None).is_err());
        let mut other = m.clone();
        other.format = "x".into();
        assert!(Manifest::parse(&other.to_bytes(), "step-1", None).is_err());
        assert!(Manifest::parse(b"{", "step-1", None).is_err());
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["files"][0]["verified_by"], "size");
        assert_eq!(v["files"][0]["crc64nvme"], "0000000000000001");
    }

    #[test]
    fn file_paths_are_clean_relative_keys_as_the_writer_makes_them() {
        let with = |paths: &[&str]| {
            let mut m = manifest("step-1", Some(1), "2026-01-01T00:00:00Z");
            m.files = paths
                .iter()
                .map(|p| ManifestFile {
                    path: p.to_string(),
                    ..m.files[0].clone()
                })
                .collect();
            m.file_count = m.files.len();
            m.bytes = 3 * m.files.len() as u64;
            Manifest::parse(&m.to_bytes(), "step-1", None)
        };
        // What a staged tree legitimately holds round-trips.
        for ok in [
            "a",
            "sub/manifest.json",
            "a\\b",
            "%25",
            "q?x#y",
            "caf\u{e9}",
            "cafe\u{301}",
            "..x",
            ".hidden/x",
            "__0_0.distcp",
        ] {
            assert!(with(&[ok]).is_ok(), "{ok:?}: {:?}", with(&[ok]));
        }
        let long = "x".repeat(256);
        for bad in [
            "",
            "/etc/hostname",
            "../x",
            "a/../../x",
            "./a",
            "a/.",
            "a//b",
            "a/",
            "a\0b",
            "a\nb",
            "\u{7f}",
            "manifest.json",
            "manifest.part-0-of-2.json",
            "w.spotguard-part-h-1",
            long.as_str(),
        ] {
            assert!(with(&[bad]).is_err(), "{bad:?} accepted");
        }
        assert!(with(&["a", "a"]).unwrap_err().contains("twice"));
        // A byte total that overflows is not a total.
        let mut m = manifest("step-1", Some(1), "2026-01-01T00:00:00Z");
        m.files.push(ManifestFile {
            path: "b".into(),
            size: u64::MAX,
            ..m.files[0].clone()
        });
        m.file_count = 2;
        m.bytes = 2;
        assert!(Manifest::parse(&m.to_bytes(), "step-1", None).is_err());
    }

    #[test]
    fn parts_are_named_and_complete_only_together() {
        let p = Part::parse("1/3").unwrap();
        assert_eq!(manifest_file(Some(p)), "manifest.part-1-of-3.json");
        assert_eq!(manifest_name("manifest.part-1-of-3.json"), Some(Some(p)));
        assert_eq!(manifest_name("manifest.json"), Some(None));
        for bad in [
            "manifest.part-3-of-3.json",
            "manifest.part-01-of-3.json",
            "x.json",
        ] {
            assert_eq!(manifest_name(bad), None, "{bad}");
        }
        for bad in ["3/3", "0/0", "a/2", "1"] {
            assert!(Part::parse(bad).is_err(), "{bad}");
        }
        assert!(is_reserved("manifest.part-9"));

        let part = |i: u32, path: &str| {
            let mut m = manifest("step-5", Some(5), &format!("2026-01-01T00:00:0{i}Z"));
            m.part = Some(Part { index: i, count: 2 });
            m.files[0].path = path.into();
            m
        };
        assert!(complete(vec![part(0, "a")]).is_err());
        let both = complete(vec![part(1, "b"), part(0, "a")]).unwrap();
        assert_eq!(both.part, None);
        assert_eq!(both.file_count, 2);
        assert_eq!(both.bytes, 6);
        assert_eq!(both.timings.completed_at, "2026-01-01T00:00:01Z");
        let mut clash = part(1, "a");
        clash.files[0].size = 9;
        clash.bytes = 9;
        assert!(complete(vec![part(0, "a"), clash]).is_err());
        let mut other_step = part(1, "b");
        other_step.step = Some(6);
        assert!(complete(vec![part(0, "a"), other_step]).is_err());
    }

    #[test]
    fn latest_is_the_greatest_step_then_the_latest_completion() {
        let a = manifest("step-9", Some(9), "2026-01-02T00:00:00Z");
        let b = manifest("step-10", Some(10), "2026-01-01T00:00:00Z");
        let c = manifest("final", None, "2026-01-03T00:00:00Z");
        assert!(newer(&b, &a));
        assert!(newer(&a, &c));
        let d = manifest("step-10b", Some(10), "2026-01-01T00:00:01Z");
        assert!(newer(&d, &b));
    }
}
