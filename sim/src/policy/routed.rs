//! GIE's approximate-prefix policy on the picker's own approximate store.
//!
//! GIE's estimated prefix cache is a per-pod LRU of the text chunks the router itself sent there,
//! with an assumed capacity: it learns at routing time (before the engine even prefills) and never
//! hears about real evictions. The store is kvroute's shipped [`ApproxStore`] (approximate mode,
//! docs/design.md §6), which implements exactly that bound and match, fed with each request's text
//! chain (64-character chunks, at most 256: GIE's defaults).

use kvroute_picker::approx::{ApproxConfig, ApproxStore, DEFAULT_BLOCK_CHARS, DEFAULT_MAX_BLOCKS};
use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{PodReport, Policy, pod_names};
use crate::SimError;
use crate::workload::SimRequest;

/// Weights of GIE's scheduling profile as used by llm-d's inference-scheduling guide:
/// prefix-cache-scorer 3, queue-scorer 2, kv-cache-utilization-scorer 2.
const W_PREFIX: f64 = 3.0;
const W_QUEUE: f64 = 2.0;
const W_KV: f64 = 2.0;

/// A store of GIE's shape holding `capacity_blocks` chunks per pod, `max_blocks` chunks per request.
pub(crate) fn approx_store(capacity_blocks: usize, max_blocks: usize) -> ApproxStore {
    ApproxStore::new(&ApproxConfig {
        block_chars: DEFAULT_BLOCK_CHARS,
        capacity_blocks_per_pod: capacity_blocks,
        max_blocks,
    })
}

/// GIE approximate prefix routing: estimated prefix match of the text chain + queue (min-max
/// normalised waiting requests from the last scrape) + KV-cache utilisation, max score, random
/// tie-break.
#[derive(Debug)]
pub struct GieApproximate {
    store: ApproxStore,
    names: Vec<String>,
    waiting: Vec<u32>,
    kv_usage: Vec<f64>,
    rng: StdRng,
}

impl GieApproximate {
    /// For `pods` pods, each assumed to hold `capacity_blocks` text chunks.
    pub fn new(pods: usize, capacity_blocks: usize, seed: u64) -> Self {
        GieApproximate {
            store: approx_store(capacity_blocks, DEFAULT_MAX_BLOCKS),
            names: pod_names(pods),
            waiting: vec![0; pods.max(1)],
            kv_usage: vec![0.0; pods.max(1)],
            rng: StdRng::seed_from_u64(0x61E ^ seed),
        }
    }
}

impl Policy for GieApproximate {
    fn name(&self) -> &str {
        "approximate-prefix"
    }

    fn pick(&mut self, req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let matches = self.store.match_chain(&req.text_blocks);
        let total = req.text_blocks.len().max(1) as f64;
        let (qmin, qmax) =
            (self.waiting.iter().copied().min().unwrap_or(0), self.waiting.iter().copied().max().unwrap_or(0));
        let mut best = (f64::MIN, 0u64, 0usize);
        for (p, name) in self.names.iter().enumerate() {
            let m = f64::from(matches.matched(name));
            let queue = if qmax == qmin { 1.0 } else { f64::from(qmax - self.waiting[p]) / f64::from(qmax - qmin) };
            let s = W_PREFIX * (m / total) + W_QUEUE * queue + W_KV * (1.0 - self.kv_usage[p]);
            let tie: u64 = self.rng.random();
            if s > best.0 + 1e-9 || ((s - best.0).abs() <= 1e-9 && tie < best.1) {
                best = (s, tie, p);
            }
        }
        self.store.record(&self.names[best.2], &req.text_blocks);
        Ok(best.2)
    }

    fn on_report(&mut self, report: &PodReport) {
        if let Some(s) = &report.stats
            && report.pod < self.waiting.len()
        {
            self.waiting[report.pod] = s.waiting;
            self.kv_usage[report.pod] = s.kv_usage;
        }
    }

    fn on_finish(&mut self, _req: &SimRequest, _pod: usize, _now_us: u64) {}
}
