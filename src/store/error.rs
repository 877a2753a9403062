//! The object-store floor's errors (a URL, a name or a key refused; a client that cannot be
//! built) and how an object store's failure is classified and worded for both directions.

/// What the store floor refused or failed to set up. Each names the URL, name or key.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid source URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    #[error("invalid dataset name {name:?}: {reason}")]
    InvalidName { name: String, reason: String },

    #[error("cannot set up the object store for {url}: {source}")]
    BuildStore {
        url: String,
        #[source]
        source: object_store::Error,
    },

    #[error("object key {key:?} rejected: {reason}")]
    UnsafeKey { key: String, reason: String },
}

impl Error {
    /// Label for the `error` label of the prefetch and upload error counters.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidUrl { .. } => "invalid_url",
            Error::InvalidName { .. } => "invalid_name",
            Error::BuildStore { .. } => "store_config",
            Error::UnsafeKey { .. } => "unsafe_key",
        }
    }
}

/// Why a request to the store failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetCause {
    /// 404.
    NotFound,
    /// 403: the credentials lack `s3:GetObject` / `storage.objects.get`.
    PermissionDenied,
    /// 401 or a credential provider failure.
    Unauthenticated,
    /// 503 SlowDown / 429, still failing after the retries with backoff.
    Throttled,
    /// Connection, timeout or another server error, after retries.
    Request,
}

impl std::fmt::Display for GetCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GetCause::NotFound => "not found (404)",
            GetCause::PermissionDenied => {
                "access denied (403: check the credentials and the bucket policy)"
            }
            GetCause::Unauthenticated => "not authenticated (401: check the credentials)",
            GetCause::Throttled => "throttled (503 SlowDown; retried with backoff)",
            GetCause::Request => "request failed",
        })
    }
}

/// An object-store failure in words (through [`crate::words::store`], the one place that words
/// them): the classified cause, a refused connection, or a credential provider that found none.
pub fn store_words(e: &object_store::Error) -> String {
    crate::words::store(e, &GetCause::of(e).to_string())
}

/// The store does not do conditional writes (`PutMode::Create`): object_store refuses it
/// itself (`NotImplemented`, `NotSupported`: a client set up without them), or the server
/// answered `501 NotImplemented` to `If-None-Match: *` (older S3-compatible servers; object_store
/// surfaces that as `Generic`, the status inside its private retry error, worded
/// "... 501 Not Implemented ...").
pub fn is_conditional_write_unsupported(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::NotImplemented { .. } | object_store::Error::NotSupported { .. } => {
            true
        }
        object_store::Error::Generic { .. } => {
            let text = crate::words::chain(e);
            text.contains(" 501") || text.contains("NotImplemented")
        }
        _ => false,
    }
}

impl GetCause {
    /// Classify an object store's failure.
    pub fn of(e: &object_store::Error) -> GetCause {
        match e {
            object_store::Error::NotFound { .. } => GetCause::NotFound,
            object_store::Error::PermissionDenied { .. } => GetCause::PermissionDenied,
            object_store::Error::Unauthenticated { .. } => GetCause::Unauthenticated,
            other if crate::words::is_credential_failure(other) => GetCause::Unauthenticated,
            other => {
                // object_store keeps the HTTP status inside its (private) retry error; its text
                // reads "... status code: 503 Service Unavailable ..." and carries S3's code.
                let text = crate::words::chain(other);
                if text.contains("SlowDown")
                    || text.contains(" 503")
                    || text.contains(" 429")
                    || text.contains("TooManyRequests")
                {
                    GetCause::Throttled
                } else if text.contains("InvalidAccessKeyId")
                    || text.contains("SignatureDoesNotMatch")
                    || text.contains("ExpiredToken")
                {
                    GetCause::Unauthenticated
                } else if text.contains(" 403") || text.contains("AccessDenied") {
                    GetCause::PermissionDenied
                } else {
                    GetCause::Request
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_without_conditional_writes_is_recognised_by_each_form_of_its_refusal() {
        let generic = |text: &str| object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        };
        assert!(is_conditional_write_unsupported(
            &object_store::Error::NotImplemented {
                operation: "put_opts".into(),
                implementer: "S3".into(),
            }
        ));
        assert!(is_conditional_write_unsupported(&generic(
            "Server returned non-2xx status code: 501 Not Implemented: <Code>NotImplemented</Code>"
        )));
        assert!(!is_conditional_write_unsupported(&generic(
            "Server returned non-2xx status code: 503 Service Unavailable"
        )));
        assert!(!is_conditional_write_unsupported(
            &object_store::Error::Precondition {
                path: "m".into(),
                source: "412".to_string().into(),
            }
        ));
    }
}
