//! Injected faults: what they are, how they are matched against requests, and how they run out.
//!
//! Faults apply to the emulated metadata paths only, never to `/spotguard/*`, so a test can always
//! inspect and clear them (except `down`, which closes the listener itself).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::Error;

/// What a fault does to a matching request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FaultKind {
    /// Answer with this status (4xx/5xx, default 500) and a short body.
    Error {
        #[serde(default = "default_status")]
        status: u16,
    },
    /// Hold the request for `delay`, then answer normally.
    Stall {
        #[serde(with = "crate::duration::serde_str")]
        delay: Duration,
    },
    /// Close the connection without answering.
    Drop,
    /// Answer 200 with a malformed body (protocol headers kept).
    Garbage,
    /// Invalidate every EC2 session token now (the next GETs get 401).
    ExpireTokens,
    /// Refuse connections: close the listener and every open connection.
    Down,
    /// Remove every fault and bring the listener back.
    Clear,
}

fn default_status() -> u16 {
    500
}

/// A fault: a kind, how long it lasts, and which paths it hits.
///
/// Without `count` and `duration` a fault lasts until cleared. JSON (`POST /spotguard/fault`):
/// `{"kind": "error", "status": 503, "count": 3, "path": "/latest/meta-data/spot"}`,
/// `{"kind": "stall", "delay": "5s", "for": "30s"}`, `{"kind": "down", "for": "3s"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    #[serde(flatten)]
    pub kind: FaultKind,
    /// Hit at most this many requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// Stay active this long.
    #[serde(
        rename = "for",
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::duration::serde_opt"
    )]
    pub duration: Option<Duration>,
    /// Only requests whose path starts with this prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

impl Fault {
    pub fn new(kind: FaultKind) -> Self {
        Fault {
            kind,
            count: None,
            duration: None,
            path: None,
        }
    }

    pub fn error(status: u16) -> Self {
        Self::new(FaultKind::Error { status })
    }

    pub fn stall(delay: Duration) -> Self {
        Self::new(FaultKind::Stall { delay })
    }

    pub fn drop_connections() -> Self {
        Self::new(FaultKind::Drop)
    }

    pub fn garbage() -> Self {
        Self::new(FaultKind::Garbage)
    }

    pub fn expire_tokens() -> Self {
        Self::new(FaultKind::ExpireTokens)
    }

    pub fn down() -> Self {
        Self::new(FaultKind::Down)
    }

    pub fn clear() -> Self {
        Self::new(FaultKind::Clear)
    }

    pub fn times(mut self, count: u32) -> Self {
        self.count = Some(count);
        self
    }

    pub fn lasting(mut self, duration: Duration) -> Self {
        self.duration = Some(duration);
        self
    }

    pub fn on_path(mut self, prefix: impl Into<String>) -> Self {
        self.path = Some(prefix.into());
        self
    }

    /// Parse a control-surface body, rejecting unknown keys (a typo must not silently turn a
    /// counted fault into a permanent one).
    pub(super) fn from_json(value: serde_json::Value) -> Result<Self, Error> {
        const KEYS: &[&str] = &["kind", "status", "delay", "count", "for", "path"];
        let obj = value.as_object().ok_or_else(|| Error::InvalidFault {
            reason: "body must be a JSON object".to_owned(),
        })?;
        if let Some(key) = obj.keys().find(|k| !KEYS.contains(&k.as_str())) {
            return Err(Error::InvalidFault {
                reason: format!("unknown field {key:?} (expected one of {KEYS:?})"),
            });
        }
        serde_json::from_value(value).map_err(|e| Error::InvalidFault {
            reason: e.to_string(),
        })
    }

    pub(super) fn validate(&self, origin: Origin) -> Result<(), Error> {
        let invalid = |reason: &str| {
            Err(Error::InvalidFault {
                reason: reason.to_owned(),
            })
        };
        if self.count == Some(0) {
            return invalid("count must be at least 1");
        }
        match &self.kind {
            FaultKind::Error { status } if !(400..=599).contains(status) => {
                invalid("status must be a 4xx or 5xx code")
            }
            FaultKind::Down if self.count.is_some() => {
                invalid("down takes a duration (\"for\"), not a count")
            }
            FaultKind::Down if origin == Origin::Http && self.duration.is_none() => invalid(
                "down over HTTP needs \"for\": the control endpoint is unreachable while down",
            ),
            _ => Ok(()),
        }
    }
}

/// Where a fault request came from (HTTP cannot clear an open-ended `down`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    Http,
    Handle,
}

/// What the server does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Error(u16),
    Stall(Duration),
    Drop,
    Garbage,
}

struct Active {
    action: Action,
    remaining: Option<u32>,
    until: Option<Instant>,
    path: Option<String>,
    spec: Fault,
}

/// The active per-request faults, first added first matched.
#[derive(Default)]
pub(super) struct Faults {
    active: Vec<Active>,
}

impl Faults {
    /// Register a per-request fault (`Error`, `Stall`, `Drop`, `Garbage`); other kinds are
    /// handled by the server and ignored here.
    pub(super) fn add(&mut self, fault: &Fault, now: Instant) {
        let action = match fault.kind {
            FaultKind::Error { status } => Action::Error(status),
            FaultKind::Stall { delay } => Action::Stall(delay),
            FaultKind::Drop => Action::Drop,
            FaultKind::Garbage => Action::Garbage,
            FaultKind::ExpireTokens | FaultKind::Down | FaultKind::Clear => return,
        };
        self.active.push(Active {
            action,
            remaining: fault.count,
            until: fault.duration.map(|d| now + d),
            path: fault.path.clone(),
            spec: fault.clone(),
        });
    }

    pub(super) fn clear(&mut self) {
        self.active.clear();
    }

    /// The action for a request to `path`, consuming one use of the matching fault.
    pub(super) fn take(&mut self, path: &str, now: Instant) -> Option<Action> {
        self.expire(now);
        let hit = self.active.iter_mut().find(|a| {
            a.path
                .as_deref()
                .is_none_or(|prefix| path.starts_with(prefix))
        })?;
        if let Some(n) = hit.remaining.as_mut() {
            *n = n.saturating_sub(1);
        }
        let action = hit.action;
        self.expire(now);
        Some(action)
    }

    fn expire(&mut self, now: Instant) {
        self.active
            .retain(|a| a.remaining != Some(0) && a.until.is_none_or(|t| now < t));
    }

    /// The active faults, with the uses left, for `/spotguard/state`.
    pub(super) fn describe(&mut self, now: Instant) -> Vec<Fault> {
        self.expire(now);
        self.active
            .iter()
            .map(|a| Fault {
                count: a.remaining,
                duration: a.until.map(|t| t.saturating_duration_since(now)),
                ..a.spec.clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_fault_runs_out_and_path_prefix_scopes_it() {
        let now = Instant::now();
        let mut faults = Faults::default();
        faults.add(
            &Fault::error(503).times(2).on_path("/latest/meta-data/spot"),
            now,
        );
        assert_eq!(faults.take("/latest/api/token", now), None);
        assert_eq!(
            faults.take("/latest/meta-data/spot/instance-action", now),
            Some(Action::Error(503))
        );
        assert_eq!(
            faults.take("/latest/meta-data/spot/instance-action", now),
            Some(Action::Error(503))
        );
        assert_eq!(
            faults.take("/latest/meta-data/spot/instance-action", now),
            None
        );
    }

    #[test]
    fn timed_fault_expires() {
        let now = Instant::now();
        let mut faults = Faults::default();
        faults.add(
            &Fault::drop_connections().lasting(Duration::from_secs(5)),
            now,
        );
        assert_eq!(
            faults.take("/x", now + Duration::from_secs(4)),
            Some(Action::Drop)
        );
        assert_eq!(faults.take("/x", now + Duration::from_secs(5)), None);
    }

    #[test]
    fn json_round_trip_and_typo_rejected() {
        let f = Fault::from_json(serde_json::json!({"kind": "stall", "delay": "2s", "count": 1}))
            .unwrap();
        assert_eq!(f, Fault::stall(Duration::from_secs(2)).times(1));
        let back = serde_json::to_value(&f).unwrap();
        assert_eq!(
            back,
            serde_json::json!({"kind": "stall", "delay": "2s", "count": 1})
        );
        let err = Fault::from_json(serde_json::json!({"kind": "drop", "cout": 1})).unwrap_err();
        assert!(err.to_string().contains("cout"), "{err}");
        let err = Fault::from_json(serde_json::json!({"kind": "down"}))
            .and_then(|f| f.validate(Origin::Http))
            .unwrap_err();
        assert!(err.to_string().contains("for"), "{err}");
        assert!(Fault::error(200).validate(Origin::Handle).is_err());
    }
}
