//! One API call's bound, and the node's reads and writes: GET with retries, the
//! resourceVersion-guarded read-modify-write (a 409 re-reads almost at once, transient errors
//! back off), and the patch that needs no precondition.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use serde_json::{json, Value};

use super::{KubeNodeOps, FIELD_MANAGER};
use crate::backoff::{jittered, Backoff};
use crate::node::Error;

/// Attempts of one node read-modify-write (conflicts and transient errors together).
const NODE_WRITE_ATTEMPTS: u32 = 8;
/// Retries of API requests after 429 / 5xx / transport errors: 50 ms doubling to 1 s.
pub(crate) const API_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
/// Pause before re-reading the node after a 409 conflict: 10–20 ms, just enough to spread
/// writers that collided.
const CONFLICT_PAUSE: Duration = Duration::from_millis(20);
/// Bound on any single API request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The change one node patch makes, as told by the planning closure.
pub(super) struct Rmw<T> {
    /// The change of the patch that succeeded (`None`: nothing needed doing).
    pub(super) applied: Option<T>,
    /// Changes of attempts whose outcome is unknown (5xx / transport error after sending).
    pub(super) ambiguous: Vec<T>,
}

impl KubeNodeOps {
    /// GET the node once (and remember its UID for Event references).
    async fn get_node_once(&self) -> Result<Node, ::kube::Error> {
        let node = with_timeout(self.nodes.get(&self.node_name)).await?;
        if let Some(uid) = &node.metadata.uid {
            if let Ok(mut g) = self.node_uid.lock() {
                *g = Some(uid.clone());
            }
        }
        Ok(node)
    }

    /// GET the node, retrying transient errors.
    pub(super) async fn get_node(&self) -> Result<Node, Error> {
        let mut backoff = API_BACKOFF;
        loop {
            match self.get_node_once().await {
                Ok(node) => return Ok(node),
                Err(e)
                    if crate::node::kube_retryable(&e)
                        && backoff.failures() + 1 < NODE_WRITE_ATTEMPTS =>
                {
                    tracing::debug!(node = %self.node_name, error = %e, "reading node failed, retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    return Err(Error::GetNode {
                        node: self.node_name.clone(),
                        source,
                    })
                }
            }
        }
    }

    /// One resourceVersion-guarded read-modify-write of the node. `plan` returns the merge patch
    /// (without resourceVersion) and a description of the change, or `None` when the node is
    /// already as wanted.
    pub(super) async fn modify_node<T, F>(
        &self,
        what: &'static str,
        mut plan: F,
    ) -> Result<Rmw<T>, Error>
    where
        F: FnMut(&Node) -> Option<(Value, T)>,
    {
        let mut ambiguous = Vec::new();
        let mut last_error: Option<::kube::Error> = None;
        for attempt in 0..NODE_WRITE_ATTEMPTS {
            if attempt > 0 {
                tokio::time::sleep(retry_pause(attempt, last_error.as_ref())).await;
            }
            let node = match self.get_node_once().await {
                Ok(node) => node,
                Err(e) if crate::node::kube_retryable(&e) => {
                    tracing::debug!(node = %self.node_name, what, attempt, error = %e, "reading node failed, retrying");
                    last_error = Some(e);
                    continue;
                }
                Err(source) => {
                    return Err(Error::GetNode {
                        node: self.node_name.clone(),
                        source,
                    })
                }
            };
            let Some((patch, change)) = plan(&node) else {
                return Ok(Rmw {
                    applied: None,
                    ambiguous,
                });
            };
            if self.dry_run {
                tracing::info!(node = %self.node_name, what, patch = %patch, "dry-run: would patch node");
                return Ok(Rmw {
                    applied: Some(change),
                    ambiguous,
                });
            }
            match self.patch_guarded(&node, patch).await {
                Ok(()) => {
                    return Ok(Rmw {
                        applied: Some(change),
                        ambiguous,
                    })
                }
                Err(::kube::Error::Api(s)) if s.code == 409 => {
                    tracing::debug!(node = %self.node_name, what, attempt, "node changed underneath, re-reading");
                    last_error = Some(::kube::Error::Api(s));
                }
                Err(e) if crate::node::kube_retryable(&e) => {
                    tracing::debug!(node = %self.node_name, what, attempt, error = %e, "node patch failed, retrying");
                    // The write may have landed: remember what it would have changed.
                    ambiguous.push(change);
                    last_error = Some(e);
                }
                Err(source) => {
                    return Err(Error::PatchNode {
                        node: self.node_name.clone(),
                        what,
                        source,
                    })
                }
            }
        }
        Err(self.write_exhausted(what, last_error))
    }

    /// The merge patch `patch`, guarded by the resourceVersion of `node` as read.
    async fn patch_guarded(&self, node: &Node, mut patch: Value) -> Result<(), ::kube::Error> {
        patch["metadata"]["resourceVersion"] = json!(node.metadata.resource_version);
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        with_timeout(
            self.nodes
                .patch(&self.node_name, &params, &Patch::Merge(&patch)),
        )
        .await
        .map(|_| ())
    }

    /// The error of a read-modify-write that ran out of attempts: a conflict when the last
    /// failure was one (or there was none), else the last failure.
    fn write_exhausted(&self, what: &'static str, last_error: Option<::kube::Error>) -> Error {
        match last_error {
            Some(::kube::Error::Api(s)) if s.code == 409 => Error::Conflict {
                node: self.node_name.clone(),
                attempts: NODE_WRITE_ATTEMPTS,
            },
            Some(source) => Error::PatchNode {
                node: self.node_name.clone(),
                what,
                source,
            },
            None => Error::Conflict {
                node: self.node_name.clone(),
                attempts: NODE_WRITE_ATTEMPTS,
            },
        }
    }

    /// A patch that needs no precondition (spotguard's own annotation or conditions), retried on
    /// transient errors.
    pub(super) async fn patch_blind(
        &self,
        what: &'static str,
        status: bool,
        patch: Patch<Value>,
    ) -> Result<(), Error> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..Default::default()
        };
        let mut backoff = API_BACKOFF;
        loop {
            let result = if status {
                with_timeout(self.nodes.patch_status(&self.node_name, &params, &patch)).await
            } else {
                with_timeout(self.nodes.patch(&self.node_name, &params, &patch)).await
            };
            match result {
                Ok(_) => return Ok(()),
                Err(e)
                    if crate::node::kube_retryable(&e)
                        && backoff.failures() + 1 < NODE_WRITE_ATTEMPTS =>
                {
                    tracing::debug!(node = %self.node_name, what, error = %e, "node patch failed, retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                Err(source) => {
                    return Err(Error::PatchNode {
                        node: self.node_name.clone(),
                        what,
                        source,
                    })
                }
            }
        }
    }
}

/// Run one API call with [`REQUEST_TIMEOUT`]; a timeout becomes a (retryable) service error.
pub(crate) async fn with_timeout<T>(
    fut: impl std::future::Future<Output = Result<T, ::kube::Error>>,
) -> Result<T, ::kube::Error> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(r) => r,
        Err(_) => Err(::kube::Error::Service(
            format!("request timed out after {}s", REQUEST_TIMEOUT.as_secs()).into(),
        )),
    }
}

/// The pause before attempt `attempt` of a read-modify-write: a conflict re-reads at once (tiny
/// jitter); anything else backs off.
fn retry_pause(attempt: u32, last_error: Option<&::kube::Error>) -> Duration {
    let conflict = matches!(last_error, Some(::kube::Error::Api(s)) if s.code == 409);
    if conflict {
        jittered(CONFLICT_PAUSE)
    } else {
        API_BACKOFF.delay(attempt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_jittered() {
        let mut backoff = API_BACKOFF;
        for _ in 0..20 {
            let d = backoff.next_delay();
            assert!(d >= Duration::from_millis(25), "{d:?}");
            assert!(d <= Duration::from_millis(1500), "{d:?}");
        }
    }
}
