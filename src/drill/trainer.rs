//! The bundled example trainer (`spotguard example-trainer`, hidden): what `spotguard drill` runs
//! when no command is given. Simulated steps; on SIGUSR1/SIGTERM it finishes the step, saves a
//! checkpoint beside the notice dir (`$SPOTGUARD_DIR-checkpoints`: never in the notice dir, which
//! only carries the notice and the acks), acks `done` and exits 143. With `$SPOTGUARD_DRILL_STAGED`
//! (`drill --upload-to`) it saves `$SPOTGUARD_DRILL_STAGED_BYTES` to a staged directory there
//! instead, acks `done` with `staged`, waits for the agent's answer and exits.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use jiff::Timestamp;

use super::ExampleTrainerArgs;

/// The local directory staged checkpoints are saved under (`drill --upload-to`).
pub const STAGED_ENV: &str = "SPOTGUARD_DRILL_STAGED";
/// How many bytes a staged checkpoint holds.
pub const STAGED_SIZE_ENV: &str = "SPOTGUARD_DRILL_STAGED_BYTES";
/// How long the trainer waits for the agent's answer to a staged ack.
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

static SIGNALLED: AtomicI32 = AtomicI32::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALLED.store(sig, Ordering::SeqCst);
}

fn install_handlers() -> std::io::Result<()> {
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    for sig in [libc::SIGUSR1, libc::SIGTERM] {
        // SAFETY: installing a handler that only stores to an atomic.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn write_ack(dir: &Path, state: &str, step: u64, checkpoint: Option<&Path>) -> std::io::Result<()> {
    let body = serde_json::json!({
        "state": state,
        "step": step,
        "checkpoint": checkpoint.map(|p| p.display().to_string()),
        "ts": Timestamp::now().as_millisecond() as f64 / 1000.0,
    });
    crate::fsutil::write_atomic(
        &dir.join(format!("ack-{}.json", std::process::id())),
        body.to_string().as_bytes(),
        0o644,
    )
}

/// Where the bundled trainer keeps its checkpoints: beside the notice dir `dir`, in
/// `<dir>-checkpoints`, so that a drill run again with the same `--notice-dir` resumes from them.
fn checkpoints_dir(dir: &Path) -> PathBuf {
    let mut name = dir.as_os_str().to_owned();
    name.push("-checkpoints");
    PathBuf::from(name)
}

/// The bundled trainer: simulated steps; on SIGUSR1/SIGTERM it finishes the step, saves a
/// checkpoint into [`checkpoints_dir`], acks `done` and exits 143. Resumes from the newest
/// checkpoint there.
pub fn example_trainer(args: ExampleTrainerArgs) -> i32 {
    let dir =
        PathBuf::from(std::env::var("SPOTGUARD_DIR").unwrap_or_else(|_| "/tmp/spotguard".into()));
    let ckpt_dir = checkpoints_dir(&dir);
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|_| std::fs::create_dir_all(&ckpt_dir))
        .and_then(|_| install_handlers())
    {
        eprintln!("example-trainer: {e}");
        return 1;
    }
    let mut step = latest_checkpoint(&ckpt_dir).unwrap_or(0);
    if step > 0 {
        println!("example-trainer: resumed from step {step}");
    } else {
        println!(
            "example-trainer: starting from scratch (pid {})",
            std::process::id()
        );
    }
    let _ = std::io::stdout().flush();
    loop {
        std::thread::sleep(args.step_time);
        step += 1;
        let sig = SIGNALLED.load(Ordering::SeqCst);
        if sig != 0 {
            let _ = write_ack(&dir, "received", step, None);
            println!("example-trainer: signal {sig} at step {step}: saving a checkpoint");
            if let Some(staged) = std::env::var_os(STAGED_ENV) {
                return save_staged(&dir, Path::new(&staged), step);
            }
            std::thread::sleep(args.save_time);
            let path = ckpt_dir.join(format!("checkpoint-{step:08}.json"));
            let payload = serde_json::json!({"step": step, "weights": "simulated"}).to_string();
            if let Err(e) = crate::fsutil::write_atomic(&path, payload.as_bytes(), 0o644) {
                eprintln!("example-trainer: saving {}: {e}", path.display());
                let _ = write_ack(&dir, "failed", step, None);
                return 1;
            }
            if let Err(e) = write_ack(&dir, "done", step, Some(&path)) {
                eprintln!("example-trainer: writing ack: {e}");
                return 1;
            }
            println!(
                "example-trainer: checkpoint {} saved; exiting 143",
                path.display()
            );
            let _ = std::io::stdout().flush();
            return 143;
        }
        if args.max_steps > 0 && step >= args.max_steps {
            return 0;
        }
    }
}

/// Save the step to a local staged directory, ack it `staged`, wait for the agent to take it,
/// exit 143 (as after any checkpoint).
fn save_staged(dir: &Path, under: &Path, step: u64) -> i32 {
    let size: u64 = std::env::var(STAGED_SIZE_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64 << 20);
    let path = under.join(format!("step-{step}"));
    if let Err(e) = write_shards(&path, size) {
        eprintln!("example-trainer: saving {}: {e}", path.display());
        let _ = write_ack(dir, "failed", step, None);
        return 1;
    }
    let answer = dir.join(format!("upload-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&answer);
    let body = serde_json::json!({
        "state": "done",
        "step": step,
        "checkpoint": path.display().to_string(),
        "staged": path.display().to_string(),
        "ts": Timestamp::now().as_millisecond() as f64 / 1000.0,
    });
    let ack = dir.join(format!("ack-{}.json", std::process::id()));
    if let Err(e) = crate::fsutil::write_atomic(&ack, body.to_string().as_bytes(), 0o644) {
        eprintln!("example-trainer: writing ack: {e}");
        return 1;
    }
    let waited = std::time::Instant::now();
    let state = loop {
        let got = std::fs::read(&answer)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_string));
        if let Some(s) = got {
            break s;
        }
        if waited.elapsed() >= ANSWER_WAIT {
            break "timeout".to_string();
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    println!(
        "example-trainer: staged checkpoint {} ({size} bytes) {state}; exiting 143",
        path.display()
    );
    let _ = std::io::stdout().flush();
    143
}

/// Four shards and a small metadata file, like a distributed checkpoint.
fn write_shards(path: &Path, size: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(path)?;
    let block: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    for i in 0..4 {
        let mut f = std::fs::File::create(path.join(format!("__{i}_0.distcp")))?;
        let mut left = size / 4;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
    }
    std::fs::write(path.join(".metadata"), b"{\"shards\": 4}")
}

fn latest_checkpoint(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("checkpoint-")?
                .strip_suffix(".json")?
                .parse::<u64>()
                .ok()
        })
        .max()
}
