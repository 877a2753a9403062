//! Logging setup: JSON lines in-cluster, human text on a terminal; `tracing` spans carry `node`,
//! `notice_id`, `source`, `pod`.

use tracing_subscriber::{fmt, EnvFilter};

use crate::config::LogFormat;

/// Install the global subscriber. Safe to call more than once (later calls are no-ops), so tests
/// and the drill can call it freely.
pub fn init(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
        LogFormat::Text => builder.with_target(false).compact().try_init(),
    };
}

/// Write a fatal error to the Kubernetes termination-message file, so that `kubectl describe pod`
/// shows why the agent stopped. Best effort.
pub fn write_termination_message(message: &str) {
    let path = std::env::var("SPOTGUARD_TERMINATION_MESSAGE_PATH")
        .unwrap_or_else(|_| "/dev/termination-log".to_string());
    if std::path::Path::new(&path).exists() {
        let _ = std::fs::write(&path, message);
    }
}
