//! Index benchmarks (docs/design.md §10, docs/index.md): hashing a 4096-token prompt; lookup of a 256-block
//! request on ~1M (block, pod) entries over 64 pods (full hit, partial, miss, and hits over 600
//! chains in turn, so the blocks are not in cache); ingest throughput with 2 concurrent readers;
//! publish latency. Each measured for the snapshot in use (design C over the flat table,
//! `pooled3_flat`; `pooled4_flat` for ingest with a fourth copy) and the naive
//! `std::collections::HashMap` model in the same run, so results read as ratios. The designs it
//! was chosen over, and their figures, are in docs/decisions/0002-index-snapshot-design.md.
//!
//! Criterion reports medians of batched iterations; per-lookup p50/p99 come from the
//! `percentiles` pass printed first (each lookup timed alone over 20,000 runs).
//! Run: `cargo bench -p kvroute-index --bench index -- --warm-up-time 1 --measurement-time 3`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/workload/mod.rs"]
mod workload;

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use criterion::{BenchmarkId, Criterion, Throughput};
use kvroute_common::{BlockHash, BlockHasher};
use kvroute_index::{Backend, BlockPods, FlatSnapshot, MatchScratch, PodIdx, PooledBackend, Writer, match_prefix};
use workload::{CHAIN_BLOCKS, SplitMix, Workload, build};

/// Entries in the lookup/ingest index (docs/design.md §10: ~1.04M).
const ENTRIES: usize = 1_040_000;
/// Block events per published ingest batch (half stores, half removes).
const BATCH_BLOCKS: usize = 4096;

/// The naive model (docs/design.md §10's "std HashMap of chained hashes"): SipHash map of block → pods,
/// the walk keeps a `Vec` of active pods and allocates its result.
#[derive(Default)]
struct Naive {
    map: HashMap<BlockHash, Vec<PodIdx>>,
}

impl Naive {
    fn store(&mut self, pod: PodIdx, blocks: &[BlockHash]) {
        for b in blocks {
            let v = self.map.entry(*b).or_default();
            if !v.contains(&pod) {
                v.push(pod);
            }
        }
    }
    fn remove(&mut self, pod: PodIdx, blocks: &[BlockHash]) {
        for b in blocks {
            if let Some(v) = self.map.get_mut(b) {
                v.retain(|p| *p != pod);
                if v.is_empty() {
                    self.map.remove(b);
                }
            }
        }
    }
    fn lookup(&self, chain: &[BlockHash]) -> Vec<(PodIdx, u32)> {
        let mut out = Vec::new();
        let Some(first) = chain.first().and_then(|b| self.map.get(b)) else {
            return out;
        };
        let mut active = first.clone();
        for (depth, b) in chain.iter().enumerate().skip(1) {
            let holders = self.map.get(b).map(Vec::as_slice).unwrap_or(&[]);
            active.retain(|p| {
                let keep = holders.contains(p);
                if !keep {
                    out.push((*p, depth as u32));
                }
                keep
            });
            if active.is_empty() {
                return out;
            }
        }
        out.extend(active.iter().map(|p| (*p, chain.len() as u32)));
        out
    }
}

fn build_naive(w: &Workload) -> Naive {
    let mut n = Naive::default();
    for (pod, chain) in w.stores() {
        n.store(pod, chain);
    }
    n
}

fn queries(w: &Workload) -> [(&'static str, Vec<BlockHash>); 3] {
    let mut rng = SplitMix(99);
    [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))]
}

fn hashing(c: &mut Criterion) {
    let hasher = BlockHasher::new("Qwen/Qwen2.5-7B-Instruct", None, 16);
    let tokens: Vec<u32> = (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) % 151_000).collect();
    let mut out = Vec::with_capacity(CHAIN_BLOCKS);
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements(4096));
    g.bench_function("4096_tokens", |b| {
        b.iter(|| {
            out.clear();
            hasher.hash_prompt(black_box(&tokens), &mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

fn lookup_design<B: Backend>(c: &mut Criterion, name: &str, w: &Workload)
where
    B::Snapshot: BlockPods + Default + Send + Sync,
{
    let (published, _writer) = build::<B>(w);
    let snap = published.load_full();
    let mut scratch = MatchScratch::default();
    let mut g = c.benchmark_group("lookup");
    for (case, q) in queries(w) {
        g.bench_with_input(BenchmarkId::new(name, case), &q, |b, q| {
            b.iter(|| match_prefix(&*snap, black_box(q), &mut scratch))
        });
    }
    g.finish();
}

/// Design C over the flat table (in use).
type PooledFlat = PooledBackend<3>;

fn lookups(c: &mut Criterion) {
    let w = Workload::new(ENTRIES, 1);
    lookup_design::<PooledFlat>(c, "pooled3_flat", &w);
    let naive = build_naive(&w);
    let mut g = c.benchmark_group("lookup");
    for (case, q) in queries(&w) {
        g.bench_with_input(BenchmarkId::new("naive", case), &q, |b, q| b.iter(|| naive.lookup(black_box(q))));
    }
    g.finish();
}

/// Spawns 2 readers looking up `q` on the current snapshot until `stop`.
fn readers<S: BlockPods + Send + Sync + 'static>(
    published: &Arc<ArcSwap<S>>,
    q: &[BlockHash],
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<u64>> {
    (0..2)
        .map(|_| {
            let (published, stop, q) = (published.clone(), stop.clone(), q.to_vec());
            std::thread::spawn(move || {
                let mut scratch = MatchScratch::default();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    black_box(match_prefix(&**published.load(), &q, &mut scratch));
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// One ingest iteration: store `BATCH_BLOCKS / 2` fresh blocks on a pod, publish, remove them,
/// publish. Returns the elapsed time.
fn ingest_round<B: Backend>(writer: &mut Writer<B>, fresh: &[Vec<BlockHash>], i: u64) -> Duration {
    let pod = PodIdx((i % 64) as u16);
    let start = Instant::now();
    for c in fresh {
        writer.store(pod, c);
    }
    writer.publish();
    for c in fresh {
        writer.remove(pod, c);
    }
    writer.publish();
    start.elapsed()
}

/// Runs the `ingest/<id>` benchmark on `writer` (fresh 256-block chains, `BATCH_BLOCKS` events
/// per batch, one publish each), with two readers walking `w.hit()` on `published` when
/// `with_readers`. Returns (batches run, lookups the readers did meanwhile).
fn run_ingest<B: Backend>(
    c: &mut Criterion,
    w: &Workload,
    id: &str,
    published: &Arc<ArcSwap<B::Snapshot>>,
    writer: &mut Writer<B>,
    with_readers: bool,
) -> (u64, u64)
where
    B::Snapshot: BlockPods + Send + Sync + 'static,
{
    let mut rng = SplitMix(7);
    let fresh: Vec<Vec<BlockHash>> = (0..BATCH_BLOCKS / 2 / CHAIN_BLOCKS).map(|_| rng.chain(CHAIN_BLOCKS)).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let handles = if with_readers { readers(published, &w.hit(), &stop) } else { Vec::new() };
    let mut rounds = 0u64;
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(BATCH_BLOCKS as u64));
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            rounds += iters;
            (0..iters).map(|i| ingest_round(writer, &fresh, i)).sum()
        })
    });
    g.finish();
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = handles.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    (rounds, reads)
}

fn ingest_design<B: Backend>(c: &mut Criterion, name: &str, w: &Workload, with_readers: bool)
where
    B::Snapshot: BlockPods + Default + Send + Sync + 'static,
{
    let (published, mut writer) = build::<B>(w);
    let id = if with_readers { format!("{name}/2_readers") } else { format!("{name}/no_readers") };
    let (_, reads) = run_ingest(c, w, &id, &published, &mut writer, with_readers);
    if with_readers {
        println!("ingest/{name}: readers did {reads} lookups meanwhile");
    }
}

/// Design C (flat, in use) with readers, also reporting how often readers held every spare
/// copy (the pool grew, or the writer waited).
fn ingest_pooled<const MAX: usize>(c: &mut Criterion, w: &Workload) {
    let (published, mut writer) = build::<PooledBackend<MAX>>(w);
    let (rounds, reads) = run_ingest(c, w, &format!("pooled{MAX}_flat/2_readers"), &published, &mut writer, true);
    let b = writer.backend();
    println!(
        "ingest/pooled{MAX}_flat: {} publishes, {} map copies, {} waits (every spare held), {} copies held at the end, readers did {reads} lookups",
        2 * rounds,
        b.copies(),
        b.waits(),
        b.copies_held()
    );
}

fn ingest(c: &mut Criterion) {
    let w = Workload::new(ENTRIES, 1);
    ingest_pooled::<3>(c, &w);
    ingest_design::<PooledFlat>(c, "pooled3_flat", &w, false);
    ingest_pooled::<4>(c, &w);
    // Naive: no snapshots at all (a reader would need a lock), so no readers: an upper bound.
    let mut naive = build_naive(&w);
    let mut rng = SplitMix(7);
    let fresh: Vec<Vec<BlockHash>> = (0..BATCH_BLOCKS / 2 / CHAIN_BLOCKS).map(|_| rng.chain(CHAIN_BLOCKS)).collect();
    let mut g = c.benchmark_group("ingest");
    g.throughput(Throughput::Elements(BATCH_BLOCKS as u64));
    g.bench_function("naive/no_readers", |b| {
        b.iter(|| {
            for c in &fresh {
                naive.store(PodIdx(1), c);
            }
            for c in &fresh {
                naive.remove(PodIdx(1), c);
            }
        })
    });
    g.finish();
}

/// Publish latency: after a batch of 256 stores, the `publish()` call alone, and the batch plus
/// publish (what an agent event waits for before readers see it).
fn publish_design<B: Backend>(c: &mut Criterion, name: &str, w: &Workload)
where
    B::Snapshot: Default,
{
    let (_published, mut writer) = build::<B>(w);
    let mut rng = SplitMix(8);
    let fresh = rng.chain(CHAIN_BLOCKS);
    let mut g = c.benchmark_group("publish");
    g.bench_function(BenchmarkId::new(name, "publish_only"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                if i % 2 == 0 {
                    writer.store(PodIdx(3), &fresh);
                } else {
                    writer.remove(PodIdx(3), &fresh);
                }
                let start = Instant::now();
                writer.publish();
                total += start.elapsed();
            }
            total
        })
    });
    g.bench_function(BenchmarkId::new(name, "batch_256_and_publish"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for i in 0..iters {
                if i % 2 == 0 {
                    writer.store(PodIdx(3), &fresh);
                } else {
                    writer.remove(PodIdx(3), &fresh);
                }
                writer.publish();
            }
            start.elapsed()
        })
    });
    g.finish();
}

fn publish(c: &mut Criterion) {
    let w = Workload::new(ENTRIES, 1);
    publish_design::<PooledFlat>(c, "pooled3_flat", &w);
}

/// p50 and p99 of per-lookup times `ns` (nanoseconds), in µs, through an HDR histogram
/// (1 ns to 1 s, 3 significant digits).
fn pct(ns: Vec<u64>) -> (f64, f64) {
    let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 1_000_000_000, 3).expect("valid bounds");
    for v in ns {
        h.saturating_record(v);
    }
    let at = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    (at(0.5), at(0.99))
}

fn percentiles_of(name: &str, w: &Workload, mut lookup: impl FnMut(&[BlockHash]) -> u64) {
    for (case, q) in queries(w) {
        for _ in 0..1000 {
            black_box(lookup(&q));
        }
        let ns: Vec<u64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(lookup(&q));
                t.elapsed().as_nanos() as u64
            })
            .collect();
        let (p50, p99) = pct(ns);
        println!("percentiles lookup/{name}/{case}: p50 {p50:.2} µs, p99 {p99:.2} µs");
    }
    // Full hits over 600 different 3-pod chains in turn: the map is not cache-hot for the query.
    let hits: Vec<&Vec<BlockHash>> = w.chains.iter().skip(2).step_by(3).take(600).collect();
    let ns: Vec<u64> = (0..20_000)
        .map(|i| {
            let q = hits[i % hits.len()];
            let t = Instant::now();
            black_box(lookup(q));
            t.elapsed().as_nanos() as u64
        })
        .collect();
    let (p50, p99) = pct(ns);
    println!("percentiles lookup/{name}/hit_rotating_600: p50 {p50:.2} µs, p99 {p99:.2} µs");
}

/// Per-lookup percentiles of one design on `w`.
fn percentiles_design<B: Backend>(name: &str, w: &Workload)
where
    B::Snapshot: BlockPods + Default,
{
    let (p, _w) = build::<B>(w);
    let snap = p.load_full();
    let mut s = MatchScratch::default();
    percentiles_of(name, w, |q| u64::from(match_prefix(&*snap, q, &mut s)));
}

/// Per-lookup p50/p99 (each lookup timed alone; `Instant` adds ~20-30 ns to each). Runs with no
/// filter or a filter naming `percentiles`; `percentiles/NAME` runs only designs whose name
/// contains NAME.
fn percentiles(filter: &str) {
    if !filter.is_empty() && !"percentiles".contains(filter) && !filter.contains("percentiles") {
        return;
    }
    let only = filter.split_once("percentiles/").map_or("", |(_, name)| name);
    let w = Workload::new(ENTRIES, 1);
    let wanted = |name: &str| name.contains(only);
    if wanted("pooled3_flat") {
        percentiles_design::<PooledFlat>("pooled3_flat", &w);
    }
    if wanted("pooled3_flat_blockwise") {
        // Every block stored in its own call: the flat map makes no runs, so this is its walk
        // one probe per block (the worst case for the layout).
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut writer = Writer::<PooledFlat>::new(published.clone(), usize::MAX);
        for (pod, chain) in w.stores() {
            for b in chain {
                writer.store(pod, std::slice::from_ref(b));
            }
        }
        writer.publish();
        let snap = published.load_full();
        let mut s = MatchScratch::default();
        percentiles_of("pooled3_flat_blockwise", &w, |q| u64::from(match_prefix(&*snap, q, &mut s)));
    }
    if wanted("pooled3_flat_split") {
        // Runs cut after the load: every chain's first 64 blocks also stored by another pod
        // (a shared prefix), then one holder evicts block 160 (a removal in the middle).
        let (published, mut writer) = build::<PooledFlat>(&w);
        for (i, (chain, pods)) in w.chains.iter().zip(&w.placement).enumerate() {
            let other = PodIdx(((i * 7 + 5) % usize::from(workload::PODS)) as u16);
            if !pods.contains(&other) {
                writer.store(other, &chain[..64]);
            }
            writer.remove(pods[0], &chain[160..161]);
        }
        writer.publish();
        let snap = published.load_full();
        let mut s = MatchScratch::default();
        percentiles_of("pooled3_flat_split", &w, |q| u64::from(match_prefix(&*snap, q, &mut s)));
    }
    if wanted("naive") {
        let naive = build_naive(&w);
        percentiles_of("naive", &w, |q| naive.lookup(q).len() as u64);
    }
}

fn main() {
    // The first free argument (not a flag or a flag's value) is criterion's filter.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut filter = String::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a.starts_with("--") {
            if matches!(
                a.as_str(),
                "--warm-up-time" | "--measurement-time" | "--sample-size" | "--save-baseline" | "--baseline"
            ) {
                i += 1;
            }
        } else {
            filter = a.clone();
        }
        i += 1;
    }
    percentiles(&filter);
    let mut c = Criterion::default().configure_from_args();
    hashing(&mut c);
    lookups(&mut c);
    ingest(&mut c);
    publish(&mut c);
    c.final_summary();
}
