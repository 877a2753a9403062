//! Fleet bench: N nodes, each with spotguard as the DaemonSet runs it, against one real API
//! server (testkit's control plane: etcd, kube-apiserver, controller-manager, scheduler).
//!
//! - The nodes: one kubelet stand-in (`Fleet`) registers them and renews every Lease at the
//!   kubelet's 10 s cadence. Each node has `FLEET_PODS` pods: a trainer opted into
//!   checkpointing, and simulated pods (no process: reported Running; once deleted they stop at
//!   the end of their grace period `FLEET_GRACE`, like processes that ignore SIGTERM). On the
//!   nodes that will be interrupted the trainer is a real process (this binary in `--child`
//!   mode, uid 1000, it stamps CLOCK_REALTIME in its SIGUSR1 handler and exits); elsewhere it is
//!   simulated too.
//! - Per node: `spotguard run --mode=kubernetes` and `spotguard prefetch-serve`, each its own
//!   process with every capability dropped but KILL and SYS_PTRACE, as the shipped
//!   ServiceAccount, the agents through one fault proxy and the prefetchers through another
//!   (each logs every request), and the node's own EC2 metadata emulator (in this process,
//!   polled every 1 s).
//!
//! Measured:
//! (a) idle, over `FLEET_IDLE_SECS`: requests/s per node beyond watches (agent and prefetcher),
//!     watch (re)starts, open watches per node (the API server's
//!     `apiserver_longrunning_requests{verb="WATCH"}` against the count before the agents
//!     started), RSS and CPU per process;
//! (b) a mass reclaim: `FLEET_RECLAIM` (25 %) of the nodes get a spot interruption (2 minutes)
//!     within one second: notice visible → SIGUSR1 received (and agent saw it → received, the
//!     part after the EC2 poll), notice → node drained (every evictable pod gone, seen by the
//!     bench's own watch), the margin to the deadline the agent was given (`notice.json`), the
//!     API server's request latency (`apiserver_request_duration_seconds` deltas, long-running
//!     requests excluded) and errors (non-2xx answers, the agents' `spotguard_errors_total`,
//!     blocked pods);
//! (c) single drains on two more nodes: a trainer and 2 pods that stop 3 s after SIGTERM, and a
//!     trainer and 30 pods that use their whole 30 s grace period: every request the agent made
//!     from the notice to the node drained.
//!
//! Run: `bench/fleet.sh [N]` or `cargo bench --bench fleet`. Environment: `FLEET_N` (100),
//! `FLEET_PODS` (30), `FLEET_GRACE` (30 s), `FLEET_IDLE_SECS` (120), `FLEET_RECLAIM` (0.25),
//! `FLEET_SCENARIOS` (`idle,reclaim,drains`), `FLEET_OUT` (write the results as JSON there),
//! `SPOTGUARD_FLEET_BIN` (another `spotguard` build, to compare builds), `FLEET_LOGS` (keep the
//! interrupted nodes' agent logs in that directory).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::{Pod, PodSecurityContext};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use serde_json::{json, Value};
use spotguard::emulator::EmulatedNotice;
use spotguard_testkit::k8s::agents::{status_kib, AgentSpec, NodeAgent};
use spotguard_testkit::k8s::apimetrics::{self, Histogram, Sample};
use spotguard_testkit::k8s::{
    FaultProxy, Fleet, Identity, RecordedRequest, RequestKind, TestCluster, TestPod,
};
use spotguard_testkit::process::{percentile, usr1_stamp_child};

// === options ===

#[derive(Clone, Debug)]
struct Opts {
    n: usize,
    pods: usize,
    grace: i64,
    idle: Duration,
    reclaim: f64,
    idle_on: bool,
    reclaim_on: bool,
    drains_on: bool,
    bin: PathBuf,
    out: Option<PathBuf>,
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

impl Opts {
    fn from_env() -> Opts {
        let scenarios =
            std::env::var("FLEET_SCENARIOS").unwrap_or_else(|_| "idle,reclaim,drains".into());
        let has = |s: &str| scenarios.split(',').any(|x| x.trim() == s);
        Opts {
            n: env_or("FLEET_N", 100),
            pods: env_or("FLEET_PODS", 30usize).max(1),
            grace: env_or("FLEET_GRACE", 30),
            idle: Duration::from_secs(env_or("FLEET_IDLE_SECS", 120)),
            reclaim: env_or("FLEET_RECLAIM", 0.25),
            idle_on: has("idle"),
            reclaim_on: has("reclaim"),
            drains_on: has("drains"),
            bin: std::env::var_os("SPOTGUARD_FLEET_BIN")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_spotguard"))),
            out: std::env::var_os("FLEET_OUT").map(PathBuf::from),
        }
    }
}

// === statistics ===

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.total_cmp(b));
    v
}

fn ms(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1} ms", x * 1e3)
    } else {
        "n/a".into()
    }
}

fn secs(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.1} s")
    } else {
        "n/a".into()
    }
}

fn pstats(v: &[f64]) -> Value {
    let s = sorted(v.to_vec());
    json!({
        "n": s.len(),
        "p50": percentile(&s, 50.0),
        "p99": percentile(&s, 99.0),
        "min": s.first().copied().unwrap_or(f64::NAN),
        "max": s.last().copied().unwrap_or(f64::NAN),
    })
}

fn is_watch(r: &RecordedRequest) -> bool {
    r.query_param("watch").as_deref() == Some("true")
}

fn kind_counts(reqs: &[RecordedRequest]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in reqs {
        let k = if is_watch(r) {
            "watch".to_string()
        } else {
            format!("{:?}", r.kind)
        };
        *out.entry(k).or_insert(0) += 1;
    }
    out
}

/// Whether a request for `node`'s pods is in `reqs` (a watch only, when `watch`).
fn pods_read(reqs: &[RecordedRequest], node: &str, watch: bool) -> bool {
    let selector = format!("spec.nodeName={node}");
    reqs.iter().any(|r| {
        (is_watch(r) || !watch) && r.query_param("fieldSelector").as_deref() == Some(&selector)
    })
}

async fn api_samples(k: &TestCluster) -> Vec<Sample> {
    match k.cp.api_metrics().await {
        Ok(t) => apimetrics::parse(&t),
        Err(e) => {
            eprintln!("fleet: API server metrics: {e}");
            Vec::new()
        }
    }
}

fn open_watches(samples: &[Sample]) -> f64 {
    apimetrics::sum(samples, "apiserver_longrunning_requests", |l| {
        l.get("verb").map(String::as_str) == Some("WATCH")
    })
}

fn short_requests(samples: &[Sample]) -> Histogram {
    Histogram::of(samples, "apiserver_request_duration_seconds", |l| {
        !matches!(
            l.get("verb").map(String::as_str),
            Some("WATCH" | "WATCHLIST" | "CONNECT")
        )
    })
}

/// The API server's latency during the reclaim per kind of request: the mix changes with the
/// build (the old drain's GETs are cheap reads), so the overall p99 alone compares unlike mixes.
fn latency_by_kind(after: &[Sample], before: &[Sample]) -> BTreeMap<&'static str, Value> {
    type Filter = fn(&BTreeMap<String, String>) -> bool;
    let kinds: [(&'static str, Filter); 4] = [
        ("eviction", |l| {
            l.get("subresource").map(String::as_str) == Some("eviction")
        }),
        ("pod_get", |l| {
            l.get("verb").map(String::as_str) == Some("GET")
                && l.get("resource").map(String::as_str) == Some("pods")
                && l.get("subresource").is_none_or(|s| s.is_empty())
        }),
        ("writes", |l| {
            matches!(
                l.get("verb").map(String::as_str),
                Some("POST" | "PATCH" | "PUT" | "DELETE" | "APPLY")
            )
        }),
        ("lists", |l| {
            l.get("verb").map(String::as_str) == Some("LIST")
        }),
    ];
    kinds
        .into_iter()
        .map(|(name, filter)| {
            let h = Histogram::of(after, "apiserver_request_duration_seconds", filter).since(
                &Histogram::of(before, "apiserver_request_duration_seconds", filter),
            );
            (
                name,
                json!({"count": h.count, "p50": h.quantile(0.5), "p99": h.quantile(0.99)}),
            )
        })
        .collect()
}

fn requests_by_code(after: &[Sample], before: &[Sample]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let count = |samples: &[Sample], code: &str| {
        apimetrics::sum(samples, "apiserver_request_total", |l| {
            l.get("code").map(String::as_str) == Some(code)
        })
    };
    let codes: HashSet<String> = after
        .iter()
        .filter(|s| s.name == "apiserver_request_total")
        .filter_map(|s| s.labels.get("code").cloned())
        .collect();
    for code in codes {
        let d = count(after, &code) - count(before, &code);
        if d > 0.0 {
            out.insert(code, d);
        }
    }
    out
}

fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let u: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
    let s: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    u + s
}

// === set-up ===

struct NodePlan {
    /// The node's name without the test's suffix.
    base: String,
    name: String,
    namespace: String,
    /// Interrupted in the reclaim (a real trainer).
    reclaim: bool,
    /// Drain scenario node: (pods besides the trainer, how they stop).
    drain: Option<(usize, Option<Duration>)>,
    /// The trainer's files: `received` (+ `.ready`) in a directory uid 1000 can write, and its
    /// checkpoint dir (notice.json) the agent writes.
    out: PathBuf,
    ckpt: PathBuf,
}

struct Bench {
    k: TestCluster,
    opts: Opts,
    prefetch_proxy: FaultProxy,
    fleet: Fleet,
    plans: Vec<NodePlan>,
    agent_kc: PathBuf,
    prefetch_kc: PathBuf,
    _dir: tempfile::TempDir,
}

fn trainer_pod(plan: &NodePlan, child_exe: &Path, real: bool) -> Pod {
    let base = TestPod::new(
        &plan.namespace,
        &format!("trainer-{}", plan.name),
        &plan.name,
    )
    .annotation("spotguard.io/checkpoint", "true")
    .annotation(
        "spotguard.io/checkpoint-dir",
        &plan.ckpt.display().to_string(),
    )
    .annotation("spotguard.io/checkpoint-timeout", "10s");
    let mut pod = if real {
        let exe = child_exe.display().to_string();
        let out = plan.out.display().to_string();
        base.command(&[&exe, "--child", &out]).build()
    } else {
        base.simulated(Some(Duration::from_secs(1))).build()
    };
    if let Some(spec) = pod.spec.as_mut() {
        spec.restart_policy = Some("Never".into());
        spec.security_context = Some(PodSecurityContext {
            run_as_user: Some(1000),
            run_as_group: Some(1000),
            ..Default::default()
        });
    }
    pod
}

async fn setup(opts: Opts) -> Result<Bench, String> {
    let started = Instant::now();
    let k = TestCluster::new().await;
    let prefetch_proxy = FaultProxy::start(k.cp)
        .await
        .map_err(|e| format!("proxy: {e}"))?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    // The trainer binary where uid 1000 can run it, and a sticky world-writable directory
    // for its files.
    let child_exe = dir.path().join("fleet-trainer");
    std::fs::copy(
        std::env::current_exe().map_err(|e| e.to_string())?,
        &child_exe,
    )
    .map_err(|e| format!("copying the trainer binary: {e}"))?;
    let shared = dir.path().join("trainers");
    std::fs::create_dir_all(&shared).map_err(|e| e.to_string())?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777))
            .map_err(|e| e.to_string())?;
    }
    let namespaces = [
        k.namespace("team-a").await,
        k.namespace("team-b").await,
        k.namespace("team-c").await,
        k.namespace("team-d").await,
    ];
    let reclaim_count = if opts.reclaim_on {
        ((opts.n as f64) * opts.reclaim).ceil() as usize
    } else {
        0
    };
    let mut plans = Vec::new();
    for i in 0..opts.n {
        let base = format!("fleet-{i:04}");
        let name = k.name(&base);
        // Spread over the fleet: every (n / count)-th node.
        let reclaim = reclaim_count > 0 && (i * reclaim_count) % opts.n < reclaim_count;
        plans.push(NodePlan {
            out: shared.join(format!("{name}.received")),
            ckpt: dir.path().join("ckpt").join(&name),
            namespace: namespaces[i % namespaces.len()].clone(),
            base,
            name,
            reclaim,
            drain: None,
        });
    }
    if opts.drains_on {
        for (pods, stop) in [(2usize, Some(Duration::from_secs(3))), (30, None)] {
            let base = format!("drain-{pods}");
            let name = k.name(&base);
            plans.push(NodePlan {
                out: shared.join(format!("{name}.received")),
                ckpt: dir.path().join("ckpt").join(&name),
                namespace: k.namespace(&format!("drain-{pods}")).await,
                base,
                name,
                reclaim: false,
                drain: Some((pods, stop)),
            });
        }
    }
    for p in &plans {
        std::fs::create_dir_all(&p.ckpt).map_err(|e| e.to_string())?;
    }
    let configs = plans.iter().map(|p| k.node_config(&p.base)).collect();
    let fleet = Fleet::start(k.cp, configs).await?;
    eprintln!(
        "fleet: {} nodes registered and Ready in {:.1} s",
        plans.len(),
        started.elapsed().as_secs_f64()
    );

    let mut pods = Vec::new();
    for p in &plans {
        let real = p.reclaim || p.drain.is_some();
        pods.push(trainer_pod(p, &child_exe, real));
        let (others, stop) = match p.drain {
            Some((n, stop)) => (n, stop),
            None if p.reclaim => (opts.pods - 1, None),
            None => (opts.pods - 1, Some(Duration::from_secs(1))),
        };
        for j in 0..others {
            pods.push(
                TestPod::new(&p.namespace, &format!("w-{}-{j}", p.name), &p.name)
                    .label("app", "worker")
                    .simulated(stop)
                    .grace_period(opts.grace)
                    .build(),
            );
        }
    }
    let t = Instant::now();
    k.run_many_pods(&pods, 16).await;
    eprintln!(
        "fleet: {} pods running in {:.1} s",
        pods.len(),
        t.elapsed().as_secs_f64()
    );
    for p in plans.iter().filter(|p| p.reclaim || p.drain.is_some()) {
        let t = Instant::now();
        while !p.out.with_extension("ready").exists() {
            if t.elapsed() > Duration::from_secs(60) {
                return Err(format!("trainer on {} never caught SIGUSR1", p.name));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let agent_kc = dir.path().join("agent.kubeconfig");
    std::fs::write(&agent_kc, k.agent_kubeconfig()).map_err(|e| e.to_string())?;
    let prefetch_kc = dir.path().join("prefetch.kubeconfig");
    std::fs::write(
        &prefetch_kc,
        k.cp.kubeconfig(&prefetch_proxy.url(), Identity::Agent),
    )
    .map_err(|e| e.to_string())?;
    Ok(Bench {
        k,
        opts,
        prefetch_proxy,
        fleet,
        plans,
        agent_kc,
        prefetch_kc,
        _dir: dir,
    })
}

impl Bench {
    fn spec(&self, node: &str) -> AgentSpec {
        let mut spec = AgentSpec::new(&self.opts.bin, node, &self.agent_kc);
        spec.prefetch_kubeconfig = Some(self.prefetch_kc.clone());
        spec
    }

    /// Start the agents of `nodes`, 4 at a time, and wait until each agent's pod cache watches
    /// the node's pods and each prefetcher has read them.
    async fn start_agents(
        &self,
        nodes: &[&NodePlan],
    ) -> Result<HashMap<String, NodeAgent>, String> {
        let t = Instant::now();
        let results: Vec<Result<NodeAgent, String>> = futures::stream::iter(nodes.iter())
            .map(|p| {
                let spec = self.spec(&p.name);
                async move { NodeAgent::start(&spec).await }
            })
            .buffer_unordered(4)
            .collect()
            .await;
        let mut agents = HashMap::new();
        for r in results {
            let a = r?;
            agents.insert(a.node.clone(), a);
        }
        loop {
            let a = self.k.proxy().requests();
            let p = self.prefetch_proxy.requests();
            let waiting = nodes
                .iter()
                .filter(|n| !pods_read(&a, &n.name, true) || !pods_read(&p, &n.name, false))
                .count();
            if waiting == 0 {
                break;
            }
            if t.elapsed() > Duration::from_secs(300) {
                return Err(format!("{waiting} nodes' pod watches not open after 300 s"));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        eprintln!(
            "fleet: {} agents and prefetchers started, pod watches open in {:.1} s",
            nodes.len(),
            t.elapsed().as_secs_f64()
        );
        Ok(agents)
    }
}

// === (a) idle ===

async fn idle(b: &Bench, agents: &HashMap<String, NodeAgent>, baseline_watches: f64) -> Value {
    let n = agents.len().max(1) as f64;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = api_samples(&b.k).await;
    b.k.proxy().clear_requests();
    b.prefetch_proxy.clear_requests();
    let pids: Vec<(Option<u32>, Option<u32>)> = agents.values().map(NodeAgent::pids).collect();
    let cpu0: Vec<(u64, u64)> = pids
        .iter()
        .map(|(a, p)| (a.map_or(0, cpu_ticks), p.map_or(0, cpu_ticks)))
        .collect();
    let t = Instant::now();
    tokio::time::sleep(b.opts.idle).await;
    let window = t.elapsed().as_secs_f64();
    let after = api_samples(&b.k).await;
    let agent_reqs = b.k.proxy().requests();
    let prefetch_reqs = b.prefetch_proxy.requests();
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut agent_cpu = Vec::new();
    let mut prefetch_cpu = Vec::new();
    for ((a, p), (a0, p0)) in pids.iter().zip(&cpu0) {
        if let Some(pid) = a {
            agent_cpu.push((cpu_ticks(*pid).saturating_sub(*a0)) as f64 / tick / window * 100.0);
        }
        if let Some(pid) = p {
            prefetch_cpu.push((cpu_ticks(*pid).saturating_sub(*p0)) as f64 / tick / window * 100.0);
        }
    }
    let rss: Vec<(u64, u64)> = agents.values().map(NodeAgent::rss_kib).collect();
    let agent_rss: Vec<f64> = rss.iter().map(|r| r.0 as f64 / 1024.0).collect();
    let prefetch_rss: Vec<f64> = rss.iter().map(|r| r.1 as f64 / 1024.0).collect();
    let beyond = |reqs: &[RecordedRequest]| reqs.iter().filter(|r| !is_watch(r)).count() as f64;
    let watches = |reqs: &[RecordedRequest]| reqs.iter().filter(|r| is_watch(r)).count() as f64;
    let open = open_watches(&after);
    let api_total = |s: &[Sample]| apimetrics::sum(s, "apiserver_request_total", |_| true);
    let api_rss =
        apimetrics::sum(&after, "process_resident_memory_bytes", |_| true) / (1 << 20) as f64;
    let api_cpu = (apimetrics::sum(&after, "process_cpu_seconds_total", |_| true)
        - apimetrics::sum(&before, "process_cpu_seconds_total", |_| true))
        / window
        * 100.0;
    let v = json!({
        "window_s": window,
        "agent_requests_per_s_per_node": beyond(&agent_reqs) / n / window,
        "prefetch_requests_per_s_per_node": beyond(&prefetch_reqs) / n / window,
        "requests_per_s_per_node": (beyond(&agent_reqs) + beyond(&prefetch_reqs)) / n / window,
        "watch_starts_per_s_per_node": (watches(&agent_reqs) + watches(&prefetch_reqs)) / n / window,
        "agent_kinds": kind_counts(&agent_reqs),
        "prefetch_kinds": kind_counts(&prefetch_reqs),
        "open_watches_per_node": (open - baseline_watches) / n,
        "open_watches_total": open,
        "open_watches_before_agents": baseline_watches,
        "agent_rss_mib": pstats(&agent_rss),
        "prefetch_rss_mib": pstats(&prefetch_rss),
        "agent_cpu_pct": pstats(&agent_cpu),
        "prefetch_cpu_pct": pstats(&prefetch_cpu),
        "apiserver_requests_per_s": (api_total(&after) - api_total(&before)) / window,
        "apiserver_rss_mib": api_rss,
        "apiserver_cpu_pct": api_cpu,
    });
    println!(
        "idle over {window:.0} s, {} nodes: {:.4} requests/s per node beyond watches (agent {:.4}, prefetcher {:.4}); watch (re)starts {:.4}/s per node; open watches per node {:.2}",
        agents.len(),
        v["requests_per_s_per_node"].as_f64().unwrap_or(f64::NAN),
        v["agent_requests_per_s_per_node"].as_f64().unwrap_or(f64::NAN),
        v["prefetch_requests_per_s_per_node"].as_f64().unwrap_or(f64::NAN),
        v["watch_starts_per_s_per_node"].as_f64().unwrap_or(f64::NAN),
        v["open_watches_per_node"].as_f64().unwrap_or(f64::NAN),
    );
    println!("  agent requests: {:?}", v["agent_kinds"]);
    println!("  prefetcher requests: {:?}", v["prefetch_kinds"]);
    println!(
        "  RSS per node: agent median {:.1} MiB (max {:.1}), prefetcher median {:.1} MiB (max {:.1}); CPU median agent {:.3} %, prefetcher {:.3} % of a core",
        v["agent_rss_mib"]["p50"].as_f64().unwrap_or(f64::NAN),
        v["agent_rss_mib"]["max"].as_f64().unwrap_or(f64::NAN),
        v["prefetch_rss_mib"]["p50"].as_f64().unwrap_or(f64::NAN),
        v["prefetch_rss_mib"]["max"].as_f64().unwrap_or(f64::NAN),
        v["agent_cpu_pct"]["p50"].as_f64().unwrap_or(f64::NAN),
        v["prefetch_cpu_pct"]["p50"].as_f64().unwrap_or(f64::NAN),
    );
    println!(
        "  API server: {:.1} requests/s in all (lease renewals of {} nodes included), RSS {:.0} MiB, CPU {:.1} % of a core",
        v["apiserver_requests_per_s"].as_f64().unwrap_or(f64::NAN),
        b.fleet.names().len(),
        api_rss,
        api_cpu
    );
    v
}

// === (b) the mass reclaim ===

/// Per node, the evictable pods still there (by uid), kept by a watch of all pods; and when
/// each node's set emptied.
struct Drained {
    left: Mutex<HashMap<String, HashSet<String>>>,
    at: Mutex<HashMap<String, Timestamp>>,
}

/// Watch every pod from now on; `nodes`' worker pods (not the trainer) are what must go.
async fn watch_drains(
    k: &TestCluster,
    nodes: &[&NodePlan],
) -> Result<(Arc<Drained>, tokio::task::JoinHandle<()>), String> {
    let api: Api<Pod> = Api::all(k.admin());
    let list = api
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("listing pods: {e}"))?;
    let wanted: HashSet<&str> = nodes.iter().map(|p| p.name.as_str()).collect();
    let mut left: HashMap<String, HashSet<String>> = nodes
        .iter()
        .map(|p| (p.name.clone(), HashSet::new()))
        .collect();
    for p in &list.items {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("");
        let name = p.metadata.name.as_deref().unwrap_or("");
        if wanted.contains(node) && !name.starts_with("trainer-") {
            if let (Some(set), Some(uid)) = (left.get_mut(node), p.metadata.uid.clone()) {
                set.insert(uid);
            }
        }
    }
    let drained = Arc::new(Drained {
        left: Mutex::new(left),
        at: Mutex::new(HashMap::new()),
    });
    let rv = list.metadata.resource_version.unwrap_or_default();
    let d = drained.clone();
    let task = tokio::spawn(async move {
        let mut rv = rv;
        loop {
            let Ok(stream) = api.watch(&WatchParams::default().timeout(290), &rv).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(WatchEvent::Deleted(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                        let node = p
                            .spec
                            .as_ref()
                            .and_then(|s| s.node_name.clone())
                            .unwrap_or_default();
                        let uid = p.metadata.uid.clone().unwrap_or_default();
                        let mut left = d.left.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(set) = left.get_mut(&node) {
                            if set.remove(&uid) && set.is_empty() {
                                d.at.lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .insert(node, Timestamp::now());
                            }
                        }
                    }
                    Ok(WatchEvent::Added(p)) | Ok(WatchEvent::Modified(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                    }
                    Ok(WatchEvent::Bookmark(bm)) => rv = bm.metadata.resource_version,
                    Ok(WatchEvent::Error(_)) | Err(_) => break,
                }
            }
        }
    });
    Ok((drained, task))
}

/// When the agent saw the notice: its "notice accepted" log line's time minus `seen_after_ms`.
fn seen_at(log: &str) -> Option<Timestamp> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "notice accepted")
        .and_then(|v| {
            let ts: Timestamp = v["timestamp"].as_str()?.parse().ok()?;
            let after = v["seen_after_ms"].as_i64().unwrap_or(0);
            Some(ts - Duration::from_millis(after.max(0) as u64))
        })
}

/// The deadline the agent gave the trainer (`notice.json`'s `deadline_unix`).
fn deadline_of(ckpt: &Path) -> Option<Timestamp> {
    let text = std::fs::read_to_string(ckpt.join("notice.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    Timestamp::from_second(v["deadline_unix"].as_i64()?).ok()
}

/// When the agent sent the checkpoint signal, by its own clock: its first "checkpoint signal
/// sent" log line (logged right after the signal, before any API call of the plan).
fn sent_at(log: &str) -> Option<Timestamp> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["message"] == "checkpoint signal sent")
        .and_then(|v| v["timestamp"].as_str()?.parse().ok())
}

fn received_at(out: &Path) -> Option<Timestamp> {
    let ns: i128 = std::fs::read_to_string(out).ok()?.trim().parse().ok()?;
    Timestamp::from_nanosecond(ns).ok()
}

fn metric_sum(text: &str, name: &str, filter: impl Fn(&BTreeMap<String, String>) -> bool) -> f64 {
    apimetrics::sum(&apimetrics::parse(text), name, filter)
}

/// `spotguard_errors_total` of `nodes`' agents by `module/error`, summed over the agents.
async fn agent_errors(
    nodes: &[&NodePlan],
    agents: &HashMap<String, NodeAgent>,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for p in nodes {
        let Some(a) = agents.get(&p.name) else {
            continue;
        };
        let Ok(text) = a.metrics().await else {
            continue;
        };
        for s in apimetrics::parse(&text)
            .into_iter()
            .filter(|s| s.name == "spotguard_errors_total" && s.value > 0.0)
        {
            let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
            *out.entry(format!("{}/{}", label("module"), label("error")))
                .or_insert(0.0) += s.value;
        }
    }
    out
}

/// Processes on this host: each agent's discovery reads every one of them, and the fleet puts
/// every node's processes on one host.
fn host_processes() -> usize {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
                .count()
        })
        .unwrap_or(0)
}

struct Notice {
    visible: Timestamp,
}

async fn interrupt(
    nodes: &[&NodePlan],
    agents: &HashMap<String, NodeAgent>,
    within: Duration,
) -> HashMap<String, Notice> {
    let mut order: Vec<&NodePlan> = nodes.to_vec();
    fastrand::shuffle(&mut order);
    let start = tokio::time::Instant::now();
    let mut out = HashMap::new();
    let step = within / order.len().max(1) as u32;
    for (i, p) in order.iter().enumerate() {
        tokio::time::sleep_until(start + step * i as u32).await;
        if let Some(a) = agents.get(&p.name) {
            match a
                .emulator
                .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(120)))
            {
                Ok(r) => {
                    out.insert(
                        p.name.clone(),
                        Notice {
                            visible: r.visible_at,
                        },
                    );
                }
                Err(e) => eprintln!("fleet: raising on {}: {e}", p.name),
            }
        }
    }
    out
}

async fn reclaim(b: &Bench, agents: &HashMap<String, NodeAgent>) -> Result<Value, String> {
    let nodes: Vec<&NodePlan> = b.plans.iter().filter(|p| p.reclaim).collect();
    let (drained, watch_task) = watch_drains(&b.k, &nodes).await?;
    let errors_before = agent_errors(&nodes, agents).await;
    let processes = host_processes();
    let pids: Vec<(Option<u32>, Option<u32>)> = agents.values().map(NodeAgent::pids).collect();
    let cpu = |pids: &[(Option<u32>, Option<u32>)]| -> (u64, u64) {
        pids.iter().fold((0, 0), |(a, p), (ap, pp)| {
            (a + ap.map_or(0, cpu_ticks), p + pp.map_or(0, cpu_ticks))
        })
    };
    let cpu0 = cpu(&pids);
    // Per agent, reclaimed or not: what one agent's plan costs beside what the box spends.
    let reclaimed: Vec<(bool, Option<u32>)> = agents
        .iter()
        .map(|(node, a)| (nodes.iter().any(|p| &p.name == node), a.pids().0))
        .collect();
    let per0: Vec<u64> = reclaimed
        .iter()
        .map(|(_, pid)| pid.map_or(0, cpu_ticks))
        .collect();
    let metrics_before = api_samples(&b.k).await;
    b.k.proxy().clear_requests();
    b.prefetch_proxy.clear_requests();
    let t0 = Instant::now();
    let notices = interrupt(&nodes, agents, Duration::from_secs(1)).await;
    // Until every node is drained, or well past the deadlines.
    let limit = Duration::from_secs(135);
    loop {
        let done = drained.at.lock().unwrap_or_else(|e| e.into_inner()).len();
        if done >= nodes.len() || t0.elapsed() > limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let window = t0.elapsed().as_secs_f64();
    // The plans finish (records, Events) a moment after the last pod went.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let metrics_after = api_samples(&b.k).await;
    let cpu1 = cpu(&pids);
    let per_agent = |want: bool| -> Value {
        let mut s: Vec<f64> = reclaimed
            .iter()
            .zip(&per0)
            .filter(|((r, _), _)| *r == want)
            .map(|((_, pid), c0)| pid.map_or(0, cpu_ticks).saturating_sub(*c0) as f64)
            .collect();
        s.sort_by(f64::total_cmp);
        let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        json!({
            "p50": percentile(&s, 50.0) / tick,
            "max": s.last().copied().unwrap_or(f64::NAN) / tick,
        })
    };
    watch_task.abort();
    let reqs = b.k.proxy().requests();
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let cpu_s = |s: &[Sample]| apimetrics::sum(s, "process_cpu_seconds_total", |_| true);
    let cpu_json = json!({
        "apiserver_s": cpu_s(&metrics_after) - cpu_s(&metrics_before),
        "agents_s": cpu1.0.saturating_sub(cpu0.0) as f64 / tick,
        "prefetchers_s": cpu1.1.saturating_sub(cpu0.1) as f64 / tick,
        "per_reclaimed_agent_s": per_agent(true),
        "per_other_agent_s": per_agent(false),
    });

    let drained_at = drained.at.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut signal_visible = Vec::new();
    let mut signal_seen = Vec::new();
    // Per agent, by its own clock: notice seen → signal sent (its own work, before the trainer
    // is scheduled to run its handler), and signal sent → handler ran (the box's scheduling).
    let mut agent_sent = Vec::new();
    let mut handler_lag = Vec::new();
    let mut drained_in = Vec::new();
    let mut margin = Vec::new();
    let mut missing = Vec::new();
    let mut per_node = BTreeMap::new();
    let logs = std::env::var_os("FLEET_LOGS").map(PathBuf::from);
    for p in &nodes {
        if let (Some(dir), Some(a)) = (&logs, agents.get(&p.name)) {
            let _ = std::fs::create_dir_all(dir);
            let _ = std::fs::write(dir.join(format!("{}.agent.log", p.name)), a.log());
        }
        let Some(notice) = notices.get(&p.name) else {
            missing.push(format!("{}: no notice raised", p.name));
            continue;
        };
        match received_at(&p.out) {
            Some(at) => {
                let visible = at.duration_since(notice.visible).as_secs_f64();
                signal_visible.push(visible);
                let log = agents.get(&p.name).map(NodeAgent::log).unwrap_or_default();
                let seen_ts = seen_at(&log);
                let sent_ts = sent_at(&log);
                let seen = seen_ts.map(|seen| at.duration_since(seen).as_secs_f64());
                if let Some(seen) = seen {
                    signal_seen.push(seen);
                }
                let own = seen_ts
                    .zip(sent_ts)
                    .map(|(seen, sent)| sent.duration_since(seen).as_secs_f64());
                let lag = sent_ts.map(|sent| at.duration_since(sent).as_secs_f64());
                agent_sent.extend(own);
                handler_lag.extend(lag);
                per_node.insert(
                    p.name.clone(),
                    json!({
                        "signal_from_visible_s": visible,
                        "signal_from_seen_s": seen,
                        "agent_seen_to_sent_s": own,
                        "sent_to_handler_s": lag,
                    }),
                );
            }
            None => missing.push(format!("{}: trainer not signalled", p.name)),
        }
        match drained_at.get(&p.name) {
            Some(at) => {
                drained_in.push(at.duration_since(notice.visible).as_secs_f64());
                match deadline_of(&p.ckpt) {
                    Some(deadline) => margin.push(deadline.duration_since(*at).as_secs_f64()),
                    None => missing.push(format!("{}: no notice.json", p.name)),
                }
            }
            None => missing.push(format!("{}: not drained", p.name)),
        }
    }
    let h = short_requests(&metrics_after).since(&short_requests(&metrics_before));
    let codes = requests_by_code(&metrics_after, &metrics_before);
    let proxy_errors: BTreeMap<String, usize> = reqs
        .iter()
        .filter(|r| r.status.is_some_and(|s| s >= 400))
        .fold(BTreeMap::new(), |mut m, r| {
            *m.entry(format!("{:?} {}", r.kind, r.status.unwrap_or(0)))
                .or_insert(0) += 1;
            m
        });
    let mut errors_during = agent_errors(&nodes, agents).await;
    for (k, v) in &errors_before {
        if let Some(x) = errors_during.get_mut(k) {
            *x -= v;
        }
    }
    errors_during.retain(|_, v| *v > 0.0);
    let agent_errors = errors_during.values().fold(0.0, |a, b| a + b);
    let mut blocked = 0.0;
    let mut stopped = Vec::new();
    for p in &nodes {
        if let Some(a) = agents.get(&p.name) {
            match a.metrics().await {
                Ok(text) => {
                    blocked += metric_sum(&text, "spotguard_drain_pods_total", |l| {
                        l.get("outcome").map(String::as_str) == Some("blocked")
                    });
                }
                Err(e) => stopped.push(format!("{}: {e}", p.name)),
            }
        }
    }
    // Peak pod GETs in one second.
    let mut per_second: BTreeMap<u64, usize> = BTreeMap::new();
    for r in reqs.iter().filter(|r| r.kind == RequestKind::PodGet) {
        *per_second
            .entry(r.at.saturating_duration_since(t0).as_secs())
            .or_insert(0) += 1;
    }
    let peak_gets = per_second.values().copied().max().unwrap_or(0);
    let v = json!({
        "nodes": nodes.len(),
        "pods_per_node": b.opts.pods,
        "grace_s": b.opts.grace,
        "window_s": window,
        "signal_from_visible_s": pstats(&signal_visible),
        "signal_from_seen_s": pstats(&signal_seen),
        "agent_seen_to_sent_s": pstats(&agent_sent),
        "sent_to_handler_s": pstats(&handler_lag),
        "drained_s": pstats(&drained_in),
        "margin_s": pstats(&margin),
        "api_p50_s": h.quantile(0.5),
        "api_p99_s": h.quantile(0.99),
        "api_requests": h.count,
        "api_codes": codes,
        "api_by_kind": latency_by_kind(&metrics_after, &metrics_before),
        "cpu_seconds": cpu_json,
        "agent_kinds": kind_counts(&reqs),
        "pod_gets": reqs.iter().filter(|r| r.kind == RequestKind::PodGet).count(),
        "peak_pod_gets_per_s": peak_gets,
        "proxy_errors": proxy_errors,
        "agent_errors": agent_errors,
        "agent_errors_by_kind": errors_during,
        "agent_errors_before": errors_before,
        "host_processes": processes,
        "blocked_pods": blocked,
        "problems": missing,
        "per_node": per_node,
        "agents_unreachable": stopped,
    });
    let sv = sorted(signal_visible);
    let ss = sorted(signal_seen);
    let own = sorted(agent_sent);
    let lag = sorted(handler_lag);
    let dr = sorted(drained_in);
    let mg = sorted(margin);
    println!(
        "reclaim: {} of {} nodes interrupted within 1 s ({} pods each, {} s grace, 2-minute notices)",
        nodes.len(),
        agents.len(),
        b.opts.pods,
        b.opts.grace
    );
    println!(
        "  notice visible → SIGUSR1: p50 {} p99 {} (max {}); agent saw it → SIGUSR1: p50 {} p99 {} (max {}); n={}",
        ms(percentile(&sv, 50.0)),
        ms(percentile(&sv, 99.0)),
        ms(sv.last().copied().unwrap_or(f64::NAN)),
        ms(percentile(&ss, 50.0)),
        ms(percentile(&ss, 99.0)),
        ms(ss.last().copied().unwrap_or(f64::NAN)),
        ss.len()
    );
    println!(
        "  per agent, its own clock: notice seen → signal sent p50 {} p99 {} (max {}); signal sent → trainer's handler ran p50 {} p99 {} (max {}); n={}",
        ms(percentile(&own, 50.0)),
        ms(percentile(&own, 99.0)),
        ms(own.last().copied().unwrap_or(f64::NAN)),
        ms(percentile(&lag, 50.0)),
        ms(percentile(&lag, 99.0)),
        ms(lag.last().copied().unwrap_or(f64::NAN)),
        own.len()
    );
    println!(
        "  notice → node drained: p50 {} p99 {}; margin to the deadline: min {} p50 {}",
        secs(percentile(&dr, 50.0)),
        secs(percentile(&dr, 99.0)),
        secs(mg.first().copied().unwrap_or(f64::NAN)),
        secs(percentile(&mg, 50.0)),
    );
    println!(
        "  API server during it: {:.0} requests, p50 {} p99 {} (long-running excluded); answers by code {:?}",
        h.count,
        ms(h.quantile(0.5)),
        ms(h.quantile(0.99)),
        v["api_codes"]
    );
    println!("  API server latency by kind: {:?}", v["api_by_kind"]);
    println!(
        "  CPU seconds over it: API server {:.1}, all agents {:.1}, all prefetchers {:.1}",
        v["cpu_seconds"]["apiserver_s"].as_f64().unwrap_or(f64::NAN),
        v["cpu_seconds"]["agents_s"].as_f64().unwrap_or(f64::NAN),
        v["cpu_seconds"]["prefetchers_s"]
            .as_f64()
            .unwrap_or(f64::NAN),
    );
    let f = |k: &str, q: &str| v["cpu_seconds"][k][q].as_f64().unwrap_or(f64::NAN);
    println!(
        "  CPU seconds per agent: reclaimed median {:.3} (max {:.3}), others median {:.3} (max {:.3})",
        f("per_reclaimed_agent_s", "p50"),
        f("per_reclaimed_agent_s", "max"),
        f("per_other_agent_s", "p50"),
        f("per_other_agent_s", "max"),
    );
    println!(
        "  agents' requests: {:?}; pod GETs {} (peak {}/s)",
        v["agent_kinds"], v["pod_gets"], peak_gets
    );
    println!(
        "  errors: non-2xx answers to the agents {:?}, agents' spotguard_errors_total during it {agent_errors} {:?} (before it {:?}), blocked pods {blocked}, problems {:?}",
        v["proxy_errors"], v["agent_errors_by_kind"], v["agent_errors_before"], v["problems"]
    );
    println!("  processes on the host (each agent's discovery reads them all): {processes}");
    Ok(v)
}

// === (c) single drains ===

async fn single_drain(b: &Bench, plan: &NodePlan) -> Result<Value, String> {
    let agents = b.start_agents(&[plan]).await?;
    let agent = agents.get(&plan.name).ok_or("no agent")?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (drained, watch_task) = watch_drains(&b.k, &[plan]).await?;
    b.k.proxy().clear_requests();
    let visible = agent
        .emulator
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?
        .visible_at;
    let t0 = Instant::now();
    loop {
        if drained
            .at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&plan.name)
        {
            break;
        }
        if t0.elapsed() > Duration::from_secs(130) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_at = drained
        .at
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&plan.name)
        .copied();
    let reqs: Vec<RecordedRequest> =
        b.k.proxy()
            .requests()
            .into_iter()
            .filter(|r| {
                r.path.contains(&plan.namespace)
                    || r.path.contains(&plan.name)
                    || r.query.contains(&plan.name)
            })
            .collect();
    watch_task.abort();
    let (pods, _) = plan.drain.unwrap_or_default();
    let took = drained_at.map(|at| at.duration_since(visible).as_secs_f64());
    let v = json!({
        "pods": pods,
        "drained_s": took,
        "requests": reqs.len(),
        "pod_gets": reqs.iter().filter(|r| r.kind == RequestKind::PodGet).count(),
        "evictions": reqs.iter().filter(|r| r.kind == RequestKind::Eviction).count(),
        "kinds": kind_counts(&reqs),
    });
    println!(
        "drain of {pods} pods (+ the trainer, which exits at the signal): notice → drained {}; {} requests from the agent: {:?}",
        took.map_or("never".into(), secs),
        reqs.len(),
        v["kinds"]
    );
    drop(agents);
    Ok(v)
}

async fn run(opts: Opts) -> Result<Value, String> {
    println!(
        "fleet bench: {} nodes × {} pods, agent binary {}",
        opts.n,
        opts.pods,
        opts.bin.display()
    );
    let b = setup(opts).await?;
    println!(
        "real API server {}; kubelet stand-in: one process, {} nodes, Lease renewals every 10 s",
        b.k.cp.assets.version,
        b.fleet.names().len()
    );
    let mut result = json!({
        "n": b.opts.n,
        "pods_per_node": b.opts.pods,
        "bin": b.opts.bin.display().to_string(),
        "version": b.k.cp.assets.version,
    });
    let fleet_nodes: Vec<&NodePlan> = b.plans.iter().filter(|p| p.drain.is_none()).collect();
    if !fleet_nodes.is_empty() && (b.opts.idle_on || b.opts.reclaim_on) {
        let baseline_watches = open_watches(&api_samples(&b.k).await);
        let mut agents = b.start_agents(&fleet_nodes).await?;
        if b.opts.idle_on {
            result["idle"] = idle(&b, &agents, baseline_watches).await;
        }
        if b.opts.reclaim_on {
            result["reclaim"] = reclaim(&b, &agents).await?;
        }
        let running = agents
            .values_mut()
            .map(|a| a.running())
            .filter(|r| *r)
            .count();
        result["agents_running_at_end"] = json!(running);
        println!(
            "{running} of {} agents (and prefetchers) still running",
            agents.len()
        );
    }
    if b.opts.drains_on {
        let mut drains = Vec::new();
        for plan in b.plans.iter().filter(|p| p.drain.is_some()) {
            drains.push(single_drain(&b, plan).await?);
        }
        result["drains"] = json!(drains);
    }
    println!(
        "peak RSS of the bench process (emulators, proxies, kubelet stand-in): {} KiB",
        status_kib(std::process::id(), "VmHWM:")
    );
    Ok(result)
}

fn raise_fd_limit() {
    // SAFETY: getrlimit / setrlimit on a local struct.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        usr1_stamp_child(Path::new(&args[2]));
    }
    raise_fd_limit();
    let opts = Opts::from_env();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot build a tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = opts.out.clone();
    match runtime.block_on(run(opts)) {
        Ok(v) => {
            if let Some(out) = out {
                let text = serde_json::to_string_pretty(&v).unwrap_or_default();
                if let Err(e) = std::fs::write(&out, text) {
                    eprintln!("writing {}: {e}", out.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fleet bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}
