//! The rules: what each reading and event is evidence of ([`sample_rules`], [`event_rules`],
//! [`missing_rules`]) and the [`Thresholds`] that decide. Rules only observe; whether an
//! observation raises, keeps or clears a finding is `state.rs`'s business.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use super::state::{GpuTrack, HealthState};
use super::{Rule, Severity, NODE_SCOPE};
use crate::gpu::{
    clock_event_reason_bit, Error, GpuEvent, GpuEventKind, GpuSample, RecoveryAction,
    CLOCK_EVENT_REASONS,
};

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
            let known: Vec<&str> = CLOCK_EVENT_REASONS.iter().map(|(_, n)| *n).collect();
            return bad(
                "gpu.thresholds.throttle_reasons",
                format!("unknown reason {name:?} (known: {})", known.join(", ")),
            );
        }
        Ok(())
    }

    pub(super) fn throttle_mask(&self) -> u64 {
        self.throttle_reasons
            .iter()
            .filter_map(|n| clock_event_reason_bit(n))
            .fold(0, |acc, bit| acc | bit)
    }
}

/// One piece of evidence observed in this evaluation.
pub(super) struct Observation {
    pub(super) uuid: String,
    pub(super) gpu: Option<u32>,
    pub(super) rule: Rule,
    pub(super) severity: Severity,
    pub(super) evidence: String,
    pub(super) codes: BTreeSet<u64>,
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

/// GpuMissing: GPUs listed earlier in this boot (or with an open GpuMissing finding) that the
/// snapshot does not list (marked not present), and fewer GPUs than `expected_gpus`.
pub(super) fn missing_rules(
    obs: &mut Vec<Observation>,
    st: &mut HealthState,
    seen: &BTreeSet<&str>,
    thresholds: &Thresholds,
) {
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
                obs,
                NODE_SCOPE,
                None,
                Rule::GpuMissing,
                Severity::Unhealthy,
                format!("{listed} of {expected} expected GPUs visible"),
            );
        }
    }
}

/// Signals that only a GPU reset or driver reload produce.
pub(super) fn reset_observed(prev: &GpuSample, cur: &GpuSample) -> bool {
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

/// Count `delta` (when positive) at `now` in the window `q`, drop what fell out of the window,
/// and return the sum within it.
fn add_to_window(
    q: &mut VecDeque<(Timestamp, u64)>,
    now: Timestamp,
    window: Duration,
    delta: u64,
) -> u64 {
    if delta > 0 {
        q.push_back((now, delta));
    }
    prune(q, window_start(now, window));
    q.iter().map(|(_, n)| *n).sum()
}

fn prune<T>(q: &mut VecDeque<(Timestamp, T)>, start: Timestamp) {
    while q.front().is_some_and(|(t, _)| *t < start) {
        q.pop_front();
    }
}

pub(super) fn sample_rules(
    obs: &mut Vec<Observation>,
    track: &mut GpuTrack,
    prev: Option<&GpuSample>,
    s: &GpuSample,
    now: Timestamp,
    t: &Thresholds,
    throttle_mask: u64,
) {
    let (uuid, gpu) = (s.uuid.as_str(), Some(s.index));
    let mut see = |rule: Rule, severity: Severity, evidence: String| {
        observe(obs, uuid, gpu, rule, severity, evidence)
    };
    if s.lost {
        see(
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
        see(
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
            see(
                Rule::EccUncorrectable,
                Severity::Unhealthy,
                format!("aggregate uncorrectable ECC errors grew by {grew}"),
            );
        }
    }

    if s.remap_failure == Some(true) {
        see(
            Rule::RowRemapFailure,
            Severity::Unhealthy,
            "row remapping failed: the GPU needs service".into(),
        );
    }
    if s.remap_pending == Some(true) {
        see(
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
        see(
            Rule::RetiredPagesPending,
            Severity::Unhealthy,
            "pages pending retirement: reboot required".into(),
        );
    }
    if s.retired_pages_single_bit.is_some() || s.retired_pages_double_bit.is_some() {
        let sbe = s.retired_pages_single_bit.unwrap_or(0);
        let dbe = s.retired_pages_double_bit.unwrap_or(0);
        if sbe.saturating_add(dbe) >= t.retired_pages_max {
            see(
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
        Some(a) if a.needs_reset() => see(
            Rule::RecoveryAction,
            Severity::Unhealthy,
            format!("driver recovery action {}", a.as_str()),
        ),
        Some(RecoveryAction::DrainP2p) => see(
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
    let corrected_in_window = add_to_window(
        &mut track.corrected,
        now,
        t.ecc_correctable_window,
        corrected,
    );
    if t.ecc_correctable_max > 0 && corrected_in_window >= t.ecc_correctable_max {
        see(
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
        let names: Vec<&str> = CLOCK_EVENT_REASONS
            .iter()
            .filter(|(bit, _)| bits & bit != 0)
            .map(|(_, n)| *n)
            .collect();
        see(
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
    let nvlink_in_window = add_to_window(&mut track.nvlink, now, t.nvlink_window, nvlink_growth);
    if t.nvlink_errors_max > 0 && nvlink_in_window >= t.nvlink_errors_max {
        see(
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
        see(
            Rule::NvlinkDown,
            Severity::Degraded,
            format!("NVLink link(s) {} down after being up", links.join(",")),
        );
    }
}

pub(super) fn event_rules(
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

pub(super) fn xid_evidence(codes: &BTreeSet<u64>) -> String {
    let parts: Vec<String> = codes
        .iter()
        .map(|c| match xid_description(*c) {
            Some(d) => format!("{c} ({d})"),
            None => c.to_string(),
        })
        .collect();
    format!("XID {}", parts.join(", "))
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "n/a".to_string(), |n| n.to_string())
}
