//! Adapter factor (docs/design.md §4): 1 when the requested LoRA adapter is running on the pod,
//! else 0; 1 for every pod when the request needs no adapter.

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Prefers pods that already run the requested LoRA adapter.
#[derive(Debug, Default, Clone, Copy)]
pub struct AdapterAffinityScorer;

impl Scorer for AdapterAffinityScorer {
    fn name(&self) -> &'static str {
        "adapter"
    }

    fn score(&self, ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        match ctx.adapter {
            None => 1.0,
            Some(a) if pod.running_adapters.iter().any(|r| r == a) => 1.0,
            Some(_) => 0.0,
        }
    }

    fn explain(&self, ctx: &ScoreContext<'_>, prep: &Prepared, pod: &PodFacts<'_>) -> String {
        match ctx.adapter {
            None => "no adapter requested".to_string(),
            Some(a) if self.score(ctx, prep, pod) > 0.0 => format!("{a} running"),
            Some(a) => format!("{a} not loaded"),
        }
    }
}
