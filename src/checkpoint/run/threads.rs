//! Checkpoint threads (hang isolation, see the module doc of `run`): spawning the named threads
//! delivery and the file side run on, the metric handles such a detached thread owns, and
//! counting the threads left behind in a blocking call.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::{Metrics, ModuleErrorLabels};

const MODULE: &str = "checkpoint";

/// Spawn a named checkpoint thread; `None` (logged, counted) when the system has no thread left.
pub(super) fn spawn_thread<F>(name: &str, counters: &Counters, f: F) -> bool
where
    F: FnOnce() + Send + 'static,
{
    match std::thread::Builder::new().name(name.into()).spawn(f) {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(thread = name, error = %e, "cannot start a checkpoint thread");
            counters.error("thread_spawn");
            false
        }
    }
}

/// Metric handles a detached thread can own (the registry's counters are shared handles).
#[derive(Clone, Debug)]
pub(super) struct Counters {
    signals_sent: Counter,
    pub(super) errors: Family<ModuleErrorLabels, Counter>,
    enabled: bool,
}

impl Counters {
    pub(super) fn of(m: &Metrics) -> Self {
        Counters {
            signals_sent: m.signals_sent.clone(),
            errors: m.errors.clone(),
            enabled: true,
        }
    }

    /// The restart path counts nothing (nothing is sent).
    pub(super) fn none() -> Self {
        Counters {
            signals_sent: Counter::default(),
            errors: Family::default(),
            enabled: false,
        }
    }

    pub(super) fn signal_sent(&self) {
        if self.enabled {
            self.signals_sent.inc();
        }
    }

    pub(super) fn error(&self, label: &str) {
        if self.enabled {
            count_error(&self.errors, label);
        }
    }
}

/// Count a thread left behind in a blocking call.
pub(super) fn count_stuck(errors: &Family<ModuleErrorLabels, Counter>) {
    count_error(errors, "stuck_thread");
}

/// `spotguard_errors_total{module="checkpoint",error=label}` + 1.
fn count_error(errors: &Family<ModuleErrorLabels, Counter>, label: &str) {
    errors
        .get_or_create(&ModuleErrorLabels {
            module: MODULE.to_string(),
            error: label.to_string(),
        })
        .inc();
}
