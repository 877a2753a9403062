//! Who may relay to this receiver (docs/relay.md, "Trust"): every request's bearer is checked
//! before anything else is read.
//!
//! - host mode: the node key every agent of the fleet shares (`--relay-key-file`), compared as
//!   SHA-256 digests in constant time;
//! - Kubernetes: a projected ServiceAccount token with the relay's own audience, checked with a
//!   `TokenReview` (authentication.k8s.io/v1): it must be authenticated for that audience, name
//!   the agent's own ServiceAccount and be bound to a pod on a node (the node name in its
//!   extra). Answers are kept a short while (bounded, by the token's SHA-256, never the token),
//!   so the files of one relay cost one review; reviews in flight are bounded too.
//!
//! The sender's side: [`Bearer`], the node key or the token file, read again on each use (the
//! kubelet rotates the projected token).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use sha2::{Digest, Sha256};

/// The audience of the relay's projected token (the DaemonSet's projected volume asks for it).
pub const AUDIENCE: &str = "spotguard-relay";
/// Where the DaemonSet projects the relay's token.
pub const TOKEN_FILE: &str = "/var/run/secrets/spotguard.io/relay/token";
/// The token's extra field naming the node its pod is bound to.
pub const NODE_NAME_EXTRA: &str = "authentication.kubernetes.io/node-name";
/// A review's answer is kept this long.
const KEEP: Duration = Duration::from_secs(30);
/// Answers kept at once.
const MAX_KEPT: usize = 1024;
/// Reviews in flight at once: a flood of forged tokens waits here, not on the API server.
const MAX_REVIEWS: usize = 8;
/// A review is answered within this, or the request is refused as unavailable.
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// No bearer, or not one this receiver accepts.
    #[error("{0}")]
    NotAnAgent(String),
    /// The token could not be reviewed now (the API server did not answer).
    #[error("the token could not be reviewed: {0}")]
    Unavailable(String),
}

impl Denied {
    /// The status the refusal is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Denied::NotAnAgent(_) => StatusCode::UNAUTHORIZED,
            Denied::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// The receiver's check.
pub enum Auth {
    /// Host mode: the node key's SHA-256.
    Key([u8; 32]),
    /// Kubernetes: TokenReview.
    Tokens(Box<Reviewer>),
}

impl Auth {
    /// Host mode with the node `key`.
    pub fn key(key: &[u8]) -> Auth {
        Auth::Key(Sha256::digest(key).into())
    }

    /// `Ok`: the request comes from an agent — in Kubernetes with the node its token is bound to.
    pub async fn check(&self, headers: &HeaderMap) -> Result<Option<String>, Denied> {
        let token = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Denied::NotAnAgent("no bearer token".into()))?;
        match self {
            Auth::Key(hash) => {
                let given: [u8; 32] = Sha256::digest(token).into();
                let diff = given
                    .iter()
                    .zip(hash)
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b));
                if diff == 0 {
                    Ok(None)
                } else {
                    Err(Denied::NotAnAgent("the node key is wrong".into()))
                }
            }
            Auth::Tokens(r) => {
                let token = std::str::from_utf8(token)
                    .map_err(|_| Denied::NotAnAgent("the token is not text".into()))?;
                r.review(token).await.map(Some)
            }
        }
    }
}

/// Reviews relay tokens with the agent's kube client.
pub struct Reviewer {
    client: kube::Client,
    audience: String,
    /// `system:serviceaccount:<namespace>:<name>`: the agents' ServiceAccount.
    username: String,
    kept: Mutex<HashMap<[u8; 32], Kept>>,
    reviews: tokio::sync::Semaphore,
}

#[derive(Clone)]
struct Kept {
    until: Instant,
    answer: Result<String, Denied>,
}

impl Reviewer {
    /// Accept tokens of `namespace`/`service_account` with `audience`.
    pub fn new(
        client: kube::Client,
        audience: &str,
        namespace: &str,
        service_account: &str,
    ) -> Reviewer {
        Reviewer {
            client,
            audience: audience.to_string(),
            username: format!("system:serviceaccount:{namespace}:{service_account}"),
            kept: Mutex::new(HashMap::new()),
            reviews: tokio::sync::Semaphore::new(MAX_REVIEWS),
        }
    }

    /// The node `token` is bound to, when it is an agent's token for this audience.
    pub async fn review(&self, token: &str) -> Result<String, Denied> {
        let id: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(answer) = self.kept(&id) {
            return answer;
        }
        let _permit = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Denied::Unavailable("the receiver is stopping".into()))?;
        // Another request with the same token may have been answered while this one waited.
        if let Some(answer) = self.kept(&id) {
            return answer;
        }
        let answer = match tokio::time::timeout(REVIEW_TIMEOUT, self.ask(token)).await {
            Ok(Ok(review)) => self.judge(&review),
            Ok(Err(e)) => return Err(Denied::Unavailable(e.to_string())),
            Err(_) => return Err(Denied::Unavailable("no answer in time".into())),
        };
        self.keep(id, answer.clone());
        answer
    }

    async fn ask(&self, token: &str) -> Result<TokenReview, kube::Error> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..TokenReview::default()
        };
        kube::Api::<TokenReview>::all(self.client.clone())
            .create(&kube::api::PostParams::default(), &review)
            .await
    }

    /// The review's answer: authenticated, for the audience, the agents' ServiceAccount, a node.
    fn judge(&self, review: &TokenReview) -> Result<String, Denied> {
        let refuse = |why: String| Err(Denied::NotAnAgent(why));
        let Some(status) = &review.status else {
            return refuse("the token review has no status".into());
        };
        if status.authenticated != Some(true) {
            return refuse("the token is not valid for the relay's audience".into());
        }
        if !status
            .audiences
            .as_ref()
            .is_some_and(|a| a.contains(&self.audience))
        {
            return refuse(format!(
                "the token is not for the audience {}",
                self.audience
            ));
        }
        let Some(user) = &status.user else {
            return refuse("the token review names no user".into());
        };
        if user.username.as_deref() != Some(self.username.as_str()) {
            return refuse(format!(
                "the token is not the agents' ServiceAccount's ({})",
                self.username
            ));
        }
        match user
            .extra
            .as_ref()
            .and_then(|e| e.get(NODE_NAME_EXTRA))
            .and_then(|n| n.first())
        {
            Some(node) if !node.is_empty() => Ok(node.clone()),
            _ => refuse("the token is not bound to a pod on a node".into()),
        }
    }

    fn kept(&self, id: &[u8; 32]) -> Option<Result<String, Denied>> {
        let kept = crate::sync::lock(&self.kept);
        kept.get(id)
            .filter(|k| k.until > Instant::now())
            .map(|k| k.answer.clone())
    }

    fn keep(&self, id: [u8; 32], answer: Result<String, Denied>) {
        let now = Instant::now();
        let mut kept = crate::sync::lock(&self.kept);
        if kept.len() >= MAX_KEPT {
            kept.retain(|_, k| k.until > now);
        }
        if kept.len() >= MAX_KEPT {
            kept.clear();
        }
        kept.insert(
            id,
            Kept {
                until: now + KEEP,
                answer,
            },
        );
    }
}

/// What the sender presents.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bearer {
    /// Host mode: the node key.
    Key(String),
    /// Kubernetes: the projected token's file, read on each use.
    TokenFile(PathBuf),
}

impl From<&str> for Bearer {
    fn from(key: &str) -> Bearer {
        Bearer::Key(key.to_string())
    }
}

impl From<String> for Bearer {
    fn from(key: String) -> Bearer {
        Bearer::Key(key)
    }
}

impl Bearer {
    /// The bearer to send now.
    pub fn read(&self) -> Result<String, super::Error> {
        match self {
            Bearer::Key(k) => Ok(k.clone()),
            Bearer::TokenFile(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| super::Error::Io {
                    what: format!("the relay token {}", path.display()),
                    source,
                })?;
                let token = text.trim();
                if token.is_empty() {
                    return Err(super::Error::Io {
                        what: format!("the relay token {}", path.display()),
                        source: std::io::Error::new(std::io::ErrorKind::InvalidData, "empty"),
                    });
                }
                Ok(token.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
        h
    }

    #[tokio::test]
    async fn the_node_key_is_the_only_bearer_host_mode_accepts() {
        let auth = Auth::key(b"0123456789abcdef");
        assert_eq!(
            auth.check(&bearer("Bearer 0123456789abcdef")).await,
            Ok(None)
        );
        for wrong in ["Bearer 0123456789abcdeX", "Bearer ", "0123456789abcdef"] {
            assert!(matches!(
                auth.check(&bearer(wrong)).await,
                Err(Denied::NotAnAgent(_))
            ));
        }
        assert!(auth.check(&HeaderMap::new()).await.is_err());
    }

    #[test]
    fn a_token_file_is_read_again_on_each_use() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "one\n").unwrap();
        let b = Bearer::TokenFile(path.clone());
        assert_eq!(b.read().unwrap(), "one");
        std::fs::write(&path, "two").unwrap();
        assert_eq!(b.read().unwrap(), "two");
        std::fs::write(&path, " \n").unwrap();
        assert!(b.read().is_err());
    }
}
