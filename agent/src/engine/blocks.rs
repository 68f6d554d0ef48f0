//! The agent's record of one engine's prefix cache, in kvroute block hashes (docs/design.md §2, §7).
//!
//! vLLM's block hashes are opaque, so every `BlockStored` is re-hashed: the run's first block
//! chains from the kvroute hash recorded for its engine parent (or from the (model, adapter) root
//! when it has none), and each further block from the one before. The record keeps
//! (medium, engine hash) → kvroute hash for every medium (a CPU-offloaded block can be the parent
//! of a GPU block), and, per reported tier, the set of kvroute hashes with their parents (to build
//! snapshots as `BlockRun`s). Two tiers are reported (docs/design.md §2 tiers): GPU, and CPU
//! (vLLM KV offloading `medium: CPU`, LMCache), which the picker credits partially; other media
//! (disk, remote) only serve as parents.
//!
//! Extra keys (docs/design.md §2): a block's `cache_salt` and multimodal items are folded into its
//! kvroute hash after its tokens, exactly as the picker folds a request's ([`hash_block_keyed`]).
//! Under-claim rule: a block whose parent the agent never saw is dropped and counted; so is a
//! block whose extra keys the agent cannot interpret, and every block after it in the same run.
//!
//! Changes since the last flush are accumulated and netted against the current state when taken
//! (a block stored then removed inside one flush window is not announced as stored), so the
//! `stored` and `removed` of one `BlockChanges` are disjoint and their order does not matter.
//!
//! Media are interned to small ids (GPU = 0, CPU = 1, others in order of first sight), so the
//! engine → kvroute map is keyed by `(u16, u64)`: no allocation per lookup, and a parent is
//! looked up once per medium seen (GPU first, then CPU, then the others), never by a scan.
//!
//! Bounds (an engine's events are outside input: unbounded, a hostile or broken engine can make
//! one record hold millions of blocks, or make the one KV-event thread search tens of thousands
//! of LoRA names linearly; docs/decisions/0024-bounded-outside-input.md): at most
//! [`BlockRecord::capacity`] engine blocks over all media (default [`DEFAULT_MAX_BLOCKS`]);
//! stores past it are dropped and counted ([`ApplyOutcome::dropped_capacity`]: under-claim), and
//! removals make room again. Hash roots per (adapter, block size) are found through a map, at most
//! [`MAX_HASHED_ADAPTERS`] adapters kept (cheap to recompute: dropped all at once when full);
//! at most [`MAX_MEDIA`] media are told apart, stores on further ones are dropped and counted.
//!
//! Concurrency: plain data, owned by one pod's state behind its mutex; no locking here.

use super::kv_events::{BlockExtra, BlockStored, KvEvent, KvEventBatch, Medium};
use fold_hash::{FoldMap, FoldSet, FoldState};
use kvroute_common::hash::{hash_block, hash_block_keyed};
use kvroute_common::{BlockHash, BlockHasher, EngineBlockHash};
use kvroute_proto::agent::v1::{BlockChanges, BlockRun};

mod fold_hash;

/// Counters of what [`BlockRecord::apply`] could not place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks stored on GPU and announced.
    pub stored_gpu: u64,
    /// Blocks stored in the CPU tier and announced.
    pub stored_cpu: u64,
    /// Blocks dropped because their parent is unknown.
    pub dropped_unknown_parent: u64,
    /// Blocks skipped because their extra keys could not be interpreted.
    pub skipped_extra_keys: u64,
    /// Blocks dropped because `token_ids` did not cover them.
    pub dropped_short_tokens: u64,
    /// Blocks dropped because the record was full ([`BlockRecord::capacity`]) or their medium
    /// was one too many ([`MAX_MEDIA`]).
    pub dropped_capacity: u64,
    /// Times the record was cleared because the decoder lost events that may have removed
    /// blocks ([`KvEvent::Untrusted`]).
    pub untrusted_clears: u64,
}

#[derive(Debug, Clone, Copy)]
struct TierBlock {
    /// kvroute parent; `None` = chain root.
    parent: Option<BlockHash>,
    /// Engine entries mapping to this hash in the tier (normally 1).
    refs: u32,
}

/// A reported tier's blocks and the changes waiting to be taken.
#[derive(Debug, Default)]
struct Tier {
    blocks: FoldMap<BlockHash, TierBlock>,
    pending_cleared: bool,
    pending_stored: Vec<(Option<BlockHash>, Vec<BlockHash>)>,
    pending_removed: Vec<BlockHash>,
}

impl Tier {
    fn has_changes(&self) -> bool {
        self.pending_cleared || !self.pending_stored.is_empty() || !self.pending_removed.is_empty()
    }

    fn clear(&mut self) {
        self.blocks.clear();
        self.pending_cleared = true;
        self.pending_stored.clear();
        self.pending_removed.clear();
    }

    fn unref(&mut self, kv: BlockHash) {
        if let Some(b) = self.blocks.get_mut(&kv) {
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.blocks.remove(&kv);
                self.pending_removed.push(kv);
            }
        }
    }
}

/// Index of the GPU tier in [`BlockRecord`]'s tiers.
const GPU_TIER: usize = 0;
/// Index of the CPU tier.
const CPU_TIER: usize = 1;

/// Largest `seen` set kept between flushes (entries); a flush of more blocks frees it after.
const SEEN_KEEP: usize = 4096;

/// Default most engine blocks one record holds, over all media. A GPU block costs the record
/// about 116 bytes (measured: 1 M blocks, 116 MiB), so this is about 29 MiB per engine, 232 MiB
/// for eight engines under the agent's 512 MiB limit. vLLM's `num_gpu_blocks` is 27 910 for an
/// 8B model on an 80 GB GPU; a 1B model on a 141 GB GPU has about 200 000.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 18;

/// Most LoRA adapters whose hash roots are kept (then all are dropped and recomputed as needed).
pub const MAX_HASHED_ADAPTERS: usize = 4096;

/// Most media told apart (GPU, CPU and 14 others).
pub const MAX_MEDIA: usize = 16;

/// Interned medium (index into [`BlockRecord`]'s media list).
type MediumId = u16;
const GPU: MediumId = 0;
const CPU: MediumId = 1;

/// The reported tier of a medium, if any.
fn tier_of(m: MediumId) -> Option<usize> {
    match m {
        GPU => Some(GPU_TIER),
        CPU => Some(CPU_TIER),
        _ => None,
    }
}

/// One engine's blocks. `model` is the base model id used as the hash root.
#[derive(Debug)]
pub struct BlockRecord {
    model: String,
    /// Interned media: index = medium id used in `engine_to_kv` keys.
    media: Vec<Medium>,
    engine_to_kv: FoldMap<(MediumId, EngineBlockHash), BlockHash>,
    /// GPU, then CPU.
    tiers: [Tier; 2],
    /// Hashers of the base model, by block size.
    base_hashers: FoldMap<u32, BlockHasher>,
    /// Hashers per LoRA adapter name, by block size (at most [`MAX_HASHED_ADAPTERS`] names).
    lora_hashers: FoldMap<Box<str>, FoldMap<u32, BlockHasher>>,
    /// Most entries of `engine_to_kv`.
    capacity: usize,
    scratch: Vec<BlockHash>,
    /// Hashes already placed in the changes being taken; kept between calls for its capacity
    /// (a fresh set per flush, grown by rehashing, was ~7 % of the agent's CPU under load).
    seen: FoldSet<BlockHash>,
}

impl BlockRecord {
    /// An empty record for an engine serving base model `model`.
    pub fn new(model: &str) -> Self {
        Self {
            model: model.to_string(),
            media: vec![Medium::Gpu, Medium::Cpu],
            engine_to_kv: FoldMap::default(),
            tiers: [Tier::default(), Tier::default()],
            base_hashers: FoldMap::default(),
            lora_hashers: FoldMap::default(),
            capacity: DEFAULT_MAX_BLOCKS,
            scratch: Vec::new(),
            seen: FoldSet::default(),
        }
    }

    /// Changes the hash root's model (learned from `/v1/models`); forgets every block, since
    /// hashes under the old root are meaningless, and queues a `cleared`.
    pub fn set_model(&mut self, model: &str) {
        if self.model != model {
            self.model = model.to_string();
            self.base_hashers.clear();
            self.lora_hashers.clear();
            self.clear();
        }
    }

    /// Base model id of the hash root.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Most engine blocks held over all media; stores past it are dropped (counted).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets [`Self::capacity`]. Blocks already held over a lowered capacity stay until removed.
    pub fn set_capacity(&mut self, blocks: usize) {
        self.capacity = blocks;
    }

    /// Engine blocks held over all media (what [`Self::capacity`] bounds).
    pub fn len(&self) -> usize {
        self.engine_to_kv.len()
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.engine_to_kv.is_empty()
    }

    /// Number of distinct kvroute hashes on GPU.
    pub fn gpu_len(&self) -> usize {
        self.tiers[GPU_TIER].blocks.len()
    }

    /// Number of distinct kvroute hashes in the CPU tier.
    pub fn cpu_len(&self) -> usize {
        self.tiers[CPU_TIER].blocks.len()
    }

    /// Whether `hash` is currently recorded on GPU.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.tiers[GPU_TIER].blocks.contains_key(&hash)
    }

    /// Forgets everything and queues a `cleared` for both tiers (engine cleared its cache,
    /// restarted, or events were lost beyond replay: the CPU tier is under-claimed too).
    pub fn clear(&mut self) {
        self.engine_to_kv.clear();
        for t in &mut self.tiers {
            t.clear();
        }
    }

    /// Applies one batch in order.
    pub fn apply(&mut self, batch: &KvEventBatch) -> ApplyOutcome {
        let mut out = ApplyOutcome::default();
        for event in &batch.events {
            match event {
                KvEvent::Stored(s) => self.stored(s, &mut out),
                KvEvent::Removed { block_hashes, medium } => {
                    // A medium never stored on holds nothing to remove.
                    let Some(m) = self.find_medium(medium) else { continue };
                    for h in block_hashes {
                        if let Some(kv) = self.engine_to_kv.remove(&(m, *h))
                            && let Some(t) = tier_of(m)
                        {
                            self.tiers[t].unref(kv);
                        }
                    }
                }
                KvEvent::AllCleared => self.clear(),
                KvEvent::Untrusted(_) => {
                    out.untrusted_clears += 1;
                    self.clear();
                }
            }
        }
        out
    }

    /// Id of an already interned medium.
    fn find_medium(&self, medium: &Medium) -> Option<MediumId> {
        match medium {
            Medium::Gpu => Some(GPU),
            Medium::Cpu => Some(CPU),
            other => self.media.iter().position(|m| m == other).and_then(|i| MediumId::try_from(i).ok()),
        }
    }

    /// Id of `medium`, interning it on first sight; `None` past [`MAX_MEDIA`] distinct media.
    fn intern_medium(&mut self, medium: &Medium) -> Option<MediumId> {
        if let Some(id) = self.find_medium(medium) {
            return Some(id);
        }
        if self.media.len() >= MAX_MEDIA {
            return None;
        }
        let id = MediumId::try_from(self.media.len()).ok()?;
        self.media.push(medium.clone());
        Some(id)
    }

    /// kvroute hash of engine block `parent` on any medium: GPU first, then CPU, then the others
    /// in order of first sight (one hash lookup per medium, never a scan of the map).
    fn lookup_parent(&self, parent: EngineBlockHash) -> Option<BlockHash> {
        (0..self.media.len()).find_map(|m| {
            let m = MediumId::try_from(m).ok()?;
            self.engine_to_kv.get(&(m, parent)).copied()
        })
    }

    fn stored(&mut self, s: &BlockStored, out: &mut ApplyOutcome) {
        let n = s.block_hashes.len() as u64;
        let parent = match s.parent {
            None => None,
            Some(p) => match self.lookup_parent(p) {
                Some(kv) => Some(kv),
                None => {
                    out.dropped_unknown_parent += n;
                    return;
                }
            },
        };
        let Some(medium) = self.intern_medium(&s.medium) else {
            out.dropped_capacity += n;
            return;
        };
        let hasher = self.hasher(s.lora_name.as_deref(), s.block_size);
        let start = parent.unwrap_or_else(|| hasher.root());
        // Re-hash block by block, folding each block's extra keys; stop at the first block that
        // cannot be placed (too few tokens, uninterpretable keys): its prefix is unknown.
        let n = s.block_hashes.len();
        let bs = s.block_size as usize;
        self.scratch.clear();
        let mut prev = start;
        for i in 0..n {
            let Some(tokens) = s.token_ids.get(i * bs..(i + 1) * bs) else {
                out.dropped_short_tokens += (n - i) as u64;
                break;
            };
            prev = match s.extra_keys.get(i).unwrap_or(&BlockExtra::Plain) {
                BlockExtra::Plain => hash_block(prev, tokens),
                BlockExtra::Keys(keys) => hash_block_keyed(prev, tokens, keys),
                BlockExtra::Opaque => {
                    out.skipped_extra_keys += (n - i) as u64;
                    break;
                }
            };
            self.scratch.push(prev);
        }
        let placed = self.scratch.len();
        let tier = tier_of(medium);
        let mut run: Vec<BlockHash> = Vec::with_capacity(placed);
        let mut prev = parent;
        let mut run_parent = parent;
        let hashes = std::mem::take(&mut self.scratch);
        for (i, (engine_hash, kv)) in s.block_hashes.iter().zip(hashes.iter().copied()).take(placed).enumerate() {
            let key = (medium, *engine_hash);
            if self.engine_to_kv.len() >= self.capacity && !self.engine_to_kv.contains_key(&key) {
                // Full: the rest of the run (each block a child of the one before) is not kept.
                out.dropped_capacity += (placed - i) as u64;
                break;
            }
            let old = self.engine_to_kv.insert(key, kv);
            if let Some(t) = tier {
                let tier = &mut self.tiers[t];
                match old {
                    // Re-store of a known engine block: nothing new in the tier.
                    Some(old) if old == kv => {}
                    other => {
                        if let Some(old) = other {
                            tier.unref(old);
                        }
                        let entry = tier.blocks.entry(kv).or_insert(TierBlock { parent: prev, refs: 0 });
                        entry.refs += 1;
                        if entry.refs == 1 {
                            if run.is_empty() {
                                run_parent = prev;
                            }
                            run.push(kv);
                            if t == GPU_TIER {
                                out.stored_gpu += 1;
                            } else {
                                out.stored_cpu += 1;
                            }
                        } else if !run.is_empty() {
                            tier.pending_stored.push((run_parent, std::mem::take(&mut run)));
                        }
                    }
                }
            }
            prev = Some(kv);
        }
        self.scratch = hashes;
        if let Some(t) = tier
            && !run.is_empty()
        {
            self.tiers[t].pending_stored.push((run_parent, run));
        }
    }

    /// The hasher of (`lora`, `block_size`) under the record's model, from the index (filled on
    /// first use; the adapter index is dropped whole when it reaches [`MAX_HASHED_ADAPTERS`]).
    fn hasher(&mut self, lora: Option<&str>, block_size: u32) -> BlockHasher {
        let model = &self.model;
        let make = || BlockHasher::new(model, lora, block_size as usize);
        let Some(name) = lora else {
            return self.base_hashers.entry(block_size).or_insert_with(make).clone();
        };
        if let Some(h) = self.lora_hashers.get(name).and_then(|m| m.get(&block_size)) {
            return h.clone();
        }
        if self.lora_hashers.len() >= MAX_HASHED_ADAPTERS && !self.lora_hashers.contains_key(name) {
            self.lora_hashers.clear();
        }
        let h = make();
        self.lora_hashers.entry(name.into()).or_default().insert(block_size, h.clone());
        h
    }

    /// Whether changes wait to be taken (either tier).
    pub fn has_changes(&self) -> bool {
        self.tiers.iter().any(Tier::has_changes)
    }

    /// Takes the GPU tier's changes since the previous call, netted against the current state.
    pub fn take_changes(&mut self) -> BlockChanges {
        self.take_tier_changes(GPU_TIER)
    }

    /// Takes the CPU tier's changes since the previous call (docs/design.md §2 tiers), `None`
    /// when there are none.
    pub fn take_offloaded_changes(&mut self) -> Option<BlockChanges> {
        self.tiers[CPU_TIER].has_changes().then(|| self.take_tier_changes(CPU_TIER))
    }

    fn take_tier_changes(&mut self, t: usize) -> BlockChanges {
        let tier = &mut self.tiers[t];
        let mut changes = BlockChanges { cleared: std::mem::take(&mut tier.pending_cleared), ..Default::default() };
        let announced = &mut self.seen;
        announced.clear();
        for (parent, hashes) in tier.pending_stored.drain(..) {
            let mut prev = parent;
            let mut cur: Option<BlockRun> = None;
            for h in hashes {
                if tier.blocks.contains_key(&h) && announced.insert(h) {
                    cur.get_or_insert_with(|| BlockRun { parent: prev.map_or(0, |p| p.0), hashes: Vec::new() })
                        .hashes
                        .push(h.0);
                } else if let Some(run) = cur.take() {
                    changes.stored.push(run);
                }
                prev = Some(h);
            }
            changes.stored.extend(cur);
        }
        let removed_seen = &mut self.seen;
        removed_seen.clear();
        for h in tier.pending_removed.drain(..) {
            if !tier.blocks.contains_key(&h) && removed_seen.insert(h) {
                changes.removed.push(h.0);
            }
        }
        // A burst (a cleared cache re-filled) must not pin a large set for the pod's lifetime.
        if removed_seen.capacity() > SEEN_KEEP {
            *removed_seen = FoldSet::default();
        }
        changes
    }

    /// The CPU tier as runs, for a `PodSnapshot`'s `offloaded_blocks`.
    pub fn offloaded_snapshot_runs(&self) -> Vec<BlockRun> {
        runs_of(&self.tiers[CPU_TIER].blocks)
    }

    /// The whole GPU set as runs (each block exactly once), for a `PodSnapshot`.
    pub fn snapshot_runs(&self) -> Vec<BlockRun> {
        runs_of(&self.tiers[GPU_TIER].blocks)
    }
}

/// A tier's blocks as runs, each block exactly once.
fn runs_of(blocks: &FoldMap<BlockHash, TierBlock>) -> Vec<BlockRun> {
    let mut children: FoldMap<BlockHash, Vec<BlockHash>> = FoldMap::default();
    let mut starts = Vec::new();
    for (h, b) in blocks {
        match b.parent {
            Some(p) if blocks.contains_key(&p) => children.entry(p).or_default().push(*h),
            _ => starts.push(*h),
        }
    }
    starts.sort_unstable();
    let mut runs = Vec::new();
    let mut visited = FoldSet::with_capacity_and_hasher(blocks.len(), FoldState::default());
    let mut stack: Vec<BlockHash> = starts;
    while let Some(first) = stack.pop() {
        if !visited.insert(first) {
            continue;
        }
        let parent = blocks.get(&first).and_then(|b| b.parent).map_or(0, |p| p.0);
        let mut run = BlockRun { parent, hashes: vec![first.0] };
        let mut cur = first;
        loop {
            match children.get(&cur).map(Vec::as_slice) {
                Some([only]) if !visited.contains(only) => {
                    visited.insert(*only);
                    run.hashes.push(only.0);
                    cur = *only;
                }
                Some(many) => {
                    stack.extend(many.iter().filter(|c| !visited.contains(c)));
                    break;
                }
                None => break,
            }
        }
        runs.push(run);
    }
    // Defensive: a parent cycle (impossible with chained hashes) still reports every block.
    for (h, b) in blocks {
        if !visited.contains(h) {
            runs.push(BlockRun { parent: b.parent.map_or(0, |p| p.0), hashes: vec![h.0] });
        }
    }
    runs
}

#[cfg(test)]
mod tests;
