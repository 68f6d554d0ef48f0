//! Cost awareness (docs/design.md §4), the shipped custom scorer: among the candidates whose
//! cacheMatchRatio is within `margin` (default 0.20) of the best candidate's, the cheaper pod
//! scores higher; a pod further behind on cache gets no cost advantage.
//!
//! Price: the pod annotation `kvroute.io/cost-per-hour` ($/hour, a positive decimal), as the
//! agent reports it in `PodInfo.annotations`; the pool parses it once per registration.
//!
//! Factor, with E = candidates within the margin that carry a price, c_min / c_max their lowest /
//! highest price:
//! - pod in E: `c_min / cost` (the cheapest eligible pod scores 1, one twice as expensive 0.5);
//! - any other pod: `c_min / c_max` (the worst eligible value: no advantage, no extra penalty);
//! - E empty (nobody near the best has a price): 1 for everyone (neutral).
//!
//! The factor is scale-free (a ratio of prices). Its pull is `w_cost · (1 − c_min/cost)`: with the
//! seed's $3.67/hour A100 against a $0.38/hour A10G the gap is 0.90·w_cost, which must exceed the
//! cache term's `w_cache · gap` for the cheap pod to win: with `w_cache = 0.50`, `w_cost = 0.15` a
//! cheap pod behind by up to 0.20 wins (0.135 > 0.10) when other factors are equal.

use super::{PodFacts, Prepared, ScoreContext, Scorer};
use crate::pool::COST_ANNOTATION;

/// Default cache-match margin (docs/design.md §4: "under 20 percentage points").
pub const DEFAULT_MARGIN: f64 = 0.20;

/// Prefers cheaper pods when their cache match is close to the best (docs/design.md §4).
#[derive(Debug, Clone, Copy)]
pub struct CostAwareScorer {
    /// cacheMatchRatio gap (fraction in [0,1]) within which price decides. Default 0.20.
    pub margin: f64,
}

impl Default for CostAwareScorer {
    fn default() -> Self {
        CostAwareScorer { margin: DEFAULT_MARGIN }
    }
}

fn ratio(ctx: &ScoreContext<'_>, pod: &PodFacts<'_>) -> f64 {
    if ctx.total_blocks == 0 { 0.0 } else { (f64::from(pod.matched_blocks) / f64::from(ctx.total_blocks)).min(1.0) }
}

fn price(pod: &PodFacts<'_>) -> Option<f64> {
    pod.cost_per_hour.filter(|c| c.is_finite() && *c > 0.0)
}

/// Slack for float noise in `ratio ≥ best − margin`.
const EPS: f64 = 1e-9;

impl Scorer for CostAwareScorer {
    fn name(&self) -> &'static str {
        "cost"
    }

    /// `[best ratio, c_min, c_max, 1 if E is non-empty]`.
    fn prepare(&self, ctx: &ScoreContext<'_>) -> Prepared {
        let best = ctx.candidates.iter().map(|p| ratio(ctx, p)).fold(0.0, f64::max);
        let (mut lo, mut hi) = (f64::INFINITY, 0.0f64);
        for p in ctx.candidates {
            if let Some(c) = price(p)
                && ratio(ctx, p) + self.margin + EPS >= best
            {
                lo = lo.min(c);
                hi = hi.max(c);
            }
        }
        let any = if lo.is_finite() { 1.0 } else { 0.0 };
        Prepared([best, lo, hi, any])
    }

    fn score(&self, ctx: &ScoreContext<'_>, prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        let [best, lo, hi, any] = prep.0;
        if any == 0.0 {
            return 1.0;
        }
        match price(pod) {
            Some(c) if ratio(ctx, pod) + self.margin + EPS >= best => (lo / c).clamp(0.0, 1.0),
            _ => (lo / hi).clamp(0.0, 1.0),
        }
    }

    fn explain(&self, ctx: &ScoreContext<'_>, prep: &Prepared, pod: &PodFacts<'_>) -> String {
        let s = self.score(ctx, prep, pod);
        match price(pod) {
            None => format!("no {COST_ANNOTATION} annotation: {s:.3}"),
            Some(c) if ratio(ctx, pod) + self.margin + EPS >= prep.0[0] => {
                format!("${c:.2}/h, cache within {:.2} of best: {s:.3}", self.margin)
            }
            Some(c) => format!("${c:.2}/h, cache more than {:.2} behind best: {s:.3}", self.margin),
        }
    }
}
