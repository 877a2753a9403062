//! The user-facing face: the `spotguard` command table ([`Cli`], [`Command`]), parsing the process's
//! command line into a [`Parsed`] (a command to run, or text to print and an exit code), and shell
//! completions. Each command's arguments live with the command (`drill::DrillArgs`,
//! `prefetch::PrefetchArgs`, `emulator::EmulateArgs`, …); `run`'s are the agent's settings
//! ([`config::RunArgs`]), completed from the environment and the config file by [`config`].

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::{self, RunArgs, EXIT_USAGE};
use crate::prefetch::cli::{EXIT_CANCELLED, EXIT_FAILED, EXIT_OK};
use crate::store::StoreOptions;
use crate::upload::latest::{self, Error as LatestError};
use crate::upload::Location;

/// `--version`: the crate version and the git commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SPOTGUARD_GIT_COMMIT"),
    ")"
);

/// Command line of the `spotguard` binary.
#[derive(Debug, Parser)]
#[command(
    name = "spotguard",
    version = VERSION,
    about = "Node agent for GPU training on spot / preemptible capacity: interruption notice → checkpoint hand-shake → drain"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (DaemonSet or systemd unit).
    Run(Box<RunArgs>),
    /// Rehearse a preemption against a training command on this machine (no cloud needed).
    Drill(Box<crate::drill::DrillArgs>),
    /// Serve an emulated instance-metadata service (EC2, GCE or Azure) for your own tests.
    Emulate(crate::emulator::EmulateArgs),
    /// Prefetch a dataset (s3://, gs://, file:///) into the shared cache, or wait for one.
    Prefetch(Box<crate::prefetch::PrefetchArgs>),
    /// The prefetcher as its own process: configured datasets and pods' annotations.
    PrefetchServe(Box<crate::prefetch::serve::ServeArgs>),
    /// Upload a checkpoint saved to local disk to s3://, gs:// or a directory, manifest last.
    Upload(Box<crate::upload::cli::UploadArgs>),
    /// The relay between agents: this node's certificate fingerprint (docs/relay.md).
    Relay(crate::relay::RelayArgs),
    /// One-shot GPU health report (exit 0 healthy, 1 unhealthy, 2 NVML unavailable).
    Gpu(crate::gpu::GpuArgs),
    /// What interruptions cost: goodput and badput by category, from a Job's, JobSet's or pod
    /// owner's goodput Events, or from the agent's goodput log on a host.
    Goodput(Box<crate::goodput::report::GoodputArgs>),
    /// Check a configuration without starting the agent.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the configuration reference (Markdown) generated from these definitions.
    #[command(hide = true)]
    ConfigReference,
    /// The bundled example trainer used by `spotguard drill` when no command is given.
    #[command(hide = true)]
    ExampleTrainer(crate::drill::ExampleTrainerArgs),
}

/// `spotguard config …`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate `run`'s flags, environment and config file as `run` would, print the effective
    /// settings and where each came from, and exit (0 valid, 64 invalid). Starts nothing.
    Check(Box<RunArgs>),
}

/// Result of parsing the command line: either a command to run, or text to print and an exit code
/// (help, version, usage errors).
pub enum Parsed {
    Command(Command),
    Exit {
        code: i32,
        text: String,
        stderr: bool,
    },
}

/// Parse the process's command line (with env and config file) into a [`Command`].
pub fn parse_cli<I, T>(argv: I) -> Parsed
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let mut cmd = config::empty_env_is_unset(Cli::command());
    let matches = match cmd.try_get_matches_from_mut(&argv) {
        Ok(m) => m,
        Err(e) => {
            return match config::env_value_error(&e, &cmd, &argv) {
                Some(text) => Parsed::Exit {
                    code: EXIT_USAGE,
                    text,
                    stderr: true,
                },
                None => clap_exit(e),
            }
        }
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => return clap_exit(e.format(&mut Cli::command())),
    };
    cmd.build();
    let run_args = |path: &[&str]| -> Result<RunArgs, config::Error> {
        let (sub, matches) = subcommand(&cmd, &matches, path)
            .ok_or_else(|| config::Error::Cli("internal: no run arguments".into()))?;
        config::merge_config_file(sub, matches, args_after(&argv, path)?)
    };
    let parsed = match cli.command {
        Command::Run(_) => run_args(&["run"]).map(|run| Command::Run(Box::new(run))),
        Command::Config(ConfigCommand::Check(_)) => run_args(&["config", "check"])
            .map(|run| Command::Config(ConfigCommand::Check(Box::new(run)))),
        other => Ok(other),
    };
    match parsed {
        Ok(command) => Parsed::Command(command),
        Err(e) => Parsed::Exit {
            code: EXIT_USAGE,
            text: format!("spotguard: {e}\n"),
            stderr: true,
        },
    }
}

/// The (sub)command at `path` and its matches.
fn subcommand<'a>(
    cmd: &'a clap::Command,
    matches: &'a clap::ArgMatches,
    path: &[&str],
) -> Option<(&'a clap::Command, &'a clap::ArgMatches)> {
    path.iter()
        .try_fold((cmd, matches), |(cmd, matches), word| {
            Some((
                cmd.find_subcommand(word)?,
                matches.subcommand_matches(word)?,
            ))
        })
}

/// The arguments given to the subcommand at `path`: `[bin, path…, args…]` → `args…`.
fn args_after<'a>(argv: &'a [OsString], path: &[&str]) -> Result<&'a [OsString], config::Error> {
    let mut pos = 0;
    for word in path {
        pos += argv[pos + 1..]
            .iter()
            .position(|a| a == *word)
            .ok_or_else(|| {
                config::Error::Cli(format!("internal: `{word}` not found in arguments"))
            })?
            + 1;
    }
    Ok(&argv[pos + 1..])
}

/// Help and version exit 0 on stdout; everything else is a usage error (64, stderr).
fn clap_exit(e: clap::Error) -> Parsed {
    use clap::error::ErrorKind;
    let text = e.render().to_string();
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => Parsed::Exit {
            code: if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                EXIT_USAGE
            } else {
                0
            },
            text,
            stderr: e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand,
        },
        _ => Parsed::Exit {
            code: EXIT_USAGE,
            text,
            stderr: true,
        },
    }
}

/// `spotguard completions SHELL`: the completion script of every command and flag.
pub fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "spotguard", &mut out);
    out
}

// `spotguard prefetch --latest-checkpoint`: the one place where the resume side of uploads
// (`upload::latest`) and the prefetcher meet.

/// What `--latest-checkpoint` prints.
#[derive(Serialize)]
struct Printed<'a> {
    /// The checkpoint's directory (URL or path).
    checkpoint: String,
    name: &'a str,
    step: Option<u64>,
    files: usize,
    bytes: u64,
    completed_at: &'a str,
    /// Where it was fetched to (with DEST).
    local: Option<PathBuf>,
    manifest: &'a crate::upload::manifest::Manifest,
}

/// `spotguard prefetch --latest-checkpoint LOCATION [DEST]`: print the latest complete
/// checkpoint as one JSON line (`null` when there is none), and with DEST fetch it into
/// `DEST/<name>`. No checkpoint yet is not an error (exit 0: a first run has nothing to resume).
/// A fetched file that does not match the manifest exits 2 naming it; `--timeout` or SIGTERM in
/// any phase exits 3; nothing is printed then.
pub async fn latest_checkpoint(
    args: crate::prefetch::PrefetchArgs,
    location: String,
    cancel: CancellationToken,
) -> i32 {
    let dest = match (&args.src, &args.dest) {
        (None, None) => None,
        (Some(one), None) => Some(PathBuf::from(one)),
        _ => {
            eprintln!("spotguard prefetch: --latest-checkpoint takes at most one directory: DEST");
            return EXIT_USAGE;
        }
    };
    let loc = match Location::parse(&location) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("spotguard prefetch: {e}");
            return EXIT_USAGE;
        }
    };
    let run = cancel.child_token();
    let timed_out = crate::prefetch::cli::cancel_after(&run, args.timeout);
    let code = match resume(args, dest, &loc, &run).await {
        Ok(printed) => {
            println!("{printed}");
            EXIT_OK
        }
        Err(_) if run.is_cancelled() => {
            if timed_out.load(Ordering::Relaxed) {
                eprintln!("spotguard prefetch: --timeout reached; nothing was reported complete");
            } else {
                eprintln!("spotguard prefetch: interrupted; nothing was reported complete");
            }
            EXIT_CANCELLED
        }
        Err(Failed::Code(code)) => code,
        Err(Failed::Error(e)) => {
            eprintln!("spotguard prefetch: {e}");
            EXIT_FAILED
        }
    };
    run.cancel();
    code
}

/// Why `resume` printed nothing.
enum Failed {
    /// The fetch's exit code (it said why).
    Code(i32),
    Error(LatestError),
}

impl From<LatestError> for Failed {
    fn from(e: LatestError) -> Failed {
        Failed::Error(e)
    }
}

/// Find the latest, fetch and verify it with DEST; the line to print.
async fn resume(
    args: crate::prefetch::PrefetchArgs,
    dest: Option<PathBuf>,
    loc: &Location,
    stop: &CancellationToken,
) -> Result<String, Failed> {
    let opts = StoreOptions {
        endpoint: args.endpoint.clone(),
        pool: args.concurrency,
        ..StoreOptions::default()
    };
    let Some(found) = latest::until(stop, latest::latest(loc, &opts)).await? else {
        eprintln!("spotguard prefetch: no complete checkpoint under {loc}; nothing to fetch");
        return Ok("null".to_string());
    };
    let m = &found.manifest;
    let mut local = None;
    if let Some(dest) = dest {
        let mut fetch = args.clone();
        fetch.latest_checkpoint = None;
        fetch.timeout = None;
        fetch.src = Some(match &found.destination {
            Location::Dir(p) => format!("file://{}", p.display()),
            Location::Store(u) => u.normalized(),
        });
        fetch.dest = Some(dest.clone());
        fetch.name = Some(m.name.clone());
        let only: HashSet<String> = m.files.iter().map(|f| f.path.clone()).collect();
        let code = Box::pin(crate::prefetch::cli::run_only(
            fetch,
            Arc::new(only),
            stop.clone(),
        ))
        .await;
        if stop.is_cancelled() {
            return Err(LatestError::Stopped.into());
        }
        if code != EXIT_OK {
            return Err(Failed::Code(code));
        }
        let dir = dest.join(&m.name);
        if let Err(e) = latest::verify_local(&dir, m, stop).await {
            // Nothing may take the copy for complete: the prefetcher's marker goes, and a file
            // that is not the manifest's is removed (a later run fetches it again).
            let _ = std::fs::remove_file(
                crate::prefetch::cache::DatasetPaths::new(&dest, &m.name).complete,
            );
            if let LatestError::Content { path, .. } = &e {
                let _ = std::fs::remove_file(path);
            }
            return Err(e.into());
        }
        crate::fsutil::write_atomic(
            &dir.join(crate::upload::manifest::manifest_file(None)),
            &m.to_bytes(),
            0o644,
        )
        .map_err(|e| {
            LatestError::Upload(crate::upload::Error::io("write", dir.display().to_string())(e))
        })?;
        local = Some(dir);
    }
    let printed = Printed {
        checkpoint: found.destination.display(),
        name: &m.name,
        step: m.step,
        files: m.file_count,
        bytes: m.bytes,
        completed_at: &m.timings.completed_at,
        local,
        manifest: m,
    };
    Ok(serde_json::to_string(&printed).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `spotguard run ARGS…`: the run arguments, or `code: text` of what the binary would print.
    fn run_args(args: &[&str]) -> Result<RunArgs, String> {
        let mut argv = vec!["spotguard", "run"];
        argv.extend_from_slice(args);
        match parse_cli(argv) {
            Parsed::Command(Command::Run(r)) => Ok(*r),
            Parsed::Command(_) => Err("other command".into()),
            Parsed::Exit { code, text, .. } => Err(format!("{code}: {text}")),
        }
    }

    #[test]
    fn bad_values_exit_64_naming_the_flag() {
        for (args, needle) in [
            (vec!["--poll-interval", "soon"], "--poll-interval"),
            (vec!["--poll-interval", "0s"], "--poll-interval"),
            (
                vec!["--checkpoint-signal", "SIGKILL"],
                "--checkpoint-signal",
            ),
            (vec!["--on-rebalance", "panic"], "--on-rebalance"),
            (vec!["--metrics-addr", "nowhere"], "--metrics-addr"),
            (
                vec!["--checkpoint-cmdline", "(unclosed"],
                "--checkpoint-cmdline",
            ),
            (vec!["--checkpoint-dir", "relative/dir"], "--checkpoint-dir"),
            (vec!["--cache-max-bytes", "lots"], "--cache-max-bytes"),
            (vec!["--prefetch", "noequals"], "--prefetch"),
            (vec!["--dry-run=maybe"], "--dry-run"),
        ] {
            let e = run_args(&args).unwrap_err();
            assert!(e.starts_with("64:"), "{args:?} → {e}");
            assert!(e.contains(needle), "{args:?} → {e}");
        }
    }

    /// `spotguard ARGS…` parsed as the binary would, or `code: text` of what it would print.
    fn command(args: &[&str]) -> Result<Command, String> {
        let mut argv = vec!["spotguard"];
        argv.extend_from_slice(args);
        match parse_cli(argv) {
            Parsed::Command(c) => Ok(c),
            Parsed::Exit { code, text, .. } => Err(format!("{code}: {text}")),
        }
    }

    /// The cache limit of `run` (host mode), `prefetch-serve` (the DaemonSet's prefetch
    /// container) and `prefetch`, the upload limit of `run` and `upload`: one setting, one value.
    fn byte_settings(value: &str) -> [Result<u64, String>; 5] {
        let run = |flag: &str| {
            run_args(&[flag, value]).map(|r| match flag {
                "--cache-max-bytes" => r.cache_max_bytes.unwrap_or(0),
                _ => r.upload_max_bytes,
            })
        };
        let serve = command(&["prefetch-serve", "--cache-max-bytes", value]).map(|c| match c {
            Command::PrefetchServe(a) => a.cache_max_bytes.unwrap_or(0),
            _ => unreachable!(),
        });
        let prefetch =
            command(&["prefetch", "s3://b/p", "/d", "--cache-max-bytes", value]).map(|c| match c {
                Command::Prefetch(a) => a.cache_max_bytes.unwrap_or(0),
                _ => unreachable!(),
            });
        let upload =
            command(&["upload", "/s", "s3://b/p", "--max-bytes", value]).map(|c| match c {
                Command::Upload(a) => a.max_bytes,
                _ => unreachable!(),
            });
        [
            run("--cache-max-bytes"),
            serve,
            prefetch,
            run("--upload-max-bytes"),
            upload,
        ]
    }

    #[test]
    fn a_size_reads_the_same_in_host_mode_and_in_the_prefetch_container() {
        for (value, bytes) in [
            ("500G", 500_000_000_000u64),
            ("500GB", 500_000_000_000),
            ("500GiB", 536_870_912_000),
            ("64k", 64_000),
            ("1.5T", 1_500_000_000_000),
            ("2Ti", 2 << 40),
            ("4096", 4096),
        ] {
            let [cache_run, cache_serve, cache_prefetch, upload_run, upload_cli] =
                byte_settings(value);
            assert_eq!(cache_run, Ok(bytes), "run --cache-max-bytes {value}");
            assert_eq!(
                cache_serve,
                Ok(bytes),
                "prefetch-serve --cache-max-bytes {value}"
            );
            assert_eq!(
                cache_prefetch,
                Ok(bytes),
                "prefetch --cache-max-bytes {value}"
            );
            assert_eq!(upload_run, Ok(bytes), "run --upload-max-bytes {value}");
            assert_eq!(upload_cli, Ok(bytes), "upload --max-bytes {value}");
        }
        // A limit of nothing is refused by every command that takes one.
        for (i, r) in byte_settings("0").into_iter().enumerate() {
            let e = r.expect_err("a 0-byte limit accepted");
            assert!(
                e.starts_with("64:") || e.starts_with("2:"),
                "setting {i}: {e}"
            );
        }
    }

    #[test]
    fn config_file_errors_name_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "poll-interval = \"fast\"\n").unwrap();
        let e = run_args(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(e.starts_with("64:") && e.contains("poll-interval"), "{e}");
        std::fs::write(&path, "no-such-key = 1\n").unwrap();
        let e = run_args(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(
            e.contains("no-such-key") && e.contains("unknown key"),
            "{e}"
        );
        std::fs::write(&path, "this is not toml").unwrap();
        let e = run_args(&["--config", path.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("config file"), "{e}");
    }
}
