//! `spotguard upload STAGED DEST`: upload a checkpoint saved to local disk into `DEST/<name>`
//! (an object store prefix or a directory) and publish it with `manifest.json` written last —
//! the engine the agent runs after a staged ack, for operators, scripts and benchmarks.
//!
//! Exit codes: 0 published (or the destination already held this very checkpoint); 1 the staged
//! tree or the destination was refused (symlinks, special files, limits, allow-list); 2 the
//! upload failed (store, I/O, a file changed under it, checksum mismatch); 3 the deadline or
//! `--timeout` arrived, or it was interrupted (with `--state-dir`, running it again resumes);
//! 64 bad arguments. Nothing is published unless every file made it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::dest::{validate_checkpoint_name, AllowUpload, Granted, Location, UploadPolicy};
use super::engine::{self, Job, Meta, Options, Report};
use super::journal::RootRecord;
use super::manifest::Origin;
use super::staged::{self, Limits, Root, StagedTree};
use super::target::Target;
use super::Outcome;
use crate::store::progress::{self, Progress, ProgressMode};
use crate::store::url::StoreOptions;
use crate::units::{self, human_bytes};

/// Exit code: published.
pub const EXIT_OK: i32 = 0;
/// Exit code: the staged tree or the destination was refused.
pub const EXIT_REFUSED: i32 = 1;
/// Exit code: the upload failed.
pub const EXIT_FAILED: i32 = 2;
/// Exit code: deadline, timeout or interrupted.
pub const EXIT_STOPPED: i32 = 3;
/// Exit code: bad arguments.
pub const EXIT_USAGE: i32 = 64;

/// `--part-size` of uploads: 5 MiB (the stores' smallest part) to 5 GiB.
pub fn parse_part_size(s: &str) -> Result<u64, String> {
    units::parse_bytes_between(
        s,
        "part size",
        (engine::MIN_PART_SIZE, "5MiB"),
        (5 << 30, "5GiB"),
    )
}

/// `--concurrency` of uploads: 1 to 256.
pub fn parse_concurrency(s: &str) -> Result<usize, String> {
    units::parse_count_between(s, "concurrency", 1, 256)
}

/// `--deadline`: RFC 3339 or Unix seconds.
fn parse_deadline(s: &str) -> Result<jiff::Timestamp, String> {
    if let Ok(secs) = s.trim().parse::<f64>() {
        return jiff::Timestamp::from_millisecond((secs * 1000.0) as i64)
            .map_err(|e| format!("deadline {s:?}: {e}"));
    }
    s.trim()
        .parse::<jiff::Timestamp>()
        .map_err(|e| format!("deadline {s:?}: expected RFC 3339 or Unix seconds ({e})"))
}

/// Arguments of `spotguard upload`.
#[derive(clap::Args, Debug, Clone)]
pub struct UploadArgs {
    /// The staged checkpoint: a local directory (absolute path, no symlink in it) of regular
    /// files and directories.
    #[arg(value_name = "STAGED")]
    pub staged: PathBuf,

    /// Where the job's checkpoints go: s3://bucket/prefix, gs://bucket/prefix, file:///dir or
    /// /dir. The checkpoint lands in DEST/<name>.
    #[arg(value_name = "DEST")]
    pub dest: String,

    /// Checkpoint name (its directory under DEST) [default: STAGED's base name].
    #[arg(long)]
    pub name: Option<String>,

    /// Training step recorded in the manifest (orders checkpoints: the greatest is the latest).
    #[arg(long)]
    pub step: Option<u64>,

    /// This node's share of a checkpoint several nodes save into the same DEST/<name>, as
    /// INDEX/COUNT (e.g. 0/4): the manifest is manifest.part-INDEX-of-COUNT.json, and the
    /// checkpoint is complete once all COUNT parts are.
    #[arg(long, value_name = "INDEX/COUNT", value_parser = super::manifest::Part::parse)]
    pub part: Option<super::manifest::Part>,

    /// Requests in flight (a small file's in a buffer of its own size, a large file's part in
    /// a part-sized one: see --memory).
    #[arg(long, default_value = "8", value_parser = parse_concurrency)]
    pub concurrency: usize,

    /// Memory for part-sized buffers: large files' parts in flight are MEMORY / part size, at
    /// least 2; small files together hold at most one part size more.
    #[arg(long, value_name = "BYTES", default_value = "32MiB", value_parser = units::parse_limit)]
    pub memory: u64,

    /// Files up to this size are one PUT; larger ones go as multipart uploads of this part size.
    #[arg(long, default_value = "8MiB", value_parser = parse_part_size)]
    pub part_size: u64,

    /// S3-compatible endpoint (path-style; http:// allowed), e.g. http://127.0.0.1:9000.
    #[arg(long, env = "SPOTGUARD_UPLOAD_ENDPOINT", value_name = "URL", value_parser = crate::store::url::parse_http_url)]
    pub endpoint: Option<String>,

    /// Stop at this time (RFC 3339 or Unix seconds) and publish nothing if not done.
    #[arg(long, value_parser = parse_deadline)]
    pub deadline: Option<jiff::Timestamp>,

    /// Stop after this long (e.g. 25s) and publish nothing if not done.
    #[arg(long, value_parser = crate::duration::parse)]
    pub timeout: Option<Duration>,

    /// Keep the upload's journal under this directory (uploads/<hash>.json): run the same
    /// command again after an interruption and it resumes instead of starting over.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// Refuse destinations outside these locations (the agent's --upload-allow; comma-separated
    /// s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX] or directories). None: any destination.
    #[arg(long, value_name = "PATTERN", value_delimiter = ',', value_parser = AllowUpload::parse)]
    pub allow: Vec<AllowUpload>,

    /// Refuse a staged tree of more files than this.
    #[arg(long, default_value = "10000")]
    pub max_files: usize,

    /// Refuse a staged tree of more bytes than this.
    #[arg(long, default_value = "1TiB", value_parser = units::parse_limit)]
    pub max_bytes: u64,

    /// Progress display: a bar on a TTY, JSON lines otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub progress: ProgressMode,
}

fn usage(msg: impl std::fmt::Display) -> i32 {
    eprintln!("spotguard upload: {msg}");
    EXIT_USAGE
}

/// Run `spotguard upload`; returns the exit code.
pub async fn run_cli(args: UploadArgs, cancel: CancellationToken) -> i32 {
    match prepare(&args).await {
        Ok((name, step, tree, target)) => upload(args, name, step, tree, target, cancel).await,
        Err(code) => code,
    }
}

/// The arguments checked, the staged tree captured and the destination opened (or the exit
/// code of what was refused).
async fn prepare(args: &UploadArgs) -> Result<(String, Option<u64>, StagedTree, Target), i32> {
    let location = Location::parse(&args.dest).map_err(usage)?;
    let (name, step) = name_and_step(args)?;
    check_staged(&args.staged)?;
    let destination = location.join(&name);
    let granted = grant(args, &location, &destination, &name)?;
    let tree = capture(args).await?;
    let target = open_target(args, &destination, &granted, &tree)?;
    Ok((name, step, tree, target))
}

/// The checkpoint's name (`--name` or STAGED's base name) and the step it proves.
fn name_and_step(args: &UploadArgs) -> Result<(String, Option<u64>), i32> {
    let name = args
        .name
        .clone()
        .or_else(|| {
            args.staged
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
        })
        .ok_or_else(|| usage("STAGED has no base name: give --name"))?;
    validate_checkpoint_name(&name).map_err(usage)?;
    // The step is what the name proves; a --step that disagrees is a mistake.
    let step = super::owner::checked_step(&name, args.step).map_err(usage)?;
    Ok((name, step))
}

/// STAGED is absolute and there.
fn check_staged(staged: &Path) -> Result<(), i32> {
    if !staged.is_absolute() {
        return Err(usage("STAGED must be an absolute path"));
    }
    // A typo in STAGED is a usage error like any other argument's; what is there and refused
    // (a symlink, a special file) exits 1 when it is captured.
    if std::fs::symlink_metadata(staged).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Err(usage(format!(
            "STAGED {}: no such directory",
            staged.display()
        )));
    }
    Ok(())
}

/// What the destination may be written: anything without `--allow`, else what the list grants.
fn grant(
    args: &UploadArgs,
    location: &Location,
    destination: &Location,
    name: &str,
) -> Result<Granted, i32> {
    if args.allow.is_empty() {
        return Ok(match location {
            Location::Store(_) => Granted::Store,
            Location::Dir(base) => Granted::Dir {
                base: base.clone(),
                below: PathBuf::from(name),
                own: Vec::new(),
            },
        });
    }
    let policy = UploadPolicy {
        allow: args.allow.clone(),
        own_dirs: Vec::new(),
    };
    policy.check(destination, None).map_err(|e| {
        eprintln!("spotguard upload: {e}");
        EXIT_REFUSED
    })
}

/// The staged tree, captured within the limits.
async fn capture(args: &UploadArgs) -> Result<StagedTree, i32> {
    let limits = Limits {
        max_files: args.max_files,
        max_bytes: args.max_bytes,
        ..Limits::default()
    };
    staged::raise_open_file_limit();
    let staged_dir = args.staged.clone();
    match tokio::task::spawn_blocking(move || staged::capture(&Root::host()?, &staged_dir, &limits))
        .await
    {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => {
            eprintln!("spotguard upload: {e}");
            Err(EXIT_REFUSED)
        }
        Err(e) => {
            eprintln!("spotguard upload: {e}");
            Err(EXIT_FAILED)
        }
    }
}

/// The destination opened, every key the upload writes checked.
fn open_target(
    args: &UploadArgs,
    destination: &Location,
    granted: &Granted,
    tree: &StagedTree,
) -> Result<Target, i32> {
    let store_opts = StoreOptions {
        endpoint: args.endpoint.clone(),
        pool: args.concurrency,
        ..StoreOptions::default()
    };
    Target::open(destination, granted, &store_opts)
        .and_then(|t| {
            t.check_keys(
                tree.files.iter().map(|f| f.path.as_str()),
                &super::manifest::manifest_file(args.part),
            )
            .map(|()| t)
        })
        .map_err(|e| {
            eprintln!("spotguard upload: {e}");
            if e.outcome() == Outcome::Refused {
                EXIT_REFUSED
            } else {
                EXIT_FAILED
            }
        })
}

/// `--deadline` and `--timeout` as one instant: the earlier.
fn deadline_of(args: &UploadArgs) -> Option<tokio::time::Instant> {
    let now = jiff::Timestamp::now();
    let from_flag = args.deadline.map(|d| {
        let left = d.duration_since(now).as_secs_f64().max(0.0);
        tokio::time::Instant::now() + Duration::from_secs_f64(left)
    });
    let from_timeout = args.timeout.map(|t| tokio::time::Instant::now() + t);
    match (from_flag, from_timeout) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Run the upload with its progress shown; the exit code of its outcome.
async fn upload(
    args: UploadArgs,
    name: String,
    step: Option<u64>,
    tree: StagedTree,
    target: Target,
    cancel: CancellationToken,
) -> i32 {
    let deadline = deadline_of(&args);
    let mode = args.progress.resolve();
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
        meta: Meta {
            name,
            step,
            part: args.part,
            notice: None,
            origin: Origin {
                staged: args.staged.display().to_string(),
                node: None,
                pod: None,
            },
            acked_at: None,
            // DEST is this command's location; its writer the invoking user.
            writer: Some(super::owner::Writer::host(
                rustix::process::getuid().as_raw(),
            )),
        },
        root: RootRecord::Host { owner: tree.owner },
        tree,
        target,
        options: Options {
            concurrency: args.concurrency,
            memory: args.memory,
            part_size: args.part_size,
            deadline,
            state_dir: args.state_dir.clone(),
            ..Options::default()
        },
        progress,
        metrics: None,
        cancel,
        relayed: Default::default(),
    };
    let report = engine::run(job).await;
    stop_report.cancel();
    let _ = reporter.await;
    print_report(&report, mode);
    if let Some(e) = &report.error {
        eprintln!("spotguard upload: {e}");
    }
    match report.outcome {
        // A relay's peer published it (the CLI does not relay; the outcome is the agent's).
        Outcome::Published | Outcome::AlreadyPublished | Outcome::Relayed => EXIT_OK,
        Outcome::Refused => EXIT_REFUSED,
        Outcome::Failed => EXIT_FAILED,
        Outcome::Deadline | Outcome::Cancelled | Outcome::Interrupted => EXIT_STOPPED,
    }
}

fn print_report(r: &Report, mode: ProgressMode) {
    match mode {
        ProgressMode::None => {}
        ProgressMode::Tty | ProgressMode::Auto => eprintln!(
            "{}: {}: {} files, {} ({} sent, {} resumed) in {:.1}s ({}/s)",
            r.destination,
            r.outcome.as_str(),
            r.files,
            human_bytes(r.bytes),
            human_bytes(r.bytes_sent),
            human_bytes(r.bytes_resumed),
            r.seconds,
            human_bytes(r.rate_bps),
        ),
        ProgressMode::Json => {
            if let Ok(json) = serde_json::to_string(r) {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{json}");
                let _ = out.flush();
            }
        }
    }
}
