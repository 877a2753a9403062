//! The crate's one poison-tolerant lock.

use std::sync::{Mutex, MutexGuard};

/// Lock `m`, also after a panic while it was held (the state it guards stays consistent).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
