//! The prefix index (docs/design.md §3): block hash → pods holding that block, and the prefix walk.
//!
//! Concurrency: one writer ([`IndexWriter`], owned by the pool's writer thread) mutates a working
//! copy and [`IndexWriter::publish`]es an immutable [`IndexSnapshot`] through `arc-swap`. Readers
//! (`Router::route`) load the current snapshot and walk it without any lock; a snapshot never
//! changes once published, so a reader sees either all of a batch or none of it.
//!
//! Invariants: pods are interned as [`PodIdx`] (small integers, assigned by the pool); a pod's
//! entries never exceed its cap (excess stores are dropped and counted); a published snapshot is
//! never mutated.
//!
//! Modules, each depending only on those listed before it: [`types`] (ids, stats, the walk's
//! scratch), `hasher`, `pages` (the slot tables' allocation: 2 MiB-aligned and advised for
//! huge pages: with the slot's `Zeroed` marker, the crate's only `unsafe`), [`walk`] (the prefix walk over
//! any [`BlockPods`] map), [`flat`] (the snapshot: an open-addressing table of 16-byte slots with
//! runs of consecutive blocks; its `edit` submodule changes a copy), [`writer`] (per-pod
//! bookkeeping and the cap over any [`Backend`]), [`pool`] (design C: a pool of identical flat
//! copies, the backend in use).
//!
//! `docs/index.md` has this design's figures against the peers, and
//! docs/decisions/0002-index-snapshot-design.md the benchmarks that chose it over designs A and B
//! and C over a hashbrown map (their code is in the git history, not here). This crate has no
//! tokio/tonic dependency so its tests and benches build fast.

pub mod flat;
mod hasher;
mod pages;
pub mod pool;
pub mod types;
pub mod walk;
pub mod writer;

/// The unit tests' random source: xorshift64 from `seed` (non-zero), each call a value in
/// `0..n`. One generator for every test, so a seed names the same sequence everywhere.
#[cfg(test)]
pub(crate) fn test_rng(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed;
    move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

pub use flat::FlatSnapshot;
pub use hasher::{MixBuild, MixHasher};
pub use pages::mapped_bytes;
pub use pool::{MAX_COPIES, PooledBackend, PooledWriter, ReclaimWait};
pub use types::{IndexStamp, IndexStats, MatchScratch, PodChanges, PodIdx};
pub use walk::{BlockPods, match_prefix, walk_blocks};
pub use writer::{Backend, Writer};

/// The index design in use (writer side): design C, a pool of flat copies (`docs/index.md`):
/// sub-µs publishes; with readers running it never waits for one; a spare copy catches up by
/// copying the slots that changed, so each event is applied once.
pub type IndexWriter = PooledWriter;
/// The index design in use (published, immutable, lock-free to read): one flat table.
pub type IndexSnapshot = FlatSnapshot;
