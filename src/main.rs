//! spotguard binary: parse the command line, then hand over to the library. `anyhow` stays here.

use std::process::ExitCode;

use anyhow::Context;
use spotguard::config::{self, Command, Config, Parsed};
use spotguard::{app, drill, emulator, gpu, prefetch, shutdown, telemetry};

fn main() -> ExitCode {
    // A small agent needs no per-thread malloc arenas (glibc makes up to 8 per core): fewer arenas,
    // less idle RSS.
    // SAFETY: mallopt is called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
    let command = match config::parse_cli(std::env::args_os()) {
        Parsed::Command(c) => c,
        Parsed::Exit { code, text, stderr } => {
            if stderr {
                eprint!("{text}");
            } else {
                print!("{text}");
            }
            return exit(code);
        }
    };
    match command {
        Command::ConfigReference => {
            print!("{}", config::reference_markdown());
            exit(0)
        }
        Command::ExampleTrainer(args) => exit(drill::example_trainer(args)),
        Command::Gpu(args) => exit(gpu::run_cli(args)),
        Command::Run(args) => {
            let cfg = match Config::resolve(*args, &config::ProcessEnv) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("spotguard: {e}");
                    return exit(config::EXIT_USAGE);
                }
            };
            telemetry::init(cfg.log_format, &cfg.args.log_level);
            match runtime().and_then(|rt| rt.block_on(run(cfg))) {
                Ok(()) => exit(0),
                Err(e) => {
                    let msg = format!("{e:#}");
                    tracing::error!(error = %msg, "spotguard stopped");
                    telemetry::write_termination_message(&msg);
                    eprintln!("spotguard: {msg}");
                    exit(1)
                }
            }
        }
        Command::Drill(args) => with_runtime(|cancel| drill::run(args, cancel)),
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
        Command::Prefetch(args) => {
            telemetry::init(config::LogFormat::Text, &one_shot_log_level());
            with_runtime(|cancel| prefetch::run_cli(*args, cancel))
        }
        Command::PrefetchServe(args) => {
            telemetry::init(config::LogFormat::Json, "info");
            with_runtime(|cancel| prefetch::serve::run_serve(*args, cancel))
        }
    }
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown::install().context("installing signal handlers")?;
    let app = app::start(cfg, cancel).await.context("starting")?;
    app.join.await.context("agent task")??;
    Ok(())
}

/// Log filter of the one-shot commands: `SPOTGUARD_LOG_LEVEL`, default `info`.
fn one_shot_log_level() -> String {
    std::env::var("SPOTGUARD_LOG_LEVEL").unwrap_or_else(|_| "info".to_string())
}

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
            eprintln!("spotguard: {e:#}");
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

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
