//! The agent's settings: `run`'s arguments ([`RunArgs`], each also read from `SPOTGUARD_<FLAG>`), an
//! optional TOML file with the same keys plus structured parts, and validation into a [`Config`].
//! Precedence: flag > env > file > default. Everything is parsed and validated before anything
//! starts; a bad value is reported with the key that holds it and the process exits 64
//! (`EX_USAGE`).
//!
//! - `args`: [`RunArgs`], its value enums and help headings;
//! - `file`: the config file (flag keys merged below the command line and the environment,
//!   `[[datasets]]`, the `[gpu]` table);
//! - `origin`: where each setting came from, the effective-configuration line, secret redaction,
//!   and naming the `SPOTGUARD_*` variable that holds a bad value;
//! - `parse`: value parsers of the flags;
//! - `reference`: the configuration reference (Markdown) generated from the definitions.
//!
//! The command table that names every subcommand is `crate::cli`'s; config knows only `run` and
//! never refers to cli or to any command's module (the arrows point from them to config).

mod args;
pub mod check;
mod file;
mod origin;
mod parse;
mod reference;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::notice::Cloud;
use args::run_command;
use file::{read_extras, validate_dataset};

pub use crate::gpu::GpuMode;
pub use args::{
    empty_env_is_unset, CloudChoice, LogFormat, MaintenanceAction, ModeChoice, RebalanceAction,
    RelayChoice, RunArgs, WebhookHeader,
};
pub(crate) use file::merge_config_file;
pub use file::Dataset;
pub(crate) use origin::env_value_error;
pub use origin::{settings_line, Origin, Setting};
pub use parse::{parse_bytes, parse_duration, parse_positive_duration};
pub use reference::reference_markdown;

/// Exit code for a usage or configuration error (`EX_USAGE`).
pub const EXIT_USAGE: i32 = 64;

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
    /// Kubernetes (downward API): the agent's ServiceAccount (`POD_SERVICE_ACCOUNT`), the one
    /// whose relay tokens the receiver accepts, and its pod's address (`POD_IP`), the one its
    /// relay Lease advertises.
    pub pod_service_account: Option<String>,
    pub pod_ip: Option<std::net::IpAddr>,
    pub datasets: Vec<Dataset>,
    /// GPU monitoring settings: `--gpu` plus the config file's `[gpu]` table (interval, thresholds).
    pub gpu: crate::gpu::GpuConfig,
    pub log_format: LogFormat,
}

impl Config {
    /// Drain reserve: the flag, else the cloud's default (25 s on AWS, 8 s on GCE and Azure).
    pub fn drain_reserve(&self, cloud: Cloud) -> Duration {
        cloud.drain_reserve(self.args.drain_reserve)
    }

    /// The timings judged against `cloud`'s notice: with `--cloud auto` they were judged at
    /// start against the cloud that forgives them most, and are judged again against the
    /// detected one.
    pub fn check_timings_on(&self, cloud: Cloud) -> Result<(), Error> {
        check_timings(&self.args, Some(cloud))
    }
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

/// Environment lookups used by [`Config::resolve`] (injectable for tests).
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
    fn exists(&self, path: &Path) -> bool;
    fn stdout_is_tty(&self) -> bool;
    /// Why the agent could not keep its files in `dir` (see [`check::writable_dir`]).
    fn check_dir(&self, dir: &Path) -> Result<(), String>;
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
    fn check_dir(&self, dir: &Path) -> Result<(), String> {
        check::writable_dir_bounded(dir, check::CHECK_DIR_LIMIT)
    }
}

const SA_TOKEN: &str = "/var/run/secrets/kubernetes.io/serviceaccount/token";

impl Config {
    /// Validate `run` arguments and resolve the derived settings (mode, node name, log format,
    /// structured file parts).
    pub fn resolve(args: RunArgs, env: &dyn Env) -> Result<Config, Error> {
        let in_cluster =
            env.var("KUBERNETES_SERVICE_HOST").is_some() && env.exists(Path::new(SA_TOKEN));
        let mode = resolve_mode(&args, env, in_cluster);
        let node_name = resolve_node_name(&args, env, mode)?;
        check_values(&args, mode)?;
        check_webhook(&args)?;
        let (all, gpu_table) = datasets(&args)?;
        let log_format = args.log_format.unwrap_or(if in_cluster {
            LogFormat::Json
        } else if env.stdout_is_tty() {
            LogFormat::Text
        } else {
            LogFormat::Json
        });
        let gpu = gpu_config(&args, gpu_table)?;
        // Last: what needs the machine (the value checks above name a typo first).
        check_machine(&args, env, mode)?;
        Ok(Config {
            gpu,
            mode,
            node_name,
            pod_name: env.var("POD_NAME"),
            pod_namespace: env.var("POD_NAMESPACE"),
            pod_service_account: env.var("POD_SERVICE_ACCOUNT"),
            pod_ip: env.var("POD_IP").and_then(|ip| ip.parse().ok()),
            datasets: all,
            log_format,
            args,
        })
    }
}

/// `--mode`, `auto` read from the environment: Kubernetes in a cluster or with a kubeconfig.
fn resolve_mode(args: &RunArgs, env: &dyn Env, in_cluster: bool) -> Mode {
    match args.mode {
        ModeChoice::Kubernetes => Mode::Kubernetes,
        ModeChoice::Host => Mode::Host,
        ModeChoice::Auto => {
            if in_cluster || env.var("KUBECONFIG").is_some() {
                Mode::Kubernetes
            } else {
                Mode::Host
            }
        }
    }
}

/// The node's name (`--node-name`, else `NODE_NAME`): required in Kubernetes mode, a DNS
/// subdomain when given.
fn resolve_node_name(args: &RunArgs, env: &dyn Env, mode: Mode) -> Result<Option<String>, Error> {
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
    Ok(node_name)
}

/// The values judged alone or together: the log filter, the timings against each other and the
/// cloud's notice ([`check::timings`]), the checkpoint units' names.
fn check_values(args: &RunArgs, mode: Mode) -> Result<(), Error> {
    check::log_filter(&args.log_level).map_err(|reason| Error::Invalid {
        key: "log-level",
        reason,
    })?;
    check_timings(args, args.cloud.0)?;
    if !args.checkpoint_cmdline_uid.is_empty() && args.checkpoint_cmdline.is_empty() {
        return Err(Error::Invalid {
            key: "checkpoint-cmdline-uid",
            reason:
                "narrows --checkpoint-cmdline, which is not set: give the trainers' pattern too"
                    .into(),
        });
    }
    for unit in &args.checkpoint_unit {
        check::unit_name(unit).map_err(|reason| Error::Invalid {
            key: "checkpoint-unit",
            reason,
        })?;
    }
    check_host_upload(args)?;
    check_relay(args, mode)
}

/// The relay's settings agree. Host mode: relaying needs peers and the node key, receiving needs
/// the key; the key file holds at least 16 bytes. Kubernetes: peers come from their Leases and
/// the relay token stands for the key, unless a node key is given.
fn check_relay(args: &RunArgs, mode: Mode) -> Result<(), Error> {
    let sends = args.relay != RelayChoice::Off;
    let invalid = |key: &'static str, reason: String| Error::Invalid { key, reason };
    let kube = mode == Mode::Kubernetes;
    if sends && !kube && args.relay_peers.is_empty() {
        return Err(invalid(
            "relay",
            "relaying needs --relay-peers (HOST:PORT#SHA256 of each peer)".into(),
        ));
    }
    if !sends && args.relay_listen.is_none() {
        return Ok(());
    }
    let Some(path) = &args.relay_key_file else {
        if kube {
            return Ok(());
        }
        return Err(invalid(
            "relay-key-file",
            "--relay and --relay-listen need the node key (--relay-key-file)".into(),
        ));
    };
    read_relay_key(path)
        .map(|_| ())
        .map_err(|reason| invalid("relay-key-file", reason))
}

/// The node key in `path`: its content without surrounding whitespace, at least 16 bytes.
pub fn read_relay_key(path: &std::path::Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let key = text.trim();
    if key.len() < 16 {
        return Err(format!(
            "{}: the node key must be at least 16 bytes",
            path.display()
        ));
    }
    Ok(key.to_string())
}

/// Host mode's fixed destination (`--checkpoint-upload`) lies under `--upload-allow`, judged for
/// no pod (a `{namespace}` pattern allows it nothing). No allow-list at all: uploads are off,
/// which the agent says at start.
fn check_host_upload(args: &RunArgs) -> Result<(), Error> {
    let (Some(location), false) = (&args.checkpoint_upload, args.upload_allow.is_empty()) else {
        return Ok(());
    };
    let invalid = |reason: String| Error::Invalid {
        key: "checkpoint-upload",
        reason,
    };
    let location = crate::upload::Location::parse(location).map_err(|e| invalid(e.to_string()))?;
    let policy = crate::upload::UploadPolicy {
        allow: args.upload_allow.clone(),
        own_dirs: Vec::new(),
    };
    policy
        .check_location(&location)
        .map_err(|e| invalid(format!("outside --upload-allow: {e}")))
}

/// The timings against each other and `cloud`'s notice ([`check::timings`]; `None`: `auto`).
fn check_timings(args: &RunArgs, cloud: Option<Cloud>) -> Result<(), Error> {
    check::timings(&check::Timings {
        cloud,
        gce_notice: args.gce_preemption_notice,
        poll_interval: args.poll_interval,
        drain_reserve: args.drain_reserve,
        maintenance_lead: args.maintenance_lead,
        maintenance_drains: args.on_maintenance == MaintenanceAction::Drain,
        rebalance_expiry: args.rebalance_expiry,
        rebalance_acts: args.on_rebalance != RebalanceAction::Ignore,
    })
    .map_err(|(key, reason)| Error::Invalid { key, reason })
}

/// The webhook settings: a template needs a URL and must render, PagerDuty needs a routing key.
fn check_webhook(args: &RunArgs) -> Result<(), Error> {
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
    Ok(())
}

/// The datasets to prefetch (the config file's `[[datasets]]`, then `--prefetch`), each valid and
/// named once, and the config file's `[gpu]` table.
fn datasets(args: &RunArgs) -> Result<(Vec<Dataset>, Option<toml::Table>), Error> {
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
    Ok((all, gpu_table))
}

/// The GPU settings: the config file's `[gpu]` table, then the flags, validated.
fn gpu_config(
    args: &RunArgs,
    gpu_table: Option<toml::Table>,
) -> Result<crate::gpu::GpuConfig, Error> {
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
    gpu.pod_resources_socket =
        Some(PathBuf::from(&args.gpu_pod_resources_socket)).filter(|p| !p.as_os_str().is_empty());
    gpu.validate().map_err(|e| Error::Invalid {
        key: "gpu",
        reason: e.to_string(),
    })?;
    Ok(gpu)
}

/// What needs the machine: in host mode a checkpoint target and the checkpoint dir; the state
/// dir.
fn check_machine(args: &RunArgs, env: &dyn Env, mode: Mode) -> Result<(), Error> {
    if mode == Mode::Host {
        if args.checkpoint_unit.is_empty()
            && args.checkpoint_pidfile.is_empty()
            && args.checkpoint_cmdline.is_empty()
        {
            return Err(Error::Invalid {
                key: "checkpoint-unit/-pidfile/-cmdline",
                reason: "host mode has no checkpoint target: a notice would signal nothing. Set at least one of --checkpoint-unit (e.g. train.service), --checkpoint-pidfile or --checkpoint-cmdline (SPOTGUARD_CHECKPOINT_UNIT, …)".into(),
            });
        }
        env.check_dir(&args.checkpoint_dir)
            .map_err(|reason| Error::Invalid {
                key: "checkpoint-dir",
                reason,
            })?;
    }
    env.check_dir(&args.state_dir)
        .map_err(|reason| Error::Invalid {
            key: "state-dir",
            reason,
        })?;
    Ok(())
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

/// Helpers of config's unit tests.
#[cfg(test)]
mod test_support {
    use std::path::PathBuf;

    use super::{args::run_command, parse_run_args, RunArgs};

    /// `spotguard run ARGS…` as [`parse_run_args`] parses it.
    pub(super) fn run_args(args: &[&str]) -> Result<RunArgs, String> {
        parse_run_args(args)
    }

    /// `run` with test-only short flags and an alias (the real `run` has none yet): what clap
    /// matched decides what was given, whatever form it was given in.
    pub(super) fn run_command_with_shorts() -> clap::Command {
        run_command()
            .mut_arg("poll_interval", |a| a.short('p').alias("poll"))
            .mut_arg("checkpoint_cmdline", |a| a.short('c'))
    }

    /// A config file holding `toml` (removed with the returned directory).
    pub(super) fn config_file(toml: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, toml).unwrap();
        (dir, path)
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{config_file, run_args};
    use super::*;
    use crate::checkpoint::Signal;

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
        fn check_dir(&self, _dir: &Path) -> Result<(), String> {
            Ok(())
        }
    }

    #[test]
    fn defaults_match_the_design() {
        let a = run_args(&["--checkpoint-unit", "train"]).unwrap();
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
        assert_eq!(c.drain_reserve(Cloud::Aws), Duration::from_secs(25));
        assert_eq!(c.drain_reserve(Cloud::Gce), Duration::from_secs(8));
        assert_eq!(c.drain_reserve(Cloud::Azure), Duration::from_secs(8));
    }

    #[test]
    fn with_cloud_auto_the_timings_are_judged_again_on_the_detected_cloud() {
        let a = run_args(&["--checkpoint-unit", "train", "--poll-interval", "25s"]).unwrap();
        let c = Config::resolve(a, &TestEnv(vec![])).expect("auto: aws could honour it");
        c.check_timings_on(Cloud::Aws).unwrap();
        let e = c.check_timings_on(Cloud::Azure).unwrap_err().to_string();
        assert!(
            e.starts_with("poll-interval:") && e.contains("azure"),
            "{e}"
        );
    }

    #[test]
    fn a_cmdline_uid_needs_a_cmdline() {
        let a = run_args(&[
            "--checkpoint-unit",
            "train",
            "--checkpoint-cmdline-uid",
            "1000",
        ])
        .unwrap();
        let e = Config::resolve(a, &TestEnv(vec![])).unwrap_err();
        assert!(e.to_string().starts_with("checkpoint-cmdline-uid:"), "{e}");
        let a = run_args(&[
            "--checkpoint-cmdline",
            "sgtrain",
            "--checkpoint-cmdline-uid",
            "1000,1001",
        ])
        .unwrap();
        assert_eq!(a.checkpoint_cmdline_uid, [1000, 1001]);
        Config::resolve(a, &TestEnv(vec![])).unwrap();
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
    fn kubernetes_relays_with_leases_and_the_token_without_a_node_key() {
        let env = TestEnv(vec![
            ("NODE_NAME", "gpu-node-1"),
            ("POD_SERVICE_ACCOUNT", "spotguard"),
            ("POD_IP", "10.0.0.7"),
        ]);
        let a = run_args(&[
            "--mode",
            "kubernetes",
            "--relay",
            "auto",
            "--relay-listen",
            "0.0.0.0:7443",
        ])
        .unwrap();
        let c = Config::resolve(a, &env).unwrap();
        assert_eq!(
            c.args.relay_token_file,
            std::path::Path::new(crate::relay::auth::TOKEN_FILE)
        );
        assert_eq!(c.args.relay_audience, crate::relay::auth::AUDIENCE);
        assert_eq!(c.pod_service_account.as_deref(), Some("spotguard"));
        assert_eq!(c.pod_ip, Some("10.0.0.7".parse().unwrap()));
        // Host mode still needs the peers and the key.
        let a = run_args(&[
            "--mode",
            "host",
            "--checkpoint-unit",
            "t",
            "--relay",
            "auto",
        ])
        .unwrap();
        assert!(Config::resolve(a, &env).is_err());
    }

    #[test]
    fn config_file_fills_in_below_flags() {
        let (_dir, path) = config_file(
            "cloud = \"gce\"\npoll_interval = \"3s\"\ncheckpoint-timeout = \"45s\"\ndry-run = true\ncheckpoint-cmdline = [\"train\", \"torchrun\"]\n[[datasets]]\nname = \"ds\"\nurl = \"s3://b/p/\"\n",
        );
        let p = path.to_str().unwrap();
        let a = run_args(&["--config", p, "--poll-interval", "2s"]).unwrap();
        assert_eq!(a.cloud, CloudChoice(Some(Cloud::Gce)));
        assert_eq!(a.poll_interval, Duration::from_secs(2), "flag beats file");
        assert_eq!(a.checkpoint_timeout, Duration::from_secs(45));
        assert!(a.dry_run);
        assert_eq!(a.checkpoint_cmdline.len(), 2);
        let mut a = a;
        a.checkpoint_unit = vec!["train".into()];
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
        let c = Config::resolve(
            run_args(&["--mode", "host", "--checkpoint-unit", "train"]).unwrap(),
            &env,
        )
        .unwrap();
        assert_eq!(c.gpu.conditions, crate::gpu::ConditionTypes::default());
        assert_eq!(
            c.gpu.pod_resources_socket.as_deref(),
            Some(Path::new(crate::gpu::podresources::DEFAULT_SOCKET))
        );
        let c = Config::resolve(
            run_args(&[
                "--mode",
                "host",
                "--checkpoint-unit",
                "train",
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
            run_args(&[
                "--mode",
                "host",
                "--checkpoint-unit",
                "train",
                "--gpu-unhealthy-condition",
                "Ready",
            ])
            .unwrap(),
            &env,
        )
        .expect_err("kubelet's condition");
        assert!(err.to_string().contains("gpu-unhealthy-condition"), "{err}");
    }

    #[test]
    fn the_relay_needs_its_peers_and_the_node_key() {
        let env = TestEnv(vec![]);
        let resolve = |extra: &[&str]| {
            let mut args = vec!["--mode", "host", "--checkpoint-unit", "train"];
            args.extend_from_slice(extra);
            Config::resolve(run_args(&args).unwrap(), &env).map_err(|e| e.to_string())
        };
        let dir = tempfile::tempdir().unwrap();
        let (good, short) = (dir.path().join("good.key"), dir.path().join("short.key"));
        std::fs::write(&good, "0123456789abcdef0123\n").unwrap();
        std::fs::write(&short, "short\n").unwrap();
        let (good, short) = (good.to_str().unwrap(), short.to_str().unwrap());
        let peer = format!("10.0.0.7:7443#{}", "ab".repeat(32));
        let e = resolve(&["--relay", "auto", "--relay-key-file", good]).unwrap_err();
        assert!(
            e.starts_with("relay:") && e.contains("--relay-peers"),
            "{e}"
        );
        let e = resolve(&["--relay", "always", "--relay-peers", &peer]).unwrap_err();
        assert!(e.starts_with("relay-key-file:"), "{e}");
        let e = resolve(&["--relay-listen", "127.0.0.1:0"]).unwrap_err();
        assert!(e.starts_with("relay-key-file:"), "{e}");
        let e = resolve(&["--relay-listen", "127.0.0.1:0", "--relay-key-file", short]).unwrap_err();
        assert!(e.contains("at least 16 bytes"), "{e}");
        resolve(&[
            "--relay",
            "auto",
            "--relay-peers",
            &peer,
            "--relay-key-file",
            good,
        ])
        .unwrap();
        resolve(&["--relay-listen", "127.0.0.1:0", "--relay-key-file", good]).unwrap();
        assert!(
            run_args(&["--relay-peers", "10.0.0.7:7443"]).is_err(),
            "a peer without its fingerprint"
        );
    }

    #[test]
    fn a_host_upload_location_outside_the_allow_list_is_refused_at_start() {
        let env = TestEnv(vec![]);
        let resolve = |extra: &[&str]| {
            let mut args = vec!["--mode", "host", "--checkpoint-unit", "train"];
            args.extend_from_slice(extra);
            Config::resolve(run_args(&args).unwrap(), &env)
        };
        for (allow, location) in [
            ("s3://ckpt/host", "s3://ckpt/other"),
            ("s3://ckpt/host", "s3://ckpt/host-evil"),
            ("/mnt/efs/ckpt", "/mnt/efs/other"),
            // `{namespace}` is a pod's; the host's location is for no pod.
            ("s3://ckpt/{namespace}", "s3://ckpt/ml"),
        ] {
            let e = resolve(&["--upload-allow", allow, "--checkpoint-upload", location])
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("checkpoint-upload:") && e.contains("outside --upload-allow"),
                "{allow} {location}: {e}"
            );
        }
        for (allow, location) in [
            ("s3://ckpt/host", "s3://ckpt/host"),
            ("s3://ckpt/host", "s3://ckpt/host/run1"),
            ("/mnt/efs/ckpt", "/mnt/efs/ckpt"),
        ] {
            resolve(&["--upload-allow", allow, "--checkpoint-upload", location])
                .unwrap_or_else(|e| panic!("{allow} {location}: {e}"));
        }
        // No allow-list: uploads are off (said at start), nothing to judge the location by.
        resolve(&["--checkpoint-upload", "s3://ckpt/x"]).unwrap();
    }
}
