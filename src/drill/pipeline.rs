//! The agent the drill drives: the embedded metadata emulator and the real `run` pipeline (host
//! mode) against it, started and stopped as a pair.

use std::path::{Path, PathBuf};
use std::time::Duration;

use jiff::Timestamp;
use tokio::sync::broadcast::Receiver;
use tokio_util::sync::CancellationToken;

use super::DrillArgs;
use crate::app;
use crate::config::{self, Config, ModeChoice};
use crate::emulator::{self, EmulatorHandle};
use crate::notice::Cloud;
use crate::responder::PlanEvent;

/// Start the metadata emulator for `cloud` on loopback.
pub async fn start_emulator(cloud: Cloud) -> Result<EmulatorHandle, String> {
    emulator::start(emulator::EmulatorConfig::new(cloud))
        .await
        .map_err(|e| format!("starting the metadata emulator: {e}"))
}

/// The running pipeline and its emulator.
pub struct Pipeline {
    emu: EmulatorHandle,
    cancel: CancellationToken,
    app: app::App,
}

impl Pipeline {
    /// Start the pipeline against `emu`: notice dir `dir`, agent state in `state_dir`, the
    /// processes to signal named by `pidfiles`; it stops with `cancel` or [`Pipeline::stop`].
    pub async fn start(
        args: &DrillArgs,
        emu: EmulatorHandle,
        dir: &Path,
        state_dir: &Path,
        pidfiles: &[PathBuf],
        cancel: &CancellationToken,
    ) -> Result<Pipeline, String> {
        let boot_id = own_life(state_dir)?;
        let mut run_args = run_args(args, &emu.base_url(), dir, state_dir, pidfiles)?;
        run_args.boot_id_file = boot_id;
        let cfg = Config::resolve(run_args, &config::ProcessEnv).map_err(|e| e.to_string())?;
        let pipeline_cancel = cancel.child_token();
        let app = app::start(cfg, pipeline_cancel.clone())
            .await
            .map_err(|e| format!("starting the pipeline: {e}"))?;
        Ok(Pipeline {
            emu,
            cancel: pipeline_cancel,
            app,
        })
    }

    /// The plan's progress.
    pub fn events(&mut self) -> &mut Receiver<PlanEvent> {
        &mut self.app.events
    }

    /// Raise the interruption in the emulator; returns when it is visible.
    pub fn raise(&self) -> Result<Timestamp, String> {
        Ok(self
            .emu
            .raise(emulator::EmulatedNotice::interruption())
            .map_err(|e| format!("raising the notice in the emulator: {e}"))?
            .visible_at)
    }

    /// Stop the pipeline (waiting up to 5 s for its tasks), then the emulator.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.app.join).await;
        self.emu.shutdown().await;
    }
}

/// A drill is a machine life of its own: a boot id made for this run, in a file beside its state
/// dir. A notice dir that an earlier drill used still holds that drill's `notice.json`, naming an
/// interruption of the machine's real boot; the agent takes a `notice.json` naming an
/// interruption of its own life as proof that its trainers were signalled already (an agent
/// whose record was lost must never signal twice), so with the machine's boot id a second drill
/// in the same dir signalled nobody. A new life per run keeps that rule whole for real machines,
/// where one life has one interruption.
fn own_life(state_dir: &Path) -> Result<PathBuf, String> {
    let path = state_dir.with_file_name("drill-boot-id");
    let id = format!(
        "drill-{:016x}-{:016x}",
        fastrand::u64(..),
        fastrand::u64(..)
    );
    crate::fsutil::write_atomic(&path, format!("{id}\n").as_bytes(), 0o644)
        .map_err(|e| format!("writing the drill's boot id {}: {e}", path.display()))?;
    Ok(path)
}

/// The `run` arguments of the drill's pipeline.
fn run_args(
    args: &DrillArgs,
    endpoint: &str,
    ckpt_dir: &Path,
    state_dir: &Path,
    pidfiles: &[PathBuf],
) -> Result<config::RunArgs, String> {
    let cloud = args.cloud.as_str();
    let timeout = crate::duration::display(args.timeout).to_string();
    let mut flags: Vec<String> = vec![
        "--mode=host".into(),
        format!("--cloud={cloud}"),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=1s".into(),
        format!("--checkpoint-timeout={timeout}"),
        format!("--checkpoint-dir={}", ckpt_dir.display()),
        format!("--state-dir={}", state_dir.display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        format!("--log-level={}", args.log_level),
        "--shutdown-grace=5s".into(),
    ];
    flags.extend(
        pidfiles
            .iter()
            .map(|p| format!("--checkpoint-pidfile={}", p.display())),
    );
    if let Some(dir) = &args.upload_to {
        flags.push(format!("--upload-allow={}", dir.display()));
        flags.push(format!("--checkpoint-upload={}", dir.display()));
    }
    let mut r = config::parse_run_args(flags)?;
    r.mode = ModeChoice::Host;
    r.config = None;
    Ok(r)
}
