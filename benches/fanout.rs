//! Signal fan-out (goal: 64 processes in ≤ 20 ms): 64 real processes that catch SIGUSR1, then
//! `deliver()` — handler check, pidfd, start-time re-check, notice.json (temp + fsync + rename),
//! `pidfd_send_signal` — timed over many runs, for one group of 64 processes (one launcher's
//! workers) and for 64 groups of one process (64 pods, one notice each).
//!
//! Run: `cargo bench --bench fanout` (as root or as the owner of the children; needs `sh`).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::checkpoint::procfs::ProcFs;
use spotguard::checkpoint::run::{deliver, CheckpointRequest, Delivery};
use spotguard::checkpoint::{Signal, TargetContainer, TargetGroup, TargetMode, TargetProcess};
use spotguard::metrics::Metrics;

const PROCESSES: usize = 64;
const WARMUP: usize = 3;
const RUNS: usize = 40;

/// Catches SIGUSR1 and counts; waits in `wait` without using CPU.
const WORKER: &str = "n=0; trap 'n=$((n+1))' USR1; sleep 100000 & S=$!; while :; do wait $S; done";

struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        if let (Ok(None), Some(pg)) = (
            self.0.try_wait(),
            rustix::process::Pid::from_raw(self.0.id() as i32),
        ) {
            let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
        }
        let _ = self.0.wait();
    }
}

fn group(name: &str, dir: &Path, processes: Vec<TargetProcess>) -> TargetGroup {
    TargetGroup {
        name: name.to_string(),
        pod: None,
        containers: vec![TargetContainer {
            name: name.to_string(),
            root_pid: None,
            init_pid: None,
            processes,
        }],
        mode: TargetMode::Handlers,
        signal: Signal::USR1,
        dir: dir.to_path_buf(),
        timeout: Duration::from_secs(90),
        proc_root: "/proc".into(),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Time `deliver()` over the runs; also the span from the first to the last signal of each run.
/// With `dry_run` nothing is written or signalled: the cost of checking and pinning the targets.
fn measure(
    label: &str,
    groups: &[TargetGroup],
    metrics: &Metrics,
    dry_run: bool,
) -> Result<(), String> {
    let mut totals = Vec::with_capacity(RUNS);
    let mut spans = Vec::with_capacity(RUNS);
    for run in 0..WARMUP + RUNS {
        let now = Timestamp::now();
        let req = CheckpointRequest {
            notice_id: format!("bench-{run}"),
            source: "aws".into(),
            kind: "interruption".into(),
            deadline: Some(now + Duration::from_secs(120)),
            checkpoint_deadline: now + Duration::from_secs(95),
            dry_run,
        };
        let start = Instant::now();
        let deliveries = deliver(groups, &req, metrics);
        let took = start.elapsed();
        let sent: usize = if dry_run {
            deliveries
                .iter()
                .flat_map(|d| d.containers.iter().map(|c| c.would_signal.len()))
                .sum()
        } else {
            deliveries.iter().map(Delivery::signalled).sum()
        };
        if sent != PROCESSES {
            return Err(format!(
                "{label}: run {run} signalled {sent} of {PROCESSES}"
            ));
        }
        let times: Vec<Timestamp> = deliveries
            .iter()
            .flat_map(|d| {
                d.containers
                    .iter()
                    .flat_map(|c| c.signalled.iter().map(|p| p.signalled_at))
            })
            .collect();
        let span = match (times.iter().min(), times.iter().max()) {
            (Some(a), Some(b)) => Duration::try_from(b.duration_since(*a)).unwrap_or_default(),
            _ => Duration::ZERO,
        };
        if run >= WARMUP {
            totals.push(took);
            spans.push(span);
        }
        if !dry_run {
            // let the shells run their traps before the next round
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    totals.sort();
    spans.sort();
    if dry_run {
        println!(
            "{label}: check only (dry-run) median {:.2} ms, p99 {:.2} ms (n={RUNS})",
            ms(percentile(&totals, 0.5)),
            ms(percentile(&totals, 0.99)),
        );
        return Ok(());
    }
    println!(
        "{label}: deliver() median {:.2} ms, p99 {:.2} ms, min {:.2} ms (n={RUNS}); first→last signal median {:.2} ms, p99 {:.2} ms",
        ms(percentile(&totals, 0.5)),
        ms(percentile(&totals, 0.99)),
        ms(totals[0]),
        ms(percentile(&spans, 0.5)),
        ms(percentile(&spans, 0.99)),
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("fanout bench failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let proc = ProcFs::default();
    let mut kids = Vec::with_capacity(PROCESSES);
    for _ in 0..PROCESSES {
        let child = Command::new("sh")
            .args(["-c", WORKER])
            .stdin(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("spawning sh: {e}"))?;
        kids.push(Kid(child));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut targets = Vec::with_capacity(PROCESSES);
    for kid in &kids {
        let pid = kid.0.id() as i32;
        loop {
            if proc.status(pid).is_ok_and(|s| s.catches(Signal::USR1)) {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("process {pid} never installed its handler"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let start_time = proc.start_time(pid).map_err(|e| e.to_string())?;
        targets.push(TargetProcess { pid, start_time });
    }
    let metrics = Metrics::register(&mut Registry::default());

    let one = [group("launcher", &tmp.path().join("one"), targets.clone())];
    measure("64 processes, 1 group ", &one, &metrics, true)?;
    measure("64 processes, 1 group ", &one, &metrics, false)?;

    let pods: Vec<TargetGroup> = targets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            group(
                &format!("pod-{i}"),
                &tmp.path().join(format!("pod-{i}")),
                vec![t.clone()],
            )
        })
        .collect();
    measure("64 processes, 64 groups", &pods, &metrics, true)?;
    measure("64 processes, 64 groups", &pods, &metrics, false)?;
    Ok(())
}
