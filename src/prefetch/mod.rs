//! Dataset prefetch (docs/prefetch.md): copy an object-store prefix into a local (or shared NFS/EFS)
//! cache, fast, resumable, and never publishing a partial file.
//!
//! - [`cli`]: `spotguard prefetch SRC DEST` ([`PrefetchArgs`], [`run_cli`]).
//! - [`Prefetcher`]: the daemon side (`--prefetch NAME=URL`, config list, pod annotations);
//!   [`serve`]: the prefetcher as its own process.
//! - [`download`]: the engine; [`claim`]: per-object claims shared between processes and nodes;
//!   [`manifest`]: the per-dataset manifest; [`cache`]: layout, leases and eviction;
//!   [`verify`]: the stores' checksums.
//! - [`source`]: source URLs, dataset names and the object store; [`Error`]: what failed.
//!
//! The user guide is `docs/prefetch.md`.

pub mod annotations;
pub mod cache;
pub mod claim;
pub mod cli;
pub mod download;
mod error;
pub mod manifest;
pub mod metrics;
pub mod policy;
mod prefetcher;
pub mod progress;
pub mod serve;
pub mod source;
pub mod verify;

use std::sync::{Mutex, MutexGuard};

pub use cli::{run_cli, PrefetchArgs};
pub use download::{FetchOptions, Outcome, Summary, Verify};
pub use error::{store_words, Error, GetCause};
pub use metrics::PrefetchMetrics;
pub use prefetcher::{DatasetState, DatasetStatus, Ensure, PrefetchDefaults, Prefetcher};
pub use progress::{Progress, Snapshot};
pub use source::{parse_spec, SourceUrl, StoreOptions};

/// Lock `m`, also after a panic while it was held (the state it guards stays consistent).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
