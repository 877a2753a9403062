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

/// A duration setting's value within `[min, max]` (each setting's help names its bounds): a
/// duration the agent cannot mean (`1000000000000h`) is refused, not taken.
fn within(s: &str, min: Duration, max: Duration) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < min {
        return Err(if min == Duration::from_nanos(1) {
            "must be greater than zero".into()
        } else {
            format!("below the least allowed, {}", crate::duration::display(min))
        });
    }
    if d > max {
        return Err(format!(
            "above the most allowed, {}",
            crate::duration::display(max)
        ));
    }
    Ok(d)
}

const NONZERO: Duration = Duration::from_nanos(1);
const MINUTE: Duration = Duration::from_secs(60);
const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// `--poll-interval`: more than 0, at most 1m.
pub(super) fn parse_poll_interval(s: &str) -> Result<Duration, String> {
    within(s, NONZERO, MINUTE)
}

/// `--rebalance-expiry`: more than 0, at most 7d.
pub(super) fn parse_rebalance_expiry(s: &str) -> Result<Duration, String> {
    within(s, NONZERO, 7 * DAY)
}

/// `--maintenance-lead`: 0 to 30d.
pub(super) fn parse_maintenance_lead(s: &str) -> Result<Duration, String> {
    within(s, Duration::ZERO, 30 * DAY)
}

/// `--checkpoint-timeout`, `--gce-preemption-notice`: more than 0, at most 1h.
pub(super) fn parse_nonzero_hour(s: &str) -> Result<Duration, String> {
    within(s, NONZERO, HOUR)
}

/// `--relay-idle-timeout`: more than 0, at most 10m.
pub(super) fn parse_relay_idle(s: &str) -> Result<Duration, String> {
    within(s, NONZERO, 10 * MINUTE)
}

/// `--goodput-record-ttl`: 1h to 366d.
pub(super) fn parse_record_ttl(s: &str) -> Result<Duration, String> {
    within(s, HOUR, 366 * DAY)
}

/// `--drain-reserve`, `--shutdown-grace`: 0 to 1h.
pub(super) fn parse_hour(s: &str) -> Result<Duration, String> {
    within(s, Duration::ZERO, HOUR)
}

pub(super) fn parse_signal(s: &str) -> Result<Signal, String> {
    s.parse()
}

/// One-character command lines with nothing in common: a pattern that matches all of them (`.`,
/// `\S`, `[^x]`) matches every command line on the host.
const UNRELATED: [&str; 10] = ["a", "Z", "0", "/", "-", ".", "_", "@", ":", "="];

/// A `--checkpoint-cmdline` pattern. Refused when it selects the world: a pattern that matches
/// the empty string (`''`, `.*`, `^`, `.?`, `train|`) matches every command line (the search is
/// unanchored), as does one that matches every one of [`UNRELATED`].
pub(super) fn parse_cmdline_regex(s: &str) -> Result<Regex, String> {
    let re = Regex::new(s).map_err(|e| e.to_string())?;
    let why = if re.is_match("") {
        Some("it matches the empty string")
    } else if UNRELATED.iter().all(|c| re.is_match(c)) {
        Some("it matches any character")
    } else {
        None
    };
    match why {
        Some(why) => Err(format!(
            "{s:?} matches every command line ({why}): a notice would signal every process on the host; name the trainer, e.g. 'torchrun|train\\.py'"
        )),
        None => Ok(re),
    }
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
    fn a_cmdline_pattern_that_selects_everything_is_refused() {
        for bad in [
            "", ".*", "^", "$", ".?", "x*", "train|", "(?s).", ".", "\\S", "[^\\n]",
        ] {
            let e = parse_cmdline_regex(bad).expect_err(bad);
            assert!(e.contains("matches every command line"), "{bad:?}: {e}");
        }
        for ok in [
            "torchrun",
            "train\\.py",
            "^python3 .*sgtrain",
            "\\bsgtrain\\b",
        ] {
            parse_cmdline_regex(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }

    #[test]
    fn every_duration_setting_is_bounded() {
        let run = super::super::args::run_command();
        let mut seen = 0;
        for a in run.get_arguments() {
            let is_duration = a
                .get_value_names()
                .is_some_and(|n| n.iter().any(|n| n.as_str() == "DURATION"));
            if !is_duration {
                continue;
            }
            seen += 1;
            let long = a.get_long().unwrap();
            let flag = format!("--{long}=1000000000000h");
            let e = run
                .clone()
                .try_get_matches_from(["spotguard", flag.as_str()])
                .expect_err(&flag);
            assert!(
                e.to_string().contains("above the most allowed"),
                "{flag}: {e}"
            );
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            assert!(
                help.contains("at most"),
                "--{long}'s help names no bound: {help}"
            );
        }
        assert!(seen >= 7, "{seen} duration settings");
    }

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
