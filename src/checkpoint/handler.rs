//! What counts as a checkpoint handler in the `handlers` target mode (docs/checkpoint-protocol.md,
//! "Discovery: which processes"). `SigCgt` alone is not evidence that a process checkpoints:
//!
//! - a process that does not catch the signal (`SigCgt` lacks it, or `SigIgn` has it) is never a
//!   handler: the signal's default action would kill it;
//! - a **known shell** (bash, sh, dash, zsh, ksh, ash, busybox, fish, …) counts only when it
//!   catches the signal *selectively*: bash (also ksh and zsh) set handlers for every terminating
//!   signal as soon as any `EXIT` trap is set, only to run that trap and die of the signal. So a
//!   shell that also catches a signal no script traps (SIGILL, SIGTRAP, SIGBUS, SIGFPE, SIGSEGV,
//!   SIGXCPU, SIGXFSZ, SIGSYS: [`CATCH_ALL`]) is never signalled; a shell that traps the signal by
//!   name (`trap save USR1`) catches it and nothing of that set, and is;
//! - a **known launcher** ([`LAUNCHERS`]: tini, dumb-init, catatonit, mpirun, srun, uv, …) is never
//!   a handler: it forwards what it catches to its children, which are signalled themselves, so
//!   signalling it too would deliver the signal twice (`pid1` is the mode for a launcher that
//!   should forward).
//!
//! Shells and launchers are told by their executable, the file name of `/proc/PID/exe`'s target
//! (set by `execve`; `comm`, which any process can set with `PR_SET_NAME`, is only the fallback when
//! the link cannot be read). The operator says otherwise with the `caught` mode (every process that
//! catches the signal, shells and launchers included).

use super::procfs::{ProcFs, ProcStatus};
use super::{Signal, TargetMode};

/// What a target mode asks of a process before it is signalled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Nothing (`pid1`, `all`: the operator named the processes).
    None,
    /// It catches the signal (`caught`).
    Caught,
    /// It is a handler ([`judge`]; `handlers`).
    Handler,
}

impl Check {
    pub fn of(mode: TargetMode) -> Check {
        match mode {
            TargetMode::Handlers => Check::Handler,
            TargetMode::Caught => Check::Caught,
            TargetMode::Pid1 | TargetMode::All => Check::None,
        }
    }
}

/// Executables that are shells (by file name).
pub const SHELLS: &[&str] = &[
    "sh", "bash", "rbash", "dash", "ash", "busybox", "zsh", "ksh", "ksh93", "mksh", "pdksh",
    "oksh", "lksh", "yash", "posh", "fish", "tcsh", "csh", "nu", "elvish", "xonsh",
];

/// Executables that are init launchers that forward signals (by file name).
pub const LAUNCHERS: &[&str] = &[
    "tini",
    "tini-static",
    "dumb-init",
    "catatonit",
    "mpirun",
    "mpiexec",
    "mpiexec.hydra",
    "orterun",
    "prterun",
    "srun",
    "uv",
];

/// Signals no script traps, which bash, ksh and zsh catch when an `EXIT` trap is set.
pub const CATCH_ALL: &[i32] = &[
    libc::SIGILL,
    libc::SIGTRAP,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGSEGV,
    libc::SIGXCPU,
    libc::SIGXFSZ,
    libc::SIGSYS,
];

/// Why a process is not a handler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotHandler {
    /// It does not catch the signal (or ignores it).
    NotCaught,
    /// A shell that catches every terminating signal (an `EXIT` trap): the signal would kill it.
    ShellCatchAll { exe: String },
    /// A launcher that forwards the signals it catches.
    Launcher { exe: String },
}

impl std::fmt::Display for NotHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotHandler::NotCaught => f.write_str("does not catch the signal"),
            NotHandler::ShellCatchAll { exe } => write!(
                f,
                "{exe} is a shell that catches every terminating signal (an EXIT trap): it would run the trap and die of the signal"
            ),
            NotHandler::Launcher { exe } => write!(
                f,
                "{exe} is a launcher that forwards signals to its children"
            ),
        }
    }
}

/// Whether `status` (of `pid`, read through `proc`) is a handler of `sig`: it catches it and is
/// neither a shell catching everything nor a launcher. Reads `/proc/<pid>/exe` only for a process
/// that catches the signal.
pub fn judge(proc: &ProcFs, pid: i32, status: &ProcStatus, sig: Signal) -> Result<(), NotHandler> {
    if !status.catches(sig) {
        return Err(NotHandler::NotCaught);
    }
    let exe = exe_name(proc, pid).unwrap_or_else(|| status.name.clone());
    judge_exe(&exe, status)
}

/// [`judge`] for a process known to catch the signal, whose executable is named `exe`.
pub fn judge_exe(exe: &str, status: &ProcStatus) -> Result<(), NotHandler> {
    if LAUNCHERS.contains(&exe) {
        return Err(NotHandler::Launcher { exe: exe.into() });
    }
    if SHELLS.contains(&exe) && CATCH_ALL.iter().any(|s| status.catches(Signal(*s))) {
        return Err(NotHandler::ShellCatchAll { exe: exe.into() });
    }
    Ok(())
}

/// The file name of the executable `pid` runs (`/proc/<pid>/exe`'s target, without the kernel's
/// ` (deleted)` suffix); `None` when the link cannot be read (the process is gone, a kernel
/// thread, no right to read it).
pub fn exe_name(proc: &ProcFs, pid: i32) -> Option<String> {
    let target = std::fs::read_link(proc.path(pid, "exe")).ok()?;
    let text = target.to_string_lossy();
    let text = text.strip_suffix(" (deleted)").unwrap_or(&text);
    let name = text.rsplit('/').next().unwrap_or(text);
    (!name.is_empty()).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::procfs::parse_status;
    use std::path::Path;

    fn status(cgt: &str) -> ProcStatus {
        let text = format!(
            "Name:\tbash\nPPid:\t1\nUid:\t0 0 0 0\nGid:\t0 0 0 0\nSigIgn:\t0000000000000006\nSigCgt:\t{cgt}\n"
        );
        parse_status(&text, Path::new("/proc/1/status")).unwrap()
    }

    /// Masks read off real processes (`bash -c '…; sleep 5 & wait'`).
    const BASH_TRAP_USR1: &str = "0000000000010200";
    const BASH_TRAP_EXIT: &str = "0000000043817ef9";

    #[test]
    fn a_shell_that_traps_the_signal_by_name_is_a_handler_one_with_an_exit_trap_is_not() {
        let usr1 = Signal::USR1;
        assert!(status(BASH_TRAP_USR1).catches(usr1));
        assert_eq!(judge_exe("bash", &status(BASH_TRAP_USR1)), Ok(()));
        assert_eq!(judge_exe("dash", &status(BASH_TRAP_USR1)), Ok(()));
        assert!(status(BASH_TRAP_EXIT).catches(usr1));
        for sh in ["bash", "sh", "zsh", "busybox"] {
            assert_eq!(
                judge_exe(sh, &status(BASH_TRAP_EXIT)),
                Err(NotHandler::ShellCatchAll { exe: sh.into() }),
                "{sh}"
            );
        }
        // Not a shell: its own masks are its business (faulthandler catches SIGSEGV and more).
        assert_eq!(judge_exe("python3.12", &status(BASH_TRAP_EXIT)), Ok(()));
        assert_eq!(
            judge_exe("tini", &status(BASH_TRAP_USR1)),
            Err(NotHandler::Launcher { exe: "tini".into() })
        );
    }

    #[test]
    fn the_executable_is_read_from_the_exe_link_not_comm() {
        let proc = ProcFs::default();
        let me = std::process::id() as i32;
        let mine = exe_name(&proc, me).unwrap();
        let path = std::env::current_exe().unwrap();
        assert_eq!(mine, path.file_name().unwrap().to_string_lossy());
        assert_eq!(exe_name(&proc, i32::MAX), None);
    }
}
