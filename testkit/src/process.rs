//! Real processes under test: whether a process has installed its SIGUSR1 handler yet (the
//! agent only signals processes that catch the signal, so a test waits for the trap first).

use std::fmt::Display;
use std::time::Duration;

/// Whether process `pid` catches SIGUSR1 (`SigCgt` in `/proc/<pid>/status`); `false` when the
/// process is gone or its status unreadable.
pub fn catches_usr1(pid: impl Display) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        .is_some_and(|m| m & (1 << (libc::SIGUSR1 - 1)) != 0)
}

/// Wait up to 5 s (200 checks 25 ms apart) until process `pid` catches SIGUSR1; `false` when
/// it never does.
pub async fn wait_catches_usr1(pid: impl Display) -> bool {
    for _ in 0..200 {
        if catches_usr1(&pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}
