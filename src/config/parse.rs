//! Value parsers of `run`'s flags (used by clap: their messages end up after the flag's name).

use std::path::PathBuf;
use std::time::Duration;

use regex::Regex;

use super::{Dataset, WebhookHeader};
use crate::checkpoint::{Signal, TargetMode};

pub(super) fn parse_webhook_header(s: &str) -> Result<WebhookHeader, String> {
    crate::webhook::parse_header(s).map(|(n, v)| WebhookHeader(n, v))
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::duration::parse(s)
}

pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

pub(super) fn parse_signal(s: &str) -> Result<Signal, String> {
    s.parse()
}

/// `--checkpoint-target`: the target modes host mode has (`pid1` and `all` name a container's
/// processes, a pod annotation's business).
pub(super) fn parse_host_target(s: &str) -> Result<TargetMode, String> {
    match s.trim() {
        "handlers" => Ok(TargetMode::Handlers),
        "caught" => Ok(TargetMode::Caught),
        other => Err(format!(
            "unknown host checkpoint target {other:?}: use handlers (the default) or caught"
        )),
    }
}

pub(super) fn parse_regex(s: &str) -> Result<Regex, String> {
    Regex::new(s).map_err(|e| e.to_string())
}

pub(super) fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (true/false)")),
    }
}

pub(super) fn parse_abs_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(format!("{s:?} must be an absolute path"))
    }
}

pub(super) fn parse_url(s: &str) -> Result<String, String> {
    crate::store::parse_http_url(s)
}

pub(super) fn parse_endpoint(s: &str) -> Result<reqwest::Url, String> {
    let t = parse_url(s)?;
    reqwest::Url::parse(&t).map_err(|e| format!("{s:?}: {e}"))
}

/// `NAME=URL` or a bare URL (the name derived from it), validated by the prefetch module.
pub(super) fn parse_dataset(s: &str) -> Result<Dataset, String> {
    let (name, url) = crate::prefetch::parse_spec(s).map_err(|e| e.to_string())?;
    Ok(Dataset { name, url })
}

/// Parse a byte size: `1024`, `64KiB`, `10MB`, `1.5GiB`, `2TiB`.
/// `--checkpoint-upload`: a location (`s3://`, `gs://`, `file://` or an absolute directory).
pub(super) fn parse_upload_location(s: &str) -> Result<String, String> {
    crate::upload::Location::parse(s)
        .map(|l| l.display())
        .map_err(|e| e.to_string())
}

/// A size limit (`--cache-max-bytes`, `--upload-max-bytes`): the crate's one byte-size dialect,
/// at least one byte.
pub use crate::units::parse_limit as parse_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_datasets_parse() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("64KiB").unwrap(), 65536);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_bytes("-1").is_err());
        assert_eq!(parse_dataset("n=s3://b/p").unwrap().name, "n");
        assert!(parse_dataset("s3://b/p").is_ok(), "bare URL: name derived");
        assert!(parse_dataset("../x=s3://b/p").is_err());
        assert!(parse_dataset("n=http://b/p").is_err());
    }

    #[test]
    fn host_targets_are_handlers_or_caught() {
        assert_eq!(parse_host_target("handlers"), Ok(TargetMode::Handlers));
        assert_eq!(parse_host_target(" caught "), Ok(TargetMode::Caught));
        for other in ["pid1", "all", "", "HANDLERS"] {
            let err = parse_host_target(other).unwrap_err();
            assert!(
                err.contains("use handlers (the default) or caught"),
                "{err}"
            );
        }
    }
}
