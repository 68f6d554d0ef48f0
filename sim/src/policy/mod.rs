//! Routing policies compared on the same simulated runs (docs/benchmarks.md): the peers'
//! algorithms, re-implemented from their published descriptions, and kvroute itself through its
//! real code.
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
pub use kvroute_picker::pending::ReplicaEvent;

use kvroute_picker::score::ScoringConfig;

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
    /// The pod's cache was emptied before `stored`/`removed` (vLLM's AllBlocksCleared).
    pub cleared: bool,
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
    /// The response of `req` on `pod` ended at `now_us` (visible to the router at once).
    fn on_finish(&mut self, req: &SimRequest, pod: usize, now_us: u64);
    /// The first token of `req` on `pod` came out at `now_us` (the router sees the response
    /// start streaming); `ttft_us` after its arrival. Default: nothing.
    fn on_first_token(&mut self, _req: &SimRequest, _pod: usize, _now_us: u64, _ttft_us: u64) {}
    /// What this replica tells its peer replicas since the last call (kvroute's one view across
    /// replicas, docs/design.md §4); empty for policies without it.
    fn take_peer_events(&mut self) -> Vec<ReplicaEvent> {
        Vec::new()
    }
    /// A peer replica's event reached this replica (replica `from`, at `now_us`).
    fn on_peer_event(&mut self, _from: usize, _ev: &ReplicaEvent, _now_us: u64) {}
    /// The decisions recorded since the last call, one CSV line each ([`DECISIONS_CSV_HEADER`]),
    /// when the policy was built with [`PolicyOptions::record_decisions`] and records them
    /// (kvroute's policies); empty otherwise.
    fn take_decisions(&mut self) -> Vec<String> {
        Vec::new()
    }
}

/// Header of the decision lines [`Policy::take_decisions`] returns: simulated time (s), request
/// id, its prefix group and conversation (empty when none), its full blocks, the chosen pod, then
/// the best candidates, chosen first, each as `pod S=… cache=… matched=… pending=… load=… queue=…`
/// (unweighted factors: cache = the match ratio, load = 1 − loadRatio, queue = 1 −
/// queueDepth / maxQueue), separated by `;`.
pub const DECISIONS_CSV_HEADER: &str = "time_s,request,group,session,blocks,pod,candidates\n";

/// Every policy name [`build`] accepts, in table order.
pub const ALL: [&str; 12] = [
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
    "kvroute-ttft",
];

/// The pods' names as routers know them (`pod-0`, `pod-1`, …).
pub fn pod_names(pods: usize) -> Vec<String> {
    (0..pods.max(1)).map(|i| format!("pod-{i}")).collect()
}

/// GIE's default estimated-cache capacity per pod, in 64-character chunks (≈ 500k tokens).
pub const GIE_CAPACITY_BLOCKS: usize = kvroute_picker::approx::DEFAULT_CAPACITY_BLOCKS_PER_POD;

/// How [`build`] sets a policy up besides its name.
#[derive(Clone, Debug)]
pub struct PolicyOptions {
    /// Estimated-cache capacity per pod of the approximate policies, in chunks (GIE's default
    /// [`GIE_CAPACITY_BLOCKS`] ≈ 500k tokens; the engines' real capacity is the simulator's, and the
    /// two differ).
    pub approx_capacity_blocks: usize,
    /// Seeds random choices (give each router replica its own).
    pub seed: u64,
    /// kvroute replicas share pending chains and in-flight counts (the picker's replica stream,
    /// docs/design.md §4); other policies ignore it.
    pub shared_view: bool,
    /// Scoring fields laid over each kvroute policy's preset, as in the picker's `scoring:`
    /// section (e.g. `{"pile_guard_margin": 0}`); `None`: the preset as it is.
    pub scoring_overlay: Option<serde_json::Map<String, serde_json::Value>>,
    /// kvroute's policies record every decision with its candidates' factors (see
    /// [`Policy::take_decisions`]); other policies ignore it.
    pub record_decisions: bool,
}

impl Default for PolicyOptions {
    fn default() -> Self {
        PolicyOptions {
            approx_capacity_blocks: GIE_CAPACITY_BLOCKS,
            seed: 1,
            shared_view: true,
            scoring_overlay: None,
            record_decisions: false,
        }
    }
}

/// The kvroute preset `preset` with `overlay`'s fields over it.
fn scoring(
    preset: &str,
    overlay: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<ScoringConfig, SimError> {
    let base = ScoringConfig::preset(preset).ok_or_else(|| SimError::UnknownPolicy(preset.to_string()))?;
    let Some(overlay) = overlay else { return Ok(base) };
    let mut merged = serde_json::to_value(base).map_err(|e| SimError::Scoring(e.to_string()))?;
    if let serde_json::Value::Object(fields) = &mut merged {
        fields.extend(overlay.clone());
    }
    let config: ScoringConfig = serde_json::from_value(merged).map_err(|e| SimError::Scoring(e.to_string()))?;
    config.validate().map_err(|e| SimError::Scoring(e.to_string()))?;
    Ok(config)
}

/// Builds the named policy for `pods` pods.
pub fn build(name: &str, pods: usize, opts: &PolicyOptions) -> Result<Box<dyn Policy>, SimError> {
    let (kv_capacity_blocks, seed) = (opts.approx_capacity_blocks, opts.seed);
    let kv = |preset: &str, view: CacheView| -> Result<Box<dyn Policy>, SimError> {
        let config = scoring(preset, opts.scoring_overlay.as_ref())?;
        let mut policy = KvroutePolicy::new(name, config, pods, view, opts.shared_view)?;
        if opts.record_decisions {
            policy.record_decisions();
        }
        Ok(Box::new(policy))
    };
    match name {
        "random" => Ok(Box::new(Random::new(pods, seed))),
        "round-robin" => Ok(Box::new(RoundRobin::new(pods))),
        "least-connections" => Ok(Box::new(LeastConnections::new(pods))),
        "approximate-prefix" => Ok(Box::new(routed::GieApproximate::new(pods, kv_capacity_blocks, seed))),
        "sglang-cache-aware" => Ok(Box::new(SglangCacheAware::new(pods, kv_capacity_blocks))),
        "dynamo-cost" => Ok(Box::new(DynamoCost::new(pods, seed))),
        "kvroute" => kv("chatbot", CacheView::Precise),
        "kvroute-latency-api" => kv("latency-api", CacheView::Precise),
        "kvroute-batch" => kv("batch", CacheView::Precise),
        "kvroute-multi-lora" => kv("multi-lora", CacheView::Precise),
        "kvroute-approximate" => kv("chatbot", CacheView::Approximate { capacity_blocks: kv_capacity_blocks }),
        "kvroute-ttft" => kv("ttft", CacheView::Precise),
        _ => Err(SimError::UnknownPolicy(name.to_string())),
    }
}

#[cfg(test)]
mod tests;
