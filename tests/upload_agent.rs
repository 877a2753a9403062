//! The agent's side of staged checkpoints, end to end in host mode: the real `spotguard run`
//! (every capability dropped but KILL and SYS_PTRACE, as shipped) against the metadata emulator,
//! a uid-1000 trainer using the Python helper (`spotguard.ack_staged`) that saves to a local
//! staged directory, acks, waits for the agent's `taken` and exits; the agent uploads to a local
//! filesystem destination and to s3s-fs and publishes the manifest last.
//!
//! Needs root (to run the trainer as uid 1000), `setpriv`, python3, and `s3s-fs`
//! (`scripts/deps/prefetch.sh`).

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::{catches_usr1, Kid};
use spotguard_testkit::s3::{S3Server, Throttle};

const TRAINER_UID: u32 = 1000;
const BUCKET: &str = "ckpt";
const MIB: u64 = 1 << 20;

/// The trainer: installs the helper's handler, and on the signal saves `$STAGED_MIB` MiB in
/// four shards plus a few small files to `$STAGED`, acks staged, waits for the answer, records
/// the times and exits.
const TRAINER: &str = r#"
import json, os, sys, time
import spotguard
spotguard.install()
open(os.environ["READY"], "w").close()
while not spotguard.should_checkpoint():
    time.sleep(0.002)
signal_at = time.time()
path = os.environ["STAGED"]
os.makedirs(path)
shard = int(os.environ["STAGED_MIB"]) * (1 << 20) // 4
block = bytes(range(256)) * 4096
for i in range(4):
    with open(os.path.join(path, f"__{i}_0.distcp"), "wb") as f:
        left = shard
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
for i in range(5):
    with open(os.path.join(path, f"meta-{i}.json"), "w") as f:
        f.write(json.dumps({"rank": i}))
saved_at = time.time()
answer = spotguard.ack_staged(path, step=7)
out = {"signal_at": signal_at, "saved_at": saved_at, "answer": answer.state,
       "error": answer.error, "exit_at": time.time()}
# Written aside, then renamed: the test reads the file while it waits.
with open(os.environ["RESULT"] + ".t", "w") as f:
    json.dump(out, f)
os.rename(os.environ["RESULT"] + ".t", os.environ["RESULT"])
spotguard.exit_after_checkpoint()
"#;

async fn get(url: &str) -> Option<(u16, String)> {
    let resp = reqwest::get(url).await.ok()?;
    let code = resp.status().as_u16();
    Some((code, resp.text().await.ok()?))
}

/// A machine: a 0755 base, the trainer's checkpoint dir, its local disk.
struct Machine {
    _tmp: tempfile::TempDir,
    base: PathBuf,
}

impl Machine {
    fn new() -> Machine {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let base = tmp.path().to_path_buf();
        let local = base.join("local");
        std::fs::create_dir(&local).unwrap();
        std::os::unix::fs::chown(&local, Some(TRAINER_UID), Some(TRAINER_UID)).unwrap();
        Machine { _tmp: tmp, base }
    }

    fn staged(&self) -> PathBuf {
        self.base.join("local/step-7")
    }

    /// Start the trainer (uid 1000) saving `mib` MiB; returns once its handler is installed.
    fn trainer(&self, mib: u64) -> Kid {
        let ready = self.base.join("local/ready");
        let mut cmd = Command::new("python3");
        cmd.arg("-c")
            .arg(TRAINER)
            .env("PYTHONPATH", repo_root().join("clients/python"))
            .env("SPOTGUARD_DIR", self.base.join("ckpt"))
            .env("STAGED", self.staged())
            .env("STAGED_MIB", mib.to_string())
            .env("RESULT", self.base.join("local/result.json"))
            .env("READY", &ready)
            .uid(TRAINER_UID)
            .gid(TRAINER_UID)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let child = Kid::spawn(cmd);
        let t = Instant::now();
        while !(ready.exists() && catches_usr1(child.pid())) {
            assert!(t.elapsed() < Duration::from_secs(20), "no handler");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::fs::write(self.base.join("trainer.pid"), child.pid().to_string()).unwrap();
        child
    }

    /// The agent as shipped (KILL and SYS_PTRACE only), with `extra` flags and env.
    fn agent(&self, emu: &str, port: u16, extra: &[String], env: &[(&str, &str)]) -> Kid {
        let mut cmd = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
        cmd.args([
            "run".to_string(),
            "--mode=host".into(),
            "--cloud=aws".into(),
            format!("--metadata-endpoint={emu}"),
            "--poll-interval=200ms".into(),
            "--checkpoint-timeout=30s".into(),
            format!("--checkpoint-dir={}", self.base.join("ckpt").display()),
            format!("--state-dir={}", self.base.join("state").display()),
            format!(
                "--checkpoint-pidfile={}",
                self.base.join("trainer.pid").display()
            ),
            format!("--metrics-addr=127.0.0.1:{port}"),
            "--gpu=off".into(),
            "--log-level=info".into(),
        ])
        .args(extra)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(self.agent_log());
        for (k, v) in env {
            cmd.env(k, v);
        }
        Kid::spawn(cmd)
    }

    /// The agent's log (its stderr), kept in the machine's base for a failing test to show.
    fn agent_log(&self) -> Stdio {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.base.join("agent.log"))
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null())
    }

    /// The last `lines` lines of the agent's log.
    fn agent_log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(self.base.join("agent.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn result(&self) -> Value {
        let t = Instant::now();
        loop {
            if let Ok(data) = std::fs::read(self.base.join("local/result.json")) {
                if let Ok(v) = serde_json::from_slice(&data) {
                    return v;
                }
            }
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "the trainer never finished"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Wait until `/metrics` has a line starting with `prefix`; returns the text.
async fn metric_line(port: u16, prefix: &str, within: Duration) -> String {
    let url = format!("http://127.0.0.1:{port}/metrics");
    let t = Instant::now();
    loop {
        if let Some((200, text)) = get(&url).await {
            if text.lines().any(|l| l.starts_with(prefix)) {
                return text;
            }
        }
        assert!(t.elapsed() < within, "no {prefix} in /metrics");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn upload_lines(text: &str) -> String {
    text.lines()
        .filter(|l| l.starts_with("spotguard_checkpoint_upload_") && !l.ends_with(" 0"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Raise an interruption with a trainer saving `mib` MiB and the agent given `extra`; returns
/// the trainer's result and the agent's upload metrics once an upload ended.
async fn staged_run(
    m: &Machine,
    mib: u64,
    extra: &[String],
    env: &[(&str, &str)],
) -> (Value, String) {
    let _trainer = m.trainer(mib);
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    let _agent = m.agent(&emu.base_url(), port, extra, env);
    metric_line(
        port,
        "spotguard_metadata_polls_total",
        Duration::from_secs(30),
    )
    .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let result = tokio::task::block_in_place(|| m.result());
    let text = metric_line(
        port,
        "spotguard_checkpoint_upload_total{outcome=\"published\"} 1",
        Duration::from_secs(60),
    )
    .await;
    (result, upload_lines(&text))
}

/// The trainer got `taken` and left within seconds of the signal (its downtime), whatever the
/// upload takes.
fn assert_trainer_left_quickly(result: &Value) -> f64 {
    assert_eq!(result["answer"], "taken", "{result}");
    let downtime = result["exit_at"].as_f64().unwrap() - result["signal_at"].as_f64().unwrap();
    let saving = result["saved_at"].as_f64().unwrap() - result["signal_at"].as_f64().unwrap();
    eprintln!("trainer: saved locally in {saving:.3}s, signal → exit {downtime:.3}s");
    assert!(downtime < 10.0, "downtime {downtime}s: {result}");
    downtime
}

fn expected_files(mib: u64) -> BTreeMap<String, u64> {
    let mut want: BTreeMap<String, u64> = (0..4)
        .map(|i| (format!("__{i}_0.distcp"), mib * MIB / 4))
        .collect();
    for i in 0..5 {
        want.insert(
            format!("meta-{i}.json"),
            format!("{{\"rank\": {i}}}").len() as u64,
        );
    }
    want
}

fn manifest_files(manifest: &Value) -> BTreeMap<String, u64> {
    manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_string(),
                f["size"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_checkpoint_is_uploaded_to_a_directory_after_the_trainer_exits() {
    let m = Machine::new();
    let dest = m.base.join("efs/run1");
    std::fs::create_dir_all(&dest).unwrap();
    let mib = 64;
    let extra = vec![
        format!("--upload-allow={}", m.base.join("efs").display()),
        format!("--checkpoint-upload={}", dest.display()),
    ];
    let (result, metrics) = staged_run(&m, mib, &extra, &[]).await;
    assert_trainer_left_quickly(&result);
    let checkpoint = dest.join("step-7");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(checkpoint.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest_files(&manifest), expected_files(mib), "{manifest}");
    assert_eq!(manifest["step"], 7);
    for (name, size) in expected_files(mib) {
        assert_eq!(
            std::fs::metadata(checkpoint.join(&name)).unwrap().len(),
            size,
            "{name}"
        );
    }
    assert_eq!(
        std::fs::read(checkpoint.join("__2_0.distcp")).unwrap(),
        std::fs::read(m.staged().join("__2_0.distcp")).unwrap()
    );
    assert!(
        metrics.contains(&format!(
            "spotguard_checkpoint_upload_bytes_total {}",
            mib * MIB + 5 * 11
        )),
        "{metrics}"
    );
}

// ---- s3s-fs ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_checkpoint_is_uploaded_to_s3_and_published_with_its_manifest_last() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let m = Machine::new();
    let mib = 48;
    let endpoint = server.endpoint();
    let extra = vec![
        format!("--upload-allow=s3://{BUCKET}/run1"),
        format!("--checkpoint-upload=s3://{BUCKET}/run1"),
        format!("--upload-endpoint={endpoint}"),
        "--upload-part-size=8MiB".into(),
    ];
    let (result, metrics) = staged_run(&m, mib, &extra, &S3Server::client_env()).await;
    assert_trainer_left_quickly(&result);
    // s3s-fs keeps objects as files under <root>/<bucket>/<key>.
    let checkpoint = server.object_path(BUCKET, "run1/step-7");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(checkpoint.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest_files(&manifest), expected_files(mib), "{manifest}");
    assert_eq!(
        std::fs::read(checkpoint.join("__3_0.distcp")).unwrap(),
        std::fs::read(m.staged().join("__3_0.distcp")).unwrap()
    );
    // The resume side finds it.
    let out = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args([
            "prefetch",
            "--latest-checkpoint",
            &format!("s3://{BUCKET}/run1"),
        ])
        .args(["--endpoint", &endpoint])
        .envs(S3Server::client_env())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("step-7"), "{stdout}");
    assert!(
        metrics.contains("spotguard_checkpoint_upload_files_total 9"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_checkpoint_outside_the_allow_list_is_refused_and_the_trainer_told_at_once() {
    let m = Machine::new();
    let dest = m.base.join("efs/run1");
    std::fs::create_dir_all(&dest).unwrap();
    let _trainer = m.trainer(4);
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    // No --upload-allow: uploads are off, the ack is refused (not left to time out).
    let extra = vec![format!("--checkpoint-upload={}", dest.display())];
    let _agent = m.agent(&emu.base_url(), port, &extra, &[]);
    metric_line(
        port,
        "spotguard_metadata_polls_total",
        Duration::from_secs(30),
    )
    .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let result = tokio::task::block_in_place(|| m.result());
    assert_eq!(result["answer"], "refused", "{result}");
    assert!(
        result["error"]
            .as_str()
            .unwrap_or_default()
            .contains("upload"),
        "{result}"
    );
    let downtime = result["exit_at"].as_f64().unwrap() - result["signal_at"].as_f64().unwrap();
    assert!(
        downtime < 10.0,
        "told within the ack poll, not the helper's wait: {result}"
    );
    let text = metric_line(
        port,
        "spotguard_checkpoint_upload_total{outcome=\"refused\"} 1",
        Duration::from_secs(30),
    )
    .await;
    assert!(
        text.lines().any(|l| l
            .starts_with("spotguard_checkpoint_upload_errors_total{error=\"not_allowed\"}")
            || l.starts_with("spotguard_checkpoint_upload_errors_total{error=\"off\"}")),
        "{}",
        upload_lines(&text)
    );
    assert!(!dest.join("step-7").exists());
}

/// A second trainer (uid 1000) that records when each SIGUSR1 arrives and acks `done`.
const MARKER: &str = r#"
trap 'date +%s.%N >> "$MARKS"
  printf "{\"state\":\"done\"}" > "$SPOTGUARD_DIR/.m$$" && mv "$SPOTGUARD_DIR/.m$$" "$SPOTGUARD_DIR/ack-$$.json"' USR1
while :; do sleep 30 & S=$!; wait $S; done
"#;

fn marks(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

async fn wait_marks(path: &Path, n: usize, machine: &Machine) -> Vec<f64> {
    let t = Instant::now();
    loop {
        let m = marks(path);
        if m.len() >= n {
            return m;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "{n} signals never came: {m:?}; the agent's log ends:\n{}",
            machine.agent_log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn unix(t: jiff::Timestamp) -> f64 {
    t.as_millisecond() as f64 / 1000.0
}

/// The upload never delays a checkpoint signal: while a staged checkpoint is uploading (over a
/// slow link, seconds long, on the uploader's own threads), another trainer's signal latency
/// (notice visible → SIGUSR1 received) for the next notice stays what it was for the first,
/// when no upload ran. A generous bound: the poll interval (200 ms) dominates both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_trainers_signal_latency_is_unchanged_during_a_large_upload() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    // 3 MiB/s: the 24 MiB checkpoint takes about 8 s.
    let slow = Throttle::start(server.addr, 3 << 20).await;
    let m = Machine::new();
    let mark_file = m.base.join("local/marks");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(MARKER)
        .env("SPOTGUARD_DIR", m.base.join("ckpt"))
        .env("MARKS", &mark_file)
        .uid(TRAINER_UID)
        .gid(TRAINER_UID)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let other = Kid::spawn(cmd);
    let t = Instant::now();
    while !catches_usr1(other.pid()) {
        assert!(t.elapsed() < Duration::from_secs(10), "no trap");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(m.base.join("other.pid"), other.pid().to_string()).unwrap();
    let _trainer = m.trainer(24);
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    let extra = vec![
        format!(
            "--checkpoint-pidfile={}",
            m.base.join("other.pid").display()
        ),
        format!("--upload-allow=s3://{BUCKET}"),
        format!("--checkpoint-upload=s3://{BUCKET}/run1"),
        format!("--upload-endpoint={}", slow.endpoint()),
    ];
    let _agent = m.agent(&emu.base_url(), port, &extra, &S3Server::client_env());
    metric_line(
        port,
        "spotguard_metadata_polls_total",
        Duration::from_secs(30),
    )
    .await;

    // 1. A rebalance recommendation: both trainers checkpoint; no upload runs yet.
    let first = emu.raise(EmulatedNotice::rebalance()).unwrap();
    let before = wait_marks(&mark_file, 1, &m).await[0] - unix(first.visible_at);
    let result = tokio::task::block_in_place(|| m.result());
    assert_trainer_left_quickly(&result);
    metric_line(
        port,
        "spotguard_checkpoint_upload_active 1",
        Duration::from_secs(10),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // 2. The interruption, while the staged checkpoint is uploading.
    let second = emu.raise(EmulatedNotice::interruption()).unwrap();
    let during = wait_marks(&mark_file, 2, &m).await[1] - unix(second.visible_at);
    let text = get(&format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .1;
    assert!(
        text.lines()
            .any(|l| l == "spotguard_checkpoint_upload_active 1"),
        "the upload was still running at the second signal: {}",
        upload_lines(&text)
    );
    eprintln!(
        "signal latency of another trainer: {:.3}s without an upload, {:.3}s during one ({} bytes sent by then)",
        before,
        during,
        slow.forwarded.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        during <= before + 1.0,
        "signal latency {during:.3}s during the upload vs {before:.3}s without"
    );
    // And the upload still publishes.
    let text = metric_line(
        port,
        "spotguard_checkpoint_upload_total{outcome=\"published\"} 1",
        Duration::from_secs(60),
    )
    .await;
    assert!(
        server
            .object_path(BUCKET, "run1/step-7/manifest.json")
            .exists(),
        "{}",
        upload_lines(&text)
    );
}

/// The deadline arrives mid-upload (`deadline − drain reserve`, 5 s after the notice, over a
/// link that needs about 20 s): the agent publishes no manifest, says so in its metrics, and the
/// previous complete checkpoint stays the latest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_mid_upload_publishes_nothing_and_the_previous_checkpoint_stays_latest() {
    let server = S3Server::s3s_fs(&[BUCKET]);
    let location = format!("s3://{BUCKET}/run1");
    // The previous checkpoint, published directly (no throttle).
    let previous = tempfile::tempdir().unwrap();
    let step6 = previous.path().join("step-6");
    std::fs::create_dir(&step6).unwrap();
    std::fs::write(step6.join("w.bin"), vec![6u8; 4096]).unwrap();
    // Published by the same writer as the trainer's (uid 1000: `host:uid:1000`), whose
    // location run1 is.
    std::fs::set_permissions(
        previous.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    for p in [step6.clone(), step6.join("w.bin")] {
        std::os::unix::fs::chown(&p, Some(TRAINER_UID), Some(TRAINER_UID)).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["upload", step6.to_str().unwrap(), &location, "--step", "6"])
        .args(["--endpoint", &server.endpoint(), "--progress", "none"])
        .envs(S3Server::client_env())
        .uid(TRAINER_UID)
        .gid(TRAINER_UID)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // 1 MiB/s: the 20 MiB checkpoint needs about 20 s; the upload gets about 5.
    let slow = Throttle::start(server.addr, 1 << 20).await;
    let m = Machine::new();
    let _trainer = m.trainer(20);
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    let extra = vec![
        "--drain-reserve=5s".to_string(),
        format!("--upload-allow=s3://{BUCKET}"),
        format!("--checkpoint-upload={location}"),
        format!("--upload-endpoint={}", slow.endpoint()),
    ];
    let _agent = m.agent(&emu.base_url(), port, &extra, &S3Server::client_env());
    metric_line(
        port,
        "spotguard_metadata_polls_total",
        Duration::from_secs(30),
    )
    .await;
    let raised = emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(10)))
        .unwrap();
    let result = tokio::task::block_in_place(|| m.result());
    assert_trainer_left_quickly(&result);
    let text = metric_line(
        port,
        "spotguard_checkpoint_upload_total{outcome=\"deadline\"} 1",
        Duration::from_secs(30),
    )
    .await;
    let ended = jiff::Timestamp::now();
    let after = ended.duration_since(raised.visible_at).as_secs_f64();
    assert!(
        (4.0..9.0).contains(&after),
        "stopped {after:.1}s after the notice (deadline − reserve = 5 s)"
    );
    assert!(
        !server
            .object_path(BUCKET, "run1/step-7/manifest.json")
            .exists(),
        "no manifest for a cut-off upload"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("spotguard_checkpoint_upload_errors_total{error=\"deadline\"}")),
        "{}",
        upload_lines(&text)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_spotguard"))
        .args(["prefetch", "--latest-checkpoint", &location])
        .args(["--endpoint", &server.endpoint()])
        .envs(S3Server::client_env())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("step-6") && !stdout.contains("step-7"),
        "the previous checkpoint stays the latest: {stdout}"
    );
}
