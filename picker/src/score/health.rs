//! Health factor (docs/design.md §4, §7): the agent's continuous health score in [0,1]. Pods below
//! the exclusion threshold never reach a scorer (see `filter`).

use super::{PodFacts, Prepared, ScoreContext, Scorer};

/// Shifts traffic gradually away from degraded pods.
#[derive(Debug, Default, Clone, Copy)]
pub struct HealthScorer;

impl Scorer for HealthScorer {
    fn name(&self) -> &'static str {
        "health"
    }

    fn score(&self, _ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> f64 {
        if pod.health_score.is_nan() { 0.0 } else { pod.health_score.clamp(0.0, 1.0) }
    }

    fn explain(&self, _ctx: &ScoreContext<'_>, _prep: &Prepared, pod: &PodFacts<'_>) -> String {
        if pod.health_reason.is_empty() {
            format!("health {:.2}", pod.health_score)
        } else {
            format!("health {:.2} ({})", pod.health_score, pod.health_reason)
        }
    }
}
