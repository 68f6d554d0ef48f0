//! GPU telemetry (docs/design.md §7): the [`GpuSource`] role and its two strategies, real NVML
//! ([`nvml::NvmlGpuSource`]) and a scripted scenario ([`mock::MockGpuSource`]).
//!
//! GPUs are named by [`GpuRef`]: an NVML index (static engine lists) or a UUID (`GPU-…`, `MIG-…`,
//! what the kubelet's PodResources API lists for `nvidia.com/gpu` with the NVIDIA device plugin's
//! default id strategy, docs/design.md §14). A UUID the node does not have is
//! [`GpuError::NotFound`]; the engine reports it in its health reason.
//!
//! Concurrency: sources are `Send + Sync` and sampled from the engine tasks (blocking calls, a few
//! microseconds each for NVML); they hold no lock across awaits.

pub mod mock;
pub mod nvml;

use crate::config::GpuSourceSpec;
pub use kvroute_cluster::GpuRef;
use std::sync::Arc;

/// GPU telemetry errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// The NVML library could not be loaded or initialised.
    #[error(
        "cannot initialise NVML ({source}): libnvidia-ml.so is missing or unusable on this host. \
         Install the NVIDIA driver, or run without a GPU with --gpu-source mock:<scenario.yaml> \
         (e.g. mock:agent/scenarios/healthy.yaml)"
    )]
    NvmlUnavailable {
        /// NVML's own error.
        source: nvml_wrapper::error::NvmlError,
    },
    /// A query for one GPU failed.
    #[error("GPU {gpu}: {source}")]
    Query {
        /// The GPU (index or UUID).
        gpu: String,
        /// NVML's error.
        source: nvml_wrapper::error::NvmlError,
    },
    /// No GPU of this node has that index or UUID.
    #[error("GPU {gpu} not found on this node")]
    NotFound {
        /// The GPU (index or UUID) asked for.
        gpu: String,
    },
    /// The mock scenario file is unreadable or not a scenario.
    #[error(transparent)]
    Scenario(#[from] kvroute_common::config::YamlFileError),
}

/// One GPU's state at one instant.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GpuSample {
    /// GPU index on the node (NVML order).
    pub index: u32,
    /// Corrected ECC errors since the driver loaded (count).
    pub ecc_corrected_volatile: u64,
    /// Uncorrected ECC errors since the driver loaded (count).
    pub ecc_uncorrected_volatile: u64,
    /// Corrected ECC errors over the GPU's life (count).
    pub ecc_corrected_aggregate: u64,
    /// Uncorrected ECC errors over the GPU's life (count).
    pub ecc_uncorrected_aggregate: u64,
    /// Core temperature, °C.
    pub temperature_c: u32,
    /// Clocks reduced for temperature (HW or SW thermal slowdown).
    pub thermal_throttle: bool,
    /// Clocks reduced for power (SW power cap, HW power brake).
    pub power_throttle: bool,
    /// GPU busy, percent [0,100].
    pub utilization_gpu_pct: u32,
    /// Memory controller busy, percent [0,100].
    pub utilization_memory_pct: u32,
    /// Memory in use, bytes.
    pub memory_used_bytes: u64,
    /// Memory total, bytes.
    pub memory_total_bytes: u64,
}

/// A source of GPU telemetry.
pub trait GpuSource: Send + Sync {
    /// Samples `gpu` (by NVML index or UUID). `engine_load` is the engine's utilization as NVML
    /// would read it (1 while it runs any request, 0 when idle); only the mock uses it, to make
    /// utilization follow the emulated fleet.
    ///
    /// # Errors
    /// [`GpuError::NotFound`] when the node has no such GPU; [`GpuError::Query`] when NVML fails.
    fn sample(&self, gpu: &GpuRef, engine_load: f64) -> Result<GpuSample, GpuError>;
}

/// `0` or `GPU-…`, as logs and errors name a GPU.
pub fn gpu_name(gpu: &GpuRef) -> String {
    match gpu {
        GpuRef::Index(i) => i.to_string(),
        GpuRef::Uuid(u) => u.clone(),
    }
}

/// Builds the configured source. NVML missing is an error naming the library (docs/design.md §7).
pub fn from_spec(spec: &GpuSourceSpec) -> Result<Arc<dyn GpuSource>, GpuError> {
    Ok(match spec {
        GpuSourceSpec::Nvml => Arc::new(nvml::NvmlGpuSource::new()?),
        GpuSourceSpec::Mock(path) => Arc::new(mock::MockGpuSource::from_file(path)?),
    })
}
