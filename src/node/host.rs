//! Host mode (bare VM / systemd): no Kubernetes, so no node to keep a copy of the plan record
//! on (the responder's local record under `--state-dir` is the only one); taints, cordons,
//! Events and drains have no host equivalent and are logged.

use async_trait::async_trait;

use super::{
    Applied, DrainReport, DrainRequest, Error, EventType, GpuConditions, NodeOps, Protection,
};
use crate::node::PodRef;

#[derive(Default)]
pub struct HostNodeOps {
    gpu: std::sync::Mutex<GpuConditions>,
}

impl HostNodeOps {
    pub fn new() -> Self {
        Self::default()
    }
}

#[async_trait]
impl NodeOps for HostNodeOps {
    async fn protect(&self, protection: &Protection) -> Result<Applied, Error> {
        tracing::info!(
            taint = %format!("{}={}:{}", super::INTERRUPTION_TAINT, protection.taint_value, protection.effect.as_str()),
            cordon = protection.cordon,
            "host mode: no node to taint or cordon"
        );
        Ok(Applied::default())
    }

    fn has_node(&self) -> bool {
        false
    }

    async fn unprotect(&self, _applied: &Applied) -> Result<(), Error> {
        Ok(())
    }

    async fn event(&self, kind: EventType, reason: &str, message: &str) -> Result<(), Error> {
        match kind {
            EventType::Normal => tracing::info!(reason, "{message}"),
            EventType::Warning => tracing::warn!(reason, "{message}"),
        }
        Ok(())
    }

    async fn pod_event(
        &self,
        pod: &PodRef,
        kind: EventType,
        reason: &str,
        message: &str,
    ) -> Result<(), Error> {
        let pod = format!("{}/{}", pod.namespace, pod.name);
        match kind {
            EventType::Normal => tracing::info!(reason, pod, "{message}"),
            EventType::Warning => tracing::warn!(reason, pod, "{message}"),
        }
        Ok(())
    }

    async fn drain(&self, _request: &DrainRequest) -> Result<DrainReport, Error> {
        tracing::info!("host mode: no pods to drain");
        Ok(DrainReport::default())
    }

    async fn gpu_conditions(&self) -> Result<GpuConditions, Error> {
        Ok(self.gpu.lock().map(|g| g.clone()).unwrap_or_default())
    }

    async fn set_gpu_conditions(&self, desired: &GpuConditions) -> Result<(), Error> {
        if let Ok(mut g) = self.gpu.lock() {
            if *g != *desired {
                tracing::info!(
                    unhealthy = desired.unhealthy.active,
                    degraded = desired.degraded.active,
                    "GPU conditions changed (host mode: reported in metrics and logs only)"
                );
                *g = desired.clone();
            }
        }
        Ok(())
    }
}
