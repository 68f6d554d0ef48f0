//! Candidate filtering (docs/design.md §4, §14, §15): model, pool readiness, engine readiness, connection (or grace period),
//! health threshold, Envoy subset hint, then queue spill.
//!
//! Order: the static checks ([`exclusion`]) run lock-free before scoring; the spill check
//! ([`spill`]) runs under the selection lock because queue depth includes in-flight reservations.

use std::fmt;
use std::time::{Duration, Instant};

use crate::pool::{Membership, PodStatus};

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

/// The static reason `status` is not a candidate, if any. Assumes the model already matched.
/// `stale_before` ([`crate::pool::stale_before`]): a report received before it counts its
/// health as at most [`STALE_REPORT_HEALTH`](crate::pool::STALE_REPORT_HEALTH); `grace`: how
/// long a disconnected agent's pods stay candidates.
pub(crate) fn exclusion(
    status: &PodStatus,
    subset: Option<&[String]>,
    health_threshold: f64,
    (grace, stale_before): (Duration, Option<Instant>),
    now: Instant,
) -> Option<Exclusion> {
    let stats = match (&status.stats, status.member) {
        (_, Membership::PoolUnready) => return Some(Exclusion::PodNotReady),
        (Some(stats), _) => stats,
        // A Ready pod of the pool routes by load until its agent reports (docs/design.md §14).
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
    let (score, reason) = status
        .effective_health(status.report_stale_before(stale_before))
        .unwrap_or((stats.health_score, stats.health_reason.as_str()));
    // NaN health counts as unhealthy.
    if score.is_nan() || score < health_threshold {
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
