//! `spotguard prefetch SRC DEST`: one-shot prefetch (also an initContainer), and
//! `spotguard prefetch --wait NAME DIR`: wait until dataset NAME under cache root DIR is complete
//! (the initContainer of a training pod whose dataset the node's prefetcher warms).
//!
//! Exit codes: 0 every object is in the cache; 1 some objects failed (named on stderr and in the
//! summary); 2 the run failed (listing, credentials, disk full, cache full, I/O); 3 cancelled or
//! `--timeout` reached (safe to run again: it resumes); 64 bad arguments.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::cache::DatasetPaths;
use super::download::{self, FetchOptions, Job, Outcome, Summary, Verify};
use crate::store::progress::{self, Progress, ProgressMode};
use crate::store::url::{self as source, SourceUrl, StoreOptions};
use crate::units::{self, human_bytes};

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
    units::parse_bytes_between(s, "part size", (64 << 10, "64KiB"), (5 << 30, "5GiB"))
}

fn parse_parts_per_object(s: &str) -> Result<usize, String> {
    units::parse_count_between(s, "parts per object", 1, 1024)
}

fn parse_concurrency(s: &str) -> Result<usize, String> {
    units::parse_count_between(s, "concurrency", 1, 1024)
}

/// Arguments of `spotguard prefetch`.
#[derive(clap::Args, Debug, Clone)]
pub struct PrefetchArgs {
    /// Source: s3://bucket/prefix, gs://bucket/prefix or file:///dir (with --wait: the cache root;
    /// with --latest-checkpoint: DEST).
    #[arg(value_name = "SRC", required_unless_present_any = ["wait", "latest_checkpoint"])]
    pub src: Option<String>,

    /// Cache root: the dataset goes to DEST/<name>.
    #[arg(value_name = "DEST", required_unless_present_any = ["wait", "latest_checkpoint"])]
    pub dest: Option<PathBuf>,

    /// Find the latest complete checkpoint (a directory with a manifest.json, as `spotguard
    /// upload` and staged acks publish them) under this location (s3://, gs://, file:/// or a
    /// directory) and fetch it into DEST/<name>, DEST given as the one positional argument;
    /// without DEST print it. Prints one JSON line (null when there is none: exit 0).
    #[arg(long, value_name = "LOCATION", conflicts_with_all = ["wait", "name", "source"])]
    pub latest_checkpoint: Option<String>,

    /// Dataset name (directory under DEST); default: scheme, bucket and prefix joined with '-',
    /// plus a short hash of the source.
    #[arg(long)]
    pub name: Option<String>,

    /// Fetch nothing: wait until dataset NAME is complete under the cache root given as the one
    /// positional argument (`spotguard prefetch --wait c4-en /data`); exit 0 then, 3 at --timeout.
    #[arg(long, value_name = "NAME", conflicts_with = "name")]
    pub wait: Option<String>,

    /// With --wait: also require the dataset to hold this source (s3://… or gs://…).
    #[arg(long, value_name = "URL", requires = "wait")]
    pub source: Option<String>,

    /// GET requests in flight.
    #[arg(long, default_value = "32", value_parser = parse_concurrency)]
    pub concurrency: usize,

    /// Objects larger than this are fetched as parallel ranged GETs of this size (8MiB, 16MiB…).
    #[arg(long, default_value = "8MiB", value_parser = parse_part_size)]
    pub part_size: u64,

    /// One object's share of the request slots for its ranged GETs while other objects wait
    /// for a slot (within --concurrency); with none waiting it takes the free slots too.
    #[arg(long, default_value = "4", value_parser = parse_parts_per_object)]
    pub parts_per_object: usize,

    /// S3-compatible endpoint (path-style; http:// allowed), e.g. http://127.0.0.1:9000.
    #[arg(long, env = "SPOTGUARD_PREFETCH_ENDPOINT", value_name = "URL", value_parser = crate::store::url::parse_http_url)]
    pub endpoint: Option<String>,

    /// Keep the cache under this size, evicting least-recently-used datasets not in use.
    #[arg(long, value_parser = units::parse_limit)]
    pub cache_max_bytes: Option<u64>,

    /// Progress display: a bar on a TTY, JSON lines otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: ProgressMode,

    /// Verification before a file is published: `checksum` uses the store's CRC64NVME / CRC32C /
    /// CRC32 / SHA-256 when it keeps one, else a plain-MD5 etag, else the size; `size` only sizes.
    #[arg(long, value_enum, default_value = "checksum")]
    pub verify: Verify,

    /// Give up after this long (exit 3; a later run resumes), e.g. 30m.
    #[arg(long, value_parser = crate::duration::parse)]
    pub timeout: Option<Duration>,

    /// A dataset whose .spotguard/lease was touched within this window is in use (never evicted).
    #[arg(long, default_value = "15m", value_parser = crate::duration::parse)]
    pub in_use_window: Duration,

    /// Lease of per-object claims in a shared cache (renewed every lease/6).
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub claim_lease: Duration,
}

/// Run `spotguard prefetch`; returns the process exit code.
pub async fn run_cli(args: PrefetchArgs, cancel: CancellationToken) -> i32 {
    fetch(args, None, cancel).await
}

/// `spotguard prefetch SRC DEST` fetching only the keys of `only` (relative to SRC) and ignoring
/// every other object under SRC: `--latest-checkpoint` fetches its manifest's files this way.
pub async fn run_only(
    args: PrefetchArgs,
    only: Arc<std::collections::HashSet<String>>,
    cancel: CancellationToken,
) -> i32 {
    fetch(args, Some(only), cancel).await
}

async fn fetch(
    args: PrefetchArgs,
    only: Option<Arc<std::collections::HashSet<String>>>,
    cancel: CancellationToken,
) -> i32 {
    if let Some(name) = args.wait.clone() {
        return wait_for(args, name, cancel).await;
    }
    let (src, dest, name) = match what_to_fetch(&args) {
        Ok(it) => it,
        Err(msg) => {
            eprintln!("spotguard prefetch: {msg}");
            return EXIT_USAGE;
        }
    };
    let store = match open_store(&src, &args) {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mode = args.progress.resolve();
    let run_cancel = cancel.child_token();
    let timed_out = cancel_after(&run_cancel, args.timeout);
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
        paths: DatasetPaths::new(&dest, &name),
        cache_root: dest.clone(),
        source: src,
        options: fetch_options(&args, only),
        progress,
        metrics: None,
        cancel: run_cancel.clone(),
    };
    let report = download::fetch_dataset(job).await;
    stop_report.cancel();
    let _ = reporter.await;
    run_cancel.cancel();
    report_and_exit(&report, mode, timed_out.load(Ordering::Relaxed))
}

/// The source, the cache root and the dataset name of a fetch; `Err`: the usage error.
fn what_to_fetch(args: &PrefetchArgs) -> Result<(SourceUrl, PathBuf, String), String> {
    if args.latest_checkpoint.is_some() {
        // The binary sends it to `cli::latest_checkpoint` (which comes back here to fetch):
        // prefetch knows nothing of checkpoints.
        return Err("--latest-checkpoint is run by cli::latest_checkpoint".to_string());
    }
    let (Some(src_text), Some(dest)) = (args.src.clone(), args.dest.clone()) else {
        return Err("SRC and DEST are required".to_string());
    };
    let src = SourceUrl::parse(&src_text).map_err(|e| e.to_string())?;
    let name = args.name.clone().unwrap_or_else(|| src.default_name());
    source::validate_name(&name).map_err(|e| e.to_string())?;
    if args.claim_lease < Duration::from_secs(3) {
        return Err("--claim-lease must be at least 3s".to_string());
    }
    Ok((src, dest, name))
}

/// The store of `src`; `Err`: the exit code (the error printed).
fn open_store(
    src: &SourceUrl,
    args: &PrefetchArgs,
) -> Result<Arc<dyn object_store::ObjectStore>, i32> {
    let store_opts = StoreOptions {
        endpoint: args.endpoint.clone(),
        pool: args.concurrency,
        ..StoreOptions::default()
    };
    source::build_store(src, &store_opts).map_err(|e| {
        eprintln!("spotguard prefetch: {e}");
        match e {
            crate::store::Error::InvalidUrl { .. } => EXIT_USAGE,
            _ => EXIT_FAILED,
        }
    })
}

/// Cancel `run` after `limit` (none: never); the flag says the limit was reached.
pub fn cancel_after(run: &CancellationToken, limit: Option<Duration>) -> Arc<AtomicBool> {
    let timed_out = Arc::new(AtomicBool::new(false));
    if let Some(limit) = limit {
        let (t, flag) = (run.clone(), timed_out.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = t.cancelled() => {}
                _ = tokio::time::sleep(limit) => {
                    flag.store(true, Ordering::Relaxed);
                    t.cancel();
                }
            }
        });
    }
    timed_out
}

fn fetch_options(
    args: &PrefetchArgs,
    only: Option<Arc<std::collections::HashSet<String>>>,
) -> FetchOptions {
    FetchOptions {
        concurrency: args.concurrency,
        part_size: args.part_size,
        parts_per_object: args.parts_per_object,
        verify: args.verify,
        lease: args.claim_lease,
        renew_every: args.claim_lease / 6,
        max_bytes: args.cache_max_bytes,
        in_use_window: args.in_use_window,
        touch_lease_on_complete: true,
        failpoint: test_failpoint(),
        only,
        ..FetchOptions::default()
    }
}

/// Print the summary and the errors; the exit code of the outcome.
fn report_and_exit(report: &download::Report, mode: ProgressMode, timed_out: bool) -> i32 {
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
            if timed_out {
                eprintln!("spotguard prefetch: --timeout reached; run again to resume");
            } else {
                eprintln!("spotguard prefetch: cancelled; run again to resume");
            }
            EXIT_CANCELLED
        }
    }
}

/// `--wait NAME DIR`: poll for the dataset's `complete` marker.
async fn wait_for(args: PrefetchArgs, name: String, cancel: CancellationToken) -> i32 {
    let root = match (&args.src, &args.dest) {
        (Some(one), None) => PathBuf::from(one),
        (None, None) => PathBuf::from("/var/cache/spotguard"),
        _ => {
            eprintln!("spotguard prefetch: --wait takes one directory: the cache root");
            return EXIT_USAGE;
        }
    };
    if let Err(e) = source::validate_name(&name) {
        eprintln!("spotguard prefetch: {e}");
        return EXIT_USAGE;
    }
    let paths = DatasetPaths::new(&root, &name);
    let started = std::time::Instant::now();
    let mut last_log = started;
    loop {
        if let Some(marker) = super::cache::CompleteMarker::read(&paths.complete) {
            match &args.source {
                Some(want) if !super::cache::same_source(&marker.source, want) => {
                    eprintln!(
                        "spotguard prefetch: {} holds {}, not {want}",
                        paths.dir.display(),
                        marker.source
                    );
                    return EXIT_FAILED;
                }
                _ => {
                    eprintln!(
                        "spotguard prefetch: {name} is complete ({} files, {}) from {}",
                        marker.objects,
                        human_bytes(marker.bytes),
                        marker.source
                    );
                    return EXIT_OK;
                }
            }
        }
        if args.timeout.is_some_and(|t| started.elapsed() >= t) {
            eprintln!("spotguard prefetch: --timeout reached waiting for {name}");
            return EXIT_CANCELLED;
        }
        if last_log.elapsed() >= Duration::from_secs(30) {
            last_log = std::time::Instant::now();
            eprintln!(
                "spotguard prefetch: waiting for {} ({}s)",
                paths.dir.display(),
                started.elapsed().as_secs()
            );
        }
        tokio::select! {
            _ = cancel.cancelled() => return EXIT_CANCELLED,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// Debug builds only (tests): `SPOTGUARD_PREFETCH_FAILPOINT=kill-after-rename` kills this
/// process with SIGKILL right after the first file is renamed into place.
#[cfg(debug_assertions)]
fn test_failpoint() -> Option<download::Failpoint> {
    let spec = std::env::var("SPOTGUARD_PREFETCH_FAILPOINT").ok()?;
    let step = match spec.as_str() {
        "kill-after-rename" => download::PublishStep::Renamed,
        "kill-after-sync" => download::PublishStep::PartSynced,
        _ => return None,
    };
    Some(download::Failpoint(Arc::new(move |at, _path| {
        if at == step {
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    })))
}

#[cfg(not(debug_assertions))]
fn test_failpoint() -> Option<download::Failpoint> {
    None
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
