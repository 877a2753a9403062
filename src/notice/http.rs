//! HTTP plumbing the metadata clients share: endpoint URLs (an override may carry a path
//! prefix), the link-local HTTP client, and the request / parse errors naming the URL.

use std::time::Duration;

use reqwest::Url;

use super::Error;

/// Parse one of this crate's constant default endpoints.
pub(crate) fn constant_url(s: &'static str) -> Url {
    // The argument is a compile-time constant checked by unit tests, never outside data.
    Url::parse(s).expect("constant default endpoint is a valid URL")
}

/// `base` + `path`, keeping any path prefix of `base` (an emulator mounted under a prefix).
pub(crate) fn endpoint_url(base: &Url, path: &str) -> Result<Url, Error> {
    let joined = format!("{}{}", base.as_str().trim_end_matches('/'), path);
    Url::parse(&joined).map_err(|e| Error::Parse {
        url: joined.clone(),
        reason: format!("invalid metadata endpoint URL: {e}"),
    })
}

pub(crate) fn request_error(url: &Url, mut source: reqwest::Error) -> Error {
    // The library's error quotes the URL: never with its user name and password.
    if let Some(u) = source.url_mut() {
        let _ = u.set_password(None);
        if !u.username().is_empty() {
            let _ = u.set_username("redacted");
        }
    }
    Error::Request {
        url: url.to_string(),
        source,
    }
}

pub(crate) fn parse_error(url: &Url, reason: impl std::fmt::Display) -> Error {
    Error::Parse {
        url: url.to_string(),
        reason: reason.to_string(),
    }
}

/// Largest metadata answer read, from any cloud or probe. Real answers are a few hundred bytes
/// (an Azure document with many events a few KiB); anything larger is refused, so that an
/// endless or huge body (a broken or hostile endpoint) costs at most this much memory.
pub(crate) const MAX_BODY: usize = 256 * 1024;

/// The body of `resp` as text, read chunk by chunk and refused as soon as it passes
/// [`MAX_BODY`] (a declared `Content-Length` above it is refused before reading): a
/// [`Error::TooLarge`]. Invalid UTF-8 is replaced, as `reqwest::Response::text` does.
pub(crate) async fn read_body(url: &Url, mut resp: reqwest::Response) -> Result<String, Error> {
    read_body_capped(url, &mut resp, MAX_BODY).await
}

pub(crate) async fn read_body_capped(
    url: &Url,
    resp: &mut reqwest::Response,
    limit: usize,
) -> Result<String, Error> {
    let too_large = || Error::TooLarge {
        url: url.to_string(),
        limit,
    };
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let mut body: Vec<u8> = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| request_error(url, e))? {
        if body.len() + chunk.len() > limit {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(match String::from_utf8(body) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// A client builder for a metadata endpoint: no proxy (the service is link-local), and no CA
/// store (saves memory) unless the endpoint is an https override.
pub(crate) fn metadata_client(endpoint: &Url, connect_timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(endpoint.scheme() == "https")
        .connect_timeout(connect_timeout)
}
