//! One task per picker: connect (jittered exponential backoff 100 ms → 5 s), open `Report`,
//! send `Hello` and a `PodSnapshot` per pod, then forward every pod's deltas. A `ResyncRequest`
//! gets fresh snapshots; a broadcast lag (this stream fell too far behind) resends all snapshots;
//! a stream error reconnects and starts over with snapshots. On shutdown the stream sends the
//! deltas already queued for it, ends its request stream (an orderly HTTP/2 close the picker
//! sees as the agent leaving) and waits up to [`CLOSE_GRACE`] for the picker to end its side.
//!
//! Concurrency: the task owns its stream; it reads pod state only through [`Hub`] snapshots
//! (short mutex sections, never across an await).

use super::hub::{Hub, Outgoing};
use crate::telemetry::AgentMetrics;
use kvroute_proto::agent::v1::agent_ingest_client::AgentIngestClient;
use kvroute_proto::agent::v1::{AgentMessage, Hello, PickerMessage, agent_message, picker_message};
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
}

/// Identity sent in `Hello`.
#[derive(Debug, Clone)]
pub struct AgentIdentity {
    /// `<node>-<pid>`.
    pub agent_id: String,
    /// Node name.
    pub node_name: String,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
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

fn snapshot_msgs(hub: &Hub, only: Option<&str>, sent: &mut HashMap<String, u64>) -> Vec<AgentMessage> {
    // Trace span of a report (docs/design.md §9): snapshots at INFO, each delta at TRACE (see below).
    let _span = tracing::info_span!("agent.report.snapshots", pod = only.unwrap_or("")).entered();
    hub.pods()
        .iter()
        .filter(|p| only.is_none_or(|o| o.is_empty() || o == p.name()))
        .map(|p| {
            let snap = p.snapshot();
            sent.insert(p.name().to_string(), snap.seq);
            AgentMessage { msg: Some(agent_message::Msg::Snapshot(snap)) }
        })
        .collect()
}

async fn stream_once(
    endpoint: &str,
    hub: &Arc<Hub>,
    id: &AgentIdentity,
    metrics: &AgentMetrics,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), ReportError> {
    let connect = AgentIngestClient::connect(endpoint.to_string());
    let mut client = tokio::select! {
        c = connect => c.map_err(|source| ReportError::Connect { endpoint: endpoint.into(), source })?,
        () = stopped(&mut shutdown) => return Ok(()),
    };
    let picker_label = vec![("picker".to_string(), endpoint.to_string())];
    metrics.picker_connects.get_or_create(&picker_label).inc();
    // Subscribe before the snapshots: deltas numbered after a snapshot are then never missed.
    let mut deltas = hub.subscribe();
    let (out, out_rx) = mpsc::channel::<AgentMessage>(1024);
    let mut snap_seq: HashMap<String, u64> = HashMap::new();
    let hello = Hello {
        agent_id: id.agent_id.clone(),
        node_name: id.node_name.clone(),
        protocol_version: 1,
        pods: hub.pods().iter().map(|p| p.info()).collect(),
    };
    let closed = || ReportError::Closed(endpoint.to_string());
    out.send(AgentMessage { msg: Some(agent_message::Msg::Hello(hello)) }).await.map_err(|_| closed())?;
    for m in snapshot_msgs(hub, None, &mut snap_seq) {
        out.send(m).await.map_err(|_| closed())?;
    }
    let rpc = |source| ReportError::Rpc { endpoint: endpoint.into(), source };
    let mut inbound = tokio::select! {
        r = client.report(ReceiverStream::new(out_rx)) => r.map_err(rpc)?.into_inner(),
        () = stopped(&mut shutdown) => return Ok(()),
    };
    tracing::info!(picker = %endpoint, pods = hub.pods().len(), "picker stream open, snapshots sent");
    let mut in_flight: HashMap<String, (u64, Instant)> = HashMap::new();
    loop {
        tokio::select! {
            () = stopped(&mut shutdown) => {
                // Send what is already queued for this picker, then end our side cleanly.
                while let Ok(o) = deltas.try_recv() {
                    if snap_seq.get(&o.delta.pod).is_some_and(|s| o.delta.seq <= *s) {
                        continue;
                    }
                    let msg = AgentMessage { msg: Some(agent_message::Msg::Delta(o.delta.clone())) };
                    if out.send(msg).await.is_err() {
                        break;
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
                Ok(o) => {
                    let o: &Outgoing = &o;
                    if snap_seq.get(&o.delta.pod).is_some_and(|s| o.delta.seq <= *s) {
                        continue;
                    }
                    in_flight.entry(o.delta.pod.clone()).or_insert((o.delta.seq, o.created));
                    let msg = AgentMessage { msg: Some(agent_message::Msg::Delta(o.delta.clone())) };
                    let span = tracing::trace_span!("agent.report.delta", pod = %o.delta.pod, seq = o.delta.seq);
                    tracing::Instrument::instrument(out.send(msg), span).await.map_err(|_| closed())?;
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(picker = %endpoint, skipped = n, "stream fell behind; resending snapshots");
                    for m in snapshot_msgs(hub, None, &mut snap_seq) {
                        out.send(m).await.map_err(|_| closed())?;
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            m = inbound.message() => match m.map_err(rpc)? {
                None => return Err(closed()),
                Some(PickerMessage { msg: Some(picker_message::Msg::Resync(r)) }) => {
                    tracing::info!(picker = %endpoint, pod = %r.pod, reason = %r.reason, "resync requested");
                    for m in snapshot_msgs(hub, Some(&r.pod), &mut snap_seq) {
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
