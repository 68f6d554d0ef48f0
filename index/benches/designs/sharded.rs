//! Design A, sharded copy-on-write: [`SHARDS`] block maps, each behind an `Arc`.
//!
//! A mutation calls `Arc::make_mut` on the one shard it touches, which clones that shard only if a
//! published snapshot still shares it (so a batch copies each touched shard at most once).
//! Publishing clones the 64 `Arc`s into a new [`ShardedSnapshot`] and stores it in the shared
//! `ArcSwap`. Readers never lock. Cost: a batch of random blocks touches every shard, so each
//! publish-then-write cycle copies the whole map (see `docs/index.md` for the measurement).
//! The shard is chosen from different bits than the map's bucket bits.

use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;

use kvroute_index::{Backend, BlockPods, IndexStats, MatchScratch, PodIdx, Writer, match_prefix};

use super::{BlockMap, SLOT_BYTES, map_link, map_unlink};

/// Number of copy-on-write shards.
pub const SHARDS: usize = 64;

#[inline]
fn shard_of(h: u64) -> usize {
    // Bits 40..46 of the raw hash: independent of the mixed bits the map buckets on.
    ((h >> 40) as usize) & (SHARDS - 1)
}

/// Published, immutable index state. Cheap to clone (64 `Arc`s).
#[derive(Clone, Debug)]
pub struct ShardedSnapshot {
    shards: Vec<Arc<BlockMap>>,
    stats: IndexStats,
}

impl Default for ShardedSnapshot {
    fn default() -> Self {
        ShardedSnapshot {
            shards: (0..SHARDS).map(|_| Arc::new(BlockMap::default())).collect(),
            stats: IndexStats::default(),
        }
    }
}

impl BlockPods for ShardedSnapshot {
    #[inline]
    fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        match self.shards.get(shard_of(block.0)).and_then(|s| s.get(&block.0)) {
            Some(set) => set.as_slice(),
            None => &[],
        }
    }
}

impl ShardedSnapshot {
    /// Pods holding `block` (sorted), empty when none.
    #[inline]
    pub fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        BlockPods::pods_of(self, block)
    }

    /// The prefix walk ([`match_prefix`]): per-pod consecutive matched blocks into `scratch`;
    /// returns the longest match.
    pub fn match_prefix(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        match_prefix(self, chain, scratch)
    }

    /// Size figures as of this snapshot.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }
}

/// Writer side of design A: the current shards (shared with the last snapshot until touched).
#[derive(Debug)]
pub struct ShardedBackend {
    shards: Vec<Arc<BlockMap>>,
    published: Arc<ArcSwap<ShardedSnapshot>>,
}

impl Backend for ShardedBackend {
    type Snapshot = ShardedSnapshot;

    fn new(published: Arc<ArcSwap<ShardedSnapshot>>) -> Self {
        ShardedBackend { shards: (0..SHARDS).map(|_| Arc::new(BlockMap::default())).collect(), published }
    }

    fn holds(&self, pod: PodIdx, block: u64) -> bool {
        self.shards[shard_of(block)].get(&block).is_some_and(|set| set.as_slice().binary_search(&pod).is_ok())
    }

    #[inline]
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        map_link(Arc::make_mut(&mut self.shards[shard_of(block)]), pod, block)
    }

    #[inline]
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        map_unlink(Arc::make_mut(&mut self.shards[shard_of(block)]), pod, block)
    }

    fn publish(&mut self, stats: IndexStats) {
        self.published.store(Arc::new(ShardedSnapshot { shards: self.shards.clone(), stats }));
    }

    fn map_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.capacity() as u64 * SLOT_BYTES).sum()
    }
}

/// The single writer of design A.
pub type ShardedWriter = Writer<ShardedBackend>;
