//! [`Writer`]: the single writer, generic over the snapshot design ([`Backend`]).
//!
//! Per pod the writer keeps a count of the blocks it holds (for the cap, exact) and a list of
//! the blocks it stored ([`PodBlocks`]), so clearing or replacing a pod costs O(its blocks), not a
//! scan of the map. The list is appended to when a store makes a new (block, pod) pair, which
//! costs nothing random (the map already said whether the pair is new); a removal leaves its
//! entry behind, stale, except that stale entries at the list's end are popped at once: first
//! whole removal calls (the [`Removed`] record: the pod's latest removal calls since it last
//! stored, whose blocks it therefore does not hold; a call whose blocks end the list, in order,
//! is popped with one comparison, as when chains are removed in the order stored), then one at
//! a time, the map asked about the last entry until it names a block the pod holds (blocks
//! stored last and removed first, whose slots are in cache). The list is compacted (stale entries and
//! repeats dropped, the map asked which blocks the pod still holds) once it is more than twice
//! the count plus [`SLACK`], so it never exceeds that. Every change to the shared map goes through the
//! [`Backend`]; [`Writer::publish`] makes everything applied so far visible to readers at once
//! (a reader never sees half a batch, nor half a resync).
//!
//! Invariants: `entries` = Σ pod counts = (block, pod) pairs in the map; `nodes` = blocks with at
//! least one pod; no pod holds more than `max_blocks_per_pod` blocks; a pod's list holds every
//! block it holds (and maybe others), at most 2 × count + [`SLACK`] entries.

use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;

use hashbrown::HashSet;

use crate::hasher::MixBuild;
use crate::types::{IndexStats, PodChanges, PodIdx};

/// Stale list entries allowed on top of the count before compacting (see the module docs).
const SLACK: usize = 1024;
/// Blocks whose slots are loaded ahead together while compacting.
const STRETCH: usize = 32;
/// Most blocks the [`Removed`] record keeps (8 bytes each).
const REMOVED_MAX: usize = 8192;

/// The latest removal calls of one pod since it last stored (or was cleared), each call's blocks
/// in its order: none of them is held by that pod. Lets [`Writer::remove`] pop a call's blocks
/// off the end of the pod's list by comparing them, instead of asking the map about each.
#[derive(Debug, Default)]
struct Removed {
    pod: Option<PodIdx>,
    blocks: Vec<u64>,
    /// End of each call's blocks in `blocks`.
    ends: Vec<usize>,
}

impl Removed {
    fn forget(&mut self) {
        self.pod = None;
        self.blocks.clear();
        self.ends.clear();
    }

    /// Records that `pod` no longer holds `gone` (one removal call).
    fn record(&mut self, pod: PodIdx, gone: &[BlockHash]) {
        if self.pod != Some(pod) || self.blocks.len() + gone.len() > REMOVED_MAX {
            self.forget();
        }
        if !gone.is_empty() && gone.len() <= REMOVED_MAX {
            self.pod = Some(pod);
            self.blocks.extend(gone.iter().map(|b| b.0));
            self.ends.push(self.blocks.len());
        }
    }

    /// Pops off the end of `list` (pod `pod`'s) every recorded call that ends it, in the call's
    /// order or reversed (a chain removed tail first), latest call first.
    fn pop_from(&mut self, pod: PodIdx, list: &mut Vec<u64>) {
        if self.pod != Some(pod) {
            return;
        }
        while let Some(&end) = self.ends.last() {
            let start = self.ends.len().checked_sub(2).map_or(0, |i| self.ends[i]);
            let call = &self.blocks[start..end];
            let Some(tail) = list.len().checked_sub(call.len()).and_then(|at| list.get(at..)) else {
                break;
            };
            if tail != call && !tail.iter().eq(call.iter().rev()) {
                break;
            }
            list.truncate(list.len() - call.len());
            self.blocks.truncate(start);
            self.ends.pop();
        }
    }
}

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
    /// Whether `pod` holds `block` (in the working copy).
    fn holds(&self, pod: PodIdx, block: u64) -> bool;
    /// A hint before [`Backend::holds`] on `blocks`: start loading what it will read.
    fn touch(&self, _blocks: &[BlockHash]) {}
    /// After a store call linked some of `blocks` (the call's blocks, in its order): lets the
    /// design group them (the flat snapshot makes runs). Changes no (block, pod) pair.
    fn seal(&mut self, _blocks: &[BlockHash]) {}
    /// One store call: links `pod` to `blocks` in order until `room` new pairs were made, pushing
    /// each block that became a new pair onto `linked`; the blocks after that are dropped
    /// (counted) unless `pod` holds them already; then [`Backend::seal`]s `blocks` if anything
    /// was linked. Returns (new blocks, dropped over the cap).
    fn store(&mut self, pod: PodIdx, blocks: &[BlockHash], room: usize, linked: &mut Vec<u64>) -> (u64, u64) {
        let (mut nodes, mut dropped, mut room, start) = (0, 0, room, linked.len());
        for b in blocks {
            if room == 0 {
                dropped += u64::from(!self.holds(pod, b.0));
                continue;
            }
            let (new_node, new_entry) = self.link(pod, b.0);
            nodes += u64::from(new_node);
            if new_entry {
                linked.push(b.0);
                room -= 1;
            }
        }
        if linked.len() > start {
            self.seal(blocks);
        }
        (nodes, dropped)
    }
    /// Unlinks `pod` from each of `blocks` it holds; returns (pairs removed, blocks gone).
    fn remove(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> (u64, u64) {
        let (mut removed, mut gone) = (0, 0);
        for b in blocks {
            let (r, g) = self.unlink(pod, b.0);
            removed += u64::from(r);
            gone += u64::from(g);
        }
        (removed, gone)
    }
    /// Makes every change so far visible to readers, with `stats` and `changes`; returns false
    /// when there was nothing to publish (no change, same stats).
    fn publish(&mut self, stats: IndexStats, changes: &PodChanges) -> bool;
    /// Heap bytes of the shared map(s), estimated from capacities.
    fn map_bytes(&self) -> u64;
}

/// What the writer keeps per pod. See the module docs.
#[derive(Clone, Debug, Default)]
struct PodBlocks {
    /// Every block the pod holds, plus stale entries (removed since) and repeats.
    list: Vec<u64>,
    /// Blocks the pod holds.
    held: usize,
}

/// The single writer. Owned by one thread (the pool's writer); readers only see snapshots.
#[derive(Debug)]
pub struct Writer<B: Backend> {
    backend: B,
    /// Per pod (by `PodIdx`).
    pods: Vec<PodBlocks>,
    /// Scratch: blocks seen while compacting (empty between calls).
    seen: HashSet<u64, MixBuild>,
    removed: Removed,
    max_blocks_per_pod: usize,
    nodes: u64,
    entries: u64,
    dropped_over_cap: u64,
    /// The pods whose blocks changed, by generation (see [`PodChanges`]).
    changes: PodChanges,
}

impl<B: Backend> Writer<B> {
    /// A writer publishing into `published`; each pod may hold at most `max_blocks_per_pod` blocks
    /// (a misbehaving agent cannot grow the index past pods × cap entries).
    pub fn new(published: Arc<ArcSwap<B::Snapshot>>, max_blocks_per_pod: usize) -> Self {
        Writer {
            backend: B::new(published),
            pods: Vec::new(),
            seen: HashSet::default(),
            removed: Removed::default(),
            max_blocks_per_pod,
            nodes: 0,
            entries: 0,
            dropped_over_cap: 0,
            changes: PodChanges::for_new_writer(),
        }
    }

    /// The snapshot design's writer side (for its own counters, e.g. [`crate::PooledBackend::copies`]).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Number of blocks `pod` holds in the working copy (the per-pod entry count metric).
    pub fn pod_blocks(&self, pod: PodIdx) -> u64 {
        self.pods.get(pod.as_usize()).map_or(0, |p| p.held as u64)
    }

    /// Records that `pod` holds `blocks`. Blocks over the pod's cap are dropped and counted.
    /// Returns how many were dropped.
    pub fn store(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        let i = pod.as_usize();
        if i >= self.pods.len() {
            self.pods.resize_with(i + 1, PodBlocks::default);
        }
        if self.removed.pod == Some(pod) {
            // The pod may hold some of the recorded blocks again.
            self.removed.forget();
        }
        let p = &mut self.pods[i];
        let room = self.max_blocks_per_pod.saturating_sub(p.held);
        let before = p.list.len();
        let (new_nodes, dropped) = self.backend.store(pod, blocks, room, &mut p.list);
        let new_entries = p.list.len() - before;
        if new_entries > 0 {
            self.changes.mark(pod);
        }
        p.held += new_entries;
        self.nodes += new_nodes;
        self.entries += new_entries as u64;
        self.dropped_over_cap += dropped;
        dropped
    }

    /// Records that `pod` no longer holds `blocks` (unknown blocks are ignored).
    pub fn remove(&mut self, pod: PodIdx, blocks: &[BlockHash]) {
        let Writer { backend, pods, removed: record, .. } = self;
        let Some(p) = pods.get_mut(pod.as_usize()) else {
            return;
        };
        let (removed, gone) = backend.remove(pod, blocks);
        if removed > 0 {
            self.changes.mark(pod);
        }
        p.held -= removed as usize;
        self.entries -= removed;
        self.nodes -= gone;
        record.record(pod, blocks);
        if removed > 0 {
            // Stale entries at the list's end go at once: the blocks a pod stored last are
            // often the first it removes (a request's blocks freed soon after), and their slots,
            // just changed, are in cache; compacting would probe each twice, cold. Whole
            // removal calls first, by comparison; then entry by entry, asking the map.
            record.pop_from(pod, &mut p.list);
            while p.list.last().is_some_and(|&b| !backend.holds(pod, b)) {
                p.list.pop();
            }
        }
        if p.list.len() > 2 * p.held + SLACK {
            self.compact(pod);
        }
    }

    /// Drops the stale entries and repeats from `pod`'s list: afterwards it lists exactly the
    /// blocks the pod holds.
    fn compact(&mut self, pod: PodIdx) {
        let Writer { backend, pods, seen, .. } = self;
        let Some(p) = pods.get_mut(pod.as_usize()) else {
            return;
        };
        // Sized once for the pod's blocks: filling it from empty rehashed it several times.
        seen.reserve(p.held);
        let mut stretch = [BlockHash(0); STRETCH];
        let mut kept = 0;
        for at in (0..p.list.len()).step_by(STRETCH) {
            let end = p.list.len().min(at + STRETCH);
            let n = end - at;
            for (d, h) in stretch.iter_mut().zip(&p.list[at..end]) {
                *d = BlockHash(*h);
            }
            backend.touch(&stretch[..n]);
            for b in &stretch[..n] {
                if backend.holds(pod, b.0) && seen.insert(b.0) {
                    p.list[kept] = b.0;
                    kept += 1;
                }
            }
        }
        p.list.truncate(kept);
        if p.list.capacity() > 2 * kept + SLACK {
            p.list.shrink_to(kept + SLACK);
        }
        seen.clear();
        seen.shrink_to(SLACK);
    }

    /// Removes every block of `pod`.
    pub fn clear_pod(&mut self, pod: PodIdx) {
        let Some(p) = self.pods.get_mut(pod.as_usize()) else {
            return;
        };
        let old = std::mem::take(p);
        if self.removed.pod == Some(pod) {
            self.removed.forget();
        }
        let blocks: Vec<BlockHash> = old.list.into_iter().map(BlockHash).collect();
        let (removed, gone) = self.backend.remove(pod, &blocks);
        if removed > 0 {
            self.changes.mark(pod);
        }
        self.entries -= removed;
        self.nodes -= gone;
    }

    /// Replaces `pod`'s whole block set with `blocks` (visible atomically at the next publish).
    /// Only the difference touches the shared map. Returns blocks dropped over the cap.
    pub fn replace_pod(&mut self, pod: PodIdx, blocks: &[BlockHash]) -> u64 {
        if let Some(p) = self.pods.get(pod.as_usize()).filter(|p| !p.list.is_empty()) {
            let new: HashSet<u64, MixBuild> = blocks.iter().map(|b| b.0).collect();
            // Unlink what goes (the list may repeat a block or name one gone: `remove` skips
            // what the pod does not hold), then store the call (what stays is not re-linked;
            // the cap applies to the total).
            let stale: Vec<BlockHash> = p.list.iter().filter(|h| !new.contains(*h)).map(|h| BlockHash(*h)).collect();
            self.remove(pod, &stale);
        }
        self.store(pod, blocks)
    }

    /// Forgets `pod` entirely (its id may be reused afterwards).
    pub fn drop_pod(&mut self, pod: PodIdx) {
        self.clear_pod(pod);
    }

    /// Current size figures of the working copy.
    pub fn stats(&self) -> IndexStats {
        let pod_bytes: u64 = self.pods.iter().map(|p| (p.list.capacity() * size_of::<u64>()) as u64).sum::<u64>()
            + ((self.removed.blocks.capacity() + self.removed.ends.capacity()) * size_of::<u64>()) as u64;
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
        self.changes.generation += 1;
        if !self.backend.publish(stats, &self.changes) {
            self.changes.generation -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};

    use super::*;
    use crate::{FlatSnapshot, PooledBackend};

    /// Churn on a few pods (stores, removes, re-stores of removed blocks, resyncs) long enough
    /// that lists compact many times: counts stay exact, every held block stays listed, a list
    /// never exceeds 2 × count + SLACK, and clearing a pod from its list empties it.
    #[test]
    fn pod_lists_stay_exact_and_bounded_under_churn() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut w = Writer::<PooledBackend>::new(published, 2000);
        let mut model: HashMap<u16, BTreeSet<u64>> = HashMap::new();
        let mut rand = crate::test_rng(0x2545_F491_4F6C_DD1D_u64);
        let (mut compactions, mut dropped) = (0, 0);
        for step in 0..3000 {
            let pod = rand(3) as u16;
            let n = 1 + rand(64) as usize;
            let blocks: Vec<BlockHash> = (0..n).map(|_| BlockHash(1 + rand(4000))).collect();
            let held = model.entry(pod).or_default();
            match rand(1000) {
                0..=499 => {
                    let mut want_dropped = 0;
                    for b in &blocks {
                        if held.len() < 2000 {
                            held.insert(b.0);
                        } else if !held.contains(&b.0) {
                            want_dropped += 1;
                        }
                    }
                    assert_eq!(w.store(PodIdx(pod), &blocks), want_dropped);
                    dropped += want_dropped;
                }
                500..=996 => {
                    for b in &blocks {
                        held.remove(&b.0);
                    }
                    let len = |w: &Writer<PooledBackend>| w.pods.get(usize::from(pod)).map_or(0, |p| p.list.len());
                    let before = len(&w);
                    w.remove(PodIdx(pod), &blocks);
                    compactions += usize::from(len(&w) < before);
                }
                997 | 998 => {
                    held.clear();
                    held.extend(blocks.iter().take(2000).map(|b| b.0));
                    w.replace_pod(PodIdx(pod), &blocks);
                }
                _ => {
                    held.clear();
                    w.clear_pod(PodIdx(pod));
                }
            }
            if step % 8 != 0 {
                continue;
            }
            for (p, held) in &model {
                let list = w.pods.get(usize::from(*p)).map_or(&[][..], |p| &p.list[..]);
                assert_eq!(w.pod_blocks(PodIdx(*p)), held.len() as u64, "pod {p} count at step {step}");
                assert!(list.len() <= 2 * held.len() + SLACK, "pod {p} list {} for {} held", list.len(), held.len());
                let listed: BTreeSet<u64> = list.iter().copied().collect();
                assert!(held.is_subset(&listed), "pod {p} lost a held block from its list at step {step}");
            }
            assert_eq!(w.stats().entries, model.values().map(|s| s.len() as u64).sum::<u64>());
        }
        let lens: Vec<(usize, usize)> = w.pods.iter().map(|p| (p.list.len(), p.held)).collect();
        assert!(compactions >= 3, "lists compacted {compactions} times; (list, held): {lens:?}");
        assert!(dropped > 0, "the cap was reached");
        for p in 0..3u16 {
            w.clear_pod(PodIdx(p));
        }
        assert_eq!((w.stats().entries, w.stats().nodes), (0, 0));
    }

    /// Chains stored and removed on a few pods in the patterns the removal record serves (in the
    /// order stored, in reverse, tails, chains stored again after their removal, the same blocks
    /// on other pods, resyncs): every held block stays listed, counts stay exact, and the record
    /// popped whole calls.
    #[test]
    fn the_removal_record_never_unlists_a_held_block() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut w = Writer::<PooledBackend>::new(published, usize::MAX);
        let mut model: HashMap<u16, BTreeSet<u64>> = HashMap::new();
        let mut rand = crate::test_rng(0x0DDB_1A5E_5BAD_5EED_u64);
        // 40 chains of 1..=24 blocks over a small universe: chains share blocks now and then.
        let chains: Vec<Vec<BlockHash>> =
            (0..40).map(|c| (0..1 + rand(24)).map(|k| BlockHash(1 + (c * 7 + k) % 200)).collect()).collect();
        let (mut popped_by_record, mut pod) = (0, 0u16);
        // Per pod, the chains stored since (by index), so removals can follow the stores' order.
        let mut recent: HashMap<u16, Vec<usize>> = HashMap::new();
        for step in 0..6000 {
            // Mostly the same pod as the step before (an agent's batch), now and then another.
            if rand(5) == 0 {
                pod = rand(3) as u16;
            }
            let held = model.entry(pod).or_default();
            let stored = recent.entry(pod).or_default();
            match rand(10) {
                0..=3 => {
                    let i = rand(chains.len() as u64) as usize;
                    held.extend(chains[i].iter().map(|b| b.0));
                    w.store(PodIdx(pod), &chains[i]);
                    stored.push(i);
                }
                4..=8 => {
                    let any = rand(chains.len() as u64) as usize;
                    let part: Vec<BlockHash> = match rand(4) {
                        // The oldest chain stored since (in the order stored), or the latest.
                        0 if !stored.is_empty() => chains[stored.remove(0)].clone(),
                        1 => chains[stored.pop().unwrap_or(any)].clone(),
                        2 => chains[any].iter().rev().copied().collect(),
                        _ => chains[any][rand(chains[any].len() as u64) as usize..].to_vec(),
                    };
                    for b in &part {
                        held.remove(&b.0);
                    }
                    // Kept record (same pod, room): it grows by this call unless calls were popped.
                    let kept = w.removed.pod == Some(PodIdx(pod)) && w.removed.blocks.len() + part.len() <= REMOVED_MAX;
                    let calls = if kept { w.removed.ends.len() } else { 0 };
                    w.remove(PodIdx(pod), &part);
                    popped_by_record += usize::from(w.removed.ends.len() <= calls);
                }
                _ => {
                    let i = rand(chains.len() as u64) as usize;
                    held.clear();
                    held.extend(chains[i].iter().map(|b| b.0));
                    w.replace_pod(PodIdx(pod), &chains[i]);
                    stored.clear();
                    stored.push(i);
                }
            }
            for (p, held) in &model {
                let list = w.pods.get(usize::from(*p)).map_or(&[][..], |p| &p.list[..]);
                assert_eq!(w.pod_blocks(PodIdx(*p)), held.len() as u64, "pod {p} count at step {step}");
                let listed: BTreeSet<u64> = list.iter().copied().collect();
                assert!(held.is_subset(&listed), "pod {p} lost a held block from its list at step {step}");
            }
        }
        assert!(popped_by_record > 100, "the record popped {popped_by_record} calls");
        for p in 0..3u16 {
            w.clear_pod(PodIdx(p));
        }
        assert_eq!((w.stats().entries, w.stats().nodes), (0, 0));
    }

    /// Stale entries at a list's end are popped at once: chains removed in the order stored
    /// (or in reverse) leave the list as it was before they were stored; a removal in the
    /// middle leaves its entries (stale) until the chains after them go too.
    #[test]
    fn removing_the_last_stored_blocks_shortens_the_list() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut w = Writer::<PooledBackend>::new(published, usize::MAX);
        let chain = |c: u64| (0..16).map(|k| BlockHash(1 + c * 100 + k)).collect::<Vec<_>>();
        let pod = PodIdx(0);
        let len = |w: &Writer<PooledBackend>| w.pods[0].list.len();
        w.store(pod, &chain(0));
        for c in 1..4 {
            w.store(pod, &chain(c));
        }
        assert_eq!(len(&w), 64);
        w.remove(pod, &chain(2));
        assert_eq!(len(&w), 64, "chain 3, stored after chain 2, is still held");
        w.remove(pod, &chain(3));
        assert_eq!(len(&w), 32, "chains 3 and 2 both went");
        w.store(pod, &chain(1));
        assert_eq!(len(&w), 32, "chain 1 was held already: nothing appended");
        w.remove(pod, &chain(1));
        assert_eq!((len(&w), w.pod_blocks(pod)), (16, 16));
        w.remove(pod, &chain(0)[..8]);
        assert_eq!(len(&w), 16, "the list's end (chain 0's last blocks) is still held");
        w.remove(pod, &chain(0)[8..]);
        assert_eq!((len(&w), w.pod_blocks(pod)), (0, 0));
        // Chains removed tail first (each call's blocks reversed), latest chain first: popped
        // (by the record, else by asking the map) all the same.
        w.store(pod, &chain(7));
        w.store(pod, &chain(8));
        for c in [8, 7] {
            let reversed: Vec<BlockHash> = chain(c).into_iter().rev().collect();
            w.remove(pod, &reversed);
        }
        assert_eq!(len(&w), 0, "both chains popped");
        // A removal call is recorded even when the pod held none of its blocks; a store then
        // makes the record forget them (the pod holds them again), so popping the next calls
        // stops at them.
        w.remove(pod, &chain(5));
        w.store(pod, &chain(5));
        w.store(pod, &chain(6));
        w.remove(pod, &chain(6));
        assert_eq!((len(&w), w.pod_blocks(pod)), (16, 16), "chain 5 is held and listed");
    }

    /// A snapshot says which pods' blocks changed since a stamp: each store, removal or clear
    /// that changes a pod marks it in the next published generation; one that changes nothing
    /// marks nothing. Another writer's
    /// stamps never pass for current.
    #[test]
    fn snapshots_tell_which_pods_changed_since_a_stamp() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut w = Writer::<PooledBackend>::new(published.clone(), 100);
        let (a, b) = (PodIdx(0), PodIdx(3));
        let blocks = |x: u64| (x..x + 4).map(BlockHash).collect::<Vec<_>>();
        w.store(a, &blocks(1));
        w.publish();
        let first = published.load().changes().clone();
        assert_eq!((first.stamp().generation, first.changed_at(a), first.changed_at(b)), (1, 1, 0));
        // Stored again: no change to the pod.
        w.store(a, &blocks(1));
        w.publish();
        assert!(published.load().changes().unchanged_since(a, first.stamp()));
        w.store(b, &blocks(10));
        w.publish();
        let second = published.load().changes().clone();
        assert!(second.stamp().generation > first.stamp().generation);
        assert!(second.unchanged_since(a, first.stamp()) && !second.unchanged_since(b, first.stamp()));
        // Removing blocks the pod does not hold changes nothing; removing one it holds does.
        w.remove(a, &blocks(100));
        w.store(b, &blocks(20));
        w.publish();
        let third = published.load().changes().clone();
        assert!(third.unchanged_since(a, first.stamp()) && !third.unchanged_since(b, second.stamp()));
        w.remove(a, &blocks(1)[..1]);
        w.publish();
        assert!(!published.load().changes().unchanged_since(a, third.stamp()));
        w.clear_pod(b);
        w.publish();
        let cleared = published.load().changes().clone();
        assert!(!cleared.unchanged_since(b, third.stamp()));
        // A stamp from later than the snapshot, or from another writer, is not current.
        assert!(!first.unchanged_since(a, third.stamp()));
        let other = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut w2 = Writer::<PooledBackend>::new(other.clone(), 100);
        w2.store(a, &blocks(1));
        w2.publish();
        assert!(!other.load().changes().unchanged_since(PodIdx(9), cleared.stamp()));
    }
}
