//! Filesystem work the agent runs in a child process it can walk away from: the agent's own
//! binary, started with a hidden first argument (fork + exec, no new privileges: the same user,
//! the same capability bounding set, only `fork`/`execve`/`pipe`/`read`/`write`, which the
//! systemd unit's `SystemCallFilter` allows). A path on a hung mount (a FUSE daemon that never
//! answers, a dead NFS server) holds the child in the kernel, never the agent: the agent waits
//! for a child only in interruptible ways (a pipe read, a bounded wait for its exit) and, when it
//! stops waiting, kills it without waiting; a child that has not exited yet is reaped when the
//! next one starts.
//!
//! Two kinds of child use it: the pod filesystem helper that holds a checkpoint dir
//! ([`super::podfs`], `spotguard __pod-fs`) and the start-up check of the agent's own
//! directories (`crate::config::check`, `spotguard __check-dir DIR`, bounded by [`wait_within`]).
//! Without [`use_exe`] (the library in unit tests) their callers do the work in this process.

use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

static EXE: OnceLock<PathBuf> = OnceLock::new();

/// Run bounded filesystem work in children started from `exe` (the daemon: `/proc/self/exe`, the
/// running binary even after a package upgrade replaced the file). Set once; `true` when this
/// call set it.
pub fn use_exe(exe: impl Into<PathBuf>) -> bool {
    EXE.set(exe.into()).is_ok()
}

/// The binary children are started from, once [`use_exe`] was called.
pub fn exe() -> Option<&'static Path> {
    EXE.get().map(PathBuf::as_path)
}

/// Children that were told to go (killed) but had not exited yet: reaped when the next child
/// starts. One stuck in the kernel stays here until it leaves it.
static GONE: Mutex<Vec<Child>> = Mutex::new(Vec::new());

fn reap_gone() {
    let mut gone = crate::sync::lock(&GONE);
    gone.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
}

/// Start `exe ARG ARGS…` with an empty environment, its stdout piped to the caller, its stdin
/// and stderr as given.
pub fn spawn(
    exe: &Path,
    arg: &str,
    args: &[&OsStr],
    stdin: Stdio,
    stderr: Stdio,
) -> io::Result<Child> {
    reap_gone();
    Command::new(exe)
        .arg(arg)
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .env_clear()
        .spawn()
}

/// Kill `child` and never wait for it: one that has not exited yet (stuck in the kernel) is
/// reaped later.
pub fn abandon(mut child: Child) {
    let _ = child.kill();
    if !matches!(child.try_wait(), Ok(Some(_))) {
        crate::sync::lock(&GONE).push(child);
    }
}

/// Wait for `child` to exit for at most `limit`: `None` when it has not (it is left running:
/// [`abandon`] it).
pub fn wait_within(child: &mut Child, limit: Duration) -> io::Result<Option<ExitStatus>> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if started.elapsed() >= limit {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Child {
        spawn(
            Path::new("/bin/sh"),
            "-c",
            &[OsStr::new(script)],
            Stdio::null(),
            Stdio::null(),
        )
        .unwrap()
    }

    #[test]
    fn a_child_that_ends_in_time_gives_its_status_and_one_that_does_not_is_left() {
        let mut quick = sh("exit 3");
        let status = wait_within(&mut quick, Duration::from_secs(30)).unwrap();
        assert_eq!(status.and_then(|s| s.code()), Some(3));

        // Blocks until its stdin (ours, never written) ends: it cannot end on its own.
        let mut stuck = spawn(
            Path::new("/bin/sh"),
            "-c",
            &[OsStr::new("read line")],
            Stdio::piped(),
            Stdio::null(),
        )
        .unwrap();
        let started = Instant::now();
        assert_eq!(
            wait_within(&mut stuck, Duration::from_millis(50)).unwrap(),
            None
        );
        assert!(started.elapsed() >= Duration::from_millis(50));
        let pid = stuck.id();
        abandon(stuck);
        // Killed, not waited for: reaped once it has exited.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            reap_gone();
            let left = GONE.lock().unwrap().iter().any(|c| c.id() == pid);
            if !left {
                break;
            }
            assert!(Instant::now() < deadline, "killed child {pid} never reaped");
            std::thread::sleep(Duration::from_millis(5));
        }
        let zombie = std::path::Path::new("/proc").join(pid.to_string());
        assert!(!zombie.exists(), "child {pid} left unreaped");
    }
}
