//! The plan's in-process test seam: the real responder (`spotguard::responder::Responder`) run
//! inside the test, without `app::start`, a metadata server or an admin server.
//!
//! - notices are pushed straight into the responder ([`Responder::push`]);
//! - the node is a [`RecordingNode`]: every `NodeOps` call recorded with the time it was made
//!   (a node that keeps the plan record's copy as the Kubernetes annotation would);
//! - checkpoint targets are real child processes ([`Trainer`]: catches SIGUSR1, counts each
//!   signal, writes a `done` ack; or held, acking only once released), found by the real host
//!   discovery (a `--checkpoint-cmdline` selector naming the seam's tag);
//! - the store's decisions ([`spotguard::responder::Decided`], a `Duplicate` included) and the
//!   plan's events are observable, so that a test waits for the decision that proves "no second
//!   plan" instead of for a silence.
//!
//! A [`Seam`] owns the directories (checkpoint dir, state dir) and the node; it starts a
//! responder, and after [`Responder::stop`] another one on the same state: an agent restarted
//! with its record.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use spotguard::checkpoint::discover::{HostDiscovery, HostTargets};
use spotguard::checkpoint::{PodRef, Signal};
use spotguard::config::{MaintenanceAction, RebalanceAction};
use spotguard::life::Lives;
use spotguard::metrics::{DecisionLabels, Metrics};
use spotguard::node::{
    Applied, Disruption, DrainReport, DrainRequest, Error as NodeError, EventType, GpuConditions,
    NodeOps, Protection,
};
use spotguard::notice::{Cloud, MaintenanceKind, Notice, NoticeKind};
use spotguard::responder::record::StateFile;
use spotguard::responder::{Decided, Decision, Deps, PlanEvent, ResponderConfig};

use crate::process::Kid;

/// One call the plan made at the node seam.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeCall {
    Protect(Protection),
    Unprotect(Applied),
    Event { reason: String, message: String },
    PodEvent { pod: String, reason: String },
    Drain { deadline: Timestamp },
    MarkDisruption,
    SaveState,
    ClearState,
}

/// A `NodeOps` that records every call with its time and answers as a node with nothing on it
/// to drain: a protect applies what it was asked (nothing was there before), the plan record's
/// copy is kept in memory (so that a restarted responder finds it, as on a Node annotation).
#[derive(Debug, Default)]
pub struct RecordingNode {
    calls: Mutex<Vec<(Timestamp, NodeCall)>>,
    state: Mutex<Option<String>>,
}

impl RecordingNode {
    fn record(&self, call: NodeCall) {
        self.calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((Timestamp::now(), call));
    }

    /// Every call so far, with when it was made, in order.
    pub fn calls(&self) -> Vec<(Timestamp, NodeCall)> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many calls so far `f` picks.
    pub fn count(&self, f: impl Fn(&NodeCall) -> bool) -> usize {
        self.calls().iter().filter(|(_, c)| f(c)).count()
    }

    /// The deadline of every drain so far, in order.
    pub fn drains(&self) -> Vec<Timestamp> {
        self.calls()
            .into_iter()
            .filter_map(|(_, c)| match c {
                NodeCall::Drain { deadline } => Some(deadline),
                _ => None,
            })
            .collect()
    }
}

#[async_trait]
impl NodeOps for RecordingNode {
    async fn load_state(&self) -> Result<Option<String>, NodeError> {
        Ok(self.state.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }
    async fn save_state(&self, record: &str) -> Result<(), NodeError> {
        self.record(NodeCall::SaveState);
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(record.to_string());
        Ok(())
    }
    async fn clear_state(&self) -> Result<(), NodeError> {
        self.record(NodeCall::ClearState);
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(())
    }
    async fn protect(&self, protection: &Protection) -> Result<Applied, NodeError> {
        self.record(NodeCall::Protect(protection.clone()));
        Ok(Applied {
            cordoned: protection.cordon,
            taint_effect: Some(protection.effect),
        })
    }
    async fn unprotect(&self, applied: &Applied) -> Result<(), NodeError> {
        self.record(NodeCall::Unprotect(applied.clone()));
        Ok(())
    }
    async fn event(&self, _kind: EventType, reason: &str, message: &str) -> Result<(), NodeError> {
        self.record(NodeCall::Event {
            reason: reason.to_string(),
            message: message.to_string(),
        });
        Ok(())
    }
    async fn pod_event(
        &self,
        pod: &PodRef,
        _kind: EventType,
        reason: &str,
        _message: &str,
    ) -> Result<(), NodeError> {
        self.record(NodeCall::PodEvent {
            pod: format!("{}/{}", pod.namespace, pod.name),
            reason: reason.to_string(),
        });
        Ok(())
    }
    async fn drain(&self, request: &DrainRequest) -> Result<DrainReport, NodeError> {
        self.record(NodeCall::Drain {
            deadline: request.deadline,
        });
        Ok(DrainReport::default())
    }
    async fn mark_disruption(&self, _disruption: &Disruption) -> Result<Vec<String>, NodeError> {
        self.record(NodeCall::MarkDisruption);
        Ok(Vec::new())
    }
    async fn gpu_conditions(&self) -> Result<GpuConditions, NodeError> {
        Ok(GpuConditions::default())
    }
    async fn set_gpu_conditions(&self, _desired: &GpuConditions) -> Result<(), NodeError> {
        Ok(())
    }
}

/// A trainer: `bash` that catches SIGUSR1, appends each signal to its marks file and writes a
/// `done` ack (`ack-<pid>.json`, step = the signal's number) into the checkpoint dir; a held one
/// writes it only once [`Trainer::release`]d. Named with the seam's tag, so that the seam's
/// discovery finds it; killed with its process group when dropped.
pub struct Trainer {
    kid: Kid,
    marks: PathBuf,
    hold: PathBuf,
}

const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; while [ -e "$HOLD" ]; do sleep 0.02; done; printf '"'"'{"state":"done","step":%d,"checkpoint":"ckpt-%d","ts":%s}'"'"' $n $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack-$BASHPID.tmp"; mv "$SPOTGUARD_DIR/.ack-$BASHPID.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

impl Trainer {
    /// The trainer's pid.
    pub fn pid(&self) -> i32 {
        self.kid.pid()
    }

    /// How many SIGUSR1 it caught so far.
    pub fn signals_seen(&self) -> usize {
        std::fs::read_to_string(&self.marks)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    /// Wait until it caught `n` signals; panics after `limit`.
    pub async fn wait_signals(&self, n: usize, limit: Duration) {
        let end = tokio::time::Instant::now() + limit;
        while self.signals_seen() < n {
            assert!(
                tokio::time::Instant::now() < end,
                "trainer {}: {} signals after {limit:?}, waiting for {n}",
                self.pid(),
                self.signals_seen()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Let a held trainer write its ack.
    pub fn release(&self) {
        let _ = std::fs::remove_file(&self.hold);
    }
}

/// Where a seam lives, and what its responders run with.
pub struct Seam {
    dir: PathBuf,
    tag: String,
    trainers: std::sync::atomic::AtomicUsize,
    /// The node every responder of this seam acts on.
    pub node: Arc<RecordingNode>,
    /// The responder's settings (host-mode defaults; a 20 s checkpoint timeout, no shutdown
    /// grace: a stopped responder stops its plan at once).
    pub cfg: ResponderConfig,
}

impl Seam {
    /// A seam under `dir` (its checkpoint dir `dir/ckpt`, state dir `dir/state`).
    pub fn new(dir: &Path) -> Seam {
        let ckpt = dir.join("ckpt");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::create_dir_all(dir.join("state")).unwrap();
        Seam {
            dir: dir.to_path_buf(),
            tag: format!("sg-seam-{:016x}", fastrand::u64(..)),
            trainers: Default::default(),
            node: Arc::new(RecordingNode::default()),
            cfg: ResponderConfig {
                on_rebalance: RebalanceAction::Checkpoint,
                rebalance_expiry: Duration::from_secs(600),
                on_maintenance: MaintenanceAction::Drain,
                on_azure_freeze: MaintenanceAction::Ignore,
                maintenance_lead: Duration::from_secs(3600),
                checkpoint_timeout: Duration::from_secs(20),
                drain_reserve: None,
                force_delete_at_deadline: false,
                drain_concurrency: 4,
                dry_run: false,
                shutdown_grace: Duration::ZERO,
                resume_hold: spotguard::responder::resume_hold(Duration::from_millis(200)),
                node_name: Some("plan-node".into()),
            },
        }
    }

    /// The checkpoint dir (`notice.json`, the acks).
    pub fn checkpoint_dir(&self) -> PathBuf {
        self.dir.join("ckpt")
    }

    /// The state dir (the plan's local record).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// Start a trainer the seam's discovery finds; returns once its trap is installed.
    pub fn trainer(&self) -> Trainer {
        self.start_trainer(false)
    }

    /// A trainer that catches the signal but acks only once [`Trainer::release`]d.
    pub fn held_trainer(&self) -> Trainer {
        self.start_trainer(true)
    }

    fn start_trainer(&self, held: bool) -> Trainer {
        let n = self
            .trainers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let marks = self.dir.join(format!("marks-{n}"));
        let hold = self.dir.join(format!("hold-{n}"));
        if held {
            std::fs::write(&hold, b"").unwrap();
        }
        let mut cmd = Command::new("bash");
        cmd.arg("-c")
            .arg(TRAINER)
            .arg(format!("{}-{n}", self.tag))
            .env("SPOTGUARD_DIR", self.checkpoint_dir())
            .env("MARKS", &marks)
            .env("HOLD", &hold)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let kid = Kid::spawn(cmd);
        kid.wait_for_trap();
        Trainer { kid, marks, hold }
    }

    /// Start a responder on this seam's state, node and trainers.
    pub async fn start(&self) -> Responder {
        let discovery = HostDiscovery::new(HostTargets {
            units: Vec::new(),
            pidfiles: Vec::new(),
            // The `--checkpoint-cmdline` selector of the seam's trainers, as the agent parses it.
            cmdlines: spotguard::config::parse_run_args([format!(
                "--checkpoint-cmdline={}-[0-9]+$",
                self.tag
            )])
            .unwrap_or_else(|text| panic!("{text}"))
            .checkpoint_cmdline,
            cmdline_uids: Vec::new(),
            dir: self.checkpoint_dir(),
            signal: Signal::USR1,
            timeout: self.cfg.checkpoint_timeout,
        });
        let mut registry = Default::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let boot_id = spotguard::life::read_boot_id().ok();
        let state_dir = self.state_dir();
        let life = tokio::task::spawn_blocking(move || Lives::open(&state_dir, boot_id, false))
            .await
            .unwrap();
        let responder = spotguard::responder::Responder::new(
            self.cfg.clone(),
            Deps {
                node: self.node.clone(),
                local: StateFile::new(&self.state_dir(), false),
                discovery: Arc::new(discovery),
                sources: Vec::new(),
                metrics: metrics.clone(),
                on_start: Vec::new(),
                life: Arc::new(life),
                upload: None,
            },
        );
        let events = responder.subscribe();
        let log = responder.subscribe();
        let decisions = responder.decisions();
        let (tx, rx) = mpsc::channel(64);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(responder.run(rx, cancel.clone()));
        Responder {
            notices: tx,
            events,
            log: (log, Vec::new()),
            decisions,
            cancel,
            task,
            metrics,
        }
    }
}

/// A responder running in the test's runtime.
pub struct Responder {
    notices: mpsc::Sender<Notice>,
    /// The plan's events.
    pub events: broadcast::Receiver<PlanEvent>,
    /// Every plan event, whatever `events` consumed ([`Responder::all_events`]).
    log: (broadcast::Receiver<PlanEvent>, Vec<PlanEvent>),
    /// The store's decisions, one per notice pushed.
    pub decisions: broadcast::Receiver<Decided>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    /// The responder's metric families.
    pub metrics: Arc<Metrics>,
}

impl Responder {
    /// Hand `notice` to the responder, as a notice source would.
    pub async fn push(&self, notice: Notice) {
        self.notices.send(notice).await.expect("responder running");
    }

    /// Wait up to `limit` for a decision for which `f` returns `Some`; panics on timeout.
    pub async fn decision<T>(
        &mut self,
        limit: Duration,
        f: impl FnMut(&Decided) -> Option<T>,
    ) -> T {
        crate::recv_until(&mut self.decisions, limit, "decision", f).await
    }

    /// Push `notice` and wait for the store's decision about it (decisions are made in the order
    /// notices arrive, one each).
    pub async fn decide(&mut self, notice: Notice) -> Decision {
        self.push(notice.clone()).await;
        self.decision(Duration::from_secs(20), |d| {
            (d.notice == notice).then(|| d.decision.clone())
        })
        .await
    }

    /// Wait up to `limit` for a plan event for which `f` returns `Some`; panics on timeout.
    pub async fn event<T>(&mut self, limit: Duration, f: impl FnMut(&PlanEvent) -> Option<T>) -> T {
        crate::wait_for_event(&mut self.events, limit, f).await
    }

    /// Every plan event this responder sent so far, in order, whatever waits consumed: after a
    /// decision was seen, every event its handling sent (a plan it started: its `NoticeSeen`).
    pub fn all_events(&mut self) -> Vec<PlanEvent> {
        let (rx, seen) = &mut self.log;
        loop {
            match rx.try_recv() {
                Ok(e) => seen.push(e),
                Err(broadcast::error::TryRecvError::Lagged(n)) => {
                    panic!("the seam's event log lost {n} events")
                }
                Err(_) => return seen.clone(),
            }
        }
    }

    /// `spotguard_notice_decisions_total{kind,decision}` now.
    pub fn decisions_counted(&self, kind: &str, decision: &str) -> u64 {
        self.metrics
            .notice_decisions
            .get_or_create(&DecisionLabels {
                kind: kind.into(),
                decision: decision.into(),
            })
            .get()
    }

    /// Stop the responder (as at shutdown, with the seam's grace) and wait until it returned.
    pub async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the responder stops")
            .expect("the responder does not panic");
    }
}

/// An interruption notice from EC2, first seen now, due in `due_in`.
pub fn interruption(id: &str, due_in: Duration) -> Notice {
    notice(id, NoticeKind::Interruption, Some(due_in))
}

/// An EC2 rebalance recommendation, first seen now.
pub fn rebalance(id: &str) -> Notice {
    notice(id, NoticeKind::Rebalance, None)
}

/// A notice from EC2 of `kind`, first seen now, due in `due_in` (if any).
pub fn notice(id: &str, kind: NoticeKind, due_in: Option<Duration>) -> Notice {
    let now = Timestamp::now();
    let deadline = due_in.map(|d| spotguard::duration::add(now, d));
    Notice {
        id: id.into(),
        kind,
        source: Cloud::Aws,
        deadline,
        not_before: deadline,
        detail: String::new(),
        restart: false,
        published_at: None,
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    }
}
