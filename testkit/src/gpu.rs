//! GPU test support: recorded readings of real boards as fixtures, a scripted [`FakeGpuProbe`],
//! and [`RecordingNodeOps`], a `NodeOps` that keeps the GPU conditions in memory and records
//! every write.
//!
//! Fixture values follow what `nvidia-smi -q` / NVML report on these boards: H100 SXM5 80 GB
//! (81559 MiB visible, 700 W, 18 NVLink4 links, row remapping, no page retirement, recovery
//! action field on R550+), A100 SXM4 80 GB (81920 MiB, 400 W, 12 NVLink3 links, row remapping,
//! R535 driver without the recovery action field) and V100 SXM2 32 GB (300 W, 6 NVLink2 links,
//! page retirement, no row remapping).

use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;

use spotguard::gpu::{
    Error, GpuEvent, GpuEventKind, GpuProbe, GpuSample, NvLinkSample, RecoveryAction,
};
use spotguard::node::{
    Applied, DrainReport, DrainRequest, Error as NodeError, EventType, GpuConditions, NodeOps,
    Protection,
};

/// Deterministic UUID in NVML's format for fixture GPU `index` of a board family.
pub fn fixture_uuid(family: u16, index: u32) -> String {
    format!("GPU-{family:04x}5c1e-8f2a-4b7d-9c3e-2f8d0c4b{index:04x}")
}

fn links(n: u32) -> Vec<NvLinkSample> {
    (0..n)
        .map(|link| NvLinkSample {
            link,
            up: Some(true),
            crc_flit: Some(0),
            crc_data: Some(0),
            replay: Some(0),
            recovery: Some(0),
        })
        .collect()
}

/// A healthy, idle H100 SXM5 80 GB (driver R550).
pub fn h100(index: u32) -> GpuSample {
    GpuSample {
        uuid: fixture_uuid(0x0100, index),
        index,
        model: "NVIDIA H100 80GB HBM3".into(),
        lost: false,
        temperature_celsius: Some(31),
        power_watts: Some(71.893),
        power_limit_watts: Some(700.0),
        utilization_gpu: Some(0.0),
        utilization_memory: Some(0.0),
        memory_used_bytes: Some(556_793_856),
        memory_total_bytes: Some(85_520_809_984),
        ecc_enabled: Some(true),
        ecc_corrected_volatile: Some(0),
        ecc_uncorrected_volatile: Some(0),
        ecc_corrected_aggregate: Some(0),
        ecc_uncorrected_aggregate: Some(0),
        // Hopper uses row remapping; page retirement queries answer NotSupported.
        retired_pages_single_bit: None,
        retired_pages_double_bit: None,
        retired_pages_pending: None,
        remapped_rows_correctable: Some(0),
        remapped_rows_uncorrectable: Some(0),
        remap_pending: Some(false),
        remap_failure: Some(false),
        recovery_action: Some(RecoveryAction::None),
        clocks_event_reasons: Some(0x1), // gpu_idle
        pcie_replay: Some(0),
        energy_millijoules: Some(2_614_881_205),
        nvlinks: links(18),
        read_errors: Vec::new(),
    }
}

/// An 8-GPU HGX H100 node.
pub fn hgx_h100() -> Vec<GpuSample> {
    (0..8).map(h100).collect()
}

/// A healthy A100 SXM4 80 GB on driver R535 (no recovery action field).
pub fn a100(index: u32) -> GpuSample {
    GpuSample {
        uuid: fixture_uuid(0x0a10, index),
        index,
        model: "NVIDIA A100-SXM4-80GB".into(),
        temperature_celsius: Some(29),
        power_watts: Some(62.41),
        power_limit_watts: Some(400.0),
        utilization_gpu: Some(0.0),
        utilization_memory: Some(0.0),
        memory_used_bytes: Some(4_718_592),
        memory_total_bytes: Some(85_899_345_920),
        recovery_action: None,
        energy_millijoules: Some(915_034_117),
        nvlinks: links(12),
        ..h100(index)
    }
}

/// A healthy V100 SXM2 32 GB: page retirement instead of row remapping.
pub fn v100(index: u32) -> GpuSample {
    GpuSample {
        uuid: fixture_uuid(0x0f10, index),
        index,
        model: "Tesla V100-SXM2-32GB".into(),
        temperature_celsius: Some(36),
        power_watts: Some(42.7),
        power_limit_watts: Some(300.0),
        memory_used_bytes: Some(0),
        memory_total_bytes: Some(34_359_738_368),
        retired_pages_single_bit: Some(0),
        retired_pages_double_bit: Some(0),
        retired_pages_pending: Some(false),
        remapped_rows_correctable: None,
        remapped_rows_uncorrectable: None,
        remap_pending: None,
        remap_failure: None,
        recovery_action: None,
        energy_millijoules: Some(411_598_225),
        nvlinks: links(6),
        ..h100(index)
    }
}

/// A consumer-class GPU where almost everything health-related is NotSupported.
pub fn not_supported(index: u32) -> GpuSample {
    GpuSample {
        uuid: fixture_uuid(0x0c0f, index),
        index,
        model: "NVIDIA GeForce RTX 4090".into(),
        lost: false,
        temperature_celsius: Some(41),
        power_watts: Some(19.2),
        power_limit_watts: Some(450.0),
        utilization_gpu: Some(0.03),
        utilization_memory: Some(0.01),
        memory_used_bytes: Some(1_048_576),
        memory_total_bytes: Some(25_757_220_864),
        ..GpuSample::default()
    }
}

/// An XID event.
pub fn xid(sample: &GpuSample, code: u64, at: Timestamp) -> GpuEvent {
    GpuEvent {
        uuid: sample.uuid.clone(),
        index: Some(sample.index),
        at,
        kind: GpuEventKind::Xid(code),
    }
}

/// Failures a [`FakeGpuProbe`] can answer with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FakeFailure {
    /// `libnvidia-ml.so.1` not found.
    LibraryMissing,
    DriverNotLoaded,
    /// NVML up but counting devices failed.
    CountDevices,
}

impl FakeFailure {
    fn error(self) -> Error {
        match self {
            FakeFailure::LibraryMissing => Error::LoadLibrary {
                library: "libnvidia-ml.so.1".into(),
                detail:
                    "libnvidia-ml.so.1: cannot open shared object file: No such file or directory"
                        .into(),
            },
            FakeFailure::DriverNotLoaded => Error::DriverNotLoaded,
            FakeFailure::CountDevices => Error::CountDevices {
                source: nvml_wrapper::error::NvmlError::Unknown,
            },
        }
    }
}

type Answer = Result<Vec<GpuSample>, FakeFailure>;

#[derive(Debug)]
struct FakeState {
    current: Answer,
    events: Vec<GpuEvent>,
    samples_taken: usize,
}

/// A scripted probe: answers the current readings (or failure) every time; tests change them
/// between samples and push events.
#[derive(Debug)]
pub struct FakeGpuProbe {
    state: Mutex<FakeState>,
    driver: Option<String>,
}

impl FakeGpuProbe {
    pub fn new(samples: Vec<GpuSample>) -> Self {
        Self::answering(Ok(samples))
    }

    pub fn failing(failure: FakeFailure) -> Self {
        Self::answering(Err(failure))
    }

    fn answering(current: Answer) -> Self {
        FakeGpuProbe {
            state: Mutex::new(FakeState {
                current,
                events: Vec::new(),
                samples_taken: 0,
            }),
            driver: Some("550.54.15".into()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FakeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// From now on answer `samples`.
    pub fn set_samples(&self, samples: Vec<GpuSample>) {
        self.lock().current = Ok(samples);
    }

    /// From now on fail.
    pub fn set_failure(&self, failure: FakeFailure) {
        self.lock().current = Err(failure);
    }

    /// Events handed out by the next `drain_events`.
    pub fn push_events(&self, events: impl IntoIterator<Item = GpuEvent>) {
        self.lock().events.extend(events);
    }

    pub fn samples_taken(&self) -> usize {
        self.lock().samples_taken
    }
}

impl GpuProbe for FakeGpuProbe {
    fn sample(&self) -> Result<Vec<GpuSample>, Error> {
        let mut st = self.lock();
        st.samples_taken += 1;
        st.current.clone().map_err(FakeFailure::error)
    }

    fn drain_events(&self) -> Vec<GpuEvent> {
        std::mem::take(&mut self.lock().events)
    }

    fn driver_version(&self) -> Option<String> {
        self.driver.clone()
    }
}

#[derive(Debug, Default)]
struct Recorded {
    on_node: GpuConditions,
    writes: Vec<GpuConditions>,
}

/// A `NodeOps` for the GPU monitor: keeps the conditions "on the node" in memory, records every
/// `set_gpu_conditions`, lets a test act as the operator. Plan-state and drain methods answer
/// as a node with nothing persisted and nothing to drain.
#[derive(Debug, Default)]
pub struct RecordingNodeOps {
    state: Mutex<Recorded>,
    changed: tokio::sync::Notify,
}

impl RecordingNodeOps {
    /// A node that already shows `conditions` (e.g. written by an earlier agent).
    pub fn with_conditions(conditions: GpuConditions) -> Self {
        RecordingNodeOps {
            state: Mutex::new(Recorded {
                on_node: conditions,
                ..Recorded::default()
            }),
            changed: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Recorded> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every `set_gpu_conditions` call so far.
    pub fn writes(&self) -> Vec<GpuConditions> {
        self.lock().writes.clone()
    }

    /// What the node shows now.
    pub fn on_node(&self) -> GpuConditions {
        self.lock().on_node.clone()
    }

    /// The operator sets the condition(s) to False (as `kubectl` edits of the status would).
    pub fn operator_clears(&self, unhealthy: bool, degraded: bool) {
        let mut st = self.lock();
        if unhealthy {
            st.on_node.unhealthy.active = false;
        }
        if degraded {
            st.on_node.degraded.active = false;
        }
    }

    /// Wait until the node shows conditions for which `done` holds; `None` after `timeout`.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&GpuConditions) -> bool,
    ) -> Option<GpuConditions> {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                let now = self.on_node();
                if done(&now) {
                    return now;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.ok()
    }
}

#[async_trait]
impl NodeOps for RecordingNodeOps {
    async fn load_state(&self) -> Result<Option<String>, NodeError> {
        Ok(None)
    }
    async fn save_state(&self, _record: &str) -> Result<(), NodeError> {
        Ok(())
    }
    async fn clear_state(&self) -> Result<(), NodeError> {
        Ok(())
    }
    async fn protect(&self, _protection: &Protection) -> Result<Applied, NodeError> {
        Ok(Applied::default())
    }
    async fn unprotect(&self, _applied: &Applied) -> Result<(), NodeError> {
        Ok(())
    }
    async fn event(
        &self,
        _kind: EventType,
        _reason: &str,
        _message: &str,
    ) -> Result<(), NodeError> {
        Ok(())
    }
    async fn pod_event(
        &self,
        _pod: &spotguard::checkpoint::PodRef,
        _kind: EventType,
        _reason: &str,
        _message: &str,
    ) -> Result<(), NodeError> {
        Ok(())
    }
    async fn drain(&self, _request: &DrainRequest) -> Result<DrainReport, NodeError> {
        Ok(DrainReport::default())
    }
    async fn gpu_conditions(&self) -> Result<GpuConditions, NodeError> {
        Ok(self.lock().on_node.clone())
    }
    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), NodeError> {
        {
            let mut st = self.lock();
            st.writes.push(desired.clone());
            st.on_node = desired.clone();
        }
        self.changed.notify_waiters();
        Ok(())
    }
}

/// A kubelet pod-resources API v1 server for tests: real gRPC (HTTP/2, length-prefixed protobuf,
/// `grpc-status` trailers) on a unix socket, answering `List` with whatever was set last.
pub struct PodResourcesServer {
    answer: std::sync::Arc<Mutex<PodResourcesAnswer>>,
    calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
enum PodResourcesAnswer {
    List(spotguard::gpu::podresources::ListPodResourcesResponse),
    Status(u32, String),
}

impl PodResourcesServer {
    /// Listen on `socket` (created; an old file is removed first).
    pub fn start(socket: &std::path::Path) -> std::io::Result<PodResourcesServer> {
        let _ = std::fs::remove_file(socket);
        let listener = tokio::net::UnixListener::bind(socket)?;
        let answer = std::sync::Arc::new(Mutex::new(PodResourcesAnswer::List(
            spotguard::gpu::podresources::ListPodResourcesResponse::default(),
        )));
        let calls = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (a, c) = (answer.clone(), calls.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (a, c) = (a.clone(), c.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let (a, c) = (a.clone(), c.clone());
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                serve_pod_resources(req, &a, &c).await,
                            )
                        }
                    });
                    let _ = hyper::server::conn::http2::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                });
            }
        });
        Ok(PodResourcesServer {
            answer,
            calls,
            task,
        })
    }

    /// Answer `List` with these pods (namespace, pod, container, resource, device ids).
    pub fn set_pods(&self, pods: &[(&str, &str, &str, &str, &[&str])]) {
        use spotguard::gpu::podresources::{
            ContainerDevices, ContainerResources, ListPodResourcesResponse, PodResources,
        };
        let pod_resources = pods
            .iter()
            .map(|(ns, pod, container, resource, ids)| PodResources {
                name: pod.to_string(),
                namespace: ns.to_string(),
                containers: vec![ContainerResources {
                    name: container.to_string(),
                    devices: vec![ContainerDevices {
                        resource_name: resource.to_string(),
                        device_ids: ids.iter().map(|s| s.to_string()).collect(),
                    }],
                }],
            })
            .collect();
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) =
            PodResourcesAnswer::List(ListPodResourcesResponse { pod_resources });
    }

    /// Answer `List` with a gRPC error status.
    pub fn set_status(&self, code: u32, message: &str) {
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) =
            PodResourcesAnswer::Status(code, message.to_string());
    }

    /// `List` calls answered so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for PodResourcesServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type GrpcBody = http_body_util::StreamBody<
    futures::stream::Iter<
        std::vec::IntoIter<Result<hyper::body::Frame<bytes::Bytes>, std::convert::Infallible>>,
    >,
>;

async fn serve_pod_resources(
    req: http::Request<hyper::body::Incoming>,
    answer: &Mutex<PodResourcesAnswer>,
    calls: &std::sync::atomic::AtomicU64,
) -> http::Response<GrpcBody> {
    use http_body_util::BodyExt;
    use hyper::body::Frame;
    let path_ok = req.method() == http::Method::POST
        && req.uri().path() == spotguard::gpu::podresources::LIST_PATH
        && req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let request_ok = body
        .ok()
        .and_then(|b| spotguard::gpu::podresources::unframe(b).ok())
        .is_some_and(|m| {
            <spotguard::gpu::podresources::ListPodResourcesRequest as prost::Message>::decode(m)
                .is_ok()
        });
    let answer = if path_ok && request_ok {
        calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        answer.lock().unwrap_or_else(|p| p.into_inner()).clone()
    } else {
        PodResourcesAnswer::Status(12, "unknown method or malformed request".into())
    };
    let mut trailers = http::HeaderMap::new();
    let mut frames = Vec::new();
    match answer {
        PodResourcesAnswer::List(resp) => {
            let msg = prost::Message::encode_to_vec(&resp);
            frames.push(Ok(Frame::data(spotguard::gpu::podresources::frame(&msg))));
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        }
        PodResourcesAnswer::Status(code, message) => {
            trailers.insert("grpc-status", http::HeaderValue::from(code));
            if let Ok(v) = http::HeaderValue::from_str(&message) {
                trailers.insert("grpc-message", v);
            }
        }
    }
    frames.push(Ok(Frame::trailers(trailers)));
    let mut resp = http::Response::new(http_body_util::StreamBody::new(futures::stream::iter(
        frames,
    )));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    resp
}
