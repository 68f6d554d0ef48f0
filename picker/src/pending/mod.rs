//! What a decision knows beyond the KV-event index: chains it (or a peer replica) routed and the
//! engines have not confirmed yet, and the requests peer replicas have in flight
//! (docs/design.md §3 "Pending entries", §4 "One view across replicas").
//!
//! - **Pending entries.** Between routing a new prefix to a pod and that pod's KV events, the
//!   index does not know where the prefix went; requests for the same prefix arriving in that
//!   window would scatter and prefill it again. So a decision records the request's chain as
//!   pending on the chosen pod ([`PendingTable`]) while the request is in flight and for
//!   `pending_ttl_ms` (default 2 s) after its routing; later decisions credit it like indexed
//!   blocks. At the end of its life an entry is counted confirmed (the pod's events stored it)
//!   or expired, and dropped either way.
//! - **Peer replicas.** With replication on ([`SharedView::enable_replication`]), every decision
//!   and every request end is also published as a [`ReplicaEvent`]; peers apply them
//!   ([`crate::score::Router::apply_peer`]), so each replica credits the others' pending chains and
//!   counts their in-flight requests in queueDepth: N replicas route like one. The transport is
//!   [`crate::replicas`].
//!
//! Time comes from a [`Clock`] (the wall clock in a running picker; the simulator's clock under
//! simulation), so the time-to-live replays faithfully.
//!
//! Concurrency: one mutex ([`SharedView::lock`]) over the table and the peers' in-flight counts,
//! taken by decisions inside the pool's selection lock (never the other way round) and by the
//! replica stream when it applies a peer's event; never held across an await. Events are
//! published under it, so a subscriber's snapshot and its live events neither overlap nor miss.
//!
//! Layering: on [`crate::pool`] only (its clock and the in-flight [`ReleaseHook`](crate::pool::ReleaseHook));
//! the router, the gateway and the replica stream build on this module, never the other way
//! round. What both the gateway and the replica transport need of a replica, its id and the
//! stream's counters ([`ReplicaIdentity`]), lives here for that reason.

mod clock;
mod table;

pub use clock::{Clock, ManualClock, SystemClock};
pub use table::{LOCAL, Origin, PendingCounts, PendingTable, Prefill};

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use kvroute_common::BlockHash;
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::broadcast;

use crate::index::PodIdx;

/// Default `pending_ttl_ms`: how long a routed chain counts as cached without the pod's KV events.
/// About a cold prefill of a few thousand tokens plus the agent's flush and the stream.
pub const DEFAULT_PENDING_TTL_MS: u64 = 2_000;
/// Default `pending_max_blocks`: most (block, pod) pending entries kept (≈ 40 MB at most).
pub const DEFAULT_PENDING_MAX_BLOCKS: usize = 1 << 20;
/// Most peer in-flight requests remembered (a peer that never reports an end cannot grow it).
pub const MAX_PEER_IN_FLIGHT: usize = 1 << 18;
/// A peer's in-flight request older than this is forgotten (its end was lost), ms.
pub const PEER_IN_FLIGHT_MAX_AGE_MS: i64 = 15 * 60 * 1000;
/// Events buffered per subscribing peer before it must resubscribe (and take a fresh snapshot).
pub const EVENT_BUFFER: usize = 16_384;

/// A decision or a request end, as replicas tell each other.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplicaEvent {
    /// A request was routed to `pod` at `routed_unix_ms`; `blocks` are pending there from the
    /// pod's index frontier on (empty when nothing new is pending).
    Routed {
        /// The sending replica's id for the request (unique per sender).
        id: u64,
        /// Pod name.
        pod: Arc<str>,
        /// Routing time, ms since the Unix epoch (the sender's clock).
        routed_unix_ms: i64,
        /// The chain from the pod's frontier on.
        blocks: Arc<[BlockHash]>,
    },
    /// The request `id` (sent earlier as `Routed`) ended, any way.
    Finished {
        /// The sending replica's id for the request.
        id: u64,
        /// Pod name.
        pod: Arc<str>,
    },
    /// Envoy could not connect to `pod` when the sender routed there: the pod leaves every
    /// replica's candidates until each one's own TCP probe connects to it again.
    Unreachable {
        /// Pod name.
        pod: Arc<str>,
    },
}

/// Counters of the replica stream ([`crate::replicas`]), for `/metrics`.
#[derive(Debug, Default)]
pub struct ReplicaCounters {
    /// Peer events applied.
    pub applied: AtomicU64,
    /// Peer events refused: over a bound, or naming a pod this replica does not know.
    pub refused: AtomicU64,
    /// Subscriptions to peers that ended (error, peer restart, lag).
    pub disconnects: AtomicU64,
    /// Peers currently subscribed to.
    pub connected: AtomicU64,
    /// Subscribers cut off for falling behind.
    pub lagged: AtomicU64,
}

/// This replica's identity and counters on the replica stream.
#[derive(Debug)]
pub struct ReplicaIdentity {
    /// Random per process.
    pub id: String,
    /// What the stream did.
    pub counters: ReplicaCounters,
}

impl ReplicaIdentity {
    /// A fresh random identity.
    pub fn new() -> Arc<Self> {
        Arc::new(ReplicaIdentity { id: uuid::Uuid::new_v4().to_string(), counters: ReplicaCounters::default() })
    }
}

/// Peer replicas' in-flight requests per pod (docs/design.md §4 queueDepth across replicas).
#[derive(Debug, Default)]
pub struct PeerInFlight {
    /// `(origin, id)` → `(pod, routed_ms)`.
    by_id: hashbrown::HashMap<(Origin, u64), (PodIdx, i64)>,
    /// Dense by pod: routing times, sorted.
    per_pod: Vec<Vec<i64>>,
    /// Insertion order, for the age bound: `(routed_ms, origin, id)`.
    order: VecDeque<(i64, Origin, u64)>,
}

impl PeerInFlight {
    /// Requests peers routed to `pod` at or after `since_ms` and have not seen end.
    pub fn since(&self, pod: PodIdx, since_ms: i64) -> u32 {
        self.per_pod.get(pod.as_usize()).map_or(0, |v| {
            let first = v.partition_point(|t| *t < since_ms);
            u32::try_from(v.len() - first).unwrap_or(u32::MAX)
        })
    }

    /// Every peer request in flight.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// No peer request in flight.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    fn add(&mut self, origin: Origin, id: u64, pod: PodIdx, routed_ms: i64, now_ms: i64) {
        self.prune(now_ms);
        if self.by_id.contains_key(&(origin, id)) {
            return;
        }
        while self.by_id.len() >= MAX_PEER_IN_FLIGHT {
            let Some((_, o, i)) = self.order.pop_front() else { break };
            self.remove(o, i);
        }
        self.by_id.insert((origin, id), (pod, routed_ms));
        let i = pod.as_usize();
        if i >= self.per_pod.len() {
            self.per_pod.resize_with(i + 1, Vec::new);
        }
        let v = &mut self.per_pod[i];
        let at = v.partition_point(|t| *t <= routed_ms);
        v.insert(at, routed_ms);
        self.order.push_back((routed_ms, origin, id));
    }

    fn remove(&mut self, origin: Origin, id: u64) {
        let Some((pod, routed_ms)) = self.by_id.remove(&(origin, id)) else { return };
        if let Some(v) = self.per_pod.get_mut(pod.as_usize())
            && let Ok(at) = v.binary_search(&routed_ms)
        {
            v.remove(at);
        }
    }

    /// Forgets every request of `origin` (its stream ended: no end will come).
    pub fn drop_origin(&mut self, origin: Origin) {
        let ids: Vec<u64> = self.by_id.keys().filter(|(o, _)| *o == origin).map(|(_, i)| *i).collect();
        for id in ids {
            self.remove(origin, id);
        }
    }

    fn prune(&mut self, now_ms: i64) {
        while let Some(&(t, o, i)) = self.order.front() {
            if t >= now_ms.saturating_sub(PEER_IN_FLIGHT_MAX_AGE_MS) && self.by_id.contains_key(&(o, i)) {
                break;
            }
            self.order.pop_front();
            if t < now_ms.saturating_sub(PEER_IN_FLIGHT_MAX_AGE_MS) {
                self.remove(o, i);
            }
        }
    }
}

/// Everything under the shared-view mutex.
#[derive(Debug)]
pub struct SharedState {
    /// Pending chains, this replica's and its peers'.
    pub pending: PendingTable,
    /// Peer replicas' in-flight requests.
    pub peers: PeerInFlight,
    /// This replica's requests in flight, by event id (only while replication is on): what a
    /// subscribing peer's snapshot lists.
    local: hashbrown::HashMap<u64, (Arc<str>, i64)>,
    events: Option<broadcast::Sender<ReplicaEvent>>,
}

impl SharedState {
    /// Publishes `ev` to subscribed peers (nothing without replication or subscribers).
    pub(crate) fn publish(&self, ev: ReplicaEvent) {
        if let Some(tx) = &self.events
            && tx.receiver_count() > 0
        {
            let _ = tx.send(ev);
        }
    }

    /// Whether decisions must publish their events.
    pub(crate) fn replicating(&self) -> bool {
        self.events.is_some()
    }

    /// Remembers this replica's request `id` on `pod` (for peers' snapshots).
    pub(crate) fn track_local(&mut self, id: u64, pod: Arc<str>, routed_ms: i64) {
        if self.events.is_some() {
            self.local.insert(id, (pod, routed_ms));
        }
    }
}

/// Counters a decision adds to (read by the metrics scrape).
#[derive(Debug, Default)]
pub struct CreditCounters {
    /// Blocks credited to chosen pods by the KV-event index (or approximate matches).
    pub indexed_blocks: AtomicU64,
    /// Blocks credited to chosen pods only because they were pending.
    pub pending_blocks: AtomicU64,
    /// Decisions the pile guard sent to the least loaded candidate (docs/design.md §4).
    pub pile_redirects: AtomicU64,
    /// Decisions that kept a request on a pod holding its prefix, at `max_queue` or past the
    /// pile guard, because the fleet was full (docs/design.md §4 "A full fleet").
    pub full_fleet_stays: AtomicU64,
    /// Candidates whose pending credit was withheld for their queue (`pending_queue_share`).
    pub pending_withheld: AtomicU64,
    /// New prefixes placed by routed rate and cached blocks (popularity unequal or unknown).
    pub new_prefix_by_traffic: AtomicU64,
    /// New prefixes placed by cached blocks alone (the recent prefixes equally popular).
    pub new_prefix_by_cache: AtomicU64,
    /// Candidates scored by the seed's load formula because their in-flight load was unknown
    /// (TTFT model not learned yet) under `load_source: inflight`.
    pub load_fallbacks: AtomicU64,
    /// `spill_rule: ttft` decisions taken by the seed's rule: a candidate had no prediction, or
    /// the cache-hot pod's KV was 90 % held.
    pub ttft_fallbacks: AtomicU64,
    /// Decisions with an `x-slo-ttft-ms` no candidate was predicted to meet.
    pub slo_misses: AtomicU64,
    /// First tokens the TTFT models learned from.
    pub ttft_observed: AtomicU64,
    /// First tokens refused as absurd (negative, not finite, over ten minutes).
    pub ttft_refused: AtomicU64,
    /// Of `ttft_observed`, those that had a prediction.
    pub ttft_predicted: AtomicU64,
    /// Σ |predicted − actual| TTFT over `ttft_predicted`, ms.
    pub ttft_abs_error_ms: AtomicU64,
    /// Σ (predicted − actual) over `ttft_predicted` where the prediction was too high, ms (the
    /// rest of `ttft_abs_error_ms` was too low).
    pub ttft_over_ms: AtomicU64,
    /// The TTFT model of every first token this replica saw, whatever the pod: what a pod whose
    /// own model has not learned yet is predicted with (docs/design.md §4).
    pub fleet_ttft: Mutex<crate::pool::TtftFit>,
}

impl CreditCounters {
    /// The load and TTFT models' counts, for the metrics scrape.
    pub fn ttft_counts(&self) -> crate::metrics::TtftCounts {
        crate::metrics::TtftCounts {
            load_fallbacks: self.load_fallbacks.load(Ordering::Relaxed),
            ttft_fallbacks: self.ttft_fallbacks.load(Ordering::Relaxed),
            slo_misses: self.slo_misses.load(Ordering::Relaxed),
            refused: self.ttft_refused.load(Ordering::Relaxed),
            observed: self.ttft_observed.load(Ordering::Relaxed),
            predicted: self.ttft_predicted.load(Ordering::Relaxed),
            abs_error_ms: self.ttft_abs_error_ms.load(Ordering::Relaxed),
            over_ms: self.ttft_over_ms.load(Ordering::Relaxed),
        }
    }

    /// Counts what [`InFlightSlot::observe_ttft`](crate::pool::InFlightSlot::observe_ttft) made
    /// of a first token, and teaches it to the fleet-wide model.
    pub fn count_ttft(&self, seen: crate::pool::TtftObservation) {
        use crate::pool::TtftObservation;
        match seen {
            TtftObservation::Learned { error_ms, work_tokens, queue, ttft_ms } => {
                self.fleet_ttft.lock().observe(work_tokens, queue, ttft_ms);
                self.ttft_observed.fetch_add(1, Ordering::Relaxed);
                if let Some(e) = error_ms.filter(|e| e.is_finite()) {
                    self.ttft_predicted.fetch_add(1, Ordering::Relaxed);
                    self.ttft_abs_error_ms.fetch_add(e.abs().round() as u64, Ordering::Relaxed);
                    if e > 0.0 {
                        self.ttft_over_ms.fetch_add(e.round() as u64, Ordering::Relaxed);
                    }
                }
            }
            TtftObservation::Refused => {
                self.ttft_refused.fetch_add(1, Ordering::Relaxed);
            }
            TtftObservation::Ignored => {}
        }
    }
}

/// The pending table, peers' in-flight requests and the replica event stream (module docs).
#[derive(Debug)]
pub struct SharedView {
    state: Mutex<SharedState>,
    clock: Arc<dyn Clock>,
    next_id: AtomicU64,
    /// Cache credit by source, for `epp_cache_credit_blocks_total`.
    pub credit: CreditCounters,
}

impl SharedView {
    /// A view whose pending chains live `ttl_ms` (0 disables them), at most `max_blocks`
    /// entries, on `clock`.
    pub fn new(ttl_ms: u64, max_blocks: usize, clock: Arc<dyn Clock>) -> Self {
        SharedView {
            state: Mutex::new(SharedState {
                pending: PendingTable::new(ttl_ms, max_blocks),
                peers: PeerInFlight::default(),
                local: hashbrown::HashMap::new(),
                events: None,
            }),
            clock,
            next_id: AtomicU64::new(1),
            credit: CreditCounters::default(),
        }
    }

    /// The clock decisions read.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Takes the mutex (see the module docs for the lock order).
    pub fn lock(&self) -> MutexGuard<'_, SharedState> {
        self.state.lock()
    }

    /// A fresh event id for a decision.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Turns replication on: from now on every decision and request end is published. Returns
    /// the sender peers subscribe through ([`SharedView::subscribe`]). Idempotent.
    pub fn enable_replication(&self) -> broadcast::Sender<ReplicaEvent> {
        let mut st = self.state.lock();
        st.events.get_or_insert_with(|| broadcast::channel(EVENT_BUFFER).0).clone()
    }

    /// A peer subscribes: the live events from now on, and a snapshot of what is pending and in
    /// flight here now (the two neither overlap nor leave a gap: events are published under the
    /// same mutex). `name` resolves a pod index to its name (pods that left are skipped). The
    /// snapshot is this replica's in-flight requests as `Routed` without blocks, then its own
    /// pending chains as `Routed` with id 0 (no in-flight effect). `None` without replication.
    pub fn subscribe(
        &self,
        name: impl Fn(PodIdx) -> Option<Arc<str>>,
    ) -> Option<(Vec<ReplicaEvent>, broadcast::Receiver<ReplicaEvent>)> {
        let st = self.state.lock();
        let rx = st.events.as_ref()?.subscribe();
        let mut snapshot: Vec<ReplicaEvent> = st
            .local
            .iter()
            .map(|(id, (pod, at))| ReplicaEvent::Routed {
                id: *id,
                pod: pod.clone(),
                routed_unix_ms: *at,
                blocks: Arc::from([]),
            })
            .collect();
        let now = self.clock.now_unix_ms();
        for (pod, blocks, origin) in st.pending.chains() {
            if origin != LOCAL {
                continue;
            }
            if let Some(pod) = name(pod) {
                snapshot.push(ReplicaEvent::Routed { id: 0, pod, routed_unix_ms: now, blocks: blocks.clone() });
            }
        }
        Some((snapshot, rx))
    }

    /// This replica's request `id` ended: its pending chain is unpinned, the peers are told.
    pub fn finished(&self, id: u64) {
        let now = self.clock.now_unix_ms();
        let mut st = self.state.lock();
        st.pending.release(LOCAL, id, now);
        if let Some((pod, _)) = st.local.remove(&id) {
            st.publish(ReplicaEvent::Finished { id, pod });
        }
    }

    /// Applies a peer replica's `Routed` or `Finished` (`origin` ≠ [`LOCAL`]): its pending chain is
    /// credited here, its request counts in the pod's queueDepth until its `Finished`
    /// (`Unreachable` is the pool's: false here). `resolve` maps a pod name
    /// to its index; events for pods this replica does not know are ignored (returns false).
    pub fn apply_peer(&self, origin: Origin, ev: &ReplicaEvent, resolve: impl Fn(&str) -> Option<PodIdx>) -> bool {
        if origin == LOCAL {
            return false;
        }
        let now = self.clock.now_unix_ms();
        let mut st = self.state.lock();
        match ev {
            ReplicaEvent::Routed { id, pod, routed_unix_ms, blocks } => {
                let Some(idx) = resolve(pod) else { return false };
                if !blocks.is_empty() {
                    st.pending.record(idx, blocks.clone(), now, origin, (*id != 0).then_some(*id));
                }
                if *id != 0 {
                    st.peers.add(origin, *id, idx, *routed_unix_ms, now);
                }
                true
            }
            ReplicaEvent::Finished { id, .. } => {
                st.peers.remove(origin, *id);
                st.pending.release(origin, *id, now);
                true
            }
            // The pool's business, not the view's ([`crate::score::Router::apply_peer`]).
            ReplicaEvent::Unreachable { .. } => false,
        }
    }

    /// Envoy could not connect to `pod`, newly seen by this replica: the peers are told
    /// ([`ReplicaEvent::Unreachable`]). Nothing without replication or subscribers.
    pub fn unreachable(&self, pod: Arc<str>) {
        self.state.lock().publish(ReplicaEvent::Unreachable { pod });
    }

    /// A peer's stream ended: its in-flight requests are forgotten (no end will come for them);
    /// its pending chains stay until their time-to-live.
    pub fn peer_gone(&self, origin: Origin) {
        let now = self.clock.now_unix_ms();
        let mut st = self.state.lock();
        st.peers.drop_origin(origin);
        st.pending.release_origin(origin, now);
    }
}

impl crate::pool::ReleaseHook for SharedView {
    fn released(&self, id: u64) {
        self.finished(id);
    }
}
