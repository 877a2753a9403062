//! HTTP delivery: the URL (http or https; logs show only scheme and host), extra headers, one
//! POST with a per-try timeout, retried through the project's backoff within a number of tries
//! and a total bound.

use std::time::Duration;

use tracing::debug;

use super::Error;
use crate::backoff::Backoff;

/// Where and how to POST: the validated URL, the headers, the HTTP client and the policy.
pub(super) struct Delivery {
    url: reqwest::Url,
    /// The URL as logs show it ([`redact`]).
    pub(super) shown: String,
    headers: reqwest::header::HeaderMap,
    client: reqwest::Client,
    pub(super) policy: RetryPolicy,
}

/// Check a webhook URL: http or https, with a host.
pub(super) fn parse_url(url: &str) -> Result<reqwest::Url, Error> {
    let parsed = reqwest::Url::parse(url.trim()).map_err(|e| Error::Url {
        url: crate::words::without_credentials(url),
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
    Ok(parsed)
}

impl Delivery {
    /// The HTTP client for `url` (from [`parse_url`]): per-try timeout, no redirects.
    pub(super) fn new(
        url: reqwest::Url,
        headers: reqwest::header::HeaderMap,
        policy: RetryPolicy,
    ) -> Result<Self, Error> {
        // At least the first try.
        let policy = RetryPolicy {
            attempts: policy.attempts.max(1),
            ..policy
        };
        let client = reqwest::Client::builder()
            .timeout(policy.per_try_timeout)
            .connect_timeout(policy.per_try_timeout.min(Duration::from_secs(3)))
            .user_agent(concat!("spotguard/", env!("CARGO_PKG_VERSION")))
            // A redirect would re-send the body somewhere the operator did not configure.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(Error::Client)?;
        Ok(Delivery {
            shown: redact(&url),
            url,
            headers,
            client,
            policy,
        })
    }

    /// POST `body`, retrying retryable failures within the policy; `on_retry` runs before each
    /// retry.
    pub(super) async fn post(&self, body: String, on_retry: impl Fn()) -> Result<(), Error> {
        let policy = &self.policy;
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
                        url: self.shown.clone(),
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
                        url: self.shown.clone(),
                        tries,
                        last: Box::new(err),
                    })
                }
            };
            debug!(url = %self.shown, error = %err, tries, delay_ms = delay.as_millis() as u64, "webhook retry");
            on_retry();
            tokio::time::sleep(delay).await;
        }
    }

    async fn post_once(&self, body: String) -> Result<(), Error> {
        let response = self
            .client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| Error::Request {
                url: self.shown.clone(),
                source: e.without_url(),
            })?;
        let status = response.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(Error::Status {
                url: self.shown.clone(),
                status: status.as_u16(),
            })
        }
    }
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

/// Scheme and host of a URL, for logs: webhook URLs often carry a secret in the path or query.
fn redact(url: &reqwest::Url) -> String {
    crate::words::url(url, crate::words::UrlShown::Origin)
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn url_is_redacted() {
        let u =
            reqwest::Url::parse("https://hooks.slack.com/services/T000/B000/SECRET?x=1").unwrap();
        assert_eq!(redact(&u), "https://hooks.slack.com/…");
        let u = reqwest::Url::parse("http://127.0.0.1:8080/hook/SECRET").unwrap();
        assert_eq!(redact(&u), "http://127.0.0.1:8080/…");
    }
}
