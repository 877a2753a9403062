//! Test support shared by unit and integration tests: fakes for the seams and in-process servers.
//! Compiled into the library (integration tests need it) but used by no production path.
pub mod apiserver;
pub mod gpu;

use std::time::Duration;

use tokio::sync::broadcast;

use crate::responder::PlanEvent;

/// Wait up to `limit` for a plan event for which `f` returns `Some`; panics on timeout or when
/// the channel closes (test helper).
pub async fn wait_for_event<T>(
    events: &mut broadcast::Receiver<PlanEvent>,
    limit: Duration,
    mut f: impl FnMut(&PlanEvent) -> Option<T>,
) -> T {
    let found = tokio::time::timeout(limit, async {
        loop {
            match events.recv().await {
                Ok(e) => {
                    if let Some(v) = f(&e) {
                        return Some(v);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .await;
    match found {
        Ok(Some(v)) => v,
        Ok(None) => panic!("plan event channel closed"),
        Err(_) => panic!("timed out after {limit:?} waiting for a plan event"),
    }
}
