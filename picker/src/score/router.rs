//! [`Router`]: one routing decision end to end (prefix walk → filter → score → select → reserve),
//! and the [`InFlightSlot`] that a decision holds for the life of its request.
//!
//! Concurrency: the prefix walk and the static filters read arc-swap snapshots without locks; the
//! queue-depth read, spill, scoring, choice and reservation run under `Pool::select_lock` (a
//! `parking_lot::Mutex<()>`, never held across an await), so two concurrent decisions can never
//! both miss each other's reservation. `explain` does the same without the lock or a reservation.

use std::cell::RefCell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::trace;

use super::filter::{self, Exclusion, Spill};
use super::select::{self, Ranked};
use super::{
    AdapterAffinityScorer, CandidateScore, Decision, Explanation, HealthScorer, LoadScorer, PodFacts,
    PrefixCacheScorer, PrefixMatches, Prepared, QueueDepthScorer, RouteError, RouteRequest, ScoreContext, Scorer,
    ScoringConfig, ScoringConfigError, load_ratio, validate_weights,
};
use crate::index::MatchScratch;
use crate::pool::{PodRecord, PodStatus, Pool, now_unix_ms};

thread_local! {
    static SCRATCH: RefCell<MatchScratch> = RefCell::new(MatchScratch::default());
}

/// Scores candidate pods and picks one. Cheap to share (`Arc<Router>`); `route` is `&self`.
#[derive(Debug)]
pub struct Router {
    pool: Arc<Pool>,
    config: ScoringConfig,
    /// The five built-ins, in `Weights::named` order, then the custom scorers, with weights.
    scorers: Vec<(Box<dyn Scorer>, f64)>,
    /// Decisions made; mixed with the seed for the random tie-break.
    decisions: AtomicU64,
}

/// Held for the life of the request. Dropping it (stream ended, any way) releases the pod's
/// in-flight count.
pub struct InFlightSlot {
    rec: Arc<PodRecord>,
    id: u64,
    routed_ms: i64,
    /// Predicted cached prompt tokens (matched blocks × block size).
    predicted_tokens: u64,
    block_size: u64,
}

impl fmt::Debug for InFlightSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightSlot")
            .field("pod", &self.rec.name)
            .field("id", &self.id)
            .field("routed_ms", &self.routed_ms)
            .field("predicted_tokens", &self.predicted_tokens)
            .finish()
    }
}

impl InFlightSlot {
    /// Called when the engine's usage arrives: returns true when the routing was stale (actual
    /// cached tokens < predicted matched tokens by more than one block, SPEC §5).
    pub fn observe_cached_tokens(&self, cached_tokens: u32) -> bool {
        self.predicted_tokens > u64::from(cached_tokens) + self.block_size
    }

    /// The pod this slot is reserved on.
    pub fn pod(&self) -> &str {
        &self.rec.name
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        self.rec.inflight.release(self.routed_ms, self.id);
    }
}

/// A pod that passed the static filters.
struct Pre<'t> {
    rec: &'t Arc<PodRecord>,
    status: Arc<PodStatus>,
    matched: u32,
}

struct Scored {
    candidates: Vec<CandidateScore>,
    /// Index into `candidates` of the choice (before sorting).
    ranked: Vec<Ranked>,
    choice: Option<usize>,
}

impl Router {
    /// A router over `pool` with the five built-in scorers and the custom scorers of
    /// `config.custom`. Fails when `config` is invalid.
    pub fn new(pool: Arc<Pool>, config: ScoringConfig) -> Result<Router, ScoringConfigError> {
        Router::with_scorers(pool, config, Vec::new())
    }

    /// Like [`Router::new`], plus `extra` custom scorers registered in code with their weights
    /// (seed §12). The sum rule covers all of them: built-in + `config.custom` + `extra` weights
    /// must sum to 1.0 (±1e-6), each in [0,1], names unique; otherwise the error names every
    /// weight and the sum.
    pub fn with_scorers(
        pool: Arc<Pool>,
        config: ScoringConfig,
        extra: Vec<(Box<dyn Scorer>, f64)>,
    ) -> Result<Router, ScoringConfigError> {
        config.validate_settings()?;
        let w = config.weights;
        let mut scorers: Vec<(Box<dyn Scorer>, f64)> = vec![
            (Box::new(PrefixCacheScorer), w.cache),
            (Box::new(LoadScorer), w.load),
            (Box::new(QueueDepthScorer), w.queue),
            (Box::new(HealthScorer), w.health),
            (Box::new(AdapterAffinityScorer), w.adapter),
        ];
        scorers.extend(config.custom.iter().map(|c| (c.build(), c.weight())));
        scorers.extend(extra);
        let named: Vec<(&str, f64)> = scorers.iter().map(|(s, w)| (s.name(), *w)).collect();
        validate_weights(&named)?;
        Ok(Router { pool, config, scorers, decisions: AtomicU64::new(0) })
    }

    /// Names and weights of every registered scorer, built-ins first.
    pub fn weights(&self) -> Vec<(&'static str, f64)> {
        self.scorers.iter().map(|(s, w)| (s.name(), *w)).collect()
    }

    /// The scoring settings in use.
    pub fn config(&self) -> &ScoringConfig {
        &self.config
    }

    /// Scores every candidate pod and reserves an in-flight slot on the chosen one atomically.
    /// Matched blocks come from the precise KV-event index.
    pub fn route(&self, req: &RouteRequest<'_>) -> Result<Decision, RouteError> {
        self.route_with(req, None)
    }

    /// Like [`Router::route`], with a second source of matched blocks (approximate mode, SPEC §6):
    /// a pod's count is the larger of the index walk's (what KV events proved) and `matches`' (what
    /// earlier routing suggests). A text chain never matches the index (its own hash domain), so
    /// that walk ends at the first block; token-id prompts keep the index's exact answer.
    pub fn route_with(
        &self,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
    ) -> Result<Decision, RouteError> {
        let total_blocks = u32::try_from(req.block_hashes.len()).unwrap_or(u32::MAX);
        let table = self.pool.table.load();
        let (pre, excluded, model_pods) = self.prefilter(&table.pods, req, matches);
        if pre.is_empty() {
            return Err(no_candidate(req.model, model_pods, &excluded));
        }
        let tick = self.decisions.fetch_add(1, Ordering::Relaxed);
        let guard = self.pool.select_lock.lock();
        let (scored, pre, spilled) = self.score(pre, req, total_blocks, tick)?;
        let Some(choice) = scored.choice else {
            drop(guard);
            return Err(no_candidate(req.model, model_pods, &[excluded, spilled].concat()));
        };
        let chosen = &pre[choice];
        let id = self.pool.next_slot_id();
        let routed_ms = now_unix_ms();
        chosen.rec.inflight.reserve(routed_ms, id);
        drop(guard);

        let block_size = match chosen.status.block_size {
            0 => self.pool.config().block_size as u64,
            b => u64::from(b),
        };
        let slot = InFlightSlot {
            rec: chosen.rec.clone(),
            id,
            routed_ms,
            predicted_tokens: u64::from(chosen.matched) * block_size,
            block_size,
        };
        let best = scored.candidates[choice].clone();
        let candidates = sort_best_first(scored.candidates, &scored.ranked, choice, ORDERED_CANDIDATES);
        trace!(pod = %best.pod, score = best.score, matched = best.matched_blocks, total_blocks, "routed");
        Ok(Decision {
            pod: best.pod,
            endpoint: best.endpoint,
            score: best.score,
            match_ratio: best.cache,
            matched_blocks: best.matched_blocks,
            total_blocks,
            candidates,
            slot,
        })
    }

    /// Same computation as [`Router::route`], no reservation, no state change (explain endpoint).
    pub fn explain(&self, req: &RouteRequest<'_>) -> Explanation {
        let total_blocks = u32::try_from(req.block_hashes.len()).unwrap_or(u32::MAX);
        let table = self.pool.table.load();
        let (pre, excluded, _) = self.prefilter(&table.pods, req, None);
        let mut excluded: Vec<(String, String)> =
            excluded.into_iter().map(|(name, why)| (name.to_string(), why.to_string())).collect();
        if pre.is_empty() {
            return Explanation { candidates: Vec::new(), excluded, choice: None };
        }
        let tick = self.decisions.load(Ordering::Relaxed);
        match self.score(pre, req, total_blocks, tick) {
            Ok((scored, _pre, spilled)) => {
                excluded.extend(spilled.into_iter().map(|(n, why)| (n.to_string(), why.to_string())));
                let choice_name = scored.choice.map(|c| scored.candidates[c].pod.clone());
                let candidates = match scored.choice {
                    Some(c) => sort_best_first(scored.candidates, &scored.ranked, c, usize::MAX),
                    None => scored.candidates,
                };
                Explanation { candidates, excluded, choice: choice_name }
            }
            Err(RouteError::Shed { reason }) => {
                excluded.push((String::new(), reason));
                Explanation { candidates: Vec::new(), excluded, choice: None }
            }
            Err(RouteError::NoCandidate { reason }) => {
                excluded.push((String::new(), reason));
                Explanation { candidates: Vec::new(), excluded, choice: None }
            }
        }
    }

    /// Prefix walk + static filters. Returns candidates, exclusions and how many pods serve the
    /// model at all.
    fn prefilter<'t>(
        &self,
        pods: &'t [Arc<PodRecord>],
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
    ) -> (Vec<Pre<'t>>, Vec<(&'t str, Exclusion)>, usize) {
        let index = self.pool.index.load();
        let grace = Duration::from_millis(self.pool.config().grace_ttl_ms);
        let now = Instant::now();
        let mut pre = Vec::with_capacity(pods.len());
        let mut excluded = Vec::new();
        let mut model_pods = 0;
        let mut walk = |scratch: &mut MatchScratch| {
            index.match_prefix(req.block_hashes, scratch);
            for rec in pods {
                let status = rec.status.load_full();
                if status.model != req.model {
                    continue;
                }
                model_pods += 1;
                match filter::exclusion(&status, req.subset, self.config.health_exclusion_threshold, grace, now) {
                    Some(why) => excluded.push((rec.name.as_str(), why)),
                    None => {
                        let indexed = scratch.matched(rec.idx);
                        let matched = matches.map_or(indexed, |m| indexed.max(m.matched_blocks(&rec.name)));
                        pre.push(Pre { rec, status, matched });
                    }
                }
            }
        };
        let done = SCRATCH.with(|s| match s.try_borrow_mut() {
            Ok(mut scratch) => {
                walk(&mut scratch);
                true
            }
            Err(_) => false,
        });
        if !done {
            walk(&mut MatchScratch::default());
        }
        (pre, excluded, model_pods)
    }

    /// Every scorer's `prepare` for this decision, in registration order.
    pub fn prepare(&self, ctx: &ScoreContext<'_>) -> Vec<Prepared> {
        self.scorers.iter().map(|(s, _)| s.prepare(ctx)).collect()
    }

    /// Each factor (unweighted, in [0,1]; built-ins first, in `Weights::named` order, then the
    /// custom ones) and the composite S in [0,1] for `pod`. Runs every scorer's `prepare` over
    /// `ctx.candidates` first: for tests and tools; `route` prepares once per decision.
    pub fn composite(&self, ctx: &ScoreContext<'_>, pod: &PodFacts<'_>) -> (Vec<f64>, f64) {
        let preps = self.prepare(ctx);
        let mut factors = vec![0.0; self.scorers.len()];
        let s = self.composite_into(ctx, &preps, pod, &mut factors);
        (factors, s)
    }

    /// Per-scorer explanations for `pod`: `(name, weight, factor, text)`.
    pub fn explain_factors(&self, ctx: &ScoreContext<'_>, pod: &PodFacts<'_>) -> Vec<(&'static str, f64, f64, String)> {
        let preps = self.prepare(ctx);
        self.scorers
            .iter()
            .zip(&preps)
            .map(|((s, w), p)| (s.name(), *w, clamp_factor(s.score(ctx, p, pod)), s.explain(ctx, p, pod)))
            .collect()
    }

    /// S for `pod`, writing each factor into `factors` (one slot per scorer).
    fn composite_into(
        &self,
        ctx: &ScoreContext<'_>,
        preps: &[Prepared],
        pod: &PodFacts<'_>,
        factors: &mut [f64],
    ) -> f64 {
        let mut s = 0.0;
        for (((scorer, w), prep), slot) in self.scorers.iter().zip(preps).zip(factors.iter_mut()) {
            let v = clamp_factor(scorer.score(ctx, prep, pod));
            *slot = v;
            s += w * v;
        }
        s.clamp(0.0, 1.0)
    }

    /// Spill, factor scores, composite, choice. Call under the selection lock when reserving.
    #[allow(clippy::type_complexity)]
    fn score<'t>(
        &self,
        pre: Vec<Pre<'t>>,
        req: &RouteRequest<'_>,
        total_blocks: u32,
        tick: u64,
    ) -> Result<(Scored, Vec<Pre<'t>>, Vec<(&'t str, Exclusion)>), RouteError> {
        let depths: Vec<u32> = pre.iter().map(|p| p.rec.queue_depth(&p.status)).collect();
        let max_queue = self.config.max_queue;
        let mut spilled = Vec::new();
        let (pre, depths): (Vec<Pre<'t>>, Vec<u32>) = match filter::spill(&depths, max_queue) {
            Spill::AllSaturated if self.config.shed_when_saturated => {
                return Err(RouteError::Shed {
                    reason: format!("all {} candidate pods have queue depth >= max_queue {max_queue}", pre.len()),
                });
            }
            Spill::AllSaturated => (pre, depths),
            Spill::KeepBelow => {
                let mut keep = Vec::with_capacity(pre.len());
                let mut keep_d = Vec::with_capacity(pre.len());
                for (p, d) in pre.into_iter().zip(depths) {
                    if d < max_queue {
                        keep.push(p);
                        keep_d.push(d);
                    } else {
                        spilled.push((p.rec.name.as_str(), Exclusion::QueueFull { depth: d, max: max_queue }));
                    }
                }
                (keep, keep_d)
            }
        };
        let facts: Vec<PodFacts<'_>> = pre
            .iter()
            .zip(&depths)
            .map(|(p, d)| {
                let stats = p.status.stats.as_ref();
                PodFacts {
                    name: &p.rec.name,
                    endpoint: &p.status.endpoint,
                    matched_blocks: p.matched,
                    gpu_utilization: stats.map_or(1.0, |s| s.gpu_utilization),
                    queue_depth: *d,
                    health_score: stats.map_or(0.0, |s| s.health_score),
                    health_reason: stats.map_or("", |s| s.health_reason.as_str()),
                    kv_cache_usage: stats.map_or(0.0, |s| s.kv_cache_usage),
                    running_adapters: stats.map_or(&[], |s| s.running_adapters.as_slice()),
                    cost_per_hour: p.status.cost_per_hour,
                    annotations: &p.status.annotations,
                }
            })
            .collect();
        let ctx = ScoreContext { adapter: req.adapter, total_blocks, config: &self.config, candidates: &facts };
        let salt = select::splitmix64(self.config.seed ^ select::splitmix64(tick));
        let preps = self.prepare(&ctx);
        let mut factors = vec![0.0; self.scorers.len()];
        let mut candidates = Vec::with_capacity(facts.len());
        let mut ranked = Vec::with_capacity(facts.len());
        for (i, f) in facts.iter().enumerate() {
            let s = self.composite_into(&ctx, &preps, f, &mut factors);
            let custom = match factors.get(5..) {
                Some(rest) if !rest.is_empty() => {
                    self.scorers[5..].iter().zip(rest).map(|((sc, _), v)| (sc.name(), *v)).collect()
                }
                _ => Vec::new(),
            };
            ranked.push(Ranked {
                score: s,
                load_ratio: load_ratio(f.gpu_utilization, self.config.max_utilization),
                queue_depth: f.queue_depth,
                tie_key: select::splitmix64(salt ^ u64::from(pre[i].rec.idx.0)),
            });
            candidates.push(CandidateScore {
                pod: f.name.to_string(),
                endpoint: f.endpoint.to_string(),
                score: s,
                cache: factors[0],
                load: factors[1],
                queue: factors[2],
                health: factors[3],
                adapter: factors[4],
                custom,
                matched_blocks: f.matched_blocks,
            });
        }
        let choice = select::best(&ranked);
        Ok((Scored { candidates, ranked, choice }, pre, spilled))
    }
}

/// A factor clamped to [0,1], NaN → 0.
fn clamp_factor(v: f64) -> f64 {
    if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) }
}

/// How many candidates a routing [`Decision`] lists in selection order (the rest follow
/// unordered): sorting all of a 1000-pod fleet on every request costs more than scoring it.
pub const ORDERED_CANDIDATES: usize = 16;

/// Candidates with `choice` first, then the best `ordered − 1` others in selection order, then
/// the rest in no particular order (`usize::MAX`: all ordered).
fn sort_best_first(
    candidates: Vec<CandidateScore>,
    ranked: &[Ranked],
    choice: usize,
    ordered: usize,
) -> Vec<CandidateScore> {
    let mut order: Vec<usize> = (0..candidates.len()).filter(|i| *i != choice).collect();
    let cmp = |a: &usize, b: &usize| select::better(&ranked[*a], &ranked[*b]);
    let k = ordered.saturating_sub(1);
    if k < order.len() {
        if k > 0 {
            order.select_nth_unstable_by(k - 1, cmp);
            order[..k].sort_unstable_by(cmp);
        }
    } else {
        // Keys are unique (the random tie key decides last), so unstable is deterministic.
        order.sort_unstable_by(cmp);
    }
    let mut slots: Vec<Option<CandidateScore>> = candidates.into_iter().map(Some).collect();
    std::iter::once(choice).chain(order).filter_map(|i| slots.get_mut(i).and_then(Option::take)).collect()
}

fn no_candidate(model: &str, model_pods: usize, excluded: &[(&str, Exclusion)]) -> RouteError {
    if model_pods == 0 {
        return RouteError::NoCandidate { reason: format!("no pod serves model '{model}'") };
    }
    let list = excluded.iter().take(8).map(|(n, why)| format!("{n}: {why}")).collect::<Vec<_>>().join("; ");
    let more = excluded.len().saturating_sub(8);
    let tail = if more > 0 { format!("; and {more} more") } else { String::new() };
    RouteError::NoCandidate { reason: format!("all {model_pods} pods of model '{model}' are excluded ({list}{tail})") }
}
