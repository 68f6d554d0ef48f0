//! The flat snapshot and its editor against a naive model (proptest), their invariants, and runs
//! under cuts.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::edit::Editor;
use super::*;
use crate::walk::walk_blocks;

/// One copy and its editor, as the pool uses them (without the pool's copies).
#[derive(Default)]
struct Map {
    t: FlatSnapshot,
    e: Editor,
}

impl Map {
    fn link(&mut self, pod: u16, key: u64) -> (bool, bool) {
        self.e.link(&mut self.t, PodIdx(pod), key)
    }
    fn unlink(&mut self, pod: u16, key: u64) -> (bool, bool) {
        self.e.unlink(&mut self.t, PodIdx(pod), key)
    }
    /// A writer's store call with room for `room` new pairs; returns (new blocks, new pairs,
    /// dropped over the room).
    fn store(&mut self, pod: u16, keys: &[u64], room: usize) -> (u64, u64, u64) {
        let blocks: Vec<BlockHash> = keys.iter().map(|k| BlockHash(*k)).collect();
        let mut linked = Vec::new();
        let (nodes, dropped) = self.e.store(&mut self.t, PodIdx(pod), &blocks, room, &mut linked);
        (nodes, linked.len() as u64, dropped)
    }
    fn seal(&mut self, blocks: &[BlockHash]) {
        self.e.seal(&mut self.t, blocks);
    }
    fn settle(&mut self) {
        self.e.settle(&mut self.t);
    }
    fn check(&self) {
        self.e.assert_invariants(&self.t);
    }
    fn live_runs(&self) -> BTreeSet<usize> {
        self.t.runs.iter().map(|r| r.blocks().len()).filter(|n| *n > 0).collect()
    }
}

#[derive(Clone, Debug)]
enum MapOp {
    Link(u16, u64),
    Unlink(u16, u64),
    Seal(Vec<u64>),
    Store(u16, Vec<u64>, usize),
    Settle,
}

fn key(k: u64) -> u64 {
    // Spread some keys over the top bits too (the home slot comes from them).
    if k.is_multiple_of(2) { k } else { k.wrapping_mul(0x0123_4567_89ab_cdef) }
}

/// A stretch of keys, sometimes with repeats or jumps.
fn keys() -> impl Strategy<Value = Vec<u64>> {
    (0u64..200, 1u64..40, prop::collection::vec(0u64..200, 0..3)).prop_map(|(from, n, extra)| {
        let mut v: Vec<u64> = (from..from + n).map(key).collect();
        for e in extra {
            let at = (e as usize) % (v.len() + 1);
            v.insert(at, key(e));
        }
        v
    })
}

fn map_op() -> impl Strategy<Value = MapOp> {
    prop_oneof![
        2 => (0u16..8, keys(), prop_oneof![3 => Just(usize::MAX), 1 => 0usize..20]).prop_map(|(p, k, room)| MapOp::Store(p, k, room)),
        5 => (0u16..8, 0u64..200).prop_map(|(p, k)| MapOp::Link(p, key(k))),
        3 => (0u16..8, 0u64..200).prop_map(|(p, k)| MapOp::Unlink(p, key(k))),
        1 => keys().prop_map(MapOp::Seal),
        1 => Just(MapOp::Settle),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]

    /// Links, unlinks, store calls and seals (few keys, so probe runs collide, wrap and shift;
    /// runs are cut and re-made) against a `HashMap<key, BTreeSet<pod>>`; the run walk gives the same
    /// counts as the block-by-block walk on chains along the keys.
    #[test]
    fn flat_map_matches_a_hash_map(ops in prop::collection::vec(map_op(), 1..1500)) {
        let mut m = Map::default();
        let mut want: HashMap<u64, BTreeSet<u16>> = HashMap::new();
        for op in ops {
            match op {
                MapOp::Link(p, key) => {
                    let set = want.entry(key).or_default();
                    let new_block = set.is_empty();
                    let new_pair = set.insert(p);
                    prop_assert_eq!(m.link(p, key), (new_block, new_pair));
                }
                MapOp::Unlink(p, key) => {
                    let removed = want.get_mut(&key).is_some_and(|s| s.remove(&p));
                    let gone = removed && want.get(&key).is_some_and(BTreeSet::is_empty);
                    if gone {
                        want.remove(&key);
                    }
                    prop_assert_eq!(m.unlink(p, key), (removed, gone));
                }
                MapOp::Seal(keys) => {
                    let bs: Vec<BlockHash> = keys.into_iter().map(BlockHash).collect();
                    m.seal(&bs);
                }
                MapOp::Store(p, keys, room) => {
                    let (mut nodes, mut entries, mut dropped) = (0, 0, 0);
                    for k in &keys {
                        let set = want.entry(*k).or_default();
                        if entries as usize == room {
                            dropped += u64::from(!set.contains(&p));
                            if set.is_empty() {
                                want.remove(k);
                            }
                            continue;
                        }
                        nodes += u64::from(set.is_empty());
                        entries += u64::from(set.insert(p));
                    }
                    prop_assert_eq!(m.store(p, &keys, room), (nodes, entries, dropped));
                }
                MapOp::Settle => m.settle(),
            }
        }
        m.check();
        prop_assert_eq!(m.t.len(), want.len());
        for k in 0..200u64 {
            let got: Vec<u16> = m.t.pods_of(BlockHash(key(k))).iter().map(|p| p.0).collect();
            let exp: Vec<u16> = want.get(&key(k)).map(|s| s.iter().copied().collect()).unwrap_or_default();
            prop_assert_eq!(got, exp);
        }
        let (mut a, mut b) = (MatchScratch::default(), MatchScratch::default());
        for from in 0..200u64 {
            let chain: Vec<BlockHash> = (from..(from + 50).min(200)).map(|k| BlockHash(key(k))).collect();
            let runs = m.t.match_prefix(&chain, &mut a);
            let blocks = walk_blocks(&m.t, &chain, &mut b);
            prop_assert_eq!(runs, blocks);
            for p in 0..8 {
                prop_assert_eq!(a.matched(PodIdx(p)), b.matched(PodIdx(p)), "pod {} from {}", p, from);
            }
        }
    }
}

#[test]
fn slot_is_a_quarter_cache_line() {
    assert_eq!(size_of::<Slot>(), 16);
    assert_eq!(align_of::<Slot>(), 16);
}

/// One store call makes one run; a second pod storing a prefix splits it into a shared run and
/// a tail run; removing a middle block cuts it there and settling makes the rest a run again;
/// the walk stays exact.
#[test]
fn runs_follow_stores_and_cuts() {
    let mut m = Map::default();
    let chain: Vec<BlockHash> = (1..=300u64).map(|k| BlockHash(k.wrapping_mul(FIB))).collect();
    for b in &chain {
        m.link(1, b.0);
    }
    m.seal(&chain);
    m.check();
    assert_eq!(m.live_runs(), BTreeSet::from([256, 44]));
    for b in &chain[..100] {
        m.link(2, b.0);
    }
    m.seal(&chain[..100]);
    m.check();
    // Pod 2's prefix is one run, pod 1's tail another (cut, then made a run again).
    assert_eq!(m.live_runs(), BTreeSet::from([100, 156, 44]));
    m.unlink(2, chain[50].0);
    m.check();
    assert_eq!(m.live_runs(), BTreeSet::from([50, 156, 44]));
    m.settle();
    m.check();
    assert_eq!(m.live_runs(), BTreeSet::from([50, 49, 156, 44]));
    let mut s = MatchScratch::default();
    assert_eq!(m.t.match_prefix(&chain, &mut s), 300);
    assert_eq!((s.matched(PodIdx(1)), s.matched(PodIdx(2))), (300, 50));
}
