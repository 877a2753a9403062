//! Webhook notifier against a real HTTP receiver on 127.0.0.1 (axum): body shape, template
//! rendering and escaping, retries, bounds, and that a slow receiver never blocks the caller.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use jiff::Timestamp;
use prometheus_client::registry::Registry;
use spotguard::metrics::{encode, Metrics};
use spotguard::webhook::{
    DryRunWebhook, Error, NotifyFields, Options, PlanOutcome, Preset, RetryPolicy, Webhook,
};

/// What the receiver does with the next request.
#[derive(Clone, Copy, Debug)]
enum Reply {
    Status(u16),
    /// Wait, then answer 200.
    Slow(Duration),
    /// Never answer.
    Hang,
    /// 302 to /elsewhere.
    Redirect,
}

#[derive(Clone, Debug)]
struct Seen {
    path: String,
    content_type: String,
    user_agent: String,
    authorization: String,
    dry_run_header: String,
    body: String,
}

#[derive(Default)]
struct Receiver {
    script: Mutex<VecDeque<Reply>>,
    /// Reply once the script is used up.
    then: Mutex<Option<Reply>>,
    seen: Mutex<Vec<Seen>>,
}

impl Receiver {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn hook(
    State(rx): State<Arc<Receiver>>,
    uri: Uri,
    headers: HeaderMap,
    body: String,
) -> Response {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    rx.seen.lock().unwrap().push(Seen {
        path: uri.path().to_string(),
        content_type: header("content-type"),
        user_agent: header("user-agent"),
        authorization: header("authorization"),
        dry_run_header: header("x-spotguard-dry-run"),
        body,
    });
    let next = rx.script.lock().unwrap().pop_front();
    let reply = next
        .or(*rx.then.lock().unwrap())
        .unwrap_or(Reply::Status(200));
    match reply {
        Reply::Status(code) => StatusCode::from_u16(code).unwrap().into_response(),
        Reply::Slow(d) => {
            tokio::time::sleep(d).await;
            StatusCode::OK.into_response()
        }
        Reply::Hang => {
            std::future::pending::<()>().await;
            StatusCode::OK.into_response()
        }
        Reply::Redirect => (StatusCode::FOUND, [("location", "/elsewhere")]).into_response(),
    }
}

/// Start a receiver with a script; returns its address.
async fn receiver(script: &[Reply], then: Option<Reply>) -> (SocketAddr, Arc<Receiver>) {
    let rx = Arc::new(Receiver::default());
    rx.script.lock().unwrap().extend(script.iter().copied());
    *rx.then.lock().unwrap() = then;
    let app = Router::new()
        .route("/hook/{*rest}", post(hook))
        .route("/elsewhere", post(hook))
        .with_state(rx.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, rx)
}

fn fields() -> NotifyFields {
    NotifyFields {
        node: "gpu-node-7".into(),
        instance: "i-0123456789abcdef0".into(),
        kind: "interruption".into(),
        source: "aws".into(),
        deadline: Some(Timestamp::now() + Duration::from_secs(120)),
        notice_id: "5e0c2a91d4b7f310".into(),
        detail: "terminate".into(),
        action: "checkpoint and drain".into(),
        outcome: None,
        host: false,
    }
}

fn fast_policy() -> RetryPolicy {
    RetryPolicy {
        attempts: 3,
        base_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(100),
        per_try_timeout: Duration::from_secs(5),
        total: Duration::from_secs(30),
    }
}

struct Setup {
    registry: Registry,
    metrics: Arc<Metrics>,
}

impl Setup {
    fn new() -> Self {
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::register(&mut registry));
        Setup { registry, metrics }
    }

    fn webhook(&self, url: String, template: Option<&str>, policy: RetryPolicy) -> Webhook {
        Webhook::with_policy(
            url,
            template.map(str::to_string),
            self.metrics.clone(),
            policy,
        )
        .unwrap()
    }

    fn count(&self, outcome: &str) -> u64 {
        let needle = format!("spotguard_webhook_total{{outcome=\"{outcome}\"}} ");
        encode(&self.registry)
            .lines()
            .find_map(|l| l.strip_prefix(&needle))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0)
    }

    fn errors(&self, label: &str) -> u64 {
        let needle = format!("spotguard_errors_total{{module=\"webhook\",error=\"{label}\"}} ");
        encode(&self.registry)
            .lines()
            .find_map(|l| l.strip_prefix(&needle))
            .map(|v| v.trim().parse().unwrap())
            .unwrap_or(0)
    }
}

#[tokio::test]
async fn default_body_is_slack_compatible_json() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    let hook = Webhook::new(
        format!("http://{addr}/hook/T00/B00/xyz"),
        None,
        s.metrics.clone(),
    )
    .unwrap();
    hook.send(&fields()).await.unwrap();

    let seen = rx.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/hook/T00/B00/xyz");
    assert_eq!(seen[0].content_type, "application/json");
    assert!(
        seen[0].user_agent.starts_with("spotguard/"),
        "{}",
        seen[0].user_agent
    );
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    let obj = body.as_object().unwrap();
    assert_eq!(obj.keys().collect::<Vec<_>>(), vec!["text"]);
    let text = obj["text"].as_str().unwrap();
    for part in [
        "interruption",
        "gpu-node-7",
        "i-0123456789abcdef0",
        "aws",
        "5e0c2a91d4b7f310",
    ] {
        assert!(text.contains(part), "{text:?} lacks {part}");
    }
    assert_eq!(
        (s.count("sent"), s.count("retry"), s.count("failed")),
        (1, 0, 0)
    );
}

#[tokio::test]
async fn template_is_rendered_with_escaped_values() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    let template = r#"{"blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": "*{{kind}}* on `{{node}}`"}}], "deadline": "{{deadline_unix}}", "id": "{{notice_id}}", "detail": "{{detail}}"}"#;
    let hook = s.webhook(
        format!("http://{addr}/hook/x"),
        Some(template),
        fast_policy(),
    );
    let mut f = fields();
    f.node = "evil\"}, \"text\": \"pwned\\\n".into();
    f.detail = "Preempt <!channel> ✓".into();
    let deadline = f.deadline.unwrap().as_second();
    hook.send(&f).await.unwrap();

    let seen = rx.seen();
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    let want = serde_json::json!({
        "blocks": [{"type": "section", "text": {"type": "mrkdwn",
            "text": format!("*interruption* on `{}`", f.node)}}],
        "deadline": deadline.to_string(),
        "id": "5e0c2a91d4b7f310",
        "detail": "Preempt <!channel> ✓",
    });
    assert_eq!(body, want);
}

#[tokio::test]
async fn template_errors_name_the_placeholder() {
    let s = Setup::new();
    let err = Webhook::new(
        "http://127.0.0.1:9/hook".into(),
        Some(r#"{"text": "{{node}} {{zone}}"}"#.into()),
        s.metrics.clone(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Template { .. }), "{err:?}");
    assert!(err.to_string().contains("{{zone}}"), "{err}");
}

#[tokio::test]
async fn bad_urls_are_rejected_at_start() {
    let s = Setup::new();
    for url in [
        "",
        "not a url",
        "ftp://example.com/x",
        "file:///etc/passwd",
        "http://",
        "unix:/run/x.sock",
    ] {
        let err = Webhook::new(url.into(), None, s.metrics.clone()).unwrap_err();
        assert!(matches!(err, Error::Url { .. }), "{url:?}: {err:?}");
    }
}

#[tokio::test]
async fn server_errors_are_retried_until_success() {
    let (addr, rx) = receiver(
        &[Reply::Status(500), Reply::Status(503), Reply::Status(429)],
        None,
    )
    .await;
    let s = Setup::new();
    let policy = RetryPolicy {
        attempts: 4,
        ..fast_policy()
    };
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, policy);
    hook.send(&fields()).await.unwrap();
    let seen = rx.seen();
    assert_eq!(seen.len(), 4);
    // Every try carries the same body.
    assert!(seen.iter().all(|r| r.body == seen[0].body));
    assert_eq!(
        (s.count("sent"), s.count("retry"), s.count("failed")),
        (1, 3, 0)
    );
}

#[tokio::test]
async fn gives_up_after_the_try_bound() {
    let (addr, rx) = receiver(&[], Some(Reply::Status(502))).await;
    let s = Setup::new();
    let hook = s.webhook(
        format!("http://{addr}/hook/SECRET-TOKEN"),
        None,
        fast_policy(),
    );
    let err = hook.send(&fields()).await.unwrap_err();
    match &err {
        Error::GaveUp { tries, last, .. } => {
            assert_eq!(*tries, 3);
            assert!(
                matches!(**last, Error::Status { status: 502, .. }),
                "{last:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // The secret part of the URL never appears in errors (they are logged).
    assert!(!format!("{err} {err:?}").contains("SECRET-TOKEN"), "{err}");
    assert_eq!(rx.seen().len(), 3);
    assert_eq!(
        (s.count("sent"), s.count("retry"), s.count("failed")),
        (0, 2, 1)
    );
    assert_eq!(s.errors("gave_up"), 1);
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let (addr, rx) = receiver(&[], Some(Reply::Status(404))).await;
    let s = Setup::new();
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, fast_policy());
    let err = hook.send(&fields()).await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 404, .. }), "{err:?}");
    assert_eq!(rx.seen().len(), 1);
    assert_eq!((s.count("retry"), s.count("failed")), (0, 1));
}

#[tokio::test]
async fn redirects_are_not_followed() {
    let (addr, rx) = receiver(&[Reply::Redirect], None).await;
    let s = Setup::new();
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, fast_policy());
    let err = hook.send(&fields()).await.unwrap_err();
    assert!(matches!(err, Error::Status { status: 302, .. }), "{err:?}");
    let paths: Vec<String> = rx.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, vec!["/hook/x".to_string()]);
}

#[tokio::test]
async fn a_hanging_receiver_is_cut_by_the_per_try_timeout() {
    let (addr, rx) = receiver(&[], Some(Reply::Hang)).await;
    let s = Setup::new();
    let policy = RetryPolicy {
        attempts: 2,
        per_try_timeout: Duration::from_millis(300),
        ..fast_policy()
    };
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, policy);
    let started = Instant::now();
    let err = hook.send(&fields()).await.unwrap_err();
    match &err {
        Error::GaveUp { tries: 2, last, .. } => {
            assert_eq!(last.metric_label(), "timeout", "{last:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(rx.seen().len(), 2);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn the_total_bound_ends_retrying() {
    let (addr, rx) = receiver(&[], Some(Reply::Status(500))).await;
    let s = Setup::new();
    let policy = RetryPolicy {
        attempts: 1000,
        base_delay: Duration::from_millis(100),
        max_delay: Duration::from_millis(400),
        per_try_timeout: Duration::from_secs(5),
        total: Duration::from_secs(2),
    };
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, policy);
    let started = Instant::now();
    let err = hook.send(&fields()).await.unwrap_err();
    assert!(
        matches!(err, Error::GaveUp { .. } | Error::OutOfTime { .. }),
        "{err:?}"
    );
    let tries = rx.seen().len();
    assert!((2..1000).contains(&tries), "{tries} tries");
    // Generous: the bound is 2 s.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(s.count("failed"), 1);
}

#[tokio::test]
async fn a_slow_receiver_does_not_block_the_caller() {
    let (addr, rx) = receiver(&[Reply::Slow(Duration::from_secs(2))], None).await;
    let s = Setup::new();
    let hook = s.webhook(format!("http://{addr}/hook/x"), None, fast_policy());
    let started = Instant::now();
    let handle = hook.notify(&fields()).expect("inside a runtime");
    let returned_after = started.elapsed();
    // notify() only spawns: it returns long before the receiver answers (2 s).
    assert!(
        returned_after < Duration::from_secs(1),
        "{returned_after:?}"
    );
    assert_eq!(s.count("sent"), 0);
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("the notification finishes")
        .unwrap();
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(rx.seen().len(), 1);
    assert_eq!(s.count("sent"), 1);
}

#[test]
fn notify_outside_a_runtime_is_counted_not_a_panic() {
    let s = Setup::new();
    let hook = s.webhook("http://127.0.0.1:9/hook/x".into(), None, fast_policy());
    assert!(hook.notify(&fields()).is_none());
    assert_eq!(s.count("failed"), 1);
    assert_eq!(s.errors("no_runtime"), 1);
}

/// https URLs (Slack) need TLS in reqwest. This build gets rustls through feature unification
/// (object_store enables reqwest's rustls-tls-native-roots); if that ever goes away, a request
/// to an https URL fails before any connection with "scheme is not http". Against a plain-HTTP
/// receiver, a TLS-capable client gets a handshake error instead.
#[tokio::test]
async fn https_urls_are_supported_by_this_build() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    let policy = RetryPolicy {
        attempts: 1,
        ..fast_policy()
    };
    let hook = s.webhook(format!("https://{addr}/hook/x"), None, policy);
    let err = hook.send(&fields()).await.unwrap_err();
    let chain = spotguard::words::chain(&err);
    assert!(
        !chain.contains("scheme is not http"),
        "no TLS support: {chain}"
    );
    match &err {
        Error::GaveUp { tries: 1, last, .. } => {
            assert!(matches!(**last, Error::Request { .. }), "{last:?}")
        }
        other => panic!("{other:?}"),
    }
    // The receiver got a TLS ClientHello, not an HTTP request it could route.
    assert!(rx.seen().is_empty());
}

fn outcome() -> PlanOutcome {
    PlanOutcome {
        outcome: "completed".into(),
        ok: false,
        checkpoint: "1 acked, 1 timeout".into(),
        step: Some(1200),
        checkpoint_seconds: Some(31.0),
        budget_seconds: Some(90.0),
        evicted: 12,
        blocked_pods: vec!["web/frontend-0".into()],
        blocking_pdbs: vec!["frontend-pdb".into()],
        drain_error: String::new(),
        plan_seconds: 48.0,
        ..PlanOutcome::default()
    }
}

fn options(preset: Preset) -> Options {
    Options {
        preset,
        policy: fast_policy(),
        routing_key: Some("R0UTING".into()),
        ..Options::default()
    }
}

#[tokio::test]
async fn start_and_outcome_messages_carry_what_on_call_needs() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    let hook = Webhook::with_options(
        format!("http://{addr}/hook/x"),
        Options {
            headers: vec![
                spotguard::webhook::parse_header("Authorization: Bearer s3cret").unwrap(),
            ],
            ..options(Preset::Slack)
        },
        s.metrics.clone(),
    )
    .unwrap();
    hook.send(&fields()).await.unwrap();
    let mut f = fields();
    f.outcome = Some(outcome());
    hook.send(&f).await.unwrap();

    let seen = rx.seen();
    assert_eq!(seen.len(), 2);
    for m in &seen {
        assert_eq!(m.authorization, "Bearer s3cret");
        assert_eq!(m.dry_run_header, "");
    }
    let start: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    let text = start["text"].as_str().unwrap();
    assert!(
        text.contains("interruption notice on node gpu-node-7"),
        "{text}"
    );
    assert!(!text.contains("DRY RUN"), "{text}");
    let end: serde_json::Value = serde_json::from_str(&seen[1].body).unwrap();
    let text = end["text"].as_str().unwrap();
    for part in [
        "gpu-node-7",
        "handled with problems",
        "1 acked, 1 timeout",
        "step 1200",
        "31.0s of 90.0s budget",
        "12 evicted, 1 blocked",
        "PDB frontend-pdb",
    ] {
        assert!(text.contains(part), "{text:?} lacks {part:?}");
    }
    assert_eq!(s.count("sent"), 2);
}

#[tokio::test]
async fn dry_run_is_marked_or_suppressed() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    let marked = Webhook::with_options(
        format!("http://{addr}/hook/x"),
        Options {
            dry_run: true,
            template: Some(r#"{"dry": "{{dry_run}}", "t": "{{dry_run_tag}}{{kind}}"}"#.into()),
            ..options(Preset::Slack)
        },
        s.metrics.clone(),
    )
    .unwrap();
    marked.send(&fields()).await.unwrap();
    let seen = rx.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].dry_run_header, "true");
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"dry": "true", "t": "[DRY RUN] interruption"})
    );

    let suppressed = Webhook::with_options(
        format!("http://{addr}/hook/x"),
        Options {
            dry_run: true,
            on_dry_run: DryRunWebhook::Suppress,
            ..options(Preset::Slack)
        },
        s.metrics.clone(),
    )
    .unwrap();
    suppressed.send(&fields()).await.unwrap();
    assert_eq!(rx.seen().len(), 1, "a suppressed webhook was sent");
    assert_eq!((s.count("sent"), s.count("suppressed")), (1, 1));
}

#[tokio::test]
async fn presets_render_what_their_receivers_expect() {
    let (addr, rx) = receiver(&[], None).await;
    let s = Setup::new();
    for preset in [Preset::Teams, Preset::Pagerduty] {
        let hook = Webhook::with_options(
            format!("http://{addr}/hook/x"),
            options(preset),
            s.metrics.clone(),
        )
        .unwrap();
        hook.send(&fields()).await.unwrap();
        let mut f = fields();
        f.outcome = Some(PlanOutcome {
            ok: true,
            blocked_pods: Vec::new(),
            blocking_pdbs: Vec::new(),
            ..outcome()
        });
        hook.send(&f).await.unwrap();
    }
    let seen = rx.seen();
    assert_eq!(seen.len(), 4);
    let v: Vec<serde_json::Value> = seen
        .iter()
        .map(|m| serde_json::from_str(&m.body).unwrap())
        .collect();
    // Teams MessageCard.
    assert_eq!(v[0]["@type"], "MessageCard");
    assert!(v[0]["title"]
        .as_str()
        .unwrap()
        .contains("interruption notice on gpu-node-7"));
    assert!(
        v[1]["text"].as_str().unwrap().contains("step 1200"),
        "{}",
        v[1]
    );
    // PagerDuty Events v2: trigger on start, resolve on a clean outcome, same dedup key.
    assert_eq!(v[2]["routing_key"], "R0UTING");
    assert_eq!(v[2]["event_action"], "trigger");
    assert_eq!(v[2]["payload"]["severity"], "warning");
    assert_eq!(v[2]["payload"]["source"], "gpu-node-7");
    assert_eq!(v[3]["event_action"], "resolve");
    assert_eq!(v[3]["payload"]["severity"], "info");
    assert_eq!(v[3]["payload"]["custom_details"]["step"], "1200");
    assert_eq!(v[2]["dedup_key"], v[3]["dedup_key"]);
    for p in &v[2..] {
        let summary = p["payload"]["summary"].as_str().unwrap();
        assert!(!summary.is_empty() && summary.len() <= 1024, "{summary}");
    }
}

#[tokio::test]
async fn outcome_template_errors_are_reported_as_such() {
    let s = Setup::new();
    let err = Webhook::with_options(
        "http://127.0.0.1:9/hook".into(),
        Options {
            // `step` is empty when no ack gave one: unquoted, that is not JSON.
            outcome_template: Some(r#"{"evicted": {{evicted}}, "step": {{step}}}"#.into()),
            ..options(Preset::Slack)
        },
        s.metrics.clone(),
    )
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("(outcome)") && text.contains("valid JSON"),
        "{text}"
    );
}

/// A trainer that acknowledges SIGUSR1 with `step` = 4242 (bash: its own process, in the host's
/// PID namespace, found through its pidfile).
const TRAINER: &str = r#"
trap 'printf '"'"'{"state":"done","step":4242,"checkpoint":"ckpt-4242","ts":%s}'"'"' $(date +%s.%N) > "$SPOTGUARD_DIR/.ack.tmp"; mv "$SPOTGUARD_DIR/.ack.tmp" "$SPOTGUARD_DIR/ack-$$.json"' USR1
echo ready > "$READY"
while :; do sleep 0.05; done
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_sends_start_and_outcome_and_records_headroom() {
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use spotguard::responder::PlanEvent;

    let (addr, rx) = receiver(&[], None).await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("ckpt")).unwrap();
    let mut trainer = tokio::process::Command::new("bash")
        .arg("-c")
        .arg(TRAINER)
        .env("SPOTGUARD_DIR", dir.join("ckpt"))
        .env("READY", dir.join("ready"))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    std::fs::write(dir.join("trainer.pid"), trainer.id().unwrap().to_string()).unwrap();
    for _ in 0..200 {
        if dir.join("ready").exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    let argv: Vec<String> = vec![
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={}", emu.base_url()),
        "--poll-interval=200ms".into(),
        "--checkpoint-timeout=20s".into(),
        format!("--checkpoint-dir={}", dir.join("ckpt").display()),
        format!("--state-dir={}", dir.join("state").display()),
        format!("--checkpoint-pidfile={}", dir.join("trainer.pid").display()),
        "--metrics-addr=127.0.0.1:0".into(),
        "--gpu=off".into(),
        "--log-level=warn".into(),
        "--shutdown-grace=2s".into(),
        format!("--webhook-url=http://{addr}/hook/agent"),
        "--webhook-header=Authorization: Bearer agent-token".into(),
    ];
    let args = spotguard::config::parse_run_args(argv).unwrap_or_else(|text| panic!("{text}"));
    let cfg = spotguard::config::Config::resolve(args, &spotguard::config::ProcessEnv).unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let app = spotguard::app::start(cfg, cancel.clone()).await.unwrap();
    let mut events = app.events;
    tokio::time::sleep(Duration::from_millis(300)).await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    spotguard_testkit::wait_for_event(&mut events, Duration::from_secs(30), |e| {
        matches!(e, PlanEvent::Done { .. }).then_some(())
    })
    .await;

    // Both messages arrive (the outcome is sent after Done, asynchronously).
    let mut seen = rx.seen();
    for _ in 0..100 {
        if seen.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        seen = rx.seen();
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen.iter().all(|m| m.authorization == "Bearer agent-token"));
    let start: serde_json::Value = serde_json::from_str(&seen[0].body).unwrap();
    assert!(
        start["text"]
            .as_str()
            .unwrap()
            .contains("interruption notice"),
        "{start}"
    );
    let end: serde_json::Value = serde_json::from_str(&seen[1].body).unwrap();
    let text = end["text"].as_str().unwrap();
    for part in ["handled after", "checkpoint 1 acked", "step 4242", "budget"] {
        assert!(text.contains(part), "{text:?} lacks {part:?}");
    }
    // Host mode: a host, not a node.
    assert!(text.contains("interruption on host "), "{text:?}");
    assert!(!text.contains("on node"), "{text:?}");

    let m = spotguard_testkit::metrics_text(app.admin_addr).await;
    for line in [
        "spotguard_checkpoint_headroom_seconds_count 1",
        "spotguard_checkpoint_last_acked_step 4242",
        "spotguard_plans_total{outcome=\"completed\"} 1",
        "spotguard_webhook_total{outcome=\"sent\"} 2",
        // Nothing to taint or cordon on a host, nothing to acknowledge to EC2: not counted as done.
        "spotguard_node_actions_total{action=\"protect\",outcome=\"ok\"} 0",
        "spotguard_node_actions_total{action=\"acknowledge\",outcome=\"ok\"} 0",
    ] {
        assert!(m.contains(line), "{line} not in\n{m}");
    }
    cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), app.join).await;
    emu.shutdown().await;
    let _ = trainer.kill().await;
}
