//! The GPU verdict: one pure function, [`evaluate`], from the previous state, a snapshot of
//! readings and the events since, to the new state. No I/O, no clock: `now` and the boot id are
//! arguments, so every rule is table-tested from recorded readings.
//!
//! Findings are sticky. A finding clears only when its evidence is gone *and* either a GPU reset
//! was observed after it was raised (counters that only a reset or driver reload brings back:
//! volatile ECC counts, the energy counter; a pending row remap or page retirement that
//! completed; a lost or missing GPU that came back; a reset/reboot recovery action that went
//! back to none) or the node rebooted (boot id differs from the one recorded with the finding),
//! or an operator removed the condition from the node ([`HealthState::clear_severity`], called by
//! the monitor). The rules table with defaults is in `docs/gpu-health.md`.
//!
//! The module's parts: `rules.rs` (the [`Thresholds`] and what each reading and event is
//! evidence of), `state.rs` (what is remembered between evaluations, and how observations
//! raise, keep and clear findings), `conditions.rs` (findings written into node conditions and
//! read back after a restart).

mod conditions;
mod rules;
mod state;

use std::collections::BTreeSet;

use jiff::Timestamp;
use serde::Serialize;

use super::{GpuEvent, GpuSample};
use rules::{event_rules, missing_rules, reset_observed, sample_rules, Observation};
use state::{apply, recompute_health};

pub use conditions::{node_conditions, previous_from_conditions};
pub use rules::{xid_description, Thresholds};
pub use state::{GpuTrack, HealthState};

/// Health of one GPU or of the node. Ordered by severity (node = worst GPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    Healthy,
    #[default]
    Unknown,
    Degraded,
    Unhealthy,
}

impl Health {
    pub const ALL: [Health; 4] = [
        Health::Healthy,
        Health::Degraded,
        Health::Unhealthy,
        Health::Unknown,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Unknown => "unknown",
            Health::Degraded => "degraded",
            Health::Unhealthy => "unhealthy",
        }
    }
}

/// Severity of a finding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Degraded,
    Unhealthy,
}

impl Severity {
    pub fn health(self) -> Health {
        match self {
            Severity::Degraded => Health::Degraded,
            Severity::Unhealthy => Health::Unhealthy,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.health().as_str()
    }
}

/// The rule that produced a finding. [`Rule::reason`] is the condition reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// An XID from `reset_xids` (the GPU needs a reset or the node a reboot).
    Xid,
    /// Uncorrectable ECC errors (volatile count above the threshold, aggregate growth, DBE event).
    EccUncorrectable,
    /// Row remapping failed (field 145).
    RowRemapFailure,
    /// A row remap is pending (field 144): reset required.
    RowRemapPending,
    /// Pages waiting for a reboot to be retired (pre-Ampere).
    RetiredPagesPending,
    /// Retired pages at or above the RMA threshold (pre-Ampere).
    RetiredPagesLimit,
    /// NVML says the GPU is lost.
    GpuLost,
    /// The driver's recovery action (field 230) says reset/reboot (unhealthy) or drain P2P
    /// (degraded).
    RecoveryAction,
    /// Fewer GPUs than seen earlier in this boot, or than `expected_gpus`.
    GpuMissing,
    /// Corrected ECC errors above the threshold within the window.
    EccCorrectableRate,
    /// Thermal / power throttling for several consecutive samples.
    ClocksThrottled,
    /// NVLink CRC / replay / recovery counters rising above the threshold within the window.
    NvlinkErrors,
    /// An NVLink link seen up earlier in this boot is down.
    NvlinkDown,
    /// Application-class XIDs repeated within the window.
    AppXidRepeated,
    /// A finding read back from the node whose text could not be parsed (kept until a reboot
    /// or an operator clears it).
    Resumed,
}

impl Rule {
    pub const ALL: [Rule; 15] = [
        Rule::Xid,
        Rule::EccUncorrectable,
        Rule::RowRemapFailure,
        Rule::RowRemapPending,
        Rule::RetiredPagesPending,
        Rule::RetiredPagesLimit,
        Rule::GpuLost,
        Rule::RecoveryAction,
        Rule::GpuMissing,
        Rule::EccCorrectableRate,
        Rule::ClocksThrottled,
        Rule::NvlinkErrors,
        Rule::NvlinkDown,
        Rule::AppXidRepeated,
        Rule::Resumed,
    ];

    /// Condition reason (CamelCase, constant).
    pub fn reason(self) -> &'static str {
        match self {
            Rule::Xid => "XidError",
            Rule::EccUncorrectable => "EccUncorrectable",
            Rule::RowRemapFailure => "RowRemapFailure",
            Rule::RowRemapPending => "RowRemapPending",
            Rule::RetiredPagesPending => "RetiredPagesPending",
            Rule::RetiredPagesLimit => "RetiredPagesLimit",
            Rule::GpuLost => "GpuLost",
            Rule::RecoveryAction => "RecoveryActionRequired",
            Rule::GpuMissing => "GpuMissing",
            Rule::EccCorrectableRate => "EccCorrectableRate",
            Rule::ClocksThrottled => "ClocksThrottled",
            Rule::NvlinkErrors => "NvlinkErrors",
            Rule::NvlinkDown => "NvlinkDown",
            Rule::AppXidRepeated => "AppXidRepeated",
            Rule::Resumed => "ResumedFinding",
        }
    }

    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Xid => "xid",
            Rule::EccUncorrectable => "ecc_uncorrectable",
            Rule::RowRemapFailure => "row_remap_failure",
            Rule::RowRemapPending => "row_remap_pending",
            Rule::RetiredPagesPending => "retired_pages_pending",
            Rule::RetiredPagesLimit => "retired_pages_limit",
            Rule::GpuLost => "gpu_lost",
            Rule::RecoveryAction => "recovery_action",
            Rule::GpuMissing => "gpu_missing",
            Rule::EccCorrectableRate => "ecc_correctable_rate",
            Rule::ClocksThrottled => "clocks_throttled",
            Rule::NvlinkErrors => "nvlink_errors",
            Rule::NvlinkDown => "nvlink_down",
            Rule::AppXidRepeated => "app_xid_repeated",
            Rule::Resumed => "resumed",
        }
    }

    pub fn from_reason(reason: &str) -> Option<Rule> {
        Rule::ALL.into_iter().find(|r| r.reason() == reason)
    }
}

/// Condition reason when findings of several rules are active.
pub const REASON_MULTIPLE: &str = "MultipleGpuFaults";
/// Condition reason while no finding of that severity is active.
pub const REASON_NONE: &str = "NoGpuFault";
/// Pseudo-UUID of node-level findings (GPU count below `expected_gpus`, unparsable resumes).
pub const NODE_SCOPE: &str = "node";

/// One sticky finding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// GPU UUID, or [`NODE_SCOPE`].
    pub uuid: String,
    /// GPU index when the finding was raised.
    pub gpu: Option<u32>,
    pub rule: Rule,
    pub severity: Severity,
    /// What was observed, as first observed (stable, so conditions are not rewritten each tick).
    pub evidence: String,
    /// When first raised.
    pub since: Timestamp,
    /// Boot id when the evidence was last observed (`None` = unknown, from an unparsable resume).
    pub boot_id: Option<String>,
    /// XID codes seen (Xid and AppXidRepeated).
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    pub codes: BTreeSet<u64>,
    /// The evidence was present in the latest evaluation.
    pub evidence_active: bool,
    /// A GPU reset was observed after the evidence was last present.
    pub reset_seen: bool,
}

/// Compute the new state. Pure: same inputs, same output.
pub fn evaluate(
    previous: &HealthState,
    snapshot: &[GpuSample],
    events: &[GpuEvent],
    now: Timestamp,
    boot_id: &str,
    thresholds: &Thresholds,
) -> HealthState {
    let mut st = previous.clone();
    st.enter_boot(boot_id);

    let mut obs: Vec<Observation> = Vec::new();
    let mut resets: BTreeSet<String> = BTreeSet::new();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let throttle_mask = thresholds.throttle_mask();

    for s in snapshot {
        if !seen.insert(s.uuid.as_str()) {
            continue; // a UUID twice in one snapshot: keep the first reading
        }
        let existed = st.gpus.contains_key(&s.uuid);
        let track = st.gpus.entry(s.uuid.clone()).or_default();
        let came_back = existed && !track.present && track.last.is_some();
        track.index = Some(s.index);
        if !s.model.is_empty() {
            track.model = s.model.clone();
        }
        track.present = true;
        let prev = track.last.take();
        if came_back || prev.as_ref().is_some_and(|p| reset_observed(p, s)) {
            resets.insert(s.uuid.clone());
        }
        sample_rules(
            &mut obs,
            track,
            prev.as_ref(),
            s,
            now,
            thresholds,
            throttle_mask,
        );
        track.last = Some(s.clone());
    }
    missing_rules(&mut obs, &mut st, &seen, thresholds);
    event_rules(&mut obs, &mut st, events, now, thresholds);

    apply(&mut st, obs, &resets, now, boot_id);
    st.evaluated_at = Some(now);
    recompute_health(&mut st);
    st
}
