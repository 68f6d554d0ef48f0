//! kvroute through its real code: a live [`Pool`] (its writer thread, the real prefix index and its
//! snapshots) and the real [`Router::route`] (prefix walk, filters, queue spill, the five scorers,
//! selection with its tie-breaks, in-flight reservation).
//!
//! How the simulation drives it:
//! - Each pod is registered with a `PoolUpdate::Snapshot`; every [`PodReport`] becomes a
//!   `PoolUpdate::Delta` (stored/removed blocks and stats), queued when the report arrives and
//!   applied (`Pool::update` + `Pool::sync`) before the next decision, so the picker sees exactly
//!   the reports that reached it by then.
//! - In-flight accounting: the live pool counts slots routed at or after a report's wall-clock
//!   `observed_at_unix_ms`; simulated time is not wall-clock time, so the simulation reports
//!   `observed_at_unix_ms = 0` (every held slot counts) and itself drops a request's
//!   [`InFlightSlot`] when the first stats report read at or after its routing time reaches the
//!   picker (the engine's `num_requests_waiting` counts it from then on) or when its response ends,
//!   whichever is first. That is docs/design.md §4's queueDepth definition exactly.
//! - [`CacheView::Approximate`]: the same router, but the index is fed from the policy's own memory
//!   of where it routed each chain (GIE's estimated prefix cache, docs/design.md §6 approximate mode) instead
//!   of the engines' KV events.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_picker::pool::InFlightSlot;
use kvroute_picker::pool::{Pool, PoolConfig, PoolUpdate};
use kvroute_picker::score::{RouteRequest, Router, ScoringConfig};
use kvroute_proto::agent::v1::{PodInfo, PodStats};

use super::routed::RoutedMemory;
use super::{PodReport, Policy};
use crate::SimError;
use crate::engine::EngineStats;
use crate::workload::{MODEL, SimRequest};

/// Where the router's prefix index comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheView {
    /// The engines' KV events (kvroute's precise mode).
    Precise,
    /// The router's own record of what it routed where, `capacity_blocks` per pod, LRU.
    Approximate {
        /// Blocks each pod is assumed to hold.
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
    pending: Vec<PoolUpdate>,
    seq: Vec<u64>,
    /// Per pod: (routed at µs, request id, slot) not yet covered by a report.
    slots: Vec<Vec<(u64, usize, InFlightSlot)>>,
    memory: Option<RoutedMemory>,
    /// Route errors answered by falling back to pod 0.
    pub fallbacks: u64,
}

impl std::fmt::Debug for KvroutePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvroutePolicy").field("name", &self.name).finish_non_exhaustive()
    }
}

fn pod_name(i: usize) -> String {
    format!("pod-{i}")
}

fn to_stats(s: &EngineStats) -> PodStats {
    PodStats {
        observed_at_unix_ms: 0,
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
    /// Registers `pods` idle pods with a fresh pool and a router using `config`.
    pub fn new(name: &str, config: ScoringConfig, pods: usize, view: CacheView) -> Result<Self, SimError> {
        let rt = tokio::runtime::Builder::new_current_thread().build().map_err(SimError::Runtime)?;
        let pool = Pool::new(PoolConfig { grace_ttl_ms: 3_600_000, ..PoolConfig::default() });
        let router = Router::new(pool.clone(), config).map_err(|e| SimError::Scoring(e.to_string()))?;
        let mut names = HashMap::new();
        let mut pending = Vec::new();
        for i in 0..pods {
            names.insert(pod_name(i), i);
            let info = PodInfo {
                pod: pod_name(i),
                endpoint: format!("10.0.{}.{}:8000", i / 256, i % 256),
                model: MODEL.into(),
                block_size: 16,
                annotations: Default::default(),
            };
            let stats = Some(to_stats(&EngineStats::default()));
            pending.push(PoolUpdate::Snapshot { stream: 1, info, seq: 0, stats, blocks: Vec::new() });
        }
        let memory = match view {
            CacheView::Precise => None,
            CacheView::Approximate { capacity_blocks } => Some(RoutedMemory::new(pods, capacity_blocks)),
        };
        let mut p = KvroutePolicy {
            name: name.to_string(),
            rt,
            pool,
            router,
            names,
            pending,
            seq: vec![0; pods],
            slots: (0..pods).map(|_| Vec::new()).collect(),
            memory,
            fallbacks: 0,
        };
        p.flush()?;
        Ok(p)
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
        stored: Vec<kvroute_common::BlockHash>,
        removed: Vec<kvroute_common::BlockHash>,
        stats: Option<PodStats>,
    ) {
        let Some(seq) = self.seq.get_mut(pod) else { return };
        *seq += 1;
        self.pending.push(PoolUpdate::Delta {
            stream: 1,
            pod: pod_name(pod),
            seq: *seq,
            cleared: false,
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
        self.flush()?;
        let rr =
            RouteRequest { model: MODEL, adapter: req.adapter.as_deref(), block_hashes: &req.blocks, subset: None };
        let (pod, slot) = match self.router.route(&rr) {
            Ok(d) => (self.names.get(&d.pod).copied().unwrap_or(0), Some(d.slot)),
            Err(_) => {
                self.fallbacks += 1;
                (0, None)
            }
        };
        if let Some(slot) = slot
            && let Some(list) = self.slots.get_mut(pod)
        {
            list.push((now_us, req.id, slot));
        }
        if let Some(mem) = self.memory.as_mut() {
            let (stored, evicted) = mem.record(pod, &req.blocks);
            let (stored, evicted) = (stored.to_vec(), evicted.to_vec());
            if !stored.is_empty() || !evicted.is_empty() {
                self.delta(pod, stored, evicted, None);
            }
        }
        Ok(pod)
    }

    fn on_report(&mut self, report: &PodReport) {
        let stats = report.stats.as_ref().map(to_stats);
        if stats.is_some()
            && let Some(list) = self.slots.get_mut(report.pod)
        {
            // The engine's counters now include every request routed up to the read.
            list.retain(|(at, _, _)| *at > report.engine_time_us);
        }
        let (stored, removed) = if self.memory.is_some() {
            (Vec::new(), Vec::new())
        } else {
            (report.stored.clone(), report.removed.clone())
        };
        if stats.is_some() || !stored.is_empty() || !removed.is_empty() {
            self.delta(report.pod, stored, removed, stats);
        }
    }

    fn on_finish(&mut self, req: &SimRequest, pod: usize) {
        if let Some(list) = self.slots.get_mut(pod) {
            list.retain(|(_, id, _)| *id != req.id);
        }
    }
}
