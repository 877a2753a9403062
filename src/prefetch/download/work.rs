//! What the tasks of one run pass each other: the listing's objects and groups ([`Listed`],
//! [`Group`], [`Work`], [`Done`]), a download in progress ([`Active`]) and its byte ranges
//! ([`Segment`]). A leaf: the layers above (`run`, `part`, `lease`, `fetch`, `publish`,
//! `object`, `plan`) import it and it imports none of them.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use object_store::path::Path as ObjectPath;
use tokio_util::sync::CancellationToken;

use crate::prefetch::claim::{Claim, ClaimRecord};
use crate::prefetch::manifest::Entry;
use crate::sync::lock;

/// An object from the listing.
#[derive(Clone, Debug)]
pub(super) struct Listed {
    pub(super) location: ObjectPath,
    pub(super) entry: Entry,
}

/// Consecutive small objects (at most `plan::GROUP_WINDOW` listing positions) claimed together: one
/// claim file instead of one per object. `first` and `last` are the window's first and last
/// listed keys, so processes listing the same source form the same groups.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) first: String,
    pub(super) last: String,
    pub(super) objects: Vec<Listed>,
}

/// Work that may have to wait for another process's claim.
pub(super) enum Work {
    Object(Listed),
    Group(Group),
}

/// The claim key of the group whose window starts at `first` and ends at `last`.
pub(super) fn group_claim_key(first: &str, last: &str) -> String {
    format!("group\n{first}\n{last}")
}

/// Result of one object or group.
pub(super) enum Done {
    /// Published, seen published by another process, failed, cancelled (all recorded).
    Finished,
    /// Someone else holds the claim: look again later.
    Deferred(Work),
}

/// A byte range of an object being fetched; `written` bytes from `start` are on disk.
#[derive(Debug)]
pub(super) struct Segment {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) written: AtomicU64,
}

impl Segment {
    pub(super) fn new(start: u64, end: u64) -> Arc<Segment> {
        Arc::new(Segment {
            start,
            end,
            written: AtomicU64::new(0),
        })
    }
    pub(super) fn done(&self) -> [u64; 2] {
        [
            self.start,
            self.start + self.written.load(Ordering::Acquire),
        ]
    }
}

/// Sort and merge `[start, end)` ranges, dropping empty ones.
pub(super) fn merge_ranges(mut v: Vec<[u64; 2]>) -> Vec<[u64; 2]> {
    v.retain(|r| r[1] > r[0]);
    v.sort_unstable();
    let mut out: Vec<[u64; 2]> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(last) if r[0] <= last[1] => last[1] = last[1].max(r[1]),
            _ => out.push(r),
        }
    }
    out
}

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
