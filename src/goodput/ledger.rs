//! The goodput ledger, read: the `Interruption` objects (`spotguard.io/v1alpha1`) the agents
//! write beside their goodput Events (`crate::node::kube::ledger`), which outlive the Events and
//! which only the agents can write. `spotguard goodput --namespace` reads them
//! ([`super::kube_report`]); recovery validation asks [`recorded_for`].
//!
//! * Paged: the namespace's records are listed `limit`/`continue` ([`PAGE`] a request), and only
//!   the subject's are kept; a Job's are selected by its uid's labels (the owner's, and the Job's
//!   on a record its JobSet owns), one list each, a record counted once.
//! * Checked on read: a record whose spec does not parse, whose record is not a goodput record,
//!   does not name the node and target the object names, or carries a figure out of bounds
//!   (negative, not finite, a badput duration past the record's own bound `record::MAX_SECONDS`,
//!   another time over a year, over 10^12 steps) is skipped and counted.
//! * Joined in linear time: records are grouped by notice id first (a hash map), and each
//!   interruption's handful of targets and recoveries is joined on its own.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DynamicObject, ListParams};
use kube::Client;
use tracing::debug;

use super::event::{EventRecord, Recovery};
use super::record::Interruption;
use super::recovery::{Job, Ledger, LedgerFactory, LogLedger, RecordedInterruption};
use super::report::{self, Row};
use crate::node::drain::PodWatch;
use crate::node::kube::ledger::{
    api_resource, bounds, InterruptionSpec, JOB_UID_LABEL, OWNER_UID_LABEL,
};
use crate::node::kube::owner::JobOwners;

/// Records listed per request.
pub const PAGE: u32 = 500;

/// Errors of the ledger's reads.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("listing the goodput records (interruptions.spotguard.io) in {namespace}: {source}")]
    List {
        namespace: String,
        #[source]
        source: kube::Error,
    },
}

/// Which records belong to a report's subject.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Matcher {
    /// Owned by an object of this kind with one of these names; when `uid` is known, only by that
    /// object (an earlier one of the same name is not this one).
    Owner {
        kind: String,
        names: std::collections::BTreeSet<String>,
        uid: Option<String>,
    },
    /// Owned by a JobSet through the Job of this uid (the record's [`JOB_UID_LABEL`]).
    JobUid(String),
    /// About this pod.
    Pod(String),
    /// Kept by any of these.
    Any(Vec<Matcher>),
}

impl Matcher {
    /// Whether `obj` (with `spec`) is the subject's.
    pub fn matches(&self, obj: &DynamicObject, spec: &InterruptionSpec) -> bool {
        match self {
            Matcher::Owner { kind, names, uid } => {
                obj.metadata.owner_references.iter().flatten().any(|o| {
                    &o.kind == kind
                        && names.contains(&o.name)
                        && uid.as_ref().is_none_or(|u| u == &o.uid)
                })
            }
            Matcher::JobUid(uid) => names_job(obj, uid),
            Matcher::Pod(name) => &spec.pod == name,
            Matcher::Any(any) => any.iter().any(|m| m.matches(obj, spec)),
        }
    }

    /// The label selector that narrows the list on the server, where there is one.
    fn selector(&self) -> Option<String> {
        match self {
            Matcher::Owner {
                uid: Some(uid),
                names,
                ..
            } if names.len() == 1 => Some(format!("{OWNER_UID_LABEL}={uid}")),
            Matcher::JobUid(uid) => Some(format!("{JOB_UID_LABEL}={uid}")),
            _ => None,
        }
    }

    /// The lists that find the subject's records: one per selector of an [`Matcher::Any`] whose
    /// every part has one, else one (narrowed when there is a selector).
    fn passes(&self) -> Vec<(Option<String>, &Matcher)> {
        match self {
            Matcher::Any(any) if !any.is_empty() && any.iter().all(|m| m.selector().is_some()) => {
                any.iter().map(|m| (m.selector(), m)).collect()
            }
            m => vec![(m.selector(), m)],
        }
    }
}

/// Whether `obj` names the Job of uid `uid` in its [`JOB_UID_LABEL`].
fn names_job(obj: &DynamicObject, uid: &str) -> bool {
    obj.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(JOB_UID_LABEL))
        .is_some_and(|l| l == uid)
}

/// The subject's records: interruptions, recoveries, the records skipped as unreadable, and the
/// `apiVersion` of the first owner that matched (to find the owner's kind).
#[derive(Clone, Debug, Default)]
pub struct Records {
    pub badput: Vec<Interruption>,
    pub recoveries: Vec<Recovery>,
    pub skipped: usize,
    pub owner_api_version: Option<String>,
}

fn seconds_ok(s: Option<f64>) -> bool {
    s.is_none_or(|s| s.is_finite() && (0.0..=bounds::SECONDS).contains(&s))
}

fn steps_ok(s: Option<u64>) -> bool {
    s.is_none_or(|s| s <= bounds::STEPS)
}

/// The record `spec` holds, if it is a goodput record consistent with its object: written by
/// the node the object names, about the target it names, its figures within bounds.
pub fn check(spec: &InterruptionSpec) -> Option<EventRecord> {
    if spec.record.len() > bounds::RECORD {
        return None;
    }
    let record: EventRecord = serde_json::from_str(&spec.record).ok()?;
    let ok = match &record {
        EventRecord::Badput(i) => {
            spec.type_ == "badput"
                && i.notice_id == spec.notice_id
                && i.node == spec.node
                && i.targets.len() == 1
                && i.targets.iter().all(|t| {
                    // the record's own bounds (one check for Events, logs and the ledger), and
                    // the schema's for the step counts
                    t.target == spec.target
                        && t.insane().is_none()
                        && steps_ok(t.wasted_steps)
                        && steps_ok(t.step)
                        && steps_ok(t.durable_step)
                })
                && i.detection_seconds().is_none_or(|s| seconds_ok(Some(s)))
                && i.drain_margin_seconds()
                    .is_none_or(|s| s.is_finite() && s.abs() <= bounds::SECONDS)
        }
        EventRecord::Recovery(r) => {
            spec.type_ == "recovery"
                && r.notice_id == spec.notice_id
                && r.node == spec.node
                && r.target == spec.target
                && seconds_ok(Some(r.recovery_seconds))
                && seconds_ok(r.restore_seconds)
                && r.restore_seconds.is_none_or(|s| s <= r.recovery_seconds)
                && steps_ok(Some(r.step))
                && r.first_step_at >= r.saved_at
        }
    };
    ok.then_some(record)
}

/// Sort one listed object into `out` if `matcher` keeps it; whether it was counted (kept, or
/// skipped as unreadable).
pub fn take(obj: &DynamicObject, matcher: &Matcher, out: &mut Records) -> bool {
    let Ok(spec) = serde_json::from_value::<InterruptionSpec>(obj.data["spec"].clone()) else {
        out.skipped += 1;
        return true;
    };
    if !matcher.matches(obj, &spec) {
        return false;
    }
    if out.owner_api_version.is_none() {
        out.owner_api_version = obj
            .metadata
            .owner_references
            .iter()
            .flatten()
            .next()
            .map(|o| o.api_version.clone());
    }
    match check(&spec) {
        Some(EventRecord::Badput(i)) => out.badput.push(i),
        Some(EventRecord::Recovery(r)) => out.recoveries.push(r),
        None => out.skipped += 1,
    }
    true
}

/// The records of `namespace` that `matcher` keeps, page by page (only the kept ones are held;
/// a record two of the lists find is counted once).
pub async fn records(
    client: &Client,
    namespace: &str,
    matcher: &Matcher,
) -> Result<Records, Error> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &api_resource());
    let passes = matcher.passes();
    let mut taken: HashSet<String> = HashSet::new();
    let mut out = Records::default();
    for (selector, m) in &passes {
        let mut params = ListParams::default().limit(PAGE);
        if let Some(s) = selector {
            params = params.labels(s);
        }
        each_listed(&api, namespace, params, |obj| {
            let name = obj.metadata.name.clone().unwrap_or_default();
            if passes.len() > 1 && taken.contains(&name) {
                return false;
            }
            if take(obj, m, &mut out) && passes.len() > 1 {
                taken.insert(name);
            }
            false
        })
        .await?;
    }
    Ok(out)
}

/// Hand every object `params` lists in `namespace` to `each`, page by page, until `each` says
/// it has found what it looked for (`true`).
async fn each_listed(
    api: &Api<DynamicObject>,
    namespace: &str,
    mut params: ListParams,
    mut each: impl FnMut(&DynamicObject) -> bool,
) -> Result<(), Error> {
    loop {
        let page = api.list(&params).await.map_err(|source| Error::List {
            namespace: namespace.to_string(),
            source,
        })?;
        if page.items.iter().any(&mut each) {
            return Ok(());
        }
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => params = params.continue_token(&c),
            _ => return Ok(()),
        }
    }
}

/// [`report::join`] in linear time: the records grouped by notice id, each group joined on its
/// own, the rows oldest first. The API lists objects by name (a hash): the records are put in
/// time order, then target order, first, so that a row's targets read the same every time.
pub fn join(mut badput: Vec<Interruption>, recoveries: Vec<Recovery>) -> Vec<Row> {
    badput.sort_by(|a, b| {
        let key = |i: &Interruption| (i.done_at, i.targets.first().map(|t| t.target.clone()));
        key(a).cmp(&key(b))
    });
    let mut groups: HashMap<String, (Vec<Interruption>, Vec<Recovery>)> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for i in badput {
        let g = groups.entry(i.notice_id.clone()).or_insert_with(|| {
            order.push(i.notice_id.clone());
            Default::default()
        });
        g.0.push(i);
    }
    for r in recoveries {
        let g = groups.entry(r.notice_id.clone()).or_insert_with(|| {
            order.push(r.notice_id.clone());
            Default::default()
        });
        g.1.push(r);
    }
    let mut rows: Vec<Row> = order
        .into_iter()
        .filter_map(|id| groups.remove(&id))
        .flat_map(|(b, r)| report::join(b, r))
        .collect();
    rows.sort_by_key(|r| r.at);
    rows
}

/// Whether an agent recorded the interruption `notice_id` for the job owned by `owner_uid` (the
/// pod's controller's uid) in `namespace`: its badput record, if any: one owned by that
/// controller, or, for a JobSet's Job, one its JobSet owns that names the Job's uid. What
/// recovery validation asks in Kubernetes before it counts a recovery naming that notice.
pub async fn recorded_interruption(
    client: &Client,
    namespace: &str,
    owner_uid: &str,
    notice_id: &str,
) -> Result<Option<Interruption>, Error> {
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &api_resource());
    for label in [OWNER_UID_LABEL, JOB_UID_LABEL] {
        let params = ListParams::default()
            .limit(PAGE)
            .labels(&format!("{label}={owner_uid}"));
        let mut found = None;
        each_listed(&api, namespace, params, |obj| {
            let ours = if label == OWNER_UID_LABEL {
                obj.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.uid == owner_uid)
            } else {
                names_job(obj, owner_uid)
            };
            let Ok(spec) = serde_json::from_value::<InterruptionSpec>(obj.data["spec"].clone())
            else {
                return false;
            };
            if !ours || spec.notice_id != notice_id {
                return false;
            }
            if let Some(EventRecord::Badput(i)) = check(&spec) {
                found = Some(i);
                return true;
            }
            false
        })
        .await?;
        if found.is_some() {
            return Ok(found);
        }
    }
    Ok(None)
}

/// Whether an agent recorded the interruption `notice_id` for the job of a pod controlled by
/// `controller` in `namespace`: first by the JobSet of that Job, when it is a JobSet's Job
/// (`owners` reads it, checked by uid: the interruption may have hit an earlier Job of the set,
/// since a JobSet that restarts recreates its Jobs), then by the controller's uid
/// ([`recorded_interruption`]). A Job that cannot be read only skips the first question.
pub async fn recorded_for(
    client: &Client,
    owners: &JobOwners,
    namespace: &str,
    controller: &ObjectReference,
    notice_id: &str,
) -> Result<Option<Interruption>, Error> {
    let Some(uid) = controller.uid.as_deref().filter(|u| !u.is_empty()) else {
        return Ok(None);
    };
    match owners.jobset(client, namespace, controller).await {
        Ok(Some(jobset)) => {
            if let Some(js_uid) = jobset.uid.as_deref() {
                if let Some(found) =
                    recorded_interruption(client, namespace, js_uid, notice_id).await?
                {
                    return Ok(Some(found));
                }
            }
        }
        Ok(None) => {}
        Err(e) => {
            debug!(error = %e, "recovery ledger: the pod's Job could not be read; its JobSet's records are not asked")
        }
    }
    recorded_interruption(client, namespace, uid, notice_id).await
}

/// How long the ledger's "no such interruption" is believed before it is asked again (a record
/// written by the interrupted node's agent may land after the job resumed here).
const NOT_FOUND_FOR: Duration = Duration::from_secs(30);
/// The most one ledger lookup may take (a recovery pass has [`PASS_BUDGET`] in all).
///
/// [`PASS_BUDGET`]: super::recovery::PASS_BUDGET
const LOOKUP_LIMIT: Duration = Duration::from_secs(2);

/// The recovery task's [`Ledger`] in Kubernetes: an interruption this agent logged itself (its
/// own goodput log, [`LogLedger`]), else one an agent recorded in the cluster's ledger for the
/// pod's controller (the job: a resumed pod has the same controller as the interrupted one), or
/// for a JobSet's Job, for its JobSet ([`recorded_for`]: a restart recreates the Jobs).
/// The controller comes from the agent's pod watch, never from the pod's labels; a pod without
/// one (a bare pod is its own job and does not resume elsewhere) has only the local log. Answers
/// are cached (a found record never changes; "not found" for [`NOT_FOUND_FOR`]), so a pod
/// rewriting its resume record costs at most one list per notice id it names and period.
pub struct KubeLedger {
    log: LogLedger,
    client: Client,
    runtime: tokio::runtime::Handle,
    pods: Arc<dyn PodWatch>,
    /// The JobSets of the pods' Jobs (shared with the node operations' record writer).
    owners: Arc<JobOwners>,
    /// (namespace, owner uid, notice id) → the answer and when it was had.
    asked: RefCell<HashMap<Asked, (Option<RecordedInterruption>, Instant)>>,
}

impl KubeLedger {
    /// The factory the recovery task makes its ledgers with (called in the runtime: the ledger
    /// blocks on it from the recovery pass's thread).
    pub fn factory(
        client: Client,
        pods: Arc<dyn PodWatch>,
        owners: Arc<JobOwners>,
        goodput_log: Option<PathBuf>,
    ) -> LedgerFactory {
        let runtime = tokio::runtime::Handle::current();
        Arc::new(move || {
            Box::new(KubeLedger {
                log: LogLedger::new(goodput_log.clone()),
                client: client.clone(),
                runtime: runtime.clone(),
                pods: pods.clone(),
                owners: owners.clone(),
                asked: RefCell::new(HashMap::new()),
            }) as Box<dyn Ledger>
        })
    }

    fn ask(
        &self,
        namespace: &str,
        controller: &ObjectReference,
        notice_id: &str,
    ) -> Option<RecordedInterruption> {
        let owner_uid = controller.uid.as_deref()?;
        let key = (
            namespace.to_string(),
            owner_uid.to_string(),
            notice_id.to_string(),
        );
        if let Some((answer, at)) = self.asked.borrow().get(&key) {
            if answer.is_some() || at.elapsed() < NOT_FOUND_FOR {
                return answer.clone();
            }
        }
        // The timer is made inside the runtime (block_on enters it): this is the pass's thread.
        let asked = self.runtime.block_on(async {
            tokio::time::timeout(
                LOOKUP_LIMIT,
                recorded_for(&self.client, &self.owners, namespace, controller, notice_id),
            )
            .await
        });
        let answer = match asked {
            Ok(Ok(found)) => found.as_ref().map(RecordedInterruption::of),
            Ok(Err(e)) => {
                debug!(error = %e, "recovery ledger: the goodput records could not be listed");
                None
            }
            Err(_) => {
                debug!(
                    namespace,
                    "recovery ledger: listing the goodput records took too long"
                );
                None
            }
        };
        let mut asked = self.asked.borrow_mut();
        if asked.len() >= MAX_ASKED {
            asked.retain(|_, (a, at)| a.is_some() && at.elapsed() < KEEP_FOUND);
            if asked.len() >= MAX_ASKED {
                asked.clear();
            }
        }
        asked.insert(key, (answer.clone(), Instant::now()));
        answer
    }
}

/// A [`KubeLedger`] question: (namespace, owner uid, notice id).
type Asked = (String, String, String);

/// Answers a [`KubeLedger`] keeps at most.
const MAX_ASKED: usize = 4096;
/// How long a found record is kept once the cache is full.
const KEEP_FOUND: Duration = Duration::from_secs(3600);

impl Ledger for KubeLedger {
    fn refresh(&mut self) {
        self.log.refresh();
    }

    fn recorded(&self, job: &Job<'_>, notice_id: &str) -> Option<RecordedInterruption> {
        if let Some(found) = self.log.recorded(job, notice_id) {
            return Some(found);
        }
        let pod = job.pod?;
        let controller = self.pods.controller(&pod.uid)??;
        self.ask(&pod.namespace, &controller, notice_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::goodput::record::TargetBadput;
    use crate::node::kube::ledger::{object, spec_for, RecordOwner, DEFAULT_RECORD_TTL};
    use crate::node::PodRef;
    use jiff::Timestamp;
    use k8s_openapi::api::core::v1::ObjectReference;

    fn t(s: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + s).unwrap()
    }

    fn pod(name: &str) -> PodRef {
        PodRef {
            namespace: "ml".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn badput(notice: &str, node: &str, pod: &str, save: f64, steps: u64) -> EventRecord {
        EventRecord::Badput(Interruption {
            notice_id: notice.into(),
            node: node.into(),
            seen_at: Some(t(0)),
            done_at: t(60),
            targets: vec![TargetBadput {
                target: format!("ml/{pod}"),
                outcome: "acked".into(),
                save_seconds: Some(save),
                wasted_steps: Some(steps),
                wasted_seconds: Some(0.0),
                ..TargetBadput::default()
            }],
            ..Interruption::default()
        })
    }

    fn stored(record: &EventRecord, node: &str, pod_name: &str, job: &str) -> DynamicObject {
        let text = record.to_annotation();
        let spec = spec_for(&text, node, &pod(pod_name)).unwrap();
        let owner = ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some(job.into()),
            uid: Some(format!("uid-{job}")),
            ..Default::default()
        };
        object(
            spec,
            "ml",
            Some(&RecordOwner::controller(&owner)),
            t(0),
            DEFAULT_RECORD_TTL,
        )
    }

    /// A record of a JobSet's Job as an agent that reads Jobs writes it: owned by the JobSet.
    fn stored_by_jobset(
        record: &EventRecord,
        pod_name: &str,
        jobset: &str,
        job: &str,
    ) -> DynamicObject {
        let spec = spec_for(&record.to_annotation(), "a", &pod(pod_name)).unwrap();
        let owner = RecordOwner {
            owner: ObjectReference {
                api_version: Some("jobset.x-k8s.io/v1alpha2".into()),
                kind: Some("JobSet".into()),
                name: Some(jobset.into()),
                uid: Some(format!("uid-{jobset}")),
                ..Default::default()
            },
            job_uid: Some(format!("uid-{job}")),
        };
        object(spec, "ml", Some(&owner), t(0), DEFAULT_RECORD_TTL)
    }

    #[test]
    fn a_jobsets_records_are_its_own_and_its_jobs_by_name_each_once() {
        let objs = [
            // Written by an agent that reads Jobs: owned by the JobSet, naming the Job.
            stored_by_jobset(&badput("n1", "a", "p1", 3.0, 0), "p1", "pretrain", "w-0"),
            // Written by an older agent: owned by the Job.
            stored(&badput("n2", "a", "p2", 5.0, 0), "a", "p2", "w-1"),
            // Another JobSet's, by either way.
            stored_by_jobset(&badput("n3", "a", "p3", 7.0, 0), "p3", "eval", "e-0"),
            stored(&badput("n4", "a", "p4", 9.0, 0), "a", "p4", "e-1"),
        ];
        let jobset = Matcher::Any(vec![
            Matcher::Owner {
                kind: "JobSet".into(),
                names: ["pretrain".to_string()].into(),
                uid: Some("uid-pretrain".into()),
            },
            Matcher::Owner {
                kind: "Job".into(),
                names: ["w-0".to_string(), "w-1".to_string()].into(),
                uid: None,
            },
        ]);
        // One list (a part without a selector), each record once though both parts keep n1's.
        assert_eq!(jobset.passes().len(), 1);
        let mut out = Records::default();
        for o in &objs {
            take(o, &jobset, &mut out);
        }
        let mut ids: Vec<&str> = out.badput.iter().map(|i| i.notice_id.as_str()).collect();
        ids.sort();
        assert_eq!(ids, ["n1", "n2"]);
        // A Job's report: its own records and those its JobSet owns that name it, one list each.
        for (job, want) in [("w-0", "n1"), ("w-1", "n2"), ("e-0", "n3")] {
            let m = Matcher::Any(vec![
                Matcher::Owner {
                    kind: "Job".into(),
                    names: [job.to_string()].into(),
                    uid: Some(format!("uid-{job}")),
                },
                Matcher::JobUid(format!("uid-{job}")),
            ]);
            let selectors: Vec<Option<String>> = m.passes().into_iter().map(|p| p.0).collect();
            assert_eq!(
                selectors,
                [
                    Some(format!("{OWNER_UID_LABEL}=uid-{job}")),
                    Some(format!("{JOB_UID_LABEL}=uid-{job}"))
                ]
            );
            let mut out = Records::default();
            for o in &objs {
                take(o, &m, &mut out);
            }
            let ids: Vec<&str> = out.badput.iter().map(|i| i.notice_id.as_str()).collect();
            assert_eq!(ids, [want], "{job}");
        }
    }

    fn job(name: &str) -> Matcher {
        Matcher::Owner {
            kind: "Job".into(),
            names: [name.to_string()].into(),
            uid: Some(format!("uid-{name}")),
        }
    }

    #[test]
    fn only_the_owners_consistent_records_in_bounds_count() {
        let mut out = Records::default();
        let objs = [
            stored(&badput("n1", "a", "p1", 3.0, 0), "a", "p1", "train"),
            // Another job's.
            stored(&badput("n2", "a", "p2", 9.0, 0), "a", "p2", "other"),
            // A record naming another node than its writer's, another target, a negative
            // figure, steps past the bound: skipped.
            stored(&badput("n3", "b", "p1", 3.0, 0), "a", "p1", "train"),
            stored(&badput("n4", "a", "p9", 3.0, 0), "a", "p1", "train"),
            stored(&badput("n5", "a", "p1", -20.0, 0), "a", "p1", "train"),
            stored(
                &badput("n6", "a", "p1", 1.0, u64::MAX - 399),
                "a",
                "p1",
                "train",
            ),
        ];
        for o in &objs {
            take(o, &job("train"), &mut out);
        }
        assert_eq!((out.badput.len(), out.skipped), (1, 4));
        assert_eq!(out.owner_api_version.as_deref(), Some("batch/v1"));
        let mut by_pod = Records::default();
        for o in &objs {
            take(o, &Matcher::Pod("p2".into()), &mut by_pod);
        }
        assert_eq!(by_pod.badput.len(), 1);
    }

    #[test]
    fn the_linear_join_gives_what_the_report_join_gives() {
        let mut b = Vec::new();
        let mut r = Vec::new();
        for n in 0..50 {
            for p in 0..3 {
                if let EventRecord::Badput(mut i) =
                    badput(&format!("n{n}"), "a", &format!("p{p}"), 1.0, 2)
                {
                    i.seen_at = Some(t(n * 100));
                    b.push(i);
                }
            }
            r.push(Recovery {
                notice_id: format!("n{}", n * 2),
                node: "b".into(),
                target: "ml/q".into(),
                saved_at: t(n),
                first_step_at: t(n + 5),
                recovery_seconds: 5.0,
                ..Recovery::default()
            });
        }
        assert_eq!(join(b.clone(), r.clone()), report::join(b, r));
    }
}
