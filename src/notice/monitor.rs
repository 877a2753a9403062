//! The per-source monitor loop: poll a [`NoticeSource`] forever, forward every notice to the
//! store, count polls and errors, back off on errors, and record readiness in [`PollHealth`].
//!
//! Error accounting (shared with the sources): `spotguard_metadata_errors_total{source,error}`
//! counts every failed *endpoint request*. A source whose poll covers several endpoints (EC2's
//! three paths, GCE's watched keys) returns `Ok` with the notices it found as long as at least one
//! endpoint answered, and counts and logs the failed ones itself through its `ErrorReporter`; only
//! when every endpoint failed does `poll` return `Err`, which this loop counts and backs off on.
//! So a partial outage never hides the notices of the endpoints that still answer, and readiness
//! ("a poll succeeded recently") means "at least one endpoint of this source answered".

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Error, Notice, NoticeSource};
use crate::backoff::Backoff;
use crate::metrics::{ErrorLabels, Metrics, SourceLabels};
use crate::sync::lock;

/// Readiness window: a source is healthy while it polled successfully within this many intervals.
const READY_INTERVALS: u32 = 5;

/// Backoff and log-limiting knobs of [`run_monitor_with`]. [`MonitorPolicy::default`] is what
/// [`run_monitor`] uses: backoff 1 s doubling to 5 s ([`crate::backoff`]: each wait 50–100 % of the step), an error
/// logged first, then every 10th consecutive one or at least every 30 s. The cap is short on
/// purpose: a notice gives 30–120 s, so a 5xx storm must not hide it for long; the metadata
/// service is link-local and a 1 Hz poll is what the clouds document.
#[derive(Clone, Debug)]
pub struct MonitorPolicy {
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    pub log_every_n: u64,
    pub log_every: Duration,
}

impl Default for MonitorPolicy {
    fn default() -> Self {
        MonitorPolicy {
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(5),
            log_every_n: 10,
            log_every: Duration::from_secs(30),
        }
    }
}

/// Decides which errors of a run of consecutive errors get logged: the first one, every
/// `every_n`-th, and any error at least `every` after the last logged one. The time of the last
/// logged line survives successes, so a flapping endpoint does not log on every error either.
#[derive(Debug)]
pub(crate) struct LogLimiter {
    every_n: u64,
    every: Duration,
    consecutive: u64,
    suppressed: u64,
    last_logged: Option<Instant>,
    logged_in_run: bool,
}

impl LogLimiter {
    pub(crate) fn new(every_n: u64, every: Duration) -> Self {
        LogLimiter {
            every_n: every_n.max(1),
            every,
            consecutive: 0,
            suppressed: 0,
            last_logged: None,
            logged_in_run: false,
        }
    }

    /// Record an error. `Some(suppressed)` when this one should be logged, with the number of
    /// errors not logged since the previous line.
    pub(crate) fn error(&mut self, now: Instant) -> Option<u64> {
        self.consecutive += 1;
        let due = match self.last_logged {
            None => true,
            Some(last) => {
                self.consecutive % self.every_n == 0
                    || now.saturating_duration_since(last) >= self.every
            }
        };
        if due {
            let suppressed = std::mem::take(&mut self.suppressed);
            self.last_logged = Some(now);
            self.logged_in_run = true;
            Some(suppressed)
        } else {
            self.suppressed += 1;
            None
        }
    }

    /// Record a success. `Some(n)` when a run of `n` consecutive errors, at least one of which was
    /// logged, just ended (worth a "recovered" line).
    pub(crate) fn success(&mut self) -> Option<u64> {
        let run = std::mem::take(&mut self.consecutive);
        self.suppressed = 0;
        let logged = std::mem::take(&mut self.logged_in_run);
        (run > 0 && logged).then_some(run)
    }

    pub(crate) fn consecutive(&self) -> u64 {
        self.consecutive
    }
}

/// Counts and logs (rate-limited) the failures of single endpoints inside a source's poll that
/// did not make the whole poll fail (see the module docs).
pub(crate) struct ErrorReporter {
    source: &'static str,
    metrics: Arc<Metrics>,
    limiter: Mutex<LogLimiter>,
}

impl ErrorReporter {
    pub(crate) fn new(source: &'static str, metrics: Arc<Metrics>) -> Self {
        let policy = MonitorPolicy::default();
        ErrorReporter {
            source,
            metrics,
            limiter: Mutex::new(LogLimiter::new(policy.log_every_n, policy.log_every)),
        }
    }

    /// Count `err` in `spotguard_metadata_errors_total` and log it unless rate-limited.
    pub(crate) fn report(&self, err: &Error) {
        count_error(&self.metrics, self.source, err);
        let logged = lock(&self.limiter).error(Instant::now());
        if let Some(suppressed) = logged {
            tracing::warn!(
                source = self.source,
                error = %err,
                suppressed,
                "metadata endpoint failed; polling goes on"
            );
        }
    }

    /// Note an all-endpoints-answered poll (ends a logged run of partial failures).
    pub(crate) fn all_ok(&self) {
        if let Some(run) = lock(&self.limiter).success() {
            tracing::info!(
                source = self.source,
                errors = run,
                "all metadata endpoints answer again"
            );
        }
    }
}

fn count_error(metrics: &Metrics, source: &str, err: &Error) {
    metrics
        .metadata_errors
        .get_or_create(&ErrorLabels {
            source: source.to_string(),
            error: err.metric_label().to_string(),
        })
        .inc();
}

#[derive(Debug)]
struct SourceHealth {
    interval: Duration,
    last_success: Option<Instant>,
    last_ok: bool,
}

/// Last poll outcome per source, for `/readyz`.
#[derive(Debug, Default)]
pub struct PollHealth {
    sources: Mutex<HashMap<&'static str, SourceHealth>>,
}

impl PollHealth {
    pub fn new() -> Self {
        PollHealth::default()
    }

    /// Declare a source (done by [`run_monitor`] at start). Re-registering keeps its history.
    pub fn register(&self, source: &'static str, interval: Duration) {
        lock(&self.sources)
            .entry(source)
            .and_modify(|h| h.interval = interval)
            .or_insert(SourceHealth {
                interval,
                last_success: None,
                last_ok: false,
            });
    }

    /// Record the outcome of one poll of `source` that ended at `now`.
    pub fn record(&self, source: &'static str, ok: bool, now: Instant) {
        let mut sources = lock(&self.sources);
        let h = sources.entry(source).or_insert(SourceHealth {
            interval: Duration::ZERO,
            last_success: None,
            last_ok: false,
        });
        h.last_ok = ok;
        if ok {
            h.last_success = Some(now);
        }
    }

    /// True when at least one source polled successfully within 5 × its poll interval. A
    /// hanging-GET source (interval zero) counts as healthy while its last poll completed without
    /// error: the GET it is hanging on now is the next poll in progress.
    pub fn ready(&self, now: Instant) -> bool {
        lock(&self.sources).values().any(|h| match h.last_success {
            None => false,
            Some(_) if h.interval.is_zero() => h.last_ok,
            Some(at) => now.saturating_duration_since(at) <= h.interval * READY_INTERVALS,
        })
    }
}

/// Poll `source` until `cancel` fires, with the default [`MonitorPolicy`].
pub async fn run_monitor(
    source: Arc<dyn NoticeSource>,
    tx: mpsc::Sender<Notice>,
    metrics: Arc<Metrics>,
    health: Arc<PollHealth>,
    cancel: CancellationToken,
) {
    run_monitor_with(
        source,
        tx,
        metrics,
        health,
        cancel,
        MonitorPolicy::default(),
    )
    .await
}

/// [`run_monitor`] with explicit backoff and log-limiting settings. Returns when `cancel` fires
/// (also in the middle of a hanging poll) or when the notice receiver is gone.
#[tracing::instrument(name = "monitor", skip_all, fields(source = source.name()))]
pub async fn run_monitor_with(
    source: Arc<dyn NoticeSource>,
    tx: mpsc::Sender<Notice>,
    metrics: Arc<Metrics>,
    health: Arc<PollHealth>,
    cancel: CancellationToken,
    policy: MonitorPolicy,
) {
    let name = source.name();
    let interval = source.poll_interval();
    health.register(name, interval);
    // A clone of the counter (shared storage), not the family's lock guard, is kept across awaits.
    let polls = metrics
        .metadata_polls
        .get_or_create(&SourceLabels {
            source: name.to_string(),
        })
        .clone();
    let mut backoff = error_backoff(&policy, interval);
    let mut limiter = LogLimiter::new(policy.log_every_n, policy.log_every);
    tracing::info!(interval = ?interval, "notice monitor started");

    loop {
        let result = tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            r = source.poll() => r,
        };
        let delay = match result {
            Ok(notices) => {
                polls.inc();
                health.record(name, true, Instant::now());
                backoff.reset();
                if let Some(run) = limiter.success() {
                    tracing::info!(errors = run, "metadata polling recovered");
                }
                if !forward(notices, &tx, &cancel).await {
                    return;
                }
                interval
            }
            Err(err) => {
                count_error(&metrics, name, &err);
                health.record(name, false, Instant::now());
                let delay = backoff.next_delay();
                if let Some(suppressed) = limiter.error(Instant::now()) {
                    tracing::warn!(
                        error = %err,
                        retryable = err.is_retryable(),
                        consecutive = limiter.consecutive(),
                        suppressed,
                        retry_in = %crate::duration::display(delay),
                        "metadata poll failed"
                    );
                }
                delay
            }
        };
        if !delay.is_zero() {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
    tracing::info!("notice monitor stopped");
}

/// The backoff after failed polls: from the policy's base, or from the poll interval when that
/// is shorter, up to the policy's cap.
fn error_backoff(policy: &MonitorPolicy, interval: Duration) -> Backoff {
    let base = if interval.is_zero() {
        policy.backoff_base
    } else {
        policy.backoff_base.min(interval)
    };
    Backoff::new(base, policy.backoff_cap.max(base))
}

/// Send the notices of one poll on; false when the monitor must stop (cancelled, or the
/// receiver is gone).
async fn forward(
    notices: Vec<Notice>,
    tx: &mpsc::Sender<Notice>,
    cancel: &CancellationToken,
) -> bool {
    for notice in notices {
        tracing::debug!(notice_id = %notice.id, kind = notice.kind.label(), "notice seen");
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return false,
            sent = tx.send(notice) => if sent.is_err() {
                tracing::warn!("notice receiver is gone; monitor stops");
                return false;
            },
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_limiter_logs_first_every_nth_and_after_interval() {
        let t0 = Instant::now();
        let mut l = LogLimiter::new(10, Duration::from_secs(30));
        assert_eq!(l.error(t0), Some(0));
        let logged: Vec<u64> = (2..=25)
            .filter(|_| l.error(t0 + Duration::from_secs(1)).is_some())
            .collect();
        // 2..=25 is 24 errors; the 10th and 20th consecutive ones are logged.
        assert_eq!(logged.len(), 2);
        assert_eq!(l.error(t0 + Duration::from_secs(40)), Some(5));
        assert_eq!(l.success(), Some(26));
        // A new error right after recovery is within 30 s of the last line: suppressed.
        assert_eq!(l.error(t0 + Duration::from_secs(41)), None);
        // A run with nothing logged ends silently.
        assert_eq!(l.success(), None);
    }

    #[test]
    fn readiness_needs_a_recent_success() {
        let h = PollHealth::new();
        let t0 = Instant::now();
        assert!(!h.ready(t0), "no source registered");
        h.register("aws", Duration::from_secs(1));
        assert!(!h.ready(t0), "never polled");
        h.record("aws", true, t0);
        assert!(h.ready(t0 + Duration::from_secs(4)));
        h.record("aws", false, t0 + Duration::from_secs(2));
        assert!(
            h.ready(t0 + Duration::from_secs(5)),
            "success within 5 intervals"
        );
        assert!(!h.ready(t0 + Duration::from_secs(6)));
    }

    #[test]
    fn hanging_source_is_ready_while_its_last_poll_succeeded() {
        let h = PollHealth::new();
        let t0 = Instant::now();
        h.register("gce", Duration::ZERO);
        assert!(!h.ready(t0));
        h.record("gce", true, t0);
        assert!(
            h.ready(t0 + Duration::from_secs(3600)),
            "hanging GET in progress"
        );
        h.record("gce", false, t0 + Duration::from_secs(3600));
        assert!(!h.ready(t0 + Duration::from_secs(3600)));
        // One healthy source is enough.
        h.register("aws", Duration::from_secs(1));
        h.record("aws", true, t0 + Duration::from_secs(3600));
        assert!(h.ready(t0 + Duration::from_secs(3601)));
    }
}
