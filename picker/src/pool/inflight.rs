//! Per-pod in-flight tracking (docs/design.md §4 queueDepth).
//!
//! Each pod keeps the routing time (wall clock, ms since the Unix epoch) of every request the
//! picker routed to it and has not seen finish, sorted. queueDepth = the last report's
//! `num_requests_waiting` + the in-flight requests routed at or after that report's
//! `observed_at_unix_ms` (earlier ones were already counted by the engine).
//!
//! A decision holds its reservation as an [`InFlightSlot`] for the life of the request; dropping
//! the slot releases it.
//!
//! Concurrency: a tiny `parking_lot::Mutex` per pod, held for a binary search and an insert or a
//! remove; never across an await. Reservation happens under the pool's selection lock (see
//! [`Selection`](super::Selection)), so a decision and its reservation are atomic with respect to
//! other decisions. A decision reads every candidate's count since its report; it takes no lock
//! for a pod whose report has not changed since the last count: the last count's report time
//! and how many requests were routed before it are kept beside the list, updated with it, and
//! read as a seqlock (docs/design.md §4 "Decision speed").

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;

use super::PodRecord;
use super::{SharedFit, TtftFit};

/// Time constant of a pod's routed rate ([`InFlight::routed_rate`]), ms: a minute spans dozens
/// of a busy pod's requests, so a prefix's share of the traffic shows, and still follows a shift
/// in what is popular within a few minutes.
pub(crate) const ROUTED_RATE_TAU_MS: f64 = 60_000.0;

/// The in-flight requests of one pod. In field order ([`PodRecord`]'s layout): what a decision
/// reads comes first.
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct InFlight {
    /// `slots.len()`, written under the lock, so an idle pod's queue depth needs no lock.
    count: AtomicU32,
    /// The pod's learned TTFT model (docs/design.md §4 "Load and predicted TTFT"), fed by its
    /// requests' first tokens ([`InFlightSlot::observe_ttft`]).
    pub(crate) ttft: SharedFit,
    /// Even while `count`, `since_ms` and `before` agree; odd while a writer (holding `slots`'
    /// lock) changes them.
    since_seq: AtomicU64,
    /// The report time [`InFlight::since`] last counted from, ms.
    since_ms: AtomicI64,
    /// How many requests in flight were routed before `since_ms`.
    before: AtomicU32,
    /// Requests routed here, each weighing `exp(−age / ROUTED_RATE_TAU_MS)`, as of
    /// `routed_at_ms` (`f64` bits). Written only by [`InFlight::reserve`], which runs under the
    /// pool's selection lock; a read outside it (`explain`) may pair a count with the time before.
    routed: AtomicU64,
    /// The last routing time, ms.
    routed_at_ms: AtomicI64,
    /// `(routed_at_unix_ms, slot id)`, sorted ascending. After the counts: its lock, taken by every
    /// reservation and release and by the first count after a pod's new report, shares a cache
    /// line with the list's header rather than with the fit every decision reads.
    slots: Mutex<Vec<(i64, u64)>>,
    /// The sums `ttft` is solved from, which only first tokens read and change: off the lines
    /// every decision reads (the last of them shares a line with the record's status pointer and
    /// block count, which a new prefix's placement reads).
    ttft_sums: Mutex<TtftFit>,
}

// What a decision reads of every candidate's record (see [`PodRecord`]) ends within its first two
// cache lines; the count since a report (`since_seq` to `before`), read only for a pod with
// requests in flight, may lie on the third.
const _: () = assert!(
    std::mem::offset_of!(PodRecord, inflight) + std::mem::offset_of!(InFlight, ttft) + std::mem::size_of::<SharedFit>()
        <= 128
);

impl InFlight {
    /// Records a request routed at `routed_ms` under slot `id`.
    pub(crate) fn reserve(&self, routed_ms: i64, id: u64) {
        {
            let mut s = self.slots.lock();
            let pos = s.partition_point(|e| *e <= (routed_ms, id));
            s.insert(pos, (routed_ms, id));
            self.publish_change(s.len(), routed_ms, true);
        }
        let (count, at) = self.routed_count();
        let count = decayed((count, at), routed_ms) + 1.0;
        self.routed.store(count.to_bits(), Ordering::Relaxed);
        self.routed_at_ms.store(routed_ms.max(at), Ordering::Relaxed);
    }

    /// The stored `(count, at_ms)` of the routed rate, not brought forward.
    fn routed_count(&self) -> (f64, i64) {
        (f64::from_bits(self.routed.load(Ordering::Relaxed)), self.routed_at_ms.load(Ordering::Relaxed))
    }

    /// The pod's routed rate at `now_ms`: the requests routed here, each weighted by
    /// `exp(−age / ROUTED_RATE_TAU_MS)` (requests per minute, smoothed). ≥ 0; 0 for a pod never
    /// routed to. A clock read earlier than the last routing decays nothing.
    pub(crate) fn routed_rate(&self, now_ms: i64) -> f64 {
        decayed(self.routed_count(), now_ms)
    }

    /// Forgets slot `id` (request finished, any way). Unknown slots are ignored.
    pub(crate) fn release(&self, routed_ms: i64, id: u64) {
        let mut s = self.slots.lock();
        if let Ok(pos) = s.binary_search(&(routed_ms, id)) {
            s.remove(pos);
            self.publish_change(s.len(), routed_ms, false);
        }
    }

    /// After the list (now `len` long) gained (`added`) or lost the request routed at
    /// `routed_ms`: publishes the length and the count routed before `since_ms`, one more or one
    /// less when that request was. Call holding `slots`' lock.
    fn publish_change(&self, len: usize, routed_ms: i64, added: bool) {
        let before = self.before.load(Ordering::Relaxed);
        let early = u32::from(routed_ms < self.since_ms.load(Ordering::Relaxed));
        let before = if added { before.saturating_add(early) } else { before.saturating_sub(early) };
        self.publish(len, before, None);
    }

    /// Writes the list's length, the count routed before `since_ms` and, when given, a new
    /// `since_ms`, as one seqlock write. Call holding `slots`' lock (the only writer).
    fn publish(&self, len: usize, before: u32, since_ms: Option<i64>) {
        let seq = self.since_seq.load(Ordering::Relaxed);
        self.since_seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd sequence before the fields: a reader that sees any new field sees the
        // sequence odd or moved on when it reads it again.
        fence(Ordering::Release);
        self.count.store(u32::try_from(len).unwrap_or(u32::MAX), Ordering::Release);
        self.before.store(before, Ordering::Relaxed);
        if let Some(at) = since_ms {
            self.since_ms.store(at, Ordering::Relaxed);
        }
        self.since_seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// All requests in flight.
    pub(crate) fn len(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    /// Requests in flight routed at or after `since_ms`. Without a lock when the last count was
    /// from the same `since_ms` (a pod's report time changes only with its next report): the
    /// count then is kept up to date by every reservation and release.
    pub(crate) fn since(&self, since_ms: i64) -> u32 {
        // An idle pod: one read, on the record's first cache line.
        if self.count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let seq = self.since_seq.load(Ordering::Acquire);
        if seq.is_multiple_of(2) {
            let (count, at, before) = (
                self.count.load(Ordering::Relaxed),
                self.since_ms.load(Ordering::Relaxed),
                self.before.load(Ordering::Relaxed),
            );
            // Orders the reads before the sequence's second read (see [`InFlight::publish`]).
            fence(Ordering::Acquire);
            if self.since_seq.load(Ordering::Relaxed) == seq {
                if count == 0 {
                    return 0;
                }
                if at == since_ms {
                    return count.saturating_sub(before);
                }
            }
        }
        let s = self.slots.lock();
        let first = s.partition_point(|e| e.0 < since_ms);
        let before = u32::try_from(first).unwrap_or(u32::MAX);
        self.publish(s.len(), before, Some(since_ms));
        u32::try_from(s.len() - first).unwrap_or(u32::MAX)
    }
}

/// `(count, at_ms)` brought forward to `now_ms` (never backward).
fn decayed((count, at_ms): (f64, i64), now_ms: i64) -> f64 {
    let age = now_ms.saturating_sub(at_ms).max(0) as f64;
    count * (-age / ROUTED_RATE_TAU_MS).exp()
}

/// Held for the life of the request. Dropping it (stream ended, any way) releases the pod's
/// in-flight count.
pub struct InFlightSlot {
    pub(super) rec: Arc<PodRecord>,
    pub(super) id: u64,
    pub(super) routed_ms: i64,
    /// Predicted cached prompt tokens (matched index blocks × the index's block size).
    pub(super) predicted_tokens: u64,
    /// Tokens per engine block of the pod (the staleness tolerance).
    pub(super) block_size: u64,
    /// Told once when the slot is released, with its id (pending chains, the replica stream).
    pub(super) on_release: Option<(Arc<dyn ReleaseHook>, u64)>,
    /// The work (tokens) the pod had at routing, this request's uncached tokens included, its
    /// queue depth then and the TTFT then predicted (ms), until the first token is observed.
    pub(super) ttft: Option<(f64, f64, Option<f64>)>,
}

/// What [`InFlightSlot::observe_ttft`] made of a first token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TtftObservation {
    /// The pod's model learned it; `error_ms` = predicted − actual when a prediction was made.
    Learned {
        /// Predicted minus measured TTFT, ms (`None`: the model predicted nothing yet).
        error_ms: Option<f64>,
        /// The work at routing, tokens (what the fleet-wide model learns too).
        work_tokens: f64,
        /// The queue depth at routing.
        queue: f64,
        /// The TTFT measured, ms.
        ttft_ms: f64,
    },
    /// Out of range (negative, not finite, or over ten minutes): not learned.
    Refused,
    /// Nothing to learn: no work was recorded at routing, or the first token was seen before.
    Ignored,
}

/// Told when an [`InFlightSlot`] is released (the request ended, any way).
pub trait ReleaseHook: Send + Sync {
    /// Request `id` (as given to [`InFlightSlot::on_release`]) ended.
    fn released(&self, id: u64);
}

impl fmt::Debug for InFlightSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightSlot")
            .field("pod", &self.rec.name)
            .field("id", &self.id)
            .field("routed_ms", &self.routed_ms)
            .field("predicted_tokens", &self.predicted_tokens)
            .finish()
    }
}

impl InFlightSlot {
    /// Called when the engine's usage arrives: returns true when the routing was stale (actual
    /// cached tokens < predicted matched tokens by more than one engine block, docs/design.md §5).
    pub fn observe_cached_tokens(&self, cached_tokens: u32) -> bool {
        self.predicted_tokens > u64::from(cached_tokens) + self.block_size
    }

    /// Envoy could not connect to this slot's pod (its local 503 for a connection failure): the
    /// pod leaves the candidates until a TCP connect to it succeeds
    /// ([`Pool::probe_unreachable`](super::Pool::probe_unreachable)). True when the pod was not
    /// marked before (the mark is news to tell peer replicas).
    pub fn mark_unreachable(&self) -> bool {
        super::mark(&self.rec, "this replica")
    }

    /// Records the pod's work (tokens, this request's uncached ones included) and queue depth
    /// at routing and the TTFT predicted from them, for [`InFlightSlot::observe_ttft`].
    pub(crate) fn set_ttft_work(&mut self, work_tokens: f64, queue: u32, predicted_ms: Option<f64>) {
        self.ttft = Some((work_tokens, f64::from(queue), predicted_ms));
    }

    /// The TTFT predicted at routing, ms (`None`: the pod's model had not learned enough).
    pub fn predicted_ttft_ms(&self) -> Option<f64> {
        self.ttft.and_then(|(_, _, p)| p)
    }

    /// The request's first token came `ttft_ms` after its routing: the pod's TTFT model learns
    /// it (once per slot) and the prediction error is returned. Pass what it returns to
    /// [`CreditCounters::count_ttft`](crate::pending::CreditCounters::count_ttft), which teaches
    /// the fleet-wide model: a pod's own line is drawn toward that model's slope, and predicts
    /// nothing before it has learned.
    pub fn observe_ttft(&mut self, ttft_ms: f64) -> TtftObservation {
        let Some((work, queue, predicted)) = self.ttft.take() else { return TtftObservation::Ignored };
        let inflight = &self.rec.inflight;
        if !inflight.ttft.observe(&inflight.ttft_sums, work, queue, ttft_ms) {
            return TtftObservation::Refused;
        }
        TtftObservation::Learned { error_ms: predicted.map(|p| p - ttft_ms), work_tokens: work, queue, ttft_ms }
    }

    /// The pod's name, shared.
    pub fn pod_name(&self) -> &Arc<str> {
        &self.rec.name
    }

    /// The pod this slot is reserved on.
    pub fn pod(&self) -> &str {
        &self.rec.name
    }

    /// Tells `hook` once, with `id`, when the slot is released (replaces an earlier hook). No
    /// allocation: the hook is shared.
    pub(crate) fn on_release(&mut self, hook: Arc<dyn ReleaseHook>, id: u64) {
        self.on_release = Some((hook, id));
    }
}

impl Drop for InFlightSlot {
    fn drop(&mut self) {
        self.rec.inflight.release(self.routed_ms, self.id);
        if let Some((hook, id)) = self.on_release.take() {
            hook.released(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each routed request adds one to the rate, which halves every τ·ln 2 without traffic; a
    /// clock that steps back neither decays it nor loses the later time.
    #[test]
    fn routed_rate_counts_requests_and_fades_with_time() {
        let f = InFlight::default();
        assert_eq!(f.routed_rate(1_000), 0.0);
        f.reserve(1_000, 1);
        f.reserve(1_000, 2);
        assert!((f.routed_rate(1_000) - 2.0).abs() < 1e-9);
        let tau = ROUTED_RATE_TAU_MS as i64;
        assert!((f.routed_rate(1_000 + tau) - 2.0 / std::f64::consts::E).abs() < 1e-9);
        f.release(1_000, 1);
        assert!((f.routed_rate(1_000) - 2.0).abs() < 1e-9, "a finished request still counted as routed");
        f.reserve(500, 3);
        assert!((f.routed_rate(1_000) - 3.0).abs() < 1e-9, "an earlier clock adds without decay");
        assert!((f.routed_rate(400) - 3.0).abs() < 1e-9);
    }

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

    /// The lock-free repeat of a count stays exact: random reservations and releases between
    /// counts from a few report times, each checked against the list counted directly.
    #[test]
    fn repeated_counts_follow_every_reservation_and_release() {
        let f = InFlight::default();
        let mut x = 0x2545_F491_4F6C_DD1D_u64;
        let mut rand = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let mut held: Vec<(i64, u64)> = Vec::new();
        let mut since = 0;
        for id in 0..3000u64 {
            match rand(3) {
                0 => {
                    let at = rand(1000) as i64;
                    f.reserve(at, id);
                    held.push((at, id));
                }
                1 if !held.is_empty() => {
                    let (at, old) = held.swap_remove(rand(held.len() as u64) as usize);
                    f.release(at, old);
                }
                _ => {
                    // Reports come seldom: most counts repeat the last report time.
                    if rand(8) == 0 {
                        since = rand(1000) as i64;
                    }
                    let want = held.iter().filter(|(at, _)| *at >= since).count() as u32;
                    assert_eq!(f.since(since), want, "since {since} with {} in flight", held.len());
                    assert_eq!(f.since(since), want, "a repeat of since {since}");
                }
            }
        }
    }
}
