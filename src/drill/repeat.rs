//! `--repeat`: the loop both drills share — N runs, each one's verdict table, the "N of M
//! passed" summary, the `--json` document, the `--junit` report and the exit code.

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::{report, DrillArgs, EXIT_ERROR, EXIT_FAIL, EXIT_PASS};

/// A run's verdict as the loop renders it: `report::Verdict`, `elastic::report::ElasticVerdict`.
pub trait RunVerdict {
    /// The run passed.
    fn passed(&self) -> bool;
    /// Why it passed or failed.
    fn reason(&self) -> &str;
    /// The verdict table (`timeout`: `--timeout`).
    fn table(&self, timeout: Duration) -> String;
    /// The run as JSON (`--json`).
    fn to_json(&self, timeout: Duration) -> Value;
    /// The name of its JUnit test case as the `n`-th run (1-based).
    fn junit_name(&self, n: usize) -> String;
}

/// One run: its verdict, its table and how long it took.
pub type Run<V> = (V, String, Duration);

/// Run `once` `--repeat` times (fewer when cancelled), printing each verdict table (not under
/// `--json`), then the summary, the JSON document and the JUnit report; returns the exit code.
/// A run that could not run ends the drill with [`EXIT_ERROR`].
pub async fn run<V, F, Fut>(args: &DrillArgs, cancel: &CancellationToken, mut once: F) -> i32
where
    V: RunVerdict,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<V, String>>,
{
    let mut runs: Vec<Run<V>> = Vec::new();
    let mut code = EXIT_PASS;
    for i in 0..args.repeat {
        if args.repeat > 1 && !args.json {
            println!("spotguard drill: run {} of {}", i + 1, args.repeat);
        }
        let began = Instant::now();
        let v = match once().await {
            Ok(v) => v,
            Err(e) => {
                eprintln!("spotguard drill: {e}");
                return EXIT_ERROR;
            }
        };
        let text = v.table(args.timeout);
        if !args.json {
            println!("{text}");
        }
        if !v.passed() {
            code = EXIT_FAIL;
        }
        runs.push((v, text, began.elapsed()));
        if cancel.is_cancelled() {
            break;
        }
    }
    if args.repeat > 1 && !args.json {
        let passed = runs.iter().filter(|(v, _, _)| v.passed()).count();
        println!("spotguard drill: {passed} of {} runs passed", runs.len());
    }
    if args.json {
        let doc = serde_json::json!({
            "pass": code == EXIT_PASS,
            "runs": runs.iter().map(|(v, _, _)| v.to_json(args.timeout)).collect::<Vec<_>>(),
        });
        println!("{doc:#}");
    }
    if let Some(path) = &args.junit {
        if let Err(e) = std::fs::write(path, report::junit(&runs)) {
            eprintln!("spotguard drill: writing {}: {e}", path.display());
            return EXIT_ERROR;
        }
    }
    code
}
