//! Durations as people write them: `500ms`, `30s`, `10m`, `1h 30m`, `7d` (a day is 24 hours),
//! `0`, or ISO 8601 (`PT30S`). One parser and one printer for the command line, the config file,
//! the emulator's control surface and log lines, all on `jiff` (the project's one time crate).
//! And the one place of time arithmetic between wall-clock times and durations: saturating
//! `t ± d`, the time left until a deadline, and the deadlines derived from one (the checkpoint
//! wait's end, a maintenance plan's start).

use std::fmt;
use std::time::Duration;

use jiff::{SignedDuration, Span, SpanRelativeTo, Timestamp};

/// Parse a non-negative duration. Units up to weeks are accepted; days and weeks are 24 h and 7 × 24 h.
/// The error does not repeat the input (it may be a pod's annotation): callers add their context.
pub fn parse(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    let signed = match text.parse::<SignedDuration>() {
        Ok(d) => d,
        // Calendar units (days, weeks) only parse into a Span; read them as fixed 24-hour days.
        Err(_) => text
            .parse::<Span>()
            .ok()
            .and_then(|span| span.to_duration(SpanRelativeTo::days_are_24_hours()).ok())
            .ok_or_else(|| words(text))?,
    };
    Duration::try_from(signed).map_err(|_| "a duration cannot be negative".to_string())
}

/// A refused duration in the project's words (the parser's own text names its grammar).
fn words(text: &str) -> String {
    if !text.is_empty() && text.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return format!("{text:?} has no unit: write {text}s for seconds (or ms, m, h)");
    }
    if text.starts_with('-') {
        return "a duration cannot be negative".into();
    }
    format!("{text:?} is not a duration: write a number and a unit, like 500ms, 30s, 10m or 1h30m")
}

/// [`parse`], refusing zero.
pub fn parse_positive(text: &str) -> Result<Duration, String> {
    let d = parse(text)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

/// A duration from JSON: a string [`parse`] accepts, or a non-negative number of seconds.
pub fn from_json(value: &serde_json::Value) -> Result<Duration, String> {
    match value {
        serde_json::Value::String(s) => parse(s),
        serde_json::Value::Number(n) => match n.as_u64() {
            Some(secs) => Ok(Duration::from_secs(secs)),
            None => n
                .as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                .and_then(|f| Duration::try_from_secs_f64(f).ok())
                .ok_or_else(|| format!("{n} is not a non-negative number of seconds")),
        },
        other => Err(format!(
            "{other} is not a duration (use \"30s\" or seconds)"
        )),
    }
}

/// The friendly form of a duration (`1s 500ms`, `2m 30s`, `30h 1m 1s`), as [`parse`] reads it back.
pub fn display(d: Duration) -> Friendly {
    Friendly(d)
}

/// See [`display`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Friendly(pub Duration);

impl fmt::Display for Friendly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // From a second up, whole milliseconds: a computed backoff reads "17s 271ms", not
        // "17s 271ms 320µs 266ns".
        let d = if self.0 >= Duration::from_secs(1) {
            Duration::from_millis(self.0.as_millis().min(u64::MAX as u128) as u64)
        } else {
            self.0
        };
        match SignedDuration::try_from(d) {
            Ok(d) => write!(f, "{d:#}"),
            // Beyond ~292 billion years: not a duration anyone configures.
            Err(_) => write!(f, "{}s", self.0.as_secs()),
        }
    }
}

/// `t + d`, saturating at the representable range.
pub fn add(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|sd| t.checked_add(sd).ok())
        .unwrap_or(Timestamp::MAX)
}

/// `t − d`, saturating at the representable range.
pub fn sub(t: Timestamp, d: Duration) -> Timestamp {
    SignedDuration::try_from(d)
        .ok()
        .and_then(|sd| t.checked_sub(sd).ok())
        .unwrap_or(Timestamp::MIN)
}

/// The time from `now` until `t` (zero when past).
pub fn until(t: Timestamp, now: Timestamp) -> Duration {
    time_until(Some(t), now)
}

/// `deadline − now`, zero for a missing or past deadline.
pub fn time_until(deadline: Option<Timestamp>, now: Timestamp) -> Duration {
    match deadline {
        Some(d) if d > now => {
            let span = d.duration_since(now);
            Duration::try_from(span).unwrap_or(Duration::ZERO)
        }
        _ => Duration::ZERO,
    }
}

/// A missing or past deadline means "now".
pub fn effective_deadline(deadline: Option<Timestamp>, now: Timestamp) -> Timestamp {
    match deadline {
        Some(d) if d > now => d,
        _ => now,
    }
}

/// When checkpoint waiting must end: `min(now + timeout, deadline − reserve)`, never before now.
pub fn checkpoint_deadline(
    deadline: Timestamp,
    now: Timestamp,
    reserve: Duration,
    timeout: Duration,
) -> Timestamp {
    let by_timeout = add(now, timeout);
    let by_deadline = sub(deadline, reserve);
    let end = if by_timeout < by_deadline {
        by_timeout
    } else {
        by_deadline
    };
    if end < now {
        now
    } else {
        end
    }
}

/// When handling of a scheduled event starts: `not_before − lead` (never before now).
pub fn maintenance_start(not_before: Timestamp, lead: Duration, now: Timestamp) -> Timestamp {
    let start = sub(not_before, lead);
    if start < now {
        now
    } else {
        start
    }
}

/// Serde for a `Duration` as its friendly string; on input also whole or fractional seconds.
pub mod serde_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&super::display(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        super::from_json(&value).map_err(serde::de::Error::custom)
    }
}

/// Serde for an `Option<Duration>` as [`serde_str`] does it; `null` or absent is `None`.
pub mod serde_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => s.collect_str(&super::display(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<serde_json::Value>::deserialize(d)? {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => super::from_json(&v)
                .map(Some)
                .map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + s).unwrap()
    }

    #[test]
    fn checkpoint_deadline_is_min_of_timeout_and_reserve() {
        let now = ts(0);
        // EC2: 120 s notice, 25 s reserve, 90 s timeout → 90 s.
        assert_eq!(
            checkpoint_deadline(
                ts(120),
                now,
                Duration::from_secs(25),
                Duration::from_secs(90)
            ),
            ts(90)
        );
        // GCE: 30 s notice, 8 s reserve → 22 s.
        assert_eq!(
            checkpoint_deadline(ts(30), now, Duration::from_secs(8), Duration::from_secs(90)),
            ts(22)
        );
        // Deadline already inside the reserve → now.
        assert_eq!(
            checkpoint_deadline(ts(5), now, Duration::from_secs(8), Duration::from_secs(90)),
            now
        );
    }

    #[test]
    fn maintenance_start_is_lead_before_not_before_never_before_now() {
        let now = ts(0);
        assert_eq!(
            maintenance_start(ts(3600), Duration::from_secs(600), now),
            ts(3000)
        );
        assert_eq!(
            maintenance_start(ts(300), Duration::from_secs(600), now),
            now
        );
    }

    #[test]
    fn parses_what_operators_write() {
        for (text, secs) in [
            ("500ms", 0.5),
            ("30s", 30.0),
            (" 10m ", 600.0),
            ("1h 30m", 5400.0),
            ("2h30m", 9000.0),
            ("10 minutes", 600.0),
            ("1.5s", 1.5),
            ("0", 0.0),
            ("0s", 0.0),
            ("7d", 604_800.0),
            ("1w", 604_800.0),
            ("PT30S", 30.0),
        ] {
            assert_eq!(parse(text).unwrap().as_secs_f64(), secs, "{text}");
        }
    }

    #[test]
    fn refuses_negative_empty_and_unitless() {
        for text in ["-5s", "", "5", "soon", "5 parsecs"] {
            assert!(parse(text).is_err(), "{text}");
        }
        assert_eq!(
            parse_positive("0s").unwrap_err(),
            "must be greater than zero"
        );
    }

    #[test]
    fn display_round_trips() {
        for d in [
            Duration::ZERO,
            Duration::from_millis(1500),
            Duration::from_secs(150),
            Duration::from_secs(30 * 3600 + 61),
            Duration::from_micros(234_567),
        ] {
            let text = display(d).to_string();
            assert_eq!(parse(&text).unwrap(), d, "{text}");
        }
        // From a second up, whole milliseconds (a computed backoff, not its nanoseconds).
        assert_eq!(
            display(Duration::from_nanos(17_271_320_266)).to_string(),
            "17s 271ms"
        );
        assert_eq!(display(Duration::from_secs(150)).to_string(), "2m 30s");
        assert_eq!(display(Duration::from_millis(1500)).to_string(), "1s 500ms");
    }

    #[test]
    fn json_takes_strings_and_seconds() {
        assert_eq!(
            from_json(&serde_json::json!("2m")).unwrap(),
            Duration::from_secs(120)
        );
        assert_eq!(
            from_json(&serde_json::json!(90)).unwrap(),
            Duration::from_secs(90)
        );
        assert_eq!(
            from_json(&serde_json::json!(0.25)).unwrap(),
            Duration::from_millis(250)
        );
        assert!(from_json(&serde_json::json!(-1)).is_err());
        assert!(from_json(&serde_json::json!(true)).is_err());
    }
}
