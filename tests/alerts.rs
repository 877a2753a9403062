//! The alert rules and the dashboard, checked by the real Prometheus tool (promtool, installed by
//! scripts/deps/promtool.sh): the rule file parses, each alert fires from a synthetic series and
//! stays silent otherwise (tests/alerts/spotguard.test.yaml), every dashboard query parses, and
//! every metric they use is one spotguard documents — for the kustomize component's rules and the
//! chart's copy alike. On what the DaemonSet's two scrape targets really export (an agent's and a
//! prefetcher's `/metrics`, scraped from the running binaries): a healthy node fires no alert for
//! hours, a blind agent fires `SpotguardAgentBlind`, and every dashboard query returns data. The
//! kustomize example carries the `release` label kube-prometheus-stack selects by.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use spotguard::emulator::{self, Cloud, EmulatorConfig};
use spotguard_testkit::assets::repo_root;
use spotguard_testkit::free_port;
use spotguard_testkit::process::Kid;
use spotguard_testkit::prometheus::{input_series_between, promtool, rule_file_of, RULE_SOURCES};
use spotguard_testkit::wait;

fn alert_names(rules: &str) -> Vec<String> {
    rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .map(str::to_string)
        .collect()
}

/// Metric names a PromQL text uses, without histogram suffixes.
fn metrics_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in expr.match_indices("spotguard_") {
        if i > 0 && expr[..i].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = expr[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name)
            .to_string();
        out.push(base);
    }
    out
}

fn assert_documented(names: &[String], what: &str) {
    let docs = std::fs::read_to_string(repo_root().join("docs/metrics.md")).unwrap();
    for n in names {
        assert!(
            docs.contains(&format!("`{n}`")) || docs.contains(&format!("{n}`")),
            "{what} uses {n}, which docs/metrics.md does not document"
        );
    }
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    for source in RULE_SOURCES {
        rules_pass_check_and_unit_tests(source);
    }
}

fn rules_pass_check_and_unit_tests(source: &str) {
    let dir = tempfile::tempdir().unwrap();
    let rules = rule_file_of(source, dir.path());
    let out = promtool(&["check", "rules", rules.to_str().unwrap()]);
    assert!(out.contains("SUCCESS"), "{out}");
    let test = dir.path().join("spotguard.test.yaml");
    std::fs::copy(repo_root().join("tests/alerts/spotguard.test.yaml"), &test).unwrap();
    let out = promtool(&["test", "rules", test.to_str().unwrap()]);
    assert!(out.contains("SUCCESS"), "{source}: {out}");

    // Every alert has a unit test where it fires and one where it stays silent.
    let rules_text = std::fs::read_to_string(&rules).unwrap();
    let tests_text = std::fs::read_to_string(&test).unwrap();
    let names = alert_names(&rules_text);
    assert!(names.len() >= 6, "{names:?}");
    for name in &names {
        let mut fires = false;
        let mut silent = false;
        let mut lines = tests_text.lines().peekable();
        while let Some(l) = lines.next() {
            if l.trim() == format!("alertname: {name}") {
                match lines.peek().map(|n| n.trim()) {
                    Some("exp_alerts: []") => silent = true,
                    Some("exp_alerts:") => fires = true,
                    other => panic!("{name}: unexpected line after alertname: {other:?}"),
                }
            }
        }
        assert!(fires, "{name} is never shown to fire");
        assert!(silent, "{name} is never shown to stay silent");
    }
    assert!(tests_text.contains("first interruption on a fresh node"));
    let used: Vec<String> = rules_text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr: "))
        .flat_map(metrics_in)
        .collect();
    assert_documented(&used, "an alert");
}

/// Each dashboard panel's queries: (panel title, PromQL as Grafana has it).
fn dashboard_queries() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(repo_root().join("daemonset/monitoring/grafana-dashboard.json"))
            .unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            out.push((
                panel["title"].as_str().unwrap_or_default().to_string(),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

/// A dashboard query with Grafana's variables as Grafana substitutes them: `rate` the window
/// for `$__rate_interval`, `range` for `$__range`, every instance.
fn substituted(expr: &str, rate: &str, range: &str) -> String {
    let promql = expr
        .replace("$__rate_interval", rate)
        .replace("$__range", range)
        .replace("$instance", ".*");
    assert!(!promql.contains('$'), "unsubstituted variable in {expr}");
    promql
}

#[test]
fn every_dashboard_query_parses() {
    let exprs: Vec<String> = dashboard_queries().into_iter().map(|(_, e)| e).collect();
    assert!(exprs.len() >= 15, "{} queries", exprs.len());
    // Each query as a recording rule: `promtool check rules` parses every expression.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let promql = substituted(e, "1m", "24h");
        rules.push_str(&format!(
            "      - record: dashboard_query_{i}\n        expr: {}\n",
            serde_json::to_string(&promql).unwrap()
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-queries.yaml");
    std::fs::write(&path, rules).unwrap();
    let out = promtool(&["check", "rules", path.to_str().unwrap()]);
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", exprs.len())),
        "{out}"
    );
    let used: Vec<String> = exprs.iter().flat_map(|e| metrics_in(e)).collect();
    assert_documented(&used, "the dashboard");
}

/// `spotguard ARGS` as a child of this test (killed with it), without the caller's settings.
fn spotguard(args: &[String]) -> Kid {
    let mut c = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    c.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("SPOTGUARD_") || k == "KUBECONFIG" || k == "NODE_NAME" || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c.stdout(Stdio::null()).stderr(Stdio::null());
    Kid::spawn(c)
}

/// `spotguard run` on a host with no GPU and no trainer, polling `endpoint` as AWS's metadata
/// service, serving /metrics on `metrics`.
fn agent(endpoint: &str, dir: &Path, metrics: SocketAddr) -> Kid {
    let d = |p: &str| {
        let path = dir.join(p);
        std::fs::create_dir_all(&path).unwrap();
        path.display().to_string()
    };
    spotguard(&[
        "run".into(),
        "--mode=host".into(),
        "--cloud=aws".into(),
        format!("--metadata-endpoint={endpoint}"),
        "--poll-interval=200ms".into(),
        format!("--checkpoint-dir={}", d("ckpt")),
        format!("--state-dir={}", d("state")),
        format!("--cache-dir={}", d("cache")),
        "--gpu=off".into(),
        // Host mode needs a target; this one matches nothing.
        "--checkpoint-cmdline=^no-such-trainer$".into(),
        format!("--metrics-addr={metrics}"),
    ])
}

/// `/metrics` at `addr`, once it answers.
async fn scrape(addr: SocketAddr) -> Option<String> {
    let resp = reqwest::get(format!("http://{addr}/metrics")).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.text().await.ok()
}

/// The sum of a family's samples in a scrape.
fn total(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Two scrapes of `addr` and the seconds between them: the first once `counter` is above 0, the
/// second once it has risen past the first's by 3 (an empty `counter`: any two scrapes).
async fn two_scrapes(addr: SocketAddr, counter: &str) -> (String, String, f64) {
    let limit = Duration::from_secs(60);
    let (first, t0) = wait::until(&format!("{counter} > 0 at {addr}"), limit, || async move {
        let text = scrape(addr).await?;
        (counter.is_empty() || total(&text, counter) > 0.0).then(|| (text, Instant::now()))
    })
    .await;
    let base = total(&first, counter);
    let (second, t1) = wait::until(
        &format!("{counter} rising at {addr}"),
        limit,
        || async move {
            let text = scrape(addr).await?;
            (counter.is_empty() || total(&text, counter) >= base + 3.0)
                .then(|| (text, Instant::now()))
        },
    )
    .await;
    (first, second, (t1 - t0).as_secs_f64())
}

/// An alert's annotation (`summary`, `description`) in a rule file, `$labels.instance` filled in.
fn annotation(rules: &str, alert: &str, key: &str, instance: &str) -> String {
    let (_, rest) = rules
        .split_once(&format!("- alert: {alert}\n"))
        .unwrap_or_else(|| panic!("no alert {alert}"));
    let line = rest
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("{alert} has no {key}"));
    line.replace("{{ $labels.instance }}", instance)
}

/// What the DaemonSet's two scrape targets (the agent's `metrics` port, the prefetcher's
/// `pf-metrics`) really export, scraped from the running binaries and held for three hours as
/// Prometheus would store it: no shipped alert (the kustomize rules and the chart's copy) fires on
/// a healthy node; `SpotguardAgentBlind` fires for an agent that cannot read its metadata service
/// and not for the prefetcher beside it; every dashboard query returns data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_node_pages_nobody_on_both_targets_real_scrapes() {
    let emu = emulator::start(EmulatorConfig::new(Cloud::Aws))
        .await
        .expect("emulator");
    let work = tempfile::tempdir().unwrap();
    let healthy_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let blind_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let prefetch_addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let _healthy = agent(&emu.base_url(), &work.path().join("healthy"), healthy_addr);
    // Nothing listens on port 1: every poll fails, as with no metadata service at all.
    let _blind = agent("http://127.0.0.1:1", &work.path().join("blind"), blind_addr);
    let cache = work.path().join("pf-cache");
    let _prefetcher = spotguard(&[
        "prefetch-serve".into(),
        format!("--cache-dir={}", cache.display()),
        format!("--metrics-addr={prefetch_addr}"),
    ]);

    let (h0, h1, h_secs) = two_scrapes(healthy_addr, "spotguard_metadata_polls_total").await;
    let (b0, b1, b_secs) = two_scrapes(blind_addr, "spotguard_metadata_errors_total").await;
    let (p0, p1, p_secs) = two_scrapes(prefetch_addr, "").await;
    // Each process exports its own families only.
    let foreign: Vec<&str> = p1
        .lines()
        .filter(|l| l.starts_with("spotguard_") && !l.starts_with("spotguard_prefetch_"))
        .collect();
    assert!(
        foreign.is_empty(),
        "the prefetcher exports the agent's families:\n{}",
        foreign.join("\n")
    );
    let foreign: Vec<&str> = h1
        .lines()
        .filter(|l| l.starts_with("spotguard_prefetch_"))
        .collect();
    assert!(
        foreign.is_empty(),
        "the agent exports the prefetcher's families:\n{}",
        foreign.join("\n")
    );

    const MINUTES: u32 = 180;
    let pod = |p: &str, port: u16, container: &str| {
        format!(
            "namespace=\"spotguard\",pod=\"{p}\",container=\"{container}\",instance=\"10.0.0.{}:{port}\"",
            if p.ends_with("blind") { 2 } else { 1 }
        )
    };
    let agent_series = input_series_between(
        &h0,
        &h1,
        h_secs,
        &pod("spotguard-healthy", 9090, "agent"),
        MINUTES,
    );
    let prefetch_series =
        |p: &str| input_series_between(&p0, &p1, p_secs, &pod(p, 9091, "prefetch"), MINUTES);
    let blind_series = input_series_between(
        &b0,
        &b1,
        b_secs,
        &pod("spotguard-blind", 9090, "agent"),
        MINUTES,
    );

    for source in RULE_SOURCES {
        let dir = tempfile::tempdir().unwrap();
        let rules = rule_file_of(source, dir.path());
        let rules_text = std::fs::read_to_string(&rules).unwrap();
        let names = alert_names(&rules_text);
        assert!(names.len() >= 6, "{names:?}");
        let mut test = format!(
            "rule_files:\n  - rules.yaml\nevaluation_interval: 1m\ntests:\n  - name: a healthy node, both targets, three hours\n    interval: 1m\n    input_series:\n{agent_series}{}    alert_rule_test:\n",
            prefetch_series("spotguard-healthy")
        );
        for name in &names {
            for at in ["20m", "1h", "3h"] {
                test.push_str(&format!(
                    "      - eval_time: {at}\n        alertname: {name}\n        exp_alerts: []\n"
                ));
            }
        }
        let instance = "10.0.0.2:9090";
        test.push_str(&format!(
            "  - name: a blind agent beside its prefetcher\n    interval: 1m\n    input_series:\n{blind_series}{}    alert_rule_test:\n      - eval_time: 20m\n        alertname: SpotguardAgentBlind\n        exp_alerts:\n          - exp_labels:\n              severity: critical\n              namespace: spotguard\n              pod: spotguard-blind\n              instance: \"{instance}\"\n            exp_annotations:\n              summary: {}\n              description: {}\n",
            prefetch_series("spotguard-blind"),
            annotation(&rules_text, "SpotguardAgentBlind", "summary", instance),
            annotation(&rules_text, "SpotguardAgentBlind", "description", instance),
        ));
        let path = dir.path().join("real-scrapes.test.yaml");
        std::fs::write(&path, &test).unwrap();
        let out = promtool(&["test", "rules", path.to_str().unwrap()]);
        assert!(out.contains("SUCCESS"), "{source}: {out}");
    }

    // Every dashboard query, as an alert that fires when it returns nothing, stays silent. The
    // agent here reads no GPU (`--gpu=off`, a node without one): the GPU panel is empty for it
    // by design; tests/nvml.rs scrapes GPU series from an agent reading (stand-in) GPUs.
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut checks = String::new();
    for (i, (title, expr)) in dashboard_queries().iter().enumerate() {
        if expr.contains("spotguard_node_gpu_") || expr.contains("spotguard_gpu_") {
            continue;
        }
        let promql = substituted(expr, "5m", "1h");
        rules.push_str(&format!(
            "      - alert: DashboardQuery{i}\n        expr: {}\n        annotations:\n          panel: {}\n",
            serde_json::to_string(&format!("absent({promql})")).unwrap(),
            serde_json::to_string(title).unwrap(),
        ));
        checks.push_str(&format!(
            "      - eval_time: 1h\n        alertname: DashboardQuery{i}\n        exp_alerts: []\n"
        ));
    }
    std::fs::write(dir.path().join("dashboard.yaml"), rules).unwrap();
    let test = format!(
        "rule_files:\n  - dashboard.yaml\nevaluation_interval: 1m\ntests:\n  - name: every dashboard query returns data from a healthy node\n    interval: 1m\n    input_series:\n{agent_series}{}    alert_rule_test:\n{checks}",
        prefetch_series("spotguard-healthy")
    );
    let path = dir.path().join("dashboard.test.yaml");
    std::fs::write(&path, &test).unwrap();
    let out = promtool(&["test", "rules", path.to_str().unwrap()]);
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn the_kube_prometheus_stack_example_labels_monitor_and_rules() {
    let out = Command::new("kubectl")
        .args(["kustomize"])
        .arg(repo_root().join("daemonset/examples/kube-prometheus-stack"))
        .output()
        .unwrap_or_else(|e| panic!("kubectl not runnable ({e}): run scripts/deps/kubectl.sh"));
    let yaml = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let docs: Vec<&str> = yaml.split("\n---\n").collect();
    for kind in ["PodMonitor", "PrometheusRule"] {
        let doc = docs
            .iter()
            .find(|d| d.contains(&format!("kind: {kind}\n")))
            .unwrap_or_else(|| panic!("no {kind} in {yaml}"));
        let (metadata, _) = doc
            .split_once("\nspec:")
            .unwrap_or_else(|| panic!("{kind} without spec"));
        assert!(
            metadata.contains("release: kube-prometheus-stack"),
            "{kind} lacks the release label:\n{doc}"
        );
    }
    // The pod selector is untouched: the agent pods carry no `release` label.
    let pm = docs
        .iter()
        .find(|d| d.contains("kind: PodMonitor\n"))
        .unwrap();
    let (_, spec) = pm.split_once("\nspec:").unwrap();
    assert!(!spec.contains("release"), "{pm}");
}
