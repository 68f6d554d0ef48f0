//! Load factor (docs/design.md §4): `1 − loadRatio`, loadRatio = GPU utilization /
//! `max_utilization`, clamped to [0,1].

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Prefers pods with idle GPUs.
#[derive(Debug, Default, Clone, Copy)]
pub struct LoadScorer;

/// loadRatio in [0,1] (non-finite inputs count as fully loaded).
pub fn load_ratio(gpu_utilization: f64, max_utilization: f64) -> f64 {
    let r = gpu_utilization / max_utilization;
    if r.is_nan() { 1.0 } else { r.clamp(0.0, 1.0) }
}

impl Scorer for LoadScorer {
    fn name(&self) -> &'static str {
        "load"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        1.0 - load_ratio(pod.gpu_utilization, ctx.config.max_utilization)
    }

    fn explain(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        format!("gpu {:.0}% of {:.0}%", pod.gpu_utilization * 100.0, ctx.config.max_utilization * 100.0)
    }
}
