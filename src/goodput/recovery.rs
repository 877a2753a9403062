//! Recovery, linked across nodes: the agent of the node a job resumed on reports how long the
//! job was away after an interruption, from the helper's resume record.
//!
//! The interrupted trainer's helper left an interruption sidecar beside the checkpoint it saved
//! after the notice (or the staged manifest carries the notice); on this node the helper's
//! `resumed(step, checkpoint=…, restore_seconds=…)` copies it into `<dir>/resume-<pid>.json` as
//! `interruption`, and stamps `first_step_ts` at the first training step. A background task here
//! ([`run`]; never on the signal path) reads the opted-in targets' resume records every
//! [`PASS_EVERY`], within [`PASS_BUDGET`] a pass, through the guarded reader the acks use (inside
//! the process's root, no symlink, one link, owned by the process's user, at most
//! [`MAX_RESUME_BYTES`], a strict [`parse`]).
//!
//! The record is the trainer's, so the notice it names is free text: a recovery counts only
//! against an interruption an agent recorded for the same job ([`Ledger::recorded`]: on a host
//! the agent's own goodput log, [`LogLedger`]; in Kubernetes that log, then the cluster's ledger
//! of the pod's controller, `super::ledger::KubeLedger`), and only with times consistent with that record ([`check`]). A refused record
//! is counted and logged once per target group and reason. An accepted one is reported once:
//! the `infrastructure_recovery` and `checkpoint_restore` badput, `spotguard_recoveries_total`,
//! an `InterruptionRecovered` pod Event carrying the [`Recovery`], a `{"recovery": …}` line in
//! `<state-dir>/goodput.jsonl`, a log line.
//!
//! Once means once per target (pod or host selector) and notice: the ranks of one job resume
//! from the same checkpoint, and the interruption's badput is per target too. The goodput log is
//! the record of what was reported: read back at start, it keeps a restarted agent from
//! reporting a recovery twice. The set of reported keys is bounded ([`MAX_REPORTED`], oldest
//! first out); only recorded interruptions enter it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::event::{EventRecord, LogLine, Recovery};
use super::record::{category, Interruption};
use super::Error;
use crate::checkpoint::ack::CheckpointDir;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::{TargetDiscovery, TargetGroup};
use crate::metrics::{CategoryLabels, Metrics};
use crate::node::{EventType, NodeOps, PodRef};

/// The reason of the pod Event a recovery posts (`outcome::reason::RECOVERED`).
pub const REASON: &str = "InterruptionRecovered";

/// How often the resume records are read.
pub const PASS_EVERY: Duration = Duration::from_secs(5);
/// The most one pass (discovery and the file reads) may take; a pass past it is abandoned (its
/// thread finishes on its own, and no pass starts while it runs).
pub const PASS_BUDGET: Duration = Duration::from_secs(4);
/// The largest resume record read (bytes): the helper's is a few hundred.
pub const MAX_RESUME_BYTES: u64 = 4096;
/// Processes looked at per pass: a pod with a fork bomb costs bounded work.
const MAX_PROCESSES: usize = 4096;
/// Refused records remembered (warned about and counted once each) before the memory is reset.
const MAX_REFUSED: usize = 4096;
/// Longest notice id, node, kind or source taken from a record.
const MAX_TEXT: usize = 256;
/// (target, notice) keys of reported recoveries kept in memory; the oldest go first.
pub const MAX_REPORTED: usize = 4096;
/// Clock skew tolerated between the trainer that saved and the one that resumed (two machines'
/// clocks), and between a record and this node's clock (seconds).
pub const CLOCK_SLACK: f64 = 2.0;

/// An interruption an agent recorded for a job: what a recovery from it is checked against.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedInterruption {
    pub notice_id: String,
    /// The node (host) it hit.
    pub node: String,
    /// When the agent signalled the job (else when it saw the notice, else when its plan ended).
    pub signalled_at: Timestamp,
    /// When its plan ended.
    pub done_at: Timestamp,
}

impl RecordedInterruption {
    /// The record of `i`, as the goodput log (or an Event) holds it.
    pub fn of(i: &Interruption) -> RecordedInterruption {
        RecordedInterruption {
            notice_id: i.notice_id.clone(),
            node: i.node.clone(),
            signalled_at: i.signalled_at.or(i.seen_at).unwrap_or(i.done_at),
            done_at: i.done_at,
        }
    }
}

/// The job a resume record was found for: its target group (`namespace/pod` in Kubernetes, the
/// selector's name on a host) and, in Kubernetes, its pod.
#[derive(Clone, Copy, Debug)]
pub struct Job<'a> {
    pub target_group: &'a str,
    pub pod: Option<&'a PodRef>,
}

/// Where the interruptions agents recorded are looked up: the only source of a recovery's
/// interruption (the resume record's notice id is the trainer's free text).
pub trait Ledger: Send {
    /// Bring the view up to date; called once per pass, on the pass's thread (may block,
    /// bounded).
    fn refresh(&mut self) {}
    /// The interruption `notice_id` an agent recorded for `job`, if any.
    fn recorded(&self, job: &Job<'_>, notice_id: &str) -> Option<RecordedInterruption>;
}

/// The interruptions in this agent's goodput log (and its rotated predecessor), re-read when
/// the files change: a host's record of its own interruptions. For a pod (no cluster-wide
/// record plugged in) an interruption of a pod of the same namespace that this agent recorded.
#[derive(Debug, Default)]
pub struct LogLedger {
    path: Option<PathBuf>,
    /// The files' (length, modification time) when last read.
    read: Option<Vec<Option<(u64, std::time::SystemTime)>>>,
    /// (target, notice id) → the record.
    by_target: HashMap<(String, String), RecordedInterruption>,
    /// (namespace, notice id) → the record, for the targets that are pods (`namespace/pod`).
    by_namespace: HashMap<(String, String), RecordedInterruption>,
}

impl LogLedger {
    /// The ledger of the goodput log at `path` (`None`: a dry run, nothing recorded).
    pub fn new(path: Option<PathBuf>) -> LogLedger {
        LogLedger {
            path,
            ..LogLedger::default()
        }
    }

    fn stamps(path: &Path) -> Vec<Option<(u64, std::time::SystemTime)>> {
        let mut old = path.as_os_str().to_owned();
        old.push(".1");
        [PathBuf::from(old), path.to_path_buf()]
            .iter()
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.len(), m.modified().ok()?))
            })
            .collect()
    }
}

impl Ledger for LogLedger {
    fn refresh(&mut self) {
        let Some(path) = &self.path else { return };
        let now = Self::stamps(path);
        if self.read.as_ref() == Some(&now) {
            return;
        }
        match super::report::load_existing(path) {
            Ok(logged) => {
                self.by_target.clear();
                self.by_namespace.clear();
                for i in &logged.interruptions {
                    let rec = RecordedInterruption::of(i);
                    for t in &i.targets {
                        if let Some((ns, _)) = t.target.split_once('/') {
                            self.by_namespace
                                .insert((ns.to_string(), i.notice_id.clone()), rec.clone());
                        }
                        self.by_target
                            .insert((t.target.clone(), i.notice_id.clone()), rec.clone());
                    }
                }
                self.read = Some(now);
            }
            Err(e) => debug!(error = %e, "recovery ledger: the goodput log cannot be read"),
        }
    }

    fn recorded(&self, job: &Job<'_>, notice_id: &str) -> Option<RecordedInterruption> {
        if let Some(r) = self
            .by_target
            .get(&(job.target_group.to_string(), notice_id.to_string()))
        {
            return Some(r.clone());
        }
        let ns = &job.pod?.namespace;
        self.by_namespace
            .get(&(ns.clone(), notice_id.to_string()))
            .cloned()
    }
}

/// Why a recovery was refused: its metric label (`spotguard_errors_total{module="goodput"}`)
/// and the words of its log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub label: &'static str,
    pub why: &'static str,
}

/// The record names no interruption an agent recorded for this job.
pub const NOT_RECORDED: &str = "recovery_not_recorded";
/// The record's times do not fit the recorded interruption or this node's clock.
pub const INCONSISTENT: &str = "recovery_inconsistent";

/// Whether `r` may count as a recovery from `recorded` (the interruption an agent recorded for
/// the job under the record's notice id, if any) at `now` (Unix seconds): saved after the
/// signal, first step after the save, the restore within the recovery, nothing in the future.
pub fn check(
    r: &Resumed,
    recorded: Option<&RecordedInterruption>,
    now: f64,
) -> Result<(), Refusal> {
    let inconsistent = |why| {
        Err(Refusal {
            label: INCONSISTENT,
            why,
        })
    };
    let Some(rec) = recorded else {
        return Err(Refusal {
            label: NOT_RECORDED,
            why: "no interruption with this notice id was recorded for this job",
        });
    };
    let signalled = rec.signalled_at.as_microsecond() as f64 / 1e6;
    if r.saved_ts > now + CLOCK_SLACK || r.first_step_ts > now + CLOCK_SLACK {
        return inconsistent("saved_ts or first_step_ts is in the future");
    }
    if r.saved_ts + CLOCK_SLACK < signalled {
        return inconsistent("saved before the interruption's signal");
    }
    if r.first_step_ts + CLOCK_SLACK < r.saved_ts {
        return inconsistent("first step before the save");
    }
    let away = (r.first_step_ts - r.saved_ts).max(0.0);
    if r.restore_seconds.is_some_and(|s| s > away + CLOCK_SLACK) {
        return inconsistent("restore_seconds longer than the recovery");
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInterruption {
    notice_id: String,
    node: Option<String>,
    kind: String,
    source: String,
    step: u64,
    saved_ts: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResume {
    step: u64,
    ts: f64,
    rank: Option<i64>,
    world_size: Option<i64>,
    // `spotguard drill --elastic --node-env VAR`: the value of $VAR, or null.
    #[serde(default, rename = "node")]
    _node: Option<String>,
    #[serde(default)]
    last_step: Option<u64>,
    #[serde(default)]
    last_ts: Option<f64>,
    #[serde(default)]
    interruption: Option<RawInterruption>,
    #[serde(default)]
    restore_seconds: Option<f64>,
    #[serde(default)]
    first_step_ts: Option<f64>,
}

/// A resume record that names an interruption and the first step after it.
#[derive(Clone, Debug, PartialEq)]
pub struct Resumed {
    /// The step training resumed from.
    pub step: u64,
    pub notice_id: String,
    /// The node the interruption hit (its `notice.json`'s `node`).
    pub from_node: Option<String>,
    /// When the interrupted trainer made the checkpoint durable (Unix seconds, its clock).
    pub saved_ts: f64,
    /// The end of the first step trained after the resume (Unix seconds, this node's clock).
    pub first_step_ts: f64,
    pub restore_seconds: Option<f64>,
}

fn plain_text(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_TEXT && !s.chars().any(char::is_control)
}

/// Parse a resume record strictly: the helper's exact shape, sane times, texts without control
/// characters. `Ok(None)` for a record that names no interruption or has no first step yet
/// (nothing to report); `Err` for anything that is not the helper's record.
pub fn parse(data: &[u8]) -> Result<Option<Resumed>, Error> {
    let bad = |why: &str| Error::Resume(why.to_string());
    if data.len() as u64 > MAX_RESUME_BYTES {
        return Err(bad("too large"));
    }
    let raw: RawResume = serde_json::from_slice(data).map_err(|e| Error::Resume(e.to_string()))?;
    let _ = (raw.rank, raw.world_size, raw.last_step);
    if !super::progress::sane_time(raw.ts)
        || raw.last_ts.is_some_and(|t| !super::progress::sane_time(t))
    {
        return Err(bad("ts is not a Unix time"));
    }
    if let Some(r) = raw.restore_seconds {
        if !(r.is_finite() && (0.0..1.0e7).contains(&r)) {
            return Err(bad("restore_seconds is not a duration"));
        }
    }
    let (Some(i), Some(first)) = (raw.interruption, raw.first_step_ts) else {
        return Ok(None);
    };
    if !super::progress::sane_time(first) || !super::progress::sane_time(i.saved_ts) {
        return Err(bad("first_step_ts or saved_ts is not a Unix time"));
    }
    if !(plain_text(&i.notice_id) && plain_text(&i.kind) && plain_text(&i.source))
        || i.node.as_deref().is_some_and(|n| !plain_text(n))
    {
        return Err(bad("notice_id, node, kind or source is not plain text"));
    }
    if i.step != raw.step {
        return Err(bad("the interruption's step is not the resumed step"));
    }
    Ok(Some(Resumed {
        step: raw.step,
        notice_id: i.notice_id,
        from_node: i.node,
        saved_ts: i.saved_ts,
        first_step_ts: first,
        restore_seconds: raw.restore_seconds,
    }))
}

fn at(unix: f64) -> Timestamp {
    Timestamp::from_microsecond((unix * 1e6) as i64).unwrap_or(Timestamp::UNIX_EPOCH)
}

impl Resumed {
    /// The recovery this record reports, for `target` on `node`.
    pub fn recovery(&self, target: &str, node: &str) -> Recovery {
        Recovery {
            notice_id: self.notice_id.clone(),
            from_node: self.from_node.clone(),
            node: node.to_string(),
            target: target.to_string(),
            step: self.step,
            saved_at: at(self.saved_ts),
            first_step_at: at(self.first_step_ts),
            // Two machines' clocks: a first step "before" the save is skew, not negative time.
            recovery_seconds: (self.first_step_ts - self.saved_ts).max(0.0),
            restore_seconds: self.restore_seconds,
        }
    }
}

/// The name of a process's resume record (`pid` as the process sees it).
pub fn resume_file_name(ns_pid: i32) -> String {
    format!("resume-{ns_pid}.json")
}

/// What has been reported: (target, notice id).
type Key = (String, String);

/// The recoveries already in the goodput log at `path` (and its rotated predecessor). Lines that
/// are not recoveries, or not the agent's, are passed over.
pub fn reported_in_log(path: &Path) -> Result<HashSet<Key>, Error> {
    let logged = super::report::load_existing(path)?;
    Ok(logged
        .recoveries
        .into_iter()
        .map(|r| (r.target, r.notice_id))
        .collect())
}

/// One resume record found in a pass.
#[derive(Clone, Debug)]
struct Found {
    target: String,
    pod: Option<PodRef>,
    record: Resumed,
}

/// A record refused in a pass: where, and why. It is counted and logged once per target group
/// and reason (`label`, `why`); `file` and `notice_id` only go to the log line.
#[derive(Clone, Debug)]
struct Refused {
    target: String,
    label: &'static str,
    why: String,
    file: String,
    notice_id: Option<String>,
}

/// A checkpoint dir kept open between passes: its group, its root process (pid, start time;
/// `None` on the host) and its path.
type DirKey = (String, Option<(i32, u64)>, PathBuf);

/// What a pass reads: every opted-in target's live processes' resume records, checked against
/// the ledger.
struct Reader {
    dirs: HashMap<DirKey, CheckpointDir>,
    ledger: Box<dyn Ledger>,
}

fn unix_now() -> f64 {
    Timestamp::now().as_microsecond() as f64 / 1e6
}

impl Reader {
    fn new(ledger: Box<dyn Ledger>) -> Reader {
        Reader {
            dirs: HashMap::new(),
            ledger,
        }
    }

    fn pass(&mut self, groups: &[TargetGroup], skip: &HashSet<Key>) -> (Vec<Found>, Vec<Refused>) {
        let mut found = Vec::new();
        let mut refused = Vec::new();
        let mut used = HashSet::new();
        let mut looked = 0usize;
        self.ledger.refresh();
        let now = unix_now();
        for g in groups {
            let proc = ProcFs::new(g.proc_root.clone());
            for c in &g.containers {
                let root = c.root_pid.and_then(|pid| {
                    let p = c.processes.iter().find(|p| p.pid == pid)?;
                    Some((pid, p.start_time))
                });
                if c.root_pid.is_some() && root.is_none() {
                    continue;
                }
                let key = (g.name.clone(), root, g.dir.clone());
                let dir = match self.dirs.entry(key.clone()) {
                    std::collections::hash_map::Entry::Occupied(d) => d.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        let opened = match root {
                            None => CheckpointDir::host(&g.dir),
                            Some((pid, start)) => {
                                CheckpointDir::in_root_of(&proc, pid, start, &g.dir)
                            }
                        };
                        match opened {
                            Ok(d) => v.insert(d),
                            Err(e) => {
                                debug!(target_group = %g.name, error = %e, "resume records: checkpoint dir not opened");
                                continue;
                            }
                        }
                    }
                };
                used.insert(key);
                for p in &c.processes {
                    looked += 1;
                    if looked > MAX_PROCESSES {
                        break;
                    }
                    let Ok(status) = proc.status(p.pid) else {
                        continue;
                    };
                    let ns_pid = status.ns_pid().unwrap_or(p.pid);
                    let name = resume_file_name(ns_pid);
                    let refuse =
                        |label: &'static str, why: String, notice_id: Option<String>| Refused {
                            target: g.name.clone(),
                            label,
                            why,
                            file: format!("{} ({name})", dir.display()),
                            notice_id,
                        };
                    let not_helpers = |why: String| refuse("resume_record", why, None);
                    match dir.read_file(&name) {
                        Ok(None) => {}
                        Ok(Some((_, stamp))) if !status.uids.contains(&stamp.uid) => {
                            refused.push(not_helpers(format!(
                                "owned by uid {}, not the process's user",
                                stamp.uid
                            )));
                        }
                        Ok(Some((_, stamp))) if stamp.size > MAX_RESUME_BYTES => {
                            refused.push(not_helpers(format!(
                                "{} bytes, more than {MAX_RESUME_BYTES}",
                                stamp.size
                            )));
                        }
                        Ok(Some((data, _))) => match parse(&data) {
                            Ok(Some(record)) => {
                                if skip.contains(&(g.name.clone(), record.notice_id.clone())) {
                                    continue;
                                }
                                let job = Job {
                                    target_group: &g.name,
                                    pod: g.pod.as_ref(),
                                };
                                let recorded = self.ledger.recorded(&job, &record.notice_id);
                                match check(&record, recorded.as_ref(), now) {
                                    Ok(()) => found.push(Found {
                                        target: g.name.clone(),
                                        pod: g.pod.clone(),
                                        record,
                                    }),
                                    Err(r) => refused.push(refuse(
                                        r.label,
                                        r.why.to_string(),
                                        Some(record.notice_id),
                                    )),
                                }
                            }
                            Ok(None) => {}
                            Err(e) => refused.push(not_helpers(e.to_string())),
                        },
                        Err(e) => refused.push(not_helpers(e.to_string())),
                    }
                }
            }
        }
        self.dirs.retain(|k, _| used.contains(k));
        (found, refused)
    }
}

/// The (target, notice) keys of the recoveries reported, at most [`MAX_REPORTED`] (the oldest
/// go first).
#[derive(Debug, Default)]
struct Reported {
    keys: HashSet<Key>,
    order: VecDeque<Key>,
}

impl Reported {
    /// Add `key`: `false` when it was there already.
    fn insert(&mut self, key: Key) -> bool {
        if !self.keys.insert(key.clone()) {
            return false;
        }
        self.order.push_back(key);
        while self.order.len() > MAX_REPORTED {
            if let Some(old) = self.order.pop_front() {
                self.keys.remove(&old);
            }
        }
        true
    }
}

/// Where a recovery is reported.
#[derive(Clone)]
pub struct Sinks {
    pub metrics: Arc<Metrics>,
    /// Pod Events (Kubernetes); a host target has no pod.
    pub node: Option<Arc<dyn NodeOps>>,
    /// This node's (host's) name.
    pub node_name: String,
    /// `<state-dir>/goodput.jsonl`; `None` in a dry run (nothing written, dedup in memory).
    pub goodput_log: Option<PathBuf>,
}

/// Whether discovery answers from its cache now (Kubernetes: the pod cache synced; a host:
/// always). A pass skips otherwise: discovery would list the node's pods from the API server,
/// which is for a notice, not for a report.
pub type Ready = Arc<dyn Fn() -> bool + Send + Sync>;

/// The recovery task: a pass every [`PASS_EVERY`] (while `ready`) until `cancel`; recoveries
/// are checked against the agent's own goodput log ([`LogLedger`]).
pub async fn run(
    discovery: Arc<dyn TargetDiscovery>,
    ready: Ready,
    sinks: Sinks,
    cancel: CancellationToken,
) {
    let ledger = log_ledger(sinks.goodput_log.clone());
    run_with(discovery, ready, sinks, ledger, cancel).await
}

/// [`run`] with recoveries checked against `ledger`'s records (Kubernetes: a cluster-wide record
/// of interruptions instead of this agent's own log).
pub async fn run_with(
    discovery: Arc<dyn TargetDiscovery>,
    ready: Ready,
    sinks: Sinks,
    ledger: LedgerFactory,
    cancel: CancellationToken,
) {
    let mut watch = Watch::with_ledger(sinks, ledger).await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PASS_EVERY) => {}
        }
        if ready() {
            watch.pass(discovery.as_ref()).await;
        }
    }
}

/// Makes the ledger a reader checks recoveries against (a new one after an abandoned pass).
pub type LedgerFactory = Arc<dyn Fn() -> Box<dyn Ledger> + Send + Sync>;

/// The factory of [`LogLedger`]s over the goodput log at `path`.
pub fn log_ledger(path: Option<PathBuf>) -> LedgerFactory {
    Arc::new(move || Box::new(LogLedger::new(path.clone())) as Box<dyn Ledger>)
}

/// The recovery task's state: what was reported, the reader, the refusals logged.
pub struct Watch {
    sinks: Sinks,
    reported: Reported,
    /// (target group, reason label, reason) of the refusals counted and logged.
    refused: HashSet<(String, &'static str, String)>,
    reader: Option<Reader>,
    ledger: LedgerFactory,
    busy: Arc<AtomicBool>,
}

impl Watch {
    /// [`Watch::with_ledger`] over the agent's own goodput log.
    pub async fn start(sinks: Sinks) -> Watch {
        let ledger = log_ledger(sinks.goodput_log.clone());
        Watch::with_ledger(sinks, ledger).await
    }

    /// Read back what the goodput log says was reported (a log that cannot be read is counted,
    /// and the task goes on from nothing); recoveries are checked against `ledger`'s records.
    pub async fn with_ledger(sinks: Sinks, ledger: LedgerFactory) -> Watch {
        let logged = match sinks.goodput_log.clone() {
            Some(path) => tokio::task::spawn_blocking(move || reported_in_log(&path))
                .await
                .unwrap_or_else(|e| Err(Error::Resume(e.to_string()))),
            None => Ok(HashSet::new()),
        };
        let logged = logged.unwrap_or_else(|e| {
            sinks.metrics.error("goodput", "goodput_log");
            warn!(error = %e, "cannot read the goodput log back: recoveries already reported may be reported again");
            HashSet::new()
        });
        let mut reported = Reported::default();
        for key in logged {
            reported.insert(key);
        }
        Watch {
            sinks,
            reported,
            refused: HashSet::new(),
            reader: Some(Reader::new(ledger())),
            ledger,
            busy: Arc::new(AtomicBool::new(false)),
        }
    }

    /// One pass: discovery, the reads and checks (on a thread of their own), the reports.
    /// Within [`PASS_BUDGET`]; a pass still reading from the last one makes this one a no-op.
    pub async fn pass(&mut self, discovery: &dyn TargetDiscovery) {
        if self.busy.load(Ordering::Acquire) {
            return;
        }
        let Ok(groups) = tokio::time::timeout(PASS_BUDGET, discovery.discover()).await else {
            debug!("resume records: discovery took longer than the pass budget");
            return;
        };
        let groups = match groups {
            Ok(g) => g,
            Err(e) => {
                debug!(error = %e, "resume records: discovery failed");
                return;
            }
        };
        let Some(mut reader) = self.reader.take() else {
            return;
        };
        let skip = self.reported.keys.clone();
        let busy = self.busy.clone();
        busy.store(true, Ordering::Release);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("sg-recovery".into())
            .spawn(move || {
                let out = reader.pass(&groups, &skip);
                busy.store(false, Ordering::Release);
                let _ = tx.send((reader, out));
            });
        if thread.is_err() {
            self.busy.store(false, Ordering::Release);
            self.reader = Some(Reader::new((self.ledger)()));
            return;
        }
        let (found, refused) = match tokio::time::timeout(PASS_BUDGET, rx).await {
            Ok(Ok((reader, out))) => {
                self.reader = Some(reader);
                out
            }
            _ => {
                // Abandoned: the thread ends on its own (the next pass waits for it) and its
                // open dirs go with it.
                warn!("resume records: a pass took longer than its budget; abandoned");
                self.reader = Some(Reader::new((self.ledger)()));
                return;
            }
        };
        for r in refused {
            let key = (r.target.clone(), r.label, r.why.clone());
            if self.refused.contains(&key) {
                continue;
            }
            self.sinks.metrics.error("goodput", r.label);
            if r.label == "resume_record" {
                warn!(target_group = %r.target, file = %r.file, reason = %r.why, "ignoring a resume record that is not the helper's");
            } else {
                warn!(
                    target_group = %r.target,
                    file = %r.file,
                    notice_id = r.notice_id.as_deref().unwrap_or("-"),
                    reason = %r.why,
                    "ignoring a recovery that no recorded interruption backs"
                );
            }
            if self.refused.len() >= MAX_REFUSED {
                self.refused.clear();
            }
            self.refused.insert(key);
        }
        for f in found {
            let key = (f.target.clone(), f.record.notice_id.clone());
            if self.reported.insert(key) {
                report(&self.sinks, &f).await;
            }
        }
    }
}

/// Report one recovery: the goodput log first (it is the record of what was reported), then the
/// metrics, the pod Event and the log line.
async fn report(sinks: &Sinks, f: &Found) {
    let r = f.record.recovery(&f.target, &sinks.node_name);
    if let Some(path) = sinks.goodput_log.clone() {
        let line = LogLine::Recovery {
            recovery: r.clone(),
        };
        let written =
            tokio::task::spawn_blocking(move || super::report::append_line(&path, &line)).await;
        if !matches!(written, Ok(Ok(()))) {
            sinks.metrics.error("goodput", "goodput_log");
            warn!("cannot append the recovery to the goodput log");
        }
    }
    let m = &sinks.metrics;
    for (cat, seconds) in [
        (
            category::INFRASTRUCTURE_RECOVERY,
            r.infrastructure_seconds(),
        ),
        (
            category::CHECKPOINT_RESTORE,
            r.restore_seconds.unwrap_or(0.0),
        ),
    ] {
        m.badput_seconds
            .get_or_create(&CategoryLabels {
                category: cat.to_string(),
            })
            .inc_by(seconds);
    }
    m.recoveries.inc();
    let message = summary(&r);
    info!(
        notice_id = %r.notice_id,
        from_node = r.from_node.as_deref().unwrap_or("-"),
        target_group = %r.target,
        step = r.step,
        recovery_seconds = r.recovery_seconds,
        restore_seconds = r.restore_seconds,
        infrastructure_seconds = r.infrastructure_seconds(),
        "interruption recovered"
    );
    if let (Some(node), Some(pod)) = (&sinks.node, &f.pod) {
        if let Err(e) = node
            .pod_record_event(
                pod,
                EventType::Normal,
                REASON,
                &message,
                &EventRecord::Recovery(r.clone()).to_annotation(),
            )
            .await
        {
            sinks.metrics.error("goodput", e.metric_label());
            warn!(error = %e, "cannot post the recovery Event");
        }
    }
}

/// The Event's text.
pub fn summary(r: &Recovery) -> String {
    let restore = r
        .restore_seconds
        .map(|s| format!(", restore {s:.1}s"))
        .unwrap_or_default();
    format!(
        "resumed at step {} after interruption {} on {}: away {:.1}s (infrastructure {:.1}s{restore})",
        r.step,
        r.notice_id,
        r.from_node.as_deref().unwrap_or("an unknown node"),
        r.recovery_seconds,
        r.infrastructure_seconds(),
    )
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use async_trait::async_trait;
    use prometheus_client::registry::Registry;

    use super::*;
    use crate::checkpoint::{Signal, TargetContainer, TargetMode, TargetProcess};
    use crate::metrics::ModuleErrorLabels;

    const RECORD: &str = r#"{"step":120,"ts":1700000100.0,"rank":0,"world_size":2,"last_step":120,"last_ts":1700000100.0,"interruption":{"notice_id":"aws-1","node":"spot-a","kind":"interruption","source":"aws","step":120,"saved_ts":1700000090.0},"restore_seconds":2.5,"first_step_ts":1700000104.0}"#;

    #[test]
    fn the_helpers_record_parses_into_a_recovery() {
        let r = parse(RECORD.as_bytes()).unwrap().unwrap();
        assert_eq!((r.step, r.notice_id.as_str()), (120, "aws-1"));
        let rec = r.recovery("ml/job-0", "spot-b");
        assert_eq!(rec.recovery_seconds, 14.0);
        assert_eq!(rec.infrastructure_seconds(), 11.5);
        assert_eq!(rec.from_node.as_deref(), Some("spot-a"));
        assert_eq!(rec.saved_at.as_second(), 1_700_000_090);
        // A resume that names no interruption, or has no first step yet: nothing to report.
        for nothing in [
            r#"{"step":0,"ts":1700000100.0,"rank":null,"world_size":null,"last_step":0,"last_ts":1700000100.0}"#,
            r#"{"step":0,"ts":1700000100.0,"rank":null,"world_size":null,"last_step":0,"last_ts":1700000100.0,"first_step_ts":1700000101.0}"#,
            &RECORD.replace(r#","first_step_ts":1700000104.0"#, ""),
        ] {
            assert_eq!(parse(nothing.as_bytes()).unwrap(), None, "{nothing}");
        }
    }

    #[test]
    fn anything_but_the_helpers_record_is_refused() {
        for bad in [
            RECORD.replace(r#""step":120,"ts""#, r#""step":-1,"ts""#),
            RECORD.replace(r#""step":120,"saved_ts""#, r#""step":119,"saved_ts""#),
            RECORD.replace(r#""saved_ts":1700000090.0"#, r#""saved_ts":1e300"#),
            RECORD.replace(
                r#""first_step_ts":1700000104.0"#,
                r#""first_step_ts":"soon""#,
            ),
            RECORD.replace(r#""restore_seconds":2.5"#, r#""restore_seconds":-1"#),
            RECORD.replace(r#""notice_id":"aws-1""#, r#""notice_id":"""#),
            RECORD.replace(r#""notice_id":"aws-1""#, r#""notice_id":"a\nb""#),
            RECORD.replace(r#""node":"spot-a""#, r#""node":5"#),
            RECORD.replace(r#""rank":0"#, r#""rank":0,"extra":1"#),
            format!(r#"{RECORD:.50}"#),
            "[]".into(),
            "not json".into(),
            RECORD.replace(
                r#""node":"spot-a""#,
                &format!(r#""node":"{}""#, "x".repeat(5000)),
            ),
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    /// Discovery that finds one host group: this test process, its checkpoint dir `dir`.
    struct Fixed(Vec<TargetGroup>);

    #[async_trait]
    impl TargetDiscovery for Fixed {
        async fn discover(&self) -> Result<Vec<TargetGroup>, crate::checkpoint::Error> {
            Ok(self.0.clone())
        }
    }

    fn discovery(dir: &Path) -> Fixed {
        let pid = std::process::id() as i32;
        let proc = ProcFs::new("/proc");
        Fixed(vec![TargetGroup {
            name: "cmdline:train".into(),
            pod: None,
            containers: vec![TargetContainer {
                name: "cmdline:train".into(),
                root_pid: None,
                init_pid: None,
                processes: vec![TargetProcess {
                    pid,
                    start_time: proc.start_time(pid).unwrap(),
                }],
            }],
            mode: TargetMode::Handlers,
            signal: Signal(libc::SIGUSR1),
            dir: dir.to_path_buf(),
            timeout: Duration::from_secs(5),
            proc_root: "/proc".into(),
        }])
    }

    fn sinks(log: &Path) -> (Sinks, Registry) {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let sinks = Sinks {
            metrics,
            node: None,
            node_name: "spot-b".into(),
            goodput_log: Some(log.to_path_buf()),
        };
        (sinks, registry)
    }

    fn refused(m: &Metrics) -> u64 {
        m.errors
            .get_or_create(&ModuleErrorLabels {
                module: "goodput".into(),
                error: "resume_record".into(),
            })
            .get()
    }

    fn log_recoveries(log: &Path) -> Vec<Recovery> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| match serde_json::from_str::<LogLine>(l) {
                Ok(LogLine::Recovery { recovery }) => Some(recovery),
                _ => None,
            })
            .collect()
    }

    fn own_record(dir: &Path) -> PathBuf {
        dir.join(resume_file_name(std::process::id() as i32))
    }

    /// The agent of the interrupted node recorded `notice` for `target` in `log`: signalled at
    /// 1700000080, RECORD's save 10 s later.
    fn recorded(log: &Path, notice: &str, target: &str) {
        let t0 = Timestamp::from_second(1_700_000_080).unwrap();
        super::super::report::append(
            log,
            &Interruption {
                notice_id: notice.into(),
                node: "spot-a".into(),
                signalled_at: Some(t0),
                done_at: t0 + Duration::from_secs(30),
                targets: vec![super::super::record::TargetBadput {
                    target: target.into(),
                    outcome: "acked".into(),
                    ..Default::default()
                }],
                ..Interruption::default()
            },
        )
        .unwrap();
    }

    fn refusals(m: &Metrics, label: &str) -> u64 {
        m.errors
            .get_or_create(&ModuleErrorLabels {
                module: "goodput".into(),
                error: label.into(),
            })
            .get()
    }

    #[tokio::test]
    async fn a_recovery_is_reported_once_even_across_a_restart() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, log) = (tmp.path().join("ckpt"), tmp.path().join("goodput.jsonl"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(own_record(&dir), RECORD).unwrap();
        recorded(&log, "aws-1", "cmdline:train");
        let d = discovery(&dir);
        let (s, _r) = sinks(&log);
        let mut w = Watch::start(s.clone()).await;
        w.pass(&d).await;
        w.pass(&d).await;
        assert_eq!(s.metrics.recoveries.get(), 1);
        let infra = s
            .metrics
            .badput_seconds
            .get_or_create(&CategoryLabels {
                category: category::INFRASTRUCTURE_RECOVERY.into(),
            })
            .get();
        assert_eq!(infra, 11.5);
        let lines = log_recoveries(&log);
        assert_eq!(lines.len(), 1);
        assert_eq!(
            (
                lines[0].notice_id.as_str(),
                lines[0].target.as_str(),
                lines[0].node.as_str()
            ),
            ("aws-1", "cmdline:train", "spot-b")
        );
        // A restarted agent reads the log back: nothing is reported again.
        let (s2, _r2) = sinks(&log);
        let mut w2 = Watch::start(s2.clone()).await;
        w2.pass(&d).await;
        assert_eq!(s2.metrics.recoveries.get(), 0);
        assert_eq!(log_recoveries(&log).len(), 1);
        // Another recorded notice for the same target is another recovery.
        recorded(&log, "aws-2", "cmdline:train");
        std::fs::write(own_record(&dir), RECORD.replace("aws-1", "aws-2")).unwrap();
        w2.pass(&d).await;
        assert_eq!(s2.metrics.recoveries.get(), 1);
        assert_eq!(log_recoveries(&log).len(), 2);
        assert_eq!(refused(&s2.metrics), 0);
    }

    /// Records the pod Events posted with a record.
    #[derive(Default)]
    struct Events(std::sync::Mutex<Vec<(String, String, String, EventRecord)>>);

    #[async_trait]
    impl NodeOps for Events {
        async fn protect(
            &self,
            _: &crate::node::Protection,
        ) -> Result<crate::node::Applied, crate::node::Error> {
            Ok(Default::default())
        }
        async fn unprotect(&self, _: &crate::node::Applied) -> Result<(), crate::node::Error> {
            Ok(())
        }
        async fn event(&self, _: EventType, _: &str, _: &str) -> Result<(), crate::node::Error> {
            Ok(())
        }
        async fn pod_event(
            &self,
            _: &PodRef,
            _: EventType,
            _: &str,
            _: &str,
        ) -> Result<(), crate::node::Error> {
            panic!("a goodput Event goes through pod_record_event")
        }
        async fn pod_record_event(
            &self,
            pod: &PodRef,
            _: EventType,
            reason: &str,
            message: &str,
            record: &str,
        ) -> Result<(), crate::node::Error> {
            self.0.lock().unwrap().push((
                format!("{}/{}", pod.namespace, pod.name),
                reason.to_string(),
                message.to_string(),
                serde_json::from_str(record).expect("the record's annotation parses back"),
            ));
            Ok(())
        }
        async fn drain(
            &self,
            _: &crate::node::DrainRequest,
        ) -> Result<crate::node::DrainReport, crate::node::Error> {
            Ok(Default::default())
        }
        async fn gpu_conditions(&self) -> Result<crate::node::GpuConditions, crate::node::Error> {
            Ok(Default::default())
        }
        async fn set_gpu_conditions(
            &self,
            _: &crate::node::GpuConditions,
        ) -> Result<(), crate::node::Error> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn the_resumed_pod_gets_one_event_with_the_record() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, log) = (tmp.path().join("ckpt"), tmp.path().join("goodput.jsonl"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(own_record(&dir), RECORD).unwrap();
        // The interrupted pod was another of the namespace (no cluster-wide record plugged in:
        // the agent's own log, by namespace).
        recorded(&log, "aws-1", "ml/job-old");
        let mut d = discovery(&dir);
        d.0[0].name = "ml/job-0".into();
        d.0[0].pod = Some(PodRef {
            namespace: "ml".into(),
            name: "job-0".into(),
            uid: "u-1".into(),
        });
        let events = Arc::new(Events::default());
        let (mut s, _r) = sinks(&log);
        s.node = Some(events.clone());
        let mut w = Watch::start(s).await;
        w.pass(&d).await;
        w.pass(&d).await;
        let posted = events.0.lock().unwrap().clone();
        let [(pod, reason, message, EventRecord::Recovery(r))] = posted.as_slice() else {
            panic!("one recovery Event expected: {posted:?}")
        };
        assert_eq!((pod.as_str(), reason.as_str()), ("ml/job-0", REASON));
        assert_eq!(
            (r.target.as_str(), r.notice_id.as_str()),
            ("ml/job-0", "aws-1")
        );
        assert_eq!(r.recovery_seconds, 14.0);
        assert!(
            message.contains("aws-1") && message.contains("spot-a"),
            "{message}"
        );
        assert_eq!(log_recoveries(&log), vec![r.clone()]);
    }

    #[tokio::test]
    async fn records_without_an_interruption_or_a_first_step_are_skipped() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, log) = (tmp.path().join("ckpt"), tmp.path().join("goodput.jsonl"));
        std::fs::create_dir(&dir).unwrap();
        recorded(&log, "aws-1", "cmdline:train");
        let d = discovery(&dir);
        let (s, _r) = sinks(&log);
        let mut w = Watch::start(s.clone()).await;
        for text in [
            r#"{"step":0,"ts":1700000100.0,"rank":null,"world_size":null,"last_step":0,"last_ts":1700000100.0,"first_step_ts":1700000101.0}"#.to_string(),
            RECORD.replace(r#","first_step_ts":1700000104.0"#, ""),
        ] {
            std::fs::write(own_record(&dir), &text).unwrap();
            w.pass(&d).await;
        }
        assert_eq!(s.metrics.recoveries.get(), 0);
        assert_eq!(refused(&s.metrics), 0);
        assert!(log_recoveries(&log).is_empty());
        // The same record once its first step is stamped: reported.
        std::fs::write(own_record(&dir), RECORD).unwrap();
        w.pass(&d).await;
        assert_eq!(s.metrics.recoveries.get(), 1);
    }

    #[tokio::test]
    async fn hostile_records_are_refused_and_counted_once_each() {
        let tmp = tempfile::tempdir().unwrap();
        let (dir, log) = (tmp.path().join("ckpt"), tmp.path().join("goodput.jsonl"));
        std::fs::create_dir(&dir).unwrap();
        let elsewhere = tmp.path().join("elsewhere.json");
        std::fs::write(&elsewhere, RECORD).unwrap();
        let path = own_record(&dir);
        recorded(&log, "aws-1", "cmdline:train");
        let d = discovery(&dir);
        let (s, _r) = sinks(&log);
        let mut w = Watch::start(s.clone()).await;
        type Plant = Box<dyn Fn(&Path)>;
        let target = elsewhere.clone();
        let mut plants: Vec<(&str, Plant)> = vec![
            (
                "symlink",
                Box::new(move |p| std::os::unix::fs::symlink(&target, p).unwrap()),
            ),
            (
                "hard link",
                Box::new({
                    let e = elsewhere.clone();
                    move |p| std::fs::hard_link(&e, p).unwrap()
                }),
            ),
            (
                "fifo",
                Box::new(|p| {
                    rustix::fs::mknodat(
                        rustix::fs::CWD,
                        p,
                        rustix::fs::FileType::Fifo,
                        rustix::fs::Mode::from_raw_mode(0o644),
                        0,
                    )
                    .unwrap()
                }),
            ),
            (
                "huge",
                Box::new(|p| {
                    std::fs::write(p, RECORD.replace("spot-a", &"a".repeat(200)).repeat(30))
                        .unwrap()
                }),
            ),
            (
                "bad json",
                Box::new(|p| std::fs::write(p, "{\"step\": 1,").unwrap()),
            ),
            (
                "world-writable",
                Box::new(|p| {
                    std::fs::write(p, RECORD).unwrap();
                    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o666)).unwrap();
                }),
            ),
        ];
        if rustix::process::geteuid().is_root() {
            plants.push((
                "another user's",
                Box::new(|p| {
                    std::fs::write(p, RECORD).unwrap();
                    std::os::unix::fs::chown(p, Some(4242), None).unwrap();
                }),
            ));
        }
        for (i, (what, plant)) in plants.iter().enumerate() {
            let _ = std::fs::remove_file(&path);
            plant(&path);
            w.pass(&d).await;
            w.pass(&d).await;
            assert_eq!(
                refused(&s.metrics),
                i as u64 + 1,
                "{what}: refused once, counted once"
            );
            assert_eq!(s.metrics.recoveries.get(), 0, "{what}");
        }
        assert!(log_recoveries(&log).is_empty());
        // The control: the helper's own record, plainly written, is taken.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, RECORD).unwrap();
        w.pass(&d).await;
        assert_eq!(s.metrics.recoveries.get(), 1);
    }

    #[tokio::test]
    async fn invented_notice_ids_report_nothing_and_are_logged_once() {
        // The attack as run: the record rewritten with a fresh notice id every pass, saved in
        // 2001, a restore of 9 999 999 s; and one with the real notice id but a save from
        // before the signal.
        let tmp = tempfile::tempdir().unwrap();
        let (dir, log) = (tmp.path().join("ckpt"), tmp.path().join("goodput.jsonl"));
        std::fs::create_dir(&dir).unwrap();
        recorded(&log, "aws-1", "cmdline:train");
        let before = std::fs::read(&log).unwrap();
        let d = discovery(&dir);
        let (s, _r) = sinks(&log);
        let mut w = Watch::start(s.clone()).await;
        for n in 0..20 {
            let forged = RECORD
                .replace("aws-1", &format!("forged-{n}"))
                .replace("1700000090.0", "1000000001.0")
                .replace(r#""restore_seconds":2.5"#, r#""restore_seconds":9999999"#);
            std::fs::write(own_record(&dir), forged).unwrap();
            w.pass(&d).await;
        }
        std::fs::write(
            own_record(&dir),
            RECORD.replace("1700000090.0", "1600000000.0"),
        )
        .unwrap();
        w.pass(&d).await;
        w.pass(&d).await;
        assert_eq!(s.metrics.recoveries.get(), 0);
        let infra = s
            .metrics
            .badput_seconds
            .get_or_create(&CategoryLabels {
                category: category::INFRASTRUCTURE_RECOVERY.into(),
            })
            .get();
        assert_eq!(infra, 0.0);
        // Counted once per target group and reason, not per record or pass.
        assert_eq!(refusals(&s.metrics, NOT_RECORDED), 1);
        assert_eq!(refusals(&s.metrics, INCONSISTENT), 1);
        // Nothing written: a refused record never reaches the goodput log.
        assert_eq!(std::fs::read(&log).unwrap(), before);
        // The memory of reported recoveries did not grow either.
        assert!(w.reported.keys.is_empty());
        // The real record is still taken.
        std::fs::write(own_record(&dir), RECORD).unwrap();
        w.pass(&d).await;
        assert_eq!(s.metrics.recoveries.get(), 1);
    }

    #[test]
    fn a_recovery_must_fit_its_recorded_interruption() {
        let r = parse(RECORD.as_bytes()).unwrap().unwrap();
        let t0 = Timestamp::from_second(1_700_000_080).unwrap();
        let rec = RecordedInterruption {
            notice_id: "aws-1".into(),
            node: "spot-a".into(),
            signalled_at: t0,
            done_at: t0 + Duration::from_secs(30),
        };
        let now = 1_700_000_200.0;
        assert_eq!(check(&r, Some(&rec), now), Ok(()));
        assert_eq!(check(&r, None, now).unwrap_err().label, NOT_RECORDED);
        let with = |f: &dyn Fn(&mut Resumed)| {
            let mut x = r.clone();
            f(&mut x);
            x
        };
        for (what, bad, at) in [
            (
                "saved before the signal",
                with(&|x| x.saved_ts = 1_000_000_001.0),
                now,
            ),
            (
                "first step before the save",
                with(&|x| x.first_step_ts = 1_700_000_085.0),
                now,
            ),
            (
                "restore longer than the recovery",
                with(&|x| x.restore_seconds = Some(9_999_999.0)),
                now,
            ),
            (
                "first step in the future",
                with(&|x| x.first_step_ts = now + 60.0),
                now,
            ),
            ("save in the future", r.clone(), 1_700_000_050.0),
        ] {
            assert_eq!(
                check(&bad, Some(&rec), at).unwrap_err().label,
                INCONSISTENT,
                "{what}"
            );
        }
    }

    #[test]
    fn the_reported_set_keeps_the_newest_keys_only() {
        let mut r = Reported::default();
        for n in 0..MAX_REPORTED + 100 {
            assert!(r.insert(("t".into(), format!("n{n}"))));
        }
        assert_eq!((r.keys.len(), r.order.len()), (MAX_REPORTED, MAX_REPORTED));
        assert!(!r.keys.contains(&("t".into(), "n0".into())));
        assert!(!r.insert(("t".into(), format!("n{}", MAX_REPORTED + 99))));
    }

    #[test]
    fn the_log_ledger_follows_the_log_and_matches_the_job() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("goodput.jsonl");
        let mut l = LogLedger::new(Some(log.clone()));
        l.refresh();
        let host = Job {
            target_group: "cmdline:train",
            pod: None,
        };
        assert_eq!(l.recorded(&host, "aws-1"), None);
        recorded(&log, "aws-1", "cmdline:train");
        recorded(&log, "aws-2", "ml/job-old");
        l.refresh();
        assert_eq!(l.recorded(&host, "aws-1").unwrap().node, "spot-a");
        // Another job's interruption is not this one's.
        let other = Job {
            target_group: "cmdline:other",
            pod: None,
        };
        assert_eq!(l.recorded(&other, "aws-1"), None);
        assert_eq!(l.recorded(&host, "aws-2"), None);
        let pod = PodRef {
            namespace: "ml".into(),
            name: "job-new".into(),
            uid: "u".into(),
        };
        let in_ml = Job {
            target_group: "ml/job-new",
            pod: Some(&pod),
        };
        assert!(l.recorded(&in_ml, "aws-2").is_some());
        assert_eq!(l.recorded(&in_ml, "aws-1"), None);
        let elsewhere = PodRef {
            namespace: "other".into(),
            ..pod.clone()
        };
        let other_ns = Job {
            target_group: "other/job-new",
            pod: Some(&elsewhere),
        };
        assert_eq!(l.recorded(&other_ns, "aws-2"), None);
    }
}
