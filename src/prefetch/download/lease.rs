//! The claims this run holds: what each records (the byte ranges on stable storage), their
//! renewal while the run goes, the checkpoint when it is interrupted, and their release.

use std::io;
use std::sync::Arc;

use super::run::{blocking, Run};
use super::work::Active;
use crate::prefetch::claim::Claim;
use crate::sync::lock;

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
