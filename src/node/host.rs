//! Host mode (bare VM / systemd): no Kubernetes. The plan state is persisted as JSON under
//! `--state-dir`; taints, cordons, Events and drains have no host equivalent and are logged.

use std::path::{Path, PathBuf};

use async_trait::async_trait;

use super::{
    Applied, DrainReport, DrainRequest, Error, EventType, GpuConditions, NodeOps, PlanState,
    Protection,
};
use crate::checkpoint::PodRef;
use crate::fsutil::write_atomic;

/// File name of the persisted plan state inside `--state-dir`.
pub const STATE_FILE: &str = "notice.json";

pub struct HostNodeOps {
    state_path: PathBuf,
    dry_run: bool,
    gpu: std::sync::Mutex<GpuConditions>,
}

impl HostNodeOps {
    pub fn new(state_dir: &Path, dry_run: bool) -> Self {
        HostNodeOps {
            state_path: state_dir.join(STATE_FILE),
            dry_run,
            gpu: std::sync::Mutex::new(GpuConditions::default()),
        }
    }

    pub fn state_path(&self) -> &Path {
        &self.state_path
    }
}

#[async_trait]
impl NodeOps for HostNodeOps {
    async fn load_state(&self) -> Result<Option<PlanState>, Error> {
        let path = self.state_path.clone();
        let bytes = match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(Error::StateRead {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::StateCorrupt {
                location: path.display().to_string(),
                reason: e.to_string(),
            })
    }

    async fn save_state(&self, state: &PlanState) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(phase = state.phase.as_str(), notice_id = %state.id, "dry-run: would persist plan state");
            return Ok(());
        }
        let json = serde_json::to_vec_pretty(state).map_err(|e| Error::StateCorrupt {
            location: self.state_path.display().to_string(),
            reason: e.to_string(),
        })?;
        let path = self.state_path.clone();
        tokio::task::spawn_blocking(move || write_atomic(&path, &json, 0o644))
            .await
            .map_err(|e| Error::StateWrite {
                path: self.state_path.display().to_string(),
                source: std::io::Error::other(e),
            })?
            .map_err(|source| Error::StateWrite {
                path: self.state_path.display().to_string(),
                source,
            })
    }

    async fn clear_state(&self) -> Result<(), Error> {
        if self.dry_run {
            return Ok(());
        }
        match tokio::fs::remove_file(&self.state_path).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::StateWrite {
                path: self.state_path.display().to_string(),
                source,
            }),
        }
    }

    async fn protect(&self, protection: &Protection) -> Result<Applied, Error> {
        tracing::info!(
            taint = %format!("{}={}:{}", super::INTERRUPTION_TAINT, protection.taint_value, protection.effect.as_str()),
            cordon = protection.cordon,
            "host mode: no node to taint or cordon"
        );
        Ok(Applied::default())
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
