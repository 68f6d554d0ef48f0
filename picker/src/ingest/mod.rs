//! Agent ingest (docs/design.md §7): the `AgentIngest` gRPC service. Each agent opens one bidi `Report`
//! stream; this module checks it (Hello, per-pod snapshot then sequence-numbered deltas) and
//! forwards the changes to the pool's writer as [`PoolUpdate`]s.
//!
//! Concurrency: one tokio task per stream reads it, keeps that stream's per-pod sequence state,
//! and awaits the pool's bounded update queue (backpressure on the agent). Responses go through a
//! bounded channel; Acks are best effort (dropped when the agent does not read), resyncs are
//! re-asked on the next delta of a pod still waiting for its snapshot (at most once per
//! [`RESYNC_RETRY`]).
//!
//! Rules: a delta must carry seq = last + 1 for its pod, after a snapshot on this stream; on a gap
//! (or a delta before any snapshot) the picker sends `ResyncRequest{pod}` and ignores that pod's
//! deltas until a snapshot arrives. Bad messages are logged and answered with a resync; the stream
//! is never closed by the picker. Stream end (or error) → the stream's pods enter the grace period.
//! Acks ("applied up to seq") are sent every [`ACK_EVERY`] messages or [`ACK_INTERVAL`], after a
//! pool barrier, for the pods whose seq advanced.
//!
//! Trust (docs/design.md §14, [`guard`]): a stream's reports count only after a `Hello` naming the
//! node the stream proved: the node of the pod whose ServiceAccount token opened it ([`token`]), or
//! the node its client certificate names (mTLS, [`tls`]); each pod must be in that node's scope and not held
//! by another live stream, within the caps; stats must be in range. Refused parts are counted and
//! dropped (the rest of the message applies); a delta for a pod the stream does not hold claims it
//! and asks for a resync.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kvroute_common::BlockHash;
use kvroute_proto::agent::v1::agent_ingest_server::{AgentIngest, AgentIngestServer};
use kvroute_proto::agent::v1::{
    Ack, AgentMessage, BlockRun, Hello, PickerMessage, PodDelta, PodSnapshot, ResyncRequest, agent_message,
    picker_message,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::pool::{Pool, PoolUpdate, StreamId};

pub mod guard;
pub mod tls;
pub mod token;

pub use guard::{Refusal, Refusals, ReportScope, Trust};

/// Messages between Acks.
pub const ACK_EVERY: u64 = 100;
/// Longest time between Acks while messages arrive.
pub const ACK_INTERVAL: Duration = Duration::from_secs(1);
/// Minimum time between two resync requests for the same pod.
pub const RESYNC_RETRY: Duration = Duration::from_secs(1);
/// Largest agent message accepted, in bytes: a full snapshot of a big pod (≈ 8 bytes per block;
/// 2M blocks ≈ 16 MiB, ~20 MB with framing) fits.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// Capacity of each stream's response channel (messages).
const RESPONSE_QUEUE: usize = 256;

static NEXT_STREAM: AtomicU64 = AtomicU64::new(1);

/// The `AgentIngest` service. Wire it with [`IngestService::into_server`] (or
/// `AgentIngestServer::new(..)`, then raise its decoding limit for large snapshots).
#[derive(Debug, Clone)]
pub struct IngestService {
    pool: Arc<Pool>,
    trust: Trust,
}

impl IngestService {
    /// A service feeding `pool` from plaintext streams, pods in scope per the pool's membership
    /// (every pod without a pool source; ownership, caps and ranges still enforced); refusals
    /// counted in a family of its own.
    pub fn new(pool: Arc<Pool>) -> IngestService {
        let scope: Arc<dyn ReportScope> = pool.clone();
        IngestService { pool, trust: Trust { scope, ..Trust::insecure(Default::default()) } }
    }

    /// A service feeding `pool` under `trust` (identity, scope, ownership, caps, counters).
    pub fn with_trust(pool: Arc<Pool>, trust: Trust) -> IngestService {
        IngestService { pool, trust }
    }

    /// The tonic server for this service, accepting messages up to [`MAX_MESSAGE_BYTES`].
    pub fn into_server(self) -> AgentIngestServer<IngestService> {
        AgentIngestServer::new(self).max_decoding_message_size(MAX_MESSAGE_BYTES)
    }
}

type ReportStream = Pin<Box<dyn Stream<Item = Result<PickerMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl AgentIngest for IngestService {
    type ReportStream = ReportStream;

    async fn report(&self, request: Request<Streaming<AgentMessage>>) -> Result<Response<ReportStream>, Status> {
        let peer = request.remote_addr().map(|a| a.to_string()).unwrap_or_default();
        let request_ip = request.remote_addr().map(|a| a.ip().to_string()).unwrap_or_default();
        let leaf = request.peer_certs().and_then(|c| c.first().cloned());
        let token_node = match &self.trust.tokens {
            Some(verifier) => {
                let refuse = |reason: Refusal, detail: &dyn std::fmt::Display| {
                    self.trust.refusals.refuse(reason, &request_ip, "", detail);
                };
                let Some(token) = token::bearer(request.metadata()) else {
                    refuse(Refusal::NoToken, &"stream without authorization: Bearer <ServiceAccount token>");
                    return Err(Status::unauthenticated("a ServiceAccount token (authorization: Bearer) is required"));
                };
                match verifier.verify(token).await {
                    Ok(pod) => {
                        debug!(pod = %pod.pod, node = %pod.node, "agent token verified");
                        Some(pod.node)
                    }
                    Err(e) => {
                        refuse(e.reason, &e.detail);
                        return Err(if e.reason == Refusal::TokenReviewUnavailable {
                            Status::unavailable("the agent's token cannot be verified now; retry")
                        } else {
                            Status::unauthenticated(format!("agent token refused: {}", e.reason.as_str()))
                        });
                    }
                }
            }
            None => None,
        };
        if self.trust.mtls && leaf.is_none() {
            // Unreachable through the mTLS listener (the handshake requires a certificate).
            self.trust.refusals.refuse(
                Refusal::NoClientCertificate,
                &request_ip,
                "",
                &"stream without a client certificate",
            );
            return Err(Status::unauthenticated("client certificate required"));
        }
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(RESPONSE_QUEUE);
        let stream = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        let mut session = Session::new(self.pool.clone(), stream, tx);
        session.trust = Some(self.trust.clone());
        session.leaf = leaf;
        session.token_node = token_node;
        // Refusals are logged once per (reason, peer IP), not per connection.
        session.peer = request_ip;
        tokio::spawn(session.run(inbound, peer));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

#[derive(Debug, Default)]
struct PodSeq {
    /// This stream holds the pod's claim ([`guard::Claims`]).
    held: bool,
    /// Last applied seq; `None` until a snapshot arrived on this stream.
    last: Option<u64>,
    /// Last seq acknowledged.
    acked: Option<u64>,
    /// When a resync was last requested (while waiting for the snapshot).
    resync_at: Option<Instant>,
}

/// One agent stream.
struct Session {
    pool: Arc<Pool>,
    stream: StreamId,
    tx: mpsc::Sender<PickerMessage>,
    pods: HashMap<String, PodSeq>,
    since_ack: u64,
    last_ack: Instant,
    /// `None` only in unit tests of the sequence logic.
    trust: Option<Trust>,
    /// The client certificate (mTLS).
    leaf: Option<rustls_pki_types::CertificateDer<'static>>,
    /// The node of the pod whose token opened the stream (token identity).
    token_node: Option<String>,
    /// The node of the accepted `Hello`.
    node: Option<String>,
    peer: String,
}

impl Session {
    fn new(pool: Arc<Pool>, stream: StreamId, tx: mpsc::Sender<PickerMessage>) -> Session {
        Session {
            pool,
            stream,
            tx,
            pods: HashMap::new(),
            since_ack: 0,
            last_ack: Instant::now(),
            trust: None,
            leaf: None,
            token_node: None,
            node: None,
            peer: String::new(),
        }
    }

    async fn run(mut self, mut inbound: Streaming<AgentMessage>, peer: String) {
        info!(stream = self.stream, %peer, "agent stream opened");
        loop {
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(status) => {
                    // Undecodable message or broken transport. tonic ends the stream after a
                    // decode error, so this is the end either way.
                    warn!(stream = self.stream, code = ?status.code(), error = %status.message(), "agent stream error");
                    break;
                }
            };
            if self.handle(msg).await.is_err() {
                warn!(stream = self.stream, "pool writer gone; dropping agent stream");
                break;
            }
            self.since_ack += 1;
            if self.since_ack >= ACK_EVERY || self.last_ack.elapsed() >= ACK_INTERVAL {
                self.ack().await;
            }
        }
        let _ = self.pool.update(PoolUpdate::StreamEnded { stream: self.stream }).await;
        if let Some(t) = &self.trust {
            t.claims.release(self.stream, self.pods.iter().filter(|(_, s)| s.held).map(|(p, _)| p.as_str()));
        }
        info!(stream = self.stream, pods = self.pods.len(), "agent stream ended");
    }

    async fn handle(&mut self, msg: AgentMessage) -> Result<(), crate::pool::PoolError> {
        match msg.msg {
            Some(agent_message::Msg::Hello(h)) => self.hello(h).await,
            // Trace spans of report processing (docs/design.md §9): snapshots at INFO, deltas at TRACE.
            Some(agent_message::Msg::Snapshot(s)) => {
                let span = tracing::info_span!("ingest.snapshot", stream = self.stream);
                tracing::Instrument::instrument(self.snapshot(s), span).await
            }
            Some(agent_message::Msg::Delta(d)) => {
                let span = tracing::trace_span!("ingest.delta", stream = self.stream, pod = %d.pod, seq = d.seq);
                tracing::Instrument::instrument(self.delta(d), span).await
            }
            None => {
                warn!(stream = self.stream, "agent message without a body: asking for a full resync");
                self.resync("", "empty AgentMessage");
                Ok(())
            }
        }
    }

    async fn hello(&mut self, h: Hello) -> Result<(), crate::pool::PoolError> {
        if h.protocol_version != 1 {
            warn!(stream = self.stream, version = h.protocol_version, agent = %h.agent_id, "unexpected protocol version; continuing as v1");
        }
        info!(stream = self.stream, agent = %h.agent_id, node = %h.node_name, pods = h.pods.len(), "agent hello");
        if !self.accept_node(&h.node_name) {
            return Ok(());
        }
        let mut pods = Vec::with_capacity(h.pods.len());
        let mut listed = std::collections::HashSet::with_capacity(h.pods.len());
        for info in h.pods {
            if let Err(e) = guard::check_info(&info) {
                self.refuse(Refusal::InvalidPodInfo, &info.pod, &e);
                continue;
            }
            if !self.admit(&info.pod, true) {
                continue;
            }
            listed.insert(info.pod.clone());
            pods.push(info);
        }
        // Pods this stream held and no longer lists have left its agent: their claims go.
        self.release_unlisted(&listed);
        self.pool.update(PoolUpdate::Hello { stream: self.stream, pods }).await
    }

    async fn snapshot(&mut self, s: PodSnapshot) -> Result<(), crate::pool::PoolError> {
        let Some(info) = s.info.filter(|i| !i.pod.is_empty() && !i.endpoint.is_empty() && !i.model.is_empty()) else {
            warn!(stream = self.stream, "snapshot without pod info (name, endpoint, model): asking for a full resync");
            self.resync("", "snapshot without pod info");
            return Ok(());
        };
        if let Err(e) = guard::check_info(&info) {
            self.refuse(Refusal::InvalidPodInfo, &info.pod, &e);
            return Ok(());
        }
        if !self.admit(&info.pod, true) {
            return Ok(());
        }
        let stats = self.checked_stats(&info.pod, s.stats);
        let blocks = flatten_runs(&s.blocks);
        debug!(stream = self.stream, pod = %info.pod, seq = s.seq, blocks = blocks.len(), "snapshot");
        let st = self.pods.entry(info.pod.clone()).or_default();
        st.last = Some(s.seq);
        st.resync_at = None;
        let pod = info.pod.clone();
        self.pool.update(PoolUpdate::Snapshot { stream: self.stream, info, seq: s.seq, stats, blocks }).await?;
        // The CPU tier is replaced as a whole too (docs/design.md §2 tiers).
        let stored = flatten_runs(&s.offloaded_blocks);
        self.pool
            .update(PoolUpdate::Offloaded { stream: self.stream, pod, cleared: true, stored, removed: Vec::new() })
            .await
    }

    async fn delta(&mut self, d: PodDelta) -> Result<(), crate::pool::PoolError> {
        // Re-scoped on every delta: a pod that left the pool (or moved off this node) is refused and
        // its claim released at once; if it comes back, its claim is taken again and, with no
        // snapshot on this stream, its next delta asks for one.
        if !self.admit(&d.pod, true) {
            return Ok(());
        }
        let st = self.pods.entry(d.pod.clone()).or_default();
        let expected = st.last.map(|l| l.wrapping_add(1));
        if expected != Some(d.seq) {
            let retry = st.resync_at.is_none_or(|t| t.elapsed() >= RESYNC_RETRY);
            let first = st.last.is_some();
            st.last = None;
            if retry {
                st.resync_at = Some(Instant::now());
                let reason = match expected {
                    Some(e) => format!("sequence gap: expected {e}, got {}", d.seq),
                    None => "delta before snapshot".to_string(),
                };
                if first {
                    warn!(stream = self.stream, pod = %d.pod, %reason, "asking for a resync");
                } else {
                    debug!(stream = self.stream, pod = %d.pod, %reason, "asking for a resync");
                }
                self.resync(&d.pod, &reason);
            }
            return Ok(());
        }
        st.last = Some(d.seq);
        let stats = self.checked_stats(&d.pod, d.stats);
        let (cleared, stored, removed) = match d.blocks {
            Some(b) => (b.cleared, flatten_runs(&b.stored), b.removed.into_iter().map(BlockHash).collect()),
            None => (false, Vec::new(), Vec::new()),
        };
        tracing::trace!(stream = self.stream, pod = %d.pod, seq = d.seq, cleared, stored = stored.len(),
            removed = removed.len(), has_stats = stats.is_some(), "delta");
        let offloaded = d.offloaded.map(|b| PoolUpdate::Offloaded {
            stream: self.stream,
            pod: d.pod.clone(),
            cleared: b.cleared,
            stored: flatten_runs(&b.stored),
            removed: b.removed.into_iter().map(BlockHash).collect(),
        });
        self.pool
            .update(PoolUpdate::Delta { stream: self.stream, pod: d.pod, seq: d.seq, cleared, stored, removed, stats })
            .await?;
        match offloaded {
            Some(u) => self.pool.update(u).await,
            None => Ok(()),
        }
    }

    fn resync(&self, pod: &str, reason: &str) {
        let msg = PickerMessage {
            msg: Some(picker_message::Msg::Resync(ResyncRequest { pod: pod.to_string(), reason: reason.to_string() })),
        };
        if self.tx.try_send(msg).is_err() {
            debug!(stream = self.stream, %pod, "response queue full or closed: resync will be re-asked");
        }
    }

    /// Acks every pod whose seq advanced, once the pool has applied what was queued.
    async fn ack(&mut self) {
        self.since_ack = 0;
        self.last_ack = Instant::now();
        if self.pool.sync().await.is_err() {
            return;
        }
        for (pod, st) in &mut self.pods {
            if let Some(seq) = st.last
                && st.acked != Some(seq)
            {
                let msg = PickerMessage { msg: Some(picker_message::Msg::Ack(Ack { pod: pod.clone(), seq })) };
                if self.tx.try_send(msg).is_ok() {
                    st.acked = Some(seq);
                }
            }
        }
    }
}

/// Trust checks of a stream (docs/design.md §14; rules in [`guard`]), kept apart from the
/// sequence logic above.
impl Session {
    /// Counts and logs a refusal concerning `pod` from this stream.
    fn refuse(&self, reason: Refusal, pod: &str, detail: &dyn std::fmt::Display) {
        if let Some(t) = &self.trust {
            t.refusals.refuse(reason, self.node.as_deref().unwrap_or(&self.peer), pod, detail);
        }
    }

    /// Takes the `Hello`'s `node` as this stream's identity if it is the node of the stream's
    /// token (token identity), the client certificate names it (mTLS), or on trust (plaintext). Otherwise the stream has no identity: its reports are
    /// refused and the pods it held are released.
    fn accept_node(&mut self, node: &str) -> bool {
        let Some(t) = &self.trust else {
            self.node = Some(node.to_string());
            return true;
        };
        if t.tokens.is_some() && self.token_node.as_deref() != Some(node) {
            let detail = format!(
                "Hello names node {node:?}; the stream's ServiceAccount token is of a pod on {:?}",
                self.token_node.as_deref().unwrap_or("")
            );
            t.refusals.refuse(Refusal::NodeNotInToken, &self.peer, "", &detail);
            self.node = None;
            self.release_unlisted(&std::collections::HashSet::new());
            return false;
        }
        if t.tokens.is_none()
            && t.mtls
            && !self.leaf.as_ref().is_some_and(|leaf| guard::certificate_names_node(leaf, node))
        {
            let detail = format!(
                "Hello names node {node:?}; the certificate does not (DNS SAN <node>{})",
                guard::AGENT_SAN_SUFFIX
            );
            t.refusals.refuse(Refusal::NodeNotInCertificate, &self.peer, "", &detail);
            self.node = None;
            self.release_unlisted(&std::collections::HashSet::new());
            return false;
        }
        if self.node.as_deref().is_some_and(|n| n != node) {
            self.release_unlisted(&std::collections::HashSet::new());
        }
        self.node = Some(node.to_string());
        true
    }

    /// Whether this stream may report `pod` now: it has an identity, the pod is in its node's
    /// scope (re-checked when `rescope`, i.e. on `Hello` and snapshots) and its claim is this
    /// stream's (claimed here if free). Refusals are counted.
    fn admit(&mut self, pod: &str, rescope: bool) -> bool {
        let Some(t) = self.trust.clone() else { return true };
        let Some(node) = self.node.clone() else {
            self.refuse(Refusal::NoHello, pod, &"report before an accepted Hello");
            return false;
        };
        let held = self.pods.get(pod).is_some_and(|s| s.held);
        if held && !rescope {
            return true;
        }
        if let Err(r) = t.scope.admits(pod, &node) {
            self.refuse(r, pod, &format_args!("pod {pod:?} is not the node {node:?}'s to report"));
            if held {
                t.claims.release(self.stream, [pod]);
                if let Some(s) = self.pods.get_mut(pod) {
                    s.held = false;
                    s.last = None;
                }
            }
            return false;
        }
        if held {
            return true;
        }
        let count = self.pods.values().filter(|s| s.held).count();
        match t.claims.claim(pod, self.stream, count) {
            Ok(_) => {
                self.pods.entry(pod.to_string()).or_default().held = true;
                true
            }
            Err(r) => {
                self.refuse(r, pod, &format_args!("claim of pod {pod:?} refused"));
                false
            }
        }
    }

    /// Releases the claims of held pods not in `listed`.
    fn release_unlisted(&mut self, listed: &std::collections::HashSet<String>) {
        let gone: Vec<String> =
            self.pods.iter().filter(|(p, s)| s.held && !listed.contains(*p)).map(|(p, _)| p.clone()).collect();
        if gone.is_empty() {
            return;
        }
        if let Some(t) = &self.trust {
            t.claims.release(self.stream, gone.iter().map(String::as_str));
        }
        for p in gone {
            self.pods.remove(&p);
        }
    }

    /// `stats` if in range; otherwise `None`, counted as [`Refusal::InvalidStats`].
    fn checked_stats(
        &self,
        pod: &str,
        stats: Option<kvroute_proto::agent::v1::PodStats>,
    ) -> Option<kvroute_proto::agent::v1::PodStats> {
        let s = stats?;
        match guard::check_stats(&s) {
            Ok(()) => Some(s),
            Err(e) => {
                self.refuse(Refusal::InvalidStats, pod, &e);
                None
            }
        }
    }
}

/// One agent stream's handling driven without a network: each message goes through the same
/// checks, sequence rules and pool updates as a message read from a `Report` stream, and the
/// picker's replies (Acks, resync requests) are returned. For fuzzing (`fuzz/`) and tests.
#[doc(hidden)]
pub struct StreamDriver {
    session: Session,
    replies: mpsc::Receiver<PickerMessage>,
}

impl StreamDriver {
    /// A new stream feeding `pool`.
    pub fn new(pool: Arc<Pool>) -> StreamDriver {
        let (tx, replies) = mpsc::channel(RESPONSE_QUEUE);
        let stream = NEXT_STREAM.fetch_add(1, Ordering::Relaxed);
        StreamDriver { session: Session::new(pool, stream, tx), replies }
    }

    /// Handles `msg` as the stream would (an Ack round every [`ACK_EVERY`] messages included);
    /// returns the replies it queued.
    pub async fn feed(&mut self, msg: AgentMessage) -> Result<Vec<PickerMessage>, crate::pool::PoolError> {
        self.session.handle(msg).await?;
        self.session.since_ack += 1;
        if self.session.since_ack >= ACK_EVERY {
            self.session.ack().await;
        }
        let mut out = Vec::new();
        while let Ok(m) = self.replies.try_recv() {
            out.push(m);
        }
        Ok(out)
    }

    /// Ends the stream as a disconnect would (its pods enter the grace period).
    pub async fn end(self) -> Result<(), crate::pool::PoolError> {
        self.session.pool.update(PoolUpdate::StreamEnded { stream: self.session.stream }).await
    }
}

/// Flattens block runs into hashes (the hashes are chained already: the index needs no parents).
fn flatten_runs(runs: &[BlockRun]) -> Vec<BlockHash> {
    runs.iter().flat_map(|r| r.hashes.iter().map(|h| BlockHash(*h))).collect()
}

#[cfg(test)]
mod tests;
