//! Undoing what spotguard applied: a cancelled or expired notice, a previous life of the machine.

use super::*;

/// Undoes what spotguard did for a notice (cancel, expiry, a previous life of the machine).
#[derive(Clone)]
pub(super) struct Undoer {
    pub(super) deps: Arc<Deps>,
    pub(super) records: Records,
    pub(super) events: broadcast::Sender<PlanEvent>,
}

impl Undoer {
    /// Remove exactly what `state.applied` says spotguard did. `true` when nothing is left to undo.
    pub(super) async fn unprotect(&self, state: &PlanState, why: &str, event_reason: &str) -> bool {
        let node = &self.deps.node;
        match node.unprotect(&state.applied).await {
            Ok(()) => {
                self.deps.metrics.action("unprotect", true);
                let msg = format!(
                    "{} {} {why}: removed what spotguard applied (cordon: {}, taint: {})",
                    state.kind.label(),
                    state.id,
                    state.applied.cordoned,
                    state
                        .applied
                        .taint_effect
                        .map(|e| e.as_str())
                        .unwrap_or("none"),
                );
                info!(notice_id = %state.id, "{msg}");
                let budget = SIDE_BUDGET_MAX;
                let _ =
                    tokio::time::timeout(budget, node.event(EventType::Normal, event_reason, &msg))
                        .await;
                true
            }
            Err(e) => {
                self.deps.metrics.action("unprotect", false);
                error!(notice_id = %state.id, error = %e, "undo failed");
                false
            }
        }
    }

    /// A cancelled or expired notice: undo, then clear its plan from the record, except for a rebalance
    /// recommendation: the metadata service keeps serving it until the instance dies, so an
    /// `undone` record keeps a restarted agent from acting on it again.
    pub(super) async fn undo(&self, id: &str, why: &str) {
        let loaded = self.records.load_all().await;
        let found = loaded
            .latest
            .into_iter()
            .chain(loaded.earlier)
            .find(|s| s.id == id && s.phase != Phase::Undone);
        let state = match found {
            Some(s) => s,
            None => {
                info!(notice_id = %id, "nothing persisted to undo");
                return;
            }
        };
        if !self.unprotect(&state, why, reason::NOTICE_CANCELLED).await {
            return;
        }
        if state.kind == NoticeKind::Rebalance {
            let mut s = state;
            s.phase = Phase::Undone;
            s.applied = Applied::default();
            s.boot_id = self.deps.life.id();
            s.updated_at = Timestamp::now();
            self.records.save(&s, SIDE_BUDGET_MAX).await;
        } else {
            // Only this plan: what the other kinds did in this life stays recorded.
            self.records.clear_plan(id, SIDE_BUDGET_MAX).await;
        }
        let _ = self.events.send(PlanEvent::Undone {
            id: id.to_string(),
            at: Timestamp::now(),
        });
    }

    /// A record from a previous life of the machine: undo what spotguard applied then (never an
    /// operator's cordon), clear the record, and arm again.
    pub(super) async fn previous_life(&self, state: PlanState) {
        info!(notice_id = %state.id, phase = state.phase.as_str(), "the machine has rebooted since this plan: undoing what spotguard applied and arming again");
        // The record and the node's own marks together: a crash between a protect patch and
        // the record loses nothing.
        // Bounded: an API outage at start-up must not keep the agent from arming.
        let marks = match tokio::time::timeout(LOAD_BUDGET, self.deps.node.applied_marks()).await {
            Ok(Ok(m)) => m,
            _ => Default::default(),
        };
        let mut state = state;
        state.applied.cordoned |= marks.cordoned;
        let mut effects: Vec<TaintEffect> = state.applied.taint_effect.into_iter().collect();
        for e in marks.taints {
            if !effects.contains(&e) {
                effects.push(e);
            }
        }
        let why = "belongs to a previous life of the machine (it rebooted since)";
        let undo_all = async {
            let mut undone = true;
            let mut first = true;
            for effect in effects.iter().copied().map(Some).chain(
                // Nothing tainted: still undo a cordon.
                effects.is_empty().then_some(None),
            ) {
                let mut one = state.clone();
                one.applied = Applied {
                    cordoned: first && state.applied.cordoned,
                    taint_effect: effect,
                };
                first = false;
                undone &= self.unprotect(&one, why, reason::PREVIOUS_LIFE).await;
            }
            undone
        };
        let undone = tokio::time::timeout(SIDE_BUDGET_MAX, undo_all)
            .await
            .unwrap_or(false);
        if !undone {
            // Keep the record so that the next start tries again; the agent is armed anyway
            // (nothing of it is restored into the store).
            warn!(notice_id = %state.id, "could not undo the previous life's cordon/taint now; the next start tries again");
            self.deps.metrics.error("responder", "previous_life_undo");
            return;
        }
        self.records.clear_plan(&state.id, SIDE_BUDGET_MAX).await;
        self.deps.metrics.action("previous_life_cleared", true);
        let _ = self.events.send(PlanEvent::Undone {
            id: state.id,
            at: Timestamp::now(),
        });
    }
}
