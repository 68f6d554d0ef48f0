//! The emulated GPU prefix cache: full blocks keyed by opaque, chained engine hashes, with vLLM's
//! reference counting and LRU eviction of unreferenced blocks.
//!
//! Hashes are made "the vLLM way" in spirit: opaque 64-bit values chained over (parent hash, the
//! block's tokens, the block's extra keys), keyed by a per-process random seed (vLLM: low 64 bits
//! of SHA-256 of the pickled tuple, with a random root unless PYTHONHASHSEED is fixed). They are
//! deliberately not kvroute's hash: the agent must re-hash `token_ids` and `extra_keys`.
//!
//! Extra keys follow vLLM 0.33's `generate_block_hash_extra_keys` (`vllm/v1/core/kv_cache_utils.py`):
//! per block, in this order, the LoRA adapter's name, one `(identifier, offset)` pair per
//! multimodal item whose placeholder tokens overlap the block (`offset` = the item's first
//! placeholder position minus the block's first token position, negative when the item began in
//! an earlier block), and the request's `cache_salt` on the first block only. A block without any
//! has no extra keys (`None`). Because hashes chain, a salt on block 0 changes every block after it.
//!
//! Invariants: at most `capacity` blocks are cached; a block referenced by a running request
//! (`refs > 0`) is never evicted; `free_lru` holds exactly the unreferenced blocks, oldest tick
//! first; `referenced` counts the cached blocks with `refs > 0`. A request releases its blocks
//! last-to-first, so a prompt's tail is evicted before its head (as vLLM's free queue does). Not
//! thread-safe by itself: the engine wraps it in a mutex.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::kv_events::KvEvent;

/// One element of a block's extra keys (vLLM's `generate_block_hash_extra_keys`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// The LoRA adapter's name (every block of an adapter's request).
    Lora(String),
    /// A multimodal item overlapping the block: its identifier (vLLM's `mm_hash`, or the request's
    /// `uuid` for the item) and its first placeholder position relative to the block's start.
    Mm {
        /// The item's identifier.
        identifier: String,
        /// First placeholder token of the item minus the block's first token index.
        offset: i64,
    },
    /// The request's `cache_salt` (first block only).
    Salt(String),
}

/// A multimodal item's placeholder tokens in the prompt (vLLM's `PlaceholderRange`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmPlaceholder {
    /// The item's identifier.
    pub identifier: String,
    /// Index of its first placeholder token in the prompt.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// What identifies a request's blocks besides their tokens: adapter, images, salt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// LoRA adapter name.
    pub lora: Option<String>,
    /// Multimodal items, sorted by offset, not overlapping.
    pub mm: Vec<MmPlaceholder>,
    /// `cache_salt` of the request (non-empty when set).
    pub cache_salt: Option<String>,
}

impl BlockKeys {
    /// Extra keys of the block covering tokens `[start, end)`; `None` when it has none.
    pub fn for_block(&self, start: usize, end: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(lora) = &self.lora {
            keys.push(ExtraKey::Lora(lora.clone()));
        }
        for item in &self.mm {
            if item.offset < end && start < item.offset + item.length {
                keys.push(ExtraKey::Mm {
                    identifier: item.identifier.clone(),
                    offset: item.offset as i64 - start as i64,
                });
            }
        }
        if start == 0
            && let Some(salt) = &self.cache_salt
        {
            keys.push(ExtraKey::Salt(salt.clone()));
        }
        (!keys.is_empty()).then_some(keys)
    }

    /// Extra keys of each full block from block `from` to block `to` (exclusive).
    pub fn for_blocks(&self, from: usize, to: usize, block_size: usize) -> Vec<Option<Vec<ExtraKey>>> {
        (from..to).map(|i| self.for_block(i * block_size, (i + 1) * block_size)).collect()
    }
}

/// Computes engine block hashes for one process.
#[derive(Debug, Clone, Copy)]
pub struct EngineHasher {
    seed: u64,
    block_size: usize,
}

impl EngineHasher {
    /// A hasher for `block_size`-token blocks with a root `seed`.
    pub fn new(seed: u64, block_size: u32) -> Self {
        Self { seed, block_size: block_size.max(1) as usize }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Hashes of the full blocks of `tokens` (a trailing partial block is ignored), each over its
    /// parent, its tokens and its extra keys from `keys`.
    pub fn chain(&self, tokens: &[u32], keys: &BlockKeys) -> Vec<u64> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, block)| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                self.seed.hash(&mut h);
                parent.hash(&mut h);
                block.hash(&mut h);
                keys.for_block(i * self.block_size, (i + 1) * self.block_size).hash(&mut h);
                let hash = h.finish();
                parent = Some(hash);
                hash
            })
            .collect()
    }
}

#[derive(Debug)]
struct Entry {
    refs: u32,
    tick: u64,
}

/// What [`PrefixCache::store`] did: the blocks now referenced by the caller and the events.
#[derive(Debug, Default)]
pub struct StoreOutcome {
    /// Hashes the caller now holds a reference on (newly stored or already present).
    pub pinned: Vec<u64>,
    /// BlockRemoved (for evictions) then BlockStored runs, in order.
    pub events: Vec<KvEvent>,
}

/// The cache of full blocks.
#[derive(Debug)]
pub struct PrefixCache {
    capacity: usize,
    blocks: HashMap<u64, Entry>,
    free_lru: BTreeMap<u64, u64>,
    tick: u64,
    referenced: usize,
}

impl PrefixCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self { capacity, blocks: HashMap::new(), free_lru: BTreeMap::new(), tick: 0, referenced: 0 }
    }

    /// Cached blocks that at least one running request references: each counted once however
    /// many requests share it (vLLM's block pool counts a physical block once).
    pub fn referenced(&self) -> usize {
        self.referenced
    }

    /// Number of cached blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Whether a block is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.blocks.contains_key(&hash)
    }

    /// Number of leading hashes of `chain` that are cached.
    pub fn match_prefix(&self, chain: &[u64]) -> usize {
        chain.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// Takes a reference on each cached hash of `hashes`; returns those pinned.
    pub fn pin(&mut self, hashes: &[u64]) -> Vec<u64> {
        hashes.iter().copied().filter(|h| self.pin_one(*h)).collect()
    }

    fn pin_one(&mut self, hash: u64) -> bool {
        match self.blocks.get_mut(&hash) {
            Some(entry) => {
                if entry.refs == 0 {
                    self.free_lru.remove(&entry.tick);
                    self.referenced += 1;
                }
                entry.refs += 1;
                true
            }
            None => false,
        }
    }

    /// Caches `chain[from..]` (block i's tokens are `tokens[i*bs..(i+1)*bs]`, its extra keys
    /// `keys.for_block(..)`), pinning each block for the caller. Evicts unreferenced LRU blocks for
    /// room; stops when nothing is evictable.
    pub fn store(
        &mut self,
        chain: &[u64],
        from: usize,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&(u32, String)>,
        keys: &BlockKeys,
    ) -> StoreOutcome {
        let mut outcome = StoreOutcome::default();
        let mut evicted = Vec::new();
        let mut runs: Vec<KvEvent> = Vec::new();
        let mut run: Option<(usize, usize)> = None; // [start, end) of the current new-block run
        let flush = |run: &mut Option<(usize, usize)>, runs: &mut Vec<KvEvent>| {
            if let Some((start, end)) = run.take() {
                runs.push(KvEvent::BlockStored {
                    block_hashes: chain[start..end].to_vec(),
                    parent_block_hash: start.checked_sub(1).map(|p| chain[p]),
                    token_ids: tokens[start * block_size..end * block_size].to_vec(),
                    block_size: block_size as u32,
                    lora: lora.cloned(),
                    extra_keys: keys.for_blocks(start, end, block_size),
                });
            }
        };
        for (i, &hash) in chain.iter().enumerate().skip(from) {
            if self.pin_one(hash) {
                outcome.pinned.push(hash);
                flush(&mut run, &mut runs);
                continue;
            }
            if self.blocks.len() >= self.capacity {
                match self.free_lru.pop_first() {
                    Some((_, victim)) => {
                        self.blocks.remove(&victim);
                        evicted.push(victim);
                    }
                    None => break, // every cached block is in use: this one cannot be cached
                }
            }
            self.blocks.insert(hash, Entry { refs: 1, tick: 0 });
            self.referenced += 1;
            outcome.pinned.push(hash);
            run = Some((run.map_or(i, |(start, _)| start), i + 1));
        }
        flush(&mut run, &mut runs);
        if !evicted.is_empty() {
            outcome.events.push(KvEvent::BlockRemoved { block_hashes: evicted });
        }
        outcome.events.extend(runs);
        outcome
    }

    /// Drops one reference on each of `hashes`, last first, so the tail becomes the LRU victim.
    pub fn release(&mut self, hashes: &[u64]) {
        for hash in hashes.iter().rev() {
            if let Some(entry) = self.blocks.get_mut(hash) {
                if entry.refs == 0 {
                    continue;
                }
                entry.refs -= 1;
                if entry.refs == 0 {
                    self.referenced -= 1;
                    self.tick += 1;
                    entry.tick = self.tick;
                    self.free_lru.insert(self.tick, *hash);
                }
            }
        }
    }

    /// Forgets every block (vLLM's `reset_prefix_cache`); references held are released silently.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.free_lru.clear();
        self.referenced = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;
    const NONE: BlockKeys = BlockKeys { lora: None, mm: Vec::new(), cache_salt: None };

    fn lora(name: &str) -> BlockKeys {
        BlockKeys { lora: Some(name.into()), ..BlockKeys::default() }
    }

    fn salted(salt: &str) -> BlockKeys {
        BlockKeys { cache_salt: Some(salt.into()), ..BlockKeys::default() }
    }

    fn tokens(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn chain_depends_on_parent_lora_and_seed() {
        let h = EngineHasher::new(7, BS as u32);
        let a = h.chain(&tokens(0, 10), &NONE);
        assert_eq!(a.len(), 2, "partial block ignored");
        let mut other = tokens(0, 8);
        other[0] = 99;
        assert_ne!(h.chain(&other, &NONE)[1], a[1], "second block hash depends on the first");
        assert_ne!(h.chain(&tokens(0, 8), &lora("sql-lora"))[0], a[0]);
        assert_ne!(EngineHasher::new(8, BS as u32).chain(&tokens(0, 8), &NONE)[0], a[0]);
        assert_eq!(h.chain(&tokens(0, 8), &NONE), a);
    }

    #[test]
    fn store_emits_chained_runs_and_skips_present_blocks() {
        let h = EngineHasher::new(1, BS as u32);
        let toks = tokens(0, 12);
        let chain = h.chain(&toks, &NONE);
        let mut cache = PrefixCache::new(10);
        let first = cache.store(&chain[..1], 0, &toks, BS, None, &NONE);
        assert_eq!(first.events.len(), 1);
        let out = cache.store(&chain, 0, &toks, BS, None, &NONE);
        assert_eq!(out.pinned, chain);
        assert_eq!(
            out.events,
            vec![KvEvent::BlockStored {
                block_hashes: chain[1..].to_vec(),
                parent_block_hash: Some(chain[0]),
                token_ids: toks[4..12].to_vec(),
                block_size: BS as u32,
                lora: None,
                extra_keys: vec![None, None],
            }]
        );
    }

    #[test]
    fn evicts_unreferenced_tail_first_and_never_pinned_blocks() {
        let h = EngineHasher::new(1, BS as u32);
        let a = tokens(0, 8);
        let chain_a = h.chain(&a, &NONE);
        let mut cache = PrefixCache::new(3);
        let pinned = cache.store(&chain_a, 0, &a, BS, None, &NONE).pinned;
        cache.release(&pinned);
        let b = tokens(100, 8);
        let chain_b = h.chain(&b, &NONE);
        let out = cache.store(&chain_b, 0, &b, BS, None, &NONE);
        // One free slot, then the LRU victim is A's tail (released last-first).
        assert_eq!(out.events[0], KvEvent::BlockRemoved { block_hashes: vec![chain_a[1]] });
        assert!(cache.contains(chain_a[0]));
        assert_eq!(cache.len(), 3);
        // Everything is now pinned or A's head; storing C evicts A's head, then stops.
        let c = tokens(200, 8);
        let chain_c = h.chain(&c, &NONE);
        let out_c = cache.store(&chain_c, 0, &c, BS, None, &NONE);
        assert_eq!(out_c.pinned, vec![chain_c[0]]);
        assert!(cache.contains(chain_b[0]) && cache.contains(chain_b[1]));
        assert_eq!(cache.match_prefix(&chain_a), 0);
    }

    /// vLLM's placement: salt in block 0 only, LoRA name in every block, an image's
    /// `(identifier, offset from the block's start)` in each block its placeholders overlap.
    #[test]
    fn extra_keys_follow_vllm_placement() {
        let keys = BlockKeys {
            lora: Some("sql-lora".into()),
            mm: vec![MmPlaceholder { identifier: "img-a".into(), offset: 6, length: 5 }],
            cache_salt: Some("tenant-1".into()),
        };
        let mm = |offset| ExtraKey::Mm { identifier: "img-a".into(), offset };
        let lora = || ExtraKey::Lora("sql-lora".into());
        assert_eq!(
            keys.for_blocks(0, 4, BS),
            vec![
                Some(vec![lora(), ExtraKey::Salt("tenant-1".into())]),
                Some(vec![lora(), mm(2)]),
                Some(vec![lora(), mm(-2)]),
                Some(vec![lora()]),
            ]
        );
        assert_eq!(NONE.for_block(0, BS), None);
    }

    #[test]
    fn a_salt_changes_every_block_and_the_same_salt_matches() {
        let h = EngineHasher::new(3, BS as u32);
        let plain = h.chain(&tokens(0, 12), &NONE);
        let a = h.chain(&tokens(0, 12), &salted("a"));
        assert!(plain.iter().zip(&a).all(|(p, s)| p != s), "salt on block 0 chains into every block");
        assert_eq!(h.chain(&tokens(0, 12), &salted("a")), a);
        assert_ne!(h.chain(&tokens(0, 12), &salted("b"))[0], a[0]);
        // An image changes the blocks its placeholders cover and every block after them.
        let img = |id: &str| BlockKeys {
            mm: vec![MmPlaceholder { identifier: id.into(), offset: 4, length: 4 }],
            ..BlockKeys::default()
        };
        let x = h.chain(&tokens(0, 12), &img("x"));
        assert_eq!(x[0], plain[0]);
        assert_ne!(x[1], plain[1]);
        assert_ne!(h.chain(&tokens(0, 12), &img("y"))[1], x[1]);
    }

    #[test]
    fn stored_events_carry_extra_keys_only_when_some_block_has_them() {
        let h = EngineHasher::new(1, BS as u32);
        let toks = tokens(0, 8);
        let keys = salted("s");
        let chain = h.chain(&toks, &keys);
        let mut cache = PrefixCache::new(10);
        let out = cache.store(&chain, 0, &toks, BS, None, &keys);
        match &out.events[..] {
            [KvEvent::BlockStored { extra_keys, .. }] => {
                assert_eq!(extra_keys, &vec![Some(vec![ExtraKey::Salt("s".into())]), None]);
            }
            other => panic!("{other:?}"),
        }
    }

    /// A block shared by several running requests is one referenced block, as in vLLM's pool.
    #[test]
    fn shared_blocks_are_referenced_once() {
        let h = EngineHasher::new(1, BS as u32);
        let toks = tokens(0, 8);
        let chain = h.chain(&toks, &NONE);
        let mut cache = PrefixCache::new(10);
        let first = cache.store(&chain, 0, &toks, BS, None, &NONE).pinned;
        let second = cache.pin(&chain);
        let third = cache.pin(&chain);
        assert_eq!(cache.referenced(), 2);
        cache.release(&first);
        cache.release(&second);
        assert_eq!(cache.referenced(), 2);
        cache.release(&third);
        assert_eq!(cache.referenced(), 0);
        cache.release(&third);
        assert_eq!(cache.referenced(), 0, "an extra release is ignored");
        assert_eq!(cache.len(), 2, "unreferenced blocks stay cached");
    }
}
