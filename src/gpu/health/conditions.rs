//! Node conditions: the findings written into `GPUUnhealthy` / `GPUDegraded`
//! ([`node_conditions`]) and read back after an agent restart ([`previous_from_conditions`]).

use std::collections::BTreeSet;

use jiff::Timestamp;

use super::state::{sort_findings, HealthState};
use super::{Finding, Health, Rule, Severity, NODE_SCOPE, REASON_MULTIPLE, REASON_NONE};
use crate::node::{ConditionState, GpuConditions};

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
/// findings come back with their evidence marked inactive: the next [`evaluate`](super::evaluate) re-observes
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

/// Evidence goes into a `; `-separated condition message: keep it to one line without `;`.
pub(super) fn sanitize(text: &str) -> String {
    text.replace(['\n', '\r'], " ").replace(';', ",")
}
