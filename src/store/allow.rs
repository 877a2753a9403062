//! Allow-list patterns of object-store locations (`s3://BUCKET[/PREFIX]`, `gs://…`): what a pod
//! may ask the prefetcher for, and where staged checkpoints may be uploaded.
//!
//! A pattern may name the namespace of the pod it is checked for: `{namespace}` as a whole
//! segment of PREFIX (`s3://ckpt/{namespace}`, `s3://ckpt/teams/{namespace}/runs`, or a whole
//! component of an upload directory, [`with_namespace`]) stands for that namespace and nothing
//! else, so a pod of namespace `b` never reaches `s3://ckpt/a/…`. Checked for no pod (host mode,
//! the agent's own `--checkpoint-upload`), such a pattern allows nothing.

use super::url::{Scheme, SourceUrl};

/// The placeholder of the namespace a location is checked for.
pub const NAMESPACE: &str = "{namespace}";

/// One allow-list pattern: `s3://BUCKET[/PREFIX]` or `gs://BUCKET[/PREFIX]`. `*` in BUCKET
/// matches any run of characters (`s3://ml-datasets-*`); PREFIX matches on whole path segments
/// (`s3://b/datasets` allows `s3://b/datasets` and `s3://b/datasets/c4`, not
/// `s3://b/datasets-private`), a `{namespace}` segment the namespace checked for. No PREFIX: the
/// whole bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowPattern {
    scheme: Scheme,
    bucket: String,
    prefix: String,
    text: String,
}

impl AllowPattern {
    /// Parse a pattern.
    pub fn parse(text: &str) -> Result<AllowPattern, String> {
        let text = text.trim();
        let (scheme, rest) = if let Some(r) = text.strip_prefix("s3://") {
            (Scheme::S3, r)
        } else if let Some(r) = text.strip_prefix("gs://") {
            (Scheme::Gcs, r)
        } else {
            return Err(format!(
                "allow pattern {text:?}: expected s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX]"
            ));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() || bucket.chars().all(|c| c == '*') {
            return Err(format!(
                "allow pattern {text:?}: name a bucket (a pattern matching every bucket would \
                 let any pod fetch anything the node's identity can read)"
            ));
        }
        if !bucket
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '*'))
        {
            return Err(format!(
                "allow pattern {text:?}: bucket names use letters, digits, '-', '.', '_' (and '*'); \
                 {NAMESPACE} may only be a whole segment of the prefix"
            ));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|s| s == ".." || s == ".") || prefix.contains("//") {
            return Err(format!("allow pattern {text:?}: bad prefix"));
        }
        check_placeholder(prefix, '/')
            .map_err(|reason| format!("allow pattern {text:?}: {reason}"))?;
        Ok(AllowPattern {
            scheme,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            text: text.to_string(),
        })
    }

    /// Whether `src` lies under this pattern, checked for a pod of `namespace` (`None`: for no
    /// pod; a pattern naming `{namespace}` then allows nothing).
    pub fn allows(&self, src: &SourceUrl, namespace: Option<&str>) -> bool {
        let Some(prefix) = with_namespace(&self.prefix, namespace) else {
            return false;
        };
        src.scheme == self.scheme
            && glob(&self.bucket, &src.bucket)
            && (prefix.is_empty()
                || src.prefix == prefix
                || src
                    .prefix
                    .strip_prefix(prefix.as_str())
                    .is_some_and(|rest| rest.starts_with('/')))
    }

    /// Whether the pattern names `{namespace}` (it then allows each pod only its own).
    pub fn per_namespace(&self) -> bool {
        self.prefix.contains(NAMESPACE)
    }
}

impl std::fmt::Display for AllowPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

/// `{namespace}` only as a whole segment of `path` (segments split by `sep`).
pub fn check_placeholder(path: &str, sep: char) -> Result<(), String> {
    if path
        .split(sep)
        .any(|s| s != NAMESPACE && s.contains(['{', '}']))
    {
        return Err(format!(
            "{NAMESPACE} may only be a whole segment of the path (s3://ckpt/{NAMESPACE}/runs), and \
             no other braces are allowed"
        ));
    }
    Ok(())
}

/// `path` with every `{namespace}` segment replaced by `namespace`; `None` when `path` names
/// it and there is no namespace, or the namespace is not a Kubernetes namespace name (a DNS
/// label: it can never be `..`, empty, or hold a separator).
pub fn with_namespace(path: &str, namespace: Option<&str>) -> Option<String> {
    if !path.contains(NAMESPACE) {
        return Some(path.to_string());
    }
    let ns = namespace.filter(|ns| is_dns_label(ns))?;
    Some(path.replace(NAMESPACE, ns))
}

/// A DNS-1123 label: 1–63 lowercase letters, digits and `-`, starting and ending alphanumeric.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `*` matches any run of characters (including none); everything else literally.
fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || s.len() < first.len() + last.len() || !s.ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_that_allow_everything_or_escape_are_rejected() {
        for bad in [
            "s3://*",
            "s3://",
            "file:///data",
            "s3://b/../x",
            "https://b",
            "s3://ckpt-{namespace}/x",
            "s3://ckpt/team-{namespace}",
            "s3://ckpt/{name}",
        ] {
            assert!(AllowPattern::parse(bad).is_err(), "{bad}");
        }
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxc"));
        assert!(glob("*-data", "x-data"));
        assert!(!glob("ab*ba", "aba"));
    }

    #[test]
    fn a_namespace_pattern_allows_each_namespace_only_its_own() {
        let p = AllowPattern::parse("s3://ckpt/{namespace}/runs").unwrap();
        assert!(p.per_namespace());
        let url = |u: &str| SourceUrl::parse(u).unwrap();
        assert!(p.allows(&url("s3://ckpt/team-a/runs/r1"), Some("team-a")));
        assert!(p.allows(&url("s3://ckpt/team-a/runs"), Some("team-a")));
        for (u, ns) in [
            ("s3://ckpt/team-a/runs/r1", Some("team-b")),
            ("s3://ckpt/team-a/runs/r1", Some("team")),
            ("s3://ckpt/team-a/runs/r1", None),
            ("s3://ckpt/team-a-x/runs/r1", Some("team-a")),
            ("s3://ckpt/{namespace}/runs/r1", None),
            ("s3://ckpt/x/runs", Some("../x")),
            ("s3://ckpt/a/b/runs", Some("a/b")),
        ] {
            assert!(!p.allows(&url(u), ns), "{u} for {ns:?}");
        }
        let whole = AllowPattern::parse("gs://shared").unwrap();
        assert!(!whole.per_namespace());
        assert!(whole.allows(&url("gs://shared/x"), None));
        assert!(whole.allows(&url("gs://shared/x"), Some("any")));
        assert_eq!(
            with_namespace("/mnt/{namespace}", Some("ml")).unwrap(),
            "/mnt/ml"
        );
        assert_eq!(with_namespace("/mnt/{namespace}", None), None);
        assert_eq!(with_namespace("/mnt/x", None).unwrap(), "/mnt/x");
    }
}
