//! One routing decision (`Router::route`: 256-block prefix walk, filters, five scorers, choice,
//! in-flight reservation and its release) over 64 and 1000 pods; docs/design.md §10 targets ≤ 5 µs / ≤ 50 µs
//! for scoring. Baselines in the same run: the bare formula over the same pods' numbers in a flat
//! array (`naive_formula`: the floor any scorer pays), and 64 pods vs 1000 (scaling).
//!
//! Fleet: every pod holds 2,000 blocks of its own; GPU load and queue depth vary by pod; all
//! healthy. `route`: 8 pods hold the request's 256-block chain to staggered depths (one full hit),
//! as when a prefix lives on a few replicas. `route_all_share`: every pod holds a staggered part of
//! the chain (pod k the first `256·(k+1)/N` blocks): the prefix walk's worst case, since each of
//! the 256 steps intersects with every pod. `route_no_prefix`: an empty chain (filters, scoring,
//! choice and reservation; no pod holds a block of it, so it is placed as a new prefix),
//! beside `route_no_prefix_placement_off` (`cold_placement_margin: 0`, the same request by S
//! alone), `route_popularity_off` (`popularity_placement_margin`, `pile_guard_margin` and
//! `full_fleet_kv` 0, the count's readers: `route` without the count of the request's prefix root), and `route_learned` (`route` once every pod's TTFT model has
//! learned from six first tokens, as in service), and `route_busy` (`route` while every pod holds
//! two requests routed after its report and not yet seen computed), `route_busy_live` (the same
//! while eight pods' blocks change before each decision, as KV events arrive in service;
//! `route_live` is `route` so; `route_live_stats` and `route_busy_live_stats` are the two with
//! one pod's report among each round's deltas, which publishes the pod table),
//! `route_busy_decoding` (the same once the pods' events show those prompts computed). Run:
//! `cargo bench -p kvroute-picker --bench route`.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use kvroute_common::BlockHash;
use kvroute_picker::pool::{Pool, PoolConfig, PoolUpdate, TtftObservation};
use kvroute_picker::score::{CustomScorerConfig, RouteRequest, Router, ScoringConfig, Weights};
use kvroute_proto::agent::v1::{PodInfo, PodStats};

const PREFIX_BLOCKS: u64 = 256;
const OWN_BLOCKS: u64 = 2_000;

fn block(x: u64) -> BlockHash {
    BlockHash(x.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555)
}

fn gpu(k: usize) -> f64 {
    (k % 10) as f64 / 10.0
}

fn queue(k: usize) -> u32 {
    (k % 7) as u32
}

/// Pod `k`'s report: ready, healthy, `gpu(k)` busy, `waiting` queued.
fn pod_stats(k: usize, waiting: u32) -> PodStats {
    PodStats {
        observed_at_unix_ms: 0,
        num_requests_waiting: waiting,
        gpu_utilization: gpu(k),
        health_score: 1.0,
        ready: true,
        ..PodStats::default()
    }
}

/// A pool of `n` pods as described in the module docs (`holders` of them share the chain), and
/// the request chain.
fn fleet(n: usize, holders: usize) -> (Arc<Pool>, Vec<BlockHash>) {
    fleet_waiting(n, holders, queue)
}

/// [`fleet`] with pod `k`'s reported queue `waiting(k)`.
fn fleet_waiting(n: usize, holders: usize, waiting: fn(usize) -> u32) -> (Arc<Pool>, Vec<BlockHash>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let Ok(rt) = rt else { panic!("tokio runtime") };
    let pool = Pool::new(PoolConfig::default());
    let chain: Vec<BlockHash> = (0..PREFIX_BLOCKS).map(block).collect();
    rt.block_on(async {
        for k in 0..n {
            let shared = if k < holders { (PREFIX_BLOCKS as usize * (k + 1) / holders) as u64 } else { 0 };
            let mut blocks: Vec<BlockHash> = chain[..shared as usize].to_vec();
            let base = 1_000_000 + k as u64 * OWN_BLOCKS;
            blocks.extend((base..base + OWN_BLOCKS).map(block));
            let info = PodInfo {
                pod: format!("pod-{k}"),
                endpoint: format!("10.0.{}.{}:8000", k / 250, k % 250),
                model: "m".into(),
                block_size: 16,
                index_block_size: 16,
                annotations: [("kvroute.io/cost-per-hour".to_string(), format!("{}", 0.5 + (k % 4) as f64))]
                    .into_iter()
                    .collect(),
            };
            let u = PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(pod_stats(k, waiting(k))), blocks };
            if pool.update(u).await.is_err() {
                panic!("pool writer gone");
            }
        }
        if pool.sync().await.is_err() {
            panic!("pool writer gone");
        }
    });
    (pool, chain)
}

/// Teaches every pod's TTFT model and the fleet's, as first tokens in service would: six cold
/// prompts of 8 to 88 blocks per pod, each first token 0.2 ms per uncached token plus 15 ms.
/// The pods must report no queue (a first token counts only against work the picker knows).
fn teach_ttft(router: &Router, n: usize) {
    for k in 0..n {
        let only = vec![format!("10.0.{}.{}:8000", k / 250, k % 250)];
        for j in 0..6u64 {
            let prompt: Vec<BlockHash> =
                (0..8 + 16 * j).map(|i| block(5_000_000 + (k as u64 * 6 + j) * 100 + i)).collect();
            let rq = RouteRequest { model: "m", adapter: None, block_hashes: &prompt, subset: Some(&only) };
            let Ok(mut d) = router.route(&rq) else { panic!("route") };
            let tokens = (prompt.len() * 16) as f64;
            let seen = d.slot.observe_ttft(15.0 + 0.2 * tokens);
            if !matches!(seen, TtftObservation::Learned { .. }) {
                panic!("pod-{k} did not learn its first token: {seen:?}");
            }
            router.shared().credit.count_ttft(seen);
        }
    }
    let e = router.explain(&RouteRequest { model: "m", adapter: None, block_hashes: &[], subset: None });
    if e.candidates.iter().any(|c| c.predicted_ttft_ms.is_none()) {
        panic!("a pod predicts no TTFT after learning");
    }
}

/// Block `j` of the `per_pod` one-block requests [`hold_in_flight`] routes to pod `k`.
fn held_block(k: usize, per_pod: u64, j: u64) -> BlockHash {
    block(9_000_000 + k as u64 * per_pod + j)
}

/// Routes `per_pod` one-block requests to each of the `n` pods (by subset) and keeps their
/// decisions, so each pod holds that many requests in flight until they are dropped.
fn hold_in_flight(router: &Router, n: usize, per_pod: u64) -> Vec<kvroute_picker::score::Decision> {
    let mut held = Vec::new();
    for k in 0..n {
        let only = vec![format!("10.0.{}.{}:8000", k / 250, k % 250)];
        for j in 0..per_pod {
            let prompt = [held_block(k, per_pod, j)];
            let rq = RouteRequest { model: "m", adapter: None, block_hashes: &prompt, subset: Some(&only) };
            let Ok(d) = router.route(&rq) else { panic!("route") };
            held.push(d);
        }
    }
    held
}

/// Stores in each pod's index the blocks [`hold_in_flight`] routed to it, as its KV events
/// would once their prompts are computed.
fn confirm_held(pool: &Arc<Pool>, n: usize, per_pod: u64) {
    update_each(pool, n, |k| ((0..per_pod).map(|j| held_block(k, per_pod, j)).collect(), None));
}

/// Sets every pod's reported queue back to the module's `queue(k)`.
fn requeue(pool: &Arc<Pool>, n: usize) {
    update_each(pool, n, |k| (Vec::new(), Some(pod_stats(k, queue(k)))));
}

/// Sends each of the `n` pods a delta of `change(k)` (blocks stored, new stats) and waits until
/// the pool has published them.
fn update_each(pool: &Arc<Pool>, n: usize, change: impl Fn(usize) -> (Vec<BlockHash>, Option<PodStats>)) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let Ok(rt) = rt else { panic!("tokio runtime") };
    rt.block_on(async {
        for k in 0..n {
            let (stored, stats) = change(k);
            send_delta(pool, k, stored, Vec::new(), stats).await;
        }
        if pool.sync().await.is_err() {
            panic!("pool writer gone");
        }
    });
}

/// Sends pod `k` a delta: `stored` and `removed` blocks, and `stats` if any.
async fn send_delta(
    pool: &Arc<Pool>,
    k: usize,
    stored: Vec<BlockHash>,
    removed: Vec<BlockHash>,
    stats: Option<PodStats>,
) {
    let u = PoolUpdate::Delta { stream: 1, pod: format!("pod-{k}"), seq: 1, cleared: false, stored, removed, stats };
    if pool.update(u).await.is_err() {
        panic!("pool writer gone");
    }
}

/// Times `router` on `rq` alone, after each round of [`churn`] on `pool`'s `n` pods (with
/// `stats`, one of the eight also reports).
fn route_live(
    b: &mut criterion::Bencher<'_>,
    router: &Router,
    pool: &Arc<Pool>,
    n: usize,
    rq: &RouteRequest<'_>,
    stats: bool,
) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let Ok(rt) = rt else { panic!("tokio runtime") };
    let mut round = 0u64;
    b.iter_custom(|iters| {
        let mut spent = std::time::Duration::ZERO;
        for _ in 0..iters {
            rt.block_on(churn(pool, n, round, stats));
            round += 1;
            let start = std::time::Instant::now();
            let d = router.route(black_box(rq));
            black_box(d.map(|d| d.score).unwrap_or(0.0));
            spent += start.elapsed();
        }
        spent
    });
}

/// Round `round` of the live cases' event stream: eight pods in turn each store (even
/// rounds) or remove (odd rounds) a block of their own, then the pool publishes. With `stats`,
/// the first of them also sends its report again (the same figures, so the decision stays
/// the same): a 1,000-pod fleet reporting every 2 s sends one every 2 ms.
async fn churn(pool: &Arc<Pool>, n: usize, round: u64, stats: bool) {
    for j in 0..8 {
        let k = ((round / 2) as usize * 8 + j) % n;
        let extra = vec![block(50_000_000 + k as u64)];
        let (stored, removed) = if round.is_multiple_of(2) { (extra, Vec::new()) } else { (Vec::new(), extra) };
        let report = (stats && j == 0).then(|| pod_stats(k, queue(k)));
        send_delta(pool, k, stored, removed, report).await;
    }
    if pool.sync().await.is_err() {
        panic!("pool writer gone");
    }
}

/// The formula alone over flat arrays (cache ratio, gpu, queue, health, adapter): the baseline.
fn naive_formula(rows: &[[f64; 5]], max_queue: f64) -> usize {
    let mut best = (f64::MIN, 0);
    for (i, r) in rows.iter().enumerate() {
        let s =
            0.60 * r[0] + 0.20 * (1.0 - r[1]) + 0.10 * (1.0 - (r[2] / max_queue).min(1.0)) + 0.05 * r[3] + 0.05 * r[4];
        if s > best.0 {
            best = (s, i);
        }
    }
    best.1
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for n in [64usize, 1000] {
        let (pool, chain) = fleet(n, 8);
        let Ok(router) = Router::new(pool.clone(), ScoringConfig::default()) else { panic!("router") };
        let rq = RouteRequest { model: "m", adapter: None, block_hashes: &chain, subset: None };
        let route = |b: &mut criterion::Bencher<'_>, router: &Router, rq: &RouteRequest<'_>| {
            b.iter(|| {
                let d = router.route(black_box(rq));
                black_box(d.map(|d| d.score).unwrap_or(0.0))
            });
        };
        g.bench_with_input(BenchmarkId::new("route", n), &n, |b, _| route(b, &router, &rq));
        // The same while the pods' blocks change before each decision, as in `route_busy_live`
        // but with nothing in flight: what a new snapshot costs a decision by itself.
        g.bench_with_input(BenchmarkId::new("route_live", n), &n, |b, _| route_live(b, &router, &pool, n, &rq, false));
        // The same with one pod's report among the deltas: the pod table is published again.
        g.bench_with_input(BenchmarkId::new("route_live_stats", n), &n, |b, _| {
            route_live(b, &router, &pool, n, &rq, true)
        });
        let empty = RouteRequest { block_hashes: &[], ..rq };
        g.bench_with_input(BenchmarkId::new("route_no_prefix", n), &n, |b, _| route(b, &router, &empty));
        // The same request without the placement of a new prefix (its cost is the difference).
        let off = ScoringConfig { cold_placement_margin: 0.0, ..ScoringConfig::default() };
        let Ok(router_off) = Router::new(pool.clone(), off) else { panic!("router") };
        g.bench_with_input(BenchmarkId::new("route_no_prefix_placement_off", n), &n, |b, _| {
            route(b, &router_off, &empty)
        });
        drop(router_off);
        // The same full-hit request without the count of its prefix's popularity.
        // The pile guard and the full-fleet rule read the count too, so they are off as well
        // (neither applies here).
        let off = ScoringConfig {
            popularity_placement_margin: 0.0,
            pile_guard_margin: 0,
            full_fleet_kv: 0.0,
            ..ScoringConfig::default()
        };
        let Ok(router_off) = Router::new(pool.clone(), off) else { panic!("router") };
        g.bench_with_input(BenchmarkId::new("route_popularity_off", n), &n, |b, _| route(b, &router_off, &rq));
        drop(router_off);
        let cost = ScoringConfig {
            weights: Weights { cache: 0.50, load: 0.15, queue: 0.10, health: 0.05, adapter: 0.05 },
            custom: vec![CustomScorerConfig::Cost { weight: 0.15, margin: 0.20 }],
            ..ScoringConfig::default()
        };
        let Ok(router_cost) = Router::new(pool.clone(), cost) else { panic!("router") };
        g.bench_with_input(BenchmarkId::new("route_with_cost_scorer", n), &n, |b, _| route(b, &router_cost, &rq));
        // `route` with two requests in flight on every pod, routed after its report, as in
        // service: each candidate's queue depth then counts its in-flight list.
        // Their pending entries are kept for the whole run (by default they lapse after 2 s,
        // which would change the case while it is measured).
        let busy = ScoringConfig { pending_ttl_ms: 3_600_000, ..ScoringConfig::default() };
        let Ok(router_busy) = Router::new(pool.clone(), busy) else { panic!("router") };
        let held = hold_in_flight(&router_busy, n, 2);
        g.bench_with_input(BenchmarkId::new("route_busy", n), &n, |b, _| route(b, &router_busy, &rq));
        // The same while the pods' KV events keep arriving, as in service: before each decision
        // eight pods' blocks change (published as one snapshot), so their requests' progress
        // is read again. Only the decision is timed.
        g.bench_with_input(BenchmarkId::new("route_busy_live", n), &n, |b, _| {
            route_live(b, &router_busy, &pool, n, &rq, false)
        });
        g.bench_with_input(BenchmarkId::new("route_busy_live_stats", n), &n, |b, _| {
            route_live(b, &router_busy, &pool, n, &rq, true)
        });
        // The same once every pod's events have shown those prompts computed: the requests are
        // decoding, no longer prefilling.
        confirm_held(&pool, n, 2);
        g.bench_with_input(BenchmarkId::new("route_busy_decoding", n), &n, |b, _| route(b, &router_busy, &rq));
        drop((held, router_busy));
        // The same request once every pod's TTFT model has learned (a fleet in service): each
        // candidate's line is then solved, not just looked up.
        let (pool_learned, chain_learned) = fleet_waiting(n, 8, |_| 0);
        let Ok(router_learned) = Router::new(pool_learned.clone(), ScoringConfig::default()) else { panic!("router") };
        teach_ttft(&router_learned, n);
        requeue(&pool_learned, n);
        let rq_learned = RouteRequest { block_hashes: &chain_learned, ..rq };
        g.bench_with_input(BenchmarkId::new("route_learned", n), &n, |b, _| route(b, &router_learned, &rq_learned));
        drop((router_learned, pool_learned));
        let rows: Vec<[f64; 5]> = (0..n)
            .map(|k| {
                let shared = if k < 8 { (PREFIX_BLOCKS as usize * (k + 1) / 8) as f64 } else { 0.0 };
                [shared / PREFIX_BLOCKS as f64, gpu(k), f64::from(queue(k)), 1.0, 1.0]
            })
            .collect();
        g.bench_with_input(BenchmarkId::new("naive_formula", n), &n, |b, _| {
            b.iter(|| naive_formula(black_box(&rows), 20.0));
        });
        drop((router, router_cost, pool));
        let (pool, chain) = fleet(n, n);
        let Ok(router) = Router::new(pool, ScoringConfig::default()) else { panic!("router") };
        let rq = RouteRequest { model: "m", adapter: None, block_hashes: &chain, subset: None };
        g.bench_with_input(BenchmarkId::new("route_all_share", n), &n, |b, _| route(b, &router, &rq));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
