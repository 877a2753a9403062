//! The claims this run holds: what each records (the byte ranges on stable storage), their
//! renewal while the run goes, the checkpoint when it is interrupted, and their release.

use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::part::{merge_ranges, Segment};
use super::run::{blocking, Run};
use crate::prefetch::claim::{Claim, ClaimRecord};
use crate::sync::lock;

/// A download in progress, or a group's claim: what the renewer needs to checkpoint it.
pub(super) struct Active {
    /// The claim this entry renews: an object's own (large objects) or a group's; `None` for an
    /// object covered by its group's claim.
    pub(super) claim: Option<Claim>,
    pub(super) record: Mutex<ClaimRecord>,
    pub(super) file: Mutex<Option<Arc<File>>>,
    pub(super) base_done: Mutex<Vec<[u64; 2]>>,
    pub(super) segments: Mutex<Vec<Arc<Segment>>>,
    pub(super) synced: Mutex<Vec<[u64; 2]>>,
    /// Cancelled when the claim was lost (someone else owns it now).
    pub(super) lost: CancellationToken,
}

impl Active {
    pub(super) fn new(
        claim: Option<Claim>,
        record: ClaimRecord,
        lost: CancellationToken,
    ) -> Arc<Active> {
        Arc::new(Active {
            claim,
            record: Mutex::new(record),
            file: Mutex::new(None),
            base_done: Mutex::new(Vec::new()),
            segments: Mutex::new(Vec::new()),
            synced: Mutex::new(Vec::new()),
            lost,
        })
    }

    pub(super) fn done_ranges(&self) -> Vec<[u64; 2]> {
        let mut v = lock(&self.base_done).clone();
        v.extend(lock(&self.segments).iter().map(|s| s.done()));
        merge_ranges(v)
    }
}

pub(super) async fn release(run: &Run, claim: &Claim) {
    let claim = claim.clone();
    let owner = run.owner.clone();
    if let Ok(Err(e)) = blocking(move || claim.release(&owner)).await {
        tracing::warn!(error = %e, "could not release claim");
    }
}

/// Interrupted: sync what is written, record it in the claim and end the lease at once, so the
/// next run (here or on another node) resumes from it without waiting.
pub(super) async fn checkpoint_on_stop(active: &Arc<Active>) {
    let Some(claim) = active.claim.clone() else {
        return;
    };
    let done = active.done_ranges();
    let file = lock(&active.file).clone();
    let mut record = lock(&active.record).clone();
    record.done = done;
    record.lease_until_ms = 0;
    let path = claim.path.clone();
    let res = blocking(move || -> io::Result<bool> {
        if let Some(f) = file {
            f.sync_data()?;
        }
        claim.renew(&record)
    })
    .await;
    match res {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(claim = %path.display(), error = %e, "could not checkpoint an interrupted download")
        }
        Err(e) => tracing::warn!(error = %e, "checkpoint task failed"),
    }
}

pub(super) async fn renew_all(run: &Arc<Run>) {
    let actives: Vec<Arc<Active>> = lock(&run.active).values().cloned().collect();
    if actives.is_empty() {
        return;
    }
    let until = run.lease_until();
    let res = blocking(move || {
        for a in actives {
            let Some(claim) = &a.claim else {
                continue;
            };
            let done = a.done_ranges();
            let file = lock(&a.file).clone();
            let changed = *lock(&a.synced) != done;
            if changed {
                if let Some(f) = &file {
                    // Only bytes on stable storage are recorded as done (a node crash on a
                    // shared cache must not leave "done" holes).
                    if let Err(e) = f.sync_data() {
                        tracing::warn!(claim = %claim.path.display(), error = %e, "could not sync a part file");
                        continue;
                    }
                }
            }
            let rec = {
                let mut r = lock(&a.record);
                r.lease_until_ms = until;
                if file.is_some() {
                    r.done = done.clone();
                }
                r.clone()
            };
            match claim.renew(&rec) {
                Ok(true) => *lock(&a.synced) = done,
                Ok(false) => a.lost.cancel(),
                Err(e) => tracing::warn!(claim = %claim.path.display(), error = %e, "could not renew claim"),
            }
        }
    })
    .await;
    if let Err(e) = res {
        tracing::warn!(error = %e, "claim renewal task failed");
    }
}
