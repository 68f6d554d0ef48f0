//! Selection (docs/design.md §4): argmax of S; ties (|ΔS| ≤ 1e-9) go to the lower loadRatio, then the lower
//! queue depth, then (for a request no candidate holds a block of) the less prefill left, then a
//! seeded random choice (a per-decision key from splitmix64).

use std::cmp::Ordering;

/// Two scores within this are a tie.
pub const TIE_EPSILON: f64 = 1e-9;

/// What selection compares for one candidate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ranked {
    pub(crate) score: f64,
    pub(crate) load_ratio: f64,
    pub(crate) queue_depth: u32,
    /// Blocks the pod's requests still prefilling have left (0 unless the request is cold).
    pub(crate) prefill: u32,
    /// Random tie-break key (lower wins).
    pub(crate) tie_key: u64,
}

/// `Less` when `a` is the better pick.
pub(crate) fn better(a: &Ranked, b: &Ranked) -> Ordering {
    if (a.score - b.score).abs() > TIE_EPSILON {
        return b.score.total_cmp(&a.score);
    }
    a.load_ratio
        .total_cmp(&b.load_ratio)
        .then(a.queue_depth.cmp(&b.queue_depth))
        .then(a.prefill.cmp(&b.prefill))
        .then(a.tie_key.cmp(&b.tie_key))
}

/// splitmix64 finaliser: a well-mixed 64-bit value from `x`.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
