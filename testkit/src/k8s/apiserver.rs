//! kube-apiserver for the test control plane: loopback only, a free port, RBAC on, a static
//! admin token (`system:masters`), ServiceAccount tokens signed by the test PKI.

use std::path::Path;
use std::time::{Duration, Instant};

use super::child::{free_port, Daemon};
use super::pki::Pki;

/// The ServiceAccount token issuer (also the tokens' audience).
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// The Service network; the `kubernetes` Service takes its first address.
pub const SERVICE_CIDR: &str = "10.0.0.0/24";

pub struct ApiServer {
    pub daemon: Daemon,
    pub port: u16,
}

/// Start the API server against `etcd_url` and wait until `/readyz` says ok.
pub async fn start(
    bin: &Path,
    dir: &Path,
    etcd_url: &str,
    pki: &Pki,
    admin_token: &str,
    event_ttl: Option<Duration>,
) -> Result<ApiServer, String> {
    let port = free_port().map_err(|e| e.to_string())?;
    let tokens = dir.join("tokens.csv");
    std::fs::write(
        &tokens,
        format!("{admin_token},admin,admin-uid,\"system:masters\"\n"),
    )
    .map_err(|e| e.to_string())?;
    let mut args = vec![
        format!("--etcd-servers={etcd_url}"),
        "--bind-address=127.0.0.1".to_string(),
        "--advertise-address=127.0.0.1".to_string(),
        format!("--secure-port={port}"),
        format!("--tls-cert-file={}", pki.serving_cert.display()),
        format!("--tls-private-key-file={}", pki.serving_key.display()),
        format!("--client-ca-file={}", pki.ca_cert.display()),
        format!("--service-account-issuer={ISSUER}"),
        format!("--service-account-key-file={}", pki.sa_pub.display()),
        format!(
            "--service-account-signing-key-file={}",
            pki.sa_key.display()
        ),
        format!("--service-cluster-ip-range={SERVICE_CIDR}"),
        format!("--token-auth-file={}", tokens.display()),
        "--authorization-mode=RBAC".to_string(),
        // The shipped DaemonSet uses hostPID / hostNetwork.
        "--allow-privileged=true".to_string(),
        "--profiling=false".to_string(),
        "--v=0".to_string(),
    ];
    if let Some(ttl) = event_ttl {
        args.push(format!("--event-ttl={}s", ttl.as_secs().max(1)));
    }
    let mut daemon = Daemon::start("kube-apiserver", bin, &args, dir)?;
    let ca = reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).map_err(|e| e.to_string())?;
    let http = reqwest::Client::builder()
        .add_root_certificate(ca)
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let mut last;
    loop {
        daemon.check_alive()?;
        match http
            .get(format!("https://127.0.0.1:{port}/readyz"))
            .bearer_auth(admin_token)
            .send()
            .await
        {
            Ok(resp) => {
                let ok = resp.status().is_success();
                last = resp.text().await.unwrap_or_default();
                if ok && last.trim() == "ok" {
                    return Ok(ApiServer { daemon, port });
                }
            }
            Err(e) => last = e.to_string(),
        }
        if started.elapsed() > Duration::from_secs(120) {
            let tail = daemon.log_tail(40);
            daemon.kill();
            return Err(format!(
                "kube-apiserver not ready after 120 s ({last}):\n{tail}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
