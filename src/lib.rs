//! spotguard: node agent for GPU training on spot / preemptible capacity.
//!
//! Architecture and module map: `docs/architecture.md` (and design §2).

pub mod checkpoint;
pub mod fsutil;
pub mod metrics;
pub mod node;
pub mod notice;
pub mod prefetch;
pub mod testing;
