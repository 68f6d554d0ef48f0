//! kvroute picker: KV-cache-aware Envoy ext_proc endpoint picker (docs/design.md §1, §3–§5, §9).
//!
//! Three listeners, all started by [`start`]:
//! - ext_proc gRPC ([`ext_proc`]): Envoy asks, per request, which pod serves it;
//! - AgentIngest gRPC ([`ingest`]): agents stream pod state and KV blocks into the [`pool`];
//! - admin HTTP ([`admin`]): `/metrics`, `/healthz`, `/explain`.
//!
//! Concurrency: one [`Gateway`] (router, model registry, metrics; immutable after start) is shared
//! by `Arc` between the request-path tasks and the admin server. The pool's own writer/reader
//! model is described in [`pool`]. Shutdown is cooperative through [`RunningPicker::shutdown`].

pub mod admin;
pub mod approx;
pub mod config;
pub mod ext_proc;
pub mod ingest;
pub mod model;
pub mod pool;
pub mod score;

/// The prefix index lives in its own crate (no async runtime, fast benches); re-exported here.
pub use kvroute_index as index;

use std::net::SocketAddr;
use std::sync::Arc;

use kvroute_proto::agent::v1::agent_ingest_server::AgentIngestServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_stream::wrappers::TcpListenerStream;

use crate::admin::metrics::Metrics;
use crate::config::PickerConfig;
use crate::ext_proc::ExtProcService;
use crate::ingest::IngestService;
use crate::model::ModelRegistry;
use crate::pool::{Pool, PoolConfig};
use crate::score::Router;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;

/// Largest gRPC message the ext_proc server accepts, in bytes, at least: 32 MiB. tonic's 4 MiB
/// default fails the stream on large prompts (docs/design.md §11); Envoy's buffer limit in deploy/ is 16 MiB,
/// and a BUFFERED body of that size plus framing must still arrive so the picker can answer 413
/// itself instead of Envoy answering 500. Raised further to twice `body_limit_bytes` when larger.
pub const MIN_GRPC_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// Largest agent report message accepted, in bytes: a full snapshot of a big pod (≈ 8 bytes per
/// block; 2M blocks ≈ 16 MiB) fits.
pub const AGENT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Errors starting or running the picker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The scoring section was rejected by the router.
    #[error("invalid scoring config: {0}")]
    Scoring(String),
    /// A listener could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind { what: &'static str, addr: SocketAddr, source: std::io::Error },
    /// A server stopped with an error.
    #[error("{what} server failed: {message}")]
    Serve { what: &'static str, message: String },
}

/// What the request path shares: read-only after start.
#[derive(Debug)]
pub struct Gateway {
    /// Pods, their state and the prefix index.
    pub pool: Arc<Pool>,
    /// Scoring and selection.
    pub router: Router,
    /// Configured InferenceModels.
    pub models: ModelRegistry,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// Largest request body parsed, in bytes (413 above).
    pub body_limit_bytes: usize,
    /// Model used for requests without a body (the first configured model).
    pub default_model: Option<String>,
}

impl Gateway {
    /// Builds the pool, router and models from a validated config.
    pub fn new(config: &PickerConfig) -> Result<Self, StartError> {
        let pool = Pool::new(PoolConfig {
            block_size: config.block_size,
            grace_ttl_ms: config.pod_grace_ttl_ms,
            max_blocks_per_pod: 2_000_000,
        });
        let router = Router::new(pool.clone(), config.scoring.to_scoring_config())
            .map_err(|e| StartError::Scoring(e.to_string()))?;
        Ok(Self {
            pool,
            router,
            models: ModelRegistry::load(&config.models, config.block_size),
            metrics: Metrics::new(),
            body_limit_bytes: config.body_limit_bytes,
            default_model: config.models.first().map(|m| m.name.clone()),
        })
    }
}

/// A started picker: its bound addresses and server tasks.
#[derive(Debug)]
pub struct RunningPicker {
    /// Bound ext_proc address (the real port when the config said 0).
    pub ext_proc_addr: SocketAddr,
    /// Bound AgentIngest address.
    pub ingest_addr: SocketAddr,
    /// Bound admin HTTP address.
    pub admin_addr: SocketAddr,
    /// The shared request-path state (tests inspect the pool and metrics through it).
    pub gateway: Arc<Gateway>,
    shutdown: ShutdownHandle,
    tasks: JoinSet<Result<(), StartError>>,
}

/// Asks a [`RunningPicker`]'s servers to stop; cloneable, usable after `wait` took the picker.
#[derive(Debug, Clone)]
pub struct ShutdownHandle(Arc<watch::Sender<bool>>);

impl ShutdownHandle {
    /// Asks every server to stop (graceful: open streams finish).
    pub fn shutdown(&self) {
        let _ = self.0.send(true);
    }
    fn requested(&self) -> bool {
        *self.0.borrow()
    }
}

impl RunningPicker {
    /// Asks every server to stop (graceful: open streams finish).
    pub fn shutdown(&self) {
        self.shutdown.shutdown();
    }

    /// A handle that can stop the servers while another task waits on [`RunningPicker::wait`].
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Waits until every server has stopped; the first failure is returned (and stops the rest).
    pub async fn wait(mut self) -> Result<(), StartError> {
        let mut first_err = None;
        while let Some(joined) = self.tasks.join_next().await {
            let res = joined.unwrap_or_else(|e| Err(StartError::Serve { what: "server task", message: e.to_string() }));
            if let Err(e) = res {
                self.shutdown.shutdown();
                first_err.get_or_insert(e);
            } else if !self.shutdown.requested() {
                self.shutdown.shutdown();
                first_err.get_or_insert(StartError::Serve {
                    what: "picker",
                    message: "a server stopped unexpectedly".into(),
                });
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { what, addr, source })
}

/// Binds all three listeners (port 0 picks a free port) and starts serving. When this returns,
/// every listener accepts connections.
pub async fn start(config: &PickerConfig) -> Result<RunningPicker, StartError> {
    let gateway = Arc::new(Gateway::new(config)?);
    let ext_l = bind("ext_proc", config.ext_proc_addr).await?;
    let ingest_l = bind("ingest", config.ingest_addr).await?;
    let admin_l = bind("admin", config.admin_addr).await?;
    let local = |l: &TcpListener, what, addr| l.local_addr().map_err(|source| StartError::Bind { what, addr, source });
    let ext_proc_addr = local(&ext_l, "ext_proc", config.ext_proc_addr)?;
    let ingest_addr = local(&ingest_l, "ingest", config.ingest_addr)?;
    let admin_addr = local(&admin_l, "admin", config.admin_addr)?;

    let (shutdown, rx) = watch::channel(false);
    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let mut tasks = JoinSet::new();

    let max_msg = MIN_GRPC_MESSAGE_BYTES.max(config.body_limit_bytes.saturating_mul(2));
    let ext = ExtProcService::new(gateway.clone()).into_server(max_msg);
    // grpc.health.v1 on the ext_proc port, for Envoy's cluster health checks and Kubernetes probes.
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<ExternalProcessorServer<ExtProcService>>().await;
    let ext_stop = stop(rx.clone());
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(ext)
            // TCP_NODELAY: without it small ext_proc replies wait on Nagle + delayed ACK
            // (measured: +40-50 ms at p90 through Envoy, gateway-bench).
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(ext_l).with_nodelay(Some(true)),
                ext_stop,
            )
            .await
            .map_err(|e| StartError::Serve { what: "ext_proc", message: e.to_string() })
    });

    let ingest =
        AgentIngestServer::new(IngestService::new(gateway.pool.clone())).max_decoding_message_size(AGENT_MESSAGE_BYTES);
    let ingest_stop = stop(rx.clone());
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(ingest)
            .serve_with_incoming_shutdown(TcpListenerStream::new(ingest_l), ingest_stop)
            .await
            .map_err(|e| StartError::Serve { what: "ingest", message: e.to_string() })
    });

    let app = admin::router(gateway.clone());
    let admin_stop = stop(rx);
    tasks.spawn(async move {
        axum::serve(admin_l, app)
            .with_graceful_shutdown(admin_stop)
            .await
            .map_err(|e| StartError::Serve { what: "admin", message: e.to_string() })
    });

    tracing::info!(%ext_proc_addr, %ingest_addr, %admin_addr, models = gateway.models.len(), "picker listening");
    Ok(RunningPicker {
        ext_proc_addr,
        ingest_addr,
        admin_addr,
        gateway,
        shutdown: ShutdownHandle(Arc::new(shutdown)),
        tasks,
    })
}
