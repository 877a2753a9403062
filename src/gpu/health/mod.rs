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

// Names the `tests` block below reaches through `use super::*`. That block is moving to
// tests/gpu_health.rs: delete this import with it (the allow keeps the build clean meanwhile).
#[cfg(test)]
#[allow(unused_imports)]
use {
    super::{GpuEventKind, RecoveryAction},
    crate::node::{ConditionState, GpuConditions},
    std::time::Duration,
};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::GpuEvent;
    use crate::testing::gpu::{a100, h100, hgx_h100, not_supported, v100, xid};

    const BOOT: &str = "7f3c2a9e-5d41-4b8f-a6c2-1e9d8b7a6c50";
    const OTHER_BOOT: &str = "c41d9e02-7a3b-4e6f-8d15-9b2c0a4f7e31";

    fn t0() -> Timestamp {
        "2025-03-01T12:00:00Z".parse().expect("timestamp")
    }

    fn at(secs: i64) -> Timestamp {
        t0().checked_add(jiff::SignedDuration::from_secs(secs))
            .expect("timestamp")
    }

    /// Evaluate `steps` 10 s apart from a fresh state.
    fn run(steps: &[(Vec<GpuSample>, Vec<GpuEvent>)], t: &Thresholds) -> HealthState {
        let mut st = HealthState::default();
        for (i, (samples, events)) in steps.iter().enumerate() {
            st = evaluate(&st, samples, events, at(10 * i as i64), BOOT, t);
        }
        st
    }

    fn only(samples: Vec<GpuSample>) -> (Vec<GpuSample>, Vec<GpuEvent>) {
        (samples, Vec::new())
    }

    fn rules(st: &HealthState) -> Vec<(Rule, Severity)> {
        st.findings.iter().map(|f| (f.rule, f.severity)).collect()
    }

    fn finding<'a>(st: &'a HealthState, uuid: &str, rule: Rule) -> Option<&'a Finding> {
        st.findings
            .iter()
            .find(|f| f.uuid == uuid && f.rule == rule)
    }

    #[test]
    fn healthy_boards_have_no_findings() {
        let t = Thresholds::default();
        for fleet in [
            hgx_h100(),
            vec![a100(0), a100(1)],
            vec![v100(0)],
            vec![not_supported(0)],
        ] {
            let steps: Vec<_> = (0..5).map(|_| only(fleet.clone())).collect();
            let st = run(&steps, &t);
            assert!(st.findings.is_empty(), "{:?}", st.findings);
            assert_eq!(st.node, Health::Healthy);
            assert!(st.gpus.values().all(|g| g.health == Health::Healthy));
            assert_eq!(st.gpus.len(), fleet.len());
        }
    }

    #[test]
    fn empty_or_unreadable_snapshot_is_unknown() {
        let t = Thresholds::default();
        assert_eq!(run(&[only(vec![])], &t).node, Health::Unknown);
        let mut bad = h100(0);
        bad.read_errors.push(crate::gpu::ReadError {
            field: "device",
            error: "Unknown Error".into(),
        });
        let st = run(&[only(vec![bad.clone()])], &t);
        assert_eq!(st.gpus[&bad.uuid].health, Health::Unknown);
        assert_eq!(st.node, Health::Unknown);
    }

    /// One broken reading after a healthy baseline ⇒ exactly one finding.
    #[test]
    fn every_state_rule_from_a_broken_reading() {
        let t = Thresholds::default();
        let cases: Vec<(&str, GpuSample, GpuSample, Rule, Severity)> = vec![
            (
                "volatile uncorrectable ECC",
                h100(0),
                GpuSample {
                    ecc_uncorrected_volatile: Some(2),
                    ecc_uncorrected_aggregate: Some(2),
                    ..h100(0)
                },
                Rule::EccUncorrectable,
                Severity::Unhealthy,
            ),
            (
                "aggregate uncorrectable ECC growth (no volatile counter)",
                GpuSample {
                    ecc_uncorrected_volatile: None,
                    ecc_uncorrected_aggregate: Some(4),
                    ..a100(0)
                },
                GpuSample {
                    ecc_uncorrected_volatile: None,
                    ecc_uncorrected_aggregate: Some(5),
                    ..a100(0)
                },
                Rule::EccUncorrectable,
                Severity::Unhealthy,
            ),
            (
                "row remap failure",
                h100(0),
                GpuSample {
                    remap_failure: Some(true),
                    ..h100(0)
                },
                Rule::RowRemapFailure,
                Severity::Unhealthy,
            ),
            (
                "row remap pending",
                a100(0),
                GpuSample {
                    remap_pending: Some(true),
                    remapped_rows_uncorrectable: Some(1),
                    ..a100(0)
                },
                Rule::RowRemapPending,
                Severity::Unhealthy,
            ),
            (
                "pages pending retirement",
                v100(0),
                GpuSample {
                    retired_pages_pending: Some(true),
                    ..v100(0)
                },
                Rule::RetiredPagesPending,
                Severity::Unhealthy,
            ),
            (
                "retired pages at the RMA limit",
                v100(0),
                GpuSample {
                    retired_pages_single_bit: Some(48),
                    retired_pages_double_bit: Some(12),
                    ..v100(0)
                },
                Rule::RetiredPagesLimit,
                Severity::Unhealthy,
            ),
            (
                "GPU lost",
                h100(0),
                GpuSample {
                    lost: true,
                    ..GpuSample {
                        uuid: h100(0).uuid,
                        index: 0,
                        model: h100(0).model,
                        ..GpuSample::default()
                    }
                },
                Rule::GpuLost,
                Severity::Unhealthy,
            ),
            (
                "recovery action reset",
                h100(0),
                GpuSample {
                    recovery_action: Some(RecoveryAction::Reset),
                    ..h100(0)
                },
                Rule::RecoveryAction,
                Severity::Unhealthy,
            ),
            (
                "recovery action reboot",
                h100(0),
                GpuSample {
                    recovery_action: Some(RecoveryAction::Reboot),
                    ..h100(0)
                },
                Rule::RecoveryAction,
                Severity::Unhealthy,
            ),
            (
                "recovery action drain and reset",
                h100(0),
                GpuSample {
                    recovery_action: Some(RecoveryAction::DrainAndReset),
                    ..h100(0)
                },
                Rule::RecoveryAction,
                Severity::Unhealthy,
            ),
            (
                "recovery action drain P2P",
                h100(0),
                GpuSample {
                    recovery_action: Some(RecoveryAction::DrainP2p),
                    ..h100(0)
                },
                Rule::RecoveryAction,
                Severity::Degraded,
            ),
            (
                "NVLink link down after up",
                h100(0),
                {
                    let mut s = h100(0);
                    s.nvlinks[5].up = Some(false);
                    s
                },
                Rule::NvlinkDown,
                Severity::Degraded,
            ),
        ];
        for (name, baseline, broken, rule, severity) in cases {
            let st = run(
                &[only(vec![baseline.clone()]), only(vec![broken.clone()])],
                &t,
            );
            assert_eq!(
                rules(&st),
                vec![(rule, severity)],
                "{name}: {:?}",
                st.findings
            );
            let f = &st.findings[0];
            assert_eq!(f.uuid, baseline.uuid, "{name}");
            assert_eq!(f.gpu, Some(0), "{name}");
            assert_eq!(f.since, at(10), "{name}");
            assert_eq!(f.boot_id.as_deref(), Some(BOOT), "{name}");
            assert!(f.evidence_active, "{name}");
            assert_eq!(st.node, severity.health(), "{name}");
            assert_eq!(st.gpus[&baseline.uuid].health, severity.health(), "{name}");
            // And the same broken reading seen first (agent started after the fault): the
            // state rules fire without a baseline, the growth rule needs one.
            let first = run(&[only(vec![broken])], &t);
            if name.contains("growth") || name.contains("NVLink") {
                assert!(first.findings.is_empty(), "{name}: {:?}", first.findings);
            } else {
                assert_eq!(rules(&first), vec![(rule, severity)], "{name}");
            }
        }
    }

    #[test]
    fn below_thresholds_is_no_finding() {
        let t = Thresholds::default();
        let cases: Vec<(&str, GpuSample)> = vec![
            (
                "59 retired pages",
                GpuSample {
                    retired_pages_single_bit: Some(59),
                    ..v100(0)
                },
            ),
            (
                "uncorrectable remapped rows without pending or failure",
                GpuSample {
                    remapped_rows_uncorrectable: Some(3),
                    remapped_rows_correctable: Some(7),
                    ..h100(0)
                },
            ),
            (
                "ECC disabled",
                GpuSample {
                    ecc_enabled: Some(false),
                    ecc_corrected_volatile: None,
                    ecc_uncorrected_volatile: None,
                    ecc_corrected_aggregate: None,
                    ecc_uncorrected_aggregate: None,
                    ..h100(0)
                },
            ),
            (
                "recovery action none",
                GpuSample {
                    recovery_action: Some(RecoveryAction::None),
                    ..h100(0)
                },
            ),
        ];
        for (name, s) in cases {
            let st = run(&[only(vec![s.clone()]), only(vec![s])], &t);
            assert!(st.findings.is_empty(), "{name}: {:?}", st.findings);
            assert_eq!(st.node, Health::Healthy, "{name}");
        }
    }

    #[test]
    fn every_reset_xid_is_unhealthy_and_app_xids_are_not() {
        let t = Thresholds::default();
        let g = h100(3);
        for code in t.reset_xids.clone() {
            let st = run(&[(vec![g.clone()], vec![xid(&g, code, at(0))])], &t);
            assert_eq!(
                rules(&st),
                vec![(Rule::Xid, Severity::Unhealthy)],
                "XID {code}"
            );
            assert_eq!(st.findings[0].codes, BTreeSet::from([code]));
            assert!(
                st.findings[0].evidence.starts_with(&format!("XID {code}")),
                "{}",
                st.findings[0].evidence
            );
        }
        for code in [13, 31, 43, 45, 63, 999] {
            let st = run(&[(vec![g.clone()], vec![xid(&g, code, at(0))])], &t);
            assert!(st.findings.is_empty(), "XID {code}: {:?}", st.findings);
            assert_eq!(st.node, Health::Healthy);
        }
        let st = run(&[(vec![g.clone()], vec![xid(&g, 79, at(0))])], &t);
        assert_eq!(
            st.findings[0].evidence,
            "XID 79 (GPU has fallen off the bus)"
        );
    }

    #[test]
    fn xid_codes_accumulate_in_one_finding() {
        let t = Thresholds::default();
        let g = h100(0);
        let st = run(
            &[
                (vec![g.clone()], vec![xid(&g, 94, at(0))]),
                (
                    vec![g.clone()],
                    vec![xid(&g, 48, at(10)), xid(&g, 94, at(11))],
                ),
            ],
            &t,
        );
        assert_eq!(st.findings.len(), 1);
        assert_eq!(st.findings[0].codes, BTreeSet::from([48, 94]));
        assert_eq!(
            st.findings[0].evidence,
            "XID 48 (double-bit ECC error), 94 (contained ECC error)"
        );
        assert_eq!(st.findings[0].since, at(0));
    }

    #[test]
    fn repeated_app_xids_within_the_window_are_degraded() {
        let t = Thresholds::default();
        let g = a100(1);
        let burst: Vec<GpuEvent> = (0..5)
            .map(|i| xid(&g, [13, 31, 43][i % 3], at(i as i64)))
            .collect();
        let st = run(&[(vec![g.clone()], burst[..4].to_vec())], &t);
        assert!(st.findings.is_empty(), "4 < 5: {:?}", st.findings);
        let st = run(&[(vec![g.clone()], burst.clone())], &t);
        assert_eq!(rules(&st), vec![(Rule::AppXidRepeated, Severity::Degraded)]);
        assert_eq!(st.findings[0].codes, BTreeSet::from([13, 31, 43]));

        // Five XIDs spread over more than the window never count five at once.
        let mut st = HealthState::default();
        for i in 0..5 {
            let now = at(i * 1000);
            st = evaluate(
                &st,
                std::slice::from_ref(&g),
                &[xid(&g, 13, now)],
                now,
                BOOT,
                &t,
            );
        }
        assert!(st.findings.is_empty(), "{:?}", st.findings);
    }

    #[test]
    fn dbe_event_is_uncorrectable_ecc() {
        let t = Thresholds::default();
        let g = h100(2);
        let ev = GpuEvent {
            uuid: g.uuid.clone(),
            index: Some(2),
            at: at(0),
            kind: GpuEventKind::DoubleBitEcc,
        };
        let sbe = GpuEvent {
            kind: GpuEventKind::SingleBitEcc,
            ..ev.clone()
        };
        let st = run(&[(vec![g.clone()], vec![sbe])], &t);
        assert!(st.findings.is_empty());
        let st = run(&[(vec![g], vec![ev])], &t);
        assert_eq!(
            rules(&st),
            vec![(Rule::EccUncorrectable, Severity::Unhealthy)]
        );
    }

    #[test]
    fn fewer_gpus_than_earlier_in_this_boot_is_unhealthy() {
        let t = Thresholds::default();
        let all = hgx_h100();
        let seven: Vec<GpuSample> = all.iter().filter(|g| g.index != 5).cloned().collect();
        let st = run(&[only(all.clone()), only(seven.clone())], &t);
        assert_eq!(rules(&st), vec![(Rule::GpuMissing, Severity::Unhealthy)]);
        assert_eq!(st.findings[0].uuid, all[5].uuid);
        assert_eq!(st.findings[0].gpu, Some(5));
        assert_eq!(st.gpus[&all[5].uuid].health, Health::Unhealthy);
        assert_eq!(st.gpus[&all[0].uuid].health, Health::Healthy);
        assert_eq!(st.node, Health::Unhealthy);

        // With expected_gpus, fewer from the first sample on is a node-level finding.
        let t8 = Thresholds {
            expected_gpus: Some(8),
            ..Thresholds::default()
        };
        let st = run(&[only(seven)], &t8);
        assert_eq!(rules(&st), vec![(Rule::GpuMissing, Severity::Unhealthy)]);
        assert_eq!(st.findings[0].uuid, NODE_SCOPE);
        assert_eq!(st.findings[0].evidence, "7 of 8 expected GPUs visible");
        assert!(run(&[only(all)], &t8).findings.is_empty());
    }

    #[test]
    fn corrected_ecc_rate_counts_within_the_window() {
        let t = Thresholds::default();
        let with = |n: u64| GpuSample {
            ecc_corrected_volatile: Some(n),
            ecc_corrected_aggregate: Some(1000 + n),
            ..h100(0)
        };
        let st = run(
            &[
                only(vec![with(0)]),
                only(vec![with(60)]),
                only(vec![with(99)]),
            ],
            &t,
        );
        assert!(st.findings.is_empty(), "99 < 100: {:?}", st.findings);
        let st = run(
            &[
                only(vec![with(0)]),
                only(vec![with(60)]),
                only(vec![with(110)]),
            ],
            &t,
        );
        assert_eq!(
            rules(&st),
            vec![(Rule::EccCorrectableRate, Severity::Degraded)]
        );

        // The same 110 errors spread over two windows stay below.
        let mut st = HealthState::default();
        for (i, n) in [0u64, 60, 110].into_iter().enumerate() {
            st = evaluate(&st, &[with(n)], &[], at(i as i64 * 3700), BOOT, &t);
        }
        assert!(st.findings.is_empty(), "{:?}", st.findings);

        // A board with only the aggregate counter.
        let agg = |n: u64| GpuSample {
            ecc_corrected_volatile: None,
            ecc_corrected_aggregate: Some(n),
            ..a100(0)
        };
        let st = run(&[only(vec![agg(500)]), only(vec![agg(650)])], &t);
        assert_eq!(
            rules(&st),
            vec![(Rule::EccCorrectableRate, Severity::Degraded)]
        );
    }

    #[test]
    fn throttling_needs_a_streak_and_the_right_reasons() {
        let t = Thresholds::default();
        let reasons = |bits: u64| GpuSample {
            clocks_event_reasons: Some(bits),
            ..h100(0)
        };
        let hw = reasons(0x8);
        let st = run(&[only(vec![hw.clone()]), only(vec![hw.clone()])], &t);
        assert!(st.findings.is_empty(), "2 < 3");
        let st = run(
            &[
                only(vec![hw.clone()]),
                only(vec![reasons(0x1)]),
                only(vec![hw.clone()]),
                only(vec![hw.clone()]),
            ],
            &t,
        );
        assert!(st.findings.is_empty(), "streak broken");
        for bits in [0x8, 0x20, 0x40, 0x80, 0x48] {
            let s = reasons(bits);
            let st = run(
                &[only(vec![s.clone()]), only(vec![s.clone()]), only(vec![s])],
                &t,
            );
            assert_eq!(
                rules(&st),
                vec![(Rule::ClocksThrottled, Severity::Degraded)],
                "{bits:#x}"
            );
        }
        let st = run(
            &(0..3)
                .map(|_| only(vec![reasons(0x48)]))
                .collect::<Vec<_>>(),
            &t,
        );
        assert_eq!(
            st.findings[0].evidence,
            "clocks held back by hw_slowdown,hw_thermal_slowdown for 3 consecutive samples"
        );
        // Idle, application clocks, software power cap, sync boost, display: not throttling.
        for bits in [0x1, 0x2, 0x4, 0x10, 0x100, 0x7] {
            let steps: Vec<_> = (0..10).map(|_| only(vec![reasons(bits)])).collect();
            assert!(run(&steps, &t).findings.is_empty(), "{bits:#x}");
        }
    }

    #[test]
    fn nvlink_errors_rising_above_the_threshold() {
        let t = Thresholds::default();
        let with = |flit: u64, replay: u64| {
            let mut s = h100(0);
            s.nvlinks[2].crc_flit = Some(flit);
            s.nvlinks[7].replay = Some(replay);
            s
        };
        let st = run(&[only(vec![with(1000, 0)]), only(vec![with(1040, 50)])], &t);
        assert!(st.findings.is_empty(), "90 < 100");
        let st = run(
            &[
                only(vec![with(1000, 0)]),
                only(vec![with(1040, 50)]),
                only(vec![with(1050, 50)]),
            ],
            &t,
        );
        assert_eq!(rules(&st), vec![(Rule::NvlinkErrors, Severity::Degraded)]);
        // A high but constant count (errors from long ago) is not rising.
        let steps: Vec<_> = (0..5).map(|_| only(vec![with(90_000, 4_000)])).collect();
        assert!(run(&steps, &t).findings.is_empty());
    }

    #[test]
    fn unhealthy_findings_stick_until_reboot() {
        let t = Thresholds::default();
        let g = h100(0);
        let mut st = evaluate(
            &HealthState::default(),
            std::slice::from_ref(&g),
            &[xid(&g, 79, at(0))],
            at(0),
            BOOT,
            &t,
        );
        for i in 1..50 {
            st = evaluate(&st, std::slice::from_ref(&g), &[], at(i * 10), BOOT, &t);
        }
        let f = finding(&st, &g.uuid, Rule::Xid).expect("sticky");
        assert!(!f.evidence_active);
        assert_eq!(st.node, Health::Unhealthy);
        let st = evaluate(&st, std::slice::from_ref(&g), &[], at(600), OTHER_BOOT, &t);
        assert!(st.findings.is_empty(), "{:?}", st.findings);
        assert_eq!(st.node, Health::Healthy);
        assert_eq!(st.boot_id.as_deref(), Some(OTHER_BOOT));
    }

    #[test]
    fn a_gpu_reset_clears_findings_whose_evidence_is_gone() {
        let t = Thresholds::default();
        let g = a100(0);
        // Uncorrectable error: remap pending, volatile count 1; after `nvidia-smi -r` both reset.
        let broken = GpuSample {
            ecc_uncorrected_volatile: Some(1),
            ecc_uncorrected_aggregate: Some(1),
            remap_pending: Some(true),
            remapped_rows_uncorrectable: Some(1),
            ..g.clone()
        };
        let after_reset = GpuSample {
            ecc_uncorrected_aggregate: Some(1),
            remapped_rows_uncorrectable: Some(1),
            energy_millijoules: Some(1_000),
            ..g.clone()
        };
        let st = run(
            &[
                only(vec![g.clone()]),
                (vec![broken.clone()], vec![xid(&g, 94, at(10))]),
                only(vec![broken.clone()]),
            ],
            &t,
        );
        assert_eq!(
            rules(&st),
            vec![
                (Rule::Xid, Severity::Unhealthy),
                (Rule::EccUncorrectable, Severity::Unhealthy),
                (Rule::RowRemapPending, Severity::Unhealthy)
            ]
        );
        let st = evaluate(
            &st,
            std::slice::from_ref(&after_reset),
            &[],
            at(100),
            BOOT,
            &t,
        );
        assert!(st.findings.is_empty(), "{:?}", st.findings);
        assert_eq!(st.node, Health::Healthy);
    }

    #[test]
    fn reset_signals_each_clear_a_sticky_xid() {
        let t = Thresholds::default();
        let base = h100(0);
        let resets: Vec<(&str, GpuSample, GpuSample)> = vec![
            (
                "volatile corrected ECC back to 0",
                GpuSample {
                    ecc_corrected_volatile: Some(12),
                    ..base.clone()
                },
                base.clone(),
            ),
            (
                "energy counter back",
                base.clone(),
                GpuSample {
                    energy_millijoules: Some(5_000),
                    ..base.clone()
                },
            ),
            (
                "recovery action reset → none",
                GpuSample {
                    recovery_action: Some(RecoveryAction::Reset),
                    ..base.clone()
                },
                base.clone(),
            ),
            (
                "lost → back",
                GpuSample {
                    lost: true,
                    ..GpuSample {
                        uuid: base.uuid.clone(),
                        model: base.model.clone(),
                        ..GpuSample::default()
                    }
                },
                base.clone(),
            ),
        ];
        for (name, before, after) in resets {
            let st = run(
                &[
                    (vec![before.clone()], vec![xid(&base, 79, at(0))]),
                    only(vec![before.clone()]),
                ],
                &t,
            );
            assert!(finding(&st, &base.uuid, Rule::Xid).is_some(), "{name}");
            let st = evaluate(&st, &[after], &[], at(100), BOOT, &t);
            assert!(st.findings.is_empty(), "{name}: {:?}", st.findings);
        }

        // Missing from the device list and back.
        let all = hgx_h100();
        let seven: Vec<GpuSample> = all.iter().filter(|g| g.index != 1).cloned().collect();
        let st = run(
            &[(all.clone(), vec![xid(&all[1], 79, at(0))]), only(seven)],
            &t,
        );
        assert_eq!(st.findings.len(), 2, "{:?}", st.findings);
        let st = evaluate(&st, &all, &[], at(100), BOOT, &t);
        assert!(st.findings.is_empty(), "{:?}", st.findings);
    }

    #[test]
    fn evidence_that_persists_keeps_the_finding_through_resets_and_reboots() {
        let t = Thresholds::default();
        let failed = GpuSample {
            remap_failure: Some(true),
            ..h100(0)
        };
        let st = run(&[only(vec![failed.clone()])], &t);
        // Driver reload (energy back to small) and a reboot: the failure flag is still set.
        let reloaded = GpuSample {
            energy_millijoules: Some(10),
            ..failed.clone()
        };
        let st = evaluate(&st, std::slice::from_ref(&reloaded), &[], at(10), BOOT, &t);
        let st = evaluate(&st, &[reloaded], &[], at(20), OTHER_BOOT, &t);
        let f = finding(&st, &failed.uuid, Rule::RowRemapFailure).expect("persists");
        assert_eq!(f.boot_id.as_deref(), Some(OTHER_BOOT));
        assert_eq!(f.since, at(0));
        assert_eq!(st.node, Health::Unhealthy);
    }

    #[test]
    fn new_evidence_after_a_reset_needs_another_reset() {
        let t = Thresholds::default();
        let g = h100(0);
        let st = run(&[(vec![g.clone()], vec![xid(&g, 79, at(0))])], &t);
        // Reset (energy back) and a new XID in the same sample: the XID wins.
        let reset = GpuSample {
            energy_millijoules: Some(1),
            ..g.clone()
        };
        let st = evaluate(
            &st,
            std::slice::from_ref(&reset),
            &[xid(&g, 79, at(20))],
            at(20),
            BOOT,
            &t,
        );
        let st = evaluate(&st, &[reset], &[], at(30), BOOT, &t);
        assert!(finding(&st, &g.uuid, Rule::Xid).is_some());
    }

    #[test]
    fn degraded_findings_are_sticky_too() {
        let t = Thresholds::default();
        let hot = GpuSample {
            clocks_event_reasons: Some(0x40),
            ..h100(0)
        };
        let cool = h100(0);
        let mut steps: Vec<_> = (0..3).map(|_| only(vec![hot.clone()])).collect();
        steps.extend((0..10).map(|_| only(vec![cool.clone()])));
        let st = run(&steps, &t);
        assert_eq!(
            rules(&st),
            vec![(Rule::ClocksThrottled, Severity::Degraded)]
        );
        assert_eq!(st.node, Health::Degraded);
        let st = evaluate(&st, &[cool], &[], at(1000), OTHER_BOOT, &t);
        assert!(st.findings.is_empty());
    }

    #[test]
    fn operator_clear_drops_findings_but_evidence_returns() {
        let t = Thresholds::default();
        let g = h100(0);
        let pending = GpuSample {
            remap_pending: Some(true),
            ..g.clone()
        };
        let other = h100(1);
        let mut st = run(
            &[(
                vec![pending.clone(), other.clone()],
                vec![xid(&other, 79, at(0))],
            )],
            &t,
        );
        assert_eq!(st.findings.len(), 2);
        assert_eq!(st.clear_severity(Severity::Unhealthy), 2);
        assert!(st.findings.is_empty());
        assert_eq!(st.node, Health::Healthy);
        let st = evaluate(
            &st,
            &[pending.clone(), other.clone()],
            &[],
            at(10),
            BOOT,
            &t,
        );
        assert_eq!(
            rules(&st),
            vec![(Rule::RowRemapPending, Severity::Unhealthy)]
        );
        assert_eq!(st.findings[0].uuid, g.uuid);
    }

    #[test]
    fn conditions_name_gpus_evidence_and_boot_id() {
        let t = Thresholds::default();
        let gpus = hgx_h100();
        let mut broken = gpus.clone();
        broken[3].remap_pending = Some(true);
        let hot = GpuSample {
            clocks_event_reasons: Some(0x8),
            ..gpus[6].clone()
        };
        broken[6] = hot;
        let st = run(
            &[
                (broken.clone(), vec![xid(&gpus[3], 79, at(0))]),
                only(broken.clone()),
                only(broken.clone()),
            ],
            &t,
        );
        let c = node_conditions(&st, BOOT);
        assert!(c.unhealthy.active);
        assert_eq!(c.unhealthy.reason, REASON_MULTIPLE);
        assert_eq!(
            c.unhealthy.message,
            format!(
                "[XidError] {u} (gpu 3, since 2025-03-01T12:00:00Z): XID 79 (GPU has fallen off the bus); \
                 [RowRemapPending] {u} (gpu 3, since 2025-03-01T12:00:00Z): row remap pending (remapped rows: 0 uncorrectable, 0 correctable): GPU reset required; \
                 boot_id={BOOT}",
                u = gpus[3].uuid
            )
        );
        assert!(c.degraded.active);
        assert_eq!(c.degraded.reason, "ClocksThrottled");
        assert!(c.degraded.message.contains(&gpus[6].uuid));
        assert!(c.degraded.message.ends_with(&format!("; boot_id={BOOT}")));

        let healthy = node_conditions(&run(&[only(gpus)], &t), BOOT);
        assert!(!healthy.unhealthy.active && !healthy.degraded.active);
        assert_eq!(healthy.unhealthy.reason, REASON_NONE);
    }

    #[test]
    fn conditions_round_trip_into_resumed_findings() {
        let t = Thresholds::default();
        let gpus = hgx_h100();
        let mut broken = gpus.clone();
        broken[1].ecc_uncorrected_volatile = Some(3);
        broken[4].recovery_action = Some(RecoveryAction::DrainP2p);
        let t8 = Thresholds {
            expected_gpus: Some(9),
            ..t.clone()
        };
        let st = run(
            &[(
                broken.clone(),
                vec![xid(&gpus[2], 48, at(0)), xid(&gpus[2], 120, at(1))],
            )],
            &t8,
        );
        let resumed = previous_from_conditions(&node_conditions(&st, BOOT));
        assert_eq!(resumed.boot_id.as_deref(), Some(BOOT));
        let strip = |f: &Finding| {
            (
                f.uuid.clone(),
                f.gpu,
                f.rule,
                f.severity,
                f.evidence.clone(),
                f.since,
                f.boot_id.clone(),
                f.codes.clone(),
            )
        };
        assert_eq!(
            resumed.findings.iter().map(strip).collect::<Vec<_>>(),
            st.findings.iter().map(strip).collect::<Vec<_>>()
        );
        assert!(resumed.findings.iter().all(|f| !f.evidence_active));
        assert_eq!(resumed.node, Health::Unhealthy);
    }

    #[test]
    fn resumed_findings_survive_a_restart_and_clear_after_a_reboot() {
        let t = Thresholds::default();
        let g = h100(0);
        let st = run(&[(vec![g.clone()], vec![xid(&g, 79, at(0))])], &t);
        let conditions = node_conditions(&st, BOOT);

        // Agent restarted, same boot: clean samples do not clear it.
        let mut resumed = previous_from_conditions(&conditions);
        for i in 0..5 {
            resumed = evaluate(
                &resumed,
                std::slice::from_ref(&g),
                &[],
                at(100 + i),
                BOOT,
                &t,
            );
        }
        assert!(finding(&resumed, &g.uuid, Rule::Xid).is_some());
        assert_eq!(node_conditions(&resumed, BOOT), conditions);

        // Agent restarted after a reboot: cleared.
        let rebooted = evaluate(
            &previous_from_conditions(&conditions),
            &[g],
            &[],
            at(200),
            OTHER_BOOT,
            &t,
        );
        assert!(rebooted.findings.is_empty());
        assert!(!node_conditions(&rebooted, OTHER_BOOT).unhealthy.active);
    }

    #[test]
    fn an_unparsable_condition_is_kept_not_dropped() {
        let c = GpuConditions {
            unhealthy: ConditionState {
                active: true,
                reason: "SomethingElse".into(),
                message: "set by hand; GPU 3 is bad".into(),
            },
            degraded: ConditionState::default(),
        };
        let st = previous_from_conditions(&c);
        assert_eq!(rules(&st), vec![(Rule::Resumed, Severity::Unhealthy)]);
        assert_eq!(st.findings[0].boot_id, None);
        let t = Thresholds::default();
        let st = evaluate(&st, &[h100(0)], &[], at(0), OTHER_BOOT, &t);
        assert_eq!(
            st.node,
            Health::Unhealthy,
            "unknown boot: kept until an operator clears it"
        );
        assert!(node_conditions(&st, OTHER_BOOT)
            .unhealthy
            .message
            .contains("GPU 3 is bad"));
        assert!(previous_from_conditions(&GpuConditions::default())
            .findings
            .is_empty());
    }

    #[test]
    fn thresholds_validate_and_deserialize() {
        assert!(Thresholds::default().validate().is_ok());
        let overlap = Thresholds {
            app_xids: vec![13, 79],
            ..Thresholds::default()
        };
        let e = overlap.validate().expect_err("79 in both lists");
        assert!(e.to_string().contains("gpu.thresholds.app_xids"), "{e}");
        let bad_reason = Thresholds {
            throttle_reasons: vec!["hot".into()],
            ..Thresholds::default()
        };
        let e = bad_reason.validate().expect_err("unknown reason");
        assert!(e.to_string().contains("\"hot\""), "{e}");
        let t: Thresholds = toml::from_str(
            "ecc_correctable_max = 5\nthrottle_samples = 1\nnvlink_window = \"10m\"\nexpected_gpus = 8",
        )
        .expect("toml");
        assert_eq!(t.ecc_correctable_max, 5);
        assert_eq!(t.nvlink_window, Duration::from_secs(600));
        assert_eq!(t.expected_gpus, Some(8));
        assert_eq!(t.reset_xids, Thresholds::default().reset_xids);
    }

    mod property {
        use proptest::prelude::*;

        use super::*;

        /// One later observation that carries no reset or reboot evidence: counters only grow,
        /// flags only go up, a lost or missing GPU stays so.
        #[derive(Clone, Debug)]
        struct Step {
            temp: u32,
            reasons: u64,
            corrected: u64,
            uncorrected_agg: u64,
            nvlink: u64,
            energy: u64,
            pending: bool,
            lost: bool,
            missing: bool,
            recovery: u8,
            events: Vec<(bool, u64)>,
            gap_secs: i64,
        }

        fn step() -> impl Strategy<Value = Step> {
            (
                (
                    20u32..95,
                    any::<u16>(),
                    0u64..500,
                    0u64..3,
                    0u64..500,
                    0u64..10_000_000,
                ),
                (
                    prop::bool::weighted(0.1),
                    prop::bool::weighted(0.03),
                    prop::bool::weighted(0.03),
                    0u8..5,
                ),
                prop::collection::vec(
                    (
                        any::<bool>(),
                        prop::sample::select(vec![13u64, 31, 43, 45, 48, 63, 74, 79, 92, 999]),
                    ),
                    0..4,
                ),
                1i64..5000,
            )
                .prop_map(
                    |(
                        (temp, reasons, corrected, unc, nvlink, energy),
                        (pending, lost, missing, recovery),
                        events,
                        gap_secs,
                    )| Step {
                        temp,
                        reasons: u64::from(reasons) & 0x1ff,
                        corrected,
                        uncorrected_agg: unc,
                        nvlink,
                        energy,
                        pending,
                        lost,
                        missing,
                        recovery,
                        events,
                        gap_secs,
                    },
                )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

            #[test]
            fn unhealthy_never_clears_without_reset_or_reboot(
                first_xid in prop::sample::select(Thresholds::default().reset_xids),
                steps in prop::collection::vec(step(), 1..40),
            ) {
                let t = Thresholds::default();
                let target = h100(0);
                let other = h100(1);
                let mut now = at(0);
                let mut st = evaluate(
                    &HealthState::default(),
                    &[target.clone(), other.clone()],
                    &[xid(&target, first_xid, now)],
                    now, BOOT, &t,
                );
                prop_assert!(finding(&st, &target.uuid, Rule::Xid).is_some());

                let mut s = target.clone();
                let (mut pending, mut lost, mut missing) = (false, false, false);
                let mut recovery_reset = false;
                for step in steps {
                    now = now.checked_add(jiff::SignedDuration::from_secs(step.gap_secs)).expect("time");
                    pending |= step.pending;
                    lost |= step.lost;
                    missing |= step.missing;
                    s.temperature_celsius = Some(step.temp);
                    s.clocks_event_reasons = Some(step.reasons);
                    s.ecc_corrected_volatile = s.ecc_corrected_volatile.map(|c| c + step.corrected);
                    s.ecc_corrected_aggregate = s.ecc_corrected_aggregate.map(|c| c + step.corrected);
                    s.ecc_uncorrected_aggregate = s.ecc_uncorrected_aggregate.map(|c| c + step.uncorrected_agg);
                    s.energy_millijoules = s.energy_millijoules.map(|e| e + step.energy);
                    s.remap_pending = Some(pending);
                    for l in &mut s.nvlinks {
                        l.crc_flit = l.crc_flit.map(|c| c + step.nvlink);
                    }
                    // Once the driver asked for a reset it never goes back to none here.
                    let action = RecoveryAction::from_nvml(u64::from(step.recovery)).unwrap_or(RecoveryAction::None);
                    recovery_reset |= action.needs_reset();
                    s.recovery_action = Some(if recovery_reset && !action.needs_reset() { RecoveryAction::Reset } else { action });
                    let mut reading = s.clone();
                    if lost {
                        reading = GpuSample { uuid: s.uuid.clone(), index: 0, model: s.model.clone(), lost: true, ..GpuSample::default() };
                    }
                    let mut snapshot = vec![other.clone()];
                    if !missing {
                        snapshot.insert(0, reading);
                    }
                    let events: Vec<GpuEvent> = step.events.iter()
                        .map(|(on_target, code)| xid(if *on_target { &target } else { &other }, *code, now))
                        .collect();
                    st = evaluate(&st, &snapshot, &events, now, BOOT, &t);
                    let f = finding(&st, &target.uuid, Rule::Xid);
                    prop_assert!(f.is_some(), "cleared without reset: {:?}", st.findings);
                    prop_assert_eq!(st.node, Health::Unhealthy);
                    prop_assert_eq!(st.gpus[&target.uuid].health, Health::Unhealthy);
                    let c = node_conditions(&st, BOOT);
                    prop_assert!(c.unhealthy.active);
                    prop_assert!(c.unhealthy.message.contains(&target.uuid));
                }
            }
        }
    }
}
