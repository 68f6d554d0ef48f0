//! NVIDIA Dynamo's indexers (dynamo-kv-router 1.6.1) on the same workload: the single-threaded
//! `RadixTree` for the bulk load, memory and lookups (as its `KvIndexer` runs it), and the
//! thread-safe `ConcurrentRadixTreeCompressed` for ingest with concurrent readers, fed through
//! its own worker loop (`SyncIndexer::worker`, as its `ThreadPoolIndexer` runs it; readers call
//! `find_matches` inline). Built only with `--features dynamo` (it pins tokio =1.52.4).

use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{SyncIndexer, WorkerTask};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::radix_tree::RadixTree;
use kvroute_common::BlockHash;
use stats_alloc::Region;

use crate::workload::{SplitMix, Workload};
use crate::{GLOBAL, LOADS, best_median, fresh_chains, net_bytes, percentiles, steady};

fn local(chain: &[BlockHash]) -> Vec<LocalBlockHash> {
    chain.iter().map(|b| LocalBlockHash(b.0)).collect()
}

/// Sequence hash of chain `i`'s block `k`: unique per (chain, position).
fn seq(i: u64, k: usize, b: BlockHash) -> ExternalSequenceBlockHash {
    ExternalSequenceBlockHash(b.0 ^ (i << 48) ^ k as u64)
}

fn store_event(i: u64, chain: &[BlockHash], pod: u64) -> RouterEvent {
    let blocks = chain
        .iter()
        .enumerate()
        .map(|(k, b)| KvCacheStoredBlockData { block_hash: seq(i, k, *b), tokens_hash: LocalBlockHash(b.0), mm_extra_info: None })
        .collect();
    let event = KvCacheEvent {
        event_id: 0,
        data: KvCacheEventData::Stored(KvCacheStoreData { parent_hash: None, start_position: None, blocks }),
        dp_rank: 0,
    };
    RouterEvent::new(pod, event)
}

fn remove_event(i: u64, chain: &[BlockHash], pod: u64) -> RouterEvent {
    let block_hashes = chain.iter().enumerate().map(|(k, b)| seq(i, k, *b)).collect();
    let event = KvCacheEvent { event_id: 0, data: KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }), dp_rank: 0 };
    RouterEvent::new(pod, event)
}

/// Loads the workload into a `RadixTree`, then prints the same figures as the other indexes.
pub fn run(w: &Workload) {
    let events: Vec<RouterEvent> = w
        .chains
        .iter()
        .zip(&w.placement)
        .enumerate()
        .flat_map(|(i, (c, pods))| pods.iter().map(move |p| store_event(i as u64, c, u64::from(p.0))))
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
    let mut rates = Vec::new();
    let mut kept = None;
    for _ in 0..LOADS {
        let batch = events.clone();
        let t = Instant::now();
        let mut tree = RadixTree::new();
        let mut failed = 0usize;
        for ev in batch {
            if tree.apply_event(ev).is_err() {
                failed += 1;
            }
        }
        rates.push(w.entries() as f64 / t.elapsed().as_secs_f64() / 1e6);
        assert_eq!(failed, 0, "dynamo refused stores");
        kept = Some(tree);
    }
    let Some(tree) = kept else { return };
    let entries = w.entries() as f64;
    println!("{:>10} load {} M block events/s, {:.1} B/entry", "dynamo", best_median(rates), bytes as f64 / entries);
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
    drop(tree);
    concurrent(w, &events);
}

/// Steady ingest with readers on the concurrent tree, loaded with the workload first.
fn concurrent(w: &Workload, events: &[RouterEvent]) {
    let tree = Arc::new(ConcurrentRadixTreeCompressed::new());
    let (tx, rx) = flume::unbounded::<WorkerTask>();
    let worker = {
        let tree = tree.clone();
        std::thread::spawn(move || tree.worker(rx, None))
    };
    // Sends `events`, the last with an acknowledgement, and waits for it: applied and visible.
    let apply = |events: Vec<RouterEvent>| {
        let n = events.len();
        let mut ack = None;
        for (k, event) in events.into_iter().enumerate() {
            if k + 1 == n {
                let (resp, rx) = tokio::sync::oneshot::channel();
                tx.send(WorkerTask::EventWithAck { event, resp }).expect("worker alive");
                ack = Some(rx);
            } else {
                tx.send(WorkerTask::Event(event)).expect("worker alive");
            }
        }
        if let Some(rx) = ack {
            let _ = rx.blocking_recv();
        }
    };
    apply(events.to_vec());
    let fresh = fresh_chains();
    let q = local(&w.hit());
    let reader = tree.clone();
    steady(
        "dynamo-crtc",
        |i| {
            let pod = i % 64;
            // Ids past the workload's chains: fresh sequence hashes every round.
            let base = 1_000_000 + i * fresh.len() as u64;
            apply(fresh.iter().enumerate().map(|(c, chain)| store_event(base + c as u64, chain, pod)).collect());
            apply(fresh.iter().enumerate().map(|(c, chain)| remove_event(base + c as u64, chain, pod)).collect());
        },
        move || {
            std::hint::black_box(SyncIndexer::find_matches(&*reader, &q, false));
        },
    );
    drop(tx);
    let _ = worker.join();
}
