//! kvroute through its real code: a live [`Pool`] (its writer thread, the real prefix index and its
//! snapshots) and the real [`Router::route`] (prefix walk, filters, queue spill, the five scorers,
//! selection with its tie-breaks, in-flight reservation).
//!
//! How the simulation drives it:
//! - Each pod is registered with a `PoolUpdate::Snapshot`; every [`PodReport`] becomes a
//!   `PoolUpdate::Delta` (stored/removed blocks and stats), queued when the report arrives and
//!   applied (`Pool::update` + `Pool::sync`) before the next decision, so the picker sees exactly
//!   the reports that reached it by then.
//! - Time: the router runs on a [`ManualClock`] set to the simulated time before every call, and
//!   engine stats carry the simulated read time as `observed_at_unix_ms`, so the picker's own
//!   rules run as in production: a request's in-flight slot counts in queueDepth from its routing
//!   until a stats read after it (docs/design.md §4), the slot is held until the response ends,
//!   and pending chains expire after `pending_ttl_ms` of simulated time (docs/design.md §3).
//! - Replicas: with `shared_view`, each replica publishes its decisions and request ends
//!   ([`ReplicaEvent`]) and the simulation delivers them to the other replicas after the replica
//!   stream's delay ([`Policy::take_peer_events`] / [`Policy::on_peer_event`]), the way
//!   `kvroute_picker::replicas` carries them between pickers.
//! - [`CacheView::Approximate`]: kvroute's approximate mode (docs/design.md §6) as the picker runs it:
//!   the request's text chain (64-character chunks, at most 256) matched against the shipped
//!   [`ApproxStore`] and given to [`Router::route_with`]; the chosen pod is recorded in the store.
//!   The engines' KV events are not used (stats still are).
//!
//! Every decision goes through `Router::route`/`route_with`, so a change to the picker's routing
//! (scoring, filters, what the router records) shows in the simulation without a change here.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_picker::approx::{ApproxStore, DEFAULT_MAX_BLOCKS};
use kvroute_picker::pending::{ManualClock, ReplicaEvent};
use kvroute_picker::pool::{InFlightSlot, Pool, PoolConfig, PoolUpdate};
use kvroute_picker::score::{PrefixMatches, RouteRequest, Router, ScoringConfig};
use kvroute_proto::agent::v1::{PodInfo, PodStats};

use super::routed::approx_store;
use super::{PodReport, Policy, pod_names};
use crate::SimError;
use crate::engine::EngineStats;
use crate::workload::{MODEL, SimRequest};

/// Where the router's prefix index comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheView {
    /// The engines' KV events (kvroute's precise mode).
    Precise,
    /// The router's own record of what it routed where (text chunks), `capacity_blocks` per pod, LRU.
    Approximate {
        /// Chunks each pod is assumed to hold.
        capacity_blocks: usize,
    },
}

/// kvroute's real pool and router under simulation.
pub struct KvroutePolicy {
    name: String,
    rt: tokio::runtime::Runtime,
    pool: Arc<Pool>,
    router: Router,
    names: HashMap<String, usize>,
    pod_names: Vec<String>,
    pending: Vec<PoolUpdate>,
    seq: Vec<u64>,
    /// Per pod: (request id, slot) of the requests in flight.
    slots: Vec<Vec<(usize, InFlightSlot)>>,
    store: Option<ApproxStore>,
    clock: Arc<ManualClock>,
    /// This replica's events for its peers (with `shared_view`).
    events: Option<tokio::sync::broadcast::Receiver<ReplicaEvent>>,
    /// Route errors answered by falling back to pod 0.
    pub fallbacks: u64,
    /// Decision lines since the last [`Policy::take_decisions`] (`None`: not recording).
    decisions: Option<Vec<String>>,
}

impl std::fmt::Debug for KvroutePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvroutePolicy").field("name", &self.name).finish_non_exhaustive()
    }
}

/// Simulated time 0 as a Unix time, ms (any fixed instant: only differences matter).
pub const SIM_EPOCH_MS: i64 = 1_798_761_600_000;

/// Simulated µs → the router clock's Unix ms.
pub fn sim_ms(us: u64) -> i64 {
    SIM_EPOCH_MS + i64::try_from(us / 1000).unwrap_or(i64::MAX / 2)
}

fn to_stats(s: &EngineStats, read_us: u64) -> PodStats {
    PodStats {
        observed_at_unix_ms: sim_ms(read_us),
        num_requests_waiting: s.waiting,
        num_requests_running: s.running,
        kv_cache_usage: s.kv_usage,
        gpu_utilization: s.gpu_utilization,
        health_score: 1.0,
        running_adapters: s.adapters.clone(),
        ready: true,
        ..PodStats::default()
    }
}

impl KvroutePolicy {
    /// Registers `pods` idle pods with a fresh pool and a router using `config`. With
    /// `shared_view`, the router publishes its decisions for peer replicas.
    pub fn new(
        name: &str,
        config: ScoringConfig,
        pods: usize,
        view: CacheView,
        shared_view: bool,
    ) -> Result<Self, SimError> {
        let rt = tokio::runtime::Builder::new_current_thread().build().map_err(SimError::Runtime)?;
        let pool = Pool::new(PoolConfig { grace_ttl_ms: 3_600_000, ..PoolConfig::default() });
        let clock = Arc::new(ManualClock::new(SIM_EPOCH_MS));
        let router =
            Router::with_clock(pool.clone(), config, clock.clone()).map_err(|e| SimError::Scoring(e.to_string()))?;
        let events = if shared_view {
            router.shared().enable_replication();
            router.subscribe_peer().map(|(_, rx)| rx)
        } else {
            None
        };
        let mut names = HashMap::new();
        let mut pending = Vec::new();
        let pod_names = pod_names(pods);
        for (i, name) in pod_names.iter().enumerate() {
            names.insert(name.clone(), i);
            let info = PodInfo {
                pod: name.clone(),
                endpoint: format!("10.0.{}.{}:8000", i / 256, i % 256),
                model: MODEL.into(),
                block_size: 16,
                index_block_size: 16,
                annotations: Default::default(),
            };
            let stats = Some(to_stats(&EngineStats::default(), 0));
            pending.push(PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats, blocks: Vec::new() });
        }
        let store = match view {
            CacheView::Precise => None,
            CacheView::Approximate { capacity_blocks } => Some(approx_store(capacity_blocks, DEFAULT_MAX_BLOCKS)),
        };
        let mut p = KvroutePolicy {
            name: name.to_string(),
            rt,
            pool,
            router,
            names,
            pod_names,
            pending,
            seq: vec![0; pods],
            slots: (0..pods).map(|_| Vec::new()).collect(),
            store,
            clock,
            events,
            fallbacks: 0,
            decisions: None,
        };
        p.flush()?;
        Ok(p)
    }

    /// Records every decision from now on (see [`Policy::take_decisions`]).
    pub fn record_decisions(&mut self) {
        self.decisions.get_or_insert_with(Vec::new);
    }

    /// Applies every queued update and waits until readers see it.
    fn flush(&mut self) -> Result<(), SimError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let updates = std::mem::take(&mut self.pending);
        let pool = self.pool.clone();
        self.rt.block_on(async move {
            for u in updates {
                pool.update(u).await?;
            }
            pool.sync().await
        })?;
        Ok(())
    }

    fn delta(
        &mut self,
        pod: usize,
        cleared: bool,
        stored: Vec<kvroute_common::BlockHash>,
        removed: Vec<kvroute_common::BlockHash>,
        stats: Option<PodStats>,
    ) {
        let Some(seq) = self.seq.get_mut(pod) else { return };
        *seq += 1;
        self.pending.push(PoolUpdate::Delta {
            stream: 1,
            pod: self.pod_names[pod].clone(),
            seq: *seq,
            cleared,
            stored,
            removed,
            stats,
        });
    }
}

impl Policy for KvroutePolicy {
    fn name(&self) -> &str {
        &self.name
    }

    fn pick(&mut self, req: &SimRequest, now_us: u64) -> Result<usize, SimError> {
        self.clock.set(sim_ms(now_us));
        self.flush()?;
        let (chain, matches) = match &self.store {
            Some(store) => (&req.text_blocks, Some(store.match_chain(&req.text_blocks))),
            None => (&req.blocks, None),
        };
        let rr = RouteRequest { model: MODEL, adapter: req.adapter.as_deref(), block_hashes: chain, subset: None };
        let routed = self.router.route_with(&rr, matches.as_ref().map(|m| m as &dyn PrefixMatches));
        if let (Some(log), Ok(d)) = (self.decisions.as_mut(), &routed) {
            let candidates: Vec<String> = d
                .candidates
                .iter()
                .map(|c| {
                    format!(
                        "{} S={:.3} cache={:.3} matched={} pending={} load={:.3} queue={:.3} ttft_ms={}",
                        c.pod,
                        c.score,
                        c.cache,
                        c.matched_blocks,
                        c.pending_blocks,
                        c.load,
                        c.queue,
                        c.predicted_ttft_ms.map_or_else(String::new, |t| format!("{t:.0}"))
                    )
                })
                .collect();
            let opt = |v: Option<u64>| v.map_or_else(String::new, |v| v.to_string());
            log.push(format!(
                "{:.6},{},{},{},{},{},{}\n",
                now_us as f64 / 1e6,
                req.id,
                opt(req.group),
                opt(req.session),
                d.total_blocks,
                d.pod,
                candidates.join(";")
            ));
        }
        let (pod, slot) = match routed {
            Ok(d) => (self.names.get(&d.pod).copied().unwrap_or(0), Some(d.slot)),
            Err(_) => {
                self.fallbacks += 1;
                (0, None)
            }
        };
        if let Some(slot) = slot
            && let Some(list) = self.slots.get_mut(pod)
        {
            list.push((req.id, slot));
        }
        if let Some(store) = &self.store {
            store.record(&self.pod_names[pod], &req.text_blocks);
        }
        Ok(pod)
    }

    fn on_report(&mut self, report: &PodReport) {
        let stats = report.stats.as_ref().map(|s| to_stats(s, report.engine_time_us));
        // Approximate mode has no KV events: only the stats reach its pool.
        let precise = self.store.is_none();
        let (cleared, stored, removed) = if precise {
            (report.cleared, report.stored.clone(), report.removed.clone())
        } else {
            (false, Vec::new(), Vec::new())
        };
        if stats.is_some() || cleared || !stored.is_empty() || !removed.is_empty() {
            self.delta(report.pod, cleared, stored, removed, stats);
        }
    }

    fn on_finish(&mut self, req: &SimRequest, pod: usize, now_us: u64) {
        self.clock.set(sim_ms(now_us));
        if let Some(list) = self.slots.get_mut(pod) {
            list.retain(|(id, _)| *id != req.id);
        }
    }

    fn on_first_token(&mut self, req: &SimRequest, pod: usize, now_us: u64, ttft_us: u64) {
        self.clock.set(sim_ms(now_us));
        if let Some((_, slot)) = self.slots.get_mut(pod).and_then(|l| l.iter_mut().find(|(id, _)| *id == req.id)) {
            let seen = slot.observe_ttft(ttft_us as f64 / 1000.0);
            self.router.shared().credit.count_ttft(seen);
        }
    }

    fn take_decisions(&mut self) -> Vec<String> {
        self.decisions.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn take_peer_events(&mut self) -> Vec<ReplicaEvent> {
        let mut out = Vec::new();
        if let Some(rx) = &mut self.events {
            while let Ok(ev) = rx.try_recv() {
                out.push(ev);
            }
        }
        out
    }

    fn on_peer_event(&mut self, from: usize, ev: &ReplicaEvent, now_us: u64) {
        self.clock.set(sim_ms(now_us));
        // Origins are 1-based: 0 is the router's own.
        self.router.apply_peer(from as u64 + 1, ev);
    }
}
