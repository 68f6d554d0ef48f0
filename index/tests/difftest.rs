//! Differential test: the index in use (design C over the flat table) against a naive
//! `HashMap<BlockHash, BTreeSet<pod>>` model, on seeded random op streams (proptest), including
//! the per-pod cap, snapshot immutability, and readers walking snapshots on other threads while
//! the writer runs.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use arc_swap::ArcSwap;
use kvroute_common::BlockHash;
use proptest::prelude::*;

use kvroute_index::{
    Backend, BlockPods, IndexSnapshot, IndexStats, IndexWriter, MAX_COPIES, MatchScratch, PodIdx, PooledBackend,
    Writer, match_prefix,
};

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

fn check<S: BlockPods + Stats>(snap: &S, model: &Model, chains: &[Vec<BlockHash>]) {
    let mut scratch = MatchScratch::default();
    let idx = model.index();
    assert_eq!(snap.stats().nodes, idx.len() as u64, "nodes");
    assert_eq!(snap.stats().entries, idx.values().map(|s| s.len() as u64).sum::<u64>(), "entries");
    for (b, pods) in &idx {
        let got: BTreeSet<u16> = BlockPods::pods_of(snap, *b).iter().map(|p| p.0).collect();
        assert_eq!(&got, pods, "pods of {b}");
    }
    for chain in chains {
        let longest = match_prefix(snap, chain, &mut scratch);
        let mut want_longest = 0;
        for p in 0..PODS {
            let want = model.matched(chain, p);
            want_longest = want_longest.max(want);
            assert_eq!(scratch.matched(PodIdx(p)), want, "pod {p} chain {chain:?}");
        }
        assert_eq!(longest, want_longest);
    }
}

/// Stats of a published snapshot (`Backend` does not expose them; test-only).
trait Stats {
    fn stats(&self) -> IndexStats;
}
impl Stats for kvroute_index::FlatSnapshot {
    fn stats(&self) -> IndexStats {
        kvroute_index::FlatSnapshot::stats(self)
    }
}

fn apply<B: Backend>(w: &mut Writer<B>, model: &mut Model, op: &Op) {
    match op {
        Op::Store(p, b) => {
            let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
            w.store(PodIdx(*p), &bs);
            model.store(*p, b);
        }
        Op::Remove(p, b) => {
            let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
            w.remove(PodIdx(*p), &bs);
            if let Some(v) = model.pods.get_mut(p) {
                v.retain(|x| !b.contains(x));
            }
        }
        Op::Clear(p) => {
            w.clear_pod(PodIdx(*p));
            model.pods.remove(p);
        }
        Op::Drop(p) => {
            w.drop_pod(PodIdx(*p));
            model.pods.remove(p);
        }
        Op::Replace(p, b) => {
            let bs: Vec<BlockHash> = b.iter().copied().map(BlockHash).collect();
            w.replace_pod(PodIdx(*p), &bs);
            model.pods.remove(p);
            model.store(*p, b);
        }
        Op::Publish => w.publish(),
    }
}

fn run_against_model<B>(ops: &[Op], chains: &[Vec<BlockHash>]) -> Result<(), TestCaseError>
where
    B: Backend,
    B::Snapshot: BlockPods + Stats + Default + Send + Sync,
{
    let published = Arc::new(ArcSwap::from_pointee(B::Snapshot::default()));
    let mut w = Writer::<B>::new(published.clone(), CAP);
    let mut model = Model::default();
    let mut frozen: Option<(Arc<B::Snapshot>, NaiveIndex)> = None;
    for op in ops {
        apply(&mut w, &mut model, op);
        if matches!(op, Op::Publish) {
            check(&**published.load(), &model, chains);
            // A snapshot taken now must not change under later writes.
            if frozen.is_none() {
                frozen = Some((published.load_full(), model.index()));
            }
        }
        prop_assert!(w.stats().entries <= u64::from(PODS) * CAP as u64);
    }
    w.publish();
    check(&**published.load(), &model, chains);
    if let Some((snap, idx)) = frozen {
        for (b, pods) in &idx {
            let got: BTreeSet<u16> = BlockPods::pods_of(&*snap, *b).iter().map(|p| p.0).collect();
            prop_assert_eq!(&got, pods);
        }
        prop_assert_eq!(snap.stats().nodes, idx.len() as u64);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, rng_seed: proptest::test_runner::RngSeed::Fixed(7), ..ProptestConfig::default() })]

    #[test]
    fn pooled_index_matches_naive_model(
        ops in prop::collection::vec(op(), 1..80),
        chains in prop::collection::vec(prop::collection::vec(block().prop_map(BlockHash), 0..8), 1..6),
    ) {
        run_against_model::<PooledBackend>(&ops, &chains)?;
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

/// SplitMix64: a seeded, dependency-free RNG for the concurrent test's op stream.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_batch(rng: &mut SplitMix) -> Vec<Op> {
    let blocks = |rng: &mut SplitMix| -> Vec<u64> {
        let n = rng.below(10);
        (0..n).map(|_| rng.below(24).wrapping_mul(0x0123_4567_89ab_cdef)).collect()
    };
    let n = 1 + rng.below(6);
    (0..n)
        .map(|_| {
            let p = rng.below(u64::from(PODS)) as u16;
            match rng.below(9) {
                0..=3 => Op::Store(p, blocks(rng)),
                4 | 5 => Op::Remove(p, blocks(rng)),
                6 => Op::Clear(p),
                7 => Op::Replace(p, blocks(rng)),
                _ => Op::Drop(p),
            }
        })
        .collect()
}

/// The pod that carries the version marker (outside the ops' pods).
const VERSION_POD: PodIdx = PodIdx(PODS);

fn marker(version: usize) -> BlockHash {
    BlockHash((1 << 62) | version as u64)
}

/// Readers on two threads walk whatever snapshot is current while the writer applies seeded
/// batches; every snapshot they see must equal the model after some whole batch (never a torn
/// one), and versions never go backwards for a reader.
fn concurrent_readers_see_whole_batches<B>(seed: u64)
where
    B: Backend,
    B::Snapshot: BlockPods + Default + Send + Sync + 'static,
{
    const BATCHES: usize = 200;
    let mut rng = SplitMix(seed);
    let batches: Vec<Vec<Op>> = (0..BATCHES).map(|_| random_batch(&mut rng)).collect();
    let chains: Vec<Vec<BlockHash>> = (0..8)
        .map(|_| (0..6).map(|_| BlockHash(rng.below(24).wrapping_mul(0x0123_4567_89ab_cdef))).collect())
        .collect();
    // Expected per-pod match counts for each chain after each batch (version k = after batch k).
    let mut model = Model::default();
    let mut expected: Vec<Vec<Vec<u32>>> = Vec::with_capacity(BATCHES + 1);
    let expect = |model: &Model| -> Vec<Vec<u32>> {
        chains.iter().map(|c| (0..PODS).map(|p| model.matched(c, p)).collect()).collect()
    };
    expected.push(expect(&model));
    for batch in &batches {
        for op in batch {
            match op {
                Op::Store(p, b) => model.store(*p, b),
                Op::Remove(p, b) => {
                    if let Some(v) = model.pods.get_mut(p) {
                        v.retain(|x| !b.contains(x));
                    }
                }
                Op::Clear(p) | Op::Drop(p) => drop(model.pods.remove(p)),
                Op::Replace(p, b) => {
                    model.pods.remove(p);
                    model.store(*p, b);
                }
                Op::Publish => {}
            }
        }
        expected.push(expect(&model));
    }
    let expected = Arc::new(expected);
    let chains = Arc::new(chains);

    let published = Arc::new(ArcSwap::from_pointee(B::Snapshot::default()));
    let mut w = Writer::<B>::new(published.clone(), CAP);
    w.store(VERSION_POD, &[marker(0)]);
    w.publish();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (published, done, expected, chains) =
                (published.clone(), done.clone(), expected.clone(), chains.clone());
            std::thread::spawn(move || {
                let mut scratch = MatchScratch::default();
                let (mut last, mut seen) = (0usize, 0u64);
                loop {
                    let finished = done.load(std::sync::atomic::Ordering::Acquire);
                    let snap = published.load();
                    let version = (last..=BATCHES).find(|v| !BlockPods::pods_of(&**snap, marker(*v)).is_empty());
                    let Some(version) = version else {
                        panic!("snapshot has no marker at or after version {last}");
                    };
                    for (c, chain) in chains.iter().enumerate() {
                        match_prefix(&**snap, chain, &mut scratch);
                        let got: Vec<u32> = (0..PODS).map(|p| scratch.matched(PodIdx(p))).collect();
                        assert_eq!(got, expected[version][c], "version {version} chain {c}");
                    }
                    last = version;
                    seen += 1;
                    if finished {
                        return (seen, last);
                    }
                }
            })
        })
        .collect();
    let mut model = Model::default();
    for (k, batch) in batches.iter().enumerate() {
        for op in batch {
            apply(&mut w, &mut model, op);
        }
        w.replace_pod(VERSION_POD, &[marker(k + 1)]);
        w.publish();
        if k % 50 == 0 {
            std::thread::yield_now();
        }
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    for r in readers {
        let Ok((seen, last)) = r.join() else {
            panic!("a reader thread panicked (see its message above)");
        };
        assert!(seen > 0);
        assert_eq!(last, BATCHES, "the last load after the writer finished sees the last batch");
    }
}

#[test]
fn pooled_concurrent_readers_see_whole_batches() {
    for seed in [1, 2] {
        concurrent_readers_see_whole_batches::<PooledBackend>(seed);
    }
}

/// Readers holding old snapshots (`load_full`) pin them: the pool grows to `MAX_COPIES`, no held
/// snapshot ever changes, and the log stays bounded once holders let go.
#[test]
fn pooled_never_mutates_held_snapshots() {
    let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
    let mut w = Writer::<PooledBackend>::new(published.clone(), usize::MAX);
    let mut held: Vec<(Arc<IndexSnapshot>, Vec<u64>)> = Vec::new();
    let mut model: BTreeSet<u64> = BTreeSet::new();
    for k in 0..40u64 {
        let blocks: Vec<BlockHash> = (0..6).map(|i| BlockHash(k * 100 + i)).collect();
        w.store(PodIdx(1), &blocks);
        model.extend(blocks.iter().map(|b| b.0));
        if k % 3 == 0 {
            let gone: Vec<BlockHash> = model.iter().take(4).map(|h| BlockHash(*h)).collect();
            w.remove(PodIdx(1), &gone);
            for g in &gone {
                model.remove(&g.0);
            }
        }
        w.publish();
        held.push((published.load_full(), model.iter().copied().collect()));
        assert!(w.backend().copies_held() <= MAX_COPIES);
        // Hold the last two snapshots, as two preempted readers would.
        if held.len() > 2 {
            held.remove(0);
        }
        for (snap, want) in &held {
            let got: Vec<u64> =
                (0..4000u64).filter(|h| !BlockPods::pods_of(&**snap, BlockHash(*h)).is_empty()).collect();
            assert_eq!(&got, want, "a held snapshot changed");
        }
    }
    assert!(w.backend().copies() >= 1, "holding two old copies must have grown the pool");
    assert_eq!(w.backend().waits(), 0, "three copies cover two held snapshots without waiting");
}

/// Chains longer than the walk's touch stretches (8, 16, 32, 64, 64, …): per-pod prefixes ending
/// on, before and after each stretch boundary, and removals in the middle of a pod's run, against
/// the model (the short random chains above rarely walk past block 8).
#[test]
fn long_chains_across_touch_stretches_match_the_model() {
    let published = Arc::new(ArcSwap::from_pointee(IndexSnapshot::default()));
    let mut w = IndexWriter::new(published.clone(), usize::MAX);
    let mut model = Model::default();
    let chain: Vec<u64> = (0..300u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555).collect();
    let ends = [1usize, 7, 8, 9, 23, 24, 25, 56, 57, 120, 121, 255, 256, 300];
    for (p, end) in ends.iter().enumerate() {
        let bs: Vec<BlockHash> = chain[..*end].iter().copied().map(BlockHash).collect();
        w.store(PodIdx(p as u16), &bs);
        model.pods.entry(p as u16).or_default().extend_from_slice(&chain[..*end]);
    }
    // Pods 12 and 13 lose a block in the middle of their run; pod 11 loses block 0.
    for (p, at) in [(12u16, 100usize), (13, 200), (11, 0)] {
        w.remove(PodIdx(p), &[BlockHash(chain[at])]);
        model.pods.entry(p).or_default().retain(|b| *b != chain[at]);
    }
    w.publish();
    let snap = published.load();
    let mut scratch = MatchScratch::default();
    let bs: Vec<BlockHash> = chain.iter().copied().map(BlockHash).collect();
    for len in [0usize, 1, 8, 9, 64, 65, 200, 300] {
        let longest = snap.match_prefix(&bs[..len], &mut scratch);
        let mut want_longest = 0;
        for p in 0..ends.len() as u16 {
            let want = model.matched(&bs[..len], p);
            want_longest = want_longest.max(want);
            assert_eq!(scratch.matched(PodIdx(p)), want, "pod {p}, query of {len} blocks");
        }
        assert_eq!(longest, want_longest);
    }
}
