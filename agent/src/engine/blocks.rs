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
//! Index granularity (docs/design.md §2): the pickers' index hashes blocks of one size, its
//! `block_size` (the record's `index_block_size`, 16 by default), whatever block size each engine
//! runs with (vLLM's CPU attention needs a multiple of 32; GPU backends use 16, 32 or 64). An
//! engine block of `B` tokens is re-hashed as `B / index_block_size` consecutive index blocks, so
//! every engine in a pool lands on the same chains as the pickers' requests. An engine whose block
//! size is not a multiple of the index's cannot be placed: its stores are dropped and counted.
//! A `BlockRemoved` of an engine block removes all of its index blocks.
//!
//! Extra keys (docs/design.md §2): a block's `cache_salt` and multimodal items are folded into its
//! kvroute hash after its tokens, exactly as the picker folds a request's ([`hash_block_keyed`]).
//! When an engine block spans several index blocks, the salt goes to the first index block (the
//! request's first `index_block_size` tokens, where the picker puts it); multimodal items cannot
//! be placed on index blocks (vLLM's keys give an item's start in the engine block, not its end),
//! so such blocks are skipped and counted (under-claim).
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
//! removals make room again. Hash roots per adapter are found through a map, at most
//! [`MAX_HASHED_ADAPTERS`] adapters kept (cheap to recompute: dropped all at once when full);
//! at most [`MAX_MEDIA`] media are told apart, stores on further ones are dropped and counted.
//!
//! Concurrency: plain data, owned by one pod's state behind its mutex; no locking here.

use super::kv_events::{BlockExtra, BlockStored, KvEvent, KvEventBatch, Medium};
use fold_hash::{FoldMap, FoldSet, FoldState};
use kvroute_common::hash::{hash_block, hash_block_keyed};
use kvroute_common::{BlockHash, BlockHasher, EngineBlockHash, ExtraKey};
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
    /// Blocks dropped because their engine block size is not a multiple of the index's
    /// ([`BlockRecord::index_block_size`]).
    pub dropped_block_size: u64,
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

    /// Unrefs the index blocks of one engine block, from its last back through the parents.
    fn unref_run(&mut self, entry: EngineEntry) {
        let mut next = Some(entry.last);
        for _ in 0..entry.index_blocks {
            let Some(kv) = next else { break };
            next = self.blocks.get(&kv).and_then(|b| b.parent);
            self.unref(kv);
        }
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

/// What an engine block maps to: the kvroute hash of its last index block, how many index
/// blocks it spans (each the parent of the next, so the others are found through the tier's
/// parents), and how many copies of it the engine holds. vLLM can hold two physical blocks with
/// one hash (a fully cached prompt of whole blocks recomputes its last block into a second copy
/// and stores it again) and sends a BlockRemoved for each it evicts: the block is gone only
/// when the last copy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EngineEntry {
    last: BlockHash,
    index_blocks: u16,
    copies: u16,
}

impl EngineEntry {
    /// Same content (a second copy of the same engine block), whatever the copy counts.
    fn same_block(&self, other: &EngineEntry) -> bool {
        (self.last, self.index_blocks) == (other.last, other.index_blocks)
    }
}

/// One engine's blocks. `model` is the base model id used as the hash root.
#[derive(Debug)]
pub struct BlockRecord {
    model: String,
    /// Tokens per kvroute block (the pickers' index granularity).
    index_block_size: u32,
    /// Interned media: index = medium id used in `engine_to_kv` keys.
    media: Vec<Medium>,
    engine_to_kv: FoldMap<(MediumId, EngineBlockHash), EngineEntry>,
    /// GPU, then CPU.
    tiers: [Tier; 2],
    /// Hasher of the base model.
    base_hasher: Option<BlockHasher>,
    /// Hashers per LoRA adapter name (at most [`MAX_HASHED_ADAPTERS`] names).
    lora_hashers: FoldMap<Box<str>, BlockHasher>,
    /// Most entries of `engine_to_kv`.
    capacity: usize,
    scratch: Vec<BlockHash>,
    /// Hashes already placed in the changes being taken; kept between calls for its capacity
    /// (a fresh set per flush, grown by rehashing, was ~7 % of the agent's CPU under load).
    seen: FoldSet<BlockHash>,
}

impl BlockRecord {
    /// An empty record for an engine serving base model `model`, hashing index blocks of
    /// `index_block_size` tokens (the pickers' `block_size`; 0 is taken as 1).
    pub fn new(model: &str, index_block_size: u32) -> Self {
        Self {
            model: model.to_string(),
            index_block_size: index_block_size.max(1),
            media: vec![Medium::Gpu, Medium::Cpu],
            engine_to_kv: FoldMap::default(),
            tiers: [Tier::default(), Tier::default()],
            base_hasher: None,
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
            self.base_hasher = None;
            self.lora_hashers.clear();
            self.clear();
        }
    }

    /// Base model id of the hash root.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Tokens per kvroute block sent to the pickers.
    pub fn index_block_size(&self) -> u32 {
        self.index_block_size
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
                        let key = (m, *h);
                        if let Some(entry) = self.engine_to_kv.get_mut(&key)
                            && entry.copies > 1
                        {
                            entry.copies -= 1;
                            continue;
                        }
                        if let Some(entry) = self.engine_to_kv.remove(&key)
                            && let Some(t) = tier_of(m)
                        {
                            self.tiers[t].unref_run(entry);
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
            self.engine_to_kv.get(&(m, parent)).map(|e| e.last)
        })
    }

    fn stored(&mut self, s: &BlockStored, out: &mut ApplyOutcome) {
        let n = s.block_hashes.len();
        let (bs, g) = (s.block_size as usize, self.index_block_size as usize);
        // Index blocks per engine block; an engine block must be a whole number of them.
        let per = match (bs % g, u16::try_from(bs / g)) {
            (0, Ok(per)) if per > 0 => per,
            _ => {
                out.dropped_block_size += n as u64;
                return;
            }
        };
        let parent = match s.parent {
            None => None,
            Some(p) => match self.lookup_parent(p) {
                Some(kv) => Some(kv),
                None => {
                    out.dropped_unknown_parent += n as u64;
                    return;
                }
            },
        };
        let Some(medium) = self.intern_medium(&s.medium) else {
            out.dropped_capacity += n as u64;
            return;
        };
        let hasher = self.hasher(s.lora_name.as_deref());
        // Re-hash engine block by engine block, each as `per` index blocks, folding its extra
        // keys; stop at the first engine block that cannot be placed (too few tokens,
        // uninterpretable keys): its prefix is unknown.
        self.scratch.clear();
        let mut prev = parent.unwrap_or_else(|| hasher.root());
        for i in 0..n {
            let Some(tokens) = s.token_ids.get(i * bs..(i + 1) * bs) else {
                out.dropped_short_tokens += (n - i) as u64;
                break;
            };
            let keys: &[ExtraKey] = match s.extra_keys.get(i).unwrap_or(&BlockExtra::Plain) {
                BlockExtra::Plain => &[],
                BlockExtra::Keys(keys) if per == 1 || keys.iter().all(|k| matches!(k, ExtraKey::Str(_))) => keys,
                BlockExtra::Keys(_) | BlockExtra::Opaque => {
                    out.skipped_extra_keys += (n - i) as u64;
                    break;
                }
            };
            for (j, sub) in tokens.chunks_exact(g).enumerate() {
                // The salt (the only string key) is the request's first index block's, as the
                // picker places it; a one-index-block engine block keeps all its keys.
                prev =
                    if j == 0 && !keys.is_empty() { hash_block_keyed(prev, sub, keys) } else { hash_block(prev, sub) };
                self.scratch.push(prev);
            }
        }
        let placed = self.scratch.len() / usize::from(per);
        let tier = tier_of(medium);
        let mut run: Vec<BlockHash> = Vec::with_capacity(self.scratch.len());
        let mut prev = parent;
        let mut run_parent = parent;
        let hashes = std::mem::take(&mut self.scratch);
        for (i, (engine_hash, subs)) in
            s.block_hashes.iter().zip(hashes.chunks_exact(usize::from(per))).take(placed).enumerate()
        {
            let key = (medium, *engine_hash);
            if self.engine_to_kv.len() >= self.capacity && !self.engine_to_kv.contains_key(&key) {
                // Full: the rest of the run (each block a child of the one before) is not kept.
                out.dropped_capacity += (placed - i) as u64;
                break;
            }
            let mut entry = EngineEntry { last: subs[subs.len() - 1], index_blocks: per, copies: 1 };
            if let Some(old) = self.engine_to_kv.get(&key)
                && old.same_block(&entry)
            {
                entry.copies = old.copies.saturating_add(1);
            }
            let old = self.engine_to_kv.insert(key, entry);
            if let Some(t) = tier {
                let tier = &mut self.tiers[t];
                match old {
                    // Another copy of a known engine block: nothing new in the tier.
                    Some(old) if old.same_block(&entry) => {}
                    other => {
                        if let Some(old) = other {
                            tier.unref_run(old);
                        }
                        for &kv in subs {
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
                            prev = Some(kv);
                        }
                    }
                }
            }
            prev = Some(entry.last);
        }
        self.scratch = hashes;
        if let Some(t) = tier
            && !run.is_empty()
        {
            self.tiers[t].pending_stored.push((run_parent, run));
        }
    }

    /// The hasher of `lora` under the record's model at the index granularity, from the index
    /// (filled on first use; the adapter index is dropped whole when it reaches
    /// [`MAX_HASHED_ADAPTERS`]).
    fn hasher(&mut self, lora: Option<&str>) -> BlockHasher {
        let (model, g) = (&self.model, self.index_block_size as usize);
        let make = || BlockHasher::new(model, lora, g);
        let Some(name) = lora else {
            return self.base_hasher.get_or_insert_with(make).clone();
        };
        if let Some(h) = self.lora_hashers.get(name) {
            return h.clone();
        }
        if self.lora_hashers.len() >= MAX_HASHED_ADAPTERS {
            self.lora_hashers.clear();
        }
        let h = make();
        self.lora_hashers.insert(name.into(), h.clone());
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
