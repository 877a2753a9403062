//! What a peer relayed to this agent, published (`relay::Publisher`): the receiver checks a
//! reservation here before it accepts a byte — the location against this agent's own
//! `--upload-allow` for the job's namespace, the checkpoint's name and step, the writer's form
//! (a Kubernetes writer names the reservation's namespace) — and hands a verified relay here to
//! publish: the staged files captured from the receiver's staging volume with the staged-tree
//! rules, checked against the reservation, and uploaded by the upload engine with the
//! sender's manifest fields (origin, notice, writer), files first, the manifest last and
//! created only if absent. The engine's journals for relays live in `<state-dir>/relay/`, apart
//! from the trainers' uploads, and a relay published again after a restart resumes from them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use futures::future::BoxFuture;

use super::dest::{validate_checkpoint_name, Granted, Location, UploadPolicy};
use super::engine::{self, Job, Meta, Options};
use super::journal::RootRecord;
use super::metrics::UploadMetrics;
use super::owner::{self, Writer};
use super::staged::{self, Limits, Root};
use super::target::Target;
use super::Outcome;
use crate::relay::wire::Reserve;
use crate::relay::{PublishJob, Published, Publisher};
use crate::store::progress::Progress;
use crate::store::url::StoreOptions;

/// Publishes relayed checkpoints with the upload engine.
pub struct RelayPublisher {
    pub policy: UploadPolicy,
    pub limits: Limits,
    pub store: StoreOptions,
    /// Requests in flight and the part size, as for this agent's own uploads.
    pub concurrency: usize,
    pub part_size: u64,
    /// Where the relays' upload journals live (`<state-dir>/relay`).
    pub journal_dir: PathBuf,
    pub metrics: Option<Arc<UploadMetrics>>,
}

/// A reservation's destination, as this agent allows it.
struct Resolved {
    destination: Location,
    granted: Granted,
    step: Option<u64>,
}

impl RelayPublisher {
    fn resolve(&self, r: &Reserve) -> Result<Resolved, String> {
        let cp = &r.checkpoint;
        let location = Location::parse(&r.location).map_err(|e| e.to_string())?;
        validate_checkpoint_name(&cp.name).map_err(|e| e.to_string())?;
        let step = owner::checked_step(&cp.name, cp.step)
            .map_err(|why| format!("checkpoint {:?}: {why}", cp.name))?;
        check_writer(&cp.writer, r.namespace.as_deref())?;
        let destination = location.join(&cp.name);
        let granted = self
            .policy
            .check(&destination, r.namespace.as_deref())
            .map_err(|e| e.to_string())?;
        Ok(Resolved {
            destination,
            granted,
            step,
        })
    }

    async fn run(self: Arc<Self>, job: PublishJob) -> Published {
        let resolved = match self.resolve(&job.reserve) {
            Ok(r) => r,
            Err(why) => return Published::Failed(why),
        };
        let (dir, limits) = (job.dir.clone(), self.limits);
        let tree =
            tokio::task::spawn_blocking(move || staged::capture(&Root::host()?, &dir, &limits))
                .await;
        let tree = match tree {
            Ok(Ok(t)) => t,
            Ok(Err(e)) => return Published::Failed(e.to_string()),
            Err(e) => return Published::Failed(e.to_string()),
        };
        // What is on the staging volume is exactly what was reserved and verified.
        let declared: HashMap<&str, u64> = job
            .reserve
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.size))
            .collect();
        if tree.files.len() != declared.len()
            || tree
                .files
                .iter()
                .any(|f| declared.get(f.path.as_str()) != Some(&f.id.size))
        {
            return Published::Failed(
                "the staged files differ from the reservation (changed on the staging volume)"
                    .into(),
            );
        }
        let target = match Target::open(&resolved.destination, &resolved.granted, &self.store) {
            Ok(t) => t,
            Err(e) => return Published::Failed(e.to_string()),
        };
        let cp = &job.reserve.checkpoint;
        let report = engine::run(Job {
            tree,
            target,
            meta: Meta {
                name: cp.name.clone(),
                step: resolved.step,
                part: cp.part,
                notice: cp.notice.clone(),
                origin: cp.origin.clone(),
                acked_at: cp.acked_at.as_deref().and_then(|t| t.parse().ok()),
                writer: Some(Writer(cp.writer.clone())),
            },
            root: RootRecord::Host { owner: None },
            options: Options {
                concurrency: self.concurrency,
                memory: (self.concurrency as u64).saturating_mul(self.part_size),
                part_size: self.part_size,
                deadline: None,
                state_dir: Some(self.journal_dir.clone()),
                ..Options::default()
            },
            progress: Arc::new(Progress::default()),
            metrics: self.metrics.clone(),
            cancel: job.cancel,
            relayed: Default::default(),
        })
        .await;
        match report.outcome {
            Outcome::Published => Published::Published,
            Outcome::AlreadyPublished => Published::AlreadyPublished,
            o => Published::Failed(
                report
                    .error
                    .unwrap_or_else(|| format!("the upload ended {}", o.as_str())),
            ),
        }
    }
}

/// A writer as the wire gives it: `host:uid:<uid>` for a host-mode job (no namespace), or
/// `k8s:<namespace>/<Kind>/<name>` naming the reservation's namespace.
fn check_writer(writer: &str, namespace: Option<&str>) -> Result<(), String> {
    let bad = || format!("writer {writer:?} is not a job of this reservation");
    if let Some(uid) = writer.strip_prefix("host:uid:") {
        return match (uid.parse::<u32>(), namespace) {
            (Ok(_), None) => Ok(()),
            _ => Err(bad()),
        };
    }
    let rest = writer.strip_prefix("k8s:").ok_or_else(bad)?;
    let parts: Vec<&str> = rest.split('/').collect();
    match (parts.as_slice(), namespace) {
        ([ns, kind, name], Some(want)) if ns == &want && !kind.is_empty() && !name.is_empty() => {
            Ok(())
        }
        _ => Err(bad()),
    }
}

impl Publisher for RelayPublisher {
    fn check(&self, reserve: &Reserve) -> Result<(), String> {
        self.resolve(reserve).map(|_| ())
    }

    fn publish(&self, job: PublishJob) -> BoxFuture<'static, Published> {
        let me = Arc::new(RelayPublisher {
            policy: self.policy.clone(),
            limits: self.limits,
            store: self.store.clone(),
            concurrency: self.concurrency,
            part_size: self.part_size,
            journal_dir: self.journal_dir.clone(),
            metrics: self.metrics.clone(),
        });
        Box::pin(me.run(job))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writer_must_name_the_reservations_job() {
        assert!(check_writer("host:uid:1000", None).is_ok());
        assert!(check_writer("host:uid:x", None).is_err());
        assert!(check_writer("host:uid:1000", Some("ml")).is_err());
        assert!(check_writer("k8s:ml/Job/train", Some("ml")).is_ok());
        assert!(check_writer("k8s:other/Job/train", Some("ml")).is_err());
        assert!(check_writer("k8s:ml/Job", Some("ml")).is_err());
        assert!(check_writer("k8s:ml/Job/train", None).is_err());
        assert!(check_writer("anything", None).is_err());
    }
}
