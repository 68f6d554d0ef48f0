//! Segment cache: a conversation's token ids are the concatenation of its segments' ids.
//!
//! The `tokenizers` pipeline first splits the input at added tokens (`<|im_start|>`, ...) and
//! normalises, pre-tokenises and BPE-encodes each piece between them on its own. ChatML-style
//! templates put special tokens between messages, so every turn of a conversation re-encodes the
//! same pieces (system prompt, earlier messages). [`SegmentCache`] maps piece text → ids; only new
//! pieces pay for BPE.
//!
//! Exactness: [`Segmenter::new`] enables segmentation only when splitting reproduces the
//! library's own split: it matches every non-normalised added token leftmost-longest (as
//! `AddedVocabulary` does) and requires them all to be plain (no `lstrip`/`rstrip`/`single_word`,
//! which look across piece boundaries) and the pre-tokenizer not to depend on a piece's offset
//! (Metaspace `prepend_scheme: first`). The caller also checks a probe text at load time.
//!
//! Concurrency: the cache is split into shards, each a `parking_lot::Mutex` around a small LRU;
//! a key's shard comes from its hash, locks are held only for a lookup or an insert (never
//! while encoding), so concurrent misses of the same piece may both encode it (same result).
//! Bounded by bytes: key length + 4 bytes per id + a fixed overhead per entry.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use hashbrown::HashTable;
use parking_lot::Mutex;
use tokenizers::Tokenizer;

/// Finds the added tokens at which the tokenizer splits its input.
#[derive(Debug)]
pub struct Segmenter {
    matcher: AhoCorasick,
    /// Token id per pattern index of `matcher`.
    ids: Vec<u32>,
}

/// One piece of a text: an added token (its id) or the text between two of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// An added token, matched exactly.
    Added(u32),
    /// Text free of non-normalised added tokens.
    Text(&'a str),
}

impl Segmenter {
    /// Builds the splitter, or explains why this tokenizer cannot be split exactly.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, String> {
        if let Some(pre) = tokenizer.get_pre_tokenizer() {
            let json = serde_json::to_string(pre).unwrap_or_default();
            if json.contains("\"prepend_scheme\":\"first\"") {
                return Err("pre-tokenizer prepends only at offset 0 (Metaspace prepend_scheme=first)".into());
            }
        }
        let has_normalizer = tokenizer.get_normalizer().is_some();
        let mut patterns = Vec::new();
        let mut ids = Vec::new();
        let mut added: Vec<_> = tokenizer.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        for (id, token) in added {
            if token.normalized && has_normalizer {
                continue; // matched after normalisation, inside a piece, by the tokenizer itself
            }
            if token.content.is_empty() {
                continue;
            }
            if token.lstrip || token.rstrip || token.single_word {
                return Err(format!("added token {:?} strips or needs word boundaries", token.content));
            }
            patterns.push(token.content);
            ids.push(id);
        }
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .map_err(|e| format!("cannot build the added-token matcher: {e}"))?;
        Ok(Self { matcher, ids })
    }

    /// Calls `f` for each piece of `text` in order; returns early with `f`'s error.
    pub fn for_each_piece<'a, E>(&self, text: &'a str, mut f: impl FnMut(Piece<'a>) -> Result<(), E>) -> Result<(), E> {
        let mut last = 0;
        for m in self.matcher.find_iter(text) {
            if m.start() > last {
                f(Piece::Text(&text[last..m.start()]))?;
            }
            f(Piece::Added(self.ids[m.pattern().as_usize()]))?;
            last = m.end();
        }
        if last < text.len() {
            f(Piece::Text(&text[last..]))?;
        }
        Ok(())
    }
}

/// Sizing of a [`SegmentCache`].
#[derive(Debug, Clone, Copy)]
pub struct SegmentCacheConfig {
    /// Total budget in bytes (text + 4 bytes per id + ~96 bytes per entry); 0 disables the cache.
    /// Default 64 MiB.
    pub max_bytes: usize,
    /// Number of independently locked shards (rounded up to a power of two). Default 16.
    pub shards: usize,
}

impl Default for SegmentCacheConfig {
    fn default() -> Self {
        Self { max_bytes: 64 << 20, shards: 16 }
    }
}

/// Counters of a [`SegmentCache`] since it was created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Pieces whose ids came from the cache.
    pub hits: u64,
    /// Pieces that had to be encoded.
    pub misses: u64,
    /// Entries evicted to stay within `max_bytes`.
    pub evictions: u64,
}

const ENTRY_OVERHEAD: usize = 96;
const NIL: usize = usize::MAX;

/// Bounded, sharded, thread-safe LRU map from piece text to its token ids.
#[derive(Debug)]
pub struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    hash: u64,
    key: Box<str>,
    ids: Arc<[u32]>,
    prev: usize,
    next: usize,
}

/// One LRU: a hash table of slot indices and a doubly linked recency list over `slots`.
#[derive(Debug)]
struct Shard {
    table: HashTable<usize>,
    slots: Vec<Entry>,
    free: Vec<usize>,
    /// Most recently used.
    head: usize,
    /// Least recently used.
    tail: usize,
    bytes: usize,
    max_bytes: usize,
}

impl SegmentCache {
    /// An empty cache with the given budget.
    pub fn new(config: SegmentCacheConfig) -> Self {
        let n = config.shards.max(1).next_power_of_two();
        let per_shard = config.max_bytes / n;
        let shards = (0..n)
            .map(|_| {
                Mutex::new(Shard {
                    table: HashTable::new(),
                    slots: Vec::new(),
                    free: Vec::new(),
                    head: NIL,
                    tail: NIL,
                    bytes: 0,
                    max_bytes: per_shard,
                })
            })
            .collect();
        Self {
            shards,
            hasher: RandomState::new(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// Ids of `key`, from the cache or from `encode` (whose result is then cached).
    pub fn get_or_encode<E>(
        &self,
        key: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        let hash = self.hasher.hash_one(key);
        let shard = &self.shards[(hash as usize) & (self.shards.len() - 1)];
        if let Some(ids) = shard.lock().get(hash, key) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Ok(ids);
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let ids: Arc<[u32]> = encode(key)?.into();
        let evicted = shard.lock().insert(hash, key, ids.clone());
        if evicted > 0 {
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
        }
        Ok(ids)
    }

    /// Hit/miss/eviction counters.
    pub fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
        }
    }

    /// Bytes currently accounted to entries, over all shards.
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }
}

fn entry_bytes(key: &str, ids: &[u32]) -> usize {
    key.len() + 4 * ids.len() + ENTRY_OVERHEAD
}

impl Shard {
    fn get(&mut self, hash: u64, key: &str) -> Option<Arc<[u32]>> {
        let slots = &self.slots;
        let idx = *self.table.find(hash, |&i| &*slots[i].key == key)?;
        self.touch(idx);
        Some(self.slots[idx].ids.clone())
    }

    /// Inserts (or refreshes) an entry and evicts from the LRU end; returns how many were evicted.
    fn insert(&mut self, hash: u64, key: &str, ids: Arc<[u32]>) -> u64 {
        let size = entry_bytes(key, &ids);
        if size > self.max_bytes {
            return 0; // larger than the whole shard: not cached
        }
        let slots = &self.slots;
        if let Some(&idx) = self.table.find(hash, |&i| &*slots[i].key == key) {
            self.touch(idx); // another thread inserted it meanwhile
            return 0;
        }
        let mut evicted = 0;
        while self.bytes + size > self.max_bytes && self.tail != NIL {
            self.remove(self.tail);
            evicted += 1;
        }
        let entry = Entry { hash, key: key.into(), ids, prev: NIL, next: NIL };
        let idx = match self.free.pop() {
            Some(i) => {
                self.slots[i] = entry;
                i
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        };
        let slots = &self.slots;
        self.table.insert_unique(hash, idx, |&i| slots[i].hash);
        self.push_front(idx);
        self.bytes += size;
        evicted
    }

    fn remove(&mut self, idx: usize) {
        self.unlink(idx);
        let hash = self.slots[idx].hash;
        if let Ok(found) = self.table.find_entry(hash, |&i| i == idx) {
            found.remove();
        }
        let entry = &mut self.slots[idx];
        self.bytes -= entry_bytes(&entry.key, &entry.ids);
        entry.key = Box::from("");
        entry.ids = Arc::from([]);
        self.free.push(idx);
    }

    fn touch(&mut self, idx: usize) {
        if self.head != idx {
            self.unlink(idx);
            self.push_front(idx);
        }
    }

    fn unlink(&mut self, idx: usize) {
        let (prev, next) = (self.slots[idx].prev, self.slots[idx].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next].prev = prev;
        }
        self.slots[idx].prev = NIL;
        self.slots[idx].next = NIL;
    }

    fn push_front(&mut self, idx: usize) {
        self.slots[idx].next = self.head;
        self.slots[idx].prev = NIL;
        if self.head != NIL {
            self.slots[self.head].prev = idx;
        }
        self.head = idx;
        if self.tail == NIL {
            self.tail = idx;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn fake_encode(s: &str) -> Result<Vec<u32>, ()> {
        Ok(s.bytes().map(u32::from).collect())
    }

    #[test]
    fn lru_evicts_least_recent_within_budget() {
        // One shard; each 1-byte entry costs 1 + 4 + overhead bytes; budget for exactly 3.
        let per = entry_bytes("a", &[0]);
        let cache = SegmentCache::new(SegmentCacheConfig { max_bytes: 3 * per, shards: 1 });
        for k in ["a", "b", "c"] {
            cache.get_or_encode(k, fake_encode).unwrap();
        }
        cache.get_or_encode("a", fake_encode).unwrap(); // a is now most recent; b is the LRU
        cache.get_or_encode("d", fake_encode).unwrap(); // evicts b
        assert_eq!(cache.stats(), SegmentCacheStats { hits: 1, misses: 4, evictions: 1 });
        let mut encoded = Vec::new();
        for k in ["a", "c", "d", "b"] {
            cache
                .get_or_encode(k, |s| {
                    encoded.push(s.to_owned());
                    fake_encode(s)
                })
                .unwrap();
        }
        assert_eq!(encoded, vec!["b".to_owned()], "only the evicted key is re-encoded");
        assert!(cache.bytes() <= 3 * per);
    }

    #[test]
    fn oversized_entries_are_not_cached_and_errors_pass_through() {
        let cache = SegmentCache::new(SegmentCacheConfig { max_bytes: 200, shards: 1 });
        let big = "x".repeat(500);
        assert_eq!(cache.get_or_encode(&big, fake_encode).unwrap().len(), 500);
        assert_eq!(cache.bytes(), 0);
        assert_eq!(cache.get_or_encode("e", |_| Err::<Vec<u32>, _>("boom")).unwrap_err(), "boom");
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn many_keys_stay_consistent() {
        let cache = SegmentCache::new(SegmentCacheConfig { max_bytes: 50 * entry_bytes("k000", &[0; 4]), shards: 4 });
        for round in 0..3 {
            for i in 0..200 {
                let k = format!("k{i:03}");
                let ids = cache.get_or_encode(&k, fake_encode).unwrap();
                assert_eq!(&*ids, &fake_encode(&k).unwrap()[..], "round {round} key {k}");
            }
        }
        assert!(cache.bytes() <= 50 * entry_bytes("k000", &[0; 4]));
        assert!(cache.stats().evictions > 0);
    }
}
