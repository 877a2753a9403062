//! Progress counters, the periodic reporter (a bar on a TTY, JSON lines otherwise) and the final
//! summary.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// Live counters of one dataset run, updated by the download tasks.
#[derive(Debug, Default)]
pub struct Progress {
    /// Bytes and files listed at the source so far.
    pub bytes_total: AtomicU64,
    pub files_total: AtomicU64,
    /// Bytes and files present locally (already there, fetched, or fetched by another process).
    pub bytes_done: AtomicU64,
    pub files_done: AtomicU64,
    /// Files this process downloaded and published.
    pub files_fetched: AtomicU64,
    /// Files already whole in the cache at the start.
    pub files_present: AtomicU64,
    /// Files another process (sharing the cache) downloaded while we waited.
    pub files_by_others: AtomicU64,
    pub files_failed: AtomicU64,
    /// Body bytes received from the store and written.
    pub bytes_fetched: AtomicU64,
    /// Bytes reused from part files of interrupted downloads.
    pub bytes_resumed: AtomicU64,
    /// GET requests sent.
    pub requests: AtomicU64,
    /// Files this process published, by what verified their content.
    pub verified_crc64nvme: AtomicU64,
    pub verified_crc32c: AtomicU64,
    pub verified_crc32: AtomicU64,
    pub verified_sha256: AtomicU64,
    pub verified_md5: AtomicU64,
    pub verified_size: AtomicU64,
    /// The listing has finished (totals are final).
    pub listed: AtomicBool,
}

/// A consistent-enough copy of the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Snapshot {
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub files_done: u64,
    pub files_total: u64,
    pub files_fetched: u64,
    pub files_present: u64,
    pub files_by_others: u64,
    pub files_failed: u64,
    pub bytes_fetched: u64,
    pub bytes_resumed: u64,
    pub requests: u64,
    pub verified_crc64nvme: u64,
    pub verified_crc32c: u64,
    pub verified_crc32: u64,
    pub verified_sha256: u64,
    pub verified_md5: u64,
    pub verified_size: u64,
    pub listed: bool,
}

impl Progress {
    pub fn snapshot(&self) -> Snapshot {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Snapshot {
            bytes_done: r(&self.bytes_done),
            bytes_total: r(&self.bytes_total),
            files_done: r(&self.files_done),
            files_total: r(&self.files_total),
            files_fetched: r(&self.files_fetched),
            files_present: r(&self.files_present),
            files_by_others: r(&self.files_by_others),
            files_failed: r(&self.files_failed),
            bytes_fetched: r(&self.bytes_fetched),
            bytes_resumed: r(&self.bytes_resumed),
            requests: r(&self.requests),
            verified_crc64nvme: r(&self.verified_crc64nvme),
            verified_crc32c: r(&self.verified_crc32c),
            verified_crc32: r(&self.verified_crc32),
            verified_sha256: r(&self.verified_sha256),
            verified_md5: r(&self.verified_md5),
            verified_size: r(&self.verified_size),
            listed: self.listed.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn sub(counter: &AtomicU64, n: u64) {
        // Saturating: never wraps even if accounting of a reset object races with a report.
        let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            Some(v.saturating_sub(n))
        });
    }
}

/// How progress is shown by the CLI.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProgressMode {
    /// A bar on stderr when it is a terminal, JSON lines on stdout otherwise.
    Auto,
    /// A bar on stderr.
    Tty,
    /// JSON lines on stdout.
    Json,
    /// Nothing but errors.
    None,
}

impl ProgressMode {
    /// Resolve `Auto` against the real terminal.
    pub fn resolve(self) -> ProgressMode {
        match self {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Tty,
            ProgressMode::Auto => ProgressMode::Json,
            other => other,
        }
    }
}

#[derive(Serialize)]
struct ProgressLine<'a> {
    event: &'static str,
    dataset: &'a str,
    bytes_done: u64,
    bytes_total: u64,
    files_done: u64,
    files_total: u64,
    rate_bps: u64,
}

/// Print progress every `every` until `stop` is cancelled; in TTY mode the bar is cleared at
/// the end.
pub async fn report(
    progress: Arc<Progress>,
    dataset: String,
    mode: ProgressMode,
    every: Duration,
    stop: CancellationToken,
) {
    if matches!(mode, ProgressMode::None) {
        return;
    }
    let mut last = (Instant::now(), 0u64);
    let mut tick = tokio::time::interval(every);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let s = progress.snapshot();
        let now = Instant::now();
        let dt = now.duration_since(last.0).as_secs_f64().max(1e-3);
        let rate = (s.bytes_done.saturating_sub(last.1) as f64 / dt) as u64;
        last = (now, s.bytes_done);
        match mode {
            ProgressMode::Tty => {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r{}\x1b[K", bar_line(&s, rate));
                let _ = err.flush();
            }
            _ => {
                let line = ProgressLine {
                    event: "progress",
                    dataset: &dataset,
                    bytes_done: s.bytes_done,
                    bytes_total: s.bytes_total,
                    files_done: s.files_done,
                    files_total: s.files_total,
                    rate_bps: rate,
                };
                if let Ok(json) = serde_json::to_string(&line) {
                    let mut out = std::io::stdout().lock();
                    let _ = writeln!(out, "{json}");
                    let _ = out.flush();
                }
            }
        }
    }
    if matches!(mode, ProgressMode::Tty) {
        let _ = write!(std::io::stderr(), "\r\x1b[K");
    }
}

/// One line of the TTY bar: `[#####-----]  48%  1.0 GiB/2.0 GiB  500/1004 files  350 MiB/s`.
pub fn bar_line(s: &Snapshot, rate_bps: u64) -> String {
    const WIDTH: u64 = 24;
    let frac = if s.bytes_total == 0 {
        if s.listed {
            1.0
        } else {
            0.0
        }
    } else {
        (s.bytes_done as f64 / s.bytes_total as f64).min(1.0)
    };
    let filled = (frac * WIDTH as f64).round() as u64;
    let bar: String = (0..WIDTH)
        .map(|i| if i < filled { '#' } else { '-' })
        .collect();
    let eta = if rate_bps > 0 && s.listed {
        format!(
            "  ETA {}s",
            s.bytes_total.saturating_sub(s.bytes_done) / rate_bps
        )
    } else {
        String::new()
    };
    format!(
        "[{bar}] {:>3}%  {}/{}{}  {}/{} files  {}/s{eta}",
        (frac * 100.0).floor() as u64,
        human_bytes(s.bytes_done),
        human_bytes(s.bytes_total),
        if s.listed { "" } else { "+" },
        s.files_done,
        s.files_total,
        human_bytes(rate_bps),
    )
}

/// `1536` → `1.5 KiB`.
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

/// Parse a size: `8MiB`, `16 MB`, `1.5GiB`, `4096`, `64k` (k/M/G/T are binary, like `KiB`;
/// `KB`/`MB`/… are decimal).
/// A `--part-size`-like flag: a size ([`parse_size`]) between `min` and `max` bytes, named
/// `what` in the error (`min_text` and `max_text` as the user would write them).
pub fn parse_size_between(
    s: &str,
    what: &str,
    (min, min_text): (u64, &str),
    (max, max_text): (u64, &str),
) -> Result<u64, String> {
    let v = parse_size(s)?;
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

pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?} (expected e.g. 8MiB, 1GB, 4096)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "ki" => 1 << 10,
        "m" | "mib" | "mi" => 1 << 20,
        "g" | "gib" | "gi" => 1 << 30,
        "t" | "tib" | "ti" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("unknown size unit {other:?} in {s:?}")),
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size {s:?} out of range"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_and_decimal() {
        assert_eq!(parse_size("8MiB").unwrap(), 8 << 20);
        assert_eq!(parse_size("8M").unwrap(), 8 << 20);
        assert_eq!(parse_size("16 mib").unwrap(), 16 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("8 parsecs").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn bar_shows_fraction_sizes_and_rate() {
        let s = Snapshot {
            bytes_done: 1 << 30,
            bytes_total: 2 << 30,
            files_done: 500,
            files_total: 1004,
            listed: true,
            ..Snapshot::default()
        };
        let line = bar_line(&s, 512 << 20);
        assert!(
            line.starts_with("[############------------]  50%"),
            "{line}"
        );
        assert!(line.contains("1.0 GiB/2.0 GiB"), "{line}");
        assert!(line.contains("500/1004 files"), "{line}");
        assert!(line.contains("512.0 MiB/s  ETA 2s"), "{line}");
        assert_eq!(human_bytes(1023), "1023 B");
    }

    #[test]
    fn sub_saturates() {
        let p = Progress::default();
        Progress::add(&p.bytes_done, 5);
        Progress::sub(&p.bytes_done, 9);
        assert_eq!(p.snapshot().bytes_done, 0);
    }
}
