//! A drill run's directories: its fresh temp dir (agent state, pidfiles; deleted unless `--keep`)
//! and the notice dir given to the command (`--notice-dir`, else one in the temp dir).

use std::path::{Path, PathBuf};

/// One run's temp dir and notice dir.
pub struct WorkDir {
    temp: tempfile::TempDir,
    /// The notice/ack directory (`SPOTGUARD_DIR`, or the base of the nodes' ones); not created
    /// here.
    pub notice: PathBuf,
}

impl WorkDir {
    /// A fresh temp dir, and the notice dir: `notice_dir` made absolute, else `<temp>/notice`.
    pub fn new(notice_dir: Option<&Path>) -> Result<WorkDir, String> {
        let temp = tempfile::Builder::new()
            .prefix("spotguard-drill-")
            .tempdir()
            .map_err(|e| format!("creating a temp dir: {e}"))?;
        let notice = match notice_dir {
            Some(d) => absolute(d)?,
            None => temp.path().join("notice"),
        };
        Ok(WorkDir { temp, notice })
    }

    /// The temp dir.
    pub fn path(&self) -> &Path {
        self.temp.path()
    }

    /// The agent's state dir (in the temp dir).
    pub fn state(&self) -> PathBuf {
        self.path().join("state")
    }

    /// Drop (delete) the temp dir, or keep it (`--keep`).
    pub fn keep(self, keep: bool) {
        if keep {
            let _ = self.temp.keep();
        }
    }
}

/// `d` made absolute (relative to the current directory).
pub fn absolute(d: &Path) -> Result<PathBuf, String> {
    std::path::absolute(d).map_err(|e| format!("{}: {e}", d.display()))
}

/// Create `d` and its parents.
pub fn create(d: &Path) -> Result<(), String> {
    std::fs::create_dir_all(d).map_err(|e| format!("creating {}: {e}", d.display()))
}
