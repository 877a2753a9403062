//! The Helm chart (`charts/spotguard`) and the kustomize base (`daemonset/`), with the real tools
//! against testkit's real control plane.
//!
//! - Both Helm majors (v3.17.2 and v4.1.4; `scripts/deps/helm.sh` installs them, a helm on PATH
//!   wins for its major): `helm lint --strict`, a misspelt value refused by the schema, the
//!   rendering with the defaults and with a values file that sets everything applied server-side
//!   (dry run) to the real API server, and `helm install` / `upgrade` / `uninstall` for real,
//!   after which nothing the release created is left, of any kind.
//! - The chart's default rendering is the kustomize base (same objects, same specs), and its
//!   `forceDelete` / `prefetch` values are the base's components, so the two never drift.
//! - The chart's DaemonSet runs: its pod is scheduled onto a GPU node and started by the kubelet
//!   stand-in with the chart's args, env and privileges, and handles a spot notice.
//! - The kustomize base: server-side apply after client-side apply conflicts with nothing, a
//!   Karpenter GPU node gets an agent pod, and the documented removal leaves nothing.
//!
//! The control plane's version is `SPOTGUARD_K8S_VERSION` (default 1.34); `scripts/test.sh`
//! runs this file against 1.32 as well.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use serde_json::Value;
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::k8s::assets;
use spotguard_testkit::k8s::fixtures::yaml_documents;
use spotguard_testkit::k8s::tools::{find_on_path, overlay, run_tool, Kubectl, Ran, Server};
use spotguard_testkit::wait::{eventually, until_described};

const HELM_DEPS: &str = "scripts/deps/helm.sh";
/// The goodput ledger's CRD, in the chart's crds/.
const LEDGER_CRD: &str = "interruptions.spotguard.io";
/// How long one run of kubectl or helm may take.
const TOOL_LIMIT: Duration = Duration::from_secs(180);

/// The kustomize base's removal, as docs/deploy-kubernetes.md gives it.
const KUSTOMIZE_REMOVAL: &str =
    "kubectl delete validatingadmissionpolicybinding,validatingadmissionpolicy,clusterrolebinding,clusterrole,namespace -l app.kubernetes.io/name=spotguard";

/// Held by the tests that create cluster-scoped objects labelled app.kubernetes.io/name=spotguard
/// for real: the kustomize removal deletes every such object, and each test's leftover check
/// lists them cluster-wide.
static CLUSTER_WIDE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn chart() -> String {
    repo_root().join("charts/spotguard").display().to_string()
}

fn full_values() -> String {
    repo_root()
        .join("tests/chart/full-values.yaml")
        .display()
        .to_string()
}

/// `bin ARGS` (helm) from operator home `home`, within [`TOOL_LIMIT`].
async fn run(bin: &Path, args: &[&str], stdin: Option<&str>, home: &Path) -> Ran {
    run_tool(bin, args, stdin, home, TOOL_LIMIT).await
}

/// One Helm binary of a major version.
#[derive(Clone)]
struct Helm {
    major: u32,
    bin: PathBuf,
}

fn helm_major(bin: &Path) -> Option<u32> {
    let out = std::process::Command::new(bin)
        .args(["version", "--template", "{{.Version}}"])
        .output()
        .ok()?;
    let v = String::from_utf8_lossy(&out.stdout);
    v.trim().strip_prefix('v')?.split('.').next()?.parse().ok()
}

/// Helm v3 and v4: the one on PATH for its major, else `scripts/deps/helm.sh`'s cache.
fn helms() -> Vec<Helm> {
    let cache = std::env::var_os("SPOTGUARD_HELM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache")
                })
                .join("spotguard/helm")
        });
    let on_path = find_on_path("helm").and_then(|b| helm_major(&b).map(|m| (m, b)));
    [(3, "3.17.2"), (4, "4.1.4")]
        .into_iter()
        .map(|(major, version)| {
            let bin = match &on_path {
                Some((m, b)) if *m == major => b.clone(),
                _ => cache.join(format!("v{version}")).join("helm"),
            };
            assert_eq!(
                helm_major(&bin),
                Some(major),
                "no Helm v{major} at {} (run {HELM_DEPS})",
                bin.display()
            );
            Helm { major, bin }
        })
        .collect()
}

/// kubectl and helm as an operator (admin) of the shared control plane.
struct Tools(Kubectl);

impl std::ops::Deref for Tools {
    type Target = Kubectl;
    fn deref(&self) -> &Kubectl {
        &self.0
    }
}

impl Tools {
    async fn start() -> Tools {
        Tools(Kubectl::start(Server::Direct, TOOL_LIMIT).await)
    }

    async fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Ran {
        self.run(args, stdin).await
    }

    async fn helm(&self, helm: &Helm, args: &[&str]) -> Ran {
        run(&helm.bin, args, None, self.home.path()).await
    }

    /// `kubectl apply --server-side --dry-run=server`: the objects as the API server would
    /// store them, or the error.
    async fn dry_run(&self, manifest: &str) -> Result<(), String> {
        let ran = self
            .kubectl(
                &[
                    "apply",
                    "--server-side",
                    "--dry-run=server",
                    "--field-manager=spotguard-chart-test",
                    "-f",
                    "-",
                ],
                Some(manifest),
            )
            .await;
        if ran.ok {
            Ok(())
        } else {
            Err(ran.stderr)
        }
    }

    /// The prometheus-operator CRDs, installed for real (idempotent) and Established.
    async fn install_crds(&self) {
        let dir = assets::shared_dir().join("crds");
        for f in [
            "monitoring.coreos.com_podmonitors.yaml",
            "monitoring.coreos.com_servicemonitors.yaml",
            "monitoring.coreos.com_prometheusrules.yaml",
        ] {
            self.install_crds_from(&dir.join(f), "spotguard-chart-test")
                .await;
        }
    }

    /// Every object of every listable type, cluster-wide, that `selector` matches — except
    /// what is already being deleted and objects with an owner (the namespace controller's and
    /// the garbage collector's work, which this control plane does not run).
    async fn leftovers(&self, selector: &str) -> Vec<String> {
        let ran = self
            .kubectl(&["api-resources", "--verbs=list", "-o", "name"], None)
            .await;
        assert!(ran.ok, "kubectl api-resources: {}", ran.stderr);
        let kinds: Vec<&str> = ran.stdout.lines().filter(|l| !l.is_empty()).collect();
        assert!(kinds.len() > 40, "too few resource types: {kinds:?}");
        let joined = kinds.join(",");
        let ran = self
            .kubectl(&["get", &joined, "-A", "-l", selector, "-o", "json"], None)
            .await;
        assert!(ran.ok, "kubectl get {joined}: {}", ran.stderr);
        let list: Value = serde_json::from_str(&ran.stdout).unwrap();
        let mut out = Vec::new();
        for o in list["items"].as_array().cloned().unwrap_or_default() {
            if !o["metadata"]["deletionTimestamp"].is_null() {
                continue;
            }
            // Dependents (the DaemonSet's pods and ControllerRevisions) go with their owner
            // through the garbage collector.
            if !o["metadata"]["ownerReferences"].is_null() {
                continue;
            }
            out.push(format!(
                "{}/{}{}",
                o["kind"].as_str().unwrap_or_default(),
                o["metadata"]["namespace"]
                    .as_str()
                    .map(|n| format!("{n}/"))
                    .unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            ));
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Rendering, offline.

/// Objects of a rendering by (kind, namespace, name); Helm's own labels removed from each
/// object's metadata (the base has only app.kubernetes.io/name and /component).
fn objects(yaml: &str) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for mut o in yaml_documents(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}")) {
        if o.is_null() {
            continue;
        }
        if let Some(labels) = o["metadata"]["labels"].as_object_mut() {
            for k in [
                "app.kubernetes.io/instance",
                "app.kubernetes.io/managed-by",
                "app.kubernetes.io/version",
                "helm.sh/chart",
            ] {
                labels.remove(k);
            }
        }
        let key = format!(
            "{}/{}/{}",
            o["kind"].as_str().unwrap_or_default(),
            o["metadata"]["namespace"].as_str().unwrap_or("-"),
            o["metadata"]["name"].as_str().unwrap_or_default()
        );
        out.insert(key, o);
    }
    out
}

/// Every entry an object with a distinct string `name`.
fn named(list: &[Value]) -> bool {
    let names: BTreeSet<_> = list.iter().filter_map(|e| e["name"].as_str()).collect();
    !list.is_empty() && names.len() == list.len()
}

/// Paths where `a` and `b` differ.
fn differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for k in x.keys().chain(y.keys()).collect::<BTreeSet<_>>() {
                differences(
                    &format!("{path}.{k}"),
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    out,
                );
            }
        }
        // Lists of named entries (containers, env, ports, volumes, mounts) by name: their order
        // carries no meaning, and kustomize's strategic merge moves a patched entry first.
        (Value::Array(x), Value::Array(y)) if named(x) && named(y) => {
            let by_name = |v: &Vec<Value>| -> BTreeMap<String, Value> {
                v.iter()
                    .map(|e| (e["name"].as_str().unwrap().to_string(), e.clone()))
                    .collect()
            };
            let (x, y) = (
                Value::Object(by_name(x).into_iter().collect()),
                Value::Object(by_name(y).into_iter().collect()),
            );
            differences(path, &x, &y, out);
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                differences(&format!("{path}[{i}]"), p, q, out);
            }
        }
        _ if a == b => {}
        _ => out.push(format!("{path}: kustomize {a} / chart {b}")),
    }
}

/// The chart's rendering (release `spotguard` in namespace `spotguard`, as the base names its
/// objects) against the base rendered with `components`. The base's Namespace is not the
/// chart's (Helm installs into an existing namespace or `--create-namespace`): it is compared
/// as the documented namespace preparation instead.
fn equivalence(kustomized: &str, helm: &str) -> Vec<String> {
    let mut base = objects(kustomized);
    let chart = objects(helm);
    let mut problems = Vec::new();
    match base.remove("Namespace/-/spotguard") {
        Some(ns) => {
            let docs =
                std::fs::read_to_string(repo_root().join("docs/deploy-kubernetes.md")).unwrap();
            for (k, v) in ns["metadata"]["labels"].as_object().unwrap() {
                if k.starts_with("pod-security")
                    && !docs.contains(&format!("{k}={}", v.as_str().unwrap()))
                {
                    problems.push(format!(
                        "the base's namespace label {k}={v} is not in docs/deploy-kubernetes.md's chart install"
                    ));
                }
            }
        }
        None => problems.push("the base has no Namespace spotguard".into()),
    }
    for k in base.keys().chain(chart.keys()).collect::<BTreeSet<_>>() {
        match (base.get(k), chart.get(k)) {
            (Some(a), Some(b)) => differences(k, a, b, &mut problems),
            (Some(_), None) => {
                problems.push(format!("{k}: in the kustomize base, not in the chart"))
            }
            (None, Some(_)) => {
                problems.push(format!("{k}: in the chart, not in the kustomize base"))
            }
            (None, None) => {}
        }
    }
    problems
}

async fn template(t: &Tools, helm: &Helm, ns: &str, extra: &[&str]) -> Result<String, String> {
    let chart = chart();
    // With the chart's crds/ (the ledger's CRD), which the kustomize base holds too.
    let mut args = vec![
        "template",
        "spotguard",
        chart.as_str(),
        "--namespace",
        ns,
        "--include-crds",
    ];
    args.extend(extra);
    let ran = t.helm(helm, &args).await;
    if ran.ok {
        Ok(ran.stdout)
    } else {
        Err(ran.stderr)
    }
}

/// The chart's default rendering is the kustomize base, its forceDelete value is the
/// force-delete component, `relay.enabled=true` is the relay component and `prefetch.enabled=false` is the no-prefetch component — with
/// both Helm majors. An object added to daemonset/ (or a field changed) without the chart
/// following fails here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_default_rendering_is_the_kustomize_base() {
    let t = Tools::start().await;
    let cases: [(&[&str], &[&str]); 4] = [
        (&[], &[]),
        (
            &["--set", "relay.enabled=true"],
            &["daemonset/components/relay"],
        ),
        (
            &["--set", "forceDelete.enabled=true"],
            &["daemonset/components/force-delete"],
        ),
        (
            &["--set", "prefetch.enabled=false"],
            &["daemonset/components/no-prefetch"],
        ),
    ];
    for helm in helms() {
        for (values, components) in cases {
            let base = t
                .kustomize(overlay(&["daemonset"], components, "").path())
                .await;
            let rendered = template(&t, &helm, "spotguard", values).await.unwrap();
            let problems = equivalence(&base, &rendered);
            assert!(
                problems.is_empty(),
                "helm v{} {values:?} vs kustomize {components:?}:\n{}",
                helm.major,
                problems.join("\n")
            );
        }
    }
    // The chart's copies of the alerts and the dashboard are the kustomize ones.
    for (copy, original) in [
        (
            "charts/spotguard/files/prometheusrule.yaml",
            "daemonset/components/alerts/prometheusrule.yaml",
        ),
        (
            "charts/spotguard/files/grafana-dashboard.json",
            "daemonset/monitoring/grafana-dashboard.json",
        ),
        (
            "charts/spotguard/crds/interruptions.spotguard.io.yaml",
            "daemonset/crds/interruptions.spotguard.io.yaml",
        ),
    ] {
        assert_eq!(
            std::fs::read(repo_root().join(copy)).unwrap(),
            std::fs::read(repo_root().join(original)).unwrap(),
            "{copy} differs from {original}: copy it again"
        );
    }
}

/// The equivalence check sees drift: an object only in the base, and a changed field.
#[test]
fn the_equivalence_check_catches_drift() {
    let sa = std::fs::read_to_string(repo_root().join("daemonset/serviceaccount.yaml")).unwrap();
    let ns = std::fs::read_to_string(repo_root().join("daemonset/namespace.yaml")).unwrap();
    let base = format!("{ns}\n---\n{sa}");
    let same = equivalence(&base, &sa);
    assert!(same.is_empty(), "{same:?}");
    // An object added to the base only (as a ValidatingAdmissionPolicy would be).
    let policy = "---\napiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\nmetadata:\n  name: spotguard\n";
    let problems = equivalence(&format!("{base}{policy}"), &sa);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("ValidatingAdmissionPolicy") && p.contains("not in the chart")),
        "{problems:?}"
    );
    // A field changed on one side.
    let changed = sa.replace(
        "app.kubernetes.io/name: spotguard",
        "app.kubernetes.io/name: other",
    );
    assert_ne!(changed, sa);
    let problems = equivalence(&base, &changed);
    assert!(
        problems.iter().any(|p| p.contains("metadata.labels")),
        "{problems:?}"
    );
    // An env entry changed inside a list of named entries.
    let ds = std::fs::read_to_string(repo_root().join("daemonset/daemonset.yaml")).unwrap();
    let ds_changed = ds.replace("value: 90s", "value: 60s");
    assert_ne!(ds_changed, ds);
    let problems = equivalence(
        &format!("{base}\n---\n{ds}"),
        &format!("{sa}\n---\n{ds_changed}"),
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("SPOTGUARD_CHECKPOINT_TIMEOUT")),
        "{problems:?}"
    );
}

/// `helm lint --strict` with the defaults and with every value set; a misspelt or mistyped
/// value is refused by the schema, before anything reaches a cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_lint_strict_and_the_schema_refuses_typos() {
    let home = tempfile::tempdir().unwrap();
    let chart = chart();
    let full = full_values();
    for helm in helms() {
        for args in [
            vec!["lint", "--strict", chart.as_str()],
            vec!["lint", "--strict", chart.as_str(), "-f", full.as_str()],
        ] {
            let ran = run(&helm.bin, &args, None, home.path()).await;
            assert!(
                ran.ok,
                "helm v{} {args:?}:\n{}{}",
                helm.major, ran.stdout, ran.stderr
            );
        }
        for (set, says) in [
            ("imagee.tag=1", "imagee"),
            ("prefetch.enable=false", "enable"),
            ("agent.gpu=on", "gpu"),
            ("agent.metricsPort=70000", "metricsPort"),
            ("uploads.allow={file:///etc}", "allow"),
        ] {
            let ran = run(
                &helm.bin,
                &["template", "x", chart.as_str(), "--set", set],
                None,
                home.path(),
            )
            .await;
            assert!(!ran.ok, "helm v{} accepted --set {set}", helm.major);
            assert!(
                ran.stderr.contains(says),
                "helm v{} --set {set}: {}",
                helm.major,
                ran.stderr
            );
        }
    }
}

/// The release workflow's chart step, run here: `helm package` with a release's version (as
/// `.github/workflows/release.yml` calls it) gives an archive that holds every file the chart
/// renders from, passes `lint --strict`, and renders exactly what the directory renders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_package_gives_the_archive_the_release_pushes() {
    let home = tempfile::tempdir().unwrap();
    let chart = chart();
    for helm in helms() {
        let out = home.path().join(format!("dist-v{}", helm.major));
        let dest = out.display().to_string();
        let ran = run(
            &helm.bin,
            &[
                "package",
                chart.as_str(),
                "--version",
                "9.8.7",
                "--app-version",
                "9.8.7",
                "--destination",
                dest.as_str(),
            ],
            None,
            home.path(),
        )
        .await;
        assert!(
            ran.ok,
            "helm v{} package: {}{}",
            helm.major, ran.stdout, ran.stderr
        );
        let archive = out.join("spotguard-9.8.7.tgz");
        assert!(
            archive.is_file(),
            "helm v{} package wrote no {}",
            helm.major,
            archive.display()
        );
        let listing = std::process::Command::new("tar")
            .arg("-tzf")
            .arg(&archive)
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        for file in std::fs::read_dir(repo_root().join("charts/spotguard/templates"))
            .unwrap()
            .map(|e| format!("templates/{}", e.unwrap().file_name().to_string_lossy()))
            .chain(
                [
                    "Chart.yaml",
                    "values.yaml",
                    "values.schema.json",
                    "files/grafana-dashboard.json",
                    "files/prometheusrule.yaml",
                    "crds/interruptions.spotguard.io.yaml",
                ]
                .map(String::from),
            )
        {
            assert!(
                listing.lines().any(|l| l == format!("spotguard/{file}")),
                "helm v{}: the packaged chart lacks {file}:\n{listing}",
                helm.major
            );
        }
        let archive = archive.display().to_string();
        let lint = run(
            &helm.bin,
            &["lint", "--strict", archive.as_str()],
            None,
            home.path(),
        )
        .await;
        assert!(
            lint.ok,
            "helm v{} lint of the archive: {}{}",
            helm.major, lint.stdout, lint.stderr
        );
        let render = |source: String| {
            let helm = &helm;
            let home = home.path().to_path_buf();
            async move {
                let ran = run(
                    &helm.bin,
                    &[
                        "template",
                        "spotguard",
                        source.as_str(),
                        "-n",
                        "spotguard",
                        "--set",
                        "image.tag=9.8.7",
                    ],
                    None,
                    &home,
                )
                .await;
                assert!(
                    ran.ok,
                    "helm v{} template {source}: {}",
                    helm.major, ran.stderr
                );
                // The only difference a release makes: the chart's version in its labels.
                ran.stdout
                    .replace("spotguard-9.8.7", "spotguard-VERSION")
                    .replace("spotguard-0.1.0", "spotguard-VERSION")
                    .replace("\"0.1.0\"", "\"9.8.7\"")
            }
        };
        let (packaged, directory) = (render(archive.clone()).await, render(chart.clone()).await);
        let first_difference = packaged
            .lines()
            .zip(directory.lines())
            .enumerate()
            .find(|(_, (a, b))| a != b);
        assert!(
            packaged == directory,
            "helm v{}: the packaged chart renders differently from charts/spotguard \
             (first differing line, packaged vs directory: {first_difference:?}; {} vs {} lines)",
            helm.major,
            packaged.lines().count(),
            directory.lines().count()
        );
    }
}

/// The renderings with the defaults and with every value set are accepted by the real API
/// server (server-side apply, dry run, strict field validation; the Prometheus Operator CRDs
/// installed); a value that renders an invalid object is refused by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_renderings_are_accepted_by_the_api_server() {
    let t = Tools::start().await;
    t.install_crds().await;
    let ns = t.k.namespace("render").await;
    let full = full_values();
    // Cluster-scoped names of their own (testkit applied the shipped ClusterRole `spotguard`).
    let name = format!("fullnameOverride=render-{}", t.k.id());
    for helm in helms() {
        for values in [
            vec!["--set", name.as_str()],
            vec!["-f", full.as_str(), "--set", name.as_str()],
        ] {
            let rendered = template(&t, &helm, &ns, &values).await.unwrap();
            if let Err(e) = t.dry_run(&rendered).await {
                panic!("helm v{} {values:?}: the server refused:\n{e}", helm.major);
            }
        }
        // Valid for the schema (a label map of strings), invalid for Kubernetes.
        let bad = template(&t, &helm, &ns, &["--set", "podLabels.a/b/c=x"])
            .await
            .unwrap();
        let err = t
            .dry_run(&bad)
            .await
            .expect_err("an invalid label key was accepted");
        assert!(err.contains("a/b/c"), "{err}");
    }
}

/// `helm install`, `helm upgrade` with changed values and `helm uninstall`, for real, with
/// both majors: everything is created, the upgrade adds and removes objects (the force-delete
/// RBAC goes when turned off), and after uninstall nothing the release created is left, of any
/// kind (every listable type, cluster-wide). The leftover check itself finds a ClusterRole that
/// outlives its release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_upgrade_uninstall_leave_nothing_behind() {
    let _cluster_wide = CLUSTER_WIDE.lock().await;
    let t = Tools::start().await;
    t.install_crds().await;
    let chart = chart();
    let full = full_values();
    for helm in helms() {
        let ns = t.k.namespace(&format!("helm{}", helm.major)).await;
        let release = format!("spotguard-v{}-{}", helm.major, t.k.id());
        let selector = format!("app.kubernetes.io/instance={release}");
        // The ledger's CRD comes from the chart's crds/ (the control plane's copy goes first).
        let ran = t
            .kubectl(
                &["delete", "crd", LEDGER_CRD, "--ignore-not-found", "--wait"],
                None,
            )
            .await;
        assert!(ran.ok, "{}", ran.stderr);
        // Every value set, on no node of this shared cluster.
        let ran = t
            .helm(
                &helm,
                &[
                    "install",
                    &release,
                    &chart,
                    "--namespace",
                    &ns,
                    "-f",
                    &full,
                    "--set",
                    "fullnameOverride=",
                    "--set",
                    "serviceAccount.name=",
                ],
            )
            .await;
        assert!(ran.ok, "helm v{} install: {}", helm.major, ran.stderr);
        assert!(ran.stdout.contains("DESIRED"), "NOTES.txt: {}", ran.stdout);
        let ran = t
            .kubectl(
                &[
                    "wait",
                    "--for=condition=Established",
                    "--timeout=60s",
                    &format!("crd/{LEDGER_CRD}"),
                ],
                None,
            )
            .await;
        assert!(
            ran.ok,
            "helm v{}: the ledger's CRD: {}",
            helm.major, ran.stderr
        );
        let ran = t.kubectl(&["get", "interruptions", "-n", &ns], None).await;
        assert!(ran.ok, "kubectl get interruptions: {}", ran.stderr);
        let installed = t.leftovers(&selector).await;
        for want in [
            format!("DaemonSet/{ns}/{release}"),
            format!("ClusterRole/{release}"),
            format!("ClusterRole/{release}-force-delete"),
            format!("ClusterRoleBinding/{release}-force-delete"),
            format!("ServiceAccount/{ns}/{release}"),
            format!("PodMonitor/{ns}/{release}"),
            format!("ServiceMonitor/{ns}/{release}"),
            format!("PrometheusRule/{ns}/{release}"),
            format!("ConfigMap/{ns}/{release}-dashboard"),
            format!("ResourceQuota/{ns}/{release}-critical-pods"),
            format!("Service/{ns}/{release}-metrics"),
        ] {
            assert!(
                installed.contains(&want),
                "helm v{}: no {want} in {installed:?}",
                helm.major
            );
        }

        let ran = t
            .helm(
                &helm,
                &[
                    "upgrade",
                    &release,
                    &chart,
                    "--namespace",
                    &ns,
                    "-f",
                    &full,
                    "--set",
                    "fullnameOverride=",
                    "--set",
                    "serviceAccount.name=",
                    "--set",
                    "forceDelete.enabled=false",
                    "--set",
                    "agent.logLevel=warn",
                    "--set",
                    "metrics.grafanaDashboard.enabled=false",
                ],
            )
            .await;
        assert!(ran.ok, "helm v{} upgrade: {}", helm.major, ran.stderr);
        let upgraded = t.leftovers(&selector).await;
        for gone in [
            format!("ClusterRole/{release}-force-delete"),
            format!("ClusterRoleBinding/{release}-force-delete"),
            format!("ConfigMap/{ns}/{release}-dashboard"),
        ] {
            assert!(
                !upgraded.contains(&gone),
                "helm v{}: {gone} kept by the upgrade",
                helm.major
            );
        }
        let dss: Api<DaemonSet> = Api::namespaced(t.k.admin(), &ns);
        let ds = dss.get(&release).await.unwrap();
        let env = &ds.spec.unwrap().template.spec.unwrap().containers[0]
            .env
            .clone()
            .unwrap();
        let value = |n: &str| {
            env.iter()
                .find(|e| e.name == n)
                .and_then(|e| e.value.clone())
        };
        assert_eq!(value("SPOTGUARD_LOG_LEVEL").as_deref(), Some("warn"));
        assert_eq!(
            value("SPOTGUARD_FORCE_DELETE_AT_DEADLINE").as_deref(),
            Some("false")
        );

        // The check finds what outlives a release: a ClusterRole of it that uninstall misses.
        let stray = format!("{release}-stray");
        let ran = t
            .kubectl(
                &[
                    "create",
                    "clusterrole",
                    &stray,
                    "--verb=get",
                    "--resource=nodes",
                ],
                None,
            )
            .await;
        assert!(ran.ok, "{}", ran.stderr);
        let ran = t
            .kubectl(
                &[
                    "label",
                    "clusterrole",
                    &stray,
                    &format!("app.kubernetes.io/instance={release}"),
                ],
                None,
            )
            .await;
        assert!(ran.ok, "{}", ran.stderr);

        let ran = t
            .helm(
                &helm,
                &["uninstall", &release, "--namespace", &ns, "--wait"],
            )
            .await;
        assert!(ran.ok, "helm v{} uninstall: {}", helm.major, ran.stderr);
        // Helm never deletes what crds/ installed: the ledger outlives the release.
        let ran = t
            .kubectl(&["get", "crd", LEDGER_CRD, "-o", "name"], None)
            .await;
        assert!(
            ran.ok,
            "helm v{}: the ledger's CRD went with the release: {}",
            helm.major, ran.stderr
        );
        assert_eq!(
            t.leftovers(&selector).await,
            vec![format!("ClusterRole/{stray}")],
            "helm v{}: what the release left (only the stray ClusterRole may be)",
            helm.major
        );
        let ran = t.kubectl(&["delete", "clusterrole", &stray], None).await;
        assert!(ran.ok, "{}", ran.stderr);
        assert_eq!(t.leftovers(&selector).await, Vec::<String>::new());
        // Helm's own release records are gone too.
        assert_eq!(
            t.leftovers(&format!("owner=helm,name={release}")).await,
            Vec::<String>::new()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The kustomize base, applied for real (namespace spotguard: one test at a time uses it).

/// The documented kustomize install with the force-delete component: client-side apply, then
/// server-side apply of the same objects conflicts with nothing; a Karpenter GPU spot node gets
/// an agent pod; `kubectl delete -k daemonset/` would leave the force-delete ClusterRole (the
/// check sees it), the documented removal leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kustomize_install_server_side_reapply_karpenter_and_removal() {
    let _cluster_wide = CLUSTER_WIDE.lock().await;
    let t = Tools::start().await;
    let ov = overlay(&["daemonset"], &["daemonset/components/force-delete"], "");
    let rendered = t.kustomize(ov.path()).await;
    let ran = t.kubectl(&["apply", "-f", "-"], Some(&rendered)).await;
    assert!(ran.ok, "client-side apply: {}", ran.stderr);
    let ran = t
        .kubectl(
            &[
                "apply",
                "--server-side",
                "--field-manager=platform-team",
                "-f",
                "-",
            ],
            Some(&rendered),
        )
        .await;
    assert!(
        ran.ok,
        "server-side apply after client-side apply conflicts:\n{}",
        ran.stderr
    );

    // A Karpenter-provisioned GPU spot node, with none of the other GPU labels.
    let node =
        t.k.node(
            t.k.node_config("karpenter-gpu")
                .label("karpenter.sh/capacity-type", "spot")
                .label("karpenter.sh/nodepool", "gpu")
                .label("karpenter.k8s.aws/instance-gpu-manufacturer", "nvidia")
                .label("node.kubernetes.io/instance-type", "g5.xlarge")
                .taint("nvidia.com/gpu", None, "NoSchedule")
                .capacity("nvidia.com/gpu", "1"),
        )
        .await;
    let pods: Api<Pod> = Api::namespaced(t.k.admin(), "spotguard");
    eventually(
        &format!(
            "an agent pod for the Karpenter GPU node {} (DESIRED 0)",
            node.name()
        ),
        Duration::from_secs(60),
        || async {
            let list = pods.list(&Default::default()).await.unwrap();
            list.items.iter().any(|p| {
                serde_json::to_string(&p.spec)
                    .unwrap()
                    .contains(&format!("\"{}\"", node.name()))
            })
        },
    )
    .await;
    // DESIRED counts the node: the controller writes its status after it made the pod.
    let dss: Api<DaemonSet> = Api::namespaced(t.k.admin(), "spotguard");
    until_described(
        "the DaemonSet's DESIRED counting the Karpenter node",
        Duration::from_secs(30),
        |desired: &Option<i32>| Some(format!("DESIRED {desired:?}")),
        || async {
            let desired = dss
                .get("spotguard")
                .await
                .unwrap()
                .status
                .map(|s| s.desired_number_scheduled);
            if desired.unwrap_or(0) >= 1 {
                Ok(())
            } else {
                Err(desired)
            }
        },
    )
    .await;

    // The removal the docs used to give misses the component's RBAC; the check sees it.
    let selector = "app.kubernetes.io/name=spotguard";
    let base = repo_root().join("daemonset");
    let ran = t
        .kubectl(
            &["delete", "-k", base.to_str().unwrap(), "--wait=false"],
            None,
        )
        .await;
    assert!(ran.ok, "{}", ran.stderr);
    let left = t.leftovers(selector).await;
    assert!(
        left.contains(&"ClusterRole/spotguard-force-delete".to_string())
            && left.contains(&"ClusterRoleBinding/spotguard-force-delete".to_string()),
        "{left:?}"
    );
    // The documented removal.
    let docs = std::fs::read_to_string(repo_root().join("docs/deploy-kubernetes.md")).unwrap();
    assert!(
        docs.contains(KUSTOMIZE_REMOVAL),
        "docs/deploy-kubernetes.md lost: {KUSTOMIZE_REMOVAL}"
    );
    let mut args: Vec<&str> = KUSTOMIZE_REMOVAL.split_whitespace().skip(1).collect();
    args.extend(["--ignore-not-found", "--wait=false"]);
    let ran = t.kubectl(&args, None).await;
    assert!(ran.ok, "{}", ran.stderr);
    // testkit's own ServiceAccount for its force-delete identity, and the relay component's Role
    // and binding testkit applies for every test, not part of this install (in the namespace
    // being deleted, they go with it).
    let testkit_objects = [
        format!(
            "ServiceAccount/spotguard/{}",
            spotguard_testkit::k8s::controlplane::FORCE_DELETE_SERVICE_ACCOUNT
        ),
        "Role/spotguard/spotguard-relay".to_string(),
        "RoleBinding/spotguard/spotguard-relay".to_string(),
    ];
    let left: Vec<String> = t
        .leftovers(selector)
        .await
        .into_iter()
        .filter(|o| !testkit_objects.contains(o))
        .collect();
    assert_eq!(
        left,
        Vec::<String>::new(),
        "left after the documented removal"
    );
    drop(node);
}

// ---------------------------------------------------------------------------------------------
// The chart's DaemonSet, running.

/// `helm install` (Helm v4; v3 renders the same objects, see the equivalence test) of the
/// chart with its default values, plus the image of this test and the metadata endpoint of its
/// emulator: the DaemonSet controller creates the agent's pod for the GPU node, the scheduler
/// binds it, the kubelet stand-in starts both containers as the chart's pod says (args, env,
/// hostPath mounts, only KILL and SYS_PTRACE, the chart's ServiceAccount token), it becomes
/// Ready by its probe, and on a spot notice the agent, with the chart's RBAC, checkpoints a
/// non-root trainer, cordons, taints and drains the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_daemonset_runs_and_its_agent_handles_a_notice() {
    let _cluster_wide = CLUSTER_WIDE.lock().await;
    use spotguard::emulator::{self, Cloud, EmulatedNotice, EmulatorConfig};
    use spotguard_testkit::k8s::daemonset;

    daemonset::assert_host_ports_free();
    let t = Tools::start().await;
    let helm = helms().pop().unwrap();
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .unwrap();
    // The image name is this test's own, so that no other DaemonSet's pod starts here.
    let (node, _dmi) = daemonset::ec2_gpu_node(
        &t.k,
        "chart-gpu",
        "spotguard-chart-test:0.1.0",
        env!("CARGO_BIN_EXE_spotguard"),
    )
    .await;
    // The trainer runs before the agent starts, so that the agent's first list of the node's
    // pods holds it: the test then waits for the agent to say so.
    let ml = t.k.namespace("ml").await;
    daemonset::start_trainer(&t.k, &node, &ml).await;
    let ns = t.k.namespace("chart").await;
    let release = format!("spotguard-{}", t.k.id());
    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        values.path(),
        format!(
            "image:\n  repository: spotguard-chart-test\n\
             agent:\n  extraEnv:\n    - name: SPOTGUARD_METADATA_ENDPOINT\n      value: {}\n\
             nodeSelector:\n  kubernetes.io/hostname: {}\n",
            emu.base_url(),
            node.name()
        ),
    )
    .unwrap();
    let chart = chart();
    let ran = t
        .helm(
            &helm,
            &[
                "install",
                &release,
                &chart,
                "--namespace",
                &ns,
                "-f",
                values.path().to_str().unwrap(),
            ],
        )
        .await;
    assert!(ran.ok, "helm install: {}", ran.stderr);

    let agent_pod = daemonset::wait_agent_pod(&t.k, &node, &ns, &release, |s| {
        s.desired_number_scheduled == 1 && s.number_ready == 1
    })
    .await;
    let agent_name = agent_pod.metadata.name.clone().unwrap();
    let run = node
        .run_of(&ns, &agent_name, "spotguard")
        .expect("agent started");
    assert!(
        node.run_of(&ns, &agent_name, "prefetch").is_some(),
        "the prefetch sidecar did not start"
    );
    daemonset::assert_shipped_capabilities(run.pid);

    // The agent's pod cache holds the trainer; then the notice.
    daemonset::wait_pod_cache_synced(&node, &ns, &agent_name, 1).await;
    emu.raise(EmulatedNotice::interruption()).unwrap();
    daemonset::wait_notice_handled(&t.k, &node, &ml, (&ns, &agent_name), |e| {
        e.reason == "CheckpointAcked" && e.message.contains("4242")
    })
    .await;
    let ran = t
        .helm(
            &helm,
            &["uninstall", &release, "--namespace", &ns, "--wait"],
        )
        .await;
    assert!(ran.ok, "helm uninstall: {}", ran.stderr);
    drop(node);
    emu.shutdown().await;
}

/// Issue 42 item 3: a name Kubernetes would refuse never reaches the policy's CEL expression.
/// `--set-string serviceAccount.name='spotguard '` (YAML trims the space everywhere but inside
/// the CEL string, so the policy matched no request and was off) and a namespace that is not a
/// namespace name fail the render, with both Helm majors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_kubernetes_would_refuse_fail_the_render() {
    let home = tempfile::tempdir().unwrap();
    let chart = chart();
    for helm in helms() {
        for (args, says) in [
            (
                vec!["--set-string", "serviceAccount.name=spotguard "],
                "serviceAccount",
            ),
            (
                vec![
                    "--set",
                    "serviceAccount.create=false",
                    "--set-string",
                    "serviceAccount.name=Spotguard",
                ],
                "serviceAccount",
            ),
            (
                vec!["--set-string", "fullnameOverride=spot guard"],
                "fullnameOverride",
            ),
            (
                vec![
                    "--set-string",
                    "metrics.grafanaDashboard.namespace=mon itoring",
                ],
                "namespace",
            ),
            (vec!["--set-string", "nodeSelector.gpu=a b"], "nodeSelector"),
            (vec!["--namespace", "spot guard"], "namespace"),
        ] {
            let mut all = vec!["template", "x", chart.as_str()];
            all.extend(&args);
            let ran = run(&helm.bin, &all, None, home.path()).await;
            assert!(!ran.ok, "helm v{} accepted {args:?}", helm.major);
            assert!(
                ran.stderr.contains(says),
                "helm v{} {args:?}: {}",
                helm.major,
                ran.stderr
            );
        }
    }
}

/// Issue 42 items 2 and 3: the chart's own-node policy, rendered by the chart with its default
/// ServiceAccount name and applied to the real control plane, matches the agent's identity: a
/// token bound to the agent's pod on node A does its own node's things (taint and cordon, its
/// Events, a repeat patched into its series) and is refused node B's (taint, an Event about B,
/// a patch of B's agent's Event). The release's ServiceAccount is not the shipped one the
/// control plane's own policy names, so only the chart's policy holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_policy_holds_the_agents_token_to_its_own_node() {
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
    use spotguard::node::kube::KubeNodeOps;
    use spotguard::node::{reason, EventType, NodeOps, Protection, TaintEffect};

    let _cluster_wide = CLUSTER_WIDE.lock().await;
    let t = Tools::start().await;
    let helm = helms().pop().unwrap();
    let release = format!("pol-{}", t.k.id());
    // A namespace of its own: the kustomize removal test deletes the agents' namespace, which
    // goes on terminating after it (the policy names whatever namespace it is rendered for).
    let agent_ns = t.k.namespace("pol").await;
    let agent_ns = agent_ns.as_str();
    let rendered = template(
        &t,
        &helm,
        agent_ns,
        &[
            "--set",
            &format!("fullnameOverride={release}"),
            "--show-only",
            "templates/validatingadmissionpolicy.yaml",
        ],
    )
    .await
    .unwrap();
    assert!(
        rendered.contains(&format!("system:serviceaccount:{agent_ns}:{release}")),
        "{rendered}"
    );
    let ran = t
        .kubectl(
            &[
                "apply",
                "--server-side",
                "--field-manager=spotguard-chart-test",
                "-f",
                "-",
            ],
            Some(&rendered),
        )
        .await;
    assert!(ran.ok, "applying the chart's policy: {}", ran.stderr);

    // The release's ServiceAccount, with the shipped ClusterRole's rights (applied again: the
    // kustomize removal test deletes every object labelled as spotguard's).
    let clusterrole = repo_root().join("daemonset/clusterrole.yaml");
    let ran = t
        .kubectl(
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=spotguard-chart-test",
                "-f",
                &clusterrole.display().to_string(),
            ],
            None,
        )
        .await;
    assert!(ran.ok, "applying the shipped ClusterRole: {}", ran.stderr);
    let admin = t.k.admin();
    let sa = ServiceAccount {
        metadata: kube::api::ObjectMeta {
            name: Some(release.clone()),
            namespace: Some(agent_ns.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(admin.clone(), agent_ns)
        .create(&Default::default(), &sa)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(release.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "ClusterRole".into(),
            name: "spotguard".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: release.clone(),
            namespace: Some(agent_ns.into()),
            ..Default::default()
        }]),
    };
    let bindings = Api::<ClusterRoleBinding>::all(admin.clone());
    bindings
        .create(&Default::default(), &binding)
        .await
        .unwrap();

    let node_a = t.k.node(t.k.node_config("chart-a")).await;
    let node_b = t.k.node(t.k.node_config("chart-b")).await;
    let (a, b) = (node_a.name().to_string(), node_b.name().to_string());
    let client_a =
        t.k.pod_bound_client(&a, agent_ns, &format!("{release}-a"), &release)
            .await;
    let client_b =
        t.k.pod_bound_client(&b, agent_ns, &format!("{release}-b"), &release)
            .await;
    let ops = |client: &kube::Client, node: &str| {
        let metrics = std::sync::Arc::new(spotguard::metrics::Metrics::register(
            &mut prometheus_client::registry::Registry::default(),
        ));
        KubeNodeOps::new(client.clone(), node.to_string(), None, false, metrics)
    };
    let (ops_a, ops_b) = (ops(&client_a, &a), ops(&client_b, &b));
    let policy = format!("{release}-own-node");
    // The API server takes up a new policy in the background: wait until a dry run of node
    // B's taint is refused by it (a dry run passes admission and changes nothing).
    let nodes_a: Api<k8s_openapi::api::core::v1::Node> = Api::all(client_a.clone());
    let dry = kube::api::PatchParams {
        dry_run: true,
        ..Default::default()
    };
    let taint = serde_json::json!({ "metadata": { "labels": { "held": "no" } } });
    until_described(
        "the chart's policy refusing node A's token a change of node B",
        Duration::from_secs(30),
        |seen: &String| Some(seen.clone()),
        || async {
            match nodes_a
                .patch(&b, &dry, &kube::api::Patch::Merge(&taint))
                .await
            {
                Err(e) if e.to_string().contains(&policy) => Ok(()),
                other => Err(format!("{:?}", other.map(|_| "allowed"))),
            }
        },
    )
    .await;

    let protection = Protection {
        taint_value: "interruption".into(),
        effect: TaintEffect::NoSchedule,
        cordon: true,
    };
    ops_a.protect(&protection).await.expect("its own node");
    for _ in 0..2 {
        ops_a
            .event(EventType::Warning, reason::SPOT_INTERRUPTION, "notice")
            .await
            .expect("its own node's Event, then its series");
    }
    ops_b
        .event(EventType::Warning, reason::SPOT_INTERRUPTION, "notice")
        .await
        .expect("node B's agent's own Event");
    let refused = |what: &str, e: String| {
        assert!(e.contains(&policy) && e.contains(&a), "{what}: {e}");
    };
    let other = ops(&client_a, &b);
    refused(
        "node B's taint",
        other.protect(&protection).await.unwrap_err().to_string(),
    );
    // The agent's own Event code, pointed at node B: an Event about B.
    refused(
        "an Event about node B",
        other
            .event(EventType::Warning, reason::SPOT_INTERRUPTION, "forged")
            .await
            .unwrap_err()
            .to_string(),
    );
    let events = t.k.events().await;
    let theirs = events
        .iter()
        .find(|e| e.regarding_name == b && e.reason == "SpotInterruption")
        .unwrap_or_else(|| panic!("{events:?}"));
    let mine = events
        .iter()
        .find(|e| e.regarding_name == a && e.reason == "SpotInterruption")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(mine.count, 2, "{mine:?}");
    let ev: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client_a.clone(), "default");
    let patched = ev
        .patch(
            &theirs.name,
            &Default::default(),
            &kube::api::Patch::Merge(&serde_json::json!({
                "metadata": { "annotations": { "spotguard.io/save-seconds": "50000" } }
            })),
        )
        .await;
    refused(
        "a patch of node B's agent's Event",
        patched.unwrap_err().to_string(),
    );

    // The policy and its binding carry the chart's labels: gone before another test lists them.
    let ran = t
        .kubectl(
            &[
                "delete",
                "validatingadmissionpolicybinding,validatingadmissionpolicy",
                &policy,
            ],
            None,
        )
        .await;
    assert!(ran.ok, "{}", ran.stderr);
    bindings
        .delete(&release, &Default::default())
        .await
        .unwrap();
}
