//! Allow-list patterns of object-store locations (`s3://BUCKET[/PREFIX]`, `gs://…`): what a pod
//! may ask the prefetcher for, and where staged checkpoints may be uploaded.

use super::url::{Scheme, SourceUrl};

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
        ] {
            assert!(AllowPattern::parse(bad).is_err(), "{bad}");
        }
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxc"));
        assert!(glob("*-data", "x-data"));
        assert!(!glob("ab*ba", "aba"));
    }
}
