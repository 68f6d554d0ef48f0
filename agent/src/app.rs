//! The agent's library entry point, wiring only: builds the per-pod state ([`Hub`]), starts the
//! KV-event reader thread for all engines (see [`subscriber`]; each pod's [`PodSink`] applies its
//! batches), one [`scrape_loop`](crate::scrape_loop) task per engine, a report ticker, one stream
//! task per picker and the metrics listener.
//!
//! Concurrency: tasks and the reader thread share only the [`Hub`] (per-pod mutexes, broadcast
//! channel) and the metric handles. A pod is written by the reader thread (blocks) and its
//! engine's scrape task (stats, model), each under the pod's mutex. Shutdown: a watch channel for
//! tasks and an atomic flag for the ZMQ thread (it looks at it at least every 500 ms); picker
//! streams send what is queued and end their side cleanly (see [`RunningAgent::shutdown`]).

use crate::config::AgentConfig;
use crate::engine::subscriber::{self, SubscriberConfig};
use crate::gpu::GpuSource;
use crate::node::NodeSources;
use crate::report::hub::Hub;
use crate::report::sink::PodSink;
use crate::report::stream::{AgentIdentity, run_picker_stream};
use crate::scrape_loop::scrape_task;
use crate::telemetry::AgentMetrics;
use kvroute_common::listener::{self, ListenerLimits};
use kvroute_proto::agent::v1::PodInfo;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
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
    let hub = Hub::new(infos, config.delta_queue);
    for pod in hub.pods() {
        pod.set_block_capacity(config.max_blocks_per_engine);
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_threads = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();

    // Header-read and idle timeouts and a connection bound (issue 17): a half-sent request does
    // not hold a socket for ever, and many of them do not starve /healthz.
    let limits = ListenerLimits {
        header_read_timeout: Duration::from_millis(config.metrics_header_timeout_ms),
        max_connections: config.metrics_max_connections,
        ..ListenerLimits::default()
    };
    let router = metrics.router();
    let mut srv_stop = stop_rx.clone();
    tasks.spawn(listener::serve(listener, router, limits, async move {
        let _ = srv_stop.wait_for(|s| *s).await;
    }));

    // The report ticker holds the only strong `alive`: when it ends (or is aborted with the task
    // set), the reader thread sees its sinks closed and exits.
    let alive = Arc::new(());
    let node = Arc::new(NodeSources::new(gpu));
    let mut subscriptions = Vec::new();
    for (engine, pod) in config.engines.iter().zip(hub.pods().iter().cloned()) {
        if let Some(kv_events) = &engine.kv_events {
            let sub_cfg = SubscriberConfig {
                pod: engine.pod.clone(),
                kv_events: kv_events.clone(),
                kv_replay: engine.kv_replay.clone(),
                replay_timeout: Duration::from_millis(config.kv_replay_timeout_ms),
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
