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
//! Two snapshot designs share the writer logic ([`Writer`]) and the walk ([`match_prefix`]):
//! - [`sharded`] (design A): 64 copy-on-write shards (`Arc::make_mut`);
//! - [`double`] (design B): two copies of one map, left-right style, kept in step by an op log;
//! - [`pooled`] (design C): a pool of up to three copies of a snapshot, so the writer reuses
//!   whichever old copy no reader holds instead of waiting for one. Its snapshot type is a
//!   parameter: B's hashbrown map ([`DoubleSnapshot`], C as first built) or [`FlatSnapshot`]
//!   (module [`flat`]: one open-addressing table of 16-byte slots whose cache lines the walk
//!   fetches in parallel; C as used).
//!
//! `docs/index.md` records the benchmark that chose between them; the winner sits behind the
//! [`IndexWriter`]/[`IndexSnapshot`] aliases. This crate has no tokio/tonic dependency so its
//! tests and benches build fast.

pub mod double;
pub mod flat;
mod hasher;
mod podset;
pub mod pooled;
pub mod sharded;
mod walk;
mod writer;

pub use double::{DoubleBackend, DoubleSnapshot, DoubleWriter};
pub use flat::{FlatMap, FlatSnapshot};
pub use hasher::{MixBuild, MixHasher};
pub use podset::{INLINE_PODS, PodSet};
pub use pooled::{PoolMap, PooledBackend, PooledWriter};
pub use sharded::{SHARDS, ShardedBackend, ShardedSnapshot, ShardedWriter};
pub use walk::{BlockPods, match_prefix, walk_blocks};
pub use writer::{Backend, Writer};

/// Interned pod id on the hot path (index into the pool's pod table). At most 65 536 pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PodIdx(pub u16);

impl PodIdx {
    /// The id as a `usize`, for indexing dense per-pod arrays.
    #[inline]
    pub fn as_usize(self) -> usize {
        usize::from(self.0)
    }
}

/// The index design in use (writer side): design C over the flat table, chosen by
/// `benches/index.rs` (see `docs/index.md`): sub-µs publishes, and with readers running it
/// ingests about 10× faster than B because it never waits for a reader to leave an old copy;
/// the flat table makes a walk whose blocks are not in cache several times faster than B's map.
pub type IndexWriter = PooledWriter;
/// The index design in use (published, immutable, lock-free to read): one flat table.
pub type IndexSnapshot = FlatSnapshot;

/// Size of the index, for metrics (`epp_prefix_tree_nodes`) and `/explain`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block hashes held by at least one pod.
    pub nodes: u64,
    /// (block, pod) pairs.
    pub entries: u64,
    /// Rough heap size of the index in bytes (published map + the writer's per-pod sets).
    pub bytes_estimate: u64,
    /// Block stores dropped because the pod was at `max_blocks_per_pod` (since start).
    pub dropped_over_cap: u64,
}

/// Reusable per-caller buffers for [`IndexSnapshot::match_prefix`]; no allocation per lookup once
/// warmed up. Results: [`MatchScratch::matched`] per pod.
#[derive(Debug, Default)]
pub struct MatchScratch {
    /// Dense by `PodIdx`: consecutive matched blocks from the start of the chain.
    counts: Vec<u32>,
    /// Pods with a non-zero count (to reset `counts` cheaply).
    touched: Vec<PodIdx>,
    active: Vec<PodIdx>,
    next: Vec<PodIdx>,
}

impl MatchScratch {
    /// Consecutive blocks from the start of the last looked-up chain that `pod` holds.
    #[inline]
    pub fn matched(&self, pod: PodIdx) -> u32 {
        self.counts.get(pod.as_usize()).copied().unwrap_or(0)
    }

    /// Pods that matched at least one block in the last lookup (unordered).
    pub fn matched_pods(&self) -> &[PodIdx] {
        &self.touched
    }

    fn reset(&mut self) {
        for p in self.touched.drain(..) {
            if let Some(c) = self.counts.get_mut(p.as_usize()) {
                *c = 0;
            }
        }
        self.active.clear();
        self.next.clear();
    }

    fn set(&mut self, pod: PodIdx, count: u32) {
        let i = pod.as_usize();
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        if self.counts[i] == 0 {
            self.touched.push(pod);
        }
        self.counts[i] = count;
    }
}

#[cfg(test)]
mod difftest;
