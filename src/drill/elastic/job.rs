//! What both ways of running the elastic drill share: the job as the notice and the power-off see
//! it ([`Job`]), what the notice goes to ([`Target`]), and the interruption itself from the
//! notice to the end of `--settle` ([`interrupt`]).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;

use super::report::ElasticVerdict;
use crate::checkpoint::procfs::ProcFs;
use crate::drill::pipeline::Pipeline;
use crate::drill::workdir::WorkDir;
use crate::drill::{follow, say, DrillArgs};
use crate::emulator::EmulatorHandle;

/// `--kill-after`, else the cloud's notice lead.
pub(super) fn kill_after(args: &DrillArgs) -> Duration {
    args.kill_after
        .unwrap_or_else(|| args.cloud.facts().interruption_notice)
}

/// Keep the drill's temp dir and say where it is (`--keep`), or delete it.
pub(super) fn keep_work(args: &DrillArgs, work: WorkDir) {
    if args.keep {
        say(
            args.json,
            format!("  drill dir (kept): {}", work.path().display()),
        );
        work.keep(true);
    }
}

/// The job as the notice and the power-off see it: the `--nodes` commands (`Nodes`), or one
/// launcher running every node (`launcher`).
pub(super) trait Job {
    /// Note what the job's processes did (every 100 ms from the notice to the power-off).
    fn watch(&mut self, proc: &ProcFs);

    /// Look at the interrupted node once more, right before its power-off.
    fn last_look(&mut self, proc: &ProcFs) {
        self.watch(proc);
    }

    /// The power-off: kill the interrupted node's processes (SIGKILL) and note how many.
    fn kill(&mut self, proc: &ProcFs);

    /// Note what the rest of the job did (every 100 ms during `--settle`).
    fn settle(&mut self, proc: &ProcFs) {
        self.watch(proc);
    }
}

/// What the notice goes to, and what the verdict names.
pub(super) struct Target {
    /// The interrupted node (1-based).
    pub doomed: u32,
    /// Its notice dir.
    pub dir: PathBuf,
    /// The pidfiles naming its processes to the pipeline.
    pub pidfiles: Vec<PathBuf>,
    /// The command, as the verdict shows it.
    pub command: String,
    /// When the job started.
    pub started_at: Timestamp,
}

/// From the notice to the end of `--settle`, watching `job` all along: raise the notice against
/// `target` and follow the plan to its checkpoint result ([`notice_phase`]); at the power-off
/// (`--kill-after` after the notice) kill the interrupted node; then `--settle` longer.
pub(super) async fn interrupt(
    args: &DrillArgs,
    emu: EmulatorHandle,
    work: &WorkDir,
    target: Target,
    cancel: &CancellationToken,
    proc: &ProcFs,
    job: &mut impl Job,
) -> Result<ElasticVerdict, String> {
    let mut v = notice_phase(args, emu, work, target, cancel, &mut || job.watch(proc)).await?;
    let power_off = power_off_instant(&v, kill_after(args));
    watch_until(power_off, cancel, || job.watch(proc)).await;
    job.last_look(proc);
    v.power_off_at = Some(Timestamp::now());
    job.kill(proc);
    let settle_end = Instant::now() + args.settle;
    watch_until(settle_end, cancel, || job.settle(proc)).await;
    Ok(v)
}

/// When the power-off comes: `kill_after` after the notice was raised.
fn power_off_instant(v: &ElasticVerdict, kill_after: Duration) -> Instant {
    let since = Timestamp::now().duration_since(v.raised_at).unsigned_abs();
    Instant::now() + kill_after.saturating_sub(since)
}

/// Call `poll` every 100 ms until `end` (or until cancelled).
async fn watch_until(end: Instant, cancel: &CancellationToken, mut poll: impl FnMut()) {
    while Instant::now() < end && !cancel.is_cancelled() {
        poll();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Raise the notice against the processes of `target` (the interrupted node) through the real
/// pipeline and follow the plan to its checkpoint result, calling `poll` every 100 ms meanwhile.
/// Shuts the emulator down.
async fn notice_phase(
    args: &DrillArgs,
    emu: EmulatorHandle,
    work: &WorkDir,
    target: Target,
    cancel: &CancellationToken,
    poll: &mut dyn FnMut(),
) -> Result<ElasticVerdict, String> {
    let state = work.state();
    let mut pipeline =
        Pipeline::start(args, emu, &target.dir, &state, &target.pidfiles, cancel).await?;
    let raised_at = pipeline.raise()?;
    let mut v = ElasticVerdict::started(
        args.cloud,
        target.command,
        target.doomed,
        target.started_at,
        raised_at,
    );
    // The nodes are watched while the pipeline runs, too.
    let limit = follow::limit(args.timeout, args.cloud);
    v.plan = follow::to_result_polling(pipeline.events(), limit, poll).await;
    pipeline.stop().await;
    Ok(v)
}
