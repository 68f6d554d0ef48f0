//! [`GpuSource`] that replays a YAML scenario, so every health path is testable without a GPU.
//!
//! ```yaml
//! uuids: [GPU-aaaa, GPU-bbbb]   # optional: the node's GPUs in NVML index order
//! gpus:
//!   0:                          # by NVML index …
//!     - at_s: 0
//!       temperature_c: 55
//!     - at_s: 5                 # from 5 s after agent start
//!       temperature_c: 85
//!       thermal_throttle: true
//!   GPU-bbbb:                   # … or by UUID, as PodResources names a pod's GPUs
//!     - {at_s: 0, ecc_uncorrected_volatile: 2}
//! ```
//! Each step sets the fields it names; a value holds until a later step changes it (time from
//! the source's creation, i.e. agent start). Unnamed fields keep healthy defaults (45 °C, no ECC,
//! no throttling, 80 GiB with 40 GiB used). GPUs absent from the scenario are healthy.
//! Utilization follows the engine's load as NVML reports it (100 % while the engine runs any
//! request, 0 when idle) unless a step sets `utilization_gpu_pct`. Immutable after load: no locking.
//!
//! Which GPUs exist, as NVML would answer: with `uuids:`, exactly those (index `i` is
//! `uuids[i]`, so a timeline keyed by either applies to both names) plus any UUID keyed under
//! `gpus:`; any other index or UUID is [`GpuError::NotFound`]. Without `uuids:` every index and
//! every UUID exists (the scenarios written for static engine lists keep working).

use super::{GpuError, GpuRef, GpuSample, GpuSource, gpu_name};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// One scenario step; every field but `at_s` optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// When the step takes effect, seconds after agent start.
    pub at_s: f64,
    /// See [`GpuSample`] for each field's unit.
    pub ecc_corrected_volatile: Option<u64>,
    #[allow(missing_docs)]
    pub ecc_uncorrected_volatile: Option<u64>,
    #[allow(missing_docs)]
    pub ecc_corrected_aggregate: Option<u64>,
    #[allow(missing_docs)]
    pub ecc_uncorrected_aggregate: Option<u64>,
    #[allow(missing_docs)]
    pub temperature_c: Option<u32>,
    #[allow(missing_docs)]
    pub thermal_throttle: Option<bool>,
    #[allow(missing_docs)]
    pub power_throttle: Option<bool>,
    #[allow(missing_docs)]
    pub utilization_gpu_pct: Option<u32>,
    #[allow(missing_docs)]
    pub utilization_memory_pct: Option<u32>,
    #[allow(missing_docs)]
    pub memory_used_bytes: Option<u64>,
    #[allow(missing_docs)]
    pub memory_total_bytes: Option<u64>,
}

/// A scenario file: per GPU (NVML index or UUID), a timeline of steps.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The node's GPU UUIDs in NVML index order. Empty: every index and UUID exists.
    #[serde(default)]
    pub uuids: Vec<String>,
    /// GPU → steps (any order; sorted on load).
    #[serde(default)]
    pub gpus: BTreeMap<GpuRef, Vec<Step>>,
}

/// Replays a [`Scenario`].
pub struct MockGpuSource {
    scenario: Scenario,
    start: Instant,
}

const GIB: u64 = 1 << 30;

impl MockGpuSource {
    /// Loads a scenario file; the clock starts now.
    pub fn from_file(path: &str) -> Result<Self, GpuError> {
        let scenario: Scenario = kvroute_common::config::load_yaml("mock GPU scenario", std::path::Path::new(path))?;
        Ok(Self::new(scenario))
    }

    /// Wraps a parsed scenario; the clock starts now.
    pub fn new(mut scenario: Scenario) -> Self {
        for steps in scenario.gpus.values_mut() {
            steps.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        }
        Self { scenario, start: Instant::now() }
    }

    /// The sample of GPU `index` at `elapsed` since start (see [`MockGpuSource::sample_gpu_at`]).
    pub fn sample_at(&self, index: u32, engine_load: f64, elapsed: Duration) -> GpuSample {
        let uuid = self.scenario.uuids.get(index as usize).cloned();
        self.sample_steps(index, uuid, engine_load, elapsed)
    }

    /// The sample of `gpu` at `elapsed` since start.
    ///
    /// # Errors
    /// [`GpuError::NotFound`] for a GPU the scenario's node does not have (see the module docs).
    pub fn sample_gpu_at(&self, gpu: &GpuRef, engine_load: f64, elapsed: Duration) -> Result<GpuSample, GpuError> {
        let uuids = &self.scenario.uuids;
        let not_found = || GpuError::NotFound { gpu: gpu_name(gpu) };
        match gpu {
            GpuRef::Index(i) if uuids.is_empty() || (*i as usize) < uuids.len() => {
                Ok(self.sample_at(*i, engine_load, elapsed))
            }
            GpuRef::Index(_) => Err(not_found()),
            GpuRef::Uuid(u) => {
                let position = uuids.iter().position(|x| x == u);
                let keyed = self.scenario.gpus.contains_key(gpu);
                if !uuids.is_empty() && position.is_none() && !keyed {
                    return Err(not_found());
                }
                let index = position.map_or(0, |p| p as u32);
                Ok(self.sample_steps(index, Some(u.clone()), engine_load, elapsed))
            }
        }
    }

    /// Applies the timeline keyed by the index (when the GPU has one in the scenario) and by the
    /// UUID (when it has one), in time order.
    fn sample_steps(&self, index: u32, uuid: Option<String>, engine_load: f64, elapsed: Duration) -> GpuSample {
        let t = elapsed.as_secs_f64();
        let mut s = GpuSample {
            index,
            temperature_c: 45,
            memory_total_bytes: 80 * GIB,
            memory_used_bytes: 40 * GIB,
            ..Default::default()
        };
        let mut util = None;
        // The index names this GPU only where the index is its NVML index: by position in
        // `uuids`, or when the scenario lists no UUIDs and the GPU was asked for by index.
        let by_index = match &uuid {
            Some(u) => self.scenario.uuids.get(index as usize).is_some_and(|x| x == u),
            None => true,
        };
        let mut steps: Vec<&Step> = Vec::new();
        if by_index {
            steps.extend(self.scenario.gpus.get(&GpuRef::Index(index)).into_iter().flatten());
        }
        if let Some(u) = uuid {
            steps.extend(self.scenario.gpus.get(&GpuRef::Uuid(u)).into_iter().flatten());
        }
        steps.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        for step in steps.into_iter().take_while(|st| st.at_s <= t) {
            macro_rules! set {
                ($($f:ident),*) => { $( if let Some(v) = step.$f { s.$f = v; } )* };
            }
            set!(
                ecc_corrected_volatile,
                ecc_uncorrected_volatile,
                ecc_corrected_aggregate,
                ecc_uncorrected_aggregate,
                temperature_c,
                thermal_throttle,
                power_throttle,
                utilization_memory_pct,
                memory_used_bytes,
                memory_total_bytes
            );
            if step.utilization_gpu_pct.is_some() {
                util = step.utilization_gpu_pct;
            }
        }
        s.utilization_gpu_pct = util.unwrap_or_else(|| (engine_load.clamp(0.0, 1.0) * 100.0).round() as u32).min(100);
        s
    }
}

impl GpuSource for MockGpuSource {
    fn sample(&self, gpu: &GpuRef, engine_load: f64) -> Result<GpuSample, GpuError> {
        self.sample_gpu_at(gpu, engine_load, self.start.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(name: &str) -> MockGpuSource {
        let p = format!("{}/scenarios/{name}", env!("CARGO_MANIFEST_DIR"));
        MockGpuSource::from_file(&p).expect("scenario loads")
    }

    #[test]
    fn shipped_scenarios() {
        let healthy = scenario("healthy.yaml");
        let s = healthy.sample_at(0, 0.5, Duration::from_secs(100));
        assert_eq!((s.ecc_uncorrected_volatile, s.thermal_throttle, s.utilization_gpu_pct), (0, false, 50));

        let ecc = scenario("ecc-uncorrected.yaml");
        assert!(ecc.sample_at(1, 0.0, Duration::ZERO).ecc_uncorrected_volatile > 0);
        assert_eq!(ecc.sample_at(0, 0.0, Duration::ZERO).ecc_uncorrected_volatile, 0);

        let hot = scenario("thermal-throttle.yaml");
        let before = hot.sample_at(0, 0.0, Duration::from_secs(4));
        let after = hot.sample_at(0, 0.0, Duration::from_secs(6));
        assert!(!before.thermal_throttle && before.temperature_c < 85);
        assert!(after.thermal_throttle && after.temperature_c == 85);
    }

    #[test]
    fn steps_hold_and_utilization_override() {
        let sc: Scenario = serde_norway::from_str(
            "gpus:\n  0:\n    - {at_s: 2, utilization_gpu_pct: 10}\n    - {at_s: 0, temperature_c: 60}\n",
        )
        .expect("parses");
        let m = MockGpuSource::new(sc);
        let s1 = m.sample_at(0, 0.9, Duration::from_secs(1));
        assert_eq!((s1.temperature_c, s1.utilization_gpu_pct), (60, 90));
        let s3 = m.sample_at(0, 0.9, Duration::from_secs(3));
        assert_eq!((s3.temperature_c, s3.utilization_gpu_pct), (60, 10));
        assert!(serde_norway::from_str::<Scenario>("gpus: {0: [{at_s: 0, bogus: 1}]}").is_err());
        assert!(MockGpuSource::from_file("/nonexistent/scenario.yaml").is_err());
    }

    #[test]
    fn gpus_by_uuid_and_index_name_the_same_device() {
        let sc: Scenario = serde_norway::from_str(
            "uuids: [GPU-a, GPU-b]\ngpus:\n  GPU-b: [{at_s: 0, ecc_uncorrected_volatile: 2}]\n  0: [{at_s: 0, temperature_c: 70}]\n",
        )
        .expect("parses");
        let m = MockGpuSource::new(sc);
        let at = |g: GpuRef| m.sample_gpu_at(&g, 0.0, Duration::ZERO);
        let b = at(GpuRef::Uuid("GPU-b".into())).expect("GPU-b exists");
        assert_eq!((b.index, b.ecc_uncorrected_volatile), (1, 2));
        assert_eq!(at(GpuRef::Index(1)).expect("index 1").ecc_uncorrected_volatile, 2, "index 1 is GPU-b");
        let a = at(GpuRef::Uuid("GPU-a".into())).expect("GPU-a exists");
        assert_eq!((a.index, a.temperature_c, a.ecc_uncorrected_volatile), (0, 70, 0), "GPU-a is index 0");
        for missing in [GpuRef::Uuid("GPU-zzz".into()), GpuRef::Index(2)] {
            assert!(matches!(at(missing.clone()), Err(GpuError::NotFound { .. })), "{missing:?}");
        }
        // Without `uuids`, every GPU exists; a UUID key still applies to that UUID only.
        let open: Scenario =
            serde_norway::from_str("gpus:\n  GPU-x: [{at_s: 0, thermal_throttle: true}]\n").expect("parses");
        let m = MockGpuSource::new(open);
        assert!(m.sample_gpu_at(&GpuRef::Uuid("GPU-x".into()), 0.0, Duration::ZERO).expect("x").thermal_throttle);
        assert!(!m.sample_gpu_at(&GpuRef::Uuid("GPU-y".into()), 0.0, Duration::ZERO).expect("y").thermal_throttle);
        assert!(!m.sample_gpu_at(&GpuRef::Index(0), 0.0, Duration::ZERO).expect("0").thermal_throttle);
    }

    #[test]
    fn nvml_absent_is_a_clear_error() {
        // No GPU driver on CI machines; where one exists this test only checks construction works.
        match super::super::nvml::NvmlGpuSource::new() {
            Ok(_) => {}
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("libnvidia-ml.so"), "{msg}");
                assert!(msg.contains("--gpu-source mock:"), "{msg}");
            }
        }
    }
}
