//! The plan lifecycle after the first notice, in host mode against the metadata emulator over
//! loopback HTTP, with a real training process that counts the signals it receives: new lives of
//! the machine (stop/start ⇒ a new boot id), one rebalance recommendation served for a long time,
//! a GCE maintenance window learned after the event, a GCE maintenance across agent restarts
//! whichever of its two keys answers first, maintenance after maintenance, a crash between the
//! local record and the signal, skewed cloud times, an unparsable EC2 scheduled event beside a
//! valid one, Azure Freeze.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use spotguard::app;
use spotguard::config::{self, Config};
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig, Fault, FaultKind};
use spotguard::responder::PlanEvent;
use spotguard_testkit::wait_for_event as wait_for;
use spotguard_testkit::{metrics_text, process};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// A trainer that catches SIGUSR1, records each signal in `marks` and (with `ack`) writes a
/// `done` ack.
const TRAINER: &str = r#"
trap 'n=$((n+1)); echo $n >> "$MARKS"; if [ "$ACK" = 1 ]; then printf '"'"'{"state":"done","step":%d,"checkpoint":"c%d","ts":%s}'"'"' $n $n $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$BASHPID.json"; fi' USR1
while :; do sleep 0.05; done
"#;

struct Machine {
    dir: tempfile::TempDir,
    trainer: tokio::process::Child,
}

impl Machine {
    async fn start(ack: bool) -> Machine {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ckpt")).unwrap();
        std::fs::write(dir.path().join("boot_id"), "boot-1\n").unwrap();
        let trainer = tokio::process::Command::new("bash")
            .arg("-c")
            .arg(TRAINER)
            .env("SPOTGUARD_DIR", dir.path().join("ckpt"))
            .env("MARKS", dir.path().join("marks"))
            .env("ACK", if ack { "1" } else { "0" })
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = trainer.id().unwrap() as i32;
        std::fs::write(dir.path().join("trainer.pid"), pid.to_string()).unwrap();
        let machine = Machine { dir, trainer };
        assert!(
            process::wait_catches_usr1(pid).await,
            "trainer did not install its handler"
        );
        machine
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Signals counted by the receiving process.
    fn signals(&self) -> usize {
        std::fs::read_to_string(self.path("marks"))
            .map(|s| s.lines().count())
            .unwrap_or(0)
    }

    fn reboot(&self, boot_id: &str) {
        std::fs::write(self.path("boot_id"), boot_id).unwrap();
    }

    fn record(&self) -> Option<serde_json::Value> {
        let s = std::fs::read_to_string(self.path("state/notice.json")).ok()?;
        serde_json::from_str(&s).ok()
    }

    fn args(&self, emu: &emulator::EmulatorHandle, extra: &[&str]) -> config::RunArgs {
        let mut argv: Vec<String> = vec![
            "--mode=host".into(),
            format!("--cloud={}", emu.cloud().as_str()),
            format!("--metadata-endpoint={}", emu.base_url()),
            "--poll-interval=200ms".into(),
            "--checkpoint-timeout=20s".into(),
            format!("--checkpoint-dir={}", self.path("ckpt").display()),
            format!("--state-dir={}", self.path("state").display()),
            format!(
                "--checkpoint-pidfile={}",
                self.path("trainer.pid").display()
            ),
            format!("--boot-id-file={}", self.path("boot_id").display()),
            "--metrics-addr=127.0.0.1:0".into(),
            "--gpu=off".into(),
            format!(
                "--log-level={}",
                std::env::var("SG_TEST_LOG").unwrap_or_else(|_| "warn".into())
            ),
            "--shutdown-grace=2s".into(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"))
    }

    async fn agent(&self, emu: &emulator::EmulatorHandle, extra: &[&str]) -> Agent {
        let cfg = Config::resolve(self.args(emu, extra), &config::ProcessEnv).unwrap();
        spotguard::telemetry::init(config::LogFormat::Text, &cfg.args.log_level);
        let cancel = CancellationToken::new();
        let app = app::start(cfg, cancel.clone()).await.unwrap();
        Agent {
            events: app.events,
            admin_addr: app.admin_addr,
            join: app.join,
            cancel,
        }
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        let _ = self.trainer.start_kill();
    }
}

struct Agent {
    events: broadcast::Receiver<PlanEvent>,
    admin_addr: SocketAddr,
    join: tokio::task::JoinHandle<Result<(), app::Error>>,
    cancel: CancellationToken,
}

impl Agent {
    async fn stop(self) {
        self.cancel.cancel();
        let r = tokio::time::timeout(Duration::from_secs(10), self.join)
            .await
            .expect("agent stops")
            .expect("agent task");
        assert!(r.is_ok(), "{r:?}");
    }

    /// The value of one series on `/metrics` (`0` when absent).
    async fn metric(&self, series: &str) -> f64 {
        let text = metrics_text(self.admin_addr).await;
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0.0)
    }

    async fn ready(&self) -> bool {
        reqwest::get(format!("http://{}/readyz", self.admin_addr))
            .await
            .unwrap()
            .status()
            .is_success()
    }

    async fn done(&mut self, limit: Duration) {
        wait_for(&mut self.events, limit, |e| {
            matches!(e, PlanEvent::Done { .. }).then_some(())
        })
        .await
    }
}

fn near(a: Timestamp, b: Timestamp, within: Duration) -> bool {
    a.duration_since(b).abs() <= SignedDuration::try_from(within).unwrap()
}

/// Item 1: an interruption handled in one life stays handled in that life (restart, no second
/// signal), and a new life (new boot id: stop/start) arms the agent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_boot_arms_the_agent_again() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &[]).await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1);
    assert_eq!(m.record().unwrap()["boot_id"], "boot-1");
    a.stop().await;

    // Same life, agent restarted, a fresh instance-action `time`: still the one interruption.
    emu.clear();
    emu.raise(EmulatedNotice::interruption().due_in(Duration::from_secs(100)))
        .unwrap();
    let a = m.agent(&emu, &[]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(m.signals(), 1, "same life: never a second signal");
    a.stop().await;

    // Stop/start: new boot id. The record of the previous life is cleared, the agent acts again.
    m.reboot("boot-2");
    let mut a = m.agent(&emu, &[]).await;
    wait_for(&mut a.events, Duration::from_secs(10), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    let processes = wait_for(&mut a.events, Duration::from_secs(30), |e| match e {
        PlanEvent::Signalled { processes, .. } => Some(*processes),
        _ => None,
    })
    .await;
    assert_eq!(processes, 1);
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 2, "armed again in the new life");
    assert_eq!(m.record().unwrap()["boot_id"], "boot-2");
    a.stop().await;
}

/// Item 2: one rebalance recommendation, served unchanged for more than 3 × the expiry (and across
/// an agent restart): exactly one signal, one undo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_rebalance_recommendation_is_signalled_once() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--rebalance-expiry=1s"]).await;
    emu.raise(EmulatedNotice::rebalance()).unwrap();
    let mut undone = 0;
    let _ = tokio::time::timeout(Duration::from_millis(4500), async {
        loop {
            if let Ok(PlanEvent::Undone { .. }) = a.events.recv().await {
                undone += 1;
            }
        }
    })
    .await;
    assert_eq!(m.signals(), 1, "one recommendation, one signal");
    assert_eq!(undone, 1, "undone once, at its expiry");
    assert_eq!(m.record().unwrap()["phase"], "undone");
    a.stop().await;
    // A restarted agent still knows the recommendation.
    let a = m.agent(&emu, &["--rebalance-expiry=1s"]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(m.signals(), 1, "not again after a restart");
    a.stop().await;
}

/// Item 3: GCE TERMINATE_ON_HOST_MAINTENANCE whose window appears in `upcoming-maintenance` 5 s
/// after the event: the plan is never zero-length, and it ends with the real window as deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gce_window_learned_after_the_event_gives_the_plan_its_real_budget() {
    let m = Machine::start(false).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--checkpoint-timeout=10s"]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let window = Duration::from_secs(20 * 60);
    let raised = emu
        .raise(
            EmulatedNotice::maintenance()
                .due_in(window)
                .window_after(Duration::from_secs(5)),
        )
        .unwrap();
    let start = raised
        .visible_at
        .checked_add(SignedDuration::try_from(window).unwrap())
        .unwrap();
    let (signalled_at, ck) = wait_for(&mut a.events, Duration::from_secs(20), |e| match e {
        PlanEvent::Signalled {
            at,
            checkpoint_deadline,
            ..
        } => Some((*at, *checkpoint_deadline)),
        _ => None,
    })
    .await;
    assert!(
        ck.duration_since(signalled_at) >= SignedDuration::from_secs(9),
        "the checkpoint got its budget, not zero: {signalled_at} → {ck}"
    );
    a.done(Duration::from_secs(40)).await;
    let rec = m.record().unwrap();
    let deadline: Timestamp = rec["deadline"].as_str().unwrap().parse().unwrap();
    assert!(
        near(deadline, start, Duration::from_secs(3)),
        "plan deadline {deadline} is the real window {start}"
    );
    assert_eq!(m.signals(), 1);
    a.stop().await;
}

/// Item 5: after a plan finishes (and is cancelled) the responder is free: the same GCE
/// maintenance (fixed notice id) reported again is acted on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gce_maintenance_after_a_cancelled_one_is_acted_on() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--maintenance-lead=1h"]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = emu
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1);
    emu.cancel(Some(&first.id)).unwrap();
    wait_for(&mut a.events, Duration::from_secs(10), |e| {
        matches!(e, PlanEvent::Undone { .. }).then_some(())
    })
    .await;
    emu.raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(
        m.signals(),
        2,
        "the maintenance after a cancelled one is handled"
    );
    // GCE announces it in two keys (`maintenance-event`, `upcoming-maintenance`) answering in
    // either order: still one maintenance, so no second plan follows the first.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(m.signals(), 2, "one maintenance, one signal");
    a.stop().await;
}

/// GCE announces one maintenance in two keys, and the first answers an agent gets after a restart
/// come in either order: restarted twice in the middle of the maintenance, each time with the
/// other key's first answer held back, the agent still knows it (one maintenance, one id, one
/// signal), whichever key spoke first before the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gce_maintenance_is_known_after_restarts_whichever_key_answers_first() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Gce))
        .await
        .unwrap();
    let lead = ["--maintenance-lead=1h"];
    let mut a = m.agent(&emu, &lead).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    emu.raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1);
    a.stop().await;
    for held_back in ["maintenance-event", "upcoming-maintenance"] {
        let mut stall = Fault::new(FaultKind::Stall {
            delay: Duration::from_secs(1),
        });
        stall.count = Some(1);
        stall.path = Some(format!("/computeMetadata/v1/instance/{held_back}"));
        emu.fault(stall).unwrap();
        let a = m.agent(&emu, &lead).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            m.signals(),
            1,
            "restarted with {held_back} answering last: the same maintenance, not a new one"
        );
        a.stop().await;
    }
}

/// Item 5: a rebalance after a finished maintenance plan is acted on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_after_a_finished_maintenance_plan_is_acted_on() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--maintenance-lead=1h"]).await;
    emu.raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1);
    emu.raise(EmulatedNotice::rebalance()).unwrap();
    wait_for(&mut a.events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    assert_eq!(
        m.signals(),
        2,
        "a rebalance after the maintenance plan is acted on"
    );
    a.stop().await;
}

fn write_record(m: &Machine, id: &str, boot: &str) {
    let now = Timestamp::now();
    let rec = serde_json::json!({
        "id": id,
        "kind": {"type": "interruption"},
        "source": "aws",
        "deadline": now.checked_add(SignedDuration::from_secs(100)).unwrap().to_string(),
        "phase": "signalled",
        "signalled_at": now.to_string(),
        "boot_id": boot,
        "updated_at": now.to_string(),
    });
    std::fs::create_dir_all(m.path("state")).unwrap();
    std::fs::write(m.path("state/notice.json"), rec.to_string()).unwrap();
}

/// Item 6: the local record says `signalled` but the agent died before the signal went out
/// (`notice.json` does not name the notice): the resumed plan signals. When `notice.json` names it,
/// the signal went out: never again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_record_and_the_signal_is_told_by_notice_json() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    write_record(&m, "i-crash", "boot-1");
    let mut a = m.agent(&emu, &["--checkpoint-timeout=3s"]).await;
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1, "the signal that never went out is sent");
    a.stop().await;

    let m = Machine::start(true).await;
    write_record(&m, "i-told", "boot-1");
    let notice = serde_json::json!({
        "notice_id": "i-told", "source": "aws", "kind": "interruption",
        "deadline_unix": null, "checkpoint_deadline_unix": 0, "signal": "SIGUSR1"
    });
    std::fs::write(m.path("ckpt/notice.json"), notice.to_string()).unwrap();
    let mut a = m.agent(&emu, &["--checkpoint-timeout=3s"]).await;
    a.done(Duration::from_secs(30)).await;
    assert_eq!(
        m.signals(),
        0,
        "notice.json names the notice: it was signalled"
    );
    a.stop().await;
}

/// Item 7: an EC2 instance-action `time` an hour ahead (a skewed clock) is clamped to two minutes
/// after the notice was first seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skewed_ec2_deadline_is_clamped() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &[]).await;
    let raised = emu
        .raise(EmulatedNotice::interruption().due_in(Duration::from_secs(3600)))
        .unwrap();
    let deadline = wait_for(&mut a.events, Duration::from_secs(20), |e| match e {
        PlanEvent::NoticeSeen { notice, .. } => notice.deadline,
        _ => None,
    })
    .await;
    let latest = raised
        .visible_at
        .checked_add(SignedDuration::from_secs(122))
        .unwrap();
    assert!(deadline <= latest, "{deadline} clamped to ≤ {latest}");
    a.done(Duration::from_secs(30)).await;
    a.stop().await;
}

const EC2_PARSE_ERRORS: &str = r#"spotguard_metadata_errors_total{source="aws",error="parse"}"#;

/// Item 7: one EC2 scheduled event whose `NotBefore` cannot be parsed does not hide the others: it
/// is skipped and counted as a parse error on every poll, the valid event beside it is handled,
/// and the agent keeps running (and ready).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unparsable_ec2_scheduled_event_does_not_hide_the_valid_one() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--maintenance-lead=1h"]).await;
    emu.raise(
        EmulatedNotice::maintenance()
            .event_id("instance-event-0badbadbadbadbad0")
            .due_in(Duration::from_secs(600))
            .not_before_raw("sometime"),
    )
    .unwrap();
    // Alone, the bad event is counted and never acted on.
    tokio::time::timeout(Duration::from_secs(10), async {
        while a.metric(EC2_PARSE_ERRORS).await < 2.0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the unparsable NotBefore is counted as a parse error");
    assert_eq!(m.signals(), 0, "an unparsable event is not acted on");
    assert!(m.record().is_none(), "no plan for an unparsable event");

    let good = emu
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    let seen = wait_for(&mut a.events, Duration::from_secs(20), |e| match e {
        PlanEvent::NoticeSeen { notice, .. } => Some(notice.id.clone()),
        _ => None,
    })
    .await;
    assert_eq!(seen, good.id, "the valid event beside the bad one is seen");
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1, "the valid event is handled");
    assert_eq!(m.record().unwrap()["id"], good.id.as_str());

    // The bad event is still served: still counted, still not a cancellation of anything, and
    // the agent keeps serving.
    let before = a.metric(EC2_PARSE_ERRORS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        a.metric(EC2_PARSE_ERRORS).await > before,
        "every poll counts the skipped event"
    );
    assert_eq!(m.signals(), 1, "no second signal");
    assert!(
        a.ready().await,
        "one bad event does not make the agent unready"
    );
    assert!(!a.join.is_finished(), "the agent keeps running");
    a.stop().await;
}

/// Item 9: an Azure Freeze (a pause of seconds) is ignored by default; a Reboot still drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_freeze_is_ignored_by_default() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Azure))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--maintenance-lead=1h"]).await;
    emu.raise(
        EmulatedNotice::maintenance()
            .code("Freeze")
            .due_in(Duration::from_secs(300)),
    )
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(m.signals(), 0, "Freeze: no signal");
    assert!(m.record().is_none(), "Freeze: no plan");
    assert!(emu.azure_acks().is_empty());
    let reboot = emu
        .raise(
            EmulatedNotice::maintenance()
                .code("Reboot")
                .due_in(Duration::from_secs(300)),
        )
        .unwrap();
    a.done(Duration::from_secs(30)).await;
    assert_eq!(m.signals(), 1, "Reboot: checkpointed");
    assert_eq!(emu.azure_acks(), vec![reboot.id]);
    a.stop().await;
}

/// Issue 24 item 2c: a rebalance is checkpointed, then a scheduled maintenance that only cordons
/// runs its plan, then the agent restarts: the record kept the rebalance beside the maintenance,
/// so the same recommendation (still served) is not checkpointed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_checkpointed_before_a_maintenance_plan_is_not_checkpointed_again() {
    let m = Machine::start(true).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let extra = ["--maintenance-lead=1h", "--on-maintenance=cordon"];
    let mut a = m.agent(&emu, &extra).await;
    emu.raise(EmulatedNotice::rebalance()).unwrap();
    wait_for(&mut a.events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Checkpointed { .. }).then_some(())
    })
    .await;
    assert_eq!(m.signals(), 1);
    let maintenance = emu
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    wait_for(&mut a.events, Duration::from_secs(20), |e| match e {
        PlanEvent::Done { id, .. } if *id == maintenance.id => Some(()),
        _ => None,
    })
    .await;
    assert_eq!(m.record().unwrap()["kind"]["type"], "maintenance");
    a.stop().await;
    let a = m.agent(&emu, &extra).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        m.signals(),
        1,
        "the rebalance of this life was checkpointed already"
    );
    a.stop().await;
}

/// Issue 24 item 7: an interruption's deadline moved earlier while the trainer (which never
/// acks) is waited for: the wait ends at the new checkpoint deadline as `timeout`, counted,
/// not as `error` ("cancelled").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_cut_short_by_an_earlier_deadline_is_a_timeout() {
    let m = Machine::start(false).await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let mut a = m.agent(&emu, &["--checkpoint-timeout=60s"]).await;
    emu.raise(EmulatedNotice::interruption().due_in(Duration::from_secs(110)))
        .unwrap();
    wait_for(&mut a.events, Duration::from_secs(20), |e| {
        matches!(e, PlanEvent::Signalled { .. }).then_some(())
    })
    .await;
    // The cloud now says 28 s: the checkpoint must end 25 s (the drain reserve) before it.
    emu.clear();
    emu.raise(EmulatedNotice::interruption().due_in(Duration::from_secs(28)))
        .unwrap();
    let results = wait_for(&mut a.events, Duration::from_secs(20), |e| match e {
        PlanEvent::Checkpointed { results, .. } => Some(results.clone()),
        _ => None,
    })
    .await;
    assert_eq!(
        results[0].outcome.as_str(),
        "timeout",
        "{}",
        results[0].detail
    );
    assert!(
        results[0].detail.contains("deadline moved earlier"),
        "{}",
        results[0].detail
    );
    assert_eq!(
        a.metric(r#"spotguard_checkpoint_total{outcome="timeout"}"#)
            .await,
        1.0
    );
    a.stop().await;
}
