//! Trust, round three (issue 29), acks: against the real `spotguard` binary in host mode as it
//! ships (every capability dropped but KILL and SYS_PTRACE), trainers as uid 1000 and a forger as
//! uid 1001 (`setpriv`), the metadata emulator over HTTP.
//!
//! - a hard link keeps its owner: a victim-owned world-writable file linked in at the victim's
//!   fallback ack name, with a `done` written into it, never counts;
//! - the node's descriptor budget: with the agent at `nofile` 1024 and a store that never
//!   answers, one uid's uploads cannot take the descriptors another uid's staged ack needs.
//!
//! Needs root (setpriv, uids 1000/1001), python3 and `/tmp` on one filesystem with the
//! checkpoint dir.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::{as_user, Kid};

const TRAINER_UID: u32 = 1000;
const FORGER_UID: u32 = 1001;

/// A trainer: on SIGUSR1 writes `received` at once and `done` after `$DELAY` seconds, atomically
/// (temp + rename) to `ack-$$.json`, and stamps the time of its `done` in `$MARKS.done`.
const TRAINER: &str = r#"
ack() {
  printf '{"state":"%s","step":7}' "$1" > "$SPOTGUARD_DIR/.t$$" || return
  mv "$SPOTGUARD_DIR/.t$$" "$SPOTGUARD_DIR/ack-$$.json"
}
trap '(ack received; sleep "$DELAY"; date +%s.%N > "$MARKS.done"; ack done) &' USR1
sleep 100000 & S=$!
while :; do wait $S; done
"#;

struct Host {
    tmp: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), PermissionsExt::from_mode(0o755)).unwrap();
        let shared = tmp.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, PermissionsExt::from_mode(0o777)).unwrap();
        std::fs::write(tmp.path().join("boot_id"), "boot-1\n").unwrap();
        Host { tmp }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    fn ckpt(&self) -> PathBuf {
        self.path("ckpt")
    }

    /// A uid-1000 trainer, its pid in the pidfile; returns once it catches SIGUSR1.
    fn trainer(&self, delay: f64) -> Kid {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(TRAINER)
            .env("SPOTGUARD_DIR", self.ckpt())
            .env("MARKS", self.path("shared/marks"))
            .env("DELAY", delay.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        as_user(&mut cmd, TRAINER_UID);
        let t = Kid::spawn(cmd);
        t.wait_for_trap();
        std::fs::write(self.path("trainer.pid"), t.pid().to_string()).unwrap();
        t
    }

    fn done_at(&self) -> Option<f64> {
        std::fs::read_to_string(self.path("shared/marks.done"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// The agent as the DaemonSet runs it: every capability dropped but KILL and SYS_PTRACE.
    fn agent(&self, endpoint: &str) -> Agent {
        let port = free_port();
        let log = self.path("agent.log");
        let mut cmd = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
        cmd.args([
            "run".to_string(),
            "--mode=host".into(),
            "--cloud=aws".into(),
            format!("--metadata-endpoint={endpoint}"),
            "--poll-interval=200ms".into(),
            "--checkpoint-timeout=20s".into(),
            format!("--checkpoint-dir={}", self.ckpt().display()),
            format!("--state-dir={}", self.path("state").display()),
            format!(
                "--checkpoint-pidfile={}",
                self.path("trainer.pid").display()
            ),
            format!("--boot-id-file={}", self.path("boot_id").display()),
            format!("--metrics-addr=127.0.0.1:{port}"),
            "--gpu=off".into(),
            "--log-format=json".into(),
            "--log-level=info".into(),
            "--shutdown-grace=2s".into(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        for (k, _) in std::env::vars() {
            if k.starts_with("SPOTGUARD_") || k == "RUST_LOG" {
                cmd.env_remove(k);
            }
        }
        Agent {
            _proc: Kid::spawn(cmd),
            port,
            log,
        }
    }
}

struct Agent {
    _proc: Kid,
    port: u16,
    log: PathBuf,
}

impl Agent {
    async fn metric(&self, series: &str) -> f64 {
        let Ok(resp) = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{}/metrics", self.port))
            .timeout(Duration::from_secs(2))
            .send()
            .await
        else {
            return 0.0;
        };
        resp.text()
            .await
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }

    async fn wait_metric(&self, series: &str, at_least: f64, limit: Duration) {
        let started = Instant::now();
        loop {
            let v = self.metric(series).await;
            if v >= at_least {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "{series} = {v}, not {at_least} within {limit:?}; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

const ACKED: &str = r#"spotguard_checkpoint_total{outcome="acked"}"#;
const REFUSED: &str = r#"spotguard_errors_total{module="checkpoint",error="refused_ack"}"#;
const SIGNALS: &str = "spotguard_checkpoint_signals_total";

/// Issue 29 item 5: the victim (uid 1000) needs 6 s to save. Its log file elsewhere on the same
/// filesystem is world-writable; the moment `notice.json` appears, uid 1001 hard-links it in as
/// the victim's fallback ack `ack-<pid>.x.json` (the link keeps the victim as owner) and writes a
/// `done` into it. The link never counts: the checkpoint is `acked` only after the victim's own
/// `done`, and the refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_forged_with_a_hard_link_does_not_count() {
    let h = Host::new();
    let victim_log = h.path("shared/victim.log");
    std::fs::write(&victim_log, "").unwrap();
    std::os::unix::fs::chown(&victim_log, Some(TRAINER_UID), Some(TRAINER_UID)).unwrap();
    std::fs::set_permissions(&victim_log, PermissionsExt::from_mode(0o666)).unwrap();
    let t = h.trainer(6.0);
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let agent = h.agent(&emu.base_url());
    agent
        .wait_metric(
            r#"spotguard_metadata_polls_total{source="aws"}"#,
            1.0,
            Duration::from_secs(20),
        )
        .await;
    let d = h.ckpt();
    let forged = d.join(format!("ack-{}.x.json", t.pid()));
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            r#"while [ ! -e {d}/notice.json ]; do sleep 0.005; done
ln {log} {forged} && printf '{{"state":"done","step":7}}' > {forged} && touch {d}/../shared/forged"#,
            d = d.display(),
            log = victim_log.display(),
            forged = forged.display(),
        ))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    as_user(&mut cmd, FORGER_UID);
    let mut forger = Kid::spawn(cmd);
    emu.raise(EmulatedNotice::interruption()).unwrap();
    agent
        .wait_metric(SIGNALS, 1.0, Duration::from_secs(20))
        .await;
    assert!(forger.wait_timeout(Duration::from_secs(20)).is_some());
    assert!(
        h.path("shared/forged").exists(),
        "the forger linked and wrote the ack"
    );
    let st = std::fs::metadata(&forged).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&st),
            std::os::unix::fs::MetadataExt::nlink(&st)
        ),
        (TRAINER_UID, 2),
        "the link is there, owned by the victim"
    );
    agent.wait_metric(ACKED, 1.0, Duration::from_secs(20)).await;
    let acked_at = Timestamp::now().as_millisecond() as f64 / 1000.0;
    let done = h.done_at().unwrap_or_else(|| {
        panic!(
            "acked by the hard link, before the victim's own done; log:\n{}",
            agent.log_text()
        )
    });
    assert!(
        done <= acked_at,
        "acked at {acked_at}, the victim's done at {done}"
    );
    assert!(agent.metric(REFUSED).await >= 1.0, "the refusal is counted");
}

// === The node's descriptor budget (issue 29 item 6) ===

/// A staged trainer: on the signal, saves `$FILES` small files to `$STAGED` (step `$STEP`), waits
/// for `$GO` when set, acks staged, and records the agent's answer in `$RESULT`; then idles
/// (its upload, if taken, is held by a store that never answers).
const STAGED_TRAINER: &str = r#"
import json, os, sys, time
import spotguard
spotguard.install()
open(os.environ["READY"], "w").close()
while not spotguard.should_checkpoint():
    time.sleep(0.002)
signal_at = time.time()
path = os.environ["STAGED"]
os.makedirs(path)
for i in range(int(os.environ["FILES"])):
    with open(os.path.join(path, f"shard-{i:04d}"), "w") as f:
        f.write(str(i))
go = os.environ.get("GO")
while go and not os.path.exists(go):
    time.sleep(0.01)
asked_at = time.time()
answer = spotguard.ack_staged(path, step=int(os.environ["STEP"]), wait=20)
out = {"answer": answer.state, "error": answer.error, "asked_at": asked_at,
       "answered_at": time.time(), "signal_at": signal_at}
with open(os.environ["RESULT"] + ".t", "w") as f:
    json.dump(out, f)
os.rename(os.environ["RESULT"] + ".t", os.environ["RESULT"])
while True:
    time.sleep(1)
"#;

/// A store that accepts connections and never answers.
fn silent_store() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    format!("http://{addr}")
}

/// Start a staged trainer as `uid`; returns once its handler is installed, its pidfile written.
fn staged_trainer(base: &Path, n: usize, uid: u32, files: usize, go: Option<&Path>) -> Kid {
    let local = base.join(format!("local{n}"));
    std::fs::create_dir(&local).unwrap();
    std::os::unix::fs::chown(&local, Some(uid), Some(uid)).unwrap();
    let ready = local.join("ready");
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(STAGED_TRAINER)
        .env("PYTHONPATH", repo_root().join("clients/python"))
        .env("SPOTGUARD_DIR", base.join("ckpt"))
        .env("STAGED", local.join(format!("step-{n}")))
        .env("STEP", n.to_string())
        .env("FILES", files.to_string())
        .env("RESULT", local.join("result.json"))
        .env("READY", &ready)
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if let Some(go) = go {
        cmd.env("GO", go);
    }
    let child = Kid::spawn(cmd);
    let t = Instant::now();
    while !(ready.exists() && spotguard_testkit::process::catches_usr1(child.pid())) {
        assert!(t.elapsed() < Duration::from_secs(30), "no handler");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(
        base.join(format!("trainer{n}.pid")),
        child.pid().to_string(),
    )
    .unwrap();
    child
}

fn staged_result(base: &Path, n: usize) -> serde_json::Value {
    let path = base.join(format!("local{n}/result.json"));
    let t = Instant::now();
    loop {
        if let Ok(data) = std::fs::read(&path) {
            return serde_json::from_slice(&data).unwrap();
        }
        if t.elapsed() > Duration::from_secs(60) {
            let log = std::fs::read_to_string(base.join("agent.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "trainer {n} never answered; the agent's log ends:\n{}",
                tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 29 item 6, scaled: the agent as shipped at `nofile` 1024, `--upload-max-files 300`, a
/// store that never answers. Three uid-1000 trainers ack 300-file trees one after another, then
/// a uid-1001 trainer acks 100 files. Before, the three uploads held ~922 descriptors and uid
/// 1001 was refused "out of file descriptors". Now uid 1000 may hold at most half of the budget
/// (1024 − 256 reserved = 768: 384): its first tree is taken, its next two are refused at once
/// naming the budget, and uid 1001's tree is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_uids_uploads_never_starve_another_uids_staged_ack_of_descriptors() {
    let h = Host::new();
    let base = h.tmp.path().to_path_buf();
    let go = base.join("shared/go");
    let mut trainers = Vec::new();
    for n in 1..=3 {
        trainers.push(staged_trainer(&base, n, TRAINER_UID, 300, None));
    }
    trainers.push(staged_trainer(&base, 4, FORGER_UID, 100, Some(&go)));
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let store = silent_store();
    let port = free_port();
    let log = base.join("agent.log");
    let mut cmd = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
    cmd.args([
        "run".to_string(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=60s".into(),
        format!("--checkpoint-dir={}", base.join("ckpt").display()),
        format!("--state-dir={}", base.join("state").display()),
        format!("--boot-id-file={}", base.join("boot_id").display()),
        format!("--metrics-addr=127.0.0.1:{port}"),
        "--gpu=off".into(),
        "--log-format=json".into(),
        "--log-level=info".into(),
        "--upload-allow=s3://ckpt/run1".into(),
        "--checkpoint-upload=s3://ckpt/run1".into(),
        format!("--upload-endpoint={store}"),
        "--upload-max-files=300".into(),
    ])
    // One target group for the four trainers (they share the one checkpoint dir): with one
    // pidfile group each, a group could read the notice.json another group of the same
    // delivery had just written as proof of an earlier delivery and leave its trainer
    // unsignalled (a delivery race of its own, seen under load; see the closing note of the
    // trust round), which is not what this test is about.
    // A comma inside a pattern is `\x2C`: the flag takes a comma-separated list.
    .arg("--checkpoint-cmdline=ack_staged\\(path\\x2C step=int")
    .envs(spotguard_testkit::s3::S3Server::client_env())
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&log).unwrap());
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    // SAFETY: setrlimit only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let agent = Agent {
        _proc: Kid::spawn(cmd),
        port,
        log,
    };
    agent
        .wait_metric(
            r#"spotguard_metadata_polls_total{source="aws"}"#,
            1.0,
            Duration::from_secs(30),
        )
        .await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    let first: Vec<serde_json::Value> =
        tokio::task::block_in_place(|| (1..=3).map(|n| staged_result(&base, n)).collect());
    std::fs::write(&go, "").unwrap();
    let other = tokio::task::block_in_place(|| staged_result(&base, 4));
    let log_text = agent.log_text();
    assert_eq!(
        other["answer"], "taken",
        "uid 1001's ack is taken: {other}\n{log_text}"
    );
    let answers: Vec<&str> = first
        .iter()
        .map(|r| r["answer"].as_str().unwrap())
        .collect();
    assert_eq!(
        answers.iter().filter(|a| **a == "taken").count(),
        1,
        "uid 1000: one tree fits its share: {first:?}\n{log_text}"
    );
    for r in first.iter().filter(|r| r["answer"] == "refused") {
        let error = r["error"].as_str().unwrap_or_default();
        assert!(error.contains("upload descriptor budget"), "{r}");
        let waited = r["answered_at"].as_f64().unwrap() - r["asked_at"].as_f64().unwrap();
        assert!(waited < 10.0, "told at once, not at the helper's wait: {r}");
    }
    assert!(
        agent
            .metric(r#"spotguard_checkpoint_upload_errors_total{error="staged_budget"}"#)
            .await
            >= 2.0
    );
    drop(trainers);
}
