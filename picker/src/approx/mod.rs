//! Approximate mode (docs/design.md §6): prefix-aware routing without a tokenizer and without KV events.
//!
//! The prompt *text* is cut into blocks of `block_chars` characters (Unicode scalar values, so a
//! multi-byte character is never split) and chained with the same XXH3 block hash as the precise
//! path ([`kvroute_common::hash::hash_block`] over the block's code points), rooted per (target
//! model, adapter) and separated from token chains by a domain tag ([`TextHasher`]). The picker
//! cannot see what the engines cache, so it remembers where each chain was routed: every decision
//! records the chosen pod as holding the request's chain ([`ApproxStore`], LRU-bounded per pod).
//! The next request's chain is matched against that record exactly like the precise index
//! (consecutive blocks from the first). This is the Gateway API Inference Extension's "estimated
//! prefix cache" (its `prefix-cache-scorer` plugin).
//!
//! Defaults follow GIE's prefix plugin: 64-character blocks (its former `DefaultHashBlockSize`,
//! and its current 16 tokens × 4 estimated characters per token), at most 256 blocks matched per
//! request (`DefaultMaxPrefixBlocks`) and 31 250 blocks per pod (`DefaultLRUCapacityPerServer`:
//! Llama-3-8B on an 80 GB H100 caches about 500K tokens, ÷ 16 tokens per block).
//!
//! Chat requests hash the concatenated message roles and contents (and the tools, first, when
//! present); completions hash the prompt; token-id prompts use the token chain (block size of the
//! config) recorded in the same store. 64 characters ≈ 16 tokens, so matched-block counts are on
//! the same scale as vLLM's 16-token blocks. The router still walks the KV-event index and takes,
//! per pod, the larger of the two counts (`Router::route_with`): where engines do send KV events,
//! a token-id prompt keeps its exact match; a text chain never matches the index.
//!
//! Concurrency: the store is shared by `Arc` between request tasks; lookups take a read lock,
//! recording a decision a write lock (`parking_lot::RwLock`, never held across an await).
//! Limits: a pod's record lives until LRU-evicted; pods that leave the pool keep their (bounded)
//! entries until more pods than the store's pod cap have been seen, then the least recently routed
//! pod is forgotten.

mod store;
mod text;

pub use store::{ApproxMatches, ApproxStore};
pub use text::{TextHasher, prompt_text};

use serde::Deserialize;

/// GIE's default block size, in characters.
pub const DEFAULT_BLOCK_CHARS: usize = 64;
/// GIE's default LRU capacity per pod, in blocks.
pub const DEFAULT_CAPACITY_BLOCKS_PER_POD: usize = 31_250;
/// GIE's default number of leading blocks hashed and matched per request.
pub const DEFAULT_MAX_BLOCKS: usize = 256;

/// How a model's requests are matched against pods' caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoutingMode {
    /// Tokenize, hash token blocks, match against the KV-event index (needs a tokenizer).
    Precise,
    /// Hash text blocks, match against where earlier requests were routed (no tokenizer needed).
    Approximate,
}

impl RoutingMode {
    /// The config and log spelling: `precise` or `approximate`.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingMode::Precise => "precise",
            RoutingMode::Approximate => "approximate",
        }
    }
}

/// `models[].approximate`: settings of approximate mode. Every field has a default (GIE's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproxConfig {
    /// Characters per text block. Default 64.
    pub block_chars: usize,
    /// Blocks remembered per pod before the least recently routed are forgotten. Default 31 250.
    pub capacity_blocks_per_pod: usize,
    /// Leading blocks of a prompt hashed, recorded and matched. Default 256.
    pub max_blocks: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            block_chars: DEFAULT_BLOCK_CHARS,
            capacity_blocks_per_pod: DEFAULT_CAPACITY_BLOCKS_PER_POD,
            max_blocks: DEFAULT_MAX_BLOCKS,
        }
    }
}

impl ApproxConfig {
    /// Which field is out of range and its value, if any (each must be ≥ 1).
    pub fn invalid_field(&self) -> Option<(&'static str, usize)> {
        [
            ("block_chars", self.block_chars),
            ("capacity_blocks_per_pod", self.capacity_blocks_per_pod),
            ("max_blocks", self.max_blocks),
        ]
        .into_iter()
        .find(|(_, v)| *v == 0)
    }
}
