//! The node's descriptor budget for uploads: every taken file is one open descriptor until its
//! upload ends, so all uploads of the agent together draw from one budget, derived from the
//! process's `RLIMIT_NOFILE` (after [`super::staged::raise_open_file_limit`]) minus a reserve for
//! everything else the agent does (sockets to the store and the API server, the metrics server,
//! `/proc` reads, journals, logs, the directories a capture walks).
//!
//! Memory: the part buffers of all uploads draw from one [`Memory`] budget
//! (`--upload-concurrency × --upload-part-size`, what the shipped memory limits were sized for):
//! an upload always gets one buffer, and more while the budget has room and the upload holds
//! less than an even split among the uploads running (see [`super::pool`]).
//!
//! Descriptors are shared per owner (the uid of a host-mode trainer, the filesystem root of a container's
//! trainer): an owner may hold at most `budget / (owners holding descriptors besides it + 2)`,
//! so one share is always left for an owner that has not come yet, and an owner that arrives
//! while others hold descriptors gets a share of its own. A tree that does not fit is refused
//! while it is captured, before the trainer is answered: it hears `refused` (naming the budget)
//! at once, while it still has time to save elsewhere.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Descriptors kept out of the budget: at least this many…
pub const RESERVE_MIN: u64 = 256;
/// …or this fraction of the limit (`1/8`), whichever is more.
pub const RESERVE_DIVISOR: u64 = 8;

/// The reserve for a descriptor limit.
pub fn reserve(limit: u64) -> u64 {
    RESERVE_MIN.max(limit / RESERVE_DIVISOR)
}

/// Who a taken descriptor is charged to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// A trainer on the host's own filesystem: its uid.
    Uid(u32),
    /// A trainer in a container: its filesystem root (one per container).
    Root { dev: u64, ino: u64 },
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Uid(uid) => write!(f, "uid {uid}"),
            Owner::Root { dev, ino } => write!(f, "the container with root {dev}:{ino}"),
        }
    }
}

/// The agent's descriptor budget for taken files.
#[derive(Debug)]
pub struct Budget {
    total: u64,
    limit: u64,
    held: Mutex<HashMap<Owner, u64>>,
}

/// Why a descriptor was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub owner: Owner,
    pub held: u64,
    pub share: u64,
    pub free: u64,
    pub total: u64,
    pub limit: u64,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the node's upload descriptor budget is spent for {}: it holds {} of its share of {} \
             ({} free of {}: RLIMIT_NOFILE {} less a reserve of {}); save elsewhere, or wait for \
             its other uploads to end",
            self.owner,
            self.held,
            self.share,
            self.free,
            self.total,
            self.limit,
            self.limit - self.total,
        )
    }
}

impl Budget {
    /// A budget of `total` descriptors (`limit`: the `RLIMIT_NOFILE` it came from, for messages).
    pub fn new(total: u64, limit: u64) -> Arc<Budget> {
        Arc::new(Budget {
            total,
            limit,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The budget for a process whose descriptor limit is `limit`.
    pub fn for_limit(limit: u64) -> Arc<Budget> {
        Budget::new(limit.saturating_sub(reserve(limit)), limit)
    }

    /// Descriptors in the budget.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Descriptors `owner` holds now.
    pub fn held_by(&self, owner: &Owner) -> u64 {
        crate::sync::lock(&self.held)
            .get(owner)
            .copied()
            .unwrap_or(0)
    }

    /// Take one descriptor for `owner`; it returns to the budget when the [`Held`] is dropped.
    pub fn take(self: &Arc<Self>, owner: &Owner) -> Result<Held, Refusal> {
        let mut held = crate::sync::lock(&self.held);
        let mine = held.get(owner).copied().unwrap_or(0);
        let others = held.keys().filter(|o| *o != owner).count() as u64;
        let share = self.total / (others + 2);
        let used: u64 = held.values().sum();
        let free = self.total.saturating_sub(used);
        if mine >= share || free == 0 {
            return Err(Refusal {
                owner: owner.clone(),
                held: mine,
                share,
                free,
                total: self.total,
                limit: self.limit,
            });
        }
        *held.entry(owner.clone()).or_insert(0) += 1;
        Ok(Held {
            budget: self.clone(),
            owner: owner.clone(),
        })
    }
}

/// One descriptor of the budget, held by a taken file.
#[derive(Debug)]
pub struct Held {
    budget: Arc<Budget>,
    owner: Owner,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut held = crate::sync::lock(&self.budget.held);
        if let Some(n) = held.get_mut(&self.owner) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.owner);
            }
        }
    }
}

/// The agent's memory budget for part buffers, in bytes.
#[derive(Debug)]
pub struct Memory {
    total: u64,
    state: Mutex<MemoryState>,
}

#[derive(Debug, Default)]
struct MemoryState {
    used: u64,
    pools: u64,
}

impl Memory {
    pub fn new(total: u64) -> Arc<Memory> {
        Arc::new(Memory {
            total,
            state: Mutex::new(MemoryState::default()),
        })
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes granted now.
    pub fn used(&self) -> u64 {
        crate::sync::lock(&self.state).used
    }

    /// A pool starts: its first buffer is granted whatever the budget holds.
    pub(crate) fn open(&self, size: u64) {
        let mut st = crate::sync::lock(&self.state);
        st.pools += 1;
        st.used = st.used.saturating_add(size);
    }

    /// One more buffer of `size` for a pool that holds `held` bytes: granted when the budget has
    /// room and the pool would still hold no more than an even split among the pools.
    pub(crate) fn grow(&self, held: u64, size: u64) -> bool {
        let mut st = crate::sync::lock(&self.state);
        let split = self.total / st.pools.max(1);
        if st.used.saturating_add(size) <= self.total && held.saturating_add(size) <= split {
            st.used += size;
            true
        } else {
            false
        }
    }

    /// A pool ends: `held` bytes come back.
    pub(crate) fn close(&self, held: u64) {
        let mut st = crate::sync::lock(&self.state);
        st.pools = st.pools.saturating_sub(1);
        st.used = st.used.saturating_sub(held);
    }
}

static MEMORY: OnceLock<Arc<Memory>> = OnceLock::new();

/// The agent's memory budget for part buffers (the first call decides).
pub fn install_memory(total: u64) -> Arc<Memory> {
    MEMORY.get_or_init(|| Memory::new(total)).clone()
}

/// The agent's memory budget, once installed; `None` in the one-shot CLI.
pub fn memory() -> Option<Arc<Memory>> {
    MEMORY.get().cloned()
}

static NODE: OnceLock<Arc<Budget>> = OnceLock::new();

/// The agent's budget, from this process's descriptor limit now (call it after raising the
/// limit); the first call decides. Captures from then on draw from it ([`node`]).
pub fn install_node() -> Arc<Budget> {
    NODE.get_or_init(|| {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX / 2);
        Budget::for_limit(limit)
    })
    .clone()
}

/// The agent's budget, once installed (`spotguard run`); `None` in the one-shot CLI, whose
/// single upload is bound by `--max-files` and the descriptor limit alone.
pub fn node() -> Option<Arc<Budget>> {
    NODE.get().cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_at_least_256_or_an_eighth() {
        assert_eq!(reserve(1024), 256);
        assert_eq!(reserve(65_536), 8_192);
        assert_eq!(Budget::for_limit(1024).total(), 768);
        assert_eq!(Budget::for_limit(100).total(), 0);
    }

    #[test]
    fn one_owner_never_takes_what_another_needs() {
        let b = Budget::new(900, 1200);
        let (a, c, d) = (Owner::Uid(1000), Owner::Uid(1001), Owner::Uid(1002));
        // Alone, an owner gets half: one share is kept for an owner yet to come.
        let mut held_a: Vec<Held> = (0..450).map(|_| b.take(&a).unwrap()).collect();
        let r = b.take(&a).unwrap_err();
        assert_eq!((r.held, r.share, r.free), (450, 450, 450));
        assert!(r.to_string().contains("upload descriptor budget"), "{r}");
        // Another owner gets its own share: 900 / (1 other + 2) = 300.
        let held_c: Vec<Held> = (0..300).map(|_| b.take(&c).unwrap()).collect();
        assert_eq!(b.take(&c).unwrap_err().share, 300);
        // A third: 900 / 4 = 225, but only 150 are free.
        let held_d: Vec<Held> = (0..150).map(|_| b.take(&d).unwrap()).collect();
        assert_eq!(b.take(&d).unwrap_err().free, 0);
        // Descriptors return as files are dropped.
        held_a.truncate(100);
        assert_eq!(b.held_by(&a), 100);
        assert!(b.take(&d).is_ok());
        drop((held_a, held_c, held_d));
        assert_eq!(crate::sync::lock(&b.held).len(), 0);
    }
}
