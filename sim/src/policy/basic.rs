//! Cache-blind baselines (docs/design.md §16): random, round robin, least connections.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{PodReport, Policy};
use crate::SimError;
use crate::workload::SimRequest;

/// Uniform random pod (seeded).
#[derive(Debug)]
pub struct Random {
    pods: usize,
    rng: StdRng,
}

impl Random {
    /// Random over `pods` pods.
    pub fn new(pods: usize, seed: u64) -> Self {
        Random { pods: pods.max(1), rng: StdRng::seed_from_u64(seed ^ 0x5EED) }
    }
}

impl Policy for Random {
    fn name(&self) -> &str {
        "random"
    }
    fn pick(&mut self, _req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        Ok(self.rng.random_range(0..self.pods))
    }
    fn on_report(&mut self, _report: &PodReport) {}
    fn on_finish(&mut self, _req: &SimRequest, _pod: usize, _now_us: u64) {}
}

/// Pods in turn.
#[derive(Debug)]
pub struct RoundRobin {
    pods: usize,
    next: usize,
}

impl RoundRobin {
    /// Round robin over `pods` pods.
    pub fn new(pods: usize) -> Self {
        RoundRobin { pods: pods.max(1), next: 0 }
    }
}

impl Policy for RoundRobin {
    fn name(&self) -> &str {
        "round-robin"
    }
    fn pick(&mut self, _req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let p = self.next;
        self.next = (self.next + 1) % self.pods;
        Ok(p)
    }
    fn on_report(&mut self, _report: &PodReport) {}
    fn on_finish(&mut self, _req: &SimRequest, _pod: usize, _now_us: u64) {}
}

/// Fewest requests the router has in flight on the pod (ties: lowest index after the last pick,
/// so equal pods are taken in turn).
#[derive(Debug)]
pub struct LeastConnections {
    open: Vec<u32>,
    last: usize,
}

impl LeastConnections {
    /// Least connections over `pods` pods.
    pub fn new(pods: usize) -> Self {
        LeastConnections { open: vec![0; pods.max(1)], last: 0 }
    }
}

impl Policy for LeastConnections {
    fn name(&self) -> &str {
        "least-connections"
    }
    fn pick(&mut self, _req: &SimRequest, _now_us: u64) -> Result<usize, SimError> {
        let n = self.open.len();
        let p = (1..=n).map(|k| (self.last + k) % n).min_by_key(|p| self.open[*p]).unwrap_or(0);
        self.open[p] += 1;
        self.last = p;
        Ok(p)
    }
    fn on_report(&mut self, _report: &PodReport) {}
    fn on_finish(&mut self, _req: &SimRequest, pod: usize, _now_us: u64) {
        if let Some(c) = self.open.get_mut(pod) {
            *c = c.saturating_sub(1);
        }
    }
}
