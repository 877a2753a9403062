//! The shipped alert rules under the real Prometheus tool (`promtool`, installed by
//! scripts/deps/promtool.sh): the rule groups of daemonset/components/alerts as a rule file, and
//! a scrape of a running agent turned into promtool's input series, so a test can ask whether an
//! alert fires on what an agent really exports.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::assets::repo_root;

/// Run `promtool ARGS`; panics with its output when it fails or is missing.
pub fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("promtool not runnable ({e}): run scripts/deps/promtool.sh"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// The rule groups of the shipped PrometheusRule (everything below `spec:`, dedented by two
/// spaces), written to `dir/rules.yaml`.
pub fn rule_file(dir: &Path) -> PathBuf {
    let cr = std::fs::read_to_string(
        repo_root().join("daemonset/components/alerts/prometheusrule.yaml"),
    )
    .unwrap();
    let (_, spec) = cr
        .split_once("\nspec:\n")
        .expect("no spec: in the PrometheusRule");
    let rules: String = spec
        .lines()
        .map(|l| {
            assert!(
                l.is_empty() || l.starts_with("  "),
                "not indented under spec: {l:?}"
            );
            format!("{}\n", l.get(2..).unwrap_or(""))
        })
        .collect();
    let path = dir.join("rules.yaml");
    std::fs::write(&path, rules).unwrap();
    path
}

/// Every finite sample of a Prometheus text scrape as promtool `input_series` entries (YAML list
/// items, indented for `input_series:`), each labelled `instance="<instance>"` and holding its
/// scraped value for `minutes` one-minute steps: what Prometheus would store if it scraped the
/// agent once a minute and the agent kept exporting what it exported then.
pub fn input_series(scrape: &str, instance: &str, minutes: u32) -> String {
    let mut out = String::new();
    for line in scrape.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if !v.is_finite() {
            continue;
        }
        let labelled = match series.split_once('{') {
            Some((name, rest)) if rest.starts_with('}') => {
                format!("{name}{{instance=\"{instance}\"}}")
            }
            Some((name, rest)) => format!("{name}{{instance=\"{instance}\",{rest}"),
            None => format!("{series}{{instance=\"{instance}\"}}"),
        };
        out.push_str(&format!(
            "      - series: '{}'\n        values: '{v}x{minutes}'\n",
            labelled.replace('\'', "''")
        ));
    }
    out
}
