//! Differential test: the sharded index against a naive `HashMap<BlockHash, BTreeSet<pod>>`
//! model, on seeded random op streams (proptest), including the per-pod cap and snapshot
//! immutability.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;
use proptest::prelude::*;

use super::{IndexSnapshot, IndexWriter, MatchScratch, PodIdx};

const PODS: u16 = 10;
const CAP: usize = 12;

type NaiveIndex = HashMap<BlockHash, BTreeSet<u16>>;

#[derive(Clone, Debug)]
enum Op {
    Store(u16, Vec<u64>),
    Remove(u16, Vec<u64>),
    Clear(u16),
    Replace(u16, Vec<u64>),
    Drop(u16),
    Publish,
}

/// The naive model: per pod, its blocks in insertion order (for the cap).
#[derive(Default)]
struct Model {
    pods: HashMap<u16, Vec<u64>>,
}

impl Model {
    fn store(&mut self, pod: u16, blocks: &[u64]) {
        let v = self.pods.entry(pod).or_default();
        for b in blocks {
            if !v.contains(b) && v.len() < CAP {
                v.push(*b);
            }
        }
    }
    fn index(&self) -> HashMap<BlockHash, BTreeSet<u16>> {
        let mut m: HashMap<BlockHash, BTreeSet<u16>> = HashMap::new();
        for (p, v) in &self.pods {
            for b in v {
                m.entry(BlockHash(*b)).or_default().insert(*p);
            }
        }
        m
    }
    fn matched(&self, chain: &[BlockHash], pod: u16) -> u32 {
        let idx = self.index();
        chain.iter().take_while(|b| idx.get(b).is_some_and(|s| s.contains(&pod))).count() as u32
    }
}

fn block() -> impl Strategy<Value = u64> + Clone {
    // Few distinct values so ops collide; spread over the shard bits too.
    (0u64..24).prop_map(|v| v.wrapping_mul(0x0123_4567_89ab_cdef))
}

fn op() -> impl Strategy<Value = Op> {
    let pod = 0..PODS;
    let blocks = prop::collection::vec(block(), 0..10);
    prop_oneof![
        4 => (pod.clone(), blocks.clone()).prop_map(|(p, b)| Op::Store(p, b)),
        2 => (pod.clone(), blocks.clone()).prop_map(|(p, b)| Op::Remove(p, b)),
        1 => pod.clone().prop_map(Op::Clear),
        1 => (pod.clone(), blocks).prop_map(|(p, b)| Op::Replace(p, b)),
        1 => pod.prop_map(Op::Drop),
        2 => Just(Op::Publish),
    ]
}

fn check(snap: &IndexSnapshot, model: &Model, chains: &[Vec<BlockHash>]) {
    let mut scratch = MatchScratch::default();
    let idx = model.index();
    assert_eq!(snap.stats().nodes, idx.len() as u64, "nodes");
    assert_eq!(snap.stats().entries, idx.values().map(|s| s.len() as u64).sum::<u64>(), "entries");
    for (b, pods) in &idx {
        let got: BTreeSet<u16> = snap.pods_of(*b).iter().map(|p| p.0).collect();
        assert_eq!(&got, pods, "pods of {b}");
    }
    for chain in chains {
        let longest = snap.match_prefix(chain, &mut scratch);
        let mut want_longest = 0;
        for p in 0..PODS {
            let want = model.matched(chain, p);
            want_longest = want_longest.max(want);
            assert_eq!(scratch.matched(PodIdx(p)), want, "pod {p} chain {chain:?}");
        }
        assert_eq!(longest, want_longest);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]

    #[test]
    fn sharded_index_matches_naive_model(
        ops in prop::collection::vec(op(), 1..80),
        chains in prop::collection::vec(prop::collection::vec(block().prop_map(BlockHash), 0..8), 1..6),
    ) {
        let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
        let mut w = IndexWriter::new(published.clone(), CAP);
        let mut model = Model::default();
        let mut frozen: Option<(Arc<IndexSnapshot>, NaiveIndex)> = None;
        for op in ops {
            match op {
                Op::Store(p, b) => {
                    let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
                    w.store(PodIdx(p), &bs);
                    model.store(p, &b);
                }
                Op::Remove(p, b) => {
                    let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
                    w.remove(PodIdx(p), &bs);
                    if let Some(v) = model.pods.get_mut(&p) { v.retain(|x| !b.contains(x)); }
                }
                Op::Clear(p) | Op::Drop(p) => {
                    if matches!(op, Op::Clear(_)) { w.clear_pod(PodIdx(p)) } else { w.drop_pod(PodIdx(p)) }
                    model.pods.remove(&p);
                }
                Op::Replace(p, b) => {
                    let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
                    w.replace_pod(PodIdx(p), &bs);
                    model.pods.remove(&p);
                    model.store(p, &b);
                }
                Op::Publish => {
                    w.publish();
                    check(&published.load(), &model, &chains);
                    // A snapshot taken now must not change under later writes.
                    if frozen.is_none() { frozen = Some((published.load_full(), model.index())); }
                }
            }
            prop_assert!(w.stats().entries <= u64::from(PODS) * CAP as u64);
        }
        w.publish();
        check(&published.load(), &model, &chains);
        if let Some((snap, idx)) = frozen {
            for (b, pods) in &idx {
                let got: BTreeSet<u16> = snap.pods_of(*b).iter().map(|p| p.0).collect();
                prop_assert_eq!(&got, pods);
            }
            prop_assert_eq!(snap.stats().nodes, idx.len() as u64);
        }
    }
}

#[test]
fn cap_drops_and_counts_excess_stores() {
    let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
    let mut w = IndexWriter::new(published.clone(), 3);
    let blocks: Vec<BlockHash> = (1..=5).map(BlockHash).collect();
    assert_eq!(w.store(PodIdx(0), &blocks), 2);
    w.publish();
    let s = published.load().stats();
    assert_eq!((s.entries, s.dropped_over_cap), (3, 2));
    let mut scratch = MatchScratch::default();
    assert_eq!(published.load().match_prefix(&blocks, &mut scratch), 3);
}

#[test]
fn walk_stops_when_no_pod_remains_and_counts_from_start() {
    let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
    let mut w = IndexWriter::new(published.clone(), 100);
    let chain: Vec<BlockHash> = (10..20).map(BlockHash).collect();
    w.store(PodIdx(1), &chain[..6]);
    w.store(PodIdx(2), &chain[..3]);
    // Pod 3 holds later blocks but not block 0: no match.
    w.store(PodIdx(3), &chain[1..]);
    w.publish();
    let mut scratch = MatchScratch::default();
    let snap = published.load();
    assert_eq!(snap.match_prefix(&chain, &mut scratch), 6);
    assert_eq!(scratch.matched(PodIdx(1)), 6);
    assert_eq!(scratch.matched(PodIdx(2)), 3);
    assert_eq!(scratch.matched(PodIdx(3)), 0);
    // Scratch reuse resets earlier results.
    assert_eq!(snap.match_prefix(&chain[..0], &mut scratch), 0);
    assert_eq!(scratch.matched(PodIdx(1)), 0);
}
