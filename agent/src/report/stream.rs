//! One task per picker: connect (jittered exponential backoff 100 ms → 400 ms), open `Report`,
//! send `Hello` and a `PodSnapshot` per pod, then forward every pod's deltas. When pods come or
//! go (their engines started or stopped with their Kubernetes pods or engine-file entries), the
//! stream sends a fresh `Hello` listing the agent's pods now (a pod missing from it has left;
//! its last delta, just before, cleared its blocks and marked it not ready) and the snapshots
//! of the new ones. A `ResyncRequest` gets fresh snapshots; a broadcast lag (this stream fell
//! too far behind) resends `Hello` and all snapshots;
//! a stream error reconnects and starts over with snapshots. On shutdown the stream sends the
//! deltas already queued for it, ends its request stream (an orderly HTTP/2 close the picker
//! sees as the agent leaving) and waits up to [`CLOSE_GRACE`] for the picker to end its side.
//!
//! Concurrency: the task owns its stream; it reads pod state only through [`Hub`] snapshots
//! (short mutex sections, never across an await).

use super::hub::{Hub, Outgoing, Pod};
use crate::telemetry::AgentMetrics;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{AgentMessage, Hello, PickerMessage, PodDelta, agent_message, picker_message};
use rand::Rng;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

/// Errors of one stream attempt (logged, then the task reconnects).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReportError {
    /// Could not connect.
    #[error("connect to picker {endpoint}: {source}")]
    Connect {
        /// Picker endpoint.
        endpoint: String,
        /// Transport error.
        source: tonic::transport::Error,
    },
    /// The RPC failed.
    #[error("picker {endpoint} stream: {source}")]
    Rpc {
        /// Picker endpoint.
        endpoint: String,
        /// gRPC status.
        source: tonic::Status,
    },
    /// The picker closed the stream.
    #[error("picker {0} closed the stream")]
    Closed(String),
    /// The token file holds no token (empty, or over [`crate::config::MAX_PICKER_TOKEN_BYTES`],
    /// or not ASCII).
    #[error("token file {path}: {what}")]
    Token {
        /// The file.
        path: String,
        /// What is wrong.
        what: String,
    },
    /// The TLS or token files could not be read.
    #[error("TLS file {path}: {source}")]
    TlsFile {
        /// The file.
        path: String,
        /// I/O error.
        source: std::io::Error,
    },
}

/// Identity sent in `Hello`.
#[derive(Debug, Clone)]
pub struct AgentIdentity {
    /// `<node>-<pid>`.
    pub agent_id: String,
    /// Node name.
    pub node_name: String,
    /// TLS towards the pickers (`None`: plaintext, `insecure_ingest`).
    pub tls: Option<Arc<crate::config::PickerTlsConfig>>,
    /// The ServiceAccount token sent when a stream opens (token identity).
    pub token: Option<Arc<crate::config::PickerTokenConfig>>,
}

/// HTTP/2 keepalive PING interval on a picker connection, idle or not.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// How long a PING may go unanswered before the connection (and the stream) is dropped and the
/// agent reconnects: a SIGSTOPped or partitioned picker, whose kernel still ACKs TCP, is seen as
/// dead within [`KEEPALIVE_INTERVAL`] + this (docs/decisions/0024-bounded-outside-input.md).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest TCP connect to a picker.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The connection settings of a picker stream: HTTP/2 keepalive both ways (the picker PINGs too,
/// `picker/src/limits.rs`) and a connect deadline.
fn picker_endpoint(endpoint: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::new(endpoint.to_string())?
        .connect_timeout(CONNECT_TIMEOUT)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .tcp_nodelay(true))
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// A restarted picker routes on a fresh index only once its agents have reconnected and replayed
/// their pods: at most 400 ms between dials keeps that within 1 s of its start (a refused dial
/// costs next to nothing, even from every node to every replica).
const BACKOFF_MAX: Duration = Duration::from_millis(400);
/// How long a closing stream waits for the picker to end its side after ours ended.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Runs until `shutdown` becomes true.
pub async fn run_picker_stream(
    endpoint: String,
    hub: Arc<Hub>,
    id: AgentIdentity,
    metrics: Arc<AgentMetrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut backoff = BACKOFF_MIN;
    loop {
        let started = Instant::now();
        // stream_once watches `shutdown` itself, to close an open stream cleanly.
        if let Err(e) = stream_once(&endpoint, &hub, &id, &metrics, shutdown.clone()).await {
            tracing::warn!(picker = %endpoint, error = %e, "picker stream ended");
        }
        if *shutdown.borrow() {
            return;
        }
        if started.elapsed() > Duration::from_secs(10) {
            backoff = BACKOFF_MIN;
        }
        let jitter = rand::rng().random_range(0.5..1.0);
        let wait = backoff.mul_f64(jitter);
        backoff = (backoff * 2).min(BACKOFF_MAX);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}

/// What one stream has told its picker about each pod: the seq of the snapshot sent and the
/// info version it described.
type Sent = HashMap<String, (u64, u64)>;

/// Snapshots of the `pods` that `only` names ("" or `None`: all), recorded in `sent`.
fn snapshot_msgs(pods: &[Arc<Pod>], only: Option<&str>, sent: &mut Sent) -> Vec<AgentMessage> {
    // Trace span of a report (docs/design.md §9): snapshots at INFO, each delta at TRACE (see below).
    let _span = tracing::info_span!("agent.report.snapshots", pod = only.unwrap_or("")).entered();
    pods.iter()
        .filter(|p| only.is_none_or(|o| o.is_empty() || o == p.name()))
        .map(|p| {
            let (snap, version) = p.versioned_snapshot();
            sent.insert(p.name().to_string(), (snap.seq, version));
            AgentMessage { msg: Some(agent_message::Msg::Snapshot(snap)) }
        })
        .collect()
}

/// `Hello` listing `pods`.
fn hello_msg(pods: &[Arc<Pod>], id: &AgentIdentity) -> AgentMessage {
    let hello = Hello {
        agent_id: id.agent_id.clone(),
        node_name: id.node_name.clone(),
        protocol_version: 1,
        pods: pods.iter().map(|p| p.info()).collect(),
    };
    AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }
}

/// `Hello` and every pod's snapshot, from one copy of the pod list; `sent` starts over.
fn full_msgs(hub: &Hub, id: &AgentIdentity, sent: &mut Sent) -> Vec<AgentMessage> {
    let pods = hub.pods();
    sent.clear();
    let mut out = vec![hello_msg(&pods, id)];
    out.extend(snapshot_msgs(&pods, None, sent));
    out
}

/// After [`Outgoing::Members`]: when the pod list or a pod's info differs from what this stream
/// described, a fresh `Hello` (the whole list: a pod missing from it has left this agent) and
/// the snapshots of pods that are new or changed. Forgets pods that left.
fn membership_msgs(hub: &Hub, id: &AgentIdentity, sent: &mut Sent) -> Vec<AgentMessage> {
    let pods = hub.pods();
    let before = sent.len();
    sent.retain(|name, _| pods.iter().any(|p| p.name() == name));
    let mut changed = sent.len() != before;
    let mut out = Vec::new();
    for p in pods.iter() {
        if sent.get(p.name()).is_some_and(|(_, v)| *v == p.info_version()) {
            continue;
        }
        changed = true;
        out.extend(snapshot_msgs(std::slice::from_ref(p), None, sent));
    }
    if changed {
        out.insert(0, hello_msg(&pods, id));
    }
    out
}

/// The token in `token.token_file`, read now (the kubelet rewrites it before it expires), as the
/// value of gRPC metadata `authorization`.
fn bearer(
    token: &crate::config::PickerTokenConfig,
) -> Result<tonic::metadata::MetadataValue<tonic::metadata::Ascii>, ReportError> {
    use std::io::Read as _;
    let path = &token.token_file;
    let io = |source| ReportError::TlsFile { path: path.clone(), source };
    let what = |what: String| ReportError::Token { path: path.clone(), what };
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(io)?
        .take(crate::config::MAX_PICKER_TOKEN_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > crate::config::MAX_PICKER_TOKEN_BYTES {
        return Err(what(format!("over {} bytes", crate::config::MAX_PICKER_TOKEN_BYTES)));
    }
    let text = text.trim();
    if text.is_empty() {
        return Err(what("empty".into()));
    }
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(what("not a printable ASCII token".into()));
    }
    format!("Bearer {text}").parse().map_err(|_| what("not a printable ASCII token".into()))
}

/// A client of `endpoint`: plaintext, or TLS with `tls` (files read now, so a rotated
/// certificate or CA bundle is used from this connection on; the scheme becomes `https`),
/// presenting the agent's certificate when `tls` names one.
async fn connect(
    endpoint: &str,
    tls: Option<&crate::config::PickerTlsConfig>,
) -> Result<AgentIngestClient<tonic::transport::Channel>, ReportError> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let err = |source| ReportError::Connect { endpoint: endpoint.into(), source };
    let Some(tls) = tls else {
        let channel = picker_endpoint(endpoint).map_err(err)?.connect().await.map_err(err)?;
        return Ok(AgentIngestClient::new(channel));
    };
    let read = |path: &str| std::fs::read(path).map_err(|source| ReportError::TlsFile { path: path.into(), source });
    // A bundle of several CAs (a rotation's overlap) adds each of them.
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(&tls.ca_file)?))
        .domain_name(tls.server_name.clone());
    if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
        config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
    }
    let url = match endpoint.strip_prefix("http://") {
        Some(rest) => format!("https://{rest}"),
        None => endpoint.to_string(),
    };
    let channel = picker_endpoint(&url).map_err(err)?.tls_config(config).map_err(err)?.connect().await.map_err(err)?;
    Ok(AgentIngestClient::new(channel))
}

/// The `Report` request over `messages`, carrying `authorization` when set.
fn report_request<T>(
    messages: T,
    authorization: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
) -> tonic::Request<T> {
    let mut request = tonic::Request::new(messages);
    if let Some(value) = authorization {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

async fn stream_once(
    endpoint: &str,
    hub: &Arc<Hub>,
    id: &AgentIdentity,
    metrics: &AgentMetrics,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), ReportError> {
    let authorization = id.token.as_deref().map(bearer).transpose()?;
    let connect = connect(endpoint, id.tls.as_deref());
    let mut client = tokio::select! {
        c = connect => c?,
        () = stopped(&mut shutdown) => return Ok(()),
    };
    let picker_label = vec![("picker".to_string(), endpoint.to_string())];
    metrics.picker_connects.get_or_create(&picker_label).inc();
    // Subscribe before the snapshots: deltas numbered after a snapshot are then never missed.
    let mut deltas = hub.subscribe();
    let (out, out_rx) = mpsc::channel::<AgentMessage>(1024);
    let mut sent: Sent = HashMap::new();
    let closed = || ReportError::Closed(endpoint.to_string());
    for m in full_msgs(hub, id, &mut sent) {
        out.send(m).await.map_err(|_| closed())?;
    }
    let rpc = |source| ReportError::Rpc { endpoint: endpoint.into(), source };
    let mut inbound = tokio::select! {
        r = client.report(report_request(ReceiverStream::new(out_rx), authorization)) => r.map_err(rpc)?.into_inner(),
        () = stopped(&mut shutdown) => return Ok(()),
    };
    tracing::info!(picker = %endpoint, pods = sent.len(), "picker stream open, snapshots sent");
    let _connected = crate::telemetry::PickerConnected::new(metrics);
    let mut in_flight: HashMap<String, (u64, Instant)> = HashMap::new();
    // A delta goes out only for a pod this stream described, and only past that snapshot.
    let wanted = |sent: &Sent, d: &PodDelta| sent.get(&d.pod).is_some_and(|(s, _)| d.seq > *s);
    loop {
        tokio::select! {
            () = stopped(&mut shutdown) => {
                // Send what is already queued for this picker, then end our side cleanly.
                while let Ok(o) = deltas.try_recv() {
                    let msgs = match &*o {
                        Outgoing::Delta { delta, .. } if wanted(&sent, delta) => {
                            vec![AgentMessage { msg: Some(agent_message::Msg::Delta(delta.clone())) }]
                        }
                        Outgoing::Delta { .. } => continue,
                        Outgoing::Members => membership_msgs(hub, id, &mut sent),
                    };
                    for msg in msgs {
                        if out.send(msg).await.is_err() {
                            break;
                        }
                    }
                }
                drop(out);
                let _ = tokio::time::timeout(CLOSE_GRACE, async {
                    while let Ok(Some(_)) = inbound.message().await {}
                })
                .await;
                tracing::info!(picker = %endpoint, "picker stream closed for shutdown");
                return Ok(());
            }
            d = deltas.recv() => match d {
                Ok(o) => match &*o {
                    Outgoing::Delta { delta, created } => {
                        if !wanted(&sent, delta) {
                            continue;
                        }
                        in_flight.entry(delta.pod.clone()).or_insert((delta.seq, *created));
                        let msg = AgentMessage { msg: Some(agent_message::Msg::Delta(delta.clone())) };
                        let span = tracing::trace_span!("agent.report.delta", pod = %delta.pod, seq = delta.seq);
                        tracing::Instrument::instrument(out.send(msg), span).await.map_err(|_| closed())?;
                    }
                    Outgoing::Members => {
                        let msgs = membership_msgs(hub, id, &mut sent);
                        if !msgs.is_empty() {
                            tracing::info!(picker = %endpoint, pods = sent.len(), "pods changed: Hello and snapshots resent");
                        }
                        in_flight.retain(|pod, _| sent.contains_key(pod));
                        for m in msgs {
                            out.send(m).await.map_err(|_| closed())?;
                        }
                    }
                },
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(picker = %endpoint, skipped = n, "stream fell behind; resending Hello and snapshots");
                    for m in full_msgs(hub, id, &mut sent) {
                        out.send(m).await.map_err(|_| closed())?;
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            m = inbound.message() => match m.map_err(rpc)? {
                None => return Err(closed()),
                Some(PickerMessage { msg: Some(picker_message::Msg::Resync(r)) }) => {
                    tracing::info!(picker = %endpoint, pod = %r.pod, reason = %r.reason, "resync requested");
                    for m in snapshot_msgs(&hub.pods(), Some(&r.pod), &mut sent) {
                        out.send(m).await.map_err(|_| closed())?;
                    }
                }
                Some(PickerMessage { msg: Some(picker_message::Msg::Ack(a)) }) => {
                    if let Some((seq, created)) = in_flight.get(&a.pod).copied() && a.seq >= seq {
                        in_flight.remove(&a.pod);
                        metrics.report_lag_ms.get_or_create(&picker_label).set(created.elapsed().as_secs_f64() * 1e3);
                    }
                }
                Some(PickerMessage { msg: None }) => {}
            },
        }
    }
}

/// Resolves once shutdown is requested (or its sender is gone); holds no guard across awaits.
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::{MAX_PICKER_TOKEN_BYTES, PickerTokenConfig};

    #[test]
    fn the_token_file_is_read_again_for_every_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let config = PickerTokenConfig { token_file: path.display().to_string() };
        std::fs::write(&path, "first.token\n").unwrap();
        assert_eq!(bearer(&config).unwrap(), "Bearer first.token");
        // The kubelet rewrites the file before the token expires.
        std::fs::write(&path, "second.token").unwrap();
        assert_eq!(bearer(&config).unwrap(), "Bearer second.token");
        for bad in ["".to_string(), " \n".into(), "x".repeat(MAX_PICKER_TOKEN_BYTES as usize + 1), "é".into()] {
            std::fs::write(&path, &bad).unwrap();
            assert!(matches!(bearer(&config), Err(ReportError::Token { .. })), "{bad:?}");
        }
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(bearer(&config), Err(ReportError::TlsFile { .. })));
    }
}
