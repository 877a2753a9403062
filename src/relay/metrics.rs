//! Relay metrics, `spotguard_relay_*`: relays sent and received by outcome, bytes received, and
//! the receiver's refusals by reason. Every label value below exists at 0 from start-up.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// `outcome` of `spotguard_relay_sent_total`: how a relay to one peer ended, seen by the sender.
pub const SENT_OUTCOMES: &[&str] = &[
    "published",
    "already_published",
    "failed",
    "deadline",
    "refused",
    "cancelled",
];
/// `outcome` of `spotguard_relay_received_total`: how a reserved relay ended on the receiver.
pub const RECEIVED_OUTCOMES: &[&str] = &["published", "already_published", "failed", "aborted"];
/// `reason` of `spotguard_relay_refusals_total`: why the receiver refused a request.
pub const REFUSAL_REASONS: &[&str] = &[
    "auth",
    "bad_request",
    "tree",
    "location",
    "cap",
    "space",
    "crc",
];

/// Relay metric families.
#[derive(Debug, Default)]
pub struct RelayMetrics {
    /// `spotguard_relay_sent_total{outcome}`: relays to a peer ended (sender).
    pub sent: Family<OutcomeLabels, Counter>,
    /// `spotguard_relay_received_total{outcome}`: reserved relays ended (receiver).
    pub received: Family<OutcomeLabels, Counter>,
    /// `spotguard_relay_received_bytes_total`: file bytes received from senders.
    pub received_bytes: Counter,
    /// `spotguard_relay_refusals_total{reason}`: requests the receiver refused.
    pub refusals: Family<ReasonLabels, Counter>,
}

impl RelayMetrics {
    /// Create the families and register them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = RelayMetrics::default();
        registry.register(
            "spotguard_relay_sent",
            "Relays of staged checkpoints to a peer ended, by outcome",
            m.sent.clone(),
        );
        registry.register(
            "spotguard_relay_received",
            "Relays reserved by peers ended, by outcome",
            m.received.clone(),
        );
        registry.register(
            "spotguard_relay_received_bytes",
            "File bytes received from relaying peers",
            m.received_bytes.clone(),
        );
        registry.register(
            "spotguard_relay_refusals",
            "Relay requests refused by the receiver, by reason",
            m.refusals.clone(),
        );
        for o in SENT_OUTCOMES {
            drop(m.sent.get_or_create(&outcome(o)));
        }
        for o in RECEIVED_OUTCOMES {
            drop(m.received.get_or_create(&outcome(o)));
        }
        for r in REFUSAL_REASONS {
            drop(m.refusals.get_or_create(&ReasonLabels {
                reason: r.to_string(),
            }));
        }
        m
    }

    /// Count a relay sent to a peer that ended with `outcome` ([`SENT_OUTCOMES`]).
    pub fn sent(&self, outcome_: &str) {
        self.sent.get_or_create(&outcome(outcome_)).inc();
    }

    /// Count a received relay that ended with `outcome` ([`RECEIVED_OUTCOMES`]).
    pub fn received(&self, outcome_: &str) {
        self.received.get_or_create(&outcome(outcome_)).inc();
    }

    /// Count a refusal by `reason` ([`REFUSAL_REASONS`]).
    pub fn refused(&self, reason: &str) {
        self.refusals
            .get_or_create(&ReasonLabels {
                reason: reason.to_string(),
            })
            .inc();
    }
}

fn outcome(o: &str) -> OutcomeLabels {
    OutcomeLabels {
        outcome: o.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_encode_with_their_names_and_start_at_zero() {
        let mut r = Registry::default();
        let m = RelayMetrics::register(&mut r);
        m.sent("published");
        m.received("aborted");
        m.refused("auth");
        m.received_bytes.inc_by(9);
        let text = crate::metrics::encode(&r);
        for line in [
            "spotguard_relay_sent_total{outcome=\"published\"} 1",
            "spotguard_relay_sent_total{outcome=\"deadline\"} 0",
            "spotguard_relay_received_total{outcome=\"aborted\"} 1",
            "spotguard_relay_received_bytes_total 9",
            "spotguard_relay_refusals_total{reason=\"auth\"} 1",
            "spotguard_relay_refusals_total{reason=\"crc\"} 0",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
