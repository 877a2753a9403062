//! The API server's own metrics (`/metrics`, read as the admin): request counts, open
//! long-running requests (watches), and the request-duration histogram, whose deltas between two
//! scrapes give the latency of what happened in between.

use std::collections::BTreeMap;

/// One sample of the Prometheus text format.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parse the Prometheus text exposition format (comments skipped, no timestamps expected).
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(parse_line)
        .collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let (head, value) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            let labels = parse_labels(&line[open + 1..close]);
            let value = line[close + 1..].split_whitespace().next()?;
            ((line[..open].to_string(), labels), value)
        }
        None => {
            let mut parts = line.split_whitespace();
            let name = parts.next()?.to_string();
            ((name, BTreeMap::new()), parts.next()?)
        }
    };
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: head.0,
        labels: head.1,
        value,
    })
}

fn parse_labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(after) = after.strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(key, value);
        rest = &after[end..];
    }
    out
}

/// The sum of `name`'s samples whose labels pass `filter`.
pub fn sum(
    samples: &[Sample],
    name: &str,
    filter: impl Fn(&BTreeMap<String, String>) -> bool,
) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && filter(&s.labels))
        .map(|s| s.value)
        .sum()
}

/// A histogram summed over label sets: cumulative `(le, count)` buckets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub count: f64,
    pub sum: f64,
}

impl Histogram {
    /// Histogram `name` (`name_bucket`, `_count`, `_sum`) over the label sets `filter` passes.
    pub fn of(
        samples: &[Sample],
        name: &str,
        filter: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Histogram {
        let mut by_le: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        let bucket = format!("{name}_bucket");
        for s in samples
            .iter()
            .filter(|s| s.name == bucket && filter(&s.labels))
        {
            let Some(le) = s.labels.get("le").and_then(|v| match v.as_str() {
                "+Inf" => Some(f64::INFINITY),
                v => v.parse::<f64>().ok(),
            }) else {
                continue;
            };
            by_le.entry(le.to_bits()).or_insert((le, 0.0)).1 += s.value;
        }
        let mut buckets: Vec<(f64, f64)> = by_le.into_values().collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram {
            buckets,
            count: sum(samples, &format!("{name}_count"), &filter),
            sum: sum(samples, &format!("{name}_sum"), &filter),
        }
    }

    /// What was observed since `before`.
    pub fn since(&self, before: &Histogram) -> Histogram {
        let old = |le: f64| {
            before
                .buckets
                .iter()
                .find(|(l, _)| l.to_bits() == le.to_bits())
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|&(le, c)| (le, (c - old(le)).max(0.0)))
                .collect(),
            count: (self.count - before.count).max(0.0),
            sum: (self.sum - before.sum).max(0.0),
        }
    }

    /// The `q` quantile as Prometheus' `histogram_quantile` estimates it (linear within the
    /// bucket; the highest finite bound when it falls in +Inf). NaN when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.buckets.last().map_or(0.0, |b| b.1);
        if total <= 0.0 {
            return f64::NAN;
        }
        let rank = q * total;
        let mut prev = (0.0, 0.0);
        for &(le, c) in &self.buckets {
            if c >= rank {
                if le.is_infinite() {
                    return prev.0;
                }
                if c == prev.1 {
                    return le;
                }
                return prev.0 + (le - prev.0) * (rank - prev.1) / (c - prev.1);
            }
            prev = (le, c);
        }
        prev.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x
apiserver_request_duration_seconds_bucket{verb="GET",resource="pods",le="0.1"} 90
apiserver_request_duration_seconds_bucket{verb="GET",resource="pods",le="0.2"} 100
apiserver_request_duration_seconds_bucket{verb="GET",resource="pods",le="+Inf"} 100
apiserver_request_duration_seconds_count{verb="GET",resource="pods"} 100
apiserver_request_duration_seconds_sum{verb="GET",resource="pods"} 5
apiserver_request_duration_seconds_bucket{verb="WATCH",resource="pods",le="0.1"} 0
apiserver_request_duration_seconds_bucket{verb="WATCH",resource="pods",le="0.2"} 0
apiserver_request_duration_seconds_bucket{verb="WATCH",resource="pods",le="+Inf"} 7
apiserver_longrunning_requests{verb="WATCH",resource="pods",scope="cluster"} 3
apiserver_longrunning_requests{verb="WATCH",resource="nodes",scope="cluster"} 2
weird{a="x\"y,z=1",b="2"} 1
"#;

    #[test]
    fn parses_samples_with_quoted_labels() {
        let s = parse(TEXT);
        let w = s.iter().find(|s| s.name == "weird").unwrap();
        assert_eq!(w.labels["a"], "x\"y,z=1");
        assert_eq!(w.labels["b"], "2");
        assert_eq!(
            sum(&s, "apiserver_longrunning_requests", |l| l["verb"]
                == "WATCH"),
            5.0
        );
    }

    #[test]
    fn quantiles_interpolate_within_buckets_and_deltas_subtract() {
        let s = parse(TEXT);
        let h = Histogram::of(&s, "apiserver_request_duration_seconds", |l| {
            l["verb"] != "WATCH"
        });
        assert_eq!(h.buckets.len(), 3);
        assert!(
            (h.quantile(0.5) - 0.0555).abs() < 1e-3,
            "{}",
            h.quantile(0.5)
        );
        assert!((h.quantile(0.95) - 0.15).abs() < 1e-9);
        let none = h.since(&h);
        assert!(none.quantile(0.99).is_nan());
        assert_eq!(h.since(&Histogram::default()).count, 100.0);
    }
}
