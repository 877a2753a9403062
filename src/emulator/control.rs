//! The control surface, `/spotguard/*`: raise and clear notices, inject faults, read state.
//! Faults never apply here (see `server::dispatch`).

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::json;

use super::fault::{Fault, FaultKind, Origin};
use super::model::{EmulatedNotice, Status};
use super::server::{self, Shared};
use super::wire::{self, Body};
use super::Error;

pub(super) const PREFIX: &str = "/spotguard/";
const NOTICE: &str = "/spotguard/notice";
const FAULT: &str = "/spotguard/fault";
const STATE: &str = "/spotguard/state";
const MAX_BODY: usize = 64 * 1024;

pub(super) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    match (method, path.as_str()) {
        (Method::POST, NOTICE) => match body_json(req).await {
            Ok(v) => reply(notice(shared, v)),
            Err(e) => reply(Err(e)),
        },
        (Method::POST, FAULT) => match body_json(req).await.and_then(Fault::from_json) {
            Ok(fault) => {
                let down = fault.kind == FaultKind::Down;
                let mut resp = reply(
                    shared
                        .apply_fault(fault, Origin::Http)
                        .map(|()| json!({ "faults": shared.state_json()["faults"] })),
                );
                if down {
                    // The listener closes right after this answer; say so.
                    wire::set_header(&mut resp, "connection", "close");
                }
                resp
            }
            Err(e) => reply(Err(e)),
        },
        (Method::GET, STATE) => wire::json(StatusCode::OK, &shared.state_json()),
        (_, NOTICE | FAULT | STATE) => wire::json(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({ "error": format!("method not allowed on {path}") }),
        ),
        _ => wire::json(
            StatusCode::NOT_FOUND,
            &json!({ "error": format!("no control endpoint {path}; see docs/emulator.md") }),
        ),
    }
}

fn reply(result: Result<serde_json::Value, Error>) -> Response<Body> {
    match result {
        Ok(v) => wire::json(StatusCode::OK, &v),
        Err(e) => wire::json(StatusCode::BAD_REQUEST, &json!({ "error": e.to_string() })),
    }
}

async fn body_json(req: Request<Incoming>) -> Result<serde_json::Value, Error> {
    let body = server::read_body(req, MAX_BODY)
        .await
        .map_err(|reason| Error::InvalidRequest { reason })?;
    serde_json::from_slice(&body).map_err(|e| Error::InvalidRequest {
        reason: format!("body is not JSON: {e}"),
    })
}

/// `{"kind": "interruption" | "rebalance" | "maintenance", …}` raises; `{"kind": "cancel",
/// "event_id"?, "state"?: "canceled" | "completed"}` ends events; `{"kind": "clear"}` removes all.
fn notice(shared: &Arc<Shared>, value: serde_json::Value) -> Result<serde_json::Value, Error> {
    let kind = value
        .get("kind")
        .and_then(|k| k.as_str())
        .ok_or_else(|| Error::InvalidRequest {
            reason: "missing \"kind\" (interruption, rebalance, maintenance, cancel, clear)"
                .to_owned(),
        })?;
    const KINDS: &str = "interruption, rebalance, maintenance, cancel, clear";
    match kind {
        "interruption" | "rebalance" | "maintenance" | "clear" | "cancel" => {}
        other => {
            return Err(Error::InvalidRequest {
                reason: format!("unknown kind {other:?}: expected one of {KINDS}"),
            })
        }
    }
    match kind {
        "clear" => {
            only_keys(&value, &["kind"])?;
            shared.clear();
            Ok(json!({ "cleared": true }))
        }
        "cancel" => {
            only_keys(&value, &["kind", "event_id", "state"])?;
            let id = value.get("event_id").and_then(|v| v.as_str());
            let how = match value.get("state").and_then(|v| v.as_str()) {
                None | Some("canceled") => Status::Canceled,
                Some("completed") => Status::Completed,
                Some(other) => {
                    return Err(Error::InvalidRequest {
                        reason: format!("state {other:?}: expected canceled or completed"),
                    })
                }
            };
            let ended = shared.end_events(id, how)?;
            Ok(json!({ "ended": ended }))
        }
        _ => {
            let notice: EmulatedNotice =
                serde_json::from_value(value).map_err(|e| Error::InvalidRequest {
                    reason: e.to_string(),
                })?;
            let raised = shared.raise(notice)?;
            Ok(json!({ "id": raised.id, "visible_at": raised.visible_at.to_string() }))
        }
    }
}

fn only_keys(value: &serde_json::Value, keys: &[&str]) -> Result<(), Error> {
    let unknown = value
        .as_object()
        .and_then(|o| o.keys().find(|k| !keys.contains(&k.as_str())));
    match unknown {
        Some(k) => Err(Error::InvalidRequest {
            reason: format!("unknown field {k:?} (expected one of {keys:?})"),
        }),
        None => Ok(()),
    }
}
