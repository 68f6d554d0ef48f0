//! The engine model: one simulated vLLM pod, scheduled in steps as vLLM's V1 scheduler does
//! (docs/design.md §8's timing model, §4's numbers).
//!
//! - **Steps.** The pod runs one batch step at a time. A step takes `decode_base_s +
//!   decode_s_per_seq × decoding requests + prefill_s_per_token × prefill tokens` (+ adapter loads
//!   started in it): decode slows as the batch grows, and a prefill chunk in the batch slows every
//!   decoding request with it. Each step has a budget of `max_num_batched_tokens` tokens: first one
//!   token per decoding request, then prefill chunks (chunked prefill) of requests already running,
//!   then new requests from the waiting queue (first come, first served) while fewer than
//!   `max_batch` run. A request's first token comes at the end of the step that computes the last
//!   chunk of its prompt (TTFT); each later step adds one token.
//! - **KV cache.** `kv_capacity_blocks` blocks of `block_size` tokens hold both the prefix cache and
//!   the running requests: a request holds the cached blocks of its prefix (shared, counted once)
//!   and its own blocks (chunks being computed, the partial last block, decoded tokens). Full prompt
//!   blocks enter the prefix cache as soon as they are computed (and are reported); when a request
//!   ends, its cached blocks become evictable, least recently used first and a chain's tail before
//!   its head (vLLM frees a request's blocks in reverse order); its own blocks are freed.
//! - **Admission and preemption.** A new request takes the longest cached prefix of its prompt
//!   (never its last token, as vLLM recomputes it) and needs blocks for its first chunk. When a
//!   running request cannot get a block, the most recently admitted running request is preempted
//!   (blocks freed, back to the head of the queue, recomputed later), as vLLM V1 does; no new
//!   request is admitted in a step that preempted. This is what makes KV pressure expensive.
//! - **LoRA**: a request whose adapter is not loaded adds `adapter_load_s` to its first step; at
//!   most `max_adapters` stay loaded (LRU).
//! - **Stats** as the agent reports them: waiting and running requests, KV usage as vLLM's
//!   `kv_cache_usage_perc` (blocks held by running requests, shared ones once, ÷ capacity; free
//!   cached blocks do not count), GPU utilisation = running ÷ `max_batch` (the mock-NVML rule).
//!
//! Not modelled: prefill cost superlinear in context length, speculative decoding, CPU offload.

use std::collections::{BTreeMap, HashMap, VecDeque};

use kvroute_common::BlockHash;

use crate::workload::SimRequest;

/// Engine timing and capacity, in seconds, tokens and blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Prefill seconds per computed prompt token. 8B default: 0.9 / 4096 (docs/design.md §4).
    pub prefill_s_per_token: f64,
    /// Fixed cost of a step, seconds (8B: 0.013, about one request's inter-token latency).
    pub decode_base_s: f64,
    /// Added step time per decoding request in the batch, seconds (8B: 0.0002, so a batch of
    /// 128 decodes at ≈ 39 ms per token).
    pub decode_s_per_seq: f64,
    /// Requests running at once (vLLM `max_num_seqs`). Default 256.
    pub max_batch: usize,
    /// Tokens per step (vLLM `max_num_batched_tokens`; 2048 is vLLM's default for the API server
    /// on an A100).
    pub max_num_batched_tokens: usize,
    /// KV capacity per pod, blocks. Default 450 000 tokens / 16 (docs/design.md §10).
    pub kv_capacity_blocks: usize,
    /// Tokens per block. Default 16.
    pub block_size: usize,
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
            decode_base_s: 0.013,
            decode_s_per_seq: 0.0002,
            max_batch: 256,
            max_num_batched_tokens: 2048,
            kv_capacity_blocks: 450_000 / 16,
            block_size: 16,
            adapter_load_s: 0.2,
            max_adapters: 4,
        }
    }

    /// Llama-3.1-70B on A100s (docs/design.md §4: 8.2 s prefill per 4096 tokens); decode ≈ 45 ms
    /// per token for one request.
    pub fn llama_70b() -> CostModel {
        CostModel {
            prefill_s_per_token: 8.2 / 4096.0,
            decode_base_s: 0.044,
            decode_s_per_seq: 0.0006,
            ..CostModel::llama_8b()
        }
    }
}

/// What a pod reports about itself at one instant (the agent's PodStats).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// `num_requests_waiting`.
    pub waiting: u32,
    /// `num_requests_running`.
    pub running: u32,
    /// `kv_cache_usage_perc` in [0,1], vLLM's definition.
    pub kv_usage: f64,
    /// GPU utilization in [0,1]: running / max_batch (docs/design.md §7 mock-NVML default).
    pub gpu_utilization: f64,
    /// Resident LoRA adapters.
    pub adapters: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    refs: u32,
    /// Position in `free` while `refs == 0`.
    stamp: u64,
}

/// The pod's KV blocks: cached (prefix-cache entries, shared, reference counted) and private
/// (held by one running request, outside the cache).
///
/// Invariants: `entries.len() + private ≤ capacity`; `free` holds exactly the entries with
/// `refs == 0`, keyed by the stamp they got when released (smallest = least recently used).
#[derive(Debug, Default)]
pub struct KvCache {
    capacity: usize,
    entries: HashMap<u64, Entry>,
    free: BTreeMap<u64, u64>,
    clock: u64,
    private: usize,
}

impl KvCache {
    /// An empty cache of `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        KvCache { capacity, ..KvCache::default() }
    }

    /// Cached blocks (referenced or not).
    pub fn cached(&self) -> usize {
        self.entries.len()
    }

    /// Blocks held by running requests: referenced cached blocks once each, plus private ones.
    pub fn in_use(&self) -> usize {
        self.entries.len() - self.free.len() + self.private
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Consecutive blocks of `chain` from its start that are cached.
    pub fn prefix_hit(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|b| self.entries.contains_key(&b.0)).count()
    }

    /// Takes a reference on each of `hashes` (all cached).
    fn pin(&mut self, hashes: &[BlockHash]) {
        for h in hashes {
            if let Some(e) = self.entries.get_mut(&h.0) {
                if e.refs == 0 {
                    self.free.remove(&e.stamp);
                }
                e.refs += 1;
            }
        }
    }

    /// Drops one reference on each of `hashes`, last first (so a chain's tail is evicted first).
    fn release(&mut self, hashes: &[BlockHash]) {
        for h in hashes.iter().rev() {
            if let Some(e) = self.entries.get_mut(&h.0)
                && e.refs > 0
            {
                e.refs -= 1;
                if e.refs == 0 {
                    self.clock += 1;
                    e.stamp = self.clock;
                    self.free.insert(self.clock, h.0);
                }
            }
        }
    }

    /// Could `n` more private blocks be had (evicting free cached blocks)?
    fn can_alloc(&self, n: usize) -> bool {
        self.capacity - self.entries.len() - self.private + self.free.len() >= n
    }

    /// Could `n` private blocks be had once `hits` (cached) are pinned? Pinning takes free cached
    /// blocks out of the evictable ones.
    fn can_alloc_after_pin(&self, hits: &[BlockHash], n: usize) -> bool {
        let pinned_free = hits.iter().filter(|h| self.entries.get(&h.0).is_some_and(|e| e.refs == 0)).count();
        self.capacity - self.entries.len() - self.private + self.free.len() >= n + pinned_free
    }

    /// Allocates `n` private blocks, evicting least recently used free cached blocks (reported in
    /// `evicted`) for room; false (nothing changed) when even that is not enough.
    fn alloc(&mut self, n: usize, evicted: &mut Vec<BlockHash>) -> bool {
        if !self.can_alloc(n) {
            return false;
        }
        while self.capacity - self.entries.len() - self.private < n {
            let Some((_, h)) = self.free.pop_first() else { return false };
            self.entries.remove(&h);
            evicted.push(BlockHash(h));
        }
        self.private += n;
        true
    }

    /// Turns one private block into the cache entry `h`, referenced by its holder. If `h` is
    /// cached already (another request computed it at the same time), the holder references that
    /// one and its own copy is freed. Returns true when `h` is new (to be reported).
    fn commit(&mut self, h: BlockHash) -> bool {
        self.private -= 1;
        if self.entries.contains_key(&h.0) {
            self.pin(&[h]);
            return false;
        }
        self.entries.insert(h.0, Entry { refs: 1, stamp: 0 });
        true
    }

    /// Forgets every cached block; only called with no block referenced.
    fn clear(&mut self) {
        debug_assert_eq!(self.entries.len(), self.free.len(), "clear with referenced blocks");
        self.entries.clear();
        self.free.clear();
    }
}

/// A request on a pod, from admission to its end.
#[derive(Debug)]
struct Seq {
    req: usize,
    /// Tokens whose KV is computed (a prefix hit counts).
    computed: usize,
    /// Tokens to compute before the next token can be sampled (the prompt, plus the tokens
    /// generated before a preemption).
    target: usize,
    /// Output tokens produced.
    generated: u32,
    /// Cached blocks referenced: always `chain[..cached]`.
    cached: usize,
    /// Private blocks held.
    private: usize,
    /// Tokens scheduled in the current step (0 = not in it).
    scheduled: usize,
    /// Admitted once before (its first admission fixed its cache hit).
    admitted_before: bool,
}

impl Seq {
    fn new(req: usize) -> Seq {
        Seq { req, computed: 0, target: 0, generated: 0, cached: 0, private: 0, scheduled: 0, admitted_before: false }
    }
}

/// What happened to requests in a step, for the simulation loop.
#[derive(Debug, Default)]
pub struct StepResult {
    /// Requests whose first admission happened in this step: (request, cached prompt blocks).
    pub admitted: Vec<(usize, usize)>,
    /// Requests whose first token came at the end of this step.
    pub first_token: Vec<usize>,
    /// Requests that finished at the end of this step.
    pub finished: Vec<usize>,
}

/// One simulated pod.
#[derive(Debug)]
pub struct PodEngine {
    /// KV blocks.
    pub kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// True while a step is in flight.
    pub stepping: bool,
    /// Resident adapters, least recently used first.
    pub adapters: Vec<String>,
    /// Blocks newly cached since the last report.
    pub stored: Vec<BlockHash>,
    /// Evictions since the last report.
    pub removed: Vec<BlockHash>,
    /// The cache was emptied since the last report (`stored`/`removed` then follow the reset).
    pub cleared: bool,
    /// Preemptions so far.
    pub preemptions: u64,
    cost: CostModel,
    /// Admissions in the step in flight: (request, cached blocks).
    step_admitted: Vec<(usize, usize)>,
}

impl PodEngine {
    /// An idle pod with an empty cache.
    pub fn new(cost: &CostModel) -> Self {
        let mut cost = cost.clone();
        cost.max_batch = cost.max_batch.max(1);
        cost.max_adapters = cost.max_adapters.max(1);
        cost.block_size = cost.block_size.max(1);
        cost.max_num_batched_tokens = cost.max_num_batched_tokens.max(1);
        PodEngine {
            kv: KvCache::new(cost.kv_capacity_blocks),
            waiting: VecDeque::new(),
            running: Vec::new(),
            stepping: false,
            adapters: Vec::new(),
            stored: Vec::new(),
            removed: Vec::new(),
            cleared: false,
            preemptions: 0,
            cost,
            step_admitted: Vec::new(),
        }
    }

    /// Queues request `req`.
    pub fn enqueue(&mut self, req: usize) {
        self.waiting.push_back(Seq::new(req));
    }

    /// Requests waiting or running.
    pub fn load(&self) -> usize {
        self.waiting.len() + self.running.len()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cost.block_size)
    }

    fn use_adapter(&mut self, adapter: &str) -> f64 {
        if let Some(pos) = self.adapters.iter().position(|a| a == adapter) {
            let a = self.adapters.remove(pos);
            self.adapters.push(a);
            return 0.0;
        }
        if self.adapters.len() >= self.cost.max_adapters {
            self.adapters.remove(0);
        }
        self.adapters.push(adapter.to_string());
        self.cost.adapter_load_s
    }

    /// Frees everything `seq` holds.
    fn free_seq(&mut self, seq: &Seq, reqs: &[SimRequest]) {
        let chain = &reqs[seq.req].blocks;
        self.kv.release(&chain[..seq.cached.min(chain.len())]);
        self.kv.private -= seq.private;
    }

    /// Preempts the most recently admitted running request: frees its blocks and puts it back at
    /// the head of the queue, to be recomputed.
    fn preempt_last(&mut self, reqs: &[SimRequest]) -> Option<usize> {
        let mut seq = self.running.pop()?;
        self.free_seq(&seq, reqs);
        self.preemptions += 1;
        let req = seq.req;
        seq.computed = 0;
        seq.cached = 0;
        seq.private = 0;
        seq.scheduled = 0;
        self.waiting.push_front(seq);
        Some(req)
    }

    /// Plans the next step; returns its duration in µs, or `None` when there is nothing to do.
    /// Errors when a request can never be scheduled (it needs more blocks than the pod has).
    pub fn schedule(&mut self, reqs: &[SimRequest]) -> Result<Option<u64>, String> {
        let bs = self.cost.block_size;
        let mut budget = self.cost.max_num_batched_tokens;
        let mut decode = 0usize;
        let mut prefill = 0usize;
        let mut extra_s = 0.0;
        let mut preempted = false;
        self.step_admitted.clear();
        // Running requests, in admission order.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (tokens_after, want) = {
                let s = &self.running[i];
                if s.computed >= s.target {
                    let r = &reqs[s.req];
                    (r.prompt_tokens as usize + s.generated as usize + 1, 1)
                } else {
                    let chunk = (s.target - s.computed).min(budget);
                    (s.computed + chunk, chunk)
                }
            };
            let need = self.blocks_for(tokens_after).saturating_sub(self.running[i].cached + self.running[i].private);
            let mut evicted = std::mem::take(&mut self.removed);
            let mut ok = self.kv.alloc(need, &mut evicted);
            while !ok {
                // Preempt from the end until this one fits (or is itself the victim).
                let last = self.running.len() - 1;
                self.preempt_last(reqs);
                preempted = true;
                if last == i {
                    break;
                }
                ok = self.kv.alloc(need, &mut evicted);
            }
            self.removed = evicted;
            if !ok {
                break;
            }
            let s = &mut self.running[i];
            s.private += need;
            s.scheduled = want;
            if s.computed >= s.target {
                decode += 1;
            } else {
                prefill += want;
            }
            budget -= want;
            i += 1;
        }
        // New requests, first come first served, unless this step preempted.
        while !preempted && budget > 0 && self.running.len() < self.cost.max_batch {
            let Some(mut s) = self.waiting.pop_front() else { break };
            let r = &reqs[s.req];
            if s.target == 0 {
                s.target = r.prompt_tokens.max(1) as usize;
            } else {
                // Recompute after a preemption: prompt plus the tokens generated so far.
                s.target = r.prompt_tokens.max(1) as usize + s.generated as usize;
            }
            let max_hit = (s.target - 1) / bs;
            let hit = self.kv.prefix_hit(&r.blocks).min(max_hit).min(r.blocks.len());
            let computed = hit * bs;
            let chunk = (s.target - computed).min(budget);
            let need = self.blocks_for(computed + chunk) - hit;
            if !self.kv.can_alloc_after_pin(&r.blocks[..hit], need) {
                if self.running.is_empty() && self.blocks_for(s.target) > self.kv.capacity() {
                    return Err(format!(
                        "request {} needs {} blocks, more than the pod's {}",
                        s.req,
                        self.blocks_for(s.target),
                        self.kv.capacity()
                    ));
                }
                self.waiting.push_front(s);
                break;
            }
            self.kv.pin(&r.blocks[..hit]);
            let mut evicted = std::mem::take(&mut self.removed);
            let allocated = self.kv.alloc(need, &mut evicted);
            self.removed = evicted;
            debug_assert!(allocated);
            if let Some(a) = r.adapter.as_deref() {
                extra_s += self.use_adapter(a);
            }
            s.cached = hit;
            s.private = need;
            s.computed = computed;
            s.scheduled = chunk;
            if !s.admitted_before {
                s.admitted_before = true;
                self.step_admitted.push((s.req, hit));
            }
            prefill += chunk;
            budget -= chunk;
            self.running.push(s);
        }
        if decode == 0 && prefill == 0 {
            if !self.running.is_empty() || !self.waiting.is_empty() {
                return Err(format!(
                    "pod stuck: {} running, {} waiting, {} of {} blocks in use",
                    self.running.len(),
                    self.waiting.len(),
                    self.kv.in_use(),
                    self.kv.capacity()
                ));
            }
            return Ok(None);
        }
        let secs = self.cost.decode_base_s
            + self.cost.decode_s_per_seq * decode as f64
            + self.cost.prefill_s_per_token * prefill as f64
            + extra_s;
        self.stepping = true;
        Ok(Some((secs * 1e6).round().max(1.0) as u64))
    }

    /// Ends the step planned by [`PodEngine::schedule`]: advances every scheduled request, caches
    /// newly computed full prompt blocks, emits first tokens and finishes requests.
    pub fn complete(&mut self, reqs: &[SimRequest]) -> StepResult {
        let bs = self.cost.block_size;
        let mut out = StepResult { admitted: std::mem::take(&mut self.step_admitted), ..StepResult::default() };
        let mut i = 0;
        while i < self.running.len() {
            let scheduled = self.running[i].scheduled;
            if scheduled == 0 {
                i += 1;
                continue;
            }
            let req = self.running[i].req;
            let r = &reqs[req];
            let s = &mut self.running[i];
            s.scheduled = 0;
            let mut token = false;
            if s.computed >= s.target {
                token = true;
            } else {
                s.computed += scheduled;
                // Full prompt blocks now computed enter the prefix cache.
                let full = (s.computed.min(r.prompt_tokens as usize) / bs).min(r.blocks.len());
                while s.cached < full {
                    let h = r.blocks[s.cached];
                    s.cached += 1;
                    s.private -= 1;
                    if self.kv.commit(h) {
                        self.stored.push(h);
                    }
                }
                if s.computed >= s.target {
                    token = true;
                    if s.generated == 0 {
                        out.first_token.push(req);
                    }
                }
            }
            if token {
                s.generated += 1;
                if s.generated >= r.output_tokens.max(1) {
                    let s = self.running.remove(i);
                    self.free_seq(&s, reqs);
                    out.finished.push(req);
                    continue;
                }
            }
            i += 1;
        }
        self.stepping = false;
        out
    }

    /// Restarts the engine with an empty prefix cache: running requests lose their KV and go back
    /// to the head of the queue (recomputed from scratch), every cached block is forgotten
    /// (reported as AllBlocksCleared).
    pub fn reset_cache(&mut self, reqs: &[SimRequest]) {
        let preempted = self.preemptions;
        while self.preempt_last(reqs).is_some() {}
        self.preemptions = preempted;
        self.kv.clear();
        self.stored.clear();
        self.removed.clear();
        self.cleared = true;
    }

    /// Current stats, as the agent would report them.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            waiting: u32::try_from(self.waiting.len()).unwrap_or(u32::MAX),
            running: u32::try_from(self.running.len()).unwrap_or(u32::MAX),
            kv_usage: self.kv.in_use() as f64 / self.kv.capacity().max(1) as f64,
            gpu_utilization: (self.running.len() as f64 / self.cost.max_batch as f64).min(1.0),
            adapters: self.adapters.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(base: u64, n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(base * 100_000 + i)).collect()
    }

    fn req(id: usize, base: u64, prompt_tokens: u32, output_tokens: u32) -> SimRequest {
        SimRequest {
            id,
            arrival_us: 0,
            prompt_tokens,
            output_tokens,
            adapter: None,
            session: None,
            group: None,
            stage: 0,
            direct: false,
            blocks: chain(base, u64::from(prompt_tokens) / 16),
            text_blocks: Vec::new(),
        }
    }

    /// Runs the pod until idle; returns (step durations µs, results in order).
    fn drain(pod: &mut PodEngine, reqs: &[SimRequest]) -> (Vec<u64>, Vec<StepResult>) {
        let (mut steps, mut results) = (Vec::new(), Vec::new());
        while let Some(us) = pod.schedule(reqs).unwrap() {
            steps.push(us);
            results.push(pod.complete(reqs));
            assert!(steps.len() < 100_000, "runaway");
        }
        (steps, results)
    }

    #[test]
    fn a_cold_prompt_prefills_in_chunks_then_a_repeat_hits() {
        let cost = CostModel::llama_8b();
        let reqs = vec![req(0, 1, 4096, 2), req(1, 1, 4096, 2)];
        let mut pod = PodEngine::new(&cost);
        pod.enqueue(0);
        let (steps, results) = drain(&mut pod, &reqs);
        // 4096 tokens in two 2048-token chunks, then one decode step.
        assert_eq!(steps.len(), 3);
        let chunk_us = ((0.013 + 2048.0 * 0.9 / 4096.0) * 1e6_f64).round() as u64;
        assert_eq!(steps[0], chunk_us);
        assert_eq!(results[1].first_token, vec![0]);
        assert_eq!(results[2].finished, vec![0]);
        assert_eq!(pod.stored.len(), 256, "every full prompt block cached");
        assert_eq!(pod.kv.in_use(), 0, "nothing held once finished");
        pod.enqueue(1);
        let (steps, results) = drain(&mut pod, &reqs);
        assert_eq!(results[0].admitted, vec![(1, 255)], "the last block is recomputed, as vLLM does");
        assert_eq!(steps[0], ((0.013 + 16.0 * 0.9 / 4096.0) * 1e6_f64).round() as u64);
    }

    #[test]
    fn decode_slows_with_batch_size() {
        let cost = CostModel::llama_8b();
        let reqs: Vec<SimRequest> = (0..64).map(|i| req(i, i as u64 + 10, 32, 50)).collect();
        let mut pod = PodEngine::new(&cost);
        for r in &reqs {
            pod.enqueue(r.id);
        }
        let (steps, _) = drain(&mut pod, &reqs);
        // After the shared prefill step, 64 requests decode together.
        let batch_step = ((0.013 + 64.0 * 0.0002) * 1e6_f64).round() as u64;
        assert_eq!(steps[1], batch_step);
        let single = ((0.013 + 0.0002) * 1e6_f64).round() as u64;
        assert!(steps[1] > single);
    }

    /// KV held by running requests: a shared prefix counts once, and when running requests need
    /// more blocks than the pod has, the newest is preempted and recomputed later.
    #[test]
    fn running_requests_hold_kv_and_pressure_preempts() {
        let mut cost = CostModel::llama_8b();
        cost.kv_capacity_blocks = 40; // 640 tokens
        // Two requests share a 256-token prefix (16 blocks) then diverge; both decode 200 tokens.
        let mut a = req(0, 7, 256, 200);
        let mut b = req(1, 7, 256, 200);
        a.prompt_tokens = 272;
        a.blocks.push(BlockHash(1));
        b.prompt_tokens = 272;
        b.blocks.push(BlockHash(2));
        let reqs = vec![a, b];
        let mut pod = PodEngine::new(&cost);
        pod.enqueue(0);
        pod.enqueue(1);
        let step = pod.schedule(&reqs).unwrap();
        assert!(step.is_some());
        // Both admitted cold in one step (the prefix was not cached yet): 2 × 17 blocks.
        assert_eq!(pod.kv.in_use(), 34);
        pod.complete(&reqs);
        // Shared blocks are one cache entry each, referenced twice.
        assert_eq!(pod.kv.cached(), 17 + 1, "16 shared + two 17th blocks, one of them a duplicate freed");
        assert_eq!(pod.kv.in_use(), 18);
        let (_, results) = drain(&mut pod, &reqs);
        assert!(pod.preemptions >= 1, "200 decoded tokens each do not fit 40 blocks together");
        let finished: Vec<usize> = results.iter().flat_map(|r| r.finished.clone()).collect();
        assert_eq!(finished.len(), 2, "both finish eventually");
        assert_eq!(pod.kv.in_use(), 0);
    }

    #[test]
    fn stats_use_vllms_kv_usage() {
        let mut cost = CostModel::llama_8b();
        cost.kv_capacity_blocks = 100;
        let reqs = vec![req(0, 3, 320, 5)];
        let mut pod = PodEngine::new(&cost);
        pod.enqueue(0);
        pod.schedule(&reqs).unwrap();
        pod.complete(&reqs);
        // 20 prompt blocks cached and referenced, + 1 block for the first decoded token.
        pod.schedule(&reqs).unwrap();
        assert!((pod.stats().kv_usage - 0.21).abs() < 1e-9, "{:?}", pod.stats());
        let _ = drain(&mut pod, &reqs);
        assert_eq!(pod.stats().kv_usage, 0.0, "free cached blocks do not count");
        assert_eq!(pod.kv.cached(), 20);
        pod.reset_cache(&reqs);
        assert_eq!(pod.kv.cached(), 0);
        assert!(pod.cleared);
    }
}
