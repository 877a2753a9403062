//! Logging setup: JSON lines in-cluster, human text on a terminal; `tracing` spans carry `node`,
//! `notice_id`, `source`, `pod`.
//!
//! Field values are typed: numbers as numbers, booleans as booleans, times as RFC 3339 strings,
//! durations as numbers with the unit in the name (`*_ms`, `*_seconds`). `tracing` has no list
//! values: a list is one string, items separated by `,`. Text output has ANSI colours only when
//! stderr is a terminal.

use std::io::IsTerminal;

use tracing_subscriber::{fmt, EnvFilter};

use crate::config::LogFormat;

/// The filter for a `--log-level`: a bare level (`info`, `debug`…) applies to spotguard, and its
/// dependencies (kube, hyper, reqwest, object_store…) stay at `warn`; anything else (`debug,
/// hyper=info`, `spotguard=trace`) is an EnvFilter used as given.
pub fn filter_directives(level: &str) -> String {
    let t = level.trim();
    let bare = ["off", "error", "warn", "info", "debug", "trace"]
        .iter()
        .any(|l| t.eq_ignore_ascii_case(l));
    if bare {
        let l = t.to_ascii_lowercase();
        if l == "off" || l == "error" {
            l
        } else {
            format!("warn,spotguard={l}")
        }
    } else {
        t.to_string()
    }
}

/// Install the global subscriber. Safe to call more than once (later calls are no-ops), so tests
/// and the drill can call it freely.
pub fn init(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter_directives(filter))
        .unwrap_or_else(|_| EnvFilter::new("warn,spotguard=info"));
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
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

#[cfg(test)]
mod tests {
    use super::filter_directives;

    #[test]
    fn bare_levels_keep_dependencies_at_warn() {
        assert_eq!(filter_directives("info"), "warn,spotguard=info");
        assert_eq!(filter_directives(" DEBUG "), "warn,spotguard=debug");
        assert_eq!(filter_directives("error"), "error");
        assert_eq!(filter_directives("debug,hyper=info"), "debug,hyper=info");
        assert_eq!(filter_directives("spotguard=trace"), "spotguard=trace");
    }
}
