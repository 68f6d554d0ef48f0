//! The pool's single writer: applies [`PoolUpdate`]s in batches, publishes, expires pods.
//!
//! Runs on its own OS thread with a current-thread tokio runtime (only for the receive timeout),
//! so [`Pool::new`](super::Pool::new) works inside or outside a runtime. A batch is everything
//! queued when the writer wakes (up to [`MAX_BATCH`] messages); after applying it, the writer
//! publishes the index once, then the changed pod statuses, then the pod table if pods came or
//! went, and only then answers barriers. Every [`TICK`] it drops pods whose grace period ended.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, error, info, warn};

use super::{InFlight, PodRecord, PodStatus, PodTable, PoolConfig, PoolUpdate, StreamId, WriterMsg};
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
    dirty: bool,
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
    /// column is what decisions read) if any pod or status changed.
    fn publish(&mut self) {
        self.index.publish();
        self.cpu.publish();
        let regroup = self.table_dirty;
        let mut changed = self.table_dirty;
        for p in self.pods.iter_mut().flatten() {
            if p.dirty {
                p.dirty = false;
                changed = true;
                p.rec.blocks.store(self.index.pod_blocks(p.rec.idx), Ordering::Relaxed);
                p.rec.status.store(Arc::new(p.status.clone()));
            }
        }
        if changed {
            self.table_dirty = false;
            let pods: Vec<Arc<PodRecord>> = self.pods.iter().flatten().map(|p| p.rec.clone()).collect();
            let status: Vec<Arc<PodStatus>> = pods.iter().map(|p| p.status.load_full()).collect();
            let by_model =
                if regroup { Arc::new(PodTable::group_by_model(&status)) } else { self.table.load().by_model.clone() };
            self.table.store(Arc::new(PodTable { pods, status, by_model }));
        }
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
        if info.block_size != 0 && info.block_size as usize != self.config.block_size {
            warn!(pod = %info.pod, pod_block_size = info.block_size, picker_block_size = self.config.block_size,
                "pod's block size differs from the picker's: its blocks will not match requests");
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
                (p.status.annotations, p.status.cost_per_hour) = super::annotations_of(info);
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
        let (annotations, cost_per_hour) = super::annotations_of(info);
        let status = PodStatus {
            annotations,
            cost_per_hour,
            endpoint: Arc::from(info.endpoint.as_str()),
            model: info.model.clone(),
            block_size: info.block_size,
            stats: None,
            connected: true,
            disconnected_at: None,
            seq: 0,
        };
        let rec = Arc::new(PodRecord {
            idx,
            name: Arc::from(info.pod.as_str()),
            status: ArcSwap::from_pointee(status.clone()),
            inflight: InFlight::default(),
            blocks: Default::default(),
        });
        let i = idx.as_usize();
        if i >= self.pods.len() {
            self.pods.resize_with(i + 1, || None);
        }
        self.pods[i] = Some(WPod { rec, status, owner: stream, dirty: true });
        self.names.insert(info.pod.clone(), idx);
        self.table_dirty = true;
        info!(pod = %info.pod, endpoint = %info.endpoint, model = %info.model, "pod registered");
        Some(idx)
    }

    fn set_stats(&mut self, idx: PodIdx, stats: Option<PodStats>, seq: u64) {
        if let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::as_mut) {
            if stats.is_some() {
                p.status.stats = stats;
            }
            p.status.seq = seq;
            p.dirty = true;
        }
    }

    fn apply(&mut self, u: PoolUpdate) {
        match u {
            PoolUpdate::Hello { stream, pods } => {
                for info in &pods {
                    self.register(info, stream);
                }
            }
            PoolUpdate::Snapshot { stream, info, seq, stats, blocks } => {
                let Some(idx) = self.register(&info, stream) else { return };
                self.index.replace_pod(idx, &blocks);
                self.set_stats(idx, stats, seq);
            }
            PoolUpdate::Delta { stream: _, pod, seq, cleared, stored, removed, stats } => {
                let Some(&idx) = self.names.get(&pod) else {
                    debug!(%pod, "delta for an unknown pod ignored");
                    return;
                };
                if cleared {
                    self.index.clear_pod(idx);
                }
                self.index.store(idx, &stored);
                self.index.remove(idx, &removed);
                self.set_stats(idx, stats, seq);
            }
            PoolUpdate::Offloaded { stream: _, pod, cleared, stored, removed } => {
                let Some(&idx) = self.names.get(&pod) else {
                    debug!(%pod, "CPU-tier changes for an unknown pod ignored");
                    return;
                };
                if cleared {
                    self.cpu.clear_pod(idx);
                }
                self.cpu.store(idx, &stored);
                self.cpu.remove(idx, &removed);
            }
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
            self.index.drop_pod(idx);
            self.cpu.drop_pod(idx);
            if let Some(p) = self.pods.get_mut(idx.as_usize()).and_then(Option::take) {
                info!(pod = %p.rec.name, "grace period over: pod dropped");
                self.names.remove(&*p.rec.name);
            }
            self.free.push_back(idx);
        }
        self.table_dirty = true;
        self.publish();
    }
}
