//! spotguard's test support, shared by its integration tests and benches: fakes for the seams and
//! in-process servers. A workspace member and a dev-dependency of `spotguard`, never part of the
//! shipped library or binary.
//!
//! - [`assets`]: where the checkout, `../shared/k8s` and `target/` are; unpacking an outside
//!   binary into a cache under `target/` once.
//! - [`ec2_mock`]: AWS's own `ec2-metadata-mock` on a free loopback port (version chosen by
//!   `SPOTGUARD_EC2_METADATA_MOCK` or `../shared/k8s`).
//! - [`k8s`]: a real Kubernetes control plane (etcd, kube-apiserver, controller-manager,
//!   scheduler) per test binary, a kubelet stand-in that runs pods as real processes, and a
//!   fault proxy in front of the API server.
//! - [`fuse`]: a FUSE mount nobody answers (a hung checkpoint dir).
//! - [`gpu`]: recorded readings of real boards (fixtures), a scripted `GpuProbe`, a recording
//!   `NodeOps`, and a fake kubelet pod-resources gRPC server.
//! - [`kubelet`]: random pod uids and container ids, the cgroup the kubelet makes for a container.
//! - [`plan`]: the plan's in-process seam: the real responder with a recording `NodeOps`, real
//!   trainers found by the real host discovery, notices pushed straight in, the store's
//!   decisions (a `Duplicate` included) observable.
//! - [`process`]: [`process::Kid`], a child process in its own group, killed with it on drop;
//!   whether a real process has installed its SIGUSR1 handler yet; the benches' trainer that
//!   records when SIGUSR1 arrived, and their one percentile.
//! - [`s3`]: s3s-fs and moto on a free loopback port, a [`s3::Throttle`] (a slow network) before
//!   them, and a [`s3::proxy::Proxy`] that injects a test's faults into the HTTP traffic.
//! - [`tcp`]: a TCP forwarder whose connections leave from a chosen loopback address and whose
//!   stream to the server a test holds at a byte mark (a peer killed mid-stream, a disk filled
//!   mid-file).
//! - [`tmpfs`]: a tmpfs of a given size (a staging volume that fills), unmounted on drop.
//! - [`wait`]: waiting for an event (checked until it holds, a deadline that names what was
//!   waited for); [`wait_for_event`]: wait for a responder plan event; [`metrics_text`]: a
//!   running agent's `/metrics`.
pub mod assets;
pub mod ec2_mock;
pub mod fuse;
pub mod gpu;
pub mod k8s;
pub mod kubelet;
pub mod plan;
pub mod process;
pub mod prometheus;
pub mod s3;
pub mod tcp;
pub mod tls;
pub mod tmpfs;
pub mod wait;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::broadcast;

use spotguard::responder::PlanEvent;

/// Wait up to `limit` for a plan event for which `f` returns `Some`; panics on timeout or when
/// the channel closes (test helper).
pub async fn wait_for_event<T>(
    events: &mut broadcast::Receiver<PlanEvent>,
    limit: Duration,
    f: impl FnMut(&PlanEvent) -> Option<T>,
) -> T {
    recv_until(events, limit, "plan event", f).await
}

/// Wait up to `limit` for a message on `rx` for which `f` returns `Some` (messages lost to a lag
/// are skipped); panics on timeout or when the channel closes, naming `what` it waited for.
pub async fn recv_until<E: Clone, T>(
    rx: &mut broadcast::Receiver<E>,
    limit: Duration,
    what: &str,
    mut f: impl FnMut(&E) -> Option<T>,
) -> T {
    let found = tokio::time::timeout(limit, async {
        loop {
            match rx.recv().await {
                Ok(e) => {
                    if let Some(v) = f(&e) {
                        return Some(v);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
    .await;
    match found {
        Ok(Some(v)) => v,
        Ok(None) => panic!("{what} channel closed"),
        Err(_) => panic!("timed out after {limit:?} waiting for a {what}"),
    }
}

/// A free TCP port on 127.0.0.1 for a server a test starts (bound and released: a tiny race
/// with other processes, which the server then reports clearly).
pub fn free_port() -> u16 {
    k8s::child::free_port().expect("a free loopback port")
}

/// The text of `/metrics` on the agent's admin server at `addr`; panics when it does not answer
/// (test helper).
pub async fn metrics_text(addr: SocketAddr) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
