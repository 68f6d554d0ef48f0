//! [`PendingTable`]: block chains routed to a pod and not yet confirmed by its KV events
//! (docs/design.md §3 "Pending entries").
//!
//! Layout: block hash → the pods holding it pending, each with an expiry and a count of the
//! in-flight requests pinning it; and the chains themselves. A chain is stored from the first
//! block the pod's index did not hold when it was routed (its *frontier*): the blocks before are
//! already credited by the index. A lookup therefore extends each pod's index match: from the
//! pod's frontier, block after block, while the pod holds the next block pending.
//!
//! Lifetime: a chain recorded for a request is *pinned* while the request is in flight (vLLM
//! keeps a running request's blocks; a queued request's blocks will be computed before a later
//! request for the same prefix is admitted), and lives `ttl` after its routing or until its end,
//! whichever is later. A chain without a request (a peer's snapshot) lives `ttl`. At the end of
//! its life a chain counts as confirmed (the pod's index holds its last block) or expired.
//!
//! Bounds: at most `max_blocks` (block, pod) entries; beyond, the oldest chains go first
//! (counted as evicted), pinned or not. A clock that jumps back cannot keep an unpinned entry
//! alive beyond its time-to-live: an expiry further than one time-to-live from now is dead.
//!
//! Not thread-safe by itself: [`super::SharedView`] holds it behind a mutex.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;

use kvroute_common::BlockHash;

use crate::index::{IndexSnapshot, IndexStamp, MixBuild, PodIdx};

/// Who recorded a pending chain: [`LOCAL`] for this replica, otherwise a peer replica's id.
pub type Origin = u64;
/// The [`Origin`] of chains this replica routed.
pub const LOCAL: Origin = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    pod: PodIdx,
    expires_ms: i64,
    /// In-flight requests whose chains pin this (block, pod).
    pins: u32,
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

    fn find_mut(&mut self, pod: PodIdx) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => (h.pod == pod).then_some(h),
            Holders::Many(v) => v.iter_mut().find(|h| h.pod == pod),
        }
    }

    /// Records `pod` until `expires_ms` (the later expiry wins), pinned once more if `pin`.
    fn upsert(&mut self, pod: PodIdx, expires_ms: i64, pin: bool) {
        let pins = u32::from(pin);
        match self.find_mut(pod) {
            Some(h) => {
                h.expires_ms = h.expires_ms.max(expires_ms);
                h.pins = h.pins.saturating_add(pins);
            }
            None => {
                let new = Holder { pod, expires_ms, pins };
                match self {
                    Holders::One(h) => *self = Holders::Many(vec![*h, new]),
                    Holders::Many(v) => v.push(new),
                }
            }
        }
    }

    /// Forgets `pod` if nothing pins it and its entry expires no later than `expires_ms` (a later
    /// chain through the same block keeps it). Returns true when no pod is left.
    fn release(&mut self, pod: PodIdx, expires_ms: i64) -> bool {
        let gone = |h: &Holder| h.pod == pod && h.pins == 0 && h.expires_ms <= expires_ms;
        match self {
            Holders::One(h) => gone(h),
            Holders::Many(v) => {
                v.retain(|h| !gone(h));
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
    routed_ms: i64,
    /// Meaningful once unpinned.
    expires_ms: i64,
    blocks: Arc<[BlockHash]>,
    origin: Origin,
    /// The request pinning it, while in flight.
    request: Option<u64>,
}

/// Counts of what happened to pending chains since start.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PendingCounts {
    /// Chains recorded by this replica's decisions.
    pub recorded_local: u64,
    /// Chains recorded from peer replicas.
    pub recorded_peer: u64,
    /// Chains whose life ended while the pod's index held their last block.
    pub confirmed: u64,
    /// Chains whose life ended without the pod's events confirming them: dropped.
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
    /// Chains by sequence number (recording order).
    chains: hashbrown::HashMap<u64, Chain>,
    next_seq: u64,
    /// `(expiry, seq)` of unpinned chains, soonest first (stale pairs are skipped).
    expiry: BinaryHeap<Reverse<(i64, u64)>>,
    /// `(origin, request)` → seq of pinned chains.
    pinned: hashbrown::HashMap<(Origin, u64), u64>,
    /// Recording order, for the size cap (seqs of chains already gone are skipped).
    order: VecDeque<u64>,
    /// Σ chain lengths (entries, counting a block on two pods twice).
    held: usize,
    counts: PendingCounts,
    /// The requests in flight not yet seen confirmed, sorted by [`Prefill::key`], as of the last
    /// [`PendingTable::prefilling`]; an entry ended since is flagged, not yet removed.
    listed: Vec<Prefill>,
    /// Requests recorded since, not yet evaluated (in recording order).
    added: Vec<Prefill>,
    /// Scratch for merging `added` into `listed`.
    staged: Vec<Prefill>,
    /// By pod index: `listed`'s run for the pod and its blocks left in all, empty for a pod whose
    /// requests do not count ([`Events::Silent`]).
    runs: Vec<PodRun>,
    /// The index snapshot `listed` was last brought up to date with.
    stamp: IndexStamp,
    /// Something changed since (a request recorded or ended, an event state): the next
    /// [`PendingTable::prefilling`] must look even if the index did not change.
    dirty: bool,
    /// By pod index: what the pod's KV events have shown of the chains routed to it.
    confirms: Vec<Events>,
}

/// A request in flight whose chain the pod's index did not hold whole when last looked at: still
/// queued or being prefilled (see [`PendingTable::prefilling`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefill {
    /// When it was routed (Unix ms).
    pub routed_ms: i64,
    seq: u64,
    /// The index generation `left` was read at ([`NOT_READ`] before the first look).
    read_at: u64,
    pub pod: PodIdx,
    /// Blocks of its chain from the first one the pod's index does not hold: the prefill work
    /// still ahead (a prefill computes a prompt's blocks in order, and KV events store them
    /// chunk by chunk).
    pub left: u32,
    end: End,
}

/// [`Prefill::read_at`] of an entry not yet read.
const NOT_READ: u64 = u64::MAX;

/// What happened to a listed request since the last look.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    InFlight,
    /// It ended: the next look counts its chain confirmed or its pod silent.
    Released,
    /// Its chain left the table (evicted, or expired after ending): it goes without a verdict.
    Gone,
}

impl Prefill {
    /// The listing order: by pod, then routing time, then recording order.
    fn key(&self) -> (PodIdx, i64, u64) {
        (self.pod, self.routed_ms, self.seq)
    }
}

/// One pod's requests still prefilling: `listed[start..end]`, and their blocks left in all.
#[derive(Clone, Copy, Debug, Default)]
struct PodRun {
    start: u32,
    end: u32,
    left: u32,
}

/// What a pod's KV events have shown of the chains routed to it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
enum Events {
    /// Nothing yet: its requests count as prefilling until they end.
    #[default]
    Unknown,
    /// A request ended before its chain was confirmed, none ever was: the pod publishes no
    /// events (prefix caching off, or no publisher), so its requests would read as prefilling
    /// for their whole life; they do not count.
    Silent,
    /// A routed chain was confirmed (for good: silence after that is evictions).
    Confirmed,
}

impl PendingTable {
    /// An empty table whose chains live `ttl_ms` and hold at most `max_blocks` entries in all.
    pub fn new(ttl_ms: u64, max_blocks: usize) -> Self {
        PendingTable {
            ttl_ms: i64::try_from(ttl_ms).unwrap_or(i64::MAX / 4),
            max_blocks,
            holders: hashbrown::HashMap::default(),
            chains: hashbrown::HashMap::new(),
            next_seq: 0,
            expiry: BinaryHeap::new(),
            pinned: hashbrown::HashMap::new(),
            order: VecDeque::new(),
            held: 0,
            counts: PendingCounts::default(),
            listed: Vec::new(),
            added: Vec::new(),
            staged: Vec::new(),
            runs: Vec::new(),
            stamp: IndexStamp::default(),
            dirty: false,
            confirms: Vec::new(),
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
        h.pins > 0 || (now_ms < h.expires_ms && h.expires_ms <= now_ms.saturating_add(self.ttl_ms))
    }

    /// Ends the unpinned chains whose life ended by `now_ms`, counting each as confirmed when
    /// `index` holds its last block on its pod, else as expired.
    pub fn purge(&mut self, now_ms: i64, index: &IndexSnapshot) {
        while let Some(&Reverse((at, seq))) = self.expiry.peek() {
            // A clock that went back leaves an expiry far ahead: dead as well.
            if at > now_ms && at <= now_ms.saturating_add(self.ttl_ms) {
                break;
            }
            self.expiry.pop();
            let current = self.chains.get(&seq).is_some_and(|c| c.request.is_none() && c.expires_ms == at);
            if !current {
                continue;
            }
            let Some(c) = self.chains.remove(&seq) else { continue };
            let confirmed = c.blocks.last().is_some_and(|last| index.pods_of(*last).contains(&c.pod));
            if confirmed {
                self.counts.confirmed += 1;
                self.mark(c.pod, Events::Confirmed);
            } else {
                self.counts.expired += 1;
                self.mark(c.pod, Events::Silent);
            }
            self.end_listed(&c, seq, End::Gone);
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

    /// Records `blocks` (a chain from some pod's frontier on) as pending on `pod`, routed at
    /// `now_ms`: pinned by `request` (unique per `origin`) until [`PendingTable::release`], or,
    /// without a request, for `ttl`. Evicts the oldest chains beyond `max_blocks`.
    pub fn record(&mut self, pod: PodIdx, blocks: Arc<[BlockHash]>, now_ms: i64, origin: Origin, request: Option<u64>) {
        if !self.enabled() || blocks.is_empty() {
            return;
        }
        if let Some(id) = request
            && self.pinned.contains_key(&(origin, id))
        {
            return;
        }
        let expires_ms = now_ms.saturating_add(self.ttl_ms);
        for b in blocks.iter() {
            match self.holders.entry(b.0) {
                hashbrown::hash_map::Entry::Occupied(mut e) => e.get_mut().upsert(pod, expires_ms, request.is_some()),
                hashbrown::hash_map::Entry::Vacant(e) => {
                    e.insert(Holders::One(Holder { pod, expires_ms, pins: u32::from(request.is_some()) }));
                }
            }
        }
        self.held += blocks.len();
        if origin == LOCAL {
            self.counts.recorded_local += 1;
        } else {
            self.counts.recorded_peer += 1;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        match request {
            Some(id) => {
                self.pinned.insert((origin, id), seq);
                self.added.push(Prefill {
                    routed_ms: now_ms,
                    seq,
                    read_at: NOT_READ,
                    pod,
                    left: 0,
                    end: End::InFlight,
                });
                self.dirty = true;
            }
            None => self.expiry.push(Reverse((expires_ms, seq))),
        }
        self.chains.insert(seq, Chain { pod, routed_ms: now_ms, expires_ms, blocks, origin, request });
        self.order.push_back(seq);
        while self.held > self.max_blocks {
            let Some(old) = self.order.pop_front() else { break };
            let Some(c) = self.chains.remove(&old) else { continue };
            if let Some(id) = c.request {
                self.pinned.remove(&(c.origin, id));
                self.unpin(&c);
            }
            self.counts.evicted += 1;
            self.end_listed(&c, old, End::Gone);
            self.unlink(&c);
        }
        if self.order.len() > 2 * self.chains.len() + 64 {
            let chains = &self.chains;
            self.order.retain(|s| chains.contains_key(s));
        }
        if self.added.len() > 2 * self.chains.len() + 64 {
            // No look in a while (approximate mode does not list): keep it bounded.
            self.added.retain(|e| e.end != End::Gone);
        }
    }

    fn unpin(&mut self, c: &Chain) {
        for b in c.blocks.iter() {
            if let Some(h) = self.holders.get_mut(&b.0).and_then(|h| h.find_mut(c.pod)) {
                h.pins = h.pins.saturating_sub(1);
                h.expires_ms = h.expires_ms.max(c.expires_ms);
            }
        }
    }

    /// `origin`'s request `request` ended at `now_ms`: its chain lives on until `ttl` after its
    /// routing (it may already be over). Unknown requests are ignored.
    pub fn release(&mut self, origin: Origin, request: u64, now_ms: i64) {
        let Some(seq) = self.pinned.remove(&(origin, request)) else { return };
        let Some(c) = self.chains.get_mut(&seq) else { return };
        c.request = None;
        c.expires_ms = c.routed_ms.saturating_add(self.ttl_ms).max(now_ms);
        let at = c.expires_ms;
        let (pod, routed_ms, blocks) = (c.pod, c.routed_ms, c.blocks.clone());
        self.end_at((pod, routed_ms, seq), End::Released);
        for b in blocks.iter() {
            if let Some(h) = self.holders.get_mut(&b.0).and_then(|h| h.find_mut(pod)) {
                h.pins = h.pins.saturating_sub(1);
                h.expires_ms = h.expires_ms.max(at);
            }
        }
        self.expiry.push(Reverse((at, seq)));
    }

    /// Releases every request of `origin` (its stream ended: no end will come) at `now_ms`.
    pub fn release_origin(&mut self, origin: Origin, now_ms: i64) {
        let ids: Vec<u64> = self.pinned.keys().filter(|(o, _)| *o == origin).map(|(_, id)| *id).collect();
        for id in ids {
            self.release(origin, id, now_ms);
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

    /// docs/design.md §4 queueDepth: brings up to date, against `index`, the list of requests in
    /// flight whose chain's last block the pod's index does not hold yet, i.e. still queued or
    /// being prefilled, each with its blocks left ([`Prefill::left`]); read it per pod with
    /// [`PendingTable::prefilling_on`]. A pod whose KV events have confirmed no routed chain yet
    /// and one of whose requests ended unconfirmed does not count: its events never come (prefix
    /// caching off), and it would otherwise read as queued for each request's whole life.
    ///
    /// Incremental (docs/design.md §4 "Decision speed"): a request's blocks left depend only on
    /// its own pod's blocks, so it is read again only when the snapshot says that pod's blocks
    /// changed since it was read ([`crate::index::PodChanges`]). Nothing changed (same snapshot,
    /// no request recorded or ended, no pod's event state changed): no work. Otherwise one pass
    /// over the list, an index read per request whose pod changed (a lookup, and a binary search
    /// of its chain), and a merge of the requests recorded since. A request leaves for good once
    /// its chain is confirmed, or it ends or its chain is evicted.
    pub fn prefilling(&mut self, index: &IndexSnapshot) {
        let changes = index.changes();
        let stamp = changes.stamp();
        if !self.dirty && stamp == self.stamp {
            return;
        }
        let same_writer = stamp.writer == self.stamp.writer;
        let mut reread = false;
        let (chains, confirms) = (&self.chains, &mut self.confirms);
        // One request's look: false when it leaves the list.
        let mut look = |e: &mut Prefill| -> bool {
            if e.end == End::Gone {
                return false;
            }
            let current = same_writer
                && e.read_at != NOT_READ
                && changes.unchanged_since(e.pod, IndexStamp { writer: stamp.writer, generation: e.read_at });
            if !current {
                let Some(c) = chains.get(&e.seq) else { return false };
                let done = c.blocks.last().is_none_or(|last| index.pods_of(*last).contains(&c.pod));
                if done {
                    mark(confirms, e.pod, Events::Confirmed);
                    return false;
                }
                let held = c.blocks.partition_point(|b| index.pods_of(*b).contains(&c.pod));
                e.left = u32::try_from(c.blocks.len().saturating_sub(held)).unwrap_or(u32::MAX);
                e.read_at = stamp.generation;
                reread = true;
            }
            if e.end == End::Released {
                // Ended before its prompt showed in the pod's events.
                mark(confirms, e.pod, Events::Silent);
                return false;
            }
            true
        };
        let before = self.listed.len();
        self.listed.retain_mut(&mut look);
        self.staged.clear();
        self.staged.extend(self.added.drain(..).filter_map(|mut e| look(&mut e).then_some(e)));
        let changed = reread || self.dirty || self.listed.len() != before || !self.staged.is_empty();
        if !self.staged.is_empty() {
            self.staged.sort_unstable_by_key(Prefill::key);
            merge_sorted(&mut self.listed, &self.staged);
        }
        if changed {
            self.index_runs();
        }
        self.stamp = stamp;
        self.dirty = false;
    }

    /// Rebuilds `runs` from `listed`, leaving silent pods out.
    fn index_runs(&mut self) {
        self.runs.clear();
        let mut at = 0;
        while let Some(first) = self.listed.get(at) {
            let pod = first.pod;
            // A few requests per pod: a scan beats a binary search of the rest of the list.
            let len = self.listed[at..].iter().take_while(|e| e.pod == pod).count();
            let i = pod.as_usize();
            if self.runs.len() <= i {
                self.runs.resize(i + 1, PodRun::default());
            }
            if events(&self.confirms, pod) != Events::Silent {
                let left = self.listed[at..at + len].iter().fold(0u32, |n, e| n.saturating_add(e.left));
                let (start, end) = (u32::try_from(at).unwrap_or(u32::MAX), u32::try_from(at + len).unwrap_or(u32::MAX));
                self.runs[i] = PodRun { start, end, left };
            }
            at += len;
        }
    }

    /// `pod`'s requests still prefilling (by routing time, then recording order) and their
    /// blocks left in all, as of the last [`PendingTable::prefilling`]: empty for a pod whose
    /// events never came.
    pub fn prefilling_on(&self, pod: PodIdx) -> (&[Prefill], u32) {
        match self.runs.get(pod.as_usize()) {
            Some(r) => (self.listed.get(r.start as usize..r.end as usize).unwrap_or(&[]), r.left),
            None => (&[], 0),
        }
    }

    /// Flags the listed request of chain `c` (`seq`) with `end`, if it is listed.
    fn end_listed(&mut self, c: &Chain, seq: u64, end: End) {
        self.end_at((c.pod, c.routed_ms, seq), end);
    }

    /// Flags the listed request keyed `key` ([`Prefill::key`]) with `end`, if it is listed.
    fn end_at(&mut self, key: (PodIdx, i64, u64), end: End) {
        // `added` is in recording order, so sorted by seq too.
        let entry = match self.listed.binary_search_by_key(&key, Prefill::key) {
            Ok(i) => self.listed.get_mut(i),
            Err(_) => self.added.binary_search_by_key(&key.2, |e| e.seq).ok().and_then(|i| self.added.get_mut(i)),
        };
        if let Some(e) = entry
            && e.end != End::Gone
        {
            e.end = end;
            self.dirty = true;
        }
    }

    /// Records what `pod`'s KV events showed (see [`mark`]); a change is for the next look.
    fn mark(&mut self, pod: PodIdx, seen: Events) {
        let was = events(&self.confirms, pod);
        mark(&mut self.confirms, pod, seen);
        self.dirty |= events(&self.confirms, pod) != was;
    }

    /// Whether [`PendingTable::prefilling`] leaves `pod`'s requests out (its events never came
    /// for one), so that the work read for it is short.
    pub fn silent(&self, pod: PodIdx) -> bool {
        events(&self.confirms, pod) == Events::Silent
    }

    /// Every chain held, in no particular order: `(pod, blocks, origin)` (a peer's snapshot).
    pub fn chains(&self) -> impl Iterator<Item = (PodIdx, &Arc<[BlockHash]>, Origin)> {
        self.chains.values().map(|c| (c.pod, &c.blocks, c.origin))
    }
}

/// Records in `confirms` (by pod index) what `pod`'s KV events showed, never going back from
/// [`Events::Confirmed`].
fn mark(confirms: &mut Vec<Events>, pod: PodIdx, seen: Events) {
    let i = usize::from(pod.0);
    if confirms.len() <= i {
        confirms.resize(i + 1, Events::Unknown);
    }
    confirms[i] = confirms[i].max(seen);
}

fn events(confirms: &[Events], pod: PodIdx) -> Events {
    confirms.get(usize::from(pod.0)).copied().unwrap_or_default()
}

/// Merges `staged` (sorted by [`Prefill::key`]) into `listed` (sorted), in place, from the back:
/// each entry moves at most once, and those before the first insertion point not at all.
fn merge_sorted(listed: &mut Vec<Prefill>, staged: &[Prefill]) {
    let old = listed.len();
    listed.extend_from_slice(staged);
    let (mut i, mut j, mut w) = (old, staged.len(), old + staged.len());
    while j > 0 {
        w -= 1;
        if i > 0 && listed[i - 1].key() > staged[j - 1].key() {
            i -= 1;
            listed[w] = listed[i];
        } else {
            j -= 1;
            listed[w] = staged[j];
        }
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

    /// Brings `t`'s prefilling list up to date with `index` and reads it back for pods 0 to 7,
    /// as `(pod, routed_ms, blocks left)`; checks each pod's total of blocks left on the way.
    fn listed(t: &mut PendingTable, index: &IndexSnapshot) -> Vec<(PodIdx, i64, u32)> {
        t.prefilling(index);
        let mut out = Vec::new();
        for pod in (0..8).map(PodIdx) {
            let (run, left) = t.prefilling_on(pod);
            assert_eq!(left, run.iter().map(|p| p.left).sum::<u32>(), "{pod:?}'s blocks left");
            out.extend(run.iter().map(|p| (p.pod, p.routed_ms, p.left)));
        }
        out
    }

    #[test]
    fn a_recorded_chain_extends_the_pod_from_its_frontier_until_it_expires() {
        let c = chain(1, 10);
        let mut t = PendingTable::new(2000, 1000);
        // A's index held 4 blocks when the request was routed: blocks 4.. are pending.
        t.record(A, arc(&c[4..]), 1000, LOCAL, None);
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
        t.record(A, arc(&c), 0, LOCAL, None);
        t.record(B, arc(&c[..3]), 100, 7, None);
        t.record(A, arc(&c[..3]), 500, LOCAL, None);
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
        t.record(A, arc(&c1), 0, LOCAL, None);
        t.record(B, arc(&c2), 1, LOCAL, None);
        assert_eq!(t.counts().evicted, 1);
        assert_eq!(t.size(), (6, 1));
        assert_eq!(ext(&t, &c1, 2, &[(A, 0)]), vec![0]);
        assert_eq!(ext(&t, &c2, 2, &[(B, 0)]), vec![6]);
    }

    #[test]
    fn a_clock_that_jumps_back_cannot_keep_an_entry_alive() {
        let c = chain(1, 4);
        let mut t = PendingTable::new(2000, 100);
        t.record(A, arc(&c), 1_000_000, LOCAL, None);
        assert_eq!(ext(&t, &c, 1_000_100, &[(A, 0)]), vec![4]);
        assert_eq!(ext(&t, &c, 10, &[(A, 0)]), vec![0]);
        t.purge(10, &IndexSnapshot::default());
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn requests_count_as_prefilling_until_the_index_holds_their_last_block() {
        use crate::index::IndexWriter;
        let (c1, c2, c3) = (chain(1, 5), chain(100, 5), chain(200, 5));
        let mut t = PendingTable::new(1000, 100);
        t.record(B, arc(&c1), 30, LOCAL, Some(1));
        t.record(A, arc(&c2), 20, LOCAL, Some(2));
        t.record(A, arc(&c3), 10, 4, Some(1));
        // A chain without a request (a peer's snapshot) is no request in flight.
        t.record(B, arc(&chain(300, 5)), 40, LOCAL, None);
        let published = Arc::new(arc_swap::ArcSwap::from_pointee(IndexSnapshot::default()));
        let mut w = IndexWriter::new(published.clone(), 100);
        // Before a pod's KV events show anything, its requests count.
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (A, 20, 5), (B, 30, 5)]);
        let (a0, b0) = (chain(400, 2), chain(500, 2));
        t.record(A, arc(&a0), 5, LOCAL, Some(7));
        t.record(B, arc(&b0), 6, LOCAL, Some(8));
        w.store(A, &a0);
        w.store(B, &b0);
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (A, 20, 5), (B, 30, 5)]);
        // A's events hold all of c2 but the last block: still prefilling, one block left; then
        // all of it.
        w.store(A, &c2[..4]);
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (A, 20, 1), (B, 30, 5)]);
        w.store(A, &c2);
        // c3's blocks on another pod confirm nothing on A.
        w.store(B, &c3);
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (B, 30, 5)]);
        // Confirmed once is confirmed for good (evicting the blocks later does not bring it back).
        w.remove(A, &c2);
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (B, 30, 5)]);
        // A request that ends is no longer prefilling, confirmed or not.
        t.release(LOCAL, 1, 50);
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5)]);
        // A pod with no confirmation whose request ended unconfirmed publishes no events: its
        // requests stop counting (they would read as queued for their whole life)...
        const C: PodIdx = PodIdx(2);
        t.record(C, arc(&chain(600, 3)), 60, LOCAL, Some(20));
        t.record(C, arc(&chain(700, 3)), 61, LOCAL, Some(21));
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (C, 60, 3), (C, 61, 3)]);
        t.release(LOCAL, 20, 70);
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5)]);
        assert!(t.silent(C) && !t.silent(A) && !t.silent(PodIdx(3)));
        // ...until one of its chains is confirmed after all.
        w.store(C, &chain(700, 3));
        w.publish();
        t.record(C, arc(&chain(800, 3)), 80, LOCAL, Some(22));
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 10, 5), (C, 80, 3)]);
        assert!(!t.silent(C));
    }

    #[test]
    fn a_request_pins_its_chain_until_it_ends() {
        let c = chain(1, 5);
        let mut t = PendingTable::new(1000, 100);
        t.record(A, arc(&c), 0, LOCAL, Some(9));
        // Long past the time-to-live, still in flight: still pending.
        t.purge(60_000, &IndexSnapshot::default());
        assert_eq!(ext(&t, &c, 60_000, &[(A, 0)]), vec![5]);
        // Ends: it goes at once (its time-to-live from routing is long over).
        t.release(LOCAL, 9, 60_000);
        assert_eq!(ext(&t, &c, 60_001, &[(A, 0)]), vec![0]);
        t.purge(60_001, &IndexSnapshot::default());
        assert_eq!(t.size(), (0, 0));
        // A request that ends early keeps its chain for the rest of the time-to-live.
        t.record(B, arc(&c), 100_000, 3, Some(1));
        t.release(3, 1, 100_200);
        t.purge(100_500, &IndexSnapshot::default());
        assert_eq!(ext(&t, &c, 100_500, &[(B, 0)]), vec![5]);
        t.purge(101_000, &IndexSnapshot::default());
        assert_eq!(ext(&t, &c, 101_000, &[(B, 0)]), vec![0]);
        assert_eq!(t.counts().expired, 2);
        // A peer that goes away releases its requests.
        t.record(B, arc(&c), 200_000, 4, Some(1));
        t.release_origin(4, 200_000);
        t.purge(201_000, &IndexSnapshot::default());
        assert_eq!(t.size(), (0, 0));
    }

    #[test]
    fn a_zero_ttl_disables_the_table() {
        let c = chain(1, 4);
        let mut t = PendingTable::new(0, 100);
        t.record(A, arc(&c), 0, LOCAL, None);
        assert!(!t.enabled());
        assert_eq!(ext(&t, &c, 0, &[(A, 0)]), vec![0]);
    }

    /// A pod found silent between looks (a peer's chain expired unconfirmed) drops out of the
    /// next look though nothing else changed, and comes back once a chain of its is confirmed.
    #[test]
    fn a_pod_found_silent_between_looks_stops_counting_at_the_next() {
        use crate::index::IndexWriter;
        let published = Arc::new(arc_swap::ArcSwap::from_pointee(IndexSnapshot::default()));
        let mut w = IndexWriter::new(published.clone(), 100);
        let mut t = PendingTable::new(100, 100);
        t.record(A, arc(&chain(1, 3)), 0, LOCAL, Some(1));
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 0, 3)]);
        t.record(A, arc(&chain(50, 2)), 0, 9, None);
        t.purge(200, &published.load());
        assert!(t.silent(A));
        assert_eq!(listed(&mut t, &published.load()), vec![]);
        t.record(A, arc(&chain(60, 2)), 210, LOCAL, Some(2));
        w.store(A, &chain(1, 2));
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![]);
        w.store(A, &chain(60, 2));
        w.publish();
        assert_eq!(listed(&mut t, &published.load()), vec![(A, 0, 1)]);
    }

    /// The list as it was first computed, from scratch at every look: every pinned chain not yet
    /// seen confirmed, read against the whole index; the reference for the incremental list.
    struct Rebuilt {
        unconfirmed: Vec<u64>,
    }

    impl Rebuilt {
        fn look(
            &mut self,
            t: &PendingTable,
            confirms: &mut Vec<Events>,
            index: &IndexSnapshot,
        ) -> Vec<(PodIdx, i64, u32)> {
            let chains = &t.chains;
            self.unconfirmed.retain(|seq| {
                let Some(c) = chains.get(seq) else { return false };
                let done = c.blocks.last().is_none_or(|last| index.pods_of(*last).contains(&c.pod));
                if done {
                    mark(confirms, c.pod, Events::Confirmed);
                } else if c.request.is_none() {
                    mark(confirms, c.pod, Events::Silent);
                }
                !done && c.request.is_some()
            });
            let mut out: Vec<(PodIdx, i64, u32)> = self
                .unconfirmed
                .iter()
                .filter_map(|seq| {
                    let c = chains.get(seq)?;
                    let held = c.blocks.partition_point(|b| index.pods_of(*b).contains(&c.pod));
                    let left = u32::try_from(c.blocks.len() - held).unwrap_or(u32::MAX);
                    (events(confirms, c.pod) != Events::Silent).then_some((c.pod, c.routed_ms, left))
                })
                .collect();
            out.sort_unstable();
            out
        }
    }

    /// Random recordings, ends, expiries, evictions and index changes (stores, partial stores,
    /// removals, clears; published or not) between looks: at every look the incremental list,
    /// each pod's total and every pod's event state equal those rebuilt from scratch.
    #[test]
    fn the_incremental_list_equals_one_rebuilt_at_every_look() {
        use crate::index::IndexWriter;
        for seed in 1..=20u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut rand = move |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let published = Arc::new(arc_swap::ArcSwap::from_pointee(IndexSnapshot::default()));
            let mut w = IndexWriter::new(published.clone(), 1000);
            let mut t = PendingTable::new(40, 120);
            let mut reference = Rebuilt { unconfirmed: Vec::new() };
            let (mut now, mut next_id, mut in_flight) = (0i64, 0u64, Vec::<(u64, PodIdx, Vec<BlockHash>)>::new());
            let (mut looks, mut listed_seen) = (0, 0);
            for _ in 0..600 {
                now += rand(4) as i64;
                match rand(100) {
                    0..=29 => {
                        let pod = PodIdx(rand(4) as u16);
                        let c = chain(rand(12) * 10, 1 + rand(8));
                        let seq = t.next_seq;
                        t.record(pod, arc(&c), now, LOCAL, Some(next_id));
                        if t.chains.contains_key(&seq) {
                            reference.unconfirmed.push(seq);
                        }
                        in_flight.push((next_id, pod, c));
                        next_id += 1;
                    }
                    30..=34 => t.record(PodIdx(rand(4) as u16), arc(&chain(rand(12) * 10, 4)), now, 7, None),
                    35..=49 if !in_flight.is_empty() => {
                        let (id, _, _) = in_flight.swap_remove(rand(in_flight.len() as u64) as usize);
                        t.release(LOCAL, id, now);
                    }
                    50..=69 if !in_flight.is_empty() => {
                        // The pod computes some or all of a routed prompt.
                        let (_, pod, c) = &in_flight[rand(in_flight.len() as u64) as usize];
                        let n = 1 + rand(c.len() as u64) as usize;
                        w.store(*pod, &c[..n]);
                    }
                    70..=76 => w.remove(PodIdx(rand(4) as u16), &chain(rand(12) * 10, 1 + rand(8))),
                    77 => w.clear_pod(PodIdx(rand(4) as u16)),
                    78..=84 => w.publish(),
                    85..=89 => t.purge(now, &published.load()),
                    _ => {
                        let index = published.load();
                        let mut confirms = t.confirms.clone();
                        let want = reference.look(&t, &mut confirms, &index);
                        let mut got = listed(&mut t, &index);
                        got.sort_unstable();
                        assert_eq!(got, want, "seed {seed} at {now} ms");
                        let pods = confirms.len().max(t.confirms.len());
                        for pod in (0..pods).map(|p| PodIdx(p as u16)) {
                            assert_eq!(events(&t.confirms, pod), events(&confirms, pod), "seed {seed}: {pod:?}");
                        }
                        looks += 1;
                        listed_seen += want.len();
                    }
                }
            }
            assert!(looks > 30 && listed_seen > 30, "seed {seed}: {looks} looks, {listed_seen} listed");
        }
    }
}
