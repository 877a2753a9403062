//! Shutdown is owned here and only here: the first SIGTERM or SIGINT cancels the root token; a
//! second one forces an immediate exit.

use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// Spawn the signal listener. Returns the root token every task is a child of.
pub fn install() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let t = token.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = name,
            "shutting down: monitors stop now, an in-flight plan gets its grace period"
        );
        t.cancel();
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tracing::warn!("second signal: exiting immediately");
        std::process::exit(130);
    });
    Ok(token)
}
