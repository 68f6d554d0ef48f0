//! What the router's filter says of each pod of the pool now, for the pool gauges
//! (docs/operations.md "Metrics"): the same [`filter::exclusion`] the decisions run, so that the
//! gauges count what the router can route to, agents or not.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ScoringConfig;
use super::filter::{self, Exclusion};
use crate::pool::{Pool, stale_before};

/// One pod as the router sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRouting {
    /// Pod (endpoint) name.
    pub name: Arc<str>,
    /// Ready as the router counts it: Ready in the pool (or registered by an agent) and not
    /// reported unready, nor gone past its agent's grace period. A Ready endpoint no agent
    /// reports on counts: it routes by load.
    pub ready: bool,
    /// A candidate now: the static filters pass (ready, health at or above the threshold,
    /// reachable) and its queue is below `max_queue`.
    pub routable: bool,
    /// An agent's stats are held for it (its stream is up, or within the grace period).
    pub reported: bool,
}

/// Every pod of `pool`, in table order, judged with `config`'s health threshold and `max_queue`.
pub fn pod_routing(pool: &Pool, config: &ScoringConfig) -> Vec<PodRouting> {
    let table = pool.table.load();
    let max_age = pool.report_max_age();
    let now = Instant::now();
    let cutoff = stale_before(now, max_age);
    let limits = (Duration::from_millis(pool.config().grace_ttl_ms), cutoff);
    table
        .pods
        .iter()
        .zip(table.status.iter().zip(table.hot.iter()))
        .map(|(rec, (status, hot))| {
            let why = if rec.is_unreachable() {
                Some(Exclusion::Unreachable)
            } else {
                filter::exclusion((hot, status), None, config.health_exclusion_threshold, limits, now)
            };
            let ready = !matches!(
                why,
                Some(Exclusion::NoStats | Exclusion::PodNotReady | Exclusion::NotReady | Exclusion::GraceExpired)
            );
            let depth = rec.queue_depth(status, status.report_stale_before(cutoff));
            PodRouting {
                name: rec.name.clone(),
                ready,
                routable: why.is_none() && depth < config.max_queue,
                reported: status.stats.is_some(),
            }
        })
        .collect()
}
