//! `spotguard goodput --namespace NS (--job | --jobset | --owner | --pod)`: the report of one
//! Kubernetes owner, from the goodput records the agents wrote to the ledger
//! ([`super::ledger`]: `Interruption` objects of `spotguard.io/v1alpha1` in the job's namespace,
//! owned by the pod's controller, which only the agents can write). The goodput Events
//! (`InterruptionBadput`, `InterruptionRecovered`) are notifications: the report does not read
//! them, so an Event anyone wrote changes nothing and an Event the API server dropped
//! (`--event-ttl`) loses nothing.
//!
//! * Which records: those owned by the owner (for `--job NAME`: by that Job's uid, or by its
//!   JobSet naming that uid; for `--jobset NAME`: by the JobSet's uid, or, as older agents wrote
//!   them, by any of its Jobs, found by the label `jobset.sigs.k8s.io/jobset-name=NAME`; for
//!   `--pod`: about the pod, even once it is gone), each once. One that does not check out is
//!   skipped and counted.
//! * Paid time: the owner's start → end. Job: `status.startTime` → `completionTime` (or the
//!   `Failed` condition's time, or now while it runs); JobSet and other owners:
//!   `creationTimestamp` → the terminal condition's `lastTransitionTime` (or now); a pod: its
//!   `startTime` → its containers' last finish (or now); a pod that is gone: its first record →
//!   its last.

use std::collections::BTreeSet;
use std::path::PathBuf;

use jiff::Timestamp;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::Client;

use super::ledger::{self, Matcher};
use super::report::{self, Owner, Report};

/// The reasons of the goodput Events (the outcome follower's `InterruptionBadput` and the
/// recovery watcher's `InterruptionRecovered`).
pub const REASONS: [&str; 2] = ["InterruptionBadput", "InterruptionRecovered"];
/// The label JobSet puts on its Jobs.
pub const JOBSET_NAME_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";

/// The Kubernetes source of `spotguard goodput`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct KubeArgs {
    /// Report a Kubernetes owner (with --job, --jobset, --owner or --pod) from its goodput
    /// records (interruptions.spotguard.io) in this namespace, instead of a host's log.
    #[arg(long, value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// The Job to report (with --namespace).
    #[arg(long, value_name = "NAME", group = "subject", requires = "namespace")]
    pub job: Option<String>,
    /// The JobSet to report (with --namespace).
    #[arg(long, value_name = "NAME", group = "subject", requires = "namespace")]
    pub jobset: Option<String>,
    /// Any other controller of the pods, as `KIND/NAME` (with --namespace).
    #[arg(
        long,
        value_name = "KIND/NAME",
        group = "subject",
        requires = "namespace"
    )]
    pub owner: Option<String>,
    /// One pod (with --namespace).
    #[arg(long, value_name = "NAME", group = "subject", requires = "namespace")]
    pub pod: Option<String>,
    /// kubeconfig file; default: in-cluster, else `KUBECONFIG`, else ~/.kube/config.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// kubeconfig context; default: the current one.
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
}

/// What a report is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Subject {
    Job(String),
    JobSet(String),
    /// A controller of pods by kind and name.
    Owner {
        kind: String,
        name: String,
    },
    Pod(String),
}

impl KubeArgs {
    /// The namespace and subject named, if any (`Err`: `--namespace` without a subject, or a
    /// bad `--owner`; clap refuses a subject without `--namespace`).
    pub fn subject(&self) -> Result<Option<(String, Subject)>, Error> {
        let Some(namespace) = self.namespace.clone() else {
            return Ok(None);
        };
        let s = if let Some(n) = &self.job {
            Subject::Job(n.clone())
        } else if let Some(n) = &self.jobset {
            Subject::JobSet(n.clone())
        } else if let Some(o) = &self.owner {
            match o.split_once('/') {
                Some((kind, name)) if !kind.is_empty() && !name.is_empty() => Subject::Owner {
                    kind: kind.to_string(),
                    name: name.to_string(),
                },
                _ => return Err(Error::Usage(format!("--owner {o:?}: expected KIND/NAME"))),
            }
        } else if let Some(n) = &self.pod {
            Subject::Pod(n.clone())
        } else {
            return Err(Error::Usage(
                "--namespace needs one of --job, --jobset, --owner, --pod".into(),
            ));
        };
        Ok(Some((namespace, s)))
    }
}

/// Errors of the Kubernetes source.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error("kube client: {0}")]
    Client(String),
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0} not found (its paid time is unknown)")]
    NotFound(String),
    #[error(transparent)]
    Ledger(#[from] ledger::Error),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Api { what, source }
}

/// The client for `args`: `--kubeconfig` / `--context` when given, else in-cluster or
/// `KUBECONFIG`, as kubectl would.
pub async fn client(args: &KubeArgs) -> Result<Client, Error> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match (&args.kubeconfig, &args.context) {
        (Some(path), _) => {
            let kc = Kubeconfig::read_from(path)
                .map_err(|e| Error::Client(format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|e| Error::Client(e.to_string()))?
        }
        (None, Some(_)) => kube::Config::from_kubeconfig(&options)
            .await
            .map_err(|e| Error::Client(e.to_string()))?,
        (None, None) => kube::Config::infer()
            .await
            .map_err(|e| Error::Client(e.to_string()))?,
    };
    Client::try_from(config).map_err(|e| Error::Client(e.to_string()))
}

/// The `lastTransitionTime` of the first condition of `types` that is True, in an object's
/// `status.conditions`.
fn terminal_time(status: &serde_json::Value, types: &[&str]) -> Option<Timestamp> {
    status["conditions"].as_array()?.iter().find_map(|c| {
        (types.contains(&c["type"].as_str()?) && c["status"].as_str()? == "True")
            .then(|| c["lastTransitionTime"].as_str()?.parse().ok())
            .flatten()
    })
}

/// A Job's paid time: start → completion (or failure, or `now`), and whether it still runs.
pub fn job_paid(job: &Job, now: Timestamp) -> (Timestamp, Timestamp, bool) {
    let status = job.status.clone().unwrap_or_default();
    let start = status
        .start_time
        .map(|t| t.0)
        .or(job.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(now);
    let ended = status.completion_time.map(|t| t.0).or_else(|| {
        terminal_time(
            &serde_json::to_value(&job.status).unwrap_or_default(),
            &["Failed"],
        )
    });
    (start, ended.unwrap_or(now), ended.is_none())
}

/// Any object's paid time: creation → its terminal condition (or `now`).
pub fn object_paid(obj: &DynamicObject, now: Timestamp) -> (Timestamp, Timestamp, bool) {
    let start = obj
        .metadata
        .creation_timestamp
        .as_ref()
        .map(|t| t.0)
        .unwrap_or(now);
    let ended = terminal_time(
        &obj.data["status"],
        &["Completed", "Complete", "Failed", "Succeeded"],
    );
    (start, ended.unwrap_or(now), ended.is_none())
}

/// A pod's paid time: started → its containers' last finish once it ended (or `now`).
pub fn pod_paid(pod: &Pod, now: Timestamp) -> (Timestamp, Timestamp, bool) {
    let status = pod.status.clone().unwrap_or_default();
    let start = status
        .start_time
        .map(|t| t.0)
        .or(pod.metadata.creation_timestamp.as_ref().map(|t| t.0))
        .unwrap_or(now);
    let done = matches!(status.phase.as_deref(), Some("Succeeded" | "Failed"));
    let finished = status
        .container_statuses
        .iter()
        .flatten()
        .filter_map(|c| c.state.as_ref()?.terminated.as_ref()?.finished_at.as_ref())
        .map(|t| t.0)
        .max();
    match (done, finished) {
        (true, Some(end)) => (start, end, false),
        _ => (start, now, true),
    }
}

const JOBSET: (&str, &str, &str, &str) = ("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets");

/// The report of `subject` in `namespace`, its paid time ending at `now` while it runs.
pub async fn report(
    client: &Client,
    namespace: &str,
    subject: &Subject,
    now: Timestamp,
) -> Result<Report, Error> {
    let (kind, name, records, (since, until, running)) = match subject {
        Subject::Job(name) => {
            let api: Api<Job> = Api::namespaced(client.clone(), namespace);
            let job = api
                .get_opt(name)
                .await
                .map_err(api_err(format!("reading Job {namespace}/{name}")))?
                .ok_or_else(|| Error::NotFound(format!("Job {namespace}/{name}")))?;
            let owned = Matcher::Owner {
                kind: "Job".into(),
                names: BTreeSet::from([name.clone()]),
                uid: job.metadata.uid.clone(),
            };
            // A JobSet's Job: its records are the JobSet's, naming the Job's uid.
            let matcher = match &job.metadata.uid {
                Some(uid) => Matcher::Any(vec![owned, Matcher::JobUid(uid.clone())]),
                None => owned,
            };
            let records = ledger::records(client, namespace, &matcher).await?;
            ("Job", name, records, job_paid(&job, now))
        }
        Subject::JobSet(name) => {
            let (group, version, kind, plural) = JOBSET;
            let ar = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, kind),
                plural,
            );
            let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
            let js = api
                .get_opt(name)
                .await
                .map_err(api_err(format!("reading JobSet {namespace}/{name}")))?
                .ok_or_else(|| Error::NotFound(format!("JobSet {namespace}/{name}")))?;
            let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
            let selector = format!("{JOBSET_NAME_LABEL}={name}");
            let names = jobs
                .list(&ListParams::default().labels(&selector))
                .await
                .map_err(api_err(format!(
                    "listing the Jobs of JobSet {namespace}/{name}"
                )))?
                .items
                .into_iter()
                .filter_map(|j| j.metadata.name)
                .collect();
            // Owned by the JobSet (its uid: an earlier JobSet of that name is not this one), or,
            // written by an older agent, by one of its Jobs, by name: a JobSet that restarts
            // recreates its Jobs under the same names.
            let matcher = Matcher::Any(vec![
                Matcher::Owner {
                    kind: "JobSet".into(),
                    names: BTreeSet::from([name.clone()]),
                    uid: js.metadata.uid.clone(),
                },
                Matcher::Owner {
                    kind: "Job".into(),
                    names,
                    uid: None,
                },
            ]);
            let records = ledger::records(client, namespace, &matcher).await?;
            ("JobSet", name, records, object_paid(&js, now))
        }
        Subject::Owner { kind, name } => {
            let by_name = Matcher::Owner {
                kind: kind.clone(),
                names: BTreeSet::from([name.clone()]),
                uid: None,
            };
            let found = ledger::records(client, namespace, &by_name).await?;
            let obj = owner_object(
                client,
                namespace,
                kind,
                name,
                found.owner_api_version.clone(),
            )
            .await?;
            let paid = object_paid(&obj, now);
            let matcher = Matcher::Owner {
                kind: kind.clone(),
                names: BTreeSet::from([name.clone()]),
                uid: obj.metadata.uid.clone(),
            };
            let records = ledger::records(client, namespace, &matcher).await?;
            (kind.as_str(), name, records, paid)
        }
        Subject::Pod(name) => {
            let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let pod = api
                .get_opt(name)
                .await
                .map_err(api_err(format!("reading Pod {namespace}/{name}")))?;
            let records = ledger::records(client, namespace, &Matcher::Pod(name.clone())).await?;
            let paid = match &pod {
                Some(pod) => pod_paid(pod, now),
                None => records_span(&records)
                    .ok_or_else(|| Error::NotFound(format!("Pod {namespace}/{name}")))?,
            };
            ("Pod", name, records, paid)
        }
    };
    let ledger::Records {
        badput,
        recoveries,
        skipped,
        ..
    } = records;
    let mut r = report::summarize(ledger::join(badput, recoveries), since, until, 1, skipped);
    r.owner = Some(Owner {
        namespace: namespace.to_string(),
        kind: kind.to_string(),
        name: name.clone(),
        running,
    });
    Ok(r)
}

/// The paid time of a pod that is gone: its first record (seen, or saved for a recovery) → its
/// last (done, or the first step after a resume); `None` without a record.
fn records_span(r: &ledger::Records) -> Option<(Timestamp, Timestamp, bool)> {
    let starts = r
        .badput
        .iter()
        .map(|i| i.seen_at.unwrap_or(i.done_at))
        .chain(r.recoveries.iter().map(|x| x.saved_at));
    let ends = r
        .badput
        .iter()
        .map(|i| i.done_at)
        .chain(r.recoveries.iter().map(|x| x.first_step_at));
    Some((starts.min()?, ends.max()?, false))
}

/// The owner `kind`/`name`: through `api_version` (from an Event's `related`) when known, else
/// the kind found by discovery.
async fn owner_object(
    client: &Client,
    namespace: &str,
    kind: &str,
    name: &str,
    api_version: Option<String>,
) -> Result<DynamicObject, Error> {
    let ar = match api_version {
        Some(v) => {
            let (group, version) = v.split_once('/').unwrap_or(("", &v));
            let gvk = GroupVersionKind::gvk(group, version, kind);
            kube::discovery::pinned_kind(client, &gvk)
                .await
                .map_err(api_err(format!("discovering {kind} ({v})")))?
                .0
        }
        None => {
            let d = kube::Discovery::new(client.clone())
                .run()
                .await
                .map_err(api_err("API discovery"))?;
            let found = d.groups().find_map(|g| g.recommended_kind(kind));
            found
                .ok_or_else(|| Error::NotFound(format!("kind {kind}")))?
                .0
        }
    };
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    api.get_opt(name)
        .await
        .map_err(api_err(format!("reading {kind} {namespace}/{name}")))?
        .ok_or_else(|| Error::NotFound(format!("{kind} {namespace}/{name}")))
}

/// `spotguard goodput --namespace …`: print the report; 0, or 1 when it cannot be made.
pub async fn run_cli(args: &KubeArgs, namespace: &str, subject: &Subject, json: bool) -> i32 {
    let result = async {
        let client = client(args).await?;
        report(&client, namespace, subject, Timestamp::now()).await
    }
    .await;
    match result {
        Ok(r) => {
            if r.skipped > 0 {
                eprintln!(
                    "spotguard goodput: skipped {} goodput record(s) that do not check out",
                    r.skipped
                );
            }
            report::print(&r, json)
        }
        Err(e) => {
            eprintln!("spotguard goodput: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paid_time_is_the_owners_start_to_its_end_or_now() {
        let t = |s: i64| Timestamp::from_second(1_700_000_000 + s).unwrap();
        let mut job: Job = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "j", "creationTimestamp": t(0).to_string()},
            "status": {"startTime": t(5).to_string()}
        }))
        .unwrap();
        assert_eq!(job_paid(&job, t(100)), (t(5), t(100), true));
        job.status.as_mut().unwrap().completion_time =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(t(60)));
        assert_eq!(job_paid(&job, t(100)), (t(5), t(60), false));
        let failed: Job = serde_json::from_value(serde_json::json!({
            "status": {"startTime": t(5).to_string(), "conditions": [
                {"type": "Failed", "status": "True", "lastTransitionTime": t(40).to_string()}]}
        }))
        .unwrap();
        assert_eq!(job_paid(&failed, t(100)), (t(5), t(40), false));
        let js: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "js", "creationTimestamp": t(1).to_string()},
            "status": {"conditions": [
                {"type": "Completed", "status": "False", "lastTransitionTime": t(9).to_string()}]}
        }))
        .unwrap();
        assert_eq!(object_paid(&js, t(100)), (t(1), t(100), true));
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "status": {"phase": "Succeeded", "startTime": t(2).to_string(),
              "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"terminated": {"exitCode": 0,
                "finishedAt": t(50).to_string()}}}]}
        }))
        .unwrap();
        assert_eq!(pod_paid(&pod, t(100)), (t(2), t(50), false));
    }

    #[test]
    fn the_subject_is_one_of_the_four_and_owner_is_kind_slash_name() {
        let args = |f: fn(&mut KubeArgs)| {
            let mut a = KubeArgs {
                namespace: Some("ml".into()),
                ..Default::default()
            };
            f(&mut a);
            a.subject()
        };
        assert_eq!(
            args(|a| a.owner = Some("PyTorchJob/llm".into())).unwrap(),
            Some((
                "ml".to_string(),
                Subject::Owner {
                    kind: "PyTorchJob".into(),
                    name: "llm".into()
                }
            ))
        );
        assert!(args(|a| a.owner = Some("llm".into())).is_err());
        assert!(args(|_| {}).is_err());
        assert_eq!(KubeArgs::default().subject().unwrap(), None);
    }
}
