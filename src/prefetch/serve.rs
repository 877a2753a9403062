//! `spotguard prefetch-serve`: the prefetcher as its own process, apart from the safety agent.
//!
//! Bulk dataset I/O (page cache, queued writes, a blocking pool busy with `pwritev` and
//! `fsync`) never shares a memory cgroup or a thread pool with the checkpoint path: in
//! Kubernetes it runs as its own container of the DaemonSet pod (own memory limit), on a host
//! as a child process of `spotguard run` (own threads and heap). The two share only the cache
//! directory and its claim protocol, and one file: the agent writes `<cache>/.spotguard-stop`
//! when an interruption notice arrives, and this process then cancels every run (part files and
//! claims are checkpointed for whoever resumes them).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::annotations::AnnotationWatcher;
use super::policy::{AllowPattern, AnnotationPolicy};
use super::{PrefetchDefaults, PrefetchMetrics, Prefetcher, StoreOptions};
use crate::backoff::Backoff;

/// Name of the stop file in the cache root.
pub const STOP_FILE: &str = ".spotguard-stop";
/// Default share of the cache's filesystem the cache may fill when no byte limit is given.
pub const DEFAULT_CACHE_FRACTION: f64 = 0.5;

/// A dataset given on the command line: `NAME=URL` or a URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetSpec {
    pub name: String,
    pub url: String,
}

fn parse_dataset(s: &str) -> Result<DatasetSpec, String> {
    let (name, url) = crate::store::parse_spec(s).map_err(|e| e.to_string())?;
    Ok(DatasetSpec { name, url })
}

fn parse_allow(s: &str) -> Result<AllowPattern, String> {
    AllowPattern::parse(s)
}

fn parse_fraction(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("invalid fraction {s:?}"))?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("fraction {s} must be in (0, 1]"));
    }
    Ok(v)
}

fn parse_flag(s: &str) -> Result<bool, String> {
    match s {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("expected true or false, got {s:?}")),
    }
}

/// Arguments of `spotguard prefetch-serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Shared dataset cache root.
    #[arg(
        long,
        env = "SPOTGUARD_CACHE_DIR",
        value_name = "DIR",
        default_value = "/var/cache/spotguard"
    )]
    pub cache_dir: PathBuf,

    /// Evict least-recently-used datasets above this size (e.g. 500GiB) [default: --cache-max-fraction of the filesystem].
    #[arg(long, env = "SPOTGUARD_CACHE_MAX_BYTES", value_name = "BYTES", value_parser = crate::units::parse_limit)]
    pub cache_max_bytes: Option<u64>,

    /// Without --cache-max-bytes: the share of the cache's filesystem the cache may fill.
    #[arg(long, env = "SPOTGUARD_CACHE_MAX_FRACTION", value_name = "FRACTION", default_value = "0.5", value_parser = parse_fraction)]
    pub cache_max_fraction: f64,

    /// Dataset to warm at start, NAME=URL or a bare URL (repeatable; operator-chosen, so
    /// file:// is allowed here).
    #[arg(long, env = "SPOTGUARD_PREFETCH", value_name = "NAME=URL", value_delimiter = ',', value_parser = parse_dataset)]
    pub prefetch: Vec<DatasetSpec>,

    /// S3-compatible endpoint for prefetch sources (e.g. http://127.0.0.1:9000).
    #[arg(long, env = "SPOTGUARD_PREFETCH_ENDPOINT", value_name = "URL", value_parser = crate::store::url::parse_http_url)]
    pub endpoint: Option<String>,

    /// Honour pods' spotguard.io/prefetch annotations (Kubernetes; off by default).
    #[arg(long, env = "SPOTGUARD_PREFETCH_ANNOTATIONS", value_name = "BOOL", num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = parse_flag)]
    pub annotations: bool,

    /// What pods may request: s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX] ('*' in BUCKET; '{namespace}' as a whole segment: the requesting pod's namespace, its dataset cached as <namespace>--NAME), comma-separated.
    #[arg(long, env = "SPOTGUARD_PREFETCH_ALLOW", value_name = "PATTERN", value_delimiter = ',', value_parser = parse_allow)]
    pub allow: Vec<AllowPattern>,

    /// This node (Kubernetes: the pods whose annotations are read).
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Where /metrics, /healthz and /readyz are served; none when unset.
    #[arg(long, env = "SPOTGUARD_PREFETCH_METRICS_ADDR", value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// How often the datasets pods asked for are started again if evicted or failed, and their
    /// leases touched (pods' annotations come from a watch of the node's pods, not this round).
    #[arg(long, default_value = "30s", value_parser = crate::duration::parse)]
    pub annotation_interval: Duration,
}

struct AlwaysReady;

impl crate::admin::Readiness for AlwaysReady {
    fn ready(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The cache limit: `--cache-max-bytes`, else the fraction of the filesystem's size.
pub fn cache_limit(dir: &Path, max_bytes: Option<u64>, fraction: f64) -> Option<u64> {
    if max_bytes.is_some() {
        return max_bytes;
    }
    let st = rustix::fs::statvfs(dir).ok()?;
    let total = st.f_blocks.saturating_mul(st.f_frsize);
    Some((total as f64 * fraction) as u64)
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The agent's side: ask the prefetcher to stop (an interruption notice). Blocking; small. No
/// cache directory: no prefetcher to stop.
pub fn request_stop(cache_dir: &Path) -> std::io::Result<()> {
    if !cache_dir.is_dir() {
        return Ok(());
    }
    let body = serde_json::json!({
        "boot_id": boot_id(),
        "at": jiff::Timestamp::now().to_string(),
    });
    // Not fsynced: written beside the signal, and a request of this boot only (`boot_id`).
    crate::fsutil::write_atomic_with(
        &cache_dir.join(STOP_FILE),
        body.to_string().as_bytes(),
        0o644,
        crate::fsutil::Durability::None,
    )
}

/// Remove a stop request (a new agent life). Blocking.
pub fn clear_stop(cache_dir: &Path) {
    let _ = std::fs::remove_file(cache_dir.join(STOP_FILE));
}

/// Whether a stop was requested in this boot.
pub fn stop_requested(cache_dir: &Path) -> bool {
    let Ok(bytes) = std::fs::read(cache_dir.join(STOP_FILE)) else {
        return false;
    };
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    // A request from an earlier boot is stale.
    v.get("boot_id").and_then(|b| b.as_str()) == Some(boot_id().as_str())
}

/// Run `spotguard prefetch-serve` until `cancel`; returns the exit code.
pub async fn run_serve(args: ServeArgs, cancel: CancellationToken) -> i32 {
    if let Err(e) = std::fs::create_dir_all(&args.cache_dir) {
        error!(dir = %args.cache_dir.display(), error = %e, "cannot create the cache directory");
        return 2;
    }
    let limit = cache_limit(
        &args.cache_dir,
        args.cache_max_bytes,
        args.cache_max_fraction,
    );
    let mut registry = Registry::default();
    let metrics = Arc::new(PrefetchMetrics::register(&mut registry));
    // The node ops below only post pod Events, which count nothing; the agent's families are the
    // agent's: registered here they would be served at 0 beside the prefetcher's (a
    // `spotguard_metadata_polls_total` that never rises makes `SpotguardAgentBlind` fire for this
    // target). Their registry is not served.
    let agent_metrics = Arc::new(crate::metrics::Metrics::register(&mut Registry::default()));
    let prefetcher = Prefetcher::new(
        args.cache_dir.clone(),
        limit,
        PrefetchDefaults {
            store: StoreOptions {
                endpoint: args.endpoint.clone(),
                ..Default::default()
            },
            ..Default::default()
        },
        metrics.clone(),
        cancel.child_token(),
    );
    info!(
        cache = %args.cache_dir.display(),
        cache_max_bytes = limit.unwrap_or(0),
        annotations = args.annotations,
        allow = %args.allow.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(","),
        "prefetcher started"
    );
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(watch_stop_request(
        prefetcher.clone(),
        args.cache_dir.clone(),
        cancel.clone(),
    ));
    if !stop_requested(&args.cache_dir) {
        prefetch_configured(&args, &prefetcher, &metrics);
    }
    let started = async {
        watch_annotations(
            &args,
            &prefetcher,
            &metrics,
            agent_metrics,
            &mut tasks,
            &cancel,
        )
        .await?;
        serve_metrics(&args, registry, &mut tasks, &cancel).await
    };
    if let Err(code) = started.await {
        return code;
    }
    cancel.cancelled().await;
    prefetcher.cancel_all();
    // Let the runs checkpoint their part files.
    for s in prefetcher.status() {
        let _ = tokio::time::timeout(Duration::from_secs(10), prefetcher.wait(&s.name)).await;
    }
    tasks.abort_all();
    0
}

/// The agent's stop request (a file in the cache, polled every 500 ms): cancel every run.
async fn watch_stop_request(p: Prefetcher, dir: PathBuf, c: CancellationToken) {
    loop {
        let d = dir.clone();
        let stop = tokio::task::spawn_blocking(move || stop_requested(&d))
            .await
            .unwrap_or(false);
        if stop {
            warn!("the agent asked the prefetcher to stop (interruption notice)");
            p.cancel_all();
            return;
        }
        tokio::select! {
            _ = c.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}

/// Start the `--prefetch` datasets.
fn prefetch_configured(args: &ServeArgs, prefetcher: &Prefetcher, metrics: &PrefetchMetrics) {
    for d in &args.prefetch {
        match prefetcher.ensure(&d.name, &d.url) {
            Ok(how) => {
                info!(dataset = %d.name, url = %d.url, how = how.as_str(), "prefetch at start")
            }
            Err(e) => {
                metrics.error(e.metric_label());
                error!(dataset = %d.name, error = %e, "cannot prefetch dataset");
            }
        }
    }
}

/// Kubernetes (NODE_NAME set): read pods' annotations, also when pod requests are off, so that a
/// pod asking for one learns from an Event why nothing happens. `Err`: the exit code.
async fn watch_annotations(
    args: &ServeArgs,
    prefetcher: &Prefetcher,
    metrics: &Arc<PrefetchMetrics>,
    agent_metrics: Arc<crate::metrics::Metrics>,
    tasks: &mut tokio::task::JoinSet<()>,
    cancel: &CancellationToken,
) -> Result<(), i32> {
    let Some(node_name) = args.node_name.clone().filter(|n| !n.is_empty()) else {
        if args.annotations {
            error!("--annotations needs --node-name (NODE_NAME)");
            return Err(super::cli::EXIT_USAGE);
        }
        return Ok(());
    };
    if args.annotations && args.allow.is_empty() {
        warn!("--annotations is on but --allow is empty: every pod request is refused");
    }
    let client = match kube::Config::infer().await {
        Ok(config) => kube::Client::try_from(config).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match client {
        Ok(client) => {
            let events = Arc::new(crate::node::kube::KubeNodeOps::new(
                client.clone(),
                node_name.clone(),
                None,
                false,
                agent_metrics,
            ));
            let watcher = AnnotationWatcher {
                pods: kube::Api::all(client),
                node_name,
                prefetcher: prefetcher.clone(),
                policy: AnnotationPolicy {
                    enabled: args.annotations,
                    allow: args.allow.clone(),
                },
                events,
                metrics: metrics.clone(),
                interval: args.annotation_interval,
            };
            tasks.spawn(watcher.run(Arc::default(), cancel.child_token()));
        }
        Err(e) if args.annotations => {
            error!(error = %e, "--annotations needs a Kubernetes client (in-cluster or KUBECONFIG)");
            return Err(2);
        }
        Err(e) => info!(error = %e, "no Kubernetes client: pods' annotations are not read"),
    }
    Ok(())
}

/// `--metrics-addr`: serve the prefetcher's metrics. `Err`: the exit code.
async fn serve_metrics(
    args: &ServeArgs,
    registry: Registry,
    tasks: &mut tokio::task::JoinSet<()>,
    cancel: &CancellationToken,
) -> Result<(), i32> {
    let Some(addr) = args.metrics_addr else {
        return Ok(());
    };
    match crate::admin::bind(
        addr,
        Arc::new(registry),
        Arc::new(AlwaysReady),
        cancel.child_token(),
    )
    .await
    {
        Ok((bound, serve)) => {
            info!(metrics = %bound, "prefetcher metrics served");
            tasks.spawn(serve);
            Ok(())
        }
        Err(e) => {
            error!(addr = %addr, error = %e, "cannot bind the metrics address");
            Err(2)
        }
    }
}

/// Host mode: run `spotguard prefetch-serve` for the configured datasets as a child process of
/// the agent (own threads and heap), restarted with backoff if it ends, stopped with SIGTERM
/// (then SIGKILL after 15 s) on shutdown.
pub async fn run_child(
    datasets: Vec<String>,
    cache_dir: PathBuf,
    cache_max_bytes: Option<u64>,
    endpoint: Option<String>,
    metrics: Arc<crate::metrics::Metrics>,
    cancel: CancellationToken,
) {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            metrics.error("prefetch", "spawn");
            error!(error = %e, "cannot find this binary to start the prefetcher");
            return;
        }
    };
    // The project's one backoff (jittered exponential), 1 s doubling to 60 s between restarts.
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("prefetch-serve")
            .arg("--cache-dir")
            .arg(&cache_dir)
            .arg("--prefetch")
            .arg(datasets.join(","))
            .env_remove("SPOTGUARD_PREFETCH_ANNOTATIONS")
            .env_remove("NODE_NAME")
            .env_remove("SPOTGUARD_PREFETCH_ALLOW")
            .kill_on_drop(true);
        if let Some(m) = cache_max_bytes {
            cmd.arg("--cache-max-bytes").arg(m.to_string());
        }
        if let Some(e) = &endpoint {
            cmd.arg("--endpoint").arg(e);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                metrics.error("prefetch", "spawn");
                error!(error = %e, "cannot start the prefetcher process");
                return;
            }
        };
        info!(pid = child.id().unwrap_or(0), "prefetcher process started");
        let delay = backoff.next_delay();
        tokio::select! {
            status = child.wait() => {
                match status {
                    Ok(s) if s.success() => {
                        info!("prefetcher process finished");
                        return;
                    }
                    Ok(s) => {
                        metrics.error("prefetch", "child_exit");
                        warn!(status = %s, retry_in_s = delay.as_secs(), "prefetcher process ended");
                    }
                    Err(e) => {
                        metrics.error("prefetch", "child_exit");
                        warn!(error = %e, "waiting for the prefetcher process failed");
                    }
                }
            }
            _ = cancel.cancelled() => {
                if let Some(pid) = child.id() {
                    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                    }
                }
                if tokio::time::timeout(Duration::from_secs(15), child.wait()).await.is_err() {
                    let _ = child.kill().await;
                }
                return;
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_requests_belong_to_this_boot() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!stop_requested(dir.path()));
        request_stop(dir.path()).unwrap();
        assert!(stop_requested(dir.path()));
        // A request from another boot is stale.
        std::fs::write(
            dir.path().join(STOP_FILE),
            br#"{"boot_id":"another-boot","at":"x"}"#,
        )
        .unwrap();
        assert!(!stop_requested(dir.path()));
        clear_stop(dir.path());
        assert!(!dir.path().join(STOP_FILE).exists());
        // No cache directory: nothing to stop, no error.
        request_stop(&dir.path().join("absent")).unwrap();
    }

    #[test]
    fn the_cache_limit_defaults_to_a_share_of_the_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(cache_limit(dir.path(), Some(123), 0.5), Some(123));
        let st = rustix::fs::statvfs(dir.path()).unwrap();
        let total = st.f_blocks * st.f_frsize;
        let half = cache_limit(dir.path(), None, 0.5).unwrap();
        assert!(half > 0 && half <= total / 2 + 1, "{half} of {total}");
    }
}
