//! Trust, round three (issue 29), acks: against the real `spotguard` binary in host mode as it
//! ships (every capability dropped but KILL and SYS_PTRACE), trainers as uid 1000 and a forger as
//! uid 1001 (`setpriv`), the metadata emulator over HTTP.
//!
//! - a hard link keeps its owner: a victim-owned world-writable file linked in at the victim's
//!   fallback ack name, with a `done` written into it, never counts.
//!
//! Needs root (setpriv) and `/tmp` on one filesystem with the checkpoint dir.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::free_port;
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
        let mut cmd = Command::new("setpriv");
        cmd.args([
            "--inh-caps=-all",
            "--ambient-caps=-all",
            "--bounding-set=-all,+kill,+sys_ptrace",
            "--",
        ])
        .arg(env!("CARGO_BIN_EXE_spotguard"))
        .args([
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
