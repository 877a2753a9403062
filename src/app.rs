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
use crate::backoff::Backoff;
use crate::checkpoint::discover::{HostDiscovery, HostTargets};
use crate::checkpoint::kube_discovery;
use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::TargetDiscovery;
use crate::config::{Config, Mode};
use crate::metrics::Metrics;
use crate::node::host::HostNodeOps;
use crate::node::kube::KubeNodeOps;
use crate::node::NodeOps;
use crate::notice::monitor::{run_monitor, PollHealth};
use crate::notice::{self, Cloud, NoticeSource};
use crate::responder::record::StateFile;
use crate::responder::{PlanEvent, Responder, ResponderConfig, StartHook};
use crate::{gpu, prefetch, webhook};

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
    #[error("relay receiver: {0}")]
    Relay(String),
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
            Error::Relay(_) => "relay",
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
    /// Staged checkpoint upload metrics (`spotguard_checkpoint_upload_*`), for the upload step.
    pub upload_metrics: Arc<crate::upload::UploadMetrics>,
    /// Completes when every task has stopped after cancellation; an error when a task ended (or
    /// panicked) before it: the process must then exit non-zero.
    pub join: JoinHandle<Result<(), Error>>,
}

struct PollReadiness(Arc<PollHealth>, Result<(), String>);

impl Readiness for PollReadiness {
    fn ready(&self) -> Result<(), String> {
        // A kernel without the features checkpoint delivery needs is never ready.
        self.1.clone()?;
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
///
/// Start-up, in order: metrics, boot id and kernel probe; node operations and checkpoint
/// discovery for the mode; notice sources; the hooks run when handling starts (prefetch stop,
/// webhook); the responder and the outcome follower; the GPU monitor; the prefetcher process;
/// the admin server. Then one supervisor waits for all of them.
pub async fn start_with_client(
    cfg: Config,
    cancel: CancellationToken,
    client: Option<kube::Client>,
) -> Result<App, Error> {
    let mut telemetry = Telemetry::register(cfg.gpu.mode != gpu::GpuMode::Off);
    let metrics = telemetry.metrics.clone();
    let boot_id = read_boot_id(&cfg, &metrics);
    let life = life_of_the_machine(&cfg, boot_id).await;
    let kernel = probe_kernel();
    let mut tasks = Tasks::default();

    let (node, discovery, pod_location, discovery_ready, cluster_ledger) =
        node_and_discovery(&cfg, client, &metrics, &mut tasks, &cancel).await?;
    let kube = cluster_ledger.as_ref().map(|(c, _, _)| c.clone());
    let relay_peers = relay_peer_list(&cfg, kube.as_ref(), &mut tasks, &cancel);
    let upload = upload_service(&cfg, &telemetry, pod_location, relay_peers, &cancel).await;
    let inputs = spawn_notice_sources(&cfg, &telemetry, &mut tasks, &cancel)?;
    let hook = build_webhook(&cfg, &metrics)?;
    let who = Who::of(&cfg);
    let on_start = start_hooks(&cfg, hook.clone(), &who);
    let responder = Responder::new(
        responder_config(&cfg),
        crate::responder::Deps {
            node: node.clone(),
            local: StateFile::new(&cfg.args.state_dir, cfg.args.dry_run),
            discovery: discovery.clone(),
            sources: inputs.sources,
            metrics: metrics.clone(),
            on_start,
            life,
            upload,
        },
    );
    let events = responder.subscribe();
    // The relay Lease's notice mark follows the plan (Kubernetes).
    let relay_kube = kube.map(|c| (c, responder.subscribe()));
    let goodput_log =
        (!cfg.args.dry_run).then(|| cfg.args.state_dir.join(crate::goodput::report::LOG_FILE));
    // The node a job resumes on reports its recovery (off the signal path).
    let recovery = crate::goodput::recovery::Sinks {
        metrics: metrics.clone(),
        node: Some(node.clone()),
        node_name: who.node_name.clone(),
        goodput_log: goodput_log.clone(),
    };
    // What a recovery is checked against: the interruptions this agent logged, and in
    // Kubernetes those any agent recorded in the ledger for the pod's controller.
    let ledger = match cluster_ledger {
        Some((client, pods, owners)) => {
            crate::goodput::ledger::KubeLedger::factory(client, pods, owners, goodput_log.clone())
        }
        None => crate::goodput::recovery::log_ledger(goodput_log.clone()),
    };
    tasks.spawn(
        "recovery reports",
        crate::goodput::recovery::run_with(
            discovery,
            discovery_ready,
            recovery,
            ledger,
            cancel.child_token(),
        ),
    );
    spawn_outcome_follower(
        &responder,
        &node,
        (hook, goodput_log),
        who,
        &metrics,
        &mut tasks,
        &cancel,
    );
    tasks.spawn("responder", responder.run(inputs.notices, cancel.clone()));
    spawn_gpu_monitor(&cfg, &node, telemetry.gpu.clone(), &mut tasks, &cancel);
    spawn_prefetcher(&cfg, &metrics, &mut tasks, &cancel).await;
    spawn_relay_receiver(&cfg, &telemetry, relay_kube, &mut tasks, &cancel).await?;

    let registry = Arc::new(std::mem::take(&mut telemetry.registry));
    let admin_addr = spawn_admin_server(
        &cfg,
        registry.clone(),
        inputs.health,
        kernel,
        &mut tasks,
        &cancel,
    )
    .await?;
    info!(
        mode = cfg.mode.as_str(),
        node = cfg.node_name.as_deref().unwrap_or("-"),
        metrics = %admin_addr,
        dry_run = cfg.args.dry_run,
        "spotguard started"
    );

    let join = tokio::spawn(supervise(tasks.set, tasks.names, cancel));
    Ok(App {
        events,
        admin_addr,
        registry,
        upload_metrics: telemetry.upload.clone(),
        join,
    })
}

/// Every task the agent runs, each with the name the supervisor reports it by.
#[derive(Default)]
struct Tasks {
    set: JoinSet<()>,
    names: HashMap<tokio::task::Id, &'static str>,
}

impl Tasks {
    fn spawn(
        &mut self,
        name: &'static str,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let h = self.set.spawn(task);
        self.names.insert(h.id(), name);
    }
}

/// The metrics registry and the metric families the tasks share.
struct Telemetry {
    registry: Registry,
    metrics: Arc<Metrics>,
    /// The notice sources' own families (e.g. GCE's upcoming maintenance).
    sources: notice::SourceMetrics,
    gpu: Arc<gpu::GpuMetrics>,
    upload: Arc<crate::upload::UploadMetrics>,
    relay: Arc<crate::relay::metrics::RelayMetrics>,
}

impl Telemetry {
    /// `gpu`: export the `spotguard_gpu_*` families. With `--gpu off` no GPU monitor runs, and
    /// a `spotguard_gpu_probe_up 0` would fire the shipped `SpotguardGPUProbeDown` alert on every
    /// node where GPU health was turned off on purpose: the families then go to a registry that
    /// is never served.
    fn register(gpu: bool) -> Self {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let sources = notice::SourceMetrics::register(&mut registry);
        let gpu = Arc::new(if gpu {
            gpu::GpuMetrics::register(&mut registry)
        } else {
            gpu::GpuMetrics::register(&mut Registry::default())
        });
        let upload = Arc::new(crate::upload::UploadMetrics::register(&mut registry));
        // Registered with the relay off too: every series exists at 0 from start-up.
        let relay = Arc::new(crate::relay::metrics::RelayMetrics::register(&mut registry));
        Telemetry {
            registry,
            metrics,
            sources,
            gpu,
            upload,
            relay,
        }
    }
}

/// This boot's id: persisted plan state is stamped with it to tell the machine's lives apart.
fn read_boot_id(cfg: &Config, metrics: &Metrics) -> Option<String> {
    match crate::life::read_boot_id_from(&cfg.args.boot_id_file) {
        Ok(id) => Some(id),
        Err(e) => {
            metrics.error("responder", e.metric_label());
            warn!(error = %e, "no boot id: persisted plan state cannot tell a previous life of the machine");
            None
        }
    }
}

/// The machine's current life (`crate::life`): this boot, and the resumes from hibernation seen
/// in it (`<state-dir>/life.json`).
async fn life_of_the_machine(cfg: &Config, boot_id: Option<String>) -> Arc<crate::life::Lives> {
    let dir = cfg.args.state_dir.clone();
    let dry_run = cfg.args.dry_run;
    let fallback = (dir.clone(), boot_id.clone());
    match tokio::task::spawn_blocking(move || crate::life::Lives::open(&dir, boot_id, dry_run))
        .await
    {
        Ok(l) => Arc::new(l),
        Err(e) => {
            warn!(error = %e, "reading the life mark failed");
            Arc::new(crate::life::Lives::open(&fallback.0, fallback.1, true))
        }
    }
}

/// pidfd_open and openat2 are needed to deliver checkpoints safely; without them /readyz fails.
fn probe_kernel() -> Result<(), String> {
    let kernel = crate::checkpoint::probe::kernel_features();
    if let Err(e) = &kernel {
        tracing::error!(error = %e, "checkpoint delivery is impossible on this kernel");
    }
    kernel
}

/// Node operations and checkpoint discovery for the mode. In Kubernetes mode the pod cache's
/// watch starts here, before any notice: no API round trip stands before the signal.
async fn node_and_discovery(
    cfg: &Config,
    client: Option<kube::Client>,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) -> Result<NodeAndDiscovery, Error> {
    match cfg.mode {
        Mode::Host => {
            let node = Arc::new(HostNodeOps::new());
            let discovery = Arc::new(
                HostDiscovery::new(HostTargets {
                    units: cfg.args.checkpoint_unit.clone(),
                    pidfiles: cfg.args.checkpoint_pidfile.clone(),
                    cmdlines: cfg.args.checkpoint_cmdline.clone(),
                    cmdline_uids: cfg.args.checkpoint_cmdline_uid.clone(),
                    dir: cfg.args.checkpoint_dir.clone(),
                    signal: cfg.args.checkpoint_signal,
                    timeout: cfg.args.checkpoint_timeout,
                })
                .with_proc(ProcFs::new(cfg.args.proc_root.clone()))
                .with_target_mode(cfg.args.checkpoint_target),
            );
            // The notice re-reads only the candidates kept warm here.
            tasks.spawn(
                "checkpoint candidates",
                discovery.clone().keep_warm(cancel.clone()),
            );
            Ok((node, discovery, None, Arc::new(|| true), None))
        }
        Mode::Kubernetes => {
            let client = match client {
                Some(c) => c,
                None => kube_client().await?,
            };
            let node_name = cfg.node_name.clone().unwrap_or_default();
            let own_pod = match (&cfg.pod_namespace, &cfg.pod_name) {
                (Some(ns), Some(n)) => Some((ns.clone(), n.clone())),
                _ => None,
            };
            let ops = Arc::new(
                KubeNodeOps::new(
                    client.clone(),
                    node_name.clone(),
                    own_pod,
                    cfg.args.dry_run,
                    metrics.clone(),
                )
                .with_gpu_condition_types(cfg.gpu.conditions.clone())
                .with_record_ttl(cfg.args.goodput_record_ttl),
            );
            let ledger_client = client.clone();
            let job_owners = ops.job_owners();
            let discovery = Arc::new(kube_discovery::KubeDiscovery::new(
                client,
                node_name,
                ops.clone(),
                kube_discovery::Defaults {
                    signal: cfg.args.checkpoint_signal,
                    timeout: cfg.args.checkpoint_timeout,
                },
                cfg.args.proc_root.clone(),
                metrics.clone(),
            ));
            // The same watch tells the drain when an evicted pod is gone.
            ops.set_pod_watch(discovery.clone());
            tasks.spawn("pod cache", discovery.clone().keep_warm(cancel.clone()));
            // Bare pods' goodput records past their time to live: deleted hourly.
            tasks.spawn(
                "goodput record expiry",
                ops.clone().expire_records(cancel.clone()),
            );
            let cache = discovery.clone();
            let pod_location: crate::upload::service::PodLocation =
                Arc::new(move |pod| cache.upload_location(pod));
            let synced = discovery.clone();
            let pods: Arc<dyn crate::node::drain::PodWatch> = discovery.clone();
            Ok((
                ops,
                discovery,
                Some(pod_location),
                Arc::new(move || synced.synced()),
                Some((ledger_client, pods, job_owners)),
            ))
        }
    }
}

/// Node operations, checkpoint discovery, (Kubernetes) where a pod's annotation says its
/// staged checkpoints go, and whether discovery answers from its cache (the recovery task's
/// passes wait for that: never an API list of their own), and (Kubernetes) the client and pod
/// watch a recovery's ledger lookups use.
type NodeAndDiscovery = (
    Arc<dyn NodeOps>,
    Arc<dyn TargetDiscovery>,
    Option<crate::upload::service::PodLocation>,
    crate::goodput::recovery::Ready,
    Option<(
        kube::Client,
        Arc<dyn crate::node::drain::PodWatch>,
        Arc<crate::node::kube::owner::JobOwners>,
    )>,
);

/// The staged checkpoint upload service (its own runtime), and the uploads an earlier run left
/// resumed or reported in the background. `None` (staged acks then count as plain `done`) only
/// when the uploader's threads cannot start.
async fn upload_service(
    cfg: &Config,
    telemetry: &Telemetry,
    pod_location: Option<crate::upload::service::PodLocation>,
    relay_peers: Option<Arc<crate::relay::lease::PeerList>>,
    cancel: &CancellationToken,
) -> Option<Arc<crate::upload::service::Service>> {
    use crate::upload::service::{Service, Settings};
    let settings = Settings {
        policy: crate::upload::UploadPolicy {
            allow: cfg.args.upload_allow.clone(),
            // The agent's own directories (notice.json goes in the checkpoint dir).
            own_dirs: vec![cfg.args.checkpoint_dir.clone(), cfg.args.state_dir.clone()],
        },
        limits: upload_limits(cfg),
        concurrency: cfg.args.upload_concurrency,
        part_size: cfg.args.upload_part_size,
        store: crate::store::StoreOptions {
            endpoint: cfg.args.upload_endpoint.clone(),
            ..crate::store::StoreOptions::default()
        },
        state_dir: cfg.args.state_dir.clone(),
        host_location: cfg.args.checkpoint_upload.clone(),
        node: cfg.node_name.clone(),
        relay: relay_sender(cfg, &telemetry.relay, relay_peers),
    };
    let service = match Service::new(settings, telemetry.upload.clone(), pod_location) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            telemetry.metrics.error("upload", "runtime");
            error!(error = %e, "cannot start the uploader's threads: staged checkpoints are not uploaded");
            return None;
        }
    };
    if cfg.args.upload_allow.is_empty() {
        match &cfg.args.checkpoint_upload {
            Some(location) => {
                warn!(location = %location, "--checkpoint-upload is set but there is no --upload-allow: uploads are off, staged checkpoints are refused")
            }
            None => info!("no --upload-allow: staged checkpoints are refused"),
        }
    }
    let recovering = service.clone();
    let cancel = cancel.clone();
    tokio::spawn(async move {
        for handle in recovering.recover(&cancel).await {
            match handle.await {
                Ok(r) => {
                    info!(destination = %r.destination, outcome = r.outcome.as_str(), "resumed upload ended")
                }
                Err(e) => warn!(error = %e, "a resumed upload's task failed"),
            }
        }
    });
    Some(service)
}

/// Kubernetes with `--relay` and no `--relay-peers`: the peers the relay Leases advertise, read
/// in the background from now on.
fn relay_peer_list(
    cfg: &Config,
    client: Option<&kube::Client>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) -> Option<Arc<crate::relay::lease::PeerList>> {
    let (Some(client), Some(ns), Some(node)) = (client, &cfg.pod_namespace, &cfg.node_name) else {
        if cfg.mode == Mode::Kubernetes && cfg.args.relay != crate::config::RelayChoice::Off {
            warn!("--relay without POD_NAMESPACE: no relay peers (set it with the downward API)");
        }
        return None;
    };
    if cfg.args.relay == crate::config::RelayChoice::Off || !cfg.args.relay_peers.is_empty() {
        return None;
    }
    let list = Arc::new(crate::relay::lease::PeerList::new(client.clone(), ns, node));
    tasks.spawn("relay peers", list.clone().follow(cancel.clone()));
    Some(list)
}

/// `--relay`: the sender's settings (the key was checked at start): the peers configured or
/// found through their Leases, the node key or (Kubernetes) the relay token's file.
fn relay_sender(
    cfg: &Config,
    metrics: &Arc<crate::relay::metrics::RelayMetrics>,
    found: Option<Arc<crate::relay::lease::PeerList>>,
) -> Option<crate::upload::handoff::Relay> {
    use crate::config::RelayChoice;
    use crate::relay::auth::Bearer;
    use crate::relay::lease::Peers;
    use crate::upload::handoff::{Mode as RelayMode, Relay};
    let mode = match cfg.args.relay {
        RelayChoice::Off => return None,
        RelayChoice::Auto => RelayMode::Auto,
        RelayChoice::Always => RelayMode::Always,
    };
    let key = match &cfg.args.relay_key_file {
        Some(path) => Bearer::Key(crate::config::read_relay_key(path).ok()?),
        None if cfg.mode == Mode::Kubernetes => {
            Bearer::TokenFile(cfg.args.relay_token_file.clone())
        }
        None => return None,
    };
    let peers = match found {
        Some(list) => Peers::Found(list),
        None => Peers::Fixed(cfg.args.relay_peers.clone()),
    };
    Some(Relay {
        mode,
        peers,
        copies: cfg.args.relay_copies.into(),
        key,
        metrics: metrics.clone(),
    })
}

/// `--relay-listen`: the relay receiver, publishing what peers relay with the upload engine
/// under this agent's own upload settings. Kubernetes without a node key: senders present an
/// agent's relay token (TokenReview), and the agent advertises itself in its relay Lease, marked
/// under notice once a plan has signalled (`events`).
async fn spawn_relay_receiver(
    cfg: &Config,
    telemetry: &Telemetry,
    kube: Option<(kube::Client, broadcast::Receiver<PlanEvent>)>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) -> Result<(), Error> {
    use crate::relay::receive::{Receiver, Settings};
    let Some(listen) = cfg.args.relay_listen else {
        return Ok(());
    };
    let relay_err = |e: String| Error::Relay(e);
    let key = match &cfg.args.relay_key_file {
        Some(f) => Some(crate::config::read_relay_key(f).map_err(relay_err)?),
        None => None,
    };
    let kube = match (&key, kube) {
        (Some(_), _) => None,
        (None, Some(k)) => Some(k),
        (None, None) => return Err(relay_err("--relay-listen needs --relay-key-file".into())),
    };
    let state = &cfg.args.state_dir;
    let identity = crate::relay::tls::Identity::load_or_create(&crate::relay::tls::dir(state))
        .map_err(|e| relay_err(e.to_string()))?;
    let publisher = crate::upload::relayed::RelayPublisher {
        policy: crate::upload::UploadPolicy {
            allow: cfg.args.upload_allow.clone(),
            own_dirs: vec![cfg.args.checkpoint_dir.clone(), cfg.args.state_dir.clone()],
        },
        limits: upload_limits(cfg),
        store: crate::store::StoreOptions {
            endpoint: cfg.args.upload_endpoint.clone(),
            pool: cfg.args.upload_concurrency,
            ..crate::store::StoreOptions::default()
        },
        concurrency: cfg.args.upload_concurrency,
        part_size: cfg.args.upload_part_size,
        journal_dir: crate::relay::tls::dir(state),
        metrics: Some(telemetry.upload.clone()),
    };
    let staging = cfg
        .args
        .relay_staging_dir
        .clone()
        .unwrap_or_else(|| crate::relay::tls::dir(state).join("staging"));
    let mut receiver = Receiver::new(
        Settings {
            key: key.unwrap_or_default().into_bytes(),
            staging,
            per_sender: cfg.args.relay_max_bytes_per_sender,
            idle: cfg.args.relay_idle_timeout,
            limits: upload_limits(cfg),
            connections: crate::relay::receive::connection_limits(
                crate::relay::receive::MAX_CONNECTIONS,
                crate::relay::receive::MAX_CONNECTIONS_PER_SENDER,
            ),
            metrics: telemetry.relay.clone(),
        },
        Arc::new(publisher),
    )
    .map_err(|e| relay_err(e.to_string()))?;
    let mut advertise = None;
    if let Some((client, events)) = kube {
        let (Some(ns), Some(sa), Some(node)) =
            (&cfg.pod_namespace, &cfg.pod_service_account, &cfg.node_name)
        else {
            return Err(relay_err(
                "Kubernetes relay receiver: POD_NAMESPACE and POD_SERVICE_ACCOUNT (downward API) are needed to know the agents' ServiceAccount".into(),
            ));
        };
        receiver = receiver.with_tokens(crate::relay::auth::Reviewer::new(
            client.clone(),
            &cfg.args.relay_audience,
            ns,
            sa,
        ));
        advertise = Some((client, events, ns.clone(), node.clone()));
    }
    let receiver = Arc::new(receiver);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| relay_err(format!("--relay-listen {listen}: {e}")))?;
    let bound = listener.local_addr().unwrap_or(listen);
    let config = identity
        .server_config()
        .map_err(|e| relay_err(e.to_string()))?;
    receiver.recover();
    info!(
        listen = %bound,
        fingerprint = %crate::relay::tls::hex(&identity.fingerprint),
        "relay receiver listening"
    );
    if let Some((client, events, ns, node)) = advertise {
        let ip = match (cfg.pod_ip, bound.ip().is_unspecified()) {
            (Some(ip), _) => ip,
            (None, false) => bound.ip(),
            (None, true) => {
                return Err(relay_err(
                    "Kubernetes relay receiver: POD_IP (downward API) or a --relay-listen address other than 0.0.0.0 is needed to advertise it".into(),
                ))
            }
        };
        let free = {
            let receiver = receiver.clone();
            Box::new(move || receiver.unreserved())
        };
        let advertiser = Arc::new(crate::relay::lease::Advertiser::new(
            client,
            &ns,
            &node,
            SocketAddr::new(ip, bound.port()),
            identity.fingerprint,
            free,
        ));
        tasks.spawn("relay lease", advertiser.clone().run(cancel.clone()));
        tasks.spawn(
            "relay notice mark",
            mark_under_notice(advertiser, events, cancel.clone()),
        );
    }
    tasks.spawn(
        "relay receiver",
        receiver.serve(listener, config, cancel.clone()),
    );
    Ok(())
}

/// The relay Lease says this node is under notice once a plan has protected the node (tainted,
/// cordoned), signalled its trainers or drained it — a plan with no trainer to signal marks it
/// too — and no longer when a notice is undone. The Lease is written by the advertiser's own
/// task: nothing here waits for it, and the signal never waits for this.
async fn mark_under_notice(
    advertiser: Arc<crate::relay::lease::Advertiser>,
    mut events: broadcast::Receiver<PlanEvent>,
    cancel: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => return,
            e = events.recv() => e,
        };
        match event {
            Ok(
                PlanEvent::Protected { .. }
                | PlanEvent::Signalled { .. }
                | PlanEvent::Checkpointed { .. }
                | PlanEvent::Drained { .. },
            ) => advertiser.under_notice(true),
            Ok(PlanEvent::Undone { .. }) => advertiser.under_notice(false),
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => {
                cancel.cancelled().await;
                return;
            }
        }
    }
}

fn upload_limits(cfg: &Config) -> crate::upload::Limits {
    crate::upload::Limits {
        max_files: cfg.args.upload_max_files as usize,
        max_bytes: cfg.args.upload_max_bytes,
        ..crate::upload::Limits::default()
    }
}

/// The in-cluster (or KUBECONFIG) client. kube's default client retries 429s for minutes: the
/// drain must see PDB refusals, so it is built without that retry.
async fn kube_client() -> Result<kube::Client, Error> {
    let config = kube::Config::infer()
        .await
        .map_err(|e| Error::KubeClient(e.to_string()))?;
    crate::node::kube::client_from_config(config).map_err(|e| Error::KubeClient(e.to_string()))
}

/// What the notice monitors give the rest of the agent.
struct NoticeInputs {
    /// The configured cloud's source (empty while auto-detecting): the responder acknowledges
    /// through it.
    sources: Vec<Arc<dyn NoticeSource>>,
    /// Every visible notice, from whichever monitor runs.
    notices: mpsc::Receiver<notice::Notice>,
    /// Recent poll success, read by /readyz.
    health: Arc<PollHealth>,
}

/// The monitor of the configured cloud, or auto-detection followed by its monitor in the
/// background.
fn spawn_notice_sources(
    cfg: &Config,
    telemetry: &Telemetry,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) -> Result<NoticeInputs, Error> {
    let health = Arc::new(PollHealth::new());
    let (tx, notices) = mpsc::channel(64);
    let source = cfg
        .args
        .cloud
        .source()
        .map(|cloud| build_source(cfg, cloud, &telemetry.metrics, &telemetry.sources))
        .transpose()?;
    match &source {
        Some(s) => tasks.spawn(
            "notice monitor",
            run_monitor(
                s.clone(),
                tx,
                telemetry.metrics.clone(),
                health.clone(),
                cancel.child_token(),
            ),
        ),
        None => tasks.spawn(
            "cloud detection and notice monitor",
            detect_and_monitor(
                cfg.clone(),
                tx,
                telemetry.metrics.clone(),
                health.clone(),
                telemetry.sources.clone(),
                cancel.child_token(),
            ),
        ),
    }
    Ok(NoticeInputs {
        sources: source.into_iter().collect(),
        notices,
        health,
    })
}

/// Auto-detect the cloud, retrying until it answers (never fatal: everything else keeps
/// serving), then watch it.
async fn detect_and_monitor(
    cfg: Config,
    tx: mpsc::Sender<notice::Notice>,
    metrics: Arc<Metrics>,
    health: Arc<PollHealth>,
    own_metrics: notice::SourceMetrics,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(Duration::from_secs(2), Duration::from_secs(60));
    let source = loop {
        let probe = match &cfg.args.metadata_endpoint {
            Some(u) => notice::detect::ProbeEndpoints::all(u.clone()),
            None => notice::detect::ProbeEndpoints::default(),
        };
        let detected = notice::detect::detect_counted(
            &cfg.args.dmi_dir,
            &probe,
            Duration::from_secs(2),
            Some(&metrics),
        )
        .await;
        match detected {
            Ok(s) => break s,
            Err(e) => {
                metrics.error("detect", e.metric_label());
                let delay = backoff.next_delay();
                warn!(error = %e, retry_in_ms = delay.as_millis() as u64, "cloud auto-detection failed; set --cloud to skip it");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    };
    info!(cloud = source.as_str(), "cloud detected");
    // Judged at start against the cloud that forgives them most; now against this one. Said and
    // counted, never fatal: the agent keeps watching as well as its settings allow.
    if let Err(e) = cfg.check_timings_on(source) {
        metrics.error("detect", e.metric_label());
        error!(cloud = source.as_str(), error = %e, "the settings cannot keep the agent's promise on the detected cloud: set --cloud and fix them");
    }
    match build_source(&cfg, source, &metrics, &own_metrics) {
        Ok(s) => run_monitor(s, tx, metrics, health, cancel).await,
        Err(e) => error!(error = %e, "cannot watch the detected cloud"),
    }
}

/// The notice and outcome webhook, when one is configured.
fn build_webhook(cfg: &Config, metrics: &Arc<Metrics>) -> Result<Option<webhook::Webhook>, Error> {
    let Some(url) = &cfg.args.webhook_url else {
        return Ok(None);
    };
    webhook::Webhook::with_options(
        url.clone(),
        webhook::Options {
            preset: cfg.args.webhook_preset,
            template: cfg.args.webhook_template.clone(),
            outcome_template: cfg.args.webhook_outcome_template.clone(),
            headers: cfg
                .args
                .webhook_header
                .iter()
                .map(|h| (h.0.clone(), h.1.clone()))
                .collect(),
            dry_run: cfg.args.dry_run,
            on_dry_run: cfg.args.webhook_dry_run,
            routing_key: cfg.args.webhook_routing_key.clone(),
            policy: webhook::RetryPolicy::default(),
        },
        metrics.clone(),
    )
    .map(Some)
    .map_err(|e| Error::Webhook(e.to_string()))
}

/// How this machine is named in webhooks and Events, and what the agent does about a notice.
#[derive(Clone)]
struct Who {
    node_name: String,
    instance: String,
    action: &'static str,
    /// Host mode: the machine is a host, not a Kubernetes node.
    host: bool,
}

impl Who {
    fn of(cfg: &Config) -> Self {
        Who {
            node_name: cfg.node_name.clone().unwrap_or_else(hostname),
            instance: hostname(),
            action: match cfg.mode {
                Mode::Kubernetes => "checkpoint, cordon and drain",
                Mode::Host => "checkpoint",
            },
            host: cfg.mode == Mode::Host,
        }
    }
}

/// Hooks run when handling starts, beside the signal: stop the prefetcher (its own process or
/// container; asked through a file in the cache, written off this thread), send the webhook.
fn start_hooks(cfg: &Config, hook: Option<webhook::Webhook>, who: &Who) -> Vec<StartHook> {
    let mut on_start: Vec<StartHook> = Vec::new();
    let dir = cfg.args.cache_dir.clone();
    on_start.push(Box::new(move |n| {
        if n.kind == notice::NoticeKind::Interruption {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || {
                if let Err(e) = prefetch::serve::request_stop(&dir) {
                    warn!(error = %e, "could not ask the prefetcher to stop");
                }
            });
        }
    }));
    if let Some(hook) = hook {
        let who = who.clone();
        on_start.push(Box::new(move |n| {
            let _ = hook.notify(&webhook::NotifyFields {
                host: who.host,
                ..webhook::NotifyFields::from_notice(n, &who.node_name, &who.instance, who.action)
            });
        }));
    }
    on_start
}

fn responder_config(cfg: &Config) -> ResponderConfig {
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
        resume_hold: crate::responder::resume_hold(cfg.args.poll_interval),
        node_name: Some(cfg.node_name.clone().unwrap_or_else(hostname)),
    }
}

/// The outcome of every plan: headroom metrics, a Node Event, the outcome webhook.
fn spawn_outcome_follower(
    responder: &Responder,
    node: &Arc<dyn NodeOps>,
    (webhook, goodput_log): (Option<webhook::Webhook>, Option<std::path::PathBuf>),
    who: Who,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) {
    tasks.spawn(
        "plan outcome follower",
        crate::outcome::follow(
            responder.subscribe(),
            crate::outcome::Sinks {
                metrics: metrics.clone(),
                node: Some(node.clone()),
                webhook,
                node_name: who.node_name,
                instance: who.instance,
                action: who.action.to_string(),
                host: who.host,
                goodput_log,
            },
            cancel.child_token(),
        ),
    );
}

/// GPU health: NVML is loaded (and retried) by the probe itself; `off` starts nothing.
fn spawn_gpu_monitor(
    cfg: &Config,
    node: &Arc<dyn NodeOps>,
    gpu_metrics: Arc<gpu::GpuMetrics>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) {
    match gpu::probe_from_config(cfg.gpu.mode) {
        Ok(probe) => tasks.spawn(
            "GPU monitor",
            gpu::run_monitor(
                probe,
                node.clone(),
                gpu_metrics,
                cfg.gpu.clone(),
                cancel.child_token(),
            ),
        ),
        Err(e) => info!(reason = %e, "GPU monitoring off"),
    }
}

/// Prefetch never runs in this process: datasets from the config go to a child
/// `spotguard prefetch-serve` (own threads and heap); in Kubernetes the DaemonSet's prefetch
/// container reads pods' annotations. A stop request left by a previous life is cleared first.
async fn spawn_prefetcher(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) {
    let dir = cfg.args.cache_dir.clone();
    let _ = tokio::task::spawn_blocking(move || prefetch::serve::clear_stop(&dir)).await;
    if cfg.datasets.is_empty() {
        return;
    }
    let child = prefetch::serve::run_child(
        cfg.datasets
            .iter()
            .map(|d| format!("{}={}", d.name, d.url))
            .collect(),
        cfg.args.cache_dir.clone(),
        cfg.args.cache_max_bytes,
        cfg.args.prefetch_endpoint.clone(),
        metrics.clone(),
        cancel.child_token(),
    );
    // The prefetcher finishing (or failing to start) is no reason to stop the agent: the task
    // then waits for shutdown like every other.
    let c = cancel.child_token();
    tasks.spawn("prefetcher process", async move {
        child.await;
        c.cancelled().await;
    });
}

/// /metrics, /healthz and /readyz; returns the bound address.
async fn spawn_admin_server(
    cfg: &Config,
    registry: Arc<Registry>,
    health: Arc<PollHealth>,
    kernel: Result<(), String>,
    tasks: &mut Tasks,
    cancel: &CancellationToken,
) -> Result<SocketAddr, Error> {
    let (addr, serve) = admin::bind(
        cfg.args.metrics_addr,
        registry,
        Arc::new(PollReadiness(health, kernel)),
        cancel.child_token(),
    )
    .await
    .map_err(|source| Error::BindAdmin {
        addr: cfg.args.metrics_addr,
        source,
    })?;
    tasks.spawn("admin server", serve);
    Ok(addr)
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

/// The notice source of `cloud`, from `run`'s settings.
fn build_source(
    cfg: &Config,
    cloud: Cloud,
    metrics: &Arc<Metrics>,
    own_metrics: &notice::SourceMetrics,
) -> Result<Arc<dyn NoticeSource>, Error> {
    let settings = notice::Settings {
        endpoint: cfg.args.metadata_endpoint.clone(),
        poll_interval: cfg.args.poll_interval,
        imds_v1_fallback: cfg.args.imds_v1_fallback,
        gce_preemption_notice: cfg.args.gce_preemption_notice,
        azure_vm_name: cfg.args.azure_vm_name.clone(),
    };
    cloud
        .source(&settings, metrics, own_metrics)
        .map_err(|e| Error::Source(e.to_string()))
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
