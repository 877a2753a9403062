//! Optional notification when spotguard starts handling a notice (`--webhook-url`,
//! `--webhook-template`).
//!
//! The body is JSON: Slack-compatible `{"text": "..."}` by default, or a user template with
//! `{{placeholder}}`s (see [`PLACEHOLDERS`]). Substitution is plain string replacement of
//! JSON-escaped values (no quotes added), so placeholders belong inside JSON strings. The
//! template is checked at start-up: an unknown or unclosed placeholder, or a template that does
//! not render to valid JSON, is an error naming the problem.
//!
//! Delivery is a POST with a short per-try timeout, retried with jittered exponential backoff
//! within a bounded number of tries and a bounded total time. [`Webhook::notify`] runs it in a
//! spawned task, so it never delays the checkpoint or the drain. Every notification is counted in
//! `spotguard_webhook_total{outcome}`: `sent` or `failed` once per notification, `retry` once per
//! retried try.
//!
//! Webhook URLs usually embed a secret (Slack's do): logs and errors show only scheme and host.

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tracing::{debug, info, warn};

use crate::metrics::{Metrics, OutcomeLabels};
use crate::notice::{time_until, Notice};

/// Placeholders a template may use.
pub const PLACEHOLDERS: &[&str] = &[
    "node",
    "instance",
    "kind",
    "source",
    "deadline",
    "deadline_unix",
    "time_left",
    "notice_id",
    "detail",
    "action",
];

/// The default body: Slack-compatible, and readable in Teams/Mattermost/Discord-style receivers
/// that accept `{"text": ...}` as well.
pub const DEFAULT_TEMPLATE: &str = r#"{"text": "spotguard: {{kind}} notice on node {{node}} (instance {{instance}}, {{source}}), deadline {{deadline}} ({{time_left}} left): {{action}}. Notice {{notice_id}}: {{detail}}"}"#;

/// Values substituted into the template. Build one with [`NotifyFields::from_notice`].
#[derive(Clone, Debug, PartialEq)]
pub struct NotifyFields {
    /// Kubernetes node name, or the host name in host mode.
    pub node: String,
    /// Cloud instance id / VM name where known (empty otherwise).
    pub instance: String,
    /// Notice kind label: `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `None` means "now" (design §3).
    pub deadline: Option<Timestamp>,
    pub notice_id: String,
    /// The cloud's own words (action, event type, description).
    pub detail: String,
    /// What spotguard is doing about it, e.g. `checkpoint and drain`.
    pub action: String,
}

impl NotifyFields {
    pub fn from_notice(notice: &Notice, node: &str, instance: &str, action: &str) -> Self {
        NotifyFields {
            node: node.to_string(),
            instance: instance.to_string(),
            kind: notice.kind.label().to_string(),
            source: notice.source.as_str().to_string(),
            deadline: notice.deadline,
            notice_id: notice.id.clone(),
            detail: notice.detail.clone(),
            action: action.to_string(),
        }
    }

    fn value(&self, field: Field, now: Timestamp) -> String {
        match field {
            Field::Node => self.node.clone(),
            Field::Instance => self.instance.clone(),
            Field::Kind => self.kind.clone(),
            Field::Source => self.source.clone(),
            Field::Deadline => match self.deadline {
                Some(d) => d.to_string(),
                None => "now".to_string(),
            },
            Field::DeadlineUnix => self
                .deadline
                .map(|d| d.as_second().to_string())
                .unwrap_or_default(),
            Field::TimeLeft => {
                let left = time_until(self.deadline, now);
                humantime::format_duration(Duration::from_secs(left.as_secs())).to_string()
            }
            Field::NoticeId => self.notice_id.clone(),
            Field::Detail => self.detail.clone(),
            Field::Action => self.action.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Node,
    Instance,
    Kind,
    Source,
    Deadline,
    DeadlineUnix,
    TimeLeft,
    NoticeId,
    Detail,
    Action,
}

impl Field {
    fn parse(name: &str) -> Option<Field> {
        Some(match name {
            "node" => Field::Node,
            "instance" => Field::Instance,
            "kind" => Field::Kind,
            "source" => Field::Source,
            "deadline" => Field::Deadline,
            "deadline_unix" => Field::DeadlineUnix,
            "time_left" => Field::TimeLeft,
            "notice_id" => Field::NoticeId,
            "detail" => Field::Detail,
            "action" => Field::Action,
            _ => return None,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Segment {
    Literal(String),
    Placeholder(Field),
}

/// A parsed body template.
#[derive(Clone, Debug, PartialEq)]
struct Template {
    segments: Vec<Segment>,
}

impl Template {
    fn parse(text: &str) -> Result<Template, Error> {
        let mut segments = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find("{{") {
            if start > 0 {
                segments.push(Segment::Literal(rest[..start].to_string()));
            }
            let after = &rest[start + 2..];
            let end = after.find("}}").ok_or_else(|| Error::Template {
                reason: format!(
                    "unclosed placeholder at {:?}",
                    after.chars().take(20).collect::<String>()
                ),
            })?;
            let name = after[..end].trim();
            let field = Field::parse(name).ok_or_else(|| Error::Template {
                reason: format!(
                    "unknown placeholder {{{{{name}}}}} (known: {})",
                    PLACEHOLDERS.join(", ")
                ),
            })?;
            segments.push(Segment::Placeholder(field));
            rest = &after[end + 2..];
        }
        if !rest.is_empty() {
            segments.push(Segment::Literal(rest.to_string()));
        }
        let template = Template { segments };
        // The body must be JSON whatever the values are: render with values that need escaping.
        let probe = NotifyFields {
            node: "n\"o\\de\n".into(),
            instance: "i-0{}".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            deadline: None,
            notice_id: "id\t1".into(),
            detail: "\u{1}<>&'".into(),
            action: "checkpoint and drain".into(),
        };
        let rendered = template.render(&probe, Timestamp::UNIX_EPOCH);
        serde_json::from_str::<serde_json::Value>(&rendered).map_err(|e| Error::Template {
            reason: format!(
                "does not render to valid JSON ({e}); placeholders are substituted as escaped \
                 string contents, so put them inside quotes"
            ),
        })?;
        Ok(template)
    }

    fn render(&self, fields: &NotifyFields, now: Timestamp) -> String {
        let mut out = String::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(s) => out.push_str(s),
                Segment::Placeholder(field) => {
                    out.push_str(&json_escape(&fields.value(*field, now)))
                }
            }
        }
        out
    }
}

/// The contents of a JSON string literal for `s`, without the surrounding quotes.
fn json_escape(s: &str) -> String {
    let quoted = serde_json::Value::String(s.to_string()).to_string();
    quoted
        .strip_prefix('"')
        .and_then(|q| q.strip_suffix('"'))
        .unwrap_or_default()
        .to_string()
}

/// Scheme and host of a URL, for logs: webhook URLs often carry a secret in the path or query.
fn redact(url: &reqwest::Url) -> String {
    match url.host_str() {
        Some(host) => match url.port() {
            Some(port) => format!("{}://{host}:{port}/…", url.scheme()),
            None => format!("{}://{host}/…", url.scheme()),
        },
        None => format!("{}:…", url.scheme()),
    }
}

/// How hard to try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Tries in all, including the first (0 is taken as 1).
    pub attempts: u32,
    /// Backoff before the first retry; doubled each time, with full jitter.
    pub base_delay: Duration,
    /// Cap of one backoff.
    pub max_delay: Duration,
    /// Bound on one POST (connect, send, response).
    pub per_try_timeout: Duration,
    /// Bound on the whole notification, retries included.
    pub total: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 4,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(8),
            per_try_timeout: Duration::from_secs(5),
            total: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// Jittered delay before retry number `retry` (1-based): uniform in [d/2, d] where
    /// d = min(base · 2^(retry−1), max).
    fn backoff(&self, retry: u32) -> Duration {
        let exp = retry.saturating_sub(1).min(16);
        let d = self
            .base_delay
            .saturating_mul(1u32 << exp)
            .min(self.max_delay);
        let half = d / 2;
        let jitter_ms = u64::try_from(half.as_millis()).unwrap_or(u64::MAX);
        half + Duration::from_millis(fastrand::u64(0..=jitter_ms))
    }
}

/// Errors of the webhook notifier.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("webhook URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("webhook template: {reason}")]
    Template { reason: String },
    #[error("building the webhook HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("POST to {url} failed: {source}")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("POST to {url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("webhook to {url} gave up after {tries} tries: {last}")]
    GaveUp {
        url: String,
        tries: u32,
        #[source]
        last: Box<Error>,
    },
    #[error("webhook to {url} ran out of its {total:?} bound during try {tries}")]
    OutOfTime {
        url: String,
        tries: u32,
        total: Duration,
    },
    #[error("no async runtime to send the webhook from")]
    NoRuntime,
}

impl Error {
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Request { .. } => true,
            // 408/425/429 and server errors are worth another try; other 4xx will not change.
            Error::Status { status, .. } => matches!(status, 408 | 425 | 429) || *status >= 500,
            Error::Url { .. }
            | Error::Template { .. }
            | Error::Client(_)
            | Error::GaveUp { .. }
            | Error::OutOfTime { .. }
            | Error::NoRuntime => false,
        }
    }

    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Url { .. } => "url",
            Error::Template { .. } => "template",
            Error::Client(_) => "client",
            Error::Request { source, .. } if source.is_timeout() => "timeout",
            Error::Request { .. } => "request",
            Error::Status { .. } => "status",
            Error::GaveUp { .. } => "gave_up",
            Error::OutOfTime { .. } => "out_of_time",
            Error::NoRuntime => "no_runtime",
        }
    }
}

struct Inner {
    url: reqwest::Url,
    shown: String,
    template: Template,
    client: reqwest::Client,
    policy: RetryPolicy,
    metrics: Arc<Metrics>,
}

/// The notifier. Cheap to clone; clones share the HTTP client.
#[derive(Clone)]
pub struct Webhook {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("url", &self.inner.shown)
            .field("policy", &self.inner.policy)
            .finish()
    }
}

impl Webhook {
    /// Validate the URL (http or https) and the template (`None`: [`DEFAULT_TEMPLATE`]).
    pub fn new(
        url: String,
        template: Option<String>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, Error> {
        Self::with_policy(url, template, metrics, RetryPolicy::default())
    }

    pub fn with_policy(
        url: String,
        template: Option<String>,
        metrics: Arc<Metrics>,
        policy: RetryPolicy,
    ) -> Result<Self, Error> {
        let parsed = reqwest::Url::parse(url.trim()).map_err(|e| Error::Url {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(Error::Url {
                url: redact(&parsed),
                reason: "only http and https are supported".into(),
            });
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(Error::Url {
                url: redact(&parsed),
                reason: "no host".into(),
            });
        }
        // At least the first try.
        let policy = RetryPolicy {
            attempts: policy.attempts.max(1),
            ..policy
        };
        let template = Template::parse(template.as_deref().unwrap_or(DEFAULT_TEMPLATE))?;
        let client = reqwest::Client::builder()
            .timeout(policy.per_try_timeout)
            .connect_timeout(policy.per_try_timeout.min(Duration::from_secs(3)))
            .user_agent(concat!("spotguard/", env!("CARGO_PKG_VERSION")))
            // A redirect would re-send the body somewhere the operator did not configure.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(Error::Client)?;
        Ok(Webhook {
            inner: Arc::new(Inner {
                shown: redact(&parsed),
                url: parsed,
                template,
                client,
                policy,
                metrics,
            }),
        })
    }

    /// The body that would be sent for `fields` at time `now`.
    pub fn render(&self, fields: &NotifyFields, now: Timestamp) -> String {
        self.inner.template.render(fields, now)
    }

    /// Send in a spawned task and return at once; the outcome is logged and counted. Returns the
    /// task's handle (dropping it does not cancel the send), or `None` outside a tokio runtime,
    /// which is logged and counted as `failed`.
    pub fn notify(&self, fields: &NotifyFields) -> Option<tokio::task::JoinHandle<()>> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let err = Error::NoRuntime;
            warn!(error = %err, "webhook not sent");
            self.count("failed");
            self.inner.metrics.error("webhook", err.metric_label());
            return None;
        };
        let this = self.clone();
        let fields = fields.clone();
        Some(runtime.spawn(async move {
            // send() logs and counts its own outcome.
            let _ = this.send(&fields).await;
        }))
    }

    /// POST the rendered body, retrying within the policy. Logs and counts the outcome.
    pub async fn send(&self, fields: &NotifyFields) -> Result<(), Error> {
        let body = self.render(fields, Timestamp::now());
        let inner = &self.inner;
        let result = self.send_with_retries(body).await;
        match &result {
            Ok(()) => {
                info!(url = %inner.shown, notice_id = %fields.notice_id, "webhook sent");
                self.count("sent");
            }
            Err(e) => {
                warn!(url = %inner.shown, notice_id = %fields.notice_id, error = %e, "webhook failed");
                self.count("failed");
                inner.metrics.error("webhook", e.metric_label());
            }
        }
        result
    }

    async fn send_with_retries(&self, body: String) -> Result<(), Error> {
        let inner = &self.inner;
        let policy = &inner.policy;
        let deadline = tokio::time::Instant::now() + policy.total;
        let mut tries = 0;
        loop {
            tries += 1;
            let err = match tokio::time::timeout_at(deadline, self.post_once(body.clone())).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_elapsed) => {
                    return Err(Error::OutOfTime {
                        url: inner.shown.clone(),
                        tries,
                        total: policy.total,
                    })
                }
            };
            if !err.is_retryable() {
                return Err(err);
            }
            let delay = policy.backoff(tries);
            if tries >= policy.attempts || tokio::time::Instant::now() + delay >= deadline {
                return Err(Error::GaveUp {
                    url: inner.shown.clone(),
                    tries,
                    last: Box::new(err),
                });
            }
            debug!(url = %inner.shown, error = %err, tries, ?delay, "webhook retry");
            self.count("retry");
            tokio::time::sleep(delay).await;
        }
    }

    async fn post_once(&self, body: String) -> Result<(), Error> {
        let inner = &self.inner;
        let response = inner
            .client
            .post(inner.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| Error::Request {
                url: inner.shown.clone(),
                source: e.without_url(),
            })?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(Error::Status {
                url: inner.shown.clone(),
                status: status.as_u16(),
            })
        }
    }

    fn count(&self, outcome: &str) {
        self.inner
            .metrics
            .webhook
            .get_or_create(&OutcomeLabels {
                outcome: outcome.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields() -> NotifyFields {
        NotifyFields {
            node: "gpu-node-1".into(),
            instance: "i-0abc".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            deadline: Some(Timestamp::from_second(1_700_000_120).unwrap()),
            notice_id: "9f8e7d6c".into(),
            detail: "terminate".into(),
            action: "checkpoint and drain".into(),
        }
    }

    fn now() -> Timestamp {
        Timestamp::from_second(1_700_000_000).unwrap()
    }

    #[test]
    fn every_placeholder_renders() {
        let text = PLACEHOLDERS
            .iter()
            .map(|p| format!("\"{p}\": \"{{{{{p}}}}}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let t = Template::parse(&format!("{{{text}}}")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&t.render(&fields(), now())).unwrap();
        let want = serde_json::json!({
            "node": "gpu-node-1",
            "instance": "i-0abc",
            "kind": "interruption",
            "source": "aws",
            "deadline": "2023-11-14T22:15:20Z",
            "deadline_unix": "1700000120",
            "time_left": "2m",
            "notice_id": "9f8e7d6c",
            "detail": "terminate",
            "action": "checkpoint and drain",
        });
        assert_eq!(v, want);
    }

    #[test]
    fn no_deadline_means_now() {
        let t =
            Template::parse(r#"{"a": "{{deadline}}|{{deadline_unix}}|{{time_left}}"}"#).unwrap();
        let mut f = fields();
        f.deadline = None;
        assert_eq!(t.render(&f, now()), r#"{"a": "now||0s"}"#);
        // A deadline in the past: zero time left.
        f.deadline = Some(Timestamp::from_second(1_600_000_000).unwrap());
        assert!(t.render(&f, now()).ends_with("|0s\"}"));
    }

    #[test]
    fn placeholders_tolerate_inner_spaces_and_repeat() {
        let t = Template::parse(r#"{"t": "{{ node }}/{{node}}"}"#).unwrap();
        assert_eq!(
            t.render(&fields(), now()),
            r#"{"t": "gpu-node-1/gpu-node-1"}"#
        );
    }

    #[test]
    fn values_are_json_escaped() {
        let t = Template::parse(r#"{"t": "{{node}}"}"#).unwrap();
        for hostile in [
            "a\"b",
            "back\\slash",
            "line\nbreak\r\t",
            "\u{0}\u{1f}",
            "\"}, \"injected\": {\"x\": \"",
            "ünïcødé ✓ 🚀",
            "{{kind}}",
        ] {
            let mut f = fields();
            f.node = hostile.into();
            let rendered = t.render(&f, now());
            let v: serde_json::Value = serde_json::from_str(&rendered)
                .unwrap_or_else(|e| panic!("{hostile:?} broke the JSON: {e}: {rendered}"));
            assert_eq!(v, serde_json::json!({ "t": hostile }), "{hostile:?}");
        }
    }

    #[test]
    fn bad_templates_are_rejected_with_the_reason() {
        let cases = [
            (r#"{"t": "{{nodes}}"}"#, "unknown placeholder {{nodes}}"),
            (r#"{"t": "{{}}"}"#, "unknown placeholder {{}}"),
            (r#"{"t": "{{node"}"#, "unclosed placeholder"),
            (r#"{"t": "{{ node }"}"#, "unclosed placeholder"),
            (r#"{"t": {{node}}}"#, "valid JSON"),
            (r#"text only {{node}}"#, "valid JSON"),
            ("", "valid JSON"),
            (r#"{"t": "x""#, "valid JSON"),
        ];
        for (template, needle) in cases {
            let err = Template::parse(template).expect_err(template);
            assert!(
                err.to_string().contains(needle),
                "{template:?}: {err} lacks {needle:?}"
            );
            assert_eq!(err.metric_label(), "template");
            assert!(!err.is_retryable());
        }
    }

    #[test]
    fn default_template_is_slack_shaped() {
        let t = Template::parse(DEFAULT_TEMPLATE).unwrap();
        let v: serde_json::Value = serde_json::from_str(&t.render(&fields(), now())).unwrap();
        let obj = v.as_object().unwrap();
        assert_eq!(obj.len(), 1);
        let text = obj["text"].as_str().unwrap();
        for part in [
            "interruption",
            "gpu-node-1",
            "i-0abc",
            "aws",
            "2m",
            "9f8e7d6c",
        ] {
            assert!(text.contains(part), "{text} lacks {part}");
        }
    }

    #[test]
    fn backoff_is_jittered_within_bounds() {
        let p = RetryPolicy {
            attempts: 10,
            base_delay: Duration::from_millis(400),
            max_delay: Duration::from_secs(2),
            per_try_timeout: Duration::from_secs(1),
            total: Duration::from_secs(30),
        };
        for _ in 0..200 {
            let d1 = p.backoff(1);
            assert!(d1 >= Duration::from_millis(200) && d1 <= Duration::from_millis(400));
            let d3 = p.backoff(3);
            assert!(d3 >= Duration::from_millis(800) && d3 <= Duration::from_millis(1600));
            let d9 = p.backoff(9);
            assert!(d9 >= Duration::from_secs(1) && d9 <= Duration::from_secs(2));
            assert!(p.backoff(u32::MAX) <= Duration::from_secs(2));
        }
    }

    #[test]
    fn fields_from_a_notice() {
        let notice = Notice {
            id: "abc".into(),
            kind: crate::notice::NoticeKind::Maintenance,
            source: crate::notice::Source::Azure,
            deadline: None,
            not_before: None,
            detail: "Reboot".into(),
            restart: true,
            published_at: None,
            observed_at: now(),
        };
        let f = NotifyFields::from_notice(&notice, "node-9", "vm-9", "drain");
        assert_eq!(
            f,
            NotifyFields {
                node: "node-9".into(),
                instance: "vm-9".into(),
                kind: "maintenance".into(),
                source: "azure".into(),
                deadline: None,
                notice_id: "abc".into(),
                detail: "Reboot".into(),
                action: "drain".into(),
            }
        );
    }

    #[test]
    fn url_is_redacted() {
        let u =
            reqwest::Url::parse("https://hooks.slack.com/services/T000/B000/SECRET?x=1").unwrap();
        assert_eq!(redact(&u), "https://hooks.slack.com/…");
        let u = reqwest::Url::parse("http://127.0.0.1:8080/hook/SECRET").unwrap();
        assert_eq!(redact(&u), "http://127.0.0.1:8080/…");
    }
}
