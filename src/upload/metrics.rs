//! Upload metrics, `spotguard_checkpoint_upload_*`: bytes sent, files published, uploads by
//! outcome, their duration, bytes still to send, and errors by cause (refusals included).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

/// Upload metric families.
#[derive(Debug)]
pub struct UploadMetrics {
    /// `spotguard_checkpoint_upload_bytes_total`: bytes sent to destinations (parts and files
    /// whose request succeeded).
    pub bytes: Counter,
    /// `spotguard_checkpoint_upload_files_total`: files whole at their destination.
    pub files: Counter,
    /// `spotguard_checkpoint_upload_total{outcome}`: uploads ended, by outcome (published,
    /// already_published, deadline, cancelled, failed, refused, interrupted, relayed).
    pub uploads: Family<OutcomeLabels, Counter>,
    /// `spotguard_checkpoint_upload_duration_seconds{outcome}`: how long uploads took.
    pub duration: Family<OutcomeLabels, Histogram>,
    /// `spotguard_checkpoint_upload_pending_bytes`: bytes of uploads in progress not yet sent.
    pub pending_bytes: Gauge,
    /// `spotguard_checkpoint_upload_active`: uploads in progress.
    pub active: Gauge,
    /// `spotguard_checkpoint_upload_errors_total{error}`: failures and refusals by cause
    /// (not_allowed, staged_symlink, changed, deadline, …).
    pub errors: Family<ErrorLabels, Counter>,
}

fn duration_histogram() -> Histogram {
    Histogram::new([
        1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 300.0, 600.0, 1800.0,
    ])
}

impl UploadMetrics {
    /// Create the families and register them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = UploadMetrics {
            bytes: Counter::default(),
            files: Counter::default(),
            uploads: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            pending_bytes: Gauge::default(),
            active: Gauge::default(),
            errors: Family::default(),
        };
        registry.register(
            "spotguard_checkpoint_upload_bytes",
            "Bytes of staged checkpoints sent to their destination",
            m.bytes.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload_files",
            "Files of staged checkpoints whole at their destination",
            m.files.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload",
            "Staged checkpoint uploads ended, by outcome",
            m.uploads.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload_duration_seconds",
            "Duration of staged checkpoint uploads, by outcome",
            m.duration.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload_pending_bytes",
            "Bytes of uploads in progress not yet sent",
            m.pending_bytes.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload_active",
            "Staged checkpoint uploads in progress",
            m.active.clone(),
        );
        registry.register(
            "spotguard_checkpoint_upload_errors",
            "Staged checkpoint upload failures and refusals, by cause",
            m.errors.clone(),
        );
        // Every outcome exists at 0 from start-up (an alert on increase() needs the series).
        for outcome in super::Outcome::ALL {
            let labels = OutcomeLabels {
                outcome: outcome.as_str().to_string(),
            };
            drop(m.uploads.get_or_create(&labels));
            drop(m.duration.get_or_create(&labels));
        }
        m
    }

    /// Count an error by its label.
    pub fn error(&self, label: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                error: label.to_string(),
            })
            .inc();
    }

    /// Count an ended upload.
    pub fn ended(&self, outcome: &str, seconds: f64) {
        let labels = OutcomeLabels {
            outcome: outcome.to_string(),
        };
        self.uploads.get_or_create(&labels).inc();
        self.duration.get_or_create(&labels).observe(seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_encode_with_their_names() {
        let mut r = Registry::default();
        let m = UploadMetrics::register(&mut r);
        m.bytes.inc_by(5);
        m.files.inc();
        m.ended("published", 3.0);
        m.error("staged_symlink");
        m.pending_bytes.set(7);
        let text = crate::metrics::encode(&r);
        for line in [
            "spotguard_checkpoint_upload_bytes_total 5",
            "spotguard_checkpoint_upload_files_total 1",
            "spotguard_checkpoint_upload_total{outcome=\"published\"} 1",
            "spotguard_checkpoint_upload_duration_seconds_count{outcome=\"published\"} 1",
            "spotguard_checkpoint_upload_errors_total{error=\"staged_symlink\"} 1",
            "spotguard_checkpoint_upload_pending_bytes 7",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
