//! [`NvmlProbe`]: the production [`GpuProbe`] over `nvml-wrapper`.
//!
//! `Nvml::init()` dlopens `libnvidia-ml.so.1` at runtime, so the binary runs on machines without
//! a driver; a failure is a typed [`Error`] saying which (library missing, driver not loaded,
//! version mismatch, no permission). NVML is initialised once and kept. XID and ECC events come
//! from an NVML event set waited on in a thread of its own with `wait(5000)` (not the crate's
//! 1 ms polling loop) and are handed over through a bounded channel.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jiff::Timestamp;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    EccCounter, MemoryError, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, NVML_FI_DEV_NVLINK_LINK_COUNT, NVML_FI_DEV_REMAPPED_COR,
    NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING, NVML_FI_DEV_REMAPPED_UNC,
};
use nvml_wrapper::{Device, EventSet, Nvml};

use super::{
    Error, GpuEvent, GpuEventKind, GpuProbe, GpuSample, NvLinkSample, ReadError, RecoveryAction,
};

/// The library `Nvml::init()` loads.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";
/// Event-set wait timeout (ms): the event thread checks for shutdown this often.
const EVENT_WAIT_MS: u32 = 5000;
/// Events buffered between two samples before new ones are dropped (and logged).
const EVENT_BUFFER: usize = 4096;
/// NVML's maximum number of NVLink links per GPU (`NVML_NVLINK_MAX_LINKS`).
const MAX_NVLINKS: u32 = 18;
/// How long `init` waits for the event thread to report its registration.
const EVENT_SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// NVML-backed probe. Either initialised at construction ([`NvmlProbe::new`], for the CLI and
/// the smoke test) or on first use and again on every later call until it succeeds
/// ([`NvmlProbe::deferred`], for the daemon: the monitor owns the backoff).
pub struct NvmlProbe {
    library: Option<PathBuf>,
    loaded: Mutex<Option<Loaded>>,
}

struct Loaded {
    nvml: Arc<Nvml>,
    driver_version: Option<String>,
    events: Receiver<GpuEvent>,
    stop: Arc<AtomicBool>,
    /// Devices the event set covers (UUIDs).
    events_registered: Vec<String>,
    /// index → (uuid, model) as last read, for devices that answer GPU_IS_LOST.
    known: BTreeMap<u32, (String, String)>,
    /// uuid → NVLink link ids (discovered on first sample of that GPU).
    links: BTreeMap<String, Vec<u32>>,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // The event thread holds its own Arc<Nvml>; it sees this within one wait and exits.
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for NvmlProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlProbe")
            .field("library", &self.library_name())
            .finish_non_exhaustive()
    }
}

impl NvmlProbe {
    /// Initialise NVML from `libnvidia-ml.so.1` now.
    pub fn new() -> Result<Self, Error> {
        let probe = Self::deferred();
        drop(probe.lock_loaded()?);
        Ok(probe)
    }

    /// Initialise NVML from a specific library file now.
    pub fn with_library(path: impl Into<PathBuf>) -> Result<Self, Error> {
        let probe = Self::deferred_with_library(path);
        drop(probe.lock_loaded()?);
        Ok(probe)
    }

    /// A probe that initialises NVML on first use (and retries on every later use until it
    /// works).
    pub fn deferred() -> Self {
        NvmlProbe {
            library: None,
            loaded: Mutex::new(None),
        }
    }

    pub fn deferred_with_library(path: impl Into<PathBuf>) -> Self {
        NvmlProbe {
            library: Some(path.into()),
            loaded: Mutex::new(None),
        }
    }

    /// UUIDs of the GPUs whose XID/ECC events are being received (empty before init or when no
    /// GPU supports events).
    pub fn events_registered(&self) -> Vec<String> {
        self.lock()
            .as_ref()
            .map(|l| l.events_registered.clone())
            .unwrap_or_default()
    }

    fn library_name(&self) -> String {
        self.library
            .as_ref()
            .map_or_else(|| DEFAULT_LIBRARY.to_string(), |p| p.display().to_string())
    }

    fn lock(&self) -> MutexGuard<'_, Option<Loaded>> {
        // A panic while sampling leaves nothing half-written that matters: keep going.
        crate::sync::lock(&self.loaded)
    }

    fn lock_loaded(&self) -> Result<MutexGuard<'_, Option<Loaded>>, Error> {
        let mut guard = self.lock();
        if guard.is_none() {
            *guard = Some(Loaded::init(self.library.as_ref(), &self.library_name())?);
        }
        Ok(guard)
    }
}

impl GpuProbe for NvmlProbe {
    fn sample(&self) -> Result<Vec<GpuSample>, Error> {
        let mut guard = self.lock_loaded()?;
        match guard.as_mut() {
            Some(loaded) => loaded.sample(),
            None => Err(Error::SampleTask {
                detail: "NVML state missing after initialisation".into(),
            }),
        }
    }

    fn drain_events(&self) -> Vec<GpuEvent> {
        self.lock()
            .as_ref()
            .map(|l| l.events.try_iter().collect())
            .unwrap_or_default()
    }

    fn driver_version(&self) -> Option<String> {
        self.lock().as_ref().and_then(|l| l.driver_version.clone())
    }
}

/// Map an `Nvml::init` failure to what the operator must fix.
fn init_error(e: NvmlError, library: &str) -> Error {
    match e {
        NvmlError::LibloadingError(err) => Error::LoadLibrary {
            library: library.to_string(),
            detail: err.to_string(),
        },
        NvmlError::FailedToLoadSymbol(symbol) => Error::LoadLibrary {
            library: library.to_string(),
            detail: format!("library too old: {symbol}"),
        },
        NvmlError::LibraryNotFound => Error::LoadLibrary {
            library: library.to_string(),
            detail: "not found".into(),
        },
        NvmlError::DriverNotLoaded => Error::DriverNotLoaded,
        NvmlError::LibRmVersionMismatch => Error::DriverVersionMismatch,
        NvmlError::NoPermission => Error::NoPermission,
        other => Error::InitNvml { source: other },
    }
}

impl Loaded {
    fn init(library: Option<&PathBuf>, library_name: &str) -> Result<Loaded, Error> {
        let nvml = match library {
            Some(path) => Nvml::builder().lib_path(path.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(|e| init_error(e, library_name))?;
        let nvml = Arc::new(nvml);
        let driver_version = nvml.sys_driver_version().ok();
        let count = nvml
            .device_count()
            .map_err(|source| Error::CountDevices { source })?;
        let mut known = BTreeMap::new();
        for index in 0..count {
            if let Ok(device) = nvml.device_by_index(index) {
                if let Ok(uuid) = device.uuid() {
                    let model = device.name().unwrap_or_default();
                    known.insert(index, (uuid, model));
                }
            }
        }

        let (tx, rx) = mpsc::sync_channel(EVENT_BUFFER);
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel();
        let devices: Vec<(u32, String)> = known
            .iter()
            .map(|(i, (uuid, _))| (*i, uuid.clone()))
            .collect();
        let thread = {
            let nvml = Arc::clone(&nvml);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("spotguard-nvml-events".into())
                .spawn(move || event_thread(&nvml, &devices, &tx, &stop, ready_tx))
        };
        let events_registered = match thread {
            Err(e) => {
                tracing::warn!(error = %e, "could not start the NVML event thread; XID events will not be seen");
                Vec::new()
            }
            Ok(_) => match ready_rx.recv_timeout(EVENT_SETUP_TIMEOUT) {
                Ok(Ok(uuids)) => {
                    tracing::info!(gpus = uuids.len(), "NVML XID/ECC events registered");
                    uuids
                }
                Ok(Err(reason)) => {
                    tracing::warn!(%reason, "NVML events unavailable; XID events will not be seen (readings still are)");
                    Vec::new()
                }
                Err(e) => {
                    tracing::warn!(error = %e, "NVML event registration did not complete; XID events may be missed");
                    Vec::new()
                }
            },
        };
        tracing::info!(
            gpus = count,
            driver = driver_version.as_deref().unwrap_or("unknown"),
            "NVML initialised"
        );
        Ok(Loaded {
            nvml,
            driver_version,
            events: rx,
            stop,
            events_registered,
            known,
            links: BTreeMap::new(),
        })
    }

    fn sample(&mut self) -> Result<Vec<GpuSample>, Error> {
        let nvml = Arc::clone(&self.nvml);
        let count = nvml
            .device_count()
            .map_err(|source| Error::CountDevices { source })?;
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            match nvml.device_by_index(index) {
                Ok(device) => {
                    let sample = self.read_device(index, &device);
                    if !sample.lost && !sample.uuid.is_empty() {
                        self.known
                            .insert(index, (sample.uuid.clone(), sample.model.clone()));
                    }
                    out.push(sample);
                }
                Err(NvmlError::GpuLost) => out.push(GpuSample {
                    lost: true,
                    ..self.unread(index)
                }),
                // Counted by NVML but not ours to read (e.g. not visible in this container).
                Err(NvmlError::NoPermission) => {
                    tracing::debug!(index, "no permission to open GPU; skipped");
                }
                Err(e) => out.push(GpuSample {
                    read_errors: vec![ReadError {
                        field: "device",
                        error: e.to_string(),
                    }],
                    ..self.unread(index)
                }),
            }
        }
        Ok(out)
    }

    /// UUID and model of an index that cannot be read now (last known, or a placeholder).
    fn identity(&self, index: u32) -> (String, String) {
        self.known
            .get(&index)
            .cloned()
            .unwrap_or_else(|| (format!("unknown-gpu-{index}"), String::new()))
    }

    /// The sample of a GPU whose device cannot be opened: its identity only.
    fn unread(&self, index: u32) -> GpuSample {
        let (uuid, model) = self.identity(index);
        GpuSample {
            uuid,
            index,
            model,
            ..GpuSample::default()
        }
    }

    fn read_device(&mut self, index: u32, d: &Device<'_>) -> GpuSample {
        let mut r = Reader::default();
        let (known_uuid, known_model) = self.identity(index);
        let uuid = r.get("uuid", || d.uuid()).unwrap_or(known_uuid);
        let model = r.get("name", || d.name()).unwrap_or(known_model);
        let mut s = GpuSample {
            uuid,
            index,
            model,
            ..GpuSample::default()
        };
        s.temperature_celsius = r.get("temperature", || d.temperature(TemperatureSensor::Gpu));
        s.power_watts = r.get("power_usage", || d.power_usage()).map(milliwatts);
        s.power_limit_watts = r
            .get("power_limit", || d.enforced_power_limit())
            .map(milliwatts);
        if let Some(u) = r.get("utilization", || d.utilization_rates()) {
            s.utilization_gpu = Some(f64::from(u.gpu.min(100)) / 100.0);
            s.utilization_memory = Some(f64::from(u.memory.min(100)) / 100.0);
        }
        if let Some(m) = r.get("memory_info", || d.memory_info()) {
            s.memory_used_bytes = Some(m.used);
            s.memory_total_bytes = Some(m.total);
        }
        s.ecc_enabled = r
            .get("ecc_mode", || d.is_ecc_enabled())
            .map(|m| m.currently_enabled);
        s.ecc_corrected_volatile = r.get("ecc_corrected_volatile", || {
            d.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
        });
        s.ecc_uncorrected_volatile = r.get("ecc_uncorrected_volatile", || {
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
        });
        s.ecc_corrected_aggregate = r.get("ecc_corrected_aggregate", || {
            d.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
        });
        s.ecc_uncorrected_aggregate = r.get("ecc_uncorrected_aggregate", || {
            d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Aggregate)
        });
        s.retired_pages_single_bit = r
            .get("retired_pages_single_bit", || {
                d.retired_pages(RetirementCause::MultipleSingleBitEccErrors)
            })
            .map(|p| p.len() as u64);
        s.retired_pages_double_bit = r
            .get("retired_pages_double_bit", || {
                d.retired_pages(RetirementCause::DoubleBitEccError)
            })
            .map(|p| p.len() as u64);
        s.retired_pages_pending = r.get("retired_pages_pending", || d.are_pages_pending_retired());
        s.clocks_event_reasons = r
            .get("clocks_event_reasons", || d.current_throttle_reasons())
            .map(|reasons| reasons.bits());
        s.pcie_replay = r
            .get("pcie_replay", || d.pcie_replay_counter())
            .map(u64::from);
        s.energy_millijoules = r.get("energy", || d.total_energy_consumption());

        // Remapped rows (no safe wrapper: fields 142–145), recovery action (230), link count.
        let ids = [
            FieldId(NVML_FI_DEV_REMAPPED_COR),
            FieldId(NVML_FI_DEV_REMAPPED_UNC),
            FieldId(NVML_FI_DEV_REMAPPED_PENDING),
            FieldId(NVML_FI_DEV_REMAPPED_FAILURE),
            FieldId(NVML_FI_DEV_GET_GPU_RECOVERY_ACTION),
            FieldId(NVML_FI_DEV_NVLINK_LINK_COUNT),
        ];
        let mut link_count = None;
        if let Some(values) = r.get("field_values", || d.field_values_for(&ids)) {
            for (id, value) in ids.iter().zip(values) {
                let name = field_name(id.0);
                let value = match value {
                    Ok(sample) => sample.value,
                    Err(e) => Err(e),
                };
                let Some(v) = r.get(name, || value).and_then(sample_u64) else {
                    continue;
                };
                match id.0 {
                    NVML_FI_DEV_REMAPPED_COR => s.remapped_rows_correctable = Some(v),
                    NVML_FI_DEV_REMAPPED_UNC => s.remapped_rows_uncorrectable = Some(v),
                    NVML_FI_DEV_REMAPPED_PENDING => s.remap_pending = Some(v != 0),
                    NVML_FI_DEV_REMAPPED_FAILURE => s.remap_failure = Some(v != 0),
                    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION => match RecoveryAction::from_nvml(v) {
                        Some(a) => s.recovery_action = Some(a),
                        None => r.errors.push(ReadError {
                            field: name,
                            error: format!("unknown recovery action {v}"),
                        }),
                    },
                    _ => link_count = Some(v),
                }
            }
        }

        if !r.lost {
            let links = match self.links.get(&s.uuid) {
                Some(links) => links.clone(),
                None => {
                    let links = discover_links(d, link_count);
                    self.links.insert(s.uuid.clone(), links.clone());
                    links
                }
            };
            for link in links {
                let l = d.link_wrapper_for(link);
                s.nvlinks.push(NvLinkSample {
                    link,
                    up: r.get("nvlink_state", || l.is_active()),
                    crc_flit: r.get("nvlink_crc_flit", || {
                        l.error_counter(ErrorCounter::DlCrcFlit)
                    }),
                    crc_data: r.get("nvlink_crc_data", || {
                        l.error_counter(ErrorCounter::DlCrcData)
                    }),
                    replay: r.get("nvlink_replay", || l.error_counter(ErrorCounter::DlReplay)),
                    recovery: r.get("nvlink_recovery", || {
                        l.error_counter(ErrorCounter::DlRecovery)
                    }),
                });
            }
        }
        s.lost = r.lost;
        s.read_errors = r.errors;
        if s.lost {
            // Whatever was read before the GPU went away is not a reading of a working GPU.
            s = GpuSample {
                uuid: s.uuid,
                index,
                model: s.model,
                lost: true,
                ..GpuSample::default()
            };
        }
        s
    }
}

/// NVLink links of a device: the link count field when the driver gives it, else every link
/// id NVML answers for.
fn discover_links(d: &Device<'_>, link_count: Option<u64>) -> Vec<u32> {
    match link_count {
        Some(n) => (0..MAX_NVLINKS.min(u32::try_from(n).unwrap_or(MAX_NVLINKS))).collect(),
        None => (0..MAX_NVLINKS)
            .filter(|link| d.link_wrapper_for(*link).is_active().is_ok())
            .collect(),
    }
}

fn field_name(id: u32) -> &'static str {
    match id {
        NVML_FI_DEV_REMAPPED_COR => "remapped_rows_correctable",
        NVML_FI_DEV_REMAPPED_UNC => "remapped_rows_uncorrectable",
        NVML_FI_DEV_REMAPPED_PENDING => "remap_pending",
        NVML_FI_DEV_REMAPPED_FAILURE => "remap_failure",
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION => "recovery_action",
        NVML_FI_DEV_NVLINK_LINK_COUNT => "nvlink_link_count",
        _ => "field_value",
    }
}

fn sample_u64(v: SampleValue) -> Option<u64> {
    match v {
        SampleValue::U32(n) => Some(u64::from(n)),
        SampleValue::U64(n) => Some(n),
        SampleValue::I64(n) => u64::try_from(n).ok(),
        SampleValue::F64(f) if f.is_finite() && f >= 0.0 => Some(f.round() as u64),
        SampleValue::F64(_) => None,
    }
}

fn milliwatts(mw: u32) -> f64 {
    f64::from(mw) / 1000.0
}

/// Reads one value at a time: NotSupported (and friends) ⇒ `None`; GPU lost ⇒ `None` and every
/// later read skipped; any other error ⇒ `None` and recorded.
#[derive(Default)]
struct Reader {
    lost: bool,
    errors: Vec<ReadError>,
}

impl Reader {
    fn get<T>(
        &mut self,
        field: &'static str,
        read: impl FnOnce() -> Result<T, NvmlError>,
    ) -> Option<T> {
        if self.lost {
            return None;
        }
        match read() {
            Ok(v) => Some(v),
            Err(e) => {
                self.absorb(field, e);
                None
            }
        }
    }

    fn absorb(&mut self, field: &'static str, e: NvmlError) {
        match e {
            // Not available on this GPU / driver: absent, not an error.
            NvmlError::NotSupported
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_)
            | NvmlError::NoData => {}
            NvmlError::GpuLost => self.lost = true,
            other => self.errors.push(ReadError {
                field,
                error: other.to_string(),
            }),
        }
    }
}

// === event thread ===

fn event_thread(
    nvml: &Nvml,
    devices: &[(u32, String)],
    tx: &SyncSender<GpuEvent>,
    stop: &AtomicBool,
    ready: mpsc::Sender<Result<Vec<String>, String>>,
) {
    let set = match register_events(nvml, devices) {
        Ok((set, uuids)) => {
            let _ = ready.send(Ok(uuids));
            set
        }
        Err(reason) => {
            let _ = ready.send(Err(reason));
            return;
        }
    };
    let mut last_error: Option<String> = None;
    let mut dropped: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        match set.wait(EVENT_WAIT_MS) {
            Ok(data) => {
                last_error = None;
                let Some(event) = to_event(&data, devices) else {
                    continue;
                };
                match tx.try_send(event) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => {
                        dropped += 1;
                        if dropped % 1000 == 1 {
                            tracing::warn!(dropped, "GPU event buffer full; events dropped");
                        }
                    }
                    Err(TrySendError::Disconnected(_)) => return,
                }
            }
            Err(NvmlError::Timeout) => {}
            Err(e) => {
                // GPU_IS_LOST and friends come back at once on every call: slow down. The
                // sampler records which GPU is lost.
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "waiting for NVML events failed");
                    last_error = Some(text);
                }
                std::thread::sleep(Duration::from_millis(u64::from(EVENT_WAIT_MS)));
            }
        }
    }
}

/// Register XID (and, where supported, ECC) events for every device. `register_events` frees
/// the set when it fails, so a device that refuses is dropped and the set rebuilt.
fn register_events<'n>(
    nvml: &'n Nvml,
    devices: &[(u32, String)],
) -> Result<(EventSet<'n>, Vec<String>), String> {
    let wanted = EventTypes::CRITICAL_XID_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR;
    let mut plan: Vec<(u32, String, EventTypes)> = Vec::new();
    for (index, uuid) in devices {
        let supported = nvml
            .device_by_index(*index)
            .and_then(|d| d.supported_event_types());
        match supported {
            Ok(types) if !(types & wanted).is_empty() => {
                plan.push((*index, uuid.clone(), types & wanted))
            }
            Ok(_) => tracing::info!(gpu = index, %uuid, "GPU supports no XID/ECC events"),
            Err(e) => {
                tracing::warn!(gpu = index, %uuid, error = %e, "cannot query GPU event support")
            }
        }
    }
    loop {
        if plan.is_empty() {
            return Err("no GPU supports XID/ECC events".into());
        }
        let mut set = Some(
            nvml.create_event_set()
                .map_err(|e| format!("creating NVML event set: {e}"))?,
        );
        let mut failed: Option<(usize, String)> = None;
        for (pos, (index, _, types)) in plan.iter().enumerate() {
            let (Ok(device), Some(s)) = (nvml.device_by_index(*index), set.take()) else {
                failed = Some((pos, "cannot open device".into()));
                break;
            };
            match device.register_events(*types, s) {
                Ok(s) => set = Some(s),
                Err(e) => {
                    failed = Some((pos, e.to_string()));
                    break;
                }
            }
        }
        match (failed, set) {
            (None, Some(set)) => {
                return Ok((set, plan.into_iter().map(|(_, uuid, _)| uuid).collect()))
            }
            (Some((pos, error)), _) => {
                let (index, uuid, _) = plan.remove(pos);
                tracing::warn!(gpu = index, %uuid, %error, "registering GPU events failed; continuing without this GPU's events");
            }
            (None, None) => return Err("NVML event set lost during registration".into()),
        }
    }
}

fn to_event(data: &EventData<'_>, devices: &[(u32, String)]) -> Option<GpuEvent> {
    let kind = if data.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        GpuEventKind::Xid(match data.event_data {
            Some(XidError::Value(v)) => v,
            Some(XidError::Unknown) | None => 999,
        })
    } else if data.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        GpuEventKind::DoubleBitEcc
    } else if data.event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
        GpuEventKind::SingleBitEcc
    } else {
        return None;
    };
    let index = data.device.index().ok();
    let uuid = data
        .device
        .uuid()
        .ok()
        .or_else(|| {
            index.and_then(|i| {
                devices
                    .iter()
                    .find(|(j, _)| *j == i)
                    .map(|(_, u)| u.clone())
            })
        })
        .unwrap_or_else(|| "unknown".to_string());
    Some(GpuEvent {
        uuid,
        index,
        at: Timestamp::now(),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use nvml_wrapper::bitmasks::device::ThrottleReasons;

    use super::*;
    use crate::gpu::CLOCK_EVENT_REASONS;

    #[test]
    fn clock_event_bits_match_nvml() {
        let expect = [
            (ThrottleReasons::GPU_IDLE, "gpu_idle"),
            (
                ThrottleReasons::APPLICATIONS_CLOCKS_SETTING,
                "applications_clocks_setting",
            ),
            (ThrottleReasons::SW_POWER_CAP, "sw_power_cap"),
            (ThrottleReasons::HW_SLOWDOWN, "hw_slowdown"),
            (ThrottleReasons::SYNC_BOOST, "sync_boost"),
            (ThrottleReasons::SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
            (ThrottleReasons::HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
            (
                ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN,
                "hw_power_brake_slowdown",
            ),
            (
                ThrottleReasons::DISPLAY_CLOCK_SETTING,
                "display_clock_setting",
            ),
        ];
        assert_eq!(expect.len(), CLOCK_EVENT_REASONS.len());
        for ((flag, name), (bit, ours)) in expect.iter().zip(CLOCK_EVENT_REASONS) {
            assert_eq!(flag.bits(), *bit, "{name}");
            assert_eq!(name, ours);
        }
    }

    #[test]
    fn reader_tells_not_supported_from_errors_and_stops_on_lost() {
        let mut r = Reader::default();
        assert_eq!(r.get("a", || Ok::<u32, NvmlError>(7)), Some(7));
        assert_eq!(r.get("b", || Err::<u32, _>(NvmlError::NotSupported)), None);
        assert!(r.errors.is_empty());
        assert_eq!(r.get("c", || Err::<u32, _>(NvmlError::Unknown)), None);
        assert_eq!(r.errors.len(), 1);
        assert_eq!(r.errors[0].field, "c");
        assert_eq!(r.get("d", || Err::<u32, _>(NvmlError::GpuLost)), None);
        assert!(r.lost);
        let mut called = false;
        assert_eq!(
            r.get("e", || {
                called = true;
                Ok::<u32, NvmlError>(1)
            }),
            None
        );
        assert!(!called, "no NVML call after the GPU is lost");
    }

    #[test]
    fn sample_values_convert_without_inventing_numbers() {
        assert_eq!(sample_u64(SampleValue::U32(3)), Some(3));
        assert_eq!(sample_u64(SampleValue::U64(1 << 40)), Some(1 << 40));
        assert_eq!(sample_u64(SampleValue::I64(-1)), None);
        assert_eq!(sample_u64(SampleValue::F64(f64::NAN)), None);
        assert_eq!(sample_u64(SampleValue::F64(2.0)), Some(2));
    }

    #[test]
    fn init_errors_say_what_to_fix() {
        assert!(matches!(
            init_error(NvmlError::DriverNotLoaded, DEFAULT_LIBRARY),
            Error::DriverNotLoaded
        ));
        assert!(matches!(
            init_error(NvmlError::LibRmVersionMismatch, DEFAULT_LIBRARY),
            Error::DriverVersionMismatch
        ));
        assert!(matches!(
            init_error(NvmlError::NoPermission, DEFAULT_LIBRARY),
            Error::NoPermission
        ));
        let e = init_error(NvmlError::Unknown, DEFAULT_LIBRARY);
        assert!(e.is_init() && e.metric_label() == "init_nvml");
    }

    #[test]
    fn a_library_that_is_not_there_is_a_load_error() {
        let err = NvmlProbe::with_library("/nonexistent/libnvidia-ml.so.1").expect_err("no NVML");
        assert!(matches!(err, Error::LoadLibrary { .. }), "{err:?}");
        assert!(err.is_init());
        assert!(
            err.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
            "{err}"
        );
    }

    #[test]
    fn a_file_that_is_not_a_library_is_a_load_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("libnvidia-ml.so.1");
        std::fs::write(&path, b"not an ELF file").expect("write");
        let probe = NvmlProbe::deferred_with_library(&path);
        let err = probe.sample().expect_err("not a library");
        assert_eq!(err.metric_label(), "load_library");
        // Deferred: it tries again on the next call (and fails the same way).
        assert_eq!(
            probe.sample().expect_err("again").metric_label(),
            "load_library"
        );
        assert!(probe.drain_events().is_empty());
        assert_eq!(probe.driver_version(), None);
        assert!(probe.events_registered().is_empty());
    }
}
