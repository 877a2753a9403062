//! GPU health: metrics text from recorded readings, the monitor against a recording NodeOps,
//! NVML failure handling, the `spotguard gpu` report, and a real-GPU smoke test
//! (`cargo test --test gpu -- --ignored` on a machine with an NVIDIA GPU).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use spotguard::gpu::health::{Health, Rule, REASON_NONE};
use spotguard::gpu::metrics::GpuMetrics;
use spotguard::gpu::report::{cli_output, Report, EXIT_HEALTHY, EXIT_UNAVAILABLE, EXIT_UNHEALTHY};
use spotguard::gpu::{
    evaluate, node_conditions, report, run_monitor, GpuArgs, GpuConfig, GpuProbe, GpuSample,
    HealthState, NvmlProbe, RecoveryAction, Thresholds,
};
use spotguard::metrics::encode;
use spotguard::node::{ConditionState, GpuConditions};
use spotguard_testkit::gpu::{
    a100, h100, hgx_h100, not_supported, v100, xid, FakeFailure, FakeGpuProbe, RecordingNodeOps,
};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

fn sample_lines(text: &str) -> Vec<&str> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .collect()
}

fn labels(s: &GpuSample) -> String {
    format!(
        "gpu=\"{}\",uuid=\"{}\",model=\"{}\"",
        s.index, s.uuid, s.model
    )
}

#[test]
fn metrics_text_from_recorded_readings() {
    let mut registry = Registry::default();
    let metrics = GpuMetrics::register(&mut registry);
    let mut h = h100(0);
    h.nvlinks.truncate(1);
    h.nvlinks[0].crc_flit = Some(12);
    h.ecc_corrected_volatile = Some(3);
    h.ecc_corrected_aggregate = Some(41);
    h.clocks_event_reasons = Some(0x4 | 0x8);
    let rtx = not_supported(1);
    let probe = FakeGpuProbe::new(vec![h.clone(), rtx.clone()]);
    let at: jiff::Timestamp = "2025-03-01T12:00:00Z".parse().expect("ts");
    probe.push_events([xid(&h, 79, at), xid(&h, 13, at), xid(&h, 13, at)]);

    let samples = probe.sample().expect("sample");
    let events = probe.drain_events();
    let state = evaluate(
        &HealthState::default(),
        &samples,
        &events,
        at,
        "boot",
        &Thresholds::default(),
    );
    metrics.record_events(&events, &state);
    metrics.observe(&samples, &state);

    let text = encode(&registry);
    let (hl, rl) = (labels(&h), labels(&rtx));
    let mut expected = vec![
        "spotguard_gpu_probe_up 1".to_string(),
        format!("spotguard_gpu_xid_errors_total{{{hl},xid=\"79\"}} 1"),
        format!("spotguard_gpu_xid_errors_total{{{hl},xid=\"13\"}} 2"),
        format!("spotguard_gpu_temperature_celsius{{{hl}}} 31"),
        format!("spotguard_gpu_temperature_celsius{{{rl}}} 41"),
        format!("spotguard_gpu_power_watts{{{hl}}} 71.893"),
        format!("spotguard_gpu_power_watts{{{rl}}} 19.2"),
        format!("spotguard_gpu_power_limit_watts{{{hl}}} 700.0"),
        format!("spotguard_gpu_power_limit_watts{{{rl}}} 450.0"),
        format!("spotguard_gpu_utilization_ratio{{{hl}}} 0.0"),
        format!("spotguard_gpu_utilization_ratio{{{rl}}} 0.03"),
        format!("spotguard_gpu_memory_utilization_ratio{{{hl}}} 0.0"),
        format!("spotguard_gpu_memory_utilization_ratio{{{rl}}} 0.01"),
        format!("spotguard_gpu_memory_used_bytes{{{hl}}} 556793856"),
        format!("spotguard_gpu_memory_used_bytes{{{rl}}} 1048576"),
        format!("spotguard_gpu_memory_total_bytes{{{hl}}} 85520809984"),
        format!("spotguard_gpu_memory_total_bytes{{{rl}}} 25757220864"),
        format!("spotguard_gpu_ecc_enabled{{{hl}}} 1"),
        format!("spotguard_gpu_ecc_errors_total{{{hl},type=\"corrected\",counter=\"volatile\"}} 3"),
        format!(
            "spotguard_gpu_ecc_errors_total{{{hl},type=\"uncorrected\",counter=\"volatile\"}} 0"
        ),
        format!(
            "spotguard_gpu_ecc_errors_total{{{hl},type=\"corrected\",counter=\"aggregate\"}} 41"
        ),
        format!(
            "spotguard_gpu_ecc_errors_total{{{hl},type=\"uncorrected\",counter=\"aggregate\"}} 0"
        ),
        format!("spotguard_gpu_remapped_rows{{{hl},type=\"correctable\"}} 0"),
        format!("spotguard_gpu_remapped_rows{{{hl},type=\"uncorrectable\"}} 0"),
        format!("spotguard_gpu_remap_pending{{{hl}}} 0"),
        format!("spotguard_gpu_remap_failure{{{hl}}} 0"),
        format!("spotguard_gpu_recovery_action{{{hl}}} 0"),
    ];
    for (reason, on) in [
        ("gpu_idle", 0),
        ("applications_clocks_setting", 0),
        ("sw_power_cap", 1),
        ("hw_slowdown", 1),
        ("sync_boost", 0),
        ("sw_thermal_slowdown", 0),
        ("hw_thermal_slowdown", 0),
        ("hw_power_brake_slowdown", 0),
        ("display_clock_setting", 0),
    ] {
        expected.push(format!(
            "spotguard_gpu_clocks_event_reasons{{{hl},reason=\"{reason}\"}} {on}"
        ));
    }
    expected.extend([
        format!("spotguard_gpu_pcie_replay_total{{{hl}}} 0"),
        format!("spotguard_gpu_energy_joules_total{{{hl}}} 2614881.205"),
        format!("spotguard_gpu_nvlink_errors_total{{{hl},link=\"0\",counter=\"crc_flit\"}} 12"),
        format!("spotguard_gpu_nvlink_errors_total{{{hl},link=\"0\",counter=\"crc_data\"}} 0"),
        format!("spotguard_gpu_nvlink_errors_total{{{hl},link=\"0\",counter=\"replay\"}} 0"),
        format!("spotguard_gpu_nvlink_errors_total{{{hl},link=\"0\",counter=\"recovery\"}} 0"),
        format!("spotguard_gpu_nvlink_up{{{hl},link=\"0\"}} 1"),
        format!("spotguard_gpu_lost{{{hl}}} 0"),
        format!("spotguard_gpu_lost{{{rl}}} 0"),
        format!("spotguard_gpu_health{{{hl},state=\"healthy\"}} 0"),
        format!("spotguard_gpu_health{{{hl},state=\"degraded\"}} 0"),
        format!("spotguard_gpu_health{{{hl},state=\"unhealthy\"}} 1"),
        format!("spotguard_gpu_health{{{hl},state=\"unknown\"}} 0"),
        format!("spotguard_gpu_health{{{rl},state=\"healthy\"}} 1"),
        format!("spotguard_gpu_health{{{rl},state=\"degraded\"}} 0"),
        format!("spotguard_gpu_health{{{rl},state=\"unhealthy\"}} 0"),
        format!("spotguard_gpu_health{{{rl},state=\"unknown\"}} 0"),
        "spotguard_node_gpu_health{state=\"healthy\"} 0".to_string(),
        "spotguard_node_gpu_health{state=\"degraded\"} 0".to_string(),
        "spotguard_node_gpu_health{state=\"unhealthy\"} 1".to_string(),
        "spotguard_node_gpu_health{state=\"unknown\"} 0".to_string(),
        "spotguard_gpu_findings{rule=\"xid\",severity=\"unhealthy\"} 1".to_string(),
    ]);
    // Every line exact; families keep their series in a hash map, so compare sorted.
    let mut got = sample_lines(&text);
    got.sort_unstable();
    let mut expected: Vec<&str> = expected.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(got, expected, "full text:\n{text}");
    // Families without any supported reading have no series and no header either.
    for absent in [
        "spotguard_gpu_retired_pages",
        "spotguard_gpu_retired_pages_pending",
    ] {
        assert!(!text.contains(&format!("# TYPE {absent} ")), "{absent}");
    }
    assert!(text.contains("# TYPE spotguard_gpu_ecc_errors counter"));
    assert!(text.contains("# TYPE spotguard_gpu_remapped_rows gauge"));
    assert!(text.ends_with("# EOF\n"));
}

#[test]
fn metrics_follow_the_snapshot_and_pre_ampere_readings() {
    let mut registry = Registry::default();
    let metrics = GpuMetrics::register(&mut registry);
    let v = GpuSample {
        retired_pages_single_bit: Some(2),
        retired_pages_pending: Some(true),
        ..v100(0)
    };
    let state = evaluate(
        &HealthState::default(),
        &[v.clone(), a100(1)],
        &[],
        jiff::Timestamp::now(),
        "boot",
        &Thresholds::default(),
    );
    metrics.observe(&[v.clone(), a100(1)], &state);
    let text = encode(&registry);
    let vl = labels(&v);
    for line in [
        format!("spotguard_gpu_retired_pages{{{vl},cause=\"single_bit_ecc\"}} 2"),
        format!("spotguard_gpu_retired_pages{{{vl},cause=\"double_bit_ecc\"}} 0"),
        format!("spotguard_gpu_retired_pages_pending{{{vl}}} 1"),
        format!("spotguard_gpu_health{{{vl},state=\"unhealthy\"}} 1"),
        "spotguard_gpu_findings{rule=\"retired_pages_pending\",severity=\"unhealthy\"} 1".into(),
    ] {
        assert!(
            sample_lines(&text).contains(&line.as_str()),
            "{line}\n{text}"
        );
    }
    // V100 has no row remapping and the R535 A100 no recovery action: no series for them.
    assert!(!text.contains(&format!("spotguard_gpu_remap_pending{{{vl}}}")));
    assert!(!text.contains("spotguard_gpu_recovery_action{"));

    // The next snapshot no longer lists the V100: its readings go, its health stays (unhealthy:
    // missing GPU on top of the pending retirement).
    let state = evaluate(
        &state,
        &[a100(1)],
        &[],
        jiff::Timestamp::now(),
        "boot",
        &Thresholds::default(),
    );
    metrics.observe(&[a100(1)], &state);
    let text = encode(&registry);
    assert!(!text.contains(&format!("spotguard_gpu_temperature_celsius{{{vl}}}")));
    assert!(sample_lines(&text)
        .contains(&format!("spotguard_gpu_health{{{vl},state=\"unhealthy\"}} 1").as_str()));

    // Probe down: no readings at all, everything unknown.
    metrics.probe_down(&state);
    let text = encode(&registry);
    assert!(sample_lines(&text).contains(&"spotguard_gpu_probe_up 0"));
    assert!(!text.contains("spotguard_gpu_temperature_celsius{"));
    assert!(sample_lines(&text).contains(&"spotguard_node_gpu_health{state=\"unknown\"} 1"));
    assert!(sample_lines(&text)
        .contains(&format!("spotguard_gpu_health{{{vl},state=\"unknown\"}} 1").as_str()));
}

// === monitor ===

struct Harness {
    _dir: tempfile::TempDir,
    boot_path: PathBuf,
    registry: Registry,
    metrics: Arc<GpuMetrics>,
}

impl Harness {
    fn new(boot_id: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let boot_path = dir.path().join("boot_id");
        std::fs::write(&boot_path, format!("{boot_id}\n")).expect("boot id");
        let mut registry = Registry::default();
        let metrics = Arc::new(GpuMetrics::register(&mut registry));
        Harness {
            _dir: dir,
            boot_path,
            registry,
            metrics,
        }
    }

    fn reboot(&self, boot_id: &str) {
        std::fs::write(&self.boot_path, format!("{boot_id}\n")).expect("boot id");
    }

    fn config(&self) -> GpuConfig {
        GpuConfig {
            interval: Duration::from_millis(20),
            init_backoff_min: Duration::from_millis(20),
            init_backoff_max: Duration::from_millis(80),
            boot_id_path: self.boot_path.clone(),
            ..GpuConfig::default()
        }
    }

    fn start(&self, probe: Arc<dyn GpuProbe>, node: Arc<RecordingNodeOps>) -> Running {
        let cancel = CancellationToken::new();
        let handle = tokio::spawn(run_monitor(
            probe,
            node,
            Arc::clone(&self.metrics),
            self.config(),
            cancel.clone(),
        ));
        Running { cancel, handle }
    }

    fn text(&self) -> String {
        encode(&self.registry)
    }

    async fn wait_metrics(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let text = self.text();
            if done(&text) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting for {what}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

struct Running {
    cancel: CancellationToken,
    handle: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.cancel.cancel();
        tokio::time::timeout(WAIT, self.handle)
            .await
            .expect("monitor stops on cancel")
            .expect("monitor task");
    }
}

async fn wait_samples(probe: &FakeGpuProbe, more_than: usize) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while probe.samples_taken() <= more_than {
        assert!(tokio::time::Instant::now() < deadline, "probe not sampled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const BOOT_A: &str = "7f3c2a9e-5d41-4b8f-a6c2-1e9d8b7a6c50";
const BOOT_B: &str = "c41d9e02-7a3b-4e6f-8d15-9b2c0a4f7e31";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitor_sets_conditions_from_findings() {
    let h = Harness::new(BOOT_A);
    let gpus = hgx_h100();
    let probe = Arc::new(FakeGpuProbe::new(gpus.clone()));
    let node = Arc::new(RecordingNodeOps::default());
    let running = h.start(probe.clone(), node.clone());

    // Healthy: the node shows both conditions False.
    let c = node
        .wait_for(WAIT, |c| c.unhealthy.reason == REASON_NONE)
        .await
        .expect("healthy conditions written");
    assert!(!c.unhealthy.active && !c.degraded.active);
    h.wait_metrics("healthy node", |t| {
        t.contains("spotguard_node_gpu_health{state=\"healthy\"} 1")
    })
    .await;

    // XID 79 on GPU 5 ⇒ GPUUnhealthy naming its UUID, the evidence and the boot id.
    probe.push_events([xid(&gpus[5], 79, jiff::Timestamp::now())]);
    let c = node
        .wait_for(WAIT, |c| c.unhealthy.active)
        .await
        .expect("unhealthy condition");
    assert_eq!(c.unhealthy.reason, "XidError");
    assert!(
        c.unhealthy.message.contains(&gpus[5].uuid),
        "{}",
        c.unhealthy.message
    );
    assert!(c
        .unhealthy
        .message
        .contains("XID 79 (GPU has fallen off the bus)"));
    assert!(c.unhealthy.message.ends_with(&format!("boot_id={BOOT_A}")));
    assert!(!c.degraded.active);
    h.wait_metrics("xid counted", |t| {
        t.contains(&format!(
            "spotguard_gpu_xid_errors_total{{{},xid=\"79\"}} 1",
            labels(&gpus[5])
        ))
    })
    .await;

    // GPU 2 throttles for good ⇒ GPUDegraded as well; GPUUnhealthy unchanged.
    let mut hot = gpus.clone();
    hot[2].clocks_event_reasons = Some(0x40);
    probe.set_samples(hot);
    let c = node
        .wait_for(WAIT, |c| c.degraded.active)
        .await
        .expect("degraded condition");
    assert_eq!(c.degraded.reason, "ClocksThrottled");
    assert!(c.degraded.message.contains(&gpus[2].uuid));
    assert!(c.unhealthy.active);

    // The XID evidence is momentary, yet many clean samples later the condition stays.
    probe.set_samples(gpus.clone());
    let taken = probe.samples_taken();
    wait_samples(&probe, taken + 10).await;
    let now = node.on_node();
    assert!(
        now.unhealthy.active && now.degraded.active,
        "sticky: {now:?}"
    );
    // Only changes were written.
    let writes = node.writes();
    assert_eq!(writes.len(), 3, "{writes:#?}");

    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_removing_a_condition_clears_momentary_findings_only() {
    let h = Harness::new(BOOT_A);
    let gpus = hgx_h100();
    let probe = Arc::new(FakeGpuProbe::new(gpus.clone()));
    let node = Arc::new(RecordingNodeOps::default());
    let running = h.start(probe.clone(), node.clone());

    probe.push_events([xid(&gpus[0], 48, jiff::Timestamp::now())]);
    node.wait_for(WAIT, |c| c.unhealthy.active)
        .await
        .expect("unhealthy");

    // The operator sets GPUUnhealthy to False (after replacing the GPU's workload, say).
    node.operator_clears(true, false);
    let c = node
        .wait_for(WAIT, |c| c.unhealthy.reason == REASON_NONE)
        .await
        .expect("monitor accepts the operator's clear");
    assert!(!c.unhealthy.active);
    let taken = probe.samples_taken();
    wait_samples(&probe, taken + 5).await;
    assert!(
        !node.on_node().unhealthy.active,
        "not re-raised without evidence"
    );

    // Evidence that is still there comes back after an operator clear.
    let mut pending = gpus.clone();
    pending[4].remap_pending = Some(true);
    probe.set_samples(pending);
    node.wait_for(WAIT, |c| {
        c.unhealthy.active && c.unhealthy.reason == "RowRemapPending"
    })
    .await
    .expect("pending remap");
    node.operator_clears(true, false);
    let taken = probe.samples_taken();
    wait_samples(&probe, taken + 5).await;
    let c = node
        .wait_for(WAIT, |c| c.unhealthy.active)
        .await
        .expect("re-raised");
    assert_eq!(c.unhealthy.reason, "RowRemapPending");

    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn findings_survive_an_agent_restart_and_clear_after_a_reboot() {
    let h = Harness::new(BOOT_A);
    let gpus = hgx_h100();
    let probe = Arc::new(FakeGpuProbe::new(gpus.clone()));
    let node = Arc::new(RecordingNodeOps::default());

    let first = h.start(probe.clone(), node.clone());
    probe.push_events([xid(&gpus[7], 95, jiff::Timestamp::now())]);
    let shown = node
        .wait_for(WAIT, |c| c.unhealthy.active)
        .await
        .expect("unhealthy");
    first.stop().await;

    // Restart on the same boot: the condition is resumed and kept.
    let writes_before = node.writes().len();
    let second = h.start(probe.clone(), node.clone());
    let taken = probe.samples_taken();
    wait_samples(&probe, taken + 10).await;
    assert_eq!(node.on_node(), shown, "kept across the restart");
    assert_eq!(node.writes().len(), writes_before, "nothing rewritten");
    h.wait_metrics("resumed unhealthy state", |t| {
        t.contains("spotguard_node_gpu_health{state=\"unhealthy\"} 1")
    })
    .await;
    second.stop().await;

    // The machine rebooted (new boot id) and the GPU is fine: cleared.
    h.reboot(BOOT_B);
    let third = h.start(probe.clone(), node.clone());
    let c = node
        .wait_for(WAIT, |c| !c.unhealthy.active)
        .await
        .expect("cleared after reboot");
    assert_eq!(c.unhealthy.reason, REASON_NONE);
    third.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_down_is_unknown_keeps_node_conditions_and_recovers() {
    let h = Harness::new(BOOT_A);
    let gpus = hgx_h100();
    // A previous agent left GPUUnhealthy on the node; NVML does not load this time.
    let earlier = node_conditions(
        &evaluate(
            &HealthState::default(),
            &gpus,
            &[xid(&gpus[1], 79, jiff::Timestamp::now())],
            jiff::Timestamp::now(),
            BOOT_A,
            &Thresholds::default(),
        ),
        BOOT_A,
    );
    let node = Arc::new(RecordingNodeOps::with_conditions(earlier.clone()));
    let probe = Arc::new(FakeGpuProbe::failing(FakeFailure::DriverNotLoaded));
    let running = h.start(probe.clone(), node.clone());

    let text = h
        .wait_metrics("retries of a failed init", |t| {
            t.contains("spotguard_gpu_probe_up 0")
                && sample_lines(t).iter().any(|l| {
                    l.starts_with("spotguard_gpu_monitor_errors_total{error=\"driver_not_loaded\"}")
                        && l.rsplit(' ').next().and_then(|n| n.parse::<u64>().ok()) >= Some(3)
                })
        })
        .await;
    assert!(
        text.contains("spotguard_node_gpu_health{state=\"unknown\"} 1"),
        "{text}"
    );
    assert!(node.writes().is_empty(), "nothing written while blind");
    assert_eq!(node.on_node(), earlier);

    // The driver comes up: probe up, the resumed finding still there (no reboot, no reset).
    probe.set_samples(gpus.clone());
    h.wait_metrics("probe up", |t| t.contains("spotguard_gpu_probe_up 1"))
        .await;
    let taken = probe.samples_taken();
    wait_samples(&probe, taken + 5).await;
    assert!(node.on_node().unhealthy.active);
    assert!(node.on_node().unhealthy.message.contains(&gpus[1].uuid));

    // NVML up but failing to sample: unknown again, no backoff needed, nothing rewritten.
    let writes = node.writes().len();
    probe.set_failure(FakeFailure::CountDevices);
    let text = h
        .wait_metrics("sampling failure", |t| {
            t.contains("spotguard_gpu_monitor_errors_total{error=\"count_devices\"}")
        })
        .await;
    assert!(sample_lines(&text).contains(&"spotguard_gpu_probe_up 0"));
    assert!(sample_lines(&text).contains(&"spotguard_node_gpu_health{state=\"unknown\"} 1"));
    assert_eq!(node.writes().len(), writes);
    assert!(node.on_node().unhealthy.active);

    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_probe_that_cannot_load_leaves_probe_up_zero() {
    let h = Harness::new(BOOT_A);
    let node = Arc::new(RecordingNodeOps::default());
    let probe: Arc<dyn GpuProbe> = Arc::new(NvmlProbe::deferred_with_library(
        "/nonexistent/spotguard-test/libnvidia-ml.so.1",
    ));
    let running = h.start(probe, node.clone());
    let text = h
        .wait_metrics("load_library errors", |t| {
            t.contains("spotguard_gpu_monitor_errors_total{error=\"load_library\"}")
        })
        .await;
    assert!(
        sample_lines(&text).contains(&"spotguard_gpu_probe_up 0"),
        "{text}"
    );
    assert!(sample_lines(&text).contains(&"spotguard_node_gpu_health{state=\"unknown\"} 1"));
    assert!(node.writes().is_empty());
    running.stop().await;
}

/// On this machine NVML is either absent (typed init error) or present (a GPU machine).
#[test]
fn nvml_probe_new_fails_cleanly_without_a_driver() {
    let has_driver = Path::new("/dev/nvidiactl").exists();
    match NvmlProbe::new() {
        Ok(probe) => assert!(
            has_driver,
            "NVML initialised without /dev/nvidiactl: {probe:?}"
        ),
        Err(e) => {
            assert!(!has_driver, "driver present but NVML failed: {e}");
            assert!(e.is_init(), "{e:?}");
            assert!(
                matches!(e.metric_label(), "load_library" | "driver_not_loaded"),
                "{e}"
            );
            let r = Report::unavailable(&e, "boot");
            assert_eq!(r.exit_code(), EXIT_UNAVAILABLE);
        }
    }
}

// === spotguard gpu ===

#[test]
fn cli_report_exit_codes_and_rendering() {
    let t = Thresholds::default();
    let healthy = FakeGpuProbe::new(hgx_h100());
    let r = report(&healthy, &t, "b00t");
    assert_eq!(r.node, Health::Healthy);
    assert_eq!(r.exit_code(), EXIT_HEALTHY);
    let out = cli_output(&GpuArgs { json: false }, &r);
    assert_eq!(out.code, EXIT_HEALTHY);
    assert!(out.stderr.is_empty());
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(lines[0].starts_with("GPU  UUID"), "{}", out.stdout);
    assert_eq!(lines.len(), 1 + 8 + 2, "{}", out.stdout);
    assert!(lines[1].contains("NVIDIA H100 80GB HBM3") && lines[1].contains("healthy"));
    assert!(
        lines[1].contains("31C") && lines[1].contains("72/700W"),
        "{}",
        lines[1]
    );
    assert!(lines[1].contains("0.5/79.6 GiB"), "{}", lines[1]);
    assert!(lines[1].contains("gpu_idle"));
    assert_eq!(
        lines[10],
        "node: healthy (8 GPUs, driver 550.54.15, boot_id b00t)"
    );

    // Degraded ⇒ shown, exit 0 (recovery action drain_p2p is a state: one sample suffices).
    let mut gpus = hgx_h100();
    gpus[3].recovery_action = Some(RecoveryAction::DrainP2p);
    let r = report(&FakeGpuProbe::new(gpus), &t, "b00t");
    assert_eq!(r.node, Health::Degraded);
    assert_eq!(r.exit_code(), EXIT_HEALTHY);
    assert!(r.to_table().contains("degraded  "));

    // Unhealthy ⇒ exit 1, findings listed.
    let mut gpus = hgx_h100();
    gpus[6].remap_pending = Some(true);
    gpus[6].remapped_rows_uncorrectable = Some(1);
    let r = report(&FakeGpuProbe::new(gpus.clone()), &t, "b00t");
    assert_eq!(r.exit_code(), EXIT_UNHEALTHY);
    let table = r.to_table();
    assert!(table.contains("1/0 pending"), "{table}");
    assert!(
        table.contains(&format!(
            "  unhealthy {} (gpu 6) RowRemapPending: row remap pending",
            gpus[6].uuid
        )),
        "{table}"
    );

    // JSON: the same verdict, machine-readable; NotSupported readings are null, not zero.
    let out = cli_output(&GpuArgs { json: true }, &r);
    assert_eq!(out.code, EXIT_UNHEALTHY);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    assert_eq!(v["node"], "unhealthy");
    assert_eq!(v["boot_id"], "b00t");
    assert_eq!(v["gpus"].as_array().map(Vec::len), Some(8));
    assert_eq!(v["gpus"][6]["health"], "unhealthy");
    assert_eq!(v["gpus"][6]["remap_pending"], true);
    assert_eq!(v["gpus"][6]["uuid"], gpus[6].uuid);
    assert!(v["gpus"][0]["retired_pages_pending"].is_null());
    assert_eq!(v["findings"][0]["rule"], "row_remap_pending");
    assert_eq!(v["findings"][0]["severity"], "unhealthy");

    // NVML unavailable ⇒ exit 2 with the reason (stderr for the table, in the JSON otherwise).
    let down = FakeGpuProbe::failing(FakeFailure::LibraryMissing);
    let r = report(&down, &t, "b00t");
    let out = cli_output(&GpuArgs { json: false }, &r);
    assert_eq!(out.code, EXIT_UNAVAILABLE);
    assert!(out.stdout.is_empty());
    assert!(out.stderr.contains("libnvidia-ml.so.1"), "{}", out.stderr);
    let out = cli_output(&GpuArgs { json: true }, &r);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    assert!(v["unavailable"]
        .as_str()
        .is_some_and(|s| s.contains("libnvidia-ml.so.1")));
    assert_eq!(v["node"], "unknown");

    // NVML up but no GPU ⇒ exit 2 as well.
    let r = report(&FakeGpuProbe::new(vec![]), &t, "b00t");
    let out = cli_output(&GpuArgs { json: false }, &r);
    assert_eq!(out.code, EXIT_UNAVAILABLE);
    assert!(out.stderr.contains("no GPU"));
}

#[test]
fn conditions_message_resumes_exactly() {
    let gpus = hgx_h100();
    let state = evaluate(
        &HealthState::default(),
        &gpus,
        &[xid(&gpus[2], 79, jiff::Timestamp::now())],
        jiff::Timestamp::now(),
        BOOT_A,
        &Thresholds::default(),
    );
    let c = node_conditions(&state, BOOT_A);
    let resumed = spotguard::gpu::previous_from_conditions(&c);
    assert_eq!(resumed.findings.len(), 1);
    assert_eq!(resumed.findings[0].rule, Rule::Xid);
    assert_eq!(node_conditions(&resumed, BOOT_A), c);
    // An inactive condition carries nothing to resume.
    let none = GpuConditions {
        unhealthy: ConditionState {
            active: false,
            reason: REASON_NONE.into(),
            message: String::new(),
        },
        degraded: ConditionState::default(),
    };
    assert!(spotguard::gpu::previous_from_conditions(&none)
        .findings
        .is_empty());
}

// === real GPU ===

#[test]
#[ignore = "requires an NVIDIA GPU"]
fn smoke_real_gpu() {
    let probe = NvmlProbe::new().expect("NVML initialises on a GPU machine");
    let samples = probe.sample().expect("sample");
    assert!(!samples.is_empty(), "at least one GPU");
    let mut uuids: Vec<&str> = samples.iter().map(|s| s.uuid.as_str()).collect();
    uuids.sort_unstable();
    uuids.dedup();
    assert_eq!(uuids.len(), samples.len(), "UUIDs unique");
    for s in &samples {
        assert!(s.uuid.starts_with("GPU-"), "{}", s.uuid);
        assert!(!s.lost, "{} lost", s.uuid);
        let t = s.temperature_celsius.expect("temperature readable");
        assert!((10..=100).contains(&t), "{}: {t} °C", s.uuid);
        assert!(s.ecc_enabled.is_some(), "{}: ECC mode readable", s.uuid);
        assert!(s.memory_total_bytes.is_some_and(|b| b > 1 << 30));
        if s.model.contains("H100") || s.model.contains("H200") || s.model.contains("A100") {
            assert!(
                s.remapped_rows_correctable.is_some(),
                "{}: remapped rows",
                s.model
            );
            assert!(s.remap_pending.is_some() && s.remap_failure.is_some());
        }
        if s.model.contains("H100") || s.model.contains("H200") {
            assert_eq!(
                s.retired_pages_single_bit, None,
                "page retirement is NotSupported on Hopper"
            );
        }
        println!("{s:#?}");
    }
    assert!(!probe.events_registered().is_empty(), "event set registers");
    std::thread::sleep(Duration::from_secs(1));
    let again = probe.sample().expect("second sample");
    assert_eq!(again.len(), samples.len());
    let boot = spotguard::life::read_boot_id().expect("boot id");
    let r = report(&probe, &Thresholds::default(), &boot);
    println!("{}", r.to_table());
    println!("{}", r.to_json());
    assert!(matches!(
        r.node,
        Health::Healthy | Health::Degraded | Health::Unhealthy
    ));
    let mut registry = Registry::default();
    let metrics = GpuMetrics::register(&mut registry);
    let state = evaluate(
        &HealthState::default(),
        &again,
        &probe.drain_events(),
        jiff::Timestamp::now(),
        &boot,
        &Thresholds::default(),
    );
    metrics.observe(&again, &state);
    let text = encode(&registry);
    assert!(text.contains("spotguard_gpu_temperature_celsius{"));
    println!("{text}");
}
