//! The real command-line tools a test drives as an operator would (kubectl, helm), against
//! this test's slice of the shared control plane, each from an operator's home of its own (a
//! kubeconfig as admin, `HOME` and Helm's directories inside it).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::{Identity, TestCluster};

/// What installs kubectl for the tests.
pub const KUBECTL_DEPS: &str = "scripts/deps/kubectl.sh";

/// How a tool's run ended: its exit status and output.
pub struct Ran {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

/// A kustomization in a fresh directory, the way an operator keeps an overlay outside the repo:
/// `resources` and `components` relative to the repo, then `extra` (patches, more keys) as is.
pub fn overlay(resources: &[&str], components: &[&str], extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let up = dir
        .path()
        .components()
        .filter(|c| matches!(c, std::path::Component::Normal(_)))
        .map(|_| "..")
        .collect::<Vec<_>>()
        .join("/");
    let rel = |p: &str| format!("{up}{}", crate::assets::repo_root().join(p).display());
    let mut text = String::from(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n",
    );
    for r in resources {
        text.push_str(&format!("  - {}\n", rel(r)));
    }
    if !components.is_empty() {
        text.push_str("components:\n");
        for c in components {
            text.push_str(&format!("  - {}\n", rel(c)));
        }
    }
    text.push_str(extra);
    std::fs::write(dir.path().join("kustomization.yaml"), text).unwrap();
    dir
}

/// `name` in a directory of `PATH`, if there is one.
pub fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Run `bin ARGS` from operator home `home` (its kubeconfig `home/config`; `HOME` and Helm's
/// cache, config and data directories inside it; never the in-cluster configuration), with
/// `stdin` written to it. Panics when it cannot start or does not finish within `limit`.
pub async fn run_tool(
    bin: &Path,
    args: &[&str],
    stdin: Option<&str>,
    home: &Path,
    limit: Duration,
) -> Ran {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .env("KUBECONFIG", home.join("config"))
        .env("HOME", home)
        .env("HELM_CACHE_HOME", home.join("helm-cache"))
        .env("HELM_CONFIG_HOME", home.join("helm-config"))
        .env("HELM_DATA_HOME", home.join("helm-data"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("running {}: {e}", bin.display()));
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).await.unwrap();
        drop(pipe);
    }
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{} {args:?} did not finish within {limit:?}", bin.display()))
        .unwrap();
    Ran {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Which address an operator's kubeconfig names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    /// The API server itself.
    Direct,
    /// This test's fault proxy in front of it (its request log shows what reached the server).
    Proxy,
}

/// kubectl as an operator (admin) of a new [`TestCluster`], from a home of its own.
pub struct Kubectl {
    pub bin: PathBuf,
    pub home: tempfile::TempDir,
    pub k: TestCluster,
    limit: Duration,
}

impl Kubectl {
    /// `KUBECTL`, else kubectl on `PATH` (panics naming [`KUBECTL_DEPS`] when there is none),
    /// with the admin's kubeconfig for `server`; each run must finish within `limit`.
    pub async fn start(server: Server, limit: Duration) -> Kubectl {
        let bin = std::env::var_os("KUBECTL")
            .map(PathBuf::from)
            .or_else(|| find_on_path("kubectl"))
            .unwrap_or_else(|| panic!("kubectl not found: run {KUBECTL_DEPS}"));
        let k = TestCluster::new().await;
        let home = tempfile::tempdir().unwrap();
        let url = match server {
            Server::Direct => k.cp.url(),
            Server::Proxy => k.proxy().url(),
        };
        std::fs::write(
            home.path().join("config"),
            k.cp.kubeconfig(&url, Identity::Admin),
        )
        .unwrap();
        Kubectl {
            bin,
            home,
            k,
            limit,
        }
    }

    /// `kubectl ARGS` (its discovery cache in the home), `stdin` written to it.
    pub async fn run(&self, args: &[&str], stdin: Option<&str>) -> Ran {
        let mut all = args.to_vec();
        let cache = self.home.path().join("kube-cache");
        all.extend(["--cache-dir", cache.to_str().unwrap()]);
        run_tool(&self.bin, &all, stdin, self.home.path(), self.limit).await
    }

    /// `kubectl kustomize DIR`: the rendering; panics with kubectl's error.
    pub async fn kustomize(&self, dir: &Path) -> String {
        let ran = self.run(&["kustomize", dir.to_str().unwrap()], None).await;
        assert!(
            ran.ok,
            "kubectl kustomize {}: {}",
            dir.display(),
            ran.stderr
        );
        ran.stdout
    }

    /// CRDs at `path` (a file or a directory of them) applied server-side as `field_manager`
    /// (idempotent), then waited for until Established; panics with kubectl's error.
    pub async fn install_crds_from(&self, path: &Path, field_manager: &str) {
        let path = path.to_str().unwrap();
        let manager = format!("--field-manager={field_manager}");
        let ran = self
            .run(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    &manager,
                    "-f",
                    path,
                ],
                None,
            )
            .await;
        assert!(ran.ok, "installing the CRDs of {path}: {}", ran.stderr);
        let ran = self
            .run(
                &[
                    "wait",
                    "--for=condition=Established",
                    "--timeout=60s",
                    "-f",
                    path,
                ],
                None,
            )
            .await;
        assert!(ran.ok, "the CRDs of {path} not Established: {}", ran.stderr);
    }
}
