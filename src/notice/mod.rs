//! Interruption notices: the shared [`Notice`] type every cloud source produces, the
//! [`NoticeSource`] seam, and the per-source monitor loop.
//!
//! Sources (`ec2`, `gce`, `azure`) turn their endpoint's answers into notices; "nothing pending"
//! (a 404, `[]`, `FALSE`) is decided inside each source. What a notice means for the plan is the responder's (its notice store).
//! Each source also supplies what the rest of the agent knows about its cloud ([`CloudFacts`],
//! linked from [`Cloud`] in `cloud`).

pub mod azure;
mod cloud;
pub mod detect;
pub mod ec2;
pub mod gce;
mod http;
pub mod monitor;

use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub use cloud::{BuildSource, Cloud, CloudFacts, Probe, Settings, SourceMetrics};

/// What a notice announces.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "id")]
pub enum NoticeKind {
    /// The instance will be taken away (EC2 spot instance-action, GCE preempted, Azure Preempt/Terminate).
    Interruption,
    /// EC2 rebalance recommendation: elevated risk, no deadline.
    Rebalance,
    /// Scheduled maintenance (EC2 scheduled events, GCE TERMINATE_ON_HOST_MAINTENANCE, Azure Reboot/Redeploy/Freeze).
    Maintenance,
    /// An earlier notice (by id) no longer applies (EC2 `canceled`/`completed`, Azure event gone).
    Cancelled(String),
}

impl NoticeKind {
    /// Low-cardinality label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            NoticeKind::Interruption => "interruption",
            NoticeKind::Rebalance => "rebalance",
            NoticeKind::Maintenance => "maintenance",
            NoticeKind::Cancelled(_) => "cancelled",
        }
    }
}

/// What a scheduled maintenance does to the machine, as its source tells: a typed fact, so that
/// nothing downstream parses a notice's `detail`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MaintenanceKind {
    /// Every other maintenance (and every notice that is not one).
    #[default]
    Other,
    /// The machine is paused for a few seconds, neither restarted nor moved (Azure `Freeze`): it
    /// follows its own policy (`--on-azure-freeze`, default `ignore`), not `--on-maintenance`.
    Freeze,
}

/// One notice as seen by a source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Notice {
    /// Stable id: the cloud's event id where it has one (EC2 EventId, Azure EventId), else a hash
    /// of the notice's content (see [`content_id`]).
    pub id: String,
    pub kind: NoticeKind,
    pub source: Cloud,
    /// When the instance goes away (interruption) or the maintenance window starts.
    /// `None` or a time in the past means "now".
    pub deadline: Option<Timestamp>,
    /// For scheduled maintenance: when handling should start at the earliest is derived from this
    /// (`not_before − maintenance-lead`). Equal to `deadline` for most sources.
    pub not_before: Option<Timestamp>,
    /// Human-readable detail from the cloud (action, event type, description).
    pub detail: String,
    /// Whether this event restarts the instance in place (EC2 reboot events, Azure Reboot/Redeploy,
    /// GCE host maintenance with restart): spotguard uncordons at start-up after such a reboot.
    #[serde(default)]
    pub restart: bool,
    /// What kind of maintenance it is ([`MaintenanceKind::Other`] for other notices).
    #[serde(default)]
    pub maintenance: MaintenanceKind,
    /// When the cloud published the notice, where it says so (EC2 rebalance `noticeTime`), for
    /// the detection-latency metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published_at: Option<Timestamp>,
    /// When the source first saw it (wall clock), for detection-latency metrics.
    pub observed_at: Timestamp,
    /// The event's id as the cloud's own answer carries it (the `EventId` of Azure Scheduled
    /// Events and of EC2 scheduled events), for linking the agent's log line to the cloud's (or
    /// the emulator's) event. `None` where the answer carries none (EC2 spot interruption and
    /// rebalance recommendation, GCE): never made up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_event_id: Option<String>,
}

impl Notice {
    /// Time left until the deadline, saturating at zero ("now") for a missing or past deadline.
    pub fn time_left(&self, now: Timestamp) -> Duration {
        crate::duration::time_until(self.deadline, now)
    }
}

/// A stable id derived from a notice's content (source, kind label and the parts given), so that
/// re-polls of the same event dedupe. 16 hex chars of SHA-256.
pub fn content_id(source: Cloud, kind: &str, parts: &[&str]) -> String {
    let mut h = Sha256::new();
    h.update(source.as_str().as_bytes());
    h.update([0u8]);
    h.update(kind.as_bytes());
    for p in parts {
        h.update([0u8]);
        h.update(p.as_bytes());
    }
    let digest = h.finalize();
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A cloud's notice endpoint(s). One poll returns every notice currently visible there
/// (empty when nothing is pending). A hanging-GET source (GCE) may block inside `poll` until a
/// value changes or its own timeout passes; the monitor loop owns cadence and backoff.
#[async_trait]
pub trait NoticeSource: Send + Sync {
    /// Short name for logs and the `source` metric label.
    fn name(&self) -> &'static str;
    /// The delay between polls. Zero for hanging-GET sources, which return only on change.
    fn poll_interval(&self) -> Duration;
    /// Fetch the notices visible now.
    async fn poll(&self) -> Result<Vec<Notice>, Error>;
    /// Tell the cloud spotguard is done with `notice` (Azure: approve the scheduled event so it
    /// starts sooner). Called only after checkpoint and drain completed. Default: nothing to do.
    async fn acknowledge(&self, _notice: &Notice) -> Result<(), Error> {
        Ok(())
    }
    /// Whether [`acknowledge`](Self::acknowledge) tells the cloud anything for `notice` (counted
    /// in `spotguard_node_actions_total{action="acknowledge"}` only then). Default: no.
    fn acknowledges(&self, _notice: &Notice) -> bool {
        false
    }
}

#[async_trait]
impl<T: NoticeSource + ?Sized> NoticeSource for std::sync::Arc<T> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn poll_interval(&self) -> Duration {
        (**self).poll_interval()
    }
    async fn poll(&self) -> Result<Vec<Notice>, Error> {
        (**self).poll().await
    }
    async fn acknowledge(&self, notice: &Notice) -> Result<(), Error> {
        (**self).acknowledge(notice).await
    }
    fn acknowledges(&self, notice: &Notice) -> bool {
        (**self).acknowledges(notice)
    }
}

/// Errors from notice sources. Never fatal: the monitor counts, logs and backs off.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("request to {} failed: {}", shown(.url), crate::words::transport(.source))]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{} answered HTTP {status}", shown(.url))]
    Status { url: String, status: u16 },
    #[error("IMDSv2 token request to {} failed (HTTP {status}); IMDSv1 fallback is off (--imds-v1-fallback)", shown(.url))]
    Token { url: String, status: u16 },
    #[error("cannot parse answer from {}: {reason}", shown(.url))]
    Parse { url: String, reason: String },
    #[error("answer from {} is larger than {limit} bytes: refused", shown(.url))]
    TooLarge { url: String, limit: usize },
    #[error("acknowledging event {event_id} failed: {reason}")]
    Acknowledge { event_id: String, reason: String },
    #[error("could not detect the cloud: {0}")]
    Detect(String),
}

/// A metadata URL as messages show it: an endpoint override's user name and password never
/// (`--metadata-endpoint http://admin:S3CRET@…`).
fn shown(url: &str) -> String {
    crate::words::without_credentials(url)
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Request { .. } | Error::Status { .. } | Error::Token { .. } => true,
            Error::Parse { .. } | Error::Acknowledge { .. } | Error::TooLarge { .. } => true,
            Error::Detect(_) => false,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Request { source, .. } if source.is_timeout() => "timeout",
            Error::Request { .. } => "request",
            Error::Status { .. } => "status",
            Error::Token { .. } => "token",
            Error::Parse { .. } => "parse",
            Error::TooLarge { .. } => "too_large",
            Error::Acknowledge { .. } => "acknowledge",
            Error::Detect(_) => "detect",
        }
    }
}
