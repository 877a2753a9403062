//! Following the agent's plan: what the responder's `PlanEvent` broadcast says about the notice,
//! the checkpoint signal and its result (and a staged checkpoint's upload), for both drills.

use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::broadcast::{error::RecvError, Receiver};

use crate::checkpoint::run::GroupResult;
use crate::notice::Cloud;
use crate::responder::PlanEvent;

/// What the plan showed up to its checkpoint result (or up to the limit).
#[derive(Debug, Clone, Default)]
pub struct PlanSeen {
    /// `NoticeSeen`: when the agent accepted the notice, and the notice's deadline.
    pub seen_at: Option<Timestamp>,
    pub deadline: Option<Timestamp>,
    /// `Signalled`: when, how many processes, and the checkpoint budget's end.
    pub signalled_at: Option<Timestamp>,
    pub processes: usize,
    pub checkpoint_deadline: Option<Timestamp>,
    /// `Checkpointed`: when, and each group's result.
    pub result_at: Option<Timestamp>,
    pub results: Vec<GroupResult>,
    /// Set when no checkpoint result came within the limit.
    pub error: Option<String>,
}

/// How long the drill follows the plan to its checkpoint result: the checkpoint timeout, the
/// cloud's notice lead and 30 s to spare.
pub fn limit(timeout: Duration, cloud: Cloud) -> Duration {
    timeout + cloud.facts().interruption_notice + Duration::from_secs(30)
}

/// Follow the plan to its checkpoint result, for at most `limit`.
pub async fn to_result(events: &mut Receiver<PlanEvent>, limit: Duration) -> PlanSeen {
    let mut seen = PlanSeen::default();
    if tokio::time::timeout(limit, follow(events, &mut seen))
        .await
        .is_err()
    {
        seen.error = Some(not_reached(limit));
    }
    seen
}

/// [`to_result`], calling `poll` every 100 ms meanwhile (the drill watches its nodes).
pub async fn to_result_polling(
    events: &mut Receiver<PlanEvent>,
    limit: Duration,
    poll: &mut dyn FnMut(),
) -> PlanSeen {
    let mut seen = PlanSeen::default();
    let mut timed_out = false;
    {
        let follow = follow(events, &mut seen);
        tokio::pin!(follow);
        let follow_deadline = tokio::time::sleep(limit);
        tokio::pin!(follow_deadline);
        loop {
            tokio::select! {
                _ = &mut follow => break,
                _ = &mut follow_deadline => {
                    timed_out = true;
                    break;
                }
                _ = tokio::time::sleep(Duration::from_millis(100)) => poll(),
            }
        }
    }
    if timed_out {
        seen.error = Some(not_reached(limit));
    }
    seen
}

fn not_reached(limit: Duration) -> String {
    format!(
        "the agent pipeline did not reach a checkpoint result within {}",
        crate::duration::display(limit)
    )
}

/// Note what the plan says into `seen` until its checkpoint result (or the broadcast closes); a
/// lagging receiver skips what it missed.
async fn follow(events: &mut Receiver<PlanEvent>, seen: &mut PlanSeen) {
    loop {
        match events.recv().await {
            Ok(PlanEvent::NoticeSeen { notice, at }) => {
                seen.seen_at = Some(at);
                seen.deadline = notice.deadline;
            }
            Ok(PlanEvent::Signalled {
                at,
                processes,
                checkpoint_deadline,
                ..
            }) => {
                seen.signalled_at = Some(at);
                seen.processes = processes;
                seen.checkpoint_deadline = Some(checkpoint_deadline);
            }
            Ok(PlanEvent::Checkpointed { at, results, .. }) => {
                seen.result_at = Some(at);
                seen.results = results;
                break;
            }
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => {}
            Err(_) => break,
        }
    }
}

/// The report of the plan's staged checkpoint upload, once it ended; `None` when the broadcast
/// closed first.
pub async fn upload(events: &mut Receiver<PlanEvent>) -> Option<Box<crate::upload::Report>> {
    loop {
        match events.recv().await {
            Ok(PlanEvent::Uploaded { report, .. }) => return Some(report),
            Ok(_) | Err(RecvError::Lagged(_)) => {}
            Err(_) => return None,
        }
    }
}
