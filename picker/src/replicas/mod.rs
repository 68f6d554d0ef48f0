//! One view across picker replicas (docs/design.md §4): the `ReplicaSync` gRPC service and the
//! tasks that subscribe to the other replicas.
//!
//! - **Serving** ([`ReplicaService`]): served on the ingest listener, next to `AgentIngest`, so it
//!   shares its port, its TLS and the way agents find pickers (the picker Service's
//!   EndpointSlices). A subscriber gets `Hello`, a snapshot (this replica's requests in flight,
//!   its pending chains and the pods it holds unreachable) and then every decision, request end
//!   and newly unreachable pod as they happen. A subscriber
//!   that falls [`crate::pending::EVENT_BUFFER`] events behind is cut off (RESOURCE_EXHAUSTED) and
//!   subscribes again. Publishing starts with the first subscriber: a single picker pays nothing.
//! - **Subscribing** ([`run_peers`]): one task per peer address; each connects, subscribes,
//!   applies the peer's events to this replica's [`SharedView`](crate::pending::SharedView)
//!   ([`crate::score::Router::apply_peer`]) and, when the stream ends, forgets the peer's in-flight requests and
//!   reconnects with jittered exponential backoff. A peer that turns out to be this replica (its
//!   Hello carries our id) is not dialed again. The address set comes from a `watch` channel: a
//!   static list from the config, or a Kubernetes watch of the picker Service.
//!
//! Bounds: a peer's event is refused (and counted) when its pod name exceeds
//! [`MAX_POD_NAME_BYTES`] or its chain [`MAX_EVENT_BLOCKS`]; a message over
//! [`MAX_MESSAGE_BYTES`] ends the stream. Events for pods this replica does not know are counted
//! and dropped.
//!
//! Trust (docs/design.md §14): the server is added to the ingest server's builder, so under mTLS
//! a subscriber has passed the same handshake as an agent (a client certificate chained to the
//! ingest CA); [`ReplicaService::with_trust`] then requires that certificate to be a picker's
//! (DNS SAN [`REPLICA_SAN`], no wildcard) and refuses anything else
//! (`epp_ingest_refusals_total{reason="not_a_replica"}`, UNAUTHENTICATED): an agent's
//! certificate cannot subscribe. Subscribing, [`tls_dialer`] presents this picker's own ingest
//! certificate and verifies the peer's as [`REPLICA_SAN`] under the same CA. Without TLS
//! (`insecure_ingest`) subscribers are taken on trust, as agents are.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::{Stream, StreamExt};
use kvroute_cluster::{ReplicaView, Watched};
use kvroute_common::BlockHash;
use kvroute_proto::replica::v1::replica_sync_client::ReplicaSyncClient;
use kvroute_proto::replica::v1::replica_sync_server::{ReplicaSync, ReplicaSyncServer};
use kvroute_proto::replica::v1::{
    Finished, Hello, ReplicaMessage, Routed, SubscribeRequest, Unreachable, replica_message,
};
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tracing::{debug, info, warn};

use crate::gateway::Gateway;
use crate::ingest::guard::{REPLICA_SAN, certificate_names_replica};
use crate::ingest::tls::TlsFiles;
use crate::ingest::{Refusal, Refusals};
use crate::pending::{Origin, ReplicaCounters, ReplicaEvent, ReplicaIdentity};

/// Protocol version spoken (`SubscribeRequest.protocol_version`, `Hello.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;
/// Longest pod name accepted from a peer, bytes (a Kubernetes name is at most 253).
pub const MAX_POD_NAME_BYTES: usize = 253;
/// Most blocks in one peer event (a 1M-token prompt at 16 tokens per block).
pub const MAX_EVENT_BLOCKS: usize = 65_536;
/// Largest replica message accepted, bytes (a chain of [`MAX_EVENT_BLOCKS`] blocks fits).
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;
/// First reconnection delay; doubled per failure up to [`MAX_BACKOFF`], with jitter.
pub const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest reconnection delay.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Converts an event to its wire message.
pub fn to_message(ev: &ReplicaEvent) -> ReplicaMessage {
    let msg = match ev {
        ReplicaEvent::Routed { id, pod, routed_unix_ms, blocks } => replica_message::Msg::Routed(Routed {
            id: *id,
            pod: pod.to_string(),
            routed_unix_ms: *routed_unix_ms,
            blocks: blocks.iter().map(|b| b.0).collect(),
        }),
        ReplicaEvent::Finished { id, pod } => {
            replica_message::Msg::Finished(Finished { id: *id, pod: pod.to_string() })
        }
        ReplicaEvent::Unreachable { pod } => replica_message::Msg::Unreachable(Unreachable { pod: pod.to_string() }),
    };
    ReplicaMessage { msg: Some(msg) }
}

/// Why a peer's message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaError {
    /// A pod name over [`MAX_POD_NAME_BYTES`] or empty.
    #[error("pod name of {0} bytes (1 to {MAX_POD_NAME_BYTES} accepted)")]
    PodName(usize),
    /// A chain over [`MAX_EVENT_BLOCKS`].
    #[error("chain of {0} blocks (at most {MAX_EVENT_BLOCKS})")]
    Chain(usize),
    /// A message without content.
    #[error("empty replica message")]
    Empty,
}

/// Converts a peer's wire message to an event (`Ok(None)` for a `Hello`).
pub fn from_message(m: ReplicaMessage) -> Result<Option<ReplicaEvent>, ReplicaError> {
    let pod_ok = |p: &str| {
        if p.is_empty() || p.len() > MAX_POD_NAME_BYTES { Err(ReplicaError::PodName(p.len())) } else { Ok(()) }
    };
    match m.msg {
        None => Err(ReplicaError::Empty),
        Some(replica_message::Msg::Hello(_)) => Ok(None),
        Some(replica_message::Msg::Routed(r)) => {
            pod_ok(&r.pod)?;
            if r.blocks.len() > MAX_EVENT_BLOCKS {
                return Err(ReplicaError::Chain(r.blocks.len()));
            }
            let blocks: Arc<[BlockHash]> = r.blocks.into_iter().map(BlockHash).collect();
            Ok(Some(ReplicaEvent::Routed { id: r.id, pod: Arc::from(r.pod), routed_unix_ms: r.routed_unix_ms, blocks }))
        }
        Some(replica_message::Msg::Finished(f)) => {
            pod_ok(&f.pod)?;
            Ok(Some(ReplicaEvent::Finished { id: f.id, pod: Arc::from(f.pod) }))
        }
        Some(replica_message::Msg::Unreachable(u)) => {
            pod_ok(&u.pod)?;
            Ok(Some(ReplicaEvent::Unreachable { pod: Arc::from(u.pod) }))
        }
    }
}

/// The `ReplicaSync` service of one replica. Replication (publishing every decision) turns on
/// with the first subscriber.
#[derive(Debug, Clone)]
pub struct ReplicaService {
    gateway: Arc<Gateway>,
    me: Arc<ReplicaIdentity>,
    /// Subscribers arrive over mTLS: their certificate must be a picker's.
    mtls: bool,
    refusals: Option<Refusals>,
}

impl ReplicaService {
    /// A service publishing `gateway`'s routing decisions to any subscriber (plaintext, taken on
    /// trust: the `insecure_ingest` case and tests).
    pub fn new(gateway: Arc<Gateway>, me: Arc<ReplicaIdentity>) -> Self {
        ReplicaService { gateway, me, mtls: false, refusals: None }
    }

    /// A service on the ingest listener: when `mtls`, only subscribers whose client certificate
    /// names [`REPLICA_SAN`] are served; others are refused and counted in `refusals`.
    pub fn with_trust(gateway: Arc<Gateway>, me: Arc<ReplicaIdentity>, mtls: bool, refusals: Refusals) -> Self {
        ReplicaService { gateway, me, mtls, refusals: Some(refusals) }
    }

    /// The tonic server for this service, accepting messages up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> ReplicaSyncServer<ReplicaService> {
        ReplicaSyncServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<ReplicaMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl ReplicaSync for ReplicaService {
    type SubscribeStream = EventStream;

    async fn subscribe(&self, request: Request<SubscribeRequest>) -> Result<Response<EventStream>, Status> {
        if self.mtls {
            let replica = request.peer_certs().and_then(|c| c.first().cloned()).is_some_and(|leaf| {
                let leaf: rustls_pki_types::CertificateDer<'_> = leaf;
                certificate_names_replica(&leaf)
            });
            if !replica {
                let who = request.remote_addr().map(|a| a.ip().to_string()).unwrap_or_default();
                if let Some(r) = &self.refusals {
                    let detail = format!("ReplicaSync subscriber's certificate does not name {REPLICA_SAN}");
                    r.refuse(Refusal::NotAReplica, &who, "", &detail);
                }
                return Err(Status::unauthenticated(format!("a picker certificate ({REPLICA_SAN}) is required")));
            }
        }
        let req = request.into_inner();
        if req.replica_id == self.me.id {
            return Err(Status::failed_precondition("this is the subscriber itself"));
        }
        let router = &self.gateway.router;
        router.shared().enable_replication();
        let Some((snapshot, rx)) = router.subscribe_peer() else {
            return Err(Status::unavailable("replication is off"));
        };
        debug!(peer = %req.replica_id, snapshot = snapshot.len(), "replica subscribed");
        let hello = ReplicaMessage {
            msg: Some(replica_message::Msg::Hello(Hello {
                replica_id: self.me.id.clone(),
                protocol_version: PROTOCOL_VERSION,
            })),
        };
        let head = futures::stream::iter(
            std::iter::once(hello).chain(snapshot.iter().map(to_message)).map(Ok::<_, Status>).collect::<Vec<_>>(),
        );
        let me = self.me.clone();
        let live = futures::stream::unfold(Some(rx), move |rx| {
            let me = me.clone();
            async move {
                let mut rx = rx?;
                match rx.recv().await {
                    Ok(ev) => Some((Ok(to_message(&ev)), Some(rx))),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        me.counters.lagged.fetch_add(1, Ordering::Relaxed);
                        Some((Err(Status::resource_exhausted(format!("subscriber fell {n} events behind"))), None))
                    }
                    Err(broadcast::error::RecvError::Closed) => None,
                }
            }
        });
        Ok(Response::new(Box::pin(head.chain(live))))
    }
}

/// Builds the channel to a peer ([`plaintext_dialer`] or [`tls_dialer`]); the error is the reason
/// no channel could be described (unreadable TLS files, a bad address).
pub type Dialer = Arc<dyn Fn(SocketAddr) -> Result<Endpoint, String> + Send + Sync>;

/// An endpoint with a 2 s connect timeout, TCP_NODELAY and HTTP/2 keepalive.
fn endpoint(url: String) -> Result<Endpoint, String> {
    Ok(Endpoint::from_shared(url)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10)))
}

/// A plaintext dialer (peers serving `insecure_ingest`).
pub fn plaintext_dialer() -> Dialer {
    Arc::new(|addr: SocketAddr| endpoint(format!("http://{addr}")))
}

/// An mTLS dialer: presents `files`' certificate and key (this picker's ingest certificate, a
/// [`REPLICA_SAN`] certificate) and verifies the peer's against `files.ca_file` as
/// [`REPLICA_SAN`]. The files are read at each connection, so a rotation applies from the next.
pub fn tls_dialer(files: TlsFiles) -> Dialer {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    Arc::new(move |addr: SocketAddr| {
        let read = |p: &std::path::Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let (ca, cert, key) = (read(&files.ca_file)?, read(&files.cert_file)?, read(&files.key_file)?);
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(cert, key))
            .domain_name(REPLICA_SAN);
        endpoint(format!("https://{addr}"))?.tls_config(tls).map_err(|e| e.to_string())
    })
}

/// Subscribes to every peer in `peers` (updated as the set changes) and applies their events to
/// `router`, until `stop` turns true. Origins are numbered per peer address from 1.
pub async fn run_peers(
    gateway: Arc<Gateway>,
    me: Arc<ReplicaIdentity>,
    mut peers: watch::Receiver<Vec<SocketAddr>>,
    dialer: Dialer,
    mut stop: watch::Receiver<bool>,
) {
    let mut tasks: HashMap<SocketAddr, (JoinHandle<()>, Origin)> = HashMap::new();
    let mut next_origin: Origin = 1;
    let router = &gateway.router;
    loop {
        let want: Vec<SocketAddr> = peers.borrow_and_update().clone();
        tasks.retain(|addr, (task, origin)| {
            let keep = want.contains(addr) && !task.is_finished();
            if !keep {
                task.abort();
                router.shared().peer_gone(*origin);
            }
            keep
        });
        for addr in want {
            if tasks.contains_key(&addr) {
                continue;
            }
            let origin = next_origin;
            next_origin += 1;
            let task = tokio::spawn(follow(gateway.clone(), me.clone(), addr, origin, dialer.clone()));
            tasks.insert(addr, (task, origin));
        }
        tokio::select! {
            changed = peers.changed() => if changed.is_err() { break },
            _ = stop.wait_for(|v| *v) => break,
        }
    }
    for (_, (task, origin)) in tasks {
        task.abort();
        router.shared().peer_gone(origin);
    }
}

/// The peers in a view of the replicas' Service: every endpoint not terminating (ready or not: a
/// starting replica is not Ready until agents reported to it, and its view is worth having from
/// the start), minus this replica: an address in `own` (its ingest listener) or on `own_ip` (its
/// pod IP). Sorted, de-duplicated. Empty until the view's first list completed.
pub fn peers_in_view(view: &ReplicaView, own: &[SocketAddr], own_ip: Option<IpAddr>) -> Vec<SocketAddr> {
    if !view.synced {
        return Vec::new();
    }
    view.dialable()
        .map(|r| r.addr)
        .filter(|a| !own.contains(a) && Some(a.ip()) != own_ip)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Keeps `peers` (what [`run_peers`] follows) equal to [`peers_in_view`] of every new view of the
/// replicas' Service (`kvroute_cluster::watch_picker_replicas`), until `stop` or the watcher
/// ends. Nothing is sent before the first complete list, nor when the set did not change, so a
/// peer's subscription survives unrelated slice updates.
pub async fn follow_service(
    view: Watched<ReplicaView>,
    own: Vec<SocketAddr>,
    own_ip: Option<IpAddr>,
    peers: watch::Sender<Vec<SocketAddr>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut views = view.subscribe();
    loop {
        let current = views.borrow_and_update().clone();
        if current.synced {
            let want = peers_in_view(&current, &own, own_ip);
            peers.send_if_modified(|have| {
                if *have == want {
                    return false;
                }
                info!(service = %current.service, peers = ?want, "replica peers changed");
                *have = want;
                true
            });
        }
        tokio::select! {
            changed = views.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|v| *v) => return,
        }
    }
}

/// Follows one peer until it turns out to be this replica: subscribe, apply, reconnect.
async fn follow(gateway: Arc<Gateway>, me: Arc<ReplicaIdentity>, addr: SocketAddr, origin: Origin, dialer: Dialer) {
    let mut backoff = MIN_BACKOFF;
    let router = &gateway.router;
    loop {
        match subscribe_once(router, &me, addr, origin, &dialer).await {
            Ok(()) => backoff = MIN_BACKOFF,
            Err(status) if status.code() == tonic::Code::FailedPrecondition => {
                debug!(%addr, "replica address is this replica: not followed");
                return;
            }
            Err(status) => {
                debug!(%addr, error = %status, "replica subscription failed");
            }
        }
        router.shared().peer_gone(origin);
        let jitter = 0.5 + rand::random::<f64>();
        tokio::time::sleep(backoff.mul_f64(jitter)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One subscription: returns when the stream ends (Ok) or fails (the status).
async fn subscribe_once(
    router: &crate::score::Router,
    me: &ReplicaIdentity,
    addr: SocketAddr,
    origin: Origin,
    dialer: &Dialer,
) -> Result<(), Status> {
    let endpoint = dialer(addr).map_err(Status::invalid_argument)?;
    let channel: Channel = endpoint.connect().await.map_err(|e| Status::unavailable(e.to_string()))?;
    let mut client = ReplicaSyncClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES);
    let req = SubscribeRequest { replica_id: me.id.clone(), protocol_version: PROTOCOL_VERSION };
    let mut stream = client.subscribe(req).await?.into_inner();
    // Counted down on every exit, an abort included (a peer that left the Service's slices).
    let _connected = Connected::count(&me.counters);
    info!(%addr, "following replica");
    loop {
        match stream.message().await {
            Ok(Some(m)) => match from_message(m) {
                Ok(Some(ev)) => {
                    if router.apply_peer(origin, &ev) {
                        me.counters.applied.fetch_add(1, Ordering::Relaxed);
                    } else {
                        me.counters.refused.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    me.counters.refused.fetch_add(1, Ordering::Relaxed);
                    warn!(%addr, error = %e, "replica event refused");
                }
            },
            Ok(None) => return Ok(()),
            Err(status) => return Err(status),
        }
    }
}

/// One subscription in `connected`: counted up when made, down (and a disconnect counted) when
/// dropped, so a follow task aborted mid-stream leaves the gauge right.
struct Connected<'a>(&'a ReplicaCounters);

impl<'a> Connected<'a> {
    fn count(counters: &'a ReplicaCounters) -> Self {
        counters.connected.fetch_add(1, Ordering::Relaxed);
        Connected(counters)
    }
}

impl Drop for Connected<'_> {
    fn drop(&mut self) {
        self.0.connected.fetch_sub(1, Ordering::Relaxed);
        self.0.disconnects.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests;
