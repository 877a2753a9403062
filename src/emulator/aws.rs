//! EC2 instance metadata service, IMDSv2 (token) protocol.
//!
//! From AWS's documentation: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
//! (1–21600) returns a session token; a PUT carrying `X-Forwarded-For` is refused (403); a missing
//! or invalid TTL is a 400. GETs carry `X-aws-ec2-metadata-token`; a missing token is a 401 when
//! IMDSv2 is required, an invalid or expired one is always a 401. Everything is `text/plain`,
//! JSON documents included. `events/maintenance/scheduled` lists active events and
//! `events/maintenance/history` the completed and canceled ones (Description prefixed
//! `[Canceled]`/`[Completed]`).

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use jiff::Timestamp;
use serde_json::json;

use super::model::{self, check_code, EmulatedNotice, Event, Model, NoticeKind, Status};
use super::server::Shared;
use super::wire::{self, Body};
use super::{Cloud, EmulatorConfig, Error};

pub(super) const TOKEN_PATH: &str = "/latest/api/token";
const META: &str = "/latest/meta-data";
const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";
const MAX_TTL: u64 = 21_600;

/// Spot interruption notices come two minutes ahead.
const INTERRUPTION_NOTICE: Duration = Duration::from_secs(120);
const MAINTENANCE_NOTICE: Duration = Duration::from_secs(3600);
const MAINTENANCE_WINDOW: Duration = Duration::from_secs(2 * 3600);

const CODES: &[&str] = &[
    "system-reboot",
    "instance-reboot",
    "instance-stop",
    "instance-retirement",
    "system-maintenance",
];

pub(super) fn build(
    cfg: &EmulatorConfig,
    notice: &EmulatedNotice,
    now: Timestamp,
) -> Result<Event, Error> {
    let mut event = Event {
        target: cfg.vm_name.clone(),
        ..Event::scheduled(notice, now)
    };
    match notice.kind {
        NoticeKind::Interruption => {
            event.id = notice.id_or_fresh("spot-itn", 12);
            event.start = notice.deadline(now, INTERRUPTION_NOTICE)?;
            event.code = event.action.as_str().to_owned();
        }
        NoticeKind::Rebalance => {
            event.id = notice.id_or_fresh("rebalance", 12);
            event.code = "rebalance".to_owned();
        }
        NoticeKind::Maintenance => {
            let code = notice.code.as_deref().unwrap_or("system-reboot");
            check_code(Cloud::Aws, "code", code, CODES, "system-reboot, instance-reboot, instance-stop, instance-retirement, system-maintenance")?;
            event.code = code.to_owned();
            event.id = notice.id_or_fresh("instance-event", 17);
            let (start, end) = notice.window(now, MAINTENANCE_NOTICE, MAINTENANCE_WINDOW)?;
            (event.start, event.end) = (start, Some(end));
            if event.description.is_empty() {
                event.description = default_description(code).to_owned();
            }
            event.raw_not_before = notice.not_before_raw.clone();
        }
    }
    Ok(event)
}

fn default_description(code: &str) -> &'static str {
    match code {
        "instance-stop" => "scheduled stop",
        "instance-retirement" => "scheduled retirement",
        "system-maintenance" => "scheduled maintenance",
        _ => "scheduled reboot",
    }
}

/// EC2 keeps ended events with a `[Canceled]`/`[Completed]` description prefix.
pub(super) fn mark_ended(event: &mut Event, how: Status) {
    let prefix = match how {
        Status::Canceled => "[Canceled] ",
        Status::Completed => "[Completed] ",
        Status::Scheduled | Status::Started => return,
    };
    event.description = format!("{prefix}{}", event.description);
}

pub(super) async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path();
    if path == TOKEN_PATH {
        return token(shared, &req);
    }
    if req.method() != Method::GET {
        return method_not_allowed("GET");
    }
    let model = shared.lock();
    if !authorized(&shared.cfg, &model, &req) {
        return wire::html_error(StatusCode::UNAUTHORIZED);
    }
    match render(&shared.cfg, &model, path) {
        Some(body) => wire::text(StatusCode::OK, body),
        None => wire::html_error(StatusCode::NOT_FOUND),
    }
}

fn method_not_allowed(allow: &'static str) -> Response<Body> {
    let mut resp = wire::html_error(StatusCode::METHOD_NOT_ALLOWED);
    wire::set_header(&mut resp, "allow", allow);
    resp
}

fn token(shared: &Shared, req: &Request<Incoming>) -> Response<Body> {
    if req.method() != Method::PUT {
        return method_not_allowed("PUT");
    }
    if req.headers().contains_key("x-forwarded-for") {
        return wire::html_error(StatusCode::FORBIDDEN);
    }
    let ttl = req
        .headers()
        .get(TTL_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|t| (1..=MAX_TTL).contains(t));
    let Some(ttl) = ttl else {
        return wire::html_error(StatusCode::BAD_REQUEST);
    };
    let token = format!("AQAEA{}==", random_alnum(50));
    let now = tokio::time::Instant::now();
    {
        let mut model = shared.lock();
        model.tokens.retain(|_, expiry| now < *expiry);
        model
            .tokens
            .insert(token.clone(), now + Duration::from_secs(ttl));
    }
    let mut resp = wire::text(StatusCode::OK, token);
    wire::set_header(&mut resp, TTL_HEADER, &ttl.to_string());
    resp
}

/// IMDSv2: a present token must be known and unexpired; an absent one passes only with IMDSv1.
fn authorized(cfg: &EmulatorConfig, model: &Model, req: &Request<Incoming>) -> bool {
    match req.headers().get(TOKEN_HEADER) {
        Some(value) => {
            let now = tokio::time::Instant::now();
            value
                .to_str()
                .ok()
                .and_then(|t| model.tokens.get(t.trim()))
                .is_some_and(|expiry| now < *expiry)
        }
        None => cfg.allow_imds_v1,
    }
}

/// The body for `path`, or `None` for a 404. Directory paths answer with or without the trailing
/// slash, one entry per line, sub-directories ending in `/`.
fn render(cfg: &EmulatorConfig, model: &Model, path: &str) -> Option<String> {
    let rest = path.strip_prefix(META)?;
    let rest = rest.trim_end_matches('/');
    let interruption = model.latest(NoticeKind::Interruption);
    let rebalance = model.latest(NoticeKind::Rebalance);
    // As ec2-metadata-mock: the times of the request, not of the notice.
    let now = cfg.ec2_restamp_times.then(jiff::Timestamp::now);
    let action_time = |e: &model::Event| match now {
        Some(now) => model::add(now, RESTAMPED_ACTION_LEAD).unwrap_or(e.start),
        None => e.start,
    };
    let notice_time = |e: &model::Event| now.unwrap_or(e.start);
    match rest {
        "" => {
            let mut entries = vec!["events/", "instance-id", "instance-type", "placement/"];
            if interruption.is_some() {
                entries.push("spot/");
            }
            Some(entries.join("\n"))
        }
        "/instance-id" => Some(cfg.instance_id.clone()),
        "/instance-type" => Some(cfg.instance_type.clone()),
        "/placement" => Some("availability-zone\nregion".to_owned()),
        "/placement/availability-zone" => Some(cfg.zone.clone()),
        "/placement/region" => Some(
            cfg.zone
                .trim_end_matches(|c: char| c.is_ascii_alphabetic())
                .to_owned(),
        ),
        "/spot" => interruption.map(|e| {
            if e.action == model::Ec2Action::Terminate {
                "instance-action\ntermination-time".to_owned()
            } else {
                "instance-action".to_owned()
            }
        }),
        "/spot/instance-action" => interruption.map(|e| {
            json!({"action": e.action.as_str(), "time": wire::rfc3339(action_time(e))}).to_string()
        }),
        "/spot/termination-time" => interruption
            .filter(|e| e.action == model::Ec2Action::Terminate)
            .map(|e| wire::rfc3339(action_time(e))),
        "/events" => Some(if rebalance.is_some() {
            "maintenance/\nrecommendations/".to_owned()
        } else {
            "maintenance/".to_owned()
        }),
        "/events/maintenance" => Some("history\nscheduled".to_owned()),
        "/events/maintenance/scheduled" => Some(events_json(model, |s| {
            s.is_live() || cfg.ec2_ended_events_in_scheduled
        })),
        "/events/maintenance/history" => Some(events_json(model, |s| !s.is_live())),
        "/events/recommendations" => rebalance.map(|_| "rebalance".to_owned()),
        "/events/recommendations/rebalance" => {
            rebalance.map(|e| json!({"noticeTime": wire::rfc3339(notice_time(e))}).to_string())
        }
        _ => None,
    }
}

/// With `ec2_restamp_times`, a spot instance-action's `time` is this long after the request.
const RESTAMPED_ACTION_LEAD: std::time::Duration = std::time::Duration::from_secs(120);

fn events_json(model: &Model, include: impl Fn(Status) -> bool) -> String {
    let events: Vec<_> = model
        .events
        .iter()
        .filter(|e| e.kind == NoticeKind::Maintenance && include(e.status))
        .map(|e| {
            json!({
                "NotBefore": e
                    .raw_not_before
                    .clone()
                    .unwrap_or_else(|| wire::ec2_event_time(e.start)),
                "NotAfter": e.end.map(wire::ec2_event_time),
                "Code": e.code,
                "Description": e.description,
                "EventId": e.id,
                "State": match e.status {
                    Status::Scheduled | Status::Started => "active",
                    Status::Canceled => "canceled",
                    Status::Completed => "completed",
                },
            })
        })
        .collect();
    serde_json::Value::Array(events).to_string()
}

fn random_alnum(n: usize) -> String {
    (0..n).map(|_| fastrand::alphanumeric()).collect()
}
