//! `spotguard prefetch SRC DEST`: one-shot prefetch (also an initContainer).
//!
//! Exit codes: 0 every object is in the cache; 1 some objects failed (named on stderr and in the
//! summary); 2 the run failed (listing, credentials, disk full, cache full, I/O); 3 cancelled or
//! `--timeout` reached (safe to run again: it resumes); 64 bad arguments.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::cache::DatasetPaths;
use super::download::{self, FetchOptions, Job, Outcome, Summary, Verify};
use super::progress::{self, human_bytes, parse_size, Progress, ProgressMode};
use super::source::{self, SourceUrl, StoreOptions};

/// Exit code: everything is in the cache.
pub const EXIT_OK: i32 = 0;
/// Exit code: some objects failed.
pub const EXIT_PARTIAL: i32 = 1;
/// Exit code: the run failed.
pub const EXIT_FAILED: i32 = 2;
/// Exit code: cancelled or timed out.
pub const EXIT_CANCELLED: i32 = 3;
/// Exit code: bad arguments.
pub const EXIT_USAGE: i32 = 64;

fn parse_part_size(s: &str) -> Result<u64, String> {
    let v = parse_size(s)?;
    if !(64 << 10..=5 << 30).contains(&v) {
        return Err(format!("part size {s} must be between 64KiB and 5GiB"));
    }
    Ok(v)
}

fn parse_concurrency(s: &str) -> Result<usize, String> {
    let v: usize = s
        .parse()
        .map_err(|_| format!("invalid concurrency {s:?}"))?;
    if !(1..=1024).contains(&v) {
        return Err(format!("concurrency {v} must be between 1 and 1024"));
    }
    Ok(v)
}

/// Arguments of `spotguard prefetch`.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefetchArgs {
    /// Source: s3://bucket/prefix, gs://bucket/prefix or file:///dir.
    #[arg(value_name = "SRC")]
    pub src: String,

    /// Cache root: the dataset goes to DEST/<name>.
    #[arg(value_name = "DEST")]
    pub dest: PathBuf,

    /// Dataset name (directory under DEST); default: bucket and prefix joined with '-'.
    #[arg(long)]
    pub name: Option<String>,

    /// GET requests in flight.
    #[arg(long, default_value = "32", value_parser = parse_concurrency)]
    pub concurrency: usize,

    /// Objects larger than this are fetched as parallel ranged GETs of this size (8MiB, 16MiB…).
    #[arg(long, default_value = "8MiB", value_parser = parse_part_size)]
    pub part_size: u64,

    /// S3-compatible endpoint (path-style; http:// allowed), e.g. http://127.0.0.1:9000.
    #[arg(long, env = "SPOTGUARD_PREFETCH_ENDPOINT")]
    pub endpoint: Option<String>,

    /// Keep the cache under this size, evicting least-recently-used datasets not in use.
    #[arg(long, value_parser = parse_size)]
    pub cache_max_bytes: Option<u64>,

    /// Progress display: a bar on a TTY, JSON lines otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: ProgressMode,

    /// Verification before a file is published: `md5` checks plain-MD5 etags, `size` only sizes.
    #[arg(long, value_enum, default_value = "md5")]
    pub verify: Verify,

    /// Give up after this long (exit 3; a later run resumes), e.g. 30m.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,

    /// A dataset whose .spotguard/lease was touched within this window is in use (never evicted).
    #[arg(long, default_value = "15m", value_parser = humantime::parse_duration)]
    pub in_use_window: Duration,

    /// Lease of per-object claims in a shared cache (renewed every lease/6).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub claim_lease: Duration,
}

/// Run `spotguard prefetch`; returns the process exit code.
pub async fn run_cli(args: PrefetchArgs, cancel: CancellationToken) -> i32 {
    let usage = |msg: String| {
        eprintln!("spotguard prefetch: {msg}");
        EXIT_USAGE
    };
    let src = match SourceUrl::parse(&args.src) {
        Ok(s) => s,
        Err(e) => return usage(e.to_string()),
    };
    let name = args.name.clone().unwrap_or_else(|| src.default_name());
    if let Err(e) = source::validate_name(&name) {
        return usage(e.to_string());
    }
    if args.claim_lease < Duration::from_secs(3) {
        return usage("--claim-lease must be at least 3s".to_string());
    }
    let store_opts = StoreOptions {
        endpoint: args.endpoint.clone(),
        pool: args.concurrency,
        ..StoreOptions::default()
    };
    let store = match source::build_store(&src, &store_opts) {
        Ok(s) => s,
        Err(e @ super::Error::InvalidUrl { .. }) => return usage(e.to_string()),
        Err(e) => {
            eprintln!("spotguard prefetch: {e}");
            return EXIT_FAILED;
        }
    };
    let mode = args.progress.resolve();
    let run_cancel = cancel.child_token();
    let timed_out = Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Some(limit) = args.timeout {
        let t = run_cancel.clone();
        let flag = timed_out.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = t.cancelled() => {}
                _ = tokio::time::sleep(limit) => {
                    flag.store(true, std::sync::atomic::Ordering::Relaxed);
                    t.cancel();
                }
            }
        });
    }
    let progress = Arc::new(Progress::default());
    let stop_report = CancellationToken::new();
    let reporter = tokio::spawn(progress::report(
        progress.clone(),
        name.clone(),
        mode,
        Duration::from_secs(1),
        stop_report.clone(),
    ));
    let job = Job {
        store,
        paths: DatasetPaths::new(&args.dest, &name),
        cache_root: args.dest.clone(),
        source: src,
        options: FetchOptions {
            concurrency: args.concurrency,
            part_size: args.part_size,
            verify: args.verify,
            lease: args.claim_lease,
            renew_every: args.claim_lease / 6,
            max_bytes: args.cache_max_bytes,
            in_use_window: args.in_use_window,
            touch_lease_on_complete: true,
            ..FetchOptions::default()
        },
        progress,
        metrics: None,
        cancel: run_cancel.clone(),
    };
    let report = download::fetch_dataset(job).await;
    stop_report.cancel();
    let _ = reporter.await;
    run_cancel.cancel();

    let s = &report.summary;
    print_summary(s, mode);
    for e in &s.errors {
        eprintln!("spotguard prefetch: {}: {}", e.key, e.error);
    }
    if s.counts.files_failed as usize > s.errors.len() {
        eprintln!(
            "spotguard prefetch: … and {} more failed objects",
            s.counts.files_failed as usize - s.errors.len()
        );
    }
    if let Some(e) = &report.fatal {
        eprintln!("spotguard prefetch: error: {e}");
    }
    match s.outcome {
        Outcome::Complete => EXIT_OK,
        Outcome::Incomplete => EXIT_PARTIAL,
        Outcome::Failed => EXIT_FAILED,
        Outcome::Cancelled => {
            if timed_out.load(std::sync::atomic::Ordering::Relaxed) {
                eprintln!("spotguard prefetch: --timeout reached; run again to resume");
            } else {
                eprintln!("spotguard prefetch: cancelled; run again to resume");
            }
            EXIT_CANCELLED
        }
    }
}

fn print_summary(s: &Summary, mode: ProgressMode) {
    match mode {
        ProgressMode::None => {}
        ProgressMode::Tty | ProgressMode::Auto => {
            eprintln!(
                "{}: {:?}: {}/{} files, {} fetched ({} resumed, {} files from other processes) in {:.1}s ({}/s)",
                s.dataset,
                s.outcome,
                s.counts.files_done,
                s.counts.files_total,
                human_bytes(s.counts.bytes_fetched),
                human_bytes(s.counts.bytes_resumed),
                s.counts.files_by_others,
                s.duration_s,
                human_bytes(s.rate_bps),
            );
        }
        ProgressMode::Json => {
            if let Ok(json) = serde_json::to_string(s) {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{json}");
                let _ = out.flush();
            }
        }
    }
}
