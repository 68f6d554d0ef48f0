//! [`GpuSource`] backed by NVML through `nvml-wrapper` (loads libnvidia-ml at run time).
//!
//! Without the library, `Nvml::init()` returns `LibloadingError(DlOpen…)` (not `LibraryNotFound`,
//! docs/design.md §12); both become [`GpuError::NvmlUnavailable`], whose message names libnvidia-ml.so and
//! suggests `--gpu-source mock:<scenario.yaml>`. `Nvml` is `Send + Sync`; a `Device` handle is
//! looked up per sample (cheap) so no lifetimes leak out: by index (`nvmlDeviceGetHandleByIndex`)
//! or by UUID (`nvmlDeviceGetHandleByUUID`, which takes `GPU-…` and, on MIG-capable drivers,
//! `MIG-…` UUIDs). NVML's `NotFound` becomes [`GpuError::NotFound`].

use super::{GpuError, GpuRef, GpuSample, GpuSource, gpu_name};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;

/// Real GPUs through NVML.
pub struct NvmlGpuSource {
    nvml: Nvml,
}

impl NvmlGpuSource {
    /// Loads and initialises NVML.
    pub fn new() -> Result<Self, GpuError> {
        Nvml::init().map(|nvml| Self { nvml }).map_err(|source| GpuError::NvmlUnavailable { source })
    }
}

impl GpuSource for NvmlGpuSource {
    fn sample(&self, gpu: &GpuRef, _engine_load: f64) -> Result<GpuSample, GpuError> {
        let q = |source: NvmlError| GpuError::Query { gpu: gpu_name(gpu), source };
        // The lookup's InvalidArg (index out of range, malformed UUID) and NotFound: no such GPU.
        let lookup = |source: NvmlError| match source {
            NvmlError::NotFound | NvmlError::InvalidArg => GpuError::NotFound { gpu: gpu_name(gpu) },
            source => q(source),
        };
        let dev = match gpu {
            GpuRef::Index(i) => self.nvml.device_by_index(*i),
            GpuRef::Uuid(u) => self.nvml.device_by_uuid(u.as_str()),
        }
        .map_err(lookup)?;
        let index = match gpu {
            GpuRef::Index(i) => *i,
            GpuRef::Uuid(_) => dev.index().map_err(q)?,
        };
        // ECC is unsupported on consumer GPUs: treat as zero rather than failing the sample.
        let ecc = |t, c| dev.total_ecc_errors(t, c).unwrap_or(0);
        let reasons = dev.current_throttle_reasons().unwrap_or(ThrottleReasons::empty());
        let util = dev.utilization_rates().map_err(q)?;
        let mem = dev.memory_info().map_err(q)?;
        Ok(GpuSample {
            index,
            ecc_corrected_volatile: ecc(MemoryError::Corrected, EccCounter::Volatile),
            ecc_uncorrected_volatile: ecc(MemoryError::Uncorrected, EccCounter::Volatile),
            ecc_corrected_aggregate: ecc(MemoryError::Corrected, EccCounter::Aggregate),
            ecc_uncorrected_aggregate: ecc(MemoryError::Uncorrected, EccCounter::Aggregate),
            temperature_c: dev.temperature(TemperatureSensor::Gpu).map_err(q)?,
            thermal_throttle: reasons
                .intersects(ThrottleReasons::HW_THERMAL_SLOWDOWN | ThrottleReasons::SW_THERMAL_SLOWDOWN),
            power_throttle: reasons
                .intersects(ThrottleReasons::SW_POWER_CAP | ThrottleReasons::HW_POWER_BRAKE_SLOWDOWN),
            utilization_gpu_pct: util.gpu,
            utilization_memory_pct: util.memory,
            memory_used_bytes: mem.used,
            memory_total_bytes: mem.total,
        })
    }
}
