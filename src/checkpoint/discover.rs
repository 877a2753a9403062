//! Host-mode target discovery: `--checkpoint-unit`, `--checkpoint-pidfile`,
//! `--checkpoint-cmdline` (each repeatable; each selector is one [`TargetGroup`] with one outcome).
//!
//! - **unit** `NAME`: every process whose cgroup path in the `name=systemd` v1 hierarchy or the v2
//!   hierarchy has a segment `NAME` (the unit's cgroup and any sub-cgroups a delegated unit made).
//!   A name without a `.` means `NAME.service`, as with `systemctl`.
//! - **pidfile** `PATH`: the process whose PID the file holds *and all its descendants* (a launcher
//!   such as torchrun or a shell script and its workers; with the `handlers` target mode only those
//!   that catch the signal are hit). A pidfile older than its process's start (the PID was
//!   recycled since the file was written) selects nothing.
//! - **cmdline** `REGEX`: every process whose arguments joined by spaces match; kernel threads
//!   (empty cmdline) and spotguard itself never match.
//!
//! A selector that matches nothing still yields its group (with no processes), so the operator sees
//! `no_handler` for it rather than silence; why it matched nothing is logged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;

use super::cgroup::{parse_line, segments};
use super::procfs::{clock_ticks_per_second, is_gone, ProcFs};
use super::{
    Error, Signal, TargetContainer, TargetDiscovery, TargetGroup, TargetMode, TargetProcess,
};

/// The host-mode selectors and the protocol settings shared by all their groups.
#[derive(Clone, Debug)]
pub struct HostTargets {
    pub units: Vec<String>,
    pub pidfiles: Vec<PathBuf>,
    pub cmdlines: Vec<regex::Regex>,
    /// `--checkpoint-dir` (host path).
    pub dir: PathBuf,
    /// `--checkpoint-signal`.
    pub signal: Signal,
    /// `--checkpoint-timeout`.
    pub timeout: Duration,
}

/// [`TargetDiscovery`] for host mode.
#[derive(Clone, Debug)]
pub struct HostDiscovery {
    targets: HostTargets,
    proc: ProcFs,
}

/// One process of the snapshot.
#[derive(Clone, Debug)]
struct Snap {
    ppid: i32,
    start_time: u64,
}

impl HostDiscovery {
    pub fn new(targets: HostTargets) -> Self {
        HostDiscovery {
            targets,
            proc: ProcFs::default(),
        }
    }

    /// Read processes from another proc mount.
    pub fn with_proc(mut self, proc: ProcFs) -> Self {
        self.proc = proc;
        self
    }

    /// Blocking discovery (reads `/proc`); [`TargetDiscovery::discover`] runs it on a blocking
    /// thread.
    pub fn discover_blocking(&self) -> Result<Vec<TargetGroup>, Error> {
        let me = i32::try_from(std::process::id()).unwrap_or(-1);
        let mut snap: HashMap<i32, Snap> = HashMap::new();
        for pid in self.proc.pids()? {
            if pid == me {
                continue;
            }
            match self.proc.stat(pid) {
                Ok(stat) if !stat.exited() => {
                    snap.insert(
                        pid,
                        Snap {
                            ppid: stat.ppid,
                            start_time: stat.start_time,
                        },
                    );
                }
                Ok(_) => {}
                Err(e) if is_gone(&e) => {}
                Err(e) => tracing::debug!(pid, error = %e, "skipping process in host discovery"),
            }
        }
        let mut groups = Vec::new();
        for unit in &self.targets.units {
            let unit = unit_name(unit);
            let pids = self.unit_pids(&snap, &unit);
            if pids.is_empty() {
                tracing::warn!(unit = %unit, "checkpoint unit has no running process");
            }
            let init = pids
                .iter()
                .filter(|p| snap.get(p).is_some_and(|s| !pids.contains(&s.ppid)))
                .min_by_key(|p| snap.get(p).map(|s| (s.start_time, **p)))
                .copied();
            groups.push(self.group(format!("unit:{unit}"), &snap, pids, init));
        }
        for pidfile in &self.targets.pidfiles {
            let name = format!("pidfile:{}", pidfile.display());
            match self.pidfile_root(pidfile, &snap) {
                Ok(root) => {
                    let pids = descendants(&snap, root);
                    groups.push(self.group(name, &snap, pids, Some(root)));
                }
                Err(e) => {
                    tracing::warn!(pidfile = %pidfile.display(), error = %e, "checkpoint pidfile selects no process");
                    groups.push(self.group(name, &snap, Vec::new(), None));
                }
            }
        }
        for re in &self.targets.cmdlines {
            let pids = self.cmdline_pids(&snap, re);
            if pids.is_empty() {
                tracing::warn!(regex = %re, "checkpoint cmdline matches no process");
            }
            groups.push(self.group(format!("cmdline:{re}"), &snap, pids, None));
        }
        Ok(groups)
    }

    fn group(
        &self,
        name: String,
        snap: &HashMap<i32, Snap>,
        pids: Vec<i32>,
        init_pid: Option<i32>,
    ) -> TargetGroup {
        let processes = pids
            .iter()
            .filter_map(|pid| {
                snap.get(pid).map(|s| TargetProcess {
                    pid: *pid,
                    start_time: s.start_time,
                })
            })
            .collect();
        TargetGroup {
            name: name.clone(),
            pod: None,
            containers: vec![TargetContainer {
                name,
                root_pid: None,
                init_pid,
                processes,
            }],
            mode: TargetMode::Handlers,
            signal: self.targets.signal,
            dir: self.targets.dir.clone(),
            timeout: self.targets.timeout,
        }
    }

    fn unit_pids(&self, snap: &HashMap<i32, Snap>, unit: &str) -> Vec<i32> {
        let mut pids: Vec<i32> = snap
            .keys()
            .copied()
            .filter(|pid| match self.proc.cgroup(*pid) {
                Ok(text) => text.lines().filter_map(parse_line).any(|l| {
                    (l.is_systemd() || l.is_unified()) && segments(l.path).any(|s| s == unit)
                }),
                Err(_) => false,
            })
            .collect();
        pids.sort_unstable();
        pids
    }

    fn cmdline_pids(&self, snap: &HashMap<i32, Snap>, re: &regex::Regex) -> Vec<i32> {
        let mut pids: Vec<i32> = snap
            .keys()
            .copied()
            .filter(|pid| match self.proc.cmdline(*pid) {
                Ok(args) if !args.is_empty() => re.is_match(&args.join(" ")),
                _ => false,
            })
            .collect();
        pids.sort_unstable();
        pids
    }

    /// The PID in a pidfile, if that process is running and not younger than the file.
    fn pidfile_root(&self, path: &Path, snap: &HashMap<i32, Snap>) -> Result<i32, Error> {
        let bad = |reason: String| Error::Pidfile {
            path: path.display().to_string(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
        if meta.len() > 64 {
            return Err(bad(format!("{} bytes is not a pid", meta.len())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let pid = text
            .trim()
            .parse::<i32>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad(format!("{:?} is not a pid", text.trim())))?;
        let proc = snap
            .get(&pid)
            .ok_or_else(|| bad(format!("process {pid} is not running")))?;
        // A process writes its pidfile after it starts: a process that started well after the
        // file was written has a recycled PID.
        if let (Ok(written), Ok(boot)) = (meta.modified(), self.proc.boot_time()) {
            let written = written
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let started =
                u64::try_from(boot).unwrap_or(0) + proc.start_time / clock_ticks_per_second();
            if started > written + 2 {
                return Err(bad(format!(
                    "process {pid} started after the pidfile was written (recycled pid)"
                )));
            }
        }
        Ok(pid)
    }
}

/// `NAME` → `NAME.service` when it has no unit suffix.
fn unit_name(name: &str) -> String {
    let name = name.trim();
    if name.contains('.') {
        name.to_string()
    } else {
        format!("{name}.service")
    }
}

/// `root` and every process below it in the snapshot.
fn descendants(snap: &HashMap<i32, Snap>, root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, s) in snap {
        children.entry(s.ppid).or_default().push(*pid);
    }
    let mut out = vec![root];
    let mut i = 0;
    while let Some(pid) = out.get(i).copied() {
        if let Some(kids) = children.get(&pid) {
            for k in kids {
                if !out.contains(k) {
                    out.push(*k);
                }
            }
        }
        i += 1;
    }
    out.sort_unstable();
    out
}

#[async_trait]
impl TargetDiscovery for HostDiscovery {
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.discover_blocking())
            .await
            .map_err(|e| Error::Proc {
                path: "host discovery".to_string(),
                source: std::io::Error::other(e.to_string()),
            })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_names() {
        assert_eq!(unit_name("train"), "train.service");
        assert_eq!(unit_name("train.service"), "train.service");
        assert_eq!(unit_name("train@3.service"), "train@3.service");
        assert_eq!(unit_name("job.scope"), "job.scope");
    }

    #[test]
    fn descendants_walk_the_tree() {
        let snap: HashMap<i32, Snap> = [(10, 1), (11, 10), (12, 10), (13, 12), (20, 1), (21, 20)]
            .into_iter()
            .map(|(pid, ppid)| {
                (
                    pid,
                    Snap {
                        ppid,
                        start_time: 0,
                    },
                )
            })
            .collect();
        assert_eq!(descendants(&snap, 10), vec![10, 11, 12, 13]);
        assert_eq!(descendants(&snap, 21), vec![21]);
    }
}
