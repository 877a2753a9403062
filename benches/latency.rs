//! Benchmark: notice visible in the metadata emulator → checkpoint signal received by a real
//! process, per cloud, through the real host-mode pipeline (`app::start`); the same in
//! Kubernetes mode (GCE hanging GET, `app::start_with_client` against the real API server of
//! testkit's control plane as the shipped ServiceAccount, the receiving process an opted-in pod
//! run by the kubelet stand-in in a kubelet-shaped cgroup) with the fault proxy in front of the
//! API server adding 0 ms, 100 ms, 1 s, or never answering (accepts, never answers) from just
//! before the notice on — plus notice → node cordoned with nothing added; and the idle footprint
//! (RSS, CPU) of a `spotguard run` process over a minute in host mode and in Kubernetes mode with
//! 110 pods on the node (the kubelet's default maximum); and host mode (GCE) on a busy node: N
//! other processes (perl-forked sleepers) started just before the notice — after the agent, or
//! before it — or long before it (older than `checkpoint::discover::RECENT`), a fresh agent per
//! trial.
//!
//! `cargo bench --bench latency` (env: SPOTGUARD_BENCH_TRIALS=50, SPOTGUARD_BENCH_IDLE_SECS=60,
//! SPOTGUARD_BENCH_MODE=all|host|kubernetes|busy, SPOTGUARD_BENCH_SLOW_TRIALS: trials for the 1 s
//! and never-answering API conditions, default SPOTGUARD_BENCH_TRIALS; for the busy node,
//! SPOTGUARD_BENCH_SLEEPERS=1000,10000 and SPOTGUARD_BENCH_BUSY_TRIALS=10 per condition). `busy`
//! runs only the busy-node conditions; `host` and `all` include them. A Kubernetes trial whose
//! process is not signalled within SIGNAL_WAIT is counted as "never" and shown as such; the
//! percentiles then include it as +∞.
//! The receiving process stamps CLOCK_REALTIME inside its signal handler (clock_gettime is
//! async-signal-safe); "visible" is the instant the emulator started answering with the notice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::k8s::{Fault, RequestKind, TestCluster, TestPod};
use spotguard_testkit::process::{percentile, sleepers, usr1_stamp_child, Sleepers};
use tokio_util::sync::CancellationToken;

/// How long a Kubernetes trial waits for the signal before counting it as never delivered.
const SIGNAL_WAIT: Duration = Duration::from_secs(10);

fn run_args(cloud: &str, endpoint: &str, dir: &Path, pidfile: &Path) -> config::RunArgs {
    let argv: Vec<String> = vec![
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
    spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"))
}

/// When a busy-node trial's other processes start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Burst {
    /// None started for the trial (the plain per-cloud trials, or long before them).
    No,
    /// After the agent started (its first refresh saw none of them), 1–2 s before the notice.
    AfterAgent(usize),
    /// Just before the agent started, 1–2 s before the notice.
    BeforeAgent(usize),
}

/// `n` sleepers, started and awaited off the runtime's threads (the agent runs on them).
async fn start_sleepers(n: usize, dir: &Path) -> Sleepers {
    let ready = dir.join(format!("sleepers-{n}-{:016x}", fastrand::u64(..)));
    tokio::task::spawn_blocking(move || sleepers(n, &ready))
        .await
        .expect("sleepers")
}

/// Notice visible → signal received, through a fresh agent, in seconds.
async fn trial(cloud: Cloud, emu: &emulator::EmulatorHandle, burst: Burst) -> f64 {
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
    let mut others = None;
    if let Burst::BeforeAgent(n) = burst {
        others = Some(start_sleepers(n, dir.path()).await);
    }
    let cancel = CancellationToken::new();
    let app = app::start(cfg, cancel.clone()).await.expect("start");
    if let Burst::AfterAgent(n) = burst {
        others = Some(start_sleepers(n, dir.path()).await);
    }
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
    if let Some(others) = others {
        tokio::task::spawn_blocking(move || drop(others))
            .await
            .expect("sleepers gone");
    }
    (received_ns - visible.as_nanosecond()) as f64 / 1e9
}

/// `p50 p99 max` of `v` (seconds), in ms.
fn row(v: &mut [f64]) -> String {
    v.sort_by(|a, b| a.total_cmp(b));
    format!(
        "{:>8.1}ms {:>8.1}ms {:>8.1}ms",
        percentile(v, 50.0) * 1e3,
        percentile(v, 99.0) * 1e3,
        v.last().copied().unwrap_or(f64::NAN) * 1e3
    )
}

/// The load averages (`/proc/loadavg`'s first three fields).
fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Host mode (GCE hanging GET) on a busy node: for each count of other processes, `trials`
/// trials with them started after the agent, before it, and long before the notice.
async fn busy_node(trials: usize, counts: &[usize]) {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
        .await
        .expect("emulator");
    let dir = tempfile::tempdir().expect("tempdir");
    println!(
        "host mode, GCE hanging GET, N other processes: notice visible → SIGUSR1 received, {trials} trials per row, a fresh agent each"
    );
    println!(
        "{:<6} {:<44} {:>10} {:>10} {:>10}   load before → after",
        "N", "others started", "p50", "p99", "max"
    );
    for &n in counts {
        for (label, burst) in [
            (
                "after the agent, 1–2 s before the notice",
                Burst::AfterAgent(n),
            ),
            (
                "before the agent, 1–2 s before the notice",
                Burst::BeforeAgent(n),
            ),
        ] {
            let before = load();
            let mut v = Vec::with_capacity(trials);
            for _ in 0..trials {
                v.push(trial(Cloud::Gce, &emu, burst).await);
            }
            println!("{n:<6} {label:<44} {}   {before} → {}", row(&mut v), load());
        }
        let before = load();
        let others = start_sleepers(n, dir.path()).await;
        // older than every window in which discovery treats a process as new
        tokio::time::sleep(spotguard::checkpoint::discover::RECENT + Duration::from_secs(2)).await;
        let mut v = Vec::with_capacity(trials);
        for _ in 0..trials {
            v.push(trial(Cloud::Gce, &emu, Burst::No).await);
        }
        tokio::task::spawn_blocking(move || drop(others))
            .await
            .expect("sleepers gone");
        println!(
            "{n:<6} {:<44} {}   {before} → {}",
            "long before (> RECENT)",
            row(&mut v),
            load()
        );
    }
    emu.shutdown().await;
}

/// How the API server answers from just before the notice on (the pod cache synced before).
#[derive(Clone, Copy)]
enum ApiCondition {
    Answers(Duration),
    Never,
}

impl ApiCondition {
    fn label(self) -> String {
        match self {
            ApiCondition::Answers(d) => format!("{} ms", d.as_millis()),
            ApiCondition::Never => "never".into(),
        }
    }
}

/// One Kubernetes-mode trial on a fresh node of its own: (notice visible → signal received,
/// notice visible → node cordoned as seen by polling the API server every 2 ms); `None` = not
/// within [`SIGNAL_WAIT`].
async fn kube_trial(
    emu: &emulator::EmulatorHandle,
    condition: ApiCondition,
    measure_cordon: bool,
) -> (Option<f64>, Option<f64>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("received");
    std::fs::create_dir_all(dir.path().join("ckpt")).expect("ckpt dir");
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("gpu-node-1")).await;
    let ml = k.namespace("ml").await;
    let web = k.namespace("web").await;
    let me = std::env::current_exe().expect("exe");
    let me = me.display().to_string();
    let out_arg = out.display().to_string();
    let mut pods = vec![TestPod::new(&ml, "trainer-0", node.name())
        .annotation("spotguard.io/checkpoint", "true")
        .annotation(
            "spotguard.io/checkpoint-dir",
            &dir.path().join("ckpt").display().to_string(),
        )
        .annotation("spotguard.io/checkpoint-timeout", "3s")
        .command(&[&me, "--child", &out_arg])
        .build()];
    for i in 0..5 {
        pods.push(TestPod::new(&web, &format!("web-{i}"), node.name()).build());
    }
    k.run_pods(&pods).await;
    while !out.with_extension("ready").exists() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let argv: Vec<String> = vec![
        "--mode=kubernetes".into(),
        format!("--node-name={}", node.name()),
        format!("--cloud={}", emu.cloud().as_str()),
        format!("--metadata-endpoint={}", emu.base_url()),
        format!("--state-dir={}", dir.path().join("state").display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-level=error".into(),
        "--shutdown-grace=0s".into(),
    ];
    let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
    let cfg = Config::resolve(args, &config::ProcessEnv).expect("config");
    let cancel = CancellationToken::new();
    let app = app::start_with_client(cfg, cancel.clone(), Some(k.agent_client()))
        .await
        .expect("start");
    // The pod cache syncs and the GCE hanging GET is parked, at a random phase.
    tokio::time::sleep(Duration::from_millis(1000 + fastrand::u64(0..500))).await;
    match condition {
        ApiCondition::Answers(d) if d.is_zero() => {}
        ApiCondition::Answers(d) => k.proxy().set_fault(None, Some(Fault::Delay(d))),
        ApiCondition::Never => k.proxy().set_fault(None, Some(Fault::Blackhole)),
    }
    let visible = emu
        .raise(EmulatedNotice::interruption())
        .expect("raise")
        .visible_at;
    let mut cordoned_at = None;
    if measure_cordon {
        let start = std::time::Instant::now();
        while start.elapsed() < SIGNAL_WAIT {
            let unschedulable = k
                .node_object(node.name())
                .await
                .spec
                .and_then(|s| s.unschedulable)
                .unwrap_or(false);
            if unschedulable {
                cordoned_at = Some(jiff::Timestamp::now());
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    let start = std::time::Instant::now();
    while !out.exists() && start.elapsed() < SIGNAL_WAIT {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let received = std::fs::read_to_string(&out)
        .ok()
        .and_then(|s| s.trim().parse::<i128>().ok())
        .map(|ns| (ns - visible.as_nanosecond()) as f64 / 1e9);
    let cordon = cordoned_at.map(|t| t.duration_since(visible).as_secs_f64());
    cancel.cancel();
    k.proxy().clear_faults();
    let _ = tokio::time::timeout(Duration::from_secs(3), app.join).await;
    emu.clear();
    drop(node);
    (received, cordon)
}

/// `p50 p90 p99 max` of trials where `None` (never) sorts last as +∞.
fn summary(v: &[Option<f64>]) -> String {
    let mut s: Vec<f64> = v.iter().map(|x| x.unwrap_or(f64::INFINITY)).collect();
    s.sort_by(|a, b| a.total_cmp(b));
    let f = |x: f64| {
        if x.is_finite() {
            format!("{:.1}ms", x * 1e3)
        } else {
            "never".to_string()
        }
    };
    let never = v.iter().filter(|x| x.is_none()).count();
    format!(
        "{:>10} {:>10} {:>10} {:>10}   n={} never={never}",
        f(percentile(&s, 50.0)),
        f(percentile(&s, 90.0)),
        f(percentile(&s, 99.0)),
        f(s.last().copied().unwrap_or(f64::NAN)),
        v.len()
    )
}

async fn kube_latency(trials: usize, slow_trials: usize) {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
        .await
        .expect("emulator");
    println!(
        "Kubernetes mode, GCE hanging GET: notice visible → SIGUSR1 received, by delay the fault proxy adds to every API request (never = not within {} s)",
        SIGNAL_WAIT.as_secs()
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10}",
        "API", "p50", "p90", "p99", "max"
    );
    let mut cordon = Vec::new();
    for condition in [
        ApiCondition::Answers(Duration::ZERO),
        ApiCondition::Answers(Duration::from_millis(100)),
        ApiCondition::Answers(Duration::from_secs(1)),
        ApiCondition::Never,
    ] {
        let n = match condition {
            ApiCondition::Answers(d) if d < Duration::from_secs(1) => trials,
            _ => slow_trials,
        };
        let zero = matches!(condition, ApiCondition::Answers(d) if d.is_zero());
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let (signal, cordoned) = kube_trial(&emu, condition, zero).await;
            v.push(signal);
            if zero {
                cordon.push(cordoned);
            }
        }
        println!("{:<10} {}", condition.label(), summary(&v));
    }
    println!("notice visible → node cordoned (API answering in 0 ms):");
    println!("{:<10} {}", "0 ms", summary(&cordon));
    emu.shutdown().await;
}

fn proc_rss_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Resident KiB of `pid` by what is mapped (`/proc/PID/smaps`): the executable's own pages (its
/// code and read-only data, plus its relocated data once written), the shared libraries' (libc,
/// libm, the loader, libgcc_s) and the rest (heap, stacks, other anonymous memory).
fn proc_rss_by_mapping(pid: u32) -> (u64, u64, u64) {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let (mut own, mut libs, mut rest) = (0, 0, 0);
    let mut path = String::new();
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: address range, perms, offset, dev, inode, then the path.
            path = f.nth(4).unwrap_or("").to_string();
        } else if first == "Rss:" {
            let kib: u64 = f.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            if std::path::Path::new(&path) == exe {
                own += kib;
            } else if path.starts_with('/') {
                libs += kib;
            } else {
                rest += kib;
            }
        }
    }
    (own, libs, rest)
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

async fn idle_footprint(secs: u64, kube_pods: Option<usize>) {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let dir = tempfile::tempdir().expect("tempdir");
    let bin = env!("CARGO_BIN_EXE_spotguard");
    let mut args: Vec<String> = vec![
        "run".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=1s".into(),
        format!("--state-dir={}", dir.path().join("state").display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-format=json".into(),
    ];
    let mut cmd = tokio::process::Command::new(bin);
    let api = match kube_pods {
        None => {
            args.push("--mode=host".into());
            args.push(format!(
                "--checkpoint-dir={}",
                dir.path().join("ckpt").display()
            ));
            args.push("--checkpoint-cmdline=^no-such-trainer$".into());
            None
        }
        Some(n) => {
            let k = TestCluster::new().await;
            let node = k.node(k.node_config("gpu-node-1")).await;
            let ml = k.namespace("ml").await;
            let pods: Vec<_> = (0..n)
                .map(|i| {
                    let pod =
                        TestPod::new(&ml, &format!("pod-{i}"), node.name()).label("app", "trainer");
                    if i % 2 == 0 {
                        pod.annotation("spotguard.io/checkpoint", "true")
                            .annotation("spotguard.io/checkpoint-dir", "/ckpt")
                            .build()
                    } else {
                        pod.build()
                    }
                })
                .collect();
            k.run_pods(&pods).await;
            let kubeconfig: PathBuf = dir.path().join("kubeconfig");
            std::fs::write(&kubeconfig, k.agent_kubeconfig()).expect("kubeconfig");
            cmd.env("KUBECONFIG", &kubeconfig);
            args.push("--mode=kubernetes".into());
            args.push(format!("--node-name={}", node.name()));
            Some((k, node))
        }
    };
    let mut agent = cmd
        .args(&args)
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
    // What of it is the agent's own (anonymous) and what the binary's shared file pages; and
    // the spare checkpoint-dir helper (`__pod-fs`), a process of its own in the same cgroup.
    let (anon, file) = (proc_rss_kib(pid, "RssAnon:"), proc_rss_kib(pid, "RssFile:"));
    let (own, libs, rest) = proc_rss_by_mapping(pid);
    let helpers: Vec<u32> = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect();
    let helper_rss: u64 = helpers.iter().map(|&h| proc_rss_kib(h, "VmRSS:")).sum();
    let helper_anon: u64 = helpers.iter().map(|&h| proc_rss_kib(h, "RssAnon:")).sum();
    rss.sort_unstable();
    let polls = emu.requests("/latest/meta-data/spot/instance-action");
    let mode = match kube_pods {
        None => "host mode".to_string(),
        Some(n) => format!(
            "Kubernetes mode, {n} pods on the node, {} pod watches",
            api.as_ref()
                .map(|(k, _)| k
                    .proxy()
                    .requests()
                    .iter()
                    .filter(|r| r.kind == RequestKind::PodWatch)
                    .count())
                .unwrap_or(0)
        ),
    };
    println!(
        "idle agent, {mode}, over {wall:.0} s (EC2, 1 s polling, {polls} instance-action polls): RSS median {:.1} MiB, max {:.1} MiB, peak (VmHWM) {:.1} MiB; CPU {:.3} s = {:.3} % of a core",
        rss[rss.len() / 2] as f64 / 1024.0,
        rss[rss.len() - 1] as f64 / 1024.0,
        hwm as f64 / 1024.0,
        cpu,
        100.0 * cpu / wall
    );
    println!(
        "  at the end: RssAnon {:.1} MiB, RssFile {:.1} MiB (the binary's pages, shared); {} helper process(es): RSS {:.1} MiB, RssAnon {:.1} MiB",
        anon as f64 / 1024.0,
        file as f64 / 1024.0,
        helpers.len(),
        helper_rss as f64 / 1024.0,
        helper_anon as f64 / 1024.0
    );
    println!(
        "  by mapping: the spotguard executable {:.1} MiB (code, read-only data, relocated data), shared libraries {:.1} MiB (libc, libm, ld.so, libgcc_s), heap/stacks/other {:.1} MiB",
        own as f64 / 1024.0,
        libs as f64 / 1024.0,
        rest as f64 / 1024.0
    );
    let _ = agent.start_kill();
    let _ = agent.wait().await;
    emu.shutdown().await;
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        usr1_stamp_child(Path::new(&args[2]));
    }
    // `cargo bench` passes `--bench`; ignore other harness flags.
    let trials: usize = std::env::var("SPOTGUARD_BENCH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let slow_trials: usize = std::env::var("SPOTGUARD_BENCH_SLOW_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(trials);
    let mode = std::env::var("SPOTGUARD_BENCH_MODE").unwrap_or_else(|_| "all".into());
    let busy = mode != "kubernetes";
    let (host, kube) = (
        mode != "kubernetes" && mode != "busy",
        mode != "host" && mode != "busy",
    );
    let busy_trials: usize = std::env::var("SPOTGUARD_BENCH_BUSY_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let counts: Vec<usize> = std::env::var("SPOTGUARD_BENCH_SLEEPERS")
        .unwrap_or_else(|_| "1000,10000".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
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
        if busy {
            busy_node(busy_trials, &counts).await;
        }
        if kube {
            kube_latency(trials, slow_trials).await;
        }
        if !host {
            if idle_secs > 0 && kube {
                idle_footprint(idle_secs, None).await;
                idle_footprint(idle_secs, Some(110)).await;
            }
            return;
        }
        println!("notice visible → SIGUSR1 received, {trials} trials per cloud (EC2 and Azure poll every 1 s; GCE hanging GETs)");
        println!("{:<8} {:>9} {:>9} {:>9} {:>9}", "cloud", "p50", "p90", "p99", "max");
        for cloud in [Cloud::Aws, Cloud::Gce, Cloud::Azure] {
            let emu = emulator::start(EmulatorConfig::new(cloud))
                .await
                .expect("emulator");
            let mut v = Vec::with_capacity(trials);
            for _ in 0..trials {
                v.push(trial(cloud, &emu, Burst::No).await);
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
            idle_footprint(idle_secs, None).await;
            if kube {
                idle_footprint(idle_secs, Some(110)).await;
            }
        }
    });
}
