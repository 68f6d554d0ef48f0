//! Unit tests of the peer policies' decision rules.

use kvroute_common::BlockHash;

use super::*;
use crate::workload::SimRequest;

fn req(id: usize, base: u64, n: u64) -> SimRequest {
    SimRequest {
        id,
        arrival_us: 0,
        prompt_tokens: (n * 16) as u32,
        output_tokens: 1,
        adapter: None,
        session: None,
        group: None,
        stage: 0,
        direct: false,
        blocks: (0..n).map(|i| BlockHash(base * 10_000 + i)).collect(),
        text_blocks: (0..n).map(|i| BlockHash(base * 10_000 + i + 5_000)).collect(),
    }
}

fn pick(p: &mut dyn Policy, r: &SimRequest) -> usize {
    match p.pick(r, 0) {
        Ok(x) => x,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn least_connections_fills_the_emptiest_pod() {
    let mut p = LeastConnections::new(3);
    let picks: Vec<usize> = (0..3).map(|i| pick(&mut p, &req(i, i as u64, 4))).collect();
    let mut sorted = picks.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![0, 1, 2], "one each first: {picks:?}");
    p.on_finish(&req(1, 1, 4), picks[1], 0);
    assert_eq!(pick(&mut p, &req(3, 3, 4)), picks[1]);
}

#[test]
fn sglang_follows_the_cache_until_load_is_imbalanced() {
    let mut p = SglangCacheAware::new(2, 10_000);
    let first = pick(&mut p, &req(0, 1, 10));
    // Same prefix: match rate 1 > 0.3 → same worker, until it has > 64 more in flight than the other.
    for i in 1..=64 {
        assert_eq!(pick(&mut p, &req(i, 1, 10)), first, "request {i}");
    }
    assert_ne!(pick(&mut p, &req(65, 1, 10)), first, "imbalance 65 > 64 and > 1.5× → least loaded");
    // A new prefix (match rate 0) goes to the worker with the smaller tree.
    let mut q = SglangCacheAware::new(2, 10_000);
    let a = pick(&mut q, &req(0, 1, 10));
    assert_ne!(pick(&mut q, &req(1, 2, 10)), a);
}

#[test]
fn dynamo_trades_overlap_against_active_blocks() {
    let mut p = DynamoCost::new(2, 0);
    // Pod 0 holds the prefix (10 blocks) per its KV events.
    p.on_report(&PodReport {
        pod: 0,
        engine_time_us: 0,
        stored: req(0, 1, 10).blocks,
        removed: vec![],
        cleared: false,
        stats: None,
    });
    assert_eq!(pick(&mut p, &req(1, 1, 10)), 0, "cost 0 + 10 vs 10 + 10");
    // Pod 0 now has 10 active blocks; the same prompt again shares them: cost 0 + 10 vs 10 + 10.
    assert_eq!(pick(&mut p, &req(2, 1, 10)), 0);
    // A different 10-block prompt: pod 0 costs 10 + 20, pod 1 costs 10 + 10.
    assert_eq!(pick(&mut p, &req(3, 2, 10)), 1);
}

#[test]
fn kvroute_records_its_decisions_only_when_asked() {
    let opts = PolicyOptions { record_decisions: true, ..PolicyOptions::default() };
    let Ok(mut p) = build("kvroute", 2, &opts) else { panic!("kvroute builds") };
    let mut r = req(7, 1, 4);
    r.group = Some(3);
    let pod = pick(p.as_mut(), &r);
    let lines = p.take_decisions();
    assert_eq!(lines.len(), 1, "{lines:?}");
    let fields: Vec<&str> = lines[0].trim_end().splitn(7, ',').collect();
    assert_eq!(fields[1..6], ["7", "3", "", "4", &format!("pod-{pod}")], "{lines:?}");
    assert_eq!(fields[6].split(';').count(), 2, "both candidates, chosen first: {lines:?}");
    assert!(fields[6].starts_with(&format!("pod-{pod} S=")), "{lines:?}");
    assert!(p.take_decisions().is_empty(), "taken once");
    let Ok(mut quiet) = build("kvroute", 2, &PolicyOptions::default()) else { panic!("kvroute builds") };
    pick(quiet.as_mut(), &r);
    assert!(quiet.take_decisions().is_empty());
}
