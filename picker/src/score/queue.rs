//! Queue factor (docs/design.md §4): `1 − min(queueDepth / maxQueue, 1)`; queueDepth includes the
//! picker's own in-flight routings since the pod's last report.

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Prefers pods with short queues.
#[derive(Debug, Default, Clone, Copy)]
pub struct QueueDepthScorer;

impl Scorer for QueueDepthScorer {
    fn name(&self) -> &'static str {
        "queue"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        let max = f64::from(ctx.config.max_queue.max(1));
        1.0 - (f64::from(pod.queue_depth) / max).min(1.0)
    }

    fn explain(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        format!("queue {}/{}", pod.queue_depth, ctx.config.max_queue)
    }
}
