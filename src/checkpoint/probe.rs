//! Start-up probe of the kernel features checkpoint delivery needs: `pidfd_open` /
//! `pidfd_send_signal` (Linux 5.3) to signal a process without racing PID reuse, and `openat2`
//! with `RESOLVE_IN_ROOT` (Linux 5.6) to resolve paths inside a container's root. Without them no
//! checkpoint signal could be delivered; the agent reports it at start-up (log, `/readyz` fails
//! with the reason) instead of failing only when a notice arrives.

use std::path::Path;

use rustix::fs::OFlags;
use rustix::process::{getpid, pidfd_open, PidfdFlags};

use super::root::{ProcessRoot, Symlinks};

/// `Ok` when both features work; else what is missing, in words an operator can act on.
pub fn kernel_features() -> Result<(), String> {
    let mut missing = Vec::new();
    if let Err(e) = pidfd_open(getpid(), PidfdFlags::empty()) {
        missing.push(format!(
            "pidfd_open: {e} (needs Linux ≥ 5.3 and a seccomp profile that allows it)"
        ));
    }
    // The very resolution every path inside a pod's root goes through.
    let in_root = ProcessRoot::host().and_then(|root| {
        root.open(
            Path::new("."),
            OFlags::PATH | OFlags::DIRECTORY,
            Symlinks::InRoot,
        )
        .map_err(Into::into)
    });
    if let Err(e) = in_root {
        missing.push(format!(
            "openat2: {e} (needs Linux ≥ 5.6 and a seccomp profile that allows it)"
        ));
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "kernel feature probe failed, checkpoint signals cannot be delivered: {}",
            missing.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_kernel_has_the_features() {
        super::kernel_features().unwrap();
    }
}
