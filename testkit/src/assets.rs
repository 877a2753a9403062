//! Outside binaries the tests run (the Kubernetes control plane, AWS's `ec2-metadata-mock`):
//! where the checkout, `../shared/k8s` and cargo's target directory are, and the one way an
//! archive is unpacked into a cache under `target/`, once, even when several test binaries race
//! to do it (filled in a staging sibling, then renamed into place with a `.complete` stamp).

use std::path::{Path, PathBuf};

/// The repository root (the workspace that holds `testkit/`).
pub fn repo_root() -> PathBuf {
    let testkit = Path::new(env!("CARGO_MANIFEST_DIR"));
    testkit.parent().unwrap_or(testkit).to_path_buf()
}

/// cargo's target directory: `CARGO_TARGET_DIR` when set, else `<repo>/target`.
pub fn target_dir() -> PathBuf {
    // A relative CARGO_TARGET_DIR is cargo's, from the checkout's root: made absolute, so the
    // binaries unpacked under it still resolve for a child started in another directory.
    std::env::var_os("CARGO_TARGET_DIR")
        .map(|d| repo_root().join(d))
        .unwrap_or_else(|| repo_root().join("target"))
}

/// `../shared/k8s` beside the checkout.
pub fn shared_dir() -> PathBuf {
    repo_root().join("../shared/k8s")
}

/// A regular file with an execute bit.
pub fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether a cache directory filled by [`fill_once`] is complete.
pub fn filled(dir: &Path) -> bool {
    dir.join(".complete").is_file()
}

/// Fill the cache directory `dest` with `fill` (given an empty staging directory beside it)
/// unless it is already complete. The staging directory is renamed into place with a
/// `.complete` stamp; a racing filler that finished first wins, and a failed fill leaves
/// nothing behind.
pub fn fill_once(
    dest: &Path,
    fill: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    if filled(dest) {
        return Ok(());
    }
    let tmp = staging(dest).map_err(|e| format!("staging beside {}: {e}", dest.display()))?;
    if let Err(e) = fill(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    publish(&tmp, dest).map_err(|e| format!("installing {}: {e}", dest.display()))
}

fn staging(dest: &Path) -> std::io::Result<PathBuf> {
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let tmp = parent.join(format!(
        ".staging-{}-{}",
        std::process::id(),
        fastrand::u64(..)
    ));
    std::fs::create_dir_all(&tmp)?;
    Ok(tmp)
}

fn publish(tmp: &Path, dest: &Path) -> std::io::Result<()> {
    std::fs::write(tmp.join(".complete"), b"")?;
    match std::fs::rename(tmp, dest) {
        Ok(()) => Ok(()),
        // Someone else finished first (or a stale incomplete copy is in the way).
        Err(_) if filled(dest) => {
            let _ = std::fs::remove_dir_all(tmp);
            Ok(())
        }
        Err(_) => {
            std::fs::remove_dir_all(dest)?;
            std::fs::rename(tmp, dest)
        }
    }
}
