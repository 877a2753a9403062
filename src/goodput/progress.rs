//! The helper's progress record, `<checkpoint dir>/progress-<pid>.json` (clients/python: last
//! step and its time, the last durable step and since when its work is at risk). It is written by
//! the trainer, so it is hostile input: the watcher reads at most
//! [`MAX_PROGRESS_BYTES`](crate::checkpoint::run::MAX_PROGRESS_BYTES) of a regular file the
//! process's own user owns, through no symlink, and [`parse`] accepts only the helper's exact
//! shape with sane numbers.

use serde::Deserialize;

use super::Error;

/// What a progress record says.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress {
    /// The last step trained.
    pub step: u64,
    /// When it was trained (Unix seconds).
    pub ts: f64,
    /// The last step made durable (saved, acked, uploaded, or resumed from).
    pub durable_step: Option<u64>,
    /// Since when the work after `durable_step` was at risk (Unix seconds).
    pub durable_ts: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    v: u32,
    step: Option<u64>,
    ts: Option<f64>,
    durable_step: Option<u64>,
    durable_ts: Option<f64>,
    // Informational for the agent (the helper writes them; nothing here uses them).
    #[serde(default, rename = "durable_checkpoint")]
    _durable_checkpoint: Option<String>,
    #[serde(default, rename = "resumed_step")]
    _resumed_step: Option<u64>,
    #[serde(default, rename = "resumed_ts")]
    _resumed_ts: Option<f64>,
}

/// A Unix time no earlier than 2001 and no later than 2200: anything else is not a clock.
pub(crate) fn sane_time(t: f64) -> bool {
    t.is_finite() && (1.0e9..7.3e9).contains(&t)
}

/// Parse a progress record strictly: version 1, a step and its time, the durable pair whole or
/// absent, times that are Unix times, a durable step no later than the step.
pub fn parse(data: &[u8]) -> Result<Progress, Error> {
    let bad = |why: &str| Error::Progress(why.to_string());
    if data.len() as u64 > crate::checkpoint::run::MAX_PROGRESS_BYTES {
        return Err(bad("too large"));
    }
    let raw: Raw = serde_json::from_slice(data).map_err(|e| Error::Progress(e.to_string()))?;
    if raw.v != 1 {
        return Err(Error::Progress(format!("version {} (expected 1)", raw.v)));
    }
    let (Some(step), Some(ts)) = (raw.step, raw.ts) else {
        return Err(bad("no step yet"));
    };
    if !sane_time(ts) {
        return Err(bad("ts is not a Unix time"));
    }
    let (durable_step, durable_ts) = match (raw.durable_step, raw.durable_ts) {
        (Some(s), Some(t)) if sane_time(t) => (Some(s), Some(t)),
        (None, None) => (None, None),
        _ => {
            return Err(bad(
                "durable_step and durable_ts must come together, as a Unix time",
            ))
        }
    };
    Ok(Progress {
        step,
        ts,
        durable_step,
        durable_ts,
    })
}

impl Progress {
    /// Steps and seconds trained after the last durable step: `None` without a durable step.
    /// A step behind the durable one (the record of an older run) counts as nothing lost.
    pub fn thrown_away(&self) -> Option<(u64, f64)> {
        let (k, t) = (self.durable_step?, self.durable_ts?);
        Some((self.step.saturating_sub(k), (self.ts - t).max(0.0)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_helpers_record_parses_and_counts_what_was_thrown_away() {
        let p = parse(
            br#"{"v":1,"step":130,"ts":1700000100.5,"durable_step":100,"durable_ts":1700000070.5,"durable_checkpoint":"/c/step-100","resumed_step":0,"resumed_ts":1700000000.0}"#,
        )
        .unwrap();
        assert_eq!(p.step, 130);
        assert_eq!(p.thrown_away(), Some((30, 30.0)));
        let fresh = parse(br#"{"v":1,"step":5,"ts":1700000000.0}"#).unwrap();
        assert_eq!(fresh.thrown_away(), None);
    }

    #[test]
    fn anything_else_is_refused() {
        for bad in [
            &br#"{"v":2,"step":1,"ts":1700000000.0}"#[..],
            br#"{"v":1,"step":1,"ts":1700000000.0,"extra":1}"#,
            br#"{"v":1,"step":-1,"ts":1700000000.0}"#,
            br#"{"v":1,"step":1,"ts":1e300}"#,
            br#"{"v":1,"step":1,"ts":1700000000.0,"durable_step":1}"#,
            br#"{"v":1,"step":1,"ts":1700000000.0,"durable_step":1,"durable_ts":5}"#,
            br#"{"v":1,"step":null,"ts":null}"#,
            b"not json",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let huge = format!(
            r#"{{"v":1,"step":1,"ts":1700000000.0,"durable_checkpoint":"{}"}}"#,
            "x".repeat(5000)
        );
        assert!(parse(huge.as_bytes()).is_err());
    }
}
