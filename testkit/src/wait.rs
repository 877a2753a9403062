//! Waiting for an event, never for a time: a test checks the thing it waits for every few
//! milliseconds until it holds, and gives up after a deadline with a panic that says what it
//! waited for (and, where the caller can say it, how things looked last). The deadline bounds a
//! failure; a passing test never sleeps it out.
//!
//! [`until_described`] is the one loop; [`until`] and [`eventually`] are its shapes for a
//! check that gives a value or a yes. [`eventually_blocking`] is the same wait for a test
//! without a runtime (a thread sleeps between checks).

use std::future::Future;
use std::time::{Duration, Instant};

/// How long a wait rests between two checks: short beside any deadline, long enough not to
/// busy-loop the machine the other tests share.
pub const PACE: Duration = Duration::from_millis(20);

/// Check `f` until it answers `Ok(value)`; while it waits it answers `Err(state)`. Panics after
/// `limit`, naming `what` and (when `describe` gives one) how the last state looked.
pub async fn until_described<T, S, F, Fut>(
    what: &str,
    limit: Duration,
    describe: impl Fn(&S) -> Option<String>,
    mut f: F,
) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, S>>,
{
    let start = tokio::time::Instant::now();
    loop {
        let last = match f().await {
            Ok(v) => return v,
            Err(state) => state,
        };
        if start.elapsed() > limit {
            match describe(&last) {
                Some(seen) => panic!("timed out after {limit:?}: {what}; last seen: {seen}"),
                None => panic!("timed out after {limit:?}: {what}"),
            }
        }
        tokio::time::sleep(PACE).await;
    }
}

/// Check `f` until it gives a value; panics after `limit`, naming `what`.
pub async fn until<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    until_described(
        what,
        limit,
        |_: &()| None,
        || {
            let next = f();
            async move { next.await.ok_or(()) }
        },
    )
    .await
}

/// Check `f` until it holds; panics after `limit`, naming `what`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    until(what, limit, || {
        let next = f();
        async move { next.await.then_some(()) }
    })
    .await
}

/// [`eventually`] for a test without a runtime: the calling thread sleeps between checks.
pub fn eventually_blocking(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > limit {
            panic!("timed out after {limit:?}: {what}");
        }
        std::thread::sleep(PACE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wait_returns_what_the_check_gave_once_it_holds() {
        let mut n = 0;
        let got = until("the third check", Duration::from_secs(5), || {
            n += 1;
            let now = n;
            async move { (now == 3).then_some(now) }
        })
        .await;
        assert_eq!(got, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "timed out after 50ms: the answer; last seen: 41")]
    async fn a_wait_past_its_deadline_says_what_it_waited_for_and_saw_last() {
        until_described(
            "the answer",
            Duration::from_millis(50),
            |s: &u32| Some(s.to_string()),
            || async { Err::<(), u32>(41) },
        )
        .await;
    }

    #[test]
    #[should_panic(expected = "timed out after 50ms: never")]
    fn a_blocking_wait_past_its_deadline_says_what_it_waited_for() {
        eventually_blocking("never", Duration::from_millis(50), || false);
    }
}
