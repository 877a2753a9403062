//! The object-store floor both transfer directions stand on: dataset prefetch (`prefetch`,
//! store → cache) and staged-checkpoint upload (`upload`, disk → store). Neither imports the
//! other; what they share is here.
//!
//! - [`url`]: `s3://`, `gs://`, `file://` locations ([`SourceUrl`], [`Scheme`]), names
//!   ([`validate_name`]) and the client ([`StoreOptions`], [`build_store`]).
//! - [`checksum`]: the checksums the stores keep ([`StoreChecksum`]) and the HTTP connector that
//!   surfaces them ([`ChecksumConnector`], [`ChecksumSlot`]).
//! - [`progress`]: transfer counters, the progress reporter and the bar.
//! - [`allow`]: allow-list patterns of locations ([`AllowPattern`]).
//! - [`key`]: which object key may become a local path ([`validate_key`]), the part-file infix,
//!   the short hash of names.
//! - What a checkpoint is, for every side that moves one (upload, relay, latest): [`manifest`]
//!   (`manifest.json`, the commit marker written last), [`owner`] (whose a location is, the
//!   writer a manifest names), [`crc`] (the CRC-64/NVME and CRC-32C of every byte, combined
//!   across parts), [`tree`] (the limits and file paths a checkpoint tree obeys, staged or
//!   received).
//! - [`Error`]: what the floor refused; [`GetCause`] and [`store_words`] classify and word an
//!   object store's failure.

pub mod allow;
pub mod checksum;
pub mod crc;
mod error;
pub mod key;
pub mod manifest;
pub mod owner;
pub mod progress;
pub mod tree;
pub mod url;

pub use allow::AllowPattern;
pub use checksum::{ChecksumConnector, ChecksumSlot, StoreChecksum, VerifiedBy};
pub use error::{is_conditional_write_unsupported, store_words, Error, GetCause};
pub use key::{short_hash, validate_key, META_DIR, PART_INFIX};
pub use progress::{Progress, ProgressMode, Snapshot};
pub use url::{
    build_store, parse_http_url, parse_spec, validate_name, Scheme, SourceUrl, StoreOptions,
};
