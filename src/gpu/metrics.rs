//! GPU metrics. Readings are published as one snapshot per sample and encoded by a collector at
//! scrape time, so a GPU that disappears or a reading that becomes NotSupported simply has no
//! series (never a stale value, never a zero). Labels per GPU: `gpu` (index), `uuid`, `model`.
//!
//! NVML's own cumulative counts (ECC errors, PCIe replays, NVLink errors, energy) are exported
//! as counters carrying NVML's value: they only grow, except that a GPU reset or driver reload
//! sets the volatile ones back to zero, which Prometheus `rate()`/`increase()` treat as a
//! counter reset. Counts that describe a state (retired pages, remapped rows) are gauges.
//! spotguard's own counts (XIDs, ECC events, errors) are ordinary counters since start.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::health::{Health, HealthState, Rule, Severity};
use super::podresources::Allocations;
use super::{GpuEvent, GpuEventKind, GpuSample, CLOCK_EVENT_REASONS};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct XidLabels {
    pub gpu: String,
    pub uuid: String,
    pub model: String,
    pub xid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EccEventLabels {
    pub gpu: String,
    pub uuid: String,
    pub model: String,
    pub r#type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabels {
    pub field: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

/// What the collector encodes at scrape time.
#[derive(Debug, Default)]
struct Published {
    samples: Vec<GpuSample>,
    /// (index, uuid, model, health) of every GPU the evaluator tracks.
    gpus: Vec<(Option<u32>, String, String, Health)>,
    node: Health,
    findings: BTreeMap<(Rule, Severity), u64>,
    /// GPU UUID → containers holding it (kubelet pod-resources), empty when unknown.
    holders: Allocations,
}

/// GPU metric families. Create with [`GpuMetrics::register`], share behind an `Arc`.
#[derive(Debug)]
pub struct GpuMetrics {
    published: Arc<RwLock<Published>>,
    /// `spotguard_gpu_probe_up`: 1 while NVML answers.
    pub probe_up: Gauge,
    /// `spotguard_gpu_xid_errors_total{gpu,uuid,model,xid}`.
    pub xid: Family<XidLabels, Counter>,
    /// `spotguard_gpu_ecc_events_total{gpu,uuid,model,type}`.
    pub ecc_events: Family<EccEventLabels, Counter>,
    /// `spotguard_gpu_read_errors_total{field}`: readings that failed other than NotSupported.
    pub read_errors: Family<FieldLabels, Counter>,
    /// `spotguard_gpu_monitor_errors_total{error}`.
    pub errors: Family<ErrorLabels, Counter>,
}

impl GpuMetrics {
    /// Create the families and register them (and the readings collector) in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = GpuMetrics {
            published: Arc::new(RwLock::new(Published::default())),
            probe_up: Gauge::default(),
            xid: Family::default(),
            ecc_events: Family::default(),
            read_errors: Family::default(),
            errors: Family::default(),
        };
        registry.register(
            "spotguard_gpu_probe_up",
            "1 while NVML is initialised and answering, 0 otherwise",
            m.probe_up.clone(),
        );
        registry.register(
            "spotguard_gpu_xid_errors",
            "Critical XID errors reported by the driver, by XID code",
            m.xid.clone(),
        );
        registry.register(
            "spotguard_gpu_ecc_events",
            "Single-bit (corrected) and double-bit (uncorrected) ECC error events",
            m.ecc_events.clone(),
        );
        registry.register(
            "spotguard_gpu_read_errors",
            "GPU readings that failed for a reason other than not being supported",
            m.read_errors.clone(),
        );
        registry.register(
            "spotguard_gpu_monitor_errors",
            "Errors of the GPU monitor (NVML init, sampling, node conditions)",
            m.errors.clone(),
        );
        registry.register_collector(Box::new(GpuCollector(Arc::clone(&m.published))));
        m
    }

    /// Publish a successful sample and the state evaluated from it.
    pub fn observe(&self, samples: &[GpuSample], state: &HealthState) {
        self.probe_up.set(1);
        for s in samples {
            for e in &s.read_errors {
                self.read_errors
                    .get_or_create(&FieldLabels {
                        field: e.field.to_string(),
                    })
                    .inc();
            }
        }
        let mut p = self.write();
        p.samples = samples.to_vec();
        p.gpus = state
            .gpus
            .iter()
            .map(|(uuid, t)| (t.index, uuid.clone(), t.model.clone(), t.health))
            .collect();
        p.node = state.node;
        p.findings = BTreeMap::new();
        for f in &state.findings {
            *p.findings.entry((f.rule, f.severity)).or_insert(0) += 1;
        }
    }

    /// NVML is down: no readings, every known GPU and the node unknown. Findings stay (they are
    /// sticky and still on the node).
    pub fn probe_down(&self, state: &HealthState) {
        self.probe_up.set(0);
        let mut p = self.write();
        p.samples.clear();
        p.gpus = state
            .gpus
            .iter()
            .map(|(uuid, t)| (t.index, uuid.clone(), t.model.clone(), Health::Unknown))
            .collect();
        p.node = Health::Unknown;
    }

    /// Count XID and ECC events. GPU index and model come from the event or the state.
    pub fn record_events(&self, events: &[GpuEvent], state: &HealthState) {
        for e in events {
            let track = state.gpus.get(&e.uuid);
            let gpu = e
                .index
                .or_else(|| track.and_then(|t| t.index))
                .map(|i| i.to_string())
                .unwrap_or_default();
            let model = track.map(|t| t.model.clone()).unwrap_or_default();
            match e.kind {
                GpuEventKind::Xid(code) => self
                    .xid
                    .get_or_create(&XidLabels {
                        gpu,
                        uuid: e.uuid.clone(),
                        model,
                        xid: code.to_string(),
                    })
                    .inc(),
                GpuEventKind::SingleBitEcc | GpuEventKind::DoubleBitEcc => {
                    let kind = if e.kind == GpuEventKind::SingleBitEcc {
                        "corrected"
                    } else {
                        "uncorrected"
                    };
                    self.ecc_events
                        .get_or_create(&EccEventLabels {
                            gpu,
                            uuid: e.uuid.clone(),
                            model,
                            r#type: kind.to_string(),
                        })
                        .inc()
                }
            };
        }
    }

    /// Which container holds which GPU (empty: unknown or none). A GPU held by exactly one
    /// container gets `pod`, `namespace` and `container` labels on its readings;
    /// `spotguard_gpu_allocation` lists every holder.
    pub fn set_holders(&self, holders: Allocations) {
        self.write().holders = holders;
    }

    /// Count a monitor error by its label.
    pub fn error(&self, label: &str) {
        self.errors
            .get_or_create(&ErrorLabels {
                error: label.to_string(),
            })
            .inc();
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Published> {
        self.published.write().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug)]
struct GpuCollector(Arc<RwLock<Published>>);

type Labels = Vec<(&'static str, String)>;

#[derive(Clone, Copy)]
enum Value {
    Int(i64),
    Float(f64),
    Counter(u64),
    FloatCounter(f64),
}

struct Series {
    name: &'static str,
    help: &'static str,
    counter: bool,
    points: Vec<(Labels, Value)>,
}

impl Series {
    fn gauge(name: &'static str, help: &'static str) -> Self {
        Series {
            name,
            help,
            counter: false,
            points: Vec::new(),
        }
    }

    fn counter(name: &'static str, help: &'static str) -> Self {
        Series {
            name,
            help,
            counter: true,
            points: Vec::new(),
        }
    }

    fn push(&mut self, labels: Labels, value: Value) {
        self.points.push((labels, value));
    }
}

fn gpu_labels(index: Option<u32>, uuid: &str, model: &str) -> Labels {
    vec![
        ("gpu", index.map(|i| i.to_string()).unwrap_or_default()),
        ("uuid", uuid.to_string()),
        ("model", model.to_string()),
    ]
}

fn with(mut labels: Labels, extra: &[(&'static str, &str)]) -> Labels {
    labels.extend(extra.iter().map(|(k, v)| (*k, (*v).to_string())));
    labels
}

fn flag(b: bool) -> Value {
    Value::Int(i64::from(b))
}

fn int(n: u64) -> Value {
    Value::Int(i64::try_from(n).unwrap_or(i64::MAX))
}

impl Published {
    /// Labels of one GPU's series: `gpu`, `uuid`, `model`, plus `pod`, `namespace`,
    /// `container` when exactly one container holds it.
    fn labels(&self, index: Option<u32>, uuid: &str, model: &str) -> Labels {
        let mut l = gpu_labels(index, uuid, model);
        if let Some([holder]) = self.holders.get(uuid).map(Vec::as_slice) {
            l.push(("pod", holder.pod.clone()));
            l.push(("namespace", holder.namespace.clone()));
            l.push(("container", holder.container.clone()));
        }
        l
    }

    fn series(&self) -> Vec<Series> {
        let mut temp = Series::gauge("spotguard_gpu_temperature_celsius", "GPU die temperature");
        let mut power = Series::gauge("spotguard_gpu_power_watts", "GPU power draw");
        let mut limit = Series::gauge(
            "spotguard_gpu_power_limit_watts",
            "Enforced GPU power limit",
        );
        let mut util = Series::gauge(
            "spotguard_gpu_utilization_ratio",
            "Fraction of the last sample period a kernel was running",
        );
        let mut mem_util = Series::gauge(
            "spotguard_gpu_memory_utilization_ratio",
            "Fraction of the last sample period device memory was read or written",
        );
        let mut mem_used =
            Series::gauge("spotguard_gpu_memory_used_bytes", "Allocated device memory");
        let mut mem_total = Series::gauge(
            "spotguard_gpu_memory_total_bytes",
            "Installed device memory",
        );
        let mut ecc_mode = Series::gauge("spotguard_gpu_ecc_enabled", "1 when ECC mode is enabled");
        let mut ecc = Series::counter(
            "spotguard_gpu_ecc_errors",
            "ECC errors as counted by NVML (volatile: since driver load; aggregate: board lifetime)",
        );
        let mut retired = Series::gauge(
            "spotguard_gpu_retired_pages",
            "Retired device memory pages by cause (pre-Ampere)",
        );
        let mut retired_pending = Series::gauge(
            "spotguard_gpu_retired_pages_pending",
            "1 when pages wait for a reboot to be retired (pre-Ampere)",
        );
        let mut remapped = Series::gauge(
            "spotguard_gpu_remapped_rows",
            "Remapped memory rows by error type (Ampere and later)",
        );
        let mut remap_pending = Series::gauge(
            "spotguard_gpu_remap_pending",
            "1 when a row remap is pending (GPU reset required)",
        );
        let mut remap_failure = Series::gauge(
            "spotguard_gpu_remap_failure",
            "1 when a row remap failed (GPU needs service)",
        );
        let mut recovery = Series::gauge(
            "spotguard_gpu_recovery_action",
            "Driver recovery action: 0 none, 1 reset, 2 reboot, 3 drain_p2p, 4 drain_and_reset",
        );
        let mut reasons = Series::gauge(
            "spotguard_gpu_clocks_event_reasons",
            "1 when this clocks-event (throttle) reason is active",
        );
        let mut pcie = Series::counter(
            "spotguard_gpu_pcie_replay",
            "PCIe replays as counted by NVML",
        );
        let mut energy = Series::counter(
            "spotguard_gpu_energy_joules",
            "Energy consumed since the driver was loaded",
        );
        let mut nvlink_errors = Series::counter(
            "spotguard_gpu_nvlink_errors",
            "NVLink data-link errors as counted by NVML, by link and counter",
        );
        let mut nvlink_up = Series::gauge(
            "spotguard_gpu_nvlink_up",
            "1 when the NVLink link is active",
        );
        let mut lost = Series::gauge("spotguard_gpu_lost", "1 when NVML reports the GPU lost");

        for s in &self.samples {
            let l = self.labels(Some(s.index), &s.uuid, &s.model);
            lost.push(l.clone(), flag(s.lost));
            if let Some(v) = s.temperature_celsius {
                temp.push(l.clone(), Value::Int(i64::from(v)));
            }
            if let Some(v) = s.power_watts {
                power.push(l.clone(), Value::Float(v));
            }
            if let Some(v) = s.power_limit_watts {
                limit.push(l.clone(), Value::Float(v));
            }
            if let Some(v) = s.utilization_gpu {
                util.push(l.clone(), Value::Float(v));
            }
            if let Some(v) = s.utilization_memory {
                mem_util.push(l.clone(), Value::Float(v));
            }
            if let Some(v) = s.memory_used_bytes {
                mem_used.push(l.clone(), int(v));
            }
            if let Some(v) = s.memory_total_bytes {
                mem_total.push(l.clone(), int(v));
            }
            if let Some(v) = s.ecc_enabled {
                ecc_mode.push(l.clone(), flag(v));
            }
            for (kind, counter, v) in [
                ("corrected", "volatile", s.ecc_corrected_volatile),
                ("uncorrected", "volatile", s.ecc_uncorrected_volatile),
                ("corrected", "aggregate", s.ecc_corrected_aggregate),
                ("uncorrected", "aggregate", s.ecc_uncorrected_aggregate),
            ] {
                if let Some(v) = v {
                    ecc.push(
                        with(l.clone(), &[("type", kind), ("counter", counter)]),
                        Value::Counter(v),
                    );
                }
            }
            for (cause, v) in [
                ("single_bit_ecc", s.retired_pages_single_bit),
                ("double_bit_ecc", s.retired_pages_double_bit),
            ] {
                if let Some(v) = v {
                    retired.push(with(l.clone(), &[("cause", cause)]), int(v));
                }
            }
            if let Some(v) = s.retired_pages_pending {
                retired_pending.push(l.clone(), flag(v));
            }
            for (kind, v) in [
                ("correctable", s.remapped_rows_correctable),
                ("uncorrectable", s.remapped_rows_uncorrectable),
            ] {
                if let Some(v) = v {
                    remapped.push(with(l.clone(), &[("type", kind)]), int(v));
                }
            }
            if let Some(v) = s.remap_pending {
                remap_pending.push(l.clone(), flag(v));
            }
            if let Some(v) = s.remap_failure {
                remap_failure.push(l.clone(), flag(v));
            }
            if let Some(v) = s.recovery_action {
                recovery.push(l.clone(), int(v.as_nvml()));
            }
            if let Some(bits) = s.clocks_event_reasons {
                for (bit, name) in CLOCK_EVENT_REASONS {
                    reasons.push(with(l.clone(), &[("reason", name)]), flag(bits & bit != 0));
                }
            }
            if let Some(v) = s.pcie_replay {
                pcie.push(l.clone(), Value::Counter(v));
            }
            if let Some(v) = s.energy_millijoules {
                energy.push(l.clone(), Value::FloatCounter(v as f64 / 1000.0));
            }
            for link in &s.nvlinks {
                let id = link.link.to_string();
                if let Some(up) = link.up {
                    nvlink_up.push(with(l.clone(), &[("link", &id)]), flag(up));
                }
                for (counter, v) in [
                    ("crc_flit", link.crc_flit),
                    ("crc_data", link.crc_data),
                    ("replay", link.replay),
                    ("recovery", link.recovery),
                ] {
                    if let Some(v) = v {
                        nvlink_errors.push(
                            with(l.clone(), &[("link", &id), ("counter", counter)]),
                            Value::Counter(v),
                        );
                    }
                }
            }
        }

        let mut health = Series::gauge(
            "spotguard_gpu_health",
            "1 for the current health state of the GPU (healthy, degraded, unhealthy, unknown)",
        );
        for (index, uuid, model, h) in &self.gpus {
            for state in Health::ALL {
                health.push(
                    with(
                        self.labels(*index, uuid, model),
                        &[("state", state.as_str())],
                    ),
                    flag(*h == state),
                );
            }
        }
        let mut allocation = Series::gauge(
            "spotguard_gpu_allocation",
            "1 for each container holding the GPU (kubelet pod-resources API)",
        );
        for (index, uuid, model, _) in &self.gpus {
            for h in self.holders.get(uuid).into_iter().flatten() {
                allocation.push(
                    with(
                        gpu_labels(*index, uuid, model),
                        &[
                            ("pod", &h.pod),
                            ("namespace", &h.namespace),
                            ("container", &h.container),
                        ],
                    ),
                    Value::Int(1),
                );
            }
        }
        let mut node = Series::gauge(
            "spotguard_node_gpu_health",
            "1 for the current GPU health state of the node (worst GPU)",
        );
        for state in Health::ALL {
            node.push(
                vec![("state", state.as_str().to_string())],
                flag(self.node == state),
            );
        }
        let mut findings = Series::gauge(
            "spotguard_gpu_findings",
            "Active GPU findings by rule and severity",
        );
        for ((rule, severity), n) in &self.findings {
            findings.push(
                vec![
                    ("rule", rule.as_str().to_string()),
                    ("severity", severity.as_str().to_string()),
                ],
                int(*n),
            );
        }

        vec![
            temp,
            power,
            limit,
            util,
            mem_util,
            mem_used,
            mem_total,
            ecc_mode,
            ecc,
            retired,
            retired_pending,
            remapped,
            remap_pending,
            remap_failure,
            recovery,
            reasons,
            pcie,
            energy,
            nvlink_errors,
            nvlink_up,
            lost,
            health,
            allocation,
            node,
            findings,
        ]
    }
}

impl Collector for GpuCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let published = self.0.read().unwrap_or_else(|p| p.into_inner());
        for series in published.series() {
            if series.points.is_empty() {
                continue;
            }
            let metric_type = if series.counter {
                MetricType::Counter
            } else {
                MetricType::Gauge
            };
            // Same HELP style as registered metrics (the registry appends a full stop).
            let help = format!("{}.", series.help);
            let mut family = encoder.encode_descriptor(series.name, &help, None, metric_type)?;
            for (labels, value) in &series.points {
                let metric = family.encode_family(labels)?;
                match *value {
                    Value::Int(v) => ConstGauge::new(v).encode(metric)?,
                    Value::Float(v) => ConstGauge::new(v).encode(metric)?,
                    Value::Counter(v) => ConstCounter::new(v).encode(metric)?,
                    Value::FloatCounter(v) => ConstCounter::new(v).encode(metric)?,
                }
            }
        }
        Ok(())
    }
}
