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

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tracing::{debug, info, warn};

use crate::backoff::Backoff;
use crate::metrics::{Metrics, OutcomeLabels};
use crate::notice::{time_until, Notice};

/// Placeholders a template may use. Outcome placeholders render empty in start messages.
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
    "message",
    "summary",
    "severity",
    "event_action",
    "dry_run",
    "dry_run_tag",
    "routing_key",
    "outcome",
    "ok",
    "checkpoint",
    "step",
    "checkpoint_seconds",
    "budget_seconds",
    "headroom_seconds",
    "evicted",
    "blocked",
    "blocked_pods",
    "blocking_pdbs",
    "drain_error",
    "plan_seconds",
];

/// The default start body (the Slack preset): Slack-compatible, and readable in
/// Teams/Mattermost/Discord-style receivers that accept `{"text": ...}` as well.
pub const DEFAULT_TEMPLATE: &str = r#"{"text": "{{dry_run_tag}}spotguard: {{kind}} notice on node {{node}} (instance {{instance}}, {{source}}), deadline {{deadline}} ({{time_left}} left): {{action}}. Notice {{notice_id}}: {{detail}}"}"#;

/// Ready-made bodies for common receivers (`--webhook-preset`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// `{"text": …}`: Slack incoming webhooks, Mattermost, Rocket.Chat.
    Slack,
    /// A Microsoft Teams MessageCard (incoming webhook / Workflows).
    Teams,
    /// PagerDuty Events API v2 (needs `--webhook-routing-key`): the start triggers an incident
    /// keyed by node and notice, a clean outcome resolves it, a problem re-triggers it as `error`.
    Pagerduty,
}

impl Preset {
    /// (start, outcome) templates.
    pub fn templates(self) -> (&'static str, &'static str) {
        match self {
            Preset::Slack => (
                DEFAULT_TEMPLATE,
                r#"{"text": "{{dry_run_tag}}spotguard: {{summary}}"}"#,
            ),
            Preset::Teams => (
                r#"{"@type": "MessageCard", "@context": "https://schema.org/extensions", "themeColor": "E8A317", "summary": "{{dry_run_tag}}spotguard: {{kind}} on {{node}}", "title": "{{dry_run_tag}}spotguard: {{kind}} notice on {{node}}", "text": "{{summary}}"}"#,
                r#"{"@type": "MessageCard", "@context": "https://schema.org/extensions", "themeColor": "0078D7", "summary": "{{dry_run_tag}}spotguard: {{kind}} on {{node}} {{outcome}}", "title": "{{dry_run_tag}}spotguard: {{kind}} on {{node}}: {{outcome}}", "text": "{{summary}}"}"#,
            ),
            Preset::Pagerduty => (PAGERDUTY, PAGERDUTY),
        }
    }
}

const PAGERDUTY: &str = r#"{"routing_key": "{{routing_key}}", "event_action": "{{event_action}}", "dedup_key": "spotguard/{{node}}/{{notice_id}}", "payload": {"summary": "{{dry_run_tag}}{{summary}}", "source": "{{node}}", "severity": "{{severity}}", "component": "spotguard", "group": "{{source}}", "class": "{{kind}}", "custom_details": {"instance": "{{instance}}", "deadline": "{{deadline}}", "outcome": "{{outcome}}", "checkpoint": "{{checkpoint}}", "step": "{{step}}", "checkpoint_seconds": "{{checkpoint_seconds}}", "budget_seconds": "{{budget_seconds}}", "evicted": "{{evicted}}", "blocked_pods": "{{blocked_pods}}", "blocking_pdbs": "{{blocking_pdbs}}", "drain_error": "{{drain_error}}", "dry_run": "{{dry_run}}"}}}"#;

/// How a plan ended, for the outcome message.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlanOutcome {
    /// `completed`, `drain_failed` or `undone`.
    pub outcome: String,
    /// Every group acked (or exited), the drain (if any) left nothing blocked and did not fail.
    pub ok: bool,
    /// Checkpoint outcomes, e.g. `2 acked, 1 timeout`; `not run` when the plan had no checkpoint.
    pub checkpoint: String,
    /// Highest training step the acks reported.
    pub step: Option<u64>,
    /// Slowest acknowledgement (signal → ack).
    pub checkpoint_seconds: Option<f64>,
    /// The checkpoint budget: signal → checkpoint deadline.
    pub budget_seconds: Option<f64>,
    pub evicted: usize,
    /// `namespace/name` of pods still on the node at the deadline.
    pub blocked_pods: Vec<String>,
    /// PodDisruptionBudgets that refused evictions.
    pub blocking_pdbs: Vec<String>,
    /// Why the drain failed, empty when it did not.
    pub drain_error: String,
    /// Notice seen → plan done.
    pub plan_seconds: f64,
}

/// Values substituted into the template. Build one with [`NotifyFields::from_notice`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NotifyFields {
    /// Kubernetes node name, or the host name in host mode.
    pub node: String,
    /// Cloud instance id / VM name where known (empty otherwise).
    pub instance: String,
    /// Notice kind label: `interruption`, `rebalance`, `maintenance`.
    pub kind: String,
    /// `aws`, `gce`, `azure`.
    pub source: String,
    /// `None` means "now": the notice gives no time, so it is treated as due at once.
    pub deadline: Option<Timestamp>,
    pub notice_id: String,
    /// The cloud's own words (action, event type, description).
    pub detail: String,
    /// What spotguard is doing about it, e.g. `checkpoint and drain`.
    pub action: String,
    /// Set for the message sent when the plan ends.
    pub outcome: Option<PlanOutcome>,
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
            outcome: None,
        }
    }

    /// One line for humans: what happened and what spotguard did (or is doing).
    pub fn summary(&self, now: Timestamp) -> String {
        match &self.outcome {
            None => format!(
                "{} notice on node {} ({}), deadline {} ({} left): {}",
                self.kind,
                self.node,
                self.source,
                self.value(Field::Deadline, now, Ctx::default()),
                self.value(Field::TimeLeft, now, Ctx::default()),
                self.action
            ),
            Some(o) => {
                let mut s = format!(
                    "{} on node {} {} after {}: checkpoint {}",
                    self.kind,
                    self.node,
                    if o.ok {
                        "handled"
                    } else {
                        "handled with problems"
                    },
                    secs(o.plan_seconds),
                    o.checkpoint
                );
                let mut inner = Vec::new();
                if let Some(step) = o.step {
                    inner.push(format!("step {step}"));
                }
                match (o.checkpoint_seconds, o.budget_seconds) {
                    (Some(d), Some(b)) => inner.push(format!("{} of {} budget", secs(d), secs(b))),
                    (Some(d), None) => inner.push(secs(d)),
                    _ => {}
                }
                if !inner.is_empty() {
                    let _ = write!(s, " ({})", inner.join(", "));
                }
                if o.outcome == "undone" {
                    s.push_str("; notice cancelled, changes undone");
                } else {
                    let _ = write!(
                        s,
                        "; drain: {} evicted, {} blocked",
                        o.evicted,
                        o.blocked_pods.len()
                    );
                    if !o.blocking_pdbs.is_empty() {
                        let _ = write!(s, " (PDB {})", o.blocking_pdbs.join(", "));
                    }
                    if !o.drain_error.is_empty() {
                        let _ = write!(s, "; drain failed: {}", o.drain_error);
                    }
                }
                s
            }
        }
    }

    fn value(&self, field: Field, now: Timestamp, ctx: Ctx<'_>) -> String {
        let o = self.outcome.as_ref();
        let num = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_default();
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
                crate::duration::display(Duration::from_secs(left.as_secs())).to_string()
            }
            Field::NoticeId => self.notice_id.clone(),
            Field::Detail => self.detail.clone(),
            Field::Action => self.action.clone(),
            Field::Message => if o.is_some() { "outcome" } else { "start" }.to_string(),
            Field::Summary => self.summary(now),
            Field::Severity => match o {
                None => "warning",
                Some(o) if o.ok => "info",
                Some(_) => "error",
            }
            .to_string(),
            Field::EventAction => match o {
                Some(o) if o.ok => "resolve",
                _ => "trigger",
            }
            .to_string(),
            Field::DryRun => ctx.dry_run.to_string(),
            Field::DryRunTag => if ctx.dry_run { "[DRY RUN] " } else { "" }.to_string(),
            Field::RoutingKey => ctx.routing_key.to_string(),
            Field::Outcome => o.map(|o| o.outcome.clone()).unwrap_or_default(),
            Field::Ok => o.map(|o| o.ok.to_string()).unwrap_or_default(),
            Field::Checkpoint => o.map(|o| o.checkpoint.clone()).unwrap_or_default(),
            Field::Step => o
                .and_then(|o| o.step)
                .map(|s| s.to_string())
                .unwrap_or_default(),
            Field::CheckpointSeconds => num(o.and_then(|o| o.checkpoint_seconds)),
            Field::BudgetSeconds => num(o.and_then(|o| o.budget_seconds)),
            Field::HeadroomSeconds => {
                num(o.and_then(|o| Some((o.budget_seconds? - o.checkpoint_seconds?).max(0.0))))
            }
            Field::Evicted => o.map(|o| o.evicted.to_string()).unwrap_or_default(),
            Field::Blocked => o
                .map(|o| o.blocked_pods.len().to_string())
                .unwrap_or_default(),
            Field::BlockedPods => o.map(|o| o.blocked_pods.join(", ")).unwrap_or_default(),
            Field::BlockingPdbs => o.map(|o| o.blocking_pdbs.join(", ")).unwrap_or_default(),
            Field::DrainError => o.map(|o| o.drain_error.clone()).unwrap_or_default(),
            Field::PlanSeconds => num(o.map(|o| o.plan_seconds)),
        }
    }
}

fn secs(s: f64) -> String {
    format!("{s:.1}s")
}

/// Per-webhook values (not per message).
#[derive(Clone, Copy, Debug, Default)]
struct Ctx<'a> {
    dry_run: bool,
    routing_key: &'a str,
}

macro_rules! fields {
    ($($name:literal => $variant:ident),* $(,)?) => {
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        enum Field { $($variant),* }
        impl Field {
            fn parse(name: &str) -> Option<Field> {
                Some(match name { $($name => Field::$variant,)* _ => return None })
            }
        }
    };
}

fields! {
    "node" => Node,
    "instance" => Instance,
    "kind" => Kind,
    "source" => Source,
    "deadline" => Deadline,
    "deadline_unix" => DeadlineUnix,
    "time_left" => TimeLeft,
    "notice_id" => NoticeId,
    "detail" => Detail,
    "action" => Action,
    "message" => Message,
    "summary" => Summary,
    "severity" => Severity,
    "event_action" => EventAction,
    "dry_run" => DryRun,
    "dry_run_tag" => DryRunTag,
    "routing_key" => RoutingKey,
    "outcome" => Outcome,
    "ok" => Ok,
    "checkpoint" => Checkpoint,
    "step" => Step,
    "checkpoint_seconds" => CheckpointSeconds,
    "budget_seconds" => BudgetSeconds,
    "headroom_seconds" => HeadroomSeconds,
    "evicted" => Evicted,
    "blocked" => Blocked,
    "blocked_pods" => BlockedPods,
    "blocking_pdbs" => BlockingPdbs,
    "drain_error" => DrainError,
    "plan_seconds" => PlanSeconds,
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

/// Which message a template is for (decides the values it is checked with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    Start,
    Outcome,
}

impl Template {
    #[cfg(test)]
    fn parse(text: &str) -> Result<Template, Error> {
        Self::parse_for(text, MessageKind::Start)
    }

    fn parse_for(text: &str, kind: MessageKind) -> Result<Template, Error> {
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
        // The body must be JSON whatever the values are: render with values that need escaping,
        // and (for outcome messages) with every optional value both present and absent.
        let probe = NotifyFields {
            node: "n\"o\\de\n".into(),
            instance: "i-0{}".into(),
            kind: "interruption".into(),
            source: "aws".into(),
            deadline: None,
            notice_id: "id\t1".into(),
            detail: "\u{1}<>&'".into(),
            action: "checkpoint and drain".into(),
            outcome: None,
        };
        let mut probes = vec![probe.clone()];
        if kind == MessageKind::Outcome {
            probes = vec![
                NotifyFields {
                    outcome: Some(PlanOutcome::default()),
                    ..probe.clone()
                },
                NotifyFields {
                    outcome: Some(PlanOutcome {
                        outcome: "drain_failed".into(),
                        ok: false,
                        checkpoint: "1 acked, 1 \"timeout\"".into(),
                        step: Some(1200),
                        checkpoint_seconds: Some(31.5),
                        budget_seconds: Some(90.0),
                        evicted: 3,
                        blocked_pods: vec!["ns/p\"o".into()],
                        blocking_pdbs: vec!["pdb\\1".into()],
                        drain_error: "api\nserver".into(),
                        plan_seconds: 48.0,
                    }),
                    ..probe
                },
            ];
        }
        for (i, p) in probes.iter().enumerate() {
            let ctx = Ctx {
                dry_run: i % 2 == 0,
                routing_key: "k\"ey",
            };
            let rendered = template.render(p, Timestamp::UNIX_EPOCH, ctx);
            serde_json::from_str::<serde_json::Value>(&rendered).map_err(|e| Error::Template {
                reason: format!(
                    "does not render to valid JSON ({e}); placeholders are substituted as \
                         escaped string contents, so put them inside quotes"
                ),
            })?;
        }
        Ok(template)
    }

    fn render(&self, fields: &NotifyFields, now: Timestamp, ctx: Ctx<'_>) -> String {
        let mut out = String::new();
        for segment in &self.segments {
            match segment {
                Segment::Literal(s) => out.push_str(s),
                Segment::Placeholder(field) => {
                    out.push_str(&json_escape(&fields.value(*field, now, ctx)))
                }
            }
        }
        out
    }
}

/// Check a template at start-up: `Err` names the problem.
pub fn check_template(text: &str, kind: MessageKind) -> Result<(), Error> {
    Template::parse_for(text, kind).map(|_| ())
}

/// `--webhook-header "Name: value"` → a validated header pair.
pub fn parse_header(text: &str) -> Result<(http::HeaderName, http::HeaderValue), String> {
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| "expected \"Name: value\"".to_string())?;
    let name = http::HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("{:?} is not a header name", name.trim()))?;
    if name == http::header::CONTENT_TYPE || name == http::header::CONTENT_LENGTH {
        return Err(format!("{name} is set by spotguard"));
    }
    let mut value = http::HeaderValue::from_str(value.trim())
        .map_err(|_| format!("the value of {name} has characters a header cannot carry"))?;
    value.set_sensitive(true);
    Ok((name, value))
}

/// What a webhook does in `--dry-run`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DryRunWebhook {
    /// Send, marked: `{{dry_run}}` is `true`, `{{dry_run_tag}}` is `[DRY RUN] ` and the request
    /// carries `X-Spotguard-Dry-Run: true`.
    #[default]
    Mark,
    /// Do not send (logged and counted as `suppressed`).
    Suppress,
}

/// Everything about a webhook besides its URL.
#[derive(Clone, Debug)]
pub struct Options {
    pub preset: Preset,
    /// Start message body; `None`: the preset's.
    pub template: Option<String>,
    /// Outcome message body; `None`: the preset's.
    pub outcome_template: Option<String>,
    /// Extra request headers (e.g. `Authorization`).
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
    /// The agent runs with `--dry-run`.
    pub dry_run: bool,
    pub on_dry_run: DryRunWebhook,
    /// `{{routing_key}}` (PagerDuty).
    pub routing_key: Option<String>,
    pub policy: RetryPolicy,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            preset: Preset::Slack,
            template: None,
            outcome_template: None,
            headers: Vec::new(),
            dry_run: false,
            on_dry_run: DryRunWebhook::Mark,
            routing_key: None,
            policy: RetryPolicy::default(),
        }
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
    /// Backoff step before the first retry; doubled each time ([`crate::backoff`]: each wait is
    /// uniformly 50–100 % of the step).
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
    /// The backoff between tries: `base_delay` doubling up to `max_delay`.
    fn backoff(&self) -> Backoff {
        Backoff::new(self.base_delay, self.max_delay)
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
    outcome_template: Template,
    headers: reqwest::header::HeaderMap,
    dry_run: bool,
    on_dry_run: DryRunWebhook,
    routing_key: String,
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
        Self::with_options(
            url,
            Options {
                template,
                policy,
                ..Options::default()
            },
            metrics,
        )
    }

    /// The full constructor: preset, both templates, headers, dry-run handling.
    pub fn with_options(url: String, opts: Options, metrics: Arc<Metrics>) -> Result<Self, Error> {
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
        let policy = opts.policy;
        // At least the first try.
        let policy = RetryPolicy {
            attempts: policy.attempts.max(1),
            ..policy
        };
        let (start_default, outcome_default) = opts.preset.templates();
        let template = Template::parse_for(
            opts.template.as_deref().unwrap_or(start_default),
            MessageKind::Start,
        )?;
        let outcome_template = Template::parse_for(
            opts.outcome_template.as_deref().unwrap_or(outcome_default),
            MessageKind::Outcome,
        )
        .map_err(|e| match e {
            Error::Template { reason } => Error::Template {
                reason: format!("(outcome) {reason}"),
            },
            other => other,
        })?;
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in &opts.headers {
            headers.append(name.clone(), value.clone());
        }
        if opts.dry_run {
            headers.insert(
                "x-spotguard-dry-run",
                reqwest::header::HeaderValue::from_static("true"),
            );
        }
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
                outcome_template,
                headers,
                dry_run: opts.dry_run,
                on_dry_run: opts.on_dry_run,
                routing_key: opts.routing_key.unwrap_or_default(),
                client,
                policy,
                metrics,
            }),
        })
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            dry_run: self.inner.dry_run,
            routing_key: &self.inner.routing_key,
        }
    }

    /// The body that would be sent for `fields` at time `now` (the outcome template when
    /// `fields.outcome` is set).
    pub fn render(&self, fields: &NotifyFields, now: Timestamp) -> String {
        let template = if fields.outcome.is_some() {
            &self.inner.outcome_template
        } else {
            &self.inner.template
        };
        template.render(fields, now, self.ctx())
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

    /// POST the rendered body, retrying within the policy. Logs and counts the outcome. In
    /// dry-run with [`DryRunWebhook::Suppress`], nothing is sent (counted as `suppressed`).
    pub async fn send(&self, fields: &NotifyFields) -> Result<(), Error> {
        let inner = &self.inner;
        let message = if fields.outcome.is_some() {
            "outcome"
        } else {
            "start"
        };
        if inner.dry_run && inner.on_dry_run == DryRunWebhook::Suppress {
            info!(url = %inner.shown, notice_id = %fields.notice_id, message, "webhook suppressed (dry run)");
            self.count("suppressed");
            return Ok(());
        }
        let body = self.render(fields, Timestamp::now());
        let result = self.send_with_retries(body).await;
        match &result {
            Ok(()) => {
                info!(url = %inner.shown, notice_id = %fields.notice_id, message, "webhook sent");
                self.count("sent");
            }
            Err(e) => {
                warn!(url = %inner.shown, notice_id = %fields.notice_id, message, error = %e, "webhook failed");
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
        let mut backoff = policy.backoff();
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
            // Give up after the last try, or when the wait would reach the total bound.
            let delay = match backoff.next_delay_before(deadline) {
                Some(delay) if tries < policy.attempts => delay,
                _ => {
                    return Err(Error::GaveUp {
                        url: inner.shown.clone(),
                        tries,
                        last: Box::new(err),
                    })
                }
            };
            debug!(url = %inner.shown, error = %err, tries, delay_ms = delay.as_millis() as u64, "webhook retry");
            self.count("retry");
            tokio::time::sleep(delay).await;
        }
    }

    async fn post_once(&self, body: String) -> Result<(), Error> {
        let inner = &self.inner;
        let response = inner
            .client
            .post(inner.url.clone())
            .headers(inner.headers.clone())
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
            outcome: None,
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
        let v: serde_json::Value =
            serde_json::from_str(&t.render(&fields(), now(), Ctx::default())).unwrap();
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
            "message": "start",
            "summary": "interruption notice on node gpu-node-1 (aws), deadline 2023-11-14T22:15:20Z (2m left): checkpoint and drain",
            "severity": "warning",
            "event_action": "trigger",
            "dry_run": "false",
            "dry_run_tag": "",
            "routing_key": "",
            "outcome": "",
            "ok": "",
            "checkpoint": "",
            "step": "",
            "checkpoint_seconds": "",
            "budget_seconds": "",
            "headroom_seconds": "",
            "evicted": "",
            "blocked": "",
            "blocked_pods": "",
            "blocking_pdbs": "",
            "drain_error": "",
            "plan_seconds": "",
        });
        assert_eq!(v, want);
        // The outcome message fills the outcome placeholders.
        let mut f = fields();
        f.outcome = Some(PlanOutcome {
            outcome: "completed".into(),
            ok: true,
            checkpoint: "1 acked".into(),
            step: Some(7),
            checkpoint_seconds: Some(30.0),
            budget_seconds: Some(90.0),
            evicted: 2,
            plan_seconds: 41.25,
            ..PlanOutcome::default()
        });
        let v: serde_json::Value = serde_json::from_str(&t.render(
            &f,
            now(),
            Ctx {
                dry_run: true,
                routing_key: "k",
            },
        ))
        .unwrap();
        for (k, want) in [
            ("message", "outcome"),
            ("severity", "info"),
            ("event_action", "resolve"),
            ("dry_run", "true"),
            ("dry_run_tag", "[DRY RUN] "),
            ("routing_key", "k"),
            ("ok", "true"),
            ("step", "7"),
            ("headroom_seconds", "60.0"),
            ("evicted", "2"),
            ("blocked", "0"),
            ("plan_seconds", "41.2"),
        ] {
            assert_eq!(v[k], want, "{k}");
        }
    }

    #[test]
    fn no_deadline_means_now() {
        let t =
            Template::parse(r#"{"a": "{{deadline}}|{{deadline_unix}}|{{time_left}}"}"#).unwrap();
        let mut f = fields();
        f.deadline = None;
        assert_eq!(t.render(&f, now(), Ctx::default()), r#"{"a": "now||0s"}"#);
        // A deadline in the past: zero time left.
        f.deadline = Some(Timestamp::from_second(1_600_000_000).unwrap());
        assert!(t.render(&f, now(), Ctx::default()).ends_with("|0s\"}"));
    }

    #[test]
    fn placeholders_tolerate_inner_spaces_and_repeat() {
        let t = Template::parse(r#"{"t": "{{ node }}/{{node}}"}"#).unwrap();
        assert_eq!(
            t.render(&fields(), now(), Ctx::default()),
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
            let rendered = t.render(&f, now(), Ctx::default());
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
        let v: serde_json::Value =
            serde_json::from_str(&t.render(&fields(), now(), Ctx::default())).unwrap();
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
            let d1 = p.backoff().delay(1);
            assert!(d1 >= Duration::from_millis(200) && d1 <= Duration::from_millis(400));
            let d3 = p.backoff().delay(3);
            assert!(d3 >= Duration::from_millis(800) && d3 <= Duration::from_millis(1600));
            let d9 = p.backoff().delay(9);
            assert!(d9 >= Duration::from_secs(1) && d9 <= Duration::from_secs(2));
            assert!(p.backoff().delay(u32::MAX) <= Duration::from_secs(2));
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
                outcome: None,
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
