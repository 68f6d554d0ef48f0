//! Per-pod in-flight tracking (docs/design.md §4 queueDepth).
//!
//! Each pod keeps the routing time (wall clock, ms since the Unix epoch) of every request the
//! picker routed to it and has not seen finish, sorted. queueDepth = the last report's
//! `num_requests_waiting` + the in-flight requests routed at or after that report's
//! `observed_at_unix_ms` (earlier ones were already counted by the engine).
//!
//! Concurrency: a tiny `parking_lot::Mutex` per pod, held for a binary search and an insert or a
//! remove; never across an await. Reservation happens under the pool's selection lock, so a
//! decision and its reservation are atomic with respect to other decisions.

use std::sync::atomic::{AtomicU32, Ordering};

use parking_lot::Mutex;

/// The in-flight requests of one pod.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// `(routed_at_unix_ms, slot id)`, sorted ascending.
    slots: Mutex<Vec<(i64, u64)>>,
    /// `slots.len()`, written under the lock, so an idle pod's queue depth needs no lock.
    count: AtomicU32,
}

impl InFlight {
    /// Records a request routed at `routed_ms` under slot `id`.
    pub(crate) fn reserve(&self, routed_ms: i64, id: u64) {
        let mut s = self.slots.lock();
        let pos = s.partition_point(|e| *e <= (routed_ms, id));
        s.insert(pos, (routed_ms, id));
        self.count.store(u32::try_from(s.len()).unwrap_or(u32::MAX), Ordering::Release);
    }

    /// Forgets slot `id` (request finished, any way). Unknown slots are ignored.
    pub(crate) fn release(&self, routed_ms: i64, id: u64) {
        let mut s = self.slots.lock();
        if let Ok(pos) = s.binary_search(&(routed_ms, id)) {
            s.remove(pos);
            self.count.store(u32::try_from(s.len()).unwrap_or(u32::MAX), Ordering::Release);
        }
    }

    /// All requests in flight.
    pub(crate) fn len(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    /// Requests in flight routed at or after `since_ms`.
    pub(crate) fn since(&self, since_ms: i64) -> u32 {
        if self.count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let s = self.slots.lock();
        let first = s.partition_point(|e| e.0 < since_ms);
        u32::try_from(s.len() - first).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_requests_routed_since_the_report() {
        let f = InFlight::default();
        f.reserve(100, 1);
        f.reserve(200, 2);
        f.reserve(150, 3);
        assert_eq!(f.len(), 3);
        assert_eq!(f.since(150), 2);
        assert_eq!(f.since(201), 0);
        f.release(150, 3);
        f.release(150, 3);
        assert_eq!(f.since(0), 2);
    }
}
