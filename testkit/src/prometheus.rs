//! The shipped alert rules under the real Prometheus tool (`promtool`, installed by
//! scripts/deps/promtool.sh): the rule groups of daemonset/components/alerts (or the chart's
//! copy) as a rule file, and scrapes of a running agent or prefetcher turned into
//! promtool's input series, so a test can ask whether an alert fires on what they really export.

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

/// The shipped PrometheusRules: the kustomize component's and the Helm chart's copy.
pub const RULE_SOURCES: [&str; 2] = [
    "daemonset/components/alerts/prometheusrule.yaml",
    "charts/spotguard/files/prometheusrule.yaml",
];

/// The rule groups of the shipped PrometheusRule (everything below `spec:`, dedented by two
/// spaces), written to `dir/rules.yaml`.
pub fn rule_file(dir: &Path) -> PathBuf {
    rule_file_of(RULE_SOURCES[0], dir)
}

/// The rule groups of the PrometheusRule at `source` (relative to the repository root), written
/// to `dir/rules.yaml`.
pub fn rule_file_of(source: &str, dir: &Path) -> PathBuf {
    let cr = std::fs::read_to_string(repo_root().join(source))
        .unwrap_or_else(|e| panic!("{source}: {e}"));
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
    for (series, v) in samples(scrape) {
        out.push_str(&series_entry(
            &labelled(series, &format!("instance=\"{instance}\"")),
            &format!("{v}x{minutes}"),
        ));
    }
    out
}

/// Two scrapes of one target, `secs` apart, as promtool `input_series` entries, each labelled
/// with `labels` (`namespace="spotguard",pod="…",instance="…"`, as Prometheus labels a target),
/// for `minutes` one-minute steps from the second scrape on: a gauge holds its second value, a
/// counter (each series of a family the scrape types `counter` or `histogram`) goes on rising at
/// the rate it rose between the scrapes. What Prometheus would store if the target went on as it
/// went between the two scrapes.
pub fn input_series_between(
    first: &str,
    second: &str,
    secs: f64,
    labels: &str,
    minutes: u32,
) -> String {
    let monotonic: Vec<&str> = second
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, kind)| matches!(kind.trim(), "counter" | "histogram"))
        .map(|(name, _)| name)
        .collect();
    let before: std::collections::HashMap<&str, f64> = samples(first).collect();
    let mut out = String::new();
    for (series, v) in samples(second) {
        let name = series.split('{').next().unwrap_or(series);
        let counter = monotonic.iter().any(|f| {
            name.strip_prefix(f)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
        });
        let per_minute = match before.get(series) {
            Some(&v0) if counter && secs > 0.0 => ((v - v0) / secs * 60.0).max(0.0),
            _ => 0.0,
        };
        out.push_str(&series_entry(
            &labelled(series, labels),
            &format!("{v}+{per_minute}x{minutes}"),
        ));
    }
    out
}

/// The finite samples of a Prometheus text scrape: (series with its labels, value).
fn samples(scrape: &str) -> impl Iterator<Item = (&str, f64)> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(series, value)| Some((series, value.parse::<f64>().ok()?)))
        .filter(|(_, v)| v.is_finite())
}

/// `series` (`name` or `name{…}`) with `labels` added in front of its own.
fn labelled(series: &str, labels: &str) -> String {
    match series.split_once('{') {
        Some((name, rest)) if rest.starts_with('}') => format!("{name}{{{labels}}}"),
        Some((name, rest)) => format!("{name}{{{labels},{rest}"),
        None => format!("{series}{{{labels}}}"),
    }
}

/// One `input_series` list item (indented for `input_series:`).
fn series_entry(series: &str, values: &str) -> String {
    format!(
        "      - series: '{}'\n        values: '{values}'\n",
        series.replace('\'', "''")
    )
}
