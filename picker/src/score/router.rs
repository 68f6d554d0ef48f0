//! [`Router`]: one routing decision end to end. Its stages, one method each, in order:
//!
//! 1. `prefilter`: the prefix walk and the static filters (lock-free) make the rows;
//! 2. `overlay_precise` (precise mode): pending chains and the CPU tier added to each row's match;
//! 3. `overlay_load`: queue depth, load, GPU utilization and prefill left, under the lock;
//! 4. `spill`: rows at `max_queue` leave (or the decision is shed); while the fleet is full,
//!    the rows holding the most of a prefix that is not hot stay (`mark_full_fleet`);
//! 5. `cap_pending`: pending credit withheld from rows queued far above the least queued;
//! 6. `predict`: every row's in-flight load and predicted TTFT from its pod's learned model, and
//!    the `x-slo-ttft-ms` filter (docs/design.md §4 "Load and predicted TTFT"); with
//!    `spill_rule: ttft` steps 5 and 6 come before the spill, which then keeps a full row
//!    predicted fastest (`kept_by_time`);
//! 7. `compose`: the factors and the composite S of every row;
//! 8. `tie_keys`: the keys after S (cold prefill left, a seeded random key);
//! 9. `choose`: the best row by S and the tie rules (`select.rs`), or by predicted TTFT
//!    (`spill_rule: ttft`, or an SLO no row is predicted to meet);
//! 10. `place_cold`: a request no row holds a block of goes, among the rows within
//!     `cold_placement_margin` of the choice's S, to the least routed rate plus cached blocks;
//!     while the recent prefixes are equally popular, among the rows within the wider
//!     `popularity_placement_margin` to the fewest cached blocks (docs/design.md §4 "Where a
//!     new prefix goes");
//! 11. `pile_guard`: the least loaded row instead, when the choice carries far more requests
//!     (unless its prefix is not hot and the choice is predicted far faster with KV room, or
//!     the fleet is full);
//! 12. `route_in` (routing only): the chain recorded pending, the event published to peers and an
//!     in-flight slot reserved on the chosen pod, with the work the TTFT model learns from.
//!
//! Concurrency: the prefix walk and the static filters read arc-swap snapshots without locks; the
//! queue-depth read, spill, scoring, choice and reservation run under the pool's selection lock
//! ([`Pool::lock_selection`], never held across an await), so two concurrent decisions can never
//! both miss each other's reservation. `explain` does the same without the lock or a reservation.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tracing::trace;

use super::filter::{self, Exclusion, Spill};
use super::popularity::{POPULARITY_ROOTS, PrefixPopularity};
use super::select::{self, Ranked};
use super::{
    AdapterAffinityScorer, CandidateScore, Decision, Explanation, HealthScorer, LoadScorer, PodFacts,
    PrefixCacheScorer, PrefixMatches, Prepared, QueueDepthScorer, RouteError, RouteRequest, ScoreContext, Scorer,
    ScoringConfig, ScoringConfigError, validate_weights,
};
use super::{DECODE_TOKENS_PER_REQUEST, LoadSource, SolvedFit, SpillRule, TtftLine, load::pod_load_ratio};
use crate::index::{IndexSnapshot, MatchScratch, PodIdx};
use crate::pending::{Clock, LOCAL, Origin, ReplicaEvent, SharedState, SharedView, SystemClock};
use crate::pool::{Membership, PodTable, Pool, stale_before};

/// Scores candidate pods and picks one. Cheap to share (`Arc<Router>`); `route` is `&self`.
#[derive(Debug)]
pub struct Router {
    pool: Arc<Pool>,
    config: ScoringConfig,
    /// The five built-ins, in `Weights::named` order, then the custom scorers, with weights.
    scorers: Vec<(Box<dyn Scorer>, f64)>,
    /// Decisions made; mixed with the seed for the random tie-break.
    decisions: AtomicU64,
    /// Pending chains, peers' in-flight requests, the replica event stream, the clock.
    shared: Arc<SharedView>,
    /// How unequal the prefixes' popularity is, from the roots of the requests routed here.
    popularity: PrefixPopularity,
}

/// A pod of the requested model that passed the static filters, for one decision.
struct Row {
    /// Index into the pod table the decision loaded.
    pod: u32,
    /// The pod's slot in the prefix index and the pending and peer tables, copied from its
    /// record so the later stages need not load the record again.
    slot: PodIdx,
    /// Blocks credited by the index (or approximate matches): the pod's frontier.
    matched: u32,
    /// Blocks after the frontier the pod holds pending (docs/design.md §3).
    pending: u32,
    /// Blocks after the credited ones the pod holds only in its CPU tier (docs/design.md §2).
    offloaded: u32,
    /// The CPU tier's consecutive match from the chain's start (`offloaded` is what it adds).
    cpu: u32,
    /// queueDepth, read under the selection lock (peers' in-flight requests included).
    depth: u32,
    /// Requests on the pod: reported running + `depth` (the pile guard's measure).
    load: u32,
    /// GPU utilization as loadRatio counts it: the report's, brought forward by the requests
    /// routed since (docs/design.md §4), in [0, 1].
    utilization: f64,
    /// Blocks the requests still prefilling there have left to compute (precise mode; the tie
    /// break of a request no candidate holds any of, docs/design.md §4).
    prefill: u32,
    /// Index blocks per engine block of the pod: every credit ends on a whole engine block,
    /// since the engine caches (and its usage counts) nothing smaller.
    per: u32,
    /// The pod's in-flight work, tokens: prefill left of the requests routed there and not yet
    /// confirmed computed, plus a decode share per reported running request.
    work: f64,
    /// That work plus this request's uncached tokens: what the TTFT model predicts from.
    ttft_work: f64,
    /// Predicted TTFT, ms (`None`: the pod's model has not learned yet).
    predicted: Option<f64>,
    /// loadRatio from in-flight work (`None`: the seed's formula).
    in_flight_load: Option<f64>,
    /// The pod's reported KV cache usage, in [0, 1] (0 without a report).
    kv: f64,
    /// The fleet is full and this row holds the most of the request's blocks (before any
    /// pending credit is withheld): see [`Router::mark_full_fleet`].
    holds_most: bool,
    /// The row stayed at `max_queue` only because the fleet is full
    /// ([`Router::spill`]).
    kept_full: bool,
}

impl Row {
    /// Blocks credited in all: indexed, then pending.
    fn credited(&self) -> u32 {
        self.matched.saturating_add(self.pending)
    }
}

/// The five built-in scorers come first in `Router::scorers`.
const BUILTINS: usize = 5;

/// Per-thread buffers of one decision, kept between decisions so that a decision allocates only
/// its result (the chosen pod's names and the short candidate list).
#[derive(Default)]
struct Scratch {
    walk: MatchScratch,
    /// The CPU tier's walk (docs/design.md §2 tiers).
    cpu_walk: MatchScratch,
    rows: Vec<Row>,
    /// Each row's S and the keys after it, as the choice compares them.
    scored: Vec<Ranked>,
    /// `(pod table index, why)`: static exclusions first, then spilled pods.
    excluded: Vec<(u32, Exclusion)>,
    preps: Vec<Prepared>,
    /// Factor columns, one per scorer (the built-ins in `Weights::named` order, then the custom
    /// ones), `rows.len()` each: scorer j's factor of row i is `columns[j · rows.len() + i]`.
    columns: Vec<f64>,
    /// The best rows in selection order, when the choice was made by S (see [`TOP_ROWS`]).
    top: Vec<u32>,
    /// Every row's weighted sum of its factors (S before the clamp).
    totals: Vec<f64>,
    order: Vec<u32>,
    /// Always empty between decisions: only its allocation is kept (see [`recycle`]).
    facts: Vec<PodFacts<'static>>,
    /// `(pod, frontier)` per row, and the pending extension per row.
    frontiers: Vec<(PodIdx, u32)>,
    extension: Vec<u32>,
    /// Precise mode: the pending table's list of requests still prefilling is current and
    /// counts (approximate mode reads none).
    precise: bool,
    /// `(routed rate, cached blocks)` per row, for a new prefix's placement.
    shares: Vec<(f64, f64)>,
    /// Each row's pod's solved TTFT fit, copied for the prediction.
    fits: Vec<SolvedFit>,
    /// The fleet is full for this request ([`Router::mark_full_fleet`]), so the pods holding most
    /// of its prefix keep it.
    full_fleet: bool,
    /// The sum of the candidates' KV usage over their fresh reports, and how many those are
    /// (read by `overlay_load`, for [`Router::mark_full_fleet`]).
    fresh_kv: (f64, u32),
}

impl Scratch {
    /// Scorer `j`'s factor of row `i`, as composed (0 for a row or scorer without one).
    fn factor(&self, i: usize, j: usize) -> f64 {
        let n = self.rows.len();
        debug_assert_eq!(self.scored.len(), n, "rows changed after their factors were composed");
        if i < n { self.columns.get(j * n + i).copied().unwrap_or(0.0) } else { 0.0 }
    }

    /// Forgets the last decision, keeping the allocations.
    fn clear(&mut self) {
        self.rows.clear();
        self.scored.clear();
        self.excluded.clear();
        self.order.clear();
        self.top.clear();
        self.precise = false;
        self.full_fleet = false;
        self.fresh_kv = (0.0, 0);
        self.shares.clear();
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` on this thread's buffers (fresh ones if a scorer re-enters the router), cleared after.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut sc) => {
            sc.clear();
            let r = f(&mut sc);
            sc.clear();
            r
        }
        Err(_) => f(&mut Scratch::default()),
    })
}

/// An empty vector of another lifetime that keeps `v`'s allocation (an in-place collect that
/// moves no element), so the per-decision `PodFacts` list needs no allocation.
#[allow(clippy::unnecessary_filter_map)] // `filter` would keep the old lifetime: the point is to change it
fn recycle<'b>(mut v: Vec<PodFacts<'_>>) -> Vec<PodFacts<'b>> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// The best of rows `among` by [`select::better`] (the first of equals); `None` when empty.
fn choose(scored: &[Ranked], among: impl Iterator<Item = usize>) -> Option<usize> {
    let mut best: Option<usize> = None;
    for i in among {
        best = match best {
            Some(b) if select::better(&scored[i], &scored[b]) != std::cmp::Ordering::Less => Some(b),
            _ => Some(i),
        };
    }
    best
}

/// The best row by [`select::better`], as [`choose`] over every row, keeping the best
/// [`TOP_ROWS`] in `sc.top` for the candidate list ([`rank`]); `None` without rows.
fn choose_keeping_top(sc: &mut Scratch) -> Option<usize> {
    let n = u32::try_from(sc.scored.len()).unwrap_or(u32::MAX);
    best_of(&sc.scored, 0..n, TOP_ROWS, &mut sc.top);
    sc.top.first().map(|&i| i as usize)
}

/// Whether `a` ranks before `b` (see [`select::better`]).
fn ahead(scored: &[Ranked], a: u32, b: u32) -> bool {
    select::better(&scored[a as usize], &scored[b as usize]) == std::cmp::Ordering::Less
}

/// Fills `best` with the best `k` of rows `among` in selection order (all of them when `k` is
/// at least their number). The short list is kept by insertion (one comparison for most rows),
/// so a 1000-pod decision does not sort its fleet.
fn best_of(scored: &[Ranked], among: impl Iterator<Item = u32>, k: usize, best: &mut Vec<u32>) {
    best.clear();
    if k >= scored.len() {
        best.extend(among);
        // Keys are unique (the random tie key decides last), so unstable is deterministic.
        best.sort_unstable_by(|a, b| select::better(&scored[*a as usize], &scored[*b as usize]));
        return;
    }
    if k == 0 {
        return;
    }
    for i in among {
        if best.len() == k {
            match best.last() {
                Some(&worst) if ahead(scored, i, worst) => {
                    best.pop();
                }
                _ => continue,
            }
        }
        let at = best.partition_point(|&o| ahead(scored, o, i));
        best.insert(at, i);
    }
}

/// Fills `order` with `choice`, then the best `ordered − 1` other candidates in selection order
/// (`usize::MAX`: every candidate). `top`: the best [`TOP_ROWS`] of all rows in selection order,
/// when the decision kept them (else empty); the best others are then among them.
fn rank(scored: &[Ranked], order: &mut Vec<u32>, choice: usize, ordered: usize, top: &[u32]) {
    let k = ordered.saturating_sub(1);
    let choice32 = u32::try_from(choice).unwrap_or(u32::MAX);
    if !top.is_empty() && k < TOP_ROWS {
        // Without the choice, at least `TOP_ROWS − 1 ≥ k` of the best remain, or every other row.
        order.clear();
        order.extend(top.iter().copied().filter(|&i| i != choice32).take(k));
    } else {
        let others = (0..scored.len()).filter(|i| *i != choice).filter_map(|i| u32::try_from(i).ok());
        best_of(scored, others, k, order);
    }
    order.insert(0, choice32);
}

/// Rows a decision keeps in selection order when it chooses by S: the candidate list's
/// [`ORDERED_CANDIDATES`] and one more, so the list is complete whichever of them is chosen.
const TOP_ROWS: usize = ORDERED_CANDIDATES + 1;

impl Router {
    /// A router over `pool` with the five built-in scorers and the custom scorers of
    /// `config.custom`. Fails when `config` is invalid.
    pub fn new(pool: Arc<Pool>, config: ScoringConfig) -> Result<Router, ScoringConfigError> {
        Router::with_scorers(pool, config, Vec::new())
    }

    /// Like [`Router::new`], on `clock` instead of the wall clock: pending chains expire and
    /// in-flight reservations are stamped by it (the simulator replays its own time through it).
    pub fn with_clock(
        pool: Arc<Pool>,
        config: ScoringConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Router, ScoringConfigError> {
        Router::with_parts(pool, config, Vec::new(), clock)
    }

    /// Like [`Router::new`], plus `extra` custom scorers registered in code with their weights
    /// (docs/design.md §4). The sum rule covers all of them: built-in + `config.custom` + `extra` weights
    /// must sum to 1.0 (±1e-6), each in [0,1], names unique; otherwise the error names every
    /// weight and the sum.
    pub fn with_scorers(
        pool: Arc<Pool>,
        config: ScoringConfig,
        extra: Vec<(Box<dyn Scorer>, f64)>,
    ) -> Result<Router, ScoringConfigError> {
        Router::with_parts(pool, config, extra, Arc::new(SystemClock))
    }

    fn with_parts(
        pool: Arc<Pool>,
        config: ScoringConfig,
        extra: Vec<(Box<dyn Scorer>, f64)>,
        clock: Arc<dyn Clock>,
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
        let shared = Arc::new(SharedView::new(config.pending_ttl_ms, config.pending_max_blocks, clock));
        Ok(Router {
            pool,
            config,
            scorers,
            decisions: AtomicU64::new(0),
            shared,
            popularity: PrefixPopularity::new(POPULARITY_ROOTS),
        })
    }

    /// Pending chains, peers' in-flight requests and the replica event stream.
    pub fn shared(&self) -> &Arc<SharedView> {
        &self.shared
    }

    /// Applies a peer replica's event (see [`SharedView::apply_peer`]; an `Unreachable` marks the
    /// pod, [`Pool::mark_unreachable`]); false when it names a pod this replica does not know.
    pub fn apply_peer(&self, origin: Origin, ev: &ReplicaEvent) -> bool {
        if let ReplicaEvent::Unreachable { pod } = ev {
            return origin != LOCAL && self.pool.mark_unreachable(pod);
        }
        let table = self.pool.table.load();
        self.shared.apply_peer(origin, ev, |name| table.pods.iter().find(|p| *p.name == *name).map(|p| p.idx))
    }

    /// A peer subscribes to this replica's events: a snapshot and the live stream (see
    /// [`SharedView::subscribe`]), the snapshot ending with an `Unreachable` for every pod marked
    /// here; `None` unless replication is on. A pod marked between the two reaches the peer twice
    /// (marks are idempotent), never not at all: a mark is set before it is published.
    pub fn subscribe_peer(&self) -> Option<(Vec<ReplicaEvent>, tokio::sync::broadcast::Receiver<ReplicaEvent>)> {
        let table = self.pool.table.load();
        let (mut snapshot, rx) =
            self.shared.subscribe(|idx| table.pods.iter().find(|p| p.idx == idx).map(|p| p.name.clone()))?;
        // Read after the subscription exists (the marks are atomics, read now).
        snapshot.extend(
            table.pods.iter().filter(|p| p.is_unreachable()).map(|p| ReplicaEvent::Unreachable { pod: p.name.clone() }),
        );
        Some((snapshot, rx))
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

    /// Like [`Router::route`], with a second source of matched blocks (approximate mode, docs/design.md §6):
    /// a pod's count is the larger of the index walk's (what KV events proved) and `matches`' (what
    /// earlier routing suggests). A text chain never matches the index (its own hash domain), so
    /// that walk ends at the first block; token-id prompts keep the index's exact answer.
    pub fn route_with(
        &self,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
    ) -> Result<Decision, RouteError> {
        self.route_slo(req, matches, None)
    }

    /// Like [`Router::route_with`], honouring a TTFT objective (GIE's `x-slo-ttft-ms`, ms):
    /// candidates predicted to miss it leave when some candidate is predicted to meet it (a
    /// candidate without a prediction stays); when none is, the least predicted TTFT is chosen
    /// and the miss counted (docs/design.md §4 "Load and predicted TTFT"). A non-finite or
    /// non-positive objective is ignored.
    pub fn route_slo(
        &self,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
        slo_ttft_ms: Option<f64>,
    ) -> Result<Decision, RouteError> {
        let table = self.pool.table.load();
        let slo = slo_ttft_ms.filter(|v| v.is_finite() && *v > 0.0);
        with_scratch(|sc| self.route_in(sc, &table, req, matches, slo))
    }

    fn route_in(
        &self,
        sc: &mut Scratch,
        table: &PodTable,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
        slo: Option<f64>,
    ) -> Result<Decision, RouteError> {
        let total_blocks = u32::try_from(req.block_hashes.len()).unwrap_or(u32::MAX);
        let index = self.pool.index.load();
        let model_pods = self.prefilter(sc, table, &index, req, matches);
        if sc.rows.is_empty() {
            return Err(no_candidate(req.model, model_pods, table, &sc.excluded));
        }
        let tick = self.decisions.fetch_add(1, Ordering::Relaxed);
        let selection = self.pool.lock_selection();
        let now = self.shared.clock().now_unix_ms();
        let mut shared = self.shared.lock();
        shared.pending.purge(now, &index);
        // Pending chains are token chains: approximate mode (text chains) keeps its own record.
        let precise = matches.is_none();
        if precise {
            self.overlay_precise(sc, &index, &mut shared, req.block_hashes, now);
        }
        let Some(choice) = self.score(sc, table, req, total_blocks, tick, &shared, slo)? else {
            drop(shared);
            drop(selection);
            return Err(no_candidate(req.model, model_pods, table, &sc.excluded));
        };
        let row = &sc.rows[choice];
        let (rec, status) = (&table.pods[row.pod as usize], &table.status[row.pod as usize]);
        let credited = row.credited();
        let pending_blocks = row.pending;
        let frontier = row.matched.min(total_blocks) as usize;
        let tail: Option<Arc<[kvroute_common::BlockHash]>> =
            (precise && shared.pending.enabled() && frontier < req.block_hashes.len())
                .then(|| Arc::from(&req.block_hashes[frontier..]));
        let id = self.shared.next_id();
        if let Some(t) = &tail {
            shared.pending.record(rec.idx, t.clone(), now, LOCAL, Some(id));
        }
        if shared.replicating() {
            shared.track_local(id, rec.name.clone(), now);
            let blocks = tail.unwrap_or_else(|| Arc::from([]));
            shared.publish(ReplicaEvent::Routed { id, pod: rec.name.clone(), routed_unix_ms: now, blocks });
        }
        // On a pod whose KV events never came the requests still prefilling are not counted:
        // with any request there the work read now is short, and a first token measured
        // against it would teach the pod's model that work costs nothing.
        let work_known = row.load == 0 || !(precise && shared.pending.enabled()) || !shared.pending.silent(rec.idx);
        drop(shared);
        if let Some(root) = req.block_hashes.first().filter(|_| self.counts_roots()) {
            self.popularity.record(root.0, now);
        }
        let mut slot = selection.reserve(rec, status, credited, now);
        slot.on_release(self.shared.clone(), id);
        if work_known {
            slot.set_ttft_work(row.ttft_work, row.depth, row.predicted);
        }
        self.shared.credit.indexed_blocks.fetch_add(u64::from(row.matched), Ordering::Relaxed);
        self.shared.credit.pending_blocks.fetch_add(u64::from(pending_blocks), Ordering::Relaxed);
        rank(&sc.scored, &mut sc.order, choice, ORDERED_CANDIDATES, &sc.top);
        let candidates: Vec<CandidateScore> = sc.order.iter().map(|&i| self.candidate(sc, table, i as usize)).collect();
        let best = &sc.scored[choice];
        trace!(pod = %rec.name, score = best.score, matched = credited, pending = pending_blocks, total_blocks, "routed");
        Ok(Decision {
            pod: rec.name.to_string(),
            endpoint: status.endpoint.to_string(),
            score: best.score,
            match_ratio: sc.factor(choice, 0),
            matched_blocks: credited,
            pending_blocks,
            total_blocks,
            candidate_count: sc.rows.len(),
            candidates,
            slot,
        })
    }

    /// Same computation as [`Router::route`], no reservation, no state change (explain endpoint).
    pub fn explain(&self, req: &RouteRequest<'_>) -> Explanation {
        self.explain_with(req, None)
    }

    /// Same computation as [`Router::route_with`] (the same second source of matched blocks), no
    /// reservation, no state change: the choice is the one `route_with` would make now.
    pub fn explain_with(&self, req: &RouteRequest<'_>, matches: Option<&dyn PrefixMatches>) -> Explanation {
        self.explain_slo(req, matches, None)
    }

    /// Same computation as [`Router::route_slo`], no reservation, no state change.
    pub fn explain_slo(
        &self,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
        slo_ttft_ms: Option<f64>,
    ) -> Explanation {
        let table = self.pool.table.load();
        let slo = slo_ttft_ms.filter(|v| v.is_finite() && *v > 0.0);
        with_scratch(|sc| self.explain_in(sc, &table, req, matches, slo))
    }

    fn explain_in(
        &self,
        sc: &mut Scratch,
        table: &PodTable,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
        slo: Option<f64>,
    ) -> Explanation {
        let total_blocks = u32::try_from(req.block_hashes.len()).unwrap_or(u32::MAX);
        let index = self.pool.index.load();
        self.prefilter(sc, table, &index, req, matches);
        let named = |sc: &Scratch, from: usize| -> Vec<(String, String)> {
            sc.excluded[from..]
                .iter()
                .map(|(i, why)| (table.pods[*i as usize].name.to_string(), why.to_string()))
                .collect()
        };
        let mut excluded = named(sc, 0);
        if sc.rows.is_empty() {
            return Explanation { candidates: Vec::new(), excluded, choice: None };
        }
        let static_excluded = sc.excluded.len();
        let tick = self.decisions.load(Ordering::Relaxed);
        let now = self.shared.clock().now_unix_ms();
        let mut shared = self.shared.lock();
        if matches.is_none() {
            self.overlay_precise(sc, &index, &mut shared, req.block_hashes, now);
        }
        let scored = self.score(sc, table, req, total_blocks, tick, &shared, slo);
        drop(shared);
        match scored {
            Ok(choice) => {
                excluded.extend(named(sc, static_excluded));
                match choice {
                    Some(c) => rank(&sc.scored, &mut sc.order, c, usize::MAX, &[]),
                    None => sc.order.extend((0..sc.rows.len()).filter_map(|i| u32::try_from(i).ok())),
                }
                let candidates = sc.order.iter().map(|&i| self.candidate(sc, table, i as usize)).collect();
                let choice = choice.map(|c| table.pods[sc.rows[c].pod as usize].name.to_string());
                Explanation { candidates, excluded, choice }
            }
            Err(RouteError::Shed { reason } | RouteError::NoCandidate { reason }) => {
                excluded.push((String::new(), reason));
                Explanation { candidates: Vec::new(), excluded, choice: None }
            }
        }
    }

    /// Prefix walk + static filters: candidates into `sc.rows`, exclusions into `sc.excluded`.
    /// Returns how many pods serve the model at all.
    fn prefilter(
        &self,
        sc: &mut Scratch,
        table: &PodTable,
        index: &IndexSnapshot,
        req: &RouteRequest<'_>,
        matches: Option<&dyn PrefixMatches>,
    ) -> usize {
        index.match_prefix(req.block_hashes, &mut sc.walk);
        let index_block = u32::try_from(self.pool.config().block_size).unwrap_or(u32::MAX);
        let now = Instant::now();
        let limits =
            (Duration::from_millis(self.pool.config().grace_ttl_ms), stale_before(now, self.pool.report_max_age()));
        // Pods of the pool whose agent has not reported yet serve no known model: candidates for
        // every model, by load (docs/design.md §14).
        let model_pods = table.by_model.get(req.model).map_or(&[][..], Vec::as_slice);
        let unreported =
            if req.model.is_empty() { &[][..] } else { table.by_model.get("").map_or(&[][..], Vec::as_slice) };
        for &i in model_pods.iter().chain(unreported) {
            let (rec, status, hot) = (&table.pods[i as usize], &table.status[i as usize], &table.hot[i as usize]);
            let why = if rec.is_unreachable() {
                Some(Exclusion::Unreachable)
            } else {
                filter::exclusion((hot, status), req.subset, self.config.health_exclusion_threshold, limits, now)
            };
            match why {
                Some(why) => sc.excluded.push((i, why)),
                None => {
                    // Two engine blocks can share their first index blocks (the same first 16
                    // tokens under 32-token blocks): a match ending inside an engine block
                    // claims nothing of it.
                    let per = engine_block_in_index_blocks(hot.block_size, index_block);
                    let indexed = whole_engine_blocks(sc.walk.matched(rec.idx), per);
                    let matched = matches.map_or(indexed, |m| indexed.max(m.matched_blocks(&rec.name)));
                    sc.rows.push(Row {
                        pod: i,
                        slot: rec.idx,
                        per,
                        matched,
                        pending: 0,
                        offloaded: 0,
                        cpu: 0,
                        depth: 0,
                        load: 0,
                        utilization: 0.0,
                        prefill: 0,
                        work: 0.0,
                        ttft_work: 0.0,
                        predicted: None,
                        in_flight_load: None,
                        kv: 0.0,
                        holds_most: false,
                        kept_full: false,
                    });
                }
            }
        }
        model_pods.len() + unreported.len()
    }

    /// The stages that run under the selection lock (see the module docs): queue and load,
    /// spill, the pending cap, composition, tie keys, the choice (an index into `sc.rows`) and
    /// the pile guard. Call under the selection lock when reserving.
    #[allow(clippy::too_many_arguments)] // the decision's parts, each read by a stage
    fn score(
        &self,
        sc: &mut Scratch,
        table: &PodTable,
        req: &RouteRequest<'_>,
        total_blocks: u32,
        tick: u64,
        shared: &SharedState,
        slo: Option<f64>,
    ) -> Result<Option<usize>, RouteError> {
        // One cutoff for the whole decision: a report is stale for every stage or for none.
        let stale_cutoff = stale_before(Instant::now(), self.pool.report_max_age());
        self.overlay_load(sc, table, shared, stale_cutoff);
        // Which rows hold the most of the prefix is read before any pending credit is withheld.
        self.mark_full_fleet(sc, req);
        let by_time_rule = self.config.spill_rule == SpillRule::Ttft;
        if by_time_rule {
            // Stay or spill by time: the queue spill needs every row's prediction first.
            self.cap_pending(&mut sc.rows);
            self.predict(sc, table, total_blocks);
            let by_time = self.kept_by_time(sc);
            self.spill(sc, by_time)?;
        } else {
            self.spill(sc, |_| false)?;
            self.cap_pending(&mut sc.rows);
            self.predict(sc, table, total_blocks);
        }
        let missed = slo.is_some_and(|slo| self.slo_filter(sc, slo));
        self.compose(sc, table, req, total_blocks, stale_cutoff);
        self.tie_keys(sc, tick);
        if missed {
            let choice = least_predicted(sc, 0..sc.rows.len());
            if choice.is_some_and(|c| sc.rows[c].kept_full) {
                self.shared.credit.full_fleet_stays.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(choice);
        }
        let by_time = match self.config.spill_rule {
            SpillRule::MaxQueue => None,
            SpillRule::Ttft => {
                let c = self.ttft_choice(sc);
                if c.is_none() {
                    self.shared.credit.ttft_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                c
            }
        };
        let mut choice = by_time.or_else(|| choose_keeping_top(sc)).map(|c| self.place_cold(&mut *sc, table, c));
        let mut kept_full = choice.is_some_and(|c| sc.rows[c].kept_full);
        if let Some(c) = choice
            && let Some(least) = self.pile_guard(sc, c)
            && !self.pile_stays(sc, c, least, by_time.is_some(), req)
        {
            // A full fleet keeps the request on a pod holding the most of its prefix rather
            // than copy the prefix to one holding less.
            if sc.full_fleet && sc.rows[c].holds_most && !sc.rows[least].holds_most {
                kept_full = true;
            } else {
                choice = Some(least);
                kept_full = sc.rows[least].kept_full;
                self.shared.credit.pile_redirects.fetch_add(1, Ordering::Relaxed);
            }
        }
        if kept_full {
            self.shared.credit.full_fleet_stays.fetch_add(1, Ordering::Relaxed);
        }
        Ok(choice)
    }

    /// docs/design.md §4 "Load and predicted TTFT": every row's work for the TTFT model (its
    /// pod's in-flight work plus this request's uncached tokens), its predicted TTFT and, with
    /// `load_source: inflight`, its loadRatio = max(in-flight work × learned ms per token /
    /// `load_horizon_ms`, reported KV usage). A pod's own model leans on the fleet-wide model's
    /// slope until its first tokens spread ([`crate::pool::TtftFit::line_toward`]); a pod whose model has not
    /// learned yet is predicted by the fleet-wide model; before that has learned too it keeps the
    /// seed's formula (counted in `load_fallbacks`). Every first token teaches the fleet-wide
    /// model too, so a pod's own has learned only once that one has.
    fn predict(&self, sc: &mut Scratch, table: &PodTable, total_blocks: u32) {
        let block = self.pool.config().block_size as f64;
        let horizon = self.config.load_horizon_ms as f64;
        let inflight = self.config.load_source == LoadSource::Inflight;
        let mut fallbacks = 0u64;
        let fleet: Option<TtftLine> =
            self.shared.credit.fleet_ttft.lock().line_after(crate::pool::FLEET_MIN_OBSERVATIONS);
        // Every candidate's fit is copied first, then evaluated: the copies' cache misses overlap
        // instead of each waiting behind the previous pod's solve.
        sc.fits.clear();
        sc.fits.extend(sc.rows.iter().map(|row| table.pods[row.pod as usize].inflight.ttft.load()));
        for (row, fit) in sc.rows.iter_mut().zip(&sc.fits) {
            let own: Option<TtftLine> = fleet.and_then(|f| fit.line(f.ms_per_token));
            let line = own.or(fleet);
            let uncached = f64::from(total_blocks.saturating_sub(row.credited())) * block;
            row.ttft_work = row.work + uncached;
            row.predicted = line.map(|l| l.predict(row.ttft_work, f64::from(row.depth))).filter(|p| p.is_finite());
            row.in_flight_load = None;
            let kv = table.hot[row.pod as usize].kv_cache_usage;
            row.kv = if kv.is_finite() { kv } else { 0.0 };
            if inflight {
                // A pod whose running requests hold most of its KV admits a new prompt only by
                // preempting one: its KV usage is a floor of its load.
                row.in_flight_load =
                    line.map(|l| (row.work * l.ms_per_token / horizon).max(row.kv)).filter(|r| r.is_finite());
                if row.in_flight_load.is_none() {
                    fallbacks += 1;
                }
            }
        }
        if fallbacks > 0 {
            self.shared.credit.load_fallbacks.fetch_add(fallbacks, Ordering::Relaxed);
        }
    }

    /// The `x-slo-ttft-ms` filter (docs/design.md §4): when some row is predicted to meet `slo`,
    /// the rows predicted to miss it leave (rows without a prediction stay) and false is returned;
    /// when every row is predicted to miss it, all stay, the miss is counted and true is returned
    /// (the least predicted TTFT is then chosen).
    fn slo_filter(&self, sc: &mut Scratch, slo: f64) -> bool {
        let meets = |r: &Row| r.predicted.is_none_or(|p| p <= slo);
        if sc.rows.iter().any(meets) {
            let excluded = &mut sc.excluded;
            sc.rows.retain(|r| {
                if !meets(r) {
                    excluded
                        .push((r.pod, Exclusion::SloMiss { predicted_ms: r.predicted.unwrap_or(0.0), slo_ms: slo }));
                }
                meets(r)
            });
            false
        } else {
            self.shared.credit.slo_misses.fetch_add(1, Ordering::Relaxed);
            true
        }
    }

    /// docs/design.md §4 "Stay or spill" by time: the cache-hot row (most blocks credited, the
    /// best by S among those) unless its predicted TTFT exceeds `ttft_spill_factor` times the
    /// least predicted TTFT among the other rows with [`KV_ROOM`], which then wins (the least
    /// predicted, the best by S among equals); a request no row holds a block of goes by S.
    /// `None` (the seed's rule decides) when some row has no prediction or the hot row's KV is
    /// [`KV_BUSY`].
    fn ttft_choice(&self, sc: &Scratch) -> Option<usize> {
        if sc.rows.iter().any(|r| r.predicted.is_none()) {
            return None;
        }
        let most = sc.rows.iter().map(Row::credited).max()?;
        if most == 0 {
            return choose(&sc.scored, 0..sc.rows.len());
        }
        let hot = choose(&sc.scored, (0..sc.rows.len()).filter(|&i| sc.rows[i].credited() == most))?;
        // The model does not see KV pressure: a hot pod whose running requests hold most of its
        // KV admits another only by preempting one, however fast it is predicted.
        if sc.rows[hot].kv >= KV_BUSY {
            return None;
        }
        // A spill computes the prompt again on the alternative: only one with KV room takes it
        // (in a fleet short of KV the copies evict what others need, and preemptions follow).
        let alt = least_predicted(sc, (0..sc.rows.len()).filter(|&i| i != hot && sc.rows[i].kv < KV_ROOM));
        let factor = self.config.ttft_spill_factor;
        match (alt, sc.rows[hot].predicted) {
            (Some(a), Some(h)) if sc.rows[a].predicted.is_some_and(|p| h > p * factor) => Some(a),
            _ => Some(hot),
        }
    }

    /// Every row's live figures, read under the selection lock: queue depth (peers' in-flight
    /// requests and the reported-running requests still prefilling included), load, GPU
    /// utilization (brought forward with `load_forecast`) and, with `prefill_tie_break`, the
    /// prefill its pod has left. `cutoff`: reports received before it are stale.
    fn overlay_load(&self, sc: &mut Scratch, table: &PodTable, shared: &SharedState, cutoff: Option<Instant>) {
        sc.fresh_kv = (0.0, 0);
        let precise = sc.precise;
        for row in &mut sc.rows {
            let (rec, hot) = (&table.pods[row.pod as usize], &table.hot[row.pod as usize]);
            let peers = shared.peers.since(row.slot, if hot.has_stats { hot.observed_at_unix_ms } else { i64::MIN });
            let stale = hot.report_stale_before(cutoff);
            row.depth = rec.queue_depth_hot(hot, stale).saturating_add(peers);
            let running = hot.num_requests_running;
            row.load = running.saturating_add(row.depth);
            row.utilization = hot.gpu_utilization;
            // A fresh report: the figures below build on it.
            let fresh = hot.has_stats && !stale;
            if fresh {
                let kv = hot.kv_cache_usage;
                sc.fresh_kv.0 += if kv.is_finite() { kv.clamp(0.0, 1.0) } else { 0.0 };
                sc.fresh_kv.1 += 1;
            }
            // docs/design.md §4 loadRatio: the requests routed since a fresh report will run
            // there as the ones it counted do, so each adds the utilization per running request
            // the pod last reported (queueDepth counts them the same way).
            if self.config.load_forecast && fresh {
                // With a fresh report `row.depth` is its waiting count plus those requests. A
                // pod that has not yet reported a running request is taken at NVML's meaning:
                // one request stepping keeps the GPU busy.
                let since = row.depth.saturating_sub(hot.num_requests_waiting);
                row.utilization = forecast_utilization(hot.gpu_utilization, hot.utilization_per_request, since);
            }
            // docs/design.md §4: a request the report listed as running but whose prompt the
            // pod's KV events have not confirmed yet is still being prefilled: for the next
            // request it is as much ahead in the queue as a waiting one. The report's waiting
            // requests were routed before it too, so the larger of the two counts.
            let (prefilling, left) = if precise { shared.pending.prefilling_on(row.slot) } else { (&[][..], 0) };
            if fresh {
                let before = prefilling.partition_point(|p| p.routed_ms < hot.observed_at_unix_ms);
                let before = u32::try_from(before).unwrap_or(u32::MAX);
                row.depth = row.depth.saturating_add(before.saturating_sub(hot.num_requests_waiting));
            }
            row.prefill = left;
            let index_block = self.pool.config().block_size as f64;
            row.work = f64::from(row.prefill) * index_block + f64::from(running) * DECODE_TOKENS_PER_REQUEST;
        }
    }

    /// docs/design.md §4 "Stay or spill" by time: which rows at `max_queue` stay candidates
    /// under `spill_rule: ttft`. Those predicted no slower than every row below `max_queue`
    /// whose KV is not [`KV_BUSY`] (a full queue of requests whose prompts the pod holds can
    /// still be the fastest place); none (the seed's spill) while any row lacks a prediction.
    fn kept_by_time(&self, sc: &Scratch) -> impl Fn(&Row) -> bool + use<> {
        let max_queue = self.config.max_queue;
        let fastest = (!sc.rows.iter().any(|r| r.predicted.is_none())).then(|| {
            sc.rows.iter().filter(|r| r.depth < max_queue).filter_map(|r| r.predicted).fold(f64::INFINITY, f64::min)
        });
        move |r: &Row| fastest.is_some_and(|f| r.kv < KV_BUSY && r.predicted.is_some_and(|p| p <= f))
    }

    /// docs/design.md §4 spill: when some rows are below `max_queue`, the others leave the
    /// candidates (into `sc.excluded`), except those `also` keeps; when none is, the decision is
    /// shed (429) with `shed_when_saturated`, else every row stays. While the fleet is full
    /// ([`Router::mark_full_fleet`]) the rows holding the most of the request's blocks stay at
    /// `max_queue` too, up to [`FULL_FLEET_QUEUE_FACTOR`] times it (with `shed_when_saturated`,
    /// only below `max_queue`: a 429 stays a 429); a row kept by that rule alone is marked
    /// `kept_full`.
    fn spill(&self, sc: &mut Scratch, also: impl Fn(&Row) -> bool) -> Result<(), RouteError> {
        if !sc.full_fleet {
            return self.spill_keeping(sc, also);
        }
        let max_queue = self.config.max_queue;
        let limit =
            if self.config.shed_when_saturated { max_queue } else { max_queue.saturating_mul(FULL_FLEET_QUEUE_FACTOR) };
        let holds = |r: &Row| r.holds_most && r.depth < limit;
        // Only where the seed's spill would leave some row: otherwise every row stays anyway.
        let spills = sc.rows.iter().any(|r| r.depth < max_queue);
        for r in &mut sc.rows {
            r.kept_full = spills && r.depth >= max_queue && holds(r) && !also(r);
        }
        self.spill_keeping(sc, |r| holds(r) || also(r))
    }

    /// Sets `sc.full_fleet` (and each row's `holds_most`) when moving the request off the pods
    /// that hold its prefix would only copy the prefix where there is no room for it
    /// (docs/design.md §4 "A full fleet"), under either spill rule: some row holds a block of
    /// the request, its root is not hot (under one candidate's share of the recent requests,
    /// as in [`Router::pile_stays`]), and the mean KV usage of the candidates with a fresh
    /// report (at least two, summed by `overlay_load`) is `full_fleet_kv` or more (0: never).
    fn mark_full_fleet(&self, sc: &mut Scratch, req: &RouteRequest<'_>) {
        let threshold = self.config.full_fleet_kv;
        let n = sc.rows.len();
        let (kv, fresh) = sc.fresh_kv;
        if threshold <= 0.0 || n < 2 || fresh < 2 || kv < threshold * f64::from(fresh) {
            return;
        }
        let top = sc.rows.iter().map(Row::credited).max().unwrap_or(0);
        sc.full_fleet = top > 0 && self.prefix_not_hot(req, n);
        if sc.full_fleet {
            for r in &mut sc.rows {
                r.holds_most = r.credited() == top;
            }
        }
    }

    /// Whether decisions count prefix roots ([`PrefixPopularity`]): read by the new-prefix
    /// placement, the pile guard and the full-fleet rule.
    fn counts_roots(&self) -> bool {
        self.config.popularity_placement_margin > 0.0
            || self.config.pile_guard_margin > 0
            || self.config.full_fleet_kv > 0.0
    }

    /// [`Router::spill`], except that the rows at `max_queue` for which `keep` holds stay.
    fn spill_keeping(&self, sc: &mut Scratch, keep: impl Fn(&Row) -> bool) -> Result<(), RouteError> {
        let max_queue = self.config.max_queue;
        match filter::spill(sc.rows.iter().map(|r| r.depth), max_queue) {
            Spill::AllSaturated if self.config.shed_when_saturated => Err(RouteError::Shed {
                reason: format!("all {} candidate pods have queue depth >= max_queue {max_queue}", sc.rows.len()),
            }),
            Spill::AllSaturated => Ok(()),
            Spill::KeepBelow => {
                let excluded = &mut sc.excluded;
                sc.rows.retain(|r| {
                    let stays = r.depth < max_queue || keep(r);
                    if !stays {
                        excluded.push((r.pod, Exclusion::QueueFull { depth: r.depth, max: max_queue }));
                    }
                    stays
                });
                Ok(())
            }
        }
    }

    /// Every row's factors (clamped to [0,1]) into `sc.columns` and its composite S into
    /// `sc.scored` (with its tie keys still 0): the rows become [`PodFacts`], each scorer
    /// prepares once and scores the whole column. No stage may drop or reorder rows after this
    /// one: the factors are read back by row ([`Scratch::factor`]). `cutoff`: reports received
    /// before it are stale.
    fn compose(
        &self,
        sc: &mut Scratch,
        table: &PodTable,
        req: &RouteRequest<'_>,
        total_blocks: u32,
        cutoff: Option<Instant>,
    ) {
        let mut facts = recycle(std::mem::take(&mut sc.facts));
        facts.extend(sc.rows.iter().map(|r| {
            let status = &table.status[r.pod as usize];
            let stats = status.stats.as_ref();
            // Without a report, a Ready pod of the pool counts as idle (Kubernetes says Ready; its
            // in-flight count is its queue depth) and of unknown GPU health, as a pod whose agent
            // cannot see its GPUs (docs/design.md §14).
            let (idle, unreported) = if status.member == Membership::PoolReady {
                (0.0, (crate::pool::NO_REPORT_HEALTH, crate::pool::NO_REPORT_REASON))
            } else {
                (1.0, (0.0, ""))
            };
            // A report older than the report-age limit is unknown, not perfect (docs/design.md §15).
            let (health_score, health_reason) =
                status.effective_health(status.report_stale_before(cutoff)).unwrap_or(unreported);
            PodFacts {
                name: &table.pods[r.pod as usize].name,
                endpoint: &status.endpoint,
                matched_blocks: r.credited(),
                pending_blocks: r.pending,
                offloaded_blocks: r.offloaded,
                gpu_utilization: if stats.is_some() { r.utilization } else { idle },
                in_flight_load: r.in_flight_load,
                queue_depth: r.depth,
                health_score,
                health_reason,
                kv_cache_usage: stats.map_or(0.0, |s| s.kv_cache_usage),
                running_adapters: stats.map_or(&[], |s| s.running_adapters.as_slice()),
                cost_per_hour: status.cost_per_hour,
                annotations: &status.annotations,
            }
        }));
        let block_size = u32::try_from(self.pool.config().block_size).unwrap_or(u32::MAX);
        let ctx =
            ScoreContext { adapter: req.adapter, total_blocks, block_size, config: &self.config, candidates: &facts };
        sc.preps.clear();
        sc.preps.extend(self.scorers.iter().map(|(s, _)| s.prepare(&ctx)));
        // Factor columns: scorer j's factors for every row at `columns[j·n ..][..n]`.
        let n = facts.len();
        sc.columns.clear();
        sc.columns.resize(self.scorers.len() * n, 0.0);
        for (((scorer, _), prep), column) in
            self.scorers.iter().zip(&sc.preps).zip(sc.columns.chunks_exact_mut(n.max(1)))
        {
            scorer.score_all(&ctx, prep, column);
            for v in column.iter_mut() {
                *v = clamp_factor(*v);
            }
        }
        self.weighted_columns(&sc.columns, n, &mut sc.totals);
        sc.scored.extend(facts.iter().zip(&sc.totals).map(|(f, total)| Ranked {
            score: total.clamp(0.0, 1.0),
            load_ratio: pod_load_ratio(f, self.config.max_utilization),
            queue_depth: f.queue_depth,
            prefill: 0,
            tie_key: 0,
        }));
        sc.facts = recycle(facts);
    }

    /// docs/design.md §4 ties, the keys after S, loadRatio and queue depth: for a request no
    /// candidate holds a block of, S differs only by load and queue, and pods that read the same
    /// there may be at the start or the end of a cold prefill, so the one with less prefill left
    /// goes first (`prefill_tie_break`); last, a seeded random key per pod and decision (`tick`).
    fn tie_keys(&self, sc: &mut Scratch, tick: u64) {
        let salt = select::splitmix64(self.config.seed ^ select::splitmix64(tick));
        let cold = self.config.prefill_tie_break && no_row_holds_a_block(&sc.rows);
        for (row, s) in sc.rows.iter().zip(&mut sc.scored) {
            s.prefill = if cold { row.prefill } else { 0 };
            s.tie_key = select::splitmix64(salt ^ u64::from(row.slot.0));
        }
    }

    /// Precise mode's additions to the index walk, for [`Router::score`]: the requests still
    /// prefilling, every row's pending entries and its CPU-tier match.
    fn overlay_precise(
        &self,
        sc: &mut Scratch,
        index: &IndexSnapshot,
        shared: &mut SharedState,
        chain: &[kvroute_common::BlockHash],
        now: i64,
    ) {
        // Each pod's blocks left are read by the cold-tie step (docs/design.md §4 ties) and are
        // the in-flight work of the load factor and the TTFT model.
        shared.pending.prefilling(index);
        sc.precise = true;
        overlay_pending(sc, shared, chain, now);
        self.overlay_offloaded(sc, chain);
    }

    /// Sets every row's CPU-tier match (docs/design.md §2 tiers); [`Router::score`] credits what it
    /// adds beyond the GPU index and pending entries.
    fn overlay_offloaded(&self, sc: &mut Scratch, chain: &[kvroute_common::BlockHash]) {
        let cpu = self.pool.cpu_index.load();
        if cpu.match_prefix(chain, &mut sc.cpu_walk) == 0 {
            return;
        }
        for row in &mut sc.rows {
            row.cpu = whole_engine_blocks(sc.cpu_walk.matched(row.slot), row.per);
        }
    }

    /// docs/design.md §4 pending entries: withholds pending credit from rows queued
    /// `pending_queue_share × max_queue` or more above the least queued candidate, then sets each
    /// row's CPU-tier-only blocks beyond what it is credited.
    fn cap_pending(&self, rows: &mut [Row]) {
        let share = self.config.pending_queue_share;
        let margin = (share * f64::from(self.config.max_queue)).ceil() as u32;
        let least = rows.iter().map(|r| r.depth).min().unwrap_or(0);
        for row in rows {
            if share > 0.0 && row.pending > 0 && row.depth >= least.saturating_add(margin.max(1)) {
                row.pending = 0;
                self.shared.credit.pending_withheld.fetch_add(1, Ordering::Relaxed);
            }
            row.offloaded = row.cpu.saturating_sub(row.credited());
        }
    }

    /// docs/design.md §4 "Where a new prefix goes": when no candidate holds any block of the
    /// request, the row with the least long-run share of what it will carry; `choice` on equal
    /// shares and for every other request. S sees what a pod carries now; a new prefix's next
    /// requests will follow it to where it lands, so that pod is best taken by what it will
    /// carry. Two rules, by how popular the recent prefixes are ([`PrefixPopularity::equal`]):
    /// - unequal, or not known to be equal: among the rows whose S is within
    ///   `cold_placement_margin` of row `choice`'s, `routed rate / mean routed rate + cached
    ///   blocks / mean cached blocks`. A pod serving a popular prefix would see its many hits
    ///   wait behind this prefill, and one holding many prefixes will hold their traffic and
    ///   evict to make room;
    /// - equally popular: among the rows within `popularity_placement_margin` (wider), `cached
    ///   blocks`. Each prefix then brings the same traffic, so the prefixes a pod holds predict
    ///   its load, and its routed rate adds only Poisson noise that splits them unevenly.
    ///
    /// A term whose mean is 0 counts 0; cached blocks: indexed, and still to prefill on the pod.
    fn place_cold(&self, sc: &mut Scratch, table: &PodTable, choice: usize) -> usize {
        let margin = self.config.cold_placement_margin;
        if margin <= 0.0 || !no_row_holds_a_block(&sc.rows) {
            return choice;
        }
        let now = self.shared.clock().now_unix_ms();
        let wide = self.config.popularity_placement_margin;
        let equal = wide > 0.0 && self.popularity.equal(now);
        let floor = sc.scored[choice].score - if equal { wide } else { margin };
        if !sc.scored.iter().enumerate().any(|(i, s)| i != choice && s.score >= floor) {
            return choice;
        }
        let counter =
            if equal { &self.shared.credit.new_prefix_by_cache } else { &self.shared.credit.new_prefix_by_traffic };
        counter.fetch_add(1, Ordering::Relaxed);
        // One read of each pod's rate (an exp) and blocks, then the means over the rows.
        sc.shares.clear();
        sc.shares.extend(sc.rows.iter().map(|row| {
            let rec = &table.pods[row.pod as usize];
            let rate = if equal { 0.0 } else { rec.inflight.routed_rate(now) };
            (rate, rec.blocks.load(Ordering::Relaxed) as f64 + f64::from(row.prefill))
        }));
        let n = sc.shares.len() as f64;
        let (mean_rate, mean_blocks) = sc.shares.iter().fold((0.0, 0.0), |(r, b), (sr, sb)| (r + sr / n, b + sb / n));
        let part = |v: f64, mean: f64| if mean > 0.0 { v / mean } else { 0.0 };
        let share = |i: usize| part(sc.shares[i].0, mean_rate) + part(sc.shares[i].1, mean_blocks);
        let mut best = (choice, share(choice));
        for i in (0..sc.rows.len()).filter(|&i| i != choice && sc.scored[i].score >= floor) {
            let s = share(i);
            if s < best.1 {
                best = (i, s);
            }
        }
        best.0
    }

    /// docs/design.md §4 pile guard: when row `choice` carries far more requests than the least
    /// loaded candidate (`pile_guard_margin` more and `pile_guard_factor` times as many), the
    /// least loaded candidate that scores best among equally loaded ones; else `None`.
    fn pile_guard(&self, sc: &Scratch, choice: usize) -> Option<usize> {
        let (margin, factor) = (self.config.pile_guard_margin, self.config.pile_guard_factor);
        let least = sc.rows.iter().map(|r| r.load).min()?;
        if !filter::piled(sc.rows[choice].load, least, margin, factor) {
            return None;
        }
        choose(&sc.scored, (0..sc.rows.len()).filter(|&i| sc.rows[i].load == least))
    }

    /// Whether row `pile`, which the pile guard would leave for row `least`, keeps the request
    /// after all (docs/design.md §4 pile guard): it has KV room and is predicted
    /// [`PILE_SPEEDUP`] times faster, and
    /// - the request's prefix is not hot (KV room below [`UNSHARED_KV_ROOM`]). A prefix is hot
    ///   when its root carries at least one candidate's share (1 / candidates) of the requests
    ///   this replica routed before this one: the guard exists to give such a prefix a second
    ///   pod, and moving a request of any other prefix only computes it cold elsewhere;
    /// - or, with `spill_rule: ttft`, the decision went by time (`by_time`; KV room below
    ///   [`KV_ROOM`], any prefix).
    fn pile_stays(&self, sc: &Scratch, pile: usize, least: usize, by_time: bool, req: &RouteRequest<'_>) -> bool {
        let (a, b) = (&sc.rows[pile], &sc.rows[least]);
        if self.config.spill_rule == SpillRule::Ttft && by_time && pile_fits(a, b, KV_ROOM) {
            return true;
        }
        // The guard fires only with a less loaded row beside the pile: two rows or more.
        pile_fits(a, b, UNSHARED_KV_ROOM) && self.prefix_not_hot(req, sc.rows.len())
    }

    /// Whether the request's prefix is not hot among `candidates` pods: its root carries less
    /// than one candidate's share (1 / `candidates`) of the requests this replica routed before
    /// it (false for a request without blocks). Read by the pile guard and the full-fleet rule.
    fn prefix_not_hot(&self, req: &RouteRequest<'_>, candidates: usize) -> bool {
        let fair = 1.0 / candidates as f64;
        req.block_hashes.first().is_some_and(|root| self.popularity.share(root.0) < fair)
    }

    /// The reported [`CandidateScore`] of row `i` (names shared, not copied).
    fn candidate(&self, sc: &Scratch, table: &PodTable, i: usize) -> CandidateScore {
        let (row, s) = (&sc.rows[i], &sc.scored[i]);
        let custom = self
            .scorers
            .iter()
            .enumerate()
            .skip(BUILTINS)
            .map(|(j, (scorer, _))| (scorer.name(), sc.factor(i, j)))
            .collect();
        CandidateScore {
            pod: table.pods[row.pod as usize].name.clone(),
            endpoint: table.status[row.pod as usize].endpoint.clone(),
            score: s.score,
            cache: sc.factor(i, 0),
            load: sc.factor(i, 1),
            queue: sc.factor(i, 2),
            health: sc.factor(i, 3),
            adapter: sc.factor(i, 4),
            custom,
            matched_blocks: row.credited(),
            pending_blocks: row.pending,
            offloaded_blocks: row.offloaded,
            predicted_ttft_ms: row.predicted,
        }
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
        for (((scorer, _), prep), slot) in self.scorers.iter().zip(preps).zip(factors.iter_mut()) {
            *slot = clamp_factor(scorer.score(ctx, prep, pod));
        }
        self.weighted(|j| factors.get(j).copied().unwrap_or(0.0))
    }

    /// S: Σ weight_j · factor(j) over the registered scorers in order, clamped to [0,1], for one
    /// pod (`composite`). [`Router::weighted_columns`] is the same sum for every candidate.
    fn weighted(&self, factor: impl Fn(usize) -> f64) -> f64 {
        let mut s = 0.0;
        for (j, (_, w)) in self.scorers.iter().enumerate() {
            s += w * factor(j);
        }
        s.clamp(0.0, 1.0)
    }

    /// [`Router::weighted`] for every row at once, before the clamp: `totals[i]` = Σ weight_j ·
    /// `columns[j·n + i]`, the terms added in the same order from 0.0, so each total has the
    /// same bits as the per-pod sum. A column at a time: a multiply-add over contiguous factors.
    fn weighted_columns(&self, columns: &[f64], n: usize, totals: &mut Vec<f64>) {
        totals.clear();
        totals.resize(n, 0.0);
        for ((_, w), column) in self.scorers.iter().zip(columns.chunks_exact(n.max(1))) {
            for (t, v) in totals.iter_mut().zip(column) {
                *t += w * v;
            }
        }
    }
}

/// Adds to every row the blocks its pod holds pending after its index frontier
/// (docs/design.md §3): one table lookup per distinct frontier, one per pending block found.
fn overlay_pending(sc: &mut Scratch, shared: &SharedState, chain: &[kvroute_common::BlockHash], now: i64) {
    sc.frontiers.clear();
    sc.frontiers.extend(sc.rows.iter().map(|r| (r.slot, r.matched)));
    shared.pending.extend_all(chain, now, &sc.frontiers, &mut sc.extension);
    for (row, ext) in sc.rows.iter_mut().zip(&sc.extension) {
        // The engine will cache whole engine blocks only: pending index blocks count up to the
        // last engine block they complete.
        row.pending = whole_engine_blocks(row.matched.saturating_add(*ext), row.per).saturating_sub(row.matched);
    }
}

/// `blocks` index blocks cut down to whole engine blocks of `per` index blocks each.
fn whole_engine_blocks(blocks: u32, per: u32) -> u32 {
    blocks - blocks % per.max(1)
}

/// Index blocks per engine block of a pod whose engine block is `engine_block` tokens, for an
/// index of `index_block`-token blocks: 1 when unknown (0) or not a whole multiple (the agent then
/// sends no blocks of the pod anyway).
fn engine_block_in_index_blocks(engine_block: u32, index_block: u32) -> u32 {
    match (engine_block, index_block) {
        (e, i) if i > 0 && e > i && e % i == 0 => e / i,
        _ => 1,
    }
}

/// KV cache usage at which stay-or-spill by time gives way to the seed's rule: the running
/// requests hold so much of the pod's KV that another one admitted preempts.
const KV_BUSY: f64 = 0.9;

/// KV cache usage below which a pod has room by time's rules: it may take a request spilled
/// from the cache-hot pod (a second copy of the prompt), and a pile of requests on it may grow
/// past the pile guard (every running request's decode adds blocks the TTFT model does not
/// see). Only a pod with most of its KV free absorbs either without evicting or preempting.
const KV_ROOM: f64 = 0.5;
/// How much faster than the least loaded candidate a pile must be predicted to stay. A herd's
/// hot pod is predicted ≈ 3.9× faster than a cold prefill (its queued requests need none), so
/// it keeps the herd; W2's piles are predicted 2–3× faster than a pod that lacks the shared
/// system prompt, where the models underrate an 8k-token cold prefill (1.1 s predicted, 1.9 s
/// taken), so those piles are moved.
const PILE_SPEEDUP: f64 = 3.0;

/// KV cache usage below which a pile of requests whose prefix is not hot may grow past the
/// pile guard (see [`Router::pile_stays`]). Higher than [`KV_ROOM`]: such a pile is one group's
/// requests on the pod that holds the group, and moving one computes the whole prompt on a pod
/// that lacks it, which then holds up that pod's own hits. Above it, the pod is near preempting
/// and the guard's move is what keeps it from tipping over, while other pods have room (see
/// `full_fleet_kv` for when they have none).
const UNSHARED_KV_ROOM: f64 = 0.8;

/// While the fleet is full, a pod holding the request's prefix keeps it up to this many times
/// `max_queue` requests queued: a bound, so that a pod that stops serving is left in the end.
const FULL_FLEET_QUEUE_FACTOR: u32 = 4;

/// Whether row `a`, a pile, may keep a request the pile guard would give to row `b`: `a`'s KV
/// usage is below `kv_room` and it is predicted at least [`PILE_SPEEDUP`] times faster (false
/// without both predictions).
fn pile_fits(a: &Row, b: &Row, kv_room: f64) -> bool {
    a.kv < kv_room && matches!((a.predicted, b.predicted), (Some(pa), Some(pb)) if pa * PILE_SPEEDUP <= pb)
}

/// Whether the request is new to every candidate: no blocks credited (indexed, pending or
/// approximate) and none in a CPU tier.
fn no_row_holds_a_block(rows: &[Row]) -> bool {
    rows.iter().all(|r| r.credited() == 0 && r.cpu == 0)
}

/// Of rows `among`, the least predicted TTFT (rows without a prediction last), the best by S
/// among equals; `None` when `among` is empty.
fn least_predicted(sc: &Scratch, among: impl Iterator<Item = usize>) -> Option<usize> {
    let key = |i: usize| sc.rows[i].predicted.unwrap_or(f64::INFINITY);
    let mut best: Option<usize> = None;
    for i in among {
        best = match best {
            Some(b) if key(i) > key(b) => Some(b),
            Some(b) if key(i) == key(b) && !ahead(&sc.scored, i as u32, b as u32) => Some(b),
            _ => Some(i),
        };
    }
    best
}

/// docs/design.md §4 loadRatio brought forward: `reported` plus `per_request` for each of the
/// `since` requests routed after the report, capped at 1 (a non-finite input leaves `reported`).
fn forecast_utilization(reported: f64, per_request: f64, since: u32) -> f64 {
    let u = reported + per_request * f64::from(since);
    if u.is_finite() { u.min(1.0) } else { reported }
}

/// A factor clamped to [0,1], NaN → 0.
fn clamp_factor(v: f64) -> f64 {
    if v.is_nan() { 0.0 } else { v.clamp(0.0, 1.0) }
}

/// How many candidates a routing [`Decision`] lists, best first: ranking all of a 1000-pod fleet
/// on every request costs more than scoring it.
pub const ORDERED_CANDIDATES: usize = 8;

fn no_candidate(model: &str, model_pods: usize, table: &PodTable, excluded: &[(u32, Exclusion)]) -> RouteError {
    if model_pods == 0 {
        return RouteError::NoCandidate { reason: format!("no pod serves model '{model}'") };
    }
    let list = excluded
        .iter()
        .take(8)
        .map(|(i, why)| format!("{}: {why}", table.pods[*i as usize].name))
        .collect::<Vec<_>>()
        .join("; ");
    let more = excluded.len().saturating_sub(8);
    let tail = if more > 0 { format!("; and {more} more") } else { String::new() };
    RouteError::NoCandidate { reason: format!("all {model_pods} pods of model '{model}' are excluded ({list}{tail})") }
}

#[cfg(test)]
mod forecast_tests {
    use super::forecast_utilization;

    #[test]
    fn forecast_adds_a_share_per_request_routed_since_and_caps_at_one() {
        assert_eq!(forecast_utilization(0.25, 1.0 / 16.0, 2), 0.375);
        assert_eq!(forecast_utilization(0.25, 1.0 / 16.0, 0), 0.25);
        assert_eq!(forecast_utilization(0.9, 0.9, 1), 1.0);
        assert_eq!(forecast_utilization(0.3, f64::NAN, 1), 0.3);
        assert_eq!(forecast_utilization(0.3, f64::INFINITY, 1), 0.3);
    }
}
