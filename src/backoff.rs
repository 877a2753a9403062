//! The project's one retry backoff: exponential from a base, capped, with equal jitter.
//!
//! Failure `n` (1-based) of a run waits a uniformly random time in `[d/2, d]` with
//! `d = min(base · 2^(n−1), cap)`. A success [`reset`](Backoff::reset)s the run. Callers that
//! retry at a fixed cadence use [`jittered`] of one step, which is the same jitter.
//!
//! Why equal jitter (`[d/2, d]`) and not full jitter (`[0, d]`): every retry here goes to a
//! service that just failed or refused (the API server answering 429 for a PodDisruptionBudget, a
//! metadata service in a 5xx storm, a webhook receiver, a crashed child process). Half the step
//! is a floor, so a retry never comes back at once and the number of tries that fit before a
//! deadline is bounded (at most `left / (d/2)`); the other half spreads the agents of a node pool
//! that all failed at the same moment. The ceiling `d` is never exceeded, so a caller can reason
//! about its worst case, and [`Backoff::next_delay_before`] never plans a wait that reaches a
//! deadline.

use std::time::Duration;

use tokio::time::Instant;

/// Uniformly random in `[step/2, step]`: the jitter of every wait in this module.
pub fn jittered(step: Duration) -> Duration {
    let half = step / 2;
    let spread = u64::try_from((step - half).as_nanos()).unwrap_or(u64::MAX);
    half + Duration::from_nanos(fastrand::u64(0..=spread))
}

/// Capped exponential backoff with equal jitter (see the module doc). Counts the failures of the
/// current run; [`reset`](Self::reset) after a success.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    failures: u32,
}

impl Backoff {
    /// `base` is the step of the first failure; the step doubles up to `cap` (a cap below the
    /// base is taken as the base).
    pub const fn new(base: Duration, cap: Duration) -> Self {
        let cap = if cap.as_nanos() < base.as_nanos() {
            base
        } else {
            cap
        };
        Backoff {
            base,
            cap,
            failures: 0,
        }
    }

    /// The step `d` (before jitter) of failure `n` (1-based; 0 is taken as 1).
    pub fn step(&self, n: u32) -> Duration {
        let exp = n.saturating_sub(1).min(31);
        self.base
            .checked_mul(1u32 << exp)
            .unwrap_or(self.cap)
            .min(self.cap)
    }

    /// The jittered delay after failure `n` (1-based) of a run, without recording it: for callers
    /// that count attempts themselves.
    pub fn delay(&self, n: u32) -> Duration {
        jittered(self.step(n))
    }

    /// Record one more failure and return the delay before the next attempt.
    pub fn next_delay(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        self.delay(self.failures)
    }

    /// [`next_delay`](Self::next_delay), but `None` when waiting it would reach `deadline`: the
    /// next attempt could not start in time (the failure is recorded either way).
    pub fn next_delay_before(&mut self, deadline: Instant) -> Option<Duration> {
        let delay = self.next_delay();
        (Instant::now() + delay < deadline).then_some(delay)
    }

    /// Failures recorded since the last reset.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Start a new run: the next failure waits about `base` again.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_up_to_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let expected_steps = [1u64, 2, 4, 8, 16, 30, 30, 30];
        for step in expected_steps {
            let d = b.next_delay();
            let full = Duration::from_secs(step);
            assert!(d >= full / 2 && d <= full, "step {step}: {d:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_secs(1));
    }

    #[test]
    fn backoff_survives_many_failures() {
        let mut b = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
        for _ in 0..200 {
            assert!(b.next_delay() <= Duration::from_secs(30));
        }
    }

    #[test]
    fn steps_grow_from_the_base_and_stop_at_the_cap() {
        let b = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        let steps: Vec<u64> = (0..=8).map(|n| b.step(n).as_millis() as u64).collect();
        assert_eq!(steps, [50, 50, 100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(b.step(u32::MAX), Duration::from_secs(1));
        // A huge base saturates at the cap instead of overflowing.
        let big = Backoff::new(Duration::from_secs(u64::MAX / 4), Duration::MAX);
        assert_eq!(big.step(40), Duration::MAX);
    }

    #[test]
    fn every_delay_is_within_half_a_step_and_the_step() {
        let b = Backoff::new(Duration::from_millis(3), Duration::from_millis(777));
        for n in 1..40 {
            let step = b.step(n);
            for _ in 0..50 {
                let d = b.delay(n);
                assert!(d >= step / 2 && d <= step, "failure {n}: {d:?} vs {step:?}");
            }
        }
        // The jitter really spreads: not every draw is the same.
        let draws: std::collections::BTreeSet<Duration> =
            (0..50).map(|_| jittered(Duration::from_secs(1))).collect();
        assert!(draws.len() > 1);
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_cap_below_the_base_is_the_base() {
        let b = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(b.step(1), Duration::from_secs(2));
        assert_eq!(b.step(10), Duration::from_secs(2));
    }

    #[test]
    fn failures_count_until_reset() {
        let mut b = Backoff::new(Duration::from_millis(1), Duration::from_millis(8));
        for _ in 0..5 {
            b.next_delay();
        }
        assert_eq!(b.failures(), 5);
        assert!(b.next_delay() >= Duration::from_millis(4));
        b.reset();
        assert_eq!(b.failures(), 0);
        assert!(b.next_delay() <= Duration::from_millis(1));
    }

    #[test]
    fn no_delay_reaches_the_deadline() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(8));
        let deadline = Instant::now() + Duration::from_secs(3);
        // Steps 1 s and 2 s end before a deadline 3 s away.
        assert!(b.next_delay_before(deadline).is_some());
        assert!(b.next_delay_before(deadline).is_some());
        // Step 8 s waits at least 4 s: past the deadline. The failure still counts.
        b.next_delay();
        assert_eq!(b.next_delay_before(deadline), None);
        assert_eq!(b.failures(), 4);
        // A deadline already here never plans a wait.
        b.reset();
        assert_eq!(b.next_delay_before(Instant::now()), None);
        assert_eq!(b.failures(), 1);
        // What is returned always ends before the deadline.
        let near = Instant::now() + Duration::from_millis(2500);
        for _ in 0..20 {
            b.reset();
            for _ in 0..3 {
                if let Some(d) = b.next_delay_before(near) {
                    assert!(Instant::now() + d < near);
                }
            }
        }
    }
}
