//! `--cloud auto`: which cloud is this? DMI first (`/sys/class/dmi/id/*`, no network), then
//! concurrent probes of every cloud's metadata service with its required headers; the first
//! positive answer wins. Each cloud's DMI rule and probe are its source's ([`super::CloudFacts`]):
//! EC2 `sys_vendor`/`bios_vendor` "Amazon EC2", `PUT /latest/api/token` answered with a token;
//! GCE `sys_vendor`/`bios_vendor` "Google" or `product_name` "Google Compute Engine",
//! `GET /computeMetadata/v1/instance/id` with `Metadata-Flavor: Google`; Azure `sys_vendor`
//! "Microsoft Corporation" *and* `chassis_asset_tag` 7783-7084-3265-9085-8269-3286-77 (plain
//! Hyper-V has the vendor but not the tag), `GET /metadata/instance/compute/vmId` with
//! `Metadata: true`.

use std::path::Path;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use reqwest::Url;

use super::http::{constant_url, endpoint_url, read_body};
use super::{Cloud, Error};

/// Where DMI identity files live on Linux.
pub const DMI_DIR: &str = "/sys/class/dmi/id";

/// The metadata base URLs to probe. Every cloud serves it at `169.254.169.254` by default;
/// [`ProbeEndpoints::all`] points every probe at one override (`--metadata-endpoint`),
/// [`ProbeEndpoints::with`] one cloud's probe elsewhere.
#[derive(Clone, Debug)]
pub struct ProbeEndpoints {
    all: Url,
    one: Vec<(Cloud, Url)>,
}

impl Default for ProbeEndpoints {
    fn default() -> Self {
        ProbeEndpoints::all(constant_url("http://169.254.169.254"))
    }
}

impl ProbeEndpoints {
    /// Probe every cloud at `endpoint`.
    pub fn all(endpoint: Url) -> Self {
        ProbeEndpoints {
            all: endpoint,
            one: Vec::new(),
        }
    }

    /// Probe `cloud` at `endpoint`.
    pub fn with(mut self, cloud: Cloud, endpoint: Url) -> Self {
        self.one.retain(|(c, _)| *c != cloud);
        self.one.push((cloud, endpoint));
        self
    }

    /// Where `cloud` is probed.
    pub fn of(&self, cloud: Cloud) -> &Url {
        self.one
            .iter()
            .find(|(c, _)| *c == cloud)
            .map_or(&self.all, |(_, u)| u)
    }
}

/// The DMI identity strings used for detection (missing files read as empty).
#[derive(Debug, Default)]
pub struct Dmi {
    pub sys_vendor: String,
    pub bios_vendor: String,
    pub product_name: String,
    pub chassis_asset_tag: String,
}

impl Dmi {
    async fn read(dir: &Path) -> Dmi {
        async fn field(dir: &Path, name: &str) -> String {
            tokio::fs::read_to_string(dir.join(name))
                .await
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        }
        Dmi {
            sys_vendor: field(dir, "sys_vendor").await,
            bios_vendor: field(dir, "bios_vendor").await,
            product_name: field(dir, "product_name").await,
            chassis_asset_tag: field(dir, "chassis_asset_tag").await,
        }
    }

    /// The first cloud whose DMI rule matches.
    fn cloud(&self) -> Option<Cloud> {
        Cloud::ALL.into_iter().find(|c| (c.facts().dmi)(self))
    }
}

/// Detect the cloud: DMI under `dmi_dir`, else the first metadata service among `probe` that
/// answers within `timeout`.
pub async fn detect(
    dmi_dir: &Path,
    probe: &ProbeEndpoints,
    timeout: Duration,
) -> Result<Cloud, Error> {
    detect_counted(dmi_dir, probe, timeout, None).await
}

/// [`detect`], counting a probe answer larger than the metadata body cap in
/// `spotguard_metadata_errors_total{source,error="too_large"}`.
pub async fn detect_counted(
    dmi_dir: &Path,
    probe: &ProbeEndpoints,
    timeout: Duration,
    metrics: Option<&crate::metrics::Metrics>,
) -> Result<Cloud, Error> {
    let dmi = Dmi::read(dmi_dir).await;
    if let Some(cloud) = dmi.cloud() {
        tracing::info!(cloud = %cloud, sys_vendor = %dmi.sys_vendor, "cloud detected from DMI");
        return Ok(cloud);
    }
    let client = probe_client(probe, timeout)?;
    let first = first_answer(&client, probe, timeout, metrics).await;
    match first {
        Some(cloud) => {
            tracing::info!(cloud = %cloud, "cloud detected by metadata probe");
            Ok(cloud)
        }
        None => Err(Error::Detect(format!(
            "DMI under {} names no known cloud (sys_vendor {:?}, bios_vendor {:?}, product_name {:?}) \
             and no metadata service answered within {:?}; set --cloud",
            dmi_dir.display(),
            dmi.sys_vendor,
            dmi.bios_vendor,
            dmi.product_name,
            timeout
        ))),
    }
}

/// The HTTP client of the metadata probes: no proxy, `timeout` to connect and in all.
fn probe_client(probe: &ProbeEndpoints, timeout: Duration) -> Result<reqwest::Client, Error> {
    reqwest::Client::builder()
        .no_proxy()
        // Link-local plain HTTP: no CA store unless an override is https.
        .tls_built_in_root_certs(Cloud::ALL.iter().any(|c| probe.of(*c).scheme() == "https"))
        .timeout(timeout)
        .connect_timeout(timeout)
        .build()
        .map_err(|e| Error::Detect(format!("cannot build HTTP client: {e}")))
}

/// Probe every cloud's metadata service at once: the first that answers (within `timeout`).
async fn first_answer(
    client: &reqwest::Client,
    probe: &ProbeEndpoints,
    timeout: Duration,
    metrics: Option<&crate::metrics::Metrics>,
) -> Option<Cloud> {
    let mut pending = FuturesUnordered::new();
    for cloud in Cloud::ALL {
        let base = probe.of(cloud);
        let p = &cloud.facts().probe;
        let Ok(url) = endpoint_url(base, p.path) else {
            tracing::debug!(cloud = %cloud, base = %base, "probe URL invalid; skipped");
            continue;
        };
        let request = client
            .request(p.method.clone(), url.clone())
            .header(p.header.0, p.header.1);
        pending.push(probe_one(request, url, cloud, metrics));
    }
    tokio::time::timeout(timeout, async {
        while let Some(answer) = pending.next().await {
            if answer.is_some() {
                return answer;
            }
        }
        None
    })
    .await
    .ok()
    .flatten()
}

/// One cloud's probe: `cloud` when its metadata service answers 2xx with a body (within the cap).
async fn probe_one(
    request: reqwest::RequestBuilder,
    url: Url,
    cloud: Cloud,
    metrics: Option<&crate::metrics::Metrics>,
) -> Option<Cloud> {
    let ok = match request.send().await {
        Ok(resp) if resp.status().is_success() => match read_body(&url, resp).await {
            Ok(b) => !b.trim().is_empty(),
            Err(e) => {
                if let (Some(m), Error::TooLarge { .. }) = (metrics, &e) {
                    m.metadata_errors
                        .get_or_create(&crate::metrics::ErrorLabels {
                            source: cloud.as_str().to_string(),
                            error: e.metric_label().to_string(),
                        })
                        .inc();
                }
                tracing::warn!(cloud = %cloud, error = %e, "metadata probe answer refused");
                false
            }
        },
        Ok(resp) => {
            tracing::debug!(cloud = %cloud, status = resp.status().as_u16(), "metadata probe negative");
            false
        }
        Err(e) => {
            tracing::debug!(cloud = %cloud, error = %e, "metadata probe failed");
            false
        }
    };
    ok.then_some(cloud)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Endpoints on a loopback port nobody listens on (bound, then released).
    fn dead_endpoints() -> ProbeEndpoints {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        ProbeEndpoints::all(Url::parse(&format!("http://127.0.0.1:{port}")).unwrap())
    }

    fn dmi_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, content) in files {
            std::fs::write(dir.path().join(name), format!("{content}\n")).unwrap();
        }
        dir
    }

    async fn detect_dmi(files: &[(&str, &str)]) -> Result<Cloud, Error> {
        let dir = dmi_dir(files);
        detect(dir.path(), &dead_endpoints(), Duration::from_millis(500)).await
    }

    #[tokio::test]
    async fn dmi_identifies_each_cloud() {
        assert_eq!(
            detect_dmi(&[("sys_vendor", "Amazon EC2")]).await.unwrap(),
            Cloud::Aws
        );
        assert_eq!(
            detect_dmi(&[("sys_vendor", "Xen"), ("bios_vendor", "Amazon EC2")])
                .await
                .unwrap(),
            Cloud::Aws
        );
        assert_eq!(
            detect_dmi(&[("sys_vendor", "Google")]).await.unwrap(),
            Cloud::Gce
        );
        assert_eq!(
            detect_dmi(&[("product_name", "Google Compute Engine")])
                .await
                .unwrap(),
            Cloud::Gce
        );
        assert_eq!(
            detect_dmi(&[
                ("sys_vendor", "Microsoft Corporation"),
                ("chassis_asset_tag", super::super::azure::AZURE_ASSET_TAG)
            ])
            .await
            .unwrap(),
            Cloud::Azure
        );
    }

    #[tokio::test]
    async fn hyper_v_without_azure_tag_is_not_azure() {
        let err = detect_dmi(&[
            ("sys_vendor", "Microsoft Corporation"),
            ("chassis_asset_tag", "None"),
        ])
        .await
        .unwrap_err();
        assert_eq!(err.metric_label(), "detect");
        assert!(err.to_string().contains("Microsoft Corporation"), "{err}");
    }

    #[tokio::test]
    async fn empty_dmi_and_no_service_is_an_error() {
        let err = detect_dmi(&[]).await.unwrap_err();
        assert!(matches!(err, Error::Detect(_)));
        assert!(!err.is_retryable());
    }
}
