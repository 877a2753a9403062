//! Object-store locations: parsing `s3://`, `gs://` and `file://` URLs (sources of datasets,
//! destinations of checkpoints), deriving a name from one, and building the [`ObjectStore`] that
//! serves it (one client setup, retries and checksum headers for both directions).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::gcp::{GoogleCloudStorage, GoogleCloudStorageBuilder};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::Error;

/// Where a dataset comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Amazon S3 or an S3-compatible server (`--endpoint`).
    S3,
    /// Google Cloud Storage.
    Gcs,
    /// A local (or NFS-mounted) directory.
    File,
}

impl Scheme {
    /// The URL scheme.
    pub fn as_str(&self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Gcs => "gs",
            Scheme::File => "file",
        }
    }
}

/// 8 hex digits of the SHA-256 of `s`.
fn short_digest(s: &str) -> String {
    let mut h = super::key::short_hash(s);
    h.truncate(8);
    h
}

/// A parsed source URL: `s3://bucket/prefix`, `gs://bucket/prefix` or `file:///abs/dir`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceUrl {
    pub scheme: Scheme,
    /// Bucket (empty for `file://`).
    pub bucket: String,
    /// Key prefix without leading or trailing `/` (for `file://`: the absolute directory without
    /// its leading `/`). Every object under `prefix/` belongs to the dataset.
    pub prefix: String,
    /// The URL as given.
    pub url: String,
    /// `prefix` as a store path (`None` = list everything).
    list_prefix: Option<ObjectPath>,
}

/// An http(s) URL with a host (`--endpoint`, `--webhook-url`): trailing slashes dropped. The
/// message names what is wrong; clap puts the flag in front of it.
pub fn parse_http_url(s: &str) -> Result<String, String> {
    let trimmed = s.trim();
    let rest = trimmed
        .strip_prefix("http://")
        .or_else(|| trimmed.strip_prefix("https://"))
        .ok_or_else(|| format!("{s:?} must start with http:// or https://"))?;
    let host = rest.split(['/', '?', '#']).next().unwrap_or("");
    if host.is_empty() {
        return Err(format!(
            "{s:?} has no host after the scheme (e.g. https://hooks.example.com/…)"
        ));
    }
    if rest.contains(char::is_whitespace) {
        return Err(format!("{s:?} has a space in it"));
    }
    Ok(trimmed.trim_end_matches('/').to_string())
}

impl SourceUrl {
    /// Parse and validate a source URL.
    pub fn parse(url: &str) -> Result<SourceUrl, Error> {
        let invalid = |reason: &str| Error::InvalidUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = if let Some(rest) = url.strip_prefix("s3://") {
            (Scheme::S3, rest)
        } else if let Some(rest) = url.strip_prefix("gs://") {
            (Scheme::Gcs, rest)
        } else if let Some(rest) = url.strip_prefix("file://") {
            (Scheme::File, rest)
        } else {
            return Err(invalid(
                "expected s3://bucket/prefix, gs://bucket/prefix or file:///dir",
            ));
        };
        if rest.contains(['?', '#']) || rest.contains('\0') {
            return Err(invalid("query strings and fragments are not supported"));
        }
        let (bucket, prefix) = match scheme {
            Scheme::File => {
                let Some(path) = rest.strip_prefix('/') else {
                    return Err(invalid("file:// URLs need an absolute path (file:///dir)"));
                };
                (String::new(), path.trim_matches('/').to_string())
            }
            Scheme::S3 | Scheme::Gcs => {
                let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
                if bucket.is_empty() {
                    return Err(invalid("missing bucket name"));
                }
                if !bucket
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                {
                    return Err(invalid(
                        "bucket names use letters, digits, '-', '.' and '_'",
                    ));
                }
                (bucket.to_string(), prefix.trim_matches('/').to_string())
            }
        };
        let list_prefix = match scheme {
            // The local store is rooted at the directory itself.
            Scheme::File => None,
            Scheme::S3 | Scheme::Gcs if prefix.is_empty() => None,
            Scheme::S3 | Scheme::Gcs => {
                Some(ObjectPath::parse(&prefix).map_err(|e| invalid(&format!("bad prefix: {e}")))?)
            }
        };
        if scheme == Scheme::File && !prefix.is_empty() {
            ObjectPath::parse(&prefix).map_err(|e| invalid(&format!("bad path: {e}")))?;
        }
        Ok(SourceUrl {
            scheme,
            bucket,
            prefix,
            url: url.to_string(),
            list_prefix,
        })
    }

    /// The dataset name used when none is given: readable (scheme, bucket and prefix joined with
    /// `-`) plus a short hash of the normalized source (scheme, bucket, prefix), so that no two
    /// sources share a directory: `s3://bkt/imagenet/train` → `s3-bkt-imagenet-train-1a2b3c4d`,
    /// while `s3://bkt-imagenet/train` and `gs://bkt/imagenet/train` get other hashes. A trailing
    /// `/` does not change the name.
    pub fn default_name(&self) -> String {
        let scheme = self.scheme.as_str();
        let mut parts: Vec<&str> = vec![scheme];
        if !self.bucket.is_empty() {
            parts.push(&self.bucket);
        }
        parts.extend(self.prefix.split('/').filter(|s| !s.is_empty()));
        let joined = parts.join("-");
        let mut name: String = joined
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let digest = short_digest(&self.normalized());
        // Room for "-" and the digest.
        let room = MAX_NAME_LEN - digest.len() - 1;
        if name.len() > room {
            name.truncate(room);
        }
        name.push('-');
        name.push_str(&digest);
        name
    }

    /// `scheme://bucket/prefix` without a trailing `/`: what identifies the source.
    pub fn normalized(&self) -> String {
        match self.scheme {
            Scheme::File => format!("file:///{}", self.prefix),
            _ => format!("{}://{}/{}", self.scheme.as_str(), self.bucket, self.prefix),
        }
    }

    /// The listing prefix inside the store (`None` = everything).
    pub fn list_prefix(&self) -> Option<&ObjectPath> {
        self.list_prefix.as_ref()
    }

    /// The key of `location` relative to the dataset prefix (`None` if it is outside it).
    pub fn relative_key<'a>(&self, location: &'a str) -> Option<&'a str> {
        match self.list_prefix() {
            None => Some(location),
            Some(_) => location
                .strip_prefix(self.prefix.as_str())
                .and_then(|rest| rest.strip_prefix('/')),
        }
    }
}

/// Longest dataset name accepted or derived.
pub const MAX_NAME_LEN: usize = 100;

/// Validate an operator-chosen dataset name: one path component of letters, digits, `-`, `_`,
/// `.`, not starting with `.`.
pub fn validate_name(name: &str) -> Result<(), Error> {
    let bad = |reason: &str| Error::InvalidName {
        name: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() {
        return Err(bad("empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad("longer than 100 characters"));
    }
    if name.starts_with('.') {
        return Err(bad("starts with '.'"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(bad("use letters, digits, '-', '_' and '.' only"));
    }
    Ok(())
}

/// Parse a dataset spec as given to `--prefetch`: `NAME=URL`, or a bare URL (the name is then
/// derived from it). Both parts are validated. Returns `(name, url)`.
pub fn parse_spec(spec: &str) -> Result<(String, String), Error> {
    let spec = spec.trim();
    let (name, url) = match spec.split_once('=') {
        // `=` inside a URL (after "://") is not a separator.
        Some((name, url)) if !name.contains("://") => (name.trim().to_string(), url.trim()),
        _ => (String::new(), spec),
    };
    let src = SourceUrl::parse(url)?;
    let name = if name.is_empty() {
        src.default_name()
    } else {
        name
    };
    validate_name(&name)?;
    Ok((name, url.to_string()))
}

/// How to reach the store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// S3-compatible endpoint (`http://127.0.0.1:9000`); path-style requests, plain HTTP allowed
    /// when the URL says `http://`.
    pub endpoint: Option<String>,
    /// Idle connections kept per host (the download concurrency).
    pub pool: usize,
    /// Bound on one request including its body (requests are at most one part long).
    pub request_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            endpoint: None,
            pool: 64,
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// Build the store for `src`. S3 reads the usual `AWS_*` environment (keys, `AWS_REGION`,
/// `AWS_ENDPOINT_URL`, `AWS_WEB_IDENTITY_TOKEN_FILE` for IRSA) and falls back to the instance
/// role through IMDS; GCS reads `GOOGLE_*` and falls back to the metadata server's token.
pub fn build_store(src: &SourceUrl, opts: &StoreOptions) -> Result<Arc<dyn ObjectStore>, Error> {
    match src.scheme {
        Scheme::S3 => Ok(Arc::new(build_s3(src, opts)?)),
        Scheme::Gcs => Ok(Arc::new(build_gcs(src, opts)?)),
        Scheme::File => {
            let dir = PathBuf::from(format!("/{}", src.prefix));
            if !dir.is_dir() {
                return Err(Error::InvalidUrl {
                    url: src.url.clone(),
                    reason: format!("{} is not a directory", dir.display()),
                });
            }
            Ok(Arc::new(LocalFileSystem::new_with_prefix(&dir).map_err(
                |source| Error::BuildStore {
                    url: src.url.clone(),
                    source,
                },
            )?))
        }
    }
}

fn client_options(opts: &StoreOptions) -> ClientOptions {
    ClientOptions::new()
        .with_timeout(opts.request_timeout)
        .with_connect_timeout(Duration::from_secs(10))
        .with_pool_max_idle_per_host(opts.pool.max(1))
}

/// 503 SlowDown and other 5xx answers are retried inside object_store with this backoff.
fn retry_config() -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: 10,
        retry_timeout: Duration::from_secs(180),
    }
}

/// The S3 store for an `s3://` URL as a concrete type (the checkpoint uploader also needs its
/// [`object_store::multipart::MultipartStore`] side); [`build_store`] explains the credentials.
pub fn build_s3(src: &SourceUrl, opts: &StoreOptions) -> Result<AmazonS3, Error> {
    let build_err = |source: object_store::Error| Error::BuildStore {
        url: src.url.clone(),
        source,
    };
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(&src.bucket)
        .with_retry(retry_config());
    let mut client = client_options(opts);
    if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none()
    {
        b = b.with_region("us-east-1");
    }
    // Ask for the objects' additional checksums (signed: object_store adds default
    // headers to GET and HEAD before signing); the connector reads them back.
    let mut headers = http::HeaderMap::new();
    headers.insert(
        super::checksum::CHECKSUM_MODE,
        http::HeaderValue::from_static("ENABLED"),
    );
    client = client.with_default_headers(headers);
    b = b.with_http_connector(super::checksum::ChecksumConnector);
    if let Some(endpoint) = &opts.endpoint {
        let endpoint = endpoint.trim_end_matches('/');
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(Error::InvalidUrl {
                url: endpoint.to_string(),
                reason: "the endpoint must start with http:// or https://".to_string(),
            });
        }
        client = client.with_allow_http(endpoint.starts_with("http://"));
        b = b
            .with_endpoint(endpoint)
            .with_virtual_hosted_style_request(false);
    }
    b.with_client_options(client).build().map_err(build_err)
}

/// The GCS store for a `gs://` URL as a concrete type (see [`build_s3`]).
pub fn build_gcs(src: &SourceUrl, opts: &StoreOptions) -> Result<GoogleCloudStorage, Error> {
    GoogleCloudStorageBuilder::from_env()
        .with_http_connector(super::checksum::ChecksumConnector)
        .with_bucket_name(&src.bucket)
        .with_retry(retry_config())
        .with_client_options(client_options(opts))
        .build()
        .map_err(|source| Error::BuildStore {
            url: src.url.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_or_without_a_name() {
        assert_eq!(
            parse_spec("imagenet=s3://bkt/imagenet/train").unwrap(),
            (
                "imagenet".to_string(),
                "s3://bkt/imagenet/train".to_string()
            )
        );
        let (name, url) = parse_spec("gs://b/p").unwrap();
        assert_eq!(url, "gs://b/p");
        assert!(
            name.starts_with("gs-b-p-") && name.len() == "gs-b-p-".len() + 8,
            "{name}"
        );
        assert!(matches!(
            parse_spec("../x=s3://b/p"),
            Err(Error::InvalidName { .. })
        ));
        assert!(matches!(
            parse_spec("x=http://b/p"),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(parse_spec("x="), Err(Error::InvalidUrl { .. })));
    }

    #[test]
    fn parses_the_three_schemes() {
        let s = SourceUrl::parse("s3://bkt/imagenet/train/").unwrap();
        assert_eq!(s.scheme, Scheme::S3);
        assert_eq!(s.bucket, "bkt");
        assert_eq!(s.prefix, "imagenet/train");
        assert!(s.default_name().starts_with("s3-bkt-imagenet-train-"));
        assert_eq!(s.relative_key("imagenet/train/a/b.bin"), Some("a/b.bin"));
        assert_eq!(s.relative_key("imagenet/training/x"), None);

        let g = SourceUrl::parse("gs://b/p").unwrap();
        assert_eq!(g.scheme, Scheme::Gcs);
        assert!(g.default_name().starts_with("gs-b-p-"));

        let f = SourceUrl::parse("file:///data/sets/x").unwrap();
        assert_eq!(f.scheme, Scheme::File);
        assert_eq!(f.prefix, "data/sets/x");
        assert_eq!(f.list_prefix(), None);
        assert_eq!(f.relative_key("a/b"), Some("a/b"));
        assert!(f.default_name().starts_with("file-data-sets-x-"));

        let root = SourceUrl::parse("s3://bkt").unwrap();
        assert_eq!(root.prefix, "");
        assert_eq!(root.list_prefix(), None);
        assert_eq!(root.relative_key("k"), Some("k"));
    }

    #[test]
    fn rejects_bad_urls_and_names() {
        for url in [
            "http://x/y",
            "s3:///prefix",
            "s3://bkt/a/../b",
            "file://relative/dir",
            "s3://b k/x",
            "s3://b/x?versionId=1",
        ] {
            assert!(
                matches!(SourceUrl::parse(url), Err(Error::InvalidUrl { .. })),
                "{url}"
            );
        }
        assert!(validate_name("imagenet-1k_v2.0").is_ok());
        for name in ["", ".hidden", "a/b", "..", "x y", &"n".repeat(101)] {
            assert!(validate_name(name).is_err(), "{name}");
        }
    }

    #[test]
    fn long_derived_names_stay_valid_and_distinct() {
        let a = SourceUrl::parse(&format!("s3://b/{}/a", "p".repeat(150))).unwrap();
        let b = SourceUrl::parse(&format!("s3://b/{}/b", "p".repeat(150))).unwrap();
        assert!(validate_name(&a.default_name()).is_ok());
        assert_ne!(a.default_name(), b.default_name());
        let odd = SourceUrl::parse("s3://b/.x/ü").unwrap();
        assert!(odd.default_name().starts_with("s3-b-.x-_-"));
        assert!(validate_name(&odd.default_name()).is_ok());
    }

    #[test]
    fn derived_names_are_injective_and_ignore_a_trailing_slash() {
        // These all joined to "a-b-c" before.
        let names: Vec<String> = ["s3://a/b/c", "s3://a-b/c", "gs://a/b/c", "s3://a/b-c"]
            .iter()
            .map(|u| SourceUrl::parse(u).unwrap().default_name())
            .collect();
        let distinct: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        for n in &names {
            assert!(validate_name(n).is_ok(), "{n}");
        }
        assert_eq!(
            SourceUrl::parse("s3://a/b/c/").unwrap().default_name(),
            names[0]
        );
    }
}
