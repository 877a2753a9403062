//! `spotguard goodput`: what interruptions cost, as a report a person reads (or JSON): per
//! interruption and in total, paid time, productive time, each badput category, goodput %, the
//! steps lost. Two sources, one report:
//!
//! * A host's goodput log (`<state-dir>/goodput.jsonl`, or several `--log` files: one line per
//!   interruption, appended by the agent as each plan ends, and `{"recovery": …}` lines from the
//!   agent of the host a job resumed on). Paid time is the report's window (`--since` →
//!   `--until`; by default the earliest row shown → now) times the targets seen in
//!   it: each target holds its accelerators for the whole window.
//! * A Kubernetes owner's Events ([`super::kube_report`]): paid time is the owner's start → end.
//!
//! Recoveries join their interruption by notice id. Productive = paid − checkpoint save − wasted
//! progress − infrastructure recovery − checkpoint restore; goodput % = productive / paid.
//! Start-up before the first step and the time after the last step are not charged.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use jiff::Timestamp;
use serde::Serialize;

use super::event::{LogLine, Recovery};
use super::record::{category, Interruption};
use super::Error;

/// The log's file name in the state dir.
pub const LOG_FILE: &str = "goodput.jsonl";
/// A log past this size is rotated to `goodput.jsonl.1` (the previous one dropped) before the
/// next line: the log never grows without bound.
pub const MAX_LOG_BYTES: u64 = 4 << 20;
/// Lines longer than this are not the agent's (skipped, counted).
const MAX_LINE_BYTES: usize = 256 << 10;
/// Every badput category the report totals, in this order.
pub const CATEGORIES: [&str; 4] = [
    category::CHECKPOINT_SAVE,
    category::WASTED_PROGRESS,
    category::INFRASTRUCTURE_RECOVERY,
    category::CHECKPOINT_RESTORE,
];
/// Exit code of a usage error (`EX_USAGE`, as every spotguard command).
const EXIT_USAGE: i32 = 64;
/// What the table's footer says is not charged.
pub const NOT_CHARGED: &str =
    "not charged: start-up before the first training step, and the time after the last step";

/// `spotguard goodput` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct GoodputArgs {
    /// The agent's state dir (its `--state-dir`), where it keeps goodput.jsonl.
    #[arg(long, value_name = "DIR", default_value = "/var/lib/spotguard")]
    pub state_dir: PathBuf,
    /// A goodput log to read instead of the state dir's (repeat for several hosts' logs:
    /// recoveries on one host join interruptions on another by notice id).
    #[arg(long = "log", value_name = "FILE", conflicts_with = "namespace")]
    pub logs: Vec<PathBuf>,
    /// Start of the window (RFC 3339; log source); default: the earliest row the report shows.
    #[arg(long, value_name = "TIME", conflicts_with = "namespace")]
    pub since: Option<Timestamp>,
    /// End of the window (RFC 3339; log source); default: now.
    #[arg(long, value_name = "TIME", conflicts_with = "namespace")]
    pub until: Option<Timestamp>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub kube: super::kube_report::KubeArgs,
}

/// Append `i` to the log at `path` (rotating it past [`MAX_LOG_BYTES`]). Blocking: run it off
/// the async workers.
pub fn append(path: &Path, i: &Interruption) -> Result<(), Error> {
    append_line(path, &LogLine::Interruption(i.clone()))
}

/// Append one log line (an interruption or a recovery) to the log at `path`, rotating it past
/// [`MAX_LOG_BYTES`]. Blocking: run it off the async workers.
pub fn append_line(path: &Path, line: &LogLine) -> Result<(), Error> {
    let err = |source| Error::Log {
        path: path.display().to_string(),
        source,
    };
    if std::fs::metadata(path).is_ok_and(|m| m.len() > MAX_LOG_BYTES) {
        rotate(path).map_err(err)?;
    }
    let mut text = serde_json::to_vec(line).map_err(|e| err(e.into()))?;
    text.push(b'\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(err)?;
    f.write_all(&text).map_err(err)
}

/// Move the log at `path` to `<path>.1`, dropping the previous `<path>.1` but for its
/// interruptions: they lead the new `<path>.1` (the newest of them, up to half of
/// [`MAX_LOG_BYTES`]), so that a run of recoveries never rotates the interruptions they are
/// checked against out of the log. `<path>.1` is replaced atomically; `path` starts afresh.
fn rotate(path: &Path) -> std::io::Result<()> {
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    let old = PathBuf::from(old);
    let mut kept: Vec<Vec<u8>> = Vec::new();
    match std::fs::File::open(&old) {
        Ok(f) => {
            for line in std::io::BufReader::new(f).split(b'\n') {
                let line = line?;
                if line.len() <= MAX_LINE_BYTES
                    && matches!(
                        serde_json::from_slice::<LogLine>(&line),
                        Ok(LogLine::Interruption(_))
                    )
                {
                    kept.push(line);
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut budget = (MAX_LOG_BYTES / 2) as usize;
    let start = kept
        .iter()
        .rposition(|l| match budget.checked_sub(l.len() + 1) {
            Some(left) => {
                budget = left;
                false
            }
            None => true,
        })
        .map_or(0, |k| k + 1);
    let mut data = Vec::new();
    for line in &kept[start..] {
        data.extend_from_slice(line);
        data.push(b'\n');
    }
    data.extend_from_slice(&std::fs::read(path)?);
    crate::fsutil::write_atomic_with(&old, &data, 0o644, crate::fsutil::Durability::File)?;
    std::fs::remove_file(path)
}

/// What a goodput log holds: its interruptions (oldest first), its recoveries, and the number of
/// lines that were not the agent's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logged {
    pub interruptions: Vec<Interruption>,
    pub recoveries: Vec<Recovery>,
    pub skipped: usize,
}

/// Every interruption of the log at `path` (and its rotated predecessor), oldest first, and the
/// number of lines that were not the agent's (recovery lines are neither).
pub fn load(path: &Path) -> Result<(Vec<Interruption>, usize), Error> {
    let l = load_all(path)?;
    Ok((l.interruptions, l.skipped))
}

/// Every line of the log at `path` and its rotated predecessor; an error when there is no log
/// at `path`.
pub fn load_all(path: &Path) -> Result<Logged, Error> {
    read_log(path, true)
}

/// [`load_all`], where a log not written yet (no file at `path`) holds nothing: the agent's own
/// read-back at start-up.
pub fn load_existing(path: &Path) -> Result<Logged, Error> {
    read_log(path, false)
}

fn read_log(path: &Path, required: bool) -> Result<Logged, Error> {
    let mut out = Logged::default();
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    for (p, required) in [(PathBuf::from(old), false), (path.to_path_buf(), required)] {
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
                .then(|| serde_json::from_slice::<LogLine>(&line).ok())
                .flatten()
            {
                Some(LogLine::Interruption(i)) => out.interruptions.push(i),
                Some(LogLine::Recovery { recovery }) => out.recoveries.push(recovery),
                None => out.skipped += 1,
            }
        }
    }
    out.interruptions.sort_by_key(|i| i.done_at);
    Ok(out)
}

/// Every line of the logs at `paths` (several hosts' logs: a recovery on one joins its
/// interruption on another), interruptions oldest first; a log's lines that are not the agent's
/// are reported on stderr and counted.
pub fn load_logs(paths: &[PathBuf]) -> Result<Logged, Error> {
    let mut all = Logged::default();
    for path in paths {
        let l = load_all(path)?;
        if l.skipped > 0 {
            eprintln!(
                "spotguard goodput: skipped {} line(s) of {} that are not the agent's",
                l.skipped,
                path.display()
            );
        }
        all.interruptions.extend(l.interruptions);
        all.recoveries.extend(l.recoveries);
        all.skipped += l.skipped;
    }
    all.interruptions.sort_by_key(|i| i.done_at);
    Ok(all)
}

/// One interruption as the report shows it: what it cost each target it hit (its badput
/// records, joined by notice id) and the recoveries from it. The flat fields sum its targets'
/// badput (`downtime_seconds` / `upload_seconds`: the longest) and its recoveries'.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub notice_id: String,
    /// When it was seen (its record's `seen_at`, else `done_at`); for a recovery whose
    /// interruption has no record here: when that interruption's checkpoint was saved.
    pub at: Timestamp,
    /// The node (host) it hit.
    pub node: Option<String>,
    pub kind: Option<String>,
    /// The targets it hit (`namespace/pod` in Kubernetes, the selector's name on a host).
    pub targets: Vec<String>,
    /// Their checkpoint outcomes (`acked`, `exited`, …; several joined with `+`).
    pub outcome: Option<String>,
    pub detection_seconds: Option<f64>,
    pub save_seconds: Option<f64>,
    pub downtime_seconds: Option<f64>,
    pub upload_seconds: Option<f64>,
    pub wasted_seconds: Option<f64>,
    pub steps_lost: Option<u64>,
    pub drain_margin_seconds: Option<f64>,
    /// The nodes (hosts) the job resumed on.
    pub recovered_on: Vec<String>,
    /// `infrastructure_recovery`: the interrupted trainer's checkpoint → the first step after the
    /// resume, less the restore (none: no recovery reported yet).
    pub recovery_seconds: Option<f64>,
    /// `checkpoint_restore`: loading the checkpoint on the new node, as the trainer timed it.
    pub restore_seconds: Option<f64>,
    /// The badput records as written (targets merged), if any reached this report.
    pub interruption: Option<Interruption>,
    pub recoveries: Vec<Recovery>,
}

impl Row {
    /// Seconds of each of [`CATEGORIES`].
    pub fn badput(&self) -> [f64; 4] {
        [
            self.save_seconds.unwrap_or(0.0),
            self.wasted_seconds.unwrap_or(0.0),
            self.recovery_seconds.unwrap_or(0.0),
            self.restore_seconds.unwrap_or(0.0),
        ]
    }
}

fn sum(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    v.flatten().reduce(|a, b| a + b)
}

fn max(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    v.flatten().reduce(f64::max)
}

/// Whether `r`'s figures can be summed: durations within bounds, the first step not before the
/// save, the restore within the recovery. A record read from an Event or a log line is anyone's
/// text until checked.
pub fn sane_recovery(r: &Recovery) -> bool {
    let slack = super::recovery::CLOCK_SLACK;
    let gap = r.first_step_at.duration_since(r.saved_at).as_secs_f64();
    super::record::sane_seconds(r.recovery_seconds)
        && r.restore_seconds
            .is_none_or(|s| super::record::sane_seconds(s) && s <= r.recovery_seconds + slack)
        && gap >= -slack
        && (gap.max(0.0) - r.recovery_seconds).abs() <= slack
}

/// Join badput records and recoveries by notice id: one [`Row`] per interruption, oldest first.
/// Records of one notice for several targets (one Event per pod) merge (a target seen twice
/// counts once); a recovery reported twice (same target and notice) counts once; a recovery
/// whose interruption has no record here gets a row of its own; an interruption without a
/// recovery has none in its row. Records whose figures cannot be summed
/// ([`Interruption::insane`], [`sane_recovery`]) and recoveries saved before their
/// interruption's signal are left out. Linear in the records (hash maps, no search).
pub fn join(badput: Vec<Interruption>, recoveries: Vec<Recovery>) -> Vec<Row> {
    let mut merged: Vec<(Interruption, HashSet<String>)> = Vec::new();
    let mut by_id: HashMap<String, usize> = HashMap::new();
    for mut i in badput {
        if i.insane().is_some() {
            continue;
        }
        match by_id.get(&i.notice_id) {
            Some(&k) => {
                let (m, seen) = &mut merged[k];
                for t in i.targets {
                    if seen.insert(t.target.clone()) {
                        m.targets.push(t);
                    }
                }
            }
            None => {
                let mut seen = HashSet::new();
                i.targets.retain(|t| seen.insert(t.target.clone()));
                by_id.insert(i.notice_id.clone(), merged.len());
                merged.push((i, seen));
            }
        }
    }
    // The recoveries of each notice, in the order the notices first appear.
    let mut groups: Vec<Vec<Recovery>> = Vec::new();
    let mut group_of: HashMap<String, usize> = HashMap::new();
    let mut once: HashSet<(String, String)> = HashSet::new();
    let slack = super::recovery::CLOCK_SLACK;
    for r in recoveries {
        if !sane_recovery(&r) {
            continue;
        }
        if let Some(&k) = by_id.get(&r.notice_id) {
            let i = &merged[k].0;
            let signalled = i.signalled_at.or(i.seen_at).unwrap_or(i.done_at);
            if signalled.duration_since(r.saved_at).as_secs_f64() > slack {
                continue;
            }
        }
        if !once.insert((r.notice_id.clone(), r.target.clone())) {
            continue;
        }
        let k = *group_of.entry(r.notice_id.clone()).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[k].push(r);
    }
    let mut rows: Vec<Row> = Vec::with_capacity(merged.len() + groups.len());
    for (i, _) in merged {
        let mine = group_of
            .remove(&i.notice_id)
            .map(|k| std::mem::take(&mut groups[k]))
            .unwrap_or_default();
        rows.push(row(Some(i), mine));
    }
    rows.extend(
        groups
            .into_iter()
            .filter(|g| !g.is_empty())
            .map(|g| row(None, g)),
    );
    rows.sort_by_key(|r| r.at);
    rows
}

fn row(i: Option<Interruption>, recoveries: Vec<Recovery>) -> Row {
    let targets = i.as_ref().map(|i| i.targets.as_slice()).unwrap_or_default();
    let mut outcomes: Vec<&str> = targets.iter().map(|t| t.outcome.as_str()).collect();
    outcomes.dedup();
    let mut on: Vec<String> = recoveries.iter().map(|r| r.node.clone()).collect();
    on.sort();
    on.dedup();
    let at = match &i {
        Some(i) => i.seen_at.unwrap_or(i.done_at),
        None => recoveries
            .iter()
            .map(|r| r.saved_at)
            .min()
            .unwrap_or_default(),
    };
    Row {
        notice_id: i
            .as_ref()
            .map(|i| i.notice_id.clone())
            .or_else(|| recoveries.first().map(|r| r.notice_id.clone()))
            .unwrap_or_default(),
        at,
        node: i
            .as_ref()
            .map(|i| i.node.clone())
            .or_else(|| recoveries.iter().find_map(|r| r.from_node.clone())),
        kind: i.as_ref().map(|i| i.kind.clone()).filter(|k| !k.is_empty()),
        targets: targets.iter().map(|t| t.target.clone()).collect(),
        outcome: (!outcomes.is_empty()).then(|| outcomes.join("+")),
        detection_seconds: i.as_ref().and_then(Interruption::detection_seconds),
        save_seconds: sum(targets.iter().map(|t| t.save_seconds)),
        downtime_seconds: max(targets.iter().map(|t| t.downtime_seconds)),
        upload_seconds: max(targets.iter().map(|t| t.upload_seconds)),
        wasted_seconds: sum(targets.iter().map(|t| t.wasted_seconds)),
        steps_lost: targets
            .iter()
            .filter_map(|t| t.wasted_steps)
            .reduce(u64::saturating_add),
        drain_margin_seconds: i.as_ref().and_then(Interruption::drain_margin_seconds),
        recovered_on: on,
        recovery_seconds: sum(recoveries.iter().map(|r| Some(r.infrastructure_seconds()))),
        restore_seconds: sum(recoveries.iter().map(|r| r.restore_seconds)),
        interruption: i,
        recoveries,
    }
}

/// Totals over the report's paid time.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Totals {
    /// Start of the paid time (the window's start; the owner's start in Kubernetes).
    pub since: Timestamp,
    /// Its end (the window's end; the owner's end, or now while it runs).
    pub until: Timestamp,
    /// Targets seen in the badput records.
    pub targets: usize,
    pub paid_seconds: f64,
    pub productive_seconds: f64,
    /// (category, seconds), every one of [`CATEGORIES`] in that order.
    pub badput_seconds: Vec<(String, f64)>,
    pub goodput_percent: f64,
    pub steps_lost: u64,
    pub interruptions: usize,
    pub recoveries: usize,
}

/// The owner a Kubernetes report is about.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Owner {
    pub namespace: String,
    pub kind: String,
    pub name: String,
    /// Still running: the paid time ends now.
    pub running: bool,
}

/// The report: the interruptions, the totals, what was skipped.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<Owner>,
    pub interruptions: Vec<Row>,
    pub totals: Totals,
    /// Log lines, or Events, that should have held a record and did not hold a readable one.
    pub skipped: usize,
}

/// The report over `rows` for paid time `since` → `until` times `paid_targets` (at least 1).
pub fn summarize(
    rows: Vec<Row>,
    since: Timestamp,
    until: Timestamp,
    paid_targets: usize,
    skipped: usize,
) -> Report {
    let window = until.duration_since(since).as_secs_f64().max(0.0);
    let paid = window * paid_targets.max(1) as f64;
    let mut badput = [0.0; 4];
    for r in &rows {
        for (slot, s) in badput.iter_mut().zip(r.badput()) {
            *slot += s;
        }
    }
    let lost: f64 = badput.iter().sum();
    let productive = (paid - lost).max(0.0);
    let targets: BTreeSet<&str> = rows
        .iter()
        .flat_map(|r| r.targets.iter().map(String::as_str))
        .collect();
    Report {
        owner: None,
        totals: Totals {
            since,
            until,
            targets: targets.len(),
            paid_seconds: paid,
            productive_seconds: productive,
            badput_seconds: CATEGORIES
                .iter()
                .zip(badput)
                .map(|(c, s)| (c.to_string(), s))
                .collect(),
            goodput_percent: if paid > 0.0 {
                100.0 * productive / paid
            } else {
                100.0
            },
            steps_lost: rows
                .iter()
                .filter_map(|r| r.steps_lost)
                .fold(0, u64::saturating_add),
            interruptions: rows.iter().filter(|r| r.interruption.is_some()).count(),
            recoveries: rows.iter().map(|r| r.recoveries.len()).sum(),
        },
        interruptions: rows,
        skipped,
    }
}

/// The report of a host log over `[since, until]`: interruptions that ended in it, recoveries
/// whose first step was in it. `until` defaults to `now`; `since` to the earliest row the report
/// shows (a record that no row shows cannot widen the window). Records whose figures cannot be
/// summed are counted as skipped.
pub fn compute(
    logged: Logged,
    since: Option<Timestamp>,
    until: Option<Timestamp>,
    now: Timestamp,
) -> Report {
    let until = until.unwrap_or(now);
    let inside = |t: Timestamp| since.is_none_or(|s| t >= s) && t <= until;
    let mut skipped = logged.skipped;
    let badput: Vec<Interruption> = logged
        .interruptions
        .into_iter()
        .filter(|i| inside(i.done_at))
        .filter(|i| {
            i.insane().is_none() || {
                skipped += 1;
                false
            }
        })
        .collect();
    let recoveries: Vec<Recovery> = logged
        .recoveries
        .into_iter()
        .filter(|r| inside(r.first_step_at))
        .filter(|r| {
            sane_recovery(r) || {
                skipped += 1;
                false
            }
        })
        .collect();
    let mut names: Vec<&str> = badput
        .iter()
        .flat_map(|i| i.targets.iter().map(|t| t.target.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    let paid_targets = names.len();
    let rows = join(badput, recoveries);
    let since = since
        .or_else(|| rows.iter().map(|r| r.at).min())
        .unwrap_or(until);
    summarize(rows, since, until, paid_targets, skipped)
}

fn opt(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())
}

/// The table a person reads.
pub fn table(r: &Report) -> String {
    let mut s = String::new();
    if let Some(o) = &r.owner {
        s.push_str(&format!(
            "{} {}/{}{}\n\n",
            o.kind,
            o.namespace,
            o.name,
            if o.running { " (running)" } else { "" }
        ));
    }
    let target_of = |row: &Row| match row.targets.as_slice() {
        [] => "-".to_string(),
        [one] => one.clone(),
        many => format!("{} targets", many.len()),
    };
    // NODE and TARGET as wide as their longest value (pod names vary in length).
    let node_w = r
        .interruptions
        .iter()
        .map(|row| row.node.as_deref().unwrap_or("-").len())
        .fold(19, usize::max);
    let target_w = r
        .interruptions
        .iter()
        .map(|row| target_of(row).len())
        .fold(21, usize::max);
    s.push_str(&format!(
        "{:<25} {:<node_w$} {:<target_w$} OUTCOME   DETECT_S  SAVE_S  DOWN_S  UPLOAD_S  WASTED_S  STEPS_LOST  DRAIN_MARGIN_S  RECOVERY_S  RESTORE_S\n",
        "WHEN", "NODE", "TARGET",
    ));
    for row in &r.interruptions {
        let when = row.at.round(jiff::Unit::Second).unwrap_or(row.at);
        s.push_str(&format!(
            "{:<25} {:<node_w$} {:<target_w$} {:<9} {:>8}  {:>6}  {:>6}  {:>8}  {:>8}  {:>10}  {:>14}  {:>10}  {:>9}\n",
            when.to_string(),
            row.node.as_deref().unwrap_or("-"),
            target_of(row),
            row.outcome.as_deref().unwrap_or("-"),
            opt(row.detection_seconds),
            opt(row.save_seconds),
            opt(row.downtime_seconds),
            opt(row.upload_seconds),
            opt(row.wasted_seconds),
            row.steps_lost
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            opt(row.drain_margin_seconds),
            opt(row.recovery_seconds),
            opt(row.restore_seconds),
        ));
    }
    let t = &r.totals;
    s.push_str(&format!(
        "\npaid time {} → {} ({} interruption(s), {} recovery(ies), {} target(s))\npaid        {:>12.1} s\nproductive  {:>12.1} s\n",
        t.since, t.until, t.interruptions, t.recoveries, t.targets, t.paid_seconds, t.productive_seconds
    ));
    for (c, v) in &t.badput_seconds {
        s.push_str(&format!("badput {:<23} {:>8.1} s\n", c, v));
    }
    s.push_str(&format!(
        "goodput     {:>12.2} %\nsteps lost  {:>12}\n",
        t.goodput_percent, t.steps_lost
    ));
    if r.skipped > 0 {
        s.push_str(&format!(
            "skipped {} record(s) that could not be read\n",
            r.skipped
        ));
    }
    s.push_str(NOT_CHARGED);
    s.push('\n');
    s
}

/// Print `report` as a table or JSON; 0, or 1 when it cannot be written.
pub fn print(report: &Report, json: bool) -> i32 {
    if json {
        match serde_json::to_string_pretty(report) {
            Ok(j) => println!("{j}"),
            Err(e) => {
                eprintln!("spotguard goodput: {e}");
                return 1;
            }
        }
    } else {
        print!("{}", table(report));
    }
    0
}

/// `spotguard goodput`: print the report of a Kubernetes owner (`--namespace` and a subject,
/// [`super::kube_report`]) or of host logs; 0, 1 when the report cannot be made, 64 on a usage
/// error.
pub fn run_cli(args: GoodputArgs) -> i32 {
    match args.kube.subject() {
        Ok(None) => {}
        Ok(Some((namespace, subject))) => {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("spotguard goodput: {e}");
                    return 1;
                }
            };
            return rt.block_on(super::kube_report::run_cli(
                &args.kube, &namespace, &subject, args.json,
            ));
        }
        Err(e) => {
            eprintln!("spotguard goodput: {e}");
            return EXIT_USAGE;
        }
    }
    let paths = if args.logs.is_empty() {
        vec![args.state_dir.join(LOG_FILE)]
    } else {
        args.logs.clone()
    };
    let all = match load_logs(&paths) {
        Ok(all) => all,
        Err(e) => {
            eprintln!("spotguard goodput: {e}");
            return 1;
        }
    };
    let report = compute(all, args.since, args.until, Timestamp::now());
    print(&report, args.json)
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

    fn recovery(
        notice: &str,
        target: &str,
        saved: i64,
        gap: f64,
        restore: Option<f64>,
    ) -> Recovery {
        Recovery {
            notice_id: notice.into(),
            from_node: Some("h".into()),
            node: "h2".into(),
            target: target.into(),
            step: 10,
            saved_at: at(saved),
            first_step_at: at(saved) + std::time::Duration::from_secs_f64(gap),
            recovery_seconds: gap,
            restore_seconds: restore,
        }
    }

    fn logged(interruptions: Vec<Interruption>) -> Logged {
        Logged {
            interruptions,
            ..Logged::default()
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
        let r = recovery("n100", "trainer", 150, 9.0, Some(2.0));
        append_line(
            &path,
            &LogLine::Recovery {
                recovery: r.clone(),
            },
        )
        .unwrap();
        let (all, bad) = load(&path).unwrap();
        assert_eq!((all.len(), bad), (2, 1));
        assert_eq!(all[1], interruption(100, 5.0, (3, 1.5)));
        assert_eq!(load_all(&path).unwrap().recoveries, vec![r]);
        // Past the cap the log moves aside, and both files are read.
        let big = std::fs::File::options().append(true).open(&path).unwrap();
        big.set_len(MAX_LOG_BYTES + 1).unwrap();
        append(&path, &interruption(200, 1.0, (0, 0.0))).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() < 4096);
        assert!(load(&path).is_ok());
    }

    #[test]
    fn a_recovery_in_another_hosts_log_joins_its_interruption() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
        append(&a, &interruption(500, 5.0, (0, 0.0))).unwrap();
        append(&a, &interruption(0, 10.0, (0, 0.0))).unwrap();
        let r = recovery("n0", "trainer", 60, 9.0, Some(2.0));
        append_line(&b, &LogLine::Recovery { recovery: r }).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&b)
            .unwrap()
            .write_all(b"not json\n")
            .unwrap();
        let all = load_logs(&[a.clone(), b]).unwrap();
        assert_eq!(
            (all.interruptions.len(), all.recoveries.len(), all.skipped),
            (2, 1, 1)
        );
        assert_eq!(all.interruptions[0].notice_id, "n0");
        let rep = compute(all, Some(at(0)), Some(at(1000)), at(1000));
        assert_eq!(rep.interruptions[0].recovery_seconds, Some(7.0));
        assert_eq!(rep.totals.recoveries, 1);
        assert_eq!(rep.skipped, 1);
        assert!(load_logs(&[a, dir.path().join("missing")]).is_err());
    }

    #[test]
    fn goodput_is_the_share_of_paid_time_not_lost() {
        let r = compute(
            logged(vec![
                interruption(0, 10.0, (0, 0.0)),
                interruption(500, 20.0, (40, 30.0)),
            ]),
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
                ("wasted_progress".to_string(), 30.0),
                ("infrastructure_recovery".to_string(), 0.0),
                ("checkpoint_restore".to_string(), 0.0)
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
            logged(vec![interruption(0, 10.0, (0, 0.0))]),
            Some(at(100)),
            Some(at(200)),
            at(0),
        );
        assert_eq!(r.totals.interruptions, 0);
        assert_eq!(r.totals.goodput_percent, 100.0);
    }

    #[test]
    fn recoveries_join_their_interruption_by_notice_id_and_are_charged() {
        // n0: recovered (9 s gap, 2 s of it the restore); n500: not recovered (yet); a recovery
        // from n900, whose record is not in this log: a row of its own, still charged; the
        // same recovery reported twice counts once.
        let rows = join(
            vec![
                interruption(0, 10.0, (0, 0.0)),
                interruption(500, 20.0, (40, 30.0)),
            ],
            vec![
                recovery("n0", "trainer-2", 70, 9.0, Some(2.0)),
                recovery("n900", "trainer-3", 900, 5.0, None),
                recovery("n0", "trainer-2", 70, 9.0, Some(2.0)),
            ],
        );
        assert_eq!(rows.len(), 3, "{rows:#?}");
        assert_eq!(
            (
                rows[0].notice_id.as_str(),
                rows[0].recovery_seconds,
                rows[0].restore_seconds
            ),
            ("n0", Some(7.0), Some(2.0))
        );
        assert_eq!(rows[0].recovered_on, vec!["h2".to_string()]);
        assert_eq!(rows[0].badput(), [10.0, 0.0, 7.0, 2.0]);
        assert_eq!(
            (
                rows[1].notice_id.as_str(),
                rows[1].recovery_seconds,
                rows[1].steps_lost
            ),
            ("n500", None, Some(40))
        );
        assert_eq!(
            (
                rows[2].notice_id.as_str(),
                rows[2].interruption.is_none(),
                rows[2].node.as_deref(),
                rows[2].recovery_seconds,
                rows[2].outcome.as_deref()
            ),
            ("n900", true, Some("h"), Some(5.0), None)
        );
        let r = summarize(rows, at(0), at(1000), 1, 2);
        let t = &r.totals;
        assert_eq!((t.interruptions, t.recoveries, r.skipped), (2, 2, 2));
        assert_eq!(
            t.badput_seconds.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            vec![30.0, 30.0, 12.0, 2.0]
        );
        assert_eq!(t.productive_seconds, 1000.0 - 74.0);
        assert!((t.goodput_percent - 92.6).abs() < 1e-9);
    }

    #[test]
    fn the_records_of_one_notice_for_several_targets_make_one_row() {
        // One Event per pod: three records of notice n0, one of them repeated.
        let mut a = interruption(0, 10.0, (0, 0.0));
        a.targets[0].target = "ml/a".into();
        a.targets[0].downtime_seconds = Some(12.0);
        let mut b = interruption(0, 4.0, (5, 2.5));
        b.targets[0].target = "ml/b".into();
        b.targets[0].outcome = "exited".into();
        b.targets[0].downtime_seconds = Some(3.0);
        let rows = join(
            vec![a.clone(), b, a],
            vec![
                recovery("n0", "ml/a2", 70, 9.0, Some(1.0)),
                recovery("n0", "ml/b2", 70, 6.0, None),
            ],
        );
        let [row] = rows.as_slice() else {
            panic!("one row expected: {rows:#?}")
        };
        assert_eq!(row.targets, vec!["ml/a".to_string(), "ml/b".to_string()]);
        assert_eq!(row.outcome.as_deref(), Some("acked+exited"));
        assert_eq!(
            (
                row.save_seconds,
                row.wasted_seconds,
                row.steps_lost,
                row.downtime_seconds
            ),
            (Some(14.0), Some(2.5), Some(5), Some(12.0))
        );
        assert_eq!(
            (row.recovery_seconds, row.restore_seconds),
            (Some(14.0), Some(1.0))
        );
        let r = summarize(rows, at(0), at(100), 1, 0);
        assert_eq!(r.totals.targets, 2);
        assert_eq!(r.totals.productive_seconds, 100.0 - 14.0 - 2.5 - 14.0 - 1.0);
    }

    #[test]
    fn the_table_and_the_json_show_every_column_and_the_footer() {
        let r = summarize(
            join(
                vec![interruption(0, 10.0, (3, 1.5))],
                vec![recovery("n0", "trainer-2", 70, 9.0, Some(2.0))],
            ),
            at(0),
            at(1000),
            1,
            1,
        );
        let text = table(&r);
        for want in [
            "RECOVERY_S",
            "RESTORE_S",
            "infrastructure_recovery",
            "checkpoint_restore",
            "skipped 1 record(s)",
            NOT_CHARGED,
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        let line = text.lines().nth(1).unwrap();
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols[1..],
            ["h", "trainer", "acked", "-", "10.0", "-", "-", "1.5", "3", "-", "7.0", "2.0"],
            "{line}"
        );
        let j = serde_json::to_value(&r).unwrap();
        let row = &j["interruptions"][0];
        for (k, v) in [
            ("notice_id", serde_json::json!("n0")),
            ("node", serde_json::json!("h")),
            ("targets", serde_json::json!(["trainer"])),
            ("outcome", serde_json::json!("acked")),
            ("save_seconds", serde_json::json!(10.0)),
            ("wasted_seconds", serde_json::json!(1.5)),
            ("steps_lost", serde_json::json!(3)),
            ("recovery_seconds", serde_json::json!(7.0)),
            ("restore_seconds", serde_json::json!(2.0)),
            ("recovered_on", serde_json::json!(["h2"])),
        ] {
            assert_eq!(row[k], v, "{k}: {row}");
        }
        assert_eq!(j["skipped"], 1);
        assert_eq!(
            j["totals"]["badput_seconds"][2][0],
            "infrastructure_recovery"
        );
        assert_eq!(j["totals"]["recoveries"], 1);
        assert!(j.get("owner").is_none());
    }

    #[test]
    fn wrapped_negative_and_forged_figures_are_skipped_never_summed() {
        // The attack as run: one record of 2^64-400 wasted steps and -20 wasted seconds beside
        // a real record of 400 lost steps; one of 10^9 s; a recovery naming the real notice
        // with a save from 2001 (before its signal) and one whose restore exceeds its recovery.
        let real = interruption(0, 10.0, (400, 200.0));
        let mut wrapped = interruption(10, 0.0, (0, 0.0));
        wrapped.targets[0].wasted_steps = Some(u64::MAX - 399);
        wrapped.targets[0].wasted_seconds = Some(-20.0);
        let mut huge = interruption(20, 1_000_000_000.0, (0, 0.0));
        huge.targets[0].target = "victim".into();
        let mut forged = recovery("n0", "trainer", 0, 5.0, None);
        forged.saved_at = Timestamp::from_second(1_000_000_001).unwrap();
        forged.first_step_at = at(60);
        forged.recovery_seconds = at(60).duration_since(forged.saved_at).as_secs_f64();
        let mut restore = recovery("n0", "trainer-3", 70, 9.0, Some(9_999_999.0));
        restore.target = "trainer-3".into();
        let r = compute(
            Logged {
                interruptions: vec![real, wrapped, huge],
                recoveries: vec![forged, restore],
                skipped: 0,
            },
            Some(at(-100)),
            Some(at(1000)),
            at(1000),
        );
        let t = &r.totals;
        assert_eq!((t.interruptions, t.recoveries, t.steps_lost), (1, 0, 400));
        // The forged recovery: 7e8 s away is past any recovery too.
        assert_eq!(
            r.skipped, 4,
            "the wrapped, the huge, the forged, the restore: {r:#?}"
        );
        assert_eq!(
            t.badput_seconds.iter().map(|(_, s)| *s).collect::<Vec<_>>(),
            vec![10.0, 200.0, 0.0, 0.0]
        );
        // Sums never wrap even where records are summed as they come (an Event's).
        let mut a = interruption(0, 1.0, (u64::MAX / 2 + 1, 1.0));
        a.targets.push(TargetBadput {
            target: "other".into(),
            wasted_steps: Some(u64::MAX / 2 + 1),
            ..TargetBadput::default()
        });
        assert_eq!(a.steps_lost(), u64::MAX);
    }

    #[test]
    fn the_default_window_starts_at_what_the_report_shows() {
        // A recovery of the real notice saved in 2001 (a forged one from a log written before
        // recoveries were checked): not charged, and the window does not move to 2001.
        let mut forged = recovery("n100", "trainer", 0, 5.0, None);
        forged.saved_at = Timestamp::from_second(1_000_000_001).unwrap();
        forged.first_step_at = at(200);
        forged.recovery_seconds = at(200).duration_since(forged.saved_at).as_secs_f64();
        let r = compute(
            Logged {
                interruptions: vec![interruption(100, 10.0, (0, 0.0))],
                recoveries: vec![forged],
                skipped: 0,
            },
            None,
            None,
            at(1100),
        );
        assert_eq!(r.totals.since, at(100));
        assert_eq!(r.totals.paid_seconds, 1000.0);
        assert!((r.totals.goodput_percent - 99.0).abs() < 1e-9);
        assert_eq!(r.totals.recoveries, 0);
    }

    #[test]
    fn rotation_keeps_the_interruptions_of_the_file_it_drops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LOG_FILE);
        append(&path, &interruption(0, 10.0, (0, 0.0))).unwrap();
        let line = LogLine::Recovery {
            recovery: recovery("n0", "trainer", 60, 9.0, None),
        };
        // A full file of recovery lines, twice: two rotations, the first interruption's file
        // dropped by the second.
        let mut full = serde_json::to_vec(&line).unwrap();
        full.push(b'\n');
        let full = full.repeat((MAX_LOG_BYTES as usize / full.len()) + 1);
        for _ in 0..2 {
            std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap()
                .write_all(&full)
                .unwrap();
            append_line(&path, &line).unwrap();
        }
        append(&path, &interruption(500, 5.0, (0, 0.0))).unwrap();
        let logged = load_all(&path).unwrap();
        assert_eq!(
            logged
                .interruptions
                .iter()
                .map(|i| i.notice_id.as_str())
                .collect::<Vec<_>>(),
            vec!["n0", "n500"]
        );
        let mut old = path.as_os_str().to_owned();
        old.push(".1");
        for p in [PathBuf::from(old), path.clone()] {
            assert!(std::fs::metadata(&p).unwrap().len() <= MAX_LOG_BYTES + 4096);
        }
    }
}
