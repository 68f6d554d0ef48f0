//! Load factor (docs/design.md §4): `1 − loadRatio`. loadRatio is the pod's in-flight work over
//! its learned capacity when the router computed it ([`PodFacts::in_flight_load`],
//! `load_source: inflight`, docs/design.md §4 "Load and predicted TTFT"), else the seed's GPU
//! utilization / `max_utilization`; clamped to [0,1] either way.

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Prefers pods with less work in flight (or idle GPUs, by the seed's formula).
#[derive(Debug, Default, Clone, Copy)]
pub struct LoadScorer;

/// The seed's loadRatio in [0,1]: GPU utilization / `max_utilization` (non-finite inputs count
/// as fully loaded).
pub fn load_ratio(gpu_utilization: f64, max_utilization: f64) -> f64 {
    let r = gpu_utilization / max_utilization;
    if r.is_nan() { 1.0 } else { r.clamp(0.0, 1.0) }
}

/// The loadRatio a candidate is scored with: its in-flight load when known and finite, else
/// [`load_ratio`].
pub fn pod_load_ratio(pod: &PodFacts<'_>, max_utilization: f64) -> f64 {
    match pod.in_flight_load {
        Some(r) if r.is_finite() => r.clamp(0.0, 1.0),
        _ => load_ratio(pod.gpu_utilization, max_utilization),
    }
}

impl Scorer for LoadScorer {
    fn name(&self) -> &'static str {
        "load"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        1.0 - pod_load_ratio(pod, ctx.config.max_utilization)
    }

    fn explain(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        match pod.in_flight_load {
            Some(r) if r.is_finite() => format!(
                "in-flight work {:.0}% of capacity (gpu {:.0}%)",
                r.clamp(0.0, 1.0) * 100.0,
                pod.gpu_utilization * 100.0
            ),
            _ => format!("gpu {:.0}% of {:.0}%", pod.gpu_utilization * 100.0, ctx.config.max_utilization * 100.0),
        }
    }
}
