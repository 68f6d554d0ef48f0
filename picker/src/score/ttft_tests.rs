//! The in-flight load, the per-pod TTFT models, the `ttft` stay-or-spill rule and the
//! `x-slo-ttft-ms` filter, through the real router (docs/design.md §4 "Load and predicted TTFT").

use std::sync::atomic::Ordering;

use super::tests::{req, router};
use super::{LoadSource, RouteRequest, Router, ScoringConfig};
use crate::pool::tests::{chain, put, stats};
use crate::pool::{Pool, TtftObservation};

/// Routes `n` cold requests of 4.. blocks to `pod` only, each first token after
/// `intercept + 0.5 ms` per token of work: the pod's model learns that line.
fn teach(r: &Router, pod: &str, intercept_ms: f64, base: u64) {
    let subset = [format!("{pod}:8000")];
    for i in 0..6u64 {
        let c = chain(base + i * 1000, 4 + i);
        let rr = RouteRequest { subset: Some(&subset), ..req(&c) };
        let Ok(mut d) = r.route(&rr) else { panic!("no decision for {pod}") };
        assert_eq!(d.pod, pod);
        // Nothing else in flight: the work is the request's own uncached tokens.
        let work = (4 + i) as f64 * 16.0;
        let seen = d.slot.observe_ttft(intercept_ms + 0.5 * work);
        assert!(matches!(seen, TtftObservation::Learned { .. }), "{seen:?}");
        assert_eq!(d.slot.observe_ttft(1.0), TtftObservation::Ignored, "one first token per request");
        r.shared().credit.count_ttft(seen);
    }
}

async fn hot_and_cold(config: ScoringConfig) -> (std::sync::Arc<Pool>, Router, Vec<kvroute_common::BlockHash>) {
    let (pool, r) = router(config);
    let c = chain(1 << 40, 32);
    // NVML reads 1 for both: they are stepping.
    put(&pool, "hot", "m", stats(1.0, 0, 1.0), &c).await;
    put(&pool, "cold", "m", stats(1.0, 0, 1.0), &[]).await;
    (pool, r, c)
}

#[tokio::test]
async fn learned_models_predict_every_candidate_and_load_reads_in_flight_work() {
    let (pool, r, c) = hot_and_cold(ScoringConfig::default()).await;
    let before = r.explain(&req(&c));
    assert!(before.candidates.iter().all(|k| k.predicted_ttft_ms.is_none()), "{before:?}");
    // Without a model, the seed's formula: NVML's 1.0 reads fully loaded.
    assert!(before.candidates.iter().all(|k| k.load == 0.0), "{before:?}");
    assert!(r.shared().credit.load_fallbacks.load(Ordering::Relaxed) > 0);
    teach(&r, "hot", 5.0, 1);
    teach(&r, "cold", 5.0, 1 << 20);
    assert_eq!(r.shared().credit.ttft_observed.load(Ordering::Relaxed), 12);
    let after = r.explain(&req(&c));
    let pred = |pod: &str| after.candidates.iter().find(|k| &*k.pod == pod).and_then(|k| k.predicted_ttft_ms);
    // hot: nothing uncached; cold: 32 blocks × 16 tokens at 0.5 ms.
    assert!((pred("hot").unwrap_or(f64::NAN) - 5.0).abs() < 1.0, "{after:?}");
    assert!((pred("cold").unwrap_or(f64::NAN) - 261.0).abs() < 2.0, "{after:?}");
    // Nothing in flight: both read idle although NVML says busy.
    assert!(after.candidates.iter().all(|k| k.load == 1.0), "{after:?}");
    assert_eq!(after.choice.as_deref(), Some("hot"));
    // KV usage is a floor of the in-flight load: a pod whose running requests hold 90 % of its
    // KV reads 90 % loaded with no prefill ahead.
    put(&pool, "full", "m", kvroute_proto::agent::v1::PodStats { kv_cache_usage: 0.9, ..stats(1.0, 0, 1.0) }, &[])
        .await;
    let ex = r.explain(&req(&c));
    let full = ex.candidates.iter().find(|k| &*k.pod == "full").map(|k| k.load);
    assert!(full.is_some_and(|l| (l - 0.1).abs() < 1e-9), "{ex:?}");

    // `load_source: gpu_utilization` keeps the seed's formula.
    let (_pool, g, c) =
        hot_and_cold(ScoringConfig { load_source: LoadSource::GpuUtilization, ..ScoringConfig::default() }).await;
    teach(&g, "hot", 5.0, 1);
    let ex = g.explain(&req(&c));
    assert!(ex.candidates.iter().all(|k| k.load == 0.0), "{ex:?}");
}

#[tokio::test]
async fn slo_filters_by_predicted_ttft_and_counts_misses() {
    let (_pool, r, c) = hot_and_cold(ScoringConfig::default()).await;
    // Before any model: no candidate is excluded by an estimate it does not have.
    let ex = r.explain_slo(&req(&c), None, Some(1.0));
    assert_eq!(ex.candidates.len(), 2, "{ex:?}");
    teach(&r, "hot", 5.0, 1);
    teach(&r, "cold", 5.0, 1 << 20);
    // Cold: 0 blocks held of a fresh chain on either pod → both predicted ≈ 5 + 256 ms.
    let fresh = chain(7 << 40, 32);
    let ex = r.explain_slo(&req(&fresh), None, Some(300.0));
    assert_eq!(ex.candidates.len(), 2, "both meet 300 ms: {ex:?}");
    // The hot request: the hot pod meets 100 ms, the cold one (≈ 261 ms) leaves.
    let ex = r.explain_slo(&req(&c), None, Some(100.0));
    assert_eq!(ex.candidates.len(), 1, "{ex:?}");
    assert!(ex.excluded.iter().any(|(pod, why)| pod == "cold" && why.contains("predicted TTFT")), "{ex:?}");
    // Nobody meets 1 ms: the least predicted is chosen, the miss counted.
    let misses = r.shared().credit.slo_misses.load(Ordering::Relaxed);
    let Ok(d) = r.route_slo(&req(&c), None, Some(1.0)) else { panic!("no decision") };
    assert_eq!(d.pod, "hot");
    assert_eq!(r.shared().credit.slo_misses.load(Ordering::Relaxed), misses + 1);
    // Absurd objectives are ignored.
    for slo in [f64::NAN, -5.0, 0.0] {
        assert_eq!(r.explain_slo(&req(&c), None, Some(slo)).candidates.len(), 2);
    }
}

#[tokio::test]
async fn ttft_preset_spills_only_when_the_hot_pod_is_predicted_much_slower() {
    let Some(ttft) = ScoringConfig::preset("ttft") else { panic!("no ttft preset") };
    for (config, slow_hot_goes) in [(ttft, "cold"), (ScoringConfig::default(), "hot")] {
        let (pool, r, c) = hot_and_cold(config.clone()).await;
        teach(&r, "cold", 5.0, 1 << 20);
        // A hot pod predicted at ≈ 300 ms against the cold one's ≈ 261 ms: within the factor.
        teach(&r, "hot", 300.0, 1);
        assert_eq!(r.explain(&req(&c)).choice.as_deref(), Some("hot"), "{config:?}");
        // Slower by far (≈ 3000 ms + more, the model's window being recent first tokens).
        for k in 0..40 {
            teach(&r, "hot", 3000.0, 100 + k * 10);
        }
        assert_eq!(r.explain(&req(&c)).choice.as_deref(), Some(slow_hot_goes), "{config:?}");
        // An alternative with most of its KV held takes no second copy of the prompt.
        let full = kvroute_proto::agent::v1::PodStats { kv_cache_usage: 0.6, ..stats(1.0, 0, 1.0) };
        put(&pool, "cold", "m", full, &[]).await;
        assert_eq!(r.explain(&req(&c)).choice.as_deref(), Some("hot"), "{config:?}");
    }
}

#[test]
fn absurd_first_tokens_are_refused_and_counted() {
    let credit = crate::pending::CreditCounters::default();
    credit.count_ttft(TtftObservation::Refused);
    credit.count_ttft(TtftObservation::Learned { error_ms: Some(-40.0), work_tokens: 10.0, queue: 0.0, ttft_ms: 50.0 });
    credit.count_ttft(TtftObservation::Learned { error_ms: Some(10.0), work_tokens: 10.0, queue: 0.0, ttft_ms: 50.0 });
    assert_eq!(credit.ttft_refused.load(Ordering::Relaxed), 1);
    assert_eq!(credit.ttft_observed.load(Ordering::Relaxed), 2);
    assert_eq!(credit.ttft_abs_error_ms.load(Ordering::Relaxed), 50);
    assert_eq!(credit.ttft_over_ms.load(Ordering::Relaxed), 10);
    assert_eq!(
        ScoringConfig { ttft_spill_factor: 0.5, ..ScoringConfig::default() }.validate().map_err(|e| e.to_string()),
        Err("scoring.ttft_spill_factor must be a number of at least 1, got 0.5".to_string())
    );
}

/// The config names the lead's end-to-end runs select: `preset: ttft`, `load_source`.
#[test]
fn config_names_select_the_load_source_and_the_spill_rule() {
    let parsed: Result<ScoringConfig, _> =
        serde_json::from_str(r#"{"load_source": "gpu_utilization", "spill_rule": "ttft", "load_horizon_ms": 500}"#);
    let Ok(c) = parsed else { panic!("{parsed:?}") };
    assert_eq!(
        (c.load_source, c.spill_rule, c.load_horizon_ms),
        (LoadSource::GpuUtilization, super::SpillRule::Ttft, 500)
    );
    assert!(serde_json::from_str::<ScoringConfig>(r#"{"load_source": "nvml"}"#).is_err());
    let Some(t) = ScoringConfig::preset("ttft") else { panic!("no ttft preset") };
    assert_eq!(
        (t.spill_rule, t.load_source, t.weights),
        (super::SpillRule::Ttft, LoadSource::Inflight, super::DEFAULT_WEIGHTS)
    );
    assert!(t.validate().is_ok());
    assert_eq!(ScoringConfig::default().load_source, LoadSource::Inflight);
}

/// docs/design.md §4 "The herd" by time: a hot pod at `max_queue` whose queue holds requests it
/// has the prompts of is still predicted far faster than a cold prefill elsewhere, so the `ttft`
/// preset keeps it (and the pile guard does not move it); the default spills at `max_queue`;
/// a hot pod whose KV is mostly held gives way to the seed's rule in both.
#[tokio::test]
async fn ttft_preset_keeps_a_full_hot_pod_predicted_fastest() {
    let Some(ttft) = ScoringConfig::preset("ttft") else { panic!("no ttft preset") };
    for (config, kv, next_goes) in
        [(ttft.clone(), 0.0, "hot"), (ScoringConfig::default(), 0.0, "cold"), (ttft, 0.95, "cold")]
    {
        let (pool, r, c) = hot_and_cold(config.clone()).await;
        teach(&r, "hot", 5.0, 1);
        teach(&r, "cold", 5.0, 1 << 20);
        let hot = kvroute_proto::agent::v1::PodStats { kv_cache_usage: kv, ..stats(1.0, 0, 1.0) };
        put(&pool, "hot", "m", hot, &c).await;
        let mut held = Vec::new();
        for _ in 0..config.max_queue + 8 {
            let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
            if d.pod != "hot" {
                break;
            }
            held.push(d);
        }
        let ex = r.explain(&req(&c));
        let why = format!("{config:?} kv {kv}: {} on hot, {ex:?}", held.len());
        assert_eq!(ex.choice.as_deref(), Some(next_goes), "{why}");
        // Past max_queue only by time.
        assert_eq!(held.len() > config.max_queue as usize, next_goes == "hot", "{why}");
    }
}

/// docs/design.md §4 pile guard: in every preset a pile keeps a full hit the guard would move
/// when the pod has KV room and is predicted far faster, unless the request's prefix is hot (a
/// candidate's share of the traffic or more: the guard's move gives it a second pod).
#[tokio::test]
async fn the_pile_guard_keeps_an_unshared_prefix_on_its_pod_when_far_faster() {
    let c = chain(1 << 41, 256);
    let Some(ttft) = ScoringConfig::preset("ttft") else { panic!("no ttft preset") };
    let presets = [("default", ScoringConfig::default()), ("ttft", ttft)];
    let cases = [(0.6, 2, "hot"), (0.85, 2, "cold"), (0.6, 20, "cold")];
    for ((preset, config), (kv, before, want)) in presets.iter().flat_map(|p| cases.iter().map(move |c| (p, *c))) {
        // A pile on the pod that holds the prompt: 45 running against 1, each with little
        // decode work left next to a 4,096-token prefill elsewhere; this prefix is 2 of 14
        // requests (under the fair half of two candidates) or 20 of 32 (over it).
        let r = full_pod_beside_another(config.clone(), &c, (kv, 0, 45), 0.1, before).await;
        let ex = r.explain(&req(&c));
        let pred = |pod: &str| ex.candidates.iter().find(|k| &*k.pod == pod).and_then(|k| k.predicted_ttft_ms);
        let why = format!("{preset}: kv {kv}, {before} of this prefix before: {ex:?}");
        assert!(pred("hot").zip(pred("cold")).is_some_and(|(h, k)| 3.0 * h <= k), "{why}");
        let before = r.shared().credit.pile_redirects.load(Ordering::Relaxed);
        let Ok(d) = r.route(&req(&c)) else { panic!("no decision") };
        assert_eq!(d.pod, want, "{why}");
        let moved = r.shared().credit.pile_redirects.load(Ordering::Relaxed) - before;
        assert_eq!(moved, u64::from(want == "cold"), "{why}");
    }
}

/// When the candidates' KV is nearly full on average, a request whose prefix is not hot stays
/// on the pod holding it: at `max_queue` (up to four times it) and past the pile guard, in the
/// default preset and in `ttft`. Moving it would compute the whole prompt again where there is
/// no room for a copy. With room somewhere, past the bound, or with a hot prefix, each preset's
/// spill and pile guard move it as before.
#[tokio::test]
async fn a_full_fleet_keeps_an_unshared_prefix_on_its_pod() {
    let c = chain(3 << 40, 256);
    // (hot pod's KV, waiting, running; cold pod's KV; requests of this prefix routed before,
    // 1 of 13 under the fair half of two candidates or 20 of 32 over it; expected pod; whether
    // the full fleet alone kept it: default, ttft)
    let cases = [
        (0.99, 25, 0, 0.7, 1, "hot", (true, true)),
        (0.99, 79, 0, 0.7, 1, "hot", (true, true)),
        // `ttft`: a pod at max_queue without 90 % of its KV held and predicted fastest stays by
        // time, so the full fleet is not what kept it.
        (0.85, 25, 0, 0.8, 1, "hot", (true, false)),
        (0.99, 25, 0, 0.5, 1, "cold", (false, false)),
        (0.99, 80, 0, 0.7, 1, "cold", (false, false)),
        (0.99, 25, 0, 0.7, 20, "cold", (false, false)),
        (0.9, 0, 45, 0.75, 1, "hot", (true, true)),
        (0.9, 0, 45, 0.6, 1, "cold", (false, false)),
    ];
    let Some(ttft) = ScoringConfig::preset("ttft") else { panic!("no ttft preset") };
    let presets = [("default", ScoringConfig::default()), ("ttft", ttft)];
    for ((preset, config), (hot_kv, waiting, running, cold_kv, before, want, kept)) in
        presets.iter().flat_map(|p| cases.iter().map(move |c| (p, *c)))
    {
        let kept = if *preset == "ttft" { kept.1 } else { kept.0 };
        let r = full_pod_beside_another(config.clone(), &c, (hot_kv, waiting, running), cold_kv, before).await;
        let why = format!(
            "{preset}: hot KV {hot_kv}, waiting {waiting}, running {running}; cold KV {cold_kv}; {before} before"
        );
        let stays = r.shared().credit.full_fleet_stays.load(Ordering::Relaxed);
        let redirects = r.shared().credit.pile_redirects.load(Ordering::Relaxed);
        let Ok(d) = r.route(&req(&c)) else { panic!("no decision: {why}") };
        assert_eq!(d.pod, want, "{why}");
        assert_eq!(r.shared().credit.full_fleet_stays.load(Ordering::Relaxed) - stays, u64::from(kept), "{why}");
        // The pile cases: the guard moves the request unless the full fleet keeps it.
        let moved_by_guard = running > 0 && want == "cold";
        assert_eq!(
            r.shared().credit.pile_redirects.load(Ordering::Relaxed) - redirects,
            u64::from(moved_by_guard),
            "{why}"
        );
    }
}

/// A router over two pods that have learned their TTFT: "hot" holds chain `c` and reports
/// `hot` (KV usage, waiting, running), "cold" holds nothing and reports `cold_kv` with one
/// running. Twelve other prefixes were routed first, one request each, then `before` of `c`
/// (to "hot").
async fn full_pod_beside_another(
    config: ScoringConfig,
    c: &[kvroute_common::BlockHash],
    (hot_kv, waiting, running): (f64, u32, u32),
    cold_kv: f64,
    before: u32,
) -> Router {
    let (pool, r) = router(config);
    put(&pool, "hot", "m", stats(1.0, 0, 1.0), c).await;
    put(&pool, "cold", "m", stats(1.0, 0, 1.0), &[]).await;
    teach(&r, "hot", 5.0, 1 << 30);
    teach(&r, "cold", 5.0, 1 << 31);
    for _ in 0..before {
        let Ok(d) = r.route(&req(c)) else { panic!("no decision") };
        assert_eq!(d.pod, "hot");
    }
    let report = |kv, waiting, running| kvroute_proto::agent::v1::PodStats {
        kv_cache_usage: kv,
        num_requests_running: running,
        ..stats(1.0, waiting, 1.0)
    };
    put(&pool, "hot", "m", report(hot_kv, waiting, running), c).await;
    put(&pool, "cold", "m", report(cold_kv, 0, 1), &[]).await;
    r
}

/// `full_fleet_kv` sets the rule's threshold (0 turns it off), and with `shed_when_saturated` a
/// pod at `max_queue` leaves the candidates as the seed's spill says, full fleet or not.
#[tokio::test]
async fn the_full_fleet_rule_follows_its_threshold_and_yields_to_shedding() {
    let c = chain(5 << 40, 256);
    let with = |f: fn(&mut ScoringConfig)| {
        let mut config = ScoringConfig::default();
        f(&mut config);
        config
    };
    let cases = [
        ("default", with(|_| {}), "hot"),
        ("full_fleet_kv 0.9", with(|c| c.full_fleet_kv = 0.9), "cold"),
        ("full_fleet_kv 0", with(|c| c.full_fleet_kv = 0.0), "cold"),
        ("shed_when_saturated", with(|c| c.shed_when_saturated = true), "cold"),
    ];
    for (name, config, want) in cases {
        // The candidates' mean KV is 0.845; the hot pod has 25 waiting (max_queue 20).
        let r = full_pod_beside_another(config, &c, (0.99, 25, 0), 0.7, 1).await;
        let stays = r.shared().credit.full_fleet_stays.load(Ordering::Relaxed);
        let Ok(d) = r.route(&req(&c)) else { panic!("no decision: {name}") };
        assert_eq!(d.pod, want, "{name}");
        let kept = r.shared().credit.full_fleet_stays.load(Ordering::Relaxed) - stays;
        assert_eq!(kept, u64::from(want == "hot"), "{name}");
    }
}

/// A first token is learned only against work the picker could see: on a pod whose KV events
/// never came for a request that ended (its queue is invisible), a request routed while another
/// is in flight teaches nothing, one routed to the empty pod does; on a pod not known silent
/// both teach.
#[tokio::test]
async fn first_tokens_behind_an_unseen_queue_are_not_learned() {
    let (_pool, r, _c) = hot_and_cold(ScoringConfig::default()).await;
    for (pod, silent) in [("cold", true), ("hot", false)] {
        let subset = [format!("{pod}:8000")];
        let on = |blocks| RouteRequest { subset: Some(&subset), ..req(blocks) };
        let (z, a, b) = (chain(4 << 40, 8), chain(5 << 40, 8), chain(6 << 40, 8));
        if silent {
            // Ends before any event shows its prompt.
            let Ok(ended) = r.route(&on(&z)) else { panic!("no decision") };
            drop(ended);
        }
        let Ok(mut first) = r.route(&on(&a)) else { panic!("no decision") };
        let Ok(mut second) = r.route(&on(&b)) else { panic!("no decision") };
        assert_eq!(second.pod, pod);
        assert!(matches!(first.slot.observe_ttft(100.0), TtftObservation::Learned { .. }), "{pod}");
        let seen = second.slot.observe_ttft(900.0);
        assert_eq!(seen == TtftObservation::Ignored, silent, "{pod}: {seen:?}");
    }
}
