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
    if let Some(code) = serve_hidden_command() {
        return code;
    }
    // The state and checkpoint dirs are checked at start in a child: a hung mount holds it, not
    // the agent.
    config::check::check_in_child("/proc/self/exe");
    // Checkpoint dirs are paths pods control: their I/O runs in helpers, which the agent can
    // leave stuck in a hung filesystem and still exit. `/proc/self/exe` is this binary even
    // after a package upgrade replaced the file.
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
            with_runtime(|cancel| upload::latest::run_cli(*args, location, cancel))
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
    for s in &cfg.args.settings {
        out.push_str(&format!(
            "{:<28} {:<8} {}\n",
            s.key,
            s.origin.as_str(),
            s.value
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
    let app = app::start(cfg, cancel).await.context("starting")?;
    tokio::spawn(async {
        tokio::time::sleep(START_UP_SETTLED).await;
        let _ = tokio::task::spawn_blocking(release_start_up_memory).await;
    });
    app.join.await.context("agent task")??;
    Ok(())
}

/// Log filter of the one-shot commands: `SPOTGUARD_LOG_LEVEL`, default `info`.
fn one_shot_log_level() -> String {
    std::env::var("SPOTGUARD_LOG_LEVEL").unwrap_or_else(|_| "info".to_string())
}

/// When the start-up's own work (the first polls, the spare checkpoint-dir helper, the pod cache's
/// first list, resumed uploads) is over: then [`release_start_up_memory`] runs, once.
const START_UP_SETTLED: std::time::Duration = std::time::Duration::from_secs(15);

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

/// Once the agent has started and settled ([`START_UP_SETTLED`]): give back the memory only
/// start-up used. The free heap goes back
/// to the kernel (`malloc_trim`), and the agent's own code and read-only data pages are unmapped
/// ([`unmap_own_read_only_pages`]): start-up (argument parsing, configuration, building every
/// task) runs code that idle never runs again, and the kernel maps the file 64 KiB around each
/// page it faults in, so most of the binary stayed mapped and counted in the agent's RSS. The
/// pages stay in the page cache; what idle and a notice run is faulted back in from there.
fn release_start_up_memory() {
    // SAFETY: malloc_trim only hands free heap pages back to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    unmap_own_read_only_pages();
}

/// `madvise(MADV_DONTNEED)` on the executable's loaded segments that are never written (code,
/// read-only data; the segment holding RELRO is writable at load and is left alone): their pages
/// are the file's page-cache pages, so the next access maps the same bytes again.
fn unmap_own_read_only_pages() {
    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        _data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader hands a valid entry; the first one is the executable.
        let info = unsafe { &*info };
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as usize,
            _ => return 1,
        };
        // SAFETY: dlpi_phdr points at dlpi_phnum program headers.
        let headers = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum.into()) };
        for h in headers {
            if h.p_type != libc::PT_LOAD || h.p_flags & libc::PF_W != 0 {
                continue;
            }
            let start = info.dlpi_addr as usize + h.p_vaddr as usize;
            let end = start + h.p_filesz as usize;
            // Whole pages only: a page shared with a writable segment is never touched.
            let (start, end) = (start.div_ceil(page) * page, end / page * page);
            if end > start {
                // SAFETY: a range of this process's own read-only file mapping; dropping its
                // pages loses nothing (they are re-read from the same file on access).
                unsafe {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
                }
            }
        }
        1 // the executable only
    }
    // SAFETY: the callback only reads the entry it is given.
    unsafe {
        libc::dl_iterate_phdr(Some(each), std::ptr::null_mut());
    }
}

fn exit(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::unmap_own_read_only_pages;

    /// Resident KiB of this executable's code mapping (`r-xp`), from `/proc/self/smaps`.
    fn resident_code_kib() -> u64 {
        let exe = std::fs::read_link("/proc/self/exe").expect("exe");
        let exe = exe.to_string_lossy().into_owned();
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut ours = false;
        let mut kib = 0;
        for line in smaps.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields
                .first()
                .is_some_and(|f| f.contains('-') && !f.ends_with(':'))
            {
                ours = fields.get(1) == Some(&"r-xp") && fields.get(5) == Some(&exe.as_str());
            } else if ours && fields.first() == Some(&"Rss:") {
                kib += fields
                    .get(1)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
        kib
    }

    trait Named {
        fn name(&self) -> String;
    }
    struct Agent;
    impl Named for Agent {
        fn name(&self) -> String {
            "agent".to_string()
        }
    }
    /// Relocated pointers (string slices, a vtable): in the RELRO part of the writable segment,
    /// which must not be dropped (its pages hold what the loader wrote, not the file's bytes).
    static WORDS: [&str; 3] = ["notice", "signal", "drain"];
    static AGENT: &(dyn Named + Sync) = &Agent;

    #[test]
    fn unmapping_start_up_pages_drops_code_pages_and_keeps_relocated_data() {
        let before = resident_code_kib();
        assert!(
            before > 0,
            "no resident code mapping found for this executable"
        );
        unmap_own_read_only_pages();
        let after = resident_code_kib();
        assert!(
            after < before,
            "resident code went from {before} KiB to {after} KiB: nothing was unmapped"
        );
        // Code and relocated data still work (a dropped RELRO page would hold unrelocated
        // pointers and crash here).
        assert_eq!(WORDS.join(","), "notice,signal,drain");
        assert_eq!(AGENT.name(), "agent");
    }
}
