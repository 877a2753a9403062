//! The drill's verdict: what happened (one `Verdict` per run), the judgement (PASS/FAIL and why),
//! and its three renderings: the table on stdout, `--json` and `--junit FILE`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use jiff::Timestamp;
use serde_json::{json, Value};

use super::follow::PlanSeen;
use super::repeat::{Run, RunVerdict};
use super::wait::HandlerWait;
use crate::checkpoint::Outcome;
use crate::notice::Cloud;

/// How the command ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    /// The shell-style code: the exit code, or 128 + N when killed by signal N.
    pub code: i32,
    /// The signal that killed it, if it was killed.
    pub signal: Option<i32>,
    /// The drill stopped it (SIGTERM, then SIGKILL) because it was still running after its
    /// checkpoint result.
    pub killed_by_drill: bool,
}

/// One `ack-<pid>.json` (or the plain `ack`) found in the checkpoint dir after the run.
#[derive(Debug, Clone, PartialEq)]
pub struct AckRow {
    /// `ack-<pid>.json`, or `ack`.
    pub file: String,
    pub state: String,
    pub step: Option<i64>,
    pub checkpoint: Option<String>,
    /// The staged directory a staged `done` ack hands to the agent.
    pub staged: Option<String>,
    /// The ack's own `ts` (the writer's clock).
    pub written: Option<Timestamp>,
}

/// Everything one drill run observed.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub pass: bool,
    pub reason: String,
    pub cloud: Cloud,
    pub command: String,
    /// The notice/ack directory (`SPOTGUARD_DIR`).
    pub notice_dir: PathBuf,
    pub handler: HandlerWait,
    /// The handler's process had exited when the notice was raised: the command's training ended
    /// before the notice.
    pub handler_gone: bool,
    pub started_at: Timestamp,
    pub raised_at: Option<Timestamp>,
    /// What the plan showed up to its checkpoint result; its `error` is why the run could not
    /// reach one.
    pub plan: PlanSeen,
    pub acks: Vec<AckRow>,
    pub exit: Option<ExitInfo>,
    /// When the drill sent its clean-up SIGTERM (the command outlived its result).
    pub drill_terminated_at: Option<Timestamp>,
    /// When the command was seen to exit on its own.
    pub exited_at: Option<Timestamp>,
    /// With --upload-to: the staged checkpoint's upload.
    pub upload: Option<UploadRow>,
}

/// What became of a staged checkpoint (`--upload-to`).
#[derive(Debug, Clone)]
pub enum UploadRow {
    /// The agent's report of the upload.
    Ended(Box<crate::upload::Report>),
    /// No upload ended: why.
    None(String),
}

impl Verdict {
    /// The trainer's downtime: the signal to the command's own exit.
    pub fn downtime(&self) -> Option<Duration> {
        match (self.plan.signalled_at, self.exited_at) {
            (Some(s), Some(e)) => Some(crate::duration::until(e, s)),
            _ => None,
        }
    }
}

impl RunVerdict for Verdict {
    fn passed(&self) -> bool {
        self.pass
    }

    fn reason(&self) -> &str {
        &self.reason
    }

    fn table(&self, timeout: Duration) -> String {
        table(self, timeout, super::SIGNAL_NAME)
    }

    fn to_json(&self, timeout: Duration) -> Value {
        to_json(self, timeout, super::SIGNAL_NAME)
    }

    fn junit_name(&self, n: usize) -> String {
        format!(
            "{} interruption #{n}: {}",
            self.cloud.as_str(),
            self.command
        )
    }
}

impl Verdict {
    /// A run that has started its command and observed nothing else yet (not passed).
    pub fn started(
        cloud: Cloud,
        command: String,
        notice_dir: PathBuf,
        handler: HandlerWait,
        started_at: Timestamp,
    ) -> Self {
        Verdict {
            pass: false,
            reason: String::new(),
            cloud,
            command,
            notice_dir,
            handler,
            handler_gone: false,
            started_at,
            raised_at: None,
            plan: PlanSeen::default(),
            acks: Vec::new(),
            exit: None,
            drill_terminated_at: None,
            exited_at: None,
            upload: None,
        }
    }
}

/// How an ack relates to the run's timeline.
fn ack_note(v: &Verdict, a: &AckRow) -> Option<String> {
    let t = a.written?;
    if let Some(s) = v.plan.signalled_at {
        if t < s {
            return Some("before the signal: an earlier run's".into());
        }
    }
    let mut notes = Vec::new();
    if v.plan.checkpoint_deadline.is_some_and(|cd| t > cd) {
        notes.push("late: after the budget");
    }
    if v.drill_terminated_at.is_some_and(|k| t >= k) {
        notes.push("after the drill's clean-up SIGTERM");
    }
    (!notes.is_empty()).then(|| notes.join("; "))
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGUSR1 => "SIGUSR1".into(),
        libc::SIGUSR2 => "SIGUSR2".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGABRT => "SIGABRT".into(),
        n => format!("signal {n}"),
    }
}

/// The command-exit row's label.
pub fn exit_label(e: &ExitInfo) -> String {
    if e.killed_by_drill {
        return match e.signal {
            Some(s) => format!(
                "killed by the drill ({}): still running when the drill ended",
                signal_name(s)
            ),
            None => format!(
                "exited {} on the drill's SIGTERM: still running when the drill ended",
                e.code
            ),
        };
    }
    if let Some(s) = e.signal {
        return format!("killed by {}", signal_name(s));
    }
    match e.code {
        143 => "143 = 128 + SIGTERM: retryable (Kubeflow ExitCode policy, Job podFailurePolicy rule)".into(),
        0 => "0 = success: a Job counts the preempted run as complete and never resumes it".into(),
        1..=127 => format!("{} = permanent failure for Kubeflow's ExitCode policy and a podFailurePolicy FailJob rule", e.code),
        c => format!("{c}: retryable for Kubeflow's ExitCode policy; a podFailurePolicy must list it (the documented rule lists 143)"),
    }
}

fn waited(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

/// How many processes the command's launcher says it starts (`torchrun --nproc-per-node N`,
/// `accelerate launch --num_processes N`, `horovodrun -np N`), if it says.
pub fn expected_processes(command: &str) -> Option<usize> {
    flag_count(
        command,
        &[
            "--nproc-per-node",
            "--nproc_per_node",
            "--num_processes",
            "--num-processes",
            "-np",
            "--num-proc",
        ],
    )
}

/// How many processes per node the command's launcher starts (`torchrun --nproc-per-node N`).
pub fn expected_per_node(command: &str) -> Option<usize> {
    flag_count(command, &["--nproc-per-node", "--nproc_per_node"])
}

fn flag_count(command: &str, flags: &[&str]) -> Option<usize> {
    let words: Vec<&str> = command.split_whitespace().collect();
    for (i, w) in words.iter().enumerate() {
        let (name, value) = match w.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (*w, words.get(i + 1).copied()),
        };
        if flags.contains(&name) {
            if let Some(n) = value.and_then(|v| v.parse::<usize>().ok()) {
                return Some(n);
            }
        }
    }
    None
}

/// Warnings that do not fail the run by themselves.
pub fn warnings(v: &Verdict) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(n) = expected_processes(&v.command) {
        if v.plan.signalled_at.is_some() && v.plan.processes < n {
            out.push(format!(
                "the launcher was asked for {n} processes but only {} caught the signal: the others never started or never called spotguard.install() (`accelerate launch --cpu` runs one process whatever --num_processes says; on CPU use `accelerate launch --multi_gpu --num_processes N` with Accelerator(cpu=True))",
                v.plan.processes
            ));
        }
    }
    out
}

/// Decide PASS/FAIL and say why.
pub fn judge(v: &mut Verdict, signal: &str, timeout: Duration) {
    if let Some(e) = &v.plan.error {
        v.pass = false;
        v.reason = e.clone();
        return;
    }
    let (pass, reason) = outcome_verdict(v, signal, timeout);
    let (pass, reason) = with_upload(v, pass, reason);
    v.pass = pass;
    v.reason = reason;
}

/// PASS/FAIL by the checkpoint step's outcome (the first that is not a success, else the first).
fn outcome_verdict(v: &Verdict, signal: &str, timeout: Duration) -> (bool, String) {
    let outcome = v
        .plan
        .results
        .iter()
        .map(|r| r.outcome)
        .find(|o| !matches!(o, Outcome::Acked | Outcome::Exited))
        .or_else(|| v.plan.results.first().map(|r| r.outcome));
    match outcome {
        None => (false, "no checkpoint target found (did the command start?)".to_string()),
        Some(Outcome::NoHandler) => (false, no_handler_reason(v, signal)),
        Some(Outcome::Timeout) => (
            false,
            format!(
                "no terminal ack within the checkpoint budget (min(--timeout {}, deadline − drain reserve)) — the save does not fit this cloud's window",
                crate::duration::display(timeout)
            ),
        ),
        Some(Outcome::Skipped) => (false, "the process acked `skipped`: it judged the save would not fit".into()),
        Some(Outcome::Failed) => (false, "a process acked `failed`, or exited without acking `done`".into()),
        Some(Outcome::Error) => (false, "spotguard could not signal or read acks (rerun with --log-level info)".into()),
        Some(Outcome::Acked | Outcome::Exited) => exit_verdict(v),
    }
}

/// Why no process caught the signal, by what the start-up wait found.
fn no_handler_reason(v: &Verdict, signal: &str) -> String {
    match &v.handler {
        HandlerWait::NotFound { waited: w } => format!(
            "no process of the command ever caught {signal} (waited {} for a handler after start): install one (import spotguard; spotguard.install())",
            waited(*w)
        ),
        HandlerWait::Found { handler, waited: w } if v.handler_gone => format!(
            "the command ended before the notice: pid {} (which caught {signal} {} after start) had exited when the notice was raised, and no process of the command caught {signal} after that (the training finished, or crashed; a launcher still waiting for other nodes was left). Give it more steps, or a shorter --after",
            handler.pid,
            waited(*w)
        ),
        HandlerWait::Found { handler, .. } => format!(
            "pid {} caught {signal} before the notice but no process caught it when the agent signalled (handler removed, or the process exited)",
            handler.pid
        ),
        HandlerWait::NotWaited => format!(
            "no process of the command caught {signal} when the agent signalled: install a handler (spotguard.install()), or drop --after-start so the drill waits for it"
        ),
    }
}

/// PASS/FAIL of a run that checkpointed, by how the command exited.
fn exit_verdict(v: &Verdict) -> (bool, String) {
    let launcher = if v.command.contains("torchrun") || v.command.contains("torch.distributed.run")
    {
        "torchrun exits 1 when its workers exit 143: start it as `python3 -m spotguard launch -- torchrun …`, which exits 143 after this run's checkpoint"
    } else {
        "exit 143 after the checkpoint (spotguard.exit_after_checkpoint()); a launcher that turns its workers' 143 into 1 (torchrun) goes under `python3 -m spotguard launch -- …`"
    };
    match &v.exit {
        None => (false, "the command did not exit, even after the drill's SIGTERM and SIGKILL".into()),
        Some(e) if e.killed_by_drill => (
            false,
            "checkpointed, but kept running after its result until the drill stopped it: exit after the checkpoint (spotguard.exit_after_checkpoint())".into(),
        ),
        Some(e) if e.signal.is_some() => (false, format!("checkpointed, then {}", exit_label(e))),
        Some(e) if e.code == 143 => (true, "acknowledged `done` within the budget and exited 143".into()),
        Some(e) if e.code == 0 => (
            false,
            "checkpointed, but exit 0 marks a Job (and a Kubeflow job) succeeded, so it would never resume: exit 143 (spotguard.exit_after_checkpoint())".into(),
        ),
        Some(e) if e.code < 128 => (
            false,
            format!(
                "checkpointed, but exit {} after the acks fails the Job: a podFailurePolicy FailJob rule (and Kubeflow's ExitCode policy) treat 1–127 as permanent. {launcher}",
                e.code
            ),
        ),
        Some(e) => (true, format!("acknowledged `done` within the budget; exit {} is retryable for Kubeflow, list it in your podFailurePolicy", e.code)),
    }
}

/// A passing run with a staged checkpoint (`--upload-to`) passes only if the upload published it.
fn with_upload(v: &Verdict, pass: bool, reason: String) -> (bool, String) {
    match (&v.upload, pass) {
        (Some(UploadRow::Ended(r)), true) if r.outcome.is_published() => (
            true,
            format!(
                "{reason}; the staged checkpoint was uploaded and published ({:.1}s after the trainer's ack)",
                r.seconds
            ),
        ),
        (Some(UploadRow::Ended(r)), true) => (
            false,
            format!(
                "checkpointed, but the staged upload ended `{}`: {}",
                r.outcome.as_str(),
                r.error.as_deref().unwrap_or("nothing published")
            ),
        ),
        (Some(UploadRow::None(why)), true) => (false, format!("checkpointed, but {why}")),
        (_, pass) => (pass, reason),
    }
}

fn rel(t: Option<Timestamp>, t0: Option<Timestamp>) -> String {
    match (t, t0) {
        (Some(t), Some(t0)) => {
            // Clock rounding can put a point a hair before the notice (a GCE hanging GET answers
            // as the notice is raised, before the drill has stamped it): under 100 ms before
            // is "at once", never "-0.002s".
            let s = t.duration_since(t0).as_secs_f64();
            if s < 0.0 && s > -0.1 {
                "+0.000s".to_string()
            } else if s < 0.0 {
                format!("-{:.3}s", -s).replace("-0.000s", "+0.000s")
            } else {
                format!("+{s:.3}s")
            }
        }
        _ => "—".into(),
    }
}

fn rel_secs(t: Option<Timestamp>, t0: Option<Timestamp>) -> Value {
    match (t, t0) {
        (Some(t), Some(t0)) => json!(t.duration_since(t0).as_secs_f64()),
        _ => Value::Null,
    }
}

fn budget(v: &Verdict) -> Option<Duration> {
    match (v.plan.checkpoint_deadline, v.plan.signalled_at) {
        (Some(cd), Some(s)) => Some(crate::duration::until(cd, s)),
        _ => None,
    }
}

/// A verdict table being written: rows of step, time and detail, the step column `w` wide.
pub struct Table {
    out: String,
    w: usize,
}

impl Table {
    /// A table whose step column is `w` wide, with its header.
    pub fn new(w: usize) -> Table {
        let mut out = String::new();
        let _ = writeln!(out, "\n  {:<w$} time       detail", "step");
        Table { out, w }
    }

    pub fn row(&mut self, step: &str, time: &str, detail: &str) {
        let w = self.w;
        let _ = writeln!(self.out, "  {step:<w$} {time:<10} {detail}");
    }

    /// The table, with its verdict line.
    pub fn finish(mut self, pass: bool, reason: &str) -> String {
        let _ = writeln!(
            self.out,
            "\n  verdict: {} — {}",
            if pass { "PASS" } else { "FAIL" },
            reason
        );
        self.out
    }
}

/// The verdict table.
pub fn table(v: &Verdict, timeout: Duration, signal: &str) -> String {
    let mut t = Table::new(20);
    handler_row(&mut t, v, signal);
    notice_rows(&mut t, v, timeout, signal);
    ack_rows(&mut t, v);
    end_rows(&mut t, v);
    upload_row(&mut t, v);
    for w in warnings(v) {
        t.row("warning", "", &w);
    }
    t.finish(v.pass, &v.reason)
}

/// What the start-up wait found.
fn handler_row(t: &mut Table, v: &Verdict, signal: &str) {
    match &v.handler {
        HandlerWait::NotWaited => t.row(
            "handler wait",
            "—",
            "--after-start: notice timed from the command's start",
        ),
        HandlerWait::Found { handler, waited: w } => t.row(
            "handler seen",
            &waited(*w),
            &format!(
                "pid {} catches {signal}: {} (after the command started)",
                handler.pid, handler.command
            ),
        ),
        HandlerWait::NotFound { waited: w } => t.row(
            "handler seen",
            "never",
            &format!(
                "no process of the command caught {signal} within {}",
                waited(*w)
            ),
        ),
    }
}

/// The notice raised and seen, the signal sent, the checkpoint budget.
fn notice_rows(t: &mut Table, v: &Verdict, timeout: Duration, signal: &str) {
    let t0 = v.raised_at;
    if let Some(raised) = v.raised_at {
        t.row(
            "notice raised",
            "+0.000s",
            &format!(
                "{} interruption, deadline {}",
                v.cloud.as_str(),
                v.plan
                    .deadline
                    .map(|d| format!("+{:.0}s", d.duration_since(raised).as_secs_f64()))
                    .unwrap_or_else(|| "now".into())
            ),
        );
    }
    let how = v.cloud.facts().drill_detection;
    t.row("notice seen", &rel(v.plan.seen_at, t0), how);
    t.row(
        "signal sent",
        &rel(v.plan.signalled_at, t0),
        &format!("{signal} to {} process(es) catching it", v.plan.processes),
    );
    if let Some(b) = budget(v) {
        t.row(
            "budget",
            &format!("{:.1}s", b.as_secs_f64()),
            &format!(
                "until {}: min(--timeout {}, deadline − drain reserve)",
                rel(v.plan.checkpoint_deadline, t0),
                crate::duration::display(timeout)
            ),
        );
    }
}

/// The acks found in the notice dir (or that there is none).
fn ack_rows(t: &mut Table, v: &Verdict) {
    for a in &v.acks {
        let mut detail = format!(
            "{} state={} step={} checkpoint={}",
            a.file,
            a.state,
            a.step
                .map(|s| s.to_string())
                .unwrap_or_else(|| "null".into()),
            a.checkpoint.as_deref().unwrap_or("-")
        );
        if let Some(n) = ack_note(v, a) {
            let _ = write!(detail, " ({n})");
        }
        t.row("ack written", &rel(a.written, v.raised_at), &detail);
    }
    if v.acks.is_empty() && v.plan.signalled_at.is_some() {
        t.row(
            "ack written",
            "—",
            "no ack file in the notice dir (SPOTGUARD_DIR)",
        );
    }
}

/// The checkpoint results, the command's exit and the trainer's downtime.
fn end_rows(t: &mut Table, v: &Verdict) {
    for r in &v.plan.results {
        t.row(
            "result",
            &rel(v.plan.result_at, v.raised_at),
            &format!("{} — {} ({})", r.outcome.as_str(), r.group, r.detail),
        );
        let badput = crate::goodput::record::target(r, None, None);
        t.row("badput", "", &badput.summary());
    }
    if let Some(e) = &v.exit {
        let mut label = exit_label(e);
        if v.handler_gone {
            label.push_str(" (its training had ended before the notice)");
        }
        t.row("command exit", &e.code.to_string(), &label);
    }
    if let Some(d) = v.downtime() {
        t.row(
            "trainer downtime",
            &format!("{:.3}s", d.as_secs_f64()),
            "signal → the command's exit",
        );
    }
}

/// The staged checkpoint's upload (`--upload-to`).
fn upload_row(t: &mut Table, v: &Verdict) {
    match &v.upload {
        Some(UploadRow::Ended(r)) => t.row(
            "upload",
            &format!("{:.3}s", r.seconds),
            &format!(
                "{} — {}: {} files, {} bytes ({}/s){}",
                r.outcome.as_str(),
                r.destination,
                r.files,
                r.bytes,
                crate::units::human_bytes(r.rate_bps),
                r.error
                    .as_ref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ),
        ),
        Some(UploadRow::None(why)) => t.row("upload", "—", why),
        None => {}
    }
}

/// A result's badput record (the table's `badput` row) as JSON: the record's fields
/// (`target`, `outcome`, `save_seconds`, `downtime_seconds`, `wasted_steps`, `wasted_seconds`,
/// `durable_step`, where known) and `summary`, the row's text.
fn badput_json(r: &crate::checkpoint::run::GroupResult) -> Value {
    let badput = crate::goodput::record::target(r, None, None);
    let mut j = serde_json::to_value(&badput).unwrap_or_else(|_| json!({}));
    if let Some(o) = j.as_object_mut() {
        o.insert("summary".into(), Value::String(badput.summary()));
    }
    j
}

/// One run as JSON (`--json`).
pub fn to_json(v: &Verdict, timeout: Duration, signal: &str) -> Value {
    let t0 = v.raised_at;
    let handler = match &v.handler {
        HandlerWait::NotWaited => json!({"waited": false}),
        HandlerWait::Found { handler, waited } => json!({
            "waited": true, "found": true, "pid": handler.pid, "command": handler.command,
            "after_start_s": waited.as_secs_f64(),
        }),
        HandlerWait::NotFound { waited } => {
            json!({"waited": true, "found": false, "waited_s": waited.as_secs_f64()})
        }
    };
    json!({
        "pass": v.pass,
        "reason": v.reason,
        "cloud": v.cloud.as_str(),
        "command": v.command,
        "notice_dir": v.notice_dir.display().to_string(),
        // The old name of the same directory (before --notice-dir), kept for existing readers.
        "checkpoint_dir": v.notice_dir.display().to_string(),
        "warnings": warnings(v),
        "signal": signal,
        "timeout_s": timeout.as_secs_f64(),
        "handler": handler,
        "notice_raised_unix": v.raised_at.map(|t| t.as_millisecond() as f64 / 1000.0),
        "notice_seen_s": rel_secs(v.plan.seen_at, t0),
        "signal_sent_s": rel_secs(v.plan.signalled_at, t0),
        "processes_signalled": v.plan.processes,
        "budget_s": budget(v).map(|b| b.as_secs_f64()),
        "deadline_s": rel_secs(v.plan.deadline, t0),
        "result_s": rel_secs(v.plan.result_at, t0),
        "results": v.plan.results.iter().map(|r| json!({
            "group": r.group, "outcome": r.outcome.as_str(), "signalled": r.signalled, "detail": r.detail,
            "badput": badput_json(r),
        })).collect::<Vec<_>>(),
        "acks": v.acks.iter().map(|a| json!({
            "file": a.file, "state": a.state, "step": a.step, "checkpoint": a.checkpoint,
            "written_s": rel_secs(a.written, t0), "note": ack_note(v, a),
        })).collect::<Vec<_>>(),
        "exit": v.exit.as_ref().map(|e| json!({
            "code": e.code, "signal": e.signal, "killed_by_drill": e.killed_by_drill, "label": exit_label(e),
        })),
        "downtime_s": v.downtime().map(|d| d.as_secs_f64()),
        "upload": match &v.upload {
            Some(UploadRow::Ended(r)) => serde_json::to_value(r).unwrap_or(Value::Null),
            Some(UploadRow::None(why)) => json!({"outcome": null, "error": why}),
            None => Value::Null,
        },
    })
}

fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 forbids most control characters, even escaped.
            c if (c as u32) < 0x20 && !matches!(c, '\n' | '\t' | '\r') => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

/// A JUnit XML report (`--junit FILE`): one test case per run, its verdict table as the case's
/// output (or its failure's text).
pub fn junit<V: RunVerdict>(runs: &[Run<V>]) -> String {
    let failures = runs.iter().filter(|(v, _, _)| !v.passed()).count();
    let total: f64 = runs.iter().map(|(_, _, took)| took.as_secs_f64()).sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuite name=\"spotguard drill\" tests=\"{}\" failures=\"{failures}\" errors=\"0\" time=\"{total:.3}\">",
        runs.len()
    );
    for (i, (v, text, took)) in runs.iter().enumerate() {
        let _ = write!(
            out,
            "  <testcase classname=\"spotguard.drill\" name=\"{}\" time=\"{:.3}\">",
            xml_escape(&v.junit_name(i + 1)),
            took.as_secs_f64()
        );
        if !v.passed() {
            let _ = write!(
                out,
                "\n    <failure message=\"{}\">{}</failure>\n  ",
                xml_escape(v.reason()),
                xml_escape(text)
            );
        } else {
            let _ = write!(out, "<system-out>{}</system-out>", xml_escape(text));
        }
        out.push_str("</testcase>\n");
    }
    out.push_str("</testsuite>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_labels_say_what_the_code_means() {
        let e = |code, signal, killed| ExitInfo {
            code,
            signal,
            killed_by_drill: killed,
        };
        assert!(exit_label(&e(143, None, false)).contains("retryable"));
        assert!(exit_label(&e(0, None, false)).contains("never resumes"));
        assert!(exit_label(&e(1, None, false)).contains("permanent"));
        assert!(exit_label(&e(143, Some(libc::SIGTERM), true))
            .starts_with("killed by the drill (SIGTERM)"));
        assert_eq!(
            exit_label(&e(138, Some(libc::SIGUSR1), false)),
            "killed by SIGUSR1"
        );
    }

    #[test]
    fn relative_times_never_print_minus_zero() {
        let t0 = Timestamp::from_millisecond(1_000_000).unwrap();
        let before = Timestamp::from_microsecond(999_999_900).unwrap();
        assert_eq!(rel(Some(before), Some(t0)), "+0.000s");
        assert_eq!(
            rel(
                Some(Timestamp::from_millisecond(1_001_500).unwrap()),
                Some(t0)
            ),
            "+1.500s"
        );
        assert_eq!(
            rel(
                Some(Timestamp::from_millisecond(998_000).unwrap()),
                Some(t0)
            ),
            "-2.000s"
        );
        assert_eq!(rel(None, Some(t0)), "—");
    }

    #[test]
    fn junit_escapes_and_counts_failures() {
        let v = |pass| Verdict {
            pass,
            reason: "a <b> & \"c\"".into(),
            ..Verdict::started(
                Cloud::Gce,
                "python3 train.py --x=<1>".into(),
                PathBuf::from("/tmp/x"),
                HandlerWait::NotWaited,
                Timestamp::now(),
            )
        };
        let xml = junit(&[
            (v(true), "ok\u{1}".into(), Duration::from_millis(1500)),
            (v(false), "table".into(), Duration::from_secs(2)),
        ]);
        assert!(xml.contains("tests=\"2\" failures=\"1\""), "{xml}");
        assert!(
            xml.contains("name=\"gce interruption #1: python3 train.py --x=&lt;1&gt;\""),
            "{xml}"
        );
        assert!(
            xml.contains("<failure message=\"a &lt;b&gt; &amp; &quot;c&quot;\">table</failure>"),
            "{xml}"
        );
        assert!(xml.contains("<system-out>ok?</system-out>"), "{xml}");
        assert_eq!(xml.matches("<testcase").count(), 2);
    }

    #[test]
    fn the_json_carries_the_badput_record_the_table_prints() {
        let mut v = Verdict::started(
            Cloud::Aws,
            "python3 train.py".into(),
            PathBuf::from("/tmp/x"),
            HandlerWait::NotWaited,
            Timestamp::now(),
        );
        v.plan.results.push(crate::checkpoint::run::GroupResult {
            group: "cmdline:train".into(),
            pod: None,
            outcome: Outcome::Acked,
            signalled: 1,
            signalled_at: Some(Timestamp::from_second(1_700_000_000).unwrap()),
            ack_latency: Some(Duration::from_millis(12_300)),
            detail: "done at step 40".into(),
            exits: vec![],
        });
        let text = table(&v, Duration::from_secs(30), "SIGUSR1");
        let j = to_json(&v, Duration::from_secs(30), "SIGUSR1");
        let b = &j["results"][0]["badput"];
        assert_eq!(b["target"], "cmdline:train", "{j}");
        assert_eq!(b["outcome"], "acked");
        assert_eq!(b["save_seconds"], 12.3);
        assert_eq!(b["downtime_seconds"], 12.3);
        assert_eq!(
            (b["wasted_steps"].as_u64(), b["wasted_seconds"].as_f64()),
            (Some(0), Some(0.0))
        );
        let summary = b["summary"].as_str().unwrap();
        assert!(
            summary.starts_with("badput: checkpoint save 12.3s"),
            "{summary}"
        );
        assert!(text.contains(summary), "{summary} not in\n{text}");
    }
}
