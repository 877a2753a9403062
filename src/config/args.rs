//! `spotguard run`'s arguments: every flag, its environment variable, default and help heading.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args, ValueEnum};
use regex::Regex;

use super::parse::*;
use super::{Dataset, GpuMode, Setting};
use crate::checkpoint::{Signal, TargetMode};
use crate::notice::Cloud;

/// `--relay`: when a staged checkpoint is also streamed to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RelayChoice {
    Off,
    /// When the upload cannot finish before its deadline at the throughput it gets.
    Auto,
    Always,
}

/// Mode of operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeChoice {
    /// Kubernetes when in-cluster config or `KUBECONFIG` is present, else host.
    Auto,
    Kubernetes,
    Host,
}

/// Which cloud's metadata service to watch: `auto` ([`CloudChoice::AUTO`]) or one [`Cloud`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CloudChoice(pub Option<Cloud>);

impl CloudChoice {
    /// DMI (`/sys/class/dmi/id/*`), then probing the metadata endpoints.
    pub const AUTO: CloudChoice = CloudChoice(None);

    /// The chosen cloud; `None` for `auto`.
    pub fn source(self) -> Option<Cloud> {
        self.0
    }
}

impl ValueEnum for CloudChoice {
    fn value_variants<'a>() -> &'a [Self] {
        static VARIANTS: std::sync::OnceLock<Vec<CloudChoice>> = std::sync::OnceLock::new();
        VARIANTS.get_or_init(|| {
            std::iter::once(CloudChoice::AUTO)
                .chain(Cloud::ALL.map(|c| CloudChoice(Some(c))))
                .collect()
        })
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        match self.0 {
            None => Some(
                clap::builder::PossibleValue::new("auto")
                    .help("DMI (`/sys/class/dmi/id/*`), then probing the metadata endpoints"),
            ),
            Some(cloud) => cloud.to_possible_value(),
        }
    }
}

/// What to do on an EC2 rebalance recommendation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RebalanceAction {
    Ignore,
    Cordon,
    Checkpoint,
    Drain,
}

/// What to do on scheduled maintenance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MaintenanceAction {
    Ignore,
    Cordon,
    Drain,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

/// Help headings of `run`'s flags (flags without one are under "Options").
const NOTICES: &str = "Notices";
const CHECKPOINT: &str = "Checkpoint";
const DRAIN: &str = "Drain";
const OBSERVABILITY: &str = "Observability";
const PREFETCH: &str = "Prefetch";
const HOST_MODE: &str = "Host mode";
const UPLOAD: &str = "Staged checkpoint upload";
const RELAY: &str = "Relay (a staged checkpoint handed to a peer)";

/// `spotguard run` flags. Every flag also reads `SPOTGUARD_<FLAG_IN_CAPS>`.
#[derive(Debug, Clone, Args)]
#[command(args_override_self = true)]
pub struct RunArgs {
    /// TOML file with the same keys as these flags plus `[[datasets]]` and `[gpu.thresholds]`.
    #[arg(long, env = "SPOTGUARD_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// `auto`: kubernetes when in-cluster config or KUBECONFIG is present, else host.
    #[arg(long, env = "SPOTGUARD_MODE", value_enum, default_value = "auto")]
    pub mode: ModeChoice,

    /// Cloud to watch; auto = DMI then probing.
    #[arg(long, env = "SPOTGUARD_CLOUD", value_enum, default_value = "auto", help_heading = NOTICES)]
    pub cloud: CloudChoice,

    /// Metadata service base URL override, e.g. http://127.0.0.1:1338 or http://[fd00:ec2::254].
    #[arg(long, env = "SPOTGUARD_METADATA_ENDPOINT", value_name = "URL", value_parser = parse_endpoint, help_heading = NOTICES)]
    pub metadata_endpoint: Option<reqwest::Url>,

    /// EC2 and Azure polling cadence (GCE uses hanging GETs); more than 0, at most 1m.
    #[arg(long, env = "SPOTGUARD_POLL_INTERVAL", value_name = "DURATION", default_value = "1s", value_parser = parse_poll_interval, help_heading = NOTICES)]
    pub poll_interval: Duration,

    /// Kubernetes node to act on (default: env NODE_NAME).
    #[arg(long, env = "SPOTGUARD_NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    /// Action on an EC2 rebalance recommendation.
    #[arg(
        long,
        env = "SPOTGUARD_ON_REBALANCE",
        value_enum,
        default_value = "checkpoint",
        help_heading = NOTICES,
    )]
    pub on_rebalance: RebalanceAction,

    /// Undo a rebalance cordon/taint if no interruption follows within this time; more than 0, at most 7d.
    #[arg(long, env = "SPOTGUARD_REBALANCE_EXPIRY", value_name = "DURATION", default_value = "30m", value_parser = parse_rebalance_expiry, help_heading = NOTICES)]
    pub rebalance_expiry: Duration,

    /// Action on scheduled maintenance / GCE TERMINATE_ON_HOST_MAINTENANCE.
    #[arg(
        long,
        env = "SPOTGUARD_ON_MAINTENANCE",
        value_enum,
        default_value = "drain",
        help_heading = NOTICES,
    )]
    pub on_maintenance: MaintenanceAction,

    /// Action on an Azure `Freeze` event (the VM is paused for a few seconds, not restarted or moved).
    #[arg(
        long,
        env = "SPOTGUARD_ON_AZURE_FREEZE",
        value_enum,
        default_value = "ignore",
        help_heading = NOTICES
    )]
    pub on_azure_freeze: MaintenanceAction,

    /// Start handling a scheduled event this long before its NotBefore; at most 30d.
    #[arg(long, env = "SPOTGUARD_MAINTENANCE_LEAD", value_name = "DURATION", default_value = "10m", value_parser = parse_maintenance_lead, help_heading = NOTICES)]
    pub maintenance_lead: Duration,

    /// Signal sent to checkpoint targets.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_SIGNAL", value_name = "SIGNAL", default_value = "SIGUSR1", value_parser = parse_signal, help_heading = CHECKPOINT)]
    pub checkpoint_signal: Signal,

    /// Upper bound on waiting for checkpoint acks; more than 0, at most 1h.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_TIMEOUT", value_name = "DURATION", default_value = "90s", value_parser = parse_nonzero_hour, help_heading = CHECKPOINT)]
    pub checkpoint_timeout: Duration,

    /// Time kept before the deadline for evictions, at most 1h and below the cloud's notice [default: 25s on aws, 8s on gce and azure].
    #[arg(long, env = "SPOTGUARD_DRAIN_RESERVE", value_name = "DURATION", value_parser = parse_hour, help_heading = DRAIN)]
    pub drain_reserve: Option<Duration>,

    /// Delete pods still blocked by a PDB 5 s before the deadline (opt-in; needs pods delete RBAC).
    #[arg(long, env = "SPOTGUARD_FORCE_DELETE_AT_DEADLINE", action = ArgAction::SetTrue, value_parser = parse_bool, help_heading = DRAIN)]
    pub force_delete_at_deadline: bool,

    /// How long the goodput record of a pod without a controller is kept (Kubernetes; a job's
    /// records go with the job); at least 1h, at most 366d.
    #[arg(long, env = "SPOTGUARD_GOODPUT_RECORD_TTL", value_name = "DURATION", default_value = "7d", value_parser = parse_record_ttl, help_heading = OBSERVABILITY)]
    pub goodput_record_ttl: Duration,

    /// Log every action it would take; mutate nothing, signal nothing.
    #[arg(long, env = "SPOTGUARD_DRY_RUN", action = ArgAction::SetTrue, value_parser = parse_bool)]
    pub dry_run: bool,

    /// Address of /metrics, /healthz, /readyz.
    #[arg(
        long,
        env = "SPOTGUARD_METRICS_ADDR",
        value_name = "ADDR",
        default_value = "0.0.0.0:9464",
        help_heading = OBSERVABILITY,
    )]
    pub metrics_addr: SocketAddr,

    /// GPU health monitoring: auto = NVML if it loads.
    #[arg(long, env = "SPOTGUARD_GPU", value_enum, default_value = "auto", help_heading = OBSERVABILITY)]
    pub gpu: GpuMode,

    /// Node condition type set True while the node's GPUs are unhealthy (see docs/gpu-health.md).
    #[arg(
        long,
        env = "SPOTGUARD_GPU_UNHEALTHY_CONDITION",
        value_name = "TYPE",
        default_value = crate::gpu::DEFAULT_UNHEALTHY_CONDITION,
        help_heading = OBSERVABILITY
    )]
    pub gpu_unhealthy_condition: String,

    /// Node condition type set True while the node's GPUs are degraded.
    #[arg(
        long,
        env = "SPOTGUARD_GPU_DEGRADED_CONDITION",
        value_name = "TYPE",
        default_value = crate::gpu::DEFAULT_DEGRADED_CONDITION,
        help_heading = OBSERVABILITY
    )]
    pub gpu_degraded_condition: String,

    /// Also set this Ready-polarity condition False while the GPUs are unhealthy (and True again
    /// on recovery), e.g. `AcceleratedHardwareReady` for EKS node auto-repair.
    #[arg(long, env = "SPOTGUARD_GPU_READY_CONDITION", value_name = "TYPE", help_heading = OBSERVABILITY)]
    pub gpu_ready_condition: Option<String>,

    /// Kubelet pod-resources socket: GPU metrics get pod / namespace / container labels of the
    /// container holding the GPU (empty = off; a socket that is not there is retried each sample).
    #[arg(
        long,
        env = "SPOTGUARD_GPU_POD_RESOURCES_SOCKET",
        value_name = "PATH",
        default_value = crate::gpu::podresources::DEFAULT_SOCKET,
        help_heading = OBSERVABILITY
    )]
    pub gpu_pod_resources_socket: String,

    /// Log format [default: json in-cluster, text on a TTY, else json].
    #[arg(long, env = "SPOTGUARD_LOG_FORMAT", value_enum, help_heading = OBSERVABILITY)]
    pub log_format: Option<LogFormat>,

    /// Log level of spotguard (dependencies stay at warn), or EnvFilter directives, e.g. `debug,kube=info`.
    #[arg(
        long,
        env = "SPOTGUARD_LOG_LEVEL",
        value_name = "FILTER",
        default_value = "info",
        help_heading = OBSERVABILITY,
    )]
    pub log_level: String,

    /// Host mode target: a systemd unit whose own cgroup's processes are checkpointed (repeatable).
    #[arg(
        long,
        env = "SPOTGUARD_CHECKPOINT_UNIT",
        value_name = "NAME",
        value_delimiter = ',',
        help_heading = HOST_MODE,
    )]
    pub checkpoint_unit: Vec<String>,

    /// Host mode target: a pidfile (a regular file owned by root or by the process's user, never
    /// naming PID 1); that process and its descendants running as the same user (repeatable).
    #[arg(
        long,
        env = "SPOTGUARD_CHECKPOINT_PIDFILE",
        value_name = "PATH",
        value_delimiter = ',',
        value_parser = parse_abs_path,
        help_heading = HOST_MODE,
    )]
    pub checkpoint_pidfile: Vec<PathBuf>,

    /// Host mode target: processes whose command line matches (repeatable; a pattern that matches every command line, such as '' or '.*', is refused; write a comma in a pattern as \x2C). Any local user can start a matching process: add --checkpoint-cmdline-uid.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_CMDLINE", value_name = "REGEX", value_delimiter = ',', value_parser = parse_cmdline_regex, help_heading = HOST_MODE)]
    pub checkpoint_cmdline: Vec<Regex>,

    /// Host mode: --checkpoint-cmdline selects only processes running as these uids (repeatable), e.g. the trainers' user.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_CMDLINE_UID", value_name = "UID", value_delimiter = ',', help_heading = HOST_MODE)]
    pub checkpoint_cmdline_uid: Vec<u32>,

    /// Host mode: where notice.json is written and acks are read.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_DIR", value_name = "DIR", default_value = "/run/spotguard", value_parser = parse_abs_path, help_heading = HOST_MODE)]
    pub checkpoint_dir: PathBuf,

    /// Host mode: which selected processes get the signal: `handlers` (those that catch it, but
    /// never a shell catching every terminating signal for an EXIT trap, nor a launcher) or
    /// `caught` (every one that catches it, shells and launchers included).
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_TARGET", value_name = "MODE", default_value = "handlers", value_parser = parse_host_target, help_heading = HOST_MODE)]
    pub checkpoint_target: TargetMode,

    /// Host mode: persisted state (notice id, phase).
    #[arg(long, env = "SPOTGUARD_STATE_DIR", value_name = "DIR", default_value = "/var/lib/spotguard", value_parser = parse_abs_path, help_heading = HOST_MODE)]
    pub state_dir: PathBuf,

    /// EC2: allow IMDSv1 when the IMDSv2 token PUT fails.
    #[arg(long, env = "SPOTGUARD_IMDS_V1_FALLBACK", action = ArgAction::SetTrue, value_parser = parse_bool, help_heading = NOTICES)]
    pub imds_v1_fallback: bool,

    /// GCE: time from preempted=TRUE to power-off (120s with extended preemption notice); more than 0, at most 1h.
    #[arg(long, env = "SPOTGUARD_GCE_PREEMPTION_NOTICE", value_name = "DURATION", default_value = "30s", value_parser = parse_nonzero_hour, help_heading = NOTICES)]
    pub gce_preemption_notice: Duration,

    /// Azure: this VM's name for filtering scheduled events [default: IMDS compute/name].
    #[arg(long, env = "SPOTGUARD_AZURE_VM_NAME", value_name = "NAME", help_heading = NOTICES)]
    pub azure_vm_name: Option<String>,

    /// Notification URL called when handling starts (Slack-compatible JSON by default).
    #[arg(long, env = "SPOTGUARD_WEBHOOK_URL", value_name = "URL", value_parser = parse_url, help_heading = OBSERVABILITY)]
    pub webhook_url: Option<String>,

    /// Template of the webhook body; placeholders like {{node}}, {{kind}}, {{deadline}}.
    #[arg(long, env = "SPOTGUARD_WEBHOOK_TEMPLATE", value_name = "TEMPLATE", help_heading = OBSERVABILITY)]
    pub webhook_template: Option<String>,

    /// Template of the webhook sent when a plan ends; placeholders like {{outcome}}, {{summary}}, {{step}}.
    #[arg(
        long,
        env = "SPOTGUARD_WEBHOOK_OUTCOME_TEMPLATE",
        value_name = "TEMPLATE",
        help_heading = OBSERVABILITY,
    )]
    pub webhook_outcome_template: Option<String>,

    /// Ready-made webhook bodies (replaced by --webhook-template / --webhook-outcome-template).
    #[arg(
        long,
        env = "SPOTGUARD_WEBHOOK_PRESET",
        value_enum,
        default_value = "slack",
        help_heading = OBSERVABILITY,
    )]
    pub webhook_preset: crate::webhook::Preset,

    /// Extra webhook request header, "Name: value" (repeatable), e.g. an Authorization token.
    #[arg(long, env = "SPOTGUARD_WEBHOOK_HEADER", value_name = "HEADER", value_parser = parse_webhook_header, help_heading = OBSERVABILITY)]
    pub webhook_header: Vec<WebhookHeader>,

    /// In --dry-run: send webhooks marked ({{dry_run}}, X-Spotguard-Dry-Run) or suppress them.
    #[arg(
        long,
        env = "SPOTGUARD_WEBHOOK_DRY_RUN",
        value_enum,
        default_value = "mark",
        help_heading = OBSERVABILITY,
    )]
    pub webhook_dry_run: crate::webhook::DryRunWebhook,

    /// PagerDuty Events v2 integration key ({{routing_key}}; needed by --webhook-preset pagerduty).
    #[arg(
        long,
        env = "SPOTGUARD_WEBHOOK_ROUTING_KEY",
        value_name = "KEY",
        hide_env_values = true,
        help_heading = OBSERVABILITY,
    )]
    pub webhook_routing_key: Option<String>,

    /// Dataset to warm at start, NAME=URL or a bare URL (repeatable), by a child `spotguard prefetch-serve` process.
    #[arg(long, env = "SPOTGUARD_PREFETCH", value_name = "NAME=URL", value_delimiter = ',', value_parser = parse_dataset, help_heading = PREFETCH)]
    pub prefetch: Vec<Dataset>,

    /// Shared dataset cache root.
    #[arg(long, env = "SPOTGUARD_CACHE_DIR", value_name = "DIR", default_value = "/var/cache/spotguard", value_parser = parse_abs_path, help_heading = PREFETCH)]
    pub cache_dir: PathBuf,

    /// Evict least-recently-used datasets above this size (e.g. 500GiB) [default: half the cache's filesystem].
    #[arg(long, env = "SPOTGUARD_CACHE_MAX_BYTES", value_name = "BYTES", value_parser = parse_bytes, help_heading = PREFETCH)]
    pub cache_max_bytes: Option<u64>,

    /// S3-compatible endpoint for prefetch sources (e.g. http://127.0.0.1:9000).
    #[arg(long, env = "SPOTGUARD_PREFETCH_ENDPOINT", value_name = "URL", value_parser = parse_url, help_heading = PREFETCH)]
    pub prefetch_endpoint: Option<String>,

    /// Where staged checkpoints may be uploaded, with the agent's own identity (repeatable):
    /// s3://BUCKET[/PREFIX], gs://BUCKET[/PREFIX] or an absolute directory; `{namespace}` as a
    /// whole path segment is the uploading pod's namespace (s3://ckpt/{namespace}: each pod only
    /// its own namespace's prefix). None: staged checkpoints are refused.
    #[arg(long, env = "SPOTGUARD_UPLOAD_ALLOW", value_name = "PATTERN", value_delimiter = ',', value_parser = crate::upload::AllowUpload::parse, help_heading = UPLOAD)]
    pub upload_allow: Vec<crate::upload::AllowUpload>,

    /// Host mode: the location bound to this host's trainers (s3://, gs://, file:// or a directory; each checkpoint in LOCATION/<name>, or below LOCATION where the ack's `upload` says); it must lie under --upload-allow (checked at start). None: staged checkpoints are refused.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_UPLOAD", value_name = "LOCATION", value_parser = parse_upload_location, help_heading = UPLOAD)]
    pub checkpoint_upload: Option<String>,

    /// Refuse a staged checkpoint of more files than this (each is held open until uploaded).
    #[arg(long, env = "SPOTGUARD_UPLOAD_MAX_FILES", value_name = "N", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000), help_heading = UPLOAD)]
    pub upload_max_files: u32,

    /// Refuse a staged checkpoint of more bytes than this.
    #[arg(long, env = "SPOTGUARD_UPLOAD_MAX_BYTES", value_name = "BYTES", default_value = "1TiB", value_parser = parse_bytes, help_heading = UPLOAD)]
    pub upload_max_bytes: u64,

    /// Requests in flight per upload; each holds one part-sized buffer (memory: concurrency × part size for all uploads together, each at least one buffer).
    #[arg(long, env = "SPOTGUARD_UPLOAD_CONCURRENCY", value_name = "N", default_value = "8", value_parser = crate::upload::cli::parse_concurrency, help_heading = UPLOAD)]
    pub upload_concurrency: usize,

    /// Files up to this size are one PUT; larger ones go as multipart uploads of this part size.
    #[arg(long, env = "SPOTGUARD_UPLOAD_PART_SIZE", value_name = "BYTES", default_value = "8MiB", value_parser = crate::upload::cli::parse_part_size, help_heading = UPLOAD)]
    pub upload_part_size: u64,

    /// S3-compatible endpoint for uploads (path-style; http:// allowed), e.g. http://127.0.0.1:9000.
    #[arg(long, env = "SPOTGUARD_UPLOAD_ENDPOINT", value_name = "URL", value_parser = parse_url, help_heading = UPLOAD)]
    pub upload_endpoint: Option<String>,

    /// Also stream a staged checkpoint to a peer agent, which verifies and publishes it (docs/relay.md): off; auto (when the upload, at the throughput it gets, cannot finish before its deadline); always. Host mode: needs --relay-peers and --relay-key-file; Kubernetes: peers are the agents advertised in Leases.
    #[arg(long, env = "SPOTGUARD_RELAY", value_name = "WHEN", default_value = "off", value_enum, help_heading = RELAY)]
    pub relay: RelayChoice,

    /// Host mode: the peers a staged checkpoint is relayed to, tried in order (repeatable): HOST:PORT#SHA256, the SHA-256 being what `spotguard relay fingerprint` prints on the peer.
    #[arg(long, env = "SPOTGUARD_RELAY_PEERS", value_name = "PEER", value_delimiter = ',', value_parser = crate::relay::send::Peer::parse, help_heading = RELAY)]
    pub relay_peers: Vec<crate::relay::send::Peer>,

    /// How many peers a staged checkpoint is streamed to at once (1 to 8; at most the peers there are): the first to publish it wins and the others are stopped; each copy whose peer fails goes on to the next peer not yet tried.
    #[arg(long, env = "SPOTGUARD_RELAY_COPIES", value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8), help_heading = RELAY)]
    pub relay_copies: u8,

    /// A file holding the node key every relay request carries and every receiver requires (at least 16 bytes; surrounding whitespace ignored; read at start).
    #[arg(long, env = "SPOTGUARD_RELAY_KEY_FILE", value_name = "PATH", value_parser = parse_abs_path, help_heading = RELAY)]
    pub relay_key_file: Option<PathBuf>,

    /// Kubernetes without --relay-key-file: the projected ServiceAccount token (audience --relay-audience) every relay request carries, read again on each use (the kubelet rotates it).
    #[arg(long, env = "SPOTGUARD_RELAY_TOKEN_FILE", value_name = "PATH", default_value = crate::relay::auth::TOKEN_FILE, value_parser = parse_abs_path, help_heading = RELAY)]
    pub relay_token_file: PathBuf,

    /// Kubernetes without --relay-key-file: the audience of the relay token; a receiver accepts a token only for it (TokenReview), of its own ServiceAccount and bound to a pod on a node.
    #[arg(long, env = "SPOTGUARD_RELAY_AUDIENCE", value_name = "AUDIENCE", default_value = crate::relay::auth::AUDIENCE, help_heading = RELAY)]
    pub relay_audience: String,

    /// Receive relays from peers on this address (e.g. 0.0.0.0:7443), TLS with this node's certificate kept in <state-dir>/relay; none: this node receives none. Host mode: needs --relay-key-file; Kubernetes: senders present the relay token instead, and the agent advertises itself in a Lease (docs/relay.md).
    #[arg(long, env = "SPOTGUARD_RELAY_LISTEN", value_name = "ADDR", help_heading = RELAY)]
    pub relay_listen: Option<std::net::SocketAddr>,

    /// Where received relays are staged (size it for the checkpoints peers may send at once) [default: <state-dir>/relay/staging].
    #[arg(long, env = "SPOTGUARD_RELAY_STAGING_DIR", value_name = "DIR", value_parser = parse_abs_path, help_heading = RELAY)]
    pub relay_staging_dir: Option<PathBuf>,

    /// Bytes one sender (address) may have reserved on this node at once.
    #[arg(long, env = "SPOTGUARD_RELAY_MAX_BYTES_PER_SENDER", value_name = "BYTES", default_value = "1TiB", value_parser = parse_bytes, help_heading = RELAY)]
    pub relay_max_bytes_per_sender: u64,

    /// A relay whose sender sends nothing for this long is given up (its files removed, nothing published); more than 0, at most 10m.
    #[arg(long, env = "SPOTGUARD_RELAY_IDLE_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = parse_relay_idle, help_heading = RELAY)]
    pub relay_idle_timeout: Duration,

    /// Maximum evictions in flight during a drain.
    #[arg(long, env = "SPOTGUARD_DRAIN_CONCURRENCY", value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024), help_heading = DRAIN)]
    pub drain_concurrency: u16,

    /// On SIGTERM, time an in-flight plan gets to finish (still bounded by its deadline); at most 1h.
    #[arg(long, env = "SPOTGUARD_SHUTDOWN_GRACE", value_name = "DURATION", default_value = "120s", value_parser = parse_hour)]
    pub shutdown_grace: Duration,

    /// Directory of DMI identifiers used by cloud auto-detection.
    #[arg(
        long,
        env = "SPOTGUARD_DMI_DIR",
        value_name = "DIR",
        default_value = "/sys/class/dmi/id",
        hide = true
    )]
    pub dmi_dir: PathBuf,

    /// Root of the proc filesystem (process discovery).
    #[arg(
        long,
        env = "SPOTGUARD_PROC_ROOT",
        value_name = "DIR",
        default_value = "/proc",
        hide = true
    )]
    pub proc_root: PathBuf,

    /// File holding this machine's boot id: persisted plan state from another boot belongs to a
    /// previous life of the machine (stop/start, hibernation, reboot).
    #[arg(
        long,
        env = "SPOTGUARD_BOOT_ID_FILE",
        value_name = "FILE",
        default_value = "/proc/sys/kernel/random/boot_id",
        hide = true
    )]
    pub boot_id_file: PathBuf,

    /// Where each setting came from (filled when the arguments are parsed).
    #[arg(skip)]
    pub settings: Vec<Setting>,
}

/// A validated `--webhook-header`.
#[derive(Clone, Debug)]
pub struct WebhookHeader(pub http::HeaderName, pub http::HeaderValue);

/// `run`'s arguments as a command of their own (`spotguard run`), for parsing them without the
/// rest of the command table.
pub(crate) fn run_command() -> clap::Command {
    empty_env_is_unset(RunArgs::augment_args(
        clap::Command::new("run").bin_name("spotguard run"),
    ))
}

/// A `SPOTGUARD_*` variable set to the empty string counts as unset: the env file's example
/// `#SPOTGUARD_METADATA_ENDPOINT=`, uncommented as shown, means "the default", where clap would
/// parse "" as the value (and refuse it, or take an empty name). Applied to `cmd` and every
/// subcommand.
pub fn empty_env_is_unset(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let empty = a
            .get_env()
            .is_some_and(|name| std::env::var_os(name).is_some_and(|v| v.is_empty()));
        if empty {
            a.env(None::<&'static str>)
        } else {
            a
        }
    })
    .mut_subcommands(empty_env_is_unset)
}
