//! Shutdown is owned here and only here: the first SIGTERM or SIGINT cancels the root token; a
//! second one forces an immediate exit. The agent's SIGHUP is here too: logged and ignored
//! ([`ignore_hangup`]).

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

/// The agent's SIGHUP (`kill -HUP`, a closed terminal): settings are read once, at start, and
/// reloading is not supported (the systemd unit has no `ExecReload=`), so a SIGHUP changes
/// nothing: it is logged and the agent keeps running, where the signal's default action would end
/// it without a word (exit 129).
pub fn ignore_hangup() -> std::io::Result<()> {
    let mut hup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            tracing::warn!(
                signal = "SIGHUP",
                "reloading settings is not supported (they are read once, at start): nothing changed, the agent keeps running; restart it to apply new settings"
            );
        }
    });
    Ok(())
}
