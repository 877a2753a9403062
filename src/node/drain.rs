//! What the drain shares with the rest of the agent, whatever carries it out: the [`PodWatch`]
//! seam through which the agent's watch of this node's pods tells the drain when an evicted pod
//! is gone, and the one-line summary of a [`DrainReport`]. The Eviction API drain itself is
//! Kubernetes-only and lives in `node::kube::drain`.

use k8s_openapi::api::core::v1::ObjectReference;
use tokio::time::Instant;

use super::DrainReport;

/// What a watch of this node's pods knows about one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPresence {
    /// This pod (this uid) is gone: the watch saw it deleted, or a list the watch made after the
    /// drain's own list does not have it.
    Gone,
    /// The watch is healthy and has not seen it go.
    Present,
    /// The watch is not healthy (never synced, or failing since): ask the API server.
    Unknown,
}

/// A watch of this node's pods that the agent keeps anyway (the checkpoint pod cache), so that
/// the drain learns from it when an evicted pod is gone instead of polling the API server for
/// each pod. Defined here so that `node` imports nothing of the watch's owner; the app hands it
/// over ([`super::kube::KubeNodeOps::set_pod_watch`]).
pub trait PodWatch: Send + Sync {
    /// Whether the pod with `uid` is gone. `listed_at`: when the drain's list of the node's pods
    /// returned (a list the watch made after that moment is authoritative for absence).
    fn presence(&self, uid: &str, listed_at: Instant) -> PodPresence;
    /// Marked changed after every update the watch applies and every change of its health.
    fn changes(&self) -> tokio::sync::watch::Receiver<()>;
    /// The controller (ownerReference with `controller: true`) of the pod with `uid` as the
    /// watch last saw it, kept a while after the pod is gone: a goodput Event's `related`
    /// without reading the pod (a drained pod is gone by the time its Event is posted).
    /// `Some(None)`: the watch saw the pod and it has no controller; `None`: the watch never saw
    /// it (the caller may ask the API server).
    fn controller(&self, uid: &str) -> Option<Option<ObjectReference>>;
}

/// One line for a `DrainBlocked` Event or log: every pod still on the node, the PDBs that held
/// it and why (empty when the drain completed).
pub fn blocked_summary(report: &DrainReport) -> String {
    if report.blocked.is_empty() {
        return String::new();
    }
    let pods: Vec<String> = report
        .blocked
        .iter()
        .map(|b| {
            if b.pdbs.is_empty() {
                format!("{} ({})", b.pod, b.reason)
            } else {
                format!(
                    "{} (PodDisruptionBudget {}: {})",
                    b.pod,
                    b.pdbs.join(", "),
                    b.reason
                )
            }
        })
        .collect();
    format!(
        "{} pod(s) still on the node at the deadline: {}",
        report.blocked.len(),
        pods.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::BlockedPod;

    #[test]
    fn blocked_summary_names_pods_and_budgets() {
        assert_eq!(blocked_summary(&DrainReport::default()), "");
        let report = DrainReport {
            blocked: vec![
                BlockedPod {
                    pod: "db/pg-0".into(),
                    pdbs: vec!["pg-pdb".into()],
                    reason: "eviction refused (429 TooManyRequests)".into(),
                },
                BlockedPod {
                    pod: "a/stuck".into(),
                    pdbs: Vec::new(),
                    reason: "evicted, still terminating at the deadline".into(),
                },
            ],
            ..Default::default()
        };
        assert_eq!(
            blocked_summary(&report),
            "2 pod(s) still on the node at the deadline: db/pg-0 (PodDisruptionBudget pg-pdb: \
             eviction refused (429 TooManyRequests)); a/stuck (evicted, still terminating at the deadline)"
        );
    }
}
