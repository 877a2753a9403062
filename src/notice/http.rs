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

pub(crate) fn request_error(url: &Url, source: reqwest::Error) -> Error {
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

/// A client builder for a metadata endpoint: no proxy (the service is link-local), and no CA
/// store (saves memory) unless the endpoint is an https override.
pub(crate) fn metadata_client(endpoint: &Url, connect_timeout: Duration) -> reqwest::ClientBuilder {
    reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(endpoint.scheme() == "https")
        .connect_timeout(connect_timeout)
}
