//! Candidate filtering (docs/design.md §4, §14, §15): model, pool readiness, engine readiness, connection (or grace period),
//! health threshold, Envoy subset hint, then queue spill.
//!
//! Order: the static checks ([`exclusion`]) run lock-free before scoring; the spill check
//! ([`spill`]) runs under the selection lock because queue depth includes in-flight reservations.

use std::fmt;
use std::time::{Duration, Instant};

use crate::pool::{Membership, PodHot, PodStatus};

/// Why a pod of the requested model is not a candidate.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Exclusion {
    NoStats,
    PodNotReady,
    NotReady,
    GraceExpired,
    Unhealthy {
        score: f64,
        threshold: f64,
        reason: String,
    },
    NotInSubset,
    /// Envoy could not connect to the endpoint; no probe has connected since.
    Unreachable,
    QueueFull {
        depth: u32,
        max: u32,
    },
    /// Predicted to miss the request's `x-slo-ttft-ms` while another candidate meets it.
    SloMiss {
        predicted_ms: f64,
        slo_ms: f64,
    },
}

impl fmt::Display for Exclusion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exclusion::NoStats => write!(f, "no stats reported yet"),
            Exclusion::PodNotReady => write!(f, "pod not Ready in the InferencePool"),
            Exclusion::NotReady => write!(f, "engine not ready"),
            Exclusion::GraceExpired => write!(f, "agent disconnected beyond the grace period"),
            Exclusion::Unhealthy { score, threshold, reason } if reason.is_empty() => {
                write!(f, "health {score:.2} below threshold {threshold:.2}")
            }
            Exclusion::Unhealthy { score, threshold, reason } => {
                write!(f, "health {score:.2} below threshold {threshold:.2} ({reason})")
            }
            Exclusion::NotInSubset => write!(f, "endpoint not in Envoy's subset hint"),
            Exclusion::Unreachable => write!(f, "Envoy could not connect to the endpoint (probing until it accepts)"),
            Exclusion::QueueFull { depth, max } => write!(f, "queue {depth} at or above max {max} (spilled)"),
            Exclusion::SloMiss { predicted_ms, slo_ms } => {
                write!(f, "predicted TTFT {predicted_ms:.0} ms over the objective {slo_ms:.0} ms")
            }
        }
    }
}

/// The static reason a pod is not a candidate, if any, from `hot`, the copy of its `status`
/// the decision reads (`status` itself is read only for a reason's text, a disconnection's time
/// and the subset hint). Assumes the model already matched. `stale_before`
/// ([`crate::pool::stale_before`]): a report received before it counts its health as at most
/// [`STALE_REPORT_HEALTH`](crate::pool::STALE_REPORT_HEALTH); `grace`: how long a disconnected
/// agent's pods stay candidates.
pub(crate) fn exclusion(
    (hot, status): (&PodHot, &PodStatus),
    subset: Option<&[String]>,
    health_threshold: f64,
    (grace, stale_before): (Duration, Option<Instant>),
    now: Instant,
) -> Option<Exclusion> {
    match (hot.has_stats, hot.member) {
        (_, Membership::PoolUnready) => return Some(Exclusion::PodNotReady),
        (true, _) => {}
        // A Ready pod of the pool routes by load until its agent reports (docs/design.md §14).
        (false, Membership::PoolReady) => return subset_exclusion(status, subset),
        (false, Membership::Agent) => return Some(Exclusion::NoStats),
    }
    if !hot.ready {
        return Some(Exclusion::NotReady);
    }
    if hot.disconnected
        && let Some(t) = status.disconnected_at
        && now.saturating_duration_since(t) >= grace
    {
        return Some(Exclusion::GraceExpired);
    }
    let stale = hot.report_stale_before(stale_before);
    let score = hot.effective_health_score(stale);
    // NaN health counts as unhealthy.
    if score.is_nan() || score < health_threshold {
        let (score, reason) = status.effective_health(stale).unwrap_or((score, ""));
        return Some(Exclusion::Unhealthy { score, threshold: health_threshold, reason: reason.to_owned() });
    }
    subset_exclusion(status, subset)
}

/// [`Exclusion::NotInSubset`] when Envoy's subset hint leaves `status`'s endpoint out.
fn subset_exclusion(status: &PodStatus, subset: Option<&[String]>) -> Option<Exclusion> {
    if let Some(allowed) = subset
        && !allowed.iter().any(|e| **e == *status.endpoint)
    {
        return Some(Exclusion::NotInSubset);
    }
    None
}

/// Spill outcome for the candidates' queue depths.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Spill {
    /// Keep exactly the candidates below `max_queue` (at least one is).
    KeepBelow,
    /// Every candidate is at or above `max_queue`.
    AllSaturated,
}

/// Pods at or above `max_queue` leave the candidates while one is below it (docs/design.md §4).
pub(crate) fn spill(mut depths: impl Iterator<Item = u32>, max_queue: u32) -> Spill {
    if depths.any(|d| d < max_queue) { Spill::KeepBelow } else { Spill::AllSaturated }
}

/// docs/design.md §4 pile guard: whether a pod carrying `load` requests (running + queueDepth)
/// is piled far above the least loaded candidate's `least`: more than `margin` requests above
/// it *and* more than `factor` times it. `margin` 0 turns the guard off.
pub(crate) fn piled(load: u32, least: u32, margin: u32, factor: f64) -> bool {
    margin > 0 && load > least.saturating_add(margin) && f64::from(load) > factor * f64::from(least)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvroute_proto::agent::v1::PodStats;

    use super::{Exclusion, exclusion, subset_exclusion};
    use crate::pool::{Membership, PodHot, PodStatus};

    /// The filters read straight from the status, as before the decision read a copy: the
    /// oracle the copy must agree with.
    fn from_status(
        status: &PodStatus,
        subset: Option<&[String]>,
        threshold: f64,
        (grace, cutoff): (Duration, Option<Instant>),
        now: Instant,
    ) -> Option<Exclusion> {
        let stats = match (&status.stats, status.member) {
            (_, Membership::PoolUnready) => return Some(Exclusion::PodNotReady),
            (Some(stats), _) => stats,
            (None, Membership::PoolReady) => return subset_exclusion(status, subset),
            (None, Membership::Agent) => return Some(Exclusion::NoStats),
        };
        if !stats.ready {
            return Some(Exclusion::NotReady);
        }
        if let Some(t) = status.disconnected_at
            && now.saturating_duration_since(t) >= grace
        {
            return Some(Exclusion::GraceExpired);
        }
        let (score, reason) = status.effective_health(status.report_stale_before(cutoff))?;
        if score.is_nan() || score < threshold {
            return Some(Exclusion::Unhealthy { score, threshold, reason: reason.to_owned() });
        }
        subset_exclusion(status, subset)
    }

    /// Every combination of membership, report, readiness, health (NaN included), report age,
    /// disconnection and subset hint: the copy's verdict is the status's, reason text and all.
    #[test]
    fn the_copy_a_decision_reads_excludes_as_the_status_does() {
        let now = Instant::now();
        let ago = |ms: u64| now.checked_sub(Duration::from_millis(ms));
        let limits = (Duration::from_millis(1_000), ago(5_000));
        let inside: Vec<String> = vec!["10.0.0.1:8000".into()];
        let outside: Vec<String> = vec!["10.0.0.9:8000".into()];
        let mut checked = 0;
        for member in [Membership::Agent, Membership::PoolReady, Membership::PoolUnready] {
            for stats in [None, Some(false), Some(true)] {
                for health in [1.0, 0.6, 0.4, 0.1, f64::NAN] {
                    for stats_age in [0, 10_000] {
                        for disconnected in [None, ago(100), ago(2_000)] {
                            for subset in [None, Some(&inside[..]), Some(&outside[..])] {
                                let status = PodStatus {
                                    endpoint: Arc::from("10.0.0.1:8000"),
                                    model: "m".into(),
                                    block_size: 16,
                                    index_mismatch: false,
                                    stats: stats.map(|ready| PodStats {
                                        ready,
                                        health_score: health,
                                        health_reason: "ecc".into(),
                                        ..PodStats::default()
                                    }),
                                    stats_at: ago(stats_age),
                                    connected: disconnected.is_none(),
                                    disconnected_at: disconnected,
                                    annotations: Vec::new(),
                                    cost_per_hour: None,
                                    member,
                                    utilization_per_request: None,
                                };
                                let hot = PodHot::of(&status);
                                let got = exclusion((&hot, &status), subset, 0.5, limits, now);
                                let want = from_status(&status, subset, 0.5, limits, now);
                                // `Exclusion` holds f64s: NaN ≠ NaN, so compare the text too.
                                assert_eq!(format!("{got:?}"), format!("{want:?}"), "{status:?} {subset:?}");
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 3 * 3 * 5 * 2 * 3 * 3);
    }
}
