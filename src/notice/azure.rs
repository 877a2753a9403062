//! Azure Scheduled Events (IMDS `GET /metadata/scheduledevents?api-version=2020-07-01`, header
//! `Metadata: true`), polled at the configured interval.
//!
//! Only events whose `Resources` name this VM are reported (the name comes from IMDS
//! `compute/name` unless configured). `Preempt`/`Terminate` are interruptions (deadline
//! `NotBefore`, RFC 1123; empty means now), `Reboot`/`Redeploy`/`Freeze` maintenance. An event that
//! disappears without spotguard having approved it yields a `Cancelled`. [`NoticeSource::acknowledge`]
//! approves an event (`POST {"StartRequests":[{"EventId":…}]}`), which makes it start sooner:
//! the responder calls it only after checkpoint and drain.
//!
//! The service is enabled by the first request and may take minutes to answer it, so the first
//! request gets [`AzureConfig::first_request_timeout`] instead of the normal bound.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use reqwest::Url;
use serde::{Deserialize, Serialize};

use super::detect::Dmi;
use super::ec2::parse_rfc2822;
use super::http::{
    constant_url, endpoint_url, metadata_client, parse_error, read_body, request_error,
};
use super::monitor::ErrorReporter;
use super::{
    content_id, Cloud, CloudFacts, Error, MaintenanceKind, Notice, NoticeKind, NoticeSource, Probe,
    Settings, SourceMetrics,
};
use crate::metrics::Metrics;

/// What the agent knows about Azure ([`Cloud::Azure`]).
pub const FACTS: CloudFacts = CloudFacts {
    name: "azure",
    // About 30 s of notice: 8 s of it kept for evictions.
    drain_reserve: Duration::from_secs(8),
    interruption_notice: Duration::from_secs(30),
    max_interruption_notice: None,
    drill_notice: "Azure Scheduled Events Preempt: NotBefore 30 s ahead",
    drill_detection: "by the agent polling the emulated Azure Scheduled Events (1s)",
    // Plain Hyper-V has the vendor but not Azure's asset tag.
    dmi: |d: &Dmi| {
        d.sys_vendor == "Microsoft Corporation" && d.chassis_asset_tag == AZURE_ASSET_TAG
    },
    probe: Probe {
        method: reqwest::Method::GET,
        path: "/metadata/instance/compute/vmId?api-version=2021-02-01&format=text",
        header: ("Metadata", "true"),
    },
    maintenance_of_detail,
    build,
};

/// Azure's fixed chassis asset tag.
pub const AZURE_ASSET_TAG: &str = "7783-7084-3265-9085-8269-3286-77";

fn build(
    s: &Settings,
    metrics: &Arc<Metrics>,
    _own: &SourceMetrics,
) -> Result<Arc<dyn NoticeSource>, Error> {
    let config = AzureConfig::new(s.endpoint.clone(), s.poll_interval, s.azure_vm_name.clone());
    Ok(Arc::new(AzureScheduledEvents::new(
        config,
        metrics.clone(),
    )?))
}

const EVENTS_PATH: &str = "/metadata/scheduledevents";
const EVENTS_API_VERSION: &str = "2020-07-01";
const NAME_PATH: &str = "/metadata/instance/compute/name";
const NAME_API_VERSION: &str = "2021-02-01";
const METADATA_HEADER: &str = "Metadata";

/// Settings of [`AzureScheduledEvents`].
#[derive(Clone, Debug)]
pub struct AzureConfig {
    /// IMDS base URL (`http://169.254.169.254`).
    pub endpoint: Url,
    /// Delay between polls (`--poll-interval`).
    pub poll_interval: Duration,
    /// This VM's name as it appears in events' `Resources`; `None` reads IMDS `compute/name`.
    pub vm_name: Option<String>,
    /// Bound on the first scheduled-events request (the service starts on first use).
    pub first_request_timeout: Duration,
    /// Bound on every later request (events, name, acknowledgement).
    pub request_timeout: Duration,
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
}

impl AzureConfig {
    pub const DEFAULT_ENDPOINT: &'static str = "http://169.254.169.254";

    /// `endpoint` `None` means [`Self::DEFAULT_ENDPOINT`]; first request bounded at 180 s, later
    /// ones at 10 s (2 s to connect).
    pub fn new(endpoint: Option<Url>, poll_interval: Duration, vm_name: Option<String>) -> Self {
        AzureConfig {
            endpoint: endpoint.unwrap_or_else(|| constant_url(Self::DEFAULT_ENDPOINT)),
            poll_interval,
            vm_name,
            first_request_timeout: Duration::from_secs(180),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Document {
    #[serde(default)]
    events: Vec<Event>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct Event {
    #[serde(default)]
    event_id: String,
    #[serde(default)]
    event_type: String,
    #[serde(default)]
    resources: Vec<String>,
    #[serde(default)]
    event_status: String,
    #[serde(default)]
    not_before: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    event_source: String,
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct StartRequests<'a> {
    start_requests: [StartRequest<'a>; 1],
}

#[derive(Serialize)]
#[serde(rename_all = "PascalCase")]
struct StartRequest<'a> {
    event_id: &'a str,
}

#[derive(Default)]
struct Seen {
    /// Events of this VM reported by the last poll: id → first seen.
    reported: HashMap<String, Timestamp>,
    /// Events spotguard approved: their disappearance is expected, not a cancellation.
    acknowledged: HashSet<String>,
}

/// The Azure notice source (name `azure`).
pub struct AzureScheduledEvents {
    config: AzureConfig,
    client: reqwest::Client,
    events_url: Url,
    name_url: Url,
    vm_name: tokio::sync::Mutex<Option<String>>,
    answered_once: AtomicBool,
    seen: Mutex<Seen>,
    reporter: ErrorReporter,
}

impl AzureScheduledEvents {
    /// Build the client; nothing is requested until the first `poll`.
    pub fn new(config: AzureConfig, metrics: Arc<Metrics>) -> Result<Self, Error> {
        let base = &config.endpoint;
        let mut events_url = endpoint_url(base, EVENTS_PATH)?;
        events_url
            .query_pairs_mut()
            .append_pair("api-version", EVENTS_API_VERSION);
        let mut name_url = endpoint_url(base, NAME_PATH)?;
        name_url
            .query_pairs_mut()
            .append_pair("api-version", NAME_API_VERSION)
            .append_pair("format", "text");
        let client = metadata_client(&config.endpoint, config.connect_timeout)
            .build()
            .map_err(|e| request_error(base, e))?;
        let vm_name = config
            .vm_name
            .as_ref()
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty());
        Ok(AzureScheduledEvents {
            config,
            client,
            events_url,
            name_url,
            vm_name: tokio::sync::Mutex::new(vm_name),
            answered_once: AtomicBool::new(false),
            seen: Mutex::new(Seen::default()),
            reporter: ErrorReporter::new(Cloud::Azure.as_str(), metrics),
        })
    }

    /// This VM's name: the configured one, else IMDS `compute/name` (cached once read).
    async fn vm_name(&self) -> Result<String, Error> {
        let mut cached = self.vm_name.lock().await;
        if let Some(name) = cached.as_ref() {
            return Ok(name.clone());
        }
        let url = &self.name_url;
        let body = self.get_text(url, self.config.request_timeout).await?;
        let name = body.trim();
        if !valid_vm_name(name) {
            // A garbled answer must never become the filter: it would hide this VM's events.
            return Err(parse_error(
                url,
                "compute/name is not a VM name (1-64 letters, digits, '-', '_', '.')",
            ));
        }
        tracing::info!(vm_name = name, "Azure VM name from IMDS");
        *cached = Some(name.to_string());
        Ok(name.to_string())
    }

    /// GET `url` with the `Metadata: true` header: the body of a 2xx answer.
    async fn get_text(&self, url: &Url, timeout: Duration) -> Result<String, Error> {
        let resp = self
            .client
            .get(url.clone())
            .header(METADATA_HEADER, "true")
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| request_error(url, e))?;
        if !resp.status().is_success() {
            return Err(Error::Status {
                url: url.to_string(),
                status: resp.status().as_u16(),
            });
        }
        read_body(url, resp).await
    }

    async fn fetch_events(&self) -> Result<Document, Error> {
        let url = &self.events_url;
        let timeout = if self.answered_once.load(Ordering::Relaxed) {
            self.config.request_timeout
        } else {
            self.config.first_request_timeout
        };
        let body = self.get_text(url, timeout).await?;
        self.answered_once.store(true, Ordering::Relaxed);
        serde_json::from_str(&body)
            .map_err(|e| parse_error(url, format!("scheduled events JSON: {e}")))
    }

    fn to_notice(&self, ev: &Event, now: Timestamp) -> Result<Option<Notice>, Error> {
        let (kind, restart, maintenance) = match ev.event_type.as_str() {
            "Preempt" | "Terminate" => (NoticeKind::Interruption, false, MaintenanceKind::Other),
            "Reboot" | "Redeploy" => (NoticeKind::Maintenance, true, MaintenanceKind::Other),
            // A pause of seconds: its own policy (`--on-azure-freeze`).
            "Freeze" => (NoticeKind::Maintenance, false, MaintenanceKind::Freeze),
            other => {
                tracing::warn!(event_type = other, event_id = %ev.event_id, "unknown scheduled event type; ignored");
                return Ok(None);
            }
        };
        // Empty NotBefore: the event has started (or starts at once).
        let when = if ev.not_before.trim().is_empty() {
            now
        } else {
            parse_rfc2822(&self.events_url, "NotBefore", &ev.not_before)?
        };
        let id = if ev.event_id.is_empty() {
            content_id(
                Cloud::Azure,
                kind.label(),
                &[&ev.event_type, &ev.not_before],
            )
        } else {
            ev.event_id.clone()
        };
        Ok(Some(Notice {
            id,
            kind,
            source: Cloud::Azure,
            deadline: Some(when),
            not_before: Some(when),
            detail: format!(
                "{} ({}, {}): {}",
                ev.event_type, ev.event_status, ev.event_source, ev.description
            ),
            restart,
            published_at: None,
            maintenance,
            observed_at: now,
            cloud_event_id: (!ev.event_id.is_empty()).then(|| ev.event_id.clone()),
        }))
    }
}

/// The kind of maintenance a notice's `detail` names: the `detail` of an Azure event starts with
/// its type (`Freeze (Scheduled, Platform): …`). A plan record keeps the detail, not the kind.
fn maintenance_of_detail(detail: &str) -> MaintenanceKind {
    if detail.starts_with("Freeze (") {
        MaintenanceKind::Freeze
    } else {
        MaintenanceKind::Other
    }
}

/// Azure resource names: 1–64 characters of letters, digits, `-`, `_` and `.`.
fn valid_vm_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn names_vm(ev: &Event, vm_name: &str) -> bool {
    ev.resources
        .iter()
        .any(|r| r.trim().eq_ignore_ascii_case(vm_name))
}

#[async_trait]
impl NoticeSource for AzureScheduledEvents {
    fn name(&self) -> &'static str {
        Cloud::Azure.as_str()
    }

    fn poll_interval(&self) -> Duration {
        self.config.poll_interval
    }

    async fn poll(&self) -> Result<Vec<Notice>, Error> {
        let (doc, vm_name) = tokio::join!(self.fetch_events(), self.vm_name());
        let doc = doc?;
        let vm_name = vm_name?;
        let now = Timestamp::now();
        let mut notices = Vec::new();
        // Ids of this VM's events, including any whose notice could not be built: an event
        // with a bad field is counted and logged, not mistaken for a cancellation.
        let mut present = HashSet::new();
        for ev in doc.events.iter().filter(|ev| names_vm(ev, &vm_name)) {
            match self.to_notice(ev, now) {
                Ok(Some(n)) => {
                    present.insert(n.id.clone());
                    notices.push(n);
                }
                Ok(None) => {}
                Err(e) => {
                    present.insert(ev.event_id.clone());
                    self.reporter.report(&e);
                }
            }
        }
        let mut seen = crate::sync::lock(&self.seen);
        for n in notices.iter_mut() {
            n.observed_at = *seen.reported.entry(n.id.clone()).or_insert(now);
        }
        let gone: Vec<String> = seen
            .reported
            .keys()
            .filter(|id| !present.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            seen.reported.remove(&id);
            if seen.acknowledged.remove(&id) {
                tracing::debug!(event_id = %id, "approved scheduled event is gone");
                continue;
            }
            tracing::info!(event_id = %id, "scheduled event disappeared; cancelled");
            notices.push(Notice {
                id: content_id(Cloud::Azure, "cancelled", &[&id]),
                kind: NoticeKind::Cancelled(id.clone()),
                source: Cloud::Azure,
                deadline: None,
                not_before: None,
                detail: format!("scheduled event {id} is no longer listed"),
                restart: false,
                published_at: None,
                maintenance: MaintenanceKind::Other,
                observed_at: now,
                // The key may be a content id (an event served without EventId).
                cloud_event_id: None,
            });
        }
        Ok(notices)
    }

    fn acknowledges(&self, notice: &Notice) -> bool {
        notice.source == Cloud::Azure && !matches!(notice.kind, NoticeKind::Cancelled(_))
    }

    /// Approve the scheduled event `notice.id` so that it starts now.
    async fn acknowledge(&self, notice: &Notice) -> Result<(), Error> {
        if notice.source != Cloud::Azure || matches!(notice.kind, NoticeKind::Cancelled(_)) {
            return Ok(());
        }
        let event_id = notice.id.as_str();
        let ack_error = |reason: String| Error::Acknowledge {
            event_id: event_id.to_string(),
            reason,
        };
        let body = StartRequests {
            start_requests: [StartRequest { event_id }],
        };
        let resp = self
            .client
            .post(self.events_url.clone())
            .header(METADATA_HEADER, "true")
            .timeout(self.config.request_timeout)
            .json(&body)
            .send()
            .await
            .map_err(|e| ack_error(format!("POST {}: {e}", self.events_url)))?;
        if !resp.status().is_success() {
            return Err(ack_error(format!(
                "POST {} answered HTTP {}",
                self.events_url,
                resp.status().as_u16()
            )));
        }
        tracing::info!(event_id, "approved Azure scheduled event");
        crate::sync::lock(&self.seen)
            .acknowledged
            .insert(event_id.to_string());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> AzureScheduledEvents {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        let config = AzureConfig::new(None, Duration::from_secs(1), Some("vm1".into()));
        AzureScheduledEvents::new(config, metrics).unwrap()
    }

    fn event(event_type: &str, not_before: &str) -> Event {
        Event {
            event_id: "E1".into(),
            event_type: event_type.into(),
            resources: vec!["vm1".into()],
            event_status: "Scheduled".into(),
            not_before: not_before.into(),
            description: String::new(),
            event_source: "Platform".into(),
        }
    }

    #[test]
    fn event_types_map_to_kinds() {
        let s = source();
        let now: Timestamp = "2016-09-19T18:00:00Z".parse().unwrap();
        let p = s
            .to_notice(&event("Preempt", "Mon, 19 Sep 2016 18:29:47 GMT"), now)
            .unwrap()
            .unwrap();
        assert_eq!(p.kind, NoticeKind::Interruption);
        assert_eq!(p.deadline, Some("2016-09-19T18:29:47Z".parse().unwrap()));
        assert_eq!(p.id, "E1");
        let t = s.to_notice(&event("Terminate", ""), now).unwrap().unwrap();
        assert_eq!(t.deadline, Some(now), "empty NotBefore means now");
        let r = s.to_notice(&event("Reboot", ""), now).unwrap().unwrap();
        assert_eq!((r.kind.clone(), r.restart), (NoticeKind::Maintenance, true));
        let d = s.to_notice(&event("Redeploy", ""), now).unwrap().unwrap();
        assert!(d.restart);
        let f = s.to_notice(&event("Freeze", ""), now).unwrap().unwrap();
        assert_eq!(
            (f.kind.clone(), f.restart),
            (NoticeKind::Maintenance, false)
        );
        assert_eq!(f.maintenance, MaintenanceKind::Freeze);
        assert_eq!(maintenance_of_detail(&f.detail), MaintenanceKind::Freeze);
        assert_eq!(maintenance_of_detail(&r.detail), MaintenanceKind::Other);
        assert!(s.to_notice(&event("Teleport", ""), now).unwrap().is_none());
        let bad = s
            .to_notice(&event("Preempt", "next tuesday"), now)
            .unwrap_err();
        assert_eq!(bad.metric_label(), "parse");
    }

    #[test]
    fn resource_match_is_case_insensitive_and_exact() {
        let mut ev = event("Freeze", "");
        ev.resources = vec!["VM1".into(), "vm10".into()];
        assert!(names_vm(&ev, "vm1"));
        ev.resources = vec!["vm10".into()];
        assert!(!names_vm(&ev, "vm1"));
    }

    #[test]
    fn ack_body_shape() {
        let body = StartRequests {
            start_requests: [StartRequest { event_id: "E1" }],
        };
        assert_eq!(
            serde_json::to_string(&body).unwrap(),
            r#"{"StartRequests":[{"EventId":"E1"}]}"#
        );
    }
}
