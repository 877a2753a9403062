//! GCE metadata server: `instance/preempted`, `instance/maintenance-event` and
//! `instance/upcoming-maintenance`, watched with hanging GETs.
//!
//! Every key is first read with a plain GET (so a notice already present is seen at once), then
//! watched with `?wait_for_change=true&last_etag=E&timeout_sec=N` (header `Metadata-Flavor:
//! Google`). The three requests stay in flight concurrently inside the source across calls of
//! [`NoticeSource::poll`]: `poll` returns as soon as any of them completes, so a change of any key
//! reaches the monitor with no added latency, and a dropped `poll` (cancellation) leaves the
//! in-flight requests to be resumed by the next call. After an error a key backs off on its own
//! (jittered, exponential) and re-reads its value with a plain GET, without the stale etag.
//!
//! `poll` returns the full set of notices currently visible, plus a `Cancelled` for each notice
//! that just went away. It returns `Err` only when the last attempt of every key failed; the
//! failures of single keys are counted and logged here (see [`super::monitor`]).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use jiff::Timestamp;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
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
use crate::backoff::Backoff;
use crate::metrics::Metrics;

/// What the agent knows about GCE ([`Cloud::Gce`]).
pub const FACTS: CloudFacts = CloudFacts {
    name: "gce",
    // About 30 s of notice: 8 s of it kept for evictions.
    drain_reserve: Duration::from_secs(8),
    interruption_notice: Duration::from_secs(30),
    // The deadline is detection + `--gce-preemption-notice`: nothing to clamp.
    max_interruption_notice: None,
    drill_notice: "GCE preemption: 30 s from `preempted=TRUE` to power-off",
    drill_detection: "by the agent's hanging GET on the emulated GCE metadata server",
    dmi: |d: &Dmi| {
        d.sys_vendor == "Google"
            || d.bios_vendor == "Google"
            || d.product_name == "Google Compute Engine"
    },
    probe: Probe {
        method: reqwest::Method::GET,
        path: "/computeMetadata/v1/instance/id",
        header: (FLAVOR_HEADER, FLAVOR),
    },
    maintenance_of_detail: |_| MaintenanceKind::Other,
    build,
};

fn build(
    s: &Settings,
    metrics: &Arc<Metrics>,
    own: &SourceMetrics,
) -> Result<Arc<dyn NoticeSource>, Error> {
    let config = GceConfig::new(s.endpoint.clone(), s.gce_preemption_notice);
    Ok(Arc::new(GceMetadata::new(
        config,
        metrics.clone(),
        own.gce.clone(),
    )?))
}

/// `spotguard_gce_upcoming_maintenance{reason}` and the window start of GCE's
/// `instance/upcoming-maintenance`, exported by [`GceMetadata`].
#[derive(Clone, Debug, Default)]
pub struct GceMetrics {
    /// 1 for each reason of the announced maintenance (e.g. `FAILURE_GPU_XID`); no series when
    /// none is announced.
    pub upcoming_maintenance: Family<ReasonLabels, Gauge>,
    /// Unix time of the announced window start, 0 when none.
    pub upcoming_maintenance_start: Gauge<f64, AtomicU64>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

impl GceMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = GceMetrics::default();
        registry.register(
            "spotguard_gce_upcoming_maintenance",
            "Reasons of the maintenance announced in GCE instance/upcoming-maintenance (1 per reason)",
            m.upcoming_maintenance.clone(),
        );
        registry.register(
            "spotguard_gce_upcoming_maintenance_start_timestamp_seconds",
            "Start of the maintenance window announced by GCE as a Unix time (0 when none)",
            m.upcoming_maintenance_start.clone(),
        );
        m
    }
}

const PREEMPTED_PATH: &str = "/computeMetadata/v1/instance/preempted";
const MAINTENANCE_EVENT_PATH: &str = "/computeMetadata/v1/instance/maintenance-event";
/// GCE's minimum notice before a terminating host maintenance, assumed until the window is known.
pub const MAINTENANCE_MIN_NOTICE: Duration = Duration::from_secs(60);
const UPCOMING_PATH: &str = "/computeMetadata/v1/instance/upcoming-maintenance";
const AUTO_RESTART_PATH: &str = "/computeMetadata/v1/instance/scheduling/automatic-restart";
const TERMINATE_DETAIL: &str = "maintenance-event=TERMINATE_ON_HOST_MAINTENANCE";
const FLAVOR_HEADER: &str = "Metadata-Flavor";
const FLAVOR: &str = "Google";
/// Extra time the client waits for a hanging GET beyond the server's `timeout_sec`.
const HANG_MARGIN: Duration = Duration::from_secs(10);

/// Settings of [`GceMetadata`].
#[derive(Clone, Debug)]
pub struct GceConfig {
    /// Metadata server base URL (`http://169.254.169.254`, same server as
    /// `http://metadata.google.internal` without needing DNS).
    pub endpoint: Url,
    /// Time from `preempted=TRUE` to power-off (`--gce-preemption-notice`: 30 s, 120 s with
    /// extended preemption notice).
    pub preemption_notice: Duration,
    /// `timeout_sec` of each hanging GET; the client allows 10 s more.
    pub watch_timeout: Duration,
    /// Bound on plain (non-hanging) GETs.
    pub request_timeout: Duration,
    /// Bound on establishing a connection.
    pub connect_timeout: Duration,
    /// How often `upcoming-maintenance` is re-read while the key does not exist (404).
    pub upcoming_recheck: Duration,
    /// Per-key backoff after an error: first step, and cap.
    pub retry_base: Duration,
    pub retry_cap: Duration,
}

impl GceConfig {
    pub const DEFAULT_ENDPOINT: &'static str = "http://169.254.169.254";

    /// `endpoint` `None` means [`Self::DEFAULT_ENDPOINT`]; hanging GETs of 60 s, plain GETs
    /// bounded at 5 s (2 s to connect), `upcoming-maintenance` re-read every 60 s while absent,
    /// per-key backoff 1 s doubling to 5 s.
    pub fn new(endpoint: Option<Url>, preemption_notice: Duration) -> Self {
        GceConfig {
            endpoint: endpoint.unwrap_or_else(|| constant_url(Self::DEFAULT_ENDPOINT)),
            preemption_notice,
            watch_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(2),
            upcoming_recheck: Duration::from_secs(60),
            retry_base: Duration::from_secs(1),
            // Short on purpose: a preemption gives 30 s, so a key must not sleep most of it.
            retry_cap: Duration::from_secs(5),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    Preempted,
    MaintenanceEvent,
    Upcoming,
}

const KEYS: [Key; 3] = [Key::Preempted, Key::MaintenanceEvent, Key::Upcoming];

impl Key {
    fn index(self) -> usize {
        match self {
            Key::Preempted => 0,
            Key::MaintenanceEvent => 1,
            Key::Upcoming => 2,
        }
    }
}

/// What a completed request in the watch set delivers.
enum Item {
    Watched(Key, Fetch),
    /// `instance/scheduling/automatic-restart`, read once at start (`None`: unreadable).
    AutomaticRestart(Option<bool>),
}

/// Outcome of one GET of a key.
enum Fetch {
    Value { body: String, etag: Option<String> },
    NotFound,
    Failed(Error),
}

struct KeyState {
    url: Url,
    etag: Option<String>,
    last_failed: bool,
    backoff: Backoff,
}

/// State of the watch, owned by whichever `poll` call holds the lock.
struct Watch {
    started: bool,
    in_flight: FuturesUnordered<BoxFuture<'static, Item>>,
    keys: Vec<KeyState>,
    preempted: Option<Notice>,
    /// When `maintenance-event` turned `TERMINATE_ON_HOST_MAINTENANCE` (`None` while it says
    /// anything else).
    terminate_since: Option<Timestamp>,
    /// The window `upcoming-maintenance` announces now.
    upcoming: Option<Window>,
    /// The one maintenance notice while either key announces a maintenance (see
    /// [`GceMetadata::settle_maintenance`]).
    maintenance: Option<Notice>,
    automatic_restart: Option<bool>,
}

/// A maintenance window as `upcoming-maintenance` announces it.
#[derive(Clone, Debug, PartialEq)]
struct Window {
    start: Timestamp,
    detail: String,
    reasons: Vec<String>,
}

/// The GCE notice source (name `gce`).
pub struct GceMetadata {
    config: GceConfig,
    client: reqwest::Client,
    auto_restart_url: Url,
    watch: tokio::sync::Mutex<Watch>,
    reporter: ErrorReporter,
    gce_metrics: GceMetrics,
}

impl GceMetadata {
    /// Build the client; nothing is requested until the first `poll`.
    pub fn new(
        config: GceConfig,
        metrics: Arc<Metrics>,
        gce_metrics: GceMetrics,
    ) -> Result<Self, Error> {
        let base = &config.endpoint;
        let client = metadata_client(&config.endpoint, config.connect_timeout)
            .build()
            .map_err(|e| request_error(base, e))?;
        let mut keys = Vec::with_capacity(KEYS.len());
        for path in [PREEMPTED_PATH, MAINTENANCE_EVENT_PATH, UPCOMING_PATH] {
            keys.push(KeyState {
                url: endpoint_url(base, path)?,
                etag: None,
                last_failed: false,
                backoff: Backoff::new(config.retry_base, config.retry_cap),
            });
        }
        Ok(GceMetadata {
            auto_restart_url: endpoint_url(base, AUTO_RESTART_PATH)?,
            client,
            watch: tokio::sync::Mutex::new(Watch {
                started: false,
                in_flight: FuturesUnordered::new(),
                keys,
                preempted: None,
                terminate_since: None,
                upcoming: None,
                maintenance: None,
                automatic_restart: None,
            }),
            reporter: ErrorReporter::new(Cloud::Gce.as_str(), metrics),
            gce_metrics,
            config,
        })
    }

    /// Start a GET of every watched key.
    fn arm_all(&self, w: &mut Watch) {
        for key in KEYS {
            let f = self.fetch(key, &w.keys[key.index()], None);
            w.in_flight.push(f);
        }
    }

    /// Take what a GET of `key` answered into the watch: the notices that went away, and the
    /// etag to watch from; a 404 is an error except for `upcoming-maintenance` (none announced).
    fn take(
        &self,
        w: &mut Watch,
        key: Key,
        fetch: Fetch,
        now: Timestamp,
    ) -> Result<(Vec<Notice>, Option<String>), Error> {
        match fetch {
            Fetch::Value { body, etag } => self.apply(w, key, &body, now).map(|gone| (gone, etag)),
            Fetch::NotFound if key == Key::Upcoming => {
                self.apply(w, key, "", now).map(|gone| (gone, None))
            }
            Fetch::NotFound => Err(Error::Status {
                url: w.keys[key.index()].url.to_string(),
                status: 404,
            }),
            Fetch::Failed(e) => Err(e),
        }
    }

    /// When to read `key` again after an answer with `etag`: at once (a hanging GET) with one;
    /// without, `upcoming-maintenance` after its recheck, and any other shortly (a server that
    /// sends no ETag cannot be watched).
    fn next_read(&self, key: Key, etag: Option<&str>) -> Option<Instant> {
        match (etag, key) {
            (Some(_), _) => None,
            (None, Key::Upcoming) => Some(Instant::now() + self.config.upcoming_recheck),
            (None, _) => Some(Instant::now() + self.config.retry_base),
        }
    }

    /// The GET of `key` to issue next: a plain read when no etag is known, else a hanging GET;
    /// started no earlier than `not_before`.
    fn fetch(
        &self,
        key: Key,
        state: &KeyState,
        not_before: Option<Instant>,
    ) -> BoxFuture<'static, Item> {
        let client = self.client.clone();
        let mut url = state.url.clone();
        let etag = state.etag.clone();
        let timeout = match &etag {
            Some(etag) => {
                let secs = self.config.watch_timeout.as_secs().max(1);
                url.query_pairs_mut()
                    .append_pair("wait_for_change", "true")
                    .append_pair("last_etag", etag)
                    .append_pair("timeout_sec", &secs.to_string());
                Duration::from_secs(secs) + HANG_MARGIN
            }
            None => self.config.request_timeout,
        };
        Box::pin(async move {
            if let Some(at) = not_before {
                tokio::time::sleep_until(at).await;
            }
            let result = client
                .get(url.clone())
                .header(FLAVOR_HEADER, FLAVOR)
                .timeout(timeout)
                .send()
                .await;
            let resp = match result {
                Ok(r) => r,
                Err(e) => return Item::Watched(key, Fetch::Failed(request_error(&url, e))),
            };
            let status = resp.status();
            if status == StatusCode::NOT_FOUND {
                return Item::Watched(key, Fetch::NotFound);
            }
            if !status.is_success() {
                let err = Error::Status {
                    url: url.to_string(),
                    status: status.as_u16(),
                };
                return Item::Watched(key, Fetch::Failed(err));
            }
            let etag = resp
                .headers()
                .get(reqwest::header::ETAG)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            match read_body(&url, resp).await {
                Ok(body) => Item::Watched(key, Fetch::Value { body, etag }),
                Err(e) => Item::Watched(key, Fetch::Failed(e)),
            }
        })
    }

    /// `instance/scheduling/automatic-restart` (whether GCE restarts this VM after a
    /// terminating host maintenance), read once at start; unknown when it cannot be read.
    fn automatic_restart(&self) -> BoxFuture<'static, Item> {
        let url = self.auto_restart_url.clone();
        let request = self
            .client
            .get(url.clone())
            .header(FLAVOR_HEADER, FLAVOR)
            .timeout(self.config.request_timeout);
        Box::pin(async move {
            let value = match request.send().await {
                Ok(resp) if resp.status().is_success() => read_body(&url, resp).await.ok(),
                _ => None,
            };
            let parsed = match value.as_deref().map(str::trim) {
                Some(v) if v.eq_ignore_ascii_case("TRUE") => Some(true),
                Some(v) if v.eq_ignore_ascii_case("FALSE") => Some(false),
                _ => None,
            };
            Item::AutomaticRestart(parsed)
        })
    }

    /// Apply a new value of `key`; returns the `Cancelled` notices for notices that went away.
    /// Synchronous on purpose: a `poll` dropped at an await point must not lose a completed
    /// request's result.
    fn apply(
        &self,
        w: &mut Watch,
        key: Key,
        body: &str,
        now: Timestamp,
    ) -> Result<Vec<Notice>, Error> {
        let url = w.keys[key.index()].url.clone();
        match key {
            Key::Preempted => self.apply_preempted(w, &url, body, now),
            Key::MaintenanceEvent => Ok(self.apply_maintenance_event(w, body, now)),
            Key::Upcoming => {
                let next = parse_upcoming(&url, body)?;
                match &next {
                    Some(u) => self.export_upcoming(&u.reasons, Some(u.start)),
                    None => self.export_upcoming(&[], None),
                }
                w.upcoming = next;
                Ok(self.settle_maintenance(w, now).into_iter().collect())
            }
        }
    }

    /// `preempted`: TRUE raises the interruption (once), FALSE cancels it.
    fn apply_preempted(
        &self,
        w: &mut Watch,
        url: &Url,
        body: &str,
        now: Timestamp,
    ) -> Result<Vec<Notice>, Error> {
        let mut gone = Vec::new();
        match body.trim() {
            "TRUE" => {
                if w.preempted.is_none() {
                    w.preempted = Some(self.preemption(now));
                }
            }
            "FALSE" => {
                if let Some(prev) = w.preempted.take() {
                    tracing::warn!(notice_id = %prev.id, "preempted went back to FALSE");
                    gone.push(cancelled(&prev, now));
                }
            }
            other => {
                return Err(parse_error(
                    url,
                    format!("unexpected preempted value {other:?}"),
                ))
            }
        }
        Ok(gone)
    }

    /// The interruption notice of `preempted=TRUE` seen at `now`.
    fn preemption(&self, now: Timestamp) -> Notice {
        let deadline = now
            .checked_add(self.config.preemption_notice)
            .unwrap_or(now);
        tracing::warn!(deadline = %deadline, "GCE preemption notice (preempted=TRUE)");
        Notice {
            id: content_id(Cloud::Gce, "interruption", &["preempted"]),
            kind: NoticeKind::Interruption,
            source: Cloud::Gce,
            deadline: Some(deadline),
            not_before: Some(deadline),
            detail: format!(
                "preempted=TRUE; power-off expected {}s after the notice",
                self.config.preemption_notice.as_secs()
            ),
            restart: false,
            published_at: None,
            maintenance: MaintenanceKind::Other,
            observed_at: now,
            cloud_event_id: None,
        }
    }

    /// `maintenance-event`: TERMINATE_ON_HOST_MAINTENANCE marks the terminating maintenance
    /// (since `now`), anything else ends it; then the maintenance notice is settled.
    fn apply_maintenance_event(&self, w: &mut Watch, body: &str, now: Timestamp) -> Vec<Notice> {
        match body.trim() {
            "TERMINATE_ON_HOST_MAINTENANCE" => {
                if w.terminate_since.is_none() {
                    w.terminate_since = Some(now);
                    match w.upcoming.as_ref().map(|u| u.start).filter(|s| *s > now) {
                        Some(start) => {
                            tracing::warn!(window_start = %start, "GCE host maintenance will terminate this VM")
                        }
                        None => tracing::warn!(
                            assumed_notice_s = MAINTENANCE_MIN_NOTICE.as_secs(),
                            "GCE host maintenance will terminate this VM; window not known yet"
                        ),
                    }
                }
            }
            value => {
                match value {
                    "NONE" => {}
                    "MIGRATE_ON_HOST_MAINTENANCE" => tracing::info!(
                        "GCE host maintenance will live-migrate this VM; nothing to do"
                    ),
                    other => {
                        tracing::warn!(value = other, "unknown maintenance-event value; ignored")
                    }
                }
                w.terminate_since = None;
            }
        }
        self.settle_maintenance(w, now).into_iter().collect()
    }

    /// Fold what the two maintenance keys say into the one maintenance notice. GCE announces
    /// one maintenance in two keys (`maintenance-event`, `upcoming-maintenance`) whose hanging
    /// GETs answer in either order: the notice is born with whichever key speaks first, under
    /// the one maintenance id ([`maintenance_id`]), stays while either key still announces it
    /// (a window learned or moved later only moves its deadline) and is cancelled once, when
    /// neither does. One maintenance is one notice, never two plans.
    fn settle_maintenance(&self, w: &mut Watch, now: Timestamp) -> Option<Notice> {
        let prev = w.maintenance.take();
        let terminate = w.terminate_since;
        let window = w.upcoming.as_ref();
        let (deadline, detail) = match (terminate, window) {
            (None, None) => return prev.map(|prev| cancelled(&prev, now)),
            (Some(since), window) => {
                // A window ahead of us, else the deadline already set while it is ahead, else
                // GCE's minimum notice from when the event was seen: never a zero-length plan.
                let deadline = window
                    .map(|u| u.start)
                    .filter(|start| *start > now)
                    .or_else(|| prev.as_ref().and_then(|n| n.deadline).filter(|d| *d > now))
                    .unwrap_or_else(|| crate::duration::add(since, MAINTENANCE_MIN_NOTICE));
                let detail = match window {
                    Some(u) => format!("{TERMINATE_DETAIL}; {}", u.detail),
                    None => TERMINATE_DETAIL.to_string(),
                };
                (deadline, detail)
            }
            (None, Some(u)) => (u.start, u.detail.clone()),
        };
        if let Some(n) = &prev {
            if n.deadline != Some(deadline) {
                tracing::info!(notice_id = %n.id, deadline = %deadline, "GCE maintenance window learned or moved: deadline updated");
            }
        }
        let observed_at = prev.as_ref().map_or(now, |n| n.observed_at);
        w.maintenance = Some(Notice {
            id: maintenance_id(),
            kind: NoticeKind::Maintenance,
            source: Cloud::Gce,
            deadline: Some(deadline),
            not_before: Some(deadline),
            detail,
            restart: terminate.is_some() && w.automatic_restart.unwrap_or(false),
            published_at: None,
            maintenance: MaintenanceKind::Other,
            observed_at,
            cloud_event_id: None,
        });
        None
    }

    fn export_upcoming(&self, reasons: &[String], start: Option<Timestamp>) {
        let m = &self.gce_metrics;
        m.upcoming_maintenance.clear();
        for reason in reasons {
            m.upcoming_maintenance
                .get_or_create(&ReasonLabels {
                    reason: reason.clone(),
                })
                .set(1);
        }
        let start = start.map_or(0.0, |t| t.as_millisecond() as f64 / 1000.0);
        m.upcoming_maintenance_start.set(start);
    }
}

/// The id of the VM's maintenance notice: one id whichever key announced it first and whatever
/// its window, so that the same maintenance keeps its id when an agent restarted in the middle
/// of it hears the two keys in the other order (a second id would be a second plan, a second
/// signal). A maintenance announced again after its cancel is a new occurrence of this id
/// (the notice store tells them apart by when they were observed). The hashed parts are those
/// of the `maintenance-event` notice of earlier versions, so their records still match.
fn maintenance_id() -> String {
    content_id(
        Cloud::Gce,
        "maintenance",
        &["maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE"],
    )
}

fn cancelled(prev: &Notice, now: Timestamp) -> Notice {
    Notice {
        id: content_id(Cloud::Gce, "cancelled", &[&prev.id]),
        kind: NoticeKind::Cancelled(prev.id.clone()),
        source: Cloud::Gce,
        deadline: None,
        not_before: None,
        detail: format!("no longer announced: {}", prev.detail),
        restart: false,
        published_at: None,
        maintenance: MaintenanceKind::Other,
        observed_at: now,
        cloud_event_id: None,
    }
}

#[derive(Deserialize)]
struct Upcoming {
    #[serde(default, alias = "windowStartTime")]
    window_start_time: Option<String>,
    #[serde(default, alias = "windowEndTime")]
    window_end_time: Option<String>,
    #[serde(default, rename = "type")]
    maintenance_type: Option<String>,
    #[serde(default, alias = "maintenanceStatus")]
    maintenance_status: Option<String>,
    #[serde(default, alias = "maintenanceReasons")]
    maintenance_reasons: Option<Vec<String>>,
}

/// The window announced by `upcoming-maintenance`; `None` for an empty value or one without a
/// window start.
fn parse_upcoming(url: &Url, body: &str) -> Result<Option<Window>, Error> {
    if body.trim().is_empty() {
        return Ok(None);
    }
    let up: Upcoming = serde_json::from_str(body)
        .map_err(|e| parse_error(url, format!("upcoming-maintenance JSON: {e}")))?;
    let Some(start_text) = up.window_start_time.filter(|s| !s.trim().is_empty()) else {
        return Ok(None);
    };
    let start: Timestamp = start_text.trim().parse().map_err(|e| {
        parse_error(
            url,
            format!("window_start_time {start_text:?} is not an RFC 3339 time: {e}"),
        )
    })?;
    let kind = up.maintenance_type.unwrap_or_default();
    let reasons = up.maintenance_reasons.unwrap_or_default();
    let detail = format!(
        "upcoming {} maintenance ({}) window {} – {}{}",
        if kind.is_empty() {
            "host"
        } else {
            kind.as_str()
        },
        up.maintenance_status.unwrap_or_default(),
        start_text,
        up.window_end_time.unwrap_or_default(),
        if reasons.is_empty() {
            String::new()
        } else {
            format!(", reasons {}", reasons.join(","))
        }
    );
    Ok(Some(Window {
        start,
        detail,
        reasons,
    }))
}

/// The notices visible now.
fn visible(w: &Watch) -> Vec<Notice> {
    [&w.preempted, &w.maintenance]
        .into_iter()
        .flatten()
        .cloned()
        .collect()
}

#[async_trait]
impl NoticeSource for GceMetadata {
    fn name(&self) -> &'static str {
        Cloud::Gce.as_str()
    }

    fn poll_interval(&self) -> Duration {
        Duration::ZERO
    }

    async fn poll(&self) -> Result<Vec<Notice>, Error> {
        let mut guard = self.watch.lock().await;
        let w = &mut *guard;
        if !w.started {
            w.started = true;
            w.in_flight.push(self.automatic_restart());
            self.arm_all(w);
        }
        loop {
            // Every completion of a watched key pushes that key's next request (with no await
            // in between), so the set is never empty; should it be, every key is re-armed.
            let Some(item) = w.in_flight.next().await else {
                self.arm_all(w);
                continue;
            };
            let (key, fetch) = match item {
                Item::Watched(key, fetch) => (key, fetch),
                Item::AutomaticRestart(value) => {
                    w.automatic_restart = value;
                    if let Some(m) = w.maintenance.as_mut() {
                        m.restart = w.terminate_since.is_some() && value.unwrap_or(false);
                    }
                    continue;
                }
            };
            let outcome = self.take(w, key, fetch, Timestamp::now());
            let state = &mut w.keys[key.index()];
            match outcome {
                Ok((gone, etag)) => {
                    state.last_failed = false;
                    state.backoff.reset();
                    let delay = self.next_read(key, etag.as_deref());
                    state.etag = etag;
                    let next = self.fetch(key, state, delay);
                    w.in_flight.push(next);
                    if w.keys.iter().all(|k| !k.last_failed) {
                        self.reporter.all_ok();
                    }
                    let mut notices = visible(w);
                    notices.extend(gone);
                    return Ok(notices);
                }
                Err(err) => {
                    state.last_failed = true;
                    state.etag = None;
                    let delay = state.backoff.next_delay();
                    let next = self.fetch(key, state, Some(Instant::now() + delay));
                    w.in_flight.push(next);
                    if w.keys.iter().all(|k| k.last_failed) {
                        return Err(err);
                    }
                    self.reporter.report(&err);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url() -> Url {
        constant_url(GceConfig::DEFAULT_ENDPOINT)
    }

    #[test]
    fn upcoming_maintenance_snake_and_camel_case() {
        let snake = r#"{"can_reschedule":"false","latest_window_start_time":"2030-04-24T16:51:07Z",
            "maintenance_status":"PENDING","type":"SCHEDULED","window_end_time":"2030-04-24T20:51:07Z",
            "window_start_time":"2030-04-24T16:51:07Z","maintenance_reasons":["FAILURE_GPU_XID"]}"#;
        let n = parse_upcoming(&url(), snake).unwrap().unwrap();
        assert_eq!(
            n.start,
            "2030-04-24T16:51:07Z".parse::<Timestamp>().unwrap()
        );
        assert_eq!(n.reasons, vec!["FAILURE_GPU_XID".to_string()]);
        let camel = r#"{"windowStartTime":"2030-04-24T16:51:07Z","type":"SCHEDULED","maintenanceStatus":"PENDING"}"#;
        let m = parse_upcoming(&url(), camel).unwrap().unwrap();
        assert_eq!(m.start, n.start);
        assert!(m.reasons.is_empty());
        assert!(parse_upcoming(&url(), "").unwrap().is_none());
        assert!(parse_upcoming(&url(), "{}").unwrap().is_none());
        assert_eq!(
            parse_upcoming(&url(), "{").unwrap_err().metric_label(),
            "parse"
        );
        let bad_time = r#"{"window_start_time":"tomorrow"}"#;
        assert_eq!(
            parse_upcoming(&url(), bad_time).unwrap_err().metric_label(),
            "parse"
        );
    }

    #[test]
    fn gce_metrics_register_with_prefix() {
        let mut r = Registry::default();
        let m = GceMetrics::register(&mut r);
        m.upcoming_maintenance
            .get_or_create(&ReasonLabels {
                reason: "FAILURE_GPU_XID".into(),
            })
            .set(1);
        m.upcoming_maintenance_start.set(1_700_000_000.0);
        let text = crate::metrics::encode(&r);
        assert!(text.contains("spotguard_gce_upcoming_maintenance{reason=\"FAILURE_GPU_XID\"} 1"));
        let start: f64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix("spotguard_gce_upcoming_maintenance_start_timestamp_seconds ")
            })
            .and_then(|v| v.parse().ok())
            .unwrap();
        assert_eq!(start, 1_700_000_000.0);
    }
}
