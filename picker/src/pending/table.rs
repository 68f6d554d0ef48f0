//! [`PendingTable`]: block chains routed to a pod and not yet confirmed by its KV events
//! (docs/design.md §3 "Pending entries").
//!
//! Layout: block hash → the pods holding it pending, each with an expiry; and the chains in the
//! order they were recorded (their expiries are then in order too, since the time-to-live is one
//! constant), so expiry and the size cap pop from the front. A chain is stored from the first
//! block the pod's index did not hold when it was recorded (its *frontier*): the blocks before are
//! already credited by the index. A lookup therefore extends each pod's index match: from the
//! pod's frontier, block after block, while the pod holds the next block pending.
//!
//! Bounds: at most `max_blocks` (block, pod) entries; beyond, the oldest chains go first
//! (counted as evicted). A clock that jumps back cannot keep an entry alive beyond its
//! time-to-live: an entry that expires further than one time-to-live from now is dead.
//!
//! Not thread-safe by itself: [`super::SharedView`] holds it behind a mutex.

use std::collections::VecDeque;
use std::sync::Arc;

use kvroute_common::BlockHash;

use crate::index::{IndexSnapshot, MixBuild, PodIdx};

/// Who recorded a pending chain: [`LOCAL`] for this replica, otherwise a peer replica's id.
pub type Origin = u64;
/// The [`Origin`] of chains this replica routed.
pub const LOCAL: Origin = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    pod: PodIdx,
    expires_ms: i64,
}

/// The pods holding one block pending: nearly always one, so no allocation for it.
#[derive(Debug)]
enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    /// Records `pod` until `expires_ms` (the later expiry wins).
    fn upsert(&mut self, pod: PodIdx, expires_ms: i64) {
        match self {
            Holders::One(h) if h.pod == pod => h.expires_ms = h.expires_ms.max(expires_ms),
            Holders::One(h) => *self = Holders::Many(vec![*h, Holder { pod, expires_ms }]),
            Holders::Many(v) => match v.iter_mut().find(|h| h.pod == pod) {
                Some(h) => h.expires_ms = h.expires_ms.max(expires_ms),
                None => v.push(Holder { pod, expires_ms }),
            },
        }
    }

    /// Forgets `pod` if its entry expires no later than `expires_ms` (a later chain through the
    /// same block keeps it). Returns true when no pod is left.
    fn release(&mut self, pod: PodIdx, expires_ms: i64) -> bool {
        match self {
            Holders::One(h) => h.pod == pod && h.expires_ms <= expires_ms,
            Holders::Many(v) => {
                v.retain(|h| !(h.pod == pod && h.expires_ms <= expires_ms));
                if let [only] = v.as_slice() {
                    *self = Holders::One(*only);
                    return false;
                }
                v.is_empty()
            }
        }
    }
}

#[derive(Debug)]
struct Chain {
    pod: PodIdx,
    expires_ms: i64,
    blocks: Arc<[BlockHash]>,
    origin: Origin,
}

/// Counts of what happened to pending chains since start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PendingCounts {
    /// Chains recorded by this replica's decisions.
    pub recorded_local: u64,
    /// Chains recorded from peer replicas.
    pub recorded_peer: u64,
    /// Chains whose time-to-live ended while the pod's index held their last block.
    pub confirmed: u64,
    /// Chains whose time-to-live ended without the pod's events confirming them: dropped.
    pub expired: u64,
    /// Chains dropped early because the table was full.
    pub evicted: u64,
}

/// Routed-but-unconfirmed block chains per pod (see the module docs).
#[derive(Debug)]
pub struct PendingTable {
    ttl_ms: i64,
    max_blocks: usize,
    holders: hashbrown::HashMap<u64, Holders, MixBuild>,
    chains: VecDeque<Chain>,
    /// Σ chain lengths in `chains` (entries, counting a block on two pods twice).
    held: usize,
    counts: PendingCounts,
}

impl PendingTable {
    /// An empty table whose chains live `ttl_ms` and hold at most `max_blocks` entries in all.
    pub fn new(ttl_ms: u64, max_blocks: usize) -> Self {
        PendingTable {
            ttl_ms: i64::try_from(ttl_ms).unwrap_or(i64::MAX / 4),
            max_blocks,
            holders: hashbrown::HashMap::default(),
            chains: VecDeque::new(),
            held: 0,
            counts: PendingCounts::default(),
        }
    }

    /// Whether the table records anything (a time-to-live of 0 disables it).
    pub fn enabled(&self) -> bool {
        self.ttl_ms > 0 && self.max_blocks > 0
    }

    /// Entries held, chains held.
    pub fn size(&self) -> (usize, usize) {
        (self.held, self.chains.len())
    }

    /// What happened to chains since start.
    pub fn counts(&self) -> PendingCounts {
        self.counts
    }

    fn alive(&self, h: &Holder, now_ms: i64) -> bool {
        now_ms < h.expires_ms && h.expires_ms <= now_ms.saturating_add(self.ttl_ms)
    }

    /// Drops the chains whose time-to-live ended by `now_ms`, counting each as confirmed when
    /// `index` holds its last block on its pod, else as expired.
    pub fn purge(&mut self, now_ms: i64, index: &IndexSnapshot) {
        while let Some(front) = self.chains.front() {
            // A clock that went back leaves the front's expiry far ahead: dead as well.
            let dead = front.expires_ms <= now_ms || front.expires_ms > now_ms.saturating_add(self.ttl_ms);
            if !dead {
                break;
            }
            let Some(c) = self.chains.pop_front() else { break };
            let confirmed = c.blocks.last().is_some_and(|last| index.pods_of(*last).contains(&c.pod));
            if confirmed {
                self.counts.confirmed += 1;
            } else {
                self.counts.expired += 1;
            }
            self.unlink(&c);
        }
    }

    fn unlink(&mut self, c: &Chain) {
        self.held = self.held.saturating_sub(c.blocks.len());
        for b in c.blocks.iter() {
            if let Some(h) = self.holders.get_mut(&b.0)
                && h.release(c.pod, c.expires_ms)
            {
                self.holders.remove(&b.0);
            }
        }
    }

    /// Records `blocks` (a chain from some pod's frontier on) as pending on `pod` until
    /// `now_ms + ttl`. Evicts the oldest chains beyond `max_blocks`.
    pub fn record(&mut self, pod: PodIdx, blocks: Arc<[BlockHash]>, now_ms: i64, origin: Origin) {
        if !self.enabled() || blocks.is_empty() {
            return;
        }
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        for b in blocks.iter() {
            match self.holders.entry(b.0) {
                hashbrown::hash_map::Entry::Occupied(mut e) => e.get_mut().upsert(pod, expires_ms),
                hashbrown::hash_map::Entry::Vacant(e) => {
                    e.insert(Holders::One(Holder { pod, expires_ms }));
                }
            }
        }
        self.held += blocks.len();
        if origin == LOCAL {
            self.counts.recorded_local += 1;
        } else {
            self.counts.recorded_peer += 1;
        }
        self.chains.push_back(Chain { pod, expires_ms, blocks, origin });
        while self.held > self.max_blocks {
            let Some(c) = self.chains.pop_front() else { break };
            self.counts.evicted += 1;
            self.unlink(&c);
        }
    }

    /// For each `(pod, frontier)` of `pods`: how many blocks of `chain` from `frontier` on the
    /// pod holds pending at `now_ms`, consecutively, into `out` (same order). One lookup per
    /// distinct frontier plus one per pending block found.
    pub fn extend_all(&self, chain: &[BlockHash], now_ms: i64, pods: &[(PodIdx, u32)], out: &mut Vec<u32>) {
        out.clear();
        if self.holders.is_empty() || chain.is_empty() {
            out.resize(pods.len(), 0);
            return;
        }
        // Frontier → the holders of the block there (most pods share a frontier).
        let mut memo: Vec<(u32, &[Holder])> = Vec::new();
        for &(pod, frontier) in pods {
            let at = match memo.iter().find(|(f, _)| *f == frontier) {
                Some((_, h)) => *h,
                None => {
                    let h = self.holders_at(chain, frontier);
                    memo.push((frontier, h));
                    h
                }
            };
            let mut n = 0u32;
            if at.iter().any(|h| h.pod == pod && self.alive(h, now_ms)) {
                n = 1;
                while self
                    .holders_at(chain, frontier.saturating_add(n))
                    .iter()
                    .any(|h| h.pod == pod && self.alive(h, now_ms))
                {
                    n += 1;
                }
            }
            out.push(n);
        }
    }

    fn holders_at(&self, chain: &[BlockHash], i: u32) -> &[Holder] {
        chain.get(i as usize).and_then(|b| self.holders.get(&b.0)).map_or(&[], Holders::as_slice)
    }

    /// Every chain held, oldest first: `(pod, expiry, blocks, origin)` (a peer's snapshot).
    pub fn chains(&self) -> impl Iterator<Item = (PodIdx, i64, &Arc<[BlockHash]>, Origin)> {
        self.chains.iter().map(|c| (c.pod, c.expires_ms, &c.blocks, c.origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::tests::chain;

    fn arc(v: &[BlockHash]) -> Arc<[BlockHash]> {
        Arc::from(v)
    }

    fn ext(t: &PendingTable, chain: &[BlockHash], now: i64, pods: &[(PodIdx, u32)]) -> Vec<u32> {
        let mut out = Vec::new();
        t.extend_all(chain, now, pods, &mut out);
        out
    }

    const A: PodIdx = PodIdx(0);
    const B: PodIdx = PodIdx(1);

    #[test]
    fn a_recorded_chain_extends_the_pod_from_its_frontier_until_it_expires() {
        let c = chain(1, 10);
        let mut t = PendingTable::new(2000, 1000);
        // A's index held 4 blocks when the request was routed: blocks 4.. are pending.
        t.record(A, arc(&c[4..]), 1000, LOCAL);
        assert_eq!(ext(&t, &c, 1500, &[(A, 4), (B, 0)]), vec![6, 0]);
        // A pod whose index frontier is behind the pending run gets nothing from it.
        assert_eq!(ext(&t, &c, 1500, &[(A, 2)]), vec![0]);
        // A shorter request sharing the prefix: extension stops at its own end.
        assert_eq!(ext(&t, &c[..7], 1500, &[(A, 4)]), vec![3]);
        // Dead at the expiry instant, and purged.
        assert_eq!(ext(&t, &c, 3000, &[(A, 4)]), vec![0]);
        t.purge(3000, &IndexSnapshot::default());
        assert_eq!(t.size(), (0, 0));
        assert_eq!(t.counts().expired, 1);
    }

    #[test]
    fn a_later_chain_through_the_same_blocks_keeps_them_alive() {
        let c = chain(1, 6);
        let mut t = PendingTable::new(1000, 1000);
        t.record(A, arc(&c), 0, LOCAL);
        t.record(B, arc(&c[..3]), 100, 7);
        t.record(A, arc(&c[..3]), 500, LOCAL);
        t.purge(1000, &IndexSnapshot::default());
        // The first chain is gone; the refresh keeps A's first three blocks, B keeps its own.
        assert_eq!(ext(&t, &c, 1000, &[(A, 0), (B, 0)]), vec![3, 3]);
        assert_eq!(t.counts().recorded_peer, 1);
        t.purge(1500, &IndexSnapshot::default());
        assert!(t.holders.is_empty());
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn the_cap_evicts_oldest_chains_first() {
        let (c1, c2) = (chain(1, 6), chain(100, 6));
        let mut t = PendingTable::new(10_000, 8);
        t.record(A, arc(&c1), 0, LOCAL);
        t.record(B, arc(&c2), 1, LOCAL);
        assert_eq!(t.counts().evicted, 1);
        assert_eq!(t.size(), (6, 1));
        assert_eq!(ext(&t, &c1, 2, &[(A, 0)]), vec![0]);
        assert_eq!(ext(&t, &c2, 2, &[(B, 0)]), vec![6]);
    }

    #[test]
    fn a_clock_that_jumps_back_cannot_keep_an_entry_alive() {
        let c = chain(1, 4);
        let mut t = PendingTable::new(2000, 100);
        t.record(A, arc(&c), 1_000_000, LOCAL);
        assert_eq!(ext(&t, &c, 1_000_100, &[(A, 0)]), vec![4]);
        assert_eq!(ext(&t, &c, 10, &[(A, 0)]), vec![0]);
        t.purge(10, &IndexSnapshot::default());
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn a_zero_ttl_disables_the_table() {
        let c = chain(1, 4);
        let mut t = PendingTable::new(0, 100);
        t.record(A, arc(&c), 0, LOCAL);
        assert!(!t.enabled());
        assert_eq!(ext(&t, &c, 0, &[(A, 0)]), vec![0]);
    }
}
