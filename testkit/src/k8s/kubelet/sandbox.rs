//! How the kubelet stand-in isolates one container process, set up between `fork` and `exec`
//! (`pre_exec`): join the kubelet-shaped cgroup; a private mount namespace with the pod's
//! volumes bind-mounted at their container paths (and the root remounted read-only for
//! `readOnlyRootFilesystem`); the capability bounding set of the `securityContext`; the user,
//! group and supplementary groups; `no_new_privs` for `allowPrivilegeEscalation: false`; die
//! with the kubelet. The process shares the host's PID and network namespaces (as with
//! `hostPID` / `hostNetwork`) and the host's root filesystem (the "image" is the host): a volume
//! mount is where it differs from the host.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Capability names as the Linux headers number them.
const CAPS: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// containerd's default capability set for a non-privileged container.
pub const RUNTIME_DEFAULT_CAPS: [&str; 14] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
];

/// The number of capability `name` (`KILL` or `CAP_KILL`, any case).
pub fn cap_number(name: &str) -> Option<u32> {
    let n = name.trim().to_ascii_uppercase();
    let n = n.strip_prefix("CAP_").unwrap_or(&n);
    CAPS.iter().position(|c| *c == n).map(|i| i as u32)
}

fn cap_last() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// One bind mount: host `src` at container path `dst`. In the child, every source is opened
/// (`O_PATH`) in the new mount namespace before the first mount, and bound from
/// `/proc/self/fd/N`: an earlier mount over one of its parents (a volume at `/tmp`) cannot hide
/// it then. (A descriptor opened before `unshare` would name a mount of the old namespace,
/// which `mount` refuses.)
pub struct Bind {
    src: CString,
    dst: CString,
    read_only: bool,
    /// `dst` could not be created on the host (a read-only or virtual filesystem such as
    /// sysfs): a tmpfs is mounted over this existing ancestor first and these directories are
    /// made in it.
    tmpfs: Option<(CString, Vec<CString>)>,
    /// `/proc/self/fd/N`, written in the child.
    via: [u8; 32],
}

/// Everything done to the child before `exec`.
pub struct Sandbox {
    cgroup_procs: Option<CString>,
    binds: Vec<Bind>,
    read_only_root: bool,
    /// Capabilities kept in the bounding set; `None`: all (privileged).
    keep_caps: Option<Vec<u32>>,
    last_cap: u32,
    uid: u32,
    gid: u32,
    groups: Vec<libc::gid_t>,
    no_new_privs: bool,
    workdir: Option<CString>,
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

impl Sandbox {
    pub fn new(uid: u32, gid: u32) -> Sandbox {
        Sandbox {
            cgroup_procs: None,
            binds: Vec::new(),
            read_only_root: false,
            keep_caps: None,
            last_cap: cap_last(),
            uid,
            gid,
            groups: Vec::new(),
            no_new_privs: false,
            workdir: None,
        }
    }

    /// Join the cgroup directory `cgroup` (must exist).
    pub fn cgroup(&mut self, cgroup: &Path) -> io::Result<()> {
        self.cgroup_procs = Some(cstr(&cgroup.join("cgroup.procs"))?);
        Ok(())
    }

    /// Bind-mount `src` at `dst`. `dst` must exist on the host, unless `tmpfs_under` names an
    /// existing ancestor of it to cover with a tmpfs (in the container's mount namespace only)
    /// in which the missing directories are made.
    pub fn bind(
        &mut self,
        src: &Path,
        dst: &Path,
        read_only: bool,
        tmpfs_under: Option<&Path>,
    ) -> io::Result<()> {
        let tmpfs = match tmpfs_under {
            Some(anc) => {
                let rest = dst.strip_prefix(anc).map_err(io::Error::other)?;
                let mut dirs = Vec::new();
                let mut p = anc.to_path_buf();
                for c in rest.components() {
                    p.push(c);
                    dirs.push(cstr(&p)?);
                }
                Some((cstr(anc)?, dirs))
            }
            None => None,
        };
        self.binds.push(Bind {
            src: cstr(src)?,
            dst: cstr(dst)?,
            read_only,
            tmpfs,
            via: [0; 32],
        });
        Ok(())
    }

    pub fn read_only_root(&mut self, yes: bool) {
        self.read_only_root = yes;
    }

    /// Keep only these capabilities (names); unknown names are an error.
    pub fn keep_caps(&mut self, names: &[String]) -> io::Result<()> {
        let mut keep = Vec::new();
        for n in names {
            keep.push(
                cap_number(n)
                    .ok_or_else(|| io::Error::other(format!("unknown capability {n:?}")))?,
            );
        }
        self.keep_caps = Some(keep);
        Ok(())
    }

    pub fn groups(&mut self, groups: Vec<u32>) {
        self.groups = groups;
    }

    pub fn no_new_privs(&mut self, yes: bool) {
        self.no_new_privs = yes;
    }

    pub fn workdir(&mut self, dir: &Path) -> io::Result<()> {
        self.workdir = Some(cstr(dir)?);
        Ok(())
    }

    fn mount_ns(&self) -> bool {
        !self.binds.is_empty() || self.read_only_root
    }

    /// Install the setup into `cmd` (runs in the child between fork and exec).
    pub fn apply(self, cmd: &mut tokio::process::Command) {
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure makes only raw syscalls on data prepared before the fork; it
        // allocates nothing.
        unsafe {
            let mut this = self;
            cmd.pre_exec(move || this.enter(parent));
        }
    }

    /// # Safety
    /// Only between fork and exec.
    unsafe fn enter(&mut self, parent: libc::pid_t) -> io::Result<()> {
        let check = |r: libc::c_int| {
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        check(libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL))?;
        if libc::getppid() != parent {
            libc::_exit(1);
        }
        if let Some(procs) = &self.cgroup_procs {
            let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            check(fd)?;
            let n = libc::write(fd, b"0".as_ptr().cast(), 1);
            libc::close(fd);
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        if self.mount_ns() {
            check(libc::unshare(libc::CLONE_NEWNS))?;
            let root = c"/";
            check(libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            if self.read_only_root {
                check(libc::mount(
                    std::ptr::null(),
                    root.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY,
                    std::ptr::null(),
                ))?;
            }
            // Open every source now, in this namespace, before any mount can hide one.
            for b in self.binds.iter_mut() {
                let fd = libc::open(b.src.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
                check(fd)?;
                write_fd_path(&mut b.via, fd);
            }
            for b in &self.binds {
                if let Some((anc, dirs)) = &b.tmpfs {
                    check(libc::mount(
                        c"tmpfs".as_ptr(),
                        anc.as_ptr(),
                        c"tmpfs".as_ptr(),
                        0,
                        c"mode=755".as_ptr().cast(),
                    ))?;
                    for d in dirs {
                        let r = libc::mkdir(d.as_ptr(), 0o755);
                        if r < 0 && *libc::__errno_location() != libc::EEXIST {
                            return Err(io::Error::last_os_error());
                        }
                    }
                }
                check(libc::mount(
                    b.via.as_ptr().cast(),
                    b.dst.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REC,
                    std::ptr::null(),
                ))?;
                // A bind mount takes its source mount's flags: a source on the filesystem of the
                // root just remounted read-only would come out read-only too, where a runtime's
                // volume (bound from the host's own mount namespace) is writable. Say each one.
                let flags = if b.read_only {
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY
                } else {
                    libc::MS_BIND | libc::MS_REMOUNT
                };
                check(libc::mount(
                    std::ptr::null(),
                    b.dst.as_ptr(),
                    std::ptr::null(),
                    flags,
                    std::ptr::null(),
                ))?;
            }
        }
        if let Some(dir) = &self.workdir {
            check(libc::chdir(dir.as_ptr()))?;
        }
        if let Some(keep) = &self.keep_caps {
            for cap in 0..=self.last_cap {
                if !keep.contains(&cap) {
                    check(libc::prctl(
                        libc::PR_CAPBSET_DROP,
                        cap as libc::c_ulong,
                        0,
                        0,
                        0,
                    ))?;
                }
            }
            // Inheritable and ambient capabilities would survive exec beside the bounding set.
            clear_inheritable()?;
            check(libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
                0,
                0,
                0,
            ))?;
        }
        check(libc::setgroups(self.groups.len(), self.groups.as_ptr()))?;
        check(libc::setgid(self.gid))?;
        check(libc::setuid(self.uid))?;
        if self.no_new_privs {
            check(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))?;
        }
        Ok(())
    }
}

/// `/proc/self/fd/<fd>` NUL-terminated into `buf`, without allocating (between fork and exec).
fn write_fd_path(buf: &mut [u8; 32], fd: libc::c_int) {
    const PREFIX: &[u8] = b"/proc/self/fd/";
    buf[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut digits = [0u8; 10];
    let mut n = fd.max(0) as u32;
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for i in 0..len {
        buf[PREFIX.len() + i] = digits[len - 1 - i];
    }
    buf[PREFIX.len() + len] = 0;
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// # Safety
/// Raw capget / capset on the calling thread.
unsafe fn clear_inheritable() -> io::Result<()> {
    const V3: u32 = 0x2008_0522;
    let mut header = CapHeader {
        version: V3,
        pid: 0,
    };
    let mut data = [CapData {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    if libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) < 0 {
        return Err(io::Error::last_os_error());
    }
    data[0].inheritable = 0;
    data[1].inheritable = 0;
    if libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fd_paths_are_written_without_allocating() {
        let mut buf = [0xffu8; 32];
        write_fd_path(&mut buf, 123);
        assert_eq!(&buf[..18], b"/proc/self/fd/123\0");
        write_fd_path(&mut buf, 0);
        assert_eq!(&buf[..16], b"/proc/self/fd/0\0");
    }

    #[test]
    fn capability_names_map_to_kernel_numbers() {
        assert_eq!(cap_number("KILL"), Some(5));
        assert_eq!(cap_number("CAP_SYS_PTRACE"), Some(19));
        assert_eq!(cap_number("sys_admin"), Some(21));
        assert_eq!(cap_number("NOPE"), None);
        for c in RUNTIME_DEFAULT_CAPS {
            assert!(cap_number(c).is_some(), "{c}");
        }
    }
}
