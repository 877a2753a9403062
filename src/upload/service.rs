//! The agent's side of staged checkpoints (`spotguard run`): the operator's settings, the
//! uploader's own runtime, and what a staged `done` ack becomes. [`Service::on_ack`] runs on the
//! ack watcher's thread while the acking process lives (`crate::checkpoint::run::wait_with`):
//! it takes the staged tree ([`super::ack::take`], which answers `taken` or `refused` in the
//! process's checkpoint dir) and submits the upload to the [`Uploader`] at once, so the upload
//! starts within the ack poll, never waits for other groups' acks, and never runs on a thread
//! the signal, the watchers or the drain use. The plan (`responder/steps/upload.rs`) holds the
//! pod out of the drain until the upload's report or `deadline − drain reserve`.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::ack::{self, Acker, Binding, StagedRequest, Taken};
use super::dest::{Location, UploadPolicy};
use super::engine::{Job, Meta, Options, Report};
use super::handoff;
use super::journal::Record;
use super::manifest::{NoticeInfo, Origin};
use super::metrics::UploadMetrics;
use super::owner::Writer;
use super::staged::{Limits, StagedTree};
use super::target::Target;
use super::uploader::{self, Recovery, Uploader};
use super::{Error, Outcome};
use crate::checkpoint::pods::UploadBinding;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::run::AckSeen;
use crate::node::PodRef;
use crate::store::progress::Progress;
use crate::store::url::StoreOptions;

/// Async threads of the uploader's runtime (requests).
const WORKERS: usize = 2;
/// Blocking threads of the uploader's runtime (reads, writes, fsyncs).
const BLOCKING: usize = 8;

/// The operator's upload settings (`run`'s `--upload-*` and `--checkpoint-upload` flags).
#[derive(Clone, Debug)]
pub struct Settings {
    /// `--upload-allow`: empty refuses every upload.
    pub policy: UploadPolicy,
    /// `--upload-max-files`, `--upload-max-bytes`.
    pub limits: Limits,
    /// `--upload-concurrency`: requests (and part-sized buffers) in flight per upload.
    pub concurrency: usize,
    /// `--upload-part-size`.
    pub part_size: u64,
    /// `--upload-endpoint` and the connection pool.
    pub store: StoreOptions,
    /// The agent's `--state-dir`: upload journals live in its `uploads/`.
    pub state_dir: PathBuf,
    /// Host mode: `--checkpoint-upload`, the location bound to every trainer of this host (an
    /// ack's `upload` may name a place below it).
    pub host_location: Option<String>,

    /// This node's name, for manifests.
    pub node: Option<String>,
    /// `--relay` with `--relay-peers` and the node key: when a staged checkpoint is also
    /// streamed to a peer ([`super::handoff`]); `None`: never.
    pub relay: Option<super::handoff::Relay>,
}

/// The location a pod's `spotguard.io/checkpoint-upload` annotation names and the job the pod
/// belongs to (the agent's pod cache), by pod; `None`: not an opted-in pod the cache knows.
pub type PodLocation = Arc<dyn Fn(&PodRef) -> Option<UploadBinding> + Send + Sync>;

/// What the plan tells each upload it starts.
#[derive(Clone, Debug)]
pub struct PlanContext {
    /// `deadline − drain reserve`: the upload stops there and publishes nothing.
    pub deadline: Option<tokio::time::Instant>,
    pub notice: NoticeInfo,
    /// The plan's token: an agent stopping past its grace period stops its uploads (their
    /// journals stay for the next run).
    pub cancel: CancellationToken,
}

/// An upload started for a staged ack.
#[derive(Debug)]
pub struct Started {
    pub pod: Option<PodRef>,
    /// The checkpoint's directory.
    pub destination: String,
    pub files: usize,
    pub bytes: u64,
    pub handle: JoinHandle<Report>,
}

/// What a staged ack became.
#[derive(Debug)]
pub enum Staged {
    Started(Started),
    /// Nothing is uploaded (the trainer was answered `refused`, or the destination could not
    /// be opened after it was answered `taken`).
    Refused {
        pod: Option<PodRef>,
        staged: String,
        error: Error,
    },
}

/// The agent's upload service.
pub struct Service {
    uploader: Uploader,
    settings: Settings,
    metrics: Arc<UploadMetrics>,
    pod_location: Option<PodLocation>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service")
            .field("settings", &self.settings)
            .finish()
    }
}

impl Service {
    /// Start the uploader's runtime.
    pub fn new(
        settings: Settings,
        metrics: Arc<UploadMetrics>,
        pod_location: Option<PodLocation>,
    ) -> std::io::Result<Service> {
        let uploader = Uploader::new(WORKERS, BLOCKING)?; // raises RLIMIT_NOFILE first
        let budget = super::budget::install_node();
        let memory = super::budget::install_memory(
            (settings.concurrency.max(1) as u64).saturating_mul(settings.part_size),
        );
        if settings.limits.max_files as u64 > budget.total() / 2 {
            warn!(
                max_files = settings.limits.max_files,
                descriptors = budget.total(),
                "--upload-max-files is more than half the upload descriptor budget: a tree that large is refused (raise LimitNOFILE)"
            );
        }
        info!(
            descriptors = budget.total(),
            buffer_bytes = memory.total(),
            "upload budget"
        );
        Ok(Service {
            uploader,
            settings,
            metrics,
            pod_location,
        })
    }

    /// Whether any destination is allowed.
    pub fn enabled(&self) -> bool {
        !self.settings.policy.allow.is_empty()
    }

    /// A terminal ack seen while its process lives: `None` unless it is a staged `done`. Takes
    /// the tree, answers the trainer, and starts the upload. Quick and blocking (directory reads
    /// and opens); no network.
    pub fn on_ack(&self, seen: &AckSeen<'_>, ctx: &PlanContext) -> Option<Staged> {
        let pod = seen.pod.cloned();
        let staged = seen.ack.staged.clone().unwrap_or_default();
        let refused = |error: Error| {
            self.metrics.error(error.metric_label());
            self.metrics.ended(Outcome::Refused.as_str(), 0.0);
            warn!(staged = %staged, pod = ?pod.as_ref().map(pod_key), error = %error, "staged checkpoint refused");
            Some(Staged::Refused {
                pod: pod.clone(),
                staged: staged.clone(),
                error,
            })
        };
        let req = match StagedRequest::from_ack(seen.ack) {
            Ok(None) => return None,
            Ok(Some(r)) => r,
            Err(e) => {
                let _ = ack::write_answer(seen.dir, seen.process.ns_pid, &ack::Answer::refused(&e));
                return refused(e);
            }
        };
        let acker = Acker {
            pid: seen.process.pid,
            start_time: seen.process.start_time,
            ns_pid: seen.process.ns_pid,
        };
        let taken = match ack::take(
            seen.proc,
            acker,
            seen.dir,
            &req,
            &self.binding(seen.pod),
            &self.settings.policy,
            &self.settings.limits,
            &self.store_options(),
        ) {
            Ok(t) => t,
            Err(e) => return refused(e),
        };
        let destination = taken.resolved.destination.display();
        let (files, bytes) = (taken.tree.files.len(), taken.tree.bytes);
        info!(
            staged = %req.staged.display(),
            destination = %destination,
            files,
            bytes,
            pod = ?pod.as_ref().map(pod_key),
            "staged checkpoint taken; uploading"
        );
        let location = taken.resolved.location.display();
        let job = self.job_for(taken, &req, ctx, pod.as_ref());
        let handle = match &self.settings.relay {
            None => self.uploader.submit(job),
            Some(relay) => {
                let namespace = pod.as_ref().map(|p| p.namespace.as_str());
                let sender = self.settings.node.as_deref().unwrap_or("");
                let (reserve, sources) = handoff::outgoing(&job, &location, namespace, sender);
                let (progress, cancel, relayed) = (
                    job.progress.clone(),
                    job.cancel.clone(),
                    job.relayed.clone(),
                );
                let upload = self.uploader.submit(job);
                self.uploader.handle().spawn(handoff::race(
                    upload,
                    relay.clone(),
                    reserve,
                    sources,
                    progress,
                    bytes,
                    ctx.deadline,
                    cancel,
                    relayed,
                ))
            }
        };
        Some(Staged::Started(Started {
            pod,
            destination,
            files,
            bytes,
            handle,
        }))
    }

    /// The job's bound location and, in Kubernetes, its owner (host mode: the acking process's
    /// uid, read with its root).
    fn binding(&self, pod: Option<&PodRef>) -> Binding {
        match (pod, &self.pod_location) {
            (Some(p), Some(lookup)) => lookup(p)
                .map(|b| Binding {
                    location: b.location,
                    writer: Some(Writer::kube(
                        &b.owner.namespace,
                        &b.owner.kind,
                        &b.owner.name,
                    )),
                    namespace: Some(p.namespace.clone()),
                })
                .unwrap_or_default(),
            (Some(_), None) => Binding::default(),
            (None, _) => Binding {
                location: self.settings.host_location.clone(),
                writer: None,
                namespace: None,
            },
        }
    }

    /// The upload of a taken tree.
    fn job_for(
        &self,
        taken: Taken,
        req: &StagedRequest,
        ctx: &PlanContext,
        pod: Option<&PodRef>,
    ) -> Job {
        Job {
            meta: Meta {
                name: taken.resolved.name.clone(),
                step: taken.resolved.step,
                part: req.part,
                notice: Some(ctx.notice.clone()),
                origin: Origin {
                    staged: req.staged.display().to_string(),
                    node: self.settings.node.clone(),
                    pod: pod.map(pod_key),
                },
                acked_at: Some(jiff::Timestamp::now()),
                writer: Some(taken.writer.clone()),
            },
            root: taken.root,
            tree: taken.tree,
            target: taken.target,
            options: self.options(ctx.deadline),
            progress: Arc::new(Progress::default()),
            metrics: Some(self.metrics.clone()),
            cancel: ctx.cancel.child_token(),
            relayed: Default::default(),
        }
    }

    /// At start-up: the uploads an earlier run of the agent left (its journals): resume those
    /// whose staged files are still reachable, report the others (`interrupted`, nothing
    /// published). Returns the resumed uploads.
    pub async fn recover(&self, cancel: &CancellationToken) -> Vec<JoinHandle<Report>> {
        let found = uploader::recover(
            &self.settings.state_dir,
            &ProcFs::default(),
            Some(&self.settings.policy),
            &self.settings.limits,
            &self.store_options(),
        )
        .await;
        let mut resumed = Vec::new();
        for r in found {
            match r {
                Recovery::Abandoned { record, reason } => {
                    let e = Error::Resume {
                        dest: record.destination.clone(),
                        reason,
                    };
                    self.metrics.ended(Outcome::Interrupted.as_str(), 0.0);
                    self.metrics.error(e.metric_label());
                    warn!(destination = %record.destination, error = %e, "an upload interrupted by an agent restart was not resumed; its multipart uploads were aborted");
                }
                Recovery::Unreadable {
                    journal,
                    error,
                    aborted,
                } => {
                    let e = Error::Journal {
                        path: journal.display().to_string(),
                        reason: error,
                    };
                    self.metrics.ended(Outcome::Interrupted.as_str(), 0.0);
                    self.metrics.error(e.metric_label());
                    warn!(error = %e, aborted, "an upload interrupted by an agent restart left an unreadable journal: not resumed, nothing was published, the multipart uploads it recorded were aborted");
                }
                Recovery::Resume {
                    record,
                    tree,
                    destination,
                    deadline,
                } => {
                    let job = self.resumed_job(record, tree, &destination, deadline, cancel);
                    resumed.extend(job.map(|j| self.uploader.submit(j)));
                }
            }
        }
        resumed
    }

    /// The upload of a journal found at start-up, when its destination is still allowed and
    /// opens; `None` (and said so) otherwise.
    fn resumed_job(
        &self,
        record: Record,
        tree: StagedTree,
        destination: &Location,
        deadline: Option<tokio::time::Instant>,
        cancel: &CancellationToken,
    ) -> Option<Job> {
        let granted = match self
            .settings
            .policy
            .check(destination, record.namespace.as_deref())
        {
            Ok(g) => g,
            Err(e) => {
                warn!(destination = %record.destination, error = %e, "not resuming an upload");
                return None;
            }
        };
        let target = match Target::open(destination, &granted, &self.store_options()) {
            Ok(t) => t,
            Err(e) => {
                self.metrics.ended(Outcome::Interrupted.as_str(), 0.0);
                warn!(destination = %record.destination, error = %e, "cannot resume an upload");
                return None;
            }
        };
        info!(destination = %record.destination, files = tree.files.len(), "resuming an upload interrupted by an agent restart");
        Some(Job {
            meta: Meta {
                name: record.name.clone(),
                step: record.step,
                part: record.part,
                notice: None,
                origin: Origin {
                    staged: record.staged.clone(),
                    node: self.settings.node.clone(),
                    pod: None,
                },
                acked_at: None,
                writer: None,
            },
            root: record.root.clone(),
            tree,
            target,
            // The plan's deadline still holds: the notice did not move.
            options: self.options(deadline),
            progress: Arc::new(Progress::default()),
            metrics: Some(self.metrics.clone()),
            cancel: cancel.child_token(),
            relayed: Default::default(),
        })
    }

    fn options(&self, deadline: Option<tokio::time::Instant>) -> Options {
        Options {
            concurrency: self.settings.concurrency,
            memory: (self.settings.concurrency as u64).saturating_mul(self.settings.part_size),
            part_size: self.settings.part_size,
            deadline,
            state_dir: Some(self.settings.state_dir.clone()),
            ..Options::default()
        }
    }

    fn store_options(&self) -> StoreOptions {
        StoreOptions {
            pool: self.settings.concurrency,
            ..self.settings.store.clone()
        }
    }
}

/// `namespace/name`.
pub fn pod_key(pod: &PodRef) -> String {
    format!("{}/{}", pod.namespace, pod.name)
}
