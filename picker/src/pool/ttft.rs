//! Per-pod time-to-first-token model, learned online (docs/design.md §4 "Load and predicted
//! TTFT"): `TTFT ≈ a + b · x + c · q` ms, with `x` = the request's uncached prompt tokens plus the
//! pod's in-flight work at routing (prefill tokens still ahead of it, and a decode share per
//! running request) and `q` = the pod's queue depth at routing (requests waiting for admission,
//! which KV pressure holds back whatever their prefill), fitted by exponentially weighted least
//! squares over the pod's recent first tokens.
//!
//! `b` (ms per token of work) is the pod's learned inverse capacity: loadRatio from in-flight
//! work is `work · b / load_horizon_ms`. A fit with too few observations, or whose numbers are
//! not finite, predicts nothing: the caller falls back to the seed's formula for that pod.
//!
//! Concurrency: each first token updates a pod's sums under a lock and publishes them solved,
//! as a [`SolvedFit`] (the line as a function of the fleet's slope, the prior), in a
//! [`SharedFit`]. Every decision reads that (one per candidate) and only evaluates it: the
//! reads take no lock, write no shared memory and solve nothing.
//!
//! Bounded: nine sums and eleven solved values per pod; every observation outside
//! [0, [`MAX_TTFT_MS`]] or with a work outside [0, [`MAX_WORK_TOKENS`]] is refused (counted by
//! the caller), never stored.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use parking_lot::Mutex;

/// Observations a pod's fit needs before it predicts.
pub const MIN_OBSERVATIONS: f64 = 4.0;
/// Least spread of the observed work (weighted standard deviation ÷ mean) for a fitted slope;
/// below it only the line through the origin is trusted.
pub const MIN_WORK_SPREAD: f64 = 0.1;
/// Observations the fleet-wide fit (a pod's stand-in until its own has learned) needs: one
/// first token already gives a line through the origin, the fleet's ms per token of work, which
/// is a better guess for every pod of the same model than no prediction at all.
pub const FLEET_MIN_OBSERVATIONS: f64 = 1.0;
/// Strength of the prior slope in a pod's fit ([`TtftFit::line_toward`]): it weighs as much as
/// this many observations whose work spreads as widely as its mean.
pub const PRIOR_OBSERVATIONS: f64 = 4.0;
/// Weight kept by the older observations at each new one (an effective window of ≈ 100).
pub const DECAY: f64 = 0.99;
/// Longest TTFT accepted as an observation, ms (10 minutes: anything longer is a stuck stream).
pub const MAX_TTFT_MS: f64 = 600_000.0;
/// Largest work accepted, tokens.
pub const MAX_WORK_TOKENS: f64 = 1.0e9;
/// Slope bounds, ms per token: 1 µs to 1 s per token of prefill (an 8B model on an A100 takes
/// ≈ 0.22 ms, a 70B one ≈ 2 ms).
pub const MIN_SLOPE: f64 = 1.0e-3;
/// See [`MIN_SLOPE`].
pub const MAX_SLOPE: f64 = 1.0e3;
/// Decode share of one running request in the work, tokens: a decoding request takes one token
/// of every step's budget and slows each step, about as much as this much prefill over the time
/// a queued prompt waits.
pub const DECODE_TOKENS_PER_REQUEST: f64 = 16.0;

/// One pod's fit: the weight and weighted sums of `x`, `q`, `y` and their products.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct TtftFit {
    w: f64,
    sx: f64,
    sq: f64,
    sy: f64,
    sxx: f64,
    sxq: f64,
    sqq: f64,
    sxy: f64,
    sqy: f64,
}

/// Most queue depth accepted as an input (requests).
pub const MAX_QUEUE: f64 = 1.0e6;

/// What a fit predicts from: intercept `a` (ms) and slope `b` (ms per token).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TtftLine {
    /// Fixed part of a first token, ms (≥ 0).
    pub intercept_ms: f64,
    /// Ms per token of work (in [`MIN_SLOPE`], [`MAX_SLOPE`]).
    pub ms_per_token: f64,
    /// Ms per queued request (≥ 0).
    pub ms_per_queued: f64,
}

impl TtftLine {
    /// Predicted TTFT, ms, for `work_tokens` of work (the request's own uncached tokens
    /// included) behind `queue` queued requests.
    pub fn predict(&self, work_tokens: f64, queue: f64) -> f64 {
        self.intercept_ms + self.ms_per_token * work_tokens.max(0.0) + self.ms_per_queued * queue.max(0.0)
    }
}

impl TtftFit {
    /// Adds one first token: `work_tokens` of work and `queue` queued requests at routing,
    /// `ttft_ms` measured. False (and nothing stored) when any is out of range or not finite.
    pub fn observe(&mut self, work_tokens: f64, queue: f64, ttft_ms: f64) -> bool {
        // `contains` is false for NaN; the infinities are outside every range.
        let in_range = (0.0..=MAX_WORK_TOKENS).contains(&work_tokens)
            && (0.0..=MAX_QUEUE).contains(&queue)
            && (0.0..=MAX_TTFT_MS).contains(&ttft_ms);
        if !in_range {
            return false;
        }
        let (x, q, y) = (work_tokens, queue, ttft_ms);
        let d = DECAY;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sq = self.sq * d + q;
        self.sy = self.sy * d + y;
        self.sxx = self.sxx * d + x * x;
        self.sxq = self.sxq * d + x * q;
        self.sqq = self.sqq * d + q * q;
        self.sxy = self.sxy * d + x * y;
        self.sqy = self.sqy * d + q * y;
        true
    }

    /// Least squares of `y` on `1, x, q` (a, b, c), with `ridge · (b − prior)²` added to the
    /// squared error, as `base + prior · tilt`: the system's matrix does not depend on the
    /// prior, only its right-hand side does, and linearly. `None` when the system is singular.
    fn full(&self, ridge: f64) -> Option<([f64; 3], [f64; 3])> {
        let m = [[self.w, self.sx, self.sq], [self.sx, self.sxx + ridge, self.sxq], [self.sq, self.sxq, self.sqq]];
        let det = |m: &[[f64; 3]; 3]| {
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        };
        let d = det(&m);
        let scale = self.w * self.sxx.max(1.0) * self.sqq.max(1.0);
        if !(d.is_finite() && d.abs() > 1e-9 * scale) {
            return None;
        }
        // Cramer's rule: column `col` of the matrix replaced by `v`.
        let solve = |v: [f64; 3]| {
            std::array::from_fn(|col| {
                let mut c = m;
                for (row, value) in c.iter_mut().zip(v) {
                    row[col] = value;
                }
                det(&c) / d
            })
        };
        Some((solve([self.sy, self.sxy, self.sqy]), solve([0.0, ridge, 0.0])))
    }

    /// Weighted standard deviation of the observed work over its mean (0 before any
    /// observation or with no work). A slope is only as good as this spread: first tokens all
    /// seen at about the same work fit any slope, and least squares through them can put the
    /// whole TTFT in the intercept (a pod that looks free however much work it has).
    pub fn work_spread(&self) -> f64 {
        if self.w <= 0.0 || self.sx <= 0.0 {
            return 0.0;
        }
        let mean = self.sx / self.w;
        let var = self.sxx / self.w - mean * mean;
        if var.is_finite() && var > 0.0 { var.sqrt() / mean } else { 0.0 }
    }

    /// [`TtftFit::line_toward`] after [`MIN_OBSERVATIONS`].
    pub fn line(&self, prior: Option<f64>) -> Option<TtftLine> {
        self.line_toward(MIN_OBSERVATIONS, prior)
    }

    /// The fitted model, `None` before `min_observations` (weighted) or when the sums are not usable.
    /// With the observed work spread at least [`MIN_WORK_SPREAD`]: least squares on work and
    /// queue when that system is solvable with a slope in bounds and a queue term ≥ 0, else
    /// least squares on work alone when it gives a slope in bounds. Otherwise the line through
    /// the origin (`b = Σy / Σx`), the slope clamped to its bounds.
    pub fn line_after(&self, min_observations: f64) -> Option<TtftLine> {
        self.line_toward(min_observations, None)
    }

    /// [`TtftFit::line_after`], with the fitted slope drawn toward `prior` (ms per token, the
    /// fleet's) as if [`PRIOR_OBSERVATIONS`] more first tokens, spread as widely as their mean
    /// work, had followed it (ridge regression). A pod's first dozen first tokens seldom span
    /// its work well: a few uneven ones can tilt least squares to a near-flat line with a large
    /// intercept, which reads the pod as free however much is queued on it. Its own data
    /// outweighs the prior as its observed spread of work grows.
    pub fn line_toward(&self, min_observations: f64, prior: Option<f64>) -> Option<TtftLine> {
        match prior.filter(|&p| slope_ok(p)) {
            Some(p) => self.solved_after(min_observations, true).at(p),
            None => self.solved_after(min_observations, false).at(0.0),
        }
    }

    /// [`TtftFit::line`] for every prior slope within the slope bounds at once (not for no prior),
    /// what a decision reads: see [`SolvedFit`].
    pub fn solve(&self) -> SolvedFit {
        self.solved_after(MIN_OBSERVATIONS, true)
    }

    /// The solution after `min_observations`, with the prior's ridge (`with_prior`) or without.
    fn solved_after(&self, min_observations: f64, with_prior: bool) -> SolvedFit {
        let none = SolvedFit { origin: f64::NAN, full: [f64::NAN; 6], ls: [f64::NAN; 4] };
        if self.w < min_observations || self.sx.is_nan() || self.sx <= 0.0 {
            return none;
        }
        let spread = self.work_spread() >= MIN_WORK_SPREAD;
        let ridge = if with_prior { PRIOR_OBSERVATIONS * (self.sx / self.w).powi(2) } else { 0.0 };
        let full = match self.full(ridge).filter(|_| spread) {
            Some(([a0, b0, c0], [a1, b1, c1])) => [a0, b0, c0, a1, b1, c1],
            None => [f64::NAN; 6],
        };
        // Least squares on work alone: b = (w·Σxy − Σx·Σy + w·ridge·prior) / (den + w·ridge) and
        // a = (Σy − b·Σx) / w, both affine in the prior.
        let den = self.w * self.sxx - self.sx * self.sx;
        let ls = if spread && den > 1e-9 * self.w * self.sxx {
            let below = den + self.w * ridge;
            let (b0, b1) = ((self.w * self.sxy - self.sx * self.sy) / below, self.w * ridge / below);
            let (mean_x, mean_y) = (self.sx / self.w, self.sy / self.w);
            [mean_y - mean_x * b0, b0, -mean_x * b1, b1]
        } else {
            [f64::NAN; 4]
        };
        SolvedFit { origin: (self.sy / self.sx).clamp(MIN_SLOPE, MAX_SLOPE), full, ls }
    }
}

/// A slope within [`MIN_SLOPE`], [`MAX_SLOPE`].
fn slope_ok(b: f64) -> bool {
    b.is_finite() && (MIN_SLOPE..=MAX_SLOPE).contains(&b)
}

/// A fit solved for every prior slope: the ridge of [`TtftFit::line_toward`] depends on the
/// fit alone, so each candidate line is affine in the prior, `base + prior · tilt`. A first
/// token solves its pod's fit once; a decision then evaluates a few products per candidate
/// instead of solving a 3 × 3 system (docs/design.md §4 "Decision speed").
#[derive(Debug, Clone, Copy)]
pub struct SolvedFit {
    /// The line through the origin's slope (`Σy / Σx`, clamped to its bounds), ms per token; NaN
    /// before the fit predicts.
    origin: f64,
    /// Least squares on work and queue: `(a, b, c) = full[0..3] + prior · full[3..6]`; NaN
    /// when the work does not spread or the system is singular.
    full: [f64; 6],
    /// Least squares on work alone: `(a, b) = ls[0..2] + prior · ls[2..4]`; NaN when undefined.
    ls: [f64; 4],
}

/// Equal when every value is the same bits: the NaN that marks a fit not solved equals itself.
impl PartialEq for SolvedFit {
    fn eq(&self, other: &SolvedFit) -> bool {
        self.to_words().map(f64::to_bits) == other.to_words().map(f64::to_bits)
    }
}

impl Default for SolvedFit {
    fn default() -> SolvedFit {
        TtftFit::default().solve()
    }
}

impl SolvedFit {
    /// The fitted line drawn toward `prior` (ms per token), as [`TtftFit::line_toward`] defines
    /// it: least squares on work and queue when its slope is in bounds and its queue term ≥ 0,
    /// else on work alone when that slope is in bounds, else the line through the origin.
    /// `None` before the fit predicts, or when `prior` is outside the slope bounds (the fleet's
    /// line, the prior a decision passes, always lies within them).
    pub fn line(&self, prior: f64) -> Option<TtftLine> {
        if !slope_ok(prior) {
            return None;
        }
        self.at(prior)
    }

    /// The line at `prior`, unchecked.
    fn at(&self, p: f64) -> Option<TtftLine> {
        // A fit that predicts has a positive origin slope.
        if self.origin.is_nan() || self.origin <= 0.0 {
            return None;
        }
        let [a0, b0, c0, a1, b1, c1] = self.full;
        let (a, b, c) = (a0 + p * a1, b0 + p * b1, c0 + p * c1);
        let (a, b, c) = if slope_ok(b) && c.is_finite() && c >= 0.0 && a.is_finite() {
            (a, b, c)
        } else {
            let [la0, lb0, la1, lb1] = self.ls;
            let (a, b) = (la0 + p * la1, lb0 + p * lb1);
            if slope_ok(b) { (a, b, 0.0) } else { (0.0, self.origin, 0.0) }
        };
        let a = a.max(0.0);
        (a.is_finite() && b.is_finite() && c.is_finite()).then_some(TtftLine {
            intercept_ms: a,
            ms_per_token: b,
            ms_per_queued: c,
        })
    }

    /// The eleven values, in declaration order.
    fn to_words(self) -> [f64; SOLVED_WORDS] {
        let [f0, f1, f2, f3, f4, f5] = self.full;
        let [l0, l1, l2, l3] = self.ls;
        [self.origin, f0, f1, f2, f3, f4, f5, l0, l1, l2, l3]
    }

    /// The inverse of [`SolvedFit::to_words`].
    fn from_words([origin, f0, f1, f2, f3, f4, f5, l0, l1, l2, l3]: [f64; SOLVED_WORDS]) -> SolvedFit {
        SolvedFit { origin, full: [f0, f1, f2, f3, f4, f5], ls: [l0, l1, l2, l3] }
    }
}

/// Values in a [`SolvedFit`].
const SOLVED_WORDS: usize = 11;

/// A pod's [`SolvedFit`] shared by the decisions that read it and the first tokens that
/// publish it, under a sequence lock: a reader copies it and retries only when a write
/// overlapped its copy, so a decision over a thousand pods takes no lock and writes nothing per
/// pod (two atomic read-modify-writes per pod under a mutex cost a tenth of such a decision).
/// The sums it is solved from lie apart, under a mutex of their own, which orders the writers
/// ([`SharedFit::observe`]): 72 bytes no decision reads, kept off the lines holding what every
/// decision reads of a pod (docs/design.md §4 "Decision speed").
#[derive(Debug)]
#[repr(C)]
pub struct SharedFit {
    /// Even while the solution is whole; odd while a writer changes it.
    seq: AtomicU64,
    /// The solution as `f64` bits, in [`SolvedFit::to_words`] order.
    solved: [AtomicU64; SOLVED_WORDS],
}

impl Default for SharedFit {
    fn default() -> SharedFit {
        let words = SolvedFit::default().to_words();
        SharedFit { seq: AtomicU64::new(0), solved: words.map(|v| AtomicU64::new(v.to_bits())) }
    }
}

impl SharedFit {
    /// A consistent copy of the solution: as one write left it, never half of two.
    pub fn load(&self) -> SolvedFit {
        let mut spins = 0u32;
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before.is_multiple_of(2) {
                let words: [f64; SOLVED_WORDS] =
                    std::array::from_fn(|i| f64::from_bits(self.solved[i].load(Ordering::Relaxed)));
                // Orders the copy before the second read of the sequence: a write whose values
                // the copy saw has moved it on by then.
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == before {
                    return SolvedFit::from_words(words);
                }
            }
            // A writer holds the solution for a few dozen instructions; one that was
            // descheduled there gets the core back.
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// [`TtftFit::observe`] on `sums`, then publishes them solved; false (nothing changed) when
    /// refused. `sums` is the same mutex at every call on this fit: its lock orders the writers.
    pub fn observe(&self, sums: &Mutex<TtftFit>, work_tokens: f64, queue: f64, ttft_ms: f64) -> bool {
        let mut fit = sums.lock();
        if !fit.observe(work_tokens, queue, ttft_ms) {
            return false;
        }
        self.publish(fit.solve());
        true
    }

    /// Writes `solved` under the sequence lock; the caller holds the writers' lock.
    fn publish(&self, solved: SolvedFit) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        // Orders the odd sequence before the values: a reader that sees any new value sees it
        // odd or moved on when it reads the sequence again.
        fence(Ordering::Release);
        for (cell, v) in self.solved.iter().zip(solved.to_words()) {
            cell.store(v.to_bits(), Ordering::Relaxed);
        }
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_a_line_from_noisy_first_tokens() {
        let mut f = TtftFit::default();
        assert_eq!(f.line(None), None);
        for i in 0..200u32 {
            let x = f64::from(i % 17) * 500.0;
            let q = f64::from(i % 5);
            let noise = if i % 2 == 0 { 3.0 } else { -3.0 };
            assert!(f.observe(x, q, 20.0 + 0.25 * x + 100.0 * q + noise));
        }
        let line = f.line(None).expect("fitted");
        assert!((line.ms_per_token - 0.25).abs() < 0.01, "{line:?}");
        assert!((line.ms_per_queued - 100.0).abs() < 5.0, "{line:?}");
        assert!((line.intercept_ms - 20.0).abs() < 5.0, "{line:?}");
        assert!((line.predict(4000.0, 2.0) - 1220.0).abs() < 40.0);
    }

    #[test]
    fn refuses_absurd_observations_and_survives_a_constant_work() {
        let mut f = TtftFit::default();
        for bad in [(-1.0, 10.0), (10.0, -1.0), (f64::NAN, 1.0), (1.0, f64::INFINITY), (1.0, MAX_TTFT_MS * 2.0)] {
            assert!(!f.observe(bad.0, 0.0, bad.1), "{bad:?}");
        }
        assert!(!f.observe(1.0, -1.0, 1.0) && !f.observe(1.0, f64::NAN, 1.0));
        assert_eq!(f, TtftFit::default());
        // Every observation at one work: least squares is undefined, the ratio line stands in.
        for _ in 0..10 {
            f.observe(1000.0, 0.0, 250.0);
        }
        let line = f.line(None).expect("fitted");
        assert!((line.predict(1000.0, 0.0) - 250.0).abs() < 1e-6, "{line:?}");
        // A slope out of bounds (TTFT falling with work) is clamped, never negative.
        let mut g = TtftFit::default();
        for i in 0..20 {
            g.observe(f64::from(i) * 100.0, 1.0, 5000.0 - f64::from(i) * 200.0);
        }
        let line = g.line(None).expect("fitted");
        assert!(line.ms_per_token >= MIN_SLOPE && line.intercept_ms >= 0.0, "{line:?}");
    }

    /// First tokens seen at nearly one work (a pod whose queue the picker could not see yet)
    /// whose TTFTs grew with a hidden queue: least squares would put it all in the intercept
    /// and read the pod as free at any work; the ratio line reads it as slow.
    #[test]
    fn nearly_constant_work_gives_the_ratio_line_not_a_flat_one() {
        let mut f = TtftFit::default();
        for (x, y) in [(3200.0, 926.0), (3216.0, 1634.0), (3232.0, 1655.0), (3248.0, 2300.0), (3264.0, 3100.0)] {
            assert!(f.observe(x, 0.0, y));
        }
        assert!(f.work_spread() < MIN_WORK_SPREAD, "{}", f.work_spread());
        let line = f.line(None).expect("fitted");
        assert_eq!(line.intercept_ms, 0.0, "{line:?}");
        let ratio = (926.0 + 1634.0 + 1655.0 + 2300.0 + 3100.0) / (3200.0 + 3216.0 + 3232.0 + 3248.0 + 3264.0);
        // The older observations weigh a little less (DECAY): within 2 % of the plain ratio.
        assert!((line.ms_per_token / ratio - 1.0).abs() < 0.02, "{line:?}");
        // Twice the work, about twice the time (a flat fit would say ≈ the same).
        assert!(line.predict(6400.0, 0.0) > 3000.0, "{line:?}");
    }

    /// The fleet-wide fit predicts after one first token, a pod's own after a weight of four
    /// (five first tokens, the older ones faded).
    #[test]
    fn the_fleet_fit_predicts_from_one_first_token() {
        let mut f = TtftFit::default();
        assert!(f.observe(4096.0, 0.0, 926.0));
        assert_eq!(f.line(None), None);
        let line = f.line_after(FLEET_MIN_OBSERVATIONS).expect("fitted");
        assert!((line.predict(4096.0, 0.0) - 926.0).abs() < 1e-6, "{line:?}");
        assert!(line.predict(0.0, 5.0) < 1.0, "nothing uncached, nothing ahead: {line:?}");
    }

    /// A pod's first tokens, mostly cold prompts of about one size whose TTFTs vary with what
    /// the model cannot see: least squares alone tilts to a near-flat line (a pod that looks
    /// free at any work); drawn toward the fleet's slope it charges queued work again, and a
    /// pod whose own first tokens span its work well keeps its own slope.
    #[test]
    fn a_prior_slope_steadies_a_pod_fit_from_few_uneven_first_tokens() {
        let mut f = TtftFit::default();
        let seen =
            [(2000.0, 700.0), (3300.0, 740.0), (3400.0, 900.0), (4200.0, 780.0), (3200.0, 650.0), (2600.0, 690.0)];
        for (x, y) in seen {
            assert!(f.observe(x, 0.0, y));
        }
        assert!(f.work_spread() >= MIN_WORK_SPREAD, "{}", f.work_spread());
        let alone = f.line(None).expect("fitted");
        let toward = f.line(Some(0.22)).expect("fitted");
        // Alone: another 3 200 queued tokens add (almost) nothing.
        assert!(alone.predict(6800.0, 0.0) - alone.predict(3400.0, 0.0) < 200.0, "{alone:?}");
        assert!(toward.predict(6800.0, 0.0) - toward.predict(3400.0, 0.0) > 500.0, "{toward:?}");
        // Both still fit what was seen, on average.
        let mean_err = |l: TtftLine| seen.iter().map(|&(x, y)| l.predict(x, 0.0) - y).sum::<f64>() / 6.0;
        assert!(mean_err(toward).abs() < 60.0, "{toward:?}");

        // Well-spread first tokens on a slope of 0.3: the prior of 0.22 barely moves it.
        let mut g = TtftFit::default();
        for i in 0..100u32 {
            let x = 200.0 + f64::from(i % 10) * 400.0;
            g.observe(x, 0.0, 30.0 + 0.3 * x);
        }
        let own = g.line(Some(0.22)).expect("fitted");
        assert!((own.ms_per_token - 0.3).abs() < 0.02, "{own:?}");
    }

    /// The line [`TtftFit::line_toward`] defines, solved directly at `prior`: Gaussian elimination
    /// on the ridge's normal equations, the same bounds and fallbacks in the same order.
    fn direct(f: &TtftFit, min_observations: f64, prior: Option<f64>) -> Option<TtftLine> {
        if f.w < min_observations || f.sx <= 0.0 {
            return None;
        }
        let ok = |b: f64| b.is_finite() && (MIN_SLOPE..=MAX_SLOPE).contains(&b);
        let (ridge, p) = match prior.filter(|&p| ok(p)) {
            Some(p) => (PRIOR_OBSERVATIONS * (f.sx / f.w).powi(2), p),
            None => (0.0, 0.0),
        };
        let spread = f.work_spread() >= MIN_WORK_SPREAD;
        let mut m =
            [[f.w, f.sx, f.sq, f.sy], [f.sx, f.sxx + ridge, f.sxq, f.sxy + ridge * p], [f.sq, f.sxq, f.sqq, f.sqy]];
        for k in 0..3 {
            let pivot = m[k];
            for row in m.iter_mut().skip(k + 1) {
                let factor = row[k] / pivot[k];
                for (cell, v) in row.iter_mut().zip(pivot).skip(k) {
                    *cell -= factor * v;
                }
            }
        }
        // The determinant is the product of the pivots (no rows were swapped).
        let det = m[0][0] * m[1][1] * m[2][2];
        let scale = f.w * f.sxx.max(1.0) * f.sqq.max(1.0);
        let full = (spread && det.is_finite() && det.abs() > 1e-9 * scale).then(|| {
            let c = m[2][3] / m[2][2];
            let b = (m[1][3] - m[1][2] * c) / m[1][1];
            ((m[0][3] - m[0][1] * b - m[0][2] * c) / m[0][0], b, c)
        });
        let (a, b, c) = match full {
            Some((a, b, c)) if ok(b) && c >= 0.0 && a.is_finite() => (a, b, c),
            _ => {
                let den = f.w * f.sxx - f.sx * f.sx;
                match (spread && den > 1e-9 * f.w * f.sxx)
                    .then(|| (f.w * f.sxy - f.sx * f.sy + f.w * ridge * p) / (den + f.w * ridge))
                {
                    Some(b) if ok(b) => ((f.sy - b * f.sx) / f.w, b, 0.0),
                    _ => (0.0, (f.sy / f.sx).clamp(MIN_SLOPE, MAX_SLOPE), 0.0),
                }
            }
        };
        Some(TtftLine { intercept_ms: a.max(0.0), ms_per_token: b, ms_per_queued: c })
    }

    /// The solution a decision reads gives, at every prior (and with none), the line the direct
    /// solve gives, in each branch: work and queue, work alone (a queue always empty, or a
    /// TTFT falling with the queue), and the line through the origin (work that does not
    /// spread, a slope beyond its bounds); the fleet's fit after one first token too.
    #[test]
    fn the_solved_fit_is_the_direct_solve_in_every_branch() {
        let fed = |n: u32, point: &dyn Fn(u32) -> (f64, f64, f64)| {
            let mut f = TtftFit::default();
            for i in 0..n {
                let (x, q, y) = point(i);
                assert!(f.observe(x, q, y), "{x} {q} {y}");
            }
            f
        };
        let wave = |i: u32, k: u32, m: u32| f64::from(i * k % m);
        let fits = [
            // Work and queue, noisy.
            fed(40, &|i| {
                let (x, q) = (300.0 + wave(i, 37, 23) * 250.0, wave(i, 11, 7));
                (x, q, 80.0 + 0.3 * x + 120.0 * q + wave(i, 29, 13) * 20.0 - 120.0)
            }),
            // No queue ever: the three-term system is singular.
            fed(30, &|i| (200.0 + wave(i, 7, 11) * 300.0, 0.0, 50.0 + 0.25 * (200.0 + wave(i, 7, 11) * 300.0))),
            // TTFT falling as the queue grows: a negative queue term.
            fed(30, &|i| {
                (
                    500.0 + wave(i, 5, 9) * 400.0,
                    wave(i, 3, 5),
                    900.0 + 0.2 * wave(i, 5, 9) * 400.0 - 60.0 * wave(i, 3, 5),
                )
            }),
            // Work that does not spread.
            fed(12, &|i| (3200.0 + f64::from(i), 1.0, 700.0 + 40.0 * wave(i, 1, 3))),
            // A slope beyond its bounds.
            fed(12, &|i| (10.0 + wave(i, 1, 6) * 40.0, 0.0, 1500.0 * (10.0 + wave(i, 1, 6) * 40.0))),
            // Few first tokens, queue and work spread.
            fed(6, &|i| (1000.0 + wave(i, 1, 6) * 700.0, wave(i, 1, 2), 300.0 + wave(i, 5, 6) * 90.0)),
        ];
        let close = |got: f64, want: f64| (got - want).abs() <= 1e-9 * want.abs().max(1.0);
        let same = |got: Option<TtftLine>, want: Option<TtftLine>| match (got, want) {
            (Some(g), Some(w)) => {
                close(g.intercept_ms, w.intercept_ms)
                    && close(g.ms_per_token, w.ms_per_token)
                    && close(g.ms_per_queued, w.ms_per_queued)
            }
            (g, w) => g == w,
        };
        let priors = [None, Some(MIN_SLOPE), Some(0.05), Some(0.22), Some(0.6), Some(3.0), Some(MAX_SLOPE), Some(-1.0)];
        for (k, f) in fits.iter().enumerate() {
            for prior in priors {
                let (got, want) = (f.line_toward(MIN_OBSERVATIONS, prior), direct(f, MIN_OBSERVATIONS, prior));
                assert!(want.is_some(), "fit {k} predicts");
                assert!(same(got, want), "fit {k}, prior {prior:?}: {got:?} against {want:?}");
                if let Some(p) = prior.filter(|&p| p > 0.0) {
                    assert_eq!(f.solve().line(p), got, "fit {k}, prior {p}");
                }
            }
        }
        // Each branch is taken by some fit at the fleet's usual prior.
        let lines: Vec<TtftLine> = fits.iter().filter_map(|f| f.line(Some(0.22))).collect();
        assert!(lines.iter().any(|l| l.ms_per_queued > 0.0), "{lines:?}");
        assert!(lines.iter().any(|l| l.ms_per_queued == 0.0 && l.intercept_ms > 0.0), "{lines:?}");
        assert!(lines.iter().any(|l| l.intercept_ms == 0.0 && l.ms_per_queued == 0.0), "{lines:?}");
        // The fleet's fit after one first token, and before any.
        let one = fed(1, &|_| (4096.0, 0.0, 926.0));
        assert!(same(one.line_after(FLEET_MIN_OBSERVATIONS), direct(&one, FLEET_MIN_OBSERVATIONS, None)));
        assert!(one.line_after(FLEET_MIN_OBSERVATIONS).is_some());
        // A prior outside the slope bounds is no prior; a fit not solved predicts nothing.
        let solved = fits[0].solve();
        assert_eq!(solved.line(MAX_SLOPE * 2.0), None);
        assert_eq!(solved.line(f64::NAN), None);
        assert_eq!(TtftFit::default().solve().line(0.2), None);
        assert_eq!(SolvedFit::default(), TtftFit::default().solve());
        assert_eq!(SolvedFit::default().line(0.2), None);
    }

    /// The shared fit publishes exactly what a plain fit fed the same first tokens solves to,
    /// and a refused first token changes neither.
    #[test]
    fn the_shared_fit_is_the_plain_fit() {
        let (shared, sums, mut plain) = (SharedFit::default(), Mutex::new(TtftFit::default()), TtftFit::default());
        assert_eq!(shared.load().line(0.2), None);
        for i in 0..50u32 {
            let (x, q, y) = (f64::from(i % 9) * 300.0, f64::from(i % 4), 10.0 + f64::from(i) * 7.5);
            assert_eq!(shared.observe(&sums, x, q, y), plain.observe(x, q, y));
        }
        assert!(!shared.observe(&sums, f64::NAN, 0.0, 1.0));
        assert_eq!(*sums.lock(), plain);
        assert_eq!(shared.load(), plain.solve());
        assert_eq!(shared.load().line(0.2), plain.line(Some(0.2)));
        assert!(shared.load().line(0.2).is_some());
    }

    /// Readers racing writers never see half of one write and half of another, and no write is
    /// lost. Each writer first publishes solutions whose eleven values are all one number, so a
    /// torn copy holds two different ones; then the writers' first tokens all reach the sums.
    #[test]
    fn readers_never_see_a_torn_fit_and_writers_lose_nothing() {
        const WRITES: u32 = 20_000;
        let (shared, sums) = (SharedFit::default(), Mutex::new(TtftFit::default()));
        let done = std::sync::atomic::AtomicBool::new(false);
        let checked = std::thread::scope(|s| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let mut n = 0u64;
                        while !done.load(Ordering::Relaxed) || n == 0 {
                            let words = shared.load().to_words();
                            assert!(words.iter().all(|&v| v.to_bits() == words[0].to_bits()), "torn: {words:?}");
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            let writers: Vec<_> = (0..2u32)
                .map(|w| {
                    let (shared, sums) = (&shared, &sums);
                    s.spawn(move || {
                        for i in 0..WRITES {
                            let x = f64::from((i * 7 + w * 13) % 1000) + 0.5;
                            let _writer = sums.lock();
                            shared.publish(SolvedFit::from_words([x; SOLVED_WORDS]));
                        }
                    })
                })
                .collect();
            for w in writers {
                assert!(w.join().is_ok(), "a writer panicked");
            }
            done.store(true, Ordering::Relaxed);
            let reads = readers.into_iter().map(|r| r.join());
            reads.map(|n| n.unwrap_or_else(|_| panic!("a reader saw a torn fit"))).sum::<u64>()
        });
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for i in 0..WRITES {
                        assert!(shared.observe(&sums, f64::from(i % 1000) + 0.5, 0.0, 1.0));
                    }
                });
            }
        });
        assert!(checked > 0);
        // `w` after n observations is Σ DECAY^k for k < n, whatever their order.
        let mut plain = TtftFit::default();
        for _ in 0..2 * WRITES {
            plain.observe(1.0, 0.0, 1.0);
        }
        assert_eq!(sums.lock().w, plain.w);
        // The last publication is the solution of the sums as the last writer left them.
        assert_eq!(shared.load(), sums.lock().solve());
    }
}
