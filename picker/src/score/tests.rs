//! Scoring tests: docs/design.md §4 properties (proptest), the seed's worked numbers, filters, spill,
//! ties, health exclusion, adapter match, reservations, config validation.

use std::sync::Arc;

use proptest::prelude::*;

use super::{PodFacts, RouteError, RouteRequest, Router, ScoreContext, ScoringConfig, ScoringConfigError, Weights};
use crate::pool::tests::{chain, put, stats};
use crate::pool::{Pool, PoolConfig, PoolUpdate};
use kvroute_common::BlockHash;

pub(super) fn facts(matched: u32, gpu: f64, queue: u32, health: f64, adapters: &[String]) -> PodFacts<'_> {
    PodFacts {
        name: "p",
        endpoint: "p:1",
        matched_blocks: matched,
        pending_blocks: 0,
        offloaded_blocks: 0,
        gpu_utilization: gpu,
        in_flight_load: None,
        queue_depth: queue,
        health_score: health,
        health_reason: "",
        kv_cache_usage: 0.0,
        running_adapters: adapters,
        cost_per_hour: None,
        annotations: &[],
    }
}

pub(super) fn router(config: ScoringConfig) -> (Arc<Pool>, Router) {
    let pool = Pool::new(PoolConfig::default());
    let r = Router::new(pool.clone(), config);
    assert!(r.is_ok());
    let Ok(r) = r else { unreachable!() };
    (pool, r)
}

pub(super) fn req<'a>(blocks: &'a [kvroute_common::BlockHash]) -> RouteRequest<'a> {
    RouteRequest { model: "m", adapter: None, block_hashes: blocks, subset: None }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]

    /// S ∈ [0,1] for any inputs, including out-of-range and adversarial ones.
    #[test]
    fn composite_is_in_unit_interval(
        total in 0u32..300, matched in 0u32..400, gpu in -1.0f64..3.0, queue in 0u32..100,
        health in -0.5f64..1.5, has_adapter in any::<bool>(), wants_adapter in any::<bool>(),
    ) {
        let (_pool, r) = router(ScoringConfig::default());
        let running = if has_adapter { vec!["x".to_string()] } else { vec![] };
        let f = facts(matched, gpu, queue, health, &running);
        let ctx = ScoreContext { adapter: wants_adapter.then_some("x"), total_blocks: total, block_size: 16, config: r.config(), candidates: &[] };
        let (factors, s) = r.composite(&ctx, &f);
        prop_assert!((0.0..=1.0).contains(&s), "S = {s}");
        for v in factors { prop_assert!((0.0..=1.0).contains(&v)); }
    }

    /// A cache advantage ≥ 0.65 is never overturned when both pods pass the health threshold.
    #[test]
    fn cache_advantage_of_065_always_wins(
        total in 20u32..300, ratio_b in 0.0f64..0.35, adv in 0.65f64..1.0,
        gpu_a in 0.0f64..1.0, gpu_b in 0.0f64..1.0, q_a in 0u32..40, q_b in 0u32..40,
        h_a in 0.3f64..1.0, h_b in 0.3f64..1.0, ad_a in any::<bool>(), ad_b in any::<bool>(),
    ) {
        let (_pool, r) = router(ScoringConfig::default());
        let ratio_a = (ratio_b + adv).min(1.0);
        prop_assume!(ratio_a - ratio_b >= 0.65);
        // Matched counts realising at least the advantage.
        let m_a = (ratio_a * f64::from(total)).ceil() as u32;
        let m_b = (ratio_b * f64::from(total)).floor() as u32;
        let run = vec!["x".to_string()];
        let none: Vec<String> = vec![];
        let fa = facts(m_a.min(total), gpu_a, q_a, h_a, if ad_a { &run } else { &none });
        let fb = facts(m_b, gpu_b, q_b, h_b, if ad_b { &run } else { &none });
        let ctx = ScoreContext { adapter: Some("x"), total_blocks: total, block_size: 16, config: r.config(), candidates: &[] };
        let (_, sa) = r.composite(&ctx, &fa);
        let (_, sb) = r.composite(&ctx, &fb);
        prop_assert!(sa > sb, "S_a {sa} <= S_b {sb}");
    }

    /// The health factor alone never costs a pass-threshold pod more than 0.035.
    #[test]
    fn max_health_penalty_is_0035(h in 0.3f64..=1.0) {
        let (_pool, r) = router(ScoringConfig::default());
        let ctx = ScoreContext { adapter: None, total_blocks: 10, block_size: 16, config: r.config(), candidates: &[] };
        let (_, best) = r.composite(&ctx, &facts(5, 0.5, 3, 1.0, &[]));
        let (_, s) = r.composite(&ctx, &facts(5, 0.5, 3, h, &[]));
        prop_assert!(best - s <= 0.035 + 1e-12);
    }
}

#[tokio::test]
async fn cache_hot_loaded_pod_beats_idle_cold_pod() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 32);
    put(&pool, "hot", "m", stats(0.8, 0, 1.0), &c).await;
    put(&pool, "cold", "m", stats(0.0, 0, 1.0), &[]).await;
    let d = r.route(&req(&c));
    assert!(d.is_ok(), "{d:?}");
    let Ok(d) = d else { return };
    assert_eq!((d.pod.as_str(), d.endpoint.as_str()), ("hot", "hot:8000"));
    assert_eq!((d.matched_blocks, d.total_blocks), (32, 32));
    assert!((d.match_ratio - 1.0).abs() < 1e-12);
    let hot = &d.candidates[0];
    let cold = &d.candidates[1];
    assert!((0.6 * hot.cache + 0.2 * hot.load - 0.64).abs() < 1e-9);
    assert!((0.6 * cold.cache + 0.2 * cold.load - 0.20).abs() < 1e-9);
    // Full composite: hot 0.64 + 0.1 + 0.05 + 0.05; cold 0.20 + 0.2.
    assert!((hot.score - 0.84).abs() < 1e-9 && (cold.score - 0.40).abs() < 1e-9);
}

#[tokio::test]
async fn partial_prefix_counts_consecutive_blocks_from_the_start() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 10);
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &c[..4]).await;
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert_eq!((d.matched_blocks, d.total_blocks), (4, 10));
    assert!((d.match_ratio - 0.4).abs() < 1e-12);
}

/// `route_with`: per pod the larger of the index's and the alternative source's matched blocks.
#[tokio::test]
async fn route_with_takes_the_larger_of_index_and_alternative_matches() {
    struct Fixed(&'static str, u32);
    impl super::PrefixMatches for Fixed {
        fn matched_blocks(&self, pod: &str) -> u32 {
            if pod == self.0 { self.1 } else { 0 }
        }
    }
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 10);
    put(&pool, "indexed", "m", stats(0.5, 0, 1.0), &c[..4]).await;
    put(&pool, "guessed", "m", stats(0.5, 0, 1.0), &[]).await;
    let Ok(d) = r.route_with(&req(&c), Some(&Fixed("guessed", 8))) else { panic!("no decision") };
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("guessed", 8));
    let m = |name: &str| d.candidates.iter().find(|c| &*c.pod == name).map(|c| c.matched_blocks);
    assert_eq!(m("indexed"), Some(4), "the index still counts");
    drop(d);
    let Ok(d) = r.route_with(&req(&c), Some(&Fixed("indexed", 2))) else { panic!("no decision") };
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("indexed", 4), "a smaller guess never lowers the index");
    drop(d);
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("indexed", 4));
}

#[tokio::test]
async fn full_queue_spills_then_degrades_or_sheds() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 8);
    put(&pool, "hot", "m", stats(0.0, 20, 1.0), &c).await;
    put(&pool, "cold", "m", stats(0.9, 5, 1.0), &[]).await;
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert_eq!(d.pod, "cold", "hot pod at maxQueue must spill");
    let e = r.explain(&req(&c));
    assert!(e.excluded.iter().any(|(p, why)| p == "hot" && why.contains("queue")), "{e:?}");
    drop(d);
    // Everyone saturated: all stay candidates, cache wins again.
    put(&pool, "cold", "m", stats(0.9, 25, 1.0), &[]).await;
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert_eq!(d.pod, "hot");
    drop(d);
    let shed = Router::new(pool.clone(), ScoringConfig { shed_when_saturated: true, ..ScoringConfig::default() });
    let Ok(shed) = shed else { panic!("config") };
    assert!(matches!(shed.route(&req(&c)), Err(RouteError::Shed { .. })));
}

#[tokio::test]
async fn reservations_are_seen_by_later_decisions_and_released_on_drop() {
    let cfg = ScoringConfig { max_queue: 2, ..ScoringConfig::default() };
    let (pool, r) = router(cfg);
    let c = chain(0, 8);
    put(&pool, "hot", "m", stats(0.0, 0, 1.0), &c).await;
    put(&pool, "cold", "m", stats(0.0, 0, 1.0), &[]).await;
    let Ok(d1) = r.route(&req(&c)) else { panic!() };
    let Ok(d2) = r.route(&req(&c)) else { panic!() };
    assert_eq!((d1.pod.as_str(), d2.pod.as_str()), ("hot", "hot"));
    let hot = pool.pods().into_iter().find(|p| p.name == "hot");
    assert_eq!(hot.map(|p| (p.in_flight, p.queue_depth)), Some((2, 2)));
    // maxQueue 2 reached by the picker's own reservations: the third spills.
    let Ok(d3) = r.route(&req(&c)) else { panic!() };
    assert_eq!(d3.pod, "cold");
    drop((d1, d2, d3));
    assert!(pool.pods().iter().all(|p| p.in_flight == 0));
}

#[tokio::test]
async fn concurrent_routes_reserve_exactly_once_each() {
    let (pool, r) = router(ScoringConfig { max_queue: 1000, ..ScoringConfig::default() });
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
    put(&pool, "b", "m", stats(0.0, 0, 1.0), &[]).await;
    let r = Arc::new(r);
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let r = r.clone();
            std::thread::spawn(move || (0..50).filter_map(|_| r.route(&req(&[])).ok()).collect::<Vec<_>>())
        })
        .collect();
    let slots: Vec<_> = threads.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect();
    assert_eq!(slots.len(), 200);
    let pods = pool.pods();
    assert_eq!(pods.iter().map(|p| p.in_flight).sum::<u32>(), 200);
    // Queue factor balances identical pods: each got about half.
    assert!(pods.iter().all(|p| (90..=110).contains(&p.in_flight)), "{pods:?}");
}

/// docs/design.md §4 queueDepth: a request the pod reports running whose prompt its KV events have
/// not confirmed yet is still being prefilled, and the next cold request queues behind it.
#[tokio::test]
async fn a_request_still_prefilling_counts_in_queue_depth_until_its_blocks_are_confirmed() {
    // Cold prompts by S alone: the placement of new prefixes would weigh where the earlier
    // ones went, which is not what this test reads.
    let (pool, r) = router(ScoringConfig { cold_placement_margin: 0.0, ..ScoringConfig::default() });
    // Reports read after the routing below (one second ahead of the wall clock).
    let after = |gpu: f64| {
        let mut s = stats(gpu, 0, 1.0);
        s.observed_at_unix_ms = crate::pool::now_unix_ms() + 1000;
        s
    };
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
    put(&pool, "b", "m", stats(0.01, 0, 1.0), &[]).await;
    // a's KV events have confirmed a routed prompt before (a pod that publishes none is not
    // read as queued for its requests).
    let w = chain(300, 8);
    let Ok(dw) = r.route(&req(&w)) else { panic!("no decision") };
    assert_eq!(dw.pod, "a");
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &w).await;
    assert_eq!(r.explain(&req(&w)).choice.as_deref(), Some("a"));
    drop(dw);
    let x = chain(100, 8);
    let Ok(dx) = r.route(&req(&x)) else { panic!("no decision") };
    assert_eq!(dx.pod, "a", "the idler pod takes the first cold prompt");
    // a runs x, nothing of it stored yet; b runs three requests that are decoding.
    put(&pool, "a", "m", after(1.0 / 256.0), &[]).await;
    put(&pool, "b", "m", after(3.0 / 256.0), &[]).await;
    let y = chain(200, 8);
    let depth = |e: &super::Explanation, pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| c.queue);
    let e = r.explain(&req(&y));
    assert_eq!(e.choice.as_deref(), Some("b"), "{e:?}");
    assert_eq!((depth(&e, "a"), depth(&e, "b")), (Some(1.0 - 1.0 / 20.0), Some(1.0)));
    // a's events store x's blocks: its prefill is over, a is the idler pod again.
    put(&pool, "a", "m", after(1.0 / 256.0), &x).await;
    let e = r.explain(&req(&y));
    assert_eq!(e.choice.as_deref(), Some("a"), "{e:?}");
    assert_eq!(depth(&e, "a"), Some(1.0));
    drop(dx);
}

/// docs/design.md §4 ties: pods a and b read the same on load and queue, each prefilling one cold
/// prompt, but a's KV events already hold half of its prompt. A request neither holds a block of
/// goes to a whatever the seed; without the prefill tie-break the seeded random pick sends some to b.
#[tokio::test]
async fn a_cold_tie_goes_to_the_pod_with_less_prefill_left() {
    let mut chosen = Vec::new();
    for on in [true, false] {
        for seed in 0..16 {
            let (pool, r) = router(ScoringConfig { seed, prefill_tie_break: on, ..ScoringConfig::default() });
            // Reports read after the routing below (one second ahead of the wall clock).
            let after = || {
                let mut s = stats(1.0 / 256.0, 0, 1.0);
                s.num_requests_running = 1;
                s.observed_at_unix_ms = crate::pool::now_unix_ms() + 1000;
                s
            };
            let to = |pod: &str| vec![format!("{pod}:8000")];
            let route_to = |pod: &str, blocks: &[BlockHash]| {
                let only = to(pod);
                let d = r.route(&RouteRequest { subset: Some(&only), ..req(blocks) });
                let Ok(d) = d else { panic!("no decision") };
                assert_eq!(d.pod, pod);
                d
            };
            put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
            put(&pool, "b", "m", stats(0.0, 0, 1.0), &[]).await;
            // Each pod's KV events have confirmed a routed prompt (docs/design.md §4 queueDepth).
            for (pod, base) in [("a", 300), ("b", 400)] {
                let w = chain(base, 8);
                let d = route_to(pod, &w);
                put(&pool, pod, "m", stats(0.0, 0, 1.0), &w).await;
                assert_eq!(r.explain(&req(&w)).choice.as_deref(), Some(pod));
                drop(d);
            }
            let (x, y) = (chain(100, 8), chain(200, 8));
            let (dx, dy) = (route_to("a", &x), route_to("b", &y));
            // Both report one request running; a's events hold the first 4 of x's 8 blocks.
            put(&pool, "a", "m", after(), &x[..4]).await;
            put(&pool, "b", "m", after(), &[]).await;
            let e = r.explain(&req(&chain(500, 8)));
            let score = |pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| (c.score, c.queue));
            assert_eq!(score("a"), score("b"), "a tie on S and queue: {e:?}");
            assert_eq!(score("a").map(|(_, q)| q), Some(1.0 - 1.0 / 20.0), "{e:?}");
            chosen.push((on, e.choice));
            drop((dx, dy));
        }
    }
    let picks = |on: bool, pod: &str| chosen.iter().filter(|(o, c)| *o == on && c.as_deref() == Some(pod)).count();
    assert_eq!((picks(true, "a"), picks(true, "b")), (16, 0), "{chosen:?}");
    assert!(picks(false, "a") > 0 && picks(false, "b") > 0, "{chosen:?}");
}

/// docs/design.md §4 "Where a new prefix goes": among pods that read the same on S, a prompt no
/// pod holds a block of goes to the one with the least long-run share (routed rate and cached
/// blocks, each over the fleet's mean); a pod more than `cold_placement_margin` below the best S
/// is not taken for it, a request some pod holds blocks of goes by S, and margin 0 turns it off.
#[tokio::test]
async fn a_new_prefix_goes_to_the_pod_with_the_least_traffic_and_cache() {
    let (pool, r) = router(ScoringConfig::default());
    // many: 40 cached blocks; busy: 10 one-block prompts routed to it, now cached; light: 10
    // cached blocks, never routed to; queued: nothing cached but 4 requests waiting (S 0.02 lower).
    put(&pool, "many", "m", stats(0.0, 0, 1.0), &chain(1_000, 40)).await;
    put(&pool, "light", "m", stats(0.0, 0, 1.0), &chain(2_000, 10)).await;
    put(&pool, "busy", "m", stats(0.0, 0, 1.0), &[]).await;
    let only = vec!["busy:8000".to_string()];
    let prompts: Vec<Vec<BlockHash>> = (0..10).map(|i| chain(3_000 + 10 * i, 1)).collect();
    for p in &prompts {
        let d = r.route(&RouteRequest { subset: Some(&only), ..req(p) });
        assert_eq!(d.map(|d| d.pod).ok().as_deref(), Some("busy"));
    }
    put(&pool, "busy", "m", stats(0.0, 0, 1.0), &prompts.concat()).await;
    put(&pool, "queued", "m", stats(0.0, 4, 1.0), &[]).await;
    let fresh = chain(9_000, 8);
    let e = r.explain(&req(&fresh));
    let score = |pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| c.score);
    assert_eq!(score("many"), score("light"), "{e:?}");
    assert_eq!(score("busy"), score("light"), "{e:?}");
    assert!(score("queued") < score("light").map(|s| s - 0.01), "{e:?}");
    assert_eq!(e.choice.as_deref(), Some("light"), "{e:?}");
    let Ok(d) = r.route(&req(&fresh)) else { panic!("no decision") };
    assert_eq!(d.pod, "light");
    drop(d);
    // Blocks of the request on `many`: S decides, as for any request.
    let mut warm = chain(1_000, 4);
    warm.extend(chain(9_500, 4));
    assert_eq!(r.explain(&req(&warm)).choice.as_deref(), Some("many"));
    // Off: the seeded random tie among the equal best S, whatever the shares.
    let mut picks = std::collections::BTreeSet::new();
    for seed in 0..32 {
        let (pool, r) = router(ScoringConfig { seed, cold_placement_margin: 0.0, ..ScoringConfig::default() });
        put(&pool, "many", "m", stats(0.0, 0, 1.0), &chain(1_000, 40)).await;
        put(&pool, "light", "m", stats(0.0, 0, 1.0), &chain(2_000, 10)).await;
        picks.extend(r.explain(&req(&fresh)).choice);
    }
    assert_eq!(picks.len(), 2, "{picks:?}");
}

/// docs/design.md §4 "Where a new prefix goes": while the recent prefixes are equally popular,
/// a new one goes to the candidate with the fewest cached blocks within the wider
/// `popularity_placement_margin`, even one further below the best S than `cold_placement_margin`;
/// while they are skewed, or nothing repeats (a flood of distinct prompts), it stays within
/// `cold_placement_margin`; and no further than the wider margin either way. The counter counts the
/// placements by cached blocks alone.
#[tokio::test]
async fn equally_popular_prefixes_place_a_new_one_by_cached_blocks_alone() {
    /// Routes `roots` prefixes (one block each), root `i` `times(i)` times, to pod `sink`.
    fn warm(r: &Router, roots: u64, times: impl Fn(u64) -> u64) {
        let sink = vec!["sink:8000".to_string()];
        for round in 0..roots.max(1) {
            for i in (0..roots).filter(|&i| times(i) > round) {
                let p = chain(50_000 + i, 1);
                assert!(r.route(&RouteRequest { subset: Some(&sink), ..req(&p) }).is_ok());
            }
        }
    }
    /// How many times root `i` is routed.
    type Times = fn(u64) -> u64;
    let setups: [(&str, u64, Times); 3] =
        [("equal", 100, |_| 3), ("skewed", 100, |i| if i < 4 { 60 } else { 1 + i % 2 }), ("distinct", 300, |_| 1)];
    for (shape, roots, times) in setups {
        let (pool, r) = router(ScoringConfig::default());
        put(&pool, "sink", "m", stats(0.0, 0, 1.0), &[]).await;
        // full: 40 cached blocks, idle; queued: 4 cached blocks, 4 waiting (S 0.02 lower); far:
        // nothing cached, 12 waiting (S 0.06 lower, beyond the wider margin too).
        put(&pool, "full", "m", stats(0.0, 0, 1.0), &chain(1_000, 40)).await;
        put(&pool, "queued", "m", stats(0.0, 4, 1.0), &chain(2_000, 4)).await;
        put(&pool, "far", "m", stats(0.0, 12, 1.0), &[]).await;
        warm(&r, roots, times);
        let only = vec!["full:8000".to_string(), "queued:8000".to_string(), "far:8000".to_string()];
        let fresh = chain(9_000, 8);
        let e = r.explain(&RouteRequest { subset: Some(&only), ..req(&fresh) });
        let score = |pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| c.score);
        assert!(score("queued") < score("full").map(|s| s - 0.01), "{shape}: {e:?}");
        assert!(score("far") < score("full").map(|s| s - 0.05), "{shape}: {e:?}");
        let want = if shape == "equal" { "queued" } else { "full" };
        assert_eq!(e.choice.as_deref(), Some(want), "{shape}: {e:?}");
        let (by_traffic, by_cache) = (
            r.shared().credit.new_prefix_by_traffic.load(std::sync::atomic::Ordering::Relaxed),
            r.shared().credit.new_prefix_by_cache.load(std::sync::atomic::Ordering::Relaxed),
        );
        // Skewed or distinct, no other candidate is within the margin: no placement to count.
        assert_eq!((by_traffic, by_cache > 0), (0, shape == "equal"), "{shape}");
    }
}

#[tokio::test]
async fn ties_break_on_load_then_queue_then_seeded_random() {
    // The ties of S itself: new prefixes are not placed by their pods' share here.
    let cache_only = ScoringConfig {
        weights: Weights { cache: 1.0, load: 0.0, queue: 0.0, health: 0.0, adapter: 0.0 },
        cold_placement_margin: 0.0,
        ..ScoringConfig::default()
    };
    let (pool, r) = router(cache_only.clone());
    put(&pool, "busy", "m", stats(0.7, 0, 1.0), &[]).await;
    put(&pool, "idle", "m", stats(0.1, 9, 1.0), &[]).await;
    let Ok(d) = r.route(&req(&[])) else { panic!() };
    assert_eq!(d.pod, "idle", "equal S: lower loadRatio wins");
    drop(d);
    put(&pool, "busy", "m", stats(0.1, 1, 1.0), &[]).await;
    let Ok(d) = r.route(&req(&[])) else { panic!() };
    assert_eq!(d.pod, "busy", "equal S and load: lower queue wins");
    drop(d);
    put(&pool, "busy", "m", stats(0.1, 9, 1.0), &[]).await;
    let picks = |r: &Router| (0..64).filter_map(|_| r.route(&req(&[])).ok().map(|d| d.pod)).collect::<Vec<_>>();
    let Ok(fresh) = Router::new(pool.clone(), cache_only.clone()) else { panic!() };
    let first = picks(&fresh);
    assert!(first.iter().any(|p| p == "busy") && first.iter().any(|p| p == "idle"), "random tie-break spreads");
    let Ok(again) = Router::new(pool.clone(), cache_only) else { panic!() };
    assert_eq!(picks(&again), first, "same seed, same sequence");
}

#[tokio::test]
async fn unhealthy_pods_are_excluded_with_a_reason() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 8);
    let mut sick = stats(0.0, 0, 0.2);
    sick.health_reason = "uncorrected ECC".into();
    put(&pool, "sick", "m", sick, &c).await;
    let e = r.route(&req(&c));
    let Err(RouteError::NoCandidate { reason }) = e else { panic!("expected NoCandidate, got {e:?}") };
    assert!(reason.contains("sick") && reason.contains("uncorrected ECC"), "{reason}");
    put(&pool, "ok", "m", stats(0.9, 10, 0.3), &[]).await;
    let Ok(d) = r.route(&req(&c)) else { panic!() };
    assert_eq!(d.pod, "ok", "a full cache hit on a pod below threshold does not count");
    let e = r.explain(&req(&c));
    assert_eq!(e.choice.as_deref(), Some("ok"));
    assert_eq!(e.excluded.len(), 1);
}

#[tokio::test]
async fn adapter_match_prefers_pods_running_the_adapter() {
    let (pool, r) = router(ScoringConfig::default());
    let mut with = stats(0.2, 0, 1.0);
    with.running_adapters = vec!["sql-lora".into()];
    put(&pool, "with", "m", with, &[]).await;
    put(&pool, "without", "m", stats(0.2, 0, 1.0), &[]).await;
    let rq = RouteRequest { adapter: Some("sql-lora"), ..req(&[]) };
    let Ok(d) = r.route(&rq) else { panic!() };
    assert_eq!(d.pod, "with");
    assert_eq!(d.candidates[0].adapter, 1.0);
    assert_eq!(d.candidates[1].adapter, 0.0);
}

#[tokio::test]
async fn model_subset_and_readiness_filters() {
    let (pool, r) = router(ScoringConfig::default());
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
    put(&pool, "b", "m", stats(0.9, 0, 1.0), &[]).await;
    put(&pool, "other", "m2", stats(0.0, 0, 1.0), &[]).await;
    let mut not_ready = stats(0.0, 0, 1.0);
    not_ready.ready = false;
    put(&pool, "starting", "m", not_ready, &[]).await;
    let subset = vec!["b:8000".to_string()];
    let Ok(d) = r.route(&RouteRequest { subset: Some(&subset), ..req(&[]) }) else { panic!() };
    assert_eq!(d.pod, "b");
    let e = r.explain(&req(&[]));
    assert_eq!(e.choice.as_deref(), Some("a"));
    assert!(e.excluded.iter().any(|(p, why)| p == "starting" && why.contains("not ready")));
    let e = r.route(&RouteRequest { model: "nope", ..req(&[]) });
    assert!(matches!(e, Err(RouteError::NoCandidate { reason }) if reason.contains("no pod serves model 'nope'")));
}

#[tokio::test]
async fn stale_routing_is_judged_against_predicted_tokens() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 10);
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &c).await;
    let Ok(d) = r.route(&req(&c)) else { panic!() };
    // Predicted 160 tokens; vLLM never counts the last token: 144..=160 is fine.
    assert!(!d.slot.observe_cached_tokens(159));
    assert!(!d.slot.observe_cached_tokens(144));
    assert!(d.slot.observe_cached_tokens(143));
    assert!(d.slot.observe_cached_tokens(0));
}

#[test]
fn validate_names_every_weight_and_the_sum() {
    assert_eq!(ScoringConfig::default().validate(), Ok(()));
    let bad = ScoringConfig { weights: Weights { cache: 0.9, ..Weights::default() }, ..ScoringConfig::default() };
    let err = bad.validate();
    let Err(e @ ScoringConfigError::Weights { .. }) = err else { panic!("{err:?}") };
    let msg = e.to_string();
    for part in ["cache=0.9", "load=0.2", "queue=0.1", "health=0.05", "adapter=0.05", "sum 1.3"] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
    let neg = ScoringConfig {
        weights: Weights { cache: 1.1, load: -0.1, queue: 0.0, health: 0.0, adapter: 0.0 },
        ..ScoringConfig::default()
    };
    assert!(neg.validate().is_err(), "sum 1 but out-of-range weights");
    for name in ["chatbot", "latency-api", "batch", "multi-lora"] {
        assert_eq!(ScoringConfig::preset(name).map(|c| c.validate()), Some(Ok(())), "{name}");
    }
    assert!(ScoringConfig { max_queue: 0, ..ScoringConfig::default() }.validate().is_err());
    assert!(ScoringConfig { max_utilization: 0.0, ..ScoringConfig::default() }.validate().is_err());
}

#[test]
fn config_parses_with_defaults_and_rejects_unknown_fields() {
    let c: Result<ScoringConfig, _> = serde_norway::from_str("max_queue: 10");
    assert!(matches!(c, Ok(ref c) if c.max_queue == 10 && c.weights == Weights::default()), "{c:?}");
    let c: Result<ScoringConfig, _> = serde_norway::from_str("max_queu: 10");
    assert!(c.is_err());
}

#[tokio::test]
async fn decision_lists_the_best_few_in_order_and_explain_all() {
    let (pool, r) = router(ScoringConfig { max_queue: 1000, ..ScoringConfig::default() });
    for k in 0..40u32 {
        put(&pool, &format!("p{k}"), "m", stats(f64::from((k * 17) % 40) / 40.0, 0, 1.0), &[]).await;
    }
    let e = r.explain(&req(&[]));
    let Ok(d) = r.route(&req(&[])) else { panic!() };
    let n = super::ORDERED_CANDIDATES;
    assert_eq!((d.candidate_count, d.candidates.len(), e.candidates.len()), (40, n, 40));
    assert!(d.candidates.windows(2).all(|w| w[0].score > w[1].score), "{:?}", d.candidates);
    // The short list is exactly explain's first ORDERED_CANDIDATES.
    let names = |c: &[super::CandidateScore]| c.iter().map(|c| c.pod.to_string()).collect::<Vec<_>>();
    assert_eq!(names(&d.candidates), names(&e.candidates[..n]));
    assert_eq!(e.choice.as_deref(), Some(&*d.pod));
    assert!(e.candidates.windows(2).all(|w| w[0].score > w[1].score), "explain orders all");
}

/// docs/design.md §2 tiers: blocks only in a pod's CPU tier (vLLM KV offloading) earn
/// `offload_credit` each, after the GPU blocks, and only consecutively from the start.
#[tokio::test]
async fn cpu_tier_blocks_earn_partial_credit_after_gpu_blocks() {
    let (pool, r) = router(ScoringConfig { pending_ttl_ms: 0, ..ScoringConfig::default() });
    let c = chain(700, 10);
    put(&pool, "gpu", "m", stats(0.0, 0, 1.0), &c[..4]).await;
    put(&pool, "cpu", "m", stats(0.0, 0, 1.0), &c[..4]).await;
    let offload = |stored: Vec<BlockHash>| PoolUpdate::Offloaded {
        stream: 1,
        pod: "cpu".into(),
        cleared: true,
        stored,
        removed: Vec::new(),
    };
    // Blocks 0..8 offloaded: 4 are on GPU too (count as GPU), 4 more at 0.8.
    assert!(pool.update(offload(c[..8].to_vec())).await.is_ok());
    assert!(pool.sync().await.is_ok());
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert_eq!(d.pod, "cpu", "{:?}", d.candidates);
    let cpu = &d.candidates[0];
    assert_eq!((cpu.matched_blocks, cpu.offloaded_blocks), (4, 4));
    assert!((cpu.cache - (4.0 + 0.8 * 4.0) / 10.0).abs() < 1e-9, "{}", cpu.cache);
    assert!((d.candidates[1].cache - 0.4).abs() < 1e-9);
    drop(d);
    // A CPU tier that skips the first block credits nothing beyond the GPU frontier.
    assert!(pool.update(offload(c[5..8].to_vec())).await.is_ok());
    assert!(pool.sync().await.is_ok());
    let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
    assert!(d.candidates.iter().all(|k| k.offloaded_blocks == 0 && (k.cache - 0.4).abs() < 1e-9));
}

/// docs/design.md §4 `tokens-saved` preset: a one-block prompt's match on an overloaded,
/// degraded pod no longer beats an idle healthy pod (the default ratio keeps the seed's choice).
#[tokio::test]
async fn tokens_saved_preset_stops_a_short_prompt_outweighing_load() {
    let c = chain(900, 1);
    for (preset, want) in [("chatbot", "busy"), ("tokens-saved", "idle")] {
        let Some(cfg) = ScoringConfig::preset(preset) else { panic!("{preset}") };
        let (pool, r) = router(ScoringConfig { pending_ttl_ms: 0, ..cfg });
        put(&pool, "busy", "m", stats(0.95, 15, 0.5), &c).await;
        put(&pool, "idle", "m", stats(0.0, 0, 1.0), &[]).await;
        let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
        assert_eq!(d.pod, want, "{preset}: {:?}", d.candidates);
    }
}

#[tokio::test]
async fn pool_members_route_by_load_before_reports_and_unready_ones_never() {
    use crate::pool::tests::{put, stats, view};
    let (pool, r) = router(ScoringConfig::default());
    assert!(pool.set_membership(view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", false)])).await.is_ok());
    // No agent has reported: a routes by load, for any model; b is not Ready.
    let Ok(d) = r.route(&req(&[])) else { panic!("a Ready member must be routable before its agent reports") };
    assert_eq!((d.pod.as_str(), d.endpoint.as_str()), ("a-rank-0", "10.0.0.1:8000"));
    let ex = r.explain(&req(&[]));
    assert!(ex.excluded.iter().any(|(p, why)| p == "b-rank-0" && why.contains("not Ready")), "{:?}", ex.excluded);
    // In-flight requests make up the unreported pod's queue: a second Ready member takes the next.
    assert!(pool.set_membership(view(&[("a", "10.0.0.1", true), ("c", "10.0.0.3", true)])).await.is_ok());
    let Ok(d2) = r.route(&req(&[])) else { panic!() };
    assert_eq!(d2.pod.as_str(), "c-rank-0", "a holds one in-flight request, c none");
    // A reporting pod joins its model's group; the unreported one stays a candidate.
    put(&pool, "c-rank-0", "m", stats(0.1, 0, 1.0), &[]).await;
    let ex = r.explain(&req(&[]));
    assert_eq!(ex.candidates.len(), 2, "{ex:?}");
    // Once the pool drops every pod, nothing is routable.
    assert!(pool.set_membership(view(&[])).await.is_ok());
    assert!(r.route(&req(&[])).is_err());
    drop((d, d2));
}

/// The pool gauges' judgement is the router's: Ready endpoints with no agent are ready and
/// routable (they route by load), also once an agent left past its grace period; an agent's
/// "not ready" or low health takes an endpoint out as the filter does.
#[tokio::test]
async fn pod_routing_counts_what_the_router_can_route_to_with_or_without_agents() {
    use crate::pool::tests::view;
    use crate::pool::{PoolConfig, PoolUpdate};
    let pool = Pool::new(PoolConfig { grace_ttl_ms: 150, ..PoolConfig::default() });
    let config = ScoringConfig::default();
    let r = Router::new(pool.clone(), config.clone()).unwrap();
    let states = |pool: &Pool| {
        super::pod_routing(pool, &config)
            .into_iter()
            .map(|p| (p.name.to_string(), (p.ready, p.routable, p.reported)))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let view3 = view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", true), ("c", "10.0.0.3", false)]);
    assert!(pool.set_membership(view3).await.is_ok());
    let s = states(&pool);
    assert_eq!(s["a-rank-0"], (true, true, false));
    assert_eq!(s["b-rank-0"], (true, true, false));
    assert_eq!(s["c-rank-0"], (false, false, false), "not Ready in the pool");
    assert_eq!(r.explain(&req(&[])).candidates.len(), 2, "the router agrees");
    // An agent reports a unhealthy and b's engine not ready.
    put(&pool, "a-rank-0", "m", stats(0.0, 0, 0.1), &[]).await;
    let mut not_ready = stats(0.0, 0, 1.0);
    not_ready.ready = false;
    let u = PoolUpdate::Snapshot {
        stream: 2,
        info: crate::pool::tests::info("b-rank-0", "m"),
        seq: 0,
        stats: Some(not_ready),
        blocks: vec![],
    };
    assert!(pool.update(u).await.is_ok() && pool.sync().await.is_ok());
    let s = states(&pool);
    assert_eq!(s["a-rank-0"], (true, false, true), "ready but below the health threshold");
    assert_eq!(s["b-rank-0"], (false, false, true), "its engine is not ready");
    assert!(r.explain(&req(&[])).candidates.is_empty());
    // Every agent leaves; past the grace period the endpoints route by load again.
    for stream in [1, 2] {
        assert!(pool.update(PoolUpdate::StreamEnded { stream }).await.is_ok());
    }
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    assert!(pool.sync().await.is_ok());
    let s = states(&pool);
    assert_eq!((s["a-rank-0"], s["b-rank-0"]), ((true, true, false), (true, true, false)), "{s:?}");
    assert_eq!(r.explain(&req(&[])).candidates.len(), 2, "the router agrees");
}

/// A pod whose agent cannot tell its GPU assignment (health 0.7, "GPU assignment unknown") is
/// not ranked below a pod no agent reports on: both GPU states are unknown.
#[tokio::test]
async fn a_pod_of_unknown_gpus_is_not_ranked_below_a_pod_without_an_agent() {
    use crate::pool::tests::view;
    let (pool, r) = router(ScoringConfig::default());
    assert!(pool.set_membership(view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", true)])).await.is_ok());
    let mut unknown = stats(0.0, 0, kvroute_common::UNKNOWN_GPU_HEALTH);
    unknown.health_reason = "GPU assignment unknown".into();
    put(&pool, "a-rank-0", "m", unknown, &[]).await;
    let e = r.explain(&req(&[]));
    let score = |pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| (c.health, c.score));
    let (Some((ha, sa)), Some((hb, sb))) = (score("a-rank-0"), score("b-rank-0")) else { panic!("{e:?}") };
    assert_eq!((ha, hb), (kvroute_common::UNKNOWN_GPU_HEALTH, crate::pool::NO_REPORT_HEALTH));
    assert!(sa >= sb, "unknown GPUs {sa} ranked below no agent {sb}");
    // A healthy reporting pod still ranks above both unknowns.
    put(&pool, "a-rank-0", "m", stats(0.0, 0, 1.0), &[]).await;
    let e = r.explain(&req(&[]));
    assert_eq!(e.choice.as_deref(), Some("a-rank-0"), "{e:?}");
}

#[tokio::test]
async fn an_unreachable_pod_is_not_a_candidate_and_a_stale_one_loses_its_perfect_health() {
    let pool = Pool::new(PoolConfig { max_report_age_ms: 100, ..PoolConfig::default() });
    let r = Router::new(pool.clone(), ScoringConfig::default()).unwrap();
    put(&pool, "a", "m", stats(0.0, 0, 1.0), &[]).await;
    put(&pool, "b", "m", stats(0.0, 0, 1.0), &[]).await;
    assert!(pool.mark_unreachable("a"));
    for _ in 0..20 {
        assert_eq!(r.route(&req(&[])).unwrap().pod, "b", "an unreachable pod is never chosen");
    }
    let e = r.explain(&req(&[]));
    assert!(e.excluded.iter().any(|(p, why)| p == "a" && why.contains("could not connect")), "{:?}", e.excluded);
    // Both unreachable: no candidate (503), not the dead endpoint.
    assert!(pool.mark_unreachable("b"));
    assert!(matches!(r.route(&req(&[])), Err(RouteError::NoCandidate { .. })));

    let pool = Pool::new(PoolConfig { max_report_age_ms: 100, ..PoolConfig::default() });
    let r = Router::new(pool.clone(), ScoringConfig::default()).unwrap();
    put(&pool, "silent", "m", stats(0.0, 0, 1.0), &[]).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    put(&pool, "talking", "m", stats(0.0, 0, 0.9), &[]).await;
    let e = r.explain(&req(&[]));
    let silent = e.candidates.iter().find(|c| &*c.pod == "silent").unwrap();
    assert_eq!(silent.health, crate::pool::STALE_REPORT_HEALTH);
    assert_eq!(e.choice.as_deref(), Some("talking"), "the pod whose agent reports wins on health");
}

/// A report of `running` requests on a pod of 16 seats (utilization = running / 16, the mock-NVML
/// rule), nothing waiting.
fn seats(running: u32) -> kvroute_proto::agent::v1::PodStats {
    let mut s = stats(f64::from(running) / 16.0, 0, 1.0);
    s.num_requests_running = running;
    s
}

/// docs/design.md §4 loadRatio: a request routed since a pod's report counts in its utilization
/// as each request the report listed as running does, so a pod that was just given a cold prompt
/// no longer looks idler than one whose requests are decoding (without it the second prompt
/// below queues behind the first).
#[tokio::test]
async fn requests_routed_since_the_report_count_in_load_ratio() {
    for forecast in [true, false] {
        // Cold prompts by S alone (no placement of new prefixes by share): S is what is read.
        let (pool, r) =
            router(ScoringConfig { load_forecast: forecast, cold_placement_margin: 0.0, ..ScoringConfig::default() });
        put(&pool, "a", "m", seats(4), &[]).await;
        put(&pool, "b", "m", seats(5), &[]).await;
        let Ok(first) = r.route(&req(&chain(100, 8))) else { panic!("no decision") };
        assert_eq!(first.pod, "a", "4 running of 16 against 5: S 0.250 vs 0.2375");
        let load = |e: &super::Explanation, pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| c.load);
        let e = r.explain(&req(&chain(200, 8)));
        if forecast {
            // a: 0.2·(1 − 5/16) + 0.1·(1 − 1/20) = 0.2325 < b: 0.2·(1 − 5/16) + 0.1 = 0.2375.
            assert_eq!(load(&e, "a"), Some(1.0 - 5.0 / 16.0), "{e:?}");
            assert_eq!(e.choice.as_deref(), Some("b"), "{e:?}");
        } else {
            assert_eq!(load(&e, "a"), Some(1.0 - 4.0 / 16.0), "{e:?}");
            assert_eq!(e.choice.as_deref(), Some("a"), "{e:?}");
        }
        // The next report lists the request as running: it counts once, not twice.
        put(
            &pool,
            "a",
            "m",
            {
                let mut s = seats(5);
                s.observed_at_unix_ms += 1000;
                s
            },
            &[],
        )
        .await;
        let e = r.explain(&req(&chain(200, 8)));
        assert_eq!(load(&e, "a"), Some(1.0 - 5.0 / 16.0), "{e:?}");
        drop(first);
    }
}

/// The per-request figure is the last report's that had requests running: an idle report keeps
/// it (a pod that reported 0 running is given requests too), and a pod that never reported a
/// running request reads busy with one (NVML's meaning: any request stepping keeps the GPU
/// busy), since its utilization per request is unknown.
#[tokio::test]
async fn the_load_forecast_uses_the_last_busy_report_and_caps_at_one() {
    let (pool, r) = router(ScoringConfig::default());
    put(&pool, "a", "m", seats(2), &[]).await;
    put(&pool, "a", "m", seats(0), &[]).await;
    put(&pool, "b", "m", stats(0.5, 0, 1.0), &[]).await; // utilization without running requests
    let mut held = Vec::new();
    for _ in 0..3 {
        let Ok(d) = r.route(&req(&[])) else { panic!("no decision") };
        held.push(d);
    }
    let e = r.explain(&req(&[]));
    let load = |pod: &str| e.candidates.iter().find(|c| &*c.pod == pod).map(|c| c.load);
    let on = |pod: &str| held.iter().filter(|d| d.pod == pod).count() as f64;
    assert_eq!(load("a"), Some(1.0 - on("a") / 16.0), "{e:?}");
    assert_eq!(on("b"), 0.0, "a idler than b all along: {e:?}");
    assert_eq!(load("b"), Some(0.5), "nothing routed there since: the reported utilization");
    let subset = ["b:8000".to_string()];
    let Ok(d) = r.route(&RouteRequest { subset: Some(&subset), ..req(&[]) }) else { panic!("no decision") };
    assert_eq!(d.pod, "b");
    held.push(d);
    let e = r.explain(&req(&[]));
    let b = e.candidates.iter().find(|c| &*c.pod == "b").map(|c| c.load);
    assert_eq!(b, Some(0.0), "no per-request figure: one request reads a busy GPU: {e:?}");
    drop(held);
    // Capped at a full GPU: one more request on a pod that reported 1 running at 90 %.
    let (pool, r) = router(ScoringConfig::default());
    let mut s = stats(0.9, 0, 1.0);
    s.num_requests_running = 1;
    put(&pool, "c", "m", s, &[]).await;
    let Ok(d) = r.route(&req(&[])) else { panic!("no decision") };
    let e = r.explain(&req(&[]));
    assert_eq!(e.candidates.first().map(|c| c.load), Some(0.0), "{e:?}");
    drop(d);
}

/// docs/design.md §2 index granularity: pods whose engines run 16-, 32- and 64-token blocks share
/// one 16-token index. Claims and predicted tokens count index blocks; the staleness tolerance is
/// the pod's own engine block; pending credit stops at the last engine block it completes; the
/// CPU tier's credit starts from there.
#[tokio::test]
async fn engines_of_16_32_and_64_token_blocks_share_one_index() {
    use crate::pool::tests::info;
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(900, 10);
    let engines = [("e16", 16u32), ("e32", 32), ("e64", 64)];
    for (name, engine_block) in engines {
        let info = kvroute_proto::agent::v1::PodInfo { block_size: engine_block, ..info(name, "m") };
        // Each holds the prompt's first 64 tokens: 4 index blocks (4, 2 and 1 engine blocks).
        let u =
            PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats: Some(stats(0.0, 0, 1.0)), blocks: c[..4].to_vec() };
        assert!(pool.update(u).await.is_ok());
    }
    assert!(pool.sync().await.is_ok());
    let e = r.explain(&req(&c));
    assert!(e.candidates.iter().all(|k| k.matched_blocks == 4), "{:?}", e.candidates);
    // A prompt that shares only the first 48 tokens: 3 index blocks, 1 engine block of 32,
    // none of 64 (a match that ends inside an engine block claims nothing of it).
    let mut other = c[..3].to_vec();
    other.extend(chain(5000, 7));
    let e = r.explain(&req(&other));
    let matched = |e: &super::Explanation, pod: &str| {
        e.candidates.iter().find(|k| k.pod.as_ref() == pod).map(|k| k.matched_blocks)
    };
    assert_eq!([matched(&e, "e16"), matched(&e, "e32"), matched(&e, "e64")], [Some(3), Some(2), Some(0)]);
    // CPU-tier credit starts after the GPU's and also stops at whole engine blocks: 7 offloaded
    // index blocks are 6 on e32 (2 beyond its 4 on GPU) and 4 on e64 of a 10-block offload (8).
    for (pod, blocks) in [("e32", 7), ("e64", 10)] {
        let u = PoolUpdate::Offloaded {
            stream: 1,
            pod: pod.into(),
            cleared: true,
            stored: c[..blocks].to_vec(),
            removed: Vec::new(),
        };
        assert!(pool.update(u).await.is_ok());
    }
    assert!(pool.sync().await.is_ok());
    let e = r.explain(&req(&c));
    let offloaded = |pod: &str| e.candidates.iter().find(|k| k.pod.as_ref() == pod).map(|k| k.offloaded_blocks);
    assert_eq!([offloaded("e16"), offloaded("e32"), offloaded("e64")], [Some(0), Some(2), Some(4)]);
    let (mut held, mut seen) = (Vec::new(), Vec::new());
    for (name, engine_block) in engines {
        let subset = vec![format!("{name}:8000")];
        let Ok(d) = r.route(&RouteRequest { subset: Some(&subset), ..req(&c) }) else { panic!("no decision") };
        assert_eq!(d.pod, name);
        // Predicted: 4 index blocks = 64 tokens, whatever the engine's block size. The engine
        // may report one engine block less (the last prompt token is never cached).
        let ok = 64 - engine_block;
        assert!(!d.slot.observe_cached_tokens(ok), "{name}: {ok} cached is within one engine block of 64");
        assert_eq!(d.slot.observe_cached_tokens(ok.saturating_sub(1)), ok > 0, "{name}: below one engine block");
        seen.push((name, engine_block));
        held.push(d);
    }
    // Each routed request is pending on its pod: the whole 10-block chain on e16 and e32 (5 engine
    // blocks of 32), but only 8 on e64 (2 engine blocks; the rest it will never cache).
    let e = r.explain(&req(&c));
    let credited =
        |pod: &str| e.candidates.iter().find(|k| k.pod.as_ref() == pod).map(|k| (k.matched_blocks, k.pending_blocks));
    assert_eq!(credited("e16"), Some((10, 6)), "{:?}", e.candidates);
    assert_eq!(credited("e32"), Some((10, 6)));
    assert_eq!(credited("e64"), Some((8, 4)));
    drop(held);
}

/// docs/design.md §4 pile guard, an operator's choice (`pile_guard_margin`, `pile_guard_factor`):
/// a cache-hot pod carrying 40 requests against a cold one carrying 1 keeps the request below the
/// margin or the factor, gives it up above both, and keeps it when the guard is off (margin 0).
#[tokio::test]
async fn the_pile_guard_moves_a_request_off_a_piled_hot_pod_as_configured() {
    let c = chain(1300, 10);
    let running = |n| kvroute_proto::agent::v1::PodStats { num_requests_running: n, ..stats(0.0, 0, 1.0) };
    for (margin, factor, want) in [(24, 2.0, "cold"), (48, 2.0, "hot"), (24, 100.0, "hot"), (0, 2.0, "hot")] {
        let (pool, r) =
            router(ScoringConfig { pile_guard_margin: margin, pile_guard_factor: factor, ..ScoringConfig::default() });
        put(&pool, "hot", "m", running(40), &c).await;
        put(&pool, "cold", "m", running(1), &[]).await;
        let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
        assert_eq!(d.pod, want, "margin {margin}, factor {factor}: {:?}", d.candidates);
    }
}

/// A decision lists its choice, then the best seven other candidates in selection order, as
/// `/explain`'s full ranking has them: whether the choice is the best by S, a new prefix's
/// placement, or the pile guard's least loaded pod (then not among the best by S at all).
#[tokio::test]
async fn the_candidate_list_is_the_full_ranking_cut_short() {
    let (pool, r) = router(ScoringConfig::default());
    let c = chain(0, 16);
    for k in 0..20u32 {
        // Staggered depths of the chain, loads and queues: S differs on every pod.
        let held = (k as usize * 3) % 17;
        let mut s = stats(f64::from(k % 10) / 10.0, k % 7, 1.0);
        // The deepest holder carries a pile: the guard sends a full hit to the least loaded pod.
        s.num_requests_running = if held == 16 { 60 } else { k % 5 };
        put(&pool, &format!("p{k}"), "m", s, &c[..held]).await;
    }
    let cold = chain(1_000, 16);
    let shallow = chain(0, 4);
    for (what, blocks) in [("full hit", &c[..]), ("new prefix", &cold[..]), ("shallow", &shallow[..])] {
        let e = r.explain(&req(blocks));
        if what == "full hit" {
            // The pile guard moved it off the best pod by S.
            let best_by_s = e.candidates.iter().skip(1).map(|c| c.score).fold(f64::MIN, f64::max);
            assert!(e.candidates[0].score < best_by_s, "the guard's choice ranks below another by S: {e:?}");
        }
        let Ok(d) = r.route(&req(blocks)) else { panic!("{what}: no decision") };
        let listed: Vec<&str> = d.candidates.iter().map(|c| &*c.pod).collect();
        let ranked: Vec<&str> = e.candidates.iter().take(8).map(|c| &*c.pod).collect();
        assert_eq!(listed, ranked, "{what}");
        assert_eq!(Some(d.pod.as_str()), e.choice.as_deref(), "{what}");
        assert_eq!(listed.len(), 8, "{what}");
    }
}
