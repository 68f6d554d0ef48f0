//! Design C, the index in use: a small pool of identical [`FlatSnapshot`] copies, so the writer
//! never waits for a reader and never redoes its work on a second copy.
//!
//! Readers load the published copy through `arc-swap` and walk it without a lock; a published
//! copy is never mutated. The writer changes a copy it owns (refcount 1) through the
//! [`Editor`](crate::flat::edit::Editor), which logs the indices of every slot, set and run it
//! changes ([`DirtyLog`](crate::flat::edit::DirtyLog), 4 bytes each). Publishing swaps that copy
//! in; the previous one becomes a *spare* tagged with the log position it reflects. Before the
//! next write the writer takes the freshest spare no reader holds (`Arc::try_unwrap` succeeds:
//! refcount 1, and nobody can load it again since it is no longer published) and copies the
//! logged indices from the published copy into it ([`catch_up`]): the copies are identical by
//! construction (one editor decides every position and id), so this is a copy of the changed
//! 16-byte slots, not a replay. The slots' values are recorded next to the log at each publish
//! (read from cache, the copy was just written), so the catch-up reads them in order instead of
//! from the published copy's table at random; a spare many publishes behind copies each slot
//! once. Only when readers hold every spare does it copy the whole published map, which adds a
//! copy to the pool, up to [`MAX_COPIES`] in all; past that it waits (at most [`RECLAIM_WAIT`])
//! and then replaces the laggiest held spare with a copy.
//!
//! With R readers each holding at most one snapshot at a time, R + 2 copies mean the writer never
//! waits; [`MAX_COPIES`] = 3 covers the common case (one reader preempted on an old copy) at
//! another table's memory, and only under reader contention: without readers holding old copies
//! the pool stays at two. The log is trimmed to the oldest spare's position; a copy more than
//! [`MAX_LAG`] entries behind (a snapshot held for long with `load_full()`, or any copy after a
//! batch that large) is let go — its holder keeps it alive, the writer stops planning to reuse it
//! — and when the table grows (it doubles), every other copy is let go. A copy made afterwards
//! is a full clone of the published one; the log is off while no copy needs it (a bulk load or a
//! resync logs nothing).
//!
//! Why copies rather than a replayed op log (docs/decisions/0002-index-snapshot-design.md):
//! replaying links, unlinks and seals onto the spare applies every event twice; copying the dirty
//! slots, with their values recorded at publish (the spare never reads the published table) and
//! each slot copied once in long catch-ups, applies it once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;

use crate::flat::FlatSnapshot;
use crate::flat::edit::{Editor, catch_up, halved};
use crate::types::{IndexStats, PodChanges, PodIdx};
use crate::writer::{Backend, Writer};

/// Most map copies the writer keeps (writable or spare, plus the published one), by default.
pub const MAX_COPIES: usize = 3;
/// Longest the writer waits, once the pool is full and every spare is held, before copying.
pub const RECLAIM_WAIT: Duration = Duration::from_millis(10);
/// Attempts spent spinning (about a lookup's length each) before the writer starts yielding:
/// a reader mid-lookup on another core lets go within a microsecond, and a yield could hand
/// this core to a preempted reader for a whole time slice.
const RECLAIM_SPINS: u32 = 32;
/// Spin-loop hints per spinning attempt.
const SPIN_HINTS: u32 = 64;
/// Yields before the writer starts sleeping between reclaim attempts.
const RECLAIM_YIELDS: u32 = 64;
/// Sleep between reclaim attempts after the spins.
const RECLAIM_NAP: Duration = Duration::from_micros(50);
/// A copy lagging the writer by more dirty-log entries than this (4 bytes each: 1 MiB of log) is
/// let go rather than kept up to date: catching it up would cost about as much as a full copy of
/// a 1M-entry table, and a copy no write needed for that long is not worth its memory.
pub const MAX_LAG: u64 = 1 << 18;
/// Log entries kept allocated between batches.
const LOG_KEEP: usize = 1 << 16;

/// The writer's wait for readers to let go of a copy: [`RECLAIM_SPINS`] short spins, then
/// [`RECLAIM_YIELDS`] yields, then naps of [`RECLAIM_NAP`], until [`RECLAIM_WAIT`] has passed
/// since the first attempt.
#[derive(Debug)]
pub struct ReclaimWait {
    start: Instant,
    attempt: u32,
}

impl Default for ReclaimWait {
    fn default() -> Self {
        ReclaimWait { start: Instant::now(), attempt: 0 }
    }
}

impl ReclaimWait {
    /// Pauses taken so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Pauses before the next attempt; false (at once) when [`RECLAIM_WAIT`] is over.
    pub fn pause(&mut self) -> bool {
        self.attempt += 1;
        if self.attempt <= RECLAIM_SPINS {
            for _ in 0..SPIN_HINTS {
                std::hint::spin_loop();
            }
            true
        } else if self.attempt <= RECLAIM_SPINS + RECLAIM_YIELDS {
            std::thread::yield_now();
            true
        } else if self.start.elapsed() < RECLAIM_WAIT {
            std::thread::sleep(RECLAIM_NAP);
            true
        } else {
            false
        }
    }
}

/// A previously published copy and the absolute log position it reflects.
#[derive(Debug)]
struct Spare {
    snap: Arc<FlatSnapshot>,
    at: u64,
}

/// Writer side of design C, keeping at most `MAX` copies (at least 2) of the flat snapshot.
#[derive(Debug)]
pub struct PooledBackend<const MAX: usize = MAX_COPIES> {
    editor: Editor,
    /// The copy the writer owns (refcount 1), at the log's head. `None` after a publish.
    writable: Option<FlatSnapshot>,
    /// Earlier published copies, possibly still held by readers.
    spares: Vec<Spare>,
    /// Absolute position of the log's first entry.
    log_base: u64,
    /// Log position of the published copy; `None` when the log cannot bring it up to date.
    published_at: Option<u64>,
    published: Arc<ArcSwap<FlatSnapshot>>,
    copies: u64,
    waits: u64,
    caught_up: u64,
}

impl<const MAX: usize> PooledBackend<MAX> {
    /// Times the writer copied the published map because readers held every spare (growing the
    /// pool, or replacing a spare held past [`RECLAIM_WAIT`]).
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Times the pool was full and every spare held, so the writer had to wait.
    pub fn waits(&self) -> u64 {
        self.waits
    }

    /// Dirty-log entries a spare's catch-up had to cover so far (slots, sets and runs; a slot
    /// logged more than once counts each time).
    pub fn caught_up(&self) -> u64 {
        self.caught_up
    }

    /// Map copies currently kept by the writer and the published one.
    pub fn copies_held(&self) -> usize {
        1 + self.spares.len() + usize::from(self.writable.is_some())
    }

    fn head(&self) -> u64 {
        self.log_base + self.editor.log.entries.len() as u64
    }

    /// The editor and the writable copy (made first if there is none).
    fn parts(&mut self) -> (&mut Editor, &mut FlatSnapshot) {
        if self.writable.is_none() {
            let copy = match self.take_spare() {
                Some(copy) => copy,
                None => {
                    let published = self.published.load();
                    // A table grown ×4 in its last batch may be twice the size it needs: copied
                    // at half size instead, at about a clone's cost. Placed anew: no other copy
                    // can follow it (flat::edit::halved).
                    match halved(&published) {
                        Some(copy) => {
                            self.editor.log.broken = true;
                            copy
                        }
                        None => FlatSnapshot::clone(&published),
                    }
                }
            };
            self.writable = Some(copy);
        }
        (&mut self.editor, self.writable.get_or_insert_with(FlatSnapshot::default))
    }

    /// The freshest spare no reader holds, brought up to the published copy; `None` when the
    /// published map must be copied instead (no spare yet, or every spare held).
    fn take_spare(&mut self) -> Option<FlatSnapshot> {
        if self.spares.is_empty() {
            return None;
        }
        let mut wait = ReclaimWait::default();
        loop {
            if let Some(copy) = self.try_take_free() {
                return Some(copy);
            }
            if self.copies_held() < MAX.max(2) {
                self.copies += 1;
                return None;
            }
            if wait.attempts() == 0 {
                self.waits += 1;
            }
            if !wait.pause() {
                // Let the laggiest held spare go; its readers keep it alive.
                if let Some(i) = (0..self.spares.len()).min_by_key(|&i| self.spares[i].at) {
                    self.spares.swap_remove(i);
                }
                self.trim_log();
                self.copies += 1;
                return None;
            }
        }
    }

    fn try_take_free(&mut self) -> Option<FlatSnapshot> {
        loop {
            let i = (0..self.spares.len())
                .filter(|&i| Arc::strong_count(&self.spares[i].snap) == 1)
                .max_by_key(|&i| self.spares[i].at)?;
            let Spare { snap, at } = self.spares.swap_remove(i);
            match Arc::try_unwrap(snap) {
                Ok(mut copy) => {
                    // No write since the publish: the published copy is at the log's head.
                    let from = usize::try_from(at.saturating_sub(self.log_base)).unwrap_or(usize::MAX);
                    let log = &mut self.editor.log;
                    let entries = log.entries.get(from..).unwrap_or(&[]);
                    let values = log.values.get(from..).unwrap_or(&[]);
                    self.caught_up += entries.len() as u64;
                    let caught_up = catch_up(&mut copy, &self.published.load(), entries, values, &mut log.seen);
                    self.trim_log();
                    return if caught_up { Some(copy) } else { None };
                }
                // A reader took a reference between the two checks: keep it, look again.
                Err(snap) => self.spares.push(Spare { snap, at }),
            }
        }
    }

    /// Drops the log before the oldest position still needed (a spare's or the published
    /// copy's); turns it off when none is.
    fn trim_log(&mut self) {
        let oldest = self.spares.iter().map(|s| s.at).chain(self.published_at).min();
        let log = &mut self.editor.log;
        match oldest {
            Some(oldest) => {
                let cut = usize::try_from(oldest.saturating_sub(self.log_base)).unwrap_or(usize::MAX);
                let cut = cut.min(log.entries.len());
                if cut > 0 {
                    log.drop_front(cut);
                    self.log_base += cut as u64;
                }
            }
            None => {
                self.log_base += log.entries.len() as u64;
                log.clear();
                log.on = false;
            }
        }
        if log.entries.is_empty() {
            // A large batch can grow the log to MAX_LAG: give it back.
            log.shrink_to(LOG_KEEP);
        }
    }

    /// After an edit: lets go of the copies the log can no longer (or should no longer) bring up
    /// to date.
    #[inline]
    fn after_edit(&mut self) {
        let log = &self.editor.log;
        if log.broken {
            // The table grew: no other copy can follow by slot index.
            self.spares.clear();
            self.published_at = None;
            let log = &mut self.editor.log;
            log.broken = false;
            self.trim_log();
        } else if log.entries.len() as u64 > MAX_LAG {
            // Let go of copies lagging more than half of MAX_LAG, so this runs again only after
            // another MAX_LAG / 2 entries.
            let keep_from = self.head() - MAX_LAG / 2;
            self.spares.retain(|s| s.at >= keep_from);
            self.published_at = self.published_at.filter(|&at| at >= keep_from);
            self.trim_log();
        }
    }
}

impl<const MAX: usize> Backend for PooledBackend<MAX> {
    type Snapshot = FlatSnapshot;

    fn new(published: Arc<ArcSwap<FlatSnapshot>>) -> Self {
        let mut editor = Editor::default();
        editor.log.on = true;
        PooledBackend {
            editor,
            writable: None,
            spares: Vec::new(),
            log_base: 0,
            published_at: Some(0),
            published,
            copies: 0,
            waits: 0,
            caught_up: 0,
        }
    }

    #[inline]
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let (editor, copy) = self.parts();
        let r = editor.link(copy, pod, block);
        self.after_edit();
        r
    }

    #[inline]
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let (editor, copy) = self.parts();
        let r = editor.unlink(copy, pod, block);
        self.after_edit();
        r
    }

    fn holds(&self, pod: PodIdx, block: u64) -> bool {
        match &self.writable {
            Some(copy) => copy.holds(pod, block),
            None => self.published.load().holds(pod, block),
        }
    }

    fn touch(&self, blocks: &[BlockHash]) {
        if let Some(copy) = &self.writable {
            copy.touch(blocks);
        }
    }

    fn store(&mut self, pod: PodIdx, blocks: &[BlockHash], room: usize, linked: &mut Vec<u64>) -> (u64, u64) {
        if blocks.is_empty() {
            return (0, 0);
        }
        let (editor, copy) = self.parts();
        let r = editor.store(copy, pod, blocks, room, linked);
        self.after_edit();
        r
    }

    fn remove(&mut self, pod: PodIdx, gone: &[BlockHash]) -> (u64, u64) {
        if gone.is_empty() {
            return (0, 0);
        }
        let (editor, copy) = self.parts();
        let r = editor.remove(copy, pod, gone);
        self.after_edit();
        r
    }

    fn seal(&mut self, blocks: &[BlockHash]) {
        if blocks.len() < 2 {
            return;
        }
        let (editor, copy) = self.parts();
        editor.seal(copy, blocks);
        self.after_edit();
    }

    fn publish(&mut self, stats: IndexStats, changes: &PodChanges) -> bool {
        if self.writable.is_none() && self.published.load().stats() == stats {
            return false;
        }
        // Only the stats may have changed (e.g. stores dropped over the cap): then this copies.
        let (editor, copy) = self.parts();
        editor.settle(copy);
        editor.end_batch();
        self.after_edit();
        let Some(mut snap) = self.writable.take() else {
            return false;
        };
        snap.stats = stats;
        snap.changes.clone_from(changes);
        if self.editor.log.on {
            self.editor.log.record_values(&snap);
        }
        let old = self.published.swap(Arc::new(snap));
        if let Some(at) = self.published_at {
            self.spares.push(Spare { snap: old, at });
        }
        self.published_at = Some(self.head());
        self.editor.log.on = true;
        self.trim_log();
        true
    }

    fn map_bytes(&self) -> u64 {
        let published = self.published.load().table_bytes();
        let writable = self.writable.as_ref().map_or(0, FlatSnapshot::table_bytes);
        let spares: u64 = self.spares.iter().map(|s| s.snap.table_bytes()).sum();
        published + writable + spares + self.editor.shared_bytes()
    }
}

/// The single writer of design C.
pub type PooledWriter = Writer<PooledBackend>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat::edit::DEDUP_FROM;

    /// Copies equal as readers and the editor see them: same slots (bit for bit), set contents
    /// and run blocks by id.
    fn assert_same(a: &FlatSnapshot, b: &FlatSnapshot) {
        assert_eq!((a.len, a.shift, a.stats), (b.len, b.shift, b.stats));
        assert!(a.slots == b.slots, "slots differ");
        assert_same_sets_and_runs(a, b);
    }

    /// Same set contents, and the same run blocks by id.
    fn assert_same_sets_and_runs(a: &FlatSnapshot, b: &FlatSnapshot) {
        assert_eq!(a.sets, b.sets);
        let runs = |s: &FlatSnapshot| s.runs.iter().map(|r| r.blocks().to_vec()).collect::<Vec<_>>();
        assert_eq!(runs(a), runs(b));
    }

    /// `copy`, the writer's copy of `published`, equals it ([`assert_same`]), or is it halved
    /// (`flat::edit::halved`: a table grown ×4 copied at half size): then the same blocks with
    /// the same slot values, sets and runs, at half the table.
    fn assert_same_or_halved(copy: &FlatSnapshot, published: &FlatSnapshot) -> bool {
        if copy.slots.len() == published.slots.len() {
            assert_same(copy, published);
            return false;
        }
        assert!(published.overshot && copy.slots.len() * 2 == published.slots.len(), "halved");
        assert_eq!((copy.len, copy.stats), (published.len, published.stats));
        for s in published.slots.iter().filter(|s| s.set != 0) {
            let i = copy.find(s.key).expect("every block is in the halved copy");
            assert_eq!(copy.slots[i], *s);
        }
        assert_eq!(copy.slots.iter().filter(|s| s.set != 0).count(), copy.len);
        assert_same_sets_and_runs(copy, published);
        true
    }

    /// A spare caught up through the dirty log equals the published copy exactly, whether it was
    /// one or two publishes behind (a reader held the other), across cuts, frees, set changes and
    /// table growth; every write then starts from such a copy.
    #[test]
    fn caught_up_copies_equal_the_published_one() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut b = PooledBackend::<3>::new(published.clone());
        let mut rand = crate::test_rng(0x1234_5678_u64);
        let mut held: Option<Arc<FlatSnapshot>> = None;
        let mut caught_up = 0;
        for round in 0..400u64 {
            let n = 1 + rand(40);
            let chain: Vec<BlockHash> = (0..n).map(|_| BlockHash(1 + rand(300) * 0x9E37_79B9)).collect();
            let pod = PodIdx(rand(6) as u16);
            match rand(4) {
                0 | 1 => {
                    for h in &chain {
                        b.link(pod, h.0);
                    }
                    b.seal(&chain);
                }
                2 => {
                    for h in &chain {
                        b.unlink(pod, h.0);
                    }
                }
                _ => {
                    for h in chain.iter().step_by(3) {
                        b.unlink(pod, h.0);
                    }
                }
            }
            b.publish(IndexStats { nodes: round, ..IndexStats::default() }, &PodChanges::default());
            // Sometimes a reader holds the copy just published over the next publish.
            held = if rand(3) == 0 { Some(published.load_full()) } else { None };
            let had_spare = !b.spares.is_empty();
            let (_, copy) = b.parts();
            let copy = copy.clone();
            assert_same(&copy, &published.load());
            caught_up += usize::from(had_spare);
        }
        drop(held);
        assert!(caught_up > 300, "most writes started from a caught-up spare ({caught_up})");
    }

    /// Runs made inline by store calls (their run references set after the slots were logged,
    /// not logged again) reach caught-up spares: every copy equals the published one after
    /// fresh chains are stored, partly removed, and stored again on other pods.
    #[test]
    fn store_calls_runs_reach_caught_up_copies() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut b = PooledBackend::<3>::new(published.clone());
        let mut rand = crate::test_rng(0x9876_5432_u64);
        let mut chains: Vec<Vec<BlockHash>> = Vec::new();
        let mut linked = Vec::new();
        let mut held = Vec::new();
        for round in 0..300u64 {
            match rand(4) {
                // A fresh chain (every block new: the inline path).
                0 | 1 => {
                    let n = 2 + rand(300);
                    let chain: Vec<BlockHash> =
                        (0..n).map(|k| BlockHash((round << 16 | k) * 0x9E37_79B9 + 1)).collect();
                    b.store(PodIdx(rand(4) as u16), &chain, usize::MAX, &mut linked);
                    chains.push(chain);
                }
                // An earlier chain on another pod (new pairs, blocks already indexed: set changes).
                2 if !chains.is_empty() => {
                    let chain = chains[rand(chains.len() as u64) as usize].clone();
                    b.store(PodIdx(4 + rand(2) as u16), &chain, usize::MAX, &mut linked);
                }
                // Part of an earlier chain removed from every pod (runs cut and freed).
                _ if !chains.is_empty() => {
                    let chain = chains.swap_remove(rand(chains.len() as u64) as usize);
                    let from = rand(chain.len() as u64) as usize;
                    for pod in 0..6 {
                        b.remove(PodIdx(pod), &chain[from..]);
                    }
                }
                _ => {}
            }
            linked.clear();
            b.publish(IndexStats { nodes: round, ..IndexStats::default() }, &PodChanges::default());
            if rand(3) == 0 {
                held.push(published.load_full());
            }
            held.drain(..held.len().saturating_sub(1));
            let (_, copy) = b.parts();
            let copy = copy.clone();
            assert_same_or_halved(&copy, &published.load());
        }
        assert!(b.caught_up() > 0);
    }

    /// A bulk load grows the table ×4 (`flat::edit`): 300 blocks in one batch end in 1,024
    /// slots where ×2 growth ends in 512. The writer's next copy halves it: 512 slots, every
    /// block and pod kept, and later copies catch up from it as before. A table whose last growth
    /// was ×2 (a later batch's first) is copied as it is.
    #[test]
    fn an_overshot_table_is_halved_at_the_next_copy() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut b = PooledBackend::<3>::new(published.clone());
        let chain: Vec<BlockHash> = (1..=300u64).map(|k| BlockHash(k.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect();
        let mut linked = Vec::new();
        b.store(PodIdx(0), &chain, usize::MAX, &mut linked);
        b.publish(IndexStats { nodes: 1, ..IndexStats::default() }, &PodChanges::default());
        assert_eq!(published.load().slots.len(), 1024);
        assert!(published.load().overshot);
        b.store(PodIdx(1), &chain[..10], usize::MAX, &mut linked);
        b.publish(IndexStats { nodes: 2, ..IndexStats::default() }, &PodChanges::default());
        let p = published.load_full();
        assert_eq!((p.slots.len(), p.len), (512, 300), "halved at the copy");
        assert!(!p.overshot);
        for (k, h) in chain.iter().enumerate() {
            assert!(p.holds(PodIdx(0), h.0));
            assert_eq!(p.holds(PodIdx(1), h.0), k < 10);
        }
        let mut scratch = crate::MatchScratch::default();
        assert_eq!(p.match_prefix(&chain, &mut scratch), 300);
        assert_eq!(scratch.matched(PodIdx(1)), 10);
        // The copy after the halved one catches up through the log, as any.
        b.remove(PodIdx(0), &chain[..5]);
        b.publish(IndexStats { nodes: 3, ..IndexStats::default() }, &PodChanges::default());
        let (_, copy) = b.parts();
        let copy = copy.clone();
        assert!(!assert_same_or_halved(&copy, &published.load()));
        // A later batch's first growth is ×2, and such a table is copied whole.
        let more: Vec<BlockHash> = (301..=400u64).map(|k| BlockHash(k.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect();
        b.store(PodIdx(2), &more, usize::MAX, &mut linked);
        b.publish(IndexStats { nodes: 4, ..IndexStats::default() }, &PodChanges::default());
        assert_eq!(published.load().slots.len(), 1024);
        assert!(!published.load().overshot);
        b.store(PodIdx(3), &more[..1], usize::MAX, &mut linked);
        b.publish(IndexStats { nodes: 5, ..IndexStats::default() }, &PodChanges::default());
        assert_eq!(published.load().slots.len(), 1024);
    }

    /// A spare readers held over many publishes catches up through the long path (each slot
    /// copied once, newest entry first) and equals the published copy exactly; the same slots
    /// were rewritten batch after batch meanwhile (links, unlinks, cuts, re-made runs).
    #[test]
    fn a_copy_held_over_many_publishes_catches_up_exactly() {
        let published = Arc::new(ArcSwap::from_pointee(FlatSnapshot::default()));
        let mut b = PooledBackend::<3>::new(published.clone());
        let keys: Vec<BlockHash> = (1..=600u64).map(|k| BlockHash(k.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect();
        for h in &keys {
            b.link(PodIdx(0), h.0);
        }
        b.seal(&keys);
        b.publish(IndexStats::default(), &PodChanges::default());
        // Two publishes, so the writer's pool holds two spares besides the published copy.
        b.link(PodIdx(1), keys[0].0);
        b.publish(IndexStats { nodes: 1, ..IndexStats::default() }, &PodChanges::default());
        let old = published.load_full();
        for round in 0..40u64 {
            let pod = PodIdx(1 + (round % 3) as u16);
            for h in &keys {
                b.link(pod, h.0);
            }
            b.seal(&keys);
            for h in keys.iter().skip(round as usize % 7).step_by(2) {
                b.unlink(pod, h.0);
            }
            b.publish(IndexStats { nodes: 2 + round, ..IndexStats::default() }, &PodChanges::default());
        }
        // The freshest spare is held, the old copy let go: the next write must take the old one.
        let fresh = published.load_full();
        b.link(PodIdx(5), keys[1].0);
        b.publish(IndexStats { nodes: 100, ..IndexStats::default() }, &PodChanges::default());
        drop(old);
        let before = b.caught_up();
        let (_, copy) = b.parts();
        let copy = copy.clone();
        assert!(b.caught_up() - before >= DEDUP_FROM as u64, "long path taken: {}", b.caught_up() - before);
        assert_same(&copy, &published.load());
        drop(fresh);
    }
}
