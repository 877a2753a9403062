//! The cloud-neutral event list every protocol renders from, and the notice request type.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

use super::{Cloud, Error};

/// What kind of notice to raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NoticeKind {
    /// EC2 spot `instance-action`, GCE `preempted=TRUE`, Azure `Preempt`/`Terminate`.
    Interruption,
    /// EC2 rebalance recommendation (EC2 only).
    Rebalance,
    /// EC2 scheduled event, GCE host maintenance, Azure `Reboot`/`Redeploy`/`Freeze`/….
    Maintenance,
}

impl NoticeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            NoticeKind::Interruption => "interruption",
            NoticeKind::Rebalance => "rebalance",
            NoticeKind::Maintenance => "maintenance",
        }
    }
}

impl fmt::Display for NoticeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// EC2 spot `instance-action` action.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ec2Action {
    #[default]
    Terminate,
    Stop,
    Hibernate,
}

impl Ec2Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Ec2Action::Terminate => "terminate",
            Ec2Action::Stop => "stop",
            Ec2Action::Hibernate => "hibernate",
        }
    }
}

/// A notice to raise. Fields a cloud does not use are ignored by it; unset fields take the
/// cloud's documented defaults (see `docs/emulator.md`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmulatedNotice {
    pub kind: NoticeKind,
    /// Offset of the deadline (EC2 `time`, EC2/Azure `NotBefore`, GCE `window_start_time`) from
    /// the moment the notice is raised. JSON: `"in": "120s"` or a number of seconds.
    #[serde(
        rename = "in",
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::duration::serde_opt"
    )]
    pub due_in: Option<Duration>,
    /// EC2 interruption action.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Ec2Action>,
    /// EC2 maintenance `Code`, Azure `EventType`, GCE `maintenance-event` value.
    #[serde(default, alias = "event_type", skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// Azure: the VM named in `Resources` (default: the emulated VM itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// EC2/Azure `EventId` (default: a fresh id in the cloud's format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// EC2/Azure `Description`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// EC2 window length (`NotAfter − NotBefore`), GCE window length, Azure `DurationInSeconds`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::duration::serde_opt"
    )]
    pub duration: Option<Duration>,
    /// GCE `maintenance_reasons` (e.g. `FAILURE_GPU_XID`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// GCE: `upcoming-maintenance` shows the window only this long after `maintenance-event`
    /// changed (the window is learned after the event). JSON: `"window_after": "5s"`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::duration::serde_opt"
    )]
    pub window_after: Option<Duration>,
    /// EC2 maintenance: serve this exact string as the event's `NotBefore` (e.g. `"sometime"`, a
    /// malformed document) instead of the computed time; the event's deadline in the emulator's
    /// state is still computed from `in`. Rejected by the other clouds and kinds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before_raw: Option<String>,
}

impl EmulatedNotice {
    pub fn new(kind: NoticeKind) -> Self {
        EmulatedNotice {
            kind,
            due_in: None,
            action: None,
            code: None,
            target: None,
            event_id: None,
            description: None,
            duration: None,
            reasons: Vec::new(),
            window_after: None,
            not_before_raw: None,
        }
    }

    pub fn interruption() -> Self {
        Self::new(NoticeKind::Interruption)
    }

    pub fn rebalance() -> Self {
        Self::new(NoticeKind::Rebalance)
    }

    pub fn maintenance() -> Self {
        Self::new(NoticeKind::Maintenance)
    }

    pub fn due_in(mut self, offset: Duration) -> Self {
        self.due_in = Some(offset);
        self
    }

    pub fn action(mut self, action: Ec2Action) -> Self {
        self.action = Some(action);
        self
    }

    pub fn code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    pub fn target(mut self, vm: impl Into<String>) -> Self {
        self.target = Some(vm.into());
        self
    }

    pub fn event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = Some(id.into());
        self
    }

    pub fn description(mut self, text: impl Into<String>) -> Self {
        self.description = Some(text.into());
        self
    }

    pub fn duration(mut self, duration: Duration) -> Self {
        self.duration = Some(duration);
        self
    }

    pub fn reason(mut self, reason: impl Into<String>) -> Self {
        self.reasons.push(reason.into());
        self
    }

    pub fn window_after(mut self, delay: Duration) -> Self {
        self.window_after = Some(delay);
        self
    }

    /// EC2 maintenance: serve `raw` verbatim as `NotBefore` (see [`EmulatedNotice::not_before_raw`]).
    pub fn not_before_raw(mut self, raw: impl Into<String>) -> Self {
        self.not_before_raw = Some(raw.into());
        self
    }

    /// `now + due_in` (or `now + default`), rejecting offsets jiff cannot represent.
    pub(super) fn deadline(&self, now: Timestamp, default: Duration) -> Result<Timestamp, Error> {
        add(now, self.due_in.unwrap_or(default))
    }

    /// The requested `event_id`, or a fresh one in the cloud's format: `prefix-` and `digits`
    /// random hex digits.
    pub(super) fn id_or_fresh(&self, prefix: &str, digits: usize) -> String {
        self.event_id
            .clone()
            .unwrap_or_else(|| format!("{prefix}-{}", random_hex(digits)))
    }

    /// A maintenance window: from [`deadline`](Self::deadline) (default `lead`), lasting
    /// `duration` (default `length`).
    pub(super) fn window(
        &self,
        now: Timestamp,
        lead: Duration,
        length: Duration,
    ) -> Result<(Timestamp, Timestamp), Error> {
        let start = self.deadline(now, lead)?;
        Ok((start, add(start, self.duration.unwrap_or(length))?))
    }
}

pub(super) fn add(ts: Timestamp, offset: Duration) -> Result<Timestamp, Error> {
    SignedDuration::try_from(offset)
        .ok()
        .and_then(|d| ts.checked_add(d).ok())
        .ok_or(Error::OffsetOutOfRange { offset })
}

/// Lifecycle of an event, shared by the clouds (each renders the states it knows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Status {
    /// Announced, not started (EC2 `active`, Azure `Scheduled`).
    Scheduled,
    /// Azure `Started` (approved or NotBefore reached).
    Started,
    /// EC2 `canceled`; gone on GCE and Azure.
    Canceled,
    /// EC2 `completed`; gone on GCE and Azure.
    Completed,
}

impl Status {
    pub(super) fn is_live(self) -> bool {
        matches!(self, Status::Scheduled | Status::Started)
    }
}

/// One raised notice, in the emulator's cloud-neutral form.
#[derive(Clone, Debug, Serialize)]
pub(super) struct Event {
    pub id: String,
    pub kind: NoticeKind,
    pub raised_at: Timestamp,
    /// EC2 `time`/`NotBefore`, GCE `window_start_time`, Azure `NotBefore`; for a rebalance the
    /// `noticeTime`.
    pub start: Timestamp,
    /// EC2 `NotAfter`, GCE `window_end_time`.
    pub end: Option<Timestamp>,
    pub action: Ec2Action,
    /// EC2 `Code`, Azure `EventType`, GCE `maintenance-event` value.
    pub code: String,
    pub description: String,
    /// Azure `Resources`.
    pub target: String,
    pub status: Status,
    /// Azure `DurationInSeconds` (−1 = unknown).
    pub duration_secs: i64,
    pub reasons: Vec<String>,
    /// GCE: the window is not yet published in `upcoming-maintenance`.
    pub window_hidden: bool,
    /// EC2: the `NotBefore` string served instead of `start` (a malformed document).
    pub raw_not_before: Option<String>,
}

impl Event {
    /// A scheduled event for `notice` raised at `now`, starting now, with no id, code, target or
    /// reasons yet: each cloud fills in what its protocol carries.
    pub(super) fn scheduled(notice: &EmulatedNotice, now: Timestamp) -> Event {
        Event {
            id: String::new(),
            kind: notice.kind,
            raised_at: now,
            start: now,
            end: None,
            action: notice.action.unwrap_or_default(),
            code: String::new(),
            description: notice.description.clone().unwrap_or_default(),
            target: String::new(),
            status: Status::Scheduled,
            duration_secs: -1,
            reasons: Vec::new(),
            window_hidden: false,
            raw_not_before: None,
        }
    }
}

/// Everything the protocols read and the control surface writes. Guarded by one mutex in
/// `server::Shared`; never held across an await.
#[derive(Default)]
pub(super) struct Model {
    pub events: Vec<Event>,
    /// EC2 session tokens and their expiry.
    pub tokens: HashMap<String, tokio::time::Instant>,
    pub azure_acks: Vec<String>,
    pub azure_incarnation: u64,
    /// Last rendered Azure document (full fields) to detect changes for `DocumentIncarnation`.
    pub azure_last_doc: String,
    pub requests: BTreeMap<String, u64>,
}

impl Model {
    pub(super) fn find(&self, id: &str) -> Option<&Event> {
        self.events.iter().find(|e| e.id == id)
    }

    pub(super) fn find_mut(&mut self, id: &str) -> Option<&mut Event> {
        self.events.iter_mut().find(|e| e.id == id)
    }

    /// The most recently raised live event of `kind`.
    pub(super) fn latest(&self, kind: NoticeKind) -> Option<&Event> {
        self.events
            .iter()
            .rev()
            .find(|e| e.kind == kind && e.status.is_live())
    }
}

/// Reject a code not in `allowed` (compared exactly, as the clouds spell them).
pub(super) fn check_code(
    cloud: Cloud,
    field: &'static str,
    value: &str,
    allowed: &[&str],
    expected: &'static str,
) -> Result<(), Error> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(Error::InvalidValue {
            cloud,
            field,
            value: value.to_owned(),
            expected,
        })
    }
}

/// `n` random lowercase hex digits (event ids).
pub(super) fn random_hex(n: usize) -> String {
    (0..n)
        .map(|_| char::from_digit(fastrand::u32(..16), 16).unwrap_or('0'))
        .collect()
}
