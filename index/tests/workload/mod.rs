//! The benchmark/measurement workload shared by `benches/index.rs` and `tests/alloc.rs`
//! (docs/design.md §3, §10 shape): chains of 256 random blocks (a 4096-token prompt at block size 16), each
//! chain on 1–3 of 64 pods, so ~1M (block, pod) entries ≈ 2,040 chains ≈ 520k distinct blocks.

#![allow(dead_code)]

use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;
use kvroute_index::{Backend, PodIdx, Writer};

/// Pods in the fleet.
pub const PODS: u16 = 64;
/// Blocks per chain (4096 tokens / 16).
pub const CHAIN_BLOCKS: usize = 256;

/// SplitMix64: seeded, deterministic block hashes.
pub struct SplitMix(pub u64);

impl SplitMix {
    /// Next pseudo-random value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A chain of `n` fresh random blocks.
    pub fn chain(&mut self, n: usize) -> Vec<BlockHash> {
        (0..n).map(|_| BlockHash(self.next_u64())).collect()
    }
}

/// Chains and, per chain, the pods that hold all of it.
pub struct Workload {
    pub chains: Vec<Vec<BlockHash>>,
    pub placement: Vec<Vec<PodIdx>>,
}

impl Workload {
    /// About `entries` (block, pod) pairs: chain i is on `1 + i % 3` pods.
    pub fn new(entries: usize, seed: u64) -> Workload {
        let mut rng = SplitMix(seed);
        let n = entries / (CHAIN_BLOCKS * 2);
        let chains = (0..n).map(|_| rng.chain(CHAIN_BLOCKS)).collect();
        let placement = (0..n)
            .map(|i| (0..1 + i % 3).map(|j| PodIdx(((i * 7 + j * 23) % usize::from(PODS)) as u16)).collect())
            .collect();
        Workload { chains, placement }
    }

    /// (block, pod) pairs the workload stores.
    pub fn entries(&self) -> usize {
        self.placement.iter().map(|p| p.len() * CHAIN_BLOCKS).sum()
    }

    /// Every (pod, chain) store, in order.
    pub fn stores(&self) -> impl Iterator<Item = (PodIdx, &[BlockHash])> {
        self.chains.iter().zip(&self.placement).flat_map(|(c, ps)| ps.iter().map(move |p| (*p, c.as_slice())))
    }

    /// Full hit: a chain held whole by 3 pods.
    pub fn hit(&self) -> Vec<BlockHash> {
        self.chains[2].clone()
    }

    /// Partial: the first half of a 3-pod chain, then blocks nobody holds.
    pub fn partial(&self, rng: &mut SplitMix) -> Vec<BlockHash> {
        let mut q = self.chains[5][..CHAIN_BLOCKS / 2].to_vec();
        q.extend(rng.chain(CHAIN_BLOCKS / 2));
        q
    }

    /// Miss: blocks nobody holds.
    pub fn miss(&self, rng: &mut SplitMix) -> Vec<BlockHash> {
        rng.chain(CHAIN_BLOCKS)
    }
}

/// An index of design `B` holding every store of `w`, published once (no per-pod cap).
pub fn build<B: Backend>(w: &Workload) -> (Arc<ArcSwap<B::Snapshot>>, Writer<B>)
where
    B::Snapshot: Default,
{
    let published = Arc::new(ArcSwap::from_pointee(B::Snapshot::default()));
    let mut writer = Writer::<B>::new(published.clone(), usize::MAX);
    for (pod, chain) in w.stores() {
        writer.store(pod, chain);
    }
    writer.publish();
    (published, writer)
}
