//! NVIDIA Dynamo KV router's cost function: for each worker,
//! `logit = overlap_score_weight × prefill_blocks + decode_blocks`, lowest wins (temperature 0,
//! seeded random tie-break). `prefill_blocks` = the request's blocks the worker does not hold
//! (from KV events, after the report delay); `decode_blocks` = distinct blocks of the sequences the
//! router has active on the worker (shared prefixes counted once, as Dynamo's `ActiveSequences`
//! does) plus this request's new ones. `overlap_score_weight` = 1.0 (Dynamo's default).

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{PodReport, Policy};
use crate::SimError;
use crate::workload::SimRequest;

/// Dynamo-style cost routing.
#[derive(Debug)]
pub struct DynamoCost {
    held: Vec<HashSet<u64>>,
    /// Per worker: block → active sequences using it.
    active: Vec<HashMap<u64, u32>>,
    routed: HashMap<usize, Vec<u64>>,
    overlap_weight: f64,
    rng: StdRng,
}

impl DynamoCost {
    /// For `pods` workers.
    pub fn new(pods: usize, seed: u64) -> Self {
        DynamoCost {
            held: vec![HashSet::new(); pods.max(1)],
            active: vec![HashMap::new(); pods.max(1)],
            routed: HashMap::new(),
            overlap_weight: 1.0,
            rng: StdRng::seed_from_u64(seed ^ 0xD1A),
        }
    }
}

impl Policy for DynamoCost {
    fn name(&self) -> &str {
        "dynamo-cost"
    }

    fn pick(&mut self, req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let n = req.blocks.len() as u64;
        let mut best = (f64::MAX, 0u64, 0usize);
        for (p, held) in self.held.iter().enumerate() {
            let overlap = req.blocks.iter().take_while(|b| held.contains(&b.0)).count() as u64;
            let active = &self.active[p];
            let new_active = req.blocks.iter().filter(|b| !active.contains_key(&b.0)).count() as u64;
            let logit = self.overlap_weight * (n - overlap) as f64 + (active.len() as u64 + new_active) as f64;
            let tie: u64 = self.rng.random();
            if logit < best.0 - 1e-9 || ((logit - best.0).abs() <= 1e-9 && tie < best.1) {
                best = (logit, tie, p);
            }
        }
        let blocks: Vec<u64> = req.blocks.iter().map(|b| b.0).collect();
        if let Some(active) = self.active.get_mut(best.2) {
            for b in &blocks {
                *active.entry(*b).or_insert(0) += 1;
            }
        }
        self.routed.insert(req.id, blocks);
        Ok(best.2)
    }

    fn on_report(&mut self, report: &PodReport) {
        if let Some(set) = self.held.get_mut(report.pod) {
            if report.cleared {
                set.clear();
            }
            set.extend(report.stored.iter().map(|b| b.0));
            for b in &report.removed {
                set.remove(&b.0);
            }
        }
    }

    fn on_finish(&mut self, req: &SimRequest, pod: usize, _now_us: u64) {
        let blocks = self.routed.remove(&req.id).unwrap_or_default();
        if let Some(active) = self.active.get_mut(pod) {
            for b in blocks {
                if let Some(c) = active.get_mut(&b) {
                    *c -= 1;
                    if *c == 0 {
                        active.remove(&b);
                    }
                }
            }
        }
    }
}
