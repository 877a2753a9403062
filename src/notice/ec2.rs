//! EC2 instance metadata (IMDS): spot instance-action, rebalance recommendations and scheduled
//! maintenance events.
//!
//! IMDSv2 by default: a session token from `PUT /latest/api/token` is cached and refreshed before
//! it expires; a 401 re-tokens once and retries. IMDSv1 (no token) is used only when
//! [`Ec2Config::imds_v1_fallback`] is set and the token request fails. The three paths are
//! queried concurrently on every poll; one failing does not hide the others' notices (see
//! [`super::monitor`] for how partial failures are counted).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use jiff::Timestamp;
use reqwest::{StatusCode, Url};
use serde::Deserialize;
use tokio::time::Instant;

use super::detect::Dmi;
use super::http::{
    constant_url, endpoint_url, metadata_client, parse_error, read_body, request_error,
};
use super::monitor::ErrorReporter;
use super::{
    content_id, Cloud, CloudFacts, Error, MaintenanceKind, Notice, NoticeKind, NoticeSource, Probe,
    Settings, SourceMetrics,
};
use crate::metrics::Metrics;

/// What the agent knows about EC2 ([`Cloud::Aws`]).
pub const FACTS: CloudFacts = CloudFacts {
    name: "aws",
    // About 120 s of notice: 25 s of it kept for evictions.
    drain_reserve: Duration::from_secs(25),
    interruption_notice: INTERRUPTION_NOTICE,
    // The instance-action `time` is a clock reading: clamped into the two minutes after first
    // sight.
    max_interruption_notice: Some(INTERRUPTION_NOTICE),
    drill_notice: "EC2 spot instance-action: 2 minutes' notice",
    drill_detection: "by the agent polling the emulated EC2 metadata service (1s)",
    dmi: |d: &Dmi| d.sys_vendor == "Amazon EC2" || d.bios_vendor == "Amazon EC2",
    probe: Probe {
        method: reqwest::Method::PUT,
        path: TOKEN_PATH,
        header: ("X-aws-ec2-metadata-token-ttl-seconds", "60"),
    },
    maintenance_of_detail: |_| MaintenanceKind::Other,
    build,
};

/// EC2 gives at most two minutes between the instance-action notice and the action.
pub const INTERRUPTION_NOTICE: Duration = Duration::from_secs(120);

fn build(
    s: &Settings,
    metrics: &Arc<Metrics>,
    _own: &SourceMetrics,
) -> Result<Arc<dyn NoticeSource>, Error> {
    let config = Ec2Config::new(s.endpoint.clone(), s.poll_interval, s.imds_v1_fallback);
    Ok(Arc::new(Ec2Imds::new(config, metrics.clone())?))
}

const TOKEN_PATH: &str = "/latest/api/token";
const INSTANCE_ACTION_PATH: &str = "/latest/meta-data/spot/instance-action";
const REBALANCE_PATH: &str = "/latest/meta-data/events/recommendations/rebalance";
const SCHEDULED_PATH: &str = "/latest/meta-data/events/maintenance/scheduled";
const TTL_HEADER: &str = "x-aws-ec2-metadata-token-ttl-seconds";
const TOKEN_HEADER: &str = "x-aws-ec2-metadata-token";

/// Scheduled-event codes that reboot the instance in place (EC2 `instance-reboot`,
/// `system-reboot`); `system-maintenance`, `instance-stop` and `instance-retirement` do not.
const RESTART_CODES: [&str; 2] = ["instance-reboot", "system-reboot"];

/// Settings of [`Ec2Imds`].
#[derive(Clone, Debug)]
pub struct Ec2Config {
    /// IMDS base URL (`http://169.254.169.254`, or `http://[fd00:ec2::254]` on IPv6-only
    /// instances, or a local emulator).
    pub endpoint: Url,
    /// Delay between polls (`--poll-interval`).
    pub poll_interval: Duration,
    /// Allow IMDSv1 when the token request fails (`--imds-v1-fallback`).
    pub imds_v1_fallback: bool,
    /// Bound on each request (token or metadata), connection included.
    pub request_timeout: Duration,
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
    /// Requested token lifetime (IMDS allows up to 6 h).
    pub token_ttl: Duration,
}

impl Ec2Config {
    pub const DEFAULT_ENDPOINT: &'static str = "http://169.254.169.254";

    /// `endpoint` `None` means [`Self::DEFAULT_ENDPOINT`]; timeouts 2 s (1 s to connect), token
    /// TTL 21600 s.
    pub fn new(endpoint: Option<Url>, poll_interval: Duration, imds_v1_fallback: bool) -> Self {
        Ec2Config {
            endpoint: endpoint.unwrap_or_else(|| constant_url(Self::DEFAULT_ENDPOINT)),
            poll_interval,
            imds_v1_fallback,
            request_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(1),
            token_ttl: Duration::from_secs(21600),
        }
    }
}

#[derive(Clone, Debug)]
struct Token {
    value: String,
    generation: u64,
    refresh_at: Instant,
    expires_at: Instant,
}

#[derive(Debug, Default)]
struct TokenCache {
    token: Option<Token>,
    generation: u64,
    /// With v1 fallback after a failed token request: use IMDSv1 without asking again until then.
    v1_until: Option<Instant>,
}

/// How long IMDSv1 is used after a failed token request before IMDSv2 is tried again (so a
/// v1-only IMDS costs one token request and one counted error per period, not per poll).
const V1_RETRY: Duration = Duration::from_secs(300);

/// Which token [`Ec2Imds::token`] is asked for.
#[derive(Clone, Copy, Debug)]
enum Want {
    /// Whatever is current: the cached token, IMDSv1 during a fallback period, else a new one.
    Current,
    /// A replacement for the credential a 401 rejected: token generation `Some(g)`, or `None`
    /// for an IMDSv1 request. A newer cached token is reused; otherwise a new one is requested.
    Replacing(Option<u64>),
}

#[derive(Clone, Debug)]
struct Urls {
    token: Url,
    instance_action: Url,
    rebalance: Url,
    scheduled: Url,
}

/// The EC2 notice source (name `aws`).
pub struct Ec2Imds {
    config: Ec2Config,
    client: reqwest::Client,
    urls: Urls,
    token: tokio::sync::Mutex<TokenCache>,
    reporter: ErrorReporter,
    /// Notice id → when it was first seen, for `observed_at` across re-polls.
    first_seen: Mutex<HashMap<String, Timestamp>>,
    /// Active scheduled events of the last successful read of `events/maintenance/scheduled`:
    /// AWS moves canceled and completed events to `events/maintenance/history`, so an event that
    /// vanishes from `scheduled` is reported as `Cancelled`.
    active_events: Mutex<Option<HashSet<String>>>,
    /// Scheduled events already named in a "skipped" warning: a bad event that stays in the
    /// schedule is counted on every poll but named in the log once.
    skipped_logged: Mutex<HashSet<String>>,
    /// The id under which `spot/instance-action` last served an interruption: when it answers
    /// 404 again, reported as `Cancelled` of that id (the responder's store takes it as a resume
    /// from hibernation only when it stays away for the resume hold: one 404 is no proof).
    served_interruption: Mutex<Option<String>>,
}

impl Ec2Imds {
    /// Build the client. Fails only on an endpoint that cannot be joined with the IMDS paths or a
    /// client that cannot be built.
    pub fn new(config: Ec2Config, metrics: Arc<Metrics>) -> Result<Self, Error> {
        let base = &config.endpoint;
        let urls = Urls {
            token: endpoint_url(base, TOKEN_PATH)?,
            instance_action: endpoint_url(base, INSTANCE_ACTION_PATH)?,
            rebalance: endpoint_url(base, REBALANCE_PATH)?,
            scheduled: endpoint_url(base, SCHEDULED_PATH)?,
        };
        let client = metadata_client(&config.endpoint, config.connect_timeout)
            .timeout(config.request_timeout)
            .build()
            .map_err(|e| request_error(base, e))?;
        Ok(Ec2Imds {
            config,
            client,
            urls,
            token: tokio::sync::Mutex::new(TokenCache::default()),
            reporter: ErrorReporter::new(Cloud::Aws.as_str(), metrics),
            first_seen: Mutex::new(HashMap::new()),
            active_events: Mutex::new(None),
            skipped_logged: Mutex::new(HashSet::new()),
            served_interruption: Mutex::new(None),
        })
    }

    /// A usable token, `None` for IMDSv1 (only with the fallback enabled).
    async fn token(&self, want: Want) -> Result<Option<Token>, Error> {
        let mut cache = self.token.lock().await;
        let now = Instant::now();
        let rejected = match want {
            Want::Current => None,
            Want::Replacing(generation) => Some(generation),
        };
        if let Some(t) = &cache.token {
            if rejected != Some(Some(t.generation)) && now < t.refresh_at {
                return Ok(Some(t.clone()));
            }
        }
        if matches!(want, Want::Current) && cache.v1_until.is_some_and(|until| now < until) {
            return Ok(None);
        }
        match self.fetch_token().await {
            Ok((value, ttl)) => {
                cache.generation += 1;
                cache.v1_until = None;
                let margin = (ttl / 10).min(Duration::from_secs(300));
                let token = Token {
                    value,
                    generation: cache.generation,
                    refresh_at: now + ttl.saturating_sub(margin),
                    expires_at: now + ttl,
                };
                cache.token = Some(token.clone());
                Ok(Some(token))
            }
            Err(err) => {
                // A refresh that fails while the old token is still valid keeps the old one.
                if let Some(t) = &cache.token {
                    if rejected != Some(Some(t.generation)) && now < t.expires_at {
                        self.reporter.report(&err);
                        return Ok(Some(t.clone()));
                    }
                }
                cache.token = None;
                if self.config.imds_v1_fallback {
                    self.reporter.report(&err);
                    cache.v1_until = Some(now + V1_RETRY);
                    tracing::info!(error = %err, retry_in_ms = V1_RETRY.as_millis() as u64, "IMDSv2 token unavailable; using IMDSv1 (--imds-v1-fallback)");
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    async fn fetch_token(&self) -> Result<(String, Duration), Error> {
        let url = &self.urls.token;
        let resp = self
            .client
            .put(url.clone())
            .header(
                TTL_HEADER,
                self.config.token_ttl.as_secs().max(1).to_string(),
            )
            .send()
            .await
            .map_err(|e| request_error(url, e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(Error::Token {
                url: url.to_string(),
                status: status.as_u16(),
            });
        }
        let ttl = resp
            .headers()
            .get(TTL_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs)
            .unwrap_or(self.config.token_ttl);
        let body = read_body(url, resp).await?;
        let value = body.trim();
        if value.is_empty() || value.contains(['\r', '\n']) {
            return Err(parse_error(
                url,
                "token response is empty or not a single line",
            ));
        }
        Ok((value.to_string(), ttl))
    }

    async fn send_get(&self, url: &Url, token: Option<&Token>) -> Result<reqwest::Response, Error> {
        let mut req = self.client.get(url.clone());
        if let Some(t) = token {
            req = req.header(TOKEN_HEADER, &t.value);
        }
        req.send().await.map_err(|e| request_error(url, e))
    }

    /// GET a metadata path: `Ok(None)` for 404 (nothing pending). A 401 re-tokens once.
    async fn get(&self, url: &Url, token: Option<&Token>) -> Result<Option<String>, Error> {
        let mut resp = self.send_get(url, token).await?;
        if resp.status() == StatusCode::UNAUTHORIZED {
            let fresh = self
                .token(Want::Replacing(token.map(|t| t.generation)))
                .await?;
            resp = self.send_get(url, fresh.as_ref()).await?;
        }
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => read_body(url, resp).await.map(Some),
            s => Err(Error::Status {
                url: url.to_string(),
                status: s.as_u16(),
            }),
        }
    }

    async fn instance_action(
        &self,
        token: Option<&Token>,
        now: Timestamp,
    ) -> Result<Vec<Notice>, Error> {
        let url = &self.urls.instance_action;
        let found = match self.get(url, token).await? {
            None => None,
            Some(body) => Some(parse_instance_action(url, &body, now)?),
        };
        let mut served = crate::sync::lock(&self.served_interruption);
        match found {
            Some(n) => {
                *served = Some(n.id.clone());
                Ok(vec![n])
            }
            None => Ok(served
                .take()
                .map(|id| vanished_interruption(&id, now))
                .into_iter()
                .collect()),
        }
    }

    async fn rebalance(&self, token: Option<&Token>, now: Timestamp) -> Result<Vec<Notice>, Error> {
        let url = &self.urls.rebalance;
        match self.get(url, token).await? {
            None => Ok(Vec::new()),
            Some(body) => parse_rebalance(url, &body, now).map(|n| vec![n]),
        }
    }

    async fn scheduled(&self, token: Option<&Token>, now: Timestamp) -> Result<Vec<Notice>, Error> {
        let url = &self.urls.scheduled;
        let (mut notices, skipped) = match self.get(url, token).await? {
            None => (Vec::new(), Vec::new()),
            Some(body) => parse_scheduled(url, &body, now)?,
        };
        // One bad event never hides the others: it is skipped, counted and logged; its id stays
        // "active" so that it is not mistaken for a cancelled one.
        for (id, e) in &skipped {
            self.reporter.report(e);
            let first = self
                .skipped_logged
                .lock()
                .map(|mut logged| logged.insert(id.clone()))
                .unwrap_or(true);
            if first {
                tracing::warn!(event_id = %id, error = %e, "scheduled event skipped (counted on every poll, logged once)");
            }
        }
        let active: HashSet<String> = notices
            .iter()
            .filter(|n| n.kind == NoticeKind::Maintenance)
            .map(|n| n.id.clone())
            .chain(skipped.into_iter().map(|(id, _)| id))
            .collect();
        let previous = match self.active_events.lock() {
            Ok(mut guard) => guard.replace(active.clone()),
            Err(_) => None,
        };
        for gone in previous.unwrap_or_default().difference(&active) {
            let already = notices
                .iter()
                .any(|n| n.kind == NoticeKind::Cancelled(gone.clone()));
            if !already {
                notices.push(vanished_event(gone, now));
            }
        }
        Ok(notices)
    }

    /// Give each notice the time its id was first seen; forget ids no longer visible (only after
    /// a poll in which every endpoint answered, so a failing endpoint does not reset its ids).
    fn stamp_observed(&self, notices: &mut [Notice], complete: bool) {
        let mut seen = crate::sync::lock(&self.first_seen);
        for n in notices.iter_mut() {
            n.observed_at = *seen.entry(n.id.clone()).or_insert(n.observed_at);
        }
        if complete {
            seen.retain(|id, _| notices.iter().any(|n| &n.id == id));
        }
    }
}

#[async_trait]
impl NoticeSource for Ec2Imds {
    fn name(&self) -> &'static str {
        Cloud::Aws.as_str()
    }

    fn poll_interval(&self) -> Duration {
        self.config.poll_interval
    }

    /// `Err` only when the token cannot be had (and v1 fallback is off) or all three paths
    /// failed; otherwise the notices found, with each failed path counted and logged.
    async fn poll(&self) -> Result<Vec<Notice>, Error> {
        let token = self.token(Want::Current).await?;
        let token = token.as_ref();
        let now = Timestamp::now();
        let (action, rebalance, scheduled) = tokio::join!(
            self.instance_action(token, now),
            self.rebalance(token, now),
            self.scheduled(token, now),
        );
        let mut notices = Vec::new();
        let mut errors = Vec::new();
        for result in [action, rebalance, scheduled] {
            match result {
                Ok(found) => notices.extend(found),
                Err(e) => errors.push(e),
            }
        }
        if errors.len() == 3 {
            // Every path failed: the first (instance-action) is the poll's error, counted by the
            // monitor; the others are counted here.
            let first = errors.remove(0);
            for e in &errors {
                self.reporter.report(e);
            }
            return Err(first);
        }
        let complete = errors.is_empty();
        for e in &errors {
            self.reporter.report(e);
        }
        if complete {
            self.reporter.all_ok();
        }
        self.stamp_observed(&mut notices, complete);
        Ok(notices)
    }
}

#[derive(Deserialize)]
struct InstanceAction {
    action: String,
    time: String,
}

fn parse_rfc3339(url: &Url, field: &str, value: &str) -> Result<Timestamp, Error> {
    value.trim().parse::<Timestamp>().map_err(|e| {
        parse_error(
            url,
            format!("{field} {value:?} is not an RFC 3339 time: {e}"),
        )
    })
}

fn parse_instance_action(url: &Url, body: &str, now: Timestamp) -> Result<Notice, Error> {
    let ia: InstanceAction = serde_json::from_str(body)
        .map_err(|e| parse_error(url, format!("instance-action JSON: {e}")))?;
    let time = parse_rfc3339(url, "time", &ia.time)?;
    // stop and hibernate end this instance's work just like terminate; hibernation starts
    // without the two-minute lead, so its deadline is now.
    let deadline = if ia.action.eq_ignore_ascii_case("hibernate") {
        now
    } else {
        time
    };
    Ok(Notice {
        id: content_id(
            Cloud::Aws,
            "interruption",
            &["instance-action", &ia.action, &ia.time],
        ),
        kind: NoticeKind::Interruption,
        source: Cloud::Aws,
        deadline: Some(deadline),
        not_before: Some(deadline),
        detail: format!("spot instance-action {} at {}", ia.action, ia.time),
        restart: false,
        published_at: None,
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    })
}

#[derive(Deserialize)]
struct Rebalance {
    #[serde(rename = "noticeTime")]
    notice_time: String,
}

fn parse_rebalance(url: &Url, body: &str, now: Timestamp) -> Result<Notice, Error> {
    let r: Rebalance =
        serde_json::from_str(body).map_err(|e| parse_error(url, format!("rebalance JSON: {e}")))?;
    let published = parse_rfc3339(url, "noticeTime", &r.notice_time)?;
    Ok(Notice {
        id: content_id(Cloud::Aws, "rebalance", &[&r.notice_time]),
        kind: NoticeKind::Rebalance,
        source: Cloud::Aws,
        deadline: None,
        not_before: None,
        detail: format!("rebalance recommendation at {}", r.notice_time),
        restart: false,
        published_at: Some(published),
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ScheduledEvent {
    #[serde(default)]
    code: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    event_id: String,
    #[serde(default)]
    not_before: String,
    #[serde(default)]
    not_after: String,
    #[serde(default)]
    state: String,
}

/// EC2's scheduled-event time format, `21 Jan 2019 09:00:43 GMT` (RFC 2822 without the
/// weekday; a weekday is accepted too).
pub(crate) fn parse_rfc2822(url: &Url, field: &str, value: &str) -> Result<Timestamp, Error> {
    jiff::fmt::rfc2822::DateTimeParser::new()
        .parse_timestamp(value.trim())
        .map_err(|e| {
            parse_error(
                url,
                format!("{field} {value:?} is not an RFC 2822 time: {e}"),
            )
        })
}

/// A scheduled event that left `events/maintenance/scheduled` (moved to history: canceled or
/// completed).
fn vanished_event(event_id: &str, now: Timestamp) -> Notice {
    Notice {
        id: content_id(Cloud::Aws, "cancelled", &[event_id]),
        kind: NoticeKind::Cancelled(event_id.to_string()),
        source: Cloud::Aws,
        deadline: None,
        not_before: None,
        detail: format!("scheduled event {event_id} left the schedule (canceled or completed)"),
        restart: false,
        published_at: None,
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    }
}

/// The spot interruption `id` no longer served by `spot/instance-action` (404 again).
fn vanished_interruption(id: &str, now: Timestamp) -> Notice {
    Notice {
        id: content_id(Cloud::Aws, "cancelled", &[id]),
        kind: NoticeKind::Cancelled(id.to_string()),
        source: Cloud::Aws,
        deadline: None,
        not_before: None,
        detail: format!("spot instance-action {id} is no longer served"),
        restart: false,
        published_at: None,
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    }
}

/// Scheduled events skipped because a field could not be parsed: (event id, error).
type Skipped = Vec<(String, Error)>;

/// The notices of `events/maintenance/scheduled`, and the events skipped. `Err` only when the
/// document itself is not a JSON array of events.
fn parse_scheduled(url: &Url, body: &str, now: Timestamp) -> Result<(Vec<Notice>, Skipped), Error> {
    if body.trim().is_empty() {
        return Ok((Vec::new(), Vec::new()));
    }
    let events: Vec<ScheduledEvent> = serde_json::from_str(body)
        .map_err(|e| parse_error(url, format!("scheduled events JSON: {e}")))?;
    let mut notices = Vec::with_capacity(events.len());
    let mut skipped = Vec::new();
    for ev in events {
        let event_id = if ev.event_id.is_empty() {
            content_id(Cloud::Aws, "maintenance", &[&ev.code, &ev.not_before])
        } else {
            ev.event_id.clone()
        };
        let state = ev.state.to_ascii_lowercase();
        if state == "canceled" || state == "cancelled" || state == "completed" {
            notices.push(Notice {
                id: content_id(Cloud::Aws, "cancelled", &[&event_id]),
                kind: NoticeKind::Cancelled(event_id),
                source: Cloud::Aws,
                deadline: None,
                not_before: None,
                detail: format!("scheduled event {} {}", ev.code, state),
                restart: false,
                published_at: None,
                maintenance: MaintenanceKind::Other,
                observed_at: now,
                cloud_event_id: (!ev.event_id.is_empty()).then(|| ev.event_id.clone()),
            });
            continue;
        }
        let not_before = match parse_rfc2822(url, "NotBefore", &ev.not_before) {
            Ok(t) => t,
            Err(e) => {
                skipped.push((event_id, e));
                continue;
            }
        };
        notices.push(Notice {
            id: event_id,
            kind: NoticeKind::Maintenance,
            source: Cloud::Aws,
            deadline: Some(not_before),
            not_before: Some(not_before),
            detail: format!(
                "{}: {} (window {} – {})",
                ev.code, ev.description, ev.not_before, ev.not_after
            ),
            restart: RESTART_CODES.contains(&ev.code.as_str()),
            published_at: None,
            maintenance: MaintenanceKind::Other,
            observed_at: now,
            cloud_event_id: (!ev.event_id.is_empty()).then(|| ev.event_id.clone()),
        });
    }
    Ok((notices, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url() -> Url {
        constant_url(Ec2Config::DEFAULT_ENDPOINT)
    }

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    #[test]
    fn default_and_ipv6_endpoints_join_paths() {
        let cfg = Ec2Config::new(None, Duration::from_secs(1), false);
        assert_eq!(
            endpoint_url(&cfg.endpoint, TOKEN_PATH).unwrap().as_str(),
            "http://169.254.169.254/latest/api/token"
        );
        let v6 = Url::parse("http://[fd00:ec2::254]").unwrap();
        assert_eq!(
            endpoint_url(&v6, INSTANCE_ACTION_PATH).unwrap().as_str(),
            "http://[fd00:ec2::254]/latest/meta-data/spot/instance-action"
        );
        let prefixed = Url::parse("http://127.0.0.1:1338/aws/").unwrap();
        assert_eq!(
            endpoint_url(&prefixed, SCHEDULED_PATH).unwrap().as_str(),
            "http://127.0.0.1:1338/aws/latest/meta-data/events/maintenance/scheduled"
        );
    }

    #[test]
    fn instance_action_terminate_stop_hibernate() {
        let now = ts("2024-05-01T10:00:00Z");
        let t = parse_instance_action(
            &url(),
            r#"{"action":"terminate","time":"2024-05-01T10:02:00Z"}"#,
            now,
        )
        .unwrap();
        assert_eq!(t.kind, NoticeKind::Interruption);
        assert_eq!(t.deadline, Some(ts("2024-05-01T10:02:00Z")));
        let s = parse_instance_action(
            &url(),
            r#"{"action":"stop","time":"2024-05-01T10:02:00Z"}"#,
            now,
        )
        .unwrap();
        assert_eq!(s.kind, NoticeKind::Interruption);
        assert_eq!(s.deadline, Some(ts("2024-05-01T10:02:00Z")));
        assert_ne!(s.id, t.id);
        let h = parse_instance_action(
            &url(),
            r#"{"action":"hibernate","time":"2024-05-01T10:02:00Z"}"#,
            now,
        )
        .unwrap();
        assert_eq!(h.deadline, Some(now), "hibernate has no lead");
        // Same content, same id.
        let t2 = parse_instance_action(
            &url(),
            r#"{"action":"terminate","time":"2024-05-01T10:02:00Z"}"#,
            now,
        )
        .unwrap();
        assert_eq!(t.id, t2.id);
    }

    #[test]
    fn instance_action_garbage_is_a_parse_error() {
        let now = Timestamp::now();
        for body in [
            "not json",
            r#"{"action":"terminate"}"#,
            r#"{"action":"terminate","time":"soon"}"#,
        ] {
            let e = parse_instance_action(&url(), body, now).unwrap_err();
            assert_eq!(e.metric_label(), "parse", "{body}: {e}");
        }
    }

    #[test]
    fn rebalance_carries_publication_time() {
        let now = ts("2024-05-01T10:00:05Z");
        let n = parse_rebalance(&url(), r#"{"noticeTime":"2024-05-01T10:00:00Z"}"#, now).unwrap();
        assert_eq!(n.kind, NoticeKind::Rebalance);
        assert_eq!(n.published_at, Some(ts("2024-05-01T10:00:00Z")));
        assert_eq!(n.deadline, None);
    }

    #[test]
    fn scheduled_events_active_and_cancelled() {
        let body = r#"[
          {"NotBefore":"21 Jan 2019 09:00:43 GMT","Code":"system-reboot","Description":"scheduled reboot",
           "EventId":"instance-event-0d59937288b749b32","NotAfter":"21 Jan 2019 09:17:23 GMT","State":"active"},
          {"NotBefore":"22 Jan 2019 09:00:43 GMT","Code":"system-maintenance","Description":"[Canceled] maintenance",
           "EventId":"instance-event-1","NotAfter":"22 Jan 2019 09:17:23 GMT","State":"canceled"},
          {"NotBefore":"Wed, 23 Jan 2019 09:00:43 GMT","Code":"instance-retirement","Description":"retire",
           "EventId":"instance-event-2","NotAfter":"","State":"active"}
        ]"#;
        let (n, skipped) = parse_scheduled(&url(), body, Timestamp::now()).unwrap();
        assert!(skipped.is_empty());
        assert_eq!(n.len(), 3);
        assert_eq!(n[0].id, "instance-event-0d59937288b749b32");
        assert_eq!(n[0].kind, NoticeKind::Maintenance);
        assert_eq!(n[0].not_before, Some(ts("2019-01-21T09:00:43Z")));
        assert!(n[0].restart);
        assert_eq!(n[1].kind, NoticeKind::Cancelled("instance-event-1".into()));
        assert_ne!(n[1].id, "instance-event-1");
        assert!(!n[2].restart);
        assert_eq!(n[2].not_before, Some(ts("2019-01-23T09:00:43Z")));
        assert!(parse_scheduled(&url(), "[]", Timestamp::now())
            .unwrap()
            .0
            .is_empty());
        assert!(parse_scheduled(&url(), "", Timestamp::now())
            .unwrap()
            .0
            .is_empty());
        assert_eq!(
            parse_scheduled(&url(), "{", Timestamp::now())
                .unwrap_err()
                .metric_label(),
            "parse"
        );
    }

    #[test]
    fn one_unparsable_scheduled_event_is_skipped_the_others_kept() {
        let body = r#"[
          {"NotBefore":"sometime","Code":"system-reboot","EventId":"e-bad","State":"active"},
          {"NotBefore":"21 Jan 2019 09:00:43 GMT","Code":"system-reboot","Description":"reboot",
           "EventId":"e-good","NotAfter":"21 Jan 2019 09:17:23 GMT","State":"active"}
        ]"#;
        let (n, skipped) = parse_scheduled(&url(), body, Timestamp::now()).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].id, "e-good");
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0].0, "e-bad");
        assert_eq!(skipped[0].1.metric_label(), "parse");
    }
}
