//! Failures of the outside world in words: the one place that turns a transport, object-store or
//! credential-provider failure into what an operator acts on. A refused connection is said as
//! such, with the address; a credential provider that found nothing is said as "no credentials"
//! (never as a denial by the bucket, which was not reached); anything else keeps its status and
//! the innermost cause, without the libraries' wrappers ("error sending request for url").
//! And the one redaction of URLs: a URL's user name and password (`http://admin:S3CRET@host`)
//! never reach a log line, a message or `config check`'s table.

use std::error::Error;

/// How much of a URL a log line or message shows ([`url`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UrlShown {
    /// Scheme, host and port only: a webhook's path and query often are its secret.
    Origin,
    /// Everything but the user name and password (`redacted@`) and the query (`?…`).
    Path,
}

/// `url` as logs show it.
pub fn url(url: &reqwest::Url, shown: UrlShown) -> String {
    match shown {
        UrlShown::Origin => match url.host_str() {
            Some(host) => match url.port() {
                Some(port) => format!("{}://{host}:{port}/…", url.scheme()),
                None => format!("{}://{host}/…", url.scheme()),
            },
            None => format!("{}:…", url.scheme()),
        },
        UrlShown::Path => {
            let mut u = url.clone();
            let query = u.query().is_some();
            u.set_query(None);
            u.set_fragment(None);
            let text = without_credentials(u.as_str());
            if query {
                format!("{text}?…")
            } else {
                text
            }
        }
    }
}

/// `text` with the credentials of every URL in it replaced: `scheme://USER:PASSWORD@host…`
/// becomes `scheme://redacted@host…` (a URL's text, an error chain that quotes one, a setting's
/// value). Everything else is left as it is.
pub fn without_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        // The authority ends at the path, query, fragment, or where the text stops being a URL.
        let end = tail
            .find(|c: char| {
                matches!(c, '/' | '?' | '#' | ')' | '(' | '"' | '\'' | ',') || c.is_whitespace()
            })
            .unwrap_or(tail.len());
        let authority = &tail[..end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("redacted");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// Every message of `e`'s source chain, joined with ": " (URL credentials redacted).
pub fn chain(e: &(dyn Error + 'static)) -> String {
    without_credentials(&chain_as_is(e))
}

fn chain_as_is(e: &(dyn Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}

/// The innermost message of `e`'s source chain (URL credentials redacted).
fn innermost(e: &(dyn Error + 'static)) -> String {
    let mut last = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        last = inner.to_string();
        cur = inner.source();
    }
    without_credentials(&last)
}

/// `host:port` of the first http(s) URL in `text`.
fn first_host(text: &str) -> Option<String> {
    let start = text.find("http://").or_else(|| text.find("https://"))?;
    let rest = &text[start..];
    let rest = &rest[rest.find("//")? + 2..];
    let end = rest
        .find(|c: char| c == '/' || c == ')' || c == '?' || c.is_whitespace())
        .unwrap_or(rest.len());
    let authority = &rest[..end];
    // Never the user name and password.
    Some(match authority.rfind('@') {
        Some(at) => authority[at + 1..].to_string(),
        None => authority.to_string(),
    })
}

/// An HTTP status named in `text` ("403 Forbidden"), if any.
fn status(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    for i in 0..bytes.len().saturating_sub(4) {
        // Bytes first: only ASCII positions are sliced (the text may hold "998.008µs").
        let before_ok = i == 0 || !bytes[i - 1].is_ascii_alphanumeric();
        if before_ok
            && bytes[i..i + 3].iter().all(u8::is_ascii_digit)
            && matches!(bytes[i], b'4' | b'5')
            && bytes[i + 3] == b' '
            && bytes.get(i + 4).is_some_and(|b| b.is_ascii_uppercase())
        {
            let three = &text[i..i + 3];
            let reason: String = text[i + 4..]
                .chars()
                .take_while(|c| c.is_ascii_alphabetic() || *c == ' ')
                .collect();
            return Some(format!("{three} {}", reason.trim()));
        }
    }
    None
}

/// A transport failure in words: "connection refused by HOST:PORT", "timed out", "no such host",
/// else the innermost cause.
pub fn transport(e: &(dyn Error + 'static)) -> String {
    let text = chain(e);
    transport_text(&text).unwrap_or_else(|| innermost(e))
}

fn transport_text(text: &str) -> Option<String> {
    let lower = text.to_ascii_lowercase();
    let at = first_host(text)
        .map(|h| format!(" by {h}"))
        .unwrap_or_default();
    if lower.contains("connection refused") {
        Some(format!(
            "connection refused{at}: nothing listens there (is the address right, and the server running?)"
        ))
    } else if lower.contains("timed out") || lower.contains("timeout") {
        Some(format!("no answer{at}: timed out"))
    } else if lower.contains("dns error") || lower.contains("failed to lookup address") {
        Some(format!(
            "the host name{} does not resolve",
            first_host(text)
                .map(|h| format!(" of {h}"))
                .unwrap_or_default()
        ))
    } else if lower.contains("connection reset") {
        Some(format!("connection reset{at}"))
    } else {
        None
    }
}

/// Where a credential provider of an object-store client goes: instance metadata (EC2, GCE,
/// Azure; by address, or by path when the endpoint is moved), ECS task credentials, STS web
/// identity.
const CREDENTIAL_ENDPOINTS: [&str; 10] = [
    "169.254.169.254",
    "169.254.170.2",
    "fd00:ec2::254",
    "metadata.google.internal",
    "/latest/api/token",
    "/latest/meta-data/iam/",
    "/computeMetadata/v1/instance/service-accounts",
    "/metadata/identity/oauth2/token",
    "AssumeRoleWithWebIdentity",
    "sts.amazonaws.com",
];

/// Whether an object-store failure is its credential provider's (the store was not reached).
pub fn is_credential_failure(e: &(dyn Error + 'static)) -> bool {
    let text = chain(e);
    CREDENTIAL_ENDPOINTS.iter().any(|h| text.contains(h))
        || text.contains("Error getting credentials")
        || text.contains("Error fetching token")
}

/// An object-store failure in words. `cause`: the caller's classification of it ("not found
/// (404)", "access denied (403: …)"), used when the store answered.
pub fn store(e: &(dyn Error + 'static), cause: &str) -> String {
    let text = chain(e);
    if is_credential_failure(e) {
        let how = transport_text(&text)
            .map(|t| {
                t.split(": nothing listens")
                    .next()
                    .unwrap_or_default()
                    .to_string()
            })
            .or_else(|| status(&text).map(|s| format!("answered {s}")))
            .unwrap_or_else(|| innermost(e));
        return format!(
            "no credentials (tried: env, web identity, instance metadata: {how}); the store was not reached. Set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS), or give the machine a role"
        );
    }
    if let Some(t) = transport_text(&text) {
        return t;
    }
    match status(&text) {
        Some(s) if !cause.contains(&s[..3]) => format!("{cause} ({s}): {}", innermost(e)),
        _ => format!("{cause}: {}", innermost(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl Error for E {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn credentials_in_urls_are_never_shown() {
        let text = "request to http://admin:S3CRET@127.0.0.1:1/latest/api/token failed (see https://u@h/x?y), s3://b/k";
        let shown = without_credentials(text);
        assert_eq!(
            shown,
            "request to http://redacted@127.0.0.1:1/latest/api/token failed (see https://redacted@h/x?y), s3://b/k"
        );
        let u = reqwest::Url::parse("http://admin:S3CRET@[fd00:ec2::254]:80/p/?token=T").unwrap();
        assert_eq!(
            url(&u, UrlShown::Path),
            "http://redacted@[fd00:ec2::254]/p/?…"
        );
        assert_eq!(url(&u, UrlShown::Origin), "http://[fd00:ec2::254]/…");
        let u = reqwest::Url::parse("https://hooks.slack.com/services/T/B/X").unwrap();
        assert_eq!(url(&u, UrlShown::Origin), "https://hooks.slack.com/…");
        let u = reqwest::Url::parse("http://127.0.0.1:8080/x?k=v").unwrap();
        assert_eq!(url(&u, UrlShown::Origin), "http://127.0.0.1:8080/…");
        let e = E(
            "error sending request for url (http://admin:S3CRET@127.0.0.1:1/latest/api/token)",
            Some(Box::new(E(
                "tcp connect error: Connection refused (os error 111)",
                None,
            ))),
        );
        for w in [chain(&e), transport(&e)] {
            assert!(!w.contains("S3CRET") && !w.contains("admin"), "{w}");
        }
        assert!(
            transport(&e).contains("by 127.0.0.1:1"),
            "{}",
            transport(&e)
        );
    }

    #[test]
    fn refused_is_said_with_the_address() {
        let e = E(
            "error sending request for url (http://127.0.0.1:1/latest/api/token)",
            Some(Box::new(E(
                "client error (Connect)",
                Some(Box::new(E(
                    "tcp connect error: Connection refused (os error 111)",
                    None,
                ))),
            ))),
        );
        let w = transport(&e);
        assert!(w.starts_with("connection refused by 127.0.0.1:1"), "{w}");
    }

    #[test]
    fn a_status_after_other_scripts_is_found() {
        let e = E(
            "Error performing GET http://127.0.0.1:1/e/secret.bin in 998.008µs - Server returned non-2xx status code: 403 Forbidden: <Error>",
            None,
        );
        assert_eq!(status(&chain(&e)).as_deref(), Some("403 Forbidden"));
        let w = store(
            &e,
            "access denied (403: check the credentials and the bucket policy)",
        );
        assert!(w.starts_with("access denied (403"), "{w}");
    }

    #[test]
    fn a_credential_provider_failure_never_blames_the_bucket() {
        let e = E(
            "Generic S3 error: Error performing PUT http://169.254.169.254/latest/api/token in 1ms - Client error with status 403 Forbidden: No Body",
            None,
        );
        let w = store(
            &e,
            "access denied (403: check the credentials and the bucket policy)",
        );
        assert!(w.starts_with("no credentials (tried: env, web identity, instance metadata: answered 403 Forbidden"), "{w}");
        assert!(!w.contains("bucket policy"), "{w}");
    }
}
