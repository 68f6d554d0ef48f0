//! NVIDIA Dynamo's `RadixTree` (dynamo-kv-router 1.6.1, single-threaded) on the same workload.
//! Built only with `--features dynamo` (it pins tokio =1.52.4 and brings an async stack).

use std::time::Instant;

use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData, KvCacheStoredBlockData,
    LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::radix_tree::RadixTree;
use kvroute_common::BlockHash;
use stats_alloc::Region;

use crate::workload::{SplitMix, Workload};
use crate::{GLOBAL, net_bytes, percentiles};

fn local(chain: &[BlockHash]) -> Vec<LocalBlockHash> {
    chain.iter().map(|b| LocalBlockHash(b.0)).collect()
}

/// Loads the workload into a `RadixTree`, then prints the same figures as the other indexes.
pub fn run(w: &Workload) {
    let events: Vec<RouterEvent> = w
        .chains
        .iter()
        .zip(&w.placement)
        .enumerate()
        .flat_map(|(i, (c, pods))| {
            pods.iter().map(move |p| {
                let blocks = c
                    .iter()
                    .enumerate()
                    .map(|(k, b)| KvCacheStoredBlockData {
                        // Sequence hash: unique per (chain, position); tokens hash: the block.
                        block_hash: ExternalSequenceBlockHash(b.0 ^ ((i as u64) << 48) ^ k as u64),
                        tokens_hash: LocalBlockHash(b.0),
                        mm_extra_info: None,
                    })
                    .collect();
                let event = KvCacheEvent {
                    event_id: 0,
                    data: KvCacheEventData::Stored(KvCacheStoreData {
                        parent_hash: None,
                        start_position: None,
                        blocks,
                    }),
                    dp_rank: 0,
                };
                RouterEvent::new(u64::from(p.0), event)
            })
        })
        .collect();
    // Memory: a tree fed clones made inside the region, so event buffers freed (or kept) by
    // `apply_event` are counted exactly once; the originals live outside it.
    let region = Region::new(GLOBAL);
    let mut sized = RadixTree::new();
    for ev in &events {
        let _ = sized.apply_event(ev.clone());
    }
    let bytes = net_bytes(&region);
    drop(sized);
    // Load throughput: the events moved in, as an indexer receives them.
    let t = Instant::now();
    let mut tree = RadixTree::new();
    let mut failed = 0usize;
    for ev in events {
        if tree.apply_event(ev).is_err() {
            failed += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let entries = w.entries() as f64;
    println!(
        "{:>10} load {:.2} M block events/s, {:.1} B/entry ({failed} stores failed)",
        "dynamo",
        entries / secs / 1e6,
        bytes as f64 / entries
    );
    let mut rng = SplitMix(99);
    for (case, q) in [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))] {
        let mut scores: Vec<(u64, u32)> =
            tree.find_matches(local(&q), false).scores.into_iter().map(|(k, v)| (k.worker_id, v)).collect();
        scores.sort_unstable();
        println!("{:>10} check {case}: (worker, matched) {scores:?}", "dynamo");
    }
    // Its API takes the query by value: the conversion (256 × 8 bytes) is inside the timing.
    percentiles("dynamo", w, |q| {
        let scores = tree.find_matches(local(q), false);
        scores.scores.values().copied().max().map_or(0, u64::from)
    });
}
