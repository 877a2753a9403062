//! Child processes that never outlive the test binary.
//!
//! Every control-plane process (and every container the kubelet stand-in runs) is started with
//! `PR_SET_PDEATHSIG(SIGKILL)`: the kernel kills it when the thread that forked it exits. The
//! control plane is forked from one thread that lives as long as the process ([`spawn_owned`]),
//! so etcd and the API server die when the test binary exits — normally, on a panic, or killed.

use std::fs::File;
use std::io;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

type Request = (Command, mpsc::Sender<io::Result<Child>>);

/// Make `cmd` die with the thread that forks it (and with the process if that thread is the
/// spawner's). Safe to call on any `Command`.
pub fn die_with_parent(cmd: &mut Command) {
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: prctl and getppid are async-signal-safe; nothing is allocated.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent died between fork and prctl: nobody would kill us later.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        // Never joined: it lives (blocked in recv) until the process exits.
        let spawned = std::thread::Builder::new()
            .name("k8s-spawner".into())
            .spawn(move || {
                // The sender lives in a static: this loop ends only with the process.
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            });
        if let Err(e) = spawned {
            panic!("cannot start the k8s spawner thread: {e}");
        }
        Mutex::new(tx)
    })
}

/// Spawn `cmd` from the process-lifetime spawner thread, with [`die_with_parent`] applied.
pub fn spawn_owned(mut cmd: Command) -> io::Result<Child> {
    die_with_parent(&mut cmd);
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .map_err(|_| io::Error::other("k8s spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("k8s spawner thread dropped the request"))?
}

/// A free TCP port on 127.0.0.1 (bound and released: a tiny race with other processes that is
/// acceptable for tests; the caller fails clearly if the port was taken meanwhile).
pub fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One long-running control-plane process, its output in a log file.
pub struct Daemon {
    pub name: &'static str,
    pub child: Child,
    pub log: PathBuf,
}

impl Daemon {
    /// Start `program args…` with stdout and stderr appended to `<dir>/<name>.log`.
    pub fn start(
        name: &'static str,
        program: &Path,
        args: &[String],
        dir: &Path,
    ) -> Result<Daemon, String> {
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child =
            spawn_owned(cmd).map_err(|e| format!("cannot start {}: {e}", program.display()))?;
        Ok(Daemon { name, child, log })
    }

    /// `Err` with the log's tail when the process has exited.
    pub fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(format!(
                "{} exited ({status}); last lines of {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail(40)
            )),
            Err(e) => Err(format!("{}: {e}", self.name)),
        }
    }

    /// The last `n` lines of the log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
