//! `spotguard goodput`: the goodput log (`<state-dir>/goodput.jsonl`, one
//! [`Interruption`] a line, appended by the agent as each plan ends) read back as a report:
//! per interruption and in total, paid time, productive time, each badput category, goodput %,
//! the steps lost. `--json` for machines.
//!
//! Paid time is the report's window (`--since` → `--until`; by default the first interruption's
//! detection → now) times the targets seen in it: each target holds its accelerators for the
//! whole window. Productive = paid − badput; goodput % = productive / paid.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use jiff::Timestamp;
use serde::Serialize;

use super::record::{category, Interruption};
use super::Error;

/// The log's file name in the state dir.
pub const LOG_FILE: &str = "goodput.jsonl";
/// A log past this size is rotated to `goodput.jsonl.1` (the previous one dropped) before the
/// next line: the log never grows without bound.
pub const MAX_LOG_BYTES: u64 = 4 << 20;
/// Lines longer than this are not the agent's (skipped, counted).
const MAX_LINE_BYTES: usize = 256 << 10;

/// `spotguard goodput` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct GoodputArgs {
    /// The agent's state dir (its `--state-dir`), where it keeps goodput.jsonl.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/spotguard")]
    pub state_dir: PathBuf,
    /// Start of the window (RFC 3339); default: the first interruption's detection.
    #[arg(long, value_name = "TIME")]
    pub since: Option<Timestamp>,
    /// End of the window (RFC 3339); default: now.
    #[arg(long, value_name = "TIME")]
    pub until: Option<Timestamp>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Append `i` to the log at `path` (rotating it past [`MAX_LOG_BYTES`]). Blocking: run it off
/// the async workers.
pub fn append<T: Serialize + ?Sized>(path: &Path, i: &T) -> Result<(), Error> {
    let err = |source| Error::Log {
        path: path.display().to_string(),
        source,
    };
    if std::fs::metadata(path).is_ok_and(|m| m.len() > MAX_LOG_BYTES) {
        let mut old = path.as_os_str().to_owned();
        old.push(".1");
        std::fs::rename(path, old).map_err(err)?;
    }
    let mut line = serde_json::to_vec(i).map_err(|e| err(e.into()))?;
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(err)?;
    f.write_all(&line).map_err(err)
}

/// Every interruption of the log at `path` (and its rotated predecessor), oldest first, and the
/// number of lines that were not the agent's.
pub fn load(path: &Path) -> Result<(Vec<Interruption>, usize), Error> {
    let mut out = Vec::new();
    let mut bad = 0;
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    for (p, required) in [(PathBuf::from(old), false), (path.to_path_buf(), true)] {
        let f = match std::fs::File::open(&p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => continue,
            Err(source) => {
                return Err(Error::Log {
                    path: p.display().to_string(),
                    source,
                })
            }
        };
        for line in std::io::BufReader::new(f).split(b'\n') {
            let line = line.map_err(|source| Error::Log {
                path: p.display().to_string(),
                source,
            })?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match (line.len() <= MAX_LINE_BYTES)
                .then(|| serde_json::from_slice::<Interruption>(&line).ok())
                .flatten()
            {
                Some(i) => out.push(i),
                None => bad += 1,
            }
        }
    }
    out.sort_by_key(|i| i.done_at);
    Ok((out, bad))
}

/// Totals over a window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Totals {
    pub since: Timestamp,
    pub until: Timestamp,
    pub targets: usize,
    pub paid_seconds: f64,
    pub productive_seconds: f64,
    /// (category, seconds), every category.
    pub badput_seconds: Vec<(String, f64)>,
    pub goodput_percent: f64,
    pub steps_lost: u64,
    pub interruptions: usize,
}

/// The report: the interruptions in the window and the totals.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub interruptions: Vec<Interruption>,
    pub totals: Totals,
}

/// The report over `[since, until]` (defaults: the first interruption's detection, `now`).
pub fn compute(
    all: Vec<Interruption>,
    since: Option<Timestamp>,
    until: Option<Timestamp>,
    now: Timestamp,
) -> Report {
    let until = until.unwrap_or(now);
    let first = all.iter().map(|i| i.seen_at.unwrap_or(i.done_at)).min();
    let since = since.or(first).unwrap_or(until);
    let interruptions: Vec<Interruption> = all
        .into_iter()
        .filter(|i| i.done_at >= since && i.done_at <= until)
        .collect();
    let mut names: Vec<&str> = interruptions
        .iter()
        .flat_map(|i| i.targets.iter().map(|t| t.target.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    let targets = names.len().max(1);
    let window = until.duration_since(since).as_secs_f64().max(0.0);
    let paid = window * targets as f64;
    let mut badput: Vec<(String, f64)> = [category::CHECKPOINT_SAVE, category::WASTED_PROGRESS]
        .iter()
        .map(|c| (c.to_string(), 0.0))
        .collect();
    for i in &interruptions {
        for (c, s) in i.badput() {
            if let Some(slot) = badput.iter_mut().find(|(k, _)| k == c) {
                slot.1 += s;
            }
        }
    }
    let lost: f64 = badput.iter().map(|(_, s)| s).sum();
    let productive = (paid - lost).max(0.0);
    Report {
        totals: Totals {
            since,
            until,
            targets,
            paid_seconds: paid,
            productive_seconds: productive,
            badput_seconds: badput,
            goodput_percent: if paid > 0.0 {
                100.0 * productive / paid
            } else {
                100.0
            },
            steps_lost: interruptions.iter().map(Interruption::steps_lost).sum(),
            interruptions: interruptions.len(),
        },
        interruptions,
    }
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())
}

/// The table a person reads.
pub fn table(r: &Report) -> String {
    let mut s = String::new();
    s.push_str(
        "WHEN                      NODE                TARGET                OUTCOME   DETECT_S  SAVE_S  DOWN_S  UPLOAD_S  WASTED_S  STEPS_LOST  DRAIN_MARGIN_S\n",
    );
    for i in &r.interruptions {
        let when = i
            .seen_at
            .unwrap_or(i.done_at)
            .round(jiff::Unit::Second)
            .unwrap_or(i.done_at);
        for t in &i.targets {
            s.push_str(&format!(
                "{:<25} {:<19} {:<21} {:<9} {:>8}  {:>6}  {:>6}  {:>8}  {:>8}  {:>10}  {:>14}\n",
                when.to_string(),
                i.node,
                t.target,
                t.outcome,
                opt(i.detection_seconds()),
                opt(t.save_seconds),
                opt(t.downtime_seconds),
                opt(t.upload_seconds),
                opt(t.wasted_seconds),
                t.wasted_steps
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "-".into()),
                opt(i.drain_margin_seconds()),
            ));
        }
    }
    let t = &r.totals;
    s.push_str(&format!(
        "\nwindow {} → {} ({} interruption(s), {} target(s))\npaid        {:>12.1} s\nproductive  {:>12.1} s\n",
        t.since, t.until, t.interruptions, t.targets, t.paid_seconds, t.productive_seconds
    ));
    for (c, v) in &t.badput_seconds {
        s.push_str(&format!("badput {:<16} {:>8.1} s\n", c, v));
    }
    s.push_str(&format!(
        "goodput     {:>12.2} %\nsteps lost  {:>12}\n",
        t.goodput_percent, t.steps_lost
    ));
    s
}

/// `spotguard goodput`: print the report; 0, or 1 when the log cannot be read.
pub fn run_cli(args: GoodputArgs) -> i32 {
    let path = args.state_dir.join(LOG_FILE);
    let (all, bad) = match load(&path) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("spotguard goodput: {e}");
            return 1;
        }
    };
    if bad > 0 {
        eprintln!(
            "spotguard goodput: skipped {bad} line(s) of {} that are not the agent's",
            path.display()
        );
    }
    let report = compute(all, args.since, args.until, Timestamp::now());
    if args.json {
        match serde_json::to_string_pretty(&report) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("spotguard goodput: {e}");
                return 1;
            }
        }
    } else {
        print!("{}", table(&report));
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::goodput::record::TargetBadput;

    fn at(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    fn interruption(seen: i64, save: f64, wasted: (u64, f64)) -> Interruption {
        Interruption {
            notice_id: format!("n{seen}"),
            node: "h".into(),
            seen_at: Some(at(seen)),
            done_at: at(seen + 60),
            targets: vec![TargetBadput {
                target: "trainer".into(),
                outcome: "acked".into(),
                save_seconds: Some(save),
                wasted_steps: Some(wasted.0),
                wasted_seconds: Some(wasted.1),
                ..TargetBadput::default()
            }],
            ..Interruption::default()
        }
    }

    #[test]
    fn the_log_round_trips_rotates_and_skips_what_is_not_the_agents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOG_FILE);
        append(&path, &interruption(0, 10.0, (0, 0.0))).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"not\":1}\n\n")
            .unwrap();
        append(&path, &interruption(100, 5.0, (3, 1.5))).unwrap();
        let (all, bad) = load(&path).unwrap();
        assert_eq!((all.len(), bad), (2, 1));
        assert_eq!(all[1], interruption(100, 5.0, (3, 1.5)));
        // Past the cap the log moves aside, and both files are read.
        let big = std::fs::File::options().append(true).open(&path).unwrap();
        big.set_len(MAX_LOG_BYTES + 1).unwrap();
        append(&path, &interruption(200, 1.0, (0, 0.0))).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() < 4096);
        assert!(load(&path).is_ok());
    }

    #[test]
    fn goodput_is_the_share_of_paid_time_not_lost() {
        let r = compute(
            vec![
                interruption(0, 10.0, (0, 0.0)),
                interruption(500, 20.0, (40, 30.0)),
            ],
            Some(at(0)),
            Some(at(1000)),
            at(5000),
        );
        let t = &r.totals;
        assert_eq!((t.targets, t.interruptions, t.steps_lost), (1, 2, 40));
        assert_eq!(t.paid_seconds, 1000.0);
        assert_eq!(
            t.badput_seconds,
            vec![
                ("checkpoint_save".to_string(), 30.0),
                ("wasted_progress".to_string(), 30.0)
            ]
        );
        assert_eq!(t.productive_seconds, 940.0);
        assert!((t.goodput_percent - 94.0).abs() < 1e-9);
        let text = table(&r);
        assert!(
            text.contains("94.00 %") && text.contains("trainer"),
            "{text}"
        );
        // The window leaves out what ended outside it.
        let r = compute(
            vec![interruption(0, 10.0, (0, 0.0))],
            Some(at(100)),
            Some(at(200)),
            at(0),
        );
        assert_eq!(r.totals.interruptions, 0);
        assert_eq!(r.totals.goodput_percent, 100.0);
    }
}
