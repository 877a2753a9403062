//! Byte sizes, one dialect for every flag, environment variable and config key that takes one
//! (`--cache-max-bytes`, `--upload-max-bytes`, `--part-size`, `--staged-size`, …), and one way
//! of printing them.
//!
//! The dialect is Kubernetes' quantities and the IEC units: a number (a decimal fraction
//! allowed), optional blanks, then a unit, case-insensitive:
//!
//! | unit | bytes |
//! |---|---|
//! | none, `B` | 1 |
//! | `k`, `kB`; `M`, `MB`; `G`, `GB`; `T`, `TB` | 1000, 1000², 1000³, 1000⁴ |
//! | `Ki`, `KiB`; `Mi`, `MiB`; `Gi`, `GiB`; `Ti`, `TiB` | 1024, 1024², 1024³, 1024⁴ |
//!
//! So `500G` is 500 000 000 000 bytes and `500GiB` 536 870 912 000, wherever it is written. A
//! fraction of a byte rounds to the nearest byte. Whether 0 is a valid value is the setting's
//! call, not the dialect's: a limit (`--cache-max-bytes`) takes [`parse_limit`], which refuses it.

/// Parse a size in the crate's dialect (see the module doc); 0 is accepted.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (expected e.g. 500GiB, 8MiB, 1GB, 4096)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        "ti" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let bytes = (value * mult as f64).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// A size limit (`--cache-max-bytes`, `--upload-max-bytes`, `--staged-size`): a size of at least
/// one byte.
pub fn parse_limit(s: &str) -> Result<u64, String> {
    let v = parse_bytes(s)?;
    if v == 0 {
        return Err(format!("{s:?} is out of range (at least 1 byte)"));
    }
    Ok(v)
}

/// A `--part-size`-like flag: a size between `min` and `max` bytes, named `what` in the error
/// (`min_text` and `max_text` as the user would write them).
pub fn parse_bytes_between(
    s: &str,
    what: &str,
    (min, min_text): (u64, &str),
    (max, max_text): (u64, &str),
) -> Result<u64, String> {
    let v = parse_bytes(s)?;
    if !(min..=max).contains(&v) {
        return Err(format!(
            "{what} {s} must be between {min_text} and {max_text}"
        ));
    }
    Ok(v)
}

/// A `--concurrency`-like flag: a whole number between `min` and `max`, named `what`.
pub fn parse_count_between(s: &str, what: &str, min: usize, max: usize) -> Result<usize, String> {
    let v: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("invalid {what} {s:?}"))?;
    if !(min..=max).contains(&v) {
        return Err(format!("{what} {v} must be between {min} and {max}"));
    }
    Ok(v)
}

/// A byte count for people: `1536` → `1.5 KiB`, `1023` → `1023 B`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_and_decimal() {
        assert_eq!(parse_bytes("500G").unwrap(), 500_000_000_000);
        assert_eq!(parse_bytes("500GB").unwrap(), 500_000_000_000);
        assert_eq!(parse_bytes("500GiB").unwrap(), 536_870_912_000);
        assert_eq!(parse_bytes("500Gi").unwrap(), 536_870_912_000);
        assert_eq!(parse_bytes("64k").unwrap(), 64_000);
        assert_eq!(parse_bytes("64KiB").unwrap(), 65_536);
        assert_eq!(parse_bytes("8M").unwrap(), 8_000_000);
        assert_eq!(parse_bytes("8MiB").unwrap(), 8 << 20);
        assert_eq!(parse_bytes("16 mib").unwrap(), 16 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("2T").unwrap(), 2_000_000_000_000);
        assert_eq!(parse_bytes("1TiB").unwrap(), 1 << 40);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("4096B").unwrap(), 4096);
        assert_eq!(parse_bytes("0").unwrap(), 0);
    }

    #[test]
    fn what_is_not_a_size_is_refused() {
        for bad in [
            "",
            "MiB",
            "8 parsecs",
            "-1",
            "1.2.3G",
            "lots",
            "99999999999TiB",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_limit_is_at_least_one_byte() {
        assert!(parse_limit("0").is_err());
        assert!(parse_limit("0GiB").is_err());
        assert!(parse_limit("0.4").is_err(), "rounds to 0 bytes");
        assert_eq!(parse_limit("1").unwrap(), 1);
        assert_eq!(parse_limit("500G").unwrap(), 500_000_000_000);
    }

    #[test]
    fn bounded_sizes_name_the_setting() {
        let p = |s| parse_bytes_between(s, "part size", (5 << 20, "5MiB"), (5 << 30, "5GiB"));
        assert_eq!(p("8MiB").unwrap(), 8 << 20);
        assert_eq!(
            p("1MiB").unwrap_err(),
            "part size 1MiB must be between 5MiB and 5GiB"
        );
        assert!(p("6GiB").is_err());
        assert_eq!(parse_count_between("8", "concurrency", 1, 256).unwrap(), 8);
        assert!(parse_count_between("0", "concurrency", 1, 256).is_err());
        assert!(parse_count_between("x", "concurrency", 1, 256).is_err());
    }

    #[test]
    fn printed_in_binary_units() {
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(512 << 20), "512.0 MiB");
        assert_eq!(human_bytes(2 << 30), "2.0 GiB");
    }
}
