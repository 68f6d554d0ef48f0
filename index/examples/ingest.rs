//! Ingest on its own, for profilers (`perf record`, `valgrind --tool=callgrind`): the benchmark
//! workload's bulk load (~1.04M (block, pod) entries, one publish), then steady rounds (store
//! 2,048 fresh blocks on a pod, publish, remove them, publish), with no reader threads so
//! instruction counts repeat exactly.
//! Run: `cargo run --release -p kvroute-index --example ingest -- [bulk|steady|both|readers] [rounds]
//! [entries]` (`bulk N`: N bulk loads, each timed by the wall clock and by this thread's CPU
//! time; `entries`: the workload's size, default ~1.04M).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/workload/mod.rs"]
mod workload;

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;
use kvroute_index::{IndexSnapshot, IndexWriter, PodIdx};
use workload::{CHAIN_BLOCKS, SplitMix, Workload};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map_or("both", String::as_str);
    let rounds: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    // A third argument: the workload's (block, pod) entries (default ~1.04M, as bench/peers).
    let entries = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1_040_000usize).clamp(1_000, 50_000_000);
    let w = Workload::new(entries, 1);
    // Bulk loads into a fresh index; the best of `tries` (the box is shared: the best is the
    // least disturbed), and the median.
    // `bulk N`: N loads (default 5).
    let tries = match mode {
        "steady" | "readers" => 1,
        "bulk" => usize::try_from(rounds).unwrap_or(5).clamp(1, 1000),
        _ => 5,
    };
    let (mut rates, mut cpu_rates) = (Vec::new(), Vec::new());
    let mut kept = None;
    for _ in 0..tries {
        std::thread::yield_now();
        let (t, cpu) = (Instant::now(), cpu_ns());
        let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
        let mut writer = IndexWriter::new(published.clone(), usize::MAX);
        for (pod, chain) in w.stores() {
            writer.store(pod, chain);
        }
        writer.publish();
        rates.push(w.entries() as f64 / t.elapsed().as_secs_f64() / 1e6);
        // A yield brings the thread's CPU time up to date (bench/peers' `own_cpu_ns`).
        std::thread::yield_now();
        cpu_rates.push(w.entries() as f64 / (cpu_ns().saturating_sub(cpu) as f64).max(1.0) * 1e3);
        kept = Some((published, writer));
    }
    let first = cpu_rates.first().copied().unwrap_or(0.0);
    rates.sort_by(f64::total_cmp);
    cpu_rates.sort_by(f64::total_cmp);
    if mode != "steady" {
        println!(
            "bulk: best {:.2}, median {:.2} M block events/s ({} entries); per CPU-second best {:.2}, median {:.2}, first {first:.2} ({tries} loads)",
            rates[rates.len() - 1],
            rates[rates.len() / 2],
            w.entries(),
            cpu_rates[cpu_rates.len() - 1],
            cpu_rates[cpu_rates.len() / 2],
        );
    }
    let Some((published, mut writer)) = kept else { return };
    if mode == "bulk" {
        return;
    }
    // `readers`: two threads walk the current snapshot in a loop meanwhile (as the benchmarks).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..if mode == "readers" { 2 } else { 0 })
        .map(|_| {
            let (published, stop, q) = (published.clone(), stop.clone(), w.hit());
            let reader = std::thread::Builder::new().name("reader".into());
            reader
                .spawn(move || {
                    let mut scratch = kvroute_index::MatchScratch::default();
                    let mut n = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::black_box(published.load().match_prefix(&q, &mut scratch));
                        n += 1;
                    }
                    n
                })
                .unwrap()
        })
        .collect();
    let mut rng = SplitMix(7);
    let fresh: Vec<Vec<BlockHash>> = (0..8).map(|_| rng.chain(CHAIN_BLOCKS)).collect();
    // Five stretches of `rounds` rounds: best and median, and events per CPU-second of this
    // (the writing) thread over all five.
    let mut rates = Vec::new();
    let cpu0 = cpu_ns();
    let caught0 = writer.backend().caught_up();
    for s in 0..5 {
        let t = Instant::now();
        for i in 0..rounds {
            let pod = PodIdx(((s * rounds + i) % 64) as u16);
            for c in &fresh {
                writer.store(pod, c);
            }
            writer.publish();
            for c in &fresh {
                writer.remove(pod, c);
            }
            writer.publish();
        }
        let events = rounds * 2 * 8 * CHAIN_BLOCKS as u64;
        rates.push(events as f64 / t.elapsed().as_secs_f64() / 1e6);
    }
    let cpu = cpu_ns().saturating_sub(cpu0) as f64 / 1e9;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|h| h.join().unwrap_or(0)).sum();
    let b = writer.backend();
    let events = 5 * rounds * 2 * 8 * CHAIN_BLOCKS as u64;
    println!(
        "readers: {reads} lookups; pool: {} full copies, {} waits, {:.2} log entries caught up per event",
        b.copies(),
        b.waits(),
        (b.caught_up() - caught0) as f64 / events.max(1) as f64
    );
    rates.sort_by(f64::total_cmp);
    println!("steady: best {:.2}, median {:.2} M block events/s (5 × {rounds} rounds)", rates[4], rates[2]);
    println!("steady per writer CPU-second: {:.2} M block events", events as f64 / cpu.max(1e-9) / 1e6);
    println!("process memory on 2 MiB pages: {}", anon_huge().unwrap_or_else(|| "unknown".into()));
}

/// `AnonHugePages` of this process (`/proc/self/smaps_rollup`, Linux): how much of the slot
/// tables the kernel backs with 2 MiB pages (index/src/pages.rs).
fn anon_huge() -> Option<String> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = s.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    Some(line.trim_start_matches("AnonHugePages:").trim().to_string())
}

/// Nanoseconds the calling thread has spent on a CPU (`/proc/thread-self/schedstat`), 0 where
/// unavailable.
fn cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_ascii_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(0)
}
