//! The local copy of the plan record: `<state-dir>/notice.json` ([`LocalRecord`]), kept in
//! every mode, written atomically before the checkpoint signal (no API call, no fsync: see
//! [`StateFile::save_with_targets`]) and durably at every phase after it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::Error;
use super::PlanState;
use crate::fsutil::{write_atomic_with, Durability};

/// File name of the persisted plan state inside `--state-dir`.
pub const STATE_FILE: &str = "notice.json";

/// A process the record lists as signalled (or about to be) for its plan's notice: the host PID
/// and its start time (clock ticks since boot), so that a recycled PID is never taken for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RecordedTarget {
    pub pid: i32,
    pub start: u64,
}

/// The local record file: the latest plan (its fields at the top level, so the file reads as a
/// plan record), the processes that plan signals, and the last plan of every other notice kind
/// in this life. One slot per kind: a maintenance plan never erases the rebalance checkpointed
/// before it (nor the reverse), so a restarted agent remembers both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalRecord {
    #[serde(flatten)]
    pub latest: PlanState,
    /// Written before the signal: every process the latest plan is about to signal (a superset:
    /// all discovered candidates). A restarted agent never signals them again for this notice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<RecordedTarget>,
    /// The last plan of each other kind (at most one per kind).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier: Vec<PlanState>,
}

impl LocalRecord {
    /// Every plan in the record, the latest first.
    pub fn plans(&self) -> impl Iterator<Item = &PlanState> {
        std::iter::once(&self.latest).chain(self.earlier.iter())
    }

    /// Put `state` in its kind's slot as the latest plan; `targets` replace the listed targets
    /// when given, are kept for the same notice otherwise, and are dropped for another notice.
    fn put(
        record: Option<LocalRecord>,
        state: &PlanState,
        targets: Option<&[RecordedTarget]>,
    ) -> LocalRecord {
        let Some(mut r) = record else {
            return LocalRecord {
                latest: state.clone(),
                targets: targets.map(<[RecordedTarget]>::to_vec).unwrap_or_default(),
                earlier: Vec::new(),
            };
        };
        let same_notice = r.latest.id == state.id && r.latest.kind == state.kind;
        let targets = match targets {
            Some(t) => t.to_vec(),
            None if same_notice => std::mem::take(&mut r.targets),
            None => Vec::new(),
        };
        let previous = std::mem::replace(&mut r.latest, state.clone());
        r.earlier.retain(|p| p.kind != state.kind);
        if previous.kind != state.kind {
            r.earlier.retain(|p| p.kind != previous.kind);
            r.earlier.push(previous);
        }
        r.targets = targets;
        r
    }

    /// The record without the plan `id` (the most recent earlier plan becomes the latest);
    /// `None` when nothing is left.
    fn without(mut self, id: &str) -> Option<LocalRecord> {
        self.earlier.retain(|p| p.id != id);
        if self.latest.id != id {
            return Some(self);
        }
        let newest = self
            .earlier
            .iter()
            .enumerate()
            .max_by_key(|(_, p)| p.updated_at)
            .map(|(i, _)| i)?;
        let latest = self.earlier.remove(newest);
        Some(LocalRecord {
            latest,
            targets: Vec::new(),
            earlier: self.earlier,
        })
    }
}

/// The local record of the plan state: `<state-dir>/notice.json` ([`LocalRecord`]), written
/// atomically and fsync'd. Host mode keeps only this record; Kubernetes mode keeps it beside the
/// Node annotation (the DaemonSet mounts a hostPath there), so that an API-server outage at
/// restart never makes the agent forget that it already signalled, and the record is written
/// before the checkpoint signal without waiting for the API server.
#[derive(Clone, Debug)]
pub struct StateFile {
    path: PathBuf,
    dry_run: bool,
    /// Serialises read-modify-write of the record.
    lock: std::sync::Arc<std::sync::Mutex<()>>,
    /// The record was found unreadable, and none was written since: nothing tells who was
    /// signalled for a notice.
    unreadable: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl StateFile {
    pub fn new(state_dir: &Path, dry_run: bool) -> Self {
        StateFile {
            path: state_dir.join(STATE_FILE),
            dry_run,
            lock: Default::default(),
            unreadable: Default::default(),
        }
    }

    /// Whether the record was found unreadable (corrupt, truncated, or not readable) and no
    /// record was written since.
    pub fn was_unreadable(&self) -> bool {
        self.unreadable.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn guard(&self) -> std::sync::MutexGuard<'_, ()> {
        crate::sync::lock(&self.lock)
    }

    /// The whole record, if any. Blocking.
    pub fn load_record_blocking(&self) -> Result<Option<LocalRecord>, Error> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(Error::StateRead {
                    path: self.path.display().to_string(),
                    source,
                })
            }
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::StateCorrupt {
                location: self.path.display().to_string(),
                reason: e.to_string(),
            })
    }

    fn mark(&self, unreadable: bool) {
        self.unreadable
            .store(unreadable, std::sync::atomic::Ordering::SeqCst);
    }

    /// The latest plan, if any. Blocking.
    pub fn load_blocking(&self) -> Result<Option<PlanState>, Error> {
        Ok(self.load_record_blocking()?.map(|r| r.latest))
    }

    /// Put `state` into its kind's slot (atomic write, fsync of file and directory); see
    /// [`LocalRecord`]. `targets`: the processes about to be signalled for it. Blocking.
    pub fn save_blocking(
        &self,
        state: &PlanState,
        targets: Option<&[RecordedTarget]>,
        durability: Durability,
    ) -> Result<(), Error> {
        if self.dry_run {
            tracing::info!(phase = state.phase.as_str(), notice_id = %state.id, "dry-run: would persist plan state");
            return Ok(());
        }
        let _g = self.guard();
        // An unreadable record is replaced: it said nothing usable (reported by `load`).
        let current = self.load_record_blocking().ok().flatten();
        self.write(&LocalRecord::put(current, state, targets), durability)?;
        self.mark(false);
        Ok(())
    }

    fn write(&self, record: &LocalRecord, durability: Durability) -> Result<(), Error> {
        let json = serde_json::to_vec_pretty(record).map_err(|e| Error::StateCorrupt {
            location: self.path.display().to_string(),
            reason: e.to_string(),
        })?;
        write_atomic_with(&self.path, &json, 0o644, durability).map_err(|source| {
            Error::StateWrite {
                path: self.path.display().to_string(),
                source,
            }
        })
    }

    /// Remove the plan `id` from the record (the file goes when nothing is left). Blocking.
    pub fn clear_plan_blocking(&self, id: &str) -> Result<(), Error> {
        if self.dry_run {
            return Ok(());
        }
        let _g = self.guard();
        match self.load_record_blocking() {
            Ok(Some(r)) => match r.without(id) {
                Some(rest) => self.write(&rest, Durability::FileAndDir),
                None => self.remove(),
            },
            Ok(None) => Ok(()),
            Err(_) => self.remove(),
        }
    }

    /// Remove the whole record. Blocking.
    pub fn clear_blocking(&self) -> Result<(), Error> {
        if self.dry_run {
            return Ok(());
        }
        let _g = self.guard();
        self.remove()
    }

    fn remove(&self) -> Result<(), Error> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(Error::StateWrite {
                path: self.path.display().to_string(),
                source,
            }),
        }
    }

    /// The whole record; an unreadable one is remembered ([`StateFile::was_unreadable`]).
    pub async fn load_record(&self) -> Result<Option<LocalRecord>, Error> {
        let me = self.clone();
        let r = blocking(move || me.load_record_blocking(), &self.path).await;
        if matches!(r, Err(Error::StateCorrupt { .. } | Error::StateRead { .. })) {
            self.mark(true);
        }
        r
    }

    pub async fn load(&self) -> Result<Option<PlanState>, Error> {
        let me = self.clone();
        blocking(move || me.load_blocking(), &self.path).await
    }

    pub async fn save(&self, state: &PlanState) -> Result<(), Error> {
        let (me, state) = (self.clone(), state.clone());
        blocking(
            move || me.save_blocking(&state, None, Durability::FileAndDir),
            &self.path,
        )
        .await
    }

    /// [`StateFile::save`] with the processes about to be signalled for `state`'s notice, on the
    /// signal path: written and renamed (a restarted agent reads it from the page cache, so it
    /// never signals them twice) but not fsync'd, which takes from milliseconds to hundreds of
    /// them when other writers have dirty data; the record of the `Signalled` phase, written
    /// after the signal, makes it durable. A machine that crashes in between starts a new life,
    /// in which the old record's processes are gone.
    pub async fn save_with_targets(
        &self,
        state: &PlanState,
        targets: Vec<RecordedTarget>,
    ) -> Result<(), Error> {
        let (me, state) = (self.clone(), state.clone());
        blocking(
            move || me.save_blocking(&state, Some(&targets), Durability::None),
            &self.path,
        )
        .await
    }

    pub async fn clear_plan(&self, id: &str) -> Result<(), Error> {
        let (me, id) = (self.clone(), id.to_string());
        blocking(move || me.clear_plan_blocking(&id), &self.path).await
    }

    pub async fn clear(&self) -> Result<(), Error> {
        let me = self.clone();
        blocking(move || me.clear_blocking(), &self.path).await
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
    path: &Path,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::StateWrite {
            path: path.display().to_string(),
            source: std::io::Error::other(e),
        })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::{Applied, TaintEffect};
    use crate::notice::{Cloud, NoticeKind};
    use crate::responder::record::Phase;

    fn plan(id: &str, kind: NoticeKind, phase: Phase) -> PlanState {
        PlanState {
            id: id.into(),
            kind,
            source: Cloud::Aws,
            deadline: Some("2026-11-25T10:02:00Z".parse().unwrap()),
            phase,
            signalled_at: Some("2026-11-25T10:00:01Z".parse().unwrap()),
            applied: Applied {
                cordoned: true,
                taint_effect: Some(TaintEffect::NoSchedule),
            },
            boot_id: Some("0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11".into()),
            restart: false,
            detail: "spot instance-action terminate at 2026-11-25T10:02:00Z".into(),
            failure: None,
            updated_at: "2026-11-25T10:00:02Z".parse().unwrap(),
        }
    }

    fn record() -> LocalRecord {
        let mut rebalance = plan("r1", NoticeKind::Rebalance, Phase::Undone);
        rebalance.signalled_at = None;
        rebalance.applied = Applied::default();
        rebalance.detail = String::new();
        LocalRecord {
            latest: plan("i1", NoticeKind::Interruption, Phase::Signalled),
            targets: vec![RecordedTarget {
                pid: 4242,
                start: 123_456,
            }],
            earlier: vec![rebalance],
        }
    }

    /// `<state-dir>/notice.json` as the agent has written it since one plan per kind (issue 24):
    /// agents restart across versions, so these bytes are read, and written, unchanged.
    const WRITTEN: &str = r#"{
  "id": "i1",
  "kind": {
    "type": "interruption"
  },
  "source": "aws",
  "deadline": "2026-11-25T10:02:00Z",
  "phase": "signalled",
  "signalled_at": "2026-11-25T10:00:01Z",
  "applied": {
    "cordoned": true,
    "taint_effect": "NoSchedule"
  },
  "boot_id": "0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11",
  "restart": false,
  "detail": "spot instance-action terminate at 2026-11-25T10:02:00Z",
  "updated_at": "2026-11-25T10:00:02Z",
  "targets": [
    {
      "pid": 4242,
      "start": 123456
    }
  ],
  "earlier": [
    {
      "id": "r1",
      "kind": {
        "type": "rebalance"
      },
      "source": "aws",
      "deadline": "2026-11-25T10:02:00Z",
      "phase": "undone",
      "applied": {
        "cordoned": false
      },
      "boot_id": "0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11",
      "restart": false,
      "updated_at": "2026-11-25T10:00:02Z"
    }
  ]
}"#;

    #[test]
    fn the_local_record_reads_and_writes_the_bytes_earlier_agents_wrote() {
        let read: LocalRecord = serde_json::from_str(WRITTEN).expect("an earlier agent's record");
        assert_eq!(read, record());
        let written = serde_json::to_vec_pretty(&record()).unwrap();
        assert_eq!(String::from_utf8(written).unwrap(), WRITTEN);
    }

    #[test]
    fn the_node_annotation_keeps_its_bytes() {
        // `spotguard.io/notice`: one plan, compact JSON.
        let annotation = r#"{"id":"i1","kind":{"type":"interruption"},"source":"aws","deadline":"2026-11-25T10:02:00Z","phase":"signalled","signalled_at":"2026-11-25T10:00:01Z","applied":{"cordoned":true,"taint_effect":"NoSchedule"},"boot_id":"0d5c6a61-1b0c-4ad8-9d55-5c3b8f0e8a11","restart":false,"detail":"spot instance-action terminate at 2026-11-25T10:02:00Z","updated_at":"2026-11-25T10:00:02Z"}"#;
        let state = plan("i1", NoticeKind::Interruption, Phase::Signalled);
        assert_eq!(serde_json::to_string(&state).unwrap(), annotation);
        let read: PlanState = serde_json::from_str(annotation).unwrap();
        assert_eq!(read, state);
    }
}
