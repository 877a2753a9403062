//! Outcomes: a group's result from what its watcher saw (precedence `failed` > `exited` >
//! `skipped` > `acked`, ack latency to the last terminal ack), the one-line detail for logs and
//! Events, and the metrics and log line of each result.

use std::fmt::Write as _;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};

use super::delivery::{ContainerDelivery, SignalledProcess};
use super::watch::{GroupWatch, ProcState};
use super::{group_span, CheckpointRequest};
use crate::checkpoint::protocol::{AckFile, AckState};
use crate::checkpoint::{Outcome, PodRef};
use crate::metrics::{Metrics, OutcomeLabels};

/// The outcome of one group.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupResult {
    pub group: String,
    pub pod: Option<PodRef>,
    pub outcome: Outcome,
    pub signalled: usize,
    pub signalled_at: Option<Timestamp>,
    /// Signal → last terminal ack, for `acked`, `skipped` and `failed`.
    pub ack_latency: Option<Duration>,
    /// One line for logs and Events: per process state, step and checkpoint, or why not.
    pub detail: String,
    /// Every process seen gone without a terminal ack, for the badput record (`crate::goodput`).
    pub exits: Vec<ExitSeen>,
}

/// A signalled process seen gone without a terminal ack.
#[derive(Clone, Debug, PartialEq)]
pub struct ExitSeen {
    pub ns_pid: i32,
    /// When the watcher saw it gone (agent clock).
    pub at: Timestamp,
    /// Its progress record's bytes (hostile: size-capped and owner-checked only), if any.
    pub progress: Option<Vec<u8>>,
}

/// The largest progress record read (bytes).
pub const MAX_PROGRESS_BYTES: u64 = 4096;

/// `progress-<ns_pid>.json` of an exited process, from the dir as first opened: `None` when
/// absent, too large, not owned by one of the process's uids, or unreadable (logged at debug).
pub(super) fn read_progress(
    dir: &crate::checkpoint::ack::CheckpointDir,
    p: &SignalledProcess,
) -> Option<Vec<u8>> {
    let name = format!("progress-{}.json", p.ns_pid);
    match dir.read_file_after_exit(&name) {
        Ok(Some((data, stamp)))
            if p.uids.contains(&stamp.uid) && stamp.size <= MAX_PROGRESS_BYTES =>
        {
            Some(data)
        }
        Ok(Some((_, stamp))) => {
            tracing::debug!(
                file = name,
                owner = stamp.uid,
                size = stamp.size,
                "progress record ignored"
            );
            None
        }
        Ok(None) => None,
        Err(e) => {
            tracing::debug!(file = name, error = %e, "progress record unreadable");
            None
        }
    }
}

/// The processes of `w` seen gone without a terminal ack.
pub(super) fn exits(w: &GroupWatch) -> Vec<ExitSeen> {
    w.containers
        .iter()
        .flat_map(|c| &c.procs)
        .filter_map(|p| match &p.state {
            ProcState::Exited { at, progress } => Some(ExitSeen {
                ns_pid: p.process.ns_pid,
                at: *at,
                progress: progress.clone(),
            }),
            _ => None,
        })
        .collect()
}

/// Count and log one group's result as it finishes (dry-run: logged, not counted).
pub(super) fn record(r: &GroupResult, req: &CheckpointRequest, metrics: &Metrics) {
    let span = group_span(req, &r.group);
    let _enter = span.enter();
    if req.dry_run {
        tracing::info!(outcome = r.outcome.as_str(), detail = %r.detail, "checkpoint (dry-run)");
        return;
    }
    metrics
        .checkpoint
        .get_or_create(&OutcomeLabels {
            outcome: r.outcome.as_str().to_string(),
        })
        .inc();
    if let Some(l) = r.ack_latency {
        metrics.ack_latency.observe(l.as_secs_f64());
    }
    match r.outcome {
        Outcome::Acked => {
            tracing::info!(outcome = "acked", ack_ms = r.ack_latency.map(|d| d.as_millis() as u64).unwrap_or(0), detail = %r.detail, "checkpoint finished")
        }
        o => tracing::warn!(outcome = o.as_str(), detail = %r.detail, "checkpoint finished"),
    }
}

/// The result of a finished group: the worst per-process outcome, latency to the last ack.
pub(super) fn finish(w: &GroupWatch) -> GroupResult {
    let mut worst = Outcome::Acked;
    let rank = |o: Outcome| match o {
        Outcome::Failed => 3,
        Outcome::Exited => 2,
        Outcome::Skipped => 1,
        _ => 0,
    };
    let mut last_ack: Option<Timestamp> = None;
    let mut parts = Vec::new();
    for c in &w.containers {
        if let Some(at) = c.plain_ack {
            last_ack = last_ack.max(Some(at));
            parts.push(format!("{}: plain ack", c.name));
            continue;
        }
        for p in &c.procs {
            let (o, text) = match &p.state {
                ProcState::Acked { state, at, note } => {
                    last_ack = last_ack.max(Some(*at));
                    let o = match state {
                        AckState::Done | AckState::Received => Outcome::Acked,
                        AckState::Skipped => Outcome::Skipped,
                        AckState::Failed => Outcome::Failed,
                    };
                    (o, format!("{}{note}", state.as_str()))
                }
                ProcState::Exited { .. } => (Outcome::Exited, "exited without done".to_string()),
                ProcState::Pending { .. } => (Outcome::Timeout, "pending".to_string()),
            };
            if rank(o) > rank(worst) {
                worst = o;
            }
            parts.push(format!(
                "pid {}{}: {text}",
                p.process.pid,
                ns_suffix(&p.process)
            ));
        }
    }
    parts.extend(w.notice_problems.iter().cloned());
    let ack_latency = match worst {
        Outcome::Acked | Outcome::Skipped | Outcome::Failed => last_ack.map(|at| {
            Duration::try_from(at.duration_since(w.signalled_at).max(SignedDuration::ZERO))
                .unwrap_or_default()
        }),
        _ => None,
    };
    w.group_result(worst, ack_latency, parts.join("; "))
}

/// Where every process of an unfinished group stands (for timeouts and abandoned watchers).
pub(super) fn pending_detail(w: &GroupWatch) -> String {
    let mut parts = Vec::new();
    for c in &w.containers {
        if c.plain_ack.is_some() {
            parts.push(format!("{}: plain ack", c.name));
            continue;
        }
        for p in &c.procs {
            let s = match &p.state {
                ProcState::Pending { received: Some(_) } => "received, no terminal ack".to_string(),
                ProcState::Pending { received: None } => "no ack".to_string(),
                ProcState::Acked { state, note, .. } => format!("{}{note}", state.as_str()),
                ProcState::Exited { .. } => "exited without done".to_string(),
            };
            let problem = p
                .problem
                .as_deref()
                .map(|e| format!(" ({e})"))
                .unwrap_or_default();
            parts.push(format!(
                "pid {}{}: {s}{problem}",
                p.process.pid,
                ns_suffix(&p.process)
            ));
        }
    }
    parts.extend(w.notice_problems.iter().cloned());
    parts.join("; ")
}

pub(super) fn skipped_detail(containers: &[ContainerDelivery]) -> Option<String> {
    let parts: Vec<String> = containers
        .iter()
        .flat_map(|c| {
            c.skipped
                .iter()
                .map(|s| format!("pid {} {}", s.pid, s.reason))
        })
        .chain(containers.iter().filter_map(|c| c.error.clone()))
        .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

pub(super) fn ack_note(ack: &AckFile) -> String {
    let mut note = String::new();
    if let Some(step) = &ack.step {
        let _ = write!(note, " step={step}");
    }
    if let Some(ck) = &ack.checkpoint {
        let _ = write!(note, " checkpoint={ck}");
    }
    note
}

fn ns_suffix(p: &SignalledProcess) -> String {
    if p.ns_pid != p.pid {
        format!(" (pid {} in its namespace)", p.ns_pid)
    } else {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::procfs::ProcFs;
    use crate::checkpoint::run::dir::DirSlot;
    use crate::checkpoint::run::watch::{ContainerWatch, ProcWatch};

    fn proc_in(state: ProcState, pid: i32, at: Timestamp) -> ProcWatch {
        ProcWatch {
            process: SignalledProcess {
                pid,
                ns_pid: pid,
                start_time: 1,
                signalled_at: at,
                uids: vec![1000],
                before: false,
            },
            state,
            problem: None,
        }
    }

    fn group(containers: Vec<ContainerWatch>, at: Timestamp) -> GroupWatch {
        GroupWatch {
            group: "g".into(),
            pod: None,
            signalled_at: at,
            deadline: at + Duration::from_secs(10),
            containers,
            notice_problems: Vec::new(),
            result: None,
            proc: ProcFs::default(),
            cut: false,
            counters: crate::checkpoint::run::threads::Counters::none(),
            hook: Default::default(),
        }
    }

    fn acked(state: AckState, at: Timestamp) -> ProcState {
        ProcState::Acked {
            state,
            at,
            note: String::new(),
        }
    }

    #[test]
    fn outcome_precedence_and_latency() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let t1 = t0 + Duration::from_millis(1500);
        let t2 = t0 + Duration::from_secs(3);
        let exited = ProcState::Exited {
            at: t1,
            progress: None,
        };
        let cases = [
            (
                vec![acked(AckState::Done, t1), acked(AckState::Done, t2)],
                Outcome::Acked,
            ),
            (
                vec![acked(AckState::Done, t1), acked(AckState::Skipped, t2)],
                Outcome::Skipped,
            ),
            (
                vec![acked(AckState::Skipped, t1), exited.clone()],
                Outcome::Exited,
            ),
            (vec![exited, acked(AckState::Failed, t1)], Outcome::Failed),
        ];
        for (states, want) in cases {
            let procs = states
                .into_iter()
                .enumerate()
                .map(|(i, s)| proc_in(s, i as i32 + 10, t0))
                .collect();
            let c = ContainerWatch {
                name: "c".into(),
                dir: DirSlot::None,
                plain_ack: None,
                foreign: Default::default(),
                procs,
            };
            let r = finish(&group(vec![c], t0));
            assert_eq!(r.outcome, want, "{}", r.detail);
            assert_eq!(r.signalled, 2);
            match want {
                Outcome::Exited => assert_eq!(r.ack_latency, None),
                _ => assert!(r.ack_latency.is_some()),
            }
        }
        // latency is to the last terminal ack
        let c = ContainerWatch {
            name: "c".into(),
            dir: DirSlot::None,
            plain_ack: None,
            foreign: Default::default(),
            procs: vec![
                proc_in(acked(AckState::Done, t1), 1, t0),
                proc_in(acked(AckState::Done, t2), 2, t0),
            ],
        };
        assert_eq!(
            finish(&group(vec![c], t0)).ack_latency,
            Some(Duration::from_secs(3))
        );
    }

    #[test]
    fn plain_ack_finishes_a_container_with_pending_processes() {
        let t0 = Timestamp::from_second(1_700_000_000).unwrap();
        let c = ContainerWatch {
            name: "trainer".into(),
            dir: DirSlot::None,
            plain_ack: Some(t0 + Duration::from_secs(2)),
            foreign: Default::default(),
            procs: vec![proc_in(ProcState::Pending { received: None }, 1, t0)],
        };
        assert!(c.finished());
        let r = finish(&group(vec![c], t0));
        assert_eq!(r.outcome, Outcome::Acked);
        assert_eq!(r.ack_latency, Some(Duration::from_secs(2)));
        assert!(r.detail.contains("trainer: plain ack"));
    }
}
