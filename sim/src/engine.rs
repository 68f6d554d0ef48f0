//! The engine cost model: one simulated vLLM pod (docs/design.md §8's timing model, docs/design.md §4's numbers).
//!
//! - Prefill costs `prefill_s_per_token` per *uncached* prompt token (docs/design.md §4: ≈ 0.9 s per 4096
//!   tokens for Llama-3.1-8B, ≈ 8.2 s for 70B, on one A100); the cached part is the longest prefix
//!   of the request's blocks the pod holds when its prefill starts (vLLM's automatic prefix cache).
//! - Prefills run one at a time per pod (compute-bound), first come first served; decode runs for
//!   every admitted request concurrently at `decode_s_per_token` per output token. At most
//!   `max_batch` requests are admitted (prefilling or decoding); the rest wait (this is
//!   `num_requests_waiting`).
//! - KV capacity is `kv_capacity_blocks`; blocks are stored when a prefill completes and evicted
//!   least recently used first. Within one request the tail of the chain is marked older than its
//!   head, so a chain is evicted from its end, as vLLM frees blocks in reverse order.
//! - LoRA: a request whose adapter is not loaded pays `adapter_load_s` (docs/design.md §4: ≈ 200 ms, rank 16)
//!   before its prefill; at most `max_adapters` stay loaded (LRU).
//!
//! Not modelled: chunked prefill interleaving with decode, preemption, decode slowdown with batch
//! size, prefill cost superlinear in context length.

use std::collections::{BTreeMap, HashMap, VecDeque};

use kvroute_common::BlockHash;

/// Engine timing and capacity, in seconds and blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Prefill seconds per uncached prompt token. 8B default: 0.9 / 4096 (docs/design.md §4).
    pub prefill_s_per_token: f64,
    /// Decode seconds per output token (inter-token latency). Default 0.015 (8B on A100).
    pub decode_s_per_token: f64,
    /// Requests admitted at once (prefilling + decoding). Default 32.
    pub max_batch: usize,
    /// KV capacity per pod, blocks. Default 450 000 tokens / 16 (docs/design.md §10).
    pub kv_capacity_blocks: usize,
    /// Seconds to load a LoRA adapter that is not resident. Default 0.2 (docs/design.md §4, rank 16).
    pub adapter_load_s: f64,
    /// LoRA adapters resident at once. Default 4 (docs/design.md §9: 3–5 per pod).
    pub max_adapters: usize,
}

impl CostModel {
    /// Llama-3.1-8B on one A100 (docs/design.md §4: 0.9 s prefill per 4096 tokens).
    pub fn llama_8b() -> CostModel {
        CostModel {
            prefill_s_per_token: 0.9 / 4096.0,
            decode_s_per_token: 0.015,
            max_batch: 32,
            kv_capacity_blocks: 450_000 / 16,
            adapter_load_s: 0.2,
            max_adapters: 4,
        }
    }

    /// Llama-3.1-70B on A100s (docs/design.md §4: 8.2 s prefill per 4096 tokens); decode 0.045 s/token.
    pub fn llama_70b() -> CostModel {
        CostModel { prefill_s_per_token: 8.2 / 4096.0, decode_s_per_token: 0.045, ..CostModel::llama_8b() }
    }
}

/// What a pod reports about itself at one instant (the agent's PodStats).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// `num_requests_waiting`.
    pub waiting: u32,
    /// `num_requests_running`.
    pub running: u32,
    /// `kv_cache_usage_perc` in [0,1].
    pub kv_usage: f64,
    /// GPU utilization in [0,1]: running / max_batch (docs/design.md §7 mock-NVML default).
    pub gpu_utilization: f64,
    /// Resident LoRA adapters.
    pub adapters: Vec<String>,
}

/// LRU set of block hashes with a capacity; evictions are recorded for the next report.
#[derive(Debug, Default)]
pub struct BlockLru {
    capacity: usize,
    stamp_of: HashMap<u64, u64>,
    by_stamp: BTreeMap<u64, u64>,
    clock: u64,
}

impl BlockLru {
    /// An empty cache holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        BlockLru { capacity, ..BlockLru::default() }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.stamp_of.len()
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.stamp_of.is_empty()
    }

    /// Consecutive blocks of `chain` from its start that are held.
    pub fn prefix_hit(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|b| self.stamp_of.contains_key(&b.0)).count()
    }

    /// Marks `chain` most recently used (head newest), inserting missing blocks and evicting the
    /// least recently used beyond capacity. New blocks go to `stored`, evicted ones to `evicted`.
    pub fn touch(&mut self, chain: &[BlockHash], stored: &mut Vec<BlockHash>, evicted: &mut Vec<BlockHash>) {
        let n = chain.len() as u64;
        let base = self.clock;
        self.clock += n;
        for (i, b) in chain.iter().enumerate() {
            // Head gets the largest stamp: evicted last.
            let stamp = base + (n - i as u64);
            match self.stamp_of.insert(b.0, stamp) {
                Some(old) => {
                    self.by_stamp.remove(&old);
                }
                None => stored.push(*b),
            }
            self.by_stamp.insert(stamp, b.0);
        }
        while self.stamp_of.len() > self.capacity {
            let Some((_, h)) = self.by_stamp.pop_first() else { break };
            self.stamp_of.remove(&h);
            evicted.push(BlockHash(h));
        }
    }
}

/// A request admitted or waiting on a pod.
#[derive(Debug, Clone, Copy)]
pub struct Admitted {
    /// Request id.
    pub req: usize,
    /// Prompt blocks found cached at prefill start.
    pub hit_blocks: usize,
    /// Prefill duration, µs (including an adapter load).
    pub prefill_us: u64,
}

/// One simulated pod.
#[derive(Debug)]
pub struct PodEngine {
    /// KV cache (GPU blocks).
    pub kv: BlockLru,
    /// Requests waiting for admission, FIFO.
    pub waiting: VecDeque<usize>,
    /// Admitted requests (prefilling or decoding).
    pub running: usize,
    /// True while a prefill runs.
    pub prefilling: bool,
    /// Resident adapters, least recently used first.
    pub adapters: Vec<String>,
    /// Block changes since the last report.
    pub stored: Vec<BlockHash>,
    /// Evictions since the last report.
    pub removed: Vec<BlockHash>,
    max_batch: usize,
    max_adapters: usize,
}

impl PodEngine {
    /// An idle pod with an empty cache.
    pub fn new(cost: &CostModel) -> Self {
        PodEngine {
            kv: BlockLru::new(cost.kv_capacity_blocks),
            waiting: VecDeque::new(),
            running: 0,
            prefilling: false,
            adapters: Vec::new(),
            stored: Vec::new(),
            removed: Vec::new(),
            max_batch: cost.max_batch.max(1),
            max_adapters: cost.max_adapters.max(1),
        }
    }

    /// Can the head of the queue start its prefill now?
    pub fn can_start(&self) -> bool {
        !self.prefilling && self.running < self.max_batch && !self.waiting.is_empty()
    }

    /// Starts the next prefill: looks up the cache, loads the adapter if needed.
    pub fn start_next(
        &mut self,
        chain: &[BlockHash],
        prompt_tokens: u32,
        adapter: Option<&str>,
        cost: &CostModel,
    ) -> Option<Admitted> {
        let req = self.waiting.pop_front()?;
        let hit_blocks = self.kv.prefix_hit(chain);
        let block_tokens = if chain.is_empty() { 0 } else { (prompt_tokens as usize) / chain.len().max(1) };
        let cached_tokens = (hit_blocks * block_tokens.max(1)).min(prompt_tokens as usize);
        // vLLM always recomputes at least the last prompt token.
        let uncached = (prompt_tokens as usize).saturating_sub(cached_tokens).max(1);
        let mut secs = uncached as f64 * cost.prefill_s_per_token;
        if let Some(a) = adapter {
            secs += self.use_adapter(a, cost);
        }
        self.prefilling = true;
        self.running += 1;
        Some(Admitted { req, hit_blocks, prefill_us: (secs * 1e6) as u64 })
    }

    fn use_adapter(&mut self, adapter: &str, cost: &CostModel) -> f64 {
        if let Some(pos) = self.adapters.iter().position(|a| a == adapter) {
            let a = self.adapters.remove(pos);
            self.adapters.push(a);
            return 0.0;
        }
        if self.adapters.len() >= self.max_adapters {
            self.adapters.remove(0);
        }
        self.adapters.push(adapter.to_string());
        cost.adapter_load_s
    }

    /// The prefill finished: its blocks are now cached (and reported).
    pub fn prefill_done(&mut self, chain: &[BlockHash]) {
        self.prefilling = false;
        self.kv.touch(chain, &mut self.stored, &mut self.removed);
    }

    /// A request finished decoding.
    pub fn finish(&mut self) {
        self.running = self.running.saturating_sub(1);
    }

    /// Current stats, as the agent would report them.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            waiting: u32::try_from(self.waiting.len()).unwrap_or(u32::MAX),
            running: u32::try_from(self.running).unwrap_or(u32::MAX),
            kv_usage: self.kv.len() as f64 / self.kv.capacity.max(1) as f64,
            gpu_utilization: (self.running as f64 / self.max_batch as f64).min(1.0),
            adapters: self.adapters.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(base: u64, n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(base * 1000 + i)).collect()
    }

    #[test]
    fn lru_evicts_chain_tails_first_and_oldest_chains_first() {
        let mut lru = BlockLru::new(6);
        let (mut s, mut e) = (Vec::new(), Vec::new());
        lru.touch(&chain(1, 4), &mut s, &mut e);
        lru.touch(&chain(2, 4), &mut s, &mut e);
        assert_eq!(s.len(), 8);
        assert_eq!(e, vec![BlockHash(1003), BlockHash(1002)], "chain 1's tail goes first");
        assert_eq!(lru.prefix_hit(&chain(1, 4)), 2);
        assert_eq!(lru.prefix_hit(&chain(2, 4)), 4);
    }

    #[test]
    fn prefill_time_counts_only_uncached_tokens() {
        let cost = CostModel::llama_8b();
        let mut pod = PodEngine::new(&cost);
        let c = chain(1, 256);
        pod.waiting.push_back(0);
        let cold = pod.start_next(&c, 4096, None, &cost).map(|a| a.prefill_us);
        assert_eq!(cold, Some(900_000), "docs/design.md §4: 0.9 s per 4096 tokens");
        pod.prefill_done(&c);
        pod.finish();
        pod.waiting.push_back(1);
        let hot = pod.start_next(&c, 4096, None, &cost);
        assert!(matches!(hot, Some(a) if a.hit_blocks == 256 && a.prefill_us < 1000));
    }
}
