//! The metadata emulator's wire protocols, faults and control surface, exercised with plain HTTP
//! (reqwest) against a started emulator on 127.0.0.1.

use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};
use spotguard::emulator::{
    self, Cloud, Ec2Action, EmulatedNotice, EmulatorConfig, EmulatorHandle, Fault, GceNoMaintenance,
};
use tokio_util::sync::CancellationToken;

fn client() -> Client {
    Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn start(cloud: Cloud) -> EmulatorHandle {
    start_with(EmulatorConfig::new(cloud)).await
}

async fn start_with(cfg: EmulatorConfig) -> EmulatorHandle {
    emulator::start(cfg).await.expect("emulator starts")
}

/// A started emulator and a client for it, in one line:
/// `let Emulated { em, c } = Emulated::start(Cloud::Aws).await;`.
struct Emulated {
    em: EmulatorHandle,
    c: Client,
}

impl Emulated {
    async fn start(cloud: Cloud) -> Emulated {
        Emulated::with(EmulatorConfig::new(cloud)).await
    }

    async fn with(cfg: EmulatorConfig) -> Emulated {
        Emulated {
            em: start_with(cfg).await,
            c: client(),
        }
    }
}

fn secs_until(ts: jiff::Timestamp) -> f64 {
    ts.duration_since(jiff::Timestamp::now()).as_secs_f64()
}

// === EC2 ===

async fn token(c: &Client, em: &EmulatorHandle) -> String {
    let resp = c
        .put(format!("{}/latest/api/token", em.base_url()))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "21600")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.text().await.unwrap()
}

async fn ec2_get(c: &Client, em: &EmulatorHandle, tok: &str, path: &str) -> (StatusCode, String) {
    let resp = c
        .get(format!("{}{path}", em.base_url()))
        .header("X-aws-ec2-metadata-token", tok)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.text().await.unwrap())
}

#[tokio::test]
async fn ec2_token_put_enforces_ttl_bounds_and_refuses_forwarded_requests() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let url = format!("{}/latest/api/token", em.base_url());
    for bad in ["0", "21601", "abc", "-5", ""] {
        let resp = c
            .put(&url)
            .header("X-aws-ec2-metadata-token-ttl-seconds", bad)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "ttl {bad:?}");
    }
    let resp = c.put(&url).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "missing ttl");
    let resp = c
        .put(&url)
        .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
        .header("X-Forwarded-For", "203.0.113.7")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);

    for ttl in ["1", "21600"] {
        let resp = c
            .put(&url)
            .header("X-aws-ec2-metadata-token-ttl-seconds", ttl)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(
            resp.headers()["x-aws-ec2-metadata-token-ttl-seconds"],
            ttl,
            "TTL echoed"
        );
        let tok = resp.text().await.unwrap();
        assert!(tok.len() > 40, "token {tok:?}");
    }
    em.shutdown().await;
}

#[tokio::test]
async fn ec2_gets_need_a_valid_unexpired_token_unless_imdsv1_is_allowed() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let url = format!("{}/latest/meta-data/instance-id", em.base_url());
    assert_eq!(
        c.get(&url).send().await.unwrap().status(),
        StatusCode::UNAUTHORIZED
    );
    let (status, _) = ec2_get(&c, &em, "not-a-token", "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let tok = token(&c, &em).await;
    let (status, body) = ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id").await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "i-0123456789abcdef0")
    );

    // A one-second token expires.
    let short = c
        .put(format!("{}/latest/api/token", em.base_url()))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "1")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let (status, _) = ec2_get(&c, &em, &short, "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::OK);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let (status, _) = ec2_get(&c, &em, &short, "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "expired token");
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::OK, "long token still valid");

    // The expire-tokens fault invalidates every token at once.
    em.fault(Fault::expire_tokens()).unwrap();
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "tokens expired by fault");
    em.shutdown().await;

    let mut cfg = EmulatorConfig::new(Cloud::Aws);
    cfg.allow_imds_v1 = true;
    let em = start_with(cfg).await;
    let url = format!("{}/latest/meta-data/instance-type", em.base_url());
    let resp = c.get(&url).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.text().await.unwrap(), "g5.xlarge");
    let (status, _) = ec2_get(&c, &em, "bogus", "/latest/meta-data/instance-type").await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "an invalid token is refused even with IMDSv1"
    );
    em.shutdown().await;
}

#[tokio::test]
async fn ec2_spot_instance_action_is_404_until_raised() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, listing) = ec2_get(&c, &em, &tok, "/latest/meta-data/").await;
    assert!(!listing.lines().any(|l| l == "spot/"), "{listing}");

    let raised = em.raise(EmulatedNotice::interruption()).unwrap();
    assert!(secs_until(raised.visible_at).abs() < 5.0);
    let (status, body) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["action"], "terminate");
    let time: jiff::Timestamp = v["time"].as_str().unwrap().parse().unwrap();
    let left = secs_until(time);
    assert!((100.0..=121.0).contains(&left), "deadline in {left}s");
    assert!(v["time"].as_str().unwrap().ends_with('Z'));
    let (status, tt) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/termination-time").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(tt, v["time"].as_str().unwrap());
    let (_, listing) = ec2_get(&c, &em, &tok, "/latest/meta-data").await;
    assert!(listing.lines().any(|l| l == "spot/"), "{listing}");

    // A stop notice has no legacy termination-time.
    em.raise(
        EmulatedNotice::interruption()
            .action(Ec2Action::Stop)
            .due_in(Duration::from_secs(30)),
    )
    .unwrap();
    let (_, body) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["action"], "stop");
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/termination-time").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    em.clear();
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/no/such/path").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    em.shutdown().await;
}

#[tokio::test]
async fn ec2_rebalance_recommendation_appears_when_raised() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    let path = "/latest/meta-data/events/recommendations/rebalance";
    assert_eq!(ec2_get(&c, &em, &tok, path).await.0, StatusCode::NOT_FOUND);
    em.raise(EmulatedNotice::rebalance()).unwrap();
    let (status, body) = ec2_get(&c, &em, &tok, path).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&body).unwrap();
    let at: jiff::Timestamp = v["noticeTime"].as_str().unwrap().parse().unwrap();
    assert!(secs_until(at).abs() < 5.0);
    let (_, events) = ec2_get(&c, &em, &tok, "/latest/meta-data/events/").await;
    assert_eq!(events, "maintenance/\nrecommendations/");
    em.shutdown().await;
}

#[tokio::test]
async fn ec2_scheduled_events_move_to_history_when_canceled() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    let scheduled = "/latest/meta-data/events/maintenance/scheduled";
    let history = "/latest/meta-data/events/maintenance/history";
    assert_eq!(ec2_get(&c, &em, &tok, scheduled).await.1, "[]");

    let raised = em
        .raise(
            EmulatedNotice::maintenance()
                .code("instance-stop")
                .due_in(Duration::from_secs(600)),
        )
        .unwrap();
    assert!(raised.id.starts_with("instance-event-"), "{}", raised.id);
    let (_, body) = ec2_get(&c, &em, &tok, scheduled).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let ev = &v[0];
    assert_eq!(ev["Code"], "instance-stop");
    assert_eq!(ev["State"], "active");
    assert_eq!(ev["EventId"], raised.id.as_str());
    assert_eq!(ev["Description"], "scheduled stop");
    let not_before = ev["NotBefore"].as_str().unwrap();
    let re = regex::Regex::new(r"^\d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$").unwrap();
    assert!(re.is_match(not_before), "{not_before}");
    assert!(re.is_match(ev["NotAfter"].as_str().unwrap()));
    let parsed = jiff::fmt::strtime::parse("%d %b %Y %H:%M:%S GMT", not_before)
        .unwrap()
        .to_datetime()
        .unwrap()
        .to_zoned(jiff::tz::TimeZone::UTC)
        .unwrap()
        .timestamp();
    let left = secs_until(parsed);
    assert!((580.0..=601.0).contains(&left), "NotBefore in {left}s");

    let ended = em.cancel(Some(&raised.id)).unwrap();
    assert_eq!(ended, vec![raised.id.clone()]);
    assert_eq!(ec2_get(&c, &em, &tok, scheduled).await.1, "[]");
    let (_, body) = ec2_get(&c, &em, &tok, history).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v[0]["State"], "canceled");
    assert_eq!(v[0]["Description"], "[Canceled] scheduled stop");

    // Interruptions have no cancellation on EC2.
    let itn = em.raise(EmulatedNotice::interruption()).unwrap();
    assert!(em.cancel(Some(&itn.id)).is_err());
    assert!(em.cancel(Some("instance-event-nope")).is_err());
    em.shutdown().await;

    // The ec2-metadata-mock shape: ended events stay in `scheduled`.
    let mut cfg = EmulatorConfig::new(Cloud::Aws);
    cfg.ec2_ended_events_in_scheduled = true;
    let em = start_with(cfg).await;
    let tok = token(&c, &em).await;
    let raised = em.raise(EmulatedNotice::maintenance()).unwrap();
    em.complete(None).unwrap();
    let (_, body) = ec2_get(&c, &em, &tok, scheduled).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v[0]["EventId"], raised.id.as_str());
    assert_eq!(v[0]["State"], "completed");
    assert_eq!(v[0]["Code"], "system-reboot");
    em.shutdown().await;
}

/// A malformed `NotBefore` beside a well-formed event, raised through the control endpoint (for
/// clients that must skip one bad event and keep the others).
#[tokio::test]
async fn ec2_scheduled_event_serves_a_raw_not_before_beside_normal_ones() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    let scheduled = "/latest/meta-data/events/maintenance/scheduled";
    let notice = format!("{}/spotguard/notice", em.base_url());
    let resp = c
        .post(&notice)
        .json(&json!({"kind": "maintenance", "event_id": "instance-event-bad", "not_before_raw": "sometime"}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap()
    );
    let good = em
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(600)))
        .unwrap();
    let (_, body) = ec2_get(&c, &em, &tok, scheduled).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2, "{body}");
    assert_eq!(v[0]["EventId"], "instance-event-bad");
    assert_eq!(v[0]["NotBefore"], "sometime");
    assert_eq!(v[0]["State"], "active");
    assert_eq!(v[0]["Code"], "system-reboot");
    assert!(v[0]["NotAfter"].is_string(), "NotAfter stays well-formed");
    assert_eq!(v[1]["EventId"], good.id.as_str());
    let re = regex::Regex::new(r"^\d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$").unwrap();
    assert!(re.is_match(v[1]["NotBefore"].as_str().unwrap()), "{body}");

    let state = em.state();
    assert_eq!(state["notices"][0]["not_before_raw"], "sometime");
    assert!(state["notices"][0]["deadline"].is_string());
    assert_eq!(state["notices"][1]["not_before_raw"], Value::Null);

    // The raw string follows the event into history.
    em.cancel(Some("instance-event-bad")).unwrap();
    let (_, body) = ec2_get(
        &c,
        &em,
        &tok,
        "/latest/meta-data/events/maintenance/history",
    )
    .await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v[0]["NotBefore"], "sometime", "{body}");
    assert_eq!(v[0]["State"], "canceled");

    // Only EC2 maintenance events have a NotBefore string to corrupt.
    let resp = c
        .post(&notice)
        .json(&json!({"kind": "interruption", "not_before_raw": "sometime"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    em.shutdown().await;
    for cloud in [Cloud::Gce, Cloud::Azure] {
        let em = start(cloud).await;
        let err = em
            .raise(EmulatedNotice::maintenance().not_before_raw("sometime"))
            .unwrap_err();
        assert_eq!(err.metric_label(), "unsupported_field", "{cloud}: {err}");
        em.shutdown().await;
    }
}

// === GCE ===

async fn gce_get(c: &Client, em: &EmulatorHandle, path_and_query: &str) -> reqwest::Response {
    c.get(format!(
        "{}/computeMetadata/v1/{path_and_query}",
        em.base_url()
    ))
    .header("Metadata-Flavor", "Google")
    .send()
    .await
    .unwrap()
}

fn etag(resp: &reqwest::Response) -> String {
    resp.headers()["etag"].to_str().unwrap().to_owned()
}

#[tokio::test]
async fn gce_requires_metadata_flavor_and_refuses_forwarded_requests() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let url = format!("{}/computeMetadata/v1/instance/preempted", em.base_url());
    assert_eq!(
        c.get(&url).send().await.unwrap().status(),
        StatusCode::FORBIDDEN
    );
    let resp = c
        .get(&url)
        .header("Metadata-Flavor", "google")
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::FORBIDDEN,
        "value is case-sensitive"
    );
    let resp = c
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .header("X-Forwarded-For", "203.0.113.7")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::FORBIDDEN);

    let resp = gce_get(&c, &em, "instance/preempted").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["metadata-flavor"], "Google");
    assert_eq!(etag(&resp).len(), 16);
    assert_eq!(resp.text().await.unwrap(), "FALSE");
    let resp = gce_get(&c, &em, "instance/name").await;
    assert_eq!(resp.text().await.unwrap(), "spotguard-vm");
    let resp = gce_get(&c, &em, "instance/zone").await;
    assert_eq!(
        resp.text().await.unwrap(),
        "projects/123456789012/zones/us-central1-a"
    );
    let resp = gce_get(&c, &em, "instance/preempted?alt=json").await;
    assert_eq!(resp.text().await.unwrap(), "\"FALSE\"");
    assert_eq!(
        gce_get(&c, &em, "instance/nope").await.status(),
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        gce_get(&c, &em, "instance/preempted?wait_for_change=maybe")
            .await
            .status(),
        StatusCode::BAD_REQUEST
    );
    em.shutdown().await;
}

#[tokio::test]
async fn gce_hanging_get_blocks_until_the_value_changes() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let first = gce_get(&c, &em, "instance/preempted").await;
    let e0 = etag(&first);

    let url = format!("instance/preempted?wait_for_change=true&last_etag={e0}&timeout_sec=60");
    let waiter = {
        let c = c.clone();
        let base = em.base_url();
        tokio::spawn(async move {
            let started = Instant::now();
            let resp = c
                .get(format!("{base}/computeMetadata/v1/{url}"))
                .header("Metadata-Flavor", "Google")
                .send()
                .await
                .unwrap();
            let tag = etag(&resp);
            (started.elapsed(), tag, resp.text().await.unwrap())
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !waiter.is_finished(),
        "hanging GET answered before any change"
    );
    em.raise(EmulatedNotice::interruption()).unwrap();
    let (elapsed, e1, body) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("hanging GET released by the change")
        .unwrap();
    assert_eq!(body, "TRUE");
    assert_ne!(e1, e0);
    assert!(elapsed >= Duration::from_millis(600), "{elapsed:?}");

    // A stale etag answers at once.
    let started = Instant::now();
    let resp = gce_get(
        &c,
        &em,
        &format!("instance/preempted?wait_for_change=true&last_etag={e0}&timeout_sec=60"),
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(etag(&resp), e1);
    assert_eq!(resp.text().await.unwrap(), "TRUE");
    em.shutdown().await;
}

#[tokio::test]
async fn gce_hanging_get_times_out_with_the_same_value_and_etag() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let e0 = etag(&gce_get(&c, &em, "instance/maintenance-event").await);
    let started = Instant::now();
    let resp = gce_get(
        &c,
        &em,
        &format!("instance/maintenance-event?wait_for_change=true&last_etag={e0}&timeout_sec=1"),
    )
    .await;
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(900), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(15), "{elapsed:?}");
    assert_eq!(etag(&resp), e0);
    assert_eq!(resp.text().await.unwrap(), "NONE");

    // Without last_etag the request waits for the next change.
    let waiter = {
        let c = c.clone();
        let base = em.base_url();
        tokio::spawn(async move {
            c.get(format!(
                "{base}/computeMetadata/v1/instance/maintenance-event?wait_for_change=true"
            ))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiter.is_finished());
    em.raise(EmulatedNotice::maintenance()).unwrap();
    let body = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(body, "TERMINATE_ON_HOST_MAINTENANCE");
    em.shutdown().await;
}

#[tokio::test]
async fn gce_many_concurrent_hanging_gets_are_released_by_one_change() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let e0 = etag(&gce_get(&c, &em, "instance/preempted").await);
    let mut waiters = Vec::new();
    for _ in 0..200 {
        let c = c.clone();
        let url = format!(
            "{}/computeMetadata/v1/instance/preempted?wait_for_change=true&last_etag={e0}",
            em.base_url()
        );
        waiters.push(tokio::spawn(async move {
            c.get(url)
                .header("Metadata-Flavor", "Google")
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap()
        }));
    }
    // Every waiter is parked before the change.
    let deadline = Instant::now() + Duration::from_secs(20);
    while em.requests("/computeMetadata/v1/instance/preempted") < 201 {
        assert!(Instant::now() < deadline, "waiters never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(waiters.iter().all(|w| !w.is_finished()));
    em.raise(EmulatedNotice::interruption()).unwrap();
    for w in waiters {
        let body = tokio::time::timeout(Duration::from_secs(20), w)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(body, "TRUE");
    }
    em.shutdown().await;
}

#[tokio::test]
async fn gce_upcoming_maintenance_window_and_its_absent_forms() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let resp = gce_get(&c, &em, "instance/upcoming-maintenance?alt=json").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.text().await.unwrap(), "{}");

    em.raise(
        EmulatedNotice::maintenance()
            .due_in(Duration::from_secs(3600))
            .duration(Duration::from_secs(1800))
            .reason("FAILURE_GPU_XID"),
    )
    .unwrap();
    let resp = gce_get(&c, &em, "instance/upcoming-maintenance?alt=json").await;
    assert_eq!(resp.headers()["content-type"], "application/json");
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["maintenance_status"], "PENDING");
    assert_eq!(v["type"], "SCHEDULED");
    assert_eq!(v["can_reschedule"], "false");
    assert_eq!(v["maintenance_reasons"], json!(["FAILURE_GPU_XID"]));
    let start: jiff::Timestamp = v["window_start_time"].as_str().unwrap().parse().unwrap();
    let end: jiff::Timestamp = v["window_end_time"].as_str().unwrap().parse().unwrap();
    assert!((3580.0..=3601.0).contains(&secs_until(start)));
    assert_eq!(end.duration_since(start).as_secs(), 1800);
    assert_eq!(
        gce_get(&c, &em, "instance/maintenance-event")
            .await
            .text()
            .await
            .unwrap(),
        "TERMINATE_ON_HOST_MAINTENANCE"
    );

    em.cancel(None).unwrap();
    assert_eq!(
        gce_get(&c, &em, "instance/maintenance-event")
            .await
            .text()
            .await
            .unwrap(),
        "NONE"
    );
    assert_eq!(
        gce_get(&c, &em, "instance/upcoming-maintenance?alt=json")
            .await
            .text()
            .await
            .unwrap(),
        "{}"
    );
    // GCE has no rebalance recommendation.
    assert!(em.raise(EmulatedNotice::rebalance()).is_err());
    em.shutdown().await;

    let mut cfg = EmulatorConfig::new(Cloud::Gce);
    cfg.gce_no_maintenance = GceNoMaintenance::NotFound;
    let em = start_with(cfg).await;
    assert_eq!(
        gce_get(&c, &em, "instance/upcoming-maintenance?alt=json")
            .await
            .status(),
        StatusCode::NOT_FOUND
    );
    em.raise(EmulatedNotice::maintenance().code("MIGRATE_ON_HOST_MAINTENANCE"))
        .unwrap();
    assert_eq!(
        gce_get(&c, &em, "instance/upcoming-maintenance?alt=json")
            .await
            .status(),
        StatusCode::OK
    );
    assert_eq!(
        gce_get(&c, &em, "instance/maintenance-event")
            .await
            .text()
            .await
            .unwrap(),
        "MIGRATE_ON_HOST_MAINTENANCE"
    );
    em.shutdown().await;
}

// === Azure ===

const SE: &str = "/metadata/scheduledevents?api-version=2020-07-01";

async fn azure_doc(c: &Client, em: &EmulatorHandle) -> Value {
    let resp = c
        .get(format!("{}{SE}", em.base_url()))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.unwrap()
}

async fn azure_ack(c: &Client, em: &EmulatorHandle, body: &str) -> StatusCode {
    c.post(format!("{}{SE}", em.base_url()))
        .header("Metadata", "true")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn azure_requires_metadata_header_and_a_known_api_version() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    let base = em.base_url();
    let resp = c.get(format!("{base}{SE}")).send().await.unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::BAD_REQUEST,
        "missing Metadata header"
    );
    let resp = c
        .get(format!("{base}{SE}"))
        .header("Metadata", "true")
        .header("X-Forwarded-For", "203.0.113.7")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "X-Forwarded-For");
    for q in ["", "?api-version=2099-01-01", "?api-version=latest"] {
        let resp = c
            .get(format!("{base}/metadata/scheduledevents{q}"))
            .header("Metadata", "true")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{q:?}");
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"].as_str().unwrap().contains("api-version"));
        assert_eq!(v["newest-versions"][0], "2020-07-01");
    }

    let name = |q: &'static str| {
        let c = c.clone();
        let base = base.clone();
        async move {
            let resp = c
                .get(format!("{base}/metadata/instance/compute/name{q}"))
                .header("Metadata", "true")
                .send()
                .await
                .unwrap();
            (resp.status(), resp.text().await.unwrap())
        }
    };
    assert_eq!(
        name("?api-version=2021-02-01&format=text").await,
        (StatusCode::OK, "spotguard-vm".to_owned())
    );
    assert_eq!(
        name("?api-version=2021-02-01").await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(name("?format=text").await.0, StatusCode::BAD_REQUEST);
    em.shutdown().await;
}

#[tokio::test]
async fn azure_events_carry_the_documented_fields_and_bump_the_incarnation() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc, json!({"DocumentIncarnation": 1, "Events": []}));

    let mine = em.raise(EmulatedNotice::interruption()).unwrap();
    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc["DocumentIncarnation"], 2);
    let ev = &doc["Events"][0];
    assert_eq!(ev["EventId"], mine.id.as_str());
    assert_eq!(ev["EventType"], "Preempt");
    assert_eq!(ev["EventStatus"], "Scheduled");
    assert_eq!(ev["ResourceType"], "VirtualMachine");
    assert_eq!(ev["Resources"], json!(["spotguard-vm"]));
    assert_eq!(ev["EventSource"], "Platform");
    assert_eq!(ev["DurationInSeconds"], -1);
    assert!(ev["Description"].as_str().is_some());
    // RFC 1123 / IMF-fixdate, as Azure writes it: "Mon, 19 Sep 2016 18:29:47 GMT".
    let raw = ev["NotBefore"].as_str().unwrap();
    let imf =
        regex::Regex::new(r"^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$")
            .unwrap();
    assert!(imf.is_match(raw), "{raw}");
    let not_before = jiff::fmt::rfc2822::DateTimeParser::new()
        .parse_timestamp(raw)
        .unwrap();
    let left = not_before
        .duration_since(jiff::Timestamp::now())
        .as_secs_f64()
        .max(0.0);
    assert!((20.0..=31.0).contains(&left), "NotBefore in {left}s");
    let guid = regex::Regex::new(r"^[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}$")
        .unwrap();
    assert!(guid.is_match(&mine.id), "{}", mine.id);

    // An event for another VM of the availability set: clients must filter on Resources.
    em.raise(
        EmulatedNotice::maintenance()
            .code("Redeploy")
            .target("other-vm")
            .event_id("OTHER-EVENT"),
    )
    .unwrap();
    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc["DocumentIncarnation"], 3);
    let other = doc["Events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["EventId"] == "OTHER-EVENT")
        .unwrap();
    assert_eq!(other["Resources"], json!(["other-vm"]));
    assert_eq!(other["EventType"], "Redeploy");

    // Reading does not change the incarnation; cancelling removes the event.
    assert_eq!(azure_doc(&c, &em).await["DocumentIncarnation"], 3);
    em.cancel(Some("OTHER-EVENT")).unwrap();
    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc["DocumentIncarnation"], 4);
    assert_eq!(doc["Events"].as_array().unwrap().len(), 1);

    // Older API versions lack the newer fields.
    let resp = c
        .get(format!(
            "{}/metadata/scheduledevents?api-version=2019-01-01",
            em.base_url()
        ))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    let old: Value = resp.json().await.unwrap();
    let ev = &old["Events"][0];
    assert!(ev.get("Description").is_none() && ev.get("DurationInSeconds").is_none());
    assert_eq!(ev["EventType"], "Preempt");
    em.shutdown().await;
}

#[tokio::test]
async fn azure_start_requests_are_recorded_and_start_then_finish_the_event() {
    let mut cfg = EmulatorConfig::new(Cloud::Azure);
    cfg.azure_started_for = Duration::from_secs(1);
    let Emulated { em, c } = Emulated::with(cfg).await;
    let raised = em
        .raise(EmulatedNotice::maintenance().due_in(Duration::from_secs(900)))
        .unwrap();
    let inc = azure_doc(&c, &em).await["DocumentIncarnation"]
        .as_u64()
        .unwrap();

    assert_eq!(
        azure_ack(&c, &em, "{\"StartRequests\": [").await,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        azure_ack(&c, &em, r#"{"StartRequests": [{"EventId": "NOPE"}]}"#).await,
        StatusCode::BAD_REQUEST
    );
    assert!(em.azure_acks().is_empty());
    let body = json!({"StartRequests": [{"EventId": raised.id}]}).to_string();
    assert_eq!(azure_ack(&c, &em, &body).await, StatusCode::OK);
    assert_eq!(em.azure_acks(), vec![raised.id.clone()]);

    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc["DocumentIncarnation"].as_u64().unwrap(), inc + 1);
    assert_eq!(doc["Events"][0]["EventStatus"], "Started");
    assert_eq!(doc["Events"][0]["NotBefore"], "");
    // Approving a started event again is still a 200.
    assert_eq!(azure_ack(&c, &em, &body).await, StatusCode::OK);

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let doc = azure_doc(&c, &em).await;
        if doc["Events"].as_array().unwrap().is_empty() {
            assert_eq!(doc["DocumentIncarnation"].as_u64().unwrap(), inc + 2);
            break;
        }
        assert!(Instant::now() < deadline, "started event never finished");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let state = em.state();
    assert_eq!(state["azure"]["acks"], json!([raised.id, raised.id]));
    em.shutdown().await;
}

#[tokio::test]
async fn azure_event_starts_by_itself_when_not_before_passes() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    em.raise(EmulatedNotice::interruption().due_in(Duration::from_secs(1)))
        .unwrap();
    assert_eq!(
        azure_doc(&c, &em).await["Events"][0]["EventStatus"],
        "Scheduled"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while azure_doc(&c, &em).await["Events"][0]["EventStatus"] != "Started" {
        assert!(Instant::now() < deadline, "event never started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(em.azure_acks().is_empty(), "started without an ack");
    em.shutdown().await;
}

// === Faults ===

#[tokio::test]
async fn error_fault_answers_n_times_then_recovers_and_spares_the_control_endpoint() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    em.fault(Fault::error(503).times(2)).unwrap();
    let state = c
        .get(format!("{}/spotguard/state", em.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(state.status(), StatusCode::OK);
    let state: Value = state.json().await.unwrap();
    assert_eq!(state["faults"][0]["kind"], "error");
    assert_eq!(state["faults"][0]["count"], 2);
    for _ in 0..2 {
        let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
    let (status, _) = ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(em.requests("/latest/meta-data/instance-id"), 3);
    em.shutdown().await;
}

#[tokio::test]
async fn path_scoped_fault_hits_only_its_prefix() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    em.fault(Fault::error(500).on_path("/latest/meta-data/spot/"))
        .unwrap();
    let tok = token(&c, &em).await;
    assert_eq!(
        ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action")
            .await
            .0,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        ec2_get(&c, &em, &tok, "/latest/meta-data/instance-id")
            .await
            .0,
        StatusCode::OK
    );
    em.fault(Fault::clear()).unwrap();
    assert_eq!(
        ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action")
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    em.shutdown().await;
}

#[tokio::test]
async fn stall_fault_holds_the_request() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    em.fault(Fault::stall(Duration::from_millis(1200)).times(1))
        .unwrap();
    let started = Instant::now();
    let resp = gce_get(&c, &em, "instance/preempted").await;
    assert!(
        started.elapsed() >= Duration::from_millis(1100),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(resp.text().await.unwrap(), "FALSE");
    em.shutdown().await;
}

#[tokio::test]
async fn drop_fault_closes_the_connection_without_an_answer() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    em.fault(Fault::drop_connections().times(1)).unwrap();
    let err = c
        .get(format!("{}{SE}", em.base_url()))
        .header("Metadata", "true")
        .send()
        .await
        .expect_err("dropped connection");
    assert!(!err.is_status() && !err.is_timeout(), "{err:?}");
    assert_eq!(azure_doc(&c, &em).await["DocumentIncarnation"], 1);
    em.shutdown().await;
}

#[tokio::test]
async fn garbage_fault_answers_200_with_a_malformed_body() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    em.fault(Fault::garbage().times(1)).unwrap();
    let resp = gce_get(&c, &em, "instance/preempted").await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["metadata-flavor"], "Google");
    let body = resp.text().await.unwrap();
    assert!(body != "TRUE" && body != "FALSE");
    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
    assert_eq!(
        gce_get(&c, &em, "instance/preempted")
            .await
            .text()
            .await
            .unwrap(),
        "FALSE"
    );
    em.shutdown().await;

    let em = start(Cloud::Aws).await;
    let tok = token(&c, &em).await;
    em.raise(EmulatedNotice::interruption()).unwrap();
    em.fault(Fault::garbage().times(1)).unwrap();
    let (status, body) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
    assert_eq!(status, StatusCode::OK);
    assert!(serde_json::from_str::<Value>(&body).is_err(), "{body}");
    em.shutdown().await;
}

#[tokio::test]
async fn down_fault_refuses_connections_until_it_ends() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    assert_eq!(azure_doc(&c, &em).await["DocumentIncarnation"], 1);
    em.fault(Fault::down().lasting(Duration::from_millis(1500)))
        .unwrap();
    // The listener is closed and pooled keep-alive connections are cut.
    let mut refused = false;
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline && !refused {
        refused = c
            .get(format!("{}{SE}", em.base_url()))
            .header("Metadata", "true")
            .send()
            .await
            .is_err_and(|e| e.is_connect() || e.is_request());
    }
    assert!(refused, "no request failed while down");
    let fresh = client();
    let err = fresh
        .get(format!("{}{SE}", em.base_url()))
        .header("Metadata", "true")
        .send()
        .await;
    if Instant::now() < deadline {
        assert!(
            err.is_err_and(|e| e.is_connect()),
            "fresh connection refused while down"
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match fresh
            .get(format!("{}{SE}", em.base_url()))
            .header("Metadata", "true")
            .send()
            .await
        {
            Ok(resp) if resp.status() == StatusCode::OK => break,
            _ => {
                assert!(Instant::now() < deadline, "listener never came back");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    em.shutdown().await;
}

#[tokio::test]
async fn faults_over_http_round_trip_and_bad_ones_are_rejected() {
    let Emulated { em, c } = Emulated::start(Cloud::Aws).await;
    let url = format!("{}/spotguard/fault", em.base_url());
    let post = |body: Value| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let resp = c.post(url).json(&body).send().await.unwrap();
            (resp.status(), resp.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = post(json!({"kind": "error", "status": 502, "for": "30s"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["faults"][0]["status"], 502);
    let resp = c
        .put(format!("{}/latest/api/token", em.base_url()))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_GATEWAY);
    for bad in [
        json!({"kind": "down"}),
        json!({"kind": "error", "status": 200}),
        json!({"kind": "stall"}),
        json!({"kind": "drop", "cout": 2}),
        json!({"kind": "explode"}),
        json!({"kind": "drop", "count": 0}),
    ] {
        let (status, v) = post(bad.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad} -> {v}");
        assert!(v["error"].is_string());
    }
    let (status, v) = post(json!({"kind": "clear"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["faults"], json!([]));
    assert!(!token(&c, &em).await.is_empty());

    // `down` over HTTP is answered before the listener closes, and needs a duration.
    let (status, _) = post(json!({"kind": "down", "for": "1500ms"})).await;
    assert_eq!(status, StatusCode::OK);
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut refused = false;
    while Instant::now() < deadline && !refused {
        refused = client()
            .get(format!("{}/latest/meta-data/", em.base_url()))
            .send()
            .await
            .is_err_and(|e| e.is_connect());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(refused, "listener never refused while down");
    let deadline = Instant::now() + Duration::from_secs(20);
    while client()
        .get(format!("{}/spotguard/state", em.base_url()))
        .send()
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "listener never came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    em.shutdown().await;
}

// === Control surface ===

#[tokio::test]
async fn control_endpoint_raises_cancels_and_clears_over_http() {
    let Emulated { em, c } = Emulated::start(Cloud::Azure).await;
    let notice = format!("{}/spotguard/notice", em.base_url());
    let post = |body: Value| {
        let c = c.clone();
        let url = notice.clone();
        async move {
            let resp = c.post(url).json(&body).send().await.unwrap();
            (resp.status(), resp.json::<Value>().await.unwrap())
        }
    };
    let (status, v) =
        post(json!({"kind": "interruption", "in": "45s", "code": "Terminate", "target": "vm-7"}))
            .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let id = v["id"].as_str().unwrap().to_owned();
    let visible: jiff::Timestamp = v["visible_at"].as_str().unwrap().parse().unwrap();
    assert!(secs_until(visible).abs() < 5.0);
    let doc = azure_doc(&c, &em).await;
    assert_eq!(doc["Events"][0]["EventType"], "Terminate");
    assert_eq!(doc["Events"][0]["Resources"], json!(["vm-7"]));

    let (status, v) = post(json!({"kind": "maintenance", "in": 60, "event_type": "Freeze", "duration": "5s", "event_id": "F1"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let doc = azure_doc(&c, &em).await;
    let freeze = &doc["Events"][1];
    assert_eq!(freeze["EventId"], "F1");
    assert_eq!(freeze["DurationInSeconds"], 5);

    let state: Value = c
        .get(format!("{}/spotguard/state", em.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(state["cloud"], "azure");
    assert_eq!(state["notices"].as_array().unwrap().len(), 2);
    assert_eq!(state["notices"][0]["id"], id.as_str());
    assert_eq!(state["notices"][0]["status"], "scheduled");
    assert_eq!(state["requests"]["/metadata/scheduledevents"], 2);

    let (status, v) = post(json!({"kind": "cancel", "event_id": "F1"})).await;
    assert_eq!((status, v), (StatusCode::OK, json!({"ended": ["F1"]})));
    assert_eq!(
        azure_doc(&c, &em).await["Events"].as_array().unwrap().len(),
        1
    );
    let (status, _) = post(json!({"kind": "clear"})).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(azure_doc(&c, &em).await["Events"], json!([]));

    for bad in [
        json!({"kind": "rebalance"}),
        json!({"kind": "interruption", "code": "Explode"}),
        json!({"kind": "interruption", "in": "soon"}),
        json!({"kind": "interruption", "colour": "red"}),
        json!({"kind": "cancel", "event_id": "missing"}),
        json!({"kind": "teleport"}),
        json!({"in": "5s"}),
    ] {
        let (status, v) = post(bad.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad} -> {v}");
    }
    let resp = c.request(Method::GET, notice.clone()).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    em.shutdown().await;
}

#[tokio::test]
async fn notice_after_raises_the_cloud_default_interruption() {
    let mut cfg = EmulatorConfig::new(Cloud::Aws);
    cfg.notice_after = Some(Duration::from_millis(300));
    let Emulated { em, c } = Emulated::with(cfg).await;
    let tok = token(&c, &em).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let (status, body) = ec2_get(&c, &em, &tok, "/latest/meta-data/spot/instance-action").await;
        if status == StatusCode::OK {
            break body;
        }
        assert!(Instant::now() < deadline, "no notice after --notice-after");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let v: Value = serde_json::from_str(&body).unwrap();
    let time: jiff::Timestamp = v["time"].as_str().unwrap().parse().unwrap();
    assert!((100.0..=121.0).contains(&secs_until(time)));
    em.shutdown().await;
}

#[tokio::test]
async fn serve_until_stops_on_cancel_and_shutdown_releases_hanging_gets() {
    let Emulated { em, c } = Emulated::start(Cloud::Gce).await;
    let base = em.base_url();
    let waiter = tokio::spawn({
        let c = c.clone();
        async move {
            c.get(format!(
                "{base}/computeMetadata/v1/instance/preempted?wait_for_change=true"
            ))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    tokio::time::timeout(Duration::from_secs(10), em.shutdown())
        .await
        .expect("shutdown does not wait for hanging GETs");
    let res = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap();
    assert!(res.is_err(), "hanging GET cut by shutdown");

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut cfg = EmulatorConfig::new(Cloud::Gce);
    cfg.listen = ([127, 0, 0, 1], port).into();
    let cancel = CancellationToken::new();
    let server = tokio::spawn(emulator::serve_until(cfg, cancel.clone()));
    let url = format!("http://127.0.0.1:{port}/computeMetadata/v1/instance/id");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match c.get(&url).header("Metadata-Flavor", "Google").send().await {
            Ok(resp) => {
                assert_eq!(resp.text().await.unwrap(), "4520031799277581759");
                break;
            }
            Err(_) => {
                assert!(Instant::now() < deadline, "serve_until never listened");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}
