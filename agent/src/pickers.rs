//! The picker replicas the agent reports to (docs/design.md §14): a static list, or every
//! replica behind the picker's headless Service, from its EndpointSlices. Each replica gets its
//! own report stream with the full state (`Hello`, every pod's snapshot, then deltas; see
//! [`crate::report::stream`]); streams open and close as replicas come and go, so scaling the
//! pickers needs no agent change.
//!
//! Replicas are dialed whether Ready or not, unless terminating: a starting picker is not Ready
//! until agents have reported to it (docs/design.md §14, "Readiness"). A replica that leaves the
//! slices has its stream closed cleanly (queued deltas sent, then the request stream ended).
//!
//! Concurrency: one task owns the set of stream tasks (one per replica), each stopped through its
//! own watch channel; the agent's stop stops them all.

use crate::report::hub::Hub;
use crate::report::stream::{AgentIdentity, run_picker_stream};
use crate::telemetry::AgentMetrics;
use kvroute_cluster::{ReplicaView, Watched};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where the replicas come from, at run time.
pub(crate) enum Replicas {
    /// Fixed endpoints (`http://host:port`).
    Static(Vec<String>),
    /// The picker Service's EndpointSlices.
    Service(Watched<ReplicaView>),
}

/// The endpoints to stream to, from a replica view.
fn endpoints(view: &ReplicaView) -> Vec<String> {
    view.dialable().map(|r| format!("http://{}", r.addr)).collect()
}

/// Runs one report stream per replica until `stop` turns true.
pub(crate) async fn run_picker_set(
    replicas: Replicas,
    hub: Arc<Hub>,
    id: AgentIdentity,
    metrics: Arc<AgentMetrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut streams: BTreeMap<String, (watch::Sender<bool>, JoinHandle<()>)> = BTreeMap::new();
    let mut view_rx = match &replicas {
        Replicas::Static(_) => None,
        Replicas::Service(w) => Some(w.subscribe()),
    };
    let mut open = true;
    loop {
        let desired: Vec<String> = match (&replicas, &mut view_rx) {
            (Replicas::Static(list), _) => list.clone(),
            (_, Some(rx)) => endpoints(&rx.borrow_and_update()),
            (_, None) => Vec::new(),
        };
        let gone: Vec<String> = streams.keys().filter(|e| !desired.contains(e)).cloned().collect();
        for endpoint in gone {
            if let Some((stop_one, _)) = streams.remove(&endpoint) {
                tracing::info!(picker = %endpoint, "picker replica gone: closing its stream");
                let _ = stop_one.send(true);
            }
        }
        for endpoint in desired {
            if streams.contains_key(&endpoint) {
                continue;
            }
            tracing::info!(picker = %endpoint, "picker replica found: opening a stream");
            let (stop_one, stop_rx) = watch::channel(false);
            let task =
                tokio::spawn(run_picker_stream(endpoint.clone(), hub.clone(), id.clone(), metrics.clone(), stop_rx));
            streams.insert(endpoint, (stop_one, task));
        }
        // Streams closed above end on their own (bounded by their close grace).
        metrics.picker_streams.set(streams.len() as i64);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            changed = async {
                match &mut view_rx {
                    Some(rx) => rx.changed().await,
                    None => std::future::pending().await,
                }
            }, if open => {
                if changed.is_err() {
                    tracing::warn!("picker replica watch stopped; keeping the current streams");
                    open = false;
                }
            }
        }
    }
    for (_, (stop_one, _)) in streams.iter() {
        let _ = stop_one.send(true);
    }
    for (_, (_, task)) in streams {
        let _ = task.await;
    }
}
