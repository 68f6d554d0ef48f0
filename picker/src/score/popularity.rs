//! Whether the prefixes a replica routes are equally popular (docs/design.md §4 "Where a new
//! prefix goes").
//!
//! Each request's root (its first block hash) counts once, each count fading as
//! `exp(−age / ROUTED_RATE_TAU_MS)`: a prefix's routed rate, on the same clock as a pod's. Over
//! all roots seen, the sample variance of those rates against their mean says whether prefixes
//! differ in popularity or only in Poisson noise: a decayed count of Poisson arrivals varies by
//! half its mean, so `max(0, 1 − (mean / 2) / variance)` is the share of the spread that is real
//! (the shrinkage of a James–Stein estimator). With hundreds of roots this reads the workload's
//! shape far more surely than the spread of a handful of pods' rates.
//!
//! Prefixes count as equally popular ([`PrefixPopularity::equal`]) only on evidence: at least
//! [`MIN_ROOTS`] roots, at least four in five of the recently new roots routed again (a flood of
//! distinct prompts, or one-off prompts beside a known set of groups, has no popularity to
//! speak of for a new prefix), and at most half the spread real.
//!
//! Bounds: at most `cap` roots (the least popular half is forgotten when full), a root unseen for
//! about five time constants is forgotten at the next rebase; the running sums are recomputed
//! from the counts at every rebase, so rounding cannot accumulate.

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::pool::ROUTED_RATE_TAU_MS;

/// Roots tracked at most.
pub(crate) const POPULARITY_ROOTS: usize = 1 << 16;
/// Fewer roots than this say nothing about the workload's shape. At 16, the sample variance of
/// equally popular roots exceeds twice its expectation (what [`MAX_REAL_SPREAD`] allows) about
/// once in a hundred; a fleet's couple of dozen system prompts (an agent platform's tenants)
/// count, and the reuse gate keeps a burst of first-seen prompts from reading as equal
/// (docs/decisions/0063-few-equal-prefixes-count.md).
const MIN_ROOTS: usize = 16;
/// The least share of recently new roots routed again for popularity to be judged.
const MIN_REUSE_SHARE: f64 = 0.8;
/// The most of the roots' spread in rate that may be real for them to count as equally popular.
const MAX_REAL_SPREAD: f64 = 0.5;
/// Counts are kept scaled by `exp((t − base) / τ)`; past this exponent they are rebased.
const REBASE_EXPONENT: f64 = 8.0;
/// A root whose count fades below this is forgotten at a rebase.
const FORGET_BELOW: f64 = 0.01;

/// Decayed request counts per root block hash. Cheap: a hash-map update per routed request.
#[derive(Debug)]
pub(crate) struct PrefixPopularity {
    inner: Mutex<Counts>,
}

#[derive(Debug)]
struct Counts {
    /// Root → decayed count at `t`, stored as count × `exp((t − base_ms) / τ)` so that one
    /// factor brings every count to the present.
    scaled: HashMap<u64, Root>,
    base_ms: i64,
    /// Σ scaled and Σ scaled², in the same units.
    sum: f64,
    sum_sq: f64,
    /// Roots first seen, and those of them seen again, in the same scaled units (each counted
    /// when it happened).
    born: f64,
    reused: f64,
    cap: usize,
}

/// One root's count, and whether it was ever routed more than once.
#[derive(Debug, Clone, Copy, Default)]
struct Root {
    scaled: f64,
    repeated: bool,
}

impl PrefixPopularity {
    /// A tracker of at most `cap` roots (at least 2).
    pub(crate) fn new(cap: usize) -> Self {
        PrefixPopularity {
            inner: Mutex::new(Counts {
                scaled: HashMap::new(),
                base_ms: i64::MIN,
                sum: 0.0,
                sum_sq: 0.0,
                born: 0.0,
                reused: 0.0,
                cap: cap.max(2),
            }),
        }
    }

    /// Counts one request whose first block hash is `root`, routed at `now_ms` (Unix ms). A clock
    /// earlier than the last record counts as the last record's time.
    pub(crate) fn record(&self, root: u64, now_ms: i64) {
        let mut c = self.inner.lock();
        if c.base_ms == i64::MIN {
            c.base_ms = now_ms;
        }
        if c.exponent(now_ms) > REBASE_EXPONENT {
            c.rebase(now_ms);
        }
        if c.scaled.len() >= c.cap && !c.scaled.contains_key(&root) {
            c.rebase(now_ms);
            if c.scaled.len() >= c.cap {
                c.forget_least_popular_half();
            }
        }
        let unit = c.exponent(now_ms).exp();
        let v = c.scaled.entry(root).or_default();
        let old = v.scaled;
        let seen = old > 0.0;
        let first_repeat = seen && !v.repeated;
        v.scaled += unit;
        v.repeated |= seen;
        let new = v.scaled;
        c.sum += new - old;
        c.sum_sq += new * new - old * old;
        if !seen {
            c.born += unit;
        }
        if first_repeat {
            c.reused += unit;
        }
    }

    /// `root`'s share of the requests counted lately, in [0, 1] (its fading count over all
    /// roots'; 0 for a root not tracked, or before any request). One lock and one lookup.
    pub(crate) fn share(&self, root: u64) -> f64 {
        let c = self.inner.lock();
        let count = c.scaled.get(&root).map_or(0.0, |r| r.scaled);
        if c.sum > 0.0 { (count / c.sum).clamp(0.0, 1.0) } else { 0.0 }
    }

    /// Whether the recent prefixes are equally popular at `now_ms`: [`MIN_ROOTS`] roots or
    /// more, at least four in five recently new roots routed again ([`Counts::reuse_share`]),
    /// and at most half the roots' spread in rate real ([`Counts::real_spread`]). One lock.
    pub(crate) fn equal(&self, now_ms: i64) -> bool {
        let c = self.inner.lock();
        c.reuse_share() >= MIN_REUSE_SHARE && c.real_spread(now_ms) <= MAX_REAL_SPREAD
    }

    #[cfg(test)]
    fn reuse_share(&self) -> f64 {
        self.inner.lock().reuse_share()
    }

    #[cfg(test)]
    fn real_spread(&self, now_ms: i64) -> f64 {
        self.inner.lock().real_spread(now_ms)
    }

    /// Roots tracked now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().scaled.len()
    }
}

impl Counts {
    /// The share of recently new roots that were routed again, in [0, 1] (0 before any): new
    /// roots and first repeats each count when they happen, fading on the routed rate's clock.
    fn reuse_share(&self) -> f64 {
        if self.born > 0.0 { (self.reused / self.born).clamp(0.0, 1.0) } else { 0.0 }
    }

    /// The share, in [0, 1], of the roots' spread in rate that Poisson arrivals at equal
    /// popularity would not give, `max(0, 1 − (mean / 2) / sample variance)` at `now_ms`. 1 while
    /// fewer than [`MIN_ROOTS`] roots are tracked (no evidence of equality); 0 with no spread.
    fn real_spread(&self, now_ms: i64) -> f64 {
        let n = self.scaled.len();
        if n < MIN_ROOTS {
            return 1.0;
        }
        let g = (-self.exponent(now_ms)).exp();
        let nf = n as f64;
        let mean = self.sum * g / nf;
        let variance = ((self.sum_sq * g * g - nf * mean * mean) / (nf - 1.0)).max(0.0);
        if variance > 0.0 && variance.is_finite() && mean.is_finite() {
            (1.0 - mean / 2.0 / variance).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// `(now − base) / τ`, never negative.
    fn exponent(&self, now_ms: i64) -> f64 {
        now_ms.saturating_sub(self.base_ms).max(0) as f64 / ROUTED_RATE_TAU_MS
    }

    /// Brings every count to `now_ms`'s units, forgets the faded ones and recomputes the sums.
    fn rebase(&mut self, now_ms: i64) {
        let g = (-self.exponent(now_ms)).exp();
        self.base_ms = self.base_ms.max(now_ms);
        self.scaled.retain(|_, v| {
            v.scaled *= g;
            v.scaled >= FORGET_BELOW
        });
        self.born *= g;
        self.reused *= g;
        self.resum();
    }

    /// Forgets the less popular half (ties either way), keeping memory bounded under a flood of
    /// distinct prompts.
    fn forget_least_popular_half(&mut self) {
        let mut values: Vec<f64> = self.scaled.values().map(|v| v.scaled).collect();
        let mid = values.len() / 2;
        let (_, median, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
        let median = *median;
        let mut dropped = 0;
        self.scaled.retain(|_, v| {
            let keep = v.scaled > median || dropped >= mid;
            if !keep {
                dropped += 1;
            }
            keep
        });
        self.resum();
    }

    fn resum(&mut self) {
        self.sum = self.scaled.values().map(|v| v.scaled).sum();
        self.sum_sq = self.scaled.values().map(|v| v.scaled * v.scaled).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Roots `0..per_root.len()`, root `i` routed `per_root[i]` times, the requests interleaved
    /// round by round and spread evenly over `[0, span_ms]`.
    fn fed(per_root: &[u32], span_ms: i64) -> PrefixPopularity {
        let p = PrefixPopularity::new(POPULARITY_ROOTS);
        let total = i64::from(per_root.iter().sum::<u32>().max(1));
        let mut left = per_root.to_vec();
        let mut k = 0i64;
        while left.iter().any(|&l| l > 0) {
            for (root, l) in left.iter_mut().enumerate().filter(|(_, l)| **l > 0) {
                *l -= 1;
                p.record(root as u64, k * span_ms / total);
                k += 1;
            }
        }
        p
    }

    #[test]
    fn equally_popular_prefixes_show_no_real_spread() {
        // 100 roots, 6 requests each over a minute: the only spread is in when each was routed.
        let p = fed(&[6; 100], 60_000);
        assert!(p.real_spread(60_000) < 0.2, "{}", p.real_spread(60_000));
        assert!(p.reuse_share() > 0.99, "{}", p.reuse_share());
        assert!(p.equal(60_000));
    }

    #[test]
    fn a_roots_share_is_its_part_of_the_fading_counts() {
        let p = PrefixPopularity::new(16);
        assert_eq!(p.share(1), 0.0, "nothing counted yet");
        for k in 0..3 {
            p.record(1, 1_000 * k);
        }
        p.record(2, 3_000);
        // Root 1's three counts faded more than root 2's one, so its share is under 3/4.
        let (one, two) = (p.share(1), p.share(2));
        assert!(one > 0.7 && one < 0.75, "{one}");
        assert!((one + two - 1.0).abs() < 1e-12, "{one} + {two}");
        assert_eq!(p.share(3), 0.0, "a root never counted");
    }

    #[test]
    fn skewed_popularity_is_not_equal() {
        // Zipf-like: root i routed 600 / (i + 1) times.
        let per: Vec<u32> = (0..100).map(|i| 600 / (i + 1)).collect();
        let p = fed(&per, 60_000);
        assert!(p.real_spread(60_000) > 0.9, "{}", p.real_spread(60_000));
        assert!(!p.equal(60_000));
    }

    #[test]
    fn distinct_prompts_and_too_few_roots_are_no_evidence() {
        // Every prompt new: no spread beyond noise, but nothing repeats.
        let p = fed(&[1; 500], 60_000);
        assert_eq!(p.reuse_share(), 0.0);
        assert!(!p.equal(60_000));
        // 100 groups that repeat, then as many one-off prompts: the new roots are not reused.
        let p = fed(&[6; 100], 60_000);
        for k in 0..100 {
            p.record(10_000 + k, 60_000 + 100 * k as i64);
        }
        assert!(p.reuse_share() < 0.6, "{}", p.reuse_share());
        assert!(!p.equal(70_000));
        // 10 equally popular roots: fewer than the evidence needs.
        let p = fed(&[6; 10], 60_000);
        assert_eq!(p.real_spread(60_000), 1.0);
        assert!(!p.equal(60_000));
        assert!(!PrefixPopularity::new(8).equal(0));
    }

    /// A couple of dozen groups, as a fleet's system prompts: equally popular ones count as
    /// equal, and a third of them five times as popular as the rest does not.
    #[test]
    fn a_couple_of_dozen_roots_are_evidence() {
        let p = fed(&[6; 24], 60_000);
        assert!(p.real_spread(60_000) < 0.5, "{}", p.real_spread(60_000));
        assert!(p.equal(60_000));
        let per: Vec<u32> = (0..24).map(|i| if i < 8 { 30 } else { 6 }).collect();
        let p = fed(&per, 60_000);
        assert!(p.real_spread(60_000) > 0.7, "{}", p.real_spread(60_000));
        assert!(!p.equal(60_000));
        // The same 24 roots each seen once so far: no reuse, no evidence.
        assert!(!fed(&[1; 24], 2_000).equal(2_000));
        // Sixteen roots are the least that count.
        assert_eq!(fed(&[6; 15], 60_000).real_spread(60_000), 1.0);
        assert!(fed(&[6; 16], 60_000).equal(60_000));
    }

    #[test]
    fn memory_stays_bounded_under_distinct_roots_and_hot_ones_survive() {
        let p = PrefixPopularity::new(64);
        for t in 0..1_000u64 {
            p.record(7, t as i64);
            p.record(1_000 + t, t as i64);
        }
        assert!(p.len() <= 64, "{}", p.len());
        assert!(p.inner.lock().scaled.contains_key(&7), "the hot root was forgotten");
    }

    #[test]
    fn faded_roots_are_forgotten_and_sums_stay_exact_across_rebases() {
        let p = PrefixPopularity::new(POPULARITY_ROOTS);
        for root in 0..100 {
            p.record(root, 0);
        }
        // Long after, only root 0 stays busy; the rest fade below the floor at a rebase.
        let tau = ROUTED_RATE_TAU_MS as i64;
        for k in 0..200 {
            p.record(0, 9 * tau + k);
        }
        assert_eq!(p.len(), 1);
        let c = p.inner.lock();
        let (sum, sum_sq): (f64, f64) =
            (c.scaled.values().map(|v| v.scaled).sum(), c.scaled.values().map(|v| v.scaled * v.scaled).sum());
        assert!((c.sum - sum).abs() <= 1e-9 * sum && (c.sum_sq - sum_sq).abs() <= 1e-9 * sum_sq);
    }

    #[test]
    fn a_clock_that_steps_back_or_jumps_stays_in_range() {
        let p = fed(&[6; 100], 60_000);
        p.record(0, -5_000_000);
        p.record(1, i64::MAX);
        for now in [i64::MIN, -1, 0, 60_000, i64::MAX] {
            let w = p.real_spread(now);
            assert!((0.0..=1.0).contains(&w), "{now}: {w}");
        }
    }
}
