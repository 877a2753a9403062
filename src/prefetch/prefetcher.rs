//! The daemon side of prefetching: [`Prefetcher`] warms datasets (`--prefetch NAME=URL`, the
//! config list, pod annotations) into `<cache_root>/<name>` in the background, one run per
//! dataset, and reports their state.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::download::{self, FetchOptions, Outcome};
use super::metrics::PrefetchMetrics;
use super::{cache, Error};
use crate::store::progress::{Progress, Snapshot};
use crate::store::url::{self as source, SourceUrl, StoreOptions};
use crate::sync::lock;

/// Defaults the daemon applies to every dataset it prefetches.
#[derive(Clone, Debug, Default)]
pub struct PrefetchDefaults {
    pub fetch: FetchOptions,
    pub store: StoreOptions,
}

/// What [`Prefetcher::ensure`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ensure {
    /// A run was started.
    Started,
    /// A run for this dataset is going on already.
    InProgress,
    /// The dataset is complete in the cache.
    AlreadyComplete,
}

impl Ensure {
    pub fn as_str(self) -> &'static str {
        match self {
            Ensure::Started => "started",
            Ensure::InProgress => "in_progress",
            Ensure::AlreadyComplete => "complete",
        }
    }
}

/// State of a dataset known to the [`Prefetcher`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetState {
    Running,
    Complete,
    Incomplete,
    Failed,
    Cancelled,
}

/// One dataset in [`Prefetcher::status`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct DatasetStatus {
    pub name: String,
    pub url: String,
    pub state: DatasetState,
    pub progress: Snapshot,
    pub started_at: Option<jiff::Timestamp>,
    pub finished_at: Option<jiff::Timestamp>,
    /// The error that stopped the last run, or the first failed object.
    pub error: Option<String>,
}

struct Tracked {
    url: String,
    state: DatasetState,
    progress: Arc<Progress>,
    started_at: Option<jiff::Timestamp>,
    finished_at: Option<jiff::Timestamp>,
    error: Option<String>,
}

struct Inner {
    cache_root: PathBuf,
    max_bytes: Option<u64>,
    defaults: PrefetchDefaults,
    metrics: Arc<PrefetchMetrics>,
    cancel: CancellationToken,
    datasets: Mutex<BTreeMap<String, Tracked>>,
    changed: Notify,
}

/// The daemon's prefetcher: warms datasets into `<cache_root>/<name>` in the background.
/// Cloning shares it.
#[derive(Clone)]
pub struct Prefetcher {
    inner: Arc<Inner>,
}

/// How often the daemon logs the progress of a running dataset.
const LOG_EVERY: Duration = Duration::from_secs(10);

impl Prefetcher {
    /// `cancel` ends every run (shutdown); [`Prefetcher::cancel_all`] does the same on an
    /// interruption notice.
    pub fn new(
        cache_root: PathBuf,
        max_bytes: Option<u64>,
        defaults: PrefetchDefaults,
        metrics: Arc<PrefetchMetrics>,
        cancel: CancellationToken,
    ) -> Prefetcher {
        Prefetcher {
            inner: Arc::new(Inner {
                cache_root,
                max_bytes,
                defaults,
                metrics,
                cancel,
                datasets: Mutex::new(BTreeMap::new()),
                changed: Notify::new(),
            }),
        }
    }

    /// Make sure dataset `name` from `url` is (being) prefetched. Idempotent: a dataset that is
    /// complete (in this process or on disk) or running is not restarted; a failed, incomplete
    /// or cancelled one is started again. Must be called within a tokio runtime.
    pub fn ensure(&self, name: &str, url: &str) -> Result<Ensure, Error> {
        source::validate_name(name)?;
        let src = SourceUrl::parse(url)?;
        if self.inner.cancel.is_cancelled() {
            return Err(Error::Cancelled);
        }
        let paths = cache::DatasetPaths::new(&self.inner.cache_root, name);
        let mut datasets = lock(&self.inner.datasets);
        if let Some(t) = datasets.get(name) {
            if !cache::same_source(&t.url, url) {
                return Err(Error::NameInUse {
                    name: name.to_string(),
                    existing: t.url.clone(),
                    requested: url.to_string(),
                });
            }
            match t.state {
                DatasetState::Running => return Ok(Ensure::InProgress),
                // Still on disk? (It may have been evicted since: then fetch it again.)
                DatasetState::Complete if paths.complete.exists() => {
                    return Ok(Ensure::AlreadyComplete)
                }
                DatasetState::Complete
                | DatasetState::Incomplete
                | DatasetState::Failed
                | DatasetState::Cancelled => {}
            }
        }
        // A directory holding another source is never overwritten.
        cache::check_source(&paths, url)?;
        if let Some(marker) = cache::CompleteMarker::read(&paths.complete) {
            if cache::same_source(&marker.source, url) {
                datasets.insert(
                    name.to_string(),
                    Tracked {
                        url: url.to_string(),
                        state: DatasetState::Complete,
                        progress: complete_progress(&marker),
                        started_at: None,
                        finished_at: None,
                        error: None,
                    },
                );
                return Ok(Ensure::AlreadyComplete);
            }
        }
        let store = source::build_store(&src, &self.inner.defaults.store)?;
        let progress = Arc::new(Progress::default());
        datasets.insert(
            name.to_string(),
            Tracked {
                url: url.to_string(),
                state: DatasetState::Running,
                progress: progress.clone(),
                started_at: Some(jiff::Timestamp::now()),
                finished_at: None,
                error: None,
            },
        );
        drop(datasets);

        let mut options = self.inner.defaults.fetch.clone();
        options.max_bytes = self.inner.max_bytes;
        let job = download::Job {
            store,
            source: src,
            paths,
            cache_root: self.inner.cache_root.clone(),
            options,
            progress: progress.clone(),
            metrics: Some(self.inner.metrics.clone()),
            cancel: self.inner.cancel.child_token(),
        };
        tokio::spawn(run_dataset(
            self.inner.clone(),
            name.to_string(),
            job,
            progress,
        ));
        Ok(Ensure::Started)
    }

    /// [`Prefetcher::ensure`] under the name derived from the URL ([`SourceUrl::default_name`]).
    /// Returns the name.
    pub fn ensure_url(&self, url: &str) -> Result<(String, Ensure), Error> {
        let name = SourceUrl::parse(url)?.default_name();
        let outcome = self.ensure(&name, url)?;
        Ok((name, outcome))
    }

    /// Cancel every run (an interruption notice: the node is going away). Part files and claims
    /// are checkpointed so another node, or this one after a restart, resumes them. Later
    /// [`Prefetcher::ensure`] calls return [`Error::Cancelled`].
    pub fn cancel_all(&self) {
        tracing::info!("cancelling all prefetches");
        self.inner.cancel.cancel();
    }

    /// The cache root.
    pub fn cache_root(&self) -> &std::path::Path {
        &self.inner.cache_root
    }

    /// Every dataset this prefetcher knows, by name.
    pub fn status(&self) -> Vec<DatasetStatus> {
        lock(&self.inner.datasets)
            .iter()
            .map(|(name, t)| DatasetStatus {
                name: name.clone(),
                url: t.url.clone(),
                state: t.state,
                progress: t.progress.snapshot(),
                started_at: t.started_at,
                finished_at: t.finished_at,
                error: t.error.clone(),
            })
            .collect()
    }

    /// Wait until dataset `name` is not running any more; `None` if it is unknown.
    pub async fn wait(&self, name: &str) -> Option<DatasetStatus> {
        loop {
            let notified = self.inner.changed.notified();
            let current = self.status().into_iter().find(|s| s.name == name)?;
            if current.state != DatasetState::Running {
                return Some(current);
            }
            notified.await;
        }
    }
}

/// The progress of a dataset found complete on disk.
fn complete_progress(marker: &cache::CompleteMarker) -> Arc<Progress> {
    let progress = Arc::new(Progress::default());
    Progress::add(&progress.files_total, marker.objects);
    Progress::add(&progress.files_done, marker.objects);
    Progress::add(&progress.files_present, marker.objects);
    Progress::add(&progress.bytes_total, marker.bytes);
    Progress::add(&progress.bytes_done, marker.bytes);
    progress
        .listed
        .store(true, std::sync::atomic::Ordering::Relaxed);
    progress
}

/// Run `job` for dataset `name`, logging its progress, then record how it ended.
async fn run_dataset(inner: Arc<Inner>, name: String, job: download::Job, progress: Arc<Progress>) {
    tracing::info!(dataset = %name, url = %job.source.url, "prefetch started");
    let stop_log = CancellationToken::new();
    let logger = tokio::spawn(log_progress(progress, name.clone(), stop_log.clone()));
    let report = download::fetch_dataset(job).await;
    stop_log.cancel();
    let _ = logger.await;
    let s = &report.summary;
    let state = match s.outcome {
        Outcome::Complete => DatasetState::Complete,
        Outcome::Incomplete => DatasetState::Incomplete,
        Outcome::Failed => DatasetState::Failed,
        Outcome::Cancelled => DatasetState::Cancelled,
    };
    let error = s
        .error
        .clone()
        .or_else(|| s.errors.first().map(|e| e.error.clone()));
    tracing::info!(
        dataset = %name,
        outcome = s.outcome.as_str(),
        files_done = s.counts.files_done,
        files_total = s.counts.files_total,
        bytes_fetched = s.counts.bytes_fetched,
        duration_s = s.duration_s,
        error = error.as_deref().unwrap_or(""),
        "prefetch finished"
    );
    if let Some(t) = lock(&inner.datasets).get_mut(&name) {
        t.state = state;
        t.finished_at = Some(jiff::Timestamp::now());
        t.error = error;
    }
    inner.changed.notify_waiters();
}

async fn log_progress(progress: Arc<Progress>, name: String, stop: CancellationToken) {
    let mut tick = tokio::time::interval(LOG_EVERY);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let s = progress.snapshot();
        tracing::info!(
            dataset = %name,
            bytes_done = s.bytes_done,
            bytes_total = s.bytes_total,
            files_done = s.files_done,
            files_total = s.files_total,
            listed = s.listed,
            "prefetch progress"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefetch::download::tests::pattern;

    /// A prefetcher of the cache at `root` with the defaults and its own metrics.
    fn prefetcher(root: &std::path::Path) -> Prefetcher {
        Prefetcher::new(
            root.to_path_buf(),
            None,
            PrefetchDefaults::default(),
            Arc::new(PrefetchMetrics::register(
                &mut prometheus_client::registry::Registry::default(),
            )),
            CancellationToken::new(),
        )
    }

    #[tokio::test]
    async fn a_dataset_directory_holding_another_source_is_never_overwritten() {
        let root = tempfile::tempdir().unwrap();
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        std::fs::write(a.path().join("x"), b"from a").unwrap();
        std::fs::write(b.path().join("y"), b"from b").unwrap();
        let p = prefetcher(root.path());
        let url_a = format!("file://{}", a.path().display());
        let url_b = format!("file://{}", b.path().display());
        p.ensure("ds", &url_a).unwrap();
        assert_eq!(p.wait("ds").await.unwrap().state, DatasetState::Complete);
        // Same name, other source: refused, in this process and in a fresh one (from disk).
        assert!(matches!(
            p.ensure("ds", &url_b),
            Err(Error::NameInUse { .. })
        ));
        let fresh = prefetcher(root.path());
        match fresh.ensure("ds", &url_b) {
            Err(Error::NameInUse { existing, .. }) => assert_eq!(existing, url_a),
            other => panic!("{other:?}"),
        }
        // A trailing slash is the same source.
        assert_eq!(
            fresh.ensure("ds", &format!("{url_a}/")).unwrap(),
            Ensure::AlreadyComplete
        );
        assert_eq!(std::fs::read(root.path().join("ds/x")).unwrap(), b"from a");
        assert!(!root.path().join("ds/y").exists());
    }

    #[tokio::test]
    async fn prefetcher_ensure_is_idempotent_and_reports_status() {
        let root = tempfile::tempdir().unwrap();
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("sub")).unwrap();
        std::fs::write(src.path().join("sub/x"), pattern(5000, 4)).unwrap();
        std::fs::write(src.path().join("y"), pattern(10, 4)).unwrap();
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(PrefetchMetrics::register(&mut registry));
        let p = Prefetcher::new(
            root.path().to_path_buf(),
            None,
            PrefetchDefaults::default(),
            metrics,
            CancellationToken::new(),
        );
        let url = format!("file://{}", src.path().display());
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::Started);
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::InProgress);
        assert!(matches!(
            p.ensure("local", "s3://b/other"),
            Err(Error::NameInUse { .. })
        ));
        assert!(matches!(
            p.ensure("../x", &url),
            Err(Error::Store(crate::store::Error::InvalidName { .. }))
        ));
        let st = p.wait("local").await.unwrap();
        assert_eq!(st.state, DatasetState::Complete, "{st:?}");
        assert_eq!(st.progress.files_done, 2);
        assert_eq!(
            std::fs::read(root.path().join("local/sub/x")).unwrap(),
            pattern(5000, 4)
        );
        assert_eq!(p.ensure("local", &url).unwrap(), Ensure::AlreadyComplete);
        let (derived, _) = p.ensure_url(&url).unwrap();
        assert_eq!(
            p.wait(&derived).await.unwrap().state,
            DatasetState::Complete
        );
        let text = crate::metrics::encode(&registry);
        assert!(
            text.contains("spotguard_prefetch_files_total{dataset=\"local\"} 2"),
            "{text}"
        );

        // A fresh prefetcher finds the complete marker on disk.
        let p2 = prefetcher(root.path());
        assert_eq!(p2.ensure("local", &url).unwrap(), Ensure::AlreadyComplete);
        p2.cancel_all();
        assert!(matches!(p2.ensure("other", &url), Err(Error::Cancelled)));
        assert_eq!(p2.status().len(), 1);
    }
}
