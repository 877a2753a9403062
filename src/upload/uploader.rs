//! Where uploads run: an [`Uploader`] owns a tokio runtime of its own — its own worker and
//! blocking threads, named `sg-upload`, at nice +10 — so that a checkpoint upload never shares a
//! thread, a task queue or a blocking pool with the checkpoint signal, the ack watchers or the
//! drain, and loses the CPU to them when they need it. Its memory is bounded by the jobs'
//! buffer pools ([`super::pool`]); reads drop the page cache behind them.
//!
//! [`recover`] is what a restarted uploader does with the journals an earlier run left: resume
//! the uploads whose staged files it can still reach, report and clean up the others.

use std::path::Path;

use tokio::task::JoinHandle;
use tracing::{info, warn};

use super::dest::{Location, UploadPolicy};
use super::journal::{self, Record, RootRecord};
use super::staged::{self, Limits, Root, StagedTree};
use super::target::Target;
use super::{Job, Report};
use crate::checkpoint::procfs::ProcFs;
use crate::prefetch::source::StoreOptions;

/// Nice value of the upload threads.
const NICE: i32 = 10;

/// A runtime for uploads, apart from everything else in the process.
pub struct Uploader {
    rt: Option<tokio::runtime::Runtime>,
}

impl Uploader {
    /// Start the runtime: `workers` async threads (requests), at most `blocking` threads for
    /// reads, writes and fsyncs.
    pub fn new(workers: usize, blocking: usize) -> std::io::Result<Uploader> {
        staged::raise_open_file_limit();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.max(1))
            .max_blocking_threads(blocking.max(1))
            .thread_name("sg-upload")
            .on_thread_start(|| {
                let tid = rustix::thread::gettid().as_raw_nonzero().get();
                // SAFETY: setpriority on this thread's own id, no pointers.
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, NICE);
                }
            })
            .enable_all()
            .build()?;
        Ok(Uploader { rt: Some(rt) })
    }

    /// Run `job` on the upload runtime. The handle may be awaited from any runtime.
    pub fn submit(&self, job: Job) -> JoinHandle<Report> {
        self.handle().spawn(super::engine::run(job))
    }

    /// The upload runtime's handle.
    pub fn handle(&self) -> tokio::runtime::Handle {
        match &self.rt {
            Some(rt) => rt.handle().clone(),
            None => unreachable!("the runtime lives until drop"),
        }
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        // Dropping a runtime inside another one panics: let its threads go in the background.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// What became of an earlier run's journal.
pub enum Recovery {
    /// The staged files are reachable again: upload with this tree and record (the engine
    /// reuses what the record says is done when given the same state directory).
    Resume {
        record: Record,
        tree: StagedTree,
        destination: Location,
    },
    /// Not resumable: its multipart uploads were aborted and the journal removed; report it
    /// (`interrupted`).
    Abandoned { record: Record, reason: String },
}

/// Go through the journals under `state_dir`: those of this boot whose staged tree can be
/// captured again (the trainer process still alive, or a host-root tree) come back as
/// [`Recovery::Resume`]; the others are abandoned. Unreadable journals are removed and logged.
pub async fn recover(
    state_dir: &Path,
    proc: &ProcFs,
    policy: Option<&UploadPolicy>,
    limits: &Limits,
    store: &StoreOptions,
) -> Vec<Recovery> {
    let boot_id = crate::life::read_boot_id().unwrap_or_default();
    let mut out = Vec::new();
    for (path, record) in journal::list(state_dir) {
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                warn!(journal = %path.display(), error = %e, "removing an unreadable upload journal");
                let _ = std::fs::remove_file(&path);
                continue;
            }
        };
        match try_resume(&record, &boot_id, proc, policy, limits) {
            Ok((tree, destination)) => out.push(Recovery::Resume {
                record,
                tree,
                destination,
            }),
            Err(reason) => {
                abandon(&record, policy, store).await;
                let _ = std::fs::remove_file(&path);
                info!(
                    destination = %record.destination,
                    reason = %reason,
                    "an upload interrupted by a restart cannot resume; nothing was published"
                );
                out.push(Recovery::Abandoned { record, reason });
            }
        }
    }
    out
}

fn try_resume(
    record: &Record,
    boot_id: &str,
    proc: &ProcFs,
    policy: Option<&UploadPolicy>,
    limits: &Limits,
) -> Result<(StagedTree, Location), String> {
    if record.boot_id != boot_id {
        return Err(format!(
            "it belongs to an earlier boot ({}); the staged files did not survive it",
            record.boot_id
        ));
    }
    let destination = Location::parse(&record.destination).map_err(|e| e.to_string())?;
    if let Some(p) = policy {
        p.check(&destination).map_err(|e| e.to_string())?;
    }
    let root = match &record.root {
        RootRecord::Host { owner } => {
            let mut r = Root::host().map_err(|e| e.to_string())?;
            r.uid = *owner;
            r
        }
        RootRecord::Process { pid, start_time } => Root::of_process(proc, *pid, *start_time)
            .map_err(|e| format!("the staged files are out of reach: {e}"))?,
    };
    let tree = staged::capture(&root, Path::new(&record.staged), limits)
        .map_err(|e| format!("the staged directory cannot be captured again: {e}"))?;
    Ok((tree, destination))
}

/// Abort the multipart uploads a journal holds open (best effort).
async fn abandon(record: &Record, policy: Option<&UploadPolicy>, store: &StoreOptions) {
    let uploads = record.open_uploads();
    if uploads.is_empty() {
        return;
    }
    let Ok(dest) = Location::parse(&record.destination) else {
        return;
    };
    let granted = match policy {
        Some(p) => match p.check(&dest) {
            Ok(g) => g,
            Err(_) => return,
        },
        None => super::dest::Granted::Store,
    };
    if !matches!(dest, Location::Store(_)) {
        return;
    }
    match Target::open(&dest, &granted, store) {
        Ok(Target::Store(s)) => {
            for (path, id) in uploads {
                s.abort(&path, &id).await;
            }
        }
        Ok(Target::Dir(_)) => {}
        Err(e) => {
            warn!(destination = %record.destination, error = %e, "cannot abort the uploads of an abandoned journal")
        }
    }
}

impl std::fmt::Debug for Uploader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Uploader")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::upload::journal::{Journal, VERSION};

    fn record(boot: &str, root: RootRecord, staged: &Path, dest: &Path) -> Record {
        Record {
            version: VERSION,
            boot_id: boot.into(),
            destination: dest.display().to_string(),
            staged: staged.display().to_string(),
            root,
            started_at: "2026-01-01T00:00:00Z".into(),
            files: BTreeMap::new(),
            name: "step-1".into(),
            step: Some(1),
            part: None,
        }
    }

    #[tokio::test]
    async fn a_restarted_uploader_resumes_what_it_can_reach_and_reports_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let state = tmp.path().join("state");
        let staged = tmp.path().join("step-1");
        std::fs::create_dir_all(&staged).unwrap();
        std::fs::write(staged.join("w"), b"w").unwrap();
        let boot = crate::life::read_boot_id().unwrap();
        let proc = ProcFs::default();
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let gone_pid = gone.id() as i32;
        let gone_start = proc.start_time(gone_pid).unwrap();
        gone.wait().unwrap();
        let journals = [
            (
                "a",
                record(
                    "an-earlier-boot",
                    RootRecord::Host { owner: None },
                    &staged,
                    &tmp.path().join("d/a"),
                ),
            ),
            (
                "b",
                record(
                    &boot,
                    RootRecord::Process {
                        pid: gone_pid,
                        start_time: gone_start,
                    },
                    &staged,
                    &tmp.path().join("d/b"),
                ),
            ),
            (
                "c",
                record(
                    &boot,
                    RootRecord::Host { owner: None },
                    &staged,
                    &tmp.path().join("d/c"),
                ),
            ),
        ];
        for (key, r) in journals {
            Journal::new(journal::path_for(&state, key), r)
                .flush()
                .unwrap();
        }
        let got = recover(
            &state,
            &proc,
            None,
            &Limits::default(),
            &StoreOptions::default(),
        )
        .await;
        let mut resumed = Vec::new();
        let mut abandoned = Vec::new();
        for r in got {
            match r {
                Recovery::Resume { record, tree, .. } => {
                    assert_eq!(tree.files.len(), 1);
                    resumed.push(record.destination);
                }
                Recovery::Abandoned { record, reason } => {
                    abandoned.push((record.destination, reason))
                }
            }
        }
        assert_eq!(resumed, vec![tmp.path().join("d/c").display().to_string()]);
        abandoned.sort();
        assert_eq!(abandoned.len(), 2, "{abandoned:?}");
        assert!(abandoned[0].1.contains("earlier boot"), "{abandoned:?}");
        assert!(abandoned[1].1.contains("out of reach"), "{abandoned:?}");
        // Abandoned journals are gone; the resumable one stays for the run that resumes it.
        assert_eq!(journal::list(&state).len(), 1);
    }
}
