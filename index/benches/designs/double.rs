//! Design B, double-buffered (left-right) with an op log: two full copies of one block map.
//!
//! Readers load the published copy through `arc-swap` and never lock. The writer mutates the
//! other copy (which it owns exclusively) and logs each primitive change. Publishing swaps the
//! writable copy in and takes the previously published one back; before the next write, once the
//! last reader has let go of it (`Arc::get_mut`), the writer replays the log onto it so both copies
//! agree again. Publishing therefore costs O(1) and writing O(changes), never O(index) — unlike
//! design A, whose batches of random blocks copy every shard.
//!
//! Readers leave a snapshot within one lookup (~1 µs), or one scheduler time slice when preempted
//! mid-lookup on an oversubscribed box. The writer waits for that (yields, then short sleeps) at
//! most [`kvroute_index::pool::RECLAIM_WAIT`], about the cost of copying a 1M-entry map; a reader that keeps an old
//! snapshot longer (a held `load_full()`) makes the writer deep-copy the current snapshot instead
//! (counted in [`DoubleBackend::clones`]), so a published snapshot is never mutated.
//! Cost: two copies of the map (about twice design A's map bytes per entry).

use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;
use kvroute_index::{Backend, BlockPods, IndexStats, MatchScratch, PodIdx, ReclaimWait, Writer, match_prefix};

use super::{BlockMap, LOG_KEEP_OPS, LogOp, SLOT_BYTES, map_link, map_unlink, replay};

/// Published, immutable index state: one block map.
#[derive(Clone, Debug, Default)]
pub struct DoubleSnapshot {
    pub map: BlockMap,
    pub stats: IndexStats,
}

impl BlockPods for DoubleSnapshot {
    #[inline]
    fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        match self.map.get(&block.0) {
            Some(set) => set.as_slice(),
            None => &[],
        }
    }
}

impl DoubleSnapshot {
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

/// Writer side of design B.
#[derive(Debug)]
pub struct DoubleBackend {
    /// The copy the writer owns (refcount 1). `None` between a publish and the next write.
    writable: Option<DoubleSnapshot>,
    /// The previously published copy, to reclaim and bring up to date before the next write.
    behind: Option<Arc<DoubleSnapshot>>,
    /// Changes in the published copy that `behind` lacks.
    log: Vec<LogOp>,
    published: Arc<ArcSwap<DoubleSnapshot>>,
    clones: u64,
}

impl DoubleBackend {
    /// Times a reader held an old snapshot so long that the writer copied the map instead.
    pub fn clones(&self) -> u64 {
        self.clones
    }

    fn writable(&mut self) -> &mut DoubleSnapshot {
        if self.writable.is_none() {
            let copy = match self.behind.take() {
                Some(behind) => self.reclaim(behind),
                None => DoubleSnapshot::clone(&self.published.load()),
            };
            self.writable = Some(copy);
        }
        self.writable.get_or_insert_with(DoubleSnapshot::default)
    }

    /// Gets exclusive use of `behind` and replays the log onto it; copies the published map when
    /// readers hold `behind` too long.
    fn reclaim(&mut self, mut behind: Arc<DoubleSnapshot>) -> DoubleSnapshot {
        let mut wait = ReclaimWait::default();
        loop {
            match Arc::try_unwrap(behind) {
                Ok(mut copy) => {
                    replay(&mut copy.map, &self.log);
                    self.log.clear();
                    // A resync or start-up batch can grow the log to the index size: give it back.
                    self.log.shrink_to(LOG_KEEP_OPS);
                    return copy;
                }
                Err(shared) => behind = shared,
            }
            if !wait.pause() {
                break;
            }
        }
        self.clones += 1;
        self.log.clear();
        DoubleSnapshot::clone(&self.published.load())
    }
}

impl Backend for DoubleBackend {
    type Snapshot = DoubleSnapshot;

    fn new(published: Arc<ArcSwap<DoubleSnapshot>>) -> Self {
        DoubleBackend { writable: None, behind: None, log: Vec::new(), published, clones: 0 }
    }

    fn holds(&self, pod: PodIdx, block: u64) -> bool {
        let held = |s: &DoubleSnapshot| s.map.get(&block).is_some_and(|set| set.as_slice().binary_search(&pod).is_ok());
        match &self.writable {
            Some(w) => held(w),
            None => held(&self.published.load()),
        }
    }

    #[inline]
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = map_link(&mut self.writable().map, pod, block);
        self.log.push(LogOp::Link(pod, block));
        r
    }

    #[inline]
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = map_unlink(&mut self.writable().map, pod, block);
        self.log.push(LogOp::Unlink(pod, block));
        r
    }

    fn publish(&mut self, stats: IndexStats) {
        if self.writable.is_none() {
            if self.published.load().stats == stats {
                return;
            }
            // Only the stats changed (e.g. stores dropped over the cap): republish them.
            self.writable();
        }
        let Some(mut snap) = self.writable.take() else {
            return;
        };
        snap.stats = stats;
        let old = self.published.swap(Arc::new(snap));
        self.behind = Some(old);
    }

    fn map_bytes(&self) -> u64 {
        let cap = match &self.writable {
            Some(w) => w.map.capacity(),
            None => self.published.load().map.capacity(),
        } as u64;
        2 * cap * SLOT_BYTES
    }
}

/// The single writer of design B.
pub type DoubleWriter = Writer<DoubleBackend>;
