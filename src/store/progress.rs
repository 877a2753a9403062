//! Progress counters, the periodic reporter (a bar on a TTY, JSON lines otherwise) and the final
//! summary.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::units::human_bytes;

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
    /// Upload: bytes of the requests under way (a PUT or a part counts in `bytes_done` only once
    /// the store answered it).
    pub bytes_in_flight: AtomicU64,
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

#[cfg(test)]
mod tests {
    use super::*;

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
