//! The GPU monitor task: sample on a blocking thread every `interval`, evaluate, publish metrics,
//! and make the node show the verdict through [`NodeOps::set_gpu_conditions`] (the Kubernetes
//! side — `nodes/status` patch, taint, Events — lives behind that method).
//!
//! NVML that cannot be initialised is not an error of the agent: `spotguard_gpu_probe_up 0`,
//! state unknown, one log line (another only when the reason changes), retries with a doubling
//! backoff; sticky conditions already on the node are left as they are.
//!
//! Each sample runs on a thread of its own, not on the runtime's blocking pool: a driver call
//! that never returns (a wedged GPU can hang NVML) then holds only that thread. The monitor
//! waits for it at most one interval, reports the probe down (`sample_timeout`), starts no
//! second sample while the first is stuck, and neither shutdown nor anything else waits for it.

use crate::backoff::Backoff;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use jiff::Timestamp;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::health::{
    evaluate, node_conditions, previous_from_conditions, Health, HealthState, Severity,
};
use super::podresources;
use super::{Error, GpuConfig, GpuEvent, GpuMetrics, GpuProbe, GpuSample};
use crate::node::{GpuConditions, NodeOps};

/// Run until `cancel`. Never returns an error: everything is logged, counted and retried.
pub async fn run_monitor(
    probe: Arc<dyn GpuProbe>,
    node: Arc<dyn NodeOps>,
    metrics: Arc<GpuMetrics>,
    cfg: GpuConfig,
    cancel: CancellationToken,
) {
    let span = tracing::info_span!("gpu_monitor");
    Monitor::new(probe, node, metrics, cfg)
        .run(cancel)
        .instrument(span)
        .await
}

struct Monitor {
    probe: Arc<dyn GpuProbe>,
    node: Arc<dyn NodeOps>,
    metrics: Arc<GpuMetrics>,
    cfg: GpuConfig,
    boot_id: String,
    state: HealthState,
    /// Conditions last written successfully (None until the node's conditions were read).
    shown: Option<GpuConditions>,
    /// Last NVML init error reported (to log it once).
    down_reason: Option<String>,
    /// Retries of NVML start-up: `init_backoff_min` doubling to `init_backoff_max`.
    backoff: Backoff,
    /// Last pod-resources error reported (to log it once).
    holders_error: Option<String>,
    /// A sample still running on its thread (a hung driver call), and since when.
    in_flight: Option<(oneshot::Receiver<SampleResult>, tokio::time::Instant)>,
}

/// Longest wait for the kubelet's pod-resources answer.
const POD_RESOURCES_TIMEOUT: Duration = Duration::from_secs(2);

type SampleResult = (Result<Vec<GpuSample>, Error>, Vec<GpuEvent>);

impl Monitor {
    fn new(
        probe: Arc<dyn GpuProbe>,
        node: Arc<dyn NodeOps>,
        metrics: Arc<GpuMetrics>,
        cfg: GpuConfig,
    ) -> Self {
        let boot_id = match crate::life::read_boot_id_from(&cfg.boot_id_path) {
            Ok(id) => id,
            Err(e) => {
                // Without a boot id a reboot cannot be told apart: findings then clear only on
                // an observed reset or by an operator.
                tracing::warn!(error = %e, "cannot read the boot id; GPU findings will not clear on reboot");
                metrics.error(e.metric_label());
                String::from("unknown")
            }
        };
        let backoff = Backoff::new(cfg.init_backoff_min, cfg.init_backoff_max);
        Monitor {
            probe,
            node,
            metrics,
            cfg,
            boot_id,
            state: HealthState::default(),
            shown: None,
            down_reason: None,
            backoff,
            in_flight: None,
            holders_error: None,
        }
    }

    async fn run(mut self, cancel: CancellationToken) {
        tracing::info!(interval = %crate::duration::display(self.cfg.interval), boot_id = %self.boot_id, "GPU monitor started");
        loop {
            let delay = tokio::select! {
                _ = cancel.cancelled() => break,
                delay = self.tick() => delay,
            };
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(delay) => {}
            }
        }
        tracing::info!("GPU monitor stopped");
    }

    /// One round; returns how long to wait before the next.
    async fn tick(&mut self) -> Duration {
        self.sync_with_node().await;
        let (samples, events) = match self.sample().await {
            Some(r) => r,
            None => {
                let e = Error::SampleTimeout {
                    waited: self.in_flight_for(),
                };
                if self.down_reason.as_deref() != Some("sample_timeout") {
                    tracing::warn!(error = %e, "GPU sampling is stuck in the driver; GPU health is unknown until it returns (nothing else waits for it)");
                    self.down_reason = Some("sample_timeout".into());
                }
                self.metrics.error(e.metric_label());
                self.metrics.probe_down(&self.state);
                return self.cfg.interval;
            }
        };
        match samples {
            Ok(samples) => {
                self.on_sample(&samples, &events).await;
                // After the node has been told: a slow kubelet never delays a condition.
                self.refresh_holders().await;
                self.cfg.interval
            }
            Err(e) if e.is_init() => self.on_probe_down(&e),
            Err(e) => {
                tracing::warn!(error = %e, "GPU sampling failed; state unknown until the next sample");
                self.metrics.error(e.metric_label());
                self.metrics.probe_down(&self.state);
                self.cfg.interval
            }
        }
    }

    /// Ask the kubelet which container holds which GPU (bounded; an error clears the labels
    /// rather than keep a stale owner).
    async fn refresh_holders(&mut self) {
        let Some(socket) = &self.cfg.pod_resources_socket else {
            return;
        };
        let timeout = self.cfg.interval.min(POD_RESOURCES_TIMEOUT);
        match podresources::list(socket, timeout).await {
            Ok(holders) => {
                if self.holders_error.take().is_some() {
                    tracing::info!(socket = %socket.display(), gpus = holders.len(), "kubelet pod-resources answering; GPU metrics labelled with their pods");
                }
                self.metrics.set_holders(holders);
            }
            Err(e) => {
                let text = e.to_string();
                if self.holders_error.as_deref() != Some(text.as_str()) {
                    tracing::info!(error = %text, "GPU metrics without pod labels (kubelet pod-resources API not answering)");
                    self.holders_error = Some(text);
                }
                // A missing socket is normal off Kubernetes: not counted as an error.
                if !matches!(&e, podresources::Error::Connect { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
                {
                    self.metrics.error("pod_resources");
                }
                self.metrics.set_holders(Default::default());
            }
        }
    }

    /// Run one sample on a thread of its own (or keep waiting for the one still running) for at
    /// most one interval. `None`: it has not returned.
    async fn sample(&mut self) -> Option<SampleResult> {
        let (mut rx, since) = match self.in_flight.take() {
            Some(pending) => pending,
            None => {
                let (tx, rx) = oneshot::channel();
                let probe = Arc::clone(&self.probe);
                let spawned = std::thread::Builder::new()
                    .name("spotguard-gpu-sample".into())
                    .spawn(move || {
                        let samples = probe.sample();
                        let events = probe.drain_events();
                        let _ = tx.send((samples, events));
                    });
                if let Err(e) = spawned {
                    return Some((
                        Err(Error::SampleTask {
                            detail: format!("starting the sampling thread: {e}"),
                        }),
                        Vec::new(),
                    ));
                }
                (rx, tokio::time::Instant::now())
            }
        };
        match tokio::time::timeout(self.cfg.interval, &mut rx).await {
            Ok(Ok(result)) => Some(result),
            Ok(Err(_)) => Some((
                Err(Error::SampleTask {
                    detail: "the sampling thread ended without a result (panicked)".into(),
                }),
                Vec::new(),
            )),
            Err(_) => {
                self.in_flight = Some((rx, since));
                None
            }
        }
    }

    fn in_flight_for(&self) -> Duration {
        self.in_flight
            .as_ref()
            .map(|(_, since)| since.elapsed())
            .unwrap_or_default()
    }

    /// Resume findings from the node once, then notice an operator removing a condition.
    async fn sync_with_node(&mut self) {
        let on_node = match self.node.gpu_conditions().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "reading GPU conditions from the node failed");
                self.metrics.error("get_conditions");
                return;
            }
        };
        match &self.shown {
            None => {
                let resumed = previous_from_conditions(&on_node);
                if !resumed.findings.is_empty() {
                    tracing::info!(
                        findings = resumed.findings.len(),
                        "resumed sticky GPU findings from the node"
                    );
                }
                if self.state.evaluated_at.is_none() {
                    self.state = resumed;
                } else {
                    self.state.merge_resumed(resumed);
                }
                self.shown = Some(on_node);
            }
            Some(shown) => {
                for (was, now, severity) in [
                    (&shown.unhealthy, &on_node.unhealthy, Severity::Unhealthy),
                    (&shown.degraded, &on_node.degraded, Severity::Degraded),
                ] {
                    if was.active && !now.active {
                        let dropped = self.state.clear_severity(severity);
                        tracing::info!(
                            severity = severity.as_str(),
                            dropped,
                            "GPU condition removed from the node by an operator; findings cleared (re-raised if the evidence is still there)"
                        );
                    }
                }
                self.shown = Some(on_node);
            }
        }
    }

    async fn on_sample(&mut self, samples: &[GpuSample], events: &[GpuEvent]) {
        if let Some(reason) = self.down_reason.take() {
            tracing::info!(previous_error = %reason, gpus = samples.len(), "NVML available again; GPU monitoring resumed");
        }
        self.backoff.reset();
        let before = self.state.node;
        self.state = evaluate(
            &self.state,
            samples,
            events,
            Timestamp::now(),
            &self.boot_id,
            &self.cfg.thresholds,
        );
        self.metrics.record_events(events, &self.state);
        self.metrics.observe(samples, &self.state);
        for e in events {
            tracing::info!(uuid = %e.uuid, gpu = e.index, kind = ?e.kind, "GPU event");
        }
        if self.state.node != before {
            let findings: Vec<String> = self
                .state
                .findings
                .iter()
                .map(|f| format!("{} {}: {}", f.uuid, f.rule.reason(), f.evidence))
                .collect();
            if self.state.node >= Health::Degraded {
                tracing::warn!(from = before.as_str(), to = self.state.node.as_str(), findings = %findings.join("; "), "GPU health changed");
            } else {
                tracing::info!(
                    from = before.as_str(),
                    to = self.state.node.as_str(),
                    "GPU health changed"
                );
            }
        }
        // Until the node's own conditions were read, writing could erase sticky findings.
        let Some(shown) = &self.shown else {
            return;
        };
        let desired = node_conditions(&self.state, &self.boot_id);
        if *shown == desired {
            return;
        }
        match self.node.set_gpu_conditions(&desired).await {
            Ok(()) => self.shown = Some(desired),
            Err(e) => {
                tracing::warn!(error = %e, "setting GPU conditions on the node failed; retrying next sample");
                self.metrics.error("set_conditions");
            }
        }
    }

    fn on_probe_down(&mut self, e: &Error) -> Duration {
        self.metrics.probe_down(&self.state);
        self.metrics.error(e.metric_label());
        let reason = e.to_string();
        let delay = self.backoff.next_delay();
        if self.down_reason.as_deref() != Some(reason.as_str()) {
            tracing::warn!(
                error = %reason,
                retry_in = %crate::duration::display(delay),
                "GPU monitoring unavailable: GPU health is unknown; retrying with backoff (everything else keeps running)"
            );
            self.down_reason = Some(reason);
        } else {
            tracing::debug!(error = %reason, retry_in = %crate::duration::display(delay), "NVML still unavailable");
        }
        delay
    }
}
