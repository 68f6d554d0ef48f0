//! The cache factor (docs/design.md §2, §4): credited blocks (GPU blocks 1 each, CPU-tier-only
//! blocks `offload_credit` each) over the request's full blocks (`ratio`, the cacheMatchRatio),
//! or over at least `full_credit_tokens` worth of blocks (`tokens_saved`); 0 when the request has
//! no full block.

use super::{CacheFactor, PodFacts, Prepared, ScoreContext, Scorer};

/// Prefix-cache affinity: the share of the request's blocks the pod already holds (or, with
/// `tokens_saved`, of a full step of prefill).
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefixCacheScorer;

/// The cache factor of `pod` for the request of `ctx`, in [0,1] (see the module docs).
pub fn cache_credit(ctx: &ScoreContext<'_>, pod: &PodFacts<'_>) -> f64 {
    let denominator = match ctx.config.cache_factor {
        CacheFactor::Ratio => ctx.total_blocks,
        CacheFactor::TokensSaved => {
            if ctx.total_blocks == 0 {
                return 0.0;
            }
            ctx.total_blocks.max(ctx.config.full_credit_tokens.div_ceil(ctx.block_size.max(1)))
        }
    };
    if denominator == 0 {
        return 0.0;
    }
    let credited = f64::from(pod.matched_blocks) + ctx.config.offload_credit * f64::from(pod.offloaded_blocks);
    (credited / f64::from(denominator)).clamp(0.0, 1.0)
}

impl Scorer for PrefixCacheScorer {
    fn name(&self) -> &'static str {
        "cache"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        cache_credit(ctx, pod)
    }

    fn explain(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        let mut s = format!("{}/{} blocks cached", pod.matched_blocks, ctx.total_blocks);
        if pod.pending_blocks > 0 {
            s.push_str(&format!(" ({} pending)", pod.pending_blocks));
        }
        if pod.offloaded_blocks > 0 {
            s.push_str(&format!(", {} more on CPU at {}", pod.offloaded_blocks, ctx.config.offload_credit));
        }
        if ctx.config.cache_factor == CacheFactor::TokensSaved {
            s.push_str(&format!(", full credit from {} tokens", ctx.config.full_credit_tokens));
        }
        s
    }
}
