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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::{clock_event_reason_bit, Error, GpuEvent, GpuEventKind, GpuSample, RecoveryAction};
use crate::node::{ConditionState, GpuConditions};

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

/// Every threshold of the rules (TOML table `[gpu.thresholds]`, every key optional).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Thresholds {
    /// XIDs after which the GPU needs a reset or the node a reboot: unhealthy on first sight.
    pub reset_xids: Vec<u64>,
    /// Application-class XIDs: counted, degraded only when repeated.
    pub app_xids: Vec<u64>,
    /// Degraded when this many `app_xids` happen on one GPU within `app_xid_window`.
    pub app_xid_count: u32,
    #[serde(with = "crate::duration::serde_str")]
    pub app_xid_window: Duration,
    /// Unhealthy when the volatile uncorrectable ECC count is above this (0 = any).
    pub ecc_uncorrectable_max: u64,
    /// Degraded when at least this many corrected ECC errors happen within the window.
    pub ecc_correctable_max: u64,
    #[serde(with = "crate::duration::serde_str")]
    pub ecc_correctable_window: Duration,
    /// Degraded when NVLink CRC + replay + recovery errors grow by at least this within the
    /// window (all links of one GPU).
    pub nvlink_errors_max: u64,
    #[serde(with = "crate::duration::serde_str")]
    pub nvlink_window: Duration,
    /// Clocks-event reasons that count as throttling (names as in the metric labels).
    pub throttle_reasons: Vec<String>,
    /// Degraded after this many consecutive samples with one of `throttle_reasons`.
    pub throttle_samples: u32,
    /// Unhealthy at this many retired pages (pre-Ampere RMA threshold).
    pub retired_pages_max: u64,
    /// Unhealthy when fewer GPUs than this are visible (unset = only GPUs seen earlier count).
    pub expected_gpus: Option<u32>,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            reset_xids: vec![48, 62, 64, 74, 79, 92, 94, 95, 119, 120, 123, 136, 140, 143],
            app_xids: vec![13, 31, 43, 45],
            app_xid_count: 5,
            app_xid_window: Duration::from_secs(3600),
            ecc_uncorrectable_max: 0,
            ecc_correctable_max: 100,
            ecc_correctable_window: Duration::from_secs(3600),
            nvlink_errors_max: 100,
            nvlink_window: Duration::from_secs(3600),
            throttle_reasons: vec![
                "hw_slowdown".into(),
                "hw_thermal_slowdown".into(),
                "hw_power_brake_slowdown".into(),
                "sw_thermal_slowdown".into(),
            ],
            throttle_samples: 3,
            retired_pages_max: 60,
            expected_gpus: None,
        }
    }
}

impl Thresholds {
    /// Check every value; the error names the key.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |key: &'static str, reason: String| Err(Error::InvalidSetting { key, reason });
        if let Some(x) = self.reset_xids.iter().find(|x| self.app_xids.contains(x)) {
            return bad(
                "gpu.thresholds.app_xids",
                format!("XID {x} is also in gpu.thresholds.reset_xids"),
            );
        }
        if self.app_xid_count == 0 {
            return bad("gpu.thresholds.app_xid_count", "must be at least 1".into());
        }
        if self.throttle_samples == 0 {
            return bad(
                "gpu.thresholds.throttle_samples",
                "must be at least 1".into(),
            );
        }
        for (key, window) in [
            ("gpu.thresholds.app_xid_window", self.app_xid_window),
            (
                "gpu.thresholds.ecc_correctable_window",
                self.ecc_correctable_window,
            ),
            ("gpu.thresholds.nvlink_window", self.nvlink_window),
        ] {
            if window.is_zero() {
                return bad(key, "must be greater than zero".into());
            }
        }
        if let Some(name) = self
            .throttle_reasons
            .iter()
            .find(|n| clock_event_reason_bit(n).is_none())
        {
            let known: Vec<&str> = super::CLOCK_EVENT_REASONS.iter().map(|(_, n)| *n).collect();
            return bad(
                "gpu.thresholds.throttle_reasons",
                format!("unknown reason {name:?} (known: {})", known.join(", ")),
            );
        }
        Ok(())
    }

    fn throttle_mask(&self) -> u64 {
        self.throttle_reasons
            .iter()
            .filter_map(|n| clock_event_reason_bit(n))
            .fold(0, |acc, bit| acc | bit)
    }
}

/// Per-GPU memory of the evaluator: the previous sample of this boot and the windows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GpuTrack {
    pub index: Option<u32>,
    pub model: String,
    pub health: Health,
    /// Listed in the latest snapshot.
    pub present: bool,
    /// Previous sample in this boot (baseline for growth and reset detection).
    pub last: Option<GpuSample>,
    /// Positive deltas of the corrected ECC count.
    corrected: VecDeque<(Timestamp, u64)>,
    /// Positive deltas of the NVLink error counters (sum over links).
    nvlink: VecDeque<(Timestamp, u64)>,
    /// Application-class XIDs.
    app_xids: VecDeque<(Timestamp, u64)>,
    throttle_streak: u32,
    links_seen_up: BTreeSet<u32>,
}

impl GpuTrack {
    fn forget_boot(&mut self) {
        self.last = None;
        self.corrected.clear();
        self.nvlink.clear();
        self.app_xids.clear();
        self.throttle_streak = 0;
        self.links_seen_up.clear();
    }
}

/// Everything [`evaluate`] remembers between two evaluations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HealthState {
    /// Boot id of the latest evaluation (or read back from the node condition).
    pub boot_id: Option<String>,
    /// By UUID.
    pub gpus: BTreeMap<String, GpuTrack>,
    /// Sorted: unhealthy first, then by UUID and rule.
    pub findings: Vec<Finding>,
    pub node: Health,
    pub evaluated_at: Option<Timestamp>,
}

impl HealthState {
    /// Findings of one severity.
    pub fn findings_of(&self, severity: Severity) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.severity == severity)
    }

    /// An operator removed the condition of this severity: drop its findings. Evidence that is
    /// still present raises them again at the next evaluation.
    pub fn clear_severity(&mut self, severity: Severity) -> usize {
        let before = self.findings.len();
        self.findings.retain(|f| f.severity != severity);
        let dropped = before - self.findings.len();
        if dropped > 0 {
            recompute_health(self);
        }
        dropped
    }

    /// Add resumed findings (read back from the node late) that this state does not have yet.
    pub fn merge_resumed(&mut self, resumed: HealthState) {
        for f in resumed.findings {
            if !self
                .findings
                .iter()
                .any(|g| g.uuid == f.uuid && g.rule == f.rule)
            {
                self.findings.push(f);
            }
        }
        sort_findings(&mut self.findings);
        recompute_health(self);
    }
}

/// One piece of evidence observed in this evaluation.
struct Observation {
    uuid: String,
    gpu: Option<u32>,
    rule: Rule,
    severity: Severity,
    evidence: String,
    codes: BTreeSet<u64>,
}

fn observe(
    out: &mut Vec<Observation>,
    uuid: &str,
    gpu: Option<u32>,
    rule: Rule,
    severity: Severity,
    evidence: String,
) {
    out.push(Observation {
        uuid: uuid.to_string(),
        gpu,
        rule,
        severity,
        evidence,
        codes: BTreeSet::new(),
    });
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
    let rebooted = st.boot_id.as_deref().is_some_and(|b| b != boot_id);
    if rebooted {
        // Counters, windows and "seen this boot" describe the previous boot.
        let with_findings: BTreeSet<String> = st.findings.iter().map(|f| f.uuid.clone()).collect();
        st.gpus.retain(|uuid, _| with_findings.contains(uuid));
        for track in st.gpus.values_mut() {
            track.forget_boot();
            track.present = false;
        }
    }
    st.boot_id = Some(boot_id.to_string());

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

    // GPUs that were listed earlier in this boot (or have an open GpuMissing finding) and are
    // not listed now.
    let listed = seen.len();
    let open_missing: BTreeSet<&str> = st
        .findings
        .iter()
        .filter(|f| f.rule == Rule::GpuMissing)
        .map(|f| f.uuid.as_str())
        .collect();
    let mut missing_obs = Vec::new();
    for (uuid, track) in st.gpus.iter_mut() {
        if seen.contains(uuid.as_str()) {
            continue;
        }
        let known_this_boot = track.last.is_some() || track.present;
        if known_this_boot || open_missing.contains(uuid.as_str()) {
            observe(
                &mut missing_obs,
                uuid,
                track.index,
                Rule::GpuMissing,
                Severity::Unhealthy,
                format!("GPU no longer listed by NVML ({listed} GPUs listed)"),
            );
        }
        track.present = false;
    }
    obs.extend(missing_obs);
    if let Some(expected) = thresholds.expected_gpus {
        if (listed as u64) < u64::from(expected) {
            observe(
                &mut obs,
                NODE_SCOPE,
                None,
                Rule::GpuMissing,
                Severity::Unhealthy,
                format!("{listed} of {expected} expected GPUs visible"),
            );
        }
    }

    event_rules(&mut obs, &mut st, events, now, thresholds);

    apply(&mut st, obs, &resets, now, boot_id);
    st.evaluated_at = Some(now);
    recompute_health(&mut st);
    st
}

/// Signals that only a GPU reset or driver reload produce.
fn reset_observed(prev: &GpuSample, cur: &GpuSample) -> bool {
    let went_down = |a: Option<u64>, b: Option<u64>| matches!((a, b), (Some(a), Some(b)) if b < a);
    let cleared = |a: Option<bool>, b: Option<bool>| a == Some(true) && b == Some(false);
    (prev.lost && !cur.lost)
        || went_down(prev.ecc_corrected_volatile, cur.ecc_corrected_volatile)
        || went_down(prev.ecc_uncorrected_volatile, cur.ecc_uncorrected_volatile)
        || went_down(prev.energy_millijoules, cur.energy_millijoules)
        || cleared(prev.remap_pending, cur.remap_pending)
        || cleared(prev.retired_pages_pending, cur.retired_pages_pending)
        || (prev
            .recovery_action
            .is_some_and(RecoveryAction::needs_reset)
            && cur.recovery_action == Some(RecoveryAction::None))
}

fn growth(prev: Option<u64>, cur: Option<u64>) -> u64 {
    match (prev, cur) {
        (Some(a), Some(b)) if b > a => b - a,
        _ => 0,
    }
}

fn window_start(now: Timestamp, window: Duration) -> Timestamp {
    now.saturating_sub(window).unwrap_or(Timestamp::MIN)
}

fn prune<T>(q: &mut VecDeque<(Timestamp, T)>, start: Timestamp) {
    while q.front().is_some_and(|(t, _)| *t < start) {
        q.pop_front();
    }
}

fn sample_rules(
    obs: &mut Vec<Observation>,
    track: &mut GpuTrack,
    prev: Option<&GpuSample>,
    s: &GpuSample,
    now: Timestamp,
    t: &Thresholds,
    throttle_mask: u64,
) {
    let uuid = s.uuid.as_str();
    let gpu = Some(s.index);
    if s.lost {
        observe(
            obs,
            uuid,
            gpu,
            Rule::GpuLost,
            Severity::Unhealthy,
            "NVML reports the GPU lost (fell off the bus or inaccessible)".into(),
        );
        track.throttle_streak = 0;
        return;
    }

    // Uncorrectable ECC: volatile count (since driver load) above the threshold, or the
    // lifetime count growing between two samples.
    if let Some(n) = s
        .ecc_uncorrected_volatile
        .filter(|n| *n > t.ecc_uncorrectable_max)
    {
        observe(
            obs,
            uuid,
            gpu,
            Rule::EccUncorrectable,
            Severity::Unhealthy,
            format!("{n} uncorrectable ECC errors since the driver loaded"),
        );
    } else {
        let grew = growth(
            prev.and_then(|p| p.ecc_uncorrected_aggregate),
            s.ecc_uncorrected_aggregate,
        );
        if grew > 0 {
            observe(
                obs,
                uuid,
                gpu,
                Rule::EccUncorrectable,
                Severity::Unhealthy,
                format!("aggregate uncorrectable ECC errors grew by {grew}"),
            );
        }
    }

    if s.remap_failure == Some(true) {
        observe(
            obs,
            uuid,
            gpu,
            Rule::RowRemapFailure,
            Severity::Unhealthy,
            "row remapping failed: the GPU needs service".into(),
        );
    }
    if s.remap_pending == Some(true) {
        observe(
            obs,
            uuid,
            gpu,
            Rule::RowRemapPending,
            Severity::Unhealthy,
            format!(
                "row remap pending (remapped rows: {} uncorrectable, {} correctable): GPU reset required",
                opt(s.remapped_rows_uncorrectable),
                opt(s.remapped_rows_correctable)
            ),
        );
    }
    if s.retired_pages_pending == Some(true) {
        observe(
            obs,
            uuid,
            gpu,
            Rule::RetiredPagesPending,
            Severity::Unhealthy,
            "pages pending retirement: reboot required".into(),
        );
    }
    if s.retired_pages_single_bit.is_some() || s.retired_pages_double_bit.is_some() {
        let sbe = s.retired_pages_single_bit.unwrap_or(0);
        let dbe = s.retired_pages_double_bit.unwrap_or(0);
        if sbe.saturating_add(dbe) >= t.retired_pages_max {
            observe(
                obs,
                uuid,
                gpu,
                Rule::RetiredPagesLimit,
                Severity::Unhealthy,
                format!(
                    "{} retired pages ({sbe} single-bit, {dbe} double-bit), limit {}",
                    sbe.saturating_add(dbe),
                    t.retired_pages_max
                ),
            );
        }
    }
    match s.recovery_action {
        Some(a) if a.needs_reset() => observe(
            obs,
            uuid,
            gpu,
            Rule::RecoveryAction,
            Severity::Unhealthy,
            format!("driver recovery action {}", a.as_str()),
        ),
        Some(RecoveryAction::DrainP2p) => observe(
            obs,
            uuid,
            gpu,
            Rule::RecoveryAction,
            Severity::Degraded,
            "driver recovery action drain_p2p".into(),
        ),
        _ => {}
    }

    // Corrected ECC rate: prefer the volatile count, fall back to the aggregate.
    let corrected = if s.ecc_corrected_volatile.is_some() {
        growth(
            prev.and_then(|p| p.ecc_corrected_volatile),
            s.ecc_corrected_volatile,
        )
    } else {
        growth(
            prev.and_then(|p| p.ecc_corrected_aggregate),
            s.ecc_corrected_aggregate,
        )
    };
    if corrected > 0 {
        track.corrected.push_back((now, corrected));
    }
    prune(
        &mut track.corrected,
        window_start(now, t.ecc_correctable_window),
    );
    let corrected_in_window: u64 = track.corrected.iter().map(|(_, n)| *n).sum();
    if t.ecc_correctable_max > 0 && corrected_in_window >= t.ecc_correctable_max {
        observe(
            obs,
            uuid,
            gpu,
            Rule::EccCorrectableRate,
            Severity::Degraded,
            format!(
                "{corrected_in_window} corrected ECC errors within {} (threshold {})",
                crate::duration::display(t.ecc_correctable_window),
                t.ecc_correctable_max
            ),
        );
    }

    // Throttling that persists.
    match s.clocks_event_reasons {
        Some(bits) if bits & throttle_mask != 0 => {
            track.throttle_streak = track.throttle_streak.saturating_add(1)
        }
        _ => track.throttle_streak = 0,
    }
    if track.throttle_streak >= t.throttle_samples {
        let bits = s.clocks_event_reasons.unwrap_or(0) & throttle_mask;
        let names: Vec<&str> = super::CLOCK_EVENT_REASONS
            .iter()
            .filter(|(bit, _)| bits & bit != 0)
            .map(|(_, n)| *n)
            .collect();
        observe(
            obs,
            uuid,
            gpu,
            Rule::ClocksThrottled,
            Severity::Degraded,
            format!(
                "clocks held back by {} for {} consecutive samples",
                names.join(","),
                t.throttle_samples
            ),
        );
    }

    // NVLink: counters rising, links going down.
    let mut nvlink_growth = 0u64;
    let mut down = Vec::new();
    for link in &s.nvlinks {
        if let Some(p) = prev.and_then(|p| p.nvlinks.iter().find(|l| l.link == link.link)) {
            for (a, b) in [
                (p.crc_flit, link.crc_flit),
                (p.crc_data, link.crc_data),
                (p.replay, link.replay),
                (p.recovery, link.recovery),
            ] {
                nvlink_growth = nvlink_growth.saturating_add(growth(a, b));
            }
        }
        match link.up {
            Some(true) => {
                track.links_seen_up.insert(link.link);
            }
            Some(false) if track.links_seen_up.contains(&link.link) => down.push(link.link),
            _ => {}
        }
    }
    if nvlink_growth > 0 {
        track.nvlink.push_back((now, nvlink_growth));
    }
    prune(&mut track.nvlink, window_start(now, t.nvlink_window));
    let nvlink_in_window: u64 = track.nvlink.iter().map(|(_, n)| *n).sum();
    if t.nvlink_errors_max > 0 && nvlink_in_window >= t.nvlink_errors_max {
        observe(
            obs,
            uuid,
            gpu,
            Rule::NvlinkErrors,
            Severity::Degraded,
            format!(
                "{nvlink_in_window} NVLink CRC/replay/recovery errors within {} (threshold {})",
                crate::duration::display(t.nvlink_window),
                t.nvlink_errors_max
            ),
        );
    }
    if !down.is_empty() {
        let links: Vec<String> = down.iter().map(u32::to_string).collect();
        observe(
            obs,
            uuid,
            gpu,
            Rule::NvlinkDown,
            Severity::Degraded,
            format!("NVLink link(s) {} down after being up", links.join(",")),
        );
    }
}

fn event_rules(
    obs: &mut Vec<Observation>,
    st: &mut HealthState,
    events: &[GpuEvent],
    now: Timestamp,
    t: &Thresholds,
) {
    let mut app_touched: BTreeSet<String> = BTreeSet::new();
    for e in events {
        match e.kind {
            GpuEventKind::Xid(code) if t.reset_xids.contains(&code) => obs.push(Observation {
                uuid: e.uuid.clone(),
                gpu: e.index,
                rule: Rule::Xid,
                severity: Severity::Unhealthy,
                evidence: String::new(),
                codes: BTreeSet::from([code]),
            }),
            GpuEventKind::Xid(code) if t.app_xids.contains(&code) => {
                let track = st.gpus.entry(e.uuid.clone()).or_default();
                if track.index.is_none() {
                    track.index = e.index;
                }
                track.app_xids.push_back((e.at, code));
                app_touched.insert(e.uuid.clone());
            }
            GpuEventKind::DoubleBitEcc => observe(
                obs,
                &e.uuid,
                e.index,
                Rule::EccUncorrectable,
                Severity::Unhealthy,
                "double-bit ECC error event".into(),
            ),
            GpuEventKind::Xid(_) | GpuEventKind::SingleBitEcc => {}
        }
    }
    let start = window_start(now, t.app_xid_window);
    for (uuid, track) in st.gpus.iter_mut() {
        // Events can arrive out of order; keep the window sorted by time.
        if app_touched.contains(uuid) {
            track.app_xids.make_contiguous().sort_by_key(|(at, _)| *at);
        }
        prune(&mut track.app_xids, start);
        if track.app_xids.len() >= t.app_xid_count as usize {
            obs.push(Observation {
                uuid: uuid.clone(),
                gpu: track.index,
                rule: Rule::AppXidRepeated,
                severity: Severity::Degraded,
                evidence: format!(
                    "{} application XIDs within {} (threshold {})",
                    track.app_xids.len(),
                    crate::duration::display(t.app_xid_window),
                    t.app_xid_count
                ),
                codes: track.app_xids.iter().map(|(_, c)| *c).collect(),
            });
        }
    }
}

/// Known XID meanings (NVIDIA XID catalogue), for evidence text.
pub fn xid_description(code: u64) -> Option<&'static str> {
    Some(match code {
        13 => "graphics engine exception",
        31 => "GPU memory page fault",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup after previous errors",
        48 => "double-bit ECC error",
        62 => "internal micro-controller halt",
        63 => "ECC page retirement or row remapping event",
        64 => "ECC page retirement or row remapper recording failure",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 => "GSP RPC timeout",
        120 => "GSP error",
        _ => return None,
    })
}

fn xid_evidence(codes: &BTreeSet<u64>) -> String {
    let parts: Vec<String> = codes
        .iter()
        .map(|c| match xid_description(*c) {
            Some(d) => format!("{c} ({d})"),
            None => c.to_string(),
        })
        .collect();
    format!("XID {}", parts.join(", "))
}

fn apply(
    st: &mut HealthState,
    obs: Vec<Observation>,
    resets: &BTreeSet<String>,
    now: Timestamp,
    boot_id: &str,
) {
    let mut observed: BTreeSet<(String, Rule)> = BTreeSet::new();
    for o in obs {
        observed.insert((o.uuid.clone(), o.rule));
        let evidence = |codes: &BTreeSet<u64>, text: &str| {
            if o.rule == Rule::Xid {
                xid_evidence(codes)
            } else {
                sanitize(text)
            }
        };
        match st
            .findings
            .iter_mut()
            .find(|f| f.uuid == o.uuid && f.rule == o.rule)
        {
            Some(f) => {
                let new_codes = !o.codes.is_subset(&f.codes);
                f.codes.extend(o.codes.iter().copied());
                // Evidence text stays as first observed, except when new XID codes show up or
                // the finding was resumed without its evidence.
                if new_codes || f.evidence.is_empty() {
                    f.evidence = evidence(&f.codes, &o.evidence);
                }
                f.severity = f.severity.max(o.severity);
                f.gpu = o.gpu.or(f.gpu);
                f.boot_id = Some(boot_id.to_string());
                f.evidence_active = true;
                f.reset_seen = false;
            }
            None => st.findings.push(Finding {
                evidence: evidence(&o.codes, &o.evidence),
                uuid: o.uuid,
                gpu: o.gpu,
                rule: o.rule,
                severity: o.severity,
                since: now,
                boot_id: Some(boot_id.to_string()),
                codes: o.codes,
                evidence_active: true,
                reset_seen: false,
            }),
        }
    }
    for f in st.findings.iter_mut() {
        if observed.contains(&(f.uuid.clone(), f.rule)) {
            continue;
        }
        f.evidence_active = false;
        if resets.contains(&f.uuid) {
            f.reset_seen = true;
        }
    }
    st.findings.retain(|f| {
        let rebooted = f.boot_id.as_deref().is_some_and(|b| b != boot_id);
        f.evidence_active || !(f.reset_seen || rebooted)
    });
    sort_findings(&mut st.findings);
}

fn sort_findings(findings: &mut [Finding]) {
    findings.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then_with(|| a.uuid.cmp(&b.uuid))
            .then_with(|| a.rule.cmp(&b.rule))
    });
}

fn recompute_health(st: &mut HealthState) {
    for (uuid, track) in st.gpus.iter_mut() {
        let worst = st
            .findings
            .iter()
            .filter(|f| &f.uuid == uuid)
            .map(|f| f.severity)
            .max();
        track.health = match worst {
            Some(sev) => sev.health(),
            None if track.present && !track.last.as_ref().is_some_and(GpuSample::unreadable) => {
                Health::Healthy
            }
            None => Health::Unknown,
        };
    }
    let any_present = st.gpus.values().any(|t| t.present);
    let any_unknown = st
        .gpus
        .values()
        .any(|t| t.present && t.health == Health::Unknown);
    st.node = match st.findings.iter().map(|f| f.severity).max() {
        Some(sev) => sev.health(),
        None if any_present && !any_unknown => Health::Healthy,
        None => Health::Unknown,
    };
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "n/a".to_string(), |n| n.to_string())
}

/// Evidence goes into a `; `-separated condition message: keep it to one line without `;`.
fn sanitize(text: &str) -> String {
    text.replace(['\n', '\r'], " ").replace(';', ",")
}

// === node conditions ===

/// The node conditions for `state`: `GPUUnhealthy` from unhealthy findings, `GPUDegraded` from
/// degraded ones. The message names every finding (`[Reason] <uuid> (gpu N, since T): evidence`)
/// and ends with `boot_id=<id>`, so that [`previous_from_conditions`] can resume the findings
/// after an agent restart and tell whether the node rebooted in between.
pub fn node_conditions(state: &HealthState, boot_id: &str) -> GpuConditions {
    GpuConditions {
        unhealthy: condition(state, Severity::Unhealthy, boot_id),
        degraded: condition(state, Severity::Degraded, boot_id),
    }
}

fn condition(state: &HealthState, severity: Severity, boot_id: &str) -> ConditionState {
    let findings: Vec<&Finding> = state.findings_of(severity).collect();
    let Some(first) = findings.first() else {
        return ConditionState {
            active: false,
            reason: REASON_NONE.to_string(),
            message: format!("no {} GPU findings", severity.as_str()),
        };
    };
    let reason = if findings.iter().all(|f| f.rule == first.rule) {
        first.rule.reason()
    } else {
        REASON_MULTIPLE
    };
    let mut parts: Vec<String> = findings.iter().map(|f| format_finding(f)).collect();
    parts.push(format!("boot_id={boot_id}"));
    ConditionState {
        active: true,
        reason: reason.to_string(),
        message: parts.join("; "),
    }
}

fn format_finding(f: &Finding) -> String {
    let scope = match f.gpu {
        Some(i) => format!("gpu {i}, since {}", f.since),
        None => format!("since {}", f.since),
    };
    format!(
        "[{}] {} ({scope}): {}",
        f.rule.reason(),
        f.uuid,
        sanitize(&f.evidence)
    )
}

fn parse_finding(segment: &str, severity: Severity, boot_id: &Option<String>) -> Option<Finding> {
    let rest = segment.strip_prefix('[')?;
    let (reason, rest) = rest.split_once("] ")?;
    let rule = Rule::from_reason(reason)?;
    let (uuid, rest) = rest.split_once(" (")?;
    let (scope, evidence) = rest.split_once("): ")?;
    let (gpu, since) = match scope.strip_prefix("gpu ") {
        Some(s) => {
            let (i, since) = s.split_once(", since ")?;
            (Some(i.parse::<u32>().ok()?), since)
        }
        None => (None, scope.strip_prefix("since ")?),
    };
    let since: Timestamp = since.parse().ok()?;
    if uuid.is_empty() || uuid.contains(' ') {
        return None;
    }
    let codes = if rule == Rule::Xid {
        parse_xid_codes(evidence)
    } else {
        BTreeSet::new()
    };
    Some(Finding {
        uuid: uuid.to_string(),
        gpu,
        rule,
        severity,
        evidence: evidence.to_string(),
        since,
        boot_id: boot_id.clone(),
        codes,
        evidence_active: false,
        reset_seen: false,
    })
}

/// `XID 48 (double-bit ECC error), 79 (…)` → {48, 79}.
fn parse_xid_codes(evidence: &str) -> BTreeSet<u64> {
    let Some(list) = evidence.strip_prefix("XID ") else {
        return BTreeSet::new();
    };
    let mut codes = BTreeSet::new();
    let mut depth = 0usize;
    let mut current = String::new();
    for ch in list.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                if let Ok(c) = current.trim().parse() {
                    codes.insert(c);
                }
                current.clear();
            }
            c if depth == 0 => current.push(c),
            _ => {}
        }
    }
    if let Ok(c) = current.trim().parse() {
        codes.insert(c);
    }
    codes
}

/// Resume sticky findings from the conditions on the node (after an agent restart). The
/// findings come back with their evidence marked inactive: the next [`evaluate`] re-observes
/// whatever still holds, and clears the rest only on a reset or a boot id change. A message
/// that cannot be parsed becomes one node-level [`Rule::Resumed`] finding, so the condition is
/// never silently dropped.
pub fn previous_from_conditions(c: &GpuConditions) -> HealthState {
    let mut st = HealthState::default();
    for (cond, severity) in [
        (&c.unhealthy, Severity::Unhealthy),
        (&c.degraded, Severity::Degraded),
    ] {
        if !cond.active {
            continue;
        }
        let segments: Vec<&str> = cond.message.split("; ").collect();
        let boot_id = segments
            .iter()
            .rev()
            .find_map(|s| s.trim().strip_prefix("boot_id="))
            .map(str::to_string)
            .filter(|b| !b.is_empty());
        if st.boot_id.is_none() {
            st.boot_id.clone_from(&boot_id);
        }
        let parsed: Vec<Finding> = segments
            .iter()
            .filter(|s| !s.starts_with("boot_id="))
            .filter_map(|s| parse_finding(s, severity, &boot_id))
            .collect();
        if parsed.is_empty() {
            st.findings.push(Finding {
                uuid: NODE_SCOPE.to_string(),
                gpu: None,
                rule: Rule::Resumed,
                severity,
                evidence: sanitize(&format!("{}: {}", cond.reason, cond.message)),
                since: Timestamp::UNIX_EPOCH,
                boot_id,
                codes: BTreeSet::new(),
                evidence_active: false,
                reset_seen: false,
            });
        } else {
            st.findings.extend(parsed);
        }
    }
    sort_findings(&mut st.findings);
    st.node = st
        .findings
        .iter()
        .map(|f| f.severity.health())
        .max()
        .unwrap_or(Health::Unknown);
    st
}
