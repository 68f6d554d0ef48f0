//! Wiring: binds the three listeners (ext_proc, AgentIngest + ReplicaSync, admin), follows the
//! peer replicas, serves until asked to stop, and reports the first failure ([`start`],
//! [`RunningPicker`]).
//!
//! Concurrency: one task per server in a `JoinSet`; a `watch` channel asks all of them to stop
//! (graceful: open streams finish). A server that stops on its own stops the others.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_stream::wrappers::TcpListenerStream;

use crate::admin;
use crate::config::PickerConfig;
use crate::ext_proc::ExtProcService;
use crate::gateway::Gateway;
use crate::ingest::IngestService;
use crate::replicas::{ReplicaIdentity, ReplicaService};
use crate::score::ScoringConfigError;

/// Largest gRPC message the ext_proc server accepts, in bytes, at least: 32 MiB. tonic's 4 MiB
/// default fails the stream on large prompts (docs/design.md §11); Envoy's buffer limit in deploy/ is 16 MiB,
/// and a BUFFERED body of that size plus framing must still arrive so the picker can answer 413
/// itself instead of Envoy answering 500. Raised further to twice `body_limit_bytes` when larger.
pub const MIN_GRPC_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// Errors starting or running the picker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The scoring section was rejected by the router.
    #[error("invalid scoring config: {0}")]
    Scoring(#[from] ScoringConfigError),
    /// A listener could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address asked for.
        addr: SocketAddr,
        /// I/O error.
        source: std::io::Error,
    },
    /// A server stopped with an error.
    #[error("{what} server failed: {source}")]
    Serve {
        /// Which server.
        what: &'static str,
        /// Its error (transport, I/O, or the task's panic).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A server stopped although no stop was asked for.
    #[error("{what} server stopped unexpectedly")]
    Stopped {
        /// Which server.
        what: &'static str,
    },
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
    /// This replica on the replica stream (its id, what the stream did).
    pub replica: Arc<ReplicaIdentity>,
    /// The peer replicas followed (from `replicas.peers`; replace the list to change them).
    pub replica_peers: watch::Sender<Vec<SocketAddr>>,
    shutdown: ShutdownHandle,
    /// Each server's task ends with its name (it stopped) or its error.
    tasks: JoinSet<Result<&'static str, StartError>>,
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
            let res = joined.unwrap_or_else(|e| Err(StartError::Serve { what: "server task", source: e.into() }));
            match res {
                Err(e) => {
                    self.shutdown.shutdown();
                    first_err.get_or_insert(e);
                }
                Ok(what) if !self.shutdown.requested() => {
                    self.shutdown.shutdown();
                    first_err.get_or_insert(StartError::Stopped { what });
                }
                Ok(_) => {}
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
            .map_err(|e| StartError::Serve { what: "ext_proc", source: e.into() })
            .map(|()| "ext_proc")
    });

    let ingest = IngestService::new(gateway.pool.clone()).into_server();
    // ReplicaSync shares the ingest listener: its port, its TLS, and how agents find pickers.
    let replica = gateway.replica.clone();
    let replica_sync = ReplicaService::new(gateway.clone(), replica.clone()).into_server();
    let ingest_stop = stop(rx.clone());
    tasks.spawn(async move {
        tonic::transport::Server::builder()
            .add_service(ingest)
            .add_service(replica_sync)
            .serve_with_incoming_shutdown(TcpListenerStream::new(ingest_l), ingest_stop)
            .await
            .map_err(|e| StartError::Serve { what: "ingest", source: e.into() })
            .map(|()| "ingest")
    });

    let (replica_peers, peers_rx) = watch::channel(config.replicas.peers.clone());
    let (gw, me, peers_stop) = (gateway.clone(), replica.clone(), rx.clone());
    tokio::spawn(crate::replicas::run_peers(gw, me, peers_rx, crate::replicas::plaintext_dialer(), peers_stop));

    let app = admin::router(gateway.clone());
    let admin_stop = stop(rx);
    tasks.spawn(async move {
        axum::serve(admin_l, app)
            .with_graceful_shutdown(admin_stop)
            .await
            .map_err(|e| StartError::Serve { what: "admin", source: e.into() })
            .map(|()| "admin")
    });

    tracing::info!(%ext_proc_addr, %ingest_addr, %admin_addr, models = gateway.models.len(), "picker listening");
    Ok(RunningPicker {
        ext_proc_addr,
        ingest_addr,
        admin_addr,
        gateway,
        replica,
        replica_peers,
        shutdown: ShutdownHandle(Arc::new(shutdown)),
        tasks,
    })
}
