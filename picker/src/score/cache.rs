//! cacheMatchRatio (docs/design.md §2, §4): consecutive matched blocks from the start of the
//! request / full blocks in the request; 0 when the request has no full block.

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Prefix-cache affinity: the share of the request's blocks the pod already holds.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefixCacheScorer;

impl Scorer for PrefixCacheScorer {
    fn name(&self) -> &'static str {
        "cache"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        if ctx.total_blocks == 0 {
            return 0.0;
        }
        (f64::from(pod.matched_blocks) / f64::from(ctx.total_blocks)).clamp(0.0, 1.0)
    }

    fn explain(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        format!("{}/{} blocks cached", pod.matched_blocks, ctx.total_blocks)
    }
}
