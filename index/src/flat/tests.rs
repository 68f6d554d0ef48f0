//! The flat map against a naive model (proptest), its invariants, and runs under cuts.

use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;
use crate::walk::walk_blocks;

/// Every occupied slot is reachable from its home with no empty slot in between; every
/// current run reference is consistent (module invariant); set refcounts are exact.
fn assert_invariants(m: &FlatMap) {
    let mask = m.mask();
    let mut occupied = 0;
    let mut refs: HashMap<u32, u32> = HashMap::new();
    for (j, s) in m.slots.iter().enumerate() {
        if s.set == 0 {
            continue;
        }
        occupied += 1;
        *refs.entry(s.set).or_default() += 1;
        assert_ne!(s.run, GATHERING);
        let mut i = m.home(s.key);
        while i != j {
            assert_ne!(m.slots[i].set, 0, "hole between home {} and slot {j}", m.home(s.key));
            i = (i + 1) & mask;
        }
    }
    assert_eq!(occupied, m.len);
    for (id, e) in m.sets.iter().enumerate().skip(1) {
        assert_eq!(refs.get(&(id as u32)).copied().unwrap_or(0), e.refs, "refs of set {id}");
    }
    assert_eq!(m.run_words, m.runs.iter().map(Vec::capacity).sum::<usize>());
    assert_eq!(m.set_pods, m.sets.iter().map(|e| e.pods.len()).sum::<usize>());
    for (r, run) in m.runs.iter().enumerate() {
        assert!(run.is_empty() || run.len() >= 2);
        let sets: BTreeSet<u32> = run
            .iter()
            .enumerate()
            .map(|(k, key)| {
                let i = m.find(*key).expect("a run's block is in the map");
                assert_eq!(m.slots[i].run, ((r as u32) << 8) | k as u32, "run {r} offset {k}");
                m.slots[i].set
            })
            .collect();
        assert!(sets.len() <= 1, "run {r} spans pod sets {sets:?}");
    }
}

#[derive(Clone, Debug)]
enum MapOp {
    Link(u16, u64),
    Unlink(u16, u64),
    Seal(Vec<u64>),
    Settle,
}

fn key(k: u64) -> u64 {
    // Spread some keys over the top bits too (the home slot comes from them).
    if k.is_multiple_of(2) { k } else { k.wrapping_mul(0x0123_4567_89ab_cdef) }
}

fn map_op() -> impl Strategy<Value = MapOp> {
    prop_oneof![
        5 => (0u16..8, 0u64..200).prop_map(|(p, k)| MapOp::Link(p, key(k))),
        3 => (0u16..8, 0u64..200).prop_map(|(p, k)| MapOp::Unlink(p, key(k))),
        // Runs over a stretch of keys, sometimes with repeats or jumps.
        1 => (0u64..200, 1u64..40, prop::collection::vec(0u64..200, 0..3)).prop_map(|(from, n, extra)| {
            let mut v: Vec<u64> = (from..from + n).map(key).collect();
            for e in extra {
                let at = (e as usize) % (v.len() + 1);
                v.insert(at, key(e));
            }
            MapOp::Seal(v)
        }),
        1 => Just(MapOp::Settle),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(11), ..ProptestConfig::default() })]

    /// Links, unlinks and seals (few keys, so probe runs collide, wrap and shift; runs are cut
    /// and re-made) against a `HashMap<key, BTreeSet<pod>>`; the run walk gives the same
    /// counts as the block-by-block walk on chains along the keys.
    #[test]
    fn flat_map_matches_a_hash_map(ops in prop::collection::vec(map_op(), 1..1500)) {
        let mut m = FlatMap::default();
        let mut want: HashMap<u64, BTreeSet<u16>> = HashMap::new();
        for op in ops {
            match op {
                MapOp::Link(p, key) => {
                    let set = want.entry(key).or_default();
                    let new_block = set.is_empty();
                    let new_pair = set.insert(p);
                    prop_assert_eq!(m.link(PodIdx(p), key), (new_block, new_pair));
                }
                MapOp::Unlink(p, key) => {
                    let removed = want.get_mut(&key).is_some_and(|s| s.remove(&p));
                    let gone = removed && want.get(&key).is_some_and(BTreeSet::is_empty);
                    if gone {
                        want.remove(&key);
                    }
                    prop_assert_eq!(m.unlink(PodIdx(p), key), (removed, gone));
                }
                MapOp::Seal(keys) => {
                    let bs: Vec<BlockHash> = keys.into_iter().map(BlockHash).collect();
                    m.seal(&bs);
                }
                MapOp::Settle => m.settle(),
            }
        }
        assert_invariants(&m);
        prop_assert_eq!(m.len(), want.len());
        for k in 0..200u64 {
            let got: Vec<u16> = m.get(key(k)).iter().map(|p| p.0).collect();
            let exp: Vec<u16> = want.get(&key(k)).map(|s| s.iter().copied().collect()).unwrap_or_default();
            prop_assert_eq!(got, exp);
        }
        let snap = FlatSnapshot { map: m, stats: IndexStats::default() };
        let (mut a, mut b) = (MatchScratch::default(), MatchScratch::default());
        for from in 0..200u64 {
            let chain: Vec<BlockHash> = (from..(from + 50).min(200)).map(|k| BlockHash(key(k))).collect();
            let runs = snap.map.walk(&chain, &mut a);
            let blocks = walk_blocks(&snap, &chain, &mut b);
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
    let mut m = FlatMap::default();
    let chain: Vec<BlockHash> = (1..=300u64).map(|k| BlockHash(k.wrapping_mul(FIB))).collect();
    for b in &chain {
        m.link(PodIdx(1), b.0);
    }
    m.seal(&chain);
    assert_invariants(&m);
    let live = |m: &FlatMap| m.runs.iter().filter(|r| !r.is_empty()).map(Vec::len).collect::<BTreeSet<_>>();
    assert_eq!(live(&m), BTreeSet::from([256, 44]));
    for b in &chain[..100] {
        m.link(PodIdx(2), b.0);
    }
    m.seal(&chain[..100]);
    assert_invariants(&m);
    // Pod 2's prefix is one run, pod 1's tail another (cut, then made a run again).
    assert_eq!(live(&m), BTreeSet::from([100, 156, 44]));
    m.unlink(PodIdx(2), chain[50].0);
    assert_invariants(&m);
    assert_eq!(live(&m), BTreeSet::from([50, 156, 44]));
    m.settle();
    assert_invariants(&m);
    assert_eq!(live(&m), BTreeSet::from([50, 49, 156, 44]));
    let snap = FlatSnapshot { map: m, stats: IndexStats::default() };
    let mut s = MatchScratch::default();
    assert_eq!(snap.match_prefix(&chain, &mut s), 300);
    assert_eq!((s.matched(PodIdx(1)), s.matched(PodIdx(2))), (300, 50));
}
