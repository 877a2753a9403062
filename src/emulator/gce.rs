//! GCE metadata server: `Metadata-Flavor: Google`, ETags and hanging GETs.
//!
//! From Google's documentation: every request needs `Metadata-Flavor: Google` and must not carry
//! `X-Forwarded-For` (else 403); answers carry `Metadata-Flavor: Google` and an `ETag`.
//! `?wait_for_change=true&last_etag=E` answers at once when the value's ETag differs from `E`,
//! otherwise holds the request until the value changes or `timeout_sec` passes (then answers
//! the unchanged value). Without `last_etag` it waits for the next change. `preempted` is
//! `TRUE`/`FALSE`; `maintenance-event` is `NONE`, `MIGRATE_ON_HOST_MAINTENANCE` or
//! `TERMINATE_ON_HOST_MAINTENANCE`; `upcoming-maintenance` is a snake_case JSON object
//! (`window_start_time`, `window_end_time`, `latest_window_start_time`, `maintenance_status`,
//! `type`, `can_reschedule` as a string, `maintenance_reasons`).
//!
//! Each key is a `tokio::sync::watch` channel: a hanging GET is a parked receiver, so thousands
//! of them cost a little memory each and no polling.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use jiff::Timestamp;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use super::model::{check_code, EmulatedNotice, Event, Model, NoticeKind};
use super::server::{self, Shared};
use super::wire::{self, Body};
use super::{Cloud, EmulatorConfig, Error, GceNoMaintenance};

const PREFIX: &str = "/computeMetadata/v1/";
const PROJECT_NUMBER: &str = "123456789012";
const PROJECT_ID: &str = "spotguard-emulator";

const MAINTENANCE_NOTICE: Duration = Duration::from_secs(3600);
const MAINTENANCE_WINDOW: Duration = Duration::from_secs(3600);
const MAINTENANCE_VALUES: &[&str] = &[
    "TERMINATE_ON_HOST_MAINTENANCE",
    "MIGRATE_ON_HOST_MAINTENANCE",
    "NONE",
];

/// Keys under `/computeMetadata/v1/` served by the emulator; the first [`CHANGING`] change.
const CHANGING: usize = 3;
const KEYS: &[&str] = &[
    "instance/preempted",
    "instance/maintenance-event",
    "instance/upcoming-maintenance",
    "instance/name",
    "instance/id",
    "instance/zone",
    "instance/hostname",
    "project/project-id",
    "project/numeric-project-id",
];

/// One key's current answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Value {
    status: StatusCode,
    body: String,
    json: bool,
    etag: String,
}

impl Value {
    fn new(status: StatusCode, body: String, json: bool) -> Self {
        let digest = Sha256::new()
            .chain_update(status.as_str())
            .chain_update(b"\0")
            .chain_update(body.as_bytes())
            .finalize();
        let etag = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Value {
            status,
            body,
            json,
            etag,
        }
    }

    fn text(body: impl Into<String>) -> Self {
        Self::new(StatusCode::OK, body.into(), false)
    }
}

/// The watch channel of every key.
pub(super) struct Channels {
    keys: BTreeMap<&'static str, watch::Sender<Value>>,
}

impl Channels {
    pub(super) fn new(cfg: &EmulatorConfig) -> Self {
        let empty = Model::default();
        let keys = KEYS
            .iter()
            .map(|&key| (key, watch::Sender::new(render(cfg, &empty, key))))
            .collect();
        Channels { keys }
    }

    /// Recompute the changing keys; receivers wake only when a value really changed.
    pub(super) fn publish(&self, cfg: &EmulatorConfig, model: &Model) {
        for key in &KEYS[..CHANGING] {
            let Some(tx) = self.keys.get(key) else {
                continue;
            };
            let value = render(cfg, model, key);
            tx.send_if_modified(|current| {
                if *current == value {
                    false
                } else {
                    *current = value;
                    true
                }
            });
        }
    }
}

fn render(cfg: &EmulatorConfig, model: &Model, key: &str) -> Value {
    let maintenance = model.latest(NoticeKind::Maintenance);
    match key {
        "instance/preempted" => Value::text(if model.latest(NoticeKind::Interruption).is_some() {
            "TRUE"
        } else {
            "FALSE"
        }),
        "instance/maintenance-event" => {
            Value::text(maintenance.map(|e| e.code.as_str()).unwrap_or("NONE"))
        }
        "instance/upcoming-maintenance" => match maintenance.filter(|e| !e.window_hidden) {
            Some(e) => Value::new(StatusCode::OK, upcoming_json(e), true),
            None => match cfg.gce_no_maintenance {
                GceNoMaintenance::Empty => Value::new(StatusCode::OK, "{}".to_owned(), true),
                GceNoMaintenance::NotFound => {
                    Value::new(StatusCode::NOT_FOUND, String::new(), false)
                }
                GceNoMaintenance::NoNotifications => Value::new(
                    StatusCode::OK,
                    json!({"error": "no notifications have been received yet, try again later"})
                        .to_string(),
                    true,
                ),
            },
        },
        "instance/name" => Value::text(cfg.vm_name.as_str()),
        "instance/id" => Value::text(cfg.instance_id.as_str()),
        "instance/zone" => Value::text(format!("projects/{PROJECT_NUMBER}/zones/{}", cfg.zone)),
        "instance/hostname" => Value::text(format!(
            "{}.{}.c.{PROJECT_ID}.internal",
            cfg.vm_name, cfg.zone
        )),
        "project/project-id" => Value::text(PROJECT_ID),
        "project/numeric-project-id" => Value::text(PROJECT_NUMBER),
        _ => Value::new(StatusCode::NOT_FOUND, String::new(), false),
    }
}

fn upcoming_json(e: &Event) -> String {
    let start = wire::rfc3339(e.start);
    let mut doc = json!({
        "can_reschedule": "false",
        "latest_window_start_time": start,
        "maintenance_status": "PENDING",
        "type": "SCHEDULED",
        "window_end_time": e.end.map(wire::rfc3339),
        "window_start_time": start,
    });
    if !e.reasons.is_empty() {
        doc["maintenance_reasons"] = json!(e.reasons);
    }
    doc.to_string()
}

pub(super) fn build(
    _cfg: &EmulatorConfig,
    notice: &EmulatedNotice,
    now: Timestamp,
) -> Result<Event, Error> {
    let mut event = Event {
        reasons: notice.reasons.clone(),
        ..Event::scheduled(notice, now)
    };
    match notice.kind {
        // `preempted` flips to TRUE now; the server carries no deadline (the client adds its
        // own 30 s or 120 s), so `in` does not apply.
        NoticeKind::Interruption => {
            event.id = notice.id_or_fresh("gce-preemption", 12);
            event.code = "TRUE".to_owned();
        }
        NoticeKind::Rebalance => {
            return Err(Error::UnsupportedNotice {
                cloud: Cloud::Gce,
                kind: NoticeKind::Rebalance,
            })
        }
        NoticeKind::Maintenance => {
            let code = notice
                .code
                .as_deref()
                .unwrap_or("TERMINATE_ON_HOST_MAINTENANCE");
            check_code(
                Cloud::Gce,
                "code",
                code,
                MAINTENANCE_VALUES,
                "TERMINATE_ON_HOST_MAINTENANCE, MIGRATE_ON_HOST_MAINTENANCE, NONE",
            )?;
            event.code = code.to_owned();
            event.id = notice.id_or_fresh("gce-maintenance", 12);
            let (start, end) = notice.window(now, MAINTENANCE_NOTICE, MAINTENANCE_WINDOW)?;
            (event.start, event.end) = (start, Some(end));
            event.window_hidden = notice.window_after.is_some();
        }
    }
    Ok(event)
}

fn forbidden(path: &str, why: &str) -> Response<Body> {
    wire::response(
        StatusCode::FORBIDDEN,
        "text/html; charset=UTF-8",
        format!(
            "<!DOCTYPE html>\n<html lang=en><title>Error 403 (Forbidden)!!1</title>\
             <p><b>403.</b> That's an error.<p>Your client does not have permission to get URL \
             <code>{path}</code> from this server. {why}\n"
        ),
    )
}

fn bad_request(why: &str) -> Response<Body> {
    wire::response(
        StatusCode::BAD_REQUEST,
        "text/html; charset=UTF-8",
        format!(
            "<!DOCTYPE html>\n<html lang=en><title>Error 400 (Bad Request)!!1</title><p>{why}\n"
        ),
    )
}

fn with_flavor(mut resp: Response<Body>) -> Response<Body> {
    wire::set_header(&mut resp, "metadata-flavor", "Google");
    wire::set_header(&mut resp, "server", "Metadata Server for VM");
    resp
}

pub(super) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    if req.headers().contains_key("x-forwarded-for") {
        return forbidden(&path, "Request contains X-Forwarded-For header.");
    }
    let flavor_ok = req
        .headers()
        .get("metadata-flavor")
        .is_some_and(|v| v.as_bytes() == b"Google");
    if !flavor_ok {
        return forbidden(&path, "Missing Metadata-Flavor:Google header.");
    }
    if req.method() != Method::GET {
        return with_flavor(wire::html_error(StatusCode::METHOD_NOT_ALLOWED));
    }
    let Some(key) = path.strip_prefix(PREFIX) else {
        return with_flavor(wire::html_error(StatusCode::NOT_FOUND));
    };
    if let Some(listing) = directory(key) {
        return with_flavor(wire::response(StatusCode::OK, "application/text", listing));
    }
    let Some(tx) = shared.gce.keys.get(key) else {
        return with_flavor(wire::html_error(StatusCode::NOT_FOUND));
    };
    let query = match server::query(&req) {
        Ok(q) => q,
        Err(e) => return with_flavor(bad_request(&e)),
    };
    let wait = match server::param(&query, "wait_for_change") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return with_flavor(bad_request(&format!(
                "invalid wait_for_change value {other:?}"
            )))
        }
    };
    let timeout = match server::param(&query, "timeout_sec").map(str::parse::<u64>) {
        None => None,
        Some(Ok(secs)) => Some(Duration::from_secs(secs)),
        Some(Err(_)) => {
            return with_flavor(bad_request("timeout_sec must be a whole number of seconds"))
        }
    };
    let alt_json = match server::param(&query, "alt") {
        None | Some("text") => false,
        Some("json") => true,
        Some(other) => return with_flavor(bad_request(&format!("invalid alt value {other:?}"))),
    };
    let value = if wait {
        hang(tx, server::param(&query, "last_etag"), timeout).await
    } else {
        tx.borrow().clone()
    };
    with_flavor(respond(value, alt_json))
}

/// Hold until the value's ETag differs from `last_etag` (or, without one, until the next change),
/// at most `timeout`; then answer whatever is current.
async fn hang(
    tx: &watch::Sender<Value>,
    last_etag: Option<&str>,
    timeout: Option<Duration>,
) -> Value {
    let mut rx = tx.subscribe();
    {
        let changed = async {
            match last_etag {
                Some(etag) => {
                    // An error means the sender is gone (shutdown); answer what we have.
                    let _ = rx.wait_for(|v| v.etag != etag).await;
                }
                None => {
                    let _ = rx.changed().await;
                }
            }
        };
        match timeout {
            Some(t) => {
                let _ = tokio::time::timeout(t, changed).await;
            }
            None => changed.await,
        }
    }
    let current = rx.borrow().clone();
    current
}

fn respond(value: Value, alt_json: bool) -> Response<Body> {
    if value.status != StatusCode::OK {
        return wire::html_error(value.status);
    }
    let (content_type, body) = if value.json {
        ("application/json", value.body)
    } else if alt_json {
        (
            "application/json",
            serde_json::Value::String(value.body).to_string(),
        )
    } else {
        ("application/text", value.body)
    };
    let mut resp = wire::response(StatusCode::OK, content_type, body);
    wire::set_header(&mut resp, "etag", &value.etag);
    resp
}

/// Directory listings (entries one per line, sub-directories ending in `/`).
fn directory(key: &str) -> Option<String> {
    let dir = match key {
        "" => "",
        "instance/" | "instance" => "instance/",
        "project/" | "project" => "project/",
        _ => return None,
    };
    if dir.is_empty() {
        return Some("instance/\nproject/\n".to_owned());
    }
    let mut entries: Vec<&str> = KEYS.iter().filter_map(|k| k.strip_prefix(dir)).collect();
    entries.sort_unstable();
    Some(entries.iter().map(|e| format!("{e}\n")).collect())
}
