//! Benchmark: notice visible in the metadata emulator → checkpoint signal received by a real
//! process, per cloud, through the real host-mode pipeline (`app::start`); and the idle footprint
//! (RSS, CPU) of a `spotguard run` process over a minute.
//!
//! `cargo bench --bench latency` (env: SPOTGUARD_BENCH_TRIALS=50, SPOTGUARD_BENCH_IDLE_SECS=60).
//! The receiving process stamps CLOCK_REALTIME inside its signal handler (clock_gettime is
//! async-signal-safe); "visible" is the instant the emulator started answering with the notice.

use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use tokio_util::sync::CancellationToken;

static RECEIVED_NS: AtomicI64 = AtomicI64::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    RECEIVED_NS.store(ts.tv_sec * 1_000_000_000 + ts.tv_nsec, Ordering::SeqCst);
}

/// Child mode: catch SIGUSR1, write the receive time (ns since the epoch) to `out`, exit.
fn child(out: &Path) -> ! {
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
    std::fs::write(out.with_extension("ready"), b"1").expect("ready file");
    while RECEIVED_NS.load(Ordering::SeqCst) == 0 {
        unsafe { libc::pause() };
    }
    std::fs::write(out, RECEIVED_NS.load(Ordering::SeqCst).to_string()).expect("write");
    std::process::exit(0);
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn run_args(cloud: &str, endpoint: &str, dir: &Path, pidfile: &Path) -> config::RunArgs {
    let argv: Vec<String> = vec![
        "spotguard".into(),
        "run".into(),
        "--mode=host".into(),
        format!("--cloud={cloud}"),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=1s".into(),
        format!("--checkpoint-dir={}", dir.join("ckpt").display()),
        format!("--state-dir={}", dir.join("state").display()),
        format!("--checkpoint-pidfile={}", pidfile.display()),
        "--checkpoint-timeout=5s".into(),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-level=error".into(),
        "--shutdown-grace=1s".into(),
    ];
    match config::parse_cli(argv) {
        config::Parsed::Command(config::Command::Run(r)) => *r,
        config::Parsed::Exit { text, .. } => panic!("{text}"),
        _ => unreachable!(),
    }
}

async fn trial(cloud: Cloud, emu: &emulator::EmulatorHandle) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("received");
    let me = std::env::current_exe().expect("exe");
    let mut target = tokio::process::Command::new(me)
        .arg("--child")
        .arg(&out)
        .kill_on_drop(true)
        .spawn()
        .expect("spawn child");
    let pidfile = dir.path().join("target.pid");
    std::fs::write(&pidfile, target.id().expect("pid").to_string()).expect("pidfile");
    while !out.with_extension("ready").exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cfg = Config::resolve(
        run_args(cloud.as_str(), &emu.base_url(), dir.path(), &pidfile),
        &config::ProcessEnv,
    )
    .expect("config");
    let cancel = CancellationToken::new();
    let app = app::start(cfg, cancel.clone()).await.expect("start");
    // Let the first polls happen, at a random phase relative to the poll clock.
    tokio::time::sleep(Duration::from_millis(1000 + fastrand::u64(0..1000))).await;
    let visible = emu
        .raise(EmulatedNotice::interruption())
        .expect("raise")
        .visible_at;
    let _ = tokio::time::timeout(Duration::from_secs(10), target.wait()).await;
    let received_ns: i128 = std::fs::read_to_string(&out)
        .expect("target did not receive the signal")
        .trim()
        .parse()
        .expect("ns");
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.clear();
    (received_ns - visible.as_nanosecond()) as f64 / 1e9
}

fn proc_rss_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn proc_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // fields after ')' start at field 3 (state); utime = 14, stime = 15 → indexes 11, 12.
    let u: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
    let s: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    u + s
}

async fn idle_footprint(secs: u64) {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = env!("CARGO_BIN_EXE_spotguard");
    let mut agent = tokio::process::Command::new(bin)
        .args([
            "run",
            "--mode=host",
            "--cloud=aws",
            &format!("--metadata-endpoint={}", emu.base_url()),
            "--poll-interval=1s",
            &format!("--checkpoint-dir={}", dir.path().join("ckpt").display()),
            &format!("--state-dir={}", dir.path().join("state").display()),
            "--checkpoint-cmdline=^no-such-trainer$",
            "--metrics-addr=127.0.0.1:0",
            "--gpu=off",
            "--log-format=json",
        ])
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn agent");
    let pid = agent.id().expect("pid");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu0 = proc_cpu_ticks(pid);
    let t0 = std::time::Instant::now();
    let mut rss = Vec::new();
    while t0.elapsed() < Duration::from_secs(secs) {
        rss.push(proc_rss_kib(pid, "VmRSS:"));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let cpu = (proc_cpu_ticks(pid) - cpu0) as f64 / tick;
    let wall = t0.elapsed().as_secs_f64();
    let hwm = proc_rss_kib(pid, "VmHWM:");
    rss.sort_unstable();
    let polls = emu.requests("/latest/meta-data/spot/instance-action");
    println!(
        "idle agent over {wall:.0} s (EC2, 1 s polling, {polls} instance-action polls): RSS median {:.1} MiB, max {:.1} MiB, peak (VmHWM) {:.1} MiB; CPU {:.3} s = {:.3} % of a core",
        rss[rss.len() / 2] as f64 / 1024.0,
        rss[rss.len() - 1] as f64 / 1024.0,
        hwm as f64 / 1024.0,
        cpu,
        100.0 * cpu / wall
    );
    let _ = agent.start_kill();
    let _ = agent.wait().await;
    emu.shutdown().await;
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        child(Path::new(&args[2]));
    }
    // `cargo bench` passes `--bench`; ignore other harness flags.
    let trials: usize = std::env::var("SPOTGUARD_BENCH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let idle_secs: u64 = std::env::var("SPOTGUARD_BENCH_IDLE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        println!("notice visible → SIGUSR1 received, {trials} trials per cloud (EC2 and Azure poll every 1 s; GCE hanging GETs)");
        println!("{:<8} {:>9} {:>9} {:>9} {:>9}", "cloud", "p50", "p90", "p99", "max");
        for cloud in [Cloud::Aws, Cloud::Gce, Cloud::Azure] {
            let emu = emulator::start(EmulatorConfig::new(cloud))
                .await
                .expect("emulator");
            let mut v = Vec::with_capacity(trials);
            for _ in 0..trials {
                v.push(trial(cloud, &emu).await);
            }
            emu.shutdown().await;
            v.sort_by(|a, b| a.total_cmp(b));
            println!(
                "{:<8} {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms",
                cloud.as_str(),
                percentile(&v, 50.0) * 1e3,
                percentile(&v, 90.0) * 1e3,
                percentile(&v, 99.0) * 1e3,
                v.last().copied().unwrap_or(f64::NAN) * 1e3
            );
        }
        if idle_secs > 0 {
            idle_footprint(idle_secs).await;
        }
    });
}
