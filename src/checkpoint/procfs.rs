//! Reading `/proc/<pid>/{status,stat,cmdline,cgroup}` with a configurable proc root (tests point it
//! at a fake tree). Parsers are pure functions over the file text; nothing here panics on odd
//! content: every malformed file is an [`Error::Proc`] naming the path, with kind `InvalidData`.
//!
//! A process that disappears between listing and reading is normal: its reads fail with kind
//! `NotFound` (or `ESRCH`), which [`is_gone`] recognises.

use std::io;
use std::path::{Path, PathBuf};

use super::{Error, Signal};

/// Default mount point of procfs.
pub const PROC_ROOT: &str = "/proc";

/// The fields of `/proc/<pid>/status` the checkpoint protocol needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStatus {
    /// `Name:` (the comm, possibly escaped by the kernel).
    pub name: String,
    /// `PPid:`, 0 for processes whose parent is outside this PID namespace.
    pub ppid: i32,
    /// `SigCgt:` mask of caught signals (bit `n-1` for signal `n`).
    pub sig_cgt: u64,
    /// `SigIgn:` mask of ignored signals.
    pub sig_ign: u64,
    /// `NSpid:` the PID in each nested PID namespace, outermost (the reader's) first. Empty on
    /// kernels older than 4.1.
    pub nspid: Vec<i32>,
    /// Real user id (`Uid:` first field).
    pub uid: u32,
    /// Every distinct user id of the process (`Uid:` real, effective, saved, filesystem): the
    /// owner of a file it creates is its filesystem uid.
    pub uids: Vec<u32>,
    /// Real group id (`Gid:` first field).
    pub gid: u32,
    /// `Tgid:`, the thread group (process) id: differs from the PID read for a thread's id.
    pub tgid: Option<i32>,
}

impl ProcStatus {
    /// True when the process has a handler for `sig` and does not ignore it.
    pub fn catches(&self, sig: Signal) -> bool {
        let Some(bit) = signal_bit(sig) else {
            return false;
        };
        self.sig_cgt & bit != 0 && self.sig_ign & bit == 0
    }

    /// The PID as the process itself sees it (last `NSpid` field), if the kernel reports it.
    pub fn ns_pid(&self) -> Option<i32> {
        self.nspid.last().copied()
    }
}

fn signal_bit(sig: Signal) -> Option<u64> {
    match sig.0 {
        n @ 1..=64 => Some(1u64 << (n - 1)),
        _ => None,
    }
}

/// The fields of `/proc/<pid>/stat` the checkpoint protocol needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    /// Field 2 without the parentheses; may contain spaces and parentheses itself.
    pub comm: String,
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), …
    pub state: char,
    /// Field 4.
    pub ppid: i32,
    /// Field 22: start time in clock ticks since boot.
    pub start_time: u64,
}

impl ProcStat {
    /// A zombie or dead process has exited, even while its `/proc` entry still exists.
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

fn invalid(path: &Path, reason: impl Into<String>) -> Error {
    Error::Proc {
        path: path.display().to_string(),
        source: io::Error::new(io::ErrorKind::InvalidData, reason.into()),
    }
}

/// Parse the text of `/proc/<pid>/status`. `path` only names the file in errors.
pub fn parse_status(text: &str, path: &Path) -> Result<ProcStatus, Error> {
    let mut name = None;
    let mut ppid = None;
    let mut sig_cgt = None;
    let mut sig_ign = None;
    let mut nspid = Vec::new();
    let mut uid = None;
    let mut uids = Vec::new();
    let mut gid = None;
    let mut tgid = None;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key {
            "Name" => name = Some(value.to_string()),
            "PPid" => {
                ppid = Some(
                    value
                        .parse::<i32>()
                        .map_err(|e| invalid(path, format!("PPid {value:?}: {e}")))?,
                )
            }
            "SigCgt" => {
                sig_cgt = Some(
                    parse_mask(value).ok_or_else(|| invalid(path, format!("SigCgt {value:?}")))?,
                )
            }
            "SigIgn" => {
                sig_ign = Some(
                    parse_mask(value).ok_or_else(|| invalid(path, format!("SigIgn {value:?}")))?,
                )
            }
            "NSpid" => {
                nspid = value
                    .split_whitespace()
                    .map(|p| p.parse::<i32>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| invalid(path, format!("NSpid {value:?}: {e}")))?
            }
            "Uid" => {
                uid = Some(first_id(value).ok_or_else(|| invalid(path, format!("Uid {value:?}")))?);
                for id in value
                    .split_whitespace()
                    .filter_map(|v| v.parse::<u32>().ok())
                {
                    if !uids.contains(&id) {
                        uids.push(id);
                    }
                }
            }
            "Tgid" => tgid = value.parse::<i32>().ok(),
            "Gid" => {
                gid = Some(first_id(value).ok_or_else(|| invalid(path, format!("Gid {value:?}")))?)
            }
            _ => {}
        }
    }
    let missing = |field: &str| invalid(path, format!("no {field} line"));
    Ok(ProcStatus {
        name: name.ok_or_else(|| missing("Name"))?,
        ppid: ppid.ok_or_else(|| missing("PPid"))?,
        sig_cgt: sig_cgt.ok_or_else(|| missing("SigCgt"))?,
        sig_ign: sig_ign.ok_or_else(|| missing("SigIgn"))?,
        nspid,
        uid: uid.ok_or_else(|| missing("Uid"))?,
        uids,
        gid: gid.ok_or_else(|| missing("Gid"))?,
        tgid,
    })
}

fn parse_mask(value: &str) -> Option<u64> {
    if value.is_empty() || value.len() > 16 {
        return None;
    }
    u64::from_str_radix(value, 16).ok()
}

fn first_id(value: &str) -> Option<u32> {
    value.split_whitespace().next()?.parse().ok()
}

/// Parse the text of `/proc/<pid>/stat`. The comm (field 2) may contain spaces and parentheses,
/// so the fields after it are found from the *last* `)`.
pub fn parse_stat(text: &str, path: &Path) -> Result<ProcStat, Error> {
    let open = text
        .find(" (")
        .ok_or_else(|| invalid(path, "no \" (\" before the comm"))?;
    let close = text
        .rfind(')')
        .filter(|c| *c > open)
        .ok_or_else(|| invalid(path, "no \")\" after the comm"))?;
    let pid = text[..open]
        .trim()
        .parse::<i32>()
        .map_err(|e| invalid(path, format!("pid field: {e}")))?;
    let comm = text[open + 2..close].to_string();
    // Fields 3.. follow the comm; index 0 here is field 3.
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let field = |n: usize| -> Result<&str, Error> {
        rest.get(n - 3).copied().ok_or_else(|| {
            invalid(
                path,
                format!("only {} fields, need field {n}", rest.len() + 2),
            )
        })
    };
    let state = field(3)?
        .chars()
        .next()
        .ok_or_else(|| invalid(path, "empty state field"))?;
    let ppid = field(4)?
        .parse::<i32>()
        .map_err(|e| invalid(path, format!("ppid field: {e}")))?;
    let start_time = field(22)?
        .parse::<u64>()
        .map_err(|e| invalid(path, format!("starttime field: {e}")))?;
    Ok(ProcStat {
        pid,
        comm,
        state,
        ppid,
        start_time,
    })
}

/// Split the NUL-separated `/proc/<pid>/cmdline` into arguments (lossy UTF-8). Kernel threads have
/// an empty cmdline and yield no arguments.
pub fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    let bytes = bytes.strip_suffix(b"\0").unwrap_or(bytes);
    if bytes.is_empty() {
        return Vec::new();
    }
    bytes
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// True when `err` means the process no longer exists (its `/proc` entry vanished).
pub fn is_gone(err: &Error) -> bool {
    match err {
        Error::Proc { source, .. } => io_gone(source),
        Error::Signal { source, .. } => io_gone(source),
        _ => false,
    }
}

pub(crate) fn io_gone(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::NotFound || err.raw_os_error() == Some(libc::ESRCH)
}

/// A procfs mount, `/proc` by default.
#[derive(Clone, Debug)]
pub struct ProcFs {
    root: PathBuf,
}

impl Default for ProcFs {
    fn default() -> Self {
        ProcFs::new(PROC_ROOT)
    }
}

impl ProcFs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ProcFs { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/<pid>/<file>`.
    pub fn path(&self, pid: i32, file: &str) -> PathBuf {
        self.root.join(pid.to_string()).join(file)
    }

    fn read(&self, pid: i32, file: &str) -> Result<(PathBuf, Vec<u8>), Error> {
        let path = self.path(pid, file);
        match std::fs::read(&path) {
            Ok(bytes) => Ok((path, bytes)),
            Err(source) => Err(Error::Proc {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    fn read_text(&self, pid: i32, file: &str) -> Result<(PathBuf, String), Error> {
        let (path, bytes) = self.read(pid, file)?;
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok((path, text))
    }

    /// Every numeric entry of the proc root (processes, not threads).
    pub fn pids(&self) -> Result<Vec<i32>, Error> {
        let entries = std::fs::read_dir(&self.root).map_err(|source| Error::Proc {
            path: self.root.display().to_string(),
            source,
        })?;
        let mut pids = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|source| Error::Proc {
                path: self.root.display().to_string(),
                source,
            })?;
            if let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
                .filter(|p| *p > 0)
            {
                pids.push(pid);
            }
        }
        pids.sort_unstable();
        Ok(pids)
    }

    pub fn status(&self, pid: i32) -> Result<ProcStatus, Error> {
        let (path, text) = self.read_text(pid, "status")?;
        parse_status(&text, &path)
    }

    pub fn stat(&self, pid: i32) -> Result<ProcStat, Error> {
        let (path, text) = self.read_text(pid, "stat")?;
        parse_stat(&text, &path)
    }

    /// Start time in clock ticks since boot (`stat` field 22).
    pub fn start_time(&self, pid: i32) -> Result<u64, Error> {
        Ok(self.stat(pid)?.start_time)
    }

    pub fn cmdline(&self, pid: i32) -> Result<Vec<String>, Error> {
        let (_, bytes) = self.read(pid, "cmdline")?;
        Ok(parse_cmdline(&bytes))
    }

    /// The raw text of `/proc/<pid>/cgroup` (parse lines with [`super::cgroup::parse_line`]).
    pub fn cgroup(&self, pid: i32) -> Result<String, Error> {
        Ok(self.read_text(pid, "cgroup")?.1)
    }

    /// Whether the process that had `start_time` is still running: `false` when its entry is gone,
    /// the PID now belongs to another process, or it is a zombie.
    pub fn alive(&self, pid: i32, start_time: u64) -> Result<bool, Error> {
        match self.stat(pid) {
            Ok(stat) => Ok(stat.start_time == start_time && !stat.exited()),
            Err(e) if is_gone(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Boot time as a Unix time in seconds (`btime` in `<root>/stat`).
    /// The last PID the kernel allocated in this PID namespace (`loadavg`'s last field): every
    /// process or thread created since an earlier reading has a PID after that reading, up to
    /// `pid_max` where the numbering wraps.
    pub fn last_pid(&self) -> Result<i32, Error> {
        let path = self.root.join("loadavg");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Proc {
            path: path.display().to_string(),
            source,
        })?;
        text.split_whitespace()
            .nth(4)
            .and_then(|v| v.parse::<i32>().ok())
            .ok_or_else(|| invalid(&path, format!("no last pid in {:?}", text.trim())))
    }

    /// `kernel.pid_max`: PIDs wrap to low numbers after it.
    pub fn pid_max(&self) -> Result<i32, Error> {
        let path = self.root.join("sys/kernel/pid_max");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Proc {
            path: path.display().to_string(),
            source,
        })?;
        text.trim()
            .parse::<i32>()
            .map_err(|e| invalid(&path, format!("{:?}: {e}", text.trim())))
    }

    pub fn boot_time(&self) -> Result<i64, Error> {
        let path = self.root.join("stat");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Proc {
            path: path.display().to_string(),
            source,
        })?;
        text.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<i64>().ok())
            .ok_or_else(|| invalid(&path, "no btime line"))
    }
}

/// Clock ticks per second for `stat` times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions; it only reads a constant of the C library.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|t| *t > 0).unwrap_or(100)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4242\nPPid:\t4200\nTracerPid:\t0\nUid:\t1000\t1000\t1000\t1000\nGid:\t100\t100\t100\t100\nNSpid:\t4242\t17\nSigQ:\t0/63408\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\nSigIgn:\t0000000001001000\nSigCgt:\t0000000180004202\n";

    #[test]
    fn status_fields_and_signal_bits() {
        let s = parse_status(STATUS, Path::new("/proc/4242/status")).unwrap();
        assert_eq!(s.name, "python3");
        assert_eq!(s.ppid, 4200);
        assert_eq!(s.nspid, vec![4242, 17]);
        assert_eq!(s.ns_pid(), Some(17));
        assert_eq!((s.uid, s.gid), (1000, 100));
        // 0x4202: bits 1 (SIGINT), 9 (SIGUSR1), 14 (SIGTERM); ignored 0x1001000: SIGPIPE, SIGXFSZ.
        assert!(s.catches(Signal::USR1));
        assert!(s.catches(Signal(libc::SIGINT)));
        assert!(s.catches(Signal::TERM));
        assert!(!s.catches(Signal::USR2));
        assert!(!s.catches(Signal(libc::SIGPIPE)));
        assert!(s.catches(Signal(33)));
        assert!(!s.catches(Signal(0)));
        assert!(!s.catches(Signal(65)));
    }

    #[test]
    fn caught_but_ignored_does_not_count() {
        let text = STATUS
            .replace("SigIgn:\t0000000001001000", "SigIgn:\t0000000000000200")
            .replace("SigCgt:\t0000000180004202", "SigCgt:\t0000000000000200");
        let s = parse_status(&text, Path::new("x")).unwrap();
        assert!(!s.catches(Signal::USR1));
    }

    #[test]
    fn status_errors_are_typed() {
        for (text, needle) in [
            ("Name:\tx\nPPid:\tone\n", "PPid"),
            ("Name:\tx\nPPid:\t1\nSigCgt:\tzz\n", "SigCgt"),
            (
                "Name:\tx\nPPid:\t1\nSigCgt:\t00000000000000000000\n",
                "SigCgt",
            ),
            (
                "Name:\tx\nPPid:\t1\nSigCgt:\t0\nSigIgn:\t0\nUid:\t0\nGid:\t0\n\nNSpid:\t1 a\n",
                "NSpid",
            ),
            (
                "Name:\tx\nPPid:\t1\nSigIgn:\t0\nUid:\t0\nGid:\t0\n",
                "no SigCgt",
            ),
            ("", "no Name"),
            ("\u{0}\u{ff}garbage", "no Name"),
        ] {
            let err = parse_status(text, Path::new("/proc/1/status")).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(needle), "{msg} should mention {needle}");
            assert!(msg.contains("/proc/1/status"));
            assert!(!is_gone(&err));
        }
    }

    #[test]
    fn stat_with_hostile_comm() {
        let tail = "S 1 4242 4242 0 -1 4194560 1000 0 0 0 5 3 0 0 20 0 1 0 987654 1000000 100";
        for comm in ["python3", "a b", "x) S 1 2 (", "((", ")", ""] {
            let text = format!("4242 ({comm}) {tail} 18446744073709551615 1 1 0 0 0\n");
            let s = parse_stat(&text, Path::new("stat")).unwrap();
            assert_eq!(s.pid, 4242);
            assert_eq!(s.comm, comm);
            assert_eq!(s.state, 'S');
            assert_eq!(s.ppid, 1);
            assert_eq!(s.start_time, 987654);
            assert!(!s.exited());
        }
        let zombie = format!("7 (z) Z {}", &tail[2..]);
        assert!(parse_stat(&zombie, Path::new("stat")).unwrap().exited());
    }

    #[test]
    fn stat_errors_are_typed() {
        for text in [
            "",
            "4242",
            "4242 (x",
            "x (y) S 1",
            "4242 (x) S 1 2 3",
            "4242 (x) S one 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21",
            "4242 (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 -5",
        ] {
            let err = parse_stat(text, Path::new("/proc/4242/stat")).unwrap_err();
            assert!(err.to_string().contains("/proc/4242/stat"), "{err}");
        }
    }

    #[test]
    fn cmdline_splits_on_nul() {
        assert_eq!(
            parse_cmdline(b"python3\0-m\0torch.distributed.run\0--nproc-per-node=8\0"),
            vec![
                "python3",
                "-m",
                "torch.distributed.run",
                "--nproc-per-node=8"
            ]
        );
        assert_eq!(parse_cmdline(b""), Vec::<String>::new());
        assert_eq!(parse_cmdline(b"\0"), Vec::<String>::new());
        assert_eq!(parse_cmdline(b"a\0\0b"), vec!["a", "", "b"]);
        assert_eq!(parse_cmdline(b"\xff\xfe"), vec!["\u{fffd}\u{fffd}"]);
    }

    #[test]
    fn real_proc_self() {
        let proc = ProcFs::default();
        let me = std::process::id() as i32;
        let status = proc.status(me).unwrap();
        assert_eq!(status.ns_pid().map(|_| ()), Some(()));
        let stat = proc.stat(me).unwrap();
        assert_eq!(stat.pid, me);
        assert!(proc.alive(me, stat.start_time).unwrap());
        assert!(!proc.alive(me, stat.start_time + 1).unwrap());
        assert!(proc.pids().unwrap().contains(&me));
        assert!(!proc.cmdline(me).unwrap().is_empty());
        assert!(proc.boot_time().unwrap() > 1_500_000_000);
        let err = proc.status(i32::MAX).unwrap_err();
        assert!(is_gone(&err));
        assert!(!proc.alive(i32::MAX, 1).unwrap());
    }
}
