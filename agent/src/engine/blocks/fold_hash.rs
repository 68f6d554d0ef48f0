//! A fast seeded hasher for the block record's maps, keyed by 64-bit block hashes (already
//! uniformly distributed, so SipHash's per-byte work buys nothing; issue 5 profiled it at ~5 %
//! of the agent's CPU under load).
//!
//! Each integer written is xored into the state, which is then folded through a 64×64 → 128-bit
//! multiply by a fixed odd constant, the high and low halves xored (the "folded multiply" of
//! wyhash / foldhash). The state starts from a random per-process seed, so prompts crafted to
//! collide under a known bucket function cannot be prepared in advance.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

/// 2^64 / φ, odd: the multiplier of the fold (Knuth's multiplicative hashing constant).
const K: u64 = 0x9E37_79B9_7F4A_7C15;

fn fold(a: u64, b: u64) -> u64 {
    let full = u128::from(a) * u128::from(b);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Builds [`FoldHasher`]s from the process seed.
#[derive(Debug, Clone, Copy)]
pub struct FoldState {
    seed: u64,
}

impl Default for FoldState {
    fn default() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        Self { seed: *SEED.get_or_init(rand::random::<u64>) }
    }
}

impl BuildHasher for FoldState {
    type Hasher = FoldHasher;

    fn build_hasher(&self) -> FoldHasher {
        FoldHasher { state: self.seed }
    }
}

/// See the module docs.
#[derive(Debug, Clone)]
pub struct FoldHasher {
    state: u64,
}

impl Hasher for FoldHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            if let Some(b) = buf.get_mut(..chunk.len()) {
                b.copy_from_slice(chunk);
            }
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u8(&mut self, x: u8) {
        self.write_u64(u64::from(x));
    }

    fn write_u16(&mut self, x: u16) {
        self.write_u64(u64::from(x));
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_u64(&mut self, x: u64) {
        self.state = fold(self.state ^ x, K);
    }

    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

/// A `HashMap` with [`FoldState`].
pub type FoldMap<K, V> = std::collections::HashMap<K, V, FoldState>;
/// A `HashSet` with [`FoldState`].
pub type FoldSet<K> = std::collections::HashSet<K, FoldState>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn equal_keys_hash_equal_and_nearby_keys_spread() {
        let s = FoldState::default();
        assert_eq!(s.hash_one((1u16, 42u64)), s.hash_one((1u16, 42u64)));
        assert_ne!(s.hash_one((0u16, 42u64)), s.hash_one((1u16, 42u64)));
        // Consecutive keys land in distinct buckets of a 1024-bucket table (low bits) and carry
        // distinct control bytes (top 7 bits) often enough.
        let low: FoldSet<u64> = (0..1024u64).map(|k| s.hash_one(k) & 1023).collect();
        assert!(low.len() > 600, "{} distinct low buckets", low.len());
        let top: FoldSet<u64> = (0..1024u64).map(|k| s.hash_one(k) >> 57).collect();
        assert!(top.len() > 100, "{} distinct top-7 values", top.len());
    }

    #[test]
    fn byte_writes_cover_every_byte() {
        let s = FoldState::default();
        assert_ne!(s.hash_one("abcdefgh1"), s.hash_one("abcdefgh2"));
    }
}
