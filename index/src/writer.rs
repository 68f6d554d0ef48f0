//! [`Writer`]: the single writer, generic over the snapshot design ([`Backend`]).
//!
//! The writer owns, per pod, the set of blocks it holds, so clearing/replacing a pod costs O(its
//! blocks) and the per-pod cap is exact. Every change to the shared map goes through
//! [`Backend::link`]/[`Backend::unlink`]; [`Writer::publish`] makes everything applied so far
//! visible to readers at once (a reader never sees half a batch, nor half a resync).
//!
//! Invariants: `entries` = Σ pod set sizes = (block, pod) pairs in the map; `nodes` = blocks with
//! at least one pod; no pod holds more than `max_blocks_per_pod` blocks.

use std::sync::Arc;

use arc_swap::ArcSwap;
use hashbrown::HashSet;
use kvroute_common::BlockHash;

use crate::hasher::MixBuild;
use crate::{IndexStats, PodIdx};

/// One snapshot design: how the shared block → pods map is mutated and published.
pub trait Backend {
    /// The immutable state readers load.
    type Snapshot;
    /// A backend publishing into `published` (whose current value it may reuse or replace).
    fn new(published: Arc<ArcSwap<Self::Snapshot>>) -> Self;
    /// Adds `pod` to `block`; returns (the block is new, the pair is new).
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool);
    /// Removes `pod` from `block`; returns (the pair was present, the block is now gone).
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool);
    /// After a store call linked some of `blocks` (the call's blocks, in its order): lets the
    /// design group them (the flat snapshot makes runs). Changes no (block, pod) pair.
    fn seal(&mut self, _blocks: &[BlockHash]) {}
    /// Makes every change so far visible to readers, with `stats`.
    fn publish(&mut self, stats: IndexStats);
    /// Heap bytes of the shared map(s), estimated from capacities.
    fn map_bytes(&self) -> u64;
}

/// The single writer. Owned by one thread (the pool's writer); readers only see snapshots.
#[derive(Debug)]
pub struct Writer<B: Backend> {
    backend: B,
    /// Per pod (by `PodIdx`): the blocks it holds.
    pod_blocks: Vec<HashSet<u64, MixBuild>>,
    max_blocks_per_pod: usize,
    nodes: u64,
    entries: u64,
    dropped_over_cap: u64,
}

impl<B: Backend> Writer<B> {
    /// A writer publishing into `published`; each pod may hold at most `max_blocks_per_pod` blocks
    /// (a misbehaving agent cannot grow the index past pods × cap entries).
    pub fn new(published: Arc<ArcSwap<B::Snapshot>>, max_blocks_per_pod: usize) -> Self {
        Writer {
            backend: B::new(published),
            pod_blocks: Vec::new(),
            max_blocks_per_pod,
            nodes: 0,
            entries: 0,
            dropped_over_cap: 0,
        }
    }

    fn pod_set(&mut self, pod: PodIdx) -> &mut HashSet<u64, MixBuild> {
        let i = pod.as_usize();
        if i >= self.pod_blocks.len() {
            self.pod_blocks.resize_with(i + 1, HashSet::default);
        }
        &mut self.pod_blocks[i]
    }

    /// The snapshot design's writer side (for its own counters, e.g. [`crate::DoubleBackend::clones`]).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Number of blocks `pod` holds in the working copy (the per-pod entry count metric).
    pub fn pod_blocks(&self, pod: PodIdx) -> u64 {
        self.pod_blocks.get(pod.as_usize()).map_or(0, |s| s.len() as u64)
    }

    fn link(&mut self, pod: PodIdx, h: u64) {
        let (new_node, new_entry) = self.backend.link(pod, h);
        self.nodes += u64::from(new_node);
        self.entries += u64::from(new_entry);
    }

    fn unlink(&mut self, pod: PodIdx, h: u64) {
        let (removed, node_gone) = self.backend.unlink(pod, h);
        self.entries -= u64::from(removed);
        self.nodes -= u64::from(node_gone);
    }

    /// Records that `pod` holds `blocks`. Blocks over the pod's cap are dropped and counted.
    /// Returns how many were dropped.
    pub fn store(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        let cap = self.max_blocks_per_pod;
        let mut dropped = 0;
        let mut linked = false;
        for b in blocks {
            let set = self.pod_set(pod);
            if set.len() >= cap {
                if !set.contains(&b.0) {
                    dropped += 1;
                }
                continue;
            }
            if set.insert(b.0) {
                self.link(pod, b.0);
                linked = true;
            }
        }
        if linked {
            self.backend.seal(blocks);
        }
        self.dropped_over_cap += dropped;
        dropped
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
    /// Only the difference touches the shared map. Returns blocks dropped over the cap.
    pub fn replace_pod(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        let mut new: HashSet<u64, MixBuild> = HashSet::with_capacity_and_hasher(blocks.len(), MixBuild);
        new.extend(blocks.iter().map(|b| b.0));
        let mut kept = std::mem::take(self.pod_set(pod));
        let stale: Vec<u64> = kept.iter().copied().filter(|h| !new.contains(h)).collect();
        // Keep what stays, unlink what goes, then store the rest (cap applies to the new total).
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
        // Per-pod set slot: 8-byte key + 1 control byte. Heap-spilled PodSets are rare, not counted.
        let pod_bytes: u64 = self.pod_blocks.iter().map(|s| s.capacity() as u64 * 9).sum();
        IndexStats {
            nodes: self.nodes,
            entries: self.entries,
            bytes_estimate: self.backend.map_bytes() + pod_bytes,
            dropped_over_cap: self.dropped_over_cap,
        }
    }

    /// Publishes the working copy as the new snapshot readers see.
    pub fn publish(&mut self) {
        let stats = self.stats();
        self.backend.publish(stats);
    }
}
