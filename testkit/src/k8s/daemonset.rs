//! The shipped DaemonSet (the kustomize base or the Helm chart) running on a kubelet stand-in
//! node, as `tests/manifests.rs` and `tests/chart.rs` run it: the host ports its pods take, an
//! opted-in non-root trainer on the node, the agent's pod Ready with the privileges it ships,
//! its pod cache holding the trainer, and a spot notice handled (checkpoint acked, trainer
//! evicted, node cordoned and tainted). Every step waits for what it names, never for a time.

use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetStatus};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use serde_json::Value;

use super::kubelet::{ContainerRun, Image, Kubelet};
use super::{non_system_taints, FlatEvent, TestCluster};
use crate::wait::until_described;

/// The trainer's pod, in the namespace a test gives [`start_trainer`].
pub const TRAINER_POD: &str = "trainer-0";

/// A trainer: catches SIGUSR1 and acks step 4242 in its emptyDir.
pub const TRAINER: &str = r#"
trap 'printf "{\"state\":\"done\",\"step\":4242,\"checkpoint\":\"ckpt-4242\",\"ts\":%s}" $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

/// The agent's metrics and the prefetcher's ports: the DaemonSet's pods use the host network,
/// so a test that runs it first checks that nothing on this machine holds them.
pub fn assert_host_ports_free() {
    for port in [9464, 9465] {
        assert!(
            std::net::TcpListener::bind(("0.0.0.0", port)).is_ok(),
            "port {port} is taken on this machine: the DaemonSet's pods use the host network"
        );
    }
}

/// A GPU node (8 GPUs) whose machine says it is an EC2 p4d.24xlarge (its
/// `/sys/class/dmi/id`, held by the returned directory), running image `image` as `binary`
/// (the spotguard under test): a test's own image name keeps any other DaemonSet's pod off it.
pub async fn ec2_gpu_node(
    k: &TestCluster,
    name: &str,
    image: &str,
    binary: &str,
) -> (Kubelet, tempfile::TempDir) {
    let dmi = tempfile::tempdir().unwrap();
    std::fs::write(dmi.path().join("sys_vendor"), "Amazon EC2\n").unwrap();
    std::fs::write(dmi.path().join("product_name"), "p4d.24xlarge\n").unwrap();
    let node = k
        .node(
            k.node_config(name)
                .gpus(8)
                .host_path("/sys/class/dmi/id", dmi.path())
                .image(image, Image::binary(binary)),
        )
        .await;
    (node, dmi)
}

/// Start the opted-in trainer [`TRAINER_POD`] in namespace `ml` on `node`: uid 1000, its
/// checkpoint dir an emptyDir, a 20 s checkpoint timeout. Returns once it runs and catches
/// SIGUSR1.
pub async fn start_trainer(k: &TestCluster, node: &Kubelet, ml: &str) -> ContainerRun {
    let trainer: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": TRAINER_POD, "namespace": ml, "annotations": {
            "spotguard.io/checkpoint": "true",
            "spotguard.io/checkpoint-dir": "/var/run/spotguard",
            "spotguard.io/checkpoint-timeout": "20s",
        }},
        "spec": {
            "nodeName": node.name(),
            "restartPolicy": "Never",
            "securityContext": { "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000 },
            "containers": [{
                "name": "trainer", "image": "registry.example/trainer:1",
                "command": ["bash", "-c", TRAINER],
                "env": [{ "name": "SPOTGUARD_DIR", "value": "/var/run/spotguard" }],
                "volumeMounts": [{ "name": "spotguard", "mountPath": "/var/run/spotguard" }],
            }],
            "volumes": [{ "name": "spotguard", "emptyDir": { "sizeLimit": "1Mi" } }],
        },
    }))
    .unwrap();
    k.run_pods(&[trainer]).await;
    let run = node
        .wait_run(ml, TRAINER_POD, "trainer", Duration::from_secs(10))
        .await;
    assert!(
        crate::process::wait_catches_usr1(run.pid).await,
        "trainer has no handler"
    );
    run
}

/// Wait up to 90 s until DaemonSet `ds` in `ns` is Ready by `ready` (its status) and its agent
/// pod is on `node`; returns that pod. On timeout the panic gives the DaemonSet's status, the
/// agent pods seen and the agent's log.
pub async fn wait_agent_pod(
    k: &TestCluster,
    node: &Kubelet,
    ns: &str,
    ds: &str,
    ready: impl Fn(&DaemonSetStatus) -> bool,
) -> Pod {
    let pods: Api<Pod> = Api::namespaced(k.admin(), ns);
    let dss: Api<DaemonSet> = Api::namespaced(k.admin(), ns);
    let what = format!("the DaemonSet's agent pod Ready on {}", node.name());
    let describe = |(status, pods): &(Option<DaemonSetStatus>, Vec<Pod>)| {
        let seen: Vec<_> = pods
            .iter()
            .map(|p| {
                (
                    p.metadata.name.clone(),
                    p.spec.as_ref().and_then(|s| s.node_name.clone()),
                    p.status
                        .as_ref()
                        .map(|s| (s.phase.clone(), s.container_statuses.clone())),
                )
            })
            .collect();
        let name = on_node(pods, node)
            .and_then(|p| p.metadata.name.clone())
            .unwrap_or_default();
        Some(format!(
            "DaemonSet status {status:?}; agent pods {seen:?}\nagent log:\n{}",
            node.logs(ns, &name, "spotguard")
        ))
    };
    until_described(&what, Duration::from_secs(90), describe, || async {
        let list = pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=agent"))
            .await
            .unwrap();
        let status = dss.get(ds).await.ok().and_then(|d| d.status);
        match (
            status.as_ref().is_some_and(&ready),
            on_node(&list.items, node),
        ) {
            (true, Some(p)) => Ok(p.clone()),
            _ => Err((status, list.items)),
        }
    })
    .await
}

fn on_node<'a>(pods: &'a [Pod], node: &Kubelet) -> Option<&'a Pod> {
    pods.iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.name()))
}

/// The process's effective capabilities are exactly KILL and SYS_PTRACE (the privileges the
/// DaemonSet ships).
pub fn assert_shipped_capabilities(pid: u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let cap_eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        cap_eff,
        (1 << 5) | (1 << 19),
        "KILL and SYS_PTRACE only: {status}"
    );
}

/// Wait up to 60 s until the agent of pod `ns/agent` says (its JSON log) that its pod cache
/// synced holding at least `targets` opted-in pods: from then on a notice finds them without an
/// API round trip.
pub async fn wait_pod_cache_synced(node: &Kubelet, ns: &str, agent: &str, targets: u64) {
    let what = format!("agent {ns}/{agent}: pod cache synced with {targets} opted-in pod(s)");
    until_described(
        &what,
        Duration::from_secs(60),
        |log: &String| Some(format!("agent log:\n{log}")),
        || async {
            let log = node.logs(ns, agent, "spotguard");
            let synced = log
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .any(|v| {
                    v["message"] == "pod cache synced"
                        && v["targets"].as_u64().is_some_and(|n| n >= targets)
                });
            if synced {
                Ok(())
            } else {
                Err(log)
            }
        },
    )
    .await
}

/// Wait up to 60 s until the notice is handled on `node`: an Event for [`TRAINER_POD`] for
/// which `acked` holds, the trainer evicted from `ml`, the node cordoned and tainted with the
/// interruption taint (`NoSchedule`). On timeout the panic says which of these were seen, the
/// Events and the log of agent pod `ns/agent`.
pub async fn wait_notice_handled(
    k: &TestCluster,
    node: &Kubelet,
    ml: &str,
    (ns, agent): (&str, &str),
    acked: impl Fn(&FlatEvent) -> bool,
) {
    let describe = |(events, seen): &(Vec<FlatEvent>, String)| {
        Some(format!(
            "{seen}\nevents: {:?}\nagent log:\n{}",
            events
                .iter()
                .map(|e| (&e.reason, &e.message))
                .collect::<Vec<_>>(),
            node.logs(ns, agent, "spotguard")
        ))
    };
    until_described(
        "the notice handled",
        Duration::from_secs(60),
        describe,
        || async {
            let events = k.events().await;
            let acked = events
                .iter()
                .any(|e| e.regarding_name == TRAINER_POD && acked(e));
            let gone = k.pod(ml, TRAINER_POD).await.is_none();
            let node_obj = k.node_object(node.name()).await;
            let cordoned = node_obj.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
            let tainted = non_system_taints(&node_obj).iter().any(|(key, _, effect)| {
                key == spotguard::node::INTERRUPTION_TAINT && effect == "NoSchedule"
            });
            if acked && gone && cordoned && tainted {
                Ok(())
            } else {
                Err((
                    events,
                    format!(
                        "acked {acked}, trainer evicted {gone}, cordoned {cordoned}, tainted {tainted}"
                    ),
                ))
            }
        },
    )
    .await
}
