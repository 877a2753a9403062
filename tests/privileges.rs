//! Test with the privileges we ship: the real `spotguard` binary with every capability dropped
//! but KILL and SYS_PTRACE (as the DaemonSet runs it: no CAP_CHOWN, no CAP_DAC_OVERRIDE, no
//! CAP_FOWNER), against a trainer running as uid 1000; and the same binary on a "kernel" (a
//! seccomp filter) without `openat2` / `pidfd_open`, whose `/readyz` must say so.
//!
//! Needs root (to drop to uid 1000 and to install the seccomp filter) and `setpriv`.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::free_port;
use spotguard_testkit::process::shipped_command;
use spotguard_testkit::process::{as_user, Kid};

const TRAINER_UID: u32 = 1000;

/// A uid-1000 trainer: on SIGUSR1 writes `received`, then `done`, into `$SPOTGUARD_DIR` (which
/// does not exist when it starts; it never creates it).
const TRAINER: &str = r#"
trap 'printf "{\"state\":\"received\"}" > "$SPOTGUARD_DIR/.t$$" && mv "$SPOTGUARD_DIR/.t$$" "$SPOTGUARD_DIR/ack-$$.json"
  printf "{\"state\":\"done\",\"step\":7}" > "$SPOTGUARD_DIR/.t$$" && mv "$SPOTGUARD_DIR/.t$$" "$SPOTGUARD_DIR/ack-$$.json"' USR1
sleep 1000 & S=$!
while :; do wait $S; done
"#;

fn cap_eff(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .unwrap()
}

async fn get(url: &str) -> Option<(u16, String)> {
    let resp = reqwest::get(url).await.ok()?;
    let code = resp.status().as_u16();
    Some((code, resp.text().await.ok()?))
}

fn agent_args(emu: &str, base: &Path, port: u16) -> Vec<String> {
    vec![
        "run".into(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={emu}"),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=20s".into(),
        format!("--checkpoint-dir={}", base.join("ckpt").display()),
        format!("--state-dir={}", base.join("state").display()),
        format!(
            "--checkpoint-pidfile={}",
            base.join("trainer.pid").display()
        ),
        format!("--metrics-addr=127.0.0.1:{port}"),
        "--gpu=off".into(),
        "--log-level=warn".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uid_1000_trainer_acks_into_a_dir_the_agent_creates_without_cap_chown() {
    let tmp = tempfile::tempdir().unwrap();
    // The trainer must be able to reach its dir: the test's temp dir is 0700.
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let base = tmp.path();
    let dir = base.join("ckpt");
    let mut trainer = Command::new("sh");
    trainer
        .arg("-c")
        .arg(TRAINER)
        .env("SPOTGUARD_DIR", &dir)
        .stderr(Stdio::null());
    as_user(&mut trainer, TRAINER_UID);
    let trainer = Kid::spawn(trainer);
    let tpid = trainer.pid();
    trainer.wait_for_trap();
    std::fs::write(base.join("trainer.pid"), tpid.to_string()).unwrap();
    assert!(!dir.exists());

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let port = free_port();
    // As the DaemonSet runs it: every capability dropped but KILL and SYS_PTRACE.
    let mut agent = shipped_command(env!("CARGO_BIN_EXE_spotguard"));
    agent
        .args(agent_args(&emu.base_url(), base, port))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let agent = Kid::spawn(agent);
    let metrics = format!("http://127.0.0.1:{port}/metrics");
    let t = Instant::now();
    loop {
        assert!(t.elapsed() < Duration::from_secs(20), "agent never served");
        if let Some((200, text)) = get(&metrics).await {
            if text.contains("spotguard_metadata_polls_total") {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    const CAP_KILL: u32 = 5;
    const CAP_SYS_PTRACE: u32 = 19;
    let want = (1u64 << CAP_KILL) | (1u64 << CAP_SYS_PTRACE);
    assert_eq!(
        cap_eff(agent.pid() as u32),
        want,
        "agent runs with KILL and SYS_PTRACE only"
    );

    emu.raise(EmulatedNotice::interruption()).unwrap();
    let t = Instant::now();
    let text = loop {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no checkpoint outcome; dir exists: {}",
            dir.exists()
        );
        if let Some((200, text)) = get(&metrics).await {
            if text
                .lines()
                .any(|l| l.starts_with("spotguard_checkpoint_total{") && l.ends_with(" 1"))
            {
                break text;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        text.lines()
            .any(|l| l == "spotguard_checkpoint_total{outcome=\"acked\"} 1"),
        "{}",
        text.lines()
            .filter(|l| l.contains("checkpoint_total") || l.contains("errors_total"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The agent made the dir (root-owned, sticky, world-writable), never chowned anything, and
    // the trainer's ack is the trainer's.
    let meta = std::fs::metadata(&dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o1777));
    let ack = std::fs::metadata(dir.join(format!("ack-{tpid}.json"))).unwrap();
    assert_eq!(ack.uid(), TRAINER_UID);
    assert!(dir.join("notice.json").exists());
}

/// A seccomp filter that makes `openat2` and `pidfd_open` fail with ENOSYS, as on a 5.4 kernel.
fn deny_new_syscalls() -> std::io::Result<()> {
    const LD_NR: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET: u16 = 0x06; // BPF_RET | BPF_K
    const ALLOW: u32 = 0x7fff_0000;
    const ERRNO: u32 = 0x0005_0000;
    let f = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let prog = [
        f(LD_NR, 0, 0, 0),
        f(JEQ, 2, 0, libc::SYS_openat2 as u32),
        f(JEQ, 1, 0, libc::SYS_pidfd_open as u32),
        f(RET, 0, 0, ALLOW),
        f(RET, 0, 0, ERRNO | libc::ENOSYS as u32),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: prctl with a filter program that lives until the call returns (the kernel copies
    // it); runs in the forked child before exec.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER,
            &fprog as *const libc::sock_fprog,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_without_openat2_and_pidfd_open_is_not_ready_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let start = |seccomp: bool| {
        let port = free_port();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_spotguard"));
        cmd.args(agent_args(&emu.base_url(), tmp.path(), port))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if seccomp {
            // SAFETY: only async-signal-safe prctl calls between fork and exec.
            unsafe { cmd.pre_exec(deny_new_syscalls) };
        }
        (Kid::spawn(cmd), port)
    };
    let (_old, old_port) = start(true);
    let (_new, new_port) = start(false);

    // The healthy agent becomes ready once a metadata poll succeeded.
    let t = Instant::now();
    loop {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "healthy agent never ready"
        );
        if let Some((200, _)) = get(&format!("http://127.0.0.1:{new_port}/readyz")).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The other one polls just as well, but is not ready, and says why.
    let t = Instant::now();
    loop {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "old-kernel agent never polled"
        );
        if let Some((200, text)) = get(&format!("http://127.0.0.1:{old_port}/metrics")).await {
            if text
                .lines()
                .any(|l| l.starts_with("spotguard_metadata_polls_total{") && !l.ends_with(" 0"))
            {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, body) = get(&format!("http://127.0.0.1:{old_port}/readyz"))
        .await
        .unwrap();
    assert_eq!(code, 503, "{body}");
    for want in [
        "kernel feature probe failed",
        "pidfd_open",
        "openat2",
        "Linux ≥ 5.6",
    ] {
        assert!(body.contains(want), "{want:?} missing from {body:?}");
    }
}
