//! Staged checkpoints (docs/checkpoint-upload.md): the ack wait is armed with a hook
//! ([`arm`]) that takes each staged `done` ack on the watcher's thread and starts its upload on
//! the uploader's own runtime at once; this step then follows every upload started — each pod
//! held out of the drain until its upload's report or `deadline − drain reserve`, whichever
//! comes first, while every other pod is evicted at once — and tells each refusal on its pod.
//! [`UploadEnd`], before the finish, waits for the reports (bounded by the same time), so that a
//! plan's `Done` comes after its uploads' outcomes.
//!
//! Each upload's outcome: a log line, an Event on the pod (`CheckpointUploaded`, or a Warning
//! `CheckpointUploadFailed` / `CheckpointUploadRefused`), the `spotguard_checkpoint_upload_*`
//! metrics (counted by the engine and the service), and the [`PlanEvent::Uploaded`] plan event.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{Flow, Run, Step};
use crate::checkpoint::run::AckHook;
use crate::node::{reason, EventType, Hold, NodeOps, PodRef};
use crate::responder::plan::{Found, Plan, SIDE_BUDGET_MIN};
use crate::responder::PlanEvent;
use crate::units::human_bytes;
use crate::upload::manifest::NoticeInfo;
use crate::upload::service::{pod_key, PlanContext, Staged, Started};
use crate::upload::{Outcome, Report};

/// How long past `deadline − drain reserve` an upload's report is awaited (the engine stops at
/// that time and aborts its multipart uploads; this bounds the abort requests).
const REPORT_GRACE: Duration = Duration::from_secs(5);

/// When uploads must be over: `deadline − drain reserve`.
fn upload_deadline(plan: &Plan, reserve: Duration) -> Timestamp {
    crate::duration::sub(plan.deadline(), reserve)
}

/// Arm the ack wait: a hook that takes staged acks and starts their uploads (their outcome
/// goes to `found.staged`); with no `--upload-allow` every staged ack is answered `refused`.
/// `None` in dry-run.
pub(super) fn arm(plan: &Plan, reserve: Duration, found: &mut Found) -> Option<AckHook> {
    let service = plan.deps.upload.clone()?;
    if plan.cfg.dry_run {
        return None;
    }
    let until = upload_deadline(plan, reserve);
    let left = crate::duration::until(until, Timestamp::now());
    let ctx = PlanContext {
        deadline: Some(tokio::time::Instant::now() + left),
        notice: NoticeInfo {
            id: plan.notice.id.clone(),
            source: plan.notice.source.as_str().to_string(),
            kind: plan.notice.kind.label().to_string(),
            deadline: Some(plan.deadline().to_string()),
        },
        cancel: plan.cancel.clone(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    found.staged = Some((rx, reserve));
    Some(Arc::new(move |seen| {
        if let Some(staged) = service.on_ack(seen, &ctx) {
            let _ = tx.send(staged);
        }
    }))
}

/// Follow the uploads the ack wait started.
pub(super) struct Upload;

#[async_trait]
impl Step for Upload {
    fn name(&self) -> &'static str {
        "upload"
    }

    fn applies(&self, run: &Run) -> bool {
        run.found.staged.is_some()
    }

    fn runs_when_cancelled(&self) -> bool {
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        run.plan.deadline()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        let Some((mut staged, reserve)) = run.found.staged.take() else {
            return Flow::Next;
        };
        let until = upload_deadline(&run.plan, reserve);
        while let Ok(s) = staged.try_recv() {
            match s {
                Staged::Started(started) => {
                    let (tx, rx) = watch::channel(false);
                    if let Some(pod) = &started.pod {
                        run.found.holds.push(Hold {
                            pod: pod_key(pod),
                            until,
                            released: rx,
                        });
                    }
                    let follower = follow(&run.plan, started, until, tx);
                    run.found.uploads.push(tokio::spawn(follower));
                }
                Staged::Refused { pod, staged, error } => {
                    let report = Report {
                        outcome: Outcome::Refused,
                        error_label: Some(error.metric_label()),
                        ..Report::failed("", error.to_string())
                    };
                    let message = format!("staged checkpoint {staged} refused: {error}");
                    let tell = tell(&run.plan, pod, report, message);
                    run.found.uploads.push(tokio::spawn(tell));
                }
            }
        }
        Flow::Next
    }
}

/// Wait for the uploads' reports before the plan finishes.
pub(super) struct UploadEnd;

#[async_trait]
impl Step for UploadEnd {
    fn name(&self) -> &'static str {
        "upload end"
    }

    fn applies(&self, run: &Run) -> bool {
        !run.found.uploads.is_empty()
    }

    fn runs_when_cancelled(&self) -> bool {
        // A cancelled plan goes on to its finish without waiting.
        true
    }

    fn deadline(&self, run: &Run) -> Timestamp {
        run.plan.deadline()
    }

    async fn run(&self, run: &mut Run) -> Flow {
        if run.plan.cancel.is_cancelled() {
            return Flow::Next;
        }
        for follower in run.found.uploads.drain(..) {
            tokio::select! {
                _ = follower => {}
                _ = run.plan.cancel.cancelled() => break,
            }
        }
        Flow::Next
    }
}

/// What a follower needs of the plan.
struct Teller {
    node: Arc<dyn NodeOps>,
    events: tokio::sync::broadcast::Sender<PlanEvent>,
    id: String,
    budget: Duration,
}

impl Teller {
    fn of(plan: &Plan) -> Teller {
        Teller {
            node: plan.deps.node.clone(),
            events: plan.events.clone(),
            id: plan.notice.id.clone(),
            budget: plan.budget().max(SIDE_BUDGET_MIN),
        }
    }

    /// The Event (on the pod, or the node's in host mode) and the plan event.
    async fn tell(&self, pod: Option<PodRef>, report: Report, message: String) {
        let (kind, why) = match report.outcome {
            o if o.is_published() => (EventType::Normal, reason::CHECKPOINT_UPLOADED),
            Outcome::Refused => (EventType::Warning, reason::CHECKPOINT_UPLOAD_REFUSED),
            _ => (EventType::Warning, reason::CHECKPOINT_UPLOAD_FAILED),
        };
        let event = async {
            match &pod {
                Some(p) => self.node.pod_event(p, kind, why, &message).await,
                None => self.node.event(kind, why, &message).await,
            }
        };
        if let Ok(Err(e)) = tokio::time::timeout(self.budget, event).await {
            warn!(error = %e, "cannot post the upload's Event");
        }
        let _ = self.events.send(PlanEvent::Uploaded {
            id: self.id.clone(),
            at: Timestamp::now(),
            pod: pod.as_ref().map(pod_key),
            report: Box::new(report),
        });
    }
}

fn tell(
    plan: &Plan,
    pod: Option<PodRef>,
    report: Report,
    message: String,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let teller = Teller::of(plan);
    async move { teller.tell(pod, report, message).await }
}

/// Follow one upload: end its hold when it reports or at `until`, whichever comes first, then
/// tell its outcome.
fn follow(
    plan: &Plan,
    started: Started,
    until: Timestamp,
    release: watch::Sender<bool>,
) -> impl std::future::Future<Output = ()> + Send + 'static {
    let teller = Teller::of(plan);
    async move {
        let Started {
            pod,
            destination,
            files,
            bytes,
            mut handle,
        } = started;
        let left = crate::duration::until(until, Timestamp::now());
        let joined = match tokio::time::timeout(left, &mut handle).await {
            Ok(r) => r,
            Err(_) => {
                warn!(destination = %destination, "upload still running at deadline − drain reserve: its pod goes to the drain");
                let _ = release.send(true);
                match tokio::time::timeout(REPORT_GRACE, &mut handle).await {
                    Ok(r) => r,
                    Err(_) => {
                        handle.abort();
                        (&mut handle).await
                    }
                }
            }
        };
        let _ = release.send(true);
        let report = match joined {
            Ok(report) => report,
            Err(e) => Report {
                files,
                bytes,
                ..Report::failed(
                    &destination,
                    format!("the upload task ended without a report: {e}"),
                )
            },
        };
        let message = describe(&report);
        if report.outcome.is_published() {
            info!(destination = %report.destination, files = report.files, bytes = report.bytes, seconds = report.seconds, rate_bps = report.rate_bps, outcome = report.outcome.as_str(), "checkpoint uploaded");
        } else {
            warn!(destination = %report.destination, outcome = report.outcome.as_str(), error = report.error.as_deref().unwrap_or(""), "checkpoint upload did not publish; the previous checkpoint stays the latest");
        }
        teller.tell(pod, report, message).await;
    }
}

/// One line for the Event.
fn describe(r: &Report) -> String {
    let what = format!(
        "{}: {} files, {} in {:.1}s",
        r.destination,
        r.files,
        human_bytes(r.bytes),
        r.seconds
    );
    match (&r.error, r.outcome) {
        (_, o) if o.is_published() => format!("checkpoint {} {what}", o.as_str()),
        (Some(e), o) => format!(
            "checkpoint upload {} ({e}); nothing published, the previous checkpoint stays the latest: {what}",
            o.as_str()
        ),
        (None, o) => format!(
            "checkpoint upload {}; nothing published, the previous checkpoint stays the latest: {what}",
            o.as_str()
        ),
    }
}
