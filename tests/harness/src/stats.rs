//! The one percentile of the reports: nearest rank over a sorted sample (the smallest value with
//! at least `q` of the sample at or below it), exact and reproducible, for summaries of a few
//! hundred to a few thousand values (the demo, the end-to-end benches, the simulator). Latency
//! benchmarks that time many calls record them in an HDR histogram (`hdrhistogram`) instead.

/// Nearest-rank `q`-percentile (`q` in [0,1]) of `sorted` (ascending); `None` when empty.
/// `q = 0` gives the smallest value, `q = 1` the largest.
pub fn percentile<T: Copy>(sorted: &[T], q: f64) -> Option<T> {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len().max(1)) - 1).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), Some(50));
        assert_eq!(percentile(&v, 0.9), Some(90));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&v, 1.0), Some(100));
        assert_eq!(percentile(&[7], 0.99), Some(7));
        assert_eq!(percentile::<u64>(&[], 0.5), None);
        // Ten values: p90 is the 9th, p91 already the 10th.
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!((percentile(&v, 0.9), percentile(&v, 0.91)), (Some(9.0), Some(10.0)));
    }
}
