//! The elastic drill's verdict: what each node did around the notice, the judgement (PASS only
//! with 0 steps lost and the other nodes training again before the interrupted node's deadline;
//! a FAIL names the cause), and its renderings (table, `--json`, `--junit`).
//!
//! Steps come from the helper's files: the step saved from the interrupted node's `done` acks;
//! each surviving node's resumed step and time from its first `resume-<pid>.json` written after
//! the notice. Steps lost = the highest step any rank reached before the survivors' last resume
//! (the saved step, or more when the job trained on and then restarted again; `last_step` of the
//! resume records) minus the step they last resumed from.

use std::path::PathBuf;
use std::time::Duration;

use jiff::Timestamp;
use serde_json::{json, Value};

use crate::checkpoint::Outcome;
use crate::drill::follow::PlanSeen;
use crate::drill::records::ResumeRow;
use crate::drill::repeat::RunVerdict;
use crate::drill::report::{exit_label, AckRow, ExitInfo, Table};
use crate::drill::wait::Handler;
use crate::notice::Cloud;

/// One node of the elastic job.
#[derive(Debug, Clone)]
pub struct NodeRun {
    pub index: u32,
    /// How the verdict names it: `node N`, or `host NAME` (`--node-env`).
    pub label: String,
    /// Its root process (and process group).
    pub pid: i32,
    pub dir: PathBuf,
    /// The first of its processes seen catching the signal, and when (after the drill started).
    pub handler: Option<(Handler, Duration)>,
    pub exit: Option<ExitInfo>,
    /// When the drill saw it exit on its own.
    pub exited_at: Option<Timestamp>,
    /// The drill stopped it at the end (it was still running, as a surviving node should be).
    pub stopped_by_drill: bool,
    /// Processes killed at the power-off (the interrupted node only).
    pub killed_at_power_off: usize,
    pub resumes: Vec<ResumeRow>,
}

impl NodeRun {
    pub fn new(index: u32, pid: i32, dir: PathBuf) -> Self {
        NodeRun {
            index,
            label: format!("node {index}"),
            pid,
            dir,
            handler: None,
            exit: None,
            exited_at: None,
            stopped_by_drill: false,
            killed_at_power_off: 0,
            resumes: Vec::new(),
        }
    }
}

/// A round of a survivor's workers after the notice, as its first resume record tells it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Round {
    /// The step resumed from.
    pub step: i64,
    /// When.
    pub at: Timestamp,
    pub world_size: Option<i64>,
}

impl Round {
    fn of(r: &ResumeRow) -> Round {
        Round {
            step: r.step,
            at: r.at,
            world_size: r.world_size,
        }
    }
}

/// A surviving node after the notice.
#[derive(Debug, Clone, PartialEq)]
pub struct Survivor {
    pub index: u32,
    pub label: String,
    /// Its first resume after the notice.
    pub first: Option<Round>,
    /// The first resume of its last generation after the notice (the round that stuck; the
    /// same as `first` when it restarted once).
    pub stuck: Option<Round>,
    /// How many times its workers (re)started after the notice (generations of resume records).
    pub resumes_after_notice: usize,
    /// The step of its last resume after the notice.
    pub last_step: Option<i64>,
}

/// Everything one elastic drill run observed, and the judgement.
#[derive(Debug, Clone)]
pub struct ElasticVerdict {
    pub pass: bool,
    pub reason: String,
    pub cloud: Cloud,
    pub command: String,
    /// The interrupted node (1-based).
    pub doomed: u32,
    pub nodes: Vec<NodeRun>,
    pub started_at: Timestamp,
    pub raised_at: Timestamp,
    /// What the plan against the interrupted node showed up to its checkpoint result (`error`:
    /// none came within the limit).
    pub plan: PlanSeen,
    /// The interrupted node's acks.
    pub acks: Vec<AckRow>,
    pub power_off_at: Option<Timestamp>,
    // Derived by `judge`.
    pub saved_step: Option<i64>,
    pub survivors: Vec<Survivor>,
    pub steps_lost: Option<i64>,
    /// From the notice to the last surviving node's resume in the round that stuck (the start
    /// of its last generation of workers).
    pub training_again: Option<Duration>,
    pub warnings: Vec<String>,
}

impl ElasticVerdict {
    pub fn started(
        cloud: Cloud,
        command: String,
        doomed: u32,
        started_at: Timestamp,
        raised_at: Timestamp,
    ) -> Self {
        ElasticVerdict {
            pass: false,
            reason: String::new(),
            cloud,
            command,
            doomed,
            nodes: Vec::new(),
            started_at,
            raised_at,
            plan: PlanSeen::default(),
            acks: Vec::new(),
            power_off_at: None,
            saved_step: None,
            survivors: Vec::new(),
            steps_lost: None,
            training_again: None,
            warnings: Vec::new(),
        }
    }

    fn doomed_node(&self) -> Option<&NodeRun> {
        self.nodes.iter().find(|n| n.index == self.doomed)
    }

    /// The interrupted node's name in the verdict.
    pub fn doomed_label(&self) -> String {
        self.doomed_node()
            .map(|n| n.label.clone())
            .unwrap_or_else(|| format!("node {}", self.doomed))
    }

    /// The deadline the survivors must beat: the notice's, else the power-off.
    fn must_train_by(&self) -> Option<Timestamp> {
        self.plan.deadline.or(self.power_off_at)
    }
}

impl RunVerdict for ElasticVerdict {
    fn passed(&self) -> bool {
        self.pass
    }

    fn reason(&self) -> &str {
        &self.reason
    }

    fn table(&self, _timeout: Duration) -> String {
        table(self)
    }

    fn to_json(&self, _timeout: Duration) -> Value {
        to_json(self)
    }

    fn junit_name(&self, n: usize) -> String {
        format!(
            "{} interruption of {} (elastic) #{n}: {}",
            self.cloud.as_str(),
            self.doomed_label(),
            self.command
        )
    }
}

fn secs(t: Timestamp, t0: Timestamp) -> f64 {
    t.duration_since(t0).as_secs_f64()
}

fn rel(t: Option<Timestamp>, t0: Timestamp) -> String {
    match t {
        Some(t) => {
            let s = secs(t, t0);
            if s < 0.0 {
                format!("-{:.1}s", -s).replace("-0.0s", "+0.0s")
            } else {
                format!("+{s:.1}s")
            }
        }
        None => "—".into(),
    }
}

/// Names `--max-restarts 0` (or `=0`) when the command says so.
fn max_restarts_zero(command: &str) -> bool {
    let words: Vec<&str> = command.split_whitespace().collect();
    words.iter().enumerate().any(|(i, w)| {
        let w = w.replace('_', "-");
        w == "--max-restarts=0" || (w == "--max-restarts" && words.get(i + 1) == Some(&"0"))
    })
}

fn through_launcher(command: &str) -> bool {
    command.contains("spotguard launch") || command.contains("-m spotguard")
}

/// Decide PASS/FAIL, fill the derived fields and say why.
pub fn judge(v: &mut ElasticVerdict, timeout: Duration, kill_after: Duration) {
    let t0 = v.raised_at;
    let signalled = v.plan.signalled_at.unwrap_or(t0);
    let done: Vec<i64> = v
        .acks
        .iter()
        .filter(|a| a.state == "done" && a.written.is_none_or(|w| w >= signalled))
        .filter_map(|a| a.step)
        .collect();
    v.saved_step = done.iter().copied().max();
    if done.iter().any(|s| Some(*s) != v.saved_step) {
        v.warnings.push(format!(
            "the interrupted node's ranks acked different steps ({done:?}): should_checkpoint() did not agree"
        ));
    }
    if let Some(n) = crate::drill::report::expected_per_node(&v.command) {
        if v.plan.signalled_at.is_some() && v.plan.processes < n {
            v.warnings.push(format!(
                "the launcher was asked for {n} processes per node but only {} caught the signal on {}",
                v.plan.processes, v.doomed_label()
            ));
        }
    }
    v.survivors = survivors(v);
    if let Some(lost) = steps_lost(v) {
        v.steps_lost = Some(lost);
    }
    if v.survivors.iter().all(|s| s.stuck.is_some()) && !v.survivors.is_empty() {
        v.training_again = v
            .survivors
            .iter()
            .filter_map(|s| s.stuck.map(|r| r.at))
            .max()
            .map(|at| Duration::from_secs_f64(secs(at, t0).max(0.0)));
    }

    let (pass, reason) = verdict(v, timeout, kill_after);
    v.pass = pass;
    v.reason = reason;
}

/// Each surviving node after the notice.
fn survivors(v: &ElasticVerdict) -> Vec<Survivor> {
    let t0 = v.raised_at;
    let doomed = v.doomed;
    v.nodes
        .iter()
        .filter(|n| n.index != doomed)
        .map(|n| {
            let after: Vec<&ResumeRow> = n.resumes.iter().filter(|r| r.at > t0).collect();
            Survivor {
                index: n.index,
                label: n.label.clone(),
                first: after.first().map(|r| Round::of(r)),
                stuck: last_generation(&after).map(Round::of),
                resumes_after_notice: generations(&after),
                last_step: after.last().map(|r| r.step),
            }
        })
        .collect()
}

/// Steps lost: the highest step reached before the survivors' last resume (the start of their
/// last generation of workers), minus the step it resumed from; known once they resumed and the
/// interrupted node saved a step.
fn steps_lost(v: &ElasticVerdict) -> Option<i64> {
    let t0 = v.raised_at;
    let doomed = v.doomed;
    let last_resume = v
        .nodes
        .iter()
        .filter(|n| n.index != doomed)
        .filter_map(|n| {
            let after: Vec<&ResumeRow> = n.resumes.iter().filter(|r| r.at > t0).collect();
            last_generation_start(&after)
        })
        .max();
    let (Some(last), Some(saved)) = (last_resume, v.saved_step) else {
        return None;
    };
    let reached = v
        .nodes
        .iter()
        .flat_map(|n| n.resumes.iter())
        .filter(|r| r.at < last)
        .map(|r| r.last_step)
        .max()
        .unwrap_or(saved)
        .max(saved);
    let resumed = v
        .survivors
        .iter()
        .filter_map(|s| s.last_step)
        .min()
        .unwrap_or(saved);
    Some((reached - resumed).max(0))
}

/// Resume records of one node (oldest first) come one per worker and round; a generation is
/// one round's workers. A record starts a new generation when its rank was already seen in the
/// current one or its world size differs (a round that did not stick, e.g. one that still
/// counted a leaving node, and the round after it, come within a second or two); a record
/// without a rank, when it comes more than 5 s after the first of the current generation. The
/// first record of each generation, oldest first.
fn generation_starts<'a>(rows: &[&'a ResumeRow]) -> Vec<&'a ResumeRow> {
    let mut starts: Vec<&ResumeRow> = Vec::new();
    let mut ranks: Vec<i64> = Vec::new();
    for r in rows {
        let new = match (starts.last(), r.rank) {
            (None, _) => true,
            (Some(first), Some(rank)) => {
                ranks.contains(&rank)
                    || matches!((first.world_size, r.world_size), (Some(a), Some(b)) if a != b)
            }
            (Some(first), None) => secs(r.at, first.at) > 5.0,
        };
        if new {
            starts.push(r);
            ranks.clear();
        }
        ranks.extend(r.rank);
    }
    starts
}

fn generations(rows: &[&ResumeRow]) -> usize {
    generation_starts(rows).len()
}

fn last_generation<'a>(rows: &[&'a ResumeRow]) -> Option<&'a ResumeRow> {
    generation_starts(rows).last().copied()
}

fn last_generation_start(rows: &[&ResumeRow]) -> Option<Timestamp> {
    last_generation(rows).map(|r| r.at)
}

fn verdict(v: &ElasticVerdict, timeout: Duration, kill_after: Duration) -> (bool, String) {
    match checks(v, timeout, kill_after) {
        Ok(reason) => (true, reason),
        Err(reason) => (false, reason),
    }
}

/// The verdict's checks in order: the first that fails says why (`Err`); else why it passed.
fn checks(v: &ElasticVerdict, timeout: Duration, kill_after: Duration) -> Result<String, String> {
    let doomed = v.doomed_label();
    if let Some(e) = &v.plan.error {
        return Err(e.clone());
    }
    checkpointed(v, &doomed, timeout)?;
    let Some(saved) = v.saved_step else {
        return Err(format!("{doomed} acked without a step: pass step= to spotguard.ack(\"done\", step=…) so that the drill can count steps"));
    };
    left(v, &doomed, saved, kill_after)?;
    survivors_resumed(v)?;
    no_steps_lost(v, &doomed, saved)?;
    let again = v.training_again.unwrap_or_default();
    in_time(v, &doomed, again)?;
    Ok(passed(v, &doomed, saved, again))
}

/// The interrupted node's own checkpoint.
fn checkpointed(v: &ElasticVerdict, doomed: &str, timeout: Duration) -> Result<(), String> {
    let bad = v
        .plan
        .results
        .iter()
        .find(|r| !matches!(r.outcome, Outcome::Acked | Outcome::Exited));
    if v.plan.results.is_empty() {
        return Err(format!(
            "no process of {doomed} was found to signal (did it start?)"
        ));
    }
    if let Some(r) = bad {
        let why = match r.outcome {
            Outcome::NoHandler => format!("no process of {doomed} caught the signal: install a handler (spotguard.install()) in every worker"),
            Outcome::Timeout => format!(
                "{doomed} did not ack within the checkpoint budget (min(--timeout {}, deadline − drain reserve))",
                crate::duration::display(timeout)
            ),
            Outcome::Skipped => format!("{doomed} acked `skipped`: it judged the save would not fit"),
            _ => format!("{doomed}'s checkpoint step ended in `{}` ({})", r.outcome.as_str(), r.detail),
        };
        return Err(why);
    }
    Ok(())
}

/// The interrupted node must leave: no worker of it may start again after the notice, and none
/// may still run at the power-off.
fn left(v: &ElasticVerdict, doomed: &str, saved: i64, kill_after: Duration) -> Result<(), String> {
    let t0 = v.raised_at;
    let launcher = if through_launcher(&v.command) {
        ""
    } else {
        " Start torchrun through `python3 -m spotguard launch -- torchrun …`: at the notice it stops the node's agent, which then leaves instead of restarting its workers."
    };
    let Some(node) = v.doomed_node() else {
        return Ok(());
    };
    if let Some(r) = node.resumes.iter().find(|r| r.at > t0) {
        return Err(format!(
            "torchrun restarted the workers on the preempted node: {doomed} saved step {saved} and then resumed from step {} {} after the notice, rejoining the job it should have left (each such restart also uses one of its --max-restarts).{launcher}",
            r.step,
            rel(Some(r.at), t0)
        ));
    }
    if node.killed_at_power_off > 0 {
        return Err(format!(
            "{doomed} was still running at its power-off ({} process(es) killed {} after the notice): its agent did not leave the job after the checkpoint.{launcher}",
            node.killed_at_power_off,
            crate::duration::display(kill_after)
        ));
    }
    Ok(())
}

/// Every surviving node resumed after the notice (and the command writes resume records at all).
fn survivors_resumed(v: &ElasticVerdict) -> Result<(), String> {
    let t0 = v.raised_at;
    if v.survivors.iter().all(|s| s.first.is_none()) && v.nodes.iter().all(|n| n.resumes.is_empty())
    {
        return Err(
            "the command writes no resume record: call spotguard.resumed(step) once the checkpoint is loaded, right before the loop (the drill learns each node's resumed step from it)".into(),
        );
    }
    let Some(s) = v.survivors.iter().find(|s| s.first.is_none()) else {
        return Ok(());
    };
    let node = v.nodes.iter().find(|n| n.index == s.index);
    let cause = match node.and_then(|n| n.exit.as_ref().filter(|_| !n.stopped_by_drill)) {
        Some(e) if max_restarts_zero(&v.command) && !through_launcher(&v.command) => format!(
            "its torchrun exited ({}) instead of restarting its workers: --max-restarts 0, and a preemption costs every surviving node one restart (start it through `python3 -m spotguard launch`, which adds an allowance for preemptions)",
            exit_label(e)
        ),
        Some(e) => format!(
            "its launcher exited ({}) {} after the notice: torchrun stops when --max-restarts is used up (each preemption costs every surviving node one restart), or when the rendezvous was closed (a node's torchrun that ran out of restarts closes it for everyone)",
            exit_label(e),
            rel(node.and_then(|n| n.exited_at), t0)
        ),
        None => "it kept running without starting its workers again: stuck in the rendezvous (waiting for the preempted node's entry to expire?) or still training with the old group".to_string(),
    };
    Err(format!(
        "a survivor did not resume: {} never resumed after the notice — {cause}",
        s.label
    ))
}

/// No step was lost, and if some were, why.
fn no_steps_lost(v: &ElasticVerdict, doomed: &str, saved: i64) -> Result<(), String> {
    let lost = v.steps_lost.unwrap_or(0);
    if lost <= 0 {
        return Ok(());
    }
    let resumed = v
        .survivors
        .iter()
        .filter_map(|s| s.last_step)
        .min()
        .unwrap_or(0);
    let again = v.survivors.iter().any(|s| s.resumes_after_notice > 1);
    let why = if again {
        " — they restarted more than once after the notice: they trained on with a group that still held the preempted node, and lost that work when it went away"
    } else if resumed < saved {
        " — they resumed from an older checkpoint than the one just saved (is --ckpt-dir shared by every node?)"
    } else {
        ""
    };
    Err(format!("{lost} step(s) lost: {doomed} saved step {saved}, the other nodes last resumed from step {resumed}{why}"))
}

/// The survivors trained again before the interrupted node's deadline (`again` after the notice).
fn in_time(v: &ElasticVerdict, doomed: &str, again: Duration) -> Result<(), String> {
    let t0 = v.raised_at;
    let Some(by) = v.must_train_by() else {
        return Ok(());
    };
    let last = v
        .survivors
        .iter()
        .filter_map(|s| s.stuck.map(|r| r.at))
        .max();
    match last {
        Some(last) if last > by => Err(format!(
            "the other nodes trained again only {:.1}s after the notice, after {doomed}'s deadline ({}): the rendezvous kept them waiting (torchrun's last_call_timeout, 30 s by default; or the preempted node's entry until its heartbeats expired)",
            again.as_secs_f64(),
            rel(Some(by), t0)
        )),
        _ => Ok(()),
    }
}

/// Why the run passed.
fn passed(v: &ElasticVerdict, doomed: &str, saved: i64, again: Duration) -> String {
    let resumed = v
        .survivors
        .iter()
        .filter_map(|s| s.stuck.map(|r| r.step))
        .min()
        .unwrap_or(saved);
    let kept = if resumed > saved {
        " (they trained on past it and kept their state: a graceful removal needs no rollback)"
    } else {
        ""
    };
    format!(
        "0 steps lost: {doomed} saved step {saved} and left; {} resumed from step {resumed}{kept} and trained again {:.1}s after the notice, before its deadline",
        v.survivors
            .iter()
            .map(|s| s.label.clone())
            .collect::<Vec<_>>()
            .join(", "),
        again.as_secs_f64()
    )
}

/// The verdict table.
pub fn table(v: &ElasticVerdict) -> String {
    // Node labels (`HOROVOD_HOSTNAME=localhost`) may be longer than the step names.
    let w = v
        .nodes
        .iter()
        .map(|n| n.label.chars().count())
        .max()
        .unwrap_or(0)
        .max(20);
    let mut t = Table::new(w);
    node_rows(&mut t, v);
    notice_rows(&mut t, v);
    node_left_row(&mut t, v);
    survivor_rows(&mut t, v);
    outcome_rows(&mut t, v);
    for w in &v.warnings {
        t.row("warning", "", w);
    }
    t.finish(v.pass, &v.reason)
}

/// Each node before the notice: training (its last resume) or its handler.
fn node_rows(t: &mut Table, v: &ElasticVerdict) {
    for n in &v.nodes {
        let first = n.resumes.iter().rfind(|r| r.at <= v.raised_at);
        let detail = match (first, &n.handler) {
            (Some(r), _) => format!(
                "pid {}: training before the notice (resumed from step {}, world size {})",
                n.pid,
                r.step,
                r.world_size
                    .map(|w| w.to_string())
                    .unwrap_or_else(|| "?".into())
            ),
            (None, Some((h, _))) => format!("pid {}: pid {} catches the signal", n.pid, h.pid),
            (None, None) => format!("pid {}: no process caught the signal", n.pid),
        };
        t.row(&n.label, "", &detail);
    }
}

/// The notice raised, the signal sent, the step saved.
fn notice_rows(t: &mut Table, v: &ElasticVerdict) {
    let t0 = v.raised_at;
    t.row(
        "notice raised",
        "+0.0s",
        &format!(
            "{} interruption of {}, deadline {}",
            v.cloud.as_str(),
            v.doomed_label(),
            rel(v.plan.deadline, t0)
        ),
    );
    t.row(
        "signal sent",
        &rel(v.plan.signalled_at, t0),
        &format!(
            "SIGUSR1 to {} process(es) of {}",
            v.plan.processes,
            v.doomed_label()
        ),
    );
    let done: Vec<&AckRow> = v.acks.iter().filter(|a| a.state == "done").collect();
    t.row(
        "step saved",
        &rel(done.iter().filter_map(|a| a.written).max(), t0),
        &match v.saved_step {
            Some(s) => format!(
                "step {s}: {} `done` ack(s) on {} ({})",
                done.len(),
                v.doomed_label(),
                done.iter()
                    .map(|a| a.file.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => format!("no `done` ack with a step on {}", v.doomed_label()),
        },
    );
}

/// How the interrupted node left (or did not).
fn node_left_row(t: &mut Table, v: &ElasticVerdict) {
    let Some(n) = v.doomed_node() else {
        return;
    };
    let detail = match (&n.exit, n.killed_at_power_off) {
        (_, k) if k > 0 => format!(
            "{}: still running at the power-off, {k} process(es) killed",
            n.label
        ),
        (Some(e), _) if !n.stopped_by_drill => {
            format!("{}: exited {} ({})", n.label, e.code, exit_label(e))
        }
        _ if n.exited_at.is_some() => format!("{}: its processes exited", n.label),
        _ => format!("{}: did not exit", n.label),
    };
    let when = if n.killed_at_power_off > 0 {
        rel(v.power_off_at, v.raised_at)
    } else {
        rel(n.exited_at, v.raised_at)
    };
    t.row("node left", &when, &detail);
}

/// Each surviving node's resume after the notice: the round that stuck (its last generation),
/// and the earlier ones when it restarted more than once.
fn survivor_rows(t: &mut Table, v: &ElasticVerdict) {
    for s in &v.survivors {
        let (time, detail) = match (s.stuck, s.first) {
            (Some(stuck), Some(first)) => (
                rel(Some(stuck.at), v.raised_at),
                format!(
                    "{}: resumed from step {} (world size {}){}",
                    s.label,
                    stuck.step,
                    world_size(stuck.world_size),
                    if s.resumes_after_notice > 1 {
                        format!(
                            " in the last of {} rounds after the notice (the first at {}, world size {})",
                            s.resumes_after_notice,
                            rel(Some(first.at), v.raised_at),
                            world_size(first.world_size)
                        )
                    } else {
                        String::new()
                    }
                ),
            ),
            _ => ("—".into(), format!("{}: did not resume", s.label)),
        };
        t.row("survivors resumed", &time, &detail);
    }
}

fn world_size(w: Option<i64>) -> String {
    w.map(|w| w.to_string()).unwrap_or_else(|| "?".into())
}

/// Steps lost, training again, the power-off.
fn outcome_rows(t: &mut Table, v: &ElasticVerdict) {
    let t0 = v.raised_at;
    t.row(
        "steps lost",
        &v.steps_lost
            .map(|l| l.to_string())
            .unwrap_or_else(|| "?".into()),
        "highest step reached before the survivors' last resume − the step they resumed from",
    );
    t.row(
        "training again",
        &v.training_again
            .map(|d| format!("{:.1}s", d.as_secs_f64()))
            .unwrap_or_else(|| "—".into()),
        &format!(
            "from the notice to the last surviving node's resume in the round that stuck; deadline {}",
            rel(v.must_train_by(), t0)
        ),
    );
    if let Some(p) = v.power_off_at {
        t.row(
            "power-off",
            &rel(Some(p), t0),
            &format!("{}'s processes killed (SIGKILL)", v.doomed_label()),
        );
    }
}

/// One run as JSON (`--json`).
pub fn to_json(v: &ElasticVerdict) -> Value {
    let t0 = v.raised_at;
    let s = |t: Option<Timestamp>| t.map(|t| secs(t, t0));
    json!({
        "elastic": true,
        "pass": v.pass,
        "reason": v.reason,
        "cloud": v.cloud.as_str(),
        "command": v.command,
        "interrupted_node": v.doomed,
        "notice_raised_unix": v.raised_at.as_millisecond() as f64 / 1000.0,
        "nodes_started_s": secs(v.started_at, t0),
        "signal_sent_s": s(v.plan.signalled_at),
        "processes_signalled": v.plan.processes,
        "deadline_s": s(v.plan.deadline),
        "result_s": s(v.plan.result_at),
        "power_off_s": s(v.power_off_at),
        "step_saved": v.saved_step,
        "steps_lost": v.steps_lost,
        "training_again_s": v.training_again.map(|d| d.as_secs_f64()),
        "warnings": v.warnings,
        "survivors": v.survivors.iter().map(|x| json!({
            "node": x.index,
            "label": x.label,
            "resumed_step": x.stuck.map(|r| r.step),
            "resumed_s": x.stuck.map(|r| secs(r.at, t0)),
            "world_size": x.stuck.and_then(|r| r.world_size),
            "first_resumed_step": x.first.map(|r| r.step),
            "first_resumed_s": x.first.map(|r| secs(r.at, t0)),
            "resumes_after_notice": x.resumes_after_notice,
            "last_resumed_step": x.last_step,
        })).collect::<Vec<_>>(),
        "nodes": v.nodes.iter().map(|n| json!({
            "node": n.index,
            "label": n.label,
            "pid": n.pid,
            "notice_dir": n.dir.display().to_string(),
            "exit": n.exit.as_ref().map(|e| json!({"code": e.code, "signal": e.signal, "label": exit_label(e)})),
            "exited_s": s(n.exited_at),
            "stopped_by_drill": n.stopped_by_drill,
            "killed_at_power_off": n.killed_at_power_off,
            "resumes": n.resumes.iter().map(|r| json!({
                "pid": r.pid, "step": r.step, "at_s": secs(r.at, t0), "rank": r.rank,
                "world_size": r.world_size, "last_step": r.last_step,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "acks": v.acks.iter().map(|a| json!({
            "file": a.file, "state": a.state, "step": a.step, "checkpoint": a.checkpoint,
            "written_s": s(a.written),
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::run::GroupResult;

    fn ts(s: f64) -> Timestamp {
        Timestamp::from_millisecond((1_000_000.0 + s * 1000.0) as i64).unwrap()
    }

    /// A record without rank (generations by time: 5 s apart).
    fn resume(pid: i64, step: i64, at: f64, last: i64) -> ResumeRow {
        ResumeRow {
            pid,
            step,
            at: ts(at),
            rank: None,
            world_size: Some(2),
            last_step: last,
            node: None,
        }
    }

    /// A worker's record with its rank and world size.
    fn ranked(pid: i64, rank: i64, world: i64, step: i64, at: f64) -> ResumeRow {
        ResumeRow {
            rank: Some(rank),
            world_size: Some(world),
            ..resume(pid, step, at, step)
        }
    }

    fn ack(step: i64, at: f64) -> AckRow {
        AckRow {
            file: format!("ack-{step}.json"),
            state: "done".into(),
            step: Some(step),
            checkpoint: None,
            staged: None,
            written: Some(ts(at)),
        }
    }

    fn base(command: &str) -> ElasticVerdict {
        let mut v = ElasticVerdict::started(Cloud::Gce, command.into(), 2, ts(-20.0), ts(0.0));
        v.plan.signalled_at = Some(ts(1.0));
        v.plan.deadline = Some(ts(30.0));
        v.power_off_at = Some(ts(30.0));
        v.plan.processes = 2;
        v.plan.results = vec![GroupResult {
            group: "host".into(),
            pod: None,
            outcome: Outcome::Acked,
            signalled: 2,
            signalled_at: Some(ts(1.0)),
            ack_latency: None,
            detail: String::new(),
            exits: Vec::new(),
        }];
        v.acks = vec![ack(59, 1.5), ack(59, 1.6)];
        let mut n1 = NodeRun::new(1, 100, "/n1".into());
        n1.resumes = vec![resume(11, 0, -15.0, 59)];
        n1.stopped_by_drill = true;
        let mut n2 = NodeRun::new(2, 200, "/n2".into());
        n2.resumes = vec![resume(21, 0, -15.0, 59)];
        v.nodes = vec![n1, n2];
        v
    }

    /// The interrupted node (the second) exits 143 at `at` seconds after the notice.
    fn left_with_143(v: &mut ElasticVerdict, at: f64) {
        v.nodes[1].exit = Some(ExitInfo {
            code: 143,
            signal: None,
            killed_by_drill: false,
        });
        v.nodes[1].exited_at = Some(ts(at));
    }

    const LAUNCHED: &str =
        "python3 -m spotguard launch -- torchrun --nnodes=1:2 --nproc-per-node=2 train.py";

    #[test]
    fn a_clean_leave_passes_with_zero_steps_lost() {
        let mut v = base(LAUNCHED);
        v.nodes[0].resumes.push(resume(12, 59, 6.0, 120));
        v.nodes[0].resumes.push(resume(13, 59, 6.1, 118));
        left_with_143(&mut v, 2.5);
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(v.pass, "{}", v.reason);
        assert_eq!(v.saved_step, Some(59));
        assert_eq!(v.steps_lost, Some(0));
        assert_eq!(v.training_again, Some(Duration::from_secs_f64(6.0)));
        let t = table(&v);
        for want in [
            "step saved",
            "node left",
            "survivors resumed",
            "steps lost           0",
            "training again       6.0s",
        ] {
            assert!(t.contains(want), "{want}:\n{t}");
        }
        assert_eq!(to_json(&v)["survivors"][0]["resumed_step"], 59);
    }

    #[test]
    fn training_again_counts_from_the_round_that_stuck_not_a_transient_one() {
        // The survivor's first round after the notice still counted the leaving node (world 4)
        // and broke up within a second; the next (world 2, the same ranks again) stuck. Both are
        // within 5 s: told apart by the ranks and the world size.
        let mut v = base(LAUNCHED);
        v.nodes[0].resumes = vec![ranked(11, 0, 4, 0, -15.0), ranked(12, 1, 4, 0, -14.9)];
        v.nodes[0].resumes.extend([
            ranked(13, 0, 4, 59, 0.2),
            ranked(14, 1, 4, 59, 0.25),
            ranked(15, 1, 2, 59, 2.6),
            ranked(16, 0, 2, 59, 2.7),
        ]);
        left_with_143(&mut v, 2.5);
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(v.pass, "{}", v.reason);
        assert_eq!(v.steps_lost, Some(0));
        assert_eq!(v.survivors[0].resumes_after_notice, 2);
        assert_eq!(v.training_again, Some(Duration::from_secs_f64(2.6)));
        assert_eq!(to_json(&v)["survivors"][0]["resumed_s"].as_f64(), Some(2.6));
        assert_eq!(
            to_json(&v)["survivors"][0]["first_resumed_s"].as_f64(),
            Some(0.2)
        );
        assert!(
            v.reason.contains("trained again 2.6s after the notice"),
            "{}",
            v.reason
        );

        // One round whose second worker came 6 s after the first (a loaded machine): one
        // generation, training again from its first record.
        let mut v = base(LAUNCHED);
        v.nodes[0].resumes = vec![ranked(13, 0, 2, 59, 1.0), ranked(14, 1, 2, 59, 7.0)];
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert_eq!(v.survivors[0].resumes_after_notice, 1);
        assert_eq!(v.training_again, Some(Duration::from_secs_f64(1.0)));
    }

    #[test]
    fn the_preempted_node_restarting_names_torchrun_and_counts_the_lost_steps() {
        // The run: node 2 rejoined, both trained to ~1100, the power-off made node 1
        // restart from 59 again.
        let mut v = base("torchrun --nnodes=1:2 --max-restarts=3 train.py");
        v.nodes[0].resumes.push(resume(12, 59, 4.0, 1100));
        v.nodes[0].resumes.push(resume(13, 59, 33.0, 70));
        v.nodes[1].resumes.push(resume(22, 59, 4.0, 1100));
        v.nodes[1].killed_at_power_off = 3;
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(!v.pass);
        assert!(
            v.reason
                .starts_with("torchrun restarted the workers on the preempted node"),
            "{}",
            v.reason
        );
        assert!(v.reason.contains("spotguard launch"), "{}", v.reason);
        assert_eq!(v.steps_lost, Some(1041));
        assert_eq!(v.survivors[0].resumes_after_notice, 2);
    }

    #[test]
    fn a_survivor_that_ran_out_of_restarts_names_max_restarts() {
        let mut v = base("torchrun --nnodes=1:2 --max-restarts=0 train.py");
        v.nodes[0].stopped_by_drill = false;
        v.nodes[0].exit = Some(ExitInfo {
            code: 1,
            signal: None,
            killed_by_drill: false,
        });
        v.nodes[0].exited_at = Some(ts(3.0));
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(!v.pass);
        assert!(
            v.reason.contains("a survivor did not resume: node 1"),
            "{}",
            v.reason
        );
        assert!(v.reason.contains("--max-restarts 0"), "{}", v.reason);
    }

    #[test]
    fn resuming_after_the_deadline_fails_and_an_older_step_counts_as_lost() {
        let mut v = base(LAUNCHED);
        v.nodes[0].resumes.push(resume(12, 59, 40.0, 60));
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(!v.pass);
        assert!(v.reason.contains("after node 2's deadline"), "{}", v.reason);

        let mut v = base(LAUNCHED);
        v.nodes[0].resumes.push(resume(12, 40, 5.0, 60));
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(!v.pass);
        assert_eq!(v.steps_lost, Some(19));
        assert!(v.reason.contains("older checkpoint"), "{}", v.reason);
    }

    #[test]
    fn no_resume_record_says_how_to_write_one() {
        let mut v = base(LAUNCHED);
        for n in v.nodes.iter_mut() {
            n.resumes.clear();
        }
        judge(&mut v, Duration::from_secs(90), Duration::from_secs(30));
        assert!(!v.pass);
        assert!(v.reason.contains("spotguard.resumed(step)"), "{}", v.reason);
    }
}
