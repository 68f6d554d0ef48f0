//! The agent's library entry point, wiring only: builds the per-pod state ([`Hub`]), starts the
//! KV-event reader thread for all engines (see [`subscriber`]; each pod's [`PodSink`] applies its
//! batches), the engine set (see [`crate::engines`]: one scrape task per engine, engines coming
//! and going with the engine source), a report ticker, the picker set (see [`crate::pickers`]:
//! one stream task per picker replica) and the metrics listener.
//!
//! Sources (docs/design.md §14): engines from the InferencePool's pods on this node (Kubernetes),
//! a watched engine file, or the config's static list; pickers from the picker's headless
//! Service (Kubernetes) or a static list; GPUs from the kubelet's PodResources (Kubernetes) or the
//! engine source. The Kubernetes client is `Client::try_default()` (in-cluster service account,
//! else `$KUBECONFIG`) unless the caller passes one ([`start_with`]).
//!
//! Concurrency: tasks and the reader thread share only the [`Hub`] (per-pod mutexes, broadcast
//! channel) and the metric handles. A pod is written by the reader thread (blocks) and its
//! engine's scrape task (stats, model), each under the pod's mutex. Shutdown: a watch channel for
//! tasks and an atomic flag for the ZMQ thread (it looks at it at least every 500 ms); picker
//! streams send what is queued and end their side cleanly (see [`RunningAgent::shutdown`]).

use crate::config::{AgentConfig, ConfigError, EngineSource, PickerSource};
use crate::engine::subscriber;
use crate::engines::{EngineSetDeps, GpuAssignment, start_engine_set};
use crate::gpu::GpuSource;
use crate::node::NodeSources;
use crate::pickers::{Replicas, run_picker_set};
use crate::report::hub::Hub;
use crate::report::sink::PodSink;
use crate::report::stream::AgentIdentity;
use crate::telemetry::AgentMetrics;
use kvroute_cluster::{ClusterError, NodeView, PodResourcesClient};
use kvroute_common::listener::{self, ListenerLimits};
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
    /// The configuration is invalid (or, for Kubernetes, `NODE_NAME` is unset).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The Kubernetes client could not be built (no in-cluster service account, no kubeconfig).
    #[error("Kubernetes sources (pool / picker_service) need API access: {0}")]
    Kubernetes(#[source] ClusterError),
    /// Neither `picker_tls` nor `insecure_ingest` was configured.
    #[error(
        "reports to the pickers are not secured: set picker_tls (ca_file) with picker_token (a projected \
         ServiceAccount token) or with cert_file and key_file, or pass --insecure-ingest (config insecure_ingest: \
         true) for plaintext"
    )]
    InsecureIngest,
    /// A `picker_tls` or `picker_token` file cannot be read.
    #[error("picker_tls/picker_token: cannot read {path}: {source}")]
    TlsFile {
        /// The file.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
    /// The engine file's first read failed (later bad edits keep the last good one).
    #[error("engine file: {0}")]
    EngineFile(#[source] ClusterError),
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
        for p in self.hub.pods().iter() {
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

/// Starts the agent. Returns once the metrics listener is bound (print READY then). Kubernetes
/// sources get a client from the environment.
pub async fn start(config: AgentConfig, gpu: Arc<dyn GpuSource>) -> Result<RunningAgent, AgentError> {
    start_with(config, gpu, None).await
}

/// [`start`] with a Kubernetes client of the caller's (tests: the API stand-in).
pub async fn start_with(
    config: AgentConfig,
    gpu: Arc<dyn GpuSource>,
    client: Option<kube::Client>,
) -> Result<RunningAgent, AgentError> {
    config.validate()?;
    match &config.picker_tls {
        Some(tls) => {
            let token = config.picker_token.as_ref().map(|t| &t.token_file);
            for path in [Some(&tls.ca_file), tls.cert_file.as_ref(), tls.key_file.as_ref(), token].into_iter().flatten()
            {
                std::fs::metadata(path).map_err(|source| AgentError::TlsFile { path: path.clone(), source })?;
            }
        }
        None if config.insecure_ingest => tracing::warn!(
            "--insecure-ingest: reports go to the pickers in plaintext, and the pickers are not authenticated \
             (use picker_tls outside a local demo)"
        ),
        None => return Err(AgentError::InsecureIngest),
    }
    let engine_source = config.engine_source()?;
    let picker_source = config.picker_source()?;
    let needs_kube =
        matches!(engine_source, EngineSource::Kubernetes(_)) || matches!(picker_source, PickerSource::Service { .. });
    let client = match client {
        Some(c) => Some(c),
        None if needs_kube => Some(kvroute_cluster::client_from_env().await.map_err(AgentError::Kubernetes)?),
        None => None,
    };
    let node_name = match &engine_source {
        EngineSource::Kubernetes(_) => config.kubernetes_node_name()?,
        _ => config.resolved_node_name(),
    };

    let metrics = AgentMetrics::new();
    let listener = tokio::net::TcpListener::bind(config.metrics_addr)
        .await
        .map_err(|source| AgentError::Bind { addr: config.metrics_addr, source })?;
    let metrics_addr =
        listener.local_addr().map_err(|source| AgentError::Bind { addr: config.metrics_addr, source })?;

    // The engines: a view that changes (Kubernetes, engine file) or not (static list).
    let (view, keep_static, assignment) = match (&engine_source, &client) {
        (EngineSource::Kubernetes(pool), Some(c)) => {
            let watched = kvroute_cluster::watch_node(c.clone(), pool.clone(), node_name.clone());
            let socket = std::path::Path::new(&config.pod_resources_socket);
            let pr = PodResourcesClient::connect(socket).map_err(AgentError::Kubernetes)?;
            let poll = Duration::from_millis(config.pod_resources_poll_ms);
            tracing::info!(pool = %pool.name, namespace = %pool.namespace, node = %node_name, "engines: the pool's pods on this node");
            (watched.subscribe(), None, GpuAssignment::PodResources { client: pr, poll })
        }
        (EngineSource::File { path, poll }, _) => {
            let watched = kvroute_cluster::watch_engine_file(std::path::Path::new(path), &node_name, *poll)
                .await
                .map_err(AgentError::EngineFile)?;
            tracing::info!(%path, "engines: the engine file (watched)");
            (watched.subscribe(), None, GpuAssignment::FromSource)
        }
        (EngineSource::Static(view), _) => {
            let (tx, rx) = watch::channel::<Arc<NodeView>>(view.clone());
            (rx, Some(tx), GpuAssignment::FromSource)
        }
        (EngineSource::Kubernetes(_), None) => {
            return Err(AgentError::Kubernetes(ClusterError::KubeConfig("no client".into())));
        }
    };
    let replicas = match (&picker_source, &client) {
        (PickerSource::Service { namespace, name, port }, Some(c)) => {
            tracing::info!(service = %name, %namespace, %port, "pickers: the Service's EndpointSlices");
            Replicas::Service(kvroute_cluster::watch_picker_replicas(c.clone(), namespace, name, Some(port)))
        }
        (PickerSource::Static(list), _) => Replicas::Static(list.clone()),
        (PickerSource::Service { .. }, None) => {
            return Err(AgentError::Kubernetes(ClusterError::KubeConfig("no client".into())));
        }
    };

    let hub = Hub::new(Vec::new(), config.delta_queue);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_threads = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();

    // Header-read and idle timeouts and a connection bound (docs/decisions/0024-bounded-outside-input.md):
    // a half-sent request does not hold a socket for ever, and many of them do not starve /healthz.
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

    // One ZeroMQ context (one I/O thread) and one reader thread for every engine, engines added
    // and removed as they come and go. The report ticker holds the only strong `alive`: when it
    // ends (or is aborted with the task set), the sinks close.
    let alive = Arc::new(());
    let window = Duration::from_millis(config.block_flush_ms);
    let (_reader, reader) =
        subscriber::spawn_dynamic::<PodSink>(zmq::Context::new(), window, metrics.clone(), stop_threads.clone())
            .map_err(|source| AgentError::Thread { pod: "kv-events".into(), source })?;
    let deps = EngineSetDeps {
        hub: hub.clone(),
        config: config.clone(),
        node: Arc::new(NodeSources::new(gpu)),
        metrics: metrics.clone(),
        reader,
        alive: Arc::downgrade(&alive),
    };
    let engine_set = start_engine_set(view, assignment, deps, stop_rx.clone()).await;
    tasks.spawn(async move {
        let _keep_static = keep_static;
        engine_set.await;
    });

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
            for p in tick_hub.pods().iter() {
                p.tick();
            }
        }
    });

    let id = AgentIdentity {
        agent_id: format!("{node_name}-{}", std::process::id()),
        node_name,
        tls: config.picker_tls.clone().map(Arc::new),
        token: config.picker_token.clone().map(Arc::new),
    };
    tasks.spawn(run_picker_set(replicas, hub.clone(), id, metrics.clone(), stop_rx.clone()));
    tracing::info!(%metrics_addr, "agent started");
    Ok(RunningAgent { metrics_addr, hub, metrics, stop_tx, stop_threads, tasks })
}
