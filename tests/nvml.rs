//! `NvmlProbe` end to end through the real NVML C ABI, without a GPU: the NVML stand-in
//! (tests/nvml-stub/nvml_stub.c, compiled here with the system gcc as `libnvidia-ml.so.1`) is
//! found by the spotguard binary through `LD_LIBRARY_PATH` exactly as the driver's library is
//! on a GPU node, and answers from a scenario file (`NVML_STUB_SCENARIO`).
//!
//! Scenarios: a healthy 2×H100 node, a degraded H100 (driver recovery action "drain P2P"), an
//! unhealthy A100 (row remap pending, no recovery-action field on R535), an H100 + A100 node
//! whose A100 does not support temperature / power / energy, an XID 79 arriving mid-run, a
//! library that appears 10 s after the agent started, and a library that hangs in
//! `nvmlDeviceGetTemperature`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::free_port;
use spotguard_testkit::k8s::{non_system_taints, TestCluster};
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::Kid;

const BIN: &str = env!("CARGO_BIN_EXE_spotguard");

// === the stand-in library ===

/// Directory holding the compiled `libnvidia-ml.so.1` (built once per test binary, compiled to
/// a temporary name and renamed into place so a concurrent reader never sees half a file).
fn stub_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nvml-stub/nvml_stub.c");
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("nvml-stub");
        std::fs::create_dir_all(&dir).expect("stub dir");
        let tmp = dir.join(format!(".libnvidia-ml.so.1.{}", std::process::id()));
        let out = Command::new("gcc")
            .args([
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-O1",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-o",
            ])
            .arg(&tmp)
            .arg(&source)
            .arg("-lpthread")
            .output()
            .expect("gcc (install it with scripts/deps/gcc.sh)");
        assert!(
            out.status.success(),
            "compiling the NVML stand-in failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::rename(&tmp, dir.join("libnvidia-ml.so.1")).expect("install stub");
        dir
    })
}

/// A scenario file plus a trace file of the calls the agent made.
struct Scenario {
    dir: tempfile::TempDir,
}

impl Scenario {
    fn new(text: &str) -> Scenario {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("scenario"), text).expect("scenario");
        Scenario { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("scenario")
    }

    fn trace_path(&self) -> PathBuf {
        self.dir.path().join("trace")
    }

    fn trace(&self) -> String {
        std::fs::read_to_string(self.trace_path()).unwrap_or_default()
    }

    /// Environment that points a spotguard process at the stand-in in `lib_dir`.
    fn env(&self, lib_dir: &Path) -> Vec<(String, String)> {
        vec![
            ("LD_LIBRARY_PATH".into(), lib_dir.display().to_string()),
            (
                "NVML_STUB_SCENARIO".into(),
                self.path().display().to_string(),
            ),
            (
                "NVML_STUB_TRACE".into(),
                self.trace_path().display().to_string(),
            ),
        ]
    }
}

/// An H100 SXM5 80 GB as NVML reports it on R550+: row remapping, recovery-action field,
/// 18 NVLink4 links, no page retirement.
fn h100(index: u32, extra: &str) -> String {
    format!(
        "device\n\
         uuid GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b0000100{index}\n\
         name NVIDIA H100 80GB HBM3\n\
         temperature 41\n\
         power_mw 312500\n\
         power_limit_mw 700000\n\
         utilization 87 42\n\
         memory 85520809984 42949672960\n\
         ecc_mode 1\n\
         ecc corrected volatile 0\n\
         ecc uncorrected volatile 0\n\
         ecc corrected aggregate 12\n\
         ecc uncorrected aggregate 0\n\
         unsupported retired_pages\n\
         unsupported retired_pending\n\
         throttle 0x1\n\
         pcie_replay 0\n\
         energy_mj 987654321\n\
         field 142 0\n\
         field 143 0\n\
         field 144 0\n\
         field 145 0\n\
         field 230 0\n\
         nvlinks 18\n\
         nvlink_errors 0 0 0 0\n\
         {extra}\n"
    )
}

/// An A100 SXM4 80 GB on R535: row remapping, no recovery-action field (230 answers
/// NOT_SUPPORTED), 12 NVLink3 links.
fn a100(index: u32, extra: &str) -> String {
    format!(
        "device\n\
         uuid GPU-a100a100-4b7d-9c3e-2f8d-0c4b0000200{index}\n\
         name NVIDIA A100-SXM4-80GB\n\
         temperature 38\n\
         power_mw 95000\n\
         power_limit_mw 400000\n\
         utilization 0 0\n\
         memory 85899345920 1048576\n\
         ecc_mode 1\n\
         ecc corrected volatile 0\n\
         ecc uncorrected volatile 0\n\
         ecc corrected aggregate 0\n\
         ecc uncorrected aggregate 0\n\
         unsupported retired_pages\n\
         unsupported retired_pending\n\
         throttle 0x0\n\
         pcie_replay 3\n\
         energy_mj 123456\n\
         field 142 0\n\
         field 143 0\n\
         field 144 0\n\
         field 145 0\n\
         nvlinks 12\n\
         {extra}\n"
    )
}

// === `spotguard gpu --json` ===

fn gpu_json(scenario: &Scenario, lib_dir: &Path) -> (i32, Value) {
    let out = Command::new(BIN)
        .args(["gpu", "--json"])
        .envs(scenario.env(lib_dir))
        .output()
        .expect("spotguard gpu");
    let text = String::from_utf8_lossy(&out.stdout);
    let json: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {text}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().expect("exit code"), json)
}

fn rules(report: &Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .expect("findings")
        .iter()
        .map(|f| f["rule"].as_str().expect("rule").to_string())
        .collect()
}

#[test]
fn cli_healthy_h100_node_reads_every_field_through_the_abi() {
    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "temperature 44")
    ));
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 0, "{r:#}");
    assert_eq!(r["node"], "healthy", "{r:#}");
    assert_eq!(r["driver_version"], "570.124.06");
    let gpus = r["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), 2);
    let g = &gpus[0];
    assert_eq!(g["uuid"], "GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b00001000");
    assert_eq!(g["model"], "NVIDIA H100 80GB HBM3");
    assert_eq!(g["health"], "healthy");
    assert_eq!(g["temperature_celsius"], 41);
    assert_eq!(gpus[1]["temperature_celsius"], 44);
    assert_eq!(g["power_watts"], 312.5);
    assert_eq!(g["power_limit_watts"], 700.0);
    assert_eq!(g["utilization_gpu"], 0.87);
    assert_eq!(g["utilization_memory"], 0.42);
    assert_eq!(g["memory_total_bytes"], 85520809984u64);
    assert_eq!(g["memory_used_bytes"], 42949672960u64);
    assert_eq!(g["ecc_enabled"], true);
    assert_eq!(g["ecc_corrected_aggregate"], 12);
    assert_eq!(g["ecc_uncorrected_volatile"], 0);
    assert_eq!(g["remapped_rows_correctable"], 0);
    assert_eq!(g["remap_pending"], false);
    assert_eq!(g["remap_failure"], false);
    assert_eq!(g["recovery_action"], "none");
    assert_eq!(g["clocks_event_reasons"], 1);
    assert_eq!(g["energy_millijoules"], 987654321u64);
    assert_eq!(g["nvlinks"].as_array().expect("links").len(), 18);
    assert_eq!(g["nvlinks"][17]["up"], true);
    // Not supported on Hopper: absent, not zero.
    assert_eq!(g["retired_pages_single_bit"], Value::Null);
    assert_eq!(g["retired_pages_pending"], Value::Null);
    assert_eq!(
        g["read_errors"].as_array().expect("errors").len(),
        0,
        "{g:#}"
    );
    let trace = s.trace();
    for call in [
        "nvmlInit_v2",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlDeviceRegisterEvents",
    ] {
        assert!(
            trace.lines().any(|l| l == call),
            "{call} not called:\n{trace}"
        );
    }
}

#[test]
fn cli_degraded_h100_when_the_driver_asks_to_drain_p2p() {
    // NVML_GPU_RECOVERY_ACTION_DRAIN_P2P = 3.
    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "field 230 3")
    ));
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 0, "degraded is shown, not failed: {r:#}");
    assert_eq!(r["node"], "degraded", "{r:#}");
    assert_eq!(r["gpus"][0]["health"], "healthy");
    assert_eq!(r["gpus"][1]["health"], "degraded");
    assert_eq!(r["gpus"][1]["recovery_action"], "drain_p2p");
    assert_eq!(rules(&r), vec!["recovery_action"], "{r:#}");
}

#[test]
fn cli_unhealthy_a100_with_a_pending_row_remap() {
    let s = Scenario::new(&format!(
        "driver 535.183.01\n{}{}",
        a100(0, ""),
        a100(1, "field 143 2\nfield 144 1")
    ));
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["node"], "unhealthy");
    let g = &r["gpus"][1];
    assert_eq!(g["health"], "unhealthy");
    assert_eq!(g["remapped_rows_uncorrectable"], 2);
    assert_eq!(g["remap_pending"], true);
    // R535 has no recovery-action field: NOT_SUPPORTED per field ⇒ absent, not "none".
    assert_eq!(g["recovery_action"], Value::Null);
    assert_eq!(g["nvlinks"].as_array().expect("links").len(), 12);
    assert!(
        rules(&r).contains(&"row_remap_pending".to_string()),
        "{r:#}"
    );
    assert_eq!(r["gpus"][0]["health"], "healthy");
}

#[test]
fn cli_gpu_that_fell_off_the_bus_is_lost_and_unhealthy() {
    // Every call on GPU 1 answers NVML_ERROR_GPU_IS_LOST from the start.
    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "lost_after 0")
    ));
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["node"], "unhealthy");
    let g = &r["gpus"][1];
    assert_eq!(g["lost"], true, "{g:#}");
    assert_eq!(
        g["temperature_celsius"],
        Value::Null,
        "no readings of a lost GPU"
    );
    assert!(rules(&r).contains(&"gpu_lost".to_string()), "{r:#}");
    assert_eq!(r["gpus"][0]["health"], "healthy");
}

#[test]
fn cli_without_the_library_or_the_driver_is_unavailable() {
    let s = Scenario::new(&h100(0, ""));
    let empty = tempfile::tempdir().expect("tempdir");
    let (code, r) = gpu_json(&s, empty.path());
    assert_eq!(code, 2, "{r:#}");
    let why = r["unavailable"].as_str().expect("unavailable");
    assert!(why.contains("libnvidia-ml.so.1"), "{why}");

    // The library loads but the kernel driver is not there (NVML_ERROR_DRIVER_NOT_LOADED = 9).
    let s = Scenario::new(&format!("init_error 9\n{}", h100(0, "")));
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 2, "{r:#}");
    let why = r["unavailable"].as_str().expect("unavailable");
    assert!(why.contains("driver is not loaded"), "{why}");
}

// === the daemon ===

/// A `spotguard run` process pointed at the stand-in through its environment.
struct Agent {
    child: Kid,
    metrics: String,
    stderr: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

const GPU_TABLE: &str =
    "[gpu]\ninterval = \"1s\"\ninit_backoff_min = \"1s\"\ninit_backoff_max = \"2s\"\n";

impl Agent {
    fn start(args: &[String], env: &[(String, String)], gpu_table: &str) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("spotguard.toml");
        std::fs::write(&config, gpu_table).expect("config");
        let port = free_port();
        // The privileges the DaemonSet ships: root without any capability but KILL and
        // SYS_PTRACE.
        let mut cmd = shipped_command(BIN);
        cmd.arg("run")
            .arg(format!("--config={}", config.display()))
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            .arg("--log-format=json")
            .arg(format!(
                "--state-dir={}",
                dir.path().join("state").display()
            ))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env_remove("NODE_NAME")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = Kid::spawn(cmd);
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let pipe = child.take_stderr().expect("stderr");
        let lines = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Agent {
            child,
            metrics: format!("http://127.0.0.1:{port}/metrics"),
            stderr,
            _dir: dir,
        }
    }

    fn logs(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    async fn scrape(&self) -> Option<String> {
        let resp = reqwest::get(&self.metrics).await.ok()?;
        resp.text().await.ok()
    }

    /// Scrape until `done` holds (panics with the last scrape and the logs after `within`).
    async fn wait_metrics(
        &self,
        what: &str,
        within: Duration,
        done: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        loop {
            if let Some(text) = self.scrape().await {
                if done(&text) {
                    return text;
                }
                last = text;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\n--- metrics\n{last}\n--- logs\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM; the agent must exit within `within`.
    fn stop(mut self, within: Duration) {
        self.child.signal(libc::SIGTERM);
        let Some(status) = self.child.wait_timeout(within) else {
            panic!(
                "agent did not stop within {within:?} of SIGTERM\n{}",
                self.logs()
            );
        };
        assert!(status.success(), "{status}\n{}", self.logs());
    }
}

/// Sample lines (no comments) of metric `name` whose labels contain every `label`.
fn series<'a>(text: &'a str, name: &str, labels: &[&str]) -> Vec<&'a str> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .collect()
}

fn value(line: &str) -> f64 {
    line.rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no value in {line}"))
}

fn host_args(emu: &emulator::EmulatorHandle, dir: &Path) -> Vec<String> {
    vec![
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        format!("--checkpoint-dir={}", dir.join("ckpt").display()),
        // Host mode needs a target; this one matches nothing.
        "--checkpoint-cmdline=^no-such-trainer$".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_metrics_through_the_abi_and_not_supported_means_no_series() {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let s = Scenario::new(&format!(
        "driver 550.54.15\n{}{}",
        h100(0, "ecc corrected volatile 5\npcie_replay 7"),
        a100(
            1,
            "unsupported temperature\nunsupported power\nunsupported energy\nunsupported throttle"
        )
    ));
    let agent = Agent::start(&host_args(&emu, work.path()), &s.env(stub_dir()), GPU_TABLE);
    let text = agent
        .wait_metrics("GPU readings", Duration::from_secs(30), |t| {
            !series(t, "spotguard_gpu_temperature_celsius", &[]).is_empty()
        })
        .await;
    let h = "gpu=\"0\"";
    let a = "gpu=\"1\"";
    assert_eq!(value(series(&text, "spotguard_gpu_probe_up", &[])[0]), 1.0);
    let temp = series(&text, "spotguard_gpu_temperature_celsius", &[h]);
    assert_eq!(temp.len(), 1, "{text}");
    assert!(
        temp[0].contains("uuid=\"GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b00001000\""),
        "{}",
        temp[0]
    );
    assert!(
        temp[0].contains("model=\"NVIDIA H100 80GB HBM3\""),
        "{}",
        temp[0]
    );
    assert_eq!(value(temp[0]), 41.0);
    assert_eq!(
        value(series(&text, "spotguard_gpu_power_watts", &[h])[0]),
        312.5
    );
    assert_eq!(
        value(series(&text, "spotguard_gpu_pcie_replay_total", &[h])[0]),
        7.0
    );
    assert_eq!(
        value(series(&text, "spotguard_gpu_energy_joules_total", &[h])[0]),
        987654.321
    );
    assert_eq!(
        series(&text, "spotguard_gpu_nvlink_up", &[h]).len(),
        18,
        "one series per link"
    );
    assert_eq!(series(&text, "spotguard_gpu_nvlink_up", &[a]).len(), 12);
    assert_eq!(
        value(series(&text, "spotguard_gpu_recovery_action", &[h])[0]),
        0.0
    );
    // The A100's NOT_SUPPORTED readings: no series at all (never a zero) …
    for name in [
        "spotguard_gpu_temperature_celsius",
        "spotguard_gpu_power_watts",
        "spotguard_gpu_energy_joules_total",
        "spotguard_gpu_clocks_event_reasons",
        "spotguard_gpu_recovery_action",
        "spotguard_gpu_retired_pages",
    ] {
        assert!(
            series(&text, name, &[a]).is_empty(),
            "{name} has a series for a reading the A100 does not support:\n{}",
            series(&text, name, &[a]).join("\n")
        );
    }
    // … while what it does support is there …
    assert_eq!(
        value(series(&text, "spotguard_gpu_pcie_replay_total", &[a])[0]),
        3.0
    );
    assert_eq!(series(&text, "spotguard_gpu_remapped_rows", &[a]).len(), 2);
    // … and NOT_SUPPORTED is not a read error.
    assert!(
        series(&text, "spotguard_gpu_read_errors_total", &[]).is_empty(),
        "{text}"
    );
    assert_eq!(
        value(series(&text, "spotguard_gpu_health", &["state=\"healthy\"", a])[0]),
        1.0,
        "{text}"
    );
    agent.stop(Duration::from_secs(10));
}

/// `--gpu off` (the docs' advice where GPU health is not wanted) exports no `spotguard_gpu_*`
/// series at all, so the shipped `SpotguardGPUProbeDown` alert, evaluated by promtool on what
/// the agent really exported, stays silent for it; an agent whose NVML fails (driver not
/// loaded) still exports `spotguard_gpu_probe_up 0` and the alert fires for that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_off_exports_no_gpu_series_and_the_probe_down_alert_stays_silent() {
    use spotguard_testkit::prometheus::{input_series, promtool, rule_file};

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let polled = |t: &str| {
        series(t, "spotguard_metadata_polls_total", &[])
            .iter()
            .any(|l| value(l) > 0.0)
    };

    // The stand-in library is on the path and would answer: only the flag keeps NVML out.
    let healthy = Scenario::new(&h100(0, ""));
    let mut args = host_args(&emu, work.path());
    args.push("--gpu=off".into());
    let off = Agent::start(&args, &healthy.env(stub_dir()), GPU_TABLE);
    let off_text = off
        .wait_metrics("a metadata poll", Duration::from_secs(30), polled)
        .await;
    let gpu_lines: Vec<&str> = off_text
        .lines()
        .filter(|l| l.contains("spotguard_gpu_"))
        .collect();
    assert!(
        gpu_lines.is_empty(),
        "--gpu off exports GPU series:\n{}",
        gpu_lines.join("\n")
    );

    // NVML present but failing: the probe is down and says so.
    let failing = Scenario::new(&format!("init_error 9\n{}", h100(0, "")));
    let down = Agent::start(
        &host_args(&emu, work.path()),
        &failing.env(stub_dir()),
        GPU_TABLE,
    );
    let down_text = down
        .wait_metrics("spotguard_gpu_probe_up 0", Duration::from_secs(30), |t| {
            polled(t)
                && series(t, "spotguard_gpu_probe_up", &[])
                    .iter()
                    .any(|l| value(l) == 0.0)
        })
        .await;

    // Both scrapes, held for 30 minutes, through the shipped rule (`for: 15m`).
    let dir = tempfile::tempdir().expect("tempdir");
    let rules = rule_file(dir.path());
    let test = format!(
        "rule_files:\n  - {}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{}{}    alert_rule_test:\n      - eval_time: 20m\n        alertname: SpotguardGPUProbeDown\n        exp_alerts:\n          - exp_labels:\n              severity: warning\n              instance: nvml-failing\n            exp_annotations:\n              summary: \"spotguard on nvml-failing cannot read its GPUs through NVML\"\n              description: \"GPU health is unknown on this node (driver not loaded, NVML missing from the container).\"\n",
        rules.display(),
        input_series(&off_text, "gpu-off", 30),
        input_series(&down_text, "nvml-failing", 30),
    );
    let test_path = dir.path().join("probe-down.test.yaml");
    std::fs::write(&test_path, &test).expect("write promtool test");
    promtool(&["test", "rules", test_path.to_str().unwrap()]);

    off.stop(Duration::from_secs(10));
    down.stop(Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn library_appearing_after_start_is_picked_up() {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let libs = tempfile::tempdir().expect("tempdir");
    let s = Scenario::new(&format!("driver 570.124.06\n{}", h100(0, "")));
    let agent = Agent::start(
        &host_args(&emu, work.path()),
        &s.env(libs.path()),
        GPU_TABLE,
    );
    let text = agent
        .wait_metrics("probe down", Duration::from_secs(20), |t| {
            !series(
                t,
                "spotguard_gpu_monitor_errors_total",
                &["error=\"load_library\""],
            )
            .is_empty()
        })
        .await;
    assert_eq!(value(series(&text, "spotguard_gpu_probe_up", &[])[0]), 0.0);
    assert!(series(&text, "spotguard_gpu_temperature_celsius", &[]).is_empty());

    // The driver's library shows up (the GPU operator installs it) 10 s after the agent started.
    tokio::time::sleep(Duration::from_secs(10)).await;
    std::fs::copy(
        stub_dir().join("libnvidia-ml.so.1"),
        libs.path().join("libnvidia-ml.so.1"),
    )
    .expect("install library");
    let installed = Instant::now();
    let text = agent
        .wait_metrics("probe up", Duration::from_secs(15), |t| {
            series(t, "spotguard_gpu_probe_up", &[])
                .first()
                .is_some_and(|l| value(l) == 1.0)
                && !series(t, "spotguard_gpu_temperature_celsius", &[]).is_empty()
        })
        .await;
    // Backoff is capped at 2 s in this config, one interval 1 s.
    assert!(
        installed.elapsed() < Duration::from_secs(5),
        "{:?}",
        installed.elapsed()
    );
    assert_eq!(
        value(series(&text, "spotguard_gpu_temperature_celsius", &["gpu=\"0\""])[0]),
        41.0
    );
    assert!(
        agent.logs().contains("GPU monitoring resumed"),
        "{}",
        agent.logs()
    );
    agent.stop(Duration::from_secs(10));
}

const NODE: &str = "gpu-node-1";

async fn condition(k: &TestCluster, node: &str, type_: &str) -> Option<Value> {
    let node = k.node_json(node).await;
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .cloned()
}

async fn has_gpu_taint(k: &TestCluster, node: &str) -> bool {
    non_system_taints(&k.node_object(node).await)
        .iter()
        .any(|(key, _, _)| key == "spotguard.io/gpu-unhealthy")
}

/// The XID arrives through `nvmlEventSetWait_v2` 5 s after NVML was initialised (between two
/// samples, which run at 0, 2, 4, 6 s); within one
/// probe interval the node shows it: the unhealthy condition (under a custom type), the EKS
/// auto-repair condition `AcceleratedHardwareReady=False`, the taint, the XID counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_mid_run_makes_the_node_unhealthy_within_one_probe_interval() {
    // A real API server; the agent process talks to it as the shipped ServiceAccount.
    let k = TestCluster::new().await;
    let kubelet = k.node(k.node_config(NODE)).await;
    let node = kubelet.name();
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let kubeconfig = work.path().join("kubeconfig");
    std::fs::write(&kubeconfig, k.agent_kubeconfig()).expect("kubeconfig");
    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "event 5000 xid 79")
    ));
    let interval = Duration::from_secs(2);
    let mut env = s.env(stub_dir());
    env.push(("KUBECONFIG".into(), kubeconfig.display().to_string()));
    let args = vec![
        "--mode=kubernetes".to_string(),
        format!("--node-name={node}"),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=500ms".into(),
        "--gpu-unhealthy-condition=example.com/GPUBroken".into(),
        "--gpu-ready-condition=AcceleratedHardwareReady".into(),
    ];
    let agent = Agent::start(
        &args,
        &env,
        "[gpu]\ninterval = \"2s\"\ninit_backoff_min = \"1s\"\ninit_backoff_max = \"2s\"\n",
    );
    agent
        .wait_metrics("healthy GPUs", Duration::from_secs(30), |t| {
            !series(
                t,
                "spotguard_gpu_health",
                &["state=\"healthy\"", "gpu=\"1\""],
            )
            .is_empty()
        })
        .await;
    assert!(
        s.trace().contains("nvmlEventSetWait_v2"),
        "the event thread waits on the set"
    );
    assert!(condition(&k, node, "example.com/GPUBroken")
        .await
        .is_none_or(|c| c["status"] == "False"));
    assert!(condition(&k, node, "AcceleratedHardwareReady")
        .await
        .is_none());
    assert!(!has_gpu_taint(&k, node).await);

    // Wait for the stand-in to hand the XID over, then time how long the node takes to show it.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !s
        .trace()
        .contains("event delivered type=8 data=79 device=1")
    {
        assert!(
            Instant::now() < deadline,
            "XID never delivered:\n{}",
            s.trace()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let delivered = Instant::now();
    loop {
        let shown = condition(&k, node, "example.com/GPUBroken")
            .await
            .is_some_and(|c| c["status"] == "True")
            && condition(&k, node, "AcceleratedHardwareReady")
                .await
                .is_some_and(|c| c["status"] == "False")
            && has_gpu_taint(&k, node).await;
        if shown {
            break;
        }
        assert!(
            delivered.elapsed() < interval + Duration::from_secs(1),
            "node not unhealthy within one probe interval ({interval:?}) of the XID:\n{:#}\n{}",
            k.node_json(node).await,
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = delivered.elapsed();
    let broken = condition(&k, node, "example.com/GPUBroken")
        .await
        .expect("condition");
    assert_eq!(broken["reason"], "XidError", "{broken:#}");
    let message = broken["message"].as_str().expect("message");
    assert!(
        message.contains("GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b00001001"),
        "{message}"
    );
    assert!(message.contains("79"), "{message}");
    let ready = condition(&k, node, "AcceleratedHardwareReady")
        .await
        .expect("condition");
    assert_eq!(ready["reason"], "XidError");
    // The default type is not written when it was renamed.
    assert!(condition(&k, node, "GPUUnhealthy").await.is_none());
    let text = agent
        .wait_metrics("XID counter", Duration::from_secs(5), |t| {
            !series(
                t,
                "spotguard_gpu_xid_errors_total",
                &["xid=\"79\"", "gpu=\"1\""],
            )
            .is_empty()
        })
        .await;
    assert_eq!(
        value(series(&text, "spotguard_gpu_xid_errors_total", &["xid=\"79\""])[0]),
        1.0
    );
    eprintln!("XID 79 to node condition: {took:?} (interval {interval:?})");
    agent.stop(Duration::from_secs(10));
}

// === a hung driver call ===

const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; printf '"'"'{"state":"done","step":%d,"checkpoint":"ckpt-%d","ts":%s}'"'"' $n $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"' USR1
while :; do sleep 0.05; done
"#;

fn persisted_phase(state_dir: &Path) -> Option<String> {
    let s = std::fs::read_to_string(state_dir.join("notice.json")).ok()?;
    let v: Value = serde_json::from_str(&s).ok()?;
    v.get("phase")?.as_str().map(str::to_string)
}

/// NVML blocks forever in `nvmlDeviceGetTemperature`: the sampling thread is stuck, GPU health
/// is reported unknown, and an interruption notice still checkpoints the trainer and completes
/// the plan; SIGTERM still stops the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvml_hanging_in_get_temperature_leaves_notice_handling_alone() {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let ckpt = work.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).expect("ckpt dir");
    // The trainer runs as another user (nobody), as trainers do.
    for d in [work.path(), ckpt.as_path()] {
        std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .expect("chmod");
    }
    let mut trainer = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "bash",
            "-c",
        ])
        .arg(TRAINER)
        .env("SPOTGUARD_DIR", &ckpt)
        .env("MARKS", work.path().join("marks"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("trainer");
    let pidfile = work.path().join("trainer.pid");
    std::fs::write(&pidfile, trainer.id().to_string()).expect("pidfile");

    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "hang temperature")
    ));
    let mut args = host_args(&emu, work.path());
    args.push(format!("--checkpoint-pidfile={}", pidfile.display()));
    args.push("--checkpoint-timeout=20s".into());
    let agent = Agent::start(&args, &s.env(stub_dir()), GPU_TABLE);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s.trace().contains("hanging") {
        assert!(
            Instant::now() < deadline,
            "never reached the hang:\n{}",
            s.trace()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The monitor gives up waiting after one interval and says so; metrics keep being served.
    let text = agent
        .wait_metrics("sample timeout", Duration::from_secs(10), |t| {
            !series(
                t,
                "spotguard_gpu_monitor_errors_total",
                &["error=\"sample_timeout\""],
            )
            .is_empty()
        })
        .await;
    assert_eq!(value(series(&text, "spotguard_gpu_probe_up", &[])[0]), 0.0);

    let raised = Instant::now();
    emu.raise(EmulatedNotice::interruption()).expect("raise");
    let state_dir = agent._dir.path().join("state");
    let deadline = Instant::now() + Duration::from_secs(30);
    while persisted_phase(&state_dir).as_deref() != Some("done") {
        assert!(
            Instant::now() < deadline,
            "plan did not complete (phase {:?})\n{}",
            persisted_phase(&state_dir),
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let marks = std::fs::read_to_string(work.path().join("marks")).unwrap_or_default();
    assert_eq!(marks.lines().count(), 1, "trainer signalled once");
    eprintln!("notice to plan done with NVML hung: {:?}", raised.elapsed());
    // Still exactly one sampling thread stuck: no new sample was started behind it.
    let hangs = s.trace().lines().filter(|l| *l == "hanging").count();
    assert_eq!(hangs, 1, "a second sample was started behind the hung one");
    agent.stop(Duration::from_secs(10));
    let _ = trainer.kill();
    let _ = trainer.wait();
}

#[test]
fn scenario_errors_are_reported_by_the_stub() {
    // A typo in a scenario must fail loudly, not run a different scenario.
    let s = Scenario::new("device\ntemprature 41\n");
    let (code, r) = gpu_json(&s, stub_dir());
    assert_eq!(code, 2, "{r:#}");
    let why = r["unavailable"].as_str().expect("unavailable");
    assert!(why.contains("driver is not loaded"), "{why}");
}

// === which pod holds which GPU ===

const H100_0: &str = "GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b00001000";
const H100_1: &str = "GPU-5c1e8f2a-4b7d-9c3e-2f8d-0c4b00001001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_resources_client_speaks_grpc_to_a_loopback_kubelet() {
    use spotguard::gpu::podresources;
    use spotguard_testkit::gpu::PodResourcesServer;
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("kubelet.sock");
    let timeout = Duration::from_secs(5);
    let err = podresources::list(&socket, timeout)
        .await
        .expect_err("no socket yet");
    assert!(matches!(err, podresources::Error::Connect { .. }), "{err}");

    let server = PodResourcesServer::start(&socket).expect("server");
    server.set_pods(&[
        ("ml", "trainer-0", "pytorch", "nvidia.com/gpu", &[H100_0]),
        ("ml", "sidecar", "exporter", "example.com/fpga", &["fpga-0"]),
    ]);
    let holders = podresources::list(&socket, timeout).await.expect("list");
    assert_eq!(holders.len(), 1, "{holders:?}");
    let h = &holders[H100_0][0];
    assert_eq!(
        (h.namespace.as_str(), h.pod.as_str(), h.container.as_str()),
        ("ml", "trainer-0", "pytorch")
    );
    assert_eq!(server.calls(), 1);

    server.set_status(14, "kubelet restarting");
    let err = podresources::list(&socket, timeout)
        .await
        .expect_err("grpc error");
    assert!(
        err.to_string()
            .contains("gRPC status 14 kubelet restarting"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_metrics_carry_the_pod_holding_the_gpu() {
    use spotguard_testkit::gpu::PodResourcesServer;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().expect("tempdir");
    let socket = work.path().join("kubelet.sock");
    let server = PodResourcesServer::start(&socket).expect("server");
    server.set_pods(&[
        ("ml", "trainer-0", "pytorch", "nvidia.com/gpu", &[H100_0]),
        // GPU 1 time-sliced between two pods: no pod labels on its readings.
        (
            "ml",
            "notebook",
            "jupyter",
            "nvidia.com/gpu",
            &[&format!("{H100_1}::0")],
        ),
        (
            "dev",
            "shell",
            "sh",
            "nvidia.com/gpu",
            &[&format!("{H100_1}::1")],
        ),
    ]);
    let s = Scenario::new(&format!(
        "driver 570.124.06\n{}{}",
        h100(0, ""),
        h100(1, "")
    ));
    let mut args = host_args(&emu, work.path());
    args.push(format!("--gpu-pod-resources-socket={}", socket.display()));
    let agent = Agent::start(&args, &s.env(stub_dir()), GPU_TABLE);
    let text = agent
        .wait_metrics("pod labels", Duration::from_secs(30), |t| {
            !series(
                t,
                "spotguard_gpu_temperature_celsius",
                &["pod=\"trainer-0\""],
            )
            .is_empty()
        })
        .await;
    let t0 = series(&text, "spotguard_gpu_temperature_celsius", &["gpu=\"0\""]);
    assert_eq!(t0.len(), 1);
    assert!(
        t0[0].contains("pod=\"trainer-0\"")
            && t0[0].contains("namespace=\"ml\"")
            && t0[0].contains("container=\"pytorch\""),
        "{}",
        t0[0]
    );
    assert!(series(
        &text,
        "spotguard_gpu_health",
        &["gpu=\"0\"", "state=\"healthy\""]
    )[0]
    .contains("pod=\"trainer-0\""));
    let t1 = series(&text, "spotguard_gpu_temperature_celsius", &["gpu=\"1\""]);
    assert!(!t1[0].contains("pod="), "{}", t1[0]);
    let shared = series(&text, "spotguard_gpu_allocation", &["gpu=\"1\""]);
    assert_eq!(shared.len(), 2, "{text}");
    assert!(shared
        .iter()
        .any(|l| l.contains("pod=\"shell\"") && l.contains("namespace=\"dev\"")));
    assert_eq!(
        series(&text, "spotguard_gpu_allocation", &["gpu=\"0\""]).len(),
        1
    );

    // The pod ends: its labels go with it.
    server.set_pods(&[]);
    let text = agent
        .wait_metrics("labels gone", Duration::from_secs(10), |t| {
            series(t, "spotguard_gpu_allocation", &[]).is_empty()
        })
        .await;
    assert!(!text.contains("pod=\"trainer-0\""), "{text}");
    // The kubelet answers with an error: counted, no labels.
    server.set_status(14, "unavailable");
    agent
        .wait_metrics("pod-resources error", Duration::from_secs(10), |t| {
            !series(
                t,
                "spotguard_gpu_monitor_errors_total",
                &["error=\"pod_resources\""],
            )
            .is_empty()
        })
        .await;
    agent.stop(Duration::from_secs(10));
}

// === condition types ===

/// The Ready-polarity condition (EKS `AcceleratedHardwareReady`) goes False with the unhealthy
/// verdict and True again on recovery; renamed problem conditions are read back under their
/// configured names (sticky findings survive a restart with custom types).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_condition_types_round_trip_through_the_api_server() {
    use spotguard::gpu::ConditionTypes;
    use spotguard::node::kube::KubeNodeOps;
    use spotguard::node::{ConditionState, GpuConditions, NodeOps};
    let k = TestCluster::new().await;
    let kubelet = k.node(k.node_config(NODE)).await;
    let node = kubelet.name();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(spotguard::metrics::Metrics::register(&mut registry));
    let types = ConditionTypes {
        unhealthy: "example.com/GPUBroken".into(),
        degraded: "example.com/GPUSlow".into(),
        ready: Some("AcceleratedHardwareReady".into()),
    };
    let ops = KubeNodeOps::new(k.agent_client(), node.to_string(), None, false, metrics)
        .with_gpu_condition_types(types);
    let healthy = GpuConditions {
        unhealthy: ConditionState {
            active: false,
            reason: "NoGpuFault".into(),
            message: "no unhealthy GPU findings".into(),
        },
        degraded: ConditionState {
            active: false,
            reason: "NoGpuFault".into(),
            message: "no degraded GPU findings".into(),
        },
    };
    ops.set_gpu_conditions(&healthy).await.expect("healthy");
    assert!(
        condition(&k, node, "AcceleratedHardwareReady")
            .await
            .is_none(),
        "nothing written while a never-unhealthy node stays healthy"
    );
    let unhealthy = GpuConditions {
        unhealthy: ConditionState {
            active: true,
            reason: "XidError".into(),
            message: "[XidError] GPU-x (gpu 0, since 2026-01-01T00:00:00Z): XID 79; boot_id=b"
                .into(),
        },
        ..healthy.clone()
    };
    ops.set_gpu_conditions(&unhealthy).await.expect("unhealthy");
    let ready = condition(&k, node, "AcceleratedHardwareReady")
        .await
        .expect("ready condition");
    assert_eq!(ready["status"], "False");
    assert_eq!(ready["reason"], "XidError");
    assert_eq!(
        condition(&k, node, "example.com/GPUBroken")
            .await
            .expect("broken")["status"],
        "True"
    );
    assert!(has_gpu_taint(&k, node).await);
    assert_eq!(
        condition(&k, node, "Ready").await.expect("kubelet's")["status"],
        "True"
    );
    let back = ops.gpu_conditions().await.expect("read back");
    assert_eq!(
        back.unhealthy, unhealthy.unhealthy,
        "read under the configured type"
    );

    ops.set_gpu_conditions(&healthy).await.expect("recovered");
    let ready = condition(&k, node, "AcceleratedHardwareReady")
        .await
        .expect("ready condition");
    assert_eq!(ready["status"], "True");
    assert_eq!(
        condition(&k, node, "example.com/GPUBroken")
            .await
            .expect("broken")["status"],
        "False"
    );
    assert!(!has_gpu_taint(&k, node).await);
    assert!(condition(&k, node, "GPUUnhealthy").await.is_none());
}
