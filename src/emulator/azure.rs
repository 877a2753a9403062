//! Azure Instance Metadata Service: Scheduled Events and `compute/name`.
//!
//! From Microsoft's documentation: every request needs `Metadata: true` and must not carry
//! `X-Forwarded-For` (else 400), and an `api-version` the service knows (else 400 with the newest
//! versions). `GET /metadata/scheduledevents` answers `{"DocumentIncarnation", "Events"}`; the
//! incarnation increases whenever the events change. `POST` with `{"StartRequests":
//! [{"EventId"}]}` approves events: they move to `Started` (with an empty `NotBefore`), as they
//! also do on their own when `NotBefore` passes, and are removed when finished; a cancelled event
//! simply disappears. Events are delivered to every VM of an availability set or scale-set
//! placement group, so `Resources` may name other VMs.

use std::sync::{Arc, Weak};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use jiff::Timestamp;
use serde::Deserialize;
use serde_json::json;

use super::model::{check_code, random_hex, EmulatedNotice, Event, Model, NoticeKind, Status};
use super::server::{self, Shared};
use super::wire::{self, Body};
use super::{Cloud, EmulatorConfig, Error};

const SCHEDULED_EVENTS: &str = "/metadata/scheduledevents";
const COMPUTE_NAME: &str = "/metadata/instance/compute/name";

/// Scheduled Events API versions, oldest first.
const EVENT_VERSIONS: &[&str] = &[
    "2017-03-01",
    "2017-08-01",
    "2017-11-01",
    "2019-01-01",
    "2019-04-01",
    "2019-08-01",
    "2020-07-01",
];

/// Instance API versions, oldest first.
const INSTANCE_VERSIONS: &[&str] = &[
    "2017-03-01",
    "2017-04-02",
    "2017-08-01",
    "2017-10-01",
    "2017-12-01",
    "2018-02-01",
    "2018-04-02",
    "2018-10-01",
    "2019-02-01",
    "2019-03-11",
    "2019-04-30",
    "2019-06-01",
    "2019-06-04",
    "2019-08-01",
    "2019-08-15",
    "2019-11-01",
    "2020-06-01",
    "2020-07-15",
    "2020-09-01",
    "2020-10-01",
    "2020-12-01",
    "2021-01-01",
    "2021-02-01",
    "2021-03-01",
    "2021-05-01",
    "2021-08-01",
    "2021-10-01",
    "2021-11-01",
    "2021-11-15",
    "2021-12-13",
];

/// The newest Scheduled Events version; change detection renders with every field.
const NEWEST_EVENTS_VERSION: &str = "2020-07-01";

const INTERRUPTION_TYPES: &[&str] = &["Preempt", "Terminate"];
const MAINTENANCE_TYPES: &[&str] = &["Reboot", "Redeploy", "Freeze"];

/// Minimum notice per event type, as documented.
fn default_notice(event_type: &str) -> Duration {
    match event_type {
        "Preempt" => Duration::from_secs(30),
        "Terminate" => Duration::from_secs(5 * 60),
        "Redeploy" => Duration::from_secs(10 * 60),
        _ => Duration::from_secs(15 * 60),
    }
}

fn default_description(event_type: &str) -> &'static str {
    match event_type {
        "Preempt" => "Spot virtual machine is being evicted.",
        "Terminate" => "Virtual machine is being deleted.",
        "Redeploy" => "Virtual machine is being moved to another host.",
        "Freeze" => "Virtual machine is being paused for a memory-preserving live migration.",
        _ => "Virtual machine is going to be restarted for host maintenance.",
    }
}

pub(super) fn build(
    cfg: &EmulatorConfig,
    notice: &EmulatedNotice,
    now: Timestamp,
) -> Result<Event, Error> {
    let (allowed, expected, default) = match notice.kind {
        NoticeKind::Interruption => (INTERRUPTION_TYPES, "Preempt, Terminate", "Preempt"),
        NoticeKind::Maintenance => (MAINTENANCE_TYPES, "Reboot, Redeploy, Freeze", "Reboot"),
        NoticeKind::Rebalance => {
            return Err(Error::UnsupportedNotice {
                cloud: Cloud::Azure,
                kind: NoticeKind::Rebalance,
            })
        }
    };
    let event_type = notice.code.as_deref().unwrap_or(default);
    check_code(Cloud::Azure, "code", event_type, allowed, expected)?;
    let duration_secs = match notice.duration {
        Some(d) => i64::try_from(d.as_secs()).map_err(|_| Error::OffsetOutOfRange { offset: d })?,
        None => -1,
    };
    Ok(Event {
        id: notice.event_id.clone().unwrap_or_else(guid),
        start: notice.deadline(now, default_notice(event_type))?,
        code: event_type.to_owned(),
        description: notice
            .description
            .clone()
            .unwrap_or_else(|| default_description(event_type).to_owned()),
        target: notice.target.clone().unwrap_or_else(|| cfg.vm_name.clone()),
        duration_secs,
        ..Event::scheduled(notice, now)
    })
}

/// An upper-case GUID, as Azure spells EventIds.
fn guid() -> String {
    let h = random_hex(32).to_uppercase();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Bump `DocumentIncarnation` when the events changed since the last publish.
pub(super) fn publish(model: &mut Model) {
    let doc = events(model, NEWEST_EVENTS_VERSION).to_string();
    if model.azure_last_doc.is_empty() {
        model.azure_last_doc = doc;
    } else if model.azure_last_doc != doc {
        model.azure_incarnation += 1;
        model.azure_last_doc = doc;
    }
}

/// The `Events` array, with the fields `api_version` has.
fn events(model: &Model, api_version: &str) -> serde_json::Value {
    let list = model
        .events
        .iter()
        .filter(|e| e.kind != NoticeKind::Rebalance && e.status.is_live())
        .map(|e| {
            let mut ev = json!({
                "EventId": e.id,
                "EventStatus": if e.status == Status::Started { "Started" } else { "Scheduled" },
                "EventType": e.code,
                "ResourceType": "VirtualMachine",
                "Resources": [e.target],
                "NotBefore": if e.status == Status::Started { String::new() } else { wire::rfc1123(e.start) },
            });
            if api_version >= "2019-04-01" {
                ev["Description"] = json!(e.description);
            }
            if api_version >= "2019-08-01" {
                ev["EventSource"] = json!("Platform");
            }
            if api_version >= "2020-07-01" {
                ev["DurationInSeconds"] = json!(e.duration_secs);
            }
            ev
        })
        .collect();
    serde_json::Value::Array(list)
}

/// Start the event when its `NotBefore` passes (Azure's implicit approval).
pub(super) fn schedule_auto_start(shared: &Arc<Shared>, id: String, not_before: Timestamp) {
    let raised_at = shared.lock().find(&id).map(|e| e.raised_at);
    let Some(raised_at) = raised_at else { return };
    let delay =
        Duration::try_from(not_before.duration_since(Timestamp::now())).unwrap_or(Duration::ZERO);
    let weak = Arc::downgrade(shared);
    shared.spawn_timer(delay, move || {
        if let Some(shared) = weak.upgrade() {
            start_event(&shared, &id, Some(raised_at));
        }
    });
}

/// Move a scheduled event to `Started` and schedule its removal. `raised_at` guards against a
/// timer of an earlier event that was re-raised under the same id.
fn start_event(shared: &Arc<Shared>, id: &str, raised_at: Option<Timestamp>) {
    let started = shared.mutate(|m| match m.find_mut(id) {
        Some(e) if e.status == Status::Scheduled && raised_at.is_none_or(|r| r == e.raised_at) => {
            e.status = Status::Started;
            Some(e.raised_at)
        }
        _ => None,
    });
    let Some(raised_at) = started else { return };
    tracing::info!(notice_id = %id, source = "azure", "emulator: scheduled event started");
    let weak: Weak<Shared> = Arc::downgrade(shared);
    let id = id.to_owned();
    shared.spawn_timer(shared.cfg.azure_started_for, move || {
        if let Some(shared) = weak.upgrade() {
            shared.mutate(|m| {
                if let Some(e) = m.find_mut(&id) {
                    if e.status == Status::Started && e.raised_at == raised_at {
                        e.status = Status::Completed;
                    }
                }
            });
        }
    });
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    wire::response(
        status,
        "application/json; charset=utf-8",
        json!({ "error": message }).to_string(),
    )
}

fn version_error(message: &str, versions: &[&str]) -> Response<Body> {
    let newest: Vec<&str> = versions.iter().rev().take(3).copied().collect();
    wire::response(
        StatusCode::BAD_REQUEST,
        "application/json; charset=utf-8",
        json!({ "error": message, "newest-versions": newest }).to_string(),
    )
}

/// The request's `api-version` if it is one of `versions`, else the 400 to answer.
fn api_version<'q>(
    query: &'q [(String, String)],
    versions: &[&str],
) -> Result<&'q str, Box<Response<Body>>> {
    match server::param(query, "api-version") {
        None => Err(Box::new(version_error(
            "Bad request. api-version was not specified in the request. For more information refer to aka.ms/azureimds",
            versions,
        ))),
        Some(v) if versions.contains(&v) => Ok(v),
        Some(_) => Err(Box::new(version_error(
            "Bad request. api-version is invalid or was not specified in the request. For more information refer to aka.ms/azureimds",
            versions,
        ))),
    }
}

pub(super) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    if let Err(resp) = check_headers(&req) {
        return *resp;
    }
    let query = match server::query(&req) {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("Bad request. {e}")),
    };
    let path = req.uri().path().trim_end_matches('/').to_owned();
    match path.as_str() {
        SCHEDULED_EVENTS => scheduled_events(shared, req, &query).await,
        COMPUTE_NAME => compute_name(shared, &req, &query),
        "/metadata/instance/compute" | "/metadata/instance" => instance(shared, &path, &query),
        "/metadata/versions" => wire::response(
            StatusCode::OK,
            "application/json; charset=utf-8",
            json!({ "apiVersions": INSTANCE_VERSIONS }).to_string(),
        ),
        _ => error(StatusCode::NOT_FOUND, "Not found"),
    }
}

/// IMDS refuses a proxied request (`X-Forwarded-For`) and one without `Metadata: true`.
fn check_headers(req: &Request<Incoming>) -> Result<(), Box<Response<Body>>> {
    if req.headers().contains_key("x-forwarded-for") {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "Bad request. X-Forwarded-For header is not allowed",
        )));
    }
    let metadata_ok = req
        .headers()
        .get("metadata")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
    if !metadata_ok {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "Bad request. Required metadata header not specified",
        )));
    }
    Ok(())
}

/// Scheduled Events: GET the document, POST an approval.
async fn scheduled_events(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    query: &[(String, String)],
) -> Response<Body> {
    let version = match api_version(query, EVENT_VERSIONS) {
        Ok(v) => v.to_owned(),
        Err(resp) => return *resp,
    };
    match *req.method() {
        Method::GET => {
            let model = shared.lock();
            let doc = json!({
                "DocumentIncarnation": model.azure_incarnation,
                "Events": events(&model, &version),
            });
            wire::response(
                StatusCode::OK,
                "application/json; charset=utf-8",
                doc.to_string(),
            )
        }
        Method::POST => approve(shared, req).await,
        _ => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "Only GET and POST requests are supported",
        ),
    }
}

/// The VM's name, a leaf: GET with `format=text` only.
fn compute_name(
    shared: &Arc<Shared>,
    req: &Request<Incoming>,
    query: &[(String, String)],
) -> Response<Body> {
    if let Err(resp) = api_version(query, INSTANCE_VERSIONS) {
        return *resp;
    }
    if req.method() != Method::GET {
        return error(
            StatusCode::METHOD_NOT_ALLOWED,
            "Only GET requests are supported",
        );
    }
    if server::param(query, "format") != Some("text") {
        return error(
            StatusCode::BAD_REQUEST,
            "Bad request. Leaf nodes need the query parameter format=text",
        );
    }
    wire::response(
        StatusCode::OK,
        "text/plain; charset=utf-8",
        shared.cfg.vm_name.clone(),
    )
}

/// The instance document (`/metadata/instance`) or its `compute` part, as JSON.
fn instance(shared: &Arc<Shared>, path: &str, query: &[(String, String)]) -> Response<Body> {
    if let Err(resp) = api_version(query, INSTANCE_VERSIONS) {
        return *resp;
    }
    if !matches!(server::param(query, "format"), None | Some("json")) {
        return error(
            StatusCode::BAD_REQUEST,
            "Bad request. Only format=json is supported here",
        );
    }
    let cfg = &shared.cfg;
    let compute = json!({
        "name": cfg.vm_name,
        "vmId": cfg.instance_id,
        "vmSize": cfg.instance_type,
        "location": cfg.zone,
    });
    let doc = if path == "/metadata/instance" {
        json!({ "compute": compute })
    } else {
        compute
    };
    wire::response(
        StatusCode::OK,
        "application/json; charset=utf-8",
        doc.to_string(),
    )
}

#[derive(Deserialize)]
struct StartRequests {
    #[serde(rename = "StartRequests")]
    start_requests: Vec<StartRequest>,
}

#[derive(Deserialize)]
struct StartRequest {
    #[serde(rename = "EventId")]
    event_id: String,
}

/// `POST` `{"StartRequests": [{"EventId": …}]}`: 200 for known events (even already started
/// ones), 400 for a malformed payload or an EventId the VM was never sent.
async fn approve(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let body = match server::read_body(req, 64 * 1024).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, &format!("Bad request. {e}")),
    };
    let parsed: StartRequests = match serde_json::from_slice(&body) {
        Ok(p) => p,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("Bad request. Malformed StartRequests payload: {e}"),
            )
        }
    };
    let ids: Vec<String> = parsed
        .start_requests
        .into_iter()
        .map(|r| r.event_id)
        .collect();
    let unknown = {
        let mut model = shared.lock();
        let unknown: Vec<String> = ids
            .iter()
            .filter(|id| !model.find(id).is_some_and(|e| e.status.is_live()))
            .cloned()
            .collect();
        if unknown.is_empty() {
            model.azure_acks.extend(ids.iter().cloned());
        }
        unknown
    };
    if !unknown.is_empty() {
        return error(
            StatusCode::BAD_REQUEST,
            &format!("Bad request. Unknown EventId(s): {}", unknown.join(", ")),
        );
    }
    for id in &ids {
        tracing::info!(notice_id = %id, source = "azure", "emulator: StartRequest received");
        start_event(shared, id, None);
    }
    wire::response(StatusCode::OK, "application/json; charset=utf-8", "")
}
