//! The plan's steps, in order, behind one small interface ([`Step`]): each says whether it has
//! work in this plan (the policy, and the phase the record reached), when it must be over, and
//! runs to an outcome: the record it persists, the plan events it sends, what it hands to later
//! steps ([`super::plan::Found`]), and how the plan goes on ([`Flow`]).
//!
//! Adding a step is a file here and one line in [`SEQUENCE`] (docs/architecture.md, "Adding a
//! step").

mod ack_wait;
mod disruption;
mod drain;
mod expiry;
mod finish;
mod protect;
mod signal;
mod upload;

use async_trait::async_trait;
use jiff::Timestamp;
use tracing::debug;

use super::plan::Run;

pub(super) use protect::beside as protect_beside;

/// Every step a plan can take, in the order they run.
const SEQUENCE: &[&dyn Step] = &[
    &protect::Protect,
    &signal::Signal,
    &ack_wait::AckWait,
    &upload::Upload,
    &expiry::RebalanceExpiry,
    &drain::Drain,
    &upload::UploadEnd,
    &finish::Finish,
];

/// How the plan goes on after a step.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Flow {
    /// To the next step.
    Next,
    /// The plan is complete (its `Done` event follows).
    End,
    /// The plan stops here, incomplete (cancelled): a restarted agent resumes it from its record.
    Stop(String),
}

/// One step of a plan.
#[async_trait]
pub(super) trait Step: Sync {
    /// Its name in logs.
    fn name(&self) -> &'static str;
    /// Whether it has work in this plan: what the policy asks, and what the record says is done
    /// (a resumed plan skips what its earlier run finished).
    fn applies(&self, run: &Run) -> bool;
    /// Whether it runs in a plan that was cancelled (superseded by an interruption, or shutdown
    /// past its grace period). By default the plan stops before it; the steps from the signal to
    /// the end of the ack wait, and the finish after a drain, run once the plan got there.
    fn runs_when_cancelled(&self) -> bool {
        false
    }
    /// When it must be over.
    fn deadline(&self, run: &Run) -> Timestamp;
    /// Run it to its outcome.
    async fn run(&self, run: &mut Run) -> Flow;
}

/// Run the plan's steps in order. `Err` when the plan stopped before its end.
pub(super) async fn run(run: &mut Run) -> Result<(), String> {
    for step in SEQUENCE {
        if run.plan.cancel.is_cancelled() && !step.runs_when_cancelled() {
            return Err("cancelled".into());
        }
        if !step.applies(run) {
            continue;
        }
        debug!(step = step.name(), deadline = %step.deadline(run), "plan step");
        match step.run(run).await {
            Flow::Next => {}
            Flow::End => return Ok(()),
            Flow::Stop(why) => return Err(why),
        }
    }
    Ok(())
}
