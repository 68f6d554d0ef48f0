//! [`FlatSnapshot`]: the block map as one open-addressing table of 16-byte slots, pod sets
//! interned, and *runs*: consecutive blocks stored together with the same pods, kept contiguous
//! so a walk verifies them by comparing hashes in sequence instead of probing each one.
//!
//! Why: a hashbrown probe reads a control-byte group, then a bucket whose address depends on it,
//! in another region: two dependent DRAM misses per block when the map is cold (27.8 µs p99 for a
//! cold 256-block walk). Here a slot is 16 bytes (key, interned pod-set id, run reference; four
//! per cache line, none straddling two), and a chain the index received in one
//! [`crate::Writer::store`] call is also kept as a run: the walk probes the first block, finds
//! (run, offset) in its slot, and compares the request's following hashes with the run's
//! (2 KB for 256 blocks, read sequentially) — one random access per run instead of per block.
//!
//! Exactness (the walk's per-pod counts equal the naive map's, whatever the op order):
//! - a run `r` lists distinct blocks; for every offset `k < runs[r].len()`, the slot of
//!   `runs[r][k]` holds the reference `(r, k)`, and all those slots hold the same pod-set id;
//! - interning makes set ids and pod sets one-to-one within a copy, so equal ids mean equal pods;
//! - any change to a block's pods (link, unlink) first cuts the run it belongs to at that block
//!   (`FlatMap::cut`), so the invariant holds after it; until the tail is made a run again the
//!   walk probes those blocks one by one;
//! - a slot's reference may be stale (its run was cut or freed and reused): the walk trusts it
//!   only when `runs[r][k]` is the slot's own key, which by the invariant means it is current.
//!
//! Runs are made by [`FlatMap::seal`] over a store call's blocks (after the writer links them):
//! stretches of ≥ 2 present blocks with one pod-set id, not already covered by a run that goes
//! the same way, at most [`MAX_RUN`] blocks each. A cut queues the run's tail (the blocks after
//! the changed one, whose pods did not change); [`FlatMap::settle`] (after each seal, and before
//! each publish) makes them runs again, so removing a block in the middle of a run splits it in
//! two, and a second pod storing a run's prefix leaves a shared run and a tail run.
//!
//! Table: linear probing, Fibonacci (multiply-shift) home slot, load kept ≤ [`MAX_LOAD_PCT`]%,
//! backward-shift deletion (no tombstones, so probe lengths never degrade with churn).
//! A published snapshot is never mutated (`Arc` + the pool's ownership rules in [`crate::pooled`]).

use std::hint::black_box;

use hashbrown::HashMap;
use kvroute_common::BlockHash;

use crate::hasher::MixBuild;
use crate::pooled::PoolMap;
use crate::walk::{BlockPods, FIRST_TOUCH, MAX_TOUCH, finish, narrow};
use crate::{IndexStats, MatchScratch, PodIdx};

/// Most occupied slots, in percent of the table, before it doubles.
pub const MAX_LOAD_PCT: usize = 70;
/// Longest run (the offset in a slot's run reference is 8 bits).
pub const MAX_RUN: usize = 256;
/// Smallest non-empty table.
const MIN_SLOTS: usize = 16;
/// Fibonacci hashing multiplier (2^64 / φ).
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
/// Run reference of a slot in no run.
const NO_RUN: u32 = u32::MAX;
/// Run reference marking a slot while [`FlatMap::seal`] gathers a run (never left behind).
const GATHERING: u32 = u32::MAX - 1;
/// Run ids below this fit the reference's top 24 bits without meeting the two markers.
const MAX_RUNS: usize = (1 << 24) - 1;

/// One table slot: 16 bytes, 16-aligned, so four share a cache line and none straddles two.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(16))]
struct Slot {
    key: u64,
    /// Interned pod set; 0 = empty slot.
    set: u32,
    /// `run id << 8 | offset`, or [`NO_RUN`]; trusted only after checking (see module docs).
    run: u32,
}

/// An interned pod set and how many slots use it.
#[derive(Clone, Debug, Default)]
struct PodSetEntry {
    pods: Box<[PodIdx]>,
    refs: u32,
    /// Bumped when the id is freed, so a cached [`Transition`] to or from it goes stale.
    generation: u32,
}

/// A remembered set change: adding (or removing) `pod` to set `from` gives set `to`. Stores of
/// a chain repeat the same change block after block; this skips building and hashing the set.
#[derive(Clone, Copy, Debug, Default)]
struct Transition {
    from: u32,
    to: u32,
    from_generation: u32,
    to_generation: u32,
    pod: PodIdx,
    add: bool,
}

/// Remembered set changes (direct-mapped).
const TRANSITIONS: usize = 256;

/// Block hash → sorted pods, open addressing, with runs. See the module docs.
#[derive(Clone, Debug)]
pub struct FlatMap {
    slots: Vec<Slot>,
    /// `64 - log2(slots.len())`: the home slot is the top bits of `key * FIB`.
    shift: u32,
    /// Occupied slots.
    len: usize,
    /// Interned pod sets by id (id 0 unused: it marks an empty slot).
    sets: Vec<PodSetEntry>,
    set_ids: HashMap<Box<[PodIdx]>, u32, MixBuild>,
    free_sets: Vec<u32>,
    /// [`TRANSITIONS`] entries once the first set change happened.
    transitions: Vec<Transition>,
    /// Runs by id: blocks in chain order; an empty vector is a free id.
    runs: Vec<Vec<u64>>,
    free_runs: Vec<u32>,
    /// Σ of runs' capacities and of interned sets' lengths, kept so [`FlatMap::heap_bytes`]
    /// (read at every publish) is O(1).
    run_words: usize,
    set_pods: usize,
    /// Tails of runs cut since the last [`FlatMap::settle`] (blocks, then each tail's end in
    /// `orphans`), to be made runs again.
    orphans: Vec<BlockHash>,
    orphan_ends: Vec<usize>,
    /// Scratch for building a pod set or gathering a run (empty between calls).
    scratch_pods: Vec<PodIdx>,
    scratch_slots: Vec<usize>,
}

impl Default for FlatMap {
    fn default() -> Self {
        FlatMap {
            slots: Vec::new(),
            shift: 0,
            len: 0,
            sets: vec![PodSetEntry::default()],
            set_ids: HashMap::default(),
            free_sets: Vec::new(),
            transitions: Vec::new(),
            runs: Vec::new(),
            free_runs: Vec::new(),
            run_words: 0,
            set_pods: 0,
            orphans: Vec::new(),
            orphan_ends: Vec::new(),
            scratch_pods: Vec::new(),
            scratch_slots: Vec::new(),
        }
    }
}

impl FlatMap {
    /// Number of blocks held by at least one pod.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // `shift` ≥ 1 once the table is non-empty, so the result is < `slots.len()`.
        (key.wrapping_mul(FIB) >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Slot index holding `key`, if any.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let s = self.slots.get(i)?;
            if s.set == 0 {
                return None;
            }
            if s.key == key {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    fn pods_of_set(&self, set: u32) -> &[PodIdx] {
        self.sets.get(set as usize).map_or(&[], |e| &e.pods)
    }

    /// Pods holding `key`, sorted, empty when none.
    #[inline]
    pub fn get(&self, key: u64) -> &[PodIdx] {
        match self.find(key) {
            Some(i) => self.pods_of_set(self.slots[i].set),
            None => &[],
        }
    }

    /// The run blocks that follow `slot`'s block, when its run reference is current.
    #[inline]
    fn run_after(&self, slot: &Slot) -> &[u64] {
        if slot.run >= GATHERING {
            return &[];
        }
        let (r, k) = ((slot.run >> 8) as usize, (slot.run & 0xFF) as usize);
        match self.runs.get(r) {
            Some(run) if run.get(k) == Some(&slot.key) => &run[k + 1..],
            _ => &[],
        }
    }

    /// Loads the home slot of each of `blocks` without acting on it, so the lines arrive in
    /// parallel (a later [`FlatMap::get`] of them hits cache). No branch depends on the loads.
    #[inline]
    pub fn touch(&self, blocks: &[BlockHash]) {
        let mask = self.mask();
        let mut acc = 0u64;
        for b in blocks {
            acc ^= self.slots.get(self.home(b.0) & mask).map_or(0, |s| s.key);
        }
        black_box(acc);
    }

    /// Table, pod sets and runs (allocated capacity; the set map's entries counted as a key box
    /// plus id, hashbrown's control bytes ignored).
    pub fn heap_bytes(&self) -> u64 {
        let (set_pods, runs) = (self.set_pods * size_of::<PodIdx>(), self.run_words * 8);
        (self.slots.capacity() * size_of::<Slot>()
            + self.sets.capacity() * size_of::<PodSetEntry>()
            + 2 * set_pods
            + self.set_ids.capacity() * (size_of::<Box<[PodIdx]>>() + 4)
            + self.runs.capacity() * size_of::<Vec<u64>>()
            + runs) as u64
    }

    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); n]);
        self.shift = 64 - n.trailing_zeros();
        let mask = n - 1;
        for s in old.into_iter().filter(|s| s.set != 0) {
            let mut i = self.home(s.key);
            while self.slots[i].set != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }

    #[inline]
    fn transition_slot(from: u32, pod: PodIdx, add: bool) -> usize {
        let k = (u64::from(from) << 17) | (u64::from(pod.0) << 1) | u64::from(add);
        (k.wrapping_mul(FIB) >> 56) as usize
    }

    /// The set that adding/removing `pod` to/from `from` gives, if remembered and still current;
    /// takes one reference to it.
    #[inline]
    fn remembered(&mut self, from: u32, pod: PodIdx, add: bool) -> Option<u32> {
        let t = *self.transitions.get(Self::transition_slot(from, pod, add))?;
        let current = |id: u32, generation: u32| self.sets.get(id as usize).is_some_and(|e| e.generation == generation);
        if t.from != from
            || t.pod != pod
            || t.add != add
            || !current(from, t.from_generation)
            || !current(t.to, t.to_generation)
        {
            return None;
        }
        let to = &mut self.sets[t.to as usize];
        if to.refs == 0 {
            return None;
        }
        to.refs += 1;
        Some(t.to)
    }

    fn remember(&mut self, from: u32, pod: PodIdx, add: bool, to: u32) {
        if self.transitions.is_empty() {
            self.transitions = vec![Transition::default(); TRANSITIONS];
        }
        let (from_generation, to_generation) = (self.sets[from as usize].generation, self.sets[to as usize].generation);
        self.transitions[Self::transition_slot(from, pod, add)] =
            Transition { from, to, from_generation, to_generation, pod, add };
    }

    /// The id of the pod set in `scratch_pods`, interning it if new; takes one reference.
    fn intern(&mut self) -> u32 {
        if let Some(&id) = self.set_ids.get(self.scratch_pods.as_slice()) {
            self.sets[id as usize].refs += 1;
            return id;
        }
        let pods: Box<[PodIdx]> = self.scratch_pods.as_slice().into();
        self.set_pods += pods.len();
        let id = match self.free_sets.pop() {
            Some(id) => {
                let e = &mut self.sets[id as usize];
                e.pods = pods.clone();
                e.refs = 1;
                id
            }
            None => {
                self.sets.push(PodSetEntry { pods: pods.clone(), refs: 1, generation: 0 });
                // Distinct pod sets are bounded by occupied slots, which a `u32` counts.
                (self.sets.len() - 1) as u32
            }
        };
        self.set_ids.insert(pods, id);
        id
    }

    /// Drops one reference to set `id`; frees it with the last.
    fn release(&mut self, id: u32) {
        let e = &mut self.sets[id as usize];
        e.refs -= 1;
        if e.refs == 0 {
            e.generation = e.generation.wrapping_add(1);
            let pods = std::mem::take(&mut e.pods);
            self.set_pods -= pods.len();
            self.set_ids.remove(&pods);
            self.free_sets.push(id);
        }
    }

    /// Cuts the run slot `i` belongs to (if current) just before its block, so no run claims a
    /// block whose pods are about to change; a run left under 2 blocks is freed.
    fn cut(&mut self, i: usize) {
        let s = self.slots[i];
        self.slots[i].run = NO_RUN;
        if s.run >= GATHERING {
            return;
        }
        let (r, k) = ((s.run >> 8) as usize, (s.run & 0xFF) as usize);
        let Some(run) = self.runs.get_mut(r) else {
            return;
        };
        if run.get(k) != Some(&s.key) {
            return;
        }
        // The blocks after the cut keep their pods: queue them to become a run again.
        if let Some(tail) = run.get(k + 1..).filter(|t| t.len() >= 2) {
            self.orphans.extend(tail.iter().map(|h| BlockHash(*h)));
            self.orphan_ends.push(self.orphans.len());
        }
        self.run_words -= run.capacity();
        if k < 2 {
            *run = Vec::new();
            self.free_runs.push(r as u32);
        } else {
            run.truncate(k);
            if run.capacity() > 2 * k {
                run.shrink_to_fit();
            }
        }
        self.run_words += run.capacity();
    }

    /// Adds `pod` to `key`'s set; returns (the block is new, the pair is new).
    pub fn link(&mut self, pod: PodIdx, key: u64) -> (bool, bool) {
        if let Some(i) = self.find(key) {
            let old = self.slots[i].set;
            let id = match self.remembered(old, pod, true) {
                Some(id) => id,
                None => {
                    let pods = &self.sets[old as usize].pods;
                    let Err(pos) = pods.binary_search(&pod) else {
                        return (false, false);
                    };
                    self.scratch_pods.clear();
                    self.scratch_pods.extend_from_slice(pods);
                    self.scratch_pods.insert(pos, pod);
                    let id = self.intern();
                    self.remember(old, pod, true, id);
                    id
                }
            };
            self.release(old);
            self.cut(i);
            self.slots[i].set = id;
            return (false, true);
        }
        if (self.len + 1) * 100 > self.slots.len() * MAX_LOAD_PCT {
            self.grow();
        }
        // Set 0 (no pods) plus `pod`.
        let set = match self.remembered(0, pod, true) {
            Some(id) => id,
            None => {
                self.scratch_pods.clear();
                self.scratch_pods.push(pod);
                let id = self.intern();
                self.remember(0, pod, true, id);
                id
            }
        };
        let mask = self.mask();
        let mut i = self.home(key);
        while self.slots[i].set != 0 {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot { key, set, run: NO_RUN };
        self.len += 1;
        (true, true)
    }

    /// Removes `pod` from `key`'s set; returns (the pair was present, the block is now gone).
    pub fn unlink(&mut self, pod: PodIdx, key: u64) -> (bool, bool) {
        let Some(i) = self.find(key) else {
            return (false, false);
        };
        let old = self.slots[i].set;
        let id = match self.remembered(old, pod, false) {
            Some(id) => id,
            None => {
                let pods = &self.sets[old as usize].pods;
                let Ok(pos) = pods.binary_search(&pod) else {
                    return (false, false);
                };
                if pods.len() == 1 {
                    self.cut(i);
                    self.release(old);
                    self.delete(i);
                    return (true, true);
                }
                self.scratch_pods.clear();
                self.scratch_pods.extend_from_slice(pods);
                self.scratch_pods.remove(pos);
                let id = self.intern();
                self.remember(old, pod, false, id);
                id
            }
        };
        self.cut(i);
        self.release(old);
        self.slots[i].set = id;
        (true, false)
    }

    /// Empties slot `i` and shifts later keys of its probe run back (backward-shift deletion).
    fn delete(&mut self, mut i: usize) {
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.set == 0 {
                break;
            }
            let h = self.home(s.key);
            // Move `s` back to `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j { i < h && h <= j } else { i < h || h <= j };
            if !stays {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = Slot::default();
        self.len -= 1;
    }

    /// Makes runs of `blocks` (one store call's blocks, in chain order, already linked): see the
    /// module docs. Blocks absent from the map or already covered are skipped.
    pub fn seal(&mut self, blocks: &[BlockHash]) {
        self.seal_one(blocks);
        self.settle();
    }

    /// Makes runs again of the tails cut since the last call (a store's blocks first: when a
    /// second pod stores a prefix of a run, the prefix becomes one run and the rest another).
    pub fn settle(&mut self) {
        if self.orphan_ends.is_empty() {
            return;
        }
        let orphans = std::mem::take(&mut self.orphans);
        let ends = std::mem::take(&mut self.orphan_ends);
        let mut from = 0;
        for &end in &ends {
            self.seal_one(&orphans[from..end]);
            from = end;
        }
        // Sealing never cuts a run, so nothing was queued meanwhile; keep the buffers unless a
        // large batch of removals grew them.
        self.orphans = orphans;
        self.orphans.clear();
        self.orphans.shrink_to(MAX_RUN * 64);
        self.orphan_ends = ends;
        self.orphan_ends.clear();
        self.orphan_ends.shrink_to(64);
    }

    fn seal_one(&mut self, blocks: &[BlockHash]) {
        let mut j = 0;
        while j < blocks.len() {
            let Some(i) = self.find(blocks[j].0) else {
                j += 1;
                continue;
            };
            // Already covered by a current run going the same way: follow it.
            let slot = self.slots[i];
            if self.covered(&slot) {
                let same = self.run_after(&slot).iter().zip(&blocks[j + 1..]).take_while(|(a, b)| **a == b.0).count();
                j += 1 + same;
                continue;
            }
            let set = self.slots[i].set;
            let mut gathered = std::mem::take(&mut self.scratch_slots);
            gathered.clear();
            while j < blocks.len() && gathered.len() < MAX_RUN {
                let Some(i2) = self.find(blocks[j].0) else { break };
                let s = self.slots[i2];
                // Another pod set, a block gathered already (a repeat), or one a current run
                // covers (left to it): the run ends here.
                if s.set != set || s.run == GATHERING || (!gathered.is_empty() && self.covered(&s)) {
                    break;
                }
                self.slots[i2].run = GATHERING;
                gathered.push(i2);
                j += 1;
            }
            let id = if gathered.len() >= 2 { self.new_run() } else { None };
            match id {
                Some(r) => {
                    let run: Vec<u64> = gathered.iter().map(|&i2| self.slots[i2].key).collect();
                    for (k, &i2) in gathered.iter().enumerate() {
                        // `r < MAX_RUNS` (24 bits) and `k < MAX_RUN` (8 bits).
                        self.slots[i2].run = (r << 8) | k as u32;
                    }
                    self.run_words += run.capacity();
                    self.runs[r as usize] = run;
                }
                None => {
                    for &i2 in &gathered {
                        self.slots[i2].run = NO_RUN;
                    }
                }
            }
            gathered.clear();
            self.scratch_slots = gathered;
        }
    }

    /// True when `s`'s run reference is current.
    fn covered(&self, s: &Slot) -> bool {
        s.run < GATHERING
            && self.runs.get((s.run >> 8) as usize).is_some_and(|r| r.get((s.run & 0xFF) as usize) == Some(&s.key))
    }

    /// A free run id, or `None` when all 2^24 - 1 are in use (the blocks then just have no run).
    fn new_run(&mut self) -> Option<u32> {
        if let Some(r) = self.free_runs.pop() {
            return Some(r);
        }
        if self.runs.len() >= MAX_RUNS {
            return None;
        }
        self.runs.push(Vec::new());
        Some((self.runs.len() - 1) as u32)
    }

    /// The prefix walk over runs: probe a block, then follow its run while the request's hashes
    /// match; pods change only where the pod-set id does. Same counts as
    /// [`crate::walk_blocks`] (see the module docs).
    pub fn walk(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        scratch.reset();
        let mut set = 0u32;
        let mut i = 0;
        // Blocks not covered by runs are probed one by one: touch stretches of them ahead (as
        // `walk_blocks` does) so their slots' lines load in parallel.
        let (mut touched, mut stretch) = (0, FIRST_TOUCH);
        while i < chain.len() {
            let Some(at) = self.find(chain[i].0) else { break };
            let slot = &self.slots[at];
            if slot.set != set {
                // `i` is the number of blocks matched so far.
                let depth = i as u32;
                if set == 0 {
                    scratch.active.extend_from_slice(self.pods_of_set(slot.set));
                } else if !narrow(scratch, self.pods_of_set(slot.set), depth) {
                    return depth;
                }
                set = slot.set;
            }
            i += 1;
            let ahead = self.run_after(slot);
            let followed = ahead.iter().zip(&chain[i..]).take_while(|(a, b)| **a == b.0).count();
            i += followed;
            if followed == 0 && i >= touched && i < chain.len() {
                touched = chain.len().min(i + stretch);
                self.touch(&chain[i..touched]);
                stretch = (stretch * 2).min(MAX_TOUCH);
            }
        }
        if scratch.active.is_empty() {
            return 0;
        }
        let depth = i as u32;
        finish(scratch, depth);
        depth
    }
}

/// Published, immutable index state of the flat layout: one [`FlatMap`] and its stats.
#[derive(Clone, Debug, Default)]
pub struct FlatSnapshot {
    map: FlatMap,
    stats: IndexStats,
}

impl BlockPods for FlatSnapshot {
    #[inline]
    fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        self.map.get(block.0)
    }

    #[inline]
    fn touch(&self, blocks: &[BlockHash]) {
        self.map.touch(blocks);
    }

    #[inline]
    fn walk(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        self.map.walk(chain, scratch)
    }
}

impl FlatSnapshot {
    /// Pods holding `block` (sorted), empty when none.
    #[inline]
    pub fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        self.map.get(block.0)
    }

    /// The prefix walk: per-pod consecutive matched blocks into `scratch`; returns the longest
    /// match.
    pub fn match_prefix(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        self.map.walk(chain, scratch)
    }

    /// Size figures as of this snapshot.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }
}

impl PoolMap for FlatSnapshot {
    #[inline]
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        self.map.link(pod, block)
    }

    #[inline]
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        self.map.unlink(pod, block)
    }

    const SEALS: bool = true;

    fn seal(&mut self, blocks: &[BlockHash]) {
        self.map.seal(blocks);
    }

    fn settle(&mut self) {
        self.map.settle();
    }

    fn stats(&self) -> IndexStats {
        self.stats
    }

    fn set_stats(&mut self, stats: IndexStats) {
        self.stats = stats;
    }

    fn heap_bytes(&self) -> u64 {
        self.map.heap_bytes()
    }
}

#[cfg(test)]
mod tests;
