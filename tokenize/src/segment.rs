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
//! Long pieces are also cut into chunks of about [`CHUNK_BYTES`] when the pre-tokenizer is one
//! whose splits are known (see [`Segmenter::new`]): a `/v1/completions` prompt is one piece, and
//! requests that share a long prefix but end in a new question would otherwise encode it all
//! again. A cut goes before a space that sits between an ASCII letter or digit and an ASCII letter
//! (`…word| word…`): with the Qwen2 pre-tokenizer regex a match ends at such a position in the
//! whole text and in the prefix alone (letter runs and single digits stop at the space; no
//! alternative matches a letter or digit followed by a space; the only lookahead, `\s+(?!\S)`,
//! belongs to whitespace runs that end before it; no anchors or lookbehind), ASCII
//! is unchanged by NFC and composes with nothing across a space, and byte-level BPE works word by
//! word: so ids(text) = ids(before) ++ ids(after). Cut positions depend only on the text up to
//! them (the first such position after every [`CHUNK_BYTES`] bytes), so equal prefixes give
//! equal chunks and hit the cache.
//!
//! Concurrency: the cache is split into shards, each a `parking_lot::Mutex` around a small LRU;
//! a key's shard comes from its hash, locks are held only for a lookup or an insert (never
//! while encoding), so concurrent misses of the same piece may both encode it (same result).
//! Bounded by bytes: key length + 4 bytes per id + a fixed overhead per entry.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use hashbrown::{DefaultHashBuilder, HashTable};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

/// Target size of the chunks a long text piece is cut into, in bytes, when cutting is exact.
pub const CHUNK_BYTES: usize = 256;

/// Pre-tokenizer regexes for which a cut before `[A-Za-z0-9]| [A-Za-z]` is exact (module docs).
/// Qwen2 / Qwen2.5 (checked against the fixture and random texts in the tests).
const CUTTABLE_SPLIT_REGEXES: &[&str] = &[
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

/// Finds the added tokens at which the tokenizer splits its input.
#[derive(Debug)]
pub struct Segmenter {
    matcher: AhoCorasick,
    /// Token id per pattern index of `matcher`.
    ids: Vec<u32>,
    /// Text pieces longer than this are cut into chunks (module docs); `None`: never cut.
    chunk_bytes: Option<usize>,
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
        let mut left_in_pieces = false;
        let mut added: Vec<_> = tokenizer.get_added_tokens_decoder().into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        for (id, token) in added {
            if token.normalized && has_normalizer {
                left_in_pieces = true;
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
        // A cut must not split an added token that the tokenizer itself matches inside a piece.
        let chunk_bytes = (!left_in_pieces && cuttable(tokenizer)).then_some(CHUNK_BYTES);
        Ok(Self { matcher, ids, chunk_bytes })
    }

    /// The same splitter with chunking set to `chunk_bytes` (tests use small chunks); chunking
    /// stays off for a tokenizer where it is not exact.
    pub fn with_chunk_bytes(mut self, chunk_bytes: usize) -> Self {
        self.chunk_bytes = self.chunk_bytes.map(|_| chunk_bytes.max(1));
        self
    }

    /// True when long pieces are cut into chunks.
    pub fn chunks(&self) -> bool {
        self.chunk_bytes.is_some()
    }

    /// Calls `f` for each piece of `text` in order; returns early with `f`'s error.
    pub fn for_each_piece<'a, E>(&self, text: &'a str, mut f: impl FnMut(Piece<'a>) -> Result<(), E>) -> Result<(), E> {
        let mut last = 0;
        for m in self.matcher.find_iter(text) {
            if m.start() > last {
                self.for_each_chunk(&text[last..m.start()], &mut f)?;
            }
            f(Piece::Added(self.ids[m.pattern().as_usize()]))?;
            last = m.end();
        }
        if last < text.len() {
            self.for_each_chunk(&text[last..], &mut f)?;
        }
        Ok(())
    }

    /// `f` for each chunk of a text piece: cut at the first exact cut position after every
    /// `chunk_bytes` bytes (module docs), or the piece whole when chunking is off.
    fn for_each_chunk<'a, E>(&self, text: &'a str, f: &mut impl FnMut(Piece<'a>) -> Result<(), E>) -> Result<(), E> {
        let Some(chunk) = self.chunk_bytes else { return f(Piece::Text(text)) };
        let bytes = text.as_bytes();
        let mut start = 0;
        while bytes.len() - start > chunk {
            // A cut at i: bytes[i] is a space, after an ASCII letter/digit, before an ASCII letter.
            // ASCII bytes never occur inside a multi-byte UTF-8 sequence: i is a char boundary.
            let Some(i) = (start + chunk..bytes.len() - 1).find(|&i| {
                bytes[i] == b' ' && bytes[i - 1].is_ascii_alphanumeric() && bytes[i + 1].is_ascii_alphabetic()
            }) else {
                break;
            };
            f(Piece::Text(&text[start..i]))?;
            start = i;
        }
        f(Piece::Text(&text[start..]))
    }
}

/// True when the tokenizer's pipeline is one for which the chunk cuts are exact: no normalizer or
/// NFC, pre-tokenizer `Sequence[Split(known regex, Isolated), ByteLevel(use_regex: false)]`, a BPE
/// model without dropout.
fn cuttable(tokenizer: &Tokenizer) -> bool {
    let json = |v: Option<serde_json::Value>| v.unwrap_or(serde_json::Value::Null);
    let normalizer = json(tokenizer.get_normalizer().and_then(|n| serde_json::to_value(n).ok()));
    let normalizer_ok = normalizer.is_null() || normalizer["type"] == "NFC";
    let pre = json(tokenizer.get_pre_tokenizer().and_then(|p| serde_json::to_value(p).ok()));
    let steps = pre["pretokenizers"].as_array();
    let pre_ok = pre["type"] == "Sequence"
        && steps.is_some_and(|s| {
            s.len() == 2
                && s[0]["type"] == "Split"
                && s[0]["behavior"] == "Isolated"
                && s[0]["invert"] == false
                && s[0]["pattern"]["Regex"].as_str().is_some_and(|r| CUTTABLE_SPLIT_REGEXES.contains(&r))
                && s[1]["type"] == "ByteLevel"
                && s[1]["use_regex"] == false
        });
    let model = json(serde_json::to_value(tokenizer.get_model()).ok());
    let model_ok = model["type"] == "BPE" && model["dropout"].is_null();
    normalizer_ok && pre_ok && model_ok
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
    /// foldhash (randomly seeded): a turn's pieces are hashed on every request, and SipHash over a
    /// 20 kB conversation cost ~10 µs of a decision.
    hasher: DefaultHashBuilder,
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
            hasher: DefaultHashBuilder::default(),
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
