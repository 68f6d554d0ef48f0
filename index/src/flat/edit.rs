//! [`Editor`]: the writer's side of the flat snapshot. It changes the one copy the writer owns
//! ([`FlatSnapshot`], passed in) and keeps what only the writer needs, once for all copies: the
//! pod-set interning table and refcounts, free set and run ids, a cache of recent set changes,
//! the run tails to re-make, and the [`DirtyLog`] of slots, sets and runs it changed.
//!
//! Because every copy is changed by this one editor in the same order, copies are identical
//! (same slot positions, set ids, run ids); a spare copy catches up by copying the logged
//! indices from the published copy ([`catch_up`]) instead of re-running links, interning and
//! sealing: replaying an op log onto a spare costs as much as the write itself
//! (docs/decisions/0002-index-snapshot-design.md).

use std::sync::Arc;

use hashbrown::HashMap;
use kvroute_common::BlockHash;

use super::{FlatSnapshot, GATHERING, MAX_LOAD_PCT, MAX_RUN, NO_RUN, Run, Slot};
use crate::hasher::MixBuild;
use crate::pages::Table;
use crate::types::PodIdx;

/// Smallest non-empty table.
const MIN_SLOTS: usize = 16;
/// Run ids below this fit the reference's top 24 bits without meeting the two markers.
const MAX_RUNS: usize = (1 << 24) - 1;
/// Remembered set changes (direct-mapped).
const TRANSITIONS: usize = 256;
/// Blocks whose slots are loaded ahead together.
const TOUCH: usize = 32;

/// The last set change of a store or remove call: within one call it repeats block after block
/// (a chain's blocks share their pods), and checking it costs less than the [`Transition`]
/// cache. Valid while `from`'s generation is unchanged. `to` = 0 (in a remove call): the
/// block leaves the index (`from` is the call's pod alone).
#[derive(Clone, Copy, Debug, Default)]
struct Memo {
    from: u32,
    to: u32,
    generation: u32,
    valid: bool,
}

/// What [`Editor::link_at`] did and where.
#[derive(Clone, Copy, Debug)]
struct Linked {
    new_node: bool,
    new_entry: bool,
    slot: usize,
    set: u32,
}
/// Dirty-log entry kinds (top two bits) and the index mask (low 30 bits).
const SLOT: u32 = 0;
const SET: u32 = 1 << 30;
const RUN: u32 = 2 << 30;
const INDEX: u32 = (1 << 30) - 1;

/// Indices of the slots, sets and runs changed since some copy was published, in order, so a
/// spare can catch up by copying them ([`catch_up`]). Off while no copy needs it.
#[derive(Debug, Default)]
pub(crate) struct DirtyLog {
    pub(crate) entries: Vec<u32>,
    /// Per entry up to the last publish ([`DirtyLog::record_values`]): a slot entry's value in
    /// the copy published then (a set or run entry's is unused). A spare catches up from these,
    /// sequentially, instead of reading the published copy's slots at random: half the pages
    /// touched (and TLB misses) per caught-up slot.
    pub(crate) values: Vec<Slot>,
    /// Scratch of [`catch_up`]'s long path: one bit per slot, all zero between calls.
    pub(crate) seen: Vec<u64>,
    pub(crate) on: bool,
    /// The slot table was reallocated (it grew), or an index did not fit an entry: no copy
    /// made before can catch up through the log.
    pub(crate) broken: bool,
}

impl DirtyLog {
    /// Before `t` is published: records the values of the slots logged since the last publish,
    /// as `t` has them (its lines were just written: this reads them from cache).
    pub(crate) fn record_values(&mut self, t: &FlatSnapshot) {
        let from = self.values.len().min(self.entries.len());
        let slots = &t.slots;
        self.values.extend(self.entries[from..].iter().map(|&e| match e & !INDEX {
            SLOT => slots.get((e & INDEX) as usize).copied().unwrap_or_default(),
            _ => Slot::default(),
        }));
    }

    /// Drops the first `n` entries (and their values).
    pub(crate) fn drop_front(&mut self, n: usize) {
        self.entries.drain(..n.min(self.entries.len()));
        self.values.drain(..n.min(self.values.len()));
    }

    /// Drops every entry (and its value).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.values.clear();
    }

    /// Gives back the memory of an empty log beyond room for `keep` entries.
    pub(crate) fn shrink_to(&mut self, keep: usize) {
        self.entries.shrink_to(keep);
        self.values.shrink_to(keep);
    }

    #[inline]
    fn mark(&mut self, kind: u32, i: usize) {
        if self.on {
            match u32::try_from(i) {
                Ok(i) if i <= INDEX => self.entries.push(kind | i),
                _ => self.broken = true,
            }
        }
    }
}

/// Brings `spare` (equal to the published copy as of some earlier position) up to `src` (the
/// published copy now) by copying what `entries` (the dirty log since that position) names:
/// a slot from `values` (the entries' recorded values, see [`DirtyLog::values`]; from `src`
/// past their end), a set or run from `src`.
/// Returns false, having changed nothing, when the tables differ in size (then clone instead).
/// From [`DEDUP_FROM`] entries on (a spare that readers held over many publishes), slots are
/// copied once each, newest entry first (`seen`, one bit per slot, all zero on entry and on
/// return, marks those done): the writer rewrites the same slots batch after batch (a chain
/// stored, then removed), and a copy 20 batches behind would otherwise write each 20 times.
pub(crate) fn catch_up(
    spare: &mut FlatSnapshot,
    src: &FlatSnapshot,
    entries: &[u32],
    values: &[Slot],
    seen: &mut Vec<u64>,
) -> bool {
    if spare.slots.len() != src.slots.len() {
        return false;
    }
    spare.sets.resize(src.sets.len(), None);
    spare.runs.resize_with(src.runs.len(), Run::default);
    if entries.len() >= DEDUP_FROM {
        catch_up_once(spare, src, entries, values, seen);
    } else {
        catch_up_each(spare, src, entries, values);
    }
    spare.shift = src.shift;
    spare.len = src.len;
    spare.stats = src.stats;
    true
}

/// Log length from which [`catch_up`] copies each slot once: about four batches of 2,048 blocks.
pub(crate) const DEDUP_FROM: usize = 8192;

/// [`catch_up`], newest entry first, each slot once.
fn catch_up_once(spare: &mut FlatSnapshot, src: &FlatSnapshot, entries: &[u32], values: &[Slot], seen: &mut Vec<u64>) {
    seen.resize(spare.slots.len().div_ceil(64), 0);
    for (k, &e) in entries.iter().enumerate().rev() {
        let i = (e & INDEX) as usize;
        if e & !INDEX == SLOT {
            let (word, bit) = (i / 64, 1u64 << (i % 64));
            match seen.get_mut(word) {
                Some(w) if *w & bit == 0 => *w |= bit,
                _ => continue,
            }
        }
        copy_entry(spare, src, e, values.get(k));
    }
    // Every bit set came from a slot entry: zeroing their words zeroes them all.
    for &e in entries {
        if e & !INDEX == SLOT
            && let Some(w) = seen.get_mut((e & INDEX) as usize / 64)
        {
            *w = 0;
        }
    }
}

/// [`catch_up`], every entry in order.
fn catch_up_each(spare: &mut FlatSnapshot, src: &FlatSnapshot, entries: &[u32], values: &[Slot]) {
    for (k, &e) in entries.iter().enumerate() {
        copy_entry(spare, src, e, values.get(k));
    }
}

/// Copies what entry `e` names into `spare`: a slot from its recorded `value` (from `src`
/// without one), a set or run from `src`.
#[inline(always)]
fn copy_entry(spare: &mut FlatSnapshot, src: &FlatSnapshot, e: u32, value: Option<&Slot>) {
    let i = (e & INDEX) as usize;
    match e & !INDEX {
        SLOT => {
            if let (Some(d), Some(s)) = (spare.slots.get_mut(i), value.or_else(|| src.slots.get(i))) {
                *d = *s;
            }
        }
        SET => {
            if let (Some(d), Some(s)) = (spare.sets.get_mut(i), src.sets.get(i)) {
                d.clone_from(s);
            }
        }
        _ => {
            if let (Some(d), Some(s)) = (spare.runs.get_mut(i), src.runs.get(i)) {
                d.clone_from(s);
            }
        }
    }
}

/// Writer-only bookkeeping of an interned pod set.
#[derive(Clone, Copy, Debug, Default)]
struct SetMeta {
    /// Slots using the set.
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

/// The writer's side of the flat layout. See the module docs.
#[derive(Debug)]
pub(crate) struct Editor {
    set_ids: HashMap<Arc<[PodIdx]>, u32, MixBuild>,
    meta: Vec<SetMeta>,
    free_sets: Vec<u32>,
    /// [`TRANSITIONS`] entries once the first set change happened.
    transitions: Vec<Transition>,
    free_runs: Vec<u32>,
    /// Σ of live runs' hash counts and of interned sets' pod counts (shared by every copy).
    run_words: usize,
    set_pods: usize,
    live_runs: usize,
    /// Tails of runs cut since the last [`Editor::settle`] (blocks, then each tail's end in
    /// `orphans`), to be made runs again.
    orphans: Vec<BlockHash>,
    orphan_ends: Vec<usize>,
    /// Scratch for building a pod set or gathering a run (empty between calls).
    scratch_pods: Vec<PodIdx>,
    scratch_slots: Vec<usize>,
    /// The table grew since the last publish, or was never published: the next growth is ×4
    /// ([`Editor::grow`]).
    growing: bool,
    pub(crate) log: DirtyLog,
}

impl Default for Editor {
    fn default() -> Self {
        Editor {
            set_ids: HashMap::default(),
            meta: vec![SetMeta::default()],
            free_sets: Vec::new(),
            transitions: Vec::new(),
            free_runs: Vec::new(),
            run_words: 0,
            set_pods: 0,
            live_runs: 0,
            orphans: Vec::new(),
            orphan_ends: Vec::new(),
            scratch_pods: Vec::new(),
            scratch_slots: Vec::new(),
            growing: true,
            log: DirtyLog::default(),
        }
    }
}

/// Moves every occupied slot of `old` into `t`'s (empty) table by linear probing from its home.
fn rehash(old: &[Slot], t: &mut FlatSnapshot) {
    let mask = t.mask();
    // Homes are the keys' top bits, so old slots land in the new table almost in order.
    for s in old.iter().copied().filter(|s| s.set != 0) {
        let mut i = t.home(s.key);
        while t.slots[i].set != 0 {
            i = (i + 1) & mask;
        }
        t.slots[i] = s;
    }
}

/// Load, in percent of half the table, under which a copy of an overshot table is halved:
/// below [`MAX_LOAD_PCT`], so the halved table does not grow again at the next few stores.
const HALVE_PCT: usize = 60;

/// A full copy of `src` at half its table size, when its table last grew ×4 and half holds its
/// blocks under [`HALVE_PCT`] percent (the size ×2 growth would have reached, or nearly);
/// `None` otherwise (copy it as it is). Same sets, runs and stats; slots placed anew, so no copy
/// made before can follow it through the dirty log. Costs about what a clone does: one pass
/// over the table, where the clone copies it. Out of line: it runs once per growth burst, and kept
/// out of the copy path it leaves the writer's loops their layout, which their steady speed
/// depends on (docs/decisions/0004-index-table-growth.md).
#[cold]
#[inline(never)]
pub(crate) fn halved(src: &FlatSnapshot) -> Option<FlatSnapshot> {
    let half = src.slots.len() / 2;
    if !src.overshot || half < MIN_SLOTS || src.len * 100 > half * HALVE_PCT {
        return None;
    }
    let mut t = FlatSnapshot {
        slots: Table::zeroed(half),
        shift: 64 - half.trailing_zeros(),
        len: src.len,
        sets: src.sets.clone(),
        runs: src.runs.clone(),
        stats: src.stats,
        changes: src.changes.clone(),
        overshot: false,
    };
    rehash(&src.slots, &mut t);
    Some(t)
}

impl Editor {
    /// Heap bytes the editor holds once for every copy: run hashes, set pods (plus `Arc`
    /// headers), the interning table, set bookkeeping, the dirty log.
    pub(crate) fn shared_bytes(&self) -> u64 {
        let arcs = (self.set_ids.len() + self.live_runs) * 16;
        (self.run_words * 8
            + self.set_pods * size_of::<PodIdx>()
            + arcs
            + self.set_ids.capacity() * (size_of::<Arc<[PodIdx]>>() + 4 + 1)
            + self.meta.capacity() * size_of::<SetMeta>()
            + self.log.entries.capacity() * 4
            + self.log.values.capacity() * size_of::<Slot>()
            + self.log.seen.capacity() * 8) as u64
    }

    #[inline(always)]
    fn put(&mut self, t: &mut FlatSnapshot, i: usize, slot: Slot) {
        t.slots[i] = slot;
        self.log.mark(SLOT, i);
    }

    #[inline(always)]
    fn set_run_ref(&mut self, t: &mut FlatSnapshot, i: usize, run: u32) {
        t.slots[i].run = run;
        self.log.mark(SLOT, i);
    }

    /// Grows the full table: ×2, or ×4 when it already grew since the last publish (or was never
    /// published: a bulk load), so a load that keeps growing moves a third of the slots ×2 would
    /// and clears half the fresh pages (growth is a quarter of a bulk load). A ×4 table may be
    /// twice what ×2 growth gives; [`halved`] then takes the size back when the writer next
    /// copies the table whole. Left to the compiler to inline: out of line, the store and remove
    /// loops it sits in run 4–15 % slower in steady ingest
    /// (docs/decisions/0004-index-table-growth.md).
    fn grow(&mut self, t: &mut FlatSnapshot) {
        let factor = if self.growing { 4 } else { 2 };
        self.growing = true;
        let n = (t.slots.len() * factor).max(MIN_SLOTS);
        let old = std::mem::replace(&mut t.slots, Table::zeroed(n));
        t.shift = 64 - n.trailing_zeros();
        t.overshot = factor == 4;
        rehash(&old, t);
        // Other copies still have the old table: they cannot follow by slot index.
        self.log.broken = true;
    }

    /// At a publish: the batch is over, the next growth is ×2 again.
    pub(crate) fn end_batch(&mut self) {
        self.growing = false;
    }

    #[inline]
    fn transition_slot(from: u32, pod: PodIdx, add: bool) -> usize {
        let k = (u64::from(from) << 17) | (u64::from(pod.0) << 1) | u64::from(add);
        (k.wrapping_mul(super::FIB) >> 56) as usize
    }

    /// The set that adding/removing `pod` to/from `from` gives, if remembered and still current;
    /// takes one reference to it.
    #[inline]
    fn remembered(&mut self, from: u32, pod: PodIdx, add: bool) -> Option<u32> {
        let t = *self.transitions.get(Self::transition_slot(from, pod, add))?;
        let current = |id: u32, generation: u32| self.meta.get(id as usize).is_some_and(|e| e.generation == generation);
        if t.from != from
            || t.pod != pod
            || t.add != add
            || !current(from, t.from_generation)
            || !current(t.to, t.to_generation)
        {
            return None;
        }
        let to = &mut self.meta[t.to as usize];
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
        let (from_generation, to_generation) = (self.meta[from as usize].generation, self.meta[to as usize].generation);
        self.transitions[Self::transition_slot(from, pod, add)] =
            Transition { from, to, from_generation, to_generation, pod, add };
    }

    /// The id of the pod set in `scratch_pods`, interning it if new; takes one reference.
    fn intern(&mut self, t: &mut FlatSnapshot) -> u32 {
        if let Some(&id) = self.set_ids.get(self.scratch_pods.as_slice()) {
            self.meta[id as usize].refs += 1;
            return id;
        }
        let pods: Arc<[PodIdx]> = self.scratch_pods.as_slice().into();
        self.set_pods += pods.len();
        if t.sets.is_empty() {
            t.sets.push(None);
        }
        let id = match self.free_sets.pop() {
            Some(id) => id,
            None => {
                self.meta.push(SetMeta::default());
                t.sets.push(None);
                // Distinct pod sets are bounded by occupied slots, which a `u32` counts.
                (t.sets.len() - 1) as u32
            }
        };
        self.meta[id as usize].refs = 1;
        t.sets[id as usize] = Some(pods.clone());
        self.log.mark(SET, id as usize);
        self.set_ids.insert(pods, id);
        id
    }

    /// Drops one reference to set `id`; frees it with the last. Inlined into the store and
    /// remove loops; freeing, the rare case, is not.
    #[inline(always)]
    fn release(&mut self, t: &mut FlatSnapshot, id: u32) {
        let e = &mut self.meta[id as usize];
        e.refs -= 1;
        if e.refs == 0 {
            self.free_set(t, id);
        }
    }

    #[cold]
    #[inline(never)]
    fn free_set(&mut self, t: &mut FlatSnapshot, id: u32) {
        let e = &mut self.meta[id as usize];
        e.generation = e.generation.wrapping_add(1);
        if let Some(pods) = t.sets[id as usize].take() {
            self.set_pods -= pods.len();
            self.set_ids.remove(&*pods);
        }
        self.log.mark(SET, id as usize);
        self.free_sets.push(id);
    }

    /// Cuts the run slot `i` belongs to (if current) just before its block, so no run claims a
    /// block whose pods are about to change; a run left under 2 blocks is freed. The caller
    /// rewrites slot `i` (its run reference included) right after.
    /// The checks are inlined into the store and remove loops (most slots are in no current
    /// run); the cut itself is not.
    #[inline(always)]
    fn cut(&mut self, t: &mut FlatSnapshot, i: usize) {
        self.cut_leaving(t, i, &[]);
    }

    /// [`Editor::cut`] when slot `i`'s block is leaving the index (its last pod unlinked) and
    /// `leaving` are the blocks the same call unlinks next: when the run's tail after the cut
    /// is a prefix of them (a chain removed in order), its blocks leave too, so the tail is not
    /// queued to be made a run again (that would cost a probe of each, after they are gone).
    #[inline(always)]
    fn cut_leaving(&mut self, t: &mut FlatSnapshot, i: usize, leaving: &[BlockHash]) {
        let s = t.slots[i];
        if s.run >= GATHERING {
            return;
        }
        let (r, k) = ((s.run >> 8) as usize, (s.run & 0xFF) as usize);
        if t.runs.get(r).and_then(|run| run.blocks().get(k)) == Some(&s.key) {
            self.cut_run(t, r, k, leaving);
        }
    }

    /// Cuts current run `r` before its offset `k` (see [`Editor::cut_leaving`]).
    #[inline(never)]
    fn cut_run(&mut self, t: &mut FlatSnapshot, r: usize, k: usize, leaving: &[BlockHash]) {
        let Some(run) = t.runs.get_mut(r) else {
            return;
        };
        let blocks = run.blocks();
        // The blocks after the cut keep their pods (unless they are leaving with this one):
        // queue them to become a run again.
        let gone = |tail: &[u64]| leaving.len() >= tail.len() && tail.iter().zip(leaving).all(|(a, b)| *a == b.0);
        if let Some(tail) = blocks.get(k + 1..).filter(|t| t.len() >= 2 && !gone(t)) {
            self.orphans.extend(tail.iter().map(|h| BlockHash(*h)));
            self.orphan_ends.push(self.orphans.len());
        }
        self.run_words -= run.len as usize;
        if k < 2 {
            *run = Run::default();
            self.free_runs.push(r as u32);
            self.live_runs -= 1;
        } else {
            // `k < MAX_RUN`: fits.
            run.len = k as u32;
            self.run_words += k;
            // A run cut to less than half its array gets its own, so the rest can be freed.
            if let Some(h) = run.hashes.as_ref().filter(|h| h.len() > 2 * k) {
                run.hashes = Some(Arc::from(&h[..k]));
            }
        }
        self.log.mark(RUN, r);
    }

    /// Adds `pod` to `key`'s set; returns (the block is new, the pair is new).
    pub(crate) fn link(&mut self, t: &mut FlatSnapshot, pod: PodIdx, key: u64) -> (bool, bool) {
        let l = self.link_at(t, pod, key, &mut Memo::default());
        (l.new_node, l.new_entry)
    }

    /// The set `memo` remembers for changing `old`, taking one reference to it.
    #[inline(always)]
    fn recall(&mut self, memo: &Memo, old: u32) -> Option<u32> {
        if memo.valid
            && memo.from == old
            && self.meta.get(old as usize).is_some_and(|e| e.generation == memo.generation)
        {
            // `to` is held by the slot the memo's change was made to: still live. Set 0 (no
            // pods: the block leaves) is not counted.
            if memo.to != 0 {
                self.meta[memo.to as usize].refs += 1;
            }
            return Some(memo.to);
        }
        None
    }

    #[inline(always)]
    fn note(&self, memo: &mut Memo, from: u32, to: u32) {
        *memo = Memo { from, to, generation: self.meta[from as usize].generation, valid: true };
    }

    /// [`Editor::link`], also telling where the block now is and its set id. Inlined into
    /// [`Editor::store`]'s loop (a call per block cost ~20 instructions of ~280 per event).
    #[inline(always)]
    fn link_at(&mut self, t: &mut FlatSnapshot, pod: PodIdx, key: u64, memo: &mut Memo) -> Linked {
        let empty = match t.probe(key) {
            Ok(i) => {
                let old = t.slots[i].set;
                let id = match self.recall(memo, old).or_else(|| self.remembered(old, pod, true)) {
                    Some(id) => id,
                    None => {
                        let pods = t.pods_of_set(old);
                        let Err(pos) = pods.binary_search(&pod) else {
                            return Linked { new_node: false, new_entry: false, slot: i, set: old };
                        };
                        self.scratch_pods.clear();
                        self.scratch_pods.extend_from_slice(pods);
                        self.scratch_pods.insert(pos, pod);
                        let id = self.intern(t);
                        self.remember(old, pod, true, id);
                        id
                    }
                };
                self.note(memo, old, id);
                self.release(t, old);
                self.cut(t, i);
                self.put(t, i, Slot { key, set: id, run: NO_RUN });
                return Linked { new_node: false, new_entry: true, slot: i, set: id };
            }
            Err(empty) => empty,
        };
        let i = if (t.len + 1) * 100 > t.slots.len() * MAX_LOAD_PCT {
            self.grow(t);
            match t.probe(key) {
                Ok(i) | Err(i) => i,
            }
        } else {
            empty
        };
        // Set 0 (no pods) plus `pod`.
        let set = match self.recall(memo, 0).or_else(|| self.remembered(0, pod, true)) {
            Some(id) => id,
            None => {
                self.scratch_pods.clear();
                self.scratch_pods.push(pod);
                let id = self.intern(t);
                self.remember(0, pod, true, id);
                id
            }
        };
        self.note(memo, 0, set);
        self.put(t, i, Slot { key, set, run: NO_RUN });
        t.len += 1;
        Linked { new_node: true, new_entry: true, slot: i, set }
    }

    /// One store call: links `pod` to the call's `blocks` in order until `room` new pairs were
    /// made, pushing each block that became a new pair onto `linked`; blocks past that are
    /// dropped (counted) unless `pod` holds them already. Then makes runs of `blocks`. While
    /// every block is a new pair (the usual case: a prefill's new blocks), the runs are made as
    /// the blocks are linked, from the slots just written; otherwise [`Editor::seal`] makes them
    /// afterwards. Same runs either way. Returns (new blocks, dropped over the cap).
    pub(crate) fn store(
        &mut self,
        t: &mut FlatSnapshot,
        pod: PodIdx,
        blocks: &[BlockHash],
        room: usize,
        linked: &mut Vec<u64>,
    ) -> (u64, u64) {
        let (mut nodes, mut dropped, mut room, start) = (0, 0, room, linked.len());
        let mut inline = true;
        let mut run = std::mem::take(&mut self.scratch_slots);
        run.clear();
        let mut run_set = 0u32;
        let mut memo = Memo::default();
        for stretch in blocks.chunks(TOUCH) {
            t.touch_wide(stretch);
            for b in stretch {
                if room == 0 {
                    inline = false;
                    dropped += u64::from(!t.holds(pod, b.0));
                    continue;
                }
                let slots = t.slots.len();
                let l = self.link_at(t, pod, b.0, &mut memo);
                nodes += u64::from(l.new_node);
                if l.new_entry {
                    linked.push(b.0);
                    room -= 1;
                }
                // A block the pod held already (maybe in a current run), or a table that grew
                // (slots moved): leave the runs to `seal`.
                inline &= l.new_entry && t.slots.len() == slots;
                if inline {
                    if l.set != run_set || run.len() == MAX_RUN {
                        let _ = self.make_run(t, &run, true);
                        run.clear();
                        run_set = l.set;
                    }
                    run.push(l.slot);
                }
            }
        }
        if inline {
            let _ = self.make_run(t, &run, true);
        }
        run.clear();
        self.scratch_slots = run;
        if inline {
            self.settle(t);
        } else if linked.len() > start {
            self.seal(t, blocks);
        }
        (nodes, dropped)
    }

    /// Removes `pod` from each of `gone` (blocks it does not hold are skipped); returns (pairs
    /// removed, blocks gone).
    pub(crate) fn remove(&mut self, t: &mut FlatSnapshot, pod: PodIdx, gone: &[BlockHash]) -> (u64, u64) {
        let (mut removed, mut dropped) = (0, 0);
        let mut memo = Memo::default();
        for (n, stretch) in gone.chunks(TOUCH).enumerate() {
            t.touch(stretch);
            for (o, b) in stretch.iter().enumerate() {
                let rest = gone.get(n * TOUCH + o + 1..).unwrap_or(&[]);
                let (r, d) = self.unlink_with(t, pod, b.0, rest, &mut memo);
                removed += u64::from(r);
                dropped += u64::from(d);
            }
        }
        (removed, dropped)
    }

    /// Makes the slots `run` (one pod set, in chain order, in no current run) a run; false
    /// (nothing done) when they are fewer than 2 or all 2^24 - 1 run ids are in use. `logged`:
    /// every slot of `run` is in the dirty log already (a store call's slots just written), so
    /// setting their run references need not log them again.
    fn make_run(&mut self, t: &mut FlatSnapshot, run: &[usize], logged: bool) -> bool {
        if run.len() < 2 {
            return false;
        }
        let Some(r) = self.new_run(t) else {
            return false;
        };
        // Written straight into the shared array (one allocation, no scratch copy).
        let hashes: Arc<[u64]> = run.iter().map(|&i| t.slots[i].key).collect();
        for (k, &i) in run.iter().enumerate() {
            // `r < MAX_RUNS` (24 bits) and `k < MAX_RUN` (8 bits).
            t.slots[i].run = (r << 8) | k as u32;
        }
        if !logged && self.log.on {
            for &i in run {
                self.log.mark(SLOT, i);
            }
        }
        self.run_words += hashes.len();
        self.live_runs += 1;
        // `run.len() ≤ MAX_RUN`: fits.
        t.runs[r as usize] = Run { len: hashes.len() as u32, hashes: Some(hashes) };
        self.log.mark(RUN, r as usize);
        true
    }

    /// Removes `pod` from `key`'s set; returns (the pair was present, the block is now gone).
    pub(crate) fn unlink(&mut self, t: &mut FlatSnapshot, pod: PodIdx, key: u64) -> (bool, bool) {
        self.unlink_with(t, pod, key, &[], &mut Memo::default())
    }

    /// `rest`: the blocks the same call unlinks next (see [`Editor::cut_leaving`]).
    #[inline(always)]
    fn unlink_with(
        &mut self,
        t: &mut FlatSnapshot,
        pod: PodIdx,
        key: u64,
        rest: &[BlockHash],
        memo: &mut Memo,
    ) -> (bool, bool) {
        let Some(i) = t.find(key) else {
            return (false, false);
        };
        let old = t.slots[i].set;
        let id = match self.recall(memo, old).or_else(|| self.remembered(old, pod, false)) {
            Some(id) => id,
            None => {
                let pods = t.pods_of_set(old);
                let Ok(pos) = pods.binary_search(&pod) else {
                    return (false, false);
                };
                if pods.len() == 1 {
                    // The block leaves; the call's next blocks (a chain's) likely leave too.
                    self.note(memo, old, 0);
                    0
                } else {
                    self.scratch_pods.clear();
                    self.scratch_pods.extend_from_slice(pods);
                    self.scratch_pods.remove(pos);
                    let id = self.intern(t);
                    self.remember(old, pod, false, id);
                    id
                }
            }
        };
        if id == 0 {
            self.cut_leaving(t, i, rest);
            self.release(t, old);
            self.delete(t, i);
            return (true, true);
        }
        self.note(memo, old, id);
        self.cut(t, i);
        self.release(t, old);
        self.put(t, i, Slot { key, set: id, run: NO_RUN });
        (true, false)
    }

    /// Empties slot `i` and shifts later keys of its probe run back (backward-shift deletion).
    fn delete(&mut self, t: &mut FlatSnapshot, mut i: usize) {
        let mask = t.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = t.slots[j];
            if s.set == 0 {
                break;
            }
            let h = t.home(s.key);
            // Move `s` back to `i` unless its home lies cyclically in (i, j].
            let stays = if i <= j { i < h && h <= j } else { i < h || h <= j };
            if !stays {
                self.put(t, i, s);
                i = j;
            }
        }
        self.put(t, i, Slot::default());
        t.len -= 1;
    }

    /// Makes runs of `blocks` (one store call's blocks, in chain order, already linked): see the
    /// module docs of [`super`]. Blocks absent from the map or already covered are skipped.
    pub(crate) fn seal(&mut self, t: &mut FlatSnapshot, blocks: &[BlockHash]) {
        self.seal_one(t, blocks);
        self.settle(t);
    }

    /// Makes runs again of the tails cut since the last call (a store's blocks first: when a
    /// second pod stores a prefix of a run, the prefix becomes one run and the rest another).
    pub(crate) fn settle(&mut self, t: &mut FlatSnapshot) {
        if self.orphan_ends.is_empty() {
            return;
        }
        let orphans = std::mem::take(&mut self.orphans);
        let ends = std::mem::take(&mut self.orphan_ends);
        let mut from = 0;
        for &end in &ends {
            self.seal_one(t, &orphans[from..end]);
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

    fn seal_one(&mut self, t: &mut FlatSnapshot, blocks: &[BlockHash]) {
        let mut j = 0;
        while j < blocks.len() {
            let Some(i) = t.find(blocks[j].0) else {
                j += 1;
                continue;
            };
            // Already covered by a current run going the same way: follow it.
            let slot = t.slots[i];
            if t.covered(&slot) {
                let same = t.run_after(&slot).iter().zip(&blocks[j + 1..]).take_while(|(a, b)| **a == b.0).count();
                j += 1 + same;
                continue;
            }
            let set = slot.set;
            let mut gathered = std::mem::take(&mut self.scratch_slots);
            gathered.clear();
            while j < blocks.len() && gathered.len() < MAX_RUN {
                let Some(i2) = t.find(blocks[j].0) else { break };
                let s = t.slots[i2];
                // Another pod set, a block gathered already (a repeat), or one a current run
                // covers (left to it): the run ends here.
                if s.set != set || s.run == GATHERING || (!gathered.is_empty() && t.covered(&s)) {
                    break;
                }
                t.slots[i2].run = GATHERING;
                gathered.push(i2);
                j += 1;
            }
            if !self.make_run(t, &gathered, false) {
                for &i2 in &gathered {
                    self.set_run_ref(t, i2, NO_RUN);
                }
            }
            gathered.clear();
            self.scratch_slots = gathered;
        }
    }

    /// A free run id, or `None` when all 2^24 - 1 are in use (the blocks then just have no run).
    fn new_run(&mut self, t: &mut FlatSnapshot) -> Option<u32> {
        if let Some(r) = self.free_runs.pop() {
            return Some(r);
        }
        if t.runs.len() >= MAX_RUNS {
            return None;
        }
        t.runs.push(Run::default());
        Some((t.runs.len() - 1) as u32)
    }
}

#[cfg(test)]
impl Editor {
    /// Run tails queued to be made runs again at the next [`Editor::settle`].
    pub(crate) fn pending_tails(&self) -> usize {
        self.orphan_ends.len()
    }

    /// Every occupied slot is reachable from its home with no empty slot in between; every
    /// current run reference is consistent (module invariant of [`super`]); set refcounts, the
    /// interning table and the shared tallies are exact.
    pub(crate) fn assert_invariants(&self, t: &FlatSnapshot) {
        use std::collections::{BTreeSet, HashMap as StdMap};
        let mask = t.mask();
        let mut occupied = 0;
        let mut refs: StdMap<u32, u32> = StdMap::new();
        for (j, s) in t.slots.iter().enumerate() {
            if s.set == 0 {
                continue;
            }
            occupied += 1;
            *refs.entry(s.set).or_default() += 1;
            assert_ne!(s.run, GATHERING);
            let mut i = t.home(s.key);
            while i != j {
                assert_ne!(t.slots[i].set, 0, "hole between home {} and slot {j}", t.home(s.key));
                i = (i + 1) & mask;
            }
        }
        assert_eq!(occupied, t.len);
        for (id, e) in self.meta.iter().enumerate().skip(1) {
            assert_eq!(refs.get(&(id as u32)).copied().unwrap_or(0), e.refs, "refs of set {id}");
            let pods = t.sets.get(id).cloned().flatten();
            assert_eq!(pods.is_some(), e.refs > 0, "set {id} present iff referenced");
            if let Some(pods) = pods {
                assert_eq!(self.set_ids.get(&*pods), Some(&(id as u32)), "set {id} interned");
            }
        }
        assert_eq!(self.set_ids.len(), self.meta.iter().filter(|e| e.refs > 0).count());
        assert_eq!(self.run_words, t.runs.iter().map(|r| r.blocks().len()).sum::<usize>());
        assert_eq!(self.live_runs, t.runs.iter().filter(|r| !r.blocks().is_empty()).count());
        assert_eq!(self.set_pods, t.sets.iter().flatten().map(|p| p.len()).sum::<usize>());
        for (r, run) in t.runs.iter().enumerate() {
            let blocks = run.blocks();
            assert!(blocks.is_empty() || blocks.len() >= 2);
            let sets: BTreeSet<u32> = blocks
                .iter()
                .enumerate()
                .map(|(k, key)| {
                    let i = t.find(*key).unwrap_or_else(|| panic!("run {r}'s block {k} is in the map"));
                    assert_eq!(t.slots[i].run, ((r as u32) << 8) | k as u32, "run {r} offset {k}");
                    t.slots[i].set
                })
                .collect();
            assert!(sets.len() <= 1, "run {r} spans pod sets {sets:?}");
        }
    }
}
