//! [`FlatSnapshot`]: the published block map as one open-addressing table of 16-byte slots, pod
//! sets interned, and *runs*: consecutive blocks stored together with the same pods, kept
//! contiguous so a walk verifies them by comparing hashes in sequence instead of probing each one.
//! This module is the read side (layout, lookups, the walk); [`edit`] changes a copy.
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
//! - a run `r` lists distinct blocks; for every offset `k < runs[r].len`, the slot of
//!   `runs[r][k]` holds the reference `(r, k)`, and all those slots hold the same pod-set id;
//! - interning makes set ids and pod sets one-to-one within a copy, so equal ids mean equal pods;
//! - any change to a block's pods (link, unlink) first cuts the run it belongs to at that block,
//!   so the invariant holds after it; until the tail is made a run again the walk probes those
//!   blocks one by one;
//! - a slot's reference may be stale (its run was cut or freed and reused): the walk trusts it
//!   only when `runs[r][k]` is the slot's own key, which by the invariant means it is current.
//!
//! Copies: the writer keeps two or three copies of this snapshot ([`crate::PooledBackend`]) and
//! they are *identical*: one writer decides every slot position, set id and run id, and a spare
//! copy is brought up to date by copying the slots, sets and runs that changed (their indices
//! are logged, [`edit::DirtyLog`], with the slots' values as published; sets and runs come from
//! the published copy), not by redoing the work. A run's
//! hashes and a set's pods are immutable once made and shared between copies (`Arc`).
//!
//! Table: linear probing, Fibonacci (multiply-shift) home slot, load kept ≤ [`MAX_LOAD_PCT`]%,
//! backward-shift deletion (no tombstones, so probe lengths never degrade with churn).
//! A published snapshot is never mutated (`Arc` + the pool's ownership rules in [`crate::pool`]).

pub(crate) mod edit;

use std::hint::black_box;
use std::sync::Arc;

use kvroute_common::BlockHash;

use crate::pages::{Table, Zeroed};
use crate::types::{IndexStats, MatchScratch, PodChanges, PodIdx};
use crate::walk::{BlockPods, FIRST_TOUCH, MAX_TOUCH, finish, narrow};

/// Most occupied slots, in percent of the table, before it doubles.
pub const MAX_LOAD_PCT: usize = 70;
/// Longest run (the offset in a slot's run reference is 8 bits).
pub const MAX_RUN: usize = 256;
/// Fibonacci hashing multiplier (2^64 / φ).
pub(crate) const FIB: u64 = 0x9E37_79B9_7F4A_7C15;
/// Run reference of a slot in no run.
pub(crate) const NO_RUN: u32 = u32::MAX;
/// Run reference marking a slot while a seal gathers a run (never left behind).
pub(crate) const GATHERING: u32 = u32::MAX - 1;

/// One table slot: 16 bytes, 16-aligned, so four share a cache line and none straddles two.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct Slot {
    pub(crate) key: u64,
    /// Interned pod set; 0 = empty slot.
    pub(crate) set: u32,
    /// `run id << 8 | offset`, or [`NO_RUN`]; trusted only after checking (see module docs).
    pub(crate) run: u32,
}

// SAFETY: a slot is a `u64` and two `u32`s (16 bytes, no padding): all-zero bytes are a valid
// slot, the empty one (`Slot::default()`). The crate's one `unsafe` outside `pages`.
#[allow(unsafe_code)]
unsafe impl Zeroed for Slot {}

/// A run as one copy sees it: the first `len` of `hashes` (the array is shared by every copy
/// and never changes; a cut only shortens `len`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Run {
    pub(crate) hashes: Option<Arc<[u64]>>,
    pub(crate) len: u32,
}

impl Run {
    /// The run's blocks, in chain order (empty for a free id).
    #[inline]
    pub(crate) fn blocks(&self) -> &[u64] {
        match &self.hashes {
            Some(h) => h.get(..self.len as usize).unwrap_or(h),
            None => &[],
        }
    }
}

/// Published, immutable index state: block hash → sorted pods, with runs. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct FlatSnapshot {
    /// The open-addressing table, on 2 MiB pages where the system allows ([`Table`]).
    pub(crate) slots: Table<Slot>,
    /// `64 - log2(slots.len())`: the home slot is the top bits of `key * FIB`.
    pub(crate) shift: u32,
    /// Occupied slots.
    pub(crate) len: usize,
    /// Interned pod sets by id (id 0, and freed ids, are `None`).
    pub(crate) sets: Vec<Option<Arc<[PodIdx]>>>,
    /// Runs by id (a free id is empty).
    pub(crate) runs: Vec<Run>,
    pub(crate) stats: IndexStats,
    /// When each pod's blocks last changed, as of this snapshot (set when published).
    pub(crate) changes: PodChanges,
    /// The table last grew ×4 (growth within one batch, `flat::edit`): it may be twice the size
    /// ×2 growth gives, and the writer's next full copy of it halves it instead.
    pub(crate) overshot: bool,
}

impl FlatSnapshot {
    /// Number of blocks held by at least one pod.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size figures as of this snapshot.
    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// When each pod's blocks last changed, as of this snapshot, and its stamp.
    pub fn changes(&self) -> &PodChanges {
        &self.changes
    }

    #[inline]
    pub(crate) fn home(&self, key: u64) -> usize {
        // `shift` ≥ 1 once the table is non-empty, so the result is < `slots.len()`.
        (key.wrapping_mul(FIB) >> self.shift) as usize
    }

    #[inline]
    pub(crate) fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// Slot index holding `key`, if any.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
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

    /// `Ok(slot)` holding `key`, or `Err(slot)`: the empty slot ending its probe sequence, where
    /// it would be inserted. The table must not be full (load ≤ [`MAX_LOAD_PCT`]%); an empty
    /// table gives `Err(0)`.
    #[inline]
    pub(crate) fn probe(&self, key: u64) -> Result<usize, usize> {
        if self.slots.is_empty() {
            return Err(0);
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let s = &self.slots[i];
            if s.set == 0 {
                return Err(i);
            }
            if s.key == key {
                return Ok(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(crate) fn pods_of_set(&self, set: u32) -> &[PodIdx] {
        match self.sets.get(set as usize) {
            Some(Some(pods)) => pods,
            _ => &[],
        }
    }

    /// Pods holding `block` (sorted), empty when none.
    #[inline]
    pub fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        match self.find(block.0) {
            Some(i) => self.pods_of_set(self.slots[i].set),
            None => &[],
        }
    }

    /// Whether `pod` holds `key`.
    #[inline]
    pub(crate) fn holds(&self, pod: PodIdx, key: u64) -> bool {
        self.find(key).is_some_and(|i| self.pods_of_set(self.slots[i].set).binary_search(&pod).is_ok())
    }

    /// The run blocks that follow `slot`'s block, when its run reference is current.
    #[inline]
    pub(crate) fn run_after(&self, slot: &Slot) -> &[u64] {
        if slot.run >= GATHERING {
            return &[];
        }
        let (r, k) = ((slot.run >> 8) as usize, (slot.run & 0xFF) as usize);
        match self.runs.get(r).map(Run::blocks) {
            Some(run) if run.get(k) == Some(&slot.key) => &run[k + 1..],
            _ => &[],
        }
    }

    /// True when `s`'s run reference is current.
    #[inline]
    pub(crate) fn covered(&self, s: &Slot) -> bool {
        s.run < GATHERING
            && self
                .runs
                .get((s.run >> 8) as usize)
                .is_some_and(|r| r.blocks().get((s.run & 0xFF) as usize) == Some(&s.key))
    }

    /// Loads the home slot of each of `blocks` without acting on it, so the lines arrive in
    /// parallel (a later probe of them hits cache). No branch depends on the loads.
    #[inline]
    pub(crate) fn touch(&self, blocks: &[BlockHash]) {
        let mask = self.mask();
        let mut acc = 0u64;
        for b in blocks {
            acc ^= self.slots.get(self.home(b.0) & mask).map_or(0, |s| s.key);
        }
        black_box(acc);
    }

    /// [`FlatSnapshot::touch`] for inserts: the home slot's line and the next (an insert probes
    /// to the first empty slot, often past the home line's four slots).
    #[inline]
    pub(crate) fn touch_wide(&self, blocks: &[BlockHash]) {
        let mask = self.mask();
        let mut acc = 0u64;
        for b in blocks {
            let i = self.home(b.0);
            acc ^= self.slots.get(i & mask).map_or(0, |s| s.key) ^ self.slots.get((i + 4) & mask).map_or(0, |s| s.key);
        }
        black_box(acc);
    }

    /// Heap bytes of this copy's own arrays (slots, set and run tables, by capacity); the run
    /// hashes and set pods they point to are shared between copies and counted by the writer.
    pub(crate) fn table_bytes(&self) -> u64 {
        (self.slots.bytes()
            + self.sets.capacity() * size_of::<Option<Arc<[PodIdx]>>>()
            + self.runs.capacity() * size_of::<Run>()) as u64
    }

    /// The prefix walk: per-pod consecutive matched blocks into `scratch`; returns the longest
    /// match. Probes a block, then follows its run while the request's hashes match; pods change
    /// only where the pod-set id does. Same counts as [`crate::walk_blocks`] (module docs).
    pub fn match_prefix(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
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

impl BlockPods for FlatSnapshot {
    #[inline]
    fn pods_of(&self, block: BlockHash) -> &[PodIdx] {
        FlatSnapshot::pods_of(self, block)
    }

    #[inline]
    fn touch(&self, blocks: &[BlockHash]) {
        FlatSnapshot::touch(self, blocks);
    }

    #[inline]
    fn walk(&self, chain: &[BlockHash], scratch: &mut MatchScratch) -> u32 {
        self.match_prefix(chain, scratch)
    }
}

#[cfg(test)]
mod tests;
