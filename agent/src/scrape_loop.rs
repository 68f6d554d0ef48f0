//! One engine's scrape loop (docs/design.md §7): every scrape interval it reads the engine's
//! `/metrics`, every probe interval also `/health`, `/v1/models` and an active inference probe;
//! it samples the engine's GPUs and the host's memory, computes the pod's health score and
//! updates the pod's stats in the [`Hub`](crate::report::hub::Hub).
//!
//! Every engine's loop ticks from one shared start ([`NodeSources::first_scrape`]), so the tokio
//! timer wakes once per scrape interval for all engines rather than once per engine.
//!
//! Stale figures (docs/decisions/0024-bounded-outside-input.md): when `/metrics` fails or stops
//! parsing, the last good page's figures
//! are still reported (with its `observed_at_unix_ms`), but their age feeds the health score
//! ([`HealthInputs::metrics_age_ms`]): past [`stale_after`] they cost a growing penalty with the
//! reason "engine stats stale", so frozen figures never pass for a healthy pod.
//!
//! Concurrency: one task per engine; it owns its loop state and writes only its own pod (under
//! the pod's mutex). It ends when the agent's stop channel turns true.
//!
//! Layering: under the engine set (`engines.rs`), which starts one loop per engine and sends it
//! its [`GpuBinding`]; this module knows nothing of the set.

use crate::config::{AgentConfig, EngineConfig};
use crate::engine::metrics::EngineMetrics;
use crate::engine::scrape::{EngineClient, ScrapeError};
use crate::gpu::{GpuError, GpuRef, gpu_name};
use crate::health::{GpuVisibility, HealthInputs, ProbeOutcome, health_score};
use crate::node::NodeSources;
use crate::report::hub::Pod;
use crate::telemetry::{AgentMetrics, Labels, pod_label};
use kvroute_proto::agent::v1::PodStats;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// Window over which corrected ECC errors are counted into a per-minute rate.
const ECC_RATE_WINDOW: Duration = Duration::from_secs(60);

/// The GPUs one engine's scrape task samples.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GpuBinding {
    /// GPUs by NVML index or UUID.
    pub(crate) gpus: Vec<GpuRef>,
    /// Why the engine's GPUs are not known (PodResources unreachable, or listing none for the
    /// pod); `None` when `gpus` is the whole answer.
    pub(crate) unknown: Option<String>,
}

/// Age past which the engine's figures are stale: 5 scrape intervals, at least 1 s.
pub(crate) fn stale_after(scrape_every: Duration) -> Duration {
    (scrape_every * 5).max(Duration::from_secs(1))
}

/// Scrapes the engine, samples its GPUs (`gpus`, which may change while it runs) and the host,
/// computes health and updates the pod, until `stop` turns true.
pub(crate) async fn scrape_task(
    engine: EngineConfig,
    config: AgentConfig,
    pod: Arc<Pod>,
    gpus: watch::Receiver<Arc<GpuBinding>>,
    node: Arc<NodeSources>,
    metrics: Arc<AgentMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    // Every engine's task ticks from the same start: one timer wake-up per interval for all.
    let mut scrape = tokio::time::interval_at(node.first_scrape, Duration::from_millis(config.scrape_interval_ms));
    scrape.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut state = ScrapeLoop::new(engine, &config, pod, gpus, node, metrics);
    loop {
        tokio::select! {
            _ = scrape.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        state.iteration().await;
    }
}

/// One engine's loop state between iterations.
struct ScrapeLoop {
    engine: EngineConfig,
    pod: Arc<Pod>,
    gpus: watch::Receiver<Arc<GpuBinding>>,
    /// The last GPU problem logged (logged again only when it changes).
    gpu_problem: Option<String>,
    node: Arc<NodeSources>,
    metrics: Arc<AgentMetrics>,
    labels: Labels,
    client: EngineClient,
    probe_timeout: Duration,
    probe_every: Duration,
    scrape_every: Duration,
    last_probe: Option<Instant>,
    health_ok: bool,
    model_loaded: bool,
    probe: ProbeOutcome,
    ecc: EccRate,
    /// The latest `/metrics` page that parsed and when it was read (unix ms).
    last_metrics: Option<(EngineMetrics, i64)>,
    /// When that page was read; the loop's start before the first one.
    last_good_metrics: Instant,
    /// When the last "engine not answering" WARN was logged; `None` while the engine answers.
    last_scrape_warn: Option<Instant>,
    /// Failed engine requests since that line.
    scrape_failures_unlogged: u64,
}

/// Least time between two "engine not answering" WARN lines of one engine.
const SCRAPE_WARN_EVERY: Duration = Duration::from_secs(30);

impl ScrapeLoop {
    fn new(
        engine: EngineConfig,
        config: &AgentConfig,
        pod: Arc<Pod>,
        gpus: watch::Receiver<Arc<GpuBinding>>,
        node: Arc<NodeSources>,
        metrics: Arc<AgentMetrics>,
    ) -> Self {
        let probe_timeout = Duration::from_millis(config.probe_timeout_ms);
        Self {
            labels: pod_label(&engine.pod),
            client: EngineClient::new(&engine.endpoint, probe_timeout),
            engine,
            pod,
            gpus,
            gpu_problem: None,
            node,
            metrics,
            probe_timeout,
            probe_every: Duration::from_millis(config.probe_interval_ms),
            scrape_every: Duration::from_millis(config.scrape_interval_ms),
            last_probe: None,
            health_ok: false,
            model_loaded: false,
            probe: ProbeOutcome::Unknown,
            ecc: EccRate::default(),
            last_metrics: None,
            last_good_metrics: Instant::now(),
            last_scrape_warn: None,
            scrape_failures_unlogged: 0,
        }
    }

    /// One tick: checks (when due), scrape, health, stats.
    async fn iteration(&mut self) {
        // Set when this iteration's probe ran past its deadline: the processed-token counters of
        // the scrape before it, compared below with this iteration's scrape (busy or stuck).
        let mut timed_out_at_tokens: Option<Option<f64>> = None;
        if self.last_probe.is_none_or(|t| t.elapsed() >= self.probe_every) {
            self.last_probe = Some(Instant::now());
            timed_out_at_tokens = self.check_engine().await;
        }
        self.scrape_metrics().await;
        if let Some(before) = timed_out_at_tokens {
            // A probe past its deadline on an engine whose token counters rose meanwhile queued
            // behind real work (busy); counters standing still = live but stuck.
            self.probe = probe_after_timeout(before, self.tokens_processed());
            if self.probe == ProbeOutcome::TimedOutBusy {
                tracing::info!(pod = %self.engine.pod, "inference probe timed out behind a busy queue");
            } else {
                tracing::warn!(pod = %self.engine.pod, "inference probe timed out and the engine made no progress");
            }
        }
        let stats = self.stats();
        self.pod.update_stats(stats, false);
    }

    /// `/health`, `/v1/models` and the inference probe. Returns, when the probe ran past its
    /// deadline, the processed-token counters of the last scrape before it.
    async fn check_engine(&mut self) -> Option<Option<f64>> {
        self.health_ok = match self.client.health().await {
            Ok(()) => true,
            Err(e) => {
                self.scrape_err(e);
                false
            }
        };
        match self.client.model().await {
            Ok(Some(id)) => {
                self.model_loaded = true;
                if self.engine.model.is_none() && self.pod.model() != id {
                    self.pod.set_model(&id, None);
                }
            }
            Ok(None) => self.model_loaded = false,
            Err(e) => {
                self.model_loaded = false;
                self.scrape_err(e);
            }
        }
        let model = self.pod.model();
        if !self.health_ok || model.is_empty() {
            return None;
        }
        let mut timed_out_at_tokens = None;
        self.probe = match self.client.probe(&model, self.probe_timeout).await {
            Ok(lat) => ProbeOutcome::Ok { latency_ms: lat.as_secs_f64() * 1e3 },
            Err(e) if e.is_timeout() => {
                // Busy or stuck? Decided by the token counters after this scrape.
                timed_out_at_tokens = Some(self.tokens_processed());
                ProbeOutcome::Failed
            }
            Err(e) => {
                tracing::warn!(pod = %self.engine.pod, error = %e, "inference probe failed");
                ProbeOutcome::Failed
            }
        };
        timed_out_at_tokens
    }

    /// Reads `/metrics`; keeps the page and follows the engine's block size.
    async fn scrape_metrics(&mut self) {
        let observed_at = now_unix_ms();
        match self.client.metrics().await {
            Ok(m) => {
                if let Some(b) = m.block_size
                    && self.pod.block_size() != b
                {
                    self.pod.set_model(&self.pod.model(), Some(b));
                }
                self.last_metrics = Some((m, observed_at));
                self.last_good_metrics = Instant::now();
                self.scrape_ok();
            }
            Err(e) => self.scrape_err(e),
        }
    }

    fn tokens_processed(&self) -> Option<f64> {
        self.last_metrics.as_ref().and_then(|(m, _)| m.tokens_processed)
    }

    /// The pod's stats from the latest page, the GPUs, the host and the checks; records the
    /// health score metric.
    fn stats(&mut self) -> PodStats {
        let (m, observed_at) = self.last_metrics.clone().unwrap_or_default();
        // NVML's `utilization.gpu` is the share of time a kernel ran: ≈ 1 for an engine that is
        // stepping, whatever its batch, 0 for an idle one. The mock follows that meaning.
        let load = if m.num_requests_running > 0 { 1.0 } else { 0.0 };
        let mut inputs = HealthInputs {
            engine_health_ok: self.health_ok,
            model_loaded: self.model_loaded,
            probe: self.probe,
            probe_timeout_ms: self.probe_timeout.as_millis() as f64,
            max_temperature_c: 0,
            metrics_age_ms: self.last_good_metrics.elapsed().as_secs_f64() * 1e3,
            metrics_stale_after_ms: stale_after(self.scrape_every).as_secs_f64() * 1e3,
            ..Default::default()
        };
        let (mut util, mut corrected) = (0.0f64, 0u64);
        let binding = self.gpus.borrow().clone();
        let mut problem = binding.unknown.clone();
        if problem.is_some() {
            inputs.gpus = GpuVisibility::Unknown;
        }
        for g in &binding.gpus {
            match self.node.gpu.sample(g, load) {
                Ok(s) => {
                    util = util.max(f64::from(s.utilization_gpu_pct) / 100.0);
                    corrected += s.ecc_corrected_volatile;
                    inputs.ecc_uncorrected += s.ecc_uncorrected_volatile;
                    inputs.max_temperature_c = inputs.max_temperature_c.max(s.temperature_c);
                    inputs.thermal_throttle |= s.thermal_throttle;
                    inputs.power_throttle |= s.power_throttle;
                }
                Err(e @ GpuError::NotFound { .. }) => {
                    inputs.gpus = GpuVisibility::NotFound;
                    problem.get_or_insert_with(|| e.to_string());
                }
                Err(e) => {
                    problem.get_or_insert_with(|| format!("GPU {} sample failed: {e}", gpu_name(g)));
                }
            }
        }
        if problem != self.gpu_problem {
            match &problem {
                Some(p) => tracing::warn!(pod = %self.engine.pod, problem = %p, "engine GPUs not seen"),
                None => tracing::info!(pod = %self.engine.pod, gpus = ?binding.gpus, "engine GPUs seen"),
            }
            self.gpu_problem = problem;
        }
        inputs.ecc_corrected_per_min = self.ecc.per_window(Instant::now(), corrected) as f64;
        if let Some(used) = self.node.host_memory.used(self.scrape_every) {
            inputs.host_memory_used = used;
        }
        let health = health_score(&inputs);
        let lora = m.lora.unwrap_or_default();
        let stats = PodStats {
            observed_at_unix_ms: observed_at,
            num_requests_waiting: m.num_requests_waiting,
            num_requests_running: m.num_requests_running,
            kv_cache_usage: m.kv_cache_usage,
            gpu_utilization: util.clamp(0.0, 1.0),
            health_score: health.score,
            health_reason: health.reason,
            running_adapters: lora.running,
            waiting_adapters: lora.waiting,
            ready: self.health_ok && self.model_loaded,
        };
        self.export(&stats);
        stats
    }

    /// Sets the pod's gauges from the stats it reports.
    fn export(&self, s: &PodStats) {
        let m = &self.metrics;
        m.health_score.get_or_create(&self.labels).set(s.health_score);
        m.requests_waiting.get_or_create(&self.labels).set(i64::from(s.num_requests_waiting));
        m.requests_running.get_or_create(&self.labels).set(i64::from(s.num_requests_running));
        m.kv_cache_usage.get_or_create(&self.labels).set(s.kv_cache_usage);
        m.gpu_utilization.get_or_create(&self.labels).set(s.gpu_utilization);
        m.engine_ready.get_or_create(&self.labels).set(i64::from(s.ready));
    }

    /// Counts a failed engine request and logs it: WARN with the cause (refused, DNS, TLS,
    /// timeout, ...) on the first failure and then at most once per [`SCRAPE_WARN_EVERY`] while
    /// the engine keeps failing (with the count since the last line); DEBUG otherwise.
    fn scrape_err(&mut self, e: ScrapeError) {
        self.metrics.scrape_errors.get_or_create(&self.labels).inc();
        let now = Instant::now();
        self.scrape_failures_unlogged += 1;
        let due = self.last_scrape_warn.is_none_or(|t| now.duration_since(t) >= SCRAPE_WARN_EVERY);
        if due {
            tracing::warn!(pod = %self.engine.pod, cause = e.cause(), error = %e,
                failures = self.scrape_failures_unlogged, "engine not answering");
            self.last_scrape_warn = Some(now);
            self.scrape_failures_unlogged = 0;
        } else {
            tracing::debug!(pod = %self.engine.pod, cause = e.cause(), error = %e, "engine scrape failed");
        }
    }

    /// The engine answered `/metrics` again after failures: say so once.
    fn scrape_ok(&mut self) {
        if self.last_scrape_warn.take().is_some() {
            tracing::info!(pod = %self.engine.pod, "engine answering again");
            self.scrape_failures_unlogged = 0;
        }
    }
}

/// Corrected ECC errors over the last [`ECC_RATE_WINDOW`], from the GPUs' cumulative counters.
#[derive(Default)]
struct EccRate {
    samples: VecDeque<(Instant, u64)>,
}

impl EccRate {
    /// Records the cumulative count `corrected` at `now`; returns the increase since the oldest
    /// sample inside the window.
    fn per_window(&mut self, now: Instant, corrected: u64) -> u64 {
        self.samples.push_back((now, corrected));
        while self.samples.front().is_some_and(|(t, _)| now.duration_since(*t) > ECC_RATE_WINDOW) {
            self.samples.pop_front();
        }
        self.samples.front().map_or(0, |(_, c)| corrected.saturating_sub(*c))
    }
}

fn now_unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Outcome of a probe that ran past its deadline, from the engine's processed-token counters
/// before the probe and after it: rising = busy (the probe queued behind real work), else (also
/// when the page has no counters) failed, as a live but stuck engine.
fn probe_after_timeout(before: Option<f64>, after: Option<f64>) -> ProbeOutcome {
    match (before, after) {
        (Some(b), Some(a)) if a > b => ProbeOutcome::TimedOutBusy,
        _ => ProbeOutcome::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_probe_is_busy_only_when_tokens_were_processed_meanwhile() {
        assert_eq!(probe_after_timeout(Some(100.0), Some(164.0)), ProbeOutcome::TimedOutBusy);
        assert_eq!(probe_after_timeout(Some(100.0), Some(100.0)), ProbeOutcome::Failed);
        // Counters reset (engine restarted) or missing: no evidence of progress.
        assert_eq!(probe_after_timeout(Some(100.0), Some(3.0)), ProbeOutcome::Failed);
        assert_eq!(probe_after_timeout(None, Some(3.0)), ProbeOutcome::Failed);
        assert_eq!(probe_after_timeout(Some(3.0), None), ProbeOutcome::Failed);
    }
}
