//! Configuration: the `run` flags (each also read from `SPOTGUARD_<FLAG>`), an optional TOML file
//! with the same keys plus structured parts, and validation. Precedence: flag > env > file >
//! default. Everything is parsed and validated before anything starts; a bad value is reported
//! with the key that holds it and the process exits 64 (`EX_USAGE`).

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args, FromArgMatches, ValueEnum};
use regex::Regex;
use serde::Deserialize;

use crate::checkpoint::Signal;
pub use crate::gpu::GpuMode;
use crate::notice::Source;

/// Exit code for a usage or configuration error (`EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;

// The command table moved to `crate::cli`; these keep `spotguard::config::{parse_cli, Parsed,
// Command}` working for the integration tests and benches that build `run` arguments with them.
#[doc(hidden)]
pub use crate::cli::{parse_cli, Command, Parsed};

/// Where a setting came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag,
    Env,
    File,
    Default,
}

impl Origin {
    /// The origin of a value clap took from `source`; `from_file`: the config file's value was
    /// passed as a command-line argument.
    pub fn of(source: ValueSource, from_file: bool) -> Origin {
        match source {
            ValueSource::CommandLine if from_file => Origin::File,
            ValueSource::CommandLine => Origin::Flag,
            ValueSource::EnvVariable => Origin::Env,
            _ => Origin::Default,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Flag => "flag",
            Origin::Env => "env",
            Origin::File => "file",
            Origin::Default => "default",
        }
    }
}

/// One effective setting of `run`, for the start-up log line and `config check`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The flag's name without dashes, e.g. `poll-interval`.
    pub key: String,
    /// The value as given (secrets redacted), lists joined with `,`.
    pub value: String,
    pub origin: Origin,
}

/// Flags whose values are secrets: shown as `<redacted>`.
const SECRET_KEYS: &[&str] = &["webhook-url", "webhook-header", "webhook-routing-key"];

/// Mode of operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeChoice {
    /// Kubernetes when in-cluster config or `KUBECONFIG` is present, else host.
    Auto,
    Kubernetes,
    Host,
}

/// Which cloud's metadata service to watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CloudChoice {
    /// DMI (`/sys/class/dmi/id/*`), then probing the metadata endpoints.
    Auto,
    Aws,
    Gce,
    Azure,
}

impl CloudChoice {
    pub fn source(self) -> Option<Source> {
        match self {
            CloudChoice::Auto => None,
            CloudChoice::Aws => Some(Source::Aws),
            CloudChoice::Gce => Some(Source::Gce),
            CloudChoice::Azure => Some(Source::Azure),
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

    /// EC2 and Azure polling cadence (GCE uses hanging GETs).
    #[arg(long, env = "SPOTGUARD_POLL_INTERVAL", value_name = "DURATION", default_value = "1s", value_parser = parse_positive_duration, help_heading = NOTICES)]
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

    /// Undo a rebalance cordon/taint if no interruption follows within this time.
    #[arg(long, env = "SPOTGUARD_REBALANCE_EXPIRY", value_name = "DURATION", default_value = "30m", value_parser = parse_positive_duration, help_heading = NOTICES)]
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

    /// Start handling a scheduled event this long before its NotBefore.
    #[arg(long, env = "SPOTGUARD_MAINTENANCE_LEAD", value_name = "DURATION", default_value = "10m", value_parser = parse_duration, help_heading = NOTICES)]
    pub maintenance_lead: Duration,

    /// Signal sent to checkpoint targets.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_SIGNAL", value_name = "SIGNAL", default_value = "SIGUSR1", value_parser = parse_signal, help_heading = CHECKPOINT)]
    pub checkpoint_signal: Signal,

    /// Upper bound on waiting for checkpoint acks.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_TIMEOUT", value_name = "DURATION", default_value = "90s", value_parser = parse_positive_duration, help_heading = CHECKPOINT)]
    pub checkpoint_timeout: Duration,

    /// Time kept before the deadline for evictions [default: 25s on aws, 8s on gce and azure].
    #[arg(long, env = "SPOTGUARD_DRAIN_RESERVE", value_name = "DURATION", value_parser = parse_duration, help_heading = DRAIN)]
    pub drain_reserve: Option<Duration>,

    /// Delete pods still blocked by a PDB 5 s before the deadline (opt-in; needs pods delete RBAC).
    #[arg(long, env = "SPOTGUARD_FORCE_DELETE_AT_DEADLINE", action = ArgAction::SetTrue, value_parser = parse_bool, help_heading = DRAIN)]
    pub force_delete_at_deadline: bool,

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
        help_heading = HOST_MODE,
    )]
    pub checkpoint_pidfile: Vec<PathBuf>,

    /// Host mode target: processes whose command line matches (repeatable).
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_CMDLINE", value_name = "REGEX", value_parser = parse_regex, help_heading = HOST_MODE)]
    pub checkpoint_cmdline: Vec<Regex>,

    /// Host mode: where notice.json is written and acks are read.
    #[arg(long, env = "SPOTGUARD_CHECKPOINT_DIR", value_name = "DIR", default_value = "/run/spotguard", value_parser = parse_abs_path, help_heading = HOST_MODE)]
    pub checkpoint_dir: PathBuf,

    /// Host mode: persisted state (notice id, phase).
    #[arg(long, env = "SPOTGUARD_STATE_DIR", value_name = "DIR", default_value = "/var/lib/spotguard", value_parser = parse_abs_path, help_heading = HOST_MODE)]
    pub state_dir: PathBuf,

    /// EC2: allow IMDSv1 when the IMDSv2 token PUT fails.
    #[arg(long, env = "SPOTGUARD_IMDS_V1_FALLBACK", action = ArgAction::SetTrue, value_parser = parse_bool, help_heading = NOTICES)]
    pub imds_v1_fallback: bool,

    /// GCE: time from preempted=TRUE to power-off (120s with extended preemption notice).
    #[arg(long, env = "SPOTGUARD_GCE_PREEMPTION_NOTICE", value_name = "DURATION", default_value = "30s", value_parser = parse_positive_duration, help_heading = NOTICES)]
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

    /// Maximum evictions in flight during a drain.
    #[arg(long, env = "SPOTGUARD_DRAIN_CONCURRENCY", value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024), help_heading = DRAIN)]
    pub drain_concurrency: u16,

    /// On SIGTERM, time an in-flight plan gets to finish (still bounded by its deadline).
    #[arg(long, env = "SPOTGUARD_SHUTDOWN_GRACE", value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
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

fn parse_webhook_header(s: &str) -> Result<WebhookHeader, String> {
    crate::webhook::parse_header(s).map(|(n, v)| WebhookHeader(n, v))
}

/// A dataset to prefetch: `NAME=URL`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Dataset {
    pub name: String,
    pub url: String,
}

/// The structured parts of the config file (everything else maps onto the flags).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileExtras {
    #[serde(default)]
    datasets: Vec<Dataset>,
    #[serde(default)]
    gpu: Option<toml::Table>,
}

/// Keys of the config file that are not flags.
const STRUCTURED_KEYS: &[&str] = &["datasets", "gpu"];

/// Resolved operating mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Kubernetes,
    Host,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Kubernetes => "kubernetes",
            Mode::Host => "host",
        }
    }
}

/// The validated configuration of `spotguard run`.
#[derive(Debug, Clone)]
pub struct Config {
    pub args: RunArgs,
    pub mode: Mode,
    pub node_name: Option<String>,
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub datasets: Vec<Dataset>,
    /// GPU monitoring settings: `--gpu` plus the config file's `[gpu]` table (interval, thresholds).
    pub gpu: crate::gpu::GpuConfig,
    pub log_format: LogFormat,
}

impl Config {
    /// Drain reserve: the flag, else 25 s on AWS and 8 s on GCE and Azure.
    pub fn drain_reserve(&self, source: Source) -> Duration {
        drain_reserve(self.args.drain_reserve, source)
    }
}

/// `--drain-reserve` if given, else the per-cloud default: 25 s on AWS (about 120 s of notice),
/// 8 s on GCE and Azure (30 s).
pub fn drain_reserve(flag: Option<Duration>, source: Source) -> Duration {
    flag.unwrap_or(match source {
        Source::Aws => Duration::from_secs(25),
        Source::Gce | Source::Azure => Duration::from_secs(8),
    })
}

/// A configuration error: names the key and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// clap's own rendering (names the flag / env var).
    #[error("{0}")]
    Cli(String),
    #[error("config file {path}: {reason}")]
    File { path: String, reason: String },
    #[error("config file {path}: key `{key}`: {reason}")]
    FileKey {
        path: String,
        key: String,
        reason: String,
    },
    #[error("{key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        false
    }
    pub fn metric_label(&self) -> &'static str {
        "config"
    }
}

/// `run`'s arguments as a command of their own (`spotguard run`), for parsing them without the
/// rest of the command table.
pub(crate) fn run_command() -> clap::Command {
    RunArgs::augment_args(clap::Command::new("run").bin_name("spotguard run"))
}

/// Parse `run`'s arguments `args` as `spotguard run ARGS…` does (environment and config file
/// included), or the text the binary would print instead.
pub fn parse_run_args<I, T>(args: I) -> Result<RunArgs, String>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let args: Vec<OsString> = args.into_iter().map(Into::into).collect();
    let argv: Vec<OsString> = std::iter::once(OsString::from("spotguard"))
        .chain(args.iter().cloned())
        .collect();
    let cmd = run_command();
    let matches = match cmd.clone().try_get_matches_from(&argv) {
        Ok(m) => m,
        Err(e) => {
            return Err(env_value_error(&e, &cmd, &argv).unwrap_or_else(|| e.render().to_string()))
        }
    };
    merge_config_file(&cmd, &matches, &args).map_err(|e| format!("spotguard: {e}\n"))
}

/// A value error in a setting that came from the environment names the `SPOTGUARD_*` variable
/// (clap's own message names the flag, which the user never typed). `cmd` is the command `argv`
/// was parsed with.
pub(crate) fn env_value_error(
    e: &clap::Error,
    cmd: &clap::Command,
    argv: &[OsString],
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(
        e.kind(),
        ErrorKind::ValueValidation | ErrorKind::InvalidValue
    ) {
        return None;
    }
    let ContextValue::String(arg) = e.get(ContextKind::InvalidArg)? else {
        return None;
    };
    let long = arg.strip_prefix("--")?.split([' ', '=']).next()?;
    let run = run_command();
    let a = run.get_arguments().find(|a| a.get_long() == Some(long))?;
    let env = a.get_env()?.to_string_lossy().into_owned();
    if std::env::var_os(&env).is_none() || given_on_command_line(e, cmd, argv) {
        return None;
    }
    let value = match e.get(ContextKind::InvalidValue) {
        Some(ContextValue::String(v)) => v.clone(),
        _ => String::new(),
    };
    let rendered = e.render().to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let reason = first
        .split_once(&format!("'{arg}': "))
        .map(|(_, r)| r.to_string())
        .unwrap_or_else(|| "not a valid value".into());
    Some(format!(
        "error: invalid value '{value}' in environment variable {env} (sets --{long}): {reason}\n"
    ))
}

/// Whether the value `e` is about was given on the command line (in any form: `--flag value`,
/// `--flag=value`, a short flag or an alias): parsing `argv` again without the environment fails
/// the same way.
fn given_on_command_line(e: &clap::Error, cmd: &clap::Command, argv: &[OsString]) -> bool {
    use clap::error::ContextKind;
    fn without_env(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|a| a.env(None)).mut_subcommands(without_env)
    }
    match without_env(cmd.clone()).try_get_matches_from(argv) {
        Ok(_) => false,
        Err(again) => {
            again.kind() == e.kind()
                && again.get(ContextKind::InvalidArg) == e.get(ContextKind::InvalidArg)
        }
    }
}

/// Complete `run`'s settings with the config file (`--config`) below the command line and the
/// environment: `matches` are what `cmd` parsed from `args`; each file key that clap's value source
/// says was neither given on the command line nor set in the environment is parsed again as
/// `--key=value` ahead of `args`, so that flag > env > file > default holds and clap validates file
/// values like any other. Records where each setting came from.
pub(crate) fn merge_config_file(
    cmd: &clap::Command,
    matches: &ArgMatches,
    args: &[OsString],
) -> Result<RunArgs, Error> {
    let mut run = RunArgs::from_arg_matches(matches).map_err(|e| Error::Cli(e.to_string()))?;
    let file_args = match &run.config {
        Some(file) => config_file_args(file, cmd, matches)?,
        None => Vec::new(),
    };
    if file_args.is_empty() {
        run.settings = settings_of(cmd, matches, &[]);
        return Ok(run);
    }
    let merged: Vec<OsString> = std::iter::once(OsString::from("spotguard"))
        .chain(file_args.iter().map(|(_, arg)| OsString::from(arg)))
        .chain(args.iter().cloned())
        .collect();
    let file_error = |reason: String| Error::File {
        path: run
            .config
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        reason,
    };
    let merged = cmd
        .clone()
        .try_get_matches_from(&merged)
        .map_err(|e| file_error(e.render().to_string().trim().to_string()))?;
    let mut run = RunArgs::from_arg_matches(&merged).map_err(|e| Error::Cli(e.to_string()))?;
    let from_file: Vec<&str> = file_args.iter().map(|(key, _)| key.as_str()).collect();
    run.settings = settings_of(cmd, &merged, &from_file);
    Ok(run)
}

/// Every `run` setting with a value, with its origin (`from_file`: the keys the config file set).
fn settings_of(cmd: &clap::Command, matches: &ArgMatches, from_file: &[&str]) -> Vec<Setting> {
    let mut out = Vec::new();
    for a in cmd.get_arguments() {
        let Some(long) = a.get_long() else { continue };
        if a.is_hide_set() || long == "help" {
            continue;
        }
        let id = a.get_id().as_str();
        let Some(source) = matches.value_source(id) else {
            continue;
        };
        let origin = Origin::of(source, from_file.contains(&long));
        let value = if SECRET_KEYS.contains(&long) {
            "<redacted>".to_string()
        } else {
            matches
                .get_raw(id)
                .map(|vals| {
                    vals.map(|v| v.to_string_lossy().into_owned())
                        .collect::<Vec<_>>()
                        .join(",")
                })
                .unwrap_or_default()
        };
        let value = if value.is_empty() && matches!(a.get_action(), ArgAction::SetTrue) {
            "true".to_string()
        } else {
            value
        };
        out.push(Setting {
            key: long.to_string(),
            value,
            origin,
        });
    }
    out
}

/// `key=value (origin)` for every setting, space-separated: the effective-configuration line.
pub fn settings_line(settings: &[Setting]) -> String {
    settings
        .iter()
        .map(|s| format!("{}={} ({})", s.key, s.value, s.origin.as_str()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Read the config file and turn its keys into `--key=value` arguments of `cmd` (with their key),
/// leaving out keys that `matches` took from the command line or the environment; each key is
/// validated on its own so that an error names the file and the key.
fn config_file_args(
    path: &Path,
    cmd: &clap::Command,
    matches: &ArgMatches,
) -> Result<Vec<(String, String)>, Error> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error::File {
        path: file.clone(),
        reason: e.to_string(),
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::File {
        path: file.clone(),
        reason: e.to_string().trim().to_string(),
    })?;
    let mut out = Vec::new();
    for (raw_key, value) in &table {
        if STRUCTURED_KEYS.contains(&raw_key.as_str()) {
            continue;
        }
        let key = raw_key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| {
                a.get_long() == Some(key.as_str()) && !a.is_hide_set() && !is_help_or_version(a)
            })
            .ok_or_else(|| Error::FileKey {
                path: file.clone(),
                key: raw_key.clone(),
                reason: "unknown key".into(),
            })?;
        if key == "config" {
            return Err(Error::FileKey {
                path: file.clone(),
                key: raw_key.clone(),
                reason: "a config file cannot name another config file".into(),
            });
        }
        // Given as a flag (in any form) or in the environment: they win over the file.
        if matches!(
            matches.value_source(arg.get_id().as_str()),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        ) {
            continue;
        }
        let values: Vec<String> = match value {
            toml::Value::Array(items) => items
                .iter()
                .map(toml_scalar)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::FileKey {
                    path: file.clone(),
                    key: raw_key.clone(),
                    reason: "expected a list of strings, numbers or booleans".into(),
                })?,
            v => vec![toml_scalar(v).ok_or_else(|| Error::FileKey {
                path: file.clone(),
                key: raw_key.clone(),
                reason: "expected a string, number or boolean".into(),
            })?],
        };
        let is_switch = matches!(arg.get_action(), ArgAction::SetTrue);
        for v in values {
            // Switches take no value: `true` gives the bare flag, `false` the default.
            let one = if is_switch {
                match parse_bool(&v) {
                    Ok(true) => format!("--{key}"),
                    Ok(false) => continue,
                    Err(reason) => {
                        return Err(Error::FileKey {
                            path: file.clone(),
                            key: raw_key.clone(),
                            reason,
                        })
                    }
                }
            } else {
                format!("--{key}={v}")
            };
            // Validate this key alone so the error names the file and key.
            if let Err(e) = cmd
                .clone()
                .try_get_matches_from(["spotguard", one.as_str()])
            {
                let msg = e.render().to_string();
                let reason = msg
                    .lines()
                    .next()
                    .unwrap_or("invalid value")
                    .trim_start_matches("error: ")
                    .to_string();
                return Err(Error::FileKey {
                    path: file.clone(),
                    key: raw_key.clone(),
                    reason,
                });
            }
            out.push((key.clone(), one));
        }
    }
    Ok(out)
}

/// clap's own `--help` / `--version`: not settings.
fn is_help_or_version(a: &clap::Arg) -> bool {
    matches!(
        a.get_action(),
        ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
    )
}

fn toml_scalar(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Environment lookups used by [`Config::resolve`] (injectable for tests).
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
    fn exists(&self, path: &Path) -> bool;
    fn stdout_is_tty(&self) -> bool;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok().filter(|v| !v.is_empty())
    }
    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }
    fn stdout_is_tty(&self) -> bool {
        use std::io::IsTerminal;
        std::io::stderr().is_terminal()
    }
}

const SA_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

impl Config {
    /// Validate `run` arguments and resolve the derived settings (mode, node name, log format,
    /// structured file parts).
    pub fn resolve(args: RunArgs, env: &dyn Env) -> Result<Config, Error> {
        let in_cluster =
            env.var("KUBERNETES_SERVICE_HOST").is_some() && env.exists(Path::new(SA_TOKEN));
        let mode = match args.mode {
            ModeChoice::Kubernetes => Mode::Kubernetes,
            ModeChoice::Host => Mode::Host,
            ModeChoice::Auto => {
                if in_cluster || env.var("KUBECONFIG").is_some() {
                    Mode::Kubernetes
                } else {
                    Mode::Host
                }
            }
        };
        let node_name = args
            .node_name
            .clone()
            .or_else(|| env.var("NODE_NAME"))
            .filter(|n| !n.trim().is_empty());
        if mode == Mode::Kubernetes && node_name.is_none() {
            return Err(Error::Invalid {
                key: "node-name",
                reason: "required in kubernetes mode (set --node-name, SPOTGUARD_NODE_NAME or NODE_NAME from the downward API)".into(),
            });
        }
        if let Some(n) = &node_name {
            validate_dns_subdomain(n).map_err(|reason| Error::Invalid {
                key: "node-name",
                reason,
            })?;
        }
        if let Some(reserve) = args.drain_reserve {
            if reserve >= Duration::from_secs(600) {
                return Err(Error::Invalid {
                    key: "drain-reserve",
                    reason: format!(
                        "{} leaves no time to checkpoint before any cloud's deadline",
                        crate::duration::display(reserve)
                    ),
                });
            }
        }
        for unit in &args.checkpoint_unit {
            if unit.is_empty() || unit.contains('/') {
                return Err(Error::Invalid {
                    key: "checkpoint-unit",
                    reason: format!("{unit:?} is not a systemd unit name"),
                });
            }
        }
        if args.webhook_template.is_some() && args.webhook_url.is_none() {
            return Err(Error::Invalid {
                key: "webhook-template",
                reason: "set --webhook-url too".into(),
            });
        }
        for (key, template, kind) in [
            (
                "webhook-template",
                &args.webhook_template,
                crate::webhook::MessageKind::Start,
            ),
            (
                "webhook-outcome-template",
                &args.webhook_outcome_template,
                crate::webhook::MessageKind::Outcome,
            ),
        ] {
            if let Some(t) = template {
                crate::webhook::check_template(t, kind).map_err(|e| Error::Invalid {
                    key,
                    reason: e.to_string(),
                })?;
            }
        }
        if args.webhook_url.is_some()
            && args.webhook_preset == crate::webhook::Preset::Pagerduty
            && args.webhook_routing_key.is_none()
        {
            return Err(Error::Invalid {
                key: "webhook-routing-key",
                reason: "required by --webhook-preset pagerduty".into(),
            });
        }
        let (datasets, gpu_table) = match &args.config {
            Some(path) => read_extras(path)?,
            None => (Vec::new(), None),
        };
        let mut all = datasets;
        all.extend(args.prefetch.iter().cloned());
        let mut seen = std::collections::HashSet::new();
        for d in &all {
            validate_dataset(d).map_err(|reason| Error::Invalid {
                key: "prefetch",
                reason,
            })?;
            if !seen.insert(d.name.clone()) {
                return Err(Error::Invalid {
                    key: "prefetch",
                    reason: format!("dataset name {:?} given twice", d.name),
                });
            }
        }
        let log_format = args.log_format.unwrap_or(if in_cluster {
            LogFormat::Json
        } else if env.stdout_is_tty() {
            LogFormat::Text
        } else {
            LogFormat::Json
        });
        tracing_subscriber::EnvFilter::try_new(&args.log_level).map_err(|e| Error::Invalid {
            key: "log-level",
            reason: e.to_string(),
        })?;
        let mut gpu: crate::gpu::GpuConfig = match gpu_table {
            Some(t) => toml::Value::Table(t)
                .try_into()
                .map_err(|e: toml::de::Error| Error::Invalid {
                    key: "gpu",
                    reason: e.to_string().trim().to_string(),
                })?,
            None => crate::gpu::GpuConfig::default(),
        };
        gpu.mode = args.gpu;
        gpu.boot_id_path.clone_from(&args.boot_id_file);
        gpu.conditions = crate::gpu::ConditionTypes {
            unhealthy: args.gpu_unhealthy_condition.clone(),
            degraded: args.gpu_degraded_condition.clone(),
            ready: args.gpu_ready_condition.clone(),
        };
        gpu.pod_resources_socket = Some(PathBuf::from(&args.gpu_pod_resources_socket))
            .filter(|p| !p.as_os_str().is_empty());
        gpu.validate().map_err(|e| Error::Invalid {
            key: "gpu",
            reason: e.to_string(),
        })?;
        Ok(Config {
            gpu,
            mode,
            node_name,
            pod_name: env.var("POD_NAME"),
            pod_namespace: env.var("POD_NAMESPACE"),
            datasets: all,
            log_format,
            args,
        })
    }
}

fn read_extras(path: &Path) -> Result<(Vec<Dataset>, Option<toml::Table>), Error> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error::File {
        path: file.clone(),
        reason: e.to_string(),
    })?;
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| Error::File {
        path: file.clone(),
        reason: e.to_string().trim().to_string(),
    })?;
    table.retain(|k, _| STRUCTURED_KEYS.contains(&k));
    let extras: FileExtras =
        toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| Error::File {
                path: file.clone(),
                reason: e.to_string().trim().to_string(),
            })?;
    Ok((extras.datasets, extras.gpu))
}

fn validate_dataset(d: &Dataset) -> Result<(), String> {
    let spec = format!("{}={}", d.name, d.url);
    crate::prefetch::parse_spec(&spec)
        .map(|_| ())
        .map_err(|e| format!("dataset {:?}: {e}", d.name))
}

fn validate_dns_subdomain(name: &str) -> Result<(), String> {
    let ok = name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && !name.starts_with(['-', '.'])
        && !name.ends_with(['-', '.']);
    if ok {
        Ok(())
    } else {
        Err(format!("{name:?} is not a valid Kubernetes node name"))
    }
}

// === value parsers (used by clap; their messages end up after the flag name) ===

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    crate::duration::parse(s).map_err(|e| format!("{e} (expected a duration like 500ms, 30s, 10m)"))
}

pub fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

fn parse_signal(s: &str) -> Result<Signal, String> {
    s.parse()
}

fn parse_regex(s: &str) -> Result<Regex, String> {
    Regex::new(s).map_err(|e| e.to_string())
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" | "" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (true/false)")),
    }
}

fn parse_abs_path(s: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(s);
    if p.is_absolute() {
        Ok(p)
    } else {
        Err(format!("{s:?} must be an absolute path"))
    }
}

fn parse_url(s: &str) -> Result<String, String> {
    let t = s.trim().trim_end_matches('/');
    let rest = t
        .strip_prefix("http://")
        .or_else(|| t.strip_prefix("https://"))
        .ok_or_else(|| format!("{s:?} must start with http:// or https://"))?;
    if rest.is_empty() || rest.contains(char::is_whitespace) {
        return Err(format!("{s:?} has no host"));
    }
    Ok(t.to_string())
}

fn parse_endpoint(s: &str) -> Result<reqwest::Url, String> {
    let t = parse_url(s)?;
    reqwest::Url::parse(&t).map_err(|e| format!("{s:?}: {e}"))
}

/// `NAME=URL` or a bare URL (the name derived from it), validated by the prefetch module.
fn parse_dataset(s: &str) -> Result<Dataset, String> {
    let (name, url) = crate::prefetch::parse_spec(s).map_err(|e| e.to_string())?;
    Ok(Dataset { name, url })
}

/// Parse a byte size: `1024`, `64KiB`, `10MB`, `1.5GiB`, `2TiB`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (expected e.g. 500GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "ki" | "kib" => 1024.0,
        "mi" | "mib" => 1024.0 * 1024.0,
        "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "ti" | "tib" => 1024.0_f64.powi(4),
        other => return Err(format!("unknown size unit {other:?}")),
    };
    let v = n * mult;
    if !v.is_finite() || v < 1.0 || v > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(v as u64)
}

// === configuration reference ===

/// One Markdown table row per visible flag of `cmd`, in definition order.
fn flag_rows(cmd: &clap::Command) -> String {
    let mut out = String::new();
    for a in cmd.get_arguments() {
        if a.is_hide_set() {
            continue;
        }
        let Some(long) = a.get_long() else { continue };
        if long == "help" || long == "version" {
            continue;
        }
        let env = a
            .get_env()
            .map(|e| format!("`{}`", e.to_string_lossy()))
            .unwrap_or_default();
        let default = a
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(",");
        let possible = a
            .get_possible_values()
            .iter()
            .map(|p| p.get_name().to_string())
            .collect::<Vec<_>>();
        let mut help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
        if !help.is_empty() && !help.ends_with('.') && !help.ends_with(']') {
            help.push('.');
        }
        if !possible.is_empty()
            && !matches!(possible.as_slice(), [a, b] if a == "true" && b == "false")
        {
            help.push_str(&format!(" One of: `{}`.", possible.join("`, `")));
        }
        if a.get_num_args().is_some_and(|n| n.max_values() > 1)
            || matches!(a.get_action(), ArgAction::Append)
        {
            help.push_str(" Repeatable; the environment variable takes a comma-separated list.");
        }
        let default = if default.is_empty() {
            "—".to_string()
        } else {
            format!("`{default}`")
        };
        out.push_str(&format!(
            "| `--{long}` | {env} | {default} | {} |\n",
            help.replace('|', "\\|")
        ));
    }
    out
}

/// The configuration reference in Markdown, generated from the clap definitions of `run` and
/// `prefetch-serve`.
pub fn reference_markdown() -> String {
    let mut out = String::new();
    out.push_str("# Configuration reference\n\n");
    out.push_str("<!-- Generated by `spotguard config-reference` from the CLI definitions; a test fails when it drifts. Do not edit by hand. -->\n\n");
    out.push_str("Every `spotguard run` flag also reads the environment variable shown. Precedence: flag > environment > config file (`--config`, TOML, same keys) > default. A bad value exits with code 64 and names the key.\n\n");
    out.push_str("| flag | environment | default | meaning |\n|---|---|---|---|\n");
    out.push_str(&flag_rows(&run_command()));
    out.push_str("\n## Config file\n\n");
    out.push_str("`--config FILE` reads TOML with the same keys as the flags (kebab-case or snake_case) plus structured parts:\n\n");
    out.push_str("```toml\ncloud = \"aws\"\npoll-interval = \"1s\"\ncheckpoint-timeout = \"90s\"\ncheckpoint-cmdline = [\"python.*train\\\\.py\"]\n\n[[datasets]]\nname = \"imagenet\"\nurl = \"s3://my-bucket/imagenet/\"\n\n[gpu.thresholds]\n# see docs/gpu-health.md\n```\n");
    {
        let serve =
            crate::prefetch::serve::ServeArgs::augment_args(clap::Command::new("prefetch-serve"));
        out.push_str("\n## `spotguard prefetch-serve`\n\n");
        out.push_str("The prefetcher as its own process (the DaemonSet's `prefetch` container; on a host, started by `run` for its `--prefetch` datasets). See docs/prefetch.md.\n\n");
        out.push_str("| flag | environment | default | meaning |\n|---|---|---|---|\n");
        out.push_str(&flag_rows(&serve));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TestEnv(Vec<(&'static str, &'static str)>);
    impl Env for TestEnv {
        fn var(&self, name: &str) -> Option<String> {
            self.0
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
        fn exists(&self, _path: &Path) -> bool {
            false
        }
        fn stdout_is_tty(&self) -> bool {
            true
        }
    }

    fn run_args(args: &[&str]) -> Result<RunArgs, String> {
        parse_run_args(args)
    }

    #[test]
    fn defaults_match_the_design() {
        let a = run_args(&[]).unwrap();
        assert_eq!(a.poll_interval, Duration::from_secs(1));
        assert_eq!(a.on_rebalance, RebalanceAction::Checkpoint);
        assert_eq!(a.rebalance_expiry, Duration::from_secs(1800));
        assert_eq!(a.on_maintenance, MaintenanceAction::Drain);
        assert_eq!(a.maintenance_lead, Duration::from_secs(600));
        assert_eq!(a.checkpoint_signal, Signal::USR1);
        assert_eq!(a.checkpoint_timeout, Duration::from_secs(90));
        assert_eq!(a.metrics_addr.to_string(), "0.0.0.0:9464");
        assert_eq!(a.checkpoint_dir, PathBuf::from("/run/spotguard"));
        assert_eq!(a.state_dir, PathBuf::from("/var/lib/spotguard"));
        assert_eq!(a.gce_preemption_notice, Duration::from_secs(30));
        assert!(!a.dry_run && !a.force_delete_at_deadline && !a.imds_v1_fallback);
        let c = Config::resolve(a, &TestEnv(vec![])).unwrap();
        assert_eq!(c.mode, Mode::Host);
        assert_eq!(c.drain_reserve(Source::Aws), Duration::from_secs(25));
        assert_eq!(c.drain_reserve(Source::Gce), Duration::from_secs(8));
        assert_eq!(c.drain_reserve(Source::Azure), Duration::from_secs(8));
    }

    #[test]
    fn kubernetes_mode_needs_a_node_name() {
        let a = run_args(&["--mode", "kubernetes"]).unwrap();
        let e = Config::resolve(a.clone(), &TestEnv(vec![])).unwrap_err();
        assert!(e.to_string().starts_with("node-name:"), "{e}");
        let c = Config::resolve(a, &TestEnv(vec![("NODE_NAME", "gpu-node-1")])).unwrap();
        assert_eq!(c.node_name.as_deref(), Some("gpu-node-1"));
        let a = run_args(&[]).unwrap();
        let c =
            Config::resolve(a, &TestEnv(vec![("KUBECONFIG", "/k"), ("NODE_NAME", "n1")])).unwrap();
        assert_eq!(c.mode, Mode::Kubernetes);
    }

    #[test]
    fn config_file_fills_in_below_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "cloud = \"gce\"\npoll_interval = \"3s\"\ncheckpoint-timeout = \"45s\"\ndry-run = true\ncheckpoint-cmdline = [\"train\", \"torchrun\"]\n[[datasets]]\nname = \"ds\"\nurl = \"s3://b/p/\"\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let a = run_args(&["--config", p, "--poll-interval", "2s"]).unwrap();
        assert_eq!(a.cloud, CloudChoice::Gce);
        assert_eq!(a.poll_interval, Duration::from_secs(2), "flag beats file");
        assert_eq!(a.checkpoint_timeout, Duration::from_secs(45));
        assert!(a.dry_run);
        assert_eq!(a.checkpoint_cmdline.len(), 2);
        let c = Config::resolve(a, &TestEnv(vec![])).unwrap();
        assert_eq!(
            c.datasets,
            vec![Dataset {
                name: "ds".into(),
                url: "s3://b/p/".into()
            }]
        );
    }

    #[test]
    fn gpu_condition_types_and_pod_resources_socket() {
        let env = TestEnv(vec![]);
        let c = Config::resolve(run_args(&["--mode", "host"]).unwrap(), &env).unwrap();
        assert_eq!(c.gpu.conditions, crate::gpu::ConditionTypes::default());
        assert_eq!(
            c.gpu.pod_resources_socket.as_deref(),
            Some(Path::new(crate::gpu::podresources::DEFAULT_SOCKET))
        );
        let c = Config::resolve(
            run_args(&[
                "--mode",
                "host",
                "--gpu-ready-condition",
                "AcceleratedHardwareReady",
                "--gpu-pod-resources-socket",
                "",
            ])
            .unwrap(),
            &env,
        )
        .unwrap();
        assert_eq!(
            c.gpu.conditions.ready.as_deref(),
            Some("AcceleratedHardwareReady")
        );
        assert_eq!(c.gpu.pod_resources_socket, None, "empty = off");
        let err = Config::resolve(
            run_args(&["--mode", "host", "--gpu-unhealthy-condition", "Ready"]).unwrap(),
            &env,
        )
        .expect_err("kubelet's condition");
        assert!(err.to_string().contains("gpu-unhealthy-condition"), "{err}");
    }

    #[test]
    fn sizes_and_datasets_parse() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("64KiB").unwrap(), 65536);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_bytes("-1").is_err());
        assert_eq!(parse_dataset("n=s3://b/p").unwrap().name, "n");
        assert!(parse_dataset("s3://b/p").is_ok(), "bare URL: name derived");
        assert!(parse_dataset("../x=s3://b/p").is_err());
        assert!(parse_dataset("n=http://b/p").is_err());
    }

    #[test]
    fn reference_lists_every_visible_flag() {
        let md = reference_markdown();
        for flag in [
            "--cloud",
            "--metadata-endpoint",
            "--poll-interval",
            "--node-name",
            "--on-rebalance",
            "--rebalance-expiry",
            "--on-maintenance",
            "--maintenance-lead",
            "--checkpoint-signal",
            "--checkpoint-timeout",
            "--drain-reserve",
            "--force-delete-at-deadline",
            "--dry-run",
            "--metrics-addr",
            "--gpu",
            "--log-format",
            "--checkpoint-unit",
            "--checkpoint-pidfile",
            "--checkpoint-cmdline",
            "--checkpoint-dir",
            "--state-dir",
            "--imds-v1-fallback",
            "--gce-preemption-notice",
            "--webhook-url",
            "--webhook-template",
            "--prefetch",
            "--cache-dir",
            "--cache-max-bytes",
        ] {
            assert!(md.contains(&format!("`{flag}`")), "{flag} missing");
            let env = format!("SPOTGUARD_{}", flag[2..].replace('-', "_").to_uppercase());
            assert!(md.contains(&env), "{env} missing");
        }
    }

    /// `run` with test-only short flags and an alias (the real `run` has none yet): what clap
    /// matched decides what was given, whatever form it was given in.
    fn run_command_with_shorts() -> clap::Command {
        run_command()
            .mut_arg("poll_interval", |a| a.short('p').alias("poll"))
            .mut_arg("checkpoint_cmdline", |a| a.short('c'))
    }

    #[test]
    fn a_flag_in_any_form_beats_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(
            &path,
            "poll-interval = \"3s\"\ncheckpoint-cmdline = [\"train\"]\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let cmd = run_command_with_shorts();
        let merge = |given: &[&str]| {
            let argv: Vec<OsString> = ["spotguard", "--config", p]
                .iter()
                .chain(given)
                .map(OsString::from)
                .collect();
            let matches = cmd.clone().try_get_matches_from(&argv).unwrap();
            merge_config_file(&cmd, &matches, &argv[1..]).unwrap()
        };
        let origin = |run: &RunArgs, key: &str| {
            run.settings
                .iter()
                .find(|s| s.key == key)
                .map(|s| s.origin)
                .unwrap()
        };
        for given in [
            &["--poll-interval", "2s", "--checkpoint-cmdline", "torchrun"][..],
            &["--poll-interval=2s", "--checkpoint-cmdline=torchrun"],
            &["-p", "2s", "-c", "torchrun"],
            &["-p2s", "-ctorchrun"],
            &["--poll", "2s", "-c=torchrun"],
            &["--poll=2s", "-c", "torchrun"],
        ] {
            let run = merge(given);
            assert_eq!(run.poll_interval, Duration::from_secs(2), "{given:?}");
            let cmdline: Vec<&str> = run.checkpoint_cmdline.iter().map(|r| r.as_str()).collect();
            assert_eq!(
                cmdline,
                ["torchrun"],
                "{given:?}: the file's list not added"
            );
            assert_eq!(origin(&run, "poll-interval"), Origin::Flag, "{given:?}");
            assert_eq!(
                origin(&run, "checkpoint-cmdline"),
                Origin::Flag,
                "{given:?}"
            );
        }
        let run = merge(&[]);
        assert_eq!(run.poll_interval, Duration::from_secs(3));
        assert_eq!(origin(&run, "poll-interval"), Origin::File);
        assert_eq!(origin(&run, "checkpoint-cmdline"), Origin::File);
        assert_eq!(origin(&run, "checkpoint-timeout"), Origin::Default);
    }

    #[test]
    fn a_bad_value_is_blamed_on_the_command_line_only_when_given_there() {
        // PATH is set in every test process and is not a duration: a bad value from the environment.
        let cmd = run_command_with_shorts().mut_arg("poll_interval", |a| a.env("PATH"));
        let argv = |given: &[&str]| -> Vec<OsString> {
            std::iter::once("spotguard")
                .chain(given.iter().copied())
                .map(OsString::from)
                .collect()
        };
        let e = cmd.clone().try_get_matches_from(argv(&[])).unwrap_err();
        assert!(!given_on_command_line(&e, &cmd, &argv(&[])), "{e}");
        for given in [
            &["--poll-interval", "soon"][..],
            &["--poll-interval=soon"],
            &["-p", "soon"],
            &["--poll=soon"],
        ] {
            let e = cmd.clone().try_get_matches_from(argv(given)).unwrap_err();
            assert!(e.to_string().contains("--poll-interval"), "{e}");
            assert!(
                given_on_command_line(&e, &cmd, &argv(given)),
                "{given:?}: {e}"
            );
        }
    }
}
