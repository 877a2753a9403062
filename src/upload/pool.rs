//! The upload's memory: at most a fixed number of part-sized buffers, reused. A buffer is leased
//! before a part is read (so reading waits while every buffer is in flight: that is the
//! backpressure), handed to the store as the request body without a copy ([`Lease::freeze`]),
//! and returns to the pool when the store drops the body. Peak memory is `buffers × size`,
//! whatever the tree, plus at most one buffer's worth of small files' own buffers.
//!
//! Requests in flight are bounded apart from the buffers: a small file (at most
//! `size / requests` bytes, [`Pool::lease_exact`]) is read into a buffer of its own size instead
//! of a part-sized one, so a tree of many small files keeps every request busy while the
//! part-sized buffers (fewer than the requests when memory is short) go to large files' parts.
//!
//! In the agent the buffers draw from the node's memory budget ([`super::budget::Memory`]): a
//! pool starts with one buffer and grows, one lease at a time, up to its count while the budget
//! allows; what it was granted returns when the pool is dropped.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::budget::Memory;

/// A pool of `count` buffers of `size` bytes.
#[derive(Debug)]
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    slots: Arc<Semaphore>,
    size: usize,
    count: usize,
    /// The node's memory budget and the buffers it granted this pool (`None`: all `count`).
    budget: Option<(Arc<Memory>, AtomicUsize)>,
    /// Requests in flight, whatever their buffer.
    requests: Arc<Semaphore>,
    /// The largest lease with a buffer of its own (0: none).
    small_max: usize,
}

impl Pool {
    /// A pool of up to `count` buffers, drawing from the agent's memory budget when installed.
    pub fn new(count: usize, size: usize) -> Arc<Pool> {
        Pool::with_budget(count, size, super::budget::memory())
    }

    /// A pool of up to `count` buffers; with `budget`, one at first, more while it allows.
    pub fn with_budget(count: usize, size: usize, budget: Option<Arc<Memory>>) -> Arc<Pool> {
        Pool::with_requests(count, size, count, budget)
    }

    /// A pool of up to `count` part-sized buffers for up to `requests` requests in flight; a
    /// request of at most `size / requests` bytes has a buffer of its own size
    /// ([`Pool::lease_exact`]), so all of them together hold at most one part's worth.
    pub fn with_requests(
        count: usize,
        size: usize,
        requests: usize,
        budget: Option<Arc<Memory>>,
    ) -> Arc<Pool> {
        let count = count.max(1);
        let requests = requests.max(1);
        let start = match &budget {
            Some(m) => {
                m.open(size as u64);
                1
            }
            None => count,
        };
        Arc::new(Pool {
            free: Mutex::new(Vec::with_capacity(count)),
            slots: Arc::new(Semaphore::new(start)),
            size,
            count,
            budget: budget.map(|m| (m, AtomicUsize::new(1))),
            requests: Arc::new(Semaphore::new(requests)),
            // A lease this small never takes a part-sized buffer (nor is taken for one).
            small_max: if requests > 1 { size / requests } else { 0 },
        })
    }

    /// Buffers this pool may hold now.
    pub fn granted(&self) -> usize {
        match &self.budget {
            Some((_, granted)) => granted.load(Ordering::Relaxed),
            None => self.count,
        }
    }

    /// One more buffer from the budget, when every granted one is out and the budget allows.
    fn grow(&self) {
        let Some((memory, granted)) = &self.budget else {
            return;
        };
        let now = granted.load(Ordering::Relaxed);
        if now < self.count
            && self.slots.available_permits() == 0
            && memory.grow((now * self.size) as u64, self.size as u64)
        {
            granted.fetch_add(1, Ordering::Relaxed);
            self.slots.add_permits(1);
        }
    }

    /// The size of each buffer.
    pub fn buffer_size(&self) -> usize {
        self.size
    }

    /// Wait for a request slot and a free part-sized buffer.
    pub async fn lease(self: &Arc<Self>) -> Lease {
        let request = acquire(&self.requests).await;
        self.grow();
        let permit = acquire(&self.slots).await;
        let buf = crate::sync::lock(&self.free)
            .pop()
            .unwrap_or_else(|| vec![0u8; self.size]);
        Lease {
            buf,
            len: 0,
            pool: self.clone(),
            _permits: (request, Some(permit)),
        }
    }

    /// A buffer for `len` bytes: of its own size when `len` is small (a request slot is all
    /// it waits for), else a part-sized one ([`Pool::lease`]).
    pub async fn lease_exact(self: &Arc<Self>, len: usize) -> Lease {
        if len > self.small_max {
            return self.lease().await;
        }
        let request = acquire(&self.requests).await;
        Lease {
            buf: vec![0u8; len],
            len: 0,
            pool: self.clone(),
            _permits: (request, None),
        }
    }
}

/// A permit of one of the pool's semaphores, which are never closed.
async fn acquire(semaphore: &Arc<Semaphore>) -> OwnedSemaphorePermit {
    match semaphore.clone().acquire_owned().await {
        Ok(p) => p,
        Err(_) => unreachable!("the pool's semaphores are never closed"),
    }
}

/// A leased buffer; back to the pool when dropped.
#[derive(Debug)]
pub struct Lease {
    buf: Vec<u8>,
    len: usize,
    pool: Arc<Pool>,
    /// The request slot, and the part-sized buffer's slot (none for a small file's own buffer).
    _permits: (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>),
}

impl Lease {
    /// The first `len` bytes, to fill (`len` ≤ the buffer size).
    pub fn fill(&mut self, len: usize) -> &mut [u8] {
        self.len = len.min(self.buf.len());
        &mut self.buf[..self.len]
    }

    /// The bytes filled.
    pub fn filled(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// The filled bytes as a request body; the buffer returns to the pool when the last clone
    /// of the body is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        self.filled()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Some((memory, granted)) = &self.budget {
            memory.close((granted.load(Ordering::Relaxed) * self.size) as u64);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if self._permits.1.is_some() && buf.len() == self.pool.size {
            crate::sync::lock(&self.pool.free).push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn buffers_are_bounded_and_come_back_when_the_body_is_dropped() {
        let pool = Pool::new(2, 16);
        let mut a = pool.lease().await;
        a.fill(3).copy_from_slice(b"abc");
        let body = a.freeze();
        let b = pool.lease().await;
        // Both buffers are out: a third lease waits.
        let third = tokio::time::timeout(std::time::Duration::from_millis(50), pool.lease()).await;
        assert!(third.is_err());
        let clone = body.clone();
        drop(body);
        assert_eq!(&clone[..], b"abc");
        drop(clone);
        let c = tokio::time::timeout(std::time::Duration::from_secs(5), pool.lease())
            .await
            .unwrap();
        drop((b, c));
        assert_eq!(crate::sync::lock(&pool.free).len(), 2);
    }

    /// Issue 35: a small file is read into a buffer of its own size, so it waits for a request
    /// slot, never for a part-sized buffer; requests stay bounded whatever their buffer, and a
    /// small file's buffer never joins the part-sized ones.
    #[tokio::test]
    async fn small_files_have_buffers_of_their_own_and_requests_stay_bounded() {
        use futures::FutureExt;
        let pool = Pool::with_requests(2, 64, 4, None);
        let parts = (pool.lease().await, pool.lease().await);
        assert!(
            pool.lease().now_or_never().is_none(),
            "both part buffers are out"
        );
        let small = pool
            .lease_exact(16)
            .now_or_never()
            .expect("a small file waits for no part buffer");
        assert_eq!((small.buf.len(), small._permits.1.is_none()), (16, true));
        assert!(
            pool.lease_exact(17).now_or_never().is_none(),
            "more than size / requests takes a part buffer"
        );
        let small2 = pool
            .lease_exact(1)
            .now_or_never()
            .expect("a fourth request");
        assert!(
            pool.lease_exact(1).now_or_never().is_none(),
            "four requests are in flight"
        );
        drop((small, small2));
        let again = pool
            .lease_exact(16)
            .now_or_never()
            .expect("a request slot is back");
        drop((again, parts));
        let free = crate::sync::lock(&pool.free);
        assert_eq!(free.iter().map(Vec::len).collect::<Vec<_>>(), [64, 64]);
    }

    /// Issue 29 item 6: pools draw from the node's memory budget. Each gets one buffer whatever
    /// the budget holds; more while the budget has room and it holds no more than an even split.
    #[tokio::test]
    async fn pools_share_the_nodes_memory_budget() {
        let memory = Memory::new(64);
        let a = Pool::with_budget(8, 16, Some(memory.clone()));
        let (a1, a2, a3, a4) = (
            a.lease().await,
            a.lease().await,
            a.lease().await,
            a.lease().await,
        );
        assert_eq!((a.granted(), memory.used()), (4, 64));
        // The budget is spent: a second upload still gets its one buffer, no more.
        let b = Pool::with_budget(8, 16, Some(memory.clone()));
        let b1 = b.lease().await;
        let more = tokio::time::timeout(std::time::Duration::from_millis(50), b.lease()).await;
        assert!(more.is_err());
        assert_eq!(b.granted(), 1);
        // The first upload ends: its memory returns; the second grows up to an even split (32).
        drop((a1, a2, a3, a4));
        drop(a);
        assert_eq!(memory.used(), 16);
        let b2 = b.lease().await;
        let more = tokio::time::timeout(std::time::Duration::from_millis(50), b.lease()).await;
        assert!(more.is_ok(), "a lone pool grows up to the budget");
        assert_eq!(b.granted(), 3);
        drop((b1, b2, more));
        drop(b);
        assert_eq!(memory.used(), 0);
    }
}
