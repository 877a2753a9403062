//! The drill's command as a child process: where its stdout goes, how its exit reads, and
//! letting it exit (waited for, else stopped: SIGTERM, then SIGKILL [`STOP_GRACE`] later).

use std::time::Duration;

use jiff::Timestamp;
use tokio::process::Child;

use super::report::{self, ExitInfo};

/// How long the drill gives what it stops between its SIGTERM and its SIGKILL (and the SIGKILL
/// to be reaped).
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Where the command's stdout goes: ours, or stderr under `--json` (stdout is the JSON).
pub fn stdout(json: bool) -> Result<std::process::Stdio, String> {
    if !json {
        return Ok(std::process::Stdio::inherit());
    }
    use std::os::fd::AsFd;
    let fd = std::io::stderr()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("duplicating stderr: {e}"))?;
    Ok(std::process::Stdio::from(fd))
}

/// How an exit status reads in the verdict.
pub fn exit_info(status: std::process::ExitStatus, killed_by_drill: bool) -> ExitInfo {
    use std::os::unix::process::ExitStatusExt;
    let signal = status.signal();
    ExitInfo {
        code: status.code().unwrap_or_else(|| 128 + signal.unwrap_or(0)),
        signal,
        killed_by_drill,
    }
}

/// A command's end before the notice, as the error names it (`exit 1`, `killed by SIGKILL`).
pub fn early_exit(status: std::io::Result<std::process::ExitStatus>) -> String {
    match status {
        Ok(s) => {
            let e = exit_info(s, false);
            match e.signal {
                Some(_) => report::exit_label(&e),
                None => format!("exit {}", e.code),
            }
        }
        Err(e) => e.to_string(),
    }
}

/// How the command ended after its checkpoint step.
pub struct Ended {
    pub exit: Option<ExitInfo>,
    /// When it was seen to exit on its own.
    pub exited_at: Option<Timestamp>,
    /// When the drill sent its clean-up SIGTERM (it outlived `wait`).
    pub terminated_at: Option<Timestamp>,
}

/// Wait up to `wait` for the child (`pid`) to exit on its own; else SIGTERM, [`STOP_GRACE`] for
/// it to exit, then SIGKILL and [`STOP_GRACE`] more.
pub async fn let_exit(child: &mut Child, pid: u32, wait: Duration) -> Ended {
    match tokio::time::timeout(wait, child.wait()).await {
        Ok(s) => Ended {
            exited_at: Some(Timestamp::now()),
            exit: s.ok().map(|s| exit_info(s, false)),
            terminated_at: None,
        },
        Err(_) => {
            let terminated_at = Some(Timestamp::now());
            terminate(pid, libc::SIGTERM);
            let status = match tokio::time::timeout(STOP_GRACE, child.wait()).await {
                Ok(s) => s.ok(),
                Err(_) => {
                    terminate(pid, libc::SIGKILL);
                    tokio::time::timeout(STOP_GRACE, child.wait())
                        .await
                        .ok()
                        .and_then(|s| s.ok())
                }
            };
            Ended {
                exit: status.map(|s| exit_info(s, true)),
                exited_at: None,
                terminated_at,
            }
        }
    }
}

fn terminate(pid: u32, sig: libc::c_int) {
    if let Ok(p) = i32::try_from(pid) {
        // SAFETY: kill(2) on our own child's pid (not yet reaped: the pid is still ours).
        unsafe {
            libc::kill(p, sig);
        }
    }
}
