//! What the command writes into its notice dir (`SPOTGUARD_DIR`) that the drill reads back: the
//! acks (`ack-<pid>.json`, the plain `ack`) and the helper's resume records (`resume-<pid>.json`,
//! written by `spotguard.resumed(step)`: the step a process resumed from, when, its rank and world
//! size, and under `--elastic` the last step it reached). Bounded reads: this is the command's
//! output, read like the agent reads acks.

use std::path::Path;

use jiff::Timestamp;

use super::report::AckRow;

/// Largest file read (the agent's ack limit).
const MAX_BYTES: u64 = 64 * 1024;

fn read_json(path: &Path) -> Option<(serde_json::Value, std::fs::Metadata)> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    if !meta.is_file() || meta.len() > MAX_BYTES {
        return None;
    }
    let body = std::fs::read(path).ok()?;
    Some((serde_json::from_slice(&body).ok()?, meta))
}

fn unix(t: Option<f64>) -> Option<Timestamp> {
    t.and_then(|t| Timestamp::from_microsecond((t * 1e6) as i64).ok())
}

/// One `resume-<pid>.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ResumeRow {
    pub pid: i64,
    /// The step it resumed from (0: a fresh start).
    pub step: i64,
    /// When it resumed (the writer's clock).
    pub at: Timestamp,
    pub rank: Option<i64>,
    pub world_size: Option<i64>,
    /// The last step it reported reaching (`step` when it never reported progress).
    pub last_step: i64,
    /// The node it belongs to, when one launcher runs every node (`--node-env`).
    pub node: Option<String>,
}

/// Every resume record in `dir`, oldest first.
pub fn read_resumes(dir: &Path) -> Vec<ResumeRow> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        // resume-<pid>.json, or resume-<pid>-<n>.json for a process's n-th resume.
        let Some(pid) = name
            .strip_prefix("resume-")
            .and_then(|r| r.strip_suffix(".json"))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i64>().ok())
        else {
            continue;
        };
        let Some((body, _)) = read_json(&entry.path()) else {
            continue;
        };
        let int = |k: &str| body.get(k).and_then(|v| v.as_i64());
        let (Some(step), Some(at)) = (int("step"), unix(body.get("ts").and_then(|t| t.as_f64())))
        else {
            continue;
        };
        out.push(ResumeRow {
            pid,
            step,
            at,
            rank: int("rank"),
            world_size: int("world_size"),
            last_step: int("last_step").unwrap_or(step).max(step),
            node: body
                .get("node")
                .and_then(|n| n.as_str())
                .map(str::to_string),
        });
    }
    out.sort_by(|a, b| a.at.cmp(&b.at).then(a.pid.cmp(&b.pid)));
    out
}

/// Remove what an earlier run left in a drill-owned notice dir (acks, resume records, the
/// notice), so that this run reads only its own.
pub fn clear(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours = name == "ack"
            || name == "notice.json"
            || (name.ends_with(".json")
                && (name.starts_with("ack-") || name.starts_with("resume-")));
        if ours {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Every ack in the notice dir (`ack-<pid>.json` and the plain `ack`), for the verdict.
pub fn read_acks(dir: &Path) -> Vec<AckRow> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let plain = name == "ack";
        let per_process = name.starts_with("ack-") && name.ends_with(".json");
        if !(plain || per_process) {
            continue;
        }
        // Bounded read: the drill reads what the command wrote, like the agent does.
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() || meta.len() > 64 * 1024 {
            continue;
        }
        let body = std::fs::read(entry.path())
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let mtime = meta
            .modified()
            .ok()
            .and_then(|m| Timestamp::try_from(m).ok());
        let get = |k: &str| body.as_ref().and_then(|b| b.get(k));
        let written = get("ts")
            .and_then(|t| t.as_f64())
            .and_then(|t| Timestamp::from_microsecond((t * 1e6) as i64).ok())
            .or(mtime);
        out.push(AckRow {
            file: name,
            state: get("state")
                .and_then(|s| s.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| if plain { "done".into() } else { "?".into() }),
            step: get("step").and_then(|s| s.as_i64()),
            checkpoint: get("checkpoint")
                .and_then(|s| s.as_str())
                .map(str::to_string),
            staged: get("staged").and_then(|s| s.as_str()).map(str::to_string),
            written,
        });
    }
    out.sort_by(|a, b| a.written.cmp(&b.written).then(a.file.cmp(&b.file)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_records_of_every_resume_of_a_process_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let w = |name: &str, body: &str| std::fs::write(dir.path().join(name), body).unwrap();
        w(
            "resume-42.json",
            r#"{"step":0,"ts":1000.0,"rank":0,"world_size":4,"last_step":90}"#,
        );
        w(
            "resume-42-2.json",
            r#"{"step":90,"ts":1010.0,"rank":0,"world_size":2,"node":"a"}"#,
        );
        w("resume-x.json", r#"{"step":1,"ts":1.0}"#);
        w("resume-43.json", "not json");
        let rows = read_resumes(dir.path());
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!((rows[0].pid, rows[0].step, rows[0].last_step), (42, 0, 90));
        assert_eq!((rows[1].pid, rows[1].step, rows[1].last_step), (42, 90, 90));
        assert_eq!(rows[1].node.as_deref(), Some("a"));
        assert_eq!(rows[1].world_size, Some(2));
    }
}
