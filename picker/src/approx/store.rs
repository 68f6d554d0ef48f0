//! [`ApproxStore`]: which pod each text-block chain was routed to, LRU-bounded per pod.
//!
//! A small dedicated structure rather than a second `kvroute_index` instance: the index interns
//! pods as the pool's `PodIdx`, drops stores beyond a pod's cap instead of evicting the least
//! recently used, and publishes batches from one writer thread; here every decision writes, and
//! the bound must evict (GIE's per-server LRU).
//!
//! Layout: `holders` maps a block hash to the pods recorded for it (a few, inline in a `Vec`);
//! each pod has `live` (block → stamp of its last recording) and `order` (recordings oldest first,
//! with lazily skipped stale entries, compacted when it grows past twice the capacity).
//!
//! Invariants: a pod's `live.len() ≤ capacity`; `holders[h]` contains pod `p` iff `pods[p].live`
//! contains `h`; `order` holds one entry per live block with its current stamp (plus stale ones).
//! Concurrency: one `parking_lot::RwLock` (lookups share it, recordings are exclusive).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvroute_common::BlockHash;
use parking_lot::RwLock;

use super::ApproxConfig;
use crate::score::PrefixMatches;

/// Pods remembered at most; past it the least recently routed pod is forgotten.
pub const MAX_PODS: usize = 4096;

/// Where text chains were routed, LRU-bounded per pod. Shared by `Arc`.
#[derive(Debug)]
pub struct ApproxStore {
    capacity: usize,
    max_blocks: usize,
    inner: RwLock<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    pods: Vec<PodLru>,
    ids: HashMap<Arc<str>, u32>,
    holders: HashMap<BlockHash, Vec<u32>>,
    /// Recordings made (orders pods for forgetting).
    clock: u64,
}

#[derive(Debug)]
struct PodLru {
    name: Arc<str>,
    live: HashMap<BlockHash, u64>,
    order: VecDeque<(BlockHash, u64)>,
    stamp: u64,
    last_routed: u64,
}

/// Per-pod consecutive matched blocks of one chain (pods with at least one).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApproxMatches {
    matched: Vec<(Arc<str>, u32)>,
}

impl ApproxMatches {
    /// Blocks of the chain, from the first, recorded for `pod` (0 when none).
    pub fn matched(&self, pod: &str) -> u32 {
        self.matched.iter().find(|(p, _)| &**p == pod).map_or(0, |(_, n)| *n)
    }

    /// `(pod, matched blocks)` for every pod matching at least one block.
    pub fn pods(&self) -> &[(Arc<str>, u32)] {
        &self.matched
    }
}

impl PrefixMatches for ApproxMatches {
    fn matched_blocks(&self, pod: &str) -> u32 {
        self.matched(pod)
    }
}

impl ApproxStore {
    /// An empty store with `config`'s per-pod capacity and block cap (0 counts as 1).
    pub fn new(config: &ApproxConfig) -> Self {
        Self {
            capacity: config.capacity_blocks_per_pod.max(1),
            max_blocks: config.max_blocks.max(1),
            inner: RwLock::new(Inner::default()),
        }
    }

    /// Records `pod` as holding `chain` (its first `max_blocks` blocks), most recently used. The
    /// chain is recorded leaf first, so that under pressure a pod forgets the tails of its chains
    /// before their shared prefixes (as vLLM's evictor frees a request's last blocks first).
    pub fn record(&self, pod: &str, chain: &[BlockHash]) {
        let chain = &chain[..chain.len().min(self.max_blocks)];
        if chain.is_empty() {
            return;
        }
        let mut inner = self.inner.write();
        inner.clock += 1;
        let clock = inner.clock;
        let pid = inner.pod_id(pod);
        let Inner { pods, holders, .. } = &mut *inner;
        let Some(lru) = pods.get_mut(pid as usize) else { return };
        lru.last_routed = clock;
        for h in chain.iter().rev() {
            lru.stamp += 1;
            if lru.live.insert(*h, lru.stamp).is_none() {
                holders.entry(*h).or_default().push(pid);
            }
            lru.order.push_back((*h, lru.stamp));
        }
        while lru.live.len() > self.capacity {
            let Some((h, stamp)) = lru.order.pop_front() else { break };
            if lru.live.get(&h) == Some(&stamp) {
                lru.live.remove(&h);
                remove_holder(holders, h, pid);
            }
        }
        if lru.order.len() > 2 * self.capacity + 64 {
            let live = &lru.live;
            lru.order.retain(|(h, s)| live.get(h) == Some(s));
        }
    }

    /// Per-pod consecutive matched blocks of `chain` (first `max_blocks` blocks), exactly like the
    /// precise index's walk: a pod's count is the number of leading blocks all recorded for it.
    pub fn match_chain(&self, chain: &[BlockHash]) -> ApproxMatches {
        let chain = &chain[..chain.len().min(self.max_blocks)];
        let inner = self.inner.read();
        let mut out = Vec::new();
        let mut alive: Vec<u32> = Vec::new();
        let mut depth = 0u32;
        for (i, h) in chain.iter().enumerate() {
            let Some(hs) = inner.holders.get(h) else { break };
            if i == 0 {
                alive.extend_from_slice(hs);
            } else {
                alive.retain(|p| {
                    let keep = hs.contains(p);
                    if !keep {
                        out.push((*p, depth));
                    }
                    keep
                });
            }
            if alive.is_empty() {
                break;
            }
            depth += 1;
        }
        out.extend(alive.iter().map(|p| (*p, depth)));
        let matched = out
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .filter_map(|(p, n)| inner.pods.get(p as usize).map(|l| (l.name.clone(), n)))
            .collect();
        ApproxMatches { matched }
    }

    /// Blocks currently remembered for `pod`.
    pub fn pod_blocks(&self, pod: &str) -> usize {
        let inner = self.inner.read();
        inner.ids.get(pod).and_then(|p| inner.pods.get(*p as usize)).map_or(0, |l| l.live.len())
    }

    /// Pods remembered.
    pub fn pod_count(&self) -> usize {
        self.inner.read().ids.len()
    }
}

impl Inner {
    /// The id of `pod`, interning it (and forgetting the least recently routed pod past
    /// [`MAX_PODS`], reusing its slot).
    fn pod_id(&mut self, pod: &str) -> u32 {
        if let Some(p) = self.ids.get(pod) {
            return *p;
        }
        let name: Arc<str> = Arc::from(pod);
        let fresh =
            PodLru { name: name.clone(), live: HashMap::new(), order: VecDeque::new(), stamp: 0, last_routed: 0 };
        let pid = if self.pods.len() < MAX_PODS {
            self.pods.push(fresh);
            u32::try_from(self.pods.len() - 1).unwrap_or(u32::MAX)
        } else {
            let slot = self.pods.iter().enumerate().min_by_key(|(_, l)| l.last_routed).map_or(0, |(i, _)| i);
            let pid = u32::try_from(slot).unwrap_or(u32::MAX);
            let Some(entry) = self.pods.get_mut(slot) else { return pid };
            let old = std::mem::replace(entry, fresh);
            for h in old.live.keys() {
                remove_holder(&mut self.holders, *h, pid);
            }
            self.ids.remove(&old.name);
            pid
        };
        self.ids.insert(name, pid);
        pid
    }
}

fn remove_holder(holders: &mut HashMap<BlockHash, Vec<u32>>, h: BlockHash, pid: u32) {
    if let Some(v) = holders.get_mut(&h) {
        v.retain(|p| *p != pid);
        if v.is_empty() {
            holders.remove(&h);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ids: &[u64]) -> Vec<BlockHash> {
        ids.iter().map(|i| BlockHash(*i)).collect()
    }

    fn store(capacity: usize) -> ApproxStore {
        ApproxStore::new(&ApproxConfig { block_chars: 4, capacity_blocks_per_pod: capacity, max_blocks: 256 })
    }

    #[test]
    fn consecutive_match_per_pod() {
        let s = store(100);
        s.record("a", &chain(&[1, 2, 3, 4]));
        s.record("b", &chain(&[1, 2, 9]));
        let m = s.match_chain(&chain(&[1, 2, 3, 5]));
        assert_eq!(m.matched("a"), 3);
        assert_eq!(m.matched("b"), 2);
        assert_eq!(m.matched("c"), 0);
        // A gap ends the match even when later blocks are recorded.
        s.record("c", &chain(&[7, 2, 3]));
        assert_eq!(s.match_chain(&chain(&[1, 2, 3])).matched("c"), 0);
        assert_eq!(s.match_chain(&chain(&[8])).pods(), &[]);
        assert_eq!(s.match_chain(&[]).pods(), &[]);
    }

    #[test]
    fn lru_bound_per_pod_evicts_least_recent_tails_first() {
        let s = store(4);
        s.record("a", &chain(&[1, 2, 3]));
        s.record("a", &chain(&[10, 11, 12]));
        assert_eq!(s.pod_blocks("a"), 4, "capacity bounds the pod");
        // The old chain lost its tail first: [1] remains, 2 and 3 are gone.
        let m = s.match_chain(&chain(&[1, 2, 3]));
        assert_eq!(m.matched("a"), 1);
        assert_eq!(s.match_chain(&chain(&[10, 11, 12])).matched("a"), 3);
        // Touching the old prefix again makes it most recent: now the other chain's tail goes.
        s.record("a", &chain(&[1, 2]));
        assert_eq!(s.pod_blocks("a"), 4);
        assert_eq!(s.match_chain(&chain(&[1, 2])).matched("a"), 2);
        assert_eq!(s.match_chain(&chain(&[10, 11, 12])).matched("a"), 2);
        // Another pod has its own budget.
        s.record("b", &chain(&[1, 2, 3, 4]));
        assert_eq!(s.pod_blocks("b"), 4);
        assert_eq!(s.pod_blocks("a"), 4);
    }

    #[test]
    fn many_recordings_stay_bounded() {
        let s = store(8);
        for i in 0..10_000u64 {
            s.record("a", &chain(&[i, i + 1_000_000]));
        }
        assert_eq!(s.pod_blocks("a"), 8);
        let inner = s.inner.read();
        assert!(inner.holders.len() <= 8);
        assert!(inner.pods[0].order.len() <= 2 * 8 + 64 + 2);
    }

    #[test]
    fn max_blocks_caps_record_and_match() {
        let s = ApproxStore::new(&ApproxConfig { block_chars: 4, capacity_blocks_per_pod: 100, max_blocks: 2 });
        s.record("a", &chain(&[1, 2, 3, 4]));
        assert_eq!(s.pod_blocks("a"), 2);
        assert_eq!(s.match_chain(&chain(&[1, 2, 3, 4])).matched("a"), 2);
    }

    /// The naive model: per pod a recency list (most recent last), capacity-bounded.
    #[derive(Default)]
    struct Naive {
        pods: std::collections::BTreeMap<String, Vec<BlockHash>>,
    }

    impl Naive {
        fn record(&mut self, pod: &str, chain: &[BlockHash], capacity: usize) {
            let list = self.pods.entry(pod.to_owned()).or_default();
            for h in chain.iter().rev() {
                list.retain(|x| x != h);
                list.push(*h);
            }
            let excess = list.len().saturating_sub(capacity);
            list.drain(..excess);
        }
        fn matched(&self, pod: &str, chain: &[BlockHash]) -> u32 {
            let Some(list) = self.pods.get(pod) else { return 0 };
            chain.iter().take_while(|h| list.contains(h)).count() as u32
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 300,
            rng_seed: proptest::test_runner::RngSeed::Fixed(6),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Differential: random recordings (chains that branch from a few shared prefixes) on
        /// three pods, then every query's per-pod match equals the naive model's.
        #[test]
        fn store_matches_the_naive_model(
            capacity in 1usize..12,
            ops in proptest::collection::vec((0usize..3, 0u64..3, 0usize..6, 0u64..4), 1..40),
            queries in proptest::collection::vec((0u64..3, 0usize..8, 0u64..4), 1..10),
        ) {
            // Chain = `len` blocks under prefix family `fam`, the last one varied by `tail`.
            let make = |fam: u64, len: usize, tail: u64| -> Vec<BlockHash> {
                (0..len as u64).map(|i| BlockHash(fam * 1000 + i * 10 + if i + 1 == len as u64 { tail } else { 0 })).collect()
            };
            let s = store(capacity);
            let mut naive = Naive::default();
            let pods = ["a", "b", "c"];
            for (p, fam, len, tail) in ops {
                let c = make(fam, len, tail);
                s.record(pods[p], &c);
                naive.record(pods[p], &c, capacity);
            }
            for (fam, len, tail) in queries {
                let q = make(fam, len, tail);
                let m = s.match_chain(&q);
                for p in pods {
                    proptest::prop_assert_eq!(m.matched(p), naive.matched(p, &q), "pod {} query {:?}", p, q);
                }
            }
            for p in pods {
                proptest::prop_assert_eq!(s.pod_blocks(p), naive.pods.get(p).map_or(0, Vec::len));
            }
        }
    }

    #[test]
    fn pods_past_the_cap_forget_the_least_recently_routed() {
        let s = store(4);
        for p in 0..MAX_PODS {
            s.record(&format!("p{p}"), &chain(&[1]));
        }
        s.record("p0", &chain(&[1]));
        s.record("new", &chain(&[1, 2]));
        assert_eq!(s.pod_count(), MAX_PODS);
        assert_eq!(s.pod_blocks("p1"), 0, "p1 was the least recently routed");
        assert_eq!(s.pod_blocks("p0"), 1);
        let m = s.match_chain(&chain(&[1, 2]));
        assert_eq!(m.matched("new"), 2);
        assert_eq!(m.matched("p1"), 0);
    }
}
