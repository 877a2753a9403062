//! Host-mode target discovery: `--checkpoint-unit`, `--checkpoint-pidfile`,
//! `--checkpoint-cmdline` (each repeatable; each selector is one [`TargetGroup`] with one outcome).
//!
//! - **unit** `NAME`: every process in the unit's own cgroup (or a sub-cgroup a delegated unit
//!   made) in the `name=systemd` v1 hierarchy or the v2 hierarchy. The unit's cgroup is where
//!   systemd puts units: `NAME` directly below slices only (`/system.slice/NAME`,
//!   `/user.slice/user-1000.slice/NAME`); a cgroup of the same name nested below another unit,
//!   scope or container does not match. A name without a `.` means `NAME.service`, as with
//!   `systemctl`.
//! - **pidfile** `PATH`: the process whose PID the file holds *and its descendants running as the
//!   same user* (a launcher such as torchrun or a shell script and its workers; with the `handlers`
//!   target mode only the handlers among them are hit: never a shell catching every terminating
//!   signal for an `EXIT` trap, see [`super::handler`]). The pidfile is hostile input (host
//!   mode's checkpoint dir is often world-writable): it must be a regular file (opened with
//!   `O_NOFOLLOW | O_NONBLOCK`, so a symlink or FIFO is refused, never followed or waited on) of at
//!   most 64 bytes, owned by root or by the user the process runs as; PID 1 is never selected. A
//!   pidfile older than its process's start (the PID was recycled since the file was written)
//!   selects nothing. Each refusal is logged with its reason and the group ends `no_handler`.
//! - **cmdline** `REGEX`: every process whose arguments joined by spaces match; kernel threads
//!   (empty cmdline) and spotguard itself never match. Any local user can start a process whose
//!   command line matches, so `--checkpoint-cmdline-uid` narrows every cmdline selector to the
//!   processes of the given users (the real uid in `/proc/PID/status`).
//!
//! A selector that matches nothing still yields its group (with no processes), so the operator sees
//! `no_handler` for it rather than silence; why it matched nothing is logged.
//!
//! **Warm candidates.** A full discovery reads every process (its stat, cmdline, cgroup). So that a
//! notice costs what its targets cost, [`HostDiscovery::keep_warm`] runs that full discovery in the
//! background, rate-limited (at most every [`WARM_INTERVAL`], and never more often than 50 times its
//! own duration: ≤ 2 % of a core), and keeps the candidates with the kernel's last allocated PID at
//! the time. At the notice only these are re-read, with the same rules: the warm candidates, every
//! PID allocated since (`/proc/loadavg`'s last PID; PIDs not reused in between), the processes
//! started within [`RECENT`] of the refresh that may still exec into a match (*unsettled*, below),
//! and the pidfiles' processes and their descendants; the pidfd, start time and `SigCgt` checks
//! then happen at the signal as always. It falls back to the full scan when the warm set cannot be
//! trusted: none yet, older than three refresh periods (the refresh is failing or starved), more
//! than [`MAX_NEW_PIDS`] PIDs allocated since (or the last PID unreadable), or a proc root other
//! than this process's own `/proc`.
//!
//! **Catching up.** Between two full refreshes the same background thread catches up every
//! [`CATCH_UP`]: the processes created since (by the last PID) are read once each — their stat,
//! whether a selector selects them or their parent is a candidate, whether they are unsettled —
//! and folded into the warm set, and the unsettled ones are re-checked (settled, they drop out;
//! matching, they become candidates). So a burst of new processes costs the background once, as
//! they appear, and a notice re-reads only what was created in the last [`CATCH_UP`] and what is
//! still unsettled, however soon after the burst it comes. It reads at most [`MAX_NEW_PIDS`]
//! processes a time (the rest the next), and pauses at least as long as it took: at most half a
//! core, and only while processes are being created (a catch-up costs a fraction of what creating
//! them cost). Every pass of the thread, full or catch-up, yields to a
//! discovery in progress (it stops and is made again after its pause): the notice never shares
//! the CPU with its own background.
//!
//! **Unsettled.** With a cmdline selector (an exec changes a process's command line, never its
//! parent, user or cgroup, so pidfile and unit selectors have none), a process started within
//! [`RECENT`] of the refresh is re-read at the notice only while it may still become another
//! program: it runs a shell or an exec wrapper
//! ([`EXEC_WRAPPERS`]: `env`, `nice`, `numactl`, … replace themselves with the command they were
//! given), its executable cannot be read, or it has not exec'd since its fork (its command line is
//! its parent's) and is younger than [`SETTLE_AGE`] (fork and exec are milliseconds apart; a fork
//! that has run longer without exec'ing is a worker of its parent's program, as a perl or Python
//! fork server's are). The rest has become the program it runs, so a burst of new
//! processes costs the background refresh, not the notice. What it does not see: a process that
//! at the refresh was settled (or older than [`RECENT`]) and, since the refresh, exec'd into a
//! matching command line, or was moved into a unit's cgroup without forking — found by the next
//! refresh.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;

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
    /// `--checkpoint-cmdline-uid`: when not empty, a cmdline selector matches only processes
    /// running as one of these uids.
    pub cmdline_uids: Vec<u32>,
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
    /// `--checkpoint-target`: which selected processes get the signal.
    mode: TargetMode,
    /// The candidates of the latest background refresh (shared by clones).
    warm: Arc<Mutex<Option<Arc<Warm>>>>,
    /// Discoveries in progress (shared by clones): the background yields to them.
    notices: Arc<AtomicUsize>,
}

/// Least time between two background refreshes of the warm candidates.
pub const WARM_INTERVAL: Duration = Duration::from_secs(2);
/// Between two full refreshes, the background catches up this often with the processes created
/// since (and re-checks the unsettled ones).
pub const CATCH_UP: Duration = Duration::from_millis(200);
/// Processes started this long before a refresh are re-read at the notice (they may have exec'd).
pub const RECENT: Duration = Duration::from_secs(10);
/// A recent process that has not exec'd since its fork counts as settled from this age on (a fork
/// and its exec are milliseconds apart).
pub const SETTLE_AGE: Duration = Duration::from_millis(250);
/// Executables that replace themselves with the command they were given (by file name): a recent
/// process running one is re-read at the notice.
pub const EXEC_WRAPPERS: &[&str] = &[
    "env",
    "nice",
    "ionice",
    "numactl",
    "taskset",
    "chrt",
    "stdbuf",
    "nohup",
    "setsid",
    "setpriv",
    "capsh",
    "runuser",
    "su",
    "sudo",
    "doas",
    "chroot",
    "unshare",
    "nsenter",
    "prlimit",
    "flock",
    "time",
    "exec",
    "systemd-run",
    "sg",
    "newgrp",
];
/// More PIDs allocated since the refresh than this: the notice scans every process.
pub const MAX_NEW_PIDS: i32 = 8192;

/// What a background refresh saw.
#[derive(Debug)]
struct Warm {
    /// Every process, as the full discovery read it.
    snap: HashMap<i32, Snap>,
    /// The processes of every group, and the pidfiles' processes' descendants.
    candidates: HashSet<i32>,
    /// The last PID allocated before the snapshot began, and where PIDs wrap.
    last_pid: i32,
    pid_max: i32,
    /// The recent processes that may still exec into a match (module docs): re-read at the notice.
    unsettled: HashSet<i32>,
    at: Instant,
    /// Trusted until `at + trusted_for`.
    trusted_for: Duration,
}

/// What a notice re-reads from the warm set: its candidates and unsettled processes (`read`), the
/// PIDs allocated since (`new`).
struct WarmReads {
    warm: Arc<Warm>,
    read: HashSet<i32>,
    new: Vec<i32>,
}

/// How a discovery found its targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostFoundBy {
    /// Re-reading the warm candidates and the processes created since.
    Warm,
    /// Reading every process.
    FullScan,
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
            mode: TargetMode::Handlers,
            warm: Arc::new(Mutex::new(None)),
            notices: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn warm(&self) -> Option<Arc<Warm>> {
        crate::sync::lock(&self.warm).clone()
    }

    /// Whether the proc root is this process's own `/proc` (whose `loadavg` numbers its PIDs).
    fn own_proc(&self) -> bool {
        self.proc.root() == Path::new(super::procfs::PROC_ROOT)
    }

    /// One background refresh of the warm candidates (a full discovery, quiet); blocking.
    /// `interval`: the pause before the next one. Returns how long it took.
    pub fn refresh_warm(&self, interval: Duration) -> Result<Duration, Error> {
        self.refresh(&|_| interval, &|| false)
            .map(|done| done.map(|(took, _)| took).unwrap_or_default())
    }

    /// [`HostDiscovery::refresh_warm`] with the pause before the next one a function of how long
    /// this one took; `None` when `stop` said so before the end (nothing published). Returns how
    /// long it took and the pause.
    fn refresh(
        &self,
        pause: &dyn Fn(Duration) -> Duration,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<(Duration, Duration)>, Error> {
        let started = Instant::now();
        let last_pid = self.proc.last_pid()?;
        let pid_max = self.proc.pid_max()?;
        let Some(snap) = self.snapshot_unless(stop)? else {
            return Ok(None);
        };
        if stop() {
            return Ok(None);
        }
        let groups = self.groups(&snap, false)?;
        let mut candidates: HashSet<i32> = HashSet::new();
        for g in &groups {
            for c in &g.containers {
                candidates.extend(c.processes.iter().map(|p| p.pid));
                if let Some(init) = c.init_pid {
                    candidates.extend(descendants(&snap, init));
                }
            }
        }
        let (recent_from, young_from) = self.windows();
        let Some(unsettled) = self.unsettled(snap.iter(), recent_from, young_from, stop) else {
            return Ok(None);
        };
        // The next refresh begins `pause` after this one ends: trusted for three such periods.
        let took = started.elapsed();
        let pause = pause(took);
        let trusted_for = (pause + took) * 3;
        *crate::sync::lock(&self.warm) = Some(Arc::new(Warm {
            snap,
            candidates,
            last_pid,
            pid_max,
            unsettled,
            at: started,
            trusted_for,
        }));
        Ok(Some((started.elapsed(), pause)))
    }

    /// The start times (clock ticks since boot) from which a process is recent ([`RECENT`]) and
    /// from which one that has not exec'd since its fork is still young ([`SETTLE_AGE`]).
    fn windows(&self) -> (u64, u64) {
        let ticks = clock_ticks_per_second();
        let uptime_ticks = self
            .proc
            .boot_time()
            .ok()
            .and_then(|boot| {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()?
                    .as_secs();
                now.checked_sub(u64::try_from(boot).ok()?)
            })
            .unwrap_or(0)
            * ticks;
        let recent_from = uptime_ticks.saturating_sub(RECENT.as_secs() * ticks);
        // to the clock tick: btime above has whole seconds
        let settle_ticks = u64::try_from(SETTLE_AGE.as_millis()).unwrap_or(u64::MAX) * ticks / 1000;
        let young_from = boottime_ticks(ticks)
            .unwrap_or(uptime_ticks)
            .saturating_sub(settle_ticks);
        (recent_from, young_from)
    }

    /// Between two full refreshes (module docs, "Catching up"): fold the processes created since
    /// the warm set was made into it, each read once, and re-check the unsettled ones, so that a
    /// notice re-reads only what was created in the last moments. Blocking.
    pub fn catch_up(&self) -> Result<CatchUp, Error> {
        self.catch_up_unless(&|| false)
    }

    fn catch_up_unless(&self, stop: &dyn Fn() -> bool) -> Result<CatchUp, Error> {
        let Some(warm) = self.warm() else {
            return Ok(CatchUp::FullRefreshDue);
        };
        let now_last = self.proc.last_pid()?;
        // at most MAX_NEW_PIDS at a time, in the order they were allocated: the rest next time
        let new: Vec<i32> = pid_range(warm.last_pid, warm.pid_max, now_last)
            .take(usize::try_from(MAX_NEW_PIDS).unwrap_or(0))
            .collect();
        let upto = if allocated(warm.last_pid, warm.pid_max, now_last) > MAX_NEW_PIDS {
            new.last().copied().unwrap_or(now_last)
        } else {
            now_last
        };
        if new.is_empty() && warm.unsettled.is_empty() {
            return Ok(CatchUp::Done);
        }
        let me = i32::try_from(std::process::id()).unwrap_or(-1);
        let mut read: HashMap<i32, Snap> = HashMap::new();
        for pid in new {
            if stop() {
                return Ok(CatchUp::Yielded);
            }
            if pid != me {
                if let Some(s) = self.read_process(pid, None) {
                    read.insert(pid, s);
                }
            }
        }
        for pid in &warm.unsettled {
            if stop() {
                return Ok(CatchUp::Yielded);
            }
            if let Some(s) = self.read_process(*pid, warm.snap.get(pid)) {
                read.insert(*pid, s);
            }
        }
        let mut candidates = warm.candidates.clone();
        for (pid, s) in &read {
            // a candidate's child is one too (a superset: the notice applies the rules)
            if candidates.contains(&s.ppid) || self.selects(*pid) {
                candidates.insert(*pid);
            }
        }
        let (recent_from, young_from) = self.windows();
        let Some(unsettled) = self.unsettled(read.iter(), recent_from, young_from, stop) else {
            return Ok(CatchUp::Yielded);
        };
        let mut snap = warm.snap.clone();
        snap.extend(read);
        *crate::sync::lock(&self.warm) = Some(Arc::new(Warm {
            snap,
            candidates,
            last_pid: upto,
            pid_max: warm.pid_max,
            unsettled,
            at: warm.at,
            trusted_for: warm.trusted_for,
        }));
        Ok(CatchUp::Done)
    }

    /// Keep the candidates warm until `cancel` (module docs), on a thread of its own: a full
    /// refresh, then a pause of [`WARM_INTERVAL`] or 50 times the refresh's duration, whichever is
    /// longer, during which it catches up every [`CATCH_UP`] (or after as long as the last
    /// catch-up took, whichever is longer). Each pass yields to a discovery in progress: it stops, and
    /// is made again after the pause.
    /// Does nothing when the proc root is not this process's own `/proc`.
    pub async fn keep_warm(self: Arc<Self>, cancel: CancellationToken) {
        if !self.own_proc() {
            cancel.cancelled().await;
            return;
        }
        // dropped at `cancel`: the thread's pause ends at once and it returns
        let (stop, stopped) = mpsc::channel::<()>();
        let this = self.clone();
        let looped = super::run_on_thread("sg-host-warm", move || this.warm_loop(&stopped));
        tokio::select! {
            _ = cancel.cancelled() => drop(stop),
            _ = looped => {}
        }
    }

    /// The thread of [`HostDiscovery::keep_warm`], until `stopped` is disconnected.
    fn warm_loop(&self, stopped: &mpsc::Receiver<()>) {
        let yield_now = || self.notices.load(Ordering::SeqCst) > 0;
        let mut next_full = Instant::now();
        loop {
            let mut pause = CATCH_UP;
            let started = Instant::now();
            if started >= next_full {
                match self.refresh(&|took| (took * 50).max(WARM_INTERVAL), &yield_now) {
                    Ok(Some((_, after))) => next_full = Instant::now() + after,
                    Ok(None) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "refreshing the warm checkpoint candidates failed");
                        next_full = Instant::now() + WARM_INTERVAL;
                    }
                }
            } else {
                match self.catch_up_unless(&yield_now) {
                    Ok(CatchUp::FullRefreshDue) => next_full = Instant::now(),
                    Ok(CatchUp::Done) => pause = pause.max(started.elapsed()),
                    Ok(CatchUp::Yielded) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "catching up the warm checkpoint candidates failed");
                    }
                }
            }
            if let Err(mpsc::RecvTimeoutError::Disconnected) = stopped.recv_timeout(pause) {
                return;
            }
        }
    }

    /// What a notice now re-reads from the warm set: the candidates and unsettled processes (and
    /// the pidfiles' processes' descendants), and the PIDs allocated since; or why the warm set
    /// cannot be trusted.
    fn warm_reads(&self) -> Result<WarmReads, &'static str> {
        if !self.own_proc() {
            return Err("proc root is not this process's /proc");
        }
        let warm = self.warm().ok_or("no warm candidates yet")?;
        if warm.at.elapsed() > warm.trusted_for {
            return Err("warm candidates are stale (refresh failing or starved)");
        }
        let now_last = self.proc.last_pid().map_err(|_| "last pid unreadable")?;
        let new = pids_since(warm.last_pid, warm.pid_max, now_last)
            .ok_or("too many processes created since the refresh")?;
        let mut read: HashSet<i32> = warm.candidates.clone();
        read.extend(warm.unsettled.iter().copied());
        for pidfile in &self.targets.pidfiles {
            if let Ok((root, _)) = self.pidfile_root(pidfile, &warm.snap) {
                read.extend(descendants(&warm.snap, root));
            }
        }
        Ok(WarmReads { warm, read, new })
    }

    /// The processes a notice now would read (module docs, "Warm candidates"), in PID order;
    /// `None` when it would read every process.
    pub fn notice_reads(&self) -> Option<Vec<i32>> {
        let WarmReads { mut read, new, .. } = self.warm_reads().ok()?;
        read.extend(new);
        let mut pids: Vec<i32> = read.into_iter().collect();
        pids.sort_unstable();
        Some(pids)
    }

    /// Discovery from the warm candidates, or `None` (and why) when they cannot be trusted.
    fn discover_warm(&self) -> Result<Vec<TargetGroup>, &'static str> {
        let WarmReads { warm, read, new } = self.warm_reads()?;
        let me = i32::try_from(std::process::id()).unwrap_or(-1);
        let mut snap: HashMap<i32, Snap> = HashMap::new();
        for (pid, created) in read
            .into_iter()
            .map(|p| (p, false))
            .chain(new.into_iter().map(|p| (p, true)))
        {
            if pid == me || snap.contains_key(&pid) {
                continue;
            }
            let known = if created { None } else { warm.snap.get(&pid) };
            if let Some(s) = self.read_process(pid, known) {
                snap.insert(pid, s);
            }
        }
        self.groups(&snap, true)
            .map_err(|_| "reading the candidates failed")
    }

    /// Blocking discovery by reading every process (what the warm path is checked against).
    pub fn discover_full(&self) -> Result<Vec<TargetGroup>, Error> {
        let snap = self.snapshot()?;
        self.groups(&snap, true)
    }

    /// Blocking discovery and how it was made: from the warm candidates when they can be trusted,
    /// else by reading every process.
    pub fn discover_with(&self) -> Result<(Vec<TargetGroup>, HostFoundBy), Error> {
        // the background yields until this discovery is done
        let _notice = InProgress::enter(&self.notices);
        match self.discover_warm() {
            Ok(groups) => Ok((groups, HostFoundBy::Warm)),
            Err(why) => {
                if self.warm().is_some() {
                    tracing::debug!(reason = why, "checkpoint discovery scans every process");
                }
                Ok((self.discover_full()?, HostFoundBy::FullScan))
            }
        }
    }

    /// Read processes from another proc mount.
    pub fn with_proc(mut self, proc: ProcFs) -> Self {
        self.proc = proc;
        self
    }

    /// Signal the selected processes by `mode` (`--checkpoint-target`; `handlers` by default).
    pub fn with_target_mode(mut self, mode: TargetMode) -> Self {
        self.mode = mode;
        self
    }

    /// Blocking discovery (reads `/proc`); [`TargetDiscovery::discover`] runs it on a thread of
    /// its own.
    pub fn discover_blocking(&self) -> Result<Vec<TargetGroup>, Error> {
        self.discover_with().map(|(groups, _)| groups)
    }

    /// Check one pidfile against the rules (module docs): the PID it names, or why it is refused.
    /// Blocking.
    pub fn check_pidfile(&self, path: &Path) -> Result<i32, Error> {
        let snap = self.snapshot()?;
        self.pidfile_root(path, &snap).map(|(pid, _)| pid)
    }

    /// The processes of `snap` started at `recent_from` or later (clock ticks since boot) that
    /// may still exec into another program (module docs, "Unsettled"); `young_from`: the start
    /// from which a process that has not exec'd since its fork is still expected to.
    /// `None` when `stop` said so before the end.
    fn unsettled<'a>(
        &self,
        procs: impl Iterator<Item = (&'a i32, &'a Snap)>,
        recent_from: u64,
        young_from: u64,
        stop: &dyn Fn() -> bool,
    ) -> Option<HashSet<i32>> {
        // An exec changes the command line, never the parent, the user or the cgroup: only a
        // cmdline selector can come to select a process that execs.
        if self.targets.cmdlines.is_empty() {
            return Some(HashSet::new());
        }
        let mut parents: HashMap<i32, Option<Vec<String>>> = HashMap::new();
        let mut stopped = false;
        let unsettled = procs
            .filter(|(_, s)| s.start_time >= recent_from)
            .take_while(|_| {
                stopped = stop();
                !stopped
            })
            .filter(|(pid, s)| {
                // kthreadd's children are kernel threads: they never exec
                if s.ppid == 2 {
                    return false;
                }
                let Ok(args) = self.proc.cmdline(**pid) else {
                    return !matches!(self.proc.stat(**pid), Err(ref e) if is_gone(e));
                };
                match super::handler::exe_name(&self.proc, **pid) {
                    Some(exe) if super::handler::SHELLS.contains(&exe.as_str()) => return true,
                    Some(exe) if EXEC_WRAPPERS.contains(&exe.as_str()) => return true,
                    Some(_) => {}
                    None => return true,
                }
                if s.start_time < young_from {
                    return false;
                }
                let parent = parents
                    .entry(s.ppid)
                    .or_insert_with(|| self.proc.cmdline(s.ppid).ok());
                args.is_empty() || parent.as_ref() == Some(&args)
            })
            .map(|(pid, _)| *pid)
            .collect();
        (!stopped).then_some(unsettled)
    }

    /// Process `pid` (gone, exited: `None`); `known`: what the warm set saw as it, whose start
    /// time, if still the same, says it is a process; otherwise only a thread group leader is
    /// one (a PID not seen before may be a thread's id).
    fn read_process(&self, pid: i32, known: Option<&Snap>) -> Option<Snap> {
        let stat = self.proc.stat(pid).ok()?;
        if stat.exited() {
            return None;
        }
        let known = known.is_some_and(|s| s.start_time == stat.start_time);
        if !known
            && !self
                .proc
                .status(pid)
                .is_ok_and(|s| s.tgid.is_none_or(|t| t == pid))
        {
            return None;
        }
        Some(Snap {
            ppid: stat.ppid,
            start_time: stat.start_time,
        })
    }

    fn snapshot(&self) -> Result<HashMap<i32, Snap>, Error> {
        Ok(self.snapshot_unless(&|| false)?.unwrap_or_default())
    }

    /// Every process; `None` when `stop` said so before the end.
    fn snapshot_unless(
        &self,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<HashMap<i32, Snap>>, Error> {
        let me = i32::try_from(std::process::id()).unwrap_or(-1);
        let mut snap: HashMap<i32, Snap> = HashMap::new();
        for pid in self.proc.pids()? {
            if stop() {
                return Ok(None);
            }
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
        Ok(Some(snap))
    }

    /// The groups over `snap`; `log`: say why a selector matched nothing (not from the background
    /// refresh, which would repeat it every few seconds).
    fn groups(&self, snap: &HashMap<i32, Snap>, log: bool) -> Result<Vec<TargetGroup>, Error> {
        let mut groups = Vec::new();
        for unit in &self.targets.units {
            let unit = unit_name(unit);
            let pids = self.unit_pids(snap, &unit);
            if pids.is_empty() && log {
                tracing::warn!(unit = %unit, "checkpoint unit has no running process");
            }
            let init = pids
                .iter()
                .filter(|p| snap.get(p).is_some_and(|s| !pids.contains(&s.ppid)))
                .min_by_key(|p| snap.get(p).map(|s| (s.start_time, **p)))
                .copied();
            groups.push(self.group(format!("unit:{unit}"), snap, pids, init));
        }
        for pidfile in &self.targets.pidfiles {
            let name = format!("pidfile:{}", pidfile.display());
            match self.pidfile_root(pidfile, snap) {
                Ok((root, uid)) => {
                    let pids: Vec<i32> = descendants(snap, root)
                        .into_iter()
                        .filter(|pid| {
                            let same = *pid == root
                                || self.proc.status(*pid).is_ok_and(|s| s.uid == uid);
                            if !same {
                                tracing::debug!(pidfile = %pidfile.display(), pid = *pid, "descendant runs as another user; not selected");
                            }
                            same
                        })
                        .collect();
                    groups.push(self.group(name, snap, pids, Some(root)));
                }
                Err(e) => {
                    if log {
                        tracing::warn!(pidfile = %pidfile.display(), error = %e, "checkpoint pidfile selects no process");
                    }
                    groups.push(self.group(name, snap, Vec::new(), None));
                }
            }
        }
        for re in &self.targets.cmdlines {
            let pids = self.cmdline_pids(snap, re);
            if pids.is_empty() && log {
                tracing::warn!(regex = %re, "checkpoint cmdline matches no process");
            }
            groups.push(self.group(format!("cmdline:{re}"), snap, pids, None));
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
            mode: self.mode,
            signal: self.targets.signal,
            dir: self.targets.dir.clone(),
            timeout: self.targets.timeout,
            proc_root: self.proc.root().to_path_buf(),
        }
    }

    fn unit_pids(&self, snap: &HashMap<i32, Snap>, unit: &str) -> Vec<i32> {
        let mut pids: Vec<i32> = snap
            .keys()
            .copied()
            .filter(|pid| self.in_unit(*pid, unit))
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Whether process `pid` is in `unit` (a full unit name).
    fn in_unit(&self, pid: i32, unit: &str) -> bool {
        match self.proc.cgroup(pid) {
            Ok(text) => text
                .lines()
                .filter_map(parse_line)
                .any(|l| (l.is_systemd() || l.is_unified()) && in_unit(l.path, unit)),
            Err(_) => false,
        }
    }

    fn cmdline_pids(&self, snap: &HashMap<i32, Snap>, re: &regex::Regex) -> Vec<i32> {
        let mut pids: Vec<i32> = snap
            .keys()
            .copied()
            .filter(|pid| self.cmdline_matches(*pid, re))
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Whether process `pid`'s command line matches `re` (and its user is allowed).
    fn cmdline_matches(&self, pid: i32, re: &regex::Regex) -> bool {
        match self.proc.cmdline(pid) {
            Ok(args) if !args.is_empty() => {
                re.is_match(&args.join(" "))
                    && (self.targets.cmdline_uids.is_empty()
                        || self
                            .proc
                            .status(pid)
                            .is_ok_and(|s| self.targets.cmdline_uids.contains(&s.uid)))
            }
            _ => false,
        }
    }

    /// Whether a cmdline or unit selector selects process `pid`.
    fn selects(&self, pid: i32) -> bool {
        self.targets
            .cmdlines
            .iter()
            .any(|re| self.cmdline_matches(pid, re))
            || self
                .targets
                .units
                .iter()
                .any(|u| self.in_unit(pid, &unit_name(u)))
    }

    /// The PID in a pidfile and its process's uid, if the file passes the rules in the module
    /// docs and that process is running and not younger than the file.
    fn pidfile_root(&self, path: &Path, snap: &HashMap<i32, Snap>) -> Result<(i32, u32), Error> {
        use rustix::fs::{FileType, Mode, OFlags};
        use std::io::Read;
        let bad = |reason: String| Error::Pidfile {
            path: path.display().to_string(),
            reason,
        };
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            rustix::io::Errno::LOOP => {
                bad("is a symlink; refused (pidfiles are never followed)".into())
            }
            e => bad(std::io::Error::from(e).to_string()),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| bad(std::io::Error::from(e).to_string()))?;
        let kind = FileType::from_raw_mode(st.st_mode);
        if kind != FileType::RegularFile {
            return Err(bad(format!(
                "is a {}, not a regular file; refused",
                file_type_name(kind)
            )));
        }
        if st.st_size > MAX_PIDFILE_BYTES as i64 {
            return Err(bad(format!(
                "{} bytes is not a pid (at most {MAX_PIDFILE_BYTES} bytes)",
                st.st_size
            )));
        }
        let mut text = String::new();
        std::fs::File::from(fd)
            .take(MAX_PIDFILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| bad(e.to_string()))?;
        let pid = text
            .trim()
            .parse::<i32>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad(format!("{:?} is not a pid", text.trim())))?;
        if pid == 1 {
            return Err(bad(
                "names pid 1 (init); refused: init and the whole host are never a checkpoint target".into(),
            ));
        }
        let proc = snap
            .get(&pid)
            .ok_or_else(|| bad(format!("process {pid} is not running")))?;
        let uid = self
            .proc
            .status(pid)
            .map_err(|e| bad(format!("process {pid}: {e}")))?
            .uid;
        let owner = st.st_uid;
        if owner != 0 && owner != uid {
            return Err(bad(format!(
                "is owned by uid {owner} but process {pid} runs as uid {uid}; refused (only root or the process's own user may name it)"
            )));
        }
        // A process writes its pidfile after it starts: a process that started well after the
        // file was written has a recycled PID.
        if let Ok(boot) = self.proc.boot_time() {
            let written = u64::try_from(st.st_mtime).unwrap_or(0);
            let started =
                u64::try_from(boot).unwrap_or(0) + proc.start_time / clock_ticks_per_second();
            if started > written + 2 {
                return Err(bad(format!(
                    "process {pid} started after the pidfile was written (recycled pid)"
                )));
            }
        }
        Ok((pid, uid))
    }
}

/// The PIDs allocated after `last` up to `now` (wrapping at `pid_max`; PIDs are not reused in
/// between), or `None` when more than [`MAX_NEW_PIDS`].
fn pids_since(last: i32, pid_max: i32, now: i32) -> Option<Vec<i32>> {
    (allocated(last, pid_max, now) <= MAX_NEW_PIDS).then(|| pid_range(last, pid_max, now).collect())
}

/// How many PIDs were allocated after `last` up to `now` (wrapping at `pid_max`).
fn allocated(last: i32, pid_max: i32, now: i32) -> i32 {
    if now >= last {
        now - last
    } else {
        (pid_max - last).max(0) + now
    }
}

/// The PIDs after `last` up to `now` (wrapping at `pid_max`), in the order they are allocated.
fn pid_range(last: i32, pid_max: i32, now: i32) -> impl Iterator<Item = i32> {
    let (upper, wrapped) = if now >= last {
        (now + 1, 1..1)
    } else {
        (pid_max.max(last + 1), 1..now + 1)
    };
    (last + 1..upper).chain(wrapped)
}

/// What a catch-up did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatchUp {
    /// The warm set now includes the processes created until it began.
    Done,
    /// Stopped for a discovery in progress; nothing changed.
    Yielded,
    /// No warm set yet: a full refresh is due.
    FullRefreshDue,
}

/// One discovery in progress, counted while it lives.
struct InProgress<'a>(&'a AtomicUsize);

impl<'a> InProgress<'a> {
    fn enter(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        InProgress(count)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Largest pidfile read.
const MAX_PIDFILE_BYTES: u64 = 64;

fn file_type_name(t: rustix::fs::FileType) -> &'static str {
    use rustix::fs::FileType;
    match t {
        FileType::Fifo => "FIFO",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Directory => "directory",
        FileType::Socket => "socket",
        FileType::Symlink => "symlink",
        _ => "special file",
    }
}

/// Whether a cgroup path is the unit's own cgroup or below it: `unit` must come right after
/// slices only (where systemd places units), so a same-named cgroup nested in another unit, a
/// scope or a container does not count.
fn in_unit(path: &str, unit: &str) -> bool {
    for s in segments(path) {
        if s == unit {
            return true;
        }
        if !s.ends_with(".slice") {
            return false;
        }
    }
    false
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
/// `CLOCK_BOOTTIME` in clock ticks (the unit of a process's start time in `/proc/PID/stat`).
fn boottime_ticks(ticks_per_second: u64) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the local timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    Some(secs * ticks_per_second + nanos * ticks_per_second / 1_000_000_000)
}

fn descendants(snap: &HashMap<i32, Snap>, root: i32) -> Vec<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for (pid, s) in snap {
        children.entry(s.ppid).or_default().push(*pid);
    }
    let mut out = vec![root];
    let mut seen: HashSet<i32> = HashSet::from([root]);
    let mut i = 0;
    while let Some(pid) = out.get(i).copied() {
        if let Some(kids) = children.get(&pid) {
            for k in kids {
                if seen.insert(*k) {
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
    /// Runs [`HostDiscovery::discover_blocking`] on a thread of its own (not tokio's blocking
    /// pool, which prefetch I/O can fill).
    async fn discover(&self) -> Result<Vec<TargetGroup>, Error> {
        let this = self.clone();
        super::run_on_thread("sg-ckpt-discover", move || this.discover_blocking())
            .await
            .unwrap_or_else(|e| {
                Err(Error::Proc {
                    path: "host discovery".to_string(),
                    source: e,
                })
            })
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
    fn unit_is_anchored_below_slices() {
        let u = "train.service";
        assert!(in_unit("/system.slice/train.service", u));
        assert!(in_unit("/system.slice/train.service/worker", u));
        assert!(in_unit("/user.slice/user-1000.slice/train.service", u));
        assert!(in_unit("/../../system.slice/train.service", u));
        assert!(!in_unit("/system.slice/other.service/train.service", u));
        assert!(!in_unit(
            "/kubepods.slice/kubepods-pod1.slice/cri-containerd-ab.scope/system.slice/train.service",
            u
        ));
        assert!(!in_unit("/system.slice/docker-ab.scope/train.service", u));
        assert!(!in_unit("/system.slice/train.service.d", u));
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
