//! Scoring (docs/design.md §4, §15): candidate filtering, the five factor scorers, selection
//! and the [`Router`] that turns a request's block chain into a [`Decision`].
//!
//! S = w_cache·cacheMatchRatio + w_load·(1 − loadRatio) + w_queue·(1 − min(queueDepth/maxQueue, 1))
//!   + w_health·healthScore + w_adapter·adapterMatch
//!
//! Concurrency: [`Router::route`] walks the prefix index and reads pod state lock-free (arc-swap),
//! then takes the pool's selection mutex for the scoring + choice + in-flight reservation only
//! (microseconds), so concurrent decisions see each other's reservations (docs/design.md §4). A decision's
//! [`InFlightSlot`](crate::pool::InFlightSlot) releases the reservation when dropped.
//!
//! Custom scorers (docs/design.md §4) add terms `w_i·factor_i` to S. They register with their weight:
//! from config (`scoring.custom`, e.g. the shipped [`CostAwareScorer`]) or in code through
//! [`Router::with_scorers`]. The sum rule covers every registered scorer: the built-in weights
//! plus the custom ones must sum to 1.0, and names must be unique.
//!
//! Invariants: weights each in [0,1], names unique, summing to 1 (checked by
//! [`ScoringConfig::validate`] and [`Router::new`] / [`Router::with_scorers`]), every factor in
//! [0,1] (clamped; NaN counts 0), hence S in [0,1].

mod adapter;
mod cache;
mod cost;
mod filter;
mod health;
mod load;
mod popularity;
mod queue;
mod routability;
mod router;
mod select;

pub use crate::pool::{DECODE_TOKENS_PER_REQUEST, SolvedFit, TtftFit, TtftLine};
pub use adapter::AdapterAffinityScorer;
pub use cache::{PrefixCacheScorer, cache_credit};
pub use cost::CostAwareScorer;
pub use health::HealthScorer;
pub use load::{LoadScorer, load_ratio, pod_load_ratio};
pub use queue::QueueDepthScorer;
pub use routability::{PodRouting, pod_routing};
pub use router::{ORDERED_CANDIDATES, Router};

use serde::{Deserialize, Serialize};

pub use crate::pending::{DEFAULT_PENDING_MAX_BLOCKS, DEFAULT_PENDING_TTL_MS};
use crate::pool::InFlightSlot;

/// Factor weights (docs/design.md §4). Each in [0,1]; they must sum to 1.0 (±1e-6). All five are required
/// when given in a config file.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    /// cacheMatchRatio weight. Default 0.60.
    pub cache: f64,
    /// `1 − loadRatio` weight. Default 0.20.
    pub load: f64,
    /// Queue factor weight. Default 0.10.
    pub queue: f64,
    /// healthScore weight. Default 0.05.
    pub health: f64,
    /// adapterMatch weight. Default 0.05.
    pub adapter: f64,
}

/// The default weights (the `chatbot` preset, docs/design.md §4).
pub const DEFAULT_WEIGHTS: Weights = Weights { cache: 0.60, load: 0.20, queue: 0.10, health: 0.05, adapter: 0.05 };
/// Default [`ScoringConfig::max_queue`], in requests (the `chatbot` preset).
pub const DEFAULT_MAX_QUEUE: u32 = 20;
/// Default [`ScoringConfig::max_utilization`] (fraction of GPU busy counted as fully loaded).
pub const DEFAULT_MAX_UTILIZATION: f64 = 1.0;
/// Default [`ScoringConfig::full_credit_tokens`].
pub const DEFAULT_FULL_CREDIT_TOKENS: u32 = 2048;
/// Default [`ScoringConfig::offload_credit`] (llm-d's 0.8; Dynamo uses 0.75 for host memory).
pub const DEFAULT_OFFLOAD_CREDIT: f64 = 0.8;

/// How matched blocks become the cache factor (docs/design.md §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheFactor {
    /// cacheMatchRatio: credited blocks / the request's full blocks (the seed's formula).
    #[default]
    Ratio,
    /// Saved prefill: credited blocks / max(the request's full blocks, `full_credit_tokens` in
    /// blocks). The same as `ratio` for prompts of at least `full_credit_tokens`; a 17-token
    /// prompt's one matched block earns 1/128 instead of 1.
    TokensSaved,
}

/// Where loadRatio comes from (docs/design.md §4 "Load and predicted TTFT").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSource {
    /// The pod's in-flight work (prefill tokens routed there and not yet computed, plus a decode
    /// share per running request) over its learned capacity (`load_horizon_ms` of its learned
    /// prefill rate), and at least its reported KV usage. A pod whose TTFT model has not learned
    /// yet falls back to `gpu_utilization`.
    #[default]
    Inflight,
    /// The seed's formula: reported GPU utilization / `max_utilization` (NVML reads ≈ 1 for any
    /// pod that is stepping, so this separates idle from busy pods only).
    GpuUtilization,
}

/// How a cache-hot pod keeps or spills a request (docs/design.md §4 "Stay or spill").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpillRule {
    /// The seed's rule: pods at `max_queue` leave the candidates; the best S wins.
    #[default]
    MaxQueue,
    /// The request stays on the cache-hot pod (most blocks credited, best S among those) unless
    /// that pod's predicted TTFT exceeds `ttft_spill_factor` times that of the best alternative
    /// with KV room, which then serves it; a cold request goes by S. A pod at `max_queue`, or
    /// carrying a pile, stays a candidate while predicted fastest. While any candidate's TTFT
    /// model has not learned yet, the seed's rule decides.
    Ttft,
}

/// Default [`ScoringConfig::ttft_spill_factor`].
pub const DEFAULT_TTFT_SPILL_FACTOR: f64 = 4.0;
/// Default [`ScoringConfig::load_horizon_ms`].
pub const DEFAULT_LOAD_HORIZON_MS: u64 = 1_000;

/// Default [`ScoringConfig::pending_queue_share`].
pub const DEFAULT_PENDING_QUEUE_SHARE: f64 = 0.5;
/// Default [`ScoringConfig::pile_guard_margin`], in requests.
pub const DEFAULT_PILE_GUARD_MARGIN: u32 = 40;
/// [`ScoringConfig::pile_guard_margin`] of the `ttft` preset, in requests: its pile guard
/// keeps a pile by predicted time (docs/design.md §4 "Pile guard by time"), and a pile the
/// models read as far faster grows past 24 requests only where that holds.
pub const TTFT_PILE_GUARD_MARGIN: u32 = 24;
/// Default [`ScoringConfig::cold_placement_margin`], in S.
pub const DEFAULT_COLD_PLACEMENT_MARGIN: f64 = 0.01;
/// Default [`ScoringConfig::full_fleet_kv`]: the KV usage at which a pod is near preempting
/// (docs/decisions/0060-a-full-fleet-keeps-prefixes.md).
pub const DEFAULT_FULL_FLEET_KV: f64 = 0.8;
/// Default [`ScoringConfig::popularity_placement_margin`], in S.
pub const DEFAULT_POPULARITY_PLACEMENT_MARGIN: f64 = 0.05;
/// Default [`ScoringConfig::pile_guard_factor`].
pub const DEFAULT_PILE_GUARD_FACTOR: f64 = 2.0;
/// Default [`ScoringConfig::health_exclusion_threshold`] (docs/design.md §7: below 0.3 = excluded band).
pub const DEFAULT_HEALTH_EXCLUSION_THRESHOLD: f64 = 0.3;

impl Default for Weights {
    fn default() -> Self {
        DEFAULT_WEIGHTS
    }
}

impl Weights {
    /// `(name, weight)` in scorer order.
    pub fn named(&self) -> [(&'static str, f64); 5] {
        [
            ("cache", self.cache),
            ("load", self.load),
            ("queue", self.queue),
            ("health", self.health),
            ("adapter", self.adapter),
        ]
    }
}

/// Scoring settings (docs/design.md §4). Every absent field takes its default (the `chatbot` preset).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// Factor weights. Default [`DEFAULT_WEIGHTS`] (0.60/0.20/0.10/0.05/0.05).
    pub weights: Weights,
    /// Queue depth (requests) at which the queue factor reaches 0 and the pod spills. Default
    /// [`DEFAULT_MAX_QUEUE`] (20).
    pub max_queue: u32,
    /// GPU utilization (fraction) counted as fully loaded. Default [`DEFAULT_MAX_UTILIZATION`] (1.0).
    pub max_utilization: f64,
    /// Pods with a health score below this are excluded. Default
    /// [`DEFAULT_HEALTH_EXCLUSION_THRESHOLD`] (0.3).
    pub health_exclusion_threshold: f64,
    /// When every candidate is at `max_queue`: true → refuse (429), false → keep them all.
    /// Default false.
    pub shed_when_saturated: bool,
    /// Seed of the random tie-break. Default 0.
    pub seed: u64,
    /// Custom scorers from config, each with its weight (docs/design.md §4). Default none.
    pub custom: Vec<CustomScorerConfig>,
    /// How long a routed chain counts as cached on the chosen pod before its KV events confirm
    /// it, ms (docs/design.md §3 "Pending entries"); 0 turns pending entries off. Default
    /// [`DEFAULT_PENDING_TTL_MS`] (2000).
    pub pending_ttl_ms: u64,
    /// Most (block, pod) pending entries kept; the oldest chains go first beyond it. Default
    /// [`DEFAULT_PENDING_MAX_BLOCKS`] (1 048 576).
    pub pending_max_blocks: usize,
    /// Pending credit is withheld from a pod whose queue depth is at least this share of
    /// `max_queue` above the least queued candidate's (docs/design.md §4 "Pending entries"): a
    /// chain still being prefilled draws the next requests of its prefix, but not a whole queue
    /// while other pods stand idle (a thundering herd then spreads over the spill pods instead of
    /// filling them one after another). In [0, 1]; 0 turns the cap off. Default
    /// [`DEFAULT_PENDING_QUEUE_SHARE`] (0.5: 10 requests under `max_queue` 20).
    pub pending_queue_share: f64,
    /// How matched blocks become the cache factor (docs/design.md §4): `ratio` (default, the
    /// match ratio) or `tokens_saved` (the prefill a match saves, full credit only from
    /// `full_credit_tokens` on, so a short prompt's match cannot outweigh load and health).
    pub cache_factor: CacheFactor,
    /// `tokens_saved` only: prompt tokens a match must save for full cache credit. Default
    /// [`DEFAULT_FULL_CREDIT_TOKENS`] (2048: one engine step of prefill, ≈ 0.45 s on an 8B model).
    pub full_credit_tokens: u32,
    /// Credit per block held only in a pod's CPU tier (vLLM KV offloading, LMCache), in [0,1]
    /// (docs/design.md §2 tiers); a GPU block counts 1. Default [`DEFAULT_OFFLOAD_CREDIT`] (0.8).
    pub offload_credit: f64,
    /// Pile guard (docs/design.md §4): when the best-scored pod carries more requests (reported
    /// running + queueDepth) than the least loaded candidate by more than this many *and* by more
    /// than `pile_guard_factor` times, the least loaded candidate serves the request instead (the
    /// best scored among equally loaded ones). A hot prefix (a system prompt every conversation
    /// shares) thus spreads to other pods before its first holder saturates. 0 turns the guard
    /// off. Default [`DEFAULT_PILE_GUARD_MARGIN`] (40).
    pub pile_guard_margin: u32,
    /// See `pile_guard_margin`; at least 1. Default [`DEFAULT_PILE_GUARD_FACTOR`] (2.0).
    pub pile_guard_factor: f64,
    /// loadRatio brought forward to the decision (docs/design.md §4): the GPU utilization of a
    /// pod's last report plus, for each request routed to it since that report, the utilization
    /// per running request the pod last reported (capped at 1), as queueDepth counts those
    /// requests. Without it a request routed a moment ago weighs a fifth of one the next report
    /// lists as running (16 running at most: 0.005 vs 0.0125 + 0.005 of S), and cold prompts
    /// stacked on the pods that had just been given one. Default true.
    pub load_forecast: bool,
    /// Ties of a cold request (no candidate holds any of its blocks) go, after loadRatio and
    /// queueDepth and before the seeded random pick, to the pod whose requests still prefilling
    /// have fewer blocks left to compute (docs/design.md §4 ties): pods that read the same on load
    /// and queue may be at the start or the end of a cold prefill. Precise mode only (the blocks
    /// left come from pending chains and KV events). Default false: the design's tie rule ends in
    /// a seeded random pick (docs/design.md §4), so this step is the operator's choice.
    pub prefill_tie_break: bool,
    /// A request no candidate holds any block of (a new prefix) goes, among the candidates whose S
    /// is within this much of the best's, to the one with the least long-run share: its routed
    /// rate over the candidates' mean plus its cached blocks over theirs (docs/design.md §4
    /// "Where a new prefix goes"). In [0, 1]; 0 turns it off (best S, as for any request).
    /// Default [`DEFAULT_COLD_PLACEMENT_MARGIN`] (0.01).
    pub cold_placement_margin: f64,
    /// While the recent prefixes are equally popular (their rates differ by no more than
    /// Poisson noise), a new prefix goes instead, among the candidates whose S is within this
    /// much of the best's, to the one with the fewest cached blocks (docs/design.md §4 "Where a
    /// new prefix goes"). In [0, 1]; 0 turns it off (the rule above always). Needs
    /// `cold_placement_margin` > 0. Default [`DEFAULT_POPULARITY_PLACEMENT_MARGIN`] (0.05).
    pub popularity_placement_margin: f64,
    /// Mean KV cache usage of the candidates (fraction, fresh reports only) at or above which
    /// the fleet is full for a request whose prefix is not hot: the pods holding the most of its
    /// blocks keep it, at `max_queue` up to 4 × `max_queue` queued and past the pile guard
    /// (docs/design.md §4 "A full fleet"). In [0, 1]; 0 turns it off. Default
    /// [`DEFAULT_FULL_FLEET_KV`] (0.8).
    pub full_fleet_kv: f64,
    /// Where loadRatio comes from: `inflight` (default: in-flight work over learned capacity) or
    /// `gpu_utilization` (the seed's formula). docs/design.md §4 "Load and predicted TTFT".
    pub load_source: LoadSource,
    /// `inflight` only: predicted prefill time of a pod's in-flight work, ms, that counts as
    /// fully loaded (loadRatio 1). Default [`DEFAULT_LOAD_HORIZON_MS`] (1000).
    pub load_horizon_ms: u64,
    /// Stay or spill: `max_queue` (default, the seed's rule) or `ttft` (by predicted time to
    /// first token; the `ttft` preset). docs/design.md §4 "Stay or spill".
    pub spill_rule: SpillRule,
    /// `spill_rule: ttft` only: the cache-hot pod keeps the request unless its predicted TTFT
    /// exceeds this many times the best alternative's (≥ 1). Default
    /// [`DEFAULT_TTFT_SPILL_FACTOR`].
    pub ttft_spill_factor: f64,
}

/// A custom scorer enabled from config, with its weight in S (the sum rule includes it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "scorer", rename_all = "kebab-case", deny_unknown_fields)]
#[non_exhaustive]
pub enum CustomScorerConfig {
    /// [`CostAwareScorer`]: prefer cheaper pods (annotation `kvroute.io/cost-per-hour`, $/hour)
    /// among those whose cacheMatchRatio is within `margin` of the best candidate's.
    Cost {
        /// Weight in S, in [0,1].
        weight: f64,
        /// Cache-match gap (fraction, in [0,1]) under which the cheaper pod is preferred.
        /// Default 0.20 (docs/design.md §4).
        #[serde(default = "default_cost_margin")]
        margin: f64,
    },
}

fn default_cost_margin() -> f64 {
    cost::DEFAULT_MARGIN
}

impl CustomScorerConfig {
    /// The scorer's name (as in explanations and validation messages).
    pub fn name(&self) -> &'static str {
        match self {
            CustomScorerConfig::Cost { .. } => "cost",
        }
    }

    /// Its weight in S.
    pub fn weight(&self) -> f64 {
        match self {
            CustomScorerConfig::Cost { weight, .. } => *weight,
        }
    }

    /// Builds the scorer.
    pub fn build(&self) -> Box<dyn Scorer> {
        match self {
            CustomScorerConfig::Cost { margin, .. } => Box::new(CostAwareScorer { margin: *margin }),
        }
    }
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            weights: DEFAULT_WEIGHTS,
            max_queue: DEFAULT_MAX_QUEUE,
            max_utilization: DEFAULT_MAX_UTILIZATION,
            health_exclusion_threshold: DEFAULT_HEALTH_EXCLUSION_THRESHOLD,
            shed_when_saturated: false,
            seed: 0,
            custom: Vec::new(),
            pending_ttl_ms: DEFAULT_PENDING_TTL_MS,
            pending_max_blocks: DEFAULT_PENDING_MAX_BLOCKS,
            pending_queue_share: DEFAULT_PENDING_QUEUE_SHARE,
            pile_guard_margin: DEFAULT_PILE_GUARD_MARGIN,
            pile_guard_factor: DEFAULT_PILE_GUARD_FACTOR,
            load_forecast: true,
            prefill_tie_break: false,
            cold_placement_margin: DEFAULT_COLD_PLACEMENT_MARGIN,
            popularity_placement_margin: DEFAULT_POPULARITY_PLACEMENT_MARGIN,
            full_fleet_kv: DEFAULT_FULL_FLEET_KV,
            cache_factor: CacheFactor::Ratio,
            full_credit_tokens: DEFAULT_FULL_CREDIT_TOKENS,
            offload_credit: DEFAULT_OFFLOAD_CREDIT,
            load_source: LoadSource::Inflight,
            load_horizon_ms: DEFAULT_LOAD_HORIZON_MS,
            spill_rule: SpillRule::MaxQueue,
            ttft_spill_factor: DEFAULT_TTFT_SPILL_FACTOR,
        }
    }
}

/// Named presets (docs/design.md §4): cache/load/queue/health/adapter, maxQueue, cache factor.
/// `chatbot` is the default; `tokens-saved` is `chatbot` scoring saved prefill instead of the
/// match ratio (for fleets with many short prompts). `ttft` (not in this table: it is `chatbot`
/// with [`SpillRule::Ttft`]) keeps a request on its cache-hot pod unless another pod's predicted
/// TTFT is lower.
pub const PRESETS: [(&str, Weights, u32, CacheFactor); 5] = [
    ("chatbot", DEFAULT_WEIGHTS, DEFAULT_MAX_QUEUE, CacheFactor::Ratio),
    (
        "latency-api",
        Weights { cache: 0.45, load: 0.15, queue: 0.30, health: 0.05, adapter: 0.05 },
        10,
        CacheFactor::Ratio,
    ),
    ("batch", Weights { cache: 0.60, load: 0.30, queue: 0.00, health: 0.05, adapter: 0.05 }, 40, CacheFactor::Ratio),
    (
        "multi-lora",
        Weights { cache: 0.45, load: 0.20, queue: 0.10, health: 0.05, adapter: 0.20 },
        20,
        CacheFactor::Ratio,
    ),
    ("tokens-saved", DEFAULT_WEIGHTS, DEFAULT_MAX_QUEUE, CacheFactor::TokensSaved),
];

impl ScoringConfig {
    /// The named preset (`chatbot`, `latency-api`, `batch`, `multi-lora`, `tokens-saved`,
    /// `ttft`), other fields default.
    pub fn preset(name: &str) -> Option<ScoringConfig> {
        if name == "ttft" {
            return Some(ScoringConfig {
                spill_rule: SpillRule::Ttft,
                pile_guard_margin: TTFT_PILE_GUARD_MARGIN,
                ..ScoringConfig::default()
            });
        }
        PRESETS.iter().find(|(n, ..)| *n == name).map(|(_, weights, max_queue, cache_factor)| ScoringConfig {
            weights: *weights,
            max_queue: *max_queue,
            cache_factor: *cache_factor,
            ..ScoringConfig::default()
        })
    }

    /// Every registered weight as `(name, weight)`: the five built-ins, then `custom` in order.
    pub fn named_weights(&self) -> Vec<(&'static str, f64)> {
        let mut named = self.weights.named().to_vec();
        named.extend(self.custom.iter().map(|c| (c.name(), c.weight())));
        named
    }

    /// Checks weights ([`validate_weights`] over [`ScoringConfig::named_weights`]),
    /// `max_queue ≥ 1`, `max_utilization` in (0,1], the threshold in [0,1] and custom scorers'
    /// own settings.
    pub fn validate(&self) -> Result<(), ScoringConfigError> {
        validate_weights(&self.named_weights())?;
        self.validate_settings()
    }

    /// Everything [`ScoringConfig::validate`] checks except the weights.
    pub(crate) fn validate_settings(&self) -> Result<(), ScoringConfigError> {
        if self.max_queue == 0 {
            return Err(ScoringConfigError::MaxQueue);
        }
        if !(self.max_utilization > 0.0 && self.max_utilization <= 1.0) {
            return Err(ScoringConfigError::MaxUtilization(self.max_utilization));
        }
        if !(0.0..=1.0).contains(&self.health_exclusion_threshold) {
            return Err(ScoringConfigError::HealthThreshold(self.health_exclusion_threshold));
        }
        if !(self.pile_guard_factor.is_finite() && self.pile_guard_factor >= 1.0) {
            return Err(ScoringConfigError::PileGuardFactor(self.pile_guard_factor));
        }
        if !(0.0..=1.0).contains(&self.offload_credit) {
            return Err(ScoringConfigError::OffloadCredit(self.offload_credit));
        }
        if !(0.0..=1.0).contains(&self.pending_queue_share) {
            return Err(ScoringConfigError::PendingQueueShare(self.pending_queue_share));
        }
        if !(0.0..=1.0).contains(&self.cold_placement_margin) {
            return Err(ScoringConfigError::ColdPlacementMargin(self.cold_placement_margin));
        }
        if !(0.0..=1.0).contains(&self.popularity_placement_margin) {
            return Err(ScoringConfigError::PopularityPlacementMargin(self.popularity_placement_margin));
        }
        if !(0.0..=1.0).contains(&self.full_fleet_kv) {
            return Err(ScoringConfigError::FullFleetKv(self.full_fleet_kv));
        }
        if self.full_credit_tokens == 0 {
            return Err(ScoringConfigError::FullCreditTokens);
        }
        if self.load_horizon_ms == 0 {
            return Err(ScoringConfigError::LoadHorizon);
        }
        if !(self.ttft_spill_factor.is_finite() && self.ttft_spill_factor >= 1.0) {
            return Err(ScoringConfigError::TtftSpillFactor(self.ttft_spill_factor));
        }
        for c in &self.custom {
            match c {
                CustomScorerConfig::Cost { margin, .. } if !(0.0..=1.0).contains(margin) => {
                    return Err(ScoringConfigError::CustomSetting {
                        scorer: c.name(),
                        message: format!("margin must be in [0, 1] (a cacheMatchRatio gap), got {margin}"),
                    });
                }
                CustomScorerConfig::Cost { .. } => {}
            }
        }
        Ok(())
    }
}

/// The registration rule (docs/design.md §4): every weight finite and in [0,1], names unique, and
/// the sum 1.0 within 1e-6. The error names every weight and the sum.
pub fn validate_weights<N: AsRef<str>>(named: &[(N, f64)]) -> Result<(), ScoringConfigError> {
    let list = || named.iter().map(|(n, w)| format!("{}={w}", n.as_ref())).collect::<Vec<_>>().join(", ");
    for (i, (n, _)) in named.iter().enumerate() {
        if named[..i].iter().any(|(m, _)| m.as_ref() == n.as_ref()) {
            return Err(ScoringConfigError::DuplicateScorer { name: n.as_ref().to_string(), weights: list() });
        }
    }
    let sum: f64 = named.iter().map(|(_, w)| w).sum();
    let each_ok = named.iter().all(|(_, w)| w.is_finite() && (0.0..=1.0).contains(w));
    if !each_ok || !sum.is_finite() || (sum - 1.0).abs() > 1e-6 {
        return Err(ScoringConfigError::Weights { weights: list(), sum });
    }
    Ok(())
}

/// Invalid scoring configuration.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum ScoringConfigError {
    /// A weight outside [0,1] or a sum other than 1.
    #[error("scoring weights must each be in [0,1] and sum to 1.0 (±1e-6); got {weights} (sum {sum}): fix the weights")]
    Weights {
        /// Every weight as `name=value`.
        weights: String,
        /// Their sum.
        sum: f64,
    },
    /// `max_queue` of 0.
    #[error("scoring.max_queue must be at least 1 (requests)")]
    MaxQueue,
    /// `max_utilization` outside (0,1].
    #[error("scoring.max_utilization must be in (0, 1], got {0}")]
    MaxUtilization(f64),
    /// Threshold outside [0,1].
    #[error("scoring.health_exclusion_threshold must be in [0, 1], got {0}")]
    HealthThreshold(f64),
    /// `offload_credit` outside [0,1].
    #[error("scoring.offload_credit must be in [0, 1] (credit per CPU-tier block), got {0}")]
    OffloadCredit(f64),
    /// `pending_queue_share` outside [0,1].
    #[error("scoring.pending_queue_share must be in [0, 1] (a share of max_queue), got {0}")]
    PendingQueueShare(f64),
    /// `cold_placement_margin` outside [0,1].
    #[error("scoring.cold_placement_margin must be in [0, 1] (a gap in S), got {0}")]
    ColdPlacementMargin(f64),
    /// `popularity_placement_margin` outside [0,1].
    #[error("scoring.popularity_placement_margin must be in [0, 1] (a gap in S), got {0}")]
    PopularityPlacementMargin(f64),
    /// `full_fleet_kv` outside [0,1].
    #[error("scoring.full_fleet_kv must be in [0, 1] (a mean KV usage; 0 turns the rule off), got {0}")]
    FullFleetKv(f64),
    /// `full_credit_tokens` of 0.
    #[error("scoring.full_credit_tokens must be at least 1 (tokens)")]
    FullCreditTokens,
    /// `load_horizon_ms` of 0.
    #[error("scoring.load_horizon_ms must be at least 1 (ms)")]
    LoadHorizon,
    /// `ttft_spill_factor` below 1 (or not a number).
    #[error("scoring.ttft_spill_factor must be a number of at least 1, got {0}")]
    TtftSpillFactor(f64),
    /// `pile_guard_factor` below 1 (or not a number).
    #[error("scoring.pile_guard_factor must be a number of at least 1, got {0}")]
    PileGuardFactor(f64),
    /// Two scorers registered under one name.
    #[error("scorer '{name}' is registered twice ({weights}): scorer names must be unique")]
    DuplicateScorer {
        /// The repeated name.
        name: String,
        /// Every weight as `name=value`.
        weights: String,
    },
    /// A custom scorer's own setting is out of range.
    #[error("scoring.custom[{scorer}]: {message}")]
    CustomSetting {
        /// The scorer's name.
        scorer: &'static str,
        /// What is wrong.
        message: String,
    },
    /// `preset` names no preset.
    #[error("scoring.preset '{0}' is unknown; use one of chatbot, latency-api, batch, multi-lora, tokens-saved, ttft")]
    UnknownPreset(String),
}

/// Where a decision's per-pod matched blocks come from when not from the precise KV-event index:
/// approximate mode's record of earlier routing (docs/design.md §6). Given to [`Router::route_with`].
pub trait PrefixMatches: Sync {
    /// Consecutive blocks of the request's chain, from the first, that `pod` is taken to hold.
    fn matched_blocks(&self, pod: &str) -> u32;
}

/// One routing question.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// Base model (InferenceModel target): only pods serving it are candidates.
    pub model: &'a str,
    /// LoRA adapter name, if the InferenceModel names one.
    pub adapter: Option<&'a str>,
    /// Full chain of the prompt's full blocks (may be empty: then cache scores 0 everywhere).
    pub block_hashes: &'a [kvroute_common::BlockHash],
    /// Envoy subset hint: allowed "ip:port" endpoints (`None` = no restriction).
    pub subset: Option<&'a [String]>,
}

/// The outcome of [`Router::route`].
#[derive(Debug)]
pub struct Decision {
    /// Chosen pod name.
    pub pod: String,
    /// Its "ip:port".
    pub endpoint: String,
    /// Its composite score S in [0,1].
    pub score: f64,
    /// Its cacheMatchRatio in [0,1].
    pub match_ratio: f64,
    /// Consecutive blocks from the start it holds (indexed or pending).
    pub matched_blocks: u32,
    /// Of `matched_blocks`, those credited only because they were pending (docs/design.md §3).
    pub pending_blocks: u32,
    /// Full blocks in the request.
    pub total_blocks: u32,
    /// Candidates scored (after filters and spill).
    pub candidate_count: usize,
    /// The best candidates, the chosen pod first, then the next best in selection order: at most
    /// [`ORDERED_CANDIDATES`] (see [`Router::explain`] for all of them).
    pub candidates: Vec<CandidateScore>,
    /// The in-flight reservation: keep it for the life of the request.
    pub slot: InFlightSlot,
}

/// One candidate's composite score and factors (each factor unweighted, in [0,1]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateScore {
    /// Pod name (shared with the pool, not copied).
    pub pod: std::sync::Arc<str>,
    /// "ip:port" (shared with the pool, not copied).
    pub endpoint: std::sync::Arc<str>,
    /// Composite S in [0,1].
    pub score: f64,
    /// cacheMatchRatio.
    pub cache: f64,
    /// 1 − loadRatio.
    pub load: f64,
    /// 1 − min(queueDepth/maxQueue, 1).
    pub queue: f64,
    /// healthScore.
    pub health: f64,
    /// adapterMatch.
    pub adapter: f64,
    /// Custom scorers' factors `(name, factor)` in registration order (empty without any).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub custom: Vec<(&'static str, f64)>,
    /// Consecutive matched blocks from the start (indexed or pending).
    pub matched_blocks: u32,
    /// Of `matched_blocks`, those only pending (routed here, not yet confirmed by KV events).
    pub pending_blocks: u32,
    /// Blocks after `matched_blocks` held only in the pod's CPU tier (partial credit).
    pub offloaded_blocks: u32,
    /// The pod's predicted time to first token for this request, ms (`None`: its TTFT model has
    /// not learned yet). docs/design.md §4 "Load and predicted TTFT".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_ms: Option<f64>,
}

/// What [`Router::explain`] returns: the same computation as `route`, no reservation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    /// Candidates, best first.
    pub candidates: Vec<CandidateScore>,
    /// `(pod, reason)` for pods of the model that were not candidates.
    pub excluded: Vec<(String, String)>,
    /// The pod `route` would choose now (`None` when it would fail).
    pub choice: Option<String>,
}

/// Why no pod was chosen.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum RouteError {
    /// No pod can serve the request (→ 503).
    #[error("no candidate endpoint: {reason}")]
    NoCandidate {
        /// What excluded the pods.
        reason: String,
    },
    /// Every candidate is at max queue and shedding is configured (→ 429).
    #[error("overloaded: {reason}")]
    Shed {
        /// Which limit was hit.
        reason: String,
    },
}

/// What a scorer sees about one candidate pod.
#[derive(Debug, Clone, Copy)]
pub struct PodFacts<'a> {
    /// Pod name.
    pub name: &'a str,
    /// "ip:port".
    pub endpoint: &'a str,
    /// Consecutive blocks from the start of the request the pod holds (indexed or pending).
    pub matched_blocks: u32,
    /// Of `matched_blocks`, those credited only because they are pending (docs/design.md §3).
    pub pending_blocks: u32,
    /// Blocks after `matched_blocks` the pod holds only in its CPU tier, consecutively
    /// (docs/design.md §2 tiers): credited at `offload_credit` each.
    pub offloaded_blocks: u32,
    /// GPU utilization in [0,1].
    pub gpu_utilization: f64,
    /// loadRatio from in-flight work over learned capacity, in [0,1] (`load_source: inflight`);
    /// `None`: the load factor uses `gpu_utilization` (the seed's formula).
    pub in_flight_load: Option<f64>,
    /// Reported waiting + picker in-flight since the report (requests).
    pub queue_depth: u32,
    /// Health score in [0,1].
    pub health_score: f64,
    /// Reason for the health penalty ("" if healthy).
    pub health_reason: &'a str,
    /// vLLM KV-cache usage in [0,1].
    pub kv_cache_usage: f64,
    /// LoRA adapters running on the pod.
    pub running_adapters: &'a [String],
    /// Price of the pod in $/hour, from its `kvroute.io/cost-per-hour` annotation (`None` when
    /// absent or invalid).
    pub cost_per_hour: Option<f64>,
    /// The pod's operator annotations `(key, value)`, sorted by key, for custom scorers.
    pub annotations: &'a [(String, String)],
}

/// The request context every scorer sees, including every candidate's match result.
#[derive(Debug, Clone, Copy)]
pub struct ScoreContext<'a> {
    /// Requested LoRA adapter, if any.
    pub adapter: Option<&'a str>,
    /// Full blocks in the request.
    pub total_blocks: u32,
    /// Tokens per block (the `tokens_saved` cache factor converts `full_credit_tokens` with it).
    pub block_size: u32,
    /// Scoring settings.
    pub config: &'a ScoringConfig,
    /// Every candidate (after filtering).
    pub candidates: &'a [PodFacts<'a>],
}

/// What a scorer derives once per decision from the whole candidate set before scoring each pod
/// (e.g. the best match ratio among candidates), so per-pod scoring stays O(1). Four numbers,
/// meaning private to the scorer; `Copy`, no allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Prepared(pub [f64; 4]);

/// A scoring factor (docs/design.md §4): request context + pod state → score in [0,1] + explanation.
/// Implementations must return a value in [0,1] for every input (the router clamps, and counts
/// NaN as 0, anyway) and must not allocate in `prepare` or `score` (hot path).
pub trait Scorer: Send + Sync + std::fmt::Debug {
    /// Short name, as used in config weights and explanations; unique among registered scorers.
    fn name(&self) -> &'static str;
    /// Once per decision, over every candidate (`ctx.candidates`). Default: nothing.
    fn prepare(&self, _ctx: &ScoreContext<'_>) -> Prepared {
        Prepared::default()
    }
    /// The factor in [0,1]; `prep` is what [`Scorer::prepare`] returned for this decision.
    fn score(&self, ctx: &ScoreContext<'_>, prep: &Prepared, pod: &PodFacts<'_>) -> f64;
    /// The factor of every candidate: `out[i]` for `ctx.candidates[i]` (`out` has exactly one
    /// slot per candidate). This is what a decision calls, once per scorer, so the per-pod loop
    /// is monomorphised (no dynamic call per pod). Default: [`Scorer::score`] per candidate;
    /// overriding it must not change the values.
    fn score_all(&self, ctx: &ScoreContext<'_>, prep: &Prepared, out: &mut [f64]) {
        for (o, pod) in out.iter_mut().zip(ctx.candidates) {
            *o = self.score(ctx, prep, pod);
        }
    }
    /// A short human explanation of the factor for this pod (explain endpoint, DEBUG logs).
    fn explain(&self, ctx: &ScoreContext<'_>, prep: &Prepared, pod: &PodFacts<'_>) -> String {
        format!("{:.3}", self.score(ctx, prep, pod))
    }
}

#[cfg(test)]
mod seed_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod ttft_tests;
