//! A tmpfs of a given size (a small staging volume that fills), unmounted on drop. Needs root.

use std::io::Write;
use std::path::{Path, PathBuf};

/// A tmpfs mounted at `path`.
pub struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    /// Mount a tmpfs of `bytes` at `path` (created if missing); panics when the mount fails
    /// (test helper).
    pub fn mount(path: &Path, bytes: u64) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        let target = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        let opts = std::ffi::CString::new(format!("size={bytes},mode=0700")).unwrap();
        // SAFETY: mount(2) with NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                c"spotguard-test".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "these tests need root to mount a tmpfs: {}",
            std::io::Error::last_os_error()
        );
        Tmpfs {
            path: path.to_path_buf(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Something else fills the volume: a file `name` under it written until the volume is
    /// full (`ENOSPC`). Its bytes.
    pub fn fill(&self, name: &str) -> u64 {
        let mut f = std::fs::File::create(self.path.join(name)).unwrap();
        let block = vec![0xa5u8; 64 << 10];
        let mut written = 0u64;
        loop {
            match f.write(&block) {
                Ok(0) => return written,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => return written,
                Err(e) => panic!("filling {}: {e}", self.path.display()),
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = std::ffi::CString::new(self.path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: umount2(2) with a NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}
