//! The clouds spotguard knows, and what the rest of the agent takes from each one's source as
//! data. [`Cloud`] is the one name of a cloud: `--cloud` of `run`, `drill` and `emulate`, a
//! notice's and a plan record's `source`, the `source` label of metrics. Everything else about a
//! cloud lives in its source file (`ec2.rs`, `gce.rs`, `azure.rs`): its client, its [`CloudFacts`]
//! (defaults, detection, how to build it), its own metrics. [`Cloud::facts`] is the one table
//! that links a cloud to its file: adding a cloud is its source file, its variant here and one
//! line in that table (docs/architecture.md, "Adding a cloud").

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use reqwest::{Method, Url};
use serde::{Deserialize, Serialize};

use super::detect::Dmi;
use super::{azure, ec2, gce, Error, MaintenanceKind, NoticeSource};
use crate::metrics::Metrics;

/// A cloud whose metadata service spotguard watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Cloud {
    Aws,
    Gce,
    Azure,
}

impl Cloud {
    /// Every cloud, in the order detection tries them.
    pub const ALL: [Cloud; 3] = [Cloud::Aws, Cloud::Gce, Cloud::Azure];

    /// What this cloud's source supplies (see [`CloudFacts`]).
    pub fn facts(self) -> &'static CloudFacts {
        match self {
            Cloud::Aws => &ec2::FACTS,
            Cloud::Gce => &gce::FACTS,
            Cloud::Azure => &azure::FACTS,
        }
    }

    /// The cloud's name (`aws`, `gce`, `azure`).
    pub fn as_str(self) -> &'static str {
        self.facts().name
    }

    /// The time kept before the deadline for evictions: `--drain-reserve` when given, else
    /// this cloud's default.
    pub fn drain_reserve(self, flag: Option<Duration>) -> Duration {
        flag.unwrap_or(self.facts().drain_reserve)
    }

    /// The kind of maintenance a notice's `detail` names (a plan record keeps the detail).
    pub fn maintenance_of_detail(self, detail: &str) -> MaintenanceKind {
        (self.facts().maintenance_of_detail)(detail)
    }

    /// Build this cloud's notice source from `run`'s settings.
    pub fn source(
        self,
        settings: &Settings,
        metrics: &Arc<Metrics>,
        own: &SourceMetrics,
    ) -> Result<Arc<dyn NoticeSource>, Error> {
        (self.facts().build)(settings, metrics, own)
    }
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the rest of the agent takes from a cloud's source, as data: each source file defines its
/// own `FACTS`.
pub struct CloudFacts {
    /// The cloud's name, as [`Cloud`] (de)serializes it.
    pub name: &'static str,
    /// Time kept before the deadline for evictions when `--drain-reserve` is not given.
    pub drain_reserve: Duration,
    /// The notice an interruption gives: what `spotguard drill` rehearses (its deadline, and the
    /// default `--kill-after` of an elastic drill).
    pub interruption_notice: Duration,
    /// The most notice the cloud ever gives an interruption, where its deadline is a clock
    /// reading that can be skewed or bogus: a deadline outside [first seen, first seen + this] is
    /// clamped into it. `None`: the source's deadlines are its own (GCE: detection + notice).
    pub max_interruption_notice: Option<Duration>,
    /// The rehearsed interruption, in `spotguard drill --help`.
    pub drill_notice: &'static str,
    /// How the drill's agent sees the emulated notice (the drill report's "notice seen" row).
    pub drill_detection: &'static str,
    /// `--cloud auto`: whether the machine's DMI identity names this cloud (no network).
    pub dmi: fn(&Dmi) -> bool,
    /// `--cloud auto`: the request only this cloud's metadata service answers with a non-empty
    /// body.
    pub probe: Probe,
    /// The kind of maintenance a notice's `detail` names: plan records keep the cloud's
    /// `detail`, not the typed [`MaintenanceKind`] (their format predates it), so a resumed plan
    /// learns it back from the source that wrote the detail.
    pub maintenance_of_detail: fn(&str) -> MaintenanceKind,
    /// Build the source.
    pub build: BuildSource,
}

/// How a source is built from `run`'s settings, the agent's metrics and its own.
pub type BuildSource =
    fn(&Settings, &Arc<Metrics>, &SourceMetrics) -> Result<Arc<dyn NoticeSource>, Error>;

/// A detection probe: `method path` with one header the metadata service requires.
#[derive(Clone, Debug)]
pub struct Probe {
    pub method: Method,
    pub path: &'static str,
    pub header: (&'static str, &'static str),
}

/// What `run`'s flags say to the sources; each source reads its part.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `--metadata-endpoint`: the base URL of whichever source runs (else its cloud's address).
    pub endpoint: Option<Url>,
    /// `--poll-interval`: the cadence of the polling sources (EC2, Azure).
    pub poll_interval: Duration,
    /// `--imds-v1-fallback` (EC2).
    pub imds_v1_fallback: bool,
    /// `--gce-preemption-notice` (GCE).
    pub gce_preemption_notice: Duration,
    /// `--azure-vm-name` (Azure).
    pub azure_vm_name: Option<String>,
}

/// The sources' own metric families, registered once at start-up (before the cloud is known:
/// auto-detection builds the source later).
#[derive(Clone, Debug, Default)]
pub struct SourceMetrics {
    /// `spotguard_gce_upcoming_maintenance*`.
    pub gce: gce::GceMetrics,
}

impl SourceMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        SourceMetrics {
            gce: gce::GceMetrics::register(registry),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cloud_has_one_name_everywhere() {
        for cloud in Cloud::ALL {
            let json = serde_json::to_string(&cloud).unwrap();
            assert_eq!(json, format!("\"{}\"", cloud.as_str()));
            let value = clap::ValueEnum::to_possible_value(&cloud).unwrap();
            assert_eq!(value.get_name(), cloud.as_str());
        }
        let names: Vec<&str> = Cloud::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(
            names,
            crate::metrics::known::SOURCES,
            "metrics' zeroed series"
        );
        assert_eq!(
            <Cloud as clap::ValueEnum>::value_variants().len(),
            Cloud::ALL.len()
        );
    }

    #[test]
    fn drain_reserve_is_the_flag_else_the_clouds() {
        assert_eq!(Cloud::Aws.drain_reserve(None), Duration::from_secs(25));
        assert_eq!(Cloud::Gce.drain_reserve(None), Duration::from_secs(8));
        assert_eq!(Cloud::Azure.drain_reserve(None), Duration::from_secs(8));
        let flag = Some(Duration::from_secs(3));
        assert_eq!(Cloud::Aws.drain_reserve(flag), Duration::from_secs(3));
    }
}
