//! "Where did I send this prefix?" memories (GIE's estimated prefix cache, SGLang's approximate
//! radix tree) and GIE's approximate-prefix policy.
//!
//! The estimated cache is a per-pod LRU of the blocks the router itself sent there, with an
//! assumed capacity: it learns at routing time (before the engine even prefills) and never hears
//! about real evictions.

use rand::Rng;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::{PodReport, Policy};
use crate::SimError;
use crate::engine::BlockLru;
use crate::workload::SimRequest;

/// Per-pod LRU of routed blocks.
#[derive(Debug)]
pub(crate) struct RoutedMemory {
    pub(crate) pods: Vec<BlockLru>,
    stored: Vec<kvroute_common::BlockHash>,
    evicted: Vec<kvroute_common::BlockHash>,
}

impl RoutedMemory {
    pub(crate) fn new(pods: usize, capacity_blocks: usize) -> Self {
        RoutedMemory {
            pods: (0..pods.max(1)).map(|_| BlockLru::new(capacity_blocks)).collect(),
            stored: Vec::new(),
            evicted: Vec::new(),
        }
    }

    /// Per pod, consecutive blocks of `chain` it is believed to hold.
    pub(crate) fn matches(&self, chain: &[kvroute_common::BlockHash]) -> Vec<usize> {
        self.pods.iter().map(|p| p.prefix_hit(chain)).collect()
    }

    /// Remembers that `chain` was sent to `pod`; returns (newly stored, evicted) blocks.
    pub(crate) fn record(
        &mut self,
        pod: usize,
        chain: &[kvroute_common::BlockHash],
    ) -> (&[kvroute_common::BlockHash], &[kvroute_common::BlockHash]) {
        self.stored.clear();
        self.evicted.clear();
        if let Some(p) = self.pods.get_mut(pod) {
            p.touch(chain, &mut self.stored, &mut self.evicted);
        }
        (&self.stored, &self.evicted)
    }
}

/// Weights of GIE's scheduling profile as used by llm-d's inference-scheduling guide:
/// prefix-cache-scorer 3, queue-scorer 2, kv-cache-utilization-scorer 2.
const W_PREFIX: f64 = 3.0;
const W_QUEUE: f64 = 2.0;
const W_KV: f64 = 2.0;

/// GIE approximate prefix routing: estimated prefix match + queue (min-max normalised waiting
/// requests from the last scrape) + KV-cache utilisation, max score, random tie-break.
#[derive(Debug)]
pub struct GieApproximate {
    memory: RoutedMemory,
    waiting: Vec<u32>,
    kv_usage: Vec<f64>,
    rng: StdRng,
}

impl GieApproximate {
    /// For `pods` pods, each assumed to hold `capacity_blocks` blocks.
    pub fn new(pods: usize, capacity_blocks: usize) -> Self {
        GieApproximate {
            memory: RoutedMemory::new(pods, capacity_blocks),
            waiting: vec![0; pods.max(1)],
            kv_usage: vec![0.0; pods.max(1)],
            rng: StdRng::seed_from_u64(0x61E),
        }
    }
}

impl Policy for GieApproximate {
    fn name(&self) -> &str {
        "approximate-prefix"
    }

    fn pick(&mut self, req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let matches = self.memory.matches(&req.blocks);
        let total = req.blocks.len().max(1) as f64;
        let (qmin, qmax) =
            (self.waiting.iter().copied().min().unwrap_or(0), self.waiting.iter().copied().max().unwrap_or(0));
        let mut best = (f64::MIN, 0u64, 0usize);
        for (p, m) in matches.iter().enumerate() {
            let queue = if qmax == qmin { 1.0 } else { f64::from(qmax - self.waiting[p]) / f64::from(qmax - qmin) };
            let s = W_PREFIX * (*m as f64 / total) + W_QUEUE * queue + W_KV * (1.0 - self.kv_usage[p]);
            let tie: u64 = self.rng.random();
            if s > best.0 + 1e-9 || ((s - best.0).abs() <= 1e-9 && tie < best.1) {
                best = (s, tie, p);
            }
        }
        self.memory.record(best.2, &req.blocks);
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

    fn on_finish(&mut self, _req: &SimRequest, _pod: usize) {}
}
