//! The agent image: daemonset/Dockerfile, the one users build, built here with podman and run.
//!
//! Built from its `prebuilt` stage (the runtime stage with the binary taken from the build
//! context) around the binary scripts/test.sh already built with the wheel profile, so the image
//! adds no Rust compilation; `FROM` lines point through `--build-arg` at a base image made here
//! with `podman import` (no registry is reachable): the libraries `ldd` lists for the binary, an
//! `/etc/passwd` and Debian's CA bundle, as distroless/cc-debian12 carries them, plus one test CA
//! appended to that bundle.
//!
//! Then, from the image: `spotguard --version`; `spotguard drill` to PASS; the agent with the
//! arguments, environment, user, capabilities, read-only root filesystem, host PID / network
//! namespaces and volume mounts read from daemonset/daemonset.yaml, talking to the real control
//! plane through the in-cluster ServiceAccount files, until it is ready and cordons its node on
//! an interruption notice; and an S3 download over TLS from a server whose CA is only in the
//! image's bundle (and the same download refused from a server whose CA is not in it). The
//! image's size is printed.
//!
//! Needs podman, buildah and runc (scripts/deps/podman.sh) and the wheel binary
//! (`target/wheel/spotguard`, or `SPOTGUARD_IMAGE_BINARY`); hence ignored in a plain
//! `cargo test`: scripts/test.sh runs `cargo test --test image -- --ignored` after its wheel
//! step. Where podman cannot run, the tests fail; they never skip.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, Node, PodSpec};
use kube::Api;
use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::k8s::controlplane::load_manifest;
use spotguard_testkit::k8s::pki::{self, Pki};
use spotguard_testkit::k8s::{ControlPlane, Identity, Kubelet, NodeConfig};
use spotguard_testkit::s3::S3Server;
use spotguard_testkit::tls::TlsFront;

/// The binary the image is built around: `SPOTGUARD_IMAGE_BINARY`, else the wheel profile's
/// under the cargo target directory.
fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("SPOTGUARD_IMAGE_BINARY") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    target.join("wheel/spotguard")
}

/// podman with its own storage under the cargo target's temporary directory (vfs: no overlay
/// support needed), runc with cgroupfs, and no default ulimits (the sandbox refuses raising
/// them). vfs copies every layer, so a run leaves a few hundred MiB there: the next run empties
/// the directory before it starts.
struct Podman {
    dir: PathBuf,
}

impl Podman {
    fn new() -> Podman {
        let podman = Podman {
            dir: Path::new(env!("CARGO_TARGET_TMPDIR")).join("image-podman"),
        };
        if podman.dir.exists() {
            // Containers an interrupted run left behind, then their storage.
            let _ = podman.output(&["rm", "--all", "--force"]);
            std::fs::remove_dir_all(&podman.dir)
                .unwrap_or_else(|e| panic!("emptying {}: {e}", podman.dir.display()));
        }
        std::fs::create_dir_all(&podman.dir).expect("podman dir");
        std::fs::write(
            podman.dir.join("containers.conf"),
            "[containers]\ndefault_ulimits = []\n",
        )
        .expect("containers.conf");
        podman
    }

    fn cmd(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .args([
                "--storage-driver=vfs",
                "--runtime=runc",
                "--cgroup-manager=cgroupfs",
            ])
            .stdin(Stdio::null());
        cmd
    }

    /// `podman ARGS`, its output whatever the exit status.
    fn output(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap_or_else(|e| {
            panic!("podman cannot be run ({e}): install it with scripts/deps/podman.sh")
        })
    }

    /// `podman ARGS`, which must succeed; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let out = self.output(args);
        assert!(
            out.status.success(),
            "podman {args:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

struct Built {
    podman: Podman,
    image: String,
    /// The test CA appended to the image's CA bundle.
    trusted: Pki,
}

/// Paths of the shared libraries `bin` needs, as `ldd` lists them (the dynamic loader included).
fn libraries(bin: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(bin).output().expect("ldd");
    assert!(out.status.success(), "ldd {}: {out:?}", bin.display());
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.trim(),
                None => l,
            };
            let path = path.split(" (").next()?.trim();
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect()
}

fn image() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(build)
}

fn build() -> Built {
    let bin = binary();
    assert!(
        bin.is_file(),
        "{} is missing: build it first (`python3 -m maturin build --profile wheel`, as \
         scripts/test.sh does, or `cargo build --profile wheel --bin spotguard`), or name a \
         binary with SPOTGUARD_IMAGE_BINARY",
        bin.display()
    );
    let podman = Podman::new();
    let version = podman.output(&["--version"]);
    assert!(
        version.status.success(),
        "podman does not run: {version:?} (scripts/deps/podman.sh installs it)"
    );
    let work = podman.dir.clone();

    // The base: what distroless/cc-debian12 holds that the binary uses.
    let root = work.join("base");
    for lib in libraries(&bin) {
        let dest = root.join(lib.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(&lib, &dest).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    }
    let trusted =
        pki::generate_named(&work.join("trusted-ca"), "spotguard-image-test-ca").expect("test CA");
    let debian_bundle = std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt")
        .expect("Debian's CA bundle (ca-certificates; scripts/deps/podman.sh installs it)");
    std::fs::create_dir_all(root.join("etc/ssl/certs")).unwrap();
    std::fs::write(
        root.join("etc/ssl/certs/ca-certificates.crt"),
        format!("{debian_bundle}{}", trusted.ca_pem),
    )
    .unwrap();
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/sbin/nologin\n\
         nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n\
         nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
    )
    .unwrap();
    for d in ["tmp", "root", "home/nonroot"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let tar = work.join("base.tar");
    let status = Command::new("tar")
        .arg("-C")
        .arg(&root)
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .expect("tar");
    assert!(status.success(), "tar of the base image");
    let base = "localhost/spotguard-test-base:latest";
    podman.ok(&["import", "--quiet", tar.to_str().unwrap(), base]);

    // The build context: the binary alone, at its root (the `prebuilt` stage's COPY).
    let ctx = work.join("context");
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::copy(&bin, ctx.join("spotguard")).expect("binary into the build context");
    let image = "localhost/spotguard:test";
    let dockerfile = repo_root().join("daemonset/Dockerfile");
    let started = Instant::now();
    podman.ok(&[
        "build",
        "--quiet",
        "--file",
        dockerfile.to_str().unwrap(),
        "--target",
        "prebuilt",
        "--build-arg",
        &format!("RUNTIME_IMAGE={base}"),
        "--build-arg",
        &format!("RUST_IMAGE={base}"),
        "--tag",
        image,
        ctx.to_str().unwrap(),
    ]);
    let size: u64 = podman
        .ok(&["image", "inspect", "--format", "{{.Size}}", image])
        .trim()
        .parse()
        .expect("image size");
    let binary_size = std::fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "image {image}: {:.1} MiB ({} binary: {:.1} MiB), built in {:.1}s",
        size as f64 / (1024.0 * 1024.0),
        bin.display(),
        binary_size as f64 / (1024.0 * 1024.0),
        started.elapsed().as_secs_f64()
    );
    Built {
        podman,
        image: image.to_string(),
        trusted,
    }
}

#[test]
#[ignore = "needs podman and the wheel binary: scripts/test.sh runs it after the wheel step"]
fn image_prints_its_version_and_passes_the_drill() {
    let b = image();
    let version = b.podman.ok(&["run", "--rm", &b.image, "--version"]);
    assert!(
        version.starts_with(&format!("spotguard {}", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );

    let out = b
        .podman
        .output(&["run", "--rm", "--network=host", &b.image, "drill"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "drill in the image: {}\n{text}",
        out.status
    );
    assert!(text.contains("verdict: PASS"), "{text}");
}

/// The agent container of the shipped DaemonSet.
fn agent_container(spec: &PodSpec) -> &Container {
    spec.containers
        .iter()
        .find(|c| c.name == "spotguard")
        .expect("container spotguard in daemonset/daemonset.yaml")
}

/// `podman run` options for the pod's namespaces and the container's securityContext; panics on
/// a setting it does not know how to carry over, so the test follows the manifest or fails.
fn security_options(spec: &PodSpec, c: &Container) -> Vec<String> {
    let mut o = Vec::new();
    if spec.host_pid == Some(true) {
        o.push("--pid=host".to_string());
    }
    // --network=host either way: the test's control plane and metadata emulator are on loopback.
    o.push("--network=host".to_string());
    let sc = c.security_context.as_ref().expect("securityContext");
    let user = sc.run_as_user.expect("runAsUser");
    let group = sc.run_as_group.expect("runAsGroup");
    o.push(format!("--user={user}:{group}"));
    if sc.read_only_root_filesystem == Some(true) {
        // podman would otherwise mount writable tmpfs on /tmp, /run and /var/tmp.
        o.push("--read-only".to_string());
        o.push("--read-only-tmpfs=false".to_string());
    }
    if sc.privileged == Some(true) {
        o.push("--privileged".to_string());
    }
    if sc.allow_privilege_escalation == Some(false) {
        o.push("--security-opt=no-new-privileges".to_string());
    }
    if let Some(caps) = &sc.capabilities {
        for d in caps.drop.iter().flatten() {
            o.push(format!("--cap-drop={}", d.to_lowercase()));
        }
        for a in caps.add.iter().flatten() {
            o.push(format!("--cap-add=CAP_{a}"));
        }
    }
    if let Some(p) = &sc.seccomp_profile {
        // podman's default seccomp profile is the runtime default.
        assert_eq!(p.type_, "RuntimeDefault", "seccompProfile {p:?}");
    }
    o
}

/// `-v` options for the container's volume mounts: hostPaths under /sys are mounted as they are
/// (left out where this machine has no such directory); every other volume is a fresh directory
/// under `dir`.
fn volume_options(spec: &PodSpec, c: &Container, dir: &Path) -> Vec<String> {
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let mut o = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("volume {} not in the pod", m.name));
        let host = match &v.host_path {
            Some(hp) if hp.path.starts_with("/sys/") && Path::new(&hp.path).is_dir() => {
                PathBuf::from(&hp.path)
            }
            // A sysfs directory this machine lacks (DMI on some VMs): sysfs cannot take a
            // mount point, and the agent reads an absent directory as "no DMI".
            Some(hp) if hp.path.starts_with("/sys/") => continue,
            Some(_) | None => {
                assert!(
                    v.host_path.is_some() || v.empty_dir.is_some(),
                    "volume {} is neither hostPath nor emptyDir",
                    v.name
                );
                let d = dir.join("volumes").join(&v.name);
                std::fs::create_dir_all(&d).unwrap();
                d
            }
        };
        let ro = if m.read_only == Some(true) { ":ro" } else { "" };
        o.push(format!("--volume={}:{}{ro}", host.display(), m.mount_path));
    }
    o
}

/// A container removed (with its process) when dropped.
struct Running<'a> {
    podman: &'a Podman,
    name: String,
}

impl Running<'_> {
    fn logs(&self) -> String {
        let out = self.podman.output(&["logs", &self.name]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    fn running(&self) -> bool {
        self.podman
            .output(&["inspect", "--format", "{{.State.Running}}", &self.name])
            .stdout
            .starts_with(b"true")
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let _ = self
            .podman
            .output(&["rm", "--force", "--time=5", &self.name]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs podman and the wheel binary: scripts/test.sh runs it after the wheel step"]
async fn image_runs_the_agent_as_the_daemonset_does_against_the_control_plane() {
    let b = tokio::task::spawn_blocking(image).await.expect("image");
    let cp = ControlPlane::shared();
    let node = format!("image-{}", std::process::id());
    let _kubelet = Kubelet::start(cp, NodeConfig::new(&node))
        .await
        .expect("kubelet stand-in");
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");

    let ds: DaemonSet = load_manifest("daemonset/daemonset.yaml").expect("daemonset.yaml");
    let pod = ds.spec.expect("spec").template;
    let spec = pod.spec.expect("pod spec");
    let namespace = ds.metadata.namespace.expect("namespace");
    let c = agent_container(&spec);
    let dir = tempfile::tempdir().expect("tempdir");

    // The ServiceAccount files the kubelet mounts (automountServiceAccountToken).
    assert_eq!(spec.automount_service_account_token, Some(true));
    let sa = dir.path().join("serviceaccount");
    std::fs::create_dir_all(&sa).unwrap();
    std::fs::write(sa.join("token"), cp.token(Identity::Agent)).unwrap();
    std::fs::write(sa.join("ca.crt"), &cp.pki.ca_pem).unwrap();
    std::fs::write(sa.join("namespace"), &namespace).unwrap();

    // The container's environment: values as written, Downward API fields for this node and pod,
    // the in-cluster API server address; then the three settings that point the agent at this
    // machine's test endpoints (cloud and metadata endpoint: the emulator; metrics: a free port,
    // where the manifest's 0.0.0.0:9464 could be taken on a shared machine).
    let pod_name = format!("spotguard-{node}");
    let mut env = BTreeMap::new();
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from)) => {
                let field = &from.field_ref.as_ref().expect("fieldRef").field_path;
                match field.as_str() {
                    "spec.nodeName" => node.clone(),
                    "metadata.name" => pod_name.clone(),
                    "metadata.namespace" => namespace.clone(),
                    "spec.serviceAccountName" => spec
                        .service_account_name
                        .clone()
                        .expect("the DaemonSet names its ServiceAccount"),
                    // hostNetwork: the pod's IP is the node's, here this machine's loopback.
                    "status.podIP" => "127.0.0.1".to_string(),
                    other => panic!("Downward API field {other} not carried over"),
                }
            }
            other => panic!("env {}: {other:?}", e.name),
        };
        env.insert(e.name.clone(), value);
    }
    let port = free_port();
    for (k, v) in [
        ("KUBERNETES_SERVICE_HOST", "127.0.0.1".to_string()),
        ("KUBERNETES_SERVICE_PORT", cp.port.to_string()),
        ("SPOTGUARD_CLOUD", "aws".to_string()),
        ("SPOTGUARD_METADATA_ENDPOINT", emu.base_url()),
        ("SPOTGUARD_METRICS_ADDR", format!("127.0.0.1:{port}")),
    ] {
        env.insert(k.to_string(), v);
    }

    let name = format!("spotguard-agent-{}", std::process::id());
    let mut args: Vec<String> = vec!["run".into(), "--detach".into(), format!("--name={name}")];
    args.extend(security_options(&spec, c));
    args.extend(volume_options(&spec, c, dir.path()));
    args.push(format!(
        "--volume={}:/var/run/secrets/kubernetes.io/serviceaccount:ro",
        sa.display()
    ));
    args.extend(env.iter().map(|(k, v)| format!("--env={k}={v}")));
    assert!(c.command.is_none(), "the manifest overrides the entrypoint");
    args.push(b.image.clone());
    args.extend(c.args.iter().flatten().cloned());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    b.podman.ok(&argv);
    let agent = Running {
        podman: &b.podman,
        name,
    };

    // Ready as the readiness probe asks it.
    let probe = c
        .readiness_probe
        .as_ref()
        .and_then(|p| p.http_get.as_ref())
        .expect("readiness httpGet");
    let readyz = format!(
        "http://127.0.0.1:{port}{}",
        probe.path.as_deref().unwrap_or("/")
    );
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = http.get(&readyz).send().await {
            if r.status().is_success() {
                break;
            }
        }
        assert!(
            agent.running(),
            "the agent container exited:\n{}",
            agent.logs()
        );
        assert!(
            Instant::now() < deadline,
            "{readyz} never answered 200 within 60 s:\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // It acts on its node through the API server as the shipped ServiceAccount: an interruption
    // notice cordons the node.
    emu.raise(EmulatedNotice::interruption()).expect("notice");
    let nodes: Api<Node> = Api::all(cp.admin());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = nodes.get(&node).await.expect("node");
        if n.spec.and_then(|s| s.unschedulable) == Some(true) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node {node} not cordoned within 60 s of the notice:\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(agent.running(), "{}", agent.logs());
}

/// `spotguard prefetch` in the image from an S3 server behind TLS: whether the download works
/// is decided by the image's CA bundle alone.
fn prefetch_in_image(b: &Built, endpoint: &str, dest: &Path) -> (bool, String) {
    let mut args = vec![
        "run".to_string(),
        "--rm".into(),
        "--network=host".into(),
        format!("--volume={}:/data", dest.display()),
    ];
    for (k, v) in S3Server::client_env() {
        args.push(format!("--env={k}={v}"));
    }
    args.extend([
        b.image.clone(),
        "prefetch".into(),
        "s3://datasets/tokenized".into(),
        "/data".into(),
        "--name=tokenized".into(),
        format!("--endpoint={endpoint}"),
        "--progress=json".into(),
        "--timeout=60s".into(),
    ]);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = b.podman.output(&argv);
    (
        out.status.success(),
        format!(
            "{}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs podman and the wheel binary: scripts/test.sh runs it after the wheel step"]
async fn image_trusts_the_servers_its_ca_bundle_vouches_for() {
    let b = tokio::task::spawn_blocking(image).await.expect("image");
    let s3 = S3Server::s3s_fs(&["datasets"]);
    let object = s3.object_path("datasets", "tokenized/shard-0000.bin");
    std::fs::create_dir_all(object.parent().unwrap()).unwrap();
    let payload = b"tokens over TLS\n".repeat(1000);
    std::fs::write(&object, &payload).unwrap();

    // CA in the image's bundle: the download goes through.
    let trusted = TlsFront::start(s3.addr, &b.trusted)
        .await
        .expect("TLS front");
    let dest = tempfile::tempdir().expect("tempdir");
    let (ok, log) = prefetch_in_image(b, &trusted.url(), dest.path());
    assert!(ok, "prefetch over TLS (CA in the bundle): {log}");
    let fetched = dest.path().join("tokenized/shard-0000.bin");
    assert_eq!(
        std::fs::read(&fetched).unwrap_or_else(|e| panic!("{}: {e}\n{log}", fetched.display())),
        payload
    );
    let seen = trusted.handshakes();
    assert!(seen.completed > 0 && seen.failed.is_empty(), "{seen:?}");

    // A CA the bundle does not hold: refused at the handshake, nothing fetched.
    let other =
        pki::generate_named(&dest.path().join("other-ca"), "not-in-the-bundle").expect("other CA");
    let untrusted = TlsFront::start(s3.addr, &other).await.expect("TLS front");
    let dest2 = tempfile::tempdir().expect("tempdir");
    let (ok, log) = prefetch_in_image(b, &untrusted.url(), dest2.path());
    assert!(
        !ok,
        "prefetch from a server whose CA is not in the bundle: {log}"
    );
    let refused = untrusted.handshakes();
    assert_eq!(refused.completed, 0, "{refused:?}\n{log}");
    assert!(
        !refused.failed.is_empty() && refused.failed.iter().all(|e| e.contains("UnknownCA")),
        "the client refused the certificate as issued by an unknown CA: {refused:?}\n{log}"
    );
    assert!(!dest2.path().join("tokenized/shard-0000.bin").exists());
}
