//! Signal delivery through a pidfd (docs/checkpoint-protocol.md): `pidfd_open`, then re-read the start time from
//! `/proc` and compare with the discovered one (a recycled PID is skipped: the pidfd pins the
//! process we checked), then check the handler masks, then `pidfd_send_signal`.
//!
//! Preparation and sending are split so that the notice can be written between them while the
//! pidfds keep the checked processes pinned.

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;

use rustix::process::{pidfd_open, pidfd_send_signal, Pid, PidfdFlags};

use super::handler::{self, Check, NotHandler};
use super::procfs::{io_gone, is_gone, ProcFs};
use super::{Error, Signal, TargetProcess};

/// Why a discovered process was not signalled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotSignalled {
    /// `handlers` or `caught` mode and the process does not catch the signal (or ignores it).
    NoHandler,
    /// `handlers` mode and the process catches the signal but is no handler (a shell with an
    /// `EXIT` trap, a launcher: [`super::handler`]); why.
    NotAHandler(String),
    /// The process exited before it could be signalled.
    Gone,
    /// The PID now belongs to another process (start time differs).
    Recycled { expected: u64, found: u64 },
    /// spotguard never signals itself.
    Spotguard,
    /// Restart path: the process started after the original signal, so it was never signalled.
    StartedAfterSignal,
    /// Nothing tells whether it was signalled for this notice before (no record lists it, its
    /// `notice.json` cannot be read): not signalled again.
    MaybeSignalled,
    /// Opening, checking or signalling failed.
    Failed(String),
}

impl NotSignalled {
    /// Short label for logs and details.
    pub fn as_str(&self) -> &'static str {
        match self {
            NotSignalled::NoHandler => "no_handler",
            NotSignalled::NotAHandler(_) => "not_a_handler",
            NotSignalled::Gone => "gone",
            NotSignalled::Recycled { .. } => "recycled",
            NotSignalled::Spotguard => "self",
            NotSignalled::StartedAfterSignal => "started_after_signal",
            NotSignalled::MaybeSignalled => "maybe_signalled",
            NotSignalled::Failed(_) => "error",
        }
    }
}

impl fmt::Display for NotSignalled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotSignalled::Recycled { expected, found } => {
                write!(f, "recycled (start time {found}, expected {expected})")
            }
            NotSignalled::Failed(reason) => write!(f, "error: {reason}"),
            NotSignalled::NotAHandler(why) => write!(f, "not a handler: {why}"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A process checked and pinned by a pidfd, ready to be signalled.
#[derive(Debug)]
pub struct Prepared {
    /// Host PID.
    pub pid: i32,
    /// PID as the process sees it (last `NSpid` field; the host PID when not reported).
    pub ns_pid: i32,
    pub start_time: u64,
    /// Real uid/gid, for the ownership of a checkpoint dir the agent creates.
    pub uid: u32,
    pub gid: u32,
    /// Every uid of the process: an ack counts only when one of them owns it.
    pub uids: Vec<u32>,
    pidfd: OwnedFd,
}

/// Convert to rustix's signal type: named signals, and real-time signals (34..=64) by number.
fn rustix_signal(sig: Signal) -> Option<rustix::process::Signal> {
    if let Some(s) = rustix::process::Signal::from_named_raw(sig.0) {
        return Some(s);
    }
    if (34..=64).contains(&sig.0) {
        // SAFETY: the value is a kernel real-time signal above glibc's reserved 32 and 33; it is
        // only sent to another process, never installed or raised in this one.
        return Some(unsafe { rustix::process::Signal::from_raw_unchecked(sig.0) });
    }
    None
}

/// Open a pidfd for `target`, re-check its start time and what `check` asks (that it catches
/// `sig`, or is a handler of it). Reads `/proc` through `proc`; the pidfd is for the PID in this
/// namespace.
pub fn prepare(
    proc: &ProcFs,
    target: &TargetProcess,
    sig: Signal,
    check: Check,
) -> Result<Prepared, NotSignalled> {
    if u32::try_from(target.pid).ok() == Some(std::process::id()) {
        return Err(NotSignalled::Spotguard);
    }
    let pid = Pid::from_raw(target.pid).ok_or(NotSignalled::Gone)?;
    let pidfd = match pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(e) if e == rustix::io::Errno::SRCH => return Err(NotSignalled::Gone),
        Err(e) => {
            return Err(NotSignalled::Failed(format!(
                "pidfd_open({}): {e}",
                target.pid
            )))
        }
    };
    let failed = |e: Error| {
        if is_gone(&e) {
            NotSignalled::Gone
        } else {
            NotSignalled::Failed(e.to_string())
        }
    };
    // The pidfd now pins whatever process has this PID; if its start time is the discovered
    // one, it is the discovered process.
    let stat = proc.stat(target.pid).map_err(failed)?;
    if stat.start_time != target.start_time {
        return Err(NotSignalled::Recycled {
            expected: target.start_time,
            found: stat.start_time,
        });
    }
    if stat.exited() {
        return Err(NotSignalled::Gone);
    }
    let status = proc.status(target.pid).map_err(failed)?;
    match check {
        Check::None => {}
        Check::Caught if !status.catches(sig) => return Err(NotSignalled::NoHandler),
        Check::Caught => {}
        // The pidfd pins the process: its exe is the one checked.
        Check::Handler => match handler::judge(proc, target.pid, &status, sig) {
            Ok(()) => {}
            Err(NotHandler::NotCaught) => return Err(NotSignalled::NoHandler),
            Err(why) => return Err(NotSignalled::NotAHandler(why.to_string())),
        },
    }
    Ok(Prepared {
        pid: target.pid,
        ns_pid: status.ns_pid().unwrap_or(target.pid),
        start_time: target.start_time,
        uid: status.uid,
        gid: status.gid,
        uids: status.uids,
        pidfd,
    })
}

/// Send `sig` through the pidfd. `ESRCH` (the process exited meanwhile) is an
/// [`Error::Signal`] that [`is_gone`] recognises.
pub fn send(prepared: &Prepared, sig: Signal) -> Result<(), Error> {
    let signal = rustix_signal(sig).ok_or_else(|| Error::Signal {
        pid: prepared.pid,
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("signal {sig} cannot be sent"),
        ),
    })?;
    pidfd_send_signal(&prepared.pidfd, signal).map_err(|e| Error::Signal {
        pid: prepared.pid,
        source: e.into(),
    })
}

/// Classify a [`send`] error as [`NotSignalled`].
pub fn send_failure(err: &Error) -> NotSignalled {
    match err {
        Error::Signal { source, .. } if io_gone(source) => NotSignalled::Gone,
        other => NotSignalled::Failed(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn signal_conversion() {
        assert_eq!(
            rustix_signal(Signal::USR1),
            Some(rustix::process::Signal::USR1)
        );
        assert_eq!(
            rustix_signal(Signal::TERM),
            Some(rustix::process::Signal::TERM)
        );
        assert_eq!(rustix_signal(Signal(40)).map(|s| s.as_raw()), Some(40));
        assert_eq!(rustix_signal(Signal(32)), None);
        assert_eq!(rustix_signal(Signal(0)), None);
        assert_eq!(rustix_signal(Signal(65)), None);
    }

    #[test]
    fn never_self_and_never_a_recycled_pid() {
        let proc = ProcFs::default();
        let me = std::process::id() as i32;
        let start = proc.start_time(me).unwrap();
        let t = TargetProcess {
            pid: me,
            start_time: start,
        };
        assert_eq!(
            prepare(&proc, &t, Signal::USR1, Check::None).unwrap_err(),
            NotSignalled::Spotguard
        );

        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let start = proc.start_time(pid).unwrap();
        let wrong = TargetProcess {
            pid,
            start_time: start + 1,
        };
        assert!(matches!(
            prepare(&proc, &wrong, Signal::TERM, Check::None),
            Err(NotSignalled::Recycled { .. })
        ));
        let right = TargetProcess {
            pid,
            start_time: start,
        };
        // `sleep` has no handler for SIGUSR1
        assert_eq!(
            prepare(&proc, &right, Signal::USR1, Check::Handler).unwrap_err(),
            NotSignalled::NoHandler
        );
        let p = prepare(&proc, &right, Signal::TERM, Check::None).unwrap();
        assert_eq!(p.ns_pid, pid);
        send(&p, Signal::TERM).unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        // reaped: the pidfd still refers to the dead process, sending fails with ESRCH
        let err = send(&p, Signal::TERM).unwrap_err();
        assert_eq!(send_failure(&err), NotSignalled::Gone);
        assert!(matches!(
            prepare(&proc, &right, Signal::TERM, Check::None),
            Err(NotSignalled::Gone | NotSignalled::Recycled { .. })
        ));
    }
}
