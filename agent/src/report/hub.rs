//! Per-pod reporting state shared by the engine tasks (writers) and the picker streams (readers).
//!
//! Concurrency: each [`Pod`] has one `parking_lot` mutex guarding its block record, latest stats
//! and sequence number; no lock is ever held across an `.await`. Every delta is numbered AND
//! published on the hub's broadcast channel while that mutex is held, so the channel carries each
//! pod's deltas in seq order. A picker stream subscribes first and then takes snapshots; it
//! forwards only deltas with seq > its snapshot's seq, so nothing is lost or doubled.
//! Invariant: per pod, seq grows by exactly one per delta; a snapshot carries the current seq.
//!
//! Pods come and go with their engines ([`Hub::add`], [`Hub::remove`], [`Hub::set_annotations`]).
//! The pod list is copied on write (readers take an `Arc` of it); every change of it is followed
//! on the same broadcast channel by [`Outgoing::Members`], so a stream sees a pod's farewell delta
//! before the change that drops it, and a new pod's `Members` before any of its deltas.

use crate::config::MIN_DELTA_QUEUE;
use crate::engine::blocks::{ApplyOutcome, BlockRecord};
use crate::engine::kv_events::KvEventBatch;
use crate::health::band;
use kvroute_proto::agent::v1::{PodDelta, PodInfo, PodSnapshot, PodStats};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::broadcast;

/// Queue jump (requests waiting) that triggers an immediate stats delta.
pub const QUEUE_JUMP: u32 = 5;

/// One item on the broadcast channel (always behind an `Arc`, so the variants' sizes differing
/// costs nothing).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum Outgoing {
    /// A pod's delta.
    Delta {
        /// The delta.
        delta: PodDelta,
        /// When it was numbered (for the report-lag metric).
        created: Instant,
    },
    /// The pod list or a pod's info changed: streams send a fresh `Hello` and the snapshots of
    /// pods they have not described yet.
    Members,
}

struct PodInner {
    info: PodInfo,
    /// Bumped when `info` changes other than by the engine (annotations): streams resend the
    /// pod's snapshot.
    info_version: u64,
    seq: u64,
    stats: PodStats,
    record: BlockRecord,
    sent_band: u8,
    sent_waiting: u32,
}

/// One pod's reporting state.
pub struct Pod {
    name: String,
    inner: Mutex<PodInner>,
    tx: broadcast::Sender<Arc<Outgoing>>,
}

impl Pod {
    /// Pod name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The full state as a snapshot (info, seq, stats, GPU and CPU-tier blocks as runs).
    pub fn snapshot(&self) -> PodSnapshot {
        let g = self.inner.lock();
        PodSnapshot {
            info: Some(g.info.clone()),
            seq: g.seq,
            stats: Some(g.stats.clone()),
            blocks: g.record.snapshot_runs(),
            offloaded_blocks: g.record.offloaded_snapshot_runs(),
        }
    }

    /// Static info currently reported.
    pub fn info(&self) -> PodInfo {
        self.inner.lock().info.clone()
    }

    /// The snapshot and the info version it describes, taken together.
    pub fn versioned_snapshot(&self) -> (PodSnapshot, u64) {
        let g = self.inner.lock();
        let snap = PodSnapshot {
            info: Some(g.info.clone()),
            seq: g.seq,
            stats: Some(g.stats.clone()),
            blocks: g.record.snapshot_runs(),
            offloaded_blocks: g.record.offloaded_snapshot_runs(),
        };
        (snap, g.info_version)
    }

    /// The info version (see [`Hub::set_annotations`]).
    pub fn info_version(&self) -> u64 {
        self.inner.lock().info_version
    }

    /// The latest stats.
    pub fn stats(&self) -> PodStats {
        self.inner.lock().stats.clone()
    }

    /// Block size (tokens) currently reported; no copy of the whole info.
    pub fn block_size(&self) -> u32 {
        self.inner.lock().info.block_size
    }

    /// Tokens per kvroute block the pod's record hashes (the pickers' index granularity).
    pub fn index_block_size(&self) -> u32 {
        self.inner.lock().record.index_block_size()
    }

    /// Applies a KV-event batch to the record; changes wait for [`Pod::flush_blocks`].
    pub fn apply_batch(&self, batch: &KvEventBatch) -> ApplyOutcome {
        self.inner.lock().record.apply(batch)
    }

    /// Sets the most engine blocks the pod's record holds (see `BlockRecord::set_capacity`).
    pub fn set_block_capacity(&self, blocks: usize) {
        self.inner.lock().record.set_capacity(blocks);
    }

    /// Forgets every block (events lost beyond replay, engine restart): a `cleared` goes out at
    /// the next flush.
    pub fn clear_blocks(&self) {
        self.inner.lock().record.clear();
    }

    /// Sets the model (hash root) and block size reported; a model change clears the blocks.
    /// A change is news to the pickers: the streams describe the pod again (a `Hello` and its
    /// snapshot with the new `PodInfo`), since the picker judges claims by the engine's block
    /// size and files the pod under its model.
    pub fn set_model(&self, model: &str, block_size: Option<u32>) {
        {
            let mut g = self.inner.lock();
            let block_size = block_size.unwrap_or(g.info.block_size);
            if g.info.model == model && g.info.block_size == block_size {
                return;
            }
            g.record.set_model(model);
            g.info.model = model.to_string();
            g.info.block_size = block_size;
            g.info_version += 1;
        }
        let _ = self.tx.send(Arc::new(Outgoing::Members));
    }

    /// Model of the hash root.
    pub fn model(&self) -> String {
        self.inner.lock().info.model.clone()
    }

    /// Sends pending block changes as one delta, if any.
    pub fn flush_blocks(&self) {
        let mut g = self.inner.lock();
        if g.record.has_changes() {
            let offloaded = g.record.take_offloaded_changes();
            let blocks = g.record.take_changes();
            self.send(&mut g, Some(blocks), offloaded, None);
        }
    }

    /// Records fresh stats; sends them at once when the health band changed or the queue jumped
    /// by ≥ [`QUEUE_JUMP`], or when `force` (report tick). Returns whether a delta went out.
    pub fn update_stats(&self, stats: PodStats, force: bool) -> bool {
        let mut g = self.inner.lock();
        let significant = band(stats.health_score) != g.sent_band
            || stats.num_requests_waiting.abs_diff(g.sent_waiting) >= QUEUE_JUMP
            || stats.ready != g.stats.ready;
        g.stats = stats;
        if force || significant {
            let offloaded = g.record.take_offloaded_changes();
            let blocks = g.record.has_changes().then(|| g.record.take_changes());
            let stats = g.stats.clone();
            self.send(&mut g, blocks, offloaded, Some(stats));
            true
        } else {
            false
        }
    }

    /// Re-sends the latest stats (report tick).
    pub fn tick(&self) {
        let stats = self.inner.lock().stats.clone();
        self.update_stats(stats, true);
    }

    fn send(
        &self,
        g: &mut PodInner,
        blocks: Option<kvroute_proto::agent::v1::BlockChanges>,
        offloaded: Option<kvroute_proto::agent::v1::BlockChanges>,
        stats: Option<PodStats>,
    ) {
        g.seq += 1;
        if let Some(s) = &stats {
            g.sent_band = band(s.health_score);
            g.sent_waiting = s.num_requests_waiting;
        }
        let delta = PodDelta { pod: self.name.clone(), seq: g.seq, blocks, stats, offloaded };
        // No receiver (no picker connected yet) is fine: snapshots carry the state.
        let _ = self.tx.send(Arc::new(Outgoing::Delta { delta, created: Instant::now() }));
    }

    /// The last delta of a pod that leaves: every block cleared, not ready, health 0 with
    /// `reason`. A picker that still routes by agent reports stops at once; the `Hello` after
    /// it no longer lists the pod.
    fn farewell(&self, reason: &str) {
        let mut g = self.inner.lock();
        g.record.clear();
        let offloaded = g.record.take_offloaded_changes();
        let blocks = g.record.take_changes();
        g.stats.ready = false;
        g.stats.health_score = 0.0;
        g.stats.health_reason = reason.to_string();
        let stats = g.stats.clone();
        self.send(&mut g, Some(blocks), offloaded, Some(stats));
    }
}

/// Tokens per kvroute block for `info`'s record: its `index_block_size`, else (unset) the engine's
/// block size, else the default.
fn index_granularity(info: &PodInfo) -> u32 {
    info.hashed_block_size().unwrap_or(kvroute_common::DEFAULT_BLOCK_SIZE as u32)
}

/// All pods of this agent and the broadcast channel of their deltas.
pub struct Hub {
    pods: Mutex<Arc<Vec<Arc<Pod>>>>,
    tx: broadcast::Sender<Arc<Outgoing>>,
}

impl Hub {
    /// Creates pods from their static info; `capacity` (deltas, at least [`MIN_DELTA_QUEUE`])
    /// bounds the broadcast backlog (a slower picker stream gets `Lagged` and resends snapshots).
    pub fn new(pods: Vec<PodInfo>, capacity: usize) -> Arc<Self> {
        let (tx, _) = broadcast::channel(capacity.max(MIN_DELTA_QUEUE));
        let pods = pods.into_iter().map(|info| Self::make_pod(info, &tx)).collect();
        Arc::new(Self { pods: Mutex::new(Arc::new(pods)), tx })
    }

    fn make_pod(info: PodInfo, tx: &broadcast::Sender<Arc<Outgoing>>) -> Arc<Pod> {
        Arc::new(Pod {
            name: info.pod.clone(),
            inner: Mutex::new(PodInner {
                record: BlockRecord::new(&info.model, index_granularity(&info)),
                info,
                info_version: 0,
                seq: 0,
                stats: PodStats::default(),
                sent_band: u8::MAX,
                sent_waiting: 0,
            }),
            tx: tx.clone(),
        })
    }

    /// Every pod, in the order they were added (a copy of the list: cheap, an `Arc`).
    pub fn pods(&self) -> Arc<Vec<Arc<Pod>>> {
        self.pods.lock().clone()
    }

    /// A pod by name.
    pub fn pod(&self, name: &str) -> Option<Arc<Pod>> {
        self.pods.lock().iter().find(|p| p.name == name).cloned()
    }

    /// Adds a pod (empty record, seq 0) and tells the streams. A pod of the same name is
    /// replaced as if removed first (see [`Hub::remove`]).
    pub fn add(&self, info: PodInfo) -> Arc<Pod> {
        if self.pod(&info.pod).is_some() {
            self.remove(&info.pod, "replaced");
        }
        let pod = Self::make_pod(info, &self.tx);
        {
            let mut list = self.pods.lock();
            let mut next = Vec::clone(&list);
            next.push(pod.clone());
            *list = Arc::new(next);
        }
        let _ = self.tx.send(Arc::new(Outgoing::Members));
        pod
    }

    /// Removes a pod: its farewell delta (blocks cleared, not ready, `reason`), then the pod
    /// leaves the list and the streams are told. Returns whether it was there.
    pub fn remove(&self, name: &str, reason: &str) -> bool {
        let Some(pod) = self.pod(name) else { return false };
        pod.farewell(reason);
        {
            let mut list = self.pods.lock();
            let next: Vec<Arc<Pod>> = list.iter().filter(|p| p.name != name).cloned().collect();
            *list = Arc::new(next);
        }
        let _ = self.tx.send(Arc::new(Outgoing::Members));
        true
    }

    /// Replaces a pod's annotations (the Pod object's changed); streams resend its snapshot.
    /// Returns whether they changed.
    pub fn set_annotations(&self, name: &str, annotations: std::collections::HashMap<String, String>) -> bool {
        let Some(pod) = self.pod(name) else { return false };
        {
            let mut g = pod.inner.lock();
            if g.info.annotations == annotations {
                return false;
            }
            g.info.annotations = annotations;
            g.info_version += 1;
        }
        let _ = self.tx.send(Arc::new(Outgoing::Members));
        true
    }

    /// Subscribes to every future delta. Subscribe BEFORE taking snapshots.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Outgoing>> {
        self.tx.subscribe()
    }
}
