//! HTTP response helpers and the clouds' time formats.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::Full;
use jiff::Timestamp;

pub(super) type Body = Full<Bytes>;

pub(super) fn response(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut resp = Response::new(Full::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

pub(super) fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    response(status, "text/plain", body)
}

pub(super) fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    response(status, "application/json", value.to_string())
}

/// Add a header whose value is built from data (a token, an etag); invalid values are skipped
/// with a log line rather than a panic.
pub(super) fn set_header(resp: &mut Response<Body>, name: &'static str, value: &str) {
    match HeaderValue::from_str(value) {
        Ok(v) => {
            resp.headers_mut().insert(HeaderName::from_static(name), v);
        }
        Err(_) => tracing::warn!(
            header = name,
            "emulator: header value not representable, omitted"
        ),
    }
}

/// A small HTML error page in the style of the clouds' front ends.
pub(super) fn html_error(status: StatusCode) -> Response<Body> {
    let code = status.as_u16();
    let reason = status.canonical_reason().unwrap_or("Error");
    response(
        status,
        "text/html",
        format!(
            "<?xml version=\"1.0\" encoding=\"iso-8859-1\"?>\n<!DOCTYPE html>\n<html><head><title>{code} - {reason}</title></head>\
             <body><h1>{code} - {reason}</h1></body></html>\n"
        ),
    )
}

/// Body of the `garbage` fault: valid in no protocol (not JSON, not `TRUE`/`FALSE`, not a token
/// an IMDS would accept), but a legal single-line header value so clients exercise their parsers.
pub(super) const GARBAGE: &str = "<html>spotguard-emulator garbage</html>{\"action\": \"termin";

fn format(ts: Timestamp, fmt: &str) -> String {
    jiff::fmt::strtime::format(fmt, ts).unwrap_or_else(|_| ts.to_string())
}

/// Whole seconds (the clouds never send fractions).
fn whole(ts: Timestamp) -> Timestamp {
    Timestamp::from_second(ts.as_second()).unwrap_or(ts)
}

/// `2026-11-22T12:00:00Z` (EC2 `time`/`noticeTime`, GCE windows).
pub(super) fn rfc3339(ts: Timestamp) -> String {
    format(whole(ts), "%Y-%m-%dT%H:%M:%SZ")
}

/// `21 Jan 2019 09:00:43 GMT` (EC2 scheduled events).
pub(super) fn ec2_event_time(ts: Timestamp) -> String {
    format(whole(ts), "%d %b %Y %H:%M:%S GMT")
}

/// `Mon, 19 Sep 2016 18:29:47 GMT` (RFC 1123; Azure `NotBefore`).
pub(super) fn rfc1123(ts: Timestamp) -> String {
    format(whole(ts), "%a, %d %b %Y %H:%M:%S GMT")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_formats_match_the_clouds_examples() {
        let ts: Timestamp = "2016-09-19T18:29:47.900Z".parse().unwrap();
        assert_eq!(rfc3339(ts), "2016-09-19T18:29:47Z");
        assert_eq!(rfc1123(ts), "Mon, 19 Sep 2016 18:29:47 GMT");
        let ts: Timestamp = "2019-01-21T09:00:43Z".parse().unwrap();
        assert_eq!(ec2_event_time(ts), "21 Jan 2019 09:00:43 GMT");
        let early: Timestamp = "2019-01-05T09:00:43Z".parse().unwrap();
        assert_eq!(ec2_event_time(early), "05 Jan 2019 09:00:43 GMT");
    }
}
