//! What a pod may ask for with `spotguard.io/prefetch`: the operator's opt-in and allow-list.
//!
//! An annotation is hostile input: whoever can create a pod on the node writes it, and the
//! prefetcher fetches with the DaemonSet's identity. So pod-requested prefetch is off unless the
//! operator turns it on (`--annotations`), only `s3://` and `gs://` URLs are accepted (never
//! `file://`: it would copy files of the node, or of the cache itself, into a directory pods
//! read), and the URL must lie under one of the operator's `--allow` patterns, checked for the
//! pod's namespace (a pattern naming `{namespace}` allows each pod only its own namespace's).
//!
//! The cache is one directory shared by every pod of the node. A dataset that only a
//! `{namespace}` pattern allows is the namespace's own, so it is cached under a name of the
//! namespace's own, `<namespace>--<name>`: another namespace's pod asking for `<name>` gets
//! its own copy (or a refusal), never this one. A dataset a pattern for every namespace allows
//! keeps its name and is shared (every namespace may fetch it anyway). A pod's dataset name may
//! not hold `--`, so no name a pod chooses is another namespace's.

pub use crate::store::AllowPattern;
use crate::store::{Scheme, SourceUrl};

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

/// Between the namespace and the name of a namespace's own dataset in the cache.
pub const NAMESPACE_SEPARATOR: &str = "--";

impl AnnotationPolicy {
    /// Check one entry of the annotation (`NAME=URL` or a bare URL) of a pod of `namespace`;
    /// returns `(name in the cache, url)`.
    pub fn check(&self, spec: &str, namespace: &str) -> Result<(String, String), Refusal> {
        if !self.enabled {
            return Err(Refusal::Disabled);
        }
        let (name, url) = crate::store::parse_spec(spec).map_err(|e| Refusal::Invalid {
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
        if name.contains(NAMESPACE_SEPARATOR) {
            return Err(Refusal::Invalid {
                spec: spec.to_string(),
                reason: format!(
                    "a dataset name may not hold {NAMESPACE_SEPARATOR:?} (the cache's names of \
                     namespaces' own datasets); name it (NAME=URL)"
                ),
            });
        }
        if self
            .allow
            .iter()
            .any(|p| !p.per_namespace() && p.allows(&src, None))
        {
            return Ok((name, url));
        }
        if !self.allow.iter().any(|p| p.allows(&src, Some(namespace))) {
            let allowed = if self.allow.is_empty() {
                "the allow-list is empty".to_string()
            } else {
                self.allow
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(Refusal::NotAllowed {
                url,
                allowed: format!("{allowed}, for namespace {namespace}"),
            });
        }
        let own = format!("{namespace}{NAMESPACE_SEPARATOR}{name}");
        crate::store::validate_name(&own).map_err(|e| Refusal::Invalid {
            spec: spec.to_string(),
            reason: format!("its name in the cache, {own}: {e}"),
        })?;
        Ok((own, url))
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
            assert!(p.check(ok, "ml").is_ok(), "{ok}");
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
            let e = p.check(bad, "ml").unwrap_err();
            assert_eq!(e.metric_label(), label, "{bad}: {e}");
        }
        let off = AnnotationPolicy {
            enabled: false,
            ..p.clone()
        };
        assert_eq!(off.check("gs://public/x", "ml"), Err(Refusal::Disabled));
        assert!(matches!(
            policy(&[]).check("gs://public/x", "ml"),
            Err(Refusal::NotAllowed { .. })
        ));
    }

    #[test]
    fn a_namespaces_own_dataset_is_its_own_and_has_a_name_of_its_own() {
        let p = policy(&["s3://data/{namespace}", "s3://public"]);
        assert_eq!(
            p.check("c4=s3://data/team-a/c4", "team-a").unwrap(),
            ("team-a--c4".to_string(), "s3://data/team-a/c4".to_string())
        );
        // Another namespace may not name it, nor squat its name in the cache.
        for (spec, ns, label) in [
            ("c4=s3://data/team-a/c4", "team-b", "not_allowed"),
            ("s3://data/team-a/c4", "team-b", "not_allowed"),
            ("team-a--c4=s3://public/x", "team-b", "invalid"),
            ("team-a--c4=s3://data/team-b/c4", "team-b", "invalid"),
        ] {
            let e = p.check(spec, ns).unwrap_err();
            assert_eq!(e.metric_label(), label, "{spec} for {ns}: {e}");
        }
        // Allowed for every namespace: shared under its own name.
        assert_eq!(
            p.check("c4=s3://public/c4", "team-b").unwrap(),
            ("c4".to_string(), "s3://public/c4".to_string())
        );
    }
}
