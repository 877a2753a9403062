//! Real processes under test: [`Kid`], a child that cannot outlive its test, whether a process
//! has installed its SIGUSR1 handler yet (the agent only signals processes that catch the
//! signal, so a test waits for the trap first), and [`usr1_stamp_child`], the benches' trainer
//! that records when the signal arrived, and [`sleepers`], the benches' other processes.

use std::fmt::Display;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

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

/// A child process under test, in a process group of its own: killed with its whole group
/// (SIGKILL) and reaped when dropped, so that a failing test leaves nothing running behind it.
pub struct Kid {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl Kid {
    /// Start `cmd` with stdin from `/dev/null` in a new process group.
    pub fn spawn(cmd: Command) -> Kid {
        Kid::try_spawn(cmd).expect("spawn child")
    }

    /// [`Kid::spawn`], with the error when `cmd` cannot be started (a tool not installed).
    pub fn try_spawn(mut cmd: Command) -> std::io::Result<Kid> {
        cmd.stdin(Stdio::null());
        Kid::try_start(cmd)
    }

    /// Start `cmd` with stdin a pipe, held until [`Kid::release`] writes a line to it (a script
    /// that begins with `read x` waits there, e.g. until the test has moved it into a cgroup).
    pub fn spawn_held(mut cmd: Command) -> Kid {
        cmd.stdin(Stdio::piped());
        Kid::start(cmd)
    }

    fn start(cmd: Command) -> Kid {
        Kid::try_start(cmd).expect("spawn child")
    }

    fn try_start(mut cmd: Command) -> std::io::Result<Kid> {
        cmd.process_group(0);
        let mut child = cmd.spawn()?;
        let stdin = child.stdin.take();
        Ok(Kid { child, stdin })
    }

    /// The child's stdout, when `cmd` made it a pipe (once).
    pub fn take_stdout(&mut self) -> Option<ChildStdout> {
        self.child.stdout.take()
    }

    /// The child's stderr, when `cmd` made it a pipe (once).
    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// Let a [`Kid::spawn_held`] child go on.
    pub fn release(&mut self) {
        let mut stdin = self.stdin.take().expect("released once");
        stdin.write_all(b"go\n").expect("release child");
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Still running (not exited; a zombie counts as exited).
    pub fn running(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Send `sig` to the child itself (not its group); for a child not yet reaped (by
    /// [`Kid::wait`], or [`Kid::running`] having seen it exit).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Wait for the child to exit.
    pub fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for child")
    }

    /// Wait up to `limit` for the child to exit; `None` when it is still running then.
    pub fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Block until the child catches SIGUSR1 (its trap is installed); panics after 10 s.
    pub fn wait_for_trap(&self) {
        let start = Instant::now();
        while !catches_usr1(self.pid()) {
            assert!(start.elapsed() < Duration::from_secs(10), "no trap");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        // Only while the leader is unreaped is its pid (the group id) certainly still ours.
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) on the process group our own unreaped child leads.
            unsafe { libc::kill(-self.pid(), libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

/// `cmd` to run as `uid` (group `uid`, no supplementary groups: std clears them when it
/// changes the uid of a child of root), the way trainers run on a node.
pub fn as_user(cmd: &mut Command, uid: u32) -> &mut Command {
    cmd.uid(uid).gid(uid)
}

static RECEIVED_NS: AtomicI64 = AtomicI64::new(0);

extern "C" fn stamp_usr1(_: libc::c_int) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    RECEIVED_NS.store(ts.tv_sec * 1_000_000_000 + ts.tv_nsec, Ordering::SeqCst);
}

/// The benches' trainer (a bench binary re-run in child mode): catch SIGUSR1, say so in
/// `<out>.ready`, and when the signal comes write its receive time (ns since the epoch, taken in
/// the handler) to `out` and exit 0; exit 2 when the ready file cannot be written.
pub fn usr1_stamp_child(out: &Path) -> ! {
    // SAFETY: installing a handler that only reads the clock and stores an atomic.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = stamp_usr1 as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
    if std::fs::write(out.with_extension("ready"), b"1").is_err() {
        std::process::exit(2);
    }
    while RECEIVED_NS.load(Ordering::SeqCst) == 0 {
        // SAFETY: plain pause(2).
        unsafe { libc::pause() };
    }
    let _ = std::fs::write(out, RECEIVED_NS.load(Ordering::SeqCst).to_string());
    std::process::exit(0);
}

/// The benches' "other processes on a busy node": `n` sleeping processes (perl forks:
/// copy-on-write, little memory each) below one perl parent, in a process group of their own.
/// Dropped, the parent kills and reaps them (an orphan is reaped only by a PID 1 that reaps,
/// and some do not: 10 000 zombies would stay behind per burst), then exits; the group is
/// killed after it.
pub struct Sleepers {
    parent: Kid,
}

/// Start `n` [`Sleepers`]; returns once all `n` are forked (perl then creates `ready`). Panics
/// after 120 s.
pub fn sleepers(n: usize, ready: &Path) -> Sleepers {
    let mut cmd = Command::new("perl");
    cmd.arg("-e")
        .arg(
            "my ($n, $r) = @ARGV; my @k; for (1..$n) { my $p = fork; die \"fork: $!\" unless defined $p; \
             if (!$p) { sleep 1000000; exit 0 } push @k, $p } \
             $SIG{TERM} = sub { kill 'KILL', @k; waitpid($_, 0) for @k; exit 0 }; \
             open(my $f, '>', $r) or die; close $f; sleep 1000000 while 1",
        )
        .arg(n.to_string())
        .arg(ready);
    let parent = Kid::spawn(cmd);
    crate::wait::eventually_blocking("the sleepers", Duration::from_secs(120), || ready.exists());
    Sleepers { parent }
}

impl Sleepers {
    /// The sleeping processes' PIDs (the perl parent's children).
    pub fn pids(&self) -> Vec<i32> {
        let pid = self.parent.pid();
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }
}

impl Drop for Sleepers {
    fn drop(&mut self) {
        self.parent.signal(libc::SIGTERM);
        let _ = self.parent.wait_timeout(Duration::from_secs(60));
    }
}

/// The `p`-th percentile (0–100) of `sorted` (ascending), the nearest rank rounded; NaN when
/// empty. The benches' one percentile.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// The `setpriv` flags for the privileges the DaemonSet ships the agent with: root, every
/// capability dropped from the bounding, inheritable and ambient sets but KILL and SYS_PTRACE.
pub const SHIPPED_CAPABILITIES: [&str; 3] = [
    "--inh-caps=-all",
    "--ambient-caps=-all",
    "--bounding-set=-all,+kill,+sys_ptrace",
];

/// `bin` run as the DaemonSet runs its containers ([`SHIPPED_CAPABILITIES`]); add its arguments
/// to the command. `setpriv` execs `bin`: the child's pid is the program's.
pub fn shipped_command(bin: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args(SHIPPED_CAPABILITIES).arg("--").arg(bin);
    cmd
}

/// Run `f` on a thread holding only the DaemonSet agent's capabilities (KILL, SYS_PTRACE):
/// capabilities are per thread, so the rest of the test process keeps its own. What a test of
/// the agent's file access runs in-process, as `setpriv --bounding-set=-all,+kill,+sys_ptrace`
/// runs the agent binary.
pub fn with_shipped_capabilities<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    use rustix::thread::{set_capabilities, CapabilitySet, CapabilitySets};
    std::thread::spawn(move || {
        let keep = CapabilitySet::KILL | CapabilitySet::SYS_PTRACE;
        set_capabilities(
            None,
            CapabilitySets {
                effective: keep,
                permitted: keep,
                inheritable: CapabilitySet::empty(),
            },
        )
        .expect("drop capabilities");
        f()
    })
    .join()
    .expect("the capability-dropped thread panicked")
}
