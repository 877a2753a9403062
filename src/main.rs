//! spotguard binary: parse the command line, then hand over to the library. `anyhow` stays here.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use spotguard::checkpoint::podfs;
use spotguard::cli::{self, Command, ConfigCommand, Parsed};
use spotguard::config::{self, Config};
use spotguard::{app, drill, emulator, gpu, prefetch, shutdown, telemetry, upload};

fn main() -> ExitCode {
    limit_malloc_arenas();
    // Best effort: a binary without the table (static, another loader) keeps its pages.
    let _ = spotguard::loader_pages::release();
    if let Some(code) = serve_hidden_command() {
        return code;
    }
    // Checkpoint dirs are paths pods control: their I/O runs in helpers, which the agent can
    // leave stuck in a hung filesystem and still exit; the state and checkpoint dirs are checked
    // at start in such a child too. `/proc/self/exe` is this binary even after a package upgrade
    // replaced the file.
    podfs::use_helper("/proc/self/exe");
    match parse_command() {
        Ok(command) => run_command(command),
        Err(code) => code,
    }
}

/// The binary started as one of the agent's own helpers, not a user command: a helper holding a
/// checkpoint dir (`spotguard::checkpoint::podfs`), or a directory check of `Config::resolve`
/// (`config::check::writable_dir_bounded`). `None` for everything else.
fn serve_hidden_command() -> Option<ExitCode> {
    let mut args = std::env::args_os();
    let first = args.nth(1)?;
    if first == podfs::HELPER_ARG {
        return Some(exit(podfs::serve()));
    }
    if first == config::check::CHECK_DIR_ARG {
        let dir = args
            .next()
            .map(std::path::PathBuf::from)
            .unwrap_or_default();
        return Some(exit(config::check::serve_check_dir(&dir)));
    }
    None
}

/// The user's command, or the exit code of `--help`, `--version` or a usage error (its text
/// already written).
fn parse_command() -> Result<Command, ExitCode> {
    match cli::parse_cli(std::env::args_os()) {
        Parsed::Command(c) => Ok(c),
        Parsed::Exit { code, text, stderr } => {
            // A closed pipe (`spotguard --help | head -1`) is not an error worth a panic.
            if stderr {
                let _ = std::io::stderr().write_all(text.as_bytes());
            } else {
                let _ = std::io::stdout().write_all(text.as_bytes());
            }
            Err(exit(code))
        }
    }
}

fn run_command(command: Command) -> ExitCode {
    match command {
        Command::ConfigReference => {
            let _ = std::io::stdout().write_all(config::reference_markdown().as_bytes());
            exit(0)
        }
        Command::Completions { shell } => {
            let _ = std::io::stdout().write_all(&cli::completions(shell));
            exit(0)
        }
        Command::Config(ConfigCommand::Check(args)) => exit(config_check(*args)),
        Command::ExampleTrainer(args) => exit(drill::example_trainer(args)),
        Command::Gpu(args) => exit(gpu::run_cli(args)),
        Command::Relay(args) => exit(spotguard::relay::run_cli(args)),
        Command::Goodput(args) => exit(spotguard::goodput::report::run_cli(*args)),
        Command::Run(args) => run_agent(*args),
        Command::Drill(args) => with_runtime(|cancel| drill::run(*args, cancel)),
        Command::Emulate(args) => {
            telemetry::init(config::LogFormat::Text, &one_shot_log_level());
            with_runtime(|cancel| async move {
                match emulator::run_cli(args, cancel).await {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("spotguard emulate: {e}");
                        1
                    }
                }
            })
        }
        Command::Prefetch(args) if args.latest_checkpoint.is_some() => {
            telemetry::init(config::LogFormat::Text, &one_shot_log_level());
            let location = args.latest_checkpoint.clone().unwrap_or_default();
            with_runtime(|cancel| cli::latest_checkpoint(*args, location, cancel))
        }
        Command::Prefetch(args) => {
            telemetry::init(config::LogFormat::Text, &one_shot_log_level());
            with_runtime(|cancel| prefetch::run_cli(*args, cancel))
        }
        Command::Upload(args) => {
            telemetry::init(config::LogFormat::Text, &one_shot_log_level());
            with_runtime(|cancel| upload::cli::run_cli(*args, cancel))
        }
        Command::PrefetchServe(args) => {
            telemetry::init(config::LogFormat::Json, "info");
            with_runtime(|cancel| prefetch::serve::run_serve(*args, cancel))
        }
    }
}

/// `spotguard run`: resolve the configuration (exit 64 when invalid), start logging, run the
/// agent until it is told to stop. 0 on a clean stop, 1 when it stopped on an error.
fn run_agent(args: config::RunArgs) -> ExitCode {
    let cfg = match Config::resolve(args, &config::ProcessEnv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("spotguard: {e}");
            return exit(config::EXIT_USAGE);
        }
    };
    telemetry::init(cfg.log_format, &cfg.args.log_level);
    tracing::info!(
        version = cli::VERSION,
        settings = %config::settings_line(&cfg.args.settings),
        "effective configuration"
    );
    let result = runtime().and_then(|rt| {
        let result = rt.block_on(run(cfg));
        // Never wait on a blocking-pool thread stuck in a filesystem call (a hung
        // checkpoint dir or state dir) at exit: the agent's own work is done.
        rt.shutdown_timeout(EXIT_GRACE);
        result
    });
    match result {
        Ok(()) => exit(0),
        Err(e) => {
            // Once, through the log (which goes to stderr in either format).
            // The chain once: an error that shows its cause in its own text is not
            // followed by that cause again.
            let msg = spotguard::words::chain(&*e);
            tracing::error!(error = %msg, "spotguard stopped");
            telemetry::write_termination_message(&msg);
            exit(1)
        }
    }
}

/// `spotguard config check`: everything `run` validates before starting, then the effective
/// settings. 0 when valid, 64 when not.
fn config_check(args: config::RunArgs) -> i32 {
    let cfg = match Config::resolve(args, &config::ProcessEnv) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "spotguard: {e}");
            return config::EXIT_USAGE;
        }
    };
    if let Some(url) = &cfg.args.webhook_url {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = std::sync::Arc::new(spotguard::metrics::Metrics::register(&mut registry));
        let opts = spotguard::webhook::Options {
            preset: cfg.args.webhook_preset,
            template: cfg.args.webhook_template.clone(),
            outcome_template: cfg.args.webhook_outcome_template.clone(),
            ..Default::default()
        };
        if let Err(e) = spotguard::webhook::Webhook::with_options(url.clone(), opts, metrics) {
            let _ = writeln!(std::io::stderr(), "spotguard: webhook-url: {e}");
            return config::EXIT_USAGE;
        }
    }
    let mut out = String::new();
    // Each value as the agent read it (durations in seconds, sizes in bytes), and as given when
    // that differs.
    for s in &cfg.args.settings {
        let given = if s.read == s.value {
            String::new()
        } else {
            format!(" (given: {})", s.value)
        };
        out.push_str(&format!(
            "{:<28} {:<8} {}{given}\n",
            s.key,
            s.origin.as_str(),
            s.read
        ));
    }
    out.push_str(&format!(
        "configuration OK (mode {}, log format {})\n",
        cfg.mode.as_str(),
        match cfg.log_format {
            config::LogFormat::Json => "json",
            config::LogFormat::Text => "text",
        }
    ));
    let _ = std::io::stdout().write_all(out.as_bytes());
    0
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown::install().context("installing signal handlers")?;
    shutdown::ignore_hangup().context("installing signal handlers")?;
    let app = app::start(cfg, cancel).await.context("starting")?;
    app.join.await.context("agent task")??;
    Ok(())
}

/// Log filter of the one-shot commands: `SPOTGUARD_LOG_LEVEL`, default `info`.
fn one_shot_log_level() -> String {
    std::env::var("SPOTGUARD_LOG_LEVEL").unwrap_or_else(|_| "info".to_string())
}

/// How long the runtime waits at exit for blocking-pool threads still running (never for one
/// stuck in a hung filesystem).
const EXIT_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
        .context("building the async runtime")
}

fn with_runtime<F, Fut>(f: F) -> ExitCode
where
    F: FnOnce(tokio_util::sync::CancellationToken) -> Fut,
    Fut: std::future::Future<Output = i32>,
{
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "spotguard: {e:#}");
            return exit(1);
        }
    };
    let code = rt.block_on(async {
        let cancel = match shutdown::install() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("spotguard: installing signal handlers: {e}");
                return 1;
            }
        };
        f(cancel).await
    });
    exit(code)
}

/// A small agent needs no per-thread malloc arenas (glibc makes up to 8 per core): fewer arenas,
/// less idle RSS.
fn limit_malloc_arenas() {
    // SAFETY: mallopt is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
