//! The user-facing face: the `spotguard` command table ([`Cli`], [`Command`]), parsing the process's
//! command line into a [`Parsed`] (a command to run, or text to print and an exit code), and shell
//! completions. Each command's arguments live with the command (`drill::DrillArgs`,
//! `prefetch::PrefetchArgs`, `emulator::EmulateArgs`, …); `run`'s are the agent's settings
//! ([`config::RunArgs`]), completed from the environment and the config file by [`config`].

use std::ffi::OsString;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{self, RunArgs, EXIT_USAGE};

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
    /// One-shot GPU health report (exit 0 healthy, 1 unhealthy, 2 NVML unavailable).
    Gpu(crate::gpu::GpuArgs),
    /// What interruptions cost: goodput and badput by category, from the agent's goodput log.
    Goodput(crate::goodput::report::GoodputArgs),
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
