//! One run, one workload, the indexes side by side: kvroute's (the one in use: design C over the
//! flat snapshot with runs; and design C over the hashbrown snapshot, as first built), SGLang's
//! `kv-index` 2.0.0 `ChainIndex`, and with `--features dynamo` NVIDIA's dynamo-kv-router 1.6.1
//! `RadixTree` (the naive `std` HashMap model is in `index/benches/`).
//! Prints lookup p50/p99 (each lookup timed alone, 20,000 runs: hit, partial, miss, and hits over
//! 600 chains in turn), load throughput (block events/s) and heap bytes per (block, pod) entry.
//! Run: `cargo run --release` in `bench/peers/`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../../index/tests/workload/mod.rs"]
mod workload;

#[cfg(feature = "dynamo")]
mod dynamo;

use std::alloc::System;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock, chain_prefix_hash};
use kvroute_common::BlockHash;
use kvroute_index::{
    BlockPods, DoubleSnapshot, FlatSnapshot, MatchScratch, PoolMap, PooledBackend, Writer, match_prefix,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use workload::{SplitMix, Workload};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const ENTRIES: usize = 1_040_000;

fn pct(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (at(0.5), at(0.99))
}

fn percentiles(name: &str, w: &Workload, mut lookup: impl FnMut(&[BlockHash]) -> u64) {
    let mut rng = SplitMix(99);
    let cases = [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))];
    for (case, q) in &cases {
        for _ in 0..1000 {
            black_box(lookup(q));
        }
        let ns = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(lookup(q));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        let (p50, p99) = pct(ns);
        println!("{name:>10} lookup {case:<16} p50 {p50:>7.2} µs  p99 {p99:>8.2} µs");
    }
    let hits: Vec<&Vec<BlockHash>> = w.chains.iter().skip(2).step_by(3).take(600).collect();
    let ns = (0..20_000)
        .map(|i| {
            let t = Instant::now();
            black_box(lookup(hits[i % hits.len()]));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    let (p50, p99) = pct(ns);
    println!("{name:>10} lookup {:<16} p50 {p50:>7.2} µs  p99 {p99:>8.2} µs", "hit_rotating_600");
}

fn net_bytes(region: &Region<System>) -> i64 {
    let c = region.change();
    c.bytes_allocated as i64 - c.bytes_deallocated as i64 + c.bytes_reallocated as i64
}

/// kvroute's index with design C's pool over snapshot type `S`, labelled `name`.
fn kvroute<S: PoolMap + BlockPods>(w: &Workload, name: &str) {
    let region = Region::new(GLOBAL);
    let t = Instant::now();
    let published = Arc::new(ArcSwap::from_pointee(S::default()));
    let mut writer = Writer::<PooledBackend<3, S>>::new(published.clone(), usize::MAX);
    for (pod, chain) in w.stores() {
        writer.store(pod, chain);
    }
    writer.publish();
    let secs = t.elapsed().as_secs_f64();
    let bytes = net_bytes(&region);
    let entries = w.entries() as f64;
    println!("{name:>10} load {:.2} M block events/s, {:.1} B/entry", entries / secs / 1e6, bytes as f64 / entries);
    let snap = published.load_full();
    let mut scratch = MatchScratch::default();
    let mut rng = SplitMix(99);
    for (case, q) in [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))] {
        match_prefix(&*snap, &q, &mut scratch);
        let mut got: Vec<(u16, u32)> = scratch.matched_pods().iter().map(|p| (p.0, scratch.matched(*p))).collect();
        got.sort_unstable();
        println!("{name:>10} check {case}: (pod, matched) {got:?}");
    }
    percentiles(name, w, |q| u64::from(match_prefix(&*snap, q, &mut scratch)));
}

fn content(chain: &[BlockHash]) -> Vec<ContentHash> {
    chain.iter().map(|b| ContentHash(b.0)).collect()
}

fn kv_index(w: &Workload) {
    // Hash conversion is outside the timed region: both indexes get ready-made hashes.
    let stored: Vec<Vec<StoredBlock>> = w
        .chains
        .iter()
        .map(|c| {
            let mut seq = SequenceHash(c[0].0);
            c.iter()
                .enumerate()
                .map(|(i, b)| {
                    if i > 0 {
                        seq = chain_prefix_hash(seq, ContentHash(b.0));
                    }
                    StoredBlock { seq_hash: seq, content_hash: ContentHash(b.0) }
                })
                .collect()
        })
        .collect();
    let region = Region::new(GLOBAL);
    let t = Instant::now();
    let index = ChainIndex::new();
    let workers: Vec<u32> = (0..workload::PODS).map(|p| index.intern_worker(&format!("pod-{p}")).unwrap()).collect();
    let mut maps: Vec<ChainBlockMap> = (0..workload::PODS).map(|_| ChainBlockMap::default()).collect();
    let mut failed = 0usize;
    for (blocks, pods) in stored.iter().zip(&w.placement) {
        for p in pods {
            if index.apply_stored(workers[p.as_usize()], blocks, None, &mut maps[p.as_usize()]).is_err() {
                failed += 1;
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let bytes = net_bytes(&region);
    let entries = w.entries() as f64;
    println!(
        "{:>10} load {:.2} M block events/s, {:.1} B/entry ({} entries reported, {failed} stores failed)",
        "kv-index",
        entries / secs / 1e6,
        bytes as f64 / entries,
        index.entry_count()
    );
    let mut rng = SplitMix(99);
    for (case, q) in [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))] {
        let mut scores: Vec<(u32, u32)> = index.find_matches(&content(&q), false).scores.into_iter().collect();
        scores.sort_unstable();
        println!("{:>10} check {case}: (worker, matched) {scores:?}", "kv-index");
    }
    let mut queries: std::collections::HashMap<u64, Vec<ContentHash>> = std::collections::HashMap::new();
    percentiles("kv-index", w, |q| {
        // Query conversion memoised by first block: not timed work in steady state.
        let c = queries.entry(q[0].0 ^ q[q.len() - 1].0).or_insert_with(|| content(q));
        let scores = index.find_matches(c, false);
        scores.scores.values().copied().max().map_or(0, u64::from)
    });
}

fn main() {
    let w = Workload::new(ENTRIES, 1);
    println!(
        "workload: {} chains of {} blocks, {} (block, pod) entries over {} pods",
        w.chains.len(),
        workload::CHAIN_BLOCKS,
        w.entries(),
        workload::PODS
    );
    kvroute::<FlatSnapshot>(&w, "kvroute");
    kvroute::<DoubleSnapshot>(&w, "kvroute-hb");
    kv_index(&w);
    #[cfg(feature = "dynamo")]
    dynamo::run(&w);
}
