//! Design C, a small pool of map copies kept in step by one op log: design B that never waits for
//! a reader.
//!
//! Any snapshot type that can be copied and replayed ([`PoolMap`]): design B's
//! ([`crate::DoubleSnapshot`], C as first built) or the flat one with runs ([`FlatSnapshot`], in
//! use; its store calls' grouping and publish points are logged too, `LogOp::Seal`/`Settle`).
//! Same writer logic as B.
//! B keeps exactly two copies, so after a publish the writer needs back the copy readers were
//! using, and on an oversubscribed box it waits for a reader preempted mid-lookup (B ingests
//! 121–201K events/s with two readers spinning; see `docs/index.md`). Here every previously
//! published copy becomes a *spare* tagged with the log position it reflects. Before the next
//! write the writer takes the freshest spare no reader holds (`Arc::try_unwrap` succeeds: refcount
//! 1, and nobody can load it again since it is no longer published) and replays the log from its
//! position. Only when every spare is held does it copy the published map, which adds a copy to the
//! pool, up to [`MAX_COPIES`] in all; past that it waits as B does (at most [`RECLAIM_WAIT`]) and
//! then replaces the laggiest held spare with a copy.
//!
//! With R readers each holding at most one snapshot at a time, R + 2 copies mean the writer never
//! waits; [`MAX_COPIES`] = 3 covers the common case (one reader preempted on an old copy) at
//! half a map more memory, and only under reader contention: without readers holding old copies
//! the pool stays at B's two. The log is trimmed to the oldest spare's position; a spare more
//! than [`MAX_LAG_OPS`] behind (a snapshot held for long with `load_full()`) is let go — its
//! holder keeps it alive, the writer just stops planning to reuse it.
//!
//! Readers are exactly B's: `arc-swap` load, no lock; a published snapshot is never mutated.

use std::sync::Arc;

use arc_swap::ArcSwap;

use kvroute_common::BlockHash;

use crate::double::{LOG_KEEP_OPS, LogOp, ReclaimWait};
use crate::flat::FlatSnapshot;
use crate::writer::{Backend, Writer};
use crate::{IndexStats, PodIdx};

/// A snapshot type the pool keeps copies of: cloned to grow the pool, changed only through
/// `link`/`unlink` (so replaying the op log brings a copy up to date).
pub trait PoolMap: Clone + Default {
    /// Adds `pod` to `block`; returns (the block is new, the pair is new).
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool);
    /// Removes `pod` from `block`; returns (the pair was present, the block is now gone).
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool);
    /// True when [`PoolMap::seal`] does something (so the pool logs the blocks for other copies).
    const SEALS: bool = false;
    /// After a store call linked `blocks` (in the call's order): lets the map group them (runs).
    /// Must not change which pods hold which block.
    fn seal(&mut self, _blocks: &[BlockHash]) {}
    /// Before a publish: finishes any grouping left pending by unlinks. Changes no pods.
    fn settle(&mut self) {}
    /// The stats published with this copy.
    fn stats(&self) -> IndexStats;
    /// Sets the stats published with this copy.
    fn set_stats(&mut self, stats: IndexStats);
    /// Heap bytes of this copy (allocated capacity).
    fn heap_bytes(&self) -> u64;
}

/// Applies `ops` in order to `copy` (bringing a copy that lacks them up to date).
fn replay<S: PoolMap>(copy: &mut S, ops: &[LogOp]) {
    let mut sealing: Vec<BlockHash> = Vec::new();
    for op in ops {
        if !sealing.is_empty() && !matches!(op, LogOp::Seal { first: false, .. }) {
            copy.seal(&sealing);
            sealing.clear();
        }
        match *op {
            LogOp::Link(p, h) => {
                let _ = copy.link(p, h);
            }
            LogOp::Unlink(p, h) => {
                let _ = copy.unlink(p, h);
            }
            LogOp::Seal { block, .. } => sealing.push(BlockHash(block)),
            LogOp::Settle => copy.settle(),
        }
    }
    if !sealing.is_empty() {
        copy.seal(&sealing);
    }
}

/// Most map copies the writer keeps (writable or spare, plus the published one), by default.
pub const MAX_COPIES: usize = 3;
/// Longest the writer waits, once the pool is full and every spare is held, before copying
/// (the same wait as design B's).
pub use crate::double::RECLAIM_WAIT;
/// A spare lagging the writer by more ops than this is dropped rather than kept up to date
/// (16 bytes of log per op: 4 MiB). A spare no write needed for that long (a fresher one was
/// always free, or a reader holds it) is not worth its memory; replaying that many ops costs
/// about as much as copying a 1M-entry map.
pub const MAX_LAG_OPS: u64 = 1 << 18;

/// A previously published copy and the absolute log position it reflects.
#[derive(Debug)]
struct Spare<S> {
    snap: Arc<S>,
    at: u64,
}

/// Writer side of design C, keeping at most `MAX` map copies (at least 2) of snapshot type `S`:
/// [`FlatSnapshot`] (in use) or [`crate::DoubleSnapshot`] (design C as first built, hashbrown map; kept
/// for the side-by-side benchmark).
#[derive(Debug)]
pub struct PooledBackend<const MAX: usize = MAX_COPIES, S = FlatSnapshot> {
    /// The copy the writer owns (refcount 1), at log position `head`. `None` after a publish.
    writable: Option<S>,
    /// Earlier published copies, possibly still held by readers.
    spares: Vec<Spare<S>>,
    /// Ops from absolute position `log_base` to `head`.
    log: Vec<LogOp>,
    log_base: u64,
    head: u64,
    /// Log position of the published copy.
    published_at: u64,
    published: Arc<ArcSwap<S>>,
    copies: u64,
    waits: u64,
}

impl<const MAX: usize, S: PoolMap> PooledBackend<MAX, S> {
    /// Times the writer copied the published map because readers held every spare (growing the
    /// pool, or replacing a spare held past [`RECLAIM_WAIT`]).
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Times the pool was full and every spare held, so the writer had to wait.
    pub fn waits(&self) -> u64 {
        self.waits
    }

    /// Map copies currently kept by the writer and the published one.
    pub fn copies_held(&self) -> usize {
        1 + self.spares.len() + usize::from(self.writable.is_some())
    }

    fn writable(&mut self) -> &mut S {
        if self.writable.is_none() {
            let copy = match self.take_spare() {
                Some(copy) => copy,
                None => S::clone(&self.published.load()),
            };
            self.writable = Some(copy);
        }
        self.writable.get_or_insert_with(S::default)
    }

    /// The freshest spare no reader holds, brought up to `head`; `None` when the published map must
    /// be copied instead (no spare yet, or every spare held).
    fn take_spare(&mut self) -> Option<S> {
        if self.spares.is_empty() {
            return None;
        }
        let mut wait = ReclaimWait::new();
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

    fn try_take_free(&mut self) -> Option<S> {
        loop {
            let i = (0..self.spares.len())
                .filter(|&i| Arc::strong_count(&self.spares[i].snap) == 1)
                .max_by_key(|&i| self.spares[i].at)?;
            let Spare { snap, at } = self.spares.swap_remove(i);
            match Arc::try_unwrap(snap) {
                Ok(mut copy) => {
                    let from = usize::try_from(at.saturating_sub(self.log_base)).unwrap_or(usize::MAX);
                    replay(&mut copy, self.log.get(from..).unwrap_or(&[]));
                    self.trim_log();
                    return Some(copy);
                }
                // A reader took a reference between the two checks: keep it, look again.
                Err(snap) => self.spares.push(Spare { snap, at }),
            }
        }
    }

    /// Drops spares lagging more than [`MAX_LAG_OPS`], then the log before the oldest spare.
    fn trim_log(&mut self) {
        let head = self.head;
        self.spares.retain(|s| head - s.at <= MAX_LAG_OPS);
        let oldest = self.spares.iter().map(|s| s.at).min().unwrap_or(head);
        let cut = usize::try_from(oldest.saturating_sub(self.log_base)).unwrap_or(usize::MAX).min(self.log.len());
        if cut > 0 {
            self.log.drain(..cut);
            self.log_base += cut as u64;
        }
        if self.log.is_empty() {
            // A resync or start-up batch can grow the log to the index size: give it back.
            self.log.shrink_to(LOG_KEEP_OPS);
        }
    }

    fn record(&mut self, op: LogOp) {
        self.log.push(op);
        self.head += 1;
    }
}

impl<const MAX: usize, S: PoolMap> Backend for PooledBackend<MAX, S> {
    type Snapshot = S;

    fn new(published: Arc<ArcSwap<S>>) -> Self {
        PooledBackend {
            writable: None,
            spares: Vec::new(),
            log: Vec::new(),
            log_base: 0,
            head: 0,
            published_at: 0,
            published,
            copies: 0,
            waits: 0,
        }
    }

    #[inline]
    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = self.writable().link(pod, block);
        self.record(LogOp::Link(pod, block));
        r
    }

    #[inline]
    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = self.writable().unlink(pod, block);
        self.record(LogOp::Unlink(pod, block));
        r
    }

    fn seal(&mut self, blocks: &[BlockHash]) {
        if !S::SEALS || blocks.len() < 2 {
            return;
        }
        self.writable().seal(blocks);
        for (k, b) in blocks.iter().enumerate() {
            self.record(LogOp::Seal { block: b.0, first: k == 0 });
        }
    }

    fn publish(&mut self, stats: IndexStats) {
        if self.writable.is_none() {
            if self.published.load().stats() == stats {
                return;
            }
            // Only the stats changed (e.g. stores dropped over the cap): republish them.
            self.writable();
        }
        if S::SEALS && self.writable.is_some() {
            self.writable().settle();
            self.record(LogOp::Settle);
        }
        let Some(mut snap) = self.writable.take() else {
            return;
        };
        snap.set_stats(stats);
        let old = self.published.swap(Arc::new(snap));
        self.spares.push(Spare { snap: old, at: self.published_at });
        self.published_at = self.head;
        self.trim_log();
    }

    fn map_bytes(&self) -> u64 {
        let published = self.published.load().heap_bytes();
        let writable = self.writable.as_ref().map_or(0, S::heap_bytes);
        let spares: u64 = self.spares.iter().map(|s| s.snap.heap_bytes()).sum();
        published + writable + spares
    }
}

/// The single writer of design C (flat layout).
pub type PooledWriter = Writer<PooledBackend>;
