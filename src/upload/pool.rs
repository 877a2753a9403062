//! The upload's memory: a fixed number of part-sized buffers, reused. A buffer is leased before
//! a part is read (so reading waits while every buffer is in flight: that is the backpressure),
//! handed to the store as the request body without a copy ([`Lease::freeze`]), and returns to
//! the pool when the store drops the body. Peak memory is `buffers × size`, whatever the tree.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A pool of `count` buffers of `size` bytes.
#[derive(Debug)]
pub struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    slots: Arc<Semaphore>,
    size: usize,
}

impl Pool {
    pub fn new(count: usize, size: usize) -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Vec::with_capacity(count)),
            slots: Arc::new(Semaphore::new(count.max(1))),
            size,
        })
    }

    /// The size of each buffer.
    pub fn buffer_size(&self) -> usize {
        self.size
    }

    /// Wait for a free buffer.
    pub async fn lease(self: &Arc<Self>) -> Lease {
        // The semaphore is never closed.
        let permit = match self.slots.clone().acquire_owned().await {
            Ok(p) => p,
            Err(_) => unreachable!("the pool's semaphore is never closed"),
        };
        let buf = crate::prefetch::lock(&self.free)
            .pop()
            .unwrap_or_else(|| vec![0u8; self.size]);
        Lease {
            buf,
            len: 0,
            pool: self.clone(),
            _permit: permit,
        }
    }
}

/// A leased buffer; back to the pool when dropped.
#[derive(Debug)]
pub struct Lease {
    buf: Vec<u8>,
    len: usize,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
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

impl Drop for Lease {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if buf.len() == self.pool.size {
            crate::prefetch::lock(&self.pool.free).push(buf);
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
        assert_eq!(crate::prefetch::lock(&pool.free).len(), 2);
    }
}
