//! The relay's wire format, version 1 (docs/relay.md): HTTP/1.1 over TLS pinned to the
//! receiver's certificate fingerprint ([`super::tls`]), every request carrying the node key as
//! `Authorization: Bearer <key>`.
//!
//! | request | body | answer |
//! |---|---|---|
//! | `POST /v1/relays` | [`Reserve`] (JSON, at most [`MAX_JSON`]) | `201` [`Reserved`] |
//! | `PUT /v1/relays/<id>/files/<index>` | the file's bytes, exactly its declared size | `204` |
//! | `POST /v1/relays/<id>/commit` | [`Commit`] | `202` [`Status`] |
//! | `GET /v1/relays/<id>` | | `200` [`Status`] |
//! | `DELETE /v1/relays/<id>` | | `204` |
//!
//! Everything a sender writes is hostile input to the receiver: the tree's paths, sizes and
//! counts are held to the same rules as a trainer's staged tree (`store::tree`), and every
//! byte is counted against its declared size and checksummed against the CRCs of the commit.

use serde::{Deserialize, Serialize};

use crate::store::crc::Crcs;
use crate::store::manifest::{hex32, hex64, NoticeInfo, Origin, Part};

/// The wire format's version; a reservation of another version is refused (`400`).
pub const VERSION: u32 = 1;

/// Requests with a JSON body larger than this are refused (`413`): 10 000 files' paths and
/// CRCs take about 2 MB.
pub const MAX_JSON: usize = 16 << 20;

/// The reservation path.
pub const RELAYS: &str = "/v1/relays";

/// A reservation: the checkpoint as the sender would publish it, and its files' paths and sizes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reserve {
    /// [`VERSION`].
    pub version: u32,
    /// The sending node's name (logs).
    pub sender: String,
    /// The job's location (`s3://bucket/run1`, `/mnt/shared/run1`): the receiver checks it
    /// against its own `--upload-allow` before it accepts a byte.
    pub location: String,
    /// The job's namespace (Kubernetes); `{namespace}` in the receiver's allow-list patterns.
    #[serde(default)]
    pub namespace: Option<String>,
    pub checkpoint: Checkpoint,
    /// In the manifest's order (sorted by path).
    pub files: Vec<FileEntry>,
}

impl Reserve {
    /// Bytes of all files (saturating: a hostile sum is refused by the limits).
    pub fn bytes(&self) -> u64 {
        self.files
            .iter()
            .fold(0u64, |sum, f| sum.saturating_add(f.size))
    }
}

/// What the manifest says besides the files, exactly as the sender would have written it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// The checkpoint's directory name under the location.
    pub name: String,
    #[serde(default)]
    pub step: Option<u64>,
    #[serde(default)]
    pub part: Option<Part>,
    #[serde(default)]
    pub notice: Option<NoticeInfo>,
    /// The sender's origin (its node, the trainer's pod and staged path).
    pub origin: Origin,
    /// When the trainer's ack was seen (RFC 3339).
    #[serde(default)]
    pub acked_at: Option<String>,
    /// The job that owns the location (`k8s:<ns>/<Kind>/<name>`, `host:uid:<uid>`).
    pub writer: String,
}

/// One file of a reservation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative to the checkpoint's directory, `/`-separated.
    pub path: String,
    pub size: u64,
}

/// A reservation accepted.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reserved {
    pub id: String,
}

/// The end of the stream: each file's checksums, in the reservation's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Commit {
    pub files: Vec<FileCrcs>,
}

/// One file's checksums as the sender computed them while reading it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCrcs {
    /// 16 hex digits.
    pub crc64nvme: String,
    /// 8 hex digits.
    pub crc32c: String,
}

impl FileCrcs {
    pub fn of(c: &Crcs) -> FileCrcs {
        FileCrcs {
            crc64nvme: hex64(c.crc64nvme),
            crc32c: hex32(c.crc32c),
        }
    }

    /// Whether `c` has these checksums.
    pub fn matches(&self, c: &Crcs) -> bool {
        *self == FileCrcs::of(c)
    }
}

/// Where a relay stands on the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Reserved; files arriving.
    Receiving,
    /// Every file verified; the receiver is publishing it.
    Publishing,
    /// The receiver published it (its manifest is at the location).
    Published,
    /// Another writer (the sender's own upload) published the same checkpoint first.
    AlreadyPublished,
    /// It did not publish (an error, a refusal); nothing partial is left.
    Failed,
    /// The sender aborted it, or went silent: the files are gone, the space is free.
    Aborted,
}

impl State {
    /// The checkpoint is at the location.
    pub fn is_published(self) -> bool {
        matches!(self, State::Published | State::AlreadyPublished)
    }

    /// Nothing more will happen.
    pub fn is_final(self) -> bool {
        !matches!(self, State::Receiving | State::Publishing)
    }
}

/// `GET /v1/relays/<id>` (and the commit's answer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub state: State,
    /// Why it failed or was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// An error answer's body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub error: String,
}
