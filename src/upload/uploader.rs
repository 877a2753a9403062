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
use crate::store::url::StoreOptions;

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
    /// The staged files are reachable again, every one of them the file that was taken: upload
    /// with this tree and record (the engine reuses what the record says is done when given the
    /// same state directory), stopping at the journaled deadline.
    Resume {
        record: Record,
        tree: StagedTree,
        destination: Location,
        /// The plan's deadline, carried over from the journal.
        deadline: Option<tokio::time::Instant>,
    },
    /// Not resumable: its multipart uploads were aborted and the journal removed; report it
    /// (`interrupted`).
    Abandoned { record: Record, reason: String },
    /// A journal that cannot be read (or a side file whose journal is gone): the multipart
    /// uploads its side file names were aborted and both files removed; report it.
    Unreadable {
        journal: std::path::PathBuf,
        error: String,
        /// Multipart uploads aborted.
        aborted: usize,
    },
}

/// Go through the journals under `state_dir`: those of this boot whose staged tree can be
/// captured again (the trainer process still alive, or a host-root tree) with every journaled
/// file found again unchanged, and whose deadline has not passed, come back as
/// [`Recovery::Resume`]; the others are abandoned. Unreadable journals are removed after the
/// uploads their side files name are aborted.
pub async fn recover(
    state_dir: &Path,
    proc: &ProcFs,
    policy: Option<&UploadPolicy>,
    limits: &Limits,
    store: &StoreOptions,
) -> Vec<Recovery> {
    let boot_id = crate::life::read_boot_id().unwrap_or_default();
    let mut out = Vec::new();
    let mut unreadable: Vec<(std::path::PathBuf, String)> = journal::orphaned_uploads(state_dir)
        .into_iter()
        .map(|p| (p, "its journal is gone".to_string()))
        .collect();
    for (path, record) in journal::list(state_dir) {
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                unreadable.push((path, e.to_string()));
                continue;
            }
        };
        match try_resume(&record, &boot_id, proc, policy, limits) {
            Ok((tree, destination, deadline)) => out.push(Recovery::Resume {
                record,
                tree,
                destination,
                deadline,
            }),
            Err(reason) => {
                let mut uploads = record.open_uploads();
                for u in journal::read_uploads(&path) {
                    let done = record.files.get(&u.path).is_some_and(|f| f.done.is_some());
                    let pair = (u.path, u.upload_id);
                    if u.destination == record.destination && !done && !uploads.contains(&pair) {
                        uploads.push(pair);
                    }
                }
                abort(
                    &record.destination,
                    record.namespace.as_deref(),
                    &uploads,
                    policy,
                    store,
                )
                .await;
                journal::remove_all(&path);
                info!(
                    destination = %record.destination,
                    reason = %reason,
                    "an upload interrupted by a restart cannot resume; nothing was published"
                );
                out.push(Recovery::Abandoned { record, reason });
            }
        }
    }
    for (path, error) in unreadable {
        type ByDest = std::collections::BTreeMap<(String, Option<String>), Vec<(String, String)>>;
        let mut by_dest = ByDest::default();
        let side = journal::read_uploads(&path);
        let aborted = side.len();
        for u in side {
            by_dest
                .entry((u.destination, u.namespace))
                .or_default()
                .push((u.path, u.upload_id));
        }
        for ((dest, namespace), uploads) in by_dest {
            abort(&dest, namespace.as_deref(), &uploads, policy, store).await;
        }
        journal::remove_all(&path);
        warn!(journal = %path.display(), error = %error, aborted, "removed an unreadable upload journal after aborting the multipart uploads it recorded");
        out.push(Recovery::Unreadable {
            journal: path,
            error,
            aborted,
        });
    }
    out
}

fn try_resume(
    record: &Record,
    boot_id: &str,
    proc: &ProcFs,
    policy: Option<&UploadPolicy>,
    limits: &Limits,
) -> Result<(StagedTree, Location, Option<tokio::time::Instant>), String> {
    if record.boot_id != boot_id {
        return Err(format!(
            "it belongs to an earlier boot ({}); the staged files did not survive it",
            record.boot_id
        ));
    }
    let deadline = match &record.deadline {
        None => None,
        Some(d) => {
            let at: jiff::Timestamp = d
                .parse()
                .map_err(|e| format!("its deadline {d:?} cannot be read: {e}"))?;
            let left = at.duration_since(jiff::Timestamp::now());
            let left = std::time::Duration::try_from(left)
                .ok()
                .filter(|l| !l.is_zero())
                .ok_or_else(|| format!("its deadline ({d}) passed while the agent was down"))?;
            Some(tokio::time::Instant::now() + left)
        }
    };
    let destination = Location::parse(&record.destination).map_err(|e| e.to_string())?;
    if let Some(p) = policy {
        p.check(&destination, record.namespace.as_deref())
            .map_err(|e| e.to_string())?;
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
    same_files(record, &tree)?;
    Ok((tree, destination, deadline))
}

/// Every file the journal says was taken is in `tree` with the same identity (device, inode,
/// size, mtime, ctime), and nothing else is: the path alone proves nothing (the trainer may
/// delete or rewrite its staged files once it was answered `taken`).
fn same_files(record: &Record, tree: &StagedTree) -> Result<(), String> {
    let mut missing = Vec::new();
    let mut changed = Vec::new();
    for (path, rec) in &record.files {
        match tree.files.iter().find(|f| &f.path == path) {
            None => missing.push(path.as_str()),
            Some(f) => {
                let (a, b) = (rec.id, f.id);
                if (a.dev, a.ino, a.size, a.mtime_ns, a.ctime_ns)
                    != (b.dev, b.ino, b.size, b.mtime_ns, b.ctime_ns)
                {
                    changed.push(path.as_str());
                }
            }
        }
    }
    let extra: Vec<&str> = tree
        .files
        .iter()
        .filter(|f| !record.files.contains_key(&f.path))
        .map(|f| f.path.as_str())
        .collect();
    if missing.is_empty() && changed.is_empty() && extra.is_empty() {
        return Ok(());
    }
    let list = |v: &[&str]| {
        let mut s = v.iter().take(3).copied().collect::<Vec<_>>().join(", ");
        if v.len() > 3 {
            s.push_str(&format!(" and {} more", v.len() - 3));
        }
        s
    };
    let mut why = Vec::new();
    if !missing.is_empty() {
        why.push(format!(
            "{} taken file(s) are gone ({})",
            missing.len(),
            list(&missing)
        ));
    }
    if !changed.is_empty() {
        why.push(format!(
            "{} taken file(s) are not the files that were taken ({})",
            changed.len(),
            list(&changed)
        ));
    }
    if !extra.is_empty() {
        why.push(format!(
            "{} file(s) were not taken ({})",
            extra.len(),
            list(&extra)
        ));
    }
    Err(format!(
        "the staged directory no longer holds exactly what was taken: {}",
        why.join("; ")
    ))
}

/// Abort the multipart uploads `uploads` (path, id) under `destination` (best effort).
async fn abort(
    destination: &str,
    namespace: Option<&str>,
    uploads: &[(String, String)],
    policy: Option<&UploadPolicy>,
    store: &StoreOptions,
) {
    if uploads.is_empty() {
        return;
    }
    let Ok(dest) = Location::parse(destination) else {
        warn!(
            destination,
            "cannot abort the uploads of an abandoned journal: not a destination"
        );
        return;
    };
    let granted = match policy {
        Some(p) => match p.check(&dest, namespace) {
            Ok(g) => g,
            Err(e) => {
                warn!(destination, error = %e, "not aborting the uploads of an abandoned journal");
                return;
            }
        },
        None => super::dest::Granted::Store,
    };
    if !matches!(dest, Location::Store(_)) {
        return;
    }
    match Target::open(&dest, &granted, store) {
        Ok(Target::Store(s)) => {
            for (path, id) in uploads {
                s.abort(path, id).await;
            }
        }
        Ok(Target::Dir(_)) => {}
        Err(e) => {
            warn!(destination, error = %e, "cannot abort the uploads of an abandoned journal")
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
    use std::time::Duration;

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
            deadline: None,
            namespace: None,
        }
    }

    /// The journal's view of `staged` as taken now.
    fn taken(staged: &Path) -> BTreeMap<String, crate::upload::journal::FileRecord> {
        let tree = staged::capture(&Root::host().unwrap(), staged, &Limits::default()).unwrap();
        tree.files
            .iter()
            .map(|f| {
                (
                    f.path.clone(),
                    crate::upload::journal::FileRecord {
                        id: f.id,
                        part_size: 8 << 20,
                        upload_id: None,
                        parts: BTreeMap::new(),
                        done: None,
                    },
                )
            })
            .collect()
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
                Record {
                    files: taken(&staged),
                    deadline: Some(
                        (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(600)).to_string(),
                    ),
                    ..record(
                        &boot,
                        RootRecord::Host { owner: None },
                        &staged,
                        &tmp.path().join("d/c"),
                    )
                },
            ),
            // Its deadline passed while the agent was down.
            (
                "d",
                Record {
                    files: taken(&staged),
                    deadline: Some(
                        (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(1)).to_string(),
                    ),
                    ..record(
                        &boot,
                        RootRecord::Host { owner: None },
                        &staged,
                        &tmp.path().join("d/d"),
                    )
                },
            ),
            // One more file was taken than the directory holds now.
            (
                "e",
                Record {
                    files: {
                        let mut f = taken(&staged);
                        let w = f["w"].clone();
                        f.insert("gone".into(), w);
                        f
                    },
                    ..record(
                        &boot,
                        RootRecord::Host { owner: None },
                        &staged,
                        &tmp.path().join("d/e"),
                    )
                },
            ),
            // The file at the taken path is another file (rewritten under the same name).
            (
                "f",
                Record {
                    files: {
                        let mut f = taken(&staged);
                        f.get_mut("w").unwrap().id.ino += 1;
                        f
                    },
                    ..record(
                        &boot,
                        RootRecord::Host { owner: None },
                        &staged,
                        &tmp.path().join("d/f"),
                    )
                },
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
                Recovery::Resume {
                    record,
                    tree,
                    deadline,
                    ..
                } => {
                    assert_eq!(tree.files.len(), 1);
                    // The journaled deadline, ten minutes away.
                    let left = deadline.unwrap() - tokio::time::Instant::now();
                    assert!(left > Duration::from_secs(590) && left <= Duration::from_secs(600));
                    resumed.push(record.destination);
                }
                Recovery::Abandoned { record, reason } => {
                    abandoned.push((record.destination, reason))
                }
                Recovery::Unreadable { journal, error, .. } => {
                    panic!("{} unreadable: {error}", journal.display())
                }
            }
        }
        assert_eq!(resumed, vec![tmp.path().join("d/c").display().to_string()]);
        abandoned.sort();
        assert_eq!(abandoned.len(), 5, "{abandoned:#?}");
        assert!(abandoned[0].1.contains("earlier boot"), "{abandoned:?}");
        assert!(abandoned[1].1.contains("out of reach"), "{abandoned:?}");
        assert!(
            abandoned[2].1.contains("passed while the agent was down"),
            "{abandoned:?}"
        );
        assert!(
            abandoned[3].1.contains("1 taken file(s) are gone (gone)"),
            "{abandoned:?}"
        );
        assert!(
            abandoned[4]
                .1
                .contains("1 taken file(s) are not the files that were taken (w)"),
            "{abandoned:?}"
        );
        // Abandoned journals are gone; the resumable one stays for the run that resumes it.
        assert_eq!(journal::list(&state).len(), 1);
    }
}
