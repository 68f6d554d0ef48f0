//! Wiring: binds the four listeners (ext_proc, gRPC health, AgentIngest + ReplicaSync, admin), follows the
//! peer replicas, serves until asked to stop, and reports the first failure ([`start`],
//! [`RunningPicker`]).
//!
//! Concurrency: one task per server in a `JoinSet`; a `watch` channel asks all of them to stop
//! (graceful: open streams finish). A server that stops on its own stops the others.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_cluster::{ModelTable, PoolView, Watched};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::admin;
use crate::config::{PickerConfig, PoolSource};
use crate::ext_proc::ExtProcService;
use crate::gateway::Gateway;
use crate::gateway::GatewayError;
use crate::ingest::guard::{Claims, Limits};
use crate::ingest::tls::{self, ReloadingTls};
use crate::ingest::token::{AgentAuth, KubeReviewApi, TokenVerifier};
use crate::ingest::{IngestService, Refusals, Trust};
use crate::pending::ReplicaIdentity;
use crate::replicas::ReplicaService;

/// Largest gRPC message the ext_proc server accepts, in bytes, at least: 32 MiB. tonic's 4 MiB
/// default fails the stream on large prompts (docs/design.md §11); Envoy's buffer limit in deploy/ is 16 MiB,
/// and a BUFFERED body of that size plus framing must still arrive so the picker can answer 413
/// itself instead of Envoy answering 500. Raised further to twice `body_limit_bytes` when larger.
pub const MIN_GRPC_MESSAGE_BYTES: usize = 32 * 1024 * 1024;

/// Errors starting or running the picker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The request path's state could not be built (the router rejected the scoring section).
    #[error(transparent)]
    Gateway(#[from] GatewayError),
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
    /// The pool source could not be started (first read of the pool file, Kubernetes client).
    #[error("cannot watch the pool: {0}")]
    Pool(#[from] kvroute_cluster::ClusterError),
    /// TLS material could not be loaded.
    #[error("{what} TLS: {source}")]
    Tls {
        /// Which listener.
        what: &'static str,
        /// What failed.
        source: crate::ingest::tls::TlsError,
    },
    /// Neither `ingest_tls` nor `insecure_ingest` was configured.
    #[error(
        "ingest is not secured: set ingest_tls (ca_file, cert_file, key_file) for mTLS with the agents, or pass \
         --insecure-ingest (config insecure_ingest: true) to accept plaintext from anyone who reaches {addr}"
    )]
    InsecureIngest {
        /// The ingest address.
        addr: SocketAddr,
    },
    /// The `/explain` token file could not be read or is empty.
    #[error("explain_token_file {path}: {detail}")]
    ExplainToken {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        detail: String,
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
    /// Bound gRPC health address (`grpc.health.v1` alone, GIE's `--grpc-health-port`).
    pub health_addr: SocketAddr,
    /// Bound AgentIngest address.
    pub ingest_addr: SocketAddr,
    /// Bound admin HTTP address.
    pub admin_addr: SocketAddr,
    /// The shared request-path state (tests inspect the pool and metrics through it).
    pub gateway: Arc<Gateway>,
    /// The ext_proc listener's open, refused and timed-out connections.
    pub ext_proc_connections: Arc<crate::ext_proc::conn::ConnCounters>,
    /// This replica on the replica stream (its id, what the stream did).
    pub replica: Arc<ReplicaIdentity>,
    /// The peer replicas followed (from `replicas.peers`; replace the list to change them).
    pub replica_peers: watch::Sender<Vec<SocketAddr>>,
    shutdown: ShutdownHandle,
    health: tonic_health::server::HealthReporter,
    /// Each server's task ends with its name (it stopped) or its error.
    tasks: JoinSet<Result<&'static str, StartError>>,
}

/// Starts a [`RunningPicker`]'s drain (see [`DrainHandle::drain`]); cloneable.
#[derive(Clone)]
pub struct DrainHandle {
    gateway: Arc<Gateway>,
    health: tonic_health::server::HealthReporter,
}

impl std::fmt::Debug for DrainHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainHandle").finish_non_exhaustive()
    }
}

impl DrainHandle {
    /// Starts draining: gRPC health and `/readyz` report NOT_SERVING from now on while every
    /// listener keeps answering, so load balancers move new streams elsewhere before
    /// [`ShutdownHandle::shutdown`] closes them (docs/design.md §14, readiness).
    pub async fn drain(&self) {
        self.gateway.draining.store(true, Ordering::Release);
        set_readiness(&self.health, false).await;
        tracing::info!("draining: NOT_SERVING");
    }
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

    /// A handle that starts draining while another task waits on [`RunningPicker::wait`].
    pub fn drain_handle(&self) -> DrainHandle {
        DrainHandle { gateway: self.gateway.clone(), health: self.health.clone() }
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

/// The `grpc.health.v1` service names that report readiness: `""` (the server), the ext_proc
/// service, and the names GIE's Helm chart probes (`inference-extension`, and `readiness` with
/// leader election). `liveness` stays SERVING while the process runs.
pub const READINESS_SERVICES: [&str; 3] = ["", GIE_HEALTH_SERVICE, "readiness"];

/// The service GIE's Helm chart names in its gRPC liveness and readiness probes.
pub const GIE_HEALTH_SERVICE: &str = "inference-extension";

/// Sets every readiness service (see [`READINESS_SERVICES`]) SERVING or NOT_SERVING.
async fn set_readiness(health: &tonic_health::server::HealthReporter, serving: bool) {
    let status = if serving { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
    if serving {
        health.set_serving::<ExternalProcessorServer<ExtProcService>>().await;
    } else {
        health.set_not_serving::<ExternalProcessorServer<ExtProcService>>().await;
    }
    for name in READINESS_SERVICES {
        health.set_service_status(name, status).await;
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    TcpListener::bind(addr).await.map_err(|source| StartError::Bind { what, addr, source })
}

/// Binds all four listeners (port 0 picks a free port) and starts serving. When this returns,
/// every listener accepts connections.
pub async fn start(config: &PickerConfig) -> Result<RunningPicker, StartError> {
    start_with_scope(config, None).await
}

/// [`start`], with the agents' reports checked against `scope` instead of the pool's membership
/// (docs/design.md §14: the pool view admits a pod from the agent of its node; without a pool
/// source every pod is in scope).
pub async fn start_with_scope(
    config: &PickerConfig,
    scope: Option<Arc<dyn crate::ingest::ReportScope>>,
) -> Result<RunningPicker, StartError> {
    start_with_kube(config, scope, None).await
}

/// [`start_with_scope`], with `client` as the Kubernetes client for the agents' TokenReviews
/// (`agent_auth: token`; tests: the API stand-in). Without one, the pool watch's client is used,
/// else one from the environment.
pub async fn start_with_kube(
    config: &PickerConfig,
    scope: Option<Arc<dyn crate::ingest::ReportScope>>,
    client: Option<kube::Client>,
) -> Result<RunningPicker, StartError> {
    let token_auth = config.ingest_tls.is_some() && config.agent_auth() == AgentAuth::Token;
    let ingest_tls = match (&config.ingest_tls, config.insecure_ingest) {
        (Some(files), _) => {
            let tls = if token_auth { ReloadingTls::optional_client(files) } else { ReloadingTls::mutual(files) };
            Some(Arc::new(tls.map_err(|source| StartError::Tls { what: "ingest", source })?))
        }
        (None, true) => {
            tracing::warn!(ingest_addr = %config.ingest_addr,
                "--insecure-ingest: agent ingest is plaintext and unauthenticated; any process that reaches this \
                 port can report pods (use ingest_tls outside a local demo)");
            None
        }
        (None, false) => return Err(StartError::InsecureIngest { addr: config.ingest_addr }),
    };
    let ext_proc_tls = match &config.ext_proc_tls {
        Some(f) => Some(Arc::new(
            ReloadingTls::server_only(&f.cert_file, &f.key_file)
                .map_err(|source| StartError::Tls { what: "ext_proc", source })?,
        )),
        None => None,
    };
    let explain_token = match &config.explain_token_file {
        Some(path) => {
            let detail = |d: String| StartError::ExplainToken { path: path.clone(), detail: d };
            let token = std::fs::read_to_string(path).map_err(|e| detail(e.to_string()))?;
            let token = token.trim().to_string();
            if token.is_empty() {
                return Err(detail("empty".into()));
            }
            Some(token)
        }
        None => None,
    };
    let gateway = Arc::new(Gateway::new(config)?);
    let scope = scope.unwrap_or_else(|| gateway.pool.clone());
    let sources = match config.pool_source() {
        Some(source) => {
            // GIE's pool metrics carry the InferencePool's name (`kvroute` for a pool file).
            if let PoolSource::Kubernetes(pool) = &source {
                gateway.metrics.set_pool_name(&pool.name);
            }
            Some(watch_sources(&source).await?)
        }
        None => None,
    };
    let (sources, kube) = match sources {
        Some((pool_view, models, kube)) => (Some((pool_view, models)), kube),
        None => (None, None),
    };
    let tokens = if token_auth {
        let client = match client.or_else(|| kube.clone()) {
            Some(c) => c,
            None => kvroute_cluster::client_from_env().await?,
        };
        let namespace = match config.pool_source() {
            Some(PoolSource::Kubernetes(pool)) => pool.namespace,
            _ => kvroute_cluster::pool_namespace(None),
        };
        let verifier = TokenVerifier::new(Arc::new(KubeReviewApi(client)), &config.agent_token, &namespace);
        tracing::info!(?verifier, "agent identity: ServiceAccount tokens (TokenReview)");
        Some(Arc::new(verifier))
    } else {
        None
    };
    let ext_l = bind("ext_proc", config.ext_proc_addr).await?;
    let health_l = bind("health", config.health_addr()).await?;
    let ingest_l = bind("ingest", config.ingest_addr).await?;
    let admin_l = bind("admin", config.admin_addr).await?;
    let local = |l: &TcpListener, what, addr| l.local_addr().map_err(|source| StartError::Bind { what, addr, source });
    let ext_proc_addr = local(&ext_l, "ext_proc", config.ext_proc_addr)?;
    let health_addr = local(&health_l, "health", config.health_addr())?;
    let ingest_addr = local(&ingest_l, "ingest", config.ingest_addr)?;
    let admin_addr = local(&admin_l, "admin", config.admin_addr)?;

    let (shutdown, rx) = watch::channel(false);
    let stop = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|v| *v).await;
    };
    let mut tasks = JoinSet::new();

    let limits = config.limits;
    let admin_limits = limits.admin_listener();
    let max_msg = MIN_GRPC_MESSAGE_BYTES.max(config.body_limit_bytes.saturating_mul(2));
    let ext = ExtProcService::new(gateway.clone()).into_server(max_msg);
    // grpc.health.v1 on the ext_proc port (Envoy's cluster health checks) and alone on the
    // health port (GIE's `--grpc-health-port`, which its chart's probes call).
    let (health_reporter, health) = tonic_health::server::health_reporter();
    set_readiness(&health_reporter, gateway.is_ready()).await;
    health_reporter.set_service_status("liveness", tonic_health::ServingStatus::Serving).await;
    let (health_only, health_stop) = (health.clone(), stop(rx.clone()));
    tasks.spawn(async move {
        let incoming = tonic::transport::server::TcpIncoming::from(health_l).with_nodelay(Some(true));
        let served =
            limits.grpc_server().add_service(health_only).serve_with_incoming_shutdown(incoming, health_stop).await;
        served.map_err(|e| StartError::Serve { what: "health", source: e.into() }).map(|()| "health")
    });
    let conn_bounds = limits.ext_proc_connection_cap(crate::limits::nofile_limit());
    if conn_bounds.max_connections < limits.ext_proc_max_connections {
        tracing::warn!(
            cap = conn_bounds.max_connections,
            configured = limits.ext_proc_max_connections,
            "ext_proc connection cap lowered to keep file descriptors for the other listeners (RLIMIT_NOFILE)"
        );
    }
    let ext_proc_connections = Arc::new(crate::ext_proc::conn::ConnCounters::default());
    // ext_proc runs on event loops of its own: a thread with a single-threaded runtime each, one
    // accept loop (here) handing every connection to the least loaded of them, where its frames,
    // its streams and their decisions stay. On one multi-threaded runtime a message's wake-up
    // often woke a second worker to steal the task: about 15 % more CPU per request through
    // Envoy (docs/decisions/0050-ext-proc-event-loops.md).
    let loops = config.ext_proc_loops();
    let mut senders = Vec::with_capacity(loops);
    let mut stopped = Vec::with_capacity(loops);
    for i in 0..loops {
        let (tx, conns) = crate::ext_proc::conn::loop_channel();
        senders.push(tx);
        let (done, done_rx) = tokio::sync::oneshot::channel();
        stopped.push(done_rx);
        let (ext, health, tls) = (ext.clone(), health.clone(), ext_proc_tls.clone());
        let (counters, loop_stop) = (ext_proc_connections.clone(), stop(rx.clone()));
        let serve = move || -> Result<(), StartError> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| StartError::Serve { what: "ext_proc", source: e.into() })?;
            rt.block_on(async move {
                // HTTP/2 keepalive finds a vanished Envoy; the stream cap bounds one
                // connection's requests; the connection bounds cap their number and close those
                // that open no stream in time. TCP_NODELAY is set on each at accept: without it
                // small ext_proc replies wait on Nagle + delayed ACK (measured: +40-50 ms at p90
                // through Envoy, gateway-bench).
                let incoming = crate::ext_proc::conn::loop_incoming(conns, conn_bounds, tls, counters);
                limits
                    .grpc_server()
                    .max_concurrent_streams(Some(limits.ext_proc_max_streams))
                    .layer(crate::ext_proc::conn::StreamCountLayer)
                    .add_service(health)
                    .add_service(ext)
                    .serve_with_incoming_shutdown(incoming, loop_stop)
                    .await
                    .map_err(|e| StartError::Serve { what: "ext_proc", source: e.into() })
            })
        };
        std::thread::Builder::new()
            .name(format!("kvroute-ext-proc-{i}"))
            .spawn(move || {
                let _ = done.send(serve());
            })
            .map_err(|e| StartError::Serve { what: "ext_proc", source: e.into() })?;
    }
    crate::ext_proc::conn::spawn_acceptor(ext_l, conn_bounds, ext_proc_connections.clone(), senders);
    tasks.spawn(async move {
        for done in stopped {
            match done.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(StartError::Stopped { what: "ext_proc" }),
            }
        }
        Ok("ext_proc")
    });

    let refusals = Refusals::new(gateway.metrics.ingest_refusals.clone());
    let trust = Trust {
        mtls: ingest_tls.is_some() && tokens.is_none(),
        tokens,
        scope,
        claims: Arc::new(Claims::new(Limits {
            max_pods_per_stream: config.max_pods_per_stream,
            max_pods: config.max_pods,
            grace: std::time::Duration::from_millis(config.pod_grace_ttl_ms),
        })),
        refusals: refusals.clone(),
    };
    let ingest = IngestService::with_trust(gateway.pool.clone(), trust).into_server();
    // ReplicaSync shares the ingest listener: its port, its TLS handshake and its refusal
    // counters. Under TLS a subscriber must present a picker certificate (docs/design.md §14),
    // with token identity for agents too (there client certificates are optional at the
    // handshake and required here).
    let replica = gateway.replica.clone();
    let replica_sync =
        ReplicaService::with_trust(gateway.clone(), replica.clone(), ingest_tls.is_some(), refusals.clone())
            .into_server();
    let replica_dialer = match &config.ingest_tls {
        Some(files) => crate::replicas::tls_dialer(files.clone()),
        None => crate::replicas::plaintext_dialer(),
    };
    let ingest_stop = stop(rx.clone());
    tasks.spawn(async move {
        // HTTP/2 keepalive finds a silent or vanished agent (its stream ends, its pods enter the
        // grace period) within keepalive_ms + keepalive_timeout_ms.
        let server = limits.grpc_server().add_service(ingest).add_service(replica_sync);
        let served = match ingest_tls {
            Some(tls) => {
                server.serve_with_incoming_shutdown(tls::incoming(ingest_l, tls, Some(refusals)), ingest_stop).await
            }
            // TCP_NODELAY as on every other listener: replica-sync events and HTTP/2 acks to the
            // agents must not wait on Nagle and the peer's delayed ACK.
            None => {
                let incoming = tonic::transport::server::TcpIncoming::from(ingest_l).with_nodelay(Some(true));
                server.serve_with_incoming_shutdown(incoming, ingest_stop).await
            }
        };
        served.map_err(|e| StartError::Serve { what: "ingest", source: e.into() }).map(|()| "ingest")
    });

    let (replica_peers, peers_rx) = watch::channel(config.replicas.peers.clone());
    let (gw, me, peers_stop) = (gateway.clone(), replica.clone(), rx.clone());
    tokio::spawn(crate::replicas::run_peers(gw, me, peers_rx, replica_dialer, peers_stop));
    // Kubernetes: the peers are the replicas' Service endpoints, this one excluded (its ingest
    // address, or its pod IP from the downward API's `POD_IP`).
    if let (Some(service), Some(client), Some(PoolSource::Kubernetes(pool))) =
        (&config.replicas.service, kube, config.pool_source())
    {
        let view = kvroute_cluster::watch_picker_replicas(client, &pool.namespace, &service.name, Some(&service.port));
        let own_ip = std::env::var(POD_IP_ENV).ok().and_then(|v| v.parse().ok());
        tracing::info!(service = %service.name, namespace = %pool.namespace, ?own_ip, "replica peers: Service endpoints");
        let (tx, stop) = (replica_peers.clone(), rx.clone());
        tokio::spawn(crate::replicas::follow_service(view, vec![ingest_addr], own_ip, tx, stop));
    }

    let app = admin::router_with_token(gateway.clone(), explain_token.map(Arc::from));
    let admin_stop = stop(rx);
    tasks.spawn(async move {
        // The peer address reaches handlers as `ConnectInfo` (the `/explain` loopback rule).
        kvroute_common::listener::serve(admin_l, app, admin_limits, admin_stop).await;
        Ok("admin")
    });

    // Endpoints Envoy could not connect to return once they accept a TCP connection.
    let (gw, probe_stop) = (gateway.clone(), stop(shutdown.subscribe()));
    let probe_every = Duration::from_millis(limits.unreachable_probe_ms);
    tasks.spawn(async move {
        let probing = async {
            loop {
                tokio::time::sleep(probe_every).await;
                gw.pool.probe_unreachable(probe_every).await;
            }
        };
        tokio::select! {
            () = probing => Ok("unreachable probe"),
            () = probe_stop => Ok("unreachable probe"),
        }
    });

    // Engines that stop answering with requests in flight: their requests end at once.
    let (gw, frozen_stop) = (gateway.clone(), stop(shutdown.subscribe()));
    tasks.spawn(async move {
        let (pool, frozen) = (gw.pool.clone(), gw.frozen.clone());
        crate::frozen::watch_engines(pool, frozen, move |name| gw.engine_frozen(name), frozen_stop).await;
        Ok("frozen-engine probe")
    });

    let health = health_reporter.clone();
    if let Some((pool_view, models)) = sources {
        let (gw, pool_stop) = (gateway.clone(), stop(shutdown.subscribe()));
        tasks.spawn(async move {
            tokio::select! {
                () = follow_pool(gw, pool_view, models) => Err(StartError::Stopped { what: "pool watch" }),
                () = pool_stop => Ok("pool watch"),
            }
        });
        let (gw, ready_stop) = (gateway.clone(), stop(shutdown.subscribe()));
        let (coverage, timeout) = (config.ready_coverage, Duration::from_millis(config.ready_timeout_ms));
        tasks.spawn(async move {
            // Serves until the stop: a task that ends early reads as a failed server.
            tokio::pin!(ready_stop);
            tokio::select! {
                () = become_ready(gw, health_reporter, coverage, timeout) => ready_stop.await,
                () = &mut ready_stop => {}
            }
            Ok("readiness")
        });
    }

    tracing::info!(%ext_proc_addr, %health_addr, %ingest_addr, %admin_addr, models = gateway.models.len(), "picker listening");
    Ok(RunningPicker {
        ext_proc_addr,
        health_addr,
        ingest_addr,
        admin_addr,
        gateway,
        ext_proc_connections,
        replica,
        replica_peers,
        shutdown: ShutdownHandle(Arc::new(shutdown)),
        health,
        tasks,
    })
}

/// How often readiness is re-evaluated until it turns SERVING.
pub const READY_POLL: Duration = Duration::from_millis(50);

/// The environment variable holding this replica's pod IP (the downward API's `status.podIP`),
/// excluded from the `replicas.service` peers.
pub const POD_IP_ENV: &str = "POD_IP";

/// Starts the pool source's watchers: the pool view and the model table, and the Kubernetes
/// client they use (reused by `replicas.service`).
async fn watch_sources(
    source: &PoolSource,
) -> Result<(Watched<PoolView>, Watched<ModelTable>, Option<kube::Client>), StartError> {
    match source {
        PoolSource::File(path) => {
            tracing::info!(path = %path.display(), "pool source: pool file");
            let (pool, models) = kvroute_cluster::watch_pool_file(path, kvroute_cluster::file::DEFAULT_POLL).await?;
            Ok((pool, models, None))
        }
        PoolSource::Kubernetes(pool) => {
            tracing::info!(pool = %pool.name, namespace = %pool.namespace, "pool source: InferencePool");
            let client = kvroute_cluster::client_from_env().await?;
            Ok((
                kvroute_cluster::watch_pool(client.clone(), pool.clone()),
                kvroute_cluster::watch_models(client.clone(), pool.clone()),
                Some(client),
            ))
        }
    }
}

/// Hands every new pool view to the pool (candidates follow at once) and every new model table
/// to the gateway; returns only if a watcher stopped.
async fn follow_pool(gw: Arc<Gateway>, pool_view: Watched<PoolView>, models: Watched<ModelTable>) {
    let mut views = pool_view.subscribe();
    let mut tables = models.subscribe();
    let mut tables_open = true;
    loop {
        let view = views.borrow_and_update().clone();
        if gw.pool.set_membership(view.clone()).await.is_err() {
            return;
        }
        tracing::debug!(
            generation = view.generation,
            endpoints = view.endpoints.len(),
            candidates = view.candidates().count(),
            synced = view.synced,
            "pool view applied"
        );
        gw.model_table.store(Some(tables.borrow_and_update().clone()));
        tokio::select! {
            r = views.changed() => if r.is_err() { return },
            r = tables.changed(), if tables_open => tables_open = r.is_ok(),
        }
    }
}

/// Turns readiness SERVING once the pool view synced and agents reported for `coverage` of its
/// Ready endpoints, or `timeout` after start (the view must still have synced).
async fn become_ready(
    gw: Arc<Gateway>,
    health: tonic_health::server::HealthReporter,
    coverage: f64,
    timeout: Duration,
) {
    let started = Instant::now();
    loop {
        // Past the timeout, SERVING unless every Ready endpoint's agent reports an engine that
        // does not answer yet (a fleet of starting engines would only get 503s).
        if let Some(c) = gw.pool.agent_coverage()
            && (c.share() >= coverage || (started.elapsed() >= timeout && c.any_routable()))
        {
            gw.ready.store(true, Ordering::Release);
            if gw.draining.load(Ordering::Acquire) {
                return;
            }
            set_readiness(&health, true).await;
            tracing::info!(
                coverage = c.share(),
                ready_endpoints = c.ready_endpoints,
                engines_ready = c.engines_ready,
                engines_unready = c.engines_unready,
                after_ms = started.elapsed().as_millis() as u64,
                "ready: SERVING"
            );
            return;
        }
        tokio::time::sleep(READY_POLL).await;
    }
}
