//! What the policy asks of a plan for a notice: taint, cordon, checkpoint, drain.

use super::ResponderConfig;
use crate::config::{MaintenanceAction, RebalanceAction};
use crate::node::{reason, TaintEffect};
use crate::notice::{MaintenanceKind, Notice, NoticeKind};

/// What the policy asks of a plan: the steps look here to know whether they apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Policy {
    /// Taint `spotguard.io/interruption` with this effect.
    pub(super) taint: Option<TaintEffect>,
    /// Also mark the node unschedulable.
    pub(super) cordon: bool,
    /// Signal the checkpoint targets and wait for their acks.
    pub(super) checkpoint: bool,
    /// Drain the node before the deadline.
    pub(super) drain: bool,
}

/// The policy for `notice` (`--on-rebalance`, `--on-maintenance`, `--on-azure-freeze`); `None`
/// when it says ignore.
pub(super) fn policy_for(notice: &Notice, cfg: &ResponderConfig) -> Option<Policy> {
    let full = Policy {
        taint: Some(TaintEffect::NoSchedule),
        cordon: true,
        checkpoint: true,
        drain: true,
    };
    let maintenance = if notice.maintenance == MaintenanceKind::Freeze {
        cfg.on_azure_freeze
    } else {
        cfg.on_maintenance
    };
    match &notice.kind {
        NoticeKind::Interruption => Some(full),
        NoticeKind::Maintenance => match maintenance {
            MaintenanceAction::Ignore => None,
            MaintenanceAction::Cordon => Some(Policy {
                checkpoint: false,
                drain: false,
                ..full
            }),
            MaintenanceAction::Drain => Some(full),
        },
        NoticeKind::Rebalance => match cfg.on_rebalance {
            RebalanceAction::Ignore => None,
            RebalanceAction::Cordon => Some(Policy {
                taint: Some(TaintEffect::PreferNoSchedule),
                cordon: true,
                checkpoint: false,
                drain: false,
            }),
            RebalanceAction::Checkpoint => Some(Policy {
                taint: Some(TaintEffect::PreferNoSchedule),
                cordon: false,
                checkpoint: true,
                drain: false,
            }),
            RebalanceAction::Drain => Some(full),
        },
        NoticeKind::Cancelled(_) => None,
    }
}

/// The reason of the Event a notice's plan emits on the node.
pub(super) fn event_reason(kind: &NoticeKind) -> &'static str {
    match kind {
        NoticeKind::Interruption => reason::SPOT_INTERRUPTION,
        NoticeKind::Rebalance => reason::REBALANCE,
        NoticeKind::Maintenance => reason::MAINTENANCE,
        NoticeKind::Cancelled(_) => reason::NOTICE_CANCELLED,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use jiff::Timestamp;

    use super::*;
    use crate::notice::Cloud;

    fn cfg() -> ResponderConfig {
        ResponderConfig {
            on_rebalance: RebalanceAction::Checkpoint,
            rebalance_expiry: Duration::from_secs(1800),
            on_maintenance: MaintenanceAction::Drain,
            on_azure_freeze: MaintenanceAction::Ignore,
            maintenance_lead: Duration::from_secs(600),
            checkpoint_timeout: Duration::from_secs(90),
            drain_reserve: None,
            force_delete_at_deadline: false,
            drain_concurrency: 8,
            dry_run: false,
            shutdown_grace: Duration::from_secs(5),
            resume_hold: Duration::from_secs(10),
            node_name: None,
        }
    }

    #[test]
    fn steps_follow_the_policies() {
        let c = cfg();
        let n = |kind: NoticeKind, detail: &str| Notice {
            id: "n".into(),
            kind,
            source: Cloud::Azure,
            deadline: None,
            not_before: None,
            detail: detail.into(),
            restart: false,
            published_at: None,
            // As the Azure source types it.
            maintenance: Cloud::Azure.maintenance_of_detail(detail),
            observed_at: Timestamp::now(),
            cloud_event_id: None,
        };
        let s = policy_for(&n(NoticeKind::Interruption, ""), &c).unwrap();
        assert!(s.cordon && s.checkpoint && s.drain);
        assert_eq!(s.taint, Some(TaintEffect::NoSchedule));
        let r = policy_for(&n(NoticeKind::Rebalance, ""), &c).unwrap();
        assert_eq!(r.taint, Some(TaintEffect::PreferNoSchedule));
        assert!(r.checkpoint && !r.drain && !r.cordon);
        let mut c2 = c.clone();
        c2.on_rebalance = RebalanceAction::Ignore;
        assert!(policy_for(&n(NoticeKind::Rebalance, ""), &c2).is_none());
        c2.on_maintenance = MaintenanceAction::Cordon;
        let m = policy_for(
            &n(NoticeKind::Maintenance, "Reboot (Scheduled, Platform): x"),
            &c2,
        )
        .unwrap();
        assert!(m.cordon && !m.checkpoint && !m.drain);
        // Azure Freeze follows its own policy (default ignore), not --on-maintenance.
        let freeze = n(
            NoticeKind::Maintenance,
            "Freeze (Scheduled, Platform): pause",
        );
        assert!(policy_for(&freeze, &c).is_none());
        let mut c3 = c.clone();
        c3.on_azure_freeze = MaintenanceAction::Cordon;
        let f = policy_for(&freeze, &c3).unwrap();
        assert!(f.cordon && !f.checkpoint && !f.drain);
        assert_eq!(c.reserve(Cloud::Aws), Duration::from_secs(25));
        assert_eq!(c.reserve(Cloud::Gce), Duration::from_secs(8));
    }
}
