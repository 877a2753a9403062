//! `spotguard gpu [--json]`: one sample, one evaluation, printed as a table or JSON.
//! Exit 0 healthy (or degraded: shown, not failed), 1 unhealthy, 2 NVML unavailable / no GPU.
//!
//! One sample has no history: rules that need a rate or a streak (corrected ECC rate, NVLink
//! counters rising, repeated application XIDs, persistent throttling, a GPU missing since
//! earlier) need the daemon; everything that is a state (pending / failed remaps, volatile
//! uncorrectable ECC, lost GPU, recovery action, retired pages) is judged here exactly as the
//! daemon judges it.

use jiff::Timestamp;
use serde::Serialize;

use super::health::{evaluate, Finding, Health, HealthState, Thresholds};
use super::{Error, GpuProbe, GpuSample, NvmlProbe};

/// Exit codes of `spotguard gpu`.
pub const EXIT_HEALTHY: i32 = 0;
pub const EXIT_UNHEALTHY: i32 = 1;
pub const EXIT_UNAVAILABLE: i32 = 2;

/// `spotguard gpu` arguments.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct GpuArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The verdict for this machine.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub generated_at: Timestamp,
    pub boot_id: String,
    /// Set when NVML could not be used (then `gpus` is empty and `node` unknown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    pub node: Health,
    pub gpus: Vec<GpuReport>,
    pub findings: Vec<Finding>,
}

#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    pub health: Health,
    #[serde(flatten)]
    pub sample: GpuSample,
}

impl Report {
    /// The report for a machine where NVML cannot be used.
    pub fn unavailable(error: &Error, boot_id: &str) -> Report {
        Report {
            generated_at: Timestamp::now(),
            boot_id: boot_id.to_string(),
            unavailable: Some(error.to_string()),
            driver_version: None,
            node: Health::Unknown,
            gpus: Vec::new(),
            findings: Vec::new(),
        }
    }

    pub fn exit_code(&self) -> i32 {
        if self.unavailable.is_some() {
            return EXIT_UNAVAILABLE;
        }
        match self.node {
            Health::Healthy | Health::Degraded => EXIT_HEALTHY,
            Health::Unhealthy => EXIT_UNHEALTHY,
            Health::Unknown => EXIT_UNAVAILABLE,
        }
    }

    pub fn to_json(&self) -> String {
        // Plain data with string keys: serialising cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Human table: one line per GPU, then the node verdict and the findings.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        if let Some(reason) = &self.unavailable {
            out.push_str(&format!("GPU health: unavailable: {reason}\n"));
            return out;
        }
        let header = [
            "GPU",
            "UUID",
            "MODEL",
            "HEALTH",
            "TEMP",
            "POWER",
            "MEMORY",
            "ECC UNC/COR",
            "REMAP",
            "CLOCKS",
        ];
        let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
        for g in &self.gpus {
            let s = &g.sample;
            rows.push(vec![
                s.index.to_string(),
                s.uuid.clone(),
                s.model.clone(),
                g.health.as_str().to_string(),
                s.temperature_celsius.map_or_else(na, |t| format!("{t}C")),
                match (s.power_watts, s.power_limit_watts) {
                    (Some(p), Some(l)) => format!("{p:.0}/{l:.0}W"),
                    (Some(p), None) => format!("{p:.0}W"),
                    _ => na(),
                },
                match (s.memory_used_bytes, s.memory_total_bytes) {
                    (Some(u), Some(t)) => format!("{}/{} GiB", gib(u), gib(t)),
                    _ => na(),
                },
                match (s.ecc_uncorrected_volatile, s.ecc_corrected_volatile) {
                    _ if s.ecc_enabled == Some(false) => "off".to_string(),
                    (Some(u), Some(c)) => format!("{u}/{c}"),
                    _ => na(),
                },
                remap_cell(s),
                if s.lost {
                    "lost".to_string()
                } else {
                    let names = s.clocks_event_reason_names();
                    if s.clocks_event_reasons.is_none() {
                        na()
                    } else if names.is_empty() {
                        "-".to_string()
                    } else {
                        names.join(",")
                    }
                },
            ]);
        }
        let widths: Vec<usize> = (0..header.len())
            .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
            .collect();
        for row in &rows {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(cell, w)| format!("{cell:<w$}"))
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        out.push_str(&format!(
            "\nnode: {} ({} GPU{}, driver {}, boot_id {})\n",
            self.node.as_str(),
            self.gpus.len(),
            if self.gpus.len() == 1 { "" } else { "s" },
            self.driver_version.as_deref().unwrap_or("unknown"),
            self.boot_id
        ));
        if !self.findings.is_empty() {
            out.push_str("findings:\n");
            for f in &self.findings {
                let gpu = f.gpu.map(|i| format!(" (gpu {i})")).unwrap_or_default();
                out.push_str(&format!(
                    "  {:<9} {}{gpu} {}: {}\n",
                    f.severity.as_str(),
                    f.uuid,
                    f.rule.reason(),
                    f.evidence
                ));
            }
        }
        out
    }
}

fn na() -> String {
    "n/a".to_string()
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}

fn remap_cell(s: &GpuSample) -> String {
    let mut parts = Vec::new();
    if let (Some(u), Some(c)) = (s.remapped_rows_uncorrectable, s.remapped_rows_correctable) {
        parts.push(format!("{u}/{c}"));
    }
    if s.remap_pending == Some(true) {
        parts.push("pending".into());
    }
    if s.remap_failure == Some(true) {
        parts.push("FAILED".into());
    }
    if s.retired_pages_single_bit.is_some() || s.retired_pages_double_bit.is_some() {
        parts.push(format!(
            "retired {}",
            s.retired_pages_single_bit
                .unwrap_or(0)
                .saturating_add(s.retired_pages_double_bit.unwrap_or(0))
        ));
    }
    if s.retired_pages_pending == Some(true) {
        parts.push("retire-pending".into());
    }
    if parts.is_empty() {
        na()
    } else {
        parts.join(" ")
    }
}

/// Sample `probe` once and judge it.
pub fn report(probe: &dyn GpuProbe, thresholds: &Thresholds, boot_id: &str) -> Report {
    let samples = match probe.sample() {
        Ok(s) => s,
        Err(e) => return Report::unavailable(&e, boot_id),
    };
    let events = probe.drain_events();
    let now = Timestamp::now();
    let state = evaluate(
        &HealthState::default(),
        &samples,
        &events,
        now,
        boot_id,
        thresholds,
    );
    let gpus = samples
        .into_iter()
        .map(|s| GpuReport {
            health: state
                .gpus
                .get(&s.uuid)
                .map_or(Health::Unknown, |t| t.health),
            sample: s,
        })
        .collect();
    Report {
        generated_at: now,
        boot_id: boot_id.to_string(),
        unavailable: None,
        driver_version: probe.driver_version(),
        node: state.node,
        gpus,
        findings: state.findings,
    }
}

/// What `spotguard gpu` prints and returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CliOutput {
    pub stdout: String,
    pub stderr: String,
    pub code: i32,
}

/// Render a report for the CLI: JSON on stdout with `--json`; otherwise the table on stdout,
/// or the reason NVML is unavailable on stderr.
pub fn cli_output(args: &GpuArgs, report: &Report) -> CliOutput {
    let code = report.exit_code();
    if args.json {
        return CliOutput {
            stdout: format!("{}\n", report.to_json()),
            stderr: String::new(),
            code,
        };
    }
    match &report.unavailable {
        Some(_) => CliOutput {
            stdout: String::new(),
            stderr: report.to_table(),
            code,
        },
        None if report.gpus.is_empty() => CliOutput {
            stdout: String::new(),
            stderr: "GPU health: NVML loaded but lists no GPU\n".into(),
            code,
        },
        None => CliOutput {
            stdout: report.to_table(),
            stderr: String::new(),
            code,
        },
    }
}

/// `spotguard gpu`: print the report, return the exit code.
pub fn run_cli(args: GpuArgs) -> i32 {
    let boot_id = crate::life::read_boot_id().unwrap_or_else(|e| {
        eprintln!("warning: {e}");
        "unknown".to_string()
    });
    let report = match NvmlProbe::new() {
        Ok(probe) => report(&probe, &Thresholds::default(), &boot_id),
        Err(e) => Report::unavailable(&e, &boot_id),
    };
    let out = cli_output(&args, &report);
    print!("{}", out.stdout);
    eprint!("{}", out.stderr);
    out.code
}
