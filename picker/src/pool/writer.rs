//! The pool's single writer: applies [`PoolUpdate`]s in batches, publishes, expires pods.
//!
//! Runs on its own OS thread with a current-thread tokio runtime (only for the receive timeout),
//! so [`Pool::new`](super::Pool::new) works inside or outside a runtime. A batch is everything
//! queued when the writer wakes (up to [`MAX_BATCH`] messages); after applying it, the writer
//! publishes the index once, then the changed pod statuses, then the pod table if a pod came,
//! went or changed status (a delta of blocks alone only updates the pod's block count), and
//! only then answers barriers. Every [`TICK`] it drops pods whose grace period ended.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use kvroute_cluster::PoolView;

use super::annotations::{annotations_of, merge, merged_annotations, priced};
use super::{
    InFlight, Membership, PodHot, PodRecord, PodStatus, PodTable, PoolConfig, PoolUpdate, StreamId, WriterMsg,
};
use crate::index::{IndexSnapshot, IndexWriter, PodIdx};

/// Most messages applied per published batch.
pub(crate) const MAX_BATCH: usize = 8192;
/// How often grace expiry runs.
pub(crate) const TICK: Duration = Duration::from_millis(100);
const MAX_PODS: usize = 1 << 16;

struct WPod {
    rec: Arc<PodRecord>,
    status: PodStatus,
    owner: StreamId,
    /// The status changed: the next publication republishes the pod table.
    dirty: bool,
    /// Only the pod's blocks changed: the next publication stores its count in the record, and
    /// the table (which decisions read whole) stays as it is.
    blocks_dirty: bool,
    /// The pod's position in the published table (set when the table is rebuilt whole; valid
    /// until a pod comes or goes, which rebuilds it).
    pos: usize,
}

struct Writer {
    config: PoolConfig,
    index: IndexWriter,
    /// The CPU tier (docs/design.md §2 tiers).
    cpu: IndexWriter,
    table: Arc<ArcSwap<PodTable>>,
    names: HashMap<String, PodIdx>,
    pods: Vec<Option<WPod>>,
    next_fresh: usize,
    free: VecDeque<PodIdx>,
    table_dirty: bool,
    /// Scratch for [`Writer::publish`]: each changed pod's table position and new status.
    changed: Vec<(usize, Arc<PodStatus>)>,
    /// The pool view's endpoints by name; `None` until a pool source sent its first view.
    members: Option<HashMap<String, Member>>,
}

/// What the pool view says about one endpoint.
struct Member {
    addr: Arc<str>,
    ready: bool,
    /// Pod annotations, sorted (they win over an agent's on the same key).
    annotations: Vec<(String, String)>,
}

pub(super) fn spawn(
    config: PoolConfig,
    rx: mpsc::Receiver<WriterMsg>,
    table: Arc<ArcSwap<PodTable>>,
    index: Arc<ArcSwap<IndexSnapshot>>,
    cpu_index: Arc<ArcSwap<IndexSnapshot>>,
) {
    let w = Writer {
        index: IndexWriter::new(index, config.max_blocks_per_pod),
        cpu: IndexWriter::new(cpu_index, config.max_blocks_per_pod),
        config,
        table,
        names: HashMap::new(),
        pods: Vec::new(),
        next_fresh: 0,
        free: VecDeque::new(),
        table_dirty: false,
        changed: Vec::new(),
        members: None,
    };
    let started = std::thread::Builder::new().name("kvroute-pool-writer".into()).spawn(move || run(w, rx));
    if let Err(e) = started {
        error!(error = %e, "cannot start the pool writer thread; agent updates will be refused");
    }
}

fn run(mut w: Writer, mut rx: mpsc::Receiver<WriterMsg>) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_time().build() {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "pool writer: no timer runtime; grace expiry only runs on updates");
            while let Some(first) = rx.blocking_recv() {
                w.batch(first, &mut rx);
            }
            return;
        }
    };
    rt.block_on(async move {
        let mut last_tick = Instant::now();
        loop {
            match tokio::time::timeout(TICK, rx.recv()).await {
                Ok(Some(first)) => w.batch(first, &mut rx),
                Ok(None) => break,
                Err(_) => {}
            }
            if last_tick.elapsed() >= TICK {
                last_tick = Instant::now();
                w.expire(Instant::now());
            }
        }
        debug!("pool writer stopped: pool dropped");
    });
}

impl Writer {
    fn batch(&mut self, first: WriterMsg, rx: &mut mpsc::Receiver<WriterMsg>) {
        let mut barriers: Vec<oneshot::Sender<()>> = Vec::new();
        let mut msg = Some(first);
        let mut n = 0;
        while let Some(m) = msg.take() {
            match m {
                WriterMsg::Update(u) => self.apply(*u),
                WriterMsg::Barrier(b) => barriers.push(b),
            }
            n += 1;
            if n < MAX_BATCH {
                msg = rx.try_recv().ok();
            }
        }
        self.publish();
        for b in barriers {
            let _ = b.send(());
        }
    }

    /// Publishes the index, then every changed pod status, then the pod table (whose status
    /// column is what decisions read) if any pod or status changed: rebuilt whole when a pod
    /// came, went or changed model, otherwise the previous table with the changed pods' chunks
    /// copied (see [`Column`](super::Column)).
    fn publish(&mut self) {
        self.index.publish();
        self.cpu.publish();
        let mut changed = std::mem::take(&mut self.changed);
        for p in self.pods.iter_mut().flatten() {
            if p.dirty || p.blocks_dirty {
                p.rec.blocks.store(self.index.pod_blocks(p.rec.idx), Ordering::Relaxed);
                p.blocks_dirty = false;
            }
            if p.dirty {
                p.dirty = false;
                let status = Arc::new(p.status.clone());
                p.rec.status.store(status.clone());
                changed.push((p.pos, status));
            }
        }
        if self.table_dirty {
            self.table_dirty = false;
            for (pos, p) in self.pods.iter_mut().flatten().enumerate() {
                p.pos = pos;
            }
            let pods: Arc<[Arc<PodRecord>]> = self.pods.iter().flatten().map(|p| p.rec.clone()).collect();
            let status: Vec<Arc<PodStatus>> = pods.iter().map(|p| p.status.load_full()).collect();
            let by_model = Arc::new(PodTable::group_by_model(&status));
            let hot = status.iter().map(|s| PodHot::of(s)).collect();
            self.table.store(Arc::new(PodTable { pods, status: status.into_iter().collect(), hot, by_model }));
        } else if !changed.is_empty() {
            let old = self.table.load_full();
            let (mut status, mut hot) = (old.status.clone(), old.hot.clone());
            for (pos, s) in changed.drain(..) {
                hot.set(pos, PodHot::of(&s));
                status.set(pos, s);
            }
            self.table.store(Arc::new(PodTable {
                pods: old.pods.clone(),
                status,
                hot,
                by_model: old.by_model.clone(),
            }));
        }
        changed.clear();
        self.changed = changed;
    }

    fn alloc_idx(&mut self) -> Option<PodIdx> {
        if self.next_fresh < MAX_PODS {
            let i = self.next_fresh;
            self.next_fresh += 1;
            // `i < 65536`.
            return Some(PodIdx(i as u16));
        }
        self.free.pop_front()
    }

    /// The pod's slot, registering it (or refreshing its info) from `info`.
    fn register(&mut self, info: &PodInfo, stream: StreamId) -> Option<PodIdx> {
        if info.pod.is_empty() {
            return None;
        }
        if let Some(members) = &self.members {
            // Pool mode: every member already has a slot; anything else is not in the pool
            // (ingest counted the refusal; the view may have changed since it checked).
            let Some(member) = members.get(&info.pod) else {
                debug!(pod = %info.pod, "report for a pod outside the pool ignored");
                return None;
            };
            let idx = *self.names.get(&info.pod)?;
            let p = self.pods.get_mut(idx.as_usize()).and_then(Option::as_mut)?;
            if p.status.model != info.model {
                p.status.model.clone_from(&info.model);
                self.table_dirty = true;
            }
            p.status.block_size = info.block_size;
            p.status.index_mismatch = index_mismatch(info, self.config.block_size);
            (p.status.annotations, p.status.cost_per_hour) = merged_annotations(info, &member.annotations);
            p.status.connected = true;
            p.status.disconnected_at = None;
            p.owner = stream;
            p.dirty = true;
            return Some(idx);
        }
        if let Some(&idx) = self.names.get(&info.pod) {
            if let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::as_mut) {
                if *p.status.endpoint != *info.endpoint {
                    p.status.endpoint = Arc::from(info.endpoint.as_str());
                }
                if p.status.model != info.model {
                    p.status.model.clone_from(&info.model);
                    self.table_dirty = true;
                }
                p.status.block_size = info.block_size;
                p.status.index_mismatch = index_mismatch(info, self.config.block_size);
                (p.status.annotations, p.status.cost_per_hour) = annotations_of(info);
                p.status.connected = true;
                p.status.disconnected_at = None;
                p.owner = stream;
                p.dirty = true;
            }
            return Some(idx);
        }
        let Some(idx) = self.alloc_idx() else {
            error!(pod = %info.pod, "pool full (65536 pods): pod ignored");
            return None;
        };
        let (annotations, cost_per_hour) = annotations_of(info);
        let status = PodStatus {
            annotations,
            cost_per_hour,
            endpoint: Arc::from(info.endpoint.as_str()),
            model: info.model.clone(),
            block_size: info.block_size,
            index_mismatch: index_mismatch(info, self.config.block_size),
            stats: None,
            stats_at: None,
            connected: true,
            disconnected_at: None,
            member: Membership::Agent,
            utilization_per_request: None,
        };
        self.insert(idx, &info.pod, status, stream);
        info!(pod = %info.pod, endpoint = %info.endpoint, model = %info.model, "pod registered");
        Some(idx)
    }

    /// Puts a new record for `name` in slot `idx` (freshly allocated).
    fn insert(&mut self, idx: PodIdx, name: &str, status: PodStatus, owner: StreamId) {
        let rec = Arc::new(PodRecord {
            idx,
            name: Arc::from(name),
            status: ArcSwap::from_pointee(status.clone()),
            inflight: InFlight::default(),
            blocks: Default::default(),
            unreachable: Default::default(),
        });
        let i = idx.as_usize();
        if i >= self.pods.len() {
            self.pods.resize_with(i + 1, || None);
        }
        self.pods[i] = Some(WPod { rec, status, owner, dirty: true, blocks_dirty: false, pos: 0 });
        self.names.insert(name.to_string(), idx);
        self.table_dirty = true;
    }

    /// Drops pod `idx` now: its blocks leave the index, its slot is freed.
    fn remove(&mut self, idx: PodIdx) {
        self.index.drop_pod(idx);
        self.cpu.drop_pod(idx);
        if let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::take) {
            self.names.remove(&*p.rec.name);
        }
        self.free.push_back(idx);
        self.table_dirty = true;
    }

    /// Applies a new pool view (docs/design.md §14): endpoints that left are dropped, new ones
    /// registered (no stats: by load until their agent reports), addresses and readiness taken
    /// from the view.
    fn set_membership(&mut self, view: &PoolView) {
        let members: HashMap<String, Member> = view
            .endpoints
            .iter()
            .map(|e| {
                let mut annotations: Vec<(String, String)> =
                    e.annotations.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
                annotations.sort();
                (e.name.clone(), Member { addr: Arc::from(e.addr.to_string()), ready: e.ready, annotations })
            })
            .collect();
        let gone: Vec<PodIdx> =
            self.pods.iter().flatten().filter(|p| !members.contains_key(&*p.rec.name)).map(|p| p.rec.idx).collect();
        for idx in gone {
            if let Some(p) = self.pods.get(idx.as_usize()).and_then(Option::as_ref) {
                info!(pod = %p.rec.name, endpoint = %p.status.endpoint, "left the pool: no longer a candidate");
            }
            self.remove(idx);
        }
        for (name, m) in &members {
            let state = if m.ready { Membership::PoolReady } else { Membership::PoolUnready };
            if let Some(&idx) = self.names.get(name) {
                let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::as_mut) else { continue };
                if p.status.endpoint != m.addr {
                    info!(pod = %name, from = %p.status.endpoint, to = %m.addr, "pod re-addressed");
                    p.status.endpoint = m.addr.clone();
                    p.dirty = true;
                }
                if p.status.member != state {
                    info!(pod = %name, ready = m.ready, "pool readiness changed");
                    p.status.member = state;
                    p.dirty = true;
                }
                let merged = merge(&p.status.annotations, &m.annotations);
                if merged != p.status.annotations {
                    (p.status.annotations, p.status.cost_per_hour) = priced(name, merged);
                    p.dirty = true;
                }
                continue;
            }
            let Some(idx) = self.alloc_idx() else {
                error!(pod = %name, "pool full (65536 pods): endpoint ignored");
                continue;
            };
            let (annotations, cost_per_hour) = priced(name, m.annotations.clone());
            let status = PodStatus {
                annotations,
                cost_per_hour,
                endpoint: m.addr.clone(),
                model: String::new(),
                block_size: 0,
                index_mismatch: false,
                stats: None,
                stats_at: None,
                connected: false,
                disconnected_at: None,
                member: state,
                utilization_per_request: None,
            };
            self.insert(idx, name, status, 0);
            info!(pod = %name, endpoint = %m.addr, ready = m.ready, "joined the pool");
        }
        if self.members.is_none() {
            // Pods an agent registered before the pool source existed are not the pool's.
            let agent_only: Vec<PodIdx> = self
                .pods
                .iter()
                .flatten()
                .filter(|p| p.status.member == Membership::Agent)
                .map(|p| p.rec.idx)
                .collect();
            for idx in agent_only {
                self.remove(idx);
            }
        }
        self.members = Some(members);
    }

    fn set_stats(&mut self, idx: PodIdx, stats: Option<PodStats>) {
        if let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::as_mut) {
            if let Some(share) = stats.as_ref().and_then(utilization_per_request) {
                p.status.utilization_per_request = Some(share);
            }
            // A delta without stats changes the pod's blocks only: republishing the whole table
            // for it would hand every decision after it a table just written by this thread,
            // cold in the deciding core's caches.
            if stats.is_some() {
                p.status.stats = stats;
                p.status.stats_at = Some(Instant::now());
                p.dirty = true;
            } else {
                p.blocks_dirty = true;
            }
        }
    }

    fn apply(&mut self, u: PoolUpdate) {
        match u {
            PoolUpdate::Hello { stream, pods } => {
                for info in &pods {
                    self.register(info, stream);
                }
            }
            PoolUpdate::Snapshot { stream, info, seq: _, stats, blocks } => {
                let Some(idx) = self.register(&info, stream) else { return };
                let blocks: &[kvroute_common::BlockHash] = if self.indexable(idx) { &blocks } else { &[] };
                self.index.replace_pod(idx, blocks);
                self.set_stats(idx, stats);
            }
            PoolUpdate::Delta { stream: _, pod, seq: _, cleared, stored, removed, stats } => {
                let Some(&idx) = self.names.get(&pod) else {
                    debug!(%pod, "delta for an unknown pod ignored");
                    return;
                };
                if cleared {
                    self.index.clear_pod(idx);
                }
                if self.indexable(idx) {
                    self.index.store(idx, &stored);
                }
                self.index.remove(idx, &removed);
                self.set_stats(idx, stats);
            }
            PoolUpdate::Offloaded { stream: _, pod, cleared, stored, removed } => {
                let Some(&idx) = self.names.get(&pod) else {
                    debug!(%pod, "CPU-tier changes for an unknown pod ignored");
                    return;
                };
                if cleared {
                    self.cpu.clear_pod(idx);
                }
                if self.indexable(idx) {
                    self.cpu.store(idx, &stored);
                }
                self.cpu.remove(idx, &removed);
            }
            PoolUpdate::Membership { view } => self.set_membership(&view),
            PoolUpdate::StreamEnded { stream } => {
                let now = Instant::now();
                for p in self.pods.iter_mut().flatten() {
                    if p.owner == stream && p.status.connected {
                        p.status.connected = false;
                        p.status.disconnected_at = Some(now);
                        p.dirty = true;
                        info!(pod = %p.rec.name, grace_ttl_ms = self.config.grace_ttl_ms, "agent stream ended: pod in grace period");
                    }
                }
            }
        }
    }

    /// Whether the pod's block hashes are of the index's granularity.
    fn indexable(&self, idx: PodIdx) -> bool {
        self.pods.get(idx.as_usize()).and_then(Option::as_ref).is_some_and(|p| !p.status.index_mismatch)
    }

    /// Drops pods whose grace period is over.
    fn expire(&mut self, now: Instant) {
        let ttl = Duration::from_millis(self.config.grace_ttl_ms);
        let expired: Vec<PodIdx> = self
            .pods
            .iter()
            .flatten()
            .filter(|p| p.status.disconnected_at.is_some_and(|t| now.duration_since(t) >= ttl))
            .map(|p| p.rec.idx)
            .collect();
        if expired.is_empty() {
            return;
        }
        for idx in expired {
            let member = self
                .pods
                .get_mut(idx.as_usize())
                .and_then(Option::as_mut)
                .filter(|p| p.status.member != Membership::Agent);
            if let Some(p) = member {
                // Still in the pool: forget what the agent said, keep routing it by load.
                info!(pod = %p.rec.name, "grace period over: agent state dropped, pod routed by load");
                p.status.stats = None;
                p.status.stats_at = None;
                p.status.disconnected_at = None;
                p.dirty = true;
                self.index.clear_pod(idx);
                self.cpu.clear_pod(idx);
                continue;
            }
            if let Some(p) = self.pods.get(idx.as_usize()).and_then(Option::as_ref) {
                info!(pod = %p.rec.name, "grace period over: pod dropped");
            }
            self.remove(idx);
        }
        self.table_dirty = true;
        self.publish();
    }
}

/// Whether `info`'s block hashes are of another granularity than the index's `block_size`
/// (tokens): the agent's `index_block_size`, or, from an agent that does not send it, the engine's
/// block size. Logged, since no block of the pod can then match a request.
fn index_mismatch(info: &PodInfo, block_size: usize) -> bool {
    let Some(granularity) = info.hashed_block_size() else { return false };
    let mismatch = granularity as usize != block_size;
    if mismatch {
        warn!(pod = %info.pod, agent_index_block_size = granularity, engine_block_size = info.block_size,
            picker_block_size = block_size,
            "the agent hashes blocks of another size than the picker's index: the pod's blocks are not indexed (set the agent's index_block_size to the picker's block_size)");
    }
    mismatch
}

/// docs/design.md §4 loadRatio: a report's GPU utilization per running request, when it has
/// requests running and a utilization in (0, 1] (validated reports have it in [0, 1]); capped at 1.
fn utilization_per_request(s: &PodStats) -> Option<f64> {
    let u = s.gpu_utilization;
    (s.num_requests_running > 0 && u.is_finite() && u > 0.0)
        .then(|| (u.min(1.0) / f64::from(s.num_requests_running)).min(1.0))
}

#[cfg(test)]
mod utilization_tests {
    use super::*;

    #[test]
    fn utilization_per_request_needs_running_requests_and_a_utilization() {
        let s = |u: f64, running: u32| PodStats {
            gpu_utilization: u,
            num_requests_running: running,
            ..PodStats::default()
        };
        assert_eq!(utilization_per_request(&s(0.5, 4)), Some(0.125));
        assert_eq!(utilization_per_request(&s(0.5, 0)), None);
        assert_eq!(utilization_per_request(&s(0.0, 4)), None);
        assert_eq!(utilization_per_request(&s(f64::NAN, 4)), None);
        assert_eq!(utilization_per_request(&s(f64::INFINITY, 4)), None);
        assert_eq!(utilization_per_request(&s(7.0, 2)), Some(0.5), "capped at a full GPU");
    }
}
