//! What the pod filesystem helper (`checkpoint::podfs`) costs: a checkpoint dir opened and an
//! ack read in the agent's own process, side by side with the same through a helper process
//! (`spotguard __pod-fs`, a request and its answer over a pipe each).
//!
//! Reports p50 / p90 / p99 / max per operation: opening a dir (with a helper: taking the spare
//! helper started ahead, and the first request to it), a helper started and ended (what an open
//! costs when no spare is ready), and
//! reading an `ack-<pid>.json` (the watcher's poll, every 50 ms per signalled process).
//!
//! Run: `cargo bench --bench podfs` (env `PODFS_BENCH_READS`, default 2000; `PODFS_BENCH_OPENS`,
//! default 100).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use spotguard::checkpoint::ack::CheckpointDir;
use spotguard::checkpoint::podfs;
use spotguard_testkit::process::percentile;

/// A delivery comes after an idle while: the last dir's helper gone, the spare started.
const IDLE: Duration = Duration::from_millis(100);

fn count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn report(what: &str, samples: Vec<Duration>) {
    let mut us: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    us.sort_by(f64::total_cmp);
    println!(
        "| {what} | {} | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs |",
        us.len(),
        percentile(&us, 50.0),
        percentile(&us, 90.0),
        percentile(&us, 99.0),
        us.last().copied().unwrap_or(f64::NAN),
    );
}

fn run(label: &str, dir: &std::path::Path, opens: usize, reads: usize) -> Result<(), String> {
    let mut open = Vec::with_capacity(opens);
    for _ in 0..opens {
        // A delivery after an idle while finds the spare helper started (the daemon's case).
        podfs::ready_spare();
        std::thread::sleep(IDLE);
        let t = Instant::now();
        let d = CheckpointDir::host(dir).map_err(|e| e.to_string())?;
        // The dir is opened on the first request (as the file thread's first read does).
        d.read_ack(1).map_err(|e| e.to_string())?;
        open.push(t.elapsed());
    }
    let d = CheckpointDir::host(dir).map_err(|e| e.to_string())?;
    let mut read = Vec::with_capacity(reads);
    for _ in 0..reads {
        let t = Instant::now();
        let ack = d.read_ack(1).map_err(|e| e.to_string())?;
        read.push(t.elapsed());
        if ack.is_none() {
            return Err("the ack is gone".into());
        }
    }
    report(&format!("{label}: open + first read"), open);

    report(&format!("{label}: ack read"), read);
    Ok(())
}

fn main() -> ExitCode {
    let reads = count("PODFS_BENCH_READS", 2000);
    let opens = count("PODFS_BENCH_OPENS", 100);
    let tmp = match tempfile::tempdir() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tempdir: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ack = r#"{"state":"done","step":42,"checkpoint":"/ck/42","ts":1}"#;
    if let Err(e) = std::fs::write(tmp.path().join("ack-1.json"), ack) {
        eprintln!("writing the ack: {e}");
        return ExitCode::FAILURE;
    }
    println!("| operation | n | p50 | p90 | p99 | max |\n|---|---|---|---|---|---|");
    if let Err(e) = run("in process", tmp.path(), opens, reads) {
        eprintln!("in process: {e}");
        return ExitCode::FAILURE;
    }
    // From here on every dir is held by a helper (set once, as the daemon does at start).
    podfs::use_helper(env!("CARGO_BIN_EXE_spotguard"));
    if let Err(e) = run("helper", tmp.path(), opens, reads) {
        eprintln!("helper: {e}");
        return ExitCode::FAILURE;
    }
    // Without a spare: a helper started (fork + exec) and ended (end of input).
    let mut started = Vec::with_capacity(opens);
    for _ in 0..opens {
        let t = Instant::now();
        let status = std::process::Command::new(env!("CARGO_BIN_EXE_spotguard"))
            .arg(podfs::HELPER_ARG)
            .stdin(std::process::Stdio::null())
            .status();
        started.push(t.elapsed());
        if !status.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("the helper did not start and end: {status:?}");
            return ExitCode::FAILURE;
        }
    }
    report("helper started and ended (no spare)", started);
    ExitCode::SUCCESS
}
