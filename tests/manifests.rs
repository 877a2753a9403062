//! Deployment artefacts (daemonset/, systemd/, the Kubernetes objects in docs/) are checked with
//! the real tools against a real API server.
//!
//! Every Kubernetes object we ship or print goes through `kubectl` the way the docs tell users to
//! apply it (`kubectl kustomize` for the kustomizations, `kubectl apply --server-side` for
//! files), into testkit's real kube-apiserver with server-side dry run (`--dry-run=server`: full
//! admission and validation, nothing persisted; the PodMonitor / PrometheusRule CRDs from
//! `../shared/k8s/crds/` are installed for real). On top of the server's own validation, every
//! object is decoded into the typed k8s-openapi 1.33 struct and encoded back, and any field that
//! did not survive (a typo, a field of the wrong object) fails the test with its path.
//!
//! Beyond validation, the DaemonSet really runs: applied for real, its pod created by the
//! DaemonSet controller, scheduled by kube-scheduler onto a GPU node, and run by the kubelet
//! stand-in with its args, env, mounts (hostPaths mapped to the node's own directories) and
//! ServiceAccount token; its agent then handles a notice on that node.
//!
//! Tools: kubectl ≥ 1.29 and systemd-analyze (`scripts/deps/kubectl.sh` installs both).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateRunning, ContainerStatus, Namespace, Pod, PodStatus,
    ResourceQuota, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, PostParams};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use spotguard::checkpoint::pods::{pod_checkpoint_spec, PodDefaults};
use spotguard::checkpoint::{Signal, TargetMode};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::k8s::assets;
use spotguard_testkit::k8s::tools::{self, find_on_path};

const DEPS: &str = tools::KUBECTL_DEPS;
const MIN_KUBECTL_MINOR: u32 = 29;

/// Every Kubernetes object file under daemonset/ (kustomization.yaml files are checked through
/// `kubectl kustomize`).
fn yaml_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml")
            ) && path.file_stem().and_then(|s| s.to_str()) != Some("kustomization")
            {
                out.push(path);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo_root().join("daemonset"), &mut out);
    out.sort();
    out
}

/// Kinds that have no k8s-openapi type (CRDs): checked by the server against the CRD schema only.
const CRD_KINDS: &[&str] = &[
    "PodMonitor",
    "PrometheusRule",
    "JobSet",
    "ResourceFlavor",
    "ClusterQueue",
    "LocalQueue",
    "PyTorchJob",
    "ClusterTrainingRuntime",
    "TrainJob",
];

// ---------------------------------------------------------------------------------------------
// kubectl against the real API server.

/// kubectl as an operator (admin), through this test's fault proxy (whose request log shows
/// what reached the server).
struct Kubectl(tools::Kubectl);

impl std::ops::Deref for Kubectl {
    type Target = tools::Kubectl;
    fn deref(&self) -> &tools::Kubectl {
        &self.0
    }
}

/// The objects of kubectl's `-o json` output: one object, or a `List`'s items.
fn objects_of(stdout: &str) -> Result<Vec<Value>, String> {
    let docs: Result<Vec<Value>, _> = serde_json::Deserializer::from_str(stdout)
        .into_iter::<Value>()
        .collect();
    let docs = docs.map_err(|e| format!("kubectl printed no JSON: {e}"))?;
    let mut out = Vec::new();
    for d in docs {
        if d["kind"] == "List" {
            out.extend(d["items"].as_array().cloned().unwrap_or_default());
        } else {
            out.push(d);
        }
    }
    Ok(out)
}

impl Kubectl {
    async fn start() -> Kubectl {
        let kubectl = Kubectl(
            tools::Kubectl::start(tools::Server::Proxy, std::time::Duration::from_secs(120)).await,
        );
        kubectl.check_version().await;
        kubectl
    }

    async fn check_version(&self) {
        // `version --client` reads no cluster; --cache-dir is accepted by every command.
        let ran = self.run(&["version", "--client", "-o", "json"], None).await;
        assert!(ran.ok, "kubectl version failed: {}; see {DEPS}", ran.stderr);
        let v: Value = serde_json::from_str(&ran.stdout).unwrap();
        let minor: u32 = v["clientVersion"]["minor"]
            .as_str()
            .unwrap_or_default()
            .trim_end_matches('+')
            .parse()
            .unwrap_or(0);
        assert!(
            minor >= MIN_KUBECTL_MINOR,
            "kubectl 1.{minor} is too old (need ≥ 1.{MIN_KUBECTL_MINOR}); run {DEPS}"
        );
    }

    /// Create the namespaces `objects` live in (for real), as a user applying into them would
    /// have them.
    async fn ensure_namespaces(&self, objects: &[Value]) {
        let nss: Api<Namespace> = Api::all(self.k.admin());
        for ns in objects
            .iter()
            .filter_map(|o| o["metadata"]["namespace"].as_str())
            .collect::<BTreeSet<_>>()
        {
            let obj = Namespace {
                metadata: kube::api::ObjectMeta {
                    name: Some(ns.to_string()),
                    ..Default::default()
                },
                ..Default::default()
            };
            match nss.create(&PostParams::default(), &obj).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => panic!("namespace {ns}: {e}"),
            }
        }
    }

    /// The objects of a manifest as kubectl reads it (client side, nothing sent).
    async fn read(&self, file: &str, stdin: Option<&str>) -> Result<Vec<Value>, String> {
        let ran = self
            .run(
                &["create", "--dry-run=client", "-f", file, "-o", "json"],
                stdin,
            )
            .await;
        if !ran.ok {
            return Err(ran.stderr);
        }
        objects_of(&ran.stdout)
    }

    /// `kubectl apply --server-side --dry-run=server -f FILE -o json`: the objects as the API
    /// server would store them, or kubectl's (or the server's) error.
    async fn dry_run(&self, file: &str, stdin: Option<&str>) -> Result<Vec<Value>, String> {
        // The namespaces must exist for the server to admit objects into them.
        if let Ok(objects) = self.read(file, stdin).await {
            self.ensure_namespaces(&objects).await;
        }
        let ran = self
            .run(
                &[
                    "apply",
                    "--server-side",
                    "--dry-run=server",
                    "--field-manager=spotguard-manifests-test",
                    "-f",
                    file,
                    "-o",
                    "json",
                ],
                stdin,
            )
            .await;
        if !ran.ok {
            return Err(ran.stderr);
        }
        let objects = objects_of(&ran.stdout)?;
        if objects.is_empty() {
            return Err("no objects".into());
        }
        Ok(objects)
    }

    /// The CRDs of `../shared/k8s/crds/` (prometheus-operator, JobSet, Kueue, the training
    /// operator's PyTorchJob, Kubeflow Trainer), installed for real (idempotent) and Established.
    async fn install_crds(&self) {
        let dir = assets::shared_dir().join("crds");
        self.install_crds_from(&dir, "spotguard-manifests-test")
            .await;
        // Real writes, not the dry runs under test.
        self.k.proxy().clear_requests();
    }

    /// Nothing a dry run sent was persisted: every write carried `dryRun=All`.
    fn assert_read_only(&self) {
        let requests = self.k.proxy().requests();
        assert!(!requests.is_empty(), "kubectl never asked the server");
        let writes: Vec<_> = requests
            .iter()
            .filter(|r| r.is_write())
            .filter(|r| r.query_param("dryRun").as_deref() != Some("All"))
            .map(|r| format!("{} {}", r.method, r.path))
            .collect();
        assert!(writes.is_empty(), "dry run wrote to the server: {writes:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Strict decoding into the k8s-openapi 1.33 types.

/// Paths of `original` that did not survive the typed round trip into `back`.
fn lost_fields(path: &str, original: &Value, back: &Value, out: &mut Vec<String>) {
    match (original, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, va) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    _ if va.is_null() => {}
                    None => out.push(p),
                    Some(vb) => lost_fields(&p, va, vb, out),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (va, vb)) in a.iter().zip(b).enumerate() {
                lost_fields(&format!("{path}[{i}]"), va, vb, out);
            }
        }
        _ if original == back => {}
        // Quantities and int-or-strings written as bare numbers come back as strings.
        (Value::Number(n), Value::String(s)) if n.to_string() == *s => {}
        // Numbers typed as floats (a CRD schema's minimum / maximum) come back with a fraction.
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => {}
        _ => out.push(format!("{path} ({original} became {back})")),
    }
}

fn strict<K: DeserializeOwned + Serialize>(obj: &Value) -> Result<K, String> {
    let typed: K =
        serde_json::from_value(obj.clone()).map_err(|e| format!("does not decode: {e}"))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut lost = Vec::new();
    lost_fields("", obj, &back, &mut lost);
    if lost.is_empty() {
        Ok(typed)
    } else {
        Err(format!(
            "fields unknown to the Kubernetes 1.33 schema (typo or wrong place?): {}",
            lost.join(", ")
        ))
    }
}

/// Strictly check one object by its kind.
fn check_object(obj: &Value) -> Result<(), String> {
    let kind = obj["kind"].as_str().unwrap_or_default();
    match kind {
        "Namespace" => strict::<Namespace>(obj).map(drop),
        "ServiceAccount" => strict::<ServiceAccount>(obj).map(drop),
        "Service" => strict::<Service>(obj).map(drop),
        "ResourceQuota" => strict::<ResourceQuota>(obj).map(drop),
        "ClusterRole" => strict::<ClusterRole>(obj).map(drop),
        "ClusterRoleBinding" => strict::<ClusterRoleBinding>(obj).map(drop),
        "Role" => strict::<Role>(obj).map(drop),
        "RoleBinding" => strict::<RoleBinding>(obj).map(drop),
        "DaemonSet" => strict::<DaemonSet>(obj).map(drop),
        "Job" => strict::<Job>(obj).map(drop),
        "Pod" => strict::<Pod>(obj).map(drop),
        "ValidatingAdmissionPolicy" => strict::<ValidatingAdmissionPolicy>(obj).map(drop),
        "ValidatingAdmissionPolicyBinding" => {
            strict::<ValidatingAdmissionPolicyBinding>(obj).map(drop)
        }
        "CustomResourceDefinition" => strict::<CustomResourceDefinition>(obj).map(drop),
        k if CRD_KINDS.contains(&k) => Ok(()),
        other => Err(format!(
            "kind {other:?} has no strict check: add it to check_object"
        )),
    }
}

fn object_name(obj: &Value) -> String {
    format!(
        "{}/{}",
        obj["kind"].as_str().unwrap_or("?"),
        obj["metadata"]["name"].as_str().unwrap_or("?")
    )
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("{kind}/{name} missing"))
}

/// Dry-run and strictly check everything kustomize renders from `dir`.
async fn kustomized(k: &Kubectl, dir: &Path) -> Vec<Value> {
    let rendered = k.kustomize(dir).await;
    let objects = k
        .dry_run("-", Some(&rendered))
        .await
        .unwrap_or_else(|e| panic!("kustomized {}: {e}", dir.display()));
    for obj in &objects {
        if let Err(e) = check_object(obj) {
            panic!("kustomized {}: {}: {e}", dir.display(), object_name(obj));
        }
    }
    objects
}

// ---------------------------------------------------------------------------------------------
// The tests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_manifest_passes_server_dry_run_and_the_strict_schema() {
    let k = Kubectl::start().await;
    k.install_crds().await;
    let files = yaml_files();
    assert!(
        files.len() >= 10,
        "expected the whole daemonset/ tree, got {files:?}"
    );
    let mut failures = Vec::new();
    let mut seen_kinds = BTreeSet::new();
    for file in &files {
        let shown = file
            .strip_prefix(repo_root())
            .unwrap()
            .display()
            .to_string();
        match k.dry_run(file.to_str().unwrap(), None).await {
            Err(e) => failures.push(format!(
                "{shown}: kubectl apply --server-side --dry-run=server: {e}"
            )),
            Ok(objects) => {
                for obj in &objects {
                    seen_kinds.insert(obj["kind"].as_str().unwrap_or_default().to_string());
                    if let Err(e) = check_object(obj) {
                        failures.push(format!("{shown}: {}: {e}", object_name(obj)));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    for kind in [
        "DaemonSet",
        "ClusterRole",
        "ClusterRoleBinding",
        "Job",
        "PodMonitor",
    ] {
        assert!(seen_kinds.contains(kind), "no {kind} under daemonset/");
    }
    k.assert_read_only();
}

/// kubectl, the real server and the strict check reject what they should: otherwise the test
/// above would prove nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_catch_broken_manifests() {
    let k = Kubectl::start().await;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    // Unknown kind: kubectl cannot map it.
    let f = write(
        "kind.yaml",
        "apiVersion: v1\nkind: Namespce\nmetadata:\n  name: x\n",
    );
    assert!(k.dry_run(&f, None).await.is_err());
    // Duplicate key: kubectl's own check.
    let f = write(
        "dup.yaml",
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  name: y\n",
    );
    assert!(k.dry_run(&f, None).await.is_err());
    // Not YAML.
    let f = write("bad.yaml", "apiVersion: v1\nkind: [Namespace\n");
    assert!(k.dry_run(&f, None).await.is_err());
    // A typo in a field name: the server's strict field validation refuses it, and so does the
    // strict round trip of what kubectl read.
    let typo = "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\n  namespace: default\nspec:\n  selector:\n    matchLabels: {a: b}\n  template:\n    metadata:\n      labels: {a: b}\n    spec:\n      hostPid: true\n      containers:\n      - name: c\n        image: i\n";
    let f = write("typo.yaml", typo);
    let err = k.dry_run(&f, None).await.unwrap_err();
    assert!(err.contains("hostPid"), "{err}");
    let objects = k.read(&f, None).await.unwrap();
    let err = check_object(&objects[0]).unwrap_err();
    assert!(err.contains(".spec.template.spec.hostPid"), "{err}");
    // A wrong type.
    let f = write(
        "type.yaml",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\n  namespace: default\nspec:\n  ports:\n  - port: nine\n",
    );
    assert!(k.dry_run(&f, None).await.is_err());
    // What no schema check sees and the server's validation does: a port name over 15
    // characters, and podFailurePolicy exit codes out of order.
    let f = write(
        "port.yaml",
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: x\n  namespace: default\nspec:\n  containers:\n  - name: c\n    image: i\n    ports:\n    - {name: prefetch-metrics, containerPort: 9465}\n",
    );
    let objects = k.read(&f, None).await.unwrap();
    assert!(check_object(&objects[0]).is_ok(), "the schema allows it");
    let err = k.dry_run(&f, None).await.unwrap_err();
    assert!(err.contains("must be no more than 15 characters"), "{err}");
    let f = write(
        "job.yaml",
        "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: x\n  namespace: default\nspec:\n  podFailurePolicy:\n    rules:\n    - action: Count\n      onExitCodes: {operator: In, values: [143, 137]}\n  template:\n    spec:\n      restartPolicy: Never\n      containers:\n      - name: c\n        image: i\n",
    );
    let err = k.dry_run(&f, None).await.unwrap_err();
    assert!(err.contains("must be ordered"), "{err}");
    k.assert_read_only();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kustomize_base_renders_the_whole_install() {
    let k = Kubectl::start().await;
    let objects = kustomized(&k, &repo_root().join("daemonset")).await;
    let names: BTreeSet<String> = objects.iter().map(object_name).collect();
    let want: BTreeSet<String> = [
        "Namespace/spotguard",
        "ServiceAccount/spotguard",
        "ResourceQuota/spotguard-critical-pods",
        "ClusterRole/spotguard",
        "ClusterRoleBinding/spotguard",
        "ClusterRole/spotguard-interruptions-view",
        "CustomResourceDefinition/interruptions.spotguard.io",
        "ValidatingAdmissionPolicy/spotguard-own-node",
        "ValidatingAdmissionPolicyBinding/spotguard-own-node",
        "DaemonSet/spotguard",
        "Service/spotguard-metrics",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(names, want);
    // Without the component, nobody may delete pods.
    for obj in &objects {
        if obj["kind"] == "ClusterRole" {
            let role: ClusterRole = strict(obj).unwrap();
            assert!(!rule_set(&role)
                .iter()
                .any(|(_, r, v)| r == "pods" && v == "delete"));
        }
    }
    k.assert_read_only();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_delete_component_adds_only_pod_deletion() {
    let k = Kubectl::start().await;
    // An overlay outside daemonset/, the way an operator would enable the component.
    let overlay = tools::overlay(&["daemonset"], &["daemonset/components/force-delete"], "");
    let objects = kustomized(&k, overlay.path()).await;

    let role: ClusterRole =
        strict(find(&objects, "ClusterRole", "spotguard-force-delete")).unwrap();
    assert_eq!(
        rule_set(&role),
        BTreeSet::from([(String::new(), "pods".to_string(), "delete".to_string())])
    );
    let binding: ClusterRoleBinding = strict(find(
        &objects,
        "ClusterRoleBinding",
        "spotguard-force-delete",
    ))
    .unwrap();
    assert_eq!(binding.role_ref.name, "spotguard-force-delete");
    let subjects = binding.subjects.unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(
        (
            subjects[0].kind.as_str(),
            subjects[0].name.as_str(),
            subjects[0].namespace.as_deref()
        ),
        ("ServiceAccount", "spotguard", Some("spotguard"))
    );
    // The base role is unchanged.
    let base_role: ClusterRole = strict(find(&objects, "ClusterRole", "spotguard")).unwrap();
    assert_eq!(rule_set(&base_role), least_privilege());

    let ds: DaemonSet = strict(find(&objects, "DaemonSet", "spotguard")).unwrap();
    let env = agent(&ds).env.clone().unwrap_or_default();
    let flags: Vec<_> = env
        .iter()
        .filter(|e| e.name == "SPOTGUARD_FORCE_DELETE_AT_DEADLINE")
        .collect();
    assert_eq!(flags.len(), 1, "{flags:?}");
    assert_eq!(flags[0].value.as_deref(), Some("true"));
}

/// The relay component (docs/relay.md, "Kubernetes") adds exactly: TokenReviews, the Leases of
/// the agent's own namespace, the relay's settings, port, staging volume and projected token;
/// the base's role and policy are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_component_adds_only_leases_and_token_reviews() {
    let k = Kubectl::start().await;
    let overlay = tools::overlay(&["daemonset"], &["daemonset/components/relay"], "");
    let objects = kustomized(&k, overlay.path()).await;
    let rule = |g: &str, r: &str, v: &str| (g.to_string(), r.to_string(), v.to_string());

    let cluster: ClusterRole = strict(find(&objects, "ClusterRole", "spotguard-relay")).unwrap();
    assert_eq!(
        rule_set(&cluster),
        BTreeSet::from([rule("authentication.k8s.io", "tokenreviews", "create")])
    );
    let role: Role = strict(find(&objects, "Role", "spotguard-relay")).unwrap();
    assert_eq!(role.metadata.namespace.as_deref(), Some("spotguard"));
    let mut leases = BTreeSet::new();
    for r in role.rules.iter().flatten() {
        assert!(r.resource_names.is_none());
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    leases.insert(rule(g, res, v));
                }
            }
        }
    }
    assert_eq!(
        leases,
        ["get", "list", "create", "patch"]
            .into_iter()
            .map(|v| rule("coordination.k8s.io", "leases", v))
            .collect()
    );
    for (kind, name) in [
        ("ClusterRoleBinding", "spotguard-relay"),
        ("RoleBinding", "spotguard-relay"),
    ] {
        let b = find(&objects, kind, name);
        assert_eq!(b["roleRef"]["name"], "spotguard-relay");
        assert_eq!(b["subjects"].as_array().unwrap().len(), 1);
        assert_eq!(b["subjects"][0]["name"], "spotguard");
        assert_eq!(b["subjects"][0]["namespace"], "spotguard");
    }
    let base_role: ClusterRole = strict(find(&objects, "ClusterRole", "spotguard")).unwrap();
    assert_eq!(rule_set(&base_role), least_privilege());

    let ds: DaemonSet = strict(find(&objects, "DaemonSet", "spotguard")).unwrap();
    let agent = agent(&ds);
    let env: BTreeMap<String, Option<String>> = agent
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    for (name, value) in [
        ("SPOTGUARD_RELAY", "auto"),
        ("SPOTGUARD_RELAY_LISTEN", "0.0.0.0:7443"),
        (
            "SPOTGUARD_RELAY_STAGING_DIR",
            "/var/lib/spotguard/relay/staging",
        ),
        (
            "SPOTGUARD_RELAY_TOKEN_FILE",
            "/var/run/secrets/spotguard.io/relay/token",
        ),
        ("SPOTGUARD_RELAY_AUDIENCE", "spotguard-relay"),
    ] {
        assert_eq!(env.get(name), Some(&Some(value.to_string())), "{name}");
    }
    assert!(env.contains_key("POD_SERVICE_ACCOUNT") && env.contains_key("POD_IP"));
    assert!(agent
        .ports
        .iter()
        .flatten()
        .any(|p| p.name.as_deref() == Some("relay") && p.container_port == 7443));
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let volumes = pod.volumes.as_ref().unwrap();
    let staging = volumes.iter().find(|v| v.name == "relay-staging").unwrap();
    assert_eq!(
        staging.host_path.as_ref().unwrap().path,
        "/var/lib/spotguard/relay/staging"
    );
    let token = volumes.iter().find(|v| v.name == "relay-token").unwrap();
    let sources = token.projected.as_ref().unwrap().sources.as_ref().unwrap();
    let sa = sources[0].service_account_token.as_ref().unwrap();
    assert_eq!(sa.audience.as_deref(), Some("spotguard-relay"));
    assert_eq!(sa.path, "token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn monitoring_kustomization_renders() {
    let k = Kubectl::start().await;
    k.install_crds().await;
    let objects = kustomized(&k, &repo_root().join("daemonset/monitoring")).await;
    let pm = find(&objects, "PodMonitor", "spotguard");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    assert_eq!(
        pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"],
        "agent"
    );
}

type Rule = (String, String, String);

fn rule_set(role: &ClusterRole) -> BTreeSet<Rule> {
    let mut out = BTreeSet::new();
    for rule in role.rules.iter().flatten() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert_ne!(verb, "*", "wildcard verb");
                    assert_ne!(resource, "*", "wildcard resource");
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

/// Design §10, exactly.
fn least_privilege() -> BTreeSet<Rule> {
    [
        ("", "nodes", "get"),
        ("", "nodes", "patch"),
        ("", "nodes/status", "patch"),
        ("", "pods", "get"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
        ("", "pods/status", "patch"),
        ("", "pods/eviction", "create"),
        ("", "events", "create"),
        ("", "events", "patch"),
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
        ("spotguard.io", "interruptions", "create"),
        ("spotguard.io", "interruptions", "get"),
        ("spotguard.io", "interruptions", "list"),
        ("spotguard.io", "interruptions", "delete"),
        ("batch", "jobs", "get"),
    ]
    .into_iter()
    .map(|(g, r, v)| (g.to_string(), r.to_string(), v.to_string()))
    .collect()
}

async fn load<K: DeserializeOwned + Serialize>(k: &Kubectl, file: &str, kind: &str) -> K {
    let objects = k
        .dry_run(repo_root().join(file).to_str().unwrap(), None)
        .await
        .unwrap();
    let obj = objects
        .iter()
        .find(|o| o["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in {file}"));
    strict(obj).unwrap()
}

fn agent(ds: &DaemonSet) -> &Container {
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    // The agent; the prefetcher runs in its own container (tests/prefetch_manifests.rs).
    pod.containers
        .iter()
        .find(|c| c.name == "spotguard")
        .expect("the agent container")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusterrole_is_exactly_least_privilege() {
    let k = Kubectl::start().await;
    let role: ClusterRole = load(&k, "daemonset/clusterrole.yaml", "ClusterRole").await;
    assert_eq!(rule_set(&role), least_privilege());
    let binding: ClusterRoleBinding = load(
        &k,
        "daemonset/clusterrolebinding.yaml",
        "ClusterRoleBinding",
    )
    .await;
    assert_eq!(binding.role_ref.name, "spotguard");
    let sa: ServiceAccount = load(&k, "daemonset/serviceaccount.yaml", "ServiceAccount").await;
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!(Some(subject.name.as_str()), sa.metadata.name.as_deref());
    assert_eq!(subject.namespace, sa.metadata.namespace);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemonset_has_the_required_security_shape() {
    let k = Kubectl::start().await;
    let ds: DaemonSet = load(&k, "daemonset/daemonset.yaml", "DaemonSet").await;
    let pod = ds.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    assert_eq!(pod.service_account_name.as_deref(), Some("spotguard"));
    assert!(pod.termination_grace_period_seconds.unwrap_or(0) >= 120);
    assert!(pod.host_ipc.is_none() || pod.host_ipc == Some(false));

    let c = agent(&ds);
    let sc = c.security_context.as_ref().unwrap();
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let added: BTreeSet<&str> = caps.add.iter().flatten().map(String::as_str).collect();
    assert_eq!(added, BTreeSet::from(["KILL", "SYS_PTRACE"]));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_ne!(sc.privileged, Some(true));
    assert_eq!(sc.run_as_user, Some(0));
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    assert_eq!(
        c.termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );

    // Downward API.
    let env = c.env.as_deref().unwrap();
    for (name, field) in [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_NAME", "metadata.name"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ] {
        let e = env
            .iter()
            .find(|e| e.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        let field_ref = e.value_from.as_ref().and_then(|v| v.field_ref.as_ref());
        assert_eq!(
            field_ref.map(|f| f.field_path.as_str()),
            Some(field),
            "{name}"
        );
    }
    // Flags as SPOTGUARD_* env only.
    for e in env.iter().filter(|e| e.name.starts_with("SPOTGUARD")) {
        assert!(
            e.name.starts_with("SPOTGUARD_") && e.value.is_some(),
            "{e:?}"
        );
    }

    // Probes on the named metrics port.
    let port = c
        .ports
        .as_deref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .unwrap();
    assert_eq!(port.container_port, 9464);
    for (probe, path) in [
        (&c.liveness_probe, "/healthz"),
        (&c.readiness_probe, "/readyz"),
    ] {
        let get = probe.as_ref().unwrap().http_get.as_ref().unwrap();
        assert_eq!(get.path.as_deref(), Some(path));
        assert_eq!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("metrics".into())
        );
    }

    // Resources.
    let res = c.resources.as_ref().unwrap();
    let requests = res.requests.as_ref().unwrap();
    assert_eq!(requests.get("memory"), Some(&Quantity("64Mi".into())));
    assert_eq!(requests.get("cpu"), Some(&Quantity("50m".into())));
    assert_eq!(
        res.limits.as_ref().unwrap().get("memory"),
        Some(&Quantity("192Mi".into()))
    );

    // hostPath mounts: read-only except the prefetch cache and the plan record.
    let volumes = pod.volumes.as_deref().unwrap();
    let mut host_mounts = BTreeSet::new();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes.iter().find(|v| v.name == m.name).unwrap();
        if let Some(hp) = &v.host_path {
            let writable = m.read_only != Some(true);
            host_mounts.insert((hp.path.clone(), m.mount_path.clone(), writable));
        }
    }
    assert_eq!(
        host_mounts,
        BTreeSet::from([
            (
                "/sys/fs/cgroup".to_string(),
                "/sys/fs/cgroup".to_string(),
                false
            ),
            (
                "/var/cache/spotguard".to_string(),
                "/var/cache/spotguard".to_string(),
                true
            ),
            (
                "/var/lib/spotguard".to_string(),
                "/var/lib/spotguard".to_string(),
                true
            ),
            (
                "/sys/class/dmi/id".to_string(),
                "/sys/class/dmi/id".to_string(),
                false
            ),
            (
                "/var/lib/kubelet/pod-resources".to_string(),
                "/var/lib/kubelet/pod-resources".to_string(),
                false
            ),
        ])
    );

    // Tolerations: GPU, spot and spotguard's own taints.
    let keys: BTreeSet<&str> = pod
        .tolerations
        .iter()
        .flatten()
        .filter_map(|t| t.key.as_deref())
        .collect();
    for key in [
        "nvidia.com/gpu",
        "cloud.google.com/gke-spot",
        "kubernetes.azure.com/scalesetpriority",
        "karpenter.sh/disruption",
        spotguard::node::INTERRUPTION_TAINT,
        spotguard::node::GPU_UNHEALTHY_TAINT,
    ] {
        assert!(keys.contains(key), "no toleration for {key}");
    }
    // GPU pool affinity.
    let terms = &pod
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .unwrap()
        .node_selector_terms;
    assert!(terms.iter().any(|t| t
        .match_expressions
        .iter()
        .flatten()
        .any(|e| e.key == "nvidia.com/gpu.present")));

    // The headless Service selects these pods on the same port name.
    let svc: Service = load(&k, "daemonset/service.yaml", "Service").await;
    let spec = svc.spec.unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    let labels = ds
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (key, value) in spec.selector.unwrap() {
        assert_eq!(labels.get(&key), Some(&value));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_job_speaks_the_checkpoint_protocol() {
    let k = Kubectl::start().await;
    let job: Job = load(&k, "daemonset/examples/training-job.yaml", "Job").await;
    let spec = job.spec.as_ref().unwrap();
    let template = &spec.template;
    let pod_spec = template.spec.clone().unwrap();
    assert_eq!(pod_spec.restart_policy.as_deref(), Some("Never"));

    // podFailurePolicy: disruptions ignored, 143 retryable.
    let rules = &spec.pod_failure_policy.as_ref().unwrap().rules;
    assert!(rules.iter().any(|r| r.action == "Ignore"
        && r.on_pod_conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "DisruptionTarget")));
    let exit_143 = rules
        .iter()
        .find(|r| {
            r.on_exit_codes
                .as_ref()
                .is_some_and(|e| e.operator == "In" && e.values.contains(&143))
        })
        .expect("a rule for exit code 143");
    assert!(matches!(exit_143.action.as_str(), "Count" | "Ignore"));

    // The annotations parse with the agent's own parser, as the pod would be seen on a node.
    let mut metadata = template.metadata.clone().unwrap();
    metadata.namespace = job.metadata.namespace.clone();
    metadata.name = Some("llm-finetune-x7k2p".into());
    metadata.uid = Some("6a0e1d52-95c6-4d4c-9d2f-5e1b8f3c7a11".into());
    let trainer_id = "ab".repeat(32);
    let pod = Pod {
        metadata,
        spec: Some(pod_spec.clone()),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![ContainerStatus {
                name: "trainer".into(),
                container_id: Some(format!("containerd://{trainer_id}")),
                state: Some(ContainerState {
                    running: Some(ContainerStateRunning::default()),
                    ..Default::default()
                }),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    };
    let parsed = pod_checkpoint_spec(&pod, &PodDefaults::default())
        .unwrap()
        .expect("the example opts in");
    assert_eq!(parsed.signal, Signal::USR1);
    assert_eq!(parsed.mode, TargetMode::Handlers);
    assert_eq!(parsed.timeout, std::time::Duration::from_secs(80));
    assert_eq!(parsed.containers, vec![("trainer".to_string(), trainer_id)]);

    // SPOTGUARD_DIR points at the annotated dir, which is a world-writable emptyDir.
    let trainer = pod_spec
        .containers
        .iter()
        .find(|c| c.name == "trainer")
        .unwrap();
    let dir_env = trainer
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "SPOTGUARD_DIR")
        .unwrap();
    assert_eq!(
        dir_env.value.as_deref().map(Path::new),
        Some(parsed.dir.as_path())
    );
    let mount = trainer
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| Path::new(&m.mount_path) == parsed.dir)
        .expect("a volume at the checkpoint dir");
    let volume = pod_spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)
        .unwrap();
    assert!(volume.empty_dir.is_some());
    let annotations = template
        .metadata
        .as_ref()
        .unwrap()
        .annotations
        .as_ref()
        .unwrap();
    assert!(annotations.get("spotguard.io/prefetch").is_some_and(|u| u
        .split_once('=')
        .map_or(u.as_str(), |(_, url)| url)
        .starts_with("s3://")));
}

/// The kube-prometheus-stack example (monitoring + the alerts component + the stack's `release`
/// label), as `kubectl apply -k daemonset/examples/kube-prometheus-stack` sends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_prometheus_stack_example_with_the_alerts_is_accepted() {
    let k = Kubectl::start().await;
    k.install_crds().await;
    let objects = kustomized(
        &k,
        &repo_root().join("daemonset/examples/kube-prometheus-stack"),
    )
    .await;
    let pm = find(&objects, "PodMonitor", "spotguard");
    assert_eq!(pm["metadata"]["labels"]["release"], "kube-prometheus-stack");
    // The pod selector is untouched by the label.
    assert!(pm["spec"]["selector"]["matchLabels"]["release"].is_null());
    let rules = objects
        .iter()
        .find(|o| o["kind"] == "PrometheusRule")
        .expect("the alerts component's PrometheusRule");
    assert_eq!(
        rules["metadata"]["labels"]["release"],
        "kube-prometheus-stack"
    );
    // Every PodMonitor endpoint names a port of the DaemonSet's pods.
    let base = kustomized(&k, &repo_root().join("daemonset")).await;
    let ds: DaemonSet = strict(find(&base, "DaemonSet", "spotguard")).unwrap();
    let ports: BTreeSet<String> = ds
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .containers
        .iter()
        .flat_map(|c| c.ports.clone().unwrap_or_default())
        .filter_map(|p| p.name)
        .collect();
    for ep in pm["spec"]["podMetricsEndpoints"].as_array().unwrap() {
        let port = ep["port"].as_str().unwrap();
        assert!(
            ports.contains(port),
            "PodMonitor port {port} not in {ports:?}"
        );
    }
    k.assert_read_only();
}

/// The marker that says a YAML block in the docs is deliberately not a complete Kubernetes
/// object (docs/contributing.md): an HTML comment on the line before the fence.
const FRAGMENT_MARKER: &str = "<!-- fragment:";

/// ```yaml blocks of a markdown file: (line of the fence, marked as fragment, body).
fn yaml_blocks(text: &str) -> Vec<(usize, bool, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let fence = lines[i].trim_start();
        if fence.starts_with("```yaml") || fence.starts_with("```yml") {
            let marked = i > 0 && lines[i - 1].trim_start().starts_with(FRAGMENT_MARKER);
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                body.push(lines[i]);
                i += 1;
            }
            out.push((start + 1, marked, body.join("\n")));
        }
        i += 1;
    }
    out
}

/// Every YAML block in docs/ and README.md is either Kubernetes objects the real API server
/// accepts (server-side dry run, plus the strict schema), or marked as a fragment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_objects_in_the_docs_are_accepted_by_the_server_or_marked_as_fragments() {
    let k = Kubectl::start().await;
    // The recipes' JobSet, Kueue, PyTorchJob and Trainer objects, against their real CRDs.
    k.install_crds().await;
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.push(repo_root().join("README.md"));
    files.sort();
    let dir = tempfile::tempdir().unwrap();
    let (mut applied, mut fragments) = (0, 0);
    let mut failures = Vec::new();
    for file in &files {
        let shown = file
            .strip_prefix(repo_root())
            .unwrap()
            .display()
            .to_string();
        for (line, marked, body) in yaml_blocks(&std::fs::read_to_string(file).unwrap()) {
            if marked {
                fragments += 1;
                continue;
            }
            let docs = match spotguard_testkit::k8s::fixtures::yaml_documents(&body) {
                Ok(d) => d,
                Err(e) => {
                    failures.push(format!("{shown}:{line}: not YAML: {e}"));
                    continue;
                }
            };
            let incomplete = docs.iter().filter(|d| !d.is_null()).any(|d| {
                d["apiVersion"].as_str().is_none()
                    || d["kind"].as_str().is_none()
                    || d["metadata"]["name"].as_str().is_none()
            });
            if incomplete {
                failures.push(format!(
                    "{shown}:{line}: not a complete Kubernetes object (apiVersion, kind, metadata.name): mark it `{FRAGMENT_MARKER} why -->` on the line before the fence, or complete it"
                ));
                continue;
            }
            let path = dir.path().join(format!("block-{applied}.yaml"));
            std::fs::write(&path, &body).unwrap();
            match k.dry_run(path.to_str().unwrap(), None).await {
                Err(e) => failures.push(format!("{shown}:{line}: the API server refuses it: {e}")),
                Ok(objects) => {
                    for obj in &objects {
                        if let Err(e) = check_object(obj) {
                            failures.push(format!("{shown}:{line}: {}: {e}", object_name(obj)));
                        }
                    }
                }
            }
            applied += 1;
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(applied >= 1, "no Kubernetes object in the docs was checked");
    assert!(fragments >= 1);
    k.assert_read_only();
}

/// The fragment marker is found where it is and nowhere else.
#[test]
fn yaml_blocks_are_found_with_their_fragment_marker() {
    let md = "text\n\n```yaml\na: 1\n```\n<!-- fragment: a patch -->\n```yaml\nb: 2\n```\n```sh\nx\n```\n";
    assert_eq!(
        yaml_blocks(md),
        vec![
            (3, false, "a: 1".to_string()),
            (7, true, "b: 2".to_string())
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// The DaemonSet, running.

/// The shipped install, applied for real through kustomize (with an operator's overlay that
/// points the agent at this test's metadata emulator), runs: the DaemonSet controller creates
/// the agent's pod for the GPU node, the scheduler binds it, the kubelet stand-in starts both
/// containers as the pod says (args, env, hostPath mounts mapped to the node's directories, a
/// read-only root, only KILL and SYS_PTRACE, the ServiceAccount token), readiness comes from
/// its `/readyz` probe, and on a spot notice that agent — with the shipped RBAC and the shipped
/// privileges — checkpoints a non-root trainer through its emptyDir, cordons, taints and drains
/// the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemonset_runs_and_its_agent_handles_a_notice_on_its_node() {
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use spotguard_testkit::k8s::daemonset;

    daemonset::assert_host_ports_free();
    let k = Kubectl::start().await;
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    // The node's machine says it is an EC2 instance.
    let (node, _dmi) = daemonset::ec2_gpu_node(
        &k.k,
        "gpu-node",
        "spotguard:0.1.0",
        env!("CARGO_BIN_EXE_spotguard"),
    )
    .await;

    // A non-root trainer on the node, opted in, its checkpoint dir an emptyDir; it runs before
    // the agent starts, so that the agent's first list of the node's pods holds it.
    let ml = k.k.namespace("ml").await;
    daemonset::start_trainer(&k.k, &node, &ml).await;

    // An operator's overlay: the base, with the metadata endpoint pointed at the emulator.
    let overlay = tools::overlay(
        &["daemonset"],
        &[],
        &format!(
            "patches:\n  - patch: |-\n      apiVersion: apps/v1\n      kind: DaemonSet\n      metadata: {{name: spotguard, namespace: spotguard}}\n      spec:\n        template:\n          spec:\n            containers:\n              - name: spotguard\n                env:\n                  - name: SPOTGUARD_METADATA_ENDPOINT\n                    value: {}\n",
            emu.base_url()
        ),
    );
    let rendered = k.kustomize(overlay.path()).await;
    let ran = k
        .run(&["apply", "--server-side", "-f", "-"], Some(&rendered))
        .await;
    assert!(ran.ok, "kubectl apply: {}", ran.stderr);

    // The DaemonSet controller's pod, scheduled onto the GPU node and Ready by its probe.
    let pods: Api<Pod> = Api::namespaced(k.k.admin(), "spotguard");
    let dss: Api<DaemonSet> = Api::namespaced(k.k.admin(), "spotguard");
    let agent_pod = daemonset::wait_agent_pod(&k.k, &node, "spotguard", "spotguard", |s| {
        s.number_ready == 1
    })
    .await;
    let agent_name = agent_pod.metadata.name.clone().unwrap();
    let run = node
        .run_of("spotguard", &agent_name, "spotguard")
        .expect("agent started");
    // Run with the privileges the DaemonSet ships.
    daemonset::assert_shipped_capabilities(run.pid);

    // The agent's pod cache holds the trainer; then the spot notice.
    daemonset::wait_pod_cache_synced(&node, "spotguard", &agent_name, 1).await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    daemonset::wait_notice_handled(&k.k, &node, &ml, ("spotguard", &agent_name), |e| {
        e.reason == "CheckpointAcked"
    })
    .await;
    // The agent's own pod stays (DaemonSet pods are not drained).
    let still = pods.get(&agent_name).await.expect("agent pod");
    assert!(still.metadata.deletion_timestamp.is_none());
    let acked =
        k.k.events()
            .await
            .into_iter()
            .find(|e| e.reason == "CheckpointAcked")
            .unwrap();
    assert!(acked.message.contains("4242"), "{}", acked.message);
    // Leave the shared control plane without a DaemonSet.
    let _ = dss
        .delete("spotguard", &kube::api::DeleteParams::default())
        .await;
    drop(node);
    emu.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// systemd.

fn systemd_analyze() -> PathBuf {
    find_on_path("systemd-analyze")
        .unwrap_or_else(|| panic!("systemd-analyze not found (Debian package systemd): run {DEPS}"))
}

/// The unit, with ExecStart pointed at the binary cargo built (verify checks it exists).
fn unit_for_verify(dir: &Path) -> PathBuf {
    let unit = std::fs::read_to_string(repo_root().join("systemd/spotguard.service")).unwrap();
    let exec = "ExecStart=/usr/local/bin/spotguard run --mode host\n";
    assert!(unit.contains(exec), "ExecStart changed: update this test");
    let unit = unit.replace(
        exec,
        &format!(
            "ExecStart={} run --mode host\n",
            env!("CARGO_BIN_EXE_spotguard")
        ),
    );
    let path = dir.join("spotguard.service");
    std::fs::write(&path, unit).unwrap();
    path
}

#[test]
fn systemd_unit_verifies_cleanly() {
    let bin = systemd_analyze();
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_for_verify(dir.path());
    let out = std::process::Command::new(&bin)
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {stderr}");
    // Unknown or misplaced keys are only warnings: they must not be there either.
    assert!(
        stderr.trim().is_empty(),
        "systemd-analyze verify warned: {stderr}"
    );
}

#[test]
fn systemd_unit_exposure_is_low() {
    let bin = systemd_analyze();
    let dir = tempfile::tempdir().unwrap();
    let unit = unit_for_verify(dir.path());
    // Exposure on systemd's 0–100 scale ("4.0 OK" is 40); the unit scores about 3.0.
    let out = std::process::Command::new(&bin)
        .args(["security", "--offline=true", "--threshold=40", "--no-pager"])
        .arg(&unit)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(out.status.success(), "exposure above 4.0: {summary}");
}

#[test]
fn systemd_unit_keeps_what_discovery_and_signalling_need() {
    let unit = std::fs::read_to_string(repo_root().join("systemd/spotguard.service")).unwrap();
    let directives: Vec<(&str, &str)> = unit
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .collect();
    let get = |key: &str| -> Vec<&str> {
        directives
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .collect()
    };
    // Signalling and /proc/<pid>/root need these, and nothing broader.
    assert_eq!(
        get("CapabilityBoundingSet"),
        vec!["CAP_KILL CAP_SYS_PTRACE CAP_DAC_READ_SEARCH"]
    );
    // These would hide other processes from discovery or drop the capabilities.
    for forbidden in [
        "ProtectProc",
        "ProcSubset",
        "PrivateUsers",
        "PrivatePIDs",
        "SecureBits",
        "DynamicUser",
    ] {
        assert!(
            get(forbidden).is_empty(),
            "{forbidden} breaks discovery or signalling"
        );
    }
    // ProtectClock implies a device allow list that would lock NVML out.
    assert!(get("ProtectClock").is_empty() && get("PrivateDevices").is_empty());
    assert_eq!(get("Type"), vec!["exec"]);
    assert_eq!(
        get("EnvironmentFile"),
        vec!["-/etc/spotguard/spotguard.env"]
    );
    for (key, value) in [
        ("StateDirectory", "spotguard"),
        ("RuntimeDirectory", "spotguard"),
        ("RuntimeDirectoryPreserve", "yes"),
        ("CacheDirectory", "spotguard"),
        ("ProtectSystem", "strict"),
        ("NoNewPrivileges", "yes"),
        ("MemoryMax", "192M"),
        ("TasksMax", "96"),
        ("Restart", "always"),
    ] {
        assert_eq!(get(key), vec![value], "{key}");
    }
}

#[test]
fn env_file_documents_every_variable_the_daemonset_sets() {
    let env_file = std::fs::read_to_string(repo_root().join("systemd/spotguard.env")).unwrap();
    let documented: BTreeSet<String> = env_file
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, _)| k.to_string())
        .filter(|k| {
            k.starts_with("SPOTGUARD_")
                && k.bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        })
        .collect();
    // Everything is commented out: the file documents defaults, it sets nothing.
    for line in env_file.lines() {
        assert!(
            line.is_empty() || line.starts_with('#'),
            "active line: {line}"
        );
    }
    let ds = std::fs::read_to_string(repo_root().join("daemonset/daemonset.yaml")).unwrap();
    let used: BTreeSet<String> = ds
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- name: "))
        .filter(|n| n.starts_with("SPOTGUARD_"))
        .map(str::to_string)
        .collect();
    assert!(!used.is_empty());
    let missing: Vec<_> = used.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "undocumented in systemd/spotguard.env: {missing:?}"
    );
    // Design §1 flags of `run`, each with its variable.
    for flag in [
        "cloud",
        "metadata-endpoint",
        "poll-interval",
        "node-name",
        "on-rebalance",
        "rebalance-expiry",
        "on-maintenance",
        "maintenance-lead",
        "checkpoint-signal",
        "checkpoint-timeout",
        "drain-reserve",
        "force-delete-at-deadline",
        "dry-run",
        "metrics-addr",
        "gpu",
        "log-format",
        "checkpoint-unit",
        "checkpoint-pidfile",
        "checkpoint-cmdline",
        "checkpoint-dir",
        "state-dir",
        "imds-v1-fallback",
        "gce-preemption-notice",
        "webhook-url",
        "webhook-template",
        "prefetch",
        "cache-dir",
        "cache-max-bytes",
    ] {
        let var = format!("SPOTGUARD_{}", flag.to_ascii_uppercase().replace('-', "_"));
        assert!(documented.contains(&var), "{var} not documented");
    }
}
