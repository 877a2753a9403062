//! Notice sources and the monitor loop against small in-process metadata servers (axum on
//! 127.0.0.1:0, one per test), in the style of NTH's httptest servers.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, put};
use axum::Router;
use jiff::Timestamp;
use prometheus_client::registry::Registry;
use reqwest::Url;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use spotguard::metrics::{encode, ErrorLabels, Metrics, SourceLabels};
use spotguard::notice::azure::{AzureConfig, AzureScheduledEvents};
use spotguard::notice::detect::{detect, ProbeEndpoints};
use spotguard::notice::ec2::{Ec2Config, Ec2Imds};
use spotguard::notice::gce::{GceConfig, GceMetadata, GceMetrics};
use spotguard::notice::monitor::{run_monitor, run_monitor_with, MonitorPolicy, PollHealth};
use spotguard::notice::{Cloud, Error, Notice, NoticeKind, NoticeSource};

// ---------------------------------------------------------------- helpers

async fn serve(router: Router) -> Url {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    Url::parse(&format!("http://{addr}")).unwrap()
}

fn metrics() -> (Registry, Arc<Metrics>) {
    let mut registry = Registry::default();
    let m = Arc::new(Metrics::register(&mut registry));
    (registry, m)
}

fn errors(m: &Metrics, source: &str, error: &str) -> u64 {
    m.metadata_errors
        .get_or_create(&ErrorLabels {
            source: source.into(),
            error: error.into(),
        })
        .get()
}

fn polls(m: &Metrics, source: &str) -> u64 {
    m.metadata_polls
        .get_or_create(&SourceLabels {
            source: source.into(),
        })
        .get()
}

fn kinds(notices: &[Notice]) -> Vec<NoticeKind> {
    notices.iter().map(|n| n.kind.clone()).collect()
}

fn secs_between(a: Timestamp, b: Timestamp) -> f64 {
    (b.as_millisecond() - a.as_millisecond()) as f64 / 1000.0
}

// ---------------------------------------------------------------- fake IMDS (EC2)

/// Scripted IMDS: each path answers from its queue (the last answer repeats); 404 when none.
#[derive(Default)]
struct Imds {
    /// Token PUT answer status (200 issues a fresh token).
    token_status: Mutex<u16>,
    token_attempts: AtomicUsize,
    /// TTLs requested by the token PUTs.
    requested_ttls: Mutex<Vec<String>>,
    token_puts: AtomicUsize,
    /// The token GETs must carry when `require_token` is set.
    valid_token: Mutex<Option<String>>,
    require_token: Mutex<bool>,
    /// Answer 401 to every GET.
    reject_all: bool,
    scripts: Mutex<HashMap<String, VecDeque<(u16, String)>>>,
    seen_tokens: Mutex<Vec<Option<String>>>,
    hits: Mutex<HashMap<String, usize>>,
}

impl Imds {
    fn new(require_token: bool) -> Self {
        Imds {
            token_status: Mutex::new(200),
            require_token: Mutex::new(require_token),
            ..Default::default()
        }
    }

    fn script(self, path: &str, answers: &[(u16, &str)]) -> Self {
        self.scripts.lock().unwrap().insert(
            path.to_string(),
            answers.iter().map(|(s, b)| (*s, b.to_string())).collect(),
        );
        self
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().unwrap().get(path).copied().unwrap_or(0)
    }
}

async fn imds_token(State(imds): State<Arc<Imds>>, headers: HeaderMap) -> Response {
    let Some(ttl) = headers
        .get("x-aws-ec2-metadata-token-ttl-seconds")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    imds.requested_ttls.lock().unwrap().push(ttl.clone());
    imds.token_attempts.fetch_add(1, Ordering::SeqCst);
    let status = *imds.token_status.lock().unwrap();
    if status != 200 {
        return StatusCode::from_u16(status).unwrap().into_response();
    }
    let n = imds.token_puts.fetch_add(1, Ordering::SeqCst) + 1;
    let token = format!("token-{n}");
    *imds.valid_token.lock().unwrap() = Some(token.clone());
    ([("x-aws-ec2-metadata-token-ttl-seconds", ttl)], token).into_response()
}

async fn imds_get(
    State(imds): State<Arc<Imds>>,
    Path(path): Path<String>,
    headers: HeaderMap,
) -> Response {
    let token = headers
        .get("x-aws-ec2-metadata-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    imds.seen_tokens.lock().unwrap().push(token.clone());
    *imds.hits.lock().unwrap().entry(path.clone()).or_default() += 1;
    if imds.reject_all {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    if *imds.require_token.lock().unwrap()
        && (token.is_none() || token != *imds.valid_token.lock().unwrap())
    {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    let mut scripts = imds.scripts.lock().unwrap();
    let answer = match scripts.get_mut(&path) {
        Some(q) if q.len() > 1 => q.pop_front(),
        Some(q) => q.front().cloned(),
        None => None,
    };
    match answer {
        Some((status, body)) => (StatusCode::from_u16(status).unwrap(), body).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn imds_server(imds: Arc<Imds>) -> Url {
    let router = Router::new()
        .route("/latest/api/token", put(imds_token))
        .route("/latest/meta-data/{*path}", get(imds_get))
        .with_state(imds);
    serve(router).await
}

const ACTION: &str = "spot/instance-action";
const REBALANCE: &str = "events/recommendations/rebalance";
const SCHEDULED: &str = "events/maintenance/scheduled";

fn ec2(base: Url, v1_fallback: bool, m: Arc<Metrics>) -> Ec2Imds {
    let cfg = Ec2Config::new(Some(base), Duration::from_millis(50), v1_fallback);
    Ec2Imds::new(cfg, m).unwrap()
}

// ---------------------------------------------------------------- EC2 tests

#[tokio::test]
async fn ec2_token_is_cached_and_sent_and_404_means_none() {
    let imds = Arc::new(Imds::new(true).script(SCHEDULED, &[(200, "[]")]));
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds.clone()).await, false, m.clone());
    for _ in 0..3 {
        assert!(src.poll().await.unwrap().is_empty());
    }
    assert_eq!(
        imds.token_puts.load(Ordering::SeqCst),
        1,
        "one token for all polls"
    );
    assert_eq!(
        *imds.requested_ttls.lock().unwrap(),
        vec!["21600".to_string()]
    );
    let seen = imds.seen_tokens.lock().unwrap().clone();
    assert_eq!(seen.len(), 9);
    assert!(
        seen.iter().all(|t| t.as_deref() == Some("token-1")),
        "{seen:?}"
    );
    assert_eq!(errors(&m, "aws", "status") + errors(&m, "aws", "token"), 0);
}

#[tokio::test]
async fn ec2_token_is_refreshed_before_it_expires() {
    let imds = Arc::new(Imds::new(true));
    let (_r, m) = metrics();
    let mut cfg = Ec2Config::new(
        Some(imds_server(imds.clone()).await),
        Duration::from_secs(1),
        false,
    );
    cfg.token_ttl = Duration::from_secs(1);
    let src = Ec2Imds::new(cfg, m).unwrap();
    src.poll().await.unwrap();
    src.poll().await.unwrap();
    assert_eq!(imds.token_puts.load(Ordering::SeqCst), 1);
    // Refreshed at 90 % of the TTL, before IMDS would reject it.
    tokio::time::sleep(Duration::from_millis(950)).await;
    src.poll().await.unwrap();
    assert_eq!(imds.token_puts.load(Ordering::SeqCst), 2);
    let seen = imds.seen_tokens.lock().unwrap().clone();
    assert_eq!(seen.last().unwrap().as_deref(), Some("token-2"));
}

#[tokio::test]
async fn ec2_token_403_is_an_error_without_v1_fallback() {
    let imds = Arc::new(Imds::new(false));
    *imds.token_status.lock().unwrap() = 403;
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds.clone()).await, false, m);
    let err = src.poll().await.unwrap_err();
    assert!(matches!(err, Error::Token { status: 403, .. }), "{err}");
    assert_eq!(err.metric_label(), "token");
    assert!(err.to_string().contains("--imds-v1-fallback"));
    assert!(
        imds.seen_tokens.lock().unwrap().is_empty(),
        "no metadata GET without a token"
    );
}

#[tokio::test]
async fn ec2_token_failure_with_v1_fallback_polls_without_token() {
    let imds = Arc::new(Imds::new(false).script(
        ACTION,
        &[(
            200,
            r#"{"action":"terminate","time":"2030-01-01T00:02:00Z"}"#,
        )],
    ));
    *imds.token_status.lock().unwrap() = 403;
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds.clone()).await, true, m.clone());
    for _ in 0..3 {
        let notices = src.poll().await.unwrap();
        assert_eq!(kinds(&notices), vec![NoticeKind::Interruption]);
        assert_eq!(
            notices[0].deadline,
            Some("2030-01-01T00:02:00Z".parse().unwrap())
        );
    }
    assert!(imds.seen_tokens.lock().unwrap().iter().all(Option::is_none));
    assert_eq!(
        imds.token_attempts.load(Ordering::SeqCst),
        1,
        "v1 sticks for a while"
    );
    assert_eq!(
        errors(&m, "aws", "token"),
        1,
        "the failed token request is counted once"
    );
    // IMDS now requires v2: the rejected v1 request fetches a token at once and retries.
    *imds.token_status.lock().unwrap() = 200;
    *imds.require_token.lock().unwrap() = true;
    assert_eq!(
        kinds(&src.poll().await.unwrap()),
        vec![NoticeKind::Interruption]
    );
    assert_eq!(imds.token_puts.load(Ordering::SeqCst), 1);
    assert_eq!(errors(&m, "aws", "status"), 0);
}

#[tokio::test]
async fn ec2_401_retokens_once_and_retries() {
    let imds = Arc::new(Imds::new(true).script(
        REBALANCE,
        &[(200, r#"{"noticeTime":"2030-01-01T00:00:00Z"}"#)],
    ));
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds.clone()).await, false, m.clone());
    assert_eq!(
        kinds(&src.poll().await.unwrap()),
        vec![NoticeKind::Rebalance]
    );
    // IMDS forgets the token (e.g. restarted): every GET with it gets 401.
    *imds.valid_token.lock().unwrap() = Some("rotated".into());
    assert_eq!(
        kinds(&src.poll().await.unwrap()),
        vec![NoticeKind::Rebalance]
    );
    assert_eq!(
        imds.token_puts.load(Ordering::SeqCst),
        2,
        "three concurrent 401s re-token once"
    );
    assert_eq!(errors(&m, "aws", "status"), 0);
}

#[tokio::test]
async fn ec2_persistent_401_fails_after_one_retoken() {
    let imds = Arc::new(Imds {
        reject_all: true,
        ..Imds::new(true)
    });
    assert!(*imds.require_token.lock().unwrap());
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds.clone()).await, false, m.clone());
    let err = src.poll().await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 401, .. }), "{err}");
    assert_eq!(imds.token_puts.load(Ordering::SeqCst), 2);
    assert_eq!(imds.hits(ACTION), 2, "one retry per path");
    // The poll's own error is the monitor's to count; the other two paths are counted here.
    assert_eq!(errors(&m, "aws", "status"), 2);
}

#[tokio::test]
async fn ec2_instance_action_stop_and_hibernate() {
    let imds = Arc::new(Imds::new(true).script(
        ACTION,
        &[
            (200, r#"{"action":"stop","time":"2030-01-01T00:02:00Z"}"#),
            (
                200,
                r#"{"action":"hibernate","time":"2030-01-01T00:02:00Z"}"#,
            ),
        ],
    ));
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds).await, false, m);
    let stop = src.poll().await.unwrap();
    assert_eq!(kinds(&stop), vec![NoticeKind::Interruption]);
    assert_eq!(
        stop[0].deadline,
        Some("2030-01-01T00:02:00Z".parse().unwrap())
    );
    assert!(stop[0].detail.contains("stop"));
    let before = Timestamp::now();
    let hib = src.poll().await.unwrap();
    assert_eq!(kinds(&hib), vec![NoticeKind::Interruption]);
    let deadline = hib[0].deadline.unwrap();
    assert!(
        deadline >= before && deadline <= Timestamp::now(),
        "hibernate: deadline now"
    );
}

#[tokio::test]
async fn ec2_rebalance_and_scheduled_events_including_cancelled() {
    let scheduled = r#"[
      {"NotBefore":"21 Jan 2030 09:00:43 GMT","Code":"system-reboot","Description":"scheduled reboot",
       "EventId":"instance-event-0d59937288b749b32","NotAfter":"21 Jan 2030 09:17:23 GMT","State":"active"},
      {"NotBefore":"22 Jan 2030 09:00:43 GMT","Code":"instance-stop","Description":"[Canceled] stop",
       "EventId":"instance-event-1","NotAfter":"22 Jan 2030 09:17:23 GMT","State":"canceled"}]"#;
    let imds = Arc::new(
        Imds::new(true)
            .script(
                REBALANCE,
                &[(200, r#"{"noticeTime":"2030-01-01T00:00:00Z"}"#)],
            )
            .script(SCHEDULED, &[(200, scheduled)]),
    );
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds).await, false, m);
    let first = src.poll().await.unwrap();
    assert_eq!(
        kinds(&first),
        vec![
            NoticeKind::Rebalance,
            NoticeKind::Maintenance,
            NoticeKind::Cancelled("instance-event-1".into())
        ]
    );
    assert_eq!(
        first[0].published_at,
        Some("2030-01-01T00:00:00Z".parse().unwrap())
    );
    assert_eq!(first[1].id, "instance-event-0d59937288b749b32");
    assert_eq!(
        first[1].not_before,
        Some("2030-01-21T09:00:43Z".parse().unwrap())
    );
    assert!(first[1].restart);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let second = src.poll().await.unwrap();
    assert_eq!(second.len(), 3);
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a.id, b.id, "same content, same id");
        assert_eq!(
            a.observed_at, b.observed_at,
            "observed_at is the first sighting"
        );
    }
}

#[tokio::test]
async fn ec2_one_failing_path_does_not_hide_the_others() {
    let imds = Arc::new(
        Imds::new(true)
            .script(ACTION, &[(500, "oops")])
            .script(
                REBALANCE,
                &[(200, r#"{"noticeTime":"2030-01-01T00:00:00Z"}"#)],
            )
            .script(SCHEDULED, &[(200, "[]")]),
    );
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds).await, false, m.clone());
    let notices = src.poll().await.unwrap();
    assert_eq!(kinds(&notices), vec![NoticeKind::Rebalance]);
    assert_eq!(errors(&m, "aws", "status"), 1);
}

#[tokio::test]
async fn ec2_garbage_json_is_a_counted_parse_error() {
    let imds = Arc::new(
        Imds::new(true)
            .script(ACTION, &[(200, "{{{ not json")])
            .script(REBALANCE, &[(200, r#"{"noticeTime": 12}"#)])
            .script(SCHEDULED, &[(200, "[]")]),
    );
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds).await, false, m.clone());
    assert!(src.poll().await.unwrap().is_empty());
    assert_eq!(errors(&m, "aws", "parse"), 2);
    // All three broken: the poll fails with the instance-action error.
    let imds = Arc::new(
        Imds::new(true)
            .script(ACTION, &[(200, "[")])
            .script(REBALANCE, &[(503, "")])
            .script(SCHEDULED, &[(200, "{\"not\":\"a list\"}")]),
    );
    let (_r, m) = metrics();
    let src = ec2(imds_server(imds).await, false, m.clone());
    let err = src.poll().await.unwrap_err();
    assert_eq!(err.metric_label(), "parse");
    assert!(err.to_string().contains("instance-action"), "{err}");
    assert_eq!(errors(&m, "aws", "parse"), 1);
    assert_eq!(errors(&m, "aws", "status"), 1);
}

// ---------------------------------------------------------------- fake GCE metadata server

#[derive(Clone, Debug, PartialEq)]
enum Val {
    Value(String),
    Missing,
}

/// Metadata keys with versions (ETag `etag-<version>`), hanging GETs honoured like GCE's
/// (`wait_for_change`, `last_etag`, `timeout_sec`), per-request fault scripts, and a log.
struct Gce {
    keys: HashMap<String, watch::Sender<(Val, u64)>>,
    faults: Mutex<HashMap<String, VecDeque<Option<u16>>>>,
    fail_all: Mutex<Option<u16>>,
    log: Mutex<Vec<(String, HashMap<String, String>)>>,
}

impl Gce {
    fn new(values: &[(&str, Val)]) -> Self {
        let keys = values
            .iter()
            .map(|(k, v)| (k.to_string(), watch::channel((v.clone(), 1)).0))
            .collect();
        Gce {
            keys,
            faults: Mutex::new(HashMap::new()),
            fail_all: Mutex::new(None),
            log: Mutex::new(Vec::new()),
        }
    }

    fn set(&self, key: &str, v: Val) {
        self.keys[key].send_modify(|(val, version)| {
            *val = v;
            *version += 1;
        });
    }

    fn requests(&self, key: &str) -> Vec<HashMap<String, String>> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, q)| q.clone())
            .collect()
    }
}

fn gce_answer(val: &Val, version: u64) -> Response {
    match val {
        Val::Value(v) => ([(header::ETAG, format!("etag-{version}"))], v.clone()).into_response(),
        Val::Missing => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn gce_get(
    State(gce): State<Arc<Gce>>,
    Path(key): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return StatusCode::FORBIDDEN.into_response();
    }
    gce.log.lock().unwrap().push((key.clone(), query.clone()));
    if let Some(status) = *gce.fail_all.lock().unwrap() {
        return StatusCode::from_u16(status).unwrap().into_response();
    }
    let fault = gce
        .faults
        .lock()
        .unwrap()
        .get_mut(&key)
        .and_then(VecDeque::pop_front)
        .flatten();
    if let Some(status) = fault {
        return StatusCode::from_u16(status).unwrap().into_response();
    }
    let Some(tx) = gce.keys.get(&key) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let mut rx = tx.subscribe();
    let (val, version) = rx.borrow_and_update().clone();
    let waiting = query.get("wait_for_change").map(String::as_str) == Some("true");
    let last = query.get("last_etag").cloned().unwrap_or_default();
    if !waiting || last != format!("etag-{version}") {
        return gce_answer(&val, version);
    }
    let secs: u64 = query
        .get("timeout_sec")
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let _ = tokio::time::timeout(Duration::from_secs(secs), rx.changed()).await;
    let (val, version) = rx.borrow().clone();
    gce_answer(&val, version)
}

async fn gce_server(gce: Arc<Gce>) -> Url {
    let router = Router::new()
        .route("/computeMetadata/v1/instance/{*key}", get(gce_get))
        .with_state(gce);
    serve(router).await
}

const PREEMPTED: &str = "preempted";
const MAINT: &str = "maintenance-event";
const UPCOMING: &str = "upcoming-maintenance";

fn quiet_gce() -> Gce {
    Gce::new(&[
        (PREEMPTED, Val::Value("FALSE".into())),
        (MAINT, Val::Value("NONE".into())),
        (UPCOMING, Val::Missing),
        ("scheduling/automatic-restart", Val::Value("TRUE".into())),
    ])
}

fn gce_source(base: Url, m: Arc<Metrics>, gm: GceMetrics) -> GceMetadata {
    let mut cfg = GceConfig::new(Some(base), Duration::from_secs(30));
    cfg.watch_timeout = Duration::from_secs(30);
    cfg.upcoming_recheck = Duration::from_secs(60);
    cfg.retry_base = Duration::from_millis(20);
    cfg.retry_cap = Duration::from_millis(100);
    GceMetadata::new(cfg, m, gm).unwrap()
}

/// Poll until each watched key has been read once (each poll returns on one completion).
async fn gce_initial_reads(src: &GceMetadata) -> Vec<Notice> {
    let mut last = Vec::new();
    for _ in 0..3 {
        last = tokio::time::timeout(Duration::from_secs(10), src.poll())
            .await
            .expect("initial read answers at once")
            .unwrap();
    }
    last
}

// ---------------------------------------------------------------- GCE tests

#[tokio::test]
async fn gce_notice_present_at_start_is_seen_at_once() {
    let gce = Arc::new(quiet_gce());
    gce.set(PREEMPTED, Val::Value("TRUE".into()));
    let (_r, m) = metrics();
    let src = gce_source(gce_server(gce.clone()).await, m, GceMetrics::default());
    let before = Timestamp::now();
    let notices = gce_initial_reads(&src).await;
    assert_eq!(kinds(&notices), vec![NoticeKind::Interruption]);
    let left = secs_between(before, notices[0].deadline.unwrap());
    assert!(
        (29.0..=31.0).contains(&left),
        "deadline = detection + 30 s, got {left}"
    );
    let first = gce.requests(PREEMPTED);
    assert!(
        !first[0].contains_key("wait_for_change"),
        "first read does not wait"
    );
}

#[tokio::test]
async fn gce_hanging_get_returns_promptly_when_the_value_changes() {
    let gce = Arc::new(quiet_gce());
    let (_r, m) = metrics();
    let src = Arc::new(gce_source(
        gce_server(gce.clone()).await,
        m,
        GceMetrics::default(),
    ));
    assert!(gce_initial_reads(&src).await.is_empty());
    let poller = tokio::spawn({
        let src = src.clone();
        async move {
            let r = src.poll().await;
            (r, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!poller.is_finished(), "poll hangs while nothing changes");
    let hanging = gce.requests(PREEMPTED);
    let last = hanging.last().unwrap();
    assert_eq!(
        last.get("wait_for_change").map(String::as_str),
        Some("true")
    );
    assert_eq!(last.get("last_etag").map(String::as_str), Some("etag-1"));
    assert_eq!(last.get("timeout_sec").map(String::as_str), Some("30"));

    let changed_at = Instant::now();
    gce.set(PREEMPTED, Val::Value("TRUE".into()));
    let (result, returned_at) = tokio::time::timeout(Duration::from_secs(5), poller)
        .await
        .expect("poll returns after the change")
        .unwrap();
    let notices = result.unwrap();
    assert_eq!(kinds(&notices), vec![NoticeKind::Interruption]);
    let latency = returned_at.duration_since(changed_at);
    assert!(
        latency < Duration::from_secs(2),
        "change → poll return took {latency:?}"
    );
}

#[tokio::test]
async fn gce_error_backs_off_and_rereads_without_etag() {
    let gce = Arc::new(quiet_gce());
    // maintenance-event: 1st request normal, 2nd (the first hanging GET) fails with 503.
    gce.faults
        .lock()
        .unwrap()
        .insert(MAINT.into(), VecDeque::from([None, Some(503)]));
    let (_r, m) = metrics();
    let src = gce_source(
        gce_server(gce.clone()).await,
        m.clone(),
        GceMetrics::default(),
    );
    gce_initial_reads(&src).await;
    // The next completion is the re-read after the failed hanging GET.
    tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .expect("re-read answers")
        .unwrap();
    let reqs = gce.requests(MAINT);
    assert!(reqs.len() >= 3, "{reqs:?}");
    assert!(!reqs[0].contains_key("last_etag"));
    assert_eq!(reqs[1].get("last_etag").map(String::as_str), Some("etag-1"));
    assert!(
        !reqs[2].contains_key("last_etag"),
        "after an error: plain GET, no etag"
    );
    assert!(!reqs[2].contains_key("wait_for_change"));
    assert_eq!(
        errors(&m, "gce", "status"),
        1,
        "single-key failure counted by the source"
    );
}

#[tokio::test]
async fn gce_terminate_maintenance_then_none_is_cancelled() {
    let gce = Arc::new(quiet_gce());
    let (_r, m) = metrics();
    let src = gce_source(gce_server(gce.clone()).await, m, GceMetrics::default());
    gce_initial_reads(&src).await;
    gce.set(MAINT, Val::Value("MIGRATE_ON_HOST_MAINTENANCE".into()));
    let migrate = tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .unwrap()
        .unwrap();
    assert!(migrate.is_empty(), "live migration is logged only");
    gce.set(MAINT, Val::Value("TERMINATE_ON_HOST_MAINTENANCE".into()));
    let term = tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kinds(&term), vec![NoticeKind::Maintenance]);
    assert!(term[0].restart, "automatic-restart=TRUE");
    let id = term[0].id.clone();
    gce.set(MAINT, Val::Value("NONE".into()));
    let none = tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kinds(&none), vec![NoticeKind::Cancelled(id)]);
}

#[tokio::test]
async fn gce_upcoming_maintenance_notice_and_reason_metric() {
    let gce = Arc::new(quiet_gce());
    let window = r#"{"can_reschedule":"false","maintenance_status":"PENDING","type":"SCHEDULED",
        "window_start_time":"2030-04-24T16:51:07Z","window_end_time":"2030-04-24T20:51:07Z",
        "maintenance_reasons":["FAILURE_GPU_XID"]}"#;
    gce.set(UPCOMING, Val::Value(window.into()));
    let (_r, m) = metrics();
    let mut registry = Registry::default();
    let gm = GceMetrics::register(&mut registry);
    let src = gce_source(gce_server(gce.clone()).await, m, gm);
    let notices = gce_initial_reads(&src).await;
    assert_eq!(kinds(&notices), vec![NoticeKind::Maintenance]);
    assert_eq!(
        notices[0].not_before,
        Some("2030-04-24T16:51:07Z".parse().unwrap())
    );
    let id = notices[0].id.clone();
    assert!(encode(&registry)
        .contains("spotguard_gce_upcoming_maintenance{reason=\"FAILURE_GPU_XID\"} 1"));
    // The window is withdrawn: the key disappears (404) while being watched.
    gce.set(UPCOMING, Val::Missing);
    let gone = tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kinds(&gone), vec![NoticeKind::Cancelled(id)]);
    let text = encode(&registry);
    assert!(!text.contains("FAILURE_GPU_XID"), "{text}");
    assert!(
        text.contains("spotguard_gce_upcoming_maintenance_start_timestamp_seconds 0"),
        "{text}"
    );
}

/// GCE announces one maintenance in two keys whose hanging GETs answer in either order. Whichever
/// key speaks first, every poll shows one maintenance notice under one id (a window learned or
/// moved later only moves its deadline), and it is cancelled once, when neither key announces it
/// any more. (Two ids for one maintenance queued a second plan: a second checkpoint signal.)
#[tokio::test]
async fn gce_one_maintenance_in_two_keys_is_one_notice_whichever_answers_first() {
    const TERMINATE: &str = "TERMINATE_ON_HOST_MAINTENANCE";
    let window = |start: &str| {
        format!(
            r#"{{"maintenance_status":"PENDING","type":"SCHEDULED","window_start_time":"{start}",
            "window_end_time":"2030-04-24T20:51:07Z"}}"#
        )
    };
    let start: Timestamp = "2030-04-24T16:51:07Z".parse().unwrap();
    let moved: Timestamp = "2030-04-24T17:51:07Z".parse().unwrap();
    let mut ids = Vec::new();
    for upcoming_first in [true, false] {
        let gce = Arc::new(quiet_gce());
        // Answered (empty) rather than 404, so that the key is watched, not re-read every 60 s.
        gce.set(UPCOMING, Val::Value(String::new()));
        let (_r, m) = metrics();
        let src = gce_source(gce_server(gce.clone()).await, m, GceMetrics::default());
        assert!(gce_initial_reads(&src).await.is_empty());
        let poll = || async {
            tokio::time::timeout(Duration::from_secs(5), src.poll())
                .await
                .expect("poll returns after the change")
                .unwrap()
        };
        let (first, first_val, second, second_val) = if upcoming_first {
            (
                UPCOMING,
                window(&start.to_string()),
                MAINT,
                TERMINATE.into(),
            )
        } else {
            (
                MAINT,
                TERMINATE.to_string(),
                UPCOMING,
                window(&start.to_string()),
            )
        };
        let case = if upcoming_first {
            "upcoming-maintenance first"
        } else {
            "maintenance-event first"
        };

        gce.set(first, Val::Value(first_val));
        let one = poll().await;
        assert_eq!(kinds(&one), vec![NoticeKind::Maintenance], "{case}");
        let id = one[0].id.clone();
        ids.push(id.clone());
        gce.set(second, Val::Value(second_val));
        let both = poll().await;
        assert_eq!(kinds(&both), vec![NoticeKind::Maintenance], "{case}");
        assert_eq!(both[0].id, id, "{case}: one maintenance, one id");
        assert_eq!(both[0].deadline, Some(start), "{case}: the window's start");
        assert!(
            both[0].restart,
            "{case}: TERMINATE with automatic-restart=TRUE"
        );

        gce.set(UPCOMING, Val::Value(window(&moved.to_string())));
        let later = poll().await;
        assert_eq!(kinds(&later), vec![NoticeKind::Maintenance], "{case}");
        assert_eq!(
            later[0].id, id,
            "{case}: a moved window is the same maintenance"
        );
        assert_eq!(later[0].deadline, Some(moved), "{case}");

        // Withdrawn key by key: still announced by the other key, then cancelled once.
        let withdraw = |key: &str| {
            let quiet = if key == MAINT {
                Val::Value("NONE".into())
            } else {
                Val::Missing
            };
            gce.set(key, quiet);
        };
        withdraw(first);
        let half = poll().await;
        assert_eq!(kinds(&half), vec![NoticeKind::Maintenance], "{case}");
        assert_eq!(half[0].id, id, "{case}");
        withdraw(second);
        let gone = poll().await;
        assert_eq!(
            kinds(&gone),
            vec![NoticeKind::Cancelled(id.clone())],
            "{case}"
        );
    }
    // An agent restarted in the middle of the maintenance hears the two keys in either order:
    // still the id its record holds, or the same maintenance would be a second plan.
    assert_eq!(
        ids[0], ids[1],
        "one maintenance, one id, whichever key answered first"
    );
}

#[tokio::test]
async fn gce_every_key_failing_fails_the_poll() {
    let gce = Arc::new(quiet_gce());
    *gce.fail_all.lock().unwrap() = Some(500);
    let (_r, m) = metrics();
    let mut cfg = GceConfig::new(Some(gce_server(gce).await), Duration::from_secs(30));
    // No retry of the first failed key before the last one has failed too.
    cfg.retry_base = Duration::from_secs(5);
    let src = GceMetadata::new(cfg, m.clone(), GceMetrics::default()).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), src.poll())
        .await
        .unwrap()
        .unwrap_err();
    assert!(matches!(err, Error::Status { status: 500, .. }), "{err}");
    assert_eq!(
        errors(&m, "gce", "status"),
        2,
        "two keys counted here, the third by the monitor"
    );
}

// ---------------------------------------------------------------- fake Azure IMDS

#[derive(Default)]
struct Azure {
    events: Mutex<serde_json::Value>,
    name: Mutex<Option<String>>,
    name_hits: AtomicUsize,
    event_gets: AtomicUsize,
    first_delay: Mutex<Duration>,
    posts: Mutex<Vec<String>>,
}

fn azure_checks(
    headers: &HeaderMap,
    query: &HashMap<String, String>,
    version: &str,
) -> Option<Response> {
    if headers.get("metadata").and_then(|v| v.to_str().ok()) != Some("true") {
        return Some(StatusCode::BAD_REQUEST.into_response());
    }
    if query.get("api-version").map(String::as_str) != Some(version) {
        return Some(StatusCode::BAD_REQUEST.into_response());
    }
    None
}

async fn azure_events(
    State(az): State<Arc<Azure>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    method: axum::http::Method,
    body: Bytes,
) -> Response {
    if let Some(bad) = azure_checks(&headers, &query, "2020-07-01") {
        return bad;
    }
    if method == axum::http::Method::POST {
        az.posts
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(&body).into_owned());
        return StatusCode::OK.into_response();
    }
    if az.event_gets.fetch_add(1, Ordering::SeqCst) == 0 {
        let delay = *az.first_delay.lock().unwrap();
        tokio::time::sleep(delay).await;
    }
    let doc = az.events.lock().unwrap().clone();
    axum::Json(doc).into_response()
}

async fn azure_name(
    State(az): State<Arc<Azure>>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if let Some(bad) = azure_checks(&headers, &query, "2021-02-01") {
        return bad;
    }
    if query.get("format").map(String::as_str) != Some("text") {
        return StatusCode::BAD_REQUEST.into_response();
    }
    az.name_hits.fetch_add(1, Ordering::SeqCst);
    match az.name.lock().unwrap().clone() {
        Some(n) => n.into_response(),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn azure_server(az: Arc<Azure>) -> Url {
    let router = Router::new()
        .route("/metadata/scheduledevents", any(azure_events))
        .route("/metadata/instance/compute/name", get(azure_name))
        .with_state(az);
    serve(router).await
}

fn azure_event(id: &str, kind: &str, resources: &[&str], not_before: &str) -> serde_json::Value {
    serde_json::json!({
        "EventId": id, "EventType": kind, "ResourceType": "VirtualMachine",
        "Resources": resources, "EventStatus": "Scheduled", "NotBefore": not_before,
        "Description": "test event", "EventSource": "Platform", "DurationInSeconds": -1
    })
}

fn azure_doc(events: Vec<serde_json::Value>) -> serde_json::Value {
    serde_json::json!({"DocumentIncarnation": 1, "Events": events})
}

fn azure_source(base: Url, vm_name: Option<&str>) -> AzureScheduledEvents {
    let (_r, m) = metrics();
    let cfg = AzureConfig::new(
        Some(base),
        Duration::from_millis(50),
        vm_name.map(str::to_string),
    );
    AzureScheduledEvents::new(cfg, m).unwrap()
}

// ---------------------------------------------------------------- Azure tests

#[tokio::test]
async fn azure_reports_only_this_vms_events() {
    let az = Arc::new(Azure::default());
    *az.name.lock().unwrap() = Some("vm-a\n".into());
    *az.events.lock().unwrap() = azure_doc(vec![
        azure_event("E1", "Preempt", &["vm-a"], "Mon, 19 Sep 2016 18:29:47 GMT"),
        azure_event("E2", "Reboot", &["vm-b"], "Mon, 19 Sep 2016 18:29:47 GMT"),
        azure_event("E3", "Freeze", &["vm-b", "VM-A"], ""),
    ]);
    let src = azure_source(azure_server(az.clone()).await, None);
    let notices = src.poll().await.unwrap();
    assert_eq!(
        kinds(&notices),
        vec![NoticeKind::Interruption, NoticeKind::Maintenance]
    );
    assert_eq!(notices[0].id, "E1");
    assert_eq!(
        notices[0].deadline,
        Some("2016-09-19T18:29:47Z".parse().unwrap())
    );
    assert_eq!(notices[1].id, "E3");
    src.poll().await.unwrap();
    assert_eq!(az.name_hits.load(Ordering::SeqCst), 1, "VM name read once");
}

#[tokio::test]
async fn azure_configured_vm_name_skips_imds_lookup() {
    let az = Arc::new(Azure::default());
    *az.events.lock().unwrap() = azure_doc(vec![azure_event("E1", "Redeploy", &["mine"], "")]);
    let src = azure_source(azure_server(az.clone()).await, Some("mine"));
    let notices = src.poll().await.unwrap();
    assert_eq!(kinds(&notices), vec![NoticeKind::Maintenance]);
    assert!(notices[0].restart);
    assert_eq!(az.name_hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn azure_unknown_vm_name_fails_the_poll() {
    let az = Arc::new(Azure::default());
    *az.events.lock().unwrap() = azure_doc(vec![azure_event("E1", "Preempt", &["x"], "")]);
    let src = azure_source(azure_server(az).await, None);
    let err = src.poll().await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 500, .. }), "{err}");
}

#[tokio::test]
async fn azure_disappeared_event_is_cancelled_unless_acknowledged() {
    let az = Arc::new(Azure::default());
    *az.events.lock().unwrap() = azure_doc(vec![
        azure_event("E1", "Freeze", &["vm"], "Mon, 19 Sep 2016 18:29:47 GMT"),
        azure_event("E2", "Reboot", &["vm"], "Mon, 19 Sep 2016 18:29:47 GMT"),
    ]);
    let src = azure_source(azure_server(az.clone()).await, Some("vm"));
    let notices = src.poll().await.unwrap();
    assert_eq!(notices.len(), 2);
    src.acknowledge(&notices[1]).await.unwrap();
    let posts = az.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 1);
    let body: serde_json::Value = serde_json::from_str(&posts[0]).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"StartRequests": [{"EventId": "E2"}]})
    );
    // Both events go away: E1 was not approved (cancelled), E2 was (started, expected).
    *az.events.lock().unwrap() = azure_doc(vec![]);
    let after = src.poll().await.unwrap();
    assert_eq!(kinds(&after), vec![NoticeKind::Cancelled("E1".into())]);
    assert!(src.poll().await.unwrap().is_empty(), "cancelled once");
}

#[tokio::test]
async fn azure_first_request_gets_the_long_timeout() {
    let az = Arc::new(Azure::default());
    *az.first_delay.lock().unwrap() = Duration::from_millis(800);
    *az.events.lock().unwrap() = azure_doc(vec![]);
    let (_r, m) = metrics();
    let mut cfg = AzureConfig::new(
        Some(azure_server(az).await),
        Duration::from_millis(50),
        Some("vm".into()),
    );
    cfg.request_timeout = Duration::from_millis(200);
    cfg.first_request_timeout = Duration::from_secs(10);
    let src = AzureScheduledEvents::new(cfg, m).unwrap();
    assert!(src.poll().await.unwrap().is_empty());
}

// ---------------------------------------------------------------- monitor

fn fast_policy() -> MonitorPolicy {
    MonitorPolicy {
        backoff_base: Duration::from_millis(50),
        backoff_cap: Duration::from_millis(200),
        ..MonitorPolicy::default()
    }
}

#[tokio::test]
async fn monitor_backs_off_counts_errors_and_recovers() {
    let fail = (500, "boom");
    let imds = Arc::new(
        Imds::new(true)
            .script(
                ACTION,
                &[
                    fail,
                    fail,
                    fail,
                    (
                        200,
                        r#"{"action":"terminate","time":"2030-01-01T00:02:00Z"}"#,
                    ),
                ],
            )
            .script(REBALANCE, &[fail, fail, fail, (404, "")])
            .script(SCHEDULED, &[fail, fail, fail, (200, "[]")]),
    );
    let (_r, m) = metrics();
    let src: Arc<dyn NoticeSource> =
        Arc::new(ec2(imds_server(imds.clone()).await, false, m.clone()));
    let health = Arc::new(PollHealth::new());
    let (tx, mut rx) = mpsc::channel(8);
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let task = tokio::spawn(run_monitor_with(
        src,
        tx,
        m.clone(),
        health.clone(),
        cancel.clone(),
        fast_policy(),
    ));
    let notice = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("notice after recovery")
        .unwrap();
    assert_eq!(notice.kind, NoticeKind::Interruption);
    // Three failed polls waited at least 25 + 50 + 100 ms (jitter keeps half of each step).
    assert!(
        started.elapsed() >= Duration::from_millis(175),
        "{:?}",
        started.elapsed()
    );
    assert!(imds.hits(ACTION) >= 4);
    assert_eq!(
        errors(&m, "aws", "status"),
        9,
        "every failed path request is counted once"
    );
    assert!(polls(&m, "aws") >= 1);
    assert!(health.ready(Instant::now()));
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn monitor_is_not_ready_while_every_poll_fails() {
    let imds = Arc::new(Imds::new(false));
    *imds.token_status.lock().unwrap() = 500;
    let (_r, m) = metrics();
    let src: Arc<dyn NoticeSource> =
        Arc::new(ec2(imds_server(imds.clone()).await, false, m.clone()));
    let health = Arc::new(PollHealth::new());
    let (tx, _rx) = mpsc::channel(8);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_monitor_with(
        src,
        tx,
        m.clone(),
        health.clone(),
        cancel.clone(),
        fast_policy(),
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!health.ready(Instant::now()));
    let failed = errors(&m, "aws", "token");
    assert!(
        (2..=8).contains(&failed),
        "backoff bounds the retries: {failed}"
    );
    assert_eq!(polls(&m, "aws"), 0);
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn monitor_cancellation_interrupts_a_hanging_get() {
    let gce = Arc::new(quiet_gce());
    let (_r, m) = metrics();
    let src: Arc<dyn NoticeSource> = Arc::new(gce_source(
        gce_server(gce.clone()).await,
        m.clone(),
        GceMetrics::default(),
    ));
    let health = Arc::new(PollHealth::new());
    let (tx, _rx) = mpsc::channel(8);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_monitor(
        src,
        tx,
        m.clone(),
        health.clone(),
        cancel.clone(),
    ));
    // Wait until the monitor hangs on the watch of `preempted`.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gce
        .requests(PREEMPTED)
        .iter()
        .any(|q| q.contains_key("wait_for_change"))
    {
        assert!(Instant::now() < deadline, "monitor never started watching");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        health.ready(Instant::now()),
        "a hanging GET in progress is healthy"
    );
    assert!(!task.is_finished());
    let cancelled_at = Instant::now();
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .expect("monitor stops promptly")
        .unwrap();
    assert!(cancelled_at.elapsed() < Duration::from_secs(2));
    assert!(polls(&m, "gce") >= 3);
}

#[tokio::test]
async fn monitor_forwards_gce_change_with_low_latency() {
    let gce = Arc::new(quiet_gce());
    let (_r, m) = metrics();
    let src: Arc<dyn NoticeSource> = Arc::new(gce_source(
        gce_server(gce.clone()).await,
        m.clone(),
        GceMetrics::default(),
    ));
    let health = Arc::new(PollHealth::new());
    let (tx, mut rx) = mpsc::channel(8);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_monitor(src, tx, m, health, cancel.clone()));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gce
        .requests(PREEMPTED)
        .iter()
        .any(|q| q.contains_key("wait_for_change"))
    {
        assert!(Instant::now() < deadline, "monitor never started watching");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let changed_at = Instant::now();
    gce.set(PREEMPTED, Val::Value("TRUE".into()));
    let notice = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    let latency = changed_at.elapsed();
    assert_eq!(notice.kind, NoticeKind::Interruption);
    assert!(latency < Duration::from_secs(2), "{latency:?}");
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), task)
        .await
        .unwrap()
        .unwrap();
}

// ---------------------------------------------------------------- detection by probing

async fn gce_identity(headers: HeaderMap) -> Response {
    if headers.get("metadata-flavor").and_then(|v| v.to_str().ok()) != Some("Google") {
        return StatusCode::FORBIDDEN.into_response();
    }
    ([("metadata-flavor", "Google")], "4520031799277581759").into_response()
}

async fn azure_vm_id(headers: HeaderMap, Query(query): Query<HashMap<String, String>>) -> Response {
    if azure_checks(&headers, &query, "2021-02-01").is_some() {
        return StatusCode::BAD_REQUEST.into_response();
    }
    "02aab8a4-74ef-476e-8182-f6d2ba4166a6".into_response()
}

fn no_dmi() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("sys_vendor"), "QEMU\n").unwrap();
    dir
}

#[tokio::test]
async fn detect_probes_each_metadata_service_with_its_headers() {
    let dmi = no_dmi();
    let aws = imds_server(Arc::new(Imds::new(true))).await;
    let gce =
        serve(Router::new().route("/computeMetadata/v1/instance/id", get(gce_identity))).await;
    let azure =
        serve(Router::new().route("/metadata/instance/compute/vmId", get(azure_vm_id))).await;
    // A server that answers nothing useful (404 everywhere) stands in for the other clouds.
    let nothing = serve(Router::new()).await;
    let timeout = Duration::from_secs(5);
    let probe = |aws: &Url, gce: &Url, azure: &Url| {
        ProbeEndpoints::all(aws.clone())
            .with(Cloud::Gce, gce.clone())
            .with(Cloud::Azure, azure.clone())
    };
    let found = detect(dmi.path(), &probe(&aws, &nothing, &nothing), timeout)
        .await
        .unwrap();
    assert_eq!(found, Cloud::Aws);
    let found = detect(dmi.path(), &probe(&nothing, &gce, &nothing), timeout)
        .await
        .unwrap();
    assert_eq!(found, Cloud::Gce);
    let found = detect(dmi.path(), &probe(&nothing, &nothing, &azure), timeout)
        .await
        .unwrap();
    assert_eq!(found, Cloud::Azure);
    let err = detect(dmi.path(), &probe(&nothing, &nothing, &nothing), timeout)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("QEMU"), "{err}");
}

#[tokio::test]
async fn detect_gives_up_after_the_timeout() {
    let dmi = no_dmi();
    // Accepts connections and never answers.
    let hang = serve(Router::new().fallback(|| async {
        tokio::time::sleep(Duration::from_secs(60)).await;
        StatusCode::OK
    }))
    .await;
    let started = Instant::now();
    let err = detect(
        dmi.path(),
        &ProbeEndpoints::all(hang),
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Detect(_)));
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}
