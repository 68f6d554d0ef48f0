//! [`MixBuild`]: a one-multiply hasher for keys that are already uniform 64-bit hashes.
//!
//! Block hashes are XXH3 outputs (docs/design.md §2), so SipHash's DoS resistance buys nothing here except
//! ~20 ns per probe; a Fibonacci multiply-fold spreads every input bit into the bucket bits.

use std::hash::{BuildHasher, Hasher};

/// Cheap hasher for keys that are already hashes: one multiply + fold (Fibonacci hashing).
#[derive(Clone, Copy, Debug, Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        let m = u128::from(v) * 0x9E37_79B9_7F4A_7C15_u128;
        // Truncations are the point: fold the 128-bit product into 64 bits.
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

/// `BuildHasher` for [`MixHasher`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MixBuild;

impl BuildHasher for MixBuild {
    type Hasher = MixHasher;
    #[inline]
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}
