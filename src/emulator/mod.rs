//! Instance-metadata emulator: the real wire protocols of the EC2 IMDSv2, GCE metadata server and
//! Azure IMDS Scheduled Events, served over loopback HTTP.
//!
//! Used by `spotguard emulate` (a server for users' own tests), by `spotguard drill` and by the
//! integration tests. It deliberately shares no types with the notice clients (`crate::notice`)
//! but the name of the cloud ([`Cloud`]): a client tested against it is tested against the wire
//! format the clouds document, not against a shared Rust struct. Every endpoint and control payload is described in `docs/emulator.md`.
//!
//! Layout: [`start`] binds and returns an [`EmulatorHandle`]; `server` owns the listener, the
//! connections and the fault layer; `aws`, `gce` and `azure` each own one cloud's protocol
//! (defaults, validation, rendering, handlers); `control` serves `/spotguard/*`; `model` is the
//! cloud-neutral event list every protocol renders from.

mod aws;
mod azure;
mod control;
mod fault;
mod gce;
mod model;
mod server;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub use fault::{Fault, FaultKind};
pub use model::{Ec2Action, EmulatedNotice, NoticeKind};

use server::Shared;

/// Which cloud's metadata service to emulate: the agent's one name of a cloud (the emulator
/// shares nothing else with the notice clients).
pub use crate::notice::Cloud;

/// What the GCE `instance/upcoming-maintenance` key answers when nothing is scheduled.
///
/// Google's documentation shows `{ }`; field reports show some machine types answer 404 and others
/// a 200 with an error object, so clients should be tested against all three.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum GceNoMaintenance {
    /// `200 {}` (the documented answer).
    #[default]
    Empty,
    /// `404 Not Found`.
    NotFound,
    /// `200 { "error": "no notifications have been received yet, try again later" }`.
    NoNotifications,
}

/// Configuration of one emulator instance. Build it with [`EmulatorConfig::new`] and adjust fields.
#[derive(Clone, Debug)]
pub struct EmulatorConfig {
    pub cloud: Cloud,
    /// Address to bind; port 0 picks an ephemeral port (see [`EmulatorHandle::addr`]).
    pub listen: SocketAddr,
    /// Raise an interruption automatically this long after start, with the cloud's typical
    /// deadline (EC2: 2 min; GCE: `preempted=TRUE` now; Azure: Preempt, NotBefore in 30 s).
    pub notice_after: Option<Duration>,
    /// The VM's name: GCE `instance/name`, Azure `compute/name` and default Azure `Resources`.
    pub vm_name: String,
    /// EC2: answer GETs that carry no token (IMDSv1). An invalid token is still a 401.
    pub allow_imds_v1: bool,
    /// EC2 `instance-id`, GCE `instance/id`.
    pub instance_id: String,
    /// EC2 `instance-type`.
    pub instance_type: String,
    /// EC2 `placement/availability-zone`, GCE zone name (the key answers the full
    /// `projects/<number>/zones/<zone>` path).
    pub zone: String,
    /// EC2: keep canceled/completed maintenance events in `events/maintenance/scheduled` (as
    /// ec2-metadata-mock does) instead of moving them to `events/maintenance/history` (as AWS
    /// documents).
    pub ec2_ended_events_in_scheduled: bool,
    /// EC2: stamp every answer with the request time, as AWS's `ec2-metadata-mock` does: the
    /// rebalance `noticeTime` is the time of the request and a spot instance-action's `time` two
    /// minutes after it, so the same notice looks different on every poll (instead of the times
    /// the notice was raised with).
    pub ec2_restamp_times: bool,
    /// GCE: the answer of `upcoming-maintenance` when nothing is scheduled.
    pub gce_no_maintenance: GceNoMaintenance,
    /// Azure: how long an event stays `Started` before it is removed (completed). Azure's
    /// documented guideline is about 10 minutes.
    pub azure_started_for: Duration,
}

impl EmulatorConfig {
    /// Defaults for `cloud`, listening on `127.0.0.1:0`.
    pub fn new(cloud: Cloud) -> Self {
        let (instance_id, instance_type, zone) = match cloud {
            Cloud::Aws => ("i-0123456789abcdef0", "g5.xlarge", "us-east-1a"),
            Cloud::Gce => ("4520031799277581759", "a2-highgpu-1g", "us-central1-a"),
            Cloud::Azure => (
                "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
                "Standard_NC24ads_A100_v4",
                "eastus",
            ),
        };
        EmulatorConfig {
            cloud,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            notice_after: None,
            vm_name: DEFAULT_VM_NAME.to_owned(),
            allow_imds_v1: false,
            instance_id: instance_id.to_owned(),
            instance_type: instance_type.to_owned(),
            zone: zone.to_owned(),
            ec2_ended_events_in_scheduled: false,
            ec2_restamp_times: false,
            gce_no_maintenance: GceNoMaintenance::default(),
            azure_started_for: Duration::from_secs(600),
        }
    }
}

const DEFAULT_VM_NAME: &str = "spotguard-vm";

/// `spotguard emulate` flags.
#[derive(Clone, Debug, clap::Args)]
pub struct EmulateArgs {
    /// Which metadata service to emulate.
    #[arg(long, value_enum)]
    pub cloud: Cloud,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:1338")]
    pub listen: SocketAddr,
    /// Raise an interruption automatically after this long (e.g. `30s`).
    #[arg(long, value_parser = crate::duration::parse)]
    pub notice_after: Option<Duration>,
    /// The VM name (GCE `instance/name`, Azure `compute/name` and event `Resources`).
    #[arg(long, default_value = DEFAULT_VM_NAME)]
    pub vm_name: String,
    /// EC2: also answer requests without a session token (IMDSv1).
    #[arg(long)]
    pub allow_imds_v1: bool,
    /// EC2: keep canceled/completed events in `events/maintenance/scheduled`.
    #[arg(long)]
    pub ec2_ended_events_in_scheduled: bool,
    /// EC2: stamp every answer with the request time (rebalance `noticeTime` = now, spot `time`
    /// = now + 2 min), as AWS's ec2-metadata-mock does.
    #[arg(long)]
    pub ec2_restamp_times: bool,
    /// GCE: what `upcoming-maintenance` answers when nothing is scheduled.
    #[arg(long, value_enum, default_value_t = GceNoMaintenance::Empty)]
    pub gce_no_maintenance: GceNoMaintenance,
}

impl EmulateArgs {
    pub fn to_config(&self) -> EmulatorConfig {
        let mut cfg = EmulatorConfig::new(self.cloud);
        cfg.listen = self.listen;
        cfg.notice_after = self.notice_after;
        cfg.vm_name = self.vm_name.clone();
        cfg.allow_imds_v1 = self.allow_imds_v1;
        cfg.ec2_ended_events_in_scheduled = self.ec2_ended_events_in_scheduled;
        cfg.ec2_restamp_times = self.ec2_restamp_times;
        cfg.gce_no_maintenance = self.gce_no_maintenance;
        cfg
    }
}

/// Errors of the emulator's control surface (bad notice or fault requests).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{kind} notices are not part of the {cloud} metadata protocol")]
    UnsupportedNotice { cloud: Cloud, kind: NoticeKind },
    #[error("{field} does not apply to {kind} notices on {cloud}")]
    UnsupportedField {
        cloud: Cloud,
        kind: NoticeKind,
        field: &'static str,
    },
    #[error("invalid {field} {value:?} for {cloud}: expected one of {expected}")]
    InvalidValue {
        cloud: Cloud,
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("no {cloud} event with id {id:?}")]
    UnknownEvent { cloud: Cloud, id: String },
    #[error("{cloud} cannot cancel event {id:?} ({kind} notices have no cancellation)")]
    NotCancellable {
        cloud: Cloud,
        id: String,
        kind: NoticeKind,
    },
    #[error("deadline offset {offset:?} is out of range")]
    OffsetOutOfRange { offset: Duration },
    #[error("invalid fault: {reason}")]
    InvalidFault { reason: String },
    #[error("invalid control request: {reason}")]
    InvalidRequest { reason: String },
}

impl Error {
    /// Every variant is a caller mistake: retrying the same request cannot succeed.
    pub fn is_retryable(&self) -> bool {
        false
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::UnsupportedNotice { .. } => "unsupported_notice",
            Error::UnsupportedField { .. } => "unsupported_field",
            Error::InvalidValue { .. } => "invalid_value",
            Error::UnknownEvent { .. } => "unknown_event",
            Error::NotCancellable { .. } => "not_cancellable",
            Error::OffsetOutOfRange { .. } => "offset_out_of_range",
            Error::InvalidFault { .. } => "invalid_fault",
            Error::InvalidRequest { .. } => "invalid_request",
        }
    }
}

/// A raised notice: its id (EC2/Azure `EventId`, or the emulator's own for notices the cloud
/// gives no id) and when it became visible to clients.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Raised {
    pub id: String,
    pub visible_at: Timestamp,
}

/// A running emulator. Dropping it without [`EmulatorHandle::shutdown`] stops it too (the server
/// tasks observe the cancelled token), but `shutdown` also waits for them.
pub struct EmulatorHandle {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

/// Bind `cfg.listen`, spawn the server on the current tokio runtime and return its handle.
pub async fn start(cfg: EmulatorConfig) -> std::io::Result<EmulatorHandle> {
    let (shared, addr) = server::start(cfg).await?;
    Ok(EmulatorHandle { shared, addr })
}

/// Run an emulator until `cancel` fires (for `spotguard emulate`). Logs the listen address.
pub async fn serve_until(cfg: EmulatorConfig, cancel: CancellationToken) -> std::io::Result<()> {
    let cloud = cfg.cloud;
    let handle = start(cfg).await?;
    tracing::info!(
        cloud = %cloud,
        listen = %handle.addr(),
        "metadata emulator listening; control: POST {}/spotguard/notice",
        handle.base_url()
    );
    cancel.cancelled().await;
    handle.shutdown().await;
    tracing::info!(cloud = %cloud, "metadata emulator stopped");
    Ok(())
}

/// Entry point of `spotguard emulate`.
pub async fn run_cli(args: EmulateArgs, cancel: CancellationToken) -> std::io::Result<()> {
    serve_until(args.to_config(), cancel).await
}

impl EmulatorHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT` (IPv6 addresses in brackets), without a trailing slash.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn cloud(&self) -> Cloud {
        self.shared.cfg.cloud
    }

    /// Raise a notice; returns its id and the instant it became visible to clients.
    pub fn raise(&self, notice: EmulatedNotice) -> Result<Raised, Error> {
        self.shared.raise(notice)
    }

    /// Cancel one maintenance event (EC2, GCE) or scheduled event (Azure) by id, or all of them
    /// with `None`. Returns the ids cancelled.
    pub fn cancel(&self, event_id: Option<&str>) -> Result<Vec<String>, Error> {
        self.shared.end_events(event_id, model::Status::Canceled)
    }

    /// Like [`EmulatorHandle::cancel`] but the events end as `completed` (EC2 history shows
    /// `State: completed`; on GCE and Azure they simply disappear).
    pub fn complete(&self, event_id: Option<&str>) -> Result<Vec<String>, Error> {
        self.shared.end_events(event_id, model::Status::Completed)
    }

    /// Remove every notice (the metadata service goes back to "nothing pending").
    pub fn clear(&self) {
        self.shared.clear();
    }

    /// Inject (or clear) a fault; see [`Fault`].
    pub fn fault(&self, fault: Fault) -> Result<(), Error> {
        self.shared.apply_fault(fault, fault::Origin::Handle)
    }

    /// Azure `StartRequests` EventIds received, in order.
    pub fn azure_acks(&self) -> Vec<String> {
        self.shared.azure_acks()
    }

    /// Requests received for `path` (exact path, without query string), faulted ones included.
    pub fn requests(&self, path: &str) -> u64 {
        self.shared.requests(path)
    }

    /// The same JSON document `GET /spotguard/state` answers.
    pub fn state(&self) -> serde_json::Value {
        self.shared.state_json()
    }

    /// Stop accepting, close every connection (hanging GETs included) and wait for the tasks.
    pub async fn shutdown(self) {
        self.shared.shutdown().await;
    }
}

impl Drop for EmulatorHandle {
    fn drop(&mut self) {
        self.shared.cancel_token().cancel();
    }
}
