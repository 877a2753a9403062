//! GPU health (docs/gpu-health.md): read every GPU through NVML on a blocking thread, turn the readings into
//! a per-GPU and node verdict with one pure function ([`health::evaluate`]), export them as
//! metrics ([`metrics::GpuMetrics`]) and show them on the node through [`crate::node::NodeOps`]
//! (conditions `GPUUnhealthy` / `GPUDegraded`, taint `spotguard.io/gpu-unhealthy`).
//!
//! - [`GpuProbe`]: the seam. [`nvml::NvmlProbe`] in production, `testkit::gpu::FakeGpuProbe` in
//!   tests. Synchronous: the monitor calls it through `spawn_blocking`.
//! - [`health`]: rules, thresholds, sticky findings, node conditions (pure).
//! - [`monitor::run_monitor`]: the daemon task.
//! - [`report`](mod@report): `spotguard gpu [--json]`.
//!
//! Rules, metrics and condition semantics are documented in `docs/gpu-health.md`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

pub mod health;
pub mod metrics;
pub mod monitor;
pub mod nvml;
pub mod podresources;
pub mod report;

pub use health::{evaluate, node_conditions, previous_from_conditions, HealthState, Thresholds};
pub use metrics::GpuMetrics;
pub use monitor::run_monitor;
pub use nvml::NvmlProbe;
pub use report::{report, run_cli, GpuArgs, Report};

/// The GPU seam. Implementations block (NVML calls); callers run them on a blocking thread.
pub trait GpuProbe: Send + Sync {
    /// Read every GPU now. A GPU that fell off the bus is returned with `lost = true`.
    fn sample(&self) -> Result<Vec<GpuSample>, Error>;
    /// Events (XIDs, ECC) seen since the previous call, oldest first.
    fn drain_events(&self) -> Vec<GpuEvent>;
    /// Driver version, when known (shown by `spotguard gpu`).
    fn driver_version(&self) -> Option<String>;
}

/// One reading of one GPU. Every `Option` is `None` when the GPU or driver does not support the
/// reading (NotSupported) or it could not be read: never a made-up zero.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GpuSample {
    /// NVML UUID (`GPU-…`): the identity that survives reboots (indices may not).
    pub uuid: String,
    /// NVML index at the time of the sample (label `gpu`).
    pub index: u32,
    /// Product name, e.g. `NVIDIA H100 80GB HBM3`.
    pub model: String,
    /// NVML answered `GPU_IS_LOST` for this device: fell off the bus or otherwise inaccessible.
    pub lost: bool,
    pub temperature_celsius: Option<u32>,
    pub power_watts: Option<f64>,
    /// Enforced power limit.
    pub power_limit_watts: Option<f64>,
    /// Fraction of the sample period a kernel was running (0..1).
    pub utilization_gpu: Option<f64>,
    /// Fraction of the sample period device memory was read or written (0..1).
    pub utilization_memory: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    /// ECC mode currently enabled.
    pub ecc_enabled: Option<bool>,
    /// ECC counts since the driver loaded (reset by a GPU reset / driver reload).
    pub ecc_corrected_volatile: Option<u64>,
    pub ecc_uncorrected_volatile: Option<u64>,
    /// ECC counts over the lifetime of the board.
    pub ecc_corrected_aggregate: Option<u64>,
    pub ecc_uncorrected_aggregate: Option<u64>,
    /// Pages retired for multiple single-bit errors (pre-Ampere; NotSupported on A100/H100).
    pub retired_pages_single_bit: Option<u64>,
    /// Pages retired for a double-bit error (pre-Ampere).
    pub retired_pages_double_bit: Option<u64>,
    /// Pages waiting for a reboot to be retired (pre-Ampere).
    pub retired_pages_pending: Option<bool>,
    /// Rows remapped for correctable errors (Ampere and later, NVML field 142).
    pub remapped_rows_correctable: Option<u64>,
    /// Rows remapped for uncorrectable errors (field 143).
    pub remapped_rows_uncorrectable: Option<u64>,
    /// A remap is pending: the GPU needs a reset (field 144).
    pub remap_pending: Option<bool>,
    /// A remap failed: the GPU needs service (field 145).
    pub remap_failure: Option<bool>,
    /// What the driver says must be done to recover the GPU (field 230, recent drivers only).
    pub recovery_action: Option<RecoveryAction>,
    /// Clocks-event (throttle) reasons bitmask, NVML bit values (see [`CLOCK_EVENT_REASONS`]).
    pub clocks_event_reasons: Option<u64>,
    /// PCIe replay counter.
    pub pcie_replay: Option<u64>,
    /// Energy since the driver was loaded, millijoules (Volta and later).
    pub energy_millijoules: Option<u64>,
    /// NVLink links present on this GPU (empty without NVLink).
    pub nvlinks: Vec<NvLinkSample>,
    /// Readings that failed with an error other than NotSupported (field name, error).
    pub read_errors: Vec<ReadError>,
}

impl GpuSample {
    /// Whether the device itself could not be opened (no readings at all).
    pub fn unreadable(&self) -> bool {
        self.read_errors.iter().any(|e| e.field == "device")
    }

    /// Names of the clocks-event reasons set in this sample.
    pub fn clocks_event_reason_names(&self) -> Vec<&'static str> {
        let bits = self.clocks_event_reasons.unwrap_or(0);
        CLOCK_EVENT_REASONS
            .iter()
            .filter(|(bit, _)| bits & bit != 0)
            .map(|(_, name)| *name)
            .collect()
    }
}

/// One NVLink link of one GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NvLinkSample {
    pub link: u32,
    pub up: Option<bool>,
    /// Data-link receive flow-control digit CRC errors.
    pub crc_flit: Option<u64>,
    /// Data-link receive data CRC errors.
    pub crc_data: Option<u64>,
    /// Data-link transmit replay errors.
    pub replay: Option<u64>,
    /// Data-link transmit recovery errors.
    pub recovery: Option<u64>,
}

/// A reading that failed for a reason other than "not supported".
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReadError {
    pub field: &'static str,
    pub error: String,
}

/// NVML `nvmlDeviceGpuRecoveryAction_t` (field `NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryAction {
    None,
    Reset,
    Reboot,
    DrainP2p,
    DrainAndReset,
}

impl RecoveryAction {
    /// From the NVML value (0..=4).
    pub fn from_nvml(value: u64) -> Option<Self> {
        match value {
            0 => Some(RecoveryAction::None),
            1 => Some(RecoveryAction::Reset),
            2 => Some(RecoveryAction::Reboot),
            3 => Some(RecoveryAction::DrainP2p),
            4 => Some(RecoveryAction::DrainAndReset),
            _ => None,
        }
    }

    /// The NVML value (exported as `spotguard_gpu_recovery_action`).
    pub fn as_nvml(self) -> u64 {
        match self {
            RecoveryAction::None => 0,
            RecoveryAction::Reset => 1,
            RecoveryAction::Reboot => 2,
            RecoveryAction::DrainP2p => 3,
            RecoveryAction::DrainAndReset => 4,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryAction::None => "none",
            RecoveryAction::Reset => "reset",
            RecoveryAction::Reboot => "reboot",
            RecoveryAction::DrainP2p => "drain_p2p",
            RecoveryAction::DrainAndReset => "drain_and_reset",
        }
    }

    /// The GPU cannot be used until it is reset or the node rebooted.
    pub fn needs_reset(self) -> bool {
        matches!(
            self,
            RecoveryAction::Reset | RecoveryAction::Reboot | RecoveryAction::DrainAndReset
        )
    }
}

/// NVML clocks-event (formerly "clocks throttle") reason bits and their metric label names.
pub const CLOCK_EVENT_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// Bit of a clocks-event reason by label name.
pub fn clock_event_reason_bit(name: &str) -> Option<u64> {
    CLOCK_EVENT_REASONS
        .iter()
        .find(|(_, n)| *n == name)
        .map(|(bit, _)| *bit)
}

/// An event reported by the driver through the NVML event set.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GpuEvent {
    /// UUID of the GPU (`unknown` when NVML could not say).
    pub uuid: String,
    pub index: Option<u32>,
    pub at: Timestamp,
    pub kind: GpuEventKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuEventKind {
    /// Critical XID error with its code (999 = NVML did not know it).
    Xid(u64),
    SingleBitEcc,
    DoubleBitEcc,
}

/// `--gpu`: `auto` = NVML if it loads (retried with backoff), `off` = no GPU monitoring.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum GpuMode {
    #[default]
    Auto,
    Off,
}

/// Settings of the GPU monitor (TOML table `[gpu]`; every key optional).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    pub mode: GpuMode,
    /// Sampling cadence.
    #[serde(with = "crate::duration::serde_str")]
    pub interval: Duration,
    /// First retry step after NVML failed to initialise (doubles up to `init_backoff_max`; each
    /// wait is jittered in [step/2, step] by `crate::backoff`).
    #[serde(with = "crate::duration::serde_str")]
    pub init_backoff_min: Duration,
    #[serde(with = "crate::duration::serde_str")]
    pub init_backoff_max: Duration,
    pub thresholds: Thresholds,
    /// Boot id source (tests point it at a file of their own).
    pub boot_id_path: PathBuf,
    /// Node condition types the verdict is shown under (flags, not the `[gpu]` table).
    #[serde(skip)]
    pub conditions: ConditionTypes,
    /// The kubelet's pod-resources socket (`--gpu-pod-resources-socket`; empty = off): GPU
    /// metrics are labelled with the pod holding the GPU while the socket answers.
    #[serde(skip)]
    pub pod_resources_socket: Option<PathBuf>,
}

/// Node condition types of the GPU verdict: `--gpu-unhealthy-condition`,
/// `--gpu-degraded-condition` (problem polarity: status True = problem present) and the optional
/// `--gpu-ready-condition` (Ready polarity: status False while unhealthy), so that a platform's
/// node auto-repair can act on the condition it already reads (EKS: `AcceleratedHardwareReady`).
/// Plain data the node ops are given ([`crate::node::GpuConditionTypes`]); chosen and validated
/// here.
pub use crate::node::GpuConditionTypes as ConditionTypes;

/// Default `GPUUnhealthy` condition type.
pub const DEFAULT_UNHEALTHY_CONDITION: &str = crate::node::DEFAULT_GPU_UNHEALTHY_CONDITION;
/// Default `GPUDegraded` condition type.
pub const DEFAULT_DEGRADED_CONDITION: &str = crate::node::DEFAULT_GPU_DEGRADED_CONDITION;
/// Conditions the kubelet owns: spotguard never writes them.
const KUBELET_CONDITIONS: &[&str] = &[
    "Ready",
    "MemoryPressure",
    "DiskPressure",
    "PIDPressure",
    "NetworkUnavailable",
];

/// The GPU settings validate the names they hand to the node ops.
impl ConditionTypes {
    /// Each type a valid condition type (a Kubernetes qualified name), none owned by the
    /// kubelet, all different.
    pub fn validate(&self) -> Result<(), Error> {
        let named = [
            ("gpu-unhealthy-condition", Some(&self.unhealthy)),
            ("gpu-degraded-condition", Some(&self.degraded)),
            ("gpu-ready-condition", self.ready.as_ref()),
        ];
        let mut seen: Vec<&str> = Vec::new();
        for (key, value) in named {
            let Some(value) = value else { continue };
            if let Err(reason) = valid_condition_type(value) {
                return Err(Error::InvalidSetting { key, reason });
            }
            if seen.contains(&value.as_str()) {
                return Err(Error::InvalidSetting {
                    key,
                    reason: format!("{value:?} is already used by another GPU condition"),
                });
            }
            seen.push(value);
        }
        Ok(())
    }
}

/// A condition type: a qualified name (`[prefix/]name`, name ≤ 63 characters of
/// `[A-Za-z0-9_.-]` starting and ending alphanumeric) that the kubelet does not own.
fn valid_condition_type(t: &str) -> Result<(), String> {
    if KUBELET_CONDITIONS.contains(&t) {
        return Err(format!("{t:?} is owned by the kubelet"));
    }
    let name = match t.split_once('/') {
        Some((prefix, name)) => {
            let ok = !prefix.is_empty()
                && prefix.len() <= 253
                && prefix.split('.').all(|l| {
                    !l.is_empty()
                        && l.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                });
            if !ok {
                return Err(format!("{t:?}: invalid prefix (a DNS subdomain)"));
            }
            name
        }
        None => t,
    };
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= 63
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{t:?}: a condition type is a name of letters, digits, '-', '_' and '.' (≤ 63, alphanumeric at both ends)"
        ))
    }
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig {
            mode: GpuMode::Auto,
            interval: Duration::from_secs(10),
            init_backoff_min: Duration::from_secs(30),
            init_backoff_max: Duration::from_secs(600),
            thresholds: Thresholds::default(),
            boot_id_path: PathBuf::from(crate::life::BOOT_ID_PATH),
            conditions: ConditionTypes::default(),
            pod_resources_socket: None,
        }
    }
}

impl GpuConfig {
    /// Check every value; the error names the key.
    pub fn validate(&self) -> Result<(), Error> {
        if self.interval.is_zero() {
            return Err(Error::InvalidSetting {
                key: "gpu.interval",
                reason: "must be greater than zero".into(),
            });
        }
        if self.init_backoff_min.is_zero() || self.init_backoff_max < self.init_backoff_min {
            return Err(Error::InvalidSetting {
                key: "gpu.init_backoff_min",
                reason: "must be greater than zero and not above gpu.init_backoff_max".into(),
            });
        }
        self.conditions.validate()?;
        self.thresholds.validate()
    }
}

/// The probe for `--gpu`. `auto` gives an NVML probe that initialises on first use and again on
/// every later sample until it succeeds (the driver may be installed after the agent starts, as
/// the NVIDIA GPU operator does); `off` is [`Error::Disabled`].
pub fn probe_from_config(mode: GpuMode) -> Result<Arc<dyn GpuProbe>, Error> {
    match mode {
        GpuMode::Off => Err(Error::Disabled),
        GpuMode::Auto => Ok(Arc::new(NvmlProbe::deferred())),
    }
}

/// Errors of the GPU module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("GPU monitoring is off (--gpu off)")]
    Disabled,
    #[error("loading the NVML library {library}: {detail} (is the NVIDIA driver installed and its libraries visible to spotguard?)")]
    LoadLibrary { library: String, detail: String },
    #[error("initialising NVML: the NVIDIA kernel driver is not loaded")]
    DriverNotLoaded,
    #[error("initialising NVML: the NVML library does not match the loaded kernel driver version (driver upgraded without a reboot?)")]
    DriverVersionMismatch,
    #[error("initialising NVML: no permission to talk to the NVIDIA driver (/dev/nvidia* access)")]
    NoPermission,
    #[error("initialising NVML: {source}")]
    InitNvml {
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("counting GPUs: {source}")]
    CountDevices {
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    #[error("sampling GPUs on a blocking thread: {detail}")]
    SampleTask { detail: String },
    #[error("an NVML call has not returned for {}", crate::duration::display(Duration::from_secs(waited.as_secs())))]
    SampleTimeout { waited: Duration },
    #[error("invalid setting {key}: {reason}")]
    InvalidSetting { key: &'static str, reason: String },
}

impl Error {
    /// NVML could not be initialised (probe down; retried with backoff).
    pub fn is_init(&self) -> bool {
        matches!(
            self,
            Error::LoadLibrary { .. }
                | Error::DriverNotLoaded
                | Error::DriverVersionMismatch
                | Error::NoPermission
                | Error::InitNvml { .. }
        )
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Disabled | Error::InvalidSetting { .. } => false,
            Error::LoadLibrary { .. }
            | Error::DriverNotLoaded
            | Error::DriverVersionMismatch
            | Error::NoPermission
            | Error::InitNvml { .. }
            | Error::CountDevices { .. }
            | Error::SampleTask { .. }
            | Error::SampleTimeout { .. } => true,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Disabled => "disabled",
            Error::LoadLibrary { .. } => "load_library",
            Error::DriverNotLoaded => "driver_not_loaded",
            Error::DriverVersionMismatch => "driver_version_mismatch",
            Error::NoPermission => "no_permission",
            Error::InitNvml { .. } => "init_nvml",
            Error::CountDevices { .. } => "count_devices",
            Error::SampleTask { .. } => "sample_task",
            Error::SampleTimeout { .. } => "sample_timeout",
            Error::InvalidSetting { .. } => "invalid_setting",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_from_toml_with_defaults() {
        let cfg: GpuConfig = toml::from_str(
            r#"
            mode = "off"
            interval = "5s"
            [thresholds]
            app_xid_window = "30m"
            reset_xids = [79]
            "#,
        )
        .expect("toml");
        assert_eq!(cfg.mode, GpuMode::Off);
        assert_eq!(cfg.interval, Duration::from_secs(5));
        assert_eq!(cfg.init_backoff_max, Duration::from_secs(600));
        assert_eq!(cfg.thresholds.app_xid_window, Duration::from_secs(1800));
        assert_eq!(cfg.thresholds.reset_xids, vec![79]);
        assert_eq!(cfg.thresholds.app_xids, Thresholds::default().app_xids);
        cfg.validate().expect("valid");

        let bad = toml::from_str::<GpuConfig>("interval = \"soon\"").expect_err("bad duration");
        assert!(bad.to_string().contains("soon"), "{bad}");
        let unknown = toml::from_str::<GpuConfig>("intervall = \"5s\"").expect_err("unknown key");
        assert!(unknown.to_string().contains("intervall"), "{unknown}");
        let zero = GpuConfig {
            interval: Duration::ZERO,
            ..GpuConfig::default()
        };
        let err = zero.validate().expect_err("zero interval");
        assert!(err.to_string().contains("gpu.interval"), "{err}");
    }

    #[test]
    fn off_mode_gives_no_probe() {
        assert!(matches!(
            probe_from_config(GpuMode::Off),
            Err(Error::Disabled)
        ));
        assert!(probe_from_config(GpuMode::Auto).is_ok());
    }

    #[test]
    fn condition_types_are_validated() {
        ConditionTypes::default().validate().expect("defaults");
        let eks = ConditionTypes {
            ready: Some("AcceleratedHardwareReady".into()),
            ..ConditionTypes::default()
        };
        eks.validate().expect("EKS");
        let prefixed = ConditionTypes {
            unhealthy: "example.com/GPUBroken".into(),
            ..ConditionTypes::default()
        };
        prefixed.validate().expect("prefixed");
        for (bad, key) in [
            (
                ConditionTypes {
                    ready: Some("Ready".into()),
                    ..ConditionTypes::default()
                },
                "gpu-ready-condition",
            ),
            (
                ConditionTypes {
                    degraded: "GPUUnhealthy".into(),
                    ..ConditionTypes::default()
                },
                "gpu-degraded-condition",
            ),
            (
                ConditionTypes {
                    unhealthy: "GPU Unhealthy".into(),
                    ..ConditionTypes::default()
                },
                "gpu-unhealthy-condition",
            ),
            (
                ConditionTypes {
                    unhealthy: "Bad_Prefix/GPU".into(),
                    ..ConditionTypes::default()
                },
                "gpu-unhealthy-condition",
            ),
        ] {
            let err = bad.validate().expect_err("invalid");
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn recovery_action_round_trips() {
        for v in 0..=4 {
            let a = RecoveryAction::from_nvml(v).expect("known");
            assert_eq!(a.as_nvml(), v);
        }
        assert_eq!(RecoveryAction::from_nvml(5), None);
        assert!(RecoveryAction::DrainAndReset.needs_reset());
        assert!(!RecoveryAction::DrainP2p.needs_reset());
    }

    #[test]
    fn clock_reason_names() {
        let s = GpuSample {
            clocks_event_reasons: Some(0x8 | 0x40 | 0x1),
            ..GpuSample::default()
        };
        assert_eq!(
            s.clocks_event_reason_names(),
            vec!["gpu_idle", "hw_slowdown", "hw_thermal_slowdown"]
        );
        assert_eq!(
            clock_event_reason_bit("hw_power_brake_slowdown"),
            Some(0x80)
        );
        assert_eq!(clock_event_reason_bit("nope"), None);
    }
}
