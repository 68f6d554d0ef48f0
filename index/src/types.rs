//! The index's shared vocabulary: [`PodIdx`], [`IndexStats`], [`PodChanges`] and [`MatchScratch`]. A leaf module:
//! everything else in the crate depends on it, it depends on nothing in the crate.

/// Interned pod id on the hot path (index into the pool's pod table). At most 65 536 pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct PodIdx(pub u16);

impl PodIdx {
    /// The id as a `usize`, for indexing dense per-pod arrays.
    #[inline]
    pub fn as_usize(self) -> usize {
        usize::from(self.0)
    }
}

/// Size of the index, for metrics (`epp_prefix_tree_nodes`) and `/explain`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct block hashes held by at least one pod.
    pub nodes: u64,
    /// (block, pod) pairs.
    pub entries: u64,
    /// Heap size of the index in bytes, from allocated capacities: every map copy the writer
    /// keeps (published, spare, writable), what they share, and the writer's per-pod sets.
    pub bytes_estimate: u64,
    /// Block stores dropped because the pod was at `max_blocks_per_pod` (since start).
    pub dropped_over_cap: u64,
}

/// When each pod's block set last changed, as one snapshot knows it: a reader that derived
/// something from a pod's blocks in one snapshot can tell whether it still holds in a later one of
/// the same writer without looking at the blocks again ([`PodChanges::unchanged_since`]).
///
/// Every snapshot a writer publishes has the next *generation* (1, 2, …); a pod's entry is the
/// generation of the first snapshot holding its latest change (0: none since the writer
/// started). Each writer has its own id, so stamps from another index never pass for current.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodChanges {
    pub(crate) writer: u64,
    pub(crate) generation: u64,
    /// By `PodIdx`; pods past the end never changed.
    pub(crate) changed: Vec<u64>,
}

/// Where and when something was read from the index: `(writer id, generation)` of the snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStamp {
    pub writer: u64,
    pub generation: u64,
}

impl PodChanges {
    /// This snapshot's stamp.
    #[inline]
    pub fn stamp(&self) -> IndexStamp {
        IndexStamp { writer: self.writer, generation: self.generation }
    }

    /// The generation of the latest change to `pod`'s blocks (0: none).
    #[inline]
    pub fn changed_at(&self, pod: PodIdx) -> u64 {
        self.changed.get(pod.as_usize()).copied().unwrap_or(0)
    }

    /// Whether `pod`'s blocks here are the ones the snapshot stamped `seen` had: same writer,
    /// `seen` no later than this snapshot, and no change to the pod after it.
    #[inline]
    pub fn unchanged_since(&self, pod: PodIdx, seen: IndexStamp) -> bool {
        seen.writer == self.writer && seen.generation <= self.generation && self.changed_at(pod) <= seen.generation
    }

    /// A new writer's: a fresh id, nothing published yet.
    pub(crate) fn for_new_writer() -> Self {
        static NEXT_WRITER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        PodChanges { writer: NEXT_WRITER.fetch_add(1, std::sync::atomic::Ordering::Relaxed), ..PodChanges::default() }
    }

    /// Records that `pod`'s blocks changed in the snapshot to be published next.
    pub(crate) fn mark(&mut self, pod: PodIdx) {
        let i = pod.as_usize();
        if self.changed.len() <= i {
            self.changed.resize(i + 1, 0);
        }
        self.changed[i] = self.generation + 1;
    }
}

/// Reusable per-caller buffers for the prefix walk ([`crate::match_prefix`]); no allocation per
/// lookup once warmed up. Results: [`MatchScratch::matched`] per pod.
#[derive(Debug, Default)]
pub struct MatchScratch {
    /// Dense by `PodIdx`: consecutive matched blocks from the start of the chain.
    counts: Vec<u32>,
    /// Pods with a non-zero count (to reset `counts` cheaply).
    touched: Vec<PodIdx>,
    /// Pods that held every block so far (sorted), and the next block's survivors.
    pub(crate) active: Vec<PodIdx>,
    pub(crate) next: Vec<PodIdx>,
}

impl MatchScratch {
    /// Consecutive blocks from the start of the last looked-up chain that `pod` holds.
    #[inline]
    pub fn matched(&self, pod: PodIdx) -> u32 {
        self.counts.get(pod.as_usize()).copied().unwrap_or(0)
    }

    /// Pods that matched at least one block in the last lookup (unordered).
    pub fn matched_pods(&self) -> &[PodIdx] {
        &self.touched
    }

    /// Forgets the last lookup's results.
    pub(crate) fn reset(&mut self) {
        for p in self.touched.drain(..) {
            if let Some(c) = self.counts.get_mut(p.as_usize()) {
                *c = 0;
            }
        }
        self.active.clear();
        self.next.clear();
    }

    /// Records that `pod` matched `count` blocks.
    pub(crate) fn set(&mut self, pod: PodIdx, count: u32) {
        let i = pod.as_usize();
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        if self.counts[i] == 0 {
            self.touched.push(pod);
        }
        self.counts[i] = count;
    }
}
