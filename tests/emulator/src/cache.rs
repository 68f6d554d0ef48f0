//! Block identity in the emulated engine: opaque, chained engine hashes and vLLM's extra keys.
//! The blocks themselves live in [`crate::block_pool`].
//!
//! Hashes are made "the vLLM way" in spirit: opaque 64-bit values chained over (parent hash, the
//! block's tokens, the block's extra keys), keyed by a per-process random seed (vLLM: low 64 bits
//! of SHA-256 of the pickled tuple, with a random root unless PYTHONHASHSEED is fixed). They are
//! deliberately not kvroute's hash: the agent must re-hash `token_ids` and `extra_keys`.
//!
//! Extra keys follow vLLM 0.33's `generate_block_hash_extra_keys` (`vllm/v1/core/kv_cache_utils.py`):
//! per block, in this order, the LoRA adapter's name, one `(identifier, offset)` pair per
//! multimodal item whose placeholder tokens overlap the block (`offset` = the item's first
//! placeholder position minus the block's first token position, negative when the item began in
//! an earlier block), and the request's `cache_salt` on the first block only. A block without any
//! has no extra keys (`None`). Because hashes chain, a salt on block 0 changes every block after it.
//!
//! Pure values and functions, no shared state.

use std::hash::{Hash, Hasher};

/// One element of a block's extra keys (vLLM's `generate_block_hash_extra_keys`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// The LoRA adapter's name (every block of an adapter's request).
    Lora(String),
    /// A multimodal item overlapping the block: its identifier (vLLM's `mm_hash`, or the request's
    /// `uuid` for the item) and its first placeholder position relative to the block's start.
    Mm {
        /// The item's identifier.
        identifier: String,
        /// First placeholder token of the item minus the block's first token index.
        offset: i64,
    },
    /// The request's `cache_salt` (first block only).
    Salt(String),
}

/// A multimodal item's placeholder tokens in the prompt (vLLM's `PlaceholderRange`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MmPlaceholder {
    /// The item's identifier.
    pub identifier: String,
    /// Index of its first placeholder token in the prompt.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// What identifies a request's blocks besides their tokens: adapter, images, salt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockKeys {
    /// LoRA adapter name.
    pub lora: Option<String>,
    /// Multimodal items, sorted by offset, not overlapping.
    pub mm: Vec<MmPlaceholder>,
    /// `cache_salt` of the request (non-empty when set).
    pub cache_salt: Option<String>,
}

impl BlockKeys {
    /// Extra keys of the block covering tokens `[start, end)`; `None` when it has none.
    pub fn for_block(&self, start: usize, end: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(lora) = &self.lora {
            keys.push(ExtraKey::Lora(lora.clone()));
        }
        for item in &self.mm {
            if item.offset < end && start < item.offset + item.length {
                keys.push(ExtraKey::Mm {
                    identifier: item.identifier.clone(),
                    offset: item.offset as i64 - start as i64,
                });
            }
        }
        if start == 0
            && let Some(salt) = &self.cache_salt
        {
            keys.push(ExtraKey::Salt(salt.clone()));
        }
        (!keys.is_empty()).then_some(keys)
    }

    /// Extra keys of each full block from block `from` to block `to` (exclusive).
    pub fn for_blocks(&self, from: usize, to: usize, block_size: usize) -> Vec<Option<Vec<ExtraKey>>> {
        (from..to).map(|i| self.for_block(i * block_size, (i + 1) * block_size)).collect()
    }
}

/// Computes engine block hashes for one process.
#[derive(Debug, Clone, Copy)]
pub struct EngineHasher {
    seed: u64,
    block_size: usize,
}

impl EngineHasher {
    /// A hasher for `block_size`-token blocks with a root `seed`.
    pub fn new(seed: u64, block_size: u32) -> Self {
        Self { seed, block_size: block_size.max(1) as usize }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Hashes of the full blocks of `tokens` (a trailing partial block is ignored), each over its
    /// parent, its tokens and its extra keys from `keys`.
    pub fn chain(&self, tokens: &[u32], keys: &BlockKeys) -> Vec<u64> {
        let mut parent = None;
        tokens
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, block)| {
                let mut h = std::collections::hash_map::DefaultHasher::new();
                self.seed.hash(&mut h);
                parent.hash(&mut h);
                block.hash(&mut h);
                keys.for_block(i * self.block_size, (i + 1) * self.block_size).hash(&mut h);
                let hash = h.finish();
                parent = Some(hash);
                hash
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: usize = 4;
    const NONE: BlockKeys = BlockKeys { lora: None, mm: Vec::new(), cache_salt: None };

    fn lora(name: &str) -> BlockKeys {
        BlockKeys { lora: Some(name.into()), ..BlockKeys::default() }
    }

    fn salted(salt: &str) -> BlockKeys {
        BlockKeys { cache_salt: Some(salt.into()), ..BlockKeys::default() }
    }

    fn tokens(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    #[test]
    fn chain_depends_on_parent_lora_and_seed() {
        let h = EngineHasher::new(7, BS as u32);
        let a = h.chain(&tokens(0, 10), &NONE);
        assert_eq!(a.len(), 2, "partial block ignored");
        let mut other = tokens(0, 8);
        other[0] = 99;
        assert_ne!(h.chain(&other, &NONE)[1], a[1], "second block hash depends on the first");
        assert_ne!(h.chain(&tokens(0, 8), &lora("sql-lora"))[0], a[0]);
        assert_ne!(EngineHasher::new(8, BS as u32).chain(&tokens(0, 8), &NONE)[0], a[0]);
        assert_eq!(h.chain(&tokens(0, 8), &NONE), a);
    }

    /// vLLM's placement: salt in block 0 only, LoRA name in every block, an image's
    /// `(identifier, offset from the block's start)` in each block its placeholders overlap.
    #[test]
    fn extra_keys_follow_vllm_placement() {
        let keys = BlockKeys {
            lora: Some("sql-lora".into()),
            mm: vec![MmPlaceholder { identifier: "img-a".into(), offset: 6, length: 5 }],
            cache_salt: Some("tenant-1".into()),
        };
        let mm = |offset| ExtraKey::Mm { identifier: "img-a".into(), offset };
        let lora = || ExtraKey::Lora("sql-lora".into());
        assert_eq!(
            keys.for_blocks(0, 4, BS),
            vec![
                Some(vec![lora(), ExtraKey::Salt("tenant-1".into())]),
                Some(vec![lora(), mm(2)]),
                Some(vec![lora(), mm(-2)]),
                Some(vec![lora()]),
            ]
        );
        assert_eq!(NONE.for_block(0, BS), None);
    }

    #[test]
    fn a_salt_changes_every_block_and_the_same_salt_matches() {
        let h = EngineHasher::new(3, BS as u32);
        let plain = h.chain(&tokens(0, 12), &NONE);
        let a = h.chain(&tokens(0, 12), &salted("a"));
        assert!(plain.iter().zip(&a).all(|(p, s)| p != s), "salt on block 0 chains into every block");
        assert_eq!(h.chain(&tokens(0, 12), &salted("a")), a);
        assert_ne!(h.chain(&tokens(0, 12), &salted("b"))[0], a[0]);
        // An image changes the blocks its placeholders cover and every block after them.
        let img = |id: &str| BlockKeys {
            mm: vec![MmPlaceholder { identifier: id.into(), offset: 4, length: 4 }],
            ..BlockKeys::default()
        };
        let x = h.chain(&tokens(0, 12), &img("x"));
        assert_eq!(x[0], plain[0]);
        assert_ne!(x[1], plain[1]);
        assert_ne!(h.chain(&tokens(0, 12), &img("y"))[1], x[1]);
    }
}
