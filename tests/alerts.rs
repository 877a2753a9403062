//! The alert rules and the dashboard, checked by the real Prometheus tool (promtool, installed by
//! scripts/deps/promtool.sh): the rule file parses, each alert fires from a synthetic series and
//! stays silent otherwise (tests/alerts/spotguard.test.yaml), every dashboard query parses, and
//! every metric they use is one spotguard documents. The kustomize example carries the `release`
//! label kube-prometheus-stack selects by.

use std::process::Command;

use spotguard_testkit::assets::repo_root;
use spotguard_testkit::prometheus::{promtool, rule_file};

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
    let dir = tempfile::tempdir().unwrap();
    let rules = rule_file(dir.path());
    let out = promtool(&["check", "rules", rules.to_str().unwrap()]);
    assert!(out.contains("SUCCESS"), "{out}");
    let test = dir.path().join("spotguard.test.yaml");
    std::fs::copy(repo_root().join("tests/alerts/spotguard.test.yaml"), &test).unwrap();
    let out = promtool(&["test", "rules", test.to_str().unwrap()]);
    assert!(out.contains("SUCCESS"), "{out}");

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

#[test]
fn every_dashboard_query_parses() {
    let text =
        std::fs::read_to_string(repo_root().join("daemonset/monitoring/grafana-dashboard.json"))
            .unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_string());
        }
    }
    assert!(exprs.len() >= 15, "{} queries", exprs.len());
    // Grafana's variables, as Grafana substitutes them, then each query as a recording rule:
    // `promtool check rules` parses every expression.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let promql = e
            .replace("$__rate_interval", "1m")
            .replace("$__range", "24h")
            .replace("$instance", ".*");
        assert!(!promql.contains('$'), "unsubstituted variable in {e}");
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
