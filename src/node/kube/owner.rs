//! Whom a goodput record belongs to (`ledger`): the pod's controller as the agent's pod watch
//! knows it, except for a JobSet's Job, whose records the JobSet owns.
//!
//! A JobSet that restarts deletes its Jobs and creates them again under the same names; a record
//! owned by a Job would go with it. So when the pod's controller is a Job (`batch/v1`), the agent
//! reads that Job (one bounded GET by name in the pod's namespace, off the signal path: the record
//! is written after the Event) and, only when the Job read is the one the pod names (same uid)
//! and the Job's own controller is a JobSet (`jobset.x-k8s.io`, with a name and a uid that can be
//! a label value), owns the record by that JobSet, the Job's uid kept in a label of its own.
//!
//! * Recovery validation asks the same (`crate::goodput::ledger::recorded_for`, through the
//!   [`JobOwners`] the node operations share): a pod of a JobSet's new Job resumes what an
//!   interruption of an earlier Job of the set recorded.
//! * Hostile input: a pod may name any Job of its namespace, a Job's creator any JobSet of it;
//!   a record goes to an owner of the pod's own namespace, no further than what the namespace's
//!   users can already claim.
//! * Cached by the Job's uid, only what was read from a Job of the uid the pod named (a pod
//!   naming another Job's uid cannot change what a genuine pod of that Job gets), at most
//!   [`MAX_CACHED`] Jobs.
//! * A Job that cannot be read (forbidden: an agent without `get` on Jobs, gone, timed out, not
//!   the Job the pod names) leaves the record owned by the Job, as before, logged and counted
//!   (`spotguard_errors_total{module="node",error="get_job"|"job_gone"}`): never dropped.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::Api;
use kube::Client;

use super::api::with_timeout;
use crate::node::Error;

/// The JobSet API group.
pub const JOBSET_GROUP: &str = "jobset.x-k8s.io";
/// Jobs whose JobSet (or lack of one) is remembered.
pub const MAX_CACHED: usize = 4096;

/// Whom a record belongs to: `owner` (its ownerReference and the owner-uid label) and, when the
/// owner is the JobSet of the pod's Job, that Job's uid (the job-uid label).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecordOwner {
    pub owner: ObjectReference,
    pub job_uid: Option<String>,
}

impl RecordOwner {
    /// Owned by the pod's controller itself.
    pub fn controller(controller: &ObjectReference) -> RecordOwner {
        RecordOwner {
            owner: controller.clone(),
            job_uid: None,
        }
    }
}

/// Whether `s` can be a label value (at most 63 characters, alphanumerics, `-`, `_`, `.`, an
/// alphanumeric at each end): the owner's uid becomes one.
pub fn label_value_ok(s: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(ok_char)
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric())
}

/// The Job `controller` names (`batch/v1`, kind `Job`, with a name and a uid): its name.
pub fn job_name(controller: &ObjectReference) -> Option<&str> {
    let named = controller.api_version.as_deref() == Some("batch/v1")
        && controller.kind.as_deref() == Some("Job")
        && controller.uid.as_deref().is_some_and(|u| !u.is_empty());
    controller
        .name
        .as_deref()
        .filter(|n| named && !n.is_empty())
}

/// The JobSet that controls `job`, when `job` is the Job `controller` names (the same uid): the
/// Job's controller ownerReference, of kind `JobSet` in [`JOBSET_GROUP`] (any version), with a
/// name and a uid fit for a label value.
pub fn jobset_of(controller: &ObjectReference, job: &Job) -> Option<ObjectReference> {
    job_name(controller)?;
    if job.metadata.uid.is_none() || job.metadata.uid != controller.uid {
        return None;
    }
    let o = job
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))?;
    let group = o.api_version.split_once('/').map(|(g, _)| g);
    (group == Some(JOBSET_GROUP)
        && o.kind == "JobSet"
        && !o.name.is_empty()
        && o.name.len() <= 253
        && label_value_ok(&o.uid))
    .then(|| ObjectReference {
        api_version: Some(o.api_version.clone()),
        kind: Some(o.kind.clone()),
        name: Some(o.name.clone()),
        namespace: job.metadata.namespace.clone(),
        uid: Some(o.uid.clone()),
        ..Default::default()
    })
}

/// The owner of a record about a pod controlled by `controller`, given what its Job's read found
/// (`jobset`: the Job's JobSet, if any).
pub fn record_owner(controller: &ObjectReference, jobset: Option<ObjectReference>) -> RecordOwner {
    match jobset {
        Some(js) => RecordOwner {
            owner: js,
            job_uid: controller.uid.clone(),
        },
        None => RecordOwner::controller(controller),
    }
}

/// The JobSets of the Jobs the agent read, by Job uid (`None`: the Job has no JobSet).
#[derive(Default)]
pub struct JobOwners {
    known: Mutex<HashMap<String, Option<ObjectReference>>>,
}

impl JobOwners {
    fn cached(&self, job_uid: &str) -> Option<Option<ObjectReference>> {
        self.known.lock().ok()?.get(job_uid).cloned()
    }

    fn remember(&self, job_uid: &str, jobset: Option<ObjectReference>) {
        if let Ok(mut known) = self.known.lock() {
            if known.len() >= MAX_CACHED {
                known.clear();
            }
            known.insert(job_uid.to_string(), jobset);
        }
    }

    /// The JobSet of the Job `controller` names in `namespace` (`Ok(None)`: `controller` is not
    /// a Job, or its Job has no JobSet); `Err` when that Job could not be read or is not the one
    /// named (another Job of that name, or none).
    pub async fn jobset(
        &self,
        client: &Client,
        namespace: &str,
        controller: &ObjectReference,
    ) -> Result<Option<ObjectReference>, Error> {
        let (Some(name), Some(uid)) = (job_name(controller), controller.uid.as_deref()) else {
            return Ok(None);
        };
        if let Some(known) = self.cached(uid) {
            return Ok(known);
        }
        let api: Api<Job> = Api::namespaced(client.clone(), namespace);
        let job = with_timeout(api.get_opt(name))
            .await
            .map_err(|source| Error::GetJob {
                job: format!("{namespace}/{name}"),
                source,
            })?;
        match job {
            Some(job) if job.metadata.uid.as_deref() == Some(uid) => {
                let jobset = jobset_of(controller, &job);
                self.remember(uid, jobset.clone());
                Ok(jobset)
            }
            _ => Err(Error::JobGone {
                job: format!("{namespace}/{name}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn job_ref(uid: &str) -> ObjectReference {
        ObjectReference {
            api_version: Some("batch/v1".into()),
            kind: Some("Job".into()),
            name: Some("pretrain-workers-0".into()),
            namespace: Some("ml".into()),
            uid: Some(uid.into()),
            ..Default::default()
        }
    }

    fn owner(api_version: &str, kind: &str, uid: &str, controller: Option<bool>) -> OwnerReference {
        OwnerReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: "pretrain".into(),
            uid: uid.into(),
            controller,
            block_owner_deletion: Some(true),
        }
    }

    fn job(uid: &str, owners: Vec<OwnerReference>) -> Job {
        Job {
            metadata: ObjectMeta {
                name: Some("pretrain-workers-0".into()),
                namespace: Some("ml".into()),
                uid: Some(uid.into()),
                owner_references: Some(owners),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_jobsets_job_gives_its_records_to_the_jobset_and_keeps_the_jobs_uid() {
        let js = owner("jobset.x-k8s.io/v1alpha2", "JobSet", "js-uid", Some(true));
        let found = jobset_of(&job_ref("job-uid"), &job("job-uid", vec![js])).unwrap();
        assert_eq!(
            (
                found.api_version.as_deref(),
                found.kind.as_deref(),
                found.name.as_deref(),
                found.uid.as_deref(),
                found.namespace.as_deref()
            ),
            (
                Some("jobset.x-k8s.io/v1alpha2"),
                Some("JobSet"),
                Some("pretrain"),
                Some("js-uid"),
                Some("ml")
            )
        );
        let o = record_owner(&job_ref("job-uid"), Some(found.clone()));
        assert_eq!(o.owner, found);
        assert_eq!(o.job_uid.as_deref(), Some("job-uid"));
        // Without a JobSet: the pod's controller, as before.
        let o = record_owner(&job_ref("job-uid"), None);
        assert_eq!((o.owner, o.job_uid), (job_ref("job-uid"), None));
    }

    #[test]
    fn only_the_named_jobs_own_jobset_controller_counts() {
        let js = || owner("jobset.x-k8s.io/v1alpha2", "JobSet", "js-uid", Some(true));
        // Another Job of that name (the pod names another uid): nothing.
        assert_eq!(
            jobset_of(&job_ref("other"), &job("job-uid", vec![js()])),
            None
        );
        // Not a Job: a Deployment's ReplicaSet, a Job of another group, no uid.
        let mut rs = job_ref("job-uid");
        rs.kind = Some("ReplicaSet".into());
        rs.api_version = Some("apps/v1".into());
        assert_eq!(jobset_of(&rs, &job("job-uid", vec![js()])), None);
        let mut fake = job_ref("job-uid");
        fake.api_version = Some("example.com/v1".into());
        assert_eq!(jobset_of(&fake, &job("job-uid", vec![js()])), None);
        let mut no_uid = job_ref("job-uid");
        no_uid.uid = None;
        assert_eq!(jobset_of(&no_uid, &job("job-uid", vec![js()])), None);
        // The Job's owner: not its controller, another kind or group, a uid no label can hold.
        for o in [
            owner("jobset.x-k8s.io/v1alpha2", "JobSet", "js-uid", None),
            owner("jobset.x-k8s.io/v1alpha2", "JobSet", "js-uid", Some(false)),
            owner("jobset.x-k8s.io/v1alpha2", "Other", "js-uid", Some(true)),
            owner("example.com/v1alpha2", "JobSet", "js-uid", Some(true)),
            owner(
                "jobset.x-k8s.io.example.com/v1",
                "JobSet",
                "js-uid",
                Some(true),
            ),
            owner("jobset.x-k8s.io/v1alpha2", "JobSet", "", Some(true)),
            owner(
                "jobset.x-k8s.io/v1alpha2",
                "JobSet",
                &"u".repeat(64),
                Some(true),
            ),
            owner("jobset.x-k8s.io/v1alpha2", "JobSet", "a b", Some(true)),
        ] {
            assert_eq!(
                jobset_of(&job_ref("job-uid"), &job("job-uid", vec![o.clone()])),
                None,
                "{o:?}"
            );
        }
        assert_eq!(
            jobset_of(&job_ref("job-uid"), &job("job-uid", vec![])),
            None
        );
    }

    #[test]
    fn label_values() {
        for ok in ["a", "0f8c-11ee_x.y", &"u".repeat(63)] {
            assert!(label_value_ok(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "a/b", "a b", &"u".repeat(64), "é"] {
            assert!(!label_value_ok(bad), "{bad}");
        }
    }
}
