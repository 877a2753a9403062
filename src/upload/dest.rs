//! Where checkpoints go: a *location* (a job's checkpoint root: `s3://bucket/run1`,
//! `gs://bucket/run1`, `file:///mnt/efs/run1` or `/mnt/efs/run1`), each checkpoint in a
//! directory of its own under it (`<location>/<name>/…`, `<name>/manifest.json` last), and the
//! operator's `--upload-allow` list that says which locations the agent may write with its own
//! identity, for the pod of which namespace (a pattern may name `{namespace}`: each pod's own).
//!
//! Object-store patterns are the allow-list patterns of the store floor ([`crate::store::AllowPattern`]:
//! `s3://BUCKET[/PREFIX]`, `*` in BUCKET, PREFIX on whole segments, `{namespace}` a whole
//! segment); filesystem patterns are absolute directories, matched on whole path components
//! (`{namespace}` a whole component, replaced by the same [`crate::store::allow::with_namespace`]). A filesystem destination is opened
//! *from* the allowed directory with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, so a symlink that
//! someone with write access to a shared filesystem plants below it can never redirect the
//! agent's writes.

use std::path::{Component, Path, PathBuf};

use super::Error;
use crate::store::url::{Scheme, SourceUrl};
use crate::store::{allow, AllowPattern};

/// A job's checkpoint root, or one checkpoint's directory ([`Location::join`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// `s3://` or `gs://` (the parsed URL; its `prefix` has no leading or trailing `/`).
    Store(SourceUrl),
    /// An absolute directory (given as `/dir` or `file:///dir`), lexically normal.
    Dir(PathBuf),
}

impl Location {
    /// Parse `s3://bucket[/prefix]`, `gs://bucket[/prefix]`, `file:///dir` or `/dir`.
    pub fn parse(text: &str) -> Result<Location, Error> {
        let text = text.trim();
        let invalid = |reason: &str| Error::InvalidDestination {
            dest: text.to_string(),
            reason: reason.to_string(),
        };
        let path = if let Some(rest) = text.strip_prefix("file://") {
            rest
        } else if text.starts_with('/') {
            text
        } else if text.starts_with("s3://") || text.starts_with("gs://") {
            let url = SourceUrl::parse(text).map_err(|e| match e {
                crate::store::Error::InvalidUrl { reason, .. } => invalid(&reason),
                e => invalid(&e.to_string()),
            })?;
            return Ok(Location::Store(url));
        } else {
            return Err(invalid(
                "expected s3://bucket/prefix, gs://bucket/prefix, file:///dir or an absolute path",
            ));
        };
        if !path.starts_with('/') {
            return Err(invalid("a filesystem destination must be an absolute path"));
        }
        if path.contains('\0') {
            return Err(invalid("NUL byte"));
        }
        let mut out = PathBuf::from("/");
        for c in Path::new(path).components() {
            match c {
                Component::RootDir | Component::CurDir => {}
                Component::Normal(n) => out.push(n),
                Component::ParentDir | Component::Prefix(_) => {
                    return Err(invalid("`..` is not allowed"))
                }
            }
        }
        Ok(Location::Dir(out))
    }

    /// The directory of checkpoint `name` under this location. `name` must be a valid
    /// checkpoint name ([`validate_checkpoint_name`]).
    pub fn join(&self, name: &str) -> Location {
        match self {
            Location::Dir(p) => Location::Dir(p.join(name)),
            Location::Store(url) => {
                let prefix = if url.prefix.is_empty() {
                    name.to_string()
                } else {
                    format!("{}/{name}", url.prefix)
                };
                let text = format!("{}://{}/{prefix}", url.scheme.as_str(), url.bucket);
                // Joining a validated name to a parsed URL gives a parsable URL.
                Location::Store(SourceUrl::parse(&text).unwrap_or_else(|_| url.clone()))
            }
        }
    }

    /// Whether `self` is `bound` or a location below it: the same scheme and bucket, and
    /// `bound`'s path followed by whole segments (never `run1-evil` under `run1`).
    pub fn is_within(&self, bound: &Location) -> bool {
        match (self, bound) {
            (Location::Dir(p), Location::Dir(b)) => p.starts_with(b),
            (Location::Store(u), Location::Store(b)) => {
                u.scheme == b.scheme
                    && u.bucket == b.bucket
                    && (b.prefix.is_empty()
                        || u.prefix == b.prefix
                        || u.prefix
                            .strip_prefix(b.prefix.as_str())
                            .is_some_and(|rest| rest.starts_with('/')))
            }
            _ => false,
        }
    }

    /// The location as a URL or path, for logs, manifests and Events.
    pub fn display(&self) -> String {
        match self {
            Location::Dir(p) => p.display().to_string(),
            Location::Store(url) => url.normalized(),
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display())
    }
}

/// A checkpoint's name (its directory under the location): the staged directory's base name,
/// e.g. `step-1200`. Letters, digits, `-`, `_`, `.`, not starting with `.`, at most 100 bytes.
pub fn validate_checkpoint_name(name: &str) -> Result<(), Error> {
    crate::store::url::validate_name(name).map_err(|e| Error::InvalidDestination {
        dest: name.to_string(),
        reason: format!("checkpoint name: {e}"),
    })
}

/// One `--upload-allow` pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowUpload {
    /// `s3://BUCKET[/PREFIX]` or `gs://BUCKET[/PREFIX]`.
    Store(AllowPattern),
    /// An absolute directory: it and everything below it (a `{namespace}` component: the pod's
    /// namespace).
    Dir(PathBuf),
}

impl AllowUpload {
    /// Parse a pattern: `s3://…`, `gs://…`, `file:///dir` or `/dir` (not `/` itself).
    pub fn parse(text: &str) -> Result<AllowUpload, String> {
        let text = text.trim();
        if text.starts_with("s3://") || text.starts_with("gs://") {
            return AllowPattern::parse(text).map(AllowUpload::Store);
        }
        match Location::parse(text) {
            Ok(Location::Dir(p)) if p == Path::new("/") => Err(format!(
                "upload allow pattern {text:?}: name a directory (allowing / would let a pod \
                 make the agent write anywhere on the node)"
            )),
            Ok(Location::Dir(p)) => {
                allow::check_placeholder(&p.to_string_lossy(), '/')
                    .map_err(|reason| format!("upload allow pattern {text:?}: {reason}"))?;
                Ok(AllowUpload::Dir(p))
            }
            Ok(Location::Store(_)) | Err(_) => Err(format!(
                "upload allow pattern {text:?}: expected s3://BUCKET[/PREFIX], \
                 gs://BUCKET[/PREFIX] or an absolute directory"
            )),
        }
    }
}

impl std::fmt::Display for AllowUpload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AllowUpload::Store(p) => write!(f, "{p}"),
            AllowUpload::Dir(p) => write!(f, "{}", p.display()),
        }
    }
}

/// What the allow-list granted: for a directory, the allowed directory the destination is opened
/// from, the rest of the path below it, and the agent's own directories it must never reach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Granted {
    Store,
    Dir {
        base: PathBuf,
        below: PathBuf,
        /// The agent's own directories (`--checkpoint-dir`, `--state-dir`): the base may not be,
        /// contain or lie inside one, compared by identity when the destination is opened.
        own: Vec<PathBuf>,
    },
}

/// The operator's `--upload-allow` list. Empty: every destination is refused (uploads are off).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UploadPolicy {
    pub allow: Vec<AllowUpload>,
    /// The agent's own directories: no allowed directory may be, contain or lie inside one.
    pub own_dirs: Vec<PathBuf>,
}

impl UploadPolicy {
    /// Whether `dest` (a checkpoint's directory) may be written for a pod of `namespace` (`None`:
    /// for no pod, host mode; a pattern naming `{namespace}` then allows nothing);
    /// [`Error::NotAllowed`] if not.
    pub fn check(&self, dest: &Location, namespace: Option<&str>) -> Result<Granted, Error> {
        let refuse = |reason: String| Error::NotAllowed {
            dest: dest.display(),
            reason,
        };
        if self.allow.is_empty() {
            return Err(refuse(
                "checkpoint uploads are off on this node (the operator enables them with \
                 --upload-allow)"
                    .to_string(),
            ));
        }
        for pattern in &self.allow {
            match (pattern, dest) {
                (AllowUpload::Store(p), Location::Store(url)) if p.allows(url, namespace) => {
                    return Ok(Granted::Store)
                }
                (AllowUpload::Dir(base), Location::Dir(path)) => {
                    let Some(base) = allow::with_namespace(&base.to_string_lossy(), namespace)
                        .map(PathBuf::from)
                    else {
                        continue;
                    };
                    if let Ok(below) = path.strip_prefix(&base) {
                        if below.as_os_str().is_empty() {
                            continue;
                        }
                        return Ok(Granted::Dir {
                            base,
                            below: below.to_path_buf(),
                            own: self.own_dirs.clone(),
                        });
                    }
                }
                _ => {}
            }
        }
        let allowed: Vec<String> = self.allow.iter().map(|p| p.to_string()).collect();
        let whose = match namespace {
            Some(ns) => format!(" for namespace {ns}"),
            None => String::new(),
        };
        Err(refuse(format!(
            "not under any allowed location{whose} ({})",
            allowed.join(", ")
        )))
    }

    /// Whether checkpoints may be written under `location` for no pod (host mode's
    /// `--checkpoint-upload`, judged at start): a checkpoint directory below it is checked.
    pub fn check_location(&self, location: &Location) -> Result<(), Error> {
        self.check(&location.join("step-0"), None).map(|_| ())
    }
}

/// The scheme of a store location, for metrics and logs.
pub fn scheme(dest: &Location) -> &'static str {
    match dest {
        Location::Dir(_) => "file",
        Location::Store(u) if u.scheme == Scheme::Gcs => "gs",
        Location::Store(_) => "s3",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(p: &[&str]) -> UploadPolicy {
        UploadPolicy {
            allow: p.iter().map(|t| AllowUpload::parse(t).unwrap()).collect(),
            own_dirs: Vec::new(),
        }
    }

    #[test]
    fn locations_parse_and_join() {
        let s = Location::parse("s3://bkt/run1/").unwrap();
        assert_eq!(s.join("step-10").display(), "s3://bkt/run1/step-10");
        let root = Location::parse("gs://bkt").unwrap();
        assert_eq!(root.join("step-1").display(), "gs://bkt/step-1");
        let d = Location::parse("file:///mnt/efs//run1/./").unwrap();
        assert_eq!(d, Location::Dir(PathBuf::from("/mnt/efs/run1")));
        assert_eq!(
            Location::parse("/mnt/efs/run1").unwrap().join("step-2"),
            Location::Dir(PathBuf::from("/mnt/efs/run1/step-2"))
        );
        for bad in [
            "relative/dir",
            "http://x/y",
            "/a/../b",
            "file://rel",
            "s3://",
            "s3://b/x?y",
        ] {
            assert!(Location::parse(bad).is_err(), "{bad}");
        }
        assert!(validate_checkpoint_name("step-1200").is_ok());
        for bad in ["", ".hidden", "a/b", "..", "a b"] {
            assert!(validate_checkpoint_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_location_is_within_its_bound_on_whole_segments() {
        let within = |a: &str, b: &str| {
            Location::parse(a)
                .unwrap()
                .is_within(&Location::parse(b).unwrap())
        };
        assert!(within("s3://ck/run1", "s3://ck/run1"));
        assert!(within("s3://ck/run1/sub/x", "s3://ck/run1/"));
        assert!(within("s3://ck/anything", "s3://ck"));
        assert!(within("/mnt/efs/run1/a", "file:///mnt/efs/run1"));
        for (a, b) in [
            ("s3://ck/run1-evil", "s3://ck/run1"),
            ("s3://ck/run", "s3://ck/run1"),
            ("s3://ck/other", "s3://ck/run1"),
            ("s3://ck2/run1", "s3://ck/run1"),
            ("gs://ck/run1", "s3://ck/run1"),
            ("s3://CK/run1", "s3://ck/run1"),
            ("s3://ck/RUN1", "s3://ck/run1"),
            ("/mnt/efs/run1-evil", "/mnt/efs/run1"),
            ("/mnt/efs", "/mnt/efs/run1"),
            ("/mnt/efs/run1", "s3://ck/mnt/efs/run1"),
        ] {
            assert!(!within(a, b), "{a} within {b}");
        }
    }

    #[test]
    fn the_allow_list_grants_stores_and_directories_on_whole_segments() {
        let p = policy(&["s3://ckpt-*/runs", "/mnt/efs/ckpt"]);
        for ok in ["s3://ckpt-a/runs/r1/step-1", "s3://ckpt-b/runs/x"] {
            assert_eq!(
                p.check(&Location::parse(ok).unwrap(), None).unwrap(),
                Granted::Store
            );
        }
        assert_eq!(
            p.check(&Location::parse("/mnt/efs/ckpt/r1/step-1").unwrap(), None)
                .unwrap(),
            Granted::Dir {
                base: PathBuf::from("/mnt/efs/ckpt"),
                below: PathBuf::from("r1/step-1"),
                own: Vec::new(),
            }
        );
        for bad in [
            "s3://ckpt-a/runs-private/x",
            "s3://other/runs/x",
            "gs://ckpt-a/runs/x",
            "/mnt/efs/ckpt-other/x",
            "/mnt/efs/ckpt",
            "/etc/cron.d",
        ] {
            let e = p.check(&Location::parse(bad).unwrap(), None).unwrap_err();
            assert_eq!(e.metric_label(), "not_allowed", "{bad}");
        }
        let off = UploadPolicy::default();
        assert!(off
            .check(&Location::parse("s3://b/x").unwrap(), None)
            .unwrap_err()
            .to_string()
            .contains("off"));
        for bad in [
            "/",
            "file:///",
            "s3://*",
            "relative",
            "http://x",
            "/mnt/efs/x-{namespace}",
        ] {
            assert!(AllowUpload::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_namespace_pattern_grants_each_pod_only_its_namespaces_location() {
        let p = policy(&["s3://ckpt/{namespace}", "/mnt/efs/{namespace}/ckpt"]);
        let check = |dest: &str, ns| p.check(&Location::parse(dest).unwrap(), ns);
        assert_eq!(
            check("s3://ckpt/ml/run1/step-1", Some("ml")).unwrap(),
            Granted::Store
        );
        assert_eq!(
            check("/mnt/efs/ml/ckpt/run1/step-1", Some("ml")).unwrap(),
            Granted::Dir {
                base: PathBuf::from("/mnt/efs/ml/ckpt"),
                below: PathBuf::from("run1/step-1"),
                own: Vec::new(),
            }
        );
        for (dest, ns) in [
            ("s3://ckpt/ml/run1/step-1", Some("other")),
            ("s3://ckpt/ml/run1/step-1", None),
            ("/mnt/efs/ml/ckpt/run1/step-1", Some("other")),
            ("/mnt/efs/ml/ckpt/run1/step-1", None),
        ] {
            let e = check(dest, ns).unwrap_err();
            assert_eq!(e.metric_label(), "not_allowed", "{dest} for {ns:?}");
        }
        assert!(check("s3://ckpt/ml/x/step-1", Some("other"))
            .unwrap_err()
            .to_string()
            .contains("for namespace other"));
        assert!(p
            .check_location(&Location::parse("s3://ckpt/ml/run1").unwrap())
            .is_err());
        assert!(policy(&["s3://ckpt/host"])
            .check_location(&Location::parse("s3://ckpt/host").unwrap())
            .is_ok());
    }
}
