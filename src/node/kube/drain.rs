//! Deadline-bounded drain of this node through the Eviction API (policy/v1).
//!
//! 1. List the pods with `fieldSelector=spec.nodeName=<node>`; [`crate::node::filter`] decides
//!    which to evict.
//! 2. Evict all of them concurrently (at most `concurrency` API requests in flight; waiting for a
//!    deletion holds no slot), each with `gracePeriodSeconds = min(pod's own, time left − 2 s)`
//!    and a UID precondition (a replacement pod with the same name is never evicted).
//!    201 ⇒ wait for the deletion; 404 ⇒ gone; 429 ⇒ a PodDisruptionBudget refuses: remember it
//!    (named in the Status cause, no extra RBAC) and retry every 1–2 s; 409 ⇒ check whether the pod
//!    was replaced, else retry; 5xx / transport ⇒ retry; 403 and anything else ⇒ blocked.
//! 3. Wait for the deletion. With a [`PodWatch`] (the agent's watch of this node's pods, wired
//!    by the app) the watch says when the pod is gone (deleted, or replaced by a new uid) and no
//!    request is made while it is healthy; only a pod still shown long after its grace period
//!    ([`OVERDUE_SLACK`]) is checked with one GET (then every [`OVERDUE_STEP`]), in case the
//!    watch stalled unnoticed. While the watch is not healthy (not synced, failing), and without
//!    one, poll GET (404 or a different UID ⇒ gone), backing off from 25 ms to 1 s.
//! 4. With `force_delete_at_deadline`, pods still refused [`FORCE_DELETE_LEAD`] before the
//!    deadline are deleted (grace capped to the time left).
//! 5. A held pod (`DrainRequest::holds`: its staged checkpoint is being uploaded) is evicted
//!    only once its hold ends; the others do not wait for it.
//! 6. At the deadline everything stops; the report names every pod still there and the PDBs
//!    that blocked it.
//!
//! Re-running is safe: pods already gone are simply not listed, pods already terminating are
//! evicted again (the API server lets a terminating pod through without a PDB check) and waited
//! for, so an agent restarted mid-drain converges.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::core::Status;
use kube::Client;
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

use crate::backoff::{jittered, Backoff};
use crate::metrics::{Metrics, OutcomeLabels};
use crate::node::drain::{PodPresence, PodWatch};
use crate::node::filter::{self, pod_key};
use crate::node::{
    kube_retryable, BlockedPod, DrainReport, DrainRequest, Error, FORCE_DELETE_LEAD,
};

/// Kept between the eviction's grace period and the deadline.
pub const GRACE_MARGIN: Duration = Duration::from_secs(2);
/// Default grace period of a pod that does not set one.
pub const DEFAULT_GRACE_SECONDS: i64 = 30;
/// Retry cadence for refused evictions (429, 5xx): [`jittered`], uniformly 1–2 s.
const RETRY_STEP: Duration = Duration::from_secs(2);
/// Retry after a 409 on the eviction (pod not replaced): [`jittered`], 125–250 ms.
const CONFLICT_STEP: Duration = Duration::from_millis(250);
/// Deletion polling (no watch, or the watch not healthy): 25 ms doubling up to 1 s.
const POLL_BACKOFF: Backoff = Backoff::new(Duration::from_millis(25), Duration::from_secs(1));
/// With a healthy watch: a pod it still shows this long after its grace period ran out is
/// checked with a GET (the kubelet removes a pod within a second or two of its grace period).
pub const OVERDUE_SLACK: Duration = Duration::from_secs(5);
/// …and again at this cadence ([`jittered`]) while it stays.
pub const OVERDUE_STEP: Duration = Duration::from_secs(5);

/// `gracePeriodSeconds` for an eviction or deletion with `left` before the deadline:
/// `min(own, left − 2 s)`, at least 1 s (0 would remove the pod object before its containers
/// stopped) unless the pod itself asks for 0.
pub fn grace_seconds(own: i64, left: Duration) -> i64 {
    if own <= 0 {
        return 0;
    }
    let cap = left.saturating_sub(GRACE_MARGIN).as_secs() as i64;
    own.min(cap.max(1))
}

/// Names of the PodDisruptionBudgets a 429 from the eviction subresource refers to. The API
/// server names the budget in a `DisruptionBudget` cause: "The disruption budget NAME needs …",
/// "… is still being processed …", "… does not allow evicting pods …".
pub fn pdb_names(status: &Status) -> Vec<String> {
    const PREFIX: &str = "The disruption budget ";
    let causes = status
        .details
        .as_ref()
        .map(|d| d.causes.as_slice())
        .unwrap_or(&[]);
    let mut names: Vec<String> = causes
        .iter()
        .filter(|c| c.reason == "DisruptionBudget" || c.message.starts_with(PREFIX))
        .filter_map(|c| c.message.strip_prefix(PREFIX))
        .chain(status.message.split(PREFIX).skip(1))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(|n| n.trim_end_matches(['.', ',', ':']).to_string())
        .filter(|n| !n.is_empty())
        .collect();
    names.sort();
    names.dedup();
    names
}

enum Outcome {
    /// Evicted and confirmed gone.
    Evicted,
    /// Already gone when we came to evict it.
    Gone,
    ForceDeleted,
    Blocked {
        pdbs: Vec<String>,
        reason: String,
    },
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Evicted => "evicted",
            Outcome::Gone => "gone",
            Outcome::ForceDeleted => "force_deleted",
            Outcome::Blocked { .. } => "blocked",
        }
    }
}

enum CallError {
    Deadline,
    Kube(::kube::Error),
}

/// One pod being evicted: what every attempt needs.
struct Target {
    name: String,
    ns: String,
    uid: Option<String>,
    /// The pod's own grace period (seconds).
    own_grace: i64,
    pods: Api<Pod>,
}

impl Target {
    fn of(pod: &Pod, client: &Client) -> Self {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        Target {
            name: pod.metadata.name.clone().unwrap_or_default(),
            uid: pod.metadata.uid.clone(),
            own_grace: own_grace(pod),
            pods: Api::namespaced(client.clone(), &ns),
            ns,
        }
    }
}

/// A pod's own `terminationGracePeriodSeconds`, [`DEFAULT_GRACE_SECONDS`] when unset.
fn own_grace(pod: &Pod) -> i64 {
    pod.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .unwrap_or(DEFAULT_GRACE_SECONDS)
}

/// What the refused attempts on one pod said so far: the disruption budgets named and the last
/// refusal.
#[derive(Default)]
struct Refusals {
    pdbs: BTreeSet<String>,
    last: Option<String>,
}

impl Refusals {
    fn blocked(self, reason: String) -> Outcome {
        Outcome::Blocked {
            pdbs: self.pdbs.into_iter().collect(),
            reason,
        }
    }
}

/// What one eviction attempt leaves the loop to do.
enum Attempt {
    /// Accepted: wait for the deletion.
    Accepted,
    /// Refused for now (paused already) or cut by the deadline: go round.
    Retry,
    Done(Outcome),
}

struct Drainer<'a> {
    client: &'a Client,
    deadline: Instant,
    force_at: Option<Instant>,
    permits: Arc<Semaphore>,
    watch: Option<&'a dyn PodWatch>,
    /// When the list of the pods to drain returned.
    listed_at: Instant,
}

impl Drainer<'_> {
    /// One API call holding a concurrency slot, bounded by the deadline.
    async fn call<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, ::kube::Error>>,
    ) -> Result<T, CallError> {
        let _permit = match tokio::time::timeout_at(self.deadline, self.permits.acquire()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) | Err(_) => return Err(CallError::Deadline),
        };
        match tokio::time::timeout_at(self.deadline, super::with_timeout(fut)).await {
            Ok(r) => r.map_err(CallError::Kube),
            Err(_) => Err(CallError::Deadline),
        }
    }

    /// Sleep `d` (or less: never past the deadline, nor past the force-delete moment when
    /// `until_force`).
    async fn pause(&self, d: Duration, until_force: bool) {
        let mut until = Instant::now() + d;
        if until_force {
            if let Some(f) = self.force_at {
                if f > Instant::now() {
                    until = until.min(f);
                }
            }
        }
        tokio::time::sleep_until(until.min(self.deadline)).await;
    }

    /// Evict one pod: attempt until the API server accepts (or the pod is gone, blocked for good,
    /// or due for a force delete), then wait for it to be gone.
    async fn evict(&self, pod: Pod) -> Outcome {
        let target = Target::of(&pod, self.client);
        let mut refusals = Refusals::default();
        loop {
            let now = Instant::now();
            if now >= self.deadline {
                let reason = refusals
                    .last
                    .take()
                    .unwrap_or_else(|| "deadline reached before the eviction was accepted".into());
                return refusals.blocked(reason);
            }
            if let (Some(force_at), Some(why)) = (self.force_at, &refusals.last) {
                if now >= force_at {
                    tracing::warn!(reason = %why, "still refused at the force-delete moment: deleting");
                    let why = why.clone();
                    return self.force_delete(&target, refusals.pdbs, why).await;
                }
            }
            match self.attempt_eviction(&target, &mut refusals, now).await {
                Attempt::Accepted => break,
                Attempt::Retry => {}
                Attempt::Done(outcome) => return outcome,
            }
        }
        self.wait_evicted(&target).await
    }

    /// One eviction request at `now`; a refusal to retry is recorded in `refusals` and paused
    /// after.
    async fn attempt_eviction(
        &self,
        target: &Target,
        refusals: &mut Refusals,
        now: Instant,
    ) -> Attempt {
        let grace = grace_seconds(
            target.own_grace,
            self.deadline.saturating_duration_since(now),
        );
        let eviction = eviction_body(&target.name, &target.ns, grace, target.uid.as_deref());
        let result = self
            .call(target.pods.create_subresource::<_, Value>(
                "eviction",
                &target.name,
                &PostParams::default(),
                &eviction,
            ))
            .await;
        match result {
            Ok(_) => {
                tracing::debug!(grace, "eviction accepted");
                Attempt::Accepted
            }
            Err(CallError::Deadline) => Attempt::Retry,
            Err(CallError::Kube(::kube::Error::Api(s))) => self.refused(target, &s, refusals).await,
            Err(CallError::Kube(e)) if kube_retryable(&e) => {
                tracing::debug!(error = %e, "eviction request failed; retrying");
                refusals.last = Some(format!("eviction request failed: {e}"));
                self.pause(jittered(RETRY_STEP), true).await;
                Attempt::Retry
            }
            Err(CallError::Kube(e)) => {
                tracing::warn!(error = %e, "eviction request failed");
                let refusals = std::mem::take(refusals);
                Attempt::Done(refusals.blocked(format!("eviction request failed: {e}")))
            }
        }
    }

    /// The API server refused the eviction with `s`: 404 ⇒ gone; 429 ⇒ a disruption budget
    /// (named), retry; 409 ⇒ gone if replaced, else retry; 5xx ⇒ retry; anything else ⇒ blocked.
    async fn refused(&self, target: &Target, s: &Status, refusals: &mut Refusals) -> Attempt {
        match s.code {
            404 => Attempt::Done(Outcome::Gone),
            429 => {
                let names = pdb_names(s);
                if refusals.last.is_none() {
                    tracing::info!(pdbs = ?names, message = %s.message, "eviction refused by a disruption budget; retrying");
                }
                refusals.pdbs.extend(names);
                refusals.last = Some(status_reason(s));
                self.pause(jittered(RETRY_STEP), true).await;
                Attempt::Retry
            }
            409 => {
                // Precondition (UID) failed or a concurrent PDB update: replaced ⇒ gone.
                match self.call(target.pods.get_opt(&target.name)).await {
                    Ok(None) => return Attempt::Done(Outcome::Gone),
                    Ok(Some(p)) if p.metadata.uid != target.uid => {
                        return Attempt::Done(Outcome::Gone)
                    }
                    _ => {}
                }
                refusals.last = Some(status_reason(s));
                self.pause(jittered(CONFLICT_STEP), true).await;
                Attempt::Retry
            }
            code if code >= 500 => {
                tracing::debug!(code, message = %s.message, "eviction failed on the server; retrying");
                refusals.last = Some(status_reason(s));
                self.pause(jittered(RETRY_STEP), true).await;
                Attempt::Retry
            }
            _ => {
                tracing::warn!(code = s.code, message = %s.message, "eviction refused");
                let refusals = std::mem::take(refusals);
                Attempt::Done(refusals.blocked(status_reason(s)))
            }
        }
    }

    /// The eviction was accepted: wait for the pod to be gone.
    async fn wait_evicted(&self, target: &Target) -> Outcome {
        let grace = grace_seconds(
            target.own_grace,
            self.deadline.saturating_duration_since(Instant::now()),
        );
        if self
            .wait_gone(&target.pods, &target.name, target.uid.as_deref(), grace)
            .await
        {
            Outcome::Evicted
        } else {
            Outcome::Blocked {
                pdbs: Vec::new(),
                reason: "evicted, still terminating at the deadline".into(),
            }
        }
    }

    async fn force_delete(&self, target: &Target, pdbs: BTreeSet<String>, why: String) -> Outcome {
        let grace = grace_seconds(
            target.own_grace,
            self.deadline.saturating_duration_since(Instant::now()),
        );
        let uid = target.uid.as_deref();
        let params = DeleteParams {
            grace_period_seconds: Some(grace.max(0) as u32),
            preconditions: uid.map(|u| kube::api::Preconditions {
                uid: Some(u.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        };
        let blocked = |reason: String| Outcome::Blocked {
            pdbs: pdbs.iter().cloned().collect(),
            reason,
        };
        match self.call(target.pods.delete(&target.name, &params)).await {
            Ok(_) => {}
            Err(CallError::Kube(::kube::Error::Api(s))) if s.code == 404 => {
                return Outcome::ForceDeleted
            }
            Err(CallError::Kube(e)) => {
                tracing::warn!(error = %e, "force delete failed");
                return blocked(format!("{why}; force delete failed: {e}"));
            }
            Err(CallError::Deadline) => {
                return blocked(format!("{why}; deadline reached during force delete"))
            }
        }
        if self.wait_gone(&target.pods, &target.name, uid, grace).await {
            Outcome::ForceDeleted
        } else {
            blocked(format!(
                "{why}; force-deleted, still terminating at the deadline"
            ))
        }
    }

    /// Wait until the pod is gone (deleted, or replaced by a new UID), asked for with a grace
    /// period of `grace` seconds; false at the deadline. The watch tells when there is one and
    /// it is healthy; otherwise poll (see the module doc).
    async fn wait_gone(&self, pods: &Api<Pod>, name: &str, uid: Option<&str>, grace: i64) -> bool {
        let (Some(watch), Some(uid)) = (self.watch, uid) else {
            return self.wait_gone_polling(pods, name, uid).await;
        };
        let mut changes = watch.changes();
        let mut polling = POLL_BACKOFF;
        let mut check_at =
            Instant::now() + Duration::from_secs(grace.max(0) as u64) + OVERDUE_SLACK;
        loop {
            changes.borrow_and_update();
            match watch.presence(uid, self.listed_at) {
                PodPresence::Gone => return true,
                PodPresence::Present => {
                    polling.reset();
                    tokio::select! {
                        changed = changes.changed() => {
                            if changed.is_err() {
                                // The watch went away with its owner: poll from now on.
                                return self.wait_gone_polling(pods, name, Some(uid)).await;
                            }
                        }
                        _ = tokio::time::sleep_until(check_at.min(self.deadline)) => {
                            if Instant::now() >= self.deadline {
                                return false;
                            }
                            tracing::debug!("the watch still shows the pod after its grace period: checking");
                            match self.gone(pods, name, Some(uid)).await {
                                Some(true) => return true,
                                Some(false) => {}
                                None => return false,
                            }
                            check_at = Instant::now() + jittered(OVERDUE_STEP);
                        }
                    }
                }
                PodPresence::Unknown => {
                    // Not healthy: one GET per step until it is again (or the pod is gone).
                    tokio::select! {
                        _ = changes.changed() => continue,
                        _ = self.pause(polling.next_delay(), false) => {}
                    }
                    match self.gone(pods, name, Some(uid)).await {
                        Some(true) => return true,
                        Some(false) if Instant::now() >= self.deadline => return false,
                        Some(false) => {}
                        None => return false,
                    }
                }
            }
        }
    }

    /// Poll GET until the pod is gone; false at the deadline.
    async fn wait_gone_polling(&self, pods: &Api<Pod>, name: &str, uid: Option<&str>) -> bool {
        let mut backoff = POLL_BACKOFF;
        loop {
            self.pause(backoff.next_delay(), false).await;
            match self.gone(pods, name, uid).await {
                Some(true) => return true,
                Some(false) if Instant::now() >= self.deadline => return false,
                Some(false) => {}
                None => return false,
            }
        }
    }

    /// One GET: whether the pod is gone (404 or a new UID); `None` at the deadline. A failed
    /// request counts as not gone.
    async fn gone(&self, pods: &Api<Pod>, name: &str, uid: Option<&str>) -> Option<bool> {
        if Instant::now() >= self.deadline {
            return None;
        }
        match self.call(pods.get_opt(name)).await {
            Ok(None) => Some(true),
            Ok(Some(p)) => Some(p.metadata.uid.as_deref() != uid),
            Err(CallError::Deadline) => None,
            Err(CallError::Kube(e)) => {
                tracing::debug!(error = %e, "checking deletion failed");
                Some(false)
            }
        }
    }
}

fn eviction_body(name: &str, ns: &str, grace: i64, uid: Option<&str>) -> Eviction {
    Eviction {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(ns.to_string()),
            ..Default::default()
        },
        delete_options: Some(DeleteOptions {
            grace_period_seconds: Some(grace),
            preconditions: uid.map(|u| Preconditions {
                uid: Some(u.to_string()),
                resource_version: None,
            }),
            ..Default::default()
        }),
    }
}

fn status_reason(s: &Status) -> String {
    let causes: Vec<&str> = s
        .details
        .as_ref()
        .map(|d| {
            d.causes
                .iter()
                .map(|c| c.message.as_str())
                .filter(|m| !m.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let mut out = format!("eviction refused ({} {}): {}", s.code, s.reason, s.message);
    if !causes.is_empty() {
        out.push_str(" (");
        out.push_str(&causes.join("; "));
        out.push(')');
    }
    out
}

/// Drain `node` before `request.deadline`. Errors only when the pods cannot be listed; every
/// per-pod problem ends in the report. `watch`: the agent's watch of this node's pods, which
/// tells when an evicted pod is gone (without it, each is polled).
#[tracing::instrument(name = "drain", skip_all, fields(node = %node))]
pub async fn drain_node(
    client: &Client,
    node: &str,
    own_pod: Option<(&str, &str)>,
    dry_run: bool,
    metrics: &Metrics,
    request: &DrainRequest,
    watch: Option<&dyn PodWatch>,
) -> Result<DrainReport, Error> {
    let started = Instant::now();
    let left = crate::duration::time_until(Some(request.deadline), Timestamp::now());
    let deadline = started + left;
    let (pods, listed_at) = list_pods(client, node, deadline, metrics).await?;
    let (to_evict, skipped) = filter::partition(pods, own_pod);
    let mut report = DrainReport {
        skipped: skipped.iter().map(|(k, _)| k.clone()).collect(),
        ..Default::default()
    };
    for (pod, why) in &skipped {
        tracing::debug!(pod = %pod, reason = why.as_str(), "not evicting");
    }
    count(metrics, "skipped", skipped.len());
    if dry_run {
        log_dry_run(&to_evict, left, &report);
        return Ok(report);
    }
    tracing::info!(
        pods = to_evict.len(),
        skipped = report.skipped.len(),
        seconds_left = left.as_secs(),
        "draining"
    );
    let drainer = Drainer {
        client,
        deadline,
        force_at: request
            .force_delete_at_deadline
            .then(|| deadline.checked_sub(FORCE_DELETE_LEAD).unwrap_or(started)),
        permits: Arc::new(Semaphore::new(request.concurrency.max(1))),
        watch,
        listed_at,
    };
    evict_all(&drainer, to_evict, request, metrics, &mut report).await;
    finish(&mut report, started, metrics);
    Ok(report)
}

/// List the pods on `node` (retrying what is retryable until `deadline`), with the moment the
/// list returned.
async fn list_pods(
    client: &Client,
    node: &str,
    deadline: Instant,
    metrics: &Metrics,
) -> Result<(Vec<Pod>, Instant), Error> {
    let all: Api<Pod> = Api::all(client.clone());
    let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let mut backoff = super::API_BACKOFF;
    loop {
        match tokio::time::timeout_at(deadline, super::with_timeout(all.list(&params))).await {
            Ok(Ok(list)) => return Ok((list.items, Instant::now())),
            Ok(Err(e)) if kube_retryable(&e) && Instant::now() < deadline => {
                tracing::debug!(error = %e, "listing pods failed; retrying");
                // Never past the deadline: a wait that would reach it ends there, where listing
                // stops.
                let pause = backoff
                    .next_delay_before(deadline)
                    .unwrap_or_else(|| deadline.saturating_duration_since(Instant::now()));
                tokio::time::sleep(pause).await;
            }
            Ok(Err(source)) => {
                metrics.error("node", "list_pods");
                return Err(Error::ListPods {
                    node: node.to_string(),
                    source,
                });
            }
            Err(_) => {
                metrics.error("node", "deadline");
                return Err(Error::Deadline("listing the pods to drain"));
            }
        }
    }
}

/// Dry run: say what would be evicted, with which grace period.
fn log_dry_run(to_evict: &[Pod], left: Duration, report: &DrainReport) {
    for pod in to_evict {
        let grace = grace_seconds(own_grace(pod), left);
        tracing::info!(pod = %pod_key(pod), grace_seconds = grace, "dry-run: would evict");
    }
    tracing::info!(
        would_evict = to_evict.len(),
        skipped = report.skipped.len(),
        "dry-run: drain planned, nothing evicted"
    );
}

/// Evict every pod of `to_evict` concurrently (a held pod once its hold ends) and put each
/// outcome in `report`.
async fn evict_all(
    drainer: &Drainer<'_>,
    to_evict: Vec<Pod>,
    request: &DrainRequest,
    metrics: &Metrics,
    report: &mut DrainReport,
) {
    let mut tasks: FuturesUnordered<_> = to_evict
        .into_iter()
        .map(|pod| {
            let key = pod_key(&pod);
            let span = tracing::info_span!("evict", pod = %key);
            let hold = request.holds.iter().find(|h| h.pod == key).cloned();
            async move {
                if let Some(hold) = hold {
                    tracing::info!(until = %hold.until, "held out of the drain until its checkpoint upload ends");
                    hold.wait().await;
                }
                (key, drainer.evict(pod).await)
            }
            .instrument(span)
        })
        .collect();
    while let Some((key, outcome)) = tasks.next().await {
        count(metrics, outcome.label(), 1);
        match outcome {
            Outcome::Evicted | Outcome::Gone => report.evicted.push(key),
            Outcome::ForceDeleted => report.force_deleted.push(key),
            Outcome::Blocked { pdbs, reason } => {
                tracing::warn!(pod = %key, pdbs = ?pdbs, reason = %reason, "pod still on the node at the deadline");
                report.blocked.push(BlockedPod {
                    pod: key,
                    pdbs,
                    reason,
                });
            }
        }
    }
}

/// Sort the report, record the drain's duration and blocked pods, log the result.
fn finish(report: &mut DrainReport, started: Instant, metrics: &Metrics) {
    report.evicted.sort();
    report.force_deleted.sort();
    report.blocked.sort_by(|a, b| a.pod.cmp(&b.pod));
    let elapsed = started.elapsed();
    metrics.drain_duration.observe(elapsed.as_secs_f64());
    metrics.drain_blocked.set(report.blocked.len() as i64);
    tracing::info!(
        evicted = report.evicted.len(),
        blocked = report.blocked.len(),
        force_deleted = report.force_deleted.len(),
        skipped = report.skipped.len(),
        seconds = elapsed.as_secs_f64(),
        "drain finished"
    );
}

fn count(metrics: &Metrics, outcome: &str, n: usize) {
    if n > 0 {
        metrics
            .drain_pods
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc_by(n as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::response::{StatusCause, StatusDetails};

    #[test]
    fn grace_is_capped_by_time_left_minus_margin() {
        assert_eq!(grace_seconds(30, Duration::from_secs(120)), 30);
        assert_eq!(grace_seconds(30, Duration::from_secs(20)), 18);
        assert_eq!(grace_seconds(300, Duration::from_secs(20)), 18);
        assert_eq!(
            grace_seconds(DEFAULT_GRACE_SECONDS, Duration::from_secs(10)),
            8
        );
        assert_eq!(grace_seconds(30, Duration::from_millis(12_900)), 10);
        // Never below 1 s (0 would bypass the kubelet)…
        assert_eq!(grace_seconds(30, Duration::from_secs(2)), 1);
        assert_eq!(grace_seconds(30, Duration::ZERO), 1);
        // …unless the pod itself asks for 0.
        assert_eq!(grace_seconds(0, Duration::from_secs(60)), 0);
        assert_eq!(grace_seconds(-5, Duration::from_secs(60)), 0);
    }

    fn status_429(causes: Vec<StatusCause>) -> Status {
        let mut s = Status::failure(
            "Cannot evict pod as it would violate the pod's disruption budget.",
            "TooManyRequests",
        );
        s.code = 429;
        s.details = Some(StatusDetails {
            name: String::new(),
            group: String::new(),
            kind: String::new(),
            uid: String::new(),
            causes,
            retry_after_seconds: 0,
        });
        s
    }

    #[test]
    fn pdb_names_come_from_the_disruption_budget_cause() {
        let s = status_429(vec![StatusCause {
            reason: "DisruptionBudget".into(),
            message: "The disruption budget trainer-pdb needs 2 healthy pods and has 2 currently"
                .into(),
            field: String::new(),
        }]);
        assert_eq!(pdb_names(&s), vec!["trainer-pdb"]);
        let s = status_429(vec![StatusCause {
            reason: "DisruptionBudget".into(),
            message: "The disruption budget db is still being processed by the server.".into(),
            field: String::new(),
        }]);
        assert_eq!(pdb_names(&s), vec!["db"]);
        // A server that only says it in the message (old / proxied): still found.
        let mut s = status_429(Vec::new());
        s.message = "Cannot evict pod as it would violate the pod's disruption budget. The disruption budget web does not allow evicting pods currently".into();
        assert_eq!(pdb_names(&s), vec!["web"]);
        // Nothing named: empty, not garbage.
        assert!(pdb_names(&status_429(Vec::new())).is_empty());
    }

    #[test]
    fn eviction_body_is_policy_v1_with_delete_options() {
        let v = serde_json::to_value(eviction_body("p", "ns", 7, Some("u1"))).unwrap();
        assert_eq!(v["apiVersion"], "policy/v1");
        assert_eq!(v["kind"], "Eviction");
        assert_eq!(v["metadata"]["name"], "p");
        assert_eq!(v["metadata"]["namespace"], "ns");
        assert_eq!(v["deleteOptions"]["gracePeriodSeconds"], 7);
        assert_eq!(v["deleteOptions"]["preconditions"]["uid"], "u1");
        assert!(v.get("delete_options").is_none());
    }
}
