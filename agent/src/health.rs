//! The pod health score (docs/design.md §7): ONE pure function, [`health_score`], from what the
//! agent observes to a score in [0,1] and a reason naming the dominant problem.
//!
//! Bands (docs/design.md §7):
//! - 1.0 healthy: no penalty at all.
//! - 0.7–0.9 minor: intermittent corrected ECC (< 1/min), moderate thermal or power throttling,
//!   host memory pressure, a slow probe, a probe that timed out while the engine kept processing
//!   tokens (busy, not stuck), engine stats that just went stale, GPUs the agent cannot see
//!   (0.3: "GPU not found on this node" when NVML has no GPU of that index or UUID, "GPU assignment unknown" when the kubelet's
//!   PodResources API has not told which GPUs the pod holds): the pod may be fine, but its ECC,
//!   thermal and power state are unknown, so it must not pass for healthy (docs/design.md §14).
//! - Stale stats (without this, an engine whose `/metrics` stops parsing would have its last
//!   good queue and KV figures reported for ever with health 1.0): once the last `/metrics` page
//!   that parsed is older than `metrics_stale_after_ms`, a soft penalty of 0.1 grows linearly
//!   to 0.5 over [`STALE_RAMP_MS`] (reason "engine stats stale"): the pod drops from minor to
//!   significant while its figures are unknown, and is still never excluded by this alone (the
//!   probe and `/health` say whether it serves).
//! - 0.3–0.6 significant: frequent corrected ECC (≥ ~10/min), throttling at ≥ 90 °C, several
//!   minor problems together (soft penalties add, floored at 0.3 so they never exclude alone).
//! - < 0.3 excluded: uncorrected ECC errors (0.1), probe failing, or timing out while the
//!   engine's token counters stand still (0.2: a live but stuck engine).
//! - 0.0: draining, engine `/health` failing, model not loaded.
//!
//! Cache warmth has weight 0 here: the picker's cache factor already counts it (docs/design.md §7).
//! Pure: no state, no I/O; the caller computes rates (ECC per minute) from successive samples.

/// Time over which the stale-stats penalty grows from 0.1 to 0.5, ms.
pub const STALE_RAMP_MS: f64 = 30_000.0;

/// Outcome of the latest active inference probe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ProbeOutcome {
    /// No probe finished yet: no penalty.
    Unknown,
    /// Answered within the deadline, latency in ms.
    Ok {
        /// Probe round trip, ms.
        latency_ms: f64,
    },
    /// Error status, or past the deadline while the engine made no progress (a stuck engine).
    Failed,
    /// Past the deadline while the engine kept processing tokens: it is busy (the probe queued
    /// behind other requests), not stuck. Penalised like the slowest answered probe (0.3), not
    /// excluded: the queue factor already steers load away from it.
    TimedOutBusy,
}

/// Whether the agent sees the pod's GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuVisibility {
    /// Every GPU of the pod was sampled (or the pod declares none).
    #[default]
    Seen,
    /// A GPU named for the pod does not exist on this node (NVML has no such index or UUID).
    NotFound,
    /// Which GPUs the pod holds is not known (PodResources unreachable or listing none).
    Unknown,
}

/// Soft penalty for GPUs the agent cannot see (shared with the picker, which counts a pod no
/// agent reports on as this unknown too).
pub use kvroute_common::GPU_UNSEEN_PENALTY;

/// Everything the score depends on, for one pod.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HealthInputs {
    /// Operator marked the pod draining.
    pub draining: bool,
    /// Engine answers `/health` with 200.
    pub engine_health_ok: bool,
    /// `/v1/models` lists a model.
    pub model_loaded: bool,
    /// Latest active probe.
    pub probe: ProbeOutcome,
    /// Probe deadline, ms (a probe slower than half of it is penalised).
    pub probe_timeout_ms: f64,
    /// Corrected ECC errors per minute, summed over the pod's GPUs.
    pub ecc_corrected_per_min: f64,
    /// Uncorrected ECC errors (volatile count), summed over the pod's GPUs.
    pub ecc_uncorrected: u64,
    /// Hottest GPU of the pod, °C.
    pub max_temperature_c: u32,
    /// Any GPU of the pod thermally throttled.
    pub thermal_throttle: bool,
    /// Any GPU of the pod power throttled.
    pub power_throttle: bool,
    /// Host memory in use, fraction [0,1].
    pub host_memory_used: f64,
    /// Age of the last `/metrics` page that parsed, ms (since the scrape loop started when
    /// none has yet): how old the reported queue and KV figures are.
    pub metrics_age_ms: f64,
    /// Age past which the figures count as stale, ms (the agent uses 5 scrape intervals, at
    /// least 1 s).
    pub metrics_stale_after_ms: f64,
    /// Whether the pod's GPUs could be sampled.
    pub gpus: GpuVisibility,
}

impl Default for HealthInputs {
    fn default() -> Self {
        Self {
            draining: false,
            engine_health_ok: true,
            model_loaded: true,
            probe: ProbeOutcome::Unknown,
            probe_timeout_ms: 2000.0,
            ecc_corrected_per_min: 0.0,
            ecc_uncorrected: 0,
            max_temperature_c: 50,
            thermal_throttle: false,
            power_throttle: false,
            host_memory_used: 0.3,
            metrics_age_ms: 0.0,
            metrics_stale_after_ms: 1000.0,
            gpus: GpuVisibility::Seen,
        }
    }
}

/// A score in [0,1] and a short reason ("" when healthy).
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// Score in [0,1].
    pub score: f64,
    /// The dominant problem, "" when healthy.
    pub reason: String,
}

/// Maps a score to its band (0 = failed, 1 = excluded, 2 = significant, 3 = minor, 4 = healthy);
/// a band change is reported to the picker at once.
pub fn band(score: f64) -> u8 {
    match score {
        s if s <= 0.0 => 0,
        s if s < 0.3 => 1,
        s if s < 0.7 => 2,
        s if s < 1.0 => 3,
        _ => 4,
    }
}

/// The health function. See the module docs for the bands.
pub fn health_score(i: &HealthInputs) -> Health {
    let hard = |score: f64, reason: &str| Health { score, reason: reason.to_string() };
    if i.draining {
        return hard(0.0, "draining");
    }
    if !i.engine_health_ok {
        return hard(0.0, "engine /health failing");
    }
    if !i.model_loaded {
        return hard(0.0, "model not loaded");
    }
    if i.ecc_uncorrected > 0 {
        return hard(0.1, "uncorrected ECC errors");
    }
    if i.probe == ProbeOutcome::Failed {
        return hard(0.2, "inference probe failing");
    }
    // Soft penalties: (amount, reason).
    let mut penalties: Vec<(f64, &str)> = Vec::new();
    let r = i.ecc_corrected_per_min;
    if r > 0.0 {
        // 0.1 up to 1/min, +0.3 per decade above, capped at 0.6.
        let p = if r <= 1.0 { 0.1 } else { (0.1 + 0.3 * r.log10()).min(0.6) };
        penalties.push((p, "corrected ECC errors"));
    }
    if i.thermal_throttle {
        penalties.push((if i.max_temperature_c >= 90 { 0.5 } else { 0.2 }, "thermal throttling"));
    } else if i.max_temperature_c >= 85 {
        penalties.push((0.1, "high GPU temperature"));
    }
    if i.power_throttle {
        penalties.push((0.1, "power throttling"));
    }
    if i.host_memory_used > 0.9 {
        penalties.push(((0.1 + (i.host_memory_used.min(1.0) - 0.9) * 3.0).min(0.4), "host memory pressure"));
    }
    if let ProbeOutcome::Ok { latency_ms } = i.probe {
        let half = i.probe_timeout_ms / 2.0;
        if half > 0.0 && latency_ms > half {
            penalties.push(((0.1 + 0.2 * (latency_ms - half) / half).min(0.3), "slow inference probe"));
        }
    }
    if i.probe == ProbeOutcome::TimedOutBusy {
        penalties.push((0.3, "inference probe timed out behind a busy queue"));
    }
    let stale_for = i.metrics_age_ms - i.metrics_stale_after_ms;
    if stale_for > 0.0 {
        penalties.push((0.1 + 0.4 * (stale_for / STALE_RAMP_MS).min(1.0), "engine stats stale"));
    }
    match i.gpus {
        GpuVisibility::Seen => {}
        GpuVisibility::NotFound => penalties.push((GPU_UNSEEN_PENALTY, "GPU not found on this node")),
        GpuVisibility::Unknown => penalties.push((GPU_UNSEEN_PENALTY, "GPU assignment unknown")),
    }
    let total: f64 = penalties.iter().map(|(p, _)| p).sum();
    let reason = penalties.iter().max_by(|a, b| a.0.total_cmp(&b.0)).map_or("", |(_, r)| r);
    let score = if penalties.is_empty() { 1.0 } else { (1.0 - total).clamp(0.3, 0.9) };
    Health { score, reason: reason.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(f: impl FnOnce(&mut HealthInputs)) -> Health {
        let mut i = HealthInputs::default();
        f(&mut i);
        health_score(&i)
    }

    #[test]
    fn healthy_band() {
        let h = with(|_| {});
        assert_eq!((h.score, h.reason.as_str()), (1.0, ""));
        assert_eq!(band(h.score), 4);
        let h = with(|i| i.probe = ProbeOutcome::Ok { latency_ms: 30.0 });
        assert_eq!(h.score, 1.0);
    }

    /// A pod whose GPUs are unknown scores what the picker counts for a pod with no agent, so
    /// neither ranks below the other.
    #[test]
    fn unknown_gpus_score_the_pickers_no_report_health() {
        for gpus in [GpuVisibility::Unknown, GpuVisibility::NotFound] {
            let h = with(|i| i.gpus = gpus);
            assert!((h.score - kvroute_common::UNKNOWN_GPU_HEALTH).abs() < 1e-12, "{gpus:?}: {h:?}");
        }
    }

    #[test]
    fn minor_band() {
        for h in [
            with(|i| i.ecc_corrected_per_min = 0.5),
            with(|i| {
                i.thermal_throttle = true;
                i.max_temperature_c = 85
            }),
            with(|i| i.host_memory_used = 0.95),
            with(|i| i.power_throttle = true),
            with(|i| i.probe = ProbeOutcome::Ok { latency_ms: 1200.0 }),
        ] {
            assert!((0.7..=0.9).contains(&h.score), "{h:?}");
            assert!(!h.reason.is_empty());
        }
        assert_eq!(with(|i| i.ecc_corrected_per_min = 0.5).reason, "corrected ECC errors");
    }

    #[test]
    fn significant_band() {
        for h in [
            with(|i| i.ecc_corrected_per_min = 10.0),
            with(|i| {
                i.thermal_throttle = true;
                i.max_temperature_c = 92
            }),
            with(|i| {
                i.thermal_throttle = true;
                i.power_throttle = true;
                i.host_memory_used = 0.99;
                i.ecc_corrected_per_min = 1000.0
            }),
        ] {
            assert!((0.3..=0.6).contains(&h.score), "{h:?}");
        }
    }

    #[test]
    fn excluded_band() {
        let ecc = with(|i| i.ecc_uncorrected = 1);
        assert!(ecc.score < 0.3 && ecc.score > 0.0 && ecc.reason.contains("uncorrected"));
        let probe = with(|i| i.probe = ProbeOutcome::Failed);
        assert!(probe.score < 0.3 && probe.score > 0.0 && probe.reason.contains("probe"));
        assert_eq!(band(probe.score), 1);
        // A probe that timed out while the engine kept processing tokens: busy, not stuck — a
        // minor penalty (as the slowest answered probe), never an exclusion.
        let busy = with(|i| i.probe = ProbeOutcome::TimedOutBusy);
        let slowest = with(|i| i.probe = ProbeOutcome::Ok { latency_ms: i.probe_timeout_ms });
        assert!((busy.score - slowest.score).abs() < 1e-12, "{busy:?} vs {slowest:?}");
        assert!(busy.score >= 0.3 && busy.reason.contains("busy"), "{busy:?}");
    }

    #[test]
    fn stale_stats_age_from_minor_to_significant_but_never_exclude() {
        let at = |age_ms: f64| with(|i| i.metrics_age_ms = age_ms);
        assert_eq!(at(999.0).score, 1.0);
        let just = at(1001.0);
        assert!((just.score - 0.9).abs() < 1e-3 && just.reason == "engine stats stale", "{just:?}");
        let mid = at(1000.0 + STALE_RAMP_MS / 2.0);
        assert!((mid.score - 0.7).abs() < 1e-9, "{mid:?}");
        let long = at(1000.0 + 10.0 * STALE_RAMP_MS);
        assert!((long.score - 0.5).abs() < 1e-9 && band(long.score) == 2, "{long:?}");
        // With other soft penalties it still stops at the floor, and a hard condition decides.
        let both = with(|i| {
            i.metrics_age_ms = 1e9;
            i.thermal_throttle = true;
            i.max_temperature_c = 95;
        });
        assert_eq!(both.score, 0.3);
        assert_eq!(
            with(|i| {
                i.metrics_age_ms = 1e9;
                i.engine_health_ok = false
            })
            .score,
            0.0
        );
    }

    #[test]
    fn unseen_gpus_are_a_named_penalty_never_silently_healthy() {
        let missing = with(|i| i.gpus = GpuVisibility::NotFound);
        assert_eq!((band(missing.score), missing.reason.as_str()), (3, "GPU not found on this node"));
        let unknown = with(|i| i.gpus = GpuVisibility::Unknown);
        assert_eq!((band(unknown.score), unknown.reason.as_str()), (3, "GPU assignment unknown"));
        // A hard condition still decides.
        let both = with(|i| {
            i.gpus = GpuVisibility::NotFound;
            i.probe = ProbeOutcome::Failed
        });
        assert_eq!(both.reason, "inference probe failing");
    }

    #[test]
    fn zero_band() {
        assert_eq!(with(|i| i.model_loaded = false).score, 0.0);
        assert_eq!(with(|i| i.engine_health_ok = false).score, 0.0);
        assert_eq!(with(|i| i.draining = true).reason, "draining");
        assert_eq!(band(0.0), 0);
    }

    proptest::proptest! {
        #[test]
        fn always_in_unit_interval(rate in 0.0f64..1e6, temp in 0u32..120, th: bool, pw: bool, mem in 0.0f64..1.5,
                                   lat in 0.0f64..1e5, unc in 0u64..3) {
            let h = health_score(&HealthInputs {
                ecc_corrected_per_min: rate, max_temperature_c: temp, thermal_throttle: th, power_throttle: pw,
                host_memory_used: mem, probe: ProbeOutcome::Ok { latency_ms: lat }, ecc_uncorrected: unc,
                ..Default::default()
            });
            proptest::prop_assert!((0.0..=1.0).contains(&h.score));
            proptest::prop_assert!(unc > 0 || h.score >= 0.3);
        }
    }
}
