//! Optional notification when spotguard starts handling a notice (`--webhook-url`,
//! `--webhook-template`).
//!
//! The body is JSON: Slack-compatible `{"text": "..."}` by default, or a user template with
//! `{{placeholder}}`s (see [`PLACEHOLDERS`]). Substitution is plain string replacement of
//! JSON-escaped values (no quotes added), so placeholders belong inside JSON strings. The
//! template is checked at start-up: an unknown or unclosed placeholder, or a template that does
//! not render to valid JSON, is an error naming the problem.
//!
//! Delivery is a POST with a short per-try timeout, retried with the project's backoff
//! within a bounded number of tries and a bounded total time. [`Webhook::notify`] runs it in a
//! spawned task, so it never delays the checkpoint or the drain. Every notification is counted in
//! `spotguard_webhook_total{outcome}`: `sent` or `failed` once per notification, `retry` once per
//! retried try.
//!
//! Webhook URLs usually embed a secret (Slack's do): logs and errors show only scheme and host.
//!
//! Here: the notifier ([`Webhook`]: construction, dry-run handling, logging and counting), its
//! options and errors. `fields` says what a message carries ([`NotifyFields`]) and what each
//! placeholder is worth; `template` parses, validates and renders bodies; `presets` holds the
//! Slack / Teams / PagerDuty bodies; `deliver` owns the URL, the HTTP client and the POST with
//! its retries ([`crate::backoff`]).

mod deliver;
mod fields;
mod presets;
mod template;

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use tracing::{info, warn};

pub use deliver::{parse_header, RetryPolicy};
pub use fields::{NotifyFields, PlanOutcome, PLACEHOLDERS};
pub use presets::{Preset, DEFAULT_TEMPLATE};
pub use template::{check_template, MessageKind};

use crate::metrics::{Metrics, OutcomeLabels};
use deliver::Delivery;
use fields::Ctx;
use template::Template;

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
    delivery: Delivery,
    template: Template,
    outcome_template: Template,
    dry_run: bool,
    on_dry_run: DryRunWebhook,
    routing_key: String,
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
            .field("url", &self.inner.delivery.shown)
            .field("policy", &self.inner.delivery.policy)
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
        let url = deliver::parse_url(&url)?;
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
        let delivery = Delivery::new(url, headers, opts.policy)?;
        Ok(Webhook {
            inner: Arc::new(Inner {
                delivery,
                template,
                outcome_template,
                dry_run: opts.dry_run,
                on_dry_run: opts.on_dry_run,
                routing_key: opts.routing_key.unwrap_or_default(),
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
        let shown = &inner.delivery.shown;
        let message = if fields.outcome.is_some() {
            "outcome"
        } else {
            "start"
        };
        if inner.dry_run && inner.on_dry_run == DryRunWebhook::Suppress {
            info!(url = %shown, notice_id = %fields.notice_id, message, "webhook suppressed (dry run)");
            self.count("suppressed");
            return Ok(());
        }
        let body = self.render(fields, Timestamp::now());
        let result = inner.delivery.post(body, || self.count("retry")).await;
        match &result {
            Ok(()) => {
                info!(url = %shown, notice_id = %fields.notice_id, message, "webhook sent");
                self.count("sent");
            }
            Err(e) => {
                warn!(url = %shown, notice_id = %fields.notice_id, message, error = %e, "webhook failed");
                self.count("failed");
                inner.metrics.error("webhook", e.metric_label());
            }
        }
        result
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
