//! Prefetch metrics. The `dataset` label is the operator-chosen dataset name: there are few of
//! them (a handful per node), so it is kept where it answers "which dataset is slow or stuck".

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DatasetLabels {
    pub dataset: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefetchErrorLabels {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    pub reason: String,
}

/// Prefetch metric families.
pub struct PrefetchMetrics {
    /// `spotguard_prefetch_bytes_total{dataset}`: bytes downloaded (written to the cache).
    pub bytes: Family<DatasetLabels, Counter>,
    /// `spotguard_prefetch_files_total{dataset}`: files published (downloaded and verified).
    pub files: Family<DatasetLabels, Counter>,
    /// `spotguard_prefetch_errors_total{error}`: failed objects and runs, by cause.
    pub errors: Family<PrefetchErrorLabels, Counter>,
    /// `spotguard_prefetch_duration_seconds`: duration of finished dataset runs.
    pub duration: Histogram,
    /// `spotguard_prefetch_active_datasets`: datasets being prefetched now.
    pub active: Gauge,
    /// `spotguard_prefetch_pending_bytes{dataset}`: bytes listed but not yet local.
    pub pending_bytes: Family<DatasetLabels, Gauge>,
    /// `spotguard_prefetch_pending_files{dataset}`: files listed but not yet local.
    pub pending_files: Family<DatasetLabels, Gauge>,
    /// `spotguard_prefetch_evictions_total`: datasets evicted to make room.
    pub evictions: Counter,
    /// `spotguard_prefetch_refused_total{reason}`: pod requests refused (disabled, scheme,
    /// not_allowed, invalid, prefetch).
    pub refused: Family<RefusedLabels, Counter>,
}

impl PrefetchMetrics {
    /// Create the families and register them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = PrefetchMetrics {
            bytes: Family::default(),
            files: Family::default(),
            errors: Family::default(),
            duration: Histogram::new([
                1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
            ]),
            active: Gauge::default(),
            pending_bytes: Family::default(),
            pending_files: Family::default(),
            evictions: Counter::default(),
            refused: Family::default(),
        };
        registry.register(
            "spotguard_prefetch_bytes",
            "Bytes downloaded into the dataset cache",
            m.bytes.clone(),
        );
        registry.register(
            "spotguard_prefetch_files",
            "Files downloaded, verified and published",
            m.files.clone(),
        );
        registry.register(
            "spotguard_prefetch_errors",
            "Prefetch errors by cause",
            m.errors.clone(),
        );
        registry.register(
            "spotguard_prefetch_duration_seconds",
            "Duration of finished dataset prefetch runs",
            m.duration.clone(),
        );
        registry.register(
            "spotguard_prefetch_active_datasets",
            "Datasets being prefetched",
            m.active.clone(),
        );
        registry.register(
            "spotguard_prefetch_pending_bytes",
            "Bytes listed at the source and not yet in the cache",
            m.pending_bytes.clone(),
        );
        registry.register(
            "spotguard_prefetch_pending_files",
            "Files listed at the source and not yet in the cache",
            m.pending_files.clone(),
        );
        registry.register(
            "spotguard_prefetch_evictions",
            "Datasets evicted from the cache to make room",
            m.evictions.clone(),
        );
        registry.register(
            "spotguard_prefetch_refused",
            "Pod-requested prefetches refused, by reason",
            m.refused.clone(),
        );
        m
    }

    /// Count a refused pod request.
    pub fn refused(&self, reason: &str) {
        self.refused
            .get_or_create(&RefusedLabels {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Count an error by its metric label.
    pub fn error(&self, label: &str) {
        self.errors
            .get_or_create(&PrefetchErrorLabels {
                error: label.to_string(),
            })
            .inc();
    }

    pub(crate) fn dataset(name: &str) -> DatasetLabels {
        DatasetLabels {
            dataset: name.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_encode_with_the_design_names() {
        let mut r = Registry::default();
        let m = PrefetchMetrics::register(&mut r);
        m.bytes
            .get_or_create(&PrefetchMetrics::dataset("imagenet"))
            .inc_by(5);
        m.files
            .get_or_create(&PrefetchMetrics::dataset("imagenet"))
            .inc();
        m.error("disk_full");
        m.duration.observe(3.0);
        m.active.set(1);
        let text = crate::metrics::encode(&r);
        for line in [
            "spotguard_prefetch_bytes_total{dataset=\"imagenet\"} 5",
            "spotguard_prefetch_files_total{dataset=\"imagenet\"} 1",
            "spotguard_prefetch_errors_total{error=\"disk_full\"} 1",
            "spotguard_prefetch_duration_seconds_count 1",
            "spotguard_prefetch_active_datasets 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }
}
