//! What a pod may ask for with `spotguard.io/prefetch`: the operator's opt-in and allow-list.
//!
//! An annotation is hostile input: whoever can create a pod on the node writes it, and the
//! prefetcher fetches with the DaemonSet's identity. So pod-requested prefetch is off unless the
//! operator turns it on (`--annotations`), only `s3://` and `gs://` URLs are accepted (never
//! `file://`: it would copy files of the node, or of the cache itself, into a directory pods
//! read), and the URL must lie under one of the operator's `--allow` patterns.

use super::source::{Scheme, SourceUrl};

/// One allow-list pattern: `s3://BUCKET[/PREFIX]` or `gs://BUCKET[/PREFIX]`. `*` in BUCKET
/// matches any run of characters (`s3://ml-datasets-*`); PREFIX matches on whole path segments
/// (`s3://b/datasets` allows `s3://b/datasets` and `s3://b/datasets/c4`, not
/// `s3://b/datasets-private`). No PREFIX: the whole bucket.
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
                "allow pattern {text:?}: bucket names use letters, digits, '-', '.', '_' (and '*')"
            ));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|s| s == ".." || s == ".") || prefix.contains("//") {
            return Err(format!("allow pattern {text:?}: bad prefix"));
        }
        Ok(AllowPattern {
            scheme,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            text: text.to_string(),
        })
    }

    /// Whether `src` lies under this pattern.
    pub fn allows(&self, src: &SourceUrl) -> bool {
        src.scheme == self.scheme
            && glob(&self.bucket, &src.bucket)
            && (self.prefix.is_empty()
                || src.prefix == self.prefix
                || src
                    .prefix
                    .strip_prefix(self.prefix.as_str())
                    .is_some_and(|rest| rest.starts_with('/')))
    }
}

impl std::fmt::Display for AllowPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
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

/// Why a pod's request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(
        "pod-requested prefetch is off on this node (the operator enables it with \
         --annotations and an --allow list)"
    )]
    Disabled,
    #[error("{url}: only s3:// and gs:// URLs may be requested by a pod")]
    Scheme { url: String },
    #[error("{url}: not under any allowed prefix ({allowed})")]
    NotAllowed { url: String, allowed: String },
    #[error("{spec:?}: {reason}")]
    Invalid { spec: String, reason: String },
    #[error("{0}")]
    Prefetch(String),
}

impl Refusal {
    /// Label for `spotguard_prefetch_refused_total{reason}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Refusal::Disabled => "disabled",
            Refusal::Scheme { .. } => "scheme",
            Refusal::NotAllowed { .. } => "not_allowed",
            Refusal::Invalid { .. } => "invalid",
            Refusal::Prefetch(_) => "prefetch",
        }
    }
}

/// The operator's policy for pod-requested prefetch.
#[derive(Clone, Debug, Default)]
pub struct AnnotationPolicy {
    /// Pod-requested prefetch is on.
    pub enabled: bool,
    /// At least one must match; an empty list refuses everything.
    pub allow: Vec<AllowPattern>,
}

impl AnnotationPolicy {
    /// Check one entry of the annotation (`NAME=URL` or a bare URL); returns `(name, url)`.
    pub fn check(&self, spec: &str) -> Result<(String, String), Refusal> {
        if !self.enabled {
            return Err(Refusal::Disabled);
        }
        let (name, url) = super::parse_spec(spec).map_err(|e| Refusal::Invalid {
            spec: spec.to_string(),
            reason: e.to_string(),
        })?;
        let src = SourceUrl::parse(&url).map_err(|e| Refusal::Invalid {
            spec: spec.to_string(),
            reason: e.to_string(),
        })?;
        if src.scheme == Scheme::File {
            return Err(Refusal::Scheme { url });
        }
        if !self.allow.iter().any(|p| p.allows(&src)) {
            let allowed = if self.allow.is_empty() {
                "the allow-list is empty".to_string()
            } else {
                self.allow
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(Refusal::NotAllowed { url, allowed });
        }
        Ok((name, url))
    }
}

/// The entries of a `spotguard.io/prefetch` annotation: comma-separated `NAME=URL` or URLs.
pub fn annotation_entries(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(patterns: &[&str]) -> AnnotationPolicy {
        AnnotationPolicy {
            enabled: true,
            allow: patterns
                .iter()
                .map(|p| AllowPattern::parse(p).unwrap())
                .collect(),
        }
    }

    #[test]
    fn patterns_match_buckets_and_whole_prefix_segments() {
        let p = policy(&["s3://ml-*-data/datasets", "gs://public"]);
        for ok in [
            "s3://ml-eu-data/datasets",
            "s3://ml-eu-data/datasets/c4",
            "c4=s3://ml-us-data/datasets/c4/en/",
            "gs://public/anything/at/all",
        ] {
            assert!(p.check(ok).is_ok(), "{ok}");
        }
        for (bad, label) in [
            ("s3://ml-eu-data/datasets-private", "not_allowed"),
            ("s3://ml-eu-data/other", "not_allowed"),
            ("s3://other/datasets", "not_allowed"),
            ("gs://ml-eu-data/datasets", "not_allowed"),
            ("s3://public/x", "not_allowed"),
            (
                "file:///var/run/secrets/kubernetes.io/serviceaccount",
                "scheme",
            ),
            ("x=file:///var/cache/spotguard", "scheme"),
            ("../x=s3://ml-eu-data/datasets", "invalid"),
            ("http://ml-eu-data/datasets", "invalid"),
        ] {
            let e = p.check(bad).unwrap_err();
            assert_eq!(e.metric_label(), label, "{bad}: {e}");
        }
        let off = AnnotationPolicy {
            enabled: false,
            ..p.clone()
        };
        assert_eq!(off.check("gs://public/x"), Err(Refusal::Disabled));
        assert!(matches!(
            policy(&[]).check("gs://public/x"),
            Err(Refusal::NotAllowed { .. })
        ));
    }

    #[test]
    fn patterns_that_allow_everything_or_escape_are_rejected() {
        for bad in [
            "s3://*",
            "s3://",
            "file:///data",
            "s3://b/../x",
            "https://b",
        ] {
            assert!(AllowPattern::parse(bad).is_err(), "{bad}");
        }
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxc"));
        assert!(glob("*-data", "x-data"));
        assert!(!glob("ab*ba", "aba"));
    }
}
