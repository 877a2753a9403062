//! etcd for the test control plane: one member on loopback, data on tmpfs when there is one
//! (`/dev/shm`: fsync is free there; etcd 3.4 has no `--unsafe-no-fsync`).

use std::path::Path;
use std::time::{Duration, Instant};

use super::child::{free_port, Daemon};

/// A running etcd and its client URL.
pub struct Etcd {
    pub daemon: Daemon,
    pub url: String,
}

/// Start etcd with its data in `<dir>/etcd` and wait until it answers `/health`.
pub async fn start(bin: &Path, dir: &Path) -> Result<Etcd, String> {
    let client = free_port().map_err(|e| e.to_string())?;
    let peer = free_port().map_err(|e| e.to_string())?;
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let args = vec![
        "--name=default".to_string(),
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls={url}"),
        format!("--advertise-client-urls={url}"),
        format!("--listen-peer-urls={peer_url}"),
        format!("--initial-advertise-peer-urls={peer_url}"),
        format!("--initial-cluster=default={peer_url}"),
        "--logger=zap".to_string(),
        "--log-level=warn".to_string(),
    ];
    let mut daemon = Daemon::start("etcd", bin, &args, dir)?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    loop {
        daemon.check_alive()?;
        if let Ok(resp) = http.get(format!("{url}/health")).send().await {
            if resp.text().await.is_ok_and(|t| t.contains("true")) {
                return Ok(Etcd { daemon, url });
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            let tail = daemon.log_tail(30);
            daemon.kill();
            return Err(format!("etcd not healthy after 60 s:\n{tail}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
