//! Wires the agent: one root `CancellationToken`, one `JoinSet` of tasks — the notice monitor(s),
//! the responder, the GPU monitor, the prefetcher triggers and the admin server.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::{broadcast, mpsc};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::{self, Readiness};
use crate::checkpoint::discover::{HostDiscovery, HostTargets};
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::TargetDiscovery;
use crate::config::{Config, Mode};
use crate::metrics::Metrics;
use crate::node::host::{HostNodeOps, StateFile};
use crate::node::kube::KubeNodeOps;
use crate::node::NodeOps;
use crate::notice::monitor::{run_monitor, PollHealth};
use crate::notice::{self, NoticeSource, Source};
use crate::responder::{PlanEvent, Responder, ResponderConfig, StartHook};
use crate::{gpu, kube_discovery, prefetch, webhook};

/// Errors that stop the agent at start-up (everything after start-up is logged and retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding the metrics server to {addr}: {source}")]
    BindAdmin {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("creating the Kubernetes client (in-cluster config or KUBECONFIG): {0}")]
    KubeClient(String),
    #[error("webhook: {0}")]
    Webhook(String),
    #[error("building the metadata client: {0}")]
    Source(String),
    #[error("the {0} task ended before shutdown")]
    TaskEnded(&'static str),
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        false
    }
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::BindAdmin { .. } => "bind_admin",
            Error::KubeClient(_) => "kube_client",
            Error::Webhook(_) => "webhook",
            Error::Source(_) => "source",
            Error::TaskEnded(_) => "task_ended",
        }
    }
}

/// A started agent.
pub struct App {
    /// Plan progress (used by `drill` and tests).
    pub events: broadcast::Receiver<PlanEvent>,
    /// Where /metrics, /healthz and /readyz are served.
    pub admin_addr: SocketAddr,
    /// The metrics registry.
    pub registry: Arc<Registry>,
    /// Completes when every task has stopped after cancellation; an error when a task ended (or
    /// panicked) before it: the process must then exit non-zero.
    pub join: JoinHandle<Result<(), Error>>,
}

struct PollReadiness(Arc<PollHealth>);

impl Readiness for PollReadiness {
    fn ready(&self) -> Result<(), String> {
        if self.0.ready(tokio::time::Instant::now()) {
            Ok(())
        } else {
            Err("no metadata poll succeeded recently".into())
        }
    }
}

/// Start every task; returns once the admin server is bound and the tasks are spawned.
pub async fn start(cfg: Config, cancel: CancellationToken) -> Result<App, Error> {
    start_with_client(cfg, cancel, None).await
}

/// [`start`] with a Kubernetes client given instead of inferred from the environment (tests
/// point it at an in-process API server). Used only in Kubernetes mode.
pub async fn start_with_client(
    cfg: Config,
    cancel: CancellationToken,
    client: Option<kube::Client>,
) -> Result<App, Error> {
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::register(&mut registry));
    let gce_metrics = notice::monitor::GceMetrics::register(&mut registry);
    let gpu_metrics = Arc::new(gpu::GpuMetrics::register(&mut registry));
    let prefetch_metrics = Arc::new(prefetch::PrefetchMetrics::register(&mut registry));
    let boot_id = match gpu::read_boot_id_from(&cfg.args.boot_id_file) {
        Ok(id) => Some(id),
        Err(e) => {
            metrics.error("responder", e.metric_label());
            warn!(error = %e, "no boot id: persisted plan state cannot tell a previous life of the machine");
            None
        }
    };

    // Node operations and checkpoint discovery, per mode.
    let (node, discovery, kube_client): (
        Arc<dyn NodeOps>,
        Arc<dyn TargetDiscovery>,
        Option<kube::Client>,
    ) = match cfg.mode {
        Mode::Host => {
            let node: Arc<dyn NodeOps> =
                Arc::new(HostNodeOps::new(&cfg.args.state_dir, cfg.args.dry_run));
            let discovery = Arc::new(
                HostDiscovery::new(HostTargets {
                    units: cfg.args.checkpoint_unit.clone(),
                    pidfiles: cfg.args.checkpoint_pidfile.clone(),
                    cmdlines: cfg.args.checkpoint_cmdline.clone(),
                    dir: cfg.args.checkpoint_dir.clone(),
                    signal: cfg.args.checkpoint_signal,
                    timeout: cfg.args.checkpoint_timeout,
                })
                .with_proc(ProcFs::new(cfg.args.proc_root.clone())),
            );
            (node, discovery, None)
        }
        Mode::Kubernetes => {
            let client = match client {
                Some(c) => c,
                None => {
                    // kube's default client retries 429s for minutes: the drain must see PDB
                    // refusals, so build it without that retry.
                    let config = kube::Config::infer()
                        .await
                        .map_err(|e| Error::KubeClient(e.to_string()))?;
                    crate::node::kube::client_from_config(config)
                        .map_err(|e| Error::KubeClient(e.to_string()))?
                }
            };
            let node_name = cfg.node_name.clone().unwrap_or_default();
            let own_pod = match (&cfg.pod_namespace, &cfg.pod_name) {
                (Some(ns), Some(n)) => Some((ns.clone(), n.clone())),
                _ => None,
            };
            let ops = Arc::new(KubeNodeOps::new(
                client.clone(),
                node_name.clone(),
                own_pod,
                cfg.args.dry_run,
                metrics.clone(),
            ));
            let discovery = Arc::new(kube_discovery::KubeDiscovery::new(
                client.clone(),
                node_name,
                ops.clone(),
                kube_discovery::Defaults {
                    signal: cfg.args.checkpoint_signal,
                    timeout: cfg.args.checkpoint_timeout,
                },
                cfg.args.proc_root.clone(),
                metrics.clone(),
            ));
            (ops, discovery, Some(client))
        }
    };

    // Notice sources.
    let health = Arc::new(PollHealth::new());
    let (notice_tx, notice_rx) = mpsc::channel(64);
    let mut tasks = JoinSet::new();
    let sources = match cfg.args.cloud.source() {
        Some(src) => vec![build_source(&cfg, src, &metrics, &gce_metrics)?],
        None => Vec::new(),
    };
    let mut names: HashMap<tokio::task::Id, &'static str> = HashMap::new();
    for s in &sources {
        let h = tasks.spawn(run_monitor(
            s.clone(),
            notice_tx.clone(),
            metrics.clone(),
            health.clone(),
            cancel.child_token(),
        ));
        names.insert(h.id(), "notice monitor");
    }
    if sources.is_empty() {
        // Auto-detect in the background: never fatal, keep serving everything else.
        let cfg2 = cfg.clone();
        let (tx, m, h, gm, c) = (
            notice_tx.clone(),
            metrics.clone(),
            health.clone(),
            gce_metrics.clone(),
            cancel.child_token(),
        );
        let h = tasks.spawn(async move {
            let mut delay = Duration::from_secs(2);
            let source = loop {
                let probe = match &cfg2.args.metadata_endpoint {
                    Some(u) => notice::detect::ProbeEndpoints::all(u.clone()),
                    None => notice::detect::ProbeEndpoints::default(),
                };
                match notice::detect::detect(&cfg2.args.dmi_dir, &probe, Duration::from_secs(2))
                    .await
                {
                    Ok(s) => break s,
                    Err(e) => {
                        m.error("detect", e.metric_label());
                        warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "cloud auto-detection failed; set --cloud to skip it");
                    }
                }
                tokio::select! {
                    _ = c.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(60));
            };
            info!(cloud = source.as_str(), "cloud detected");
            match build_source(&cfg2, source, &m, &gm) {
                Ok(s) => run_monitor(s, tx, m, h, c).await,
                Err(e) => error!(error = %e, "cannot watch the detected cloud"),
            }
        });
        names.insert(h.id(), "cloud detection and notice monitor");
    }
    drop(notice_tx);

    // Hooks run when handling starts: cancel prefetches, send the webhook.
    let mut on_start: Vec<StartHook> = Vec::new();
    let prefetcher = Arc::new(prefetch::Prefetcher::new(
        cfg.args.cache_dir.clone(),
        cfg.args.cache_max_bytes,
        prefetch::PrefetchDefaults {
            store: prefetch::StoreOptions {
                endpoint: cfg.args.prefetch_endpoint.clone(),
                ..Default::default()
            },
            ..Default::default()
        },
        prefetch_metrics,
        cancel.child_token(),
    ));
    {
        let p = prefetcher.clone();
        on_start.push(Box::new(move |n| {
            if n.kind == notice::NoticeKind::Interruption {
                p.cancel_all();
            }
        }));
    }
    if let Some(url) = &cfg.args.webhook_url {
        let hook = Arc::new(
            webhook::Webhook::new(
                url.clone(),
                cfg.args.webhook_template.clone(),
                metrics.clone(),
            )
            .map_err(|e| Error::Webhook(e.to_string()))?,
        );
        let node_name = cfg.node_name.clone().unwrap_or_else(hostname);
        let instance = hostname();
        let action = match cfg.mode {
            Mode::Kubernetes => "checkpoint, cordon and drain",
            Mode::Host => "checkpoint",
        };
        on_start.push(Box::new(move |n| {
            let _ = hook.notify(&webhook::NotifyFields::from_notice(
                n, &node_name, &instance, action,
            ));
        }));
    }

    // The responder.
    let responder = Responder::new(
        ResponderConfig {
            on_rebalance: cfg.args.on_rebalance,
            rebalance_expiry: cfg.args.rebalance_expiry,
            on_maintenance: cfg.args.on_maintenance,
            on_azure_freeze: cfg.args.on_azure_freeze,
            maintenance_lead: cfg.args.maintenance_lead,
            checkpoint_timeout: cfg.args.checkpoint_timeout,
            drain_reserve: cfg.args.drain_reserve,
            force_delete_at_deadline: cfg.args.force_delete_at_deadline,
            drain_concurrency: usize::from(cfg.args.drain_concurrency),
            dry_run: cfg.args.dry_run,
            shutdown_grace: cfg.args.shutdown_grace,
            boot_id: boot_id.clone(),
        },
        crate::responder::Deps {
            node: node.clone(),
            local: StateFile::new(&cfg.args.state_dir, cfg.args.dry_run),
            discovery,
            sources: sources.clone(),
            metrics: metrics.clone(),
            on_start,
        },
    );
    let events = responder.subscribe();
    let h = tasks.spawn(responder.run(notice_rx, cancel.clone()));
    names.insert(h.id(), "responder");

    // GPU health: NVML is loaded (and retried) by the probe itself; `off` starts nothing.
    match gpu::probe_from_config(cfg.gpu.mode) {
        Ok(probe) => {
            let h = tasks.spawn(gpu::run_monitor(
                probe,
                node.clone(),
                gpu_metrics,
                cfg.gpu.clone(),
                cancel.child_token(),
            ));
            names.insert(h.id(), "GPU monitor");
        }
        Err(e) => info!(reason = %e, "GPU monitoring off"),
    }

    // Prefetch: datasets from config at start, pod annotations in Kubernetes mode.
    for d in &cfg.datasets {
        match prefetcher.ensure(&d.name, &d.url) {
            Ok(how) => info!(dataset = %d.name, url = %d.url, ?how, "prefetch at start"),
            Err(e) => {
                metrics.error("prefetch", e.metric_label());
                error!(dataset = %d.name, error = %e, "cannot prefetch dataset");
            }
        }
    }
    if let (Some(client), Some(node_name)) = (kube_client, cfg.node_name.clone()) {
        let h = tasks.spawn(kube_discovery::watch_prefetch_annotations(
            client,
            node_name,
            prefetcher.clone(),
            metrics.clone(),
            cancel.child_token(),
        ));
        names.insert(h.id(), "prefetch annotation watch");
    }

    // Admin server.
    let registry = Arc::new(registry);
    let (admin_addr, serve) = admin::bind(
        cfg.args.metrics_addr,
        registry.clone(),
        Arc::new(PollReadiness(health)),
        cancel.child_token(),
    )
    .await
    .map_err(|source| Error::BindAdmin {
        addr: cfg.args.metrics_addr,
        source,
    })?;
    let h = tasks.spawn(serve);
    names.insert(h.id(), "admin server");
    info!(
        mode = ?cfg.mode,
        node = cfg.node_name.as_deref().unwrap_or("-"),
        metrics = %admin_addr,
        dry_run = cfg.args.dry_run,
        "spotguard started"
    );

    let join = tokio::spawn(supervise(tasks, names, cancel));
    Ok(App {
        events,
        admin_addr,
        registry,
        join,
    })
}

/// Wait for every task. Each runs until cancellation; one that ends (or panics) before is a bug:
/// stop the others and fail, so that the process exits non-zero and systemd / the kubelet restarts
/// it (it resumes from the persisted state). `/healthz` never stays green over a dead responder.
async fn supervise(
    mut tasks: JoinSet<()>,
    names: HashMap<tokio::task::Id, &'static str>,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let mut failed: Option<&'static str> = None;
    while let Some(r) = tasks.join_next_with_id().await {
        let (id, panicked) = match &r {
            Ok((id, ())) => (*id, None),
            Err(e) => (e.id(), e.is_panic().then(|| e.to_string())),
        };
        let name = names.get(&id).copied().unwrap_or("task");
        if let Some(p) = &panicked {
            error!(task = name, error = %p, "a task panicked");
        }
        if !cancel.is_cancelled() || panicked.is_some() {
            if failed.is_none() {
                error!(
                    task = name,
                    "a task ended before shutdown: stopping the agent so that it is restarted"
                );
                failed = Some(name);
            }
            cancel.cancel();
        }
    }
    info!("all tasks stopped");
    match failed {
        Some(task) => Err(Error::TaskEnded(task)),
        None => Ok(()),
    }
}

fn build_source(
    cfg: &Config,
    source: Source,
    metrics: &Arc<Metrics>,
    gce_metrics: &notice::monitor::GceMetrics,
) -> Result<Arc<dyn NoticeSource>, Error> {
    let endpoint = cfg.args.metadata_endpoint.clone();
    let built: Result<Arc<dyn NoticeSource>, notice::Error> = match source {
        Source::Aws => notice::ec2::Ec2Imds::new(
            notice::ec2::Ec2Config::new(
                endpoint,
                cfg.args.poll_interval,
                cfg.args.imds_v1_fallback,
            ),
            metrics.clone(),
        )
        .map(|s| Arc::new(s) as Arc<dyn NoticeSource>),
        Source::Gce => notice::gce::GceMetadata::new(
            notice::gce::GceConfig::new(endpoint, cfg.args.gce_preemption_notice),
            metrics.clone(),
            gce_metrics.clone(),
        )
        .map(|s| Arc::new(s) as Arc<dyn NoticeSource>),
        Source::Azure => notice::azure::AzureScheduledEvents::new(
            notice::azure::AzureConfig::new(
                endpoint,
                cfg.args.poll_interval,
                cfg.args.azure_vm_name.clone(),
            ),
            metrics.clone(),
        )
        .map(|s| Arc::new(s) as Arc<dyn NoticeSource>),
    };
    built.map_err(|e| Error::Source(e.to_string()))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_task_that_ends_early_stops_the_others_and_fails() {
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut names = HashMap::new();
        let c = cancel.clone();
        let h = tasks.spawn(async move { c.cancelled().await });
        names.insert(h.id(), "monitor");
        let h = tasks.spawn(async {});
        names.insert(h.id(), "responder");
        let r = tokio::time::timeout(
            Duration::from_secs(5),
            supervise(tasks, names, cancel.clone()),
        )
        .await
        .expect("the others are stopped");
        assert!(matches!(r, Err(Error::TaskEnded("responder"))), "{r:?}");
        assert!(cancel.is_cancelled());
    }

    #[tokio::test]
    async fn a_panicking_task_fails_the_agent() {
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut names = HashMap::new();
        let h = tasks.spawn(async { panic!("boom") });
        names.insert(h.id(), "responder");
        let r = supervise(tasks, names, cancel.clone()).await;
        assert!(matches!(r, Err(Error::TaskEnded("responder"))), "{r:?}");
    }

    #[tokio::test]
    async fn tasks_ending_at_shutdown_are_fine() {
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let c = cancel.clone();
        tasks.spawn(async move { c.cancelled().await });
        cancel.cancel();
        assert!(supervise(tasks, HashMap::new(), cancel).await.is_ok());
    }
}
