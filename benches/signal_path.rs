//! Benchmark: the agent's signal path — discovery of the targets, then the pidfd checks and the
//! signal (`checkpoint::run::deliver`) — until a real process's SIGUSR1 handler runs, with 100,
//! 1 000 and 10 000 other processes on the machine (sleepers), in both modes, the O(targets)
//! path against the full scan it replaced, interleaved trial by trial (the order alternates), so
//! that both see the same machine:
//!
//! - host mode: a `--checkpoint-cmdline` target; `warm` re-reads the candidates a background
//!   refresh kept (`HostDiscovery::discover_with`, the refresh itself made before the trial, as
//!   the agent's background task makes it), `full` reads every process (`discover_full`); with
//!   the other processes started 2 s before the trials (recent: a notice soon after a burst of new
//!   processes) and long before them (older than `RECENT`);
//! - Kubernetes mode: the target in a kubelet-shaped container cgroup (systemd driver, Burstable);
//!   `cgroup` reads that container's `cgroup.procs` at its located directory (`find_containers`),
//!   `full` scans every `/proc/*/cgroup` (`ProcIndex::scan`).
//!
//! The notice's detection is not in it (with GCE's hanging GET it is ~0; `benches/latency.rs`
//! measures notice → signal through the whole agent). Reported per condition: signal latency
//! p50/p99 (start of discovery → the handler's CLOCK_REALTIME stamp) and the agent's CPU time per
//! plan (user + system of this process, all threads, from the start of discovery until `deliver`
//! returned); for host mode also the CPU time of one background refresh.
//!
//! `cargo bench --bench signal_path` (as root: cgroups are created; env:
//! SPOTGUARD_BENCH_TRIALS=30, SPOTGUARD_BENCH_SLEEPERS=100,1000,10000).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::cgroup::{cgroup_mounts, find_containers, ContainerCgroups, ProcIndex};
use spotguard::checkpoint::discover::{HostDiscovery, HostFoundBy, HostTargets, WARM_INTERVAL};
use spotguard::checkpoint::run::{deliver, CheckpointRequest};
use spotguard::checkpoint::{PodRef, Signal, TargetGroup, TargetMode};
use spotguard::metrics::Metrics;
use spotguard_testkit::kubelet::{self, Qos};
use spotguard_testkit::process::{percentile, sleepers, usr1_stamp_child, Kid};

fn now_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain clock_gettime into a local.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// User + system CPU time of this process (all threads, live and ended), in ms.
fn cpu_ms() -> f64 {
    // SAFETY: getrusage fills a zeroed local struct.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The trainer: this bench re-run in child mode, `$0`-style token in its arguments.
fn trainer(out: &Path, token: &str) -> Kid {
    let mut cmd = Command::new(std::env::current_exe().expect("exe"));
    cmd.arg("--child").arg(out).arg(token);
    let kid = Kid::spawn(cmd);
    wait_for("the trainer's handler", || {
        out.with_extension("ready").exists()
    });
    kid
}

fn request() -> CheckpointRequest {
    let now = Timestamp::now();
    CheckpointRequest {
        notice_id: format!("bench-{:016x}", fastrand::u64(..)),
        source: "gce".into(),
        kind: "interruption".into(),
        deadline: Some(now + Duration::from_secs(120)),
        checkpoint_deadline: now + Duration::from_secs(60),
        dry_run: false,
    }
}

#[derive(Default)]
struct Samples {
    latency_ms: Vec<f64>,
    cpu_ms: Vec<f64>,
}

impl Samples {
    fn row(&mut self, label: &str) -> (f64, f64) {
        self.latency_ms.sort_by(f64::total_cmp);
        self.cpu_ms.sort_by(f64::total_cmp);
        let (p50, p99) = (
            percentile(&self.latency_ms, 50.0),
            percentile(&self.latency_ms, 99.0),
        );
        let cpu = percentile(&self.cpu_ms, 50.0);
        println!(
            "| {label} | {p50:.2} | {p99:.2} | {cpu:.2} | {:.2} |",
            percentile(&self.cpu_ms, 99.0)
        );
        (p99, cpu)
    }
}

/// One trial: start the trainer, prepare (outside the window), then time discovery + deliver
/// until the handler's stamp.
fn trial(
    dir: &Path,
    token: &str,
    prepare: &mut dyn FnMut(&Kid),
    discover: &mut dyn FnMut() -> Vec<TargetGroup>,
    samples: &mut Samples,
) {
    let out = dir.join(format!("stamp-{}", fastrand::u64(..)));
    let kid = trainer(&out, token);
    prepare(&kid);
    let m = Metrics::register(&mut Registry::default());
    let req = request();
    let cpu0 = cpu_ms();
    let t0 = now_ns();
    let groups = discover();
    let deliveries = deliver(&groups, &req, &m);
    let cpu = cpu_ms() - cpu0;
    assert_eq!(
        deliveries
            .iter()
            .flat_map(|d| d.signalled_pids())
            .collect::<Vec<_>>(),
        vec![kid.pid()],
        "exactly the trainer is signalled"
    );
    // the child creates the file, then writes it: wait for the number
    let read = || -> Option<i64> { std::fs::read_to_string(&out).ok()?.trim().parse().ok() };
    wait_for("the stamp", || read().is_some());
    let stamp = read().unwrap_or_default();
    samples.latency_ms.push((stamp - t0) as f64 / 1e6);
    samples.cpu_ms.push(cpu);
    drop(deliveries);
    drop(kid);
}

fn host_mode(dir: &Path, trials: usize, n: usize, when: &str) -> Vec<(String, f64, f64)> {
    let token = format!("sg-bench-{:016x}", fastrand::u64(..));
    let d = HostDiscovery::new(HostTargets {
        units: Vec::new(),
        pidfiles: Vec::new(),
        cmdlines: vec![regex::Regex::new(&token).expect("regex")],
        cmdline_uids: Vec::new(),
        dir: dir.join("ckpt"),
        signal: Signal::USR1,
        timeout: Duration::from_secs(5),
    });
    let (mut warm, mut full) = (Samples::default(), Samples::default());
    let mut refresh_cpu = Vec::new();
    for i in 0..trials {
        for which in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            if which == 0 {
                let d2 = d.clone();
                trial(
                    dir,
                    &token,
                    &mut |_| {
                        let c0 = cpu_ms();
                        d2.refresh_warm(WARM_INTERVAL).expect("refresh");
                        refresh_cpu.push(cpu_ms() - c0);
                    },
                    &mut || {
                        let (g, how) = d.discover_with().expect("discover");
                        assert_eq!(how, HostFoundBy::Warm);
                        g
                    },
                    &mut warm,
                );
            } else {
                trial(
                    dir,
                    &token,
                    &mut |_| {},
                    &mut || d.discover_full().expect("discover"),
                    &mut full,
                );
            }
        }
    }
    let (wp99, wcpu) = warm.row(&format!("host, {n} others started {when}, warm (new)"));
    let (fp99, fcpu) = full.row(&format!("host, {n} others started {when}, full scan (old)"));
    refresh_cpu.sort_by(f64::total_cmp);
    println!(
        "|   background refresh, per run (every ≥ {} s) | | | {:.2} | {:.2} |",
        WARM_INTERVAL.as_secs(),
        percentile(&refresh_cpu, 50.0),
        percentile(&refresh_cpu, 99.0)
    );
    vec![
        (format!("host {n} started {when} new"), wp99, wcpu),
        (format!("host {n} started {when} old"), fp99, fcpu),
    ]
}

fn kube_mode(dir: &Path, trials: usize, n: usize) -> Vec<(String, f64, f64)> {
    let mounts = cgroup_mounts();
    let tag = format!("sg-bench-{:016x}", fastrand::u64(..));
    let base = kubelet::cgroup_root().join(&tag);
    let uid = kubelet::pod_uid();
    let (mut new, mut old) = (Samples::default(), Samples::default());
    let proc_root = PathBuf::from("/proc");
    let mut made = Vec::new();
    for i in 0..trials {
        for which in if i % 2 == 0 { [0, 1] } else { [1, 0] } {
            // a container of its own per trial, as a restarted container gets a new id
            let id = kubelet::container_id();
            let cg = kubelet::pod_cgroup(&base, Qos::Burstable, &uid, &id);
            std::fs::create_dir_all(&cg).expect("create cgroup");
            made.push(cg.clone());
            let group = |containers| TargetGroup {
                name: "ml/trainer-0".into(),
                pod: Some(PodRef {
                    namespace: "ml".into(),
                    name: "trainer-0".into(),
                    uid: uid.clone(),
                }),
                containers,
                mode: TargetMode::Handlers,
                signal: Signal::USR1,
                dir: dir.join("ckpt"),
                timeout: Duration::from_secs(5),
                proc_root: proc_root.clone(),
            };
            let wanted = vec![(uid.clone(), id.clone())];
            let located = std::cell::RefCell::new(ContainerCgroups::default());
            let mut prepare = |kid: &Kid| {
                std::fs::write(cg.join("cgroup.procs"), kid.pid().to_string()).expect("join");
                // what the agent's background task has done by the notice
                *located.borrow_mut() = ContainerCgroups::locate(&mounts);
            };
            if which == 0 {
                trial(
                    dir,
                    "kube",
                    &mut prepare,
                    &mut || {
                        let (index, _, _) =
                            find_containers(&proc_root, &mounts, &located.borrow(), &wanted)
                                .expect("find");
                        vec![group(index.container(&uid, &id).into_iter().collect())]
                    },
                    &mut new,
                );
            } else {
                trial(
                    dir,
                    "kube",
                    &mut prepare,
                    &mut || {
                        let index = ProcIndex::scan(&proc_root).expect("scan");
                        vec![group(index.container(&uid, &id).into_iter().collect())]
                    },
                    &mut old,
                );
            }
        }
    }
    for cg in made.iter().rev() {
        let mut p = cg.as_path();
        while p != base.parent().unwrap_or(Path::new("/")) {
            let _ = std::fs::remove_dir(p);
            p = p.parent().unwrap_or(Path::new("/"));
        }
    }
    let (np99, ncpu) = new.row(&format!("kubernetes, {n} others, container cgroup (new)"));
    let (op99, ocpu) = old.row(&format!("kubernetes, {n} others, full scan (old)"));
    vec![
        (format!("kubernetes {n} new"), np99, ncpu),
        (format!("kubernetes {n} old"), op99, ocpu),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        usr1_stamp_child(Path::new(&args[2]));
    }
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let trials: usize = std::env::var("SPOTGUARD_BENCH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let counts: Vec<usize> = std::env::var("SPOTGUARD_BENCH_SLEEPERS")
        .unwrap_or_else(|_| "100,1000,10000".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let pid_max: usize = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(32768);
    let dir = tempfile::tempdir().expect("tempdir");
    println!("signal path: discovery → SIGUSR1 handler ran; {trials} trials per row, old and new interleaved\n");
    println!("| condition | p50 ms | p99 ms | CPU/plan p50 ms | CPU/plan p99 ms |");
    println!("|---|---|---|---|---|");
    let mut summary = Vec::new();
    for n in counts {
        let running = std::fs::read_dir("/proc").map(|d| d.count()).unwrap_or(0);
        assert!(
            running + n + 1000 < pid_max,
            "{n} sleepers do not fit under pid_max {pid_max}"
        );
        let others = sleepers(n, &dir.path().join(format!("sleepers-{n}")));
        let started = std::time::Instant::now();
        // a burst of processes just before the notices (the notice of an agent started beside
        // them, 2–7 s later): recent, but settled (forks that never exec'd, past SETTLE_AGE)
        std::thread::sleep(Duration::from_secs(2));
        summary.extend(host_mode(dir.path(), trials, n, "2 s before"));
        // ... and long before: not recent any more
        let old = spotguard::checkpoint::discover::RECENT + Duration::from_secs(1);
        std::thread::sleep(old.saturating_sub(started.elapsed()));
        summary.extend(host_mode(dir.path(), trials, n, "long before"));
        summary.extend(kube_mode(dir.path(), trials, n));
        drop(others);
    }
    println!("\nratios old/new (p99 latency, median CPU):");
    for pair in summary.chunks(2) {
        if let [(name, np99, ncpu), (_, op99, ocpu)] = pair {
            println!(
                "  {}: p99 ×{:.1}, CPU ×{:.1}",
                name.trim_end_matches(" new"),
                op99 / np99,
                ocpu / ncpu
            );
        }
    }
}
