//! The agent's own Prometheus metrics and its HTTP listener (`/metrics`, `/healthz`).
//!
//! Metric handles are created once at start and shared (`Arc<AgentMetrics>`); prometheus-client
//! metrics are atomics, so the ZMQ threads and tokio tasks update them without locks. The
//! registry is only read by the HTTP handler.

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// Label set: `[("pod", name)]` or `[("picker", endpoint)]`.
pub type Labels = Vec<(String, String)>;

/// Every metric the agent exports.
pub struct AgentMetrics {
    registry: Registry,
    /// KV-event batches received over SUB, per pod.
    pub kv_events_received: Family<Labels, Counter>,
    /// KV-event batches recovered through replay, per pod.
    pub kv_events_replayed: Family<Labels, Counter>,
    /// Blocks dropped (unknown parent, opaque extra keys, short token ids, record full), per pod.
    pub kv_blocks_dropped: Family<Labels, Counter>,
    /// Block events applied (blocks named by `BlockStored` and `BlockRemoved`, any medium), per
    /// pod: the agent's work, which its CPU use follows.
    pub kv_block_events: Family<Labels, Counter>,
    /// Malformed KV-event messages, per pod.
    pub kv_events_malformed: Family<Labels, Counter>,
    /// KV events skipped inside batches that were otherwise kept, per pod and `reason`
    /// (`unknown_type`: a type this agent does not know, e.g. from a newer vLLM; `unreadable`:
    /// a store whose fields could not be read; `untrusted`: an unreadable removal or a payload
    /// cut short, which cleared the pod's record).
    pub kv_events_skipped: Family<Labels, Counter>,
    /// Times the pod's record was cleared because events were lost or the engine restarted.
    pub kv_resyncs: Family<Labels, Counter>,
    /// Failed engine scrapes (`/metrics`, `/health`, `/v1/models`), per pod.
    pub scrape_errors: Family<Labels, Counter>,
    /// Current health score [0,1], per pod.
    pub health_score: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Requests waiting in the engine's queue (`vllm:num_requests_waiting`), per pod.
    pub requests_waiting: Family<Labels, Gauge>,
    /// Requests the engine is running (`vllm:num_requests_running`), per pod.
    pub requests_running: Family<Labels, Gauge>,
    /// The engine's KV-cache usage (`vllm:kv_cache_usage_perc`), [0,1], per pod.
    pub kv_cache_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    /// GPU utilization reported for the pod (max over its GPUs), [0,1], per pod.
    pub gpu_utilization: Family<Labels, Gauge<f64, AtomicU64>>,
    /// 1 while the engine answers `/health` and serves its model, else 0, per pod.
    pub engine_ready: Family<Labels, Gauge>,
    /// Time from a delta's creation to the picker's Ack of it, ms, per picker (last value).
    pub report_lag_ms: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Picker stream (re)connections, per picker.
    pub picker_connects: Family<Labels, Counter>,
    /// Engines the agent serves now.
    pub engines: Gauge,
    /// Engine set changes, per `change` (`added`, `removed`, `restarted`).
    pub engine_changes: Family<Labels, Counter>,
    /// Picker report streams the agent keeps now (one per picker replica).
    pub picker_streams: Gauge,
    /// Picker report streams open now (connected, snapshots sent); `/healthz` is 503 at 0.
    pub pickers_connected: Gauge,
}

/// `[("model_server_pod", pod)]`: GIE's label for the model-server pod. Not `pod`: a Prometheus
/// Operator scrape sets `pod` to the agent's own pod and renames a clashing exposed `pod` label to
/// `exported_pod`.
pub fn pod_label(pod: &str) -> Labels {
    vec![("model_server_pod".into(), pod.into())]
}

/// `[("pod", pod), ("reason", reason)]`.
pub fn pod_reason_labels(pod: &str, reason: &str) -> Labels {
    vec![("pod".into(), pod.into()), ("reason".into(), reason.into())]
}

impl AgentMetrics {
    /// Creates and registers every metric (prefix `kvroute_agent_`).
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("kvroute_agent");
        let m = Self {
            kv_events_received: Family::default(),
            kv_events_replayed: Family::default(),
            kv_blocks_dropped: Family::default(),
            kv_block_events: Family::default(),
            kv_events_malformed: Family::default(),
            kv_events_skipped: Family::default(),
            kv_resyncs: Family::default(),
            scrape_errors: Family::default(),
            health_score: Family::default(),
            requests_waiting: Family::default(),
            requests_running: Family::default(),
            kv_cache_usage: Family::default(),
            gpu_utilization: Family::default(),
            engine_ready: Family::default(),
            report_lag_ms: Family::default(),
            picker_connects: Family::default(),
            engines: Gauge::default(),
            engine_changes: Family::default(),
            picker_streams: Gauge::default(),
            pickers_connected: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("kv_event_batches_received", "KV-event batches received", m.kv_events_received.clone());
        registry.register(
            "kv_event_batches_replayed",
            "KV-event batches recovered by replay",
            m.kv_events_replayed.clone(),
        );
        registry.register(
            "kv_blocks_dropped",
            "Blocks that could not be placed in a chain",
            m.kv_blocks_dropped.clone(),
        );
        registry.register(
            "kv_block_events",
            "Blocks named by applied BlockStored and BlockRemoved events",
            m.kv_block_events.clone(),
        );
        registry.register("kv_events_malformed", "Undecodable KV-event messages", m.kv_events_malformed.clone());
        registry.register(
            "kv_events_skipped",
            "KV events skipped in kept batches, by reason (unknown_type, unreadable, untrusted)",
            m.kv_events_skipped.clone(),
        );
        registry.register(
            "kv_resyncs",
            "Pod records cleared after lost events or engine restart",
            m.kv_resyncs.clone(),
        );
        registry.register("scrape_errors", "Failed engine HTTP scrapes", m.scrape_errors.clone());
        registry.register("health_score", "Pod health score [0,1]", m.health_score.clone());
        registry.register(
            "requests_waiting",
            "Requests waiting in the engine's queue (vllm:num_requests_waiting)",
            m.requests_waiting.clone(),
        );
        registry.register(
            "requests_running",
            "Requests the engine is running (vllm:num_requests_running)",
            m.requests_running.clone(),
        );
        registry.register(
            "kv_cache_usage",
            "Engine KV-cache usage [0,1] (vllm:kv_cache_usage_perc)",
            m.kv_cache_usage.clone(),
        );
        registry.register(
            "gpu_utilization",
            "GPU utilization reported for the pod, max over its GPUs [0,1]",
            m.gpu_utilization.clone(),
        );
        registry.register(
            "engine_ready",
            "1 while the engine answers /health and serves its model",
            m.engine_ready.clone(),
        );
        registry.register("report_lag_ms", "Delta creation to picker Ack, ms", m.report_lag_ms.clone());
        registry.register("picker_connects", "Picker stream connections", m.picker_connects.clone());
        registry.register("engines", "Engines served now", m.engines.clone());
        registry.register("engine_changes", "Engines added, removed or restarted", m.engine_changes.clone());
        registry.register("picker_streams", "Picker report streams open or opening", m.picker_streams.clone());
        registry.register(
            "pickers_connected",
            "Picker report streams connected now (0: the agent reaches no picker)",
            m.pickers_connected.clone(),
        );
        Arc::new(Self { registry, ..m })
    }

    /// Drops every series of engine `pod` (it stopped): with pods coming and going, series of
    /// gone pods would otherwise pile up for the agent's life.
    pub fn forget_pod(&self, pod: &str) {
        let l = pod_label(pod);
        for f in [
            &self.kv_events_received,
            &self.kv_events_replayed,
            &self.kv_blocks_dropped,
            &self.kv_block_events,
            &self.kv_events_malformed,
            &self.kv_resyncs,
            &self.scrape_errors,
        ] {
            f.remove(&l);
        }
        for f in [&self.requests_waiting, &self.requests_running, &self.engine_ready] {
            f.remove(&l);
        }
        for f in [&self.health_score, &self.kv_cache_usage, &self.gpu_utilization] {
            f.remove(&l);
        }
    }

    /// Text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// The HTTP router: `/metrics`, `/healthz` (200 while at least one picker stream is
    /// connected, else 503 naming the problem: the readiness probe) and `/livez` (200 while the
    /// process serves: the liveness probe, so a picker outage does not restart every agent).
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/metrics", get(metrics))
            .route("/healthz", get(healthz))
            .route("/livez", get(|| async { "ok" }))
            .with_state(self.clone())
    }
}

async fn healthz(State(m): State<Arc<AgentMetrics>>) -> (StatusCode, String) {
    health_of(&m)
}

/// `/healthz`'s answer: whether the agent reaches a picker.
fn health_of(m: &AgentMetrics) -> (StatusCode, String) {
    match m.pickers_connected.get() {
        n if n > 0 => (StatusCode::OK, format!("ok: {n} picker stream(s) connected\n")),
        _ => {
            (StatusCode::SERVICE_UNAVAILABLE, "no picker stream connected: see the agent's log for the cause\n".into())
        }
    }
}

async fn metrics(State(m): State<Arc<AgentMetrics>>) -> impl IntoResponse {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], m.encode())
}

/// Counts one connected picker stream in [`AgentMetrics::pickers_connected`] while alive.
pub struct PickerConnected<'a>(&'a AgentMetrics);

impl<'a> PickerConnected<'a> {
    /// A stream just connected.
    pub fn new(m: &'a AgentMetrics) -> Self {
        m.pickers_connected.inc();
        Self(m)
    }
}

impl Drop for PickerConnected<'_> {
    fn drop(&mut self) {
        self.0.pickers_connected.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dashboard's agent panels (deploy/observability/grafana-dashboard.json) query only
    /// families this exposition has, by the per-pod label it uses.
    #[test]
    fn dashboard_agent_panels_query_exported_families() {
        let m = AgentMetrics::new();
        // Labelled families show their samples once a pod has one.
        let l = pod_label("engine-0");
        m.scrape_errors.get_or_create(&l).inc();
        m.kv_resyncs.get_or_create(&l).inc();
        m.health_score.get_or_create(&l).set(1.0);
        let text = m.encode();
        assert!(text.contains("kvroute_agent_health_score{model_server_pod=\"engine-0\"}"), "{text}");
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/observability/grafana-dashboard.json");
        let dashboard: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("dashboard")).expect("json");
        let mut queried = 0;
        for panel in dashboard["panels"].as_array().expect("panels") {
            for t in panel["targets"].as_array().expect("targets") {
                let expr = t["expr"].as_str().expect("expr");
                for (i, _) in expr.match_indices("kvroute_agent_") {
                    let name: String =
                        expr[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    let sample = text.lines().any(|l| !l.starts_with('#') && l.starts_with(&name));
                    assert!(sample, "dashboard queries {name}, which the agent does not export: {text}");
                    queried += 1;
                }
            }
        }
        assert!(queried >= 4, "the dashboard has agent panels");
    }

    #[test]
    fn healthz_reflects_picker_streams() {
        let m = AgentMetrics::new();
        assert_eq!(health_of(&m).0, StatusCode::SERVICE_UNAVAILABLE);
        let open = PickerConnected::new(&m);
        assert_eq!(health_of(&m).0, StatusCode::OK);
        drop(open);
        assert_eq!(health_of(&m).0, StatusCode::SERVICE_UNAVAILABLE);
    }
}
