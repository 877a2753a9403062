//! Checks of settings whose values can be judged on the machine itself, before anything starts:
//! log filter directives, directories the agent writes (state, checkpoint notices), systemd unit
//! names, the drain reserve against the chosen cloud's notice, and files a command will write.
//! Each returns the reason in words; the caller names the setting.

use std::io::ErrorKind;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use crate::checkpoint::child;
use crate::notice::Cloud;

/// Levels a log filter takes.
const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// A log filter: comma-separated directives, each a level (`info`) or `TARGET=LEVEL`
/// (`kube=warn`); a span filter (`TARGET[span]=LEVEL`) is left to the filter's own parser. A bare
/// word that is not a level would be read as "everything of target WORD" and silence the agent's
/// own lines, so it is refused, as is an empty directive.
pub fn log_filter(filter: &str) -> Result<(), String> {
    let levels = LEVELS.join(", ");
    if filter.trim().is_empty() {
        return Err(format!("empty: give a level ({levels})"));
    }
    for directive in filter.split(',') {
        let d = directive.trim();
        if d.is_empty() {
            return Err(format!(
                "{filter:?} has an empty directive (a stray comma): give LEVEL or TARGET=LEVEL, separated by single commas"
            ));
        }
        if d.contains('[') {
            continue;
        }
        let level = match d.rsplit_once('=') {
            Some((target, level)) if !target.is_empty() => level,
            Some(_) => return Err(format!("{d:?} has no target before '='")),
            None => d,
        };
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "{d:?} is not a level ({levels}) nor a TARGET=LEVEL directive"
            ));
        }
    }
    tracing_subscriber::EnvFilter::try_new(filter)
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Filesystems that cannot hold the agent's files (kernel interfaces, not storage).
const PSEUDO_FS: [(i64, &str); 10] = [
    (libc::PROC_SUPER_MAGIC, "proc"),
    (libc::SYSFS_MAGIC, "sysfs"),
    (libc::CGROUP_SUPER_MAGIC, "cgroup"),
    (libc::CGROUP2_SUPER_MAGIC, "cgroup2"),
    (libc::DEVPTS_SUPER_MAGIC, "devpts"),
    (libc::DEBUGFS_MAGIC, "debugfs"),
    (libc::TRACEFS_MAGIC, "tracefs"),
    (libc::SECURITYFS_MAGIC, "securityfs"),
    (libc::BPF_FS_MAGIC, "bpf"),
    (0x6265_6570, "configfs"),
];

/// The hidden first argument that makes the binary check one directory ([`serve_check_dir`]).
pub const CHECK_DIR_ARG: &str = "__check-dir";
/// How long a directory check in a child may take before the agent starts without it.
pub const CHECK_DIR_LIMIT: Duration = Duration::from_secs(3);

/// The child's side: check `dir`, print why it is unusable, exit 0 (usable) or 1.
pub fn serve_check_dir(dir: &Path) -> i32 {
    match writable_dir(dir) {
        Ok(()) => 0,
        Err(why) => {
            print!("{why}");
            1
        }
    }
}

/// [`writable_dir`], run in a child process ([`crate::checkpoint::child`], the mechanism of the
/// pod filesystem helper) given `limit`: a directory on a filesystem that does not answer (a
/// hung FUSE or NFS mount, a path a trainer's mount put there) holds that child, never the
/// agent, which must start and signal whatever a directory does. A check that does not end in
/// time is said on stderr and counts as passed: the agent starts, and its later accesses to the
/// directory are bounded on their own. Without children ([`child::use_exe`] not called: the
/// library in tests) the check runs in this process.
pub fn writable_dir_bounded(dir: &Path, limit: Duration) -> Result<(), String> {
    let Some(exe) = child::exe() else {
        return writable_dir(dir);
    };
    let spawned = child::spawn(
        exe,
        CHECK_DIR_ARG,
        &[dir.as_os_str()],
        Stdio::null(),
        Stdio::null(),
    );
    let mut c = match spawned {
        Ok(c) => c,
        // No process to spare: check here.
        Err(_) => return writable_dir(dir),
    };
    match child::wait_within(&mut c, limit) {
        Ok(Some(status)) => {
            let mut why = String::new();
            if let Some(mut out) = c.stdout.take() {
                use std::io::Read;
                let _ = out.read_to_string(&mut why);
            }
            if status.success() {
                Ok(())
            } else if why.is_empty() {
                Err(format!("{}: the check ended with {status}", dir.display()))
            } else {
                Err(why)
            }
        }
        _ => {
            // Stuck in the filesystem: killed, left behind (reaped once it leaves the kernel).
            child::abandon(c);
            eprintln!(
                "spotguard: {} did not answer within {} (a hung mount?): not checked, starting anyway",
                dir.display(),
                crate::duration::display(limit)
            );
            Ok(())
        }
    }
}

/// A directory the agent writes: it exists and is a directory, or its nearest existing ancestor
/// is a directory it can be created in; the directory (or that ancestor) accepts a new file (one
/// is created and removed: permission bits, read-only mounts and ACLs all count); and it is not
/// on a kernel pseudo-filesystem (proc, sysfs, cgroup, …). tmpfs is accepted: what the state dir
/// keeps must outlive the agent's restarts within one boot, which tmpfs does (each record is
/// stamped with the boot id; a reboot starts over anyway).
pub fn writable_dir(dir: &Path) -> Result<(), String> {
    let mut probe = dir;
    let mut missing = false;
    loop {
        match std::fs::metadata(probe) {
            Ok(m) if m.is_dir() => break,
            Ok(_) if probe == dir => {
                return Err(format!("{} exists and is not a directory", dir.display()))
            }
            Ok(_) => {
                return Err(format!(
                    "cannot be created: {} is not a directory",
                    probe.display()
                ))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                missing = true;
                match probe.parent() {
                    Some(p) => probe = p,
                    None => return Err(format!("{}: {}", dir.display(), io_words(&e))),
                }
            }
            Err(e) => return Err(format!("{}: {}", probe.display(), io_words(&e))),
        }
    }
    if let Ok(st) = rustix::fs::statfs(probe) {
        // f_type's integer type differs between architectures.
        #[allow(clippy::unnecessary_cast)]
        let kind = st.f_type as i64;
        if let Some((_, name)) = PSEUDO_FS.iter().find(|(magic, _)| *magic == kind) {
            return Err(format!(
                "{} is on {name}, a kernel interface that keeps no files: use a directory on disk (or tmpfs)",
                probe.display()
            ));
        }
    }
    let what = if missing {
        format!(
            "{} does not exist and cannot be created in {}",
            dir.display(),
            probe.display()
        )
    } else {
        format!("{} is not writable", dir.display())
    };
    tempfile::Builder::new()
        .prefix(".spotguard-check-")
        .tempfile_in(probe)
        .map(drop)
        .map_err(|e| format!("{what}: {}", io_words(&e)))
}

/// An I/O error without the "(os error N)" tail.
fn io_words(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Unit types whose units own processes (a cgroup with tasks).
const PROCESS_UNIT_TYPES: [&str; 6] = ["service", "scope", "slice", "socket", "mount", "swap"];

/// A systemd unit name as `--checkpoint-unit` takes it (`NAME` means `NAME.service`), by
/// systemd's rules: at most 255 characters of `A–Z a–z 0–9 : - _ . \ @`, a non-empty name before
/// the type suffix, a type whose units hold processes, and an instance rather than a template
/// (`name@.service`).
pub fn unit_name(unit: &str) -> Result<(), String> {
    let full = if unit.contains('.') {
        unit.to_string()
    } else {
        format!("{unit}.service")
    };
    if unit.is_empty() {
        return Err("empty: name a unit, e.g. train.service".into());
    }
    if let Some(c) = unit
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || ":-_.\\@".contains(*c)))
    {
        return Err(format!(
            "{unit:?} is not a systemd unit name: {c:?} is not allowed (letters, digits and : - _ . \\ @ only; `systemd-escape` makes a name of any string)"
        ));
    }
    if full.len() > 255 {
        return Err(format!(
            "{unit:?} is not a systemd unit name: longer than 255 characters"
        ));
    }
    let (name, kind) = full.rsplit_once('.').unwrap_or((&full, ""));
    if name.is_empty() {
        return Err(format!(
            "{unit:?} is not a systemd unit name: nothing before .{kind}"
        ));
    }
    if !PROCESS_UNIT_TYPES.contains(&kind) {
        return Err(format!(
            "{unit:?}: .{kind} units hold no processes to checkpoint (use a .{} unit)",
            PROCESS_UNIT_TYPES.join(", .")
        ));
    }
    if name.ends_with('@') {
        return Err(format!(
            "{unit:?} is a template: name an instance, e.g. {}1.{kind}",
            name
        ));
    }
    Ok(())
}

/// The drain reserve leaves time to checkpoint within the chosen cloud's notice (`None`: cloud
/// detected at start: checked against the longest notice, AWS's two minutes).
pub fn drain_reserve(
    reserve: Duration,
    cloud: Option<Cloud>,
    gce_notice: Duration,
) -> Result<(), String> {
    let (notice, whose) = match cloud {
        Some(Cloud::Gce) => (gce_notice, "gce (--gce-preemption-notice)".to_string()),
        Some(c) => (c.facts().interruption_notice, c.as_str().to_string()),
        None => (
            Cloud::ALL
                .iter()
                .map(|c| c.facts().interruption_notice)
                .chain([gce_notice])
                .max()
                .unwrap_or_default(),
            "any cloud".to_string(),
        ),
    };
    if reserve >= notice {
        return Err(format!(
            "{} leaves no time to checkpoint: the notice of {whose} is {}; keep it well below that (default: {})",
            crate::duration::display(reserve),
            crate::duration::display(notice),
            match cloud {
                Some(c) => crate::duration::display(c.facts().drain_reserve).to_string(),
                None => "25s on aws, 8s on gce and azure".into(),
            }
        ));
    }
    Ok(())
}

/// The timings judged together, against each other and against the notice of the cloud the
/// agent watches ([`timings`]).
#[derive(Clone, Copy, Debug)]
pub struct Timings {
    /// `--cloud`; `None`: `auto`.
    pub cloud: Option<Cloud>,
    /// `--gce-preemption-notice`.
    pub gce_notice: Duration,
    /// `--poll-interval`.
    pub poll_interval: Duration,
    /// `--drain-reserve`; `None`: the cloud's default.
    pub drain_reserve: Option<Duration>,
    /// `--maintenance-lead`.
    pub maintenance_lead: Duration,
    /// `--on-maintenance drain`: the plan checkpoints and drains before the window.
    pub maintenance_drains: bool,
    /// `--rebalance-expiry`.
    pub rebalance_expiry: Duration,
    /// `--on-rebalance` is not `ignore`.
    pub rebalance_acts: bool,
}

/// The interruption notice of `cloud` (GCE's is `--gce-preemption-notice`).
fn notice_of(cloud: Cloud, gce_notice: Duration) -> Duration {
    match cloud {
        Cloud::Gce => gce_notice,
        c => c.facts().interruption_notice,
    }
}

/// Timings that contradict each other or the cloud's notice, each refused naming the setting
/// blamed (returned), the other setting and the cloud's figure. With `--cloud auto` each is
/// judged against the cloud that forgives it most (the agent does not know yet where it runs;
/// the agent judges them again once it has detected the cloud): naming the cloud has it judged
/// against that cloud.
///
/// - the drain reserve (given, or the cloud's default) is at least the notice: no time is left
///   to checkpoint;
/// - EC2 and Azure are polled: the poll interval and the drain reserve together are at least the
///   notice, so a notice first seen one poll late leaves no time to checkpoint (GCE's hanging GET
///   answers at the change, whatever the interval);
/// - `--on-maintenance drain` with a maintenance lead no longer than the drain reserve: the plan
///   starts with no time to checkpoint before the window;
/// - an EC2 rebalance action undone (`--rebalance-expiry`) within one poll: before the agent
///   could see the interruption that may follow.
pub fn timings(t: &Timings) -> Result<(), (&'static str, String)> {
    let d = crate::duration::display;
    if let Some(reserve) = t.drain_reserve {
        drain_reserve(reserve, t.cloud, t.gce_notice).map_err(|r| ("drain-reserve", r))?;
    } else if let Some(Cloud::Gce) = t.cloud {
        let reserve = Cloud::Gce.facts().drain_reserve;
        if reserve >= t.gce_notice {
            return Err((
                "gce-preemption-notice",
                format!(
                    "{} leaves no time to checkpoint: gce's default drain reserve (--drain-reserve) is {}; give the VM's real notice (30s, or 120s with extended preemption notice), or a smaller --drain-reserve",
                    d(t.gce_notice),
                    d(reserve)
                ),
            ));
        }
    }
    let reserve_of = |c: Cloud| c.drain_reserve(t.drain_reserve);
    let reserve_words = |c: Cloud| match t.drain_reserve {
        Some(r) => format!("--drain-reserve {}", d(r)),
        None => format!(
            "{c}'s default --drain-reserve {}",
            d(c.facts().drain_reserve)
        ),
    };
    // The clouds judged: the chosen one, else the most forgiving.
    let judged = |applies: &dyn Fn(Cloud) -> bool, slack: &dyn Fn(Cloud) -> i128| match t.cloud {
        Some(c) => applies(c).then_some(c),
        None => Cloud::ALL
            .iter()
            .copied()
            .filter(|c| applies(*c))
            .max_by_key(|c| slack(*c)),
    };
    let polled = |c: Cloud| c != Cloud::Gce;
    let poll_slack = |c: Cloud| {
        notice_of(c, t.gce_notice).as_nanos() as i128
            - (t.poll_interval + reserve_of(c)).as_nanos() as i128
    };
    if let Some(c) = judged(&polled, &poll_slack) {
        let notice = notice_of(c, t.gce_notice);
        if t.poll_interval + reserve_of(c) >= notice {
            return Err((
                "poll-interval",
                format!(
                    "{} with {} leaves no time to checkpoint on {c}, whose notice is {}: a notice first seen one poll late has {} left, all of it the drain's; poll more often (default 1s) or keep less for the drain",
                    d(t.poll_interval),
                    reserve_words(c),
                    d(notice),
                    d(notice.saturating_sub(t.poll_interval)),
                ),
            ));
        }
    }
    if t.maintenance_drains {
        let lead_slack =
            |c: Cloud| t.maintenance_lead.as_nanos() as i128 - reserve_of(c).as_nanos() as i128;
        if let Some(c) = judged(&|_| true, &lead_slack) {
            if t.maintenance_lead <= reserve_of(c) {
                return Err((
                    "maintenance-lead",
                    format!(
                        "{} with --on-maintenance drain and {} on {c} leaves no time to checkpoint before the maintenance window: the lead must be longer than the drain reserve (default lead 10m)",
                        d(t.maintenance_lead),
                        reserve_words(c),
                    ),
                ));
            }
        }
    }
    if t.rebalance_acts && t.cloud == Some(Cloud::Aws) && t.rebalance_expiry <= t.poll_interval {
        return Err((
            "rebalance-expiry",
            format!(
                "{} undoes a rebalance action within one --poll-interval ({}): before the agent could see the interruption that may follow; give it longer than the poll interval (default 30m)",
                d(t.rebalance_expiry),
                d(t.poll_interval),
            ),
        ));
    }
    Ok(())
}

/// A file a command will write at its end (`--junit`): checked before the command runs, so a
/// typo costs no run. The file may exist (it is replaced) but is no directory; its directory
/// exists and accepts a new file.
pub fn output_file(path: &Path) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!("{} is a directory", path.display()));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{} is not a directory", parent.display())),
        Err(e) => return Err(format!("{}: {}", parent.display(), io_words(&e))),
    }
    tempfile::Builder::new()
        .prefix(".spotguard-check-")
        .tempfile_in(parent)
        .map(drop)
        .map_err(|e| format!("cannot write in {}: {}", parent.display(), io_words(&e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_filters() {
        for ok in [
            "info",
            "DEBUG",
            "debug,kube=info",
            "warn,spotguard=trace",
            "off",
        ] {
            log_filter(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in ["inf", "verbose", "info,,", "", "kube=loud", "=info"] {
            assert!(log_filter(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn unit_names() {
        for ok in ["train", "train.service", "job@3.service", "a-b_c:d.scope"] {
            unit_name(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "bad unit name",
            "",
            ".service",
            "train.timer",
            "job@.service",
            "a/b",
        ] {
            assert!(unit_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(unit_name(&"a".repeat(250)).is_err());
    }

    #[test]
    fn contradictory_timings_are_refused_naming_the_setting() {
        let ok = Timings {
            cloud: Some(Cloud::Azure),
            gce_notice: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            drain_reserve: None,
            maintenance_lead: Duration::from_secs(600),
            maintenance_drains: true,
            rebalance_expiry: Duration::from_secs(1800),
            rebalance_acts: true,
        };
        let s = Duration::from_secs;
        for cloud in [None, Some(Cloud::Aws), Some(Cloud::Gce), Some(Cloud::Azure)] {
            timings(&Timings { cloud, ..ok }).unwrap_or_else(|e| panic!("{cloud:?}: {e:?}"));
        }
        for (bad, key, words) in [
            (
                Timings {
                    poll_interval: s(25),
                    ..ok
                },
                "poll-interval",
                &["25s", "azure", "30s", "--drain-reserve 8s"][..],
            ),
            (
                Timings {
                    cloud: Some(Cloud::Aws),
                    poll_interval: s(60),
                    drain_reserve: Some(s(60)),
                    ..ok
                },
                "poll-interval",
                &["1m", "aws", "2m", "--drain-reserve 1m"],
            ),
            (
                Timings {
                    cloud: Some(Cloud::Gce),
                    gce_notice: s(5),
                    ..ok
                },
                "gce-preemption-notice",
                &["5s", "8s", "--drain-reserve"],
            ),
            (
                Timings {
                    drain_reserve: Some(s(30)),
                    ..ok
                },
                "drain-reserve",
                &["azure", "30s"],
            ),
            (
                Timings {
                    maintenance_lead: s(8),
                    ..ok
                },
                "maintenance-lead",
                &[
                    "8s",
                    "--on-maintenance drain",
                    "--drain-reserve 8s",
                    "azure",
                ],
            ),
            (
                Timings {
                    cloud: Some(Cloud::Aws),
                    rebalance_expiry: s(1),
                    ..ok
                },
                "rebalance-expiry",
                &["1s", "--poll-interval"],
            ),
        ] {
            let (k, why) = timings(&bad).expect_err(key);
            assert_eq!(k, key, "{why}");
            for w in words {
                assert!(why.contains(w), "{key}: {w:?} not in {why}");
            }
        }
        // Accepted: GCE is not polled; auto forgives what some cloud honours; no drain on
        // maintenance; rebalance ignored.
        timings(&Timings {
            cloud: Some(Cloud::Gce),
            poll_interval: s(60),
            ..ok
        })
        .unwrap();
        timings(&Timings {
            cloud: None,
            poll_interval: s(60),
            ..ok
        })
        .unwrap();
        timings(&Timings {
            maintenance_lead: s(0),
            maintenance_drains: false,
            ..ok
        })
        .unwrap();
        timings(&Timings {
            cloud: Some(Cloud::Aws),
            rebalance_expiry: s(1),
            rebalance_acts: false,
            ..ok
        })
        .unwrap();
    }

    #[test]
    fn drain_reserves() {
        let gce = Duration::from_secs(30);
        assert!(drain_reserve(Duration::from_secs(300), Some(Cloud::Aws), gce).is_err());
        assert!(drain_reserve(Duration::from_secs(40), Some(Cloud::Gce), gce).is_err());
        assert!(drain_reserve(Duration::from_secs(40), Some(Cloud::Aws), gce).is_ok());
        assert!(drain_reserve(Duration::from_secs(40), Some(Cloud::Gce), gce * 4).is_ok());
        assert!(drain_reserve(Duration::from_secs(40), None, gce).is_ok());
        assert!(drain_reserve(Duration::from_secs(120), None, gce).is_err());
    }
}
