//! A FUSE mount nobody answers: every lookup below it blocks in the kernel (the way a dead NFS
//! server or a stuck FUSE daemon holds a checkpoint dir). Dropping it aborts the connection, so
//! stuck threads get `ENOTCONN` and go on, and detaches the mount. Needs root and `/dev/fuse`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// A FUSE mount nobody answers, at `path`.
pub struct HungMount {
    path: PathBuf,
    fuse: Option<OwnedFd>,
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
        }
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
        // Closing the device aborts the connection: stuck threads get ENOTCONN and go on.
        drop(self.fuse.take());
        let target = CString::new(self.path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: umount2(2) with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}
