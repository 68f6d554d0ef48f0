//! One run, one workload, the indexes side by side: kvroute's (design C over the flat snapshot,
//! the one in use), SGLang's `kv-index` 2.0.0 `ChainIndex`, and with `--features dynamo`
//! NVIDIA's dynamo-kv-router 1.6.1 (`RadixTree` for the bulk load and lookups,
//! `ConcurrentRadixTreeCompressed` for ingest with readers; the naive `std` HashMap model is in
//! `index/benches/`).
//!
//! Per index: bulk load throughput (block events/s, the workload's ~1.04M (block, pod) entries
//! into an empty index, best and median of 5 loads, by the wall clock and per CPU-second of the loading thread) and heap bytes per entry; lookup p50/p99
//! (each lookup timed alone, 20,000 runs: hit, partial, miss, and hits over 600 chains in turn);
//! steady ingest with two reader threads spinning on lookups (rounds of 8 fresh 256-block chains
//! stored on one pod, made visible, removed, made visible: block events/s, best and median of 4
//! stretches of ~0.5 s), and the same per CPU-second of the writing threads (the caller's, and
//! Dynamo's worker thread) over all stretches: on a shared machine the readers and other load
//! take cores from the writer, and readers that never wait (kvroute's) take the most, so this
//! column compares the writers' own cost and the wall-clock column what is left of the cores.
//! Run: `cargo run --release --features dynamo -- [kvroute] [kv-index] [dynamo]` in
//! `bench/peers/` (no names: all).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../../index/tests/workload/mod.rs"]
mod workload;

#[cfg(feature = "dynamo")]
mod dynamo;

use std::alloc::System;
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kv_index::{ChainBlockMap, ChainIndex, ContentHash, SequenceHash, StoredBlock, chain_prefix_hash};
use kvroute_common::BlockHash;
use kvroute_index::{IndexSnapshot, IndexWriter, MatchScratch, PodIdx};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use workload::{CHAIN_BLOCKS, SplitMix, Workload};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const ENTRIES: usize = 1_040_000;
/// Bulk loads per index (best and median reported).
const LOADS: usize = 5;
/// Fresh chains per steady round (8 × 256 = 2,048 stores, then as many removes).
const ROUND_CHAINS: usize = 8;
/// Steady stretches measured, and each one's length.
const STRETCHES: usize = 4;
const STRETCH: Duration = Duration::from_millis(500);

fn pct(mut ns: Vec<u64>) -> (f64, f64) {
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    (at(0.5), at(0.99))
}

/// Times one bulk load by the wall clock and by the calling thread's CPU time (every index's
/// load runs in the calling thread).
pub struct LoadTimer {
    wall: Instant,
    cpu: u64,
    stat: Vec<std::path::PathBuf>,
}

impl LoadTimer {
    pub fn start() -> LoadTimer {
        let stat: Vec<std::path::PathBuf> = thread_schedstat().into_iter().collect();
        LoadTimer { cpu: own_cpu_ns(&stat), stat, wall: Instant::now() }
    }

    /// Pushes `entries` per wall-clock second and per CPU-second (M/s) onto the two lists.
    pub fn finish(self, entries: usize, wall: &mut Vec<f64>, cpu: &mut Vec<f64>) {
        let secs = self.wall.elapsed().as_secs_f64();
        let cpu_secs = own_cpu_ns(&self.stat).saturating_sub(self.cpu) as f64 / 1e9;
        wall.push(entries as f64 / secs / 1e6);
        cpu.push(entries as f64 / cpu_secs.max(1e-9) / 1e6);
    }
}

/// "best B, median M" of rates (M/s).
pub fn best_median(mut rates: Vec<f64>) -> String {
    rates.sort_by(f64::total_cmp);
    format!("best {:.2}, median {:.2}", rates[rates.len() - 1], rates[rates.len() / 2])
}

pub fn percentiles(name: &str, w: &Workload, mut lookup: impl FnMut(&[BlockHash]) -> u64) {
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

pub fn net_bytes(region: &Region<System>) -> i64 {
    // A reallocation's growth or shrinkage is already in these two totals (adding
    // `bytes_reallocated` counted it twice).
    let c = region.change();
    c.bytes_allocated as i64 - c.bytes_deallocated as i64
}

/// The steady-ingest chains: `ROUND_CHAINS` fresh 256-block chains.
pub fn fresh_chains() -> Vec<Vec<BlockHash>> {
    let mut rng = SplitMix(7);
    (0..ROUND_CHAINS).map(|_| rng.chain(CHAIN_BLOCKS)).collect()
}

/// `/proc` path of the calling thread's `schedstat` (its first field: ns spent on a CPU).
pub fn thread_schedstat() -> Option<std::path::PathBuf> {
    let task = std::fs::read_link("/proc/thread-self").ok()?;
    Some(std::path::Path::new("/proc").join(task).join("schedstat"))
}

/// Nanoseconds on a CPU so far of the threads whose `schedstat` files are `paths`.
fn cpu_ns(paths: &[std::path::PathBuf]) -> u64 {
    paths
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .filter_map(|s| s.split_ascii_whitespace().next().and_then(|x| x.parse::<u64>().ok()))
        .sum()
}

/// [`cpu_ns`] of the calling thread's own `schedstat`, brought up to date first: the kernel
/// adds a running thread's time to that field only at a scheduler tick or event (4 ms apart
/// here, a tenth of a bulk load: per-CPU-second loads read in steps of 40, 44, 48 ms), and a
/// yield is such an event (checked against `CLOCK_THREAD_CPUTIME_ID`: within 0.1 ms after a
/// yield, up to 3.4 ms behind without).
fn own_cpu_ns(paths: &[std::path::PathBuf]) -> u64 {
    std::thread::yield_now();
    cpu_ns(paths)
}

/// Runs `round(i)` (one store + remove round of `ROUND_CHAINS` chains, made visible) while two
/// threads run `read` in a loop; prints block events/s per stretch (best, median), the events
/// per CPU-second of the writing threads (this one and `workers`' `schedstat` files) and the
/// readers' lookups.
pub fn steady(
    name: &str,
    mut round: impl FnMut(u64),
    read: impl Fn() + Send + Sync + Clone + 'static,
    workers: &[std::path::PathBuf],
) {
    let writers: Vec<std::path::PathBuf> = thread_schedstat().into_iter().chain(workers.iter().cloned()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (stop, read) = (stop.clone(), read.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    read();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let events_per_round = (2 * ROUND_CHAINS * CHAIN_BLOCKS) as f64;
    let mut i = 0u64;
    // Warm-up: a few rounds (the index reaches its steady copies and sizes).
    for _ in 0..20 {
        round(i);
        i += 1;
    }
    let mut rates = Vec::new();
    let (cpu0, wall0, i0) = (cpu_ns(&writers), Instant::now(), i);
    for _ in 0..STRETCHES {
        let (t, mut n) = (Instant::now(), 0u64);
        while t.elapsed() < STRETCH {
            round(i);
            i += 1;
            n += 1;
        }
        rates.push(n as f64 * events_per_round / t.elapsed().as_secs_f64() / 1e6);
    }
    let (cpu, wall) = (cpu_ns(&writers).saturating_sub(cpu0) as f64 / 1e9, wall0.elapsed().as_secs_f64());
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    println!(
        "{name:>10} steady with 2 readers: {} M block events/s ({i} rounds; readers did {reads} lookups)",
        best_median(rates)
    );
    println!(
        "{name:>10} steady per writer CPU-second: {:.2} M block events (writers on a CPU {:.0} % of the time)",
        (i - i0) as f64 * events_per_round / cpu.max(1e-9) / 1e6,
        100.0 * cpu / wall
    );
}

/// kvroute's index (design C over the flat snapshot, as the picker uses it).
fn kvroute(w: &Workload) {
    let (mut rates, mut cpu_rates) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    let mut kept = None;
    for _ in 0..LOADS {
        // Slot tables of 2 MiB or more are their own mappings, outside the global allocator.
        let mapped = kvroute_index::mapped_bytes();
        let region = Region::new(GLOBAL);
        let t = LoadTimer::start();
        let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
        let mut writer = IndexWriter::new(published.clone(), usize::MAX);
        for (pod, chain) in w.stores() {
            writer.store(pod, chain);
        }
        writer.publish();
        t.finish(w.entries(), &mut rates, &mut cpu_rates);
        bytes = net_bytes(&region) + kvroute_index::mapped_bytes() as i64 - mapped as i64;
        kept = Some((published, writer));
    }
    let (published, mut writer) = kept.unwrap();
    let entries = w.entries() as f64;
    println!(
        "{:>10} load {} M block events/s ({} per CPU-second), {:.1} B/entry",
        "kvroute",
        best_median(rates),
        best_median(cpu_rates),
        bytes as f64 / entries
    );
    let snap = published.load_full();
    let mut scratch = MatchScratch::default();
    let mut rng = SplitMix(99);
    for (case, q) in [("hit", w.hit()), ("partial", w.partial(&mut rng)), ("miss", w.miss(&mut rng))] {
        snap.match_prefix(&q, &mut scratch);
        let mut got: Vec<(u16, u32)> = scratch.matched_pods().iter().map(|p| (p.0, scratch.matched(*p))).collect();
        got.sort_unstable();
        println!("{:>10} check {case}: (pod, matched) {got:?}", "kvroute");
    }
    percentiles("kvroute", w, |q| u64::from(snap.match_prefix(q, &mut scratch)));
    drop(snap);
    println!(
        "{:>10} before steady: {} blocks, {} MiB of mapped slot tables",
        "kvroute",
        published.load().len(),
        kvroute_index::mapped_bytes() >> 20
    );
    let fresh = fresh_chains();
    let q = w.hit();
    let reader = published.clone();
    steady(
        "kvroute",
        |i| {
            let pod = PodIdx((i % 64) as u16);
            for c in &fresh {
                writer.store(pod, c);
            }
            writer.publish();
            for c in &fresh {
                writer.remove(pod, c);
            }
            writer.publish();
        },
        move || {
            thread_local!(static SCRATCH: std::cell::RefCell<MatchScratch> = std::cell::RefCell::new(MatchScratch::default()));
            SCRATCH.with(|s| black_box(reader.load().match_prefix(&q, &mut s.borrow_mut())));
        },
        &[],
    );
    println!(
        "{:>10} after steady: {} blocks, {} MiB of mapped slot tables",
        "kvroute",
        published.load().len(),
        kvroute_index::mapped_bytes() >> 20
    );
    let b = writer.backend();
    println!(
        "{:>10} pool: {} full copies (every spare held), {} waits, {} copies held",
        "kvroute",
        b.copies(),
        b.waits(),
        b.copies_held()
    );
}

fn content(chain: &[BlockHash]) -> Vec<ContentHash> {
    chain.iter().map(|b| ContentHash(b.0)).collect()
}

fn stored(chain: &[BlockHash]) -> Vec<StoredBlock> {
    let mut seq = SequenceHash(chain[0].0);
    chain
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if i > 0 {
                seq = chain_prefix_hash(seq, ContentHash(b.0));
            }
            StoredBlock { seq_hash: seq, content_hash: ContentHash(b.0) }
        })
        .collect()
}

fn kv_index(w: &Workload) {
    // Hash conversion is outside the timed region: both indexes get ready-made hashes.
    let stored_chains: Vec<Vec<StoredBlock>> = w.chains.iter().map(|c| stored(c)).collect();
    let (mut rates, mut cpu_rates) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    let mut kept = None;
    for _ in 0..LOADS {
        let region = Region::new(GLOBAL);
        let t = LoadTimer::start();
        let index = ChainIndex::new();
        let workers: Vec<u32> =
            (0..workload::PODS).map(|p| index.intern_worker(&format!("pod-{p}")).unwrap()).collect();
        let mut maps: Vec<ChainBlockMap> = (0..workload::PODS).map(|_| ChainBlockMap::default()).collect();
        let mut failed = 0usize;
        for (blocks, pods) in stored_chains.iter().zip(&w.placement) {
            for p in pods {
                if index.apply_stored(workers[p.as_usize()], blocks, None, &mut maps[p.as_usize()]).is_err() {
                    failed += 1;
                }
            }
        }
        t.finish(w.entries(), &mut rates, &mut cpu_rates);
        bytes = net_bytes(&region);
        assert_eq!(failed, 0, "kv-index refused stores");
        kept = Some((index, workers, maps));
    }
    let (index, workers, mut maps) = kept.unwrap();
    let entries = w.entries() as f64;
    println!(
        "{:>10} load {} M block events/s ({} per CPU-second), {:.1} B/entry ({} entries reported)",
        "kv-index",
        best_median(rates),
        best_median(cpu_rates),
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
    let index = Arc::new(index);
    let fresh: Vec<Vec<StoredBlock>> = fresh_chains().iter().map(|c| stored(c)).collect();
    let seqs: Vec<Vec<SequenceHash>> = fresh.iter().map(|c| c.iter().map(|b| b.seq_hash).collect()).collect();
    let q = content(&w.hit());
    let reader = index.clone();
    steady(
        "kv-index",
        |i| {
            // Changes are visible as applied: no publish step.
            let p = (i % 64) as usize;
            for c in &fresh {
                index.apply_stored(workers[p], c, None, &mut maps[p]).unwrap();
            }
            for s in &seqs {
                index.apply_removed(workers[p], s, &mut maps[p]);
            }
        },
        move || {
            black_box(reader.find_matches(&q, false));
        },
        &[],
    );
}

fn main() {
    let names: Vec<String> = std::env::args().skip(1).collect();
    let wanted = |n: &str| names.is_empty() || names.iter().any(|a| a == n);
    let w = Workload::new(ENTRIES, 1);
    println!(
        "workload: {} chains of {} blocks, {} (block, pod) entries over {} pods",
        w.chains.len(),
        workload::CHAIN_BLOCKS,
        w.entries(),
        workload::PODS
    );
    if wanted("kvroute") {
        kvroute(&w);
    }
    if wanted("kv-index") {
        kv_index(&w);
    }
    #[cfg(feature = "dynamo")]
    if wanted("dynamo") {
        dynamo::run(&w);
    }
}
