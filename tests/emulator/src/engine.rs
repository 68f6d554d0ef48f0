//! The emulated engine: admission (bounded running batch + FIFO-ish wait queue), the timing model
//! and the KV blocks of each request.
//!
//! Timing (every duration × `time_scale`): prefill sleeps `uncached_tokens × prefill_us_per_token`
//! and yields the first token; with `max_num_partial_prefills` = N > 0 at most N requests prefill
//! at once and the others wait (FIFO) before their cache lookup, so a prefill queued behind another
//! of the same prefix finds its blocks, as vLLM's scheduler does; each further token takes
//! `decode_ms_per_token`.
//!
//! Blocks follow vLLM's scheduler and block pool ([`BlockPool`], `vllm/v1/core/kv_cache_manager.py`):
//! when a request is scheduled, its hit is the longest run of cached leading full blocks, capped
//! so that the last prompt token is never counted (hit tokens ≤ prompt_len − 1, whole blocks); it
//! takes a reference on those, takes new blocks for the rest of the prompt (evicting LRU cached
//! blocks when no empty one is left) and caches the prompt's full blocks, all before its prefill
//! runs. Each decode step takes a block when the token it computes starts one and caches a block
//! when it fills one; the last generated token is never computed, so a request holds
//! `ceil((prompt + output − 1) / block_size)` blocks at most. At the end every block is released,
//! last first. Block identity includes the request's extra keys ([`BlockKeys`]: adapter, images,
//! `cache_salt`), so a salted prompt never hits an unsalted (or differently salted) cache.
//!
//! KV usage (`vllm:kv_cache_usage_perc`) is the pool's: blocks held by running requests, a shared
//! one once, over `num_gpu_blocks − 1` (vLLM's null block is never usable). Cached blocks no
//! request holds are free (evictable) and not counted. Not modelled: vLLM admits a request only
//! when its blocks are free and preempts under pressure; the emulator runs it anyway (see
//! [`BlockPool`]).
//!
//! Concurrency: each request runs in its own tokio task, which owns the request's lifecycle and
//! streams [`GenerationEvent`]s to the HTTP side through a bounded channel; a closed channel means
//! the client left, and the task aborts (releasing its blocks). The pool is one `parking_lot`
//! mutex, never held across an `.await`. Admission is a tokio semaphore of `max_num_partial_prefills`
//! permits (when limited), then one of `max_num_seqs` permits; a request holds the prefill permit
//! until its prefill is done. Every running-slot holder is past its prefill, so the prefill holder
//! waiting for a running slot always gets one once a decode finishes: no deadlock.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Semaphore, SemaphorePermit, mpsc};
use tokio::time::Instant;

use crate::block_pool::{BlockContent, BlockId, BlockPool};
use crate::cache::{BlockKeys, EngineHasher};
use crate::faults::FaultState;
use crate::kv_events::{KvEvent, KvEventSink};
use crate::metrics::{FinishReason, Metrics};

/// Timing and capacity of the emulated engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per block.
    pub block_size: u32,
    /// KV blocks, vLLM's `num_gpu_blocks` (one of them is the null block).
    pub num_gpu_blocks: u32,
    /// Maximum running requests.
    pub max_num_seqs: u32,
    /// Prefills running at once; 0 = no limit.
    pub max_num_partial_prefills: u32,
    /// Prefill time per uncached token, µs.
    pub prefill_us_per_token: f64,
    /// Decode time per token, ms.
    pub decode_ms_per_token: f64,
    /// Multiplier of every simulated duration.
    pub time_scale: f64,
    /// Engine-hash root seed.
    pub hash_seed: u64,
}

/// A request as the engine sees it.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate (≥ 1); EOS is never produced, so always exactly this many.
    pub max_tokens: u32,
    /// LoRA adapter (id, name), if any.
    pub lora: Option<(u32, String)>,
    /// Multimodal placeholders and `cache_salt` (the adapter name is taken from `lora`).
    pub keys: BlockKeys,
}

/// What a running request reports to its HTTP handler, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// One generated token: its id and text; `index` counts from 0.
    Token {
        /// 0-based position in the output.
        index: u32,
        /// Token id.
        id: u32,
        /// Token text.
        text: String,
    },
    /// The request finished after the last token.
    Finished {
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: u32,
        /// Prompt tokens this request wrote to the prefix cache: its full prompt blocks that were
        /// not hits (vLLM's `num_cache_creation_tokens`).
        created_cache_tokens: u32,
        /// Generated tokens.
        completion_tokens: u32,
        /// Why it finished.
        reason: FinishReason,
    },
}

/// The shared engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    hasher: EngineHasher,
    cache: Mutex<BlockPool>,
    slots: Semaphore,
    /// `None` when prefills are not limited.
    prefill_slots: Option<Semaphore>,
    metrics: Arc<Metrics>,
    faults: Arc<FaultState>,
    events: KvEventSink,
    filler: Vec<(u32, String)>,
}

/// The client left before the request finished.
struct Aborted;

/// What the pool needs to cache a request's blocks: the chain over `tokens`' full blocks.
fn content<'a>(
    request: &'a GenerationRequest,
    keys: &'a BlockKeys,
    chain: &'a [u64],
    tokens: &'a [u32],
    block_size: usize,
) -> BlockContent<'a> {
    BlockContent { chain, tokens, block_size, lora: request.lora.as_ref(), keys }
}

/// The blocks a request holds; released exactly once.
#[derive(Default)]
struct Held {
    /// Its blocks in token order: block `i` holds tokens `i*bs..(i+1)*bs`.
    blocks: Vec<BlockId>,
    /// Leading blocks of `blocks` that are cached (hits, or filled and cached since).
    cached: usize,
    /// Blocks it needed when the pool had none free (counted in use, never cached).
    missing: u64,
}

impl Engine {
    /// An engine publishing to `events`; `filler` is the cycle of (token id, text) it generates.
    pub fn new(
        config: EngineConfig,
        metrics: Arc<Metrics>,
        faults: Arc<FaultState>,
        events: KvEventSink,
        filler: Vec<(u32, String)>,
    ) -> Self {
        let filler = if filler.is_empty() { vec![(1000, " the".to_string())] } else { filler };
        Self {
            hasher: EngineHasher::new(config.hash_seed, config.block_size),
            cache: Mutex::new(BlockPool::new(config.num_gpu_blocks as usize)),
            slots: Semaphore::new(config.max_num_seqs as usize),
            prefill_slots: (config.max_num_partial_prefills > 0)
                .then(|| Semaphore::new(config.max_num_partial_prefills as usize)),
            config,
            metrics,
            faults,
            events,
            filler,
        }
    }

    /// Starts a request; its events arrive on the returned channel. Dropping the receiver aborts it.
    pub fn submit(self: &Arc<Self>, request: GenerationRequest) -> mpsc::Receiver<GenerationEvent> {
        let (tx, rx) = mpsc::channel(64);
        let engine = self.clone();
        tokio::spawn(async move { engine.run(request, tx).await });
        rx
    }

    /// Clears the prefix cache and publishes AllBlocksCleared.
    pub fn reset_prefix_cache(&self) {
        {
            let mut pool = self.cache.lock();
            pool.clear();
            self.metrics.blocks_in_use.store(pool.in_use(), Ordering::Relaxed);
        }
        self.events.send([KvEvent::AllBlocksCleared]);
        tracing::info!("prefix cache reset");
    }

    /// Number of distinct block hashes cached now.
    pub fn cached_blocks(&self) -> usize {
        self.cache.lock().len()
    }

    /// Blocks in use now (the numerator of `vllm:kv_cache_usage_perc`).
    pub fn blocks_in_use(&self) -> u64 {
        self.cache.lock().in_use()
    }

    fn scaled(&self, seconds: f64) -> Duration {
        Duration::from_secs_f64((seconds * self.config.time_scale).max(0.0))
    }

    async fn run(self: Arc<Self>, request: GenerationRequest, tx: mpsc::Sender<GenerationEvent>) {
        let arrived = Instant::now();
        let adapter = request.lora.as_ref().map(|(_, name)| name.clone());
        self.metrics.waiting.fetch_add(1, Ordering::Relaxed);
        if let Some(name) = &adapter {
            self.metrics.lora_request(name, 1, 0);
        }
        let permits = tokio::select! {
            permits = self.admit() => permits,
            _ = tx.closed() => None,
        };
        self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
        if let Some(name) = &adapter {
            self.metrics.lora_request(name, -1, 0);
        }
        let Some((_permit, prefill_permit)) = permits else {
            self.metrics.record_finished(FinishReason::Abort);
            return;
        };
        self.metrics.running.fetch_add(1, Ordering::Relaxed);
        if let Some(name) = &adapter {
            self.metrics.lora_request(name, 0, 1);
        }
        let mut held = Held::default();
        let reason = match self.generate(&request, &tx, arrived, &mut held, prefill_permit).await {
            Ok(()) => FinishReason::Length,
            Err(Aborted) => FinishReason::Abort,
        };
        {
            let mut pool = self.cache.lock();
            pool.free(&held.blocks, held.missing);
            self.metrics.blocks_in_use.store(pool.in_use(), Ordering::Relaxed);
        }
        self.metrics.running.fetch_sub(1, Ordering::Relaxed);
        if let Some(name) = &adapter {
            self.metrics.lora_request(name, 0, -1);
        }
        self.metrics.record_finished(reason);
    }

    /// Waits for a prefill slot (when limited), then a running slot, honouring the `stuck` and
    /// `extra_latency_ms` faults. Returns (running permit, prefill permit).
    async fn admit(&self) -> Option<(SemaphorePermit<'_>, Option<SemaphorePermit<'_>>)> {
        while self.faults.get().stuck {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let extra = self.faults.get().extra_latency_ms;
        if extra > 0 {
            tokio::time::sleep(Duration::from_millis(extra)).await;
        }
        let prefill = match &self.prefill_slots {
            Some(slots) => Some(slots.acquire().await.ok()?),
            None => None,
        };
        Some((self.slots.acquire().await.ok()?, prefill))
    }

    async fn generate(
        &self,
        request: &GenerationRequest,
        tx: &mpsc::Sender<GenerationEvent>,
        arrived: Instant,
        held: &mut Held,
        prefill_permit: Option<SemaphorePermit<'_>>,
    ) -> Result<(), Aborted> {
        let bs = self.config.block_size as usize;
        let prompt_len = request.prompt.len();
        let mut keys = request.keys.clone();
        keys.lora = request.lora.as_ref().map(|(_, name)| name.clone());
        let chain = self.hasher.chain(&request.prompt, &keys);
        let max_hit_blocks = prompt_len.saturating_sub(1) / bs;
        // Scheduled: hits, blocks for the whole prompt, its full blocks cached (vLLM's
        // `allocate_slots`, before the prefill runs).
        let hit_blocks = {
            let mut pool = self.cache.lock();
            let hit = pool.match_prefix(&chain).min(max_hit_blocks);
            held.blocks = pool.touch(&chain[..hit]);
            held.cached = hit;
            self.grow(&mut pool, held, content(request, &keys, &chain, &request.prompt, bs));
            hit
        };
        let cached_tokens = hit_blocks * bs;
        let created_cache_tokens = (held.cached * bs).min(prompt_len).saturating_sub(cached_tokens);
        self.metrics.record_prefix_lookup(prompt_len as u64, cached_tokens as u64);

        let uncached = (prompt_len - cached_tokens) as f64;
        self.sleep_or_abort(self.scaled(uncached * self.config.prefill_us_per_token / 1e6), tx).await?;
        drop(prefill_permit);
        self.metrics.observe_ttft(arrived.elapsed().as_secs_f64());

        let mut all_tokens = request.prompt.clone();
        for index in 0..request.max_tokens {
            if index > 0 {
                // This decode step computes the previous token's KV: it may start or fill a block.
                let longer;
                let chain = if all_tokens.len().is_multiple_of(bs) {
                    longer = self.hasher.chain(&all_tokens, &keys);
                    &longer
                } else {
                    &chain
                };
                self.grow(&mut self.cache.lock(), held, content(request, &keys, chain, &all_tokens, bs));
                self.sleep_or_abort(self.scaled(self.config.decode_ms_per_token / 1e3), tx).await?;
            }
            let (id, text) = self.filler[index as usize % self.filler.len()].clone();
            all_tokens.push(id);
            self.metrics.record_generated_token();
            tx.send(GenerationEvent::Token { index, id, text }).await.map_err(|_| Aborted)?;
        }

        let finished = GenerationEvent::Finished {
            prompt_tokens: prompt_len as u32,
            cached_tokens: cached_tokens as u32,
            created_cache_tokens: created_cache_tokens as u32,
            completion_tokens: request.max_tokens,
            reason: FinishReason::Length,
        };
        tx.send(finished).await.map_err(|_| Aborted)
    }

    /// Makes the request hold blocks for the tokens of `content` (those whose KV is computed) and
    /// caches the full ones, publishing the evictions and stores in order (under the pool's lock,
    /// so events of concurrent requests keep the pool's order) and the usage gauge.
    fn grow(&self, pool: &mut BlockPool, held: &mut Held, content: BlockContent<'_>) {
        let bs = content.block_size;
        let need = content.tokens.len().div_ceil(bs);
        let have = held.blocks.len() + held.missing as usize;
        let mut events = Vec::new();
        if need > have {
            if held.missing > 0 {
                // Out of blocks once: the rest of the request stays over capacity, in order.
                pool.add_missing((need - have) as u64);
                held.missing += (need - have) as u64;
            } else {
                let got = pool.allocate(need - have, &mut events);
                held.missing += (need - have - got.len()) as u64;
                held.blocks.extend(got);
            }
        }
        let full = (content.tokens.len() / bs).min(held.blocks.len());
        if full > held.cached {
            pool.cache(&held.blocks, held.cached, full, content, &mut events);
            held.cached = full;
        }
        self.events.send(events);
        self.metrics.blocks_in_use.store(pool.in_use(), Ordering::Relaxed);
    }

    async fn sleep_or_abort(&self, duration: Duration, tx: &mpsc::Sender<GenerationEvent>) -> Result<(), Aborted> {
        if duration.is_zero() {
            return if tx.is_closed() { Err(Aborted) } else { Ok(()) };
        }
        tokio::select! {
            _ = tokio::time::sleep(duration) => Ok(()),
            _ = tx.closed() => Err(Aborted),
        }
    }
}
