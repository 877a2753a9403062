//! GPU health on the node: conditions (`GPUUnhealthy` / `GPUDegraded`, optionally a
//! Ready-polarity one) through a strategic-merge patch of `nodes/status` (merge key `type`, so the
//! kubelet's conditions are untouched), the taint `spotguard.io/gpu-unhealthy:NoSchedule` while
//! unhealthy, and an Event per transition.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use kube::api::Patch;
use serde_json::{json, Value};

use super::{node_taints, taints_value, KubeNodeOps};
use crate::node::{reason, ConditionState, Error, EventType, GpuConditions, GPU_UNHEALTHY_TAINT};

impl KubeNodeOps {
    /// The GPU conditions as the node shows them.
    pub(super) async fn read_gpu_conditions(&self) -> Result<GpuConditions, Error> {
        let node = self.get_node().await?;
        let get = |t: &str| {
            find_condition(&node, t)
                .map(condition_state)
                .unwrap_or_default()
        };
        Ok(GpuConditions {
            unhealthy: get(&self.gpu_types.unhealthy),
            degraded: get(&self.gpu_types.degraded),
        })
    }

    /// Show `desired`: patch the conditions that differ, set or clear the GPU taint, and emit an
    /// Event per transition.
    pub(super) async fn write_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error> {
        let node = self.get_node().await?;
        let now = Timestamp::now();
        let mut patches = Vec::new();
        let mut transitions: Vec<(EventType, &str, String)> = Vec::new();
        let mut recovered: Vec<&str> = Vec::new();
        for wanted in self.wanted_conditions(desired) {
            let Some((patch, was_active)) = condition_patch(&node, &wanted, now) else {
                continue;
            };
            patches.push(patch);
            if !wanted.with_events {
                continue;
            }
            let want = wanted.state;
            if want.active && !was_active {
                let r = if wanted.type_ == self.gpu_types.unhealthy {
                    reason::GPU_UNHEALTHY
                } else {
                    reason::GPU_DEGRADED
                };
                transitions.push((EventType::Warning, r, want.message.clone()));
            } else if !want.active && was_active {
                recovered.push(wanted.type_);
            }
        }
        if !recovered.is_empty() {
            transitions.push((
                EventType::Normal,
                reason::GPU_RECOVERED,
                format!("{} cleared", recovered.join(", ")),
            ));
        }
        self.patch_conditions(patches).await?;
        self.sync_gpu_taint(&node, desired.unhealthy.active).await?;
        for (kind, r, message) in transitions {
            if let Err(e) = self.emit_node_event(kind, r, &message).await {
                tracing::warn!(node = %self.node_name, reason = r, error = %e, "could not emit GPU event");
            }
        }
        Ok(())
    }

    /// The conditions to show for `desired`: unhealthy and degraded (with Events on change), and
    /// the Ready-polarity one when configured (no Events).
    fn wanted_conditions<'a>(&'a self, desired: &'a GpuConditions) -> Vec<WantedCondition<'a>> {
        let mut wanted = vec![
            WantedCondition {
                type_: &self.gpu_types.unhealthy,
                state: &desired.unhealthy,
                ready_polarity: false,
                with_events: true,
            },
            WantedCondition {
                type_: &self.gpu_types.degraded,
                state: &desired.degraded,
                ready_polarity: false,
                with_events: true,
            },
        ];
        if let Some(ready) = &self.gpu_types.ready {
            wanted.push(WantedCondition {
                type_: ready,
                state: &desired.unhealthy,
                ready_polarity: true,
                with_events: false,
            });
        }
        wanted
    }

    /// One strategic-merge patch of `nodes/status` with `patches` (none: nothing to write).
    async fn patch_conditions(&self, patches: Vec<Value>) -> Result<(), Error> {
        if patches.is_empty() {
            return Ok(());
        }
        if self.dry_run {
            let conditions = Value::Array(patches);
            tracing::info!(node = %self.node_name, conditions = %conditions, "dry-run: would patch node conditions");
            return Ok(());
        }
        let patch = json!({ "status": { "conditions": patches } });
        let result = self
            .patch_blind("conditions", true, Patch::Strategic(patch))
            .await;
        self.count("condition", &result);
        result
    }

    /// Set the GPU taint when `unhealthy`, clear it otherwise (no write when `node` already
    /// shows it so).
    async fn sync_gpu_taint(&self, node: &Node, unhealthy: bool) -> Result<(), Error> {
        let has_taint = node_taints(node)
            .iter()
            .any(|t| t.key == GPU_UNHEALTHY_TAINT && t.effect == "NoSchedule");
        if unhealthy != has_taint {
            self.set_taint(GPU_UNHEALTHY_TAINT, None, "NoSchedule", unhealthy)
                .await?;
        }
        Ok(())
    }

    /// Add (`present`) or remove a taint `key:effect` through an RV-guarded write.
    async fn set_taint(
        &self,
        key: &str,
        value: Option<&str>,
        effect: &str,
        present: bool,
    ) -> Result<bool, Error> {
        let what = if present { "taint" } else { "untaint" };
        let out = self
            .modify_node(what, |node| {
                let taints = node_taints(node);
                let has = taints.iter().any(|t| t.key == key && t.effect == effect);
                if has == present {
                    return None;
                }
                let new: Vec<Taint> = if present {
                    let mut t = taints.clone();
                    t.push(Taint {
                        key: key.to_string(),
                        value: value.map(str::to_string),
                        effect: effect.to_string(),
                        time_added: None,
                    });
                    t
                } else {
                    taints
                        .iter()
                        .filter(|t| !(t.key == key && t.effect == effect))
                        .cloned()
                        .collect()
                };
                Some((json!({ "spec": { "taints": taints_value(&new) } }), ()))
            })
            .await;
        self.count(what, &out);
        Ok(out?.applied.is_some())
    }
}

/// One GPU condition to show: its type, the state wanted, whether it reads with Ready polarity
/// (status False = problem present), whether its changes are told by Events.
struct WantedCondition<'a> {
    type_: &'a str,
    state: &'a ConditionState,
    ready_polarity: bool,
    with_events: bool,
}

/// The patch entry that shows `wanted` on `node`, with whether it was active before; `None` when
/// the node already shows it (or never showed it and it is not active).
fn condition_patch(node: &Node, wanted: &WantedCondition, now: Timestamp) -> Option<(Value, bool)> {
    let want = wanted.state;
    let current = find_condition(node, wanted.type_);
    let current_state = current.map(|c| {
        let mut state = condition_state(c);
        if wanted.ready_polarity {
            state.active = c.status == "False";
        }
        state
    });
    let unchanged = match &current_state {
        Some(c) => c == want,
        // Never shown: nothing to say while healthy.
        None => !want.active,
    };
    if unchanged {
        return None;
    }
    let was_active = current_state.as_ref().is_some_and(|c| c.active);
    let transition_time = match current {
        Some(c) if was_active == want.active => {
            c.last_transition_time.as_ref().map(|t| t.0).unwrap_or(now)
        }
        _ => now,
    };
    let status = if want.active != wanted.ready_polarity {
        "True"
    } else {
        "False"
    };
    let patch = json!({
        "type": wanted.type_,
        "status": status,
        "reason": if want.reason.is_empty() { Value::Null } else { json!(want.reason) },
        "message": if want.message.is_empty() { Value::Null } else { json!(want.message) },
        "lastTransitionTime": transition_time.to_string(),
        "lastHeartbeatTime": now.to_string(),
    });
    Some((patch, was_active))
}

fn find_condition<'a>(node: &'a Node, type_: &str) -> Option<&'a NodeCondition> {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
}

fn condition_state(c: &NodeCondition) -> ConditionState {
    ConditionState {
        active: c.status == "True",
        reason: c.reason.clone().unwrap_or_default(),
        message: c.message.clone().unwrap_or_default(),
    }
}
