//! SGLang model gateway's cache-aware policy: an approximate radix tree per worker of what it
//! routed there; when load is balanced, the worker with the longest match if the match rate beats
//! `cache_threshold`, else the worker with the smallest tree; when load is imbalanced
//! (max − min > `balance_abs_threshold` and max > min × `balance_rel_threshold`), the least
//! loaded worker. Load = requests the router has in flight on the worker.
//!
//! Thresholds: 0.3 / 64 / 1.5, sgl-router's `RouterArgs` defaults as we know them (not verified
//! against a copy of the source here). The tree is the picker's [`ApproxStore`] over the token
//! chain (SGLang's tree is over characters with no 256-chunk cap; the token chain stands for it).

use kvroute_picker::approx::ApproxStore;

use super::routed::approx_store;
use super::{PodReport, Policy, pod_names};
use crate::SimError;
use crate::workload::SimRequest;

/// SGLang-style cache-aware routing with balance thresholds.
#[derive(Debug)]
pub struct SglangCacheAware {
    store: ApproxStore,
    names: Vec<String>,
    open: Vec<u32>,
    cache_threshold: f64,
    balance_abs: u32,
    balance_rel: f64,
}

impl SglangCacheAware {
    /// For `pods` workers whose trees hold at most `capacity_blocks` blocks each.
    pub fn new(pods: usize, capacity_blocks: usize) -> Self {
        SglangCacheAware {
            store: approx_store(capacity_blocks, usize::MAX),
            names: pod_names(pods),
            open: vec![0; pods.max(1)],
            cache_threshold: 0.3,
            balance_abs: 64,
            balance_rel: 1.5,
        }
    }

    fn least_loaded(&self) -> usize {
        (0..self.open.len()).min_by_key(|p| self.open[*p]).unwrap_or(0)
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &str {
        "sglang-cache-aware"
    }

    fn pick(&mut self, req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let max = self.open.iter().copied().max().unwrap_or(0);
        let min = self.open.iter().copied().min().unwrap_or(0);
        let imbalanced = max - min > self.balance_abs && f64::from(max) > f64::from(min) * self.balance_rel;
        let pod = if imbalanced {
            self.least_loaded()
        } else {
            let matches = self.store.match_chain(&req.blocks);
            let (best, hit) = self
                .names
                .iter()
                .enumerate()
                .map(|(p, n)| (p, matches.matched(n)))
                .max_by_key(|(p, m)| (*m, std::cmp::Reverse(*p)))
                .unwrap_or((0, 0));
            let rate = f64::from(hit) / req.blocks.len().max(1) as f64;
            if rate > self.cache_threshold {
                best
            } else {
                (0..self.open.len())
                    .min_by_key(|p| (self.store.pod_blocks(&self.names[*p]), self.open[*p]))
                    .unwrap_or(0)
            }
        };
        self.store.record(&self.names[pod], &req.blocks);
        self.open[pod] += 1;
        Ok(pod)
    }

    fn on_report(&mut self, _report: &PodReport) {}

    fn on_finish(&mut self, _req: &SimRequest, pod: usize, _now_us: u64) {
        if let Some(c) = self.open.get_mut(pod) {
            *c = c.saturating_sub(1);
        }
    }
}
