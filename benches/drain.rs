//! Drain of 100 pods (no PDB) against the real API server (testkit's control plane) through the
//! fault proxy adding 5 ms per request; the pods are real processes under the kubelet stand-in
//! that exit at once on SIGTERM. Side by side with `kubectl drain` on the same server when
//! kubectl is installed.
//!
//! Reports per tool: median / min / max wall time over the runs, requests per drain, the
//! latency the proxy added (summed over requests), and for spotguard the agent overhead =
//! median wall − the proxy's floor (critical path: list + ⌈N / concurrency⌉ waves of evictions
//! and of deletion checks, 5 ms each; the real server's and kubelet's own time is in the
//! overhead). Peak RSS (VmHWM) is of this whole process (kubelet stand-in and proxy included;
//! the control plane runs in its own processes).
//!
//! Run: `cargo bench --bench drain` (env `DRAIN_BENCH_RUNS`, default 12; `DRAIN_BENCH_KUBECTL=0`
//! skips kubectl).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::metrics::Metrics;
use spotguard::node::kube::KubeNodeOps;
use spotguard::node::{DrainRequest, NodeOps, DEFAULT_DRAIN_CONCURRENCY};
use spotguard_testkit::k8s::{Identity, Kubelet, TestCluster, TestPod};

const PODS: usize = 100;
const LATENCY: Duration = Duration::from_millis(5);

struct Sample {
    wall: Duration,
    requests: usize,
    served: Duration,
}

struct Bench {
    k: TestCluster,
    node: Kubelet,
    namespaces: Vec<String>,
}

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot build a tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("drain bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// 100 running pods on the node, in 4 namespaces.
async fn seed(b: &Bench, round: usize) {
    let pods: Vec<_> = (0..PODS)
        .map(|i| {
            TestPod::new(
                &b.namespaces[i % 4],
                &format!("worker-{round}-{i}"),
                b.node.name(),
            )
            .label("app", "trainer")
            .build()
        })
        .collect();
    b.k.run_pods(&pods).await;
}

async fn pods_left(b: &Bench) -> usize {
    let ns: Vec<&str> = b.namespaces.iter().map(String::as_str).collect();
    b.k.pods_in(&ns).await.len()
}

async fn run() -> Result<(), String> {
    let runs: usize = std::env::var("DRAIN_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
        .max(10);
    let k = TestCluster::new().await;
    let node = k.node(k.node_config("bench-node")).await;
    let mut namespaces = Vec::new();
    for i in 0..4 {
        namespaces.push(k.namespace(&format!("team-{i}")).await);
    }
    let b = Bench {
        k,
        node,
        namespaces,
    };
    b.k.proxy().set_latency(LATENCY);
    let metrics = Arc::new(Metrics::register(&mut Registry::default()));
    let ops = KubeNodeOps::new(
        b.k.agent_client(),
        b.node.name().to_string(),
        None,
        false,
        metrics,
    );
    let concurrency = DEFAULT_DRAIN_CONCURRENCY;

    let mut samples = Vec::new();
    // Round 0 warms the connection pool (a long-running agent keeps its client).
    for round in 0..=runs {
        seed(&b, round).await;
        b.k.proxy().clear_requests();
        let served_before = b.k.proxy().added_latency();
        let request = DrainRequest {
            deadline: Timestamp::now() + Duration::from_secs(120),
            force_delete_at_deadline: false,
            concurrency,
            holds: Vec::new(),
        };
        let started = Instant::now();
        let report = ops.drain(&request).await.map_err(|e| e.to_string())?;
        let wall = started.elapsed();
        if report.evicted.len() != PODS || !report.complete() {
            return Err(format!(
                "round {round}: {} evicted, {} blocked",
                report.evicted.len(),
                report.blocked.len()
            ));
        }
        if round > 0 {
            samples.push(Sample {
                wall,
                requests: b.k.proxy().requests().len(),
                served: b.k.proxy().added_latency() - served_before,
            });
        }
    }
    let waves = PODS.div_ceil(concurrency) as u32;
    let critical = LATENCY * (1 + 2 * waves);
    println!(
        "drain of {PODS} pods, no PDB, real API server ({}) + {LATENCY:?}/request at the proxy, pods that exit on SIGTERM, {runs} runs",
        b.k.cp.assets.version
    );
    report_line("spotguard", &samples);
    let median = median_wall(&samples);
    println!(
        "  the proxy's floor (critical path, concurrency {concurrency}: 1 list + {waves} eviction waves + {waves} deletion-check waves): {critical:?}"
    );
    println!(
        "  agent + server + kubelet time = median wall − proxy floor: {:?}",
        median.saturating_sub(critical)
    );
    println!(
        "  peak RSS (VmHWM, whole bench process incl. kubelet stand-in and proxy): {}",
        vm_hwm()
    );

    if std::env::var("DRAIN_BENCH_KUBECTL").as_deref() != Ok("0") {
        match kubectl_runs(&b, runs.min(10)).await {
            Ok(samples) => {
                report_line("kubectl drain", &samples);
                println!("  (kubectl includes process start, discovery and cordon; it polls deletions every 1 s)");
            }
            Err(e) => println!("kubectl drain: not measured: {e}"),
        }
    }
    Ok(())
}

fn median_wall(samples: &[Sample]) -> Duration {
    let mut walls: Vec<Duration> = samples.iter().map(|s| s.wall).collect();
    walls.sort();
    walls.get(walls.len() / 2).copied().unwrap_or_default()
}

fn report_line(tool: &str, samples: &[Sample]) {
    let mut walls: Vec<Duration> = samples.iter().map(|s| s.wall).collect();
    walls.sort();
    let min = walls.first().copied().unwrap_or_default();
    let max = walls.last().copied().unwrap_or_default();
    let mut reqs: Vec<usize> = samples.iter().map(|s| s.requests).collect();
    reqs.sort();
    let mut served: Vec<Duration> = samples.iter().map(|s| s.served).collect();
    served.sort();
    println!(
        "{tool}: median wall {:?} (min {min:?}, max {max:?}); requests/drain median {}; latency the proxy added, summed over requests, median {:?}",
        median_wall(samples),
        reqs.get(reqs.len() / 2).copied().unwrap_or_default(),
        served.get(served.len() / 2).copied().unwrap_or_default(),
    );
}

fn vm_hwm() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l.trim_start_matches("VmHWM:").trim().to_string())
        })
        .unwrap_or_else(|| "unavailable".to_string())
}

/// `kubectl drain` as an operator (admin) through the same proxy; the node is uncordoned after
/// each round.
async fn kubectl_runs(b: &Bench, runs: usize) -> Result<Vec<Sample>, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        b.k.cp.kubeconfig(&b.k.proxy().url(), Identity::Admin),
    )
    .map_err(|e| format!("kubeconfig: {e}"))?;
    let cache = dir.path().join("cache");
    let mut samples = Vec::new();
    for round in 0..=runs {
        b.k.patch_node_spec(b.node.name(), serde_json::json!({ "unschedulable": false }))
            .await;
        seed(b, 1000 + round).await;
        b.k.proxy().clear_requests();
        let served_before = b.k.proxy().added_latency();
        let started = Instant::now();
        let out = tokio::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--cache-dir")
            .arg(&cache)
            .args([
                "drain",
                b.node.name(),
                "--ignore-daemonsets",
                "--delete-emptydir-data",
                "--timeout=120s",
            ])
            .output()
            .await
            .map_err(|e| format!("running kubectl: {e}"))?;
        let wall = started.elapsed();
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr
                .chars()
                .rev()
                .take(600)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(format!("kubectl exited with {}: {tail}", out.status));
        }
        let left = pods_left(b).await;
        if left != 0 {
            return Err(format!("kubectl drain left {left} pods"));
        }
        // Round 0 fills kubectl's discovery cache.
        if round > 0 {
            samples.push(Sample {
                wall,
                requests: b.k.proxy().requests().len(),
                served: b.k.proxy().added_latency() - served_before,
            });
        }
    }
    Ok(samples)
}
