//! Many stand-in nodes served by one set of tasks: for fleet benches with 100+ nodes, where a
//! [`super::Kubelet`] per node (its own client, heartbeat task and pod watch) would cost more
//! than what is measured.
//!
//! One client; one heartbeat task that renews every node's Lease once per 10 s (the kubelet's
//! cadence), spread evenly over the 10 s, and reports each node's status every 5 minutes; one
//! watch of all pods, each handed to the worker of the node it is bound to (pods of other nodes
//! are ignored). Pods run exactly as under [`super::Kubelet`]: real processes, or no process for
//! a simulated pod ([`super::SIMULATED_ANNOTATION`]). Dropping the fleet stops every node and
//! deletes the Node objects.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tokio_util::sync::CancellationToken;

use super::{
    beat, create_node, delete_node_objects, lock, not_ready, sync_pod, ContainerRun, Inner,
    NodeConfig, LEASE_RENEW,
};
use crate::k8s::controlplane::ControlPlane;

/// Registrations in flight at once.
const REGISTER_CONCURRENCY: usize = 8;
/// How long registration waits for the control plane to treat every node as Ready.
const READY_WAIT: Duration = Duration::from_secs(120);

/// A running fleet of stand-in nodes.
pub struct Fleet {
    cp: &'static ControlPlane,
    nodes: Arc<HashMap<String, Arc<Inner>>>,
    order: Vec<String>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl Fleet {
    /// Register every node of `configs` (replacing nodes of those names), wait until the
    /// control plane treats them all as Ready, and start serving them.
    pub async fn start(
        cp: &'static ControlPlane,
        configs: Vec<NodeConfig>,
    ) -> Result<Fleet, String> {
        let dir = tempfile::Builder::new()
            .prefix("kubelet-fleet-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        let client = cp.admin();
        let stop = CancellationToken::new();
        let mut nodes = HashMap::new();
        let mut order = Vec::new();
        for config in configs {
            let root = dir.path().join(&config.name);
            std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
            order.push(config.name.clone());
            nodes.insert(
                config.name.clone(),
                Arc::new(Inner {
                    node: config.name.clone(),
                    client: client.clone(),
                    cp,
                    root,
                    cgroup_root: crate::kubelet::cgroup_root(),
                    config,
                    runs: Mutex::new(Vec::new()),
                    pods: Mutex::new(HashMap::new()),
                    mountpoints: Mutex::new(Vec::new()),
                    stop: stop.child_token(),
                }),
            );
        }
        let fleet = Fleet {
            cp,
            nodes: Arc::new(nodes),
            order,
            stop,
            tasks: Vec::new(),
            _dir: dir,
        };
        let results: Vec<Result<(), String>> = futures::stream::iter(fleet.order.clone())
            .map(|name| {
                let inner = fleet.nodes[&name].clone();
                async move { create_node(&inner).await }
            })
            .buffer_unordered(REGISTER_CONCURRENCY)
            .collect()
            .await;
        if let Some(e) = results.into_iter().find_map(Result::err) {
            return Err(e);
        }
        let uids = fleet.wait_ready(&client).await?;
        let mut fleet = fleet;
        fleet.tasks.push(tokio::spawn(heartbeats(
            fleet.nodes.clone(),
            fleet.order.clone(),
            uids,
            fleet.stop.clone(),
        )));
        fleet
            .tasks
            .push(tokio::spawn(watch_pods(client, fleet.nodes.clone())));
        Ok(fleet)
    }

    /// Until no node of the fleet has the not-ready taint; each node's uid.
    async fn wait_ready(&self, client: &kube::Client) -> Result<HashMap<String, String>, String> {
        let api: Api<Node> = Api::all(client.clone());
        let start = tokio::time::Instant::now();
        loop {
            let list = api
                .list(&ListParams::default())
                .await
                .map_err(|e| format!("listing nodes: {e}"))?;
            let ours: Vec<&Node> = list
                .items
                .iter()
                .filter(|n| {
                    n.metadata
                        .name
                        .as_ref()
                        .is_some_and(|name| self.nodes.contains_key(name))
                })
                .collect();
            let waiting = ours.iter().filter(|n| not_ready(n)).count();
            if ours.len() == self.nodes.len() && waiting == 0 {
                return Ok(ours
                    .iter()
                    .filter_map(|n| Some((n.metadata.name.clone()?, n.metadata.uid.clone()?)))
                    .collect());
            }
            if start.elapsed() > READY_WAIT {
                return Err(format!(
                    "{} of {} fleet nodes not Ready after {READY_WAIT:?} (logs in {})",
                    waiting + self.nodes.len() - ours.len(),
                    self.nodes.len(),
                    self.cp.logs_dir().display()
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The nodes' names, in the order given.
    pub fn names(&self) -> &[String] {
        &self.order
    }

    /// Node `name`'s own directory (its "disk").
    pub fn root(&self, name: &str) -> Option<&Path> {
        self.nodes.get(name).map(|i| i.root.as_path())
    }

    /// Every container process started on node `name` so far, oldest first.
    pub fn runs(&self, name: &str) -> Vec<ContainerRun> {
        self.nodes
            .get(name)
            .map(|i| lock(&i.runs).clone())
            .unwrap_or_default()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for inner in self.nodes.values() {
            inner.stop_node();
        }
        delete_node_objects(self.cp, self.order.clone());
    }
}

/// Every node's Lease renewed once per [`LEASE_RENEW`], the renewals spread evenly over it.
async fn heartbeats(
    nodes: Arc<HashMap<String, Arc<Inner>>>,
    order: Vec<String>,
    uids: HashMap<String, String>,
    stop: CancellationToken,
) {
    let n = order.len().max(1) as u32;
    let mut last_status: HashMap<String, tokio::time::Instant> = order
        .iter()
        .map(|name| (name.clone(), tokio::time::Instant::now()))
        .collect();
    let mut round = tokio::time::Instant::now();
    loop {
        round += LEASE_RENEW;
        for (i, name) in order.iter().enumerate() {
            let at = round + LEASE_RENEW / n * i as u32;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep_until(at) => {}
            }
            let (Some(inner), Some(uid), Some(last)) =
                (nodes.get(name), uids.get(name), last_status.get_mut(name))
            else {
                continue;
            };
            beat(inner, uid, last).await;
        }
    }
}

/// List + watch every pod; each goes to the worker of its node.
async fn watch_pods(client: kube::Client, nodes: Arc<HashMap<String, Arc<Inner>>>) {
    let pods: Api<Pod> = Api::all(client);
    let node_of = |p: &Pod| {
        p.spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .and_then(|n| nodes.get(n))
            .cloned()
    };
    loop {
        let list = match pods.list(&ListParams::default()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "kubelet fleet: listing pods");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let mut rv = list.metadata.resource_version.clone().unwrap_or_default();
        for p in list.items {
            if let Some(inner) = node_of(&p) {
                sync_pod(&inner, p);
            }
        }
        'watch: loop {
            let wp = WatchParams::default().timeout(290);
            let stream = match pods.watch(&wp, &rv).await {
                Ok(s) => s,
                Err(_) => break 'watch,
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(ev) = stream.next().await {
                match ev {
                    Ok(WatchEvent::Added(p)) | Ok(WatchEvent::Modified(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                        if let Some(inner) = node_of(&p) {
                            sync_pod(&inner, p);
                        }
                    }
                    Ok(WatchEvent::Deleted(p)) => {
                        rv = p.metadata.resource_version.clone().unwrap_or(rv);
                        if let (Some(inner), Some(uid)) = (node_of(&p), p.metadata.uid.as_deref()) {
                            if let Some(entry) = lock(&inner.pods).remove(uid) {
                                entry.gone.cancel();
                            }
                        }
                    }
                    Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                    Ok(WatchEvent::Error(_)) | Err(_) => break 'watch,
                }
            }
        }
    }
}
