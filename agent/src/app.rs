//! The agent's library entry point: builds the per-pod state, starts the KV-event reader thread
//! (all engines), one scrape task per engine, a report ticker, one stream task per picker and the
//! metrics listener.
//!
//! KV events: the reader thread reads every engine's batches once per `block_flush_ms` window
//! (see [`subscriber`]), applies each to its pod's record itself ([`PodSink`]) and, at the end
//! of the pass, sends what every pod applied as one delta per pod with changes. So a change
//! waits at most one window and the tokio side is woken once per window by the deltas, with no
//! per-batch hand-off and no flush timer of its own.
//!
//! Scrape tasks tick in phase (one shared start), so the tokio timer wakes once per scrape
//! interval for all engines rather than once per engine.
//!
//! Concurrency: tasks and the reader thread share only the [`Hub`] (per-pod mutexes, broadcast
//! channel) and the metric handles. A pod is written by the reader thread (blocks) and its
//! engine's scrape task (stats, model), each under the pod's mutex. Shutdown: a watch channel for
//! tasks and an atomic flag for the ZMQ thread (it looks at it at least every 500 ms); picker
//! streams send what is queued and end their side cleanly (see [`RunningAgent::shutdown`]).

use crate::config::{AgentConfig, EngineConfig};
use crate::engine::kv_events::{KvEvent, KvMessage};
use crate::engine::scrape::EngineClient;
use crate::engine::subscriber::{self, EventSink, SubscriberConfig};
use crate::gpu::GpuSource;
use crate::health::{HealthInputs, ProbeOutcome, health_score};
use crate::report::hub::{Hub, Pod};
use crate::report::stream::{AgentIdentity, run_picker_stream};
use crate::telemetry::{AgentMetrics, pod_label};
use kvroute_proto::agent::v1::{PodInfo, PodStats};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// Start-up errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The metrics listener could not bind.
    #[error("cannot bind metrics listener {addr}: {source}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// I/O error.
        source: std::io::Error,
    },
    /// A subscriber thread could not start.
    #[error("cannot start KV-event thread for {pod}: {source}")]
    Thread {
        /// Pod.
        pod: String,
        /// I/O error.
        source: std::io::Error,
    },
}

/// A started agent. Dropping it does not stop it; call [`RunningAgent::shutdown`].
pub struct RunningAgent {
    /// Bound address of `/metrics` and `/healthz`.
    pub metrics_addr: SocketAddr,
    /// Per-pod state (for tests and introspection).
    pub hub: Arc<Hub>,
    /// Metric handles.
    pub metrics: Arc<AgentMetrics>,
    stop_tx: watch::Sender<bool>,
    stop_threads: Arc<AtomicBool>,
    tasks: JoinSet<()>,
}

impl RunningAgent {
    /// Graceful stop (SIGTERM): stops the KV-event threads and scrapes, flushes every pod's
    /// pending block changes, lets each picker stream send what is queued and close its side
    /// (bounded by [`crate::report::stream::CLOSE_GRACE`]), then waits at most
    /// [`SHUTDOWN_GRACE`] for the tasks before aborting the rest.
    pub async fn shutdown(mut self) {
        self.stop_threads.store(true, Ordering::Relaxed);
        for p in self.hub.pods() {
            p.flush_blocks();
        }
        let _ = self.stop_tx.send(true);
        let all_done = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(SHUTDOWN_GRACE, all_done).await.is_err() {
            tracing::warn!("tasks still running after the shutdown grace; aborting them");
        }
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        tracing::info!("agent stopped");
    }
}

/// Longest graceful shutdown before remaining tasks are aborted.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);

fn now_unix_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Starts the agent. Returns once the metrics listener is bound (print READY then).
pub async fn start(config: AgentConfig, gpu: Arc<dyn GpuSource>) -> Result<RunningAgent, AgentError> {
    let metrics = AgentMetrics::new();
    let listener = tokio::net::TcpListener::bind(config.metrics_addr)
        .await
        .map_err(|source| AgentError::Bind { addr: config.metrics_addr, source })?;
    let metrics_addr =
        listener.local_addr().map_err(|source| AgentError::Bind { addr: config.metrics_addr, source })?;
    let infos = config
        .engines
        .iter()
        .map(|e| PodInfo {
            pod: e.pod.clone(),
            endpoint: e.endpoint.clone(),
            model: e.model.clone().unwrap_or_default(),
            block_size: e.block_size,
            annotations: e.annotations.clone().into_iter().collect(),
        })
        .collect();
    let hub = Hub::new(infos, 4096);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_threads = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();

    let router = metrics.router();
    let mut srv_stop = stop_rx.clone();
    tasks.spawn(async move {
        let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
            let _ = srv_stop.wait_for(|s| *s).await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "metrics listener failed");
        }
    });

    // The report ticker holds the only strong `alive`: when it ends (or is aborted with the task
    // set), the reader thread sees its sinks closed and exits.
    let alive = Arc::new(());
    let node = Arc::new(NodeSources { gpu, host_memory: HostMemory::new(), first_scrape: tokio::time::Instant::now() });
    let mut subscriptions = Vec::new();
    for (engine, pod) in config.engines.iter().zip(hub.pods().iter().cloned()) {
        if let Some(kv_events) = &engine.kv_events {
            let sub_cfg = SubscriberConfig {
                pod: engine.pod.clone(),
                kv_events: kv_events.clone(),
                kv_replay: engine.kv_replay.clone(),
                replay_timeout: Duration::from_secs(1),
            };
            subscriptions.push((sub_cfg, PodSink::new(pod.clone(), Arc::downgrade(&alive), &metrics)));
        }
        tasks.spawn(scrape_task(engine.clone(), config.clone(), pod, node.clone(), metrics.clone(), stop_rx.clone()));
    }
    if !subscriptions.is_empty() {
        // One ZeroMQ context (one I/O thread) and one reader thread for every engine.
        let window = Duration::from_millis(config.block_flush_ms);
        subscriber::spawn(zmq::Context::new(), subscriptions, window, metrics.clone(), stop_threads.clone())
            .map_err(|source| AgentError::Thread { pod: "kv-events".into(), source })?;
    }

    let tick_hub = hub.clone();
    let report_every = Duration::from_millis(config.report_interval_ms);
    let mut tick_stop = stop_rx.clone();
    tasks.spawn(async move {
        let _alive = alive;
        let mut iv = tokio::time::interval(report_every);
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = iv.tick() => {}
                _ = tick_stop.wait_for(|s| *s) => return,
            }
            for p in tick_hub.pods() {
                p.tick();
            }
        }
    });

    let node_name = config.resolved_node_name();
    let id = AgentIdentity { agent_id: format!("{node_name}-{}", std::process::id()), node_name };
    for picker in &config.pickers {
        tasks.spawn(run_picker_stream(picker.clone(), hub.clone(), id.clone(), metrics.clone(), stop_rx.clone()));
    }
    tracing::info!(%metrics_addr, engines = config.engines.len(), pickers = config.pickers.len(), "agent started");
    Ok(RunningAgent { metrics_addr, hub, metrics, stop_tx, stop_threads, tasks })
}

/// The agent's [`EventSink`]: applies batches to the pod's record on the reader thread and sends
/// the pod's changes at the end of each read pass.
struct PodSink {
    pod: Arc<Pod>,
    alive: Weak<()>,
    dropped: prometheus_client::metrics::counter::Counter,
    block_events: prometheus_client::metrics::counter::Counter,
}

impl PodSink {
    fn new(pod: Arc<Pod>, alive: Weak<()>, metrics: &AgentMetrics) -> Self {
        let labels = pod_label(pod.name());
        let dropped = metrics.kv_blocks_dropped.get_or_create(&labels).clone();
        let block_events = metrics.kv_block_events.get_or_create(&labels).clone();
        Self { pod, alive, dropped, block_events }
    }
}

impl EventSink for PodSink {
    fn batch(&mut self, msg: KvMessage) {
        let blocks: usize = msg
            .batch
            .events
            .iter()
            .map(|e| match e {
                KvEvent::Stored(s) => s.block_hashes.len(),
                KvEvent::Removed { block_hashes, .. } => block_hashes.len(),
                KvEvent::AllCleared | KvEvent::Untrusted(_) => 0,
            })
            .sum();
        self.block_events.inc_by(blocks as u64);
        let out = self.pod.apply_batch(&msg.batch);
        let dropped =
            out.dropped_unknown_parent + out.skipped_extra_keys + out.dropped_short_tokens + out.dropped_capacity;
        if dropped > 0 {
            self.dropped.inc_by(dropped);
            tracing::debug!(pod = %self.pod.name(), seq = msg.seq, ?out, "blocks dropped");
        }
    }

    fn reset(&mut self, reason: &str) {
        tracing::warn!(pod = %self.pod.name(), %reason, "clearing pod blocks");
        self.pod.clear_blocks();
    }

    fn flush(&mut self) {
        self.pod.flush_blocks();
    }

    fn is_closed(&self) -> bool {
        self.alive.strong_count() == 0
    }
}

/// What every engine's scrape task reads from the node.
struct NodeSources {
    gpu: Arc<dyn GpuSource>,
    host_memory: HostMemory,
    /// First tick of every scrape task (they tick in phase).
    first_scrape: tokio::time::Instant,
}

/// The host's memory use, read at most once per `max_age` for all engines (one host: reading
/// `/proc/meminfo` once per engine per scrape was ~2 % of the agent's CPU under load, issue 5).
struct HostMemory {
    state: parking_lot::Mutex<HostMemoryState>,
}

/// The reader (absent where sysinfo cannot read the host) and the last reading (when, used).
type HostMemoryState = (Option<sysinfo::System>, Option<(Instant, f64)>);

impl HostMemory {
    fn new() -> Self {
        Self { state: parking_lot::Mutex::new((sysinfo::System::new().ok(), None)) }
    }

    /// Used fraction of host memory (1 − available / total), at most `max_age` old; `None` when
    /// unknown.
    fn used(&self, max_age: Duration) -> Option<f64> {
        let mut g = self.state.lock();
        if let Some((at, used)) = g.1
            && at.elapsed() < max_age
        {
            return Some(used);
        }
        let sys = g.0.as_mut()?;
        sys.refresh_memory();
        let total = sys.total_memory();
        if total == 0 {
            return None;
        }
        let used = 1.0 - sys.available_memory() as f64 / total as f64;
        g.1 = Some((Instant::now(), used));
        Some(used)
    }
}

/// Scrapes the engine, samples its GPUs and the host, computes health and updates the pod.
async fn scrape_task(
    engine: EngineConfig,
    config: AgentConfig,
    pod: Arc<Pod>,
    node: Arc<NodeSources>,
    metrics: Arc<AgentMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let NodeSources { gpu, host_memory, first_scrape } = &*node;
    let labels = pod_label(&engine.pod);
    let probe_timeout = Duration::from_millis(config.probe_timeout_ms);
    let client = EngineClient::new(&engine.endpoint, probe_timeout);
    // Every engine's task ticks from the same start: one timer wake-up per interval for all.
    let mut scrape = tokio::time::interval_at(*first_scrape, Duration::from_millis(config.scrape_interval_ms));
    scrape.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let probe_every = Duration::from_millis(config.probe_interval_ms);
    let mut last_probe: Option<Instant> = None;
    let (mut health_ok, mut model_loaded, mut probe) = (false, false, ProbeOutcome::Unknown);
    let mut ecc_window: VecDeque<(Instant, u64)> = VecDeque::new();
    let mut last_metrics: Option<(crate::engine::metrics::EngineMetrics, i64)> = None;
    loop {
        tokio::select! {
            _ = scrape.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // Set when this iteration's probe ran past its deadline: the processed-token counters of
        // the scrape before it, compared below with this iteration's scrape (busy or stuck).
        let mut timed_out_at_tokens: Option<Option<f64>> = None;
        if last_probe.is_none_or(|t| t.elapsed() >= probe_every) {
            last_probe = Some(Instant::now());
            health_ok = client.health().await.map_err(|e| scrape_err(&metrics, &labels, &engine.pod, e)).is_ok();
            match client.model().await {
                Ok(Some(id)) => {
                    model_loaded = true;
                    if engine.model.is_none() && pod.model() != id {
                        pod.set_model(&id, None);
                    }
                }
                Ok(None) => model_loaded = false,
                Err(e) => {
                    model_loaded = false;
                    scrape_err(&metrics, &labels, &engine.pod, e);
                }
            }
            let model = pod.model();
            if health_ok && !model.is_empty() {
                probe = match client.probe(&model, probe_timeout).await {
                    Ok(lat) => ProbeOutcome::Ok { latency_ms: lat.as_secs_f64() * 1e3 },
                    Err(e) if e.is_timeout() => {
                        // Busy or stuck? Decided by the token counters after this scrape.
                        timed_out_at_tokens = Some(last_metrics.as_ref().and_then(|(m, _)| m.tokens_processed));
                        ProbeOutcome::Failed
                    }
                    Err(e) => {
                        tracing::warn!(pod = %engine.pod, error = %e, "inference probe failed");
                        ProbeOutcome::Failed
                    }
                };
            }
        }
        let observed_at = now_unix_ms();
        match client.metrics().await {
            Ok(m) => {
                if let Some(b) = m.block_size
                    && pod.block_size() != b
                {
                    pod.set_model(&pod.model(), Some(b));
                }
                last_metrics = Some((m, observed_at));
            }
            Err(e) => scrape_err(&metrics, &labels, &engine.pod, e),
        }
        if let Some(before) = timed_out_at_tokens {
            // A probe past its deadline on an engine whose token counters rose meanwhile queued
            // behind real work (busy); counters standing still = live but stuck.
            probe = probe_after_timeout(before, last_metrics.as_ref().and_then(|(m, _)| m.tokens_processed));
            if probe == ProbeOutcome::TimedOutBusy {
                tracing::info!(pod = %engine.pod, "inference probe timed out behind a busy queue");
            } else {
                tracing::warn!(pod = %engine.pod, "inference probe timed out and the engine made no progress");
            }
        }
        let (m, observed_at) = last_metrics.clone().unwrap_or_default();
        let load = f64::from(m.num_requests_running) / f64::from(engine.max_num_seqs.max(1));
        let mut inputs = HealthInputs {
            engine_health_ok: health_ok,
            model_loaded,
            probe,
            probe_timeout_ms: config.probe_timeout_ms as f64,
            max_temperature_c: 0,
            ..Default::default()
        };
        let (mut util, mut corrected) = (0.0f64, 0u64);
        for &g in &engine.gpus {
            match gpu.sample(g, load) {
                Ok(s) => {
                    util = util.max(f64::from(s.utilization_gpu_pct) / 100.0);
                    corrected += s.ecc_corrected_volatile;
                    inputs.ecc_uncorrected += s.ecc_uncorrected_volatile;
                    inputs.max_temperature_c = inputs.max_temperature_c.max(s.temperature_c);
                    inputs.thermal_throttle |= s.thermal_throttle;
                    inputs.power_throttle |= s.power_throttle;
                }
                Err(e) => tracing::warn!(pod = %engine.pod, error = %e, "GPU sample failed"),
            }
        }
        let now = Instant::now();
        ecc_window.push_back((now, corrected));
        while ecc_window.front().is_some_and(|(t, _)| now.duration_since(*t) > Duration::from_secs(60)) {
            ecc_window.pop_front();
        }
        inputs.ecc_corrected_per_min = ecc_window.front().map_or(0, |(_, c)| corrected.saturating_sub(*c)) as f64;
        if let Some(used) = host_memory.used(Duration::from_millis(config.scrape_interval_ms)) {
            inputs.host_memory_used = used;
        }
        let health = health_score(&inputs);
        metrics.health_score.get_or_create(&labels).set(health.score);
        let lora = m.lora.clone().unwrap_or_default();
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
            ready: health_ok && model_loaded,
        };
        pod.update_stats(stats, false);
    }
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

fn scrape_err(metrics: &AgentMetrics, labels: &crate::telemetry::Labels, pod: &str, e: impl std::fmt::Display) {
    metrics.scrape_errors.get_or_create(labels).inc();
    tracing::debug!(pod, error = %e, "engine scrape failed");
}

#[cfg(test)]
mod tests {
    //! The reader thread with the agent's sink, over real ZeroMQ sockets: batches of several pods
    //! published inside one window go out as one delta per pod; a gap that cannot be replayed
    //! clears the pod; the thread exits once the sinks are closed.
    use super::*;

    const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

    /// The three frames (topic, seq, payload) of fixture batch `n` (seq = n).
    fn frames(n: usize) -> Vec<Vec<u8>> {
        let dir = format!("{}/../tests/fixtures/vllm-kv-events/v0.33", env!("CARGO_MANIFEST_DIR"));
        ["topic", "seq", "msgpack"]
            .iter()
            .map(|e| std::fs::read(format!("{dir}/batch-{n}.{e}")).expect("fixture"))
            .collect()
    }

    fn info(pod: &str) -> PodInfo {
        PodInfo { pod: pod.into(), model: MODEL.into(), block_size: 16, ..Default::default() }
    }

    /// An engine's publisher: XPUB (a PUB that also reports subscriptions) on a free port.
    struct Publisher {
        socket: zmq::Socket,
        endpoint: String,
    }

    impl Publisher {
        fn new(ctx: &zmq::Context) -> Self {
            let socket = ctx.socket(zmq::XPUB).expect("xpub");
            socket.set_rcvtimeo(10_000).expect("rcvtimeo");
            socket.bind("tcp://127.0.0.1:*").expect("bind");
            let endpoint = socket.get_last_endpoint().expect("endpoint").expect("utf-8");
            Self { socket, endpoint }
        }

        /// Blocks until a subscriber has subscribed (so nothing published after is lost).
        fn wait_subscriber(&self) {
            self.socket.recv_bytes(0).expect("a subscription within 10 s");
        }

        fn publish(&self, n: usize) {
            self.socket.send_multipart(frames(n), 0).expect("publish");
        }
    }

    /// Starts the reader on one publisher per pod of `hub`; returns the thread, the publishers,
    /// the strong `alive` of the sinks and the stop flag.
    fn start_reader(
        hub: &Hub,
        window: Duration,
        metrics: &Arc<AgentMetrics>,
    ) -> (std::thread::JoinHandle<()>, Vec<Publisher>, Arc<()>, Arc<AtomicBool>) {
        let ctx = zmq::Context::new();
        let alive = Arc::new(());
        let publishers: Vec<Publisher> = hub.pods().iter().map(|_| Publisher::new(&ctx)).collect();
        let subscriptions = hub
            .pods()
            .iter()
            .zip(&publishers)
            .map(|(pod, p)| {
                let cfg = SubscriberConfig {
                    pod: pod.name().into(),
                    kv_events: p.endpoint.clone(),
                    kv_replay: None,
                    replay_timeout: Duration::from_secs(1),
                };
                (cfg, PodSink::new(pod.clone(), Arc::downgrade(&alive), metrics))
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let reader =
            subscriber::spawn(ctx, subscriptions, window, metrics.clone(), stop.clone()).expect("reader thread");
        for p in &publishers {
            p.wait_subscriber();
        }
        (reader, publishers, alive, stop)
    }

    async fn next_delta(
        deltas: &mut tokio::sync::broadcast::Receiver<Arc<crate::report::hub::Outgoing>>,
    ) -> kvroute_proto::agent::v1::PodDelta {
        let o = tokio::time::timeout(Duration::from_secs(5), deltas.recv()).await.expect("a delta").expect("open");
        o.delta.clone()
    }

    #[tokio::test]
    async fn one_window_sends_one_delta_per_pod_with_every_batch() {
        let hub = Hub::new(vec![info("a"), info("b")], 64);
        let mut deltas = hub.subscribe();
        let metrics = AgentMetrics::new();
        let (reader, publishers, alive, _stop) = start_reader(&hub, Duration::from_millis(200), &metrics);
        // Both pods' engines publish two batches, well inside one 200 ms window.
        for p in &publishers {
            p.publish(0);
            p.publish(1);
        }
        let got = [next_delta(&mut deltas).await, next_delta(&mut deltas).await];
        let mut pods: Vec<&str> = got.iter().map(|d| d.pod.as_str()).collect();
        pods.sort_unstable();
        assert_eq!(pods, ["a", "b"]);
        let events: u64 = ["a", "b"].iter().map(|p| metrics.kv_block_events.get_or_create(&pod_label(p)).get()).sum();
        // Per pod: batch 0 stores 3 blocks, batch 1 stores 2.
        assert_eq!(events, 2 * 5);
        for d in &got {
            let blocks = d.blocks.as_ref().expect("block changes");
            let stored: usize = blocks.stored.iter().map(|r| r.hashes.len()).sum();
            // Batch 0 stores A's 3 blocks, batch 1 B's 2 new ones: both in the one delta.
            assert_eq!((d.seq, stored), (1, 5), "{d:?}");
        }
        // Nothing else in that window.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(deltas.try_recv().is_err());
        // A later batch opens a new window.
        publishers[0].publish(2);
        let d = next_delta(&mut deltas).await;
        assert_eq!((d.pod.as_str(), d.seq), ("a", 2));
        assert_eq!(d.blocks.as_ref().map(|b| b.removed.len()), Some(1));
        // The sinks closed (the agent's tasks gone), the thread exits.
        drop(alive);
        tokio::task::spawn_blocking(move || reader.join().expect("reader exits cleanly")).await.expect("join");
    }

    #[tokio::test]
    async fn a_gap_without_replay_clears_the_pod_and_stop_ends_the_reader() {
        let hub = Hub::new(vec![info("a")], 64);
        let mut deltas = hub.subscribe();
        let (reader, publishers, _alive, stop) = start_reader(&hub, Duration::from_millis(20), &AgentMetrics::new());
        publishers[0].publish(0);
        let d = next_delta(&mut deltas).await;
        assert!(!d.blocks.as_ref().expect("blocks").cleared, "{d:?}");
        // seq 1 lost, no replay endpoint: the record is cleared (under-claim), then batch 2
        // applies to the empty record.
        publishers[0].publish(2);
        let d = next_delta(&mut deltas).await;
        assert!(d.blocks.as_ref().expect("blocks").cleared, "{d:?}");
        assert_eq!(hub.pods()[0].snapshot().blocks.iter().map(|r| r.hashes.len()).sum::<usize>(), 0);
        stop.store(true, Ordering::Relaxed);
        tokio::task::spawn_blocking(move || reader.join().expect("reader exits cleanly")).await.expect("join");
    }

    #[test]
    fn a_timed_out_probe_is_busy_only_when_tokens_were_processed_meanwhile() {
        assert_eq!(probe_after_timeout(Some(100.0), Some(164.0)), ProbeOutcome::TimedOutBusy);
        assert_eq!(probe_after_timeout(Some(100.0), Some(100.0)), ProbeOutcome::Failed);
        // Counters reset (engine restarted) or missing: no evidence of progress.
        assert_eq!(probe_after_timeout(Some(100.0), Some(3.0)), ProbeOutcome::Failed);
        assert_eq!(probe_after_timeout(None, Some(3.0)), ProbeOutcome::Failed);
        assert_eq!(probe_after_timeout(Some(3.0), None), ProbeOutcome::Failed);
    }

    #[test]
    fn host_memory_is_read_once_per_max_age() {
        let host = HostMemory::new();
        let Some(first) = host.used(Duration::from_secs(3600)) else { return }; // no /proc here
        assert!((0.0..=1.0).contains(&first), "{first}");
        let at = host.state.lock().1.map(|(t, _)| t);
        // Within max_age: the same reading, not a new one.
        assert_eq!(host.used(Duration::from_secs(3600)), Some(first));
        assert_eq!(host.state.lock().1.map(|(t, _)| t), at);
        // Past max_age (zero): a fresh reading.
        host.used(Duration::ZERO);
        assert_ne!(host.state.lock().1.map(|(t, _)| t), at);
    }
}
