//! The emulated GPU KV cache, modelled on vLLM's block pool (`vllm/v1/core/block_pool.py`) so
//! that hits, evictions and KV usage follow the same arithmetic as the real engine's.
//!
//! - `num_gpu_blocks` physical blocks, of which one is vLLM's null block: `num_gpu_blocks − 1`
//!   are usable, and KV usage is `1 − free / (num_gpu_blocks − 1)`.
//! - A running request holds one block per `block_size` tokens whose KV it has computed or is
//!   computing, the partial last one included; prefix-cache hits are shared (reference counted).
//! - A full block is cached (given its chained hash) when the step that computes its last token
//!   is scheduled; a BlockStored is published then. vLLM does not de-duplicate: a block computed
//!   again (the last prompt block when the whole prompt was cached: hits stop at prompt − 1
//!   tokens) is cached as a second copy of the same hash, and stored again.
//! - Free blocks form one queue. Blocks are taken from its front. A request's blocks are freed
//!   last to first: those without a hash go to the front (reused first, LIFO), cached ones to the
//!   back (LRU). Taking a cached block evicts it: one BlockRemoved per block. So eviction only
//!   starts when no empty block is left, and a prompt's tail goes before its head.
//!
//! One departure: vLLM admits a request only when its blocks are free (else it waits, or a
//! running request is preempted); the emulator runs it anyway. Blocks it needed beyond the free
//! ones are counted as [`BlockPool::missing`] (in use, never cached).
//!
//! Invariants: every usable block is either in the free queue (`refs == 0`) or referenced
//! (`refs > 0`), never both; `cached` maps each hash to the blocks holding it, in insertion order
//! (lookups take the first, as vLLM's dict does); a block with a hash is in `cached` under it.
//! Not thread-safe by itself: the engine wraps it in a mutex.

use std::collections::{BTreeMap, HashMap};

use crate::cache::BlockKeys;
use crate::kv_events::KvEvent;

/// Index of a physical block in the pool.
pub type BlockId = u32;

#[derive(Debug, Default)]
struct Block {
    /// The chained hash of the full block cached here, if any.
    hash: Option<u64>,
    /// Running requests that hold it.
    refs: u32,
    /// Its key in the free queue while free.
    free_key: Option<i64>,
}

/// What a run of newly full blocks is: their tokens and what identifies them besides.
#[derive(Debug, Clone, Copy)]
pub struct BlockContent<'a> {
    /// Engine hashes of every full block of the request so far, in order.
    pub chain: &'a [u64],
    /// The request's tokens (at least `chain.len() * block_size`).
    pub tokens: &'a [u32],
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapter (id, name), if any.
    pub lora: Option<&'a (u32, String)>,
    /// Salt, images, adapter name.
    pub keys: &'a BlockKeys,
}

/// The pool of KV blocks.
#[derive(Debug)]
pub struct BlockPool {
    num_gpu_blocks: usize,
    blocks: Vec<Block>,
    /// Free blocks by position: the smallest key is the front.
    free: BTreeMap<i64, BlockId>,
    next_front: i64,
    next_back: i64,
    cached: HashMap<u64, Vec<BlockId>>,
    missing: u64,
}

impl BlockPool {
    /// A pool of vLLM's `num_gpu_blocks` (null block included), all free and empty.
    pub fn new(num_gpu_blocks: usize) -> Self {
        let usable = num_gpu_blocks.saturating_sub(1);
        let blocks = (0..usable).map(|_| Block::default()).collect::<Vec<_>>();
        let mut pool = Self {
            num_gpu_blocks,
            blocks,
            free: BTreeMap::new(),
            next_front: -1,
            next_back: 0,
            cached: HashMap::new(),
            missing: 0,
        };
        let all: Vec<BlockId> = (0..usable as BlockId).collect();
        pool.append(&all);
        pool
    }

    /// vLLM's `num_gpu_blocks`, the null block included.
    pub fn num_gpu_blocks(&self) -> usize {
        self.num_gpu_blocks
    }

    /// Blocks that can hold KV: `num_gpu_blocks − 1`.
    pub fn usable(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks, empty or cached.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks running requests hold, plus those they needed when none was free.
    pub fn in_use(&self) -> u64 {
        (self.blocks.len() - self.free.len()) as u64 + self.missing
    }

    /// Blocks requests needed beyond the free ones (the emulator ran them anyway).
    pub fn missing(&self) -> u64 {
        self.missing
    }

    /// Distinct hashes cached.
    pub fn len(&self) -> usize {
        self.cached.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.cached.is_empty()
    }

    /// Whether a hash is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Number of leading hashes of `chain` that are cached.
    pub fn match_prefix(&self, chain: &[u64]) -> usize {
        chain.iter().take_while(|h| self.cached.contains_key(h)).count()
    }

    /// Takes a reference on the (first) block of each cached hash of `hashes`, taking free ones
    /// out of the free queue; returns the blocks (stops at the first hash not cached).
    pub fn touch(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let Some(&id) = self.cached.get(h).and_then(|ids| ids.first()) else { break };
            self.take_ref(id);
            out.push(id);
        }
        out
    }

    fn take_ref(&mut self, id: BlockId) {
        let b = &mut self.blocks[id as usize];
        if let Some(key) = b.free_key.take() {
            self.free.remove(&key);
        }
        b.refs += 1;
    }

    /// Takes up to `n` blocks from the front of the free queue, evicting the cached ones (a
    /// BlockRemoved each, into `events`). Blocks short of `n` are counted as missing; the caller
    /// adds them to its own count and returns them with [`free`](Self::free).
    pub fn allocate(&mut self, n: usize, events: &mut Vec<KvEvent>) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some((_, id)) = self.free.pop_first() else { break };
            let b = &mut self.blocks[id as usize];
            b.free_key = None;
            b.refs = 1;
            if let Some(hash) = b.hash.take() {
                self.uncache(hash, id);
                events.push(KvEvent::BlockRemoved { block_hashes: vec![hash] });
            }
            out.push(id);
        }
        self.missing += (n - out.len()) as u64;
        out
    }

    /// Counts `n` more blocks needed when none was free (see [`allocate`](Self::allocate)).
    pub fn add_missing(&mut self, n: u64) {
        self.missing += n;
    }

    fn uncache(&mut self, hash: u64, id: BlockId) {
        if let Some(ids) = self.cached.get_mut(&hash) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.cached.remove(&hash);
            }
        }
    }

    /// Caches blocks `from..to` of a request (`blocks[i]` holds its block `i`), now full, under
    /// `content.chain[i]`, and pushes one BlockStored for the run into `events`. A hash already
    /// held by another block gets a second copy (vLLM does not de-duplicate).
    pub fn cache(
        &mut self,
        blocks: &[BlockId],
        from: usize,
        to: usize,
        content: BlockContent<'_>,
        events: &mut Vec<KvEvent>,
    ) {
        let to = to.min(blocks.len()).min(content.chain.len());
        if from >= to {
            return;
        }
        for (&id, &hash) in blocks[from..to].iter().zip(&content.chain[from..to]) {
            let b = &mut self.blocks[id as usize];
            if b.hash.is_some() {
                continue;
            }
            b.hash = Some(hash);
            self.cached.entry(hash).or_default().push(id);
        }
        let bs = content.block_size;
        events.push(KvEvent::BlockStored {
            block_hashes: content.chain[from..to].to_vec(),
            parent_block_hash: from.checked_sub(1).map(|p| content.chain[p]),
            token_ids: content.tokens[from * bs..to * bs].to_vec(),
            block_size: bs as u32,
            lora: content.lora.cloned(),
            extra_keys: content.keys.for_blocks(from, to, bs),
        });
    }

    /// Returns a request's blocks (in token order) and its missing count: each drops a
    /// reference, last block first; those no longer referenced become free, empty ones at the
    /// front, cached ones at the back (vLLM's `free_blocks`).
    pub fn free(&mut self, blocks: &[BlockId], missing: u64) {
        self.missing -= missing.min(self.missing);
        let (mut empty, mut cached) = (Vec::new(), Vec::new());
        for &id in blocks.iter().rev() {
            let b = &mut self.blocks[id as usize];
            if b.refs == 0 {
                continue;
            }
            b.refs -= 1;
            if b.refs == 0 {
                if b.hash.is_some() { cached.push(id) } else { empty.push(id) }
            }
        }
        self.prepend(&empty);
        self.append(&cached);
    }

    fn prepend(&mut self, ids: &[BlockId]) {
        // The first of `ids` becomes the front.
        for &id in ids.iter().rev() {
            self.free.insert(self.next_front, id);
            self.blocks[id as usize].free_key = Some(self.next_front);
            self.next_front -= 1;
        }
    }

    fn append(&mut self, ids: &[BlockId]) {
        for &id in ids {
            self.free.insert(self.next_back, id);
            self.blocks[id as usize].free_key = Some(self.next_back);
            self.next_back += 1;
        }
    }

    /// Forgets every hash (vLLM's `reset_prefix_cache`); blocks held stay held, now empty.
    pub fn clear(&mut self) {
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{EngineHasher, ExtraKey};

    const BS: usize = 4;
    const NONE: BlockKeys = BlockKeys { lora: None, mm: Vec::new(), cache_salt: None };

    fn tokens(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    /// A request's life in the pool: touch its hits, allocate the rest of its prompt, cache the
    /// full blocks. Returns (blocks, hit blocks, events).
    fn run(pool: &mut BlockPool, toks: &[u32], keys: &BlockKeys) -> (Vec<BlockId>, usize, Vec<KvEvent>) {
        let chain = EngineHasher::new(1, BS as u32).chain(toks, keys);
        let hit = pool.match_prefix(&chain).min((toks.len() - 1) / BS);
        let mut blocks = pool.touch(&chain[..hit]);
        let mut events = Vec::new();
        let need = toks.len().div_ceil(BS) - blocks.len();
        blocks.extend(pool.allocate(need, &mut events));
        let content = BlockContent { chain: &chain, tokens: toks, block_size: BS, lora: None, keys };
        pool.cache(&blocks, hit, toks.len() / BS, content, &mut events);
        (blocks, hit, events)
    }

    fn removed(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::BlockRemoved { block_hashes } => block_hashes.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    fn stored(events: &[KvEvent]) -> Vec<u64> {
        events
            .iter()
            .flat_map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                _ => Vec::new(),
            })
            .collect()
    }

    #[test]
    fn the_null_block_is_not_usable_and_usage_counts_held_blocks() {
        let mut pool = BlockPool::new(11);
        assert_eq!((pool.usable(), pool.num_free(), pool.in_use()), (10, 10, 0));
        let (blocks, _, _) = run(&mut pool, &tokens(0, 9), &NONE);
        assert_eq!(blocks.len(), 3, "two full blocks and the partial one");
        assert_eq!(pool.in_use(), 3);
        pool.free(&blocks, 0);
        assert_eq!(pool.in_use(), 0, "cached blocks nobody holds are free");
        assert_eq!(pool.len(), 2);
    }

    /// The partial block of a finished request is reused before any cached block is evicted.
    #[test]
    fn empty_blocks_are_reused_before_cached_ones_are_evicted() {
        let mut pool = BlockPool::new(7); // 6 usable
        let (a, _, _) = run(&mut pool, &tokens(0, 9), &NONE); // 2 full + 1 partial
        pool.free(&a, 0);
        let (b, _, events) = run(&mut pool, &tokens(100, 9), &NONE);
        assert!(removed(&events).is_empty(), "4 empty blocks were left for B's 3");
        pool.free(&b, 0);
        // 4 cached, 2 empty: C's 3 blocks take both empty ones and evict A's tail.
        let a_chain = EngineHasher::new(1, BS as u32).chain(&tokens(0, 9), &NONE);
        let (_, _, events) = run(&mut pool, &tokens(200, 9), &NONE);
        assert_eq!(removed(&events), vec![a_chain[1]]);
        assert_eq!(pool.match_prefix(&a_chain), 1, "A's head is still cached");
    }

    #[test]
    fn eviction_follows_release_order_tail_first_and_never_takes_held_blocks() {
        let mut pool = BlockPool::new(5); // 4 usable
        let a_chain = EngineHasher::new(1, BS as u32).chain(&tokens(0, 8), &NONE);
        let (a, _, _) = run(&mut pool, &tokens(0, 8), &NONE);
        pool.free(&a, 0);
        let (b, _, events) = run(&mut pool, &tokens(100, 8), &NONE);
        assert!(removed(&events).is_empty());
        // B is still running: C can only take A's blocks, tail first, then runs short by one.
        let (c, _, events) = run(&mut pool, &tokens(200, 12), &NONE);
        assert_eq!(removed(&events), vec![a_chain[1], a_chain[0]]);
        assert_eq!(c.len(), 2);
        assert_eq!(pool.missing(), 1);
        assert_eq!(pool.in_use(), 5, "over capacity by the missing block");
        pool.free(&c, 1);
        pool.free(&b, 0);
        assert_eq!((pool.missing(), pool.in_use()), (0, 0));
    }

    /// vLLM caps a hit at prompt − 1 tokens: a fully cached prompt whose length is a multiple of
    /// the block size computes its last block again, into a new block cached as a second copy.
    #[test]
    fn a_recomputed_last_block_is_a_second_copy_of_its_hash() {
        let mut pool = BlockPool::new(11);
        let (a, _, _) = run(&mut pool, &tokens(0, 8), &NONE);
        pool.free(&a, 0);
        let (b, hit, events) = run(&mut pool, &tokens(0, 8), &NONE);
        assert_eq!(hit, 1);
        let chain = EngineHasher::new(1, BS as u32).chain(&tokens(0, 8), &NONE);
        assert_eq!(stored(&events), vec![chain[1]], "stored again");
        assert_ne!(b[1], a[1], "in a new block");
        pool.free(&b, 0);
        // The free queue is now: 7 empty blocks, A's copy of block 1, B's copy, block 0.
        // Taking 8 evicts A's copy (a BlockRemoved of the hash) while B's stays cached.
        let mut events = Vec::new();
        assert_eq!(pool.allocate(8, &mut events).len(), 8);
        assert_eq!(removed(&events), vec![chain[1]]);
        assert!(pool.contains(chain[1]), "the other copy is still cached");
    }

    #[test]
    fn shared_blocks_are_held_once() {
        let mut pool = BlockPool::new(101);
        let (a, _, _) = run(&mut pool, &tokens(0, 9), &NONE);
        let (b, hit, _) = run(&mut pool, &tokens(0, 9), &NONE);
        assert_eq!(hit, 2);
        assert_eq!(pool.in_use(), 4, "2 shared full blocks + a partial block each");
        pool.free(&a, 0);
        assert_eq!(pool.in_use(), 3);
        pool.free(&b, 0);
        assert_eq!(pool.in_use(), 0);
        assert_eq!(pool.len(), 2, "unreferenced blocks stay cached");
    }

    #[test]
    fn stored_events_chain_and_carry_extra_keys_only_when_some_block_has_them() {
        let mut pool = BlockPool::new(11);
        let keys = BlockKeys { cache_salt: Some("s".into()), ..BlockKeys::default() };
        let (_, _, events) = run(&mut pool, &tokens(0, 8), &keys);
        match &events[..] {
            [KvEvent::BlockStored { extra_keys, parent_block_hash: None, token_ids, .. }] => {
                assert_eq!(extra_keys, &vec![Some(vec![ExtraKey::Salt("s".into())]), None]);
                assert_eq!(token_ids, &tokens(0, 8));
            }
            other => panic!("{other:?}"),
        }
        // A prompt extending a cached one stores only its new blocks, parented on the last hit.
        let chain = EngineHasher::new(1, BS as u32).chain(&tokens(0, 12), &NONE);
        let (_, _, _) = run(&mut pool, &tokens(0, 8), &NONE);
        let (_, hit, events) = run(&mut pool, &tokens(0, 13), &NONE);
        assert_eq!(hit, 2);
        match &events[..] {
            [KvEvent::BlockStored { block_hashes, parent_block_hash, .. }] => {
                assert_eq!(block_hashes, &vec![chain[2]]);
                assert_eq!(*parent_block_hash, Some(chain[1]));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn clear_forgets_hashes_but_not_held_blocks() {
        let mut pool = BlockPool::new(11);
        let (a, _, _) = run(&mut pool, &tokens(0, 9), &NONE);
        pool.clear();
        assert!(pool.is_empty());
        assert_eq!(pool.in_use(), 3);
        pool.free(&a, 0);
        assert_eq!(pool.in_use(), 0);
        let mut events = Vec::new();
        pool.allocate(10, &mut events);
        assert!(events.is_empty(), "nothing left to evict");
    }
}
