//! Checkpoint protocol v1 (docs/checkpoint-protocol.md): find the training processes that asked to be told, write
//! `notice.json` into their checkpoint dir, signal the ones that catch the signal (through a pidfd,
//! after re-checking the start time), and wait for their acks within the budget.
//!
//! Discovery is a seam ([`TargetDiscovery`]): host mode selects by systemd unit, pidfile or
//! cmdline ([`discover`]); Kubernetes mode ([`kube_discovery`]) keeps a watch-fed cache of the
//! opted-in pods on this node and maps their containers to host PIDs through `/proc/*/cgroup`.
//! Dependencies point one way: checkpoint uses `node` (the pod reference, Events on pods), never
//! the reverse.

pub mod ack;
pub mod cgroup;
pub mod child;
pub mod discover;
pub mod handler;
pub mod kube_discovery;
pub mod podfs;
pub mod pods;
pub mod probe;
pub mod procfs;
pub mod protocol;
pub mod root;
pub mod run;
pub mod signal;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;

pub use crate::node::PodRef;

/// Which processes of a target get the signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TargetMode {
    /// Every handler ([`handler::judge`]): a process whose `SigCgt` has the signal and whose
    /// `SigIgn` does not, unless it is a shell that catches every terminating signal (an `EXIT`
    /// trap) or a launcher.
    #[default]
    Handlers,
    /// Every process whose `SigCgt` has the signal and whose `SigIgn` does not, shells and
    /// launchers included (the operator knows they handle it).
    Caught,
    /// The container's init process (for launchers that forward signals).
    Pid1,
    /// Every process.
    All,
}

impl std::str::FromStr for TargetMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "handlers" => Ok(TargetMode::Handlers),
            "caught" => Ok(TargetMode::Caught),
            "pid1" => Ok(TargetMode::Pid1),
            "all" => Ok(TargetMode::All),
            other => Err(format!(
                "unknown checkpoint target {other:?} (expected handlers, caught, pid1 or all)"
            )),
        }
    }
}

/// A signal by number, parsed from names like `SIGUSR1`, `USR1` or `10`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Signal(pub i32);

impl Signal {
    pub const USR1: Signal = Signal(libc::SIGUSR1);
    pub const USR2: Signal = Signal(libc::SIGUSR2);
    pub const TERM: Signal = Signal(libc::SIGTERM);

    const NAMES: &'static [(&'static str, i32)] = &[
        ("SIGHUP", libc::SIGHUP),
        ("SIGINT", libc::SIGINT),
        ("SIGQUIT", libc::SIGQUIT),
        ("SIGUSR1", libc::SIGUSR1),
        ("SIGUSR2", libc::SIGUSR2),
        ("SIGTERM", libc::SIGTERM),
        ("SIGCONT", libc::SIGCONT),
        ("SIGWINCH", libc::SIGWINCH),
        ("SIGPWR", libc::SIGPWR),
    ];

    /// What `--checkpoint-signal` takes, in words.
    fn allowed() -> String {
        let names: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
        format!(
            "use one the trainer catches: {}, or a number 1-64 other than 9 (SIGKILL), 19 (SIGSTOP), 32 and 33",
            names.join(", ")
        )
    }

    pub fn name(self) -> String {
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == self.0)
            .map(|(s, _)| (*s).to_string())
            .unwrap_or_else(|| format!("SIG{}", self.0))
    }
}

impl std::str::FromStr for Signal {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_uppercase();
        if let Ok(n) = t.parse::<i32>() {
            if n == 32 || n == 33 {
                return Err(format!(
                    "signal number {n} is reserved by the C library (NPTL) and cannot be sent; real-time signals start at 34"
                ));
            }
            if (1..=64).contains(&n) && n != libc::SIGKILL && n != libc::SIGSTOP {
                return Ok(Signal(n));
            }
            if n == libc::SIGKILL || n == libc::SIGSTOP {
                return Err(format!(
                    "signal number {n} ({}) cannot be caught, so no trainer could save on it: {}",
                    if n == libc::SIGKILL {
                        "SIGKILL"
                    } else {
                        "SIGSTOP"
                    },
                    Self::allowed()
                ));
            }
            return Err(format!(
                "signal number {n} is not a signal: {}",
                Self::allowed()
            ));
        }
        let full = if t.starts_with("SIG") {
            t
        } else {
            format!("SIG{t}")
        };
        Self::NAMES
            .iter()
            .find(|(name, _)| *name == full)
            .map(|(_, n)| Signal(*n))
            .ok_or_else(|| match full.as_str() {
                "SIGKILL" | "SIGSTOP" => format!(
                    "{full} cannot be caught, so no trainer could save on it: {}",
                    Self::allowed()
                ),
                _ => format!("unknown signal {s:?}: {}", Self::allowed()),
            })
    }
}

impl std::fmt::Display for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A process found by discovery (host PID namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetProcess {
    pub pid: i32,
    /// Start time in clock ticks since boot (`/proc/<pid>/stat` field 22): re-checked before
    /// signalling so that a recycled PID is never hit.
    pub start_time: u64,
}

/// One container (or, in host mode, one selector's process set) sharing a filesystem root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetContainer {
    /// Container name (Kubernetes) or selector description (host).
    pub name: String,
    /// When set, the checkpoint dir is resolved inside `/proc/<root_pid>/root` with
    /// `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`; `None` means a host path.
    pub root_pid: Option<i32>,
    /// The container's init process (host PID), for `TargetMode::Pid1`.
    pub init_pid: Option<i32>,
    pub processes: Vec<TargetProcess>,
}

/// Everything that is checkpointed together and gets one outcome: a pod, or a host selector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetGroup {
    /// `namespace/name` for pods, `unit:NAME` / `pidfile:PATH` / `cmdline:REGEX` on hosts.
    pub name: String,
    pub pod: Option<PodRef>,
    pub containers: Vec<TargetContainer>,
    pub mode: TargetMode,
    pub signal: Signal,
    /// Checkpoint dir as the processes see it (inside the container for pods).
    pub dir: PathBuf,
    /// Per-group bound on waiting (annotation `spotguard.io/checkpoint-timeout` or the default).
    pub timeout: Duration,
    /// The proc mount the PIDs above belong to (`--proc-root`, `/proc` by default): delivery and
    /// the wait read it, and resolve container roots through `<proc_root>/<pid>/root`.
    pub proc_root: PathBuf,
}

/// Outcome of checkpointing one group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Acked,
    Skipped,
    Failed,
    Exited,
    Timeout,
    NoHandler,
    Error,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Acked => "acked",
            Outcome::Skipped => "skipped",
            Outcome::Failed => "failed",
            Outcome::Exited => "exited",
            Outcome::Timeout => "timeout",
            Outcome::NoHandler => "no_handler",
            Outcome::Error => "error",
        }
    }

    pub const ALL: [Outcome; 7] = [
        Outcome::Acked,
        Outcome::Skipped,
        Outcome::Failed,
        Outcome::Exited,
        Outcome::Timeout,
        Outcome::NoHandler,
        Outcome::Error,
    ];
}

/// Finds checkpoint targets. Host mode: `--checkpoint-unit/-pidfile/-cmdline`. Kubernetes: opted-in
/// pods on this node.
#[async_trait]
pub trait TargetDiscovery: Send + Sync {
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error>;
}

#[async_trait]
impl<T: TargetDiscovery + ?Sized> TargetDiscovery for std::sync::Arc<T> {
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error> {
        (**self).discover().await
    }
}

/// Run blocking checkpoint work on a thread of its own and await it (never tokio's blocking pool,
/// which prefetch I/O can fill). `Err` when no thread could be started or it panicked.
pub async fn run_on_thread<T, F>(name: &str, f: F) -> std::io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    rx.await
        .map_err(|_| std::io::Error::other(format!("thread {name} panicked")))
}

/// Errors of the checkpoint module.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading {path}: {source}")]
    Proc {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading pidfile {path}: {reason}")]
    Pidfile { path: String, reason: String },
    #[error("listing pods on this node: {0}")]
    ListPods(String),
    #[error("pod {pod}: annotation {annotation}: {reason}")]
    Annotation {
        pod: String,
        annotation: &'static str,
        reason: String,
    },
    #[error("writing {file} for {target}: {source}")]
    WriteNotice {
        target: String,
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("signalling pid {pid}: {source}")]
    Signal {
        pid: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("reading acks for {target}: {source}")]
    ReadAck {
        target: String,
        #[source]
        source: std::io::Error,
    },
    /// A file at an ack (or notice) name that is not protocol input: linked from elsewhere (more
    /// than one hard link) or writable by every user. Never read, never counted.
    #[error(
        "{target}: {reason} (refused: an ack is a file of its own that only its writer can write)"
    )]
    RefusedAck {
        target: String,
        reason: String,
        /// The file's inode: a refusal is logged and counted once per file.
        ino: u64,
    },
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Error::ListPods(_) | Error::Proc { .. })
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Proc { .. } => "proc",
            Error::Pidfile { .. } => "pidfile",
            Error::ListPods(_) => "list_pods",
            Error::Annotation { .. } => "annotation",
            Error::WriteNotice { .. } => "write_notice",
            Error::Signal { .. } => "signal",
            Error::ReadAck { .. } => "read_ack",
            Error::RefusedAck { .. } => "refused_ack",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_and_nptl_signals_are_refused() {
        assert_eq!("usr1".parse::<Signal>(), Ok(Signal::USR1));
        assert_eq!("SIGTERM".parse::<Signal>(), Ok(Signal::TERM));
        assert_eq!("34".parse::<Signal>(), Ok(Signal(34)));
        for n in ["32", "33"] {
            let e = n.parse::<Signal>().unwrap_err();
            assert!(e.contains("reserved by the C library"), "{e}");
        }
        assert!("9".parse::<Signal>().is_err());
        assert!("65".parse::<Signal>().is_err());
    }
}
