//! The seed's routing claims, reproduced on the simulator and pinned (docs/benchmarks.md):
//! - docs/design.md §16: random routing over 32 pods leaves ~97 % (31/32) of repeated-prefix requests cold;
//! - docs/design.md §4: conversations stick to their pod under kvroute;
//! - docs/design.md §15: a thundering herd on a 4-pod fleet with maxQueue 20 puts 20 requests on the
//!   cache-hot pod and spreads the rest across the other 3.

use kvroute_sim::policy::{self, Policy};
use kvroute_sim::sim::{self, Outcome, RunResult, SimConfig};
use kvroute_sim::workload::{self, Workload};

fn run(w: &Workload, name: &str, pods: usize) -> RunResult {
    let cfg = SimConfig { pods, ..SimConfig::default() };
    let p: Box<dyn Policy> =
        match policy::build(name, pods, &policy::PolicyOptions { seed: 3, ..policy::PolicyOptions::default() }) {
            Ok(p) => p,
            Err(e) => panic!("building {name}: {e}"),
        };
    match sim::run(w, &mut [p], &cfg, None) {
        Ok(r) => r,
        Err(e) => panic!("running {name}: {e}"),
    }
}

/// The second request of each pair (same session, later arrival).
fn repeats(r: &RunResult) -> Vec<&Outcome> {
    let mut seen = std::collections::HashSet::new();
    let mut order: Vec<&Outcome> = r.outcomes.iter().collect();
    order.sort_by_key(|o| o.arrival_us);
    order.into_iter().filter(|o| !seen.insert(o.session)).collect()
}

#[test]
fn random_over_32_pods_leaves_about_97_percent_of_repeats_cold() {
    let w = workload::repeated_pairs(1500, 512, 0.2, 5.0, 16);
    let cold = |r: &RunResult| {
        let rep = repeats(r);
        assert_eq!(rep.len(), 1500);
        rep.iter().filter(|o| o.hit_blocks == 0).count() as f64 / rep.len() as f64
    };
    let random = cold(&run(&w, "random", 32));
    // 31/32 = 96.9 %; binomial σ over 1500 ≈ 0.45 %.
    assert!((0.95..=0.985).contains(&random), "random left {:.1} % cold", random * 100.0);
    let kvroute = cold(&run(&w, "kvroute", 32));
    eprintln!("repeats cold: random {:.2} %, kvroute {:.2} %", random * 100.0, kvroute * 100.0);
    assert!(kvroute < 0.01, "kvroute left {:.1} % of repeats cold", kvroute * 100.0);
}

#[test]
fn conversations_stick_to_their_pod() {
    let w = workload::chat(120, 5, 1.0, 5, 16);
    let stickiness = |r: &RunResult| {
        let mut by_session: std::collections::HashMap<u64, Vec<&Outcome>> = Default::default();
        for o in &r.outcomes {
            if let Some(s) = o.session {
                by_session.entry(s).or_default().push(o);
            }
        }
        let (mut same, mut total) = (0usize, 0usize);
        for turns in by_session.values_mut() {
            turns.sort_by_key(|o| o.arrival_us);
            for pair in turns.windows(2) {
                total += 1;
                same += usize::from(pair[0].pod == pair[1].pod);
            }
        }
        same as f64 / total.max(1) as f64
    };
    let kv = stickiness(&run(&w, "kvroute", 8));
    let random = stickiness(&run(&w, "random", 8));
    eprintln!("turn stays on previous turn's pod: kvroute {:.1} %, random {:.1} %", kv * 100.0, random * 100.0);
    assert!(kv >= 0.95, "kvroute kept only {:.1} % of turns on the previous turn's pod", kv * 100.0);
    assert!(random < 0.25, "random kept {:.1} % (expected ≈ 1/8)", random * 100.0);
}

#[test]
fn thundering_herd_fills_the_hot_pod_to_max_queue_then_spreads() {
    let w = workload::herd(1, 50, 4096, 0, 16);
    let r = run(&w, "kvroute", 4);
    let mut order: Vec<&Outcome> = r.outcomes.iter().collect();
    order.sort_by_key(|o| o.arrival_us);
    let hot = order[0].pod;
    let mut per_pod = [0usize; 4];
    for o in &order[1..] {
        per_pod[o.pod] += 1;
    }
    assert_eq!(per_pod[hot], 20, "the cache-hot pod takes exactly maxQueue = 20: {per_pod:?}");
    for (p, n) in per_pod.iter().enumerate().filter(|(p, _)| *p != hot) {
        assert!((8..=12).contains(n), "pod {p} took {n} of the 30 spilled requests: {per_pod:?}");
    }
    // The hot pod serves its 20 from cache; each other pod prefills once and serves the rest of
    // its share from the cache that first prefill built (the herd warms the fleet).
    // (vLLM recomputes a prompt's last token, so a full hit is every block but the last.)
    assert!(order[1..].iter().filter(|o| o.pod == hot).all(|o| o.hit_blocks + 1 == o.total_blocks));
    let cold = order[1..].iter().filter(|o| o.hit_blocks == 0).count();
    assert_eq!(cold, 3, "one cold prefill per spill pod: {per_pod:?}");
    eprintln!("herd: per pod {per_pod:?}, hot pod {hot}, cold prefills {cold}");
}

#[test]
fn runs_are_deterministic() {
    let cfg = workload::SharedPrefixConfig { groups: 20, stages: workload::staged(&[4.0], 15.0), ..Default::default() };
    let w = workload::shared_prefix(&cfg, 9, 16);
    for name in ["random", "kvroute", "sglang-cache-aware"] {
        let (a, b) = (run(&w, name, 4), run(&w, name, 4));
        let key = |r: &RunResult| r.outcomes.iter().map(|o| (o.pod, o.ttft_us, o.hit_blocks)).collect::<Vec<_>>();
        assert_eq!(key(&a), key(&b), "{name} is not deterministic");
    }
}
