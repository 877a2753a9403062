//! A FUSE mount nobody answers: every lookup below it blocks in the kernel (the way a dead NFS
//! server or a stuck FUSE daemon holds a checkpoint dir). Dropping it aborts the connection, so
//! stuck threads get `ENOTCONN` and go on, and detaches the mount. Needs root and `/dev/fuse`.
//!
//! Two kinds: [`HungMount::new`] never even answers the kernel's `INIT`, so every request waits
//! unsent and a fatal signal (SIGKILL, the process's exit) still ends a thread waiting on it;
//! [`HungMount::stuck_daemon`] is a daemon that answered `INIT` and then takes every request and
//! never answers it: a thread waiting on a request the daemon has taken can be ended by nothing
//! but the connection's abort (not SIGKILL, not its process's exit), as with a real stuck daemon.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// A FUSE mount nobody answers, at `path`.
pub struct HungMount {
    path: PathBuf,
    fuse: Option<OwnedFd>,
    daemon: Option<std::thread::JoinHandle<()>>,
}

impl HungMount {
    /// Mount it at `path` (created if missing); panics when the mount fails (test helper).
    pub fn new(path: &Path) -> HungMount {
        std::fs::create_dir_all(path).unwrap();
        // SAFETY: open(2) with a NUL-terminated path; the fd is owned below.
        let raw = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        assert!(
            raw >= 0,
            "these tests need root and /dev/fuse: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `raw` is a fresh fd nobody else owns.
        let fuse = unsafe { OwnedFd::from_raw_fd(raw) };
        let opts = CString::new(format!(
            "fd={},rootmode=40000,user_id=0,group_id=0,allow_other",
            fuse.as_raw_fd()
        ))
        .unwrap();
        let target = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                c"spotguard-hung".as_ptr(),
                target.as_ptr(),
                c"fuse".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(rc, 0, "mount fuse: {}", std::io::Error::last_os_error());
        HungMount {
            path: path.to_path_buf(),
            fuse: Some(fuse),
            daemon: None,
        }
    }

    /// Mount it at `path` with a daemon that answers the kernel's `INIT`, then reads every
    /// request and answers none.
    pub fn stuck_daemon(path: &Path) -> HungMount {
        let mut m = HungMount::new(path);
        let fd = m.fuse.as_ref().unwrap().as_raw_fd();
        // SAFETY: dup(2) of an fd we own; the copy is owned by the daemon thread.
        let dup = unsafe { libc::dup(fd) };
        assert!(dup >= 0, "dup: {}", std::io::Error::last_os_error());
        // SAFETY: `dup` is a fresh fd nobody else owns.
        let dev = unsafe { OwnedFd::from_raw_fd(dup) };
        m.daemon = Some(std::thread::spawn(move || stuck_daemon(dev)));
        m
    }
}

/// `FUSE_INIT`'s opcode.
const FUSE_INIT: u32 = 26;

/// Answer `INIT`, then take every request and never answer; returns when the connection is
/// aborted (reads fail).
fn stuck_daemon(dev: OwnedFd) {
    let mut buf = vec![0u8; 1 << 20 | 4096];
    loop {
        // SAFETY: read(2) into a buffer we own, within its length.
        let n = unsafe { libc::read(dev.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return;
        }
        if n < 40 {
            continue;
        }
        let opcode = u32::from_ne_bytes(buf[4..8].try_into().unwrap());
        if opcode != FUSE_INIT {
            continue; // taken, never answered
        }
        let unique = u64::from_ne_bytes(buf[8..16].try_into().unwrap());
        let minor = u32::from_ne_bytes(buf[44..48].try_into().unwrap());
        // fuse_out_header (16 bytes) + fuse_init_out (64 bytes, protocol 7.23 and later).
        let mut out = Vec::with_capacity(80);
        out.extend_from_slice(&80u32.to_ne_bytes());
        out.extend_from_slice(&0i32.to_ne_bytes());
        out.extend_from_slice(&unique.to_ne_bytes());
        out.extend_from_slice(&7u32.to_ne_bytes()); // major
        out.extend_from_slice(&minor.min(31).to_ne_bytes()); // minor
        out.extend_from_slice(&0u32.to_ne_bytes()); // max_readahead
        out.extend_from_slice(&0u32.to_ne_bytes()); // flags
        out.extend_from_slice(&0u16.to_ne_bytes()); // max_background
        out.extend_from_slice(&0u16.to_ne_bytes()); // congestion_threshold
        out.extend_from_slice(&4096u32.to_ne_bytes()); // max_write
        out.extend_from_slice(&1u32.to_ne_bytes()); // time_gran
        out.resize(80, 0);
        // SAFETY: write(2) of a buffer we own.
        unsafe { libc::write(dev.as_raw_fd(), out.as_ptr().cast(), out.len()) };
    }
}

impl HungMount {
    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for HungMount {
    fn drop(&mut self) {
        let target = CString::new(self.path.as_os_str().as_encoded_bytes()).unwrap();
        if let Some(daemon) = self.daemon.take() {
            // A forced unmount aborts the connection (the daemon's copy of the device keeps it
            // open): stuck threads get ENOTCONN, the daemon's read fails and it returns.
            // SAFETY: umount2(2) with a NUL-terminated path.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_FORCE) };
            let _ = daemon.join();
        }
        // Closing the device aborts the connection: stuck threads get ENOTCONN and go on.
        drop(self.fuse.take());
        // SAFETY: umount2(2) with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}
