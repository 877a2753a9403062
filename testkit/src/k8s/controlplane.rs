//! One real control plane per test binary: etcd, kube-apiserver, kube-controller-manager and
//! kube-scheduler on loopback, started on first use ([`ControlPlane::shared`]) and killed when
//! the binary exits (see [`super::child`]). Tests share it and keep apart by namespace and node
//! name ([`super::TestCluster`]).
//!
//! At start it applies the shipped RBAC (`daemonset/namespace.yaml`, `serviceaccount.yaml`,
//! `clusterrole.yaml`, `clusterrolebinding.yaml`, `clusterrole-interruptions-view.yaml`, the
//! force-delete component's role, and the relay component's roles and bindings), the goodput ledger's CRD (`daemonset/crds/`), and
//! mints ServiceAccount tokens with the TokenRequest API: the agent under test talks to the API
//! server as the shipped ServiceAccount with the shipped ClusterRole, never as an admin.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::authentication::v1::BoundObjectReference;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding, Subject};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::apiserver;
use super::assets::{self, Assets};
use super::child::Daemon;
use super::controllers;
use super::etcd;
use super::pki::{self, Pki};

/// The namespace and ServiceAccount of the shipped install.
pub const AGENT_NAMESPACE: &str = "spotguard";
pub const AGENT_SERVICE_ACCOUNT: &str = "spotguard";
/// A second ServiceAccount bound to the shipped ClusterRole *and* the force-delete component's
/// (tests of `--force-delete-at-deadline`; the base identity must not be able to delete pods).
pub const FORCE_DELETE_SERVICE_ACCOUNT: &str = "spotguard-force-delete";
/// Field manager of the harness's own server-side applies.
pub const FIELD_MANAGER: &str = "spotguard-testkit";

/// Who a client acts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Identity {
    /// `system:masters`: the test's own reads and setup.
    Admin,
    /// The shipped ServiceAccount with the shipped ClusterRole.
    Agent,
    /// [`FORCE_DELETE_SERVICE_ACCOUNT`]: the shipped roles plus components/force-delete.
    AgentForceDelete,
}

/// The shared control plane.
pub struct ControlPlane {
    pub assets: Assets,
    /// Working directory: logs, PKI, etcd data, kubeconfigs.
    pub dir: PathBuf,
    pub port: u16,
    pub pki: Pki,
    admin_token: String,
    agent_token: String,
    force_delete_token: String,
    /// kubeconfig (admin) for kubectl and the controllers.
    pub admin_kubeconfig: PathBuf,
    /// The API server's `--event-ttl`, when the test binary asked for one ([`set_event_ttl`]).
    pub event_ttl: Option<Duration>,
    daemons: Mutex<Vec<Daemon>>,
}

static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
static EVENT_TTL: OnceLock<Duration> = OnceLock::new();

/// Start this test binary's API server with `--event-ttl=ttl` (Events expire after it), when it
/// has not started yet: every test of a binary that needs it calls this first (the first call
/// wins; see `TestCluster::with_event_ttl`, which checks that it took).
pub fn set_event_ttl(ttl: Duration) {
    let _ = EVENT_TTL.set(ttl);
}

impl ControlPlane {
    /// The control plane of this test binary, started on first use. Panics with a message that
    /// says how to provide the binaries when they cannot be found, or with the failing
    /// component's log when it does not start.
    pub fn shared() -> &'static ControlPlane {
        let result = SHARED.get_or_init(|| {
            // Start from a plain thread with its own runtime: the caller may be inside a tokio
            // runtime (block_on there would panic) that ends with its test.
            std::thread::Builder::new()
                .name("k8s-control-plane".into())
                .spawn(start)
                .map_err(|e| e.to_string())
                .and_then(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("control plane start panicked".into()))
                })
        });
        match result {
            Ok(cp) => cp,
            Err(e) => panic!("the real Kubernetes control plane is not available: {e}"),
        }
    }

    /// `https://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The bearer token of `identity`.
    pub fn token(&self, identity: Identity) -> &str {
        match identity {
            Identity::Admin => &self.admin_token,
            Identity::Agent => &self.agent_token,
            Identity::AgentForceDelete => &self.force_delete_token,
        }
    }

    /// A kube config for `url` (the API server or a proxy in front of it) as `identity`.
    pub fn config(&self, url: &str, identity: Identity) -> kube::Config {
        let uri: http::Uri = match url.parse() {
            Ok(u) => u,
            Err(e) => panic!("{url}: {e}"),
        };
        let mut config = kube::Config::new(uri);
        config.root_cert = Some(vec![pem_der(&self.pki.ca_pem)]);
        config.auth_info.token = Some(self.token(identity).to_string().into());
        config.default_retry = false;
        config
    }

    /// A client straight to the API server as `identity`. Create one per test (a client's
    /// connections belong to the tokio runtime that made them).
    pub fn client(&self, identity: Identity) -> kube::Client {
        match kube::Client::try_from(self.config(&self.url(), identity)) {
            Ok(c) => c,
            Err(e) => panic!("kube client: {e}"),
        }
    }

    /// The admin client.
    pub fn admin(&self) -> kube::Client {
        self.client(Identity::Admin)
    }

    /// A kubeconfig (YAML) for `server` as `identity`, with the CA inline.
    pub fn kubeconfig(&self, server: &str, identity: Identity) -> String {
        use base64::Engine;
        let ca = base64::engine::general_purpose::STANDARD.encode(self.pki.ca_pem.as_bytes());
        let tls = if server.starts_with("https://") {
            format!("    certificate-authority-data: {ca}\n")
        } else {
            String::new()
        };
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n{tls}\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\nusers:\n- name: test\n  user:\n    token: {}\n",
            self.token(identity)
        )
    }

    /// The API server's own `/metrics` (Prometheus text), read as the admin.
    pub async fn api_metrics(&self) -> Result<String, String> {
        let ca = reqwest::Certificate::from_pem(self.pki.ca_pem.as_bytes())
            .map_err(|e| e.to_string())?;
        let http = reqwest::Client::builder()
            .add_root_certificate(ca)
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        let resp = http
            .get(format!("{}/metrics", self.url()))
            .bearer_auth(&self.admin_token)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("/metrics: {}", resp.status()));
        }
        resp.text().await.map_err(|e| e.to_string())
    }

    /// Logs of the control-plane processes (for failure messages).
    pub fn logs_dir(&self) -> &Path {
        &self.dir
    }
}

/// The DER of the first certificate in `pem`.
fn pem_der(pem: &str) -> Vec<u8> {
    use base64::Engine;
    let body: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(body)
        .unwrap_or_default()
}

/// Where this process's control plane lives: tmpfs when there is one. Directories of test
/// binaries that are gone are removed first.
fn work_dir() -> Result<PathBuf, String> {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    if let Ok(entries) = std::fs::read_dir(&base) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let pid = name
                .strip_prefix("spotguard-k8s-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(pid) = pid {
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    let dir = base.join(format!(
        "spotguard-k8s-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// At exit: kill the control plane, then remove its directory (the children would die anyway
/// through PDEATHSIG; killing them first lets the directory go).
extern "C" fn stop_at_exit() {
    if let Some(Ok(cp)) = SHARED.get() {
        if let Ok(mut daemons) = cp.daemons.lock() {
            for d in daemons.iter_mut().rev() {
                d.kill();
            }
        }
        let _ = std::fs::remove_dir_all(&cp.dir);
    }
}

fn start() -> Result<ControlPlane, String> {
    let started = std::time::Instant::now();
    let assets = assets::locate().map_err(|e| e.to_string())?;
    let dir = work_dir()?;
    let pki = pki::generate(&dir.join("pki"))?;
    let admin_token = format!("admin-{:016x}", fastrand::u64(..));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut daemons = Vec::new();
    let result = rt.block_on(async {
        let etcd = etcd::start(&assets.etcd, &dir).await?;
        let etcd_url = etcd.url.clone();
        daemons.push(etcd.daemon);
        let event_ttl = EVENT_TTL.get().copied();
        let api = apiserver::start(
            &assets.kube_apiserver,
            &dir,
            &etcd_url,
            &pki,
            &admin_token,
            event_ttl,
        )
        .await?;
        let port = api.port;
        daemons.push(api.daemon);
        let url = format!("https://127.0.0.1:{port}");
        let admin_kubeconfig = dir.join("admin.kubeconfig");
        let mut cp = ControlPlane {
            assets: assets.clone(),
            dir: dir.clone(),
            port,
            pki: pki.clone(),
            admin_token: admin_token.clone(),
            agent_token: String::new(),
            force_delete_token: String::new(),
            admin_kubeconfig: admin_kubeconfig.clone(),
            event_ttl,
            daemons: Mutex::new(Vec::new()),
        };
        std::fs::write(&admin_kubeconfig, cp.kubeconfig(&url, Identity::Admin))
            .map_err(|e| e.to_string())?;
        if let Some(cm) = &assets.kube_controller_manager {
            daemons.push(controllers::start_controller_manager(
                cm,
                &dir,
                &admin_kubeconfig,
                &pki.ca_cert,
            )?);
        }
        if let Some(s) = &assets.kube_scheduler {
            daemons.push(controllers::start_scheduler(s, &dir, &admin_kubeconfig)?);
        }
        let admin = cp.admin();
        bootstrap_rbac(&admin).await?;
        cp.agent_token = mint_token(&admin, AGENT_NAMESPACE, AGENT_SERVICE_ACCOUNT).await?;
        cp.force_delete_token =
            mint_token(&admin, AGENT_NAMESPACE, FORCE_DELETE_SERVICE_ACCOUNT).await?;
        Ok::<ControlPlane, String>(cp)
    });
    let cp = match result {
        Ok(cp) => cp,
        Err(e) => {
            for d in daemons.iter_mut().rev() {
                d.kill();
            }
            return Err(format!("{e}\n(control-plane logs in {})", dir.display()));
        }
    };
    *cp.daemons.lock().unwrap_or_else(|e| e.into_inner()) = daemons;
    publish_service_ca(&cp);
    // SAFETY: registering a plain extern "C" function.
    unsafe {
        libc::atexit(stop_at_exit);
    }
    let parts = [
        ("etcd", Some(&cp.assets.etcd)),
        (
            "controller-manager",
            cp.assets.kube_controller_manager.as_ref(),
        ),
        ("scheduler", cp.assets.kube_scheduler.as_ref()),
    ]
    .iter()
    .map(|(n, p)| match p {
        Some(p) => format!("{n} {}", p.display()),
        None => format!("no {n}"),
    })
    .collect::<Vec<_>>()
    .join(", ");
    // Straight to stderr, past the test harness's output capture: every run says what it ran
    // against.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "testkit: real Kubernetes control plane {} from {} ({parts}) at {} in {:.1}s; logs in {}",
        cp.assets.version,
        cp.assets.source,
        cp.url(),
        started.elapsed().as_secs_f64(),
        cp.dir.display()
    );
    Ok(cp)
}

/// The ConfigMap OpenShift's service-ca controller publishes in every namespace.
pub const OPENSHIFT_SERVICE_CA: &str = "openshift-service-ca.crt";

/// The builds in `../shared/k8s` (1.34 and 1.32) are OpenShift's Kubernetes fork: their ServiceAccount
/// admission adds an `openshift-service-ca.crt` ConfigMap to every token volume, which
/// OpenShift's service-ca controller publishes in every namespace (a kubelet cannot start such a
/// pod until it exists). Stand in for that controller: a thread (with its own runtime, for the
/// life of the test binary) that watches namespaces and publishes the test CA under that name.
/// Harmless on upstream builds (an unused ConfigMap per namespace).
fn publish_service_ca(cp: &ControlPlane) {
    let config = cp.config(&cp.url(), Identity::Admin);
    let ca = cp.pki.ca_pem.clone();
    let spawned = on_own_thread("k8s-service-ca", config, move |client| async move {
        use futures::StreamExt;
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::api::{ListParams, WatchEvent, WatchParams};
        let nss: Api<Namespace> = Api::all(client.clone());
        let publish = |ns: String| {
            let client = client.clone();
            let ca = ca.clone();
            async move {
                let cms: Api<ConfigMap> = Api::namespaced(client, &ns);
                let cm = ConfigMap {
                    metadata: kube::api::ObjectMeta {
                        name: Some(OPENSHIFT_SERVICE_CA.into()),
                        ..Default::default()
                    },
                    data: Some(std::collections::BTreeMap::from([(
                        "service-ca.crt".to_string(),
                        ca,
                    )])),
                    ..Default::default()
                };
                let _ = cms.create(&PostParams::default(), &cm).await;
            }
        };
        loop {
            let Ok(list) = nss.list(&ListParams::default()).await else {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            };
            for ns in &list.items {
                publish(ns.metadata.name.clone().unwrap_or_default()).await;
            }
            let rv = list.metadata.resource_version.unwrap_or_default();
            let Ok(stream) = nss.watch(&WatchParams::default().timeout(290), &rv).await else {
                continue;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(ev)) = stream.next().await {
                if let WatchEvent::Added(ns) = ev {
                    publish(ns.metadata.name.clone().unwrap_or_default()).await;
                }
            }
        }
    });
    if let Err(e) = spawned {
        eprintln!("testkit: cannot start the service-ca publisher: {e}");
    }
}

/// Run `job` with a client made from `config` on a thread of its own (named `name`) with its own
/// current-thread runtime: for work that runs outside the test's runtime (a `Drop` while that
/// runtime shuts down) or for the life of the test binary. The client is made inside that
/// runtime; when the runtime or the client cannot be made, the job does not run.
pub(crate) fn on_own_thread<F, Fut>(
    name: &str,
    config: kube::Config,
    job: F,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce(kube::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async move {
                let Ok(client) = kube::Client::try_from(config) else {
                    return;
                };
                job(client).await
            })
        })
}

/// Parse one shipped manifest into a typed object.
pub fn load_manifest<K: DeserializeOwned>(relative: &str) -> Result<K, String> {
    let path = assets::repo_root().join(relative);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    serde_saphyr::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// Server-side apply of `obj` (cluster-scoped or namespaced by `api`).
pub async fn apply<K>(api: &Api<K>, name: &str, obj: &K) -> Result<K, String>
where
    K: kube::Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(name, &params, &Patch::Apply(obj))
        .await
        .map_err(|e| format!("applying {name}: {e}"))
}

fn name_of<K: kube::Resource>(obj: &K) -> String {
    obj.meta().name.clone().unwrap_or_default()
}

async fn apply_manifest<K>(client: &kube::Client, relative: &str) -> Result<K, String>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + std::fmt::Debug,
{
    let obj: K = load_manifest(relative)?;
    apply(&Api::all(client.clone()), &name_of(&obj), &obj).await
}

/// Server-side apply of a shipped manifest of cluster-scoped kind `K`, as the file has it.
async fn apply_as_written<K>(client: &kube::Client, relative: &str) -> Result<(), String>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let obj: serde_json::Value = load_manifest(relative)?;
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let params = PatchParams::apply(FIELD_MANAGER).force();
    Api::<K>::all(client.clone())
        .patch(&name, &params, &Patch::Apply(&obj))
        .await
        .map(drop)
        .map_err(|e| format!("applying {name}: {e}"))
}

/// The shipped namespace, ServiceAccount, ClusterRole and binding, ValidatingAdmissionPolicy and
/// binding, the force-delete component's ClusterRole, and a second ServiceAccount bound to both
/// roles.
async fn bootstrap_rbac(client: &kube::Client) -> Result<(), String> {
    apply_manifest::<Namespace>(client, "daemonset/namespace.yaml").await?;
    let sa: ServiceAccount = load_manifest("daemonset/serviceaccount.yaml")?;
    let ns = sa
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| AGENT_NAMESPACE.into());
    apply(&Api::namespaced(client.clone(), &ns), &name_of(&sa), &sa).await?;
    apply_manifest::<ClusterRole>(client, "daemonset/clusterrole.yaml").await?;
    apply_manifest::<ClusterRole>(client, "daemonset/clusterrole-interruptions-view.yaml").await?;
    install_ledger_crd(client).await?;
    let base_binding: ClusterRoleBinding =
        apply_manifest(client, "daemonset/clusterrolebinding.yaml").await?;
    // The policy that holds a pod-bound token of the agent to its own node, as the manifests
    // install it.
    // As written (not through the typed object, whose empty fields would own more than the file
    // says and conflict with an operator's apply of the same file).
    apply_as_written::<ValidatingAdmissionPolicy>(
        client,
        "daemonset/validatingadmissionpolicy.yaml",
    )
    .await?;
    apply_as_written::<ValidatingAdmissionPolicyBinding>(
        client,
        "daemonset/validatingadmissionpolicybinding.yaml",
    )
    .await?;

    // The component's file holds the ClusterRole and its binding (two documents).
    let path =
        assets::repo_root().join("daemonset/components/force-delete/clusterrole-force-delete.yaml");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let roles: Api<ClusterRole> = Api::all(client.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let mut component_binding = None;
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        match doc["kind"].as_str() {
            Some("ClusterRole") => {
                let role: ClusterRole =
                    serde_json::from_value(doc).map_err(|e| format!("{}: {e}", path.display()))?;
                apply(&roles, &name_of(&role), &role).await?;
            }
            Some("ClusterRoleBinding") => {
                let b: ClusterRoleBinding =
                    serde_json::from_value(doc).map_err(|e| format!("{}: {e}", path.display()))?;
                component_binding = Some(b);
            }
            _ => {}
        }
    }
    let component_binding =
        component_binding.ok_or_else(|| format!("{}: no ClusterRoleBinding", path.display()))?;

    // The second identity: the shipped bindings, with the subject renamed.
    let sa_api: Api<ServiceAccount> = Api::namespaced(client.clone(), AGENT_NAMESPACE);
    let mut sa: ServiceAccount = load_manifest("daemonset/serviceaccount.yaml")?;
    sa.metadata.name = Some(FORCE_DELETE_SERVICE_ACCOUNT.into());
    apply(&sa_api, FORCE_DELETE_SERVICE_ACCOUNT, &sa).await?;
    for mut b in [base_binding, component_binding] {
        let name = format!("{}-testkit-force-delete", name_of(&b));
        b.metadata = kube::api::ObjectMeta {
            name: Some(name.clone()),
            labels: b.metadata.labels.clone(),
            ..Default::default()
        };
        b.subjects = Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: FORCE_DELETE_SERVICE_ACCOUNT.into(),
            namespace: Some(AGENT_NAMESPACE.into()),
            api_group: None,
        }]);
        apply(&bindings, &name, &b).await?;
    }
    // The relay component's roles (Leases in the agent's namespace, TokenReviews), bound to the
    // shipped ServiceAccount as the component binds them.
    for file in [
        "daemonset/components/relay/role-relay.yaml",
        "daemonset/components/relay/clusterrole-relay.yaml",
    ] {
        apply_rbac_documents(client, file).await?;
    }
    Ok(())
}

/// Every Role, RoleBinding, ClusterRole and ClusterRoleBinding of the multi-document `file`.
async fn apply_rbac_documents(client: &kube::Client, file: &str) -> Result<(), String> {
    let path = assets::repo_root().join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |e: serde_json::Error| format!("{}: {e}", path.display());
    for doc in docs.into_iter().filter(|d| !d.is_null()) {
        let ns = doc["metadata"]["namespace"]
            .as_str()
            .unwrap_or(AGENT_NAMESPACE)
            .to_string();
        match doc["kind"].as_str() {
            Some("Role") => {
                let o: Role = serde_json::from_value(doc).map_err(bad)?;
                apply(&Api::namespaced(client.clone(), &ns), &name_of(&o), &o).await?;
            }
            Some("RoleBinding") => {
                let o: RoleBinding = serde_json::from_value(doc).map_err(bad)?;
                apply(&Api::namespaced(client.clone(), &ns), &name_of(&o), &o).await?;
            }
            Some("ClusterRole") => {
                let o: ClusterRole = serde_json::from_value(doc).map_err(bad)?;
                apply(&Api::all(client.clone()), &name_of(&o), &o).await?;
            }
            Some("ClusterRoleBinding") => {
                let o: ClusterRoleBinding = serde_json::from_value(doc).map_err(bad)?;
                apply(&Api::all(client.clone()), &name_of(&o), &o).await?;
            }
            other => return Err(format!("{}: unexpected kind {other:?}", path.display())),
        }
    }
    Ok(())
}

/// The goodput ledger's CRD as the manifests ship it, installed and Established (the agents
/// write their goodput records there).
async fn install_ledger_crd(client: &kube::Client) -> Result<(), String> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    apply_as_written::<CustomResourceDefinition>(client, LEDGER_CRD).await?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    crate::wait::until(
        "the goodput ledger's CRD Established",
        Duration::from_secs(60),
        || async {
            api.get("interruptions.spotguard.io")
                .await
                .ok()?
                .status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        },
    )
    .await;
    Ok(())
}

/// The goodput ledger's CRD in the kustomize base (the chart ships the same file in `crds/`).
pub const LEDGER_CRD: &str = "daemonset/crds/interruptions.spotguard.io.yaml";

/// A day-long token of ServiceAccount `namespace/name` (TokenRequest API).
pub async fn mint_token(
    client: &kube::Client,
    namespace: &str,
    name: &str,
) -> Result<String, String> {
    mint(client, namespace, name, TokenSpec::default()).await
}

/// What a TokenRequest asks for beyond the ServiceAccount.
#[derive(Clone, Debug, Default)]
pub struct TokenSpec {
    /// Default: the API server's issuer.
    pub audience: Option<String>,
    /// Default: a day.
    pub expiration_seconds: Option<i64>,
    pub bound_object_ref: Option<BoundObjectReference>,
}

/// A day-long token of `pod`'s ServiceAccount bound to `pod`, as the kubelet mints for a
/// projected token volume: the API server puts the pod's node in its user info
/// (`authentication.kubernetes.io/node-name`).
pub async fn mint_pod_token(client: &kube::Client, pod: &Pod) -> Result<String, String> {
    mint_bound(client, pod, None).await
}

/// [`mint_pod_token`] for `audience` (a projected token's, as the kubelet mints for a
/// `serviceAccountToken` volume source with that audience).
pub async fn mint_pod_token_for(
    client: &kube::Client,
    pod: &Pod,
    audience: &str,
) -> Result<String, String> {
    mint_bound(client, pod, Some(audience.to_string())).await
}

/// A token of `pod`'s ServiceAccount bound to `pod`, for `audience` (the API server's when
/// `None`).
async fn mint_bound(
    client: &kube::Client,
    pod: &Pod,
    audience: Option<String>,
) -> Result<String, String> {
    let namespace = pod.metadata.namespace.clone().unwrap_or_default();
    let sa = pod
        .spec
        .as_ref()
        .and_then(|s| s.service_account_name.clone())
        .unwrap_or_else(|| "default".into());
    let bound = BoundObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: pod.metadata.name.clone(),
        uid: pod.metadata.uid.clone(),
    };
    let spec = TokenSpec {
        audience,
        bound_object_ref: Some(bound),
        ..Default::default()
    };
    mint(client, &namespace, &sa, spec).await
}

/// The one TokenRequest of the test support (the agent's tokens, the kubelet stand-in's
/// projected tokens).
pub(crate) async fn mint(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    spec: TokenSpec,
) -> Result<String, String> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let req = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![spec
                .audience
                .unwrap_or_else(|| apiserver::ISSUER.to_string())],
            expiration_seconds: Some(spec.expiration_seconds.unwrap_or(24 * 3600)),
            bound_object_ref: spec.bound_object_ref,
        },
        ..Default::default()
    };
    // A just-created ServiceAccount may take a moment to be visible to the token endpoint.
    let mut last = String::new();
    for _ in 0..50 {
        match api
            .create_subresource::<_, TokenRequest>("token", name, &PostParams::default(), &req)
            .await
        {
            Ok(t) => {
                if let Some(status) = t.status {
                    return Ok(status.token);
                }
                last = "no status in the TokenRequest answer".into();
            }
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("TokenRequest for {namespace}/{name}: {last}"))
}
