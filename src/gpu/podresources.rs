//! Which pod holds which GPU: the kubelet's pod-resources API v1 (`PodResourcesLister/List`,
//! gRPC over the unix socket `/var/lib/kubelet/pod-resources/kubelet.sock`), as dcgm-exporter
//! reads it. The device plugin's device ids for `nvidia.com/*` resources are GPU UUIDs
//! (`GPU-…`, time-sliced replicas as `GPU-…::N`, MIG devices as `MIG-…`).
//!
//! The messages are written by hand with the field numbers of the official
//! `k8s.io/kubelet/pkg/apis/podresources/v1/api.proto` (fields spotguard does not read — CPU
//! ids, memory, topology, dynamic resources — are skipped by the decoder). One unary call per
//! refresh: HTTP/2 POST with a 5-byte gRPC frame, `grpc-status` from the trailers (or from the
//! headers of a trailers-only answer), bounded by a timeout.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// Where the kubelet serves the pod-resources API.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// gRPC method path: package `v1`, service `PodResourcesLister`, method `List`.
pub const LIST_PATH: &str = "/v1.PodResourcesLister/List";
/// Resources whose devices are NVIDIA GPUs (`nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`, …).
const NVIDIA_PREFIX: &str = "nvidia.com/";
/// Largest response accepted (a node with hundreds of pods answers in a few hundred KiB).
const MAX_RESPONSE: usize = 16 << 20;

/// `ListPodResourcesRequest {}`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesRequest {}

/// `ListPodResourcesResponse { repeated PodResources pod_resources = 1; }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ListPodResourcesResponse {
    #[prost(message, repeated, tag = "1")]
    pub pod_resources: Vec<PodResources>,
}

/// `PodResources { string name = 1; string namespace = 2; repeated ContainerResources containers = 3; }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(message, repeated, tag = "3")]
    pub containers: Vec<ContainerResources>,
}

/// `ContainerResources { string name = 1; repeated ContainerDevices devices = 2; … }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerResources {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, repeated, tag = "2")]
    pub devices: Vec<ContainerDevices>,
}

/// `ContainerDevices { string resource_name = 1; repeated string device_ids = 2; … }`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerDevices {
    #[prost(string, tag = "1")]
    pub resource_name: String,
    #[prost(string, repeated, tag = "2")]
    pub device_ids: Vec<String>,
}

/// A container holding a GPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuHolder {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// GPU UUID → the containers holding it (sorted; more than one when the GPU is shared).
pub type Allocations = BTreeMap<String, Vec<GpuHolder>>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting to the kubelet pod-resources socket {socket}: {source}")]
    Connect {
        socket: String,
        #[source]
        source: std::io::Error,
    },
    #[error("pod-resources List over {socket}: {detail}")]
    Call { socket: String, detail: String },
    #[error("pod-resources List over {socket} did not answer within {}s", .timeout.as_secs())]
    Timeout { socket: String, timeout: Duration },
}

/// Call `List` on the kubelet's socket and return which container holds which GPU.
pub async fn list(socket: &Path, timeout: Duration) -> Result<Allocations, Error> {
    let name = socket.display().to_string();
    match tokio::time::timeout(timeout, call_list(socket, &name)).await {
        Ok(r) => r.map(|resp| allocations(&resp)),
        Err(_) => Err(Error::Timeout {
            socket: name,
            timeout,
        }),
    }
}

async fn call_list(socket: &Path, name: &str) -> Result<ListPodResourcesResponse, Error> {
    let call_err = |detail: String| Error::Call {
        socket: name.to_string(),
        detail,
    };
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|source| Error::Connect {
            socket: name.to_string(),
            source,
        })?;
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| call_err(format!("HTTP/2 handshake: {e}")))?;
    let driver = tokio::spawn(async move {
        // Ends when the sender is dropped or the kubelet closes the connection.
        let _ = conn.await;
    });
    let request = http::Request::post(format!("http://localhost{LIST_PATH}"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(Full::new(frame(&prost::Message::encode_to_vec(
            &ListPodResourcesRequest {},
        ))))
        .map_err(|e| call_err(format!("building the request: {e}")))?;
    let result = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| call_err(format!("sending: {e}")))?;
        if response.status() != http::StatusCode::OK {
            return Err(call_err(format!("HTTP status {}", response.status())));
        }
        // A trailers-only answer carries grpc-status in the headers.
        check_status(response.headers()).map_err(call_err)?;
        let body = http_body_util::Limited::new(response.into_body(), MAX_RESPONSE)
            .collect()
            .await
            .map_err(|e| call_err(format!("reading the answer: {e}")))?;
        if let Some(trailers) = body.trailers() {
            check_status(trailers).map_err(call_err)?;
        }
        let data = body.to_bytes();
        let message = unframe(data).map_err(call_err)?;
        <ListPodResourcesResponse as prost::Message>::decode(message)
            .map_err(|e| call_err(format!("decoding the answer: {e}")))
    }
    .await;
    drop(sender);
    driver.abort();
    result
}

/// `grpc-status` 0 or absent ⇒ Ok; otherwise the status code and message.
fn check_status(headers: &http::HeaderMap) -> Result<(), String> {
    let Some(status) = headers.get("grpc-status") else {
        return Ok(());
    };
    if status.as_bytes() == b"0" {
        return Ok(());
    }
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or("");
    Err(format!(
        "gRPC status {} {message}",
        String::from_utf8_lossy(status.as_bytes())
    ))
}

/// One gRPC length-prefixed message (uncompressed).
pub fn frame(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// The one message of a unary answer.
pub fn unframe(mut data: Bytes) -> Result<Bytes, String> {
    if data.len() < 5 {
        return Err(format!(
            "answer of {} bytes is not a gRPC message",
            data.len()
        ));
    }
    let compressed = data.get_u8();
    if compressed != 0 {
        return Err("compressed gRPC answer (not requested)".into());
    }
    let len = data.get_u32() as usize;
    if len > data.len() {
        return Err(format!(
            "gRPC message of {len} bytes, {} received",
            data.len()
        ));
    }
    Ok(data.split_to(len))
}

/// GPU UUID → holders, from a `List` answer (only `nvidia.com/*` resources; a time-sliced
/// replica id `GPU-…::N` counts for its GPU).
pub fn allocations(resp: &ListPodResourcesResponse) -> Allocations {
    let mut out: Allocations = BTreeMap::new();
    for pod in &resp.pod_resources {
        for container in &pod.containers {
            for devices in &container.devices {
                if !devices.resource_name.starts_with(NVIDIA_PREFIX) {
                    continue;
                }
                for id in &devices.device_ids {
                    let uuid = id.split("::").next().unwrap_or(id);
                    if uuid.is_empty() {
                        continue;
                    }
                    let holders = out.entry(uuid.to_string()).or_default();
                    let holder = GpuHolder {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name.clone(),
                    };
                    if !holders.contains(&holder) {
                        holders.push(holder);
                    }
                }
            }
        }
    }
    for holders in out.values_mut() {
        holders.sort();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, containers: Vec<ContainerResources>) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers,
        }
    }

    fn container(name: &str, resource: &str, ids: &[&str]) -> ContainerResources {
        ContainerResources {
            name: name.into(),
            devices: vec![ContainerDevices {
                resource_name: resource.into(),
                device_ids: ids.iter().map(|s| s.to_string()).collect(),
            }],
        }
    }

    #[test]
    fn allocations_keep_nvidia_devices_and_fold_replicas() {
        let resp = ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "ml",
                    "trainer-0",
                    vec![container("pytorch", "nvidia.com/gpu", &["GPU-a", "GPU-b"])],
                ),
                pod(
                    "ml",
                    "notebook",
                    vec![container("jupyter", "nvidia.com/gpu", &["GPU-c::0"])],
                ),
                pod(
                    "dev",
                    "shell",
                    vec![container("sh", "nvidia.com/gpu", &["GPU-c::1"])],
                ),
                pod(
                    "net",
                    "sriov",
                    vec![container("app", "intel.com/sriov", &["0000:3b:00.1"])],
                ),
            ],
        };
        let a = allocations(&resp);
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a["GPU-a"][0].pod, "trainer-0");
        assert_eq!(a["GPU-b"][0].container, "pytorch");
        let shared: Vec<&str> = a["GPU-c"].iter().map(|h| h.pod.as_str()).collect();
        assert_eq!(
            shared,
            vec!["shell", "notebook"],
            "sorted by namespace, pod"
        );
        assert!(!a.contains_key("0000:3b:00.1"));
    }

    #[test]
    fn frames_round_trip_and_bad_frames_are_errors() {
        let msg = prost::Message::encode_to_vec(&ListPodResourcesResponse {
            pod_resources: vec![pod("a", "b", vec![])],
        });
        let framed = frame(&msg);
        assert_eq!(framed[0], 0);
        assert_eq!(unframe(framed).expect("unframe"), Bytes::from(msg));
        assert!(unframe(Bytes::from_static(&[0, 0, 0])).is_err());
        assert!(unframe(Bytes::from_static(&[1, 0, 0, 0, 0])).is_err());
        assert!(unframe(Bytes::from_static(&[0, 0, 0, 0, 9, 1])).is_err());
    }

    #[test]
    fn unknown_fields_of_newer_kubelets_are_skipped() {
        // ContainerResources with cpu_ids (3, packed int64) and a field number from the future.
        let mut raw = Vec::new();
        raw.extend_from_slice(&[0x0a, 0x01, b'c']); // name = "c"
        raw.extend_from_slice(&[0x1a, 0x02, 0x01, 0x02]); // cpu_ids = [1, 2]
        raw.extend_from_slice(&[0xa0, 0x06, 0x07]); // field 100 varint 7
        let c = <ContainerResources as prost::Message>::decode(raw.as_slice()).expect("decode");
        assert_eq!(c.name, "c");
        assert!(c.devices.is_empty());
    }
}
