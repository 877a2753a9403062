//! Waiting for the training program: the drill raises its notice only after some process in the
//! command's tree is a handler of the checkpoint signal (what the agent's `handlers` mode checks:
//! `SigCgt` has it, `SigIgn` does not, and it is not a shell catching everything for an `EXIT` trap
//! nor a launcher, see `checkpoint::handler`), so a slow start-up (`import torch`, torchrun
//! spawning workers) is never mistaken for a missing handler, and a launcher script's `EXIT` trap is
//! not taken for one.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use crate::checkpoint::procfs::ProcFs;
use crate::checkpoint::Signal;

/// The first process of the command's tree seen catching the signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handler {
    pub pid: i32,
    /// Its command line, shortened for the verdict table.
    pub command: String,
}

/// What the start-up wait found.
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerWait {
    /// `--after-start`: the notice was timed from the command's start, no handler wait.
    NotWaited,
    /// A process caught the signal `waited` after the command started.
    Found { handler: Handler, waited: Duration },
    /// Nothing caught it within the start-up wait.
    NotFound { waited: Duration },
}

/// The pids of `root` and all its descendants, from one scan of `/proc`.
pub fn tree(proc: &ProcFs, root: i32) -> Vec<i32> {
    let Ok(pids) = proc.pids() else {
        return vec![root];
    };
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for pid in pids {
        if let Ok(st) = proc.stat(pid) {
            children.entry(st.ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        if !seen.insert(pid) {
            continue;
        }
        out.push(pid);
        if let Some(c) = children.get(&pid) {
            todo.extend(c.iter().copied());
        }
    }
    out
}

/// The first process of `root`'s tree (root first) that is a handler of `sig`.
pub fn find_handler(proc: &ProcFs, root: i32, sig: Signal) -> Option<Handler> {
    let mut pids = tree(proc, root);
    pids.sort_unstable();
    // The root first, then the others in pid order (roughly start order).
    if let Some(i) = pids.iter().position(|p| *p == root) {
        pids.swap(0, i);
    }
    pids.into_iter().find_map(|pid| {
        let status = proc.status(pid).ok()?;
        crate::checkpoint::handler::judge(proc, pid, &status, sig).ok()?;
        let argv = proc.cmdline(pid).unwrap_or_default();
        let command = if argv.is_empty() {
            status.name.clone()
        } else {
            shorten(&argv.join(" "), 80)
        };
        Some(Handler { pid, command })
    })
}

/// Whether `pid` still runs (exists and is not a zombie).
pub fn alive(proc: &ProcFs, pid: i32) -> bool {
    proc.stat(pid)
        .is_ok_and(|st| st.state != 'Z' && st.state != 'X')
}

/// Whether some process of `pids` holds a listening TCP socket (e.g. torchrun's agent hosting
/// the c10d rendezvous store): its socket inodes, matched against /proc/net/tcp and tcp6.
pub fn listens(proc_root: &Path, pids: &[i32]) -> bool {
    let mut inodes = HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(proc_root.join(pid.to_string()).join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let t = target.to_string_lossy();
                if let Some(n) = t.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    if let Ok(n) = n.parse::<u64>() {
                        inodes.insert(n);
                    }
                }
            }
        }
    }
    if inodes.is_empty() {
        return false;
    }
    ["net/tcp", "net/tcp6"].iter().any(|table| {
        let Ok(text) = std::fs::read_to_string(proc_root.join(table)) else {
            return false;
        };
        text.lines().skip(1).any(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            f.len() > 9 && f[3] == "0A" && f[9].parse::<u64>().is_ok_and(|i| inodes.contains(&i))
        })
    })
}

/// `text` cut to at most `max` characters, with an ellipsis when cut.
pub fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
    s.push('…');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// The SIGUSR1 handler in `root`'s tree, once one shows (within a minute).
    fn handler_in_tree(proc: &ProcFs, root: i32) -> Handler {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(h) = find_handler(proc, root, Signal::USR1) {
                return h;
            }
            assert!(std::time::Instant::now() < deadline, "no handler found");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn finds_a_handler_in_a_grandchild_and_not_in_a_plain_shell() {
        let proc = ProcFs::new("/proc");
        // sh (no handler) -> python catching SIGUSR1.
        let mut child = Command::new("sh")
            .arg("-c")
            .arg("python3 -c 'import signal,time; signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(30)'; true")
            .spawn()
            .expect("spawn sh");
        let root = child.id() as i32;
        let found = handler_in_tree(&proc, root);
        assert_ne!(found.pid, root, "the shell does not catch SIGUSR1");
        assert!(found.command.contains("-c import signal"), "{found:?}");
        assert!(!proc.status(root).unwrap().catches(Signal::USR1));
        assert!(tree(&proc, root).contains(&found.pid));
        let _ = child.kill();
        // SAFETY: kill(2) of the grandchild we found (still ours to clean up).
        unsafe { libc::kill(found.pid, libc::SIGKILL) };
        let _ = child.wait();
    }

    #[test]
    fn a_launcher_script_with_an_exit_trap_is_not_taken_for_the_handler() {
        let proc = ProcFs::new("/proc");
        // bash catches SIGUSR1 for its EXIT trap (and would die of it); its python child handles it.
        let mut child = Command::new("bash")
            .arg("-c")
            .arg("trap 'true' EXIT; python3 -c 'import signal,time; signal.signal(signal.SIGUSR1, lambda *a: None); time.sleep(30)'; true")
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn bash");
        let root = child.id() as i32;
        let found = handler_in_tree(&proc, root);
        assert!(proc.status(root).unwrap().catches(Signal::USR1));
        assert_ne!(found.pid, root, "bash with an EXIT trap is no handler");
        assert!(found.command.contains("-c import signal"), "{found:?}");
        let _ = child.kill();
        // SAFETY: kill(2) of the grandchild we found (still ours to clean up).
        unsafe { libc::kill(found.pid, libc::SIGKILL) };
        let _ = child.wait();
    }

    #[test]
    fn shorten_cuts_with_an_ellipsis() {
        assert_eq!(shorten("abc", 3), "abc");
        assert_eq!(shorten("abcdef", 4), "abc…");
    }
}
