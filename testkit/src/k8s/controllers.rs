//! kube-controller-manager and kube-scheduler for the test control plane, both with the admin
//! kubeconfig, no leader election and no serving port.
//!
//! Controllers run: `nodelifecycle` (the not-ready taint comes off a Ready node; a node whose
//! Lease stops is marked unreachable), `disruption` (PodDisruptionBudget status: without it
//! every eviction of a covered pod answers 429), `replicaset` (an evicted replica is replaced,
//! so a PDB lets the next one go), `job` (Jobs and their `podFailurePolicy`),
//! `daemonset`, `resourcequota` (the quota admission refuses pods in a namespace whose quota has
//! no computed status), `serviceaccount` (every namespace's `default` ServiceAccount),
//! `root-ca-cert-publisher` (the `kube-root-ca.crt` ConfigMap every
//! ServiceAccount token volume reads). No garbage collector: test pods may name owners that do
//! not exist.

use std::path::Path;

use super::child::Daemon;

pub const CONTROLLERS: &str =
    "nodelifecycle,disruption,replicaset,job,daemonset,resourcequota,serviceaccount,root-ca-cert-publisher";

pub fn start_controller_manager(
    bin: &Path,
    dir: &Path,
    kubeconfig: &Path,
    root_ca: &Path,
) -> Result<Daemon, String> {
    let args = vec![
        format!("--root-ca-file={}", root_ca.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".to_string(),
        format!("--controllers={CONTROLLERS}"),
        "--secure-port=0".to_string(),
        "--use-service-account-credentials=false".to_string(),
        "--kube-api-qps=200".to_string(),
        "--kube-api-burst=400".to_string(),
        "--concurrent-job-syncs=10".to_string(),
        "--v=0".to_string(),
    ];
    Daemon::start("kube-controller-manager", bin, &args, dir)
}

pub fn start_scheduler(bin: &Path, dir: &Path, kubeconfig: &Path) -> Result<Daemon, String> {
    let args = vec![
        format!("--kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".to_string(),
        "--secure-port=0".to_string(),
        "--v=0".to_string(),
    ];
    Daemon::start("kube-scheduler", bin, &args, dir)
}
