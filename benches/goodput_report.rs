//! What `spotguard goodput` costs over a full host log: the goodput log and its rotated
//! predecessor at their cap (2 × `MAX_LOG_BYTES`, 4 MiB each), filled the way a flood of
//! recoveries filled it (each line a distinct notice: nothing merges), with one interruption
//! line in ten. Reports the CPU time (user + system, this process) of reading the logs, joining
//! and summing them and rendering the table, and fails past [`LIMIT_CPU_S`].
//!
//! Run: `cargo bench --bench goodput_report` (env `GOODPUT_BENCH_ROUNDS`, default 3).

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use jiff::Timestamp;
use spotguard::goodput::event::{LogLine, Recovery};
use spotguard::goodput::record::{Interruption, TargetBadput};
use spotguard::goodput::report::{self, LOG_FILE, MAX_LOG_BYTES};

/// The most CPU one report of a full host log may take (seconds).
const LIMIT_CPU_S: f64 = 1.0;

fn cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn line(n: u64) -> LogLine {
    let t0 = Timestamp::from_second(1_790_000_000 + n as i64).unwrap();
    if n % 10 == 0 {
        return LogLine::Interruption(Interruption {
            notice_id: format!("aws-i-0123456789abcdef0-{n}"),
            node: "gpu-7".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            seen_at: Some(t0),
            signalled_at: Some(t0),
            done_at: t0 + Duration::from_secs(20),
            targets: vec![TargetBadput {
                target: "cmdline:sgtrain-x".into(),
                outcome: "acked".into(),
                step: Some(n),
                save_seconds: Some(12.5),
                downtime_seconds: Some(12.5),
                wasted_steps: Some(0),
                wasted_seconds: Some(0.0),
                ..TargetBadput::default()
            }],
            ..Interruption::default()
        });
    }
    LogLine::Recovery {
        recovery: Recovery {
            notice_id: format!("forged-{n}"),
            from_node: Some("gpu-7".into()),
            node: "gpu-7".into(),
            target: "cmdline:sgtrain-x".into(),
            step: 120,
            saved_at: t0,
            first_step_at: t0 + Duration::from_secs(30),
            recovery_seconds: 30.0,
            restore_seconds: Some(2.5),
        },
    }
}

/// Fill `path` with lines from `n` on until it holds `MAX_LOG_BYTES`; the next `n`.
fn fill(path: &std::path::Path, mut n: u64) -> u64 {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut written = 0u64;
    while written < MAX_LOG_BYTES {
        let mut text = serde_json::to_vec(&line(n)).unwrap();
        text.push(b'\n');
        f.write_all(&text).unwrap();
        written += text.len() as u64;
        n += 1;
    }
    f.flush().unwrap();
    n
}

fn main() -> ExitCode {
    let rounds: usize = std::env::var("GOODPUT_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(LOG_FILE);
    let next = fill(&dir.path().join(format!("{LOG_FILE}.1")), 0);
    let lines = fill(&path, next);
    let mut worst = Duration::ZERO;
    for round in 0..rounds {
        let before = cpu();
        let logged = report::load_all(&path).unwrap();
        let r = report::compute(logged, None, None, Timestamp::now());
        let text = report::table(&r);
        let spent = cpu() - before;
        worst = worst.max(spent);
        println!(
            "round {round}: {lines} lines ({} interruptions, {} recoveries, {} rows): {:.3} s CPU, {} bytes of table",
            r.totals.interruptions,
            r.totals.recoveries,
            r.interruptions.len(),
            spent.as_secs_f64(),
            text.len()
        );
    }
    if worst.as_secs_f64() > LIMIT_CPU_S {
        eprintln!(
            "a full host log took {:.3} s of CPU, more than {LIMIT_CPU_S} s",
            worst.as_secs_f64()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
