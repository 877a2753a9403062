//! AWS's own instance-metadata mock, `amazon-ec2-metadata-mock` (the tool AWS tests its node
//! termination handler with), started on a free loopback port for a test and stopped when
//! dropped. It behaves as real clients must survive and the project's emulator does not by
//! default: it stamps each answer with the request time (spot `time` = now + 2 min, rebalance
//! `noticeTime` = now) and serves a rebalance recommendation from start-up.
//!
//! Where the binary comes from, in order:
//! 1. `SPOTGUARD_EC2_METADATA_MOCK`: a binary, or an `.xz` of one (another version);
//! 2. `../shared/k8s/ec2-metadata-mock-<version>-linux-amd64.xz` beside the checkout.
//!
//! An `.xz` is unpacked once (with `xz -dc`, through [`crate::assets::fill_once`]) into
//! `<target>/ec2-metadata-mock/<version>/`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::assets::{fill_once, shared_dir, target_dir};

/// Environment variable naming another mock binary (or `.xz`).
pub const ENV: &str = "SPOTGUARD_EC2_METADATA_MOCK";

const PREFIX: &str = "ec2-metadata-mock-";

/// A running `ec2-metadata-mock`.
pub struct Ec2MetadataMock {
    child: Child,
    port: u16,
    version: String,
    _home: tempfile::TempDir,
}

/// The mock's binary (unpacked when needed) and its version, or why it cannot be had.
pub fn binary() -> Result<(PathBuf, String), String> {
    let source = match std::env::var_os(ENV) {
        Some(p) => PathBuf::from(p),
        None => shipped()?,
    };
    let name = source
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let version = name
        .strip_prefix(PREFIX)
        .and_then(|rest| rest.split('-').next())
        .filter(|v| !v.is_empty())
        .unwrap_or("custom")
        .to_string();
    if !name.ends_with(".xz") {
        return Ok((source, version));
    }
    let dir = target_dir().join("ec2-metadata-mock").join(&version);
    fill_once(&dir, |tmp| {
        let bin = tmp.join("ec2-metadata-mock");
        let out = std::fs::File::create(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
        let status = Command::new("xz")
            .arg("-dc")
            .arg(&source)
            .stdout(out)
            .status()
            .map_err(|e| format!("running xz to unpack {}: {e}", source.display()))?;
        if !status.success() {
            return Err(format!("xz -dc {} failed: {status}", source.display()));
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", bin.display()))
    })?;
    let bin = dir.join("ec2-metadata-mock");
    Ok((bin, version))
}

/// The archive beside the checkout: `../shared/k8s/ec2-metadata-mock-*-linux-amd64.xz`.
fn shipped() -> Result<PathBuf, String> {
    let dir = shared_dir();
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(PREFIX) && n.ends_with("-linux-amd64.xz"))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().ok_or_else(|| {
        format!(
            "AWS's ec2-metadata-mock not found: set {ENV} to its binary (or an .xz of it), or put \
             ec2-metadata-mock-<version>-linux-amd64.xz into {}",
            dir.display()
        )
    })
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Ec2MetadataMock {
    /// Start the mock with `args` (a subcommand and its flags, e.g. `["spot", "-a",
    /// "hibernate", "-d", "3"]`, and global flags such as `-I` for IMDSv2 only) on a free
    /// loopback port; returns once it answers.
    pub async fn start(args: &[&str]) -> Result<Ec2MetadataMock, String> {
        let (bin, version) = binary()?;
        let mut last = String::new();
        for _ in 0..3 {
            let home = tempfile::tempdir().map_err(|e| e.to_string())?;
            let port = free_port().map_err(|e| e.to_string())?;
            let log =
                std::fs::File::create(home.path().join("mock.log")).map_err(|e| e.to_string())?;
            let err = log.try_clone().map_err(|e| e.to_string())?;
            let child = Command::new(&bin)
                .args(args)
                .args(["-n", "127.0.0.1", "-p", &port.to_string()])
                // It reads $HOME/aemm-config.json: never a user's.
                .env("HOME", home.path())
                .current_dir(home.path())
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(err)
                .spawn()
                .map_err(|e| format!("starting {}: {e}", bin.display()))?;
            let mut mock = Ec2MetadataMock {
                child,
                port,
                version: version.clone(),
                _home: home,
            };
            if mock.answers(Duration::from_secs(10)).await {
                tracing::info!(version = %mock.version, port, "ec2-metadata-mock started");
                return Ok(mock);
            }
            last = format!(
                "ec2-metadata-mock {version} did not answer on port {port}: {}",
                std::fs::read_to_string(mock._home.path().join("mock.log")).unwrap_or_default()
            );
        }
        Err(last)
    }

    async fn answers(&mut self, within: Duration) -> bool {
        let client = reqwest::Client::new();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            let answered = client
                .put(format!("{}/latest/api/token", self.base_url()))
                .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
                .timeout(Duration::from_secs(1))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if answered {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// `http://127.0.0.1:<port>`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The mock's version (from its file name; `custom` when it says none).
    pub fn version(&self) -> &str {
        &self.version
    }
}

impl Drop for Ec2MetadataMock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
