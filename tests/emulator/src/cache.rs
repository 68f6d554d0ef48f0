//! The emulated GPU prefix cache: full blocks keyed by opaque, chained engine hashes, with vLLM's
//! reference counting and LRU eviction of unreferenced blocks.
//!
//! Hashes are made "the vLLM way" in spirit: opaque 64-bit values chained over (parent hash, the
//! block's tokens, the LoRA name), keyed by a per-process random seed (vLLM: low 64 bits of SHA-256
//! of the pickled tuple, with a random root unless PYTHONHASHSEED is fixed). They are deliberately
//! not kvroute's hash: the agent must re-hash `token_ids`.
//!
//! Invariants: at most `capacity` blocks are cached; a block referenced by a running request
//! (`refs > 0`) is never evicted; `free_lru` holds exactly the unreferenced blocks, oldest tick
//! first. A request releases its blocks last-to-first, so a prompt's tail is evicted before its
//! head (as vLLM's free queue does). Not thread-safe by itself: the engine wraps it in a mutex.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use crate::kv_events::KvEvent;

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

    /// Hashes of the full blocks of `tokens` (a trailing partial block is ignored).
    pub fn chain(&self, tokens: &[u32], lora: Option<&str>) -> Vec<u64> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                self.seed.hash(&mut h);
                parent.hash(&mut h);
                block.hash(&mut h);
                lora.hash(&mut h);
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
}

impl PrefixCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self { capacity, blocks: HashMap::new(), free_lru: BTreeMap::new(), tick: 0 }
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
                }
                entry.refs += 1;
                true
            }
            None => false,
        }
    }

    /// Caches `chain[from..]` (block i's tokens are `tokens[i*bs..(i+1)*bs]`), pinning each block
    /// for the caller. Evicts unreferenced LRU blocks for room; stops when nothing is evictable.
    pub fn store(
        &mut self,
        chain: &[u64],
        from: usize,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&(u32, String)>,
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
                entry.refs = entry.refs.saturating_sub(1);
                if entry.refs == 0 {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;

    fn tokens(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn chain_depends_on_parent_lora_and_seed() {
        let h = EngineHasher::new(7, BS as u32);
        let a = h.chain(&tokens(0, 10), None);
        assert_eq!(a.len(), 2, "partial block ignored");
        let mut other = tokens(0, 8);
        other[0] = 99;
        assert_ne!(h.chain(&other, None)[1], a[1], "second block hash depends on the first");
        assert_ne!(h.chain(&tokens(0, 8), Some("sql-lora"))[0], a[0]);
        assert_ne!(EngineHasher::new(8, BS as u32).chain(&tokens(0, 8), None)[0], a[0]);
        assert_eq!(h.chain(&tokens(0, 8), None), a);
    }

    #[test]
    fn store_emits_chained_runs_and_skips_present_blocks() {
        let h = EngineHasher::new(1, BS as u32);
        let toks = tokens(0, 12);
        let chain = h.chain(&toks, None);
        let mut cache = PrefixCache::new(10);
        let first = cache.store(&chain[..1], 0, &toks, BS, None);
        assert_eq!(first.events.len(), 1);
        let out = cache.store(&chain, 0, &toks, BS, None);
        assert_eq!(out.pinned, chain);
        assert_eq!(
            out.events,
            vec![KvEvent::BlockStored {
                block_hashes: chain[1..].to_vec(),
                parent_block_hash: Some(chain[0]),
                token_ids: toks[4..12].to_vec(),
                block_size: BS as u32,
                lora: None,
            }]
        );
    }

    #[test]
    fn evicts_unreferenced_tail_first_and_never_pinned_blocks() {
        let h = EngineHasher::new(1, BS as u32);
        let a = tokens(0, 8);
        let chain_a = h.chain(&a, None);
        let mut cache = PrefixCache::new(3);
        let pinned = cache.store(&chain_a, 0, &a, BS, None).pinned;
        cache.release(&pinned);
        let b = tokens(100, 8);
        let chain_b = h.chain(&b, None);
        let out = cache.store(&chain_b, 0, &b, BS, None);
        // One free slot, then the LRU victim is A's tail (released last-first).
        assert_eq!(out.events[0], KvEvent::BlockRemoved { block_hashes: vec![chain_a[1]] });
        assert!(cache.contains(chain_a[0]));
        assert_eq!(cache.len(), 3);
        // Everything is now pinned or A's head; storing C evicts A's head, then stops.
        let c = tokens(200, 8);
        let chain_c = h.chain(&c, None);
        let out_c = cache.store(&chain_c, 0, &c, BS, None);
        assert_eq!(out_c.pinned, vec![chain_c[0]]);
        assert!(cache.contains(chain_b[0]) && cache.contains(chain_b[1]));
        assert_eq!(cache.match_prefix(&chain_a), 0);
    }
}
