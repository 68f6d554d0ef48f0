//! Design C-hb (docs/decisions/0002-index-snapshot-design.md): a pool of up to [`MAX_COPIES`]
//! copies of design B's hashbrown map, kept in step by replaying an op log. Before the next write
//! the writer takes the freshest spare no reader holds and replays the log from its position; when
//! readers hold every spare it copies the published map (growing the pool); past `MAX` copies it
//! waits as B does. A spare more than [`MAX_LAG_OPS`] behind is let go. The library's pool
//! (`kvroute_index::pool`) keeps this structure but copies dirty slots instead of replaying, over
//! the flat table.

use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_index::{Backend, IndexStats, MAX_COPIES, PodIdx, ReclaimWait, Writer};

use super::{DoubleSnapshot, LOG_KEEP_OPS, LogOp, SLOT_BYTES, map_link, map_unlink, replay};

/// A spare lagging the writer by more ops than this is dropped rather than kept up to date.
pub const MAX_LAG_OPS: u64 = 1 << 18;

/// A previously published copy and the absolute log position it reflects.
#[derive(Debug)]
struct Spare {
    snap: Arc<DoubleSnapshot>,
    at: u64,
}

/// Writer side of design C over hashbrown maps, keeping at most `MAX` copies (at least 2).
#[derive(Debug)]
pub struct PooledHbBackend<const MAX: usize = MAX_COPIES> {
    writable: Option<DoubleSnapshot>,
    spares: Vec<Spare>,
    log: Vec<LogOp>,
    log_base: u64,
    head: u64,
    published_at: u64,
    published: Arc<ArcSwap<DoubleSnapshot>>,
    copies: u64,
    waits: u64,
}

/// Design C over hashbrown maps with three copies, as benchmarked.
pub type PooledHashbrown = PooledHbBackend<MAX_COPIES>;

impl<const MAX: usize> PooledHbBackend<MAX> {
    /// Times the writer copied the published map because readers held every spare.
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

    fn writable(&mut self) -> &mut DoubleSnapshot {
        if self.writable.is_none() {
            let copy = match self.take_spare() {
                Some(copy) => copy,
                None => DoubleSnapshot::clone(&self.published.load()),
            };
            self.writable = Some(copy);
        }
        self.writable.get_or_insert_with(DoubleSnapshot::default)
    }

    fn take_spare(&mut self) -> Option<DoubleSnapshot> {
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
                if let Some(i) = (0..self.spares.len()).min_by_key(|&i| self.spares[i].at) {
                    self.spares.swap_remove(i);
                }
                self.trim_log();
                self.copies += 1;
                return None;
            }
        }
    }

    fn try_take_free(&mut self) -> Option<DoubleSnapshot> {
        loop {
            let i = (0..self.spares.len())
                .filter(|&i| Arc::strong_count(&self.spares[i].snap) == 1)
                .max_by_key(|&i| self.spares[i].at)?;
            let Spare { snap, at } = self.spares.swap_remove(i);
            match Arc::try_unwrap(snap) {
                Ok(mut copy) => {
                    let from = usize::try_from(at.saturating_sub(self.log_base)).unwrap_or(usize::MAX);
                    replay(&mut copy.map, self.log.get(from..).unwrap_or(&[]));
                    self.trim_log();
                    return Some(copy);
                }
                Err(snap) => self.spares.push(Spare { snap, at }),
            }
        }
    }

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
            self.log.shrink_to(LOG_KEEP_OPS);
        }
    }

    fn record(&mut self, op: LogOp) {
        self.log.push(op);
        self.head += 1;
    }
}

impl<const MAX: usize> Backend for PooledHbBackend<MAX> {
    type Snapshot = DoubleSnapshot;

    fn new(published: Arc<ArcSwap<DoubleSnapshot>>) -> Self {
        PooledHbBackend {
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

    fn holds(&self, pod: PodIdx, block: u64) -> bool {
        let held = |s: &DoubleSnapshot| s.map.get(&block).is_some_and(|set| set.as_slice().binary_search(&pod).is_ok());
        match &self.writable {
            Some(w) => held(w),
            None => held(&self.published.load()),
        }
    }

    fn link(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = map_link(&mut self.writable().map, pod, block);
        self.record(LogOp::Link(pod, block));
        r
    }

    fn unlink(&mut self, pod: PodIdx, block: u64) -> (bool, bool) {
        let r = map_unlink(&mut self.writable().map, pod, block);
        self.record(LogOp::Unlink(pod, block));
        r
    }

    fn publish(&mut self, stats: IndexStats) {
        if self.writable.is_none() {
            if self.published.load().stats == stats {
                return;
            }
            self.writable();
        }
        let Some(mut snap) = self.writable.take() else {
            return;
        };
        snap.stats = stats;
        let old = self.published.swap(Arc::new(snap));
        self.spares.push(Spare { snap: old, at: self.published_at });
        self.published_at = self.head;
        self.trim_log();
    }

    fn map_bytes(&self) -> u64 {
        let bytes = |s: &DoubleSnapshot| s.map.capacity() as u64 * SLOT_BYTES;
        let published = bytes(&self.published.load());
        let writable = self.writable.as_ref().map_or(0, bytes);
        let spares: u64 = self.spares.iter().map(|s| bytes(&s.snap)).sum();
        published + writable + spares
    }
}

/// The single writer of design C over hashbrown maps.
pub type PooledHbWriter = Writer<PooledHashbrown>;
