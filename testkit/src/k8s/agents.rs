//! spotguard on a stand-in node as the DaemonSet runs it, for fleet tests and benches: the
//! agent (`spotguard run --mode=kubernetes`) and the prefetcher (`spotguard prefetch-serve`),
//! each its own process with every capability dropped but KILL and SYS_PTRACE, talking to the
//! API server as the shipped ServiceAccount through a kubeconfig the caller gives (a fault
//! proxy's, to count what they ask), and the node's own EC2 metadata emulator (in-process, on
//! loopback). Both processes are killed when the handle is dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use spotguard::emulator::{self, Cloud, EmulatorConfig, EmulatorHandle};

use super::child::free_port;

/// How to run one node's spotguard.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// The `spotguard` binary.
    pub bin: PathBuf,
    pub node: String,
    /// kubeconfig file of the agent.
    pub kubeconfig: PathBuf,
    /// kubeconfig file of the prefetcher; no prefetcher when `None`.
    pub prefetch_kubeconfig: Option<PathBuf>,
    /// EC2 polling cadence (`--poll-interval`).
    pub poll_interval: Duration,
    /// The prefetcher's `--annotation-interval`.
    pub annotation_interval: Duration,
    /// More `spotguard run` arguments.
    pub args: Vec<String>,
    /// More environment of the agent (the downward API's `POD_NAMESPACE`, say).
    pub env: Vec<(String, String)>,
}

impl AgentSpec {
    pub fn new(bin: impl Into<PathBuf>, node: &str, kubeconfig: impl Into<PathBuf>) -> AgentSpec {
        AgentSpec {
            bin: bin.into(),
            node: node.to_string(),
            kubeconfig: kubeconfig.into(),
            prefetch_kubeconfig: None,
            poll_interval: Duration::from_secs(1),
            annotation_interval: Duration::from_secs(30),
            args: Vec::new(),
            env: Vec::new(),
        }
    }
}

/// One node's running spotguard.
pub struct NodeAgent {
    pub node: String,
    /// The node's metadata service.
    pub emulator: EmulatorHandle,
    agent: tokio::process::Child,
    prefetcher: Option<tokio::process::Child>,
    /// The agent's /metrics.
    pub metrics_addr: SocketAddr,
    dir: tempfile::TempDir,
}

/// `cmd` as the DaemonSet runs its containers: every capability dropped but KILL and
/// SYS_PTRACE.
fn shipped_privileges(bin: &Path) -> tokio::process::Command {
    tokio::process::Command::from(crate::process::shipped_command(bin))
}

impl NodeAgent {
    /// Start the emulator, the agent and (with a kubeconfig for it) the prefetcher. Returns
    /// once the agent serves /metrics.
    pub async fn start(spec: &AgentSpec) -> Result<NodeAgent, String> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("agent-{}-", spec.node))
            .tempdir()
            .map_err(|e| e.to_string())?;
        let emulator = emulator::start(EmulatorConfig::new(Cloud::Aws))
            .await
            .map_err(|e| format!("emulator: {e}"))?;
        let port = free_port().map_err(|e| e.to_string())?;
        let metrics_addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let cache = dir.path().join("cache");
        std::fs::create_dir_all(&cache).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.path().join("agent.log")).map_err(|e| e.to_string())?;
        let agent = shipped_privileges(&spec.bin)
            .arg("run")
            .args([
                "--mode=kubernetes".to_string(),
                format!("--node-name={}", spec.node),
                "--cloud=aws".to_string(),
                format!("--metadata-endpoint={}", emulator.base_url()),
                format!(
                    "--poll-interval={}ms",
                    spec.poll_interval.as_millis().max(1)
                ),
                format!("--state-dir={}", dir.path().join("state").display()),
                format!("--cache-dir={}", cache.display()),
                format!("--metrics-addr={metrics_addr}"),
                "--gpu=off".to_string(),
                "--log-format=json".to_string(),
                "--shutdown-grace=1s".to_string(),
            ])
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .env("KUBECONFIG", &spec.kubeconfig)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", spec.bin.display()))?;
        let prefetcher = match &spec.prefetch_kubeconfig {
            None => None,
            Some(kc) => {
                let log = std::fs::File::create(dir.path().join("prefetch.log"))
                    .map_err(|e| e.to_string())?;
                Some(
                    shipped_privileges(&spec.bin)
                        .arg("prefetch-serve")
                        .arg(format!("--cache-dir={}", cache.display()))
                        .arg(format!("--node-name={}", spec.node))
                        .arg(format!(
                            "--annotation-interval={}ms",
                            spec.annotation_interval.as_millis().max(1)
                        ))
                        .env("KUBECONFIG", kc)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(log)
                        .kill_on_drop(true)
                        .spawn()
                        .map_err(|e| format!("starting the prefetcher: {e}"))?,
                )
            }
        };
        let mut me = NodeAgent {
            node: spec.node.clone(),
            emulator,
            agent,
            prefetcher,
            metrics_addr,
            dir,
        };
        let start = tokio::time::Instant::now();
        loop {
            if let Ok(Some(status)) = me.agent.try_wait() {
                return Err(format!(
                    "agent of {} exited with {status}: {}",
                    me.node,
                    me.log_tail(20)
                ));
            }
            if me.metrics().await.is_ok() {
                return Ok(me);
            }
            if start.elapsed() > Duration::from_secs(60) {
                return Err(format!(
                    "agent of {} never served /metrics: {}",
                    me.node,
                    me.log_tail(20)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The agent's /metrics text.
    pub async fn metrics(&self) -> Result<String, String> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| e.to_string())?;
        let resp = client
            .get(format!("http://{}/metrics", self.metrics_addr))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        resp.text().await.map_err(|e| e.to_string())
    }

    /// The agent's and the prefetcher's process ids.
    pub fn pids(&self) -> (Option<u32>, Option<u32>) {
        (
            self.agent.id(),
            self.prefetcher.as_ref().and_then(|p| p.id()),
        )
    }

    /// Resident memory (KiB) of the agent and of the prefetcher (0 when not running). The
    /// processes run under `setpriv`, which execs them: the pid is theirs.
    pub fn rss_kib(&self) -> (u64, u64) {
        let (a, p) = self.pids();
        (
            a.map(|pid| status_kib(pid, "VmRSS:")).unwrap_or(0),
            p.map(|pid| status_kib(pid, "VmRSS:")).unwrap_or(0),
        )
    }

    /// The agent's log (JSON lines).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// The prefetcher's log (JSON lines).
    pub fn prefetch_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prefetch.log")).unwrap_or_default()
    }

    fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// This node's directory (state, cache, logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether both processes still run.
    pub fn running(&mut self) -> bool {
        let agent = matches!(self.agent.try_wait(), Ok(None));
        let prefetcher = match &mut self.prefetcher {
            Some(p) => matches!(p.try_wait(), Ok(None)),
            None => true,
        };
        agent && prefetcher
    }
}

/// A `/proc/<pid>/status` field in KiB (0 when unreadable).
pub fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
