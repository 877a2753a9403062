//! Where the control plane's binaries come from, the way the ecosystem finds them:
//!
//! 1. `KUBEBUILDER_ASSETS`, if set: a directory holding `kube-apiserver` (and usually `etcd`),
//!    as controller-runtime's envtest lays it out; `kube-controller-manager` and
//!    `kube-scheduler` are used from there when present.
//! 2. `../shared/k8s/kubernetes-<version>-linux-amd64.tar.xz` beside the checkout, unpacked once
//!    into `target/k8s-assets/v<version>/` (kept across runs, keyed by version).
//! 3. The official release binaries of that version from `dl.k8s.io`, checked against their
//!    published SHA-256, into the same cache, where the network allows.
//! 4. Otherwise an error that says how to provide them.
//!
//! `etcd` comes from `KUBEBUILDER_ASSETS`, else `ETCD_BIN`, else `PATH` (Debian's
//! `etcd-server`, installed by `scripts/deps/etcd.sh`). The version is a parameter:
//! `SPOTGUARD_K8S_VERSION` (default [`DEFAULT_VERSION`]).

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::assets::{executable, fill_once, filled};
pub use crate::assets::{repo_root, shared_dir, target_dir};

/// The Kubernetes version the tests run against unless `SPOTGUARD_K8S_VERSION` says otherwise.
pub const DEFAULT_VERSION: &str = "1.34.9";

/// The binaries of one control plane, and where they came from.
#[derive(Clone, Debug)]
pub struct Assets {
    /// `Kubernetes vX.Y.Z` as the API server prints it.
    pub version: String,
    pub kube_apiserver: PathBuf,
    /// `None` when the source has none (envtest assets carry only the API server and etcd).
    pub kube_controller_manager: Option<PathBuf>,
    pub kube_scheduler: Option<PathBuf>,
    pub etcd: PathBuf,
    /// Human-readable origin, printed once per test binary.
    pub source: String,
}

/// The binaries could not be found; the message says how to provide them.
#[derive(Debug)]
pub struct MissingAssets(pub String);

impl fmt::Display for MissingAssets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MissingAssets {}

const KUBE_BINARIES: [&str; 3] = [
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// The version asked for: `SPOTGUARD_K8S_VERSION`, else [`DEFAULT_VERSION`] (a leading `v` is
/// accepted).
pub fn wanted_version() -> String {
    std::env::var("SPOTGUARD_K8S_VERSION")
        .ok()
        .map(|v| v.trim().trim_start_matches('v').to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| DEFAULT_VERSION.to_string())
}

fn how_to_provide(version: &str) -> String {
    format!(
        "The Kubernetes tests need kube-apiserver, kube-controller-manager and kube-scheduler \
         v{version} and etcd. Provide them one of these ways:\n\
         - put kubernetes-{version}-linux-amd64.tar.xz (the three binaries at its top level) in \
         ../shared/k8s/ beside this checkout ({shared});\n\
         - or set KUBEBUILDER_ASSETS to a directory holding kube-apiserver, kube-controller-manager, \
         kube-scheduler and etcd (e.g. from `setup-envtest use {version} -p path`, plus the other two \
         from https://dl.k8s.io/release/v{version}/bin/linux/amd64/);\n\
         - or run where https://dl.k8s.io is reachable (the binaries are downloaded into {cache});\n\
         - choose another version with SPOTGUARD_K8S_VERSION.\n\
         etcd: `bash scripts/deps/etcd.sh` (Debian's etcd-server), or ETCD_BIN=/path/to/etcd.",
        shared = shared_dir().display(),
        cache = cache_dir(version).display(),
    )
}

fn cache_dir(version: &str) -> PathBuf {
    target_dir().join("k8s-assets").join(format!("v{version}"))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| executable(p))
}

fn find_etcd(assets_dir: Option<&Path>, version: &str) -> Result<PathBuf, MissingAssets> {
    if let Some(p) = assets_dir.map(|d| d.join("etcd")).filter(|p| executable(p)) {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os("ETCD_BIN").map(PathBuf::from) {
        if executable(&p) {
            return Ok(p);
        }
        return Err(MissingAssets(format!(
            "ETCD_BIN={} is not an executable file.\n{}",
            p.display(),
            how_to_provide(version)
        )));
    }
    on_path("etcd").ok_or_else(|| {
        MissingAssets(format!(
            "etcd not found (KUBEBUILDER_ASSETS, ETCD_BIN, PATH).\n{}",
            how_to_provide(version)
        ))
    })
}

/// The version string a binary prints (`Kubernetes v1.34.9`).
fn printed_version(bin: &Path) -> Result<String, MissingAssets> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .map_err(|e| MissingAssets(format!("cannot run {} --version: {e}", bin.display())))?;
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || text.is_empty() {
        return Err(MissingAssets(format!(
            "{} --version failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(text)
}

/// Find (unpacking or downloading when needed) the binaries of the wanted version.
pub fn locate() -> Result<Assets, MissingAssets> {
    let version = wanted_version();
    if let Some(dir) = std::env::var_os("KUBEBUILDER_ASSETS").map(PathBuf::from) {
        let api = dir.join("kube-apiserver");
        if !executable(&api) {
            return Err(MissingAssets(format!(
                "KUBEBUILDER_ASSETS={} has no executable kube-apiserver.\n{}",
                dir.display(),
                how_to_provide(&version)
            )));
        }
        let optional = |n: &str| Some(dir.join(n)).filter(|p| executable(p));
        let etcd = find_etcd(Some(&dir), &version)?;
        return Ok(Assets {
            version: printed_version(&api)?,
            kube_controller_manager: optional("kube-controller-manager"),
            kube_scheduler: optional("kube-scheduler"),
            kube_apiserver: api,
            etcd,
            source: format!("KUBEBUILDER_ASSETS={}", dir.display()),
        });
    }
    let etcd = find_etcd(None, &version)?;
    let cache = cache_dir(&version);
    let archive = shared_dir().join(format!("kubernetes-{version}-linux-amd64.tar.xz"));
    let source = if complete(&cache) {
        std::fs::read_to_string(cache.join(".source"))
            .unwrap_or_else(|_| "cached".into())
            .trim()
            .to_string()
    } else if archive.is_file() {
        unpack(&archive, &cache).map_err(|e| {
            MissingAssets(format!(
                "unpacking {}: {e}\n{}",
                archive.display(),
                how_to_provide(&version)
            ))
        })?;
        let s = format!("{}", archive.display());
        let _ = std::fs::write(cache.join(".source"), &s);
        s
    } else {
        match download(&version, &cache) {
            Ok(s) => s,
            Err(e) => {
                return Err(MissingAssets(format!(
                    "no {} and no download ({e}).\n{}",
                    archive.display(),
                    how_to_provide(&version)
                )))
            }
        }
    };
    let api = cache.join("kube-apiserver");
    Ok(Assets {
        version: printed_version(&api)?,
        kube_apiserver: api,
        kube_controller_manager: Some(cache.join("kube-controller-manager")),
        kube_scheduler: Some(cache.join("kube-scheduler")),
        etcd,
        source: format!("{source} (cached in {})", cache.display()),
    })
}

/// A cache directory holds a complete set once its `.complete` stamp exists and every binary is
/// there.
fn complete(dir: &Path) -> bool {
    filled(dir) && KUBE_BINARIES.iter().all(|b| executable(&dir.join(b)))
}

/// Fill the cache with `fill`; a stamped copy that lost a binary is replaced.
fn fill_cache(dest: &Path, fill: impl FnOnce(&Path) -> Result<(), String>) -> Result<(), String> {
    if filled(dest) && !complete(dest) {
        std::fs::remove_dir_all(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    }
    fill_once(dest, fill)
}

fn unpack(archive: &Path, dest: &Path) -> Result<(), String> {
    fill_cache(dest, |tmp| {
        let out = Command::new("tar")
            .arg("-xJf")
            .arg(archive)
            .arg("-C")
            .arg(tmp)
            .output()
            .map_err(|e| format!("running tar (needs tar and xz-utils): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "tar -xJf failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        match KUBE_BINARIES.iter().find(|b| !executable(&tmp.join(b))) {
            Some(b) => Err(format!(
                "the archive has no executable {b} at its top level"
            )),
            None => Ok(()),
        }
    })
}

/// Download the release binaries of `version` from dl.k8s.io, checked against the published
/// SHA-256 of each. Fails fast without network (DNS or connect error within seconds).
fn download(version: &str, dest: &Path) -> Result<String, String> {
    let base = format!("https://dl.k8s.io/release/v{version}/bin/linux/amd64");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let source = format!("downloaded from {base}");
    fill_cache(dest, |tmp| {
        rt.block_on(async {
            let client = reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .timeout(Duration::from_secs(600))
                .build()
                .map_err(|e| e.to_string())?;
            for b in KUBE_BINARIES {
                let get = |url: String| {
                    let client = client.clone();
                    async move {
                        let resp = client
                            .get(&url)
                            .send()
                            .await
                            .map_err(|e| format!("{url}: {e}"))?;
                        if !resp.status().is_success() {
                            return Err(format!("{url}: HTTP {}", resp.status()));
                        }
                        resp.bytes().await.map_err(|e| format!("{url}: {e}"))
                    }
                };
                let sum = get(format!("{base}/{b}.sha256")).await?;
                let want = String::from_utf8_lossy(&sum)
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_ascii_lowercase();
                let bytes = get(format!("{base}/{b}")).await?;
                let got: String = Sha256::digest(&bytes)
                    .iter()
                    .map(|x| format!("{x:02x}"))
                    .collect();
                if got != want {
                    return Err(format!("{base}/{b}: sha256 {got}, published {want}"));
                }
                let path = tmp.join(b);
                std::fs::write(&path, &bytes).map_err(|e| e.to_string())?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                    .map_err(|e| e.to_string())?;
            }
            Ok(())
        })?;
        let _ = std::fs::write(tmp.join(".source"), &source);
        Ok(())
    })?;
    Ok(source)
}
