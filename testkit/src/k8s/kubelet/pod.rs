//! One pod's life on a stand-in node: volumes, init containers, containers, readiness probes,
//! restarts, status reports, graceful deletion.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::BoundObjectReference;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Pod, Probe, Secret, Volume, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::{json, Value};
use spotguard::backoff::Backoff;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::sandbox::{Sandbox, RUNTIME_DEFAULT_CAPS};
use super::{lock, ContainerRun, Inner};
use crate::kubelet::{pod_cgroup, Qos};

/// How long a status report is retried before it is given up (logged).
const REPORT_FOR: Duration = Duration::from_secs(15);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// SIGKILL every process in `cgroup` until it is empty (bounded).
pub(super) fn kill_cgroup(cgroup: &Path) {
    for _ in 0..100 {
        let procs = std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.is_empty() {
            return;
        }
        for pid in pids {
            // SAFETY: plain kill(2).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Remove a container's cgroup and its now-empty pod slice.
pub(super) fn remove_cgroup(cgroup: &Path) {
    for _ in 0..50 {
        if std::fs::remove_dir(cgroup).is_ok() || !cgroup.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Some(slice) = cgroup.parent() {
        let _ = std::fs::remove_dir(slice);
    }
}

fn now() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .unwrap_or_else(|_| jiff::Timestamp::now())
        .to_string()
}

#[derive(Clone, Debug)]
enum State {
    Waiting {
        reason: String,
        message: String,
    },
    Running {
        started_at: String,
    },
    Terminated {
        exit_code: i32,
        reason: String,
        started_at: String,
        finished_at: String,
        container_id: String,
    },
}

impl State {
    fn json(&self) -> Value {
        match self {
            State::Waiting { reason, message } => {
                json!({ "waiting": { "reason": reason, "message": message } })
            }
            State::Running { started_at } => json!({ "running": { "startedAt": started_at } }),
            State::Terminated {
                exit_code,
                reason,
                started_at,
                finished_at,
                container_id,
            } => json!({ "terminated": {
                "exitCode": exit_code, "reason": reason, "startedAt": started_at,
                "finishedAt": finished_at, "containerID": container_id,
            }}),
        }
    }
}

struct CStatus {
    spec: Container,
    id: Option<String>,
    pid: Option<u32>,
    cgroup: Option<PathBuf>,
    state: State,
    last: Option<State>,
    restarts: i32,
    ready: bool,
    /// Bumped per start, so that a late exit of an older run is not taken for the new one.
    generation: u64,
    probe: Option<ProbeState>,
    restart_at: Option<Instant>,
}

impl CStatus {
    fn new(spec: &Container) -> CStatus {
        CStatus {
            spec: spec.clone(),
            id: None,
            pid: None,
            cgroup: None,
            state: State::Waiting {
                reason: "PodInitializing".into(),
                message: String::new(),
            },
            last: None,
            restarts: 0,
            ready: false,
            generation: 0,
            probe: None,
            restart_at: None,
        }
    }

    fn running(&self) -> bool {
        matches!(self.state, State::Running { .. })
    }

    /// The container ended with `code` (a run that began at `started_at`): not ready any more.
    fn terminate(&mut self, code: i32, started_at: String) {
        self.state = State::Terminated {
            exit_code: code,
            reason: if code == 0 { "Completed" } else { "Error" }.into(),
            started_at,
            finished_at: now(),
            container_id: self
                .id
                .as_ref()
                .map(|id| format!("containerd://{id}"))
                .unwrap_or_default(),
        };
        self.ready = false;
    }

    fn exit_code(&self) -> Option<i32> {
        match &self.state {
            State::Terminated { exit_code, .. } => Some(*exit_code),
            _ => None,
        }
    }

    fn json(&self) -> Value {
        let image = self.spec.image.clone().unwrap_or_default();
        let mut v = json!({
            "name": self.spec.name,
            "image": image,
            "imageID": format!("{image}@sha256:{}", "0".repeat(64)),
            "ready": self.ready,
            "started": self.running(),
            "restartCount": self.restarts,
            "state": self.state.json(),
        });
        if let Some(id) = &self.id {
            v["containerID"] = json!(format!("containerd://{id}"));
        }
        if let Some(last) = &self.last {
            v["lastState"] = last.json();
        }
        v
    }
}

struct ProbeState {
    probe: Probe,
    next_at: Instant,
    failures: i32,
    successes: i32,
}

struct Exit {
    index: usize,
    init: bool,
    generation: u64,
    code: i32,
}

struct PodRun {
    inner: Arc<Inner>,
    pod: Pod,
    ns: String,
    name: String,
    uid: String,
    qos: Qos,
    started: String,
    init: Vec<CStatus>,
    main: Vec<CStatus>,
    phase: &'static str,
    conditions: BTreeMap<&'static str, (bool, String)>,
    volumes: HashMap<String, PathBuf>,
    exits_tx: mpsc::UnboundedSender<Exit>,
    exits: mpsc::UnboundedReceiver<Exit>,
    waiters: Vec<tokio::task::JoinHandle<()>>,
}

/// The pod worker: runs until the pod is gone from the API server (or the node stops).
pub(super) async fn run(
    inner: Arc<Inner>,
    pod: Pod,
    updates: watch::Receiver<Pod>,
    gone: CancellationToken,
) {
    let (exits_tx, exits) = mpsc::unbounded_channel();
    let spec = pod.spec.clone().unwrap_or_default();
    let mut run = PodRun {
        ns: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        uid: pod.metadata.uid.clone().unwrap_or_default(),
        qos: Qos::parse(pod.status.as_ref().and_then(|s| s.qos_class.as_deref())),
        started: now(),
        init: spec
            .init_containers
            .iter()
            .flatten()
            .map(CStatus::new)
            .collect(),
        main: spec.containers.iter().map(CStatus::new).collect(),
        phase: "Pending",
        conditions: BTreeMap::new(),
        volumes: HashMap::new(),
        inner,
        pod,
        exits_tx,
        exits,
        waiters: Vec::new(),
    };
    let simulated = simulated(&run.pod);
    tokio::select! {
        _ = async {
            match simulated {
                Some(stop) => run.simulate(updates, stop).await,
                None => run.lifecycle(updates).await,
            }
        } => {}
        _ = gone.cancelled() => {}
    }
    run.kill_all();
    for w in &run.waiters {
        w.abort();
    }
    for c in run.init.iter().chain(&run.main) {
        if let Some(cg) = &c.cgroup {
            remove_cgroup(cg);
        }
    }
    let _ = std::fs::remove_dir_all(run.pod_dir().join("volumes"));
}

/// How a simulated pod ([`super::SIMULATED_ANNOTATION`]) stops once deleted: after this long
/// (`None`: it uses its whole grace period, like a process that ignores SIGTERM).
#[derive(Clone, Copy, Debug)]
pub(super) struct StopAfter(Option<Duration>);

fn simulated(pod: &Pod) -> Option<StopAfter> {
    let value = pod
        .metadata
        .annotations
        .as_ref()?
        .get(super::SIMULATED_ANNOTATION)?;
    if value == "grace" {
        return Some(StopAfter(None));
    }
    let secs: f64 = value.parse().ok()?;
    Some(StopAfter(Some(Duration::from_secs_f64(secs.max(0.0)))))
}

fn terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn deleting(pod: &Pod) -> Option<u64> {
    pod.metadata.deletion_timestamp.as_ref()?;
    Some(
        pod.metadata
            .deletion_grace_period_seconds
            .unwrap_or(30)
            .max(0) as u64,
    )
}

impl PodRun {
    fn pod_dir(&self) -> PathBuf {
        self.inner.root.join("pods").join(&self.uid)
    }

    fn restart_policy(&self) -> String {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into())
    }

    async fn lifecycle(&mut self, mut updates: watch::Receiver<Pod>) {
        if terminal(&self.pod) || deleting(&self.pod).is_some() {
            // Nothing of ours runs for it (finished before we saw it, or deleted unstarted).
            self.finish_deletion(&mut updates).await;
            return;
        }
        self.set_condition("PodScheduled", true);
        // Volume set-up is retried (a ConfigMap may appear later), as the kubelet does.
        let mut reported = String::new();
        while let Err((reason, message)) = self.prepare_volumes().await {
            if message != reported {
                for c in self.init.iter_mut().chain(self.main.iter_mut()) {
                    c.state = State::Waiting {
                        reason: reason.clone(),
                        message: message.clone(),
                    };
                }
                self.report().await;
                reported = message;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                changed = updates.changed() => {
                    if changed.is_err() { return; }
                    self.pod = updates.borrow().clone();
                }
            }
            if deleting(&self.pod).is_some() {
                self.finish_deletion(&mut updates).await;
                return;
            }
        }
        self.set_condition("PodReadyToStartContainers", true);
        // Init containers, one after the other.
        let mut i = 0;
        while i < self.init.len() {
            if let Err((reason, message)) = self.start(i, true).await {
                self.init[i].state = State::Waiting { reason, message };
                self.report().await;
                self.finish_deletion(&mut updates).await;
                return;
            }
            self.report().await;
            let code = loop {
                tokio::select! {
                    Some(exit) = self.exits.recv() => {
                        if exit.init && exit.index == i && exit.generation == self.init[i].generation {
                            self.on_exit(exit);
                            break self.init[i].exit_code().unwrap_or(1);
                        }
                    }
                    changed = updates.changed() => {
                        if changed.is_err() { return; }
                        self.pod = updates.borrow().clone();
                        if let Some(grace) = deleting(&self.pod) {
                            self.terminate(grace).await;
                            self.finish_deletion(&mut updates).await;
                            return;
                        }
                    }
                }
            };
            if code == 0 {
                i += 1;
            } else if self.restart_policy() == "Never" {
                self.phase = "Failed";
                self.report().await;
                self.finish_deletion(&mut updates).await;
                return;
            } else {
                self.init[i].restarts += 1;
                tokio::time::sleep(backoff(self.init[i].restarts)).await;
            }
        }
        self.set_condition("Initialized", true);
        for i in 0..self.main.len() {
            if let Err((reason, message)) = self.start(i, false).await {
                self.main[i].state = State::Waiting { reason, message };
            }
        }
        self.phase = "Running";
        self.update_ready();
        self.report().await;

        loop {
            let next_probe = self
                .main
                .iter()
                .filter(|c| c.running())
                .filter_map(|c| c.probe.as_ref().map(|p| p.next_at))
                .chain(self.main.iter().filter_map(|c| c.restart_at))
                .min()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                Some(exit) = self.exits.recv() => {
                    if self.on_exit(exit) {
                        self.after_exit().await;
                        if self.phase == "Succeeded" || self.phase == "Failed" {
                            self.finish_deletion(&mut updates).await;
                            return;
                        }
                    }
                }
                changed = updates.changed() => {
                    if changed.is_err() { return; }
                    self.pod = updates.borrow().clone();
                    if let Some(grace) = deleting(&self.pod) {
                        self.terminate(grace).await;
                        self.finish_deletion(&mut updates).await;
                        return;
                    }
                }
                _ = tokio::time::sleep_until(next_probe) => {
                    self.restart_due().await;
                    if self.probe_due().await {
                        self.report().await;
                    }
                }
            }
        }
    }

    /// A simulated pod: no process runs; its containers are reported Running and Ready at once,
    /// and once deleted it "stops" after `stop` (capped by its grace period; exit 0, or 137 when
    /// the grace period ran out), is reported terminated and removed as the kubelet does. For
    /// benches with many pods, where what matters is the API traffic, not the processes.
    async fn simulate(&mut self, mut updates: watch::Receiver<Pod>, stop: StopAfter) {
        if terminal(&self.pod) || deleting(&self.pod).is_some() {
            self.finish_deletion(&mut updates).await;
            return;
        }
        let started = now();
        for t in ["PodScheduled", "PodReadyToStartContainers", "Initialized"] {
            self.set_condition(t, true);
        }
        for c in self.main.iter_mut() {
            c.id = Some(crate::kubelet::container_id());
            c.state = State::Running {
                started_at: started.clone(),
            };
            c.ready = true;
        }
        self.phase = "Running";
        self.update_ready();
        self.report().await;
        let grace = loop {
            if let Some(grace) = deleting(&self.pod) {
                break grace;
            }
            if updates.changed().await.is_err() {
                return;
            }
            self.pod = updates.borrow().clone();
        };
        let grace = Duration::from_secs(grace);
        let (after, code) = match stop.0 {
            Some(d) if d < grace => (d, 0),
            _ => (grace, 137),
        };
        tokio::time::sleep(after).await;
        for c in self.main.iter_mut() {
            c.terminate(code, started.clone());
        }
        self.phase = if code == 0 { "Succeeded" } else { "Failed" };
        self.update_ready();
        self.report().await;
        self.finish_deletion(&mut updates).await;
    }

    /// A container exited: record it. `true` when it was the current run.
    fn on_exit(&mut self, exit: Exit) -> bool {
        let list = if exit.init {
            &mut self.init
        } else {
            &mut self.main
        };
        let Some(c) = list.get_mut(exit.index) else {
            return false;
        };
        if c.generation != exit.generation {
            return false;
        }
        let started_at = match &c.state {
            State::Running { started_at } => started_at.clone(),
            _ => now(),
        };
        c.terminate(exit.code, started_at);
        c.pid = None;
        true
    }

    /// After a main container exited on its own: restart it or finish the pod.
    async fn after_exit(&mut self) {
        let policy = self.restart_policy();
        for c in &mut self.main {
            if let Some(code) = c.exit_code() {
                let restart = policy == "Always" || (policy == "OnFailure" && code != 0);
                if restart && c.restart_at.is_none() {
                    c.restart_at = Some(Instant::now() + backoff(c.restarts + 1));
                }
            }
        }
        if self
            .main
            .iter()
            .all(|c| c.exit_code().is_some() && c.restart_at.is_none())
        {
            let ok = self.main.iter().all(|c| c.exit_code() == Some(0));
            self.phase = if ok { "Succeeded" } else { "Failed" };
        }
        self.update_ready();
        self.report().await;
    }

    async fn restart_due(&mut self) {
        let due: Vec<usize> = self
            .main
            .iter()
            .enumerate()
            .filter(|(_, c)| c.restart_at.is_some_and(|t| t <= Instant::now()))
            .map(|(i, _)| i)
            .collect();
        for i in due {
            self.main[i].restart_at = None;
            self.main[i].last = Some(self.main[i].state.clone());
            self.main[i].restarts += 1;
            if let Err((reason, message)) = self.start(i, false).await {
                self.main[i].state = State::Waiting { reason, message };
            }
            self.update_ready();
            self.report().await;
        }
    }

    /// Run due readiness probes; `true` when readiness changed.
    async fn probe_due(&mut self) -> bool {
        let mut changed = false;
        for i in 0..self.main.len() {
            let c = &self.main[i];
            if !c.running() {
                continue;
            }
            let Some(p) = c.probe.as_ref() else { continue };
            if p.next_at > Instant::now() {
                continue;
            }
            let ok = probe_once(&p.probe, &c.spec).await;
            let c = &mut self.main[i];
            if let Some(p) = c.probe.as_mut() {
                p.next_at = Instant::now()
                    + Duration::from_secs(p.probe.period_seconds.unwrap_or(10).max(1) as u64);
                if ok {
                    p.successes += 1;
                    p.failures = 0;
                } else {
                    p.failures += 1;
                    p.successes = 0;
                }
                let ready = if ok {
                    p.successes >= p.probe.success_threshold.unwrap_or(1)
                } else {
                    p.failures < p.probe.failure_threshold.unwrap_or(3) && c.ready
                };
                if ready != c.ready {
                    c.ready = ready;
                    changed = true;
                }
            }
        }
        if changed {
            self.update_ready();
        }
        changed
    }

    fn set_condition(&mut self, t: &'static str, status: bool) {
        match self.conditions.get(t) {
            Some((s, _)) if *s == status => {}
            _ => {
                self.conditions.insert(t, (status, now()));
            }
        }
    }

    fn update_ready(&mut self) {
        let ready = self.phase == "Running" && self.main.iter().all(|c| c.ready);
        self.set_condition("ContainersReady", ready);
        self.set_condition("Ready", ready);
    }

    /// The status as the kubelet reports it (strategic merge: conditions merge by type, so
    /// those others own, like DisruptionTarget, stay).
    async fn report(&mut self) {
        let conditions: Vec<Value> = self
            .conditions
            .iter()
            .map(|(t, (s, at))| {
                json!({ "type": t, "status": if *s { "True" } else { "False" }, "lastTransitionTime": at,
                        "lastProbeTime": Value::Null })
            })
            .collect();
        let mut status = json!({
            "phase": self.phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{ "ip": "127.0.0.1" }],
            "podIP": "127.0.0.1",
            "podIPs": [{ "ip": "127.0.0.1" }],
            "startTime": self.started,
            "containerStatuses": self.main.iter().map(CStatus::json).collect::<Vec<_>>(),
        });
        if !self.init.is_empty() {
            status["initContainerStatuses"] =
                json!(self.init.iter().map(CStatus::json).collect::<Vec<_>>());
        }
        let pods: Api<Pod> = Api::namespaced(self.inner.client.clone(), &self.ns);
        let patch = json!({ "status": status });
        // Retried for a while, as the kubelet's status manager does: a report lost to a busy API
        // server would leave the pod Pending for good (nothing here reports it again).
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let give_up = Instant::now() + REPORT_FOR;
        loop {
            let e = match pods
                .patch_status(
                    &self.name,
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e) => e,
            };
            let Some(delay) = backoff.next_delay_before(give_up) else {
                tracing::warn!(pod = %self.name, error = %e, attempts = backoff.failures(), "kubelet stand-in: status report lost");
                return;
            };
            tracing::debug!(pod = %self.name, error = %e, attempts = backoff.failures(), "kubelet stand-in: status report failed");
            tokio::time::sleep(delay).await;
        }
    }

    /// SIGTERM every running container, wait up to `grace`, then SIGKILL; report the terminal
    /// phase.
    async fn terminate(&mut self, grace: u64) {
        for c in self.init.iter().chain(&self.main) {
            if let (true, Some(pid)) = (c.running(), c.pid) {
                // SAFETY: plain kill(2) of our own child.
                unsafe {
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
        }
        for c in self.main.iter_mut() {
            c.restart_at = None;
        }
        let deadline = Instant::now() + Duration::from_secs(grace);
        self.wait_exits(deadline).await;
        if self.init.iter().chain(&self.main).any(CStatus::running) {
            for c in self.init.iter().chain(&self.main) {
                if let (true, Some(cg)) = (c.running(), &c.cgroup) {
                    kill_cgroup(cg);
                }
            }
            self.wait_exits(Instant::now() + Duration::from_secs(5))
                .await;
        }
        let all_ok = self
            .main
            .iter()
            .all(|c| c.exit_code().is_none_or(|code| code == 0));
        self.phase = if all_ok && self.main.iter().all(|c| c.exit_code().is_some()) {
            "Succeeded"
        } else {
            "Failed"
        };
        self.update_ready();
        self.report().await;
    }

    async fn wait_exits(&mut self, deadline: Instant) {
        while self.init.iter().chain(&self.main).any(CStatus::running) {
            tokio::select! {
                Some(exit) = self.exits.recv() => { self.on_exit(exit); }
                _ = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Wait for the pod's deletion to be requested, then remove it with grace 0 as the kubelet
    /// does once nothing runs any more. Returns when the pod is gone or the node stops (the
    /// caller is cancelled then).
    async fn finish_deletion(&mut self, updates: &mut watch::Receiver<Pod>) {
        loop {
            if deleting(&self.pod).is_some() {
                let pods: Api<Pod> = Api::namespaced(self.inner.client.clone(), &self.ns);
                let dp = DeleteParams {
                    grace_period_seconds: Some(0),
                    preconditions: Some(Preconditions {
                        uid: Some(self.uid.clone()),
                        resource_version: None,
                    }),
                    ..Default::default()
                };
                for _ in 0..10 {
                    match pods.delete(&self.name, &dp).await {
                        Ok(_) => break,
                        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => break,
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                // A finalizer may keep it: wait for it to go (the watch cancels us).
                std::future::pending::<()>().await;
            }
            if updates.changed().await.is_err() {
                return;
            }
            self.pod = updates.borrow().clone();
        }
    }

    fn kill_all(&mut self) {
        for c in self.init.iter().chain(&self.main) {
            if let Some(cg) = &c.cgroup {
                kill_cgroup(cg);
            }
        }
    }

    // === volumes ===

    async fn prepare_volumes(&mut self) -> Result<(), (String, String)> {
        let spec = self.pod.spec.clone().unwrap_or_default();
        for v in spec.volumes.iter().flatten() {
            let path = self.volume(v).await.map_err(|m| {
                (
                    "CreateContainerConfigError".to_string(),
                    format!("volume {}: {m}", v.name),
                )
            })?;
            self.volumes.insert(v.name.clone(), path);
        }
        Ok(())
    }

    async fn volume(&self, v: &Volume) -> Result<PathBuf, String> {
        let dir = self.pod_dir().join("volumes").join(&v.name);
        let mkdir = |p: &Path, mode: u32| -> Result<(), String> {
            use std::os::unix::fs::PermissionsExt;
            std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        if v.empty_dir.is_some() {
            // World-writable, as the kubelet makes an emptyDir.
            mkdir(&dir, 0o777)?;
            return Ok(dir);
        }
        if let Some(hp) = &v.host_path {
            let local = self.inner.map_host_path(Path::new(&hp.path));
            match hp.type_.as_deref().unwrap_or("") {
                "DirectoryOrCreate" if !local.exists() => mkdir(&local, 0o755)?,
                "Directory" if !local.is_dir() => {
                    return Err(format!(
                        "hostPath {} ({}) is not a directory",
                        hp.path,
                        local.display()
                    ))
                }
                "FileOrCreate" if !local.exists() => {
                    if let Some(parent) = local.parent() {
                        mkdir(parent, 0o755)?;
                    }
                    std::fs::write(&local, b"").map_err(|e| e.to_string())?;
                }
                "File" if !local.is_file() => {
                    return Err(format!("hostPath {} is not a file", hp.path))
                }
                _ => {}
            }
            return Ok(local);
        }
        if let Some(cm) = &v.config_map {
            mkdir(&dir, 0o755)?;
            let data = self.config_map(&cm.name).await?;
            write_items(&dir, &data, cm.items.as_deref().unwrap_or(&[]))?;
            return Ok(dir);
        }
        if let Some(s) = &v.secret {
            mkdir(&dir, 0o755)?;
            let name = s.secret_name.clone().unwrap_or_default();
            let data = self.secret(&name).await?;
            write_items(&dir, &data, s.items.as_deref().unwrap_or(&[]))?;
            return Ok(dir);
        }
        if let Some(p) = &v.projected {
            mkdir(&dir, 0o755)?;
            for source in p.sources.iter().flatten() {
                self.projection(&dir, source).await?;
            }
            return Ok(dir);
        }
        if let Some(d) = &v.downward_api {
            mkdir(&dir, 0o755)?;
            for item in d.items.iter().flatten() {
                let value = match &item.field_ref {
                    Some(f) => self.field(&f.field_path)?,
                    None => return Err("downwardAPI resourceFieldRef is not supported".into()),
                };
                write_file(&dir.join(&item.path), value.as_bytes())?;
            }
            return Ok(dir);
        }
        Err("this volume type is not supported by the kubelet stand-in (emptyDir, hostPath, configMap, secret, projected, downwardAPI are)".into())
    }

    async fn projection(&self, dir: &Path, source: &VolumeProjection) -> Result<(), String> {
        if let Some(t) = &source.service_account_token {
            let token = self.token(t.audience.clone(), t.expiration_seconds).await?;
            write_file(&dir.join(&t.path), token.as_bytes())?;
        }
        if let Some(cm) = &source.config_map {
            let data = self.config_map(&cm.name).await?;
            write_items(dir, &data, cm.items.as_deref().unwrap_or(&[]))?;
        }
        if let Some(s) = &source.secret {
            let data = self.secret(&s.name).await?;
            write_items(dir, &data, s.items.as_deref().unwrap_or(&[]))?;
        }
        if let Some(d) = &source.downward_api {
            for item in d.items.iter().flatten() {
                if let Some(f) = &item.field_ref {
                    write_file(&dir.join(&item.path), self.field(&f.field_path)?.as_bytes())?;
                }
            }
        }
        Ok(())
    }

    /// A token of the pod's ServiceAccount bound to the pod (TokenRequest, as the kubelet).
    async fn token(
        &self,
        audience: Option<String>,
        expiration: Option<i64>,
    ) -> Result<String, String> {
        let sa = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into());
        let spec = crate::k8s::controlplane::TokenSpec {
            audience,
            expiration_seconds: Some(expiration.unwrap_or(3607).max(3600)),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(self.name.clone()),
                uid: Some(self.uid.clone()),
            }),
        };
        crate::k8s::controlplane::mint(&self.inner.client, &self.ns, &sa, spec).await
    }

    async fn config_map(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let api: Api<ConfigMap> = Api::namespaced(self.inner.client.clone(), &self.ns);
        let cm = api
            .get(name)
            .await
            .map_err(|e| format!("configmap {}/{name}: {}", self.ns, api_message(&e)))?;
        let mut out: BTreeMap<String, Vec<u8>> = cm
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.into_bytes()))
            .collect();
        out.extend(
            cm.binary_data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0)),
        );
        Ok(out)
    }

    async fn secret(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, String> {
        let api: Api<Secret> = Api::namespaced(self.inner.client.clone(), &self.ns);
        let s = api
            .get(name)
            .await
            .map_err(|e| format!("secret {}/{name}: {}", self.ns, api_message(&e)))?;
        let mut out: BTreeMap<String, Vec<u8>> = s
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        out.extend(
            s.string_data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes())),
        );
        Ok(out)
    }

    /// A Downward API field.
    fn field(&self, path: &str) -> Result<String, String> {
        let m = &self.pod.metadata;
        let spec = self.pod.spec.clone().unwrap_or_default();
        let from_map = |map: &Option<BTreeMap<String, String>>, rest: &str| {
            let key = rest.trim_start_matches("['").trim_end_matches("']");
            map.as_ref()
                .and_then(|m| m.get(key).cloned())
                .unwrap_or_default()
        };
        Ok(match path {
            "metadata.name" => m.name.clone().unwrap_or_default(),
            "metadata.namespace" => m.namespace.clone().unwrap_or_default(),
            "metadata.uid" => m.uid.clone().unwrap_or_default(),
            "spec.nodeName" => spec.node_name.unwrap_or_default(),
            "spec.serviceAccountName" => spec.service_account_name.unwrap_or_default(),
            "status.hostIP" | "status.podIP" | "status.hostIPs" | "status.podIPs" => {
                "127.0.0.1".into()
            }
            p if p.starts_with("metadata.labels[") => from_map(&m.labels, &p[15..]),
            p if p.starts_with("metadata.annotations[") => from_map(&m.annotations, &p[20..]),
            other => return Err(format!("fieldRef {other} is not supported")),
        })
    }

    // === containers ===

    async fn env(
        &self,
        c: &Container,
        image: Option<&super::Image>,
    ) -> Result<Vec<(String, String)>, (String, String)> {
        let err = |m: String| ("CreateContainerConfigError".to_string(), m);
        let host_network = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.host_network)
            .unwrap_or(false);
        let mut env: Vec<(String, String)> = vec![
            ("PATH".into(), DEFAULT_PATH.into()),
            (
                "HOSTNAME".into(),
                if host_network {
                    self.inner.node.clone()
                } else {
                    self.name.clone()
                },
            ),
        ];
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(x, _)| *x != k);
            env.push((k, v));
        };
        for (k, v) in image.map(|i| i.env.clone()).unwrap_or_default() {
            set(&mut env, k, v);
        }
        let port = self.inner.cp.port.to_string();
        for (k, v) in [
            ("KUBERNETES_SERVICE_HOST", "127.0.0.1".to_string()),
            ("KUBERNETES_SERVICE_PORT", port.clone()),
            ("KUBERNETES_SERVICE_PORT_HTTPS", port.clone()),
            ("KUBERNETES_PORT", format!("tcp://127.0.0.1:{port}")),
        ] {
            set(&mut env, k.to_string(), v);
        }
        for e in c.env.iter().flatten() {
            let value = if let Some(v) = &e.value {
                expand(v, &env)
            } else if let Some(from) = &e.value_from {
                if let Some(f) = &from.field_ref {
                    self.field(&f.field_path).map_err(err)?
                } else if let Some(k) = &from.config_map_key_ref {
                    let data = self.config_map(&k.name).await.map_err(err)?;
                    match data.get(&k.key) {
                        Some(v) => String::from_utf8_lossy(v).into_owned(),
                        None if k.optional == Some(true) => continue,
                        None => {
                            return Err(err(format!("configmap {} has no key {}", k.name, k.key)))
                        }
                    }
                } else if let Some(k) = &from.secret_key_ref {
                    let data = self.secret(&k.name).await.map_err(err)?;
                    match data.get(&k.key) {
                        Some(v) => String::from_utf8_lossy(v).into_owned(),
                        None if k.optional == Some(true) => continue,
                        None => return Err(err(format!("secret {} has no key {}", k.name, k.key))),
                    }
                } else {
                    return Err(err(format!(
                        "env {}: resourceFieldRef is not supported",
                        e.name
                    )));
                }
            } else {
                String::new()
            };
            set(&mut env, e.name.clone(), value);
        }
        if c.env_from.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(err(
                "envFrom is not supported by the kubelet stand-in".into()
            ));
        }
        Ok(env)
    }

    /// Start container `index` (an init container when `init`).
    async fn start(&mut self, index: usize, init: bool) -> Result<(), (String, String)> {
        let spec = if init {
            self.init[index].spec.clone()
        } else {
            self.main[index].spec.clone()
        };
        let image_name = spec.image.clone().unwrap_or_default();
        let image = self.inner.config.images.get(&image_name).cloned();
        let command = spec.command.clone().unwrap_or_default();
        let mut argv: Vec<String> = if !command.is_empty() {
            command
        } else if let Some(i) = &image {
            i.entrypoint.clone()
        } else {
            Vec::new()
        };
        if argv.is_empty() && image.as_ref().is_none_or(|i| i.cmd.is_empty()) {
            return Err((
                "ErrImagePull".into(),
                format!(
                    "image {image_name:?} is not known to the kubelet stand-in and the container has no command"
                ),
            ));
        }
        match &spec.args {
            Some(a) if !a.is_empty() => argv.extend(a.iter().cloned()),
            _ if spec.command.as_ref().is_none_or(|c| c.is_empty()) => {
                argv.extend(image.as_ref().map(|i| i.cmd.clone()).unwrap_or_default())
            }
            _ => {}
        }
        let env = self.env(&spec, image.as_ref()).await?;
        let argv: Vec<String> = argv.iter().map(|a| expand(a, &env)).collect();

        let fail = |m: String| ("RunContainerError".to_string(), m);
        let container_id = crate::kubelet::container_id();
        let cgroup = pod_cgroup(&self.inner.cgroup_root, self.qos, &self.uid, &container_id);
        let log_dir = self
            .inner
            .root
            .join("logs")
            .join(format!("{}_{}_{}", self.ns, self.name, self.uid))
            .join(&spec.name);
        std::fs::create_dir_all(&log_dir).map_err(|e| fail(e.to_string()))?;
        let restarts = if init {
            self.init[index].restarts
        } else {
            self.main[index].restarts
        };
        let log = log_dir.join(format!("{restarts}.log"));
        let out = std::fs::File::create(&log).map_err(|e| fail(e.to_string()))?;
        let err_out = out.try_clone().map_err(|e| fail(e.to_string()))?;

        // Security context: the container's over the pod's.
        let pod_sc = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.security_context.clone())
            .unwrap_or_default();
        let sc = spec.security_context.clone().unwrap_or_default();
        let uid = sc.run_as_user.or(pod_sc.run_as_user).unwrap_or(0) as u32;
        let gid = sc.run_as_group.or(pod_sc.run_as_group).unwrap_or(0) as u32;
        let mut groups: Vec<u32> = pod_sc
            .supplemental_groups
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|g| g as u32)
            .collect();
        if let Some(fs) = pod_sc.fs_group {
            groups.push(fs as u32);
        }
        let mut sandbox = Sandbox::new(uid, gid);
        sandbox.groups(groups);
        sandbox.cgroup(&cgroup).map_err(|e| fail(e.to_string()))?;
        if sc.privileged != Some(true) {
            let caps = sc.capabilities.clone().unwrap_or_default();
            let drop_all = caps
                .drop
                .iter()
                .flatten()
                .any(|c| c.eq_ignore_ascii_case("ALL"));
            let mut keep: Vec<String> = if drop_all {
                Vec::new()
            } else {
                RUNTIME_DEFAULT_CAPS
                    .iter()
                    .map(|c| c.to_string())
                    .filter(|c| {
                        !caps
                            .drop
                            .iter()
                            .flatten()
                            .any(|d| d.trim_start_matches("CAP_").eq_ignore_ascii_case(c))
                    })
                    .collect()
            };
            keep.extend(caps.add.iter().flatten().cloned());
            sandbox.keep_caps(&keep).map_err(|e| fail(e.to_string()))?;
        }
        sandbox.no_new_privs(sc.allow_privilege_escalation == Some(false));
        sandbox.read_only_root(sc.read_only_root_filesystem == Some(true));
        let workdir = spec
            .working_dir
            .clone()
            .map(PathBuf::from)
            .or_else(|| image.as_ref().and_then(|i| i.workdir.clone()))
            .unwrap_or_else(|| PathBuf::from("/"));
        let mut binds: Vec<(PathBuf, PathBuf, bool)> = image
            .as_ref()
            .map(|i| {
                i.files
                    .iter()
                    .map(|(h, c)| (h.clone(), c.clone(), true))
                    .collect()
            })
            .unwrap_or_default();
        for m in spec.volume_mounts.iter().flatten() {
            let Some(src) = self.volumes.get(&m.name) else {
                return Err(fail(format!("volumeMount {}: no such volume", m.name)));
            };
            let mut src = src.clone();
            if let Some(sub) = m.sub_path.as_deref().filter(|s| !s.is_empty()) {
                src = src.join(sub);
                if !src.exists() {
                    std::fs::create_dir_all(&src).map_err(|e| fail(e.to_string()))?;
                }
            }
            binds.push((src, PathBuf::from(&m.mount_path), m.read_only == Some(true)));
        }
        for (src, dst, ro) in &binds {
            let tmpfs_under = self.mountpoint(src, dst).map_err(fail)?;
            sandbox
                .bind(src, dst, *ro, tmpfs_under.as_deref())
                .map_err(|e| fail(format!("volume at {}: {e}", dst.display())))?;
        }
        sandbox.workdir(&workdir).map_err(|e| fail(e.to_string()))?;
        let mut argv = argv;
        if let Some(program) = hidden(&argv[0], &binds) {
            argv[0] = unhidden(&program).map_err(|e| {
                fail(format!(
                    "a copy of {} outside the container's volumes: {e}",
                    program.display()
                ))
            })?;
        }

        let mut cmd = tokio::process::Command::new(&argv[0]);
        cmd.args(&argv[1..])
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err_out)
            .kill_on_drop(true);
        sandbox.apply(&mut cmd);
        std::fs::create_dir_all(&cgroup)
            .map_err(|e| fail(format!("cgroup {}: {e}", cgroup.display())))?;
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                remove_cgroup(&cgroup);
                return Err(fail(format!("starting {:?}: {e}", argv[0])));
            }
        };
        let pid = child.id().unwrap_or(0);
        let c = if init {
            &mut self.init[index]
        } else {
            &mut self.main[index]
        };
        c.generation += 1;
        c.id = Some(container_id.clone());
        c.pid = Some(pid);
        c.cgroup = Some(cgroup.clone());
        c.state = State::Running { started_at: now() };
        c.ready = init || spec.readiness_probe.is_none();
        c.probe = (!init)
            .then(|| spec.readiness_probe.clone())
            .flatten()
            .map(|probe| ProbeState {
                next_at: Instant::now()
                    + Duration::from_secs(probe.initial_delay_seconds.unwrap_or(0).max(0) as u64),
                probe,
                failures: 0,
                successes: 0,
            });
        let generation = c.generation;
        lock(&self.inner.runs).push(ContainerRun {
            namespace: self.ns.clone(),
            pod: self.name.clone(),
            uid: self.uid.clone(),
            container: spec.name.clone(),
            container_id,
            pid,
            cgroup,
            log,
        });
        let tx = self.exits_tx.clone();
        self.waiters.push(tokio::spawn(async move {
            let code = match child.wait().await {
                Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
                Err(_) => 128 + 9,
            };
            let _ = tx.send(Exit {
                index,
                init,
                generation,
                code,
            });
        }));
        Ok(())
    }

    /// Make sure `dst` exists on the host to mount `src` on (like a runtime creating mountpoints
    /// in a rootfs); remember what was created. Where it cannot be created (under sysfs, say:
    /// `/sys/class/dmi/id` on a machine without DMI), the deepest existing ancestor, to cover
    /// with a tmpfs inside the container.
    fn mountpoint(&self, src: &Path, dst: &Path) -> Result<Option<PathBuf>, String> {
        if dst.exists() {
            return Ok(None);
        }
        let mut created = Vec::new();
        let mut p = dst.to_path_buf();
        while !p.exists() {
            created.push(p.clone());
            if !p.pop() {
                break;
            }
        }
        let made = if src.is_dir() {
            std::fs::create_dir_all(dst)
        } else {
            dst.parent()
                .map_or(Ok(()), std::fs::create_dir_all)
                .and_then(|()| std::fs::write(dst, b""))
        };
        if let Err(e) = made {
            if src.is_dir()
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EPERM | libc::EROFS | libc::EACCES | libc::ENOENT)
                )
            {
                for c in &created {
                    let _ = std::fs::remove_dir(c);
                }
                return Ok(Some(p));
            }
            return Err(format!("mountpoint {}: {e}", dst.display()));
        }
        let mut mps = lock(&self.inner.mountpoints);
        for c in created.into_iter().rev() {
            mps.push(c);
        }
        Ok(None)
    }
}

fn api_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

fn backoff(restarts: i32) -> Duration {
    let secs = 1u64 << (restarts.clamp(1, 6) - 1);
    Duration::from_secs(secs.min(30))
}

/// `$(VAR)` references expanded from `env` (`$$` escapes), as the kubelet does.
fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(r) = after.strip_prefix('$') {
            out.push('$');
            rest = r;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(end) => {
                    let name = &inner[..end];
                    match env.iter().rev().find(|(k, _)| k == name) {
                        Some((_, v)) => out.push_str(v),
                        None => out.push_str(&format!("$({name})")),
                    }
                    rest = &inner[end + 1..];
                }
                None => {
                    out.push('$');
                    rest = after;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

fn write_file(path: &Path, data: &[u8]) -> Result<(), String> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
    }
    std::fs::write(path, data).map_err(|e| format!("{}: {e}", path.display()))
}

fn write_items(
    dir: &Path,
    data: &BTreeMap<String, Vec<u8>>,
    items: &[k8s_openapi::api::core::v1::KeyToPath],
) -> Result<(), String> {
    if items.is_empty() {
        for (k, v) in data {
            write_file(&dir.join(k), v)?;
        }
        return Ok(());
    }
    for item in items {
        let v = data
            .get(&item.key)
            .ok_or_else(|| format!("no key {}", item.key))?;
        write_file(&dir.join(&item.path), v)?;
    }
    Ok(())
}

fn port_of(port: &IntOrString, c: &Container) -> Option<u16> {
    match port {
        IntOrString::Int(p) => u16::try_from(*p).ok(),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok()),
    }
}

/// One readiness probe (httpGet, tcpSocket or exec) against the container on this host.
async fn probe_once(p: &Probe, c: &Container) -> bool {
    let timeout = Duration::from_secs(p.timeout_seconds.unwrap_or(1).max(1) as u64);
    if let Some(h) = &p.http_get {
        let Some(port) = port_of(&h.port, c) else {
            return false;
        };
        let url = format!(
            "http://127.0.0.1:{port}{}",
            h.path.as_deref().unwrap_or("/")
        );
        let Ok(client) = reqwest::Client::builder().timeout(timeout).build() else {
            return false;
        };
        return client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success() || r.status().is_redirection());
    }
    if let Some(t) = &p.tcp_socket {
        let Some(port) = port_of(&t.port, c) else {
            return false;
        };
        return tokio::time::timeout(timeout, tokio::net::TcpStream::connect(("127.0.0.1", port)))
            .await
            .is_ok_and(|r| r.is_ok());
    }
    if let Some(e) = &p.exec {
        let argv = e.command.clone().unwrap_or_default();
        let Some((prog, args)) = argv.split_first() else {
            return false;
        };
        return tokio::time::timeout(
            timeout,
            tokio::process::Command::new(prog)
                .args(args)
                .kill_on_drop(true)
                .status(),
        )
        .await
        .is_ok_and(|r| r.is_ok_and(|s| s.success()));
    }
    false
}

/// The program at `program` when the container's own mounts hide it: the deepest bind over its
/// path shows something else there (a checkout under /tmp, where the DaemonSet mounts an
/// emptyDir, runs a binary under /tmp).
fn hidden(program: &str, binds: &[(PathBuf, PathBuf, bool)]) -> Option<PathBuf> {
    let p = Path::new(program);
    if !p.is_absolute() {
        return None;
    }
    let (src, dst, _) = binds
        .iter()
        .filter(|(_, dst, _)| p.starts_with(dst))
        .max_by_key(|(_, dst, _)| dst.components().count())?;
    let seen = src.join(p.strip_prefix(dst).ok()?);
    (seen != p).then(|| p.to_path_buf())
}

/// A copy of `program` where no container mounts anything (/dev/shm), named by its path, size
/// and mtime so that pods starting together share one copy (made by rename) and a rebuilt
/// program gets a new one. World-executable: containers run as other users too.
fn unhidden(program: &Path) -> std::io::Result<String> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(program)?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    program.hash(&mut h);
    meta.len().hash(&mut h);
    meta.modified()?.hash(&mut h);
    let name = program
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let copy = Path::new("/dev/shm").join(format!("spotguard-testkit-{:016x}-{name}", h.finish()));
    if !copy.exists() {
        let tmp = copy.with_extension(format!("tmp-{}", crate::kubelet::container_id()));
        std::fs::copy(program, &tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &copy)?;
    }
    Ok(copy.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variable_references_expand_like_the_kubelet() {
        let env = vec![
            ("A".to_string(), "1".to_string()),
            ("B".to_string(), "x y".to_string()),
        ];
        assert_eq!(expand("$(A)-$(B)", &env), "1-x y");
        assert_eq!(expand("$(C)", &env), "$(C)");
        assert_eq!(expand("$$(A)", &env), "$(A)");
        assert_eq!(expand("cost $5 $(A", &env), "cost $5 $(A");
    }

    #[test]
    fn restart_backoff_doubles_to_a_cap() {
        assert_eq!(backoff(1), Duration::from_secs(1));
        assert_eq!(backoff(2), Duration::from_secs(2));
        assert_eq!(backoff(10), Duration::from_secs(30));
    }

    #[test]
    fn a_program_under_a_volume_mounted_over_its_path_is_hidden() {
        let vol = (
            PathBuf::from("/var/k/emptydir/tmp"),
            PathBuf::from("/tmp"),
            false,
        );
        let same = (PathBuf::from("/opt/img"), PathBuf::from("/opt/img"), true);
        let binds = vec![vol, same];
        assert_eq!(
            hidden("/tmp/ci/target/debug/spotguard", &binds),
            Some(PathBuf::from("/tmp/ci/target/debug/spotguard"))
        );
        assert_eq!(hidden("/work/target/debug/spotguard", &binds), None);
        assert_eq!(hidden("/opt/img/bin/x", &binds), None);
        assert_eq!(hidden("spotguard", &binds), None);
    }
}
