//! Stickiness: what the evaluator remembers between two evaluations (per GPU: the previous
//! sample of this boot and the rule windows; the findings) and how the observations of one
//! evaluation raise, keep and clear findings ([`apply`]).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use jiff::Timestamp;

use super::conditions::sanitize;
use super::rules::{xid_evidence, Observation};
use super::{Finding, Health, Rule, Severity};
use crate::gpu::GpuSample;

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
    pub(super) corrected: VecDeque<(Timestamp, u64)>,
    /// Positive deltas of the NVLink error counters (sum over links).
    pub(super) nvlink: VecDeque<(Timestamp, u64)>,
    /// Application-class XIDs.
    pub(super) app_xids: VecDeque<(Timestamp, u64)>,
    pub(super) throttle_streak: u32,
    pub(super) links_seen_up: BTreeSet<u32>,
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

/// Everything [`evaluate`](super::evaluate) remembers between two evaluations.
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
    /// Start an evaluation in boot `boot_id`. After a reboot, counters, windows and "seen this
    /// boot" describe the previous boot: forget them, and the GPUs without findings.
    pub(super) fn enter_boot(&mut self, boot_id: &str) {
        let rebooted = self.boot_id.as_deref().is_some_and(|b| b != boot_id);
        if rebooted {
            let with_findings: BTreeSet<String> =
                self.findings.iter().map(|f| f.uuid.clone()).collect();
            self.gpus.retain(|uuid, _| with_findings.contains(uuid));
            for track in self.gpus.values_mut() {
                track.forget_boot();
                track.present = false;
            }
        }
        self.boot_id = Some(boot_id.to_string());
    }

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

pub(super) fn apply(
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

pub(super) fn sort_findings(findings: &mut [Finding]) {
    findings.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then_with(|| a.uuid.cmp(&b.uuid))
            .then_with(|| a.rule.cmp(&b.rule))
    });
}

pub(super) fn recompute_health(st: &mut HealthState) {
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
