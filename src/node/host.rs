//! Host mode (bare VM / systemd): no Kubernetes. The plan state is persisted as JSON under
//! `--state-dir`; taints, cordons, Events and drains have no host equivalent and are logged.

use std::path::{Path, PathBuf};

use async_trait::async_trait;

use super::{
    Applied, DrainReport, DrainRequest, Error, EventType, GpuConditions, NodeOps, PlanState,
    Protection,
};
use crate::fsutil::write_atomic;
use crate::node::PodRef;

/// File name of the persisted plan state inside `--state-dir`.
pub const STATE_FILE: &str = "notice.json";

/// The local record of the plan state: `<state-dir>/notice.json`, written atomically and fsync'd.
/// Host mode keeps only this record; Kubernetes mode keeps it beside the Node annotation (the
/// DaemonSet mounts a hostPath there), so that an API-server outage at restart never makes the
/// agent forget that it already signalled, and the record is written before the checkpoint signal
/// without waiting for the API server.
#[derive(Clone, Debug)]
pub struct StateFile {
    path: PathBuf,
    dry_run: bool,
}

impl StateFile {
    pub fn new(state_dir: &Path, dry_run: bool) -> Self {
        StateFile {
            path: state_dir.join(STATE_FILE),
            dry_run,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The record, if any. Blocking.
    pub fn load_blocking(&self) -> Result<Option<PlanState>, Error> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(Error::StateRead {
                    path: self.path.display().to_string(),
                    source,
                })
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::StateCorrupt {
                location: self.path.display().to_string(),
                reason: e.to_string(),
            })
    }

    /// Replace the record (atomic write, fsync of file and directory). Blocking.
    pub fn save_blocking(&self, state: &PlanState) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(phase = state.phase.as_str(), notice_id = %state.id, "dry-run: would persist plan state");
            return Ok(());
        }
        let json = serde_json::to_vec_pretty(state).map_err(|e| Error::StateCorrupt {
            location: self.path.display().to_string(),
            reason: e.to_string(),
        })?;
        write_atomic(&self.path, &json, 0o644).map_err(|source| Error::StateWrite {
            path: self.path.display().to_string(),
            source,
        })
    }

    /// Remove the record. Blocking.
    pub fn clear_blocking(&self) -> Result<(), Error> {
        if self.dry_run {
            return Ok(());
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::StateWrite {
                path: self.path.display().to_string(),
                source,
            }),
        }
    }

    pub async fn load(&self) -> Result<Option<PlanState>, Error> {
        let me = self.clone();
        blocking(move || me.load_blocking(), &self.path).await
    }

    pub async fn save(&self, state: &PlanState) -> Result<(), Error> {
        let (me, state) = (self.clone(), state.clone());
        blocking(move || me.save_blocking(&state), &self.path).await
    }

    pub async fn clear(&self) -> Result<(), Error> {
        let me = self.clone();
        blocking(move || me.clear_blocking(), &self.path).await
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
    path: &Path,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::StateWrite {
            path: path.display().to_string(),
            source: std::io::Error::other(e),
        })?
}

pub struct HostNodeOps {
    state: StateFile,
    gpu: std::sync::Mutex<GpuConditions>,
}

impl HostNodeOps {
    pub fn new(state_dir: &Path, dry_run: bool) -> Self {
        HostNodeOps {
            state: StateFile::new(state_dir, dry_run),
            gpu: std::sync::Mutex::new(GpuConditions::default()),
        }
    }

    pub fn state_path(&self) -> &Path {
        self.state.path()
    }
}

#[async_trait]
impl NodeOps for HostNodeOps {
    fn state_is_local(&self) -> bool {
        true
    }

    async fn load_state(&self) -> Result<Option<PlanState>, Error> {
        self.state.load().await
    }

    async fn save_state(&self, state: &PlanState) -> Result<(), Error> {
        self.state.save(state).await
    }

    async fn clear_state(&self) -> Result<(), Error> {
        self.state.clear().await
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
