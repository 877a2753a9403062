//! Map Kubernetes containers to host PIDs through `/proc/*/cgroup` (docs/checkpoint-protocol.md, discovery).
//!
//! One scan of every process's cgroup file builds a [`ProcIndex`] keyed by (pod UID, container ID).
//! Both cgroup versions are read (`N:controllers:/path` for v1, `0::/path` for v2) and both kubelet
//! drivers are understood:
//!
//! - systemd: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope`
//!   (also `crio-<id>.scope`, `docker-<id>.scope`; Guaranteed pods sit directly in
//!   `kubepods-pod<uid>.slice`; crun may add a `container` sub-cgroup below the scope);
//! - cgroupfs: `/kubepods/burstable/pod<uid>/<id>`, `/kubepods/pod<uid>/<id>`.
//!
//! Leading `..` segments (the reader sits in a cgroup namespace) and any prefix before the kubepods
//! hierarchy (kind's `/kubelet.slice/…`, a nested runtime) are ignored. `crio-conmon-<id>` (the
//! CRI-O monitor, which carries the *container's* id) is skipped; the sandbox (pause) container is
//! indexed like any other but its id is never among a pod's `containerStatuses`, so looking up by
//! container id leaves it out.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::procfs::{is_gone, ProcFs};
use super::{Error, TargetContainer, TargetProcess};

/// One line of `/proc/<pid>/cgroup`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CgroupLine<'a> {
    /// Hierarchy id; `0` is the unified (v2) hierarchy.
    pub hierarchy: u32,
    /// Comma-separated controllers (`cpu,cpuacct`, `name=systemd`), empty for v2.
    pub controllers: &'a str,
    /// Path relative to the reader's cgroup namespace root; may start with `/..`.
    pub path: &'a str,
}

impl CgroupLine<'_> {
    /// The cgroup v2 line (`0::/path`).
    pub fn is_unified(&self) -> bool {
        self.hierarchy == 0 && self.controllers.is_empty()
    }

    /// The v1 hierarchy systemd tracks units in (`N:name=systemd:/path`).
    pub fn is_systemd(&self) -> bool {
        self.controllers.split(',').any(|c| c == "name=systemd")
    }
}

/// Parse `N:controllers:/path`. The path may itself contain `:`. `None` for malformed lines.
pub fn parse_line(line: &str) -> Option<CgroupLine<'_>> {
    let mut parts = line.splitn(3, ':');
    let hierarchy = parts.next()?.trim().parse::<u32>().ok()?;
    let controllers = parts.next()?;
    let path = parts.next()?.trim_end_matches(['\n', '\r']);
    if !path.starts_with('/') {
        return None;
    }
    Some(CgroupLine {
        hierarchy,
        controllers,
        path,
    })
}

/// The path segments that matter: empty, `.` and `..` segments dropped.
pub fn segments(path: &str) -> impl Iterator<Item = &str> {
    path.split('/')
        .filter(|s| !s.is_empty() && *s != "." && *s != "..")
}

/// Where a cgroup path places a process in Kubernetes terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeCgroup {
    /// Pod UID with dashes (as in `metadata.uid`).
    pub pod_uid: String,
    /// Container ID (no runtime prefix); `None` for a process in the pod cgroup itself.
    pub container_id: Option<String>,
}

/// Recognise a kubelet-shaped cgroup path (both drivers). `None` for non-Kubernetes paths and for
/// `crio-conmon-*` monitors.
pub fn parse_kube_path(path: &str) -> Option<KubeCgroup> {
    let segs: Vec<&str> = segments(path).collect();
    for (i, seg) in segs.iter().enumerate() {
        let (pod_uid, systemd) = if let Some(uid) = systemd_pod_slice(seg) {
            (uid, true)
        } else if let Some(uid) = cgroupfs_pod_dir(seg) {
            if !segs[..i].iter().any(|s| is_kubepods_dir(s)) {
                continue;
            }
            (uid, false)
        } else {
            continue;
        };
        let container_id = match segs.get(i + 1) {
            None => None,
            Some(next) => match container_segment(next, systemd) {
                ContainerSeg::Id(id) => Some(id),
                ContainerSeg::Monitor => return None,
                ContainerSeg::Other => None,
            },
        };
        return Some(KubeCgroup {
            pod_uid,
            container_id,
        });
    }
    None
}

/// `kubepods-pod<uid>.slice`, `kubepods-burstable-pod<uid>.slice`,
/// `kubelet-kubepods-besteffort-pod<uid>.slice`: the uid with `_` turned back into `-`.
fn systemd_pod_slice(seg: &str) -> Option<String> {
    let stem = seg.strip_suffix(".slice")?;
    let (prefix, uid) = stem.rsplit_once("-pod")?;
    if !prefix.split('-').any(|p| p == "kubepods") || !valid_uid(uid) {
        return None;
    }
    Some(uid.replace('_', "-"))
}

/// `pod<uid>` under a `kubepods` directory (cgroupfs driver).
fn cgroupfs_pod_dir(seg: &str) -> Option<String> {
    let uid = seg.strip_prefix("pod")?;
    valid_uid(uid).then(|| uid.to_string())
}

fn is_kubepods_dir(seg: &str) -> bool {
    seg == "kubepods" || seg.starts_with("kubepods-") || seg.starts_with("kubepods.")
}

/// Pod UIDs are UUIDs (`8-4-4-4-12` hex) or, for static pods, 32 hex digits.
fn valid_uid(uid: &str) -> bool {
    (32..=36).contains(&uid.len())
        && uid
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'_')
}

enum ContainerSeg {
    Id(String),
    Monitor,
    Other,
}

fn container_segment(seg: &str, systemd: bool) -> ContainerSeg {
    let stem = seg.strip_suffix(".scope").unwrap_or(seg);
    if stem.starts_with("crio-conmon-") {
        return ContainerSeg::Monitor;
    }
    let id = if seg.ends_with(".scope") {
        // `cri-containerd-<id>`, `crio-<id>`, `docker-<id>`, `cri-dockerd-<id>`: the id is hex, so
        // it is whatever follows the last dash.
        stem.rsplit_once('-').map(|(_, id)| id).unwrap_or(stem)
    } else if systemd {
        return ContainerSeg::Other;
    } else {
        stem.strip_prefix("crio-")
            .or_else(|| stem.strip_prefix("docker-"))
            .unwrap_or(stem)
    };
    if !id.is_empty() && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        ContainerSeg::Id(id.to_string())
    } else {
        ContainerSeg::Other
    }
}

/// What the index keeps per process.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Indexed {
    pid: i32,
    ppid: i32,
    start_time: u64,
    /// PID 1 of its own PID namespace (last `NSpid` field is 1, more than one field).
    ns_init: bool,
}

/// (pod UID, container ID).
type ContainerKey = (String, String);

/// Processes of every Kubernetes container on this host, from one scan of `/proc/*/cgroup`.
#[derive(Clone, Debug, Default)]
pub struct ProcIndex {
    by_container: HashMap<ContainerKey, Vec<Indexed>>,
}

impl ProcIndex {
    /// Scan every process under `proc_root` once. Processes that vanish mid-scan are skipped;
    /// unreadable or malformed entries are logged and skipped; only a failure to list the proc
    /// root is an error.
    pub fn scan(proc_root: &Path) -> Result<Self, Error> {
        let proc = ProcFs::new(proc_root);
        let mut index = ProcIndex::default();
        for pid in proc.pids()? {
            match index_one(&proc, pid) {
                Ok(Some((key, entry))) => index.by_container.entry(key).or_default().push(entry),
                Ok(None) => {}
                Err(e) if is_gone(&e) => {}
                Err(e) => tracing::debug!(pid, error = %e, "skipping process in cgroup scan"),
            }
        }
        for procs in index.by_container.values_mut() {
            procs.sort_by_key(|p| (p.start_time, p.pid));
        }
        Ok(index)
    }

    /// Number of containers found.
    pub fn len(&self) -> usize {
        self.by_container.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_container.is_empty()
    }

    /// The processes of one container, by pod UID (with dashes) and container ID (bare, see
    /// [`crate::checkpoint::pods::container_id`]). The returned container is named after the container ID
    /// (callers set the container name); `init_pid` is the PID-namespace init when the container
    /// has its own PID namespace, else the earliest process whose parent is outside the container;
    /// `root_pid` is the same process (its `/proc/<pid>/root` is the container's filesystem).
    pub fn container(&self, pod_uid: &str, container_id: &str) -> Option<TargetContainer> {
        let procs = self
            .by_container
            .get(&(pod_uid.to_string(), container_id.to_string()))?;
        let init = procs.iter().find(|p| p.ns_init).or_else(|| {
            procs
                .iter()
                .find(|p| !procs.iter().any(|q| q.pid == p.ppid))
        });
        let init_pid = init.map(|p| p.pid);
        Some(TargetContainer {
            name: container_id.to_string(),
            root_pid: init_pid.or_else(|| procs.first().map(|p| p.pid)),
            init_pid,
            processes: procs
                .iter()
                .map(|p| TargetProcess {
                    pid: p.pid,
                    start_time: p.start_time,
                })
                .collect(),
        })
    }
}

impl ProcIndex {
    /// Index only `pids` (a container's `cgroup.procs`), with the same reading and the same rules
    /// as [`ProcIndex::scan`]: each process is keyed by its own `/proc/<pid>/cgroup`, so the result
    /// for a container is what a full scan would give for it whenever `pids` holds every process
    /// of that container.
    pub fn of_pids(proc_root: &Path, pids: impl IntoIterator<Item = i32>) -> Self {
        let proc = ProcFs::new(proc_root);
        let mut index = ProcIndex::default();
        for pid in pids {
            match index_one(&proc, pid) {
                Ok(Some((key, entry))) => index.by_container.entry(key).or_default().push(entry),
                Ok(None) => {}
                Err(e) if is_gone(&e) => {}
                Err(e) => {
                    tracing::debug!(pid, error = %e, "skipping process of a container cgroup")
                }
            }
        }
        for procs in index.by_container.values_mut() {
            procs.sort_by_key(|p| (p.start_time, p.pid));
            procs.dedup_by_key(|p| p.pid);
        }
        index
    }
}

/// The cgroup hierarchies mounted in this process's mount namespace (`cgroup` and `cgroup2`
/// entries of `/proc/self/mountinfo`), each mount point once.
pub fn cgroup_mounts() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .map(|text| parse_cgroup_mounts(&text))
        .unwrap_or_default()
}

fn parse_cgroup_mounts(mountinfo: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fstype = right.split(' ').next().unwrap_or("");
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        let Some(mount_point) = left.split(' ').nth(4) else {
            continue;
        };
        let path = PathBuf::from(unescape_mountinfo(mount_point));
        if !out.contains(&path) {
            out.push(path);
        }
    }
    out
}

/// `\040` (space), `\011`, `\012`, `\134` as mountinfo writes them.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            if let Ok(byte) = u8::try_from(v) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Deepest cgroup directory [`ContainerCgroups::locate`] descends to.
const MAX_CGROUP_DEPTH: usize = 16;

/// Where each Kubernetes container's cgroup directories are (one per hierarchy it is in), found
/// by walking the cgroup hierarchies — as many directories as the node has cgroups, not one read
/// per process. Its processes are then the `cgroup.procs` of those directories and their
/// sub-cgroups ([`ContainerCgroups::pids`]).
#[derive(Clone, Debug, Default)]
pub struct ContainerCgroups {
    dirs: HashMap<ContainerKey, Vec<PathBuf>>,
}

impl ContainerCgroups {
    /// Walk every hierarchy in `mounts`; a directory whose path (relative to its mount) is a
    /// container's cgroup by [`parse_kube_path`] is recorded and not descended further.
    pub fn locate(mounts: &[PathBuf]) -> Self {
        let mut found = ContainerCgroups::default();
        for mount in mounts {
            let mut stack = vec![(mount.clone(), String::new(), 0usize)];
            while let Some((dir, rel, depth)) = stack.pop() {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries.flatten() {
                    if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                        continue;
                    }
                    let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                        continue;
                    };
                    let child_rel = format!("{rel}/{name}");
                    match parse_kube_path(&child_rel) {
                        Some(KubeCgroup {
                            pod_uid,
                            container_id: Some(id),
                        }) => found
                            .dirs
                            .entry((pod_uid, id))
                            .or_default()
                            .push(entry.path()),
                        _ if depth + 1 < MAX_CGROUP_DEPTH => {
                            stack.push((entry.path(), child_rel, depth + 1))
                        }
                        _ => {}
                    }
                }
            }
        }
        found
    }

    /// The container's cgroup directories, if it was found and they all still exist.
    pub fn dirs(&self, pod_uid: &str, container_id: &str) -> Option<&[PathBuf]> {
        let dirs = self
            .dirs
            .get(&(pod_uid.to_string(), container_id.to_string()))?;
        dirs.iter()
            .all(|d| d.join("cgroup.procs").exists())
            .then_some(dirs.as_slice())
    }

    /// Every PID in the `cgroup.procs` of `dirs` and of their sub-cgroups (PIDs as this process's
    /// PID namespace numbers them). `None` when a directory cannot be read (gone: the container
    /// stopped or was moved).
    pub fn pids(dirs: &[PathBuf]) -> Option<Vec<i32>> {
        let mut pids = Vec::new();
        for top in dirs {
            let mut stack = vec![(top.clone(), 0usize)];
            while let Some((dir, depth)) = stack.pop() {
                let text = std::fs::read_to_string(dir.join("cgroup.procs")).ok()?;
                pids.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
                if depth + 1 >= MAX_CGROUP_DEPTH {
                    continue;
                }
                if let Ok(entries) = std::fs::read_dir(&dir) {
                    for entry in entries.flatten() {
                        if entry.file_type().is_ok_and(|t| t.is_dir()) {
                            stack.push((entry.path(), depth + 1));
                        }
                    }
                }
            }
        }
        pids.sort_unstable();
        pids.dedup();
        Some(pids)
    }
}

/// How [`find_containers`] found the processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoundBy {
    /// The containers' own `cgroup.procs`, at the directories already located.
    Cgroups,
    /// The containers' own `cgroup.procs`, after walking the hierarchies to locate them.
    Located,
    /// A scan of every process: no cgroup hierarchy is mounted, the proc root is not this
    /// process's own `/proc` (whose PIDs `cgroup.procs` lists), a container's cgroup was not
    /// found, or it vanished while read.
    FullScan,
}

/// The processes of the `wanted` containers: read from their own cgroups (O(their processes),
/// plus one walk of the hierarchies when one of them is not in `located` yet), or, when that
/// cannot be trusted (see [`FoundBy::FullScan`]), from one [`ProcIndex::scan`]. Either way each
/// process is keyed by its own `/proc/<pid>/cgroup`, so a wanted container gets exactly what the
/// full scan gives it. Returns a newly located map when the hierarchies were walked.
pub fn find_containers(
    proc_root: &Path,
    mounts: &[PathBuf],
    located: &ContainerCgroups,
    wanted: &[(String, String)],
) -> Result<(ProcIndex, FoundBy, Option<ContainerCgroups>), Error> {
    let own_proc = proc_root == Path::new(super::procfs::PROC_ROOT);
    if mounts.is_empty() || !own_proc {
        return Ok((ProcIndex::scan(proc_root)?, FoundBy::FullScan, None));
    }
    let collect = |map: &ContainerCgroups| -> Option<Vec<i32>> {
        let mut pids = Vec::new();
        for (uid, id) in wanted {
            pids.extend(ContainerCgroups::pids(map.dirs(uid, id)?)?);
        }
        Some(pids)
    };
    if let Some(pids) = collect(located) {
        return Ok((ProcIndex::of_pids(proc_root, pids), FoundBy::Cgroups, None));
    }
    let relocated = ContainerCgroups::locate(mounts);
    match collect(&relocated) {
        Some(pids) => Ok((
            ProcIndex::of_pids(proc_root, pids),
            FoundBy::Located,
            Some(relocated),
        )),
        None => Ok((
            ProcIndex::scan(proc_root)?,
            FoundBy::FullScan,
            Some(relocated),
        )),
    }
}

impl ContainerCgroups {
    /// Whether every one of `wanted` has its directories here.
    pub fn has_all(&self, wanted: &[(String, String)]) -> bool {
        wanted.iter().all(|(uid, id)| self.dirs(uid, id).is_some())
    }
}

fn index_one(proc: &ProcFs, pid: i32) -> Result<Option<(ContainerKey, Indexed)>, Error> {
    let text = proc.cgroup(pid)?;
    let Some(kube) = text
        .lines()
        .filter_map(parse_line)
        .find_map(|l| parse_kube_path(l.path))
    else {
        return Ok(None);
    };
    let Some(container_id) = kube.container_id else {
        return Ok(None);
    };
    let stat = proc.stat(pid)?;
    if stat.exited() {
        return Ok(None);
    }
    let status = proc.status(pid)?;
    let entry = Indexed {
        pid,
        ppid: stat.ppid,
        start_time: stat.start_time,
        ns_init: status.nspid.len() > 1 && status.ns_pid() == Some(1),
    };
    Ok(Some(((kube.pod_uid, container_id), entry)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f9ef1a7-3c1a-4e5b-9d2e-6b1c2a3d4e5f";
    const ID: &str = "4c9a2b7e1d0f3a5b6c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b";

    fn kube(line: &str) -> Option<KubeCgroup> {
        parse_kube_path(parse_line(line)?.path)
    }

    #[test]
    fn parses_line_shapes() {
        let l = parse_line("12:cpu,cpuacct:/kubepods/pod1").unwrap();
        assert_eq!(
            (l.hierarchy, l.controllers, l.path),
            (12, "cpu,cpuacct", "/kubepods/pod1")
        );
        assert!(!l.is_unified());
        let l = parse_line("0::/system.slice/a:b.service").unwrap();
        assert_eq!(l.path, "/system.slice/a:b.service");
        assert!(l.is_unified());
        assert!(parse_line("1:name=systemd:/").unwrap().is_systemd());
        for bad in ["", "x::/", "0:/", "0::relative", "garbage", "-1::/"] {
            assert_eq!(parse_line(bad), None, "{bad:?}");
        }
    }

    /// Real-world lines (systemd and cgroupfs drivers, three runtimes, v1 and v2, namespaced).
    #[test]
    fn kubelet_paths_table() {
        let u = UID.replace('-', "_");
        type Want<'a> = Option<(&'a str, Option<&'a str>)>;
        let table: Vec<(String, Want)> = vec![
            // systemd driver, containerd, burstable, v2
            (format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope"), Some((UID, Some(ID)))),
            // Guaranteed: no QoS level
            (format!("0::/kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope"), Some((UID, Some(ID)))),
            // besteffort, CRI-O, v1 memory
            (format!("4:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/crio-{ID}.scope"), Some((UID, Some(ID)))),
            // CRI-O with crun's `container` sub-cgroup
            (format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/crio-{ID}.scope/container"), Some((UID, Some(ID)))),
            // conmon carries the container id but is not the container
            (format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/crio-conmon-{ID}.scope"), None),
            // docker / cri-dockerd, systemd hierarchy v1
            (format!("1:name=systemd:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice/docker-{ID}.scope"), Some((UID, Some(ID)))),
            // cgroup namespace: leading `..` segments
            (format!("0::/../../kubepods-burstable-pod{u}.slice/cri-containerd-{ID}.scope"), Some((UID, Some(ID)))),
            (format!("0::/../../../kubepods.slice/kubepods-pod{u}.slice/cri-containerd-{ID}.scope"), Some((UID, Some(ID)))),
            // kind / nested kubelet
            (format!("0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{u}.slice/cri-containerd-{ID}.scope"), Some((UID, Some(ID)))),
            // cgroupfs driver
            (format!("3:cpu,cpuacct:/kubepods/burstable/pod{UID}/{ID}"), Some((UID, Some(ID)))),
            (format!("3:cpu,cpuacct:/kubepods/pod{UID}/{ID}"), Some((UID, Some(ID)))),
            (format!("0::/kubepods/besteffort/pod{UID}/{ID}"), Some((UID, Some(ID)))),
            (format!("0::/../kubepods/burstable/pod{UID}/{ID}"), Some((UID, Some(ID)))),
            (format!("5:pids:/kubelet/kubepods/burstable/pod{UID}/{ID}"), Some((UID, Some(ID)))),
            (format!("4:memory:/process_api/abc/kubepods/pod{UID}/crio-{ID}"), Some((UID, Some(ID)))),
            (format!("4:memory:/kubepods/pod{UID}/crio-conmon-{ID}"), None),
            // a process in the pod cgroup itself
            (format!("0::/kubepods/burstable/pod{UID}"), Some((UID, None))),
            (format!("0::/kubepods.slice/kubepods-pod{u}.slice"), Some((UID, None))),
            // static pod: 32 hex uid
            ("0::/kubepods/burstable/podd41d8cd98f00b204e9800998ecf8427e/abc123".to_string(), Some(("d41d8cd98f00b204e9800998ecf8427e", Some("abc123")))),
            // not Kubernetes
            ("0::/".to_string(), None),
            ("0::/system.slice/containerd.service".to_string(), None),
            ("1:name=systemd:/user.slice/user-1000.slice/session-2.scope".to_string(), None),
            (format!("0::/docker/{ID}"), None),
            (format!("0::/pod{UID}/{ID}"), None),
            (format!("0::/system.slice/mypod-pod{u}.slice/x.scope"), None),
            ("0::/kubepods/burstable/podnot-a-uid/abc".to_string(), None),
        ];
        for (line, want) in table {
            let got = kube(&line);
            let want = want.map(|(uid, id)| KubeCgroup {
                pod_uid: uid.to_string(),
                container_id: id.map(str::to_string),
            });
            assert_eq!(got, want, "{line}");
        }
    }

    /// The status IDs the index is looked up with come from the production parser
    /// ([`crate::checkpoint::pods::container_id`]): the ID it returns is the bare ID the cgroup
    /// paths carry.
    #[test]
    fn container_ids_from_status() {
        use crate::checkpoint::pods::container_id;
        assert_eq!(
            container_id(&format!("containerd://{ID}")),
            Some(("containerd", ID))
        );
        assert_eq!(container_id(&format!("cri-o://{ID}")), Some(("cri-o", ID)));
        assert_eq!(container_id("docker://abc123"), Some(("docker", "abc123")));
        for bad in [
            "",
            "abc",
            "containerd://",
            "://abc",
            "containerd://a/b",
            "docker://../x",
        ] {
            assert_eq!(container_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cgroup_mounts_from_mountinfo() {
        let text = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime shared:4 - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
42 31 0:38 / /host\\040cg rw - cgroup2 cgroup2 rw
43 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
garbage
44 1 0:5 / /proc rw - proc proc rw
";
        assert_eq!(
            parse_cgroup_mounts(text),
            [
                "/sys/fs/cgroup/cpu",
                "/sys/fs/cgroup/systemd",
                "/sys/fs/cgroup/unified",
                "/host cg"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn scan_fake_proc_tree() {
        let dir = tempfile::tempdir().unwrap();
        let u = UID.replace('-', "_");
        let scope =
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice");
        let mk = |pid: i32, ppid: i32, start: u64, nspid: &str, cgroup: &str| {
            let p = dir.path().join(pid.to_string());
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("cgroup"), cgroup).unwrap();
            std::fs::write(
                p.join("stat"),
                format!(
                    "{pid} (my (proc)) S {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 1 1\n"
                ),
            )
            .unwrap();
            std::fs::write(
                p.join("status"),
                format!("Name:\tx\nPPid:\t{ppid}\nUid:\t0 0 0 0\nGid:\t0 0 0 0\nNSpid:\t{nspid}\nSigIgn:\t0\nSigCgt:\t0\n"),
            )
            .unwrap();
        };
        // container with its own pid namespace: init has NSpid ... 1
        mk(
            100,
            90,
            500,
            "100\t1",
            &format!("0::/../..{scope}/cri-containerd-{ID}.scope\n"),
        );
        mk(
            101,
            100,
            501,
            "101\t7",
            &format!("0::{scope}/cri-containerd-{ID}.scope\n"),
        );
        // sandbox of the same pod
        mk(
            99,
            90,
            400,
            "99\t1",
            &format!("0::{scope}/cri-containerd-feed.scope\n"),
        );
        // host process, garbage process
        mk(1, 0, 1, "1", "0::/init.scope\n");
        mk(5, 1, 2, "5", "\u{0}garbage\n");
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        std::fs::create_dir_all(dir.path().join("77")).unwrap(); // vanished: no files

        let index = ProcIndex::scan(dir.path()).unwrap();
        assert_eq!(index.len(), 2);
        let c = index.container(UID, ID).unwrap();
        assert_eq!(c.init_pid, Some(100));
        assert_eq!(c.root_pid, Some(100));
        assert_eq!(
            c.processes,
            vec![
                TargetProcess {
                    pid: 100,
                    start_time: 500
                },
                TargetProcess {
                    pid: 101,
                    start_time: 501
                }
            ]
        );
        assert!(index.container(UID, "other").is_none());
        assert!(index.container("nope", ID).is_none());
        assert!(ProcIndex::scan(&dir.path().join("missing")).is_err());
    }
}
