//! spotguard: node agent for GPU training on spot / preemptible capacity.
//!
//! Architecture and module map: `docs/architecture.md`. Seams (traits):
//! [`notice::NoticeSource`], [`node::NodeOps`], [`gpu::GpuProbe`],
//! [`checkpoint::TargetDiscovery`]; the object store seam is `object_store::ObjectStore`.

pub mod admin;
pub mod app;
pub mod backoff;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod drill;
pub mod duration;
pub mod emulator;
pub mod fsutil;
pub mod goodput;
pub mod gpu;
pub mod life;
pub mod loader_pages;
pub mod metrics;
pub mod node;
pub mod notice;
pub mod outcome;
pub mod prefetch;
pub mod relay;
pub mod responder;
pub mod shutdown;
pub mod store;
pub mod sync;
pub mod telemetry;
pub mod units;
pub mod upload;
pub mod webhook;
pub mod words;
