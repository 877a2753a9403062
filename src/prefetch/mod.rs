//! Dataset prefetch (docs/prefetch.md): copy an object-store prefix into a local (or shared NFS/EFS)
//! cache, fast, resumable, and never publishing a partial file.
//!
//! - [`cli`]: `spotguard prefetch SRC DEST` ([`PrefetchArgs`], [`run_cli`]).
//! - [`Prefetcher`]: the daemon side (`--prefetch NAME=URL`, config list, pod annotations);
//!   [`serve`]: the prefetcher as its own process.
//! - [`download`]: the engine; [`claim`]: per-object claims shared between processes and nodes;
//!   [`manifest`]: the per-dataset manifest; [`cache`]: layout, leases and eviction.
//! - [`Error`]: what failed. Source URLs, dataset names, the object store, its checksums and the
//!   progress counters are the store floor's ([`crate::store`]), shared with `upload`.
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
pub mod serve;

pub use crate::store::{parse_spec, Progress, Snapshot, SourceUrl, StoreOptions};
pub use cli::{run_cli, PrefetchArgs};
pub use download::{FetchOptions, Outcome, Summary, Verify};
pub use error::Error;
pub use metrics::PrefetchMetrics;
pub use prefetcher::{DatasetState, DatasetStatus, Ensure, PrefetchDefaults, Prefetcher};
