//! Sharded copy-on-write index: [`SHARDS`] hash maps, each behind an `Arc`.
//!
//! The writer keeps the current shards; a mutation calls `Arc::make_mut` on the one shard it
//! touches, which clones that shard only if a published snapshot still shares it (so a batch
//! copies each touched shard at most once). [`ShardedWriter::publish`] clones the 64 `Arc`s into a
//! new [`ShardedSnapshot`] and stores it in the shared `ArcSwap`. Readers never lock.
//!
//! The writer also keeps, per pod, the set of blocks it holds, so clearing/replacing a pod costs
//! O(its blocks) and the per-pod cap is exact. Keys are already uniform 64-bit hashes: the maps use
//! a one-multiply hasher; the shard is chosen from different bits than the map's bucket bits.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use arc_swap::ArcSwap;
use hashbrown::{HashMap, HashSet};
use kvroute_common::BlockHash;

use super::{IndexStats, MatchScratch, PodIdx, PodSet};

/// Number of copy-on-write shards.
pub const SHARDS: usize = 64;

/// Cheap hasher for keys that are already hashes: one multiply + fold (Fibonacci hashing).
#[derive(Clone, Copy, Debug, Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        let m = u128::from(v) * 0x9E37_79B9_7F4A_7C15_u128;
        // Truncations are the point: fold the 128-bit product into 64 bits.
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

/// `BuildHasher` for [`MixHasher`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MixBuild;

impl BuildHasher for MixBuild {
    type Hasher = MixHasher;
    #[inline]
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

type Shard = HashMap<u64, PodSet, MixBuild>;

#[inline]
fn shard_of(h: u64) -> usize {
    // Bits 40..46 of the raw hash: independent of the mixed bits the map buckets on.
    ((h >> 40) as usize) & (SHARDS - 1)
}

/// Published, immutable index state. Cheap to clone (64 `Arc`s).
#[derive(Clone, Debug)]
pub struct ShardedSnapshot {
    shards: Vec<Arc<Shard>>,
    stats: IndexStats,
}

impl Default for ShardedSnapshot {
    fn default() -> Self {
        ShardedSnapshot {
            shards: (0..SHARDS).map(|_| Arc::new(Shard::default())).collect(),
            stats: IndexStats::default(),
        }
    }
}

impl ShardedSnapshot {
    /// Pods holding `block` (sorted), empty when none.
    #[inline]
    pub fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        match self.shards.get(shard_of(block.0)).and_then(|s| s.get(&block.0)) {
            Some(set) => set.as_slice(),
            None => &[],
        }
    }

    /// Walks `chain` from block 0 and records, per pod, how many consecutive blocks from the start
    /// it holds (SPEC §2 match ratio numerator). Stops at the first block no remaining pod holds.
    /// Results are read from `scratch` ([`MatchScratch::matched`]); returns the longest match.
    pub fn match_prefix(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        scratch.reset();
        let Some(first) = chain.first() else {
            return 0;
        };
        scratch.active.extend_from_slice(self.pods_of(*first));
        if scratch.active.is_empty() {
            return 0;
        }
        let mut depth: u32 = 1;
        for block in &chain[1..] {
            let holders = self.pods_of(*block);
            // Sorted-merge intersection of `active` with `holders` into `next`.
            scratch.next.clear();
            let (mut i, mut j) = (0, 0);
            while i < scratch.active.len() && j < holders.len() {
                let (a, h) = (scratch.active[i], holders[j]);
                if a == h {
                    scratch.next.push(a);
                    i += 1;
                    j += 1;
                } else if a < h {
                    // `a` stops matching here: its count is `depth`.
                    let d = depth;
                    scratch.set(a, d);
                    i += 1;
                } else {
                    j += 1;
                }
            }
            while i < scratch.active.len() {
                let (a, d) = (scratch.active[i], depth);
                scratch.set(a, d);
                i += 1;
            }
            std::mem::swap(&mut scratch.active, &mut scratch.next);
            if scratch.active.is_empty() {
                return depth;
            }
            depth += 1;
        }
        let active = std::mem::take(&mut scratch.active);
        for &a in &active {
            scratch.set(a, depth);
        }
        scratch.active = active;
        depth
    }

    /// Size figures as of this snapshot.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }
}

/// The single writer. Not `Sync`-shared: owned by one thread.
#[derive(Debug)]
pub struct ShardedWriter {
    shards: Vec<Arc<Shard>>,
    /// Per pod (by `PodIdx`): the blocks it holds.
    pod_blocks: Vec<HashSet<u64, MixBuild>>,
    max_blocks_per_pod: usize,
    nodes: u64,
    entries: u64,
    dropped_over_cap: u64,
    published: Arc<ArcSwap<ShardedSnapshot>>,
}

impl ShardedWriter {
    /// A writer publishing into `published`; each pod may hold at most `max_blocks_per_pod` blocks.
    pub fn new(published: Arc<ArcSwap<ShardedSnapshot>>, max_blocks_per_pod: usize) -> ShardedWriter {
        ShardedWriter {
            shards: (0..SHARDS).map(|_| Arc::new(Shard::default())).collect(),
            pod_blocks: Vec::new(),
            max_blocks_per_pod,
            nodes: 0,
            entries: 0,
            dropped_over_cap: 0,
            published,
        }
    }

    fn pod_set(&mut self, pod: PodIdx) -> &mut HashSet<u64, MixBuild> {
        let i = pod.as_usize();
        if i >= self.pod_blocks.len() {
            self.pod_blocks.resize_with(i + 1, HashSet::default);
        }
        &mut self.pod_blocks[i]
    }

    /// Number of blocks `pod` holds in the working copy.
    pub fn pod_blocks(&self, pod: PodIdx) -> u64 {
        self.pod_blocks.get(pod.as_usize()).map_or(0, |s| s.len() as u64)
    }

    /// Records that `pod` holds `blocks`. Blocks over the pod's cap are dropped and counted.
    /// Returns how many were dropped.
    pub fn store(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        let cap = self.max_blocks_per_pod;
        let mut dropped = 0;
        for b in blocks {
            let set = self.pod_set(pod);
            if set.contains(&b.0) {
                continue;
            }
            if set.len() >= cap {
                dropped += 1;
                continue;
            }
            set.insert(b.0);
            let shard = Arc::make_mut(&mut self.shards[shard_of(b.0)]);
            let e = shard.entry(b.0).or_default();
            if e.is_empty() {
                self.nodes += 1;
            }
            if e.insert(pod) {
                self.entries += 1;
            }
        }
        self.dropped_over_cap += dropped;
        dropped
    }

    fn unlink(&mut self, pod: PodIdx, h: u64) {
        let shard = Arc::make_mut(&mut self.shards[shard_of(h)]);
        if let Some(set) = shard.get_mut(&h) {
            if set.remove(pod) {
                self.entries -= 1;
            }
            if set.is_empty() {
                shard.remove(&h);
                self.nodes -= 1;
            }
        }
    }

    /// Records that `pod` no longer holds `blocks` (unknown blocks are ignored).
    pub fn remove(&mut self, pod: PodIdx, blocks: &[BlockHash]) {
        for b in blocks {
            let held = self.pod_blocks.get_mut(pod.as_usize()).is_some_and(|s| s.remove(&b.0));
            if held {
                self.unlink(pod, b.0);
            }
        }
    }

    /// Removes every block of `pod`.
    pub fn clear_pod(&mut self, pod: PodIdx) {
        let Some(set) = self.pod_blocks.get_mut(pod.as_usize()) else {
            return;
        };
        let old = std::mem::take(set);
        for h in old {
            self.unlink(pod, h);
        }
    }

    /// Replaces `pod`'s whole block set with `blocks` (visible atomically at the next publish).
    /// Only the difference touches the shards. Returns blocks dropped over the cap.
    pub fn replace_pod(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        let mut new: HashSet<u64, MixBuild> = HashSet::with_capacity_and_hasher(blocks.len(), MixBuild);
        new.extend(blocks.iter().map(|b| b.0));
        let old = std::mem::take(self.pod_set(pod));
        let stale: Vec<u64> = old.iter().copied().filter(|h| !new.contains(h)).collect();
        // Keep what stays, unlink what goes, then store the rest (cap applies to the new total).
        let mut kept = old;
        for h in &stale {
            kept.remove(h);
            self.unlink(pod, *h);
        }
        *self.pod_set(pod) = kept;
        let fresh: Vec<BlockHash> = blocks.iter().copied().filter(|b| !self.pod_set(pod).contains(&b.0)).collect();
        self.store(pod, &fresh)
    }

    /// Forgets `pod` entirely (its id may be reused afterwards).
    pub fn drop_pod(&mut self, pod: PodIdx) {
        self.clear_pod(pod);
        if let Some(s) = self.pod_blocks.get_mut(pod.as_usize()) {
            *s = HashSet::default();
        }
    }

    /// Current size figures of the working copy.
    pub fn stats(&self) -> IndexStats {
        // Map slot: 8-byte key + 16-byte PodSet + 1 control byte, at ~7/8 load; per-pod set slot:
        // 8 bytes + 1 control byte at ~7/8 load. Heap-spilled sets are rare and not counted.
        let map_bytes: u64 = self.shards.iter().map(|s| s.capacity() as u64 * 25).sum();
        let pod_bytes: u64 = self.pod_blocks.iter().map(|s| s.capacity() as u64 * 9).sum();
        IndexStats {
            nodes: self.nodes,
            entries: self.entries,
            bytes_estimate: map_bytes + pod_bytes,
            dropped_over_cap: self.dropped_over_cap,
        }
    }

    /// Publishes the working copy as the new snapshot readers see.
    pub fn publish(&mut self) {
        let snap = ShardedSnapshot { shards: self.shards.clone(), stats: self.stats() };
        self.published.store(Arc::new(snap));
    }
}
