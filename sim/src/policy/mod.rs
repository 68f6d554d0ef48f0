//! Routing policies compared on the same simulated runs (issue 9): the peers' algorithms,
//! re-implemented from their published descriptions, and kvroute itself through its real code.
//!
//! Every policy sees the fleet the way its real counterpart does: engine state arrives as
//! [`PodReport`]s after the report delay (KV events and stats, like kvroute's agents or Dynamo's
//! event plane); a policy's own routing decisions and the end of each response are visible at once
//! (the router is in the request path).

mod basic;
mod dynamo;
mod kvroute;
mod routed;
mod sglang;

pub use basic::{LeastConnections, Random, RoundRobin};
pub use dynamo::DynamoCost;
pub use kvroute::{CacheView, KvroutePolicy};
pub use sglang::SglangCacheAware;

use kvroute_common::BlockHash;

use crate::SimError;
use crate::engine::EngineStats;
use crate::workload::SimRequest;

/// One pod's report as it reaches the router: block changes and (on stats ticks) stats.
#[derive(Clone, Debug)]
pub struct PodReport {
    /// Pod index.
    pub pod: usize,
    /// Simulated time the engine state was read, µs.
    pub engine_time_us: u64,
    /// Blocks stored since the previous report.
    pub stored: Vec<BlockHash>,
    /// Blocks evicted since the previous report.
    pub removed: Vec<BlockHash>,
    /// Stats, when this report carries them.
    pub stats: Option<EngineStats>,
}

/// A routing policy under simulation.
pub trait Policy {
    /// Name in tables and charts.
    fn name(&self) -> &str;
    /// Chooses the pod (index in 0..pods) for `req` at simulated time `now_us`.
    fn pick(&mut self, req: &SimRequest, now_us: u64) -> Result<usize, SimError>;
    /// A pod's report arrived (after the report delay).
    fn on_report(&mut self, report: &PodReport);
    /// The response of `req` on `pod` ended (visible to the router at once).
    fn on_finish(&mut self, req: &SimRequest, pod: usize);
}

/// Every policy name [`build`] accepts, in table order.
pub const ALL: [&str; 11] = [
    "random",
    "round-robin",
    "least-connections",
    "approximate-prefix",
    "sglang-cache-aware",
    "dynamo-cost",
    "kvroute",
    "kvroute-latency-api",
    "kvroute-batch",
    "kvroute-multi-lora",
    "kvroute-approximate",
];

/// Builds the named policy for `pods` pods. `kv_capacity_blocks` sizes the approximate policies'
/// estimated caches (they assume each pod holds that many blocks; the engines' real capacity is
/// the simulator's, and the two may differ).
pub fn build(name: &str, pods: usize, kv_capacity_blocks: usize, seed: u64) -> Result<Box<dyn Policy>, SimError> {
    let kv = |preset: &str, view: CacheView| -> Result<Box<dyn Policy>, SimError> {
        let config = kvroute_picker::score::ScoringConfig::preset(preset)
            .ok_or_else(|| SimError::UnknownPolicy(name.to_string()))?;
        Ok(Box::new(KvroutePolicy::new(name, config, pods, view)?))
    };
    match name {
        "random" => Ok(Box::new(Random::new(pods, seed))),
        "round-robin" => Ok(Box::new(RoundRobin::new(pods))),
        "least-connections" => Ok(Box::new(LeastConnections::new(pods))),
        "approximate-prefix" => Ok(Box::new(routed::GieApproximate::new(pods, kv_capacity_blocks))),
        "sglang-cache-aware" => Ok(Box::new(SglangCacheAware::new(pods, kv_capacity_blocks))),
        "dynamo-cost" => Ok(Box::new(DynamoCost::new(pods, seed))),
        "kvroute" => kv("chatbot", CacheView::Precise),
        "kvroute-latency-api" => kv("latency-api", CacheView::Precise),
        "kvroute-batch" => kv("batch", CacheView::Precise),
        "kvroute-multi-lora" => kv("multi-lora", CacheView::Precise),
        "kvroute-approximate" => kv("chatbot", CacheView::Approximate { capacity_blocks: kv_capacity_blocks }),
        _ => Err(SimError::UnknownPolicy(name.to_string())),
    }
}

#[cfg(test)]
mod tests;
